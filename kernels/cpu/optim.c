/* kernels/cpu/optim.c — the optimizer loops over one contiguous f32 parameter of n elements.
 *
 *   optim_adamw: torch.optim.AdamW's single-tensor update (its default), op for op:
 *                p1 = p * decay; m = madd(g, a1, m * b1); v = madd(a2 * g, g, v * b2);
 *                p = p1 + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps)
 *   optim_sgd:   torch.optim.SGD's: d = madd(p, wd, g) (wd != 0); buf = init ? d : madd(d, 1 - dampening,
 *                buf * momentum); d = nesterov ? madd(buf, momentum, d) : buf; p = madd(d, -lr, p)
 *   optim_sumsq: sum of x^2 in double, over fixed chunks summed in chunk order
 *   optim_scale: x *= s
 *
 * Same bits as PyTorch: every product, quotient, root and sum is rounded to f32 where ATen's
 * kernels round it, and madd(a, b, c) = a b + c is one fused multiply-add (one rounding) where
 * ATen's vectorised add_(alpha) (vec::fmadd) and addcmul_ (as its build compiles it) use one on
 * CPUs with FMA, else a product and a sum. So this file is compiled with -ffp-contract=off (CMakeLists.txt): the
 * compiler must not fuse what PyTorch rounds twice. Checked element for element against
 * PyTorch 1.13 on an AVX-512 CPU (spec/optim_torch_bits_spec.lua: this sequence in Lua, and
 * torch.optim itself where /usr/bin/python3 has torch).
 *
 * Every loop runs over fixed chunks of CHUNK elements (a function of n only), split over the
 * OpenMP threads when n is large: each element takes the same code path at any thread count,
 * so the results are bit-identical for 1 or many threads. The sum of squares has no OpenMP
 * reduction: chunk sums land in a buffer and are added in chunk order.
 */
#include "kernels.h"
#include <math.h>
#include <stdlib.h>
#if defined(__SSE2__) || defined(__AVX__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define MADD(a, b, c) fmaf(a, b, c) /* one rounding: ATen's vec::fmadd on this CPU */
#else
#define MADD(a, b, c) ((a) * (b) + (c)) /* two: ATen's fmadd where the CPU has no FMA */
#endif

#define PAR_MIN 32768 /* elements below which a loop stays on one thread */
#define CHUNK 8192    /* elements per task (a multiple of 16: chunks keep the vector alignment) */

static inline int64_t n_chunks(int64_t n) { return (n + CHUNK - 1) / CHUNK; }
static inline int64_t chunk_len(int64_t n, int64_t c) { return n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK; }

/* d[i] = sqrt(s[i]). IEEE sqrt is correctly rounded, so vector and scalar lanes agree bit for
 * bit. Written with intrinsics because GCC 12 keeps an errno branch around sqrtf (unless the
 * whole build has -fno-math-errno) and then refuses to vectorise the loop: 2.4x slower. */
static inline void sqrt_n(float *restrict d, const float *restrict s, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_sqrt_ps(_mm256_loadu_ps(s + i)));
#elif defined(__SSE2__)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(d + i, _mm_sqrt_ps(_mm_loadu_ps(s + i)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
    for (; i + 4 <= n; i += 4) vst1q_f32(d + i, vsqrtq_f32(vld1q_f32(s + i)));
#endif
    for (; i < n; i++) d[i] = sqrtf(s[i]);
}

#define SUB 512 /* elements per pass of the three AdamW loops (their buffers stay in L1) */

static void adamw_chunk(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                        int64_t n, float decay, float b1, float a1, float b2, float a2, float step_size,
                        float bc2_sqrt, float eps)
{
    float root[SUB];
    for (int64_t o = 0; o < n; o += SUB) {
        const int64_t len = n - o < SUB ? n - o : SUB;
        float *restrict pp = p + o, *restrict mm = m + o, *restrict vv = v + o;
        const float *restrict gg = g + o;
#pragma omp simd
        for (int64_t i = 0; i < len; i++) {
            mm[i] = MADD(gg[i], a1, mm[i] * b1);          /* exp_avg.mul_(beta1).add_(grad, alpha=1-beta1) */
            vv[i] = MADD(a2 * gg[i], gg[i], vv[i] * b2);  /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2) */
        }
        sqrt_n(root, vv, len);
#pragma omp simd
        for (int64_t i = 0; i < len; i++) {
            const float denom = root[i] / bc2_sqrt + eps; /* (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps) */
            pp[i] = pp[i] * decay + (-step_size * mm[i]) / denom; /* param.mul_(decay); .addcdiv_(exp_avg, denom, value=-step_size) */
        }
    }
}

void optim_adamw(float *p, const float *g, float *m, float *v, int64_t n, float decay, float beta1,
                 float one_minus_beta1, float beta2, float one_minus_beta2, float step_size, float bc2_sqrt, float eps)
{
    const int64_t nc = n_chunks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t c = 0; c < nc; c++) {
        const int64_t o = c * CHUNK;
        adamw_chunk(p + o, g + o, m + o, v + o, chunk_len(n, c), decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                    step_size, bc2_sqrt, eps);
    }
}

static void sgd_chunk(float *restrict p, const float *restrict g, float *restrict buf, int64_t n, float lr,
                      float wd, float momentum, float keep, int nesterov, int init)
{
    const float neg_lr = -lr;
    if (!buf) { /* no momentum */
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float d = wd != 0.0f ? MADD(p[i], wd, g[i]) : g[i]; /* grad.add(param, alpha=weight_decay) */
            p[i] = MADD(d, neg_lr, p[i]);                              /* param.add_(d_p, alpha=-lr) */
        }
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float d = wd != 0.0f ? MADD(p[i], wd, g[i]) : g[i];
        const float b = init ? d : MADD(d, keep, buf[i] * momentum);  /* buf.mul_(momentum).add_(d_p, alpha=1-dampening) */
        buf[i] = b;
        p[i] = MADD(nesterov ? MADD(b, momentum, d) : b, neg_lr, p[i]); /* d_p.add(buf, alpha=momentum) */
    }
}

void optim_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float weight_decay, float momentum,
               float one_minus_dampening, int nesterov, int init)
{
    const int64_t nc = n_chunks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t c = 0; c < nc; c++) {
        const int64_t o = c * CHUNK;
        sgd_chunk(p + o, g + o, buf ? buf + o : NULL, chunk_len(n, c), lr, weight_decay, momentum, one_minus_dampening,
                  nesterov, init);
    }
}

static inline double sumsq_chunk(const float *x, int64_t n)
{
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return s;
}

double optim_sumsq(const float *x, int64_t n)
{
    const int64_t nc = n_chunks(n);
    double total = 0.0;
    double *part = nc > 1 ? malloc((size_t)nc * sizeof *part) : NULL;
    if (!part) { /* one chunk, or no buffer: the same chunk sums, serially, in the same order */
        for (int64_t c = 0; c < nc; c++) total += sumsq_chunk(x + c * CHUNK, chunk_len(n, c));
        return total;
    }
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t c = 0; c < nc; c++) part[c] = sumsq_chunk(x + c * CHUNK, chunk_len(n, c));
    for (int64_t c = 0; c < nc; c++) total += part[c];
    free(part);
    return total;
}

void optim_scale(float *x, int64_t n, float s)
{
    const int64_t nc = n_chunks(n);
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t c = 0; c < nc; c++) {
        float *restrict q = x + c * CHUNK;
        const int64_t len = chunk_len(n, c);
#pragma omp simd
        for (int64_t i = 0; i < len; i++) q[i] *= s;
    }
}
