/* kernels/cpu/flash_attention.h — the memory-efficient (FlashAttention-2 style) CPU attention
 * kernels of flash_attention.c (internal; the dispatch and autograd node are core/flash.c).
 *
 * Shapes: q [B, Tq, H, D], k and v [B, Tk, Hkv, D], read through element strides (the last dim
 * must be contiguous: stride 1); out and dout [B, Tq, H, D] contiguous; lse and delta
 * [B, H, Tq] contiguous; dq [B, Tq, H, D], dk and dv [B, Tk, Hkv, D] contiguous. Query head h
 * uses K/V head h / (H / Hkv) (grouped-query attention, K/V never repeated).
 *
 * Visibility of key j to query i (all conditions that are set must hold), with i' = i + Tk - Tq:
 *   causal          j <= i'                         (bottom-right aligned)
 *   window          i' - left <= j <= i' + right    (left/right < 0: unbounded on that side)
 *   block layout    layout[i / bs, j / bs] != 0     (layout [ceil(Tq/bs), ceil(Tk/bs)] row-major)
 *   documents       q_doc[b, i] == k_doc[b, j]      ([B, Tq] and [B, Tk] contiguous int32)
 * A query that sees no key gets output 0 and lse -inf; its gradients are 0.
 *
 * Forward writes out and lse = log sum_j exp(scale q_i . k_j) over visible j (natural log).
 * Backward ACCUMULATES (+=) into dq, dk, dv (NULL: skipped) from dout, out and lse; delta is
 * [B, H, Tq] scratch it fills with rowsum(dout * out). Both return 0, or -1 when the per-thread
 * tile scratch cannot be allocated (nothing written then). Results do not depend on the number
 * of threads (fixed tiles, fixed reduction order, no atomics on floats).
 */
#ifndef ULY_KERNELS_CPU_FLASH_ATTENTION_H
#define ULY_KERNELS_CPU_FLASH_ATTENTION_H
#include <stdint.h>

typedef struct flash_operand {
    const float *p;              /* element [0, 0, 0, 0] */
    int64_t sb, st, sh;          /* element strides of the batch, sequence and head dims */
    int dtype;                   /* ULY_DTYPE_F32 (0), or ULY_DTYPE_BF16 (1: p then points at bf16, read
                                    exactly) in bf16 precision on a backend with bf16 GEMMs (the CPU's) */
} flash_operand;

typedef struct flash_problem {
    int64_t B, Tq, Tk, H, Hkv, D;
    float scale;
    flash_operand q, k, v;
    int causal;
    int64_t left, right;         /* window widths; < 0: unbounded */
    const int32_t *layout;       /* NULL or [nbr, nbc] */
    int64_t bs, nbr, nbc;
    const int32_t *q_doc, *k_doc; /* both NULL or both set */
    int bf16;                    /* mixed precision: a backend doing attention with GEMMs may round their operands
                                    to bf16 (the CUDA one does; the CPU's on AMX tiles, else in f32) */
} flash_problem;

/* scratch: flash_attention_scratch_floats(p, 0 / 1) floats (the transposed K tiles; backward also
 * V, Q and dO tiles): O(N D), allocated by the caller so that the allocator counts it */
int64_t flash_attention_scratch_floats(const flash_problem *p, int backward);
int flash_attention_forward(float *out, float *lse, float *scratch, const flash_problem *p);
int flash_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                             float *delta, float *scratch, const flash_problem *p);
/* score tiles (64 x 64) computed by forward calls since the last reset: work done, for specs */
int64_t flash_attention_tiles(void);
void flash_attention_reset_tiles(void);

#endif
