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
 * ULY_CUDA_ATTN_WGMMA=0 / 1 forces it off / on. Untimed wgmma variants, off by default:
 * ULY_CUDA_ATTN_FWD=rows128 / ULY_CUDA_ATTN_DQ=rows128 (128 query rows a block, two warpgroups
 * sharing each K and V tile) and ULY_CUDA_ATTN_DKV=rows128 (128 keys a block, two warpgroups
 * sharing each Q and dO tile); ULY_CUDA_ATTN_FWD=tma (the forward's tiles by TMA, waited for on
 * mbarriers) and ws (warp-specialised: a TMA producer warp, two consumer warpgroups); 64-wide
 * backward tiles (ULY_CUDA_ATTN_DKV=64, ULY_CUDA_ATTN_DQ=64).
 * What ptxas needs to keep a kernel's wgmmas back to back (scripts/sass-check.sh fails when it
 * does not: its C7520 note, each wgmma then waits for the one before): no call in the loop around
 * them (a 64-bit division is one: the mask's layout lookups divide in 32 bits), and A fragments
 * written before the fence, not between two wgmmas (acc_to_a_all).
 * Layout: the kernels are in attention_forward.cuh and attention_backward.cuh (their shared
 * pieces in attention_tiles.cuh), included here once; this file is the host side: which kernel
 * runs (head dim, GQA grouping, split key bands, tile widths), their launches, and the wgmma
 * self-check. */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#ifndef ULY_CUDA_EMU
#include <cudaTypedefs.h>   /* PFN_cuTensorMapEncodeTiled_v12000 */
#endif
#include "uly_cuda.h"               /* uly_cuda_record_error, the exported declarations */
#include "attention_tiles.cuh"      /* shared tile layouts, loads, fragments, tile classification */
#include "attention_forward.cuh"    /* fa_forward, fa_combine */
#include "attention_backward.cuh"   /* fa_backward_dkv, fa_backward_dq */

/* ---- host side ---- */
static int launched(const char *name) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    uly_cu_fail(name, e);
    return -1;
}

/* a kernel's dynamic shared memory limit raised to smem bytes, the first time (*raised); -1 when
 * that fails (reported as `what`) */
template <typename Kernel>
static int allow_smem(Kernel kernel, size_t smem, bool *raised, const char *what) {
    if (*raised) return 0;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) {
        uly_cu_fail(what, e);
        return -1;
    }
    *raised = true;
    return 0;
}

/* ---- the kernels' variants (bench/gpu.lua times them against the defaults) ----
 * ULY_CUDA_ATTN_FWD: pipelined, rows128, tma, ws, wspp, wsov, wsppov; ULY_CUDA_ATTN_DQ: 64, rows128, ws;
 * ULY_CUDA_ATTN_DKV: 64, rows128, ws; ULY_CUDA_ATTN_BWD: onepass, twopass (the default); and
 * ULY_CUDA_ATTN: fused (the default in mixed precision), chunked; ULY_CUDA_ATTN_WGMMA: 0, 1 (see
 * use_wgmma). Unset or empty: the tuned choice for the call's head dim where one was set
 * (uly_cuda_attention_prefer, from tools/tune_attention.lua's cache), else the default kernels.
 * An unknown value, or a variant this GPU or driver cannot run (the two-warpgroup kernels need
 * compute capability 9.0, the TMA ones also the driver's tensor-map encoder), runs the default
 * and says so on stderr, once per variable and value: a benchmark
 * labelled with a variant must not quietly time the default. (Shapes a variant does not cover,
 * e.g. a forward with key splits, run the default without a word: that is by design.) */
enum { V_FWD, V_DQ, V_DKV, V_BWD, V_PATH, V_WGMMA, V_COUNT };
static const char *const variant_vars[V_COUNT] = {"ULY_CUDA_ATTN_FWD", "ULY_CUDA_ATTN_DQ", "ULY_CUDA_ATTN_DKV",
                                                  "ULY_CUDA_ATTN_BWD", "ULY_CUDA_ATTN", "ULY_CUDA_ATTN_WGMMA"};
static const char *const variant_names[V_COUNT][8] = {{"pipelined", "rows128", "tma", "ws", "wspp", "wsov", "wsppov", NULL},
                                                      {"64", "rows128", "ws", NULL},
                                                      {"64", "rows128", "ws", NULL},
                                                      {"onepass", "twopass", NULL},
                                                      {"fused", "chunked", NULL},
                                                      {"0", "1", NULL}};
/* The tuned choices (uly_cuda_attention_prefer; lua/ulysses/attention_tune.lua measures them on
 * this GPU and keeps them in a cache file): per head dim (64, 128) a name for each of the forward,
 * dQ, dK/dV and backward variables, taken where the variable is unset or empty. tuned_slot is the
 * head dim of the fused call in progress (0: 64, 1: 128, -1: other), set at each entry point. */
static char tuned[2][V_BWD + 1][16];
static int tuned_slot = -1;
static int from_tuned[V_COUNT];   /* whether variant(v) last answered with a tuned choice */
static void variant_note(int v, const char *value, const char *why) {
    static char said[V_COUNT][32];   /* the value last reported, per variable */
    if (!strncmp(said[v], value, sizeof said[v] - 1)) return;
    snprintf(said[v], sizeof said[v], "%s", value);
    if (from_tuned[v])
        fprintf(stderr, "ulysses: the tuned attention choice %s=%s (ULY_CUDA_TUNED=0 ignores it): %s; running the default kernels\n",
                variant_vars[v], value, why);
    else fprintf(stderr, "ulysses: %s=%s: %s; running the default kernels\n", variant_vars[v], value, why);
}
/* the known name of variable v equal to s, or NULL */
static const char *known_name(int v, const char *s) {
    for (const char *const *k = variant_names[v]; *k; k++)
        if (!strcmp(s, *k)) return *k;
    return NULL;
}
/* the value of variable v: one of its names, or "" (unset, empty, or unknown: reported); unset or
 * empty, the tuned choice for the call's head dim where there is one */
static const char *variant(int v) {
    const char *env = getenv(variant_vars[v]);
    from_tuned[v] = 0;
    if (!env || !*env) {
        if (v > V_BWD || tuned_slot < 0 || !tuned[tuned_slot][v][0]) return "";
        from_tuned[v] = 1;
        return known_name(v, tuned[tuned_slot][v]);
    }
    if (const char *name = known_name(v, env)) return name;
    char known[64] = "";
    for (const char *const *k = variant_names[v]; *k; k++)
        snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", known[0] ? ", " : "", *k);
    char why[96];
    snprintf(why, sizeof why, "unknown (known: %s)", known);
    variant_note(v, env, why);
    return "";
}
/* whether variant `name` of v is asked for and can run here (ok; else `why_not` is reported) */
static int variant_runs(int v, const char *name, int ok, const char *why_not) {
    if (strcmp(variant(v), name)) return 0;
    if (!ok) variant_note(v, name, why_not);
    return ok;
}
/* every variable's value checked at each fused attention call (unknown ones reported), also where
 * the kernel that reads it does not run */
static void check_variants(void) {
    for (int v = 0; v < V_COUNT; v++) variant(v);
}
/* whether the fused kernels take this attention (ULY_CUDA_ATTN=chunked: never) */
int uly_cu_fused_attention_ok(const geom &g) {
    if (!strcmp(variant(V_PATH), "chunked")) return 0;
    return (g.D == 32 || g.D == 64 || g.D == 128) && g.Tq > 0 && g.Tk > 0 && g.Tq < ((int64_t)1 << 30) &&
           g.Tk < ((int64_t)1 << 30);   /* tile_state's row_span holds positions in 32 bits */
}

#define NOT_SM90 "needs compute capability 9.0 (wgmma)"
#define NO_TMA "needs compute capability 9.0 and the driver's tensor-map encoder (TMA)"
#define MAP_REFUSED "the driver refused a tensor map of these operands (TMA)"

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

/* whether the two-warpgroup kernels' wgmma build is what runs here (compute capability 9.0, or the
 * emulator): in the other passes their kernels are empty */
static int two_warpgroup_build_loads(void) {
#ifdef ULY_CUDA_EMU
    return 1;
#else
    static int cc9 = -1;
    if (cc9 < 0) {
        int dev = 0, major = 0, minor = 0;
        cc9 = cudaGetDevice(&dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
              minor == 0;
        cudaGetLastError();
    }
    return cc9;
#endif
}
/* ULY_CUDA_ATTN_FWD=rows128: the wgmma forward with 128 query rows a block (fa_forward_rows128,
 * two warpgroups sharing K and V), where one would run unpipelined without key splits or GQA
 * packing. bench/gpu.lua times it beside the default. */
static int forward_rows128(void) { return variant_runs(V_FWD, "rows128", two_warpgroup_build_loads(), NOT_SM90); }

template <int D>
static void launch_forward_rows128(float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                                   int *ran) {
    const size_t smem = 5 * 64 * (D / 8) * 16 + 1024;   /* V, two K tiles, 128 rows of Q, + 1 KiB to align them */
    static bool raised;
    if (allow_smem(fa_forward_rows128<D>, smem, &raised, "fused flash attention forward (wgmma, 128 rows): shared memory")) return;
    char name[64] = "";   /* for the profiler */
    if (uly_cu_prof_on) snprintf(name, sizeof name, "attention forward D %d wgmma (128 rows)", D);
    const int64_t blocks = (g.Tq + 127) / 128 * g.B * g.H;
    ULY_LAUNCH_SMEM_AS(name, fa_forward_rows128<D>, blocks, 2 * FA_THREADS, smem, uly_cu_stream)(out, lse, g, q, k, v,
                                                                                                 ran);
}

/* the driver's tensor-map encoder (TMA), found once through the runtime (libcuda is not linked);
 * NULL where the driver has none */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static int tried;
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    if (!tried) {
        tried = 1;
        void *p = NULL;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) == cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        cudaGetLastError();
    }
    return fn;
}
/* ULY_CUDA_ATTN_FWD=tma: the wgmma forward with TMA loads (fa_forward_tma); ws: warp-specialised
 * (fa_forward_ws: a TMA producer warp, two consumer warpgroups); wspp: that with ping-pong; wsov,
 * wsppov: those with the intra-warpgroup overlap (OV); where one would run unpipelined without
 * key splits or GQA packing. bench/gpu.lua times them beside the default. 0: none; else the
 * index of the name in the list below (1: tma). */
static int forward_tma(void) {
    static const char *const names[] = {"tma", "ws", "wspp", "wsov", "wsppov"};
    const int ok = two_warpgroup_build_loads() && tensor_map_encoder();
    for (int i = 0; i < 5; i++)
        if (variant_runs(V_FWD, names[i], ok, NO_TMA)) return i + 1;
    return 0;
}
/* the map of a [B, T, heads, D] bf16 tensor in boxes of `rows` rows (64 unless said) x 64 elements
 * of one head, landing 128-byte swizzled; -1 when the driver refuses it (e.g. a base not 16-byte
 * aligned) */
static int tile_map(CUtensorMap *m, const bf16 *base, int64_t B, int64_t T, int64_t heads, int D, int rows = 64) {
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)heads, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[3] = {(cuuint64_t)D * 2, (cuuint64_t)(heads * D * 2), (cuuint64_t)(T * heads * D * 2)};
    const cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1}, unit[4] = {1, 1, 1, 1};
    return tensor_map_encoder()(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)base, dims, strides, box, unit,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : -1;
}
/* the map of n f32 values (one flat row: per-query statistics, [B, H, Tq]) in boxes of `box`,
 * unswizzled; -1 when the driver refuses it, or n is past TMA's 32-bit coordinates */
static int flat_map(CUtensorMap *m, const float *base, int64_t n, int box) {
    const cuuint64_t dims[1] = {(cuuint64_t)n};
    const cuuint32_t boxes[1] = {(cuuint32_t)box}, unit[1] = {1};
    if (n >= ((int64_t)1 << 31)) return -1;
    return tensor_map_encoder()(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, (void *)base, dims, NULL, boxes, unit,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : -1;
}
/* which (forward_tma's: 1 fa_forward_tma, 2 fa_forward_ws, 3 it with ping-pong, 4 with the
 * intra-warpgroup overlap, 5 with both); 0 when launched, -1 when a map could not be made (the
 * caller launches the cp.async kernel) */
template <int D>
static int launch_forward_tma(int which, float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k,
                              const bf16 *v, int *ran) {
    CUtensorMap mq, mk, mv;
    const int ws = which >= 2, ov = which >= 4, kn = ov ? WS_KN_OV : 64;   /* keys a tile, the K and V boxes' rows */
    if (tile_map(&mq, q, g.B, g.Tq, g.H, D) || tile_map(&mk, k, g.B, g.Tk, g.Hkv, D, kn) ||
        tile_map(&mv, v, g.B, g.Tk, g.Hkv, D, kn))
        return -1;
    auto kernel = which == 5 ? fa_forward_ws<D, true, true> : which == 4 ? fa_forward_ws<D, false, true>
                : which == 3 ? fa_forward_ws<D, true> : which == 2 ? fa_forward_ws<D, false> : fa_forward_tma<D>;
    /* tma: Q, V, two K tiles + 1 KiB to align them, and the mbarriers */
    const size_t smem = ov ? FWD_WS_SMEM(D, WS_STAGES_OV, WS_KN_OV) : ws ? FWD_WS_SMEM(D, WS_STAGES, 64)
                            : 4 * 64 * (D / 8) * 16 + 1024 + 3 * 8;
    static bool raised[5];
    if (allow_smem(kernel, smem, &raised[which - 1], "fused flash attention forward (wgmma, TMA): shared memory")) return 0;
    static const char *const kinds[5] = {"", ", warp-specialised", ", warp-specialised, ping-pong",
                                         ", warp-specialised, overlapped", ", warp-specialised, ping-pong, overlapped"};
    char name[80] = "";   /* for the profiler */
    if (uly_cu_prof_on) snprintf(name, sizeof name, "attention forward D %d wgmma (TMA%s)", D, kinds[which - 1]);
    const int64_t blocks = ws ? (g.Tq + 127) / 128 * g.B * g.H : (g.Tq + 63) / 64 * g.B * g.H;
    ULY_LAUNCH_SMEM_AS(name, kernel, blocks, ov ? WSG_THREADS : ws ? WS_THREADS : FA_THREADS, smem, uly_cu_stream)(out, lse, g, mq, mk,
                                                                                                     mv, ran);
    return 0;
}

/* one forward kernel launch: grouped or not, wgmma or mma.sync (the wgmma kernel's tiles live
 * in dynamic shared memory: Q, V, two K tiles + 1 KiB to align them) */
template <int D, bool grouped, bool WG, bool PIPE = false>
static void launch_forward(int64_t blocks, float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k,
                           const bf16 *v, int splits, float *part, float *part_lse, int *ran) {
    if constexpr (WG && !grouped && !PIPE && (D == 64 || D == 128)) {
        if (splits == 1 && forward_rows128()) {
            launch_forward_rows128<D>(out, lse, g, q, k, v, ran);
            return;
        }
        const int tma = splits == 1 ? forward_tma() : 0;
        if (tma) {
            if (launch_forward_tma<D>(tma, out, lse, g, q, k, v, ran) == 0) return;
            variant_note(V_FWD, variant(V_FWD), MAP_REFUSED);
        }
    }
    if (WG) {
        const size_t smem = 4 * 64 * (D / 8) * 16 + 1024;   /* Q, V and two K tiles, + 1 KiB to align them */
        static bool raised;
        if (allow_smem(fa_forward<D, grouped, WG, PIPE>, smem, &raised, "fused flash attention forward (wgmma): shared memory"))
            return;
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

/* ULY_CUDA_ATTN_DQ=64: the dQ kernel's wgmma variant with 64-key tiles at D = 64; rows128: its
 * two-warpgroup variant, 128 query rows a block sharing each K and V tile (64-key tiles at D 64,
 * 32 at D 128), where its build loads (see fa_backward_dq; bench/gpu.lua times them beside the
 * default 32-key tiles of 64 rows) */
static int dq_key_tile(int D) {
    const char *v = variant(V_DQ);
    return D == 64 && (!strcmp(v, "64") || !strcmp(v, "rows128")) ? 64 : 32;
}
static int dq_rows128(void) { return variant_runs(V_DQ, "rows128", two_warpgroup_build_loads(), NOT_SM90); }

template <int D, bool WG, int KT, int WGS = 1>
static void launch_dq_kt(int64_t blocks, float *dq, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                         const bf16 *dout, const float *lse, const float *delta, int *ran) {
    /* WG: room to align the tiles; WGS = 2: each warpgroup's Q and dO */
    const size_t smem = backward_smem_bytes<D, false, KT>() + (WGS - 1) * 2 * 64 * (D / 8) * 16 + (WG ? 1024 : 0);
    cudaError_t e = cudaFuncSetAttribute(fa_backward_dq<D, WG, KT, WGS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e != cudaSuccess) { uly_cu_fail("fused flash attention backward (dQ): shared memory", e); return; }
    char name[64] = "";   /* for the profiler */
    if (uly_cu_prof_on)
        snprintf(name, sizeof name, "attention backward dQ D %d%s%s%s", D, WG ? " wgmma" : "", KT == 64 ? " (64-key tiles)" : "",
                 WGS == 2 ? " (128 rows)" : "");
    if (WGS == 2) blocks = (g.Tq + 127) / 128 * g.B * g.H;
    ULY_LAUNCH_SMEM_AS(name, (fa_backward_dq<D, WG, KT, WGS>), blocks, WGS * FA_THREADS, smem, uly_cu_stream)(
        dq, g, q, k, v, dout, lse, delta, ran);
}
/* ULY_CUDA_ATTN_DQ=ws: the warp-specialised dQ on TMA (fa_backward_dq_ws), where its build loads
 * and the driver makes tensor maps */
static int dq_ws(void) { return variant_runs(V_DQ, "ws", two_warpgroup_build_loads() && tensor_map_encoder(), NO_TMA); }
/* 0 when launched, -1 when a map could not be made (the caller launches the cp.async kernel) */
template <int D>
static int launch_dq_ws(float *dq, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout,
                        const float *lse, const float *delta, int *ran) {
    CUtensorMap mq, mk, mv, mo;
    if (tile_map(&mq, q, g.B, g.Tq, g.H, D) || tile_map(&mo, dout, g.B, g.Tq, g.H, D) || tile_map(&mk, k, g.B, g.Tk, g.Hkv, D) ||
        tile_map(&mv, v, g.B, g.Tk, g.Hkv, D))
        return -1;
    /* + 1 KiB to align the tiles: both warpgroups' Q and dO, per stage K and V, the mbarriers */
    const size_t tile = 64 * (D / 8) * 16, smem = 1024 + (4 + 2 * WS_STAGES) * tile + (2 * WS_STAGES + 1) * 8;
    static bool raised;
    if (allow_smem(fa_backward_dq_ws<D>, smem, &raised, "fused flash attention backward (dQ; warp-specialised): shared memory"))
        return 0;
    char name[80] = "";   /* for the profiler */
    if (uly_cu_prof_on) snprintf(name, sizeof name, "attention backward dQ D %d wgmma (128 rows, TMA, warp-specialised)", D);
    const int64_t blocks = (g.Tq + 127) / 128 * g.B * g.H;
    ULY_LAUNCH_SMEM_AS(name, fa_backward_dq_ws<D>, blocks, WSG_THREADS, smem, uly_cu_stream)(dq, g, mq, mk, mv, mo, lse,
                                                                                              delta, ran);
    return 0;
}
template <int D, bool WG>
static void launch_dq(int64_t blocks, float *dq, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                      const bf16 *dout, const float *lse, const float *delta, int *ran) {
    if constexpr (WG && (D == 64 || D == 128)) {
        if (dq_ws()) {
            if (launch_dq_ws<D>(dq, g, q, k, v, dout, lse, delta, ran) == 0) return;
            variant_note(V_DQ, "ws", MAP_REFUSED);
        }
        if (dq_rows128()) {
            launch_dq_kt<D, WG, D == 64 ? 64 : 32, 2>(blocks, dq, g, q, k, v, dout, lse, delta, ran);
            return;
        }
    }
    if constexpr (WG && D == 64) {
        if (dq_key_tile(D) == 64) {
            launch_dq_kt<D, WG, 64>(blocks, dq, g, q, k, v, dout, lse, delta, ran);
            return;
        }
    }
    launch_dq_kt<D, WG, 32>(blocks, dq, g, q, k, v, dout, lse, delta, ran);
}

/* ULY_CUDA_ATTN_DKV=64: the dK/dV kernel's wgmma variant with 64-query tiles at D = 64; rows128:
 * its two-warpgroup variant, 128 keys a block sharing each Q and dO tile (32-query tiles), where
 * its build loads (see fa_backward_dkv; bench/gpu.lua times them beside the default 32-query tiles
 * of 64 keys) */
static int dkv_query_tile(int D) { return D == 64 && !strcmp(variant(V_DKV), "64") ? 64 : 32; }
static int dkv_rows128(void) { return variant_runs(V_DKV, "rows128", two_warpgroup_build_loads(), NOT_SM90); }

template <int D, bool WG, bool DQ = false, int QT = 32, int WGS = 1>
static void launch_dkv_qt(int64_t blocks, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k,
                          const bf16 *v, const bf16 *dout, const float *lse, const float *delta, int *ran, float *dq) {
    /* WG: room to align the tiles; WGS = 2: each warpgroup's K and V */
    const size_t smem = backward_smem_bytes<D, DQ, QT>() + (WGS - 1) * 2 * 64 * (D / 8) * 16 + dkv_stats_bytes(QT) +
                        (WG ? 1024 : 0);
    cudaError_t e = cudaFuncSetAttribute(fa_backward_dkv<D, WG, DQ, QT, WGS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e != cudaSuccess) { uly_cu_fail("fused flash attention backward (dK, dV): shared memory", e); return; }
    char name[96] = "";   /* for the profiler */
    if (uly_cu_prof_on)
        snprintf(name, sizeof name, "attention backward dK dV%s D %d%s%s%s", DQ ? " dQ (one pass)" : "", D, WG ? " wgmma" : "",
                 QT == 64 ? " (64-query tiles)" : "", WGS == 2 ? " (128 keys)" : "");
    if (WGS == 2) blocks = (g.Tk + 127) / 128 * g.B * g.Hkv;
    ULY_LAUNCH_SMEM_AS(name, (fa_backward_dkv<D, WG, DQ, QT, WGS>), blocks, WGS * FA_THREADS, smem, uly_cu_stream)(
        dk, dv, g, q, k, v, dout, lse, delta, ran, dq);
}
/* ULY_CUDA_ATTN_DKV=ws: the warp-specialised dK/dV on TMA (fa_backward_dkv_ws), where its build
 * loads and the driver makes tensor maps */
static int dkv_ws(void) { return variant_runs(V_DKV, "ws", two_warpgroup_build_loads() && tensor_map_encoder(), NO_TMA); }
/* 0 when launched, -1 when a map could not be made (the caller launches the cp.async kernel); DQ:
 * with the one-pass dQ, added into dq */
template <int D, bool DQ = false>
static int launch_dkv_ws(float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                         const bf16 *dout, const float *lse, const float *delta, int *ran, float *dq = NULL) {
    constexpr int T = DKV_WS_QT;
    CUtensorMap mq, mk, mv, mo, ml, md;
    if (tile_map(&mq, q, g.B, g.Tq, g.H, D, T) || tile_map(&mo, dout, g.B, g.Tq, g.H, D, T) ||
        tile_map(&mk, k, g.B, g.Tk, g.Hkv, D) || tile_map(&mv, v, g.B, g.Tk, g.Hkv, D) ||
        flat_map(&ml, lse, g.B * g.H * g.Tq, T) || flat_map(&md, delta, g.B * g.H * g.Tq, T))
        return -1;
    /* + 1 KiB to align the tiles: both warpgroups' K and V, per stage Q, dO, lse and delta, (DQ:
     * the dS tiles), the mbarriers */
    const size_t smem = 1024 + 4 * 64 * (D / 8) * 16 + WS_STAGES * (2 * T * (D / 8) * 16 + 2 * T * 4) +
                        (DQ ? 2 * T * 128 * 2 : 0) + (2 * WS_STAGES + 1) * 8;
    static bool raised;
    if (allow_smem(fa_backward_dkv_ws<D, DQ>, smem, &raised, "fused flash attention backward (dK, dV; warp-specialised): shared memory"))
        return 0;
    char name[96] = "";   /* for the profiler */
    if (uly_cu_prof_on)
        snprintf(name, sizeof name, "attention backward dK dV%s D %d wgmma (128 keys, TMA, warp-specialised)",
                 DQ ? " dQ (one pass)" : "", D);
    const int64_t blocks = (g.Tk + 127) / 128 * g.B * g.Hkv;
    ULY_LAUNCH_SMEM_AS(name, (fa_backward_dkv_ws<D, DQ>), blocks, WSG_THREADS, smem, uly_cu_stream)(dk, dv, g, mq, mk, mv, mo,
                                                                                                  ml, md, ran, dq);
    return 0;
}

template <int D, bool WG, bool DQ = false>
static void launch_dkv(int64_t blocks, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                       const bf16 *dout, const float *lse, const float *delta, int *ran, float *dq = NULL) {
    if constexpr (WG && (D == 64 || (D == 128 && !DQ))) {
        if (dkv_ws()) {
            if (launch_dkv_ws<D, DQ>(dk, dv, g, q, k, v, dout, lse, delta, ran, dq) == 0) return;
            variant_note(V_DKV, "ws", MAP_REFUSED);
        }
    }
    if constexpr (WG && !DQ && (D == 64 || D == 128)) {
        if (dkv_rows128()) {
            launch_dkv_qt<D, WG, DQ, 32, 2>(blocks, dk, dv, g, q, k, v, dout, lse, delta, ran, dq);
            return;
        }
    }
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
    const char *env = variant(V_WGMMA);
    if (!strcmp(env, "0")) return 0;
    if (!strcmp(env, "1")) return 1;
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
    const char *env = variant(V_WGMMA);
    if (!strcmp(env, "0")) return "off (ULY_CUDA_ATTN_WGMMA=0)";
    if (!strcmp(env, "1")) return "on (ULY_CUDA_ATTN_WGMMA=1, no self-check)";
    return wg_why[D == 128];
}

/* ULY_CUDA_ATTN_FWD=pipelined: the wgmma forward issues the next tile's S before this tile's
 * softmax (fa_forward's PIPE); rows128: see forward_rows128; unset: one tile at a time, 64 rows a
 * block. bench/gpu.lua times them. */
static int forward_pipelined(void) { return !strcmp(variant(V_FWD), "pipelined"); }

/* use_wgmma, and where it says no at D 64 or 128 while variable v asks for a variant (they all run
 * on wgmma), the note that the default kernels run instead */
static int wgmma_for(int D, int kernel, int v) {
    const int on = use_wgmma(D, kernel);
    const char *name = variant(v);
    if (!on && *name && (D == 64 || D == 128))
        variant_note(v, name, "needs the wgmma kernels, off here (uly.cuda.wgmma_status says why)");
    return on;
}

template <int D>
static int forward_d(float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v) {
    const int grouped = forward_grouped(g), wg = wgmma_for(D, WG_FWD, V_FWD);
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
 * at 128 only with ULY_CUDA_ATTN_DKV=ws, elsewhere its registers would spill): 5 tile products
 * per (key, query) tile pair instead of 8 (7 against the warp-specialised kernels), but dQ's sum
 * is in no fixed order, so its last bits vary from run to run; with ULY_CUDA_ATTN_DKV=ws in the
 * warp-specialised dK/dV. Unset or 'twopass': the deterministic two kernels. bench/gpu.lua times
 * both. */
static int backward_onepass(int D) { return !strcmp(variant(V_BWD), "onepass") && D <= 64; }

template <int D>
static int backward_d(float *dq, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k, const bf16 *v,
                      const bf16 *dout, const float *lse, const float *delta) {
    if constexpr (D == 128) {   /* the one-pass dQ in the warp-specialised dK/dV, or none */
        if (dq && !strcmp(variant(V_BWD), "onepass") && wgmma_for(D, WG_DKV, V_DKV) && dkv_ws()) {
            if (launch_dkv_ws<D, true>(dk, dv, g, q, k, v, dout, lse, delta, NULL, dq) == 0)
                return launched("fused flash attention backward (one pass: dQ, dK, dV)");
            variant_note(V_DKV, "ws", MAP_REFUSED);
        }
    }
    if constexpr (D <= 64) {
        if (dq && backward_onepass(D)) {
            int64_t blocks = (g.Tk + 63) / 64 * g.B * g.Hkv;
            if (wgmma_for(D, WG_DKV, V_DKV)) launch_dkv<D, true, true>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL, dq);
            else launch_dkv<D, false, true>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL, dq);
            return launched("fused flash attention backward (one pass: dQ, dK, dV)");
        }
    }
    if (dk || dv) {
        int64_t blocks = (g.Tk + 63) / 64 * g.B * g.Hkv;
        if (wgmma_for(D, WG_DKV, V_DKV)) launch_dkv<D, true>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL);
        else launch_dkv<D, false>(blocks, dk, dv, g, q, k, v, dout, lse, delta, NULL);
        if (launched("fused flash attention backward (dK, dV)")) return -1;
    }
    if (dq) {
        int64_t blocks = (g.Tq + 63) / 64 * g.B * g.H;
        if (wgmma_for(D, WG_DQ, V_DQ)) launch_dq<D, true>(blocks, dq, g, q, k, v, dout, lse, delta, NULL);
        else launch_dq<D, false>(blocks, dq, g, q, k, v, dout, lse, delta, NULL);
        if (launched("fused flash attention backward (dQ)")) return -1;
    }
    return 0;
}

int uly_cu_fused_attention_forward(float *out, float *lse, const geom &g, const bf16 *q, const bf16 *k,
                                   const bf16 *v) {
    tuned_slot = g.D == 64 ? 0 : g.D == 128 ? 1 : -1;
    check_variants();
    switch (g.D) {
    case 32: return forward_d<32>(out, lse, g, q, k, v);
    case 64: return forward_d<64>(out, lse, g, q, k, v);
    case 128: return forward_d<128>(out, lse, g, q, k, v);
    default: uly_cu_fail_msg("fused flash attention forward", "head dim not 32, 64 or 128"); return -1;
    }
}

int uly_cu_fused_attention_backward(float *dq, float *dk, float *dv, const geom &g, const bf16 *q, const bf16 *k,
                                    const bf16 *v, const bf16 *dout, const float *lse, const float *delta) {
    tuned_slot = g.D == 64 ? 0 : g.D == 128 ? 1 : -1;
    check_variants();
    switch (g.D) {
    case 32: return backward_d<32>(dq, dk, dv, g, q, k, v, dout, lse, delta);
    case 64: return backward_d<64>(dq, dk, dv, g, q, k, v, dout, lse, delta);
    case 128: return backward_d<128>(dq, dk, dv, g, q, k, v, dout, lse, delta);
    default: uly_cu_fail_msg("fused flash attention backward", "head dim not 32, 64 or 128"); return -1;
    }
}

/* ---- the tuned choices (lua/ulysses/attention_tune.lua) ---- */
extern "C" int uly_cuda_attention_prefer(int D, const char *fwd, const char *dq, const char *dkv, const char *bwd) {
    if (D != 64 && D != 128) {
        uly_cuda_record_error("uly_cuda_attention_prefer: head dim not 64 or 128 (the ones with kernel variants)");
        return -1;
    }
    const char *asked[V_BWD + 1] = {fwd, dq, dkv, bwd};
    for (int v = 0; v <= V_BWD; v++)
        if (asked[v] && *asked[v] && !known_name(v, asked[v])) {
            char why[160];
            snprintf(why, sizeof why, "uly_cuda_attention_prefer: %s: no variant '%.40s' (see attention_fused.cu's variant_names)",
                     variant_vars[v], asked[v]);
            uly_cuda_record_error(why);   /* this call's answer only: the backend's error state is untouched */
            return -1;
        }
    for (int v = 0; v <= V_BWD; v++) snprintf(tuned[D == 128][v], sizeof tuned[0][0], "%s", asked[v] ? asked[v] : "");
    return 0;
}

extern "C" const char *uly_cuda_attention_preferred(int D, int which) {
    if ((D != 64 && D != 128) || which < 0 || which > V_BWD) return "";
    return tuned[D == 128][which];
}

/* what a tuned choice is valid for: the current device's name and compute capability, and this
 * library file's size and modification time (a rebuilt library is tuned again) */
extern "C" int uly_cuda_tune_key(char *buf, int len) {
    if (!buf || len <= 0) { uly_cuda_record_error("uly_cuda_tune_key: needs a buffer of positive length"); return -1; }
    int dev = 0, major = 0, minor = 0;
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess) {
        char why[200];
        snprintf(why, sizeof why, "uly_cuda_tune_key: %s", cudaGetErrorString(e));
        cudaGetLastError();
        uly_cuda_record_error(why);
        return -1;
    }
    Dl_info info;
    struct stat st;
    if (!dladdr((void *)uly_cuda_tune_key, &info) || !info.dli_fname || stat(info.dli_fname, &st)) {
        uly_cuda_record_error("uly_cuda_tune_key: cannot find this library's file (dladdr, stat)");
        return -1;
    }
    snprintf(buf, (size_t)len, "%s, compute capability %d.%d, library %lld-%lld", prop.name, major, minor,
             (long long)st.st_size, (long long)st.st_mtime);
    return 0;
}
