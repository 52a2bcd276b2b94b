/* kernels/cuda/launch.cuh — how the CUDA backend launches a kernel: ULY_LAUNCH(kernel, blocks,
 * threads, stream)(args...). Under nvcc the <<<>>> launch; in the emulator build
 * (kernels/cuda/emu/, ULY_CUDA_EMU) a call that runs every block's threads as fibers on the CPU. */
#ifndef ULY_CUDA_LAUNCH_CUH
#define ULY_CUDA_LAUNCH_CUH
#ifdef ULY_CUDA_EMU
#define ULY_LAUNCH(kernel, blocks, threads, stream) uly_emu::launch(kernel, (unsigned)(blocks), (unsigned)(threads))
#else
#define ULY_LAUNCH(kernel, blocks, threads, stream) kernel<<<(blocks), (threads), 0, (stream)>>>
#endif
#endif
