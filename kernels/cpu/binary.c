/* kernels/cpu/binary.c — elementwise a (op) b with broadcasting through strides, tensor-scalar
 * ops (add, mul, pow) and their backward, and y += alpha x. out is contiguous; backward
 * kernels accumulate (+=). Parallel over rows of the last dimension. */
#include <math.h>
#include "kernels.h"

#define PAR_MIN 32768

static inline float apply(float x, float y, int kind) {
    switch (kind) {
    case ULY_BINARY_ADD: return x + y;
    case ULY_BINARY_SUB: return x - y;
    case ULY_BINARY_MUL: return x * y;
    default: return x / y;
    }
}

static int is_contig(int ndim, const int64_t *shape, const int64_t *st) {
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && st[d] != s) return 0;
        s *= shape[d];
    }
    return 1;
}

void binary_forward(float *out, const float *a, const int64_t *sa, const float *b, const int64_t *sb,
                    int ndim, const int64_t *shape, int kind) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    if (n == 0) return;
    if (is_contig(ndim, shape, sa) && is_contig(ndim, shape, sb)) {
#define LOOP(EXPR) _Pragma("omp parallel for simd if (n > PAR_MIN)") for (int64_t i = 0; i < n; i++) out[i] = EXPR;
        switch (kind) {
        case ULY_BINARY_ADD: LOOP(a[i] + b[i]) break;
        case ULY_BINARY_SUB: LOOP(a[i] - b[i]) break;
        case ULY_BINARY_MUL: LOOP(a[i] * b[i]) break;
        default: LOOP(a[i] / b[i]) break;
        }
#undef LOOP
        return;
    }
    int64_t inner = ndim ? shape[ndim - 1] : 1, rows = n / inner;
    int64_t ia = ndim ? sa[ndim - 1] : 0, ib = ndim ? sb[ndim - 1] : 0;
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        int64_t rem = r, oa = 0, ob = 0;
        for (int d = ndim - 2; d >= 0; d--) {
            int64_t i = rem % shape[d];
            rem /= shape[d];
            oa += i * sa[d];
            ob += i * sb[d];
        }
        const float *pa = a + oa, *pb = b + ob;
        float *po = out + r * inner;
        if (ia == 1 && ib == 0) {
            float y = pb[0];
            for (int64_t j = 0; j < inner; j++) po[j] = apply(pa[j], y, kind);
        } else if (ia == 1 && ib == 1) {
            for (int64_t j = 0; j < inner; j++) po[j] = apply(pa[j], pb[j], kind);
        } else {
            for (int64_t j = 0; j < inner; j++) po[j] = apply(pa[j * ia], pb[j * ib], kind);
        }
    }
}

void scalar_forward(float *out, const float *a, int64_t n, int kind, float s) {
    if (kind == ULY_SCALAR_ADD) {
#pragma omp parallel for simd if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = a[i] + s;
    } else if (kind == ULY_SCALAR_MUL) {
#pragma omp parallel for simd if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = a[i] * s;
    } else if (s == 2.0f) {
#pragma omp parallel for simd if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = a[i] * a[i];
    } else {
#pragma omp parallel for if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = powf(a[i], s);
    }
}

void scalar_backward(float *dinp, const float *dout, const float *a, int64_t n, int kind, float s) {
    if (kind == ULY_SCALAR_ADD) {
        axpy_accumulate(dinp, dout, n, 1.0f);
    } else if (kind == ULY_SCALAR_MUL) {
        axpy_accumulate(dinp, dout, n, s);
    } else if (s != 0.0f) {   /* x^0 is 1 everywhere: no gradient (0 * 0^-1 would be NaN at 0) */
#pragma omp parallel for if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) dinp[i] += dout[i] * s * powf(a[i], s - 1.0f);
    }
}

void axpy_accumulate(float *y, const float *x, int64_t n, float alpha) {
    if (alpha == 1.0f) {
#pragma omp parallel for simd if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) y[i] += x[i];
    } else {
#pragma omp parallel for simd if (n > PAR_MIN)
        for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
    }
}
