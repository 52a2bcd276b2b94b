/* kernels/cpu/attention_ref.c — reference (materialised) scaled dot-product attention, BLAS sgemm.
 *
 * q [B, Tq, H, D], k and v [B, Tk, Hkv, D], out [B, Tq, H, D], probs [B, H, Tq, Tk]; all
 * contiguous. Query head h uses K/V head g = h / (H / Hkv) (grouped-query attention).
 *   forward : S = scale * Q_h K_g^T; P = softmax_rows(S + mask) -> probs[b, h]; O_h = P V_g
 *             causal: query i sees key j iff j <= i + (Tk - Tq) (bottom-right aligned);
 *             masked entries of P are exactly 0, a row that sees no key is all 0 (output 0).
 *   backward: dV_g += P^T dO_h;  dP = dO_h V_g^T;  dS = P * (dP - rowsum(dP * P));
 *             dQ_h += scale * dS K_g;  dK_g += scale * dS^T Q_h
 * Backward ACCUMULATES (+=) into dq, dk, dv; a NULL gradient pointer is skipped.
 * Per-head matrices are addressed in place through strided leading dimensions (H*D for rows of
 * q/out/dout, Hkv*D for rows of k/v): no copies. Causal blocks skip the fully masked keys.
 *
 * Determinism: multi-threaded OpenBLAS sgemm does NOT give the same bits as single-threaded
 * sgemm once K exceeds its blocking (checked on 0.3.21), so every sgemm here runs
 * single-threaded (pthread OpenBLAS is held at 1 thread for the call and restored after; an
 * OpenMP OpenBLAS is single-threaded inside our parallel regions) and the parallelism comes from
 * a decomposition into blocks of fixed size (RB query rows, CB keys) that does not depend on
 * the thread count; only the scheduling of the blocks does:
 *   forward   items (b, h, query block): S, softmax, O rows of that block;
 *   backward  phase 1, items (b, h, query block): dS rows (scratch) and dQ rows;
 *             phase 2, items (b, g, key block): dV, dK rows of that block, the query heads of
 *             group g accumulated in increasing h (a fixed order).
 * Scratch: dS for a batch of K/V groups, malloc'ed per call (batch size is a scheduling choice).
 */
#include "kernels.h"
#include <cblas.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define RB 64                 /* query rows per block */
#define CB 64                 /* keys per block (backward dK/dV) */
#define ATT_PAR_MIN (1 << 16) /* multiply-adds per call below which no threads are started */
#define SCRATCH_MAX_FLOATS ((int64_t)1 << 26) /* soft cap on the dS scratch (256 MiB) */

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* C[M,N] = alpha op(A) op(B) + beta C (row-major), beta 0 or 1; tolerates empty dimensions. */
static void gemm(enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K,
                 float alpha, const float *A, int64_t lda, const float *Bm, int64_t ldb, float beta,
                 float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (beta == 0.0f)
            for (int64_t r = 0; r < M; r++) memset(C + r * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    cblas_sgemm(CblasRowMajor, ta, tb, (blasint)M, (blasint)N, (blasint)K, alpha, A, (blasint)lda, Bm,
                (blasint)ldb, beta, C, (blasint)ldc);
}

/* hold pthread OpenBLAS single-threaded for the call (see the determinism note above; it also
 * must not spawn its own threads from inside our parallel regions); restore afterwards. */
static int blas_single_begin(void) {
    if (openblas_get_parallel() == 1) {
        int n = openblas_get_num_threads();
        if (n > 1) {
            openblas_set_num_threads(1);
            return n;
        }
    }
    return 0;
}
static void blas_single_end(int saved) {
    if (saved > 0) openblas_set_num_threads(saved);
}

/* keys [0, n) are visible to query row i (n is non-decreasing in i) */
static inline int64_t visible(int64_t i, int64_t Tq, int64_t Tk, int causal) {
    if (!causal) return Tk;
    int64_t lim = i + (Tk - Tq) + 1;
    return lim < 0 ? 0 : (lim > Tk ? Tk : lim);
}

static void softmax_row(float *s, int64_t nv, int64_t Tk) {
    if (nv > 0) {
        float m = s[0];
        for (int64_t j = 1; j < nv; j++) m = s[j] > m ? s[j] : m;
        double sum = 0.0;
        for (int64_t j = 0; j < nv; j++) {
            float e = expf(s[j] - m);
            s[j] = e;
            sum += (double)e;
        }
        float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j < nv; j++) s[j] *= inv;
    }
    for (int64_t j = nv; j < Tk; j++) s[j] = 0.0f;
}

/* dS = P * (dP - rowsum(dP * P)) in place over dP; masked entries 0 */
static void dsoftmax_row(float *ds, const float *p, int64_t nv, int64_t Tk) {
    double acc = 0.0;
    for (int64_t j = 0; j < nv; j++) acc += (double)ds[j] * (double)p[j];
    float a = (float)acc;
    for (int64_t j = 0; j < nv; j++) ds[j] = p[j] * (ds[j] - a);
    for (int64_t j = nv; j < Tk; j++) ds[j] = 0.0f;
}

typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D, rep, ldq, ldk;
    float scale;
    int causal;
} att_dims;

static void fwd_block(float *out, float *probs, const float *q, const float *k, const float *v,
                      const att_dims *a, int64_t b, int64_t h, int64_t rb) {
    const int64_t Tq = a->Tq, Tk = a->Tk, D = a->D, g = h / a->rep;
    const int64_t i0 = rb * RB, i1 = i0 + RB < Tq ? i0 + RB : Tq, m = i1 - i0;
    const int64_t kmax = visible(i1 - 1, Tq, Tk, a->causal); /* keys any row of the block sees */
    const float *Q = q + ((b * Tq + i0) * a->H + h) * D;
    const float *K = k + (b * Tk * a->Hkv + g) * D;
    const float *V = v + (b * Tk * a->Hkv + g) * D;
    float *P = probs + ((b * a->H + h) * Tq + i0) * Tk;
    float *O = out + ((b * Tq + i0) * a->H + h) * D;
    gemm(CblasNoTrans, CblasTrans, m, kmax, D, a->scale, Q, a->ldq, K, a->ldk, 0.0f, P, Tk);
    for (int64_t r = 0; r < m; r++) softmax_row(P + r * Tk, visible(i0 + r, Tq, Tk, a->causal), Tk);
    gemm(CblasNoTrans, CblasNoTrans, m, D, kmax, 1.0f, P, Tk, V, a->ldk, 0.0f, O, a->ldq);
}

void attention_forward(float *out, float *probs, const float *q, const float *k, const float *v,
                       int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D,
                       float scale, int causal) {
    if (B <= 0 || Tq <= 0 || H <= 0 || Hkv <= 0) return;
    att_dims a = {B, Tq, Tk, H, Hkv, D, H / Hkv, H * D, Hkv * D, scale, causal};
    const int64_t nrb = (Tq + RB - 1) / RB, items = B * H * nrb;
    const int par = max_threads() > 1 && items > 1 && 2 * B * H * Tq * Tk * (D > 0 ? D : 1) >= ATT_PAR_MIN;
    int saved = blas_single_begin();
    #pragma omp parallel for schedule(dynamic, 1) if (par)
    for (int64_t it = 0; it < items; it++) {
        int64_t bh = it / nrb;
        fwd_block(out, probs, q, k, v, &a, bh / H, bh % H, it % nrb);
    }
    blas_single_end(saved);
}

/* phase 1: dS rows of query block rb of head (b, h) into dS (the head's [Tq, Tk] scratch), dQ rows */
static void bwd_rows(float *dq, float *dS, const float *dout, const float *k, const float *v,
                     const float *probs, const att_dims *a, int64_t b, int64_t h, int64_t rb) {
    const int64_t Tq = a->Tq, Tk = a->Tk, D = a->D, g = h / a->rep;
    const int64_t i0 = rb * RB, i1 = i0 + RB < Tq ? i0 + RB : Tq, m = i1 - i0;
    const int64_t kmax = visible(i1 - 1, Tq, Tk, a->causal);
    const int64_t qoff = ((b * Tq + i0) * a->H + h) * D;
    const float *K = k + (b * Tk * a->Hkv + g) * D;
    const float *V = v + (b * Tk * a->Hkv + g) * D;
    const float *P = probs + ((b * a->H + h) * Tq + i0) * Tk;
    float *S = dS + i0 * Tk;
    gemm(CblasNoTrans, CblasTrans, m, kmax, D, 1.0f, dout + qoff, a->ldq, V, a->ldk, 0.0f, S, Tk);
    for (int64_t r = 0; r < m; r++) dsoftmax_row(S + r * Tk, P + r * Tk, visible(i0 + r, Tq, Tk, a->causal), Tk);
    if (dq) gemm(CblasNoTrans, CblasNoTrans, m, D, kmax, a->scale, S, Tk, K, a->ldk, 1.0f, dq + qoff, a->ldq);
}

/* phase 2: dV, dK rows of key block cb of K/V head (b, g); dS_group holds the rep heads' dS */
static void bwd_keys(float *dk, float *dv, const float *dS_group, size_t dS_stride, const float *dout,
                     const float *q, const float *probs, const att_dims *a, int64_t b, int64_t g, int64_t cb) {
    const int64_t Tq = a->Tq, Tk = a->Tk, D = a->D;
    const int64_t c0 = cb * CB, n = (c0 + CB < Tk ? c0 + CB : Tk) - c0;
    int64_t is = a->causal ? c0 - (Tk - Tq) : 0; /* first query row that sees key c0 */
    if (is < 0) is = 0;
    if (is >= Tq) return; /* keys never seen: zero gradient */
    const int64_t mr = Tq - is, koff = ((b * Tk + c0) * a->Hkv + g) * D;
    for (int64_t r = 0; r < a->rep; r++) {
        const int64_t h = g * a->rep + r, qoff = ((b * Tq + is) * a->H + h) * D;
        const float *P = probs + ((b * a->H + h) * Tq + is) * Tk + c0;
        if (dv) gemm(CblasTrans, CblasNoTrans, n, D, mr, 1.0f, P, Tk, dout + qoff, a->ldq, 1.0f, dv + koff, a->ldk);
        if (dk) gemm(CblasTrans, CblasNoTrans, n, D, mr, a->scale, dS_group + (size_t)r * dS_stride + is * Tk + c0, Tk,
                     q + qoff, a->ldq, 1.0f, dk + koff, a->ldk);
    }
}

int attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                        const float *k, const float *v, const float *probs,
                        int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D,
                        float scale, int causal) {
    if (B <= 0 || Tq <= 0 || Tk <= 0 || H <= 0 || Hkv <= 0 || D <= 0) return 0; /* no gradient flows */
    if (!dq && !dk && !dv) return 0;
    att_dims a = {B, Tq, Tk, H, Hkv, D, H / Hkv, H * D, Hkv * D, scale, causal};
    const int64_t rep = a.rep, ngroups = B * Hkv;
    const int64_t nrb = (Tq + RB - 1) / RB, nkb = (Tk + CB - 1) / CB;
    const int nt = max_threads();
    const int par = nt > 1 && 4 * B * H * Tq * Tk * D >= ATT_PAR_MIN;
    const int need_ds = dq || dk;
    /* dS scratch per head, stride rounded to 64 bytes; a batch of groups gives every thread work */
    const size_t stride = ((size_t)Tq * (size_t)Tk + 15) & ~(size_t)15;
    int64_t per_group = rep * nrb < nkb ? rep * nrb : nkb;
    int64_t nbatch = par ? (4 * nt + per_group - 1) / per_group : 1;
    if (nbatch > ngroups) nbatch = ngroups;
    while (nbatch > 1 && nbatch * rep * (int64_t)stride > SCRATCH_MAX_FLOATS) nbatch /= 2;
    float *scratch = NULL;
    if (need_ds) {
        scratch = aligned_alloc(64, (size_t)nbatch * (size_t)rep * stride * sizeof(float));
        if (!scratch && nbatch > 1) {
            nbatch = 1;
            scratch = aligned_alloc(64, (size_t)rep * stride * sizeof(float));
        }
        if (!scratch) return -1; /* the caller reports it; no gradient was written */
    }
    int saved = blas_single_begin();
    for (int64_t bg0 = 0; bg0 < ngroups; bg0 += nbatch) {
        const int64_t nb = ngroups - bg0 < nbatch ? ngroups - bg0 : nbatch;
        if (need_ds) {
            #pragma omp parallel for schedule(dynamic, 1) if (par)
            for (int64_t it = 0; it < nb * rep * nrb; it++) {
                const int64_t lh = it / nrb, bg = bg0 + lh / rep;
                const int64_t b = bg / Hkv, h = (bg % Hkv) * rep + lh % rep;
                bwd_rows(dq, scratch + (size_t)lh * stride, dout, k, v, probs, &a, b, h, it % nrb);
            }
        }
        if (dk || dv) {
            #pragma omp parallel for schedule(dynamic, 1) if (par)
            for (int64_t it = 0; it < nb * nkb; it++) {
                const int64_t lg = it / nkb, bg = bg0 + lg;
                bwd_keys(dk, dv, scratch ? scratch + (size_t)lg * rep * stride : NULL, stride, dout, q, probs, &a,
                         bg / Hkv, bg % Hkv, it % nkb);
            }
        }
    }
    blas_single_end(saved);
    free(scratch);
    return 0;
}
