// scalar.h: MSL scalar types on the host compiler.
//
//   half    = _Float16 (IEEE binary16; GCC rounds every half operation to half, as a GPU does)
//   bfloat  = a 16-bit class: float arithmetic rounded to nearest-even on every result.
//             As in MSL, bfloat converts implicitly to float but nothing converts implicitly
//             to bfloat (write bfloat(x) / static_cast<bfloat>(x)).
//   uint, ushort, uchar, ulong (64-bit), long (64-bit), char (signed 8-bit).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>
#include <utility>

#include "mt_emu/abi.h"

typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

namespace metal {

struct bfloat {
  uint16_t bits;

  bfloat() = default;
  template <class U, class = std::enable_if_t<std::is_arithmetic<U>::value ||
                                              std::is_same<U, _Float16>::value>>
  constexpr explicit bfloat(U v) : bits(round(float(v))) {}

  constexpr operator float() const {
    return __builtin_bit_cast(float, uint32_t(bits) << 16);
  }
  static constexpr bfloat from_bits(uint16_t b) {
    bfloat r{};
    r.bits = b;
    return r;
  }
  // float -> bfloat, round to nearest even; NaN stays a quiet NaN of the same sign.
  static constexpr uint16_t round(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }

  friend constexpr bfloat operator+(bfloat a, bfloat b) { return bfloat(float(a) + float(b)); }
  friend constexpr bfloat operator-(bfloat a, bfloat b) { return bfloat(float(a) - float(b)); }
  friend constexpr bfloat operator*(bfloat a, bfloat b) { return bfloat(float(a) * float(b)); }
  friend constexpr bfloat operator/(bfloat a, bfloat b) { return bfloat(float(a) / float(b)); }
  // bfloat op integer -> bfloat (MSL's usual arithmetic conversions: the integer becomes a
  // bfloat); without these the implicit conversion to float would make the result a float.
  template <class I>
  using if_int = std::enable_if_t<std::is_integral<I>::value && !std::is_same<I, bool>::value, bfloat>;
  template <class I> friend constexpr if_int<I> operator+(bfloat a, I b) { return a + bfloat(b); }
  template <class I> friend constexpr if_int<I> operator-(bfloat a, I b) { return a - bfloat(b); }
  template <class I> friend constexpr if_int<I> operator*(bfloat a, I b) { return a * bfloat(b); }
  template <class I> friend constexpr if_int<I> operator/(bfloat a, I b) { return a / bfloat(b); }
  template <class I> friend constexpr if_int<I> operator+(I a, bfloat b) { return bfloat(a) + b; }
  template <class I> friend constexpr if_int<I> operator-(I a, bfloat b) { return bfloat(a) - b; }
  template <class I> friend constexpr if_int<I> operator*(I a, bfloat b) { return bfloat(a) * b; }
  template <class I> friend constexpr if_int<I> operator/(I a, bfloat b) { return bfloat(a) / b; }
  friend constexpr bfloat operator-(bfloat a) { return from_bits(uint16_t(a.bits ^ 0x8000u)); }
  friend constexpr bfloat operator+(bfloat a) { return a; }
  bfloat& operator+=(bfloat b) { return *this = *this + b; }
  bfloat& operator-=(bfloat b) { return *this = *this - b; }
  bfloat& operator*=(bfloat b) { return *this = *this * b; }
  bfloat& operator/=(bfloat b) { return *this = *this / b; }
  bfloat& operator+=(float b) { return *this = bfloat(float(*this) + b); }
  bfloat& operator-=(float b) { return *this = bfloat(float(*this) - b); }
  bfloat& operator*=(float b) { return *this = bfloat(float(*this) * b); }
  bfloat& operator/=(float b) { return *this = bfloat(float(*this) / b); }
  bfloat& operator++() { return *this += 1.0f; }
  bfloat& operator--() { return *this -= 1.0f; }
};

}  // namespace metal

using metal::bfloat;

namespace mt {

template <class T> struct is_fp : std::is_floating_point<T> {};
template <> struct is_fp<_Float16> : std::true_type {};
template <> struct is_fp<metal::bfloat> : std::true_type {};

template <class T> struct is_scalar_num
    : std::integral_constant<bool, std::is_arithmetic<T>::value || is_fp<T>::value> {};

template <class T> constexpr bool is_fp_v = is_fp<std::decay_t<T>>::value;
template <class T> constexpr bool is_num_v = is_scalar_num<std::decay_t<T>>::value;
template <class T> constexpr bool is_int_v =
    std::is_integral<std::decay_t<T>>::value && !std::is_same<std::decay_t<T>, bool>::value;

// The type of a mixed scalar expression, as MSL would pick it: bfloat with an integer stays
// bfloat, bfloat with half/float goes to float, otherwise the usual arithmetic conversions.
template <class A, class B, class = void> struct common { using type = decltype(A() + B()); };
template <> struct common<metal::bfloat, metal::bfloat> { using type = metal::bfloat; };
template <class B> struct common<metal::bfloat, B, std::enable_if_t<std::is_integral<B>::value>> {
  using type = metal::bfloat;
};
template <class A> struct common<A, metal::bfloat, std::enable_if_t<std::is_integral<A>::value>> {
  using type = metal::bfloat;
};
template <class B>
struct common<metal::bfloat, B, std::enable_if_t<std::is_floating_point<B>::value>> {
  using type = B;
};
template <class A>
struct common<A, metal::bfloat, std::enable_if_t<std::is_floating_point<A>::value>> {
  using type = A;
};
template <> struct common<metal::bfloat, _Float16> { using type = float; };
template <> struct common<_Float16, metal::bfloat> { using type = float; };
template <class A, class B> using common_t = typename common<std::decay_t<A>, std::decay_t<B>>::type;

// float used for computing the math of a float-like scalar
template <class T> using calc_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

}  // namespace mt

namespace metal {

// numeric_limits for every MSL scalar (std's for the standard ones).
template <class T> struct numeric_limits : std::numeric_limits<T> {};

template <> struct numeric_limits<_Float16> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr int max_exponent = 16;
  static constexpr int min_exponent = -13;
  static constexpr _Float16 from(uint16_t b) { return __builtin_bit_cast(_Float16, b); }
  static constexpr _Float16 min() { return from(0x0400); }
  static constexpr _Float16 max() { return from(0x7BFF); }
  static constexpr _Float16 lowest() { return from(0xFBFF); }
  static constexpr _Float16 epsilon() { return from(0x1400); }
  static constexpr _Float16 infinity() { return from(0x7C00); }
  static constexpr _Float16 quiet_NaN() { return from(0x7E00); }
  static constexpr _Float16 signaling_NaN() { return from(0x7D00); }
  static constexpr _Float16 denorm_min() { return from(0x0001); }
  static constexpr _Float16 round_error() { return from(0x3800); }
};

template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr int max_exponent = 128;
  static constexpr int min_exponent = -125;
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
  static constexpr bfloat max() { return bfloat::from_bits(0x7F7F); }
  static constexpr bfloat lowest() { return bfloat::from_bits(0xFF7F); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3C00); }
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7F80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7FC0); }
  static constexpr bfloat signaling_NaN() { return bfloat::from_bits(0x7FA0); }
  static constexpr bfloat denorm_min() { return bfloat::from_bits(0x0001); }
  static constexpr bfloat round_error() { return bfloat::from_bits(0x3F00); }
};

// Reinterpret the bits of a value as another type of the same size.
template <class To, class From> inline To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "as_type: the two types must have the same size");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

}  // namespace metal

// MSL literals: 1.0h (half) and 1.0bf (bfloat) are rewritten by the source pre-pass into
// these calls, since a C++ compiler does not know the suffixes.
#define MT_HALF_LITERAL(x) (static_cast<_Float16>(x))
#define MT_BFLOAT_LITERAL(x) (::metal::bfloat(x))

// Math constants of metal_math.
#ifndef MAXFLOAT
#define MAXFLOAT 0x1.fffffep+127f
#endif
#define MAXHALF ((_Float16)65504.0f)
#define HUGE_VALH (::metal::numeric_limits<_Float16>::infinity())
#define FLT_MAX_H 65504.0f
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f
#define M_E_H ((_Float16)M_E_F)
#define M_LOG2E_H ((_Float16)M_LOG2E_F)
#define M_LOG10E_H ((_Float16)M_LOG10E_F)
#define M_LN2_H ((_Float16)M_LN2_F)
#define M_LN10_H ((_Float16)M_LN10_F)
#define M_PI_H ((_Float16)M_PI_F)
#define M_PI_2_H ((_Float16)M_PI_2_F)
#define M_PI_4_H ((_Float16)M_PI_4_F)
#define M_1_PI_H ((_Float16)M_1_PI_F)
#define M_2_PI_H ((_Float16)M_2_PI_F)
#define M_SQRT2_H ((_Float16)M_SQRT2_F)
#define M_SQRT1_2_H ((_Float16)M_SQRT1_2_F)
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define HALF_EPSILON 0.0009765625f
#ifndef FLT_MAX
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#endif
