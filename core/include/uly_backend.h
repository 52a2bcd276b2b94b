/* core/include/uly_backend.h — the compute backend table: everything the core asks of a device.
 *
 * The core (libulysses.so) validates arguments, allocates results, records autograd and calls
 * these functions through the table of the tensors' device: the CPU table
 * (core/backend_cpu.c, the kernels of kernels/cpu/), the simulated device (core/backend_sim.c:
 * host memory behind tagged pointers, for specs on machines without a GPU) or the CUDA table
 * handed over by libulysses_cuda.so (kernels/cuda/backend.cu) when a CUDA device is first asked
 * for. Not part of the FFI surface; shared by C and CUDA sources.
 *
 * The kernel entries have the names, arguments and contracts of kernels/cpu/kernels.h and
 * kernels/cpu/flash_attention.h (forward writes, backward ACCUMULATES, NULL gradient = skipped);
 * every pointer they take is a pointer into the backend's memory. A device backend may run them
 * asynchronously, in order, on its stream; failures are kept and handed over by take_error(). */
#ifndef ULY_BACKEND_H
#define ULY_BACKEND_H
#include <stdint.h>
#include "uly.h"
#include "../../kernels/cpu/kernels.h"
#include "../../kernels/cpu/flash_attention.h"
#ifdef __cplusplus
extern "C" {
#endif

#define ULY_BACKEND_ABI 11
#define ULY_VIEW_MAX_DIMS 8

/* a strided window over backend memory: element [0, ..., 0] at p, strides in elements */
typedef struct uly_view {
    void *p;
    int dtype;
    int ndim;
    int64_t shape[ULY_VIEW_MAX_DIMS];
    int64_t stride[ULY_VIEW_MAX_DIMS];
} uly_view;

enum uly_copy_kind { ULY_COPY_H2D = 0, ULY_COPY_D2H = 1, ULY_COPY_D2D = 2 };

typedef struct uly_backend {
    int abi;                 /* ULY_BACKEND_ABI */
    int64_t size;            /* sizeof(uly_backend) as compiled by the provider */
    const char *name;        /* "cpu", "sim", "cuda" */

    /* ---- memory: raw buffers (the core's caching pool, core/alloc.c, sits on top) ---- */
    void *(*raw_alloc)(int64_t bytes);                 /* NULL on failure (reason: take_error) */
    void (*raw_free)(void *p);
    int (*memory_info)(int64_t *free_b, int64_t *total_b);
    int (*copy)(void *dst, const void *src, int64_t bytes, int kind); /* ULY_COPY_*; the host side is plain memory */
    int (*memset0)(void *p, int64_t bytes);
    int (*synchronize)(void);                          /* wait for every queued kernel */
    const char *(*take_error)(void);                   /* the first failure since the last call, or NULL; clears it */

    /* ---- strided element walks (dtype-converting copy; reduction into a broadcast view) ---- */
    /* dst = src elementwise over dst's shape; src has dst's ndim/shape with stride 0 where broadcast */
    void (*copy_view)(const uly_view *dst, const uly_view *src);
    /* dst += alpha * src (f32) over src's shape; dst has src's ndim/shape with stride 0 where summed */
    void (*sum_view)(const uly_view *dst, const uly_view *src, float alpha);
    /* f32 view = value */
    void (*fill_view)(const uly_view *dst, double value);

    /* ---- kernels (kernels/cpu/kernels.h) ---- */
    void (*unary_forward)(float *out, const float *inp, int64_t n, int kind);
    void (*unary_backward)(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind);
    void (*swiglu_forward)(float *out, const float *gate, const float *up, int64_t n);
    void (*swiglu_backward)(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n);
    void (*reduce_sum_forward)(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, float scale);
    void (*reduce_sum_backward)(float *dinp, const float *dout, int64_t outer, int64_t n, int64_t inner, float scale);
    void (*reduce_max_forward)(float *out, int64_t *argmax, const float *inp, int64_t outer, int64_t n, int64_t inner);
    void (*reduce_max_backward)(float *dinp, const float *dout, const int64_t *argmax, int64_t outer, int64_t n, int64_t inner);
    void (*softmax_forward)(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, int is_log);
    void (*softmax_backward)(float *dinp, const float *dout, const float *out, int64_t outer, int64_t n, int64_t inner,
                             int is_log);
    void (*layernorm_forward)(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                              const float *bias, int64_t rows, int64_t C, float eps);
    void (*layernorm_backward)(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                               const float *weight, const float *mean, const float *rstd, int64_t rows, int64_t C);
    void (*rmsnorm_forward)(float *out, float *rstd, const float *inp, const float *weight, int64_t rows, int64_t C,
                            float eps);
    void (*rmsnorm_backward)(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                             const float *rstd, int64_t rows, int64_t C);
    void (*embedding_forward)(float *out, const void *idx, int idx_bytes, const float *weight, int64_t n, int64_t C);
    void (*embedding_backward)(float *dweight, const float *dout, const void *idx, int idx_bytes, int64_t n, int64_t C);
    int64_t (*embedding_first_bad_index)(const void *idx, int idx_bytes, int64_t n, int64_t V);
    void (*rope_forward)(float *out, const float *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos_offset,
                         float theta);
    void (*rope_backward)(float *dinp, const float *dout, int64_t B, int64_t T, int64_t H, int64_t D,
                          int64_t pos_offset, float theta);
    void (*dropout_forward)(float *out, const float *inp, int64_t n, float p, uint64_t seed, uint64_t offset);
    void (*dropout_backward)(float *dinp, const float *dout, int64_t n, float p, uint64_t seed, uint64_t offset);
    int64_t (*cross_entropy_forward)(float *loss, float *lse, const float *logits, const void *targets,
                                     int target_bytes, int64_t rows, int64_t V, int64_t ignore_index);
    void (*cross_entropy_backward)(float *dlogits, const float *dloss, const float *logits, const float *lse,
                                   const void *targets, int target_bytes, int64_t rows, int64_t V,
                                   int64_t ignore_index);
    void (*attention_forward)(float *out, float *probs, const float *q, const float *k, const float *v, int64_t B,
                              int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D, float scale, int causal);
    int (*attention_backward)(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                              const float *v, const float *probs, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                              int64_t Hkv, int64_t D, float scale, int causal);
    void (*binary_forward)(float *out, const float *a, const int64_t *a_strides, const float *b,
                           const int64_t *b_strides, int ndim, const int64_t *shape, int kind);
    void (*scalar_forward)(float *out, const float *a, int64_t n, int kind, float s);
    void (*scalar_backward)(float *dinp, const float *dout, const float *a, int64_t n, int kind, float s);
    void (*axpy_accumulate)(float *y, const float *x, int64_t n, float alpha);
    int (*gemm_operand_ok)(int64_t rows, int64_t cols, int64_t rs, int64_t cs);
    void (*gemm_batched)(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                         int64_t K, float beta);

    /* ---- flash attention (kernels/cpu/flash_attention.h); pointers in the problem are device pointers ---- */
    int64_t (*flash_attention_scratch_floats)(const flash_problem *p, int backward);
    int (*flash_attention_forward)(float *out, float *lse, float *scratch, const flash_problem *p);
    int (*flash_attention_backward)(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                    const float *lse, float *delta, float *scratch, const flash_problem *p);

    /* ---- optimizers ---- */
    void (*optim_adamw)(float *p, const float *g, float *m, float *v, int64_t n, float decay, float beta1,
                        float one_minus_beta1, float beta2, float one_minus_beta2, float step_size, float bc2_sqrt,
                        float eps);
    void (*optim_sgd)(float *p, const float *g, float *buf, int64_t n, float lr, float weight_decay, float momentum,
                      float one_minus_dampening, int nesterov, int init);
    double (*optim_sumsq)(const float *x, int64_t n);
    void (*optim_scale)(float *x, int64_t n, float s);

    /* ---- mixed precision: gemm_batched with A and B rounded to bf16 (round to nearest even),
     *      products exact, f32 accumulation and output; a bf16 C (bf16 activations: only with
     *      K > 0 and beta 0) gets the f32 result rounded to nearest even. NULL: the core rounds
     *      copies of the operands and calls gemm_batched (same numbers, no speed-up). ---- */
    void (*gemm_batched_bf16)(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                              int64_t K, float beta);
    /* ---- a Linear layer's GEMM adding its bias itself: C = bias + A B (C [M, N] row-major
     *      contiguous, f32, or bf16 for bf16 activations: the f32 result rounded once; bias [N]
     *      contiguous, A and B as in gemm_batched, no batches, K > 0), with bf16 operands when
     *      bf16. 0, or -1 when it does not take this problem (nothing was done: the core then
     *      seeds an f32 C with the bias and calls the GEMM with beta 1). NULL: never. ---- */
    int (*gemm_bias)(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, const float *bias, int bf16);

    /* ---- exchanges of device buffers (core/comm_exchange.c): a layout's elements (uly_comm_layout, in
     *      elements of es bytes) gathered into / scattered from a contiguous buffer ---- */
    void (*pack_layout)(void *dst, const void *src, const uly_comm_layout *L, int64_t es);
    void (*unpack_layout)(void *dst, const uly_comm_layout *L, const void *src, int64_t es);

    /* ---- collectives on device memory (NCCL on the GPU); every entry NULL when the backend has
     *      none, and then the core stages device buffers through host memory over MPI ---- */
    int (*device_uuid)(unsigned char *uuid16);             /* which physical device this process uses */
    int (*comm_unique_id)(void *id, int64_t len);          /* on one rank; len = 128 */
    void *(*comm_create)(int nranks, int rank, const void *id); /* collective over the group; NULL on failure */
    void (*comm_destroy)(void *comm);
    int (*comm_all_reduce)(void *comm, void *buf, int64_t count, int dtype, int op);  /* in place, ULY_REDUCE_* */
    int (*comm_all_to_all_v)(void *comm, const void *send, const int64_t *send_counts, const int64_t *send_displs,
                             void *recv, const int64_t *recv_counts, const int64_t *recv_displs, int dtype);
    /* comm_all_reduce without ordering later device work after it until comm_join (which orders it
     * after every collective queued so far): the data moves while the device computes */
    int (*comm_all_reduce_start)(void *comm, void *buf, int64_t count, int dtype, int op);
    int (*comm_join)(void);

    /* ---- AdamW over n parameters in one launch (host arrays of device pointers; NULL: the core
     *      calls optim_adamw per parameter). Same arithmetic as optim_adamw, element by element. ---- */
    void (*optim_adamw_multi)(int n, float *const *p, const float *const *g, float *const *m, float *const *v,
                              const int64_t *sizes, const float *decay, float beta1, float one_minus_beta1,
                              float beta2, float one_minus_beta2, float step_size, float bc2_sqrt, float eps);

    /* ---- the ZeRO collectives on device memory, queued like comm_all_reduce_start (ordered after
     *      the compute queued so far, joined by comm_join); count is each rank's block, in
     *      elements. all_gather: recv = every rank's send in rank order (send may be recv's own
     *      block: in place); reduce_scatter: recv = this rank's block of the reduction of every
     *      rank's send. NULL: the core stages them through host memory. ---- */
    int (*comm_all_gather_start)(void *comm, const void *send, void *recv, int64_t count, int dtype);
    int (*comm_reduce_scatter_start)(void *comm, const void *send, void *recv, int64_t count, int dtype, int op);

    /* ---- the watchdog over device collectives in flight (NULL: none): a host wait on the stream
     *      that outlasts `seconds` (<= 0: no limit) while they are in flight, or an asynchronous
     *      error of the library, aborts every communicator and fails; comm_aborted says whether
     *      that has happened to comm (which the core then never uses again) ---- */
    void (*comm_set_timeout)(double seconds);
    int (*comm_aborted)(void *comm);

    /* ---- bf16 activations: kernels above with their activations in bf16 (void pointers at the
     *      bits), weights, statistics and gradients f32 as before: each bf16 value read exactly,
     *      each result rounded once to nearest even (as the converting copies round), the f32
     *      entry's arithmetic otherwise, so each gives the f32 entry's bits between two
     *      converting copies. binary_forward_typed: out, a and b each in its own dtype. NULL: the
     *      core converts around the f32 entry. The row kernels (norms, cross-entropy, RoPE) return
     *      0, or -1 (cross-entropy's forward: -1 for its count) when they could not run, having
     *      written nothing: no memory for their row buffers on the CPU; the core reports it. ---- */
    void (*binary_forward_typed)(void *out, int out_dtype, const void *a, int a_dtype, const int64_t *a_strides,
                                 const void *b, int b_dtype, const int64_t *b_strides, int ndim, const int64_t *shape,
                                 int kind);
    void (*swiglu_forward_bf16)(void *out, const void *gate, const void *up, int64_t n);
    void (*swiglu_backward_bf16)(float *dgate, float *dup, const float *dout, const void *gate, const void *up, int64_t n);
    int (*layernorm_forward_bf16)(void *out, float *mean, float *rstd, const void *inp, const float *weight,
                                  const float *bias, int64_t rows, int64_t C, float eps);
    int (*layernorm_backward_bf16)(float *dinp, float *dweight, float *dbias, const float *dout, const void *inp,
                                   const float *weight, const float *mean, const float *rstd, int64_t rows, int64_t C);
    int (*rmsnorm_forward_bf16)(void *out, float *rstd, const void *inp, const float *weight, int64_t rows, int64_t C,
                                float eps);
    int (*rmsnorm_backward_bf16)(float *dinp, float *dweight, const float *dout, const void *inp, const float *weight,
                                 const float *rstd, int64_t rows, int64_t C);
    int64_t (*cross_entropy_forward_bf16)(float *loss, float *lse, const void *logits, const void *targets,
                                          int target_bytes, int64_t rows, int64_t V, int64_t ignore_index);
    int (*cross_entropy_backward_bf16)(float *dlogits, const float *dloss, const void *logits, const float *lse,
                                       const void *targets, int target_bytes, int64_t rows, int64_t V,
                                        int64_t ignore_index);
    void (*unary_forward_bf16)(void *out, const void *inp, int64_t n, int kind);
    void (*unary_backward_bf16)(float *dinp, const float *dout, const void *inp, const void *out, int64_t n, int kind);
    int (*rope_forward_bf16)(void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos_offset,
                             float theta);
    /* ---- bf16 precision where gemm_batched_bf16 is NULL: gemm_batched_rounded is gemm_batched
     *      for it, free to multiply at a bf16 rate (the simulated device: the AMX tiles); while
     *      gemm_rounds_operands() says 1 it rounds f32 operands to bf16 itself (nearest even) and
     *      the core hands them over as they are, else the core rounds copies first (rounding
     *      twice changes nothing). NULL: gemm_batched on copies the core rounded. ---- */
    void (*gemm_batched_rounded)(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                                 int64_t K, float beta);
    int (*gemm_rounds_operands)(void);
} uly_backend;

#ifdef __cplusplus
}
#endif
#endif
