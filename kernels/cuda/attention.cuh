/* kernels/cuda/attention.cuh — what the CUDA attention kernels share (attention.cu, the chunked
 * cuBLAS path and the reference kernel; attention_fused.cu, the fused tensor-core path): one
 * problem's geometry and which keys a query row may see (kernels/cpu/flash_attention.h's masks). */
#ifndef ULY_CUDA_ATTENTION_CUH
#define ULY_CUDA_ATTENTION_CUH
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <cuda_bf16.h>
#include "common.cuh"

typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D;
    float scale;
    const float *q, *k, *v;       /* f32, or bf16 where q16 / k16 / v16 say so (bf16 precision only) */
    int64_t qb, qt, qh, kb, kt, kh, vb, vt, vh;
    int q16, k16, v16;
    int causal;
    int64_t left, right;
    const int32_t *layout;
    int64_t bs, nbc;
    const int32_t *q_doc, *k_doc;
} geom;

static inline geom geom_of(const flash_problem *p) {
    geom g;
    g.B = p->B; g.Tq = p->Tq; g.Tk = p->Tk; g.H = p->H; g.Hkv = p->Hkv; g.D = p->D; g.scale = p->scale;
    g.q = p->q.p; g.k = p->k.p; g.v = p->v.p;
    g.qb = p->q.sb; g.qt = p->q.st; g.qh = p->q.sh;
    g.kb = p->k.sb; g.kt = p->k.st; g.kh = p->k.sh;
    g.vb = p->v.sb; g.vt = p->v.st; g.vh = p->v.sh;
    g.q16 = p->q.dtype == ULY_DTYPE_BF16; g.k16 = p->k.dtype == ULY_DTYPE_BF16; g.v16 = p->v.dtype == ULY_DTYPE_BF16;
    g.causal = p->causal; g.left = p->left; g.right = p->right;
    g.layout = p->layout; g.bs = p->bs; g.nbc = p->nbc;
    g.q_doc = p->q_doc; g.k_doc = p->k_doc;
    return g;
}

/* the band of keys query i may see ([lo, hi], empty when lo > hi) before the layout/doc checks */
__device__ static inline void band(const geom &g, int64_t i, int64_t *lo, int64_t *hi) {
    int64_t ip = i + g.Tk - g.Tq, a = 0, b = g.Tk - 1;
    if (g.causal && ip < b) b = ip;
    if (g.left >= 0 && ip - g.left > a) a = ip - g.left;
    if (g.right >= 0 && ip + g.right < b) b = ip + g.right;
    *lo = a;
    *hi = b;
}
__device__ static inline int visible(const geom &g, int64_t b, int64_t i, int64_t j) {
    int64_t lo, hi;
    band(g, i, &lo, &hi);
    if (j < lo || j > hi) return 0;
    if (g.layout && !g.layout[(i / g.bs) * g.nbc + j / g.bs]) return 0;
    if (g.q_doc && g.q_doc[b * g.Tq + i] != g.k_doc[b * g.Tk + j]) return 0;
    return 1;
}

/* the keys any row of [i0, i1) may see: the union of the rows' causal / window bands */
__host__ __device__ static inline void chunk_band(const geom &g, int64_t i0, int64_t i1, int64_t *lo, int64_t *hi) {
    int64_t off = g.Tk - g.Tq, a = 0, b = g.Tk - 1;
    if (g.causal && i1 - 1 + off < b) b = i1 - 1 + off;
    if (g.left >= 0 && i0 + off - g.left > a) a = i0 + off - g.left;
    if (g.right >= 0 && i1 - 1 + off + g.right < b) b = i1 - 1 + off + g.right;
    *lo = a;
    *hi = b;
}

/* the fused tensor-core path (attention_fused.cu): bf16 operands [B, T, heads, D] contiguous,
 * head dims 32, 64, 128; 0 from *_ok when the problem is not for it (or ULY_CUDA_ATTN=chunked) */
int uly_cu_fused_attention_ok(const geom &g);
int uly_cu_fused_attention_forward(float *out, float *lse, const geom &g, const __nv_bfloat16 *q,
                                   const __nv_bfloat16 *k, const __nv_bfloat16 *v);
int uly_cu_fused_attention_backward(float *dq, float *dk, float *dv, const geom &g, const __nv_bfloat16 *q,
                                    const __nv_bfloat16 *k, const __nv_bfloat16 *v, const __nv_bfloat16 *dout,
                                    const float *lse, const float *delta);

#endif
