/* kernels/cpu/gemm_amx.c — bf16 GEMM on Intel AMX tiles (TDPBF16PS) for bf16 mixed precision on
 * the CPU: C (f32) = beta C + A B with A and B rounded to bf16 (nearest even) on the way in,
 * products exact, f32 accumulation (FTZ/DAZ, as AMX and the AVX-512 BF16 conversions work).
 * The packing and the driver here also serve the second engine, VDPBF16PS on zmm registers
 * (gemm_avx512_bf16.c), which computes the same blocks where AMX is off (gemm_bf16_engine()).
 *
 * Blocking: B is packed once per (NC columns, KC rows) panel into 32-column strips of bf16 pairs
 * (the VNNI layout TDPBF16PS reads: a row per pair of K, a 32-bit word per column), A per
 * thread into MC x KC blocks of bf16 rows; a 32 x 32 block of C is four 16 x 16 f32 tiles fed by
 * two A and two B tiles a step of 32 in K, then added into C with its strides. Panels are padded
 * with zeros to whole tiles, so any M, N, K work; A and B need a unit stride along their rows or
 * their columns (a 16 x 16 transpose of bf16 pairs packs the transposed operands of the backward
 * GEMMs), C along its rows, else OpenBLAS takes the GEMM. Work is split over OpenMP threads by
 * (row block, column strip), each C element summed over K in the same order at any thread count.
 * Also here: tile_gemm_amx, flash attention's small tile products on the same micro-kernel,
 * gemm_amx_peak, the tiles' measured bf16 peak (MFU's denominator for bf16 on them), and
 * gemm_bf16_engine, which engine runs the bf16 GEMMs (AMX first, then AVX512-BF16) or why none.
 *
 * AMX is used where the CPU has AMX-BF16 and AVX512-BF16 and Linux grants the tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM), unless ULY_CPU_AMX=0; gemm_amx_status() says which. */
#include "gemm_bf16.h"
#include "kernels.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef GEMM_BF16_BUILT
#define AMX_BUILT 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int amx_state = -1;         /* -1 undecided, 0 off, 1 on */
static int amx_wanted = 1;         /* gemm_amx_enable */
static char amx_reason[160] = "undecided";

#ifdef AMX_BUILT
#define MR GEMM_BF16_MR             /* a C block: 2 x 2 tiles of 16 x 16 */
#define NR GEMM_BF16_NR
#ifndef KC
#define KC 1024                    /* K per packed panel (a multiple of 32; 1024 ran the GEMMs of a
                                      step as fast as 512 or faster, up to 1.3x on [8192, 768] x [768, 256]) */
#endif
#ifndef NC
#define NC 512                     /* columns per packed B panel (a multiple of NR) */
#endif
#ifndef MC
#define MC 64                      /* rows per packed A block (a multiple of MR) */
#endif
#define SPLIT_MIN_MACS (1LL << 21) /* multiply-adds below which one thread does the GEMM */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int decide(void) {
    const char *env = getenv("ULY_CPU_AMX");
    if (env && strcmp(env, "0") == 0) {
        snprintf(amx_reason, sizeof amx_reason, "off: ULY_CPU_AMX=0");
        return 0;
    }
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)) || !(b & (1u << 16)) ||
        !(b & (1u << 30))) {
        snprintf(amx_reason, sizeof amx_reason, "off: this CPU has no AMX-BF16 tiles");
        return 0;
    }
    unsigned a1 = 0, b1, c1, d1;
    if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 & (1u << 5))) {
        snprintf(amx_reason, sizeof amx_reason, "off: this CPU has AMX but not AVX512-BF16");
        return 0;
    }
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xE6u) != 0xE6u || !(lo & (1u << 17))) {
        snprintf(amx_reason, sizeof amx_reason, "off: the OS has not enabled AVX-512 or AMX state (XCR0 %#x)", lo);
        return 0;
    }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(amx_reason, sizeof amx_reason, "off: Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
        return 0;
    }
    snprintf(amx_reason, sizeof amx_reason, "on");
    return 1;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

/* pairs: lo in the low, hi in the high half of each word (both rounded in one conversion, then
 * interleaved by one permute: word w = (lo[w], hi[w])) */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                                21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
/* 32 f32 as 32 consecutive bf16 (= 16 pair words): element 2q low, 2q + 1 high */
static inline __m512i bf16_run(__m512 first16, __m512 next16) {
    return (__m512i)_mm512_cvtne2ps_pbh(next16, first16);
}

/* the 16 x 16 transpose of 32-bit words: four stages, each swapping bit s of the row and the lane */
static void transpose16(__m512i r[16]) {
    for (int d = 8; d >= 1; d >>= 1) {
        int lo_idx[16], hi_idx[16];
        for (int l = 0; l < 16; l++) {
            int blk = l / (2 * d) * 2 * d, off = l % (2 * d);
            lo_idx[l] = off < d ? blk + off : 16 + blk + off - d;
            hi_idx[l] = off < d ? blk + d + off : 16 + blk + off;
        }
        __m512i il = _mm512_loadu_si512(lo_idx), ih = _mm512_loadu_si512(hi_idx);
        for (int i = 0; i < 16; i++) {
            if (i & d) continue;
            __m512i x = r[i], y = r[i + d];
            r[i] = _mm512_permutex2var_epi32(x, il, y);
            r[i + d] = _mm512_permutex2var_epi32(x, ih, y);
        }
    }
}

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
static inline __mmask32 lanes32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1);
}

/* ---- bf16 operands packed as they are, not through f32 (load16, then VCVTNE2PS2BF16, which
 * flushes a denormal to zero and quiets a NaN): TDPBF16PS and VDPBF16PS treat a denormal input as
 * zero themselves, so the products are the same bits (spec/cpu_amx_spec.lua checks), and a NaN
 * operand gives a NaN either way ---- */
/* 32 consecutive bf16 at element i of x, lanes outside m zero */
static inline __m512i load32_bf16(const void *x, int64_t i, __mmask32 m) {
    return _mm512_maskz_loadu_epi16(m, (const uint16_t *)x + i);
}
/* 16 bf16 at element i of lo and of hi (lanes outside m zero) as pair words (lo[c], hi[c]) */
static inline __m512i bf16_pairs16(const void *x, int64_t lo, int64_t hi, __mmask16 m, int has_lo, int has_hi) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                                21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m256i a = has_lo ? _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + lo) : _mm256_setzero_si256();
    const __m256i b = has_hi ? _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + hi) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    return _mm512_permutexvar_epi16(interleave, both);
}

/* up to 16 consecutive elements at element offset i of x (f32, or bf16 where bf16), as f32 (a
 * bf16 value exactly; converting it back to bf16 gives its bits); lanes outside m zero */
static inline __m512 load16(const void *x, int bf16, int64_t i, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)x + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* A rows [i0, i0 + mcp) x K [k0, k0 + kcp) into dst (mcp rows of kcp bf16); zeros past M and K;
 * a holds f32, or bf16 where a16 */
static void pack_a(uint16_t *dst, const void *a, int a16, int64_t rs, int64_t cs, int64_t M, int64_t K, int64_t i0,
                   int64_t k0, int64_t mcp, int64_t kcp) {
    if (cs == 1) {
        for (int64_t i = 0; i < mcp; i++) {
            uint16_t *row = dst + i * kcp;
            const int64_t src = (i0 + i) * rs + k0;
            for (int64_t k = 0; k < kcp; k += 32) {
                int64_t left = i0 + i < M ? K - (k0 + k) : 0;
                if (a16) {
                    _mm512_storeu_si512(row + k, load32_bf16(a, src + k, lanes32(left)));
                    continue;
                }
                __m512 x = load16(a, a16, src + k, lanes(left));
                __m512 y = load16(a, a16, src + k + 16, lanes(left - 16));
                _mm512_storeu_si512(row + k, bf16_run(x, y));
            }
        }
    } else {   /* rs == 1, a transposed operand: 16 rows lie along memory for each k */
        __m512i w[16];
        for (int64_t i = 0; i < mcp; i += 16) {
            __mmask16 rows = lanes(M - (i0 + i));
            for (int64_t k = 0; k < kcp; k += 32) {
                for (int q = 0; q < 16; q++) {
                    int64_t kk = k0 + k + 2 * q;
                    if (a16) {
                        w[q] = bf16_pairs16(a, kk * cs + i0 + i, (kk + 1) * cs + i0 + i, rows, kk < K, kk + 1 < K);
                        continue;
                    }
                    __m512 lo = kk < K ? load16(a, a16, kk * cs + i0 + i, rows) : _mm512_setzero_ps();
                    __m512 hi = kk + 1 < K ? load16(a, a16, (kk + 1) * cs + i0 + i, rows) : _mm512_setzero_ps();
                    w[q] = bf16_pairs(lo, hi);
                }
                transpose16(w);
                for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + (i + r) * kcp + k, w[r]);
            }
        }
    }
}

/* B rows [k0, k0 + kcp) x columns [j0, j0 + ncp) into 32-column strips: strip s holds kcp / 2
 * rows of 32 words, word (p, c) = (B[k0 + 2p][j], B[k0 + 2p + 1][j]) for j = j0 + 32 s + c; b
 * holds f32, or bf16 where b16 */
static void pack_b_strip(uint32_t *dst, const void *b, int b16, int64_t rs, int64_t cs, int64_t K, int64_t N,
                         int64_t k0, int64_t j, int64_t kcp) {
    if (cs == 1) {
        for (int64_t p = 0; p < kcp / 2; p++) {
            int64_t k = k0 + 2 * p;
            for (int h = 0; h < 2; h++) {
                __mmask16 cols = lanes(N - (j + 16 * h));
                if (b16) {
                    _mm512_storeu_si512(dst + p * NR + 16 * h,
                                        bf16_pairs16(b, k * rs + j + 16 * h, (k + 1) * rs + j + 16 * h, cols, k < K, k + 1 < K));
                    continue;
                }
                __m512 lo = k < K ? load16(b, b16, k * rs + j + 16 * h, cols) : _mm512_setzero_ps();
                __m512 hi = k + 1 < K ? load16(b, b16, (k + 1) * rs + j + 16 * h, cols) : _mm512_setzero_ps();
                _mm512_storeu_si512(dst + p * NR + 16 * h, bf16_pairs(lo, hi));
            }
        }
    } else {   /* rs == 1, a transposed operand: each column's K values lie along memory */
        __m512i w[16];
        for (int64_t p = 0; p < kcp / 2; p += 16) {
            int64_t k = k0 + 2 * p;
            for (int h = 0; h < 2; h++) {
                for (int c = 0; c < 16; c++) {
                    int64_t jj = j + 16 * h + c;
                    if (jj >= N) { w[c] = _mm512_setzero_si512(); continue; }
                    if (b16) {
                        w[c] = load32_bf16(b, jj * cs + k, lanes32(K - k));
                        continue;
                    }
                    __m512 x = load16(b, b16, jj * cs + k, lanes(K - k));
                    __m512 y = load16(b, b16, jj * cs + k + 16, lanes(K - k - 16));
                    w[c] = bf16_run(x, y);
                }
                transpose16(w);
                for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + (p + r) * NR + 16 * h, w[r]);
            }
        }
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    /* gcc does not see LDTILECFG read the struct: without this barrier it dropped the stores of
     * rows and colsb (seen, gcc 12: garbage rows, #GP) */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* out (32 x 32 f32, row stride ld floats) = in (row stride ild floats: 0 repeats one row, a
 * bias) + the packed A rows (32 of kcp bf16) times the strip (kcp / 2 rows of 32 words); in NULL:
 * zeros (in may be out: C added into in place) */
static void micro_kernel(float *out, int64_t ld, const float *in, int64_t ild, const uint16_t *a, const uint32_t *strip,
                         int64_t kcp) {
    if (in) {
        _tile_loadd(0, in, ild * 4);
        _tile_loadd(1, in + 16, ild * 4);
        _tile_loadd(2, in + 16 * ild, ild * 4);
        _tile_loadd(3, in + 16 * ild + 16, ild * 4);
    } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    }
    const int64_t astride = kcp * 2;
    for (int64_t k = 0; k < kcp; k += 32) {
        _tile_loadd(4, a + k, astride);
        _tile_loadd(5, a + 16 * kcp + k, astride);
        _tile_loadd(6, strip + (k / 2) * NR, NR * 4);
        _tile_loadd(7, strip + (k / 2) * NR + 16, NR * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, ld * 4);
    _tile_stored(1, out + 16, ld * 4);
    _tile_stored(2, out + 16 * ld, ld * 4);
    _tile_stored(3, out + 16 * ld + 16, ld * 4);
}

/* C's [mr x nr] block (at c, row stride rs, unit column stride) = beta C + acc (beta 0: C not
 * read), or acc + bias (a row of nr) where bias */
static void add_block(float *c, int64_t rs, const float *acc, int64_t mr, int64_t nr, float beta, const float *bias) {
    for (int64_t r = 0; r < mr; r++) {
        float *row = c + r * rs;
        const float *src = acc + r * NR;
        for (int h = 0; h < 2; h++) {
            __mmask16 m = lanes(nr - 16 * h);
            if (!m) break;
            __m512 v = _mm512_loadu_ps(src + 16 * h);
            if (bias) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, bias + 16 * h), v);
            else if (beta != 0.0f) v = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, row + 16 * h), v);
            _mm512_mask_storeu_ps(row + 16 * h, m, v);
        }
    }
}

/* C's [mr x nr] block (bf16 at c, row stride rs) = acc rounded to bf16 (nearest even) */
static void store_block_bf16(uint16_t *c, int64_t rs, const float *acc, int64_t mr, int64_t nr) {
    for (int64_t r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) {
            __mmask16 m = lanes(nr - 16 * h);
            if (!m) break;
            __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * NR + 16 * h));
            _mm256_mask_storeu_epi16(c + r * rs + 16 * h, m, v);
        }
}

/* C's [mr x nr] block at c (row stride ld) = beta C + the packed A rows times the strip, or bias
 * (a row of nr, C not read) + them where bias: a whole f32 block goes through the tiles straight
 * to C (from C with beta 1, from the bias row repeated with a bias), others through buf, the bias
 * added after (as the core's fallback, the bias seeded into C and beta 1, adds them: the same
 * bits); a bf16 C (c16: beta 0) gets the f32 block rounded */
static void c_block(void *c, int c16, int64_t ld, int64_t mr, int64_t nr, float beta, const float *bias,
                    const uint16_t *a, const uint32_t *strip, int64_t kcp, float *buf) {
    const int whole = mr == MR && nr == NR;
    if (!c16 && whole && (bias || beta == 0.0f || beta == 1.0f)) {
        micro_kernel(c, ld, bias ? bias : beta == 0.0f ? NULL : c, bias ? 0 : ld, a, strip, kcp);
    } else if (c16) {
        micro_kernel(buf, NR, bias && whole ? bias : NULL, 0, a, strip, kcp);
        if (bias && !whole) add_block(buf, NR, buf, mr, nr, 0.0f, bias);
        store_block_bf16(c, ld, buf, mr, nr);
    } else {
        micro_kernel(buf, NR, NULL, 0, a, strip, kcp);
        add_block(c, ld, buf, mr, nr, beta, bias);
    }
}

static struct {           /* packing buffers, grown and kept (first-touch faults are slow) */
    uint32_t *b;
    int64_t b_words;
    uint16_t *a[64];
    int64_t a_elems[64];
} bufs;

static int grow(void **p, int64_t *have, int64_t need, size_t es) {
    if (*have >= need) return 0;
    free(*p);
    *p = aligned_alloc(64, (size_t)((need * (int64_t)es + 63) / 64 * 64));
    *have = *p ? need : 0;
    return *p ? 0 : -1;
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* one GEMM, no batches, C with unit column stride, A and B each with a unit row or column stride;
 * each of A, B, C f32 or bf16 (a16, b16, c16; a bf16 C only with K <= KC and beta 0: its blocks
 * are rounded once, whole); its blocks on the AMX tiles (tiles) or the AVX512-BF16 engine; -1
 * when the packing buffers cannot be had (the caller falls back) */
static int amx_gemm(int tiles, int64_t M, int64_t N, int64_t K, const void *a, int a16, int64_t ars, int64_t acs,
                    const void *b, int b16, int64_t brs, int64_t bcs, float beta, const float *bias, void *c, int c16,
                    int64_t crs) {
    int T = 1;
#ifdef _OPENMP
    if (omp_in_parallel()) return -1;   /* the packing buffers are the process's: OpenBLAS takes it */
    if (M * N * K >= SPLIT_MIN_MACS) T = omp_get_max_threads();
#endif
    if (T > 64) T = 64;
    const int64_t ncmax = round_up(N < NC ? N : NC, NR), kcmax = round_up(K < KC ? K : KC, 32);
    const int64_t mcmax = round_up(M < MC ? M : MC, MR);
    if (grow((void **)&bufs.b, &bufs.b_words, ncmax * kcmax / 2, 4)) return -1;
    for (int t = 0; t < T; t++)
        if (grow((void **)&bufs.a[t], &bufs.a_elems[t], mcmax * kcmax, 2)) return -1;
    for (int64_t jc = 0; jc < N; jc += NC) {
        const int64_t nc = N - jc < NC ? N - jc : NC, strips = round_up(nc, NR) / NR;
        for (int64_t pc = 0; pc < K; pc += KC) {
            const int64_t kcp = round_up(K - pc < KC ? K - pc : KC, 32);
            const float bt = pc == 0 ? beta : 1.0f;
            const int64_t mblocks = (M + MC - 1) / MC, items = mblocks * strips;
            #pragma omp parallel num_threads(T)
            {
                int t = 0, nt = 1;
#ifdef _OPENMP
                t = omp_get_thread_num();
                nt = omp_get_num_threads();
#endif
                #pragma omp for schedule(static)
                for (int64_t s = 0; s < strips; s++)
                    pack_b_strip(bufs.b + s * (kcp / 2) * NR, b, b16, brs, bcs, K, N, pc, jc + s * NR, kcp);
                if (tiles) load_tile_config();
                float acc[MR * NR] __attribute__((aligned(64)));
                int64_t packed = -1;
                /* (row block, strip) items in row-block order, a contiguous share a thread */
                for (int64_t it = items * t / nt; it < items * (t + 1) / nt; it++) {
                    const int64_t ib = it / strips, s = it % strips, i0 = ib * MC;
                    const int64_t mc = M - i0 < MC ? M - i0 : MC, mcp = round_up(mc, MR);
                    if (packed != ib) {
                        pack_a(bufs.a[t], a, a16, ars, acs, M, K, i0, pc, mcp, kcp);
                        packed = ib;
                    }
                    const int64_t j = jc + s * NR, nr = N - j < NR ? N - j : NR;
                    for (int64_t ir = 0; ir < mcp; ir += MR) {
                        void *cb = (char *)c + ((i0 + ir) * crs + j) * (c16 ? 2 : 4);
                        const int64_t mr = mc - ir < MR ? mc - ir : MR;
                        const float *bb = bias && pc == 0 ? bias + j : NULL;
                        const uint16_t *ab = bufs.a[t] + ir * kcp;
                        const uint32_t *strip = bufs.b + s * (kcp / 2) * NR;
                        if (tiles) c_block(cb, c16, crs, mr, nr, bt, bb, ab, strip, kcp, acc);
                        else avx512_bf16_block(cb, c16, crs, mr, nr, bt, bb, ab, strip, kcp);
                    }
                }
                if (tiles) _tile_release();
            }
        }
    }
    return 0;
}

/* the small GEMM of the flash-attention kernels (tile_gemm_amx, kernels.h): its panels in buffers
 * of the calling thread (it runs inside their parallel regions) */
static __thread uint16_t *tile_a;
static __thread uint32_t *tile_b;
static __thread int64_t tile_a_elems, tile_b_words;

/* C[M][N] (+= where acc) = the packed A (rows of round_up(K, 32) bf16, round_up(M, 32) of them)
 * times the packed B (32-column strips of round_up(K, 32) / 2 pair rows) */
static void tile_products(int64_t M, int64_t N, int64_t K, const uint16_t *pa, const uint32_t *pb, float *C,
                          int64_t ldc, int acc) {
    const int64_t mp = round_up(M, MR), np = round_up(N, NR), kp = round_up(K, 32);
    float buf[MR * NR] __attribute__((aligned(64)));
    for (int64_t s = 0; s < np / NR; s++) {
        const int64_t j = s * NR, nr = N - j < NR ? N - j : NR;
        for (int64_t i = 0; i < mp; i += MR)
            c_block(C + i * ldc + j, 0, ldc, M - i < MR ? M - i : MR, nr, acc ? 1.0f : 0.0f, NULL, pa + i * kp,
                    pb + s * (kp / 2) * NR, kp, buf);
    }
}

static int tile_gemm_amx_on(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                            float *C, int64_t ldc, int acc) {
    const int64_t mp = round_up(M, MR), np = round_up(N, NR), kp = round_up(K, 32);
    if (grow((void **)&tile_a, &tile_a_elems, mp * kp, 2) || grow((void **)&tile_b, &tile_b_words, np * kp / 2, 4))
        return -1;
    pack_a(tile_a, A, 0, lda, 1, M, K, 0, 0, mp, kp);
    for (int64_t s = 0; s < np / NR; s++) pack_b_strip(tile_b + s * (kp / 2) * NR, B, 0, ldb, 1, K, N, 0, s * NR, kp);
    tile_products(M, N, K, tile_a, tile_b, C, ldc, acc);
    return 0;
}

/* the tiles' configuration, loaded once per thread and parallel region (LDTILECFG took three
 * quarters of a 64 x 64 x 64 product's overhead when every product loaded it) */
void tile_amx_configure(void) { load_tile_config(); }
void tile_amx_release(void) { _tile_release(); }

void tile_amx_pack_a(uint16_t *dst, const float *A, int64_t rs, int64_t cs, int64_t M, int64_t K) {
    pack_a(dst, A, 0, rs, cs, M, K, 0, 0, round_up(M, MR), round_up(K, 32));
}

void tile_amx_pack_b(uint32_t *dst, const float *B, int64_t rs, int64_t cs, int64_t K, int64_t N) {
    const int64_t kp = round_up(K, 32);
    for (int64_t s = 0; s < round_up(N, NR) / NR; s++) pack_b_strip(dst + s * (kp / 2) * NR, B, 0, rs, cs, K, N, 0, s * NR, kp);
}

void tile_amx_gemm_packed(int64_t M, int64_t N, int64_t K, const uint16_t *pa, const uint32_t *pb, float *C,
                          int64_t ldc, int acc) {
    tile_products(M, N, K, pa, pb, C, ldc, acc);
}

/* the tile unit's rate on one thread: six accumulators (latency x throughput) fed by two tiles
 * that stay in their registers, ROUNDS of six TDPBF16PS (16 x 16 x 32 multiply-adds each). The
 * operands are ones, not zeros: zeros multiply faster (seen: 3x) and would flatter the peak. */
#define PEAK_ROUNDS 20000
static double amx_peak_thread(void) {
    uint16_t ones[16 * 32] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) ones[i] = 0x3f80;   /* 1.0 in bf16 */
    load_tile_config();
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
    double t0 = omp_get_wtime();
    for (int r = 0; r < PEAK_ROUNDS; r++) {
        _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
        _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
    }
    float sink[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, sink, 64);   /* the products are used */
    double t = omp_get_wtime() - t0;
    _tile_release();
    return sink[0] == 1.5f ? t * 1.0000001 : t;
}
#pragma GCC pop_options

double gemm_amx_peak(int threads) {
    if (!gemm_amx_on()) return 0.0;
    if (threads < 1) threads = 1;
    const double slowest = slowest_thread_best_of_three(amx_peak_thread, threads);
    return slowest > 0.0 ? 6.0 * PEAK_ROUNDS * (16.0 * 16 * 32 * 2) * threads / slowest : 0.0;
}
#endif /* AMX_BUILT */

#ifndef AMX_BUILT
double gemm_amx_peak(int threads) { (void)threads; return 0.0; }
void tile_amx_configure(void) {}
void tile_amx_release(void) {}
/* never called without AMX (gemm_amx_on is 0): here for the linker */
void tile_amx_pack_a(uint16_t *dst, const float *A, int64_t rs, int64_t cs, int64_t M, int64_t K) {
    (void)dst; (void)A; (void)rs; (void)cs; (void)M; (void)K;
}
void tile_amx_pack_b(uint32_t *dst, const float *B, int64_t rs, int64_t cs, int64_t K, int64_t N) {
    (void)dst; (void)B; (void)rs; (void)cs; (void)K; (void)N;
}
void tile_amx_gemm_packed(int64_t M, int64_t N, int64_t K, const uint16_t *pa, const uint32_t *pb, float *C,
                          int64_t ldc, int acc) {
    (void)M; (void)N; (void)K; (void)pa; (void)pb; (void)C; (void)ldc; (void)acc;
}
#endif

int tile_gemm_amx(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                  int64_t ldc, int acc) {
#ifdef AMX_BUILT
    if (gemm_amx_on() && M > 0 && N > 0 && K > 0) return tile_gemm_amx_on(M, N, K, A, lda, B, ldb, C, ldc, acc);
#else
    (void)M; (void)N; (void)K; (void)A; (void)lda; (void)B; (void)ldb; (void)C; (void)ldc; (void)acc;
#endif
    return -1;
}

int gemm_amx_on(void) {
    if (amx_state < 0) {
#ifdef AMX_BUILT
        amx_state = decide();
#else
        snprintf(amx_reason, sizeof amx_reason, "off: built without AMX support (needs x86-64 Linux, gcc >= 11 or clang >= 12)");
        amx_state = 0;
#endif
    }
    return amx_state && amx_wanted;
}

const char *gemm_amx_status(void) {
    gemm_amx_on();
    return amx_state && !amx_wanted ? "off: switched off (uly.cpu_amx(false))" : amx_reason;
}

int gemm_amx_enable(int on) {
    int prev = amx_wanted;
    amx_wanted = on != 0;
    return prev;
}

int gemm_bf16_on(void) { return gemm_amx_on() || gemm_avx512_bf16_on(); }

const char *gemm_bf16_engine(void) {
    static char why[400];
    if (gemm_amx_on()) return "amx";
    if (gemm_avx512_bf16_on()) return "avx512_bf16";
    /* both statuses say "off: why" */
    snprintf(why, sizeof why, "off: AMX: %s; AVX512-BF16: %s", gemm_amx_status() + 5, gemm_avx512_bf16_status() + 5);
    return why;
}

double gemm_bf16_peak(int threads) {
    return gemm_amx_on() ? gemm_amx_peak(threads) : gemm_avx512_bf16_on() ? gemm_avx512_bf16_peak(threads) : 0.0;
}

#ifdef AMX_BUILT
/* a bf16 C over K > KC: the f32 sums in this buffer (grown, kept), rounded into C at the end */
static float *csum;
static int64_t csum_elems;

static int amx_gemm_bf16_out(int tiles, int64_t M, int64_t N, int64_t K, const void *a, int a16, int64_t ars,
                             int64_t acs, const void *b, int b16, int64_t brs, int64_t bcs, const float *bias,
                             uint16_t *c, int64_t crs) {
    if (K <= KC) return amx_gemm(tiles, M, N, K, a, a16, ars, acs, b, b16, brs, bcs, 0.0f, bias, c, 1, crs);
    if (grow((void **)&csum, &csum_elems, M * N, 4) ||
        amx_gemm(tiles, M, N, K, a, a16, ars, acs, b, b16, brs, bcs, 0.0f, bias, csum, 0, N))
        return -1;
    #pragma omp parallel for schedule(static) if (M * N >= (1 << 16))
    for (int64_t i = 0; i < M; i++) {
        const float *src = csum + i * N;
        uint16_t *dst = c + i * crs;
        for (int64_t j = 0; j < N; j++) dst[j] = f32_bf16_bits(src[j]);
    }
    return 0;
}
#endif

int gemm_amx_2d(int64_t M, int64_t N, int64_t K, const void *a, int adt, int64_t ars, int64_t acs, const void *b,
                int bdt, int64_t brs, int64_t bcs, float beta, const float *bias, void *c, int cdt, int64_t crs,
                int64_t ccs) {
#ifdef AMX_BUILT
    /* a row or a column of A or B with one element has any stride there: read it as unit */
    if (K == 1) acs = brs = 1;
    if (M == 1) ars = 1;
    if (N == 1) { bcs = 1; ccs = 1; }
    const int a16 = adt == KDT_BF16, b16 = bdt == KDT_BF16, c16 = cdt == KDT_BF16, tiles = gemm_amx_on();
    if (!(tiles || gemm_avx512_bf16_on()) || K <= 0 || M <= 0 || N <= 0 || ccs != 1 || (acs != 1 && ars != 1) ||
        (bcs != 1 && brs != 1) || (c16 && beta != 0.0f && !bias))
        return -1;
    /* the packing buffers are the process's: a second caller at the same time (another host
     * thread) leaves the GEMM to OpenBLAS */
    static int busy;
    if (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE)) return -1;
    int rc = c16 ? amx_gemm_bf16_out(tiles, M, N, K, a, a16, ars, acs, b, b16, brs, bcs, bias, c, crs)
                 : amx_gemm(tiles, M, N, K, a, a16, ars, acs, b, b16, brs, bcs, beta, bias, c, 0, crs);
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    return rc;
#else
    (void)M; (void)N; (void)K; (void)a; (void)adt; (void)ars; (void)acs; (void)b; (void)bdt; (void)brs; (void)bcs;
    (void)beta; (void)bias; (void)c; (void)cdt; (void)crs; (void)ccs;
#endif
    return -1;
}
