/* kernels/cuda/backend.cu — the CUDA backend table that libulysses.so calls for device 'cuda'
 * (core/include/uly_backend.h): device 0, one stream that every kernel and copy is queued on in
 * order, cudaMalloc'ed buffers under the core's caching pool, copies that wait for the stream
 * when the host needs the bytes, and the first failure of any launch or copy kept (with what
 * failed) until the core asks for it. Built by uly_cuda_backend() on first use. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "common.cuh"
#include "uly_cuda.h"

cudaStream_t uly_cu_stream;
static void *scratch;                 /* 64 KiB for values read back by the host */
static char first_error[512];
static char taken[512];
static int started;

void uly_cu_fail(const char *what, cudaError_t err) {
    if (!first_error[0])
        snprintf(first_error, sizeof first_error, "%s: cuda error %d (%s: %s)", what, (int)err, cudaGetErrorName(err),
                 cudaGetErrorString(err));
    cudaGetLastError();
}

void uly_cu_fail_msg(const char *what, const char *msg) {
    if (!first_error[0]) snprintf(first_error, sizeof first_error, "%s: %s", what, msg);
}

extern "C" void *uly_cu_scratch(void) { return scratch; }

extern "C" int uly_cu_read_back(void *host, const void *dev, int64_t bytes) {
    cudaError_t e = cudaMemcpyAsync(host, dev, (size_t)bytes, cudaMemcpyDeviceToHost, uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("reading a result back", e); return -1; }
    return uly_cu_stream_wait("reading a result back");
}

/* the stream-ordered allocator's pool (cudaMallocAsync: kernels' temporaries such as bf16 operand
 * copies) keeps what it has between synchronizations instead of returning it to the driver at
 * each one (its default), so a warm step maps no memory; an out-of-memory here trims it first */
static cudaMemPool_t async_pool;

static void *cu_raw_alloc(int64_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, (size_t)bytes);
    if (e == cudaErrorMemoryAllocation && async_pool) {
        cudaGetLastError();
        if (uly_cu_stream_wait("cudaMalloc's retry")) return NULL;
        cudaMemPoolTrimTo(async_pool, 0);
        e = cudaMalloc(&p, (size_t)bytes);
    }
    if (e != cudaSuccess) {
        char what[96];
        snprintf(what, sizeof what, "cudaMalloc of %lld bytes", (long long)bytes);
        uly_cu_fail(what, e);
        return NULL;
    }
    return p;
}

static void cu_raw_free(void *p) {
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) uly_cu_fail("cudaFree", e);
}

static int cu_memory_info(int64_t *free_b, int64_t *total_b) {
    size_t f = 0, t = 0;
    cudaError_t e = cudaMemGetInfo(&f, &t);
    if (e != cudaSuccess) { uly_cu_fail("cudaMemGetInfo", e); return -1; }
    *free_b = (int64_t)f;
    *total_b = (int64_t)t;
    return 0;
}

static int cu_copy(void *dst, const void *src, int64_t bytes, int kind) {
    if (bytes <= 0) return 0;
    cudaMemcpyKind k = kind == ULY_COPY_H2D ? cudaMemcpyHostToDevice
                     : kind == ULY_COPY_D2H ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    const char *what = kind == ULY_COPY_H2D ? "copy to the device" : kind == ULY_COPY_D2H ? "copy from the device"
                                                                                         : "copy on the device";
    cudaError_t e = cudaMemcpyAsync(dst, src, (size_t)bytes, k, uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail(what, e); return -1; }
    /* the host side may be reused (H2D) or read (D2H) as soon as this returns */
    return kind != ULY_COPY_D2D ? uly_cu_stream_wait(what) : 0;
}

static int cu_memset0(void *p, int64_t bytes) {
    if (bytes <= 0) return 0;
    cudaError_t e = cudaMemsetAsync(p, 0, (size_t)bytes, uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("cudaMemsetAsync", e); return -1; }
    return 0;
}

static int cu_synchronize(void) { return uly_cu_stream_wait("synchronize"); }

static const char *cu_take_error(void) {
    if (!first_error[0]) return NULL;
    memcpy(taken, first_error, sizeof taken);
    first_error[0] = 0;
    return taken;
}

static uly_backend table = {   /* the bf16-activation entries switch (uly_cuda_bf16_kernels) */
    ULY_BACKEND_ABI, (int64_t)sizeof(uly_backend), "cuda",
    cu_raw_alloc, cu_raw_free, cu_memory_info, cu_copy, cu_memset0, cu_synchronize, cu_take_error,
    cu_copy_view, cu_sum_view, cu_fill_view,
    cu_unary_forward, cu_unary_backward, cu_swiglu_forward, cu_swiglu_backward,
    cu_reduce_sum_forward, cu_reduce_sum_backward, cu_reduce_max_forward, cu_reduce_max_backward,
    cu_softmax_forward, cu_softmax_backward,
    cu_layernorm_forward, cu_layernorm_backward, cu_rmsnorm_forward, cu_rmsnorm_backward,
    cu_embedding_forward, cu_embedding_backward, cu_embedding_first_bad_index,
    cu_rope_forward, cu_rope_backward, cu_dropout_forward, cu_dropout_backward,
    cu_cross_entropy_forward, cu_cross_entropy_backward,
    cu_attention_forward, cu_attention_backward,
    cu_binary_forward, cu_scalar_forward, cu_scalar_backward, cu_axpy_accumulate,
    cu_gemm_operand_ok, cu_gemm_batched,
    cu_flash_scratch_floats, cu_flash_forward, cu_flash_backward,
    cu_optim_adamw, cu_optim_sgd, cu_optim_sumsq, cu_optim_scale,
    cu_gemm_batched_bf16, cu_gemm_bias,
    cu_pack_layout, cu_unpack_layout,
    cu_device_uuid, cu_comm_unique_id, cu_comm_create, cu_comm_destroy, cu_comm_all_reduce, cu_comm_all_to_all_v,
    cu_comm_all_reduce_start, cu_comm_join,
    cu_optim_adamw_multi,
    cu_comm_all_gather_start, cu_comm_reduce_scatter_start,
    cu_comm_set_timeout, cu_comm_aborted,
    cu_binary_forward_typed, cu_swiglu_forward_bf16, cu_swiglu_backward_bf16,
    cu_layernorm_forward_bf16, cu_layernorm_backward_bf16, cu_rmsnorm_forward_bf16, cu_rmsnorm_backward_bf16,
    cu_cross_entropy_forward_bf16, cu_cross_entropy_backward_bf16,
    cu_unary_forward_bf16, cu_unary_backward_bf16, cu_rope_forward_bf16,
};

extern "C" int uly_cuda_temporaries_peak(int64_t *bytes, int reset) {
    *bytes = 0;
    if (!async_pool) { uly_cuda_record_error("the CUDA backend is not started (or its device has no memory pool)"); return -1; }
    if (uly_cu_stream_wait("reading the temporaries' pool")) {
        const char *why = cu_take_error();
        uly_cuda_record_error(why ? why : "waiting for the device failed");
        return -1;
    }
    cudaError_t e = cudaSuccess;
    uint64_t high = 0;
    if (e == cudaSuccess) e = cudaMemPoolGetAttribute(async_pool, cudaMemPoolAttrUsedMemHigh, &high);
    uint64_t zero = 0;
    if (e == cudaSuccess && reset) e = cudaMemPoolSetAttribute(async_pool, cudaMemPoolAttrUsedMemHigh, &zero);
    if (e != cudaSuccess) {
        char msg[160];
        snprintf(msg, sizeof msg, "reading the temporaries' pool: %s", cudaGetErrorString(e));
        uly_cuda_record_error(msg);
        return -1;
    }
    *bytes = (int64_t)high;
    return 0;
}

extern "C" const void *uly_cuda_backend(void) {
    if (started) return &table;
    int n = uly_cuda_device_count();
    if (n <= 0) return NULL;   /* the reason is in uly_cuda_last_error */
    /* ULY_CUDA_DEVICE, else one GPU per rank of a node (Open MPI's local rank), else device 0 */
    const char *env = getenv("ULY_CUDA_DEVICE"), *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    int dev = env && *env ? atoi(env) : local && *local ? atoi(local) % n : 0;
    if (dev < 0 || dev >= n) {
        char msg[128];
        snprintf(msg, sizeof msg, "ULY_CUDA_DEVICE=%d but there %s %d device%s", dev, n == 1 ? "is" : "are", n, n == 1 ? "" : "s");
        uly_cuda_record_error(msg);
        return NULL;
    }
    cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&uly_cu_stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMalloc(&scratch, 64 << 10);
    if (e == cudaSuccess && cudaDeviceGetDefaultMemPool(&async_pool, dev) == cudaSuccess) {
        uint64_t keep = UINT64_MAX;
        if (cudaMemPoolSetAttribute(async_pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) async_pool = NULL;
    }
    cudaGetLastError();   /* a device without memory pools just keeps the default */
    if (e != cudaSuccess) {
        uly_cu_fail("starting the CUDA backend", e);
        uly_cuda_record_error(first_error);
        first_error[0] = 0;
        return NULL;
    }
    if (cu_gemm_init()) {
        uly_cuda_record_error(first_error);
        first_error[0] = 0;
        return NULL;
    }
    started = 1;
    return &table;
}

/* bf16 activations through the kernels that read and write bf16 (1, the default) or through
 * converting copies around the f32 kernels (0): the same bits, the specs check; benchmarks time
 * both. The core reads the table at each call, so this takes effect at once. Returns the previous;
 * on < 0 only reads it. */
extern "C" int uly_cuda_bf16_kernels(int on) {
    const int prev = table.binary_forward_typed != NULL;
    if (on < 0) return prev;   /* only read */
    table.binary_forward_typed = on ? cu_binary_forward_typed : NULL;
    table.swiglu_forward_bf16 = on ? cu_swiglu_forward_bf16 : NULL;
    table.swiglu_backward_bf16 = on ? cu_swiglu_backward_bf16 : NULL;
    table.layernorm_forward_bf16 = on ? cu_layernorm_forward_bf16 : NULL;
    table.layernorm_backward_bf16 = on ? cu_layernorm_backward_bf16 : NULL;
    table.rmsnorm_forward_bf16 = on ? cu_rmsnorm_forward_bf16 : NULL;
    table.rmsnorm_backward_bf16 = on ? cu_rmsnorm_backward_bf16 : NULL;
    table.cross_entropy_forward_bf16 = on ? cu_cross_entropy_forward_bf16 : NULL;
    table.cross_entropy_backward_bf16 = on ? cu_cross_entropy_backward_bf16 : NULL;
    table.unary_forward_bf16 = on ? cu_unary_forward_bf16 : NULL;
    table.unary_backward_bf16 = on ? cu_unary_backward_bf16 : NULL;
    table.rope_forward_bf16 = on ? cu_rope_forward_bf16 : NULL;
    return prev;
}
