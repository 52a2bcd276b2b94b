// spec/support/emu_rules.cpp — rules of a GPU that the CUDA emulator enforces, each on its own, for
// spec/cuda_emu_spec.lua. argv[1]:
//   balanced, no-shrink, too-much, mixed: setmaxnreg in two blocks of three warpgroups, the third
//     giving registers back (40 a thread), the first two taking them (232), as the warp-specialised
//     attention kernels do ("done"); the third never giving any back, the two asking 240, or one
//     thread asking another count: each an error the emulator stops at;
//   smem: a launch with 64 KiB of dynamic shared memory refused before cudaFuncSetAttribute allows
//     it and run after ("refused 1 ran 1").
#include "cuda_emu.h"
#include <stdio.h>
#include <string.h>

static int ran;
static void big_smem_kernel(int *out) {
    unsigned char *s = (unsigned char *)uly_emu::dynamic_shared();
    s[65535] = 1;
    if (threadIdx.x == 0) *out = 1;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "balanced";
    if (!strcmp(mode, "smem")) {
        uly_emu::launch(big_smem_kernel, 1, 32, 65536, NULL)(&ran);
        const int refused = cudaGetLastError() == cudaErrorInvalidValue && !ran;
        if (cudaFuncSetAttribute(big_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536) != cudaSuccess) return 1;
        uly_emu::launch(big_smem_kernel, 1, 32, 65536, NULL)(&ran);
        printf("refused %d ran %d\n", refused, ran && cudaGetLastError() == cudaSuccess);
        return 0;
    }
    uly_emu::run_grid(2, 384, 0, [&] {
        const unsigned wg = threadIdx.x / 128;
        if (wg == 2) {
            if (strcmp(mode, "no-shrink")) uly_emu::setmaxnreg(40, 0);
            return;
        }
        const unsigned n = !strcmp(mode, "too-much") ? 240 : !strcmp(mode, "mixed") && threadIdx.x == 5 ? 224 : 232;
        uly_emu::setmaxnreg(n, 1);
    });
    puts("done");
    return 0;
}
