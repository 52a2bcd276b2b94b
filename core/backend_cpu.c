/* core/backend_cpu.c — the CPU backend table: host memory, the kernels of kernels/cpu/, and the
 * strided walks (dtype-converting copy, fill, reduction into a broadcast view) that the core's
 * copies and gradient accumulation use. */
#include <stdlib.h>
#include <string.h>
#include "internal.h"

/* ---- strided walks over views ---- */
static void byte_strides(const uly_view *v, int64_t *out) {
    int64_t es = uly_dtype_size(v->dtype);
    for (int d = 0; d < v->ndim; d++) out[d] = v->stride[d] * es;
}

static int view_contiguous(const uly_view *v) {
    int64_t st = 1;
    for (int d = v->ndim - 1; d >= 0; d--) {
        if (v->shape[d] != 1 && v->stride[d] != st) return 0;
        st *= v->shape[d];
    }
    return 1;
}

typedef struct { int da, db; } conv_ctx;
static void convert_run(char *a, char *b, int64_t n, int64_t sa, int64_t sb, void *vctx) {
    conv_ctx *c = vctx; /* a = dst, b = src */
    if (c->da == ULY_DTYPE_F32 && c->db == ULY_DTYPE_F32) {
        if (sa == 4 && sb == 4) { memmove(a, b, (size_t)n * 4); return; }
        for (int64_t i = 0; i < n; i++) *(float *)(a + i * sa) = *(const float *)(b + i * sb);
        return;
    }
    if (c->da == ULY_DTYPE_F32 && c->db == ULY_DTYPE_BF16) {   /* bf16 activations read as f32 */
        for (int64_t i = 0; i < n; i++) *(float *)(a + i * sa) = uly_bf16_to_f32(*(const uint16_t *)(b + i * sb));
        return;
    }
    if (c->da == ULY_DTYPE_BF16 && c->db == ULY_DTYPE_F32) {   /* an f32 result rounded to bf16 */
        for (int64_t i = 0; i < n; i++) *(uint16_t *)(a + i * sa) = uly_f32_to_bf16(*(const float *)(b + i * sb));
        return;
    }
    for (int64_t i = 0; i < n; i++) uly_store(a + i * sa, c->da, uly_load(b + i * sb, c->db));
}

static void cpu_copy_view(const uly_view *dst, const uly_view *src) {
    int64_t n = uly_numel_of(dst->ndim, dst->shape);
    if (n == 0) return;
    if (dst->dtype == src->dtype && view_contiguous(dst) && view_contiguous(src)) {
        memmove(dst->p, src->p, (size_t)(n * uly_dtype_size(dst->dtype)));
        return;
    }
    /* bf16 activations: whole tensors converted between f32 and bf16, over the threads */
    const int bf16_f32 = (dst->dtype == ULY_DTYPE_F32 && src->dtype == ULY_DTYPE_BF16) ||
                         (dst->dtype == ULY_DTYPE_BF16 && src->dtype == ULY_DTYPE_F32);
    if (bf16_f32 && view_contiguous(dst) && view_contiguous(src)) {
        float *f = dst->dtype == ULY_DTYPE_F32 ? dst->p : src->p;
        uint16_t *h = dst->dtype == ULY_DTYPE_BF16 ? dst->p : src->p;
        if (dst->dtype == ULY_DTYPE_F32) {
            #pragma omp parallel for schedule(static) if (n >= 65536)
            for (int64_t i = 0; i < n; i++) f[i] = uly_bf16_to_f32(h[i]);
        } else {
            #pragma omp parallel for schedule(static) if (n >= 65536)
            for (int64_t i = 0; i < n; i++) h[i] = uly_f32_to_bf16(f[i]);
        }
        return;
    }
    int64_t ds[ULY_MAX_DIMS], ss[ULY_MAX_DIMS];
    byte_strides(dst, ds);
    byte_strides(src, ss);
    conv_ctx c = {dst->dtype, src->dtype};
    uly_walk2(dst->ndim, dst->shape, dst->p, ds, src->p, ss, convert_run, &c);
}

static void cpu_fill_view(const uly_view *dst, double value) {
    char one[8];
    uly_store(one, dst->dtype, value);
    uly_view src = *dst;
    src.p = one;
    for (int d = 0; d < src.ndim; d++) src.stride[d] = 0;
    cpu_copy_view(dst, &src);
}

typedef struct { float alpha; } acc_ctx;
static void acc_run(char *a, char *b, int64_t n, int64_t sa, int64_t sb, void *vctx) {
    float alpha = ((acc_ctx *)vctx)->alpha; /* a = src (walked), b = dst */
    if (sa == 4 && sb == 4) { /* unit strides (rows of a narrow, e.g. q/k/v of a fused QKV): vectorised */
        const float *s = (const float *)a;
        float *d = (float *)b;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] += alpha * s[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) *(float *)(b + i * sb) += alpha * *(const float *)(a + i * sa);
}

/* dst += alpha * src where src is contiguous and dst's last two dims are transposed (stride[-2]
 * == 1), as when a gradient flows back through t() or transpose(): walk 32x32 tiles so both
 * sides stay in cache instead of striding through dst a whole row apart per element */
static int transposed_add(const uly_view *dst, const uly_view *src, float alpha) {
    int nd = dst->ndim;
    if (nd < 2 || !view_contiguous(src) || dst->stride[nd - 2] != 1) return 0;
    for (int d = 0; d < nd; d++)
        if (dst->stride[d] == 0 && dst->shape[d] != 1) return 0;
    int64_t R = dst->shape[nd - 2], Cc = dst->shape[nd - 1], cs = dst->stride[nd - 1];
    int64_t batches = uly_numel_of(nd - 2, dst->shape);
    if (R < 32 || Cc < 32) return 0;
    const float *s0 = src->p;
    float *d0 = dst->p;
    for (int64_t b = 0; b < batches; b++) {
        int64_t rem = b, off = 0;
        for (int d = nd - 3; d >= 0; d--) { off += (rem % dst->shape[d]) * dst->stride[d]; rem /= dst->shape[d]; }
        const float *sb = s0 + b * R * Cc;
        float *db = d0 + off;
        #pragma omp parallel for collapse(2) if (R * Cc >= 65536)
        for (int64_t i0 = 0; i0 < R; i0 += 32)
            for (int64_t j0 = 0; j0 < Cc; j0 += 32)
                for (int64_t j = j0; j < j0 + 32 && j < Cc; j++)
                    for (int64_t i = i0; i < i0 + 32 && i < R; i++) db[i + j * cs] += alpha * sb[i * Cc + j];
    }
    return 1;
}

/* dst[c] += alpha * sum_r src[r, c] for contiguous src [R, C] and a contiguous dst broadcast over
 * the leading dims (a bias gradient): threads split the columns, each column summed in row order,
 * so any thread count gives the same bits */
static int column_sum_into(const uly_view *dst, const uly_view *src, float alpha) {
    if (!view_contiguous(src)) return 0;
    int k = 0; /* leading dims summed (stride 0), the rest contiguous and kept */
    while (k < dst->ndim && dst->stride[k] == 0) k++;
    if (k == 0 || k == dst->ndim) return 0;
    int64_t C = 1;
    for (int d = dst->ndim - 1; d >= k; d--) {
        if (dst->shape[d] != 1 && dst->stride[d] != C) return 0;
        C *= dst->shape[d];
    }
    int64_t n = uly_numel_of(src->ndim, src->shape);
    if (C == 0 || n % C) return 0;
    int64_t R = n / C;
    const float *s0 = src->p;
    float *d0 = dst->p;
    enum { BLOCK = 64 };
    int64_t blocks = (C + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t c0 = b * BLOCK, w = C - c0 < BLOCK ? C - c0 : BLOCK;
        float acc[BLOCK] = {0};
        for (int64_t r = 0; r < R; r++) {
            const float *row = s0 + r * C + c0;
            for (int64_t c = 0; c < w; c++) acc[c] += row[c];
        }
        for (int64_t c = 0; c < w; c++) d0[c0 + c] += alpha * acc[c];
    }
    return 1;
}

static void cpu_sum_view(const uly_view *dst, const uly_view *src, float alpha) {
    if (view_contiguous(dst) && view_contiguous(src)) {
        axpy_accumulate(dst->p, src->p, uly_numel_of(src->ndim, src->shape), alpha);
        return;
    }
    if (column_sum_into(dst, src, alpha) || transposed_add(dst, src, alpha)) return;
    int64_t sa[ULY_MAX_DIMS], sb[ULY_MAX_DIMS];
    byte_strides(src, sa);
    byte_strides(dst, sb);
    acc_ctx c = {alpha};
    uly_walk2(src->ndim, src->shape, src->p, sa, dst->p, sb, acc_run, &c);
}

/* ---- layouts: gather / scatter a layout's elements (element size es) ---- */
static void layout_walk(char *dst, const char *src, const uly_comm_layout *L, int64_t es, int gather) {
    int64_t at = 0;
    for (int64_t rep = 0; rep < L->count; rep++)
        for (int r = 0; r < L->nruns; r++) {
            int64_t off = (L->base + rep * L->stride + L->offset[r]) * es, n = L->length[r] * es;
            if (n <= 0) continue;
            if (gather) memcpy(dst + at, src + off, (size_t)n);
            else memcpy(dst + off, src + at, (size_t)n);
            at += n;
        }
}
static void cpu_pack_layout(void *dst, const void *src, const uly_comm_layout *L, int64_t es) {
    layout_walk(dst, src, L, es, 1);
}
static void cpu_unpack_layout(void *dst, const uly_comm_layout *L, const void *src, int64_t es) {
    layout_walk(dst, src, L, es, 0);
}

/* ---- memory ---- */
static void *cpu_raw_alloc(int64_t bytes) { void *p = NULL; return posix_memalign(&p, 64, (size_t)bytes) ? NULL : p; }
static void cpu_raw_free(void *p) { free(p); }
static int cpu_copy(void *dst, const void *src, int64_t bytes, int kind) {
    (void)kind;
    if (bytes > 0) memmove(dst, src, (size_t)bytes);
    return 0;
}
static int cpu_memset0(void *p, int64_t bytes) { if (bytes > 0) memset(p, 0, (size_t)bytes); return 0; }
static int cpu_synchronize(void) { return 0; }
static const char *cpu_take_error(void) { return NULL; }

/* mutable: uly_cpu_bf16_kernels sets and clears the bf16-activation entries */
uly_backend uly_backend_cpu = {
    .abi = ULY_BACKEND_ABI, .size = sizeof(uly_backend), .name = "cpu",
    .raw_alloc = cpu_raw_alloc, .raw_free = cpu_raw_free, .memory_info = NULL, .copy = cpu_copy,
    .memset0 = cpu_memset0, .synchronize = cpu_synchronize, .take_error = cpu_take_error,
    .copy_view = cpu_copy_view, .sum_view = cpu_sum_view, .fill_view = cpu_fill_view,
    .unary_forward = unary_forward, .unary_backward = unary_backward,
    .swiglu_forward = swiglu_forward, .swiglu_backward = swiglu_backward,
    .reduce_sum_forward = reduce_sum_forward, .reduce_sum_backward = reduce_sum_backward,
    .reduce_max_forward = reduce_max_forward, .reduce_max_backward = reduce_max_backward,
    .softmax_forward = softmax_forward, .softmax_backward = softmax_backward,
    .layernorm_forward = layernorm_forward, .layernorm_backward = layernorm_backward,
    .rmsnorm_forward = rmsnorm_forward, .rmsnorm_backward = rmsnorm_backward,
    .embedding_forward = embedding_forward, .embedding_backward = embedding_backward,
    .embedding_first_bad_index = embedding_first_bad_index,
    .rope_forward = rope_forward, .rope_backward = rope_backward,
    .dropout_forward = dropout_forward, .dropout_backward = dropout_backward,
    .cross_entropy_forward = cross_entropy_forward, .cross_entropy_backward = cross_entropy_backward,
    .attention_forward = attention_forward, .attention_backward = attention_backward,
    .binary_forward = binary_forward, .scalar_forward = scalar_forward, .scalar_backward = scalar_backward,
    .axpy_accumulate = axpy_accumulate, .gemm_operand_ok = gemm_operand_ok, .gemm_batched = gemm_batched,
    .gemm_batched_bf16 = gemm_batched_bf16, .gemm_bias = gemm_bias,
    .flash_attention_scratch_floats = flash_attention_scratch_floats,
    .flash_attention_forward = flash_attention_forward, .flash_attention_backward = flash_attention_backward,
    .optim_adamw = optim_adamw, .optim_sgd = optim_sgd, .optim_sumsq = optim_sumsq, .optim_scale = optim_scale,
    .pack_layout = cpu_pack_layout, .unpack_layout = cpu_unpack_layout,
    .binary_forward_typed = binary_forward_typed, .swiglu_forward_bf16 = swiglu_forward_bf16,
    .swiglu_backward_bf16 = swiglu_backward_bf16, .layernorm_forward_bf16 = layernorm_forward_bf16,
    .layernorm_backward_bf16 = layernorm_backward_bf16, .rmsnorm_forward_bf16 = rmsnorm_forward_bf16,
    .rmsnorm_backward_bf16 = rmsnorm_backward_bf16, .cross_entropy_forward_bf16 = cross_entropy_forward_bf16,
    .cross_entropy_backward_bf16 = cross_entropy_backward_bf16, .unary_forward_bf16 = unary_forward_bf16,
    .unary_backward_bf16 = unary_backward_bf16, .rope_forward_bf16 = rope_forward_bf16,
};

/* bf16 activations through the twins that read and write bf16 (1, the default:
 * kernels/cpu/bf16_twins.c) or through converting copies around the f32 kernels (0): the same
 * bits, which the specs check; benchmarks time both. The core reads the table at each call, so
 * this takes effect at once. Returns the previous setting; on < 0 only reads it. */
int uly_cpu_bf16_kernels(int on) {
    uly_backend *t = &uly_backend_cpu;
    const int prev = t->binary_forward_typed != NULL;
    if (on < 0) return prev;
    t->binary_forward_typed = on ? binary_forward_typed : NULL;
    t->swiglu_forward_bf16 = on ? swiglu_forward_bf16 : NULL;
    t->swiglu_backward_bf16 = on ? swiglu_backward_bf16 : NULL;
    t->layernorm_forward_bf16 = on ? layernorm_forward_bf16 : NULL;
    t->layernorm_backward_bf16 = on ? layernorm_backward_bf16 : NULL;
    t->rmsnorm_forward_bf16 = on ? rmsnorm_forward_bf16 : NULL;
    t->rmsnorm_backward_bf16 = on ? rmsnorm_backward_bf16 : NULL;
    t->cross_entropy_forward_bf16 = on ? cross_entropy_forward_bf16 : NULL;
    t->cross_entropy_backward_bf16 = on ? cross_entropy_backward_bf16 : NULL;
    t->unary_forward_bf16 = on ? unary_forward_bf16 : NULL;
    t->unary_backward_bf16 = on ? unary_backward_bf16 : NULL;
    t->rope_forward_bf16 = on ? rope_forward_bf16 : NULL;
    return prev;
}

int64_t uly_cpu_bf16_kernel_calls(void) { return bf16_twin_calls(); }
