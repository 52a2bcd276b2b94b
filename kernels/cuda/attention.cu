/* kernels/cuda/attention.cu — attention on the GPU, the contracts of kernels/cpu/attention_ref.c
 * and kernels/cpu/flash_attention.h: flash attention (only the output and one log-sum-exp per row
 * kept for backward; causal, sliding-window, block-sparse and document masks; GQA without
 * repeating K/V; strided q/k/v read in place) and the reference kernel that also writes the
 * probabilities.
 *
 * Flash attention runs on tensor cores through cuBLAS, a chunk of query rows at a time: for each
 * (batch, head, chunk) S = scale Q K^T over only the keys inside the chunk's causal / window band
 * (a TF32 GEMM into a scratch of chunk x band floats, at most ~256 MiB), a masked softmax kernel
 * (layout and document masks too) turns S into P and writes the log-sum-exp, and O = P V.
 * Backward recomputes P from the log-sum-exp per chunk and runs dP = dO V^T, dS = P (dP - delta)
 * with delta = rowsum(P dP) over the chunk's band, dV += P^T dO, dK += dS^T Q, dQ += dS K: every
 * GEMM on tensor cores, accumulations in a fixed
 * order (no atomics: the same bits run to run). Memory is O(N D) plus the chunk's scratch.
 * ULY_CUDA_ATTN_CHUNK=n forces the chunk (specs use small ones to cross chunk borders).
 * In mixed precision, head dims 32, 64 and 128 run the fused kernels of attention_fused.cu
 * instead (no score matrix in memory); ULY_CUDA_ATTN=chunked keeps them on this path.
 * The warp-per-row kernels below the chunked path are the reference kernel's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include "common.cuh"
#include "attention.cuh"
#include "uly_cuda.h"

#define WARPS 4
#define MAXD 256
#define PER_LANE (MAXD / 32)

/* sum over the warp, every lane gets it */
__device__ static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* load a D-vector spread over the lanes: lane l holds elements l, l + 32, ... */
__device__ static inline void load_row(float *r, const float *p, int64_t D, int lane) {
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        r[k] = d < D ? p[d] : 0.0f;
    }
}
__device__ static inline float dot_row(const float *r, const float *p, int64_t D, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        if (d < D) s += r[k] * p[d];
    }
    return warp_sum(s);
}

/* ---- forward: a warp per (b, h, i) ---- */
__global__ static void flash_fw(float *out, float *lse, geom g) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), rows = g.B * g.H * g.Tq;
    if (row >= rows) return;
    int64_t i = row % g.Tq, h = (row / g.Tq) % g.H, b = row / (g.Tq * g.H), hk = h / (g.H / g.Hkv);
    float q[PER_LANE], acc[PER_LANE];
    load_row(q, g.q + b * g.qb + i * g.qt + h * g.qh, g.D, lane);
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) acc[k] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    int64_t lo, hi;
    band(g, i, &lo, &hi);
    for (int64_t j = lo; j <= hi; j++) {
        if (!visible(g, b, i, j)) continue;
        float s = g.scale * dot_row(q, g.k + b * g.kb + j * g.kt + hk * g.kh, g.D, lane);
        float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        const float *vr = g.v + b * g.vb + j * g.vt + hk * g.vh;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            int64_t d = lane + 32 * k;
            acc[k] = acc[k] * corr + (d < g.D ? p * vr[d] : 0.0f);
        }
        m = mn;
    }
    float *o = out + ((b * g.Tq + i) * g.H + h) * g.D;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        if (d < g.D) o[d] = l > 0.0f ? acc[k] / l : 0.0f;
    }
    if (lane == 0) lse[(b * g.H + h) * g.Tq + i] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/* reference kernel: probs[b, h, i, j] = exp(scale q.k - lse) where visible, else 0 */
__global__ static void write_probs(float *probs, const float *lse, geom g) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), rows = g.B * g.H * g.Tq;
    if (row >= rows) return;
    int64_t i = row % g.Tq, h = (row / g.Tq) % g.H, b = row / (g.Tq * g.H), hk = h / (g.H / g.Hkv);
    float q[PER_LANE];
    load_row(q, g.q + b * g.qb + i * g.qt + h * g.qh, g.D, lane);
    float L = lse[(b * g.H + h) * g.Tq + i];
    float *pr = probs + ((b * g.H + h) * g.Tq + i) * g.Tk;
    for (int64_t j = 0; j < g.Tk; j++) {
        float p = 0.0f;
        if (visible(g, b, i, j)) p = expf(g.scale * dot_row(q, g.k + b * g.kb + j * g.kt + hk * g.kh, g.D, lane) - L);
        if (lane == 0) pr[j] = p;
    }
}

/* ---- backward ---- */
/* delta[b, h, i] = dout_i . out_i */
__device__ static inline float as_f32(float x) { return x; }
__device__ static inline float as_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

/* delta_i = dO_i . O_i; with dO the bf16 copy the bf16 GEMMs use, so that sum_j P_ij dP_ij =
 * delta_i holds for the rounded dO too (a row with one visible key then gets dS = 0, not the
 * rounding error of dO) */
template <typename T>
__global__ static void flash_delta(float *delta, const T *dout, const float *out, geom g) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), rows = g.B * g.H * g.Tq;
    if (row >= rows) return;
    int64_t i = row % g.Tq, h = (row / g.Tq) % g.H, b = row / (g.Tq * g.H);
    const T *d = dout + ((b * g.Tq + i) * g.H + h) * g.D;
    const float *o = out + ((b * g.Tq + i) * g.H + h) * g.D;
    float s = 0.0f;
    for (int64_t e = lane; e < g.D; e += 32) s += as_f32(d[e]) * o[e];
    s = warp_sum(s);
    if (lane == 0) delta[(b * g.H + h) * g.Tq + i] = s;
}

/* the probability of (i, j): from the saved matrix (reference) or recomputed from lse (flash) */
__device__ static inline float prob(const geom &g, const float *probs, const float *lse, int64_t b, int64_t h, int64_t i,
                                    int64_t j, float s) {
    if (probs) return probs[((b * g.H + h) * g.Tq + i) * g.Tk + j];
    return expf(s - lse[(b * g.H + h) * g.Tq + i]);
}

/* dq_i += scale sum_j ds_ij k_j, ds = p (dout_i . v_j - delta_i): a warp per (b, h, i) */
__global__ static void flash_dq(float *dq, const float *dout, const float *lse, const float *probs, const float *delta, geom g) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), rows = g.B * g.H * g.Tq;
    if (row >= rows) return;
    int64_t i = row % g.Tq, h = (row / g.Tq) % g.H, b = row / (g.Tq * g.H), hk = h / (g.H / g.Hkv);
    float q[PER_LANE], d[PER_LANE], acc[PER_LANE];
    load_row(q, g.q + b * g.qb + i * g.qt + h * g.qh, g.D, lane);
    load_row(d, dout + ((b * g.Tq + i) * g.H + h) * g.D, g.D, lane);
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) acc[k] = 0.0f;
    float di = delta[(b * g.H + h) * g.Tq + i];
    int64_t lo, hi;
    band(g, i, &lo, &hi);
    for (int64_t j = lo; j <= hi; j++) {
        if (!visible(g, b, i, j)) continue;
        const float *kr = g.k + b * g.kb + j * g.kt + hk * g.kh;
        float s = probs ? 0.0f : g.scale * dot_row(q, kr, g.D, lane);
        float p = prob(g, probs, lse, b, h, i, j, s);
        float dp = dot_row(d, g.v + b * g.vb + j * g.vt + hk * g.vh, g.D, lane);
        float ds = p * (dp - di) * g.scale;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            int64_t e = lane + 32 * k;
            if (e < g.D) acc[k] += ds * kr[e];
        }
    }
    float *o = dq + ((b * g.Tq + i) * g.H + h) * g.D;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t e = lane + 32 * k;
        if (e < g.D) o[e] += acc[k];
    }
}

/* dk_j += scale sum_(h, i) ds_ij q_i, dv_j += sum_(h, i) p_ij dout_i over the query heads of K/V
 * head hk: a warp per (b, hk, j); queries outside j's band are never visited */
__global__ static void flash_dkv(float *dk, float *dv, const float *dout, const float *lse, const float *probs,
                                 const float *delta, geom g) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), rows = g.B * g.Hkv * g.Tk;
    if (row >= rows) return;
    int64_t j = row % g.Tk, hk = (row / g.Tk) % g.Hkv, b = row / (g.Tk * g.Hkv), group = g.H / g.Hkv;
    float kr[PER_LANE], vr[PER_LANE], ak[PER_LANE], av[PER_LANE];
    load_row(kr, g.k + b * g.kb + j * g.kt + hk * g.kh, g.D, lane);
    load_row(vr, g.v + b * g.vb + j * g.vt + hk * g.vh, g.D, lane);
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) ak[k] = av[k] = 0.0f;
    /* queries whose band can hold j: i' = i + Tk - Tq with i' >= j (causal), i' <= j + left, i' >= j - right */
    int64_t off = g.Tk - g.Tq, ilo = 0, ihi = g.Tq - 1;
    if (g.causal && j - off > ilo) ilo = j - off;
    if (g.left >= 0 && j + g.left - off < ihi) ihi = j + g.left - off;
    if (g.right >= 0 && j - g.right - off > ilo) ilo = j - g.right - off;
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        for (int64_t i = ilo; i <= ihi; i++) {
            if (!visible(g, b, i, j)) continue;
            const float *qr = g.q + b * g.qb + i * g.qt + h * g.qh;
            const float *dr = dout + ((b * g.Tq + i) * g.H + h) * g.D;
            float s = probs ? 0.0f : g.scale * dot_row(kr, qr, g.D, lane);
            float p = prob(g, probs, lse, b, h, i, j, s);
            float dp = dot_row(vr, dr, g.D, lane);
            float ds = p * (dp - delta[(b * g.H + h) * g.Tq + i]) * g.scale;
#pragma unroll
            for (int k = 0; k < PER_LANE; k++) {
                int64_t e = lane + 32 * k;
                if (e < g.D) { ak[k] += ds * qr[e]; av[k] += p * dr[e]; }
            }
        }
    }
    int64_t base = ((b * g.Tk + j) * g.Hkv + hk) * g.D;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t e = lane + 32 * k;
        if (e < g.D) {
            if (dk) dk[base + e] += ak[k];
            if (dv) dv[base + e] += av[k];
        }
    }
}

static unsigned warps_grid(int64_t rows) { return (unsigned)((rows + WARPS - 1) / WARPS); }

static int check_dims(const char *op, const geom &g) {
    if (g.D > MAXD) {
        char msg[128];
        snprintf(msg, sizeof msg, "head dim %lld is above the %d this kernel supports", (long long)g.D, MAXD);
        uly_cu_fail_msg(op, msg);
        return -1;
    }
    if (g.B * g.H * g.Tq > (int64_t)WARPS * 0x7fffffff || g.B * g.Hkv * g.Tk > (int64_t)WARPS * 0x7fffffff) {
        uly_cu_fail_msg(op, "too many rows for one launch");
        return -1;
    }
    return 0;
}

static int backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                    const float *probs, float *delta, const geom &g, const char *op) {
    if (check_dims(op, g)) return -1;
    int64_t qrows = g.B * g.H * g.Tq, krows = g.B * g.Hkv * g.Tk;
    if (qrows == 0) return 0;
    ULY_LAUNCH(flash_delta<float>, warps_grid(qrows), 32 * WARPS, uly_cu_stream)(delta, dout, out, g);
    ULY_CU_LAUNCHED("flash_delta");
    if (dq) {
        ULY_LAUNCH(flash_dq, warps_grid(qrows), 32 * WARPS, uly_cu_stream)(dq, dout, lse, probs, delta, g);
        ULY_CU_LAUNCHED("flash_dq");
    }
    if ((dk || dv) && krows) {
        ULY_LAUNCH(flash_dkv, warps_grid(krows), 32 * WARPS, uly_cu_stream)(dk, dv, dout, lse, probs, delta, g);
        ULY_CU_LAUNCHED("flash_dkv");
    }
    return 0;
}

/* ---- the chunked tensor-core path ---- */
extern "C" cublasHandle_t uly_cu_cublas(void);   /* gemm.cu */

/* query rows of a chunk: ~256 MiB of scratch per S-sized buffer, a multiple of 16, at least 16 */
static int64_t chunk_rows(const geom &g) {
    const char *env = getenv("ULY_CUDA_ATTN_CHUNK");
    if (env && atoll(env) > 0) return atoll(env);
    int64_t c = ((int64_t)64 << 20) / (g.Tk > 0 ? g.Tk : 1);
    c = c / 16 * 16;
    if (c < 16) c = 16;
    return c < g.Tq ? c : g.Tq;
}

/* S [c, nk] (already scaled) -> P = exp(S - lse) where visible, else 0; lse of each row written
 * (forward: mode 0) or read (backward: mode 1). A block per row. */
__global__ static void chunk_softmax(float *S, float *lse, geom g, int64_t b, int64_t h, int64_t i0, int64_t c,
                                     int64_t lo, int64_t nk, int mode, __nv_bfloat16 *P16) {
    for (int64_t r = blockIdx.x; r < c; r += gridDim.x) {
        int64_t i = i0 + r;
        float *row = S + r * nk;
        float *L = lse + (b * g.H + h) * g.Tq + i;
        float Lr;
        if (mode == 0) {
            float m = -INFINITY;
            for (int64_t j = threadIdx.x; j < nk; j += blockDim.x)
                if (visible(g, b, i, lo + j)) m = fmaxf(m, row[j]);
            m = uly_cu_block_max(m);
            double s = 0.0;
            if (m > -INFINITY)
                for (int64_t j = threadIdx.x; j < nk; j += blockDim.x)
                    if (visible(g, b, i, lo + j)) s += expf(row[j] - m);
            s = uly_cu_block_sum(s);
            Lr = s > 0.0 ? m + (float)log(s) : -INFINITY;
            if (threadIdx.x == 0) *L = Lr;
        } else {
            Lr = *L;
        }
        for (int64_t j = threadIdx.x; j < nk; j += blockDim.x) {
            float pj = (Lr > -INFINITY && visible(g, b, i, lo + j)) ? expf(row[j] - Lr) : 0.0f;
            row[j] = pj;
            if (P16) P16[r * nk + j] = __float2bfloat16_rn(pj);   /* the bf16 operand of the next GEMMs */
        }
    }
}

/* dP [c, nk] -> dS = P (dP - delta_i) scale, in place, with delta_i = sum_j P_ij dP_ij over the
 * row (the chunk's band holds every key the row sees): the same P as dS, so sum_j dS_ij = 0
 * holds even where P was rounded for the forward's P V (dO . O would carry that rounding: with
 * one dominant key it swamps the true dS). A block per row. */
__global__ static void chunk_ds(float *dP, const float *P, int64_t c, int64_t nk, float scale, __nv_bfloat16 *dS16) {
    for (int64_t r = blockIdx.x; r < c; r += gridDim.x) {
        float *drow = dP + r * nk;
        const float *prow = P + r * nk;
        double s = 0.0;
        for (int64_t j = threadIdx.x; j < nk; j += blockDim.x) s += (double)prow[j] * drow[j];
        const float delta = (float)uly_cu_block_sum(s);
        for (int64_t j = threadIdx.x; j < nk; j += blockDim.x) {
            float ds = prow[j] * (drow[j] - delta) * scale;
            drow[j] = ds;
            if (dS16) dS16[r * nk + j] = __float2bfloat16_rn(ds);   /* the bf16 operand of the next GEMMs */
        }
    }
}

/* [B, T, Hh, D] strided f32 -> contiguous bf16 (the operands of the bf16 attention GEMMs) */
__device__ static inline __nv_bfloat16 as_bf16(float x) { return __float2bfloat16_rn(x); }
__device__ static inline __nv_bfloat16 as_bf16(__nv_bfloat16 x) { return x; }

/* a strided [B, T, Hh, D] operand into a compact bf16 copy: f32 rounded, bf16 moved. A thread per
 * V elements of a row (V = 4: 16-byte f32 or 8-byte bf16 loads, 8-byte stores, where D, the
 * strides and both pointers allow), offsets in I (int32_t where they fit): three divisions a
 * thread, not six 64-bit ones an element */
__device__ static inline void ld4(const float *p, float *v) {
    const uint4 u = *(const uint4 *)p;
    v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y); v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
}
__device__ static inline void ld4(const __nv_bfloat16 *p, __nv_bfloat16 *v) {
    const uint2 u = *(const uint2 *)p;
    v[0] = __ushort_as_bfloat16((unsigned short)(u.x & 0xffff)); v[1] = __ushort_as_bfloat16((unsigned short)(u.x >> 16));
    v[2] = __ushort_as_bfloat16((unsigned short)(u.y & 0xffff)); v[3] = __ushort_as_bfloat16((unsigned short)(u.y >> 16));
}
template <typename T_, typename I, int V>
__global__ static void to_bf16_4d(__nv_bfloat16 *dst, const T_ *src, I T, I Hh, I D, I sb, I st, I sh, I n) {
    const I DV = D / V;
    for (I e = (I)(blockIdx.x * blockDim.x + threadIdx.x); e < n / V; e += (I)(gridDim.x * blockDim.x)) {
        const I r = e / DV, d = (e - r * DV) * V, bt = r / Hh, h = r - bt * Hh, b = bt / T, t = bt - b * T;
        const T_ *p = src + (b * sb + t * st + h * sh + d);
        if (V == 4) {
            T_ v[4];
            ld4(p, v);
            const unsigned short o0 = __bfloat16_as_ushort(as_bf16(v[0])), o1 = __bfloat16_as_ushort(as_bf16(v[1]));
            const unsigned short o2 = __bfloat16_as_ushort(as_bf16(v[2])), o3 = __bfloat16_as_ushort(as_bf16(v[3]));
            *(uint2 *)(dst + (int64_t)e * 4) = make_uint2((uint32_t)o0 | (uint32_t)o1 << 16, (uint32_t)o2 | (uint32_t)o3 << 16);
        } else {
            dst[e] = as_bf16(*p);
        }
    }
}
template <typename T_, typename I>
static void launch_to_bf16_4d(__nv_bfloat16 *dst, const T_ *src, int64_t T, int64_t Hh, int64_t D, int64_t sb, int64_t st,
                              int64_t sh, int64_t n) {
    const bool wide = D % 4 == 0 && sb % 4 == 0 && st % 4 == 0 && sh % 4 == 0 && (uintptr_t)dst % 8 == 0 &&
                      (uintptr_t)src % (4 * sizeof(T_)) == 0;
    const char *name = sizeof(T_) == 4 ? "to_bf16_4d<float>" : "to_bf16_4d<__nv_bfloat16>";
    void (*k)(__nv_bfloat16 *, const T_ *, I, I, I, I, I, I, I) = wide ? to_bf16_4d<T_, I, 4> : to_bf16_4d<T_, I, 1>;
    ULY_LAUNCH_AS(name, k, uly_cu_blocks(wide ? n / 4 : n, 256), 256, uly_cu_stream)(dst, src, (I)T, (I)Hh, (I)D, (I)sb,
                                                                                   (I)st, (I)sh, (I)n);
}
template <typename T_>
static void launch_to_bf16_4d(__nv_bfloat16 *dst, const T_ *src, int64_t B, int64_t T, int64_t Hh, int64_t D, int64_t sb,
                              int64_t st, int64_t sh) {
    const int64_t n = B * T * Hh * D;
    const int64_t reach = (B - 1) * (sb < 0 ? -sb : sb) + (T - 1) * (st < 0 ? -st : st) + (Hh - 1) * (sh < 0 ? -sh : sh) + D;
    if (uly_cu_index32(n, reach)) launch_to_bf16_4d<T_, int32_t>(dst, src, T, Hh, D, sb, st, sh, n);
    else launch_to_bf16_4d<T_, int64_t>(dst, src, T, Hh, D, sb, st, sh, n);
}

/* out rows with no visible key at all (their chunk has an empty band) are 0, lse -inf */
__global__ static void empty_rows(float *out, float *lse, geom g, int64_t b, int64_t h, int64_t i0, int64_t c) {
    ULY_CU_FOR(e, c * g.D) {
        int64_t r = e / g.D;
        out[((b * g.Tq + i0 + r) * g.H + h) * g.D + e % g.D] = 0.0f;
        if (e % g.D == 0) lse[(b * g.H + h) * g.Tq + i0 + r] = -INFINITY;
    }
}

static int gemm_ok(cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    uly_cu_fail_msg(what, "cuBLAS call failed");
    return -1;
}

/* C (col-major m x n, ldc) = alpha op(A) op(B) + beta C with f32 accumulation: f32 operands on TF32
 * tensor cores (full f32 after uly_cuda_set_tf32(0), as every f32 GEMM), or bf16 operands (mixed
 * precision) at the bf16 rate */
static int gemm_t(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const void *A,
                  int64_t lda, const void *B, int64_t ldb, float beta, float *C, int64_t ldc, cudaDataType_t type,
                  const char *what) {
    cublasComputeType_t compute = type == CUDA_R_32F && uly_cuda_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    uly_cu_prof_scope prof(what, uly_cu_stream);   /* `what` names the chunk's product */
    return gemm_ok(cublasGemmEx(uly_cu_cublas(), ta, tb, (int)m, (int)n, (int)k, &alpha, A, type, (int)lda, B, type,
                                (int)ldb, &beta, C, CUDA_R_32F, (int)ldc, compute, CUBLAS_GEMM_DEFAULT), what);
}

/* the GEMM operands of one problem: the f32 tensors in place, or (mixed precision) contiguous bf16
 * copies made once per call; element size and row strides follow */
typedef struct {
    int bf16;
    cudaDataType_t type;
    size_t es;
    const void *q, *k, *v, *dout;
    int64_t qb, qt, qh, kb, kt, kh, vb, vt, vh;
    __nv_bfloat16 *buf;
} operands;

static void operands_make(operands *o, const geom &g, const float *dout) {
    memset(o, 0, sizeof *o);
    o->type = CUDA_R_32F;
    o->es = 4;
    o->q = g.q; o->k = g.k; o->v = g.v; o->dout = dout;
    o->qb = g.qb; o->qt = g.qt; o->qh = g.qh; o->kb = g.kb; o->kt = g.kt; o->kh = g.kh;
    o->vb = g.vb; o->vt = g.vt; o->vh = g.vh;
}

/* one operand into the bf16 buffer at *cur (advanced past it): rounded from f32, or compacted from
 * bf16; a bf16 operand already compact ([B, T, Hh, D] rows Hh D apart) is used in place */
static int in_place(int is16, int64_t B, int64_t T, int64_t Hh, int64_t D, int64_t sb, int64_t st, int64_t sh) {
    return is16 && sh == D && st == Hh * D && (sb == T * Hh * D || B == 1);
}

static const __nv_bfloat16 *bf16_operand(__nv_bfloat16 **cur, const float *src, int is16, int64_t B, int64_t T,
                                         int64_t Hh, int64_t D, int64_t sb, int64_t st, int64_t sh) {
    const int64_t n = B * T * Hh * D;
    if (in_place(is16, B, T, Hh, D, sb, st, sh)) return (const __nv_bfloat16 *)src;
    __nv_bfloat16 *dst = *cur;
    *cur += n;
    if (n == 0) return dst;
    if (is16) launch_to_bf16_4d(dst, (const __nv_bfloat16 *)src, B, T, Hh, D, sb, st, sh);
    else launch_to_bf16_4d(dst, src, B, T, Hh, D, sb, st, sh);
    return dst;
}

/* the bf16 operands (compact copies, made once per call; bf16 inputs already compact are read in
 * place: a bf16 KV cache is not copied at every decoding step) */
static int operands_bf16(operands *o, const geom &g, const float *dout) {
    int64_t nq = g.B * g.Tq * g.H * g.D, nk = g.B * g.Tk * g.Hkv * g.D, total = dout ? nq : 0;
    if (!in_place(g.q16, g.B, g.Tq, g.H, g.D, g.qb, g.qt, g.qh)) total += nq;
    if (!in_place(g.k16, g.B, g.Tk, g.Hkv, g.D, g.kb, g.kt, g.kh)) total += nk;
    if (!in_place(g.v16, g.B, g.Tk, g.Hkv, g.D, g.vb, g.vt, g.vh)) total += nk;
    cudaError_t e = cudaMallocAsync((void **)&o->buf, (size_t)(total ? total : 1) * sizeof(__nv_bfloat16), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("bf16 attention operands", e); return -1; }
    __nv_bfloat16 *cur = o->buf;
    o->q = bf16_operand(&cur, g.q, g.q16, g.B, g.Tq, g.H, g.D, g.qb, g.qt, g.qh);
    o->k = bf16_operand(&cur, g.k, g.k16, g.B, g.Tk, g.Hkv, g.D, g.kb, g.kt, g.kh);
    o->v = bf16_operand(&cur, g.v, g.v16, g.B, g.Tk, g.Hkv, g.D, g.vb, g.vt, g.vh);
    o->dout = dout ? bf16_operand(&cur, dout, 0, g.B, g.Tq, g.H, g.D, g.Tq * g.H * g.D, g.H * g.D, g.D) : NULL;
    ULY_CU_LAUNCHED("to_bf16_4d");
    o->bf16 = 1;
    o->type = CUDA_R_16BF;
    o->es = 2;
    o->qt = g.H * g.D; o->qh = g.D; o->qb = g.Tq * o->qt;
    o->kt = o->vt = g.Hkv * g.D; o->kh = o->vh = g.D; o->kb = o->vb = g.Tk * o->kt;
    return 0;
}

static const void *at(const void *p, int64_t elems, size_t es) { return (const char *)p + elems * (int64_t)es; }

/* one (batch, head)'s operands (f32 in place or the bf16 copies): query head h reads K/V head
 * h / (H / Hkv); rows of Q, K, V are qt, kt, vt elements apart */
typedef struct { const void *Q, *K, *V; int64_t hk; } head_ops;
static head_ops head_of(const geom &g, const operands &op, int64_t b, int64_t h) {
    head_ops o;
    o.hk = h / (g.H / g.Hkv);
    o.Q = at(op.q, b * op.qb + h * op.qh, op.es);
    o.K = at(op.k, b * op.kb + o.hk * op.kh, op.es);
    o.V = at(op.v, b * op.vb + o.hk * op.vh, op.es);
    return o;
}

/* S [c, nk] = scale Q[i0 .. i0 + c) K[lo .. lo + nk)^T (row-major, as col-major S^T = K Q^T) */
static int chunk_scores(const geom &g, const operands &op, const head_ops &o, int64_t i0, int64_t c, int64_t lo,
                        int64_t nk, float *S, const char *what) {
    return gemm_t(CUBLAS_OP_T, CUBLAS_OP_N, nk, c, g.D, g.scale, at(o.K, lo * op.kt, op.es), op.kt,
                  at(o.Q, i0 * op.qt, op.es), op.qt, 0.0f, S, nk, op.type, what);
}

extern "C" int64_t cu_flash_scratch_floats(const flash_problem *p, int backward_) { (void)p; (void)backward_; return 0; }

extern "C" int cu_flash_forward(float *out, float *lse, float *scratch, const flash_problem *p) {
    (void)scratch;
    geom g = geom_of(p);
    if (g.B * g.H * g.Tq == 0) return 0;
    if (!uly_cu_cublas()) { uly_cu_fail_msg("flash_attention_forward", "no cuBLAS handle"); return 0; }
    operands op;
    operands_make(&op, g, NULL);
    if (p->bf16 && operands_bf16(&op, g, NULL)) return 0;
    if (op.bf16 && uly_cu_fused_attention_ok(g)) {
        uly_cu_fused_attention_forward(out, lse, g, (const __nv_bfloat16 *)op.q, (const __nv_bfloat16 *)op.k,
                                       (const __nv_bfloat16 *)op.v);
        cudaFreeAsync(op.buf, uly_cu_stream);
        return 0;
    }
    int64_t C = chunk_rows(g), per = C * (g.Tk > 0 ? g.Tk : 1);
    float *S = NULL;
    /* S (f32), and in bf16 mode P's bf16 copy after it */
    cudaError_t e = cudaMallocAsync((void **)&S, (size_t)per * (sizeof(float) + (op.bf16 ? 2 : 0)), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("flash_attention_forward scratch", e); if (op.buf) cudaFreeAsync(op.buf, uly_cu_stream); return 0; }
    __nv_bfloat16 *P16 = op.bf16 ? (__nv_bfloat16 *)(S + per) : NULL;
    int rc = 0;
    for (int64_t b = 0; b < g.B && !rc; b++)
        for (int64_t h = 0; h < g.H && !rc; h++) {
            const head_ops o = head_of(g, op, b, h);
            for (int64_t i0 = 0; i0 < g.Tq && !rc; i0 += C) {
                int64_t c = g.Tq - i0 < C ? g.Tq - i0 : C, lo, hi;
                chunk_band(g, i0, i0 + c, &lo, &hi);
                if (lo > hi) {
                    ULY_LAUNCH(empty_rows, uly_cu_blocks(c * g.D, 256), 256, uly_cu_stream)(out, lse, g, b, h, i0, c);
                    ULY_CU_LAUNCHED("empty_rows");
                    continue;
                }
                int64_t nk = hi - lo + 1;
                if ((rc = chunk_scores(g, op, o, i0, c, lo, nk, S, "flash attention S = Q K^T"))) break;
                ULY_LAUNCH(chunk_softmax, (unsigned)(c < 65535 ? c : 65535), 256, uly_cu_stream)(S, lse, g, b, h, i0, c, lo,
                                                                                               nk, 0, P16);
                ULY_CU_LAUNCHED("chunk_softmax");
                rc = gemm_t(CUBLAS_OP_N, CUBLAS_OP_N, g.D, c, nk, 1.0f, at(o.V, lo * op.vt, op.es), op.vt,
                            op.bf16 ? (const void *)P16 : (const void *)S, nk, 0.0f,
                            out + ((b * g.Tq + i0) * g.H + h) * g.D, g.H * g.D, op.type, "flash attention O = P V");
            }
        }
    cudaFreeAsync(S, uly_cu_stream);
    if (op.buf) cudaFreeAsync(op.buf, uly_cu_stream);
    return 0;
}

extern "C" int cu_flash_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                                 float *delta, float *scratch, const flash_problem *p) {
    (void)scratch;
    geom g = geom_of(p);
    int64_t qrows = g.B * g.H * g.Tq;
    if (qrows == 0) return 0;
    if (!uly_cu_cublas()) { uly_cu_fail_msg("flash_attention_backward", "no cuBLAS handle"); return 0; }
    operands op;
    operands_make(&op, g, dout);
    if (p->bf16 && operands_bf16(&op, g, dout)) return 0;
    if (op.bf16 && uly_cu_fused_attention_ok(g)) {
        ULY_LAUNCH(flash_delta<__nv_bfloat16>, warps_grid(qrows), 32 * WARPS, uly_cu_stream)(
            delta, (const __nv_bfloat16 *)op.dout, out, g);
        ULY_CU_LAUNCHED("flash_delta");
        uly_cu_fused_attention_backward(dq, dk, dv, g, (const __nv_bfloat16 *)op.q, (const __nv_bfloat16 *)op.k,
                                        (const __nv_bfloat16 *)op.v, (const __nv_bfloat16 *)op.dout, lse, delta);
        cudaFreeAsync(op.buf, uly_cu_stream);
        return 0;
    }
    int64_t C = chunk_rows(g), per = C * (g.Tk > 0 ? g.Tk : 1);
    float *P = NULL;
    /* P and dS (f32), and in bf16 mode their bf16 copies after them */
    cudaError_t e = cudaMallocAsync((void **)&P, (size_t)per * 2 * (sizeof(float) + (op.bf16 ? 2 : 0)), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("flash_attention_backward scratch", e); if (op.buf) cudaFreeAsync(op.buf, uly_cu_stream); return 0; }
    float *dS = P + per;
    __nv_bfloat16 *P16 = op.bf16 ? (__nv_bfloat16 *)(dS + per) : NULL, *dS16 = op.bf16 ? P16 + per : NULL;
    const void *Pg = op.bf16 ? (const void *)P16 : (const void *)P, *dSg = op.bf16 ? (const void *)dS16 : (const void *)dS;
    int rc = 0;
    const int64_t ldo = g.H * g.D, ldkv = g.Hkv * g.D;   /* rows of dout (and its bf16 copy), dq, dk, dv */
    for (int64_t b = 0; b < g.B && !rc; b++)
        for (int64_t h = 0; h < g.H && !rc; h++) {
            const head_ops o = head_of(g, op, b, h);
            const int64_t hk = o.hk;
            for (int64_t i0 = 0; i0 < g.Tq && !rc; i0 += C) {
                int64_t c = g.Tq - i0 < C ? g.Tq - i0 : C, lo, hi;
                chunk_band(g, i0, i0 + c, &lo, &hi);
                if (lo > hi) continue;
                int64_t nk = hi - lo + 1;
                const void *dO = at(op.dout, ((b * g.Tq + i0) * g.H + h) * g.D, op.es);
                if ((rc = chunk_scores(g, op, o, i0, c, lo, nk, P, "flash attention backward S = Q K^T"))) break;
                ULY_LAUNCH(chunk_softmax, (unsigned)(c < 65535 ? c : 65535), 256, uly_cu_stream)(P, (float *)lse, g, b, h,
                                                                                               i0, c, lo, nk, 1, P16);
                ULY_CU_LAUNCHED("chunk_softmax");
                if (dv && (rc = gemm_t(CUBLAS_OP_N, CUBLAS_OP_T, g.D, nk, c, 1.0f, dO, ldo, Pg, nk, 1.0f,
                                       dv + (b * g.Tk + lo) * ldkv + hk * g.D, ldkv, op.type, "flash attention dV += P^T dO")))
                    break;
                if (!dq && !dk) continue;
                if ((rc = gemm_t(CUBLAS_OP_T, CUBLAS_OP_N, nk, c, g.D, 1.0f, at(o.V, lo * op.vt, op.es), op.vt, dO, ldo,
                                 0.0f, dS, nk, op.type, "flash attention dP = dO V^T")))
                    break;
                ULY_LAUNCH(chunk_ds, (unsigned)(c < 65535 ? c : 65535), 256, uly_cu_stream)(dS, P, c, nk, g.scale, dS16);
                ULY_CU_LAUNCHED("chunk_ds");
                if (dk && (rc = gemm_t(CUBLAS_OP_N, CUBLAS_OP_T, g.D, nk, c, 1.0f, at(o.Q, i0 * op.qt, op.es), op.qt, dSg,
                                       nk, 1.0f, dk + (b * g.Tk + lo) * ldkv + hk * g.D, ldkv, op.type,
                                       "flash attention dK += dS^T Q")))
                    break;
                if (dq && (rc = gemm_t(CUBLAS_OP_N, CUBLAS_OP_N, g.D, c, nk, 1.0f, at(o.K, lo * op.kt, op.es), op.kt, dSg,
                                       nk, 1.0f, dq + (b * g.Tq + i0) * ldo + h * g.D, ldo, op.type,
                                       "flash attention dQ += dS K")))
                    break;
            }
        }
    cudaFreeAsync(P, uly_cu_stream);
    if (op.buf) cudaFreeAsync(op.buf, uly_cu_stream);
    return 0;
}

/* ---- the reference kernel: contiguous q [B, Tq, H, D], k / v [B, Tk, Hkv, D], probs [B, H, Tq, Tk] ---- */
static geom reference_geom(const float *q, const float *k, const float *v, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                           int64_t Hkv, int64_t D, float scale, int causal) {
    flash_problem p;
    memset(&p, 0, sizeof p);
    p.B = B; p.Tq = Tq; p.Tk = Tk; p.H = H; p.Hkv = Hkv; p.D = D; p.scale = scale;
    p.q.p = q; p.q.sb = Tq * H * D; p.q.st = H * D; p.q.sh = D;
    p.k.p = k; p.k.sb = Tk * Hkv * D; p.k.st = Hkv * D; p.k.sh = D;
    p.v.p = v; p.v.sb = Tk * Hkv * D; p.v.st = Hkv * D; p.v.sh = D;
    p.causal = causal; p.left = p.right = -1;
    return geom_of(&p);
}

extern "C" void cu_attention_forward(float *out, float *probs, const float *q, const float *k, const float *v, int64_t B,
                                     int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D, float scale, int causal) {
    geom g = reference_geom(q, k, v, B, Tq, Tk, H, Hkv, D, scale, causal);
    int64_t rows = B * H * Tq;
    if (rows == 0 || check_dims("attention_forward", g)) return;
    float *lse = NULL;
    cudaError_t e = cudaMallocAsync((void **)&lse, (size_t)rows * sizeof(float), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("attention_forward scratch", e); return; }
    ULY_LAUNCH(flash_fw, warps_grid(rows), 32 * WARPS, uly_cu_stream)(out, lse, g);
    ULY_CU_LAUNCHED("flash_fw");
    if (Tk > 0) {
        ULY_LAUNCH(write_probs, warps_grid(rows), 32 * WARPS, uly_cu_stream)(probs, lse, g);
        ULY_CU_LAUNCHED("write_probs");
    }
    cudaFreeAsync(lse, uly_cu_stream);
}

extern "C" int cu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                     const float *v, const float *probs, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                                     int64_t Hkv, int64_t D, float scale, int causal) {
    geom g = reference_geom(q, k, v, B, Tq, Tk, H, Hkv, D, scale, causal);
    int64_t rows = B * H * Tq;
    if (rows == 0) return 0;
    /* delta = rowsum(dout * out) needs out: out_i = sum_j p_ij v_j, formed here into scratch */
    float *scratch = NULL;
    cudaError_t e = cudaMallocAsync((void **)&scratch, (size_t)rows * (D + 1) * sizeof(float), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("attention_backward scratch", e); return -1; }
    float *out = scratch, *delta = scratch + rows * D, *lse = NULL;
    (void)lse;
    cudaError_t e2 = cudaMallocAsync((void **)&lse, (size_t)rows * sizeof(float), uly_cu_stream);
    if (e2 != cudaSuccess) { cudaFreeAsync(scratch, uly_cu_stream); uly_cu_fail("attention_backward scratch", e2); return -1; }
    ULY_LAUNCH(flash_fw, warps_grid(rows), 32 * WARPS, uly_cu_stream)(out, lse, g);
    ULY_CU_LAUNCHED("flash_fw");
    int rc = backward(dq, dk, dv, dout, out, lse, probs, delta, g, "attention_backward");
    cudaFreeAsync(lse, uly_cu_stream);
    cudaFreeAsync(scratch, uly_cu_stream);
    return rc;
}
