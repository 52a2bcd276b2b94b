/* core/flash.c — dispatch and autograd node of the memory-efficient attention
 * (kernels/cpu/flash_attention.c): validates q/k/v and the mask, reads strided q/k/v views in
 * place (last dim contiguous; anything else is copied once), saves only q, k, v, the output, the
 * per-row log-sum-exp and the mask ids for backward, and holds the backward rule. */
#include <math.h>
#include <string.h>
#include "internal.h"

static const char *OP = "flash_attention";

int64_t uly_flash_attention_tiles(void) { return flash_attention_tiles(); }  /* CPU kernel's count */
void uly_flash_attention_reset_tiles(void) { flash_attention_reset_tiles(); }

/* t itself when its last dim is contiguous (stride 1, or a single element), else a copy */
static uly_tensor *rows_contiguous(uly_tensor *t) {
    if (t->shape[3] <= 1 || t->stride[3] == 1) {
        uly_tensor_retain(t);
        return t;
    }
    return uly_contiguous_raw(t);
}

static flash_operand operand(const uly_tensor *t) {
    flash_operand o = {(const float *)uly_ptr(t), t->stride[0], t->stride[1], t->stride[2], t->dtype};
    return o;
}

/* q, k or v as the backend reads it: its rows made contiguous; a bf16 one (bf16 activations, a
 * bf16 KV cache) as it is where the backend rounds operands to bf16 anyway (bf16 precision on a
 * backend with bf16 GEMMs), else as an f32 copy */
static uly_tensor *backend_operand(uly_tensor *t) {
    uly_tensor *r = rows_contiguous(t);
    if (!r || r->dtype == ULY_DTYPE_F32 || (uly_matmul_bf16() && uly_be(t)->gemm_batched_bf16)) return r;
    uly_tensor *f = uly_contiguous_f32(r);
    uly_tensor_release(r);
    return f;
}

static int check_qkv(uly_tensor *q, uly_tensor *k, uly_tensor *v) {
    if (uly_check_floating(OP, "q", q) || uly_check_floating(OP, "k", k) || uly_check_floating(OP, "v", v) ||
        uly_check_same_device(OP, "q", q, "k", k) || uly_check_same_device(OP, "q", q, "v", v))
        return -1;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
        return uly_set_error("%s: q, k, v must be [batch, seq, heads, head_dim], got q %s, k %s, v %s", OP,
                             uly_desc(q), uly_desc(k), uly_desc(v));
    if (!uly_same_shape(k, v) || k->shape[0] != q->shape[0] || k->shape[3] != q->shape[3])
        return uly_set_error("%s: k %s and v %s must both be [%lld, seq, kv_heads, %lld] to match q %s", OP,
                             uly_desc(k), uly_desc(v), (long long)q->shape[0], (long long)q->shape[3], uly_desc(q));
    if (k->shape[2] == 0 || q->shape[2] % k->shape[2])
        return uly_set_error("%s: %lld query heads cannot be grouped over %lld key/value heads "
                             "(query heads must be a multiple of kv heads)", OP, (long long)q->shape[2],
                             (long long)k->shape[2]);
    return 0;
}

/* an integer id tensor of exactly [B, T] */
static int check_ids(const char *arg, const uly_tensor *t, int64_t B, int64_t T, const char *what) {
    if (uly_check_tensor(OP, arg, t)) return -1;
    if (t->dtype != ULY_DTYPE_I32 && t->dtype != ULY_DTYPE_I64)
        return uly_set_error("%s: mask '%s' is %s but document ids must be i32 or i64; convert with :int()", OP, arg,
                             uly_desc(t));
    if (t->ndim != 2 || t->shape[0] != B || t->shape[1] != T)
        return uly_set_error("%s: mask '%s' is %s but must be [%lld, %lld] (batch, %s length)", OP, arg, uly_desc(t),
                             (long long)B, (long long)T, what);
    return 0;
}

/* validates the mask and packs its tensors into one i32 tensor [layout | q_doc | k_doc] (NULL
 * without error when the mask has no tensors); *rc = -1 on error */
static uly_tensor *pack_mask(const uly_attn_mask *m, int64_t B, int64_t Tq, int64_t Tk, int64_t *nbr, int64_t *nbc,
                             int device, int *rc) {
    *rc = -1;
    *nbr = *nbc = 0;
    if (m->window_left < -1 || m->window_right < -1)
        return uly_set_error_null("%s: window widths must be >= 0 (or -1 for unbounded), got left %lld, right %lld",
                                  OP, (long long)m->window_left, (long long)m->window_right);
    const uly_tensor *lay = m->block_layout;
    if (lay) {
        if (m->block_size <= 0)
            return uly_set_error_null("%s: a block layout needs block_size > 0, got %lld", OP, (long long)m->block_size);
        *nbr = (Tq + m->block_size - 1) / m->block_size;
        *nbc = (Tk + m->block_size - 1) / m->block_size;
        if (uly_check_tensor(OP, "block_layout", lay)) return NULL;
        if (lay->dtype != ULY_DTYPE_I32 && lay->dtype != ULY_DTYPE_I64)
            return uly_set_error_null("%s: block_layout is %s but must be an i32 0/1 tensor; convert with :int()", OP,
                                      uly_desc(lay));
        if (lay->ndim != 2 || lay->shape[0] != *nbr || lay->shape[1] != *nbc)
            return uly_set_error_null("%s: block_layout is %s but block_size %lld over Tq %lld, Tk %lld needs "
                                      "[%lld, %lld] (ceil(T / block_size) blocks per side)", OP, uly_desc(lay),
                                      (long long)m->block_size, (long long)Tq, (long long)Tk, (long long)*nbr,
                                      (long long)*nbc);
    }
    if ((m->q_doc != NULL) != (m->k_doc != NULL))
        return uly_set_error_null("%s: document masks need both q_doc [B, Tq] and k_doc [B, Tk] (pass the same "
                                  "ids twice for self-attention)", OP);
    if (m->q_doc && (check_ids("q_doc", m->q_doc, B, Tq, "query") || check_ids("k_doc", m->k_doc, B, Tk, "key")))
        return NULL;
    const int64_t nl = lay ? *nbr * *nbc : 0, nd = m->q_doc ? B * (Tq + Tk) : 0, total = nl + nd;
    *rc = 0;
    if (!lay && !m->q_doc) return NULL;
    uly_tensor *pack = uly_new_contiguous(1, &total, ULY_DTYPE_I32, ULY_DEVICE_CPU);
    if (!pack) { *rc = -1; return NULL; }
    int32_t *p = uly_ptr(pack);
    int ok = (!lay || uly_tensor_copy_to(lay, p, ULY_DTYPE_I32, nl) == 0) &&
             (!m->q_doc || (uly_tensor_copy_to(m->q_doc, p + nl, ULY_DTYPE_I32, B * Tq) == 0 &&
                            uly_tensor_copy_to(m->k_doc, p + nl + B * Tq, ULY_DTYPE_I32, B * Tk) == 0));
    for (int64_t x = 0; ok && x < nl; x++)
        if (p[x] != 0 && p[x] != 1) {
            uly_set_error("%s: block_layout must hold only 0 and 1, found %d at block [%lld, %lld]", OP, (int)p[x],
                          (long long)(x / *nbc), (long long)(x % *nbc));
            ok = 0;
        }
    if (!ok) { uly_tensor_release(pack); *rc = -1; return NULL; }
    if (device != ULY_DEVICE_CPU) { /* checked on the host, used on the device */
        uly_tensor *moved = uly_tensor_to_device(pack, device);
        uly_tensor_release(pack);
        if (!moved) { *rc = -1; return NULL; }
        pack = moved;
    }
    return pack;
}

/* the kernel's problem from the (saved) tensors and node scalars */
static flash_problem problem(const uly_tensor *q, const uly_tensor *k, const uly_tensor *v, const uly_tensor *pack,
                             const int64_t *i, double scale) {
    flash_problem p;
    memset(&p, 0, sizeof p);
    p.B = i[0]; p.Tq = i[1]; p.Tk = i[2]; p.H = i[3]; p.Hkv = i[4]; p.D = i[5];
    p.scale = (float)scale;
    p.q = operand(q); p.k = operand(k); p.v = operand(v);
    p.causal = (int)i[6]; p.left = i[7]; p.right = i[8];
    p.bs = i[9];
    p.bf16 = (int)i[11];
    const int32_t *ids = pack ? (const int32_t *)uly_ptr(pack) : NULL;
    if (i[10] & 1) {
        p.layout = ids;
        p.nbr = (p.Tq + p.bs - 1) / p.bs;
        p.nbc = (p.Tk + p.bs - 1) / p.bs;
        ids += p.nbr * p.nbc;
    }
    if (i[10] & 2) {
        p.q_doc = ids;
        p.k_doc = ids + p.B * p.Tq;
    }
    return p;
}

/* the kernel's O(N D) scratch of transposed tiles, from the counted allocator */
static uly_tensor *new_scratch(const uly_backend *be, int device, const flash_problem *p, int backward) {
    int64_t n = be->flash_attention_scratch_floats(p, backward);
    if (n < 1) n = 1;
    return uly_new_contiguous(1, &n, ULY_DTYPE_F32, device);
}

/* kept (out, lse) handed back for the same q, k, v and mask: contiguous, on q's device, of the
 * shapes and dtypes this call would produce */
static int check_kept(const uly_tensor *q, const uly_tensor *out, const uly_tensor *lse, const int64_t *lshape) {
    if (uly_check_tensor(OP, "kept out", out) || uly_check_tensor(OP, "kept lse", lse)) return -1;
    if (out->dtype != q->dtype || !uly_tensor_is_contiguous(out) || !uly_same_shape(out, q) || uly_dev(out) != uly_dev(q))
        return uly_set_error("%s: the kept output is %s but must be a contiguous %s %s on q's device (the output of "
                             "flash_attention_keep on these q, k, v)", OP, uly_desc(out), uly_dtype_name(q->dtype),
                             uly_desc(q));
    if (lse->dtype != ULY_DTYPE_F32 || !uly_tensor_is_contiguous(lse) || lse->ndim != 3 || lse->shape[0] != lshape[0] ||
        lse->shape[1] != lshape[1] || lse->shape[2] != lshape[2] || uly_dev(lse) != uly_dev(q))
        return uly_set_error("%s: the kept log-sum-exp is %s but must be contiguous f32 [%lld, %lld, %lld] (batch, "
                             "heads, queries) on q's device", OP, uly_desc(lse), (long long)lshape[0],
                             (long long)lshape[1], (long long)lshape[2]);
    return 0;
}

/* the forward, or with kept_out/kept_lse the node alone over an earlier forward's results; the
 * log-sum-exp is returned through lse_out (a new reference) when asked for */
static uly_tensor *flash_attention(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale,
                                   const uly_attn_mask *mask, uly_tensor *kept_out, uly_tensor *kept_lse,
                                   uly_tensor **lse_out) {
    if (lse_out) *lse_out = NULL;
    if (check_qkv(q, k, v)) return NULL;
    const uly_attn_mask none = {0, -1, -1, NULL, 0, NULL, NULL};
    const uly_attn_mask *m = mask ? mask : &none;
    const int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], D = q->shape[3], Tk = k->shape[1],
                  Hkv = k->shape[2];
    int64_t lshape[3] = {B, H, Tq};
    if (kept_out && check_kept(q, kept_out, kept_lse, lshape)) return NULL;
    if (!(scale > 0)) scale = D ? 1.0 / sqrt((double)D) : 1.0;
    int64_t nbr, nbc;
    int rc;
    uly_tensor *pack = pack_mask(m, B, Tq, Tk, &nbr, &nbc, uly_dev(q), &rc);
    if (rc) return NULL;
    uly_tensor *qc = backend_operand(q), *kc = qc ? backend_operand(k) : NULL;
    uly_tensor *vc = kc ? backend_operand(v) : NULL;
    uly_tensor *lse = NULL, *out = NULL;
    if (vc && kept_out) {   /* a view of the kept output: the node attaches to a tensor of its own */
        uly_tensor_retain(kept_lse);
        lse = kept_lse;
        out = uly_new_view(kept_out, kept_out->ndim, kept_out->shape, kept_out->stride, kept_out->offset);
    } else if (vc) {
        lse = uly_new_contiguous(3, lshape, ULY_DTYPE_F32, uly_dev(q));
        out = lse ? uly_new_contiguous(4, q->shape, ULY_DTYPE_F32, uly_dev(q)) : NULL;
    }
    if (out) {
        int64_t ints[12] = {B, Tq, Tk, H, Hkv, D, m->causal != 0, m->window_left, m->window_right,
                            m->block_layout ? m->block_size : 0, (m->block_layout ? 1 : 0) | (m->q_doc ? 2 : 0),
                            uly_matmul_bf16()};
        flash_problem p = problem(qc, kc, vc, pack, ints, scale);
        if (!kept_out) {
            uly_tensor *scratch = new_scratch(uly_be(q), uly_dev(q), &p, 0);
            if (!scratch || uly_be(q)->flash_attention_forward(uly_f32(out), uly_f32(lse), uly_f32(scratch), &p)) {
                if (scratch) uly_set_error("%s: out of memory for the per-thread tile scratch", OP);
                uly_tensor_release(out);
                out = NULL;
            }
            uly_tensor_release(scratch);
            if (out) uly_result_as(&out, q->dtype);   /* bf16 activations stay bf16 */
        }
        uly_tensor *in[3] = {q, k, v};
        uly_node *n = out ? uly_node_begin(ULY_OP_FLASH_ATTENTION, 3, in) : NULL;
        if (n) {
            uly_tensor *alias = uly_new_view(out, out->ndim, out->shape, out->stride, out->offset);
            if (!alias) {
                uly_node_release(n);
                uly_tensor_release(out);
                out = NULL;
            } else {
                uly_node_save(n, qc); uly_node_save(n, kc); uly_node_save(n, vc);
                uly_node_save(n, alias); uly_node_save(n, lse);
                if (pack) uly_node_save(n, pack);
                uly_tensor_release(alias);
                memcpy(n->i, ints, sizeof ints);
                n->f[0] = scale;
                uly_node_attach(n, out);
            }
        }
    }
    if (out && lse_out) {
        *lse_out = lse;
        lse = NULL;
    }
    uly_tensor_release(qc); uly_tensor_release(kc); uly_tensor_release(vc);
    uly_tensor_release(lse); uly_tensor_release(pack);
    return out;
}

uly_tensor *uly_flash_attention(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale, const uly_attn_mask *mask) {
    return flash_attention(q, k, v, scale, mask, NULL, NULL, NULL);
}

uly_tensor *uly_flash_attention_keep(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale,
                                     const uly_attn_mask *mask, uly_tensor **lse) {
    if (!lse) return uly_set_error_null("%s: flash_attention_keep needs somewhere to return the log-sum-exp", OP);
    return flash_attention(q, k, v, scale, mask, NULL, NULL, lse);
}

uly_tensor *uly_flash_attention_kept(uly_tensor *q, uly_tensor *k, uly_tensor *v, double scale,
                                     const uly_attn_mask *mask, uly_tensor *out, uly_tensor *lse) {
    if (!out || !lse)
        return uly_set_error_null("%s: flash_attention_kept needs the kept output and log-sum-exp (got %s and %s)", OP,
                                  out ? "a tensor" : "NULL", lse ? "a tensor" : "NULL");
    return flash_attention(q, k, v, scale, mask, out, lse, NULL);
}

int uly_bw_flash_attention(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_tensor *const *s = n->saved;
    flash_problem p = problem(s[0], s[1], s[2], n->n_saved > 5 ? s[5] : NULL, n->i, n->f[0]);
    int64_t dshape[3] = {p.B, p.H, p.Tq};
    uly_tensor *gc = uly_contiguous_raw(g);
    uly_tensor *delta = gc ? uly_new_contiguous(3, dshape, ULY_DTYPE_F32, uly_dev(g)) : NULL;
    uly_tensor *scratch = delta ? new_scratch(uly_be(g), uly_dev(g), &p, 1) : NULL;
    int rc = scratch ? 0 : -1;
    if (!rc && uly_be(g)->flash_attention_backward(gin[0] ? uly_f32(gin[0]) : NULL, gin[1] ? uly_f32(gin[1]) : NULL,
                                        gin[2] ? uly_f32(gin[2]) : NULL, uly_f32(gc), uly_f32(s[3]), uly_f32(s[4]),
                                        uly_f32(delta), uly_f32(scratch), &p))
        rc = uly_set_error("%s backward: out of memory for the per-thread tile scratch", OP);
    uly_tensor_release(scratch);
    uly_tensor_release(delta);
    uly_tensor_release(gc);
    return rc;
}
