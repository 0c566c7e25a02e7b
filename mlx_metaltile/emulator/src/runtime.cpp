// runtime.cpp: the emulator's execution engine, built once into a shared library.
//
// One launch = a grid of threadgroups. Threadgroups are claimed by a few worker threads; the
// threads of one threadgroup run on one worker, either
//   * plainly, one after the other inside a single "runner" fiber (no switches), which is how
//     every launch starts, or
//   * as one fiber per thread, switched cooperatively at barriers and SIMD collectives, once
//     a kernel has been seen to call one (the plain attempt is abandoned and the launch redone).
//
// Device buffers live in a reserved address range, one large slot per buffer (the rest of
// the slot is unmapped), and every load and store of kernel code is reported here by the
// compiler's thread-sanitizer instrumentation (__tsan_read4, ...): that gives bounds checks,
// per-buffer byte counters and, for threadgroup memory, the uninitialised-read check.
// This file itself is compiled without instrumentation.

#include "mt_emu/abi.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int kSimd = 32;
constexpr int kMaxBuffers = 64;
constexpr int kMaxWorkers = 16;
constexpr int kMaxRas = 16;
constexpr int kMaxPath = 32;               // call-path depth kept per waiting thread
constexpr size_t kTgLimit = 32 * 1024;     // Metal's threadgroup memory limit
constexpr size_t kTgSlotMap = 512 * 1024;  // mapped part of a worker's threadgroup slot
constexpr size_t kRedzone = 64;            // gap between threadgroup arrays (catches overruns)
constexpr size_t kAltStack = 64 * 1024;

// ---- the C structures shared with Python (ctypes mirrors them) ----------------------------

struct BufDesc {
  const char* name;
  const void* src;     // bytes to copy in (inputs), or null
  void* dst;           // where to copy the result (outputs), or null
  uint64_t span;       // bytes of the region the kernel may touch
  int64_t data_off;    // offset of element 0 within the region (negative strides)
  uint32_t elem_size;
  int32_t init_kind;   // 0 copy src, 1 poison (0xFF bytes), 2 repeat `pattern`
  uint8_t pattern[16];
};

struct LaunchDesc {
  mt_thread_fn fn;
  const char* kernel;
  int32_t nbuf;
  const BufDesc* bufs;
  uint32_t grid[3];
  uint32_t tg[3];
  int32_t strict;
  int32_t shuffle;       // permute fiber and threadgroup order
  uint64_t seed;
  int32_t force_fibers;  // skip the plain attempt
  int32_t nworkers;
  uint64_t stack_size;
  double timeout_s;  // 0: no limit
  // Call-site identities of the kernel module's code (from its debug information): code
  // offset site_starts[k] up to site_starts[k + 1] has identity site_ids[k]. site_state 0:
  // not read yet (a launch that needs them stops with status 3), 1: read, 2: unreadable.
  const uint64_t* site_starts;
  const uint32_t* site_ids;
  int64_t nsites;
  int32_t site_state;
};

struct LaunchResult {
  int32_t status;  // 0 ok, 1 hazard, 2 emulator error, 3 needs the call-site identities
  int32_t hazard_kind;
  char message[4096];
  uint64_t ras[kMaxRas];  // code addresses the message may name as "@RA<k>"
  int32_t nras;
  int32_t has_thread;
  uint32_t threadgroup[3];
  uint32_t thread[3];     // position in threadgroup
  uint32_t thread_index;  // linear index in threadgroup
  uint64_t fault_ra;      // the faulting code address (the source line of the hazard)
  uint64_t bytes_read[kMaxBuffers];
  uint64_t bytes_written[kMaxBuffers];
  uint64_t threadgroups;
  uint64_t threads;
  uint64_t threadgroup_barriers;
  uint64_t simdgroup_barriers;
  uint64_t simd_collectives;
  uint64_t fiber_switches;
  uint64_t threadgroup_memory;
  int32_t used_fibers;
  int32_t used_site_ids;  // call paths were told apart with the call-site identities
};

// ---- fibers ---------------------------------------------------------------------------------

enum FiberState { RUNNABLE, BLOCK_COLL, BLOCK_TGB, BLOCK_SGB, DONE };

struct Worker;

struct Fiber {
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  char* map = nullptr;  // guard page + stack
  size_t map_size = 0;
  char* lo = nullptr;   // usable stack [lo, hi)
  char* hi = nullptr;
  int state = DONE;
  mt_coll* coll = nullptr;
  mt_site site = {nullptr, 0, 0};  // source position of the barrier / collective it waits at
  uintptr_t site_ra = 0;            // code address of that call (for the hazard's location)
  // The call path to that call: return addresses in the kernel module, innermost first
  // (path[0] == site_ra), up to the kernel's entry; and their call-site identities (filled
  // when needed).
  uintptr_t path[kMaxPath];
  int npath = 0;
  bool canon_ok = false;
  uint64_t canon[kMaxPath];
  mt_ids ids;
  Worker* w = nullptr;
  bool runner = false;
};

#if defined(__x86_64__)
// Callee-saved registers, MXCSR and the x87 control word are saved on the stack.
extern "C" void mt_switch(void** save_sp, void* new_sp);
extern "C" void mt_fiber_trampoline();
asm(R"(
  .text
  .globl mt_switch
  .hidden mt_switch
  .type mt_switch,@function
mt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mt_switch,.-mt_switch

  .globl mt_fiber_trampoline
  .hidden mt_fiber_trampoline
  .type mt_fiber_trampoline,@function
mt_fiber_trampoline:
  movq %r12, %rdi
  call mt_fiber_main
  ud2
  .size mt_fiber_trampoline,.-mt_fiber_trampoline
)");
#endif

// ---- launch state ---------------------------------------------------------------------------

struct Launch {
  const LaunchDesc* d = nullptr;
  LaunchResult* r = nullptr;
  int nbuf = 0;
  char* region[kMaxBuffers] = {};
  uint64_t span[kMaxBuffers] = {};
  void* args[kMaxBuffers] = {};
  uint32_t tgdim[3] = {1, 1, 1};  // threadgroup size after clamping to the grid
  uint32_t ntg[3] = {0, 0, 0};
  uint64_t total_tg = 0;
  std::vector<uint64_t> order;  // threadgroup order (permuted with shuffle)
  std::atomic<uint64_t> next{0};
  std::atomic<bool> abort{false};
  std::atomic<bool> need_fibers{false};
  std::atomic<bool> timed_out{false};  // set by the watchdog
  // The kernel module's code (the watchdog's signal interrupts a thread looping there).
  uintptr_t code_lo = 0, code_hi = 0, code_base = 0;
  // Two threads waited at one call through different return addresses and the call-site
  // identities are not loaded: the launch stops and is redone with them (status 3).
  std::atomic<bool> need_sites{false};
  std::atomic<bool> used_sites{false};
  // Worker threads still inside worker_main (the watchdog signals only those).
  std::mutex alive_mu;
  bool alive[kMaxWorkers] = {};
  pthread_t handles[kMaxWorkers] = {};
  bool fibers = false;
  int strict = 0;
  std::mutex mu;
  bool hazard = false;
};

// Strict mode's race detector: per byte of threadgroup memory, the last writer and the last
// reader (thread, barrier epoch, SIMD-group epoch, code address).
struct RaceShadow {
  uint16_t* w_thread = nullptr;
  uint32_t* w_epoch = nullptr;
  uint32_t* w_sg = nullptr;
  uintptr_t* w_ra = nullptr;
  uint16_t* r_thread = nullptr;
  uint32_t* r_epoch = nullptr;
  uint32_t* r_sg = nullptr;
};
constexpr uint16_t kNoThread = 0xFFFF;

struct Worker {
  int index = 0;
  Launch* L = nullptr;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  Fiber* cur = nullptr;
  const mt_ids* cur_ids = nullptr;
  std::vector<Fiber> fibers;  // one per thread of a threadgroup (fiber mode)
  Fiber runner;
  size_t stack_size = 0;
  // threadgroup memory of the current threadgroup
  char* tg_base = nullptr;
  uint8_t* shadow = nullptr;  // 0 not addressable, 1 allocated, 2 written (strict mode)
  size_t tg_end = 0;          // end of the last allocation
  size_t tg_declared = 0;     // bytes declared (each rounded to 16), against the limit
  std::vector<std::pair<int, void*>> tg_slots;
  RaceShadow race;
  uint32_t tg_epoch = 1;             // threadgroup barriers released in this threadgroup, + 1
  uint32_t sg_epoch[1024 / 32] = {};  // simdgroup (and threadgroup) barriers, per SIMD-group
  // counters
  uint64_t rd[kMaxBuffers] = {};
  uint64_t wr[kMaxBuffers] = {};
  uint64_t tgb = 0, sgb = 0, coll = 0, switches = 0, tg_peak = 0, tgs = 0, threads = 0;
  char* altstack = nullptr;
  // call-site identities looked up in this launch (direct-mapped by return address)
  struct SiteMemo {
    uintptr_t ra;
    uint64_t id;
  } site_memo[256];
};

std::mutex g_launch_mu;  // one launch at a time per process
char* g_arena = nullptr;
uint64_t g_arena_bytes = 0;
int g_shift = 0;         // log2 of the slot size
uint64_t g_slot = 0;
Worker g_workers[kMaxWorkers];
bool g_tg_mapped[kMaxWorkers] = {};
__attribute__((tls_model("initial-exec"))) thread_local Worker* tl_w = nullptr;

inline char* slot_base(int slot) { return g_arena + (uint64_t(slot) << g_shift); }
// Slot 0 is a guard; buffers use slots 1..kMaxBuffers; worker threadgroup memory follows.
inline int buf_slot(int i) { return 1 + i; }
inline int tg_slot(int worker) { return 1 + kMaxBuffers + worker; }

bool reserve_arena(char* err, size_t n) {
  if (g_arena) return true;
  const int nslots = 1 + kMaxBuffers + kMaxWorkers + 1;
  // 64 GiB slots: a 32-bit index that wrapped around (uint(-1) * 4 or 8 bytes) stays in
  // the lower half of its own buffer's slot and is reported on the right buffer.
  for (int shift : {36, 34, 32, 30, 28}) {
    uint64_t bytes = uint64_t(nslots) << shift;
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) {
      g_arena = static_cast<char*>(p);
      g_arena_bytes = bytes;
      g_shift = shift;
      g_slot = uint64_t(1) << shift;
      return true;
    }
  }
  snprintf(err, n, "cannot reserve address space for device buffers: %s", strerror(errno));
  return false;
}

size_t page_round(size_t x) {
  size_t pg = size_t(sysconf(_SC_PAGESIZE));
  return (x + pg - 1) / pg * pg;
}

bool map_rw(char* at, size_t bytes) {
  if (bytes == 0) return true;
  void* p = mmap(at, page_round(bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  return p == at;
}

void unmap_to_guard(char* at, size_t bytes) {
  if (bytes == 0) return;
  mmap(at, page_round(bytes), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
       -1, 0);
}

// ---- hazards ----------------------------------------------------------------------------------

void escape(Worker* w);

// Record the first hazard of the launch. `ras` are code addresses the message names as @RA<k>.
void record_hazard(Worker* w, int kind, uintptr_t fault_ra, const uintptr_t* ras, int nras,
                   const char* fmt, ...) __attribute__((format(printf, 6, 7)));
void record_hazard(Worker* w, int kind, uintptr_t fault_ra, const uintptr_t* ras, int nras,
                   const char* fmt, ...) {
  Launch* L = w->L;
  std::lock_guard<std::mutex> lock(L->mu);
  L->abort.store(true);
  if (L->hazard || L->need_sites.load()) return;  // (a launch to be redone reports nothing)
  L->hazard = true;
  LaunchResult* r = L->r;
  r->status = 1;
  r->hazard_kind = kind;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->message, sizeof r->message, fmt, ap);
  va_end(ap);
  r->fault_ra = fault_ra;
  r->nras = std::min(nras, kMaxRas);
  for (int i = 0; i < r->nras; ++i) r->ras[i] = ras[i];
  const mt_ids* ids = w->cur_ids;
  if (ids) {
    r->has_thread = 1;
    for (int k = 0; k < 3; ++k) {
      r->threadgroup[k] = ids->threadgroup_position_in_grid[k];
      r->thread[k] = ids->thread_position_in_threadgroup[k];
    }
    r->thread_index = ids->thread_index_in_threadgroup;
  }
}

// Leave the faulting fiber for good: back to the worker's scheduler.
void escape(Worker* w) {
  Fiber* f = w->cur;
  if (!f) return;  // on the scheduler: the caller checks L->abort
#if defined(__x86_64__)
  mt_switch(&f->sp, w->sched_sp);
#else
  swapcontext(&f->uc, &w->sched_uc);
#endif
  __builtin_unreachable();
}

// ---- memory access checks (called by the instrumentation) -----------------------------------

__attribute__((noinline, cold)) void access_fault(Worker* w, uintptr_t a, size_t n, bool write,
                                                  uintptr_t ra) {
  Launch* L = w->L;
  uint64_t off = a - uintptr_t(g_arena);
  int slot = int(off >> g_shift);
  int64_t so = int64_t(off & (g_slot - 1));
  // An address in the upper half of a slot is a negative offset of the next slot's buffer.
  if (uint64_t(so) > g_slot / 2) {
    slot += 1;
    so -= int64_t(g_slot);
  }
  const char* verb = write ? "write" : "read";
  if (slot >= 1 && slot <= L->nbuf) {
    int i = slot - 1;
    const BufDesc& b = L->d->bufs[i];
    int64_t rel = so - b.data_off;  // bytes from element 0
    int64_t es = b.elem_size ? b.elem_size : 1;
    record_hazard(w, MT_HZ_OUT_OF_BOUNDS, ra, nullptr, 0,
                  "out-of-bounds %s of %zu bytes on buffer '%s': byte offset %lld "
                  "(element %lld of %u-byte elements); the buffer holds %llu bytes",
                  verb, n, b.name, (long long)rel, (long long)(rel >= 0 ? rel / es : -((-rel + es - 1) / es)),
                  unsigned(es), (unsigned long long)L->span[i]);
  } else if (slot == tg_slot(w->index)) {
    record_hazard(w, MT_HZ_OUT_OF_BOUNDS, ra, nullptr, 0,
                  "out-of-bounds %s of %zu bytes in threadgroup memory at offset %lld: outside "
                  "every threadgroup array (%zu bytes declared)",
                  verb, n, (long long)so, w->tg_declared);
  } else {
    record_hazard(w, MT_HZ_OUT_OF_BOUNDS, ra, nullptr, 0,
                  "wild %s of %zu bytes at %p: not inside any buffer of this launch", verb, n,
                  reinterpret_cast<void*>(a));
  }
  escape(w);
}

__attribute__((noinline, cold)) void uninit_read(Worker* w, uintptr_t a, size_t n, uintptr_t ra) {
  size_t so = a - uintptr_t(w->tg_base);
  record_hazard(w, MT_HZ_UNINITIALIZED_READ, ra, nullptr, 0,
                "strict mode: read of %zu bytes of threadgroup memory at offset %zu that no "
                "thread of this threadgroup has written",
                n, so);
  escape(w);
}

__attribute__((noinline, cold)) void timeout_fault(Worker* w, uintptr_t ra) {
  record_hazard(w, MT_HZ_TIMEOUT, ra, nullptr, 0,
                "the launch ran for more than %g s: an endless loop, or threads spin-waiting "
                "on each other (a GPU gives no such guarantee either; here the threads of a "
                "threadgroup take turns). Raise the limit with "
                "MLX_METALTILE_EMULATOR_TIMEOUT_S if the kernel is just slow",
                w->L->d->timeout_s);
  escape(w);
}

__attribute__((noinline, cold)) void race_fault(Worker* w, size_t so, uint32_t other,
                                                uintptr_t other_ra, const char* what,
                                                uintptr_t ra) {
  uintptr_t ras[1] = {other_ra};
  record_hazard(w, MT_HZ_RACE, ra, ras, other_ra ? 1 : 0,
                "strict mode: data race on threadgroup memory at offset %zu: %s thread %u "
                "(index in threadgroup; its access at @RA0) with no threadgroup_barrier in "
                "between, so the order is undefined on a GPU",
                so, what, other);
  escape(w);
}

// Strict mode, one threadgroup byte: uninitialised reads and races between threads.
inline void strict_check(Worker* w, size_t idx, uint8_t* sh, bool write, bool atomic,
                         uintptr_t ra, uintptr_t a, size_t n) {
  const uint32_t t = w->cur_ids ? w->cur_ids->thread_index_in_threadgroup : 0;
  const uint32_t g = t / 32;
  RaceShadow& R = w->race;
  auto synced = [&](uint16_t other, uint32_t other_sg) {
    // a simdgroup_barrier since then orders accesses within one SIMD-group
    return other / 32u == g && w->sg_epoch[g] != other_sg;
  };
  if (write) {
    if (!atomic) {
      uint16_t wt = R.w_thread[idx];
      if (wt != kNoThread && wt != t && R.w_epoch[idx] == w->tg_epoch && !synced(wt, R.w_sg[idx]))
        race_fault(w, idx, wt, R.w_ra[idx], "this thread writes a byte also written by", ra);
      uint16_t rt = R.r_thread[idx];
      if (rt != kNoThread && rt != t && R.r_epoch[idx] == w->tg_epoch && !synced(rt, R.r_sg[idx]))
        race_fault(w, idx, rt, 0, "this thread writes a byte read by", ra);
    }
    *sh = 2;
    R.w_thread[idx] = atomic ? kNoThread : uint16_t(t);
    R.w_epoch[idx] = w->tg_epoch;
    R.w_sg[idx] = w->sg_epoch[g];
    R.w_ra[idx] = ra;
  } else {
    if (*sh != 2) uninit_read(w, a, n, ra);
    uint16_t wt = R.w_thread[idx];
    if (!atomic && wt != kNoThread && wt != t && R.w_epoch[idx] == w->tg_epoch &&
        !synced(wt, R.w_sg[idx]))
      race_fault(w, idx, wt, R.w_ra[idx], "this thread reads a byte written by", ra);
    if (!atomic) {
      R.r_thread[idx] = uint16_t(t);
      R.r_epoch[idx] = w->tg_epoch;
      R.r_sg[idx] = w->sg_epoch[g];
    }
  }
}

inline __attribute__((always_inline)) void on_access(uintptr_t a, size_t n, bool write,
                                                      uintptr_t ra, bool atomic = false) {
  Worker* w = tl_w;
  if (__builtin_expect(w == nullptr, 0)) return;
  Launch* L = w->L;
  if (__builtin_expect(L->timed_out.load(std::memory_order_relaxed), 0)) timeout_fault(w, ra);
  uint64_t off = a - uintptr_t(g_arena);
  if (off >= g_arena_bytes) return;  // stack, globals: not ours to check
  int slot = int(off >> g_shift);
  uint64_t so = off & (g_slot - 1);
  if (slot >= 1 && slot <= L->nbuf) {
    int i = slot - 1;
    if (__builtin_expect(so + n > L->span[i], 0)) access_fault(w, a, n, write, ra);
    (write ? w->wr : w->rd)[i] += n;
    return;
  }
  if (slot == tg_slot(w->index)) {
    if (__builtin_expect(so + n > w->tg_end, 0)) access_fault(w, a, n, write, ra);
    uint8_t* sh = w->shadow + so;
    for (size_t k = 0; k < n; ++k) {
      if (__builtin_expect(sh[k] == 0, 0)) access_fault(w, a, n, write, ra);
    }
    if (L->strict) {
      for (size_t k = 0; k < n; ++k) strict_check(w, so + k, sh + k, write, atomic, ra, a, n);
    }
    return;
  }
  access_fault(w, a, n, write, ra);
}

}  // namespace

// The thread-sanitizer instrumentation interface (only the parts GCC emits for our flags).
#define MT_RA uintptr_t(__builtin_return_address(0))
#define MT_TSAN_SIZED(N)                                                                       \
  extern "C" void __tsan_read##N(void* a) { on_access(uintptr_t(a), N, false, MT_RA); }        \
  extern "C" void __tsan_write##N(void* a) { on_access(uintptr_t(a), N, true, MT_RA); }        \
  extern "C" void __tsan_unaligned_read##N(void* a) { on_access(uintptr_t(a), N, false, MT_RA); } \
  extern "C" void __tsan_unaligned_write##N(void* a) { on_access(uintptr_t(a), N, true, MT_RA); } \
  extern "C" void __tsan_volatile_read##N(void* a) { on_access(uintptr_t(a), N, false, MT_RA); } \
  extern "C" void __tsan_volatile_write##N(void* a) { on_access(uintptr_t(a), N, true, MT_RA); }
MT_TSAN_SIZED(1)
MT_TSAN_SIZED(2)
MT_TSAN_SIZED(4)
MT_TSAN_SIZED(8)
MT_TSAN_SIZED(16)
extern "C" void __tsan_read_range(void* a, unsigned long n) {
  if (n) on_access(uintptr_t(a), n, false, MT_RA);
}
extern "C" void __tsan_write_range(void* a, unsigned long n) {
  if (n) on_access(uintptr_t(a), n, true, MT_RA);
}
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_vptr_update(void**, void*) {}
extern "C" void __tsan_vptr_read(void**) {}

namespace {

// ---- threadgroup geometry -----------------------------------------------------------------------

void thread_ids(const Launch* L, const uint32_t tgpos[3], const uint32_t real[3], uint32_t t,
                mt_ids* ids) {
  const uint32_t* g = L->d->grid;
  uint32_t x = t % real[0], y = (t / real[0]) % real[1], z = t / (real[0] * real[1]);
  uint32_t pos[3] = {x, y, z};
  uint32_t n = real[0] * real[1] * real[2];
  uint32_t dn = L->tgdim[0] * L->tgdim[1] * L->tgdim[2];
  for (int k = 0; k < 3; ++k) {
    ids->thread_position_in_threadgroup[k] = pos[k];
    ids->threadgroup_position_in_grid[k] = tgpos[k];
    ids->thread_position_in_grid[k] = tgpos[k] * L->tgdim[k] + pos[k];
    ids->threads_per_threadgroup[k] = real[k];
    ids->dispatch_threads_per_threadgroup[k] = L->tgdim[k];
    ids->threads_per_grid[k] = g[k];
    ids->threadgroups_per_grid[k] = L->ntg[k];
  }
  ids->thread_index_in_threadgroup = t;
  ids->thread_index_in_simdgroup = t % kSimd;
  ids->simdgroup_index_in_threadgroup = t / kSimd;
  ids->simdgroups_per_threadgroup = (n + kSimd - 1) / kSimd;
  ids->dispatch_simdgroups_per_threadgroup = (dn + kSimd - 1) / kSimd;
  ids->thread_index_in_quadgroup = t % 4;
  ids->quadgroup_index_in_threadgroup = t / 4;
  ids->quadgroups_per_threadgroup = (n + 3) / 4;
  ids->dispatch_quadgroups_per_threadgroup = (dn + 3) / 4;
}

void tg_coords(const Launch* L, uint64_t linear, uint32_t pos[3], uint32_t real[3]) {
  pos[0] = uint32_t(linear % L->ntg[0]);
  pos[1] = uint32_t((linear / L->ntg[0]) % L->ntg[1]);
  pos[2] = uint32_t(linear / (uint64_t(L->ntg[0]) * L->ntg[1]));
  for (int k = 0; k < 3; ++k) {
    uint32_t start = pos[k] * L->tgdim[k];
    real[k] = std::min(L->tgdim[k], L->d->grid[k] - start);
  }
}

void reset_threadgroup_memory(Worker* w) {
  w->tg_epoch = 1;
  memset(w->sg_epoch, 0, sizeof w->sg_epoch);
  if (w->tg_end && w->L->strict) {
    size_t m = w->tg_end + kRedzone;
    RaceShadow& R = w->race;
    memset(R.w_thread, 0xFF, m * sizeof *R.w_thread);
    memset(R.r_thread, 0xFF, m * sizeof *R.r_thread);
  }
  if (w->tg_end) memset(w->shadow, 0, w->tg_end + kRedzone);
  w->tg_end = 0;
  w->tg_declared = 0;
  w->tg_slots.clear();
}

uint64_t mix_seed(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return x;
}

// ---- fibers -------------------------------------------------------------------------------------

bool alloc_stack(Fiber* f, size_t stack_size) {
  if (f->map && f->map_size == stack_size + size_t(sysconf(_SC_PAGESIZE))) return true;
  if (f->map) munmap(f->map, f->map_size);
  size_t pg = size_t(sysconf(_SC_PAGESIZE));
  size_t total = stack_size + pg;
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    f->map = nullptr;
    return false;
  }
  mprotect(p, pg, PROT_NONE);  // guard page: an overflow faults here
  f->map = static_cast<char*>(p);
  f->map_size = total;
  f->lo = f->map + pg;
  f->hi = f->map + total;
  return true;
}

extern "C" void mt_fiber_main(Fiber* f);

void start_fiber(Fiber* f) {
#if defined(__x86_64__)
  uint64_t* top = reinterpret_cast<uint64_t*>(uintptr_t(f->hi) & ~uintptr_t(15));
  // Frame popped by mt_switch: control words, r15..r12, rbx, rbp, return address.
  uint64_t* s = top - 1;  // return address slot at top-8, so the trampoline's rsp is aligned
  *s = uint64_t(uintptr_t(&mt_fiber_trampoline));
  s -= 1; *s = 0;                         // rbp
  s -= 1; *s = 0;                         // rbx
  s -= 1; *s = uint64_t(uintptr_t(f));    // r12: the argument of mt_fiber_main
  s -= 1; *s = 0;                         // r13
  s -= 1; *s = 0;                         // r14
  s -= 1; *s = 0;                         // r15
  s -= 1;
  uint32_t ctl[2];
  asm volatile("stmxcsr %0" : "=m"(ctl[0]));
  asm volatile("fnstcw %0" : "=m"(ctl[1]));
  memcpy(s, ctl, 8);
  f->sp = s;
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->lo;
  f->uc.uc_stack.ss_size = size_t(f->hi - f->lo);
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, reinterpret_cast<void (*)()>(&mt_fiber_main), 1, f);
#endif
}

inline void run_fiber(Worker* w, Fiber* f) {
  w->cur = f;
  w->cur_ids = &f->ids;
#if defined(__x86_64__)
  mt_switch(&w->sched_sp, f->sp);
#else
  swapcontext(&w->sched_uc, &f->uc);
#endif
  w->cur = nullptr;
}

inline void yield_to_scheduler(Worker* w, Fiber* f) {
#if defined(__x86_64__)
  mt_switch(&f->sp, w->sched_sp);
#else
  swapcontext(&f->uc, &w->sched_uc);
#endif
}

void run_plain(Worker* w);

}  // namespace

extern "C" void mt_fiber_main(Fiber* f) {
  Worker* w = f->w;
  if (f->runner) {
    run_plain(w);
  } else {
    w->L->d->fn(w->L->args, &f->ids);
  }
  f->state = DONE;
  yield_to_scheduler(w, f);
  __builtin_trap();
}

namespace {

// ---- plain mode: the threads of a threadgroup one after the other ---------------------------

bool claim(Launch* L, uint64_t* linear) {
  if (L->abort.load(std::memory_order_relaxed)) return false;
  uint64_t k = L->next.fetch_add(1);
  if (k >= L->total_tg) return false;
  *linear = L->order.empty() ? k : L->order[k];
  return true;
}

void run_plain(Worker* w) {
  Launch* L = w->L;
  uint64_t linear;
  mt_ids ids;
  std::vector<uint32_t> perm;
  while (claim(L, &linear)) {
    uint32_t pos[3], real[3];
    tg_coords(L, linear, pos, real);
    uint32_t n = real[0] * real[1] * real[2];
    reset_threadgroup_memory(w);
    perm.resize(n);
    for (uint32_t t = 0; t < n; ++t) perm[t] = t;
    if (L->d->shuffle) {
      std::mt19937_64 rng(mix_seed(L->d->seed, linear));
      std::shuffle(perm.begin(), perm.end(), rng);
    }
    for (uint32_t t : perm) {
      thread_ids(L, pos, real, t, &ids);
      w->cur_ids = &ids;
      L->d->fn(L->args, &ids);
    }
    w->cur_ids = nullptr;
    w->tgs += 1;
    w->threads += n;
  }
}

// ---- fiber mode: SIMD-groups and barriers ---------------------------------------------------

struct TgState {
  uint32_t n = 0;
  uint32_t done = 0;
  uint32_t at_tgb = 0;
  struct Sg {
    uint32_t size = 0, done = 0, blocked = 0;
  } sg[1024 / kSimd];
};

void describe_threads(const std::vector<uint32_t>& ts, char* out, size_t len) {
  // "0-31, 40, 64-95" (compact ranges)
  size_t used = 0;
  out[0] = 0;
  for (size_t i = 0; i < ts.size() && used + 24 < len;) {
    size_t j = i;
    while (j + 1 < ts.size() && ts[j + 1] == ts[j] + 1) ++j;
    used += size_t(snprintf(out + used, len - used, "%s%u", i ? ", " : "", ts[i]));
    if (j > i) used += size_t(snprintf(out + used, len - used, "-%u", ts[j]));
    i = j + 1;
  }
}

bool same_site(const mt_site& a, const mt_site& b) {
  return a.line == b.line && a.column == b.column &&
         (a.file == b.file || (a.file && b.file && strcmp(a.file, b.file) == 0));
}
// The call-site identity of a return address in the kernel module (see the launch's
// site_starts / site_ids); an address the table does not cover (or marks 0xFFFFFFFF: code
// without debug information) stands for itself.
uint64_t site_identity(Worker* w, uintptr_t ra) {
  Worker::SiteMemo& memo = w->site_memo[(ra * 0x9E3779B97F4A7C15ull) >> 56];
  if (memo.ra == ra) return memo.id;
  const Launch* L = w->L;
  const LaunchDesc* d = L->d;
  const uint64_t off = uint64_t(ra - 1 - L->code_base);  // inside the call instruction
  const uint64_t* end = d->site_starts + d->nsites;
  const uint64_t* it = std::upper_bound(d->site_starts, end, off);
  memo.ra = ra;
  const uint32_t id = it == d->site_starts ? 0xFFFFFFFFu : d->site_ids[it - d->site_starts - 1];
  memo.id = id == 0xFFFFFFFFu ? (uint64_t(1) << 63) | ra : id;
  return memo.id;
}

void site_info_unreadable(Worker* w, const Fiber& f);

// Two waiting fibers at the same barrier / collective: the same call of the source, reached
// through the same chain of calls. The source position (file, line, column) of the barrier or
// SIMD-group function must match (a caller that gave none: its code address), and so must the
// call path: the return addresses of the frames from the kernel's entry down to that call.
// Different return addresses can still be one chain of source calls -- the compiler copies
// code (jump threading, unrolling) and inlines helpers -- so a mismatch is settled with the
// call-site identities from the module's debug information: two addresses with the same
// identity lie in the same inlined-call instances and on the same line and column.
bool same_site(Worker* w, Fiber& a, Fiber& b) {
  if (a.site.file || b.site.file) {
    if (!a.site.file || !b.site.file || !same_site(a.site, b.site)) return false;
  } else if (!a.npath && !b.npath) {
    return a.site_ra == b.site_ra;
  }
  if (a.npath == b.npath && memcmp(a.path, b.path, sizeof(uintptr_t) * size_t(a.npath)) == 0)
    return true;
  if (a.npath != b.npath) return false;  // not the same depth of calls
  Launch* L = w->L;
  const int state = L->d->site_state;
  if (state == 0) {  // read the module's debug information, then redo the launch
    L->need_sites.store(true);
    L->abort.store(true);
    return false;
  }
  if (state != 1) {
    site_info_unreadable(w, a);
    return false;
  }
  L->used_sites.store(true, std::memory_order_relaxed);
  for (Fiber* f : {&a, &b}) {
    if (f->canon_ok) continue;
    for (int k = 0; k < f->npath; ++k) f->canon[k] = site_identity(w, f->path[k]);
    f->canon_ok = true;
  }
  return memcmp(a.canon, b.canon, sizeof(uint64_t) * size_t(a.npath)) == 0;
}

// "body line 12" / "header line 3" / "file.h:7"
void site_text(const mt_site& s, char* out, size_t n) {
  const char* f = s.file ? s.file : "?";
  const char* base = strrchr(f, '/');
  base = base ? base + 1 : f;
  if (strcmp(base, "body.metal") == 0) snprintf(out, n, "body line %u", s.line);
  else if (strcmp(base, "header.metal") == 0) snprintf(out, n, "header line %u", s.line);
  else snprintf(out, n, "%s:%u", base, s.line);
}

// Two threads wait at one barrier or SIMD-group function through different return addresses and
// the module's debug information could not be read, so whether that is one call of the source
// (copied by the compiler) or two different calls cannot be told: an emulator error (status 2)
// rather than a guess.
void site_info_unreadable(Worker* w, const Fiber& f) {
  Launch* L = w->L;
  std::lock_guard<std::mutex> lock(L->mu);
  L->abort.store(true);
  if (L->hazard) return;
  L->hazard = true;
  char where[300];
  site_text(f.site, where, sizeof where);
  snprintf(L->r->message, sizeof L->r->message,
           "threads wait at the barrier or SIMD-group function at %s through different machine "
           "code (different calls of a function containing it, or copies the compiler made of "
           "one call), and the kernel module's debug information, which tells the two apart, "
           "could not be read",
           f.site.file ? where : "an unknown line");
  L->r->status = 2;
}

// Everyone blocked or done: report who waits where. `sg` < 0: the whole threadgroup (threads
// at different threadgroup barriers / SIMD functions); otherwise SIMD-group `sg`, whose lanes
// can never all meet at one simdgroup_barrier. The hazard names the threadgroup and the first
// waiting thread.
void deadlock(Worker* w, TgState& st, int sg = -1) {
  std::vector<mt_site> sites;
  std::vector<Fiber*> firsts;
  std::vector<uintptr_t> ras;
  std::vector<std::vector<uint32_t>> who;
  std::vector<int> kinds;
  std::vector<uint32_t> done;
  const uint32_t t0 = sg < 0 ? 0 : uint32_t(sg) * kSimd;
  const uint32_t t1 = sg < 0 ? st.n : t0 + st.sg[sg].size;
  for (uint32_t t = t0; t < t1; ++t) {
    Fiber& f = w->fibers[t];
    if (f.state == DONE) {
      done.push_back(t);
      continue;
    }
    if (f.state == RUNNABLE) continue;  // not at a barrier yet (cannot happen when called)
    size_t k = 0;
    while (k < sites.size() && !(kinds[k] == f.state && same_site(w, *firsts[k], f))) ++k;
    if (k == sites.size()) {
      firsts.push_back(&f);
      sites.push_back(f.site);
      ras.push_back(f.site_ra);
      kinds.push_back(f.state);
      who.emplace_back();
    }
    who[k].push_back(t);
  }
  char msg[3500];
  size_t used;
  if (sg < 0) {
    used = size_t(snprintf(msg, sizeof msg,
                           "deadlock: the threads of this threadgroup can never all meet at "
                           "one barrier (a Mac would hang)."));
  } else {
    used = size_t(snprintf(msg, sizeof msg,
                           "deadlock: the lanes of SIMD-group %d can never all meet at one "
                           "simdgroup_barrier (a Mac would hang).",
                           sg));
  }
  char list[512], where[300], path[40];
  uintptr_t path_ras[kMaxRas];
  int npath_ras = 0;
  for (size_t k = 0; k < sites.size() && used + 900 < sizeof msg; ++k) {
    describe_threads(who[k], list, sizeof list);
    site_text(sites[k], where, sizeof where);
    const char* what = kinds[k] == BLOCK_TGB   ? "threadgroup_barrier"
                       : kinds[k] == BLOCK_SGB ? "simdgroup_barrier"
                                               : "a SIMD-group function";
    // "@PATH<a>-<b>": the caller lines along the group's call path (ras[a..b)), for Python to
    // fill in: threads at one line of a helper may have come through different calls of it
    path[0] = 0;
    const Fiber& f = *firsts[k];
    if (f.npath && npath_ras + f.npath <= kMaxRas) {
      snprintf(path, sizeof path, "@PATH%d-%d", npath_ras, npath_ras + f.npath);
      for (int i = 0; i < f.npath; ++i) path_ras[npath_ras++] = f.path[i];
    }
    used += size_t(snprintf(msg + used, sizeof msg - used, " Threads %s wait at %s (%s%s).",
                            list, what, where, path));
  }
  if (!done.empty() && used + 600 < sizeof msg) {
    describe_threads(done, list, sizeof list);
    snprintf(msg + used, sizeof msg - used, " Threads %s have returned.", list);
  }
  w->cur_ids = firsts.empty() ? nullptr : &firsts[0]->ids;
  record_hazard(w, MT_HZ_BARRIER, ras.empty() ? 0 : ras[0], path_ras, npath_ras, "%s", msg);
  w->cur_ids = nullptr;
}

void release(Fiber& f) {
  f.state = RUNNABLE;
  f.coll = nullptr;
}

// Resolve what can be resolved in SIMD-group g once all its unfinished lanes are blocked.
void try_resolve_sg(Worker* w, TgState& st, uint32_t g) {
  TgState::Sg& sg = st.sg[g];
  if (sg.blocked + sg.done < sg.size || sg.blocked == 0) return;
  Fiber* lanes = &w->fibers[g * kSimd];
  bool any_coll = false;
  // Collectives, one call site at a time (lowest lane first).
  for (uint32_t i = 0; i < sg.size; ++i) {
    if (lanes[i].state != BLOCK_COLL) continue;
    any_coll = true;
    const uintptr_t site_ra = lanes[i].site_ra;
    mt_coll* set[kSimd] = {};
    uint32_t count = 0;
    for (uint32_t j = i; j < sg.size; ++j) {
      if (lanes[j].state == BLOCK_COLL && same_site(w, lanes[j], lanes[i])) {
        set[j] = lanes[j].coll;
        count++;
      }
    }
    if (w->L->abort.load(std::memory_order_relaxed)) return;
    char err[512] = {0};
    // -1, or the offending lane + 256 * hazard kind (MT_HZ_SIMD_LANE when 0)
    int bad = set[i]->resolve(set, err, sizeof err);
    w->coll += 1;
    if (bad >= 0) {
      int kind = bad >> 8 ? bad >> 8 : MT_HZ_SIMD_LANE;
      w->cur_ids = &lanes[bad & 255].ids;
      record_hazard(w, kind, site_ra, nullptr, 0, "%s", err);
      w->cur_ids = nullptr;
      return;
    }
    for (uint32_t j = i; j < sg.size; ++j) {
      if (set[j]) release(lanes[j]);
    }
    sg.blocked -= count;
  }
  if (any_coll) return;
  // simdgroup_barrier: every live lane of the SIMD-group at the same one.
  uint32_t at_sgb = 0;
  Fiber* first = nullptr;
  bool same = true;
  for (uint32_t i = 0; i < sg.size; ++i) {
    if (lanes[i].state == BLOCK_SGB) {
      if (first && !same_site(w, lanes[i], *first)) same = false;
      if (!first) first = &lanes[i];
      at_sgb++;
    }
  }
  if (at_sgb && at_sgb == sg.size && same) {
    for (uint32_t i = 0; i < sg.size; ++i) release(lanes[i]);
    sg.blocked -= at_sgb;
    w->sgb += 1;
    w->sg_epoch[g] += 1;
  } else if (at_sgb && (sg.done || !same || at_sgb < sg.size)) {
    deadlock(w, st, int(g));
  }
}

void run_threadgroup_fibers(Worker* w, uint64_t linear) {
  Launch* L = w->L;
  uint32_t pos[3], real[3];
  tg_coords(L, linear, pos, real);
  TgState st;
  st.n = real[0] * real[1] * real[2];
  reset_threadgroup_memory(w);
  uint32_t nsg = (st.n + kSimd - 1) / kSimd;
  for (uint32_t g = 0; g < nsg; ++g) st.sg[g].size = std::min<uint32_t>(kSimd, st.n - g * kSimd);
  std::vector<uint32_t> order(st.n);
  for (uint32_t t = 0; t < st.n; ++t) {
    Fiber& f = w->fibers[t];
    thread_ids(L, pos, real, t, &f.ids);
    f.state = RUNNABLE;
    f.coll = nullptr;
    f.site = mt_site{nullptr, 0, 0};
    f.site_ra = 0;
    f.npath = 0;
    f.canon_ok = false;
    f.w = w;
    f.runner = false;
    start_fiber(&f);
    order[t] = t;
  }
  if (L->d->shuffle) {
    std::mt19937_64 rng(mix_seed(L->d->seed, linear));
    std::shuffle(order.begin(), order.end(), rng);
  }
  while (st.done < st.n) {
    bool ran = false;
    for (uint32_t t : order) {
      Fiber& f = w->fibers[t];
      if (f.state != RUNNABLE) continue;
      ran = true;
      run_fiber(w, &f);
      w->switches += 2;
      if (L->abort.load(std::memory_order_relaxed)) return;
      uint32_t g = t / kSimd;
      switch (f.state) {
        case DONE:
          st.done++;
          st.sg[g].done++;
          if (st.at_tgb) {
            w->cur_ids = &f.ids;
            std::vector<uint32_t> waiting;
            const Fiber* waiter = nullptr;
            for (uint32_t u = 0; u < st.n; ++u)
              if (w->fibers[u].state == BLOCK_TGB) {
                waiting.push_back(u);
                waiter = &w->fibers[u];
              }
            char list[512], where[300];
            describe_threads(waiting, list, sizeof list);
            site_text(waiter->site, where, sizeof where);
            record_hazard(w, MT_HZ_BARRIER, waiter->site_ra, nullptr, 0,
                          "barrier divergence: this thread returned while threads %s wait at "
                          "threadgroup_barrier (%s); every thread of a threadgroup must reach "
                          "each barrier (a Mac would hang)",
                          list, where);
            return;
          }
          break;
        case BLOCK_TGB:
          if (st.done) {
            w->cur_ids = &f.ids;
            std::vector<uint32_t> gone;
            for (uint32_t u = 0; u < st.n; ++u)
              if (w->fibers[u].state == DONE) gone.push_back(u);
            char list[512];
            describe_threads(gone, list, sizeof list);
            record_hazard(w, MT_HZ_BARRIER, f.site_ra, nullptr, 0,
                          "barrier divergence: this thread reached threadgroup_barrier after "
                          "threads %s returned; every thread of a threadgroup must reach each "
                          "barrier (a Mac would hang)",
                          list);
            return;
          }
          st.at_tgb++;
          st.sg[g].blocked++;
          break;
        case BLOCK_SGB:
        case BLOCK_COLL:
          st.sg[g].blocked++;
          break;
        default:
          break;
      }
      try_resolve_sg(w, st, g);
      if (L->abort.load(std::memory_order_relaxed)) return;
      if (st.at_tgb && st.at_tgb + st.done == st.n) {
        // Every live thread waits at a threadgroup barrier: the same one?
        bool same = true;
        for (uint32_t u = 1; u < st.n; ++u)
          if (!same_site(w, w->fibers[u], w->fibers[0])) same = false;
        if (!same) {
          deadlock(w, st);
          return;
        }
        for (uint32_t u = 0; u < st.n; ++u) release(w->fibers[u]);
        for (uint32_t q = 0; q < nsg; ++q) st.sg[q].blocked = 0;
        st.at_tgb = 0;
        w->tgb += 1;
        w->tg_epoch += 1;
      }
    }
    if (!ran && st.done < st.n) {
      deadlock(w, st);
      return;
    }
  }
  w->tgs += 1;
  w->threads += st.n;
}

// ---- workers ----------------------------------------------------------------------------------

void worker_main(Worker* w) {
  tl_w = w;
  stack_t ss = {};
  ss.ss_sp = w->altstack;
  ss.ss_size = kAltStack;
  stack_t old_ss;
  sigaltstack(&ss, &old_ss);
  Launch* L = w->L;
  if (!L->fibers) {
    Fiber& f = w->runner;
    f.w = w;
    f.runner = true;
    f.state = RUNNABLE;
    start_fiber(&f);
    run_fiber(w, &f);
  } else {
    uint64_t linear;
    while (claim(L, &linear)) run_threadgroup_fibers(w, linear);
  }
  w->cur_ids = nullptr;
  tl_w = nullptr;
  {
    std::lock_guard<std::mutex> lock(L->alive_mu);
    L->alive[w->index] = false;
  }
  sigaltstack(&old_ss, nullptr);
}

// ---- signals: stack overflow and other faults inside kernel code ----------------------------

struct sigaction g_old[65];
bool g_handlers = false;

void on_signal(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tl_w;
  if (w && w->cur) {
    Fiber* f = w->cur;
    uintptr_t ra = 0;
#if defined(__x86_64__)
    ra = uintptr_t(static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RIP]) + 1;
#elif defined(__aarch64__)
    ra = uintptr_t(static_cast<ucontext_t*>(uctx)->uc_mcontext.pc) + 1;
#endif
    char* addr = static_cast<char*>(info->si_addr);
    if ((sig == SIGSEGV || sig == SIGBUS) && addr >= f->map && addr < f->lo) {
      record_hazard(w, MT_HZ_STACK_OVERFLOW, ra, nullptr, 0,
                    "thread stack overflow (the emulator gives each thread %llu KiB; large "
                    "per-thread arrays or deep recursion; set MLX_METALTILE_EMULATOR_STACK_KB "
                    "to raise it)",
                    (unsigned long long)(w->L->d->stack_size / 1024));
    } else if (sig == SIGFPE) {
      record_hazard(w, MT_HZ_ARITHMETIC, ra, nullptr, 0,
                    "arithmetic fault (integer division or remainder by zero, or overflow of "
                    "INT_MIN / -1)");
    } else if (sig == SIGILL) {
      record_hazard(w, MT_HZ_MEMORY_FAULT, ra, nullptr, 0,
                    "illegal instruction: the compiler's trap for undefined behaviour (for "
                    "example a non-void function that ends without a return)");
    } else {
      record_hazard(w, MT_HZ_MEMORY_FAULT, ra, nullptr, 0,
                    "memory fault (signal %d) at address %p: a wild pointer outside every "
                    "buffer",
                    sig, info->si_addr);
    }
    escape(w);  // leaves the signal frame for good (SA_NODEFER: no mask to restore)
  }
  // Not ours: hand over to whoever handled it before (Python's faulthandler, the default).
  struct sigaction& old = g_old[sig];
  if (old.sa_flags & SA_SIGINFO) {
    if (old.sa_sigaction) {
      old.sa_sigaction(sig, info, uctx);
      return;
    }
  } else if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
    old.sa_handler(sig);
    return;
  }
  sigaction(sig, &old, nullptr);  // default action on return: re-faults and terminates
}

// The watchdog's signal: a launch past its time limit whose thread loops in kernel code without
// touching memory (an endless loop on registers) is interrupted there and reported. Anywhere
// else (the runtime, libm) the handler returns: the runtime checks the limit at each memory
// access, and the watchdog signals again.
int g_timeout_sig = 0;
struct sigaction g_old_timeout;

void on_timeout_signal(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tl_w;
  if (w && w->cur && w->L && w->L->timed_out.load(std::memory_order_relaxed)) {
    uintptr_t pc = 0;
#if defined(__x86_64__)
    pc = uintptr_t(static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
    pc = uintptr_t(static_cast<ucontext_t*>(uctx)->uc_mcontext.pc);
#endif
    if (pc >= w->L->code_lo && pc < w->L->code_hi) timeout_fault(w, pc + 1);  // does not return
    return;
  }
  if (w) return;  // a worker outside kernel code, or a late signal: nothing to do
  if ((g_old_timeout.sa_flags & SA_SIGINFO) && g_old_timeout.sa_sigaction)
    g_old_timeout.sa_sigaction(sig, info, uctx);
  else if (!(g_old_timeout.sa_flags & SA_SIGINFO) && g_old_timeout.sa_handler != SIG_DFL &&
           g_old_timeout.sa_handler != SIG_IGN)
    g_old_timeout.sa_handler(sig);
}

int find_code(struct dl_phdr_info* info, size_t, void* data) {
  auto* L = static_cast<Launch*>(data);
  Dl_info dl;
  if (!dladdr(reinterpret_cast<void*>(L->d->fn), &dl)) return 1;
  if (info->dlpi_addr != uintptr_t(dl.dli_fbase)) return 0;
  L->code_base = info->dlpi_addr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD && (ph.p_flags & PF_X)) {
      uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
      if (!L->code_lo || lo < L->code_lo) L->code_lo = lo;
      L->code_hi = std::max<uintptr_t>(L->code_hi, lo + ph.p_memsz);
    }
  }
  return 1;
}

// Installed at each launch unless still in place (someone may have installed a handler since,
// e.g. faulthandler.enable(); it becomes the one faults outside kernel code go to).
void install_handlers() {
  struct sigaction sa = {};
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) {
    struct sigaction cur;
    sigaction(sig, nullptr, &cur);
    if (g_handlers && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_signal) continue;
    sigaction(sig, &sa, &g_old[sig]);
  }
  if (!g_timeout_sig) g_timeout_sig = SIGRTMAX - 3;
  struct sigaction cur;
  sigaction(g_timeout_sig, nullptr, &cur);
  if (!(g_handlers && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_timeout_signal)) {
    struct sigaction ta = {};
    ta.sa_sigaction = on_timeout_signal;
    ta.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER | SA_RESTART;
    sigemptyset(&ta.sa_mask);
    sigaction(g_timeout_sig, &ta, &g_old_timeout);
  }
  g_handlers = true;
}

// ---- the launch -------------------------------------------------------------------------------

bool setup_buffers(Launch* L, char* err, size_t n) {
  const LaunchDesc* d = L->d;
  for (int i = 0; i < d->nbuf; ++i) {
    const BufDesc& b = d->bufs[i];
    if (b.span >= g_slot / 2) {
      snprintf(err, n, "buffer '%s' of %llu bytes is too large for the emulator", b.name,
               (unsigned long long)b.span);
      return false;
    }
    char* base = slot_base(buf_slot(i));
    if (!map_rw(base, b.span)) {
      snprintf(err, n, "cannot map buffer '%s': %s", b.name, strerror(errno));
      return false;
    }
    L->region[i] = base;
    L->span[i] = b.span;
    L->args[i] = base + b.data_off;
    if (b.init_kind == 0 && b.src) {
      memcpy(base, static_cast<const char*>(b.src), b.span);
    } else if (b.init_kind == 2 && b.elem_size && b.elem_size <= 16) {
      for (uint64_t o = 0; o + b.elem_size <= b.span; o += b.elem_size)
        memcpy(base + o, b.pattern, b.elem_size);
    } else {
      memset(base, 0xFF, b.span);  // Metal does not clear outputs: poison
    }
  }
  return true;
}

void teardown_buffers(Launch* L) {
  for (int i = 0; i < L->nbuf; ++i) unmap_to_guard(L->region[i], L->span[i]);
}

bool prepare_worker(Worker* w, int index, Launch* L, size_t max_threads, char* err, size_t n) {
  w->index = index;
  w->L = L;
  w->cur = nullptr;
  w->cur_ids = nullptr;
  memset(w->rd, 0, sizeof w->rd);
  memset(w->wr, 0, sizeof w->wr);
  w->tgb = w->sgb = w->coll = w->switches = w->tg_peak = w->tgs = w->threads = 0;
  memset(w->site_memo, 0, sizeof w->site_memo);
  if (!g_tg_mapped[index]) {
    char* base = slot_base(tg_slot(index));
    if (!map_rw(base, kTgSlotMap)) {
      snprintf(err, n, "cannot map threadgroup memory: %s", strerror(errno));
      return false;
    }
    w->tg_base = base;
    w->shadow = static_cast<uint8_t*>(calloc(kTgSlotMap + kRedzone, 1));
    w->altstack = static_cast<char*>(malloc(kAltStack));
    g_tg_mapped[index] = true;
  }
  if (L->strict && !w->race.w_thread) {
    auto arr = [](size_t elem) {
      void* p = mmap(nullptr, kTgSlotMap * elem, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    };
    RaceShadow& R = w->race;
    R.w_thread = static_cast<uint16_t*>(arr(2));
    R.w_epoch = static_cast<uint32_t*>(arr(4));
    R.w_sg = static_cast<uint32_t*>(arr(4));
    R.w_ra = static_cast<uintptr_t*>(arr(8));
    R.r_thread = static_cast<uint16_t*>(arr(2));
    R.r_epoch = static_cast<uint32_t*>(arr(4));
    R.r_sg = static_cast<uint32_t*>(arr(4));
    if (!R.w_thread || !R.w_epoch || !R.w_sg || !R.w_ra || !R.r_thread || !R.r_epoch || !R.r_sg) {
      snprintf(err, n, "cannot allocate the strict-mode shadow memory");
      return false;
    }
    memset(R.w_thread, 0xFF, kTgSlotMap * 2);
    memset(R.r_thread, 0xFF, kTgSlotMap * 2);
  }
  w->tg_end = 0;
  memset(w->shadow, 0, kTgSlotMap);
  w->tg_declared = 0;
  w->tg_slots.clear();
  if (w->stack_size != L->d->stack_size) {
    for (Fiber& f : w->fibers)
      if (f.map) munmap(f.map, f.map_size);
    w->fibers.clear();
    if (w->runner.map) munmap(w->runner.map, w->runner.map_size);
    w->runner.map = nullptr;
    w->stack_size = L->d->stack_size;
  }
  size_t want = L->fibers ? max_threads : 0;
  if (w->fibers.size() < want) w->fibers.resize(want);
  for (size_t i = 0; i < want; ++i) {
    if (!alloc_stack(&w->fibers[i], w->stack_size)) {
      snprintf(err, n, "cannot allocate fiber stacks: %s", strerror(errno));
      return false;
    }
  }
  // The runner calls the threads one after the other: the same stack budget per thread as a
  // fiber gets, plus room for the runner's own frames.
  if (!L->fibers && !alloc_stack(&w->runner, w->stack_size + 64 * 1024)) {
    snprintf(err, n, "cannot allocate the runner stack: %s", strerror(errno));
    return false;
  }
  return true;
}

int run_launch(Launch* L, char* err, size_t errn) {
  const LaunchDesc* d = L->d;
  int nw = std::max(1, std::min<int>(d->nworkers, kMaxWorkers));
  if (uint64_t(nw) > L->total_tg) nw = int(std::max<uint64_t>(1, L->total_tg));
  size_t max_threads = size_t(L->tgdim[0]) * L->tgdim[1] * L->tgdim[2];
  for (int i = 0; i < nw; ++i)
    if (!prepare_worker(&g_workers[i], i, L, max_threads, err, errn)) return 2;
  L->next.store(0);
  L->abort.store(false);
  dl_iterate_phdr(find_code, L);
  std::vector<std::thread> threads;
  threads.reserve(size_t(nw));
  {
    std::lock_guard<std::mutex> lock(L->alive_mu);
    for (int i = 0; i < nw; ++i) {
      L->alive[i] = true;
      threads.emplace_back(worker_main, &g_workers[i]);
      L->handles[i] = threads.back().native_handle();
    }
  }
  // The watchdog: past the time limit, the next memory access of kernel code raises, and
  // threads looping in kernel code without one are interrupted by a signal (every 20 ms).
  std::mutex wd_mu;
  std::condition_variable wd_cv;
  bool finished = false;
  std::thread watchdog;
  if (d->timeout_s > 0) {
    watchdog = std::thread([&] {
      std::unique_lock<std::mutex> lock(wd_mu);
      if (wd_cv.wait_for(lock, std::chrono::duration<double>(d->timeout_s),
                         [&] { return finished; }))
        return;
      L->timed_out.store(true);
      while (!wd_cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return finished; })) {
        std::lock_guard<std::mutex> alive_lock(L->alive_mu);
        for (int i = 0; i < nw; ++i)
          if (L->alive[i]) pthread_kill(L->handles[i], g_timeout_sig);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (watchdog.joinable()) {
    {
      std::lock_guard<std::mutex> lock(wd_mu);
      finished = true;
    }
    wd_cv.notify_all();
    watchdog.join();
  }
  LaunchResult* r = L->r;
  for (int i = 0; i < nw; ++i) {
    Worker& w = g_workers[i];
    for (int b = 0; b < L->nbuf; ++b) {
      r->bytes_read[b] += w.rd[b];
      r->bytes_written[b] += w.wr[b];
    }
    r->threadgroups += w.tgs;
    r->threads += w.threads;
    r->threadgroup_barriers += w.tgb;
    r->simdgroup_barriers += w.sgb;
    r->simd_collectives += w.coll;
    r->fiber_switches += w.switches;
    r->threadgroup_memory = std::max(r->threadgroup_memory, w.tg_peak);
  }
  return 0;
}

}  // namespace

// ---- entry points for kernel code ---------------------------------------------------------------

// The return addresses of the kernel-module frames above a barrier / collective entry point:
// kernel code is built with frame pointers, so the saved frame-pointer chain leads from the
// entry point's own frame (`fp`) up to the kernel's entry; the walk stops at the first return
// address outside the module (the runtime's fiber start) or outside the fiber's stack.
inline void capture_path(const Launch* L, Fiber* f, void** fp) {
  int n = 0;
  while (n < kMaxPath) {
    const uintptr_t ra = uintptr_t(fp[1]);
    if (ra < L->code_lo || ra >= L->code_hi) break;
    f->path[n++] = ra;
    void** next = static_cast<void**>(fp[0]);
    if (next <= fp || reinterpret_cast<char*>(next) >= f->hi) break;
    fp = next;
  }
  f->npath = n;  // (deeper calls than kMaxPath: the innermost kMaxPath count)
  f->canon_ok = false;
}

extern "C" __attribute__((noinline, optimize("no-omit-frame-pointer"))) void mt_barrier(
    int kind, const mt_site* site) {
  Worker* w = tl_w;
  uintptr_t ra = uintptr_t(__builtin_return_address(0));
  Fiber* f = w->cur;
  if (!f || f->runner) {  // plain mode: redo the launch with fibers
    w->L->need_fibers.store(true);
    w->L->abort.store(true);
    escape(w);
  }
  f->site = *site;
  f->site_ra = ra;
  capture_path(w->L, f, static_cast<void**>(__builtin_frame_address(0)));
  f->state = kind == MT_BARRIER_THREADGROUP ? BLOCK_TGB : BLOCK_SGB;
  yield_to_scheduler(w, f);
}

extern "C" __attribute__((noinline, optimize("no-omit-frame-pointer"))) void mt_collective(
    mt_coll* c) {
  Worker* w = tl_w;
  uintptr_t ra = uintptr_t(__builtin_return_address(0));
  Fiber* f = w->cur;
  if (!f || f->runner) {
    w->L->need_fibers.store(true);
    w->L->abort.store(true);
    escape(w);
  }
  f->site = c->site;
  f->site_ra = ra;
  capture_path(w->L, f, static_cast<void**>(__builtin_frame_address(0)));
  f->coll = c;
  f->state = BLOCK_COLL;
  yield_to_scheduler(w, f);
}

extern "C" void* mt_tg_alloc(size_t bytes, size_t align, int slot, const char* name) {
  Worker* w = tl_w;
  for (auto& s : w->tg_slots)
    if (s.first == slot) return s.second;
  size_t rounded = (bytes + 15) / 16 * 16;
  w->tg_declared += rounded;
  uintptr_t ra = uintptr_t(__builtin_return_address(0));
  if (w->tg_declared > kTgLimit) {
    record_hazard(w, MT_HZ_THREADGROUP_MEMORY, ra, nullptr, 0,
                  "threadgroup memory over the 32 KiB limit: the threadgroup arrays declared "
                  "so far need %zu bytes ('%s' adds %zu)",
                  w->tg_declared, name, rounded);
    escape(w);
    return nullptr;
  }
  if (align < 16) align = 16;
  size_t off = (w->tg_end + kRedzone + align - 1) / align * align;
  if (off + bytes + kRedzone > kTgSlotMap) {
    record_hazard(w, MT_HZ_THREADGROUP_MEMORY, ra, nullptr, 0,
                  "threadgroup memory: too many threadgroup arrays ('%s')", name);
    escape(w);
    return nullptr;
  }
  char* p = w->tg_base + off;
  memset(p, 0xFF, bytes);  // Metal does not clear threadgroup memory: poison
  memset(w->shadow + off, 1, bytes);
  if (w->L->strict) {  // no access yet to the new array's bytes
    memset(w->race.w_thread + off, 0xFF, bytes * sizeof(uint16_t));
    memset(w->race.r_thread + off, 0xFF, bytes * sizeof(uint16_t));
  }
  w->tg_end = off + bytes;
  w->tg_peak = std::max<uint64_t>(w->tg_peak, w->tg_declared);
  w->tg_slots.emplace_back(slot, p);
  return p;
}

extern "C" uint32_t mt_lane(void) {
  Worker* w = tl_w;
  return w && w->cur_ids ? w->cur_ids->thread_index_in_simdgroup : 0;
}

extern "C" int mt_strict(void) {
  Worker* w = tl_w;
  return w && w->L ? w->L->strict : 0;
}

extern "C" void mt_hazard(int kind, const char* message) {
  Worker* w = tl_w;
  uintptr_t ra = uintptr_t(__builtin_return_address(0));
  record_hazard(w, kind, ra, nullptr, 0, "%s", message);
  escape(w);
  abort();  // not reached from kernel code
}

extern "C" uint64_t mt_atomic_rmw(void* p, int size, int kind, int op, uint64_t v) {
  uintptr_t ra = uintptr_t(__builtin_return_address(0));
  if (op != 1) on_access(uintptr_t(p), size_t(size), false, ra, true);
  if (op != 0) on_access(uintptr_t(p), size_t(size), true, ra, true);
  // op: 0 load, 1 store, 2 exchange, 3 add, 4 sub, 5 and, 6 or, 7 xor, 8 min, 9 max
  auto rmw = [&](auto* q, auto val) -> uint64_t {
    using T = std::remove_pointer_t<decltype(q)>;
    T old;
    switch (op) {
      case 0: old = __atomic_load_n(q, __ATOMIC_SEQ_CST); break;
      case 1: __atomic_store_n(q, val, __ATOMIC_SEQ_CST); old = val; break;
      case 2: old = __atomic_exchange_n(q, val, __ATOMIC_SEQ_CST); break;
      case 3: old = __atomic_fetch_add(q, val, __ATOMIC_SEQ_CST); break;
      case 4: old = __atomic_fetch_sub(q, val, __ATOMIC_SEQ_CST); break;
      case 5: old = __atomic_fetch_and(q, val, __ATOMIC_SEQ_CST); break;
      case 6: old = __atomic_fetch_or(q, val, __ATOMIC_SEQ_CST); break;
      case 7: old = __atomic_fetch_xor(q, val, __ATOMIC_SEQ_CST); break;
      default: {
        old = __atomic_load_n(q, __ATOMIC_SEQ_CST);
        for (;;) {
          T want = op == 8 ? (val < old ? val : old) : (val > old ? val : old);
          if (__atomic_compare_exchange_n(q, &old, want, false, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST))
            break;
        }
      }
    }
    uint64_t bits = 0;
    memcpy(&bits, &old, sizeof old);
    return bits;
  };
  if (kind == 2) {  // float: compare-and-swap on the bits
    uint32_t* q = static_cast<uint32_t*>(p);
    float fv;
    uint32_t vb = uint32_t(v);
    memcpy(&fv, &vb, 4);
    if (op <= 2) return rmw(q, vb);
    uint32_t old = __atomic_load_n(q, __ATOMIC_SEQ_CST);
    for (;;) {
      float of;
      memcpy(&of, &old, 4);
      float nf = op == 3 ? of + fv : op == 4 ? of - fv : op == 8 ? std::min(of, fv) : std::max(of, fv);
      uint32_t nb;
      memcpy(&nb, &nf, 4);
      if (__atomic_compare_exchange_n(q, &old, nb, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return old;
    }
  }
  if (size == 4) {
    if (kind == 1) return rmw(static_cast<int32_t*>(p), int32_t(v)) & 0xFFFFFFFFull;
    return rmw(static_cast<uint32_t*>(p), uint32_t(v));
  }
  if (size == 8) {
    if (kind == 1) return rmw(static_cast<int64_t*>(p), int64_t(v));
    return rmw(static_cast<uint64_t*>(p), v);
  }
  return 0;
}

extern "C" int mt_atomic_cas(void* p, int size, uint64_t* expected, uint64_t desired) {
  uintptr_t ra = uintptr_t(__builtin_return_address(0));
  on_access(uintptr_t(p), size_t(size), false, ra, true);
  on_access(uintptr_t(p), size_t(size), true, ra, true);
  if (size == 4) {
    uint32_t e = uint32_t(*expected);
    bool ok = __atomic_compare_exchange_n(static_cast<uint32_t*>(p), &e, uint32_t(desired), false,
                                          __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    *expected = e;
    return ok;
  }
  uint64_t e = *expected;
  bool ok = __atomic_compare_exchange_n(static_cast<uint64_t*>(p), &e, desired, false,
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  *expected = e;
  return ok;
}

// ---- entry points for Python ----------------------------------------------------------------

extern "C" int mt_rt_abi_version(void) { return 4; }

extern "C" int mt_launch(const LaunchDesc* d, LaunchResult* r) {
  std::lock_guard<std::mutex> lock(g_launch_mu);
  memset(r, 0, sizeof *r);
  char err[512] = {0};
  if (!reserve_arena(err, sizeof err)) {
    r->status = 2;
    snprintf(r->message, sizeof r->message, "%s", err);
    return r->status;
  }
  install_handlers();
  if (d->nbuf > kMaxBuffers) {
    r->status = 2;
    snprintf(r->message, sizeof r->message, "too many buffers (%d > %d)", d->nbuf, kMaxBuffers);
    return r->status;
  }
  for (bool fibers : {bool(d->force_fibers), true}) {
    Launch L;
    L.d = d;
    L.r = r;
    L.nbuf = d->nbuf;
    L.strict = d->strict;
    L.fibers = fibers;
    L.total_tg = 1;
    for (int k = 0; k < 3; ++k) {
      L.tgdim[k] = std::min(d->tg[k], d->grid[k]);  // as MLX: the group never exceeds the grid
      if (L.tgdim[k] == 0) L.tgdim[k] = 1;
      L.ntg[k] = d->grid[k] ? (d->grid[k] + L.tgdim[k] - 1) / L.tgdim[k] : 0;
      L.total_tg *= L.ntg[k];
    }
    if (d->shuffle) {
      L.order.resize(L.total_tg);
      for (uint64_t i = 0; i < L.total_tg; ++i) L.order[i] = i;
      std::mt19937_64 rng(mix_seed(d->seed, ~0ull));
      std::shuffle(L.order.begin(), L.order.end(), rng);
    }
    memset(r, 0, sizeof *r);
    if (!setup_buffers(&L, err, sizeof err)) {
      teardown_buffers(&L);
      r->status = 2;
      snprintf(r->message, sizeof r->message, "%s", err);
      return r->status;
    }
    int rc = L.total_tg ? run_launch(&L, err, sizeof err) : 0;
    if (rc) {
      teardown_buffers(&L);
      r->status = 2;
      snprintf(r->message, sizeof r->message, "%s", err);
      return r->status;
    }
    if (!fibers && L.need_fibers.load() && !L.hazard) {
      teardown_buffers(&L);
      continue;  // the kernel blocks at barriers or SIMD functions: redo it with fibers
    }
    r->used_fibers = fibers;
    if (L.need_sites.load()) {  // the caller reads the call-site identities and launches again
      teardown_buffers(&L);
      r->status = 3;
      return r->status;
    }
    r->used_site_ids = L.used_sites.load();
    if (r->status == 0) {
      for (int i = 0; i < d->nbuf; ++i)
        if (d->bufs[i].dst) memcpy(d->bufs[i].dst, L.region[i], d->bufs[i].span);
    }
    teardown_buffers(&L);
    return r->status;
  }
  return r->status;
}

// Where a code address lives, for mapping it to a source line (addr2line on the module).
extern "C" int mt_addr_info(uint64_t addr, char* path, size_t n, uint64_t* offset) {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(uintptr_t(addr)), &info) || !info.dli_fname) return 0;
  snprintf(path, n, "%s", info.dli_fname);
  *offset = addr - uint64_t(uintptr_t(info.dli_fbase));
  return 1;
}
