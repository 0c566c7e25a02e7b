// gated_rms_norm_looped.metal: fused gated RMSNorm for rows longer than 4096.
//
// MATH (per row of length n, all in float32, rounded once to T):
//   out[i] = w[i] * y[i] * rsqrt(mean_j(y[j]^2) + eps) * silu(z[i]),  silu(z) = z*sigmoid(z)
//
// LAYOUT: as gated_rms_norm.metal (y/out [rows, n] T, z and w any float dtype, 0-d n_cols, eps).
//   Two passes over the row: sum of squares, then normalise; the second read of y hits cache.
//
// RANGE: as gated_rms_norm.metal, the row is scaled by its max |y| m and mean(y^2) is never
//   formed; right for any row whose RMS is a finite float32 (an all-zero row with eps = 0
//   gives NaN, 0/0). In the first pass each thread keeps its own running max m_t and
//   sum((y/m_t)^2), rescaled when m_t grows, so the row is still read twice.
//   COST: one more threadgroup reduction (the max, one barrier), a division per element in
//   each pass and a compare (and, when the running max grows, a rescale) per element.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (1024, 1, 1); grid = (1024, rows, 1): threadgroup_position_in_grid.y is the row
//   Pass k covers elements [k*4096, (k+1)*4096): thread t holds 4 consecutive of them.
//   threadgroup memory: 2 x 32 floats. Every thread reaches both barriers (no early return).
#include "common.h"
// ---- kernel body ----
constexpr uint N_READS = 4;
threadgroup float simd_partials[32];
threadgroup float simd_maxima[32];

const uint row = threadgroup_position_in_grid.y;
const uint lid = thread_position_in_threadgroup.x;
const uint tg = threads_per_threadgroup.x;
const uint n = n_cols;
const size_t base = size_t(row) * n;

float m_t = 0.0f;    // this thread's max |y| so far
float sum_sq = 0.0f;  // this thread's sum of (y / m_t)^2
for (uint start = lid * N_READS; start < n; start += tg * N_READS) {
  for (uint j = 0; j < N_READS; ++j) {
    if (start + j < n) {
      const float v = float(y[base + start + j]);
      const float a = metal::fabs(v);
      if (a > m_t) {
        const float c = m_t / a;
        sum_sq *= c * c;
        m_t = a;
      }
      const float u = m_t > 0.0f ? v / m_t : 0.0f;
      sum_sq += u * u;
    }
  }
}
const float row_max = mt_threadgroup_max(m_t, simd_maxima, thread_index_in_simdgroup,
                                         simdgroup_index_in_threadgroup, tg / 32);
const float m = row_max > 0.0f ? row_max : 1.0f;  // any m > 0 serves an all-zero row
const float c = m_t / m;                           // <= 1
const float total = mt_threadgroup_sum(sum_sq * c * c, simd_partials,
                                       thread_index_in_simdgroup,
                                       simdgroup_index_in_threadgroup, tg / 32);
const float k = mt_rms_factor(m, total, n, eps);

for (uint start = lid * N_READS; start < n; start += tg * N_READS) {
  for (uint j = 0; j < N_READS; ++j) {
    const uint col = start + j;
    if (col < n) {
      const float gate = mt_silu(float(z[base + col]));
      out[base + col] = T(float(w[col]) * (float(y[base + col]) / m) * k * gate);
    }
  }
}
