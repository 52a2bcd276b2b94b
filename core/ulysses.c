/* core/ulysses.c — the two DeepSpeed-Ulysses exchanges as autograd ops, over a sequence-parallel
 * group of P ranks (../shared/DESIGN.md, "The algorithm").
 *
 *  uly_ulysses_qkv_to_heads: the fused projection output qkv [B, n_r, H + 2G, D] (this rank's
 *    n_r tokens, every head; Q heads, then K heads, then V heads) -> [B, N, Hq_r + 2 Gk_r, D]:
 *    the whole sequence for this rank's query heads and the K/V heads they use. ONE exchange
 *    moves Q, K and V; MPI datatypes pick each destination's heads straight out of qkv and
 *    place each source's tokens straight into the result, so nothing is packed or permuted.
 *  uly_ulysses_heads_to_seq: the attention output o [B, N, Hq_r, D] -> [B, n_r, H, D].
 * Backward of each is the other direction. In bf16 mixed precision (uly_matmul_bf16() when the
 * forward runs) all four exchanges move bf16: what crosses is rounded where the GEMMs that use it
 * round it anyway (Q, K, V and the attention output feed bf16 GEMMs, and so do their gradients),
 * and half the bytes cross. Splits (the same on every rank):
 *  - tokens: rank r holds [start_r, start_r + n_r) with the first N % P ranks one token longer;
 *  - query heads: likewise over H; rank r's query heads [h0, h0 + Hq) use K/V heads
 *    g(h) = h / (H / G), a contiguous range [g0, g0 + Gk): with G < P (or uneven head groups)
 *    several ranks get the same K/V head, and its sender sends it to each of them. In backward
 *    those copies' gradients are summed at the sender. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "../kernels/cpu/kernels.h"

static int64_t copies; /* packing copies made by the exchanges (0 on the forward path) */
int64_t uly_ulysses_copies(void) { return copies; }

int uly_ulysses_split(int64_t n, int parts, int index, int64_t *start, int64_t *length) {
    if (parts < 1 || index < 0 || index >= parts || n < 0)
        return uly_set_error("ulysses_split: index %d of %d parts of %lld is out of range", index, parts, (long long)n);
    int64_t base = n / parts, extra = n % parts;
    *length = base + (index < extra);
    *start = index * base + (index < extra ? index : extra);
    return 0;
}

int uly_ulysses_heads(int64_t heads, int64_t kv_heads, int parts, int index, int64_t *q_start, int64_t *q_count,
                      int64_t *kv_start, int64_t *kv_count) {
    if (heads < 1 || kv_heads < 1 || heads % kv_heads)
        return uly_set_error("ulysses_heads: %lld query heads are not a multiple of %lld K/V heads",
                             (long long)heads, (long long)kv_heads);
    if (uly_ulysses_split(heads, parts, index, q_start, q_count)) return -1;
    int64_t group = heads / kv_heads;
    if (*q_count == 0) { *kv_start = 0; *kv_count = 0; return 0; }
    *kv_start = *q_start / group;
    *kv_count = (*q_start + *q_count - 1) / group - *kv_start + 1;
    return 0;
}

typedef struct {
    int P, r;
    int64_t B, N, H, G, D, W;             /* W = H + 2G: heads per token in qkv */
    int64_t *tok0, *ntok;                 /* per rank */
    int64_t *h0, *hq, *g0, *gk, *w;       /* per rank; w = hq + 2 gk */
} plan;

static void plan_free(plan *p) { free(p->tok0); }

static int plan_make(plan *p, uly_comm *c, int64_t B, int64_t N, int64_t H, int64_t G, int64_t D) {
    memset(p, 0, sizeof *p);
    p->P = uly_comm_size(c);
    p->r = uly_comm_rank(c);
    if (p->P < 1) return uly_set_error("ulysses: no sequence-parallel group (call uly_dist_init)");
    p->B = B; p->N = N; p->H = H; p->G = G; p->D = D; p->W = H + 2 * G;
    p->tok0 = calloc(7 * (size_t)p->P, sizeof(int64_t));
    if (!p->tok0) return uly_set_error("ulysses: out of memory");
    p->ntok = p->tok0 + p->P; p->h0 = p->ntok + p->P; p->hq = p->h0 + p->P;
    p->g0 = p->hq + p->P; p->gk = p->g0 + p->P; p->w = p->gk + p->P;
    for (int j = 0; j < p->P; j++) {
        uly_ulysses_split(N, p->P, j, &p->tok0[j], &p->ntok[j]);
        if (uly_ulysses_heads(H, G, p->P, j, &p->h0[j], &p->hq[j], &p->g0[j], &p->gk[j])) { plan_free(p); return -1; }
        p->w[j] = p->hq[j] + 2 * p->gk[j];
    }
    return 0;
}

static uly_comm_layout run1(int64_t base, int64_t count, int64_t stride, int64_t len) {
    uly_comm_layout L = {.base = base, .count = count, .stride = stride, .nruns = 1};
    L.offset[0] = 0;
    L.length[0] = len;
    return L;
}

/* rank j's query, key and value heads inside one token of qkv [.., H + 2G, D] */
static uly_comm_layout heads_of(const plan *p, int j, int64_t count) {
    uly_comm_layout L = {.base = 0, .count = count, .stride = p->W * p->D, .nruns = 3};
    L.offset[0] = p->h0[j] * p->D;                  L.length[0] = p->hq[j] * p->D;
    L.offset[1] = (p->H + p->g0[j]) * p->D;         L.length[1] = p->gk[j] * p->D;
    L.offset[2] = (p->H + p->G + p->g0[j]) * p->D;  L.length[2] = p->gk[j] * p->D;
    return L;
}

/* a contiguous copy of contiguous t in dtype (bf16 for an exchange), or t itself retained */
static uly_tensor *in_dtype(uly_tensor *t, int dtype) {
    if (!t || t->dtype == dtype) { if (t) t->refcount++; return t; }
    uly_tensor *c = uly_new_contiguous(t->ndim, t->shape, dtype, uly_dev(t));
    if (c && uly_copy_raw(c, t)) { uly_tensor_release(c); return NULL; }
    return c;
}

/* the buffer an exchange receives into: `out` itself (f32), or a bf16 one of its shape */
static uly_tensor *receive_buffer(uly_tensor *out, int dtype) {
    if (out->dtype == dtype) { out->refcount++; return out; }
    return uly_new_contiguous(out->ndim, out->shape, dtype, uly_dev(out));
}

/* after the exchange: a bf16 receive buffer's values into the f32 `out` */
static int received(uly_tensor *out, uly_tensor *buf) { return buf == out ? 0 : uly_copy_raw(out, buf); }

/* qkv [B, n_r, W, D] -> heads [B, N, w_r, D] */
static int exchange_qkv(uly_comm *c, const plan *p, int dev, const void *qkv, void *heads, int dtype) {
    int P = p->P, r = p->r;
    uly_comm_layout *tok = malloc(2 * (size_t)P * sizeof *tok), *hd = tok + P;
    if (!tok) return uly_set_error("ulysses: out of memory");
    for (int j = 0; j < P; j++) {
        hd[j] = heads_of(p, j, p->B * p->ntok[r]);                       /* in my qkv: rank j's heads */
        tok[j] = run1(p->tok0[j] * p->w[r] * p->D, p->B, p->N * p->w[r] * p->D, p->ntok[j] * p->w[r] * p->D);
    }                                                                     /* in my heads: rank j's tokens */
    int rc = uly_comm_all_to_all_layout_on(c, dev, qkv, hd, heads, tok, dtype);
    free(tok);
    return rc;
}

/* o [B, N, hq_r, D] <-> y [B, n_r, H, D] (fwd: o -> y) */
static int exchange_out(uly_comm *c, const plan *p, int dev, void *o, void *y, int forward, int dtype) {
    int P = p->P, r = p->r;
    uly_comm_layout *tok = malloc(2 * (size_t)P * sizeof *tok), *hd = tok + P;
    if (!tok) return uly_set_error("ulysses: out of memory");
    for (int j = 0; j < P; j++) {
        tok[j] = run1(p->tok0[j] * p->hq[r] * p->D, p->B, p->N * p->hq[r] * p->D, p->ntok[j] * p->hq[r] * p->D);
        hd[j] = run1(p->h0[j] * p->D, p->B * p->ntok[r], p->H * p->D, p->hq[j] * p->D);
    }
    int rc = forward ? uly_comm_all_to_all_layout_on(c, dev, o, tok, y, hd, dtype)
                     : uly_comm_all_to_all_layout_on(c, dev, y, hd, o, tok, dtype);
    free(tok);
    return rc;
}

static int check_group(const char *op, uly_comm *c) {
    if (!c) return uly_set_error("%s: no sequence-parallel group given (uly.dist.init{sp = P} first)", op);
    return 0;
}

uly_tensor *uly_ulysses_qkv_to_heads(uly_comm *c, uly_tensor *qkv, int64_t heads, int64_t kv_heads, int64_t seq_total) {
    const char *op = "ulysses_qkv_to_heads";
    if (check_group(op, c) || uly_check_floating(op, "qkv", qkv)) return NULL;
    if (qkv->ndim != 4 || qkv->shape[2] != heads + 2 * kv_heads)
        return uly_set_error_null("%s: qkv must be [batch, local_seq, heads + 2 kv_heads = %lld, head_dim], got %s", op,
                                  (long long)(heads + 2 * kv_heads), uly_desc(qkv));
    plan p;
    if (plan_make(&p, c, qkv->shape[0], seq_total, heads, kv_heads, qkv->shape[3])) return NULL;
    if (qkv->shape[1] != p.ntok[p.r]) {
        char why[200];
        snprintf(why, sizeof why, "%s: holds %lld tokens, but splitting the sequence of %lld over %d ranks gives it "
                 "%lld; shard with uly.data's shard option", op, (long long)qkv->shape[1], (long long)seq_total, p.P,
                 (long long)p.ntok[p.r]);
        plan_free(&p);
        uly_comm_all_to_all_refuse(c, why);
        return NULL;
    }
    /* what crosses: bf16 in bf16 precision or for bf16 activations; the result in qkv's dtype */
    const int xt = uly_matmul_bf16() || qkv->dtype == ULY_DTYPE_BF16 ? ULY_DTYPE_BF16 : ULY_DTYPE_F32;
    uly_tensor *src = uly_contiguous_raw(qkv);
    if (src && src != qkv) copies++;
    uly_tensor *send = in_dtype(src, xt);
    int64_t shape[4] = {p.B, p.N, p.w[p.r], p.D};
    uly_tensor *out = send ? uly_new_contiguous(4, shape, qkv->dtype, uly_dev(qkv)) : NULL;
    uly_tensor *recv = out ? receive_buffer(out, xt) : NULL;
    if (out && (!recv || exchange_qkv(c, &p, uly_dev(qkv), uly_ptr(send), uly_ptr(recv), xt) || received(out, recv))) {
        uly_tensor_release(out);
        out = NULL;
    }
    if (out) {
        uly_node *n = uly_node_begin(ULY_OP_ULYSSES_QKV, 1, &qkv);
        if (n) { n->i[0] = (int64_t)(intptr_t)c; n->i[1] = heads; n->i[2] = kv_heads; n->i[3] = seq_total; n->i[4] = xt; }
        uly_node_attach(n, out);
    }
    uly_tensor_release(recv);
    uly_tensor_release(send);
    uly_tensor_release(src);
    plan_free(&p);
    return out;
}

uly_tensor *uly_ulysses_heads_to_seq(uly_comm *c, uly_tensor *o, int64_t heads, int64_t seq_total) {
    const char *op = "ulysses_heads_to_seq";
    if (check_group(op, c) || uly_check_floating(op, "o", o)) return NULL;
    if (o->ndim != 4) return uly_set_error_null("%s: o must be [batch, seq, local_heads, head_dim], got %s", op, uly_desc(o));
    plan p;
    if (plan_make(&p, c, o->shape[0], seq_total, heads, 1, o->shape[3])) return NULL;
    if (o->shape[1] != seq_total || o->shape[2] != p.hq[p.r]) {
        char why[200];
        snprintf(why, sizeof why, "%s: expects [%lld, %lld, %lld, %lld] (the whole sequence for its %lld of %lld heads), "
                 "got %s", op, (long long)p.B, (long long)seq_total, (long long)p.hq[p.r], (long long)p.D,
                 (long long)p.hq[p.r], (long long)heads, uly_desc(o));
        plan_free(&p);
        uly_comm_all_to_all_refuse(c, why);
        return NULL;
    }
    const int xt = uly_matmul_bf16() || o->dtype == ULY_DTYPE_BF16 ? ULY_DTYPE_BF16 : ULY_DTYPE_F32;
    uly_tensor *src = uly_contiguous_raw(o);
    if (src && src != o) copies++;
    uly_tensor *send = in_dtype(src, xt);
    int64_t shape[4] = {p.B, p.ntok[p.r], heads, p.D};
    uly_tensor *out = send ? uly_new_contiguous(4, shape, o->dtype, uly_dev(o)) : NULL;
    uly_tensor *recv = out ? receive_buffer(out, xt) : NULL;
    if (out && (!recv || exchange_out(c, &p, uly_dev(o), uly_ptr(send), uly_ptr(recv), 1, xt) || received(out, recv))) {
        uly_tensor_release(out);
        out = NULL;
    }
    if (out) {
        uly_node *n = uly_node_begin(ULY_OP_ULYSSES_OUT, 1, &o);
        if (n) { n->i[0] = (int64_t)(intptr_t)c; n->i[1] = heads; n->i[3] = seq_total; n->i[4] = xt; }
        uly_node_attach(n, out);
    }
    uly_tensor_release(recv);
    uly_tensor_release(send);
    uly_tensor_release(src);
    plan_free(&p);
    return out;
}

/* backward of qkv_to_heads: each sender receives its heads' gradients for its tokens from every
 * rank into a staging buffer (a K/V head sent to several ranks comes back several times), then
 * adds them into gin; or, where gin is new (n->fresh: autograd.c) and every element of it comes
 * from one rank in gin's dtype, straight into gin, the forward's exchange reversed. */
int uly_bw_ulysses_qkv(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    if (!gin[0]) return 0;
    uly_comm *c = (uly_comm *)(intptr_t)n->i[0];
    uly_tensor *d = gin[0];
    const int dev = uly_dev(d);
    plan p;
    if (plan_make(&p, c, d->shape[0], n->i[3], n->i[1], n->i[2], d->shape[3])) return -1;
    int P = p.P, r = p.r;
    int64_t per_token = 0, kv_sent = 0; /* staging: for each source j, [B, n_r, w_j, D] */
    for (int j = 0; j < P; j++) { per_token += p.w[j]; kv_sent += p.gk[j]; }
    const int xt = (int)n->i[4];   /* the forward's exchange dtype */
    if ((n->fresh & 1) && xt == d->dtype && kv_sent == p.G) {
        uly_tensor *send = in_dtype(g, xt);
        uly_comm_layout *to = malloc(2 * (size_t)P * sizeof *to), *hd = to + P;
        int rc = (!send || !to) ? uly_set_error("ulysses backward: out of memory") : 0;
        for (int j = 0; !rc && j < P; j++) {
            to[j] = run1(p.tok0[j] * p.w[r] * p.D, p.B, p.N * p.w[r] * p.D, p.ntok[j] * p.w[r] * p.D);
            hd[j] = heads_of(&p, j, p.B * p.ntok[r]);
        }
        if (!rc) rc = uly_comm_all_to_all_layout_on(c, dev, uly_ptr(send), to, uly_ptr(d), hd, xt);
        free(to);
        uly_tensor_release(send);
        plan_free(&p);
        return rc;
    }
    if ((n->fresh & 1) && uly_tensor_fill_(d, 0.0)) { plan_free(&p); return -1; }
    int64_t stage_shape[1] = {p.B * p.ntok[r] * per_token * p.D};
    uly_tensor *stage = uly_new_contiguous(1, stage_shape, ULY_DTYPE_F32, dev);
    uly_tensor *send = in_dtype(g, xt), *recv = stage ? receive_buffer(stage, xt) : NULL;
    uly_comm_layout *from = malloc(2 * (size_t)P * sizeof *from), *to = from + P;
    int rc = (!stage || !from || !send || !recv) ? uly_set_error("ulysses backward: out of memory") : 0;
    if (!rc) {
        int64_t at = 0;
        for (int j = 0; j < P; j++) {
            to[j] = run1(p.tok0[j] * p.w[r] * p.D, p.B, p.N * p.w[r] * p.D, p.ntok[j] * p.w[r] * p.D);
            int64_t len = p.B * p.ntok[r] * p.w[j] * p.D;
            from[j] = run1(at, 1, len, len);
            at += len;
        }
        copies++;
        rc = uly_comm_all_to_all_layout_on(c, dev, uly_ptr(send), to, uly_ptr(recv), from, xt);
        if (!rc) rc = received(stage, recv);
    }
    if (!rc && dev != ULY_DEVICE_CPU) { /* the same sums as strided views on the device */
        int64_t D = p.D, W = p.W, at = 0;
        for (int j = 0; j < P; j++) {
            int64_t wj = p.w[j], T = p.B * p.ntok[r], k = 0;
            int64_t part[3][2] = {{p.h0[j], p.hq[j]}, {p.H + p.g0[j], p.gk[j]}, {p.H + p.G + p.g0[j], p.gk[j]}};
            for (int q = 0; q < 3; q++) {
                int64_t len = part[q][1] * D;
                if (len && T) {
                    uly_view dv = {.p = uly_f32(d) + part[q][0] * D, .dtype = ULY_DTYPE_F32, .ndim = 2,
                                   .shape = {T, len}, .stride = {W * D, 1}};
                    uly_view sv = {.p = uly_f32(stage) + at + k, .dtype = ULY_DTYPE_F32, .ndim = 2,
                                   .shape = {T, len}, .stride = {wj * D, 1}};
                    uly_be(d)->sum_view(&dv, &sv, 1.0f);
                }
                k += len;
            }
            at += T * wj * D;
        }
        rc = uly_device_check("ulysses backward", dev);
    } else if (!rc) { /* gin[b, t, heads of j] += stage_j[b, t] */
        float *dst = uly_f32(d);
        const float *s = uly_f32(stage);
        int64_t D = p.D, W = p.W;
        for (int j = 0; j < P; j++) {
            int64_t wj = p.w[j], T = p.B * p.ntok[r];
            int64_t part[3][2] = {{p.h0[j], p.hq[j]}, {p.H + p.g0[j], p.gk[j]}, {p.H + p.G + p.g0[j], p.gk[j]}};
            #pragma omp parallel for if (T * wj * D >= 65536)
            for (int64_t t = 0; t < T; t++) {
                const float *row = s + t * wj * D;
                float *out = dst + t * W * D;
                int64_t k = 0;
                for (int q = 0; q < 3; q++) {
                    int64_t len = part[q][1] * D;
                    float *o = out + part[q][0] * D;
                    for (int64_t e = 0; e < len; e++) o[e] += row[k + e];
                    k += len;
                }
            }
            s += T * wj * D;
        }
    }
    free(from);
    uly_tensor_release(recv);
    uly_tensor_release(send);
    uly_tensor_release(stage);
    plan_free(&p);
    return rc;
}

/* backward of heads_to_seq: the reverse exchange into a staging tensor, added into gin; or
 * straight into gin where it is new (n->fresh) and of the exchange's dtype (every element of it
 * comes from one rank) */
int uly_bw_ulysses_out(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    if (!gin[0]) return 0;
    uly_comm *c = (uly_comm *)(intptr_t)n->i[0];
    uly_tensor *d = gin[0];
    plan p;
    if (plan_make(&p, c, d->shape[0], n->i[3], n->i[1], 1, d->shape[3])) return -1;
    const int xt = (int)n->i[4];
    if ((n->fresh & 1) && xt == d->dtype) {
        uly_tensor *send = in_dtype(g, xt);
        int rc = send ? exchange_out(c, &p, uly_dev(d), uly_ptr(d), uly_ptr(send), 0, xt)
                      : uly_set_error("ulysses backward: out of memory");
        uly_tensor_release(send);
        plan_free(&p);
        return rc;
    }
    if ((n->fresh & 1) && uly_tensor_fill_(d, 0.0)) { plan_free(&p); return -1; }
    uly_tensor *stage = uly_new_like(d);
    uly_tensor *send = in_dtype(g, xt), *recv = stage ? receive_buffer(stage, xt) : NULL;
    int rc = (!stage || !send || !recv) ? uly_set_error("ulysses backward: out of memory")
           : exchange_out(c, &p, uly_dev(d), uly_ptr(recv), uly_ptr(send), 0, xt);
    if (!rc) rc = received(stage, recv);
    if (!rc) {
        copies++;
        uly_be(d)->axpy_accumulate(uly_f32(d), uly_f32(stage), uly_tensor_numel(d), 1.0f);
    }
    uly_tensor_release(recv);
    uly_tensor_release(send);
    uly_tensor_release(stage);
    plan_free(&p);
    return rc;
}

