// gated_rms_norm_looped.metal: fused gated RMSNorm for rows longer than 4096.
//
// MATH (per row of length n, all in float32, rounded once to T):
//   out[i] = w[i] * y[i] * rsqrt(mean_j(y[j]^2) + eps) * silu(z[i]),  silu(z) = z*sigmoid(z)
//
// LAYOUT: as gated_rms_norm.metal (y [rows, n] YT, z/out [rows, n] T, w [n] T, 0-d n_cols, eps).
//   Two passes over the row: sum of squares, then normalise; the second read of y hits cache.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (1024, 1, 1); grid = (1024, rows, 1): threadgroup_position_in_grid.y is the row
//   Pass k covers elements [k*4096, (k+1)*4096): thread t holds 4 consecutive of them.
//   threadgroup memory: 32 floats. Every thread reaches the one barrier (no early return).
#include "common.h"
// ---- kernel body ----
constexpr uint N_READS = 4;
threadgroup float simd_partials[32];

const uint row = threadgroup_position_in_grid.y;
const uint lid = thread_position_in_threadgroup.x;
const uint tg = threads_per_threadgroup.x;
const uint n = n_cols;
const size_t base = size_t(row) * n;

float sum_sq = 0.0f;
for (uint start = lid * N_READS; start < n; start += tg * N_READS) {
  for (uint j = 0; j < N_READS; ++j) {
    if (start + j < n) {
      const float v = float(y[base + start + j]);
      sum_sq += v * v;
    }
  }
}
const float total = mt_threadgroup_sum(sum_sq, simd_partials, thread_index_in_simdgroup,
                                       simdgroup_index_in_threadgroup, tg / 32);
const float inv_rms = metal::precise::rsqrt(total / float(n) + eps);

for (uint start = lid * N_READS; start < n; start += tg * N_READS) {
  for (uint j = 0; j < N_READS; ++j) {
    const uint col = start + j;
    if (col < n) {
      const float gate = mt_silu(float(z[base + col]));
      out[base + col] = T(float(w[col]) * float(y[base + col]) * inv_rms * gate);
    }
  }
}
