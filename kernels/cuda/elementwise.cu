/* kernels/cuda/elementwise.cu — the elementwise kernels of the CUDA backend, same contracts as
 * kernels/cpu/{unary,binary,dropout,rope}.c: activations and their derivatives, broadcasting
 * binary ops through strides, tensor-scalar ops, y += a x, dropout with the CPU's counter-based
 * RNG (the same mask bit for bit), RoPE, and the strided walks of the core (dtype-converting
 * copy, fill, accumulation into a broadcast view). Grid-stride loops on the backend's stream. */
#include <math.h>
#include <string.h>
#include "common.cuh"

#define THREADS 256
#define LAUNCH(kernel, n, ...) do { \
        if ((n) > 0) ULY_LAUNCH(kernel, uly_cu_blocks((n), THREADS), THREADS, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(#kernel); } while (0)
#define LAUNCH_AS_(name, kernel, n, ...) do { \
        if ((n) > 0) ULY_LAUNCH_AS(name, kernel, uly_cu_blocks((n), THREADS), THREADS, uly_cu_stream)(__VA_ARGS__); \
        ULY_CU_LAUNCHED(name); } while (0)

/* ---- activations ---- */
__device__ static inline float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

__device__ static inline float act(float x, int kind) {
    switch (kind) {
    case ULY_UNARY_GELU_TANH: { float u = GELU_K * (x + GELU_C * x * x * x); return x * sigmoidf_(2.0f * u); }
    case ULY_UNARY_GELU_EXACT: return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
    case ULY_UNARY_SILU: return x * sigmoidf_(x);
    case ULY_UNARY_RELU: return x < 0.0f ? 0.0f : x;
    case ULY_UNARY_TANH: return tanhf(x);
    case ULY_UNARY_SIGMOID: return sigmoidf_(x);
    case ULY_UNARY_EXP: return expf(x);
    case ULY_UNARY_LOG: return logf(x);
    default: return sqrtf(x);
    }
}

__device__ static inline float act_grad(float x, float y, int have_y, int kind) {
    switch (kind) {
    case ULY_UNARY_GELU_TANH: {
        float u = GELU_K * (x + GELU_C * x * x * x), s = sigmoidf_(2.0f * u), t = 2.0f * s - 1.0f;
        float du = GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
    }
    case ULY_UNARY_GELU_EXACT:
        return 0.5f * (1.0f + erff(x * 0.7071067811865476f)) + x * 0.3989422804014327f * expf(-0.5f * x * x);
    case ULY_UNARY_SILU: { float s = sigmoidf_(x); return s * (1.0f + x * (1.0f - s)); }
    case ULY_UNARY_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case ULY_UNARY_TANH: { float t = have_y ? y : tanhf(x); return 1.0f - t * t; }
    case ULY_UNARY_SIGMOID: { float s = have_y ? y : sigmoidf_(x); return s * (1.0f - s); }
    case ULY_UNARY_EXP: return have_y ? y : expf(x);
    case ULY_UNARY_LOG: return 1.0f / x;
    default: return 0.5f / (have_y ? y : sqrtf(x));
    }
}

/* T: f32, or bf16 bits (bf16 activations: read exactly, the result rounded once) */
template <typename T> __global__ static void unary_fw(T *out, const T *inp, int64_t n, int kind) {
    ULY_CU_FOR(i, n) uly_cu_st(out, i, act(uly_cu_ld(inp, i), kind));
}
template <typename T>
__global__ static void unary_bw(float *dinp, const float *dout, const T *inp, const T *out, int64_t n, int kind) {
    ULY_CU_FOR(i, n) dinp[i] += dout[i] * act_grad(uly_cu_ld(inp, i), out ? uly_cu_ld(out, i) : 0.0f, out != NULL, kind);
}
extern "C" void cu_unary_forward(float *out, const float *inp, int64_t n, int kind) {
    LAUNCH_AS_("unary_fw", unary_fw<float>, n, out, inp, n, kind);
}
extern "C" void cu_unary_backward(float *dinp, const float *dout, const float *inp, const float *out, int64_t n, int kind) {
    LAUNCH_AS_("unary_bw", unary_bw<float>, n, dinp, dout, inp, out, n, kind);
}
extern "C" void cu_unary_forward_bf16(void *out, const void *inp, int64_t n, int kind) {
    LAUNCH_AS_("unary_fw bf16", unary_fw<uint16_t>, n, (uint16_t *)out, (const uint16_t *)inp, n, kind);
}
extern "C" void cu_unary_backward_bf16(float *dinp, const float *dout, const void *inp, const void *out, int64_t n, int kind) {
    LAUNCH_AS_("unary_bw bf16", unary_bw<uint16_t>, n, dinp, dout, (const uint16_t *)inp, (const uint16_t *)out, n, kind);
}

/* T: f32, or bf16 bits (bf16 activations: read exactly, the result rounded once) */
template <typename T> __global__ static void swiglu_fw(T *out, const T *g, const T *u, int64_t n) {
    ULY_CU_FOR(i, n) {
        const float gi = uly_cu_ld(g, i);
        uly_cu_st(out, i, gi * sigmoidf_(gi) * uly_cu_ld(u, i));
    }
}
template <typename T> __global__ static void swiglu_bw(float *dg, float *du, const float *d, const T *g, const T *u, int64_t n) {
    ULY_CU_FOR(i, n) {
        const float gi = uly_cu_ld(g, i), ui = uly_cu_ld(u, i);
        float s = sigmoidf_(gi), silu = gi * s;
        if (dg) dg[i] += d[i] * ui * s * (1.0f + gi * (1.0f - s));
        if (du) du[i] += d[i] * silu;
    }
}
extern "C" void cu_swiglu_forward(float *out, const float *gate, const float *up, int64_t n) {
    LAUNCH_AS_("swiglu_fw", swiglu_fw<float>, n, out, gate, up, n);
}
extern "C" void cu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n) {
    LAUNCH_AS_("swiglu_bw", swiglu_bw<float>, n, dgate, dup, dout, gate, up, n);
}
extern "C" void cu_swiglu_forward_bf16(void *out, const void *gate, const void *up, int64_t n) {
    LAUNCH_AS_("swiglu_fw bf16", swiglu_fw<uint16_t>, n, (uint16_t *)out, (const uint16_t *)gate, (const uint16_t *)up, n);
}
extern "C" void cu_swiglu_backward_bf16(float *dgate, float *dup, const float *dout, const void *gate, const void *up,
                                        int64_t n) {
    LAUNCH_AS_("swiglu_bw bf16", swiglu_bw<uint16_t>, n, dgate, dup, dout, (const uint16_t *)gate, (const uint16_t *)up, n);
}

/* ---- two strided operands walked over one shape (binary ops, copies, gradients added into views) ----
 * Size-1 dims dropped and neighbours merged where both operands step through them as one: same-
 * layout operands are one dim (no division at all), a slice of heads keeps only the dims that
 * jump. The kernels count in I: int32_t where uly_cu_index32 allows (its divisions cost a third
 * of 64-bit ones), else int64_t; the outermost dim takes what is left of the index, undivided. */
typedef struct { int nd; int64_t shape[ULY_VIEW_MAX_DIMS], s0[ULY_VIEW_MAX_DIMS], s1[ULY_VIEW_MAX_DIMS]; } pair_dims;
static pair_dims merge_dims(int ndim, const int64_t *shape, const int64_t *s0, const int64_t *s1) {
    pair_dims m;
    int nd = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        if (nd > 0 && m.s0[nd - 1] == s0[d] * shape[d] && m.s1[nd - 1] == s1[d] * shape[d]) {
            m.shape[nd - 1] *= shape[d];   /* the outer dim steps as one over the inner: one dim */
            m.s0[nd - 1] = s0[d];
            m.s1[nd - 1] = s1[d];
        } else {
            m.shape[nd] = shape[d];
            m.s0[nd] = s0[d];
            m.s1[nd] = s1[d];
            nd++;
        }
    }
    if (nd == 0) { m.shape[0] = 1; m.s0[0] = m.s1[0] = 1; nd = 1; }
    m.nd = nd;
    return m;
}
static bool pair_contiguous(const pair_dims &m) { return m.nd == 1 && m.s0[0] == 1 && m.s1[0] == 1; }
/* whether n elements over m index in int32_t: every offset of both operands fits */
static bool pair_index32(const pair_dims &m, int64_t n) {
    int64_t r0 = 0, r1 = 0;
    for (int d = 0; d < m.nd; d++) {
        r0 += (m.shape[d] - 1) * (m.s0[d] < 0 ? -m.s0[d] : m.s0[d]);
        r1 += (m.shape[d] - 1) * (m.s1[d] < 0 ? -m.s1[d] : m.s1[d]);
    }
    return uly_cu_index32(n, r0 > r1 ? r0 : r1);
}
template <typename I> struct pair_geom { int nd; I shape[ULY_VIEW_MAX_DIMS], s0[ULY_VIEW_MAX_DIMS], s1[ULY_VIEW_MAX_DIMS]; };
template <typename I> static pair_geom<I> pair_geom_of(const pair_dims &m) {
    pair_geom<I> g;
    g.nd = m.nd;
    for (int d = 0; d < m.nd; d++) { g.shape[d] = (I)m.shape[d]; g.s0[d] = (I)m.s0[d]; g.s1[d] = (I)m.s1[d]; }
    return g;
}
/* element i's offsets in the two operands */
template <typename I> __device__ static inline void pair_offsets(const pair_geom<I> &g, I i, I &o0, I &o1) {
    I rem = i, a = 0, b = 0;
    for (int d = g.nd - 1; d > 0; d--) {
        const I x = rem % g.shape[d];
        rem /= g.shape[d];
        a += x * g.s0[d];
        b += x * g.s1[d];
    }
    o0 = a + rem * g.s0[0];
    o1 = b + rem * g.s1[0];
}
#define PAIR_FOR(I, i, n) for (I i = (I)(blockIdx.x * blockDim.x + threadIdx.x); i < (n); i += (I)(gridDim.x * blockDim.x))

/* ---- binary with broadcasting (strides aligned to the output shape, 0 = broadcast; the output
 * contiguous): a and b as the pair ---- */
template <typename TO, typename TA, typename TB, typename I>
__global__ static void binary_fw(TO *out, const TA *a, const TB *b, pair_geom<I> g, I n, int kind) {
    PAIR_FOR(I, i, n) {
        I oa, ob;
        pair_offsets(g, i, oa, ob);
        float x = uly_cu_ld(a, oa), y = uly_cu_ld(b, ob);
        uly_cu_st(out, i, kind == ULY_BINARY_ADD ? x + y : kind == ULY_BINARY_SUB ? x - y : kind == ULY_BINARY_MUL ? x * y : x / y);
    }
}
static pair_dims geometry(const int64_t *sa, const int64_t *sb, int ndim, const int64_t *shape, int64_t *n) {
    *n = 1;
    for (int d = 0; d < ndim; d++) *n *= shape[d];
    return merge_dims(ndim, shape, sa, sb);
}
template <typename TO, typename TA, typename TB, typename I>
static void binary_launch_i(TO *out, const TA *a, const TB *b, const pair_dims &m, int64_t n, int kind) {
    void (*k)(TO *, const TA *, const TB *, pair_geom<I>, I, int) = binary_fw<TO, TA, TB, I>;
    const char *name = sizeof(TO) + sizeof(TA) + sizeof(TB) == 12 ? "binary_fw" : "binary_fw bf16";
    LAUNCH_AS_(name, k, n, out, a, b, pair_geom_of<I>(m), (I)n, kind);
}
template <typename TO, typename TA, typename TB>
static void binary_launch(TO *out, const TA *a, const TB *b, const pair_dims &m, int64_t n, int kind) {
    if (pair_index32(m, n)) binary_launch_i<TO, TA, TB, int32_t>(out, a, b, m, n, kind);
    else binary_launch_i<TO, TA, TB, int64_t>(out, a, b, m, n, kind);
}
extern "C" void cu_binary_forward(float *out, const float *a, const int64_t *sa, const float *b, const int64_t *sb,
                                  int ndim, const int64_t *shape, int kind) {
    int64_t n;
    const pair_dims g = geometry(sa, sb, ndim, shape, &n);
    binary_launch(out, a, b, g, n, kind);
}
/* bf16 activations: each of out, a, b f32 or bf16 (its dtype) */
template <typename TO, typename TA>
static void binary_b(TO *out, const TA *a, const void *b, int bt, const pair_dims &g, int64_t n, int kind) {
    if (bt == ULY_DTYPE_BF16) binary_launch(out, a, (const uint16_t *)b, g, n, kind);
    else binary_launch(out, a, (const float *)b, g, n, kind);
}
template <typename TO>
static void binary_a(TO *out, const void *a, int at, const void *b, int bt, const pair_dims &g, int64_t n, int kind) {
    if (at == ULY_DTYPE_BF16) binary_b(out, (const uint16_t *)a, b, bt, g, n, kind);
    else binary_b(out, (const float *)a, b, bt, g, n, kind);
}
extern "C" void cu_binary_forward_typed(void *out, int ot, const void *a, int at, const int64_t *sa, const void *b, int bt,
                                        const int64_t *sb, int ndim, const int64_t *shape, int kind) {
    int64_t n;
    const pair_dims g = geometry(sa, sb, ndim, shape, &n);
    if (ot == ULY_DTYPE_BF16) binary_a((uint16_t *)out, a, at, b, bt, g, n, kind);
    else binary_a((float *)out, a, at, b, bt, g, n, kind);
}

__global__ static void scalar_fw(float *out, const float *a, int64_t n, int kind, float s) {
    ULY_CU_FOR(i, n) {
        float x = a[i];
        out[i] = kind == ULY_SCALAR_ADD ? x + s : kind == ULY_SCALAR_MUL ? x * s : (s == 2.0f ? x * x : powf(x, s));
    }
}
__global__ static void scalar_bw(float *dinp, const float *dout, const float *a, int64_t n, int kind, float s) {
    ULY_CU_FOR(i, n) {
        float d = dout[i];
        /* x^0 is 1 everywhere: no gradient (0 * 0^-1 would be NaN at 0) */
        dinp[i] += kind == ULY_SCALAR_ADD ? d : kind == ULY_SCALAR_MUL ? s * d : s == 0.0f ? 0.0f : d * s * powf(a[i], s - 1.0f);
    }
}
__global__ static void axpy(float *y, const float *x, int64_t n, float alpha) { ULY_CU_FOR(i, n) y[i] += alpha * x[i]; }
/* the same four at a time (16-byte loads and stores; y and x 16-byte aligned) */
__global__ static void axpy_x4(uint4 *y, const uint4 *x, int64_t n4, float alpha) {
    ULY_CU_FOR(i, n4) {
        const uint4 a = x[i];
        uint4 b = y[i];
        b.x = __float_as_uint(__uint_as_float(b.x) + alpha * __uint_as_float(a.x));
        b.y = __float_as_uint(__uint_as_float(b.y) + alpha * __uint_as_float(a.y));
        b.z = __float_as_uint(__uint_as_float(b.z) + alpha * __uint_as_float(a.z));
        b.w = __float_as_uint(__uint_as_float(b.w) + alpha * __uint_as_float(a.w));
        y[i] = b;
    }
}
/* y += alpha x over n contiguous floats: vectorised where both are 16-byte aligned */
static void launch_axpy(float *y, const float *x, int64_t n, float alpha) {
    int64_t done = 0;
    if (((uintptr_t)y & 15) == 0 && ((uintptr_t)x & 15) == 0 && n >= 4) {
        const int64_t n4 = n / 4;
        LAUNCH(axpy_x4, n4, (uint4 *)y, (const uint4 *)x, n4, alpha);
        done = 4 * n4;
    }
    if (done < n) LAUNCH(axpy, n - done, y + done, x + done, n - done, alpha);
}
extern "C" void cu_scalar_forward(float *out, const float *a, int64_t n, int kind, float s) { LAUNCH(scalar_fw, n, out, a, n, kind, s); }
extern "C" void cu_scalar_backward(float *dinp, const float *dout, const float *a, int64_t n, int kind, float s) {
    LAUNCH(scalar_bw, n, dinp, dout, a, n, kind, s);
}
extern "C" void cu_axpy_accumulate(float *y, const float *x, int64_t n, float alpha) { launch_axpy(y, x, n, alpha); }

/* ---- dropout: keep(i) = uniform(seed, offset + i) >= p, kept values scaled by 1 / (1 - p) ---- */
__global__ static void dropout_k(float *out, const float *inp, int64_t n, float p, uint64_t seed, uint64_t offset, int acc) {
    float scale = 1.0f / (1.0f - p);
    ULY_CU_FOR(i, n) {
        float v = (p < 1.0f && uly_cu_uniform(seed, offset + (uint64_t)i) >= p) ? inp[i] * scale : 0.0f;
        if (acc) out[i] += v; else out[i] = v;
    }
}
extern "C" void cu_dropout_forward(float *out, const float *inp, int64_t n, float p, uint64_t seed, uint64_t offset) {
    LAUNCH(dropout_k, n, out, inp, n, p, seed, offset, 0);
}
extern "C" void cu_dropout_backward(float *dinp, const float *dout, int64_t n, float p, uint64_t seed, uint64_t offset) {
    if (dinp) LAUNCH(dropout_k, n, dinp, dout, n, p, seed, offset, 1);
}

/* ---- RoPE on [B, T, H, D]: pair i of position pos turns by pos * theta^(-2i/D) (double angle) ---- */
#define ROPE_MAX_PAIRS 512
/* a block per (b, t) row at a time: its D / 2 angles' cosines and sines (double, rounded to f32)
 * once into shared memory, then every head's pairs turned by them: the trigonometry once per
 * position instead of once per head. D / 2 <= ROPE_MAX_PAIRS. */
template <typename E>   /* E: f32, or bf16 bits */
__global__ static void rope_k(E *out, const E *inp, int64_t rows, int64_t T, int64_t H, int64_t D, int64_t off,
                              double theta, double sign, int acc) {
    __shared__ float cs[2 * ROPE_MAX_PAIRS];
    const int64_t P = D / 2;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int64_t t = r % T;
        __syncthreads();   /* the last row's angles are no longer read */
        for (int64_t i = threadIdx.x; i < P; i += blockDim.x) {
            const double a = (double)(off + t) * pow(theta, -(double)(2 * i) / (double)D);
            cs[i] = (float)cos(a);
            cs[P + i] = (float)(sign * sin(a));
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < H * P; e += blockDim.x) {
            const int64_t i = e % P, base = r * H * D + (e / P) * D + 2 * i;
            const float c = cs[i], s = cs[P + i];
            const float x0 = uly_cu_ld(inp, base), x1 = uly_cu_ld(inp, base + 1);
            float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
            if (acc) { y0 += uly_cu_ld(out, base); y1 += uly_cu_ld(out, base + 1); }
            uly_cu_st(out, base, y0);
            uly_cu_st(out, base + 1, y1);
        }
    }
}
/* the same, a thread per pair with its own angle: for heads wider than 2 x ROPE_MAX_PAIRS */
template <typename E>
__global__ static void rope_pairs_k(E *out, const E *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off,
                                    double theta, double sign, int acc) {
    int64_t P = D / 2, n = B * T * H * P;
    ULY_CU_FOR(e, n) {
        int64_t i = e % P, t = (e / (P * H)) % T;
        double a = (double)(off + t) * pow(theta, -(double)(2 * i) / (double)D);
        float c = (float)cos(a), s = (float)(sign * sin(a));
        int64_t base = (e / P) * D + 2 * i;
        float x0 = uly_cu_ld(inp, base), x1 = uly_cu_ld(inp, base + 1);
        float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        if (acc) { y0 += uly_cu_ld(out, base); y1 += uly_cu_ld(out, base + 1); }
        uly_cu_st(out, base, y0);
        uly_cu_st(out, base + 1, y1);
    }
}
template <typename E>
static void launch_rope(const char *name, E *out, const E *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off,
                        float theta, double sign, int acc) {
    const int64_t rows = B * T, pairs = H * (D / 2);
    if (rows * pairs <= 0) { ULY_CU_LAUNCHED(name); return; }
    if (D / 2 > ROPE_MAX_PAIRS) {
        LAUNCH_AS_(name, rope_pairs_k<E>, rows * pairs, out, inp, B, T, H, D, off, (double)theta, sign, acc);
        return;
    }
    const int threads = pairs >= 256 ? 256 : pairs > 32 ? (int)((pairs + 31) / 32 * 32) : 32;
    const unsigned blocks = (unsigned)(rows < 65535 * 8 ? rows : 65535 * 8);
    ULY_LAUNCH_AS(name, rope_k<E>, blocks, threads, uly_cu_stream)(out, inp, rows, T, H, D, off, (double)theta, sign, acc);
    ULY_CU_LAUNCHED(name);
}
extern "C" void cu_rope_forward(float *out, const float *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, float theta) {
    launch_rope("rope_k", out, inp, B, T, H, D, off, theta, 1.0, 0);
}
extern "C" void cu_rope_backward(float *dinp, const float *dout, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off,
                                 float theta) {
    launch_rope("rope_k", dinp, dout, B, T, H, D, off, theta, -1.0, 1);
}
extern "C" int cu_rope_forward_bf16(void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off,
                                    float theta) {
    launch_rope("rope_k bf16", (uint16_t *)out, (const uint16_t *)inp, B, T, H, D, off, theta, 1.0, 0);
    return 0;
}

/* ---- strided walks ---- */
#define bf16_to_f32 uly_cu_bf16_to_f32
#define f32_to_bf16 uly_cu_f32_to_bf16
__device__ static inline double load(const char *p, int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return *(const float *)p;
    case ULY_DTYPE_BF16: return bf16_to_f32(*(const uint16_t *)p);
    case ULY_DTYPE_I32: return *(const int32_t *)p;
    case ULY_DTYPE_I64: return (double)*(const int64_t *)p;
    default: return *(const double *)p;
    }
}
__device__ static inline void store(char *p, int dtype, double v) {
    switch (dtype) {
    case ULY_DTYPE_F32: *(float *)p = (float)v; break;
    case ULY_DTYPE_BF16: *(uint16_t *)p = f32_to_bf16((float)v); break;
    case ULY_DTYPE_I32: *(int32_t *)p = (int32_t)v; break;
    case ULY_DTYPE_I64: *(int64_t *)p = (int64_t)v; break;
    default: *(double *)p = v; break;
    }
}
/* bytes of one element (host and device) */
__host__ __device__ static inline int dsize(int dtype) {
    return dtype == ULY_DTYPE_BF16 ? 2 : (dtype == ULY_DTYPE_F32 || dtype == ULY_DTYPE_I32) ? 4 : 8;
}
__device__ static inline int64_t offset_of(const uly_view &v, int64_t i) {
    int64_t off = 0;
    for (int d = v.ndim - 1; d >= 0; d--) {
        off += (i % v.shape[d]) * v.stride[d];
        i /= v.shape[d];
    }
    return off;
}

/* dst and src as the pair; the dtypes converted through load/store where they differ */
template <typename I> __global__ static void copy_view_k(char *dst, const char *src, int dt, int st, pair_geom<I> g, I n) {
    const int ds = dsize(dt), ss = dsize(st);
    PAIR_FOR(I, i, n) {
        I od, os;
        pair_offsets(g, i, od, os);
        const char *s = src + (int64_t)os * ss;
        char *d = dst + (int64_t)od * ds;
        if (dt == st && ds == 4) *(uint32_t *)d = *(const uint32_t *)s;
        else if (dt == st && ds == 8) *(uint64_t *)d = *(const uint64_t *)s;
        else if (dt == st) *(uint16_t *)d = *(const uint16_t *)s;
        else store(d, dt, load(s, st));
    }
}
/* contiguous conversions, four elements a thread (16-byte f32 side, 8-byte bf16 side), the same
 * rounding as the strided walk's */
__global__ static void f32_to_bf16_x4(uint2 *dst, const uint4 *src, int64_t n4) {
    ULY_CU_FOR(i, n4) {
        const uint4 v = src[i];
        dst[i] = make_uint2((uint32_t)f32_to_bf16(__uint_as_float(v.x)) | (uint32_t)f32_to_bf16(__uint_as_float(v.y)) << 16,
                            (uint32_t)f32_to_bf16(__uint_as_float(v.z)) | (uint32_t)f32_to_bf16(__uint_as_float(v.w)) << 16);
    }
}
__global__ static void bf16_to_f32_x4(uint4 *dst, const uint2 *src, int64_t n4) {
    ULY_CU_FOR(i, n4) {
        const uint2 v = src[i];
        dst[i] = make_uint4(v.x << 16, v.x & 0xffff0000u, v.y << 16, v.y & 0xffff0000u);
    }
}
template <typename I> static void launch_copy_view(const uly_view *dst, const uly_view *src, const pair_dims &m, int64_t n) {
    LAUNCH_AS_("copy_view_k", copy_view_k<I>, n, (char *)dst->p, (const char *)src->p, dst->dtype, src->dtype,
               pair_geom_of<I>(m), (I)n);
}
/* dst = src elementwise (dtypes converted): one cudaMemcpyAsync when both are contiguous in one
 * dtype, a vectorised conversion when f32 <-> bf16 contiguous, else the strided walk over the
 * collapsed dims */
extern "C" void cu_copy_view(const uly_view *dst, const uly_view *src) {
    int64_t n = 1;
    for (int d = 0; d < dst->ndim; d++) n *= dst->shape[d];
    if (n <= 0) return;
    const pair_dims m = merge_dims(dst->ndim, dst->shape, dst->stride, src->stride);
    if (pair_contiguous(m)) {
        if (dst->dtype == src->dtype) {
            const cudaError_t e = cudaMemcpyAsync(dst->p, src->p, (size_t)(n * (int64_t)dsize(dst->dtype)),
                                                  cudaMemcpyDeviceToDevice, uly_cu_stream);
            if (e != cudaSuccess) uly_cu_fail("copy on the device", e);
            return;
        }
        const bool down = dst->dtype == ULY_DTYPE_BF16 && src->dtype == ULY_DTYPE_F32;
        const bool up = dst->dtype == ULY_DTYPE_F32 && src->dtype == ULY_DTYPE_BF16;
        const uintptr_t wide = (uintptr_t)(down ? src->p : dst->p), narrow = (uintptr_t)(down ? dst->p : src->p);
        if ((down || up) && n >= 4 && wide % 16 == 0 && narrow % 8 == 0) {
            const int64_t n4 = n / 4;
            if (down) LAUNCH_AS_("copy_view f32 -> bf16", f32_to_bf16_x4, n4, (uint2 *)dst->p, (const uint4 *)src->p, n4);
            else LAUNCH_AS_("copy_view bf16 -> f32", bf16_to_f32_x4, n4, (uint4 *)dst->p, (const uint2 *)src->p, n4);
            if (n4 * 4 == n) return;
            uly_view d = *dst, s = *src;   /* the last n % 4 elements */
            d.ndim = s.ndim = 1;
            d.shape[0] = s.shape[0] = n - 4 * n4;
            d.stride[0] = s.stride[0] = 1;
            d.p = (char *)dst->p + 4 * n4 * (int64_t)dsize(dst->dtype);
            s.p = (char *)src->p + 4 * n4 * (int64_t)dsize(src->dtype);
            cu_copy_view(&d, &s);
            return;
        }
    }
    if (pair_index32(m, n)) launch_copy_view<int32_t>(dst, src, m, n);
    else launch_copy_view<int64_t>(dst, src, m, n);
}

__global__ static void fill_view_k(uly_view dst, double value, int64_t n) {
    int ds = dsize(dst.dtype);
    ULY_CU_FOR(i, n) store((char *)dst.p + offset_of(dst, i) * ds, dst.dtype, value);
}
/* dst = value: over the collapsed dims; a contiguous run of +0 (zero bits in every dtype) is one
 * cudaMemsetAsync */
extern "C" void cu_fill_view(const uly_view *dst, double value) {
    int64_t n = 1;
    for (int d = 0; d < dst->ndim; d++) n *= dst->shape[d];
    if (n <= 0) return;
    const pair_dims m = merge_dims(dst->ndim, dst->shape, dst->stride, dst->stride);
    uly_view v = *dst;
    v.ndim = m.nd;
    memcpy(v.shape, m.shape, sizeof m.shape);
    memcpy(v.stride, m.s0, sizeof m.s0);
    if (v.ndim == 1 && v.stride[0] == 1 && value == 0.0 && !signbit(value)) {
        const cudaError_t e = cudaMemsetAsync(v.p, 0, (size_t)(n * (int64_t)dsize(v.dtype)), uly_cu_stream);
        if (e != cudaSuccess) uly_cu_fail("fill on the device", e);
        return;
    }
    LAUNCH(fill_view_k, n, v, value, n);
}

/* dst += alpha * src summed over the dims where dst has stride 0: one thread per kept element,
 * looping over the summed positions in order (deterministic) */
typedef struct { int nk, nr; int64_t kshape[ULY_VIEW_MAX_DIMS], kd[ULY_VIEW_MAX_DIMS], ks[ULY_VIEW_MAX_DIMS];
                 int64_t rshape[ULY_VIEW_MAX_DIMS], rs[ULY_VIEW_MAX_DIMS]; } sum_geom;

/* kept element k's offsets in dst and src (the outermost kept dim takes what is left: no division) */
__device__ static inline void kept_offsets(const sum_geom &g, int64_t k, int64_t *od, int64_t *os) {
    int64_t rem = k, a = 0, b = 0;
    for (int d = g.nk - 1; d > 0; d--) {
        int64_t x = rem % g.kshape[d];
        rem /= g.kshape[d];
        a += x * g.kd[d];
        b += x * g.ks[d];
    }
    *od = a + rem * g.kd[0];
    *os = b + rem * g.ks[0];
}
__device__ static inline double sum_range(const sum_geom &g, const float *src, int64_t os, int64_t r0, int64_t r1) {
    double acc = 0.0;   /* long reductions (bias gradients over B x T rows) in double */
    for (int64_t r = r0; r < r1; r++) {
        int64_t rr = r, o = os;
        for (int d = g.nr - 1; d > 0; d--) {
            o += (rr % g.rshape[d]) * g.rs[d];
            rr /= g.rshape[d];
        }
        acc += src[o + rr * g.rs[0]];
    }
    return acc;
}
__global__ static void sum_view_k(float *dst, const float *src, sum_geom g, int64_t kept, int64_t red, float alpha) {
    ULY_CU_FOR(k, kept) {
        int64_t od, os;
        kept_offsets(g, k, &od, &os);
        dst[od] += alpha * (float)sum_range(g, src, os, 0, red);
    }
}
/* long reductions (a bias gradient over B x T rows): NCH chunks of the summed positions per kept
 * element in parallel, then the chunks added in order */
__global__ static void sum_view_part(double *part, const float *src, sum_geom g, int64_t kept, int64_t red, int64_t nch) {
    ULY_CU_FOR(e, nch * kept) {
        int64_t ch = e / kept, k = e % kept, od, os;
        kept_offsets(g, k, &od, &os);
        part[e] = sum_range(g, src, os, red * ch / nch, red * (ch + 1) / nch);
    }
}
__global__ static void sum_view_total(float *dst, const double *part, sum_geom g, int64_t kept, int64_t nch, float alpha) {
    ULY_CU_FOR(k, kept) {
        int64_t od, os;
        kept_offsets(g, k, &od, &os);
        double acc = 0.0;
        for (int64_t ch = 0; ch < nch; ch++) acc += part[ch * kept + k];
        dst[od] += alpha * (float)acc;
    }
}
/* dst += alpha * src element for element, dst and src as the pair (sum_view summing nothing: a
 * gradient added into a slice or a broadcast-free view) */
template <typename I> __global__ static void add_view_k(float *dst, const float *src, pair_geom<I> g, I n, float alpha) {
    PAIR_FOR(I, i, n) {
        I od, os;
        pair_offsets(g, i, od, os);
        dst[od] += alpha * src[os];
    }
}
template <typename I> static void launch_add_view(const uly_view *dst, const uly_view *src, const pair_dims &m, int64_t n,
                                                  float alpha) {
    LAUNCH_AS_("add_view_k", add_view_k<I>, n, (float *)dst->p, (const float *)src->p, pair_geom_of<I>(m), (I)n, alpha);
}

extern "C" void cu_sum_view(const uly_view *dst, const uly_view *src, float alpha) {
    bool summed = false;   /* a dim of size > 1 that dst holds once (stride 0) */
    int64_t n = 1;
    for (int d = 0; d < src->ndim; d++) {
        summed = summed || (dst->stride[d] == 0 && src->shape[d] != 1);
        n *= src->shape[d];
    }
    if (!summed) {   /* element for element: contiguous y += a x, else a walk over the merged dims */
        if (n <= 0) return;
        const pair_dims m = merge_dims(src->ndim, src->shape, dst->stride, src->stride);
        if (pair_contiguous(m)) launch_axpy((float *)dst->p, (const float *)src->p, n, alpha);
        else if (pair_index32(m, n)) launch_add_view<int32_t>(dst, src, m, n, alpha);
        else launch_add_view<int64_t>(dst, src, m, n, alpha);
        return;
    }
    /* the summed dims and the kept ones, each list in order with size-1 dims dropped and
     * neighbours merged where they step as one (a bias gradient over [B, T] rows sums over one
     * dim): the same elements added in the same order, fewer divisions */
    sum_geom g;
    g.nk = g.nr = 0;
    int64_t kept = 1, red = 1;
    for (int d = 0; d < src->ndim; d++) {
        const int64_t len = src->shape[d];
        if (dst->stride[d] == 0 && len != 1) {
            red *= len;
            if (g.nr > 0 && g.rs[g.nr - 1] == src->stride[d] * len) {
                g.rshape[g.nr - 1] *= len;
                g.rs[g.nr - 1] = src->stride[d];
            } else {
                g.rshape[g.nr] = len;
                g.rs[g.nr++] = src->stride[d];
            }
        } else if (len != 1) {
            kept *= len;
            if (g.nk > 0 && g.kd[g.nk - 1] == dst->stride[d] * len && g.ks[g.nk - 1] == src->stride[d] * len) {
                g.kshape[g.nk - 1] *= len;
                g.kd[g.nk - 1] = dst->stride[d];
                g.ks[g.nk - 1] = src->stride[d];
            } else {
                g.kshape[g.nk] = len;
                g.kd[g.nk] = dst->stride[d];
                g.ks[g.nk++] = src->stride[d];
            }
        }
    }
    if (g.nk == 0) { g.kshape[0] = 1; g.kd[0] = g.ks[0] = 0; g.nk = 1; }
    if (red == 0 || kept == 0) return;
    if (red < 4096 || kept >= 65536) {
        LAUNCH(sum_view_k, kept, (float *)dst->p, (const float *)src->p, g, kept, red, alpha);
        return;
    }
    int64_t nch = red / 1024 < 128 ? red / 1024 : 128;
    double *part = NULL;
    cudaError_t e = cudaMallocAsync((void **)&part, (size_t)(nch * kept) * sizeof(double), uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail("sum_view scratch", e); return; }
    LAUNCH(sum_view_part, nch * kept, part, (const float *)src->p, g, kept, red, nch);
    LAUNCH(sum_view_total, kept, (float *)dst->p, part, g, kept, nch, alpha);
    cudaFreeAsync(part, uly_cu_stream);
}
