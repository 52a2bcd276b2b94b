/* kernels/cuda/launch.cuh — how the CUDA backend launches a kernel: ULY_LAUNCH(kernel, blocks,
 * threads, stream)(args...), or ULY_LAUNCH_SMEM with dynamic shared memory. Under nvcc the <<<>>>
 * launch; in the emulator build (kernels/cuda/emu/, ULY_CUDA_EMU) a call that runs every block's
 * threads as fibers on the CPU. */
#ifndef ULY_CUDA_LAUNCH_CUH
#define ULY_CUDA_LAUNCH_CUH
#ifdef ULY_CUDA_EMU
#define ULY_LAUNCH(kernel, blocks, threads, stream) \
    uly_emu::launch(kernel, (unsigned)(blocks), (unsigned)(threads), 0, (stream))
#define ULY_LAUNCH_SMEM(kernel, blocks, threads, smem, stream) \
    uly_emu::launch(kernel, (unsigned)(blocks), (unsigned)(threads), (size_t)(smem), (stream))
#define ULY_DYNAMIC_SHARED(type, name) type *name = (type *)uly_emu::dynamic_shared()
#else
#define ULY_LAUNCH(kernel, blocks, threads, stream) kernel<<<(blocks), (threads), 0, (stream)>>>
/* with `smem` bytes of dynamic shared memory, declared in the kernel by ULY_DYNAMIC_SHARED (above
 * 48 KiB the kernel must first allow it: cudaFuncSetAttribute(..MaxDynamicSharedMemorySize..)) */
#define ULY_LAUNCH_SMEM(kernel, blocks, threads, smem, stream) kernel<<<(blocks), (threads), (smem), (stream)>>>
#define ULY_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
#endif
