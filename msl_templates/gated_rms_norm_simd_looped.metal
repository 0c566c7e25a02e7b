// gated_rms_norm_simd_looped.metal: fused gated RMSNorm, one SIMD-group per row of any
// length, 8 rows per threadgroup, the row streamed in two passes with no barrier.
//
// MATH (per row of length n, all in float32, rounded once to T):
//   out[i] = w[i] * y[i] * rsqrt(mean_j(y[j]^2) + eps) * silu(z[i]),  silu(z) = z*sigmoid(z)
//
// LAYOUT: as gated_rms_norm_simd_rows.metal (y/out [rows, n] T, z [rows, n] ZT, w [n] WT,
//   row-contiguous; n_cols, n_rows (uint) and eps (float) are 0-d runtime inputs).
//
// WHY (the cuda plan's kernel for many rows; Metal keeps gated_rms_norm.metal): a row per
//   1024-thread threadgroup holds 4 elements per thread and waits on two threadgroup
//   barriers between its loads and its stores, so an SM has few bytes in flight (H100,
//   4096 x 4096 bfloat16: about 30% of DRAM bandwidth, latency-bound). Here rows are
//   independent SIMD-groups: each lane issues its ITEMS elements' loads per array before
//   using any, 8 consecutive elements at a time (mt_load8 / mt_store8: one 16-byte access
//   each on CUDA where aligned), and a row's reduction is simd_max and simd_sum, never a
//   barrier.
//
// RANGE: as gated_rms_norm_looped.metal: each lane keeps its running max m_l and
//   sum((y/m_l)^2), rescaled when m_l grows; the row max m = simd_max(m_l) and the lanes'
//   sums are combined at m (sum_l s_l (m_l/m)^2), so mean(y^2) is never formed: right for
//   any row whose RMS is a finite float32 (an all-zero row with eps = 0 gives NaN, 0/0).
//
// TRAFFIC: y read twice (the second pass re-reads a row the SIMD-group has just read, from
//   cache: 8 KB for 4096 bfloat16), z and w once, out written once.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32, 8, 1); grid = (32, round_up(rows, 8), 1): thread_position_in_grid.y is
//   the row. ITEMS is 8 or 16. Step s covers elements [s * 32 * ITEMS, (s + 1) * 32 * ITEMS)
//   of the row in ITEMS / 8 chunks of 256; lane l holds elements 8l .. 8l + 7 of each chunk
//   (a SIMD-group's chunk is 512 contiguous bytes of 16-bit elements); past n they read as 0
//   and are not written. No threadgroup memory and no barrier: a SIMD-group whose row is past
//   n_rows returns as a whole (uniform).
#include "common.h"
// ---- kernel body ----
constexpr uint CHUNKS = ITEMS / 8;
constexpr uint STEP = 32 * ITEMS;
static_assert(ITEMS % 8 == 0, "ITEMS: whole chunks of 8");

const uint row = thread_position_in_grid.y;
if (row >= n_rows) {
  return;
}
const uint lane = thread_index_in_simdgroup;
const uint n = n_cols;
const size_t base = size_t(row) * n;

// pass 1: this lane's running max |y| and sum of (y / m_l)^2
float m_l = 0.0f;
float s_l = 0.0f;
for (uint start = 0; start < n; start += STEP) {
  float v[ITEMS];
  for (uint g = 0; g < CHUNKS; ++g) {  // all loads of the step first
    mt_load8_bounded(y + base, start + g * 256 + lane * 8, n, v + 8 * g);
  }
  float a = 0.0f;
  for (uint i = 0; i < ITEMS; ++i) {
    a = max(a, metal::fabs(v[i]));
  }
  if (a > m_l) {
    const float c = m_l / a;
    s_l *= c * c;
    m_l = a;
  }
  if (m_l > 0.0f) {
    for (uint i = 0; i < ITEMS; ++i) {
      const float u = v[i] / m_l;
      s_l += u * u;
    }
  }
}
const float row_max = simd_max(m_l);
const float m = row_max > 0.0f ? row_max : 1.0f;  // any m > 0 serves an all-zero row
const float c = m_l / m;                           // <= 1 (0 for a lane of zeros)
const float k = mt_rms_factor(m, simd_sum(s_l * c * c), n, eps);

// pass 2: normalise, gate, write
for (uint start = 0; start < n; start += STEP) {
  float yv[ITEMS];
  float zv[ITEMS];
  float wv[ITEMS];
  for (uint g = 0; g < CHUNKS; ++g) {
    const uint col = start + g * 256 + lane * 8;
    mt_load8_bounded(y + base, col, n, yv + 8 * g);
    mt_load8_bounded(z + base, col, n, zv + 8 * g);
    mt_load8_bounded(w, col, n, wv + 8 * g);
  }
  float o[ITEMS];
  for (uint i = 0; i < ITEMS; ++i) {
    o[i] = wv[i] * (yv[i] / m) * k * mt_silu(zv[i]);
  }
  for (uint g = 0; g < CHUNKS; ++g) {
    const uint col = start + g * 256 + lane * 8;
    mt_store8_bounded(out + base, col, n, o + 8 * g);
  }
}
