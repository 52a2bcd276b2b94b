/* kernels/cpu/vecmath.h — small inline math shared by the CPU kernels (internal).
 *
 *   uly_expf: vectorisable expf, Cody-Waite range reduction + degree-7 polynomial (Cephes
 *             expf, <= 2 ulp); NaN propagates, overflow gives +inf, below ~-103.9 gives 0.
 *             Branch-free, so GCC if-converts and vectorises the loops that call it
 *             (softmax.c, unary.c).
 *   uly_expf_softmax: uly_expf's bits for x in [-87, 88], 0 below, in fewer instructions
 *             (flash attention's exp(s - max)).
 *   min64:    the smaller of two int64_t (block / chunk bounds).
 */
#ifndef ULY_KERNELS_CPU_VECMATH_H
#define ULY_KERNELS_CPU_VECMATH_H
#include <stdint.h>

typedef union { float f; uint32_t u; } f32bits;

/* both exponentials' range reduction: x = n ln 2 + r, |r| <= ln 2 / 2, n in the low bits of t
 * (the round-to-nearest integer trick: t.u - 0x4B400000 = n), and e^r (Cephes expf's polynomial) */
static inline float uly_expf_reduced(float x, f32bits *t)
{
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    t->f = x * 1.44269504088896341f + magic;
    const float nf = t->f - magic;
    float r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * (r * r) + r + 1.0f;
}

/* vectorisable expf, <= 2 ulp; NaN propagates, overflow to +inf, underflow to 0 */
static inline float uly_expf(float x)
{
    /* out-of-range inputs are fixed by the selects at the end (no clamp-then-compute: a
     * constant-folded overflow path would stop GCC from if-converting and vectorising) */
    f32bits t;
    const float p = uly_expf_reduced(x, &t);
    /* 2^n split in two factors so that n in [-150, 128] (denormals, overflow) is exact;
     * unsigned arithmetic: no UB for out-of-range or NaN x (result replaced below) */
    const int32_t n = (int32_t)(t.u - 0x4B400000u);
    const int32_t n1 = n >> 1, n2 = n - n1;
    f32bits s1 = { .u = (uint32_t)(n1 + 127) << 23 };
    f32bits s2 = { .u = (uint32_t)(n2 + 127) << 23 };
    f32bits e = { .f = p * s1.f * s2.f };
    /* branch-free fix-up (bit masks, so GCC keeps the loops straight-line and vectorised):
     * e^x > FLT_MAX -> +inf, e^x < 2^-150 -> 0; NaN x compares false and stays NaN */
    const uint32_t big = 0u - (uint32_t)(x > 88.7228394f);
    const uint32_t tiny = 0u - (uint32_t)(x < -103.972076f);
    e.u = (e.u & ~(big | tiny)) | (big & 0x7F800000u);
    return e.f;
}

/* uly_expf for softmax's exp(s - max), where x <= 88: its bits wherever x >= -87 (e^x >= 2^-125),
 * 0 below (no overflow fix-up, 2^n in one factor: 15 vector instructions where uly_expf takes 25);
 * NaN propagates. Flash attention's exponentials, whose arguments are scores minus their row's max
 * or log-sum-exp. */
static inline float uly_expf_softmax(float x)
{
    f32bits t;
    const float p = uly_expf_reduced(x, &t);
    /* 2^n with n = t.u - 0x4B400000 in [-126, 127]: the exponent field n + 127 */
    f32bits s = { .u = (t.u - 0x4B400000u + 127u) << 23 };
    f32bits e = { .f = p * s.f };
    e.u &= 0u - (uint32_t)!(x < -87.0f);
    return e.f;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#endif
