/* kernels/cuda/gemm.cu — the strided, batched, broadcasting GEMM of the CUDA backend (the
 * contract of kernels/cpu/matmul.c) on cuBLASLt: f32 operands multiply in TF32 on tensor cores
 * with f32 accumulation (uly_cuda_set_tf32(0) asks for full f32), bf16 operands (mixed precision)
 * at the bf16 rate. Row-major C = A B is computed as the column-major C^T = B^T A^T, transposed
 * operands are passed as transposes (no copies); batches with regular strides go in one
 * strided-batched cublasLtMatmul (its heuristic's first algorithm, a 32 MiB workspace; cuBLAS's
 * GemmStridedBatchedEx where cuBLASLt finds nothing), the rest (a broadcast output that
 * accumulates, irregular batch strides) one cuBLAS call per batch, in order, on the backend's
 * stream. ULY_CUDA_GEMM=cublas skips cuBLASLt (GemmEx throughout; bench/gpu.lua compares). */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "common.cuh"
#include "uly_cuda.h"

static cublasHandle_t handle;
static cublasLtHandle_t lt;              /* NULL: cuBLASLt did not start; the cuBLAS calls do all */
static void *lt_workspace;
static const size_t LT_WORKSPACE = 32 << 20;   /* what cuBLASLt asks for on Hopper */
static int use_tf32 = 1;

extern "C" void uly_cuda_set_tf32(int on) { use_tf32 = on != 0; }
extern "C" int uly_cuda_tf32(void) { return use_tf32; }

/* the backend's cuBLAS handle (on its stream), made on first use; NULL if cuBLAS failed */
extern "C" cublasHandle_t uly_cu_cublas(void) {
    if (!handle) cu_gemm_init();
    return handle;
}

/* a GEMM's precision for the profiler's names */
static const char *gemm_precision(cudaDataType_t in_type, cublasComputeType_t compute) {
    return in_type != CUDA_R_32F ? "bf16" : compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? "tf32" : "f32";
}

static const char *cublas_name(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}

extern "C" int cu_gemm_init(void) {
    if (handle) return 0;
    cublasStatus_t s = cublasCreate(&handle);
    if (s != CUBLAS_STATUS_SUCCESS) { uly_cu_fail_msg("cublasCreate", cublas_name(s)); handle = NULL; return -1; }
    cublasSetStream(handle, uly_cu_stream);
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) lt = NULL;
    else if (cudaMalloc(&lt_workspace, LT_WORKSPACE) != cudaSuccess) { cudaGetLastError(); lt_workspace = NULL; }
    return 0;
}

/* cuBLASLt's heuristic answers, kept per problem (the query costs tens of microseconds, which a
 * decoding step of small GEMMs would pay again and again): everything the choice depends on,
 * pointer alignment included; found = 0 remembers a problem cuBLASLt declines */
typedef struct {
    int64_t m, n, k, lda, ldb, ldc, sa, sb, sc, batches;
    int ta, tb, in_type, out_type, compute, bias, align;
} lt_key;
typedef struct { lt_key key; int used, found; cublasLtMatmulAlgo_t algo; } lt_entry;
static lt_entry lt_cache[256];
static int lt_next;                     /* round-robin replacement */
static int64_t lt_queries;              /* heuristic queries made (uly_cuda_gemm_heuristic_queries) */

extern "C" int64_t uly_cuda_gemm_heuristic_queries(void) { return lt_queries; }

static lt_entry *lt_lookup(const lt_key *key) {
    for (int i = 0; i < (int)(sizeof lt_cache / sizeof lt_cache[0]); i++)
        if (lt_cache[i].used && !memcmp(&lt_cache[i].key, key, sizeof *key)) return &lt_cache[i];
    return NULL;
}

/* One strided-batched column-major GEMM through cuBLASLt: C = op(A) op(B) + beta C, f32 out, its
 * heuristic's first algorithm (cached per problem), with the workspace. -1 when cuBLASLt has
 * nothing for this problem (or did not start): the caller uses cuBLAS's GemmStridedBatchedEx. */
static int lt_gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void *A, int64_t lda,
                   int64_t sa, const void *B, int64_t ldb, int64_t sb, float beta, void *C, int64_t ldc, int64_t sc,
                   int64_t batches, cudaDataType_t in_type, cublasComputeType_t compute, const float *bias = NULL,
                   cudaDataType_t out_type = CUDA_R_32F) {
    if (!lt) return -1;
    /* ULY_CUDA_GEMM=cublas: cuBLAS's GemmEx instead (bench/gpu.lua compares: is cuBLASLt's first
     * heuristic the slower algorithm?) */
    const char *env = getenv("ULY_CUDA_GEMM");
    if (env && !strcmp(env, "cublas")) return -1;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const int32_t opa = ta, opb = tb, nb = (int32_t)batches;
    const size_t ws = lt_workspace ? LT_WORKSPACE : 0;
    bool ok = cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb) == CUBLAS_STATUS_SUCCESS;
    if (ok && bias) {   /* bias[i] added to row i of the column-major C (the epilogue) */
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        ok = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) ==
                 CUBLAS_STATUS_SUCCESS;
    }
    ok = ok && cublasLtMatrixLayoutCreate(&la, in_type, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda) ==
                   CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatrixLayoutCreate(&lb, in_type, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb) ==
                   CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatrixLayoutCreate(&lc, out_type, m, n, ldc) == CUBLAS_STATUS_SUCCESS;
    if (ok && batches > 1) {
        const cublasLtMatrixLayout_t ls[3] = {la, lb, lc};
        const int64_t strides[3] = {sa, sb, sc};
        for (int i = 0; i < 3 && ok; i++)
            ok = cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb) ==
                     CUBLAS_STATUS_SUCCESS &&
                 cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                                                  sizeof strides[i]) == CUBLAS_STATUS_SUCCESS;
    }
    ok = ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
             CUBLAS_STATUS_SUCCESS;
    lt_key key;
    memset(&key, 0, sizeof key);   /* padding included: keys compare with memcmp */
    key.m = m; key.n = n; key.k = k; key.lda = lda; key.ldb = ldb; key.ldc = ldc;
    key.sa = sa; key.sb = sb; key.sc = sc; key.batches = batches;
    key.ta = ta; key.tb = tb; key.in_type = in_type; key.out_type = out_type; key.compute = compute; key.bias = bias != NULL;
    key.align = (int)(((uintptr_t)A | (uintptr_t)B | (uintptr_t)C | (uintptr_t)bias) & 255);
    lt_entry *hit = ok ? lt_lookup(&key) : NULL;
    if (ok && !hit) {
        cublasLtMatmulHeuristicResult_t found;
        int count = 0;
        lt_queries++;
        const int asked = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &found, &count) ==
                          CUBLAS_STATUS_SUCCESS;
        hit = &lt_cache[lt_next];
        lt_next = (lt_next + 1) % (int)(sizeof lt_cache / sizeof lt_cache[0]);
        hit->key = key;
        hit->used = 1;
        hit->found = asked && count > 0;
        if (hit->found) hit->algo = found.algo;
    }
    ok = ok && hit->found;
    const float one = 1.0f;
    if (ok) {
        char name[96] = "";   /* for the profiler: row-major M x N x K, the column-major call's n x m x k */
        if (uly_cu_prof_on) snprintf(name, sizeof name, "matmul %s %lld x %lld x %lld%s", gemm_precision(in_type, compute), (long long)n,
                 (long long)m, (long long)k, batches > 1 ? " batched" : "");
        uly_cu_prof_scope prof(name, uly_cu_stream);
        ok = cublasLtMatmul(lt, desc, &one, A, la, B, lb, &beta, C, lc, C, lc, &hit->algo, lt_workspace, ws,
                            uly_cu_stream) == CUBLAS_STATUS_SUCCESS;
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return ok ? 0 : -1;
}

/* can (rows x cols, strides rs / cs) be read as row-major (*trans = 0) or as a transpose (1)? */
static int layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
    if (cols <= 1) cs = 1;
    if (rows <= 1) rs = cols > 1 ? cols : 1;
    if (cs == 1 && rs >= (cols > 1 ? cols : 1)) { *trans = 0; *ld = rs; return 1; }
    if (rows <= 1) rs = 1;
    if (cols <= 1) cs = rows > 1 ? rows : 1;
    if (rs == 1 && cs >= (rows > 1 ? rows : 1)) { *trans = 1; *ld = cs; return 1; }
    return 0;
}

extern "C" int cu_gemm_operand_ok(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    int t;
    int64_t ld;
    return layout(rows, cols, rs, cs, &t, &ld);
}

__global__ static void scale_c(float *c, int64_t M, int64_t N, int64_t ldc, float beta) {
    ULY_CU_FOR(e, M * N) {
        float *p = c + (e / N) * ldc + e % N;
        *p = beta == 0.0f ? 0.0f : *p * beta;
    }
}

/* one collapsed batch stride per operand, if the nb batch dims are regular for all three */
static int collapse(int nb, const int64_t *bshape, const uly_mat *m, int64_t *stride) {
    int64_t s = -1;
    for (int d = nb - 1; d >= 0; d--) {
        if (bshape[d] == 1) continue;
        if (s < 0) { s = m->bstride[d]; continue; }
        int64_t inner = 1;
        for (int e = d + 1; e < nb; e++) inner *= bshape[e];
        if (m->bstride[d] != s * inner) return 0;
    }
    *stride = s < 0 ? 0 : s;
    return 1;
}

/* the GEMM on operand pointers already in `in_type` (f32, or the bf16 copies of gemm_bf16) */
static void gemm_typed(int nb, const int64_t *bshape, uly_mat A, const void *ap, uly_mat B, const void *bp, uly_mat C,
                       int64_t M, int64_t N, int64_t K, float beta, cudaDataType_t in_type);

extern "C" void cu_gemm_batched(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                                int64_t K, float beta) {
    gemm_typed(nb, bshape, A, A.p, B, B.p, C, M, N, K, beta, CUDA_R_32F);
}

/* elements from the operand's first element to its last (all strides are >= 0) */
static int64_t extent(int nb, const int64_t *bshape, const uly_mat *m, int64_t rows, int64_t cols) {
    int64_t last = (rows - 1) * m->rs + (cols - 1) * m->cs;
    for (int d = 0; d < nb; d++) last += (bshape[d] - 1) * m->bstride[d];
    return last + 1;
}

__global__ static void to_bf16(__nv_bfloat16 *dst, const float *src, int64_t n) {
    ULY_CU_FOR(i, n) dst[i] = __float2bfloat16_rn(src[i]);
}

/* the same four at a time: 16-byte loads, 8-byte stores (src 16-byte, dst 8-byte aligned) */
__global__ static void to_bf16_x4(uint2 *dst, const uint4 *src, int64_t n4) {
    ULY_CU_FOR(i, n4) {
        const uint4 v = src[i];
        uint2 o;
        o.x = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(__uint_as_float(v.x))) |
              (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(__uint_as_float(v.y))) << 16;
        o.y = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(__uint_as_float(v.z))) |
              (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(__uint_as_float(v.w))) << 16;
        dst[i] = o;
    }
}

/* dst[0..n) = src rounded to bf16 on the stream: vectorised where both are aligned (the pool's
 * blocks are; a view into one may not be), the rest an element at a time. At 4096^2 x 2 operands
 * the scalar kernel moved 2 TB/s on an H200 (ncu, 2026-12-04), half of what the memory can. */
static void launch_to_bf16(__nv_bfloat16 *dst, const float *src, int64_t n) {
    int64_t done = 0;
    if (((uintptr_t)dst & 7) == 0 && ((uintptr_t)src & 15) == 0 && n >= 4) {
        const int64_t n4 = n / 4;
        ULY_LAUNCH(to_bf16_x4, uly_cu_blocks(n4, 256), 256, uly_cu_stream)((uint2 *)dst, (const uint4 *)src, n4);
        done = 4 * n4;
    }
    if (done < n) ULY_LAUNCH(to_bf16, uly_cu_blocks(n - done, 256), 256, uly_cu_stream)(dst + done, src + done, n - done);
}

/* A and B as bf16 operands: f32 ones rounded into one stream-ordered temporary with their own
 * layout (*tmp, for the caller to free after the GEMM), bf16 ones (uly_mat.dtype) as they are;
 * -1 when the temporary cannot be had (recorded as the backend's failure unless quiet) */
static int bf16_operands(int nb, const int64_t *bshape, const uly_mat &A, const uly_mat &B, int64_t M, int64_t N,
                         int64_t K, const void **ap, const void **bp, __nv_bfloat16 **tmp, int quiet) {
    const int a_f32 = A.dtype != ULY_DTYPE_BF16, b_f32 = B.dtype != ULY_DTYPE_BF16;
    int64_t na = a_f32 ? extent(nb, bshape, &A, M, K) : 0, nbb = b_f32 ? extent(nb, bshape, &B, K, N) : 0;
    *tmp = NULL;
    if (na + nbb > 0) {
        cudaError_t e = cudaMallocAsync((void **)tmp, (size_t)(na + nbb) * sizeof(__nv_bfloat16), uly_cu_stream);
        if (e != cudaSuccess) {
            if (quiet) cudaGetLastError();
            else uly_cu_fail("bf16 GEMM operand copies", e);
            *tmp = NULL;
            return -1;
        }
    }
    *ap = a_f32 ? (const void *)*tmp : A.p;
    *bp = b_f32 ? (const void *)(*tmp + na) : B.p;
    if (a_f32) launch_to_bf16(*tmp, A.p, na);
    if (b_f32) launch_to_bf16(*tmp + na, B.p, nbb);
    ULY_CU_LAUNCHED("to_bf16");
    return 0;
}

/* mixed precision: the bf16 operands (bf16_operands) multiplied on tensor cores at the bf16 rate,
 * accumulated in f32 and written in f32, or rounded to bf16 where C is bf16 (bf16 activations:
 * then K > 0 and beta 0, the core's contract) */
extern "C" void cu_gemm_batched_bf16(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                                     int64_t K, float beta) {
    if (M == 0 || N == 0) return;
    if (C.dtype == ULY_DTYPE_BF16 && (K == 0 || beta != 0.0f)) {
        uly_cu_fail_msg("bf16 GEMM output", "needs K > 0 and beta 0 (the core's contract)");
        return;
    }
    if (K == 0) { gemm_typed(nb, bshape, A, A.p, B, B.p, C, M, N, K, beta, CUDA_R_32F); return; }
    const void *a16, *b16;
    __nv_bfloat16 *tmp;
    if (bf16_operands(nb, bshape, A, B, M, N, K, &a16, &b16, &tmp, 0)) return;
    gemm_typed(nb, bshape, A, a16, B, b16, C, M, N, K, beta, CUDA_R_16BF);
    if (tmp) cudaFreeAsync(tmp, uly_cu_stream);
}

/* C = bias + A B through cuBLASLt's bias epilogue (one pass over C instead of seeding it with the
 * bias and reading it back): -1, nothing done, where it does not apply or cuBLASLt declines */
extern "C" int cu_gemm_bias(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, const float *bias, int bf16) {
    if (!lt || M == 0 || N == 0 || K == 0) return -1;
    if (!handle && cu_gemm_init()) return -1;
    int ta = 0, tb = 0, tc = 0;
    int64_t lda = 1, ldb = 1, ldc = 1;
    if (!layout(M, K, A.rs, A.cs, &ta, &lda) || !layout(K, N, B.rs, B.cs, &tb, &ldb) ||
        !layout(M, N, C.rs, C.cs, &tc, &ldc) || tc)
        return -1;
    const cudaDataType_t in_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    if (!bf16 && (A.dtype == ULY_DTYPE_BF16 || B.dtype == ULY_DTYPE_BF16)) return -1;
    if (C.dtype == ULY_DTYPE_BF16) return -1;   /* the bias is added to an f32 output */
    const cublasComputeType_t compute = (use_tf32 && !bf16) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const void *ap = A.p, *bp = B.p;
    __nv_bfloat16 *tmp = NULL;
    if (bf16 && bf16_operands(0, NULL, A, B, M, N, K, &ap, &bp, &tmp, 1)) return -1;   /* the core's fallback tries */
    cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    int rc = lt_gemm(opb, opa, N, M, K, bp, ldb, 0, ap, lda, 0, 0.0f, C.p, ldc, 0, 1, in_type, compute, bias);
    if (tmp) cudaFreeAsync(tmp, uly_cu_stream);
    return rc;
}

static void gemm_typed(int nb, const int64_t *bshape, uly_mat A, const void *ap, uly_mat B, const void *bp, uly_mat C,
                       int64_t M, int64_t N, int64_t K, float beta, cudaDataType_t in_type) {
    if (M == 0 || N == 0) return;
    if (!handle && cu_gemm_init()) return;
    int ta = 0, tb = 0, tc = 0;
    int64_t lda = 1, ldb = 1, ldc = 1;
    layout(M, K, A.rs, A.cs, &ta, &lda);
    layout(K, N, B.rs, B.cs, &tb, &ldb);
    layout(M, N, C.rs, C.cs, &tc, &ldc);
    int64_t batches = 1;
    for (int d = 0; d < nb; d++) batches *= bshape[d];
    const float one = 1.0f;
    cublasComputeType_t compute = (use_tf32 && in_type == CUDA_R_32F) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const size_t es = in_type == CUDA_R_32F ? 4 : 2;
    const cudaDataType_t out_type = C.dtype == ULY_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const size_t ec = out_type == CUDA_R_32F ? 4 : 2;
    cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (K == 0) { /* C = beta C for every batch (f32 C only: cu_gemm_batched_bf16 refuses a bf16 one) */
        int64_t idx[8] = {0};
        for (int64_t bi = 0; bi < batches; bi++) {
            int64_t oc = 0;
            int first = 1;
            for (int d = 0; d < nb; d++) { oc += idx[d] * C.bstride[d]; if (C.bstride[d] == 0 && idx[d] > 0) first = 0; }
            ULY_LAUNCH(scale_c, uly_cu_blocks(M * N, 256), 256, uly_cu_stream)(C.p + oc, M, N, ldc, first ? beta : 1.0f);
            ULY_CU_LAUNCHED("gemm scale_c");
            for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bshape[d]) break; idx[d] = 0; }
        }
        return;
    }
    int64_t sa, sb, sc;
    cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
    int regular = collapse(nb, bshape, &A, &sa) && collapse(nb, bshape, &B, &sb) && collapse(nb, bshape, &C, &sc);
    char name[96] = "";   /* for the profiler */
    if (uly_cu_prof_on) snprintf(name, sizeof name, "matmul %s %lld x %lld x %lld (cuBLAS)%s", gemm_precision(in_type, compute), (long long)M,
             (long long)N, (long long)K, batches > 1 ? " batched" : "");
    if (regular && (sc != 0 || batches == 1)) {
        if (lt_gemm(opb, opa, N, M, K, bp, ldb, sb, ap, lda, sa, beta, C.p, ldc, sc, batches, in_type, compute, NULL,
                    out_type))
            s = (uly_cu_prof_scope{name, uly_cu_stream},
                 cublasGemmStridedBatchedEx(handle, opb, opa, (int)N, (int)M, (int)K, &one, bp, in_type, (int)ldb, sb,
                                           ap, in_type, (int)lda, sa, &beta, C.p, out_type, (int)ldc, sc,
                                           (int)batches, compute, CUBLAS_GEMM_DEFAULT));
    } else {
        int64_t idx[8] = {0};
        for (int64_t bi = 0; bi < batches && s == CUBLAS_STATUS_SUCCESS; bi++) {
            int64_t oa = 0, ob = 0, oc = 0;
            int first = 1;   /* a broadcast C gets beta on its first batch, later batches add */
            for (int d = 0; d < nb; d++) {
                oa += idx[d] * A.bstride[d]; ob += idx[d] * B.bstride[d]; oc += idx[d] * C.bstride[d];
                if (C.bstride[d] == 0 && idx[d] > 0) first = 0;
            }
            const float b_eff = first ? beta : 1.0f;
            s = (uly_cu_prof_scope{name, uly_cu_stream},
                 cublasGemmEx(handle, opb, opa, (int)N, (int)M, (int)K, &one, (const char *)bp + ob * es, in_type, (int)ldb,
                              (const char *)ap + oa * es, in_type, (int)lda, &b_eff, (char *)C.p + oc * ec, out_type,
                              (int)ldc, compute, CUBLAS_GEMM_DEFAULT));
            for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bshape[d]) break; idx[d] = 0; }
        }
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
        char what[160];
        snprintf(what, sizeof what, "cuBLAS GEMM %lld x %lld x %lld (%lld batches)", (long long)M, (long long)N,
                 (long long)K, (long long)batches);
        uly_cu_fail_msg(what, cublas_name(s));
    }
}

/* uniform values in [-1, 1) from the element index (a hash: the same on every run), f32 or bf16:
 * the benchmark's operands, random as ours are (tensor cores multiply zeros faster: on an H200
 * 894 TFLOP/s against 788 on random data) */
__global__ static void fill_uniform(void *p, int64_t n, int bf16, uint32_t seed) {
    ULY_CU_FOR(i, n) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 16; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
        const float v = (float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
        if (bf16) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
        else ((float *)p)[i] = v;
    }
}

/* the benchmarks' reference: raw cuBLAS on its own buffers of random values, M x K @ K x N
 * (row-major, f32 output), f32 (TF32) or bf16 inputs; the seconds per GEMM over `iters` timed runs
 * after one warm-up */
extern "C" int uly_cuda_cublas_gemm_seconds(int64_t M, int64_t N, int64_t K, int bf16, int iters, double *seconds) {
    if (M <= 0 || N <= 0 || K <= 0 || iters <= 0 || !seconds) { uly_cuda_record_error("cublas_gemm_seconds: bad arguments"); return -1; }
    if (!handle && cu_gemm_init()) { uly_cuda_record_error("cublas_gemm_seconds: no cuBLAS handle"); return -1; }
    size_t es = bf16 ? 2 : 4;
    void *a = NULL, *b = NULL, *c = NULL;
    cudaEvent_t t0 = NULL, t1 = NULL;
    cudaError_t e = cudaMalloc(&a, (size_t)(M * K) * es);
    if (e == cudaSuccess) e = cudaMalloc(&b, (size_t)(K * N) * es);
    if (e == cudaSuccess) e = cudaMalloc(&c, (size_t)(M * N) * 4);
    if (e == cudaSuccess) {
        ULY_LAUNCH(fill_uniform, uly_cu_blocks(M * K, 256), 256, uly_cu_stream)(a, M * K, bf16, 1u);
        ULY_LAUNCH(fill_uniform, uly_cu_blocks(K * N, 256), 256, uly_cu_stream)(b, K * N, bf16, 2u);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaEventCreate(&t0);
    if (e == cudaSuccess) e = cudaEventCreate(&t1);
    int rc = -1;
    if (e == cudaSuccess) {
        const float one = 1.0f, zero = 0.0f;
        cudaDataType_t in = bf16 ? CUDA_R_16BF : CUDA_R_32F;
        cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
        cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
        for (int it = -1; it < iters && s == CUBLAS_STATUS_SUCCESS; it++) {
            if (it == 0) cudaEventRecord(t0, uly_cu_stream);
            s = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, b, in, (int)N, a, in, (int)K,
                             &zero, c, CUDA_R_32F, (int)N, compute, CUBLAS_GEMM_DEFAULT);
        }
        cudaEventRecord(t1, uly_cu_stream);
        e = cudaEventSynchronize(t1);
        float ms = 0;
        if (s == CUBLAS_STATUS_SUCCESS && e == cudaSuccess && cudaEventElapsedTime(&ms, t0, t1) == cudaSuccess) {
            *seconds = ms / 1e3 / iters;
            rc = 0;
        } else {
            uly_cuda_record_error(s != CUBLAS_STATUS_SUCCESS ? cublas_name(s) : cudaGetErrorString(e));
        }
    } else {
        uly_cuda_record_error(cudaGetErrorString(e));
        cudaGetLastError();
    }
    if (t0) cudaEventDestroy(t0);
    if (t1) cudaEventDestroy(t1);
    cudaFree(a); cudaFree(b); cudaFree(c);
    return rc;
}
