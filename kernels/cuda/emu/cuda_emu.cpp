/* kernels/cuda/emu/cuda_emu.cpp — the CUDA emulator's machinery (see cuda_emu.h): the fiber
 * scheduler behind launches, __syncthreads and warp shuffles as barriers with deadlock
 * detection, host-memory "device" allocations with a limit, and the cuBLAS GEMM as loops.
 * Fibers switch with a few instructions on x86-64 (callee-saved registers and the stack
 * pointer; ucontext's swapcontext makes two system calls per switch), with ucontext elsewhere. */
#include "cuda_emu.h"
#include <stdio.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
/* fibers end without unwinding: their frames' redzones stay poisoned, so clear a stack before reuse */
#define UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define UNPOISON(p, n) ((void)0)
#endif
#include <time.h>
#include <unistd.h>
#include <ucontext.h>
#include <algorithm>
#include <map>
#include <vector>

dim3 threadIdx, blockIdx, blockDim, gridDim;

#if defined(__x86_64__)
/* uly_emu_swap(&save_sp, load_sp): push the callee-saved registers, switch stacks, pop them */
extern "C" void uly_emu_swap(void **save_sp, void *load_sp);
__asm__(".text\n.globl uly_emu_swap\n.type uly_emu_swap,@function\nuly_emu_swap:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
        ".size uly_emu_swap, .-uly_emu_swap\n");
#define FAST_SWITCH 1
#endif

namespace uly_emu {
namespace {
enum { NONE = 0, BLOCK = 1, WARP = 2, SPIN = 3, NAMED = 4 };   /* SPIN: an mbarrier wait, retried each round */
const size_t STACK = 64 << 10;

/* a cp.async copy not yet done: it happens at the cp.async.wait_group that covers its group */
struct async_copy {
    void *dst;
    const void *src;
    int bytes, valid;
    unsigned group;
};

struct wgmma_op {
    float *d;
    int n, trans;
    uint64_t desc;
    float a[2][16];                     /* this thread's rows of A: g and g + 8 (lane = 4 g + t) */
    unsigned group;
    std::vector<uint16_t> b_at_issue;   /* the B elements this thread reads, as they were at issue */
    bool a_shared;                      /* A through a descriptor (desc_a), checked again at the wait */
    bool accumulate;                    /* false: d = A B (wgmma's scale-d 0) */
    uint64_t desc_a;
    int trans_a;                        /* A MN-major */
};

struct fiber {
#ifdef FAST_SWITCH
    void *sp;
#else
    ucontext_t ctx;
#endif
    int done, wait;
    unsigned gen, bar_id;   /* bar_id: the named barrier a NAMED wait is at */
    std::vector<async_copy> copies;   /* issued, not yet waited for */
    unsigned commits;                 /* groups committed so far */
    std::vector<wgmma_op> wgmmas;     /* queued, not yet waited for */
    unsigned wg_commits;
    int stalled;                      /* this run only retried a spin that failed again */
};

/* an mbarrier: arrivals still expected in this phase, bytes still expected, phases completed */
struct mbar_state { unsigned count, pending; int64_t tx; unsigned phase; };
/* a TMA load not yet landed (it lands at the first wait on its barrier) */
struct tma_op { void *dst, *bar; unsigned char map[128]; int c[4]; };

struct block_state {
    std::vector<fiber> fibers;
    char *stacks;            /* threads x STACK bytes, grown (never copied) as blocks get larger */
    size_t stacks_bytes;
#ifdef FAST_SWITCH
    void *sched_sp;
#else
    ucontext_t sched;
#endif
    const std::function<void()> *body;
    unsigned n, cur, alive;
    unsigned block_gen, block_waiting;
    std::vector<unsigned> warp_gen, warp_waiting, warp_alive;
    std::vector<uint64_t> slots;   /* one value per lane for shuffles */
    std::vector<unsigned char> gathered;   /* 64 bytes per lane for warp_gather */
    int eager_copies;                      /* cp.async done at issue (ULY_EMU_ASYNC=eager) */
    std::map<uintptr_t, mbar_state> mbars;   /* the block's mbarriers, by shared-memory address */
    unsigned named_arrived[16], named_count[16];   /* named barriers: arrivals so far, and the count they wait for */
    std::vector<tma_op> tma;                 /* its TMA loads in flight */
    /* setmaxnreg: registers a thread each warpgroup holds, its threads arrived at the pending
     * change (and the count asked), completed changes, and the registers the pool holds */
    std::vector<unsigned> wg_regs, wg_arrived, wg_asked, wg_gen;
    std::vector<int> wg_increase;
    int64_t reg_pool;
} B;

/* from the running fiber back to the scheduler */
void to_scheduler(fiber &f) {
#ifdef FAST_SWITCH
    uly_emu_swap(&f.sp, B.sched_sp);
#else
    swapcontext(&f.ctx, &B.sched);
#endif
}

void trampoline() {
    (*B.body)();
    fiber &f = B.fibers[B.cur];
    f.done = 1;
    B.alive--;
    B.warp_alive[B.cur >> 5]--;
#ifdef FAST_SWITCH
    void *dead;
    uly_emu_swap(&dead, B.sched_sp);   /* never resumed */
#endif
    /* (ucontext: returning resumes uc_link, the scheduler) */
}

void wait_at(int kind) {
    fiber &f = B.fibers[B.cur];
    f.wait = kind;
    if (kind == BLOCK) { f.gen = B.block_gen; B.block_waiting++; }
    else { unsigned w = B.cur >> 5; f.gen = B.warp_gen[w]; B.warp_waiting[w]++; }
    to_scheduler(f);
}

/* release every barrier whose live threads have all arrived; 1 if any was */
int release() {
    int any = 0;
    if (B.block_waiting && B.block_waiting == B.alive) {
        B.block_gen++;
        B.block_waiting = 0;
        for (auto &f : B.fibers) if (f.wait == BLOCK) f.wait = NONE;
        any = 1;
    }
    for (unsigned w = 0; w < B.warp_gen.size(); w++)
        if (B.warp_waiting[w] && B.warp_waiting[w] == B.warp_alive[w]) {
            B.warp_gen[w]++;
            B.warp_waiting[w] = 0;
            for (unsigned t = w * 32; t < B.n && t < w * 32 + 32; t++)
                if (B.fibers[t].wait == WARP) B.fibers[t].wait = NONE;
            any = 1;
        }
    return any;
}
/* runs thread t until it waits or ends; 0 if it could not run */
int run_fiber(unsigned t) {
    fiber &f = B.fibers[t];
    if (f.done || f.wait) return 0;
    B.cur = t;
    f.stalled = 0;
    threadIdx.x = t; threadIdx.y = threadIdx.z = 0;
#ifdef FAST_SWITCH
    uly_emu_swap(&B.sched_sp, f.sp);
#else
    swapcontext(&B.sched, &f.ctx);
#endif
    return !f.stalled;   /* a run that only found its mbarrier phase still open again made no progress */
}
} // namespace

static unsigned char *dyn_smem;
static size_t dyn_smem_bytes;
void *dynamic_shared() { return dyn_smem; }

void run_grid(unsigned blocks, unsigned threads, size_t dynamic_smem, const std::function<void()> &body) {
    if (dynamic_smem > dyn_smem_bytes) {
        free(dyn_smem);
        dyn_smem = (unsigned char *)aligned_alloc(1024, (dynamic_smem + 1023) / 1024 * 1024);
        if (!dyn_smem) { fprintf(stderr, "cuda emulator: no memory for %zu bytes of shared memory\n", dynamic_smem); abort(); }
        dyn_smem_bytes = dynamic_smem;
    }
    if (threads == 0 || threads > 1024) { fprintf(stderr, "cuda emulator: %u threads per block\n", threads); abort(); }
    unsigned warps = (threads + 31) / 32;
    /* ULY_EMU_ORDER=reverse runs one warp at a time, the last first, each up to its next
     * __syncthreads: a read of shared memory that another warp writes without a barrier between
     * them sees what the default order (all threads in turn, warps in step) would hide */
    const char *order = getenv("ULY_EMU_ORDER");
    const int reverse = order && !strcmp(order, "reverse");
    const char *async = getenv("ULY_EMU_ASYNC");
    B.eager_copies = async && !strcmp(async, "eager");
    B.fibers.assign(threads, fiber());
    if (B.stacks_bytes < threads * STACK) {
        if (B.stacks) UNPOISON(B.stacks, B.stacks_bytes);
        free(B.stacks);
        B.stacks_bytes = threads * STACK;
        B.stacks = (char *)malloc(B.stacks_bytes);
        if (!B.stacks) { fprintf(stderr, "cuda emulator: no memory for %u fiber stacks\n", threads); abort(); }
    }
    B.warp_gen.assign(warps, 0);
    B.warp_waiting.assign(warps, 0);
    B.warp_alive.assign(warps, 0);
    B.slots.assign(warps * 32, 0);
    B.gathered.assign((size_t)warps * 32 * 64, 0);
    B.body = &body;
    gridDim.x = blocks; gridDim.y = gridDim.z = 1;
    blockDim.x = threads; blockDim.y = blockDim.z = 1;
    for (unsigned b = 0; b < blocks; b++) {
        blockIdx.x = b; blockIdx.y = blockIdx.z = 0;
        if (dynamic_smem) memset(dyn_smem, 0xff, dynamic_smem);
        B.n = threads;
        B.alive = threads;
        B.mbars.clear();
        B.tma.clear();
        for (int i = 0; i < 16; i++) B.named_arrived[i] = B.named_count[i] = 0;
        const unsigned groups = (threads + 127) / 128, launch_regs = std::min(255u, 65536 / threads / 8 * 8);
        B.wg_regs.assign(groups, launch_regs);
        B.wg_arrived.assign(groups, 0);
        B.wg_asked.assign(groups, 0);
        B.wg_gen.assign(groups, 0);
        B.wg_increase.assign(groups, 0);
        B.reg_pool = 0;
        B.block_gen = B.block_waiting = 0;
        for (unsigned w = 0; w < warps; w++) {
            B.warp_waiting[w] = 0;
            B.warp_alive[w] = (w + 1) * 32 <= threads ? 32 : threads - w * 32;
        }
        UNPOISON(B.stacks, threads * STACK);
        for (unsigned t = 0; t < threads; t++) {
            fiber &f = B.fibers[t];
            f.done = f.wait = NONE;
            f.gen = 0;
            f.copies.clear();
            f.commits = 0;
            if (!f.wgmmas.empty()) {
                fprintf(stderr, "cuda emulator: a thread ended with %zu wgmma never waited for (wgmma.wait_group)\n",
                        f.wgmmas.size());
                abort();
            }
            f.wg_commits = 0;
#ifdef FAST_SWITCH
            /* a fresh stack that "returns" into trampoline: 6 zero registers, then its address */
            uintptr_t top = ((uintptr_t)(B.stacks + (t + 1) * STACK)) & ~(uintptr_t)15;
            void **sp = (void **)top;
            *--sp = NULL;                        /* trampoline's own return address: never used */
            *--sp = (void *)trampoline;
            for (int r = 0; r < 6; r++) *--sp = NULL;
            f.sp = sp;
#else
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = B.stacks + t * STACK;
            f.ctx.uc_stack.ss_size = STACK;
            f.ctx.uc_link = &B.sched;
            makecontext(&f.ctx, trampoline, 0);
#endif
        }
        while (B.alive) {
            int ran = 0;
            for (auto &f : B.fibers) if (f.wait == SPIN) f.wait = NONE;   /* spinning threads try again */
            if (reverse) {
                /* one warp at a time, last first, each as far as it goes before a __syncthreads */
                for (unsigned wi = 0; wi < warps; wi++) {
                    unsigned w = warps - 1 - wi, lo = w * 32, hi = lo + 32 < threads ? lo + 32 : threads;
                    for (;;) {
                        int any = 0;
                        for (unsigned t = hi; t-- > lo;) any |= run_fiber(t);
                        if (!any) break;
                        ran = 1;
                        release();
                    }
                }
            } else {
                /* every thread in turn to its next barrier: the warps advance together */
                for (unsigned t = 0; t < threads; t++) ran |= run_fiber(t);
            }
            if (!release() && !ran && B.alive) {
                fprintf(stderr, "cuda emulator: deadlock in block %u: %u live threads wait at barriers that not all "
                                "of them reach (a __syncthreads or shuffle inside divergent code), on an mbarrier "
                                "phase that nothing completes, or at a setmaxnreg that not all of a warpgroup's "
                                "threads reach or whose increase no decrease makes room for\n", b, B.alive);
                abort();
            }
        }
        if (!B.tma.empty()) {
            fprintf(stderr, "cuda emulator: block %u ended with %zu TMA loads no thread waited for\n", b, B.tma.size());
            abort();
        }
        for (int i = 1; i < 16; i++)
            if (B.named_arrived[i]) {
                fprintf(stderr, "cuda emulator: block %u ended with named barrier %d at %u of its %u arrivals\n", b, i,
                        B.named_arrived[i], B.named_count[i]);
                abort();
            }
    }
}

void sync_block() { wait_at(BLOCK); }

namespace {
/* one more arrival at named barrier id; 1 when it completed (its waiters released) */
int named_arrival(unsigned id, unsigned count) {
    if (id < 1 || id > 15 || count == 0 || count % 32 || count > B.n) {
        fprintf(stderr, "cuda emulator: named barrier %u with a count of %u threads (ids 1 to 15, counts of whole warps "
                        "up to the block's %u)\n", id, count, B.n);
        abort();
    }
    if (B.named_arrived[id] && B.named_count[id] != count) {
        fprintf(stderr, "cuda emulator: named barrier %u used with counts %u and %u at once\n", id, B.named_count[id], count);
        abort();
    }
    B.named_count[id] = count;
    if (++B.named_arrived[id] < count) return 0;
    B.named_arrived[id] = 0;
    for (auto &f : B.fibers)
        if (f.wait == NAMED && f.bar_id == id) f.wait = NONE;
    return 1;
}
} // namespace
void named_sync(unsigned id, unsigned count) {
    if (named_arrival(id, count)) return;
    fiber &f = B.fibers[B.cur];
    f.wait = NAMED;
    f.bar_id = id;
    to_scheduler(f);
}
void named_arrive(unsigned id, unsigned count) { named_arrival(id, count); }

namespace {
/* warpgroup w's pending setmaxnreg, once all its threads asked: a decrease at once, an increase
 * when the pool holds what it takes; 1 when it took effect */
int apply_setmaxnreg(unsigned w) {
    const unsigned n = B.wg_asked[w], members = std::min(128u, B.n - 128 * w);
    if (B.wg_arrived[w] < members) return 0;
    const int64_t change = ((int64_t)n - (int64_t)B.wg_regs[w]) * members;
    if (change > B.reg_pool) return 0;   /* an increase the pool cannot give yet */
    B.reg_pool -= change;
    B.wg_regs[w] = n;
    B.wg_arrived[w] = 0;
    B.wg_gen[w]++;
    return 1;
}
} // namespace
void setmaxnreg(unsigned n, int increase) {
    const unsigned w = B.cur / 128;
    if (n < 24 || n > 256 || n % 8 || B.n % 128) {
        fprintf(stderr, "cuda emulator: setmaxnreg %u in a block of %u threads (counts are multiples of 8 from 24 to "
                        "256; warpgroups of 128 threads)\n", n, B.n);
        abort();
    }
    if (B.wg_arrived[w] == 0) { B.wg_asked[w] = n; B.wg_increase[w] = increase; }
    else if (B.wg_asked[w] != n || B.wg_increase[w] != increase) {
        fprintf(stderr, "cuda emulator: the threads of warpgroup %u ask setmaxnreg.%s %u and .%s %u at once (all of a "
                        "warpgroup's threads run the same one)\n", w, B.wg_increase[w] ? "inc" : "dec", B.wg_asked[w],
                        increase ? "inc" : "dec", n);
        abort();
    }
    if (increase ? n < B.wg_regs[w] : n > B.wg_regs[w]) {
        fprintf(stderr, "cuda emulator: setmaxnreg.%s %u in a warpgroup holding %u registers a thread\n",
                increase ? "inc" : "dec", n, B.wg_regs[w]);
        abort();
    }
    const unsigned gen = B.wg_gen[w];
    B.wg_arrived[w]++;
    fiber &f = B.fibers[B.cur];
    for (int tries = 0;; tries++) {
        for (unsigned v = 0; v < B.wg_regs.size(); v++) apply_setmaxnreg(v);   /* a decrease may have made room */
        if (B.wg_gen[w] != gen) return;
        if (tries) f.stalled = 1;
        f.wait = SPIN;
        to_scheduler(f);
    }
}

/* ---- TMA: the emulator's tensor maps, mbarriers, tiled loads ---- */
namespace {
/* what cuTensorMapEncodeTiled keeps in a CUtensorMap's 128 opaque bytes here */
struct tensor_map {
    const unsigned char *base;
    uint64_t dims[4], strides[4];   /* strides in bytes; strides[0] = the element size */
    uint32_t box[4];
    int swizzle128, rank;
};
static_assert(sizeof(tensor_map) <= 128, "tensor_map fits a CUtensorMap");

mbar_state &mbar_of(void *bar) {
    auto it = B.mbars.find((uintptr_t)bar);
    if (it == B.mbars.end()) {
        fprintf(stderr, "cuda emulator: an mbarrier used before mbarrier.init\n");
        abort();
    }
    return it->second;
}

/* a phase completes when its arrivals and its bytes are all in */
void mbar_complete(mbar_state &m) {
    if (m.pending == 0 && m.tx == 0) {
        m.phase++;
        m.pending = m.count;
    }
}

/* the load's box into shared memory, its bytes counted on its barrier: element (i0, i1, i2, i3)
 * of the box at line ((i3 b2 + i2) b1 + i1) of b0 elements, its 16-byte chunks swizzled by the
 * line (128-byte swizzle); zeros for coordinates outside the tensor */
void land(const tma_op &op) {
    tensor_map m;
    memcpy(&m, op.map, sizeof m);
    const uint64_t es = m.strides[0], line = m.box[0] * es;
    unsigned char *dst = (unsigned char *)op.dst;
    uint64_t n = 0;
    for (uint32_t i3 = 0; i3 < m.box[3]; i3++)
        for (uint32_t i2 = 0; i2 < m.box[2]; i2++)
            for (uint32_t i1 = 0; i1 < m.box[1]; i1++, n++)
                for (uint32_t i0 = 0; i0 < m.box[0]; i0++) {
                    const int64_t c[4] = {(int64_t)op.c[0] + i0, (int64_t)op.c[1] + i1, (int64_t)op.c[2] + i2,
                                          (int64_t)op.c[3] + i3};
                    bool in = true;
                    uint64_t at = 0;
                    for (int d = 0; d < 4; d++) {
                        in = in && c[d] >= 0 && (uint64_t)c[d] < m.dims[d];
                        at += (uint64_t)(c[d] < 0 ? 0 : c[d]) * m.strides[d];
                    }
                    uint64_t byte = i0 * es, chunk = byte / 16;
                    if (m.swizzle128) chunk ^= n & 7;
                    unsigned char *to = dst + n * line + chunk * 16 + byte % 16;
                    if (in) memcpy(to, m.base + at, es);
                    else memset(to, 0, es);
                }
    mbar_state &mb = mbar_of(op.bar);
    mb.tx -= (int64_t)(n * line);   /* every box byte counts, in the tensor or not */
    mbar_complete(mb);
}
} // namespace

void mbar_init(void *bar, unsigned count) {
    if ((uintptr_t)bar % 8) { fprintf(stderr, "cuda emulator: an mbarrier not 8-byte aligned\n"); abort(); }
    B.mbars[(uintptr_t)bar] = mbar_state{count, count, 0, 0};
}
void mbar_expect_tx(void *bar, unsigned bytes) {
    mbar_state &m = mbar_of(bar);
    if (m.pending == 0) { fprintf(stderr, "cuda emulator: more arrivals on an mbarrier than its count\n"); abort(); }
    m.tx += bytes;
    m.pending--;
    mbar_complete(m);
}
void tma_load(void *dst, const void *map, int rank, int c0, int c1, int c2, int c3, void *bar) {
    tensor_map m;
    memcpy(&m, map, sizeof m);
    const unsigned char *d = (const unsigned char *)dst;
    if (!dyn_smem || d < dyn_smem || d >= dyn_smem + dyn_smem_bytes || (d - dyn_smem) % (m.swizzle128 ? 1024 : 128)) {
        fprintf(stderr, "cuda emulator: a TMA load's destination outside dynamic shared memory or not aligned (1024 "
                        "bytes with the 128-byte swizzle, else 128)\n");
        abort();
    }
    if (rank != m.rank) {
        fprintf(stderr, "cuda emulator: a %d-d TMA load of a rank-%d tensor map\n", rank, m.rank);
        abort();
    }
    mbar_of(bar);
    tma_op op;
    op.dst = dst;
    op.bar = bar;
    memcpy(op.map, map, sizeof op.map);
    op.c[0] = c0; op.c[1] = c1; op.c[2] = c2; op.c[3] = c3;
    if (B.eager_copies) land(op);   /* ULY_EMU_ASYNC=eager: landed at once */
    else B.tma.push_back(op);
}
void mbar_wait(void *bar, unsigned parity) {
    fiber &f = B.fibers[B.cur];
    for (int tries = 0;; tries++) {
        /* the loads on this barrier land now */
        std::vector<tma_op> left;
        for (const tma_op &op : B.tma) {
            if (op.bar != bar) left.push_back(op);
            else land(op);
        }
        B.tma.swap(left);
        if ((mbar_of(bar).phase & 1) != (parity & 1)) return;   /* the phase of this parity has completed */
        if (tries) f.stalled = 1;
        f.wait = SPIN;
        to_scheduler(f);
    }
}

/* cp.async: queued per thread, done when a wait covers its group (late, as the GPU may be: a
 * read of the tile before the wait sees the old bytes) */
static void queue_copy(void *dst, const void *src, int bytes, int valid) {
    if (B.eager_copies) {   /* ULY_EMU_ASYNC=eager: at once, as early as the GPU may land them */
        if (valid) memcpy(dst, src, (size_t)bytes);
        else memset(dst, 0, (size_t)bytes);
        return;
    }
    fiber &f = B.fibers[B.cur];
    f.copies.push_back(async_copy{dst, src, bytes, valid, f.commits});
}
void async_copy16(void *dst, const void *src, int valid) { queue_copy(dst, src, 16, valid); }
void async_copy4(void *dst, const void *src, int valid) { queue_copy(dst, src, 4, valid); }
void async_commit() { B.fibers[B.cur].commits++; }
void async_wait(unsigned in_flight) {
    fiber &f = B.fibers[B.cur];
    std::vector<async_copy> left;
    for (const async_copy &c : f.copies) {
        if (c.group + in_flight < f.commits) {   /* committed, and not among the newest in_flight groups */
            if (c.valid) memcpy(c.dst, c.src, (size_t)c.bytes);
            else memset(c.dst, 0, (size_t)c.bytes);
        } else {
            left.push_back(c);
        }
    }
    f.copies.swap(left);
}

/* ---- wgmma: B through a shared-memory descriptor, run when a wait covers it ---- */
uint32_t shared_offset(const void *p) {
    const unsigned char *c = (const unsigned char *)p;
    if (!dyn_smem || c < dyn_smem || c >= dyn_smem + dyn_smem_bytes) {
        fprintf(stderr, "cuda emulator: a wgmma operand outside the block's dynamic shared memory\n");
        abort();
    }
    return (uint32_t)(c - dyn_smem);
}

/* element (k, n) of the 16 x N bf16 tile a descriptor points at (PTX ISA, the warpgroup matrix
 * descriptor: start address, leading and stride byte offsets, each >> 4; bits 62-63 the
 * swizzle). 128-byte swizzle: lines of 128 bytes, the 16-byte chunk index XORed with the line's
 * index modulo 8 (address bits 4-6 ^= bits 7-9). K-major (trans 0): a line holds one n, k along
 * it; MN-major (trans 1): a line holds one k, n along it (n < 64: one atom); groups of 8 lines
 * `stride` bytes apart. The descriptor is decoded once per tile (b_tile), the elements read
 * through it (b_bits). */
struct b_tile { uint32_t start, sbo; int trans; };
static b_tile b_decode(uint64_t desc, int trans) {
    unsigned swz = (unsigned)(desc >> 62);
    if (swz != 1) { fprintf(stderr, "cuda emulator: wgmma descriptor swizzle %u (only 128-byte is emulated)\n", swz); abort(); }
    return b_tile{(uint32_t)(desc & 0x3fff) << 4, (uint32_t)((desc >> 32) & 0x3fff) << 4, trans};
}
static inline uint16_t b_bits(const b_tile &t, int k, int n) {
    if (t.trans && n >= 64) { fprintf(stderr, "cuda emulator: MN-major wgmma B wider than one 128-byte atom\n"); abort(); }
    int line = t.trans ? k : n, along = t.trans ? n : k;
    uint32_t addr = t.start + (uint32_t)(line / 8) * t.sbo + (uint32_t)(line % 8) * 128 + (uint32_t)along * 2;
    addr ^= ((addr >> 7) & 7) << 4;
    if (addr + 2 > dyn_smem_bytes) { fprintf(stderr, "cuda emulator: wgmma B read past shared memory\n"); abort(); }
    uint16_t bits;
    memcpy(&bits, dyn_smem + addr, 2);
    return bits;
}
static inline float bf16_bits_to_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* the B elements (k, column) this thread's accumulators take, in a fixed order (wgmma_wait's) */
template <typename F>
static void each_b_of_thread(int n, F fn) {
    unsigned t = B.cur & 3;
    for (int j = 0; j < n / 8; j++)
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 16; k++) fn(k, 8 * j + 2 * (int)t + h);
}

/* queued, with this thread's rows of A (g and g + 8 of its warp's 16); B is read now and again at
 * the wait, which must find the same bytes: a tile written after the issue (not yet landed, no
 * fence) or overwritten before the wait is an error */
static wgmma_op &queue_rows(float *d, int n, const float rows[2][16], uint64_t desc, int trans) {
    fiber &f = B.fibers[B.cur];
    wgmma_op op;
    op.d = d; op.n = n; op.trans = trans; op.desc = desc; op.group = f.wg_commits;
    op.a_shared = false; op.desc_a = 0; op.trans_a = 0; op.accumulate = true;
    memcpy(op.a, rows, sizeof op.a);
    op.b_at_issue.resize((size_t)n * 4);
    const b_tile b = b_decode(desc, trans);
    uint16_t *bits = op.b_at_issue.data();
    each_b_of_thread(n, [&](int k, int c) { *bits++ = b_bits(b, k, c); });
    f.wgmmas.push_back(std::move(op));
    return f.wgmmas.back();
}
void wgmma_queue(float *d, int n, const float *a16x16, uint64_t desc, int trans) {
    const unsigned g = (B.cur & 31) >> 2;
    float rows[2][16];
    memcpy(rows[0], a16x16 + 16 * g, sizeof rows[0]);
    memcpy(rows[1], a16x16 + 16 * (g + 8), sizeof rows[1]);
    queue_rows(d, n, rows, desc, trans);
}
/* the rows of a 64 x 16 A tile this thread's accumulators take (its warp's rows g and g + 8):
 * laid out as a B with its rows as n, K-major or (trans_a) MN-major. The warp's lanes together
 * read all of its 16 rows, so a row changed between issue and wait is seen by some lane. */
static void wgmma_a_rows(uint64_t desc_a, int trans_a, float a[2][16]) {
    const int w = (int)((B.cur >> 5) & 3), g = (int)((B.cur & 31) >> 2);
    const b_tile t = b_decode(desc_a, trans_a);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 16; k++) a[h][k] = bf16_bits_to_float(b_bits(t, k, 16 * w + g + 8 * h));
}
void wgmma_queue_ss(float *d, int n, uint64_t desc_a, uint64_t desc_b, int trans_b, int accumulate, int trans_a) {
    float rows[2][16];
    wgmma_a_rows(desc_a, trans_a, rows);
    wgmma_op &op = queue_rows(d, n, rows, desc_b, trans_b);
    op.a_shared = true;
    op.desc_a = desc_a;
    op.trans_a = trans_a;
    op.accumulate = accumulate != 0;
}
void wgmma_commit() { B.fibers[B.cur].wg_commits++; }

void wgmma_wait(unsigned in_flight) {
    fiber &f = B.fibers[B.cur];
    if (B.eager_copies) {
        /* ULY_EMU_ASYNC=eager: the other threads run first (a wgmma takes time), so that a buffer
         * given back before the wait (an mbarrier arrival, then a TMA load landing at once) is
         * overwritten under it, which the check below sees */
        bool completes = false;
        for (const wgmma_op &op : f.wgmmas) completes |= op.group + in_flight < f.wg_commits;
        if (completes) {
            f.wait = SPIN;
            to_scheduler(f);
        }
    }
    std::vector<wgmma_op> left;
    for (wgmma_op &op : f.wgmmas) {
        if (op.group + in_flight >= f.wg_commits) { left.push_back(std::move(op)); continue; }
        if (op.a_shared) {
            float a[2][16];
            wgmma_a_rows(op.desc_a, op.trans_a, a);
            if (memcmp(a, op.a, sizeof a)) {
                fprintf(stderr, "cuda emulator: a wgmma's A tile changed between its issue and its wait (written after "
                                "the issue, or overwritten before wgmma.wait_group)\n");
                abort();
            }
        }
        const b_tile b = b_decode(op.desc, op.trans);
        const uint16_t *issued = op.b_at_issue.data();
        bool same = true;
        each_b_of_thread(op.n, [&](int k, int c) { same &= b_bits(b, k, c) == *issued++; });
        if (!same) {
            fprintf(stderr, "cuda emulator: a wgmma's B tile changed between its issue and its wait (written after "
                            "the issue, or overwritten before wgmma.wait_group)\n");
            abort();
        }
        /* B as read (and checked) above: b_at_issue[32 j + 16 h + k] is (k, 8 j + 2 t + h) */
        for (int j = 0; j < op.n / 8; j++)
            for (int i = 0; i < 4; i++) {
                const float *row = op.a[i >> 1];   /* row g + 8 (i >> 1) */
                const uint16_t *col = &op.b_at_issue[32 * (size_t)j + 16 * (size_t)(i & 1)];
                float s = 0.0f;
                for (int k = 0; k < 16; k++) s += row[k] * bf16_bits_to_float(col[k]);
                op.d[4 * j + i] = op.accumulate ? op.d[4 * j + i] + s : s;
            }
    }
    f.wgmmas.swap(left);
}

uint64_t shuffle_xor(uint64_t bits, int lane_mask) {
    unsigned me = B.cur, w = me >> 5, lane = me & 31, other = (lane ^ (unsigned)lane_mask) & 31;
    B.slots[w * 32 + lane] = bits;
    wait_at(WARP);                     /* every lane has written */
    uint64_t got = (w * 32 + other < B.n) ? B.slots[w * 32 + other] : bits;
    wait_at(WARP);                     /* every lane has read before the slots are reused */
    return got;
}
void warp_gather(const void *mine, size_t bytes, void *all) {
    if (bytes > 64) { fprintf(stderr, "cuda emulator: warp_gather of %zu bytes per lane\n", bytes); abort(); }
    unsigned me = B.cur, w = me >> 5, lane = me & 31;
    if (B.warp_alive[w] != 32 || (w + 1) * 32 > B.n) {
        fprintf(stderr, "cuda emulator: a warp-collective instruction (mma/ldmatrix) needs all 32 lanes\n");
        abort();
    }
    memcpy(&B.gathered[((size_t)w * 32 + lane) * 64], mine, bytes);
    wait_at(WARP);                     /* every lane has written */
    for (unsigned l = 0; l < 32; l++) memcpy((char *)all + l * bytes, &B.gathered[((size_t)w * 32 + l) * 64], bytes);
    wait_at(WARP);                     /* every lane has read */
}
} // namespace uly_emu

/* ---------------------------------------------------------------- runtime */
static cudaError_t last = cudaSuccess;
static size_t in_use;

static size_t emu_total(void) {
    const char *e = getenv("ULY_EMU_MEMORY");
    return (e && atoll(e) > 0) ? (size_t)atoll(e) : ((size_t)4 << 30);
}

static cudaError_t fail(cudaError_t e) { last = e; return e; }

static std::map<const void *, int> smem_allowed;   /* by kernel: cudaFuncSetAttribute's dynamic shared memory */
void uly_emu::allow_dynamic_smem(const void *kernel, int bytes) { smem_allowed[kernel] = bytes; }
int uly_emu::launch_refused(const void *kernel, size_t smem) {
    if (smem <= 48 * 1024) return 0;
    auto it = smem_allowed.find(kernel);
    if (it != smem_allowed.end() && smem <= (size_t)it->second) return 0;
    last = cudaErrorInvalidValue;   /* as a GPU answers a launch over its kernel's allowance */
    return 1;
}

cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int dev) {
    if (dev != 0) return fail(cudaErrorInvalidValue);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "ulysses CUDA emulator");
    for (int i = 0; i < 16; i++) prop->uuid.bytes[i] = (unsigned char)(0xe0 + i);
    const char *own = getenv("ULY_EMU_GPUS");   /* "own": every process its own device (else ranks share one) */
    if (own && !strcmp(own, "own")) {
        unsigned pid = (unsigned)getpid();
        memcpy(prop->uuid.bytes, &pid, sizeof pid);
    }
    prop->totalGlobalMem = emu_total();
    prop->major = 9;
    return cudaSuccess;
}
/* 132 multiprocessors; compute capability ULY_EMU_CC (default 8.0: the kernels' mma.sync paths;
 * 9.0 sends the fused attention forward through its wgmma self-check) */
/* cuTensorMapEncodeTiled as the emulator keeps it (uly_emu's tensor_map in the opaque bytes), bf16
 * or f32, with the driver's checks that matter here: rank 1 to 4 (5 on a GPU), 16-byte aligned base and
 * strides, boxes of 1 to 256, and with the 128-byte swizzle an inner box of at most 128 bytes */
static CUresult emu_encode_tiled(CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank, void *base,
                                 const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                                 const cuuint32_t *element_strides, CUtensorMapInterleave interleave,
                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
    uly_emu::tensor_map m;
    const unsigned es = type == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ? 2 : type == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ? 4 : 0;
    if (!map || !es || rank < 1 || rank > 4 || ((uintptr_t)base & 15) ||
        interleave != CU_TENSOR_MAP_INTERLEAVE_NONE || (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && swizzle != CU_TENSOR_MAP_SWIZZLE_128B))
        return CUDA_ERROR_INVALID_VALUE;
    memset(&m, 0, sizeof m);
    m.base = (const unsigned char *)base;
    m.rank = (int)rank;
    m.swizzle128 = swizzle == CU_TENSOR_MAP_SWIZZLE_128B;
    m.strides[0] = es;
    for (cuuint32_t d = 0; d < 4; d++) {
        m.dims[d] = d < rank ? dims[d] : 1;
        m.box[d] = d < rank ? box[d] : 1;
        if (d > 0) m.strides[d] = d < rank ? strides[d - 1] : 0;
        if (m.box[d] < 1 || m.box[d] > 256 || (d < rank && element_strides[d] != 1) || (d > 0 && d < rank && strides[d - 1] % 16))
            return CUDA_ERROR_INVALID_VALUE;
    }
    if ((m.box[0] * es) % 16 || (m.swizzle128 && m.box[0] * es > 128)) return CUDA_ERROR_INVALID_VALUE;
    memset(map, 0, sizeof *map);
    memcpy(map, &m, sizeof m);
    return CUDA_SUCCESS;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned, unsigned long long,
                                             cudaDriverEntryPointQueryResult *status) {
    const bool found = symbol && !strcmp(symbol, "cuTensorMapEncodeTiled");
    *fn = found ? (void *)emu_encode_tiled : NULL;
    if (status) *status = found ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev) {
    if (dev != 0) return fail(cudaErrorInvalidValue);
    const char *cc = getenv("ULY_EMU_CC");
    int major = 8, minor = 0;
    if (cc && sscanf(cc, "%d.%d", &major, &minor) < 1) major = 8;
    switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = 132; return cudaSuccess;
    case cudaDevAttrClockRate: *value = 1830000; return cudaSuccess;   /* kHz: an H100 SXM's at its 989 TFLOP/s */
    case cudaDevAttrComputeCapabilityMajor: *value = major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = minor; return cudaSuccess;
    default: return fail(cudaErrorInvalidValue);
    }
}
cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : fail(cudaErrorInvalidValue); }
cudaError_t cudaGetDevice(int *dev) { *dev = 0; return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    *total_b = emu_total();
    *free_b = *total_b > in_use ? *total_b - in_use : 0;
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t bytes) {
    if (in_use + bytes > emu_total()) return fail(cudaErrorMemoryAllocation);
    void *q = NULL;
    if (posix_memalign(&q, 256, bytes + 256)) return fail(cudaErrorMemoryAllocation);
    ((size_t *)q)[0] = bytes;
    ((size_t *)q)[1] = 0;   /* 1: from the stream-ordered pool */
    in_use += bytes;
    *p = (char *)q + 256;
    return cudaSuccess;
}
/* the allocation's memory back to the host at once (cudaFree waits for the device first) */
void uly_emu_release(void *p) {
    char *q = (char *)p - 256;
    in_use -= *(size_t *)q;
    free(q);
}
cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    uly_emu::drain_all();
    uly_emu_release(p);
    return cudaSuccess;
}
/* stream-ordered allocations: device memory as any other, also counted as the pool's use */
static uint64_t async_used, async_high;
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t) {
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) return e;
    ((size_t *)((char *)*p - 256))[1] = 1;   /* from the pool */
    async_used += bytes;
    if (async_used > async_high) async_high = async_used;
    return cudaSuccess;
}
/* the pool may hand the bytes out again to later work at once (stream order); the memory itself
 * goes when the stream reaches the free, so work queued before it still reads valid bytes */
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
    if (!p) return cudaSuccess;
    size_t *head = (size_t *)((char *)p - 256);
    if (head[1]) async_used -= head[0];
    uly_emu::submit(s, [p]() { uly_emu_release(p); });
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { cudaError_t e = last; last = cudaSuccess; return e; }
const char *cudaGetErrorName(cudaError_t e) {
    return e == cudaSuccess ? "cudaSuccess" : e == cudaErrorMemoryAllocation ? "cudaErrorMemoryAllocation"
         : e == cudaErrorInvalidValue ? "cudaErrorInvalidValue" : "cudaErrorNoDevice";
}
const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess ? "no error" : e == cudaErrorMemoryAllocation ? "out of memory (emulated device)"
         : e == cudaErrorInvalidValue ? "invalid argument" : "no CUDA-capable device is detected";
}
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return cudaSuccess; }

/* the default memory pool: nothing to keep or trim (cudaMallocAsync is cudaMalloc), its use counted */
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int dev) {
    if (dev != 0) return fail(cudaErrorInvalidValue);
    *pool = (cudaMemPool_t)1;
    return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr attr, void *value) {
    if (attr == cudaMemPoolAttrUsedMemHigh) async_high = *(uint64_t *)value ? async_high : async_used;
    return cudaSuccess;
}
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, cudaMemPoolAttr attr, void *value) {
    if (attr == cudaMemPoolAttrUsedMemHigh) *(uint64_t *)value = async_high;
    else if (attr == cudaMemPoolAttrUsedMemCurrent) *(uint64_t *)value = async_used;
    else return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t) { return cudaSuccess; }

/* ---------------------------------------------------------------- cuBLAS */
struct uly_emu_cublas { cudaStream_t stream; };
cublasStatus_t cublasCreate(cublasHandle_t *h) { *h = new uly_emu_cublas{NULL}; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }

/* x rounded to TF32: 10 explicit mantissa bits, to nearest (ties away from zero) */
static float to_tf32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;   /* not inf or nan */
    memcpy(&x, &u, 4);
    return x;
}

static float element(const void *p, cudaDataType_t t, long long i, bool tf32) {
    if (t == CUDA_R_16BF) { __nv_bfloat16 b = ((const __nv_bfloat16 *)p)[i]; return __bfloat162float(b); }
    return tf32 ? to_tf32(((const float *)p)[i]) : ((const float *)p)[i];
}

/* column-major C = alpha op(A) op(B) + beta C (+ bias), f32 accumulation in index order */
void uly_emu::gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, const void *A,
                  cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb, float beta, void *C,
                  cudaDataType_t ct, int ldc, bool tf32, const float *bias) {
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int l = 0; l < k; l++) {
                float a = ta == CUBLAS_OP_N ? element(A, at, i + (long long)l * lda, tf32)
                                            : element(A, at, l + (long long)i * lda, tf32);
                float b = tb == CUBLAS_OP_N ? element(B, bt, l + (long long)j * ldb, tf32)
                                            : element(B, bt, j + (long long)l * ldb, tf32);
                s += a * b;
            }
            const long long at_c = i + (long long)j * ldc;
            float v = alpha * s + (beta == 0.0f ? 0.0f : beta * element(C, ct, at_c, false));
            if (bias) v += bias[i];
            if (ct == CUDA_R_16BF) ((__nv_bfloat16 *)C)[at_c] = __float2bfloat16_rn(v);
            else ((float *)C)[at_c] = v;
        }
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType_t at, int lda, const void *B, cudaDataType_t bt,
                            int ldb, const void *beta, void *C, cudaDataType_t ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
    if (ct != CUDA_R_32F && ct != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
    float al = *(const float *)alpha, be = *(const float *)beta;   /* host scalars: read at the call */
    const bool tf32 = compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    uly_emu::submit(h->stream, [=]() { uly_emu::gemm(ta, tb, m, n, k, al, A, at, lda, B, bt, ldb, be, C, ct, ldc, tf32); });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType_t at, int lda,
                                          long long sa, const void *B, cudaDataType_t bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType_t ct, int ldc, long long sc, int batches,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    size_t ea = at == CUDA_R_16BF ? 2 : 4, eb = bt == CUDA_R_16BF ? 2 : 4;
    for (int i = 0; i < batches; i++) {
        cublasStatus_t s = cublasGemmEx(h, ta, tb, m, n, k, alpha, (const char *)A + i * sa * ea, at, lda,
                                        (const char *)B + i * sb * eb, bt, ldb, beta,
                                        (char *)C + i * sc * (ct == CUDA_R_16BF ? 2 : 4), ct, ldc,
                                        compute, algo);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}
