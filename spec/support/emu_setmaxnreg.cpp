// spec/support/emu_setmaxnreg.cpp — the CUDA emulator's setmaxnreg on its own, for
// spec/cuda_emu_spec.lua: two blocks of three warpgroups, the third giving registers back (40 a
// thread) and the first two taking them (232), as the warp-specialised attention kernels do.
// argv[1]: balanced (prints "done"); no-shrink (the third never gives any back), too-much (the
// two ask 240), mixed (one thread asks another count), each an error the emulator stops at.
#include "cuda_emu.h"
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "balanced";
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
