/* kernels/cuda/mma.cuh — the warp-level tensor-core instructions of sm_80 and later (also run on
 * sm_90), as small functions: mma.sync m16n8k16 with bf16 operands and f32 accumulators,
 * ldmatrix (x4, plain and transposed) from shared memory, and the asynchronous global -> shared
 * copies (cp.async, 16 bytes or one float, zero-filled past the end; commit / wait by group) that let a tile
 * load run under the math of the previous one. Fragment layouts are the PTX ISA's:
 * with g = lane / 4 and t = lane % 4,
 *   A (16 x 16, row-major) a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
 *   B (16 x 8, k x n)      b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
 *   C (16 x 8, f32)        c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
 * (two bf16 in a 32-bit register, the lower index in the low half). In the emulator build the same
 * functions gather the warp's registers (uly_emu::warp_gather) and compute exactly these layouts,
 * so a fragment mix-up fails the specs on the CPU as it would on the GPU; cp.async copies land
 * only at the wait that covers them, so a missing wait fails there too. */
#ifndef ULY_CUDA_MMA_CUH
#define ULY_CUDA_MMA_CUH
#include <stdint.h>
#include <cuda_bf16.h>

/* two floats -> two bf16 (round to nearest even) in one register, lo in the low half */
__device__ static inline uint32_t mma_pack_bf16(float lo, float hi) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

#ifdef ULY_CUDA_EMU
__device__ static inline float mma_bf16_at(uint32_t reg, int hi) {
    return __uint_as_float(hi ? (reg & 0xffff0000u) : (reg << 16));
}

/* c += A B for one warp's 16 x 8 tile (k = 16) */
__device__ static inline void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    struct regs { uint32_t a[4], b[2]; } mine, all[32];
    for (int i = 0; i < 4; i++) mine.a[i] = a[i];
    mine.b[0] = b[0];
    mine.b[1] = b[1];
    uly_emu::warp_gather(&mine, sizeof mine, all);
    /* this lane's rows of A (g, g + 8: lanes 4 g .. 4 g + 3 hold them) and columns of B (2 t,
     * 2 t + 1: column n is held by lanes 4 n .. 4 n + 3) */
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float A[2][16], Bm[2][16];
    for (int u = 0; u < 4; u++)
        for (int e = 0; e < 2; e++) {
            const regs &row = all[4 * g + u];
            A[0][2 * u + e] = mma_bf16_at(row.a[0], e);
            A[1][2 * u + e] = mma_bf16_at(row.a[1], e);
            A[0][2 * u + 8 + e] = mma_bf16_at(row.a[2], e);
            A[1][2 * u + 8 + e] = mma_bf16_at(row.a[3], e);
            for (int h = 0; h < 2; h++) {
                const regs &col = all[4 * (2 * t + h) + u];
                Bm[h][2 * u + e] = mma_bf16_at(col.b[0], e);
                Bm[h][2 * u + 8 + e] = mma_bf16_at(col.b[1], e);
            }
        }
    for (int i = 0; i < 4; i++) {
        const float *a_row = A[i >> 1], *b_col = Bm[i & 1];   /* row g + 8 (i >> 1), column 2 t + (i & 1) */
        float s = 0.0f;
        for (int k = 0; k < 16; k++) s += a_row[k] * b_col[k];
        c[i] += s;
    }
}

/* four 8 x 8 bf16 matrices; lanes 8j .. 8j+7 give the 16-byte rows of matrix j; r[j] of lane l
 * holds row l/4, columns 2(l%4), 2(l%4)+1 (transposed: rows 2(l%4), 2(l%4)+1 of column l/4) */
__device__ static inline void ldmatrix_x4_impl(uint32_t r[4], const void *row, int trans) {
    const void *rows[32];
    uly_emu::warp_gather(&row, sizeof row, rows);
    int lane = threadIdx.x & 31;
    for (int j = 0; j < 4; j++) {
        uint16_t e[2];
        for (int h = 0; h < 2; h++) {
            int rr = trans ? 2 * (lane & 3) + h : lane >> 2, cc = trans ? lane >> 2 : 2 * (lane & 3) + h;
            e[h] = ((const uint16_t *)rows[8 * j + rr])[cc];
        }
        r[j] = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
    }
}
__device__ static inline void ldmatrix_x4(uint32_t r[4], const void *row) { ldmatrix_x4_impl(r, row, 0); }
__device__ static inline void ldmatrix_x4_trans(uint32_t r[4], const void *row) { ldmatrix_x4_impl(r, row, 1); }

/* 16 bytes global -> shared, or 16 zero bytes when !valid (src is then not read) */
__device__ static inline void cp_async16(void *dst, const void *src, int valid) { uly_emu::async_copy16(dst, src, valid); }
/* 4 bytes (a float), or 4 zero bytes when !valid */
__device__ static inline void cp_async4(void *dst, const void *src, int valid) { uly_emu::async_copy4(dst, src, valid); }
__device__ static inline void cp_async_commit(void) { uly_emu::async_commit(); }
template <int N>
__device__ static inline void cp_async_wait(void) { uly_emu::async_wait(N); }

#else
__device__ static inline void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ static inline void ldmatrix_x4(uint32_t r[4], const void *row) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ static inline void ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ static inline void cp_async16(void *dst, const void *src, int valid) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ static inline void cp_async4(void *dst, const void *src, int valid) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ static inline void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* until at most N of the groups committed so far are still in flight */
template <int N>
__device__ static inline void cp_async_wait(void) { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#endif

/* ---- wgmma: Hopper's warpgroup MMA (sm_90a; the emulator) ----
 * A warpgroup (4 consecutive warps, here a whole 128-thread block) computes D (64 x N, f32) +=
 * A (64 x 16, bf16) B (16 x N, bf16): A from registers, warp w giving rows 16w.. in the mma.sync
 * A layout above; B from shared memory through a descriptor; D per warp in the mma.sync C layout,
 * one n8 tile after another (d[4j + i] is C element i of columns 8j..8j+7). Asynchronous:
 * wg_fence() before the first wgmma after the registers were written, wg_commit() closes a
 * group, wg_wait<N>() returns when at most N groups are in flight, and wg_fence_regs() then stops
 * the compiler reading the accumulators earlier. Shared memory that cp.async filled needs
 * fence_proxy_async() in every thread before the barrier that precedes the wgmma reading it.
 * B tiles use the 128-byte swizzle: 128-byte lines, the 16-byte chunk c of line r stored at chunk
 * c ^ (r % 8), atoms of 8 lines 1024 bytes apart, each atom 1024-byte aligned. ULY_HAS_WGMMA says
 * whether this compilation pass has them (sm_90a device code, or the emulator). */
#if defined(ULY_CUDA_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ULY_HAS_WGMMA 1
#else
#define ULY_HAS_WGMMA 0
#endif

/* the descriptor of a 128-byte-swizzled B operand starting at p (the first line of an 8-line
 * group, possibly 32 * k bytes into it): 8-line groups 1024 bytes apart. Both byte offsets are set
 * to 1024: the K-major operands here span one atom along K per instruction and the MN-major ones
 * one atom along N (64 bf16), so whichever of the two the layout reads is the 8-line stride. */
__device__ static inline uint64_t wg_desc_sw128(const void *p) {
#ifdef ULY_CUDA_EMU
    uint32_t a = uly_emu::shared_offset(p);
#else
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
#endif
    const uint64_t off = 1024 >> 4;
    return (uint64_t)((a >> 4) & 0x3fff) | (off << 16) | (off << 32) | ((uint64_t)1 << 62);
}
/* A tile's descriptors from one base: wg_desc_lo(p) once, then wg_desc_at(lo, bytes) for the
 * operand `bytes` (a multiple of 16) after p is one 32-bit add (the address field is the low 14
 * bits of the low word, and shared memory ends below 256 KiB, so the sum never carries out of it;
 * the high word, the 8-line stride and the swizzle mode, is a constant). Built per wgmma by
 * wg_desc_sw128, each descriptor cost ~4 uniform instructions: ~70 a tile in dK/dV. */
#define WG_DESC_HI ((uint32_t)(1024 >> 4) | (1u << 30))
__device__ static inline uint32_t wg_desc_lo(const void *p) { return (uint32_t)wg_desc_sw128(p); }
__device__ static inline uint64_t wg_desc_at(uint32_t lo, uint32_t bytes) {
    return ((uint64_t)WG_DESC_HI << 32) | (uint64_t)(lo + (bytes >> 4));
}

#ifdef ULY_CUDA_EMU
/* d (N / 2 floats) += A B for this warp's 16 rows of a 64 x N x 16 warpgroup MMA; TRANS: B MN-major */
template <int N, int TRANS>
__device__ static inline void wgmma_64xN(float *d, const uint32_t a[4], uint64_t desc) {
    uint32_t all[32][4];
    uly_emu::warp_gather(a, 16, all);
    float A[16][16];
    for (int l = 0; l < 32; l++) {
        int g = l >> 2, t = l & 3;
        for (int e = 0; e < 2; e++) {
            A[g][2 * t + e] = mma_bf16_at(all[l][0], e);
            A[g + 8][2 * t + e] = mma_bf16_at(all[l][1], e);
            A[g][2 * t + 8 + e] = mma_bf16_at(all[l][2], e);
            A[g + 8][2 * t + 8 + e] = mma_bf16_at(all[l][3], e);
        }
    }
    uly_emu::wgmma_queue(d, N, &A[0][0], desc, TRANS);
}
template <int TRANS>
__device__ static inline void wgmma_64x64(float d[32], const uint32_t a[4], uint64_t desc) { wgmma_64xN<64, TRANS>(d, a, desc); }
template <int TRANS, int ACC = 1, int TRANS_A = 0>
__device__ static inline void wgmma_64x32_ss(float d[16], uint64_t desc_a, uint64_t desc) {
    uly_emu::wgmma_queue_ss(d, 32, desc_a, desc, TRANS, ACC, TRANS_A);
}
template <int TRANS, int ACC = 1>
__device__ static inline void wgmma_64x64_ss(float d[32], uint64_t desc_a, uint64_t desc) {
    uly_emu::wgmma_queue_ss(d, 64, desc_a, desc, TRANS, ACC, 0);
}
template <int ACC = 1>
__device__ static inline void wgmma_64x128_ss(float d[64], uint64_t desc_a, uint64_t desc) {
    uly_emu::wgmma_queue_ss(d, 128, desc_a, desc, 0, ACC, 0);
}
__device__ static inline void wg_fence(void) {}
__device__ static inline void wg_commit(void) { uly_emu::wgmma_commit(); }
template <int N>
__device__ static inline void wg_wait(void) { uly_emu::wgmma_wait(N); }
__device__ static inline void wg_fence_regs(float *, int) {}
__device__ static inline void fence_proxy_async(void) {}
#elif ULY_HAS_WGMMA
/* a wgmma's accumulators: the operand list d[0..N) as read-write registers, and the PTX that names
 * them (%0 to %N-1, in braces) */
#define WG_ACC16(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WG_ACC32(d) WG_ACC16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
                    "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
                    "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_ACC64(d) WG_ACC32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), \
                    "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), \
                    "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
                    "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), \
                    "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WG_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
template <int TRANS>
__device__ static inline void wgmma_64x64(float d[32], const uint32_t a[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_REGS32 ", "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                 : WG_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS));
}
/* the same with A through a descriptor too (64 x 16, K-major, wg_desc_sw128; TRANS_A 1 (64 x 32):
 * MN-major, a 128-byte line per k holding the 64 rows): no A registers; ACC 0: d = A B, its old
 * value ignored (the first of a chain, no zeroed registers: ptxas then waits for nothing before
 * the next wgmma) */
template <int TRANS, int ACC = 1, int TRANS_A = 0>
__device__ static inline void wgmma_64x32_ss(float d[16], uint64_t desc_a, uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %19, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 WG_REGS16 ", "
                 "%16, %17, p, 1, 1, %20, %18;\n}\n"
                 : WG_ACC16(d)
                 : "l"(desc_a), "l"(desc), "n"(TRANS), "n"(ACC), "n"(TRANS_A));
}
template <int TRANS, int ACC = 1>
__device__ static inline void wgmma_64x64_ss(float d[32], uint64_t desc_a, uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %35, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_REGS32 ", "
                 "%32, %33, p, 1, 1, 0, %34;\n}\n"
                 : WG_ACC32(d)
                 : "l"(desc_a), "l"(desc), "n"(TRANS), "n"(ACC));
}
/* 64 x 128 (a 128-key score tile), both operands K-major from shared memory */
template <int ACC = 1>
__device__ static inline void wgmma_64x128_ss(float d[64], uint64_t desc_a, uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 WG_REGS64 ", "
                 "%64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC64(d)
                 : "l"(desc_a), "l"(desc), "n"(ACC));
}
__device__ static inline void wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ static inline void wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ static inline void wg_wait(void) { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ static inline void wg_fence_regs(float *d, int n) {
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ static inline void fence_proxy_async(void) { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#else   /* passes without wgmma: never called (the kernels take the mma.sync path there) */
template <int TRANS>
__device__ static inline void wgmma_64x64(float *, const uint32_t *, uint64_t) {}
template <int TRANS, int ACC = 1, int TRANS_A = 0>
__device__ static inline void wgmma_64x32_ss(float *, uint64_t, uint64_t) {}
template <int TRANS, int ACC = 1>
__device__ static inline void wgmma_64x64_ss(float *, uint64_t, uint64_t) {}
template <int ACC = 1>
__device__ static inline void wgmma_64x128_ss(float *, uint64_t, uint64_t) {}
__device__ static inline void wg_fence(void) {}
__device__ static inline void wg_commit(void) {}
template <int N>
__device__ static inline void wg_wait(void) {}
__device__ static inline void wg_fence_regs(float *, int) {}
__device__ static inline void fence_proxy_async(void) {}
#endif
#endif
