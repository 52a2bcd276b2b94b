/* kernels/cpu/unary.c — elementwise activations (all ULY_UNARY_* kinds) and SwiGLU.
 *
 *   unary_forward:   out[i] = f(inp[i]) for i < n (out may equal inp: in place)
 *   unary_backward:  dinp[i] += dout[i] * f'(inp[i])   (ACCUMULATES; `out` is the forward
 *                    output, used by TANH/SIGMOID/EXP/SQRT, recomputed if NULL)
 *   swiglu_forward:  out = silu(gate) * up, all [n]
 *   swiglu_backward: dgate += dout * up * silu'(gate), dup += dout * silu(gate)
 *                    (ACCUMULATES; a NULL gradient pointer is skipped)
 *
 * GELU_TANH is evaluated through the identity 0.5 x (1 + tanh(u)) = x * sigmoid(2u),
 * u = sqrt(2/pi) (x + 0.044715 x^3) (same function, no cancellation near 1 + tanh = 0);
 * its backward is the exact derivative of that formula. GELU_EXACT uses erff.
 * LOG backward is dout / x, SQRT backward dout * 0.5 / out.
 *
 * exp is uly_expf (vecmath.h), a vectorisable Cody-Waite + degree-7 polynomial (Cephes expf,
 * <= 2 ulp, NaN and +-inf handled, underflows to 0 below ~-103.9) so the sigmoid/SiLU/GELU
 * loops vectorise; tanh, erf, log and sqrt call libm (scalar: errno semantics block
 * vectorisation).
 *
 * Threading: the range is cut into fixed blocks of EW_BLOCK elements (independent of the
 * thread count) and every element is computed by the same code whatever the number of
 * threads, so results are bit-identical for any OMP_NUM_THREADS. The *_block forms run one
 * block's function on the calling thread: the bf16 twins (bf16_twins.c) call them on f32 copies
 * of each block.
 */
#include "kernels.h"
#include "vecmath.h"
#include <math.h>
#include <stddef.h>
#include <omp.h>

#define EW_BLOCK ULY_EW_BLOCK
/* parallelise only above these sizes (thread start-up would dominate below) */
#define PAR_CHEAP 131072 /* memory-bound: relu, sqrt */
#define PAR_EXP 32768    /* exp-based, vectorised */
#define PAR_LIBM 8192    /* scalar libm call per element: erff, tanhf, logf */

/* ---- exp-based helpers (uly_expf: vecmath.h) ---- */
static inline float uly_sigmoidf(float x) { return 1.0f / (1.0f + uly_expf(-x)); }

#define GELU_K 0.7978845608028654f  /* sqrt(2/pi) */
#define GELU_C 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT2PI 0.3989422804014327f /* 1/sqrt(2 pi) */

/* ---- fixed-block driver ---- */
typedef struct {
    float *o0, *o1;
    const float *a, *b, *c;
} ew_args;
typedef void (*ew_fn)(const ew_args *p, int64_t lo, int64_t hi);

static void ew_run(ew_fn fn, const ew_args *p, int64_t n, int64_t par_threshold)
{
    if (n <= 0) return;
    const int64_t nb = (n + EW_BLOCK - 1) / EW_BLOCK;
    const int par = n > par_threshold && nb > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t lo = blk * EW_BLOCK;
        const int64_t hi = lo + EW_BLOCK < n ? lo + EW_BLOCK : n;
        fn(p, lo, hi);
    }
}

/* Defines a block function NAME whose loop body is BODY, with
 * o0,o1 (outputs) and a,b,c (inputs) in scope and `i` the index. */
#define EW_FN_(NAME, PRAGMA, ...)                                                 \
    static void NAME(const ew_args *p, int64_t lo, int64_t hi)                    \
    {                                                                             \
        float *o0 = p->o0, *o1 = p->o1;                                           \
        const float *a = p->a, *b = p->b, *c = p->c;                              \
        (void)o0; (void)o1; (void)a; (void)b; (void)c;                            \
        PRAGMA                                                                    \
        for (int64_t i = lo; i < hi; i++) { __VA_ARGS__ }                         \
    }
#define EW_FN(NAME, ...) EW_FN_(NAME, _Pragma("omp simd"), __VA_ARGS__)
/* loops calling scalar libm (erff, tanhf, logf, sqrtf): no simd request */
#define EW_FN_LIBM(NAME, ...) EW_FN_(NAME, , __VA_ARGS__)

/* ---- forward: o0 = f(a) ---- */
EW_FN(fw_gelu_tanh, {
    const float x = a[i];
    const float u = GELU_K * (x + GELU_C * x * x * x);
    o0[i] = x * uly_sigmoidf(2.0f * u);
})
EW_FN_LIBM(fw_gelu_exact, {
    const float x = a[i];
    o0[i] = 0.5f * x * (1.0f + erff(x * INV_SQRT2));
})
EW_FN(fw_silu, { const float x = a[i]; o0[i] = x * uly_sigmoidf(x); })
EW_FN(fw_relu, { const float x = a[i]; o0[i] = x < 0.0f ? 0.0f : x; /* NaN propagates */ })
EW_FN_LIBM(fw_tanh, { o0[i] = tanhf(a[i]); })
EW_FN(fw_sigmoid, { o0[i] = uly_sigmoidf(a[i]); })
EW_FN(fw_exp, { o0[i] = uly_expf(a[i]); })
EW_FN_LIBM(fw_log, { o0[i] = logf(a[i]); })
EW_FN_LIBM(fw_sqrt, { o0[i] = sqrtf(a[i]); })

/* ---- backward: o0 += b * f'(a), c = forward output (may be NULL) ---- */
EW_FN(bw_gelu_tanh, {
    const float x = a[i];
    const float x2 = x * x;
    const float u = GELU_K * (x + GELU_C * x2 * x);
    const float s = uly_sigmoidf(2.0f * u);
    const float g = s * (1.0f - s);
    /* d/dx [x s(2u)] = s + x * s(1-s) * 2 u'(x);  g == 0 drops the slope (0 * inf for huge
     * |x|) by a bit mask, as uly_expf does: a `g == 0 ? 0 : ...` kept this loop scalar, ~10x
     * slower than the forward and a tenth of a GPT training step */
    const float du2 = 2.0f * GELU_K * (1.0f + 3.0f * GELU_C * x2);
    f32bits slope = { .f = x * g * du2 };
    slope.u &= 0u - (uint32_t)(g != 0.0f);
    const float d = s + slope.f;
    o0[i] += b[i] * d;
})
EW_FN_LIBM(bw_gelu_exact, {
    const float x = a[i];
    const float cdf = 0.5f * (1.0f + erff(x * INV_SQRT2));
    const float pdf = INV_SQRT2PI * uly_expf(-0.5f * x * x);
    o0[i] += b[i] * (cdf + x * pdf);
})
EW_FN(bw_silu, {
    const float x = a[i];
    const float s = uly_sigmoidf(x);
    o0[i] += b[i] * (s * (1.0f + x * (1.0f - s)));
})
EW_FN(bw_relu, { o0[i] += a[i] > 0.0f ? b[i] : 0.0f; })
EW_FN(bw_tanh_out, { const float y = c[i]; o0[i] += b[i] * (1.0f - y * y); })
EW_FN_LIBM(bw_tanh_in, { const float y = tanhf(a[i]); o0[i] += b[i] * (1.0f - y * y); })
EW_FN(bw_sigmoid_out, { const float y = c[i]; o0[i] += b[i] * (y * (1.0f - y)); })
EW_FN(bw_sigmoid_in, { const float y = uly_sigmoidf(a[i]); o0[i] += b[i] * (y * (1.0f - y)); })
EW_FN(bw_exp_out, { o0[i] += b[i] * c[i]; })
EW_FN(bw_exp_in, { o0[i] += b[i] * uly_expf(a[i]); })
EW_FN(bw_log, { o0[i] += b[i] / a[i]; })
EW_FN(bw_sqrt_out, { o0[i] += b[i] * 0.5f / c[i]; })
EW_FN_LIBM(bw_sqrt_in, { o0[i] += b[i] * 0.5f / sqrtf(a[i]); })

/* the forward block function of `kind` and the size above which it runs on several threads */
static ew_fn forward_fn(int kind, int64_t *par)
{
    switch (kind) {
    case ULY_UNARY_GELU_TANH: *par = PAR_EXP; return fw_gelu_tanh;
    case ULY_UNARY_GELU_EXACT: *par = PAR_LIBM; return fw_gelu_exact;
    case ULY_UNARY_SILU: *par = PAR_EXP; return fw_silu;
    case ULY_UNARY_RELU: *par = PAR_CHEAP; return fw_relu;
    case ULY_UNARY_TANH: *par = PAR_LIBM; return fw_tanh;
    case ULY_UNARY_SIGMOID: *par = PAR_EXP; return fw_sigmoid;
    case ULY_UNARY_EXP: *par = PAR_EXP; return fw_exp;
    case ULY_UNARY_LOG: *par = PAR_LIBM; return fw_log;
    case ULY_UNARY_SQRT: *par = PAR_CHEAP; return fw_sqrt;
    default: return NULL;
    }
}

/* the backward block function of `kind` (have_out: the forward output is given) and its size threshold */
static ew_fn backward_fn(int kind, int have_out, int64_t *par)
{
    switch (kind) {
    case ULY_UNARY_GELU_TANH: *par = PAR_EXP; return bw_gelu_tanh;
    case ULY_UNARY_GELU_EXACT: *par = PAR_LIBM; return bw_gelu_exact;
    case ULY_UNARY_SILU: *par = PAR_EXP; return bw_silu;
    case ULY_UNARY_RELU: *par = PAR_CHEAP; return bw_relu;
    case ULY_UNARY_TANH: *par = have_out ? PAR_CHEAP : PAR_LIBM; return have_out ? bw_tanh_out : bw_tanh_in;
    case ULY_UNARY_SIGMOID: *par = have_out ? PAR_CHEAP : PAR_EXP; return have_out ? bw_sigmoid_out : bw_sigmoid_in;
    case ULY_UNARY_EXP: *par = have_out ? PAR_CHEAP : PAR_EXP; return have_out ? bw_exp_out : bw_exp_in;
    case ULY_UNARY_LOG: *par = PAR_CHEAP; return bw_log;
    case ULY_UNARY_SQRT: *par = PAR_CHEAP; return have_out ? bw_sqrt_out : bw_sqrt_in;
    default: return NULL;
    }
}

void unary_forward(float *out, const float *inp, int64_t n, int kind)
{
    ew_args p = { .o0 = out, .a = inp };
    int64_t par = 0;
    const ew_fn fn = forward_fn(kind, &par);
    if (fn) ew_run(fn, &p, n, par);
}

void unary_backward(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind)
{
    if (!dinp) return;
    ew_args p = { .o0 = dinp, .a = inp, .b = dout, .c = out };
    int64_t par = 0;
    const ew_fn fn = backward_fn(kind, out != NULL, &par);
    if (fn) ew_run(fn, &p, n, par);
}

/* one block on the calling thread (the bf16 twins: bf16_twins.c) */
void unary_forward_block(float *out, const float *inp, int64_t n, int kind)
{
    ew_args p = { .o0 = out, .a = inp };
    int64_t par = 0;
    const ew_fn fn = forward_fn(kind, &par);
    if (fn && n > 0) fn(&p, 0, n);
}

void unary_backward_block(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind)
{
    ew_args p = { .o0 = dinp, .a = inp, .b = dout, .c = out };
    int64_t par = 0;
    const ew_fn fn = dinp ? backward_fn(kind, out != NULL, &par) : NULL;
    if (fn && n > 0) fn(&p, 0, n);
}

/* ---- SwiGLU ---- */
EW_FN(fw_swiglu, { const float g = a[i]; o0[i] = g * uly_sigmoidf(g) * b[i]; })
/* o0 = dgate, o1 = dup, a = gate, b = up, c = dout */
EW_FN(bw_swiglu_both, {
    const float g = a[i], d = c[i];
    const float s = uly_sigmoidf(g);
    o0[i] += d * b[i] * (s * (1.0f + g * (1.0f - s)));
    o1[i] += d * (g * s);
})
EW_FN(bw_swiglu_gate, {
    const float g = a[i];
    const float s = uly_sigmoidf(g);
    o0[i] += c[i] * b[i] * (s * (1.0f + g * (1.0f - s)));
})
EW_FN(bw_swiglu_up, { const float g = a[i]; o1[i] += c[i] * (g * uly_sigmoidf(g)); })

void swiglu_forward(float *out, const float *gate, const float *up, int64_t n)
{
    ew_args p = { .o0 = out, .a = gate, .b = up };
    ew_run(fw_swiglu, &p, n, PAR_EXP);
}

/* the backward block function for the gradients asked for (NULL: none) */
static ew_fn swiglu_backward_fn(const float *dgate, const float *dup)
{
    return dgate && dup ? bw_swiglu_both : dgate ? bw_swiglu_gate : dup ? bw_swiglu_up : NULL;
}

void swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n)
{
    ew_args p = { .o0 = dgate, .o1 = dup, .a = gate, .b = up, .c = dout };
    const ew_fn fn = swiglu_backward_fn(dgate, dup);
    if (fn) ew_run(fn, &p, n, PAR_EXP);
}

void swiglu_forward_block(float *out, const float *gate, const float *up, int64_t n)
{
    ew_args p = { .o0 = out, .a = gate, .b = up };
    if (n > 0) fw_swiglu(&p, 0, n);
}

void swiglu_backward_block(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n)
{
    ew_args p = { .o0 = dgate, .o1 = dup, .a = gate, .b = up, .c = dout };
    const ew_fn fn = swiglu_backward_fn(dgate, dup);
    if (fn && n > 0) fn(&p, 0, n);
}
