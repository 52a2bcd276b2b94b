// spec/support/emu_rules.cpp — rules of a GPU that the CUDA emulator enforces, each on its own, for
// spec/cuda_emu_spec.lua. argv[1]:
//   balanced, no-shrink, too-much, mixed: setmaxnreg in two blocks of three warpgroups, the third
//     giving registers back (40 a thread), the first two taking them (232), as the warp-specialised
//     attention kernels do ("done"); the third never giving any back, the two asking 240, or one
//     thread asking another count: each an error the emulator stops at;
//   smem: a launch with 64 KiB of dynamic shared memory refused before cudaFuncSetAttribute allows
//     it and run after ("refused 1 ran 1");
//   wgmma, wgmma-a-late, wgmma-b-late: one warpgroup's 64 x 64 x 16 wgmma with A and B through
//     128-byte-swizzled descriptors, every accumulator against the product ("wgmma ok"); then with
//     one element of A (a row another warp's lanes take) or of B written between the issue and the
//     wait, which the emulator stops at.
#include "cuda_emu.h"
#include <stdio.h>
#include <string.h>

// bf16 bits of a float that bf16 holds exactly (the small integers below)
static uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16);
}
// byte offset of element `along` of line `line` in a K-major tile of 128-byte swizzled lines,
// groups of 8 lines 1024 bytes apart (the PTX ISA's layout for a descriptor's 128-byte swizzle)
static uint32_t sw128(uint32_t base, int line, int along) {
    uint32_t addr = base + (uint32_t)(line / 8) * 1024 + (uint32_t)(line % 8) * 128 + (uint32_t)along * 2;
    return addr ^ (((addr >> 7) & 7) << 4);
}
static uint64_t desc_sw128(uint32_t offset) { return (uint64_t)(offset >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62); }
static float a_value(int r, int k) { return (float)((r * 3 + k) % 7 - 3); }
static float b_value(int k, int c) { return (float)((k * 5 + c) % 5 - 2); }

// 128 threads: A (64 rows x 16 k) at byte 0, B (64 columns x 16 k, K-major) at byte 8192
static int wgmma_case(const char *mode) {
    int wrong = 0;
    uly_emu::run_grid(1, 128, 16384, [&] {
        unsigned char *smem = (unsigned char *)uly_emu::dynamic_shared();
        const int tid = (int)threadIdx.x, w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
        if (tid == 0)
            for (int r = 0; r < 64; r++)
                for (int k = 0; k < 16; k++) {
                    uint16_t a = bf16_of(a_value(r, k)), b = bf16_of(b_value(k, r));
                    memcpy(smem + sw128(0, r, k), &a, 2);
                    memcpy(smem + sw128(8192, r, k), &b, 2);   // column r of B
                }
        __syncthreads();
        float d[32] = {0};
        uly_emu::wgmma_queue_ss(d, 64, desc_sw128(0), desc_sw128(8192), 0, 1, 0);
        uly_emu::wgmma_commit();
        __syncthreads();
        if (tid == 127) {   // a row of warp 0 (its lanes 20 to 23 take it), or a column of B
            uint16_t x = bf16_of(1.0f);
            if (!strcmp(mode, "wgmma-a-late")) memcpy(smem + sw128(0, 5, 9), &x, 2);
            if (!strcmp(mode, "wgmma-b-late")) memcpy(smem + sw128(8192, 40, 3), &x, 2);
        }
        __syncthreads();
        uly_emu::wgmma_wait(0);
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) {
                const int r = 16 * w + g + 8 * (i >> 1), c = 8 * j + 2 * t + (i & 1);
                float want = 0.0f;
                for (int k = 0; k < 16; k++) want += a_value(r, k) * b_value(k, c);
                wrong += d[4 * j + i] != want;
            }
    });
    if (wrong) printf("wgmma: %d accumulators wrong\n", wrong);
    else puts("wgmma ok");
    return wrong != 0;
}

static int ran;
static void big_smem_kernel(int *out) {
    unsigned char *s = (unsigned char *)uly_emu::dynamic_shared();
    s[65535] = 1;
    if (threadIdx.x == 0) *out = 1;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "balanced";
    if (!strncmp(mode, "wgmma", 5)) return wgmma_case(mode);
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
