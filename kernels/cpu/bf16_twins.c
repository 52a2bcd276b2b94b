/* kernels/cpu/bf16_twins.c — the CPU kernels for bf16 activations (the "bf16 activations" entries
 * of core/include/uly_backend.h): norms, cross-entropy, RoPE, the elementwise activations,
 * SwiGLU and the binary ops reading and writing bf16 themselves, so a bf16 activation moves two
 * bytes instead of the four of an f32 copy plus the copy itself.
 *
 * Each twin gives the bits of the f32 kernel between two converting copies: bf16 values are
 * read exactly (bf16 -> f32 is exact), the f32 kernel's own compiled code computes, and each
 * result is rounded once to nearest even (f32_round_bf16, as the copies round).
 *  - elementwise (unary, SwiGLU): blocks of ULY_EW_BLOCK elements, the f32 kernels' blocks,
 *    converted into f32 buffers on the stack and run by the kernels' block functions
 *    (unary_forward_block, ...);
 *  - rows (norms, cross-entropy, RoPE): the f32 kernels' *_io forms, reading each row through
 *    a per-thread f32 buffer (bf16_io below), kept and grown across calls (no allocation, no
 *    first-touch page faults on the hot path);
 *  - binary ops: one f32 operation per element, so any loop gives the f32 kernel's bits; the
 *    operands (f32 or bf16, broadcast or strided) are gathered into f32 segments first.
 * Gradients (dinp, dweight, ...) are f32 and accumulate, as in the f32 kernels. */
#include "kernels.h"
#include "../../core/include/uly.h"
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PAR_MIN 32768 /* elements below which a twin stays on one thread */

static atomic_int_fast64_t twin_calls;
static void count_call(void) { atomic_fetch_add_explicit(&twin_calls, 1, memory_order_relaxed); }
int64_t bf16_twin_calls(void) { return (int64_t)atomic_load_explicit(&twin_calls, memory_order_relaxed); }

/* ---- conversions (vectorisable loops; kernels.h's bf16_bits_f32 and f32_bf16_bits) ---- */
static void to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_bits_f32(src[i]);
}
static void to_bf16(uint16_t *restrict dst, const float *restrict src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = f32_bf16_bits(src[i]);
}

/* ---- row io: per-thread f32 buffers for the row kernels' *_io forms ----
 * Two buffers (in, out) per OpenMP thread number, grown by reserve_rows before a row kernel
 * starts, on the calling thread, so nothing inside its parallel region can fail: where memory
 * cannot be had the twin returns -1 having written nothing, and the core says so (an abort
 * here had ended the process). Kept and grown across calls (no allocation, no first-touch page
 * faults on the hot path). The twins run on the core's op thread, one call at a time. */
typedef struct { float *p; int64_t cap; } row_buffer;
static row_buffer *row_bufs;   /* [slots][2] */
static int row_slots;

static int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* every thread's two buffers hold n + 16 floats (64-byte aligned); -1 when they cannot */
static int reserve_rows(int64_t n) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const char *limit = getenv("ULY_TEST_ROW_BUFFER_LIMIT");   /* the specs' stand-in for a full memory */
    if (limit && n + 16 > atoll(limit)) return -1;
    if (threads > row_slots) {
        row_buffer *grown = realloc(row_bufs, (size_t)threads * 2 * sizeof *grown);
        if (!grown) return -1;
        memset(grown + 2 * row_slots, 0, (size_t)(threads - row_slots) * 2 * sizeof *grown);
        row_bufs = grown;
        row_slots = threads;
    }
    const int64_t want = (n + 16 + 4095) / 4096 * 4096;
    for (int i = 0; i < 2 * threads; i++) {
        if (row_bufs[i].cap >= want) continue;
        void *p = NULL;
        if (posix_memalign(&p, 64, (size_t)want * sizeof(float))) return -1;
        free(row_bufs[i].p);
        row_bufs[i].p = p;
        row_bufs[i].cap = want;
    }
    return 0;
}
static float *thread_buffer(int which) { return row_bufs[2 * thread_num() + which].p; }

/* elements [off, off + n) sit in the buffer at the alignment they have in a 64-byte-aligned f32
 * copy of the whole array (the converting copies' layout), so vector loops split them as there */
static const float *bf16_in(const void *src, int64_t off, int64_t n) {
    float *f = thread_buffer(0) + (off & 15);
    to_f32(f, (const uint16_t *)src + off, n);
    return f;
}
static float *bf16_out(int64_t off, int64_t n) { (void)n; return thread_buffer(1) + (off & 15); }
static void bf16_put(void *dst, int64_t off, int64_t n, const float *f) { to_bf16((uint16_t *)dst + off, f, n); }
static const uly_row_io bf16_io = { bf16_in, bf16_out, bf16_put };

/* ---- norms, cross-entropy, RoPE: the f32 kernels through bf16_io ---- */
int layernorm_forward_bf16(void *out, float *mean, float *rstd, const void *inp, const float *weight,
                           const float *bias, int64_t rows, int64_t C, float eps) {
    if (reserve_rows(C)) return -1;
    count_call();
    layernorm_forward_io(&bf16_io, out, mean, rstd, inp, weight, bias, rows, C, eps);
    return 0;
}
int layernorm_backward_bf16(float *dinp, float *dweight, float *dbias, const float *dout, const void *inp,
                            const float *weight, const float *mean, const float *rstd, int64_t rows, int64_t C) {
    if (reserve_rows(C)) return -1;
    count_call();
    layernorm_backward_io(&bf16_io, dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, C);
    return 0;
}
int rmsnorm_forward_bf16(void *out, float *rstd, const void *inp, const float *weight, int64_t rows, int64_t C,
                         float eps) {
    if (reserve_rows(C)) return -1;
    count_call();
    rmsnorm_forward_io(&bf16_io, out, rstd, inp, weight, rows, C, eps);
    return 0;
}
int rmsnorm_backward_bf16(float *dinp, float *dweight, const float *dout, const void *inp, const float *weight,
                          const float *rstd, int64_t rows, int64_t C) {
    if (reserve_rows(C)) return -1;
    count_call();
    rmsnorm_backward_io(&bf16_io, dinp, dweight, dout, inp, weight, rstd, rows, C);
    return 0;
}
int64_t cross_entropy_forward_bf16(float *loss, float *lse, const void *logits, const void *targets, int target_bytes,
                                   int64_t rows, int64_t V, int64_t ignore_index) {
    if (reserve_rows(V)) return -1;
    count_call();
    return cross_entropy_forward_io(&bf16_io, loss, lse, logits, targets, target_bytes, rows, V, ignore_index);
}
int cross_entropy_backward_bf16(float *dlogits, const float *dloss, const void *logits, const float *lse,
                                const void *targets, int target_bytes, int64_t rows, int64_t V, int64_t ignore_index) {
    if (reserve_rows(V)) return -1;
    count_call();
    cross_entropy_backward_io(&bf16_io, dlogits, dloss, logits, lse, targets, target_bytes, rows, V, ignore_index);
    return 0;
}
int rope_forward_bf16(void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos_offset,
                      float theta) {
    if (reserve_rows(D)) return -1;   /* rope_row reads at most D elements at a time */
    count_call();
    rope_forward_io(&bf16_io, out, inp, B, T, H, D, pos_offset, theta);
    return 0;
}

/* ---- unary activations and SwiGLU: the f32 kernels' blocks on f32 copies ---- */
#define EW ULY_EW_BLOCK
static inline int64_t ew_blocks(int64_t n) { return (n + EW - 1) / EW; }
static inline int64_t ew_len(int64_t n, int64_t lo) { return n - lo < EW ? n - lo : EW; }

void unary_forward_bf16(void *out, const void *inp, int64_t n, int kind) {
    count_call();
    const uint16_t *x16 = inp;
    uint16_t *y16 = out;
    const int64_t nb = ew_blocks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t blk = 0; blk < nb; blk++) {
        float x[EW] __attribute__((aligned(64))), y[EW] __attribute__((aligned(64)));
        const int64_t lo = blk * EW, len = ew_len(n, lo);
        to_f32(x, x16 + lo, len);
        unary_forward_block(y, x, len, kind);
        to_bf16(y16 + lo, y, len);
    }
}

/* out (the forward output) may be NULL: the block function recomputes it */
void unary_backward_bf16(float *dinp, const float *dout, const void *inp, const void *out, int64_t n, int kind) {
    count_call();
    if (!dinp) return;
    const uint16_t *x16 = inp, *y16 = out;
    const int64_t nb = ew_blocks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t blk = 0; blk < nb; blk++) {
        float x[EW] __attribute__((aligned(64))), y[EW] __attribute__((aligned(64)));
        const int64_t lo = blk * EW, len = ew_len(n, lo);
        to_f32(x, x16 + lo, len);
        if (y16) to_f32(y, y16 + lo, len);
        unary_backward_block(dinp + lo, dout + lo, x, y16 ? y : NULL, len, kind);
    }
}

void swiglu_forward_bf16(void *out, const void *gate, const void *up, int64_t n) {
    count_call();
    const uint16_t *g16 = gate, *u16 = up;
    uint16_t *y16 = out;
    const int64_t nb = ew_blocks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t blk = 0; blk < nb; blk++) {
        float g[EW] __attribute__((aligned(64))), u[EW] __attribute__((aligned(64))), y[EW] __attribute__((aligned(64)));
        const int64_t lo = blk * EW, len = ew_len(n, lo);
        to_f32(g, g16 + lo, len);
        to_f32(u, u16 + lo, len);
        swiglu_forward_block(y, g, u, len);
        to_bf16(y16 + lo, y, len);
    }
}

void swiglu_backward_bf16(float *dgate, float *dup, const float *dout, const void *gate, const void *up, int64_t n) {
    count_call();
    if (!dgate && !dup) return;
    const uint16_t *g16 = gate, *u16 = up;
    const int64_t nb = ew_blocks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t blk = 0; blk < nb; blk++) {
        float g[EW] __attribute__((aligned(64))), u[EW] __attribute__((aligned(64)));
        const int64_t lo = blk * EW, len = ew_len(n, lo);
        to_f32(g, g16 + lo, len);
        to_f32(u, u16 + lo, len);
        swiglu_backward_block(dgate ? dgate + lo : NULL, dup ? dup + lo : NULL, dout + lo, g, u, len);
    }
}

/* ---- binary ops with broadcasting, each operand f32 or bf16 ---- */
#define SEG 2048 /* elements of one row gathered at a time */

/* n elements of src (element stride st: 0 broadcasts) as f32: src itself where it is f32 with
 * unit stride, else gathered into buf */
static const float *gather_f32(float *restrict buf, const void *src, int dtype, int64_t st, int64_t n) {
    if (dtype == ULY_DTYPE_F32) {
        const float *s = src;
        if (st == 1) return s;
        for (int64_t i = 0; i < n; i++) buf[i] = s[i * st];
        return buf;
    }
    const uint16_t *h = src;
    if (st == 1) to_f32(buf, h, n);
    else for (int64_t i = 0; i < n; i++) buf[i] = bf16_bits_f32(h[i * st]);
    return buf;
}

static void apply(float *restrict o, const float *x, const float *y, int64_t n, int kind) {
    switch (kind) {
    case ULY_BINARY_ADD: _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i]; break;
    case ULY_BINARY_SUB: _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = x[i] - y[i]; break;
    case ULY_BINARY_MUL: _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = x[i] * y[i]; break;
    default: _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = x[i] / y[i]; break;
    }
}

static int unit_strides(int ndim, const int64_t *shape, const int64_t *st) {
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && st[d] != s) return 0;
        s *= shape[d];
    }
    return 1;
}

/* out (contiguous, shape) = a (op) b, a and b read through element strides (0 = broadcast);
 * one f32 operation per element, as binary_forward: the same bits */
void binary_forward_typed(void *out, int out_dtype, const void *a, int a_dtype, const int64_t *sa, const void *b,
                          int b_dtype, const int64_t *sb, int ndim, const int64_t *shape, int kind) {
    count_call();
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    if (n == 0) return;
    /* rows of the last dimension, or one row when both operands are contiguous */
    const int flat = unit_strides(ndim, shape, sa) && unit_strides(ndim, shape, sb);
    const int64_t inner = flat ? n : ndim ? shape[ndim - 1] : 1, rows = n / inner;
    const int64_t ia = flat ? 1 : ndim ? sa[ndim - 1] : 0, ib = flat ? 1 : ndim ? sb[ndim - 1] : 0;
    const int64_t segs = (inner + SEG - 1) / SEG, as = a_dtype == ULY_DTYPE_BF16 ? 2 : 4;
    const int64_t bs = b_dtype == ULY_DTYPE_BF16 ? 2 : 4, os = out_dtype == ULY_DTYPE_BF16 ? 2 : 4;
    const int64_t pieces = rows * segs;
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t k = 0; k < pieces; k++) {
        const int64_t r = k / segs, j0 = (k % segs) * SEG, len = inner - j0 < SEG ? inner - j0 : SEG;
        int64_t rem = r, oa = j0 * ia, ob = j0 * ib;
        for (int d = ndim - 2; d >= 0 && !flat; d--) {
            const int64_t i = rem % shape[d];
            rem /= shape[d];
            oa += i * sa[d];
            ob += i * sb[d];
        }
        float fa[SEG] __attribute__((aligned(64))), fb[SEG] __attribute__((aligned(64)));
        float fo[SEG] __attribute__((aligned(64)));
        const float *x = gather_f32(fa, (const char *)a + oa * as, a_dtype, ia, len);
        const float *y = gather_f32(fb, (const char *)b + ob * bs, b_dtype, ib, len);
        char *o = (char *)out + (r * inner + j0) * os;
        if (out_dtype == ULY_DTYPE_F32) {
            apply((float *)o, x, y, len, kind);
        } else {
            apply(fo, x, y, len, kind);
            to_bf16((uint16_t *)o, fo, len);
        }
    }
}
