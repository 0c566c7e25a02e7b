// mt_cuda/scalar.cuh: MSL scalar types (half / bfloat are CUDA's) and their arithmetic with MSL's promotions.
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

// ---- scalar types ------------------------------------------------------------------------

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long long;  // 64-bit, as in MSL
using half = __half;
using bfloat = __nv_bfloat16;
using float16_t = __half;
using bfloat16_t = __nv_bfloat16;

template <class T>
struct mt_half_like
    : cuda::std::bool_constant<cuda::std::is_same_v<T, __half> ||
                               cuda::std::is_same_v<T, __nv_bfloat16>> {};

template <class T>
struct mt_identity {
  using type = T;
};
template <class T>
using mt_id_t = typename mt_identity<T>::type;  // keeps a parameter out of deduction

// common.h's bit helper (MT_BIT_HELPERS): (a & mask) | bits as one lop3 (LUT 0xEA = (a & b) | c).
// Written as C, ptxas emits two LOP3s where mask and bits are both constants (one immediate
// each); given one lop3 it keeps one constant in a register, hoisted out of the loops.
#define MT_BIT_HELPERS 1
MT_FN uint mt_and_or(uint a, uint mask, uint bits) {
  uint d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}

// Conversion between any two scalar types; half <-> bfloat and half -> integer go through
// float (CUDA has no direct path for all of them).
template <class To, class From>
MT_FN To mt_cast(From v) {
  if constexpr (cuda::std::is_same_v<To, From>) {
    return v;
  } else if constexpr (mt_half_like<From>::value) {
    return static_cast<To>(float(v));
  } else {
    return static_cast<To>(v);
  }
}

// ---- half / bfloat arithmetic with MSL's promotions --------------------------------------
// CUDA declares __half op __half only, so `h * 2.0f` is ambiguous there (float(h) or
// __half(2.0f)?). MSL computes half op float in float and half op int in half.

#define MT_MIXED_FLOAT(H, OP)                                                      \
  MT_FN float operator OP(H a, float b) { return float(a) OP b; }                  \
  MT_FN float operator OP(float a, H b) { return a OP float(b); }                  \
  MT_FN float operator OP(H a, double b) { return float(a) OP float(b); }          \
  MT_FN float operator OP(double a, H b) { return float(a) OP float(b); }

#define MT_MIXED_INT(H, I, OP)                                                     \
  MT_FN H operator OP(H a, I b) { return H(float(a) OP float(H(float(b)))); }      \
  MT_FN H operator OP(I a, H b) { return H(float(H(float(a))) OP float(b)); }

#define MT_MIXED_CMP(H, S, OP)                                                     \
  MT_FN bool operator OP(H a, S b) { return float(a) OP float(b); }                \
  MT_FN bool operator OP(S a, H b) { return float(a) OP float(b); }

#define MT_MIXED_INTS(H, OP)                                                       \
  MT_MIXED_INT(H, int, OP)                                                         \
  MT_MIXED_INT(H, unsigned int, OP)                                                \
  MT_MIXED_INT(H, long, OP)                                                        \
  MT_MIXED_INT(H, unsigned long, OP)                                               \
  MT_MIXED_INT(H, long long, OP)                                                   \
  MT_MIXED_INT(H, unsigned long long, OP)

#define MT_MIXED_CMPS(H, OP)                                                       \
  MT_MIXED_CMP(H, float, OP)                                                       \
  MT_MIXED_CMP(H, double, OP)                                                      \
  MT_MIXED_CMP(H, int, OP)                                                         \
  MT_MIXED_CMP(H, unsigned int, OP)                                                \
  MT_MIXED_CMP(H, long, OP)                                                        \
  MT_MIXED_CMP(H, unsigned long, OP)                                               \
  MT_MIXED_CMP(H, long long, OP)                                                   \
  MT_MIXED_CMP(H, unsigned long long, OP)

#define MT_MIXED_ALL(H)                                                            \
  MT_MIXED_FLOAT(H, +) MT_MIXED_FLOAT(H, -) MT_MIXED_FLOAT(H, *) MT_MIXED_FLOAT(H, /) \
  MT_MIXED_INTS(H, +) MT_MIXED_INTS(H, -) MT_MIXED_INTS(H, *) MT_MIXED_INTS(H, /)     \
  MT_MIXED_CMPS(H, <) MT_MIXED_CMPS(H, >) MT_MIXED_CMPS(H, <=) MT_MIXED_CMPS(H, >=)   \
  MT_MIXED_CMPS(H, ==) MT_MIXED_CMPS(H, !=)

MT_MIXED_ALL(__half)
MT_MIXED_ALL(__nv_bfloat16)

#undef MT_MIXED_ALL
#undef MT_MIXED_CMPS
#undef MT_MIXED_INTS
#undef MT_MIXED_CMP
#undef MT_MIXED_INT
#undef MT_MIXED_FLOAT

// The type MSL gives `a op b` (same type stays itself: no short -> int promotion).
template <class A, class B>
using mt_common_t = cuda::std::conditional_t<
    cuda::std::is_same_v<A, B>, A,
    decltype(cuda::std::declval<A>() + cuda::std::declval<B>())>;

}  // namespace metal
}  // namespace mlx::core::cu
