/* kernels/cpu/matmul.c — strided, batched, broadcasting GEMM on top of cblas_sgemm.
 * Transposed operands are passed to BLAS as transposes (no copies); batches whose output is
 * broadcast (stride 0, as for a weight gradient) accumulate in a fixed order. */
#include <cblas.h>
#include "kernels.h"

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
    for (int64_t bi = 0; bi < batches; bi++) {
        int64_t oa = 0, ob = 0, oc = 0;
        for (int d = 0; d < nb; d++) { oa += idx[d] * A.bstride[d]; ob += idx[d] * B.bstride[d]; oc += idx[d] * C.bstride[d]; }
        if (K == 0) {
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) C.p[oc + i * ldc + j] = beta == 0.0f ? 0.0f : C.p[oc + i * ldc + j] * beta;
        } else {
            cblas_sgemm(CblasRowMajor, ta, tb, (blasint)M, (blasint)N, (blasint)K, 1.0f, A.p + oa, (blasint)lda,
                        B.p + ob, (blasint)ldb, beta, C.p + oc, (blasint)ldc);
        }
        for (int d = nb - 1; d >= 0; d--) {
            if (++idx[d] < bshape[d]) break;
            idx[d] = 0;
        }
    }
}
