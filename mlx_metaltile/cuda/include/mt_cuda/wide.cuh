// mt_cuda/wide.cuh: 16-byte loads and stores of 8 consecutive elements (and loads of 4, and
// of 2 or 4 code words), where the address allows them. Not MSL: a kernel reaches them
// through common.h's mt_load8 / mt_load4 / mt_store8 / mt_load_codes, whose MSL definitions
// (element by element: what Metal and the emulator run) this header replaces by defining
// MT_WIDE_LOADS. Part of msl_compat.cuh; included only from it.
//
// Why: a warp's scalar 16-bit load moves 64 bytes, a 16-byte load per lane 512. NVIDIA's
// memory system tracks a bounded number of requests per SM, so streaming kernels reading
// half or bfloat one element at a time stay near 30% of an H100's bandwidth.
// The address is checked per call (MLX may hand a kernel an array at any element offset);
// a misaligned one takes the element-by-element path.
#pragma once

#define MT_WIDE_LOADS 1

namespace mlx::core::cu {
namespace metal {

template <class T>
MT_FN bool mt_aligned16(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// v[j] = float(p[j]), j < N: N * sizeof(T) bytes in 8-byte words (N 4 of a 16-bit T) or
// 16-byte words (otherwise), where the address is aligned to the word.
template <int N, class T>
MT_FN void mt_load_words(const T* p, float* v) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "mt_load: 16- or 32-bit elements");
  static_assert(N == 4 || N == 8, "mt_load: 4 or 8 elements");
  using Word = cuda::std::conditional_t<N * sizeof(T) == 8, ::uint2, ::uint4>;
  constexpr int WORDS = N * sizeof(T) / sizeof(Word);
  if ((reinterpret_cast<unsigned long long>(p) & (sizeof(Word) - 1)) == 0) {
    Word w[WORDS];
#pragma unroll
    for (int i = 0; i < WORDS; ++i) {
      w[i] = reinterpret_cast<const Word*>(p)[i];
    }
    const T* e = reinterpret_cast<const T*>(w);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      v[j] = mt_cast<float>(e[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      v[j] = mt_cast<float>(p[j]);
    }
  }
}

template <class T>
MT_FN void mt_load4(const T* p, float* v) {
  mt_load_words<4>(p, v);
}

template <class T>
MT_FN void mt_load8(const T* p, float* v) {
  mt_load_words<8>(p, v);
}

// w[j] = p[j], j < N (N = 2 or 4 packed code words): one 8- or 16-byte load where p is
// aligned to it, else word by word.
template <unsigned N>
MT_FN void mt_load_codes(const unsigned* p, unsigned* w) {
  static_assert(N == 2 || N == 4, "mt_load_codes: 2 or 4 words");
  using Word = cuda::std::conditional_t<N == 2, ::uint2, ::uint4>;
  if ((reinterpret_cast<unsigned long long>(p) & (sizeof(Word) - 1)) == 0) {
    const Word v = *reinterpret_cast<const Word*>(p);
    w[0] = v.x;
    w[1] = v.y;
    if constexpr (N == 4) {
      w[2] = v.z;
      w[3] = v.w;
    }
  } else {
#pragma unroll
    for (unsigned j = 0; j < N; ++j) {
      w[j] = p[j];
    }
  }
}

// p[j] = T(v[j]), j < 8 (rounded as MSL's conversion rounds).
template <class T>
MT_FN void mt_store8(T* p, const float* v) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "mt_store8: 16- or 32-bit elements");
  if (mt_aligned16(p)) {
    constexpr int WORDS = sizeof(T) / 2;
    ::uint4 w[WORDS];
    T* e = reinterpret_cast<T*>(w);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      e[j] = mt_cast<T>(v[j]);
    }
#pragma unroll
    for (int i = 0; i < WORDS; ++i) {
      reinterpret_cast<::uint4*>(p)[i] = w[i];
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      p[j] = mt_cast<T>(v[j]);
    }
  }
}

}  // namespace metal
}  // namespace mlx::core::cu
