/* kernels/cpu/kernels.h — signatures of the CPU compute kernels (internal, not the FFI surface).
 *
 * Contract for every kernel here:
 *  - float32, row-major, contiguous buffers unless an argument says otherwise;
 *  - `*_forward` writes (=) its outputs;
 *  - `*_backward` ACCUMULATES (+=) into every gradient output (dinp, dweight, ...);
 *    a NULL gradient pointer means "not needed" and is skipped;
 *  - no allocation of results, no error reporting: the dispatch layer (core/ops.c)
 *    validates shapes, dtypes and index ranges before calling;
 *  - multi-threaded with OpenMP where it pays; results never depend on the thread count
 *    (no racy scatter, reductions in a fixed order per output element).
 */
#ifndef ULY_KERNELS_CPU_H
#define ULY_KERNELS_CPU_H
#include <stdint.h>

/* x rounded to the nearest bf16 (even on ties), kept in f32; a NaN stays a (quiet) NaN */
static inline float f32_round_bf16(float x) {
    union { float f; uint32_t u; } v = {x};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) v.u |= 0x00400000u;
    else v.u += 0x7fffu + ((v.u >> 16) & 1u);
    v.u &= 0xffff0000u;
    return v.f;
}
/* the bits of x rounded to bf16 (as f32_round_bf16), and a bf16's value */
static inline uint16_t f32_bf16_bits(float x) {
    union { float f; uint32_t u; } v = {f32_round_bf16(x)};
    return (uint16_t)(v.u >> 16);
}
/* the bits AVX512-BF16's VCVTNEPS2BF16 (and so the AMX packers) round x to: f32_bf16_bits, but a
 * denormal x becomes a zero of its sign (checked against the instruction over 2^20 patterns) */
static inline uint16_t f32_bf16_bits_daz(float x) {
    union { float f; uint32_t u; } v = {x};
    if ((v.u & 0x7f800000u) == 0) v.u &= 0x80000000u;
    return f32_bf16_bits(v.f);
}
static inline float bf16_bits_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* ---- how a row kernel reads its activations and writes its results ----
 * The row kernels (norms, cross-entropy, RoPE) take an io: NULL for f32 arrays (pointers into
 * them), or the bf16 twins' (bf16_twins.c), which convert elements [off, off + n) of a bf16
 * array into a per-thread f32 buffer (in), hand out another for the f32 results of elements
 * [off, off + n) (out) and round those into the bf16 array (put). The same compiled arithmetic
 * serves both. */
typedef struct uly_row_io {
    const float *(*in)(const void *src, int64_t off, int64_t n);
    float *(*out)(int64_t off, int64_t n);
    void (*put)(void *dst, int64_t off, int64_t n, const float *f);
} uly_row_io;
static inline const float *row_in(const uly_row_io *io, const void *src, int64_t off, int64_t n) {
    return io ? io->in(src, off, n) : (const float *)src + off;
}
static inline float *row_out(const uly_row_io *io, void *dst, int64_t off, int64_t n) {
    return io ? io->out(off, n) : (float *)dst + off;
}
static inline void row_put(const uly_row_io *io, void *dst, int64_t off, int64_t n, const float *f) {
    if (io) io->put(dst, off, n, f);
}

/* ---- elementwise unary (unary.c) ---- */
enum uly_unary_kind {
    ULY_UNARY_GELU_TANH = 0, /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    ULY_UNARY_GELU_EXACT,    /* 0.5 x (1 + erf(x / sqrt 2)) */
    ULY_UNARY_SILU,          /* x * sigmoid(x) */
    ULY_UNARY_RELU,
    ULY_UNARY_TANH,
    ULY_UNARY_SIGMOID,
    ULY_UNARY_EXP,
    ULY_UNARY_LOG,
    ULY_UNARY_SQRT,
    ULY_UNARY_COUNT
};
/* out[i] = f(inp[i]) for i < n */
void unary_forward(float *out, const float *inp, int64_t n, int kind);
/* dinp[i] += dout[i] * f'(inp[i]); `out` is the forward output (may be used, e.g. exp/tanh/sigmoid/sqrt) */
void unary_backward(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind);
/* the elementwise kernels cut n into blocks of ULY_EW_BLOCK elements (from element 0); the
 * *_block forms run one block (n <= ULY_EW_BLOCK) on the calling thread, as the kernels do */
#define ULY_EW_BLOCK 4096
void unary_forward_block(float *out, const float *inp, int64_t n, int kind);
void unary_backward_block(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind);

/* swiglu: out = silu(gate) * up, all [n] */
void swiglu_forward(float *out, const float *gate, const float *up, int64_t n);
void swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n);
void swiglu_forward_block(float *out, const float *gate, const float *up, int64_t n);
void swiglu_backward_block(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n);

/* ---- reductions over the middle axis of a contiguous [outer, n, inner] view (reduce.c) ---- */
/* out[o, i] = scale * sum_j inp[o, j, i]   (out is [outer, inner]) ; mean = sum with scale 1/n */
void reduce_sum_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, float scale);
/* dinp[o, j, i] += scale * dout[o, i] */
void reduce_sum_backward(float *dinp, const float *dout, int64_t outer, int64_t n, int64_t inner, float scale);
/* out[o, i] = max_j inp[o, j, i]; argmax[o, i] = the first j reaching it (NaN wins: propagates) */
void reduce_max_forward(float *out, int64_t *argmax, const float *inp, int64_t outer, int64_t n, int64_t inner);
/* dinp[o, argmax[o,i], i] += dout[o, i] */
void reduce_max_backward(float *dinp, const float *dout, const int64_t *argmax, int64_t outer, int64_t n, int64_t inner);

/* ---- softmax / log-softmax over the middle axis of [outer, n, inner] (softmax.c) ---- */
/* is_log = 0: out = softmax; is_log = 1: out = log_softmax. Numerically stable (max-subtracted). */
void softmax_forward(float *out, const float *inp, int64_t outer, int64_t n, int64_t inner, int is_log);
/* from the forward OUTPUT `out`:
 *   softmax:     dinp += out * (dout - sum_j dout*out)
 *   log_softmax: dinp += dout - exp(out) * sum_j dout */
void softmax_backward(float *dinp, const float *dout, const float *out, int64_t outer, int64_t n, int64_t inner, int is_log);

/* ---- normalisation over the last axis, rows x C (norm.c) ---- */
/* out = (x - mean) * rstd * weight + bias; weight/bias may be NULL (= 1 / 0). Saves mean[rows], rstd[rows]. */
void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int64_t rows, int64_t C, float eps);
void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, const float *mean, const float *rstd, int64_t rows, int64_t C);
/* out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps); weight may be NULL. Saves rstd[rows]. */
void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int64_t rows, int64_t C, float eps);
void rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                      const float *rstd, int64_t rows, int64_t C);
/* the same with out / inp read and written through io (uly_row_io; NULL: f32) */
void layernorm_forward_io(const uly_row_io *io, void *out, float *mean, float *rstd, const void *inp,
                          const float *weight, const float *bias, int64_t rows, int64_t C, float eps);
void layernorm_backward_io(const uly_row_io *io, float *dinp, float *dweight, float *dbias, const float *dout,
                           const void *inp, const float *weight, const float *mean, const float *rstd, int64_t rows,
                           int64_t C);
void rmsnorm_forward_io(const uly_row_io *io, void *out, float *rstd, const void *inp, const float *weight,
                        int64_t rows, int64_t C, float eps);
void rmsnorm_backward_io(const uly_row_io *io, float *dinp, float *dweight, const float *dout, const void *inp,
                         const float *weight, const float *rstd, int64_t rows, int64_t C);

/* ---- embedding (embedding.c); idx_bytes is 4 (int32) or 8 (int64); indices already range-checked ---- */
/* out[i, :] = weight[idx[i], :]  for i < n; weight is [V, C] */
void embedding_forward(float *out, const void *idx, int idx_bytes, const float *weight, int64_t n, int64_t C);
/* dweight[idx[i], :] += dout[i, :]  (deterministic: threads split the C columns, rows in order) */
void embedding_backward(float *dweight, const float *dout, const void *idx, int idx_bytes, int64_t n, int64_t C);
/* index of the first idx[i] outside [0, V), or -1 if all are valid */
int64_t embedding_first_bad_index(const void *idx, int idx_bytes, int64_t n, int64_t V);

/* ---- rotary position embedding (rope.c) ----
 * x is [B, T, H, D], D even. Pairs (x[2i], x[2i+1]) are rotated by angle pos * theta^(-2i/D)
 * with pos = pos_offset + t (t the index along T): the interleaved/complex form of the RoFormer
 * and Llama papers. */
void rope_forward(float *out, const float *inp, int64_t B, int64_t T, int64_t H, int64_t D,
                  int64_t pos_offset, float theta);
/* dinp += rotation by -angle of dout */
void rope_backward(float *dinp, const float *dout, int64_t B, int64_t T, int64_t H, int64_t D,
                   int64_t pos_offset, float theta);
/* rope_forward with out / inp through io (uly_row_io; NULL: f32) */
void rope_forward_io(const uly_row_io *io, void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D,
                     int64_t pos_offset, float theta);

/* ---- dropout with a counter-based RNG (dropout.c) ----
 * element i is kept iff uniform(seed, offset + i) >= p; kept elements are scaled by 1/(1-p).
 * The mask depends only on (seed, offset + i), never on the thread count. */
void dropout_forward(float *out, const float *inp, int64_t n, float p, uint64_t seed, uint64_t offset);
void dropout_backward(float *dinp, const float *dout, int64_t n, float p, uint64_t seed, uint64_t offset);
/* the uniform in [0, 1) used above (exposed for specs and for other RNG users) */
float uly_counter_uniform(uint64_t seed, uint64_t counter);

/* ---- cross-entropy fused with log-softmax (cross_entropy.c) ----
 * logits [rows, V]; targets [rows] of int32 (target_bytes 4) or int64 (8), already range-checked
 * except for ignore_index. For each row r with targets[r] != ignore_index:
 *   loss[r] = lse[r] - logits[r, t],  lse[r] = log sum_j exp(logits[r, j]);
 * ignored rows get loss 0 and lse 0. Returns the number of non-ignored rows. */
int64_t cross_entropy_forward(float *loss, float *lse, const float *logits, const void *targets,
                              int target_bytes, int64_t rows, int64_t V, int64_t ignore_index);
/* dlogits[r, j] += dloss[r] * (exp(logits[r, j] - lse[r]) - [j == t_r]) for non-ignored rows */
void cross_entropy_backward(float *dlogits, const float *dloss, const float *logits, const float *lse,
                            const void *targets, int target_bytes, int64_t rows, int64_t V, int64_t ignore_index);
/* the same with logits read through io (uly_row_io; NULL: f32) */
int64_t cross_entropy_forward_io(const uly_row_io *io, float *loss, float *lse, const void *logits,
                                 const void *targets, int target_bytes, int64_t rows, int64_t V, int64_t ignore_index);
void cross_entropy_backward_io(const uly_row_io *io, float *dlogits, const float *dloss, const void *logits,
                               const float *lse, const void *targets, int target_bytes, int64_t rows, int64_t V,
                               int64_t ignore_index);

/* ---- reference attention (attention_ref.c), materialises the full score matrix ----
 * q [B, Tq, H, D], k and v [B, Tk, Hkv, D], out [B, Tq, H, D], all contiguous; H % Hkv == 0 and
 * query head h uses K/V head h / (H / Hkv) (grouped-query attention).
 * probs [B, H, Tq, Tk] receives softmax(scale * q k^T + mask), saved for backward.
 * causal: query i may see key j iff j <= i + (Tk - Tq) (bottom-right aligned, as FlashAttention);
 * a query row that sees no key gets probability 0 everywhere and output 0. Uses BLAS sgemm. */
void attention_forward(float *out, float *probs, const float *q, const float *k, const float *v,
                       int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D,
                       float scale, int causal);
/* returns 0, or -1 (nothing written) when its dS scratch cannot be allocated */
int attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                        const float *k, const float *v, const float *probs,
                        int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D,
                        float scale, int causal);

/* ---- elementwise binary with broadcasting, and tensor-scalar ops (binary.c) ----
 * a and b are read through element strides aligned to the output shape (0 = broadcast);
 * out is contiguous with `shape`. */
enum uly_binary_kind { ULY_BINARY_ADD = 0, ULY_BINARY_SUB, ULY_BINARY_MUL, ULY_BINARY_DIV };
void binary_forward(float *out, const float *a, const int64_t *a_strides, const float *b, const int64_t *b_strides,
                    int ndim, const int64_t *shape, int kind);
enum uly_scalar_kind { ULY_SCALAR_ADD = 0, ULY_SCALAR_MUL, ULY_SCALAR_POW };
/* out = a + s, a * s or a ^ s over n contiguous elements */
void scalar_forward(float *out, const float *a, int64_t n, int kind, float s);
/* dinp += dout * d(op)/da */
void scalar_backward(float *dinp, const float *dout, const float *a, int64_t n, int kind, float s);
/* y += alpha * x over n contiguous elements */
void axpy_accumulate(float *y, const float *x, int64_t n, float alpha);

/* ---- strided batched GEMM through BLAS (matmul.c) ----
 * C[b] = beta * C[b] + A[b] @ B[b] for every index b of the batch shape; a matrix operand has
 * batch strides (0 = broadcast over that batch dim) and row/column strides. A or B must have
 * a unit row or column stride (the caller makes a contiguous copy otherwise); C must have a
 * unit column stride. A broadcast C (stride 0) gets beta on its first batch only, later batches
 * add in order: beta = 0 writes the sum over the batches (an uninitialised C is fine). */
/* dtype: ULY_DTYPE_F32 (0, what every CPU kernel takes), or ULY_DTYPE_BF16 (p then points at bf16
 * values), which only a backend's gemm_batched_bf16 is ever handed */
typedef struct uly_mat { float *p; int64_t bstride[8]; int64_t rs, cs; int dtype; } uly_mat;
int gemm_operand_ok(int64_t rows, int64_t cols, int64_t rs, int64_t cs);
void gemm_batched(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C,
                  int64_t M, int64_t N, int64_t K, float beta);
/* the dtype codes kernels are handed (uly_mat.dtype, flash_operand.dtype): ULY_DTYPE_F32, ULY_DTYPE_BF16 */
#define KDT_F32 0
#define KDT_BF16 1
/* the backend's gemm_batched_bf16 (uly_backend.h): A and B f32 or bf16, rounded to bf16 (nearest
 * even), products exact, f32 sums; C f32, or bf16 (K > 0, beta 0) holding the f32 result rounded
 * once. On AMX tiles where gemm_amx_on, else with VDPBF16PS where gemm_avx512_bf16_on (the
 * operands rounded as they are packed), else OpenBLAS on rounded f32 copies */
void gemm_batched_bf16(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C,
                       int64_t M, int64_t N, int64_t K, float beta);
/* gemm_batched for bf16 precision on f32 operands, for a backend whose core rounds them while
 * gemm_bf16_on() says 0 (the simulated device's gemm_batched_rounded, gemm_rounds_operands):
 * gemm_batched_bf16 with a bf16 engine on, else gemm_batched on the operands as given */
void gemm_batched_rounded(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C,
                          int64_t M, int64_t N, int64_t K, float beta);
/* ---- the bf16 GEMM (gemm_amx.c: packing, driver, the AMX engine) ----
 * gemm_amx_2d: C = beta C + A B, or bias + A B where bias (a row of N: beta then ignored, C not
 * read), operands rounded to bf16 on the way in; A and B (each f32 or bf16: adt, bdt) with a
 * unit row or column stride, C (f32, or bf16 with beta 0 or a bias: cdt) with unit column stride;
 * -1 when it did nothing (no bf16 engine on, other strides, called inside a parallel region or
 * while another thread runs it, no memory for its panels). Its blocks run on the AMX tiles where
 * gemm_amx_on, else on the AVX512-BF16 engine where gemm_avx512_bf16_on.
 * gemm_amx_on: whether AMX is in use; gemm_amx_status: "on" or "off: why"; gemm_amx_enable: a
 * switch (the previous setting), for comparisons */
int gemm_amx_2d(int64_t M, int64_t N, int64_t K, const void *a, int adt, int64_t ars, int64_t acs, const void *b,
                int bdt, int64_t brs, int64_t bcs, float beta, const float *bias, void *c, int cdt, int64_t crs,
                int64_t ccs);
/* the backend's gemm_bias (uly_backend.h): C = bias + A B for a Linear layer in bf16 precision on
 * a bf16 engine (C f32, or bf16 rounded once); -1 otherwise (f32 precision, none on: the core
 * seeds C with the bias and adds the GEMM into it, the same bits) */
int gemm_bias(uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N, int64_t K, const float *bias, int bf16);
int gemm_amx_on(void);
const char *gemm_amx_status(void);
int gemm_amx_enable(int on);
/* the AMX tiles' bf16 peak of `threads` threads in FLOP/s, measured (~10 ms); 0 where AMX is off */
double gemm_amx_peak(int threads);
/* ---- the AVX512-BF16 engine (gemm_avx512_bf16.c): gemm_amx_2d's blocks with VDPBF16PS where AMX
 * is off. gemm_avx512_bf16_on: whether the CPU has it and it is wanted (it runs only while AMX is
 * off; by default only where VDPBF16PS measured at least 1.25x the f32 FMA rate); _status: "on" or
 * "off: why"; _enable: 1 always, 0 never, -1 where it pays (the default; returns the previous
 * setting); _peak: its bf16 peak of `threads` threads in FLOP/s, measured (~10 ms), 0 where off ----
 * gemm_bf16_on: whether either engine runs gemm_amx_2d; gemm_bf16_engine: "amx", "avx512_bf16"
 * or "off: why"; gemm_bf16_peak: the running engine's peak (0 where none) */
int gemm_avx512_bf16_on(void);
const char *gemm_avx512_bf16_status(void);
int gemm_avx512_bf16_enable(int on);
double gemm_avx512_bf16_peak(int threads);
int gemm_bf16_on(void);
const char *gemm_bf16_engine(void);
double gemm_bf16_peak(int threads);
/* C[M][N] (+= where acc) A[M][K] B[K][N], row-major with leading dims, operands rounded to bf16:
 * the flash-attention kernels' tile products in bf16 precision; callable inside a parallel
 * region (its panels are the calling thread's) once tile_amx_configure() has run on the calling
 * thread (and until tile_amx_release()); -1 when it did nothing (AMX off, no memory) */
void tile_amx_configure(void);
void tile_amx_release(void);
int tile_gemm_amx(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                  int64_t ldc, int acc);
/* the same products on operands packed once and used for many products (flash attention's K, V,
 * Q and dO tiles): tile_amx_pack_a packs A [M][K] (element (i, k) at A[i rs + k cs]; rs or cs 1)
 * into TILE_AMX_A_ELEMS(M, K) bf16, tile_amx_pack_b packs B [K][N] (element (k, j) at
 * B[k rs + j cs]) into TILE_AMX_B_WORDS(K, N) words, rounded to bf16 and zero-padded to whole
 * tiles; tile_amx_gemm_packed: C[M][N] (+= where acc) = packed A times packed B, with the bits of
 * tile_gemm_amx on the unpacked operands. Only where gemm_amx_on(), between tile_amx_configure()
 * and tile_amx_release() on the calling thread. */
#define TILE_AMX_A_ELEMS(M, K) ((((M) + 31) / 32 * 32) * (((K) + 31) / 32 * 32))
#define TILE_AMX_B_WORDS(K, N) ((((N) + 31) / 32 * 32) * (((K) + 31) / 32 * 32) / 2)
void tile_amx_pack_a(uint16_t *dst, const float *A, int64_t rs, int64_t cs, int64_t M, int64_t K);
void tile_amx_pack_b(uint32_t *dst, const float *B, int64_t rs, int64_t cs, int64_t K, int64_t N);
void tile_amx_gemm_packed(int64_t M, int64_t N, int64_t K, const uint16_t *pa, const uint32_t *pb, float *C,
                          int64_t ldc, int acc);

/* ---- bf16 twins (bf16_twins.c): the kernels above with their activations in bf16 (uint16_t
 * bits; weights, statistics and gradients f32), the uly_backend entries of the same names
 * (core/include/uly_backend.h: each gives the f32 kernel's bits between two converting copies).
 * binary_forward_typed: out, a and b each f32 or bf16 (dtype ULY_DTYPE_F32 / ULY_DTYPE_BF16). The
 * row twins (norms, cross-entropy, RoPE) return -1 (cross-entropy's forward for its count),
 * having written nothing, when their per-thread row buffers cannot be had; call them outside
 * OpenMP parallel regions, from one thread at a time. ---- */
void binary_forward_typed(void *out, int out_dtype, const void *a, int a_dtype, const int64_t *a_strides,
                          const void *b, int b_dtype, const int64_t *b_strides, int ndim, const int64_t *shape,
                          int kind);
void swiglu_forward_bf16(void *out, const void *gate, const void *up, int64_t n);
void swiglu_backward_bf16(float *dgate, float *dup, const float *dout, const void *gate, const void *up, int64_t n);
int layernorm_forward_bf16(void *out, float *mean, float *rstd, const void *inp, const float *weight,
                           const float *bias, int64_t rows, int64_t C, float eps);
int layernorm_backward_bf16(float *dinp, float *dweight, float *dbias, const float *dout, const void *inp,
                            const float *weight, const float *mean, const float *rstd, int64_t rows, int64_t C);
int rmsnorm_forward_bf16(void *out, float *rstd, const void *inp, const float *weight, int64_t rows, int64_t C,
                         float eps);
int rmsnorm_backward_bf16(float *dinp, float *dweight, const float *dout, const void *inp, const float *weight,
                          const float *rstd, int64_t rows, int64_t C);
int64_t cross_entropy_forward_bf16(float *loss, float *lse, const void *logits, const void *targets, int target_bytes,
                                   int64_t rows, int64_t V, int64_t ignore_index);
int cross_entropy_backward_bf16(float *dlogits, const float *dloss, const void *logits, const float *lse,
                                const void *targets, int target_bytes, int64_t rows, int64_t V, int64_t ignore_index);
void unary_forward_bf16(void *out, const void *inp, int64_t n, int kind);
void unary_backward_bf16(float *dinp, const float *dout, const void *inp, const void *out, int64_t n, int kind);
int rope_forward_bf16(void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos_offset,
                      float theta);
/* how many times a twin above has been called in this process (specs: the twins did run) */
int64_t bf16_twin_calls(void);

/* ==== optimizers (optim.c) — begin ==========================================================
 * In place over ONE contiguous f32 parameter of n elements; g is its gradient, m / v / buf its
 * state (same n). The caller (core/optim.c) computes the scalars in double and validates. */
/* p *= decay; m = b1 m + a1 g; v = b2 v + a2 g^2; p -= step_size * m / (sqrt(v)/bc2_sqrt + eps)
 * with decay = 1 - lr wd, step_size = lr / (1 - b1^step), bc2_sqrt = sqrt(1 - b2^step), and
 * a1 = 1 - b1, a2 = 1 - b2 computed in double before rounding to f32, as torch.optim.AdamW's
 * Python floats are (1.0f - 0.999f is 0.00099998713, float(1 - 0.999) is 0.0010000000475);
 * every op rounded as ATen's kernels round it (optim.c): torch.optim.AdamW's bits */
void optim_adamw(float *p, const float *g, float *m, float *v, int64_t n, float decay, float beta1,
                 float one_minus_beta1, float beta2, float one_minus_beta2, float step_size, float bc2_sqrt, float eps);
/* d = g + wd p; buf = init ? d : momentum buf + (1 - dampening) d; p -= lr (nesterov ? d + momentum buf : buf);
 * buf == NULL: no momentum, p -= lr d. 1 - dampening comes computed in double (as torch.optim.SGD's);
 * rounded as ATen's kernels round (optim.c): torch.optim.SGD's bits */
void optim_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float weight_decay, float momentum,
               float one_minus_dampening, int nesterov, int init);
/* sum of x[i]^2 in double; fixed chunks added in order: the same value at any thread count */
double optim_sumsq(const float *x, int64_t n);
/* x *= s */
void optim_scale(float *x, int64_t n, float s);
/* ==== optimizers — end ==================================================================== */

/* this machine's f32 FMA peak over `threads` threads, measured (peak.c), in FLOP/s */
double cpu_fma_peak(int threads);
/* the peaks' timing (peak.c): thread_seconds run on `threads` threads at once, three times; the
 * slowest thread's seconds of the best run (clocks warm, less noise) */
double slowest_thread_best_of_three(double (*thread_seconds)(void), int threads);

#endif
