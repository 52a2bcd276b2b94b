/* core/alloc.c — the host allocator: 64-byte aligned blocks, a caching pool keyed by rounded
 * size (so the same activations reuse the same, already-faulted pages every step), huge pages
 * for large blocks, a memory limit that fails cleanly, and the allocated/peak counters that
 * every benchmark reports. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "internal.h"

#define HUGE_PAGE (2LL << 20)

typedef struct { void *p; int64_t bytes; } block;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static block *free_blocks;
static int64_t n_free, cap_free;
static int64_t bytes_allocated, bytes_peak, bytes_cached, bytes_limit;

static int64_t physical_memory(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return (pages > 0 && page > 0) ? (int64_t)pages * page : (int64_t)1 << 40;
}

/* size classes: 64 B granularity up to 64 KiB, then 1/8 steps of the power of two, and
 * whole huge pages from 2 MiB; at most ~12% slack */
static int64_t round_size(int64_t n) {
    if (n <= 0) n = 1;
    if (n <= 65536) return (n + 63) & ~63LL;
    if (n >= HUGE_PAGE) return (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    int64_t p = 1;
    while (p * 2 <= n) p *= 2;
    int64_t step = p / 8;
    return (n + step - 1) / step * step;
}

static void *take_cached(int64_t bytes) {
    for (int64_t i = n_free - 1; i >= 0; i--) {
        if (free_blocks[i].bytes == bytes) {
            void *p = free_blocks[i].p;
            free_blocks[i] = free_blocks[--n_free];
            bytes_cached -= bytes;
            return p;
        }
    }
    return NULL;
}

/* The cache keeps exact-size blocks; with many distinct sizes (million-token activations of
 * several shapes) it could hold far more than the working set. Keep what the pool holds (in use
 * + cached) within the high-water mark of what was in use plus 1/8 and 256 MiB: free the oldest
 * cached blocks beyond that. */
static int64_t pool_budget(int64_t incoming) {
    int64_t peak = bytes_peak > bytes_allocated + incoming ? bytes_peak : bytes_allocated + incoming;
    return peak + peak / 8 + (256LL << 20);
}

static void trim_cache_locked(int64_t incoming) {
    int64_t budget = pool_budget(incoming), k = 0;
    while (k < n_free && bytes_allocated + incoming + bytes_cached > budget) {
        free(free_blocks[k].p);
        bytes_cached -= free_blocks[k].bytes;
        k++;
    }
    if (k) {
        memmove(free_blocks, free_blocks + k, (size_t)(n_free - k) * sizeof *free_blocks);
        n_free -= k;
    }
}

static void release_cache_locked(void) {
    for (int64_t i = 0; i < n_free; i++) free(free_blocks[i].p);
    n_free = 0;
    bytes_cached = 0;
}

static void *os_alloc(int64_t bytes) {
    void *p = NULL;
    size_t align = bytes >= HUGE_PAGE ? (size_t)HUGE_PAGE : 64;
    if (posix_memalign(&p, align, (size_t)bytes) != 0) return NULL;
    if (bytes >= HUGE_PAGE) madvise(p, (size_t)bytes, MADV_HUGEPAGE);
    return p;
}

void *uly_alloc(int64_t nbytes, int64_t *block_bytes) {
    if (nbytes < 0) return uly_set_error_null("allocation of a negative size (%lld bytes)", (long long)nbytes);
    int64_t bytes = round_size(nbytes);
    pthread_mutex_lock(&pool_lock);
    if (!bytes_limit) bytes_limit = physical_memory();
    if (bytes_allocated + bytes > bytes_limit) {
        int64_t used = bytes_allocated, limit = bytes_limit;
        pthread_mutex_unlock(&pool_lock);
        return uly_set_error_null("out of memory: cannot allocate %s (%s already in use, limit %s); "
                                  "use smaller tensors or raise the limit with uly.memory_limit()",
                                  uly_bytes_str(nbytes), uly_bytes_str(used), uly_bytes_str(limit));
    }
    void *p = take_cached(bytes);
    if (!p) { trim_cache_locked(bytes); p = os_alloc(bytes); }
    if (!p && n_free) { release_cache_locked(); p = os_alloc(bytes); }
    if (!p) {
        pthread_mutex_unlock(&pool_lock);
        return uly_set_error_null("out of memory: the system refused %s", uly_bytes_str(nbytes));
    }
    bytes_allocated += bytes;
    if (bytes_allocated > bytes_peak) bytes_peak = bytes_allocated;
    pthread_mutex_unlock(&pool_lock);
    *block_bytes = bytes;
    return p;
}

void uly_free(void *p, int64_t block_bytes) {
    if (!p) return;
    pthread_mutex_lock(&pool_lock);
    bytes_allocated -= block_bytes;
    if (n_free == cap_free) {
        int64_t cap = cap_free ? cap_free * 2 : 256;
        block *nb = realloc(free_blocks, (size_t)cap * sizeof *nb);
        if (!nb) { free(p); pthread_mutex_unlock(&pool_lock); return; }
        free_blocks = nb;
        cap_free = cap;
    }
    free_blocks[n_free++] = (block){p, block_bytes};
    bytes_cached += block_bytes;
    trim_cache_locked(0);
    pthread_mutex_unlock(&pool_lock);
}

int64_t uly_memory_allocated(void) { return bytes_allocated; }
int64_t uly_memory_peak(void) { return bytes_peak; }
int64_t uly_memory_reserved(void) { return bytes_allocated + bytes_cached; }
void uly_memory_reset_peak(void) { pthread_mutex_lock(&pool_lock); bytes_peak = bytes_allocated; pthread_mutex_unlock(&pool_lock); }

void uly_memory_empty_cache(void) {
    pthread_mutex_lock(&pool_lock);
    release_cache_locked();
    free(free_blocks);
    free_blocks = NULL;
    cap_free = 0;
    pthread_mutex_unlock(&pool_lock);
}

void uly_memory_set_limit(int64_t nbytes) { bytes_limit = nbytes > 0 ? nbytes : physical_memory(); }
int64_t uly_memory_limit(void) { return bytes_limit ? bytes_limit : (bytes_limit = physical_memory()); }

__attribute__((destructor)) static void release_pool_at_exit(void) { uly_memory_empty_cache(); }
