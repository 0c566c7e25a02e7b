// mlx_prelude.h: what MLX puts in front of every custom-kernel source (its kernels/utils.h),
// to the extent custom kernel bodies use it: float16_t, bfloat16_t, Limits<T>, the
// elem_to_loc family, ceildiv, WorkPerThread, ConditionalType, METAL_FUNC and the
// MLX_MTL_PRAGMA_UNROLL / defines.h constants.
#pragma once

#include "mt_emu/math.h"

typedef _Float16 float16_t;
typedef metal::bfloat bfloat16_t;

#define METAL_FUNC inline __attribute__((always_inline))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("GCC unroll 16")

static constexpr int MAX_REDUCE_SPECIALIZED_DIMS = 4;
static constexpr int REDUCE_N_READS = 4;
static constexpr int REDUCE_N_WRITES = 4;
static constexpr int SOFTMAX_N_READS = 4;
static constexpr int RMS_N_READS = 4;
static constexpr int RMS_LOOPED_LIMIT = 4096;

template <typename U> struct WorkPerThread {
  static_assert(sizeof(U) <= 8, "Type too large");
  static constexpr int n = 8 / sizeof(U);
};

// Limits<T>: max/min are the infinities for floating point, the extreme values otherwise.
template <typename U, bool = mt::is_fp_v<U>> struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
template <typename U> struct Limits<U, true> {
  static constexpr U max = metal::numeric_limits<U>::infinity();
  static constexpr U min = U(-metal::numeric_limits<U>::infinity());
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = U(-metal::numeric_limits<U>::max());
};
template <> struct Limits<bool, false> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

// Location of element `elem` of a row-major index space in a strided array.
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int d = ndim - 1; d >= 0 && elem > 0; --d) {
    loc += IdxT(elem % shape[d]) * IdxT(strides[d]);
    elem /= shape[d];
  }
  return loc;
}
// elem = (last axis, second-to-last axis, all leading axes flattened)
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(metal::uint3 elem, const int* shape, const int64_t* strides,
                            int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]);
  if (ndim > 1) loc += IdxT(elem.y) * IdxT(strides[ndim - 2]);
  uint z = elem.z;
  for (int d = ndim - 3; d >= 0; --d) {
    loc += IdxT(z % shape[d]) * IdxT(strides[d]);
    z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t> METAL_FUNC IdxT elem_to_loc_1(uint elem, const int64_t& stride) {
  return IdxT(elem) * IdxT(stride);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_2(metal::uint2 elem, const int64_t strides[2]) {
  return IdxT(elem.x) * IdxT(strides[1]) + IdxT(elem.y) * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_3(metal::uint3 elem, const int64_t strides[3]) {
  return IdxT(elem.x) * IdxT(strides[2]) + IdxT(elem.y) * IdxT(strides[1]) +
         IdxT(elem.z) * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
METAL_FUNC metal::vec<IdxT, 2> elem_to_loc_2_nd(metal::uint3 elem, const int* shape,
                                                const int64_t* a_strides,
                                                const int64_t* b_strides, int ndim) {
  metal::vec<IdxT, 2> loc(IdxT(elem.x) * IdxT(a_strides[ndim - 1]) +
                              IdxT(elem.y) * IdxT(a_strides[ndim - 2]),
                          IdxT(elem.x) * IdxT(b_strides[ndim - 1]) +
                              IdxT(elem.y) * IdxT(b_strides[ndim - 2]));
  uint z = elem.z;
  for (int d = ndim - 3; d >= 0; --d) {
    uint l = z % shape[d];
    loc.x += IdxT(l) * IdxT(a_strides[d]);
    loc.y += IdxT(l) * IdxT(b_strides[d]);
    z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC metal::vec<IdxT, 3> elem_to_loc_3_nd(metal::uint3 elem, const int* shape,
                                                const int64_t* a_strides,
                                                const int64_t* b_strides,
                                                const int64_t* c_strides, int ndim) {
  metal::vec<IdxT, 3> loc(IdxT(elem.x) * IdxT(a_strides[ndim - 1]) +
                              IdxT(elem.y) * IdxT(a_strides[ndim - 2]),
                          IdxT(elem.x) * IdxT(b_strides[ndim - 1]) +
                              IdxT(elem.y) * IdxT(b_strides[ndim - 2]),
                          IdxT(elem.x) * IdxT(c_strides[ndim - 1]) +
                              IdxT(elem.y) * IdxT(c_strides[ndim - 2]));
  uint z = elem.z;
  for (int d = ndim - 3; d >= 0; --d) {
    uint l = z % shape[d];
    loc.x += IdxT(l) * IdxT(a_strides[d]);
    loc.y += IdxT(l) * IdxT(b_strides[d]);
    loc.z += IdxT(l) * IdxT(c_strides[d]);
    z /= shape[d];
  }
  return loc;
}

template <typename T, typename U> inline T ceildiv(T N, U M) { return (N + M - 1) / M; }

template <bool condition, typename T, typename U> struct ConditionalType { using type = U; };
template <typename T, typename U> struct ConditionalType<true, T, U> { using type = T; };

template <typename U, typename T> inline U cast_to(T val) { return static_cast<U>(val); }
