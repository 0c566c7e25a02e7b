// mt_cuda/kernel.cuh: the library made visible to the kernel, and the MSL spellings that
// are not C++ (what the source rewrites write, Metal's macros).
#pragma once

namespace mlx::core::cu {
using namespace metal;

// A packed scalar input (translation: PACKED_INPUT) from its 32 bits, as the MSL type the
// kernel declares: uint, int or float.
template <class T>
MT_FN T mt_unpack_scalar(uint32_t bits) {
  if constexpr (cuda::std::is_same_v<T, float>) {
    return __uint_as_float(bits);
  } else {
    static_assert(cuda::std::is_same_v<T, uint> || cuda::std::is_same_v<T, int>,
                  "packed scalars are uint, int or float");
    return static_cast<T>(bits);
  }
}
}  // namespace mlx::core::cu

// ---- MSL spellings that are not C++ ------------------------------------------------------

// Kernel-scope threadgroup arrays, as the shared pre-pass writes them, 16-byte aligned (as
// Metal aligns threadgroup memory; common.h's mt_sg_load4 relies on it). (The address-space
// words device / constant / thread / threadgroup are erased from the source text by the
// translation, not by macros here: `device` and `constant` are also spelled inside CUDA's
// own __device__ / __constant__ macros.)
#define MT_THREADGROUP_ARRAY(name, dims, ...) __shared__ __align__(16) __VA_ARGS__ name dims

// Half and bfloat literals (1.0h, 2bf), as the shared literal rewrite writes them.
#define MT_HALF_LITERAL(x) (::__half(float(x)))
#define MT_BFLOAT_LITERAL(x) (::__nv_bfloat16(float(x)))

#define METAL_FUNC __device__ __forceinline__

#ifndef INFINITY
#define INFINITY (::cuda::std::numeric_limits<float>::infinity())
#endif
#ifndef NAN
#define NAN (::cuda::std::numeric_limits<float>::quiet_NaN())
#endif
#ifndef FLT_MAX
#define FLT_MAX 3.402823466e+38F
#endif
#ifndef FLT_MIN
#define FLT_MIN 1.175494351e-38F
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 1.192092896e-07F
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 3.402823466e+38F
#endif
#ifndef HALF_MAX
#define HALF_MAX 65504.0f
#endif
