/* kernels/cpu/softmax.c — softmax / log-softmax over the middle axis of a contiguous
 * [outer, n, inner] view (inner == 1: the usual last-dim case, contiguous rows).
 *
 *   forward:  m = max_j x, s = sum_j exp(x - m)  (s in double)
 *             softmax:     out = exp(x - m) / s
 *             log_softmax: out = (x - m) - log(s)
 *   backward (from the forward OUTPUT y, ACCUMULATES into dinp; NULL dinp is skipped):
 *             softmax:     dinp += y * (dout - sum_j dout*y)
 *             log_softmax: dinp += dout - exp(y) * sum_j dout        (sums in double)
 *
 * Rows whose values are all -inf (fully masked): PyTorch returns NaN; here softmax gives 0
 * and log_softmax gives -inf for the whole row (no NaN). The backward of such a row then
 * adds 0 (softmax) or dout (log_softmax, exp(-inf) = 0 in the formula above). A NaN anywhere
 * in a row, or a +inf, makes the whole row NaN, as in PyTorch.
 *
 * Threading: one task per row (inner == 1) or per (outer, inner block); every output is
 * computed by the same code in a fixed order whatever the thread count (bit-identical).
 * exp is the vectorisable Cody-Waite + polynomial uly_expf of vecmath.h (Cephes, <= 2 ulp).
 */
#include "kernels.h"
#include "vecmath.h"
#include <math.h>
#include <omp.h>

#define PAR_MIN 16384 /* elements below which a kernel stays single-threaded */
#define IBLK 128      /* inner-axis block of the strided (inner > 1) path */

/* ---- contiguous rows (inner == 1) ---- */
static void softmax_row(float *y, const float *x, int64_t n, int is_log)
{
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
    /* m == -inf only for a fully masked row: shift by 0 so exp(-inf - 0) = 0 (no -inf + inf).
     * A fully masked row is detected below as s == 0 (impossible otherwise: the max term
     * contributes exp(0) = 1); this does not depend on the max reduction's initial value. */
    const float ms = m == -INFINITY ? 0.0f : m;
    double s = 0.0;
    if (is_log) {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) s += (double)uly_expf(x[j] - ms);
        if (s == 0.0) {
            for (int64_t j = 0; j < n; j++) y[j] = -INFINITY;
            return;
        }
        const float ls = (float)log(s);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) y[j] = (x[j] - ms) - ls;
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) {
            const float e = uly_expf(x[j] - ms);
            y[j] = e;
            s += (double)e;
        }
        const float inv = s == 0.0 ? 0.0f : (float)(1.0 / s);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) y[j] *= inv;
    }
}

static void softmax_row_backward(float *dx, const float *dy, const float *y, int64_t n, int is_log)
{
    double s = 0.0;
    if (is_log) {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) s += (double)dy[j];
        const float sf = (float)s;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) dx[j] += dy[j] - uly_expf(y[j]) * sf;
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) s += (double)dy[j] * (double)y[j];
        const float sf = (float)s;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) dx[j] += y[j] * (dy[j] - sf);
    }
}

/* ---- strided columns (inner > 1): block of ilen columns, stride inner between j ---- */
static void softmax_cols(float *y, const float *x, int64_t n, int64_t inner, int64_t ilen, int is_log)
{
    float m[IBLK], shift[IBLK], post[IBLK];
    double s[IBLK];
    for (int64_t i = 0; i < ilen; i++) {
        m[i] = -INFINITY;
        s[i] = 0.0;
    }
    for (int64_t j = 0; j < n; j++) {
        const float *xr = x + j * inner;
#pragma omp simd
        for (int64_t i = 0; i < ilen; i++) {
            const float v = xr[i], b = m[i];
            m[i] = ((v > b) | (v != v)) ? v : b; /* NaN sticks */
        }
    }
    /* fully masked column (m == -inf): shift by 0 so exp(-inf - 0) = 0, no NaN */
    for (int64_t i = 0; i < ilen; i++) shift[i] = m[i] == -INFINITY ? 0.0f : m[i];
    if (is_log) {
        for (int64_t j = 0; j < n; j++) {
            const float *xr = x + j * inner;
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) s[i] += (double)uly_expf(xr[i] - shift[i]);
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            const float *xr = x + j * inner;
            float *yr = y + j * inner;
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) {
                const float e = uly_expf(xr[i] - shift[i]);
                yr[i] = e;
                s[i] += (double)e;
            }
        }
    }
    if (is_log) {
        /* masked: s = 0, post = +inf, so y = -inf - 0 - inf = -inf */
        for (int64_t i = 0; i < ilen; i++) post[i] = s[i] == 0.0 ? INFINITY : (float)log(s[i]);
        for (int64_t j = 0; j < n; j++) {
            const float *xr = x + j * inner;
            float *yr = y + j * inner;
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) yr[i] = (xr[i] - shift[i]) - post[i];
        }
    } else {
        /* masked: s = 0, every e = 0, scale by 0 */
        for (int64_t i = 0; i < ilen; i++) post[i] = s[i] == 0.0 ? 0.0f : (float)(1.0 / s[i]);
        for (int64_t j = 0; j < n; j++) {
            float *yr = y + j * inner;
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) yr[i] *= post[i];
        }
    }
}

static void softmax_cols_backward(float *dx, const float *dy, const float *y, int64_t n, int64_t inner,
                                  int64_t ilen, int is_log)
{
    double s[IBLK];
    float sf[IBLK];
    for (int64_t i = 0; i < ilen; i++) s[i] = 0.0;
    for (int64_t j = 0; j < n; j++) {
        const float *dyr = dy + j * inner, *yr = y + j * inner;
        if (is_log) {
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) s[i] += (double)dyr[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) s[i] += (double)dyr[i] * (double)yr[i];
        }
    }
    for (int64_t i = 0; i < ilen; i++) sf[i] = (float)s[i];
    for (int64_t j = 0; j < n; j++) {
        const float *dyr = dy + j * inner, *yr = y + j * inner;
        float *dxr = dx + j * inner;
        if (is_log) {
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) dxr[i] += dyr[i] - uly_expf(yr[i]) * sf[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) dxr[i] += yr[i] * (dyr[i] - sf[i]);
        }
    }
}

void softmax_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, int is_log)
{
    if (outer <= 0 || n <= 0 || inner <= 0) return;
    const int par = outer * n * inner > PAR_MIN;
    if (inner == 1) {
#pragma omp parallel for schedule(static) if (par && outer > 1)
        for (int64_t o = 0; o < outer; o++) softmax_row(out + o * n, inp + o * n, n, is_log);
        return;
    }
    const int64_t nib = (inner + IBLK - 1) / IBLK;
#pragma omp parallel for schedule(static) if (par && outer * nib > 1)
    for (int64_t t = 0; t < outer * nib; t++) {
        const int64_t o = t / nib, i0 = (t % nib) * IBLK;
        const int64_t off = o * n * inner + i0;
        softmax_cols(out + off, inp + off, n, inner, min64(IBLK, inner - i0), is_log);
    }
}

void softmax_backward(float *dinp, const float *dout, const float *out, int64_t outer, int64_t n, int64_t inner,
                      int is_log)
{
    if (!dinp || outer <= 0 || n <= 0 || inner <= 0) return;
    const int par = outer * n * inner > PAR_MIN;
    if (inner == 1) {
#pragma omp parallel for schedule(static) if (par && outer > 1)
        for (int64_t o = 0; o < outer; o++)
            softmax_row_backward(dinp + o * n, dout + o * n, out + o * n, n, is_log);
        return;
    }
    const int64_t nib = (inner + IBLK - 1) / IBLK;
#pragma omp parallel for schedule(static) if (par && outer * nib > 1)
    for (int64_t t = 0; t < outer * nib; t++) {
        const int64_t o = t / nib, i0 = (t % nib) * IBLK;
        const int64_t off = o * n * inner + i0;
        softmax_cols_backward(dinp + off, dout + off, out + off, n, inner, min64(IBLK, inner - i0), is_log);
    }
}
