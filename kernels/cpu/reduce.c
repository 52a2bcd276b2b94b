/* kernels/cpu/reduce.c — sum / max over the middle axis of a contiguous [outer, n, inner] view.
 *
 *   reduce_sum_forward:  out[o, i] = scale * sum_j inp[o, j, i]            (out is [outer, inner])
 *   reduce_sum_backward: dinp[o, j, i] += scale * dout[o, i]                (ACCUMULATES)
 *   reduce_max_forward:  out[o, i] = max_j inp[o, j, i], argmax[o, i] = first j reaching it;
 *                        NaN propagates: a NaN makes the result NaN and argmax the first NaN
 *   reduce_max_backward: dinp[o, argmax[o, i], i] += dout[o, i]             (ACCUMULATES)
 * A NULL gradient pointer is skipped.
 *
 * Sums accumulate in double. When the output has few elements (e.g. a full sum, outer =
 * inner = 1) the j axis is also cut into fixed chunks; chunking is a function of the shape
 * only, each chunk is summed in order and the chunk sums are added in chunk order, so the
 * result never depends on the thread count. Chunk partials live in a malloc'ed buffer (if
 * that fails, the same chunk sums are computed serially per output: same result).
 */
#include "kernels.h"
#include "vecmath.h"
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#define PAR_MIN 32768   /* elements below which a kernel stays single-threaded */
#define SUM_CHUNK 16384 /* elements of inp per summing task */
#define IBLK 256        /* inner-axis block for the strided (inner > 1) paths */
#define MIN_TASKS 64    /* below this many (row / column-block) tasks, sums are also split along j */

/* sum of p[0..len) in double, fixed order for a given (pointer, len) */
static inline double sum_contig(const float *p, int64_t len)
{
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < len; j++) s += (double)p[j];
    return s;
}

/* acc[0..ilen) = sum over jlen rows (stride inner) of p[j*inner + i] */
static inline void sum_strided(double *acc, const float *p, int64_t jlen, int64_t inner, int64_t ilen)
{
    for (int64_t i = 0; i < ilen; i++) acc[i] = 0.0;
    int64_t j = 0;
    for (; j + 4 <= jlen; j += 4) { /* 4 rows per pass over acc: fewer acc loads/stores */
        const float *r0 = p + j * inner, *r1 = r0 + inner, *r2 = r1 + inner, *r3 = r2 + inner;
#pragma omp simd
        for (int64_t i = 0; i < ilen; i++)
            acc[i] += ((double)r0[i] + (double)r1[i]) + ((double)r2[i] + (double)r3[i]);
    }
    for (; j < jlen; j++) {
        const float *row = p + j * inner;
#pragma omp simd
        for (int64_t i = 0; i < ilen; i++) acc[i] += (double)row[i];
    }
}

void reduce_sum_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, float scale)
{
    if (outer <= 0 || inner <= 0) return;
    const double sc = (double)scale;
    const int par = outer * n * inner > PAR_MIN;
    if (n <= 0) {   /* an empty sum is 0; an empty mean (scale NaN) is NaN, as on the GPU */
        for (int64_t k = 0; k < outer * inner; k++) out[k] = 0.0f * scale;
        return;
    }

    if (inner == 1) {
        /* split rows only when there are too few of them to keep threads busy (shape rule) */
        const int64_t nch = outer >= MIN_TASKS ? 1 : (n + SUM_CHUNK - 1) / SUM_CHUNK;
        double *part = nch > 1 ? malloc((size_t)(outer * nch) * sizeof(double)) : NULL;
        if (part) {
#pragma omp parallel for schedule(static) if (par)
            for (int64_t t = 0; t < outer * nch; t++) {
                const int64_t o = t / nch, c = t % nch;
                const int64_t j0 = c * SUM_CHUNK;
                part[t] = sum_contig(inp + o * n + j0, min64(SUM_CHUNK, n - j0));
            }
#pragma omp parallel for schedule(static) if (outer > 4096)
            for (int64_t o = 0; o < outer; o++) {
                double s = 0.0;
                for (int64_t c = 0; c < nch; c++) s += part[o * nch + c];
                out[o] = (float)(sc * s);
            }
            free(part);
        } else {
#pragma omp parallel for schedule(static) if (par)
            for (int64_t o = 0; o < outer; o++) {
                double s = 0.0;
                for (int64_t j0 = 0; j0 < n; j0 += SUM_CHUNK)
                    s += sum_contig(inp + o * n + j0, min64(SUM_CHUNK, n - j0));
                out[o] = (float)(sc * s);
            }
        }
        return;
    }

    /* inner > 1: tasks over (o, j-chunk, i-block); i is the contiguous vectorised axis */
    const int64_t nib = (inner + IBLK - 1) / IBLK;
    int64_t jch = SUM_CHUNK / min64(inner, IBLK);
    if (jch < 1) jch = 1;
    if (outer * nib >= MIN_TASKS) jch = n; /* enough (o, i-block) tasks: no j split */
    const int64_t nch = (n + jch - 1) / jch;
    double *part = nch > 1 ? malloc((size_t)(outer * nch * inner) * sizeof(double)) : NULL;
    if (nch == 1 || part) {
#pragma omp parallel for schedule(static) if (par)
        for (int64_t t = 0; t < outer * nch * nib; t++) {
            const int64_t o = t / (nch * nib), c = (t / nib) % nch, b = t % nib;
            const int64_t j0 = c * jch, i0 = b * IBLK;
            const int64_t jlen = min64(jch, n - j0), ilen = min64(IBLK, inner - i0);
            double acc[IBLK];
            sum_strided(acc, inp + (o * n + j0) * inner + i0, jlen, inner, ilen);
            if (nch == 1) {
                float *dst = out + o * inner + i0;
                for (int64_t i = 0; i < ilen; i++) dst[i] = (float)(sc * acc[i]);
            } else {
                double *dst = part + (o * nch + c) * inner + i0;
                for (int64_t i = 0; i < ilen; i++) dst[i] = acc[i];
            }
        }
        if (part) {
#pragma omp parallel for schedule(static) if (outer * nch * inner > PAR_MIN)
            for (int64_t t = 0; t < outer * nib; t++) {
                const int64_t o = t / nib, i0 = (t % nib) * IBLK, ilen = min64(IBLK, inner - i0);
                double acc[IBLK];
                for (int64_t i = 0; i < ilen; i++) acc[i] = 0.0;
                for (int64_t c = 0; c < nch; c++) {
                    const double *src = part + (o * nch + c) * inner + i0;
#pragma omp simd
                    for (int64_t i = 0; i < ilen; i++) acc[i] += src[i];
                }
                for (int64_t i = 0; i < ilen; i++) out[o * inner + i0 + i] = (float)(sc * acc[i]);
            }
            free(part);
        }
    } else {
        /* malloc failed: same chunk sums, added in the same order, parallel over (o, i-block) */
#pragma omp parallel for schedule(static) if (par)
        for (int64_t t = 0; t < outer * nib; t++) {
            const int64_t o = t / nib, i0 = (t % nib) * IBLK, ilen = min64(IBLK, inner - i0);
            double acc[IBLK], tot[IBLK];
            for (int64_t i = 0; i < ilen; i++) tot[i] = 0.0;
            for (int64_t j0 = 0; j0 < n; j0 += jch) {
                sum_strided(acc, inp + (o * n + j0) * inner + i0, min64(jch, n - j0), inner, ilen);
                for (int64_t i = 0; i < ilen; i++) tot[i] += acc[i];
            }
            for (int64_t i = 0; i < ilen; i++) out[o * inner + i0 + i] = (float)(sc * tot[i]);
        }
    }
}

void reduce_sum_backward(float *dinp, const float *dout, int64_t outer, int64_t n, int64_t inner, float scale)
{
    if (!dinp || outer <= 0 || n <= 0 || inner <= 0) return;
    const int par = outer * n * inner > PAR_MIN;
    if (inner == 1) {
        const int64_t JB = 8192, nb = (n + JB - 1) / JB;
#pragma omp parallel for schedule(static) if (par)
        for (int64_t t = 0; t < outer * nb; t++) {
            const int64_t o = t / nb, j0 = (t % nb) * JB, jlen = min64(JB, n - j0);
            const float v = scale * dout[o];
            float *d = dinp + o * n + j0;
#pragma omp simd
            for (int64_t j = 0; j < jlen; j++) d[j] += v;
        }
        return;
    }
    int64_t jb = 8192 / inner;
    if (jb < 1) jb = 1;
    const int64_t nb = (n + jb - 1) / jb;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < outer * nb; t++) {
        const int64_t o = t / nb, j0 = (t % nb) * jb, jlen = min64(jb, n - j0);
        const float *g = dout + o * inner;
        for (int64_t j = j0; j < j0 + jlen; j++) {
            float *d = dinp + (o * n + j) * inner;
#pragma omp simd
            for (int64_t i = 0; i < inner; i++) d[i] += scale * g[i];
        }
    }
}

/* max of a contiguous row and the first index reaching it (first NaN if any).
 * Pass 1 (vectorised): max and "any NaN"; pass 2: first index, scanned in blocks. */
static float row_max(const float *x, int64_t n, int64_t *arg)
{
    float m = x[0];
    int has_nan = x[0] != x[0];
#pragma omp simd reduction(max : m) reduction(| : has_nan)
    for (int64_t j = 1; j < n; j++) {
        const float v = x[j];
        m = v > m ? v : m;
        has_nan |= v != v;
    }
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        const int64_t j1 = min64(n, j0 + 64);
        int hit = 0;
        if (has_nan) {
#pragma omp simd reduction(| : hit)
            for (int64_t j = j0; j < j1; j++) hit |= x[j] != x[j];
        } else {
#pragma omp simd reduction(| : hit)
            for (int64_t j = j0; j < j1; j++) hit |= x[j] == m;
        }
        if (hit)
            for (int64_t j = j0; j < j1; j++)
                if (has_nan ? x[j] != x[j] : x[j] == m) {
                    *arg = j;
                    return x[j];
                }
    }
    /* not reached for gcc; a max-reduction identity of -FLT_MAX (other compilers) could
     * leave m above an all -inf row: then every element is -inf */
    *arg = 0;
    return x[0];
}

void reduce_max_forward(float *out, int64_t *argmax, const float *inp, int64_t outer, int64_t n, int64_t inner)
{
    if (outer <= 0 || inner <= 0) return;
    if (n <= 0) {
        for (int64_t k = 0; k < outer * inner; k++) {
            out[k] = -INFINITY;
            if (argmax) argmax[k] = 0;
        }
        return;
    }
    const int par = outer * n * inner > PAR_MIN;
    if (inner == 1) {
#pragma omp parallel for schedule(static) if (par)
        for (int64_t o = 0; o < outer; o++) {
            int64_t a;
            out[o] = row_max(inp + o * n, n, &a);
            if (argmax) argmax[o] = a;
        }
        return;
    }
    const int64_t nib = (inner + IBLK - 1) / IBLK;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < outer * nib; t++) {
        const int64_t o = t / nib, i0 = (t % nib) * IBLK, ilen = min64(IBLK, inner - i0);
        const float *x = inp + o * n * inner + i0;
        float best[IBLK];
        int64_t arg[IBLK];
        for (int64_t i = 0; i < ilen; i++) {
            best[i] = x[i];
            arg[i] = 0;
        }
        for (int64_t j = 1; j < n; j++) {
            const float *row = x + j * inner;
#pragma omp simd
            for (int64_t i = 0; i < ilen; i++) {
                const float v = row[i], b = best[i];
                /* strictly greater, or the first NaN (a NaN best is never replaced) */
                const int take = (v > b) | ((v != v) & (b == b));
                best[i] = take ? v : b;
                arg[i] = take ? j : arg[i];
            }
        }
        for (int64_t i = 0; i < ilen; i++) {
            out[o * inner + i0 + i] = best[i];
            if (argmax) argmax[o * inner + i0 + i] = arg[i];
        }
    }
}

void reduce_max_backward(float *dinp, const float *dout, const int64_t *argmax, int64_t outer, int64_t n, int64_t inner)
{
    if (!dinp || outer <= 0 || n <= 0 || inner <= 0) return;
    /* every (o, i) owns a distinct dinp element: no race */
    const int64_t IB = 4096, nib = (inner + IB - 1) / IB;
#pragma omp parallel for schedule(static) if (outer * inner > PAR_MIN)
    for (int64_t t = 0; t < outer * nib; t++) {
        const int64_t o = t / nib, i0 = (t % nib) * IB, ilen = min64(IB, inner - i0);
        for (int64_t i = i0; i < i0 + ilen; i++) {
            const int64_t k = o * inner + i;
            dinp[(o * n + argmax[k]) * inner + i] += dout[k];
        }
    }
}
