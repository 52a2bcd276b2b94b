/* core/optim.c — the optimizer entry points of uly.h: uly_adamw_step, uly_sgd_step, uly_grad_norm
 * and uly_grad_scale_. Each validates the whole list first (so a bad tensor leaves every parameter
 * untouched), then runs the loops of kernels/cpu/optim.c once per parameter that has a grad.
 * Parameters are contiguous f32 CPU leaves updated in place (their storage version is bumped, so
 * a graph that saved a parameter before the step notices). Messages number tensors 1-based, in
 * the order of the list, as the Lua package's opt.params does. */
#include <math.h>
#include <stdlib.h>
#include "internal.h"

/* a parameter (or a gradient / state tensor) the update loops can run over: f32, contiguous (on
 * any device; the parameter's gradient and state must be on its device, see check_like) */
static int check_f32_contig(const char *op, int i, int n, const char *what, const uly_tensor *t) {
    if (!t) return uly_set_error("%s: parameter %d of %d: %s is NULL (a freed or missing tensor)", op, i + 1, n, what);
    if (t->dtype != ULY_DTYPE_F32)
        return uly_set_error("%s: parameter %d of %d: %s is %s; optimizers update f32 tensors only (keep master "
                             "weights in f32, convert with :float())", op, i + 1, n, what, uly_desc(t));
    if (!uly_tensor_is_contiguous(t))
        return uly_set_error("%s: parameter %d of %d: %s %s is not contiguous; make it contiguous "
                             "(:contiguous()) before handing it to the optimizer", op, i + 1, n, what, uly_desc(t));
    return 0;
}

/* t (a gradient or a state tensor) must have the parameter's shape */
static int check_like(const char *op, int i, int n, const char *what, const uly_tensor *p, const uly_tensor *t) {
    if (check_f32_contig(op, i, n, what, t)) return -1;
    if (uly_dev(p) != uly_dev(t))
        return uly_set_error("%s: parameter %d of %d: %s is on %s but the parameter is on %s; create optimizer state "
                             "after moving the model (model:to(device)), or move it with :to()", op, i + 1, n, what,
                             uly_device_name(uly_dev(t)), uly_device_name(uly_dev(p)));
    if (!uly_same_shape(p, t))
        return uly_set_error("%s: parameter %d of %d: %s is %s but the parameter is %s; it must have the "
                             "parameter's shape", op, i + 1, n, what, uly_desc(t), uly_desc(p));
    return 0;
}

static int check_param(const char *op, int i, int n, const uly_tensor *p) {
    if (check_f32_contig(op, i, n, "the parameter", p)) return -1;
    if (p->grad_fn)
        return uly_set_error("%s: parameter %d of %d (%s) is not a leaf: it was computed by %s; optimize the "
                             "leaf tensor itself (or a :detach()ed copy)", op, i + 1, n, uly_desc(p),
                             uly_op_name(p->grad_fn->op));
    if (p->grad && check_like(op, i, n, "its grad", p, p->grad)) return -1;
    return 0;
}

static int check_list(const char *op, uly_tensor *const *params, int n) {
    if (n < 0) return uly_set_error("%s: the number of parameters is %d; it must be >= 0", op, n);
    if (n > 0 && !params) return uly_set_error("%s: the parameter list is NULL but n = %d", op, n);
    return 0;
}

static int check_real(const char *op, const char *name, double x, double lo, double hi, int hi_open) {
    if (!(x >= lo) || !(hi_open ? x < hi : x <= hi))   /* NaN fails both */
        return uly_set_error("%s: %s = %g is out of range; it must be in [%g, %g%s", op, name, x, lo, hi,
                             hi_open ? ")" : "]");
    return 0;
}

static int check_weight_decay(const char *op, const double *wd, int n) {
    for (int i = 0; wd && i < n; i++)
        if (!(wd[i] >= 0.0) || isinf(wd[i]))
            return uly_set_error("%s: parameter %d of %d: weight_decay = %g; it must be finite and >= 0",
                                 op, i + 1, n, wd[i]);
    return 0;
}

static int check_step(const char *op, int64_t step) {
    if (step < 1)
        return uly_set_error("%s: step = %lld; steps are counted from 1 (bias correction and momentum "
                             "initialisation depend on it)", op, (long long)step);
    return 0;
}

/* every parameter with a grad in ONE launch, when they share a device whose backend can (1); else
 * 0 and the caller loops */
static int adamw_multi(uly_tensor *const *params, uly_tensor *const *exp_avg, uly_tensor *const *exp_avg_sq,
                       const double *weight_decay, int n, double lr, double beta1, double beta2, double eps,
                       float step_size, float bc2_sqrt) {
    const uly_backend *be = uly_be(params[0]);
    if (!be->optim_adamw_multi) return 0;
    for (int i = 1; i < n; i++)
        if (uly_dev(params[i]) != uly_dev(params[0])) return 0;
    float **p = malloc((size_t)n * (4 * sizeof(float *) + sizeof(int64_t) + sizeof(float)));
    if (!p) return 0;
    float **g = p + n, **m = g + n, **v = m + n;
    int64_t *sizes = (int64_t *)(v + n);
    float *decay = (float *)(sizes + n);
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (!params[i]->grad) continue;
        p[k] = uly_f32(params[i]); g[k] = uly_f32(params[i]->grad);
        m[k] = uly_f32(exp_avg[i]); v[k] = uly_f32(exp_avg_sq[i]);
        sizes[k] = uly_tensor_numel(params[i]);
        decay[k] = (float)(1.0 - lr * (weight_decay ? weight_decay[i] : 0.0));
        uly_bump_version(params[i]); uly_bump_version(exp_avg[i]); uly_bump_version(exp_avg_sq[i]);
        k++;
    }
    if (k) be->optim_adamw_multi(k, p, (const float *const *)g, m, v, sizes, decay, (float)beta1, (float)(1.0 - beta1),
                                 (float)beta2, (float)(1.0 - beta2), step_size, bc2_sqrt, (float)eps);
    free(p);
    return 1;
}

int uly_adamw_step(uly_tensor *const *params, uly_tensor *const *exp_avg, uly_tensor *const *exp_avg_sq,
                   const double *weight_decay, int n, double lr, double beta1, double beta2,
                   double eps, int64_t step) {
    const char *op = "adamw_step";
    if (check_list(op, params, n) || check_real(op, "lr", lr, 0.0, INFINITY, 1) ||
        check_real(op, "beta1", beta1, 0.0, 1.0, 1) || check_real(op, "beta2", beta2, 0.0, 1.0, 1) ||
        check_real(op, "eps", eps, 0.0, INFINITY, 1) || check_weight_decay(op, weight_decay, n) ||
        check_step(op, step))
        return -1;
    if (n > 0 && (!exp_avg || !exp_avg_sq))
        return uly_set_error("%s: the exp_avg / exp_avg_sq lists are NULL; AdamW needs both state tensors for "
                             "every parameter", op);
    for (int i = 0; i < n; i++) {
        if (check_param(op, i, n, params[i])) return -1;
        if (!params[i]->grad) continue;
        if (check_like(op, i, n, "exp_avg", params[i], exp_avg[i]) ||
            check_like(op, i, n, "exp_avg_sq", params[i], exp_avg_sq[i]))
            return -1;
    }
    const double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    const float step_size = (float)(lr / bc1), bc2_sqrt = (float)sqrt(bc2);
    if (n > 1 && adamw_multi(params, exp_avg, exp_avg_sq, weight_decay, n, lr, beta1, beta2, eps, step_size, bc2_sqrt))
        return uly_device_check(op, ULY_DEVICE_CUDA);
    for (int i = 0; i < n; i++) {
        uly_tensor *p = params[i], *m = exp_avg[i], *v = exp_avg_sq[i];
        if (!p->grad) continue;
        const float decay = (float)(1.0 - lr * (weight_decay ? weight_decay[i] : 0.0));
        uly_be(p)->optim_adamw(uly_f32(p), uly_f32(p->grad), uly_f32(m), uly_f32(v), uly_tensor_numel(p), decay,
                    (float)beta1, (float)(1.0 - beta1), (float)beta2, (float)(1.0 - beta2), step_size, bc2_sqrt,
                    (float)eps);
        uly_bump_version(p); uly_bump_version(m); uly_bump_version(v);
    }
    return uly_device_check(op, ULY_DEVICE_CUDA);
}

int uly_sgd_step(uly_tensor *const *params, uly_tensor *const *momentum_buf, const double *weight_decay,
                 int n, double lr, double momentum, double dampening, int nesterov, int64_t step) {
    const char *op = "sgd_step";
    if (check_list(op, params, n) || check_real(op, "lr", lr, 0.0, INFINITY, 1) ||
        check_real(op, "momentum", momentum, 0.0, INFINITY, 1) ||
        check_real(op, "dampening", dampening, 0.0, 1.0, 0) || check_weight_decay(op, weight_decay, n) ||
        check_step(op, step))
        return -1;
    if (nesterov && (momentum <= 0.0 || dampening != 0.0))
        return uly_set_error("%s: nesterov momentum needs momentum > 0 and dampening = 0 (got momentum = %g, "
                             "dampening = %g)", op, momentum, dampening);
    const int use_buf = momentum != 0.0;
    if (use_buf && n > 0 && !momentum_buf)
        return uly_set_error("%s: momentum = %g needs a momentum buffer per parameter, but the list is NULL",
                             op, momentum);
    for (int i = 0; i < n; i++) {
        if (check_param(op, i, n, params[i])) return -1;
        if (use_buf && params[i]->grad && check_like(op, i, n, "momentum_buf", params[i], momentum_buf[i]))
            return -1;
    }
    for (int i = 0; i < n; i++) {
        uly_tensor *p = params[i], *b = use_buf ? momentum_buf[i] : NULL;
        if (!p->grad) continue;
        uly_be(p)->optim_sgd(uly_f32(p), uly_f32(p->grad), b ? uly_f32(b) : NULL, uly_tensor_numel(p), (float)lr,
                  (float)(weight_decay ? weight_decay[i] : 0.0), (float)momentum, (float)(1.0 - dampening),
                  nesterov != 0, step == 1);
        uly_bump_version(p);
        if (b) uly_bump_version(b);
    }
    return uly_device_check(op, ULY_DEVICE_CUDA);
}

/* every present grad must be f32, contiguous and shaped like its parameter */
static int check_grads(const char *op, uly_tensor *const *params, int n) {
    if (check_list(op, params, n)) return -1;
    for (int i = 0; i < n; i++) {
        if (!params[i])
            return uly_set_error("%s: parameter %d of %d is NULL (a freed or missing tensor)", op, i + 1, n);
        if (params[i]->grad && check_like(op, i, n, "its grad", params[i], params[i]->grad)) return -1;
    }
    return 0;
}

double uly_grad_norm(uly_tensor *const *params, int n) {
    if (check_grads("grad_norm", params, n)) return -1.0;
    double total = 0.0;   /* tensor sums added in list order: deterministic */
    for (int i = 0; i < n; i++) {
        const uly_tensor *g = params[i]->grad;
        if (g) total += uly_be(g)->optim_sumsq(uly_f32(g), uly_tensor_numel(g));
    }
    if (uly_device_check("grad_norm", ULY_DEVICE_CUDA)) return -1.0;
    return sqrt(total);
}

int uly_grad_scale_(uly_tensor *const *params, int n, double scale) {
    if (check_grads("grad_scale_", params, n)) return -1;
    if (isnan(scale)) return uly_set_error("grad_scale_: the scale is NaN; refusing to poison every gradient");
    for (int i = 0; i < n; i++) {
        uly_tensor *g = params[i]->grad;
        if (!g) continue;
        uly_be(g)->optim_scale(uly_f32(g), uly_tensor_numel(g), (float)scale);
        uly_bump_version(g);
    }
    return 0;
}
