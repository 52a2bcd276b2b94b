/* kernels/cpu/embedding.c — embedding lookup.
 *
 *   forward : out[i, :] = weight[idx[i], :]        out [n, C], weight [V, C]
 *   backward: dweight[idx[i], :] += dout[i, :]      dout [n, C], dweight [V, C]
 *   first_bad_index: first i with idx[i] outside [0, V), or -1.
 * idx is int32 (idx_bytes 4) or int64 (idx_bytes 8); the dispatch layer has range-checked it.
 * Backward ACCUMULATES (+=) into dweight; a NULL dweight is skipped.
 * Determinism: backward splits the C columns among threads (chunks of whole cache lines) and
 * every thread walks the rows i = 0..n-1 in order, so each dweight element receives its
 * contributions in the same order whatever the thread count (no atomics, no racy scatter).
 */
#include "kernels.h"
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define EMB_PAR_MIN 32768 /* elements below which threads are not worth starting */

static inline int64_t load_idx(const void *idx, int idx_bytes, int64_t i) {
    return idx_bytes == 4 ? (int64_t)((const int32_t *)idx)[i] : ((const int64_t *)idx)[i];
}

void embedding_forward(float *out, const void *idx, int idx_bytes, const float *weight, int64_t n, int64_t C) {
    if (n <= 0 || C <= 0) return;
    #pragma omp parallel for schedule(static) if (n * C >= EMB_PAR_MIN && n > 1)
    for (int64_t i = 0; i < n; i++)
        memcpy(out + i * C, weight + load_idx(idx, idx_bytes, i) * C, (size_t)C * sizeof(float));
}

/* accumulate columns [c0, c1) of every row, rows in order */
static void emb_bwd_cols(float *dweight, const float *dout, const void *idx, int idx_bytes,
                         int64_t n, int64_t C, int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < n; i++) {
        float *restrict dst = dweight + load_idx(idx, idx_bytes, i) * C;
        const float *restrict src = dout + i * C;
        #pragma omp simd
        for (int64_t c = c0; c < c1; c++) dst[c] += src[c];
    }
}

void embedding_backward(float *dweight, const float *dout, const void *idx, int idx_bytes, int64_t n, int64_t C) {
    if (!dweight || n <= 0 || C <= 0) return;
    #pragma omp parallel if (n * C >= EMB_PAR_MIN && C >= 32)
    {
        int nt = 1, tid = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        /* column chunk: a multiple of 16 floats (64 bytes) so threads never share a cache line
         * more than necessary; threads beyond the last chunk idle. */
        int64_t chunk = (C + nt - 1) / nt;
        chunk = (chunk + 15) & ~(int64_t)15;
        int64_t c0 = (int64_t)tid * chunk, c1 = c0 + chunk;
        if (c1 > C) c1 = C;
        if (c0 < c1) emb_bwd_cols(dweight, dout, idx, idx_bytes, n, C, c0, c1);
    }
}

int64_t embedding_first_bad_index(const void *idx, int idx_bytes, int64_t n, int64_t V) {
    int64_t first = n; /* n = none found */
    #pragma omp parallel for schedule(static) reduction(min : first) if (n >= (1 << 18))
    for (int64_t i = 0; i < n; i++) {
        int64_t v = load_idx(idx, idx_bytes, i);
        if ((v < 0 || v >= V) && i < first) first = i;
    }
    return first < n ? first : -1;
}
