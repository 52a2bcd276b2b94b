/* uly.h — the ONE public header of libulysses: the whole C API and the LuaJIT FFI surface.
 *
 * Macro-free on purpose: lua/ulysses/ffi.lua feeds this file (minus the # lines) to ffi.cdef.
 * Conventions:
 *  - every tensor is an opaque, reference-counted `uly_tensor *`; functions that return one
 *    return a NEW reference (release it with uly_tensor_release) or NULL on error;
 *  - functions returning int return 0 on success and -1 on error;
 *  - on error the message (op, shapes, dtypes, a hint) is in uly_last_error() (thread-local);
 *  - dimensions are 0-based here (the Lua binding is 1-based); shapes and counts are int64_t.
 */
#ifndef ULY_H
#define ULY_H
#include <stdint.h>
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif

typedef struct uly_tensor uly_tensor;

enum uly_dtype { ULY_DTYPE_F32 = 0, ULY_DTYPE_BF16 = 1, ULY_DTYPE_I32 = 2, ULY_DTYPE_I64 = 3, ULY_DTYPE_F64 = 4 };
enum uly_device { ULY_DEVICE_CPU = 0, ULY_DEVICE_CUDA = 1, ULY_DEVICE_COUNT = 2 };
enum uly_reduction { ULY_REDUCTION_MEAN = 0, ULY_REDUCTION_SUM = 1, ULY_REDUCTION_NONE = 2 };

/* ---- library ---- */
const char *uly_last_error(void);
void uly_clear_error(void);
const char *uly_version(void);
const char *uly_blas_corename(void);       /* OpenBLAS kernel family in use, e.g. "Haswell" */
int uly_has_feature(const char *name);     /* "mpi", "hdf5", "cuda", "openmp" -> 1/0 */
int uly_file_stamp(const char *path, int64_t *size, int64_t *mtime_ns); /* a file's bytes and modification
                                               time (ns since the epoch); -1 with the error set if it cannot be read */
int uly_set_num_threads(int n);            /* kernels and BLAS; n <= 0 restores the default */
int uly_get_num_threads(void);
double uly_cpu_peak_flops(int threads);    /* f32 FMA peak of `threads` threads in FLOP/s, measured (~15 ms) */
const char *uly_cpu_amx_status(void);      /* bf16 matmuls on the CPU's AMX tiles: "on", or "off: why" */
int uly_set_cpu_amx(int on);               /* use AMX where the CPU has it (default 1); the previous setting */
double uly_cpu_amx_peak_flops(int threads); /* the AMX tiles' bf16 peak in FLOP/s, measured; 0 where AMX is off */
const char *uly_cpu_avx512_bf16_status(void); /* bf16 matmuls by AVX512-BF16 where AMX is off: "on"/"off: why" */
int uly_set_cpu_avx512_bf16(int on);        /* AVX512-BF16: 1 always where the CPU has it, 0 never, -1 (the default)
                                               where it beats f32 FMA; the previous setting */
double uly_cpu_avx512_bf16_peak_flops(int threads); /* its bf16 peak in FLOP/s, measured; 0 where it is off */
const char *uly_cpu_bf16_gemm(void);        /* the engine of bf16 matmuls: "amx", "avx512_bf16", or "off: why" */
double uly_cpu_bf16_peak_flops(int threads); /* that engine's bf16 peak in FLOP/s, measured; 0 where none runs */
int uly_cpu_bf16_kernels(int on);           /* bf16 activations on the CPU through its bf16 kernels (1, default) or
                                               converting copies (0); < 0 only reads; the previous setting */
int64_t uly_cpu_bf16_kernel_calls(void);    /* how many times a CPU bf16 kernel has run in this process */
const char *uly_dtype_name(int dtype);
int64_t uly_dtype_size(int dtype);

/* ---- memory: bytes held by live tensors and the caching pool ---- */
int64_t uly_memory_allocated(void);        /* bytes currently held by tensors */
int64_t uly_memory_peak(void);             /* high-water mark of uly_memory_allocated */
int64_t uly_memory_reserved(void);         /* allocated + cached free blocks */
void uly_memory_reset_peak(void);
void uly_memory_empty_cache(void);         /* return cached blocks to the OS */
void uly_memory_set_limit(int64_t nbytes); /* allocations beyond it fail cleanly; <= 0: physical RAM */
int64_t uly_memory_limit(void);
int64_t uly_tensor_live_count(void);       /* tensor handles alive (leak checks) */

/* ---- devices (core/device.c): 'cpu' always; 'cuda' once a backend is registered for it: the
 *      CUDA library's table (lua/ulysses/cuda.lua registers it on first use) or the host-memory
 *      simulation (tagged pointers that crash if the core ever touches them directly: specs of
 *      the device paths on machines without a GPU). Each device has its own caching pool. ---- */
int uly_device_register(int device, const void *backend);  /* a uly_backend table (NULL: none); refused while the device holds tensors */
int uly_device_simulate(void);                /* device 'cuda' becomes the simulation */
int uly_device_available(int device);
const char *uly_device_backend(int device);   /* "cpu", "sim", "cuda"; NULL when none */
int uly_device_synchronize(int device);       /* waits for queued kernels; reports their failures */
int64_t uly_device_memory_allocated(int device);  /* bytes held by tensors on the device */
int uly_device_memory_stats(int device, int64_t *stats); /* [allocated, peak, reserved, limit, raw_allocs, raw_frees] */
int uly_device_memory_reset_peak(int device);
int uly_device_empty_cache(int device);
int uly_device_set_memory_limit(int device, int64_t nbytes); /* <= 0: the device's total memory */

/* ---- random numbers (one global generator: seed + counter, counter-based) ---- */
void uly_manual_seed(uint64_t seed);
uint64_t uly_rng_seed(void);
uint64_t uly_rng_offset(void);
void uly_rng_set_state(uint64_t seed, uint64_t offset);

/* ---- tensor creation and lifetime ---- */
uly_tensor *uly_tensor_empty(int ndim, const int64_t *shape, int dtype, int device);
uly_tensor *uly_tensor_arange(double start, double end, double step, int dtype);
void uly_tensor_retain(uly_tensor *t);
void uly_tensor_release(uly_tensor *t);

/* ---- metadata ---- */
int uly_tensor_ndim(const uly_tensor *t);
int64_t uly_tensor_size(const uly_tensor *t, int dim);
int64_t uly_tensor_stride(const uly_tensor *t, int dim);
int64_t uly_tensor_numel(const uly_tensor *t);
int64_t uly_tensor_nbytes(const uly_tensor *t);
int uly_tensor_dtype(const uly_tensor *t);
int uly_tensor_device(const uly_tensor *t);
int64_t uly_tensor_storage_offset(const uly_tensor *t);
int uly_tensor_is_contiguous(const uly_tensor *t);
void *uly_tensor_data_ptr(const uly_tensor *t);   /* address of element [0,...,0] */
int uly_tensor_shares_storage(const uly_tensor *a, const uly_tensor *b);
int uly_tensor_describe(const uly_tensor *t, char *buf, int64_t buflen); /* "f32[2, 3]" */

/* ---- data in and out (converting dtypes; the tensor may be a strided view) ---- */
int uly_tensor_copy_from(uly_tensor *t, const void *src, int src_dtype, int64_t numel);
int uly_tensor_copy_to(const uly_tensor *t, void *dst, int dst_dtype, int64_t numel);
int uly_tensor_fill_(uly_tensor *t, double value);
int uly_tensor_copy_(uly_tensor *dst, const uly_tensor *src);     /* src broadcast to dst */
int uly_tensor_uniform_(uly_tensor *t, double lo, double hi);      /* from the global generator */
int uly_tensor_normal_(uly_tensor *t, double mean, double std);
int uly_tensor_get_item(const uly_tensor *t, const int64_t *index, double *value);
int uly_tensor_set_item(uly_tensor *t, const int64_t *index, double value);

/* ---- views (share storage; differentiable) and copies ---- */
uly_tensor *uly_tensor_view(uly_tensor *t, int ndim, const int64_t *shape);
uly_tensor *uly_tensor_reshape(uly_tensor *t, int ndim, const int64_t *shape);   /* view if possible */
uly_tensor *uly_tensor_permute(uly_tensor *t, const int *dims);
uly_tensor *uly_tensor_transpose(uly_tensor *t, int dim0, int dim1);
uly_tensor *uly_tensor_narrow(uly_tensor *t, int dim, int64_t start, int64_t length);
uly_tensor *uly_tensor_select(uly_tensor *t, int dim, int64_t index);            /* drops dim */
uly_tensor *uly_tensor_expand(uly_tensor *t, int ndim, const int64_t *shape);
uly_tensor *uly_tensor_contiguous(uly_tensor *t);
uly_tensor *uly_tensor_clone(uly_tensor *t);
uly_tensor *uly_tensor_to_dtype(uly_tensor *t, int dtype);
uly_tensor *uly_tensor_to_device(uly_tensor *t, int device);  /* a differentiable copy; t itself (retained) when already there */
uly_tensor *uly_tensor_cat(int n, uly_tensor *const *ts, int dim);

/* ---- autograd ---- */
int uly_tensor_set_requires_grad(uly_tensor *t, int flag);  /* leaves only */
int uly_tensor_requires_grad(const uly_tensor *t);
int uly_tensor_is_leaf(const uly_tensor *t);
/* how many times t's storage was written in place (ops ending in _, copies, optimizer steps, and
 * backward accumulating into a leaf's grad): a changed value means changed contents */
uint64_t uly_tensor_version(const uly_tensor *t);
uly_tensor *uly_tensor_grad(const uly_tensor *t);           /* NULL without error if none */
int uly_tensor_set_grad(uly_tensor *t, uly_tensor *grad);   /* grad may be NULL */
int uly_tensor_zero_grad(uly_tensor *t, int set_to_none);
uly_tensor *uly_tensor_detach(uly_tensor *t);
const char *uly_tensor_grad_fn_name(const uly_tensor *t);   /* "MatmulBackward" or NULL */
int uly_backward(uly_tensor *root, uly_tensor *grad, int retain_graph);  /* reentrant: a custom backward may call it */
/* custom nodes (core/custom.c): a view of `output` (computed without recording) whose backward
 * calls fn(id, grad_output, grad_inputs); grad_inputs[k]: input k's gradient buffer to accumulate
 * into, or NULL. fn returns 0, or -1 after uly_fail(message). */
typedef int (*uly_custom_backward)(int64_t id, uly_tensor *grad_output, uly_tensor **grad_inputs);
uly_tensor *uly_custom_op(int n_inputs, uly_tensor *const *inputs, uly_tensor *output, uly_custom_backward fn, int64_t id);
int uly_custom_released(int64_t *ids, int cap);             /* ids of freed custom nodes since the last call */
int uly_fail(const char *message);                          /* set uly_last_error(); returns -1 */
int uly_tensor_accumulate_(uly_tensor *dst, uly_tensor *src); /* dst += src (src summed over broadcast dims) */
int uly_grad_enabled(void);
int uly_set_grad_enabled(int enabled);                      /* returns the previous setting */
int64_t uly_autograd_live_nodes(void);                      /* graph nodes alive (leak checks) */
void uly_profile_enable(int on);                            /* time every backward rule by op */
void uly_profile_reset(void);
int64_t uly_profile_report(char *buf, int64_t buflen);      /* "Op calls seconds" lines; returns the length needed */

/* ---- ops (all differentiable; f32, or bf16 activations: computed in f32, the result bf16 where the
 *      inputs are (a matmul's where a is), cross-entropy's loss f32; every tensor argument on one
 *      device, the result there too) ---- */
uly_tensor *uly_add(uly_tensor *a, uly_tensor *b);          /* broadcasting */
uly_tensor *uly_sub(uly_tensor *a, uly_tensor *b);
uly_tensor *uly_mul(uly_tensor *a, uly_tensor *b);
uly_tensor *uly_div(uly_tensor *a, uly_tensor *b);
uly_tensor *uly_add_scalar(uly_tensor *a, double s);
uly_tensor *uly_mul_scalar(uly_tensor *a, double s);        /* scale */
uly_tensor *uly_pow_scalar(uly_tensor *a, double exponent);
uly_tensor *uly_matmul(uly_tensor *a, uly_tensor *b);       /* [..., M, K] @ [..., K, N], batch dims broadcast */
uly_tensor *uly_addmm(uly_tensor *a, uly_tensor *w, uly_tensor *bias); /* a [..., K] @ w [K, N] + bias [N]: a Linear layer
                                     in one op (the bias seeds the output, one GEMM adds into it) */
int uly_set_matmul_bf16(int on);  /* mixed precision: matmuls (forward and backward) round their f32 operands to bf16,
                                     accumulate in f32 (tensor cores at the bf16 rate on a GPU); returns the previous setting */
int uly_matmul_bf16(void);
int uly_set_activation_bf16(int on); /* bf16 activations: embeddings give bf16, and every op keeps bf16 inputs bf16
                                        (computing in f32, saving bf16 for backward; gradients stay f32); previous setting */
int uly_activation_bf16(void);
uly_tensor *uly_sum(uly_tensor *t, int dim, int keepdim);
uly_tensor *uly_sum_all(uly_tensor *t);
uly_tensor *uly_mean(uly_tensor *t, int dim, int keepdim);
uly_tensor *uly_mean_all(uly_tensor *t);
uly_tensor *uly_max(uly_tensor *t, int dim, int keepdim, uly_tensor **indices); /* indices: i64, may be NULL */
uly_tensor *uly_max_all(uly_tensor *t);
uly_tensor *uly_softmax(uly_tensor *t, int dim);
uly_tensor *uly_log_softmax(uly_tensor *t, int dim);
uly_tensor *uly_layernorm(uly_tensor *x, uly_tensor *weight, uly_tensor *bias, double eps); /* last dim; weight/bias may be NULL */
uly_tensor *uly_rmsnorm(uly_tensor *x, uly_tensor *weight, double eps);
uly_tensor *uly_gelu(uly_tensor *x, int tanh_approximation);
uly_tensor *uly_silu(uly_tensor *x);
uly_tensor *uly_relu(uly_tensor *x);
uly_tensor *uly_tanh(uly_tensor *x);
uly_tensor *uly_sigmoid(uly_tensor *x);
uly_tensor *uly_exp(uly_tensor *x);
uly_tensor *uly_log(uly_tensor *x);
uly_tensor *uly_sqrt(uly_tensor *x);
uly_tensor *uly_swiglu(uly_tensor *gate, uly_tensor *up);   /* silu(gate) * up */
uly_tensor *uly_embedding(uly_tensor *indices, uly_tensor *weight);  /* i32/i64 [...] , f32 [V, C] */
uly_tensor *uly_rope(uly_tensor *x, int64_t pos_offset, double theta); /* x [B, T, H, D] */
uly_tensor *uly_dropout(uly_tensor *x, double p, int training);
uly_tensor *uly_cross_entropy(uly_tensor *logits, uly_tensor *targets, int64_t ignore_index, int reduction);
uly_tensor *uly_attention(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale, int causal);

/* ---- optimizers (core/optim.c, kernels/cpu/optim.c): one call updates a list of n f32
 *      parameters in place from their .grad; state tensors have each parameter's shape.
 *      Parameters without a grad are skipped. step is 1-based (bias correction). ---- */
int uly_adamw_step(uly_tensor *const *params, uly_tensor *const *exp_avg, uly_tensor *const *exp_avg_sq,
                   const double *weight_decay, int n, double lr, double beta1, double beta2,
                   double eps, int64_t step);
int uly_sgd_step(uly_tensor *const *params, uly_tensor *const *momentum_buf, const double *weight_decay,
                 int n, double lr, double momentum, double dampening, int nesterov, int64_t step);
double uly_grad_norm(uly_tensor *const *params, int n);    /* global L2 norm of the grads; -1 on error */
int uly_grad_scale_(uly_tensor *const *params, int n, double scale); /* grads *= scale */

/* ---- HDF5 files (core/h5.c): datasets, hyperslab reads, attributes, atomic commit.
 *      Files are int64_t handles (> 0); names are paths inside the file ("optim/exp_avg/w").
 *      File-level dtypes: ULY_H5_U8 and the tensor dtypes above. ---- */
enum uly_h5_dtype { ULY_H5_U8 = 100 };
int64_t uly_h5_create(const char *path);                     /* truncates; -1 on error */
int64_t uly_h5_open(const char *path, int writable);         /* checks it is an HDF5 file */
int uly_h5_close(int64_t file);
int uly_h5_exists(int64_t file, const char *name);           /* 1/0; -1 on error */
int uly_h5_list(int64_t file, const char *group, char *buf, int64_t buflen); /* dataset paths, '\n'-separated; needed length if buflen too small */
int uly_h5_info(int64_t file, const char *name, int *ndim, int64_t *shape, int *dtype); /* shape: 8 slots */
int uly_h5_write(int64_t file, const char *name, const void *data, int dtype, int ndim, const int64_t *shape); /* new dataset (parents made); data in dtype */
int uly_h5_write_tensor(int64_t file, const char *name, const uly_tensor *t); /* stored in t's dtype (bf16 as u16 + attribute) */
int uly_h5_read(int64_t file, const char *name, int ndim, const int64_t *start, const int64_t *count,
                void *out, int out_dtype);                   /* hyperslab start/count (NULL: whole), converted */
int uly_h5_read_tensor(int64_t file, const char *name, uly_tensor *dst); /* shape must match exactly */
int uly_h5_set_attr_string(int64_t file, const char *object, const char *key, const char *value); /* object "" or "/" = file */
int uly_h5_get_attr_string(int64_t file, const char *object, const char *key, char *buf, int64_t buflen); /* needed length if too small */
int uly_h5_set_attr_f64(int64_t file, const char *object, const char *key, double value);
int uly_h5_get_attr_f64(int64_t file, const char *object, const char *key, double *value);
int uly_h5_attr_type(int64_t file, const char *object, const char *key); /* 0 absent, 1 string, 2 number, 3 other; -1 error */
int uly_file_commit(const char *tmp_path, const char *final_path); /* fsync tmp, rename over final, fsync dir */
/* where a save to path lands (a symlink's target; an error for a directory, device or pipe) */
int uly_file_destination(const char *path, char *out, int64_t out_len);

/* ---- communication (core/comm*.c): Open MPI when the library is built with it and the process
 *      runs under mpirun; otherwise a world of size 1 whose collectives are local copies.
 *      Groups: the world, this rank's sequence-parallel group (sp consecutive ranks) and its
 *      data-parallel group (ranks with the same sp_rank). Counts are in elements of `dtype`.
 *      Every collective first checks that all ranks of the group call the same collective with
 *      consistent sizes, and gives up after uly_dist_set_timeout seconds with a clear error. ---- */
typedef struct uly_comm uly_comm;
enum uly_comm_op { ULY_REDUCE_SUM = 0, ULY_REDUCE_AVG = 1, ULY_REDUCE_MAX = 2 };
enum uly_comm_kind { ULY_COMM_ALL_TO_ALL = 0, ULY_COMM_ALL_REDUCE = 1, ULY_COMM_ALL_GATHER = 2,
                     ULY_COMM_REDUCE_SCATTER = 3, ULY_COMM_BROADCAST = 4, ULY_COMM_BARRIER = 5, ULY_COMM_KINDS = 6 };
int uly_dist_init(int sp_size);               /* idempotent; world size must be a multiple of sp_size */
int uly_dist_initialized(void);
int uly_dist_finalize(void);
int uly_dist_abort(const char *message);      /* prints "ulysses: rank R: message" and ends every rank */
void uly_dist_set_timeout(double seconds);    /* per collective; <= 0: wait forever */
uly_comm *uly_dist_world(void);               /* borrowed handles, valid until finalize */
uly_comm *uly_dist_sp_group(void);
uly_comm *uly_dist_dp_group(void);
int uly_comm_rank(const uly_comm *c);
int uly_comm_size(const uly_comm *c);
int uly_comm_world_rank_of(const uly_comm *c, int rank);  /* a group rank's world rank */
/* how the group moves device tensors, decided at its first device collective: 1 the device
 * backend's collectives (NCCL), -1 staged through host memory over MPI, 0 not decided yet */
int uly_comm_device_path(const uly_comm *c);
const char *uly_comm_name(const uly_comm *c);             /* "world", "sp", "dp" */
int uly_comm_all_to_all_v(uly_comm *c, const void *send, const int64_t *send_counts, const int64_t *send_displs,
                          void *recv, const int64_t *recv_counts, const int64_t *recv_displs, int dtype);
/* one peer's part of a strided exchange (no packing copies): starting `base` elements into the
 * buffer, `count` repetitions `stride` elements apart, each made of `nruns` (<= 3) runs of
 * length[k] elements at offset[k] within the repetition; the peer's elements are taken in that order */
typedef struct uly_comm_layout {
    int64_t base, count, stride;
    int nruns;
    int64_t offset[3], length[3];
} uly_comm_layout;
int uly_comm_all_to_all_layout(uly_comm *c, const void *send, const uly_comm_layout *send_layouts,
                               void *recv, const uly_comm_layout *recv_layouts, int dtype); /* one layout per group rank */
/* the same on buffers of a device: NCCL where every rank has its own GPU, else packed and staged
 * through host memory over MPI */
int uly_comm_all_to_all_layout_on(uly_comm *c, int device, const void *send, const uly_comm_layout *send_layouts,
                                  void *recv, const uly_comm_layout *recv_layouts, int dtype);
int uly_comm_all_reduce_(uly_comm *c, uly_tensor *t, int op);  /* in place, contiguous */
/* An all-reduce that completes later, so its data moves while the caller goes on (gradient
 * buckets during backward): host tensors over a non-blocking MPI all-reduce, device tensors on
 * the device's communication stream (NCCL), after the work queued so far; device tensors staged
 * through host memory (no NCCL) and bf16 host tensors complete at once. Every rank of the group
 * starts the same all-reduces in the same order. t must be neither read nor written until
 * uly_comm_wait_all(c) returns; wait_all completes every started one in order, and on the device
 * only orders later device work after them (no host wait). */
int uly_comm_all_reduce_start(uly_comm *c, uly_tensor *t, int op);
int uly_comm_wait_all(uly_comm *c);
int uly_comm_pending(const uly_comm *c);      /* started and not yet waited for */
void uly_comm_progress(uly_comm *c);          /* lets MPI move the pending ones' data (host tensors) */
int uly_comm_all_gather(uly_comm *c, const uly_tensor *in, uly_tensor *out); /* out: [size * in.shape[0], ...] */
int uly_comm_reduce_scatter(uly_comm *c, const uly_tensor *in, uly_tensor *out, int op); /* in: [size * out.shape[0], ...] */
/* a reduce-scatter that completes at uly_comm_wait_all, in order with the started all-reduces
 * (MPI_Ireduce_scatter_block on the host, NCCL on the device's communication stream; staged or
 * bf16 host buffers: at once); in and out must stay untouched until then */
int uly_comm_reduce_scatter_start(uly_comm *c, const uly_tensor *in, uly_tensor *out, int op);
int uly_comm_broadcast_(uly_comm *c, uly_tensor *t, int root);
int uly_comm_barrier(uly_comm *c);
int uly_comm_check_same(uly_comm *c, const char *what, const int64_t *values, int n); /* error (on every rank) lists each rank's values */
int64_t uly_comm_bytes(int kind, int world_peer, int sent); /* bytes this rank sent (sent=1) to / received (0) from a peer */
double uly_comm_seconds(int kind);                         /* wall time spent inside collectives of a kind */
int64_t uly_comm_calls(int kind);
void uly_comm_reset_stats(void);

/* ---- Ulysses sequence parallelism (core/ulysses.c): the two all-to-alls as autograd ops over
 *      a sequence-parallel group; splits give the first n % P ranks one extra token / head ---- */
int uly_ulysses_split(int64_t n, int parts, int index, int64_t *start, int64_t *length);
int uly_ulysses_heads(int64_t heads, int64_t kv_heads, int parts, int index, int64_t *q_start, int64_t *q_count,
                      int64_t *kv_start, int64_t *kv_count);  /* this rank's query heads and the K/V heads they use */
uly_tensor *uly_ulysses_qkv_to_heads(uly_comm *sp, uly_tensor *qkv, int64_t heads, int64_t kv_heads, int64_t seq_total);
                                       /* [B, n_r, H + 2G, D] -> [B, N, Hq_r + 2 Gk_r, D], one exchange */
uly_tensor *uly_ulysses_heads_to_seq(uly_comm *sp, uly_tensor *o, int64_t heads, int64_t seq_total);
                                       /* [B, N, Hq_r, D] -> [B, n_r, H, D] */
int64_t uly_ulysses_copies(void);      /* packing copies the exchanges made so far (none on the forward path) */

/* ---- flash attention (kernels/cpu/flash_attention.c, core/flash.c): memory-efficient attention,
 *      O(N D) memory (the output and one log-sum-exp per row are all it saves for backward).
 *      q [B, Tq, H, D], k and v [B, Tk, Hkv, D] f32, H a multiple of Hkv (GQA, K/V not repeated);
 *      strided views (e.g. narrows of a fused QKV buffer) are read in place when their last dim is
 *      contiguous. Returns [B, Tq, H, D] contiguous; scale <= 0 means 1/sqrt(D). Differentiable.
 *      Mask (NULL: dense); with i' = i + Tk - Tq, query i sees key j iff every set condition holds:
 *        causal        j <= i'
 *        window        i' - window_left <= j <= i' + window_right  (-1: unbounded on that side)
 *        block_layout  layout[i / block_size, j / block_size] == 1; i32/i64 0/1 tensor
 *                      [ceil(Tq / block_size), ceil(Tk / block_size)]
 *        documents     q_doc[b, i] == k_doc[b, j]; integer ids [B, Tq] and [B, Tk], both or neither
 *      A query that sees no key outputs 0 (gradient 0). Fully hidden 64 x 64 tiles are skipped. ---- */
typedef struct uly_attn_mask {
    int causal;
    int64_t window_left, window_right;
    const uly_tensor *block_layout;
    int64_t block_size;
    const uly_tensor *q_doc, *k_doc;
} uly_attn_mask;
uly_tensor *uly_flash_attention(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale, const uly_attn_mask *mask);
/* the same forward, also returning its per-row log-sum-exp [B, H, Tq] f32 (*lse, a new reference) */
uly_tensor *uly_flash_attention_keep(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale,
                                     const uly_attn_mask *mask, uly_tensor **lse);
/* no forward: the differentiable result over an output and lse kept from flash_attention_keep on
 * these q, k, v and mask (activation checkpointing's replay without attention's forward) */
uly_tensor *uly_flash_attention_kept(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale,
                                     const uly_attn_mask *mask, uly_tensor *out, uly_tensor *lse);
int64_t uly_flash_attention_tiles(void);        /* score tiles computed by forwards since the reset (work done) */
void uly_flash_attention_reset_tiles(void);

#ifdef __cplusplus
}
#endif
#endif
