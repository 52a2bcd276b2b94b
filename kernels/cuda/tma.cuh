/* kernels/cuda/tma.cuh — Hopper's tensor memory accelerator and warp specialisation (sm_90a, and
 * the emulator): mbarriers in shared memory, 4-d (tiles) and 1-d (rows of statistics) tiled loads
 * of a tensor map's box into shared memory, setmaxnreg and named barriers. One thread issues a
 * tile's load (mbar_expect_tx: one arrival and the bytes to come, then tma_load_4d), every thread
 * that reads the tile waits on the barrier's phase (mbar_wait with the phase's parity, 0 first,
 * flipping with each use); mbar_arrive is a plain arrival (a buffer given back). The box lands in
 * the 128-byte swizzle that wgmma reads (chunk c of 128-byte line r at chunk c ^ (r % 8), the
 * destination 1024-byte aligned; unswizzled, 128-byte aligned), with zeros where the box leaves
 * the tensor; its bytes count in full either way. No cp.async, no per-thread address arithmetic:
 * the loads leave the warps' instruction stream. */
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
    uly_emu::tma_load(dst, map, 4, c0, c1, c2, c3, bar);
}
__device__ static inline void tma_load_1d(void *dst, const CUtensorMap *map, int c0, uint64_t *bar) {
    uly_emu::tma_load(dst, map, 1, c0, 0, 0, 0, bar);
}
template <int N>
__device__ static inline void regs_shrink_to(void) { uly_emu::setmaxnreg(N, 0); }
template <int N>
__device__ static inline void regs_grow_to(void) { uly_emu::setmaxnreg(N, 1); }
__device__ static inline void named_bar_sync(unsigned id, unsigned count) { uly_emu::named_sync(id, count); }
__device__ static inline void named_bar_arrive(unsigned id, unsigned count) { uly_emu::named_arrive(id, count); }
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
/* a wait that timed out: the kernel traps. Out of line: with the trap inlined into every wait,
 * ptxas (nvcc 13.0) held the forward's consumer warpgroups to the launch's 168 registers a thread
 * although their setmaxnreg gives them 232 (at D 128 with 128-key tiles: spills, and the wgmmas
 * serialised, C7512); with a call there they get them (over 200) */
__device__ __noinline__ static void mbar_timed_out(void) { __trap(); }
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
        if (n >= (1u << 26)) mbar_timed_out();
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
/* setmaxnreg: a warpgroup (all its threads) gives registers back to the block's pool, or takes
 * them (waiting until the pool has them): a producer warpgroup that only issues loads shrinks, the
 * consumers grow past the launch's even share (which ptxas then allocates them) */
template <int N>
__device__ static inline void regs_shrink_to(void) { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ static inline void regs_grow_to(void) { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
/* named barriers (not 0, __syncthreads'): sync waits until `count` threads (whole warps) have
 * arrived, these included; arrive counts without waiting. Two warpgroups take turns with a pair */
__device__ static inline void named_bar_sync(unsigned id, unsigned count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ static inline void named_bar_arrive(unsigned id, unsigned count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ static inline void tma_load_1d(void *dst, const CUtensorMap *map, int c0, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n"
                 ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(c0), "r"(smem_u32(bar))
                 : "memory");
}
#endif

/* rows r0.. (ROWS) of head hd of batch b through map mp (boxes of ROWS rows x 64 elements) into
 * the wgmma tile s, counted on barrier br: D / 64 boxes side by side (sw128_at's atom columns,
 * ROWS rows x 128 bytes apart) */
#if ULY_HAS_WGMMA
template <int D, int ROWS = 64>
__device__ static inline void tma_tile(uint4 *s, const CUtensorMap *mp, int64_t hd, int64_t r0, int64_t b, uint64_t *br) {
#pragma unroll
    for (int a = 0; a < D / 64; a++) tma_load_4d(s + a * ROWS * 8, mp, 64 * a, (int)hd, (int)r0, (int)b, br);
}
#endif
