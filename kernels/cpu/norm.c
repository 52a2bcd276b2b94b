/* kernels/cpu/norm.c — LayerNorm and RMSNorm over the last axis of a [rows, C] tensor.
 *
 *   layernorm_forward:  mean = mean(x), rstd = 1/sqrt(var(x) + eps)  (biased var, in double)
 *                       out = (x - mean) * rstd * weight + bias; saves mean[rows], rstd[rows]
 *   rmsnorm_forward:    rstd = 1/sqrt(mean(x^2) + eps) (in double); out = x * rstd * weight
 *   weight / bias may be NULL (= 1 / 0); the saved mean / rstd pointers may be NULL too.
 *
 *   backward (ACCUMULATES += into dinp, dweight, dbias; a NULL one is skipped), with
 *   xhat = (x - mean) * rstd (rmsnorm: x * rstd), g = dout * weight:
 *     layernorm: dinp += rstd * (g - mean(g) - xhat * mean(g * xhat))
 *     rmsnorm:   dinp += rstd * (g - xhat * mean(g * xhat))
 *     dweight += sum_rows dout * xhat,  dbias += sum_rows dout
 *   Row means are in double. dweight / dbias are reduced deterministically: rows are cut
 *   into at most NCHUNK fixed chunks (a function of `rows` only, not of the thread count);
 *   each chunk sums its rows in order into a float partial (malloc'ed), then the partials
 *   are added in chunk order in double. If malloc fails, the same chunk sums are formed
 *   column-block-wise instead (same result).
 *   The *_io forms read inp and write out through a uly_row_io (kernels.h): the bf16 twins
 *   (bf16_twins.c) run this same code on per-thread f32 copies of each row.
 */
#include "kernels.h"
#include "vecmath.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define PAR_MIN 16384 /* rows * C below which a kernel stays single-threaded */
#define NCHUNK 128    /* maximum number of row chunks for the dweight / dbias partials */
#define CBLK 512      /* column block of the malloc-failure fallback */

/* ---------------- LayerNorm ---------------- */

void layernorm_forward_io(const uly_row_io *io, void *out, float *mean, float *rstd, const void *inp,
                          const float *weight, const float *bias, int64_t rows, int64_t C, float eps)
{
    if (rows <= 0 || C <= 0) return;
#pragma omp parallel for schedule(static) if (rows * C > PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = row_in(io, inp, r * C, C);
        float *y = row_out(io, out, r * C, C);
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < C; c++) s += (double)x[c];
        const double md = s / (double)C;
        double v = 0.0;
#pragma omp simd reduction(+ : v)
        for (int64_t c = 0; c < C; c++) {
            const double d = (double)x[c] - md;
            v += d * d;
        }
        const float m = (float)md;
        const float rs = (float)(1.0 / sqrt(v / (double)C + (double)eps));
        if (mean) mean[r] = m;
        if (rstd) rstd[r] = rs;
        if (weight && bias) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * rs * weight[c] + bias[c];
        } else if (weight) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * rs * weight[c];
        } else if (bias) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * rs + bias[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * rs;
        }
        row_put(io, out, r * C, C, y);
    }
}

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int64_t rows, int64_t C, float eps)
{
    layernorm_forward_io(NULL, out, mean, rstd, inp, weight, bias, rows, C, eps);
}

/* dinp row of layernorm (weight may be NULL) */
static inline void ln_dinp_row(float *dx, const float *dy, const float *x, const float *w, float m, float rs,
                               int64_t C)
{
    double sg = 0.0, sgx = 0.0;
    if (w) {
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t c = 0; c < C; c++) {
            const float g = dy[c] * w[c];
            const float xh = (x[c] - m) * rs;
            sg += (double)g;
            sgx += (double)g * (double)xh;
        }
    } else {
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t c = 0; c < C; c++) {
            const float xh = (x[c] - m) * rs;
            sg += (double)dy[c];
            sgx += (double)dy[c] * (double)xh;
        }
    }
    const float mg = (float)(sg / (double)C), mgx = (float)(sgx / (double)C);
    if (w) {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) {
            const float xh = (x[c] - m) * rs;
            dx[c] += rs * (dy[c] * w[c] - mg - xh * mgx);
        }
    } else {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) {
            const float xh = (x[c] - m) * rs;
            dx[c] += rs * (dy[c] - mg - xh * mgx);
        }
    }
}

/* pw[c] += dy * xhat, pb[c] += dy for one row (or a column range of it), c < len */
static inline void ln_param_row(float *pw, float *pb, const float *dy, const float *x, float m, float rs,
                                int64_t len)
{
    if (pw) {
#pragma omp simd
        for (int64_t c = 0; c < len; c++) pw[c] += dy[c] * ((x[c] - m) * rs);
    }
    if (pb) {
#pragma omp simd
        for (int64_t c = 0; c < len; c++) pb[c] += dy[c];
    }
}

/* dst[c] += sum_k part[k * C + c] (k in order, double) for c in [0, C) */
static void combine_partials(float *dst, const float *part, int64_t nch, int64_t C)
{
    const int64_t nb = (C + CBLK - 1) / CBLK;
#pragma omp parallel for schedule(static) if (nch * C > PAR_MIN && nb > 1)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t c0 = b * CBLK, c1 = min64(C, c0 + CBLK);
        double acc[CBLK];
        for (int64_t c = c0; c < c1; c++) acc[c - c0] = 0.0;
        for (int64_t k = 0; k < nch; k++) {
            const float *p = part + k * C;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) acc[c - c0] += (double)p[c];
        }
        for (int64_t c = c0; c < c1; c++) dst[c] += (float)acc[c - c0];
    }
}

void layernorm_backward_io(const uly_row_io *io, float *dinp, float *dweight, float *dbias, const float *dout,
                           const void *inp, const float *weight, const float *mean, const float *rstd, int64_t rows,
                           int64_t C)
{
    if (rows <= 0 || C <= 0) return;
    const int par = rows * C > PAR_MIN;
    const int64_t chunk = (rows + NCHUNK - 1) / NCHUNK;
    const int64_t nch = (rows + chunk - 1) / chunk;

    float *pw = NULL, *pb = NULL;
    int fallback = 0;
    if (dweight) fallback |= !(pw = calloc((size_t)(nch * C), sizeof(float)));
    if (dbias) fallback |= !(pb = calloc((size_t)(nch * C), sizeof(float)));
    if (fallback) {
        free(pw);
        free(pb);
        pw = pb = NULL;
    }

#pragma omp parallel for schedule(static) if (par && nch > 1)
    for (int64_t k = 0; k < nch; k++) {
        const int64_t r1 = min64(rows, (k + 1) * chunk);
        float *pwk = pw ? pw + k * C : NULL, *pbk = pb ? pb + k * C : NULL;
        for (int64_t r = k * chunk; r < r1; r++) {
            const float *dy = dout + r * C, *x = row_in(io, inp, r * C, C);
            if (dinp) ln_dinp_row(dinp + r * C, dy, x, weight, mean[r], rstd[r], C);
            if (pwk || pbk) ln_param_row(pwk, pbk, dy, x, mean[r], rstd[r], C);
        }
    }
    if (pw) combine_partials(dweight, pw, nch, C);
    if (pb) combine_partials(dbias, pb, nch, C);
    free(pw);
    free(pb);

    if (fallback) { /* same chunk partials, built per column block instead of per chunk */
        const int64_t nb = (C + CBLK - 1) / CBLK;
#pragma omp parallel for schedule(static) if (par && nb > 1)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t c0 = b * CBLK, c1 = min64(C, c0 + CBLK);
            float cw[CBLK], cb[CBLK];
            double aw[CBLK], ab[CBLK];
            memset(aw, 0, sizeof aw);
            memset(ab, 0, sizeof ab);
            for (int64_t k = 0; k < nch; k++) {
                memset(cw, 0, sizeof cw);
                memset(cb, 0, sizeof cb);
                float *pwk = dweight ? cw : NULL, *pbk = dbias ? cb : NULL;
                for (int64_t r = k * chunk; r < min64(rows, (k + 1) * chunk); r++)
                    ln_param_row(pwk, pbk, dout + r * C + c0, row_in(io, inp, r * C + c0, c1 - c0), mean[r], rstd[r],
                                 c1 - c0);
                for (int64_t c = 0; c < c1 - c0; c++) {
                    aw[c] += (double)cw[c];
                    ab[c] += (double)cb[c];
                }
            }
            for (int64_t c = c0; c < c1; c++) {
                if (dweight) dweight[c] += (float)aw[c - c0];
                if (dbias) dbias[c] += (float)ab[c - c0];
            }
        }
    }
}

void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, const float *mean, const float *rstd, int64_t rows, int64_t C)
{
    layernorm_backward_io(NULL, dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, C);
}

/* ---------------- RMSNorm ---------------- */

void rmsnorm_forward_io(const uly_row_io *io, void *out, float *rstd, const void *inp, const float *weight,
                        int64_t rows, int64_t C, float eps)
{
    if (rows <= 0 || C <= 0) return;
#pragma omp parallel for schedule(static) if (rows * C > PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = row_in(io, inp, r * C, C);
        float *y = row_out(io, out, r * C, C);
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < C; c++) s += (double)x[c] * (double)x[c];
        const float rs = (float)(1.0 / sqrt(s / (double)C + (double)eps));
        if (rstd) rstd[r] = rs;
        if (weight) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = x[c] * rs * weight[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = x[c] * rs;
        }
        row_put(io, out, r * C, C, y);
    }
}

void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int64_t rows, int64_t C,
                     float eps)
{
    rmsnorm_forward_io(NULL, out, rstd, inp, weight, rows, C, eps);
}

static inline void rms_dinp_row(float *dx, const float *dy, const float *x, const float *w, float rs, int64_t C)
{
    double sgx = 0.0;
    if (w) {
#pragma omp simd reduction(+ : sgx)
        for (int64_t c = 0; c < C; c++) sgx += (double)(dy[c] * w[c]) * (double)(x[c] * rs);
    } else {
#pragma omp simd reduction(+ : sgx)
        for (int64_t c = 0; c < C; c++) sgx += (double)dy[c] * (double)(x[c] * rs);
    }
    const float mgx = (float)(sgx / (double)C);
    if (w) {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) dx[c] += rs * (dy[c] * w[c] - (x[c] * rs) * mgx);
    } else {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) dx[c] += rs * (dy[c] - (x[c] * rs) * mgx);
    }
}

static inline void rms_param_row(float *pw, const float *dy, const float *x, float rs, int64_t len)
{
#pragma omp simd
    for (int64_t c = 0; c < len; c++) pw[c] += dy[c] * (x[c] * rs);
}

void rmsnorm_backward_io(const uly_row_io *io, float *dinp, float *dweight, const float *dout, const void *inp,
                         const float *weight, const float *rstd, int64_t rows, int64_t C)
{
    if (rows <= 0 || C <= 0) return;
    const int par = rows * C > PAR_MIN;
    const int64_t chunk = (rows + NCHUNK - 1) / NCHUNK;
    const int64_t nch = (rows + chunk - 1) / chunk;

    float *pw = dweight ? calloc((size_t)(nch * C), sizeof(float)) : NULL;
    const int fallback = dweight && !pw;

#pragma omp parallel for schedule(static) if (par && nch > 1)
    for (int64_t k = 0; k < nch; k++) {
        const int64_t r1 = min64(rows, (k + 1) * chunk);
        float *pwk = pw ? pw + k * C : NULL;
        for (int64_t r = k * chunk; r < r1; r++) {
            const float *dy = dout + r * C, *x = row_in(io, inp, r * C, C);
            if (dinp) rms_dinp_row(dinp + r * C, dy, x, weight, rstd[r], C);
            if (pwk) rms_param_row(pwk, dy, x, rstd[r], C);
        }
    }
    if (pw) combine_partials(dweight, pw, nch, C);
    free(pw);

    if (fallback) {
        const int64_t nb = (C + CBLK - 1) / CBLK;
#pragma omp parallel for schedule(static) if (par && nb > 1)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t c0 = b * CBLK, c1 = min64(C, c0 + CBLK);
            float cw[CBLK];
            double aw[CBLK];
            memset(aw, 0, sizeof aw);
            for (int64_t k = 0; k < nch; k++) {
                memset(cw, 0, sizeof cw);
                for (int64_t r = k * chunk; r < min64(rows, (k + 1) * chunk); r++)
                    rms_param_row(cw, dout + r * C + c0, row_in(io, inp, r * C + c0, c1 - c0), rstd[r], c1 - c0);
                for (int64_t c = 0; c < c1 - c0; c++) aw[c] += (double)cw[c];
            }
            for (int64_t c = c0; c < c1; c++) dweight[c] += (float)aw[c - c0];
        }
    }
}

void rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                      const float *rstd, int64_t rows, int64_t C)
{
    rmsnorm_backward_io(NULL, dinp, dweight, dout, inp, weight, rstd, rows, C);
}
