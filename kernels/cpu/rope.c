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
 * B*H vectors at that t. The (cos, sin) table of the last large call is kept (rope_table): the
 * same positions are rotated for q and k in every layer, in forward, recomputation and backward,
 * and on short heads of few vectors (a DNA model's B 1, H 4, D 32) the double sin/cos had been a
 * twentieth of a training step; the table holds the same floats. Parallel over t; every output element is computed independently,
 * so results do not depend on the thread count. rope_forward_io reads and writes through a
 * uly_row_io (kernels.h): the bf16 twin (bf16_twins.c) runs this same code on f32 copies.
 */
#include "kernels.h"
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#define ROPE_CHUNK 256     /* pairs whose cos/sin are held on the stack at once */
#define ROPE_PAR_MIN 16384 /* elements below which threads are not worth starting */
#define ROPE_TABLE_MIN 65536                 /* (t, i) pairs from which a call keeps its table */
#define ROPE_TABLE_MAX ((int64_t)256 << 20)  /* bytes a kept table may take (T D 4; tools/plan.lua counts it) */

/* the angle's cos and sin as the rotation uses them */
static inline void angle(double pos, double f, float *c, float *s) {
    const double a = pos * f;
    *c = (float)cos(a);
    *s = (float)sin(a);
}

/* apply the rotation (sign = +1 forward, -1 backward) for all b, h at sequence index t; cos and
 * sin from row (P pairs of them) where given, else computed */
static void rope_row(const uly_row_io *io, void *out, const void *inp, int accumulate, int64_t B, int64_t T,
                     int64_t H, int64_t D, int64_t t, double pos, const double *freq, double th, double sign,
                     const float *row) {
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    int64_t P = D / 2;
    for (int64_t i0 = 0; i0 < P; i0 += ROPE_CHUNK) {
        int64_t np = P - i0 < ROPE_CHUNK ? P - i0 : ROPE_CHUNK;
        for (int64_t j = 0; j < np; j++) {
            int64_t i = i0 + j;
            if (row) {
                cs[j] = row[2 * i];
                sn[j] = sign < 0 ? -row[2 * i + 1] : row[2 * i + 1];   /* (float)(-x) is -(float)x */
            } else {
                angle(pos, freq ? freq[i] : pow(th, -(double)(2 * i) / (double)D), &cs[j], &sn[j]);
                if (sign < 0) sn[j] = -sn[j];
            }
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

/* the kept table: (cos, sin) of positions pos .. pos + T - 1 at pairs 0 .. D/2 - 1 for theta;
 * one at a time, replaced by the next large call it does not cover (calls hold the lock) */
static struct {
    float *cs;
    int64_t pos, T, D;
    float theta;
} table;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

/* the kept table's row for position pos_offset where it covers [pos_offset, pos_offset + T), else
 * a new one made for that range; NULL (computed per call) when that is too small to pay or too
 * large to keep */
static const float *table_for(int64_t T, int64_t D, int64_t pos_offset, float theta, const double *freq) {
    const int64_t P = D / 2;
    if (!freq) return NULL;
    if (!(table.cs && table.D == D && table.theta == theta && table.pos <= pos_offset &&
          pos_offset + T <= table.pos + table.T)) {
        if (T * P < ROPE_TABLE_MIN || T * P * 2 * (int64_t)sizeof(float) > ROPE_TABLE_MAX) return NULL;
        free(table.cs);
        table.cs = malloc((size_t)(T * P * 2) * sizeof(float));
        if (!table.cs) return NULL;
        table.pos = pos_offset; table.T = T; table.D = D; table.theta = theta;
        float *cs = table.cs;
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < P; i++)
                angle((double)pos_offset + (double)t, freq[i], &cs[2 * (t * P + i)], &cs[2 * (t * P + i) + 1]);
    }
    return table.cs + (pos_offset - table.pos) * P * 2;
}

static void rope_apply(const uly_row_io *io, void *out, const void *inp, int accumulate, int64_t B, int64_t T,
                       int64_t H, int64_t D, int64_t pos_offset, float theta, double sign) {
    if (B <= 0 || T <= 0 || H <= 0 || D < 2) return;
    int64_t P = D / 2;
    /* inverse frequencies, shared by all t; on allocation failure they are recomputed inline */
    double *freq = malloc((size_t)P * sizeof(double));
    if (freq)
        for (int64_t i = 0; i < P; i++) freq[i] = pow((double)theta, -(double)(2 * i) / (double)D);
    pthread_mutex_lock(&table_lock);
    const float *tab = table_for(T, D, pos_offset, theta, freq);
    #pragma omp parallel for schedule(static) if (B * T * H * D >= ROPE_PAR_MIN && T > 1)
    for (int64_t t = 0; t < T; t++)
        rope_row(io, out, inp, accumulate, B, T, H, D, t, (double)pos_offset + (double)t, freq, (double)theta, sign,
                 tab ? tab + t * P * 2 : NULL);
    pthread_mutex_unlock(&table_lock);
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
