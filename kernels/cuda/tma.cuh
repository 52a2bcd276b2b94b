/* kernels/cuda/tma.cuh — Hopper's tensor memory accelerator (sm_90a, and the emulator): mbarriers
 * in shared memory and 4-d tiled loads of a tensor map's box into shared memory. One thread issues
 * a tile's load (mbar_expect_tx: one arrival and the bytes to come, then tma_load_4d), every
 * thread that reads the tile waits on the barrier's phase (mbar_wait with the phase's parity, 0
 * first, flipping with each use); mbar_arrive is a plain arrival (a buffer given back). The box
 * lands in the 128-byte swizzle that wgmma reads (chunk c of 128-byte line r at chunk c ^ (r % 8),
 * the destination 1024-byte aligned), with zeros where the box leaves the tensor; its bytes count
 * in full either way. No cp.async, no per-thread address arithmetic: the loads leave the warps'
 * instruction stream. */
#pragma once
#include <stdint.h>
#include <cuda.h>
#include "mma.cuh"

#ifdef ULY_CUDA_EMU
__device__ static inline void mbar_init(uint64_t *bar, unsigned count) { uly_emu::mbar_init(bar, count); }
__device__ static inline void mbar_init_fence(void) {}
__device__ static inline void mbar_expect_tx(uint64_t *bar, unsigned bytes) { uly_emu::mbar_expect_tx(bar, bytes); }
__device__ static inline void mbar_wait(uint64_t *bar, unsigned parity) { uly_emu::mbar_wait(bar, parity); }
__device__ static inline void mbar_arrive(uint64_t *bar) { uly_emu::mbar_expect_tx(bar, 0); }
__device__ static inline void tma_load_4d(void *dst, const CUtensorMap *map, int c0, int c1, int c2, int c3, uint64_t *bar) {
    uly_emu::tma_load_4d(dst, map, c0, c1, c2, c3, bar);
}
#elif ULY_HAS_WGMMA
__device__ static inline uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ static inline void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
/* the barriers' initialisation visible to the async proxy (the TMA unit) */
__device__ static inline void mbar_init_fence(void) { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ static inline void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
/* spins on try_wait (which itself waits a while in hardware); a phase that has not completed
 * after ~2^26 tries (seconds) traps: a kernel error that names the launch, not a hung GPU */
__device__ static inline void mbar_wait(uint64_t *bar, unsigned parity) {
    const uint32_t at = smem_u32(bar);
    for (uint32_t n = 0;; n++) {
        uint32_t done;
        asm volatile("{\n"
                     ".reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n"
                     "}\n"
                     : "=r"(done)
                     : "r"(at), "r"(parity)
                     : "memory");
        if (done) return;
        if (n >= (1u << 26)) __trap();
    }
}
/* one arrival (no bytes) */
__device__ static inline void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ static inline void tma_load_4d(void *dst, const CUtensorMap *map, int c0, int c1, int c2, int c3, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
                 : "memory");
}
#endif
