// gated_rms_norm_wide_row.metal: fused gated RMSNorm, one threadgroup per row, the row held in
// registers, ITEMS elements per thread read and written 8 consecutive elements at a time.
//
// MATH (per row of length n, all in float32, rounded once to T):
//   out[i] = w[i] * y[i] * rsqrt(mean_j(y[j]^2) + eps) * silu(z[i]),  silu(z) = z*sigmoid(z)
//
// LAYOUT: as gated_rms_norm.metal (y/out [rows, n] T, z [rows, n] ZT, w [n] WT,
//   row-contiguous; n_cols (uint) and eps (float) are 0-d runtime inputs).
//
// WHY (the cuda plan's kernel for rows of 129 to 4096; Metal keeps gated_rms_norm.metal): the
//   row kernel's 4 elements per thread in 1024-thread threadgroups load one 16-bit element
//   per instruction, and an SM holds two rows, so it has few bytes in flight (H100, 4096 x
//   4096 bfloat16: about 30% of DRAM bandwidth). Here a thread holds ITEMS elements as
//   ITEMS / 8 chunks of 8 (mt_load8 / mt_store8: one 16-byte access each on CUDA where
//   aligned), issues all its y and z loads before the first reduction, and a row takes
//   ITEMS / 4 times fewer threads, so an SM holds that many more rows.
//
// RANGE: as gated_rms_norm.metal: the row is scaled by its max |y| m and mean(y^2) is never
//   formed; right for any row whose RMS is a finite float32 (an all-zero row with eps = 0
//   gives NaN, 0/0). TRAFFIC: y, z and w read once, out written once.
// ARITHMETIC: two IEEE divisions per element (y / m and silu's) cost an H100 about as much
//   time as the row's bytes; here y / m is y * (1 / m) and silu divides with fast::divide
//   (mt_silu_fast), so the element's work is one exp and a few multiplies. Metal compiles
//   with fast math by default, where `/` is approximate already.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (TG, 1, 1), TG = round_up(ceil(n / ITEMS), 32) <= 1024; ITEMS is 16 or 32;
//   grid = (TG, rows, 1): threadgroup_position_in_grid.y is the row. Chunk c < ITEMS / 8 of
//   thread t is elements c * 8 TG + 8t .. + 7 (a SIMD-group's chunk is 256 contiguous
//   elements); past n they read as 0 and are not written.
//   threadgroup memory: 2 x 32 floats. Every thread reaches both barriers (no early return).
#include "common.h"
// ---- kernel body ----
constexpr uint CHUNKS = ITEMS / 8;
static_assert(ITEMS % 8 == 0, "ITEMS: whole chunks of 8");
threadgroup float simd_partials[32];
threadgroup float simd_maxima[32];

const uint row = threadgroup_position_in_grid.y;
const uint lid = thread_position_in_threadgroup.x;
const uint tg = threads_per_threadgroup.x;
const uint n = n_cols;
const size_t base = size_t(row) * n;

// All loads of y and z first, so they are in flight together before the first barrier.
float yv[ITEMS];
float zv[ITEMS];
for (uint c = 0; c < CHUNKS; ++c) {
  const uint col = c * 8 * tg + lid * 8;
  mt_load8_bounded(y + base, col, n, yv + 8 * c);
  mt_load8_bounded(z + base, col, n, zv + 8 * c);
}
float abs_max = 0.0f;
for (uint i = 0; i < ITEMS; ++i) {
  abs_max = max(abs_max, metal::fabs(yv[i]));
}
const uint n_simd = tg / 32;
const float row_max = mt_threadgroup_max(abs_max, simd_maxima, thread_index_in_simdgroup,
                                         simdgroup_index_in_threadgroup, n_simd);
const float m = row_max > 0.0f ? row_max : 1.0f;  // any m > 0 serves an all-zero row
// y / m as y * (1 / m) where 1 / m is finite (m normal): one division per row, not per
// element (a row of subnormal maxima divides).
const bool normal_max = m >= FLT_MIN;
const float inv_m = 1.0f / m;
float sum_sq = 0.0f;
for (uint i = 0; i < ITEMS; ++i) {
  yv[i] = normal_max ? yv[i] * inv_m : yv[i] / m;
  sum_sq += yv[i] * yv[i];
}
const float total = mt_threadgroup_sum(sum_sq, simd_partials, thread_index_in_simdgroup,
                                       simdgroup_index_in_threadgroup, n_simd);
const float k = mt_rms_factor(m, total, n, eps);

for (uint c = 0; c < CHUNKS; ++c) {
  const uint col = c * 8 * tg + lid * 8;
  float wv[8];
  float o[8];
  mt_load8_bounded(w, col, n, wv);
  for (uint j = 0; j < 8; ++j) {
    o[j] = wv[j] * yv[8 * c + j] * k * mt_silu_fast(zv[8 * c + j]);
  }
  mt_store8_bounded(out + base, col, n, o);
}
