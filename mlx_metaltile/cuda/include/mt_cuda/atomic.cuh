// mt_cuda/atomic.cuh: MSL atomics on CUDA atomics.
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

// ---- atomics -----------------------------------------------------------------------------
// atomic<T> is layout-compatible with T and trivially constructible, so it can live in
// __shared__ memory and alias output buffers. Every order is relaxed, as in MSL.

template <class T>
struct alignas(sizeof(T)) atomic {
  T value;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<uint>;
using atomic_float = atomic<float>;
using atomic_ulong = atomic<ulong>;

template <class T>
MT_FN T* mt_atomic_ptr(const volatile atomic<T>* obj) {
  return const_cast<T*>(&obj->value);
}
template <class T>
MT_FN atomic<T>* mt_as_atomic(T* p) { return reinterpret_cast<atomic<T>*>(p); }

template <class T>
MT_FN T atomic_load_explicit(const volatile atomic<T>* obj, memory_order) {
  return *reinterpret_cast<const volatile T*>(&obj->value);
}
template <class T>
MT_FN void atomic_store_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  *reinterpret_cast<volatile T*>(&obj->value) = v;
}
template <class T>
MT_FN T atomic_exchange_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  return atomicExch(mt_atomic_ptr(obj), v);
}
template <class T>
MT_FN bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* obj, T* expected,
                                                 mt_id_t<T> desired, memory_order,
                                                 memory_order) {
  T old;
  if constexpr (cuda::std::is_same_v<T, float>) {
    old = __int_as_float(atomicCAS(reinterpret_cast<int*>(mt_atomic_ptr(obj)),
                                   __float_as_int(*expected), __float_as_int(desired)));
    if (__float_as_int(old) == __float_as_int(*expected)) return true;
  } else {
    old = atomicCAS(mt_atomic_ptr(obj), *expected, desired);
    if (old == *expected) return true;
  }
  *expected = old;
  return false;
}
template <class T>
MT_FN T atomic_fetch_add_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  return atomicAdd(mt_atomic_ptr(obj), v);
}
template <class T>
MT_FN T atomic_fetch_sub_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  if constexpr (cuda::std::is_same_v<T, float>) {
    return atomicAdd(mt_atomic_ptr(obj), -v);
  } else if constexpr (cuda::std::is_same_v<T, ulong>) {
    return atomicAdd(mt_atomic_ptr(obj), ~v + 1ull);
  } else {
    return atomicSub(mt_atomic_ptr(obj), v);
  }
}
// float min/max through compare-and-swap (CUDA has integer atomicMin/atomicMax only).
template <class T, class Pick>
MT_FN T mt_atomic_float_update(volatile atomic<T>* obj, T v, Pick pick) {
  int* addr = reinterpret_cast<int*>(mt_atomic_ptr(obj));
  int old = *reinterpret_cast<volatile int*>(addr);
  while (true) {
    const int want = __float_as_int(pick(__int_as_float(old), v));
    if (want == old) break;
    const int seen = atomicCAS(addr, old, want);
    if (seen == old) break;
    old = seen;
  }
  return __int_as_float(old);
}
template <class T>
MT_FN T atomic_fetch_min_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  if constexpr (cuda::std::is_same_v<T, float>) {
    return mt_atomic_float_update(obj, v, [](float a, float b) { return fminf(a, b); });
  } else {
    return atomicMin(mt_atomic_ptr(obj), v);
  }
}
template <class T>
MT_FN T atomic_fetch_max_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  if constexpr (cuda::std::is_same_v<T, float>) {
    return mt_atomic_float_update(obj, v, [](float a, float b) { return fmaxf(a, b); });
  } else {
    return atomicMax(mt_atomic_ptr(obj), v);
  }
}
template <class T>
MT_FN T atomic_fetch_and_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  return atomicAnd(mt_atomic_ptr(obj), v);
}
template <class T>
MT_FN T atomic_fetch_or_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  return atomicOr(mt_atomic_ptr(obj), v);
}
template <class T>
MT_FN T atomic_fetch_xor_explicit(volatile atomic<T>* obj, mt_id_t<T> v, memory_order) {
  return atomicXor(mt_atomic_ptr(obj), v);
}

}  // namespace metal
}  // namespace mlx::core::cu
