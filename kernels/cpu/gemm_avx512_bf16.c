/* kernels/cpu/gemm_avx512_bf16.c — the bf16 GEMM's second engine: gemm_amx.c's packed panels
 * multiplied with VDPBF16PS on zmm registers, for CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and
 * 5, Intel Cooper Lake) or with AMX switched off. gemm_amx.c packs and drives as for the tiles and
 * hands each 32 x 32 block of C here (avx512_bf16_block): ROWS rows at a time, 2 x ROWS
 * accumulators (a C row's 32 columns are two zmm), per pair of K the strip's row (two zmm: the
 * pair layout is what VDPBF16PS reads) times each A row's pair (one 32-bit word, broadcast).
 * Products exact, f32 sums over K in one fixed order (VDPBF16PS adds the odd product, then the
 * even one; it flushes denormal inputs and results, as AMX does).
 *
 * Used where AMX is not (gemm_amx_on() 0) and the CPU has AVX512-F/BW/VL/BF16 with the OS keeping
 * the AVX-512 state, unless ULY_CPU_AVX512_BF16=0, and where it pays: VDPBF16PS measured at
 * least 1.25x the f32 FMA rate (2x expected on Zen 4/5; an Intel Emerald Rapids VM ran it at half,
 * where OpenBLAS on rounded copies is faster: there it runs only when asked, ULY_CPU_AVX512_BF16=1
 * or gemm_avx512_bf16_enable(1)); gemm_avx512_bf16_status() says which. Also
 * gemm_avx512_bf16_peak: its measured bf16 peak (MFU's denominator for bf16 on it). */
#include "gemm_bf16.h"
#include "kernels.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static int avx_state = -1;         /* -1 undecided, 0 off, 1 on, 2 there but no faster than f32 */
static int avx_wanted = -1;        /* gemm_avx512_bf16_enable: -1 where it pays, 0 never, 1 always */
static char avx_reason[200] = "undecided";

#ifdef GEMM_BF16_BUILT
#include <cpuid.h>
#include <immintrin.h>

#ifndef ROWS
#define ROWS 8                     /* C rows per register block (<= 14: 2 x ROWS accumulators + 2 B
                                      vectors + a broadcast in 32 zmm); tuned by measurement */
#endif
#define MR GEMM_BF16_MR
#define NR GEMM_BF16_NR
#define TAIL (MR % ROWS ? MR % ROWS : ROWS)   /* the rows left of a block after whole groups */


#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* R rows of a block (c and a at its first row; rows of them valid, stored), nr columns: the sums
 * seeded with the bias or (beta 1) with C, else zeros and C = beta C + them at the end (beta 0:
 * C not read); a bf16 C gets them rounded. R is a constant where inlined: the accumulators stay
 * in registers. */
static inline __attribute__((always_inline)) void row_group(const int R, void *c, int c16, int64_t ld, int64_t rows,
                                                            int64_t nr, float beta, const float *bias,
                                                            const uint16_t *a, const uint32_t *strip, int64_t kcp) {
    const __mmask16 m[2] = {lanes(nr), lanes(nr - 16)};
    const int seed_c = !c16 && !bias && beta == 1.0f, scale_c = !c16 && !bias && beta != 0.0f && beta != 1.0f;
    float *cf = c;
    uint16_t *ch = c;
    __m512 acc[2 * ROWS];
    #pragma GCC unroll 32
    for (int i = 0; i < 2 * R; i++) {
        const int r = i / 2, h = i % 2;
        acc[i] = r >= rows ? _mm512_setzero_ps()
                 : bias    ? _mm512_maskz_loadu_ps(m[h], bias + 16 * h)
                 : seed_c  ? _mm512_maskz_loadu_ps(m[h], cf + r * ld + 16 * h)
                           : _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kcp / 2; p++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(strip + p * NR);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(strip + p * NR + 16);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            uint32_t w;
            memcpy(&w, a + r * kcp + 2 * p, sizeof w);   /* A[r][2p], A[r][2p + 1]: one pair */
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)w);
            acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], x, b0);
            acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], x, b1);
        }
    }
    #pragma GCC unroll 32
    for (int i = 0; i < 2 * R; i++) {
        const int r = i / 2, h = i % 2;
        if (r >= rows) break;
        if (c16) {
            _mm256_mask_storeu_epi16(ch + r * ld + 16 * h, m[h], (__m256i)_mm512_cvtneps_pbh(acc[i]));
        } else {
            float *dst = cf + r * ld + 16 * h;
            __m512 v = acc[i];
            if (scale_c) v = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m[h], dst), v);
            _mm512_mask_storeu_ps(dst, m[h], v);
        }
    }
}

static void group_whole(void *c, int c16, int64_t ld, int64_t rows, int64_t nr, float beta, const float *bias,
                        const uint16_t *a, const uint32_t *strip, int64_t kcp) {
    row_group(ROWS, c, c16, ld, rows, nr, beta, bias, a, strip, kcp);
}
static void group_tail(void *c, int c16, int64_t ld, int64_t rows, int64_t nr, float beta, const float *bias,
                       const uint16_t *a, const uint32_t *strip, int64_t kcp) {
    row_group(TAIL, c, c16, ld, rows, nr, beta, bias, a, strip, kcp);
}

/* the block in groups of ROWS rows (the last one of a block TAIL rows: A is padded to MR), those
 * wholly past mr skipped */
void avx512_bf16_block(void *c, int c16, int64_t ld, int64_t mr, int64_t nr, float beta, const float *bias,
                       const uint16_t *a, const uint32_t *strip, int64_t kcp) {
    for (int64_t r0 = 0; r0 < mr; r0 += ROWS) {
        void *cr = (char *)c + r0 * ld * (c16 ? 2 : 4);
        const int64_t rows = mr - r0 < ROWS ? mr - r0 : ROWS;
        if (MR - r0 >= ROWS) group_whole(cr, c16, ld, rows, nr, beta, bias, a + r0 * kcp, strip, kcp);
        else group_tail(cr, c16, ld, rows, nr, beta, bias, a + r0 * kcp, strip, kcp);
    }
}

/* VDPBF16PS's rate on one thread: PEAK_CHAINS independent accumulators (latency x throughput),
 * PEAK_ROUNDS of them, each 16 lanes x 2 multiply-adds; ones, not zeros, as the AMX peak */
#define PEAK_CHAINS 16
#define PEAK_ROUNDS 200000
static double peak_thread(void) {
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80);   /* a pair of bf16 1.0 */
    __m512 acc[PEAK_CHAINS];
    for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_setzero_ps();
    double t0 = omp_get_wtime();
    for (int r = 0; r < PEAK_ROUNDS; r++) {
        #pragma GCC unroll 16
        for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], ones, ones);
    }
    __m512 sum = acc[0];
    for (int i = 1; i < PEAK_CHAINS; i++) sum = _mm512_add_ps(sum, acc[i]);
    double t = omp_get_wtime() - t0;
    return _mm512_reduce_add_ps(sum) == 1.5f ? t * 1.0000001 : t;   /* the sums are used */
}
#pragma GCC pop_options

static int decide(void) {
    const char *env = getenv("ULY_CPU_AVX512_BF16");
    if (env && strcmp(env, "0") == 0) {
        snprintf(avx_reason, sizeof avx_reason, "off: ULY_CPU_AVX512_BF16=0");
        return 0;
    }
    unsigned a, b, c, d, a1 = 0, b1, c1, d1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16)) || !(b & (1u << 30)) || !(b & (1u << 31)) ||
        !__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 & (1u << 5))) {
        snprintf(avx_reason, sizeof avx_reason, "off: this CPU has no AVX512-BF16 (with AVX512-F, BW and VL)");
        return 0;
    }
    unsigned lo = 0, hi;
    if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27))) __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xE6u) != 0xE6u) {
        snprintf(avx_reason, sizeof avx_reason, "off: the OS has not enabled the AVX-512 state (XCR0 %#x)", lo);
        return 0;
    }
    if (env && strcmp(env, "1") == 0) avx_wanted = 1;
    /* does it pay? VDPBF16PS's rate on one thread against f32 FMA's (the best of three each) */
    const double best = slowest_thread_best_of_three(peak_thread, 1);
    const double bf16 = best > 0.0 ? (double)PEAK_CHAINS * PEAK_ROUNDS * (16.0 * 2 * 2) / best : 0.0;
    const double f32 = cpu_fma_peak(1);
    if (bf16 < 1.25 * f32) {
        snprintf(avx_reason, sizeof avx_reason,
                 "off: VDPBF16PS runs at %.2fx the f32 FMA rate here (%.0f against %.0f GFLOP/s a thread), "
                 "so OpenBLAS on rounded copies is as fast; uly.cpu_avx512_bf16(true) uses it anyway",
                 f32 > 0.0 ? bf16 / f32 : 0.0, bf16 / 1e9, f32 / 1e9);
        return 2;
    }
    snprintf(avx_reason, sizeof avx_reason, "on");
    return 1;
}

double gemm_avx512_bf16_peak(int threads) {
    if (!gemm_avx512_bf16_on()) return 0.0;
    if (threads < 1) threads = 1;
    const double slowest = slowest_thread_best_of_three(peak_thread, threads);
    return slowest > 0.0 ? (double)PEAK_CHAINS * PEAK_ROUNDS * (16.0 * 2 * 2) * threads / slowest : 0.0;
}
#else
double gemm_avx512_bf16_peak(int threads) { (void)threads; return 0.0; }
#endif /* GEMM_BF16_BUILT */

int gemm_avx512_bf16_on(void) {
    if (avx_state < 0) {
#ifdef GEMM_BF16_BUILT
        avx_state = decide();
#else
        snprintf(avx_reason, sizeof avx_reason,
                 "off: built without AVX512-BF16 support (needs x86-64 Linux, gcc >= 11 or clang >= 12)");
        avx_state = 0;
#endif
    }
    return avx_state == 1 ? avx_wanted != 0 : avx_state == 2 && avx_wanted == 1;
}

const char *gemm_avx512_bf16_status(void) {
    if (gemm_avx512_bf16_on()) return "on";
    return avx_state && avx_wanted == 0 ? "off: switched off (uly.cpu_avx512_bf16(false))" : avx_reason;
}

int gemm_avx512_bf16_enable(int on) {
    int prev = avx_wanted;
    avx_wanted = on < 0 ? -1 : on != 0;
    return prev;
}
