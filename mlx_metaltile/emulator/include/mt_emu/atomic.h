// atomic.h: metal::atomic<T> and the atomic_*_explicit functions, on device or threadgroup
// memory. Executed by the runtime with host atomics (threadgroups run concurrently), checked
// and counted like any other access. float supports load/store/exchange/add/sub/min/max.
#pragma once

#include "mt_emu/scalar.h"

namespace metal {

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};
enum memory_scope { memory_scope_thread, memory_scope_simdgroup, memory_scope_threadgroup,
                    memory_scope_device };

template <class T> struct atomic {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomic<T> needs a 4- or 8-byte T");
  using value_type = T;
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<unsigned int> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<unsigned long> atomic_ulong;
typedef atomic<long> atomic_long;

}  // namespace metal

namespace mt {
template <class T> constexpr int atomic_kind = is_fp_v<T> ? 2 : std::is_signed<T>::value ? 1 : 0;
template <class T> inline uint64_t to_bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof v);
  return b;
}
template <class T> inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}
template <class T> inline T atomic_op(volatile metal::atomic<T>* obj, int op, T v) {
  return from_bits<T>(mt_atomic_rmw((void*)obj, sizeof(T), atomic_kind<T>, op, to_bits(v)));
}
}  // namespace mt

namespace metal {

#define MT_ATOMIC_RMW(name, op)                                                              \
  template <class T>                                                                         \
  inline T name(volatile atomic<T>* obj, typename atomic<T>::value_type v,                    \
                memory_order = memory_order_relaxed, memory_scope = memory_scope_device) {   \
    return mt::atomic_op<T>(obj, op, v);                                                     \
  }
MT_ATOMIC_RMW(atomic_exchange_explicit, 2)
MT_ATOMIC_RMW(atomic_fetch_add_explicit, 3)
MT_ATOMIC_RMW(atomic_fetch_sub_explicit, 4)
MT_ATOMIC_RMW(atomic_fetch_and_explicit, 5)
MT_ATOMIC_RMW(atomic_fetch_or_explicit, 6)
MT_ATOMIC_RMW(atomic_fetch_xor_explicit, 7)
MT_ATOMIC_RMW(atomic_fetch_min_explicit, 8)
MT_ATOMIC_RMW(atomic_fetch_max_explicit, 9)
#undef MT_ATOMIC_RMW

template <class T>
inline void atomic_store_explicit(volatile atomic<T>* obj, typename atomic<T>::value_type v,
                                  memory_order = memory_order_relaxed,
                                  memory_scope = memory_scope_device) {
  mt::atomic_op<T>(obj, 1, v);
}
template <class T>
inline T atomic_load_explicit(volatile atomic<T>* obj, memory_order = memory_order_relaxed,
                              memory_scope = memory_scope_device) {
  return mt::atomic_op<T>(obj, 0, T(0));
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* obj, T* expected,
                                                  typename atomic<T>::value_type desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed,
                                                  memory_scope = memory_scope_device) {
  uint64_t e = mt::to_bits(*expected);
  bool ok = mt_atomic_cas((void*)obj, sizeof(T), &e, mt::to_bits(desired)) != 0;
  *expected = mt::from_bits<T>(e);
  return ok;
}
template <class T>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* obj, T* expected,
                                                    typename atomic<T>::value_type desired,
                                                    memory_order s = memory_order_relaxed,
                                                    memory_order f = memory_order_relaxed,
                                                    memory_scope sc = memory_scope_device) {
  return atomic_compare_exchange_weak_explicit(obj, expected, desired, s, f, sc);
}

}  // namespace metal
