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
// This file itself is compiled without instrumentation. It is a unity build of the parts
// included at its end, one concern each; the structures Python passes in are declared in
// mt_emu/launch.h.

#include "mt_emu/abi.h"
#include "mt_emu/launch.h"

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

using BufDesc = mt_buf_desc;
using LaunchDesc = mt_launch_desc;
using LaunchResult = mt_launch_result;

constexpr int kSimd = 32;
constexpr int kMaxBuffers = MT_MAX_BUFFERS;
constexpr int kMaxWorkers = 16;
constexpr int kMaxRas = MT_MAX_RAS;
constexpr int kMaxPath = 32;               // call-path depth kept per waiting thread
constexpr size_t kTgLimit = 32 * 1024;     // Metal's threadgroup memory limit
constexpr size_t kTgSlotMap = 512 * 1024;  // mapped part of a worker's threadgroup slot
constexpr size_t kRedzone = 64;            // gap between threadgroup arrays (catches overruns)
constexpr size_t kAltStack = 64 * 1024;

}  // namespace

#include "fiber_switch.inc"
#include "state.inc"
#include "hazards.inc"
#include "memcheck.inc"
#include "ubsan.inc"
#include "fibers.inc"
#include "scheduler.inc"
#include "signals.inc"
#include "launch.inc"
#include "kernel_api.inc"
#include "atomics.inc"
#include "interface.inc"
