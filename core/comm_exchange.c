/* core/comm_exchange.c — all-to-all: counts and displacements (uly_comm_all_to_all_v), and the
 * strided form the Ulysses exchanges use (uly_comm_all_to_all_layout_on: each peer's elements
 * described by a layout, moved with MPI derived datatypes on the host, packed by a kernel into one
 * device buffer per peer and moved by NCCL, or staged through host memory, on a device). */
#define _GNU_SOURCE
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "comm_internal.h"

int uly_comm_all_to_all_v(uly_comm *c, const void *send, const int64_t *send_counts, const int64_t *send_displs,
                          void *recv, const int64_t *recv_counts, const int64_t *recv_displs, int dtype) {
    call k;
    if (comm_call_begin(&k, c, ULY_COMM_ALL_TO_ALL)) return -1;
    int P = c->size;
    k.h.dtype = dtype;
    if (!comm_valid_dtype(dtype)) comm_bad(&k, "unknown dtype %d", dtype);
    if (!send_counts || !send_displs || !recv_counts || !recv_displs) comm_bad(&k, "a count or displacement array is NULL");
    for (int j = 0; j < P && !k.h.bad; j++) {
        int64_t d[2] = {send_displs[j], recv_displs[j]};
        for (int q = 0; q < 2; q++) {
            if (d[q] < 0) comm_bad(&k, "negative displacement %lld for rank %d", (long long)d[q], j);
            else if (d[q] > INT_MAX)
                comm_bad(&k, "displacement %lld for rank %d is too large for one MPI call (at most %d elements): split the exchange",
                    (long long)d[q], j, INT_MAX);
        }
        if ((send_counts[j] && !send) || (recv_counts[j] && !recv)) comm_bad(&k, "a NULL buffer with a non-zero count");
    }
    int64_t *zeros = NULL;
    if (!send_counts || !recv_counts) { /* still take part, so every rank gets the error */
        zeros = calloc((size_t)P, sizeof *zeros);
        if (!zeros) return uly_set_error("all_to_all: out of memory");
    }
    int agreed = comm_agree_counts(&k, send_counts ? send_counts : zeros, recv_counts ? recv_counts : zeros, 1);
    free(zeros);
    if (agreed) return -1;
    int64_t es = uly_dtype_size(dtype);
    int rc = 0;
    if (P == 1) {
        if (send_counts[0]) memmove((char *)recv + recv_displs[0] * es, (const char *)send + send_displs[0] * es,
                                    (size_t)(send_counts[0] * es));
    }
#ifdef ULY_WITH_MPI
    else {
        int *iv = malloc(4 * (size_t)P * sizeof *iv);
        if (!iv) return uly_set_error("all_to_all: out of memory");
        for (int j = 0; j < P; j++) {
            iv[j] = (int)send_counts[j]; iv[P + j] = (int)send_displs[j];
            iv[2 * P + j] = (int)recv_counts[j]; iv[3 * P + j] = (int)recv_displs[j];
        }
        static char dummy[64];
        MPI_Request req;
        MPI_Datatype T = comm_mpi_type(dtype);
        rc = MPI_Ialltoallv(send ? send : dummy, iv, iv + P, T, recv ? recv : dummy, iv + 2 * P, iv + 3 * P, T,
                            c->data, &req);
        rc = rc != MPI_SUCCESS ? comm_mpi_failed(&k, rc, "MPI_Ialltoallv") : comm_wait_one(&k, "moving data", &req);
        if (rc == 0 || !c->broken) free(iv);
    }
#endif
    if (rc == 0)
        for (int j = 0; j < P; j++) comm_count_bytes(ULY_COMM_ALL_TO_ALL, c->world_ranks[j], send_counts[j] * es, recv_counts[j] * es);
    return comm_call_end(&k, rc);
}

/* a rank whose all-to-all arguments failed its own checks still joins the header round, so
 * every rank of the group returns the same error instead of waiting for it */
int uly_comm_all_to_all_refuse(uly_comm *c, const char *why) {
    call k;
    if (comm_call_begin(&k, c, ULY_COMM_ALL_TO_ALL)) return -1;
    comm_bad(&k, "%s", why);
    k.h.a = c->size;
    comm_agree(&k);
    return -1;
}

/* ---------------------------------------------------------------- strided (layout) all-to-all */

static int64_t layout_numel(const uly_comm_layout *L) {
    int64_t per = 0;
    for (int r = 0; r < L->nruns; r++) per += L->length[r];
    return per * L->count;
}

static const char *layout_problem(const uly_comm_layout *L) {
    if (L->nruns < 0 || L->nruns > 3) return "nruns must be 0..3";
    if (L->base < 0 || L->count < 0 || L->stride < 0) return "negative base, count or stride";
    for (int r = 0; r < L->nruns; r++)
        if (L->offset[r] < 0 || L->length[r] < 0) return "negative run offset or length";
    return NULL;
}

/* position of the next element of a layout, walked in order */
typedef struct { const uly_comm_layout *L; int64_t rep; int run; int64_t pos; } cursor;

static void cursor_settle(cursor *c) { /* skip finished and empty runs */
    while (c->rep < c->L->count && (c->L->nruns == 0 || c->pos >= c->L->length[c->run])) {
        c->pos = 0;
        if (++c->run >= c->L->nruns) { c->run = 0; c->rep++; }
    }
}

/* copy the elements of src's layout into dst's layout, in order (a rank's exchange with itself) */
static void copy_layout(char *dst, const uly_comm_layout *Ld, const char *src, const uly_comm_layout *Ls, int64_t es) {
    cursor a = {Ls, 0, 0, 0}, b = {Ld, 0, 0, 0};
    int64_t left = layout_numel(Ls);
    while (left > 0) {
        cursor_settle(&a);
        cursor_settle(&b);
        int64_t na = Ls->length[a.run] - a.pos, nb = Ld->length[b.run] - b.pos;
        int64_t n = na < nb ? na : nb;
        if (n > left) n = left;
        memmove(dst + (Ld->base + b.rep * Ld->stride + Ld->offset[b.run] + b.pos) * es,
                src + (Ls->base + a.rep * Ls->stride + Ls->offset[a.run] + a.pos) * es, (size_t)(n * es));
        a.pos += n;
        b.pos += n;
        left -= n;
    }
}

#ifdef ULY_WITH_MPI
/* an MPI datatype selecting a layout's elements, displaced by its base (so displacements are 0) */
static int layout_type(const uly_comm_layout *L, MPI_Datatype elem, int64_t es, MPI_Datatype *out) {
    int blen[3], disp[3], n = 0;
    for (int r = 0; r < L->nruns; r++)
        if (L->length[r] > 0) { blen[n] = (int)L->length[r]; disp[n] = (int)L->offset[r]; n++; }
    MPI_Datatype run, rep, reps;
    int one = 1;
    MPI_Aint base = (MPI_Aint)(L->base * es);
    if (MPI_Type_indexed(n, blen, disp, elem, &run) != MPI_SUCCESS) return -1;
    MPI_Type_create_resized(run, 0, (MPI_Aint)(L->stride * es), &rep);
    MPI_Type_contiguous((int)L->count, rep, &reps);
    MPI_Type_create_hindexed(1, &one, &base, reps, out);
    MPI_Type_commit(out);
    MPI_Type_free(&run);
    MPI_Type_free(&rep);
    MPI_Type_free(&reps);
    return 0;
}
#endif

/* ---- exchanges of device buffers: each peer's layout packed into one contiguous device buffer
 *      (a kernel), moved by the device communicator (NCCL) or, without one, through host memory
 *      over MPI, then unpacked into the receiving layouts ---- */
static int layouts_on_device(call *k, int device, const void *send, const uly_comm_layout *sl, void *recv,
                             const uly_comm_layout *rl, int dtype, const int64_t *counts) {
    uly_comm *c = k->c;
    const uly_backend *be = uly_backends[device];
    int P = c->size, me = c->rank, rc = 0;
    int64_t es = uly_dtype_size(dtype), *displs = calloc(2 * (size_t)P, sizeof *displs), stot = 0, rtot = 0;
    if (!displs) return uly_set_error("all_to_all: out of memory");
    for (int j = 0; j < P; j++) {
        displs[j] = stot; stot += counts[j];
        displs[P + j] = rtot; rtot += counts[P + j];
    }
    int64_t sblock = 0, rblock = 0;
    char *sp = uly_alloc_on(device, (stot ? stot : 1) * es, &sblock);
    char *rp = sp ? uly_alloc_on(device, (rtot ? rtot : 1) * es, &rblock) : NULL;
    if (!rp) { if (sp) uly_free_on(device, sp, sblock); free(displs); return -1; }
    for (int j = 0; j < P; j++)
        if (counts[j]) be->pack_layout(sp + displs[j] * es, send, &sl[j], es);
    if (P > 1 && comm_device_comm(c, device) == 1) {
        rc = comm_device_done(k, device, be->comm_all_to_all_v(c->dev_comm, sp, counts, displs, rp, counts + P, displs + P, dtype));
    } else {
        if (counts[me]) be->copy(rp + displs[P + me] * es, sp + displs[me] * es, counts[me] * es, ULY_COPY_D2D);
#ifdef ULY_WITH_MPI
        if (P > 1) { /* through host memory: contiguous per-peer blocks, MPI_Alltoallv */
            char *hs = malloc((size_t)((stot ? stot : 1) * es)), *hr = malloc((size_t)((rtot ? rtot : 1) * es));
            int *iv = calloc(4 * (size_t)P, sizeof *iv);
            if (!hs || !hr || !iv) rc = uly_set_error("all_to_all: out of host memory for staging %lld + %lld elements",
                                                      (long long)stot, (long long)rtot);
            if (!rc && (stot > INT_MAX || rtot > INT_MAX))
                rc = uly_set_error("all_to_all: %lld / %lld elements exceed what one MPI call moves (%d)",
                                   (long long)stot, (long long)rtot, INT_MAX);
            if (!rc && be->copy(hs, sp, stot * es, ULY_COPY_D2H)) rc = uly_device_check("all_to_all", device) ? -1 : uly_set_error("all_to_all: copy from the device failed");
            for (int j = 0; !rc && j < P; j++)
                if (j != me) { iv[j] = (int)counts[j]; iv[P + j] = (int)displs[j]; iv[2 * P + j] = (int)counts[P + j]; iv[3 * P + j] = (int)displs[P + j]; }
            if (!rc) {
                MPI_Request req;
                int m = MPI_Ialltoallv(hs, iv, iv + P, comm_mpi_type(dtype), hr, iv + 2 * P, iv + 3 * P, comm_mpi_type(dtype), c->data, &req);
                rc = m != MPI_SUCCESS ? comm_mpi_failed(k, m, "MPI_Ialltoallv") : comm_wait_one(k, "moving data", &req);
            }
            for (int j = 0; !rc && j < P; j++)
                if (j != me && counts[P + j] &&
                    be->copy(rp + displs[P + j] * es, hr + displs[P + j] * es, counts[P + j] * es, ULY_COPY_H2D))
                    rc = uly_device_check("all_to_all", device) ? -1 : uly_set_error("all_to_all: copy to the device failed");
            if (rc == 0 || !c->broken) { free(hs); free(hr); }
            free(iv);
        }
#endif
    }
    for (int j = 0; !rc && j < P; j++)
        if (counts[P + j]) be->unpack_layout(recv, &rl[j], rp + displs[P + j] * es, es);
    if (!rc) rc = uly_device_check("all_to_all", device);
    if (rc == 0 || !c->broken) { uly_free_on(device, sp, sblock); uly_free_on(device, rp, rblock); }
    free(displs);
    return rc;
}

int uly_comm_all_to_all_layout(uly_comm *c, const void *send, const uly_comm_layout *send_layouts,
                               void *recv, const uly_comm_layout *recv_layouts, int dtype) {
    return uly_comm_all_to_all_layout_on(c, ULY_DEVICE_CPU, send, send_layouts, recv, recv_layouts, dtype);
}

int uly_comm_all_to_all_layout_on(uly_comm *c, int device, const void *send, const uly_comm_layout *send_layouts,
                                  void *recv, const uly_comm_layout *recv_layouts, int dtype) {
    call k;
    if (comm_call_begin(&k, c, ULY_COMM_ALL_TO_ALL)) return -1;
    int P = c->size;
    k.h.dtype = dtype;
    k.h.device = device;
    if (device < 0 || device >= ULY_DEVICE_COUNT || !uly_backends[device] || !uly_backends[device]->pack_layout)
        comm_bad(&k, "device %d has no backend for exchanges", device);
    if (!comm_valid_dtype(dtype)) comm_bad(&k, "unknown dtype %d", dtype);
    if (!send_layouts || !recv_layouts) comm_bad(&k, "a layout array is NULL");
    int64_t *counts = calloc(2 * (size_t)P, sizeof *counts);
    if (!counts) return uly_set_error("all_to_all: out of memory");
    for (int j = 0; j < P && !k.h.bad; j++) {
        const char *why = layout_problem(&send_layouts[j]);
        if (!why) why = layout_problem(&recv_layouts[j]);
        if (why) { comm_bad(&k, "layout for rank %d: %s", j, why); break; }
        counts[j] = layout_numel(&send_layouts[j]);
        counts[P + j] = layout_numel(&recv_layouts[j]);
        if ((counts[j] && !send) || (counts[P + j] && !recv)) comm_bad(&k, "a NULL buffer with a non-zero count");
        const uly_comm_layout *L2[2] = {&send_layouts[j], &recv_layouts[j]};
        for (int q = 0; q < 2; q++) {
            if (L2[q]->count > INT_MAX) comm_bad(&k, "layout for rank %d repeats %lld times (at most %d)", j, (long long)L2[q]->count, INT_MAX);
            for (int r = 0; r < L2[q]->nruns; r++)
                if (L2[q]->offset[r] > INT_MAX || L2[q]->length[r] > INT_MAX)
                    comm_bad(&k, "layout for rank %d has a run beyond %d elements", j, INT_MAX);
        }
    }
    int agreed = comm_agree_counts(&k, counts, counts + P, 0);
    if (agreed) { free(counts); return -1; }
    int64_t es = uly_dtype_size(dtype);
    int me = c->rank, rc = 0;
    if (device != ULY_DEVICE_CPU) {
        rc = layouts_on_device(&k, device, send, send_layouts, recv, recv_layouts, dtype, counts);
        if (rc == 0)
            for (int j = 0; j < P; j++)
                if (j != me) comm_count_bytes(ULY_COMM_ALL_TO_ALL, c->world_ranks[j], counts[j] * es, counts[P + j] * es);
        free(counts);
        return comm_call_end(&k, rc);
    }
    if (counts[me]) copy_layout(recv, &recv_layouts[me], send, &send_layouts[me], es);
#ifdef ULY_WITH_MPI
    if (P > 1) {
        MPI_Datatype *types = malloc(2 * (size_t)P * sizeof *types);
        int *iv = calloc(4 * (size_t)P, sizeof *iv);  /* send counts, send displs, recv counts, recv displs */
        if (!types || !iv) { free(types); free(iv); free(counts); return uly_set_error("all_to_all: out of memory"); }
        MPI_Datatype elem = comm_mpi_type(dtype);
        for (int j = 0; j < P; j++) {
            types[j] = types[P + j] = MPI_BYTE;
            if (j == me) continue;
            if (counts[j]) { layout_type(&send_layouts[j], elem, es, &types[j]); iv[j] = 1; }
            if (counts[P + j]) { layout_type(&recv_layouts[j], elem, es, &types[P + j]); iv[2 * P + j] = 1; }
        }
        static char dummy[64];
        MPI_Request req;
        rc = MPI_Ialltoallw(send ? send : dummy, iv, iv + P, types, recv ? recv : dummy, iv + 2 * P, iv + 3 * P,
                            types + P, c->data, &req);
        rc = rc != MPI_SUCCESS ? comm_mpi_failed(&k, rc, "MPI_Ialltoallw") : comm_wait_one(&k, "moving data", &req);
        if (rc == 0 || !c->broken) {
            for (int j = 0; j < 2 * P; j++) if (types[j] != MPI_BYTE) MPI_Type_free(&types[j]);
            free(types);
            free(iv);
        }
    }
#endif
    if (rc == 0)
        for (int j = 0; j < P; j++)
            if (j != me) comm_count_bytes(ULY_COMM_ALL_TO_ALL, c->world_ranks[j], counts[j] * es, counts[P + j] * es);
    free(counts);
    return comm_call_end(&k, rc);
}
