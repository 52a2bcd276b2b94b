/* kernels/cuda/emu/cuda_emu.h — a small CUDA emulator, so the CUDA backend's own kernels run (and
 * are tested) on machines without a GPU. The .cu files compile unchanged as C++ with this header
 * in front (kernels/cuda/emu/include/ stands in for cuda_runtime.h, cuda_bf16.h, cublas_v2.h):
 *  - a launch runs the blocks one after another; each block's threads are fibers (ucontext) on
 *    the calling thread, switched only at __syncthreads() and warp shuffles, which are real
 *    barriers: a kernel whose threads diverge at a barrier is reported as a deadlock;
 *  - __shared__ is static storage (blocks never overlap, so it is per block); dynamic shared
 *    memory (ULY_LAUNCH_SMEM / ULY_DYNAMIC_SHARED) is one buffer filled with 0xff (NaNs) before
 *    each block, so reading what no thread wrote shows; more than 48 KiB of it only as far as
 *    cudaFuncSetAttribute allowed the kernel (else the launch fails, as on a GPU);
 *  - device memory is host memory; copies are memcpy; work on a stream runs at once, or with
 *    ULY_EMU_STREAMS=lazy as late as the waits allow (a missing cudaStreamWaitEvent shows);
 *  - cp.async copies happen at the wait that covers them, not before (a read that skips the wait
 *    sees stale bytes), or with ULY_EMU_ASYNC=eager at issue (an overwrite of a tile other
 *    warps still read shows); ULY_EMU_ORDER=reverse runs one warp at a time, last first, each up
 *    to its next __syncthreads, so a missing barrier between warps shows (scripts/test.sh runs
 *    the specs both ways);
 *  - TMA loads land at the first mbarrier wait on their barrier (or at issue, eager), in the
 *    128-byte swizzle, zeros outside the tensor; an mbarrier wait yields until its phase
 *    completes (kernels/cuda/tma.cuh; a wait nothing can complete is reported as a deadlock);
 *    with eager loads a wgmma wait yields once too, so a buffer given back to a TMA producer
 *    before the wgmma reading it was waited for is overwritten under it (and reported);
 *  - named barriers (bar.sync / bar.arrive, warpgroups taking turns) count their arrivals; a
 *    block that ends with one part-arrived is reported; setmaxnreg moves registers between the
 *    block's warpgroups and its pool, an increase waiting until the pool has them;
 *  - cuBLAS and cuBLASLt GEMMs are plain loops (f32 accumulation; bf16 inputs read exactly),
 *    queued on their stream (cublaslt_emu.cpp: descriptors and layouts as given, one algorithm);
 *  - one device, "ulysses CUDA emulator", with the memory limit ULY_EMU_MEMORY (default 4 GiB).
 * What it cannot show: speed, races between blocks, and warp-divergent shuffles
 * beyond the barrier check. Built as libulysses_cuemu.so (CMake, next to libulysses_cuda.so);
 * ULY_CUDA_LIB=build/libulysses_cuemu.so makes uly.cuda load it in place of the real one. */
#ifndef ULY_CUDA_EMU_H
#define ULY_CUDA_EMU_H
#define ULY_CUDA_EMU 1
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <functional>
#include <tuple>
#include <type_traits>

struct uly_emu_stream;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned x, y, z; };
extern dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace uly_emu {
void run_grid(unsigned blocks, unsigned threads, size_t dynamic_smem, const std::function<void()> &body);
/* the block's dynamic shared memory (ULY_DYNAMIC_SHARED): 1024-byte aligned, 0xff bytes (NaNs) at
 * the start of every block, so a read of what no thread wrote shows */
void *dynamic_shared();
void sync_block();
/* named barriers (bar.sync / bar.arrive with an id 1..15 and a thread count): a barrier completes
 * when `count` threads have arrived, releasing those that wait at it; arrive does not wait. A
 * block that ends with a barrier part-arrived is reported (an unbalanced protocol) */
void named_sync(unsigned id, unsigned count);
void named_arrive(unsigned id, unsigned count);
/* setmaxnreg (.sync.aligned): every thread of the caller's warpgroup asks its registers a thread
 * be n (a multiple of 8, 24 to 256); when all 128 have, the warpgroup's count becomes n, its
 * registers going back to the block's pool (launched with 65536 / threads, rounded down to 8, a
 * thread) or, for an increase, taken from it once it holds them: until then the warpgroup
 * waits, as on a GPU, so an increase that no decrease makes room for is a deadlock here */
void setmaxnreg(unsigned n, int increase);
uint64_t shuffle_xor(uint64_t bits, int lane_mask);
/* a warp-wide barrier that hands every lane all 32 lanes' `bytes` (at most 64) in lane order:
 * the emulation of the warp-collective tensor-core instructions (kernels/cuda/mma.cuh) */
void warp_gather(const void *mine, size_t bytes, void *all);
/* cp.async (kernels/cuda/mma.cuh): 16 bytes (zeros when !valid) queued by this thread, done at
 * the async_wait that leaves fewer than in_flight + 1 of its committed groups pending */
void async_copy16(void *dst, const void *src, int valid);
void async_copy4(void *dst, const void *src, int valid);   /* the same with 4 bytes */
void async_commit();
void async_wait(unsigned in_flight);
/* wgmma (kernels/cuda/mma.cuh): the byte offset of p in the block's dynamic shared memory (a
 * descriptor's address; an error outside it), and one warpgroup MMA queued by this thread:
 * d (4 N/8 floats, this thread's accumulators) += A (its warp's 16 x 16, row-major) B, B a 16 x N
 * bf16 tile read through desc (128-byte swizzle; trans: MN-major) when a wgmma_wait covers it,
 * so accumulators read or shared memory overwritten before the wait show */
uint32_t shared_offset(const void *p);
void wgmma_queue(float *d, int n, const float *a16x16, uint64_t desc, int trans);
/* the same with A (64 x 16, 128-byte swizzle; K-major, or trans_a: MN-major) through a descriptor
 * too: this thread reads the rows its accumulators take (g and g + 8 of its warp's 16 w.., lane
 * 4 g + t; the warp's lanes together all 16), at the issue and again at the wait; accumulate 0:
 * d = A B at the wait, d's old value ignored */
void wgmma_queue_ss(float *d, int n, uint64_t desc_a, uint64_t desc_b, int trans_b, int accumulate, int trans_a);
void wgmma_commit();
void wgmma_wait(unsigned in_flight);
/* TMA (kernels/cuda/tma.cuh): mbarriers in shared memory (their state kept here by address, new
 * each block) and tiled loads of a tensor map's box into shared memory (128-byte swizzle, zeros
 * outside the tensor). A load lands at the first wait on its barrier, not before (a read that
 * skips the wait sees the old bytes), or with ULY_EMU_ASYNC=eager at issue. mbar_wait spins:
 * the thread yields until the phase of that parity completes; a block whose live threads all
 * spin or wait with nothing left to run is a deadlock. */
void mbar_init(void *bar, unsigned count);
void mbar_expect_tx(void *bar, unsigned bytes);   /* one arrival, and bytes the loads will bring */
/* a box of a rank-`rank` map (the instruction's dimensions must be the map's), coordinates past
 * the rank 0 */
void tma_load(void *dst, const void *map, int rank, int c0, int c1, int c2, int c3, void *bar);
void mbar_wait(void *bar, unsigned parity);

/* streams (kernels/cuda/emu/streams.cpp): work queued on a stream runs at once, or with
 * ULY_EMU_STREAMS=lazy only when something waits for it (a stream or event synchronize, a
 * synchronous copy, cudaFree, or another stream's cudaStreamWaitEvent reached in its own order),
 * so a read that lacks its wait sees the data from before */
void submit(uly_emu_stream *s, std::function<void()> work);
/* work that may run only once ready() (polled; a blocking wait spins on it, a query stops there) */
void submit_when(uly_emu_stream *s, std::function<bool()> ready, std::function<void()> work);
void drain(uly_emu_stream *s);       /* run everything queued on s */
void run_to(uly_emu_stream *s, uint64_t point);       /* run s until `point` pieces of work are done */
bool progress_to(uly_emu_stream *s, uint64_t point);  /* run what is ready, no waiting: reached it? */
void drain_all();
bool lazy();                         /* ULY_EMU_STREAMS=lazy */

/* the dynamic shared memory a kernel may take beyond the default 48 KiB, as a GPU keeps it per
 * kernel (cudaFuncSetAttribute's MaxDynamicSharedMemorySize); a launch asking more than its kernel
 * was allowed fails as on a GPU: cudaGetLastError says cudaErrorInvalidValue, nothing runs */
void allow_dynamic_smem(const void *kernel, int bytes);
int launch_refused(const void *kernel, size_t smem);

template <typename... P>
struct launcher {
    void (*kernel)(P...);
    unsigned blocks, threads;
    size_t smem;
    uly_emu_stream *stream;
    template <typename... A>
    void operator()(A &&...args) const {
        if (launch_refused(reinterpret_cast<const void *>(kernel), smem)) return;
        /* the arguments are taken by value now, converted as a real launch converts them */
        std::tuple<typename std::decay<P>::type...> saved(std::forward<A>(args)...);
        auto k = kernel;
        unsigned b = blocks, t = threads;
        size_t sm = smem;
        submit(stream, [k, b, t, sm, saved]() {
            std::function<void()> body = [&]() { std::apply(k, saved); };
            run_grid(b, t, sm, body);
        });
    }
};
template <typename... P>
launcher<P...> launch(void (*kernel)(P...), unsigned blocks, unsigned threads, size_t smem, uly_emu_stream *stream) {
    return launcher<P...>{kernel, blocks, threads, smem, stream};
}
} // namespace uly_emu

static inline void __syncthreads(void) { uly_emu::sync_block(); }
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    (void)mask;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    bits = uly_emu::shuffle_xor(bits, lane_mask);
    T out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
/* a warp vote: every lane's predicate gathered (a warp-wide barrier, as a shuffle is) */
static inline int __any_sync(unsigned mask, int pred) {
    (void)mask;
    int all[32];
    pred = pred != 0;
    uly_emu::warp_gather(&pred, sizeof pred, all);
    int any = 0;
    for (int l = 0; l < 32; l++) any |= all[l];
    return any;
}
#define __expf(x) expf(x)   /* glibc declares its own __expf */
/* IEEE round-to-nearest arithmetic (nvcc never fuses these): the host's, where the emulator is
 * built for a CPU without FMA (no contraction); fmaf is libm's exact fused multiply-add */
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* one thread runs at a time: atomics are plain read-modify-writes */
static inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) { unsigned long long o = *p; if (v < o) *p = v; return o; }
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) { unsigned long long o = *p; *p = o + v; return o; }
static inline float atomicAdd(float *p, float v) { float o = *p; *p = o + v; return o; }

/* ---- bf16 ---- */
struct __nv_bfloat16 { uint16_t x; };
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u = __float_as_uint(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) { b.x = (uint16_t)((u >> 16) | 0x40); return b; }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.x = (uint16_t)(u >> 16);
    return b;
}
static inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((uint32_t)b.x << 16); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.x = u; return b; }
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { uint4 v = { x, y, z, w }; return v; }
static inline uint2 make_uint2(unsigned x, unsigned y) { uint2 v = { x, y }; return v; }

/* ---- runtime ---- */
typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
                         cudaErrorNoDevice = 100, cudaErrorNotReady = 600 } cudaError_t;
/* profiler ranges (ncu --profile-from-start off): nothing to profile here */
static inline cudaError_t cudaProfilerStart(void) { return cudaSuccess; }
static inline cudaError_t cudaProfilerStop(void) { return cudaSuccess; }
typedef enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                              cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 } cudaMemcpyKind;
typedef enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
typedef uly_emu_stream *cudaStream_t;
typedef struct uly_emu_event *cudaEvent_t;
#define cudaStreamNonBlocking 1
typedef struct { unsigned char bytes[16]; } cudaUUID_t;
typedef struct cudaDeviceProp { char name[256]; cudaUUID_t uuid; size_t totalGlobalMem; int major, minor; } cudaDeviceProp;

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int dev);
typedef enum cudaDeviceAttr { cudaDevAttrClockRate = 13, cudaDevAttrMultiProcessorCount = 16,
                               cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrComputeCapabilityMinor = 76 } cudaDeviceAttr;
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev);   /* 132 multiprocessors, as an H200 */
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaMalloc(void **p, size_t bytes);
template <typename T> static inline cudaError_t cudaMalloc(T **p, size_t bytes) { return cudaMalloc((void **)p, bytes); }
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);   /* runs what is ready; cudaErrorNotReady if work remains */
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDriverGetVersion(int *v);
typedef struct uly_emu_mempool *cudaMemPool_t;
typedef enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4, cudaMemPoolAttrUsedMemCurrent = 7,
                               cudaMemPoolAttrUsedMemHigh = 8 } cudaMemPoolAttr;
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int dev);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep);
typedef enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;
/* as on an sm_90 GPU: a block may have at most 227 KiB of dynamic shared memory, and a kernel more
 * than 48 KiB only once allowed */
template <typename F>
static inline cudaError_t cudaFuncSetAttribute(F *f, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
    if (value < 0 || value > 227 * 1024) return cudaErrorInvalidValue;
    uly_emu::allow_dynamic_smem(reinterpret_cast<const void *>(f), value);
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e);
#define cudaEventDisableTiming 2
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);
cudaError_t cudaEventDestroy(cudaEvent_t e);

/* ---- the driver's tensor maps (TMA), as cuda.h declares them; the emulator's encoder keeps the
 * arguments in the opaque bytes (cuda_emu.cpp), reached through cudaGetDriverEntryPointByVersion ---- */
#define __grid_constant__
typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
typedef enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1 } CUresult;
typedef struct alignas(64) CUtensorMap_st { cuuint64_t opaque[16]; } CUtensorMap;
typedef enum { CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9 } CUtensorMapDataType;
typedef enum { CU_TENSOR_MAP_INTERLEAVE_NONE = 0 } CUtensorMapInterleave;
typedef enum { CU_TENSOR_MAP_SWIZZLE_NONE = 0, CU_TENSOR_MAP_SWIZZLE_128B = 3 } CUtensorMapSwizzle;
typedef enum { CU_TENSOR_MAP_L2_PROMOTION_NONE = 0, CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3 } CUtensorMapL2promotion;
typedef enum { CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0 } CUtensorMapFloatOOBfill;
typedef CUresult (*PFN_cuTensorMapEncodeTiled_v12000)(CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank,
                                                      void *base, const cuuint64_t *dims, const cuuint64_t *strides,
                                                      const cuuint32_t *box, const cuuint32_t *element_strides,
                                                      CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                                      CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill fill);
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0, cudaDriverEntryPointSymbolNotFound = 1 };
#define cudaEnableDefault 0
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *status);

/* ---- cuBLAS (column-major GEMMs) ---- */
typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1, CUBLAS_STATUS_ALLOC_FAILED = 3,
               CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_ARCH_MISMATCH = 8, CUBLAS_STATUS_EXECUTION_FAILED = 13,
               CUBLAS_STATUS_INTERNAL_ERROR = 14, CUBLAS_STATUS_NOT_SUPPORTED = 15 } cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef struct uly_emu_cublas *cublasHandle_t;
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType_t at, int lda, const void *B, cudaDataType_t bt,
                            int ldb, const void *beta, void *C, cudaDataType_t ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType_t at, int lda,
                                          long long sa, const void *B, cudaDataType_t bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType_t ct, int ldc, long long sc, int batches,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo);
namespace uly_emu {
/* column-major C = alpha op(A) op(B) + beta C (+ bias[i] on row i where bias is given): f32
 * accumulation in index order, bf16 inputs read exactly, f32 inputs rounded to TF32 (10 mantissa
 * bits, to nearest) when `tf32` (the compute type CUBLAS_COMPUTE_32F_FAST_TF32, as tensor cores
 * do); C f32 or bf16 (ct: read as f32, each result rounded to nearest even); what cuBLAS and
 * cuBLASLt stand for here; runs now, the callers queue it on a stream */
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, const void *A, cudaDataType_t at,
          int lda, const void *B, cudaDataType_t bt, int ldb, float beta, void *C, cudaDataType_t ct, int ldc, bool tf32,
          const float *bias = NULL);
}
#endif
