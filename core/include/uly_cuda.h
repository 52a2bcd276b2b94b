/* core/include/uly_cuda.h — the C API of libulysses_cuda.so, the CUDA library loaded lazily by
 * lua/ulysses/cuda.lua (never by libulysses.so). Macro-free so the FFI can parse it as is.
 * Functions returning int give 0 on success and -1 on failure (the reason: uly_cuda_last_error),
 * except the counts and versions, which give 0 when there is no device or no driver. */
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* devices: how many (0 on any error, which is cleared), and why there are none */
int uly_cuda_device_count(void);
const char *uly_cuda_last_error(void);
void uly_cuda_record_error(const char *message);   /* set the text uly_cuda_last_error returns */
void uly_cuda_set_tf32(int on);                     /* f32 GEMMs on tensor cores in TF32 (default 1) */
int uly_cuda_tf32(void);                            /* 1: TF32, 0: full f32 */
int uly_cuda_bf16_kernels(int on);                  /* bf16 activations read and written by the kernels (1,
                                                       default) or converted around the f32 ones (0); previous
                                                       (on < 0: only reads it) */
int uly_cuda_profiler(int on);                      /* cudaProfilerStart (1) / Stop (0): ncu ranges */
int uly_cuda_device_name(int dev, char *buf, int len);
int uly_cuda_device_memory(int dev, int64_t *free_b, int64_t *total_b);
int uly_cuda_device_attributes(int dev, int *cc_major, int *cc_minor, int *multiprocessors,
                               int *clock_khz);          /* clock: the peak SM clock in kHz */

/* versions as 1000 * major + 10 * minor (13000 = 13.0); the driver's is 0 without a driver */
int uly_cuda_runtime_version(void);
int uly_cuda_driver_version(void);

/* device buffers: NULL / -1 on failure */
void *uly_cuda_malloc(int64_t bytes);
int uly_cuda_free(void *p);
int uly_cuda_memcpy_h2d(void *dst, const void *src, int64_t bytes);
int uly_cuda_memcpy_d2h(void *dst, const void *src, int64_t bytes);

/* the backend table (core/include/uly_backend.h) that libulysses.so calls for device 'cuda':
 * creates the stream and cuBLAS handle on device 0 on first call; NULL on failure */
const void *uly_cuda_backend(void);

/* benchmarks: seconds per raw cuBLAS GEMM (M x K @ K x N, TF32 or bf16 inputs, f32 out) */
int uly_cuda_cublas_gemm_seconds(int64_t M, int64_t N, int64_t K, int bf16, int iters, double *seconds);

/* the kernels' stream-ordered temporaries (bf16 operand copies, score chunks; cudaMallocAsync):
 * the most bytes in use at once since the last reset (reset = 1 starts over after reading) */
int uly_cuda_temporaries_peak(int64_t *bytes, int reset);

/* how many times the GEMMs asked cuBLASLt's heuristic for an algorithm (once per distinct problem:
 * the answers are kept) */
int64_t uly_cuda_gemm_heuristic_queries(void);
/* whether the fused attention kernels at head dim D (64 or 128) run on Hopper's wgmma, and why
 * ("on (...)", "off: ..."): decided for each D at its first call (a self-check on compute
 * capability 9.0) */
const char *uly_cuda_wgmma_status(int D);
/* the tuned choice of fused attention kernels at head dim D (64 or 128): a variant name for each of
 * ULY_CUDA_ATTN_FWD, _DQ, _DKV and _BWD ("" or NULL: the default), taken where that variable is
 * unset or empty (lua/ulysses/attention_tune.lua measures and sets them); preferred(D, 0..3) reads
 * them back; tune_key: the device name, compute capability and this library's file size and time,
 * what a measured choice is valid for */
int uly_cuda_attention_prefer(int D, const char *fwd, const char *dq, const char *dkv, const char *bwd);
const char *uly_cuda_attention_preferred(int D, int which);
int uly_cuda_tune_key(char *buf, int len);

/* profiling (kernels/cuda/profile.cu): between start and stop every kernel launch and GEMM is
 * timed on the GPU by events; stop waits for the device and sums the times per name. Then count
 * gives the number of names (and the wall time from start to stop on the backend's stream, ms),
 * entry(i) the i-th name, longest total first, its launches and its total ms. Profiles do not nest. */
int uly_cuda_profile_start(void);
int uly_cuda_profile_stop(void);
int uly_cuda_profile_count(double *wall_ms);
int uly_cuda_profile_entry(int i, char *name, int len, int64_t *calls, double *ms);

/* kernels: p[0..n) = v on the current device, synchronised */
int uly_cuda_fill_f32(float *p, int64_t n, float v);

#ifdef __cplusplus
}
#endif
