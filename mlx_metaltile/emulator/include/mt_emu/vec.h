// vec.h: MSL vector types vec<T, N> (N = 2, 3, 4) and packed_vec<T, N>.
//
// Layout as in MSL: vec<T, 3> occupies 4 elements (float3 is 16 bytes), vectors are aligned
// to their size; packed_ types have no padding and the element's alignment.
// Components: .x .y .z .w / .r .g .b .a, [i], and swizzles (every 2-component one, every
// 3- and 4-component permutation without repeats, the in-order rgba runs, .bgr and .bgra).
// Swizzles of distinct components can be assigned (v.xy = float2(1, 2)).
// Arithmetic is element-wise; a scalar operand is converted to the element type; comparisons
// give vec<bool, N>. No implicit conversion between vector types (write float4(int4_value)).
#pragma once

#include "mt_emu/scalar.h"

namespace metal {

template <class T, int N> struct vec;
template <class T, int N> struct packed_vec;

namespace detail {

// A swizzle: a view on the storage of the vector it is a member of (union member).
template <class T, int S, int... I> struct swz {
  T d[S];
  static constexpr int M = sizeof...(I);
  using vec_type = vec<T, M>;
  operator vec_type() const { return vec_type(d[I]...); }
  T operator[](int i) const {
    constexpr int idx[] = {I...};
    return d[idx[i]];
  }
  swz& operator=(const vec_type& v) {
    int k = 0;
    ((d[I] = v.d[k++]), ...);
    return *this;
  }
  swz& operator=(const swz& o) { return *this = vec_type(o); }
  template <class B> swz& operator+=(const B& b) { return *this = vec_type(*this) + b; }
  template <class B> swz& operator-=(const B& b) { return *this = vec_type(*this) - b; }
  template <class B> swz& operator*=(const B& b) { return *this = vec_type(*this) * b; }
  template <class B> swz& operator/=(const B& b) { return *this = vec_type(*this) / b; }
};

#define MT_SWZ(name, ...) swz<T, S, __VA_ARGS__> name

template <class T, int N> struct storage;
template <class T> struct storage<T, 2> {
  static constexpr int S = 2;
  union {
    T d[2];
    struct { T x, y; };
    struct { T r, g; };
    MT_SWZ(xx, 0, 0);
    MT_SWZ(xy, 0, 1);
    MT_SWZ(yx, 1, 0);
    MT_SWZ(yy, 1, 1);
    MT_SWZ(rg, 0, 1);
  };
};
template <class T> struct storage<T, 3> {
  static constexpr int S = 4;
  union {
    T d[4];
    struct { T x, y, z; };
    struct { T r, g, b; };
    MT_SWZ(xx, 0, 0);
    MT_SWZ(xy, 0, 1);
    MT_SWZ(xz, 0, 2);
    MT_SWZ(yx, 1, 0);
    MT_SWZ(yy, 1, 1);
    MT_SWZ(yz, 1, 2);
    MT_SWZ(zx, 2, 0);
    MT_SWZ(zy, 2, 1);
    MT_SWZ(zz, 2, 2);
    MT_SWZ(xyz, 0, 1, 2);
    MT_SWZ(xzy, 0, 2, 1);
    MT_SWZ(yxz, 1, 0, 2);
    MT_SWZ(yzx, 1, 2, 0);
    MT_SWZ(zxy, 2, 0, 1);
    MT_SWZ(zyx, 2, 1, 0);
    MT_SWZ(rg, 0, 1);
    MT_SWZ(gb, 1, 2);
    MT_SWZ(rgb, 0, 1, 2);
    MT_SWZ(bgr, 2, 1, 0);
  };
};
template <class T> struct storage<T, 4> {
  static constexpr int S = 4;
  union {
    T d[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    MT_SWZ(xx, 0, 0);
    MT_SWZ(xy, 0, 1);
    MT_SWZ(xz, 0, 2);
    MT_SWZ(xw, 0, 3);
    MT_SWZ(yx, 1, 0);
    MT_SWZ(yy, 1, 1);
    MT_SWZ(yz, 1, 2);
    MT_SWZ(yw, 1, 3);
    MT_SWZ(zx, 2, 0);
    MT_SWZ(zy, 2, 1);
    MT_SWZ(zz, 2, 2);
    MT_SWZ(zw, 2, 3);
    MT_SWZ(wx, 3, 0);
    MT_SWZ(wy, 3, 1);
    MT_SWZ(wz, 3, 2);
    MT_SWZ(ww, 3, 3);
    MT_SWZ(xyz, 0, 1, 2);
    MT_SWZ(xyw, 0, 1, 3);
    MT_SWZ(xzy, 0, 2, 1);
    MT_SWZ(xzw, 0, 2, 3);
    MT_SWZ(xwy, 0, 3, 1);
    MT_SWZ(xwz, 0, 3, 2);
    MT_SWZ(yxz, 1, 0, 2);
    MT_SWZ(yxw, 1, 0, 3);
    MT_SWZ(yzx, 1, 2, 0);
    MT_SWZ(yzw, 1, 2, 3);
    MT_SWZ(ywx, 1, 3, 0);
    MT_SWZ(ywz, 1, 3, 2);
    MT_SWZ(zxy, 2, 0, 1);
    MT_SWZ(zxw, 2, 0, 3);
    MT_SWZ(zyx, 2, 1, 0);
    MT_SWZ(zyw, 2, 1, 3);
    MT_SWZ(zwx, 2, 3, 0);
    MT_SWZ(zwy, 2, 3, 1);
    MT_SWZ(wxy, 3, 0, 1);
    MT_SWZ(wxz, 3, 0, 2);
    MT_SWZ(wyx, 3, 1, 0);
    MT_SWZ(wyz, 3, 1, 2);
    MT_SWZ(wzx, 3, 2, 0);
    MT_SWZ(wzy, 3, 2, 1);
    MT_SWZ(xyzw, 0, 1, 2, 3);
    MT_SWZ(xywz, 0, 1, 3, 2);
    MT_SWZ(xzyw, 0, 2, 1, 3);
    MT_SWZ(xzwy, 0, 2, 3, 1);
    MT_SWZ(xwyz, 0, 3, 1, 2);
    MT_SWZ(xwzy, 0, 3, 2, 1);
    MT_SWZ(yxzw, 1, 0, 2, 3);
    MT_SWZ(yxwz, 1, 0, 3, 2);
    MT_SWZ(yzxw, 1, 2, 0, 3);
    MT_SWZ(yzwx, 1, 2, 3, 0);
    MT_SWZ(ywxz, 1, 3, 0, 2);
    MT_SWZ(ywzx, 1, 3, 2, 0);
    MT_SWZ(zxyw, 2, 0, 1, 3);
    MT_SWZ(zxwy, 2, 0, 3, 1);
    MT_SWZ(zyxw, 2, 1, 0, 3);
    MT_SWZ(zywx, 2, 1, 3, 0);
    MT_SWZ(zwxy, 2, 3, 0, 1);
    MT_SWZ(zwyx, 2, 3, 1, 0);
    MT_SWZ(wxyz, 3, 0, 1, 2);
    MT_SWZ(wxzy, 3, 0, 2, 1);
    MT_SWZ(wyxz, 3, 1, 0, 2);
    MT_SWZ(wyzx, 3, 1, 2, 0);
    MT_SWZ(wzxy, 3, 2, 0, 1);
    MT_SWZ(wzyx, 3, 2, 1, 0);
    MT_SWZ(rg, 0, 1);
    MT_SWZ(gb, 1, 2);
    MT_SWZ(ba, 2, 3);
    MT_SWZ(rgb, 0, 1, 2);
    MT_SWZ(gba, 1, 2, 3);
    MT_SWZ(rgba, 0, 1, 2, 3);
    MT_SWZ(bgr, 2, 1, 0);
    MT_SWZ(bgra, 2, 1, 0, 3);
  };
};
#undef MT_SWZ

}  // namespace detail
}  // namespace metal

namespace mt {

// What counts as a vector operand: vec, a swizzle, a packed vector.
template <class X> struct vec_like : std::false_type {};
template <class T, int N> struct vec_like<metal::vec<T, N>> : std::true_type {
  using elem = T;
  static constexpr int n = N;
};
template <class T, int S, int... I> struct vec_like<metal::detail::swz<T, S, I...>>
    : std::true_type {
  using elem = T;
  static constexpr int n = sizeof...(I);
};
template <class T, int N> struct vec_like<metal::packed_vec<T, N>> : std::true_type {
  using elem = T;
  static constexpr int n = N;
};
template <class X> constexpr bool is_vec_v = vec_like<std::decay_t<X>>::value;
template <class X> using vec_of_t =
    metal::vec<typename vec_like<std::decay_t<X>>::elem, vec_like<std::decay_t<X>>::n>;

template <class X, class = void> struct count_of { static constexpr int value = 1; };
template <class X> struct count_of<X, std::enable_if_t<is_vec_v<X>>> {
  static constexpr int value = vec_like<std::decay_t<X>>::n;
};
template <class... A> constexpr int total_count() { return (0 + ... + count_of<A>::value); }

// The vector type of a binary operation between A and B (absent when none applies).
template <class A, class B, class = void> struct binop {};
template <class A, class B>
struct binop<A, B, std::enable_if_t<is_vec_v<A> && is_vec_v<B> &&
                                    std::is_same<vec_of_t<A>, vec_of_t<B>>::value>> {
  using type = vec_of_t<A>;
};
template <class A, class B>
struct binop<A, B, std::enable_if_t<is_vec_v<A> && is_num_v<B>>> { using type = vec_of_t<A>; };
template <class A, class B>
struct binop<A, B, std::enable_if_t<is_num_v<A> && is_vec_v<B>>> { using type = vec_of_t<B>; };
template <class A, class B> using binop_t = typename binop<std::decay_t<A>, std::decay_t<B>>::type;

template <class V, class X> inline V to_vec(const X& x) {
  if constexpr (is_vec_v<X>) {
    return V(x);
  } else {
    return V(typename vec_like<V>::elem(x));
  }
}

}  // namespace mt

namespace metal {

template <class T, int N> struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec
    : detail::storage<T, N> {
  using value_type = T;
  using detail::storage<T, N>::d;

  vec() = default;
  vec(const vec& o) { std::memcpy(d, o.d, sizeof d); }
  vec& operator=(const vec& o) {
    std::memcpy(d, o.d, sizeof d);
    return *this;
  }
  // broadcast a scalar
  template <class U, std::enable_if_t<mt::is_num_v<U>, int> = 0> vec(U s) {
    for (int i = 0; i < N; ++i) d[i] = T(s);
  }
  // components and sub-vectors: float4(a, b, c, d), float4(v.xy, 0, 1), float3(v2, z)
  template <class A0, class A1, class... A,
            std::enable_if_t<mt::total_count<A0, A1, A...>() == N, int> = 0>
  vec(const A0& a0, const A1& a1, const A&... a) {
    int k = 0;
    put(k, a0);
    put(k, a1);
    (put(k, a), ...);
  }
  // a vector-like of the same type (swizzle, packed) or, explicitly, of another element type
  template <class X, std::enable_if_t<mt::is_vec_v<X> && mt::vec_like<X>::n == N &&
                                          std::is_same<typename mt::vec_like<X>::elem, T>::value,
                                      int> = 0>
  vec(const X& x) {
    for (int i = 0; i < N; ++i) d[i] = x[i];
  }
  template <class X, std::enable_if_t<mt::is_vec_v<X> && mt::vec_like<X>::n == N &&
                                          !std::is_same<typename mt::vec_like<X>::elem, T>::value,
                                      int> = 0>
  explicit vec(const X& x) {
    for (int i = 0; i < N; ++i) d[i] = T(x[i]);
  }

  T& operator[](int i) { return d[i]; }
  const T& operator[](int i) const { return d[i]; }

  template <class B> vec& operator+=(const B& b) { return *this = *this + b; }
  template <class B> vec& operator-=(const B& b) { return *this = *this - b; }
  template <class B> vec& operator*=(const B& b) { return *this = *this * b; }
  template <class B> vec& operator/=(const B& b) { return *this = *this / b; }
  template <class B> vec& operator%=(const B& b) { return *this = *this % b; }
  template <class B> vec& operator&=(const B& b) { return *this = *this & b; }
  template <class B> vec& operator|=(const B& b) { return *this = *this | b; }
  template <class B> vec& operator^=(const B& b) { return *this = *this ^ b; }
  template <class B> vec& operator<<=(const B& b) { return *this = *this << b; }
  template <class B> vec& operator>>=(const B& b) { return *this = *this >> b; }
  vec& operator++() { return *this += T(1); }
  vec& operator--() { return *this -= T(1); }
  vec operator++(int) { vec t = *this; ++*this; return t; }
  vec operator--(int) { vec t = *this; --*this; return t; }

 private:
  template <class X> void put(int& k, const X& x) {
    if constexpr (mt::is_vec_v<X>) {
      for (int i = 0; i < mt::vec_like<X>::n; ++i) d[k++] = T(x[i]);
    } else {
      d[k++] = T(x);
    }
  }
};

template <class T, int N> struct packed_storage;
template <class T> struct packed_storage<T, 2> { union { T d[2]; struct { T x, y; }; }; };
template <class T> struct packed_storage<T, 3> { union { T d[3]; struct { T x, y, z; }; }; };
template <class T> struct packed_storage<T, 4> { union { T d[4]; struct { T x, y, z, w; }; }; };

template <class T, int N> struct packed_vec : packed_storage<T, N> {
  using value_type = T;
  using packed_storage<T, N>::d;
  packed_vec() = default;
  packed_vec(const vec<T, N>& v) {
    for (int i = 0; i < N; ++i) d[i] = v[i];
  }
  template <class A0, class... A,
            std::enable_if_t<(sizeof...(A) + 1 == N) && mt::is_num_v<A0>, int> = 0>
  packed_vec(A0 a0, A... a) : packed_vec(vec<T, N>(a0, a...)) {}
  operator vec<T, N>() const {
    vec<T, N> v;
    for (int i = 0; i < N; ++i) v[i] = d[i];
    return v;
  }
  T& operator[](int i) { return d[i]; }
  const T& operator[](int i) const { return d[i]; }
  template <class B> packed_vec& operator+=(const B& b) { return *this = vec<T, N>(*this) + b; }
  template <class B> packed_vec& operator-=(const B& b) { return *this = vec<T, N>(*this) - b; }
  template <class B> packed_vec& operator*=(const B& b) { return *this = vec<T, N>(*this) * b; }
  template <class B> packed_vec& operator/=(const B& b) { return *this = vec<T, N>(*this) / b; }
};

// ---- element-wise operators --------------------------------------------------------------

#define MT_VEC_BINOP(op, cond)                                                             \
  template <class A, class B, class V = mt::binop_t<A, B>,                                 \
            std::enable_if_t<cond, int> = 0>                                               \
  inline V operator op(const A& a, const B& b) {                                           \
    const V x = mt::to_vec<V>(a), y = mt::to_vec<V>(b);                                    \
    V r;                                                                                   \
    for (int i = 0; i < mt::vec_like<V>::n; ++i)                                           \
      r[i] = typename V::value_type(x[i] op y[i]);                                         \
    return r;                                                                              \
  }
MT_VEC_BINOP(+, true)
MT_VEC_BINOP(-, true)
MT_VEC_BINOP(*, true)
MT_VEC_BINOP(/, true)
MT_VEC_BINOP(%, std::is_integral<typename V::value_type>::value)
MT_VEC_BINOP(&, std::is_integral<typename V::value_type>::value)
MT_VEC_BINOP(|, std::is_integral<typename V::value_type>::value)
MT_VEC_BINOP(^, std::is_integral<typename V::value_type>::value)
MT_VEC_BINOP(<<, std::is_integral<typename V::value_type>::value)
MT_VEC_BINOP(>>, std::is_integral<typename V::value_type>::value)
#undef MT_VEC_BINOP

#define MT_VEC_CMP(op)                                                                     \
  template <class A, class B, class V = mt::binop_t<A, B>>                                 \
  inline vec<bool, mt::vec_like<V>::n> operator op(const A& a, const B& b) {               \
    const V x = mt::to_vec<V>(a), y = mt::to_vec<V>(b);                                    \
    vec<bool, mt::vec_like<V>::n> r;                                                       \
    for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = x[i] op y[i];                      \
    return r;                                                                              \
  }
MT_VEC_CMP(==)
MT_VEC_CMP(!=)
MT_VEC_CMP(<)
MT_VEC_CMP(<=)
MT_VEC_CMP(>)
MT_VEC_CMP(>=)
MT_VEC_CMP(&&)
MT_VEC_CMP(||)
#undef MT_VEC_CMP

template <class A, class V = mt::vec_of_t<A>> inline V operator-(const A& a) {
  V x = a, r;
  for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = typename V::value_type(-x[i]);
  return r;
}
template <class A, class V = mt::vec_of_t<A>> inline V operator+(const A& a) { return V(a); }
template <class A, class V = mt::vec_of_t<A>,
          std::enable_if_t<std::is_integral<typename V::value_type>::value, int> = 0>
inline V operator~(const A& a) {
  V x = a, r;
  for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = typename V::value_type(~x[i]);
  return r;
}
template <class A, class V = mt::vec_of_t<A>>
inline vec<bool, mt::vec_like<V>::n> operator!(const A& a) {
  V x = a;
  vec<bool, mt::vec_like<V>::n> r;
  for (int i = 0; i < mt::vec_like<V>::n; ++i) r[i] = !x[i];
  return r;
}

// ---- the named types ------------------------------------------------------------------------

#define MT_VEC_TYPES(T, name)                                                               \
  typedef vec<T, 2> name##2;                                                                \
  typedef vec<T, 3> name##3;                                                                \
  typedef vec<T, 4> name##4;                                                                \
  typedef packed_vec<T, 2> packed_##name##2;                                                \
  typedef packed_vec<T, 3> packed_##name##3;                                                \
  typedef packed_vec<T, 4> packed_##name##4;
MT_VEC_TYPES(float, float)
MT_VEC_TYPES(_Float16, half)
MT_VEC_TYPES(bfloat, bfloat)
MT_VEC_TYPES(int, int)
MT_VEC_TYPES(unsigned int, uint)
MT_VEC_TYPES(short, short)
MT_VEC_TYPES(unsigned short, ushort)
MT_VEC_TYPES(signed char, char)
MT_VEC_TYPES(unsigned char, uchar)
MT_VEC_TYPES(long, long)
MT_VEC_TYPES(unsigned long, ulong)
MT_VEC_TYPES(bool, bool)
#undef MT_VEC_TYPES

}  // namespace metal
