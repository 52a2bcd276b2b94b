/* kernels/cuda/comm.cu — the CUDA backend's side of communication: gathering a layout's elements
 * into a contiguous buffer and scattering them back (the packed form of the Ulysses exchanges),
 * the device's UUID (so ranks sharing one GPU are detected), and NCCL communicators and
 * collectives (all-reduce, all-gather, reduce-scatter; all-to-all-v as grouped send/recv) on a communication stream of their
 * own, ordered after the compute work that makes their inputs and before the compute work queued
 * after them; cu_comm_all_reduce_start leaves the second ordering to cu_comm_join, so gradient
 * buckets reduce while backward computes. NCCL is
 * opened with dlopen on first use, so libulysses_cuda.so loads without it; without NCCL the
 * core stages device buffers through host memory over MPI instead. The emulator build links its
 * own NCCL over MPI (emu/nccl_emu.cpp) in place of libnccl.
 *
 * The NCCL watchdog: a GPU waiting for a peer that died or stalled waits forever, and so would the
 * host in cudaStreamSynchronize. While NCCL work is in flight every host wait on the stream
 * (uly_cu_stream_wait) polls instead: a communicator's asynchronous error (a peer's death as NCCL
 * sees it), or the wait outlasting the timeout (ULY_COMM_TIMEOUT, uly.dist.set_timeout: the
 * core's, handed over by cu_comm_set_timeout), aborts every communicator, so the stuck kernels
 * end, and fails the wait with what was in flight; the core then treats those groups as broken. */
#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "common.cuh"

/* ---- layouts ---- */
typedef struct { int64_t base, count, stride, per; int nruns; int64_t offset[3], length[3]; } lay;

static lay lay_of(const uly_comm_layout *L) {
    lay l;
    l.base = L->base; l.count = L->count; l.stride = L->stride; l.nruns = L->nruns; l.per = 0;
    for (int r = 0; r < 3; r++) {
        l.offset[r] = r < L->nruns ? L->offset[r] : 0;
        l.length[r] = r < L->nruns ? L->length[r] : 0;
        l.per += l.length[r];
    }
    return l;
}

/* element e of the layout (in walk order) -> its offset in the strided buffer */
__device__ static inline int64_t lay_offset(const lay &l, int64_t e) {
    int64_t rep = e / l.per, w = e % l.per;
    int r = 0;
    while (r < 2 && w >= l.length[r]) { w -= l.length[r]; r++; }
    return l.base + rep * l.stride + l.offset[r] + w;
}

template <typename T>
__global__ static void pack_k(T *dst, const T *src, lay l, int64_t n) { ULY_CU_FOR(e, n) dst[e] = src[lay_offset(l, e)]; }
template <typename T>
__global__ static void unpack_k(T *dst, const T *src, lay l, int64_t n) { ULY_CU_FOR(e, n) dst[lay_offset(l, e)] = src[e]; }

template <typename T>
static void launch_layout(void *dst, const void *src, const uly_comm_layout *L, int gather) {
    lay l = lay_of(L);
    int64_t n = l.per * l.count;
    if (n <= 0) return;
    if (gather) ULY_LAUNCH(pack_k<T>, uly_cu_blocks(n, 256), 256, uly_cu_stream)((T *)dst, (const T *)src, l, n);
    else ULY_LAUNCH(unpack_k<T>, uly_cu_blocks(n, 256), 256, uly_cu_stream)((T *)dst, (const T *)src, l, n);
    ULY_CU_LAUNCHED(gather ? "pack_layout" : "unpack_layout");
}

static void layout(void *dst, const void *src, const uly_comm_layout *L, int64_t es, int gather) {
    if (es == 4) launch_layout<uint32_t>(dst, src, L, gather);
    else if (es == 8) launch_layout<uint64_t>(dst, src, L, gather);
    else if (es == 2) launch_layout<uint16_t>(dst, src, L, gather);
    else launch_layout<uint8_t>(dst, src, L, gather);
}

extern "C" void cu_pack_layout(void *dst, const void *src, const uly_comm_layout *L, int64_t es) { layout(dst, src, L, es, 1); }
extern "C" void cu_unpack_layout(void *dst, const uly_comm_layout *L, const void *src, int64_t es) { layout(dst, src, L, es, 0); }

extern "C" int cu_device_uuid(unsigned char *uuid16) {
    int dev = 0;
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) { uly_cu_fail("device uuid", e); return -1; }
    memcpy(uuid16, prop.uuid.bytes, 16);
    return 0;
}

/* ---- the communication stream: NCCL work runs there, beside the compute stream ---- */
static cudaStream_t comm_stream;
static cudaEvent_t computed, communicated, comm_tail;   /* comm_tail: after the last NCCL work queued */
static int comm_queued;                                 /* any NCCL work queued since the stream was made */
static char last_queued[160];                           /* the last collective queued, for the watchdog */

static int comm_stream_ready(void) {
    if (comm_stream) return 0;
    cudaError_t e = cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&computed, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&communicated, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&comm_tail, cudaEventDisableTiming);
    if (e != cudaSuccess) { uly_cu_fail("creating the communication stream", e); comm_stream = NULL; return -1; }
    return 0;
}

/* the communication queued next starts once the compute work queued so far (its inputs) is done */
static int after_compute(void) {
    if (comm_stream_ready()) return -1;
    cudaError_t e = cudaEventRecord(computed, uly_cu_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(comm_stream, computed, 0);
    if (e != cudaSuccess) { uly_cu_fail("ordering communication after compute", e); return -1; }
    return 0;
}

/* compute work queued from now on starts once the communication queued so far is done: its
 * outputs are ready, and the buffers it reads may be reused */
extern "C" int cu_comm_join(void) {
    if (!comm_stream) return 0;
    cudaError_t e = cudaEventRecord(communicated, comm_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(uly_cu_stream, communicated, 0);
    if (e != cudaSuccess) { uly_cu_fail("ordering compute after communication", e); return -1; }
    return 0;
}

#if defined(ULY_CUDA_EMU) ? defined(ULY_EMU_NCCL) : __has_include(<nccl.h>)
#include <nccl.h>
/* ---- NCCL, opened on first use ---- */
static struct {
    int tried, ok;
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*init_rank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*destroy)(ncclComm_t);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    const char *(*error_string)(ncclResult_t);
    ncclResult_t (*all_gather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*reduce_scatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*abort)(ncclComm_t);
    ncclResult_t (*async_error)(ncclComm_t, ncclResult_t *);
} N;

static int nccl_open(void) {
    if (N.tried) return N.ok;
    N.tried = 1;
#ifdef ULY_CUDA_EMU
    /* the emulator's NCCL over MPI (kernels/cuda/emu/nccl_emu.cpp) is part of this library */
#define SYM(field, name) N.field = name;
#else
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_GLOBAL);
    if (!h) { uly_cu_fail_msg("NCCL", "libnccl.so.2 not found (device buffers will stage through host memory)"); return 0; }
#define SYM(field, name) \
    N.field = (decltype(N.field))dlsym(h, #name); \
    if (!N.field) { uly_cu_fail_msg("NCCL", "missing " #name); return 0; }
#endif
    SYM(get_unique_id, ncclGetUniqueId)
    SYM(init_rank, ncclCommInitRank)
    SYM(destroy, ncclCommDestroy)
    SYM(all_reduce, ncclAllReduce)
    SYM(send, ncclSend)
    SYM(recv, ncclRecv)
    SYM(group_start, ncclGroupStart)
    SYM(group_end, ncclGroupEnd)
    SYM(error_string, ncclGetErrorString)
    SYM(all_gather, ncclAllGather)
    SYM(reduce_scatter, ncclReduceScatter)
    SYM(abort, ncclCommAbort)
    SYM(async_error, ncclCommGetAsyncError)
#undef SYM
    N.ok = 1;
    return 1;
}

/* a group's communicator as the core holds it: aborted by the watchdog, it is never used again */
typedef struct { ncclComm_t nccl; int nranks, aborted; } cu_comm;
static cu_comm *live[64];   /* every communicator made and not destroyed */

static int nccl_check(const char *what, ncclResult_t r) {
    if (r == ncclSuccess) return 0;
    uly_cu_fail_msg(what, N.error_string ? N.error_string(r) : "NCCL error");
    return -1;
}

static int nccl_type(int dtype, ncclDataType_t *t) {
    switch (dtype) {
    case ULY_DTYPE_F32: *t = ncclFloat32; return 0;
    case ULY_DTYPE_BF16: *t = ncclBfloat16; return 0;
    case ULY_DTYPE_I32: *t = ncclInt32; return 0;
    case ULY_DTYPE_I64: *t = ncclInt64; return 0;
    case ULY_DTYPE_F64: *t = ncclFloat64; return 0;
    default: uly_cu_fail_msg("NCCL", "unknown dtype"); return -1;
    }
}

extern "C" int cu_comm_unique_id(void *id, int64_t len) {
    if (len < (int64_t)sizeof(ncclUniqueId) || !nccl_open()) return -1;
    ncclUniqueId u;
    if (nccl_check("ncclGetUniqueId", N.get_unique_id(&u))) return -1;
    memcpy(id, &u, sizeof u);
    return 0;
}

extern "C" void *cu_comm_create(int nranks, int rank, const void *id) {
    if (!nccl_open()) return NULL;
    int slot = 0;
    while (slot < 64 && live[slot]) slot++;
    if (slot == 64) { uly_cu_fail_msg("NCCL", "more than 64 communicators"); return NULL; }
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t comm = NULL;
    if (nccl_check("ncclCommInitRank", N.init_rank(&comm, nranks, u, rank))) return NULL;
    cu_comm *c = (cu_comm *)calloc(1, sizeof *c);
    if (!c) { N.destroy(comm); uly_cu_fail_msg("NCCL", "out of host memory"); return NULL; }
    c->nccl = comm;
    c->nranks = nranks;
    live[slot] = c;
    return c;
}

extern "C" void cu_comm_destroy(void *comm) {
    cu_comm *c = (cu_comm *)comm;
    if (!c) return;
    for (int i = 0; i < 64; i++)
        if (live[i] == c) live[i] = NULL;
    if (!c->aborted && N.ok) N.destroy(c->nccl);   /* an aborted one is already gone */
    free(c);
}

extern "C" int cu_comm_aborted(void *comm) { return comm && ((cu_comm *)comm)->aborted; }

/* the communicator for a collective about to be queued (NULL, with the failure kept, if unusable);
 * the collective is described for the watchdog's message */
static ncclComm_t usable(void *comm, const char *kind, int64_t count, int dtype) {
    cu_comm *c = (cu_comm *)comm;
    if (!N.ok || !c) { uly_cu_fail_msg(kind, "no NCCL communicator"); return NULL; }
    if (c->aborted) {
        uly_cu_fail_msg(kind, "the NCCL communicator was aborted by the watchdog after an earlier failure: end the job");
        return NULL;
    }
    static const char *const names[] = {"f32", "bf16", "i32", "i64", "f64"};   /* ULY_DTYPE_* order */
    const char *tn = dtype >= 0 && dtype < 5 ? names[dtype] : "?";
    snprintf(last_queued, sizeof last_queued, "%s of %lld %s elements over %d ranks", kind, (long long)count, tn, c->nranks);
    return c->nccl;
}

/* after NCCL work is queued on the communication stream: mark where it ends (comm_in_flight) */
static int queued(int rc) {
    comm_queued = 1;
    cudaError_t e = cudaEventRecord(comm_tail, comm_stream);
    if (e != cudaSuccess) { uly_cu_fail("marking the end of the communication", e); return -1; }
    return rc;
}

extern "C" int cu_comm_all_reduce_start(void *comm, void *buf, int64_t count, int dtype, int op) {
    ncclDataType_t t;
    ncclComm_t nc = usable(comm, "all-reduce", count, dtype);
    if (!nc || nccl_type(dtype, &t) || after_compute()) return -1;
    ncclRedOp_t o = op == ULY_REDUCE_AVG ? ncclAvg : op == ULY_REDUCE_MAX ? ncclMax : ncclSum;
    return queued(nccl_check("ncclAllReduce", N.all_reduce(buf, buf, (size_t)count, t, o, nc, comm_stream)));
}

extern "C" int cu_comm_all_reduce(void *comm, void *buf, int64_t count, int dtype, int op) {
    int rc = cu_comm_all_reduce_start(comm, buf, count, dtype, op);
    return cu_comm_join() || rc ? -1 : 0;
}

/* ZeRO's collectives: NCCL takes send == recv + rank * count as an in-place all-gather */
extern "C" int cu_comm_all_gather_start(void *comm, const void *send, void *recv, int64_t count, int dtype) {
    ncclDataType_t t;
    ncclComm_t nc = usable(comm, "all-gather", count, dtype);
    if (!nc || nccl_type(dtype, &t) || after_compute()) return -1;
    return queued(nccl_check("ncclAllGather", N.all_gather(send, recv, (size_t)count, t, nc, comm_stream)));
}

extern "C" int cu_comm_reduce_scatter_start(void *comm, const void *send, void *recv, int64_t count, int dtype, int op) {
    ncclDataType_t t;
    ncclComm_t nc = usable(comm, "reduce-scatter", count, dtype);
    if (!nc || nccl_type(dtype, &t) || after_compute()) return -1;
    ncclRedOp_t o = op == ULY_REDUCE_AVG ? ncclAvg : op == ULY_REDUCE_MAX ? ncclMax : ncclSum;
    return queued(nccl_check("ncclReduceScatter", N.reduce_scatter(send, recv, (size_t)count, t, o, nc, comm_stream)));
}

/* the Ulysses exchange: one grouped send/recv per peer, on the communication stream, then the
 * compute stream (which unpacks the result) waits for it */
extern "C" int cu_comm_all_to_all_v(void *comm, const void *send, const int64_t *scounts, const int64_t *sdispls, void *recv,
                                    const int64_t *rcounts, const int64_t *rdispls, int dtype) {
    ncclDataType_t t;
    const int nranks = comm ? ((cu_comm *)comm)->nranks : 0;   /* the peers are the communicator's ranks 0..P-1 */
    int64_t total = 0;
    for (int j = 0; j < nranks; j++) total += scounts[j];
    ncclComm_t nc = usable(comm, "all-to-all", total, dtype);
    if (!nc || nccl_type(dtype, &t) || after_compute()) return -1;
    size_t es = dtype == ULY_DTYPE_BF16 ? 2 : (dtype == ULY_DTYPE_F32 || dtype == ULY_DTYPE_I32) ? 4 : 8;
    int rc = nccl_check("ncclGroupStart", N.group_start());
    for (int j = 0; !rc && j < nranks; j++) {
        if (scounts[j]) rc = nccl_check("ncclSend", N.send((const char *)send + sdispls[j] * es, (size_t)scounts[j], t, j,
                                                         nc, comm_stream));
        if (!rc && rcounts[j]) rc = nccl_check("ncclRecv", N.recv((char *)recv + rdispls[j] * es, (size_t)rcounts[j], t, j,
                                                                nc, comm_stream));
    }
    int end = queued(nccl_check("ncclGroupEnd", N.group_end()));
    int joined = cu_comm_join();
    return rc || end || joined ? -1 : 0;
}

/* ---- the watchdog ---- */
static double watchdog_timeout = 600;   /* seconds; <= 0: none */

extern "C" void cu_comm_set_timeout(double seconds) { watchdog_timeout = seconds; }

static int comm_in_flight(void) { return comm_queued && cudaEventQuery(comm_tail) == cudaErrorNotReady; }

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* the first asynchronous error any live communicator reports (ncclSuccess: none) */
static ncclResult_t async_failure(void) {
    for (int i = 0; i < 64; i++) {
        ncclResult_t r = ncclSuccess;
        if (live[i] && !live[i]->aborted && N.async_error(live[i]->nccl, &r) == ncclSuccess && r != ncclSuccess &&
            r != ncclInProgress)
            return r;
    }
    return ncclSuccess;
}

/* every communicator aborted (their kernels end), the failure kept for the core */
static int watchdog_fires(const char *what, ncclResult_t async) {
    char msg[480];
    if (async != ncclSuccess)
        snprintf(msg, sizeof msg, "NCCL watchdog: NCCL reported an error (%s) with device collectives in flight (the last "
                 "queued: %s)", N.error_string(async), last_queued);
    else
        snprintf(msg, sizeof msg, "NCCL watchdog: timed out after %g s waiting for the device collectives in flight (the "
                 "last queued: %s): a rank died, stalled or skipped one", watchdog_timeout, last_queued);
    size_t n = strlen(msg);
    snprintf(msg + n, sizeof msg - n, "; its communicators are aborted and cannot be used again: end the job "
             "(uly.dist.abort)%s", async != ncclSuccess ? "" : "; the limit is ULY_COMM_TIMEOUT or uly.dist.set_timeout");
    uly_cu_fail_msg(what, msg);
    for (int i = 0; i < 64; i++)
        if (live[i] && !live[i]->aborted) {
            N.abort(live[i]->nccl);
            live[i]->aborted = 1;
        }
    return -1;
}

int uly_cu_stream_wait(const char *what) {
    cudaError_t e = cudaSuccess;
    const double t0 = seconds_now();
    for (long spins = 0;; spins++) {
        if (!N.ok || !comm_in_flight()) { e = cudaStreamSynchronize(uly_cu_stream); break; }
        e = cudaStreamQuery(uly_cu_stream);
        if (e != cudaErrorNotReady) break;
        ncclResult_t async = async_failure();
        const double waited = seconds_now() - t0;
        if (async != ncclSuccess || (watchdog_timeout > 0 && waited > watchdog_timeout)) return watchdog_fires(what, async);
        if (spins < 2000) sched_yield();   /* about the first millisecond: the common case, soon done */
        else { struct timespec ts = {0, 100000}; nanosleep(&ts, NULL); }
    }
    if (e != cudaSuccess) { uly_cu_fail(what, e); return -1; }
    return 0;
}
#else /* built without nccl.h: no device collectives, the core stages through host memory */
extern "C" void cu_comm_set_timeout(double seconds) {}
extern "C" int cu_comm_aborted(void *comm) { return 0; }
int uly_cu_stream_wait(const char *what) {
    cudaError_t e = cudaStreamSynchronize(uly_cu_stream);
    if (e != cudaSuccess) { uly_cu_fail(what, e); return -1; }
    return 0;
}
extern "C" int cu_comm_unique_id(void *id, int64_t len) { uly_cu_fail_msg("NCCL", "built without nccl.h"); return -1; }
extern "C" void *cu_comm_create(int nranks, int rank, const void *id) { return NULL; }
extern "C" void cu_comm_destroy(void *comm) {}
extern "C" int cu_comm_all_reduce(void *comm, void *buf, int64_t count, int dtype, int op) { return -1; }
extern "C" int cu_comm_all_reduce_start(void *comm, void *buf, int64_t count, int dtype, int op) { return -1; }
extern "C" int cu_comm_all_gather_start(void *comm, const void *send, void *recv, int64_t count, int dtype) { return -1; }
extern "C" int cu_comm_reduce_scatter_start(void *comm, const void *send, void *recv, int64_t count, int dtype, int op) {
    return -1;
}
extern "C" int cu_comm_all_to_all_v(void *comm, const void *send, const int64_t *scounts, const int64_t *sdispls, void *recv,
                                    const int64_t *rcounts, const int64_t *rdispls, int dtype) { return -1; }
#endif
