/* core/h5.c — HDF5 files: create/open (a handle -> path table so every message names the file),
 * datasets written from raw memory or tensors (bf16 kept as u16 + attribute uly_dtype="bf16"),
 * hyperslab reads converted to any dtype by HDF5's own conversion, a sorted recursive listing,
 * string and f64 attributes, and uly_file_commit (fsync + rename + fsync of the directory) for
 * atomic replacement, which works without HDF5.
 *
 * HDF5's own error printing is switched off; our messages name the file, the dataset, shapes and
 * dtypes, and append HDF5's innermost message where it explains more. Built without HDF5, every
 * uly_h5_* function exists and fails with a clear message. Like HDF5 itself (non-threadsafe
 * build), call these from one thread at a time. */
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "internal.h"

/* ---- atomic commit: no HDF5 needed ---- */
static int commit_error(const char *what, const char *path, int err) {
    return uly_set_error("uly_file_commit: cannot %s '%s': %s", what, path, strerror(err));
}

static int fsync_path(const char *path, int flags, int is_dir) {
    int fd = open(path, flags);
    if (fd < 0) return commit_error(is_dir ? "open the directory" : "open", path, errno);
    if (fsync(fd) != 0 && !(is_dir && errno == EINVAL)) { /* some file systems cannot sync a directory */
        int err = errno;
        close(fd);
        return commit_error(is_dir ? "fsync the directory" : "fsync", path, err);
    }
    close(fd);
    return 0;
}

/* where a save to `path` must land: the path itself when it is missing or a regular file, the
 * target of a symbolic link (so the link stays a link), an error for anything else (a directory,
 * a device such as /dev/full, a pipe), which a rename over it would replace */
int uly_file_destination(const char *path, char *out, int64_t out_len) {
    if (!path || !*path || !out || out_len < 2) return uly_set_error("uly_file_destination: no path or buffer given");
    struct stat st;
    const char *use = path;
    char real[PATH_MAX];
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
        if (!realpath(path, real))
            return uly_set_error("'%s' is a symbolic link to a missing file (%s): save to the target's path, or remove "
                                 "the link", path, strerror(errno));
        use = real;
        if (stat(use, &st) != 0) return uly_set_error("cannot stat '%s': %s", use, strerror(errno));
    } else if (lstat(path, &st) != 0) {
        if (errno != ENOENT) return uly_set_error("cannot stat '%s': %s", path, strerror(errno));
        st.st_mode = S_IFREG;   /* missing: a new file */
    }
    if (S_ISDIR(st.st_mode))
        return uly_set_error("'%s' is a directory: give the path of a file inside it (e.g. %s/step.h5)", use, use);
    if (!S_ISREG(st.st_mode))
        return uly_set_error("'%s' is not a regular file (a device, pipe or socket), which saving would replace: give "
                             "the path of a file", use);
    if ((int64_t)strlen(use) + 1 > out_len) return uly_set_error("uly_file_destination: path too long: %s", use);
    memcpy(out, use, strlen(use) + 1);
    return 0;
}

int uly_file_commit(const char *tmp_path, const char *final_path) {
    if (!tmp_path || !final_path || !*tmp_path || !*final_path)
        return uly_set_error("uly_file_commit: both the temporary and the final path must be given");
    if (fsync_path(tmp_path, O_RDONLY, 0)) return -1;
    if (rename(tmp_path, final_path) != 0)
        return uly_set_error("uly_file_commit: cannot rename '%s' to '%s': %s%s", tmp_path, final_path, strerror(errno),
                             errno == EXDEV ? " (both must be on one file system)" : "");
    char dir[4096];
    const char *slash = strrchr(final_path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == final_path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - final_path), final_path);
    return fsync_path(dir, O_RDONLY | O_DIRECTORY, 1);
}

#ifdef ULY_WITH_HDF5
#include <hdf5.h>

/* HDF5 1.12 renamed the object-info calls (tokens instead of addresses) */
#if H5_VERSION_GE(1, 12, 0)
typedef H5O_info2_t obj_info;
#define OBJ_INFO_BY_NAME(loc, name, info) H5Oget_info_by_name3(loc, name, info, H5O_INFO_BASIC, H5P_DEFAULT)
#define OBJ_VISIT(obj, cb, data) H5Ovisit3(obj, H5_INDEX_NAME, H5_ITER_INC, cb, data, H5O_INFO_BASIC)
#else
typedef H5O_info_t obj_info;
#define OBJ_INFO_BY_NAME(loc, name, info) H5Oget_info_by_name2(loc, name, info, H5O_INFO_BASIC, H5P_DEFAULT)
#define OBJ_VISIT(obj, cb, data) H5Ovisit2(obj, H5_INDEX_NAME, H5_ITER_INC, cb, data, H5O_INFO_BASIC)
#endif

#define BF16_ATTR "uly_dtype"

/* HDF5's innermost error message (where the failure was detected). Every HDF5 call clears the
 * error stack, so note_failure() copies it right after the failing call; h5_detail() gives it. */
static _Thread_local char detail[440];

static herr_t first_error(unsigned n, const H5E_error2_t *e, void *data) {
    if (n == 0 && e->desc) snprintf((char *)data, sizeof detail - 20, "%s", e->desc);
    return 0;
}
static void note_failure(void) {
    char buf[sizeof detail - 20];
    buf[0] = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, first_error, buf);
    if (buf[0]) snprintf(detail, sizeof detail, " (HDF5: %s)", buf);
}
static const char *h5_detail(void) { return detail; }

/* ---- open files: handle -> path ---- */
typedef struct { hid_t id; char *path; } open_file;
static open_file *files;
static int n_files, cap_files;

static void drop_file(int i);

/* files whose H5Fclose failed (a full disk while flushing): HDF5 keeps them half-open, and its own
 * exit-time cleanup crashes closing them again, so the library's cleanup is ours (h5_at_exit) */
static int failed_closes;

static void h5_at_exit(void) {
    while (n_files > 0) {   /* files the program left open: flushed and closed */
        H5Fclose(files[n_files - 1].id);
        drop_file(n_files - 1);
    }
    if (!failed_closes) H5close();
}

static void h5_init(void) {
    static int done;
    if (!done) {
        H5dont_atexit();   /* before any other HDF5 call; h5_at_exit instead */
        H5open();
        H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
        atexit(h5_at_exit);
        done = 1;
    }
}

static int add_file(hid_t id, const char *path) {
    if (n_files == cap_files) {
        int cap = cap_files ? 2 * cap_files : 16;
        open_file *grown = realloc(files, (size_t)cap * sizeof *files);
        if (!grown) return uly_set_error("uly_h5: out of memory for the table of open files");
        files = grown;
        cap_files = cap;
    }
    char *copy = strdup(path);
    if (!copy) return uly_set_error("uly_h5: out of memory for the table of open files");
    files[n_files++] = (open_file){id, copy};
    return 0;
}

static int find_file(int64_t file) {
    for (int i = 0; i < n_files; i++)
        if (files[i].id == (hid_t)file) return i;
    return -1;
}

static void drop_file(int i) {
    free(files[i].path);
    files[i] = files[--n_files];
    if (n_files == 0) {
        free(files);
        files = NULL;
        cap_files = 0;
    }
}

/* the path of an open handle, or NULL with an error */
static const char *file_path(const char *op, int64_t file) {
    h5_init();
    detail[0] = 0;
    int i = find_file(file);
    if (i < 0) {
        uly_set_error("%s: %lld is not an open HDF5 file handle (already closed, or not from uly_h5_open/uly_h5_create)",
                      op, (long long)file);
        return NULL;
    }
    return files[i].path;
}

/* paths inside the file are taken without leading '/' ("" is the root group) */
static const char *rel(const char *name) {
    if (!name) return "";
    while (*name == '/') name++;
    return name;
}

/* ---- dtypes ---- */
static const char *dtype_str(int dtype) { return dtype == ULY_H5_U8 ? "u8" : uly_dtype_name(dtype); }

static int valid_dtype(int dtype) {
    return dtype == ULY_H5_U8 || (dtype >= ULY_DTYPE_F32 && dtype <= ULY_DTYPE_F64);
}

static int64_t dtype_bytes(int dtype) { return dtype == ULY_H5_U8 ? 1 : uly_dtype_size(dtype); }

static hid_t mem_type(int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return H5T_NATIVE_FLOAT;
    case ULY_DTYPE_BF16: return H5T_NATIVE_UINT16;
    case ULY_DTYPE_I32: return H5T_NATIVE_INT32;
    case ULY_DTYPE_I64: return H5T_NATIVE_INT64;
    case ULY_DTYPE_F64: return H5T_NATIVE_DOUBLE;
    default: return H5T_NATIVE_UINT8;
    }
}

static hid_t disk_type(int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return H5T_IEEE_F32LE;
    case ULY_DTYPE_BF16: return H5T_STD_U16LE;
    case ULY_DTYPE_I32: return H5T_STD_I32LE;
    case ULY_DTYPE_I64: return H5T_STD_I64LE;
    case ULY_DTYPE_F64: return H5T_IEEE_F64LE;
    default: return H5T_STD_U8LE;
    }
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* keep NaN quiet */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static int read_string_attr(hid_t obj, const char *key, char *buf, int64_t buflen, int64_t *needed);

/* ---- checksums: every dataset written carries one of its bytes (uly_checksum, 16 hex digits),
 * which reading a whole dataset into a tensor of its dtype verifies, so a corrupted file is an
 * error naming the dataset instead of silently wrong weights. 64-bit, word at a time. */
#define CHECKSUM_ATTR "uly_checksum"

static uint64_t bytes_checksum(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    h ^= h >> 32;
    return h * 0xbf58476d1ce4e5b9ULL;
}

/* 1 when a dataset carries uly_dtype = "bf16" */
static int is_bf16(hid_t dset) {
    if (H5Aexists(dset, BF16_ATTR) <= 0) return 0;
    char v[16];
    int64_t need = 0;
    return read_string_attr(dset, BF16_ATTR, v, sizeof v, &need) == 0 && need <= (int64_t)sizeof v &&
           !strcmp(v, "bf16");
}

/* our dtype code for a dataset's stored type; -1 for types we do not read (strings, compounds) */
static int dataset_dtype(hid_t dset) {
    hid_t t = H5Dget_type(dset);
    if (t < 0) return -1;
    H5T_class_t cls = H5Tget_class(t);
    size_t size = H5Tget_size(t);
    int is_unsigned = H5Tget_sign(t) == H5T_SGN_NONE;
    H5Tclose(t);
    if (cls == H5T_FLOAT) return size <= 4 ? ULY_DTYPE_F32 : ULY_DTYPE_F64;
    if (cls != H5T_INTEGER) return -1;
    if (size == 1 && is_unsigned) return ULY_H5_U8;
    if (size == 2 && is_unsigned && is_bf16(dset)) return ULY_DTYPE_BF16;
    if (size < 4 || (size == 4 && !is_unsigned)) return ULY_DTYPE_I32;
    return ULY_DTYPE_I64;
}

/* ---- objects inside a file ---- */
/* 1 when `name` resolves to an object, 0 when not (no intermediate group may be missing) */
static int object_exists(hid_t fid, const char *name) {
    name = rel(name);
    if (!*name) return 1;
    size_t len = strlen(name);
    char *p = malloc(len + 1);
    if (!p) return uly_set_error("uly_h5: out of memory");
    memcpy(p, name, len + 1);
    int found = 1;
    for (size_t i = 1; i <= len && found; i++) {
        if (p[i] != '/' && p[i] != 0) continue;
        char c = p[i];
        p[i] = 0;
        found = H5Lexists(fid, p, H5P_DEFAULT) > 0 && H5Oexists_by_name(fid, p, H5P_DEFAULT) > 0;
        p[i] = c;
    }
    free(p);
    return found;
}

/* 1 dataset, 2 group, 3 other, 0 absent */
static int object_kind(hid_t fid, const char *name) {
    if (object_exists(fid, name) <= 0) return 0;
    obj_info info;
    if (OBJ_INFO_BY_NAME(fid, *rel(name) ? rel(name) : "/", &info) < 0) return 0;
    return info.type == H5O_TYPE_DATASET ? 1 : info.type == H5O_TYPE_GROUP ? 2 : 3;
}

static hid_t open_dataset(const char *op, int64_t file, const char *path, const char *name) {
    if (!name || !*rel(name)) {
        uly_set_error("%s: no dataset name given (file %s)", op, path);
        return -1;
    }
    int kind = object_kind((hid_t)file, name);
    if (kind != 1) {
        if (kind == 0)
            uly_set_error("%s: dataset '%s' not found in %s (list what it holds with f:list() or h5ls -r)", op,
                          rel(name), path);
        else
            uly_set_error("%s: '%s' in %s is a %s, not a dataset", op, rel(name), path, kind == 2 ? "group" : "named type");
        return -1;
    }
    hid_t d = H5Dopen2((hid_t)file, rel(name), H5P_DEFAULT);
    if (d < 0) note_failure();
    if (d < 0) uly_set_error("%s: cannot open dataset '%s' in %s%s", op, rel(name), path, h5_detail());
    return d;
}

static int check_writable(const char *op, int64_t file, const char *path) {
    unsigned intent = 0;
    if (H5Fget_intent((hid_t)file, &intent) < 0 || !(intent & H5F_ACC_RDWR))
        return uly_set_error("%s: %s is open read-only; open it writable (uly_h5_open(path, 1), Lua mode 'r+')", op, path);
    return 0;
}

/* ---- files ---- */
static hid_t strong_close_fapl(void) {
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl >= 0) H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG); /* closing the file closes what is open in it */
    return fapl;
}

int64_t uly_h5_create(const char *path) {
    h5_init();
    detail[0] = 0;
    if (!path || !*path) return uly_set_error("uly_h5_create: no path given");
    hid_t fapl = strong_close_fapl();
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    if (f < 0) note_failure();
    H5Pclose(fapl);
    if (f < 0)
        return uly_set_error("uly_h5_create: cannot create %s (does the directory exist and is it writable? is the "
                             "file open elsewhere?)%s", path, h5_detail());
    if (add_file(f, path)) {
        H5Fclose(f);
        return -1;
    }
    return (int64_t)f;
}

int64_t uly_h5_open(const char *path, int writable) {
    h5_init();
    detail[0] = 0;
    if (!path || !*path) return uly_set_error("uly_h5_open: no path given");
    struct stat st;
    if (stat(path, &st) != 0) return uly_set_error("uly_h5_open: cannot open %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return uly_set_error("uly_h5_open: %s is a directory, not an HDF5 file", path);
    int fd = open(path, writable ? O_RDWR : O_RDONLY);
    if (fd < 0) return uly_set_error("uly_h5_open: cannot open %s: %s", path, strerror(errno));
    close(fd);
    if (H5Fis_hdf5(path) <= 0)
        return uly_set_error("uly_h5_open: %s is not an HDF5 file (or is truncated/corrupt)", path);
    hid_t fapl = strong_close_fapl();
    hid_t f = H5Fopen(path, writable ? H5F_ACC_RDWR : H5F_ACC_RDONLY, fapl);
    if (f < 0) note_failure();
    H5Pclose(fapl);
    if (f < 0)
        return uly_set_error("uly_h5_open: cannot open %s: not a readable HDF5 file (truncated/corrupt, or locked "
                             "by a writer)%s", path, h5_detail());
    if (add_file(f, path)) {
        H5Fclose(f);
        return -1;
    }
    return (int64_t)f;
}

int uly_h5_close(int64_t file) {
    const char *path = file_path("uly_h5_close", file);
    if (!path) return -1;
    int i = find_file(file);
    herr_t rc = H5Fclose((hid_t)file);
    if (rc < 0) failed_closes++;
    if (rc < 0) note_failure();
    if (rc < 0) uly_set_error("uly_h5_close: closing %s failed; data may not be complete on disk%s", path, h5_detail());
    drop_file(i);
    return rc < 0 ? -1 : 0;
}

/* 1 when `name` is an object in the file (a dataset or a group), 0 when not */
int uly_h5_exists(int64_t file, const char *name) {
    if (!file_path("uly_h5_exists", file)) return -1;
    return object_exists((hid_t)file, name) > 0 ? 1 : 0;
}

/* ---- listing ---- */
typedef struct { char **names; int n, cap; const char *prefix; int failed; } name_list;

static herr_t collect_dataset(hid_t obj, const char *name, const obj_info *info, void *data) {
    name_list *l = data;
    if (info->type != H5O_TYPE_DATASET || !strcmp(name, ".")) return 0;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        char **grown = realloc(l->names, (size_t)cap * sizeof *grown);
        if (!grown) { l->failed = 1; return -1; }
        l->names = grown;
        l->cap = cap;
    }
    size_t len = strlen(l->prefix) + strlen(name) + 2;
    char *s = malloc(len);
    if (!s) { l->failed = 1; return -1; }
    snprintf(s, len, "%s%s%s", l->prefix, *l->prefix ? "/" : "", name);
    l->names[l->n++] = s;
    return 0;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every dataset under `group` ("" or "/" = the whole file), recursively, as full paths without the
 * leading '/', sorted by strcmp, one per line. Returns 0 with the listing in buf; when buf is NULL or
 * buflen is smaller than the listing plus its NUL, returns that needed size (> 0) and writes nothing:
 * call once with (NULL, 0), allocate, call again. -1 on error. */
int uly_h5_list(int64_t file, const char *group, char *buf, int64_t buflen) {
    const char *path = file_path("uly_h5_list", file);
    if (!path) return -1;
    const char *g = rel(group);
    int kind = object_kind((hid_t)file, g);
    if (kind != 2)
        return uly_set_error("uly_h5_list: %s '%s' in %s", kind == 0 ? "no group" : "not a group:", g, path);
    hid_t gid = H5Oopen((hid_t)file, *g ? g : "/", H5P_DEFAULT);
    if (gid < 0) note_failure();
    if (gid < 0) return uly_set_error("uly_h5_list: cannot open group '%s' in %s%s", g, path, h5_detail());
    name_list l = {NULL, 0, 0, g, 0};
    herr_t rc = OBJ_VISIT(gid, collect_dataset, &l);
    if (rc < 0) note_failure();
    H5Oclose(gid);
    int result = 0;
    if (rc < 0 || l.failed) {
        result = uly_set_error("uly_h5_list: walking group '%s' in %s failed%s", g, path,
                               l.failed ? ": out of memory" : h5_detail());
    } else {
        if (l.n > 1) qsort(l.names, (size_t)l.n, sizeof *l.names, cmp_names);
        int64_t need = 1;
        for (int i = 0; i < l.n; i++) need += (int64_t)strlen(l.names[i]) + (i ? 1 : 0);
        if (!buf || buflen < need) {
            result = need > INT32_MAX ? uly_set_error("uly_h5_list: listing of %s is too long", path) : (int)need;
        } else {
            char *p = buf;
            for (int i = 0; i < l.n; i++) {
                if (i) *p++ = '\n';
                size_t len = strlen(l.names[i]);
                memcpy(p, l.names[i], len);
                p += len;
            }
            *p = 0;
        }
    }
    for (int i = 0; i < l.n; i++) free(l.names[i]);
    free(l.names);
    return result;
}

/* ---- shape and dtype ---- */
static int dataset_shape(hid_t dset, int *ndim, hsize_t *dims) {
    hid_t space = H5Dget_space(dset);
    if (space < 0) return -1;
    int rank = H5Sget_simple_extent_ndims(space);
    if (rank >= 0 && rank <= ULY_MAX_DIMS) H5Sget_simple_extent_dims(space, dims, NULL);
    H5Sclose(space);
    *ndim = rank;
    return rank < 0 ? -1 : 0;
}

static const char *hshape_str(int ndim, const hsize_t *dims) {
    int64_t s[ULY_MAX_DIMS];
    for (int d = 0; d < ndim && d < ULY_MAX_DIMS; d++) s[d] = (int64_t)dims[d];
    return uly_shape_str(ndim < ULY_MAX_DIMS ? ndim : ULY_MAX_DIMS, s);
}

/* opens the dataset and reads rank, dims and dtype, with messages naming all three */
static hid_t describe(const char *op, int64_t file, const char *path, const char *name, int *ndim, hsize_t *dims,
                      int *dtype) {
    hid_t d = open_dataset(op, file, path, name);
    if (d < 0) return -1;
    const char *why = NULL;
    if (dataset_shape(d, ndim, dims) < 0) why = "its dataspace cannot be read";
    else if (*ndim > ULY_MAX_DIMS) why = "it has more than 8 dimensions";
    else if ((*dtype = dataset_dtype(d)) < 0) why = "its element type is not a number (string, compound, ...)";
    if (why) {
        uly_set_error("%s: dataset '%s' in %s cannot be used: %s", op, rel(name), path, why);
        H5Dclose(d);
        return -1;
    }
    return d;
}

/* rank, shape and dtype code: ULY_H5_U8 for u8, BF16 for u16 tagged uly_dtype="bf16", other integers
 * as I32 (<= 32 bits signed, <= 16 unsigned) or I64, floats as F32 (<= 32 bits) or F64 */
int uly_h5_info(int64_t file, const char *name, int *ndim, int64_t *shape, int *dtype) {
    const char *path = file_path("uly_h5_info", file);
    if (!path) return -1;
    int nd, dt;
    hsize_t dims[ULY_MAX_DIMS];
    hid_t d = describe("uly_h5_info", file, path, name, &nd, dims, &dt);
    if (d < 0) return -1;
    H5Dclose(d);
    if (ndim) *ndim = nd;
    for (int i = 0; shape && i < nd; i++) shape[i] = (int64_t)dims[i];
    if (dtype) *dtype = dt;
    return 0;
}

/* ---- writing ---- */
static int write_string_attr(hid_t obj, const char *key, const char *value);

int uly_h5_write(int64_t file, const char *name, const void *data, int dtype, int ndim, const int64_t *shape) {
    const char *op = "uly_h5_write";
    const char *path = file_path(op, file);
    if (!path) return -1;
    if (!name || !*rel(name)) return uly_set_error("%s: no dataset name given (file %s)", op, path);
    name = rel(name);
    if (!valid_dtype(dtype))
        return uly_set_error("%s: dataset '%s': unknown dtype code %d (use f32, bf16, i32, i64, f64 or u8)", op, name, dtype);
    if (ndim < 0 || ndim > ULY_MAX_DIMS || (ndim > 0 && !shape))
        return uly_set_error("%s: dataset '%s': %d dimensions given; 0 to 8 with a shape are supported", op, name, ndim);
    hsize_t dims[ULY_MAX_DIMS];
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return uly_set_error("%s: dataset '%s': negative size in shape %s", op, name, uly_shape_str(ndim, shape));
        dims[i] = (hsize_t)shape[i];
        numel *= shape[i];
    }
    if (numel > 0 && !data) return uly_set_error("%s: dataset '%s': data pointer is NULL", op, name);
    if (check_writable(op, file, path)) return -1;
    if (object_exists((hid_t)file, name) > 0)
        return uly_set_error("%s: '%s' already exists in %s (datasets are written once: pick a new name or create "
                             "a new file)", op, name, path);

    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    hid_t space = ndim ? H5Screate_simple(ndim, dims, NULL) : H5Screate(H5S_SCALAR);
    hid_t d = H5Dcreate2((hid_t)file, name, disk_type(dtype), space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
    if (d < 0) note_failure();
    H5Sclose(space);
    H5Pclose(lcpl);
    if (d < 0)
        return uly_set_error("%s: cannot create dataset '%s' %s%s in %s (is a parent path a dataset?)%s", op, name,
                             dtype_str(dtype), uly_shape_str(ndim, shape), path, h5_detail());
    int rc = 0;
    if (numel > 0 && H5Dwrite(d, mem_type(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0 && (note_failure(), 1))
        rc = uly_set_error("%s: writing dataset '%s' %s%s to %s failed (disk full?)%s", op, name, dtype_str(dtype),
                           uly_shape_str(ndim, shape), path, h5_detail());
    if (!rc && dtype == ULY_DTYPE_BF16 && write_string_attr(d, BF16_ATTR, "bf16") < 0)
        rc = uly_set_error("%s: cannot tag dataset '%s' in %s as bf16%s", op, name, path, h5_detail());
    if (!rc) {
        char hex[24];
        snprintf(hex, sizeof hex, "%016llx",
                 (unsigned long long)bytes_checksum(data, numel > 0 ? (size_t)(numel * dtype_bytes(dtype)) : 0));
        if (write_string_attr(d, CHECKSUM_ATTR, hex) < 0)
            rc = uly_set_error("%s: cannot store the checksum of dataset '%s' in %s%s", op, name, path, h5_detail());
    }
    H5Dclose(d);
    if (rc) H5Ldelete((hid_t)file, name, H5P_DEFAULT); /* leave no half-written dataset behind */
    return rc;
}

int uly_h5_write_tensor(int64_t file, const char *name, const uly_tensor *t) {
    if (!file_path("uly_h5_write_tensor", file)) return -1;
    if (uly_check_tensor("uly_h5_write_tensor", "tensor", t)) return -1;
    uly_tensor *c = NULL; /* contiguous on the host (a device tensor is copied over) */
    if (t->storage->device == ULY_DEVICE_CPU) c = uly_contiguous_raw((uly_tensor *)t);
    else if ((c = uly_new_contiguous(t->ndim, t->shape, t->dtype, ULY_DEVICE_CPU)) && uly_copy_raw(c, t)) {
        uly_tensor_release(c);
        c = NULL;
    }
    if (!c) return -1;
    int rc = uly_h5_write(file, name, uly_ptr(c), c->dtype, c->ndim, c->shape);
    uly_tensor_release(c);
    return rc;
}

/* ---- reading ---- */
/* read n elements of the selection (mspace/fspace) into out as out_dtype; bf16 is converted here,
 * everything else by HDF5 */
static herr_t read_converted(hid_t d, int file_dtype, hid_t mspace, hid_t fspace, int64_t n, void *out, int out_dtype) {
    if (file_dtype == ULY_DTYPE_BF16 && out_dtype != ULY_DTYPE_BF16) {
        int64_t esize = dtype_bytes(out_dtype) > 4 ? dtype_bytes(out_dtype) : 4;
        char *tmp = malloc((size_t)(n * esize));
        if (!tmp) return -2;
        herr_t rc = H5Dread(d, H5T_NATIVE_UINT16, mspace, fspace, H5P_DEFAULT, tmp);
        if (rc < 0) note_failure();
        if (rc >= 0) {
            for (int64_t i = n - 1; i >= 0; i--) ((float *)tmp)[i] = bf16_to_f32(((uint16_t *)tmp)[i]); /* in place, backwards */
            if (out_dtype != ULY_DTYPE_F32)
                rc = H5Tconvert(H5T_NATIVE_FLOAT, mem_type(out_dtype), (size_t)n, tmp, NULL, H5P_DEFAULT);
            if (rc < 0) note_failure();
            if (rc >= 0) memcpy(out, tmp, (size_t)(n * dtype_bytes(out_dtype)));
        }
        free(tmp);
        return rc;
    }
    if (out_dtype == ULY_DTYPE_BF16 && file_dtype != ULY_DTYPE_BF16) {
        float *tmp = malloc((size_t)n * sizeof(float));
        if (!tmp) return -2;
        herr_t rc = H5Dread(d, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, tmp);
        if (rc < 0) note_failure();
        if (rc >= 0)
            for (int64_t i = 0; i < n; i++) ((uint16_t *)out)[i] = f32_to_bf16(tmp[i]);
        free(tmp);
        return rc;
    }
    herr_t rc = H5Dread(d, mem_type(out_dtype), mspace, fspace, H5P_DEFAULT, out);
    if (rc < 0) note_failure();
    return rc;
}

/* checks a slab against the dataset's dims and selects it; returns its element count or -1 */
static int64_t select_slab(const char *op, const char *path, const char *name, hid_t fspace, int rank,
                           const hsize_t *dims, int ndim, const int64_t *start, const int64_t *count, hsize_t *cnt) {
    if (!start || !count)
        return uly_set_error("%s: dataset '%s' in %s: give both start and count (or neither, for the whole dataset)",
                             op, name, path);
    if (ndim != rank)
        return uly_set_error("%s: dataset '%s' in %s has %d dimensions (shape %s) but the slab has %d", op, name, path,
                             rank, hshape_str(rank, dims), ndim);
    hsize_t st[ULY_MAX_DIMS];
    int64_t n = 1;
    for (int i = 0; i < rank; i++) {
        if (start[i] < 0 || count[i] < 0 || (hsize_t)start[i] > dims[i] || (hsize_t)count[i] > dims[i] - (hsize_t)start[i])
            return uly_set_error("%s: slab start %s count %s is out of range for dataset '%s' of shape %s in %s (need "
                                 "0 <= start and start + count <= size in every dimension)", op,
                                 uly_shape_str(ndim, start), uly_shape_str(ndim, count), name, hshape_str(rank, dims), path);
        st[i] = (hsize_t)start[i];
        cnt[i] = (hsize_t)count[i];
        n *= count[i];
    }
    if (rank > 0 && H5Sselect_hyperslab(fspace, H5S_SELECT_SET, st, NULL, cnt, NULL) < 0 && (note_failure(), 1))
        return uly_set_error("%s: cannot select the slab of dataset '%s' in %s%s", op, name, path, h5_detail());
    return n;
}

static int read_dataset(const char *op, int64_t file, const char *path, const char *name, int ndim, const int64_t *start,
                        const int64_t *count, void *out, int out_dtype) {
    if (!valid_dtype(out_dtype))
        return uly_set_error("%s: dataset '%s': unknown output dtype code %d (use f32, bf16, i32, i64, f64 or u8)", op,
                             rel(name), out_dtype);
    int rank, file_dtype;
    hsize_t dims[ULY_MAX_DIMS];
    hid_t d = describe(op, file, path, name, &rank, dims, &file_dtype);
    if (d < 0) return -1;
    name = rel(name);
    hid_t fspace = H5Dget_space(d), mspace = H5S_ALL;
    int64_t n = 1;
    if (start || count) {
        hsize_t cnt[ULY_MAX_DIMS];
        n = select_slab(op, path, name, fspace, rank, dims, ndim, start, count, cnt);
        if (n > 0 && rank > 0) mspace = H5Screate_simple(rank, cnt, NULL);
    } else {
        for (int i = 0; i < rank; i++) n *= (int64_t)dims[i];
    }
    int rc = n < 0 ? -1 : 0;
    if (n > 0 && !out) rc = uly_set_error("%s: dataset '%s' in %s: output pointer is NULL", op, name, path);
    if (n > 0 && !rc) {
        herr_t r = read_converted(d, file_dtype, mspace, fspace, n, out, out_dtype);
        if (r == -2) rc = uly_set_error("%s: out of memory converting dataset '%s' of %s", op, name, path);
        else if (r < 0)
            rc = uly_set_error("%s: reading dataset '%s' %s%s from %s as %s failed (file truncated or corrupt?)%s", op,
                               name, dtype_str(file_dtype), hshape_str(rank, dims), path, dtype_str(out_dtype), h5_detail());
    }
    if (mspace != H5S_ALL) H5Sclose(mspace);
    H5Sclose(fspace);
    H5Dclose(d);
    return rc;
}

/* The slab start/count (ndim must be the dataset's rank) or, with both NULL, the whole dataset
 * (ndim ignored), into out as out_dtype (converted). Only the slab is read from the file. */
int uly_h5_read(int64_t file, const char *name, int ndim, const int64_t *start, const int64_t *count, void *out,
                int out_dtype) {
    const char *path = file_path("uly_h5_read", file);
    if (!path) return -1;
    return read_dataset("uly_h5_read", file, path, name, ndim, start, count, out, out_dtype);
}

int uly_h5_read_tensor(int64_t file, const char *name, uly_tensor *dst) {
    const char *op = "uly_h5_read_tensor";
    const char *path = file_path(op, file);
    if (!path) return -1;
    if (uly_check_tensor(op, "dst", dst)) return -1;
    if (!uly_tensor_is_contiguous(dst))
        return uly_set_error("%s: dataset '%s': the destination %s must be contiguous", op, rel(name), uly_desc(dst));
    if (uly_check_inplace(op, dst)) return -1;
    if (dst->storage->device != ULY_DEVICE_CPU) { /* read on the host, then copy over */
        uly_tensor *h = uly_new_contiguous(dst->ndim, dst->shape, dst->dtype, ULY_DEVICE_CPU);
        int rc = h ? uly_h5_read_tensor(file, name, h) : -1;
        if (!rc) rc = uly_copy_raw(dst, h);
        uly_tensor_release(h);
        if (!rc) uly_bump_version(dst);
        return rc;
    }
    int rank, file_dtype;
    hsize_t dims[ULY_MAX_DIMS];
    hid_t d = describe(op, file, path, name, &rank, dims, &file_dtype);
    if (d < 0) return -1;
    H5Dclose(d);
    int same = rank == dst->ndim;
    for (int i = 0; same && i < rank; i++) same = (int64_t)dims[i] == dst->shape[i];
    if (!same)
        return uly_set_error("%s: dataset '%s' in %s has shape %s (%s) but the destination tensor is %s", op, rel(name),
                             path, hshape_str(rank, dims), dtype_str(file_dtype), uly_desc(dst));
    if (read_dataset(op, file, path, name, 0, NULL, NULL, uly_ptr(dst), dst->dtype)) return -1;
    uly_bump_version(dst);
    if (file_dtype == dst->dtype) {   /* the bytes as stored: check them against their checksum */
        d = H5Dopen2((hid_t)file, rel(name), H5P_DEFAULT);
        char want[32] = "";
        int64_t need = 0;
        int has = d >= 0 && H5Aexists(d, CHECKSUM_ATTR) > 0 &&
                  read_string_attr(d, CHECKSUM_ATTR, want, sizeof want, &need) == 0 && need <= (int64_t)sizeof want;
        if (d >= 0) H5Dclose(d);
        char got[24];
        snprintf(got, sizeof got, "%016llx",
                 (unsigned long long)bytes_checksum(uly_ptr(dst), (size_t)uly_tensor_nbytes(dst)));
        if (has && strcmp(want, got) != 0)
            return uly_set_error("%s: dataset '%s' in %s does not match the checksum written with it (%s, read %s): "
                                 "the file is corrupt; load another copy or an older checkpoint", op, rel(name), path,
                                 want, got);
    }
    return 0;
}

/* ---- attributes ---- */
static hid_t open_object(const char *op, int64_t file, const char *path, const char *object) {
    const char *o = rel(object);
    if (object_exists((hid_t)file, o) <= 0) {
        uly_set_error("%s: no object '%s' in %s to hold attributes", op, o, path);
        return -1;
    }
    hid_t obj = H5Oopen((hid_t)file, *o ? o : "/", H5P_DEFAULT);
    if (obj < 0) note_failure();
    if (obj < 0) uly_set_error("%s: cannot open '%s' in %s%s", op, o, path, h5_detail());
    return obj;
}

static const char *obj_label(const char *object) { return *rel(object) ? rel(object) : "/"; }

static hid_t vlen_string_type(void) {
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    return t;
}

/* replace attribute `key` of obj with a new scalar one of `type`, written from `value` */
static int write_attr(hid_t obj, const char *key, hid_t type, const void *value) {
    if (H5Aexists(obj, key) > 0 && H5Adelete(obj, key) < 0) return -1;
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, key, type, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a < 0) note_failure();
    H5Sclose(space);
    if (a < 0) return -1;
    herr_t rc = H5Awrite(a, type, value);
    if (rc < 0) note_failure();
    H5Aclose(a);
    return rc < 0 ? -1 : 0;
}

static int write_string_attr(hid_t obj, const char *key, const char *value) {
    hid_t t = vlen_string_type();
    int rc = write_attr(obj, key, t, &value);
    H5Tclose(t);
    return rc;
}

/* read a scalar string attribute (variable or fixed length) into buf; *needed = strlen + 1.
 * -1: not a one-element string attribute or HDF5 failed (no message set) */
static int read_string_attr(hid_t obj, const char *key, char *buf, int64_t buflen, int64_t *needed) {
    hid_t a = H5Aopen(obj, key, H5P_DEFAULT);
    if (a < 0) return -1;
    hid_t ft = H5Aget_type(a), space = H5Aget_space(a);
    int rc = -1;
    if (ft >= 0 && space >= 0 && H5Tget_class(ft) == H5T_STRING && H5Sget_simple_extent_npoints(space) == 1) {
        hid_t mt = H5Tcopy(H5T_C_S1);
        H5Tset_cset(mt, H5Tget_cset(ft));
        char *s = NULL;
        if (H5Tis_variable_str(ft) > 0) {
            H5Tset_size(mt, H5T_VARIABLE);
            if (H5Aread(a, mt, &s) >= 0 && s) {
                *needed = (int64_t)strlen(s) + 1;
                if (buf && buflen >= *needed) memcpy(buf, s, (size_t)*needed);
                H5free_memory(s);
                rc = 0;
            }
        } else {
            size_t size = H5Tget_size(ft);
            H5Tset_size(mt, size + 1);
            H5Tset_strpad(mt, H5T_STR_NULLTERM);
            s = calloc(1, size + 1);
            if (s && H5Aread(a, mt, s) >= 0) {
                *needed = (int64_t)strlen(s) + 1;
                if (buf && buflen >= *needed) memcpy(buf, s, (size_t)*needed);
                rc = 0;
            }
            free(s);
        }
        H5Tclose(mt);
    }
    if (space >= 0) H5Sclose(space);
    if (ft >= 0) H5Tclose(ft);
    H5Aclose(a);
    return rc;
}

/* 0 absent, 1 string, 2 number, 3 other */
static int attr_kind(hid_t obj, const char *key) {
    if (H5Aexists(obj, key) <= 0) return 0;
    hid_t a = H5Aopen(obj, key, H5P_DEFAULT);
    if (a < 0) return 3;
    hid_t t = H5Aget_type(a);
    H5T_class_t cls = H5Tget_class(t);
    H5Tclose(t);
    H5Aclose(a);
    return cls == H5T_STRING ? 1 : (cls == H5T_INTEGER || cls == H5T_FLOAT) ? 2 : 3;
}

static int check_key(const char *op, const char *path, const char *key) {
    if (!key || !*key) return uly_set_error("%s: no attribute name given (file %s)", op, path);
    return 0;
}

int uly_h5_set_attr_string(int64_t file, const char *object, const char *key, const char *value) {
    const char *op = "uly_h5_set_attr_string";
    const char *path = file_path(op, file);
    if (!path || check_key(op, path, key) || check_writable(op, file, path)) return -1;
    if (!value) return uly_set_error("%s: attribute '%s': value is NULL", op, key);
    hid_t obj = open_object(op, file, path, object);
    if (obj < 0) return -1;
    int rc = write_string_attr(obj, key, value);
    H5Oclose(obj);
    if (rc) return uly_set_error("%s: cannot write attribute '%s' on '%s' in %s%s", op, key, obj_label(object), path, h5_detail());
    return 0;
}

int uly_h5_set_attr_f64(int64_t file, const char *object, const char *key, double value) {
    const char *op = "uly_h5_set_attr_f64";
    const char *path = file_path(op, file);
    if (!path || check_key(op, path, key) || check_writable(op, file, path)) return -1;
    hid_t obj = open_object(op, file, path, object);
    if (obj < 0) return -1;
    int rc = write_attr(obj, key, H5T_NATIVE_DOUBLE, &value);
    H5Oclose(obj);
    if (rc) return uly_set_error("%s: cannot write attribute '%s' on '%s' in %s%s", op, key, obj_label(object), path, h5_detail());
    return 0;
}

/* opens the object and checks the attribute is there and of the wanted kind */
static hid_t open_attr_owner(const char *op, int64_t file, const char *path, const char *object, const char *key,
                             int want) {
    if (check_key(op, path, key)) return -1;
    hid_t obj = open_object(op, file, path, object);
    if (obj < 0) return -1;
    int kind = attr_kind(obj, key);
    if (kind == want) return obj;
    H5Oclose(obj);
    static const char *kinds[] = {"absent", "a string", "a number", "neither a string nor a number"};
    if (kind == 0) uly_set_error("%s: attribute '%s' not found on '%s' in %s", op, key, obj_label(object), path);
    else uly_set_error("%s: attribute '%s' on '%s' in %s is %s, not %s", op, key, obj_label(object), path, kinds[kind],
                       kinds[want]);
    return -1;
}

int uly_h5_get_attr_string(int64_t file, const char *object, const char *key, char *buf, int64_t buflen) {
    const char *op = "uly_h5_get_attr_string";
    const char *path = file_path(op, file);
    if (!path) return -1;
    hid_t obj = open_attr_owner(op, file, path, object, key, 1);
    if (obj < 0) return -1;
    int64_t needed = 0;
    int rc = read_string_attr(obj, key, buf, buflen, &needed);
    H5Oclose(obj);
    if (rc) return uly_set_error("%s: cannot read string attribute '%s' on '%s' in %s (not a single string?)%s", op,
                                 key, obj_label(object), path, h5_detail());
    if (!buf || buflen < needed) return needed > INT32_MAX ? uly_set_error("%s: attribute '%s' is too long", op, key) : (int)needed;
    return 0;
}

int uly_h5_get_attr_f64(int64_t file, const char *object, const char *key, double *value) {
    const char *op = "uly_h5_get_attr_f64";
    const char *path = file_path(op, file);
    if (!path) return -1;
    if (!value) return uly_set_error("%s: value pointer is NULL", op);
    hid_t obj = open_attr_owner(op, file, path, object, key, 2);
    if (obj < 0) return -1;
    hid_t a = H5Aopen(obj, key, H5P_DEFAULT);
    hid_t space = a >= 0 ? H5Aget_space(a) : -1;
    int ok = space >= 0 && H5Sget_simple_extent_npoints(space) == 1 && H5Aread(a, H5T_NATIVE_DOUBLE, value) >= 0;
    if (space >= 0) H5Sclose(space);
    if (a >= 0) H5Aclose(a);
    H5Oclose(obj);
    if (!ok) return uly_set_error("%s: cannot read attribute '%s' on '%s' in %s as one number%s", op, key,
                                  obj_label(object), path, h5_detail());
    return 0;
}

int uly_h5_attr_type(int64_t file, const char *object, const char *key) {
    const char *op = "uly_h5_attr_type";
    const char *path = file_path(op, file);
    if (!path || check_key(op, path, key)) return -1;
    hid_t obj = open_object(op, file, path, object);
    if (obj < 0) return -1;
    int kind = attr_kind(obj, key);
    H5Oclose(obj);
    return kind;
}

#else /* built without HDF5: every entry point fails clearly */

static int no_hdf5(const char *op) {
    return uly_set_error("%s: libulysses was built without HDF5; install libhdf5-openmpi-dev (or libhdf5-dev) and "
                         "rebuild (cmake -DULY_HDF5=ON makes it required)", op);
}

int64_t uly_h5_create(const char *path) { return no_hdf5("uly_h5_create"); }
int64_t uly_h5_open(const char *path, int writable) { return no_hdf5("uly_h5_open"); }
int uly_h5_close(int64_t file) { return no_hdf5("uly_h5_close"); }
int uly_h5_exists(int64_t file, const char *name) { return no_hdf5("uly_h5_exists"); }
int uly_h5_list(int64_t file, const char *group, char *buf, int64_t buflen) { return no_hdf5("uly_h5_list"); }
int uly_h5_info(int64_t file, const char *name, int *ndim, int64_t *shape, int *dtype) { return no_hdf5("uly_h5_info"); }
int uly_h5_write(int64_t file, const char *name, const void *data, int dtype, int ndim, const int64_t *shape) {
    return no_hdf5("uly_h5_write");
}
int uly_h5_write_tensor(int64_t file, const char *name, const uly_tensor *t) { return no_hdf5("uly_h5_write_tensor"); }
int uly_h5_read(int64_t file, const char *name, int ndim, const int64_t *start, const int64_t *count, void *out,
                int out_dtype) {
    return no_hdf5("uly_h5_read");
}
int uly_h5_read_tensor(int64_t file, const char *name, uly_tensor *dst) { return no_hdf5("uly_h5_read_tensor"); }
int uly_h5_set_attr_string(int64_t file, const char *object, const char *key, const char *value) {
    return no_hdf5("uly_h5_set_attr_string");
}
int uly_h5_get_attr_string(int64_t file, const char *object, const char *key, char *buf, int64_t buflen) {
    return no_hdf5("uly_h5_get_attr_string");
}
int uly_h5_set_attr_f64(int64_t file, const char *object, const char *key, double value) {
    return no_hdf5("uly_h5_set_attr_f64");
}
int uly_h5_get_attr_f64(int64_t file, const char *object, const char *key, double *value) {
    return no_hdf5("uly_h5_get_attr_f64");
}
int uly_h5_attr_type(int64_t file, const char *object, const char *key) { return no_hdf5("uly_h5_attr_type"); }

#endif
