/* kernels/cuda/rows.cu — the row-wise kernels of the CUDA backend, same contracts as
 * kernels/cpu/{reduce,softmax,norm,embedding,cross_entropy,optim}.c: sums and maxima over the
 * middle axis of [outer, n, inner], softmax / log-softmax, LayerNorm and RMSNorm (row statistics
 * in double), embedding lookup and its gradient, fused cross-entropy, AdamW / SGD over one flat
 * parameter, and the sum of squares for gradient norms. Every reduction has a fixed order (no
 * float atomics), so results repeat run to run. Values the host needs (a count, a norm, the
 * first bad index) come back through the backend's small scratch buffers. */
#include <math.h>
#include <stdlib.h>
#include "common.cuh"

#define THREADS 256
#define LAUNCH(kernel, n, ...) do { \
        if ((n) > 0) ULY_LAUNCH(kernel, uly_cu_blocks((n), THREADS), THREADS, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(#kernel); } while (0)
/* one block of ROWT threads per row (rows <= 2^31 - 1 handled by a grid-stride over rows) */
#define ROWT 256
#define ROW_BLOCKS(rows) ((unsigned)((rows) < 65535 * 16 ? (rows) : 65535 * 16))
#define LAUNCH_ROWS(kernel, rows, ...) do { \
        if ((rows) > 0) ULY_LAUNCH(kernel, ROW_BLOCKS(rows), ROWT, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(#kernel); } while (0)
#define LAUNCH_AS_(name, kernel, n, ...) do { \
        if ((n) > 0) ULY_LAUNCH_AS(name, kernel, uly_cu_blocks((n), THREADS), THREADS, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(name); } while (0)
/* the templated kernels (T: f32, or bf16 bits) under their f32 name, or with " bf16" */
#define NAMED(name) (sizeof(T) == 2 ? name " bf16" : name)
#define LAUNCH_T(name, kernel, n, ...) do { \
        if ((n) > 0) ULY_LAUNCH_AS(NAMED(name), kernel, uly_cu_blocks((n), THREADS), THREADS, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(NAMED(name)); } while (0)
#define LAUNCH_ROWS_T(name, kernel, rows, ...) do { \
        if ((rows) > 0) ULY_LAUNCH_AS(NAMED(name), kernel, ROW_BLOCKS(rows), ROWT, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(NAMED(name)); } while (0)

extern "C" void *uly_cu_scratch(void);                                   /* backend.cu: 64 KiB of device memory */
extern "C" int uly_cu_read_back(void *host, const void *dev, int64_t bytes); /* sync copy; 0 on success */

/* ---- sum / mean over the middle axis ---- */
__global__ static void sum_rows(float *out, const float *inp, int64_t rows, int64_t n, float scale) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        double s = 0.0;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += inp[r * n + j];
        s = uly_cu_block_sum(s);
        if (threadIdx.x == 0) out[r] = (float)(s * scale);
    }
}
__global__ static void sum_mid(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, float scale) {
    ULY_CU_FOR(e, outer * inner) {
        int64_t o = e / inner, i = e % inner;
        double s = 0.0;
        for (int64_t j = 0; j < n; j++) s += inp[(o * n + j) * inner + i];
        out[e] = (float)(s * scale);
    }
}
extern "C" void cu_reduce_sum_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, float scale) {
    if (inner == 1) LAUNCH_ROWS(sum_rows, outer, out, inp, outer, n, scale);
    else LAUNCH(sum_mid, outer * inner, out, inp, outer, n, inner, scale);
}
__global__ static void sum_bw(float *dinp, const float *dout, int64_t outer, int64_t n, int64_t inner, float scale) {
    ULY_CU_FOR(e, outer * n * inner) dinp[e] += scale * dout[(e / (n * inner)) * inner + e % inner];
}
extern "C" void cu_reduce_sum_backward(float *dinp, const float *dout, int64_t outer, int64_t n, int64_t inner, float scale) {
    LAUNCH(sum_bw, outer * n * inner, dinp, dout, outer, n, inner, scale);
}

__global__ static void max_mid(float *out, int64_t *arg, const float *inp, int64_t outer, int64_t n, int64_t inner) {
    ULY_CU_FOR(e, outer * inner) {
        int64_t o = e / inner, i = e % inner, best_j = 0;
        float best = inp[o * n * inner + i];
        for (int64_t j = 1; j < n && !isnan(best); j++) {
            float v = inp[(o * n + j) * inner + i];
            if (v > best || isnan(v)) { best = v; best_j = j; }
        }
        out[e] = best;
        arg[e] = best_j;
    }
}
extern "C" void cu_reduce_max_forward(float *out, int64_t *argmax, const float *inp, int64_t outer, int64_t n, int64_t inner) {
    LAUNCH(max_mid, outer * inner, out, argmax, inp, outer, n, inner);
}
__global__ static void max_bw(float *dinp, const float *dout, const int64_t *arg, int64_t outer, int64_t n, int64_t inner) {
    ULY_CU_FOR(e, outer * inner) {
        int64_t o = e / inner, i = e % inner;
        dinp[(o * n + arg[e]) * inner + i] += dout[e];
    }
}
extern "C" void cu_reduce_max_backward(float *dinp, const float *dout, const int64_t *argmax, int64_t outer, int64_t n,
                                       int64_t inner) {
    LAUNCH(max_bw, outer * inner, dinp, dout, argmax, outer, n, inner);
}

/* ---- softmax over the middle axis: a block per row when inner == 1, a thread per column else ---- */
__global__ static void softmax_rows(float *out, const float *inp, int64_t rows, int64_t n, int is_log) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = inp + r * n;
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, x[j]);
        m = uly_cu_block_max(m);
        double s = 0.0;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += expf(x[j] - m);
        s = uly_cu_block_sum(s);
        float ls = (float)log(s);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
            out[r * n + j] = is_log ? x[j] - m - ls : expf(x[j] - m) / (float)s;
    }
}
__global__ static void softmax_mid(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, int is_log) {
    ULY_CU_FOR(e, outer * inner) {
        int64_t o = e / inner, i = e % inner;
        const float *x = inp + o * n * inner + i;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) m = fmaxf(m, x[j * inner]);
        double s = 0.0;
        for (int64_t j = 0; j < n; j++) s += expf(x[j * inner] - m);
        float ls = (float)log(s);
        for (int64_t j = 0; j < n; j++)
            out[o * n * inner + j * inner + i] = is_log ? x[j * inner] - m - ls : expf(x[j * inner] - m) / (float)s;
    }
}
extern "C" void cu_softmax_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, int is_log) {
    if (inner == 1) LAUNCH_ROWS(softmax_rows, outer, out, inp, outer, n, is_log);
    else LAUNCH(softmax_mid, outer * inner, out, inp, outer, n, inner, is_log);
}
__global__ static void softmax_bw(float *dinp, const float *dout, const float *out, int64_t outer, int64_t n, int64_t inner,
                                  int is_log) {
    ULY_CU_FOR(e, outer * inner) {
        int64_t base = (e / inner) * n * inner + e % inner;
        double s = 0.0;
        for (int64_t j = 0; j < n; j++) s += is_log ? dout[base + j * inner] : dout[base + j * inner] * out[base + j * inner];
        for (int64_t j = 0; j < n; j++) {
            int64_t k = base + j * inner;
            dinp[k] += is_log ? dout[k] - expf(out[k]) * (float)s : out[k] * (dout[k] - (float)s);
        }
    }
}
extern "C" void cu_softmax_backward(float *dinp, const float *dout, const float *out, int64_t outer, int64_t n, int64_t inner,
                                    int is_log) {
    LAUNCH(softmax_bw, outer * inner, dinp, dout, out, outer, n, inner, is_log);
}

/* ---- LayerNorm / RMSNorm: a block per row; parameter gradients a thread per column ----
 * T: the input and output, f32 or bf16 bits (bf16 activations: read exactly, rounded once) */
template <typename T>
__global__ static void norm_fw(T *out, float *mean, float *rstd, const T *inp, const float *w, const float *b,
                               int64_t rows, int64_t C, float eps, int rms) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *x = inp + r * C;
        double md = 0.0;
        if (!rms) {
            double s = 0.0;
            for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += uly_cu_ld(x, c);
            md = uly_cu_block_sum(s) / (double)C;
        }
        double v = 0.0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) { double d = (double)uly_cu_ld(x, c) - md; v += d * d; }
        v = uly_cu_block_sum(v);
        float m = (float)md, rs = (float)(1.0 / sqrt(v / (double)C + (double)eps));
        if (threadIdx.x == 0) { if (mean) mean[r] = m; if (rstd) rstd[r] = rs; }
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float y = (uly_cu_ld(x, c) - m) * rs;
            if (w) y *= w[c];
            if (b) y += b[c];
            uly_cu_st(out, r * C + c, y);
        }
    }
}
template <typename T>
__global__ static void norm_bw_input(float *dinp, const float *dout, const T *inp, const float *w, const float *mean,
                                     const float *rstd, int64_t rows, int64_t C, int rms) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *x = inp + r * C;
        const float *d = dout + r * C;
        float m = rms ? 0.0f : mean[r], rs = rstd[r];
        double sg = 0.0, sgx = 0.0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float g = d[c] * (w ? w[c] : 1.0f), xh = (uly_cu_ld(x, c) - m) * rs;
            sg += g;
            sgx += (double)g * xh;
        }
        float mg = (float)(uly_cu_block_sum(sg) / (double)C), mgx = (float)(uly_cu_block_sum(sgx) / (double)C);
        if (rms) mg = 0.0f;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float g = d[c] * (w ? w[c] : 1.0f), xh = (uly_cu_ld(x, c) - m) * rs;
            dinp[r * C + c] += rs * (g - mg - xh * mgx);
        }
    }
}
/* parameter gradients, two passes with a fixed order: NCHUNK row chunks x C columns of partial
 * sums (a thread per (chunk, column), coalesced along the columns), then a thread per column adds
 * its chunks in order */
#define NCHUNK 128
template <typename T>
__global__ static void norm_bw_partial(double *part, const float *dout, const T *inp, const float *mean,
                                       const float *rstd, int64_t rows, int64_t C, int64_t nch, int rms) {
    ULY_CU_FOR(e, nch * C) {
        int64_t k = e / C, c = e % C, r0 = rows * k / nch, r1 = rows * (k + 1) / nch;
        double sw = 0.0, sb = 0.0;
        for (int64_t r = r0; r < r1; r++) {
            float d = dout[r * C + c], xh = (uly_cu_ld(inp, r * C + c) - (rms ? 0.0f : mean[r])) * rstd[r];
            sw += (double)d * xh;
            sb += d;
        }
        part[e] = sw;
        part[nch * C + e] = sb;
    }
}
__global__ static void norm_bw_total(float *dw, float *db, const double *part, int64_t C, int64_t nch) {
    ULY_CU_FOR(c, C) {
        double sw = 0.0, sb = 0.0;
        for (int64_t k = 0; k < nch; k++) { sw += part[k * C + c]; sb += part[nch * C + k * C + c]; }
        if (dw) dw[c] += (float)sw;
        if (db) db[c] += (float)sb;
    }
}
template <typename T>
static void norm_bw_params(float *dw, float *db, const float *dout, const T *inp, const float *mean,
                           const float *rstd, int64_t rows, int64_t C, int rms) {
    int64_t nch = rows < NCHUNK ? (rows > 0 ? rows : 1) : NCHUNK;
    double *part = NULL;
    cudaError_t e = cudaMallocAsync((void **)&part, (size_t)(2 * nch * C) * sizeof(double), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("norm backward scratch", e); return; }
    LAUNCH_T("norm_bw_partial", norm_bw_partial<T>, nch * C, part, dout, inp, mean, rstd, rows, C, nch, rms);
    LAUNCH(norm_bw_total, C, dw, db, part, C, nch);
    cudaFreeAsync(part, uly_cu_stream);
}
template <typename T>
static void layernorm_fw(T *out, float *mean, float *rstd, const T *inp, const float *w, const float *b, int64_t rows,
                         int64_t C, float eps) {
    if (C > 0) LAUNCH_ROWS_T("norm_fw", norm_fw<T>, rows, out, mean, rstd, inp, w, b, rows, C, eps, 0);
}
template <typename T>
static void layernorm_bw(float *dinp, float *dw, float *db, const float *dout, const T *inp, const float *w,
                         const float *mean, const float *rstd, int64_t rows, int64_t C) {
    if (C <= 0) return;
    if (dinp) LAUNCH_ROWS_T("norm_bw_input", norm_bw_input<T>, rows, dinp, dout, inp, w, mean, rstd, rows, C, 0);
    if (dw || db) norm_bw_params(dw, db, dout, inp, mean, rstd, rows, C, 0);
}
template <typename T>
static void rmsnorm_fw(T *out, float *rstd, const T *inp, const float *w, int64_t rows, int64_t C, float eps) {
    if (C > 0) LAUNCH_ROWS_T("norm_fw", norm_fw<T>, rows, out, (float *)NULL, rstd, inp, w, (const float *)NULL, rows, C, eps, 1);
}
template <typename T>
static void rmsnorm_bw(float *dinp, float *dw, const float *dout, const T *inp, const float *w, const float *rstd,
                       int64_t rows, int64_t C) {
    if (C <= 0) return;
    if (dinp) LAUNCH_ROWS_T("norm_bw_input", norm_bw_input<T>, rows, dinp, dout, inp, w, (const float *)NULL, rstd, rows, C, 1);
    if (dw) norm_bw_params(dw, (float *)NULL, dout, inp, (const float *)NULL, rstd, rows, C, 1);
}
extern "C" void cu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                                     int64_t rows, int64_t C, float eps) {
    layernorm_fw(out, mean, rstd, inp, w, b, rows, C, eps);
}
extern "C" void cu_layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                                      const float *mean, const float *rstd, int64_t rows, int64_t C) {
    layernorm_bw(dinp, dw, db, dout, inp, w, mean, rstd, rows, C);
}
extern "C" void cu_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, int64_t rows, int64_t C, float eps) {
    rmsnorm_fw(out, rstd, inp, w, rows, C, eps);
}
extern "C" void cu_rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                    const float *rstd, int64_t rows, int64_t C) {
    rmsnorm_bw(dinp, dw, dout, inp, w, rstd, rows, C);
}
/* bf16 activations: the input and output as bf16 */
extern "C" int cu_layernorm_forward_bf16(void *out, float *mean, float *rstd, const void *inp, const float *w,
                                         const float *b, int64_t rows, int64_t C, float eps) {
    layernorm_fw((uint16_t *)out, mean, rstd, (const uint16_t *)inp, w, b, rows, C, eps);
    return 0;
}
extern "C" int cu_layernorm_backward_bf16(float *dinp, float *dw, float *db, const float *dout, const void *inp,
                                          const float *w, const float *mean, const float *rstd, int64_t rows, int64_t C) {
    layernorm_bw(dinp, dw, db, dout, (const uint16_t *)inp, w, mean, rstd, rows, C);
    return 0;
}
extern "C" int cu_rmsnorm_forward_bf16(void *out, float *rstd, const void *inp, const float *w, int64_t rows, int64_t C,
                                       float eps) {
    rmsnorm_fw((uint16_t *)out, rstd, (const uint16_t *)inp, w, rows, C, eps);
    return 0;
}
extern "C" int cu_rmsnorm_backward_bf16(float *dinp, float *dw, const float *dout, const void *inp, const float *w,
                                        const float *rstd, int64_t rows, int64_t C) {
    rmsnorm_bw(dinp, dw, dout, (const uint16_t *)inp, w, rstd, rows, C);
    return 0;
}

/* ---- embedding ---- */
__device__ static inline int64_t load_idx(const void *p, int bytes, int64_t i) {
    return bytes == 4 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}
__global__ static void embed_fw(float *out, const void *idx, int ib, const float *w, int64_t n, int64_t C) {
    ULY_CU_FOR(e, n * C) out[e] = w[load_idx(idx, ib, e / C) * C + e % C];
}
/* a thread per column walks the rows in order: deterministic, no atomics */
__global__ static void embed_bw(float *dw, const float *dout, const void *idx, int ib, int64_t n, int64_t C) {
    ULY_CU_FOR(c, C)
        for (int64_t i = 0; i < n; i++) dw[load_idx(idx, ib, i) * C + c] += dout[i * C + c];
}
extern "C" void cu_embedding_forward(float *out, const void *idx, int ib, const float *w, int64_t n, int64_t C) {
    LAUNCH(embed_fw, n * C, out, idx, ib, w, n, C);
}
extern "C" void cu_embedding_backward(float *dw, const float *dout, const void *idx, int ib, int64_t n, int64_t C) {
    if (dw) LAUNCH(embed_bw, C, dw, dout, idx, ib, n, C);
}
__global__ static void first_bad(unsigned long long *first, const void *idx, int ib, int64_t n, int64_t V) {
    ULY_CU_FOR(i, n) {
        int64_t v = load_idx(idx, ib, i);
        if (v < 0 || v >= V) atomicMin(first, (unsigned long long)i);
    }
}
extern "C" int64_t cu_embedding_first_bad_index(const void *idx, int ib, int64_t n, int64_t V) {
    unsigned long long *first = (unsigned long long *)uly_cu_scratch(), host = (unsigned long long)n;
    if (n <= 0) return -1;
    cudaMemcpyAsync(first, &host, sizeof host, cudaMemcpyHostToDevice, uly_cu_stream);
    LAUNCH(first_bad, n, first, idx, ib, n, V);
    if (uly_cu_read_back(&host, first, sizeof host)) return -1;
    return host < (unsigned long long)n ? (int64_t)host : -1;
}

/* ---- cross-entropy: a block per row; count of non-ignored rows read back ---- */
template <typename T>
__global__ static void ce_fw(float *loss, float *lse, const T *logits, const void *t, int tb, int64_t rows, int64_t V,
                             int64_t ignore) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t tr = load_idx(t, tb, r);
        if (tr == ignore) {
            if (threadIdx.x == 0) { loss[r] = 0.0f; lse[r] = 0.0f; }
            continue;
        }
        const T *x = logits + r * V;
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, uly_cu_ld(x, j));
        m = uly_cu_block_max(m);
        double s = 0.0;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(uly_cu_ld(x, j) - m);
        s = uly_cu_block_sum(s);
        if (threadIdx.x == 0) {
            float l = m + (float)log(s);
            lse[r] = l;
            loss[r] = l - uly_cu_ld(x, tr);
        }
    }
}
__global__ static void ce_count(unsigned long long *count, const void *t, int tb, int64_t rows, int64_t ignore) {
    unsigned long long mine = 0;
    ULY_CU_FOR(r, rows) mine += load_idx(t, tb, r) != ignore;
    if (mine) atomicAdd(count, mine);   /* integers: order does not matter */
}
template <typename T>
static int64_t ce_forward(float *loss, float *lse, const T *logits, const void *t, int tb, int64_t rows, int64_t V,
                          int64_t ignore) {
    if (rows <= 0) return 0;
    LAUNCH_ROWS_T("ce_fw", ce_fw<T>, rows, loss, lse, logits, t, tb, rows, V, ignore);
    unsigned long long *count = (unsigned long long *)uly_cu_scratch(), host = 0;
    cudaMemsetAsync(count, 0, sizeof host, uly_cu_stream);
    LAUNCH(ce_count, rows, count, t, tb, rows, ignore);
    if (uly_cu_read_back(&host, count, sizeof host)) return 0;
    return (int64_t)host;
}
extern "C" int64_t cu_cross_entropy_forward(float *loss, float *lse, const float *logits, const void *t, int tb, int64_t rows,
                                            int64_t V, int64_t ignore) {
    return ce_forward(loss, lse, logits, t, tb, rows, V, ignore);
}
extern "C" int64_t cu_cross_entropy_forward_bf16(float *loss, float *lse, const void *logits, const void *t, int tb,
                                                 int64_t rows, int64_t V, int64_t ignore) {
    return ce_forward(loss, lse, (const uint16_t *)logits, t, tb, rows, V, ignore);
}
template <typename T>
__global__ static void ce_bw(float *dl, const float *dloss, const T *logits, const float *lse, const void *t, int tb,
                             int64_t rows, int64_t V, int64_t ignore) {
    ULY_CU_FOR(e, rows * V) {
        int64_t r = e / V, j = e % V, tr = load_idx(t, tb, r);
        if (tr == ignore) continue;
        dl[e] += dloss[r] * (expf(uly_cu_ld(logits, e) - lse[r]) - (j == tr ? 1.0f : 0.0f));
    }
}
extern "C" void cu_cross_entropy_backward(float *dlogits, const float *dloss, const float *logits, const float *lse,
                                          const void *t, int tb, int64_t rows, int64_t V, int64_t ignore) {
    LAUNCH_AS_("ce_bw", ce_bw<float>, rows * V, dlogits, dloss, logits, lse, t, tb, rows, V, ignore);
}
extern "C" int cu_cross_entropy_backward_bf16(float *dlogits, const float *dloss, const void *logits, const float *lse,
                                              const void *t, int tb, int64_t rows, int64_t V, int64_t ignore) {
    LAUNCH_AS_("ce_bw bf16", ce_bw<uint16_t>, rows * V, dlogits, dloss, (const uint16_t *)logits, lse, t, tb, rows, V, ignore);
    return 0;
}

/* ---- optimizers ---- */
/* a1 = 1 - b1 and a2 = 1 - b2 as the host rounded them from double (kernels/cpu/kernels.h).
 * Each element as kernels/cpu/optim.c does it (torch.optim.AdamW's ops, rounded where ATen's CPU
 * kernels round): the _rn intrinsics keep nvcc from fusing a product into a sum that the CPU
 * rounds twice, so the GPU's update has the CPU's bits. */
__device__ static inline void adamw_one(float *p, float g, float *m, float *v, float decay, float b1, float a1,
                                        float b2, float a2, float step_size, float bc2_sqrt, float eps) {
    const float mi = __fmaf_rn(g, a1, __fmul_rn(*m, b1));
    const float vi = __fmaf_rn(__fmul_rn(a2, g), g, __fmul_rn(*v, b2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    *m = mi;
    *v = vi;
    *p = __fadd_rn(__fmul_rn(*p, decay), __fdiv_rn(__fmul_rn(-step_size, mi), denom));
}
__global__ static void adamw_k(float *p, const float *g, float *m, float *v, int64_t n, float decay, float b1, float a1,
                               float b2, float a2, float step_size, float bc2_sqrt, float eps) {
    ULY_CU_FOR(i, n) adamw_one(p + i, g[i], m + i, v + i, decay, b1, a1, b2, a2, step_size, bc2_sqrt, eps);
}
extern "C" void cu_optim_adamw(float *p, const float *g, float *m, float *v, int64_t n, float decay, float b1, float a1,
                               float b2, float a2, float step_size, float bc2_sqrt, float eps) {
    LAUNCH(adamw_k, n, p, g, m, v, n, decay, b1, a1, b2, a2, step_size, bc2_sqrt, eps);
}
/* AdamW over many parameters in one launch: element e of the concatenation belongs to the
 * parameter whose [offset, next offset) holds it (binary search over the prefix offsets) */
typedef struct { float *p; const float *g; float *m, *v; int64_t offset; float decay; } adamw_part;
__global__ static void adamw_multi_k(const adamw_part *parts, int n, int64_t total, float b1, float a1, float b2,
                                     float a2, float step_size, float bc2_sqrt, float eps) {
    ULY_CU_FOR(e, total) {
        int lo = 0, hi = n - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (parts[mid].offset <= e) lo = mid; else hi = mid - 1;
        }
        const adamw_part &q = parts[lo];
        int64_t i = e - q.offset;
        adamw_one(q.p + i, q.g[i], q.m + i, q.v + i, q.decay, b1, a1, b2, a2, step_size, bc2_sqrt, eps);
    }
}
extern "C" void cu_optim_adamw_multi(int n, float *const *p, const float *const *g, float *const *m, float *const *v,
                                     const int64_t *sizes, const float *decay, float b1, float a1, float b2, float a2,
                                     float step_size, float bc2_sqrt, float eps) {
    if (n <= 0) return;
    adamw_part *host = (adamw_part *)malloc((size_t)n * sizeof *host), *dev = NULL;
    if (!host) { uly_cu_fail_msg("optim_adamw_multi", "out of host memory"); return; }
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        host[i].p = p[i]; host[i].g = g[i]; host[i].m = m[i]; host[i].v = v[i];
        host[i].offset = total;
        host[i].decay = decay[i];
        total += sizes[i];
    }
    cudaError_t e = cudaMallocAsync((void **)&dev, (size_t)n * sizeof *dev, uly_cu_stream);
    if (e == cudaSuccess) e = cudaMemcpyAsync(dev, host, (size_t)n * sizeof *dev, cudaMemcpyHostToDevice, uly_cu_stream);
    if (e != cudaSuccess) {
        free(host);
        uly_cu_fail("optim_adamw_multi", e);
        if (dev) cudaFreeAsync(dev, uly_cu_stream);
        return;
    }
    if (uly_cu_stream_wait("optim_adamw_multi")) return;   /* the copy may still read host: kept */
    free(host);   /* copied */
    LAUNCH(adamw_multi_k, total, dev, n, total, b1, a1, b2, a2, step_size, bc2_sqrt, eps);
    cudaFreeAsync(dev, uly_cu_stream);
}

/* keep = 1 - dampening, as the host rounded it from double */
__global__ static void sgd_k(float *p, const float *g, float *buf, int64_t n, float lr, float wd, float mom, float keep,
                             int nesterov, int init) {
    ULY_CU_FOR(i, n) { /* torch.optim.SGD's ops, rounded as kernels/cpu/optim.c */
        float d = wd != 0.0f ? __fmaf_rn(p[i], wd, g[i]) : g[i];
        if (buf) {
            float b = init ? d : __fmaf_rn(d, keep, __fmul_rn(buf[i], mom));
            buf[i] = b;
            d = nesterov ? __fmaf_rn(b, mom, d) : b;
        }
        p[i] = __fmaf_rn(d, -lr, p[i]);
    }
}
extern "C" void cu_optim_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float wd, float momentum, float keep,
                             int nesterov, int init) {
    LAUNCH(sgd_k, n, p, g, buf, n, lr, wd, momentum, keep, nesterov, init);
}
/* sum of squares: up to SUMSQ_BLOCKS partial sums (how many is a function of n only), added in order */
#define SUMSQ_BLOCKS 1024
__global__ static void sumsq_part(double *part, const float *x, int64_t n) {
    double s = 0.0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        s += (double)x[i] * x[i];
    s = uly_cu_block_sum(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
__global__ static void sumsq_total(double *part, int nparts) {
    double s = 0.0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += part[i];
    s = uly_cu_block_sum(s);
    if (threadIdx.x == 0) part[0] = s;
}
extern "C" double cu_optim_sumsq(const float *x, int64_t n) {
    if (n <= 0) return 0.0;
    double *part = (double *)uly_cu_scratch(), host = 0.0;
    int blocks = (int)((n + THREADS - 1) / THREADS < SUMSQ_BLOCKS ? (n + THREADS - 1) / THREADS : SUMSQ_BLOCKS);
    ULY_LAUNCH(sumsq_part, blocks, THREADS, uly_cu_stream)(part, x, n);
    ULY_CU_LAUNCHED("sumsq_part");
    ULY_LAUNCH(sumsq_total, 1, 1024, uly_cu_stream)(part, blocks);
    ULY_CU_LAUNCHED("sumsq_total");
    if (uly_cu_read_back(&host, part, sizeof host)) return 0.0;
    return host;
}
__global__ static void scale_k(float *x, int64_t n, float s) { ULY_CU_FOR(i, n) x[i] *= s; }
extern "C" void cu_optim_scale(float *x, int64_t n, float s) { LAUNCH(scale_k, n, x, n, s); }
