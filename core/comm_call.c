/* core/comm_call.c — the protocol of one collective on a group of P ranks:
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
 * and the caller is expected to end the job with uly_dist_abort. */
#define _GNU_SOURCE
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "comm_internal.h"

const char *const comm_kind_names[KIND_NAMES] = {
    "all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "check_same",
    "finalize (its program has ended)"};
const char *const comm_op_names[3] = {"sum", "avg", "max"};

double comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- messages */

void comm_put(msgbuf *m, const char *fmt, ...) {
    if (m->n >= sizeof m->s - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(m->s + m->n, sizeof m->s - m->n, fmt, ap);
    va_end(ap);
    if (k > 0) m->n += (size_t)k;
    if (m->n > sizeof m->s - 1) m->n = sizeof m->s - 1;
}

/* "rank 1", or "rank 1 (world 3)" in a group whose ranks are not the world's */
void comm_put_rank(msgbuf *m, const uly_comm *c, int r) {
    comm_put(m, "rank %d", r);
    if (c->world_ranks[r] != r || c->size != uly_grid.size) comm_put(m, " (world %d)", c->world_ranks[r]);
}

void comm_bad(call *k, const char *fmt, ...) {
    if (k->h.bad) return;  /* keep the first problem */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->h.note, sizeof k->h.note, fmt, ap);
    va_end(ap);
    k->h.bad = 1;
}

int comm_call_begin(call *k, uly_comm *c, int kind) {
    memset(k, 0, sizeof *k);
    if (!c) return uly_set_error("%s: no group given (call uly_dist_init first, then use its world, sp or dp group)",
                                 comm_kind_names[kind]);
    if (!uly_grid.initialized) return uly_set_error("%s: the process grid is not initialised (uly_dist_init)", comm_kind_names[kind]);
    if (comm_device_aborted(c)) c->broken = 1;
    if (c->broken)
        return uly_set_error("%s on group %s: an earlier collective on this group timed out or its device "
                             "communicator was aborted, so its ranks are out of step for good; end the job "
                             "(uly.dist.abort)", comm_kind_names[kind], c->name);
    k->c = c;
    k->kind = kind;
    k->seq = c->calls++;
    k->t0 = comm_now();
    k->deadline = uly_grid.timeout > 0 ? k->t0 + uly_grid.timeout : 0;
    k->h.kind = kind;
    k->h.seq = (int64_t)k->seq;
    k->h.dtype = -1;
    return 0;
}

int comm_call_end(call *k, int rc) {
    if (rc == 0 && k->kind < ULY_COMM_KINDS) {
        uly_grid.calls[k->kind]++;
        uly_grid.seconds[k->kind] += comm_now() - k->t0;
    }
    return rc;
}

/* the prefix of every message about this call: "all_reduce on group sp (call 5)" */
void comm_put_call(msgbuf *m, const call *k) {
    comm_put(m, "%s on group %s", comm_kind_names[k->kind], k->c->name);
    if (k->c->size > 1) comm_put(m, " (call %llu)", (unsigned long long)k->seq + 1);
}

/* local checks on a tensor argument; records the first problem in the header */
void comm_check_tensor_arg(call *k, const char *what, const uly_tensor *t) {
    if (!t) { comm_bad(k, "no %stensor given", what); return; }
    if (t->storage->device != ULY_DEVICE_CPU)
        comm_bad(k, "the %stensor %s is on the GPU: collectives here take CPU tensors (move it to the CPU)", what,
            uly_desc(t));
    else if (!uly_tensor_is_contiguous(t))
        comm_bad(k, "the %stensor %s is not contiguous: pass a contiguous tensor (t:contiguous())", what, uly_desc(t));
}

static int is_float_dtype(int64_t dtype) {
    return dtype == ULY_DTYPE_F32 || dtype == ULY_DTYPE_BF16 || dtype == ULY_DTYPE_F64;
}

void comm_check_op(call *k, int op, int dtype) {
    if (op < ULY_REDUCE_SUM || op > ULY_REDUCE_MAX) comm_bad(k, "unknown reduction %d (sum = 0, avg = 1, max = 2)", op);
    else if (op == ULY_REDUCE_AVG && !is_float_dtype(dtype))
        comm_bad(k, "avg of an integer (%s) tensor: use sum and divide", uly_dtype_name(dtype));
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
        comm_put(m, "%s", comm_op_names[v]);
    else comm_put(m, "%lld", (long long)v);
}

/* every rank in the same collective at the same call? */
static int judge_step(const call *k, const header *h, msgbuf *m) {
    int P = k->c->size, same = 1;
    for (int r = 1; r < P; r++) same &= h[r].kind == h[0].kind && h[r].seq == h[0].seq;
    if (same) return 0;
    comm_put(m, "collectives out of step on group %s: ", k->c->name);
    for (int r = 0; r < P; r++) {
        comm_put(m, r ? ", " : "");
        comm_put_rank(m, k->c, r);
        int64_t kd = h[r].kind;
        comm_put(m, " is in %s (call %lld)", kd >= 0 && kd < KIND_NAMES ? comm_kind_names[kd] : "?", (long long)h[r].seq + 1);
    }
    comm_put(m, ": every rank of a group must call the same collectives in the same order");
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
    comm_put_call(m, k);
    if (P == 1) { comm_put(m, ": %s", h[0].note); return -1; }
    if (nbad == P && same_note) { comm_put(m, ": invalid arguments on every rank: %s", h[0].note); return -1; }
    comm_put(m, ": invalid arguments");
    for (int r = 0, i = 0; r < P; r++)
        if (h[r].bad) { comm_put(m, i++ ? "; on " : " on "); comm_put_rank(m, k->c, r); comm_put(m, ": %s", h[r].note); }
    return -1;
}

static int judge_values(const call *k, const header *h, msgbuf *m) {
    int P = k->c->size;
    int same = 1;
    for (int r = 1; r < P; r++) same &= h[r].device == h[0].device;
    if (!same) {
        comm_put_call(m, k);
        comm_put(m, ": the tensors are on different devices: ");
        for (int r = 0; r < P; r++) {
            comm_put(m, r ? ", " : "");
            comm_put_rank(m, k->c, r);
            comm_put(m, " has %s", uly_device_name((int)h[r].device));
        }
        comm_put(m, "; move them to one device on every rank");
        return -1;
    }
    for (int r = 1; r < P; r++) same &= h[r].dtype == h[0].dtype;
    if (!same) {
        comm_put_call(m, k);
        comm_put(m, ": the dtype differs between ranks: ");
        for (int r = 0; r < P; r++) {
            comm_put(m, r ? ", " : "");
            comm_put_rank(m, k->c, r);
            comm_put(m, " has %s", uly_dtype_name((int)h[r].dtype));
        }
        return -1;
    }
    for (int f = 0; f < 2; f++) {
        const char *label = field_label(k->kind, f);
        if (!label) continue;
        same = 1;
        for (int r = 1; r < P; r++) same &= (f ? h[r].b : h[r].a) == (f ? h[0].b : h[0].a);
        if (same) continue;
        comm_put_call(m, k);
        comm_put(m, ": the %s differs between ranks: ", label);
        for (int r = 0; r < P; r++) {
            comm_put(m, r ? ", " : "");
            comm_put_rank(m, k->c, r);
            comm_put(m, " has ");
            put_field(m, k->kind, f, f ? h[r].b : h[r].a);
        }
        comm_put(m, ": every rank must pass the same %s", f == 0 ? "shape" : label);
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

/* between polls of a wait: yield for the first 64, then sleep, 2 us longer each time up to 1 ms
 * (a rank waiting on a late peer leaves the core to others) */
static void relax(int spins) {
    if (spins < 64) { sched_yield(); return; }
    long ns = 2000L * (spins - 63);
    struct timespec ts = {0, ns < 1000000L ? ns : 1000000L};
    nanosleep(&ts, NULL);
}

int comm_mpi_failed(const call *k, int rc, const char *what) {
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, text, &len);
    msgbuf m = {.n = 0};
    comm_put_call(&m, k);
    comm_put(&m, ": %s failed: %s", what, text);
    return uly_set_error("%s", m.s);
}

static int timed_out(call *k, const char *stage, const MPI_Request *req, const int *peer, int n) {
    k->c->broken = 1;
    msgbuf m = {.n = 0};
    comm_put(&m, "timed out after %g s in ", uly_grid.timeout);
    comm_put_call(&m, k);
    int missing = 0;
    for (int i = 0; i < n; i++)
        if (req[i] != MPI_REQUEST_NULL && peer[i] >= 0) {
            comm_put(&m, missing++ ? ", " : " waiting for ");
            comm_put_rank(&m, k->c, peer[i]);
        }
    if (missing)
        comm_put(&m, " (%s): a rank skipped a collective, died or is much slower", stage);
    else
        comm_put(&m, " while %s, after every rank had arrived: a rank died or is much slower", stage);
    comm_put(&m, "; the group cannot be used again: end the job (uly.dist.abort)");
    return uly_set_error("%s", m.s);
}

/* poll until every request completes or the deadline passes; peer[i] >= 0 names the group
 * rank a receive waits for (a timeout lists the ones still missing). busy: every peer is known to
 * be in this collective (its header arrived), so the data is moving and moves only while MPI is
 * polled (a large message goes fragment by fragment, one batch a poll: polling every 1 ms moved an
 * all-to-all at 0.17 GB/s): poll without sleeping for the first BUSY_SPIN_S seconds */
#define BUSY_SPIN_S 1.0
static int wait_requests(call *k, const char *stage, MPI_Request *req, const int *peer, int n, int busy) {
    const double busy_until = busy ? comm_now() + BUSY_SPIN_S : 0.0;
    for (int spins = 0;; spins++) {
        int pending = 0;
        for (int i = 0; i < n; i++) {
            if (req[i] == MPI_REQUEST_NULL) continue;
            int done = 0, rc = MPI_Test(&req[i], &done, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) return comm_mpi_failed(k, rc, stage);
            pending += !done;
        }
        if (!pending) return 0;
        if (k->deadline > 0 && comm_now() > k->deadline) return timed_out(k, stage, req, peer, n);
        if (busy && spins >= 64 && comm_now() < busy_until) sched_yield();
        else relax(spins);
    }
}

/* the wait of a collective's data phase, after every rank's header arrived */
int comm_wait_one(call *k, const char *stage, MPI_Request *req) {
    int nobody = -1;
    return wait_requests(k, stage, req, &nobody, 1, 1);
}

/* rows of `nbytes` in `all`, this rank's row filled in; afterwards every row is. On a timeout
 * MPI may still write into `all`: the caller must then leak it. */
static int exchange(call *k, const char *stage, int tag, char *all, int nbytes) {
    uly_comm *c = k->c;
    int P = c->size, n = 0, rc = MPI_SUCCESS;
    MPI_Request *req = malloc(2 * (size_t)P * sizeof *req);
    int *peer = malloc(2 * (size_t)P * sizeof *peer);
    if (!req || !peer) { free(req); free(peer); return uly_set_error("%s: out of memory", comm_kind_names[k->kind]); }
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
    int out = rc != MPI_SUCCESS ? (c->broken = 1, comm_mpi_failed(k, rc, stage)) : wait_requests(k, stage, req, peer, n, 0);
    free(req);
    free(peer);
    return out;
}
#endif

/* phase 1: every rank's header; 0 when they agree */
int comm_agree(call *k) {
    if (k->c->size == 1) return judge(k, &k->h);
#ifdef ULY_WITH_MPI
    int P = k->c->size;
    header *all = calloc((size_t)P, sizeof *all);
    if (!all) return uly_set_error("%s: out of memory", comm_kind_names[k->kind]);
    all[k->c->rank] = k->h;
    if (exchange(k, "exchanging headers", 1, (char *)all, (int)sizeof *all)) return -1;  /* `all` leaked */
    int rc = judge(k, all);
    free(all);
    return rc;
#else
    return uly_set_error("%s: a group of %d ranks in a library built without MPI", comm_kind_names[k->kind], k->c->size);
#endif
}

/* phase 2: every rank's row of n int64 values into a new [P][n] table (NULL on error) */
int64_t *comm_gather_rows(call *k, const int64_t *mine, int n) {
    int P = k->c->size;
    int64_t *all = calloc((size_t)P * (size_t)(n > 0 ? n : 1), sizeof *all);
    if (!all) return uly_set_error_null("%s: out of memory", comm_kind_names[k->kind]);
    if (n > 0) memcpy(all + (size_t)k->c->rank * n, mine, (size_t)n * sizeof *all);
#ifdef ULY_WITH_MPI
    if (P > 1 && n > 0 && exchange(k, "exchanging sizes", 2, (char *)all, n * (int)sizeof *all)) return NULL;
#endif
    return all;
}

/* ---------------------------------------------------------------- MPI data movement */
#ifdef ULY_WITH_MPI
MPI_Datatype comm_mpi_type(int dtype) {
    switch (dtype) {
    case ULY_DTYPE_F32: return MPI_FLOAT;
    case ULY_DTYPE_BF16: return MPI_UINT16_T;  /* moved as bits; reductions go through f32 */
    case ULY_DTYPE_I32: return MPI_INT32_T;
    case ULY_DTYPE_I64: return MPI_INT64_T;
    default: return MPI_DOUBLE;
    }
}

MPI_Op comm_mpi_op(int op) { return op == ULY_REDUCE_MAX ? MPI_MAX : MPI_SUM; }


int comm_reduce_mpi(call *k, void *data, int64_t numel, int dtype, int op) {
    int64_t es = uly_dtype_size(dtype);
    for (int64_t off = 0; off < numel; off += CHUNK) {
        int cnt = (int)(numel - off < CHUNK ? numel - off : CHUNK);
        MPI_Request req;
        int rc = MPI_Iallreduce(MPI_IN_PLACE, (char *)data + off * es, cnt, comm_mpi_type(dtype), comm_mpi_op(op), k->c->data, &req);
        if (rc != MPI_SUCCESS) return comm_mpi_failed(k, rc, "MPI_Iallreduce");
        if (comm_wait_one(k, "reducing", &req)) return -1;
    }
    return 0;
}
#endif

/* ---------------------------------------------------------------- collectives */

int comm_valid_dtype(int dtype) { return dtype >= ULY_DTYPE_F32 && dtype <= ULY_DTYPE_F64; }

/* phases 1 and 2 of an all-to-all: headers agree, then rank i's send_counts[j] must equal rank
 * j's recv_counts[i] for every pair (the same message on every rank otherwise) */
int comm_agree_counts(call *k, const int64_t *send_counts, const int64_t *recv_counts, int check_ints) {
    uly_comm *c = k->c;
    int P = c->size;
    int64_t *row = calloc(2 * (size_t)P, sizeof *row);
    if (!row) return uly_set_error("all_to_all: out of memory");
    for (int j = 0; j < P && !k->h.bad; j++) {
        int64_t v[2] = {send_counts[j], recv_counts[j]};
        for (int q = 0; q < 2; q++) {
            if (v[q] < 0) comm_bad(k, "negative count %lld for rank %d", (long long)v[q], j);
            else if (check_ints && v[q] > INT_MAX)
                comm_bad(k, "count %lld for rank %d is too large for one MPI call (at most %d elements): split the exchange",
                    (long long)v[q], j, INT_MAX);
        }
        row[j] = send_counts[j];
        row[P + j] = recv_counts[j];
    }
    k->h.a = P;
    if (comm_agree(k)) { free(row); return -1; }
    int64_t *tab = comm_gather_rows(k, row, 2 * P);
    free(row);
    if (!tab) return -1;
    msgbuf m = {.n = 0};
    int mismatches = 0;
    for (int i = 0; i < P; i++)
        for (int j = 0; j < P; j++) {
            int64_t s = tab[(size_t)i * 2 * P + j], r = tab[(size_t)j * 2 * P + P + i];
            if (s == r) continue;
            if (!mismatches) comm_put_call(&m, k), comm_put(&m, ": ");
            if (mismatches++ < 6) {
                comm_put(&m, mismatches > 1 ? "; " : "");
                comm_put_rank(&m, c, i);
                comm_put(&m, " sends %lld elements to ", (long long)s);
                comm_put_rank(&m, c, j);
                comm_put(&m, " but rank %d expects %lld", j, (long long)r);
            }
        }
    free(tab);
    if (mismatches) {
        if (mismatches > 6) comm_put(&m, "; ... (%d mismatches in all)", mismatches);
        comm_put(&m, ": rank i's send_counts[j] must equal rank j's recv_counts[i]");
        return uly_set_error("%s", m.s);
    }
    return 0;
}
