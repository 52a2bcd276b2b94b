/* core/internal.h — private structures shared by the core's .c files: tensors, storage,
 * autograd nodes, the allocator and error helpers. Never included by kernels or Lua. */
#ifndef ULY_INTERNAL_H
#define ULY_INTERNAL_H
#include <math.h>
#include <stdint.h>
#include <stdarg.h>
#include "uly.h"
#include <string.h>
#include "uly_backend.h"

#define ULY_MAX_DIMS 8
#define ULY_NODE_MAX_INPUTS 4
#define ULY_NODE_MAX_SAVED 6

/* ---- errors (error.c) ---- */
int uly_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));  /* returns -1 */
void *uly_set_error_null(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* returns NULL */
/* "f32[2, 3]" for messages; rotating static buffers, valid for a few calls */
const char *uly_desc(const uly_tensor *t);
const char *uly_shape_str(int ndim, const int64_t *shape);
const char *uly_bytes_str(int64_t nbytes);
/* element `flat` (row-major) of a tensor of this shape as its 1-based index, the way Lua writes
 * it: "[2, 5]" (for messages about a bad element) */
const char *uly_position_str(int ndim, const int64_t *shape, int64_t flat);

/* ---- allocator (alloc.c): one caching pool per device, sized classes, counted ---- */
void *uly_alloc(int64_t nbytes, int64_t *block_bytes);  /* host; NULL + error on failure */
void uly_free(void *p, int64_t block_bytes);
void *uly_alloc_on(int device, int64_t nbytes, int64_t *block_bytes);
void uly_free_on(int device, void *p, int64_t block_bytes);
int uly_device_pool_in_use(int device);

/* ---- devices (device.c): the backend table of each device (NULL: none registered) ---- */
extern const uly_backend *uly_backends[ULY_DEVICE_COUNT];
extern uly_backend uly_backend_cpu;         /* backend_cpu.c (its bf16 entries switch: uly_cpu_bf16_kernels) */
extern const uly_backend uly_backend_sim;   /* backend_sim.c */
/* the first failure a device backend kept since the last check, as an error naming `op`; 0 if none */
int uly_device_check(const char *op, int device);
/* two tensor arguments on one device: "op: 'b' is on cpu but 'a' is on cuda; move one with :to(...)" */
int uly_check_same_device(const char *op, const char *an, const uly_tensor *a, const char *bn, const uly_tensor *b);
const char *uly_device_name(int device);

/* ---- element conversion (host memory) ---- */
static inline float uly_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t uly_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}
static inline double uly_load(const char *p, int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return *(const float *)p;
    case ULY_DTYPE_BF16: return uly_bf16_to_f32(*(const uint16_t *)p);
    case ULY_DTYPE_I32: return *(const int32_t *)p;
    case ULY_DTYPE_I64: return (double)*(const int64_t *)p;
    default: return *(const double *)p;
    }
}
/* a value on its way to Lua: every NaN as the one quiet NaN. LuaJIT keeps its other types inside
 * the NaN space, so a NaN with all its high bits set (f32 0xFFFFFFFF, e.g. from uninitialised
 * device memory) would read there as nil, not as a number */
static inline double uly_lua_number(double v) { return v != v ? (double)NAN : v; }

static inline void uly_store(char *p, int dtype, double v) {
    switch (dtype) {
    case ULY_DTYPE_F32: *(float *)p = (float)v; break;
    case ULY_DTYPE_BF16: *(uint16_t *)p = uly_f32_to_bf16((float)v); break;
    case ULY_DTYPE_I32: *(int32_t *)p = (int32_t)v; break;
    case ULY_DTYPE_I64: *(int64_t *)p = (int64_t)v; break;
    default: *(double *)p = v; break;
    }
}

/* ---- tensors (tensor.c) ---- */
typedef struct uly_storage {
    int64_t refcount;
    void *data;
    int64_t block_bytes;   /* what the allocator handed out */
    int device;
    uint64_t version;      /* bumped by every in-place write; checked by autograd */
} uly_storage;

struct uly_node;

struct uly_tensor {
    int64_t refcount;
    uly_storage *storage;
    int64_t offset;                /* in elements */
    int ndim;
    int dtype;
    int64_t shape[ULY_MAX_DIMS];
    int64_t stride[ULY_MAX_DIMS];  /* in elements */
    int requires_grad;
    uly_tensor *grad;              /* leaves: accumulated gradient (owned) */
    struct uly_node *grad_fn;      /* non-leaves: the op that made it (owned) */
    int nograd_view;               /* a view made inside no_grad of a tensor that requires grad (or of
                                      such a view): writing into it with grad on is refused */
};

int64_t uly_numel_of(int ndim, const int64_t *shape);
uly_tensor *uly_new_contiguous(int ndim, const int64_t *shape, int dtype, int device);   /* uninitialised */
uly_tensor *uly_new_zeros(int ndim, const int64_t *shape, int dtype, int device);
uly_tensor *uly_new_like(const uly_tensor *t);                 /* contiguous, same shape/dtype/device */
uly_tensor *uly_new_view(uly_tensor *base, int ndim, const int64_t *shape, const int64_t *stride, int64_t offset);
uly_tensor *uly_contiguous_raw(uly_tensor *t);   /* retained t if contiguous, else a copy; no autograd */
int uly_copy_raw(uly_tensor *dst, const uly_tensor *src);  /* strided, converting, broadcasting; no checks on grad */
void uly_bump_version(uly_tensor *t);
static inline int uly_dev(const uly_tensor *t) { return t->storage->device; }
/* the backend of t's device: every kernel call goes through it */
static inline const uly_backend *uly_be(const uly_tensor *t) { return uly_backends[t->storage->device]; }
/* t as a strided view for the backend's walks */
uly_view uly_view_of(const uly_tensor *t);
static inline float *uly_f32(const uly_tensor *t) { return (float *)t->storage->data + t->offset; }
static inline void *uly_ptr(const uly_tensor *t) {
    return (char *)t->storage->data + t->offset * uly_dtype_size(t->dtype);
}
int uly_check_tensor(const char *op, const char *arg, const uly_tensor *t);        /* non-NULL */
int uly_check_float(const char *op, const char *arg, const uly_tensor *t);         /* non-NULL, f32 */
/* bf16 activations: ops that compute in f32 take bf16 inputs as well (converted on the way in), give
 * bf16 results for bf16 inputs and save bf16 inputs as bf16 (the autograd engine hands backward
 * rules f32 copies, autograd.c) */
int uly_check_floating(const char *op, const char *arg, const uly_tensor *t);      /* non-NULL, f32 or bf16 */
/* a backend's bf16 row kernel (norms, cross-entropy, RoPE) returned -1: it had no memory for its
 * per-thread row buffers of `row` floats and wrote nothing; sets the error, returns -1 */
int uly_bf16_kernel_failed(const char *op, int64_t row);
uly_tensor *uly_contiguous_f32(uly_tensor *t);  /* retained t if contiguous f32, else a (converted) copy */
/* what to save of input t, whose contiguous form the op read is tf (f32, or bf16 where the backend
 * reads bf16): bf16 stays bf16 (tf itself when it is) */
uly_tensor *uly_saved_form(uly_tensor *t, uly_tensor *tf);
int uly_result_as(uly_tensor **out, int dtype);  /* *out converted to dtype (released and NULL on failure: -1) */
/* bf16 when a (and b, if given) are bf16, or one of them is and activations are bf16
 * (uly_activation_bf16: an f32 weight added into bf16 activations keeps them bf16); else f32 */
int uly_result_dtype(const uly_tensor *a, const uly_tensor *b);
int uly_same_shape(const uly_tensor *a, const uly_tensor *b);
int uly_check_inplace(const char *op, const uly_tensor *t);  /* refuses leaves requiring grad while grad is on */
uint64_t uly_rng_take(uint64_t n);  /* reserve n counters of the global generator (library.c) */

/* ---- autograd (autograd.c, backward.c) ---- */
enum uly_op {
    ULY_OP_NONE = 0,
    ULY_OP_ADD, ULY_OP_SUB, ULY_OP_MUL, ULY_OP_DIV,
    ULY_OP_ADD_SCALAR, ULY_OP_MUL_SCALAR, ULY_OP_POW_SCALAR,
    ULY_OP_MATMUL,
    ULY_OP_SUM, ULY_OP_MAX,
    ULY_OP_SOFTMAX, ULY_OP_LOG_SOFTMAX,
    ULY_OP_LAYERNORM, ULY_OP_RMSNORM,
    ULY_OP_UNARY, ULY_OP_SWIGLU,
    ULY_OP_EMBEDDING, ULY_OP_ROPE, ULY_OP_DROPOUT, ULY_OP_CROSS_ENTROPY, ULY_OP_ATTENTION,
    ULY_OP_VIEW, ULY_OP_PERMUTE, ULY_OP_NARROW, ULY_OP_EXPAND, ULY_OP_COPY, ULY_OP_CAT,
    ULY_OP_ULYSSES_QKV, ULY_OP_ULYSSES_OUT, ULY_OP_CUSTOM,
    ULY_OP_FLASH_ATTENTION,
    ULY_OP_ADDMM,
    ULY_OP_COUNT
};

typedef struct uly_edge {
    struct uly_node *node;   /* gradient flows into this node's output ... */
    uly_tensor *leaf;        /* ... or into this leaf's .grad; both NULL: input needs no grad */
    int ndim, device;
    int64_t shape[ULY_MAX_DIMS];  /* the input's shape and device (gradients have them) */
} uly_edge;

typedef struct uly_node {
    int64_t refcount;
    uint64_t seq;            /* creation order: a topological order of the graph */
    int op;
    int n_inputs;
    uly_edge inputs[ULY_NODE_MAX_INPUTS];
    int n_saved;
    uly_tensor *saved[ULY_NODE_MAX_SAVED];
    uint64_t saved_version[ULY_NODE_MAX_SAVED];
    double f[4];             /* op scalars (eps, p, scale, ...) */
    int64_t i[ULY_MAX_DIMS + 4]; /* op integers (dims, offsets, seeds, ...) */
    int out_ndim;
    int64_t out_shape[ULY_MAX_DIMS];
    int released;            /* saved tensors freed after a backward without retain_graph */
    uly_tensor *grad_out;    /* accumulated gradient of the output during backward */
    int grad_out_borrowed;   /* grad_out shares a downstream gradient's storage: read-only, cloned on write */
    int fresh;               /* during its backward: bit k set = gin[k] is new and uninitialised (the rule writes it) */
} uly_node;

/* Start recording `op` on `n_inputs` inputs: NULL (and no error) when grad mode is off or no
 * input requires grad. The caller saves tensors, fills f/i, then attaches the output. */
uly_node *uly_node_begin(int op, int n_inputs, uly_tensor *const *inputs);
void uly_node_save(uly_node *n, uly_tensor *t);       /* retains t, remembers its version */
void uly_node_attach(uly_node *n, uly_tensor *out);    /* out takes the node; n may be NULL */
void uly_node_release(uly_node *n);
const char *uly_op_name(int op);

/* backward rules (backward.c): gin[i] is the gradient buffer of input i (contiguous, input's
 * shape, to be ACCUMULATED into) or NULL when input i needs no gradient. */
typedef int (*uly_backward_fn)(uly_node *n, uly_tensor *gout, uly_tensor **gin);
extern const uly_backward_fn uly_backward_rules[ULY_OP_COUNT];
int uly_comm_all_to_all_refuse(uly_comm *c, const char *why);  /* comm_exchange.c */
int uly_bw_custom(uly_node *n, uly_tensor *gout, uly_tensor **gin);     /* custom.c */
void uly_custom_note_freed(const uly_node *n);
int uly_bw_ulysses_qkv(uly_node *n, uly_tensor *gout, uly_tensor **gin);  /* ulysses.c */
int uly_bw_ulysses_out(uly_node *n, uly_tensor *gout, uly_tensor **gin);
int uly_bw_flash_attention(uly_node *n, uly_tensor *gout, uly_tensor **gin);  /* flash.c */

/* dst += alpha * src, summing src over the dims where dst is broadcast (f32; any strides) */
int uly_sum_to(uly_tensor *dst, const uly_tensor *src, float alpha);
/* the last two dims of t as a GEMM operand, batch strides aligned right to nb dims (ops.c) */
uly_mat uly_as_mat(const uly_tensor *t, int nb);
/* mixed precision (ops.c): a GEMM in the current matmul precision, and the bf16-rounded copy the
 * core makes when the backend has no native bf16 GEMM */
void uly_gemm(const uly_backend *be, int bf16, int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M,
              int64_t N, int64_t K, float beta);
uly_tensor *uly_bf16_rounded(const uly_tensor *t);
int uly_gemm_rounds(const uly_backend *be);   /* the backend rounds bf16-precision GEMM operands itself */
int uly_gemm_precision(const uly_backend *be); /* a matmul node's i[0]: 0 f32, 1 bf16, 2 bf16 saved unrounded */
/* visit a shape in row-major order, fn gets runs along the last dim (byte strides; tensor.c) */
typedef void (*uly_walk_fn)(char *a, char *b, int64_t n, int64_t sa, int64_t sb, void *ctx);
void uly_walk2(int ndim, const int64_t *shape, char *a, const int64_t *sa, char *b, const int64_t *sb,
               uly_walk_fn fn, void *ctx);
/* accumulate src into dst (same shape, any strides, f32) */
int uly_add_into(uly_tensor *dst, const uly_tensor *src);

#endif
