/* kernels/cuda/emu/include/cuda.h — stands in for the CUDA driver header in the emulator build: its tensor-map
 * types and the encoder's signature (see ../cuda_emu.h). */
#include "cuda_emu.h"
