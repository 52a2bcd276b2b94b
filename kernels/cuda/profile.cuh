/* kernels/cuda/profile.cuh — the GPU time of every kernel launch and GEMM, by name, while
 * profiling is on (uly_cuda_profile_start / _stop; Lua: uly.cuda.profile). ULY_LAUNCH and the
 * GEMM calls hold a uly_cu_prof_scope across the launch: it records a CUDA event on the launch's
 * stream before it and another after it; stopping waits for the device and sums the elapsed
 * times per name (profile.cu). Off, a scope costs a load and a branch. */
#ifndef ULY_CUDA_PROFILE_CUH
#define ULY_CUDA_PROFILE_CUH
#include <cuda_runtime.h>

extern int uly_cu_prof_on;
int uly_cu_prof_begin(const char *name, cudaStream_t s);   /* a slot, or -1 (recording failed) */
void uly_cu_prof_end(int slot, cudaStream_t s);

struct uly_cu_prof_scope {
    int slot;
    cudaStream_t stream;
    uly_cu_prof_scope(const char *name, cudaStream_t s) : slot(-1), stream(s) {
        if (uly_cu_prof_on) slot = uly_cu_prof_begin(name, s);
    }
    ~uly_cu_prof_scope() {
        if (slot >= 0) uly_cu_prof_end(slot, stream);
    }
    uly_cu_prof_scope(const uly_cu_prof_scope &) = delete;
    uly_cu_prof_scope &operator=(const uly_cu_prof_scope &) = delete;
};
#endif
