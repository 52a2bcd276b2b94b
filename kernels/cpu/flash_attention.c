/* kernels/cpu/flash_attention.c — memory-efficient attention on the CPU (FlashAttention-2 style):
 * contract in flash_attention.h.
 *
 * Forward, one work item per (b, h, query tile of BR rows): the query tile is packed (scaled),
 * then for every key tile of BC keys that the mask does not hide entirely, S = Q K^T (a small
 * register-blocked GEMM), the masked entries set to -inf, an online softmax update (running row
 * max m and sum l, the accumulator rescaled by exp(m_old - m_new)) and acc += P V. The output
 * is acc / l and the log-sum-exp m + log l is saved per row: O(N D) memory, never O(N^2).
 *
 * Backward recomputes the score tiles from q, k and the saved lse (P = exp(S - lse)), with
 * delta_i = rowsum(dO * O), dP = dO V^T, dS = P * (dP - delta):
 * one pass over key tiles, items (b, kv head g, group of key tiles kt = grp, grp + G, ...): per
 * key tile, dV += P^T dO and dK += scale dS^T Q over the query heads of group g and the query
 * tiles that see it, and dS K is added into that group's dQ partial sums ([B][H][T][Dp], one
 * buffer per group, DQ_GROUPS of them); at the end dQ = scale * (group 0 + group 1 + ...).
 * Every output element and partial sum has one writer with a fixed order, and the groups are
 * added in order, so results do not depend on the thread count (no atomics on floats), with 5
 * tile GEMMs per visible tile pair and DQ_GROUPS x [B, H, T, D] floats of scratch.
 *
 * bf16 precision on AMX tiles (fctx.amx): the tile products round their operands to bf16, and
 * (fctx.pre) K and V (forward) or Q and dO (backward) are packed for the tiles once into the
 * scratch their f32 tiles take otherwise (D rounded up to 32, the tiles' zero padding: scratch_d),
 * the key tile's K and V once per work item, so
 * only P and dS are packed per product (the same bits as packing every product's operands).
 * That path works on transposed tiles: the forward computes S^T = K Q^T and O^T += V^T P^T, so
 * its online softmax (online_softmax_cols) runs down columns, a query a lane, where the row
 * form folds 16 lanes per row and tile; the backward adds dQ^T = K^T dS^T into transposed dQ
 * tiles. P^T and dS^T are written straight into their products' bf16 layouts. The exponentials
 * are uly_expf_softmax (uly_expf's bits where e^x >= 2^-125, 0 below).
 *
 * Tiles: a key tile is skipped when the mask hides it from every row of the query tile, used
 * without per-element masking when it is fully visible, masked element by element otherwise;
 * the key-tile loop only runs over the span the causal/window bounds allow, so work is
 * proportional to the unmasked area. Packed tiles are zero-padded to BR / BC rows and to a
 * multiple of VL columns (Dp), so the micro-kernel needs no edge cases.
 */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512") /* the exp / scaling loops in 16 lanes */
#endif
#include "flash_attention.h"
#include "kernels.h"
#include "vecmath.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BR 64                    /* query rows per tile */
#define BC 64                    /* keys per tile */
/* the micro-kernel's vectors and register block, by the vector unit the build targets: VL
 * floats a vector, a block of 4 rows x NV vectors of accumulators. AVX-512 has 32 registers of
 * 16 floats (16 accumulators + 4 B vectors + the broadcast A); AVX2 16 of 8 (12 + 3 + 1), SSE 16
 * of 4. A block larger than the register file spills every multiply-add: with AVX-512's block
 * on an AVX2 CPU this kernel ran 20x slower than sgemm (bench/attention.lua). */
#if defined(__AVX512F__)
#define VL 16
#define NV 4
#define VREGS 32
#elif defined(__AVX__)
#define VL 8
#define NV 3
#define VREGS 16
#else
#define VL 4
#define NV 3
#define VREGS 16
#endif
_Static_assert(4 * NV + NV + 1 <= VREGS, "the micro-kernel's block (4 x NV accumulators, NV B vectors, "
                                         "one broadcast) must fit the vector registers");
_Static_assert(BR % 32 == 0 && BC % 32 == 0, "the pre-packed AMX path writes whole tiles of 32 rows and columns");
#define BIG ((int64_t)1 << 60)   /* "unbounded" window width */
#define PAR_MIN ((int64_t)1 << 18) /* multiply-adds below which no threads are started */
#define DQ_GROUPS 2              /* backward: dQ partial sums, one buffer per group of key tiles */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
#if defined(__GNUC__) && !defined(__clang__)
/* vf by value between static inline helpers, never across a library boundary: gcc's note that
 * its ABI differs without AVX-512 (a build for a CPU without it) is noise here */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
/* B's vectors are loaded once per k into registers: left to itself gcc folds them into each
 * row's multiply-add as a memory operand, 16 loads a k instead of 7 for 4 x 3 on AVX2 (8 cycles
 * of two load ports against 6 of the two FMA units: 134 against 105 GFLOP/s on a Zen 2) */
#if defined(__x86_64__) && defined(__GNUC__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif
/* x in every lane: one broadcast load (`(vf){0} + x` adds a zero, which holds a register) */
typedef int vi __attribute__((vector_size(VL * sizeof(int))));
#if defined(__GNUC__) && !defined(__clang__)
static inline vf vsplat(float x) { return __builtin_shuffle((vf){x}, (vi){0}); }
#else
static inline vf vsplat(float x) {
    vf v;
    for (int e = 0; e < VL; e++) v[e] = x;
    return v;
}
#endif
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static int64_t tiles_done; /* forward score tiles computed (flash_attention_tiles) */
int64_t flash_attention_tiles(void) { return __atomic_load_n(&tiles_done, __ATOMIC_RELAXED); }
void flash_attention_reset_tiles(void) { __atomic_store_n(&tiles_done, 0, __ATOMIC_RELAXED); }

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* ---- micro-kernel: C[4][VL nv] = (acc ? C : 0) + A[4][K] B[K][VL nv], nv a constant 1..NV ---- */
static inline __attribute__((always_inline)) void micro(int nv, int64_t K, const float *restrict A, int64_t lda,
                                                        const float *restrict Bm, int64_t ldb, float *restrict C,
                                                        int64_t ldc, int acc) {
    vf c[4][NV] = {{{0}}};
    if (acc)
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < nv; x++) c[r][x] = vload(C + r * ldc + x * VL);
    for (int64_t k = 0; k < K; k++) {
        vf b[NV];
        for (int x = 0; x < nv; x++) {
            b[x] = vload(Bm + k * ldb + x * VL);
            KEEP_IN_REGISTER(b[x]);
        }
        for (int r = 0; r < 4; r++) {
            const vf a = vsplat(A[r * lda + k]);
            for (int x = 0; x < nv; x++) c[r][x] += a * b[x];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int x = 0; x < nv; x++) vstore(C + r * ldc + x * VL, c[r][x]);
}

/* C[M][N] (+)= A[M][K] B[K][N], row-major with leading dims; M % 4 == 0, N % VL == 0 */
static void tile_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *Bm, int64_t ldb,
                      float *C, int64_t ldc, int acc) {
    for (int64_t n0 = 0; n0 < N; n0 += NV * VL) {
        const int64_t nv = min64(NV, (N - n0) / VL);
        for (int64_t r = 0; r < M; r += 4) {
            const float *a = A + r * lda;
            const float *b = Bm + n0;
            float *c = C + r * ldc + n0;
            switch (nv) {
#if NV >= 4
            case 4: micro(4, K, a, lda, b, ldb, c, ldc, acc); break;
#endif
            case 3: micro(3, K, a, lda, b, ldb, c, ldc, acc); break;
            case 2: micro(2, K, a, lda, b, ldb, c, ldc, acc); break;
            default: micro(1, K, a, lda, b, ldb, c, ldc, acc); break;
            }
        }
    }
}

/* ---- packing (strided rows in, zero-padded tiles out) ---- */
/* element i of an operand row: f32, or bf16 (bf16 q, k, v: read exactly) */
static inline float elem(const void *base, int bf16, int64_t i) {
    return bf16 ? bf16_bits_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}
/* dst[r][d] = s * src row t0 + r, for r < n (rows n..rows-1 and columns D..ld-1 zero); src f32,
 * or bf16 where bf16 */
static void pack_rows(float *dst, int64_t ld, int64_t rows, const void *base, int bf16, int64_t st, int64_t t0,
                      int64_t n, int64_t D, float s) {
    for (int64_t r = 0; r < n; r++) {
        float *d = dst + r * ld;
        if (bf16) {
            const uint16_t *src = (const uint16_t *)base + (t0 + r) * st;
            for (int64_t x = 0; x < D; x++) d[x] = s * bf16_bits_f32(src[x]);
        } else {
            const float *src = (const float *)base + (t0 + r) * st;
            for (int64_t x = 0; x < D; x++) d[x] = s * src[x];
        }
        for (int64_t x = D; x < ld; x++) d[x] = 0.0f;
    }
    if (rows > n) memset(dst + n * ld, 0, (size_t)((rows - n) * ld) * sizeof(float));
}
/* dst[d][c] = s * src row t0 + c, for c < n (columns n..ld-1 zero); D rows */
static void pack_cols(float *dst, int64_t ld, const void *base, int bf16, int64_t st, int64_t t0, int64_t n,
                      int64_t D, float s) {
    for (int64_t c = 0; c < n; c++) {
        const int64_t row = (t0 + c) * st;
        for (int64_t x = 0; x < D; x++) dst[x * ld + c] = s * elem(base, bf16, row + x);
    }
    if (ld > n)
        for (int64_t x = 0; x < D; x++) memset(dst + x * ld + n, 0, (size_t)(ld - n) * sizeof(float));
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* bf16 precision on AMX tiles with K, V, Q and dO packed for the tiles once (any D: the tiles
 * pad it with zeros; ULY_FLASH_PREPACK=0 packs per product instead, for comparisons) */
static int prepacked(const flash_problem *p) {
    const char *env = getenv("ULY_FLASH_PREPACK");
    return p->bf16 && gemm_amx_on() && !(env && strcmp(env, "0") == 0);
}
/* D as the scratch lays tiles out: rounded up to the tiles' 32 where operands are pre-packed */
static int64_t scratch_d(const flash_problem *p) { return prepacked(p) ? round_up(p->D, 32) : p->D; }

/* ---- masks ---- */
typedef struct fctx {
    const flash_problem *p;
    int64_t Dp, Ds, rep, off, L, R, nqt, nkt;   /* Ds: scratch_d */
    int32_t *qdr, *kdr; /* document id [min, max] per (b, query tile) and (b, key tile) */
    int amx;            /* bf16 precision on AMX tiles (kernels/cpu/gemm_amx.c) */
    int pre;            /* ... with K, V, Q and dO packed for the tiles once (prepacked) */
} fctx;

/* a tile product in the problem's precision: bf16 operands on AMX tiles where the CPU has them
 * and the precision is bf16 (P and dS rounded as the GPU's fused kernels round them), else f32 */
static void tile_mm(const fctx *c, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *Bm,
                    int64_t ldb, float *C, int64_t ldc, int acc) {
    if (c->amx && !tile_gemm_amx(M, N, K, A, lda, Bm, ldb, C, ldc, acc)) return;
    tile_gemm(M, N, K, A, lda, Bm, ldb, C, ldc, acc);
}

/* keys [*lo, *hi] that the causal/window bounds let rows [i0, i0 + mr) see (empty: lo > hi) */
static void key_span(const fctx *c, int64_t i0, int64_t mr, int64_t *lo, int64_t *hi) {
    *lo = i0 + c->off - c->L;
    if (*lo < 0) *lo = 0;
    *hi = min64(c->p->Tk - 1, i0 + mr - 1 + c->off + c->R);
}
/* query rows [*lo, *hi] that can see some key of [j0, j0 + nc) under those bounds */
static void query_span(const fctx *c, int64_t j0, int64_t nc, int64_t *lo, int64_t *hi) {
    *lo = j0 - c->off - c->R;
    if (*lo < 0) *lo = 0;
    *hi = min64(c->p->Tq - 1, j0 + nc - 1 - c->off + c->L);
}

enum { TILE_SKIP = 0, TILE_FULL = 1, TILE_PARTIAL = 2 };

/* is the tile rows [i0, i0 + mr) x keys [j0, j0 + nc) of batch b hidden, fully visible or mixed? */
static int classify(const fctx *c, int64_t b, int64_t i0, int64_t mr, int64_t j0, int64_t nc) {
    const flash_problem *p = c->p;
    const int64_t i1 = i0 + mr - 1, j1 = j0 + nc - 1;
    if (j1 < i0 + c->off - c->L || j0 > i1 + c->off + c->R) return TILE_SKIP;
    int full = j0 >= i1 + c->off - c->L && j1 <= i0 + c->off + c->R;
    if (p->q_doc) {
        const int32_t *qa = c->qdr + 2 * (b * c->nqt + i0 / BR), *ka = c->kdr + 2 * (b * c->nkt + j0 / BC);
        if (qa[1] < ka[0] || ka[1] < qa[0]) return TILE_SKIP;
        if (!(qa[0] == qa[1] && ka[0] == ka[1] && qa[0] == ka[0])) full = 0;
    }
    if (p->layout) {
        int any = 0, all = 1;
        for (int64_t r = i0 / p->bs; r <= i1 / p->bs; r++)
            for (int64_t s = j0 / p->bs; s <= j1 / p->bs; s++) {
                if (p->layout[r * p->nbc + s]) any = 1;
                else all = 0;
            }
        if (!any) return TILE_SKIP;
        if (!all) full = 0;
    }
    return full ? TILE_FULL : TILE_PARTIAL;
}

/* can query i see key j (batch b)? */
static inline int visible(const fctx *c, int64_t b, int64_t i, int64_t j) {
    const flash_problem *p = c->p;
    const int64_t ii = i + c->off;
    int vis = j >= ii - c->L && j <= ii + c->R;
    if (p->layout) vis = vis && p->layout[(i / p->bs) * p->nbc + j / p->bs] != 0;
    if (p->q_doc) vis = vis && p->q_doc[b * p->Tq + i] == p->k_doc[b * p->Tk + j];
    return vis;
}

/* v[k] = -inf for k in [0, n) outside [lo, hi] */
static void hide_outside(float *v, int64_t n, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < min64(lo, n); k++) v[k] = -INFINITY;
    for (int64_t k = hi + 1 < 0 ? 0 : hi + 1; k < n; k++) v[k] = -INFINITY;
}

/* S[r][x] (rows: queries i0 + r, columns: keys j0 + x, leading dim BC) = -inf where hidden;
 * columns x >= nc always; rows r >= mr untouched. With only the causal / window bounds, a row
 * sees the keys j in [i + off - L, i + off + R]: one span a row, no per-element test. */
static void mask_rows(const fctx *c, int64_t b, float *S, int64_t i0, int64_t mr, int64_t j0, int64_t nc, int full) {
    const int bounds_only = !c->p->layout && !c->p->q_doc;
    for (int64_t r = 0; r < mr; r++) {
        float *s = S + r * BC;
        const int64_t ii = i0 + r + c->off;
        if (!full && bounds_only)
            hide_outside(s, nc, ii - c->L - j0, ii + c->R - j0);
        else if (!full)
            for (int64_t x = 0; x < nc; x++)
                if (!visible(c, b, i0 + r, j0 + x)) s[x] = -INFINITY;
        for (int64_t x = nc; x < BC; x++) s[x] = -INFINITY;
    }
}
/* the transposed tile St[x][r] (rows: keys j0 + x, columns: queries i0 + r, leading dim BR);
 * rows x >= nc are hidden entirely; columns r >= mr are left (their lse is +inf: P = 0). With
 * only the bounds, key j is seen by the queries i in [j - off - R, j - off + L]. */
static void mask_cols(const fctx *c, int64_t b, float *St, int64_t i0, int64_t mr, int64_t j0, int64_t nc, int full) {
    const int bounds_only = !c->p->layout && !c->p->q_doc;
    if (!full && bounds_only)
        for (int64_t x = 0; x < nc; x++) {
            const int64_t j = j0 + x;
            hide_outside(St + x * BR, mr, j - c->off - c->R - i0, j - c->off + c->L - i0);
        }
    else if (!full)
        for (int64_t x = 0; x < nc; x++)
            for (int64_t r = 0; r < mr; r++)
                if (!visible(c, b, i0 + r, j0 + x)) St[x * BR + r] = -INFINITY;
    for (int64_t x = nc; x < BC; x++)
        for (int64_t r = 0; r < BR; r++) St[x * BR + r] = -INFINITY;
}

/* ---- row helpers over BC columns (VL vertical lanes, then a fixed-order fold) ---- */
static float row_max(const float *s, float init) {
    vf mx = vload(s);
    for (int x = 1; x < BC / VL; x++) {
        const vf v = vload(s + x * VL);
        const vi gt = v > mx;   /* lane-wise: the larger, as (v > mx ? v : mx) */
        mx = (vf)(((vi)v & gt) | ((vi)mx & ~gt));
    }
    float m = init;
    for (int e = 0; e < VL; e++) m = mx[e] > m ? mx[e] : m;
    return m;
}
static float row_sum(const float *s) {
    vf acc = vload(s);
    for (int x = 1; x < BC / VL; x++) acc += vload(s + x * VL);
    float t = 0.0f;
    for (int e = 0; e < VL; e++) t += acc[e];
    return t;
}

/* backward's elementwise steps over a transposed tile (BC rows of BR): P^T = exp(S^T - lse), and
 * dS^T = P^T (dP^T - delta) in place of dP^T (omp simd: gcc left the exp scalar otherwise) */
static void exp_minus_lse(float *restrict St, const float *restrict lr) {
    for (int64_t x = 0; x < BC; x++) {
        float *row = St + x * BR;
        #pragma omp simd
        for (int64_t r = 0; r < BR; r++) row[r] = uly_expf_softmax(row[r] - lr[r]);
    }
}
static void scores_grad(float *restrict dPt, const float *restrict St, const float *restrict dr) {
    for (int64_t x = 0; x < BC; x++) {
        float *row = dPt + x * BR;
        const float *p = St + x * BR;
        #pragma omp simd
        for (int64_t r = 0; r < BR; r++) row[r] = p[r] * (row[r] - dr[r]);
    }
}

/* ---- the pre-packed AMX path's bf16 operands, written from f32 tiles [BC][BR] (row x, column r) ----
 * as A (bf16 rows: row x of the tile a row of the operand) or as B (32-column strips of row pairs:
 * word (p, r) = (row 2p, row 2p + 1) at column r, strip r / 32). Rounding as VCVTNEPS2BF16 does
 * it (tile_amx_pack_a / _pack_b), so the bits equal packing the f32 tiles: by that instruction
 * where the build targets AVX512-BF16, else f32_bf16_bits_daz, its bits in C. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && VL == 16
#include <immintrin.h>
#define HW_BF16 1
static inline __m512i bf16_low(const float *x) {   /* 16 rounded, each in the low half of a word */
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
}
#endif
static inline int64_t pair_word(int64_t p, int64_t r) { return r / 32 * (BC / 2) * 32 + p * 32 + r % 32; }

/* dst (A rows) = the tile rounded */
static void tile_to_rows(uint16_t *restrict dst, const float *restrict t) {
#ifdef HW_BF16
    for (int64_t i = 0; i < BC * BR; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(t + i)));
#else
    for (int64_t i = 0; i < BC * BR; i++) dst[i] = f32_bf16_bits_daz(t[i]);
#endif
}
/* dst (B words) = the tile rounded; with keep, the tile itself rounded in place too */
static void tile_to_pairs(uint32_t *restrict dst, float *restrict t, int keep) {
    for (int64_t p = 0; p < BC / 2; p++) {
        float *t0 = t + 2 * p * BR, *t1 = t0 + BR;
#ifdef HW_BF16
        for (int64_t r = 0; r < BR; r += 16) {
            const __m512i lo = bf16_low(t0 + r), hi = _mm512_slli_epi32(bf16_low(t1 + r), 16);
            _mm512_storeu_si512(dst + pair_word(p, r), _mm512_or_si512(lo, hi));
            if (keep) {
                _mm512_storeu_ps(t0 + r, _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)));
                _mm512_storeu_ps(t1 + r, _mm512_castsi512_ps(hi));
            }
        }
#else
        for (int64_t r = 0; r < BR; r++) {
            const uint16_t h0 = f32_bf16_bits_daz(t0[r]), h1 = f32_bf16_bits_daz(t1[r]);
            dst[pair_word(p, r)] = (uint32_t)h0 | (uint32_t)h1 << 16;
            if (keep) {
                t0[r] = bf16_bits_f32(h0);
                t1[r] = bf16_bits_f32(h1);
            }
        }
#endif
    }
}

/* the pre-packed backward's forms of the two steps above: P^T kept in f32 for dS and written as
 * the A operand of dV += P^T dO; dS^T (in dPt) as the A operand of dK += dS^T Q and the B operand
 * of dQ^T += K^T dS^T */
static void exp_minus_lse_packed(float *restrict St, const float *restrict lr, uint16_t *restrict pa) {
    exp_minus_lse(St, lr);
    tile_to_rows(pa, St);
}
static void scores_grad_packed(float *restrict dPt, const float *restrict St, const float *restrict dr,
                               uint16_t *restrict sa, uint32_t *restrict sb) {
    scores_grad(dPt, St, dr);
    tile_to_rows(sa, dPt);
    tile_to_pairs(sb, dPt, 0);
}

/* online softmax over the masked score tile S (rows < mr): S becomes P = exp(S - m_new), the
 * running max m, sum l and accumulator rows (Dp wide) are updated. With bf16 products (amx) P is
 * rounded to bf16 here, so l sums the weights P V multiplies and O stays a weighted mean of V's
 * rows (a row's sum of unrounded P scaled its O by the rounding; where one key dominates a row,
 * dQ through delta = dO . O was off by a third on the GPU before the same fix) */
static void online_softmax(float *S, float *m, float *l, float *acc, int64_t mr, int64_t Dp, int amx) {
    for (int64_t r = 0; r < mr; r++) {
        float *s = S + r * BC;
        const float mx = row_max(s, m[r]);
        if (mx == -INFINITY) { /* nothing visible to this row yet */
            memset(s, 0, BC * sizeof(float));
            continue;
        }
        const float alpha = uly_expf_softmax(m[r] - mx);
        #pragma omp simd
        for (int x = 0; x < BC; x++) s[x] = uly_expf_softmax(s[x] - mx);
        if (amx) {
            #pragma omp simd
            for (int x = 0; x < BC; x++) s[x] = f32_round_bf16(s[x]);
        }
        l[r] = l[r] * alpha + row_sum(s);
        m[r] = mx;
        if (alpha != 1.0f) {
            float *a = acc + r * Dp;
            #pragma omp simd
            for (int64_t d = 0; d < Dp; d++) a[d] *= alpha;
        }
    }
}

/* ---- problem setup ---- */

/* fills c; returns -1 when the document-range arrays cannot be allocated */
static int ctx_init(fctx *c, const flash_problem *p) {
    memset(c, 0, sizeof *c);
    c->p = p;
    c->Dp = round_up(p->D, VL);
    c->rep = p->H / p->Hkv;
    c->off = p->Tk - p->Tq;
    c->L = p->left >= 0 ? p->left : BIG;
    c->R = p->causal ? 0 : (p->right >= 0 ? p->right : BIG);
    c->nqt = (p->Tq + BR - 1) / BR;
    c->nkt = (p->Tk + BC - 1) / BC;
    c->amx = p->bf16 && gemm_amx_on();
    c->pre = c->amx && prepacked(p);
    c->Ds = c->pre ? round_up(p->D, 32) : p->D;
    if (!p->q_doc) return 0;
    c->qdr = malloc((size_t)(2 * p->B * (c->nqt + c->nkt) + 2) * sizeof(int32_t));
    if (!c->qdr) return -1;
    c->kdr = c->qdr + 2 * p->B * c->nqt;
    for (int pass = 0; pass < 2; pass++) {
        const int64_t T = pass ? p->Tk : p->Tq, tile = pass ? BC : BR, nt = pass ? c->nkt : c->nqt;
        const int32_t *ids = pass ? p->k_doc : p->q_doc;
        int32_t *rng = pass ? c->kdr : c->qdr;
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t t = 0; t < nt; t++) {
                int32_t lo = ids[b * T + t * tile], hi = lo;
                for (int64_t x = t * tile; x < min64(T, (t + 1) * tile); x++) {
                    int32_t v = ids[b * T + x];
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                }
                rng[2 * (b * nt + t)] = lo;
                rng[2 * (b * nt + t) + 1] = hi;
            }
    }
    return 0;
}
static void ctx_free(fctx *c) { free(c->qdr); }

static int is16(const flash_operand *o) { return o->dtype == KDT_BF16; }
static const void *head_ptr(const flash_operand *o, int64_t b, int64_t h) {
    return (const char *)o->p + (b * o->sb + h * o->sh) * (is16(o) ? 2 : 4);
}

/* every tile of every (b, head) of x [B, T, heads, D] transposed: dst[b][head][tile][D][width],
 * zero-padded to the tile width; one pass, so the tile loops read K^T, V^T, Q^T, dO^T as is */
static void pack_all_transposed(float *dst, const void *base, int bf16, int64_t sb, int64_t st, int64_t sh, int64_t B,
                                int64_t heads, int64_t T, int64_t width, int64_t D, float s) {
    const int64_t nt = (T + width - 1) / width;
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < B * heads * nt; it++) {
        const int64_t bh = it / nt, t = it % nt, b = bh / heads, h = bh % heads;
        pack_cols(dst + it * D * width, width, (const char *)base + (b * sb + h * sh) * (bf16 ? 2 : 4), bf16, st,
                  t * width, min64(width, T - t * width), D, s);
    }
}

int64_t flash_attention_scratch_floats(const flash_problem *p, int backward) {
    const int64_t nqt = (p->Tq + BR - 1) / BR, nkt = (p->Tk + BC - 1) / BC, Ds = scratch_d(p);
    const int64_t kt = p->B * p->Hkv * nkt * Ds * BC, qt = p->B * p->H * nqt * Ds * BR;
    const int64_t dqg = DQ_GROUPS * p->B * p->H * nqt * BR * round_up(p->D, VL);
    return backward ? 2 * qt + dqg : kt;
}

/* ---- forward ---- */
/* the pre-packed forward's scratch: per (b, K/V head, key tile) K as tile A operand (M = BC, K =
 * D), then V^T (M = D, K = BC): scratch_d BC floats a tile, where the f32 K^T tiles take D BC */
static uint32_t *kv_packed(const fctx *c, float *scratch, int64_t b, int64_t g, int64_t kt) {
    return (uint32_t *)scratch + ((b * c->p->Hkv + g) * c->nkt + kt) * c->Ds * BC;
}
static void pack_kv_amx(const fctx *c, float *scratch, float *tmp) {
    const flash_problem *p = c->p;
    const int64_t D = p->D, Dp = c->Dp;
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < p->B * p->Hkv * c->nkt; it++) {
        const int64_t b = it / (p->Hkv * c->nkt), g = it / c->nkt % p->Hkv, kt = it % c->nkt, j0 = kt * BC;
        const int64_t nc = min64(BC, p->Tk - j0);
        uint16_t *ka = (uint16_t *)kv_packed(c, scratch, b, g, kt), *vta = ka + TILE_AMX_A_ELEMS(BC, D);
        pack_rows(tmp, Dp, BC, head_ptr(&p->k, b, g), is16(&p->k), p->k.st, j0, nc, D, 1.0f);
        tile_amx_pack_a(ka, tmp, Dp, 1, BC, D);        /* K: A of S^T = K Q^T */
        pack_rows(tmp, Dp, BC, head_ptr(&p->v, b, g), is16(&p->v), p->v.st, j0, nc, D, 1.0f);
        tile_amx_pack_a(vta, tmp, 1, Dp, D, BC);       /* V^T: A of O^T += V^T P^T */
    }
}

/* the pre-packed forward's online softmax, on the transposed score tile St[x][r] (keys x, queries
 * r): every step runs down the columns, a query a lane, so no row is folded across lanes. The
 * bits of online_softmax on S: the same max, exp and bf16 rounding, and each row's sum in
 * online_softmax's order (lane e of row_sum adds keys e, e + VL, ... in turn, then the lanes
 * are added in order from 0; P has no denormals, so rounding as the tiles do is rounding as
 * f32_round_bf16 does). accT is O^T [D][BR]; its columns are rescaled where the max rose
 * (multiplying by 1 elsewhere would give the same bits). P^T goes to pb as the B operand of
 * O^T += V^T P^T. */
static void online_softmax_cols(float *restrict St, float *restrict m, float *restrict l, float *restrict accT,
                                int64_t D, uint32_t *restrict pb) {
    float mx[BR], sub[BR], alpha[BR], t[BR];
    #pragma omp simd
    for (int r = 0; r < BR; r++) mx[r] = m[r];
    for (int x = 0; x < BC; x++) {
        const float *s = St + x * BR;
        #pragma omp simd
        for (int r = 0; r < BR; r++) mx[r] = s[r] > mx[r] ? s[r] : mx[r];
    }
    /* a row that sees nothing yet: P = exp(-inf - 0) = 0 and alpha 1, so l, m and O^T keep theirs */
    #pragma omp simd
    for (int r = 0; r < BR; r++) {
        const int seen = mx[r] != -INFINITY;
        sub[r] = seen ? mx[r] : 0.0f;
        alpha[r] = seen ? uly_expf_softmax(m[r] - mx[r]) : 1.0f;
        m[r] = seen ? mx[r] : m[r];
        t[r] = 0.0f;
    }
    for (int x = 0; x < BC; x++) {
        float *s = St + x * BR;
        #pragma omp simd
        for (int r = 0; r < BR; r++) s[r] = uly_expf_softmax(s[r] - sub[r]);
    }
    tile_to_pairs(pb, St, 1);   /* P^T as the B operand of O^T += V^T P^T, and rounded in St */
    for (int e = 0; e < VL; e++) {
        #pragma omp simd
        for (int r = 0; r < BR; r++) {
            float a = St[e * BR + r];
            for (int q = 1; q < BC / VL; q++) a += St[(q * VL + e) * BR + r];
            t[r] += a;
        }
    }
    #pragma omp simd
    for (int r = 0; r < BR; r++) l[r] = l[r] * alpha[r] + t[r];
    for (int r0 = 0; r0 < BR; r0 += VL) {
        int rose = 0;
        for (int r = r0; r < r0 + VL; r++) rose |= alpha[r] != 1.0f;
        if (!rose) continue;
        for (int64_t d = 0; d < D; d++) {
            float *a = accT + d * BR + r0;
            #pragma omp simd
            for (int r = 0; r < VL; r++) a[r] *= alpha[r0 + r];
        }
    }
}

/* per-thread workspace floats: f32 tiles, and the pre-packed path's bf16 Q^T and P^T tiles */
static int64_t fwd_ws_floats(int64_t Dp, int64_t D) {
    return round_up(2 * BR * Dp + Dp * BC + BR * BC + 2 * BR + TILE_AMX_B_WORDS(D, BR) + TILE_AMX_B_WORDS(BC, BR), VL);
}

static void fwd_item(const fctx *c, float *ws, const float *KT, float *out, float *lse, int64_t b, int64_t h,
                     int64_t qt, int64_t *ntiles) {
    const flash_problem *p = c->p;
    const int64_t D = p->D, Dp = c->Dp, i0 = qt * BR, mr = min64(BR, p->Tq - i0), g = h / c->rep;
    float *Qs = ws, *Vs = Qs + BR * Dp, *S = Vs + BC * Dp, *acc = S + BR * BC;
    float *m = acc + BR * Dp, *l = m + BR;
    uint32_t *qb = (uint32_t *)(l + BR), *pb = qb + TILE_AMX_B_WORDS(D, BR);
    const void *vb = head_ptr(&p->v, b, g);
    pack_rows(Qs, Dp, BR, head_ptr(&p->q, b, h), is16(&p->q), p->q.st, i0, mr, D, p->scale);
    if (c->pre) tile_amx_pack_b(qb, Qs, 1, Dp, D, BR);   /* Q^T: B of S^T = K Q^T */
    memset(acc, 0, (size_t)(BR * Dp) * sizeof(float));
    for (int64_t r = 0; r < BR; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    int64_t lo, hi;
    key_span(c, i0, mr, &lo, &hi);
    for (int64_t kt = lo / BC; lo <= hi && kt <= hi / BC; kt++) {
        const int64_t j0 = kt * BC, nc = min64(BC, p->Tk - j0);
        const int cls = classify(c, b, i0, mr, j0, nc);
        if (cls == TILE_SKIP) continue;
        (*ntiles)++;
        if (c->pre) {   /* K and V packed once for all query tiles, Q once for all key tiles; transposed */
            const uint16_t *ka = (const uint16_t *)kv_packed(c, (float *)KT, b, g, kt);
            tile_amx_gemm_packed(BC, BR, D, ka, qb, S, BR, 0);                      /* S^T = K Q^T */
            if (cls == TILE_PARTIAL || nc < BC) mask_cols(c, b, S, i0, mr, j0, nc, cls == TILE_FULL);
            online_softmax_cols(S, m, l, acc, D, pb);   /* P^T: keys past nc are 0, as V's padding */
            tile_amx_gemm_packed(D, BR, BC, ka + TILE_AMX_A_ELEMS(BC, D), pb, acc, BR, 1);   /* O^T += V^T P^T */
            continue;
        }
        const float *Kt = KT + ((b * p->Hkv + g) * c->nkt + kt) * D * BC;
        pack_rows(Vs, Dp, BC, vb, is16(&p->v), p->v.st, j0, nc, D, 1.0f);
        tile_mm(c, BR, BC, D, Qs, Dp, Kt, BC, S, BC, 0);
        if (cls == TILE_PARTIAL || nc < BC) mask_rows(c, b, S, i0, mr, j0, nc, cls == TILE_FULL);
        online_softmax(S, m, l, acc, mr, Dp, c->amx);
        tile_mm(c, BR, Dp, nc, S, BC, Vs, Dp, acc, Dp, 1);
    }
    for (int64_t r = 0; r < mr; r++) {
        const int64_t i = i0 + r;
        float *o = out + ((b * p->Tq + i) * p->H + h) * D;
        float *ls = lse + (b * p->H + h) * p->Tq + i;
        if (l[r] > 0.0f) {
            const float inv = 1.0f / l[r];
            if (c->pre)   /* O^T [D][BR] */
                for (int64_t d = 0; d < D; d++) o[d] = acc[d * BR + r] * inv;
            else
                for (int64_t d = 0; d < D; d++) o[d] = acc[r * Dp + d] * inv;
            *ls = m[r] + logf(l[r]);
        } else {
            memset(o, 0, (size_t)D * sizeof(float));
            *ls = -INFINITY;
        }
    }
}

int flash_attention_forward(float *out, float *lse, float *scratch, const flash_problem *p) {
    if (p->B <= 0 || p->Tq <= 0 || p->H <= 0) return 0;
    fctx c;
    if (ctx_init(&c, p)) return -1;
    const int64_t items = p->B * p->H * c.nqt, Dp = c.Dp;
    const int64_t ws_floats = fwd_ws_floats(Dp, p->D);
    const int nt = max_threads();
    const int par = nt > 1 && items > 1 && p->B * p->H * p->Tq * p->Tk * (p->D + 1) >= PAR_MIN;
    float *ws = aligned_alloc(64, (size_t)(par ? nt : 1) * (size_t)ws_floats * sizeof(float));
    if (!ws) { ctx_free(&c); return -1; }
    int64_t total = 0;
    #pragma omp parallel if (par) reduction(+ : total)
    {
        float *mine = ws + (size_t)thread_id() * (size_t)ws_floats;
        if (c.amx) tile_amx_configure();
        if (c.pre) pack_kv_amx(&c, scratch, mine);
        else pack_all_transposed(scratch, p->k.p, is16(&p->k), p->k.sb, p->k.st, p->k.sh, p->B, p->Hkv, p->Tk, BC, p->D, 1.0f);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t bh = it / c.nqt;
            fwd_item(&c, mine, scratch, out, lse, bh / p->H, bh % p->H, it % c.nqt, &total);
        }
        if (c.amx) tile_amx_release();
    }
    __atomic_fetch_add(&tiles_done, total, __ATOMIC_RELAXED);
    free(ws);
    ctx_free(&c);
    return 0;
}

/* ---- backward ---- */
/* lse for recomputing P: an empty row (-inf) becomes +inf so that exp(S - lse) = 0 */
static float lse_for_p(float x) { return x == -INFINITY ? INFINITY : x; }

/* the pre-packed backward's scratch (in place of the f32 Q^T and dO^T tiles, scratch_d for D):
 * per (b, head, query tile) four tile B operands: Q^T (K = D, N = BR), Q (K = BR, N = D), both
 * scaled, then dO^T and dO likewise */
static uint32_t *q_packed(const fctx *c, const float *scratch, int64_t b, int64_t h, int64_t qt) {
    return (uint32_t *)scratch + ((b * c->p->H + h) * c->nqt + qt) * 2 * c->Ds * BR;
}
static void pack_q_do_amx(const fctx *c, const float *scratch, const float *dout, float *tq, float *td) {
    const flash_problem *p = c->p;
    const int64_t D = p->D, Dp = c->Dp, w = TILE_AMX_B_WORDS(D, BR);
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < p->B * p->H * c->nqt; it++) {
        const int64_t b = it / (p->H * c->nqt), h = it / c->nqt % p->H, qt = it % c->nqt, i0 = qt * BR;
        const int64_t mr = min64(BR, p->Tq - i0);
        uint32_t *dst = q_packed(c, scratch, b, h, qt);
        pack_rows(tq, Dp, BR, head_ptr(&p->q, b, h), is16(&p->q), p->q.st, i0, mr, D, p->scale);
        pack_rows(td, Dp, BR, dout + (b * p->Tq * p->H + h) * D, 0, p->H * D, i0, mr, D, 1.0f);
        tile_amx_pack_b(dst, tq, 1, Dp, D, BR);
        tile_amx_pack_b(dst + w, tq, Dp, 1, BR, D);
        tile_amx_pack_b(dst + 2 * w, td, 1, Dp, D, BR);
        tile_amx_pack_b(dst + 3 * w, td, Dp, 1, BR, D);
    }
}

/* dK, dV rows of key tile kt of K/V head (b, g), and this tile's share of dQ (unscaled dS K)
 * added into dqg, the dQ partial sums of the key-tile group kt belongs to ([B][H][nqt BR][Dp]) */
static void bwd_kv_item(const fctx *c, float *ws, const float *QT, const float *OT, float *dk, float *dv,
                        float *dqg, const float *dout, const float *lse, const float *delta, int64_t b, int64_t g,
                        int64_t kt) {
    const flash_problem *p = c->p;
    const int64_t D = p->D, Dp = c->Dp, j0 = kt * BC, nc = min64(BC, p->Tk - j0);
    float *Ks = ws, *Vs = Ks + BC * Dp, *Qs = Vs + BC * Dp;
    float *dOs = Qs + BR * Dp, *St = dOs + BR * Dp, *dPt = St + BC * BR, *dKa = dPt + BC * BR, *dVa = dKa + BC * Dp;
    float *lr = dVa + BC * Dp, *dr = lr + BR, *dSs = dr + BR;
    /* the pre-packed path's bf16 tiles: K, V and K^T as A operands, a product's A (P^T or dS^T)
     * or, for dQ^T, its B (dS^T) */
    uint16_t *ka = (uint16_t *)(dSs + BR * BC), *va = ka + TILE_AMX_A_ELEMS(BC, D), *sa = va + TILE_AMX_A_ELEMS(BC, D);
    uint16_t *kta = sa + TILE_AMX_A_ELEMS(BC, BR);
    uint32_t *sb = (uint32_t *)(kta + TILE_AMX_A_ELEMS(D, BC));
    const int64_t w = TILE_AMX_B_WORDS(D, BR);
    int64_t lo, hi;
    query_span(c, j0, nc, &lo, &hi);
    if (lo > hi) return;
    pack_rows(Ks, Dp, BC, head_ptr(&p->k, b, g), is16(&p->k), p->k.st, j0, nc, D, 1.0f);
    pack_rows(Vs, Dp, BC, head_ptr(&p->v, b, g), is16(&p->v), p->v.st, j0, nc, D, 1.0f);
    if (c->pre) {
        tile_amx_pack_a(ka, Ks, Dp, 1, BC, D);
        tile_amx_pack_a(va, Vs, Dp, 1, BC, D);
        tile_amx_pack_a(kta, Ks, 1, Dp, D, BC);
    }
    memset(dKa, 0, (size_t)(2 * BC * Dp) * sizeof(float)); /* dKa and dVa */
    const int64_t ldo = p->H * D;
    for (int64_t h = g * c->rep; h < (g + 1) * c->rep; h++) {
        const void *qb = head_ptr(&p->q, b, h);
        const float *ob = dout + (b * p->Tq * p->H + h) * D;
        const float *lh = lse + (b * p->H + h) * p->Tq, *dh = delta + (b * p->H + h) * p->Tq;
        for (int64_t qt = lo / BR; qt <= hi / BR; qt++) {
            const int64_t i0 = qt * BR, mr = min64(BR, p->Tq - i0);
            const int cls = classify(c, b, i0, mr, j0, nc);
            if (cls == TILE_SKIP) continue;
            for (int64_t r = 0; r < BR; r++) {
                lr[r] = r < mr ? lse_for_p(lh[i0 + r]) : INFINITY;
                dr[r] = r < mr ? dh[i0 + r] : 0.0f;
            }
            if (c->pre) {   /* the same products, K, V, Q and dO packed once (rows past mr: P = 0) */
                const uint32_t *qb4 = q_packed(c, QT, b, h, qt);
                tile_amx_gemm_packed(BC, BR, D, ka, qb4, St, BR, 0);                   /* S^T = K Q^T */
                if (cls == TILE_PARTIAL || nc < BC) mask_cols(c, b, St, i0, mr, j0, nc, cls == TILE_FULL);
                exp_minus_lse_packed(St, lr, sa);                                       /* P^T */
                tile_amx_gemm_packed(BC, D, BR, sa, qb4 + 3 * w, dVa, Dp, 1);           /* dV += P^T dO */
                tile_amx_gemm_packed(BC, BR, D, va, qb4 + 2 * w, dPt, BR, 0);           /* dP^T = V dO^T */
                scores_grad_packed(dPt, St, dr, sa, sb);                                /* dS^T */
                tile_amx_gemm_packed(BC, D, BR, sa, qb4 + w, dKa, Dp, 1);               /* dK += dS^T Q */
                if (dqg)                /* dQ^T += K^T dS^T: the group's tile of dQ kept transposed, [D][BR] */
                    tile_amx_gemm_packed(D, BR, BC, kta, sb, dqg + ((b * p->H + h) * c->nqt * BR + i0) * Dp, BR, 1);
                continue;
            }
            const float *Qt = QT + ((b * p->H + h) * c->nqt + qt) * D * BR;
            const float *dOt = OT + ((b * p->H + h) * c->nqt + qt) * D * BR;
            pack_rows(Qs, Dp, BR, qb, is16(&p->q), p->q.st, i0, mr, D, p->scale);
            pack_rows(dOs, Dp, BR, ob, 0, ldo, i0, mr, D, 1.0f);
            tile_mm(c, BC, BR, D, Ks, Dp, Qt, BR, St, BR, 0);            /* S^T = K Q^T (scaled) */
            if (cls == TILE_PARTIAL || nc < BC) mask_cols(c, b, St, i0, mr, j0, nc, cls == TILE_FULL);
            exp_minus_lse(St, lr);                                        /* P^T */
            tile_mm(c, BC, Dp, mr, St, BR, dOs, Dp, dVa, Dp, 1);          /* dV += P^T dO */
            tile_mm(c, BC, BR, D, Vs, Dp, dOt, BR, dPt, BR, 0);           /* dP^T = V dO^T */
            scores_grad(dPt, St, dr);                                     /* dS^T = P^T (dP^T - delta) */
            tile_mm(c, BC, Dp, mr, dPt, BR, Qs, Dp, dKa, Dp, 1);          /* dK += dS^T (scale Q) */
            if (dqg) {                                                    /* dQ_group += dS K */
                for (int64_t r = 0; r < BR; r++)
                    for (int64_t x = 0; x < BC; x++) dSs[r * BC + x] = dPt[x * BR + r];
                tile_mm(c, BR, Dp, BC, dSs, BC, Ks, Dp, dqg + ((b * p->H + h) * c->nqt * BR + i0) * Dp, Dp, 1);
            }
        }
    }
    for (int64_t x = 0; x < nc; x++) {
        const int64_t row = ((b * p->Tk + j0 + x) * p->Hkv + g) * D;
        if (dk) for (int64_t d = 0; d < D; d++) dk[row + d] += dKa[x * Dp + d];
        if (dv) for (int64_t d = 0; d < D; d++) dv[row + d] += dVa[x * Dp + d];
    }
}

int flash_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                             float *delta, float *scratch, const flash_problem *p) {
    if (p->B <= 0 || p->Tq <= 0 || p->Tk <= 0 || p->H <= 0 || p->D <= 0) return 0; /* no gradient flows */
    if (!dq && !dk && !dv) return 0;
    fctx c;
    if (ctx_init(&c, p)) return -1;
    const int64_t Dp = c.Dp, D = p->D, H = p->H, Tq = p->Tq;
    const int64_t ws_floats = round_up(2 * BR * Dp + 2 * BC * BR + 4 * BC * Dp + 2 * BR + BR * BC +
                                       (3 * TILE_AMX_A_ELEMS(BC, D) + TILE_AMX_A_ELEMS(BC, BR)) / 2 +
                                       TILE_AMX_B_WORDS(BC, BR), VL);
    const int64_t nq = p->B * H * c.nqt * c.Ds * BR, group_floats = p->B * H * c.nqt * BR * Dp;
    float *QT = scratch, *OT = QT + nq, *dqg = OT + nq; /* dqg: DQ_GROUPS x [B][H][nqt BR][Dp] */
    const int nt = max_threads();
    const int par = nt > 1 && p->B * H * Tq * p->Tk * (D + 1) >= PAR_MIN;
    float *ws = aligned_alloc(64, (size_t)(par ? nt : 1) * (size_t)ws_floats * sizeof(float));
    if (!ws) { ctx_free(&c); return -1; }
    const int64_t rows = p->B * Tq;
    /* One pass over key tiles: each task (b, K/V head, group) walks the key tiles kt = group,
     * group + G, ... in order, so every dQ partial sum has one writer and a fixed order, and the
     * groups are added in order at the end: bit-identical at any thread count. */
    #pragma omp parallel if (par)
    {
        float *mine = ws + (size_t)thread_id() * (size_t)ws_floats;
        if (c.amx) tile_amx_configure();
        #pragma omp for schedule(static)
        for (int64_t bi = 0; bi < rows; bi++) { /* delta = rowsum(dO * O), dO as dP's product reads it */
            const int64_t b = bi / Tq, i = bi % Tq;
            for (int64_t h = 0; h < H; h++) {
                const float *o = out + (bi * H + h) * D, *g = dout + (bi * H + h) * D;
                float s = 0.0f;
                if (c.amx)
                    for (int64_t d = 0; d < D; d++) s += o[d] * f32_round_bf16(g[d]);
                else
                    for (int64_t d = 0; d < D; d++) s += o[d] * g[d];
                delta[(b * H + h) * Tq + i] = s;
            }
        }
        if (dq) {
            #pragma omp for schedule(static)
            for (int64_t k = 0; k < DQ_GROUPS * p->B * H * c.nqt; k++)
                memset(dqg + k * BR * Dp, 0, (size_t)(BR * Dp) * sizeof(float));
        }
        if (c.pre) {
            pack_q_do_amx(&c, QT, dout, mine, mine + BR * Dp);
        } else {
            pack_all_transposed(QT, p->q.p, is16(&p->q), p->q.sb, p->q.st, p->q.sh, p->B, H, Tq, BR, D, p->scale);
            pack_all_transposed(OT, dout, 0, Tq * H * D, H * D, D, p->B, H, Tq, BR, D, 1.0f);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < p->B * p->Hkv * DQ_GROUPS; it++) {
            const int64_t grp = it % DQ_GROUPS, bg = it / DQ_GROUPS;
            for (int64_t kt = grp; kt < c.nkt; kt += DQ_GROUPS)
                bwd_kv_item(&c, mine, QT, OT, dk, dv, dq ? dqg + grp * group_floats : NULL, dout, lse, delta,
                            bg / p->Hkv, bg % p->Hkv, kt);
        }
        if (c.amx) tile_amx_release();
        if (dq && c.pre) {
            /* dQ = scale * (group 0 + group 1 + ...) from the transposed [D][BR] tiles, a tile at a
             * time (its groups stay in cache while its rows are written; row by row across the
             * heads, each element read had been a cache miss) */
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < p->B * H * c.nqt; t++) {
                const int64_t bh = t / c.nqt, b = bh / H, h = bh % H, i0 = t % c.nqt * BR;
                const float *s0 = dqg + (bh * c.nqt * BR + i0) * Dp;
                for (int64_t r = 0; r < min64(BR, Tq - i0); r++) {
                    float *d = dq + ((b * Tq + i0 + r) * H + h) * D;
                    for (int64_t x = 0; x < D; x++) {
                        float sum = s0[x * BR + r];
                        for (int64_t gi = 1; gi < DQ_GROUPS; gi++) sum += s0[gi * group_floats + x * BR + r];
                        d[x] += p->scale * sum;
                    }
                }
            }
        } else if (dq) {
            #pragma omp for schedule(static)
            for (int64_t bi = 0; bi < rows; bi++) { /* dQ = scale * (group 0 + group 1 + ...) */
                const int64_t b = bi / Tq, i = bi % Tq;
                for (int64_t h = 0; h < H; h++) {
                    float *d = dq + (bi * H + h) * D;
                    const float *s0 = dqg + ((b * H + h) * c.nqt * BR + i) * Dp;   /* [BR][Dp] tiles */
                    for (int64_t x = 0; x < D; x++) {
                        float sum = s0[x];
                        for (int64_t gi = 1; gi < DQ_GROUPS; gi++) sum += s0[gi * group_floats + x];
                        d[x] += p->scale * sum;
                    }
                }
            }
        }
    }
    free(ws);
    ctx_free(&c);
    return 0;
}
