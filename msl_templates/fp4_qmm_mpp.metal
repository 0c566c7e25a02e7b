// fp4_qmm_mpp.metal: fp4 (E2M1) quantized matmul on the matrix units of Metal 4 GPUs
// (MetalPerformancePrimitives matmul2d; M5 class, macOS >= 26.2).
//
// MATH (float32 accumulation, rounded once to T):
//   out[m, n] = sum_g scale(n, g) * sum_{k in g} x[m, k] * e2m1(n, k)        (SCALE_MODE 0, 1)
//   out[m, n] = sum_k x[m, k] * half(e2m1(n, k) * scale(n, k / 16))            (SCALE_MODE 2)
//   e2m1 -> {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}; scale = mt_fp4_scale<SCALE_MODE>(scales[n, g]).
//   The weights are staged in half ("bfloat16 staged through half": every activation dtype
//   meets half weights), and only values half holds exactly go there: the bare E2M1 codes,
//   or, for nvfp4 (E4M3 scales, SCALE_MODE 2), code * scale, which is exact in half (at most
//   6 significant bits, magnitudes 2^-10 .. 2688). E8M0 and float scales are applied in
//   float32 to each K block's partial product, so no scale exponent can overflow a half.
//   x feeds the matmul in its own dtype (half, bfloat or float against half weights, float
//   destination: combinations MetalPerformancePrimitives lists), so nothing rounds x: a
//   bfloat16 call meets its weights staged through half, while its activations keep
//   bfloat16's range (rounding them to half would overflow past 65504).
//
// LAYOUT (row-contiguous): x [M, K] T; w [N, K / 8] uint32 (code j of a word at bits
//   [4j, 4j + 4)); scales [N, K / GS] ST; out [M, N] T. m_rows, n_cols, k_cols: 0-d uint32
//   runtime inputs (M, N, K). Cooperative-tensor coordinates follow MetalPerformancePrimitives:
//   get_multidimensional_index(i)[0] is the column (innermost), [1] the row, of the operand as
//   stored: x block [16 rows m][32 k], weight block [16 rows n][32 k] (transpose_right),
//   destination [16 rows m][16 columns n].
// TEMPLATE: T, ST (uint8 or float: the wrapper passes float16 / bfloat16 scales as float32),
//   GS (16, 32, 64, 128: it decides how many matmuls a K block takes), SCALE_MODE (0 float,
//   1 E8M0, 2 E4M3).
//
// DESIGN: a threadgroup of 128 threads (4 simdgroups) owns out[m_tile : +32, n_tile : +32] and
//   walks K in blocks of 32. Per block, thread t decodes one uint32 word of w (row t / 4 of the
//   tile, k (t % 4) * 8 .. +8; mt_e2m1x2 in common.h: integer bit placement, no table, which
//   costs no memory access) into the half tile wq and stages the row's scale(s) in float;
//   simdgroup s owns the 16x16 output block (rows 16 (s / 2), columns 16 (s % 2)) and runs one
//   matmul2d(16, 16, 32) per K block (two when GS == 16 without folding: one per group, the
//   other group's codes read as 0) on cooperative inputs: the left one read from x in device
//   memory (rows past M read as 0, never loaded), the right one from wq. The product goes to
//   a destination cooperative tensor and is added to the float accumulator times its column's
//   scale (or accumulated in place when the scale is folded). The accumulator is stored from
//   its cooperative tensor to out, row-guarded.
//   Traffic (device loads, counted by the emulator): w ceil(M / 32) times, a scale once per
//   word as in the simdgroup kernel, x N / 16 times (the two simdgroups that share rows each
//   load them), out once.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (128, 1, 1): 4 simdgroups, each the execution_simdgroup scope of its
//   matmul2d (every lane of a simdgroup calls run); grid = (128 * N / 32, ceil(M / 32), 1).
//   N % 32 == 0, K % 32 == 0, GS | K, 8 | GS (checked): no column or K tail; the 8 codes of a
//   word share one scale. threadgroup memory: 32 x 40 half + 2 x 32 float = 2,816 bytes.
//   Every thread reaches every barrier. Built only where the wrapper found
//   MetalPerformancePrimitives (macOS >= 26.2, GPU generation >= 17); without Metal 4 the
//   body is an #error, never an empty kernel.
// ONLY CHECKABLE ON A MAC: that Apple's compiler accepts the (16, 16, 32) descriptor with
//   these operand types as cooperative inputs, the layout its implementation picks (the
//   kernel only uses get_capacity, is_valid_element, get_multidimensional_index and
//   operator[]), and its speed. The emulator runs the same body against its model of
//   MetalPerformancePrimitives.
#include "common.h"
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#endif
// ---- kernel body ----
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400
constexpr uint BM = 32;
constexpr uint BN = 32;
constexpr uint BK = 32;
constexpr uint LDW = BK + 8;  // padded row stride of the half weight tile
constexpr bool FOLD = SCALE_MODE == 2;  // nvfp4: code * E4M3 scale is exact in half
constexpr uint SUB = (GS < BK && !FOLD) ? BK / GS : 1;  // matmuls (groups) per K block
constexpr uint SG_GROUP = GS < BK ? GS : BK;  // K extent of one group inside a block
threadgroup half wq[BN * LDW];
threadgroup float ss[2 * BN];

const uint M = m_rows;
const uint N = n_cols;
const uint K = k_cols;
const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n_tile = threadgroup_position_in_grid.x * BN;
const uint m_tile = threadgroup_position_in_grid.y * BM;

// Staging role: row lr of the weight tile, k lc .. lc + 7.
const uint lr = tid / 4;
const uint lc = (tid % 4) * 8;
const size_t w_off = size_t(n_tile + lr) * (K / 8) + lc / 8;
const size_t s_off = size_t(n_tile + lr) * (K / GS);

// This simdgroup's 16x16 output block.
const uint sm = (sg / 2) * 16;
const uint sn = (sg % 2) * 16;
const uint row0 = m_tile + sm;

constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
    16, 16, 32, false, true, false,
    FOLD ? mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate
         : mpp::tensor_ops::matmul2d_descriptor::mode::multiply);
mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
auto a = op.template get_left_input_cooperative_tensor<T, half, float>();
auto b = op.template get_right_input_cooperative_tensor<T, half, float>();
using left_t = metal::remove_addrspace_t<decltype(a)>;
using right_t = metal::remove_addrspace_t<decltype(b)>;
auto acc = op.template get_destination_cooperative_tensor<left_t, right_t, float>();
auto part = op.template get_destination_cooperative_tensor<left_t, right_t, float>();
for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
  acc[i] = 0.0f;
  part[i] = 0.0f;
}

for (uint k0 = 0; k0 < K; k0 += BK) {
  // Left input straight from device memory (rows past M are zeros, not loads).
  for (uint16_t i = 0; i < a.get_capacity(); ++i) {
    if (a.is_valid_element(i)) {
      const auto idx = a.get_multidimensional_index(i);
      const uint row = row0 + uint(idx[1]);
      a[i] = row < M ? x[size_t(row) * K + k0 + uint(idx[0])] : T(0);
    }
  }
  const uint word = w[w_off + k0 / 8];
  const float s = mt_fp4_scale<SCALE_MODE>(scales[s_off + (k0 + lc) / GS]);

  threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous block's reads are done
  const half hs = FOLD ? half(s) : half(1.0h);
  for (uint j = 0; j < 4; ++j) {
    const half2 v = mt_e2m1x2(word >> (4 * j)) * hs;
    wq[lr * LDW + lc + j] = v.x;
    wq[lr * LDW + lc + j + 4] = v.y;
  }
  if (lc % SG_GROUP == 0) {
    ss[(lc / SG_GROUP) % 2 * BN + lr] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint sub = 0; sub < SUB; ++sub) {
    for (uint16_t i = 0; i < b.get_capacity(); ++i) {
      if (b.is_valid_element(i)) {
        const auto idx = b.get_multidimensional_index(i);
        const uint k = uint(idx[0]);
        const half v = wq[(sn + uint(idx[1])) * LDW + k];
        b[i] = (SUB == 1 || k / GS == sub) ? v : half(0.0h);
      }
    }
    if (FOLD) {
      op.run(a, b, acc);
    } else {
      op.run(a, b, part);
      for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
        if (acc.is_valid_element(i)) {
          const auto idx = part.get_multidimensional_index(i);
          acc[i] += part[i] * ss[sub * BN + sn + uint(idx[0])];
        }
      }
    }
  }
}

for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
  if (acc.is_valid_element(i)) {
    const auto idx = acc.get_multidimensional_index(i);
    const uint row = row0 + uint(idx[1]);
    if (row < M) {
      out[size_t(row) * N + n_tile + sn + uint(idx[0])] = T(acc[i]);
    }
  }
}
#else
#error "fp4_qmm_mpp needs Metal 4 (MetalPerformancePrimitives); use the simdgroup variant"
#endif
