/* kernels/cuda/launch.cuh — how the CUDA backend launches a kernel: ULY_LAUNCH(kernel, blocks,
 * threads, stream)(args...), or ULY_LAUNCH_SMEM with dynamic shared memory; the _AS forms name
 * the launch for the profiler (profile.cuh; the plain forms use the kernel's name as written).
 * Under nvcc the <<<>>> launch; in the emulator build (kernels/cuda/emu/, ULY_CUDA_EMU) a call
 * that runs every block's threads as fibers on the CPU. Either way a profiler scope, a temporary
 * that lives to the end of the launch statement, brackets the launch with events when profiling. */
#ifndef ULY_CUDA_LAUNCH_CUH
#define ULY_CUDA_LAUNCH_CUH
#include "profile.cuh"
#ifdef ULY_CUDA_EMU
#define ULY_LAUNCH_SMEM_AS(name, kernel, blocks, threads, smem, stream) \
    uly_cu_prof_scope{(name), (stream)}, uly_emu::launch(kernel, (unsigned)(blocks), (unsigned)(threads), (size_t)(smem), (stream))
#define ULY_DYNAMIC_SHARED(type, name) type *name = (type *)uly_emu::dynamic_shared()
#else
/* with `smem` bytes of dynamic shared memory, declared in the kernel by ULY_DYNAMIC_SHARED (above
 * 48 KiB the kernel must first allow it: cudaFuncSetAttribute(..MaxDynamicSharedMemorySize..)) */
#define ULY_LAUNCH_SMEM_AS(name, kernel, blocks, threads, smem, stream) \
    uly_cu_prof_scope{(name), (stream)}, kernel<<<(blocks), (threads), (smem), (stream)>>>
#define ULY_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
#define ULY_LAUNCH_AS(name, kernel, blocks, threads, stream) ULY_LAUNCH_SMEM_AS(name, kernel, blocks, threads, 0, stream)
#define ULY_LAUNCH(kernel, blocks, threads, stream) ULY_LAUNCH_SMEM_AS(#kernel, kernel, blocks, threads, 0, stream)
#define ULY_LAUNCH_SMEM(kernel, blocks, threads, smem, stream) ULY_LAUNCH_SMEM_AS(#kernel, kernel, blocks, threads, smem, stream)
#endif
