/* kernels/cuda/emu/include/cuda_profiler_api.h — stands in for the CUDA header in the emulator build (see ../cuda_emu.h). */
#include "cuda_emu.h"
