/* kernels/cpu/dropout.c — dropout with a counter-based RNG.
 *
 *   forward : out[i] = keep(i) ? inp[i] / (1 - p) : 0            inp, out [n]
 *   backward: dinp[i] += keep(i) ? dout[i] / (1 - p) : 0          dout, dinp [n]
 *   keep(i) = uly_counter_uniform(seed, offset + i) >= p
 * p = 0 keeps everything (out = inp exactly); p >= 1 drops everything (out = 0, nothing added
 * in backward, no division). Backward ACCUMULATES (+=) into dinp; a NULL dinp is skipped.
 * The mask depends only on (seed, offset + i): no RNG state, so results never depend on the
 * thread count, and backward recomputes the mask instead of storing it.
 *
 * RNG (to be reproduced bit-exactly by other back ends):
 *   mix(z)  = splitmix64 finalizer: z ^= z>>30; z *= 0xbf58476d1ce4e5b9; z ^= z>>27;
 *             z *= 0x94d049bb133111eb; z ^= z>>31            (all mod 2^64)
 *   k1 = mix(seed ^ 0x243f6a8885a308d3),  k2 = mix(seed + 0x13198a2e03707344)
 *   h  = mix(mix((counter * 0x9e3779b97f4a7c15) ^ k1) + k2)
 *   uniform = (h >> 40) * 2^-24                 (top 24 bits: exact float in [0, 1))
 * The seed is injected twice (before and after the first mix) so that two seeds never give
 * shifted copies of the same stream.
 */
#include "kernels.h"

#define DROP_PAR_MIN 65536 /* elements below which threads are not worth starting */

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

static inline uint64_t key1(uint64_t seed) { return mix64(seed ^ 0x243f6a8885a308d3ULL); }
static inline uint64_t key2(uint64_t seed) { return mix64(seed + 0x13198a2e03707344ULL); }

static inline float uniform_keyed(uint64_t k1, uint64_t k2, uint64_t counter) {
    uint64_t h = mix64(mix64((counter * 0x9e3779b97f4a7c15ULL) ^ k1) + k2);
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

float uly_counter_uniform(uint64_t seed, uint64_t counter) {
    return uniform_keyed(key1(seed), key2(seed), counter);
}

void dropout_forward(float *out, const float *inp, int64_t n, float p, uint64_t seed, uint64_t offset) {
    if (n <= 0) return;
    if (p >= 1.0f) { /* drop everything */
        #pragma omp parallel for simd schedule(static) if (n >= DROP_PAR_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = 0.0f;
        return;
    }
    const uint64_t k1 = key1(seed), k2 = key2(seed);
    const float scale = 1.0f / (1.0f - p);
    #pragma omp parallel for simd schedule(static) if (n >= DROP_PAR_MIN)
    for (int64_t i = 0; i < n; i++)
        out[i] = uniform_keyed(k1, k2, offset + (uint64_t)i) >= p ? inp[i] * scale : 0.0f;
}

void dropout_backward(float *dinp, const float *dout, int64_t n, float p, uint64_t seed, uint64_t offset) {
    if (!dinp || n <= 0 || p >= 1.0f) return; /* p >= 1: gradient is 0 everywhere */
    const uint64_t k1 = key1(seed), k2 = key2(seed);
    const float scale = 1.0f / (1.0f - p);
    #pragma omp parallel for simd schedule(static) if (n >= DROP_PAR_MIN)
    for (int64_t i = 0; i < n; i++)
        if (uniform_keyed(k1, k2, offset + (uint64_t)i) >= p) dinp[i] += dout[i] * scale;
}
