/* core/library.c — library-wide settings: version, features built in, thread count, dtype
 * names and sizes, the global counter-based random generator (seed + offset), and a file's
 * size and modification time. */
#include <errno.h>
#include <stdint.h>
#include <sys/stat.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <string.h>
#include "internal.h"
#include "../kernels/cpu/kernels.h"

extern char *openblas_get_corename(void);
extern void openblas_set_num_threads(int);

#ifndef ULY_VERSION
#define ULY_VERSION "0.1.0"
#endif

const char *uly_version(void) { return ULY_VERSION; }
const char *uly_blas_corename(void) { return openblas_get_corename(); }

int uly_file_stamp(const char *path, int64_t *size, int64_t *mtime_ns) {
    struct stat st;
    if (!path || !size || !mtime_ns) return uly_set_error("file_stamp: path, size and mtime_ns must not be NULL");
    if (stat(path, &st) != 0) return uly_set_error("file_stamp: cannot stat '%s': %s", path, strerror(errno));
    *size = (int64_t)st.st_size;
    *mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + (int64_t)st.st_mtim.tv_nsec;
    return 0;
}

int uly_has_feature(const char *name) {
    if (!name) return 0;
#ifdef ULY_WITH_MPI
    if (!strcmp(name, "mpi")) return 1;
#endif
#ifdef ULY_WITH_HDF5
    if (!strcmp(name, "hdf5")) return 1;
#endif
#ifdef ULY_WITH_CUDA
    if (!strcmp(name, "cuda")) return 1;
#endif
#ifdef _OPENMP
    if (!strcmp(name, "openmp")) return 1;
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    if (!strcmp(name, "fma")) return 1; /* CPU kernels built with fused multiply-add (optim.c's MADD) */
#endif
    return 0;
}

static int default_threads(void) {
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

static int current_threads;

/* OpenBLAS stays single-threaded: kernels/cpu/matmul.c splits GEMMs over the OpenMP threads */
__attribute__((constructor)) static void blas_single_threaded(void) { openblas_set_num_threads(1); }

int uly_set_num_threads(int n) {
    if (n <= 0) n = default_threads();
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
    openblas_set_num_threads(1);  /* GEMMs split over our own threads (kernels/cpu/matmul.c) */
    current_threads = n;
    return 0;
}

double uly_cpu_peak_flops(int threads) { return cpu_fma_peak(threads); }
const char *uly_cpu_amx_status(void) { return gemm_amx_status(); }
int uly_set_cpu_amx(int on) { return gemm_amx_enable(on); }
double uly_cpu_amx_peak_flops(int threads) { return gemm_amx_peak(threads); }
const char *uly_cpu_avx512_bf16_status(void) { return gemm_avx512_bf16_status(); }
int uly_set_cpu_avx512_bf16(int on) { return gemm_avx512_bf16_enable(on); }
double uly_cpu_avx512_bf16_peak_flops(int threads) { return gemm_avx512_bf16_peak(threads); }
const char *uly_cpu_bf16_gemm(void) { return gemm_bf16_engine(); }
double uly_cpu_bf16_peak_flops(int threads) { return gemm_bf16_peak(threads); }

int uly_get_num_threads(void) {
#ifdef _OPENMP
    return current_threads ? current_threads : omp_get_max_threads();
#else
    return 1;
#endif
}

const char *uly_dtype_name(int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return "f32";
    case ULY_DTYPE_BF16: return "bf16";
    case ULY_DTYPE_I32: return "i32";
    case ULY_DTYPE_I64: return "i64";
    case ULY_DTYPE_F64: return "f64";
    default: return "invalid-dtype";
    }
}

int64_t uly_dtype_size(int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: case ULY_DTYPE_I32: return 4;
    case ULY_DTYPE_BF16: return 2;
    case ULY_DTYPE_I64: case ULY_DTYPE_F64: return 8;
    default: return 0;
    }
}

/* the global generator: every draw of n numbers uses counters [offset, offset + n) and then
 * advances offset, so results never depend on thread counts and a state is two integers */
static uint64_t rng_seed = 0x5eed, rng_offset;

void uly_manual_seed(uint64_t seed) { rng_seed = seed; rng_offset = 0; }
uint64_t uly_rng_seed(void) { return rng_seed; }
uint64_t uly_rng_offset(void) { return rng_offset; }
void uly_rng_set_state(uint64_t seed, uint64_t offset) { rng_seed = seed; rng_offset = offset; }

/* reserve n counters from the global generator; returns the first */
uint64_t uly_rng_take(uint64_t n) {
    uint64_t first = rng_offset;
    rng_offset += n;
    return first;
}
