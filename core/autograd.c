/* core/autograd.c — the autograd engine. Ops record a node per result (uly_node_begin/attach):
 * the op, edges to the nodes or leaves of its inputs, and the tensors saved for backward.
 * Nodes carry a creation sequence number, so sorting the reachable nodes by decreasing seq
 * replays the recorded tape backwards. The backward rules themselves live in backward.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "internal.h"

static int grad_enabled = 1;
static uint64_t next_seq = 1;
static int64_t live_nodes;

int uly_grad_enabled(void) { return grad_enabled; }
int uly_set_grad_enabled(int enabled) {
    int prev = grad_enabled;
    grad_enabled = enabled != 0;
    return prev;
}
int64_t uly_autograd_live_nodes(void) { return live_nodes; }

static const char *op_names[ULY_OP_COUNT] = {
    [ULY_OP_NONE] = "None", [ULY_OP_ADD] = "AddBackward", [ULY_OP_SUB] = "SubBackward",
    [ULY_OP_MUL] = "MulBackward", [ULY_OP_DIV] = "DivBackward", [ULY_OP_ADD_SCALAR] = "AddScalarBackward",
    [ULY_OP_MUL_SCALAR] = "MulScalarBackward", [ULY_OP_POW_SCALAR] = "PowScalarBackward",
    [ULY_OP_MATMUL] = "MatmulBackward", [ULY_OP_SUM] = "SumBackward", [ULY_OP_MAX] = "MaxBackward",
    [ULY_OP_SOFTMAX] = "SoftmaxBackward", [ULY_OP_LOG_SOFTMAX] = "LogSoftmaxBackward",
    [ULY_OP_LAYERNORM] = "LayerNormBackward", [ULY_OP_RMSNORM] = "RMSNormBackward",
    [ULY_OP_UNARY] = "UnaryBackward", [ULY_OP_SWIGLU] = "SwiGLUBackward", [ULY_OP_EMBEDDING] = "EmbeddingBackward",
    [ULY_OP_ROPE] = "RoPEBackward", [ULY_OP_DROPOUT] = "DropoutBackward",
    [ULY_OP_CROSS_ENTROPY] = "CrossEntropyBackward", [ULY_OP_ATTENTION] = "AttentionBackward",
    [ULY_OP_CUSTOM] = "CustomBackward", [ULY_OP_ULYSSES_QKV] = "UlyssesQKVBackward", [ULY_OP_ULYSSES_OUT] = "UlyssesOutBackward",
    [ULY_OP_VIEW] = "ViewBackward", [ULY_OP_PERMUTE] = "PermuteBackward", [ULY_OP_NARROW] = "NarrowBackward",
    [ULY_OP_EXPAND] = "ExpandBackward", [ULY_OP_COPY] = "CopyBackward", [ULY_OP_CAT] = "CatBackward",
    [ULY_OP_FLASH_ATTENTION] = "FlashAttentionBackward", [ULY_OP_ADDMM] = "AddmmBackward",
};
const char *uly_op_name(int op) { return (op >= 0 && op < ULY_OP_COUNT && op_names[op]) ? op_names[op] : "?"; }

/* ---- recording ---- */
uly_node *uly_node_begin(int op, int n_inputs, uly_tensor *const *inputs) {
    if (!grad_enabled) return NULL;
    int any = 0;
    for (int k = 0; k < n_inputs; k++) any |= inputs[k] && inputs[k]->requires_grad;
    if (!any) return NULL;
    uly_node *n = calloc(1, sizeof *n);
    if (!n) return NULL; /* out of memory for a node: the result simply has no history */
    live_nodes++;
    n->refcount = 1;
    n->seq = next_seq++;
    n->op = op;
    n->n_inputs = n_inputs;
    for (int k = 0; k < n_inputs; k++) {
        uly_tensor *t = inputs[k];
        uly_edge *e = &n->inputs[k];
        if (!t) continue;
        e->ndim = t->ndim;
        e->device = uly_dev(t);
        memcpy(e->shape, t->shape, sizeof e->shape);
        if (!t->requires_grad) continue;
        if (t->grad_fn) { e->node = t->grad_fn; e->node->refcount++; }
        else { e->leaf = t; t->refcount++; }
    }
    return n;
}

void uly_node_save(uly_node *n, uly_tensor *t) {
    if (!n || !t) return;
    t->refcount++;
    n->saved_version[n->n_saved] = t->storage->version;
    n->saved[n->n_saved++] = t;
}

void uly_node_attach(uly_node *n, uly_tensor *out) {
    if (!n || !out) { uly_node_release(n); return; }
    n->out_ndim = out->ndim;
    memcpy(n->out_shape, out->shape, sizeof n->out_shape);
    out->grad_fn = n;
    out->requires_grad = 1;
}

static void release_saved(uly_node *n) {
    for (int k = 0; k < n->n_saved; k++) { uly_tensor_release(n->saved[k]); n->saved[k] = NULL; }
}

/* iterative release: dropping the last handle of a deep graph must not recurse per node */
void uly_node_release(uly_node *n) {
    uly_node *stack_small[64], **stack = stack_small;
    int64_t top = 0, cap = 64;
    if (!n) return;
    stack[top++] = n;
    while (top) {
        uly_node *x = stack[--top];
        if (--x->refcount > 0) continue;
        uly_custom_note_freed(x);
        release_saved(x);
        uly_tensor_release(x->grad_out);
        for (int k = 0; k < x->n_inputs; k++) {
            uly_tensor_release(x->inputs[k].leaf);
            uly_node *c = x->inputs[k].node;
            if (!c) continue;
            if (top == cap) {
                uly_node **bigger = malloc((size_t)cap * 2 * sizeof *bigger);
                if (!bigger) { uly_node_release(c); continue; } /* fall back to recursion */
                memcpy(bigger, stack, (size_t)top * sizeof *bigger);
                if (stack != stack_small) free(stack);
                stack = bigger;
                cap *= 2;
            }
            stack[top++] = c;
        }
        live_nodes--;
        free(x);
    }
    if (stack != stack_small) free(stack);
}

/* ---- tensor-level autograd API ---- */
int uly_tensor_set_requires_grad(uly_tensor *t, int flag) {
    if (uly_check_tensor("requires_grad_", "tensor", t)) return -1;
    if (t->grad_fn) {
        if (flag) return 0;
        return uly_set_error("requires_grad_(false): %s is not a leaf (it was computed by %s); use :detach()",
                             uly_desc(t), uly_op_name(t->grad_fn->op));
    }
    if (flag && t->dtype != ULY_DTYPE_F32 && t->dtype != ULY_DTYPE_F64 && t->dtype != ULY_DTYPE_BF16)
        return uly_set_error("requires_grad_: only floating-point tensors can require gradients, got %s", uly_desc(t));
    t->requires_grad = flag != 0;
    return 0;
}
int uly_tensor_requires_grad(const uly_tensor *t) { return t && t->requires_grad; }
int uly_tensor_is_leaf(const uly_tensor *t) { return t && !t->grad_fn; }
const char *uly_tensor_grad_fn_name(const uly_tensor *t) { return t && t->grad_fn ? uly_op_name(t->grad_fn->op) : NULL; }

uly_tensor *uly_tensor_grad(const uly_tensor *t) {
    if (!t || !t->grad) return NULL;
    t->grad->refcount++;
    return t->grad;
}

int uly_tensor_set_grad(uly_tensor *t, uly_tensor *grad) {
    if (uly_check_tensor("set_grad", "tensor", t)) return -1;
    if (grad && (!uly_same_shape(t, grad) || grad->dtype != ULY_DTYPE_F32))
        return uly_set_error("set_grad: gradient %s does not match tensor %s (needs f32 of the same shape)",
                             uly_desc(grad), uly_desc(t));
    if (grad) grad->refcount++;
    uly_tensor_release(t->grad);
    t->grad = grad;
    return 0;
}

int uly_tensor_zero_grad(uly_tensor *t, int set_to_none) {
    if (uly_check_tensor("zero_grad", "tensor", t)) return -1;
    if (!t->grad) return 0;
    if (set_to_none) { uly_tensor_release(t->grad); t->grad = NULL; return 0; }
    return uly_tensor_fill_(t->grad, 0.0);
}

uly_tensor *uly_tensor_detach(uly_tensor *t) {
    if (uly_check_tensor("detach", "tensor", t)) return NULL;
    return uly_new_view(t, t->ndim, t->shape, t->stride, t->offset);
}

/* ---- backward ---- */
static int cmp_seq_desc(const void *a, const void *b) {
    uint64_t x = (*(uly_node *const *)a)->seq, y = (*(uly_node *const *)b)->seq;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* all nodes reachable from root (each once), via an explicit stack; marks with `mark` */
static uly_node **collect(uly_node *root, int64_t *count) {
    int64_t cap = 256, n = 0, top = 0, scap = 256;
    uly_node **out = malloc((size_t)cap * sizeof *out), **stack = malloc((size_t)scap * sizeof *stack);
    /* visited set: an open-addressing hash of node pointers */
    int64_t hcap = 1024, hn = 0;
    uly_node **hash = calloc((size_t)hcap, sizeof *hash);
    if (!out || !stack || !hash) goto oom;
    stack[top++] = root;
    while (top) {
        uly_node *x = stack[--top];
        uintptr_t h = ((uintptr_t)x >> 4) * 11400714819323198485ull;
        int64_t i = (int64_t)(h & (uintptr_t)(hcap - 1));
        int seen = 0;
        while (hash[i]) { if (hash[i] == x) { seen = 1; break; } i = (i + 1) & (hcap - 1); }
        if (seen) continue;
        hash[i] = x;
        if (++hn * 2 > hcap) { /* grow and rehash */
            int64_t ncap = hcap * 2;
            uly_node **nh = calloc((size_t)ncap, sizeof *nh);
            if (!nh) goto oom;
            for (int64_t j = 0; j < hcap; j++) {
                if (!hash[j]) continue;
                uintptr_t hh = ((uintptr_t)hash[j] >> 4) * 11400714819323198485ull;
                int64_t k = (int64_t)(hh & (uintptr_t)(ncap - 1));
                while (nh[k]) k = (k + 1) & (ncap - 1);
                nh[k] = hash[j];
            }
            free(hash);
            hash = nh;
            hcap = ncap;
        }
        if (n == cap) { cap *= 2; uly_node **o2 = realloc(out, (size_t)cap * sizeof *o2); if (!o2) goto oom; out = o2; }
        out[n++] = x;
        for (int k = 0; k < x->n_inputs; k++) {
            if (!x->inputs[k].node) continue;
            if (top == scap) { scap *= 2; uly_node **s2 = realloc(stack, (size_t)scap * sizeof *s2); if (!s2) goto oom; stack = s2; }
            stack[top++] = x->inputs[k].node;
        }
    }
    free(stack);
    free(hash);
    qsort(out, (size_t)n, sizeof *out, cmp_seq_desc);
    *count = n;
    return out;
oom:
    free(out); free(stack); free(hash);
    uly_set_error("backward: out of memory while collecting the graph");
    return NULL;
}

/* ---- backward profiler: wall time per backward rule (uly_profile_*) ---- */
static int profile_on;
static double profile_seconds[ULY_OP_COUNT];
static int64_t profile_calls[ULY_OP_COUNT];
static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
void uly_profile_enable(int on) { profile_on = on != 0; }
void uly_profile_reset(void) {
    memset(profile_seconds, 0, sizeof profile_seconds);
    memset(profile_calls, 0, sizeof profile_calls);
}
int64_t uly_profile_report(char *buf, int64_t buflen) {
    int64_t used = 0;
    for (int op = 0; op < ULY_OP_COUNT; op++) {
        if (!profile_calls[op]) continue;
        char line[160];
        int n = snprintf(line, sizeof line, "%s %lld %.9f\n", uly_op_name(op), (long long)profile_calls[op],
                         profile_seconds[op]);
        if (buf && used + n < buflen) memcpy(buf + used, line, (size_t)n);
        used += n;
    }
    if (buf && used < buflen) buf[used] = 0;
    return used + 1;
}

/* the buffer that input edge e accumulates into: created zeroed on first use, or left
 * uninitialised when the rule can write it (*fresh set then) */
static uly_tensor *edge_grad_fresh(uly_edge *e, int can_write, int *fresh) {
    uly_tensor **slot = e->node ? &e->node->grad_out : &e->leaf->grad;
    if (!*slot && can_write) {
        *slot = uly_new_contiguous(e->ndim, e->shape, ULY_DTYPE_F32, e->device);
        if (*slot) *fresh = 1;
        return *slot;
    }
    if (!*slot) *slot = uly_new_zeros(e->ndim, e->shape, ULY_DTYPE_F32, e->device);
    else if (e->node && e->node->grad_out_borrowed) { /* about to accumulate: take a private copy */
        uly_tensor *own = uly_new_contiguous(e->ndim, e->shape, ULY_DTYPE_F32, e->device);
        if (!own) return NULL;
        if (uly_copy_raw(own, *slot)) { uly_tensor_release(own); return NULL; }
        uly_tensor_release(*slot);
        *slot = own;
        e->node->grad_out_borrowed = 0;
    }
    return *slot;
}

/* Ops whose gradient for input k is the output gradient itself, reshaped (views, and add/sub's
 * first input without broadcasting): when that input's node has no gradient yet, hand it a view
 * of g instead of zeroing a buffer and copying g into it. */
static int passes_gradient_through(const uly_node *n, int k) {
    const uly_edge *e = &n->inputs[k];
    if (!e->node || e->node->grad_out) return 0;
    switch (n->op) {
    case ULY_OP_VIEW: return 1;
    case ULY_OP_ADD: case ULY_OP_SUB:
        if (n->op == ULY_OP_SUB && k == 1) return 0;
        if (e->ndim != n->out_ndim) return 0;
        for (int d = 0; d < e->ndim; d++) if (e->shape[d] != n->out_shape[d]) return 0;
        return 1;
    default: return 0;
    }
}

static int pass_gradient(uly_edge *e, uly_tensor *g) {
    int64_t stride[ULY_MAX_DIMS], s = 1;
    for (int d = e->ndim - 1; d >= 0; d--) { stride[d] = s; s *= e->shape[d]; }
    uly_tensor *v = uly_new_view(g, e->ndim, e->shape, stride, g->offset);
    if (!v) return -1;
    e->node->grad_out = v;
    e->node->grad_out_borrowed = 1;
    return 0;
}

static uly_tensor *edge_grad(uly_edge *e) {
    int fresh = 0;
    return edge_grad_fresh(e, 0, &fresh);
}

/* rules that can write input k's uninitialised gradient buffer (n->fresh) instead of adding into zeros */
static int writes_fresh(int op, int k) {
    return op == ULY_OP_MATMUL || (op == ULY_OP_ADDMM && k < 2) || op == ULY_OP_ULYSSES_QKV || op == ULY_OP_ULYSSES_OUT;
}

/* bf16 activations: ops save bf16 inputs as bf16, and the rules compute in f32, so each such saved
 * tensor reaches its rule as an f32 copy, made just before and freed just after; except where the
 * rule reads bf16 itself: a custom node's Lua function (it sees what it saved), flash attention's
 * q, k, v (bf16 only where the backend takes them so), the GEMM operands of a bf16-precision
 * matmul on a backend with bf16 GEMMs, and the inputs of norms, activations, SwiGLU and
 * cross-entropy on a backend with their bf16 kernels (uly_backend.h) */
static int rule_reads_bf16(const uly_node *n, int k) {
    const uly_backend *be = uly_be(n->saved[k]);
    switch (n->op) {
    case ULY_OP_CUSTOM: return 1;
    case ULY_OP_FLASH_ATTENTION: return k != 3;
    case ULY_OP_MATMUL: case ULY_OP_ADDMM: return n->i[0] && be->gemm_batched_bf16 && k < 2;
    case ULY_OP_LAYERNORM: return k == 0 && be->layernorm_backward_bf16;
    case ULY_OP_RMSNORM: return k == 0 && be->rmsnorm_backward_bf16;
    case ULY_OP_CROSS_ENTROPY: return k == 0 && be->cross_entropy_backward_bf16;
    case ULY_OP_SWIGLU: return k < 2 && be->swiglu_backward_bf16 && n->saved[0]->dtype == n->saved[1]->dtype;
    case ULY_OP_UNARY: return k < 2 && be->unary_backward_bf16 && n->saved[0]->dtype == n->saved[1]->dtype;
    default: return 0;
    }
}

/* swaps f32 copies in for the node's bf16 saved tensors (the originals into orig); -1 on failure */
static int saved_as_f32(uly_node *n, uly_tensor **orig) {
    for (int k = 0; k < n->n_saved; k++) {
        uly_tensor *t = n->saved[k];
        if (!t || t->dtype != ULY_DTYPE_BF16 || rule_reads_bf16(n, k)) continue;
        uly_tensor *f = uly_contiguous_f32(t);
        if (!f) return -1;
        orig[k] = t;
        n->saved[k] = f;
    }
    return 0;
}

static void saved_restore(uly_node *n, uly_tensor **orig) {
    for (int k = 0; k < n->n_saved; k++)
        if (orig[k]) { uly_tensor_release(n->saved[k]); n->saved[k] = orig[k]; }
}

static int run_node(uly_node *n, int retain_graph) {
    if (n->released)
        return uly_set_error("backward: trying to backward through %s a second time, but its saved tensors were "
                             "freed by the first backward; pass retain_graph=true to the first backward",
                             uly_op_name(n->op));
    for (int k = 0; k < n->n_saved; k++)
        if (n->saved[k] && n->saved[k]->storage->version != n->saved_version[k])
            return uly_set_error("backward: a tensor %s saved by %s was modified in place after it was used "
                                 "(version %llu, expected %llu); clone it before writing into it",
                                 uly_desc(n->saved[k]), uly_op_name(n->op),
                                 (unsigned long long)n->saved[k]->storage->version,
                                 (unsigned long long)n->saved_version[k]);
    uly_tensor *gin[ULY_NODE_MAX_INPUTS] = {0}, *tmp[ULY_NODE_MAX_INPUTS] = {0};
    int rc = 0;
    int pending = 0;
    for (int k = 0; k < n->n_inputs && !rc; k++) {
        uly_edge *e = &n->inputs[k];
        if (!e->node && !e->leaf) continue;
        if (uly_tensor_is_contiguous(n->grad_out) && passes_gradient_through(n, k)) {
            rc = pass_gradient(e, n->grad_out);
            continue;
        }
        pending++;
        int fresh = 0;
        gin[k] = edge_grad_fresh(e, writes_fresh(n->op, k), &fresh);
        if (!gin[k]) { rc = -1; break; }
        if (fresh) n->fresh |= 1 << k;
        for (int j = 0; j < k; j++) /* the same input twice (x * x): accumulate separately, add after */
            if (gin[j] == gin[k]) {
                tmp[k] = uly_new_zeros(e->ndim, e->shape, ULY_DTYPE_F32, e->device);
                if (!tmp[k]) rc = -1;
                gin[k] = tmp[k];
                break;
            }
    }
    double t0 = profile_on ? now_seconds() : 0;
    uly_tensor *orig[ULY_NODE_MAX_SAVED] = {0};
    if (!rc && pending) rc = saved_as_f32(n, orig);
    if (!rc && pending) rc = uly_backward_rules[n->op](n, n->grad_out, gin);
    saved_restore(n, orig);
    for (int k = 0; rc && k < n->n_inputs; k++)  /* a failed rule leaves no uninitialised gradient behind */
        if ((n->fresh >> k) & 1) uly_tensor_fill_(gin[k], 0.0);
    n->fresh = 0;
    if (!rc && pending) rc = uly_device_check(uly_op_name(n->op), ULY_DEVICE_CUDA);
    for (int k = 0; !rc && k < n->n_inputs; k++) /* a leaf's grad changed: its version says so */
        if (gin[k] && !n->inputs[k].node) uly_bump_version(gin[k]);
    for (int k = 0; k < n->n_inputs; k++) {
        if (!tmp[k]) continue;
        if (!rc) {
            uly_tensor *dst = edge_grad(&n->inputs[k]);
            if (dst) uly_be(dst)->axpy_accumulate(uly_f32(dst), uly_f32(tmp[k]), uly_tensor_numel(dst), 1.0f);
            else rc = -1;
        }
        uly_tensor_release(tmp[k]);
    }
    uly_tensor_release(n->grad_out);
    n->grad_out = NULL;
    n->grad_out_borrowed = 0;
    if (profile_on) { profile_seconds[n->op] += now_seconds() - t0; profile_calls[n->op]++; }
    /* a node that saved nothing (views, add, ...) stays usable, as a view reused in a new forward */
    if (!retain_graph && !rc && n->n_saved) { release_saved(n); n->released = 1; }
    return rc;
}

int uly_backward(uly_tensor *root, uly_tensor *grad, int retain_graph) {
    if (uly_check_tensor("backward", "tensor", root)) return -1;
    if (!root->requires_grad)
        return uly_set_error("backward: %s does not require grad and has no grad_fn; did you forget "
                             "requires_grad=true on a parameter, or run the forward inside no_grad?", uly_desc(root));
    if (grad) {
        if (!uly_same_shape(grad, root) || grad->dtype != ULY_DTYPE_F32)
            return uly_set_error("backward: gradient %s does not match the output %s", uly_desc(grad), uly_desc(root));
    } else if (uly_tensor_numel(root) != 1) {
        return uly_set_error("backward: the output %s is not a scalar; pass a gradient of the same shape",
                             uly_desc(root));
    }
    int prev = uly_set_grad_enabled(0);
    uly_tensor *g0 = uly_new_contiguous(root->ndim, root->shape, ULY_DTYPE_F32, uly_dev(root));
    if (!g0) { uly_set_grad_enabled(prev); return -1; }
    if (grad ? uly_copy_raw(g0, grad) : uly_tensor_fill_(g0, 1.0)) {
        uly_tensor_release(g0);
        uly_set_grad_enabled(prev);
        return -1;
    }

    int rc = 0;
    if (!root->grad_fn) { /* a leaf: backward is just accumulation */
        uly_edge e = {.leaf = root, .ndim = root->ndim, .device = uly_dev(root)};
        memcpy(e.shape, root->shape, sizeof e.shape);
        uly_tensor *dst = edge_grad(&e);
        if (!dst) rc = -1;
        else uly_be(dst)->axpy_accumulate(uly_f32(dst), uly_f32(g0), uly_tensor_numel(dst), 1.0f);
        uly_tensor_release(g0);
        uly_set_grad_enabled(prev);
        return rc;
    }
    int64_t count = 0;
    uly_node **order = collect(root->grad_fn, &count);
    if (!order) { uly_tensor_release(g0); uly_set_grad_enabled(prev); return -1; }
    if (root->grad_fn->released) {
        rc = run_node(root->grad_fn, retain_graph); /* reports the error */
        uly_tensor_release(g0);
    } else {
        uly_tensor_release(root->grad_fn->grad_out);
        root->grad_fn->grad_out = g0;
        root->grad_fn->grad_out_borrowed = 0;
        for (int64_t k = 0; k < count && !rc; k++) {
            if (!order[k]->grad_out) continue; /* no gradient reached this node */
            rc = run_node(order[k], retain_graph);
        }
    }
    for (int64_t k = 0; k < count; k++) {
        uly_tensor_release(order[k]->grad_out);
        order[k]->grad_out = NULL;
        order[k]->grad_out_borrowed = 0;
    }
    free(order);
    uly_set_grad_enabled(prev);
    return rc;
}
