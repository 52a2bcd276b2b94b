/* core/comm_async.c — reductions that complete later (uly_comm_all_reduce_start,
 * uly_comm_reduce_scatter_start): agreed now, then moving while the rank goes on (a non-blocking
 * MPI collective on the host; NCCL on the device's communication stream), completed in order by
 * uly_comm_wait_all, which the gradient syncs call (lua/ulysses/grad_sync.lua, zero.lua). */
#define _GNU_SOURCE
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "comm_internal.h"

/* ---- all-reduces that complete later ---- */
typedef struct pending_reduce {
    call k;                /* its deadline and the prefix of its messages */
    int kind;              /* ULY_COMM_ALL_REDUCE (in place in t) or ULY_COMM_REDUCE_SCATTER (in -> t) */
    uly_tensor *t;         /* the result; retained until it completes */
    uly_tensor *in;        /* a reduce-scatter's input (retained), else NULL */
    int op;
    int device;            /* -1: MPI moves host memory (req); else on the device's communication stream */
#ifdef ULY_WITH_MPI
    MPI_Request req;
#endif
} pending_reduce;

static pending_reduce *push_pending(uly_comm *c) {
    if (c->n_pending == c->cap_pending) {
        int cap = c->cap_pending ? 2 * c->cap_pending : 16;
        pending_reduce *more = realloc(c->pending, (size_t)cap * sizeof *more);
        if (!more) return NULL;
        c->pending = more;
        c->cap_pending = cap;
    }
    pending_reduce *p = &c->pending[c->n_pending++];
    memset(p, 0, sizeof *p);
    return p;
}

/* a device collective that failed to start: the pending slot it took given back, its message */
static int start_failed(call *k, const char *why) {
    k->c->n_pending--;
    msgbuf m = {.n = 0};
    comm_put_call(&m, k);
    comm_put(&m, ": the device collective failed: %s", why ? why : "no reason given");
    return uly_set_error("%s", m.s);
}

/* the data of the agreed all-reduce k of t moving in the background, if it can (else -2) */
static int all_reduce_background(call *k, uly_tensor *t, int op) {
    uly_comm *c = k->c;
    int dev = uly_dev(t);
    pending_reduce *p = NULL;
    if (comm_on_device(t)) {
        const uly_backend *be = uly_backends[dev];
        if (comm_device_comm(c, dev) != 1 || !be->comm_all_reduce_start || !be->comm_join) return -2;
        if (!(p = push_pending(c))) return -2;
        int rc = be->comm_all_reduce_start(c->dev_comm, uly_ptr(t), uly_tensor_numel(t), t->dtype, op);
        const char *why = be->take_error();
        if (rc || why) return start_failed(k, why);
    } else {
#ifdef ULY_WITH_MPI
        int fits = uly_tensor_numel(t) <= CHUNK && t->dtype != ULY_DTYPE_BF16;   /* bf16 sums through f32 */
        if (!fits || !(p = push_pending(c))) return -2;
        int rc = MPI_Iallreduce(MPI_IN_PLACE, uly_ptr(t), (int)uly_tensor_numel(t), comm_mpi_type(t->dtype), comm_mpi_op(op),
                                c->data, &p->req);
        if (rc != MPI_SUCCESS) { c->n_pending--; return comm_mpi_failed(k, rc, "MPI_Iallreduce"); }
#else
        return -2;
#endif
    }
    p->k = *k;
    p->kind = ULY_COMM_ALL_REDUCE;
    p->t = t;
    uly_tensor_retain(t);
    p->op = op;
    p->device = comm_on_device(t) ? dev : -1;
    return 0;
}

/* the data of the agreed reduce-scatter k moving in the background, if it can (else -2) */
static int reduce_scatter_background(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    uly_comm *c = k->c;
    pending_reduce *p = NULL;
    if (k->h.device != ULY_DEVICE_CPU) {
        const uly_backend *be = comm_device_collectives(k, ULY_COMM_REDUCE_SCATTER);
        if (!be || !(p = push_pending(c))) return -2;   /* staged through the host: now */
        int rc = be->comm_reduce_scatter_start(c->dev_comm, uly_ptr(in), uly_ptr(out), k->h.a, in->dtype, op);
        const char *why = be->take_error();
        if (rc || why) return start_failed(k, why);
    } else {
#ifdef ULY_WITH_MPI
        if (in->dtype == ULY_DTYPE_BF16 || !(p = push_pending(c))) return -2;   /* bf16 sums through f32: now */
        int rc = MPI_Ireduce_scatter_block(uly_ptr(in), uly_ptr(out), (int)k->h.a, comm_mpi_type(in->dtype), comm_mpi_op(op),
                                           c->data, &p->req);
        if (rc != MPI_SUCCESS) { c->n_pending--; return comm_mpi_failed(k, rc, "MPI_Ireduce_scatter_block"); }
#else
        return -2;
#endif
    }
    p->k = *k;
    p->kind = ULY_COMM_REDUCE_SCATTER;
    p->t = out;
    uly_tensor_retain(out);
    p->in = (uly_tensor *)in;
    uly_tensor_retain(p->in);
    p->op = op;
    p->device = k->h.device != ULY_DEVICE_CPU ? (int)k->h.device : -1;
    return 0;
}

int uly_comm_all_reduce_start(uly_comm *c, uly_tensor *t, int op) {
    call k;
    if (comm_all_reduce_agree(&k, c, t, op)) return -1;
    if (c->size == 1) return comm_call_end(&k, comm_all_reduce_now(&k, t, op));
    double t0 = k.t0;
    int rc = all_reduce_background(&k, t, op);
    if (rc == -2) return comm_call_end(&k, comm_all_reduce_now(&k, t, op));   /* staged, or too big: now */
    if (rc == 0) uly_grid.seconds[ULY_COMM_ALL_REDUCE] += comm_now() - t0;       /* counted as a call when it completes */
    return rc;
}

int uly_comm_reduce_scatter_start(uly_comm *c, const uly_tensor *in, uly_tensor *out, int op) {
    call k;
    if (comm_reduce_scatter_agree(&k, c, in, out, op)) return -1;
    if (c->size == 1) return comm_call_end(&k, comm_reduce_scatter_now(&k, in, out, op));
    double t0 = k.t0;
    int rc = reduce_scatter_background(&k, in, out, op);
    if (rc == -2) return comm_call_end(&k, comm_reduce_scatter_now(&k, in, out, op));   /* staged, or bf16: now */
    if (rc == 0) uly_grid.seconds[ULY_COMM_REDUCE_SCATTER] += comm_now() - t0;           /* counted when it completes */
    return rc;
}

int uly_comm_pending(const uly_comm *c) { return c ? c->n_pending : 0; }

/* MPI moves a non-blocking collective's data only inside MPI calls: a poke at the pending ones */
void uly_comm_progress(uly_comm *c) {
#ifdef ULY_WITH_MPI
    for (int i = 0; c && !c->broken && i < c->n_pending; i++) {
        pending_reduce *p = &c->pending[i];
        int done = 0;
        if (p->device < 0 && p->req != MPI_REQUEST_NULL) MPI_Test(&p->req, &done, MPI_STATUS_IGNORE);
    }
#else
    (void)c;
#endif
}

/* completes p (the data has arrived): avg's division, the stats */
static int complete(uly_comm *c, pending_reduce *p) {
    uly_tensor *t = p->t;
    if (p->op == ULY_REDUCE_AVG && p->device < 0) comm_divide_host(t, c->size);
    uly_bump_version(t);
    if (p->kind == ULY_COMM_REDUCE_SCATTER) comm_count_stacked(c, ULY_COMM_REDUCE_SCATTER, uly_tensor_nbytes(t));
    else comm_count_all_reduce(c, uly_tensor_nbytes(t));
    uly_grid.calls[p->kind]++;
    return 0;
}

int uly_comm_wait_all(uly_comm *c) {
    if (!c) return uly_set_error("wait_all: no group given");
    int rc = 0, joined = 0;   /* joined: 1 done, -1 failed (every device one fails then) */
    for (int i = 0; i < c->n_pending; i++) {
        pending_reduce *p = &c->pending[i];
        double t0 = comm_now();
        int r = 0, leak = 0;
        if (p->device >= 0) {
            const uly_backend *be = uly_backends[p->device];
            if (!joined) { /* compute work queued from here on runs after every pending one */
                r = be->comm_join();
                const char *why = be->take_error();
                if (r || why) {
                    msgbuf m = {.n = 0};
                    comm_put_call(&m, &p->k);
                    comm_put(&m, ": the device collective failed: %s", why ? why : "no reason given");
                    r = uly_set_error("%s", m.s);
                }
                joined = r ? -1 : 1;
            } else if (joined < 0) r = -1;
        } else {
#ifdef ULY_WITH_MPI
            r = c->broken ? -1 : comm_wait_one(&p->k, "reducing", &p->req);
            leak = r != 0;   /* MPI may still write into it */
#endif
        }
        if (!r) r = complete(c, p);
        uly_grid.seconds[p->kind] += comm_now() - t0;
        if (r && !rc) rc = -1;
        if (!leak) { uly_tensor_release(p->t); uly_tensor_release(p->in); }
    }
    c->n_pending = 0;
    return rc;
}
