/* core/comm.c — the process grid: MPI started (or not), every rank's sp agreed on, and the world,
 * sequence-parallel and data-parallel groups made from it, shutdown (an abort when a collective
 * timed out, since MPI cannot finish cleanly then), the deadline every wait uses
 * (uly_dist_set_timeout; else ULY_COMM_TIMEOUT; else 600 s), and the byte/time stats.
 *
 * Without MPI (the library built without it, or the process not launched by mpirun) the world
 * has one rank, MPI is never initialised, and every collective is a local copy or a no-op.
 *
 * The communication layer's other files: comm_call.c (the protocol every collective follows),
 * comm_exchange.c (all-to-all), comm_reduce.c (all-reduce, all-gather, reduce-scatter,
 * broadcast, barrier, check_same), comm_async.c (reductions that complete later) and
 * comm_device.c (device buffers).
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
#include "comm_internal.h"

comm_grid uly_grid = {.size = 1, .timeout = 600};

/* ---------------------------------------------------------------- stats */

void comm_count_bytes(int kind, int world_peer, int64_t sent, int64_t received) {
    if (!uly_grid.bytes || world_peer == uly_grid.rank || world_peer < 0 || world_peer >= uly_grid.size) return;
    int64_t *b = uly_grid.bytes + ((size_t)kind * uly_grid.size + world_peer) * 2;
    b[0] += received;
    b[1] += sent;
}

/* elements of block j when n elements are split into P nearly equal blocks */
int64_t comm_block(int64_t n, int P, int j) { return n * (j + 1) / P - n * j / P; }

int64_t uly_comm_bytes(int kind, int world_peer, int sent) {
    if (!uly_grid.bytes || kind < 0 || kind >= ULY_COMM_KINDS || world_peer < 0 || world_peer >= uly_grid.size) return 0;
    return uly_grid.bytes[((size_t)kind * uly_grid.size + world_peer) * 2 + (sent ? 1 : 0)];
}

double uly_comm_seconds(int kind) { return kind >= 0 && kind < ULY_COMM_KINDS ? uly_grid.seconds[kind] : 0; }
int64_t uly_comm_calls(int kind) { return kind >= 0 && kind < ULY_COMM_KINDS ? uly_grid.calls[kind] : 0; }

void uly_comm_reset_stats(void) {
    if (uly_grid.bytes) memset(uly_grid.bytes, 0, (size_t)ULY_COMM_KINDS * uly_grid.size * 2 * sizeof *uly_grid.bytes);
    memset(uly_grid.calls, 0, sizeof uly_grid.calls);
    memset(uly_grid.seconds, 0, sizeof uly_grid.seconds);
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
void comm_device_timeout(void) {
    const uly_backend *be = uly_backends[ULY_DEVICE_CUDA];
    if (be && be->comm_set_timeout) be->comm_set_timeout(uly_grid.timeout);
}

void uly_dist_set_timeout(double seconds) {
    uly_grid.timeout = seconds;
    uly_grid.timeout_explicit = 1;
    comm_device_timeout();
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
        uly_grid.mpi_ours = 1;
        atexit(at_exit);
    }
    MPI_Comm_size(MPI_COMM_WORLD, world);
    MPI_Comm_rank(MPI_COMM_WORLD, &uly_grid.rank);
    return 0;
}

static int init_stranded;   /* the grid agreement timed out: MPI cannot shut down cleanly */

/* every rank's sp before anything is split (no rank may build another grid): each rank judges the
 * same table, so a mismatch is the same error on every rank; waits as a collective does */
static int agree_on_grid(int sp_size, int world) {
    int *all = calloc((size_t)world, sizeof *all);
    if (!all) return uly_set_error("uly_dist_init: out of memory");
    MPI_Request req;
    if (MPI_Iallgather(&sp_size, 1, MPI_INT, all, 1, MPI_INT, MPI_COMM_WORLD, &req) != MPI_SUCCESS) {
        free(all);
        return uly_set_error("uly_dist_init: MPI_Iallgather failed");
    }
    double deadline = uly_grid.timeout > 0 ? comm_now() + uly_grid.timeout : 0;
    for (int done = 0; MPI_Test(&req, &done, MPI_STATUS_IGNORE), !done;) {
        if (deadline > 0 && comm_now() > deadline) {
            init_stranded = 1;   /* MPI may still write into `all`: leaked */
            return uly_set_error("uly_dist_init: timed out after %g s waiting for every rank to call dist.init (a rank "
                                 "failed or ended before it): end the job (uly.dist.abort)", uly_grid.timeout);
        }
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
    int same = 1;
    for (int r = 1; r < world; r++) same &= all[r] == all[0];
    msgbuf m = {.n = 0};
    if (!same) {
        comm_put(&m, "uly_dist_init: the ranks passed different sp (sequence-parallel group sizes):");
        for (int r = 0; r < world && r < 16; r++) comm_put(&m, "%s rank %d sp = %d", r ? "," : "", r, all[r]);
        comm_put(&m, "%s: every rank must call dist.init with the same sp", world > 16 ? ", ..." : "");
    }
    free(all);
    return same ? 0 : uly_set_error("%s", m.s);
}

static int mpi_group(uly_comm *g, const char *name, int color) {
    g->name = name;
    if (MPI_Comm_split(MPI_COMM_WORLD, color, uly_grid.rank, &g->data) != MPI_SUCCESS ||
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
    if (comm_device_aborted(g)) g->broken = 1;   /* a peer may be stuck: MPI cannot shut down cleanly */
    if (g->n_pending && !g->broken) uly_comm_wait_all(g);   /* MPI must not shut down under them */
    free(g->pending);
    if (g->dev_comm && uly_backends[ULY_DEVICE_CUDA] && uly_backends[ULY_DEVICE_CUDA]->comm_destroy)
        uly_backends[ULY_DEVICE_CUDA]->comm_destroy(g->dev_comm);
#ifdef ULY_WITH_MPI
    if (uly_grid.mpi && !g->broken && g->world_ranks) {
        MPI_Comm_free(&g->data);
        MPI_Comm_free(&g->ctrl);
    }
#endif
    free(g->world_ranks);
    memset(g, 0, sizeof *g);
}

int uly_dist_init(int sp_size) {
    if (uly_grid.initialized) {
        if (sp_size == uly_grid.sp) return 0;
        return uly_set_error("uly_dist_init: the grid is already set up with sp = %d; it cannot change to sp = %d in the "
                             "same process", uly_grid.sp, sp_size);
    }
    if (!uly_grid.timeout_explicit) uly_grid.timeout = env_timeout();
    int world = 0;
    uly_grid.rank = 0;
#ifdef ULY_WITH_MPI
    if (start_mpi(&world)) return -1;
    if (world > 1 && agree_on_grid(sp_size, world)) return -1;   /* before any check of sp: the same error everywhere */
#else
    if (launched_size() > 1)
        return uly_set_error("uly_dist_init: launched by mpirun with %d ranks, but libulysses was built without MPI: "
                             "install libopenmpi-dev and rebuild (scripts/setup.sh)", launched_size());
#endif
    uly_grid.mpi = world > 0;
    if (!uly_grid.mpi) world = 1;
    if (sp_size < 1) return uly_set_error("uly_dist_init: sp = %d: the sequence-parallel group size must be at least 1", sp_size);
    if (world % sp_size) {
        if (!uly_grid.mpi)
            return uly_set_error("uly_dist_init: sp = %d needs %d ranks, but this process is a world of 1 rank (not "
                                 "launched by mpirun): run it with mpirun -np %d, or use sp = 1", sp_size, sp_size, sp_size);
        return uly_set_error("uly_dist_init: %d ranks cannot be split into sequence-parallel groups of %d: the world "
                             "size must be a multiple of sp", world, sp_size);
    }
    uly_grid.size = world;
    uly_grid.sp = sp_size;
    uly_grid.bytes = calloc((size_t)ULY_COMM_KINDS * world * 2, sizeof *uly_grid.bytes);
    if (!uly_grid.bytes) return uly_set_error("uly_dist_init: out of memory");
    int rc;
#ifdef ULY_WITH_MPI
    if (uly_grid.mpi)
        rc = mpi_group(&uly_grid.world, "world", 0) || mpi_group(&uly_grid.sp_group, "sp", uly_grid.rank / sp_size) ||
             mpi_group(&uly_grid.dp_group, "dp", uly_grid.rank % sp_size);
    else
#endif
        rc = single_group(&uly_grid.world, "world") || single_group(&uly_grid.sp_group, "sp") || single_group(&uly_grid.dp_group, "dp");
    if (rc) {
        free_group(&uly_grid.world); free_group(&uly_grid.sp_group); free_group(&uly_grid.dp_group);
        free(uly_grid.bytes); uly_grid.bytes = NULL;
        return -1;
    }
    uly_comm_reset_stats();
    uly_grid.initialized = 1;
    return 0;
}

int uly_dist_initialized(void) { return uly_grid.initialized; }

/* the ranks' last agreement on the world group: a rank still waiting in a world collective (its
 * peer skipped it and ended) gets this header instead of the one it waits for, so both fail at
 * once, naming the collective, instead of after the timeout; a rank that is merely slower (rank 0
 * still writing its results) is waited for as long as it takes, as MPI_Finalize would */
static void agree_to_finish(void) {
    call k;
    if (uly_grid.world.size < 2 || comm_call_begin(&k, &uly_grid.world, KIND_FINALIZE)) return;
    k.deadline = 0;
    if (comm_agree(&k)) uly_dist_abort(uly_last_error());
}

int uly_dist_finalize(void) {
    int broken = 0;
    const uly_comm *groups[3] = {&uly_grid.world, &uly_grid.sp_group, &uly_grid.dp_group};
    for (int i = 0; i < 3; i++) broken |= groups[i]->broken || comm_device_aborted(groups[i]);
#ifdef ULY_WITH_MPI
    broken |= init_stranded;
#endif
    if (uly_grid.initialized && uly_grid.mpi && !broken) agree_to_finish();
    if (uly_grid.initialized) {
        free_group(&uly_grid.world);
        free_group(&uly_grid.sp_group);
        free_group(&uly_grid.dp_group);
        free(uly_grid.bytes);
        uly_grid.bytes = NULL;
        uly_grid.initialized = 0;
        uly_grid.sp = 0;
    }
#ifdef ULY_WITH_MPI
    int inited = 0, finished = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finished);
    if (uly_grid.mpi_ours && inited && !finished) {
        if (broken) uly_dist_abort("a collective timed out or failed on the device earlier, so MPI cannot shut down "
                                   "cleanly: ending the job");
        MPI_Finalize();
        uly_grid.mpi_done = 1;
    }
#endif
    (void)broken;
    return 0;
}

int uly_dist_abort(const char *message) {
    int rank = uly_grid.initialized ? uly_grid.rank : env_rank();
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

uly_comm *uly_dist_world(void) { return uly_grid.initialized ? &uly_grid.world : uly_set_error_null("uly_dist_world: call uly_dist_init first"); }
uly_comm *uly_dist_sp_group(void) { return uly_grid.initialized ? &uly_grid.sp_group : uly_set_error_null("uly_dist_sp_group: call uly_dist_init first"); }
uly_comm *uly_dist_dp_group(void) { return uly_grid.initialized ? &uly_grid.dp_group : uly_set_error_null("uly_dist_dp_group: call uly_dist_init first"); }

int uly_comm_rank(const uly_comm *c) { return c ? c->rank : -1; }
int uly_comm_size(const uly_comm *c) { return c ? c->size : -1; }
int uly_comm_device_path(const uly_comm *c) { return c ? c->dev_state : 0; }
int uly_comm_world_rank_of(const uly_comm *c, int rank) {
    return c && rank >= 0 && rank < c->size ? c->world_ranks[rank] : -1;
}
const char *uly_comm_name(const uly_comm *c) { return c ? c->name : ""; }
