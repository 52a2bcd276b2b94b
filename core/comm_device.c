/* core/comm_device.c — device buffers in collectives: a group's device communicator (NCCL),
 * made once at its first device collective when every rank has a device of its own, else the
 * group stages device buffers through host copies over MPI; waiting for a device collective and
 * reporting its failure; whether the watchdog (kernels/cuda/comm.cu) aborted the communicator. */
#define _GNU_SOURCE
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "comm_internal.h"

/* did the device backend's watchdog abort c's device communicator (kernels/cuda/comm.cu)? */
int comm_device_aborted(const uly_comm *c) {
    const uly_backend *be = uly_backends[ULY_DEVICE_CUDA];
    return c->dev_comm && be && be->comm_aborted && be->comm_aborted(c->dev_comm);
}

/* ---- device tensors: staged through host memory (MPI moves host buffers) ---- */
int comm_on_device(const uly_tensor *t) { return t && uly_dev(t) != ULY_DEVICE_CPU; }

/* a host copy of t (contiguous), or t itself retained when it is a host tensor already */
uly_tensor *comm_host_copy(const uly_tensor *t, int with_data) {
    if (!comm_on_device(t)) { if (t) uly_tensor_retain((uly_tensor *)t); return (uly_tensor *)t; }
    uly_tensor *h = uly_new_contiguous(t->ndim, t->shape, t->dtype, ULY_DEVICE_CPU);
    if (h && with_data && uly_copy_raw(h, t)) { uly_tensor_release(h); h = NULL; }
    return h;
}

/* after a collective on the host copy h of t: the result goes back into t */
int comm_finish(uly_tensor *t, uly_tensor *h, int rc) {
    if (rc == 0 && h != t) {
        rc = uly_copy_raw(t, h);
        if (!rc) uly_bump_version(t);
    }
    uly_tensor_release(h);
    return rc;
}

/* The device backend's communicator for group c (collective over the group: called after the
 * header agreement, so every rank is here): made once, when the backend has device collectives,
 * every rank uses its own physical device, and creation succeeds everywhere; else -1 and device
 * buffers stage through host memory over MPI (ranks sharing one GPU, no NCCL, the simulation). */
int comm_device_comm(uly_comm *c, int device) {
    if (c->dev_state) return c->dev_state;
    c->dev_state = -1;
#ifdef ULY_WITH_MPI
    const uly_backend *be = uly_backends[device];
    if (c->size < 2 || !uly_grid.mpi) return c->dev_state;
    int usable = be && be->comm_create && be->comm_unique_id && be->device_uuid && be->comm_all_reduce &&
                 be->comm_all_to_all_v;
    unsigned char mine[16] = {0};
    if (usable && be->device_uuid(mine)) usable = 0;
    unsigned char *all = calloc((size_t)c->size, 16);
    if (!all) usable = 0;
    MPI_Allgather(mine, 16, MPI_BYTE, all ? all : mine, all ? 16 : 0, MPI_BYTE, c->ctrl);
    for (int r = 0; usable && r < c->size; r++)
        for (int q = r + 1; q < c->size; q++)
            if (!memcmp(all + 16 * r, all + 16 * q, 16)) usable = 0;   /* two ranks share a GPU */
    free(all);
    int every = 0;
    MPI_Allreduce(&usable, &every, 1, MPI_INT, MPI_MIN, c->ctrl);
    if (!every) return c->dev_state;
    char id[128] = {0};
    int got = c->rank == 0 ? be->comm_unique_id(id, sizeof id) == 0 : 1, all_got = 0;
    MPI_Allreduce(&got, &all_got, 1, MPI_INT, MPI_MIN, c->ctrl);
    if (!all_got) { be->take_error(); return c->dev_state; }
    MPI_Bcast(id, sizeof id, MPI_BYTE, 0, c->ctrl);
    void *dc = be->comm_create(c->size, c->rank, id);
    int made = dc != NULL, all_made = 0;
    MPI_Allreduce(&made, &all_made, 1, MPI_INT, MPI_MIN, c->ctrl);
    if (!all_made) {
        if (dc) be->comm_destroy(dc);
        be->take_error();
        return c->dev_state;
    }
    c->dev_comm = dc;
    c->dev_state = 1;
    comm_device_timeout();
#endif
    return c->dev_state;
}

/* the device collective just queued: wait for it, report its failure */
int comm_device_done(call *k, int device, int rc) {
    const uly_backend *be = uly_backends[device];
    if (be->synchronize() != 0) rc = -1;
    const char *why = be->take_error();
    if (rc || why) {
        msgbuf m = {.n = 0};
        comm_put_call(&m, k);
        comm_put(&m, ": the device collective failed: %s", why ? why : "no reason given");
        return uly_set_error("%s", m.s);
    }
    return 0;
}

/* does the group move this agreed collective's device buffers with the backend's own collectives?
 * (collective: every rank asks, with the same agreed device) */
const uly_backend *comm_device_collectives(call *k, int kind) {
    int dev = (int)k->h.device;
    if (k->c->size < 2 || dev < 0 || dev == ULY_DEVICE_CPU || comm_device_comm(k->c, dev) != 1) return NULL;
    const uly_backend *be = uly_backends[dev];
    if (!be->comm_join) return NULL;
    return (kind == ULY_COMM_ALL_GATHER ? be->comm_all_gather_start != NULL : be->comm_reduce_scatter_start != NULL)
               ? be : NULL;
}

/* the agreed collective's data through host copies of device (or mixed) buffers */
int comm_staged(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    uly_tensor *hi = comm_host_copy(in, 1), *ho = comm_host_copy(out, 0);
    int rc = !hi || !ho ? uly_set_error("%s: out of host memory for staging", comm_kind_names[k->kind]) : 0;
#ifdef ULY_WITH_MPI
    if (!rc && k->kind == ULY_COMM_ALL_GATHER) rc = comm_all_gather_mpi(k, uly_ptr(hi), uly_ptr(ho), k->h.a, in->dtype);
    if (!rc && k->kind == ULY_COMM_REDUCE_SCATTER) rc = comm_reduce_scatter_mpi(k, hi, ho, op);
#else
    (void)op;
#endif
    if (!rc && ho != out) rc = uly_copy_raw(out, ho);
    if (rc == 0 || !k->c->broken) { uly_tensor_release(hi); uly_tensor_release(ho); }
    return rc;
}
