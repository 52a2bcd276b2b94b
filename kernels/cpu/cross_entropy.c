/* kernels/cpu/cross_entropy.c — cross-entropy fused with log-softmax.
 *
 * logits [rows, V]; targets [rows], int32 (target_bytes 4) or int64 (8).
 *   forward : for rows with t = targets[r] != ignore_index:
 *               lse[r]  = log sum_j exp(logits[r, j])   (max-subtracted, summed in double)
 *               loss[r] = lse[r] - logits[r, t]
 *             ignored rows: loss[r] = 0, lse[r] = 0. Returns the number of non-ignored rows.
 *   backward: dlogits[r, j] += dloss[r] * (exp(logits[r, j] - lse[r]) - [j == t])
 *             for non-ignored rows (ignored rows receive nothing).
 * Backward ACCUMULATES (+=) into dlogits; a NULL dlogits is skipped.
 * Parallel over rows; each row is reduced sequentially by one thread, so results do not
 * depend on the thread count. The *_io forms read the logits through a uly_row_io (kernels.h):
 * the bf16 twins (bf16_twins.c) run this same code on per-thread f32 copies of each row.
 */
#include "kernels.h"
#include <math.h>
#include <stddef.h>

#define CE_PAR_MIN 32768 /* elements below which threads are not worth starting */

static inline int64_t load_target(const void *targets, int target_bytes, int64_t r) {
    return target_bytes == 4 ? (int64_t)((const int32_t *)targets)[r] : ((const int64_t *)targets)[r];
}

int64_t cross_entropy_forward_io(const uly_row_io *io, float *loss, float *lse, const void *logits,
                                 const void *targets, int target_bytes, int64_t rows, int64_t V, int64_t ignore_index) {
    int64_t count = 0;
    if (rows <= 0) return 0;
    #pragma omp parallel for schedule(static) reduction(+ : count) if (rows * V >= CE_PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = load_target(targets, target_bytes, r);
        if (t == ignore_index) {
            loss[r] = 0.0f;
            lse[r] = 0.0f;
            continue;
        }
        const float *x = row_in(io, logits, r * V, V);
        float m = -INFINITY;
        for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
        double s = 0.0;
        for (int64_t j = 0; j < V; j++) s += (double)expf(x[j] - m);
        double l = (double)m + log(s);
        lse[r] = (float)l;
        loss[r] = (float)(l - (double)x[t]);
        count++;
    }
    return count;
}

int64_t cross_entropy_forward(float *loss, float *lse, const float *logits, const void *targets,
                              int target_bytes, int64_t rows, int64_t V, int64_t ignore_index) {
    return cross_entropy_forward_io(NULL, loss, lse, logits, targets, target_bytes, rows, V, ignore_index);
}

void cross_entropy_backward_io(const uly_row_io *io, float *dlogits, const float *dloss, const void *logits,
                               const float *lse, const void *targets, int target_bytes, int64_t rows, int64_t V,
                               int64_t ignore_index) {
    if (!dlogits || rows <= 0) return;
    #pragma omp parallel for schedule(static) if (rows * V >= CE_PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = load_target(targets, target_bytes, r);
        if (t == ignore_index) continue;
        const float g = dloss[r], l = lse[r];
        const float *x = row_in(io, logits, r * V, V);
        float *d = dlogits + r * V;
        for (int64_t j = 0; j < t; j++) d[j] += g * expf(x[j] - l);
        d[t] += g * (expf(x[t] - l) - 1.0f);
        for (int64_t j = t + 1; j < V; j++) d[j] += g * expf(x[j] - l);
    }
}

void cross_entropy_backward(float *dlogits, const float *dloss, const float *logits, const float *lse,
                            const void *targets, int target_bytes, int64_t rows, int64_t V, int64_t ignore_index) {
    cross_entropy_backward_io(NULL, dlogits, dloss, logits, lse, targets, target_bytes, rows, V, ignore_index);
}
