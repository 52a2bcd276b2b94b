/* kernels/cpu/matmul.c — strided, batched, broadcasting GEMM on top of cblas_sgemm.
 * Transposed operands are passed to BLAS as transposes (no copies); batches whose output is
 * broadcast (stride 0, as for a weight gradient) accumulate in a fixed order.
 * Threads: OpenBLAS (pthread build) runs single-threaded (uly_set_num_threads keeps it at 1) and
 * a large GEMM is cut into one block of output rows (or columns) per OpenMP thread, each a
 * single-threaded sgemm: OpenBLAS's own worker threads spin between calls and took ~20 % of a
 * training step from our OpenMP kernels on 2 cores. */
#include <cblas.h>
#include <stdlib.h>
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define SPLIT_MIN_FLOPS (1LL << 21)   /* multiply-adds below which one thread does the GEMM */
#define SPLIT_MIN_SIDE 32             /* rows (columns) per thread at least */

/* can (rows x cols, strides rs/cs) be handed to BLAS as row-major or transposed? */
static int layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, CBLAS_TRANSPOSE *trans, int64_t *ld) {
    if (cols <= 1) cs = 1;
    if (rows <= 1) rs = cols > 1 ? cols : 1;
    if (cs == 1 && rs >= (cols > 1 ? cols : 1)) { *trans = CblasNoTrans; *ld = rs; return 1; }
    if (rows <= 1) rs = 1; /* try the transposed reading */
    if (cols <= 1) cs = rows > 1 ? rows : 1;
    if (rs == 1 && cs >= (rows > 1 ? rows : 1)) { *trans = CblasTrans; *ld = cs; return 1; }
    return 0;
}

int gemm_operand_ok(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    CBLAS_TRANSPOSE t;
    int64_t ld;
    return layout(rows, cols, rs, cs, &t, &ld);
}

/* C (row-major M x N) = A B + beta C with the output cut into per-thread blocks of rows (or of
 * columns when there are few rows); each block is one single-threaded sgemm over the whole K */
static void sgemm_split(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K, const float *a,
                        int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    int T = 1;
#ifdef _OPENMP
    if (!omp_in_parallel() && M * N * K >= SPLIT_MIN_FLOPS) T = omp_get_max_threads();
#endif
    int by_rows = M >= (int64_t)T * SPLIT_MIN_SIDE, by_cols = !by_rows && N >= (int64_t)T * SPLIT_MIN_SIDE;
    if (T <= 1 || (!by_rows && !by_cols)) {
        cblas_sgemm(CblasRowMajor, ta, tb, (blasint)M, (blasint)N, (blasint)K, 1.0f, a, (blasint)lda, b, (blasint)ldb,
                    beta, c, (blasint)ldc);
        return;
    }
    const int64_t len = by_rows ? M : N;
    #pragma omp parallel for num_threads(T) schedule(static, 1)
    for (int t = 0; t < T; t++) {
        int64_t lo = len * t / T, n = len * (t + 1) / T - lo;
        if (n <= 0) continue;
        if (by_rows) /* rows lo.. of A (row i of a transposed A is its column i) and of C */
            cblas_sgemm(CblasRowMajor, ta, tb, (blasint)n, (blasint)N, (blasint)K, 1.0f,
                        a + (ta == CblasNoTrans ? lo * lda : lo), (blasint)lda, b, (blasint)ldb, beta, c + lo * ldc,
                        (blasint)ldc);
        else       /* columns lo.. of B and of C */
            cblas_sgemm(CblasRowMajor, ta, tb, (blasint)M, (blasint)n, (blasint)K, 1.0f, a, (blasint)lda,
                        b + (tb == CblasNoTrans ? lo : lo * ldb), (blasint)ldb, beta, c + lo, (blasint)ldc);
    }
}

/* the batches of a [nb]-dim batch shape in order: offsets of A, B, C for batch index idx, and
 * whether it is the first batch to reach its block of C (C broadcast over a dim: later ones add) */
static int batch_offsets(int nb, const int64_t *idx, const uly_mat *A, const uly_mat *B, const uly_mat *C,
                         int64_t *oa, int64_t *ob, int64_t *oc) {
    int first = 1;
    *oa = *ob = *oc = 0;
    for (int d = 0; d < nb; d++) {
        *oa += idx[d] * A->bstride[d]; *ob += idx[d] * B->bstride[d]; *oc += idx[d] * C->bstride[d];
        if (C->bstride[d] == 0 && idx[d] > 0) first = 0;
    }
    return first;
}
static void next_batch(int nb, const int64_t *bshape, int64_t *idx) {
    for (int d = nb - 1; d >= 0; d--) {
        if (++idx[d] < bshape[d]) break;
        idx[d] = 0;
    }
}

void gemm_batched(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C,
                  int64_t M, int64_t N, int64_t K, float beta) {
    if (M == 0 || N == 0) return;
    CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans, tc = CblasNoTrans;
    int64_t lda = 1, ldb = 1, ldc = 1;
    layout(M, K, A.rs, A.cs, &ta, &lda);
    layout(K, N, B.rs, B.cs, &tb, &ldb);
    layout(M, N, C.rs, C.cs, &tc, &ldc);
    int64_t batches = 1, idx[8] = {0};
    for (int d = 0; d < nb; d++) batches *= bshape[d];
    for (int64_t bi = 0; bi < batches; bi++, next_batch(nb, bshape, idx)) {
        int64_t oa, ob, oc;
        float b = batch_offsets(nb, idx, &A, &B, &C, &oa, &ob, &oc) ? beta : 1.0f;
        if (K == 0) {
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) C.p[oc + i * ldc + j] = b == 0.0f ? 0.0f : C.p[oc + i * ldc + j] * b;
        } else {
            sgemm_split(ta, tb, M, N, K, A.p + oa, lda, B.p + ob, ldb, b, C.p + oc, ldc);
        }
    }
}

/* element `off` of a GEMM operand, f32 or bf16 */
static void *elem(uly_mat m, int64_t off) { return (char *)m.p + off * (m.dtype == KDT_BF16 ? 2 : 4); }

/* rows x cols at p (f32 or bf16: dt; strides rs, cs) rounded to bf16 (nearest even) into dst,
 * contiguous f32 */
static void rounded_copy(float *dst, const void *p, int dt, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    #pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            dst[i * cols + j] = dt == KDT_BF16 ? bf16_bits_f32(((const uint16_t *)p)[i * rs + j * cs])
                                                : f32_round_bf16(((const float *)p)[i * rs + j * cs]);
}

/* the fallback's buffers (rounded A and B, an f32 C for a bf16 one), grown and kept: first-touch
 * faults are slow; a second host thread in here at the same time gets buffers of its own */
static struct { float *p[3]; int64_t n[3]; } spare;
static int spare_busy;

static float *take(float **own, int k, int mine, int64_t n) {
    if (!mine) return *own = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (spare.n[k] < n) {
        free(spare.p[k]);
        spare.p[k] = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
        spare.n[k] = spare.p[k] ? n : 0;
    }
    return spare.p[k];
}

/* one batch of gemm_batched_bf16 through OpenBLAS: the operands rounded into f32 copies, a bf16
 * C computed in f32 and rounded once; -1 without memory */
static int rounded_sgemm(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, float beta) {
    const int mine = !__atomic_exchange_n(&spare_busy, 1, __ATOMIC_ACQUIRE), c16 = C.dtype == KDT_BF16;
    float *own[3] = {NULL, NULL, NULL};
    float *ra = take(&own[0], 0, mine, M * K), *rb = take(&own[1], 1, mine, K * N);
    float *cf = c16 ? take(&own[2], 2, mine, M * N) : NULL;
    const int ok = ra && rb && (!c16 || cf);
    if (ok) {
        rounded_copy(ra, A.p, A.dtype, M, K, A.rs, A.cs);
        rounded_copy(rb, B.p, B.dtype, K, N, B.rs, B.cs);
        uly_mat a1 = {.p = ra, .rs = K, .cs = 1}, b1 = {.p = rb, .rs = N, .cs = 1};
        uly_mat c1 = c16 ? (uly_mat){.p = cf, .rs = N, .cs = 1} : C;
        gemm_batched(0, NULL, a1, b1, c1, M, N, K, c16 ? 0.0f : beta);
        if (c16) {
            #pragma omp parallel for schedule(static) if (M * N >= (1 << 16))
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) ((uint16_t *)C.p)[i * C.rs + j * C.cs] = f32_bf16_bits(cf[i * N + j]);
        }
    }
    for (int k = 0; k < 3; k++) free(own[k]);
    if (mine) __atomic_store_n(&spare_busy, 0, __ATOMIC_RELEASE);
    return ok ? 0 : -1;
}

/* the same product without any memory of its own (the fallback's last resort): plain loops */
static void rounded_loops(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, float beta) {
    #define VAL(m, i, j) ((m).dtype == KDT_BF16 ? bf16_bits_f32(((const uint16_t *)(m).p)[(i) * (m).rs + (j) * (m).cs]) \
                                              : f32_round_bf16((m).p[(i) * (m).rs + (j) * (m).cs]))
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += VAL(A, i, k) * VAL(B, k, j);
            if (C.dtype == KDT_BF16) ((uint16_t *)C.p)[i * C.rs + j * C.cs] = f32_bf16_bits(s);
            else C.p[i * C.rs + j * C.cs] = beta == 0.0f ? s : beta * C.p[i * C.rs + j * C.cs] + s;
        }
    #undef VAL
}

void gemm_batched_bf16(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C,
                       int64_t M, int64_t N, int64_t K, float beta) {
    if (M == 0 || N == 0) return;
    if (K == 0 && C.dtype != KDT_BF16 && A.dtype != KDT_BF16 && B.dtype != KDT_BF16) {
        gemm_batched(nb, bshape, A, B, C, M, N, K, beta);   /* C = beta C */
        return;
    }
    int64_t batches = 1, idx[8] = {0};
    for (int d = 0; d < nb; d++) batches *= bshape[d];
    for (int64_t bi = 0; bi < batches; bi++, next_batch(nb, bshape, idx)) {
        int64_t oa, ob, oc;
        float b = batch_offsets(nb, idx, &A, &B, &C, &oa, &ob, &oc) ? beta : 1.0f;
        uly_mat a1 = A, b1 = B, c1 = C;
        a1.p = elem(A, oa);
        b1.p = elem(B, ob);
        c1.p = elem(C, oc);
        if (!gemm_amx_2d(M, N, K, a1.p, A.dtype, A.rs, A.cs, b1.p, B.dtype, B.rs, B.cs, b, NULL, c1.p, C.dtype, C.rs,
                         C.cs))
            continue;
        if (rounded_sgemm(a1, b1, c1, M, N, K, b)) rounded_loops(a1, b1, c1, M, N, K, b);
    }
}

void gemm_batched_rounded(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C,
                          int64_t M, int64_t N, int64_t K, float beta) {
    if (gemm_bf16_on()) gemm_batched_bf16(nb, bshape, A, B, C, M, N, K, beta);
    else gemm_batched(nb, bshape, A, B, C, M, N, K, beta);
}

int gemm_bias(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, const float *bias, int bf16) {
    if (!bf16) return -1;
    return gemm_amx_2d(M, N, K, A.p, A.dtype, A.rs, A.cs, B.p, B.dtype, B.rs, B.cs, 0.0f, bias, C.p, C.dtype, C.rs, C.cs);
}
