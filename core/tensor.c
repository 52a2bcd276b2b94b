/* core/tensor.c — tensor handles: creation, reference counting, metadata, strided copies with
 * dtype conversion (f32, bf16, i32, i64, f64), fill, random init and element access. */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include "internal.h"

static int64_t live_tensors;
int64_t uly_tensor_live_count(void) { return live_tensors; }

int64_t uly_numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}

static int valid_dtype(int dtype) { return dtype >= ULY_DTYPE_F32 && dtype <= ULY_DTYPE_F64; }

/* ---- creation and lifetime ---- */
static uly_tensor *alloc_handle(void) {
    uly_tensor *t = calloc(1, sizeof *t);
    if (!t) return uly_set_error_null("out of memory allocating a tensor handle");
    t->refcount = 1;
    live_tensors++;
    return t;
}

uly_tensor *uly_new_contiguous(int ndim, const int64_t *shape, int dtype, int device) {
    if (ndim < 0 || ndim > ULY_MAX_DIMS)
        return uly_set_error_null("tensor: %d dimensions requested, at most %d are supported", ndim, ULY_MAX_DIMS);
    if (!valid_dtype(dtype)) return uly_set_error_null("tensor: unknown dtype %d", dtype);
    if (ndim > 0 && !shape) return uly_set_error_null("tensor: shape is NULL");
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return uly_set_error_null("tensor: negative size %lld in dimension %d of shape %s", (long long)shape[d],
                                      d + 1, uly_shape_str(ndim, shape));
        if (shape[d] && numel > INT64_MAX / 16 / shape[d])
            return uly_set_error_null("tensor: shape %s has too many elements", uly_shape_str(ndim, shape));
        numel *= shape[d];
    }
    if (!uly_device_available(device))
        return uly_set_error_null("tensor: device '%s' is not available (no backend registered for it)", uly_device_name(device));
    uly_storage *s = calloc(1, sizeof *s);
    if (!s) return uly_set_error_null("out of memory allocating a storage handle");
    s->refcount = 1;
    s->device = device;
    s->data = uly_alloc_on(device, numel * uly_dtype_size(dtype), &s->block_bytes);
    if (!s->data) {
        free(s);
        return uly_set_error_null("tensor %s%s: %s", uly_dtype_name(dtype), uly_shape_str(ndim, shape), uly_last_error());
    }
    uly_tensor *t = alloc_handle();
    if (!t) { uly_free_on(device, s->data, s->block_bytes); free(s); return NULL; }
    t->storage = s;
    t->ndim = ndim;
    t->dtype = dtype;
    int64_t st = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        t->shape[d] = shape[d];
        t->stride[d] = st;
        st *= shape[d] ? shape[d] : 1;
    }
    return t;
}

uly_tensor *uly_new_zeros(int ndim, const int64_t *shape, int dtype, int device) {
    uly_tensor *t = uly_new_contiguous(ndim, shape, dtype, device);
    if (t) uly_be(t)->memset0(t->storage->data, uly_numel_of(ndim, shape) * uly_dtype_size(dtype));
    return t;
}

uly_tensor *uly_new_like(const uly_tensor *t) { return uly_new_contiguous(t->ndim, t->shape, t->dtype, uly_dev(t)); }

uly_tensor *uly_new_view(uly_tensor *base, int ndim, const int64_t *shape, const int64_t *stride, int64_t offset) {
    uly_tensor *t = alloc_handle();
    if (!t) return NULL;
    t->storage = base->storage;
    t->storage->refcount++;
    t->offset = offset;
    t->ndim = ndim;
    t->dtype = base->dtype;
    for (int d = 0; d < ndim; d++) { t->shape[d] = shape[d]; t->stride[d] = stride[d]; }
    return t;
}

uly_tensor *uly_tensor_empty(int ndim, const int64_t *shape, int dtype, int device) {
    if (device < 0 || device >= ULY_DEVICE_COUNT) return uly_set_error_null("tensor: unknown device %d", device);
    if (!uly_device_available(device))
        return uly_set_error_null("tensor: device 'cuda' is not available (no CUDA backend loaded: in Lua, "
                                  "uly.cuda.why() says why; uly.cuda.simulate() gives a host-memory simulation for tests)");
    return uly_new_contiguous(ndim, shape, dtype, device);
}

uly_tensor *uly_tensor_arange(double start, double end, double step, int dtype) {
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step))
        return uly_set_error_null("arange(%g, %g, %g): step must be non-zero and bounds finite", start, end, step);
    double span = ceil((end - start) / step);
    int64_t n = span > 0 ? (int64_t)span : 0;
    uly_tensor *t = uly_new_contiguous(1, &n, dtype, ULY_DEVICE_CPU);
    if (!t) return NULL;
    char *p = t->storage->data;
    int64_t es = uly_dtype_size(dtype);
    for (int64_t i = 0; i < n; i++) uly_store(p + i * es, dtype, start + (double)i * step);
    return t;
}

void uly_tensor_retain(uly_tensor *t) { if (t) t->refcount++; }

void uly_tensor_release(uly_tensor *t) {
    if (!t || --t->refcount > 0) return;
    uly_storage *s = t->storage;
    if (s && --s->refcount == 0) {
        uly_free_on(s->device, s->data, s->block_bytes);
        free(s);
    }
    uly_tensor_release(t->grad);
    uly_node_release(t->grad_fn);
    live_tensors--;
    free(t);
}

/* ---- metadata ---- */
int uly_tensor_ndim(const uly_tensor *t) { return t ? t->ndim : -1; }
int64_t uly_tensor_size(const uly_tensor *t, int dim) {
    if (!t) return uly_set_error("size: tensor is NULL");
    if (dim < 0 || dim >= t->ndim) return uly_set_error("size: dimension %d out of range for %s", dim + 1, uly_desc(t));
    return t->shape[dim];
}
int64_t uly_tensor_stride(const uly_tensor *t, int dim) {
    if (!t || dim < 0 || dim >= t->ndim) return uly_set_error("stride: dimension %d out of range for %s", dim + 1, uly_desc(t));
    return t->stride[dim];
}
int64_t uly_tensor_numel(const uly_tensor *t) { return t ? uly_numel_of(t->ndim, t->shape) : 0; }
int64_t uly_tensor_nbytes(const uly_tensor *t) { return t ? uly_tensor_numel(t) * uly_dtype_size(t->dtype) : 0; }
int uly_tensor_dtype(const uly_tensor *t) { return t ? t->dtype : -1; }
int uly_tensor_device(const uly_tensor *t) { return t ? t->storage->device : -1; }
int64_t uly_tensor_storage_offset(const uly_tensor *t) { return t ? t->offset : 0; }
void *uly_tensor_data_ptr(const uly_tensor *t) { return t ? uly_ptr(t) : NULL; }
int uly_tensor_shares_storage(const uly_tensor *a, const uly_tensor *b) { return a && b && a->storage == b->storage; }

int uly_tensor_is_contiguous(const uly_tensor *t) {
    if (!t) return 0;
    int64_t st = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->stride[d] != st) return 0;
        st *= t->shape[d];
    }
    return 1;
}

int uly_same_shape(const uly_tensor *a, const uly_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

int uly_check_tensor(const char *op, const char *arg, const uly_tensor *t) {
    if (!t) return uly_set_error("%s: argument '%s' is NULL (a freed or missing tensor)", op, arg);
    return 0;
}

int uly_check_float(const char *op, const char *arg, const uly_tensor *t) {
    if (uly_check_tensor(op, arg, t)) return -1;
    if (t->dtype != ULY_DTYPE_F32)
        return uly_set_error("%s: '%s' is %s but the %s kernel needs f32; convert with :float()", op, arg, uly_desc(t),
                             t->storage->device == ULY_DEVICE_CPU ? "CPU" : "device");
    return 0;
}

/* ops that compute in f32 and keep bf16 activations bf16: t must be f32 or bf16 */
int uly_check_floating(const char *op, const char *arg, const uly_tensor *t) {
    if (uly_check_tensor(op, arg, t)) return -1;
    if (t->dtype != ULY_DTYPE_F32 && t->dtype != ULY_DTYPE_BF16)
        return uly_set_error("%s: '%s' is %s but the op takes f32 or bf16 values; convert with :float()", op, arg,
                             uly_desc(t));
    return 0;
}

int uly_bf16_kernel_failed(const char *op, int64_t row) {
    return uly_set_error("%s: the bf16 kernel found no memory for its row buffers (2 x %lld floats a thread): free "
                         "memory, or have bf16 activations converted around the f32 kernels "
                         "(uly.cpu_bf16_kernels(false))", op, (long long)row);
}

uly_tensor *uly_contiguous_f32(uly_tensor *t) {
    if (t->dtype == ULY_DTYPE_F32) return uly_contiguous_raw(t);
    uly_tensor *c = uly_new_contiguous(t->ndim, t->shape, ULY_DTYPE_F32, uly_dev(t));
    if (c && uly_copy_raw(c, t)) { uly_tensor_release(c); c = NULL; }
    return c;
}

uly_tensor *uly_saved_form(uly_tensor *t, uly_tensor *tf) {
    if (t->dtype == ULY_DTYPE_BF16 && tf && tf->dtype == ULY_DTYPE_BF16) { uly_tensor_retain(tf); return tf; }
    if (t->dtype == ULY_DTYPE_BF16) return uly_contiguous_raw(t);
    if (tf) uly_tensor_retain(tf);
    return tf;
}

int uly_result_as(uly_tensor **out, int dtype) {
    uly_tensor *o = *out;
    if (!o || o->dtype == dtype) return o ? 0 : -1;
    uly_tensor *c = uly_new_contiguous(o->ndim, o->shape, dtype, uly_dev(o));
    if (c && uly_copy_raw(c, o)) { uly_tensor_release(c); c = NULL; }
    uly_tensor_release(o);
    *out = c;
    return c ? 0 : -1;
}

int uly_result_dtype(const uly_tensor *a, const uly_tensor *b) {
    const int a16 = a->dtype == ULY_DTYPE_BF16, b16 = !b || b->dtype == ULY_DTYPE_BF16;
    if (a16 && b16) return ULY_DTYPE_BF16;
    return (a16 || (b && b->dtype == ULY_DTYPE_BF16)) && uly_activation_bf16() ? ULY_DTYPE_BF16 : ULY_DTYPE_F32;
}

int uly_check_inplace(const char *op, const uly_tensor *t) {
    if (uly_check_tensor(op, "self", t)) return -1;
    if (uly_grad_enabled() && t->requires_grad && !t->grad_fn)
        return uly_set_error("%s: in-place write into a leaf %s that requires grad; do it inside uly.no_grad(...) "
                             "or on a detached tensor", op, uly_desc(t));
    /* a view of such a leaf (x[i] = v, x:narrow(...):fill_(v)) writes into the leaf as well */
    for (const uly_node *n = t->grad_fn; uly_grad_enabled() && n && n->n_inputs == 1; n = n->inputs[0].node) {
        if (n->op != ULY_OP_VIEW && n->op != ULY_OP_PERMUTE && n->op != ULY_OP_NARROW && n->op != ULY_OP_EXPAND) break;
        const uly_tensor *leaf = n->inputs[0].leaf;
        if (leaf && leaf->storage == t->storage)
            return uly_set_error("%s: in-place write into %s, a view of a leaf %s that requires grad; do it inside "
                                 "uly.no_grad(...) or on a detached tensor", op, uly_desc(t), uly_desc(leaf));
    }
    if (uly_grad_enabled() && t->nograd_view)
        return uly_set_error("%s: in-place write into %s, a view made inside uly.no_grad(...) of a tensor that requires "
                             "grad: autograd cannot see the write; write inside uly.no_grad(...) too, or into a "
                             "detached tensor (t:detach())", op, uly_desc(t));
    /* a tensor autograd computed (or a view of one): its new values would not be what its
     * backward rule differentiates, so the gradients through it would be silently wrong */
    if (uly_grad_enabled() && t->grad_fn)
        return uly_set_error("%s: in-place write into %s, which autograd computed from tensors that require grad "
                             "(backward would differentiate the old values); write into a copy outside the graph "
                             "(t:detach():clone()), or inside uly.no_grad(...)", op, uly_desc(t));
    return 0;
}

void uly_bump_version(uly_tensor *t) { t->storage->version++; }
uint64_t uly_tensor_version(const uly_tensor *t) { return t ? t->storage->version : 0; }

/* ---- strided element walks ---- */
/* Visit the elements of a shape in row-major order, calling fn on the byte offsets of up to two
 * strided operands. Inner dimension unrolled into a plain loop. */
void uly_walk2(int ndim, const int64_t *shape, char *a, const int64_t *sa, char *b, const int64_t *sb,
               uly_walk_fn fn, void *ctx) {
    if (uly_numel_of(ndim, shape) == 0) return;
    if (ndim == 0) { fn(a, b, 1, 0, 0, ctx); return; }
    int64_t idx[ULY_MAX_DIMS] = {0};
    int last = ndim - 1;
    for (;;) {
        int64_t oa = 0, ob = 0;
        for (int d = 0; d < last; d++) { oa += idx[d] * sa[d]; ob += idx[d] * sb[d]; }
        fn(a + oa, b ? b + ob : NULL, shape[last], sa[last], sb[last], ctx);
        int d = last - 1;
        while (d >= 0 && ++idx[d] == shape[d]) idx[d--] = 0;
        if (d < 0) return;
    }
}

/* contiguous, same dtype and element count, possibly different devices: a byte transfer */
static int transfer(uly_tensor *dst, const uly_tensor *src) {
    int dd = uly_dev(dst), sd = uly_dev(src);
    int64_t bytes = uly_tensor_nbytes(dst);
    const uly_backend *be = uly_backends[dd != ULY_DEVICE_CPU ? dd : sd];
    int kind = dd == ULY_DEVICE_CPU ? ULY_COPY_D2H : sd == ULY_DEVICE_CPU ? ULY_COPY_H2D : ULY_COPY_D2D;
    int failed = be->copy(uly_ptr(dst), uly_ptr(src), bytes, kind);
    if (uly_device_check("copy", dd != ULY_DEVICE_CPU ? dd : sd)) return -1;
    if (failed) return uly_set_error("copy of %s from %s to %s failed", uly_desc(src), uly_device_name(sd), uly_device_name(dd));
    return 0;
}

static void byte_strides(const uly_tensor *t, int64_t *out) {
    int64_t es = uly_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++) out[d] = t->stride[d] * es;
}

int uly_copy_raw(uly_tensor *dst, const uly_tensor *src) {
    /* align src to dst's shape (broadcasting from the right) */
    if (src->ndim > dst->ndim) goto mismatch;
    uly_view dv = uly_view_of(dst), sv = dv;
    sv.p = uly_ptr(src);
    sv.dtype = src->dtype;
    for (int d = 0; d < dst->ndim; d++) sv.stride[d] = 0;
    for (int d = 0; d < src->ndim; d++) {
        int dd = dst->ndim - src->ndim + d;
        if (src->shape[d] == dst->shape[dd]) sv.stride[dd] = src->stride[d];
        else if (src->shape[d] != 1) goto mismatch;
    }
    if (uly_dev(dst) == uly_dev(src)) {
        uly_be(dst)->copy_view(&dv, &sv);
        return 0;
    }
    /* across devices: bytes move contiguously in src's dtype; broadcasting, strides and
     * conversion happen on the side that has them */
    if (uly_tensor_is_contiguous(dst) && uly_tensor_is_contiguous(src) && uly_same_shape(dst, src) &&
        dst->dtype == src->dtype)
        return transfer(dst, src);
    uly_tensor *sc = uly_contiguous_raw((uly_tensor *)src);
    uly_tensor *moved = sc ? uly_new_contiguous(src->ndim, src->shape, src->dtype, uly_dev(dst)) : NULL;
    int rc = moved ? transfer(moved, sc) : -1;
    if (!rc) rc = uly_copy_raw(dst, moved);
    uly_tensor_release(sc);
    uly_tensor_release(moved);
    return rc;
mismatch:
    return uly_set_error("copy: source %s cannot be broadcast to destination %s", uly_desc(src), uly_desc(dst));
}

uly_tensor *uly_contiguous_raw(uly_tensor *t) {
    if (uly_tensor_is_contiguous(t)) { t->refcount++; return t; }
    uly_tensor *c = uly_new_like(t);
    if (!c) return NULL;
    uly_copy_raw(c, t);
    return c;
}

/* ---- data in and out ---- */
typedef struct { const char *flat; char *flat_out; int flat_dtype, t_dtype; int64_t pos; } flat_ctx;
static void from_flat_run(char *a, char *b, int64_t n, int64_t sa, int64_t sb, void *vctx) {
    (void)b; (void)sb;
    flat_ctx *c = vctx;
    int64_t es = uly_dtype_size(c->flat_dtype);
    for (int64_t i = 0; i < n; i++) uly_store(a + i * sa, c->t_dtype, uly_load(c->flat + (c->pos + i) * es, c->flat_dtype));
    c->pos += n;
}
static void to_flat_run(char *a, char *b, int64_t n, int64_t sa, int64_t sb, void *vctx) {
    (void)b; (void)sb;
    flat_ctx *c = vctx;
    int64_t es = uly_dtype_size(c->flat_dtype);
    for (int64_t i = 0; i < n; i++)
        uly_store(c->flat_out + (c->pos + i) * es, c->flat_dtype, uly_lua_number(uly_load(a + i * sa, c->t_dtype)));
    c->pos += n;
}

static int check_flat(const char *op, const uly_tensor *t, const void *p, int dtype, int64_t numel) {
    if (uly_check_tensor(op, "tensor", t)) return -1;
    if (!p) return uly_set_error("%s: buffer pointer is NULL", op);
    if (!valid_dtype(dtype)) return uly_set_error("%s: unknown buffer dtype %d", op, dtype);
    if (numel != uly_tensor_numel(t))
        return uly_set_error("%s: buffer has %lld elements but tensor %s has %lld", op, (long long)numel, uly_desc(t),
                             (long long)uly_tensor_numel(t));
    return 0;
}

/* a host tensor of t's shape and dtype (the staging buffer of a device tensor's flat copies) */
static uly_tensor *host_twin(const uly_tensor *t) { return uly_new_contiguous(t->ndim, t->shape, t->dtype, ULY_DEVICE_CPU); }

/* floating values bound for an integer tensor must be numbers in its range (a fraction is
 * truncated toward zero, as C and PyTorch do); converting NaN or 1e10 to i32 gives garbage */
static int check_integer_values(const uly_tensor *t, const void *src, int src_dtype, int64_t numel) {
    if ((t->dtype != ULY_DTYPE_I32 && t->dtype != ULY_DTYPE_I64) ||
        (src_dtype != ULY_DTYPE_F64 && src_dtype != ULY_DTYPE_F32))
        return 0;
    const double lo = t->dtype == ULY_DTYPE_I32 ? -2147483648.0 : -9223372036854775808.0;
    const double hi = t->dtype == ULY_DTYPE_I32 ? 2147483648.0 : 9223372036854775808.0;   /* exclusive */
    for (int64_t i = 0; i < numel; i++) {
        const double v = src_dtype == ULY_DTYPE_F64 ? ((const double *)src)[i] : ((const float *)src)[i];
        if (!(v > lo - 1.0 && v < hi)) {
            char text[32];
            if (v != v) snprintf(text, sizeof text, "NaN");
            else snprintf(text, sizeof text, "%g", v);
            return uly_set_error("tensor: value %s (element %lld) does not fit %s (integers from %.0f to %.0f)", text,
                                 (long long)i + 1, uly_dtype_name(t->dtype), lo, hi - 1.0);
        }
    }
    return 0;
}

int uly_tensor_copy_from(uly_tensor *t, const void *src, int src_dtype, int64_t numel) {
    if (check_flat("copy_from", t, src, src_dtype, numel) || uly_check_inplace("copy_from", t) ||
        check_integer_values(t, src, src_dtype, numel))
        return -1;
    if (uly_dev(t) != ULY_DEVICE_CPU) {
        uly_tensor *h = host_twin(t);
        int rc = h ? uly_tensor_copy_from(h, src, src_dtype, numel) : -1;
        if (!rc) rc = uly_copy_raw(t, h);
        uly_tensor_release(h);
        if (!rc) uly_bump_version(t);
        return rc;
    }
    if (uly_tensor_is_contiguous(t) && src_dtype == t->dtype) {
        memcpy(uly_ptr(t), src, (size_t)uly_tensor_nbytes(t));
    } else {
        int64_t bs[ULY_MAX_DIMS];
        byte_strides(t, bs);
        flat_ctx c = {src, NULL, src_dtype, t->dtype, 0};
        uly_walk2(t->ndim, t->shape, uly_ptr(t), bs, NULL, bs, from_flat_run, &c);
    }
    uly_bump_version(t);
    return 0;
}

int uly_tensor_copy_to(const uly_tensor *t, void *dst, int dst_dtype, int64_t numel) {
    if (check_flat("copy_to", t, dst, dst_dtype, numel)) return -1;
    if (uly_dev(t) != ULY_DEVICE_CPU) {
        uly_tensor *h = host_twin(t);
        int rc = h ? uly_copy_raw(h, t) : -1;
        if (!rc) rc = uly_tensor_copy_to(h, dst, dst_dtype, numel);
        uly_tensor_release(h);
        return rc;
    }
    if (uly_tensor_is_contiguous(t) && dst_dtype == t->dtype) {
        memcpy(dst, uly_ptr(t), (size_t)uly_tensor_nbytes(t));
        if (dst_dtype == ULY_DTYPE_F32)   /* NaNs as Lua reads them (uly_lua_number) */
            for (int64_t i = 0; i < numel; i++) { float *x = (float *)dst + i; if (*x != *x) *x = NAN; }
        if (dst_dtype == ULY_DTYPE_F64)
            for (int64_t i = 0; i < numel; i++) { double *x = (double *)dst + i; if (*x != *x) *x = NAN; }
        return 0;
    }
    int64_t bs[ULY_MAX_DIMS];
    byte_strides(t, bs);
    flat_ctx c = {NULL, dst, dst_dtype, t->dtype, 0};
    uly_walk2(t->ndim, t->shape, uly_ptr(t), bs, NULL, bs, to_flat_run, &c);
    return 0;
}

int uly_tensor_fill_(uly_tensor *t, double value) {
    if (uly_check_inplace("fill_", t)) return -1;
    uly_view v = uly_view_of(t);
    uly_be(t)->fill_view(&v, value);
    uly_bump_version(t);
    return uly_device_check("fill_", uly_dev(t));
}

/* the bytes [lo, hi) of storage a view can touch (empty: lo == hi) */
static void byte_span(const uly_tensor *t, int64_t *lo, int64_t *hi) {
    int64_t first = t->offset, last = t->offset;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 0) { *lo = *hi = 0; return; }
        const int64_t reach = (t->shape[d] - 1) * t->stride[d];
        if (reach < 0) first += reach; else last += reach;
    }
    const int64_t es = uly_dtype_size(t->dtype);
    *lo = first * es;
    *hi = (last + 1) * es;
}

/* a dim of more than one element at stride 0 (an expanded view): several elements, one location */
static int writes_one_place_twice(const uly_tensor *t) {
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1 && t->stride[d] == 0 && uly_tensor_numel(t) > 1) return 1;
    return 0;
}

int uly_tensor_copy_(uly_tensor *dst, const uly_tensor *src) {
    if (uly_check_inplace("copy_", dst) || uly_check_tensor("copy_", "src", src)) return -1;
    if (uly_grad_enabled() && src->requires_grad)
        return uly_set_error("copy_: the source %s requires grad, but copy_ does not carry gradients (its values would "
                             "reach %s cut off from the graph); build the result with differentiable ops (uly.cat, "
                             "arithmetic), or copy src:detach() if the gradient is not wanted", uly_desc(src), uly_desc(dst));
    if (writes_one_place_twice(dst))
        return uly_set_error("copy_: the destination %s is an expanded view (strides %s): several of its elements are "
                             "one memory location, so only the last would stay; copy into a tensor of its own "
                             "(uly.empty or :contiguous())", uly_desc(dst), uly_shape_str(dst->ndim, dst->stride));
    /* a source that overlaps the destination in memory is read whole before any of it is written */
    int64_t dlo, dhi, slo, shi;
    byte_span(dst, &dlo, &dhi);
    byte_span(src, &slo, &shi);
    const int same_view = src->offset == dst->offset && src->ndim == dst->ndim && src->dtype == dst->dtype &&
                          !memcmp(src->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim) &&
                          !memcmp(src->stride, dst->stride, sizeof(int64_t) * (size_t)dst->ndim);
    uly_tensor *staged = NULL;
    if (src->storage == dst->storage && dlo < shi && slo < dhi && !same_view) {
        staged = uly_new_contiguous(src->ndim, src->shape, src->dtype, uly_dev(src));
        if (!staged || uly_copy_raw(staged, src)) {
            uly_tensor_release(staged);
            return staged ? -1 : uly_set_error("copy_: out of memory for a copy of the overlapping source %s", uly_desc(src));
        }
    }
    int rc = uly_copy_raw(dst, staged ? staged : src);
    uly_tensor_release(staged);
    if (rc) return -1;
    uly_bump_version(dst);
    return 0;
}

static int random_fill(uly_tensor *t, const char *op, int normal, double a, double b) {
    if (uly_check_inplace(op, t)) return -1;
    int64_t n = uly_tensor_numel(t);
    double *vals = malloc((size_t)(n ? n : 1) * sizeof *vals);
    if (!vals) return uly_set_error("%s: out of memory for %lld values", op, (long long)n);
    uint64_t seed = uly_rng_seed(), first = uly_rng_take((uint64_t)n * (normal ? 2 : 1));
    /* counter-based: value i depends on (seed, first + i) only, so threads change nothing */
    #pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) {
        if (normal) { /* Box-Muller on two independent counters */
            double u1 = uly_counter_uniform(seed, first + 2 * (uint64_t)i);
            double u2 = uly_counter_uniform(seed, first + 2 * (uint64_t)i + 1);
            vals[i] = a + b * sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
        } else {
            vals[i] = a + (b - a) * uly_counter_uniform(seed, first + (uint64_t)i);
        }
    }
    int rc = uly_tensor_copy_from(t, vals, ULY_DTYPE_F64, n);
    free(vals);
    return rc;
}

int uly_tensor_uniform_(uly_tensor *t, double lo, double hi) { return random_fill(t, "uniform_", 0, lo, hi); }
int uly_tensor_normal_(uly_tensor *t, double mean, double std) { return random_fill(t, "normal_", 1, mean, std); }

static int item_offset(const char *op, const uly_tensor *t, const int64_t *index, int64_t *off) {
    if (uly_check_tensor(op, "tensor", t)) return -1;
    if (t->ndim > 0 && !index) return uly_set_error("%s: index is NULL", op);
    int64_t o = t->offset;
    for (int d = 0; d < t->ndim; d++) {
        if (index[d] < 0 || index[d] >= t->shape[d])
            return uly_set_error("%s: index %lld is out of range for dimension %d of size %lld in %s", op,
                                 (long long)index[d], d + 1, (long long)t->shape[d], uly_desc(t));
        o += index[d] * t->stride[d];
    }
    *off = o;
    return 0;
}

int uly_tensor_get_item(const uly_tensor *t, const int64_t *index, double *value) {
    int64_t o;
    if (item_offset("get_item", t, index, &o)) return -1;
    int64_t es = uly_dtype_size(t->dtype);
    char one[8];
    if (uly_be(t)->copy(one, (const char *)t->storage->data + o * es, es, ULY_COPY_D2H) ||
        uly_device_check("get_item", uly_dev(t)))
        return -1;
    *value = uly_lua_number(uly_load(one, t->dtype));
    return 0;
}

int uly_tensor_set_item(uly_tensor *t, const int64_t *index, double value) {
    int64_t o;
    if (uly_check_inplace("set_item", t) || item_offset("set_item", t, index, &o)) return -1;
    int64_t es = uly_dtype_size(t->dtype);
    char one[8];
    uly_store(one, t->dtype, value);
    if (uly_be(t)->copy((char *)t->storage->data + o * es, one, es, ULY_COPY_H2D) || uly_device_check("set_item", uly_dev(t)))
        return -1;
    uly_bump_version(t);
    return 0;
}
