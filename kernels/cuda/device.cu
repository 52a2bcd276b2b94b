/* kernels/cuda/device.cu — libulysses_cuda.so's device layer: device count/name/memory/attributes,
 * runtime and driver versions, device buffers and host<->device copies, and fill_f32 (the first
 * kernel, the device path's smoke test). Every failure is cleared from the CUDA runtime and kept, with
 * the operation that met it, for uly_cuda_last_error(). */
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>
#include "uly_cuda.h"
#include "launch.cuh"

static char last_error[512] = "no error";

/* remember why `op` failed (cuda error string and code), clear the runtime's sticky state; -1 */
static int fail(const char *op, cudaError_t err) {
    snprintf(last_error, sizeof last_error, "%s: cuda error %d (%s: %s)", op, (int)err,
             cudaGetErrorName(err), cudaGetErrorString(err));
    cudaGetLastError();
    return -1;
}

static int fail_msg(const char *op, const char *msg) {
    snprintf(last_error, sizeof last_error, "%s: %s", op, msg);
    return -1;
}

const char *uly_cuda_last_error(void) { return last_error; }
void uly_cuda_record_error(const char *message) { snprintf(last_error, sizeof last_error, "%s", message); }

/* the profiler's collection on (1) or off (0), for `ncu --profile-from-start off` around a region */
int uly_cuda_profiler(int on) {
    cudaError_t err = on ? cudaProfilerStart() : cudaProfilerStop();
    if (err != cudaSuccess) { fail(on ? "cudaProfilerStart" : "cudaProfilerStop", err); return -1; }
    return 0;
}

int uly_cuda_device_count(void) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        fail("cudaGetDeviceCount", err);
        return 0;
    }
    if (n == 0) fail_msg("cudaGetDeviceCount", "the driver reports no CUDA device");
    return n;
}

static int check_device(const char *op, int dev) {
    int n = uly_cuda_device_count();
    if (dev < 0 || dev >= n) {
        char msg[128];
        snprintf(msg, sizeof msg, "device %d does not exist (%d CUDA device%s)", dev, n, n == 1 ? "" : "s");
        return fail_msg(op, msg);
    }
    return 0;
}

int uly_cuda_device_name(int dev, char *buf, int len) {
    if (!buf || len <= 0) return fail_msg("uly_cuda_device_name", "needs a buffer of positive length");
    if (check_device("uly_cuda_device_name", dev)) return -1;
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, dev);
    if (err != cudaSuccess) return fail("cudaGetDeviceProperties", err);
    snprintf(buf, (size_t)len, "%s", prop.name);
    return 0;
}

/* compute capability, multiprocessor count and peak SM clock (kHz): what a peak-FLOP/s estimate needs */
int uly_cuda_device_attributes(int dev, int *cc_major, int *cc_minor, int *multiprocessors, int *clock_khz) {
    if (!cc_major || !cc_minor || !multiprocessors || !clock_khz)
        return fail_msg("uly_cuda_device_attributes", "needs four output pointers");
    if (check_device("uly_cuda_device_attributes", dev)) return -1;
    const struct { cudaDeviceAttr attr; int *out; const char *what; } want[] = {
        { cudaDevAttrComputeCapabilityMajor, cc_major, "compute capability" },
        { cudaDevAttrComputeCapabilityMinor, cc_minor, "compute capability" },
        { cudaDevAttrMultiProcessorCount, multiprocessors, "multiprocessor count" },
        { cudaDevAttrClockRate, clock_khz, "clock rate" } };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        cudaError_t err = cudaDeviceGetAttribute(want[i].out, want[i].attr, dev);
        if (err != cudaSuccess) {
            char op[96];
            snprintf(op, sizeof op, "cudaDeviceGetAttribute (%s)", want[i].what);
            return fail(op, err);
        }
    }
    return 0;
}

int uly_cuda_device_memory(int dev, int64_t *free_b, int64_t *total_b) {
    if (!free_b || !total_b) return fail_msg("uly_cuda_device_memory", "needs two output pointers");
    if (check_device("uly_cuda_device_memory", dev)) return -1;
    int old = 0;
    cudaError_t err = cudaGetDevice(&old);
    if (err != cudaSuccess) return fail("cudaGetDevice", err);
    if ((err = cudaSetDevice(dev)) != cudaSuccess) return fail("cudaSetDevice", err);
    size_t f = 0, t = 0;
    err = cudaMemGetInfo(&f, &t);
    cudaSetDevice(old);
    if (err != cudaSuccess) return fail("cudaMemGetInfo", err);
    *free_b = (int64_t)f;
    *total_b = (int64_t)t;
    return 0;
}

int uly_cuda_runtime_version(void) {
    int v = 0;
    if (cudaRuntimeGetVersion(&v) != cudaSuccess) cudaGetLastError();
    return v;
}

int uly_cuda_driver_version(void) {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return v;
}

void *uly_cuda_malloc(int64_t bytes) {
    if (bytes <= 0) {
        fail_msg("uly_cuda_malloc", "needs a positive byte count");
        return NULL;
    }
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, (size_t)bytes);
    if (err != cudaSuccess) {
        char op[96];
        snprintf(op, sizeof op, "cudaMalloc of %lld bytes", (long long)bytes);
        fail(op, err);
        return NULL;
    }
    return p;
}

int uly_cuda_free(void *p) {
    cudaError_t err = cudaFree(p);
    return err == cudaSuccess ? 0 : fail("cudaFree", err);
}

static int copy(const char *op, void *dst, const void *src, int64_t bytes, cudaMemcpyKind kind) {
    if (bytes < 0 || (bytes > 0 && (!dst || !src))) return fail_msg(op, "needs two buffers and bytes >= 0");
    if (bytes == 0) return 0;
    cudaError_t err = cudaMemcpy(dst, src, (size_t)bytes, kind);
    return err == cudaSuccess ? 0 : fail(op, err);
}

int uly_cuda_memcpy_h2d(void *dst, const void *src, int64_t bytes) {
    return copy("uly_cuda_memcpy_h2d", dst, src, bytes, cudaMemcpyHostToDevice);
}

int uly_cuda_memcpy_d2h(void *dst, const void *src, int64_t bytes) {
    return copy("uly_cuda_memcpy_d2h", dst, src, bytes, cudaMemcpyDeviceToHost);
}

__global__ static void fill_f32_kernel(float *p, int64_t n, float v) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = v;
}

int uly_cuda_fill_f32(float *p, int64_t n, float v) {
    if (n < 0 || (n > 0 && !p)) return fail_msg("uly_cuda_fill_f32", "needs a device buffer and n >= 0");
    if (n == 0) return 0;
    const int threads = 256;
    int64_t blocks = (n + threads - 1) / threads;
    if (blocks > 65535) blocks = 65535; /* grid-stride loop covers the rest */
    ULY_LAUNCH(fill_f32_kernel, (unsigned)blocks, threads, 0)(p, n, v);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail("uly_cuda_fill_f32 launch", err);
    err = cudaDeviceSynchronize();
    return err == cudaSuccess ? 0 : fail("uly_cuda_fill_f32", err);
}
