// MetalPerformancePrimitives: the subset of mpp::tensor_ops the emulator models.
//
//   matmul2d_descriptor(m, n, k = dynamic, transpose_left = false, transpose_right = false,
//                       relaxed_precision = false, mode = multiply)
//   matmul2d<Descriptor, execution_simdgroup>: destination (m x n) = left (m x k) *
//     right (k x n) [+ destination for mode::multiply_accumulate], run by the 32 lanes of one
//     SIMD-group together (every lane must call run; the operands must be the same on every
//     lane).
//     Operands: tensor views (metal::tensor, any address space) or cooperative tensors from
//     get_left_input_cooperative_tensor<LeftT, RightT, DestT>(),
//     get_right_input_cooperative_tensor<LeftT, RightT, DestT>(),
//     get_destination_cooperative_tensor<LeftOperand, RightOperand, DestT>().
//     Stored orientation, as tensors (extents innermost first): left is [m][k]
//     (extents (k, m)), or [k][m] with transpose_left; right is [k][n] (extents (n, k)), or
//     [n][k] with transpose_right; destination is [m][n] (extents (n, m)). A cooperative
//     operand uses the same orientation: get_multidimensional_index gives [0] = column,
//     [1] = row of the stored operand.
//     Edges: elements of a tensor operand outside its extents read as 0 and are not written
//     (Apple's header: run checks the tile against the tensors' extents); k elements past
//     the descriptor's k are not used.
//     Arithmetic: operands converted to float, products summed over k in order onto the
//     destination's value (float), rounded once to the destination type.
//     Element types: the half / bfloat / float rows of Apple's table (left, right, dest):
//     (half, half, half|float), (half, float, float), (float, half, float),
//     (float, float, float), (bfloat, bfloat, bfloat|float), (bfloat, float, float),
//     (float, bfloat, float), (bfloat, half, bfloat|half|float),
//     (half, bfloat, bfloat|half|float). Others do not compile here.
//
// Not modelled: execution_simdgroups<N> and execution_thread, a dynamic k (descriptor k must
// be static here), integer / 4-bit / fp8 operands, reductions (reduce_rows/columns),
// cooperative-tensor iterators, relaxed_precision (full precision either way). Apple's
// cooperative layout is not reproduced (see <metal_tensor>): only the documented accessors
// are valid.
//
// Semantics taken from Apple's MPPTensorOpsMatMul2d.h as published (the descriptor, the
// operand roles and the data-type table, edge checking, the cooperative-tensor accessors) and
// from MLX's NAX kernels (steel/gemm/nax.h: get_*_cooperative_tensor<A, B, C>() and run on
// execution_simdgroup). What could not be confirmed without a Mac: the coordinate order of
// cooperative *input* tensors under transposition (taken as the stored orientation) and
// whether Apple rounds a non-float destination once (as here) or per k step.
#pragma once
#include "mt_emu/kernel.h"
#include <metal_tensor>

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode {
    multiply,
    multiply_accumulate,
  };

  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;

  constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

namespace mt_detail {

// 1 half, 2 bfloat, 3 float, 0 anything else
template <class T> constexpr int kind() {
  using U = std::remove_cv_t<T>;
  return std::is_same<U, _Float16>::value       ? 1
         : std::is_same<U, metal::bfloat>::value ? 2
         : std::is_same<U, float>::value         ? 3
                                                 : 0;
}
constexpr bool supported(int l, int r, int d) {
  constexpr int H = 1, B = 2, F = 3;
  if (l == H && r == H) return d == H || d == F;
  if ((l == H && r == F) || (l == F && r == H) || (l == F && r == F)) return d == F;
  if (l == B && r == B) return d == B || d == F;
  if ((l == B && r == F) || (l == F && r == B)) return d == F;
  if ((l == B && r == H) || (l == H && r == B)) return d == B || d == H || d == F;
  return false;
}

template <class X> struct operand {
  static constexpr bool known = false;
};
template <class T, class E, class L> struct operand<metal::tensor<T, E, L>> {
  static constexpr bool known = true;
  static constexpr bool coop = false;
  using elem = std::remove_cv_t<T>;
};
template <class T, class E, class L> struct operand<metal::cooperative_tensor<T, E, L>> {
  static constexpr bool known = true;
  static constexpr bool coop = true;
  using elem = T;
};
template <class X> using elem_t = typename operand<std::remove_cv_t<X>>::elem;

// What one lane hands to the collective for one operand.
struct lane_operand {
  void* storage;        // cooperative tensor elements, or this lane's staged tensor elements
  const void* address;  // tensor operands: data pointer, extents, strides (checked uniform)
  long ext0, ext1, str0, str1;
};
struct lane_record {
  lane_operand op[3];  // left, right, destination
};

// A tensor operand's lane share: elements p = lane + 32 j of its rows x cols tile.
template <int Rows, int Cols, class Tensor>
MT_AI void stage(const Tensor& t, float* out, lane_operand& rec) {
  const unsigned lane = mt_lane();
  for (int j = 0; 32 * j + int(lane) < Rows * Cols; ++j) {
    const int p = 32 * j + int(lane), r = p / Cols, c = p % Cols;
    out[j] = t.mt_inside(c, r) ? float(*t.mt_address(c, r)) : 0.0f;
  }
  rec.storage = out;
  rec.address = t.data();
  rec.ext0 = long(t.get_extent(0));
  rec.ext1 = long(t.get_extent(1));
  rec.str0 = long(t.get_stride(0));
  rec.str1 = long(t.get_stride(1));
}

// Gather operand `which` (rows x cols, row-major) from the 32 lane records.
template <int Rows, int Cols, class Operand>
void gather(mt_coll* const* L, int which, float* full) {
  for (int l = 0; l < 32; ++l) {
    const lane_operand& o = static_cast<const lane_record*>(L[l]->in)->op[which];
    if constexpr (operand<Operand>::coop) {
      const auto* e = static_cast<const typename operand<Operand>::elem*>(o.storage);
      for (int i = 0; i < Operand::kCapacity; ++i) {
        const int p = Operand::mt_linear(unsigned(l), i);
        if (p < Rows * Cols) full[p] = float(e[i]);
      }
    } else {
      const float* s = static_cast<const float*>(o.storage);
      for (int j = 0; 32 * j + l < Rows * Cols; ++j) full[32 * j + l] = s[j];
    }
  }
}

template <class Op, class Left, class Right, class Dest>
int resolve_matmul(mt_coll* const* L, char* err, size_t err_len) {
  constexpr matmul2d_descriptor D = Op::descriptor;
  for (int l = 0; l < 32; ++l) {
    if (!L[l]) {
      snprintf(err, err_len,
               "matmul2d (execution_simdgroup): lane %d does not call run; every lane of the "
               "SIMD-group must enter run together",
               l);
      int lead = 0;
      while (!L[lead]) ++lead;
      return lead + 256 * MT_HZ_SIMDGROUP_MATRIX;
    }
  }
  const bool is_tensor[3] = {!operand<Left>::coop, !operand<Right>::coop, !operand<Dest>::coop};
  const char* names[3] = {"left", "right", "destination"};
  const lane_record* r0 = static_cast<const lane_record*>(L[0]->in);
  for (int w = 0; w < 3; ++w) {
    if (!is_tensor[w]) continue;
    for (int l = 1; l < 32; ++l) {
      const lane_operand& a = r0->op[w];
      const lane_operand& b = static_cast<const lane_record*>(L[l]->in)->op[w];
      if (a.address != b.address || a.ext0 != b.ext0 || a.ext1 != b.ext1 ||
          a.str0 != b.str0 || a.str1 != b.str1) {
        snprintf(err, err_len,
                 "matmul2d: the %s tensor differs between lane 0 and lane %d (address, "
                 "extents or strides); the operands must be the same on every lane",
                 names[w], l);
        return l + 256 * MT_HZ_SIMDGROUP_MATRIX;
      }
    }
  }
  constexpr int LR = Op::kLeftRows, LC = Op::kLeftCols, RR = Op::kRightRows,
                RC = Op::kRightCols, M = D.m, N = D.n, K = D.k;
  float A[LR * LC], B[RR * RC], C[M * N];  // the scheduler's stack (one per worker)
  gather<LR, LC, Left>(L, 0, A);
  gather<RR, RC, Right>(L, 1, B);
  const bool acc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
  if (acc) {
    gather<M, N, Dest>(L, 2, C);
  } else {
    for (int i = 0; i < M * N; ++i) C[i] = 0.0f;
  }
  using DE = elem_t<Dest>;
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      float s = C[m * N + n];
      for (int k = 0; k < K; ++k) {
        const float a = D.transpose_left ? A[k * LC + m] : A[m * LC + k];
        const float b = D.transpose_right ? B[n * RC + k] : B[k * RC + n];
        s += a * b;
      }
      C[m * N + n] = float(DE(s));
    }
  }
  // Scatter the destination back to each lane's share.
  for (int l = 0; l < 32; ++l) {
    const lane_operand& o = static_cast<const lane_record*>(L[l]->in)->op[2];
    if constexpr (operand<Dest>::coop) {
      auto* e = static_cast<DE*>(o.storage);
      for (int i = 0; i < Dest::kCapacity; ++i) {
        const int p = Dest::mt_linear(unsigned(l), i);
        if (p < M * N) e[i] = DE(C[p]);
      }
    } else {
      float* s = static_cast<float*>(o.storage);
      for (int j = 0; 32 * j + l < M * N; ++j) s[j] = C[32 * j + l];
    }
  }
  return -1;
}

}  // namespace mt_detail

template <matmul2d_descriptor Descriptor, class Scope, class... Args> class matmul2d {
 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;
  using scope = Scope;
  static_assert(std::is_same<Scope, metal::execution_simdgroup>::value,
                "the emulator's MetalPerformancePrimitives subset runs matmul2d on "
                "metal::execution_simdgroup only");
  static_assert(Descriptor.m > 0 && Descriptor.n > 0 && Descriptor.k > 0,
                "the emulator's matmul2d needs static m, n and k in the descriptor");

  static constexpr int kLeftRows = Descriptor.transpose_left ? Descriptor.k : Descriptor.m;
  static constexpr int kLeftCols = Descriptor.transpose_left ? Descriptor.m : Descriptor.k;
  static constexpr int kRightRows = Descriptor.transpose_right ? Descriptor.n : Descriptor.k;
  static constexpr int kRightCols = Descriptor.transpose_right ? Descriptor.k : Descriptor.n;

  template <class LeftElementType, class RightElementType, class ElementType,
            class CoordType = int, class... CoopArgs>
  using cooperative_tensor_left_input_t =
      metal::cooperative_tensor<LeftElementType, metal::extents<int, kLeftCols, kLeftRows>>;
  template <class LeftElementType, class RightElementType, class ElementType,
            class CoordType = int, class... CoopArgs>
  using cooperative_tensor_right_input_t =
      metal::cooperative_tensor<RightElementType, metal::extents<int, kRightCols, kRightRows>>;
  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int,
            class... CoopArgs>
  using cooperative_tensor_destination_t =
      metal::cooperative_tensor<ElementType, metal::extents<int, Descriptor.n, Descriptor.m>>;

  matmul2d() = default;

  template <class LeftElementType, class RightElementType, class ElementType,
            class CoordType = int, class... CoopArgs>
  cooperative_tensor_left_input_t<LeftElementType, RightElementType, ElementType>
  get_left_input_cooperative_tensor() const {
    return {};
  }
  template <class LeftElementType, class RightElementType, class ElementType,
            class CoordType = int, class... CoopArgs>
  cooperative_tensor_right_input_t<LeftElementType, RightElementType, ElementType>
  get_right_input_cooperative_tensor() const {
    return {};
  }
  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int,
            class... CoopArgs>
  cooperative_tensor_destination_t<LeftOperand, RightOperand, ElementType>
  get_destination_cooperative_tensor() const {
    return {};
  }

  template <class Left, class Right, class Dest>
  MT_AI void run(Left& left, Right& right, Dest& destination) const {
    using L = std::remove_cv_t<Left>;
    using R = std::remove_cv_t<Right>;
    using D = std::remove_cv_t<Dest>;
    static_assert(mt_detail::operand<L>::known && mt_detail::operand<R>::known &&
                      mt_detail::operand<D>::known,
                  "matmul2d::run takes tensors or cooperative tensors");
    static_assert(mt_detail::supported(mt_detail::kind<mt_detail::elem_t<L>>(),
                                       mt_detail::kind<mt_detail::elem_t<R>>(),
                                       mt_detail::kind<mt_detail::elem_t<D>>()),
                  "matmul2d: this (left, right, destination) element-type combination is not "
                  "in Apple's table (or not in the emulator's half/bfloat/float subset)");
    constexpr int M = Descriptor.m, N = Descriptor.n;
    float ls[(kLeftRows * kLeftCols + 31) / 32];
    float rs[(kRightRows * kRightCols + 31) / 32];
    float ds[(M * N + 31) / 32];
    mt_detail::lane_record rec{};
    if constexpr (mt_detail::operand<L>::coop) {
      rec.op[0].storage = left.e;
    } else {
      mt_detail::stage<kLeftRows, kLeftCols>(left, ls, rec.op[0]);
    }
    if constexpr (mt_detail::operand<R>::coop) {
      rec.op[1].storage = right.e;
    } else {
      mt_detail::stage<kRightRows, kRightCols>(right, rs, rec.op[1]);
    }
    if constexpr (mt_detail::operand<D>::coop) {
      rec.op[2].storage = destination.e;
    } else {
      if (Descriptor.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate) {
        mt_detail::stage<M, N>(destination, ds, rec.op[2]);
      } else {
        rec.op[2].storage = ds;
        rec.op[2].address = destination.data();
        rec.op[2].ext0 = long(destination.get_extent(0));
        rec.op[2].ext1 = long(destination.get_extent(1));
        rec.op[2].str0 = long(destination.get_stride(0));
        rec.op[2].str1 = long(destination.get_stride(1));
      }
    }
    mt_coll c;
    c.op = mt::OP_MMA;
    c.width = 32;
    c.arg = 0;
    c.in = &rec;
    c.in2 = nullptr;
    c.in3 = nullptr;
    c.out = nullptr;
    c.resolve = &mt_detail::resolve_matmul<matmul2d, L, R, D>;
    mt_collective(&c);
    if constexpr (!mt_detail::operand<D>::coop) {
      // This lane's share of a tensor destination, inside its extents.
      using DE = mt_detail::elem_t<D>;
      const unsigned lane = mt_lane();
      for (int j = 0; 32 * j + int(lane) < M * N; ++j) {
        const int p = 32 * j + int(lane), r = p / N, col = p % N;
        if (destination.mt_inside(col, r)) *destination.mt_address(col, r) = DE(ds[j]);
      }
    }
  }
};

}  // namespace tensor_ops
}  // namespace mpp
