/* kernels/cuda/attention_fused.cu — fused flash attention on tensor cores (mixed precision): bf16
 * Q, K, V, dO operands, f32 accumulation, f32 outputs, the contract of kernels/cpu/flash_attention.h
 * (every mask, GQA, backward accumulating). No score matrix ever leaves the chip.
 *
 * Forward: a block of 4 warps per 64 query rows of one (batch, head); each warp owns 16 rows and
 * walks the 64-key tiles of the rows' causal / window band: S = Q K^T (mma.sync m16n8k16), the
 * online softmax in registers (row max and sum across the 4 lanes of a quad), P rounded to bf16
 * straight from the accumulators into the A operand of O += P V. Writes O and one log-sum-exp
 * per row. One query tile against a long key band (decoding) splits the band over several
 * blocks, whose partial rows a second kernel merges (flash-decoding); when every query of a GQA
 * group fits in one tile, the tile holds the group's query heads, so K and V are read once.
 * Backward, two kernels, so that nothing is accumulated with atomics (the same bits run to run):
 *  - dK, dV: a block per 64 keys of one (batch, kv head); each warp owns 16 keys and walks the
 *    32-query tiles that can see them, of every query head sharing the kv head (GQA): S^T = K Q^T,
 *    P^T = exp(scale S^T - lse), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta) scale,
 *    dK += dS^T Q;
 *  - dQ: a block per 64 query rows; each warp walks 32-key tiles: S and dP again, dQ += dS K.
 * Tiles arrive by cp.async: in the forward the next K loads during the softmax and P V (on
 * wgmma into a second buffer, from the start of the tile: two barriers a tile), the next V
 * during S; in the backward kernels the next streaming tiles (dK/dV: Q and dO; dQ: K and V) into
 * a second buffer during the whole tile (64 KiB of dynamic shared memory at D = 128).
 * Tiles no pair of which is visible are skipped (band, block-sparse layout); tiles wholly visible
 * skip the per-element mask. Shared tiles are swizzled in 16-byte chunks so that ldmatrix reads
 * conflict-free; the forward keeps within 48 KiB of static shared memory at D = 128.
 * Head dims 32, 64 and 128; attention.cu runs everything else (and f32 precision) on its chunked
 * cuBLAS path. ULY_CUDA_ATTN=chunked forces that path for comparisons.
 * On Hopper (sm_90a, this file's 9.0 build) the forward at D = 64 and 128 runs S = Q K^T and
 * O += P V as warpgroup MMAs (wgmma, mma.cuh): the block's 4 warps are one warpgroup, Q (A) and
 * K, V (B) come straight from shared memory in the 128-byte-swizzled layout (K-major Q and K,
 * MN-major V), P is A from registers, and the softmax is unchanged (wgmma's accumulators have
 * mma.sync's layout). The dQ kernel does the same (S and dP as 64 x 32 wgmmas, A (Q, dO) and B (K, V) both
 * K-major from shared memory, dQ += dS K with K MN-major), and so does dK/dV (S^T, dP^T with K,
 * V as A and Q, dO as B, K-major; dV, dK with Q, dO MN-major).
 * Enabled by a self-check at the first forward (every kernel both ways on a small problem);
 * ULY_CUDA_ATTN_WGMMA=0 / 1 forces it off / on.
 * What ptxas needs to keep a kernel's wgmmas back to back (scripts/sass-check.sh fails when it
 * does not: its C7520 note, each wgmma then waits for the one before): no call in the loop around
 * them (a 64-bit division is one: the mask's layout lookups divide in 32 bits), and A fragments
 * written before the fence, not between two wgmmas (acc_to_a_all). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_bf16.h>
#include "attention.cuh"
#include "mma.cuh"

#define FA_THREADS 128   /* 4 warps */
typedef __nv_bfloat16 bf16;

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
 * caller commits the group and waits for it */
template <int D, int ROWS, bool WG = false>
__device__ static inline void load_tile_async(uint4 *s, const bf16 *src, int64_t r0, int64_t nrows, int64_t stride) {
    /* a thread copies chunk c of rows r, r + RP, ...: one address each side computed, then
     * constant steps (RP is a multiple of the swizzle's 8 rows, so row r + k RP's chunk c sits
     * k RP rows after row r's), and the rows left compared in 32 bits (the loop as e / CH, e % CH
     * per copy was ~170 integer instructions a tile in the hot loops) */
    constexpr int CH = D / 8, RP = FA_THREADS / CH, STEP = RP * (WG ? 8 : CH);
    static_assert(FA_THREADS % CH == 0 && ROWS % RP == 0 && RP % 8 == 0, "load_tile_async: tile shape");
    const int c = threadIdx.x % CH, r = threadIdx.x / CH;
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

/* ---- forward ---- */
/* S = Q K^T for the warpgroup's 64 x 64 tile on wgmma, queued and committed (the caller waits):
 * A (Q) and B (K) both from shared memory in the wgmma layout (K-major, 16 of D an instruction),
 * the first with scale-d 0 (no zeroed accumulators). Q was A from registers, loaded once before
 * the loop; ptxas (CUDA 13.0, sm_90a) then gave those registers to P's bf16 fragments inside the
 * loop at D = 64, so from the second key tile on S was P K^T (the wrong numbers an H200 showed,
 * 2026-12-04; seen in the SASS). Reloading them every tile fixed that at the cost of KS ldmatrix
 * and their addresses; from shared memory nothing of Q is in registers at all, and the bytes
 * read are the same as the reload's. */
template <int KS>
__device__ static inline void scores_wg(float s[8][4], const uint4 *sQ, const uint4 *kt) {
    const uint32_t dq = wg_desc_lo(sQ), dk = wg_desc_lo(kt);
    wg_fence();
    wgmma_64x64_ss<0, 0>(&s[0][0], wg_desc_at(dq, 0), wg_desc_at(dk, 0));
#pragma unroll
    for (int kk = 1; kk < KS; kk++) {   /* 64-row atoms 8 KiB apart, 32 bytes of D per instruction */
        const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
        wgmma_64x64_ss<0, 1>(&s[0][0], wg_desc_at(dq, off), wg_desc_at(dk, off));
    }
    wg_commit();
}

/* The per-element mask, for TILE_MASKED tiles only (behind one uniform branch, so that the other
 * tiles' loop stays short). A lane holds 2 NT elements of a fixed index (its query row; in dK/dV
 * its key) against the columns col0 + 8 n + c (n < NT, c < 2; col0 = the tile's first column +
 * 2 (lane % 4)): visible_bits says which it may see as bit 2 n + c. The band is an interval of
 * columns, compared unrolled in 32 bits; the block-sparse layout and documents, rarer, run a
 * rolled loop. Unrolled per element with 64-bit divisions (the forward at D = 64 was 17,700
 * instructions, then 5,500 with the mask behind a branch) the warps waited for instruction
 * fetches half the time (ncu, H200). */

/* the query rows [*lo, *hi] that see key j by the causal / window band (rows past the last out) */
__device__ static inline void key_band(const geom &g, int64_t j, int64_t *lo, int64_t *hi) {
    const int64_t jp = j - (g.Tk - g.Tq);   /* the key's position in query numbering */
    int64_t a = 0, z = g.Tq - 1;
    if (g.causal && jp > a) a = jp;
    if (g.right >= 0 && jp - g.right > a) a = jp - g.right;
    if (g.left >= 0 && jp + g.left < z) z = jp + g.left;
    *lo = a;
    *hi = z;
}

/* bit 2 n + c: whether fixed index `fixed` (ROW: query row i, columns keys; else key j, columns
 * queries) sees column col0 + 8 n + c; fixed must be in range (i < Tq, j < Tk) */
template <int NT, bool ROW>
__device__ static uint32_t visible_bits(const geom &g, int64_t b, int64_t fixed, int64_t col0) {
    int64_t lo, hi;
    if (ROW) band(g, fixed, &lo, &hi);
    else key_band(g, fixed, &lo, &hi);
    /* relative to col0, clamped into [-1, 8 NT] so that 32 bits hold them */
    const int span = 8 * NT;
    const int a = (int)(lo - col0 < -1 ? -1 : lo - col0 > span ? span : lo - col0);
    const int z = (int)(hi - col0 < -1 ? -1 : hi - col0 > span ? span : hi - col0);
    uint32_t bits = 0;
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int c = 0; c < 2; c++) bits |= (uint32_t)(8 * n + c >= a && 8 * n + c <= z) << (2 * n + c);
    /* 32-bit divisions (positions and the block size fit): a 64-bit one is a subroutine call,
     * and a call in the loop around the backward kernels' wgmmas made ptxas serialise every wgmma
     * of the kernel (C7520; scripts/sass-check.sh fails on it). No branch on the data either (a
     * column out of the band reads entry 0 instead). */
    if (g.layout) {
        const uint32_t bs = (uint32_t)g.bs, row = (uint32_t)(ROW ? fixed : 0), key = (uint32_t)(ROW ? 0 : fixed);
#pragma unroll 1
        for (int e = 0; e < 2 * NT; e++) {
            const bool want = bits >> e & 1;
            const uint32_t col = (uint32_t)col0 + 8 * (e >> 1) + (e & 1), i = ROW ? row : col, j = ROW ? col : key;
            const int64_t at = want ? (int64_t)(i / bs) * g.nbc + j / bs : 0;
            bits &= ~((uint32_t)(g.layout[at] == 0) << e);
        }
    }
    if (g.q_doc) {
#pragma unroll 1
        for (int e = 0; e < 2 * NT; e++) {
            const bool want = bits >> e & 1;
            const int64_t col = col0 + 8 * (e >> 1) + (e & 1), i = want ? (ROW ? fixed : col) : 0,
                          j = want ? (ROW ? col : fixed) : 0;
            bits &= ~((uint32_t)(g.q_doc[b * g.Tq + i] != g.k_doc[b * g.Tk + j]) << e);
        }
    }
    return bits;
}

/* s[n][2 r + c] at -inf where bit 2 n + c of bits is clear */
template <int NT>
__device__ static inline void apply_bits(float s[][4], uint32_t bits, int r) {
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int c = 0; c < 2; c++)
            if (!(bits >> (2 * n + c) & 1)) s[n][2 * r + c] = -INFINITY;
}

/* which keys from j0 this lane's two query rows see (visible_bits of each; rows[] the query
 * indices, past the last, or grouped -1, for none) */
template <int NT, bool grouped>
__device__ static inline void row_bits(uint32_t bits[2], const geom &g, int64_t b, const int64_t rows[2], int64_t j0,
                                       int tq) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = rows[r];
        const bool row_in = grouped ? i >= 0 : i < g.Tq;
        bits[r] = visible_bits<NT, true>(g, b, row_in ? i : 0, j0 + 2 * tq) & (row_in ? ~0u : 0u);
    }
}

/* s (NT n8 tiles of scores for this lane's two query rows, accumulator layout) at -inf where
 * the (query, key) pair is not visible, keys from j0 */
template <int NT, bool grouped>
__device__ static inline void mask_scores(float s[][4], const geom &g, int64_t b, const int64_t rows[2], int64_t j0,
                                          int tq) {
    uint32_t bits[2];
    row_bits<NT, grouped>(bits, g, b, rows, j0, tq);
    apply_bits<NT>(s, bits[0], 0);
    apply_bits<NT>(s, bits[1], 1);
}

/* How far (natural-log units) a row's scores may rise above its running max before the max
 * moves: 8 log 2, so that exp(s - m) <= 256 (bf16 and the f32 sums hold that easily). Until then
 * the max stays and O is not rescaled: a rescale is a multiply per O accumulator (64 a thread a
 * tile at D = 128), and past the first tiles of a row its max rarely grows by that much. The
 * result is the same up to rounding (O and l carry the same stale max; lse = m + log l). */
#define RESCALE_SLACK 5.5451774f

/* one key tile's step of the online softmax for this lane's two rows: s (the tile's scores,
 * accumulator layout) becomes P = exp(s scale - m) with masked pairs at 0 (st: the tile's
 * state), and when a row of the warp has scores more than RESCALE_SLACK above its max, every
 * row's max moves to its new one, with its sum l and O rescaled (one branch for the warp) */
template <int D, bool grouped>
__device__ static inline void online_softmax(float s[8][4], float o[D / 8][4], float m[2], float l[2], const geom &g,
                                             int64_t b, const int64_t rows[2], int64_t j0, int st, int tq) {
    if (st == TILE_MASKED) mask_scores<8, grouped>(s, g, b, rows, j0, tq);
    float mx[2] = {-INFINITY, -INFINITY};   /* the raw scores' max: scale > 0 keeps the order */
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float mt[2];   /* the tile's max per row, scaled; -inf where it sees nothing */
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mt[r] = quad_max(mx[r]) * g.scale;
        grow |= mt[r] > m[r] + RESCALE_SLACK;   /* a row's first visible scores (m = -inf) too */
    }
    if (__any_sync(0xffffffffu, grow)) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float mn = fmaxf(m[r], mt[r]);            /* -inf stays -inf */
            alpha[r] = mn == -INFINITY ? 1.0f : __expf(m[r] - mn);   /* 0 from -inf: O and l were 0 */
            m[r] = mn;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
    }
    float nb2[2];   /* -m in log2 units: exp(x scale - m) = 2^(x scale log2e - m log2e) */
#pragma unroll
    for (int r = 0; r < 2; r++) nb2[r] = m[r] == -INFINITY ? 0.0f : -m[r] * LOG2E_F;   /* nothing visible yet: P = 0 */
    const float sl2 = g.scale * LOG2E_F;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = exp2_ftz(fmaf(s[n][e], sl2, nb2[e >> 1]));   /* masked: -inf -> 0 */
            s[n][e] = p;
            l[e >> 1] += p;
        }
}

/* acc += x t on the warpgroup's tensor cores, waited for (O += P V in the forward, dQ += dS K):
 * x (16 x 16 KT of this warp's rows, accumulator layout) rounded to A fragments before the
 * fence, t a ROWS-row tile in the wgmma layout as MN-major B. The wait covers every wgmma in
 * flight (the pipelined forward's next S too). */
template <int D, int KT, int ROWS>
__device__ static inline void times_tile_wg_waited(float acc[D / 8][4], float x[2 * KT][4], const uint4 *t) {
    uint32_t xa[KT][4];
    acc_to_a_all<KT>(xa, x);
    wg_fence();
    acc_times_tile_wg<D, KT, ROWS>(acc, xa, t);
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(&acc[0][0], 4 * (D / 8));
}

/* the wgmma forward's first tiles, as cp.async groups: Q with K(j0); with PIPE, K(j1) into K's
 * second buffer; V(j0). Waits for Q and K(j0), which every thread then sees */
template <int D, bool grouped, bool PIPE>
__device__ static inline void forward_prologue_wg(uint4 *sQ, uint4 *sK, uint4 *sK2, uint4 *sV, const bf16 *q,
                                                  const bf16 *k, const bf16 *v, const geom &g, int64_t h0, int64_t i0,
                                                  int64_t j0, int64_t j1) {
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    load_query_tile<D, grouped, true>(sQ, q, g, h0, i0, qs);
    if (j0 >= 0) load_tile_async<D, 64, true>(sK, k, j0, g.Tk, ks);
    cp_async_commit();
    if (PIPE) {
        if (j1 >= 0) load_tile_async<D, 64, true>(sK2, k, j1, g.Tk, ks);
        cp_async_commit();
    }
    if (j0 >= 0) load_tile_async<D, 64, true>(sV, v, j0, g.Tk, ks);
    cp_async_commit();
    cp_async_wait<PIPE ? 2 : 1>();   /* Q and K(j0) */
    fence_proxy_async();
    __syncthreads();
}

/* Split over keys (decoding: one query tile against a long cache, flash-decoding): with
 * splits > 1 block `split` walks only its share of the band's key tiles and writes its rows'
 * partial O (normalised by its own sum) and log-sum-exp to part_o / part_lse, which fa_combine
 * merges; with splits = 1 it writes out and lse itself. */
template <int D, bool grouped, bool WG, bool PIPE = false>
__global__ static void __launch_bounds__(FA_THREADS, WG_MIN_BLOCKS(WG && !PIPE, D))
fa_forward(float *out, float *lse, geom g, const bf16 *Q, const bf16 *K, const bf16 *V, int splits, float *part_o,
           float *part_lse, int *ran_wgmma) {
    constexpr int CH = D / 8, KS = D / 16;
    /* WG: S = Q K^T and O += P V on wgmma (Hopper), K and V tiles in its layout in dynamic shared
     * memory; in a compilation pass without wgmma the same kernel takes the mma.sync path.
     * PIPE (with WG): the next tile's S = Q K^T is issued before this tile's softmax, so the
     * tensor cores work while the warps exponentiate (K double-buffered, loaded a tile ahead) */
    constexpr bool W = WG && ULY_HAS_WGMMA && (D == 64 || D == 128);
    constexpr bool P2 = W && PIPE;
    uint4 *sQ, *sK, *sV, *sK2 = NULL;
    if (W) {
        ULY_DYNAMIC_SHARED(uint4, dyn);
        sK = align_1024(dyn);
        sV = sK + 64 * CH;
        sQ = sV + 64 * CH;
        sK2 = sQ + 64 * CH;   /* K's second buffer */
        if (ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    } else {
        __shared__ uint4 tQ[64 * CH], tK[64 * CH], tV[64 * CH];
        sQ = tQ; sK = tK; sV = tV;
    }
    const int split = (int)(blockIdx.x % (unsigned)splits);
    const int64_t blk = (int64_t)(blockIdx.x / (unsigned)splits), grp = g.H / g.Hkv;
    /* a block per 64 query rows of one (batch, head); grouped: per (batch, kv head), its tile
     * holding every query of the group's heads (Tq * grp <= 64), so K and V are read once */
    const int64_t nt = grouped ? 1 : (g.Tq + 63) / 64, tile = nt - 1 - blk % nt, bh = blk / nt;
    const int64_t b = grouped ? bh / g.Hkv : bh / g.H, h = grouped ? -1 : bh % g.H;
    const int64_t hk = grouped ? bh % g.Hkv : h / grp, i0 = tile * 64;
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    const bf16 *q = Q + b * g.Tq * qs + (grouped ? 0 : h * D), *k = K + b * g.Tk * ks + hk * D, *v = V + b * g.Tk * ks + hk * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
    /* this lane's two rows (tile rows t0 and t0 + 8) as query indices; past the last query (or,
     * grouped, -1) when there is no such row */
    const int64_t t0 = i0 + warp * 16 + (lane >> 2);
    int64_t rows[2] = {t0, t0 + 8};
    if (grouped)   /* t < 64 and Tq <= 64: 32-bit division (a 64-bit one is a call, and spills) */
#pragma unroll
        for (int r = 0; r < 2; r++) rows[r] = rows[r] < g.Tq * grp ? (int)rows[r] % (int)g.Tq : -1;

    /* pipeline: K of the next tile loads during this tile's softmax and P V, V during its S */
    int64_t lo, hi;
    chunk_band(g, i0, i0 + 64 < g.Tq ? i0 + 64 : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, i0, i0 + 63);
    if (splits > 1 && lo <= hi) {   /* this split's share of the band's key tiles */
        const int64_t t0 = lo / 64, tiles = hi / 64 - t0 + 1;
        const int64_t a = t0 + tiles * split / splits, z = t0 + tiles * (split + 1) / splits;
        lo = a * 64 > lo ? a * 64 : lo;
        hi = z * 64 - 1 < hi ? z * 64 - 1 : hi;
    }
    int st = TILE_EMPTY;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / 64 * 64, hi, 64, &st) : -1;
    float o[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    if constexpr (P2) {
        /* cp.async groups, oldest first: Q + K(j0); K(j1); V(j0); then each round commits
         * K(two tiles on) at its start and the next V at its end, so at a round's start the
         * pending ones are [K(next), V(this), K(after next)] (empty groups keep the count) */
        int st1 = TILE_EMPTY;
        int64_t j1 = j0 >= 0 ? next_key_tile(g, rs, j0 + 64, hi, 64, &st1) : -1;
        forward_prologue_wg<D, grouped, true>(sQ, sK, sK2, sV, q, k, v, g, hk * grp, i0, j0, j1);
        float s[8][4];
        if (j0 >= 0) {   /* S(j0) */
            scores_wg<KS>(s, sQ, sK);
            wg_wait<0>();
            wg_fence_regs(&s[0][0], 32);
        }
        __syncthreads();   /* every warp is done with K(j0)'s buffer */
        uint4 *k_this = sK, *k_next = sK2;   /* held K(j0); holds K(j1) */
        while (j0 >= 0) {
            int st2 = TILE_EMPTY;
            const int64_t j2 = j1 >= 0 ? next_key_tile(g, rs, j1 + 64, hi, 64, &st2) : -1;
            if (j2 >= 0) load_tile_async<D, 64, true>(k_this, k, j2, g.Tk, ks);   /* K two tiles on */
            cp_async_commit();
            cp_async_wait<2>();   /* K(j1) */
            fence_proxy_async();
            __syncthreads();
            float sn[8][4];
            if (j1 >= 0) scores_wg<KS>(sn, sQ, k_next);   /* S(j1): the tensor cores run it during this softmax */
            online_softmax<D, grouped>(s, o, m, l, g, b, rows, j0, st, tq);
            cp_async_wait<1>();   /* V(j0) */
            fence_proxy_async();
            __syncthreads();
            times_tile_wg_waited<D, 4, 64>(o, s, sV);   /* O += P V; the wait covers S(j1) too */
            if (j1 >= 0) {
                wg_fence_regs(&sn[0][0], 32);
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) s[n][e] = sn[n][e];
            }
            __syncthreads();   /* every warp is done with V(j0) */
            if (j1 >= 0) load_tile_async<D, 64, true>(sV, v, j1, g.Tk, ks);
            cp_async_commit();
            j0 = j1; st = st1;
            j1 = j2; st1 = st2;
            uint4 *const t = k_this;
            k_this = k_next;
            k_next = t;
        }
        cp_async_wait<0>();
    } else if constexpr (W) {
        /* K double-buffered: K of the next tile is queued at the top of this one (its buffer was
         * last read by the S before the previous P V, which every warp finished before the barrier
         * there), so each tile needs two barriers, not four: one before P V (this V landed) and
         * one after it (every warp done with V, the next K landed). cp.async groups at a tile's
         * top: [V(this)], then K(next) is committed; V(next) after the second barrier. */
        forward_prologue_wg<D, grouped, false>(sQ, sK, sK2, sV, q, k, v, g, hk * grp, i0, j0, -1);
        uint4 *k_this = sK, *k_next = sK2;
        while (j0 >= 0) {
            int st_next = TILE_EMPTY;
            const int64_t j_next = next_key_tile(g, rs, j0 + 64, hi, 64, &st_next);
            if (j_next >= 0) load_tile_async<D, 64, true>(k_next, k, j_next, g.Tk, ks);
            cp_async_commit();
            float s[8][4];
            scores_wg<KS>(s, sQ, k_this);
            wg_wait<0>();
            wg_fence_regs(&s[0][0], 32);
            online_softmax<D, grouped>(s, o, m, l, g, b, rows, j0, st, tq);
            cp_async_wait<1>();   /* this tile's V (the next K may still be in flight) */
            fence_proxy_async();
            __syncthreads();
            times_tile_wg_waited<D, 4, 64>(o, s, sV);   /* O += P V */
            cp_async_wait<0>();   /* the next K */
            fence_proxy_async();
            __syncthreads();      /* every warp is done with V (and with this K), the next K landed */
            if (j_next >= 0) load_tile_async<D, 64, true>(sV, v, j_next, g.Tk, ks);
            cp_async_commit();
            j0 = j_next;
            st = st_next;
            uint4 *const t = k_this;
            k_this = k_next;
            k_next = t;
        }
        cp_async_wait<0>();
    } else {   /* mma.sync: one K and one V buffer in static shared memory (48 KiB at D = 128) */
    load_query_tile<D, grouped>(sQ, q, g, hk * grp, i0, qs);
    if (j0 >= 0) load_tile_async<D, 64>(sK, k, j0, g.Tk, ks);
    cp_async_commit();
    if (j0 >= 0) load_tile_async<D, 64>(sV, v, j0, g.Tk, ks);
    cp_async_commit();
    cp_async_wait<1>();   /* Q and the first K */
    __syncthreads();
    uint32_t qa[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; kk++) ldmatrix_x4(qa[kk], frag_a<D>(sQ, warp * 16, 2 * kk));

    while (j0 >= 0) {
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++)
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t bb[4];
                ldmatrix_x4(bb, frag_b<D>(sK, np * 16, 2 * kk));
                mma_two(s[2 * np], s[2 * np + 1], qa[kk], bb);
            }
        __syncthreads();   /* every warp is done with K */
        int st_next = TILE_EMPTY;
        const int64_t j_next = next_key_tile(g, rs, j0 + 64, hi, 64, &st_next);
        if (j_next >= 0) load_tile_async<D, 64>(sK, k, j_next, g.Tk, ks);
        cp_async_commit();
        online_softmax<D, grouped>(s, o, m, l, g, b, rows, j0, st, tq);
        cp_async_wait<1>();   /* this tile's V (the next K may still be in flight) */
        __syncthreads();
        acc_times_tile<D, 4>(o, s, sV);   /* O += P V */
        __syncthreads();   /* every warp is done with V */
        if (j_next >= 0) load_tile_async<D, 64>(sV, v, j_next, g.Tk, ks);
        cp_async_commit();
        cp_async_wait<1>();   /* the next K (its V may still be in flight) */
        __syncthreads();
        j0 = j_next;
        st = st_next;
    }
    }   /* the mma.sync loop */
    if (splits > 1) {   /* this split's partial rows, merged by fa_combine */
        out = part_o + (int64_t)split * g.B * g.Tq * g.H * D;
        lse = part_lse + (int64_t)split * g.B * g.H * g.Tq;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = quad_sum(l[r]);
        const int64_t i = rows[r], hr = grouped ? hk * grp + (int)(t0 + 8 * r) / (int)g.Tq : h;   /* its query head */
        if (grouped ? i < 0 : i >= g.Tq) continue;
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        float *dst = out + ((b * g.Tq + i) * g.H + hr) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < CH; n++) {
            dst[n * 8] = o[n][2 * r] * inv;
            dst[n * 8 + 1] = o[n][2 * r + 1] * inv;
        }
        if (tq == 0) lse[(b * g.H + hr) * g.Tq + i] = sum > 0.0f ? m[r] + logf(sum) : -INFINITY;
    }
}

/* the splits' partial rows merged, in split order (the same bits every run): a thread per
 * (batch, head, row) and element d of the row; lse = log sum_s exp(lse_s), O = sum_s
 * exp(lse_s - lse) O_s; a row no split saw gets O = 0 and lse = -inf */
__global__ static void fa_combine(float *out, float *lse, geom g, int D, int splits, const float *part_o,
                                  const float *part_lse) {
    const int64_t rows = g.B * g.H * g.Tq, plane_o = g.B * g.Tq * g.H * D;
    ULY_CU_FOR(e, rows * D) {
        const int64_t row = e / D, d = e % D;           /* row = (b * H + h) * Tq + i */
        const int64_t b = row / (g.H * g.Tq), h = row / g.Tq % g.H, i = row % g.Tq;
        float mx = -INFINITY;
        for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_lse[s * rows + row]);
        const int64_t at = ((b * g.Tq + i) * g.H + h) * D + d;
        if (mx == -INFINITY) {
            out[at] = 0.0f;
            if (d == 0) lse[row] = -INFINITY;
            continue;
        }
        float sum = 0.0f, acc = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float w = __expf(part_lse[s * rows + row] - mx);
            sum += w;
            acc += w * part_o[s * plane_o + at];
        }
        out[at] = acc / sum;
        if (d == 0) lse[row] = mx + logf(sum);
    }
}

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

/* the query rows [lo, hi] that see every key of [j0, j0 + 63] (none with keys past the last or
 * documents): rows see [band lo, band hi], both ends growing with the row, so these are the rows
 * from the first that sees key j0 + 63 to the last that sees key j0 */
struct full_rows { int32_t lo, hi; };
__device__ static inline full_rows full_rows_of_keys(const geom &g, int64_t j0) {
    int64_t a, z, a1, z1;
    key_band(g, j0 + 63, &a, &z);
    key_band(g, j0, &a1, &z1);
    full_rows f = {(int32_t)a, (int32_t)z1};
    if (j0 + 63 >= g.Tk || g.q_doc) f.hi = -1;
    return f;
}

/* the next QT-query tile, head-major over the query heads sharing the kv head (up to h_end), at or after
 * (*h, *i0) with a visible pair against keys [j0, j0 + 63]; 0 when none is left. Without a
 * block-sparse layout every tile of the rows [i_lo, i_hi] (query_span's, not empty) has one, and
 * it is wholly visible when its rows are within fr (the search took ~100 instructions a tile). */
template <int QT>
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
            *st = tile_state(g, span_of_rows(g, *i0, *i0 + QT - 1), j0, j0 + 63);
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

/* WG: S^T, dP^T, dV += P^T dO and dK += dS^T Q as wgmma (Hopper), every tile in its layout (at
 * D = 128: 221 registers, no spills, with S^T and dP^T's A (K, V) from shared memory; with A in
 * registers it spilled ~100 bytes a thread, and the mma.sync kernel uses 255).
 * DQ (the one-pass backward, D = 32 and 64): dQ too, from the same dS (dq_share, atomics), so
 * S and dP are computed once instead of once here and once in the dQ kernel; dq_share reads K
 * through ldmatrix, whose layout is the wgmma one at D = 64 only, so DQ stays on mma.sync at 128 */
/* QT: queries a tile, 32, or 64 in the wgmma variant at D = 64 (ULY_CUDA_ATTN_DKV=64): S^T and
 * dP^T as 64 x 64 wgmmas, whose A (K, V: 2 KiB a wgmma from shared memory) then feeds twice the
 * math of a 64 x 32 one, and half the tiles to walk; 3 blocks per SM instead of 4 (more registers) */
#define DKV_MIN_BLOCKS(wg, D, DQ, QT) ((QT) == 64 ? ((wg) && ULY_HAS_WGMMA ? 3 : 0) : WG_MIN_BLOCKS((wg) && (D) == 64 && !(DQ), D))
template <int D, bool WG, bool DQ = false, int QT = 32>
__global__ static void __launch_bounds__(FA_THREADS, DKV_MIN_BLOCKS(WG, D, DQ, QT))
fa_backward_dkv(float *dk, float *dv, geom g, const bf16 *Q, const bf16 *K, const bf16 *V, const bf16 *dO,
                const float *lse, const float *delta, int *ran_wgmma, float *dq) {
    constexpr int CH = D / 8;
    constexpr bool W = WG && ULY_HAS_WGMMA && (D == 64 || (D == 128 && !DQ));
    static_assert(QT == 32 || (QT == 64 && D == 64 && !DQ), "fa_backward_dkv: 64-query tiles only at D 64, two-pass");
    constexpr int T = W ? QT : 32;   /* this pass's query tile (mma.sync: 32) */
    constexpr int NT = T / 8;        /* n8 tiles of queries: S^T is 64 x T */
    ULY_DYNAMIC_SHARED(uint4, smem_raw);
    uint4 *const smem = W ? align_1024(smem_raw) : smem_raw;
    if (W && ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    /* K, V, then two buffers of Q (T rows) followed by dO (T rows), (DQ: dS^T), then the two
     * buffers of lse and delta (2 T floats each) */
    uint4 *const sK = smem, *const sV = smem + 64 * CH;
    float *const sStats = (float *)(smem + (128 + 4 * QT) * CH + (DQ ? 64 * 32 * 2 / 16 : 0));
    const int64_t nt = (g.Tk + 63) / 64, tile = (int64_t)blockIdx.x % nt, bh = (int64_t)blockIdx.x / nt;
    const int64_t b = bh / g.Hkv, hk = bh % g.Hkv, j0 = tile * 64, G = g.H / g.Hkv;
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t keys[2] = {j0 + warp * 16 + (lane >> 2), j0 + warp * 16 + (lane >> 2) + 8};
    const bf16 *const qbase = Q + b * g.Tq * qs, *const obase = dO + b * g.Tq * qs;

    float dka[CH][4], dva[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++)
        for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.0f;
    /* pipeline: the next query tile's Q and dO load into the other buffer during this one's math */
    /* the walk in 32 bits (positions < 2^30, heads fewer): fewer registers live across the loop */
    int64_t span_lo, span_hi;
    query_span(g, j0, j0 + 63 < g.Tk ? j0 + 63 : g.Tk - 1, &span_lo, &span_hi);
    const int i_lo = (int)span_lo, i_hi = (int)span_hi, h_end = (int)(hk * G + G);
    int h = (int)(hk * G), i0 = i_lo / T * T;
    int st = TILE_EMPTY, buf = 0;
    const full_rows fr = full_rows_of_keys(g, j0);
    int have = i_lo <= i_hi && next_query_tile<T>(g, h_end, j0, i_lo, i_hi, fr, &h, &i0, &st);
    load_tile_async<D, 64, W>(sK, K + b * g.Tk * ks + hk * D, j0, g.Tk, ks);   /* W: A of S^T, dP^T */
    load_tile_async<D, 64, W>(sV, V + b * g.Tk * ks + hk * D, j0, g.Tk, ks);
    const float *const lse_b = lse + b * g.H * g.Tq, *const delta_b = delta + b * g.H * g.Tq;
    if (have) {
        load_tile_async<D, T, W>(smem + 128 * CH, qbase + h * D, i0, g.Tq, qs);
        load_tile_async<D, T, W>(smem + (128 + T) * CH, obase + h * D, i0, g.Tq, qs);
        load_stats_async<T>(sStats, lse_b + h * g.Tq, delta_b + h * g.Tq, i0, g.Tq);
    }
    cp_async_commit();
    while (have) {
        int h_next = h, i_next = i0 + T;
        int st_next = TILE_EMPTY;
        const int more = next_query_tile<T>(g, h_end, j0, i_lo, i_hi, fr, &h_next, &i_next, &st_next);
        if (more) {   /* the other buffer: every warp finished with it at the end of the last round */
            uint4 *const other = smem + (128 + 2 * T * (buf ^ 1)) * CH;
            load_tile_async<D, T, W>(other, qbase + h_next * D, i_next, g.Tq, qs);
            load_tile_async<D, T, W>(other + T * CH, obase + h_next * D, i_next, g.Tq, qs);
            load_stats_async<T>(sStats + 2 * T * (buf ^ 1), lse_b + h_next * g.Tq, delta_b + h_next * g.Tq, i_next, g.Tq);
        }
        cp_async_commit();
        /* this tile's mask (bit 2 n + c of key r: the query in s[n][2 r + c]; all set but on
         * masked tiles), worked out while the tiles load, applied after the MMAs */
        uint32_t vis[2] = {~0u, ~0u};
        if (st == TILE_MASKED)
#pragma unroll
            for (int r = 0; r < 2; r++) vis[r] = keys[r] < g.Tk ? visible_bits<NT, false>(g, b, keys[r], i0 + 2 * tq) : 0u;
        cp_async_wait<1>();   /* this tile's Q and dO (and K, V): all but the newest group */
        if (W) fence_proxy_async();
        __syncthreads();
        const uint4 *const sQ = smem + (128 + 2 * T * buf) * CH, *const sO = sQ + T * CH;
        const float *const stats = sStats + 2 * T * buf;   /* this tile's lse, then delta */
        float s[NT][4], dp[NT][4];
        if constexpr (W) two_products_wg<D, T>(s, dp, sK, sQ, sV, sO);   /* S^T = K Q^T, dP^T = V dO^T */
        else two_products<D>(s, dp, sK, sQ, sV, sO, warp);
        if (st == TILE_MASKED) {   /* S^T at -inf where not visible (exp gives 0) */
            apply_bits<NT>(s, vis[0], 0);
            apply_bits<NT>(s, vis[1], 1);
        }
        /* P^T = exp(S^T scale - lse) as 2^(S^T scale log2e - lse log2e). Only masked tiles hold
         * queries past the last (stats 0) or queries that see nothing (lse -inf), and there
         * every pair of theirs is -inf: lse is clamped to -1e30 so that -inf - lse stays -inf
         * (P = 0; with lse -inf it would be NaN). dS^T / scale = P^T (dP^T - delta): the scale
         * is applied to dK once at the end (and by dq_share to its dQ) */
        float nl2[NT][2], dlc[NT][2];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int t = n * 8 + 2 * tq + c;
                nl2[n][c] = -fmaxf(stats[t], -1e30f) * LOG2E_F;
                dlc[n][c] = stats[T + t];
            }
        const float sl2 = g.scale * LOG2E_F;
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = exp2_ftz(fmaf(s[n][e], sl2, nl2[n][e & 1]));
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - dlc[n][e & 1]);
            }
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
        if constexpr (W) {   /* dV += P^T dO, dK += dS^T Q: P^T, dS^T from the accumulators, dO and Q MN-major */
            uint32_t pa[T / 16][4], da[T / 16][4];
            acc_to_a_all<T / 16>(pa, s);
            acc_to_a_all<T / 16>(da, dp);
            wg_fence();
            acc_times_tile_wg<D, T / 16, T>(dva, pa, sO);
            acc_times_tile_wg<D, T / 16, T>(dka, da, sQ);
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(&dva[0][0], 4 * CH);
            wg_fence_regs(&dka[0][0], 4 * CH);
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
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int64_t j = keys[r];
        if (j >= g.Tk) continue;
        int64_t at = ((b * g.Tk + j) * g.Hkv + hk) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < CH; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                if (dk) dk[at + n * 8 + c] += dka[n][2 * r + c] * g.scale;   /* dS's scale, left out of the loop */
                if (dv) dv[at + n * 8 + c] += dva[n][2 * r + c];
            }
    }
}

/* ---- backward: dQ ---- */
/* WG: S, dP and dQ += dS K as wgmma (Hopper), the K and V tiles in its layout (D = 64, 128) */
/* KT: keys a tile, 32, or 64 in the wgmma variant at D = 64 (ULY_CUDA_ATTN_DQ=64): S and dP as
 * 64 x 64 wgmmas, whose A (Q, dO from shared memory) then feeds twice the math, and half the
 * tiles to walk */
template <int D, bool WG, int KT = 32>
__global__ static void __launch_bounds__(FA_THREADS)
fa_backward_dq(float *dq, geom g, const bf16 *Q, const bf16 *K, const bf16 *V, const bf16 *dO, const float *lse,
               const float *delta, int *ran_wgmma) {
    constexpr int CH = D / 8;
    constexpr bool W = WG && ULY_HAS_WGMMA && (D == 64 || D == 128);
    static_assert(KT == 32 || (KT == 64 && D == 64), "fa_backward_dq: 64-key tiles only at D 64");
    constexpr int T = W ? KT : 32;   /* this pass's key tile (mma.sync: 32) */
    constexpr int NT = T / 8;        /* n8 tiles of keys: S is 64 x T */
    /* Q, dO (64 rows), then two buffers of K (T rows) followed by V (T rows) */
    ULY_DYNAMIC_SHARED(uint4, smem_raw);
    uint4 *const smem = W ? align_1024(smem_raw) : smem_raw;
    if (W && ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    uint4 *const sQ = smem, *const sO = smem + 64 * CH;
    const int64_t nt = (g.Tq + 63) / 64, tile = nt - 1 - (int64_t)blockIdx.x % nt, bh = (int64_t)blockIdx.x / nt;
    const int64_t b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv), i0 = tile * 64;
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    const bf16 *k = K + b * g.Tk * ks + hk * D, *v = V + b * g.Tk * ks + hk * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t rows[2] = {i0 + warp * 16 + (lane >> 2), i0 + warp * 16 + (lane >> 2) + 8};
    /* per row: -lse log2e (-inf for a row with nothing visible or past the last: P = 0), delta */
    float nl2[2], dl[2];
    const float sl2 = g.scale * LOG2E_F;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int in = rows[r] < g.Tq;
        const float L = in ? lse[(b * g.H + h) * g.Tq + rows[r]] : -INFINITY;
        nl2[r] = L > -INFINITY ? -L * LOG2E_F : -INFINITY;
        dl[r] = in ? delta[(b * g.H + h) * g.Tq + rows[r]] : 0.0f;
    }
    /* pipeline: the next key tile's K and V load into the other buffer during this one's math */
    int64_t lo, hi;
    chunk_band(g, i0, i0 + 64 < g.Tq ? i0 + 64 : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, i0, i0 + 63);
    int st = TILE_EMPTY, buf = 0;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / T * T, hi, T, &st) : -1;
    load_tile_async<D, 64, W>(sQ, Q + b * g.Tq * qs + h * D, i0, g.Tq, qs);   /* W: A of S, dP */
    load_tile_async<D, 64, W>(sO, dO + b * g.Tq * qs + h * D, i0, g.Tq, qs);
    if (j0 >= 0) {
        load_tile_async<D, T, W>(smem + 128 * CH, k, j0, g.Tk, ks);
        load_tile_async<D, T, W>(smem + (128 + T) * CH, v, j0, g.Tk, ks);
    }
    cp_async_commit();
    float acc[CH][4];
#pragma unroll
    for (int n = 0; n < CH; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    while (j0 >= 0) {
        int st_next = TILE_EMPTY;
        const int64_t j_next = next_key_tile(g, rs, j0 + T, hi, T, &st_next);
        if (j_next >= 0) {   /* the other buffer: every warp finished with it at the end of the last round */
            uint4 *const other = smem + (128 + 2 * T * (buf ^ 1)) * CH;
            load_tile_async<D, T, W>(other, k, j_next, g.Tk, ks);
            load_tile_async<D, T, W>(other + T * CH, v, j_next, g.Tk, ks);
        }
        cp_async_commit();
        uint32_t vis[2] = {~0u, ~0u};   /* the tile's mask, while the tiles load (as in dK/dV) */
        if (st == TILE_MASKED) row_bits<NT, false>(vis, g, b, rows, j0, tq);
        cp_async_wait<1>();   /* this tile's K and V (and Q, dO): all but the newest group */
        if (W) fence_proxy_async();
        __syncthreads();
        const uint4 *const sK = smem + (128 + 2 * T * buf) * CH, *const sV = sK + T * CH;
        float s[NT][4], dp[NT][4];
        if constexpr (W) two_products_wg<D, T>(s, dp, sQ, sK, sO, sV);   /* S = Q K^T, dP = dO V^T */
        else two_products<D>(s, dp, sQ, sK, sO, sV, warp);
        if (st == TILE_MASKED) {   /* exp(-inf) = 0 */
            apply_bits<NT>(s, vis[0], 0);
            apply_bits<NT>(s, vis[1], 1);
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)   /* dS / scale = P (dP - delta), P = 2^(S scale log2e - lse log2e) */
                s[n][e] = exp2_ftz(fmaf(s[n][e], sl2, nl2[e >> 1])) * (dp[n][e] - dl[e >> 1]);
        if constexpr (W) times_tile_wg_waited<D, T / 16, T>(acc, s, sK);   /* dQ += dS K, K MN-major */
        else acc_times_tile<D, 2>(acc, s, sK);   /* (T = 32) */
        __syncthreads();   /* every warp is done with this buffer before the next round refills it */
        j0 = j_next;
        st = st_next;
        buf ^= 1;
    }
    wg_fence_regs(&acc[0][0], 4 * CH);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int64_t i = rows[r];
        if (i >= g.Tq) continue;
        float *dst = dq + ((b * g.Tq + i) * g.H + h) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < CH; n++) {   /* dS's scale, left out of the loop */
            dst[n * 8] += acc[n][2 * r] * g.scale;
            dst[n * 8 + 1] += acc[n][2 * r + 1] * g.scale;
        }
    }
}

/* ---- host side ---- */
int uly_cu_fused_attention_ok(const geom &g) {
    const char *env = getenv("ULY_CUDA_ATTN");
    if (env && !strcmp(env, "chunked")) return 0;
    return (g.D == 32 || g.D == 64 || g.D == 128) && g.Tq > 0 && g.Tk > 0 && g.Tq < ((int64_t)1 << 30) &&
           g.Tk < ((int64_t)1 << 30);   /* tile_state's row_span holds positions in 32 bits */
}

static int launched(const char *name) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    uly_cu_fail(name, e);
    return -1;
}

/* How many key splits a forward of `blocks` blocks gets: for one query tile (decoding, short
 * prompts) against at least 4 key tiles, enough to give every multiprocessor about two blocks,
 * each at least 2 key tiles; ULY_CUDA_ATTN_SPLITS=n forces n (tests). Longer queries fill the GPU
 * with query tiles already. */
static int forward_splits(const geom &g, int64_t blocks) {
    const int64_t key_tiles = (g.Tk + 63) / 64;
    if ((g.Tq + 63) / 64 != 1 || key_tiles < 2) return 1;
    const char *env = getenv("ULY_CUDA_ATTN_SPLITS");
    int64_t n;
    if (env && atoi(env) > 0) n = atoi(env);
    else {
        static int sms;
        if (!sms) {
            int dev = 0;
            if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) !=
                cudaSuccess || sms < 1)
                sms = 1;
            cudaGetLastError();
        }
        n = (2 * (int64_t)sms + blocks - 1) / blocks;
        if (n > key_tiles / 2) n = key_tiles / 2;
    }
    if (n > key_tiles) n = key_tiles;
    return n < 1 ? 1 : n > 64 ? 64 : (int)n;
}

/* pack a GQA group's query heads into one tile (decoding and short queries: every query of the
 * group fits in 64 rows), so each K/V tile is read once for the group instead of once per query
 * head; ULY_CUDA_ATTN_GROUPED=0 turns it off (comparisons) */
static int forward_grouped(const geom &g) {
    const char *env = getenv("ULY_CUDA_ATTN_GROUPED");
    if (env && !strcmp(env, "0")) return 0;
    return g.H > g.Hkv && g.Tq * (g.H / g.Hkv) <= 64;
}

/* one forward kernel launch: grouped or not, wgmma or mma.sync (the wgmma kernel's tiles live
 * in dynamic shared memory: Q, V, two K tiles + 1 KiB to align them) */
template <int D, bool grouped, bool WG, bool PIPE = false>
static void launch_forward(int64_t blocks, float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k,
                           const bf16 *v, int splits, float *part, float *part_lse, int *ran) {
    if (WG) {
        const size_t smem = 4 * 64 * (D / 8) * 16 + 1024;   /* Q, V and two K tiles, + 1 KiB to align them */
        static bool raised;
        if (!raised) {
            cudaError_t e = cudaFuncSetAttribute(fa_forward<D, grouped, WG, PIPE>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
            if (e != cudaSuccess) { uly_cu_fail("fused flash attention forward (wgmma): shared memory", e); return; }
            raised = true;
        }
        char name[64] = "";   /* for the profiler */
        if (uly_cu_prof_on) snprintf(name, sizeof name, "attention forward D %d wgmma%s%s", D, grouped ? " grouped" : "", PIPE ? " pipelined" : "");
        ULY_LAUNCH_SMEM_AS(name, (fa_forward<D, grouped, WG, PIPE>), blocks, FA_THREADS, smem, uly_cu_stream)(
            out, lse, g, q, k, v, splits, part, part_lse, ran);
    } else {
        char name[64] = "";   /* for the profiler */
        if (uly_cu_prof_on) snprintf(name, sizeof name, "attention forward D %d%s", D, grouped ? " grouped" : "");
        ULY_LAUNCH_AS(name, (fa_forward<D, grouped, WG>), blocks, FA_THREADS, uly_cu_stream)(out, lse, g, q, k, v, splits,
                                                                                             part, part_lse, ran);
    }
}

/* ---- wgmma in the fused kernels (Hopper) ----
 * ULY_CUDA_ATTN_WGMMA=0 turns it off; =1 uses it wherever the kernel was built with it, unchecked
 * (the emulator: the specs run it so; for comparisons on a GPU). Unset: on a compute capability
 * 9.0 device, for each head dim (64, 128) and each kernel (forward, dQ, dK/dV) apart, after a
 * self-check at the head dim's first use: a small causal GQA problem through the three kernels
 * both ways, where a wgmma kernel must have run its wgmma code (the sm_90a build) and agree with
 * mma.sync within bf16 rounding; a kernel that does not stays on mma.sync, and
 * uly_cuda_wgmma_status(D) says which and why. Seen on an H200 (2026-12-04): D = 128 passed, bit
 * for bit; D = 64's forward was wrong from its second key tile on, a ptxas register reuse of Q's
 * A fragments (found afterwards in the SASS; Q is now read from shared memory, see scores_wg;
 * not yet run on a GPU). Then the whole
 * head dim went off; now a failing forward no longer takes dQ and dK/dV off with it. */
enum { WG_FWD = 0, WG_DQ = 1, WG_DKV = 2 };
static int wg_state[2][3];   /* by head dim (64, 128) and kernel: 0 not decided, 1 on, -1 off */
static char wg_why[2][400] = {"not decided yet (decided at the first fused attention with D = 64)",
                              "not decided yet (decided at the first fused attention with D = 128)"};

/* ULY_CUDA_ATTN_DQ=64: the dQ kernel's wgmma variant with 64-key tiles at D = 64 (see
 * fa_backward_dq; bench/gpu.lua times it beside the default 32) */
static int dq_key_tile(int D) {
    const char *env = getenv("ULY_CUDA_ATTN_DQ");
    return D == 64 && env && !strcmp(env, "64") ? 64 : 32;
}

template <int D, bool WG, int KT>
static void launch_dq_kt(int64_t blocks, float *dq, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                         const bf16 *dout, const float *lse, const float *delta, int *ran) {
    const size_t smem = backward_smem_bytes<D, false, KT>() + (WG ? 1024 : 0);   /* WG: room to align the tiles */
    cudaError_t e = cudaFuncSetAttribute(fa_backward_dq<D, WG, KT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) { uly_cu_fail("fused flash attention backward (dQ): shared memory", e); return; }
    char name[64] = "";   /* for the profiler */
    if (uly_cu_prof_on)
        snprintf(name, sizeof name, "attention backward dQ D %d%s%s", D, WG ? " wgmma" : "", KT == 64 ? " (64-key tiles)" : "");
    ULY_LAUNCH_SMEM_AS(name, (fa_backward_dq<D, WG, KT>), blocks, FA_THREADS, smem, uly_cu_stream)(dq, g, q, k, v, dout,
                                                                                                  lse, delta, ran);
}
template <int D, bool WG>
static void launch_dq(int64_t blocks, float *dq, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                      const bf16 *dout, const float *lse, const float *delta, int *ran) {
    if constexpr (WG && D == 64) {
        if (dq_key_tile(D) == 64) {
            launch_dq_kt<D, WG, 64>(blocks, dq, g, q, k, v, dout, lse, delta, ran);
            return;
        }
    }
    launch_dq_kt<D, WG, 32>(blocks, dq, g, q, k, v, dout, lse, delta, ran);
}

/* ULY_CUDA_ATTN_DKV=64: the dK/dV kernel's wgmma variant with 64-query tiles at D = 64 (see
 * fa_backward_dkv; bench/gpu.lua times it beside the default 32) */
static int dkv_query_tile(int D) {
    const char *env = getenv("ULY_CUDA_ATTN_DKV");
    return D == 64 && env && !strcmp(env, "64") ? 64 : 32;
}

template <int D, bool WG, bool DQ = false, int QT = 32>
static void launch_dkv_qt(int64_t blocks, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k,
                          const bf16 *v, const bf16 *dout, const float *lse, const float *delta, int *ran, float *dq) {
    const size_t smem = backward_smem_bytes<D, DQ, QT>() + dkv_stats_bytes(QT) + (WG ? 1024 : 0);   /* WG: room to align */
    cudaError_t e = cudaFuncSetAttribute(fa_backward_dkv<D, WG, DQ, QT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) { uly_cu_fail("fused flash attention backward (dK, dV): shared memory", e); return; }
    char name[80] = "";   /* for the profiler */
    if (uly_cu_prof_on)
        snprintf(name, sizeof name, "attention backward dK dV%s D %d%s%s", DQ ? " dQ (one pass)" : "", D, WG ? " wgmma" : "",
                 QT == 64 ? " (64-query tiles)" : "");
    ULY_LAUNCH_SMEM_AS(name, (fa_backward_dkv<D, WG, DQ, QT>), blocks, FA_THREADS, smem, uly_cu_stream)(
        dk, dv, g, q, k, v, dout, lse, delta, ran, dq);
}
template <int D, bool WG, bool DQ = false>
static void launch_dkv(int64_t blocks, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                       const bf16 *dout, const float *lse, const float *delta, int *ran, float *dq = NULL) {
    if constexpr (WG && !DQ && D == 64) {
        if (dkv_query_tile(D) == 64) {
            launch_dkv_qt<D, WG, DQ, 64>(blocks, dk, dv, g, q, k, v, dout, lse, delta, ran, dq);
            return;
        }
    }
    launch_dkv_qt<D, WG, DQ, 32>(blocks, dk, dv, g, q, k, v, dout, lse, delta, ran, dq);
}

/* the largest |a - b| over n values and the largest |a|, NaN counted as a difference */
static void differ(const float *a, const float *b, size_t n, float *worst, float *big) {
    for (size_t i = 0; i < n; i++) {
        *big = fmaxf(*big, fabsf(a[i]));
        float d = fabsf(a[i] - b[i]);
        if (!(d <= *worst)) *worst = d;
    }
}

/* the forward, dQ and dK / dV on a small causal GQA problem through the mma.sync and the wgmma
 * kernels */
template <int D>
static void wgmma_selfcheck(char *why, size_t nwhy, int ok[3]) {
    geom g;
    memset(&g, 0, sizeof g);
    g.B = 1; g.Tq = g.Tk = 160; g.H = 2; g.Hkv = 1; g.D = D; g.scale = 1.0f / sqrtf((float)D);
    g.causal = 1; g.left = g.right = -1;
    const size_t nq = (size_t)g.Tq * g.H * D, nkv = (size_t)g.Tk * g.Hkv * D, nl = (size_t)g.H * g.Tq;
    const size_t nin = 2 * nq + 2 * nkv;                      /* q, k, v, dO (bf16) */
    const size_t ng = 2 * nq + 4 * nkv;                       /* dq, dk, dv twice: accumulated from 0 */
    const size_t nf = 2 * (nq + nl) + nl + ng;                /* o, lse twice; delta; the gradients (f32) */
    bf16 *hin = (bf16 *)malloc(nin * sizeof(bf16));
    float *hf = (float *)malloc(nf * sizeof(float));
    void *dmem = NULL;
    cudaError_t e = hin && hf ? cudaMalloc(&dmem, nin * sizeof(bf16) + nf * sizeof(float) + 3 * sizeof(int))
                              : cudaErrorMemoryAllocation;
    ok[WG_FWD] = ok[WG_DQ] = ok[WG_DKV] = 0;
    if (e == cudaSuccess) {
        uint32_t x = 12345;
        for (size_t i = 0; i < nin; i++) {
            x = x * 1664525u + 1013904223u;
            hin[i] = __float2bfloat16_rn(((float)(x >> 8) / 16777216.0f - 0.5f) * 2.0f);
        }
        bf16 *dq_in = (bf16 *)dmem, *dk = dq_in + nq, *dv = dk + nkv, *ddo = dv + nkv;
        float *o1 = (float *)(ddo + nq), *l1 = o1 + nq, *o2 = l1 + nl, *l2 = o2 + nq, *delta = l2 + nl;
        float *g1 = delta + nl, *g2 = g1 + nq, *k1 = g2 + nq, *v1 = k1 + nkv, *k2 = v1 + nkv, *v2 = k2 + nkv;
        int *ran = (int *)(v2 + nkv), ran_h[3] = {0, 0, 0};
        const int64_t blocks = (g.Tq + 63) / 64 * g.H;
        e = cudaMemcpy(dq_in, hin, nin * sizeof(bf16), cudaMemcpyHostToDevice);
        if (e == cudaSuccess) e = cudaMemcpy(ran, ran_h, sizeof ran_h, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) {
            launch_forward<D, false, false>(blocks, o1, l1, g, dq_in, dk, dv, 1, NULL, NULL, NULL);
            launch_forward<D, false, true>(blocks, o2, l2, g, dq_in, dk, dv, 1, NULL, NULL, ran);
            e = cudaDeviceSynchronize();
        }
        if (e == cudaSuccess) e = cudaMemcpy(hf, o1, 2 * (nq + nl) * sizeof(float), cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) {   /* delta = rowsum(dO * O), O from the mma.sync forward; dq from 0 */
            float *hdelta = hf + 2 * (nq + nl), *hzero = hdelta + nl;
            for (int64_t h = 0; h < g.H; h++)
                for (int64_t i = 0; i < g.Tq; i++) {
                    float sum = 0.0f;
                    for (int64_t d = 0; d < D; d++) {
                        size_t at = ((size_t)i * g.H + h) * D + d;
                        sum += __bfloat162float(hin[2 * nkv + nq + at]) * hf[at];
                    }
                    hdelta[h * g.Tq + i] = sum;
                }
            memset(hzero, 0, ng * sizeof(float));
            e = cudaMemcpy(delta, hdelta, (nl + ng) * sizeof(float), cudaMemcpyHostToDevice);
        }
        if (e == cudaSuccess) {
            launch_dq<D, false>(blocks, g1, g, dq_in, dk, dv, ddo, l1, delta, NULL);
            launch_dq<D, true>(blocks, g2, g, dq_in, dk, dv, ddo, l1, delta, ran + 1);
            const int64_t kblocks = (g.Tk + 63) / 64 * g.Hkv;
            launch_dkv<D, false>(kblocks, k1, v1, g, dq_in, dk, dv, ddo, l1, delta, NULL);
            launch_dkv<D, true>(kblocks, k2, v2, g, dq_in, dk, dv, ddo, l1, delta, ran + 2);
            e = cudaDeviceSynchronize();
        }
        if (e == cudaSuccess) e = cudaMemcpy(hf, o1, nf * sizeof(float), cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) e = cudaMemcpy(ran_h, ran, sizeof ran_h, cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) {
            float fw = 0.0f, fbig = 0.0f, bw = 0.0f, bbig = 0.0f, kw = 0.0f, kbig = 0.0f;
            const float *grads = hf + 2 * (nq + nl) + nl;
            differ(hf, hf + nq + nl, nq + nl, &fw, &fbig);                     /* o, lse */
            differ(grads, grads + nq, nq, &bw, &bbig);                           /* dq */
            differ(grads + 2 * nq, grads + 2 * nq + 2 * nkv, 2 * nkv, &kw, &kbig);   /* dk, dv */
#ifdef ULY_CUDA_EMU
            /* where every kernel agrees (the emulator), ULY_EMU_WGMMA_FAULT=forward,dq,dkv makes the
             * named ones disagree, so the specs see a kernel turned off without the others */
            const char *fault = getenv("ULY_EMU_WGMMA_FAULT");
            if (fault && strstr(fault, "forward")) fw = 1.0f;
            if (fault && strstr(fault, "dq")) bw = 1.0f;
            if (fault && strstr(fault, "dkv")) kw = 1.0f;
#endif
            static const char *name[3] = {"forward", "dQ", "dK/dV"};
            const float worst[3] = {fw, bw, kw}, big[3] = {fbig, bbig, kbig};
            int n_on = 0;
            for (int k = 0; k < 3; k++) {
                ok[k] = ran_h[k] && worst[k] <= 2e-3f * fmaxf(big[k], 1.0f);
                n_on += ok[k];
            }
            if (!ran_h[0] || !ran_h[1] || !ran_h[2]) {
                snprintf(why, nwhy, "off: the loaded kernels have no wgmma (not the sm_90a build)");
                ok[WG_FWD] = ok[WG_DQ] = ok[WG_DKV] = 0;
            } else if (n_on == 3) {
                snprintf(why, nwhy, "on (self-check: forward within %g, dQ within %g, dK/dV within %g of mma.sync)", fw,
                         bw, kw);
            } else {   /* "off: ..." or "partly on: ...": each kernel's verdict */
                size_t at = (size_t)snprintf(why, nwhy, "%s:", n_on ? "partly on" : "off");
                for (int k = 0; k < 3 && at < nwhy; k++)
                    at += (size_t)snprintf(why + at, nwhy - at, ok[k] ? "%s %s on (within %g)" :
                                           "%s %s off (the self-check's differs from mma.sync by %g, largest value %g)",
                                           k ? ";" : "", name[k], worst[k], big[k]);
            }
        }
    }
    if (e != cudaSuccess) {
        snprintf(why, nwhy, "off: the self-check failed to run: %s", cudaGetErrorString(e));
        cudaGetLastError();
    }
    if (dmem) cudaFree(dmem);
    free(hin);
    free(hf);
}

/* whether `kernel` (WG_FWD, WG_DQ, WG_DKV) at head dim D runs its wgmma build */
static int use_wgmma(int D, int kernel) {
    if (D != 64 && D != 128) return 0;
    const char *env = getenv("ULY_CUDA_ATTN_WGMMA");
    if (env && !strcmp(env, "0")) return 0;
    if (env && !strcmp(env, "1")) return 1;
    const int at = D == 128;
    if (wg_state[at][kernel]) return wg_state[at][kernel] > 0;
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev)) {
        cudaGetLastError();
        major = 0;
    }
    if (major != 9 || minor != 0) {
        snprintf(wg_why[at], sizeof wg_why[at], "off: compute capability %d.%d (wgmma needs 9.0)", major, minor);
        wg_state[at][WG_FWD] = wg_state[at][WG_DQ] = wg_state[at][WG_DKV] = -1;
        return 0;
    }
    int ok[3];
    if (D == 64) wgmma_selfcheck<64>(wg_why[at], sizeof wg_why[at], ok);
    else wgmma_selfcheck<128>(wg_why[at], sizeof wg_why[at], ok);
    for (int k = 0; k < 3; k++) wg_state[at][k] = ok[k] ? 1 : -1;
    return ok[kernel];
}

extern "C" const char *uly_cuda_wgmma_status(int D) {
    if (D != 64 && D != 128) return "off: head dims other than 64 and 128 have no wgmma kernels";
    const char *env = getenv("ULY_CUDA_ATTN_WGMMA");
    if (env && !strcmp(env, "0")) return "off (ULY_CUDA_ATTN_WGMMA=0)";
    if (env && !strcmp(env, "1")) return "on (ULY_CUDA_ATTN_WGMMA=1, no self-check)";
    return wg_why[D == 128];
}

/* ULY_CUDA_ATTN_FWD=pipelined: the wgmma forward issues the next tile's S before this tile's
 * softmax (fa_forward's PIPE); unset: one tile at a time. bench/gpu.lua times both. */
static int forward_pipelined(void) {
    const char *env = getenv("ULY_CUDA_ATTN_FWD");
    return env && !strcmp(env, "pipelined");
}

template <int D>
static int forward_d(float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v) {
    const int grouped = forward_grouped(g), wg = use_wgmma(D, WG_FWD);
    int64_t blocks = grouped ? g.B * g.Hkv : (g.Tq + 63) / 64 * g.B * g.H;
    const int splits = forward_splits(g, blocks);
    float *part = NULL;
    if (splits > 1) {
        const size_t floats = (size_t)splits * g.B * g.H * g.Tq * (D + 1);
        cudaError_t e = cudaMallocAsync((void **)&part, floats * sizeof(float), uly_cu_stream);
        if (e != cudaSuccess) { uly_cu_fail("fused flash attention forward: split partials", e); return -1; }
    }
    float *part_lse = part ? part + (size_t)splits * g.B * g.H * g.Tq * D : NULL;
    /* grouped: its own kernels, the packed tile's index arithmetic costs the other registers */
    if (wg && forward_pipelined()) {
        if (grouped) launch_forward<D, true, true, true>(blocks * splits, out, lse, g, q, k, v, splits, part, part_lse, NULL);
        else launch_forward<D, false, true, true>(blocks * splits, out, lse, g, q, k, v, splits, part, part_lse, NULL);
    } else if (grouped && wg) launch_forward<D, true, true>(blocks * splits, out, lse, g, q, k, v, splits, part, part_lse, NULL);
    else if (grouped) launch_forward<D, true, false>(blocks * splits, out, lse, g, q, k, v, splits, part, part_lse, NULL);
    else if (wg) launch_forward<D, false, true>(blocks * splits, out, lse, g, q, k, v, splits, part, part_lse, NULL);
    else launch_forward<D, false, false>(blocks * splits, out, lse, g, q, k, v, splits, part, part_lse, NULL);
    if (launched("fused flash attention forward")) { if (part) cudaFreeAsync(part, uly_cu_stream); return -1; }
    if (splits > 1) {
        int64_t n = g.B * g.H * g.Tq * D;
        ULY_LAUNCH(fa_combine, uly_cu_blocks(n, 256), 256, uly_cu_stream)(out, lse, g, D, splits, part, part_lse);
        cudaFreeAsync(part, uly_cu_stream);
        return launched("fused flash attention forward (combining key splits)");
    }
    return 0;
}

/* ULY_CUDA_ATTN_BWD=onepass: dQ from the dK/dV kernel's own dS, added with atomics (D = 32, 64;
 * at 128 its registers would spill): 5 tile products per (key, query) tile pair instead of 8,
 * but dQ's sum is in no fixed order, so its last bits vary from run to run. Unset or 'twopass':
 * the deterministic two kernels. bench/gpu.lua times both. */
static int backward_onepass(int D) {
    const char *env = getenv("ULY_CUDA_ATTN_BWD");
    return env && !strcmp(env, "onepass") && D <= 64;
}

template <int D>
static int backward_d(float *dq, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                      const bf16 *dout, const float *lse, const float *delta) {
    if constexpr (D <= 64) {
        if (dq && backward_onepass(D)) {
            int64_t blocks = (g.Tk + 63) / 64 * g.B * g.Hkv;
            if (use_wgmma(D, WG_DKV)) launch_dkv<D, true, true>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL, dq);
            else launch_dkv<D, false, true>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL, dq);
            return launched("fused flash attention backward (one pass: dQ, dK, dV)");
        }
    }
    if (dk || dv) {
        int64_t blocks = (g.Tk + 63) / 64 * g.B * g.Hkv;
        if (use_wgmma(D, WG_DKV)) launch_dkv<D, true>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL);
        else launch_dkv<D, false>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL);
        if (launched("fused flash attention backward (dK, dV)")) return -1;
    }
    if (dq) {
        int64_t blocks = (g.Tq + 63) / 64 * g.B * g.H;
        if (use_wgmma(D, WG_DQ)) launch_dq<D, true>(blocks, dq, g, q, k, v, dout, lse, delta, NULL);
        else launch_dq<D, false>(blocks, dq, g, q, k, v, dout, lse, delta, NULL);
        if (launched("fused flash attention backward (dQ)")) return -1;
    }
    return 0;
}

int uly_cu_fused_attention_forward(float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k,
                                   const bf16 *v) {
    switch (g.D) {
    case 32: return forward_d<32>(out, lse, g, q, k, v);
    case 64: return forward_d<64>(out, lse, g, q, k, v);
    case 128: return forward_d<128>(out, lse, g, q, k, v);
    default: uly_cu_fail_msg("fused flash attention forward", "head dim not 32, 64 or 128"); return -1;
    }
}

int uly_cu_fused_attention_backward(float *dq, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k,
                                    const bf16 *v, const bf16 *dout, const float *lse, const float *delta) {
    switch (g.D) {
    case 32: return backward_d<32>(dq, dk, dv, g, q, k, v, dout, lse, delta);
    case 64: return backward_d<64>(dq, dk, dv, g, q, k, v, dout, lse, delta);
    case 128: return backward_d<128>(dq, dk, dv, g, q, k, v, dout, lse, delta);
    default: uly_cu_fail_msg("fused flash attention backward", "head dim not 32, 64 or 128"); return -1;
    }
}
