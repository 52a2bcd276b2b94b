/* core/comm_internal.h — what the communication layer's files share (core/comm*.c): a group
 * (struct uly_comm), the grid's state, one collective call and its header, message building,
 * and the helpers one file defines for the others. Never included outside core/comm*.c. */
#ifndef ULY_COMM_INTERNAL_H
#define ULY_COMM_INTERNAL_H
#include "internal.h"
#ifdef ULY_WITH_MPI
#include <mpi.h>
#endif

#define COMM_HIDDEN __attribute__((visibility("hidden")))
#define CHUNK ((int64_t)1 << 30)  /* elements per MPI call of chunked collectives */

enum { KIND_CHECK_SAME = ULY_COMM_KINDS, KIND_FINALIZE, KIND_NAMES };
extern COMM_HIDDEN const char *const comm_kind_names[KIND_NAMES];   /* "all_to_all", ..., "check_same" */
extern COMM_HIDDEN const char *const comm_op_names[3];              /* "sum", "avg", "max" */

struct uly_comm {
    const char *name;      /* "world", "sp", "dp" */
    int rank, size;
    int *world_ranks;      /* group rank -> world rank */
    uint64_t calls;        /* collectives begun on this group: the next one's sequence number */
    int broken;            /* a wait timed out: no further collectives on this group */
    void *dev_comm;        /* the device backend's communicator (NCCL) for this group, once made */
    int dev_state;         /* 0 not tried yet, 1 dev_comm ready, -1 none: device buffers stage through the host */
    struct pending_reduce *pending;   /* all-reduces started and not yet waited for, in order */
    int n_pending, cap_pending;
#ifdef ULY_WITH_MPI
    MPI_Comm data, ctrl;   /* payload collectives; header exchanges */
#endif
};

/* the process grid and the stats (comm.c) */
typedef struct {
    int initialized;       /* uly_dist_init succeeded and no finalize since */
    int mpi;               /* the grid runs over MPI */
    int mpi_ours;          /* this library called MPI_Init_thread, so it finalizes */
    int mpi_done;          /* MPI was finalized: it cannot start again in this process */
    int rank, size, sp;
    double timeout;        /* seconds; <= 0: wait forever */
    int timeout_explicit;  /* set by uly_dist_set_timeout: the environment no longer applies */
    uly_comm world, sp_group, dp_group;
    int64_t *bytes;        /* [kind][world peer][0 received, 1 sent] */
    int64_t calls[ULY_COMM_KINDS];
    double seconds[ULY_COMM_KINDS];
} comm_grid;
extern COMM_HIDDEN comm_grid uly_grid;

typedef struct { char s[1900]; size_t n; } msgbuf;

/* ---------------------------------------------------------------- one collective call */

/* the header every rank of the group sends to every other before a collective */
typedef struct {
    int64_t kind, seq, dtype;
    int64_t device;        /* where the buffers live (ULY_DEVICE_*): every rank must agree */
    int64_t a, b;          /* kind-specific: see field_label */
    int64_t bad;           /* 1: this rank's arguments failed its local checks; note says why */
    char note[208];
} header;

typedef struct {
    uly_comm *c;
    int kind;
    uint64_t seq;
    double t0, deadline;   /* deadline 0: none */
    header h;              /* this rank's header */
} call;

/* comm_call.c: one collective call: messages, the header agreement, waiting with a deadline */
COMM_HIDDEN int comm_agree(call *k);
COMM_HIDDEN int comm_agree_counts(call *k, const int64_t *send_counts, const int64_t *recv_counts, int check_ints);
COMM_HIDDEN void comm_bad(call *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
COMM_HIDDEN int comm_call_begin(call *k, uly_comm *c, int kind);
COMM_HIDDEN int comm_call_end(call *k, int rc);
COMM_HIDDEN void comm_check_op(call *k, int op, int dtype);
COMM_HIDDEN void comm_check_tensor_arg(call *k, const char *what, const uly_tensor *t);
COMM_HIDDEN int64_t *comm_gather_rows(call *k, const int64_t *mine, int n);
COMM_HIDDEN double comm_now(void);
COMM_HIDDEN void comm_put(msgbuf *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
COMM_HIDDEN void comm_put_call(msgbuf *m, const call *k);
COMM_HIDDEN void comm_put_rank(msgbuf *m, const uly_comm *c, int r);
COMM_HIDDEN int comm_valid_dtype(int dtype);
#ifdef ULY_WITH_MPI
COMM_HIDDEN int comm_mpi_failed(const call *k, int rc, const char *what);
COMM_HIDDEN MPI_Op comm_mpi_op(int op);
COMM_HIDDEN MPI_Datatype comm_mpi_type(int dtype);
COMM_HIDDEN int comm_reduce_mpi(call *k, void *data, int64_t numel, int dtype, int op);
COMM_HIDDEN int comm_wait_one(call *k, const char *stage, MPI_Request *req);
#endif

/* comm.c: the grid's stats and timeout */
COMM_HIDDEN int64_t comm_block(int64_t n, int P, int j);
COMM_HIDDEN void comm_count_bytes(int kind, int world_peer, int64_t sent, int64_t received);
COMM_HIDDEN void comm_device_timeout(void);

/* comm_device.c: device buffers: the backend's communicator, its collectives, staging through the host */
COMM_HIDDEN int comm_device_aborted(const uly_comm *c);
COMM_HIDDEN const uly_backend *comm_device_collectives(call *k, int kind);
COMM_HIDDEN int comm_device_comm(uly_comm *c, int device);
COMM_HIDDEN int comm_device_done(call *k, int device, int rc);
COMM_HIDDEN int comm_finish(uly_tensor *t, uly_tensor *h, int rc);
COMM_HIDDEN uly_tensor *comm_host_copy(const uly_tensor *t, int with_data);
COMM_HIDDEN int comm_on_device(const uly_tensor *t);
COMM_HIDDEN int comm_staged(call *k, const uly_tensor *in, uly_tensor *out, int op);

/* comm_reduce.c: reductions and gathers */
COMM_HIDDEN int comm_all_gather_mpi(call *k, const void *src, void *dst, int64_t n, int dtype);
COMM_HIDDEN int comm_all_reduce_agree(call *k, uly_comm *c, uly_tensor *t, int op);
COMM_HIDDEN int comm_all_reduce_now(call *k, uly_tensor *t, int op);
COMM_HIDDEN void comm_count_all_reduce(const uly_comm *c, int64_t nbytes);
COMM_HIDDEN void comm_count_stacked(const uly_comm *c, int kind, int64_t nbytes);
COMM_HIDDEN void comm_divide_host(uly_tensor *t, int P);
COMM_HIDDEN int comm_reduce_scatter_agree(call *k, uly_comm *c, const uly_tensor *in, uly_tensor *out, int op);
COMM_HIDDEN int comm_reduce_scatter_now(call *k, const uly_tensor *in, uly_tensor *out, int op);
#ifdef ULY_WITH_MPI
COMM_HIDDEN int comm_reduce_scatter_mpi(call *k, const uly_tensor *in, uly_tensor *out, int op);
#endif
#endif
