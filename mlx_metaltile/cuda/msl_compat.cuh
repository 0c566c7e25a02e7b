// msl_compat.cuh: the subset of the Metal Shading Language that mlx-metaltile kernels use,
// implemented in CUDA C++ so the same kernel bodies compile under mx.fast.cuda_kernel.
//
// How it is used (mlx_metaltile/cuda/_translate.py): MLX's CUDA JIT puts its own
// device utils first, then our header (this file + the template's MSL helpers wrapped in
// `namespace mlx::core::cu`), then the generated `__global__` function holding the body.
// Everything below lives in `mlx::core::cu::metal` and is pulled into `mlx::core::cu` with a
// using-directive, so inside the kernel our `float4`, `uint3`, `min`, ... hide CUDA's global
// ones of the same name.
//
// Conventions followed here:
//  * half / bfloat are CUDA's __half / __nv_bfloat16 (what MLX passes for float16 /
//    bfloat16 arrays), with MSL's arithmetic: half op float -> float, half op int -> half.
//  * SIMD-groups are CUDA warps (both 32 lanes). SIMD functions act on the lanes active at
//    the call (__activemask()), as in MSL; with every lane active they use butterflies.
//  * simdgroup_matrix<T, 8, 8> keeps Apple's per-lane layout: lane l holds row
//    (l/16)*4 + ((l/2)%4), columns ((l/8)%2)*4 + (l%2)*2 + {0, 1}.
//  * Every function is __device__ explicitly: MLX's NVRTC would treat unannotated
//    functions as device code, nvcc (the CI compile check) would not.
#ifndef MLX_METALTILE_MSL_COMPAT_CUH
#define MLX_METALTILE_MSL_COMPAT_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/limits>
#include <cuda/std/type_traits>

#define MT_FN __device__ __forceinline__

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

// ---- vector types ------------------------------------------------------------------------
// Size and alignment as in MSL: vec<T, 3> occupies 4 elements.

template <class T, int N>
struct vec;

#define MT_VEC_COMMON(N)                                                           \
  vec() = default;                                                                 \
  MT_FN vec(T s) { /* scalar broadcast is implicit in MSL */                       \
    _Pragma("unroll") for (int i = 0; i < N; ++i)(*this)[i] = s;                   \
  }                                                                                \
  template <class U, class = cuda::std::enable_if_t<!cuda::std::is_same_v<U, T>>>  \
  MT_FN explicit vec(const vec<U, N>& o) {                                         \
    _Pragma("unroll") for (int i = 0; i < N; ++i)(*this)[i] = mt_cast<T>(o[i]);    \
  }                                                                                \
  MT_FN T& operator[](int i) { return (&x)[i]; }                                   \
  MT_FN const T& operator[](int i) const { return (&x)[i]; }

template <class T>
struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  MT_VEC_COMMON(2)
  MT_FN vec(T a, T b) : x(a), y(b) {}
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  MT_VEC_COMMON(3)
  MT_FN vec(T a, T b, T c) : x(a), y(b), z(c) {}
  MT_FN vec(const vec<T, 2>& a, T c) : x(a.x), y(a.y), z(c) {}
  MT_FN vec(T a, const vec<T, 2>& b) : x(a), y(b.x), z(b.y) {}
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  MT_VEC_COMMON(4)
  MT_FN vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  MT_FN vec(const vec<T, 2>& a, const vec<T, 2>& b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
  MT_FN vec(const vec<T, 3>& a, T d) : x(a.x), y(a.y), z(a.z), w(d) {}
  MT_FN vec(T a, const vec<T, 3>& b) : x(a), y(b.x), z(b.y), w(b.z) {}
  MT_FN vec(const vec<T, 2>& a, T c, T d) : x(a.x), y(a.y), z(c), w(d) {}
  MT_FN vec(T a, const vec<T, 2>& b, T d) : x(a), y(b.x), z(b.y), w(d) {}
  MT_FN vec(T a, T b, const vec<T, 2>& c) : x(a), y(b), z(c.x), w(c.y) {}
};

#undef MT_VEC_COMMON

#define MT_VEC_ALIASES(T, NAME) \
  using NAME##2 = vec<T, 2>;    \
  using NAME##3 = vec<T, 3>;    \
  using NAME##4 = vec<T, 4>;

MT_VEC_ALIASES(float, float)
MT_VEC_ALIASES(__half, half)
MT_VEC_ALIASES(__nv_bfloat16, bfloat)
MT_VEC_ALIASES(int, int)
MT_VEC_ALIASES(unsigned int, uint)
MT_VEC_ALIASES(short, short)
MT_VEC_ALIASES(unsigned short, ushort)
MT_VEC_ALIASES(char, char)
MT_VEC_ALIASES(unsigned char, uchar)
MT_VEC_ALIASES(long long, long)
MT_VEC_ALIASES(unsigned long long, ulong)
MT_VEC_ALIASES(bool, bool)
#undef MT_VEC_ALIASES

template <class T>
struct mt_is_vec : cuda::std::false_type {};
template <class T, int N>
struct mt_is_vec<vec<T, N>> : cuda::std::true_type {};

// Element-wise operators: vec op vec, vec op scalar, scalar op vec (scalar converted to T).
#define MT_VEC_BINOP(OP)                                                            \
  template <class T, int N>                                                         \
  MT_FN auto operator OP(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                    \
    _Pragma("unroll") for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);           \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N>                                                         \
  MT_FN auto operator OP(const vec<T, N>& a, mt_id_t<T> b) {                        \
    vec<T, N> r;                                                                    \
    _Pragma("unroll") for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b);              \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N>                                                         \
  MT_FN auto operator OP(mt_id_t<T> a, const vec<T, N>& b) {                        \
    vec<T, N> r;                                                                    \
    _Pragma("unroll") for (int i = 0; i < N; ++i) r[i] = T(a OP b[i]);              \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N>                                                         \
  MT_FN vec<T, N>& operator OP##=(vec<T, N>& a, const vec<T, N>& b) {               \
    return a = a OP b;                                                              \
  }                                                                                 \
  template <class T, int N>                                                         \
  MT_FN vec<T, N>& operator OP##=(vec<T, N>& a, mt_id_t<T> b) {                     \
    return a = a OP b;                                                              \
  }

MT_VEC_BINOP(+)
MT_VEC_BINOP(-)
MT_VEC_BINOP(*)
MT_VEC_BINOP(/)
MT_VEC_BINOP(%)
MT_VEC_BINOP(&)
MT_VEC_BINOP(|)
MT_VEC_BINOP(^)
MT_VEC_BINOP(<<)
MT_VEC_BINOP(>>)
#undef MT_VEC_BINOP

#define MT_VEC_CMP(OP)                                                              \
  template <class T, int N>                                                         \
  MT_FN vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {          \
    vec<bool, N> r;                                                                 \
    _Pragma("unroll") for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];              \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N>                                                         \
  MT_FN vec<bool, N> operator OP(const vec<T, N>& a, mt_id_t<T> b) {                \
    return a OP vec<T, N>(b);                                                       \
  }                                                                                 \
  template <class T, int N>                                                         \
  MT_FN vec<bool, N> operator OP(mt_id_t<T> a, const vec<T, N>& b) {                \
    return vec<T, N>(a) OP b;                                                       \
  }

MT_VEC_CMP(==)
MT_VEC_CMP(!=)
MT_VEC_CMP(<)
MT_VEC_CMP(>)
MT_VEC_CMP(<=)
MT_VEC_CMP(>=)
MT_VEC_CMP(&&)
MT_VEC_CMP(||)
#undef MT_VEC_CMP

template <class T, int N>
MT_FN vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}
template <class T, int N>
MT_FN vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = T(~a[i]);
  return r;
}
template <int N>
MT_FN vec<bool, N> operator!(const vec<bool, N>& a) {
  vec<bool, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}

template <int N>
MT_FN bool all(const vec<bool, N>& v) {
  bool r = true;
#pragma unroll
  for (int i = 0; i < N; ++i) r = r && v[i];
  return r;
}
template <int N>
MT_FN bool any(const vec<bool, N>& v) {
  bool r = false;
#pragma unroll
  for (int i = 0; i < N; ++i) r = r || v[i];
  return r;
}
MT_FN bool all(bool v) { return v; }
MT_FN bool any(bool v) { return v; }

// ---- as_type, select ---------------------------------------------------------------------

template <class To, class From>
MT_FN To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and result sizes differ");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}

template <class T>
MT_FN T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N>
MT_FN vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }
template <class T, int N>
MT_FN vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

// ---- numeric limits and constants --------------------------------------------------------

template <class T>
using numeric_limits = cuda::std::numeric_limits<T>;

// ---- math --------------------------------------------------------------------------------
// float versions call CUDA's; half and bfloat compute in float and round once; vectors apply
// the scalar function per element. `precise::` is at least as accurate as the default and
// `fast::` uses the hardware approximations (MSL's fast-math defaults).

#define MT_MATH_UNARY(NAME, FLOAT_EXPR)                                            \
  MT_FN float NAME(float x) { return FLOAT_EXPR; }                                 \
  MT_FN __half NAME(__half h) {                                                    \
    const float x = float(h);                                                      \
    return __half(FLOAT_EXPR);                                                     \
  }                                                                                \
  MT_FN __nv_bfloat16 NAME(__nv_bfloat16 h) {                                      \
    const float x = float(h);                                                      \
    return __nv_bfloat16(FLOAT_EXPR);                                              \
  }                                                                                \
  template <class T, int N>                                                        \
  MT_FN vec<T, N> NAME(const vec<T, N>& v) {                                       \
    vec<T, N> r;                                                                   \
    _Pragma("unroll") for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);               \
    return r;                                                                      \
  }

#define MT_MATH_BINARY(NAME, FLOAT_EXPR)                                           \
  MT_FN float NAME(float x, float y) { return FLOAT_EXPR; }                        \
  MT_FN __half NAME(__half a, __half b) {                                          \
    const float x = float(a), y = float(b);                                        \
    return __half(FLOAT_EXPR);                                                     \
  }                                                                                \
  MT_FN __nv_bfloat16 NAME(__nv_bfloat16 a, __nv_bfloat16 b) {                     \
    const float x = float(a), y = float(b);                                        \
    return __nv_bfloat16(FLOAT_EXPR);                                              \
  }                                                                                \
  template <class T, int N>                                                        \
  MT_FN vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {                   \
    vec<T, N> r;                                                                   \
    _Pragma("unroll") for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b[i]);         \
    return r;                                                                      \
  }                                                                                \
  template <class T, int N>                                                        \
  MT_FN vec<T, N> NAME(const vec<T, N>& a, mt_id_t<T> b) {                         \
    return NAME(a, vec<T, N>(b));                                                  \
  }

// The functions whose precise and default forms agree.
#define MT_MATH_COMMON_FUNCTIONS                                                   \
  MT_MATH_UNARY(fabs, fabsf(x))                                                    \
  MT_MATH_UNARY(sqrt, sqrtf(x))                                                    \
  MT_MATH_UNARY(floor, floorf(x))                                                  \
  MT_MATH_UNARY(ceil, ceilf(x))                                                    \
  MT_MATH_UNARY(round, roundf(x))                                                  \
  MT_MATH_UNARY(rint, rintf(x))                                                    \
  MT_MATH_UNARY(trunc, truncf(x))                                                  \
  MT_MATH_UNARY(fract, fminf(x - floorf(x), 0x1.fffffep-1f))                       \
  MT_MATH_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? x : 0.0f)))  \
  MT_MATH_UNARY(saturate, fminf(fmaxf(x, 0.0f), 1.0f))                             \
  MT_MATH_UNARY(asin, asinf(x))                                                    \
  MT_MATH_UNARY(acos, acosf(x))                                                    \
  MT_MATH_UNARY(atan, atanf(x))                                                    \
  MT_MATH_UNARY(sinh, sinhf(x))                                                    \
  MT_MATH_UNARY(cosh, coshf(x))                                                    \
  MT_MATH_UNARY(asinh, asinhf(x))                                                  \
  MT_MATH_UNARY(acosh, acoshf(x))                                                  \
  MT_MATH_UNARY(atanh, atanhf(x))                                                  \
  MT_MATH_BINARY(fmin, fminf(x, y))                                                \
  MT_MATH_BINARY(fmax, fmaxf(x, y))                                                \
  MT_MATH_BINARY(fmod, fmodf(x, y))                                                \
  MT_MATH_BINARY(atan2, atan2f(x, y))                                              \
  MT_MATH_BINARY(copysign, copysignf(x, y))                                        \
  MT_MATH_BINARY(step, y < x ? 0.0f : 1.0f) /* step(edge, x) */

MT_MATH_COMMON_FUNCTIONS
MT_MATH_UNARY(exp, expf(x))
MT_MATH_UNARY(exp2, exp2f(x))
MT_MATH_UNARY(exp10, exp10f(x))
MT_MATH_UNARY(log, logf(x))
MT_MATH_UNARY(log2, log2f(x))
MT_MATH_UNARY(log10, log10f(x))
MT_MATH_UNARY(rsqrt, rsqrtf(x))
MT_MATH_UNARY(sin, sinf(x))
MT_MATH_UNARY(cos, cosf(x))
MT_MATH_UNARY(tan, tanf(x))
MT_MATH_UNARY(tanh, tanhf(x))
MT_MATH_BINARY(pow, powf(x, y))
MT_MATH_BINARY(powr, powf(x, y))
MT_MATH_BINARY(divide, x / y)

namespace precise {
MT_MATH_COMMON_FUNCTIONS
MT_MATH_UNARY(exp, expf(x))
MT_MATH_UNARY(exp2, exp2f(x))
MT_MATH_UNARY(exp10, exp10f(x))
MT_MATH_UNARY(log, logf(x))
MT_MATH_UNARY(log2, log2f(x))
MT_MATH_UNARY(log10, log10f(x))
MT_MATH_UNARY(rsqrt, 1.0f / sqrtf(x))  // correctly rounded sqrt and division
MT_MATH_UNARY(sin, sinf(x))
MT_MATH_UNARY(cos, cosf(x))
MT_MATH_UNARY(tan, tanf(x))
MT_MATH_UNARY(tanh, tanhf(x))
MT_MATH_BINARY(pow, powf(x, y))
MT_MATH_BINARY(powr, powf(x, y))
MT_MATH_BINARY(divide, x / y)
}  // namespace precise

namespace fast {
MT_MATH_COMMON_FUNCTIONS
MT_MATH_UNARY(exp, __expf(x))
MT_MATH_UNARY(exp2, exp2f(x))
MT_MATH_UNARY(exp10, __exp10f(x))
MT_MATH_UNARY(log, __logf(x))
MT_MATH_UNARY(log2, __log2f(x))
MT_MATH_UNARY(log10, __log10f(x))
MT_MATH_UNARY(rsqrt, rsqrtf(x))
MT_MATH_UNARY(sin, __sinf(x))
MT_MATH_UNARY(cos, __cosf(x))
MT_MATH_UNARY(tan, __tanf(x))
MT_MATH_UNARY(tanh, tanhf(x))
MT_MATH_BINARY(pow, __powf(x, y))
MT_MATH_BINARY(powr, __powf(x, y))
MT_MATH_BINARY(divide, __fdividef(x, y))
}  // namespace fast

#undef MT_MATH_COMMON_FUNCTIONS

MT_FN bool isnan(float x) { return x != x; }
MT_FN bool isinf(float x) { return fabsf(x) == cuda::std::numeric_limits<float>::infinity(); }
MT_FN bool isfinite(float x) { return fabsf(x) < cuda::std::numeric_limits<float>::infinity(); }
MT_FN bool signbit(float x) { return (__float_as_uint(x) >> 31) != 0u; }
MT_FN bool isnan(__half x) { return isnan(float(x)); }
MT_FN bool isinf(__half x) { return isinf(float(x)); }
MT_FN bool isfinite(__half x) { return isfinite(float(x)); }
MT_FN bool signbit(__half x) { return signbit(float(x)); }
MT_FN bool isnan(__nv_bfloat16 x) { return isnan(float(x)); }
MT_FN bool isinf(__nv_bfloat16 x) { return isinf(float(x)); }
MT_FN bool isfinite(__nv_bfloat16 x) { return isfinite(float(x)); }
MT_FN bool signbit(__nv_bfloat16 x) { return signbit(float(x)); }

// abs: float-like through fabs, integers by value.
MT_FN float abs(float x) { return fabsf(x); }
MT_FN __half abs(__half x) { return __habs(x); }
MT_FN __nv_bfloat16 abs(__nv_bfloat16 x) { return __habs(x); }
MT_FN int abs(int x) { return x < 0 ? -x : x; }
MT_FN long abs(long x) { return x < 0 ? -x : x; }
MT_FN long long abs(long long x) { return x < 0 ? -x : x; }
MT_FN short abs(short x) { return short(x < 0 ? -x : x); }
MT_FN char abs(char x) { return char(x < 0 ? -x : x); }
template <class T, cuda::std::enable_if_t<cuda::std::is_unsigned_v<T>, int> = 0>
MT_FN T abs(T x) { return x; }
template <class T, int N>
MT_FN vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}

// min / max / clamp for any two scalar types (the result type follows MSL's promotion);
// float-like arguments go through fmin/fmax (the non-NaN operand wins).
template <class A, class B, cuda::std::enable_if_t<!mt_is_vec<A>::value && !mt_is_vec<B>::value, int> = 0>
MT_FN mt_common_t<A, B> min(A a, B b) {
  using C = mt_common_t<A, B>;
  if constexpr (cuda::std::is_same_v<C, float> || mt_half_like<C>::value) {
    return C(fminf(float(C(a)), float(C(b))));
  } else {
    return C(b) < C(a) ? C(b) : C(a);
  }
}
template <class A, class B, cuda::std::enable_if_t<!mt_is_vec<A>::value && !mt_is_vec<B>::value, int> = 0>
MT_FN mt_common_t<A, B> max(A a, B b) {
  using C = mt_common_t<A, B>;
  if constexpr (cuda::std::is_same_v<C, float> || mt_half_like<C>::value) {
    return C(fmaxf(float(C(a)), float(C(b))));
  } else {
    return C(a) < C(b) ? C(b) : C(a);
  }
}
template <class T, int N>
MT_FN vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N>
MT_FN vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N>
MT_FN vec<T, N> min(const vec<T, N>& a, mt_id_t<T> b) { return min(a, vec<T, N>(b)); }
template <class T, int N>
MT_FN vec<T, N> max(const vec<T, N>& a, mt_id_t<T> b) { return max(a, vec<T, N>(b)); }

template <class X, class L, class H>
MT_FN auto clamp(X x, L lo, H hi) { return min(max(x, lo), hi); }

MT_FN float fma(float a, float b, float c) { return fmaf(a, b, c); }
MT_FN __half fma(__half a, __half b, __half c) { return __hfma(a, b, c); }
MT_FN __nv_bfloat16 fma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __hfma(a, b, c);
}
template <class T, int N>
MT_FN vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}

template <class T, class A>
MT_FN T mix(T x, T y, A a) { return x + (y - x) * a; }

template <class T, int N>
MT_FN T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T r = a[0] * b[0];
#pragma unroll
  for (int i = 1; i < N; ++i) r = r + a[i] * b[i];
  return r;
}
template <class T, int N>
MT_FN T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }

MT_FN uint popcount(uint x) { return __popc(x); }
MT_FN ulong popcount(ulong x) { return __popcll(x); }
MT_FN uint clz(uint x) { return __clz(x); }
MT_FN uint ctz(uint x) { return x == 0 ? 32u : uint(__ffs(x) - 1); }
MT_FN uint mulhi(uint a, uint b) { return __umulhi(a, b); }
MT_FN int mulhi(int a, int b) { return __mulhi(a, b); }

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

// ---- simdgroup_matrix<T, 8, 8> -----------------------------------------------------------
// Apple's layout: lane l = b4 b3 b2 b1 b0 (bits) holds row 4*b4 + 2*b2 + b1 and columns
// 4*b3 + 2*b0 + {0, 1}. The products use warp shuffles and float FMAs (no tensor cores).

MT_FN uint mt_sg_row(uint lane) { return ((lane >> 2) & 4u) + ((lane >> 1) & 3u); }
MT_FN uint mt_sg_col(uint lane) { return ((lane >> 1) & 4u) + ((lane & 1u) << 1); }
// The lane holding element (row, col) (and its neighbour col ^ 1).
MT_FN uint mt_sg_owner(uint row, uint col) {
  return ((col >> 1) & 1u) | ((row & 1u) << 1) | (((row >> 1) & 1u) << 2) |
         (((col >> 2) & 1u) << 3) | (((row >> 2) & 1u) << 4);
}

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "only simdgroup_matrix<T, 8, 8> is supported");
  vec<T, 2> elems;

  simdgroup_matrix() = default;
  // MSL's diagonal constructor: `value` on the diagonal, zero elsewhere.
  MT_FN explicit simdgroup_matrix(T value) {
    const uint lane = mt_lane();
    const uint row = mt_sg_row(lane), col = mt_sg_col(lane);
    elems = vec<T, 2>(row == col ? value : T(0), row == col + 1 ? value : T(0));
  }
  MT_FN vec<T, 2>& thread_elements() { return elems; }
  MT_FN const vec<T, 2>& thread_elements() const { return elems; }
};

using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<__half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<__nv_bfloat16, 8, 8>;

template <class T, int Cols, int Rows>
MT_FN simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elems = vec<T, 2>(value);
  return m;
}

// Element (r, c) of the 8x8 block is src[(origin.y + r) * elements_per_row + origin.x + c];
// with transpose_matrix the block read that way is stored transposed.
template <class T, class U>
MT_FN void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src,
                          ulong elements_per_row = 8, ulong2 matrix_origin = ulong2(0),
                          bool transpose_matrix = false) {
  const uint lane = mt_lane();
  const ulong row = mt_sg_row(lane), col = mt_sg_col(lane);
  const U* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const ulong r = transpose_matrix ? col + j : row;
    const ulong c = transpose_matrix ? row : col + j;
    d.elems[j] = mt_cast<T>(base[r * elements_per_row + c]);
  }
}

template <class T, class U>
MT_FN void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, U* dst,
                           ulong elements_per_row = 8, ulong2 matrix_origin = ulong2(0),
                           bool transpose_matrix = false) {
  const uint lane = mt_lane();
  const ulong row = mt_sg_row(lane), col = mt_sg_col(lane);
  U* base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const ulong r = transpose_matrix ? col + j : row;
    const ulong c = transpose_matrix ? row : col + j;
    base[r * elements_per_row + c] = mt_cast<U>(a.elems[j]);
  }
}

// D = A * B + C over the whole SIMD-group (all 32 lanes must call it), in float.
template <class TD, class TA, class TB, class TC>
MT_FN void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                         const simdgroup_matrix<TA, 8, 8>& a,
                                         const simdgroup_matrix<TB, 8, 8>& b,
                                         const simdgroup_matrix<TC, 8, 8>& c) {
  const uint lane = mt_lane();
  const uint row = mt_sg_row(lane), col = mt_sg_col(lane);
  float acc0 = mt_cast<float>(c.elems[0]);
  float acc1 = mt_cast<float>(c.elems[1]);
#pragma unroll
  for (uint k = 0; k < 8; k += 2) {
    // A(row, k), A(row, k + 1) sit in one lane; so do B(k, col..col+1) and B(k+1, col..).
    const vec<TA, 2> a_pair = mt_shfl(0xffffffffu, a.elems, int(mt_sg_owner(row, k)));
    const vec<TB, 2> b_k0 = mt_shfl(0xffffffffu, b.elems, int(mt_sg_owner(k, col)));
    const vec<TB, 2> b_k1 = mt_shfl(0xffffffffu, b.elems, int(mt_sg_owner(k + 1, col)));
    const float a0 = mt_cast<float>(a_pair[0]), a1 = mt_cast<float>(a_pair[1]);
    acc0 = fmaf(a0, mt_cast<float>(b_k0[0]), acc0);
    acc1 = fmaf(a0, mt_cast<float>(b_k0[1]), acc1);
    acc0 = fmaf(a1, mt_cast<float>(b_k1[0]), acc0);
    acc1 = fmaf(a1, mt_cast<float>(b_k1[1]), acc1);
  }
  d.elems = vec<TD, 2>(mt_cast<TD>(acc0), mt_cast<TD>(acc1));
}

template <class TD, class TA, class TB>
MT_FN void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                              const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal

using namespace metal;

}  // namespace mlx::core::cu

// ---- MSL spellings that are not C++ ------------------------------------------------------

// Kernel-scope threadgroup arrays, as the shared pre-pass writes them. (The address-space
// words device / constant / thread / threadgroup are erased from the source text by the
// translation, not by macros here: `device` and `constant` are also spelled inside CUDA's
// own __device__ / __constant__ macros.)
#define MT_THREADGROUP_ARRAY(name, dims, ...) __shared__ __VA_ARGS__ name dims

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

#endif  // MLX_METALTILE_MSL_COMPAT_CUH
