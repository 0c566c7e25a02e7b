// mt_cuda/matrix.cuh: simdgroup_matrix<T, 8, 8> in the lane layout of NVIDIA's mma.sync.
// Part of msl_compat.cuh (its conventions hold here); included only from it.
#pragma once

namespace mlx::core::cu {
namespace metal {

// ---- simdgroup_matrix<T, 8, 8> -----------------------------------------------------------
// The layout: lane l = 4 g + t holds row g and columns 2 t, 2 t + 1: the A and C/D fragments
// of mma.sync m16n8k8 (rows 0..7) and the fragment movmatrix transposes. MSL leaves the
// lane layout of thread_elements() to the implementation; Apple's (lane bits b4..b0: row
// 4 b4 + 2 b2 + b1, columns 4 b3 + 2 b0 + {0, 1}) is what Metal and the emulator give. A
// product of half or bfloat fragments then needs no permutation of A, C or D, and one
// movmatrix for B (sm_80+, below; none for a B loaded as common.h's mt_sg_bmatrix), where
// Apple's layout took 5 shuffles per product. Kernels
// that read thread_elements() find their row and column through common.h's mt_frag_row /
// mt_frag_col and the row's lanes through MT_FRAG_ROW_XOR0 / 1 (defined here for CUDA, with
// MT_FRAG_LAYOUT, and in common.h in Apple's layout for Metal and the emulator).
#define MT_FRAG_LAYOUT 1
#define MT_FRAG_ROW_XOR0 1u
#define MT_FRAG_ROW_XOR1 2u

MT_FN uint mt_frag_row(uint lane) { return lane >> 2; }
MT_FN uint mt_frag_col(uint lane) { return (lane & 3u) << 1; }
// The lane holding element (row, col) (and its neighbour col ^ 1).
MT_FN uint mt_sg_owner(uint row, uint col) { return 4u * row + (col >> 1); }

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "only simdgroup_matrix<T, 8, 8> is supported");
  vec<T, 2> elems;

  simdgroup_matrix() = default;
  // MSL's diagonal constructor: `value` on the diagonal, zero elsewhere.
  MT_FN explicit simdgroup_matrix(T value) {
    const uint lane = mt_lane();
    const uint row = mt_frag_row(lane), col = mt_frag_col(lane);
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
// with transpose_matrix the block read that way is stored transposed. Element by element:
// one access of a lane's adjacent pair where aligned took half PF 1 sdpa_multi_mma kernels
// at D 96 / 128 from 96-168 to 207-225 registers a thread (nvcc sm_90).
template <class T, class U>
MT_FN void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src,
                          ulong elements_per_row = 8, ulong2 matrix_origin = ulong2(0),
                          bool transpose_matrix = false) {
  const uint lane = mt_lane();
  const ulong row = mt_frag_row(lane), col = mt_frag_col(lane);
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
  const ulong row = mt_frag_row(lane), col = mt_frag_col(lane);
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
  const uint row = mt_frag_row(lane), col = mt_frag_col(lane);
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
// columns 2t, 2t + 1 (rows g + 8 in the second register / second pair), this header's
// layout, so they need no permutation; B holds rows 2t, 2t + 1 of column g, i.e. row g of
// B^T in the same layout: one movmatrix .trans of the lane's pair. C is added in float after
// the product, as the FMA path adds it.
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

// The lane's pair of row g of M^T, from its pair of row g of M (8x8, 16-bit elements).
MT_FN uint mt_tc_transpose(uint bits) {
  uint out;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(bits));
  return out;
}

// p = A * B for one m16n8k8, A's rows 0..7 in a_lo and rows 8..15 in a_hi; f32 accumulation
// from zero.
template <class U>
MT_FN void mt_tc_m16n8k8(float (&p)[4], uint a_lo, uint a_hi, uint b) {
  if constexpr (cuda::std::is_same_v<U, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};"
        : "=f"(p[0]), "=f"(p[1]), "=f"(p[2]), "=f"(p[3])
        : "r"(a_lo), "r"(a_hi), "r"(b), "f"(0.0f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};"
        : "=f"(p[0]), "=f"(p[1]), "=f"(p[2]), "=f"(p[3])
        : "r"(a_lo), "r"(a_hi), "r"(b), "f"(0.0f));
  }
}

// d += p's rows 0..7 (lo) or 8..15 (hi), c's elements added in float (the FMA path's sum).
template <class TD, class TC>
MT_FN void mt_tc_add(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TC, 8, 8>& c,
                     float p0, float p1) {
  d.elems = vec<TD, 2>(mt_cast<TD>(mt_cast<float>(c.elems[0]) + p0),
                       mt_cast<TD>(mt_cast<float>(c.elems[1]) + p1));
}

template <class TD, class U, class TC>
MT_FN void mt_sg_mma_tc(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                        const simdgroup_matrix<U, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  float p[4];
  mt_tc_m16n8k8<U>(p, mt_tc_bits(a.elems), 0u, mt_tc_transpose(mt_tc_bits(b.elems)));
  mt_tc_add(d, c, p[0], p[1]);
}

// A half or bfloat matrix M loaded for the B side of products (common.h's mt_sg_bmatrix):
// the lane holds its pair of row g of M^T (mma.sync's B fragment), read from memory in that
// layout, so its products need no movmatrix. It has no thread_elements(): it feeds products
// only.
template <class T>
struct mt_tc_bfrag {
  vec<T, 2> elems;  // M^T(g, 2t), M^T(g, 2t + 1)
};

// Four 8x8 blocks of 16-bit elements, block m's row r at src + m * step + r *
// elements_per_row (threadgroup memory, 16-byte aligned rows), into d[m].elems: the lane's
// pair of row g (trans: of the block's transpose). Lane l gives the address of row l % 8 of
// block l / 8.
template <class F, class T>
MT_FN void mt_tc_ldmatrix4(F* d, const T* src, uint elements_per_row, uint step, bool trans) {
  const uint lane = mt_lane();
  const T* row = src + (lane >> 3) * step + (lane & 7u) * elements_per_row;
  if (!__isShared(row)) {
    __trap();  // not threadgroup memory (the translation erases address spaces): fail loudly
  }
  const uint addr = static_cast<uint>(__cvta_generic_to_shared(row));
  uint r0, r1, r2, r3;
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
  }
  memcpy(&d[0].elems, &r0, 4);
  memcpy(&d[1].elems, &r1, 4);
  memcpy(&d[2].elems, &r2, 4);
  memcpy(&d[3].elems, &r3, 4);
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

// ---- common.h's product helpers (MT_MMA_HELPERS) -------------------------------------------
// mt_sg_bmatrix<T>: a matrix that only serves as B; mt_tc_bfrag for half and bfloat on
// sm_80+, else simdgroup_matrix. mt_sg_load_b: simdgroup_load into it.
// mt_mma_pair: d0 = a0 * b + d0 and d1 = a1 * b + d1 (d0 and d1 distinct); half or bfloat
// fragments as one m16n8k8, a0 its rows 0..7 and a1 its rows 8..15 (the rows are summed
// apart: the same results as two products).
#define MT_MMA_HELPERS 1

template <class T, class U>
MT_FN void mt_sg_load_b(simdgroup_matrix<T, 8, 8>& d, const U* src, ulong elements_per_row = 8,
                        ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  simdgroup_load(d, src, elements_per_row, matrix_origin, transpose_matrix);
}

// mt_sg_load4: blocks m = 0..3 at src + m * step, as simdgroup_load (mt_sg_load_b) of each;
// for half and bfloat (sm_80+) one ldmatrix.x4 (the caller's promise: src, elements_per_row
// and step multiples of 16 bytes, in threadgroup memory).
template <class T>
MT_FN void mt_sg_load4(simdgroup_matrix<T, 8, 8>* d, const T* src, uint elements_per_row,
                       uint step, bool transpose_matrix = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (mt_half_like<T>::value) {
    // A layout: the lane's pair of row g of M is row g of the block read plainly, of M^T
    // (a transposed read) the .trans pair.
    mt_tc_ldmatrix4(d, src, elements_per_row, step, transpose_matrix);
    return;
  }
#endif
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    simdgroup_load(d[m], src + m * step, elements_per_row, ulong2(0), transpose_matrix);
  }
}

template <class TD, class TA, class TB>
MT_FN void mt_mma_pair(simdgroup_matrix<TD, 8, 8>& d0, const simdgroup_matrix<TA, 8, 8>& a0,
                       simdgroup_matrix<TD, 8, 8>& d1, const simdgroup_matrix<TA, 8, 8>& a1,
                       const simdgroup_matrix<TB, 8, 8>& b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (mt_half_like<TA>::value && cuda::std::is_same_v<TA, TB>) {
    float p[4];
    mt_tc_m16n8k8<TA>(p, mt_tc_bits(a0.elems), mt_tc_bits(a1.elems),
                      mt_tc_transpose(mt_tc_bits(b.elems)));
    mt_tc_add(d0, d0, p[0], p[1]);
    mt_tc_add(d1, d1, p[2], p[3]);
    return;
  }
#endif
  simdgroup_multiply_accumulate(d0, a0, b, d0);
  simdgroup_multiply_accumulate(d1, a1, b, d1);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <class T>
using mt_sg_bmatrix = cuda::std::conditional_t<mt_half_like<T>::value, mt_tc_bfrag<T>,
                                               simdgroup_matrix<T, 8, 8>>;

// Element (r, c) of M as simdgroup_load reads it; the lane's pair is (2t + j, g).
template <class T, class U>
MT_FN void mt_sg_load_b(mt_tc_bfrag<T>& d, const U* src, ulong elements_per_row = 8,
                        ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  const uint lane = mt_lane();
  const ulong row = mt_frag_row(lane), col = mt_frag_col(lane);
  const U* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const ulong r = transpose_matrix ? row : col + j;
    const ulong c = transpose_matrix ? col + j : row;
    d.elems[j] = mt_cast<T>(base[r * elements_per_row + c]);
  }
}

// B layout: the lane's pair of row g of M^T, the .trans pair of the block read plainly, or
// row g of the block where M is read transposed.
template <class T>
MT_FN void mt_sg_load4(mt_tc_bfrag<T>* d, const T* src, uint elements_per_row, uint step,
                       bool transpose_matrix = false) {
  mt_tc_ldmatrix4(d, src, elements_per_row, step, !transpose_matrix);
}

template <class TD, class U, class TC>
MT_FN void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                         const simdgroup_matrix<U, 8, 8>& a,
                                         const mt_tc_bfrag<U>& b,
                                         const simdgroup_matrix<TC, 8, 8>& c) {
  float p[4];
  mt_tc_m16n8k8<U>(p, mt_tc_bits(a.elems), 0u, mt_tc_bits(b.elems));
  mt_tc_add(d, c, p[0], p[1]);
}

template <class TD, class U>
MT_FN void mt_mma_pair(simdgroup_matrix<TD, 8, 8>& d0, const simdgroup_matrix<U, 8, 8>& a0,
                       simdgroup_matrix<TD, 8, 8>& d1, const simdgroup_matrix<U, 8, 8>& a1,
                       const mt_tc_bfrag<U>& b) {
  float p[4];
  mt_tc_m16n8k8<U>(p, mt_tc_bits(a0.elems), mt_tc_bits(a1.elems), mt_tc_bits(b.elems));
  mt_tc_add(d0, d0, p[0], p[1]);
  mt_tc_add(d1, d1, p[2], p[3]);
}
#else
template <class T>
using mt_sg_bmatrix = simdgroup_matrix<T, 8, 8>;
#endif

template <class TD, class TA, class TB>
MT_FN void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                              const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal
}  // namespace mlx::core::cu
