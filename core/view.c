/* core/view.c — view ops that share storage (view, reshape, permute, transpose, narrow, select,
 * expand, detach lives in autograd.c) and the copying ops (contiguous, clone, to_dtype, cat).
 * All are differentiable; their backward rules are in backward.c. */
#include <stdio.h>
#include <string.h>
#include "internal.h"

static uly_tensor *record(int op, uly_tensor *in, uly_tensor *out, const int64_t *ints, int n_ints) {
    if (!out) return NULL;
    /* autograd does not see this view (or its base): a write into it later, with grad on, would
     * go unnoticed */
    if (out->storage == in->storage && ((!uly_grad_enabled() && in->requires_grad) || in->nograd_view))
        out->nograd_view = 1;
    uly_node *n = uly_node_begin(op, 1, &in);
    if (n && n_ints) memcpy(n->i, ints, sizeof(int64_t) * (size_t)n_ints);
    uly_node_attach(n, out);
    return out;
}

static int check_shape(const char *op, const uly_tensor *t, int ndim, const int64_t *shape) {
    if (uly_check_tensor(op, "tensor", t)) return -1;
    if (ndim < 0 || ndim > ULY_MAX_DIMS) return uly_set_error("%s: %d dimensions requested (at most %d)", op, ndim, ULY_MAX_DIMS);
    if (ndim && !shape) return uly_set_error("%s: shape is NULL", op);
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0) return uly_set_error("%s: negative size in shape %s", op, uly_shape_str(ndim, shape));
    if (uly_numel_of(ndim, shape) != uly_tensor_numel(t))
        return uly_set_error("%s: shape %s has %lld elements but %s has %lld", op, uly_shape_str(ndim, shape),
                             (long long)uly_numel_of(ndim, shape), uly_desc(t), (long long)uly_tensor_numel(t));
    return 0;
}

uly_tensor *uly_tensor_view(uly_tensor *t, int ndim, const int64_t *shape) {
    if (check_shape("view", t, ndim, shape)) return NULL;
    if (!uly_tensor_is_contiguous(t))
        return uly_set_error_null("view: %s is not contiguous (strides %s); use :reshape() or :contiguous() first",
                                  uly_desc(t), uly_shape_str(t->ndim, t->stride));
    int64_t stride[ULY_MAX_DIMS], st = 1;
    for (int d = ndim - 1; d >= 0; d--) { stride[d] = st; st *= shape[d] ? shape[d] : 1; }
    return record(ULY_OP_VIEW, t, uly_new_view(t, ndim, shape, stride, t->offset), NULL, 0);
}

uly_tensor *uly_tensor_reshape(uly_tensor *t, int ndim, const int64_t *shape) {
    if (check_shape("reshape", t, ndim, shape)) return NULL;
    if (uly_tensor_is_contiguous(t)) return uly_tensor_view(t, ndim, shape);
    uly_tensor *c = uly_tensor_contiguous(t);
    uly_tensor *out = c ? uly_tensor_view(c, ndim, shape) : NULL;
    uly_tensor_release(c);
    return out;
}

uly_tensor *uly_tensor_permute(uly_tensor *t, const int *dims) {
    if (uly_check_tensor("permute", "tensor", t)) return NULL;
    if (t->ndim && !dims) return uly_set_error_null("permute: dims is NULL");
    int seen[ULY_MAX_DIMS] = {0};
    int64_t shape[ULY_MAX_DIMS], stride[ULY_MAX_DIMS], ints[ULY_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++) {
        if (dims[d] < 0 || dims[d] >= t->ndim || seen[dims[d]]++)
            return uly_set_error_null("permute: the dims given are not a permutation of the %d dimensions of %s",
                                      t->ndim, uly_desc(t));
        shape[d] = t->shape[dims[d]];
        stride[d] = t->stride[dims[d]];
        ints[d] = dims[d];
    }
    return record(ULY_OP_PERMUTE, t, uly_new_view(t, t->ndim, shape, stride, t->offset), ints, t->ndim);
}

uly_tensor *uly_tensor_transpose(uly_tensor *t, int d0, int d1) {
    if (uly_check_tensor("transpose", "tensor", t)) return NULL;
    if (d0 < 0 || d1 < 0 || d0 >= t->ndim || d1 >= t->ndim)
        return uly_set_error_null("transpose: dimensions %d and %d out of range for %s", d0 + 1, d1 + 1, uly_desc(t));
    int dims[ULY_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++) dims[d] = d;
    dims[d0] = d1;
    dims[d1] = d0;
    return uly_tensor_permute(t, dims);
}

/* narrow and select share a node: i = {dim, start, length, squeezed} */
static uly_tensor *narrow_impl(const char *op, uly_tensor *t, int dim, int64_t start, int64_t length, int squeeze) {
    if (uly_check_tensor(op, "tensor", t)) return NULL;
    if (dim < 0 || dim >= t->ndim)
        return uly_set_error_null("%s: dimension %d out of range for %s", op, dim + 1, uly_desc(t));
    if (start < 0 || length < 0 || start + length > t->shape[dim])
        return uly_set_error_null("%s: range [%lld, %lld) is out of bounds for dimension %d of size %lld in %s", op,
                                  (long long)start, (long long)(start + length), dim + 1, (long long)t->shape[dim], uly_desc(t));
    int64_t shape[ULY_MAX_DIMS], stride[ULY_MAX_DIMS];
    int k = 0;
    for (int d = 0; d < t->ndim; d++) {
        if (d == dim && squeeze) continue;
        shape[k] = d == dim ? length : t->shape[d];
        stride[k++] = t->stride[d];
    }
    int64_t ints[4] = {dim, start, length, squeeze};
    return record(ULY_OP_NARROW, t, uly_new_view(t, k, shape, stride, t->offset + start * t->stride[dim]), ints, 4);
}

uly_tensor *uly_tensor_narrow(uly_tensor *t, int dim, int64_t start, int64_t length) {
    return narrow_impl("narrow", t, dim, start, length, 0);
}

uly_tensor *uly_tensor_select(uly_tensor *t, int dim, int64_t index) {
    if (t && dim >= 0 && dim < t->ndim && (index < 0 || index >= t->shape[dim]))
        return uly_set_error_null("select: index %lld is out of range for dimension %d of size %lld in %s",
                                  (long long)index, dim + 1, (long long)t->shape[dim], uly_desc(t));
    return narrow_impl("select", t, dim, index, 1, 1);
}

uly_tensor *uly_tensor_expand(uly_tensor *t, int ndim, const int64_t *shape) {
    if (uly_check_tensor("expand", "tensor", t)) return NULL;
    if (ndim < t->ndim || ndim > ULY_MAX_DIMS || (ndim && !shape))
        return uly_set_error_null("expand: cannot expand %s to %d dimensions", uly_desc(t), ndim);
    int64_t sh[ULY_MAX_DIMS], st[ULY_MAX_DIMS];
    for (int d = 0; d < ndim; d++) {
        int td = d - (ndim - t->ndim);
        int64_t want = shape[d], have = td >= 0 ? t->shape[td] : 1;
        if (want == -1 && td >= 0) want = have;
        if (want < 0 || (have != want && have != 1))
            return uly_set_error_null("expand: %s cannot be expanded to %s (dimension %d has size %lld, only size 1 "
                                      "can grow)", uly_desc(t), uly_shape_str(ndim, shape), d + 1, (long long)have);
        sh[d] = want;
        st[d] = (td >= 0 && have == want) ? t->stride[td] : 0;
    }
    return record(ULY_OP_EXPAND, t, uly_new_view(t, ndim, sh, st, t->offset), NULL, 0);
}

static uly_tensor *copy_op(const char *op, uly_tensor *t, int dtype, int device) {
    if (uly_check_tensor(op, "tensor", t)) return NULL;
    uly_tensor *out = uly_new_contiguous(t->ndim, t->shape, dtype, device);
    if (!out) return NULL;
    if (uly_copy_raw(out, t)) { uly_tensor_release(out); return NULL; }
    int floating = dtype == ULY_DTYPE_F32 || dtype == ULY_DTYPE_BF16 || dtype == ULY_DTYPE_F64;
    if (floating) return record(ULY_OP_COPY, t, out, NULL, 0);
    return out; /* integer results are never differentiable */
}

uly_tensor *uly_tensor_contiguous(uly_tensor *t) {
    if (uly_check_tensor("contiguous", "tensor", t)) return NULL;
    if (uly_tensor_is_contiguous(t)) { t->refcount++; return t; }
    return copy_op("contiguous", t, t->dtype, uly_dev(t));
}

uly_tensor *uly_tensor_clone(uly_tensor *t) { return copy_op("clone", t, t ? t->dtype : 0, t ? uly_dev(t) : 0); }

uly_tensor *uly_tensor_to_dtype(uly_tensor *t, int dtype) {
    if (dtype < ULY_DTYPE_F32 || dtype > ULY_DTYPE_F64) return uly_set_error_null("to_dtype: unknown dtype %d", dtype);
    if (uly_check_tensor("to_dtype", "tensor", t)) return NULL;
    return copy_op("to_dtype", t, dtype, uly_dev(t));
}

uly_tensor *uly_tensor_to_device(uly_tensor *t, int device) {
    if (uly_check_tensor("to", "tensor", t)) return NULL;
    if (device < 0 || device >= ULY_DEVICE_COUNT) return uly_set_error_null("to: unknown device %d", device);
    if (!uly_device_available(device))
        return uly_set_error_null("to: device '%s' is not available (no backend loaded; in Lua uly.cuda.why() says why)",
                                  uly_device_name(device));
    if (uly_dev(t) == device) { t->refcount++; return t; }
    return copy_op("to", t, t->dtype, device);  /* backward: the gradient moves back (uly_sum_to) */
}

uly_tensor *uly_tensor_cat(int n, uly_tensor *const *ts, int dim) {
    if (n < 1 || !ts) return uly_set_error_null("cat: needs at least one tensor");
    if (n > ULY_NODE_MAX_INPUTS)
        return uly_set_error_null("cat: at most %d tensors per call (the Lua binding chains larger lists)", ULY_NODE_MAX_INPUTS);
    for (int k = 0; k < n; k++)
        if (uly_check_tensor("cat", "tensor", ts[k])) return NULL;
    const uly_tensor *t0 = ts[0];
    if (dim < 0 || dim >= t0->ndim) return uly_set_error_null("cat: dimension %d out of range for %s", dim + 1, uly_desc(t0));
    int64_t shape[ULY_MAX_DIMS];
    memcpy(shape, t0->shape, sizeof shape);
    shape[dim] = 0;
    for (int k = 0; k < n; k++) {
        const uly_tensor *t = ts[k];
        char name[32];
        snprintf(name, sizeof name, "tensor %d", k + 1);
        if (uly_check_same_device("cat", "tensor 1", t0, name, t)) return NULL;
        int ok = t->ndim == t0->ndim && t->dtype == t0->dtype;
        for (int d = 0; ok && d < t0->ndim; d++) ok = d == dim || t->shape[d] == t0->shape[d];
        if (!ok)
            return uly_set_error_null("cat: tensor %d is %s but tensor 1 is %s; all must match except in dimension %d",
                                      k + 1, uly_desc(t), uly_desc(t0), dim + 1);
        shape[dim] += t->shape[dim];
    }
    uly_tensor *out = uly_new_contiguous(t0->ndim, shape, t0->dtype, uly_dev(t0));
    if (!out) return NULL;
    int64_t at = 0;
    for (int k = 0; k < n; k++) {
        uly_tensor part = *out; /* a temporary strided window into out, never handed out */
        part.shape[dim] = ts[k]->shape[dim];
        part.offset = at * out->stride[dim];
        uly_copy_raw(&part, ts[k]);
        at += ts[k]->shape[dim];
    }
    uly_node *node = uly_node_begin(ULY_OP_CAT, n, ts);
    if (node) node->i[0] = dim;
    uly_node_attach(node, out);
    return out;
}
