/* core/alloc.c — the caching allocator, one pool per device: blocks rounded to size classes and
 * kept after free (so the same activations reuse the same, already-faulted pages, and a GPU step
 * makes no cudaMalloc once warm), a memory limit that fails cleanly, and the allocated / peak /
 * reserved counters that benchmarks report. The host pool takes 64-byte aligned memory (huge
 * pages for large blocks) and trims its cache beyond the high-water mark; device pools take raw
 * buffers from the device's backend, keep them until memory runs out, then free the whole cache
 * and retry once. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "internal.h"

#define HUGE_PAGE (2LL << 20)

typedef struct { void *p; int64_t bytes; } block;

typedef struct pool {
    pthread_mutex_t lock;
    block *free_blocks;
    int64_t n_free, cap_free;
    int64_t allocated, peak, cached, limit;
    int64_t raw_allocs, raw_frees;     /* calls into the OS / the device backend */
} pool;

static pool pools[ULY_DEVICE_COUNT] = {
    [ULY_DEVICE_CPU] = {.lock = PTHREAD_MUTEX_INITIALIZER},
    [ULY_DEVICE_CUDA] = {.lock = PTHREAD_MUTEX_INITIALIZER},
};

static int64_t physical_memory(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return (pages > 0 && page > 0) ? (int64_t)pages * page : (int64_t)1 << 40;
}

static int64_t default_limit(int device) {
    if (device == ULY_DEVICE_CPU) return physical_memory();
    int64_t free_b = 0, total_b = 0;
    const uly_backend *be = uly_backends[device];
    if (be && be->memory_info && be->memory_info(&free_b, &total_b) == 0 && total_b > 0) return total_b;
    return INT64_MAX / 4;
}

/* size classes: 64 B granularity up to 64 KiB, then 1/8 steps of the power of two, and
 * whole huge pages from 2 MiB; at most ~12% slack (device pools: 512 B granularity) */
static int64_t round_size(int device, int64_t n) {
    if (n <= 0) n = 1;
    int64_t g = device == ULY_DEVICE_CPU ? 63 : 511;
    if (n <= 65536) return (n + g) & ~g;
    if (n >= HUGE_PAGE) return (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    int64_t p = 1;
    while (p * 2 <= n) p *= 2;
    int64_t step = p / 8;
    return (n + step - 1) / step * step;
}

static void *raw_alloc(int device, pool *P, int64_t bytes) {
    void *p = NULL;
    if (device == ULY_DEVICE_CPU) {
        size_t align = bytes >= HUGE_PAGE ? (size_t)HUGE_PAGE : 64;
        if (posix_memalign(&p, align, (size_t)bytes) != 0) return NULL;
        if (bytes >= HUGE_PAGE) madvise(p, (size_t)bytes, MADV_HUGEPAGE);
    } else {
        p = uly_backends[device]->raw_alloc(bytes);
    }
    if (p) P->raw_allocs++;
    return p;
}

static void raw_free(int device, pool *P, void *p) {
    if (device == ULY_DEVICE_CPU) free(p);
    else uly_backends[device]->raw_free(p);
    P->raw_frees++;
}

static void *take_cached(pool *P, int64_t bytes) {
    for (int64_t i = P->n_free - 1; i >= 0; i--) {
        if (P->free_blocks[i].bytes == bytes) {
            void *p = P->free_blocks[i].p;
            P->free_blocks[i] = P->free_blocks[--P->n_free];
            P->cached -= bytes;
            return p;
        }
    }
    return NULL;
}

/* The host cache keeps exact-size blocks; with many distinct sizes (million-token activations of
 * several shapes) it could hold far more than the working set. Keep what the pool holds (in use
 * + cached) within the high-water mark of what was in use plus 1/8 and 256 MiB: free the oldest
 * cached blocks beyond that. Device pools keep everything until an allocation fails. */
static void trim_cache_locked(int device, pool *P, int64_t incoming) {
    if (device != ULY_DEVICE_CPU) return;
    int64_t peak = P->peak > P->allocated + incoming ? P->peak : P->allocated + incoming;
    int64_t budget = peak + peak / 8 + (256LL << 20), k = 0;
    while (k < P->n_free && P->allocated + incoming + P->cached > budget) {
        raw_free(device, P, P->free_blocks[k].p);
        P->cached -= P->free_blocks[k].bytes;
        k++;
    }
    if (k) {
        memmove(P->free_blocks, P->free_blocks + k, (size_t)(P->n_free - k) * sizeof *P->free_blocks);
        P->n_free -= k;
    }
}

static void release_cache_locked(int device, pool *P) {
    for (int64_t i = 0; i < P->n_free; i++) raw_free(device, P, P->free_blocks[i].p);
    P->n_free = 0;
    P->cached = 0;
}

static const char *device_label(int device) { return device == ULY_DEVICE_CPU ? "" : " on the cuda device"; }

void *uly_alloc_on(int device, int64_t nbytes, int64_t *block_bytes) {
    if (nbytes < 0) return uly_set_error_null("allocation of a negative size (%lld bytes)", (long long)nbytes);
    if (device < 0 || device >= ULY_DEVICE_COUNT || !uly_backends[device])
        return uly_set_error_null("allocation on device %d, which has no backend", device);
    pool *P = &pools[device];
    int64_t bytes = round_size(device, nbytes);
    pthread_mutex_lock(&P->lock);
    if (!P->limit) P->limit = default_limit(device);
    if (P->allocated + bytes > P->limit) {
        int64_t used = P->allocated, limit = P->limit;
        pthread_mutex_unlock(&P->lock);
        return uly_set_error_null("out of memory%s: cannot allocate %s (%s already in use, limit %s); "
                                  "use smaller tensors or raise the limit with uly.memory_limit()",
                                  device_label(device), uly_bytes_str(nbytes), uly_bytes_str(used),
                                  uly_bytes_str(limit));
    }
    void *p = take_cached(P, bytes);
    if (!p) { trim_cache_locked(device, P, bytes); p = raw_alloc(device, P, bytes); }
    if (!p && P->n_free) { /* out of memory: give the whole cache back, then one retry */
        if (device != ULY_DEVICE_CPU) uly_backends[device]->take_error();
        release_cache_locked(device, P);
        p = raw_alloc(device, P, bytes);
    }
    if (!p) {
        const char *why = device == ULY_DEVICE_CPU ? "the system refused it" : uly_backends[device]->take_error();
        int64_t used = P->allocated;
        pthread_mutex_unlock(&P->lock);
        return uly_set_error_null("out of memory%s: cannot allocate %s with %s in use and the cache emptied (%s)",
                                  device_label(device), uly_bytes_str(nbytes), uly_bytes_str(used),
                                  why ? why : "no reason given");
    }
    P->allocated += bytes;
    if (P->allocated > P->peak) P->peak = P->allocated;
    pthread_mutex_unlock(&P->lock);
    *block_bytes = bytes;
    return p;
}

void uly_free_on(int device, void *p, int64_t block_bytes) {
    if (!p) return;
    pool *P = &pools[device];
    pthread_mutex_lock(&P->lock);
    P->allocated -= block_bytes;
    if (P->n_free == P->cap_free) {
        int64_t cap = P->cap_free ? P->cap_free * 2 : 256;
        block *nb = realloc(P->free_blocks, (size_t)cap * sizeof *nb);
        if (!nb) { raw_free(device, P, p); pthread_mutex_unlock(&P->lock); return; }
        P->free_blocks = nb;
        P->cap_free = cap;
    }
    P->free_blocks[P->n_free++] = (block){p, block_bytes};
    P->cached += block_bytes;
    trim_cache_locked(device, P, 0);
    pthread_mutex_unlock(&P->lock);
}

void *uly_alloc(int64_t nbytes, int64_t *block_bytes) { return uly_alloc_on(ULY_DEVICE_CPU, nbytes, block_bytes); }
void uly_free(void *p, int64_t block_bytes) { uly_free_on(ULY_DEVICE_CPU, p, block_bytes); }

int uly_device_memory_stats(int device, int64_t *stats) {
    if (device < 0 || device >= ULY_DEVICE_COUNT) return uly_set_error("memory stats: unknown device %d", device);
    if (!stats) return uly_set_error("memory stats: needs an array of 6 counters");
    pool *P = &pools[device];
    pthread_mutex_lock(&P->lock);
    if (!P->limit && uly_backends[device]) P->limit = default_limit(device);
    int64_t v[6] = {P->allocated, P->peak, P->allocated + P->cached, P->limit, P->raw_allocs, P->raw_frees};
    pthread_mutex_unlock(&P->lock);
    memcpy(stats, v, sizeof v);
    return 0;
}

int uly_device_memory_reset_peak(int device) {
    if (device < 0 || device >= ULY_DEVICE_COUNT) return uly_set_error("memory: unknown device %d", device);
    pool *P = &pools[device];
    pthread_mutex_lock(&P->lock);
    P->peak = P->allocated;
    pthread_mutex_unlock(&P->lock);
    return 0;
}

int uly_device_empty_cache(int device) {
    if (device < 0 || device >= ULY_DEVICE_COUNT) return uly_set_error("memory: unknown device %d", device);
    pool *P = &pools[device];
    pthread_mutex_lock(&P->lock);
    if (P->n_free) release_cache_locked(device, P);
    free(P->free_blocks);
    P->free_blocks = NULL;
    P->cap_free = 0;
    pthread_mutex_unlock(&P->lock);
    return 0;
}

int uly_device_set_memory_limit(int device, int64_t nbytes) {
    if (device < 0 || device >= ULY_DEVICE_COUNT) return uly_set_error("memory: unknown device %d", device);
    pools[device].limit = nbytes > 0 ? nbytes : (uly_backends[device] ? default_limit(device) : 0);
    return 0;
}

int64_t uly_device_memory_allocated(int device) {
    return device >= 0 && device < ULY_DEVICE_COUNT ? pools[device].allocated : 0;
}
int64_t uly_memory_allocated(void) { return pools[ULY_DEVICE_CPU].allocated; }
int64_t uly_memory_peak(void) { return pools[ULY_DEVICE_CPU].peak; }
int64_t uly_memory_reserved(void) { return pools[ULY_DEVICE_CPU].allocated + pools[ULY_DEVICE_CPU].cached; }
void uly_memory_reset_peak(void) { uly_device_memory_reset_peak(ULY_DEVICE_CPU); }
void uly_memory_empty_cache(void) { uly_device_empty_cache(ULY_DEVICE_CPU); }
void uly_memory_set_limit(int64_t nbytes) { uly_device_set_memory_limit(ULY_DEVICE_CPU, nbytes); }
int64_t uly_memory_limit(void) {
    pool *P = &pools[ULY_DEVICE_CPU];
    return P->limit ? P->limit : (P->limit = physical_memory());
}

/* the device pool's cache goes back before its backend may be unloaded; the host pool at exit */
int uly_device_pool_in_use(int device) { return pools[device].allocated > 0; }
__attribute__((destructor)) static void release_pool_at_exit(void) {
    uly_memory_empty_cache();
    /* the simulated device lives in this library; a real device's library may be gone by now */
    if (uly_backends[ULY_DEVICE_CUDA] == &uly_backend_sim) uly_device_empty_cache(ULY_DEVICE_CUDA);
}
