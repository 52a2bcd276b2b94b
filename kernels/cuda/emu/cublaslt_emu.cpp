/* kernels/cuda/emu/cublaslt_emu.cpp — cuBLASLt for the CUDA emulator: matmul descriptors and
 * matrix layouts (column-major, strided batches) recorded as given, one "algorithm" that every
 * heuristic query returns, and cublasLtMatmul as the emulator's GEMM loops per batch, queued on
 * the stream like any other work. D must be C (the only use here), f32 or bf16 (the product in
 * f32, beta C and the bias added, then rounded to nearest even: uly_emu::gemm); the bias
 * epilogue adds bias[i] to row i of each column-major output, after the product. */
#include "cuda_emu.h"
#include "cublasLt.h"

struct uly_emu_lt { int unused; };
struct uly_emu_lt_desc { cublasComputeType_t compute; cublasOperation_t ta, tb; int epilogue; const float *bias; };
struct uly_emu_lt_layout { cudaDataType_t type; uint64_t rows, cols; int64_t ld; int32_t batches; int64_t stride; };
struct uly_emu_lt_pref { size_t workspace; };

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { *h = new uly_emu_lt{0}; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
    if (scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    *d = new uly_emu_lt_desc{compute, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, NULL};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete d; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void *buf,
                                              size_t size) {
    if (attr == CUBLASLT_MATMUL_DESC_BIAS_POINTER) {
        if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->bias, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    }
    if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    int32_t v;
    memcpy(&v, buf, sizeof v);
    if (attr == CUBLASLT_MATMUL_DESC_TRANSA) d->ta = (cublasOperation_t)v;
    else if (attr == CUBLASLT_MATMUL_DESC_TRANSB) d->tb = (cublasOperation_t)v;
    else if (attr == CUBLASLT_MATMUL_DESC_EPILOGUE && (v == CUBLASLT_EPILOGUE_DEFAULT || v == CUBLASLT_EPILOGUE_BIAS))
        d->epilogue = v;
    else return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    if (ld < (int64_t)(rows > 0 ? rows : 1)) return CUBLAS_STATUS_INVALID_VALUE;   /* column-major: ld >= rows */
    *l = new uly_emu_lt_layout{type, rows, cols, ld, 1, 0};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete l; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
    if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && size == sizeof(int32_t)) memcpy(&l->batches, buf, size);
    else if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && size == sizeof(int64_t)) memcpy(&l->stride, buf, size);
    else return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) { *p = new uly_emu_lt_pref{0}; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) { delete p; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t size) {
    if (attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES || size != sizeof(size_t)) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(&p->workspace, buf, size);
    return CUBLAS_STATUS_SUCCESS;
}

/* the shapes must fit together, as the real library checks: op(A) m x k, op(B) k x n, C m x n */
static bool shapes_fit(const uly_emu_lt_desc *d, const uly_emu_lt_layout *a, const uly_emu_lt_layout *b,
                       const uly_emu_lt_layout *c) {
    uint64_t am = d->ta == CUBLAS_OP_N ? a->rows : a->cols, ak = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t bk = d->tb == CUBLAS_OP_N ? b->rows : b->cols, bn = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
    return am == c->rows && bn == c->cols && ak == bk && a->batches == c->batches && b->batches == c->batches &&
           (c->type == CUDA_R_32F || c->type == CUDA_R_16BF) && (c->stride != 0 || c->batches == 1);
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t,
                                              cublasLtMatmulPreference_t, int requested,
                                              cublasLtMatmulHeuristicResult_t *results, int *returned) {
    *returned = 0;
    if (requested < 1 || !shapes_fit(d, a, b, c)) return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(&results[0], 0, sizeof results[0]);
    results[0].state = CUBLAS_STATUS_SUCCESS;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t stream) {
    if (C != D || c != dl || !shapes_fit(d, a, b, c)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const float al = *(const float *)alpha, be = *(const float *)beta;   /* host scalars: read at the call */
    const int m = (int)c->rows, n = (int)c->cols, k = (int)(d->ta == CUBLAS_OP_N ? a->cols : a->rows);
    const uly_emu_lt_layout la = *a, lb = *b, lc = *c;
    const cublasOperation_t ta = d->ta, tb = d->tb;
    const bool tf32 = d->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    const float *bias = d->epilogue == CUBLASLT_EPILOGUE_BIAS ? d->bias : NULL;
    if (d->epilogue == CUBLASLT_EPILOGUE_BIAS && !bias) return CUBLAS_STATUS_INVALID_VALUE;
    uly_emu::submit(stream, [=]() {
        const size_t ea = la.type == CUDA_R_16BF ? 2 : 4, eb = lb.type == CUDA_R_16BF ? 2 : 4;
        const size_t ec = lc.type == CUDA_R_16BF ? 2 : 4;
        for (int32_t i = 0; i < lc.batches; i++)
            uly_emu::gemm(ta, tb, m, n, k, al, (const char *)A + i * la.stride * ea, la.type, (int)la.ld,
                          (const char *)B + i * lb.stride * eb, lb.type, (int)lb.ld, be, (char *)D + i * lc.stride * ec,
                          lc.type, (int)lc.ld, tf32, bias);
    });
    return CUBLAS_STATUS_SUCCESS;
}
