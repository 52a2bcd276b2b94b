/* kernels/cuda/emu/streams.cpp — the CUDA emulator's streams and events (see cuda_emu.h).
 *
 * Every kernel, copy, memset, GEMM and stream-ordered free is a piece of work submitted to a
 * stream. By default it runs at once, in submission order. With ULY_EMU_STREAMS=lazy it is queued
 * and runs only when the host or another stream needs it: cudaStreamSynchronize runs the stream's
 * queue, cudaEventSynchronize runs it up to the event, a cudaStreamWaitEvent queued on stream B
 * runs A up to the event when B reaches it, and the synchronous calls (cudaMemcpy, cudaFree,
 * cudaDeviceSynchronize) run every queue. So work that reads what another stream writes without
 * waiting for it sees the old bytes, and the specs fail instead of passing by luck. The default
 * stream (NULL) is the legacy one: its work runs after every other queue. */
#include "cuda_emu.h"
#include <stdio.h>
#include <time.h>
#include <deque>
#include <vector>

struct uly_emu_stream {
    std::deque<std::function<void()>> queue;
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

/* run s's queue until `point` pieces of its work are done */
void run_to(uly_emu_stream *s, uint64_t point) {
    if (s->done >= point) return;
    if (s->running) {   /* a stream waiting, through others, for its own later work */
        fprintf(stderr, "cuda emulator: a stream waits for an event that only its own later work records (deadlock)\n");
        abort();
    }
    s->running = true;
    while (s->done < point && !s->queue.empty()) {
        std::function<void()> w = std::move(s->queue.front());
        s->queue.pop_front();
        w();
        s->done++;
    }
    s->running = false;
}
} // namespace

void submit(uly_emu_stream *s, std::function<void()> work) {
    if (!s) { drain_all(); work(); return; }
    s->submitted++;
    if (!lazy() && s->queue.empty() && !s->running) { work(); s->done++; return; }
    s->queue.push_back(std::move(work));
    if (!lazy() && !s->running) run_to(s, s->submitted);
}

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
/* s goes on only once e's stream has reached e (as recorded now: a later record does not count) */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    uly_emu_stream *on = e->stream;
    uint64_t point = e->point;
    if (on && on != s) submit(s, [on, point]() { uly_emu::run_to(on, point); });
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
    return lazy_now;
}