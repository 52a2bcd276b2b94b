/* core/custom.c — autograd nodes whose backward is a caller-supplied function (the Lua side's
 * activation checkpointing: recompute a segment in backward and backpropagate through it).
 *
 * uly_custom_op(n, inputs, output, fn, id) returns a view of `output` (computed by the caller
 * without recording) whose grad_fn calls fn(id, grad_output, grad_inputs) during backward, where
 * grad_inputs[k] is the buffer input k's gradient accumulates into (NULL when it needs none).
 * When such a node is freed its id is queued; uly_custom_released() hands the ids back so the
 * caller can drop whatever it kept for them (it must not be called back from a free). */
#include <stdlib.h>
#include <string.h>
#include "internal.h"

static int64_t *released;
static int n_released, cap_released;

void uly_custom_note_freed(const uly_node *n) {
    if (n->op != ULY_OP_CUSTOM) return;
    if (n_released == cap_released) {
        int cap = cap_released ? 2 * cap_released : 64;
        int64_t *bigger = realloc(released, (size_t)cap * sizeof *bigger);
        if (!bigger) return; /* the caller keeps its closure: a small leak, never a crash */
        released = bigger;
        cap_released = cap;
    }
    released[n_released++] = n->i[1];
}

int uly_custom_released(int64_t *ids, int cap) {
    if (n_released == 0 || cap <= 0) return 0;
    int n = n_released < cap ? n_released : cap;
    if (n > 0) memcpy(ids, released, (size_t)n * sizeof *ids);
    memmove(released, released + n, (size_t)(n_released - n) * sizeof *released);
    n_released -= n;
    return n;
}

uly_tensor *uly_custom_op(int n_inputs, uly_tensor *const *inputs, uly_tensor *output, uly_custom_backward fn,
                          int64_t id) {
    if (n_inputs < 0 || n_inputs > ULY_NODE_MAX_INPUTS)
        return uly_set_error_null("custom_op: %d inputs (at most %d)", n_inputs, ULY_NODE_MAX_INPUTS);
    if (uly_check_floating("custom_op", "output", output)) return NULL;
    if (!fn) return uly_set_error_null("custom_op: no backward function given");
    for (int k = 0; k < n_inputs; k++)
        if (uly_check_tensor("custom_op", "input", inputs[k])) return NULL;
    if (output->grad_fn) return uly_set_error_null("custom_op: the output %s is already part of a graph; compute it "
                                                   "under no_grad", uly_desc(output));
    uly_tensor *out = uly_new_view(output, output->ndim, output->shape, output->stride, output->offset);
    if (!out) return NULL;
    uly_node *n = uly_node_begin(ULY_OP_CUSTOM, n_inputs, inputs);
    if (n) { n->i[0] = (int64_t)(intptr_t)fn; n->i[1] = id; }
    uly_node_attach(n, out);
    return out;
}

int uly_bw_custom(uly_node *n, uly_tensor *g, uly_tensor **gin) {
    uly_custom_backward fn = (uly_custom_backward)(intptr_t)n->i[0];
    uly_clear_error();
    if (fn(n->i[1], g, gin) == 0) return 0;
    const char *why = uly_last_error();
    if (!why || !*why) return uly_set_error("backward: the custom function %lld failed", (long long)n->i[1]);
    return -1;
}

int uly_fail(const char *message) { return uly_set_error("%s", message ? message : "failed"); }

int uly_tensor_accumulate_(uly_tensor *dst, uly_tensor *src) {
    if (uly_check_float("accumulate_", "dst", dst) || uly_check_float("accumulate_", "src", src)) return -1;
    return uly_sum_to(dst, src, 1.0f);
}
