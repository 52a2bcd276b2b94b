/* kernels/cpu/peak.c — this machine's f32 FMA peak, measured: every thread runs chains of
 * independent vector fused multiply-adds (the widest vectors the build targets: AVX-512 with
 * -march=native on such a CPU, else AVX2 / SSE) for a fixed number of rounds, and the FLOP/s of
 * the slowest thread times the thread count is the peak. MFU (train.lua, bench/train.lua) is
 * model FLOP/s over this, so it is right on any CPU, not only the one a constant was taken on.
 * The best of three runs; about 15 ms per call with AVX-512. */
#include "kernels.h"
#include <omp.h>
#include <time.h>

#if defined(__AVX512F__)
#define PEAK_LANES 16
#elif defined(__AVX__)
#define PEAK_LANES 8
#else
#define PEAK_LANES 4
#endif
typedef float peak_vec __attribute__((vector_size(PEAK_LANES * sizeof(float))));

#define PEAK_CHAINS 12        /* independent accumulators: covers FMA latency x units */
#define PEAK_ROUNDS 1000000   /* per thread and run: 12 x 1M FMAs of PEAK_LANES lanes */

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* the chains on one thread; the sum is returned so the work cannot be optimised away */
__attribute__((noinline)) static float fma_chains(float seed) {
    peak_vec acc[PEAK_CHAINS], mul, add;
    for (int l = 0; l < PEAK_LANES; l++) { mul[l] = 0.999999f; add[l] = seed * 1e-7f; }
    for (int c = 0; c < PEAK_CHAINS; c++)
        for (int l = 0; l < PEAK_LANES; l++) acc[c][l] = seed + (float)c;
    __asm__("" : "+v"(mul), "+v"(add));   /* kept in registers: FMAs without memory operands */
    for (long r = 0; r < PEAK_ROUNDS; r++)
#pragma GCC unroll 12
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = acc[c] * mul + add;   /* one FMA each */
    float s = 0.0f;
    for (int c = 0; c < PEAK_CHAINS; c++)
        for (int l = 0; l < PEAK_LANES; l++) s += acc[c][l];
    return s;
}

double slowest_thread_best_of_three(double (*thread_seconds)(void), int threads) {
    if (threads < 1) threads = 1;
    double slowest = 0.0;
    for (int attempt = 0; attempt < 3; attempt++) {
        double worst = 0.0;
#pragma omp parallel num_threads(threads) reduction(max : worst)
        {
#pragma omp barrier
            double t = thread_seconds();
            worst = t > worst ? t : worst;
        }
        if (attempt == 0 || worst < slowest) slowest = worst;
    }
    return slowest;
}

double cpu_fma_peak(int threads) {
    if (threads < 1) threads = 1;
    double slowest = 0.0;
    float sink = 0.0f;
    for (int attempt = 0; attempt < 3; attempt++) {   /* the best of three: clocks warm, less noise */
        double worst = 0.0;
#pragma omp parallel num_threads(threads) reduction(max : worst) reduction(+ : sink)
        {
#pragma omp barrier
            double t0 = seconds();
            sink += fma_chains((float)omp_get_thread_num());
            double t = seconds() - t0;
            worst = t > worst ? t : worst;
        }
        if (attempt == 0 || worst < slowest) slowest = worst;
    }
    if (sink == 12345.678f) slowest *= 1.0000001;     /* uses the sum */
    const double flops = 2.0 * PEAK_LANES * PEAK_CHAINS * (double)PEAK_ROUNDS;
    return slowest > 0.0 ? flops * threads / slowest : 0.0;
}
