/* core/backend_sim.c — the simulated device: a backend for device 'cuda' that keeps its memory on
 * the host behind TAGGED pointers (the real address plus 2^47, non-canonical on x86-64), untags
 * them and runs the CPU kernels. Any core code that touches device memory directly instead of
 * going through the table crashes at once, as it would with real device memory, so the whole
 * device path (dispatch, transfers, autograd buffers, pools, optimizers, checkpoints, staging
 * for collectives) is tested on machines without a GPU. Enabled by uly_device_simulate(). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"

#define TAG ((uintptr_t)1 << 47)
#define U(p) ((void *)((p) ? (uintptr_t)(p) - TAG : 0))   /* device -> host address */
#define UF(p) ((float *)U(p))
#define UC(p) ((const float *)U(p))

static char sim_error[256];
/* simulated device memory: ULY_SIM_MEMORY bytes, default 4 GiB */

static int64_t sim_total(void) { /* read every time: specs shrink it to provoke out-of-memory */
    const char *e = getenv("ULY_SIM_MEMORY");
    return (e && atoll(e) > 0) ? atoll(e) : (4LL << 30);
}
static int64_t sim_in_use;

/* every live block sits in a list rooted here, so leak checkers still see the memory behind the
 * tagged pointers; the 256-byte header keeps the data 256-byte aligned, like cudaMalloc's */
typedef struct sim_block { int64_t bytes; struct sim_block *prev, *next; } sim_block;
#define HEADER 256
static sim_block live = {0, &live, &live};

static void *sim_raw_alloc(int64_t bytes) {
    if (sim_in_use + bytes > sim_total()) {
        snprintf(sim_error, sizeof sim_error, "simulated out of memory: %lld bytes requested, %lld of %lld in use",
                 (long long)bytes, (long long)sim_in_use, (long long)sim_total());
        return NULL;
    }
    void *p = NULL;
    if (posix_memalign(&p, 256, (size_t)bytes + HEADER)) {
        snprintf(sim_error, sizeof sim_error, "host allocation of %lld bytes failed", (long long)bytes);
        return NULL;
    }
    sim_block *b = p;
    b->bytes = bytes;
    b->next = live.next;
    b->prev = &live;
    live.next->prev = b;
    live.next = b;
    sim_in_use += bytes;
    return (void *)((uintptr_t)p + HEADER + TAG);
}
static void sim_raw_free(void *p) {
    if (!p) return;
    sim_block *b = (sim_block *)((char *)U(p) - HEADER);
    b->prev->next = b->next;
    b->next->prev = b->prev;
    sim_in_use -= b->bytes;
    free(b);
}
static int sim_memory_info(int64_t *free_b, int64_t *total_b) {
    *total_b = sim_total();
    *free_b = sim_total() - sim_in_use;
    return 0;
}
static int sim_copy(void *dst, const void *src, int64_t bytes, int kind) {
    void *d = kind == ULY_COPY_D2H ? dst : U(dst);
    const void *s = kind == ULY_COPY_H2D ? src : U(src);
    if (bytes > 0) memmove(d, s, (size_t)bytes);
    return 0;
}
static int sim_memset0(void *p, int64_t bytes) { return uly_backend_cpu.memset0(U(p), bytes); }
static int sim_synchronize(void) { return 0; }
static const char *sim_take_error(void) {
    static char taken[256];
    if (!sim_error[0]) return NULL;
    memcpy(taken, sim_error, sizeof taken);
    sim_error[0] = 0;
    return taken;
}

static uly_view host_view(const uly_view *v) { uly_view h = *v; h.p = U(v->p); return h; }
static void sim_copy_view(const uly_view *dst, const uly_view *src) {
    uly_view d = host_view(dst), s = host_view(src);
    uly_backend_cpu.copy_view(&d, &s);
}
static void sim_sum_view(const uly_view *dst, const uly_view *src, float alpha) {
    uly_view d = host_view(dst), s = host_view(src);
    uly_backend_cpu.sum_view(&d, &s, alpha);
}
static void sim_fill_view(const uly_view *dst, double value) {
    uly_view d = host_view(dst);
    uly_backend_cpu.fill_view(&d, value);
}

/* ---- kernels: untag, run the CPU kernel ---- */
static void s_unary_forward(float *o, const float *i, int64_t n, int k) { unary_forward(UF(o), UC(i), n, k); }
static void s_unary_backward(float *di, const float *d, const float *i, const float *o, int64_t n, int k) {
    unary_backward(UF(di), UC(d), UC(i), UC(o), n, k);
}
static void s_swiglu_forward(float *o, const float *g, const float *u, int64_t n) { swiglu_forward(UF(o), UC(g), UC(u), n); }
static void s_swiglu_backward(float *dg, float *du, const float *d, const float *g, const float *u, int64_t n) {
    swiglu_backward(UF(dg), UF(du), UC(d), UC(g), UC(u), n);
}
static void s_reduce_sum_forward(float *o, const float *i, int64_t a, int64_t n, int64_t b, float s) {
    reduce_sum_forward(UF(o), UC(i), a, n, b, s);
}
static void s_reduce_sum_backward(float *di, const float *d, int64_t a, int64_t n, int64_t b, float s) {
    reduce_sum_backward(UF(di), UC(d), a, n, b, s);
}
static void s_reduce_max_forward(float *o, int64_t *am, const float *i, int64_t a, int64_t n, int64_t b) {
    reduce_max_forward(UF(o), (int64_t *)U(am), UC(i), a, n, b);
}
static void s_reduce_max_backward(float *di, const float *d, const int64_t *am, int64_t a, int64_t n, int64_t b) {
    reduce_max_backward(UF(di), UC(d), (const int64_t *)U(am), a, n, b);
}
static void s_softmax_forward(float *o, const float *i, int64_t a, int64_t n, int64_t b, int l) {
    softmax_forward(UF(o), UC(i), a, n, b, l);
}
static void s_softmax_backward(float *di, const float *d, const float *o, int64_t a, int64_t n, int64_t b, int l) {
    softmax_backward(UF(di), UC(d), UC(o), a, n, b, l);
}
static void s_layernorm_forward(float *o, float *m, float *r, const float *i, const float *w, const float *b,
                                int64_t rows, int64_t C, float eps) {
    layernorm_forward(UF(o), UF(m), UF(r), UC(i), UC(w), UC(b), rows, C, eps);
}
static void s_layernorm_backward(float *di, float *dw, float *db, const float *d, const float *i, const float *w,
                                 const float *m, const float *r, int64_t rows, int64_t C) {
    layernorm_backward(UF(di), UF(dw), UF(db), UC(d), UC(i), UC(w), UC(m), UC(r), rows, C);
}
static void s_rmsnorm_forward(float *o, float *r, const float *i, const float *w, int64_t rows, int64_t C, float eps) {
    rmsnorm_forward(UF(o), UF(r), UC(i), UC(w), rows, C, eps);
}
static void s_rmsnorm_backward(float *di, float *dw, const float *d, const float *i, const float *w, const float *r,
                               int64_t rows, int64_t C) {
    rmsnorm_backward(UF(di), UF(dw), UC(d), UC(i), UC(w), UC(r), rows, C);
}
static void s_embedding_forward(float *o, const void *idx, int ib, const float *w, int64_t n, int64_t C) {
    embedding_forward(UF(o), U(idx), ib, UC(w), n, C);
}
static void s_embedding_backward(float *dw, const float *d, const void *idx, int ib, int64_t n, int64_t C) {
    embedding_backward(UF(dw), UC(d), U(idx), ib, n, C);
}
static int64_t s_embedding_first_bad_index(const void *idx, int ib, int64_t n, int64_t V) {
    return embedding_first_bad_index(U(idx), ib, n, V);
}
static void s_rope_forward(float *o, const float *i, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, float th) {
    rope_forward(UF(o), UC(i), B, T, H, D, off, th);
}
static void s_rope_backward(float *di, const float *d, int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, float th) {
    rope_backward(UF(di), UC(d), B, T, H, D, off, th);
}
static void s_dropout_forward(float *o, const float *i, int64_t n, float p, uint64_t seed, uint64_t off) {
    dropout_forward(UF(o), UC(i), n, p, seed, off);
}
static void s_dropout_backward(float *di, const float *d, int64_t n, float p, uint64_t seed, uint64_t off) {
    dropout_backward(UF(di), UC(d), n, p, seed, off);
}
static int64_t s_cross_entropy_forward(float *loss, float *lse, const float *lg, const void *t, int tb, int64_t rows,
                                       int64_t V, int64_t ig) {
    return cross_entropy_forward(UF(loss), UF(lse), UC(lg), U(t), tb, rows, V, ig);
}
static void s_cross_entropy_backward(float *dl, const float *dloss, const float *lg, const float *lse, const void *t,
                                     int tb, int64_t rows, int64_t V, int64_t ig) {
    cross_entropy_backward(UF(dl), UC(dloss), UC(lg), UC(lse), U(t), tb, rows, V, ig);
}
static void s_attention_forward(float *o, float *pr, const float *q, const float *k, const float *v, int64_t B,
                                int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t D, float sc, int ca) {
    attention_forward(UF(o), UF(pr), UC(q), UC(k), UC(v), B, Tq, Tk, H, Hkv, D, sc, ca);
}
static int s_attention_backward(float *dq, float *dk, float *dv, const float *d, const float *q, const float *k,
                                const float *v, const float *pr, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                                int64_t Hkv, int64_t D, float sc, int ca) {
    return attention_backward(UF(dq), UF(dk), UF(dv), UC(d), UC(q), UC(k), UC(v), UC(pr), B, Tq, Tk, H, Hkv, D, sc, ca);
}
static void s_binary_forward(float *o, const float *a, const int64_t *sa, const float *b, const int64_t *sb, int nd,
                             const int64_t *shape, int kind) {
    binary_forward(UF(o), UC(a), sa, UC(b), sb, nd, shape, kind);
}
static void s_scalar_forward(float *o, const float *a, int64_t n, int kind, float s) { scalar_forward(UF(o), UC(a), n, kind, s); }
static void s_scalar_backward(float *di, const float *d, const float *a, int64_t n, int kind, float s) {
    scalar_backward(UF(di), UC(d), UC(a), n, kind, s);
}
static void s_axpy_accumulate(float *y, const float *x, int64_t n, float al) { axpy_accumulate(UF(y), UC(x), n, al); }
static void s_gemm_batched(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                           int64_t K, float beta) {
    A.p = UF(A.p); B.p = UF(B.p); C.p = UF(C.p);
    gemm_batched(nb, bshape, A, B, C, M, N, K, beta);
}
static void s_gemm_batched_rounded(int nb, const int64_t *bshape, uly_mat A, uly_mat B, uly_mat C, int64_t M, int64_t N,
                                   int64_t K, float beta) {
    A.p = UF(A.p); B.p = UF(B.p); C.p = UF(C.p);
    gemm_batched_rounded(nb, bshape, A, B, C, M, N, K, beta);
}
static flash_problem host_problem(const flash_problem *p) {
    flash_problem h = *p;
    h.q.p = UC(p->q.p); h.k.p = UC(p->k.p); h.v.p = UC(p->v.p);
    h.layout = U(p->layout); h.q_doc = U(p->q_doc); h.k_doc = U(p->k_doc);
    return h;
}
static int s_flash_forward(float *o, float *lse, float *scr, const flash_problem *p) {
    flash_problem h = host_problem(p);
    return flash_attention_forward(UF(o), UF(lse), UF(scr), &h);
}
static int s_flash_backward(float *dq, float *dk, float *dv, const float *d, const float *o, const float *lse,
                            float *delta, float *scr, const flash_problem *p) {
    flash_problem h = host_problem(p);
    return flash_attention_backward(UF(dq), UF(dk), UF(dv), UC(d), UC(o), UC(lse), UF(delta), UF(scr), &h);
}
static void s_optim_adamw(float *p, const float *g, float *m, float *v, int64_t n, float dc, float b1, float a1,
                          float b2, float a2, float ss, float bc2, float eps) {
    optim_adamw(UF(p), UC(g), UF(m), UF(v), n, dc, b1, a1, b2, a2, ss, bc2, eps);
}
static void s_optim_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float wd, float mom, float keep,
                        int nest, int init) {
    optim_sgd(UF(p), UC(g), UF(buf), n, lr, wd, mom, keep, nest, init);
}
static double s_optim_sumsq(const float *x, int64_t n) { return optim_sumsq(UC(x), n); }
static void s_optim_scale(float *x, int64_t n, float s) { optim_scale(UF(x), n, s); }

/* the one-launch AdamW of a device backend, as the loop it stands for (exercises the core's path) */
static void s_optim_adamw_multi(int n, float *const *p, const float *const *g, float *const *m, float *const *v,
                                const int64_t *sizes, const float *decay, float b1, float a1, float b2, float a2,
                                float ss, float bc2, float eps) {
    for (int i = 0; i < n; i++)
        optim_adamw(UF(p[i]), UC(g[i]), UF(m[i]), UF(v[i]), sizes[i], decay[i], b1, a1, b2, a2, ss, bc2, eps);
}

static void s_pack_layout(void *dst, const void *src, const uly_comm_layout *L, int64_t es) {
    uly_backend_cpu.pack_layout(U(dst), U(src), L, es);
}
static void s_unpack_layout(void *dst, const uly_comm_layout *L, const void *src, int64_t es) {
    uly_backend_cpu.unpack_layout(U(dst), L, U(src), es);
}

const uly_backend uly_backend_sim = {
    .abi = ULY_BACKEND_ABI, .size = sizeof(uly_backend), .name = "sim",
    .raw_alloc = sim_raw_alloc, .raw_free = sim_raw_free, .memory_info = sim_memory_info, .copy = sim_copy,
    .memset0 = sim_memset0, .synchronize = sim_synchronize, .take_error = sim_take_error,
    .copy_view = sim_copy_view, .sum_view = sim_sum_view, .fill_view = sim_fill_view,
    .unary_forward = s_unary_forward, .unary_backward = s_unary_backward,
    .swiglu_forward = s_swiglu_forward, .swiglu_backward = s_swiglu_backward,
    .reduce_sum_forward = s_reduce_sum_forward, .reduce_sum_backward = s_reduce_sum_backward,
    .reduce_max_forward = s_reduce_max_forward, .reduce_max_backward = s_reduce_max_backward,
    .softmax_forward = s_softmax_forward, .softmax_backward = s_softmax_backward,
    .layernorm_forward = s_layernorm_forward, .layernorm_backward = s_layernorm_backward,
    .rmsnorm_forward = s_rmsnorm_forward, .rmsnorm_backward = s_rmsnorm_backward,
    .embedding_forward = s_embedding_forward, .embedding_backward = s_embedding_backward,
    .embedding_first_bad_index = s_embedding_first_bad_index,
    .rope_forward = s_rope_forward, .rope_backward = s_rope_backward,
    .dropout_forward = s_dropout_forward, .dropout_backward = s_dropout_backward,
    .cross_entropy_forward = s_cross_entropy_forward, .cross_entropy_backward = s_cross_entropy_backward,
    .attention_forward = s_attention_forward, .attention_backward = s_attention_backward,
    .binary_forward = s_binary_forward, .scalar_forward = s_scalar_forward, .scalar_backward = s_scalar_backward,
    .axpy_accumulate = s_axpy_accumulate, .gemm_operand_ok = gemm_operand_ok, .gemm_batched = s_gemm_batched,
    .gemm_batched_rounded = s_gemm_batched_rounded, .gemm_rounds_operands = gemm_bf16_on,
    .flash_attention_scratch_floats = flash_attention_scratch_floats,
    .flash_attention_forward = s_flash_forward, .flash_attention_backward = s_flash_backward,
    .optim_adamw = s_optim_adamw, .optim_sgd = s_optim_sgd, .optim_sumsq = s_optim_sumsq, .optim_scale = s_optim_scale,
    .pack_layout = s_pack_layout, .unpack_layout = s_unpack_layout,
    .optim_adamw_multi = s_optim_adamw_multi,
    /* no device collectives: exchanges of simulated device memory stage through the host */
};
