/* kernels/cuda/attention_forward.cuh — the fused attention forward (mma.sync, wgmma, and the
 * pipelined wgmma variant) and the merge of split key bands (flash-decoding); see
 * attention_fused.cu for the design and the host side that launches them. */
#pragma once
#include "attention_tiles.cuh"
#include "tma.cuh"

/* ---- forward ---- */
/* a warp's rows before their first key tile: O = 0, running max -inf and sum 0 (its two rows) */
template <int CH>
__device__ static inline void start_online_softmax(float o[CH][4], float m[2], float l[2]) {
#pragma unroll
    for (int n = 0; n < CH; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
}

/* S = Q K^T for the warpgroup's 64 x 64 tile on wgmma, queued and committed (the caller waits):
 * A (Q) and B (K) both from shared memory in the wgmma layout (K-major, 16 of D an instruction),
 * the first with scale-d 0 (no zeroed accumulators). Q was A from registers, loaded once before
 * the loop; ptxas (CUDA 13.0, sm_90a) then gave those registers to P's bf16 fragments inside the
 * loop at D = 64, so from the second key tile on S was P K^T (the wrong numbers an H200 showed,
 * 2026-12-04; seen in the SASS). Reloading them every tile fixed that at the cost of KS ldmatrix
 * and their addresses; from shared memory nothing of Q is in registers at all, and the bytes
 * read are the same as the reload's. */
template <int KS, int N = 64>
__device__ static inline void scores_wg(float s[N / 8][4], const uint4 *sQ, const uint4 *kt) {
    static_assert(N == 64 || N == 128, "scores_wg: key tiles of 64 or 128");
    const uint32_t dq = wg_desc_lo(sQ), dk = wg_desc_lo(kt);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        /* 32 bytes of D per instruction in the 128-byte lines of atom column kk / 4: Q's 64-row
         * atom columns 8 KiB apart, K's N rows x 128 bytes */
        const uint32_t at = (kk & 3) * 32, q_off = (kk >> 2) * 8192 + at, k_off = (kk >> 2) * (N * 128) + at;
        if constexpr (N == 128) {
            if (kk == 0) wgmma_64x128_ss<0>(&s[0][0], wg_desc_at(dq, 0), wg_desc_at(dk, 0));
            else wgmma_64x128_ss<1>(&s[0][0], wg_desc_at(dq, q_off), wg_desc_at(dk, k_off));
        } else {
            if (kk == 0) wgmma_64x64_ss<0, 0>(&s[0][0], wg_desc_at(dq, 0), wg_desc_at(dk, 0));
            else wgmma_64x64_ss<0, 1>(&s[0][0], wg_desc_at(dq, q_off), wg_desc_at(dk, k_off));
        }
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

/* O's two rows times alpha[0] and alpha[1] (a moved max) */
template <int D>
__device__ static inline void rescale_o(float o[D / 8][4], const float alpha[2]) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
        o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }
}

/* p0 + p1 as the bf16 values P V multiplies (P's A fragments round them the same way) */
__device__ static inline float sum_as_bf16(float p0, float p1) {
    const uint32_t w = mma_pack_bf16(p0, p1);
    return __uint_as_float(w << 16) + __uint_as_float(w & 0xffff0000u);
}

/* one key tile's step of the online softmax for this lane's two rows: s (the tile's NT n8
 * tiles of scores, 8 NT keys, accumulator layout) becomes P = exp(s scale - m) with masked pairs
 * at 0 (st: the tile's state), and the row sums l add P as rounded to bf16 (sum_as_bf16): l
 * sums exactly the weights P V multiplies, so O = sum P V / l is a weighted mean of
 * V's rows. (Summing the unrounded P scaled O by a row's rounding: where one key dominates a row,
 * O was off by up to 2^-9 of that key's V, and dQ, whose delta = dO . O then disagrees with the
 * backward's own P, by far more: a spec saw 35 % of a row's dQ.) When a row of the warp has
 * scores more than RESCALE_SLACK above its max, every row's max moves to its new one, with its
 * sum l and O rescaled (one branch for the warp).
 * DEFER: O is left alone (a P V may still be adding into it); whether it is to be rescaled is
 * returned (the same for the warp), and by what in alpha */
template <int D, bool grouped, bool DEFER = false, int NT = 8>
__device__ static inline bool online_softmax(float s[][4], float o[D / 8][4], float m[2], float l[2], const geom &g,
                                             int64_t b, const int64_t rows[2], int64_t j0, int st, int tq,
                                             float *alpha_out = nullptr) {
    if (st == TILE_MASKED) mask_scores<NT, grouped>(s, g, b, rows, j0, tq);
    float mx[2] = {-INFINITY, -INFINITY};   /* the raw scores' max: scale > 0 keeps the order */
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float mt[2];   /* the tile's max per row, scaled; -inf where it sees nothing */
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mt[r] = quad_max(mx[r]) * g.scale;
        grow |= mt[r] > m[r] + RESCALE_SLACK;   /* a row's first visible scores (m = -inf) too */
    }
    const bool grew = __any_sync(0xffffffffu, grow);
    if (grew) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float mn = fmaxf(m[r], mt[r]);            /* -inf stays -inf */
            alpha[r] = mn == -INFINITY ? 1.0f : __expf(m[r] - mn);   /* 0 from -inf: O and l were 0 */
            m[r] = mn;
            l[r] *= alpha[r];
        }
        if constexpr (DEFER) {
            alpha_out[0] = alpha[0];
            alpha_out[1] = alpha[1];
        } else {
            rescale_o<D>(o, alpha);
        }
    }
    float nb2[2];   /* -m in log2 units: exp(x scale - m) = 2^(x scale log2e - m log2e) */
#pragma unroll
    for (int r = 0; r < 2; r++) nb2[r] = m[r] == -INFINITY ? 0.0f : -m[r] * LOG2E_F;   /* nothing visible yet: P = 0 */
    const float sl2 = g.scale * LOG2E_F;
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {   /* masked: -inf -> 0 */
            const float p0 = exp2_ftz(fmaf(s[n][2 * r], sl2, nb2[r])), p1 = exp2_ftz(fmaf(s[n][2 * r + 1], sl2, nb2[r]));
            s[n][2 * r] = p0;
            s[n][2 * r + 1] = p1;
            l[r] += sum_as_bf16(p0, p1);
        }
    return grew;
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

/* a forward's end: this lane's two rows of O divided by their sums, and their log-sum-exp (-inf,
 * with O = 0, for a row that saw no key); rows past the last (grouped: -1) are skipped;
 * head_of(r): row r's query head. Every lane takes part in the sums' shuffles. */
template <int D, bool grouped, typename HeadOf>
__device__ static inline void store_forward_rows(float *out, float *lse, const geom &g, int64_t b, const int64_t rows[2],
                                                 float o[D / 8][4], const float m[2], const float l[2], int tq,
                                                 HeadOf head_of) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = quad_sum(l[r]);
        const int64_t i = rows[r], hr = head_of(r);
        if (grouped ? i < 0 : i >= g.Tq) continue;
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        float *dst = out + ((b * g.Tq + i) * g.H + hr) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            dst[n * 8] = o[n][2 * r] * inv;
            dst[n * 8 + 1] = o[n][2 * r + 1] * inv;
        }
        if (tq == 0) lse[(b * g.H + hr) * g.Tq + i] = sum > 0.0f ? m[r] + logf(sum) : -INFINITY;
    }
}

/* a wgmma forward's tile up to P: S = Q K^T (kt: this tile's K), waited for, then the online
 * softmax step (st: the tile's state for these rows) */
template <int D, bool grouped>
__device__ static inline void scores_softmax_wg(float s[8][4], const uint4 *sQ, const uint4 *kt, float o[D / 8][4],
                                                float m[2], float l[2], const geom &g, int64_t b, const int64_t rows[2],
                                                int64_t j0, int st, int tq) {
    scores_wg<D / 16>(s, sQ, kt);
    wg_wait<0>();
    wg_fence_regs(&s[0][0], 32);
    online_softmax<D, grouped>(s, o, m, l, g, b, rows, j0, st, tq);
}

/* this tile's V has landed for every thread (the next K may still be in flight) */
__device__ static inline void this_v_landed() {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
}

/* the end of a wgmma forward's tile (K double-buffered): wait for the next K, a barrier (every
 * warp is done with V and this K, and the next K landed for all), the next V queued by the THREADS
 * threads, and on to the next tile: j0, st become j_next's, the K buffers swap */
template <int D, int THREADS>
__device__ static inline void next_tile_wg(uint4 *sV, const bf16 *v, int64_t Tk, int64_t ks, int64_t j_next, int st_next,
                                           int64_t &j0, int &st, uint4 *&k_this, uint4 *&k_next) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (j_next >= 0) load_tile_async<D, 64, true, THREADS>(sV, v, j_next, Tk, ks);
    cp_async_commit();
    j0 = j_next;
    st = st_next;
    uint4 *const t = k_this;
    k_this = k_next;
    k_next = t;
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
    float o[CH][4], m[2], l[2];
    start_online_softmax<CH>(o, m, l);
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
            scores_softmax_wg<D, grouped>(s, sQ, k_this, o, m, l, g, b, rows, j0, st, tq);
            this_v_landed();
            times_tile_wg_waited<D, 4, 64>(o, s, sV);   /* O += P V */
            next_tile_wg<D, FA_THREADS>(sV, v, g.Tk, ks, j_next, st_next, j0, st, k_this, k_next);
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
    store_forward_rows<D, grouped>(out, lse, g, b, rows, o, m, l, tq, [&](int r) {   /* row r's query head */
        return grouped ? hk * grp + (int)(t0 + 8 * r) / (int)g.Tq : h;
    });
}

/* The wgmma forward with 128 query rows a block (ULY_CUDA_ATTN_FWD=rows128): two warpgroups, each
 * the one-warpgroup kernel's 64 rows (fa_forward's W path, unpipelined), sharing every K and V
 * tile, so a tile is loaded, and written into shared memory, once per 128 rows instead of once per
 * 64: half the cp.async traffic per FLOP (at D = 64 about 40 % of a tile's shared-memory bytes).
 * The block walks the key tiles of its 128 rows' band; a warpgroup skips the math of a tile none of
 * its rows see (on the causal diagonal, the first warpgroup's last tile) but keeps to the barriers.
 * Without a band's split over blocks and without GQA packing (decoding keeps fa_forward). In a
 * compilation pass without wgmma it is empty (the launcher never picks it there). */
template <int D>
__global__ static void __launch_bounds__(2 * FA_THREADS, ROWS128_MIN_BLOCKS(D))
fa_forward_rows128(float *out, float *lse, geom g, const bf16 *Q, const bf16 *K, const bf16 *V, int *ran_wgmma) {
#if ULY_HAS_WGMMA
    constexpr int CH = D / 8;
    ULY_DYNAMIC_SHARED(uint4, dyn);
    uint4 *const sK = align_1024(dyn), *const sV = sK + 64 * CH, *const sQ0 = sV + 64 * CH;
    uint4 *const sK2 = sQ0 + 128 * CH;   /* K's second buffer; Q is two 64-row tiles, one per warpgroup */
    if (ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    const int64_t blk = blockIdx.x, grp = g.H / g.Hkv;
    const int64_t nt = (g.Tq + 127) / 128, tile = nt - 1 - blk % nt, bh = blk / nt;   /* longest bands first */
    const int64_t b = bh / g.H, h = bh % g.H, hk = h / grp, i0 = tile * 128;
    const int64_t qs = g.H * D, ks = g.Hkv * D;
    const bf16 *q = Q + b * g.Tq * qs + h * D, *k = K + b * g.Tk * ks + hk * D, *v = V + b * g.Tk * ks + hk * D;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t w0 = i0 + 64 * wg;    /* this warpgroup's first row */
    uint4 *const sQ = sQ0 + wg * 64 * CH;
    const int64_t t0 = w0 + warp * 16 + (lane >> 2);
    const int64_t rows[2] = {t0, t0 + 8};
    int64_t lo, hi;
    chunk_band(g, i0, i0 + 128 < g.Tq ? i0 + 128 : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, i0, i0 + 127), rw = span_of_rows(g, w0, w0 + 63);
    int st = TILE_EMPTY;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / 64 * 64, hi, 64, &st) : -1;
    float o[CH][4], m[2], l[2];
    start_online_softmax<CH>(o, m, l);
    /* cp.async groups as fa_forward's W path: [Q + K(j0)], [V(j0)]; then at a tile's top K(next),
     * after its second barrier V(next) */
    load_tile_async<D, 64, true, FA_THREADS, true>(sQ, q, w0, g.Tq, qs);   /* each warpgroup its own rows */
    if (j0 >= 0) load_tile_async<D, 64, true, 2 * FA_THREADS>(sK, k, j0, g.Tk, ks);
    cp_async_commit();
    if (j0 >= 0) load_tile_async<D, 64, true, 2 * FA_THREADS>(sV, v, j0, g.Tk, ks);
    cp_async_commit();
    cp_async_wait<1>();   /* Q and K(j0) */
    fence_proxy_async();
    __syncthreads();
    uint4 *k_this = sK, *k_next = sK2;
    while (j0 >= 0) {
        int st_next = TILE_EMPTY;
        const int64_t j_next = next_key_tile(g, rs, j0 + 64, hi, 64, &st_next);
        if (j_next >= 0) load_tile_async<D, 64, true, 2 * FA_THREADS>(k_next, k, j_next, g.Tk, ks);
        cp_async_commit();
        const int mine = wg_tile_state<64>(g, rw, st, j0);   /* the same for the whole warpgroup */
        float s[8][4];
        if (mine != TILE_EMPTY) scores_softmax_wg<D, false>(s, sQ, k_this, o, m, l, g, b, rows, j0, mine, tq);
        this_v_landed();
        if (mine != TILE_EMPTY) times_tile_wg_waited<D, 4, 64>(o, s, sV);   /* O += P V */
        next_tile_wg<D, 2 * FA_THREADS>(sV, v, g.Tk, ks, j_next, st_next, j0, st, k_this, k_next);
    }
    cp_async_wait<0>();
    store_forward_rows<D, false>(out, lse, g, b, rows, o, m, l, tq, [&](int) { return h; });
#endif
}

/* The wgmma forward with its tiles loaded by TMA (ULY_CUDA_ATTN_FWD=tma): fa_forward's W path (64
 * rows, one warpgroup, K double-buffered), but thread 0 issues each tile's load as D / 64 TMA
 * boxes (64 rows x 128 bytes of one head) and the warps wait on an mbarrier per buffer, where they
 * queued ~D / 2 cp.async copies each and waited for their groups: one barrier a tile instead of
 * two, no load instructions in the loop but thread 0's, no fence between the loads and wgmma
 * (both are the async proxy). Maps: Q, K, V as [B, T, heads, D] bf16 (tile_map in
 * attention_fused.cu). Without key splits or GQA packing; empty in a pass without wgmma. */
template <int D>
__global__ static void __launch_bounds__(FA_THREADS, WG_MIN_BLOCKS(true, D))
fa_forward_tma(float *out, float *lse, geom g, const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
               const __grid_constant__ CUtensorMap mv, int *ran_wgmma) {
#if ULY_HAS_WGMMA
    constexpr int CH = D / 8;
    constexpr unsigned TILE = 64 * D * 2;   /* bytes of a 64-row tile */
    ULY_DYNAMIC_SHARED(uint4, dyn);
    uint4 *const sK = align_1024(dyn), *const sV = sK + 64 * CH, *const sQ = sV + 64 * CH, *const sK2 = sQ + 64 * CH;
    uint64_t *const bar = (uint64_t *)(sK2 + 64 * CH);   /* K's two buffers' (the first's also Q's), V's */
    if (ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    const int64_t blk = blockIdx.x, grp = g.H / g.Hkv;
    const int64_t nt = (g.Tq + 63) / 64, tile = nt - 1 - blk % nt, bh = blk / nt;   /* longest bands first */
    const int64_t b = bh / g.H, h = bh % g.H, hk = h / grp, i0 = tile * 64;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t t0 = i0 + warp * 16 + (lane >> 2);
    const int64_t rows[2] = {t0, t0 + 8};
    int64_t lo, hi;
    chunk_band(g, i0, i0 + 64 < g.Tq ? i0 + 64 : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, i0, i0 + 63);
    int st = TILE_EMPTY;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / 64 * 64, hi, 64, &st) : -1;
    float o[CH][4], m[2], l[2];
    start_online_softmax<CH>(o, m, l);
    const bool issuer = threadIdx.x == 0;
    auto load = [&](uint4 *s, const CUtensorMap *mp, int64_t hd, int64_t r0, uint64_t *br) { tma_tile<D>(s, mp, hd, r0, b, br); };
    if (issuer) {
        for (int i = 0; i < 3; i++) mbar_init(&bar[i], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (issuer && j0 >= 0) {
        mbar_expect_tx(&bar[0], 2 * TILE);
        load(sQ, &mq, h, i0, &bar[0]);
        load(sK, &mk, hk, j0, &bar[0]);
        mbar_expect_tx(&bar[2], TILE);
        load(sV, &mv, hk, j0, &bar[2]);
    }
    uint4 *k_this = sK, *k_next = sK2;
    unsigned kb = 0, phases = 0;   /* this tile's K buffer; bit i: the parity bar[i]'s next wait is for */
    while (j0 >= 0) {
        int st_next = TILE_EMPTY;
        const int64_t j_next = next_key_tile(g, rs, j0 + 64, hi, 64, &st_next);
        if (issuer && j_next >= 0) {   /* its buffer: every warp's S of the last tile was done by its barrier */
            mbar_expect_tx(&bar[kb ^ 1], TILE);
            load(k_next, &mk, hk, j_next, &bar[kb ^ 1]);
        }
        mbar_wait(&bar[kb], (phases >> kb) & 1);   /* this K (the first time with Q) */
        phases ^= 1u << kb;
        float s[8][4];
        scores_softmax_wg<D, false>(s, sQ, k_this, o, m, l, g, b, rows, j0, st, tq);
        mbar_wait(&bar[2], (phases >> 2) & 1);   /* this V */
        phases ^= 4u;
        times_tile_wg_waited<D, 4, 64>(o, s, sV);   /* O += P V */
        __syncthreads();   /* every warp is done with V and this K */
        if (issuer && j_next >= 0) {
            mbar_expect_tx(&bar[2], TILE);
            load(sV, &mv, hk, j_next, &bar[2]);
        }
        j0 = j_next;
        st = st_next;
        kb ^= 1;
        uint4 *const t = k_this;
        k_this = k_next;
        k_next = t;
    }
    store_forward_rows<D, false>(out, lse, g, b, rows, o, m, l, tq, [&](int) { return h; });
#endif
}

#if ULY_HAS_WGMMA
/* a warp-specialised block's mbarriers, made by thread 0 before the block's last barrier: per
 * stage of the ring full (one arrival, the producer's, and the stage's bytes) and empty (one
 * arrival from each of the 256 consumer threads), and `once` (one arrival and the bytes of the
 * tiles loaded once) */
template <int STAGES = WS_STAGES>
__device__ static inline void start_ws_ring(uint64_t *full, uint64_t *empty, uint64_t *once) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], 2 * FA_THREADS);
        }
        mbar_init(once, 1);
        mbar_init_fence();
    }
    __syncthreads();
}

/* a warp-specialised kernel's producer (one thread) over the key tiles of the rows rs from j0 (up
 * to key hi; next_key_tile's walk, KN keys a tile): each tile's K and V (KN rows each, by TMA:
 * the maps' boxes are KN rows) into stage n % STAGES of sKV, counted on full[stage], after
 * waiting for empty[stage] (both consumer warpgroups gave it back) from the second round of the
 * ring on */
template <int D, int STAGES = WS_STAGES, int KN = 64>
__device__ static inline void produce_kv_tiles(uint4 *sKV, uint64_t *full, uint64_t *empty, const CUtensorMap *mk,
                                               const CUtensorMap *mv, const geom &g, const row_span &rs, int64_t j0,
                                               int64_t hi, int64_t hk, int64_t b) {
    constexpr int CH = D / 8;
    constexpr unsigned TILE = KN * D * 2;   /* bytes of a KN-row tile */
    unsigned phases = 0;                    /* bit i: the parity empty[i]'s next wait is for */
    int st;
    for (int n = 0; j0 >= 0; n++) {
        const int at = n % STAGES;
        if (n >= STAGES) {   /* both consumers gave the stage back */
            mbar_wait(&empty[at], (phases >> at) & 1);
            phases ^= 1u << at;
        }
        uint4 *const kv = sKV + at * 2 * KN * CH;
        mbar_expect_tx(&full[at], 2 * TILE);
        tma_tile<D, KN>(kv, mk, hk, j0, b, &full[at]);
        tma_tile<D, KN>(kv + KN * CH, mv, hk, j0, b, &full[at]);
        j0 = next_key_tile(g, rs, j0 + KN, hi, KN, &st);
    }
}
#endif

/* FlashAttention-3's division of labour (ULY_CUDA_ATTN_FWD=ws): 128 query rows a block, two
 * consumer warpgroups of 64 rows doing the math (S, online softmax, P V on wgmma, as the 128-row
 * forward) and one producer warp whose first thread streams K and V by TMA through a ring of
 * WS_STAGES buffers: full[s] completes when stage s's tiles have landed, empty[s] when all 256
 * consumer threads are done with it. No block barrier in the loop: the producer runs up to
 * WS_STAGES tiles ahead, and a consumer warpgroup waits only for the data. Both consumers walk the
 * block's tiles, skipping the math of one none of their rows see (still waiting for it and giving
 * it back). Without key splits or GQA packing; empty in a pass without wgmma.
 * PP (ULY_CUDA_ATTN_FWD=wspp): FlashAttention-3's ping-pong: the consumers take turns issuing
 * their S (named barriers WS_TURN and WS_TURN + 1), so that one's softmax runs while the other's
 * products have the tensor cores. Warpgroup 1 gives warpgroup 0 the first turn, and warpgroup 0
 * takes warpgroup 1's last hand-over after the loop: each barrier gets as many arrivals as syncs.
 * (A hand-over outside the branch that issues and waits had ptxas serialise the wgmmas, C7518.)
 * OV (ULY_CUDA_ATTN_FWD=wsov, wsppov with PP): FlashAttention-3's intra-warpgroup overlap: a
 * consumer issues tile n's S and the previous tile's P V together, waits for S alone and runs
 * tile n's softmax while P V is on the tensor cores, then rescales O (when its max moved) once
 * P V is done. A stage's V is read a tile after its K, so a stage is given back a tile later
 * and the ring has WS_STAGES_OV stages (the producer keeps loading a tile ahead). P's fragments
 * held across the loop need more than the 168 registers a thread ptxas allows a 288-thread
 * block (D 128 spilled): the producer is a warpgroup then (WSG_THREADS) and setmaxnreg moves its
 * registers to the consumers. OV takes FlashAttention-3's tile, 128 keys (WS_KN_OV): S one
 * m64n128 wgmma per 16 of D (Q read once per 128 keys from shared memory, where two n64 read it
 * twice), the per-tile work (the stage's barriers, the rows' max and sum across the quad, the
 * walk) once per 128 keys; S, O and P take 64, D / 2 and 32 registers a thread (202 used at D 64,
 * 216 at D 128, no spills, nvcc 13.0; at D 128 that needs mbar_wait's trap out of line, see
 * tma.cuh). Its online softmax rounds differently from a 64-key tile's (a row's running max
 * moves at other keys), so it does not give the other forwards' bits: the specs compare it
 * within bf16's tolerance. */
#define WS_TURN 1
#define WS_STAGES_OV 3
#define WS_KN_OV 128
/* the forward ws kernels' shared memory: Q (128 rows), the ring's K and V (KN rows each), the
 * mbarriers, + 1 KiB to align the tiles; at most the 227 KiB an sm_90 block may have */
#define FWD_WS_SMEM(D, STAGES, KN) \
    ((size_t)(128 + 2 * (STAGES) * (KN)) * ((D) / 8) * 16 + 1024 + (2 * (STAGES) + 1) * 8)
static_assert(FWD_WS_SMEM(128, WS_STAGES_OV, WS_KN_OV) <= SM90_SMEM_MAX,
              "the overlapped forward's ring does not fit an sm_90 block's shared memory");
template <int D, bool PP = false, bool OV = false>
__global__ static void __launch_bounds__(OV ? WSG_THREADS : WS_THREADS, WS_MIN_BLOCKS(D))
fa_forward_ws(float *out, float *lse, geom g, const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
              const __grid_constant__ CUtensorMap mv, int *ran_wgmma) {
#if ULY_HAS_WGMMA
    constexpr int CH = D / 8, STAGES = OV ? WS_STAGES_OV : WS_STAGES, KN = OV ? WS_KN_OV : 64, NT = KN / 8;
    constexpr unsigned TILE = 64 * D * 2;   /* bytes of a 64-row tile */
    ULY_DYNAMIC_SHARED(uint4, dyn);
    /* Q as two 64-row tiles, then per stage K and V (KN rows each), then the mbarriers */
    uint4 *const sQ0 = align_1024(dyn), *const sKV = sQ0 + 128 * CH;
    uint64_t *const full = (uint64_t *)(sKV + STAGES * 2 * KN * CH), *const empty = full + STAGES,
                    *const qbar = empty + STAGES;
    if (ran_wgmma && blockIdx.x == 0 && threadIdx.x == 0) *ran_wgmma = 1;
    const int64_t blk = blockIdx.x, grp = g.H / g.Hkv;
    const int64_t nt = (g.Tq + 127) / 128, tile = nt - 1 - blk % nt, bh = blk / nt;   /* longest bands first */
    const int64_t b = bh / g.H, h = bh % g.H, hk = h / grp, i0 = tile * 128;
    int64_t lo, hi;
    chunk_band(g, i0, i0 + 128 < g.Tq ? i0 + 128 : g.Tq, &lo, &hi);
    const row_span rs = span_of_rows(g, i0, i0 + 127);
    int st = TILE_EMPTY;
    int64_t j0 = lo <= hi ? next_key_tile(g, rs, lo / KN * KN, hi, KN, &st) : -1;
    const int wg = threadIdx.x >> 7;   /* 0, 1: the consumers; 2: the producer warp (OV: warpgroup) */
    start_ws_ring<STAGES>(full, empty, qbar);   /* and the last block-wide barrier */
    if (wg == 2) {
        if (OV) regs_shrink_to<WSG_REGS_P>();
        if (threadIdx.x == 2 * FA_THREADS && j0 >= 0) {
            mbar_expect_tx(qbar, 2 * TILE);
            tma_tile<D>(sQ0, &mq, h, i0, b, qbar);
            tma_tile<D>(sQ0 + 64 * CH, &mq, h, i0 + 64, b, qbar);
            produce_kv_tiles<D, STAGES, KN>(sKV, full, empty, &mk, &mv, g, rs, j0, hi, hk, b);
        }
        return;
    }
    if (OV) regs_grow_to<WSG_REGS_C>();
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tq = lane & 3;
    const int64_t w0 = i0 + 64 * wg, t0 = w0 + warp * 16 + (lane >> 2);   /* this warpgroup's first row */
    const int64_t rows[2] = {t0, t0 + 8};
    const row_span rw = span_of_rows(g, w0, w0 + 63);
    const uint4 *const sQ = sQ0 + wg * 64 * CH;
    float o[CH][4], m[2], l[2];
    start_online_softmax<CH>(o, m, l);
    if (j0 >= 0) mbar_wait(qbar, 0);
    unsigned phases = 0;   /* bit i: the parity full[i]'s next wait is for */
    const bool started = j0 >= 0;
    if (PP && wg == 1 && started) named_bar_arrive(WS_TURN, 2 * FA_THREADS);   /* warpgroup 0 takes the first turn */
    /* tile n (at j0, state st): the walk's next tile into *j_next, *st_next, this warpgroup's view
     * of tile n into *mine (the same for the whole warpgroup); waits for its stage, returned */
    auto take_stage = [&](int n, int64_t *j_next, int *st_next, int *mine) {
        const int at = n % STAGES;
        *st_next = TILE_EMPTY;
        *j_next = next_key_tile(g, rs, j0 + KN, hi, KN, st_next);
        mbar_wait(&full[at], (phases >> at) & 1);
        phases ^= 1u << at;
        *mine = wg_tile_state<KN>(g, rw, st, j0);
        return at;
    };
    if constexpr (OV) {
        /* every tile issues S and the last tile's P V, and waits the same way, whatever its state:
         * a wgmma or its wait under a condition has ptxas serialise them all (C7520, C7518). So a
         * tile none of these rows sees is run as a masked one (P = 0), and the first tile's P V
         * multiplies its own V by a P of zeros (O stays 0) */
        constexpr int KT = KN / 16;   /* 16-key steps of P V */
        uint32_t pa[KT][4];           /* the last tile's P, bf16 A fragments */
#pragma unroll
        for (int kk = 0; kk < KT; kk++) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
        int prev = 0;        /* the stage whose V that P multiplies */
        for (int n = 0; j0 >= 0; n++) {
            int st_next, mine;
            int64_t j_next;
            const int at = take_stage(n, &j_next, &st_next, &mine);
            const uint4 *const kv = sKV + at * 2 * KN * CH;
            if (mine == TILE_EMPTY) mine = TILE_MASKED;
            if (PP) named_bar_sync(WS_TURN + wg, 2 * FA_THREADS);   /* this warpgroup's turn to issue */
            float s[NT][4];
            scores_wg<D / 16, KN>(s, sQ, kv);   /* S(n) */
            wg_fence();                         /* O += P(n-1) V(n-1), behind it */
            acc_times_tile_wg<D, KT, KN>(o, pa, sKV + (n ? prev : at) * 2 * KN * CH + KN * CH);
            wg_commit();
            if (PP) named_bar_arrive(WS_TURN + 1 - wg, 2 * FA_THREADS);   /* the other's turn */
            wg_wait<1>();                   /* S(n) alone */
            wg_fence_regs(&s[0][0], 4 * NT);
            float alpha[2];
            const bool grew = online_softmax<D, false, true, NT>(s, o, m, l, g, b, rows, j0, mine, tq, alpha);
            wg_wait<0>();                   /* P V done: O may be rescaled, and V(n-1)'s stage goes back */
            wg_fence_regs(&o[0][0], 4 * CH);
            if (n) mbar_arrive(&empty[prev]);
            if (grew) rescale_o<D>(o, alpha);
            acc_to_a_all<KT>(pa, s);
            prev = at;
            j0 = j_next;
            st = st_next;
        }
        if (started) {   /* the last tile's P V */
            wg_fence();
            acc_times_tile_wg<D, KT, KN>(o, pa, sKV + prev * 2 * KN * CH + KN * CH);
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(&o[0][0], 4 * CH);
            mbar_arrive(&empty[prev]);
        }
    } else {
        for (int n = 0; j0 >= 0; n++) {
            int st_next, mine;
            int64_t j_next;
            const int at = take_stage(n, &j_next, &st_next, &mine);
            const uint4 *const kv = sKV + at * 2 * KN * CH;
            if (PP) named_bar_sync(WS_TURN + wg, 2 * FA_THREADS);   /* this warpgroup's turn to issue S */
            if (mine != TILE_EMPTY) {
                float s[8][4];
                scores_wg<D / 16>(s, sQ, kv);
                if (PP) named_bar_arrive(WS_TURN + 1 - wg, 2 * FA_THREADS);   /* the other's turn */
                wg_wait<0>();
                wg_fence_regs(&s[0][0], 32);
                online_softmax<D, false>(s, o, m, l, g, b, rows, j0, mine, tq);
                times_tile_wg_waited<D, 4, 64>(o, s, kv + 64 * CH);   /* O += P V */
            } else if (PP) {
                named_bar_arrive(WS_TURN + 1 - wg, 2 * FA_THREADS);
            }
            mbar_arrive(&empty[at]);   /* this thread is done with the stage: its wgmmas were waited for */
            j0 = j_next;
            st = st_next;
        }
    }
    if (PP && wg == 0 && started) named_bar_sync(WS_TURN, 2 * FA_THREADS);   /* warpgroup 1's last hand-over */
    store_forward_rows<D, false>(out, lse, g, b, rows, o, m, l, tq, [&](int) { return h; });
#endif
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
