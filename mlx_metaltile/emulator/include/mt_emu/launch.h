// launch.h: the C interface between Python and the emulator runtime library: the launch
// structures, status codes, hazard kinds and the ABI version. Python reads this file itself
// (emulator/_abi.py feeds the part between the cdef markers to cffi), so it is the only
// statement of these facts: plain C declarations and integer #defines only in that part.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- cdef begin

// Bumped whenever a structure or an entry point changes.
#define MT_ABI_VERSION 6
#define MT_MAX_BUFFERS 64
#define MT_MAX_RAS 16
#define MT_MESSAGE_LEN 4096

// mt_launch_result.status
enum mt_status {
  MT_STATUS_OK = 0,
  MT_STATUS_HAZARD = 1,
  MT_STATUS_ERROR = 2,       // the emulator itself failed (message says why)
  MT_STATUS_NEED_SITES = 3,  // rerun with the module's call-site identities
};

// Hazard kinds (each raised as its own Python exception class; emulator/_errors.py).
enum mt_hazard_kind {
  MT_HZ_NONE = 0,
  MT_HZ_OUT_OF_BOUNDS = 1,
  MT_HZ_THREADGROUP_MEMORY = 2,
  MT_HZ_BARRIER = 3,
  MT_HZ_SIMD_LANE = 4,
  MT_HZ_UNINITIALIZED_READ = 5,
  MT_HZ_STACK_OVERFLOW = 6,
  MT_HZ_MEMORY_FAULT = 7,
  MT_HZ_ARITHMETIC = 8,
  MT_HZ_SIMDGROUP_MATRIX = 9,
  MT_HZ_TIMEOUT = 10,
  MT_HZ_RACE = 11,
  MT_HZ_INPUT_WRITE = 12,
};

// mt_buf_desc.init_kind
enum mt_init_kind {
  MT_INIT_COPY = 0,     // copy src
  MT_INIT_POISON = 1,   // 0xFF bytes
  MT_INIT_PATTERN = 2,  // repeat `pattern`
};

typedef struct mt_buf_desc {
  const char* name;
  const void* src;     // bytes to copy in (inputs), or null
  void* dst;           // where to copy the result (outputs), or null
  uint64_t span;       // bytes of the region the kernel may touch
  int64_t data_off;    // offset of element 0 within the region (negative strides)
  uint32_t elem_size;
  int32_t init_kind;   // enum mt_init_kind
  uint8_t pattern[16];
} mt_buf_desc;

typedef struct mt_launch_desc {
  const void* fn;  // the module's mt_kernel_thread (an mt_thread_fn, mt_emu/abi.h)
  const char* kernel;
  int32_t nbuf;
  const mt_buf_desc* bufs;
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
  // offset site_starts[k] up to site_starts[k + 1] has identity site_ids[k], numbered in
  // source order (within one function, a smaller identity was written earlier). site_state 0:
  // not read yet (a launch that needs them stops with MT_STATUS_NEED_SITES), 1: read,
  // 2: unreadable.
  const uint64_t* site_starts;
  const uint32_t* site_ids;
  int64_t nsites;
  int32_t site_state;
} mt_launch_desc;

typedef struct mt_launch_result {
  int32_t status;  // enum mt_status
  int32_t hazard_kind;
  char message[MT_MESSAGE_LEN];
  uint64_t ras[MT_MAX_RAS];  // code addresses the message may name as "@RA<k>"
  int32_t nras;
  int32_t has_thread;
  uint32_t threadgroup[3];
  uint32_t thread[3];     // position in threadgroup
  uint32_t thread_index;  // linear index in threadgroup
  uint64_t fault_ra;      // the faulting code address (the source line of the hazard)
  uint64_t bytes_read[MT_MAX_BUFFERS];
  uint64_t bytes_written[MT_MAX_BUFFERS];
  uint64_t threadgroups;
  uint64_t threads;
  uint64_t threadgroup_barriers;
  uint64_t simdgroup_barriers;
  uint64_t simd_collectives;
  uint64_t fiber_switches;
  uint64_t threadgroup_memory;
  int32_t used_fibers;
  int32_t used_site_ids;  // call paths were told apart (or ordered) with the call-site identities
} mt_launch_result;

int mt_rt_abi_version(void);
int mt_launch(const mt_launch_desc* d, mt_launch_result* r);
// The module file holding a code address, and the address's offset in it (1 if found).
int mt_addr_info(uint64_t addr, char* path, size_t n, uint64_t* offset);

// ---- cdef end

#ifdef __cplusplus
}
#endif
