/* kernels/cuda/attention_backward.cuh — the fused attention backward: dK/dV (a block per 64 keys,
 * or 128 as two warpgroups, walking the query tiles that see them) and dQ (a block per 64 query
 * rows, or 128, walking key tiles), each on mma.sync or wgmma; see attention_fused.cu for the
 * design and the host side. */
#pragma once
#include "attention_tiles.cuh"
#include "tma.cuh"

/* ---- backward: dK and dV ---- */
/* the two products of a backward tile for this warp's 16 rows (rows warp * 16 .. of a1 and a2)
 * against 32 rows of b1 and b2, contracted over D: s = a1 b1^T, dp = a2 b2^T, each 16 x 32 in
 * accumulator layout (four n8 tiles) */
template <int D>
__device__ static inline void two_products(float s[4][4], float dp[4][4], const uint4 *a1, const uint4 *b1,
                                           const uint4 *a2, const uint4 *b2, int warp) {
#pragma unroll
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t x[4], y[4];
        ldmatrix_x4(x, frag_a<D>(a1, warp * 16, 2 * kk));
        ldmatrix_x4(y, frag_a<D>(a2, warp * 16, 2 * kk));
#pragma unroll
        for (int np = 0; np < 2; np++) {
            uint32_t bx[4], by[4];
            ldmatrix_x4(bx, frag_b<D>(b1, np * 16, 2 * kk));
            mma_two(s[2 * np], s[2 * np + 1], x, bx);
            ldmatrix_x4(by, frag_b<D>(b2, np * 16, 2 * kk));
            mma_two(dp[2 * np], dp[2 * np + 1], y, by);
        }
    }
}
/* the query rows that can see some key of [j0, j1]: the inverse of the causal / window band */
__device__ static inline void query_span(const geom &g, int64_t j0, int64_t j1, int64_t *i_lo, int64_t *i_hi) {
    int64_t off = g.Tk - g.Tq, a = 0, z = g.Tq - 1;
    if (g.causal && j0 - off > a) a = j0 - off;
    if (g.right >= 0 && j0 - g.right - off > a) a = j0 - g.right - off;
    if (g.left >= 0 && j1 + g.left - off < z) z = j1 + g.left - off;
    *i_lo = a;
    *i_hi = z;
}

/* the query rows [lo, hi] that see every key of [j0, j0 + KEYS) (none with keys past the last or
 * documents): rows see [band lo, band hi], both ends growing with the row, so these are the rows
 * from the first that sees key j0 + KEYS - 1 to the last that sees key j0 */
struct full_rows { int32_t lo, hi; };
template <int KEYS = 64>
__device__ static inline full_rows full_rows_of_keys(const geom &g, int64_t j0) {
    int64_t a, z, a1, z1;
    key_band(g, j0 + KEYS - 1, &a, &z);
    key_band(g, j0, &a1, &z1);
    full_rows f = {(int32_t)a, (int32_t)z1};
    if (j0 + KEYS - 1 >= g.Tk || g.q_doc) f.hi = -1;
    return f;
}

/* the query rows a warpgroup's 64 keys [j0, j0 + 63] are seen by (query_span's, [lo, hi]; empty
 * when its keys are all past the last) and those seeing all of them (full_rows_of_keys'): what
 * wg_query_tile_state compares a query tile with */
struct key_rows { int32_t lo, hi; full_rows full; };
__device__ static inline key_rows rows_of_keys(const geom &g, int64_t j0) {
    key_rows k = {1, 0, {0, -1}};
    if (j0 >= g.Tk) return k;
    int64_t lo, hi;
    query_span(g, j0, j0 + 63 < g.Tk ? j0 + 63 : g.Tk - 1, &lo, &hi);
    k.lo = (int32_t)lo;
    k.hi = (int32_t)hi;
    k.full = full_rows_of_keys<64>(g, j0);
    return k;
}
/* A warpgroup's view of a QT-query tile at i0 that a 128-key block's walk classified as `st` (for
 * all its keys): FULL stays FULL; a MASKED one may be EMPTY or FULL for the warpgroup's 64 keys
 * (the band's comparisons; with a block-sparse layout a visible one stays MASKED: the
 * per-element mask is right either way). Inline comparisons only (a call in the loop would
 * serialise the wgmmas, C7520). */
template <int QT>
__device__ static inline int wg_query_tile_state(const geom &g, const key_rows &kr, int st, int i0) {
    if (st != TILE_MASKED) return st;
    if (kr.lo > kr.hi || i0 + QT - 1 < kr.lo || i0 > kr.hi) return TILE_EMPTY;
    return !g.layout && i0 >= kr.full.lo && i0 + QT - 1 <= kr.full.hi ? TILE_FULL : TILE_MASKED;
}

/* the next QT-query tile, head-major over the query heads sharing the kv head (up to h_end), at or after
 * (*h, *i0) with a visible pair against keys [j0, j0 + KEYS); 0 when none is left. Without a
 * block-sparse layout every tile of the rows [i_lo, i_hi] (query_span's, not empty) has one, and
 * it is wholly visible when its rows are within fr (the search took ~100 instructions a tile). */
template <int QT, int KEYS = 64>
__device__ static inline int next_query_tile(const geom &g, int h_end, int64_t j0, int i_lo, int i_hi,
                                             const full_rows &fr, int *h, int *i0, int *st) {
    if (!g.layout) {
        if (*i0 > i_hi) { (*h)++; *i0 = i_lo / QT * QT; }
        if (*h >= h_end) return 0;
        *st = *i0 >= fr.lo && *i0 + QT - 1 <= fr.hi ? TILE_FULL : TILE_MASKED;
        return 1;
    }
    for (; *h < h_end; (*h)++, *i0 = i_lo / QT * QT)
        for (; *i0 <= i_hi; *i0 += QT) {
            *st = tile_state(g, span_of_rows(g, *i0, *i0 + QT - 1), j0, j0 + KEYS - 1);
            if (*st != TILE_EMPTY) return 1;
        }
    return 0;
}

/* dynamic shared memory of either backward kernel: two 64-row tiles that stay (dK/dV: K, V;
 * dQ: Q, dO) and two buffers of two ST-row tiles that stream (Q, dO; K, V: 32 rows, or 64 in the
 * dK/dV variant with 64-query tiles); the one-pass dK/dV kernel (DQ) adds dS^T as a bf16 tile of
 * 64 keys x 32 queries */
template <int D, bool DQ = false, int ST = 32>
static constexpr size_t backward_smem_bytes() { return (size_t)(2 * 64 + 4 * ST) * (D / 8) * 16 + (DQ ? 64 * 32 * 2 : 0); }

/* the one-pass backward's dQ share of one (64-key, 32-query) tile pair: dq (f32, [B, Tq, H, D]
 * rows i0.. of head h) += dS K over the block's 64 keys, dS^T read from the keys-major bf16 tile
 * sdS (64 x 32, dS / scale: the scale is applied here); warp w takes query rows 16 (w & 1).. and half (w >> 1) of D, and adds its
 * 16 x D/2 into dq with atomics (other blocks add the other keys' shares) */
template <int D>
__device__ static inline void dq_share(float *dq, const geom &g, int64_t b, int64_t h, int64_t i0, const uint4 *sdS,
                                       const uint4 *sK, int warp) {
    constexpr int NT = D / 16;   /* n8 tiles in half of D */
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const int q0 = (warp & 1) * 16, c0 = (warp >> 1) * (D / 16);   /* its rows; its first chunk of D */
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {   /* 16 keys at a time */
        uint32_t a[4];
        ldmatrix_x4_trans(a, frag_b<32>(sdS, kk * 16, q0 / 8));   /* dS rows q0.., keys kk * 16.. */
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t bb[4];
            ldmatrix_x4_trans(bb, frag_a<D>(sK, kk * 16, c0 + 2 * np));
            mma_two(acc[2 * np], acc[2 * np + 1], a, bb);
        }
    }
    const int lane = threadIdx.x & 31, tq = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = i0 + q0 + (lane >> 2) + 8 * r;
        if (i >= g.Tq) continue;
        float *dst = dq + ((b * g.Tq + i) * g.H + h) * D + c0 * 8 + 2 * tq;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            atomicAdd(dst + n * 8, acc[n][2 * r] * g.scale);   /* sdS holds dS / scale */
            atomicAdd(dst + n * 8 + 1, acc[n][2 * r + 1] * g.scale);
        }
    }
}

/* the dK/dV kernel's per-query statistics of one QT-query tile, lse at st[0..QT) and delta at
 * st[QT..2 QT) (zeros past the last query), queued as single-float cp.async copies beside the
 * tile's Q and dO: read from shared memory in the loop instead of from global memory (each
 * thread's loads of them there stalled on L2 latency every tile) */
static constexpr size_t dkv_stats_bytes(int QT) { return 2 * 2 * (size_t)QT * sizeof(float); }   /* two buffers */
template <int QT>
__device__ static inline void load_stats_async(float *st, const float *L, const float *dl, int64_t i0, int64_t Tq) {
    static_assert(2 * QT <= FA_THREADS, "load_stats_async: a thread a value");
    const int t = threadIdx.x;
    if (t < 2 * QT) {
        const int64_t i = i0 + (t & (QT - 1));
        const bool in = i < Tq;
        cp_async4(st + t, in ? (t < QT ? L : dl) + i : L, in);
    }
}

/* P^T and dS^T / scale of a tile in place of S^T (s) and dP^T (dp), 64 keys x T queries, this
 * thread's query t = 8 n + 2 tq + c at column (n, c); lse at stats[t], delta at stats[T + t].
 * P^T = exp(S^T scale - lse) as 2^(S^T scale log2e - lse log2e) (sl2 = scale log2e). Only masked
 * tiles hold queries past the last (stats 0, or another head's) or queries that see nothing (lse
 * -inf), and there every pair of theirs is -inf: lse is clamped to -1e30 so that -inf - lse stays
 * -inf (P = 0; with lse -inf it would be NaN). dS^T / scale = P^T (dP^T - delta): the scale is
 * applied to dK once at the end (and by dq_share to its dQ) */
template <int NT, int T>
__device__ static inline void probs_and_dscores(float s[NT][4], float dp[NT][4], const float *stats, float sl2, int tq) {
    float nl2[NT][2], dlc[NT][2];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int t = n * 8 + 2 * tq + c;
            nl2[n][c] = -fmaxf(stats[t], -1e30f) * LOG2E_F;
            dlc[n][c] = stats[T + t];
        }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = exp2_ftz(fmaf(s[n][e], sl2, nl2[n][e & 1]));
            s[n][e] = p;
            dp[n][e] = p * (dp[n][e] - dlc[n][e & 1]);
        }
}

/* The one-pass dQ of a 128-key block and a T-query tile (fa_backward_dkv_ws with DQ), queued (the
 * caller fences, commits and waits): dQ^T = K^T dS^T / scale over the block's 128 keys, split
 * between the two warpgroups so that each element of dQ is added once a block: at D 128
 * warpgroup wg takes elements 64 wg.. of D for all T queries, at D 64 (T 64) all of D for queries
 * 32 wg..; dqt is its 64 x DQ_SHARE_N (accumulator layout), as 64 x 32 blocks of 16 floats a
 * thread. K^T from both consumers' K tiles (sKV; a 128-byte line per key holding 64 of D, the atom
 * column of wg's half at D 128: MN-major A), dS from sdS (both warpgroups' dS as bf16, a 128-byte
 * line per query holding 64 keys, the second warpgroup's 64 keys one T-line atom column on:
 * K-major B) */
#define DQ_SHARE_N(D, T) ((D) == 128 ? (T) : (T) / 2)   /* queries a warpgroup's dQ share holds */
template <int D, int T>
__device__ static inline void dq_share_issue_wg(float dqt[DQ_SHARE_N(D, T) / 2], const uint4 *sdS, const uint4 *sKV, int wg) {
    constexpr uint32_t K_APART = 128 * (D / 8) * 16, DS_APART = T * 128;   /* bytes: the two K tiles, dS's columns */
    const uint32_t da = wg_desc_lo(sKV + (D == 128 ? wg * 512 : 0)), db = wg_desc_lo(sdS + (D == 64 ? wg * 32 * 8 : 0));
#pragma unroll
    for (int q = 0; q < DQ_SHARE_N(D, T) / 32; q++) {   /* 32 queries: 32 lines (4 KiB) along dS */
        wgmma_64x32_ss<0, 0, 1>(dqt + 16 * q, wg_desc_at(da, 0), wg_desc_at(db, q * 4096));
#pragma unroll
        for (int kk = 1; kk < 8; kk++)   /* 16 keys: 16 lines (2 KiB) into a K tile; 32 bytes along dS's lines */
            wgmma_64x32_ss<0, 1, 1>(dqt + 16 * q, wg_desc_at(da, (kk >> 2) * K_APART + (kk & 3) * 2048),
                                    wg_desc_at(db, q * 4096 + (kk >> 2) * DS_APART + (kk & 3) * 32));
    }
}
/* this warp's dS^T (da: 16 keys x T queries as the bf16 A fragments of dK's product, / scale;
 * zero: zeros) into col, its warpgroup's keys' column of dq_share_issue_wg's dS (T lines of 64
 * keys, 128-byte swizzled): 16-bit stores, 16 distinct words a store */
template <int T>
__device__ static inline void store_dscores_rows(uint4 *col, const uint32_t da[T / 16][4], int warp, int lane, bool zero) {
#pragma unroll
    for (int n = 0; n < T / 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint32_t w = zero ? 0u : da[n >> 1][2 * (n & 1) + r];   /* queries 8 n + 2 (lane % 4), + 1 */
            uint16_t *const at = (uint16_t *)&col[sw128_at<T>(8 * n + 2 * (lane & 3), 2 * warp + r)] + (lane >> 2);
            at[0] = (uint16_t)w;
            ((uint16_t *)&col[sw128_at<T>(8 * n + 2 * (lane & 3) + 1, 2 * warp + r)])[lane >> 2] = (uint16_t)(w >> 16);
        }
}
/* dqt (dq_share_issue_wg's share of queries i0..i0 + T - 1 of head h) times the scale added into dq
 * ([B, Tq, H, D] f32) with atomics, none past the last query */
template <int D, int T>
__device__ static inline void add_dq_share_wg(float *dq, const geom &g, int64_t b, int64_t h, int64_t i0,
                                              const float dqt[DQ_SHARE_N(D, T) / 2], int wg, int warp, int lane) {
    const int d = (D == 128 ? 64 * wg : 0) + 16 * warp + (lane >> 2);
    const int64_t q0 = i0 + (D == 64 ? 32 * wg : 0) + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < DQ_SHARE_N(D, T) / 8; j++)   /* 8 queries, 4 floats of dqt */
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int64_t i = q0 + 8 * j + c;
            if (i >= g.Tq) continue;
            float *const dst = dq + ((b * g.Tq + i) * g.H + h) * D + d;
            atomicAdd(dst, dqt[4 * j + c] * g.scale);
            atomicAdd(dst + 8, dqt[4 * j + 2 + c] * g.scale);
        }
}

/* dV += P^T dO and dK += dS^T Q as wgmma, P^T and dS^T (pa, da: 64 keys x T queries as bf16 A
 * fragments) with dO and Q (T-row tiles) MN-major B; DQ: with dq_share_issue_wg's share of dQ
 * (dqt, from sdS and sKV) in the same group; waited for */
template <int D, int T, bool DQ = false>
__device__ static inline void dkv_accumulate_frags(float dva[D / 8][4], float dka[D / 8][4], const uint32_t pa[T / 16][4],
                                                   const uint32_t da[T / 16][4], const uint4 *sO, const uint4 *sQ,
                                                   float *dqt = nullptr, const uint4 *sdS = nullptr,
                                                   const uint4 *sKV = nullptr, int wg = 0) {
    wg_fence();
    if constexpr (DQ) dq_share_issue_wg<D, T>(dqt, sdS, sKV, wg);
    acc_times_tile_wg<D, T / 16, T>(dva, pa, sO);
    acc_times_tile_wg<D, T / 16, T>(dka, da, sQ);
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(&dva[0][0], 4 * (D / 8));
    wg_fence_regs(&dka[0][0], 4 * (D / 8));
    if constexpr (DQ) wg_fence_regs(dqt, DQ_SHARE_N(D, T) / 2);
}
/* the same from P^T and dS^T in accumulator layout (s, dp), rounded here */
template <int D, int T>
__device__ static inline void dkv_accumulate_wg(float dva[D / 8][4], float dka[D / 8][4], float s[T / 8][4],
                                                float dp[T / 8][4], const uint4 *sO, const uint4 *sQ) {
    uint32_t pa[T / 16][4], da[T / 16][4];
    acc_to_a_all<T / 16>(pa, s);
    acc_to_a_all<T / 16>(da, dp);
    dkv_accumulate_frags<D, T>(dva, dka, pa, da, sO, sQ);
}

/* a dK/dV block's sums added into dk and dv ([B, Tk, Hkv, D] f32) at this thread's two keys
 * (none past the last), dK times the scale left out of its loop */
template <int D>
__device__ static inline void add_dkv_rows(float *dk, float *dv, const geom &g, int64_t b, int64_t hk, const int64_t keys[2],
                                           const float dka[D / 8][4], const float dva[D / 8][4], int tq) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int64_t j = keys[r];
        if (j >= g.Tk) continue;
        int64_t at = ((b * g.Tk + j) * g.Hkv + hk) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                if (dk) dk[at + n * 8 + c] += dka[n][2 * r + c] * g.scale;
                if (dv) dv[at + n * 8 + c] += dva[n][2 * r + c];
            }
    }
}

/* WG: S^T, dP^T, dV += P^T dO and dK += dS^T Q as wgmma (Hopper), every tile in its layout (at
 * D = 128: 221 registers, no spills, with S^T and dP^T's A (K, V) from shared memory; with A in
 * registers it spilled ~100 bytes a thread, and the mma.sync kernel uses 255).
 * DQ (the one-pass backward, D = 32 and 64): dQ too, from the same dS (dq_share, atomics), so
 * S and dP are computed once instead of once here and once in the dQ kernel; dq_share reads K
 * through ldmatrix, whose layout is the wgmma one at D = 64 only, so DQ stays on mma.sync at 128 */
/* QT: queries a tile, 32, or 64 in the wgmma variant at D = 64 (ULY_CUDA_ATTN_DKV=64): S^T and
 * dP^T as 64 x 64 wgmmas, whose A (K, V: 2 KiB a wgmma from shared memory) then feeds twice the
 * math of a 64 x 32 one, and half the tiles to walk; 3 blocks per SM instead of 4 (more registers) */
/* WGS = 2 (wgmma only, ULY_CUDA_ATTN_DKV=rows128): 128 keys a block, two warpgroups of 64 each
 * with its own K and V, sharing every Q and dO tile (and its lse and delta) the block loads: half
 * the tile loads per FLOP, as the 128-row forward and dQ; a warpgroup skips the math of a query
 * tile none of its keys is seen by, keeping to the barriers. */
#define DKV_MIN_BLOCKS(wg, D, DQ, QT) ((QT) == 64 ? ((wg) && ULY_HAS_WGMMA ? 3 : 0) : WG_MIN_BLOCKS((wg) && (D) == 64 && !(DQ), D))
template <int D, bool WG, bool DQ = false, int QT = 32, int WGS = 1>
__global__ static void __launch_bounds__(WGS * FA_THREADS, WGS == 2 ? ROWS128_MIN_BLOCKS(D) : DKV_MIN_BLOCKS(WG, D, DQ, QT))
fa_backward_dkv(float *dk, float *dv, geom g, const bf16 *Q, const bf16 *K, const bf16 *V, const bf16 *dO,
                const float *lse, const float *delta, int *ran_wgmma, float *dq) {
    constexpr int CH = D / 8;
    constexpr bool W = WG && ULY_HAS_WGMMA && (D == 64 || (D == 128 && !DQ));
    static_assert(QT == 32 || (QT == 64 && D == 64 && !DQ), "fa_backward_dkv: 64-query tiles only at D 64, two-pass");
    static_assert(WGS == 1 || (WGS == 2 && WG && !DQ), "fa_backward_dkv: two warpgroups only on wgmma, two-pass");
    if constexpr (WGS == 2 && !W) return;   /* never launched in a pass without wgmma */
    constexpr int T = W ? QT : 32;   /* this pass's query tile (mma.sync: 32) */
    constexpr int NT = T / 8;        /* n8 tiles of queries: S^T is 64 x T */
    constexpr int KEYS = 64 * WGS;   /* the block's keys */
    constexpr int QO = 2 * KEYS;     /* the Q / dO buffers' first row in shared memory */
    ULY_DYNAMIC_SHARED(uint4, smem_raw);
    uint4 *const smem = W ? align_1024(smem_raw) : smem_raw;
    if (W && ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    /* per warpgroup K, V (64 rows), then two buffers of Q (T rows) followed by dO (T rows), (DQ:
     * dS^T), then the two buffers of lse and delta (2 T floats each) */
    const int wg = WGS == 2 ? (int)(threadIdx.x >> 7) : 0;
    uint4 *const sK = smem + wg * 128 * CH, *const sV = sK + 64 * CH;
    float *const sStats = (float *)(smem + (QO + 4 * QT) * CH + (DQ ? 64 * 32 * 2 / 16 : 0));
    const int64_t nt = (g.Tk + KEYS - 1) / KEYS, tile = (int64_t)blockIdx.x % nt, bh = (int64_t)blockIdx.x / nt;
    const int64_t b = bh / g.Hkv, hk = bh % g.Hkv, jb = tile * KEYS, j0 = jb + 64 * wg, G = g.H / g.Hkv;
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    const int warp = WGS == 2 ? (int)(threadIdx.x >> 5) & 3 : (int)(threadIdx.x >> 5), lane = threadIdx.x & 31,
              tq = lane & 3;
    const int64_t keys[2] = {j0 + warp * 16 + (lane >> 2), j0 + warp * 16 + (lane >> 2) + 8};
    const bf16 *const qbase = Q + b * g.Tq * qs, *const obase = dO + b * g.Tq * qs;

    float dka[CH][4], dva[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++)
        for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.0f;
    /* pipeline: the next query tile's Q and dO load into the other buffer during this one's math */
    /* the walk in 32 bits (positions < 2^30, heads fewer): fewer registers live across the loop */
    int64_t span_lo, span_hi;
    query_span(g, jb, jb + KEYS - 1 < g.Tk ? jb + KEYS - 1 : g.Tk - 1, &span_lo, &span_hi);
    const int i_lo = (int)span_lo, i_hi = (int)span_hi, h_end = (int)(hk * G + G);
    int h = (int)(hk * G), i0 = i_lo / T * T;
    int st = TILE_EMPTY, buf = 0;
    const full_rows fr = full_rows_of_keys<KEYS>(g, jb);
    const key_rows kr = WGS == 2 ? rows_of_keys(g, j0) : key_rows{};   /* this warpgroup's keys' rows */
    int have = i_lo <= i_hi && next_query_tile<T, KEYS>(g, h_end, jb, i_lo, i_hi, fr, &h, &i0, &st);
    /* W: A of S^T, dP^T; each warpgroup its own keys */
    load_tile_async<D, 64, W, FA_THREADS, WGS == 2>(sK, K + b * g.Tk * ks + hk * D, j0, g.Tk, ks);
    load_tile_async<D, 64, W, FA_THREADS, WGS == 2>(sV, V + b * g.Tk * ks + hk * D, j0, g.Tk, ks);
    const float *const lse_b = lse + b * g.H * g.Tq, *const delta_b = delta + b * g.H * g.Tq;
    if (have) {
        load_tile_async<D, T, W, WGS * FA_THREADS>(smem + QO * CH, qbase + h * D, i0, g.Tq, qs);
        load_tile_async<D, T, W, WGS * FA_THREADS>(smem + (QO + T) * CH, obase + h * D, i0, g.Tq, qs);
        load_stats_async<T>(sStats, lse_b + h * g.Tq, delta_b + h * g.Tq, i0, g.Tq);
    }
    cp_async_commit();
    while (have) {
        int h_next = h, i_next = i0 + T;
        int st_next = TILE_EMPTY;
        const int more = next_query_tile<T, KEYS>(g, h_end, jb, i_lo, i_hi, fr, &h_next, &i_next, &st_next);
        if (more) {   /* the other buffer: every warp finished with it at the end of the last round */
            uint4 *const other = smem + (QO + 2 * T * (buf ^ 1)) * CH;
            load_tile_async<D, T, W, WGS * FA_THREADS>(other, qbase + h_next * D, i_next, g.Tq, qs);
            load_tile_async<D, T, W, WGS * FA_THREADS>(other + T * CH, obase + h_next * D, i_next, g.Tq, qs);
            load_stats_async<T>(sStats + 2 * T * (buf ^ 1), lse_b + h_next * g.Tq, delta_b + h_next * g.Tq, i_next, g.Tq);
        }
        cp_async_commit();
        /* this tile's mask (bit 2 n + c of key r: the query in s[n][2 r + c]; all set but on
         * masked tiles), worked out while the tiles load, applied after the MMAs */
        const int mine = WGS == 2 ? wg_query_tile_state<T>(g, kr, st, i0) : st;   /* this warpgroup's keys' view */
        uint32_t vis[2] = {~0u, ~0u};
        if (mine == TILE_MASKED)
#pragma unroll
            for (int r = 0; r < 2; r++) vis[r] = keys[r] < g.Tk ? visible_bits<NT, false>(g, b, keys[r], i0 + 2 * tq) : 0u;
        cp_async_wait<1>();   /* this tile's Q and dO (and K, V): all but the newest group */
        if (W) fence_proxy_async();
        __syncthreads();
        if (WGS == 2 && mine == TILE_EMPTY) {   /* none of this warpgroup's keys is seen by the tile */
            __syncthreads();
            h = h_next;
            i0 = i_next;
            st = st_next;
            have = more;
            buf ^= 1;
            continue;
        }
        const uint4 *const sQ = smem + (QO + 2 * T * buf) * CH, *const sO = sQ + T * CH;
        const float *const stats = sStats + 2 * T * buf;   /* this tile's lse, then delta */
        float s[NT][4], dp[NT][4];
        if constexpr (W) two_products_wg<D, T>(s, dp, sK, sQ, sV, sO);   /* S^T = K Q^T, dP^T = V dO^T */
        else two_products<D>(s, dp, sK, sQ, sV, sO, warp);
        if (mine == TILE_MASKED) {   /* S^T at -inf where not visible (exp gives 0) */
            apply_bits<NT>(s, vis[0], 0);
            apply_bits<NT>(s, vis[1], 1);
        }
        probs_and_dscores<NT, T>(s, dp, stats, g.scale * LOG2E_F, tq);
        if constexpr (DQ) {   /* dS^T into its bf16 tile (keys-major), then this tile pair's share of dQ */
            uint4 *const sdS = smem + 256 * CH;
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int r = 0; r < 2; r++)
                    ((uint32_t *)&sdS[sw_at<32>(warp * 16 + (lane >> 2) + 8 * r, n)])[tq] =
                        mma_pack_bf16(dp[n][2 * r], dp[n][2 * r + 1]);
            __syncthreads();
            dq_share<D>(dq, g, b, h, i0, sdS, sK, warp);
        }
        if constexpr (W) {
            dkv_accumulate_wg<D, T>(dva, dka, s, dp, sO, sQ);
        } else {
            acc_times_tile<D, 2>(dva, s, sO);    /* dV += P^T dO (T = 32) */
            acc_times_tile<D, 2>(dka, dp, sQ);   /* dK += dS^T Q */
        }
        __syncthreads();   /* every warp is done with this buffer before the next round refills it */
        h = h_next;
        i0 = i_next;
        st = st_next;
        have = more;
        buf ^= 1;
    }
    add_dkv_rows<D>(dk, dv, g, b, hk, keys, dka, dva, tq);
}

/* a 128-key block's walk over the T-query tiles that see its keys, head-major over the query
 * heads of its kv head hk (next_query_tile's): the tile at (h, i0), its state st; have = 0 when
 * none is left */
template <int T>
struct query_walk {
    int i_lo, i_hi, h_end, h, i0, st, have;
    full_rows fr;
    __device__ void next(const geom &g, int64_t jb) {
        i0 += T;
        have = next_query_tile<T, 128>(g, h_end, jb, i_lo, i_hi, fr, &h, &i0, &st);
    }
};
template <int T>
__device__ static inline query_walk<T> start_query_walk(const geom &g, int64_t hk, int64_t jb) {
    query_walk<T> w;
    int64_t lo, hi;
    query_span(g, jb, jb + 127 < g.Tk ? jb + 127 : g.Tk - 1, &lo, &hi);
    const int G = g.H / g.Hkv;
    w.i_lo = (int)lo;
    w.i_hi = (int)hi;
    w.h_end = (int)hk * G + G;
    w.h = (int)hk * G;
    w.i0 = w.i_lo / T * T;
    w.st = TILE_EMPTY;
    w.fr = full_rows_of_keys<128>(g, jb);
    w.have = w.i_lo <= w.i_hi && next_query_tile<T, 128>(g, w.h_end, jb, w.i_lo, w.i_hi, w.fr, &w.h, &w.i0, &w.st);
    return w;
}

/* Warp-specialised dK/dV on TMA (ULY_CUDA_ATTN_DKV=ws), FlashAttention-3's division of labour in
 * the backward: 128 keys a block as WGS = 2's two consumer warpgroups (each its own 64 keys' K
 * and V, dK and dV in registers), and a producer warpgroup whose first thread streams each query
 * tile's Q, dO, lse and delta by TMA through a ring of WS_STAGES stages: full[s] completes when
 * stage s has landed, empty[s] when all 256 consumer threads are done with it (as fa_forward_ws).
 * No block barrier and no load instruction in the consumers' loop. DKV_WS_QT queries a tile: 64,
 * FlashAttention-3's tile (at D 128 227 registers, 229 with DQ, no spills, since mbar_wait's trap
 * went out of line, tma.cuh). lse and delta come through flat maps over [B H Tq] (1-d: no
 * alignment asked of Tq), so a tile's rows past its head's last query read the next head's
 * statistics: only masked pairs meet them (P = 0, and dP^T = 0 from Q and dO's zero rows there).
 * DQ (ULY_CUDA_ATTN_BWD=onepass): the consumers also add the block's share of dQ = dS K into dq
 * with atomics (FlashAttention-2/3's one pass: 5 tile products a pair where dK/dV and a dQ kernel
 * take 7), its wgmmas joining dV's and dK's: both write their dS as bf16 into one tile (two,
 * alternating, and a barrier of both a tile: neither overwrites a tile the other's wgmma may still
 * read), then each adds its half of dQ^T = K^T dS^T over all 128 keys (dq_share_issue_wg), so each
 * element of dQ is added once a block, not once a warpgroup (the atomics' traffic halved, as
 * FlashAttention-3's). Neither skips a tile then: one whose keys see none of it gives zeros. Empty
 * in a pass without wgmma. */
#define DQ_BAR 1   /* DQ: the named barrier of both consumer warpgroups */
#define DKV_WS_QT 64
template <int D, bool DQ = false>
__global__ static void __launch_bounds__(WSG_THREADS, WS_MIN_BLOCKS(D))
fa_backward_dkv_ws(float *dk, float *dv, geom g, const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                   const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mo,
                   const __grid_constant__ CUtensorMap ml, const __grid_constant__ CUtensorMap md, int *ran_wgmma,
                   float *dq) {
#if ULY_HAS_WGMMA
    constexpr int CH = D / 8, T = DKV_WS_QT, NT = T / 8;
    constexpr int DS_CHUNKS = DQ ? 2 * 2 * T * 8 : 0;   /* the dS tiles (uint4): two of T lines x 128 keys */
    constexpr unsigned KTILE = 64 * D * 2, QTILE = T * D * 2, STATS = T * 4;   /* bytes */
    ULY_DYNAMIC_SHARED(uint4, dyn);
    /* K and V of warpgroup 0, then of 1 (64 rows each); per stage Q and dO (T rows each); DQ: two
     * dS tiles (T queries x 128 keys); per stage lse and delta (T floats each); the mbarriers */
    uint4 *const sKV = align_1024(dyn), *const sQO = sKV + 4 * 64 * CH, *const sDS = sQO + WS_STAGES * 2 * T * CH;
    float *const sStats = (float *)(sDS + DS_CHUNKS);
    uint64_t *const full = (uint64_t *)(sStats + WS_STAGES * 2 * T), *const empty = full + WS_STAGES,
                    *const kvbar = empty + WS_STAGES;
    if (ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    const int64_t nt = (g.Tk + 127) / 128, tile = (int64_t)blockIdx.x % nt, bh = (int64_t)blockIdx.x / nt;
    const int64_t b = bh / g.Hkv, hk = bh % g.Hkv, jb = tile * 128;
    const int wg = threadIdx.x >> 7;   /* 0, 1: the consumers; 2: the producer */
    start_ws_ring(full, empty, kvbar);   /* and the last block-wide barrier */
    if (wg == 2) {
        regs_shrink_to<WSG_REGS_P>();
        query_walk<T> w = start_query_walk<T>(g, hk, jb);
        if (threadIdx.x == 2 * FA_THREADS && w.have) {
            mbar_expect_tx(kvbar, 4 * KTILE);
            for (int c = 0; c < 2; c++) {   /* each consumer's K and V */
                tma_tile<D>(sKV + c * 128 * CH, &mk, hk, jb + 64 * c, b, kvbar);
                tma_tile<D>(sKV + c * 128 * CH + 64 * CH, &mv, hk, jb + 64 * c, b, kvbar);
            }
            unsigned phases = 0;   /* bit i: the parity empty[i]'s next wait is for */
            for (int n = 0; w.have; n++) {
                const int at = n % WS_STAGES;
                if (n >= WS_STAGES) {   /* both consumers gave the stage back */
                    mbar_wait(&empty[at], (phases >> at) & 1);
                    phases ^= 1u << at;
                }
                uint4 *const qo = sQO + at * 2 * T * CH;
                float *const stats = sStats + at * 2 * T;
                const int row = (int)((b * g.H + w.h) * g.Tq + w.i0);   /* the flat maps' coordinate */
                mbar_expect_tx(&full[at], 2 * QTILE + 2 * STATS);
                tma_tile<D, T>(qo, &mq, w.h, w.i0, b, &full[at]);
                tma_tile<D, T>(qo + T * CH, &mo, w.h, w.i0, b, &full[at]);
                tma_load_1d(stats, &ml, row, &full[at]);
                tma_load_1d(stats + T, &md, row, &full[at]);
                w.next(g, jb);
            }
        }
        return;
    }
    regs_grow_to<WSG_REGS_C>();
    query_walk<T> w = start_query_walk<T>(g, hk, jb);
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t j0 = jb + 64 * wg;   /* this warpgroup's first key */
    const int64_t keys[2] = {j0 + warp * 16 + (lane >> 2), j0 + warp * 16 + (lane >> 2) + 8};
    const key_rows kr = rows_of_keys(g, j0);
    const uint4 *const sK = sKV + wg * 128 * CH, *const sV = sK + 64 * CH;
    float dka[CH][4], dva[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++)
        for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.0f;
    if (w.have) mbar_wait(kvbar, 0);
    unsigned phases = 0;   /* bit i: the parity full[i]'s next wait is for */
    const float sl2 = g.scale * LOG2E_F;
    for (int n = 0; w.have; n++) {
        const int at = n % WS_STAGES;
        /* this warpgroup's view of the tile, and its mask (bit 2 n + c of key r: the query in
         * s[n][2 r + c]), while the stage lands */
        const int mine = wg_query_tile_state<T>(g, kr, w.st, w.i0);
        uint32_t vis[2] = {~0u, ~0u};
        if (mine == TILE_MASKED)
#pragma unroll
            for (int r = 0; r < 2; r++) vis[r] = keys[r] < g.Tk ? visible_bits<NT, false>(g, b, keys[r], w.i0 + 2 * tq) : 0u;
        mbar_wait(&full[at], (phases >> at) & 1);
        phases ^= 1u << at;
        if (mine != TILE_EMPTY) {
            const uint4 *const sQ = sQO + at * 2 * T * CH, *const sO = sQ + T * CH;
            float s[NT][4], dp[NT][4];
            two_products_wg<D, T>(s, dp, sK, sQ, sV, sO);   /* S^T = K Q^T, dP^T = V dO^T */
            if (mine == TILE_MASKED) {   /* S^T at -inf where not visible (exp gives 0) */
                apply_bits<NT>(s, vis[0], 0);
                apply_bits<NT>(s, vis[1], 1);
            }
            probs_and_dscores<NT, T>(s, dp, sStats + at * 2 * T, sl2, tq);
            if constexpr (DQ) {   /* dS rounded once, for dK's product and dQ's */
                uint32_t pa[T / 16][4], da[T / 16][4];
                acc_to_a_all<T / 16>(pa, s);
                acc_to_a_all<T / 16>(da, dp);
                uint4 *const sdS = sDS + (n & 1) * 2 * T * 8;
                store_dscores_rows<T>(sdS + wg * T * 8, da, warp, lane, false);
                fence_proxy_async();                        /* the stores, then the wgmmas reading them */
                named_bar_sync(DQ_BAR, 2 * FA_THREADS);     /* both warpgroups' dS are in */
                float dqt[DQ_SHARE_N(D, T) / 2];
                dkv_accumulate_frags<D, T, true>(dva, dka, pa, da, sO, sQ, dqt, sdS, sKV, wg);
                add_dq_share_wg<D, T>(dq, g, b, w.h, w.i0, dqt, wg, warp, lane);
            } else {
                dkv_accumulate_wg<D, T>(dva, dka, s, dp, sO, sQ);
            }
        } else if constexpr (DQ) {   /* none of its keys sees the tile: zeros for the other's share of dQ */
            uint4 *const sdS = sDS + (n & 1) * 2 * T * 8;
            store_dscores_rows<T>(sdS + wg * T * 8, nullptr, warp, lane, true);
            fence_proxy_async();
            named_bar_sync(DQ_BAR, 2 * FA_THREADS);
            float dqt[DQ_SHARE_N(D, T) / 2];
            wg_fence();
            dq_share_issue_wg<D, T>(dqt, sdS, sKV, wg);
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(dqt, DQ_SHARE_N(D, T) / 2);
            add_dq_share_wg<D, T>(dq, g, b, w.h, w.i0, dqt, wg, warp, lane);
        }
        mbar_arrive(&empty[at]);   /* this thread is done with the stage: its wgmmas were waited for */
        w.next(g, jb);
    }
    add_dkv_rows<D>(dk, dv, g, b, hk, keys, dka, dva, tq);
#endif
}

/* ---- backward: dQ ---- */
/* this thread's two query rows' -lse log2e (-inf for a row with nothing visible or past the last:
 * P = 0) and delta, of head h */
__device__ static inline void dq_row_stats(float nl2[2], float dl[2], const geom &g, int64_t b, int64_t h,
                                           const int64_t rows[2], const float *lse, const float *delta) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int in = rows[r] < g.Tq;
        const float L = in ? lse[(b * g.H + h) * g.Tq + rows[r]] : -INFINITY;
        nl2[r] = L > -INFINITY ? -L * LOG2E_F : -INFINITY;
        dl[r] = in ? delta[(b * g.H + h) * g.Tq + rows[r]] : 0.0f;
    }
}
/* dS / scale = P (dP - delta) in place of S, P = 2^(S scale log2e - lse log2e) (sl2 = scale log2e) */
template <int NT>
__device__ static inline void dscores_of_rows(float s[NT][4], const float dp[NT][4], const float nl2[2], const float dl[2],
                                              float sl2) {
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] = exp2_ftz(fmaf(s[n][e], sl2, nl2[e >> 1])) * (dp[n][e] - dl[e >> 1]);
}
/* a dQ block's sums added into dq ([B, Tq, H, D] f32) at this thread's two rows of head h (none
 * past the last), times dS's scale left out of the loop */
template <int D>
__device__ static inline void add_dq_rows(float *dq, const geom &g, int64_t b, int64_t h, const int64_t rows[2],
                                          const float acc[D / 8][4], int tq) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int64_t i = rows[r];
        if (i >= g.Tq) continue;
        float *dst = dq + ((b * g.Tq + i) * g.H + h) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            dst[n * 8] += acc[n][2 * r] * g.scale;
            dst[n * 8 + 1] += acc[n][2 * r + 1] * g.scale;
        }
    }
}
/* WG: S, dP and dQ += dS K as wgmma (Hopper), the K and V tiles in its layout (D = 64, 128) */
/* KT: keys a tile, 32, or 64 in the wgmma variant at D = 64 (ULY_CUDA_ATTN_DQ=64): S and dP as
 * 64 x 64 wgmmas, whose A (Q, dO from shared memory) then feeds twice the math, and half the
 * tiles to walk. WGS = 2 (wgmma only, ULY_CUDA_ATTN_DQ=rows128): 128 query rows a block, two
 * warpgroups of 64 each with its own Q and dO, sharing every K and V tile the block loads (half
 * the tile loads per FLOP, as the forward's fa_forward_rows128); a warpgroup skips the math of a
 * tile none of its rows see, keeping to the barriers. */
template <int D, bool WG, int KT = 32, int WGS = 1>
__global__ static void __launch_bounds__(WGS * FA_THREADS, WGS == 2 ? ROWS128_MIN_BLOCKS(D) : 0)
fa_backward_dq(float *dq, geom g, const bf16 *Q, const bf16 *K, const bf16 *V, const bf16 *dO, const float *lse,
               const float *delta, int *ran_wgmma) {
    constexpr int CH = D / 8;
    constexpr bool W = WG && ULY_HAS_WGMMA && (D == 64 || D == 128);
    static_assert(KT == 32 || (KT == 64 && D == 64), "fa_backward_dq: 64-key tiles only at D 64");
    static_assert(WGS == 1 || (WGS == 2 && WG), "fa_backward_dq: two warpgroups only on wgmma");
    if constexpr (WGS == 2 && !W) return;   /* never launched in a pass without wgmma */
    constexpr int T = W ? KT : 32;   /* this pass's key tile (mma.sync: 32) */
    constexpr int NT = T / 8;        /* n8 tiles of keys: S is 64 x T */
    constexpr int ROWS = 64 * WGS;   /* the block's query rows */
    /* per warpgroup Q, dO (64 rows), then two buffers of K (T rows) followed by V (T rows) */
    ULY_DYNAMIC_SHARED(uint4, smem_raw);
    uint4 *const smem = W ? align_1024(smem_raw) : smem_raw;
    if (W && ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    const int wg = WGS == 2 ? (int)(threadIdx.x >> 7) : 0;
    uint4 *const sQ = smem + wg * 128 * CH, *const sO = sQ + 64 * CH;
    constexpr int KV = 2 * ROWS;   /* the K / V buffers' first row in shared memory */
    const int64_t nt = (g.Tq + ROWS - 1) / ROWS, tile = nt - 1 - (int64_t)blockIdx.x % nt, bh = (int64_t)blockIdx.x / nt;
    const int64_t b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv), ib = tile * ROWS, i0 = ib + 64 * wg;
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    const bf16 *k = K + b * g.Tk * ks + hk * D, *v = V + b * g.Tk * ks + hk * D;
    const int warp = WGS == 2 ? (int)(threadIdx.x >> 5) & 3 : (int)(threadIdx.x >> 5), lane = threadIdx.x & 31,
              tq = lane & 3;
    const int64_t rows[2] = {i0 + warp * 16 + (lane >> 2), i0 + warp * 16 + (lane >> 2) + 8};
    float nl2[2], dl[2];
    const float sl2 = g.scale * LOG2E_F;
    dq_row_stats(nl2, dl, g, b, h, rows, lse, delta);
    /* pipeline: the next key tile's K and V load into the other buffer during this one's math */
    int64_t lo, hi;
    chunk_band(g, ib, ib + ROWS < g.Tq ? ib + ROWS : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, ib, ib + ROWS - 1), rw = WGS == 2 ? span_of_rows(g, i0, i0 + 63) : rs;
    int st = TILE_EMPTY, buf = 0;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / T * T, hi, T, &st) : -1;
    /* W: A of S, dP; each warpgroup its own rows */
    load_tile_async<D, 64, W, FA_THREADS, WGS == 2>(sQ, Q + b * g.Tq * qs + h * D, i0, g.Tq, qs);
    load_tile_async<D, 64, W, FA_THREADS, WGS == 2>(sO, dO + b * g.Tq * qs + h * D, i0, g.Tq, qs);
    if (j0 >= 0) {
        load_tile_async<D, T, W, WGS * FA_THREADS>(smem + KV * CH, k, j0, g.Tk, ks);
        load_tile_async<D, T, W, WGS * FA_THREADS>(smem + (KV + T) * CH, v, j0, g.Tk, ks);
    }
    cp_async_commit();
    float acc[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    while (j0 >= 0) {
        int st_next = TILE_EMPTY;
        const int64_t j_next = next_key_tile(g, rs, j0 + T, hi, T, &st_next);
        if (j_next >= 0) {   /* the other buffer: every warp finished with it at the end of the last round */
            uint4 *const other = smem + (KV + 2 * T * (buf ^ 1)) * CH;
            load_tile_async<D, T, W, WGS * FA_THREADS>(other, k, j_next, g.Tk, ks);
            load_tile_async<D, T, W, WGS * FA_THREADS>(other + T * CH, v, j_next, g.Tk, ks);
        }
        cp_async_commit();
        const int mine = WGS == 2 ? wg_tile_state<T>(g, rw, st, j0) : st;   /* this warpgroup's rows' view */
        uint32_t vis[2] = {~0u, ~0u};   /* the tile's mask, while the tiles load (as in dK/dV) */
        if (mine == TILE_MASKED) row_bits<NT, false>(vis, g, b, rows, j0, tq);
        cp_async_wait<1>();   /* this tile's K and V (and Q, dO): all but the newest group */
        if (W) fence_proxy_async();
        __syncthreads();
        const uint4 *const sK = smem + (KV + 2 * T * buf) * CH, *const sV = sK + T * CH;
        if (WGS == 2 && mine == TILE_EMPTY) {   /* none of this warpgroup's rows sees the tile */
            __syncthreads();
            j0 = j_next;
            st = st_next;
            buf ^= 1;
            continue;
        }
        float s[NT][4], dp[NT][4];
        if constexpr (W) two_products_wg<D, T>(s, dp, sQ, sK, sO, sV);   /* S = Q K^T, dP = dO V^T */
        else two_products<D>(s, dp, sQ, sK, sO, sV, warp);
        if (mine == TILE_MASKED) {   /* exp(-inf) = 0 */
            apply_bits<NT>(s, vis[0], 0);
            apply_bits<NT>(s, vis[1], 1);
        }
        dscores_of_rows<NT>(s, dp, nl2, dl, sl2);
        if constexpr (W) times_tile_wg_waited<D, T / 16, T>(acc, s, sK);   /* dQ += dS K, K MN-major */
        else acc_times_tile<D, 2>(acc, s, sK);   /* (T = 32) */
        __syncthreads();   /* every warp is done with this buffer before the next round refills it */
        j0 = j_next;
        st = st_next;
        buf ^= 1;
    }
    wg_fence_regs(&acc[0][0], 4 * CH);
    add_dq_rows<D>(dq, g, b, h, rows, acc, tq);
}

/* Warp-specialised dQ on TMA (ULY_CUDA_ATTN_DQ=ws): 128 query rows a block as two consumer
 * warpgroups (each its own 64 rows' Q and dO, by TMA once, and dQ in registers), and a producer
 * warpgroup whose first thread streams the 64-key K and V tiles those rows see through the
 * WS_STAGES ring (produce_kv_tiles, as the warp-specialised forward). setmaxnreg as
 * fa_backward_dkv_ws (each side works out its walk after the resize). Empty in a pass without
 * wgmma. */
template <int D>
__global__ static void __launch_bounds__(WSG_THREADS, WS_MIN_BLOCKS(D))
fa_backward_dq_ws(float *dq, geom g, const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                  const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mo, const float *lse,
                  const float *delta, int *ran_wgmma) {
#if ULY_HAS_WGMMA
    constexpr int CH = D / 8, NT = 8;   /* key tiles of 64: S is 64 x 64 a warpgroup */
    constexpr unsigned TILE = 64 * D * 2;   /* bytes of a 64-row tile */
    ULY_DYNAMIC_SHARED(uint4, dyn);
    /* Q then dO of warpgroup 0, then of 1 (64 rows each); per stage K and V (64 rows each); the
     * mbarriers */
    uint4 *const sQO = align_1024(dyn), *const sKV = sQO + 4 * 64 * CH;
    uint64_t *const full = (uint64_t *)(sKV + WS_STAGES * 128 * CH), *const empty = full + WS_STAGES,
                    *const qbar = empty + WS_STAGES;
    if (ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    const int64_t nt = (g.Tq + 127) / 128, tile = nt - 1 - (int64_t)blockIdx.x % nt, bh = (int64_t)blockIdx.x / nt;
    const int64_t b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv), ib = tile * 128;   /* longest bands first */
    const int wg = threadIdx.x >> 7;   /* 0, 1: the consumers; 2: the producer */
    start_ws_ring(full, empty, qbar);   /* and the last block-wide barrier */
    if (wg == 2) {
        regs_shrink_to<WSG_REGS_P>();
        int64_t lo, hi;
        chunk_band(g, ib, ib + 128 < g.Tq ? ib + 128 : g.Tq, &lo, &hi);
        const row_span rs = span_of_rows(g, ib, ib + 127);
        int st;
        const int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / 64 * 64, hi, 64, &st) : -1;
        if (threadIdx.x == 2 * FA_THREADS && j0 >= 0) {
            mbar_expect_tx(qbar, 4 * TILE);
            for (int c = 0; c < 2; c++) {   /* each consumer's Q and dO */
                tma_tile<D>(sQO + c * 128 * CH, &mq, h, ib + 64 * c, b, qbar);
                tma_tile<D>(sQO + c * 128 * CH + 64 * CH, &mo, h, ib + 64 * c, b, qbar);
            }
            produce_kv_tiles<D>(sKV, full, empty, &mk, &mv, g, rs, j0, hi, hk, b);
        }
        return;
    }
    regs_grow_to<WSG_REGS_C>();
    int64_t lo, hi;
    chunk_band(g, ib, ib + 128 < g.Tq ? ib + 128 : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, ib, ib + 127);
    int st = TILE_EMPTY;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / 64 * 64, hi, 64, &st) : -1;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t i0 = ib + 64 * wg;   /* this warpgroup's first row */
    const int64_t rows[2] = {i0 + warp * 16 + (lane >> 2), i0 + warp * 16 + (lane >> 2) + 8};
    const row_span rw = span_of_rows(g, i0, i0 + 63);
    const uint4 *const sQ = sQO + wg * 128 * CH, *const sO = sQ + 64 * CH;
    float nl2[2], dl[2];
    const float sl2 = g.scale * LOG2E_F;
    dq_row_stats(nl2, dl, g, b, h, rows, lse, delta);
    float acc[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    if (j0 >= 0) mbar_wait(qbar, 0);
    unsigned phases = 0;   /* bit i: the parity full[i]'s next wait is for */
    for (int n = 0; j0 >= 0; n++) {
        const int at = n % WS_STAGES;
        const int mine = wg_tile_state<64>(g, rw, st, j0);   /* this warpgroup's rows' view */
        uint32_t vis[2] = {~0u, ~0u};   /* the tile's mask, while the stage lands */
        if (mine == TILE_MASKED) row_bits<NT, false>(vis, g, b, rows, j0, tq);
        mbar_wait(&full[at], (phases >> at) & 1);
        phases ^= 1u << at;
        if (mine != TILE_EMPTY) {
            const uint4 *const sK = sKV + at * 128 * CH, *const sV = sK + 64 * CH;
            float s[NT][4], dp[NT][4];
            two_products_wg<D, 64>(s, dp, sQ, sK, sO, sV);   /* S = Q K^T, dP = dO V^T */
            if (mine == TILE_MASKED) {   /* exp(-inf) = 0 */
                apply_bits<NT>(s, vis[0], 0);
                apply_bits<NT>(s, vis[1], 1);
            }
            dscores_of_rows<NT>(s, dp, nl2, dl, sl2);
            times_tile_wg_waited<D, 4, 64>(acc, s, sK);   /* dQ += dS K, K MN-major */
        }
        mbar_arrive(&empty[at]);   /* this thread is done with the stage: its wgmmas were waited for */
        j0 = next_key_tile(g, rs, j0 + 64, hi, 64, &st);
    }
    add_dq_rows<D>(dq, g, b, h, rows, acc, tq);
#endif
}
