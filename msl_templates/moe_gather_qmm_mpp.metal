// moe_gather_qmm_mpp.metal: MoE grouped affine-quantized matmul over expert-sorted rows on
// the matrix units of Metal 4 GPUs (MetalPerformancePrimitives matmul2d, M5 and later).
//
// MATH (as moe_gather_qmm_simdgroup.metal; rows m, columns n, float32 accumulation):
//   e        = indices[m]
//   W[n, k]  = T(scale[e, n, k / gs] * q[e, n, k] + bias[e, n, k / gs])  (rounded once to T)
//   out[m,n] = T( sum_k float(x[m, k]) * float(W[n, k]) )  if e < E, else NaN
//   Operands are staged in T itself (float, half or bfloat: matmul2d takes (bfloat, bfloat,
//   float) as it takes (half, half, float)), so x and the weights, already rounded to T, are
//   staged exactly: a bfloat16 weight or activation keeps its range (half would overflow
//   beyond +-65504 and lose bits below 2^-14), and every variant gives the same products.
//
// LAYOUTS: as moe_gather_qmm_simdgroup.metal (x [M, K], w [E, N, K * BITS / 32] uint32,
//   scales/biases [E, N, K / GROUP_SIZE], indices [M], out [M, N]; n_rows, n_experts,
//   n_cols, k_dim are 0-d uint runtime inputs; template T, BITS, GROUP_SIZE).
//   Indices of M < 8 rows arrive in the `constant` address space: a second instantiation,
//   as in moe_gather_qmm_simdgroup.metal.
//   Tensor views follow MetalPerformancePrimitives: extents are (innermost, outer), so a
//   row-major [rows][cols] block is dextents(cols, rows) with packed strides (1, cols).
//
// TILING: threadgroup (bx, slot, tile) = one simdgroup; it computes out[run rows, 32 bx :
//   32 bx + 32] for the run (rows of the 8-row tile sharing an expert) whose first row is
//   `slot`; other slots exit at once, before any barrier. Per K block of 32 the lanes stage
//   x (8 x 32, rows outside the run zeroed; lane -> row lane / 4, 8 values) and W (32 x 32,
//   lane l dequantises output column 32 bx + l) into threadgroup memory as two K halves, and
//   matmul2d(M = 8, N = 32, K = 16, transpose_right, multiply_accumulate) runs twice on
//   `metal::tensor` views (tensor_inline) of those halves into one float destination
//   cooperative tensor; the next block's codes and x values are fetched into registers
//   before the products. The run's rows are stored from the cooperative tensor through
//   get_multidimensional_index (index[0] = column, index[1] = row).
//   An out-of-range expert id (>= E) reads no weight: its slot writes NaN to its own row.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32, 1, 1): one simdgroup (the matmul's execution_simdgroup scope)
//   grid        = (32 * N / 32, 8, ceil(M / 8)) threads
//   N % 32 == 0, K % 32 == 0, GROUP_SIZE % 32 == 0 (a 32-wide K block is in one group)
//   threadgroup memory: 2 x (8 x 16 + 32 x 16) ST = 2,560 bytes (half, bfloat) or 5,120 (float)
//   Built only where the wrapper found MetalPerformancePrimitives (macOS >= 26.2, GPU
//   generation >= 17); without Metal 4 the body is an #error, never an empty kernel.
//
// TRAFFIC per call: for each (tile, distinct expert in the tile): N * K * BITS / 8 bytes of
//   codes and 2 * N * K / GROUP_SIZE scale/bias elements, each loaded once; x rows read
//   N / 32 times (once per column block); out written once (M * N elements).
//   Each thread also reads its slot's id and the tile's <= 8 ids (36 bytes, cache hits);
//   the slots of a tile that lead no run exit after those reads.
//
// ONLY CHECKED ON A MAC: that Apple's compiler accepts the tensor views and the (8, 32, 16)
//   descriptor with half / bfloat / float operands on threadgroup memory (MLX's NAX kernels use
//   (16, 32, 16) with cooperative-tensor operands and relaxed precision; M = 8 rows and
//   threadgroup-memory operands are this kernel's design, and Apple's published headers do
//   not say whether the matrix units run them at full rate), the cooperative-tensor layout
//   Apple's implementation picks (the kernel only uses the documented accessors:
//   get_capacity, is_valid_element, get_multidimensional_index, operator[]), and its speed.
//   MLX compiles custom kernels with the newest language version the OS offers (4.0 from
//   macOS 26), so the wrapper's rule (macOS >= 26.2) implies __METAL_VERSION__ >= 400; an
//   MLX that still picked 3.x would hit the #error below, never build an empty kernel.
//   The emulator runs the same body against its MetalPerformancePrimitives model.
#include "common.h"
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#endif

// Dequantise 16 consecutive codes of one weight row that lie in one quantisation group,
// rounding each weight once to T (returned as float). `words` points at the first word.
template <typename T, int BITS, typename WordPtr>
inline void mt_moe_dequant16(WordPtr words, float scale, float bias, thread float* dst) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint MASK = (1u << BITS) - 1u;
  for (int j = 0; j < 16 / PER_WORD; ++j) {
    const uint word = words[j];
    for (int i = 0; i < PER_WORD; ++i) {
      const float q = float((word >> (BITS * i)) & MASK);
      dst[j * PER_WORD + i] = float(T(metal::fma(scale, q, bias)));
    }
  }
}
// ---- kernel body ----
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400
using ST = T;  // the staging (operand) type: exact for x and for weights rounded to T
constexpr uint BM = 8;     // rows per tile (matmul M)
constexpr uint BN = 32;    // output columns per threadgroup (matmul N)
constexpr uint BK = 32;    // K block staged per iteration
constexpr uint MK = 16;    // matmul K
constexpr uint PER_WORD = 32 / BITS;
threadgroup ST xs[BK / MK][BM * MK];
threadgroup ST ws[BK / MK][BN * MK];

const uint n_block = threadgroup_position_in_grid.x;
const uint slot = threadgroup_position_in_grid.y;
const uint row0 = threadgroup_position_in_grid.z * BM;
const uint M = n_rows;
const uint E = n_experts;
const uint N = n_cols;
const uint K = k_dim;
const uint lane = thread_index_in_simdgroup;
const uint n0 = n_block * BN;

const uint rows_here = min(BM, M - row0);
if (slot >= rows_here) {
  return;
}
const uint e = uint(indices[row0 + slot]);
if (e >= E) {
  // Out-of-range expert: NaN for this row, no weight read.
  out[size_t(row0 + slot) * N + n0 + lane] = T(NAN);
  return;
}
uint run = 0;          // bit r: row r of the tile belongs to this run
bool leader = true;    // slot is the first row of the tile with expert e
for (uint r = 0; r < rows_here; ++r) {
  const bool same = uint(indices[row0 + r]) == e;
  run |= same ? (1u << r) : 0u;
  leader = leader && !(same && r < slot);
}
if (!leader) {
  return;
}

const size_t w_row = size_t(e) * N + n0 + lane;
const auto w_words = w + w_row * (K / PER_WORD);
const auto w_scales = scales + w_row * (K / GROUP_SIZE);
const auto w_biases = biases + w_row * (K / GROUP_SIZE);
const uint xr = lane / 4;           // x staging: row xr, 8 values from xk
const uint xk = (lane % 4) * 8;
const bool x_live = ((run >> xr) & 1u) != 0u;
const auto x_row = x + size_t(row0 + (x_live ? xr : 0u)) * K + xk;

constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
    BM, BN, MK, false, true, false,
    mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
using a_view = metal::tensor<threadgroup ST, metal::dextents<int32_t, 2>, metal::tensor_inline>;
a_view a0(xs[0], metal::dextents<int32_t, 2>(MK, BM));
a_view a1(xs[1], metal::dextents<int32_t, 2>(MK, BM));
a_view b0(ws[0], metal::dextents<int32_t, 2>(MK, BN));
a_view b1(ws[1], metal::dextents<int32_t, 2>(MK, BN));
auto acc = op.template get_destination_cooperative_tensor<
    metal::remove_addrspace_t<decltype(a0)>, metal::remove_addrspace_t<decltype(b0)>, float>();
for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
  acc[i] = 0.0f;
}

constexpr uint WORDS = BK / PER_WORD;  // packed words of one row per K block
float scale = 0.0f;
float bias = 0.0f;
uint wq[WORDS];  // the fetched block: this lane's codes and x values
float xq[8];
for (uint j = 0; j < WORDS; ++j) {
  wq[j] = w_words[j];
}
for (uint i = 0; i < 8; ++i) {
  xq[i] = x_live ? float(x_row[i]) : 0.0f;
}
for (uint k0 = 0; k0 < K; k0 += BK) {
  if (k0 % GROUP_SIZE == 0) {  // a 32-wide block never straddles a group
    scale = float(w_scales[k0 / GROUP_SIZE]);
    bias = float(w_biases[k0 / GROUP_SIZE]);
  }
  for (uint i = 0; i < 8; ++i) {
    const uint k = xk + i;
    xs[k / MK][xr * MK + k % MK] = ST(xq[i]);
  }
  for (uint h = 0; h < BK / MK; ++h) {
    float wv[MK];
    mt_moe_dequant16<T, BITS>(wq + h * (MK / PER_WORD), scale, bias, wv);
    for (uint i = 0; i < MK; ++i) {
      ws[h][lane * MK + i] = ST(wv[i]);
    }
  }
  // Fetch the next block while this one is multiplied.
  if (k0 + BK < K) {
    for (uint j = 0; j < WORDS; ++j) {
      wq[j] = w_words[(k0 + BK) / PER_WORD + j];
    }
    for (uint i = 0; i < 8; ++i) {
      xq[i] = x_live ? float(x_row[k0 + BK + i]) : 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  op.run(a0, b0, acc);
  op.run(a1, b1, acc);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
  if (acc.is_valid_element(i)) {
    const auto idx = acc.get_multidimensional_index(i);
    const uint c = uint(idx[0]);
    const uint r = uint(idx[1]);
    if (((run >> r) & 1u) != 0u) {
      out[size_t(row0 + r) * N + n0 + c] = T(acc[i]);
    }
  }
}
#else
#error "moe_gather_qmm_mpp needs Metal 4 (MetalPerformancePrimitives); use the simdgroup variant"
#endif
