/* kernels/cpu/rope.c — rotary position embedding, interleaved (complex) form.
 *
 * x is [B, T, H, D], D even. For pair i < D/2 of every head vector at sequence index t:
 *   angle = pos * theta^(-2i/D),  pos = pos_offset + t
 *   forward : (o0, o1) = (x0 cos - x1 sin,  x0 sin + x1 cos)      (out = rotation by +angle)
 *   backward: dinp += rotation by -angle of dout:
 *             (d0 cos + d1 sin, -d0 sin + d1 cos)
 * Backward ACCUMULATES (+=) into dinp; a NULL dinp is skipped. out may alias inp.
 * Angles are formed and reduced in double (pos * freq, then sin/cos), so positions in the
 * millions keep full float accuracy; cos/sin are computed once per (t, i) and shared by the
 * B*H vectors at that t. Parallel over t; every output element is computed independently,
 * so results do not depend on the thread count. rope_forward_io reads and writes through a
 * uly_row_io (kernels.h): the bf16 twin (bf16_twins.c) runs this same code on f32 copies.
 */
#include "kernels.h"
#include <math.h>
#include <stdlib.h>

#define ROPE_CHUNK 256     /* pairs whose cos/sin are held on the stack at once */
#define ROPE_PAR_MIN 16384 /* elements below which threads are not worth starting */

/* apply the rotation (sign = +1 forward, -1 backward) for all b, h at sequence index t */
static void rope_row(const uly_row_io *io, void *out, const void *inp, int accumulate, int64_t B, int64_t T,
                     int64_t H, int64_t D, int64_t t, double pos, const double *freq, double th, double sign) {
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    int64_t P = D / 2;
    for (int64_t i0 = 0; i0 < P; i0 += ROPE_CHUNK) {
        int64_t np = P - i0 < ROPE_CHUNK ? P - i0 : ROPE_CHUNK;
        for (int64_t j = 0; j < np; j++) {
            int64_t i = i0 + j;
            double f = freq ? freq[i] : pow(th, -(double)(2 * i) / (double)D);
            double a = pos * f;
            cs[j] = (float)cos(a);
            sn[j] = (float)(sign * sin(a));
        }
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < H; h++) {
                int64_t base = ((b * T + t) * H + h) * D + 2 * i0;
                const float *x = row_in(io, inp, base, 2 * np);
                float *o = row_out(io, out, base, 2 * np);
                if (accumulate) {
                    for (int64_t j = 0; j < np; j++) {
                        float x0 = x[2 * j], x1 = x[2 * j + 1];
                        o[2 * j] += x0 * cs[j] - x1 * sn[j];
                        o[2 * j + 1] += x0 * sn[j] + x1 * cs[j];
                    }
                } else {
                    for (int64_t j = 0; j < np; j++) {
                        float x0 = x[2 * j], x1 = x[2 * j + 1];
                        o[2 * j] = x0 * cs[j] - x1 * sn[j];
                        o[2 * j + 1] = x0 * sn[j] + x1 * cs[j];
                    }
                }
                row_put(io, out, base, 2 * np, o);
            }
        }
    }
}

static void rope_apply(const uly_row_io *io, void *out, const void *inp, int accumulate, int64_t B, int64_t T,
                       int64_t H, int64_t D, int64_t pos_offset, float theta, double sign) {
    if (B <= 0 || T <= 0 || H <= 0 || D < 2) return;
    int64_t P = D / 2;
    /* inverse frequencies, shared by all t; on allocation failure they are recomputed inline */
    double *freq = malloc((size_t)P * sizeof(double));
    if (freq)
        for (int64_t i = 0; i < P; i++) freq[i] = pow((double)theta, -(double)(2 * i) / (double)D);
    #pragma omp parallel for schedule(static) if (B * T * H * D >= ROPE_PAR_MIN && T > 1)
    for (int64_t t = 0; t < T; t++)
        rope_row(io, out, inp, accumulate, B, T, H, D, t, (double)pos_offset + (double)t, freq, (double)theta, sign);
    free(freq);
}

void rope_forward_io(const uly_row_io *io, void *out, const void *inp, int64_t B, int64_t T, int64_t H, int64_t D,
                     int64_t pos_offset, float theta) {
    rope_apply(io, out, inp, 0, B, T, H, D, pos_offset, theta, 1.0);
}

void rope_forward(float *out, const float *inp, int64_t B, int64_t T, int64_t H, int64_t D,
                  int64_t pos_offset, float theta) {
    rope_apply(NULL, out, inp, 0, B, T, H, D, pos_offset, theta, 1.0);
}

void rope_backward(float *dinp, const float *dout, int64_t B, int64_t T, int64_t H, int64_t D,
                   int64_t pos_offset, float theta) {
    if (!dinp) return;
    rope_apply(NULL, dinp, dout, 1, B, T, H, D, pos_offset, theta, -1.0);
}
