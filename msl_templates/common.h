// common.h: helpers shared by several mlx-metaltile kernels.
//
// Inlined (once) into a kernel's header by the template renderer; MLX's own utils header
// (metal_stdlib, float16_t/bfloat16_t, ...) is already in front of it.
//
// SIMD width is 32 on every Apple GPU; the reductions below rely on it.
#pragma once

// Elements p[0 .. 8) (mt_load8) or p[0 .. 4) (mt_load4) of a device array as floats, and 8
// floats stored there (rounded to T). Element by element here (Metal, the emulator); the CUDA
// layer defines MT_WIDE_LOADS and its own versions (mlx_metaltile/cuda/include/mt_cuda/
// wide.cuh: 16-byte accesses, 8-byte for 4 half / bfloat values, where p is aligned to them,
// else element by element), which NVIDIA needs to stream half and bfloat near its bandwidth.
// The values are the same either way.
#ifndef MT_WIDE_LOADS
template <typename T>
inline void mt_load8(const device T* p, thread float* v) {
  for (uint j = 0; j < 8; ++j) {
    v[j] = float(p[j]);
  }
}

template <typename T>
inline void mt_load4(const device T* p, thread float* v) {
  for (uint j = 0; j < 4; ++j) {
    v[j] = float(p[j]);
  }
}

template <typename T>
inline void mt_store8(device T* p, const thread float* v) {
  for (uint j = 0; j < 8; ++j) {
    p[j] = T(v[j]);
  }
}

// w[0 .. N) = p[0 .. N), N = 2 or 4 packed code words of a quantized weight row. Word by
// word here; the CUDA layer reads them in one 8- or 16-byte access where p is aligned to it
// (a lane reading its own weight row then issues one load per step, not N).
template <uint N>
inline void mt_load_codes(const device uint* p, thread uint* w) {
  for (uint j = 0; j < N; ++j) {
    w[j] = p[j];
  }
}
#endif

// p[0 .. N) as floats for N = 4 or 8 (mt_load4 / mt_load8), or zeros where !live (a
// uniform or per-lane guard: nothing is read then).
template <uint N, typename T>
inline void mt_load_live(const device T* p, bool live, thread float* v) {
  static_assert(N == 4 || N == 8, "mt_load_live: 4 or 8 elements");
  if (live) {
    if constexpr (N == 8) {
      mt_load8(p, v);
    } else {
      mt_load4(p, v);
    }
  } else {
    for (uint j = 0; j < N; ++j) {
      v[j] = 0.0f;
    }
  }
}

// The lane layout of simdgroup_matrix<T, 8, 8>::thread_elements(), which MSL leaves to the
// implementation: lane l holds row mt_frag_row(l), columns mt_frag_col(l) and + 1; the 4
// lanes holding one row differ in the lane bits MT_FRAG_ROW_XOR0 and MT_FRAG_ROW_XOR1 (a
// row's lanes summed by xor over XOR0, then XOR1, add its column pairs (0 + 1) + (2 + 3) in
// either layout). Apple's layout here (Metal, the emulator): lane bits b4..b0 give row
// 4 b4 + 2 b2 + b1, columns 4 b3 + 2 b0. The CUDA layer defines MT_FRAG_LAYOUT and mma.sync's
// layout (mlx_metaltile/cuda/include/mt_cuda/matrix.cuh: row l / 4, columns 2 (l % 4)), so
// that its products of half / bfloat fragments permute no lanes.
#ifndef MT_FRAG_LAYOUT
#define MT_FRAG_ROW_XOR0 1u
#define MT_FRAG_ROW_XOR1 8u
inline uint mt_frag_row(uint lane) {
  return ((lane >> 2) & 4u) | ((lane >> 1) & 3u);
}
inline uint mt_frag_col(uint lane) {
  return ((lane >> 1) & 4u) | ((lane & 1u) << 1);
}
#endif

// mt_and_or(a, mask, bits) = (a & mask) | bits, the decoders' way of masking a code in place
// into a float's mantissa. The CUDA layer (MT_BIT_HELPERS, mt_cuda/scalar.cuh) issues it as
// one lop3: ptxas otherwise keeps both constants as immediates, two instructions per code.
#ifndef MT_BIT_HELPERS
inline uint mt_and_or(uint a, uint mask, uint bits) {
  return (a & mask) | bits;
}
#endif

// mt_round2<T>(v) = float2(float(T(v.x)), float(T(v.y))): two float32 values rounded to T
// (round to nearest even) and read back; exact for T = float. Written as one vector
// conversion so that the CUDA layer (mt_cuda/vec.cuh, mt_pair_cast) rounds both in one
// cvt.rn.bf16x2 / f16x2 instruction; the same values as two scalar conversions. Below
// Metal 3.1 MLX's bfloat16_t is a struct with no vector type: two scalar conversions.
// Checked only on a Mac: that Apple's compiler takes vec<bfloat, 2>(float2) (Metal 3.1).
template <typename T>
inline float2 mt_round2(float2 v) {
#if defined(__METAL_VERSION__) && __METAL_VERSION__ < 310
  return float2(float(T(v.x)), float(T(v.y)));
#else
  return float2(vec<T, 2>(v));
#endif
}

// Converged SIMD-group functions: mt_shuffle_converged(v, lane) = simd_shuffle(v, lane),
// mt_shuffle_xor_converged(v, mask) = simd_shuffle_xor(v, mask), mt_sum_converged(v) =
// simd_sum(v), mt_max_converged(v) = simd_max(v) and mt_min_converged(v) = simd_min(v), where
// the caller promises all 32 lanes of its SIMD-group active at the call (a full SIMD-group,
// no lane returned early, every branch around the call uniform over it). The CUDA layer
// (MT_SIMD_HELPERS, mt_cuda/simd.cuh) then shuffles under a constant full mask: no
// activemask vote and divergence branch per call. The emulator's own versions
// (mt_emu/simd.h) check the promise at every call.
#ifndef MT_SIMD_HELPERS
template <typename U>
inline U mt_shuffle_converged(U v, ushort lane) {
  return simd_shuffle(v, lane);
}

template <typename U>
inline U mt_shuffle_xor_converged(U v, ushort mask) {
  return simd_shuffle_xor(v, mask);
}

template <typename U>
inline U mt_sum_converged(U v) {
  return simd_sum(v);
}

template <typename U>
inline U mt_max_converged(U v) {
  return simd_max(v);
}

template <typename U>
inline U mt_min_converged(U v) {
  return simd_min(v);
}
#endif

// Product helpers: mt_sg_bmatrix<T>, a simdgroup_matrix<T, 8, 8> that only serves as the B
// side of products (never read through thread_elements()), loaded by mt_sg_load_b (as
// simdgroup_load) or mt_sg_load4 (four blocks); mt_mma_pair(d0, a0, d1, a1, b): d0 = a0 * b +
// d0 and d1 = a1 * b + d1 (d0 and d1 distinct), each as simdgroup_multiply_accumulate gives
// it. The CUDA layer (MT_MMA_HELPERS, mt_cuda/matrix.cuh) keeps a half or bfloat B in the
// tensor cores' layout (no transpose per product) and runs a pair as one instruction of 16
// rows.
#ifndef MT_MMA_HELPERS
template <typename T>
using mt_sg_bmatrix = simdgroup_matrix<T, 8, 8>;

template <typename T>
inline void mt_sg_load_b(thread simdgroup_matrix<T, 8, 8>& d, const threadgroup T* src,
                         ulong elements_per_row, ulong2 matrix_origin = ulong2(0),
                         bool transpose_matrix = false) {
  simdgroup_load(d, src, elements_per_row, matrix_origin, transpose_matrix);
}

// Blocks m = 0..3 at src + m * step, each as simdgroup_load (mt_sg_load_b) of one block at
// that address: d[m] a simdgroup_matrix or an mt_sg_bmatrix. The caller promises src in
// threadgroup memory, and src, elements_per_row and step multiples of 16 bytes (the CUDA
// layer reads half and bfloat blocks with one ldmatrix .x4, which needs both).
template <typename M, typename T>
inline void mt_sg_load4(thread M* d, const threadgroup T* src, uint elements_per_row, uint step,
                        bool transpose_matrix = false) {
  for (uint m = 0; m < 4; ++m) {
    simdgroup_load(d[m], src + m * step, elements_per_row, ulong2(0), transpose_matrix);
  }
}

template <typename TD, typename TA, typename TB>
inline void mt_mma_pair(thread simdgroup_matrix<TD, 8, 8>& d0,
                        thread const simdgroup_matrix<TA, 8, 8>& a0,
                        thread simdgroup_matrix<TD, 8, 8>& d1,
                        thread const simdgroup_matrix<TA, 8, 8>& a1,
                        thread const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d0, a0, b, d0);
  simdgroup_multiply_accumulate(d1, a1, b, d1);
}
#endif

// Elements row[col .. col + 8) as floats, zeros from column n on (a ragged row's last chunk
// goes element by element; a whole chunk through mt_load8), and 8 floats stored there up to
// column n (rounded to T).
template <typename T>
inline void mt_load8_bounded(const device T* row, uint col, uint n, thread float* v) {
  if (col + 8 <= n) {
    mt_load8(row + col, v);
  } else {
    for (uint j = 0; j < 8; ++j) {
      v[j] = col + j < n ? float(row[col + j]) : 0.0f;
    }
  }
}

template <typename T>
inline void mt_store8_bounded(device T* row, uint col, uint n, const thread float* v) {
  if (col + 8 <= n) {
    mt_store8(row + col, v);
  } else {
    for (uint j = 0; j < 8; ++j) {
      if (col + j < n) {
        row[col + j] = T(v[j]);
      }
    }
  }
}

// Sum of one float per thread over the whole threadgroup.
// Every thread of the threadgroup must call it (it contains a barrier), with
// `scratch` a kernel-scope `threadgroup float[32]` array. All threads get the total.
// Reduction order: simd_sum within each SIMD-group, then simd_sum over the SIMD-group
// partials in SIMD-group order. A second call on the same scratch needs a barrier first.
inline float mt_threadgroup_sum(float value, threadgroup float* scratch, uint simd_lane,
                                uint simd_group, uint n_simd_groups) {
  value = simd_sum(value);
  if (simd_lane == 0) {
    scratch[simd_group] = value;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = simd_lane < n_simd_groups ? scratch[simd_lane] : 0.0f;
  return simd_sum(total);
}

// Maximum of one float per thread over the whole threadgroup; as mt_threadgroup_sum (every
// thread calls it, `scratch` a kernel-scope `threadgroup float[32]`, all threads get it).
inline float mt_threadgroup_max(float value, threadgroup float* scratch, uint simd_lane,
                                uint simd_group, uint n_simd_groups) {
  value = simd_max(value);
  if (simd_lane == 0) {
    scratch[simd_group] = value;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float top = simd_lane < n_simd_groups ? scratch[simd_lane] : 0.0f;
  return simd_max(top);
}

// RMS normalisation that keeps the range of the math. With m > 0 the row's max |y| (1 for
// an all-zero row) and ss = sum_j (y_j / m)^2 (in [1, n], or 0 for a zero row), returns k
// such that y * rsqrt(mean(y^2) + eps) == (y / m) * k. Never forms mean(y^2) itself, which
// overflows float32 from |y| ~ 1.8e19 / sqrt(n) and underflows for tiny y: k is finite
// whenever the RMS of y is a finite float32 and the row is not all zero with eps = 0 (that
// row gives NaN, the math's 0/0, as mx.fast.rms_norm does).
inline float mt_rms_factor(float m, float ss, uint n, float eps) {
  const float ms = ss / float(n);                   // mean((y/m)^2), in [1/n, 1]
  const float r = m * metal::precise::sqrt(ms);     // the row's RMS
  const float se = metal::precise::sqrt(eps);
  if (r >= se) {  // m / sqrt(r^2 + eps) = rsqrt(ms) / sqrt(1 + eps / r^2), eps / r^2 <= 1
    return metal::precise::rsqrt(ms) * metal::precise::rsqrt(1.0f + (eps / r) / r);
  }
  const float t = r / se;  // eps dominates: m / sqrt(eps) / sqrt(1 + r^2 / eps), m/se < sqrt(n)
  return (m / se) * metal::precise::rsqrt(1.0f + t * t);
}

// silu(z) = z * sigmoid(z) = z / (1 + exp(-z)); exp(-z) = inf for very negative z gives -0.
inline float mt_silu(float z) {
  return z / (1.0f + metal::exp(-z));
}

// The same with fast::divide (a reciprocal and a multiply, a few ulps; CUDA's __fdividef
// gives 0 for a denominator above 2^126, where z / (1 + exp(-z)) is below 1e-35 in size).
inline float mt_silu_fast(float z) {
  return metal::fast::divide(z, 1.0f + metal::exp(-z));
}

// Attention scores in two factors, so that scores beyond float32's range still order keys:
// c = a * b with b a power of two (exact) and |a| < 4. Returns (a, b): (c, 1) for |c| < 1,
// else b = 2^min(e + 1, 126) for c = f * 2^e (1 <= |f| < 2; 2^-126 is the smallest normal
// reciprocal). A kernel keeps its scores as d = a * q.k (|a * q| < 4|q|, where c * q
// overflows float32 for c = 1e38 and q = 3) and weighs a key by
// 2^(b * (d - max d)); b * (d - max d) equals c * q.k - max exactly (b is a power of two)
// wherever c * q.k is finite, and is -inf (weight 0) where the difference is out of range.
inline float2 mt_score_unit(float c) {
  const uint e = (as_type<uint>(c) >> 23) & 0xFFu;  // biased exponent of c
  if (e < 127u) {  // |c| < 1 (the common case: scale ~ 1/sqrt(D))
    return float2(c, 1.0f);
  }
  const uint k = min(e - 126u, 126u);
  return float2(c * as_type<float>((127u - k) << 23), as_type<float>((127u + k) << 23));
}

// THE BACKWARD SCORE EXPRESSION (sdpa_multi's VJP: sdpa_multi_backward_stats.metal,
// sdpa_multi_backward_dq_split.metal and sdpa_multi_backward_dkv.metal all form every score
// and every dP this way, so a score is the same bits in each kernel: a probability
// recomputed from another kernel's (m, l) never exceeds its exact value by rounding). For a
// row x (a * float(q) in float32 with a = mt_score_unit(...).x, or float(dO)) and a key y
// (float(k), or float(v)) of D columns (a multiple of MT_SCORE_CHUNK):
//   chunk_c = fma(x[16c + 15], y[16c + 15], .. fma(x[16c + 1], y[16c + 1],
//             fma(x[16c], y[16c], 0.0f)) ..)   (an explicit fma chain from 0.0f over the
//             chunk's 16 columns in increasing order), c = 0 .. D/16 - 1;
//   s = chunk_0; s = s + chunk_1; .. s = s + chunk_{D/16-1}   (chunks added left to right).
// mt_score_chunk forms one chunk_c, mt_score_add adds a chunk to the running sum (the
// first chunk is the sum), mt_rows4_dot forms the whole expression for four rows at once.
constexpr int MT_SCORE_CHUNK = 16;

// chunk_c of the rule above for one row: x[0 .. 16) (threadgroup, T, times x_scale in
// float32: a * float(q), or 1.0f * float(dO) == float(dO) exactly) against y[0 .. 16)
// (thread registers, float).
template <typename T>
inline float mt_score_chunk(const threadgroup T* x, float x_scale, const thread float* y) {
  float acc = 0.0f;
  for (int i = 0; i < MT_SCORE_CHUNK; ++i) {
    acc = metal::fma(x_scale * float(x[i]), y[i], acc);
  }
  return acc;
}

// The running sum over chunks: s = chunk_0 for c = 0, else s + chunk_c.
inline float mt_score_add(float s, float chunk, int c) {
  return c == 0 ? chunk : s + chunk;
}

// Four rows of T dotted with one key row of T by the rule above (the statistics and split
// dq kernels' scores and dP, lane per key). Row r is rows[r * D .. r * D + D) (threadgroup
// memory, the same address for every lane: a broadcast, 4 elements per access; rows 8-byte
// aligned), its operand x_scale * float(x) as mt_score_chunk's; key[0 .. D) is the lane's
// own key row, each element read once for the four rows.
template <typename T, int D>
inline void mt_rows4_dot(const threadgroup T* rows, float x_scale, const threadgroup T* key,
                         thread float* out) {
  static_assert(D % MT_SCORE_CHUNK == 0, "score chunks");
  const threadgroup vec<T, 4>* r4 = reinterpret_cast<const threadgroup vec<T, 4>*>(rows);
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < D / MT_SCORE_CHUNK; ++c) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = c * (MT_SCORE_CHUNK / 4); i < (c + 1) * (MT_SCORE_CHUNK / 4); ++i) {
      const float x0 = float(key[4 * i]);
      const float x1 = float(key[4 * i + 1]);
      const float x2 = float(key[4 * i + 2]);
      const float x3 = float(key[4 * i + 3]);
      for (int r = 0; r < 4; ++r) {
        const vec<T, 4> w = r4[r * (D / 4) + i];
        a[r] = metal::fma(x_scale * float(w.x), x0, a[r]);
        a[r] = metal::fma(x_scale * float(w.y), x1, a[r]);
        a[r] = metal::fma(x_scale * float(w.z), x2, a[r]);
        a[r] = metal::fma(x_scale * float(w.w), x3, a[r]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      s[r] = mt_score_add(s[r], a[r], c);
    }
  }
  for (int r = 0; r < 4; ++r) {
    out[r] = s[r];
  }
}

// ---- fp4 (E2M1) weights and their block scales (MLX's mxfp4 / nvfp4 layouts) ----------
//
// E2M1 code (4 bits): bit 3 sign, bits 2-1 exponent, bit 0 mantissa; magnitudes
// {0, 0.5, 1, 1.5, 2, 3, 4, 6} (exponent 0 is subnormal: 0 or 0.5). Eight codes per
// uint32, code j at bits [4j, 4j + 4).
//
// Decoded with integer arithmetic, no table: the 3 magnitude bits are placed at the top of a
// binary16 mantissa/exponent (bits 9-11), the sign at bit 15; the half then holds
// magnitude * 2^-14 exactly (exponent 0 lands on a half subnormal), and one multiply by
// 2^14 restores it. Two codes 16 bits apart are decoded at once as a half2, so a uint32 word
// costs four of these (5 integer ops + 1 half2 multiply each) and no memory access; a table
// lookup would cost one indexed load per code (from constant memory, where lanes reading
// different entries are serialised, or from a threadgroup copy that needs filling and a
// barrier). MLX's own fp4 decoder places the bits the same way.
//
// mt_e2m1x2(bits): .x = code at bits [0, 4), .y = code at bits [16, 20) (exact; -0 for 0x8).
inline half2 mt_e2m1x2(uint bits) {
  const uint mag = (bits & 0x00070007u) << 9;
  const uint sgn = (bits & 0x00080008u) << 12;
  return as_type<half2>(mag | sgn) * half2(16384.0h);
}

// Block scale -> float32. SCALE_MODE: 0 a plain float scale (float, half or bfloat),
// 1 E8M0 (uint8, value 2^(s - 127); s = 0 gives 2^-127 and s = 255 gives inf, as MLX),
// 2 E4M3 (uint8, nvfp4; 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7F reads as
// 480 like MLX's decoder, no NaN). Every result is exact in float32.
template <int SCALE_MODE, typename ST>
inline float mt_fp4_scale(ST s) {
  if constexpr (SCALE_MODE == 1) {
    const uint b = uint(s) & 0xFFu;
    return as_type<float>(b == 0u ? 0x00400000u : (b << 23));
  } else if constexpr (SCALE_MODE == 2) {
    const uint b = uint(s) & 0xFFu;
    const uint mag = b & 0x7Fu;
    const float v = (mag >> 3) == 0u ? float(mag) * 0.001953125f  // subnormal: m * 2^-9
                                     : as_type<float>((mag << 20) + (120u << 23));
    return (b & 0x80u) != 0u ? -v : v;
  } else {
    return float(s);
  }
}
