// abi.h: the C interface between the emulator runtime library (src/runtime.cpp, built once)
// and the kernel modules (one per kernel instantiation, built from the generated source).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "mt_emu/launch.h"  // hazard kinds

#ifdef __cplusplus
extern "C" {
#endif

// The built-in attribute values of one thread ([[thread_position_in_grid]], ...).
typedef struct mt_ids {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];           // the real size (partial at grid edges)
  uint32_t dispatch_threads_per_threadgroup[3];  // the requested size
  uint32_t threads_per_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
} mt_ids;

// One thread of the kernel: args[i] is the address of buffer i (inputs, their
// _shape/_strides/_ndim buffers, outputs, in signature order).
typedef void (*mt_thread_fn)(void* const* args, const mt_ids* ids);

// Where a barrier or SIMD-group function is called, in the kernel's source. Threads meet at
// the same barrier / collective when they call it from the same source position through the
// same chain of calls (the runtime walks the frames of kernel code; copies the compiler made
// of one call are recognised with the module's debug information).
typedef struct mt_site {
  const char* file;
  uint32_t line;
  uint32_t column;
} mt_site;

// A SIMD-group collective: every lane that calls one fills a record on its own stack and
// blocks; once every unfinished lane of the SIMD-group is blocked, the lanes blocked at the
// same call site form the active set and `resolve` is called once with lanes[0..31]
// (NULL for lanes outside the set). It writes each active lane's `out` and returns -1, or
// returns the offending lane after writing a message into err.
typedef struct mt_coll mt_coll;
typedef int (*mt_resolve_fn)(mt_coll* const* lanes, char* err, size_t err_len);
struct mt_coll {
  int op;              // operation code (header-defined)
  int width;           // 32 for simd_*, 4 for quad_*
  int64_t arg;         // lane / delta / mask argument
  const void* in;      // this lane's operand(s)
  const void* in2;
  const void* in3;
  void* out;           // this lane's result
  mt_resolve_fn resolve;
#ifdef __cplusplus
  // Set it (mt::site_of(std::source_location)) so lanes meet by source position and call
  // path; left null, by the code addresses of the call path alone.
  mt_site site = {nullptr, 0, 0};
#else
  mt_site site;
#endif
};

enum { MT_BARRIER_THREADGROUP = 0, MT_BARRIER_SIMDGROUP = 1 };

// Runtime entry points used by kernel code (through the headers).
void mt_collective(mt_coll* c);
void mt_barrier(int kind, const mt_site* site);
void* mt_tg_alloc(size_t bytes, size_t align, int slot, const char* name);
uint32_t mt_lane(void);
int mt_strict(void);
// Bounds (and input-write) checks of a range, without counting its bytes.
void mt_check_range(const void* p, size_t n, int write);
void mt_hazard(int kind, const char* message);  // from kernel code; never returns
// Device and threadgroup atomics (bounds-checked and counted like other accesses).
// kind: 0 unsigned, 1 signed, 2 float; op: see MT_ATOMIC_* in mt_emu/atomic.h.
uint64_t mt_atomic_rmw(void* p, int size, int kind, int op, uint64_t value);
int mt_atomic_cas(void* p, int size, uint64_t* expected, uint64_t desired);

#ifdef __cplusplus
}
#endif
