// gated_rms_norm.metal: fused gated RMSNorm, one row per threadgroup, row held in registers.
//
// MATH (per row of length n, all in float32, rounded once to T):
//   out[i] = w[i] * y[i] * rsqrt(mean_j(y[j]^2) + eps) * silu(z[i]),  silu(z) = z*sigmoid(z)
//
// LAYOUT: y [rows, n] T, z [rows, n] and w [n] in any float dtype (read through float()),
//   out [rows, n] T (y's dtype),
//   all row-contiguous (ensure_row_contiguous); n_cols (uint) and eps (float) are 0-d
//   runtime inputs, so changing n or eps never builds a new kernel.
//
// RANGE: mean(y^2) is never formed (it overflows float32 from |y| ~ 1.8e19 / sqrt(n) and
//   underflows for tiny y): the row is scaled by its max |y| m, and
//   y * rsqrt(mean(y^2) + eps) = (y / m) * mt_rms_factor(m, sum((y/m)^2), n, eps), right for
//   any row whose RMS is a finite float32. An all-zero row with eps = 0 gives NaN (0/0).
//   COST: one more threadgroup reduction (the max, one barrier) and a division per element;
//   the row stays in registers, so device traffic is unchanged.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (TG, 1, 1), TG = round_up(ceil(n / 4), 32) <= 1024, i.e. 128 < n <= 4096
//   grid        = (TG, rows, 1): threadgroup_position_in_grid.y is the row
//   Thread t holds elements [4t, 4t + 4) of its row (y, z and w); past n they read as 0.
//   (Rows of n <= 128 go to gated_rms_norm_simd_rows.metal instead; on cuda, from 128 rows,
//   rows to gated_rms_norm_wide_row.metal: ops/gated_rms_norm.py's WIDE_ROW_MIN_ROWS.)
//   threadgroup memory: 2 x 32 floats. Every thread reaches both barriers (no early return).
// CUDA ONLY: the spec's launch bounds (1024, 2) hold the kernel to 32 registers, so two
//   1024-thread threadgroups share an SM (the register file holds 64K): at 39 registers one
//   did, and each SM idled through its threadgroup's reductions (H100, 4096 x 4096 bfloat16:
//   133 -> 98 us; Nsight Compute: 50% theoretical occupancy, register-limited). Metal
//   never sees it.
#include "common.h"
// ---- kernel body ----
constexpr uint N_READS = 4;
threadgroup float simd_partials[32];
threadgroup float simd_maxima[32];

const uint row = threadgroup_position_in_grid.y;
const uint lid = thread_position_in_threadgroup.x;
const uint n = n_cols;
const size_t base = size_t(row) * n;

// All loads first, so they are in flight together before the barrier of the reduction.
float y_reg[N_READS];
float z_reg[N_READS];
float w_reg[N_READS];
float abs_max = 0.0f;
for (uint j = 0; j < N_READS; ++j) {
  const uint col = lid * N_READS + j;
  const bool inside = col < n;
  y_reg[j] = inside ? float(y[base + col]) : 0.0f;
  z_reg[j] = inside ? float(z[base + col]) : 0.0f;
  w_reg[j] = inside ? float(w[col]) : 0.0f;
  abs_max = max(abs_max, metal::fabs(y_reg[j]));
}
const uint n_simd = threads_per_threadgroup.x / 32;
const float row_max = mt_threadgroup_max(abs_max, simd_maxima, thread_index_in_simdgroup,
                                         simdgroup_index_in_threadgroup, n_simd);
const float m = row_max > 0.0f ? row_max : 1.0f;  // any m > 0 serves an all-zero row
float sum_sq = 0.0f;
for (uint j = 0; j < N_READS; ++j) {
  y_reg[j] = y_reg[j] / m;
  sum_sq += y_reg[j] * y_reg[j];
}
const float total = mt_threadgroup_sum(sum_sq, simd_partials, thread_index_in_simdgroup,
                                       simdgroup_index_in_threadgroup, n_simd);
const float k = mt_rms_factor(m, total, n, eps);

for (uint j = 0; j < N_READS; ++j) {
  const uint col = lid * N_READS + j;
  if (col < n) {
    out[base + col] = T(w_reg[j] * y_reg[j] * k * mt_silu(z_reg[j]));
  }
}
