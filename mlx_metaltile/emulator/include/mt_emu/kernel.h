// kernel.h: everything a kernel module sees in front of the generated source (precompiled).
//
// MSL address spaces and qualifiers become nothing: device/constant/threadgroup pointers are
// plain host pointers, checked by the runtime through the compiler instrumentation. (So two
// overloads that differ only by address space collide here.) Extension headers (for example
// a MetalPerformancePrimitives subset) go next to metal_stdlib under include/ and include
// this file first; they must not include standard headers after it.
#pragma once

#include "mt_emu/scalar.h"
#include "mt_emu/vec.h"
#include "mt_emu/math.h"
#include "mt_emu/simd.h"
#include "mt_emu/matrix.h"
#include "mt_emu/atomic.h"
#include "mt_emu/mlx_prelude.h"

using namespace metal;

// Kernel code's memory copies and fills, checked and counted as its loads and stores are
// (the compiler's instrumentation leaves calls to the C library's memcpy unchecked). Defined
// after the runtime headers, so only the kernel's own code goes through them.
inline void* mt_checked_memcpy(void* d, const void* s, size_t n) {
  mt_check_range(s, n, 0);
  mt_check_range(d, n, 1);
  return __builtin_memcpy(d, s, n);
}
inline void* mt_checked_memmove(void* d, const void* s, size_t n) {
  mt_check_range(s, n, 0);
  mt_check_range(d, n, 1);
  return __builtin_memmove(d, s, n);
}
inline void* mt_checked_memset(void* d, int c, size_t n) {
  mt_check_range(d, n, 1);
  return __builtin_memset(d, c, n);
}
#define __builtin_memcpy(d, s, n) mt_checked_memcpy((d), (s), (n))
#define __builtin_memmove(d, s, n) mt_checked_memmove((d), (s), (n))
#define __builtin_memset(d, c, n) mt_checked_memset((d), (c), (n))

// A kernel-scope `threadgroup T name[dims];` (rewritten by mlx_metaltile._msl_source): one
// allocation per threadgroup, shared by its threads, poisoned when the threadgroup starts.
#define MT_THREADGROUP_ARRAY(name, dims, ...)                                               \
  typedef __VA_ARGS__ mt_tg_type_##name dims;                                               \
  mt_tg_type_##name& name = *static_cast<mt_tg_type_##name*>(::mt_tg_alloc(                 \
      sizeof(mt_tg_type_##name), alignof(mt_tg_type_##name), __COUNTER__, #name))

#define __METAL_VERSION__ 320
#define device
#define constant
#define threadgroup
#define thread
#define threadgroup_imageblock
#define object_data
#define ray_data
#define kernel
