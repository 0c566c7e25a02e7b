// math.h: metal:: math, integer, relational and geometric functions, and metal::fast:: /
// metal::precise:: (both map to the same host functions: half and bfloat compute in float and
// round the result; float uses the host libm, which is at least as accurate as Metal's
// precise variants -- Apple's fast-math error bounds are not reproduced).
// Every function takes scalars or vectors (element-wise); mixed scalar types are promoted
// (min(uint, int) is accepted here even where a Metal compiler might call it ambiguous).
#pragma once

#include "mt_emu/vec.h"

namespace metal {

namespace detail {
template <class T> using fp_req = std::enable_if_t<mt::is_fp_v<T>, int>;
template <class T> using num_req = std::enable_if_t<mt::is_num_v<T>, int>;
template <class T> using int_req = std::enable_if_t<mt::is_int_v<T>, int>;
template <class A, class B> using fp2_req =
    std::enable_if_t<mt::is_num_v<A> && mt::is_num_v<B> && mt::is_fp_v<mt::common_t<A, B>>, int>;
template <class A, class B> using num2_req =
    std::enable_if_t<mt::is_num_v<A> && mt::is_num_v<B>, int>;
template <class A, class B> using vec2_req =
    std::enable_if_t<(mt::is_vec_v<A> || mt::is_vec_v<B>), int>;
template <class A, class B, class C> using vec3_req =
    std::enable_if_t<(mt::is_vec_v<A> || mt::is_vec_v<B> || mt::is_vec_v<C>), int>;
template <class A, class B, class C> struct vec3_type {
  using type = std::conditional_t<mt::is_vec_v<A>, mt::vec_of_t<A>,
               std::conditional_t<mt::is_vec_v<B>, mt::vec_of_t<B>, mt::vec_of_t<C>>>;
};
}  // namespace detail

// ---- one-argument floating-point functions --------------------------------------------------

#define MT_MATH1(name, expr)                                                                 \
  template <class T, detail::fp_req<T> = 0> inline T name(T x_) {                           \
    using C = mt::calc_t<T>;                                                                 \
    const C x = C(x_);                                                                       \
    return T(expr);                                                                          \
  }                                                                                          \
  template <class X, class V = mt::vec_of_t<X>> inline V name(const X& x_) {                \
    const V x = x_;                                                                          \
    V r;                                                                                     \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = name(x[i]);                          \
    return r;                                                                                \
  }

MT_MATH1(acos, std::acos(x))
MT_MATH1(acosh, std::acosh(x))
MT_MATH1(asin, std::asin(x))
MT_MATH1(asinh, std::asinh(x))
MT_MATH1(atan, std::atan(x))
MT_MATH1(atanh, std::atanh(x))
MT_MATH1(cos, std::cos(x))
MT_MATH1(cosh, std::cosh(x))
MT_MATH1(cospi, std::cos(x * C(3.14159265358979323846)))
MT_MATH1(exp, std::exp(x))
MT_MATH1(exp2, std::exp2(x))
MT_MATH1(exp10, std::pow(C(10), x))
MT_MATH1(fabs, std::fabs(x))
MT_MATH1(floor, std::floor(x))
MT_MATH1(ceil, std::ceil(x))
MT_MATH1(round, std::round(x))
MT_MATH1(rint, std::nearbyint(x))
MT_MATH1(trunc, std::trunc(x))
MT_MATH1(fract, std::fmin(x - std::floor(x), C(0x1.fffffep-1)))
MT_MATH1(log, std::log(x))
MT_MATH1(log2, std::log2(x))
MT_MATH1(log10, std::log10(x))
MT_MATH1(logb, std::logb(x))
MT_MATH1(rsqrt, C(1) / std::sqrt(x))
MT_MATH1(sin, std::sin(x))
MT_MATH1(sinh, std::sinh(x))
MT_MATH1(sinpi, std::sin(x * C(3.14159265358979323846)))
MT_MATH1(sqrt, std::sqrt(x))
MT_MATH1(cbrt, std::cbrt(x))
MT_MATH1(tan, std::tan(x))
MT_MATH1(tanh, std::tanh(x))
MT_MATH1(tanpi, std::tan(x * C(3.14159265358979323846)))
MT_MATH1(saturate, std::fmin(std::fmax(x, C(0)), C(1)))
MT_MATH1(sign, x > C(0) ? C(1) : x < C(0) ? C(-1) : std::isnan(x) ? C(0) : x)
MT_MATH1(erf, std::erf(x))
MT_MATH1(erfc, std::erfc(x))
MT_MATH1(lgamma, std::lgamma(x))
MT_MATH1(tgamma, std::tgamma(x))
MT_MATH1(log1p, std::log1p(x))
MT_MATH1(expm1, std::expm1(x))
#undef MT_MATH1

// ---- two- and three-argument functions -----------------------------------------------------

#define MT_MATH2(name, req, expr)                                                            \
  template <class A, class B, detail::req<A, B> = 0>                                         \
  inline mt::common_t<A, B> name(A a_, B b_) {                                               \
    using T = mt::common_t<A, B>;                                                            \
    using C = std::conditional_t<mt::is_fp_v<T>, mt::calc_t<T>, T>;                          \
    const C a = C(T(a_)), b = C(T(b_));                                                      \
    return T(expr);                                                                          \
  }                                                                                          \
  template <class A, class B, detail::vec2_req<A, B> = 0, class V = mt::binop_t<A, B>>      \
  inline V name(const A& a_, const B& b_) {                                                  \
    const V a = mt::to_vec<V>(a_), b = mt::to_vec<V>(b_);                                    \
    V r;                                                                                     \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = name(a[i], b[i]);                    \
    return r;                                                                                \
  }

MT_MATH2(atan2, fp2_req, std::atan2(a, b))
MT_MATH2(pow, fp2_req, std::pow(a, b))
MT_MATH2(powr, fp2_req, std::pow(a, b))
MT_MATH2(fmod, fp2_req, std::fmod(a, b))
MT_MATH2(remainder, fp2_req, std::remainder(a, b))
MT_MATH2(fmin, fp2_req, std::fmin(a, b))
MT_MATH2(fmax, fp2_req, std::fmax(a, b))
MT_MATH2(fdim, fp2_req, std::fdim(a, b))
MT_MATH2(copysign, fp2_req, std::copysign(a, b))
MT_MATH2(nextafter, fp2_req, std::nextafter(a, b))
MT_MATH2(step, fp2_req, b < a ? C(0) : C(1))
MT_MATH2(divide, fp2_req, a / b)
// min/max: the non-NaN operand wins for floating point (fmin/fmax), as on Apple GPUs
MT_MATH2(min, num2_req, mt::is_fp_v<T> ? (b < a || a != a ? b : a) : (b < a ? b : a))
MT_MATH2(max, num2_req, mt::is_fp_v<T> ? (a < b || a != a ? b : a) : (a < b ? b : a))
#undef MT_MATH2

template <class T, detail::num_req<T> = 0> inline T abs(T x) {
  if constexpr (mt::is_fp_v<T>) {
    return fabs(x);
  } else if constexpr (std::is_signed<T>::value) {
    return x < 0 ? T(-x) : x;
  } else {
    return x;
  }
}
template <class X, class V = mt::vec_of_t<X>> inline V abs(const X& x_) {
  const V x = x_;
  V r;
  for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = abs(x[i]);
  return r;
}

#define MT_MATH3(name, expr)                                                                 \
  template <class A, class B, class C_, std::enable_if_t<mt::is_num_v<A> && mt::is_num_v<B> && \
                                                             mt::is_num_v<C_>, int> = 0>     \
  inline mt::common_t<mt::common_t<A, B>, C_> name(A a_, B b_, C_ c_) {                      \
    using T = mt::common_t<mt::common_t<A, B>, C_>;                                          \
    using C = std::conditional_t<mt::is_fp_v<T>, mt::calc_t<T>, T>;                          \
    const C a = C(T(a_)), b = C(T(b_)), c = C(T(c_));                                        \
    return T(expr);                                                                          \
  }                                                                                          \
  template <class A, class B, class C_, detail::vec3_req<A, B, C_> = 0,                      \
            class V = typename detail::vec3_type<A, B, C_>::type>                            \
  inline V name(const A& a_, const B& b_, const C_& c_) {                                    \
    const V a = mt::to_vec<V>(a_), b = mt::to_vec<V>(b_), c = mt::to_vec<V>(c_);             \
    V r;                                                                                     \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = name(a[i], b[i], c[i]);              \
    return r;                                                                                \
  }

MT_MATH3(clamp, min(max(a, b), c))
MT_MATH3(mix, a + (b - a) * c)
MT_MATH3(fma, std::fma(a, b, c))
MT_MATH3(mad, a * b + c)
MT_MATH3(max3, max(max(a, b), c))
MT_MATH3(min3, min(min(a, b), c))
MT_MATH3(fmax3, max(max(a, b), c))
MT_MATH3(fmin3, min(min(a, b), c))
MT_MATH3(median3, max(min(a, b), min(max(a, b), c)))
MT_MATH3(fmedian3, max(min(a, b), min(max(a, b), c)))
MT_MATH3(smoothstep, [&] {
  C t = min(max((c - a) / (b - a), C(0)), C(1));
  return t * t * (C(3) - C(2) * t);
}())
#undef MT_MATH3

// ---- functions with an output argument ------------------------------------------------------

template <class T, detail::fp_req<T> = 0> inline T sincos(T x, T& cosval) {
  cosval = cos(x);
  return sin(x);
}
template <class T, detail::fp_req<T> = 0> inline T frexp(T x, int& e) {
  return T(std::frexp(mt::calc_t<T>(x), &e));
}
template <class T, detail::fp_req<T> = 0> inline T ldexp(T x, int e) {
  return T(std::ldexp(mt::calc_t<T>(x), e));
}
template <class T, detail::fp_req<T> = 0> inline T modf(T x, T& ip) {
  mt::calc_t<T> i;
  T f = T(std::modf(mt::calc_t<T>(x), &i));
  ip = T(i);
  return f;
}
template <class T, detail::fp_req<T> = 0> inline int ilogb(T x) {
  return std::ilogb(mt::calc_t<T>(x));
}

// ---- relational ----------------------------------------------------------------------------

#define MT_REL1(name, expr)                                                                  \
  template <class T, detail::fp_req<T> = 0> inline bool name(T x_) {                        \
    const mt::calc_t<T> x = mt::calc_t<T>(x_);                                               \
    return expr;                                                                             \
  }                                                                                          \
  template <class X, class V = mt::vec_of_t<X>>                                              \
  inline vec<bool, mt::vec_like<V>::n> name(const X& x_) {                                   \
    const V x = x_;                                                                          \
    vec<bool, mt::vec_like<V>::n> r;                                                         \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = name(x[i]);                          \
    return r;                                                                                \
  }
MT_REL1(isnan, std::isnan(x))
MT_REL1(isinf, std::isinf(x))
MT_REL1(isfinite, std::isfinite(x))
MT_REL1(isnormal, std::isnormal(x))
MT_REL1(signbit, std::signbit(x))
#undef MT_REL1

template <class T, detail::fp_req<T> = 0> inline bool isordered(T a, T b) {
  return !(isnan(a) || isnan(b));
}
template <class T, detail::fp_req<T> = 0> inline bool isunordered(T a, T b) {
  return isnan(a) || isnan(b);
}

inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class X, class V = mt::vec_of_t<X>> inline bool all(const X& x_) {
  const V x = x_;
  for (int i = 0; i < mt::vec_like<V>::n; ++i)
    if (!x[i]) return false;
  return true;
}
template <class X, class V = mt::vec_of_t<X>> inline bool any(const X& x_) {
  const V x = x_;
  for (int i = 0; i < mt::vec_like<V>::n; ++i)
    if (x[i]) return true;
  return false;
}

// select(a, b, c): c ? b : a, element-wise for vectors
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class X, class Y, class C, class V = mt::binop_t<X, Y>,
          std::enable_if_t<mt::is_vec_v<C>, int> = 0>
inline V select(const X& a_, const Y& b_, const C& c_) {
  const V a = mt::to_vec<V>(a_), b = mt::to_vec<V>(b_);
  const mt::vec_of_t<C> c = c_;
  V r;
  for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

// ---- integer functions ----------------------------------------------------------------------

#define MT_INT1(name, expr)                                                                  \
  template <class T, detail::int_req<T> = 0> inline T name(T x) {                           \
    using U = std::make_unsigned_t<T>;                                                       \
    const U u = U(x);                                                                        \
    constexpr int bits = int(sizeof(T) * 8);                                                 \
    (void)u;                                                                                 \
    (void)bits;                                                                              \
    return T(expr);                                                                          \
  }                                                                                          \
  template <class X, class V = mt::vec_of_t<X>,                                              \
            std::enable_if_t<mt::is_int_v<typename V::value_type>, int> = 0>                 \
  inline V name(const X& x_) {                                                               \
    const V x = x_;                                                                          \
    V r;                                                                                     \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = name(x[i]);                          \
    return r;                                                                                \
  }
MT_INT1(clz, u == 0 ? bits : __builtin_clzll((unsigned long long)u) - (64 - bits))
MT_INT1(ctz, u == 0 ? bits : __builtin_ctzll((unsigned long long)u))
MT_INT1(popcount, __builtin_popcountll((unsigned long long)u))
MT_INT1(reverse_bits, [&] {
  U r = 0;
  for (int i = 0; i < bits; ++i) r = U(r | (((u >> i) & 1u) << (bits - 1 - i)));
  return r;
}())
#undef MT_INT1

#define MT_INT2(name, expr)                                                                  \
  template <class T, detail::int_req<T> = 0> inline T name(T x, T y) {                      \
    using W = std::conditional_t<std::is_signed<T>::value, __int128, unsigned __int128>;     \
    (void)sizeof(W);                                                                         \
    return T(expr);                                                                          \
  }                                                                                          \
  template <class A, class B, detail::vec2_req<A, B> = 0, class V = mt::binop_t<A, B>,      \
            std::enable_if_t<mt::is_int_v<typename V::value_type>, int> = 0>                 \
  inline V name(const A& a_, const B& b_) {                                                  \
    const V a = mt::to_vec<V>(a_), b = mt::to_vec<V>(b_);                                    \
    V r;                                                                                     \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = name(a[i], b[i]);                    \
    return r;                                                                                \
  }
MT_INT2(absdiff, x > y ? W(x) - W(y) : W(y) - W(x))
MT_INT2(hadd, (W(x) + W(y)) >> 1)
MT_INT2(rhadd, (W(x) + W(y) + 1) >> 1)
MT_INT2(mulhi, (W(x) * W(y)) >> (8 * sizeof(T)))
MT_INT2(addsat, std::min<W>(std::max<W>(W(x) + W(y), W(std::numeric_limits<T>::min())),
                            W(std::numeric_limits<T>::max())))
MT_INT2(subsat, std::min<W>(std::max<W>(W(x) - W(y), W(std::numeric_limits<T>::min())),
                            W(std::numeric_limits<T>::max())))
MT_INT2(mul24, x * y)
MT_INT2(rotate, [&] {
  using U = std::make_unsigned_t<T>;
  constexpr int bits = int(sizeof(T) * 8);
  int s = int(U(y) % bits);
  return s ? T(U(U(x) << s) | U(U(x) >> (bits - s))) : x;
}())
#undef MT_INT2

template <class T, detail::int_req<T> = 0> inline T mad24(T a, T b, T c) { return a * b + c; }
template <class T, detail::int_req<T> = 0> inline T extract_bits(T x, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return T(0);
  U u = U(U(x) >> offset);
  if (bits >= sizeof(T) * 8) return T(u);
  U mask = U((U(1) << bits) - 1);
  u &= mask;
  if (std::is_signed<T>::value && (u >> (bits - 1)) & 1) u |= U(~mask);  // sign-extend
  return T(u);
}
template <class T, detail::int_req<T> = 0>
inline T insert_bits(T base, T insert, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return base;
  U mask = bits >= sizeof(T) * 8 ? U(~U(0)) : U((U(1) << bits) - 1);
  mask = U(mask << offset);
  return T((U(base) & U(~mask)) | (U(U(insert) << offset) & mask));
}

// ---- geometric ------------------------------------------------------------------------------

template <class A, class B, class V = mt::binop_t<A, B>, std::enable_if_t<mt::is_vec_v<A>, int> = 0>
inline typename V::value_type dot(const A& a_, const B& b_) {
  const V a = mt::to_vec<V>(a_), b = mt::to_vec<V>(b_);
  using T = typename V::value_type;
  T s = T(0);
  for (int i = 0; i < mt::vec_like<V>::n; ++i) s = T(s + a[i] * b[i]);
  return s;
}
template <class X, class V = mt::vec_of_t<X>> inline typename V::value_type length_squared(const X& x) {
  return dot(V(x), V(x));
}
template <class X, class V = mt::vec_of_t<X>> inline typename V::value_type length(const X& x) {
  return sqrt(length_squared(x));
}
template <class A, class B, class V = mt::binop_t<A, B>, std::enable_if_t<mt::is_vec_v<A>, int> = 0>
inline typename V::value_type distance(const A& a, const B& b) {
  return length(V(a) - V(b));
}
template <class A, class B, class V = mt::binop_t<A, B>, std::enable_if_t<mt::is_vec_v<A>, int> = 0>
inline typename V::value_type distance_squared(const A& a, const B& b) {
  return length_squared(V(a) - V(b));
}
template <class X, class V = mt::vec_of_t<X>> inline V normalize(const X& x) {
  return V(x) * rsqrt(length_squared(x));
}
template <class T> inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// ---- fast:: and precise:: -------------------------------------------------------------------

#define MT_NS_FUNCS                                                                          \
  using metal::acos; using metal::acosh; using metal::asin; using metal::asinh;             \
  using metal::atan; using metal::atan2; using metal::atanh; using metal::cos;              \
  using metal::cosh; using metal::cospi; using metal::divide; using metal::exp;             \
  using metal::exp10; using metal::exp2; using metal::fabs; using metal::abs;               \
  using metal::floor; using metal::ceil; using metal::fmax; using metal::fmin;              \
  using metal::fmod; using metal::fract; using metal::log; using metal::log10;              \
  using metal::log2; using metal::pow; using metal::powr; using metal::rint;                \
  using metal::round; using metal::rsqrt; using metal::sin; using metal::sincos;            \
  using metal::sinh; using metal::sinpi; using metal::sqrt; using metal::tan;               \
  using metal::tanh; using metal::tanpi; using metal::trunc; using metal::max;              \
  using metal::min; using metal::clamp; using metal::saturate; using metal::normalize;      \
  using metal::length; using metal::distance; using metal::dot; using metal::max3;          \
  using metal::min3; using metal::fmax3; using metal::fmin3; using metal::median3;          \
  using metal::fmedian3; using metal::sign; using metal::step; using metal::mix;            \
  using metal::fma; using metal::copysign;
namespace fast {
MT_NS_FUNCS
}
namespace precise {
MT_NS_FUNCS
}
#undef MT_NS_FUNCS

}  // namespace metal
