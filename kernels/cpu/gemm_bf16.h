/* kernels/cpu/gemm_bf16.h — what the bf16 GEMM's two engines share: gemm_amx.c (packing, driver,
 * the AMX tiles) hands its packed panels to gemm_avx512_bf16.c (VDPBF16PS on zmm registers) where
 * AMX is off. Internal to kernels/cpu; the public entry points are in kernels.h. */
#ifndef ULY_GEMM_BF16_H
#define ULY_GEMM_BF16_H
#include <stdint.h>

/* the compilers that know the AMX and AVX512-BF16 intrinsics, on x86-64 Linux */
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define GEMM_BF16_BUILT 1
#endif

#define GEMM_BF16_MR 32   /* rows of a C block (A is packed in whole blocks of them, zero-padded) */
#define GEMM_BF16_NR 32   /* columns of a C block: one packed B strip */

/* C's [mr x nr] block on the AVX512-BF16 engine, c_block's contract (gemm_amx.c): c (f32, or bf16
 * where c16: beta 0) at row stride ld = beta C + A B, or bias (a row of nr, C not read) + A B; a
 * holds GEMM_BF16_MR packed rows of kcp bf16, strip kcp / 2 rows of GEMM_BF16_NR pair words */
void avx512_bf16_block(void *c, int c16, int64_t ld, int64_t mr, int64_t nr, float beta, const float *bias,
                       const uint16_t *a, const uint32_t *strip, int64_t kcp);
#endif
