// matrix.h: simdgroup_matrix<T, 8, 8> with Apple's per-lane element layout.
//
// Each lane holds two elements of the 8x8 matrix (thread_elements()): row r, columns c and
// c + 1, where for lane l: q = l / 4, r = (q & 4) + (l / 2) % 4, c = (q & 2) * 2 + (l % 2) * 2.
// simdgroup_load/store move each lane's own elements (elements_per_row is the row stride in
// memory, matrix_origin = (column, row) of the block in memory, transpose reads the block
// transposed). simdgroup_multiply_accumulate needs all 32 lanes of a full SIMD-group; it
// computes in float (double for double): D[i][j] = C[i][j] + sum_k A[i][k] * B[k][j], k = 0..7
// in order, one rounding to D's type at the end.
#pragma once

#include "mt_emu/simd.h"

namespace mt {
inline void sgm_pos(uint32_t lane, int& row, int& col) {
  const int q = int(lane / 4);
  row = (q & 4) + int(lane / 2) % 4;
  col = (q & 2) * 2 + int(lane % 2) * 2;
}
}  // namespace mt

namespace metal {

template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports simdgroup_matrix<T, 8, 8> only");
  static_assert(std::is_same<T, float>::value || std::is_same<T, _Float16>::value ||
                    std::is_same<T, bfloat>::value,
                "simdgroup_matrix holds half, bfloat or float elements (as in Metal)");
  vec<T, 2> e;

  simdgroup_matrix() = default;
  // A diagonal matrix with `diag` on the diagonal (0 elsewhere), as in Metal.
  template <class U, std::enable_if_t<mt::is_num_v<U>, int> = 0> simdgroup_matrix(U diag) {
    int r, c;
    mt::sgm_pos(mt_lane(), r, c);
    e[0] = r == c ? T(diag) : T(0);
    e[1] = r == c + 1 ? T(diag) : T(0);
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<_Float16, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

template <class T>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const T* src,
                           unsigned long elements_per_row = 8,
                           vec<unsigned long, 2> matrix_origin = vec<unsigned long, 2>(0),
                           bool transpose_matrix = false) {
  int r, c;
  mt::sgm_pos(mt_lane(), r, c);
  for (int j = 0; j < 2; ++j) {
    // element (r, c + j) of the matrix
    unsigned long mr = transpose_matrix ? c + j : r, mc = transpose_matrix ? r : c + j;
    d.e[j] = src[(matrix_origin.y + mr) * elements_per_row + matrix_origin.x + mc];
  }
}

template <class T>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, T* dst,
                            unsigned long elements_per_row = 8,
                            vec<unsigned long, 2> matrix_origin = vec<unsigned long, 2>(0),
                            bool transpose_matrix = false) {
  int r, c;
  mt::sgm_pos(mt_lane(), r, c);
  for (int j = 0; j < 2; ++j) {
    unsigned long mr = transpose_matrix ? c + j : r, mc = transpose_matrix ? r : c + j;
    dst[(matrix_origin.y + mr) * elements_per_row + matrix_origin.x + mc] = a.e[j];
  }
}

}  // namespace metal

namespace mt {

template <class TD, class TA, class TB, class TC>
int resolve_mma(mt_coll* const* L, char* err, size_t err_len) {
  for (int l = 0; l < 32; ++l) {
    if (!L[l]) {
      snprintf(err, err_len,
               "simdgroup_multiply_accumulate: lane %d is not active; a simdgroup_matrix "
               "operation needs all 32 lanes of a full SIMD-group",
               l);
      int lead = 0;
      while (!L[lead]) ++lead;
      return lead + 256 * MT_HZ_SIMDGROUP_MATRIX;
    }
  }
  using C = std::conditional_t<std::is_same<TD, double>::value, double, float>;
  C A[8][8], B[8][8], Cm[8][8];
  for (int l = 0; l < 32; ++l) {
    int r, c;
    sgm_pos(uint32_t(l), r, c);
    const auto& a = *static_cast<const metal::vec<TA, 2>*>(L[l]->in);
    const auto& b = *static_cast<const metal::vec<TB, 2>*>(L[l]->in2);
    for (int j = 0; j < 2; ++j) {
      A[r][c + j] = C(a[j]);
      B[r][c + j] = C(b[j]);
      Cm[r][c + j] = L[l]->in3 ? C((*static_cast<const metal::vec<TC, 2>*>(L[l]->in3))[j]) : C(0);
    }
  }
  for (int l = 0; l < 32; ++l) {
    int r, c;
    sgm_pos(uint32_t(l), r, c);
    auto& d = *static_cast<metal::vec<TD, 2>*>(L[l]->out);
    for (int j = 0; j < 2; ++j) {
      C s = Cm[r][c + j];
      for (int k = 0; k < 8; ++k) s += A[r][k] * B[k][c + j];
      d[j] = TD(s);
    }
  }
  return -1;
}

template <class TD, class TA, class TB, class TC>
MT_AI void mma(metal::simdgroup_matrix<TD, 8, 8>& d, const metal::simdgroup_matrix<TA, 8, 8>& a,
               const metal::simdgroup_matrix<TB, 8, 8>& b, const void* c,
               const std::source_location& loc) {
  metal::vec<TD, 2> result;
  mt_coll k;
  k.op = OP_MMA;
  k.width = 32;
  k.arg = 0;
  k.in = &a.e;
  k.in2 = &b.e;
  k.in3 = c;
  k.out = &result;
  k.resolve = &resolve_mma<TD, TA, TB, TC>;
  k.site = site_of(loc);
  mt_collective(&k);
  d.e = result;
}

}  // namespace mt

namespace metal {

template <class TD, class TA, class TB, class TC>
MT_AI void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                         const simdgroup_matrix<TA, 8, 8>& a,
                                         const simdgroup_matrix<TB, 8, 8>& b,
                                         const simdgroup_matrix<TC, 8, 8>& c, MT_LOC) {
  mt::mma<TD, TA, TB, TC>(d, a, b, &c.e, mt_loc);
}

template <class TD, class TA, class TB>
MT_AI void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                              const simdgroup_matrix<TB, 8, 8>& b, MT_LOC) {
  mt::mma<TD, TA, TB, TD>(d, a, b, nullptr, mt_loc);
}

}  // namespace metal
