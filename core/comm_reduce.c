/* core/comm_reduce.c — the collectives on whole tensors: all-reduce (bf16 through f32, avg
 * divides after the sum), all-gather and reduce-scatter (ZeRO: the output stacks P blocks of the
 * input, or the other way round; in place where the block is the rank's own), broadcast, barrier
 * and check_same. Host tensors over MPI; device tensors over the backend's collectives (NCCL)
 * when the group has them, else staged through host memory (comm_device.c). */
#define _GNU_SOURCE
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "comm_internal.h"

/* reduce `t` in place over the group (bf16 through an f32 copy), then avg divides */
static int reduce_tensor(call *k, uly_tensor *t, int op) {
    int P = k->c->size;
    if (P == 1) return 0;
#ifdef ULY_WITH_MPI
    if (t->dtype == ULY_DTYPE_BF16) {
        uly_tensor *f = uly_new_contiguous(t->ndim, t->shape, ULY_DTYPE_F32, ULY_DEVICE_CPU);
        if (!f) return -1;
        int rc = uly_copy_raw(f, t);
        if (!rc) rc = reduce_tensor(k, f, op);
        if (!rc) rc = uly_copy_raw(t, f);
        if (rc == 0 || !k->c->broken) uly_tensor_release(f);
        return rc;
    }
    if (comm_reduce_mpi(k, uly_ptr(t), uly_tensor_numel(t), t->dtype, op)) return -1;
    if (op == ULY_REDUCE_AVG) {
        int64_t n = uly_tensor_numel(t);
        if (t->dtype == ULY_DTYPE_F32) { float *p = uly_f32(t); for (int64_t i = 0; i < n; i++) p[i] /= (float)P; }
        else { double *p = uly_ptr(t); for (int64_t i = 0; i < n; i++) p[i] /= P; }
    }
    return 0;
#else
    return -1;
#endif
}

void comm_count_all_reduce(const uly_comm *c, int64_t nbytes) {
    for (int j = 0; j < c->size; j++) {
        int64_t b = comm_block(nbytes, c->size, j) + comm_block(nbytes, c->size, c->rank);
        comm_count_bytes(ULY_COMM_ALL_REDUCE, c->world_ranks[j], b, b);
    }
}

/* out must be in's shape with the first dimension times `factor` (a 0-d in counts as [1]) */
static void check_stacked(call *k, const uly_tensor *small, const uly_tensor *big, int factor, const char *rule) {
    if (!small || !big || k->h.bad) return;
    if (small->dtype != big->dtype) {
        comm_bad(k, "the input and the output differ in dtype (%s, %s)", uly_dtype_name(small->dtype), uly_dtype_name(big->dtype));
        return;
    }
    int64_t s0 = small->ndim ? small->shape[0] : 1;
    int ok = big->ndim == (small->ndim ? small->ndim : 1) && big->shape[0] == s0 * factor;
    for (int d = 1; ok && d < small->ndim; d++) ok = big->shape[d] == small->shape[d];
    if (!ok) comm_bad(k, "%s: got input %s and output %s", rule, uly_desc(k->kind == ULY_COMM_ALL_GATHER ? small : big),
                 uly_desc(k->kind == ULY_COMM_ALL_GATHER ? big : small));
}

/* ---- all-gather and reduce-scatter (ZeRO): host tensors over MPI; device tensors over the
 * backend's collectives (NCCL) when the group has them, else staged through host memory ---- */

/* a tensor argument that may live on a device: present and contiguous */
static void check_any_arg(call *k, const char *what, const uly_tensor *t) {
    if (!t) comm_bad(k, "no %stensor given", what);
    else if (!uly_tensor_is_contiguous(t))
        comm_bad(k, "the %stensor %s is not contiguous: pass a contiguous tensor (t:contiguous())", what, uly_desc(t));
}

/* where a collective's two tensors live: their device, or -1 when they differ (staged) */
static int64_t pair_device(const uly_tensor *a, const uly_tensor *b) {
    if (!a || !b) return ULY_DEVICE_CPU;
    return uly_dev(a) == uly_dev(b) ? uly_dev(a) : -1;
}

/* the checks and agreement of an all-gather; *in_place: in is this rank's block of out */
static int all_gather_agree(call *k, uly_comm *c, const uly_tensor *in, uly_tensor *out, int *in_place) {
    *in_place = 0;
    if (comm_call_begin(k, c, ULY_COMM_ALL_GATHER)) return -1;
    check_any_arg(k, "input ", in);
    check_any_arg(k, "output ", out);
    check_stacked(k, in, out, c->size, "the output must be the input stacked over the group's ranks along dim 0");
    if (in) {
        k->h.dtype = in->dtype;
        k->h.a = uly_tensor_numel(in);
        if (k->h.a > INT_MAX) comm_bad(k, "the input has %lld elements, more than one MPI call takes (%d)", (long long)k->h.a, INT_MAX);
    }
    k->h.device = pair_device(in, out);
    if (in && out && !k->h.bad && uly_dev(in) == uly_dev(out)) {
        int64_t bytes = k->h.a * (int64_t)uly_dtype_size(in->dtype);
        const char *src = uly_ptr(in), *dst = uly_ptr(out);
        *in_place = bytes > 0 && src == dst + (int64_t)c->rank * bytes;
        if (!*in_place && bytes > 0 && src < dst + bytes * c->size && dst < src + bytes)
            comm_bad(k, "the input overlaps the output other than as this rank's block of it (block %d); pass a "
                "separate input, or exactly that block", c->rank);
    }
    return comm_agree(k);
}

/* the agreed all-gather's data between host buffers (src NULL: in place) */
int comm_all_gather_mpi(call *k, const void *src, void *dst, int64_t n, int dtype) {
#ifdef ULY_WITH_MPI
    MPI_Request req;
    MPI_Datatype T = comm_mpi_type(dtype);
    int rc = MPI_Iallgather(src ? src : MPI_IN_PLACE, (int)n, T, dst, (int)n, T, k->c->data, &req);
    return rc != MPI_SUCCESS ? comm_mpi_failed(k, rc, "MPI_Iallgather") : comm_wait_one(k, "moving data", &req);
#else
    (void)k; (void)src; (void)dst; (void)n; (void)dtype;
    return uly_set_error("all_gather: built without MPI");
#endif
}

void comm_count_stacked(const uly_comm *c, int kind, int64_t nbytes) {
    for (int j = 0; j < c->size; j++) comm_count_bytes(kind, c->world_ranks[j], nbytes, nbytes);
}

/* avg's division of a host result */
void comm_divide_host(uly_tensor *t, int P) {
    int64_t n = uly_tensor_numel(t);
    if (t->dtype == ULY_DTYPE_F32) { float *x = uly_f32(t); for (int64_t i = 0; i < n; i++) x[i] /= (float)P; }
    else if (t->dtype == ULY_DTYPE_F64) { double *x = uly_ptr(t); for (int64_t i = 0; i < n; i++) x[i] /= P; }
}

#ifdef ULY_WITH_MPI
int comm_reduce_scatter_mpi(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    if (in->dtype == ULY_DTYPE_BF16) {
        uly_tensor *fi = uly_new_contiguous(in->ndim, in->shape, ULY_DTYPE_F32, ULY_DEVICE_CPU);
        uly_tensor *fo = fi ? uly_new_contiguous(out->ndim, out->shape, ULY_DTYPE_F32, ULY_DEVICE_CPU) : NULL;
        int rc = fo ? uly_copy_raw(fi, in) : -1;
        if (!rc) rc = comm_reduce_scatter_mpi(k, fi, fo, op);
        if (!rc) rc = uly_copy_raw(out, fo);
        if (rc == 0 || !k->c->broken) { if (fi) uly_tensor_release(fi); if (fo) uly_tensor_release(fo); }
        return rc;
    }
    int64_t n = uly_tensor_numel(out);
    MPI_Request req;
    int rc = MPI_Ireduce_scatter_block(uly_ptr(in), uly_ptr(out), (int)n, comm_mpi_type(in->dtype), comm_mpi_op(op),
                                       k->c->data, &req);
    if (rc != MPI_SUCCESS) return comm_mpi_failed(k, rc, "MPI_Ireduce_scatter_block");
    if (comm_wait_one(k, "reducing", &req)) return -1;
    if (op == ULY_REDUCE_AVG) comm_divide_host(out, k->c->size);
    return 0;
}
#endif

/* the checks and agreement of a reduce-scatter */
int comm_reduce_scatter_agree(call *k, uly_comm *c, const uly_tensor *in, uly_tensor *out, int op) {
    if (comm_call_begin(k, c, ULY_COMM_REDUCE_SCATTER)) return -1;
    check_any_arg(k, "input ", in);
    check_any_arg(k, "output ", out);
    check_stacked(k, out, in, c->size, "the input must be the output's shape with dim 0 times the group size");
    if (in) comm_check_op(k, op, in->dtype);
    if (out) {
        k->h.dtype = out->dtype;
        k->h.a = uly_tensor_numel(out);
        if (k->h.a > INT_MAX) comm_bad(k, "the output has %lld elements, more than one MPI call takes (%d)", (long long)k->h.a, INT_MAX);
    }
    k->h.b = op;
    k->h.device = pair_device(in, out);
    if (in && out && !k->h.bad && uly_dev(in) == uly_dev(out)) {
        const char *src = uly_ptr(in), *dst = uly_ptr(out);
        int64_t nb = k->h.a * (int64_t)uly_dtype_size(out->dtype);
        if (nb > 0 && src < dst + nb && dst < src + nb * c->size)
            comm_bad(k, "the output overlaps the input; reduce into a separate tensor");
    }
    return comm_agree(k);
}

static int broadcast_host(uly_comm *c, uly_tensor *t, int root) {
    call k;
    if (comm_call_begin(&k, c, ULY_COMM_BROADCAST)) return -1;
    comm_check_tensor_arg(&k, "", t);
    if (root < 0 || root >= c->size) comm_bad(&k, "root %d is not a rank of group %s (ranks 0 to %d)", root, c->name, c->size - 1);
    if (t) {
        k.h.dtype = t->dtype;
        k.h.a = uly_tensor_numel(t);
    }
    k.h.b = root;
    if (comm_agree(&k)) return -1;
    int64_t n = k.h.a, es = uly_dtype_size(t->dtype);
    int rc = 0;
#ifdef ULY_WITH_MPI
    for (int64_t off = 0; c->size > 1 && off < n && rc == 0; off += CHUNK) {
        MPI_Request req;
        int cnt = (int)(n - off < CHUNK ? n - off : CHUNK);
        rc = MPI_Ibcast((char *)uly_ptr(t) + off * es, cnt, comm_mpi_type(t->dtype), root, c->data, &req);
        rc = rc != MPI_SUCCESS ? comm_mpi_failed(&k, rc, "MPI_Ibcast") : comm_wait_one(&k, "moving data", &req);
    }
#endif
    if (rc == 0) {
        uly_bump_version(t);
        for (int j = 0; j < c->size; j++) {
            int from_me = c->rank == root, to_me = j == root;
            comm_count_bytes(ULY_COMM_BROADCAST, c->world_ranks[j], from_me ? n * es : 0, to_me ? n * es : 0);
        }
    }
    return comm_call_end(&k, rc);
}

/* the header exchange already waits for every rank of the group */
int uly_comm_barrier(uly_comm *c) {
    call k;
    if (comm_call_begin(&k, c, ULY_COMM_BARRIER)) return -1;
    return comm_call_end(&k, comm_agree(&k));
}

int uly_comm_check_same(uly_comm *c, const char *what, const int64_t *values, int n) {
    call k;
    if (comm_call_begin(&k, c, KIND_CHECK_SAME)) return -1;
    if (n < 0 || (n > 0 && !values)) comm_bad(&k, "%d values at %p", n, (const void *)values);
    if (n > (1 << 20)) comm_bad(&k, "%d values: at most %d", n, 1 << 20);
    k.h.a = n;
    if (comm_agree(&k)) return -1;
    int64_t *tab = comm_gather_rows(&k, values, n);
    if (!tab) return -1;
    int same = 1, P = c->size;
    for (int r = 1; r < P; r++) same &= !memcmp(tab, tab + (size_t)r * n, (size_t)n * sizeof *tab);
    if (!same) {
        msgbuf m = {.n = 0};
        comm_put(&m, "%s differs between the ranks of group %s: ", what && *what ? what : "a value", c->name);
        for (int r = 0; r < P; r++) {
            comm_put(&m, r ? "; " : "");
            comm_put_rank(&m, c, r);
            comm_put(&m, ":");
            for (int i = 0; i < n && i < 16; i++) comm_put(&m, " %lld", (long long)tab[(size_t)r * n + i]);
            if (n > 16) comm_put(&m, " ...");
        }
        comm_put(&m, ": every rank must use the same configuration");
        free(tab);
        return uly_set_error("%s", m.s);
    }
    free(tab);
    return comm_call_end(&k, 0);
}

/* the checks and the agreement of an all-reduce of t (host or device) */
int comm_all_reduce_agree(call *k, uly_comm *c, uly_tensor *t, int op) {
    if (comm_call_begin(k, c, ULY_COMM_ALL_REDUCE)) return -1;
    if (!comm_on_device(t)) comm_check_tensor_arg(k, "", t);
    else if (!uly_tensor_is_contiguous(t))
        comm_bad(k, "the tensor %s is not contiguous: pass a contiguous tensor (t:contiguous())", uly_desc(t));
    if (t) {
        comm_check_op(k, op, t->dtype);
        k->h.dtype = t->dtype;
        k->h.device = uly_dev(t);
        k->h.a = uly_tensor_numel(t);
    }
    k->h.b = op;
    return comm_agree(k);
}

/* the agreed all-reduce's data, moved now */
int comm_all_reduce_now(call *k, uly_tensor *t, int op) {
    uly_comm *c = k->c;
    int rc = 0, dev = uly_dev(t);
    if (!comm_on_device(t)) rc = reduce_tensor(k, t, op);
    else if (c->size > 1 && comm_device_comm(c, dev) == 1) {
        const uly_backend *be = uly_backends[dev];
        rc = comm_device_done(k, dev, be->comm_all_reduce(c->dev_comm, uly_ptr(t), uly_tensor_numel(t), t->dtype, op));
    } else if (c->size > 1) { /* through host memory */
        uly_tensor *h = uly_new_contiguous(t->ndim, t->shape, t->dtype, ULY_DEVICE_CPU);
        rc = (!h || uly_copy_raw(h, t)) ? -1 : reduce_tensor(k, h, op);
        if (!rc) rc = uly_copy_raw(t, h);
        if (rc == 0 || !c->broken) uly_tensor_release(h);
    }
    if (rc == 0) {
        uly_bump_version(t);
        comm_count_all_reduce(c, uly_tensor_nbytes(t));
    }
    return rc;
}

int uly_comm_all_reduce_(uly_comm *c, uly_tensor *t, int op) {
    call k;
    if (comm_all_reduce_agree(&k, c, t, op)) return -1;
    return comm_call_end(&k, comm_all_reduce_now(&k, t, op));
}

int uly_comm_all_gather(uly_comm *c, const uly_tensor *in, uly_tensor *out) {
    call k;
    int in_place;
    if (all_gather_agree(&k, c, in, out, &in_place)) return -1;
    int64_t n = k.h.a, es = uly_dtype_size(in->dtype);
    int rc = 0;
    const uly_backend *be;
    if (c->size == 1) rc = in_place ? 0 : uly_copy_raw(out, in);
    else if ((be = comm_device_collectives(&k, ULY_COMM_ALL_GATHER))) {
        int r = be->comm_all_gather_start(c->dev_comm, uly_ptr(in), uly_ptr(out), n, in->dtype);
        if (be->comm_join()) r = -1;
        rc = comm_device_done(&k, (int)k.h.device, r);
    } else if (k.h.device != ULY_DEVICE_CPU) rc = comm_staged(&k, in, out, 0);
    else rc = comm_all_gather_mpi(&k, in_place ? NULL : uly_ptr(in), uly_ptr(out), n, in->dtype);
    if (rc == 0) {
        uly_bump_version(out);
        comm_count_stacked(c, ULY_COMM_ALL_GATHER, n * es);
    }
    return comm_call_end(&k, rc);
}

/* the agreed reduce-scatter's data, moved now */
int comm_reduce_scatter_now(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    uly_comm *c = k->c;
    int rc = 0;
    const uly_backend *be;
    if (c->size == 1) rc = uly_copy_raw(out, in);
    else if ((be = comm_device_collectives(k, ULY_COMM_REDUCE_SCATTER))) {
        int r = be->comm_reduce_scatter_start(c->dev_comm, uly_ptr(in), uly_ptr(out), k->h.a, in->dtype, op);
        if (be->comm_join()) r = -1;
        rc = comm_device_done(k, (int)k->h.device, r);
    } else if (k->h.device != ULY_DEVICE_CPU) rc = comm_staged(k, in, out, op);
#ifdef ULY_WITH_MPI
    else rc = comm_reduce_scatter_mpi(k, in, out, op);
#endif
    if (rc == 0) {
        uly_bump_version(out);
        comm_count_stacked(c, ULY_COMM_REDUCE_SCATTER, uly_tensor_nbytes(out));
    }
    return rc;
}

int uly_comm_reduce_scatter(uly_comm *c, const uly_tensor *in, uly_tensor *out, int op) {
    call k;
    if (comm_reduce_scatter_agree(&k, c, in, out, op)) return -1;
    return comm_call_end(&k, comm_reduce_scatter_now(&k, in, out, op));
}

int uly_comm_broadcast_(uly_comm *c, uly_tensor *t, int root) {
    if (!comm_on_device(t)) return broadcast_host(c, t, root);
    uly_tensor *h = comm_host_copy(t, 1);
    return comm_finish(t, h, broadcast_host(c, h, root));
}
