// mt_cuda/math.cuh: numeric limits and the MSL math library (precise:: and fast:: included).
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

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

}  // namespace metal
}  // namespace mlx::core::cu
