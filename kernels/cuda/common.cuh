/* kernels/cuda/common.cuh — shared by the CUDA backend's .cu files: the one stream every kernel
 * runs on (in order, asynchronously), the first failure kept for the core (take_error), launch
 * helpers and the small device math the kernels share. */
#ifndef ULY_CUDA_COMMON_CUH
#define ULY_CUDA_COMMON_CUH
#include <stdlib.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include "uly.h"
#include "launch.cuh"
#include "uly_backend.h"

/* the backend's stream and its failure record (backend.cu) */
extern cudaStream_t uly_cu_stream;
void uly_cu_fail(const char *what, cudaError_t err);     /* keeps the first failure */
void uly_cu_fail_msg(const char *what, const char *msg);
/* wait for the stream (the host needs its results; `what` names the wait in an error): while
 * NCCL work is in flight, under the NCCL watchdog (comm.cu); 0 or -1 */
int uly_cu_stream_wait(const char *what);

/* after a launch: a bad configuration is reported now, a fault in the kernel at the next sync */
#define ULY_CU_LAUNCHED(name) do { cudaError_t e_ = cudaGetLastError(); if (e_ != cudaSuccess) uly_cu_fail(name, e_); } while (0)

static inline unsigned uly_cu_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    return (unsigned)(b > 65535 * 8 ? 65535 * 8 : b);   /* kernels loop grid-stride beyond this */
}

/* bf16 values as their bits (uint16_t): read exactly; written rounded to nearest even (NaN kept a
 * NaN). The dtype-converting copies and the bf16-activation kernels share them, so a kernel that
 * reads and writes bf16 gives the bits of the f32 kernel between two converting copies. */
__device__ static inline float uly_cu_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ static inline uint16_t uly_cu_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* element i of an f32 or a bf16 array, and a store into either: the kernels templated on T */
__device__ static inline float uly_cu_ld(const float *p, int64_t i) { return p[i]; }
__device__ static inline float uly_cu_ld(const uint16_t *p, int64_t i) { return uly_cu_bf16_to_f32(p[i]); }
__device__ static inline void uly_cu_st(float *p, int64_t i, float v) { p[i] = v; }
__device__ static inline void uly_cu_st(uint16_t *p, int64_t i, float v) { p[i] = uly_cu_f32_to_bf16(v); }

/* a grid-stride loop may count in int32_t up to this n: its last step (at most uly_cu_blocks' cap
 * of blocks x up to 1024 threads past n) must not overflow */
#define ULY_CU_I32_LOOP_MAX ((int64_t)INT32_MAX - 65535 * 8 * 1024)
/* whether a kernel over n elements reaching element offsets up to `reach` may index in int32_t;
 * ULY_CUDA_INDEX64=1 says no to all (the device specs run the 64-bit paths so) */
static inline bool uly_cu_index32(int64_t n, int64_t reach) {
    const char *e = getenv("ULY_CUDA_INDEX64");
    return !(e && e[0] == '1') && n < ULY_CU_I32_LOOP_MAX && reach < INT32_MAX;
}
#define ULY_CU_FOR(i, n) for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
                              i += (int64_t)gridDim.x * blockDim.x)

/* block-wide sum of one double per thread (blockDim.x a multiple of 32, at most 1024) */
__device__ static inline double uly_cu_block_sum(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = threadIdx.x < nw ? part[threadIdx.x] : 0.0;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __shared__ double total;
    if (threadIdx.x == 0) total = v;
    __syncthreads();
    return total;
}

__device__ static inline float uly_cu_block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = threadIdx.x < nw ? part[threadIdx.x] : -INFINITY;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __shared__ float total;
    if (threadIdx.x == 0) total = v;
    __syncthreads();
    return total;
}

/* the counter-based uniform of kernels/cpu/dropout.c, bit for bit */
__device__ static inline uint64_t uly_cu_mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}
__device__ static inline float uly_cu_uniform(uint64_t seed, uint64_t counter) {
    uint64_t k1 = uly_cu_mix64(seed ^ 0x243f6a8885a308d3ULL), k2 = uly_cu_mix64(seed + 0x13198a2e03707344ULL);
    uint64_t h = uly_cu_mix64(uly_cu_mix64((counter * 0x9e3779b97f4a7c15ULL) ^ k1) + k2);
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

/* the kernel table entries, one group per file */
extern "C" {
/* elementwise.cu */
void cu_unary_forward(float *out, const float *inp, int64_t n, int kind);
void cu_unary_backward(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind);
void cu_swiglu_forward(float *out, const float *gate, const float *up, int64_t n);
void cu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n);
void cu_binary_forward(float *out, const float *a, const int64_t *sa, const float *b, const int64_t *sb, int ndim,
                       const int64_t *shape, int kind);
void cu_scalar_forward(float *out, const float *a, int64_t n, int kind, float s);
void cu_scalar_backward(float *dinp, const float *dout, const float *a, int64_t n, int kind, float s);
void cu_axpy_accumulate(float *y, const float *x, int64_t n, float alpha);
void cu_dropout_forward(float *out, const float *inp, int64_t n, float p, uint64_t seed, uint64_t offset);
void cu_dropout_backward(float *dinp, const float *dout, int64_t n, float p, uint64_t seed, uint64_t offset);
void cu_rope_forward(float *out, const float *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, float theta);
void cu_rope_backward(float *dinp, const float *dout, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, float theta);
void cu_binary_forward_typed(void *out, int ot, const void *a, int at, const int64_t *sa, const void *b, int bt,
                             const int64_t *sb, int ndim, const int64_t *shape, int kind);
void cu_swiglu_forward_bf16(void *out, const void *gate, const void *up, int64_t n);
void cu_unary_forward_bf16(void *out, const void *inp, int64_t n, int kind);
void cu_unary_backward_bf16(float *dinp, const float *dout, const void *inp, const void *out, int64_t n, int kind);
int cu_rope_forward_bf16(void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, float theta);
void cu_swiglu_backward_bf16(float *dgate, float *dup, const float *dout, const void *gate, const void *up, int64_t n);
void cu_copy_view(const uly_view *dst, const uly_view *src);
void cu_sum_view(const uly_view *dst, const uly_view *src, float alpha);
void cu_fill_view(const uly_view *dst, double value);
/* rows.cu */
void cu_reduce_sum_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, float scale);
void cu_reduce_sum_backward(float *dinp, const float *dout, int64_t outer, int64_t n, int64_t inner, float scale);
void cu_reduce_max_forward(float *out, int64_t *argmax, const float *inp, int64_t outer, int64_t n, int64_t inner);
void cu_reduce_max_backward(float *dinp, const float *dout, const int64_t *argmax, int64_t outer, int64_t n, int64_t inner);
void cu_softmax_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, int is_log);
void cu_softmax_backward(float *dinp, const float *dout, const float *out, int64_t outer, int64_t n, int64_t inner, int is_log);
void cu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                          int64_t rows, int64_t C, float eps);
void cu_layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                           const float *mean, const float *rstd, int64_t rows, int64_t C);
void cu_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, int64_t rows, int64_t C, float eps);
void cu_rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp, const float *w, const float *rstd,
                         int64_t rows, int64_t C);
int cu_layernorm_forward_bf16(void *out, float *mean, float *rstd, const void *inp, const float *w, const float *b,
                              int64_t rows, int64_t C, float eps);
int cu_layernorm_backward_bf16(float *dinp, float *dw, float *db, const float *dout, const void *inp, const float *w,
                               const float *mean, const float *rstd, int64_t rows, int64_t C);
int cu_rmsnorm_forward_bf16(void *out, float *rstd, const void *inp, const float *w, int64_t rows, int64_t C, float eps);
int cu_rmsnorm_backward_bf16(float *dinp, float *dw, const float *dout, const void *inp, const float *w,
                             const float *rstd, int64_t rows, int64_t C);
int64_t cu_cross_entropy_forward_bf16(float *loss, float *lse, const void *logits, const void *t, int tb, int64_t rows,
                                      int64_t V, int64_t ignore);
int cu_cross_entropy_backward_bf16(float *dlogits, const float *dloss, const void *logits, const float *lse,
                                   const void *t, int tb, int64_t rows, int64_t V, int64_t ignore);
void cu_embedding_forward(float *out, const void *idx, int ib, const float *w, int64_t n, int64_t C);
void cu_embedding_backward(float *dw, const float *dout, const void *idx, int ib, int64_t n, int64_t C);
int64_t cu_embedding_first_bad_index(const void *idx, int ib, int64_t n, int64_t V);
int64_t cu_cross_entropy_forward(float *loss, float *lse, const float *logits, const void *t, int tb, int64_t rows,
                                 int64_t V, int64_t ignore);
void cu_cross_entropy_backward(float *dlogits, const float *dloss, const float *logits, const float *lse, const void *t,
                               int tb, int64_t rows, int64_t V, int64_t ignore);
void cu_optim_adamw(float *p, const float *g, float *m, float *v, int64_t n, float decay, float b1, float a1, float b2,
                    float a2, float step_size, float bc2_sqrt, float eps);
void cu_optim_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float wd, float momentum, float keep,
                  int nesterov, int init);
double cu_optim_sumsq(const float *x, int64_t n);
void cu_optim_adamw_multi(int n, float *const *p, const float *const *g, float *const *m, float *const *v,
                          const int64_t *sizes, const float *decay, float b1, float a1, float b2, float a2,
                          float step_size, float bc2_sqrt, float eps);
void cu_optim_scale(float *x, int64_t n, float s);
/* gemm.cu */
int cu_gemm_operand_ok(int64_t rows, int64_t cols, int64_t rs, int64_t cs);
void cu_gemm_batched(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K,
                     float beta);
int cu_gemm_init(void);
void cu_gemm_batched_bf16(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K,
                          float beta);
int cu_gemm_bias(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, const float *bias, int bf16);
/* comm.cu */
void cu_pack_layout(void *dst, const void *src, const uly_comm_layout *L, int64_t es);
void cu_unpack_layout(void *dst, const uly_comm_layout *L, const void *src, int64_t es);
int cu_device_uuid(unsigned char *uuid16);
int cu_comm_unique_id(void *id, int64_t len);
void *cu_comm_create(int nranks, int rank, const void *id);
void cu_comm_destroy(void *comm);
int cu_comm_all_reduce(void *comm, void *buf, int64_t count, int dtype, int op);
int cu_comm_all_to_all_v(void *comm, const void *send, const int64_t *scounts, const int64_t *sdispls, void *recv,
                         const int64_t *rcounts, const int64_t *rdispls, int dtype);
int cu_comm_all_reduce_start(void *comm, void *buf, int64_t count, int dtype, int op);
int cu_comm_join(void);
int cu_comm_all_gather_start(void *comm, const void *send, void *recv, int64_t count, int dtype);
int cu_comm_reduce_scatter_start(void *comm, const void *send, void *recv, int64_t count, int dtype, int op);
void cu_comm_set_timeout(double seconds);
int cu_comm_aborted(void *comm);
/* attention.cu */
void cu_attention_forward(float *out, float *probs, const float *q, const float *k, const float *v, int64_t B, int64_t Tq,
                          int64_t Tk, int64_t H, int64_t Hkv, int64_t D, float scale, int causal);
int cu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                          const float *v, const float *probs, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv,
                          int64_t D, float scale, int causal);
int64_t cu_flash_scratch_floats(const flash_problem *p, int backward);
int cu_flash_forward(float *out, float *lse, float *scratch, const flash_problem *p);
int cu_flash_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse, float *delta,
                      float *scratch, const flash_problem *p);
}
#endif
