/* kernels/cuda/emu/include/cublas_v2.h — stands in for the CUDA header in the emulator build (see ../cuda_emu.h). */
#include "cuda_emu.h"
