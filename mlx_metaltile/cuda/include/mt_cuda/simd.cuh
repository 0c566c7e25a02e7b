// mt_cuda/simd.cuh: barriers and SIMD-group functions on CUDA warps.
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

// ---- barriers ----------------------------------------------------------------------------
// __syncthreads() orders shared and global memory among the block's threads, which covers
// every mem_flags combination of threadgroup_barrier.

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
MT_FN constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};

MT_FN void threadgroup_barrier(mem_flags = mem_flags::mem_none) { __syncthreads(); }
MT_FN void simdgroup_barrier(mem_flags = mem_flags::mem_none) { __syncwarp(__activemask()); }
MT_FN void atomic_thread_fence(mem_flags flags, memory_order = memory_order_seq_cst,
                               thread_scope scope = thread_scope_device) {
  if (scope == thread_scope_device || (unsigned(flags) & unsigned(mem_flags::mem_device))) {
    __threadfence();
  } else {
    __threadfence_block();
  }
}

// ---- SIMD-group (warp) functions ---------------------------------------------------------

MT_FN uint mt_lane() {
  uint lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Shuffle any trivially copyable value in 32-bit words (CUDA shuffles 4 or 8 bytes).
template <class T>
MT_FN T mt_shfl(unsigned mask, const T& v, int src) {
  if constexpr (cuda::std::is_same_v<T, float> || cuda::std::is_same_v<T, int> ||
                cuda::std::is_same_v<T, unsigned> || cuda::std::is_same_v<T, __half> ||
                cuda::std::is_same_v<T, __nv_bfloat16>) {
    return __shfl_sync(mask, v, src);
  } else {
    constexpr int W = (sizeof(T) + 3) / 4;
    unsigned words[W] = {};
    memcpy(words, &v, sizeof(T));
#pragma unroll
    for (int i = 0; i < W; ++i) words[i] = __shfl_sync(mask, words[i], src);
    T r;
    memcpy(&r, words, sizeof(T));
    return r;
  }
}

// Fold `v` over the active lanes of the caller's group (all 32 lanes, or its quad) with
// `op`. Every lane of the group gets the same result.
template <int WIDTH, class T, class Op>
MT_FN T mt_group_reduce(T v, Op op) {
  const unsigned active = __activemask();
  if (active == 0xffffffffu) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off >>= 1) {
      v = op(v, mt_shfl(active, v, int(mt_lane() ^ off)));
    }
    return v;
  }
  // Some lanes are inactive: every active lane walks the active lanes in order (the same
  // shuffles everywhere) and keeps those of its own group.
  const uint group_base = mt_lane() & ~uint(WIDTH - 1);
  bool have = false;
  T acc = v;
  for (unsigned m = active; m; m &= m - 1) {
    const int src = __ffs(m) - 1;
    const T other = mt_shfl(active, v, src);
    if (uint(src) - group_base < uint(WIDTH)) {
      acc = have ? op(acc, other) : other;
      have = true;
    }
  }
  return acc;
}

template <class T>
MT_FN T mt_add(T a, T b) { return a + b; }

#define MT_REDUCTIONS(PREFIX, WIDTH)                                                       \
  template <class T>                                                                       \
  MT_FN T PREFIX##_sum(T v) {                                                              \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(a + b); });                   \
  }                                                                                        \
  template <class T>                                                                       \
  MT_FN T PREFIX##_product(T v) {                                                          \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(a * b); });                   \
  }                                                                                        \
  template <class T>                                                                       \
  MT_FN T PREFIX##_max(T v) {                                                              \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(max(a, b)); });               \
  }                                                                                        \
  template <class T>                                                                       \
  MT_FN T PREFIX##_min(T v) {                                                              \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(min(a, b)); });               \
  }                                                                                        \
  template <class T>                                                                       \
  MT_FN T PREFIX##_and(T v) {                                                              \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(a & b); });                   \
  }                                                                                        \
  template <class T>                                                                       \
  MT_FN T PREFIX##_or(T v) {                                                               \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(a | b); });                   \
  }                                                                                        \
  template <class T>                                                                       \
  MT_FN T PREFIX##_xor(T v) {                                                              \
    return mt_group_reduce<WIDTH>(v, [](T a, T b) { return T(a ^ b); });                   \
  }

MT_REDUCTIONS(simd, 32)
MT_REDUCTIONS(quad, 4)
#undef MT_REDUCTIONS

// Prefix sums over the active lanes in lane order (inclusive / exclusive).
template <int WIDTH, class T>
MT_FN T mt_group_prefix_sum(T v, bool inclusive) {
  const unsigned active = __activemask();
  const uint lane = mt_lane();
  const uint group_base = lane & ~uint(WIDTH - 1);
  T acc = T(0);
  for (unsigned m = active; m; m &= m - 1) {
    const int src = __ffs(m) - 1;
    const T other = mt_shfl(active, v, src);
    if (uint(src) >= group_base && (uint(src) < lane || (inclusive && uint(src) == lane))) {
      acc = T(acc + other);
    }
  }
  return acc;
}
template <class T>
MT_FN T simd_prefix_inclusive_sum(T v) { return mt_group_prefix_sum<32>(v, true); }
template <class T>
MT_FN T simd_prefix_exclusive_sum(T v) { return mt_group_prefix_sum<32>(v, false); }
template <class T>
MT_FN T quad_prefix_inclusive_sum(T v) { return mt_group_prefix_sum<4>(v, true); }
template <class T>
MT_FN T quad_prefix_exclusive_sum(T v) { return mt_group_prefix_sum<4>(v, false); }

// Shuffles. Out-of-range sources keep the caller's value (MSL's shuffle_up/down rule).
template <class T>
MT_FN T simd_shuffle(T v, ushort lane) { return mt_shfl(__activemask(), v, lane & 31); }
template <class T>
MT_FN T simd_broadcast(T v, ushort lane) { return mt_shfl(__activemask(), v, lane & 31); }
template <class T>
MT_FN T simd_shuffle_xor(T v, ushort mask) {
  return mt_shfl(__activemask(), v, int((mt_lane() ^ mask) & 31));
}
template <class T>
MT_FN T simd_shuffle_down(T v, ushort delta) {
  const uint src = mt_lane() + delta;
  return mt_shfl(__activemask(), v, int(src < 32 ? src : mt_lane()));
}
template <class T>
MT_FN T simd_shuffle_up(T v, ushort delta) {
  const uint lane = mt_lane();
  return mt_shfl(__activemask(), v, int(lane >= delta ? lane - delta : lane));
}
template <class T>
MT_FN T simd_shuffle_rotate_down(T v, ushort delta) {
  return mt_shfl(__activemask(), v, int((mt_lane() + delta) & 31));
}
template <class T>
MT_FN T simd_shuffle_rotate_up(T v, ushort delta) {
  return mt_shfl(__activemask(), v, int((mt_lane() - delta) & 31));
}
template <class T>
MT_FN T simd_broadcast_first(T v) {
  const unsigned active = __activemask();
  return mt_shfl(active, v, __ffs(active) - 1);
}
template <class T>
MT_FN T quad_shuffle(T v, ushort lane) {
  return mt_shfl(__activemask(), v, int((mt_lane() & ~3u) | (lane & 3u)));
}
template <class T>
MT_FN T quad_broadcast(T v, ushort lane) { return quad_shuffle(v, lane); }
template <class T>
MT_FN T quad_shuffle_xor(T v, ushort mask) {
  return mt_shfl(__activemask(), v, int(mt_lane() ^ (mask & 3u)));
}
template <class T>
MT_FN T quad_shuffle_down(T v, ushort delta) {
  const uint lane = mt_lane();
  const uint src = (lane & 3u) + delta;
  return mt_shfl(__activemask(), v, int(src < 4 ? (lane & ~3u) + src : lane));
}
template <class T>
MT_FN T quad_shuffle_up(T v, ushort delta) {
  const uint lane = mt_lane();
  return mt_shfl(__activemask(), v, int((lane & 3u) >= delta ? lane - delta : lane));
}

// common.h's converged helpers (MT_SIMD_HELPERS): the caller promises all 32 lanes active,
// so the mask is the constant full one. ptxas then issues a plain SHFL per shuffle, where
// __activemask() costs a vote, a uniform-register move and a divergence branch per call
// (2 to 8% of the MoE decode kernels' time on an H200). The sum, max and min are
// mt_group_reduce's all-lanes butterflies: the same order, the same results.
#define MT_SIMD_HELPERS 1
template <class T>
MT_FN T mt_shuffle_converged(T v, ushort lane) { return mt_shfl(0xffffffffu, v, lane & 31); }
template <class T>
MT_FN T mt_shuffle_xor_converged(T v, ushort mask) {
  return mt_shfl(0xffffffffu, v, int((mt_lane() ^ mask) & 31));
}
template <class T, class Op>
MT_FN T mt_converged_reduce(T v, Op op) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v = op(v, mt_shfl(0xffffffffu, v, int(mt_lane() ^ off)));
  }
  return v;
}
template <class T>
MT_FN T mt_sum_converged(T v) { return mt_converged_reduce(v, [](T a, T b) { return T(a + b); }); }
template <class T>
MT_FN T mt_max_converged(T v) {
  return mt_converged_reduce(v, [](T a, T b) { return T(max(a, b)); });
}
template <class T>
MT_FN T mt_min_converged(T v) {
  return mt_converged_reduce(v, [](T a, T b) { return T(min(a, b)); });
}

struct simd_vote {
  using vote_t = ulong;
  vote_t bits;
  MT_FN explicit constexpr simd_vote(vote_t v = 0) : bits(v) {}
  MT_FN explicit constexpr operator vote_t() const { return bits; }
  MT_FN constexpr bool any() const { return bits != 0; }
  MT_FN bool all() const { return bits == ulong(__activemask()); }
};
MT_FN simd_vote simd_ballot(bool pred) { return simd_vote(__ballot_sync(__activemask(), pred)); }
MT_FN simd_vote simd_active_threads_mask() { return simd_vote(__activemask()); }
MT_FN bool simd_all(bool pred) { return __all_sync(__activemask(), pred); }
MT_FN bool simd_any(bool pred) { return __any_sync(__activemask(), pred); }
MT_FN bool simd_is_first() { return int(mt_lane()) == __ffs(__activemask()) - 1; }
MT_FN bool quad_all(bool pred) {
  const unsigned bits = __ballot_sync(__activemask(), pred) | ~__activemask();
  return ((bits >> (mt_lane() & ~3u)) & 0xFu) == 0xFu;
}
MT_FN bool quad_any(bool pred) {
  const unsigned bits = __ballot_sync(__activemask(), pred);
  return ((bits >> (mt_lane() & ~3u)) & 0xFu) != 0u;
}

}  // namespace metal
}  // namespace mlx::core::cu
