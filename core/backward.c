/* core/backward.c — every backward rule, in one table indexed by op. A rule receives the node
 * (saved tensors, scalars), the gradient of the op's output (contiguous f32) and one gradient
 * buffer per input (contiguous, the input's shape, to ACCUMULATE into; NULL when that input
 * needs no gradient). Plus the two accumulation helpers the rules share. */
#include <stdlib.h>
#include <string.h>
#include "internal.h"

/* ---- accumulation helpers ---- */
/* dst += alpha * src, summing src over the dims where dst is broadcast; src may live on another
 * device (a gradient flowing back through :to()), then it is moved over first */
int uly_sum_to(uly_tensor *dst, const uly_tensor *src, float alpha) {
    if (uly_dev(dst) != uly_dev(src)) {
        uly_tensor *moved = uly_new_contiguous(src->ndim, src->shape, src->dtype, uly_dev(dst));
        int rc = (!moved || uly_copy_raw(moved, src)) ? -1 : uly_sum_to(dst, moved, alpha);
        uly_tensor_release(moved);
        return rc;
    }
    uly_view sv = uly_view_of(src), dv = sv;
    dv.p = uly_ptr(dst);
    for (int d = 0; d < src->ndim; d++) {
        int dd = d - (src->ndim - dst->ndim);
        if (dd >= 0 && dst->shape[dd] != 1 && dst->shape[dd] != src->shape[d])
            return uly_set_error("internal: gradient %s cannot be summed to %s", uly_desc(src), uly_desc(dst));
        dv.stride[d] = (dd >= 0 && dst->shape[dd] != 1) ? dst->stride[dd] : 0;
    }
    uly_be(dst)->sum_view(&dv, &sv, alpha);
    return 0;
}

int uly_add_into(uly_tensor *dst, const uly_tensor *src) { return uly_sum_to(dst, src, 1.0f); }

/* a stack-allocated strided window over a gradient buffer, never reference counted */
static uly_tensor window(const uly_tensor *t, int ndim, const int64_t *shape, const int64_t *stride, int64_t offset) {
    uly_tensor w = *t;
    w.ndim = ndim;
    memcpy(w.shape, shape, sizeof(int64_t) * (size_t)ndim);
    memcpy(w.stride, stride, sizeof(int64_t) * (size_t)ndim);
    w.offset = offset;
    return w;
}

static int64_t numel(const uly_tensor *t) { return uly_tensor_numel(t); }

/* ---- elementwise ---- */
static int bw_add(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)n;
    if (gin[0] && uly_sum_to(gin[0], g, 1.0f)) return -1;
    if (gin[1] && uly_sum_to(gin[1], g, 1.0f)) return -1;
    return 0;
}

static int bw_sub(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)n;
    if (gin[0] && uly_sum_to(gin[0], g, 1.0f)) return -1;
    if (gin[1] && uly_sum_to(gin[1], g, -1.0f)) return -1;
    return 0;
}

/* strides of t aligned to the output shape of g (0 where t is broadcast) */
static void aligned(const uly_tensor *t, const uly_tensor *g, int64_t *st) {
    for (int d = 0; d < g->ndim; d++) {
        int td = d - (g->ndim - t->ndim);
        st[d] = (td >= 0 && t->shape[td] != 1) ? t->stride[td] : 0;
    }
}

/* tmp = g (op1) x, optionally tmp = tmp (op2) y, then gin += alpha * sum_to(tmp) */
static int product_into(uly_tensor *gin, uly_tensor *g, int op1, const uly_tensor *x, int op2, const uly_tensor *y, float alpha) {
    uly_tensor *tmp = uly_new_like(g);
    if (!tmp) return -1;
    int64_t sg[ULY_MAX_DIMS], sx[ULY_MAX_DIMS], sy[ULY_MAX_DIMS];
    aligned(g, g, sg);
    aligned(x, g, sx);
    uly_be(g)->binary_forward(uly_f32(tmp), uly_f32(g), sg, uly_f32(x), sx, g->ndim, g->shape, op1);
    if (y) {
        aligned(y, g, sy);
        uly_be(g)->binary_forward(uly_f32(tmp), uly_f32(tmp), sg, uly_f32(y), sy, g->ndim, g->shape, op2);
    }
    int rc = uly_sum_to(gin, tmp, alpha);
    uly_tensor_release(tmp);
    return rc;
}

static int bw_mul(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *a = n->saved[0], *b = n->saved[1];
    if (gin[0] && product_into(gin[0], g, ULY_BINARY_MUL, b, 0, NULL, 1.0f)) return -1;
    if (gin[1] && product_into(gin[1], g, ULY_BINARY_MUL, a, 0, NULL, 1.0f)) return -1;
    return 0;
}

static int bw_div(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *a = n->saved[0], *b = n->saved[1];
    if (gin[0] && product_into(gin[0], g, ULY_BINARY_DIV, b, 0, NULL, 1.0f)) return -1;
    if (gin[1]) { /* d(a/b)/db = -a / b^2: (g * a / b) / b */
        uly_tensor *tmp = uly_new_like(g);
        if (!tmp) return -1;
        int64_t sg[ULY_MAX_DIMS], sa[ULY_MAX_DIMS], sb[ULY_MAX_DIMS];
        aligned(g, g, sg); aligned(a, g, sa); aligned(b, g, sb);
        uly_be(g)->binary_forward(uly_f32(tmp), uly_f32(g), sg, uly_f32(a), sa, g->ndim, g->shape, ULY_BINARY_MUL);
        uly_be(g)->binary_forward(uly_f32(tmp), uly_f32(tmp), sg, uly_f32(b), sb, g->ndim, g->shape, ULY_BINARY_DIV);
        uly_be(g)->binary_forward(uly_f32(tmp), uly_f32(tmp), sg, uly_f32(b), sb, g->ndim, g->shape, ULY_BINARY_DIV);
        int rc = uly_sum_to(gin[1], tmp, -1.0f);
        uly_tensor_release(tmp);
        if (rc) return -1;
    }
    return 0;
}

static int bw_add_scalar(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)n;
    uly_be(g)->scalar_backward(uly_f32(gin[0]), uly_f32(g), NULL, numel(g), ULY_SCALAR_ADD, 0);
    return 0;
}
static int bw_mul_scalar(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->scalar_backward(uly_f32(gin[0]), uly_f32(g), NULL, numel(g), ULY_SCALAR_MUL, (float)n->f[0]);
    return 0;
}
static int bw_pow_scalar(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->scalar_backward(uly_f32(gin[0]), uly_f32(g), uly_f32(n->saved[0]), numel(g), ULY_SCALAR_POW, (float)n->f[0]);
    return 0;
}

/* ---- matmul: dA += dC B^T, dB += A^T dC (broadcast batch dims accumulate) ---- */
static uly_mat transposed(uly_mat m) {
    int64_t t = m.rs;
    m.rs = m.cs;
    m.cs = t;
    return m;
}

/* in bf16 precision on a backend with bf16 GEMMs: the output gradient rounded once into a bf16
 * copy when both backward GEMMs take it (each would round it again), else NULL */
static uly_tensor *bf16_once(const uly_backend *be, int bf16, uly_tensor *g, int both) {
    if (!bf16 || !be->gemm_batched_bf16 || !both || !uly_tensor_is_contiguous(g)) return NULL;
    uly_tensor *c = uly_new_contiguous(g->ndim, g->shape, ULY_DTYPE_BF16, uly_dev(g));
    if (c && uly_copy_raw(c, g)) { uly_tensor_release(c); c = NULL; }
    return c;
}

static int bw_matmul(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *a = n->saved[0], *b = n->saved[1];
    int nb = g->ndim - 2;
    int64_t M = g->shape[nb], N = g->shape[nb + 1], K = a->shape[a->ndim - 1];
    const uly_backend *be = uly_be(g);
    /* in bf16 matmul precision the output gradient is rounded like the operands were (by the
     * backend's bf16 GEMM, or here into a copy) */
    const int bf16 = n->i[0] != 0;
    const int round_here = bf16 && !be->gemm_batched_bf16 && !uly_gemm_rounds(be);
    uly_tensor *gr = round_here ? uly_bf16_rounded(g) : bf16_once(be, bf16, g, gin[0] && gin[1]);
    if (round_here && !gr) return -1;
    uly_tensor *ra = NULL, *rb = NULL;   /* operands saved unrounded, rounded here (uly_gemm_precision) */
    if (round_here && n->i[0] == 2 &&
        ((gin[1] && !(ra = uly_bf16_rounded(a))) || (gin[0] && !(rb = uly_bf16_rounded(b))))) {
        uly_tensor_release(gr);
        uly_tensor_release(ra);
        return -1;
    }
    uly_mat G = uly_as_mat(gr ? gr : g, nb);
    /* a fresh (uninitialised) gradient buffer is written (beta 0), an existing one added into */
    if (gin[0]) uly_gemm(be, bf16, nb, g->shape, G, transposed(uly_as_mat(rb ? rb : b, nb)), uly_as_mat(gin[0], nb), M,
                         K, N, (n->fresh & 1) ? 0.0f : 1.0f);
    if (gin[1]) uly_gemm(be, bf16, nb, g->shape, transposed(uly_as_mat(ra ? ra : a, nb)), G, uly_as_mat(gin[1], nb), K,
                         N, M, (n->fresh & 2) ? 0.0f : 1.0f);
    uly_tensor_release(gr);
    uly_tensor_release(ra);
    uly_tensor_release(rb);
    return 0;
}

/* addmm: a [M, K] (flattened), w [K, N], bias [N]; g [M, N] */
static int bw_addmm(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *a = n->saved[0], *w = n->saved[1];
    const uly_backend *be = uly_be(g);
    int64_t M = n->i[1], K = w->shape[0], N = w->shape[1];
    /* saved unrounded (uly_gemm_precision 2) on a backend that no longer rounds: rounded here */
    const int round_here = n->i[0] == 2 && !uly_gemm_rounds(be);
    uly_tensor *g16 = round_here ? uly_bf16_rounded(g) : bf16_once(be, (int)n->i[0], g, gin[0] && gin[1]);
    uly_tensor *ra = round_here && gin[1] ? uly_bf16_rounded(a) : NULL, *rw = round_here && gin[0] ? uly_bf16_rounded(w) : NULL;
    if (round_here && (!g16 || (gin[1] && !ra) || (gin[0] && !rw))) {
        uly_tensor_release(g16); uly_tensor_release(ra); uly_tensor_release(rw);
        return -1;
    }
    if (ra) a = ra;
    if (rw) w = rw;
    uly_tensor *gg = g16 ? g16 : g;
    uly_mat G = {.p = (float *)uly_ptr(gg), .rs = N, .cs = 1, .dtype = gg->dtype},
            A = {.p = (float *)uly_ptr(a), .rs = K, .cs = 1, .dtype = a->dtype}, W = uly_as_mat(w, 0);
    if (gin[0]) {
        uly_mat DA = {.p = uly_f32(gin[0]), .rs = K, .cs = 1};
        uly_gemm(be, (int)n->i[0], 0, NULL, G, transposed(W), DA, M, K, N, (n->fresh & 1) ? 0.0f : 1.0f);
    }
    if (gin[1]) uly_gemm(be, (int)n->i[0], 0, NULL, transposed(A), G, uly_as_mat(gin[1], 0), K, N, M, (n->fresh & 2) ? 0.0f : 1.0f);
    uly_tensor_release(g16);
    uly_tensor_release(ra);
    uly_tensor_release(rw);
    if (gin[2] && uly_sum_to(gin[2], g, 1.0f)) return -1;
    return 0;
}

/* ---- reductions, softmax ---- */
static int bw_sum(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->reduce_sum_backward(uly_f32(gin[0]), uly_f32(g), n->i[0], n->i[1], n->i[2], (float)n->f[0]);
    return 0;
}
static int bw_max(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->reduce_max_backward(uly_f32(gin[0]), uly_f32(g), uly_ptr(n->saved[0]), n->i[0], n->i[1], n->i[2]);
    return 0;
}
static int bw_softmax(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->softmax_backward(uly_f32(gin[0]), uly_f32(g), uly_f32(n->saved[0]), n->i[0], n->i[1], n->i[2], n->op == ULY_OP_LOG_SOFTMAX);
    return 0;
}

/* ---- normalisation, activations ---- */
static float *opt_f32(const uly_tensor *t) { return t ? uly_f32(t) : NULL; }

/* a saved input still bf16 here is one the backend reads as bf16 (autograd.c rule_reads_bf16) */
static int bw_layernorm(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *w = n->i[2] ? n->saved[3] : NULL, *x = n->saved[0];
    if (x->dtype == ULY_DTYPE_BF16) {
        if (uly_be(g)->layernorm_backward_bf16(opt_f32(gin[0]), opt_f32(gin[1]), opt_f32(gin[2]), uly_f32(g), uly_ptr(x),
                                               opt_f32(w), uly_f32(n->saved[1]), uly_f32(n->saved[2]), n->i[0], n->i[1]))
            return uly_bf16_kernel_failed("layernorm backward", n->i[1]);
    } else
        uly_be(g)->layernorm_backward(opt_f32(gin[0]), opt_f32(gin[1]), opt_f32(gin[2]), uly_f32(g), uly_f32(x), opt_f32(w),
                                      uly_f32(n->saved[1]), uly_f32(n->saved[2]), n->i[0], n->i[1]);
    return 0;
}
static int bw_rmsnorm(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *w = n->i[2] ? n->saved[2] : NULL, *x = n->saved[0];
    if (x->dtype == ULY_DTYPE_BF16) {
        if (uly_be(g)->rmsnorm_backward_bf16(opt_f32(gin[0]), opt_f32(gin[1]), uly_f32(g), uly_ptr(x), opt_f32(w),
                                             uly_f32(n->saved[1]), n->i[0], n->i[1]))
            return uly_bf16_kernel_failed("rmsnorm backward", n->i[1]);
    } else
        uly_be(g)->rmsnorm_backward(opt_f32(gin[0]), opt_f32(gin[1]), uly_f32(g), uly_f32(x), opt_f32(w),
                                    uly_f32(n->saved[1]), n->i[0], n->i[1]);
    return 0;
}
static int bw_unary(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    if (n->saved[0]->dtype == ULY_DTYPE_BF16)   /* input and output bf16, read by the backend */
        uly_be(g)->unary_backward_bf16(uly_f32(gin[0]), uly_f32(g), uly_ptr(n->saved[0]), uly_ptr(n->saved[1]), numel(g),
                                       (int)n->i[0]);
    else
        uly_be(g)->unary_backward(uly_f32(gin[0]), uly_f32(g), uly_f32(n->saved[0]), uly_f32(n->saved[1]), numel(g),
                                  (int)n->i[0]);
    return 0;
}
static int bw_swiglu(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    if (n->saved[0]->dtype == ULY_DTYPE_BF16)   /* both bf16, read by the backend */
        uly_be(g)->swiglu_backward_bf16(opt_f32(gin[0]), opt_f32(gin[1]), uly_f32(g), uly_ptr(n->saved[0]),
                                        uly_ptr(n->saved[1]), numel(g));
    else
        uly_be(g)->swiglu_backward(opt_f32(gin[0]), opt_f32(gin[1]), uly_f32(g), uly_f32(n->saved[0]), uly_f32(n->saved[1]),
                                   numel(g));
    return 0;
}

/* ---- embedding, rope, dropout, cross-entropy, attention ---- */
static int bw_embedding(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *idx = n->saved[0];
    if (gin[1]) uly_be(g)->embedding_backward(uly_f32(gin[1]), uly_f32(g), uly_ptr(idx), (int)uly_dtype_size(idx->dtype), n->i[0], n->i[1]);
    return 0;
}
static int bw_rope(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->rope_backward(uly_f32(gin[0]), uly_f32(g), n->i[0], n->i[1], n->i[2], n->i[3], n->i[4], (float)n->f[0]);
    return 0;
}
static int bw_dropout(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_be(g)->dropout_backward(uly_f32(gin[0]), uly_f32(g), numel(g), (float)n->f[0], (uint64_t)n->i[0], (uint64_t)n->i[1]);
    return 0;
}
static int bw_cross_entropy(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    if (!gin[0]) return 0;
    uly_tensor *logits = n->saved[0], *targets = n->saved[1], *lse = n->saved[2];
    int64_t rows = n->i[0];
    uly_tensor *dloss = NULL;
    if (n->i[3] == ULY_REDUCTION_NONE) {
        dloss = g;
        g->refcount++;
    } else {
        double gv = 0;
        dloss = uly_new_contiguous(1, &rows, ULY_DTYPE_F32, uly_dev(g));
        if (!dloss || uly_tensor_get_item(g, NULL, &gv) || uly_tensor_fill_(dloss, (double)((float)gv * (float)n->f[0]))) {
            uly_tensor_release(dloss);
            return -1;
        }
    }
    int rc = 0;
    if (logits->dtype == ULY_DTYPE_BF16) {   /* saved in bf16, on a backend that reads it (autograd.c rule_reads_bf16) */
        if (uly_be(g)->cross_entropy_backward_bf16(uly_f32(gin[0]), uly_f32(dloss), uly_ptr(logits), uly_f32(lse),
                                                   uly_ptr(targets), (int)uly_dtype_size(targets->dtype), rows, n->i[1],
                                                   n->i[2]))
            rc = uly_bf16_kernel_failed("cross_entropy backward", n->i[1]);
    } else
        uly_be(g)->cross_entropy_backward(uly_f32(gin[0]), uly_f32(dloss), uly_f32(logits), uly_f32(lse), uly_ptr(targets),
                                          (int)uly_dtype_size(targets->dtype), rows, n->i[1], n->i[2]);
    uly_tensor_release(dloss);
    return rc;
}
static int bw_attention(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    if (uly_be(g)->attention_backward(opt_f32(gin[0]), opt_f32(gin[1]), opt_f32(gin[2]), uly_f32(g), uly_f32(n->saved[0]),
                       uly_f32(n->saved[1]), uly_f32(n->saved[2]), uly_f32(n->saved[3]), n->i[0], n->i[1], n->i[2],
                       n->i[3], n->i[4], n->i[5], (float)n->f[0], (int)n->i[6]))
        return uly_set_error("attention backward: out of memory for the [%lld, %lld, %lld] score-gradient scratch; "
                             "use shorter sequences or fewer heads per rank", (long long)(n->i[3] / n->i[4]),
                             (long long)n->i[1], (long long)n->i[2]);
    return 0;
}

/* ---- views and copies ---- */
static int bw_view(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)n;
    uly_be(g)->axpy_accumulate(uly_f32(gin[0]), uly_f32(g), numel(g), 1.0f); /* both contiguous, same numel */
    return 0;
}
static int bw_permute(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *d = gin[0];
    int64_t shape[ULY_MAX_DIMS], stride[ULY_MAX_DIMS];
    for (int k = 0; k < d->ndim; k++) { shape[k] = d->shape[n->i[k]]; stride[k] = d->stride[n->i[k]]; }
    uly_tensor w = window(d, d->ndim, shape, stride, d->offset);
    return uly_add_into(&w, g);
}
static int bw_narrow(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *d = gin[0];
    int dim = (int)n->i[0];
    int64_t shape[ULY_MAX_DIMS], stride[ULY_MAX_DIMS];
    int k = 0;
    for (int x = 0; x < d->ndim; x++) {
        if (x == dim && n->i[3]) continue;
        shape[k] = x == dim ? n->i[2] : d->shape[x];
        stride[k++] = d->stride[x];
    }
    uly_tensor w = window(d, k, shape, stride, d->offset + n->i[1] * d->stride[dim]);
    return uly_add_into(&w, g);
}
static int bw_expand(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)n;
    return uly_sum_to(gin[0], g, 1.0f);
}
static int bw_copy(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)n;
    return uly_add_into(gin[0], g);
}
static int bw_cat(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    int dim = (int)n->i[0];
    int64_t at = 0;
    for (int k = 0; k < n->n_inputs; k++) {
        int64_t len = n->inputs[k].shape[dim];
        if (gin[k]) {
            int64_t shape[ULY_MAX_DIMS];
            memcpy(shape, g->shape, sizeof shape);
            shape[dim] = len;
            uly_tensor w = window(g, g->ndim, shape, g->stride, g->offset + at * g->stride[dim]);
            if (uly_add_into(gin[k], &w)) return -1;
        }
        at += len;
    }
    return 0;
}

static int bw_none(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    (void)g; (void)gin;
    return uly_set_error("backward: no rule for op %s", uly_op_name(n->op));
}

const uly_backward_fn uly_backward_rules[ULY_OP_COUNT] = {
    [ULY_OP_NONE] = bw_none,
    [ULY_OP_ADD] = bw_add, [ULY_OP_SUB] = bw_sub, [ULY_OP_MUL] = bw_mul, [ULY_OP_DIV] = bw_div,
    [ULY_OP_ADD_SCALAR] = bw_add_scalar, [ULY_OP_MUL_SCALAR] = bw_mul_scalar, [ULY_OP_POW_SCALAR] = bw_pow_scalar,
    [ULY_OP_MATMUL] = bw_matmul, [ULY_OP_SUM] = bw_sum, [ULY_OP_MAX] = bw_max,
    [ULY_OP_SOFTMAX] = bw_softmax, [ULY_OP_LOG_SOFTMAX] = bw_softmax,
    [ULY_OP_LAYERNORM] = bw_layernorm, [ULY_OP_RMSNORM] = bw_rmsnorm, [ULY_OP_UNARY] = bw_unary,
    [ULY_OP_SWIGLU] = bw_swiglu, [ULY_OP_EMBEDDING] = bw_embedding, [ULY_OP_ROPE] = bw_rope,
    [ULY_OP_DROPOUT] = bw_dropout, [ULY_OP_CROSS_ENTROPY] = bw_cross_entropy, [ULY_OP_ATTENTION] = bw_attention,
    [ULY_OP_CUSTOM] = uly_bw_custom, [ULY_OP_ULYSSES_QKV] = uly_bw_ulysses_qkv, [ULY_OP_ULYSSES_OUT] = uly_bw_ulysses_out,
    [ULY_OP_VIEW] = bw_view, [ULY_OP_PERMUTE] = bw_permute, [ULY_OP_NARROW] = bw_narrow,
    [ULY_OP_EXPAND] = bw_expand, [ULY_OP_COPY] = bw_copy, [ULY_OP_CAT] = bw_cat,
    [ULY_OP_FLASH_ATTENTION] = uly_bw_flash_attention, [ULY_OP_ADDMM] = bw_addmm,
};
