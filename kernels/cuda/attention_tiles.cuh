/* kernels/cuda/attention_tiles.cuh — the device pieces the fused attention kernels share
 * (attention_forward.cuh, attention_backward.cuh; included once, by attention_fused.cu): shared
 * tile layouts (swizzled for ldmatrix, 128-byte swizzled for wgmma), cp.async tile loads,
 * mma.sync / wgmma fragment helpers, quad reductions, exp2, and the classification of key tiles
 * against a block's rows (empty, masked, wholly visible). */
#pragma once
#include <cuda_bf16.h>
#include "attention.cuh"
#include "mma.cuh"

#define FA_THREADS 128   /* 4 warps */
typedef __nv_bfloat16 bf16;
/* the warp-specialised kernels (fa_forward_ws, fa_backward_dkv_ws): two consumer warpgroups and a
 * producer warp (WS_THREADS) or warpgroup (WSG_THREADS), a ring of WS_STAGES stages between them;
 * one block an SM (two at D 64 would cap registers at 96 and spill) */
#define WS_STAGES 2
#define WS_THREADS (2 * FA_THREADS + 32)
#define WS_MIN_BLOCKS(D) (ULY_HAS_WGMMA ? 1 : 0)
/* WSG_: the warp-specialised kernels with a producer warpgroup (the backward's, and the forward's
 * overlapped variant). The producer is a whole warpgroup (one thread issuing) so that setmaxnreg
 * can move registers: ptxas gives each thread of a 288- or 384-thread block 168 (at D 128 the
 * dK/dV consumers need ~200 and spilled 320 bytes at 168); the producer shrinks to WSG_REGS_P,
 * the consumers grow to WSG_REGS_C (168 x 3 = P + 2 C: the block's registers stay what it
 * launched with). Each side starts its walk after the resize: values live across it had ptxas
 * keep the consumers at 168 (and spill; at 24 the producer spilled too) */
#define WSG_THREADS (3 * FA_THREADS)
#define WSG_REGS_P 40
#define WSG_REGS_C 232
static_assert(WSG_REGS_P + 2 * WSG_REGS_C <= 3 * (65536 / WSG_THREADS / 8 * 8),
              "setmaxnreg: the consumers would wait forever for registers the block does not have");
/* the most dynamic shared memory an sm_90 block may opt in to (227 KiB; the launch fails above) */
#define SM90_SMEM_MAX (227 * 1024)

/* chunk c (16 bytes, 8 bf16) of row r of a shared tile of D-element rows */
template <int D>
__device__ static inline int sw_at(int r, int c) {
    constexpr int CH = D / 8, SW = CH >= 8 ? 7 : CH - 1;
    return r * CH + (c ^ (r & SW));
}

/* chunk c of row r of a ROWS-row tile that wgmma reads (mma.cuh: 128-byte swizzle): D / 64 atom
 * columns of ROWS rows x 128 bytes side by side along the row; the same as sw_at at D = 64 */
template <int ROWS>
__device__ static inline int sw128_at(int r, int c) { return (c >> 3) * ROWS * 8 + r * 8 + ((c & 7) ^ (r & 7)); }

/* rows [r0, r0 + ROWS) of a bf16 matrix with `stride`-element rows into a swizzled shared tile
 * (rows at or past `nrows` are zeros; WG: the wgmma layout), queued as cp.async copies: the
 * caller commits the group and waits for it. THREADS threads share the copies: the block's
 * first THREADS, or (OWN_WG) the calling thread's warpgroup alone */
template <int D, int ROWS, bool WG = false, int THREADS = FA_THREADS, bool OWN_WG = false>
__device__ static inline void load_tile_async(uint4 *s, const bf16 *src, int64_t r0, int64_t nrows, int64_t stride) {
    /* a thread copies chunk c of rows r, r + RP, ...: one address each side computed, then
     * constant steps (RP is a multiple of the swizzle's 8 rows, so row r + k RP's chunk c sits
     * k RP rows after row r's), and the rows left compared in 32 bits (the loop as e / CH, e % CH
     * per copy was ~170 integer instructions a tile in the hot loops) */
    constexpr int CH = D / 8, RP = THREADS / CH, STEP = RP * (WG ? 8 : CH);
    static_assert(THREADS % CH == 0 && ROWS % RP == 0 && RP % 8 == 0 && (!OWN_WG || THREADS == 128),
                  "load_tile_async: tile shape");
    const unsigned tid = OWN_WG ? threadIdx.x & 127u : threadIdx.x;
    const int c = tid % CH, r = tid / CH;
    uint4 *d = s + (WG ? sw128_at<ROWS>(r, c) : sw_at<D>(r, c));
    const int64_t step = RP * stride;
    if (r0 + ROWS <= nrows) {
        /* the whole tile in range (all but a sequence's last tile; the same for every thread): no
         * bounds, no selects, nothing but the copies and a 64-bit pointer step between them */
        const bf16 *p = src + (r0 + r) * stride + c * 8;
#pragma unroll
        for (int k = 0; k < ROWS / RP; k++, p += step) cp_async16(d + k * STEP, p, 1);
        return;
    }
    const int64_t rest = nrows - r0 - r;   /* rows of the source from this thread's first row on */
    const int left = rest < 0 ? 0 : rest > ROWS ? ROWS : (int)rest;
    const bf16 *p = src + (r0 + r) * stride + c * 8;
#pragma unroll
    for (int k = 0; k < ROWS / RP; k++, p += step) {
        const bool in = k * RP < left;
        cp_async16(d + k * STEP, in ? p : src, in);
    }
}

/* the first 1024-byte aligned address at or after p in shared memory (wgmma's swizzle atoms);
 * the emulator's dynamic shared memory starts aligned */
__device__ static inline uint4 *align_1024(uint4 *p) {
#ifdef ULY_CUDA_EMU
    return p;
#else
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return p + ((1024 - (a & 1023)) & 1023) / 16;
#endif
}

/* the query tile of a GQA group packed (decoding): row r is query r % Tq of query head
 * h0 + r / Tq, rows at or past `rows` zeros; qb points at the batch's first query row */
template <int D, bool WG = false>
__device__ static inline void load_q_grouped(uint4 *s, const bf16 *qb, int64_t h0, int64_t rows, int64_t Tq,
                                             int64_t stride) {
    constexpr int CH = D / 8;
    for (int e = threadIdx.x; e < 64 * CH; e += FA_THREADS) {
        int r = e / CH, c = e % CH, in = r < rows;
        const int tq = (int)Tq;   /* <= 64 here: 32-bit division */
        cp_async16(&s[WG ? sw128_at<64>(r, c) : sw_at<D>(r, c)], in ? qb + (h0 + r / tq) * D + (r % tq) * stride + c * 8 : qb,
                   in);
    }
}

/* the forward's query tile, queued as cp.async copies: rows i0.. of the block's head, or (grouped)
 * every query of the GQA group whose first query head is h0; WG: in the wgmma layout (A of
 * S = Q K^T from shared memory) */
template <int D, bool grouped, bool WG = false>
__device__ static inline void load_query_tile(uint4 *sQ, const bf16 *q, const geom &g, int64_t h0, int64_t i0,
                                              int64_t stride) {
    if (grouped) load_q_grouped<D, WG>(sQ, q, h0, g.Tq * (g.H / g.Hkv), g.Tq, stride);
    else load_tile_async<D, 64, WG>(sQ, q, i0, g.Tq, stride);
}

/* this lane's ldmatrix row for the 16 x 16 block at row r0, chunk kc: in A order (matrices
 * (r0, kc) (r0+8, kc) (r0, kc+1) (r0+8, kc+1)), which transposed is also the B operand of two
 * n-tiles (kc, kc+1) when the tile's rows are k */
template <int D>
__device__ static inline const uint4 *frag_a(const uint4 *s, int r0, int kc) {
    int l = threadIdx.x & 31, j = l >> 3;
    return s + sw_at<D>(r0 + (l & 7) + ((j & 1) << 3), kc + (j >> 1));
}
/* in B order when the tile's rows are n: b of n-tile r0 (regs 0, 1) and of n-tile r0 + 8 (2, 3) */
template <int D>
__device__ static inline const uint4 *frag_b(const uint4 *s, int r0, int kc) {
    int l = threadIdx.x & 31, j = l >> 3;
    return s + sw_at<D>(r0 + (l & 7) + ((j >> 1) << 3), kc + (j & 1));
}

/* the A operand (16 x 16) from two 16 x 8 accumulator tiles side by side */
__device__ static inline void acc_to_a(uint32_t a[4], const float l[4], const float r[4]) {
    a[0] = mma_pack_bf16(l[0], l[1]);
    a[1] = mma_pack_bf16(l[2], l[3]);
    a[2] = mma_pack_bf16(r[0], r[1]);
    a[3] = mma_pack_bf16(r[2], r[3]);
}

/* c0 += a b[0..1] and c1 += a b[2..3]: two adjacent n8 tiles from one ldmatrix_x4 B fragment */
__device__ static inline void mma_two(float c0[4], float c1[4], const uint32_t a[4], const uint32_t b[4]) {
    mma_bf16_16816(c0, a, b);
    mma_bf16_16816(c1, a, b + 2);
}

/* acc (16 x D, accumulator layout) += x t, where x is 16 x 16 KT in accumulator layout (2 KT n8
 * tiles, rounded to bf16 here) and t the first 16 KT rows of a shared D-wide tile (transposed loads) */
template <int D, int KT>
__device__ static inline void acc_times_tile(float acc[D / 8][4], float x[2 * KT][4], const uint4 *t) {
#pragma unroll
    for (int kk = 0; kk < KT; kk++) {
        uint32_t xa[4];
        acc_to_a(xa, x[2 * kk], x[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < D / 16; np++) {
            uint32_t bb[4];
            ldmatrix_x4_trans(bb, frag_a<D>(t, kk * 16, 2 * np));
            mma_two(acc[2 * np], acc[2 * np + 1], xa, bb);
        }
    }
}

/* two_products on wgmma: a1, a2 64-row tiles and b1, b2 N-row tiles (32 or 64), all in the wgmma
 * layout (K-major; A through a descriptor too, so no A registers: 64 fewer a thread at D = 128,
 * which lets dK/dV run on wgmma there without spilling); s and dp are the warpgroup's 64 x N.
 * The first of each chain ignores the accumulator (ACC 0) instead of adding to zeroed registers:
 * with zeros written, ptxas waited for the first wgmma before issuing the second (dQ, D = 128). */
template <int N, int ACC>
__device__ static inline void wgmma_64xN_ss(float *d, uint64_t desc_a, uint64_t desc_b) {
    if constexpr (N == 64) wgmma_64x64_ss<0, ACC>(d, desc_a, desc_b);
    else wgmma_64x32_ss<0, ACC>(d, desc_a, desc_b);
}
template <int D, int N = 32>
__device__ static inline void two_products_wg(float s[N / 8][4], float dp[N / 8][4], const uint4 *a1, const uint4 *b1,
                                              const uint4 *a2, const uint4 *b2) {
    static_assert(N == 32 || N == 64, "two_products_wg: B tiles of 32 or 64 rows");
    const uint32_t da1 = wg_desc_lo(a1), db1 = wg_desc_lo(b1), da2 = wg_desc_lo(a2), db2 = wg_desc_lo(b2);
    wg_fence();
    wgmma_64xN_ss<N, 0>(&s[0][0], wg_desc_at(da1, 0), wg_desc_at(db1, 0));
    wgmma_64xN_ss<N, 0>(&dp[0][0], wg_desc_at(da2, 0), wg_desc_at(db2, 0));
#pragma unroll
    for (int kk = 1; kk < D / 16; kk++) {
        /* 16 of D: 32 bytes into the 128-byte lines of atom column kk / 4 (64-row atoms 8 KiB
         * apart in A, N-row ones N x 128 bytes in B) */
        const uint32_t at = (kk & 3) * 32, a_off = (kk >> 2) * 8192 + at, b_off = (kk >> 2) * (N * 128) + at;
        wgmma_64xN_ss<N, 1>(&s[0][0], wg_desc_at(da1, a_off), wg_desc_at(db1, b_off));
        wgmma_64xN_ss<N, 1>(&dp[0][0], wg_desc_at(da2, a_off), wg_desc_at(db2, b_off));
    }
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(&s[0][0], N / 2);
    wg_fence_regs(&dp[0][0], N / 2);
}

/* x (16 x 16 KT of this warp's rows, accumulator layout) rounded to bf16 as KT A fragments */
template <int KT>
__device__ static inline void acc_to_a_all(uint32_t xa[KT][4], float x[2 * KT][4]) {
#pragma unroll
    for (int kk = 0; kk < KT; kk++) acc_to_a(xa[kk], x[2 * kk], x[2 * kk + 1]);
}

/* acc_times_tile on wgmma, queued (the caller fences, commits and waits): acc += x t, x 64 x 16 KT
 * as KT A fragments (acc_to_a_all, rounded before the caller's fence: converting between two
 * wgmmas makes ptxas insert a warpgroup arrive before each (C7519)), t the
 * first 16 KT rows of a ROWS-row tile in the wgmma layout (MN-major B), 64 of D per instruction */
template <int D, int KT, int ROWS>
__device__ static inline void acc_times_tile_wg(float acc[D / 8][4], const uint32_t xa[KT][4], const uint4 *t) {
    const uint32_t dt = wg_desc_lo(t);
#pragma unroll
    for (int kk = 0; kk < KT; kk++)
#pragma unroll
        for (int half = 0; half < D / 64; half++)   /* atom columns ROWS x 128 bytes apart, 16 rows 2 KiB */
            wgmma_64x64<1>(&acc[8 * half][0], xa[kk], wg_desc_at(dt, half * ROWS * 128 + kk * 2048));
}

__device__ static inline float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ static inline float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* 2^x on the special-function unit, subnormal results flushed to 0: one instruction, where
 * __expf is a multiply, the same instruction and a subnormal fix-up around it */
#define LOG2E_F 1.4426950408889634f
__device__ static inline float exp2_ftz(float x) {
#ifdef ULY_CUDA_EMU
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

/* How many blocks of a wgmma kernel an SM should hold (__launch_bounds__' second argument, which
 * caps ptxas's registers): at D = 128, 3 (at most 168 registers a thread; with Q read from
 * shared memory the forward takes 159, no spills), at D = 64, 4 (128; the forward takes 122).
 * Used by the forward (not pipelined) and by dK/dV at D = 64 (128 registers, no spills; uncapped
 * 144; the one-pass variant would spill 68 bytes and is left out). The mma.sync build is left uncapped: it would spill its accumulators. 0 is "unspecified":
 * ptxas then picks as with no second argument (an explicit 1 made it take more registers). */
#define WG_MIN_BLOCKS(wg, D) ((wg) && ULY_HAS_WGMMA ? ((D) == 128 ? 3 : (D) == 64 ? 4 : 0) : 0)

enum { TILE_EMPTY = 0, TILE_MASKED = 1, TILE_FULL = 2 };

/* query rows [i0, i1] (clamped to the last) with the bands of the first and the last: both ends
 * of the band grow with the row, so these bound every row's. A block computes its rows' span
 * once; classifying a key tile is then a few comparisons (and the layout's blocks when there is
 * one) instead of two band computations per tile in the hot loop */
struct row_span {
    int32_t i0, i1, lo0, hi0, lo1, hi1;   /* 32 bits: uly_cu_fused_attention_ok wants Tq, Tk < 2^30 */
    int partial;                          /* rows past the last query */
    int32_t full_lo, full_hi;             /* the keys every row sees ([lo1, hi0] of keys < Tk; none with
                                             rows past the last or documents) */
};
__device__ static inline row_span span_of_rows(const geom &g, int64_t i0, int64_t i1) {
    row_span r;
    int64_t lo0, hi0, lo1, hi1;
    r.partial = i1 >= g.Tq;
    if (i1 >= g.Tq) i1 = g.Tq - 1;
    band(g, i0, &lo0, &hi0);
    band(g, i1, &lo1, &hi1);
    r.i0 = (int32_t)i0; r.i1 = (int32_t)i1;
    r.lo0 = (int32_t)lo0; r.hi0 = (int32_t)hi0; r.lo1 = (int32_t)lo1; r.hi1 = (int32_t)hi1;
    r.full_lo = r.lo1;
    r.full_hi = r.partial || g.q_doc ? -1 : r.hi0;   /* band() keeps hi0 below Tk */
    return r;
}

/* which pairs of the rows of rs x keys [j0, j1] are visible: none, some, or all */
__device__ static int tile_state(const geom &g, const row_span &rs, int64_t j0, int64_t j1) {
    const int partial = rs.partial || j1 >= g.Tk;
    if (j1 >= g.Tk) j1 = g.Tk - 1;
    if (rs.i0 > rs.i1 || j0 > j1) return TILE_EMPTY;
    if (rs.hi1 < j0 || rs.lo0 > j1) return TILE_EMPTY;
    int all = rs.lo1 <= j0 && rs.hi0 >= j1;
    if (g.layout) {   /* 32-bit divisions: positions < 2^30 (a 64-bit one is a call) */
        const uint32_t bs = (uint32_t)g.bs;
        const int b0 = (int)((uint32_t)rs.i0 / bs), b1 = (int)((uint32_t)rs.i1 / bs);
        const int c0 = (int)((uint32_t)j0 / bs), c1 = (int)((uint32_t)j1 / bs);
        if ((b1 - b0 + 1) * (c1 - c0 + 1) > 64) {
            all = 0;   /* small blocks: masked element by element */
        } else {
            int any = 0, every = 1;
#pragma unroll 1
            for (int r = b0; r <= b1; r++)
#pragma unroll 1
                for (int c = c0; c <= c1; c++) {
                    int on = g.layout[(int64_t)r * g.nbc + c] != 0;
                    any |= on;
                    every &= on;
                }
            if (!any) return TILE_EMPTY;
            all &= every;
        }
    }
    return all && !partial && !g.q_doc ? TILE_FULL : TILE_MASKED;
}

/* the first key tile [j, j + step) at or after j (up to key hi) with a visible pair for the rows
 * of rs, and its state; -1 when none is left */
__device__ static inline int64_t next_key_tile(const geom &g, const row_span &rs, int64_t j, int64_t hi, int step,
                                               int *st) {
    if (!g.layout) {
        /* without a block-sparse layout every tile of the band [lo, hi] the walk starts from
         * (chunk_band's: the rows' bands are intervals with both ends growing with the row, so
         * their union is one) has a visible pair: no search, and the state is two comparisons
         * (the search was ~55 instructions a tile) */
        const int jj = (int)j;   /* j, hi < Tk < 2^30 */
        if (jj > (int)hi) return -1;
        *st = jj >= rs.full_lo && jj + step - 1 <= rs.full_hi ? TILE_FULL : TILE_MASKED;
        return j;
    }
    for (; j <= hi; j += step) {
        *st = tile_state(g, rs, j, j + step - 1);
        if (*st != TILE_EMPTY) return j;
    }
    return -1;
}

/* A warpgroup's view of a T-key tile that a 128-row block's walk classified as `st` (for all its
 * rows): FULL stays FULL; a MASKED one may be EMPTY or FULL for the warpgroup's 64 rows rs (the
 * band's comparisons; with a block-sparse layout it stays MASKED: the per-element mask is right
 * either way). Inline comparisons only: a call in the loop would serialise the wgmmas (C7520). */
template <int T>
__device__ static inline int wg_tile_state(const geom &g, const row_span &rs, int st, int64_t j0) {
    if (st != TILE_MASKED) return st;
    const int j = (int)j0, j1 = j + T - 1;   /* positions < 2^30 */
    if (rs.i0 > rs.i1 || rs.hi1 < j || rs.lo0 > j1) return TILE_EMPTY;
    return !g.layout && j >= rs.full_lo && j1 <= rs.full_hi ? TILE_FULL : TILE_MASKED;
}

/* How many 128-row blocks (two warpgroups: fa_forward_rows128, fa_backward_dq's WGS = 2) an SM
 * should hold: at D = 64 two (at most 128 registers a thread, as the one-warpgroup forward's 4
 * blocks), at D = 128 one (its O alone is 64 registers) */
#define ROWS128_MIN_BLOCKS(D) (ULY_HAS_WGMMA ? ((D) == 64 ? 2 : 1) : 0)
