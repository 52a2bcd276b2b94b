/* kernels/cuda/attention.cu — attention on the GPU, the contracts of kernels/cpu/attention_ref.c
 * and kernels/cpu/flash_attention.h: flash attention (online softmax, only the output and one
 * log-sum-exp per row kept; causal, sliding-window, block-sparse and document masks; GQA without
 * repeating K/V; strided q/k/v read in place) and the reference kernel that also writes the
 * probabilities. This is the portable version (any sm_80+): one warp per query row (forward, dQ)
 * or per key row (dK, dV), head dims up to 256 spread over the lanes, keys outside the causal /
 * window band never visited, no float atomics (the same bits run to run). */
#include <math.h>
#include <stdio.h>
#include "common.cuh"

#define WARPS 4
#define MAXD 256
#define PER_LANE (MAXD / 32)

typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D;
    float scale;
    const float *q, *k, *v;
    int64_t qb, qt, qh, kb, kt, kh, vb, vt, vh;
    int causal;
    int64_t left, right;
    const int32_t *layout;
    int64_t bs, nbc;
    const int32_t *q_doc, *k_doc;
} geom;

static geom geom_of(const flash_problem *p) {
    geom g;
    g.B = p->B; g.Tq = p->Tq; g.Tk = p->Tk; g.H = p->H; g.Hkv = p->Hkv; g.D = p->D; g.scale = p->scale;
    g.q = p->q.p; g.k = p->k.p; g.v = p->v.p;
    g.qb = p->q.sb; g.qt = p->q.st; g.qh = p->q.sh;
    g.kb = p->k.sb; g.kt = p->k.st; g.kh = p->k.sh;
    g.vb = p->v.sb; g.vt = p->v.st; g.vh = p->v.sh;
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
__global__ static void flash_delta(float *delta, const float *dout, const float *out, geom g) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), rows = g.B * g.H * g.Tq;
    if (row >= rows) return;
    int64_t i = row % g.Tq, h = (row / g.Tq) % g.H, b = row / (g.Tq * g.H);
    const float *d = dout + ((b * g.Tq + i) * g.H + h) * g.D, *o = out + ((b * g.Tq + i) * g.H + h) * g.D;
    float s = 0.0f;
    for (int64_t e = lane; e < g.D; e += 32) s += d[e] * o[e];
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
    ULY_LAUNCH(flash_delta, warps_grid(qrows), 32 * WARPS, uly_cu_stream)(delta, dout, out, g);
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

extern "C" int64_t cu_flash_scratch_floats(const flash_problem *p, int backward_) { (void)p; (void)backward_; return 0; }

extern "C" int cu_flash_forward(float *out, float *lse, float *scratch, const flash_problem *p) {
    (void)scratch;
    geom g = geom_of(p);
    if (check_dims("flash_attention_forward", g)) return 0;  /* reported through take_error */
    int64_t rows = g.B * g.H * g.Tq;
    if (rows == 0) return 0;
    ULY_LAUNCH(flash_fw, warps_grid(rows), 32 * WARPS, uly_cu_stream)(out, lse, g);
    ULY_CU_LAUNCHED("flash_fw");
    return 0;
}

extern "C" int cu_flash_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                                 float *delta, float *scratch, const flash_problem *p) {
    (void)scratch;
    geom g = geom_of(p);
    backward(dq, dk, dv, dout, out, lse, NULL, delta, g, "flash_attention_backward");
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
