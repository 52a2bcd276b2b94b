/* kernels/cuda/emu/include/cuda_bf16.h — stands in for the CUDA header in the emulator build (see ../cuda_emu.h). */
#include "cuda_emu.h"
