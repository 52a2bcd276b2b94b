/* core/ops.c — the forward half of every compute op: validate arguments (errors name the op,
 * shapes and dtypes), allocate the result, call the CPU kernel and record the autograd node.
 * The backward rules are in backward.c, the view ops in view.c. */
#include <math.h>
#include <string.h>
#include "internal.h"
#include "../kernels/cpu/kernels.h"

/* ---- elementwise binary ops with broadcasting ---- */
static int broadcast(const char *op, const uly_tensor *a, const uly_tensor *b, int *ndim, int64_t *shape,
                     int64_t *sa, int64_t *sb) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int d = 0; d < nd; d++) {
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        int64_t xa = da >= 0 ? a->shape[da] : 1, xb = db >= 0 ? b->shape[db] : 1;
        if (xa != xb && xa != 1 && xb != 1)
            return uly_set_error("%s: shapes %s and %s cannot be broadcast (dimension %d of the aligned shapes: "
                                 "%lld vs %lld)", op, uly_desc(a), uly_desc(b), d + 1, (long long)xa, (long long)xb);
        shape[d] = xa == 1 ? xb : xa;
        sa[d] = (da >= 0 && xa != 1) ? a->stride[da] : 0;
        sb[d] = (db >= 0 && xb != 1) ? b->stride[db] : 0;
    }
    *ndim = nd;
    return 0;
}

/* bf16 operands: the backend's typed kernel reads them as they are, or they are read through f32
 * copies (of their own shape: broadcasting needs no more); the result's dtype is uly_result_dtype's */
static uly_tensor *binary_op(const char *op, int kind, int node_op, uly_tensor *a, uly_tensor *b) {
    if (uly_check_floating(op, "a", a) || uly_check_floating(op, "b", b) || uly_check_same_device(op, "a", a, "b", b))
        return NULL;
    int nd = 0;
    int64_t shape[ULY_MAX_DIMS], sa[ULY_MAX_DIMS], sb[ULY_MAX_DIMS];
    const uly_backend *be = uly_be(a);
    if ((a->dtype == ULY_DTYPE_BF16 || b->dtype == ULY_DTYPE_BF16) && be->binary_forward_typed) {
        /* the backend reads and writes bf16 itself */
        if (broadcast(op, a, b, &nd, shape, sa, sb)) return NULL;
        uly_tensor *out = uly_new_contiguous(nd, shape, uly_result_dtype(a, b), uly_dev(a));
        if (!out) return NULL;
        be->binary_forward_typed(uly_ptr(out), out->dtype, uly_ptr(a), a->dtype, sa, uly_ptr(b), b->dtype, sb, nd, shape,
                                 kind);
        uly_tensor *in[2] = {a, b};
        uly_node *n = uly_node_begin(node_op, 2, in);
        if (n && (kind == ULY_BINARY_MUL || kind == ULY_BINARY_DIV)) { uly_node_save(n, a); uly_node_save(n, b); }
        uly_node_attach(n, out);
        return out;
    }
    uly_tensor *af = a->dtype == ULY_DTYPE_F32 ? (uly_tensor_retain(a), a) : uly_contiguous_f32(a);
    uly_tensor *bf = !af ? NULL : b->dtype == ULY_DTYPE_F32 ? (uly_tensor_retain(b), b) : uly_contiguous_f32(b);
    uly_tensor *out = NULL;
    if (bf && !broadcast(op, af, bf, &nd, shape, sa, sb)) out = uly_new_contiguous(nd, shape, ULY_DTYPE_F32, uly_dev(a));
    if (out) {
        uly_be(out)->binary_forward(uly_f32(out), uly_f32(af), sa, uly_f32(bf), sb, nd, shape, kind);
        if (!uly_result_as(&out, uly_result_dtype(a, b))) {
            uly_tensor *in[2] = {a, b};
            uly_node *n = uly_node_begin(node_op, 2, in);
            if (n && (kind == ULY_BINARY_MUL || kind == ULY_BINARY_DIV)) { uly_node_save(n, a); uly_node_save(n, b); }
            uly_node_attach(n, out);
        }
    }
    uly_tensor_release(af);
    uly_tensor_release(bf);
    return out;
}

uly_tensor *uly_add(uly_tensor *a, uly_tensor *b) { return binary_op("add", ULY_BINARY_ADD, ULY_OP_ADD, a, b); }
uly_tensor *uly_sub(uly_tensor *a, uly_tensor *b) { return binary_op("sub", ULY_BINARY_SUB, ULY_OP_SUB, a, b); }
uly_tensor *uly_mul(uly_tensor *a, uly_tensor *b) { return binary_op("mul", ULY_BINARY_MUL, ULY_OP_MUL, a, b); }
uly_tensor *uly_div(uly_tensor *a, uly_tensor *b) { return binary_op("div", ULY_BINARY_DIV, ULY_OP_DIV, a, b); }

/* ---- tensor-scalar ops ---- */
static uly_tensor *scalar_op(const char *op, int kind, int node_op, uly_tensor *a, double s) {
    if (uly_check_floating(op, "a", a)) return NULL;
    uly_tensor *ac = uly_contiguous_f32(a);
    if (!ac) return NULL;
    uly_tensor *out = uly_new_like(ac);
    if (out) uly_be(out)->scalar_forward(uly_f32(out), uly_f32(ac), uly_tensor_numel(ac), kind, (float)s);
    if (!uly_result_as(&out, a->dtype)) {
        uly_node *n = uly_node_begin(node_op, 1, &a);
        if (n) {
            n->f[0] = s;
            if (kind == ULY_SCALAR_POW) {
                uly_tensor *keep = uly_saved_form(a, ac);
                uly_node_save(n, keep);
                uly_tensor_release(keep);
            }
        }
        uly_node_attach(n, out);
    }
    uly_tensor_release(ac);
    return out;
}

uly_tensor *uly_add_scalar(uly_tensor *a, double s) { return scalar_op("add_scalar", ULY_SCALAR_ADD, ULY_OP_ADD_SCALAR, a, s); }
uly_tensor *uly_mul_scalar(uly_tensor *a, double s) { return scalar_op("mul_scalar", ULY_SCALAR_MUL, ULY_OP_MUL_SCALAR, a, s); }
uly_tensor *uly_pow_scalar(uly_tensor *a, double e) { return scalar_op("pow", ULY_SCALAR_POW, ULY_OP_POW_SCALAR, a, e); }

/* ---- matmul ---- */
static int matmul_bf16, activation_bf16;
int uly_set_matmul_bf16(int on) { int prev = matmul_bf16; matmul_bf16 = on != 0; return prev; }
int uly_matmul_bf16(void) { return matmul_bf16; }
int uly_set_activation_bf16(int on) { int prev = activation_bf16; activation_bf16 = on != 0; return prev; }
int uly_activation_bf16(void) { return activation_bf16; }

/* a contiguous f32 copy of t with every value rounded to bf16 (round to nearest even) */
uly_tensor *uly_bf16_rounded(const uly_tensor *t) {
    uly_tensor *h = uly_new_contiguous(t->ndim, t->shape, ULY_DTYPE_BF16, uly_dev(t));
    uly_tensor *out = h ? uly_new_contiguous(t->ndim, t->shape, ULY_DTYPE_F32, uly_dev(t)) : NULL;
    if (out && (uly_copy_raw(h, t) || uly_copy_raw(out, h))) { uly_tensor_release(out); out = NULL; }
    uly_tensor_release(h);
    return out;
}

/* does the backend round bf16-precision GEMM operands itself (the CPU's AMX GEMM)? */
int uly_gemm_rounds(const uly_backend *be) {
    return !be->gemm_batched_bf16 && be->gemm_rounds_operands && be->gemm_rounds_operands();
}

/* what a matmul node records of its precision: 0 f32, 1 bf16, 2 bf16 with its operands saved
 * unrounded (the backend rounded them: a backward where it no longer does rounds them itself) */
int uly_gemm_precision(const uly_backend *be) { return matmul_bf16 ? (uly_gemm_rounds(be) ? 2 : 1) : 0; }

/* a GEMM in the current matmul precision; with bf16 and a backend without native bf16 GEMMs the
 * caller has already rounded A and B, unless the backend rounds them itself (uly_gemm_rounds) */
void uly_gemm(const uly_backend *be, int bf16, int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M,
              int64_t N, int64_t K, float beta) {
    if (bf16 && be->gemm_batched_bf16) be->gemm_batched_bf16(nb, bshape, A, B, C, M, N, K, beta);
    else if (bf16 && be->gemm_batched_rounded) be->gemm_batched_rounded(nb, bshape, A, B, C, M, N, K, beta);
    else be->gemm_batched(nb, bshape, A, B, C, M, N, K, beta);
}
/* describe the last two dims of t as a matrix, batch dims aligned right to nb dims */
uly_mat uly_as_mat(const uly_tensor *t, int nb) {
    uly_mat m = {.p = (float *)uly_ptr(t), .rs = t->stride[t->ndim - 2], .cs = t->stride[t->ndim - 1], .dtype = t->dtype};
    int tb = t->ndim - 2;
    for (int d = 0; d < nb; d++) {
        int td = d - (nb - tb);
        m.bstride[d] = (td >= 0 && t->shape[td] != 1) ? t->stride[td] : 0;
    }
    return m;
}

/* a GEMM operand [rows, cols] (last two dims of t) as the backend multiplies it: t itself where its
 * strides suit, else a contiguous copy; f32 unless the backend takes bf16 operands (bf16 precision
 * on a backend with bf16 GEMMs); rounded to bf16 where the precision asks and the backend cannot */
static uly_tensor *gemm_operand(const uly_backend *be, uly_tensor *t, int64_t rows, int64_t cols) {
    const int native = matmul_bf16 && be->gemm_batched_bf16;
    if (t->dtype == ULY_DTYPE_BF16 && !native) return uly_contiguous_f32(t);   /* exact: already bf16 values */
    if (matmul_bf16 && !native && !uly_gemm_rounds(be)) return uly_bf16_rounded(t);
    if (be->gemm_operand_ok(rows, cols, t->stride[t->ndim - 2], t->stride[t->ndim - 1])) { t->refcount++; return t; }
    return uly_contiguous_raw(t);
}

/* what a matmul saves of operand t (used as op): bf16 t as bf16 (the engine hands backward an f32
 * copy where the backend needs one), else the operand itself */
static uly_tensor *gemm_saved(const uly_backend *be, uly_tensor *t, uly_tensor *op, int64_t rows, int64_t cols) {
    if (t->dtype != ULY_DTYPE_BF16 || op->dtype == ULY_DTYPE_BF16) { op->refcount++; return op; }
    if (be->gemm_operand_ok(rows, cols, t->stride[t->ndim - 2], t->stride[t->ndim - 1])) { t->refcount++; return t; }
    return uly_contiguous_raw(t);
}

static uly_tensor *matmul_as(uly_tensor *a, uly_tensor *b, int out_dtype);

/* the result in a's dtype: bf16 activations stay bf16 (weights may be f32) */
uly_tensor *uly_matmul(uly_tensor *a, uly_tensor *b) {
    return uly_check_tensor("matmul", "a", a) ? NULL : matmul_as(a, b, a->dtype);
}

static uly_tensor *matmul_as(uly_tensor *a, uly_tensor *b, int out_dtype) {
    if (uly_check_floating("matmul", "a", a) || uly_check_floating("matmul", "b", b) ||
        uly_check_same_device("matmul", "a", a, "b", b))
        return NULL;
    if (a->ndim < 2 || b->ndim < 2)
        return uly_set_error_null("matmul: both operands need at least 2 dimensions, got %s @ %s; "
                                  "use :view(1, n) or :view(n, 1) for vectors", uly_desc(a), uly_desc(b));
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    if (b->shape[b->ndim - 2] != K)
        return uly_set_error_null("matmul: inner dimensions differ: %s @ %s (%lld vs %lld)", uly_desc(a), uly_desc(b),
                                  (long long)K, (long long)b->shape[b->ndim - 2]);
    /* [..., M, K] @ [K, N] with contiguous a: one GEMM over all rows (through views, so autograd sees it) */
    if (b->ndim == 2 && a->ndim > 2 && uly_tensor_is_contiguous(a)) {
        int64_t flat[2] = {uly_tensor_numel(a) / (K ? K : 1), K};
        if (K == 0) flat[0] = uly_numel_of(a->ndim - 1, a->shape);
        uly_tensor *a2 = uly_tensor_view(a, 2, flat);
        uly_tensor *o2 = a2 ? matmul_as(a2, b, out_dtype) : NULL;
        uly_tensor_release(a2);
        if (!o2) return NULL;
        int64_t oshape[ULY_MAX_DIMS];
        memcpy(oshape, a->shape, sizeof oshape);
        oshape[a->ndim - 1] = N;
        uly_tensor *out = uly_tensor_view(o2, a->ndim, oshape);
        uly_tensor_release(o2);
        return out;
    }
    int nb = (a->ndim > b->ndim ? a->ndim : b->ndim) - 2;
    int64_t shape[ULY_MAX_DIMS];
    for (int d = 0; d < nb; d++) {
        int da = d - (nb - (a->ndim - 2)), db = d - (nb - (b->ndim - 2));
        int64_t xa = da >= 0 ? a->shape[da] : 1, xb = db >= 0 ? b->shape[db] : 1;
        if (xa != xb && xa != 1 && xb != 1)
            return uly_set_error_null("matmul: batch dimensions of %s and %s cannot be broadcast", uly_desc(a), uly_desc(b));
        shape[d] = xa == 1 ? xb : xa;
    }
    shape[nb] = M;
    shape[nb + 1] = N;
    const uly_backend *be = uly_be(a);
    uly_tensor *ac = gemm_operand(be, a, M, K), *bc = ac ? gemm_operand(be, b, K, N) : NULL;
    /* a bf16 result straight from a backend's bf16 GEMM (cuBLASLt rounds its f32 accumulators) */
    const int direct16 = out_dtype == ULY_DTYPE_BF16 && matmul_bf16 && be->gemm_batched_bf16 && K > 0;
    uly_tensor *out = (ac && bc) ? uly_new_contiguous(nb + 2, shape, direct16 ? ULY_DTYPE_BF16 : ULY_DTYPE_F32, uly_dev(a))
                                 : NULL;
    if (out) uly_gemm(be, matmul_bf16, nb, shape, uly_as_mat(ac, nb), uly_as_mat(bc, nb), uly_as_mat(out, nb), M, N, K, 0.0f);
    if (!uly_result_as(&out, out_dtype)) {
        uly_tensor *in[2] = {a, b};
        uly_node *n = uly_node_begin(ULY_OP_MATMUL, 2, in);
        if (n) {
            uly_tensor *sa = gemm_saved(be, a, ac, M, K), *sb = sa ? gemm_saved(be, b, bc, K, N) : NULL;
            uly_node_save(n, sa);
            uly_node_save(n, sb);
            n->i[0] = uly_gemm_precision(be);  /* the backward GEMMs use the forward's precision */
            if (!sb) { uly_node_release(n); n = NULL; uly_tensor_release(out); out = NULL; }
            uly_tensor_release(sa);
            uly_tensor_release(sb);
        }
        uly_node_attach(n, out);
    }
    uly_tensor_release(ac);
    uly_tensor_release(bc);
    return out;
}

/* ---- addmm: a Linear layer in one op ---- */
uly_tensor *uly_addmm(uly_tensor *a, uly_tensor *w, uly_tensor *bias) {
    const char *op = "addmm";
    if (uly_check_floating(op, "a", a) || uly_check_floating(op, "w", w) || uly_check_floating(op, "bias", bias) ||
        uly_check_same_device(op, "a", a, "w", w) || uly_check_same_device(op, "a", a, "bias", bias))
        return NULL;
    if (w->ndim != 2 || a->ndim < 1 || a->shape[a->ndim - 1] != w->shape[0] || bias->ndim != 1 ||
        bias->shape[0] != w->shape[1])
        return uly_set_error_null("addmm: needs a [..., K] @ w [K, N] + bias [N], got %s @ %s + %s", uly_desc(a),
                                  uly_desc(w), uly_desc(bias));
    const uly_backend *be = uly_be(a);
    int64_t K = w->shape[0], N = w->shape[1], M = K ? uly_tensor_numel(a) / K : uly_numel_of(a->ndim - 1, a->shape);
    const int round_here = matmul_bf16 && !be->gemm_batched_bf16 && !uly_gemm_rounds(be);
    const int native = matmul_bf16 && be->gemm_batched_bf16;   /* the backend multiplies bf16 operands as they are */
    if (a->ndim < 2 || !uly_tensor_is_contiguous(a) || round_here || bias->dtype != ULY_DTYPE_F32 ||
        ((a->dtype == ULY_DTYPE_BF16 || w->dtype == ULY_DTYPE_BF16) && !native)) { /* the general path: two ops */
        uly_tensor *t = matmul_as(a, w, ULY_DTYPE_F32);   /* rounded once, after the bias */
        uly_tensor *out = t ? uly_add(t, bias) : NULL;
        uly_tensor_release(t);
        if (out && a->dtype == ULY_DTYPE_BF16 && out->dtype != ULY_DTYPE_BF16) {
            uly_tensor *o16 = uly_tensor_to_dtype(out, ULY_DTYPE_BF16);
            uly_tensor_release(out);
            out = o16;
        }
        return out;
    }
    uly_tensor *wc = be->gemm_operand_ok(K, N, w->stride[0], w->stride[1]) ? (w->refcount++, w) : uly_contiguous_raw(w);
    int64_t oshape[ULY_MAX_DIMS];
    memcpy(oshape, a->shape, sizeof oshape);
    oshape[a->ndim - 1] = N;
    uly_mat A = {.p = (float *)uly_ptr(a), .rs = K, .cs = 1, .dtype = a->dtype}, W = wc ? uly_as_mat(wc, 0) : (uly_mat){0};
    const int bias_here = be->gemm_bias && K > 0 && (N <= 1 || bias->stride[0] == 1);
    uly_tensor *out = NULL;
    if (wc && bias_here && a->dtype == ULY_DTYPE_BF16) {   /* bf16 activations: a bf16 result straight from the GEMM */
        out = uly_new_contiguous(a->ndim, oshape, ULY_DTYPE_BF16, uly_dev(a));
        uly_mat O = {.p = out ? (float *)uly_ptr(out) : NULL, .rs = N, .cs = 1, .dtype = ULY_DTYPE_BF16};
        if (out && be->gemm_bias(A, W, O, M, N, K, uly_f32(bias), matmul_bf16)) { uly_tensor_release(out); out = NULL; }
    }
    if (!out && wc && (out = uly_new_contiguous(a->ndim, oshape, ULY_DTYPE_F32, uly_dev(a)))) {
        uly_mat O = {.p = uly_f32(out), .rs = N, .cs = 1};
        /* the backend's GEMM adds the bias (cuBLASLt's epilogue); else every row of out = bias, then out += a w */
        if (!bias_here || be->gemm_bias(A, W, O, M, N, K, uly_f32(bias), matmul_bf16)) {
            uly_view dv = {.p = uly_f32(out), .dtype = ULY_DTYPE_F32, .ndim = 2, .shape = {M, N}, .stride = {N, 1}};
            uly_view sv = {.p = uly_f32(bias), .dtype = ULY_DTYPE_F32, .ndim = 2, .shape = {M, N},
                           .stride = {0, bias->stride[0]}};
            be->copy_view(&dv, &sv);
            uly_gemm(be, matmul_bf16, 0, NULL, A, W, O, M, N, K, 1.0f);
        }
    }
    if (!uly_result_as(&out, a->dtype)) {   /* bf16 activations stay bf16 */
        uly_tensor *in[3] = {a, w, bias};
        uly_node *n = uly_node_begin(ULY_OP_ADDMM, 3, in);
        if (n) {
            uly_node_save(n, a);
            uly_node_save(n, wc);
            n->i[0] = uly_gemm_precision(be);
            n->i[1] = M;
        }
        uly_node_attach(n, out);
    }
    uly_tensor_release(wc);
    return out;
}

/* ---- reductions ---- */
static int split_dim(const char *op, const uly_tensor *t, int dim, int64_t *outer, int64_t *n, int64_t *inner) {
    if (dim < 0 || dim >= t->ndim)
        return uly_set_error("%s: dimension %d is out of range for %s (%d dimensions)", op, dim + 1, uly_desc(t), t->ndim);
    *outer = uly_numel_of(dim, t->shape);
    *n = t->shape[dim];
    *inner = uly_numel_of(t->ndim - dim - 1, t->shape + dim + 1);
    return 0;
}

static void reduced_shape(const uly_tensor *t, int dim, int keepdim, int *ndim, int64_t *shape) {
    int k = 0;
    for (int d = 0; d < t->ndim; d++) {
        if (d != dim) shape[k++] = t->shape[d];
        else if (keepdim) shape[k++] = 1;
    }
    *ndim = k;
}

/* dim = -1: over everything (result 0-d) */
static uly_tensor *reduce(const char *op, uly_tensor *t, int dim, int keepdim, int mean, int is_max, uly_tensor **indices) {
    if (indices) *indices = NULL;
    if (uly_check_floating(op, "input", t)) return NULL;
    int64_t outer = 1, n = uly_tensor_numel(t), inner = 1, shape[ULY_MAX_DIMS];
    int nd = 0;
    if (dim >= 0 || t->ndim == 0) {
        if (t->ndim == 0) dim = -1;
        else {
            if (split_dim(op, t, dim, &outer, &n, &inner)) return NULL;
            reduced_shape(t, dim, keepdim, &nd, shape);
        }
    }
    if (is_max && n == 0)
        return uly_set_error_null("%s: cannot take the max over an empty dimension of %s", op, uly_desc(t));
    uly_tensor *tc = uly_contiguous_f32(t);
    if (!tc) return NULL;
    uly_tensor *out = uly_new_contiguous(nd, shape, ULY_DTYPE_F32, uly_dev(t)), *arg = NULL;
    float scale = mean ? (n ? 1.0f / (float)n : NAN) : 1.0f;
    if (out && is_max) {
        arg = uly_new_contiguous(nd, shape, ULY_DTYPE_I64, uly_dev(t));
        if (arg) uly_be(t)->reduce_max_forward(uly_f32(out), uly_ptr(arg), uly_f32(tc), outer, n, inner);
        else { uly_tensor_release(out); out = NULL; }
    } else if (out) {
        uly_be(t)->reduce_sum_forward(uly_f32(out), uly_f32(tc), outer, n, inner, scale);
    }
    if (out && !uly_result_as(&out, t->dtype)) {   /* summed in f32, given in t's dtype */
        uly_node *node = uly_node_begin(is_max ? ULY_OP_MAX : ULY_OP_SUM, 1, &t);
        if (node) {
            node->i[0] = outer; node->i[1] = n; node->i[2] = inner;
            node->f[0] = scale;
            if (is_max) uly_node_save(node, arg);
        }
        uly_node_attach(node, out);
        if (indices && arg) {
            /* indices count along the reduced dimension; for a full reduction, the flat position.
             * A copy: arg is saved for backward and must not be changed by the caller. */
            *indices = uly_tensor_clone(arg);
            if (!*indices) { uly_tensor_release(out); out = NULL; }
        }
    }
    uly_tensor_release(arg);
    uly_tensor_release(tc);
    return out;
}

uly_tensor *uly_sum(uly_tensor *t, int dim, int keepdim) {
    if (dim < 0) return uly_set_error_null("sum: dimension %d is out of range", dim + 1);
    return reduce("sum", t, dim, keepdim, 0, 0, NULL);
}
uly_tensor *uly_sum_all(uly_tensor *t) { return reduce("sum", t, -1, 0, 0, 0, NULL); }
uly_tensor *uly_mean(uly_tensor *t, int dim, int keepdim) {
    if (dim < 0) return uly_set_error_null("mean: dimension %d is out of range", dim + 1);
    return reduce("mean", t, dim, keepdim, 1, 0, NULL);
}
uly_tensor *uly_mean_all(uly_tensor *t) { return reduce("mean", t, -1, 0, 1, 0, NULL); }
uly_tensor *uly_max(uly_tensor *t, int dim, int keepdim, uly_tensor **indices) {
    if (dim < 0) return uly_set_error_null("max: dimension %d is out of range", dim + 1);
    return reduce("max", t, dim, keepdim, 0, 1, indices);
}
uly_tensor *uly_max_all(uly_tensor *t) { return reduce("max", t, -1, 0, 0, 1, NULL); }

/* save an op's own result for its backward through a second handle on the same storage (same
 * version counter): saving `out` itself makes out -> node -> out a cycle that is never freed.
 * On failure (no memory for a handle) the node and out are released and out is set to NULL. */
static void save_output(uly_node *n, uly_tensor **out) {
    if (!n) return;
    uly_tensor *o = *out, *alias = uly_new_view(o, o->ndim, o->shape, o->stride, o->offset);
    if (!alias) { uly_node_release(n); uly_tensor_release(o); *out = NULL; return; }
    uly_node_save(n, alias);
    uly_tensor_release(alias);
}

/* ---- softmax ---- */
static uly_tensor *softmax_op(const char *op, uly_tensor *t, int dim, int is_log) {
    if (uly_check_floating(op, "input", t)) return NULL;
    int64_t outer = 0, n = 0, inner = 0;
    if (split_dim(op, t, dim, &outer, &n, &inner)) return NULL;
    uly_tensor *tc = uly_contiguous_f32(t);
    uly_tensor *out = tc ? uly_new_like(tc) : NULL;
    if (out) uly_be(t)->softmax_forward(uly_f32(out), uly_f32(tc), outer, n, inner, is_log);
    if (!uly_result_as(&out, t->dtype)) {
        uly_node *node = uly_node_begin(is_log ? ULY_OP_LOG_SOFTMAX : ULY_OP_SOFTMAX, 1, &t);
        if (node) { node->i[0] = outer; node->i[1] = n; node->i[2] = inner; }
        save_output(node, &out);
        if (out) uly_node_attach(node, out);
    }
    uly_tensor_release(tc);
    return out;
}
uly_tensor *uly_softmax(uly_tensor *t, int dim) { return softmax_op("softmax", t, dim, 0); }
uly_tensor *uly_log_softmax(uly_tensor *t, int dim) { return softmax_op("log_softmax", t, dim, 1); }

/* ---- normalisation ---- */
static int check_norm_param(const char *op, const char *arg, const uly_tensor *p, int64_t C) {
    if (!p) return 0;
    if (uly_check_floating(op, arg, p)) return -1;
    if (p->ndim != 1 || p->shape[0] != C)
        return uly_set_error("%s: '%s' is %s but the normalised (last) dimension has size %lld", op, arg, uly_desc(p),
                             (long long)C);
    return 0;
}

uly_tensor *uly_layernorm(uly_tensor *x, uly_tensor *w, uly_tensor *b, double eps) {
    if (uly_check_floating("layernorm", "x", x)) return NULL;
    if (x->ndim < 1) return uly_set_error_null("layernorm: input %s needs at least one dimension", uly_desc(x));
    int64_t C = x->shape[x->ndim - 1], rows = C ? uly_tensor_numel(x) / C : 0;
    if (check_norm_param("layernorm", "weight", w, C) || check_norm_param("layernorm", "bias", b, C) ||
        uly_check_same_device("layernorm", "x", x, "weight", w) || uly_check_same_device("layernorm", "x", x, "bias", b))
        return NULL;
    const uly_backend *be = uly_be(x);
    const int native = x->dtype == ULY_DTYPE_BF16 && be->layernorm_forward_bf16;   /* reads and writes bf16 itself */
    uly_tensor *xc = native ? uly_contiguous_raw(x) : uly_contiguous_f32(x);
    uly_tensor *wc = w ? uly_contiguous_f32(w) : NULL, *bc = b ? uly_contiguous_f32(b) : NULL;
    uly_tensor *out = xc ? uly_new_like(xc) : NULL, *xs = xc ? uly_saved_form(x, xc) : NULL;
    uly_tensor *mean = uly_new_contiguous(1, &rows, ULY_DTYPE_F32, uly_dev(x)), *rstd = uly_new_contiguous(1, &rows, ULY_DTYPE_F32, uly_dev(x));
    if (xc && xs && out && mean && rstd && (!w || wc) && (!b || bc) && native &&
        be->layernorm_forward_bf16(uly_ptr(out), uly_f32(mean), uly_f32(rstd), uly_ptr(xc), wc ? uly_f32(wc) : NULL,
                                   bc ? uly_f32(bc) : NULL, rows, C, (float)eps)) {
        uly_bf16_kernel_failed("layernorm", C);
        uly_tensor_release(out); out = NULL;
    } else if (xc && xs && out && mean && rstd && (!w || wc) && (!b || bc)) {
        if (!native)
            be->layernorm_forward(uly_f32(out), uly_f32(mean), uly_f32(rstd), uly_f32(xc), wc ? uly_f32(wc) : NULL,
                                  bc ? uly_f32(bc) : NULL, rows, C, (float)eps);
        uly_tensor *in[3] = {x, w, b};
        uly_node *n = !uly_result_as(&out, x->dtype) ? uly_node_begin(ULY_OP_LAYERNORM, 3, in) : NULL;
        if (n) {
            uly_node_save(n, xs); uly_node_save(n, mean); uly_node_save(n, rstd);
            if (wc) uly_node_save(n, wc);
            n->i[0] = rows; n->i[1] = C; n->i[2] = wc != NULL;
        }
        uly_node_attach(n, out);
    } else { uly_tensor_release(out); out = NULL; }
    uly_tensor_release(xc); uly_tensor_release(xs); uly_tensor_release(wc); uly_tensor_release(bc);
    uly_tensor_release(mean); uly_tensor_release(rstd);
    return out;
}

uly_tensor *uly_rmsnorm(uly_tensor *x, uly_tensor *w, double eps) {
    if (uly_check_floating("rmsnorm", "x", x)) return NULL;
    if (x->ndim < 1) return uly_set_error_null("rmsnorm: input %s needs at least one dimension", uly_desc(x));
    int64_t C = x->shape[x->ndim - 1], rows = C ? uly_tensor_numel(x) / C : 0;
    if (check_norm_param("rmsnorm", "weight", w, C) || uly_check_same_device("rmsnorm", "x", x, "weight", w)) return NULL;
    const uly_backend *be = uly_be(x);
    const int native = x->dtype == ULY_DTYPE_BF16 && be->rmsnorm_forward_bf16;   /* reads and writes bf16 itself */
    uly_tensor *xc = native ? uly_contiguous_raw(x) : uly_contiguous_f32(x), *wc = w ? uly_contiguous_f32(w) : NULL;
    uly_tensor *out = xc ? uly_new_like(xc) : NULL, *rstd = uly_new_contiguous(1, &rows, ULY_DTYPE_F32, uly_dev(x));
    uly_tensor *xs = xc ? uly_saved_form(x, xc) : NULL;
    if (xc && xs && out && rstd && (!w || wc) && native &&
        be->rmsnorm_forward_bf16(uly_ptr(out), uly_f32(rstd), uly_ptr(xc), wc ? uly_f32(wc) : NULL, rows, C, (float)eps)) {
        uly_bf16_kernel_failed("rmsnorm", C);
        uly_tensor_release(out); out = NULL;
    } else if (xc && xs && out && rstd && (!w || wc)) {
        if (!native) be->rmsnorm_forward(uly_f32(out), uly_f32(rstd), uly_f32(xc), wc ? uly_f32(wc) : NULL, rows, C, (float)eps);
        uly_tensor *in[2] = {x, w};
        uly_node *n = !uly_result_as(&out, x->dtype) ? uly_node_begin(ULY_OP_RMSNORM, 2, in) : NULL;
        if (n) {
            uly_node_save(n, xs); uly_node_save(n, rstd);
            if (wc) uly_node_save(n, wc);
            n->i[0] = rows; n->i[1] = C; n->i[2] = wc != NULL;
        }
        uly_node_attach(n, out);
    } else { uly_tensor_release(out); out = NULL; }
    uly_tensor_release(xc); uly_tensor_release(xs); uly_tensor_release(wc); uly_tensor_release(rstd);
    return out;
}

/* ---- activations ---- */
static uly_tensor *unary_op(const char *op, uly_tensor *x, int kind) {
    if (uly_check_floating(op, "x", x)) return NULL;
    const uly_backend *be = uly_be(x);
    const int native = x->dtype == ULY_DTYPE_BF16 && be->unary_forward_bf16;   /* reads and writes bf16 itself */
    uly_tensor *xc = native ? uly_contiguous_raw(x) : uly_contiguous_f32(x);
    uly_tensor *out = xc ? uly_new_like(xc) : NULL;
    if (out && native) be->unary_forward_bf16(uly_ptr(out), uly_ptr(xc), uly_tensor_numel(xc), kind);
    else if (out) be->unary_forward(uly_f32(out), uly_f32(xc), uly_tensor_numel(xc), kind);
    if (!uly_result_as(&out, x->dtype)) {
        uly_node *n = uly_node_begin(ULY_OP_UNARY, 1, &x);
        uly_tensor *xs = n ? uly_saved_form(x, xc) : NULL;
        if (n) { n->i[0] = kind; uly_node_save(n, xs); }
        uly_tensor_release(xs);
        save_output(n, &out);
        if (out) uly_node_attach(n, out);
    }
    uly_tensor_release(xc);
    return out;
}
uly_tensor *uly_gelu(uly_tensor *x, int tanh_approx) { return unary_op("gelu", x, tanh_approx ? ULY_UNARY_GELU_TANH : ULY_UNARY_GELU_EXACT); }
uly_tensor *uly_silu(uly_tensor *x) { return unary_op("silu", x, ULY_UNARY_SILU); }
uly_tensor *uly_relu(uly_tensor *x) { return unary_op("relu", x, ULY_UNARY_RELU); }
uly_tensor *uly_tanh(uly_tensor *x) { return unary_op("tanh", x, ULY_UNARY_TANH); }
uly_tensor *uly_sigmoid(uly_tensor *x) { return unary_op("sigmoid", x, ULY_UNARY_SIGMOID); }
uly_tensor *uly_exp(uly_tensor *x) { return unary_op("exp", x, ULY_UNARY_EXP); }
uly_tensor *uly_log(uly_tensor *x) { return unary_op("log", x, ULY_UNARY_LOG); }
uly_tensor *uly_sqrt(uly_tensor *x) { return unary_op("sqrt", x, ULY_UNARY_SQRT); }

uly_tensor *uly_swiglu(uly_tensor *gate, uly_tensor *up) {
    if (uly_check_floating("swiglu", "gate", gate) || uly_check_floating("swiglu", "up", up) ||
        uly_check_same_device("swiglu", "gate", gate, "up", up))
        return NULL;
    if (!uly_same_shape(gate, up))
        return uly_set_error_null("swiglu: gate %s and up %s must have the same shape", uly_desc(gate), uly_desc(up));
    const uly_backend *be = uly_be(gate);
    const int native = gate->dtype == ULY_DTYPE_BF16 && up->dtype == ULY_DTYPE_BF16 && be->swiglu_forward_bf16;
    uly_tensor *gc = native ? uly_contiguous_raw(gate) : uly_contiguous_f32(gate);
    uly_tensor *uc = native ? uly_contiguous_raw(up) : uly_contiguous_f32(up);
    uly_tensor *out = (gc && uc) ? uly_new_like(gc) : NULL;
    if (out && native) be->swiglu_forward_bf16(uly_ptr(out), uly_ptr(gc), uly_ptr(uc), uly_tensor_numel(gc));
    else if (out) be->swiglu_forward(uly_f32(out), uly_f32(gc), uly_f32(uc), uly_tensor_numel(gc));
    if (!uly_result_as(&out, uly_result_dtype(gate, up))) {
        uly_tensor *in[2] = {gate, up};
        uly_node *n = uly_node_begin(ULY_OP_SWIGLU, 2, in);
        uly_tensor *gs = n ? uly_saved_form(gate, gc) : NULL, *us = gs ? uly_saved_form(up, uc) : NULL;
        if (n && !us) { uly_node_release(n); n = NULL; uly_tensor_release(out); out = NULL; }
        uly_node_save(n, gs);
        uly_node_save(n, us);
        uly_tensor_release(gs); uly_tensor_release(us);
        uly_node_attach(n, out);
    }
    uly_tensor_release(gc); uly_tensor_release(uc);
    return out;
}

/* ---- embedding ---- */
static int check_index_dtype(const char *op, const char *arg, const uly_tensor *t) {
    if (uly_check_tensor(op, arg, t)) return -1;
    if (t->dtype != ULY_DTYPE_I32 && t->dtype != ULY_DTYPE_I64)
        return uly_set_error("%s: '%s' must hold integer token ids (i32 or i64), got %s; convert with :int()", op, arg,
                             uly_desc(t));
    return 0;
}

uly_tensor *uly_embedding(uly_tensor *idx, uly_tensor *weight) {
    if (check_index_dtype("embedding", "indices", idx) || uly_check_floating("embedding", "weight", weight) ||
        uly_check_same_device("embedding", "weight", weight, "indices", idx))
        return NULL;
    if (weight->ndim != 2)
        return uly_set_error_null("embedding: weight must be [vocab, dim], got %s", uly_desc(weight));
    if (idx->ndim + 1 > ULY_MAX_DIMS) return uly_set_error_null("embedding: indices %s have too many dimensions", uly_desc(idx));
    int64_t V = weight->shape[0], C = weight->shape[1], n = uly_tensor_numel(idx);
    uly_tensor *ic = uly_contiguous_raw(idx), *wc = uly_contiguous_f32(weight);
    uly_tensor *out = NULL;
    int bytes = (int)uly_dtype_size(idx->dtype);
    if (ic && wc) {
        int64_t bad = uly_be(ic)->embedding_first_bad_index(uly_ptr(ic), bytes, n, V);
        if (bad >= 0) {
            double v;
            int64_t flat[1] = {bad};
            uly_tensor *f = uly_tensor_view(ic, 1, &n);
            uly_tensor_get_item(f, flat, &v);
            uly_tensor_release(f);
            uly_set_error("embedding: index %.0f at %s of %s is out of range for a table of %lld rows "
                          "(valid ids are 0..%lld)", v, uly_position_str(idx->ndim, idx->shape, bad), uly_desc(idx),
                          (long long)V, (long long)V - 1);
        } else {
            int64_t shape[ULY_MAX_DIMS];
            memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)idx->ndim);
            shape[idx->ndim] = C;
            out = uly_new_contiguous(idx->ndim + 1, shape, ULY_DTYPE_F32, uly_dev(idx));
            if (out) {
                uly_be(out)->embedding_forward(uly_f32(out), uly_ptr(ic), bytes, uly_f32(wc), n, C);
                /* where activations are bf16, they start here */
                uly_result_as(&out, activation_bf16 || weight->dtype == ULY_DTYPE_BF16 ? ULY_DTYPE_BF16 : ULY_DTYPE_F32);
            }
            if (out) {
                uly_tensor *in[2] = {idx, weight};
                uly_node *node = uly_node_begin(ULY_OP_EMBEDDING, 2, in);
                if (node) { uly_node_save(node, ic); node->i[0] = n; node->i[1] = C; }
                uly_node_attach(node, out);
            }
        }
    }
    uly_tensor_release(ic); uly_tensor_release(wc);
    return out;
}

/* ---- rotary position embedding ---- */
uly_tensor *uly_rope(uly_tensor *x, int64_t pos_offset, double theta) {
    if (uly_check_floating("rope", "x", x)) return NULL;
    if (x->ndim != 4 || x->shape[3] % 2)
        return uly_set_error_null("rope: input must be [batch, seq, heads, head_dim] with an even head_dim, got %s",
                                  uly_desc(x));
    if (pos_offset < 0) return uly_set_error_null("rope: position offset %lld is negative", (long long)pos_offset);
    if (!(theta > 0)) return uly_set_error_null("rope: theta must be positive, got %g", theta);
    const uly_backend *be = uly_be(x);
    const int native = x->dtype == ULY_DTYPE_BF16 && be->rope_forward_bf16;   /* reads and writes bf16 itself */
    uly_tensor *xc = native ? uly_contiguous_raw(x) : uly_contiguous_f32(x);
    uly_tensor *out = xc ? uly_new_like(xc) : NULL;
    if (out && native &&
        be->rope_forward_bf16(uly_ptr(out), uly_ptr(xc), x->shape[0], x->shape[1], x->shape[2], x->shape[3], pos_offset,
                              (float)theta)) {
        uly_bf16_kernel_failed("rope", x->shape[3]);
        uly_tensor_release(out); out = NULL;
    } else if (out && !native)
        be->rope_forward(uly_f32(out), uly_f32(xc), x->shape[0], x->shape[1], x->shape[2], x->shape[3], pos_offset, (float)theta);
    if (!uly_result_as(&out, x->dtype)) {
        uly_node *n = uly_node_begin(ULY_OP_ROPE, 1, &x);
        if (n) { for (int d = 0; d < 4; d++) n->i[d] = x->shape[d]; n->i[4] = pos_offset; n->f[0] = theta; }
        uly_node_attach(n, out);
    }
    uly_tensor_release(xc);
    return out;
}

/* ---- dropout ---- */
uly_tensor *uly_dropout(uly_tensor *x, double p, int training) {
    if (uly_check_floating("dropout", "x", x)) return NULL;
    if (!(p >= 0 && p <= 1)) return uly_set_error_null("dropout: probability p = %g is outside [0, 1]", p);
    if (!training || p == 0) { x->refcount++; return x; }
    uly_tensor *xc = uly_contiguous_f32(x);
    uly_tensor *out = xc ? uly_new_like(xc) : NULL;
    int64_t n = xc ? uly_tensor_numel(xc) : 0;
    uint64_t seed = uly_rng_seed(), offset = out ? uly_rng_take((uint64_t)n) : 0;
    if (out) uly_be(out)->dropout_forward(uly_f32(out), uly_f32(xc), n, (float)p, seed, offset);
    if (!uly_result_as(&out, x->dtype)) {
        uly_node *node = uly_node_begin(ULY_OP_DROPOUT, 1, &x);
        if (node) { node->i[0] = (int64_t)seed; node->i[1] = (int64_t)offset; node->f[0] = p; }
        uly_node_attach(node, out);
    }
    uly_tensor_release(xc);
    return out;
}

/* ---- cross-entropy ---- */
uly_tensor *uly_cross_entropy(uly_tensor *logits, uly_tensor *targets, int64_t ignore_index, int reduction) {
    if (uly_check_floating("cross_entropy", "logits", logits) || check_index_dtype("cross_entropy", "targets", targets) ||
        uly_check_same_device("cross_entropy", "logits", logits, "targets", targets))
        return NULL;
    if (logits->ndim < 1) return uly_set_error_null("cross_entropy: logits %s need a class dimension", uly_desc(logits));
    int64_t V = logits->shape[logits->ndim - 1], rows = uly_numel_of(logits->ndim - 1, logits->shape);
    if (uly_tensor_numel(targets) != rows || targets->ndim != logits->ndim - 1)
        return uly_set_error_null("cross_entropy: targets %s do not match logits %s (expected targets of shape %s)",
                                  uly_desc(targets), uly_desc(logits), uly_shape_str(logits->ndim - 1, logits->shape));
    if (reduction < ULY_REDUCTION_MEAN || reduction > ULY_REDUCTION_NONE)
        return uly_set_error_null("cross_entropy: unknown reduction %d (use mean, sum or none)", reduction);
    const uly_backend *be = uly_be(logits);
    const int native = logits->dtype == ULY_DTYPE_BF16 && be->cross_entropy_forward_bf16;   /* reads bf16 itself */
    uly_tensor *lc = native ? uly_contiguous_raw(logits) : uly_contiguous_f32(logits), *tc = uly_contiguous_raw(targets);
    const int dev = uly_dev(logits);
    uly_tensor *loss = uly_new_contiguous(1, &rows, ULY_DTYPE_F32, dev), *lse = uly_new_contiguous(1, &rows, ULY_DTYPE_F32, dev);
    uly_tensor *out = NULL, *th = NULL;  /* th: the targets on the host, for the range check */
    int bytes = (int)uly_dtype_size(targets->dtype);
    if (lc && tc && loss && lse) {
        /* range check (ignore_index excepted) */
        int64_t bad = -1;
        double badv = 0;
        th = dev == ULY_DEVICE_CPU ? (tc->refcount++, tc) : uly_new_contiguous(tc->ndim, tc->shape, tc->dtype, ULY_DEVICE_CPU);
        if (th && th != tc && uly_copy_raw(th, tc)) { uly_tensor_release(th); th = NULL; }
        for (int64_t r = 0; th && r < rows && bad < 0; r++) {
            int64_t t = bytes == 4 ? ((int32_t *)uly_ptr(th))[r] : ((int64_t *)uly_ptr(th))[r];
            if (t != ignore_index && (t < 0 || t >= V)) { bad = r; badv = (double)t; }
        }
        if (!th) {
            /* the error is set */
        } else if (bad >= 0) {
            uly_set_error("cross_entropy: target %.0f at %s of %s is out of range for %lld classes "
                          "(and is not the ignore index %lld)", badv, uly_position_str(targets->ndim, targets->shape, bad),
                          uly_desc(targets), (long long)V, (long long)ignore_index);
        } else {
            int64_t count = native ? be->cross_entropy_forward_bf16(uly_f32(loss), uly_f32(lse), uly_ptr(lc), uly_ptr(tc), bytes,
                                                                    rows, V, ignore_index)
                                   : be->cross_entropy_forward(uly_f32(loss), uly_f32(lse), uly_f32(lc), uly_ptr(tc), bytes,
                                                               rows, V, ignore_index);
            if (count < 0) {   /* the bf16 kernel wrote nothing */
                uly_bf16_kernel_failed("cross_entropy", V);
                goto done;
            }
            double scale = reduction == ULY_REDUCTION_MEAN ? (count ? 1.0 / (double)count : 0.0) : 1.0;
            if (reduction == ULY_REDUCTION_NONE) {
                out = uly_tensor_view(loss, targets->ndim, targets->shape);
            } else {
                out = uly_new_contiguous(0, NULL, ULY_DTYPE_F32, dev);
                if (out && dev == ULY_DEVICE_CPU) {
                    double s = 0;
                    const float *lp = uly_f32(loss);
                    for (int64_t r = 0; r < rows; r++) s += lp[r];
                    *uly_f32(out) = (float)(s * scale);
                } else if (out) {
                    be->reduce_sum_forward(uly_f32(out), uly_f32(loss), 1, rows, 1, (float)scale);
                }
            }
            if (out) {
                uly_tensor *in[2] = {logits, targets};
                uly_node *n = uly_node_begin(ULY_OP_CROSS_ENTROPY, 2, in);
                uly_tensor *ls = n ? uly_saved_form(logits, lc) : NULL;   /* bf16 logits: kept in bf16 */
                if (n && !ls) { uly_node_release(n); n = NULL; uly_tensor_release(out); out = NULL; }
                if (n) {
                    uly_node_save(n, ls); uly_node_save(n, tc); uly_node_save(n, lse);
                    n->i[0] = rows; n->i[1] = V; n->i[2] = ignore_index; n->i[3] = reduction; n->f[0] = scale;
                }
                uly_node_attach(n, out);
                uly_tensor_release(ls);
            }
        }
    }
done:
    uly_tensor_release(th); uly_tensor_release(lc); uly_tensor_release(tc); uly_tensor_release(loss); uly_tensor_release(lse);
    return out;
}

/* ---- reference attention ---- */
static uly_tensor *attention_f32(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale, int causal);

/* bf16 q/k/v are read through differentiable f32 copies (this reference keeps the whole score
 * matrix anyway); the output is bf16 when q is */
static uly_tensor *as_f32(const char *arg, uly_tensor *t) {
    if (uly_check_floating("attention", arg, t)) return NULL;
    if (t->dtype == ULY_DTYPE_F32) { uly_tensor_retain(t); return t; }
    return uly_tensor_to_dtype(t, ULY_DTYPE_F32);
}

/* shapes: on the tensors as given (so an error names their dtypes, not the f32 copies') */
static int check_attention_shapes(const uly_tensor *q, const uly_tensor *k, const uly_tensor *v) {
    if (uly_check_tensor("attention", "q", q) || uly_check_tensor("attention", "k", k) ||
        uly_check_tensor("attention", "v", v))
        return -1;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
        return uly_set_error("attention: q, k, v must be [batch, seq, heads, head_dim], got q %s, k %s, v %s",
                             uly_desc(q), uly_desc(k), uly_desc(v));
    if (!uly_same_shape(k, v) || k->shape[0] != q->shape[0] || k->shape[3] != q->shape[3])
        return uly_set_error("attention: k %s and v %s must both be [%lld, seq, kv_heads, %lld] to match q %s",
                             uly_desc(k), uly_desc(v), (long long)q->shape[0], (long long)q->shape[3], uly_desc(q));
    if (k->shape[2] == 0 || q->shape[2] % k->shape[2])
        return uly_set_error("attention: %lld query heads cannot be grouped over %lld key/value heads "
                             "(query heads must be a multiple of kv heads)", (long long)q->shape[2],
                             (long long)k->shape[2]);
    return 0;
}

uly_tensor *uly_attention(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale, int causal) {
    if (check_attention_shapes(q, k, v)) return NULL;
    uly_tensor *qf = as_f32("q", q), *kf = qf ? as_f32("k", k) : NULL;
    uly_tensor *vf = kf ? as_f32("v", v) : NULL;
    uly_tensor *out = vf ? attention_f32(qf, kf, vf, scale, causal) : NULL;
    uly_tensor_release(qf); uly_tensor_release(kf); uly_tensor_release(vf);
    if (out && q->dtype == ULY_DTYPE_BF16) {
        uly_tensor *o16 = uly_tensor_to_dtype(out, ULY_DTYPE_BF16);
        uly_tensor_release(out);
        out = o16;
    }
    return out;
}

static uly_tensor *attention_f32(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale, int causal) {
    if (uly_check_float("attention", "q", q) || uly_check_float("attention", "k", k) || uly_check_float("attention", "v", v) ||
        uly_check_same_device("attention", "q", q, "k", k) || uly_check_same_device("attention", "q", q, "v", v))
        return NULL;
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], D = q->shape[3], Tk = k->shape[1], Hkv = k->shape[2];
    if (!(scale > 0)) scale = D ? 1.0 / sqrt((double)D) : 1.0;
    uly_tensor *qc = uly_contiguous_raw(q), *kc = uly_contiguous_raw(k), *vc = uly_contiguous_raw(v);
    int64_t pshape[4] = {B, H, Tq, Tk};
    uly_tensor *probs = (qc && kc && vc) ? uly_new_contiguous(4, pshape, ULY_DTYPE_F32, uly_dev(q)) : NULL;
    uly_tensor *out = probs ? uly_new_like(qc) : NULL;
    if (out) {
        uly_be(out)->attention_forward(uly_f32(out), uly_f32(probs), uly_f32(qc), uly_f32(kc), uly_f32(vc), B, Tq, Tk, H, Hkv, D,
                          (float)scale, causal);
        uly_tensor *in[3] = {q, k, v};
        uly_node *n = uly_node_begin(ULY_OP_ATTENTION, 3, in);
        if (n) {
            uly_node_save(n, qc); uly_node_save(n, kc); uly_node_save(n, vc); uly_node_save(n, probs);
            n->i[0] = B; n->i[1] = Tq; n->i[2] = Tk; n->i[3] = H; n->i[4] = Hkv; n->i[5] = D; n->i[6] = causal != 0;
            n->f[0] = scale;
        }
        uly_node_attach(n, out);
    } else if (qc && kc && vc && !probs) {
        uly_set_error("attention: the reference kernel needs the full [%lld, %lld, %lld, %lld] score matrix: %s",
                      (long long)B, (long long)H, (long long)Tq, (long long)Tk, uly_last_error());
    }
    uly_tensor_release(qc); uly_tensor_release(kc); uly_tensor_release(vc); uly_tensor_release(probs);
    return out;
}
