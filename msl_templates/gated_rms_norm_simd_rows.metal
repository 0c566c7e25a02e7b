// gated_rms_norm_simd_rows.metal: fused gated RMSNorm for short rows (n <= 128), one
// SIMD-group per row, 8 rows per threadgroup.
//
// MATH (per row of length n, all in float32, rounded once to T):
//   out[i] = w[i] * y[i] * rsqrt(mean_j(y[j]^2) + eps) * silu(z[i]),  silu(z) = z*sigmoid(z)
//
// LAYOUT: y [rows, n] T, z [rows, n] and w [n] in any float dtype (read through float()),
//   out [rows, n] T (y's dtype),
//   row-contiguous; n_cols, n_rows (uint) and eps (float) are 0-d runtime inputs.
//   Per-head norms (n = 64 or 128 over thousands of rows) land here: a threadgroup of 8
//   independent SIMD-groups instead of thousands of 32-thread threadgroups.
//
// RANGE: as gated_rms_norm.metal, the row is scaled by its max |y| m and mean(y^2) is never
//   formed; right for any row whose RMS is a finite float32 (an all-zero row with eps = 0
//   gives NaN, 0/0). COST: one more simd reduction (simd_max) and a division per element;
//   the row stays in registers.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32, 8, 1); grid = (32, round_up(rows, 8), 1): thread_position_in_grid.y is
//   the row. Lane l holds elements [4l, 4l + 4) of its row (n <= 128); past n they read as 0.
//   No threadgroup memory and no barrier: a SIMD-group whose row is past n_rows returns as a
//   whole (uniform), and the row's reduction is one simd_sum.
#include "common.h"
// ---- kernel body ----
constexpr uint N_READS = 4;

const uint row = thread_position_in_grid.y;
if (row >= n_rows) {
  return;
}
const uint lane = thread_index_in_simdgroup;
const uint n = n_cols;
const size_t base = size_t(row) * n;

// All loads first, so they are in flight together before the reduction.
float y_reg[N_READS];
float z_reg[N_READS];
float w_reg[N_READS];
float abs_max = 0.0f;
for (uint j = 0; j < N_READS; ++j) {
  const uint col = lane * N_READS + j;
  const bool inside = col < n;
  y_reg[j] = inside ? float(y[base + col]) : 0.0f;
  z_reg[j] = inside ? float(z[base + col]) : 0.0f;
  w_reg[j] = inside ? float(w[col]) : 0.0f;
  abs_max = max(abs_max, metal::fabs(y_reg[j]));
}
const float row_max = simd_max(abs_max);
const float m = row_max > 0.0f ? row_max : 1.0f;  // any m > 0 serves an all-zero row
float sum_sq = 0.0f;
for (uint j = 0; j < N_READS; ++j) {
  y_reg[j] = y_reg[j] / m;
  sum_sq += y_reg[j] * y_reg[j];
}
const float k = mt_rms_factor(m, simd_sum(sum_sq), n, eps);

for (uint j = 0; j < N_READS; ++j) {
  const uint col = lane * N_READS + j;
  if (col < n) {
    out[base + col] = T(w_reg[j] * y_reg[j] * k * mt_silu(z_reg[j]));
  }
}
