/* kernels/cuda/profile.cu — GPU time per kernel (profile.cuh): while on, each launch's pair of
 * events is kept (made as needed); stop waits for the device, sums each pair's elapsed time under
 * its name and destroys the events. The report: uly_cuda_profile_entry(i), entries
 * by total time, longest first, and the wall time from start to stop on the backend's stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>
#include <map>
#include <algorithm>
#include "common.cuh"
#include "uly_cuda.h"

int uly_cu_prof_on;

namespace {
struct launch_rec {
    char name[96];
    cudaEvent_t a, b;
};
struct entry {
    std::string name;
    int64_t calls;
    double ms;
};
std::vector<cudaEvent_t> pool;        /* this profile's events, destroyed at its stop */
std::vector<launch_rec> launches;     /* this profile's, in launch order */
std::vector<entry> report;            /* the last stop's */
cudaEvent_t wall_a, wall_b;
double wall_ms;
char failure[200];

cudaEvent_t take_event() {
    cudaEvent_t e;
    if (cudaEventCreate(&e) != cudaSuccess) return NULL;
    pool.push_back(e);
    return e;
}
void destroy_events() {
    for (cudaEvent_t e : pool) cudaEventDestroy(e);
    pool.clear();
}
void fail(const char *what, cudaError_t e) {
    if (!failure[0]) snprintf(failure, sizeof failure, "profiling: %s: %s", what, cudaGetErrorString(e));
}
} // namespace

int uly_cu_prof_begin(const char *name, cudaStream_t s) {
    launch_rec r;
    snprintf(r.name, sizeof r.name, "%s", name);
    /* ULY_LAUNCH names a templated kernel as written, in parentheses: drop them */
    size_t n = strlen(r.name);
    if (n >= 2 && r.name[0] == '(' && r.name[n - 1] == ')') {
        memmove(r.name, r.name + 1, n - 2);
        r.name[n - 2] = 0;
    }
    r.a = take_event();
    r.b = take_event();
    if (!r.a || !r.b) { fail("creating an event", cudaErrorMemoryAllocation); return -1; }
    cudaError_t e = cudaEventRecord(r.a, s);
    if (e != cudaSuccess) { fail("recording an event", e); return -1; }
    launches.push_back(r);
    return (int)launches.size() - 1;
}

void uly_cu_prof_end(int slot, cudaStream_t s) {
    cudaError_t e = cudaEventRecord(launches[(size_t)slot].b, s);
    if (e != cudaSuccess) fail("recording an event", e);
}

extern "C" int uly_cuda_profile_start(void) {
    if (uly_cu_prof_on) { uly_cuda_record_error("uly.cuda.profile: already profiling (profiles do not nest)"); return -1; }
    if (!uly_cuda_backend()) return -1;   /* the reason is recorded */
    launches.clear();
    report.clear();
    destroy_events();
    failure[0] = 0;
    wall_ms = 0;
    wall_a = take_event();
    wall_b = take_event();
    if (!wall_a || !wall_b || cudaEventRecord(wall_a, uly_cu_stream) != cudaSuccess) {
        destroy_events();
        uly_cuda_record_error("uly.cuda.profile: cannot record a CUDA event");
        return -1;
    }
    uly_cu_prof_on = 1;
    return 0;
}

extern "C" int uly_cuda_profile_stop(void) {
    if (!uly_cu_prof_on) { uly_cuda_record_error("uly.cuda.profile: not profiling (start it first)"); return -1; }
    uly_cu_prof_on = 0;
    cudaError_t e = cudaEventRecord(wall_b, uly_cu_stream);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) fail("waiting for the device", e);
    float ms = 0;
    if (!failure[0] && cudaEventElapsedTime(&ms, wall_a, wall_b) == cudaSuccess) wall_ms = ms;
    std::map<std::string, size_t> at;
    for (const launch_rec &r : launches) {
        float t = 0;
        e = cudaEventElapsedTime(&t, r.a, r.b);
        if (e != cudaSuccess) { fail("reading a launch's time", e); break; }
        auto it = at.find(r.name);
        if (it == at.end()) {
            at[r.name] = report.size();
            report.push_back(entry{r.name, 1, t});
        } else {
            report[it->second].calls++;
            report[it->second].ms += t;
        }
    }
    launches.clear();
    destroy_events();
    std::stable_sort(report.begin(), report.end(), [](const entry &x, const entry &y) { return x.ms > y.ms; });
    if (failure[0]) {
        report.clear();
        uly_cuda_record_error(failure);
        return -1;
    }
    return 0;
}

extern "C" int uly_cuda_profile_count(double *wall) {
    if (wall) *wall = wall_ms;
    return (int)report.size();
}

extern "C" int uly_cuda_profile_entry(int i, char *name, int len, int64_t *calls, double *ms) {
    if (i < 0 || i >= (int)report.size() || len <= 0) return -1;
    snprintf(name, (size_t)len, "%s", report[(size_t)i].name.c_str());
    *calls = report[(size_t)i].calls;
    *ms = report[(size_t)i].ms;
    return 0;
}
