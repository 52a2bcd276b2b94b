/* core/comm.c — the communication layer: the process grid (world, sequence-parallel and
 * data-parallel groups) and collectives on CPU tensors over Open MPI, with a cross-rank
 * consistency check before every collective, deadlines instead of hangs, and byte/time stats.
 *
 * Without MPI (the library built without it, or the process not launched by mpirun) the world
 * has one rank, MPI is never initialised, and every collective is a local copy or a no-op.
 *
 * One collective on a group of P ranks:
 *  1. every rank sends a fixed-size header (kind, the group's call number, dtype, sizes, and
 *     any failure of its local argument checks) to every other rank of the group on the group's
 *     control communicator, and receives theirs (point to point, so a missing rank is named);
 *  2. every rank judges the same table of headers by the same rules, so on any mismatch every
 *     rank returns the same error and no data moves; all_to_all_v and check_same exchange their
 *     count/value arrays the same way in a second round;
 *  3. the data moves with a non-blocking MPI collective on the group's data communicator.
 * Every wait polls MPI_Test, yields the CPU between polls (ranks are often oversubscribed) and
 * gives up at the deadline (uly_dist_set_timeout; else ULY_COMM_TIMEOUT; else 600 s). The group
 * is then marked broken (MPI may still write into its buffers, which are deliberately leaked)
 * and the caller is expected to end the job with uly_dist_abort.
 *
 * Stats count payload bytes only (not headers, not check_same), never a rank's transfers to
 * itself, and only collectives that completed. all_to_all_v counts exactly what goes to and
 * comes from each peer; all_reduce counts the bandwidth-optimal algorithm (reduce-scatter then
 * all-gather: 2 * block bytes with each peer), all_gather / reduce_scatter one block with each
 * peer, broadcast the flat tree (root -> every rank). What MPI moves on the wire may differ. */
#define _GNU_SOURCE
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "internal.h"
#ifdef ULY_WITH_MPI
#include <mpi.h>
#endif

enum { KIND_CHECK_SAME = ULY_COMM_KINDS, KIND_NAMES };
static const char *const kind_names[KIND_NAMES] = {
    "all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "check_same"};
static const char *const op_names[] = {"sum", "avg", "max"};

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

static struct {
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
} S = {.size = 1, .timeout = 600};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- messages */

typedef struct { char s[1900]; size_t n; } msgbuf;

static void put(msgbuf *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(msgbuf *m, const char *fmt, ...) {
    if (m->n >= sizeof m->s - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(m->s + m->n, sizeof m->s - m->n, fmt, ap);
    va_end(ap);
    if (k > 0) m->n += (size_t)k;
    if (m->n > sizeof m->s - 1) m->n = sizeof m->s - 1;
}

/* "rank 1", or "rank 1 (world 3)" in a group whose ranks are not the world's */
static void put_rank(msgbuf *m, const uly_comm *c, int r) {
    put(m, "rank %d", r);
    if (c->world_ranks[r] != r || c->size != S.size) put(m, " (world %d)", c->world_ranks[r]);
}

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

static void bad(call *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bad(call *k, const char *fmt, ...) {
    if (k->h.bad) return;  /* keep the first problem */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->h.note, sizeof k->h.note, fmt, ap);
    va_end(ap);
    k->h.bad = 1;
}

/* did the device backend's watchdog abort c's device communicator (kernels/cuda/comm.cu)? */
static int device_aborted(const uly_comm *c) {
    const uly_backend *be = uly_backends[ULY_DEVICE_CUDA];
    return c->dev_comm && be && be->comm_aborted && be->comm_aborted(c->dev_comm);
}

static int call_begin(call *k, uly_comm *c, int kind) {
    memset(k, 0, sizeof *k);
    if (!c) return uly_set_error("%s: no group given (call uly_dist_init first, then use its world, sp or dp group)",
                                 kind_names[kind]);
    if (!S.initialized) return uly_set_error("%s: the process grid is not initialised (uly_dist_init)", kind_names[kind]);
    if (device_aborted(c)) c->broken = 1;
    if (c->broken)
        return uly_set_error("%s on group %s: an earlier collective on this group timed out or its device "
                             "communicator was aborted, so its ranks are out of step for good; end the job "
                             "(uly.dist.abort)", kind_names[kind], c->name);
    k->c = c;
    k->kind = kind;
    k->seq = c->calls++;
    k->t0 = now();
    k->deadline = S.timeout > 0 ? k->t0 + S.timeout : 0;
    k->h.kind = kind;
    k->h.seq = (int64_t)k->seq;
    k->h.dtype = -1;
    return 0;
}

static int call_end(call *k, int rc) {
    if (rc == 0 && k->kind < ULY_COMM_KINDS) {
        S.calls[k->kind]++;
        S.seconds[k->kind] += now() - k->t0;
    }
    return rc;
}

/* the prefix of every message about this call: "all_reduce on group sp (call 5)" */
static void put_call(msgbuf *m, const call *k) {
    put(m, "%s on group %s", kind_names[k->kind], k->c->name);
    if (k->c->size > 1) put(m, " (call %llu)", (unsigned long long)k->seq + 1);
}

/* local checks on a tensor argument; records the first problem in the header */
static void check_tensor_arg(call *k, const char *what, const uly_tensor *t) {
    if (!t) { bad(k, "no %stensor given", what); return; }
    if (t->storage->device != ULY_DEVICE_CPU)
        bad(k, "the %stensor %s is on the GPU: collectives here take CPU tensors (move it to the CPU)", what,
            uly_desc(t));
    else if (!uly_tensor_is_contiguous(t))
        bad(k, "the %stensor %s is not contiguous: pass a contiguous tensor (t:contiguous())", what, uly_desc(t));
}

static int is_float_dtype(int64_t dtype) {
    return dtype == ULY_DTYPE_F32 || dtype == ULY_DTYPE_BF16 || dtype == ULY_DTYPE_F64;
}

static void check_op(call *k, int op, int dtype) {
    if (op < ULY_REDUCE_SUM || op > ULY_REDUCE_MAX) bad(k, "unknown reduction %d (sum = 0, avg = 1, max = 2)", op);
    else if (op == ULY_REDUCE_AVG && !is_float_dtype(dtype))
        bad(k, "avg of an integer (%s) tensor: use sum and divide", uly_dtype_name(dtype));
}

/* ---------------------------------------------------------------- judging the headers */

static const char *field_label(int kind, int field) {
    switch (kind) {
    case ULY_COMM_ALL_REDUCE: return field ? "reduction" : "element count";
    case ULY_COMM_ALL_GATHER: return field ? NULL : "element count of each rank's input";
    case ULY_COMM_REDUCE_SCATTER: return field ? "reduction" : "element count of each rank's output";
    case ULY_COMM_BROADCAST: return field ? "root" : "element count";
    case KIND_CHECK_SAME: return field ? NULL : "number of values";
    default: return NULL;
    }
}

static void put_field(msgbuf *m, int kind, int field, int64_t v) {
    if (field == 1 && (kind == ULY_COMM_ALL_REDUCE || kind == ULY_COMM_REDUCE_SCATTER) && v >= 0 && v <= 2)
        put(m, "%s", op_names[v]);
    else put(m, "%lld", (long long)v);
}

/* every rank in the same collective at the same call? */
static int judge_step(const call *k, const header *h, msgbuf *m) {
    int P = k->c->size, same = 1;
    for (int r = 1; r < P; r++) same &= h[r].kind == h[0].kind && h[r].seq == h[0].seq;
    if (same) return 0;
    put(m, "collectives out of step on group %s: ", k->c->name);
    for (int r = 0; r < P; r++) {
        put(m, r ? ", " : "");
        put_rank(m, k->c, r);
        int64_t kd = h[r].kind;
        put(m, " is in %s (call %lld)", kd >= 0 && kd < KIND_NAMES ? kind_names[kd] : "?", (long long)h[r].seq + 1);
    }
    put(m, ": every rank of a group must call the same collectives in the same order");
    return -1;
}

/* a rank whose local argument checks failed: everyone reports it */
static int judge_args(const call *k, const header *h, msgbuf *m) {
    int P = k->c->size, nbad = 0, same_note = 1, first = -1;
    for (int r = 0; r < P; r++)
        if (h[r].bad) {
            nbad++;
            if (first < 0) first = r;
            else same_note &= !strcmp(h[r].note, h[first].note);
        }
    if (!nbad) return 0;
    put_call(m, k);
    if (P == 1) { put(m, ": %s", h[0].note); return -1; }
    if (nbad == P && same_note) { put(m, ": invalid arguments on every rank: %s", h[0].note); return -1; }
    put(m, ": invalid arguments");
    for (int r = 0, i = 0; r < P; r++)
        if (h[r].bad) { put(m, i++ ? "; on " : " on "); put_rank(m, k->c, r); put(m, ": %s", h[r].note); }
    return -1;
}

static int judge_values(const call *k, const header *h, msgbuf *m) {
    int P = k->c->size;
    int same = 1;
    for (int r = 1; r < P; r++) same &= h[r].device == h[0].device;
    if (!same) {
        put_call(m, k);
        put(m, ": the tensors are on different devices: ");
        for (int r = 0; r < P; r++) {
            put(m, r ? ", " : "");
            put_rank(m, k->c, r);
            put(m, " has %s", uly_device_name((int)h[r].device));
        }
        put(m, "; move them to one device on every rank");
        return -1;
    }
    for (int r = 1; r < P; r++) same &= h[r].dtype == h[0].dtype;
    if (!same) {
        put_call(m, k);
        put(m, ": the dtype differs between ranks: ");
        for (int r = 0; r < P; r++) {
            put(m, r ? ", " : "");
            put_rank(m, k->c, r);
            put(m, " has %s", uly_dtype_name((int)h[r].dtype));
        }
        return -1;
    }
    for (int f = 0; f < 2; f++) {
        const char *label = field_label(k->kind, f);
        if (!label) continue;
        same = 1;
        for (int r = 1; r < P; r++) same &= (f ? h[r].b : h[r].a) == (f ? h[0].b : h[0].a);
        if (same) continue;
        put_call(m, k);
        put(m, ": the %s differs between ranks: ", label);
        for (int r = 0; r < P; r++) {
            put(m, r ? ", " : "");
            put_rank(m, k->c, r);
            put(m, " has ");
            put_field(m, k->kind, f, f ? h[r].b : h[r].a);
        }
        put(m, ": every rank must pass the same %s", f == 0 ? "shape" : label);
        return -1;
    }
    return 0;
}

static int judge(const call *k, const header *h) {
    msgbuf m = {.n = 0};
    if (judge_step(k, h, &m) || judge_args(k, h, &m) || judge_values(k, h, &m))
        return uly_set_error("%s", m.s);
    return 0;
}

/* ---------------------------------------------------------------- waiting (MPI) */
#ifdef ULY_WITH_MPI

static void relax(int spins) {
    if (spins < 64) { sched_yield(); return; }
    long ns = 2000L * (spins - 63);
    struct timespec ts = {0, ns < 1000000L ? ns : 1000000L};
    nanosleep(&ts, NULL);
}

static int mpi_failed(const call *k, int rc, const char *what) {
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, text, &len);
    msgbuf m = {.n = 0};
    put_call(&m, k);
    put(&m, ": %s failed: %s", what, text);
    return uly_set_error("%s", m.s);
}

static int timed_out(call *k, const char *stage, const MPI_Request *req, const int *peer, int n) {
    k->c->broken = 1;
    msgbuf m = {.n = 0};
    put(&m, "timed out after %g s in ", S.timeout);
    put_call(&m, k);
    int missing = 0;
    for (int i = 0; i < n; i++)
        if (req[i] != MPI_REQUEST_NULL && peer[i] >= 0) {
            put(&m, missing++ ? ", " : " waiting for ");
            put_rank(&m, k->c, peer[i]);
        }
    if (missing)
        put(&m, " (%s): a rank skipped a collective, died or is much slower", stage);
    else
        put(&m, " while %s, after every rank had arrived: a rank died or is much slower", stage);
    put(&m, "; the group cannot be used again: end the job (uly.dist.abort)");
    return uly_set_error("%s", m.s);
}

/* poll until every request completes or the deadline passes; peer[i] >= 0 names the group
 * rank a receive waits for (a timeout lists the ones still missing) */
static int wait_requests(call *k, const char *stage, MPI_Request *req, const int *peer, int n) {
    for (int spins = 0;; spins++) {
        int pending = 0;
        for (int i = 0; i < n; i++) {
            if (req[i] == MPI_REQUEST_NULL) continue;
            int done = 0, rc = MPI_Test(&req[i], &done, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) return mpi_failed(k, rc, stage);
            pending += !done;
        }
        if (!pending) return 0;
        if (k->deadline > 0 && now() > k->deadline) return timed_out(k, stage, req, peer, n);
        relax(spins);
    }
}

static int wait_one(call *k, const char *stage, MPI_Request *req) {
    int nobody = -1;
    return wait_requests(k, stage, req, &nobody, 1);
}

/* rows of `nbytes` in `all`, this rank's row filled in; afterwards every row is. On a timeout
 * MPI may still write into `all`: the caller must then leak it. */
static int exchange(call *k, const char *stage, int tag, char *all, int nbytes) {
    uly_comm *c = k->c;
    int P = c->size, n = 0, rc = MPI_SUCCESS;
    MPI_Request *req = malloc(2 * (size_t)P * sizeof *req);
    int *peer = malloc(2 * (size_t)P * sizeof *peer);
    if (!req || !peer) { free(req); free(peer); return uly_set_error("%s: out of memory", kind_names[k->kind]); }
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++)
        if (r != c->rank) {
            peer[n] = r;
            rc = MPI_Irecv(all + (size_t)r * nbytes, nbytes, MPI_BYTE, r, tag, c->ctrl, &req[n++]);
        }
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++)
        if (r != c->rank) {
            peer[n] = -1;
            rc = MPI_Isend(all + (size_t)c->rank * nbytes, nbytes, MPI_BYTE, r, tag, c->ctrl, &req[n++]);
        }
    int out = rc != MPI_SUCCESS ? (c->broken = 1, mpi_failed(k, rc, stage)) : wait_requests(k, stage, req, peer, n);
    free(req);
    free(peer);
    return out;
}
#endif

/* phase 1: every rank's header; 0 when they agree */
static int agree(call *k) {
    if (k->c->size == 1) return judge(k, &k->h);
#ifdef ULY_WITH_MPI
    int P = k->c->size;
    header *all = calloc((size_t)P, sizeof *all);
    if (!all) return uly_set_error("%s: out of memory", kind_names[k->kind]);
    all[k->c->rank] = k->h;
    if (exchange(k, "exchanging headers", 1, (char *)all, (int)sizeof *all)) return -1;  /* `all` leaked */
    int rc = judge(k, all);
    free(all);
    return rc;
#else
    return uly_set_error("%s: a group of %d ranks in a library built without MPI", kind_names[k->kind], k->c->size);
#endif
}

/* phase 2: every rank's row of n int64 values into a new [P][n] table (NULL on error) */
static int64_t *gather_rows(call *k, const int64_t *mine, int n) {
    int P = k->c->size;
    int64_t *all = calloc((size_t)P * (size_t)(n > 0 ? n : 1), sizeof *all);
    if (!all) return uly_set_error_null("%s: out of memory", kind_names[k->kind]);
    if (n > 0) memcpy(all + (size_t)k->c->rank * n, mine, (size_t)n * sizeof *all);
#ifdef ULY_WITH_MPI
    if (P > 1 && n > 0 && exchange(k, "exchanging sizes", 2, (char *)all, n * (int)sizeof *all)) return NULL;
#endif
    return all;
}

/* ---------------------------------------------------------------- MPI data movement */
#ifdef ULY_WITH_MPI
static MPI_Datatype mpi_type(int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return MPI_FLOAT;
    case ULY_DTYPE_BF16: return MPI_UINT16_T;  /* moved as bits; reductions go through f32 */
    case ULY_DTYPE_I32: return MPI_INT32_T;
    case ULY_DTYPE_I64: return MPI_INT64_T;
    default: return MPI_DOUBLE;
    }
}

static MPI_Op mpi_op(int op) { return op == ULY_REDUCE_MAX ? MPI_MAX : MPI_SUM; }

#define CHUNK ((int64_t)1 << 30)  /* elements per MPI call of chunked collectives */

static int reduce_mpi(call *k, void *data, int64_t numel, int dtype, int op) {
    int64_t es = uly_dtype_size(dtype);
    for (int64_t off = 0; off < numel; off += CHUNK) {
        int cnt = (int)(numel - off < CHUNK ? numel - off : CHUNK);
        MPI_Request req;
        int rc = MPI_Iallreduce(MPI_IN_PLACE, (char *)data + off * es, cnt, mpi_type(dtype), mpi_op(op), k->c->data, &req);
        if (rc != MPI_SUCCESS) return mpi_failed(k, rc, "MPI_Iallreduce");
        if (wait_one(k, "reducing", &req)) return -1;
    }
    return 0;
}
#endif

/* ---------------------------------------------------------------- stats */

static void count_bytes(int kind, int world_peer, int64_t sent, int64_t received) {
    if (!S.bytes || world_peer == S.rank || world_peer < 0 || world_peer >= S.size) return;
    int64_t *b = S.bytes + ((size_t)kind * S.size + world_peer) * 2;
    b[0] += received;
    b[1] += sent;
}

/* elements of block j when n elements are split into P nearly equal blocks */
static int64_t block(int64_t n, int P, int j) { return n * (j + 1) / P - n * j / P; }

int64_t uly_comm_bytes(int kind, int world_peer, int sent) {
    if (!S.bytes || kind < 0 || kind >= ULY_COMM_KINDS || world_peer < 0 || world_peer >= S.size) return 0;
    return S.bytes[((size_t)kind * S.size + world_peer) * 2 + (sent ? 1 : 0)];
}

double uly_comm_seconds(int kind) { return kind >= 0 && kind < ULY_COMM_KINDS ? S.seconds[kind] : 0; }
int64_t uly_comm_calls(int kind) { return kind >= 0 && kind < ULY_COMM_KINDS ? S.calls[kind] : 0; }

void uly_comm_reset_stats(void) {
    if (S.bytes) memset(S.bytes, 0, (size_t)ULY_COMM_KINDS * S.size * 2 * sizeof *S.bytes);
    memset(S.calls, 0, sizeof S.calls);
    memset(S.seconds, 0, sizeof S.seconds);
}

/* ---------------------------------------------------------------- collectives */

static int valid_dtype(int dtype) { return dtype >= ULY_DTYPE_F32 && dtype <= ULY_DTYPE_F64; }

/* phases 1 and 2 of an all-to-all: headers agree, then rank i's send_counts[j] must equal rank
 * j's recv_counts[i] for every pair (the same message on every rank otherwise) */
static int agree_counts(call *k, const int64_t *send_counts, const int64_t *recv_counts, int check_ints) {
    uly_comm *c = k->c;
    int P = c->size;
    int64_t *row = calloc(2 * (size_t)P, sizeof *row);
    if (!row) return uly_set_error("all_to_all: out of memory");
    for (int j = 0; j < P && !k->h.bad; j++) {
        int64_t v[2] = {send_counts[j], recv_counts[j]};
        for (int q = 0; q < 2; q++) {
            if (v[q] < 0) bad(k, "negative count %lld for rank %d", (long long)v[q], j);
            else if (check_ints && v[q] > INT_MAX)
                bad(k, "count %lld for rank %d is too large for one MPI call (at most %d elements): split the exchange",
                    (long long)v[q], j, INT_MAX);
        }
        row[j] = send_counts[j];
        row[P + j] = recv_counts[j];
    }
    k->h.a = P;
    if (agree(k)) { free(row); return -1; }
    int64_t *tab = gather_rows(k, row, 2 * P);
    free(row);
    if (!tab) return -1;
    msgbuf m = {.n = 0};
    int mismatches = 0;
    for (int i = 0; i < P; i++)
        for (int j = 0; j < P; j++) {
            int64_t s = tab[(size_t)i * 2 * P + j], r = tab[(size_t)j * 2 * P + P + i];
            if (s == r) continue;
            if (!mismatches) put_call(&m, k), put(&m, ": ");
            if (mismatches++ < 6) {
                put(&m, mismatches > 1 ? "; " : "");
                put_rank(&m, c, i);
                put(&m, " sends %lld elements to ", (long long)s);
                put_rank(&m, c, j);
                put(&m, " but rank %d expects %lld", j, (long long)r);
            }
        }
    free(tab);
    if (mismatches) {
        if (mismatches > 6) put(&m, "; ... (%d mismatches in all)", mismatches);
        put(&m, ": rank i's send_counts[j] must equal rank j's recv_counts[i]");
        return uly_set_error("%s", m.s);
    }
    return 0;
}

int uly_comm_all_to_all_v(uly_comm *c, const void *send, const int64_t *send_counts, const int64_t *send_displs,
                          void *recv, const int64_t *recv_counts, const int64_t *recv_displs, int dtype) {
    call k;
    if (call_begin(&k, c, ULY_COMM_ALL_TO_ALL)) return -1;
    int P = c->size;
    k.h.dtype = dtype;
    if (!valid_dtype(dtype)) bad(&k, "unknown dtype %d", dtype);
    if (!send_counts || !send_displs || !recv_counts || !recv_displs) bad(&k, "a count or displacement array is NULL");
    for (int j = 0; j < P && !k.h.bad; j++) {
        int64_t d[2] = {send_displs[j], recv_displs[j]};
        for (int q = 0; q < 2; q++) {
            if (d[q] < 0) bad(&k, "negative displacement %lld for rank %d", (long long)d[q], j);
            else if (d[q] > INT_MAX)
                bad(&k, "displacement %lld for rank %d is too large for one MPI call (at most %d elements): split the exchange",
                    (long long)d[q], j, INT_MAX);
        }
        if ((send_counts[j] && !send) || (recv_counts[j] && !recv)) bad(&k, "a NULL buffer with a non-zero count");
    }
    int64_t *zeros = NULL;
    if (!send_counts || !recv_counts) { /* still take part, so every rank gets the error */
        zeros = calloc((size_t)P, sizeof *zeros);
        if (!zeros) return uly_set_error("all_to_all: out of memory");
    }
    int agreed = agree_counts(&k, send_counts ? send_counts : zeros, recv_counts ? recv_counts : zeros, 1);
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
        MPI_Datatype T = mpi_type(dtype);
        rc = MPI_Ialltoallv(send ? send : dummy, iv, iv + P, T, recv ? recv : dummy, iv + 2 * P, iv + 3 * P, T,
                            c->data, &req);
        rc = rc != MPI_SUCCESS ? mpi_failed(&k, rc, "MPI_Ialltoallv") : wait_one(&k, "moving data", &req);
        if (rc == 0 || !c->broken) free(iv);
    }
#endif
    if (rc == 0)
        for (int j = 0; j < P; j++) count_bytes(ULY_COMM_ALL_TO_ALL, c->world_ranks[j], send_counts[j] * es, recv_counts[j] * es);
    return call_end(&k, rc);
}

/* a rank whose all-to-all arguments failed its own checks still joins the header round, so
 * every rank of the group returns the same error instead of waiting for it */
int uly_comm_all_to_all_refuse(uly_comm *c, const char *why) {
    call k;
    if (call_begin(&k, c, ULY_COMM_ALL_TO_ALL)) return -1;
    bad(&k, "%s", why);
    k.h.a = c->size;
    agree(&k);
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

static int layouts_on_device(call *k, int device, const void *send, const uly_comm_layout *sl, void *recv,
                             const uly_comm_layout *rl, int dtype, const int64_t *counts);
static int device_comm(uly_comm *c, int device);
static int device_done(call *k, int device, int rc);
static const uly_backend *device_collectives(call *k, int kind);
static int reduce_scatter_now(call *k, const uly_tensor *in, uly_tensor *out, int op);

int uly_comm_all_to_all_layout(uly_comm *c, const void *send, const uly_comm_layout *send_layouts,
                               void *recv, const uly_comm_layout *recv_layouts, int dtype) {
    return uly_comm_all_to_all_layout_on(c, ULY_DEVICE_CPU, send, send_layouts, recv, recv_layouts, dtype);
}

int uly_comm_all_to_all_layout_on(uly_comm *c, int device, const void *send, const uly_comm_layout *send_layouts,
                                  void *recv, const uly_comm_layout *recv_layouts, int dtype) {
    call k;
    if (call_begin(&k, c, ULY_COMM_ALL_TO_ALL)) return -1;
    int P = c->size;
    k.h.dtype = dtype;
    k.h.device = device;
    if (device < 0 || device >= ULY_DEVICE_COUNT || !uly_backends[device] || !uly_backends[device]->pack_layout)
        bad(&k, "device %d has no backend for exchanges", device);
    if (!valid_dtype(dtype)) bad(&k, "unknown dtype %d", dtype);
    if (!send_layouts || !recv_layouts) bad(&k, "a layout array is NULL");
    int64_t *counts = calloc(2 * (size_t)P, sizeof *counts);
    if (!counts) return uly_set_error("all_to_all: out of memory");
    for (int j = 0; j < P && !k.h.bad; j++) {
        const char *why = layout_problem(&send_layouts[j]);
        if (!why) why = layout_problem(&recv_layouts[j]);
        if (why) { bad(&k, "layout for rank %d: %s", j, why); break; }
        counts[j] = layout_numel(&send_layouts[j]);
        counts[P + j] = layout_numel(&recv_layouts[j]);
        if ((counts[j] && !send) || (counts[P + j] && !recv)) bad(&k, "a NULL buffer with a non-zero count");
        const uly_comm_layout *L2[2] = {&send_layouts[j], &recv_layouts[j]};
        for (int q = 0; q < 2; q++) {
            if (L2[q]->count > INT_MAX) bad(&k, "layout for rank %d repeats %lld times (at most %d)", j, (long long)L2[q]->count, INT_MAX);
            for (int r = 0; r < L2[q]->nruns; r++)
                if (L2[q]->offset[r] > INT_MAX || L2[q]->length[r] > INT_MAX)
                    bad(&k, "layout for rank %d has a run beyond %d elements", j, INT_MAX);
        }
    }
    int agreed = agree_counts(&k, counts, counts + P, 0);
    if (agreed) { free(counts); return -1; }
    int64_t es = uly_dtype_size(dtype);
    int me = c->rank, rc = 0;
    if (device != ULY_DEVICE_CPU) {
        rc = layouts_on_device(&k, device, send, send_layouts, recv, recv_layouts, dtype, counts);
        if (rc == 0)
            for (int j = 0; j < P; j++)
                if (j != me) count_bytes(ULY_COMM_ALL_TO_ALL, c->world_ranks[j], counts[j] * es, counts[P + j] * es);
        free(counts);
        return call_end(&k, rc);
    }
    if (counts[me]) copy_layout(recv, &recv_layouts[me], send, &send_layouts[me], es);
#ifdef ULY_WITH_MPI
    if (P > 1) {
        MPI_Datatype *types = malloc(2 * (size_t)P * sizeof *types);
        int *iv = calloc(4 * (size_t)P, sizeof *iv);  /* send counts, send displs, recv counts, recv displs */
        if (!types || !iv) { free(types); free(iv); free(counts); return uly_set_error("all_to_all: out of memory"); }
        MPI_Datatype elem = mpi_type(dtype);
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
        rc = rc != MPI_SUCCESS ? mpi_failed(&k, rc, "MPI_Ialltoallw") : wait_one(&k, "moving data", &req);
        if (rc == 0 || !c->broken) {
            for (int j = 0; j < 2 * P; j++) if (types[j] != MPI_BYTE) MPI_Type_free(&types[j]);
            free(types);
            free(iv);
        }
    }
#endif
    if (rc == 0)
        for (int j = 0; j < P; j++)
            if (j != me) count_bytes(ULY_COMM_ALL_TO_ALL, c->world_ranks[j], counts[j] * es, counts[P + j] * es);
    free(counts);
    return call_end(&k, rc);
}

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
    if (reduce_mpi(k, uly_ptr(t), uly_tensor_numel(t), t->dtype, op)) return -1;
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

static void count_all_reduce(const uly_comm *c, int64_t nbytes) {
    for (int j = 0; j < c->size; j++) {
        int64_t b = block(nbytes, c->size, j) + block(nbytes, c->size, c->rank);
        count_bytes(ULY_COMM_ALL_REDUCE, c->world_ranks[j], b, b);
    }
}

/* out must be in's shape with the first dimension times `factor` (a 0-d in counts as [1]) */
static void check_stacked(call *k, const uly_tensor *small, const uly_tensor *big, int factor, const char *rule) {
    if (!small || !big || k->h.bad) return;
    if (small->dtype != big->dtype) {
        bad(k, "the input and the output differ in dtype (%s, %s)", uly_dtype_name(small->dtype), uly_dtype_name(big->dtype));
        return;
    }
    int64_t s0 = small->ndim ? small->shape[0] : 1;
    int ok = big->ndim == (small->ndim ? small->ndim : 1) && big->shape[0] == s0 * factor;
    for (int d = 1; ok && d < small->ndim; d++) ok = big->shape[d] == small->shape[d];
    if (!ok) bad(k, "%s: got input %s and output %s", rule, uly_desc(k->kind == ULY_COMM_ALL_GATHER ? small : big),
                 uly_desc(k->kind == ULY_COMM_ALL_GATHER ? big : small));
}

/* ---- all-gather and reduce-scatter (ZeRO): host tensors over MPI; device tensors over the
 * backend's collectives (NCCL) when the group has them, else staged through host memory ---- */

/* a tensor argument that may live on a device: present and contiguous */
static void check_any_arg(call *k, const char *what, const uly_tensor *t) {
    if (!t) bad(k, "no %stensor given", what);
    else if (!uly_tensor_is_contiguous(t))
        bad(k, "the %stensor %s is not contiguous: pass a contiguous tensor (t:contiguous())", what, uly_desc(t));
}

/* where a collective's two tensors live: their device, or -1 when they differ (staged) */
static int64_t pair_device(const uly_tensor *a, const uly_tensor *b) {
    if (!a || !b) return ULY_DEVICE_CPU;
    return uly_dev(a) == uly_dev(b) ? uly_dev(a) : -1;
}

/* the checks and agreement of an all-gather; *in_place: in is this rank's block of out */
static int all_gather_agree(call *k, uly_comm *c, const uly_tensor *in, uly_tensor *out, int *in_place) {
    *in_place = 0;
    if (call_begin(k, c, ULY_COMM_ALL_GATHER)) return -1;
    check_any_arg(k, "input ", in);
    check_any_arg(k, "output ", out);
    check_stacked(k, in, out, c->size, "the output must be the input stacked over the group's ranks along dim 0");
    if (in) {
        k->h.dtype = in->dtype;
        k->h.a = uly_tensor_numel(in);
        if (k->h.a > INT_MAX) bad(k, "the input has %lld elements, more than one MPI call takes (%d)", (long long)k->h.a, INT_MAX);
    }
    k->h.device = pair_device(in, out);
    if (in && out && !k->h.bad && uly_dev(in) == uly_dev(out)) {
        int64_t bytes = k->h.a * (int64_t)uly_dtype_size(in->dtype);
        const char *src = uly_ptr(in), *dst = uly_ptr(out);
        *in_place = bytes > 0 && src == dst + (int64_t)c->rank * bytes;
        if (!*in_place && bytes > 0 && src < dst + bytes * c->size && dst < src + bytes)
            bad(k, "the input overlaps the output other than as this rank's block of it (block %d); pass a "
                "separate input, or exactly that block", c->rank);
    }
    return agree(k);
}

/* the agreed all-gather's data between host buffers (src NULL: in place) */
static int all_gather_mpi(call *k, const void *src, void *dst, int64_t n, int dtype) {
#ifdef ULY_WITH_MPI
    MPI_Request req;
    MPI_Datatype T = mpi_type(dtype);
    int rc = MPI_Iallgather(src ? src : MPI_IN_PLACE, (int)n, T, dst, (int)n, T, k->c->data, &req);
    return rc != MPI_SUCCESS ? mpi_failed(k, rc, "MPI_Iallgather") : wait_one(k, "moving data", &req);
#else
    (void)k; (void)src; (void)dst; (void)n; (void)dtype;
    return uly_set_error("all_gather: built without MPI");
#endif
}

static void count_stacked(const uly_comm *c, int kind, int64_t nbytes) {
    for (int j = 0; j < c->size; j++) count_bytes(kind, c->world_ranks[j], nbytes, nbytes);
}

/* avg's division of a host result */
static void divide_host(uly_tensor *t, int P) {
    int64_t n = uly_tensor_numel(t);
    if (t->dtype == ULY_DTYPE_F32) { float *x = uly_f32(t); for (int64_t i = 0; i < n; i++) x[i] /= (float)P; }
    else if (t->dtype == ULY_DTYPE_F64) { double *x = uly_ptr(t); for (int64_t i = 0; i < n; i++) x[i] /= P; }
}

#ifdef ULY_WITH_MPI
static int reduce_scatter_mpi(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    if (in->dtype == ULY_DTYPE_BF16) {
        uly_tensor *fi = uly_new_contiguous(in->ndim, in->shape, ULY_DTYPE_F32, ULY_DEVICE_CPU);
        uly_tensor *fo = fi ? uly_new_contiguous(out->ndim, out->shape, ULY_DTYPE_F32, ULY_DEVICE_CPU) : NULL;
        int rc = fo ? uly_copy_raw(fi, in) : -1;
        if (!rc) rc = reduce_scatter_mpi(k, fi, fo, op);
        if (!rc) rc = uly_copy_raw(out, fo);
        if (rc == 0 || !k->c->broken) { if (fi) uly_tensor_release(fi); if (fo) uly_tensor_release(fo); }
        return rc;
    }
    int64_t n = uly_tensor_numel(out);
    MPI_Request req;
    int rc = MPI_Ireduce_scatter_block(uly_ptr(in), uly_ptr(out), (int)n, mpi_type(in->dtype), mpi_op(op),
                                       k->c->data, &req);
    if (rc != MPI_SUCCESS) return mpi_failed(k, rc, "MPI_Ireduce_scatter_block");
    if (wait_one(k, "reducing", &req)) return -1;
    if (op == ULY_REDUCE_AVG) divide_host(out, k->c->size);
    return 0;
}
#endif

/* the checks and agreement of a reduce-scatter */
static int reduce_scatter_agree(call *k, uly_comm *c, const uly_tensor *in, uly_tensor *out, int op) {
    if (call_begin(k, c, ULY_COMM_REDUCE_SCATTER)) return -1;
    check_any_arg(k, "input ", in);
    check_any_arg(k, "output ", out);
    check_stacked(k, out, in, c->size, "the input must be the output's shape with dim 0 times the group size");
    if (in) check_op(k, op, in->dtype);
    if (out) {
        k->h.dtype = out->dtype;
        k->h.a = uly_tensor_numel(out);
        if (k->h.a > INT_MAX) bad(k, "the output has %lld elements, more than one MPI call takes (%d)", (long long)k->h.a, INT_MAX);
    }
    k->h.b = op;
    k->h.device = pair_device(in, out);
    if (in && out && !k->h.bad && uly_dev(in) == uly_dev(out)) {
        const char *src = uly_ptr(in), *dst = uly_ptr(out);
        int64_t nb = k->h.a * (int64_t)uly_dtype_size(out->dtype);
        if (nb > 0 && src < dst + nb && dst < src + nb * c->size)
            bad(k, "the output overlaps the input; reduce into a separate tensor");
    }
    return agree(k);
}

static int broadcast_host(uly_comm *c, uly_tensor *t, int root) {
    call k;
    if (call_begin(&k, c, ULY_COMM_BROADCAST)) return -1;
    check_tensor_arg(&k, "", t);
    if (root < 0 || root >= c->size) bad(&k, "root %d is not a rank of group %s (ranks 0 to %d)", root, c->name, c->size - 1);
    if (t) {
        k.h.dtype = t->dtype;
        k.h.a = uly_tensor_numel(t);
    }
    k.h.b = root;
    if (agree(&k)) return -1;
    int64_t n = k.h.a, es = uly_dtype_size(t->dtype);
    int rc = 0;
#ifdef ULY_WITH_MPI
    for (int64_t off = 0; c->size > 1 && off < n && rc == 0; off += CHUNK) {
        MPI_Request req;
        int cnt = (int)(n - off < CHUNK ? n - off : CHUNK);
        rc = MPI_Ibcast((char *)uly_ptr(t) + off * es, cnt, mpi_type(t->dtype), root, c->data, &req);
        rc = rc != MPI_SUCCESS ? mpi_failed(&k, rc, "MPI_Ibcast") : wait_one(&k, "moving data", &req);
    }
#endif
    if (rc == 0) {
        uly_bump_version(t);
        for (int j = 0; j < c->size; j++) {
            int from_me = c->rank == root, to_me = j == root;
            count_bytes(ULY_COMM_BROADCAST, c->world_ranks[j], from_me ? n * es : 0, to_me ? n * es : 0);
        }
    }
    return call_end(&k, rc);
}

/* the header exchange already waits for every rank of the group */
int uly_comm_barrier(uly_comm *c) {
    call k;
    if (call_begin(&k, c, ULY_COMM_BARRIER)) return -1;
    return call_end(&k, agree(&k));
}

int uly_comm_check_same(uly_comm *c, const char *what, const int64_t *values, int n) {
    call k;
    if (call_begin(&k, c, KIND_CHECK_SAME)) return -1;
    if (n < 0 || (n > 0 && !values)) bad(&k, "%d values at %p", n, (const void *)values);
    if (n > (1 << 20)) bad(&k, "%d values: at most %d", n, 1 << 20);
    k.h.a = n;
    if (agree(&k)) return -1;
    int64_t *tab = gather_rows(&k, values, n);
    if (!tab) return -1;
    int same = 1, P = c->size;
    for (int r = 1; r < P; r++) same &= !memcmp(tab, tab + (size_t)r * n, (size_t)n * sizeof *tab);
    if (!same) {
        msgbuf m = {.n = 0};
        put(&m, "%s differs between the ranks of group %s: ", what && *what ? what : "a value", c->name);
        for (int r = 0; r < P; r++) {
            put(&m, r ? "; " : "");
            put_rank(&m, c, r);
            put(&m, ":");
            for (int i = 0; i < n && i < 16; i++) put(&m, " %lld", (long long)tab[(size_t)r * n + i]);
            if (n > 16) put(&m, " ...");
        }
        put(&m, ": every rank must use the same configuration");
        free(tab);
        return uly_set_error("%s", m.s);
    }
    free(tab);
    return call_end(&k, 0);
}

/* ---------------------------------------------------------------- the grid */

static int env_rank(void) {
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    if (!r) r = getenv("PMI_RANK");
    return r ? atoi(r) : 0;
}

static int launched_size(void) {
    const char *s = getenv("OMPI_COMM_WORLD_SIZE");
    if (!s) s = getenv("PMI_SIZE");
    return s ? atoi(s) : 0;
}

static double env_timeout(void) {
    const char *s = getenv("ULY_COMM_TIMEOUT");
    if (!s || !*s) return 600;
    char *end;
    double v = strtod(s, &end);
    return end != s ? v : 600;
}

/* the device backend's watchdog takes the same limit as the MPI waits */
static void device_timeout(void) {
    const uly_backend *be = uly_backends[ULY_DEVICE_CUDA];
    if (be && be->comm_set_timeout) be->comm_set_timeout(S.timeout);
}

void uly_dist_set_timeout(double seconds) {
    S.timeout = seconds;
    S.timeout_explicit = 1;
    device_timeout();
}

static int single_group(uly_comm *g, const char *name) {
    g->name = name;
    g->rank = 0;
    g->size = 1;
    g->world_ranks = calloc(1, sizeof *g->world_ranks);
    return g->world_ranks ? 0 : uly_set_error("uly_dist_init: out of memory");
}

#ifdef ULY_WITH_MPI
static void at_exit(void) { uly_dist_finalize(); }

/* MPI_Init_thread when launched by mpirun (or MPI already running); *world = 0: no MPI */
static int start_mpi(int *world) {
    int inited = 0, finished = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finished);
    if (finished) return uly_set_error("uly_dist_init: MPI was finalized already; it cannot start again in this process");
    *world = 0;
    if (!inited && !launched_size()) return 0;
    if (!inited) {
        int provided = 0;
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
            return uly_set_error("uly_dist_init: MPI_Init_thread failed");
        S.mpi_ours = 1;
        atexit(at_exit);
    }
    MPI_Comm_size(MPI_COMM_WORLD, world);
    MPI_Comm_rank(MPI_COMM_WORLD, &S.rank);
    return 0;
}

static int mpi_group(uly_comm *g, const char *name, int color) {
    g->name = name;
    if (MPI_Comm_split(MPI_COMM_WORLD, color, S.rank, &g->data) != MPI_SUCCESS ||
        MPI_Comm_dup(g->data, &g->ctrl) != MPI_SUCCESS)
        return uly_set_error("uly_dist_init: splitting the %s group failed", name);
    MPI_Comm_set_errhandler(g->data, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(g->ctrl, MPI_ERRORS_RETURN);
    MPI_Comm_rank(g->data, &g->rank);
    MPI_Comm_size(g->data, &g->size);
    g->world_ranks = calloc((size_t)g->size, sizeof *g->world_ranks);
    int *mine = calloc((size_t)g->size, sizeof *mine);
    if (!g->world_ranks || !mine) { free(mine); return uly_set_error("uly_dist_init: out of memory"); }
    MPI_Group gg, wg;
    MPI_Comm_group(g->data, &gg);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    for (int i = 0; i < g->size; i++) mine[i] = i;
    MPI_Group_translate_ranks(gg, g->size, mine, wg, g->world_ranks);
    MPI_Group_free(&gg);
    MPI_Group_free(&wg);
    free(mine);
    return 0;
}
#endif

static void free_group(uly_comm *g) {
    if (device_aborted(g)) g->broken = 1;   /* a peer may be stuck: MPI cannot shut down cleanly */
    if (g->n_pending && !g->broken) uly_comm_wait_all(g);   /* MPI must not shut down under them */
    free(g->pending);
    if (g->dev_comm && uly_backends[ULY_DEVICE_CUDA] && uly_backends[ULY_DEVICE_CUDA]->comm_destroy)
        uly_backends[ULY_DEVICE_CUDA]->comm_destroy(g->dev_comm);
#ifdef ULY_WITH_MPI
    if (S.mpi && !g->broken && g->world_ranks) {
        MPI_Comm_free(&g->data);
        MPI_Comm_free(&g->ctrl);
    }
#endif
    free(g->world_ranks);
    memset(g, 0, sizeof *g);
}

int uly_dist_init(int sp_size) {
    if (sp_size < 1) return uly_set_error("uly_dist_init: sp = %d: the sequence-parallel group size must be at least 1", sp_size);
    if (S.initialized) {
        if (sp_size == S.sp) return 0;
        return uly_set_error("uly_dist_init: the grid is already set up with sp = %d; it cannot change to sp = %d in the "
                             "same process", S.sp, sp_size);
    }
    if (!S.timeout_explicit) S.timeout = env_timeout();
    int world = 0;
    S.rank = 0;
#ifdef ULY_WITH_MPI
    if (start_mpi(&world)) return -1;
#else
    if (launched_size() > 1)
        return uly_set_error("uly_dist_init: launched by mpirun with %d ranks, but libulysses was built without MPI: "
                             "install libopenmpi-dev and rebuild (scripts/setup.sh)", launched_size());
#endif
    S.mpi = world > 0;
    if (!S.mpi) world = 1;
    if (world % sp_size) {
        if (!S.mpi)
            return uly_set_error("uly_dist_init: sp = %d needs %d ranks, but this process is a world of 1 rank (not "
                                 "launched by mpirun): run it with mpirun -np %d, or use sp = 1", sp_size, sp_size, sp_size);
        return uly_set_error("uly_dist_init: %d ranks cannot be split into sequence-parallel groups of %d: the world "
                             "size must be a multiple of sp", world, sp_size);
    }
    S.size = world;
    S.sp = sp_size;
    S.bytes = calloc((size_t)ULY_COMM_KINDS * world * 2, sizeof *S.bytes);
    if (!S.bytes) return uly_set_error("uly_dist_init: out of memory");
    int rc;
#ifdef ULY_WITH_MPI
    if (S.mpi)
        rc = mpi_group(&S.world, "world", 0) || mpi_group(&S.sp_group, "sp", S.rank / sp_size) ||
             mpi_group(&S.dp_group, "dp", S.rank % sp_size);
    else
#endif
        rc = single_group(&S.world, "world") || single_group(&S.sp_group, "sp") || single_group(&S.dp_group, "dp");
    if (rc) {
        free_group(&S.world); free_group(&S.sp_group); free_group(&S.dp_group);
        free(S.bytes); S.bytes = NULL;
        return -1;
    }
    uly_comm_reset_stats();
    S.initialized = 1;
    return 0;
}

int uly_dist_initialized(void) { return S.initialized; }

int uly_dist_finalize(void) {
    int broken = 0;
    const uly_comm *groups[3] = {&S.world, &S.sp_group, &S.dp_group};
    for (int i = 0; i < 3; i++) broken |= groups[i]->broken || device_aborted(groups[i]);
    if (S.initialized) {
        free_group(&S.world);
        free_group(&S.sp_group);
        free_group(&S.dp_group);
        free(S.bytes);
        S.bytes = NULL;
        S.initialized = 0;
        S.sp = 0;
    }
#ifdef ULY_WITH_MPI
    int inited = 0, finished = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finished);
    if (S.mpi_ours && inited && !finished) {
        if (broken) uly_dist_abort("a collective timed out or failed on the device earlier, so MPI cannot shut down "
                                   "cleanly: ending the job");
        MPI_Finalize();
        S.mpi_done = 1;
    }
#endif
    (void)broken;
    return 0;
}

int uly_dist_abort(const char *message) {
    int rank = S.initialized ? S.rank : env_rank();
    fflush(stdout);
    fprintf(stderr, "ulysses: rank %d: %s\n", rank, message && *message ? message : "aborted");
    fflush(stderr);
#ifdef ULY_WITH_MPI
    int inited = 0, finished = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finished);
    if (inited && !finished) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    exit(1);
}

uly_comm *uly_dist_world(void) { return S.initialized ? &S.world : uly_set_error_null("uly_dist_world: call uly_dist_init first"); }
uly_comm *uly_dist_sp_group(void) { return S.initialized ? &S.sp_group : uly_set_error_null("uly_dist_sp_group: call uly_dist_init first"); }
uly_comm *uly_dist_dp_group(void) { return S.initialized ? &S.dp_group : uly_set_error_null("uly_dist_dp_group: call uly_dist_init first"); }

int uly_comm_rank(const uly_comm *c) { return c ? c->rank : -1; }
int uly_comm_size(const uly_comm *c) { return c ? c->size : -1; }
int uly_comm_device_path(const uly_comm *c) { return c ? c->dev_state : 0; }
int uly_comm_world_rank_of(const uly_comm *c, int rank) {
    return c && rank >= 0 && rank < c->size ? c->world_ranks[rank] : -1;
}
const char *uly_comm_name(const uly_comm *c) { return c ? c->name : ""; }

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
    if (P > 1 && device_comm(c, device) == 1) {
        rc = device_done(k, device, be->comm_all_to_all_v(c->dev_comm, sp, counts, displs, rp, counts + P, displs + P, dtype));
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
                int m = MPI_Ialltoallv(hs, iv, iv + P, mpi_type(dtype), hr, iv + 2 * P, iv + 3 * P, mpi_type(dtype), c->data, &req);
                rc = m != MPI_SUCCESS ? mpi_failed(k, m, "MPI_Ialltoallv") : wait_one(k, "moving data", &req);
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

/* ---- device tensors: staged through host memory (MPI moves host buffers) ---- */
static int on_device(const uly_tensor *t) { return t && uly_dev(t) != ULY_DEVICE_CPU; }

/* a host copy of t (contiguous), or t itself retained when it is a host tensor already */
static uly_tensor *host_copy(const uly_tensor *t, int with_data) {
    if (!on_device(t)) { if (t) uly_tensor_retain((uly_tensor *)t); return (uly_tensor *)t; }
    uly_tensor *h = uly_new_contiguous(t->ndim, t->shape, t->dtype, ULY_DEVICE_CPU);
    if (h && with_data && uly_copy_raw(h, t)) { uly_tensor_release(h); h = NULL; }
    return h;
}

/* after a collective on the host copy h of t: the result goes back into t */
static int finish(uly_tensor *t, uly_tensor *h, int rc) {
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
static int device_comm(uly_comm *c, int device) {
    if (c->dev_state) return c->dev_state;
    c->dev_state = -1;
#ifdef ULY_WITH_MPI
    const uly_backend *be = uly_backends[device];
    if (c->size < 2 || !S.mpi) return c->dev_state;
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
    device_timeout();
#endif
    return c->dev_state;
}

/* the device collective just queued: wait for it, report its failure */
static int device_done(call *k, int device, int rc) {
    const uly_backend *be = uly_backends[device];
    if (be->synchronize() != 0) rc = -1;
    const char *why = be->take_error();
    if (rc || why) {
        msgbuf m = {.n = 0};
        put_call(&m, k);
        put(&m, ": the device collective failed: %s", why ? why : "no reason given");
        return uly_set_error("%s", m.s);
    }
    return 0;
}

/* the checks and the agreement of an all-reduce of t (host or device) */
static int all_reduce_agree(call *k, uly_comm *c, uly_tensor *t, int op) {
    if (call_begin(k, c, ULY_COMM_ALL_REDUCE)) return -1;
    if (!on_device(t)) check_tensor_arg(k, "", t);
    else if (!uly_tensor_is_contiguous(t))
        bad(k, "the tensor %s is not contiguous: pass a contiguous tensor (t:contiguous())", uly_desc(t));
    if (t) {
        check_op(k, op, t->dtype);
        k->h.dtype = t->dtype;
        k->h.device = uly_dev(t);
        k->h.a = uly_tensor_numel(t);
    }
    k->h.b = op;
    return agree(k);
}

/* the agreed all-reduce's data, moved now */
static int all_reduce_now(call *k, uly_tensor *t, int op) {
    uly_comm *c = k->c;
    int rc = 0, dev = uly_dev(t);
    if (!on_device(t)) rc = reduce_tensor(k, t, op);
    else if (c->size > 1 && device_comm(c, dev) == 1) {
        const uly_backend *be = uly_backends[dev];
        rc = device_done(k, dev, be->comm_all_reduce(c->dev_comm, uly_ptr(t), uly_tensor_numel(t), t->dtype, op));
    } else if (c->size > 1) { /* through host memory */
        uly_tensor *h = uly_new_contiguous(t->ndim, t->shape, t->dtype, ULY_DEVICE_CPU);
        rc = (!h || uly_copy_raw(h, t)) ? -1 : reduce_tensor(k, h, op);
        if (!rc) rc = uly_copy_raw(t, h);
        if (rc == 0 || !c->broken) uly_tensor_release(h);
    }
    if (rc == 0) {
        uly_bump_version(t);
        count_all_reduce(c, uly_tensor_nbytes(t));
    }
    return rc;
}

int uly_comm_all_reduce_(uly_comm *c, uly_tensor *t, int op) {
    call k;
    if (all_reduce_agree(&k, c, t, op)) return -1;
    return call_end(&k, all_reduce_now(&k, t, op));
}

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
    put_call(&m, k);
    put(&m, ": the device collective failed: %s", why ? why : "no reason given");
    return uly_set_error("%s", m.s);
}

/* the data of the agreed all-reduce k of t moving in the background, if it can (else -2) */
static int all_reduce_background(call *k, uly_tensor *t, int op) {
    uly_comm *c = k->c;
    int dev = uly_dev(t);
    pending_reduce *p = NULL;
    if (on_device(t)) {
        const uly_backend *be = uly_backends[dev];
        if (device_comm(c, dev) != 1 || !be->comm_all_reduce_start || !be->comm_join) return -2;
        if (!(p = push_pending(c))) return -2;
        int rc = be->comm_all_reduce_start(c->dev_comm, uly_ptr(t), uly_tensor_numel(t), t->dtype, op);
        const char *why = be->take_error();
        if (rc || why) return start_failed(k, why);
    } else {
#ifdef ULY_WITH_MPI
        int fits = uly_tensor_numel(t) <= CHUNK && t->dtype != ULY_DTYPE_BF16;   /* bf16 sums through f32 */
        if (!fits || !(p = push_pending(c))) return -2;
        int rc = MPI_Iallreduce(MPI_IN_PLACE, uly_ptr(t), (int)uly_tensor_numel(t), mpi_type(t->dtype), mpi_op(op),
                                c->data, &p->req);
        if (rc != MPI_SUCCESS) { c->n_pending--; return mpi_failed(k, rc, "MPI_Iallreduce"); }
#else
        return -2;
#endif
    }
    p->k = *k;
    p->kind = ULY_COMM_ALL_REDUCE;
    p->t = t;
    uly_tensor_retain(t);
    p->op = op;
    p->device = on_device(t) ? dev : -1;
    return 0;
}

/* the data of the agreed reduce-scatter k moving in the background, if it can (else -2) */
static int reduce_scatter_background(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    uly_comm *c = k->c;
    pending_reduce *p = NULL;
    if (k->h.device != ULY_DEVICE_CPU) {
        const uly_backend *be = device_collectives(k, ULY_COMM_REDUCE_SCATTER);
        if (!be || !(p = push_pending(c))) return -2;   /* staged through the host: now */
        int rc = be->comm_reduce_scatter_start(c->dev_comm, uly_ptr(in), uly_ptr(out), k->h.a, in->dtype, op);
        const char *why = be->take_error();
        if (rc || why) return start_failed(k, why);
    } else {
#ifdef ULY_WITH_MPI
        if (in->dtype == ULY_DTYPE_BF16 || !(p = push_pending(c))) return -2;   /* bf16 sums through f32: now */
        int rc = MPI_Ireduce_scatter_block(uly_ptr(in), uly_ptr(out), (int)k->h.a, mpi_type(in->dtype), mpi_op(op),
                                           c->data, &p->req);
        if (rc != MPI_SUCCESS) { c->n_pending--; return mpi_failed(k, rc, "MPI_Ireduce_scatter_block"); }
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
    if (all_reduce_agree(&k, c, t, op)) return -1;
    if (c->size == 1) return call_end(&k, all_reduce_now(&k, t, op));
    double t0 = k.t0;
    int rc = all_reduce_background(&k, t, op);
    if (rc == -2) return call_end(&k, all_reduce_now(&k, t, op));   /* staged, or too big: now */
    if (rc == 0) S.seconds[ULY_COMM_ALL_REDUCE] += now() - t0;       /* counted as a call when it completes */
    return rc;
}

int uly_comm_reduce_scatter_start(uly_comm *c, const uly_tensor *in, uly_tensor *out, int op) {
    call k;
    if (reduce_scatter_agree(&k, c, in, out, op)) return -1;
    if (c->size == 1) return call_end(&k, reduce_scatter_now(&k, in, out, op));
    double t0 = k.t0;
    int rc = reduce_scatter_background(&k, in, out, op);
    if (rc == -2) return call_end(&k, reduce_scatter_now(&k, in, out, op));   /* staged, or bf16: now */
    if (rc == 0) S.seconds[ULY_COMM_REDUCE_SCATTER] += now() - t0;           /* counted when it completes */
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
    if (p->op == ULY_REDUCE_AVG && p->device < 0) divide_host(t, c->size);
    uly_bump_version(t);
    if (p->kind == ULY_COMM_REDUCE_SCATTER) count_stacked(c, ULY_COMM_REDUCE_SCATTER, uly_tensor_nbytes(t));
    else count_all_reduce(c, uly_tensor_nbytes(t));
    S.calls[p->kind]++;
    return 0;
}

int uly_comm_wait_all(uly_comm *c) {
    if (!c) return uly_set_error("wait_all: no group given");
    int rc = 0, joined = 0;   /* joined: 1 done, -1 failed (every device one fails then) */
    for (int i = 0; i < c->n_pending; i++) {
        pending_reduce *p = &c->pending[i];
        double t0 = now();
        int r = 0, leak = 0;
        if (p->device >= 0) {
            const uly_backend *be = uly_backends[p->device];
            if (!joined) { /* compute work queued from here on runs after every pending one */
                r = be->comm_join();
                const char *why = be->take_error();
                if (r || why) {
                    msgbuf m = {.n = 0};
                    put_call(&m, &p->k);
                    put(&m, ": the device collective failed: %s", why ? why : "no reason given");
                    r = uly_set_error("%s", m.s);
                }
                joined = r ? -1 : 1;
            } else if (joined < 0) r = -1;
        } else {
#ifdef ULY_WITH_MPI
            r = c->broken ? -1 : wait_one(&p->k, "reducing", &p->req);
            leak = r != 0;   /* MPI may still write into it */
#endif
        }
        if (!r) r = complete(c, p);
        S.seconds[p->kind] += now() - t0;
        if (r && !rc) rc = -1;
        if (!leak) { uly_tensor_release(p->t); uly_tensor_release(p->in); }
    }
    c->n_pending = 0;
    return rc;
}

/* does the group move this agreed collective's device buffers with the backend's own collectives?
 * (collective: every rank asks, with the same agreed device) */
static const uly_backend *device_collectives(call *k, int kind) {
    int dev = (int)k->h.device;
    if (k->c->size < 2 || dev < 0 || dev == ULY_DEVICE_CPU || device_comm(k->c, dev) != 1) return NULL;
    const uly_backend *be = uly_backends[dev];
    if (!be->comm_join) return NULL;
    return (kind == ULY_COMM_ALL_GATHER ? be->comm_all_gather_start != NULL : be->comm_reduce_scatter_start != NULL)
               ? be : NULL;
}

/* the agreed collective's data through host copies of device (or mixed) buffers */
static int staged(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    uly_tensor *hi = host_copy(in, 1), *ho = host_copy(out, 0);
    int rc = !hi || !ho ? uly_set_error("%s: out of host memory for staging", kind_names[k->kind]) : 0;
#ifdef ULY_WITH_MPI
    if (!rc && k->kind == ULY_COMM_ALL_GATHER) rc = all_gather_mpi(k, uly_ptr(hi), uly_ptr(ho), k->h.a, in->dtype);
    if (!rc && k->kind == ULY_COMM_REDUCE_SCATTER) rc = reduce_scatter_mpi(k, hi, ho, op);
#else
    (void)op;
#endif
    if (!rc && ho != out) rc = uly_copy_raw(out, ho);
    if (rc == 0 || !k->c->broken) { uly_tensor_release(hi); uly_tensor_release(ho); }
    return rc;
}

int uly_comm_all_gather(uly_comm *c, const uly_tensor *in, uly_tensor *out) {
    call k;
    int in_place;
    if (all_gather_agree(&k, c, in, out, &in_place)) return -1;
    int64_t n = k.h.a, es = uly_dtype_size(in->dtype);
    int rc = 0;
    const uly_backend *be;
    if (c->size == 1) rc = in_place ? 0 : uly_copy_raw(out, in);
    else if ((be = device_collectives(&k, ULY_COMM_ALL_GATHER))) {
        int r = be->comm_all_gather_start(c->dev_comm, uly_ptr(in), uly_ptr(out), n, in->dtype);
        if (be->comm_join()) r = -1;
        rc = device_done(&k, (int)k.h.device, r);
    } else if (k.h.device != ULY_DEVICE_CPU) rc = staged(&k, in, out, 0);
    else rc = all_gather_mpi(&k, in_place ? NULL : uly_ptr(in), uly_ptr(out), n, in->dtype);
    if (rc == 0) {
        uly_bump_version(out);
        count_stacked(c, ULY_COMM_ALL_GATHER, n * es);
    }
    return call_end(&k, rc);
}

/* the agreed reduce-scatter's data, moved now */
static int reduce_scatter_now(call *k, const uly_tensor *in, uly_tensor *out, int op) {
    uly_comm *c = k->c;
    int rc = 0;
    const uly_backend *be;
    if (c->size == 1) rc = uly_copy_raw(out, in);
    else if ((be = device_collectives(k, ULY_COMM_REDUCE_SCATTER))) {
        int r = be->comm_reduce_scatter_start(c->dev_comm, uly_ptr(in), uly_ptr(out), k->h.a, in->dtype, op);
        if (be->comm_join()) r = -1;
        rc = device_done(k, (int)k->h.device, r);
    } else if (k->h.device != ULY_DEVICE_CPU) rc = staged(k, in, out, op);
#ifdef ULY_WITH_MPI
    else rc = reduce_scatter_mpi(k, in, out, op);
#endif
    if (rc == 0) {
        uly_bump_version(out);
        count_stacked(c, ULY_COMM_REDUCE_SCATTER, uly_tensor_nbytes(out));
    }
    return rc;
}

int uly_comm_reduce_scatter(uly_comm *c, const uly_tensor *in, uly_tensor *out, int op) {
    call k;
    if (reduce_scatter_agree(&k, c, in, out, op)) return -1;
    return call_end(&k, reduce_scatter_now(&k, in, out, op));
}

int uly_comm_broadcast_(uly_comm *c, uly_tensor *t, int root) {
    if (!on_device(t)) return broadcast_host(c, t, root);
    uly_tensor *h = host_copy(t, 1);
    return finish(t, h, broadcast_host(c, h, root));
}
