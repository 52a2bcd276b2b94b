/* kernels/cuda/emu/streams.cpp — the CUDA emulator's streams and events (see cuda_emu.h).
 *
 * Every kernel, copy, memset, GEMM and stream-ordered free is a piece of work submitted to a
 * stream. By default it runs at once, in submission order. With ULY_EMU_STREAMS=lazy it is queued
 * and runs only when the host or another stream needs it: cudaStreamSynchronize runs the stream's
 * queue, cudaEventSynchronize runs it up to the event, a cudaStreamWaitEvent queued on stream B
 * runs A up to the event when B reaches it, and the synchronous calls (cudaMemcpy, cudaFree,
 * cudaDeviceSynchronize) run every queue. So work that reads what another stream writes without
 * waiting for it sees the old bytes, and the specs fail instead of passing by luck. The default
 * stream (NULL) is the legacy one: its work runs after every other queue.
 *
 * A piece of work may also have a readiness test (submit_when: the emulated NCCL's transfers,
 * ready once MPI has moved their data; a wait for another stream's event). A blocking wait spins
 * on it; cudaStreamQuery / cudaEventQuery run what is ready and answer cudaErrorNotReady at the
 * first piece that is not, which is how the NCCL watchdog (kernels/cuda/comm.cu) sees a
 * collective that never completes. */
#include "cuda_emu.h"
#include <sched.h>
#include <stdio.h>
#include <time.h>
#include <deque>
#include <vector>

struct uly_emu_work {
    std::function<bool()> ready;        /* empty: always ready */
    std::function<void()> run;
};
struct uly_emu_stream {
    std::deque<uly_emu_work> queue;
    uint64_t submitted = 0, done = 0;   /* pieces of work handed in, and run */
    bool running = false;
};
struct uly_emu_event {
    uly_emu_stream *stream = NULL;      /* where it was last recorded; NULL: never (complete) */
    uint64_t point = 0;                 /* complete once stream->done reaches it */
    double t = 0;                       /* when the stream reached it */
};

namespace uly_emu {
std::vector<uly_emu_stream *> streams;   /* every stream made, for drain_all */

bool lazy() {
    static int mode = -1;
    if (mode < 0) {
        const char *e = getenv("ULY_EMU_STREAMS");
        mode = e && !strcmp(e, "lazy");
    }
    return mode == 1;
}

namespace {
double seconds_now() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool cycle;   /* progress_to found the stream it needs already running (a wait for its own later work) */

void deadlock() {
    fprintf(stderr, "cuda emulator: a stream waits for an event that only its own later work records (deadlock)\n");
    abort();
}

void relax(long spins) {
    if (spins < 1000) { sched_yield(); return; }
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
}

/* pops and runs the front piece of s's work */
void run_front(uly_emu_stream *s) {
    std::function<void()> w = std::move(s->queue.front().run);
    s->queue.pop_front();
    w();
    s->done++;
}
} // namespace

/* run s's queue until `point` pieces of its work are done, waiting for each to be ready */
void run_to(uly_emu_stream *s, uint64_t point) {
    if (s->done >= point) return;
    if (s->running) deadlock();   /* a stream waiting, through others, for its own later work */
    s->running = true;
    while (s->done < point && !s->queue.empty()) {
        for (long spins = 0; s->queue.front().ready; spins++) {
            cycle = false;
            if (s->queue.front().ready()) break;
            if (cycle) deadlock();
            relax(spins);
        }
        run_front(s);
    }
    s->running = false;
}

/* run what is ready of s's queue, without waiting, up to `point`; true once s has reached it */
bool progress_to(uly_emu_stream *s, uint64_t point) {
    if (s->done >= point) return true;
    if (s->running) { cycle = true; return false; }
    s->running = true;
    while (s->done < point && !s->queue.empty() && (!s->queue.front().ready || s->queue.front().ready())) run_front(s);
    s->running = false;
    return s->done >= point;
}

void submit_when(uly_emu_stream *s, std::function<bool()> ready, std::function<void()> work) {
    if (!s) {
        drain_all();
        for (long spins = 0; ready && !ready(); spins++) relax(spins);
        work();
        return;
    }
    s->submitted++;
    s->queue.push_back(uly_emu_work{std::move(ready), std::move(work)});
    if (!lazy() && !s->running) run_to(s, s->submitted);
}

void submit(uly_emu_stream *s, std::function<void()> work) { submit_when(s, nullptr, std::move(work)); }

void drain(uly_emu_stream *s) { if (s) run_to(s, s->submitted); else drain_all(); }

void drain_all() {
    for (size_t i = 0; i < streams.size(); i++) run_to(streams[i], streams[i]->submitted);
}
} // namespace uly_emu

using uly_emu::drain;
using uly_emu::drain_all;
using uly_emu::submit;

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = new uly_emu_stream;
    uly_emu::streams.push_back(*s);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!s) return cudaSuccess;
    drain(s);
    for (size_t i = 0; i < uly_emu::streams.size(); i++)
        if (uly_emu::streams[i] == s) uly_emu::streams.erase(uly_emu::streams.begin() + (long)i);
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { drain(s); return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t s) {
    if (!s) {
        for (size_t i = 0; i < uly_emu::streams.size(); i++)
            if (!uly_emu::progress_to(uly_emu::streams[i], uly_emu::streams[i]->submitted)) return cudaErrorNotReady;
        return cudaSuccess;
    }
    return uly_emu::progress_to(s, s->submitted) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaDeviceSynchronize(void) { drain_all(); return cudaSuccess; }

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind) {
    drain_all();
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind, cudaStream_t s) {
    if (bytes) submit(s, [=]() { memmove(dst, src, bytes); });
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    if (bytes) submit(s, [=]() { memset(p, value, bytes); });
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new uly_emu_event; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!s) { drain_all(); e->stream = NULL; e->t = uly_emu::seconds_now(); return cudaSuccess; }
    submit(s, [e]() { e->t = uly_emu::seconds_now(); });
    e->stream = s;
    e->point = s->submitted;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (e->stream) uly_emu::run_to(e->stream, e->point);
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    return !e->stream || uly_emu::progress_to(e->stream, e->point) ? cudaSuccess : cudaErrorNotReady;
}
/* s goes on only once e's stream has reached e (as recorded now: a later record does not count) */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    uly_emu_stream *on = e->stream;
    uint64_t point = e->point;
    if (on && on != s)
        uly_emu::submit_when(s, [on, point]() { return uly_emu::progress_to(on, point); }, [on, point]() { uly_emu::run_to(on, point); });
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)((b->t - a->t) * 1e3);
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }

/* For spec/device_spec.lua: the stream semantics above, checked on two streams. Returns 1 when
 * work runs lazily (ULY_EMU_STREAMS=lazy), 0 when at once, -1 when either breaks its promise: a
 * read without a wait must see the old value exactly when lazy, and one ordered by
 * cudaStreamWaitEvent must always see the new one. */
extern "C" int uly_emu_streams_selftest(void) {
    cudaStream_t a = NULL, b = NULL;
    cudaEvent_t e = NULL;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreate(&e);
    static int value, seen;
    value = 1;
    seen = 0;
    submit(a, []() { value = 2; });
    const int early = value;                 /* nothing waited for a yet */
    cudaEventRecord(e, a);
    cudaStreamWaitEvent(b, e, 0);
    submit(b, []() { seen = value; });
    cudaStreamSynchronize(b);                /* b's wait runs a up to the event first */
    const int ordered = seen;
    cudaEventDestroy(e);
    cudaStreamDestroy(b);
    cudaStreamDestroy(a);
    const int lazy_now = uly_emu::lazy();
    if (ordered != 2 || early != (lazy_now ? 1 : 2)) return -1;
    if (lazy_now) {   /* work that is not ready yet: a query stops there, and runs it once it is */
        static bool go;
        go = false;
        value = 1;
        cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
        uly_emu::submit_when(a, []() { return go; }, []() { value = 3; });
        submit(a, []() { value *= 2; });
        const cudaError_t before = cudaStreamQuery(a);
        go = true;
        const cudaError_t after = cudaStreamQuery(a);
        cudaStreamDestroy(a);
        if (before != cudaErrorNotReady || after != cudaSuccess || value != 6) return -1;
    }
    return lazy_now;
}