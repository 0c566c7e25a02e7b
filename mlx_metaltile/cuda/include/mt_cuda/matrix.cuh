// mt_cuda/matrix.cuh: simdgroup_matrix<T, 8, 8> on warp shuffles, in Apple's per-lane layout.
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

// ---- simdgroup_matrix<T, 8, 8> -----------------------------------------------------------
// Apple's layout: lane l = b4 b3 b2 b1 b0 (bits) holds row 4*b4 + 2*b2 + b1 and columns
// 4*b3 + 2*b0 + {0, 1}. Fragments stay in that layout between operations (thread_elements()
// is a plain per-lane view, usable in divergent code); products of half or bfloat matrices run
// on tensor cores (sm_80+, below), the others on warp shuffles and float FMAs.

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

// D = A * B + C over the whole SIMD-group on shuffles and float FMAs (any element types).
template <class TD, class TA, class TB, class TC>
MT_FN void mt_sg_mma_fma(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                         const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// ---- tensor cores --------------------------------------------------------------------------
// A product of two half (or two bfloat) matrices is one mma.sync m16n8k8 (f32 accumulation)
// whose A rows 8..15 are zero. Its fragments (PTX ISA, lane = 4 g + t): A and D hold row g,
// columns 2t, 2t + 1 (rows g + 8 in the second register / second pair); B holds rows 2t,
// 2t + 1 of column g. Apple's A and D fragments are row pairs too, so each moves with one
// shuffle of a lane's pair; B needs the column pair of two Apple lanes (two shuffles, one
// byte permute). C is added in float after the product, in Apple's layout: 5 shuffles of
// 32 bits per product (A 1, B 2, D 2) against 12 of vector pairs on the FMA path.
// Exactness: the tensor core forms each product of two 16-bit values exactly and sums the 8
// products of a row with float32 precision or better (truncating, not rounding); C is then
// added with one float32 rounding and D rounded once to its type: float32 accumulation
// error, inside the tolerance table. float operands stay on the FMA path: tensor cores would
// round them to TF32, and a warp vote sending exactly-16-bit float values here costs more
// (the branch stops nvcc unrolling a kernel's loops of products) than the shuffles it saves.

template <class U>
MT_FN uint mt_tc_bits(const vec<U, 2>& e) {  // a lane's pair in one register, element 0 low
  uint bits;
  memcpy(&bits, &e, 4);
  return bits;
}

// p = A * B: rows 0..7 of one m16n8k8 (A rows 8..15 zero), f32 accumulation from zero.
template <class U>
MT_FN void mt_tc_m16n8k8(float (&p)[4], uint a_lo, uint b) {
  if constexpr (cuda::std::is_same_v<U, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};"
        : "=f"(p[0]), "=f"(p[1]), "=f"(p[2]), "=f"(p[3])
        : "r"(a_lo), "r"(0u), "r"(b), "f"(0.0f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};"
        : "=f"(p[0]), "=f"(p[1]), "=f"(p[2]), "=f"(p[3])
        : "r"(a_lo), "r"(0u), "r"(b), "f"(0.0f));
  }
}

template <class TD, class U, class TC>
MT_FN void mt_sg_mma_tc(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                        const simdgroup_matrix<U, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  const uint lane = mt_lane();
  const uint g = lane >> 2, t = lane & 3u;
  const uint a_in = __shfl_sync(0xffffffffu, mt_tc_bits(a.elems), int(mt_sg_owner(g, 2 * t)));
  const uint b_mine = mt_tc_bits(b.elems);
  const uint b_k0 = __shfl_sync(0xffffffffu, b_mine, int(mt_sg_owner(2 * t, g)));
  const uint b_k1 = __shfl_sync(0xffffffffu, b_mine, int(mt_sg_owner(2 * t + 1, g)));
  // Column g is the low (g even) or high half of each: B(2t, g) low, B(2t + 1, g) high.
  const uint b_in = __byte_perm(b_k0, b_k1, (g & 1u) ? 0x7632u : 0x5410u);
  float p[4];
  mt_tc_m16n8k8<U>(p, a_in, b_in);
  // Apple lane (row, col) takes D(row, col..col + 1) from MMA lane 4 row + col / 2.
  const int src = int(4 * mt_sg_row(lane) + mt_sg_col(lane) / 2);
  const float p0 = __shfl_sync(0xffffffffu, p[0], src);
  const float p1 = __shfl_sync(0xffffffffu, p[1], src);
  d.elems = vec<TD, 2>(mt_cast<TD>(mt_cast<float>(c.elems[0]) + p0),
                       mt_cast<TD>(mt_cast<float>(c.elems[1]) + p1));
}
#endif  // __CUDA_ARCH__ >= 800

// D = A * B + C over the whole SIMD-group (all 32 lanes must call it), in float.
template <class TD, class TA, class TB, class TC>
MT_FN void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                         const simdgroup_matrix<TA, 8, 8>& a,
                                         const simdgroup_matrix<TB, 8, 8>& b,
                                         const simdgroup_matrix<TC, 8, 8>& c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (mt_half_like<TA>::value && cuda::std::is_same_v<TA, TB>) {
    mt_sg_mma_tc(d, a, b, c);
    return;
  }
#endif
  mt_sg_mma_fma(d, a, b, c);
}

template <class TD, class TA, class TB>
MT_FN void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                              const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal
}  // namespace mlx::core::cu
