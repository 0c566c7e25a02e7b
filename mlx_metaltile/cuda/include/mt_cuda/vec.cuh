// mt_cuda/vec.cuh: MSL vector types (no swizzles, no packed vectors), as_type and select.
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

// ---- vector types ------------------------------------------------------------------------
// Size and alignment as in MSL: vec<T, 3> occupies 4 elements.

template <class T, int N>
struct vec;

// float2 -> bfloat2 / half2 in one cvt.rn.{bf16x2,f16x2}.f32 (ptxas: one F2FP ... PACK_AB
// instead of two F2F conversions): the same round-to-nearest-even of each element as the
// scalar conversion, at half the conversion instructions. Kernels that round pairs of
// float32 values to T (expert_qmv.metal's ROUND dot) write float2(vec<T, 2>(float2(a, b))).
template <class T, class U, int N>
constexpr bool mt_pair_cast = N == 2 && cuda::std::is_same_v<U, float> &&
                              (cuda::std::is_same_v<T, __nv_bfloat16> ||
                               cuda::std::is_same_v<T, __half>);

template <class R, class F>
MT_FN void mt_cast_pair(R& r, const F& o) {
  if constexpr (cuda::std::is_same_v<decltype(r.x), __nv_bfloat16>) {
    const __nv_bfloat162 p = __float22bfloat162_rn(::make_float2(o.x, o.y));
    r.x = p.x;
    r.y = p.y;
  } else {
    const __half2 p = __float22half2_rn(::make_float2(o.x, o.y));
    r.x = p.x;
    r.y = p.y;
  }
}

#define MT_VEC_COMMON(N)                                                           \
  vec() = default;                                                                 \
  MT_FN vec(T s) { /* scalar broadcast is implicit in MSL */                       \
    _Pragma("unroll") for (int i = 0; i < N; ++i)(*this)[i] = s;                   \
  }                                                                                \
  template <class U, class = cuda::std::enable_if_t<!cuda::std::is_same_v<U, T>>>  \
  MT_FN explicit vec(const vec<U, N>& o) {                                         \
    if constexpr (mt_pair_cast<T, U, N>) {                                         \
      mt_cast_pair(*this, o);                                                      \
    } else {                                                                       \
      _Pragma("unroll") for (int i = 0; i < N; ++i)(*this)[i] = mt_cast<T>(o[i]);  \
    }                                                                              \
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

}  // namespace metal
}  // namespace mlx::core::cu
