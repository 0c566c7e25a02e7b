// fp4_qmm_qmv.metal: fp4 (E2M1) quantized matmul for small M (decode), shaped like a GEMV.
//
// MATH (float32 accumulation, rounded once to T):
//   out[m, n] = sum_g scale(n, g) * sum_{k in group g} float(x[m, k]) * e2m1(w, n, k)
//   e2m1(w, n, k) = code (w[n, k / 8] >> 4 (k % 8)) & 0xF  -> {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}
//   scale(n, g)   = mt_fp4_scale<SCALE_MODE>(scales[n, g])  (E8M0, E4M3 or a float; common.h)
//
// LAYOUT (row-contiguous): x [M, K] T; w [N, K / 8] uint32 (8 codes per word, code j at bits
//   [4j, 4j + 4)); scales [N, K / GS] ST; out [M, N] T. m_rows, n_cols, k_cols, gs_shift:
//   0-d uint32 runtime inputs (M, N, K, log2 GS), so a decode loop at any M never builds a
//   new kernel, and the group size (16, 32, 64 or 128) is not a template argument either.
// TEMPLATE: T (x / out dtype), ST (scale dtype: uint8 or float; the wrapper passes float16 /
//   bfloat16 scales as float32), SCALE_MODE (0 float, 1 E8M0, 2 E4M3), MB (rows of x per
//   threadgroup: 1, 2, 4 or 8).
//
// DESIGN: each simdgroup owns ROWS = 4 output columns n (rows of w) and MB rows of x; its 32
//   lanes split K: per step a lane takes VPT consecutive k (VPT = 16 for MB <= 2, else 8, so
//   the x values held in registers stay at <= 64 floats), i.e. VPT / 8 uint32 words per row of
//   w, 8 bytes (MB <= 2) or 4 bytes per lane per row, contiguous across the simdgroup.
//   The lane's x chunk (MB x VPT) is loaded once per step and reused for the 4 rows of w; the
//   codes are decoded two at a time (mt_e2m1x2: integer bit placement, no table), dotted with
//   x in float32, and the group's scale is applied once per VPT codes. simd_sum reduces over
//   lanes; lane 0 writes the MB x 4 outputs.
//   Traffic (device loads, counted by the emulator): w once per block of MB rows of x (once
//   in total for M <= MB: N K / 2 bytes); a scale once per VPT codes (GS / VPT lanes load the
//   same one: 2x the ideal N K / GS for GS 32 and VPT 16); x once per simdgroup (N / 4 times,
//   from cache); out once.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (64, 1, 1): 2 simdgroups; grid = (64, N / 8, ceil(M / MB))
//   N % 32 == 0 and K % 32 == 0 (checked), so N % 8 == 0: every (threadgroup, simdgroup)
//   owns 4 valid rows of w and VPT divides K (no partial words, no column guard needed).
//   GS divides K; VPT <= 16 <= GS, so a lane's VPT codes share one scale.
//   Rows of x past M (ragged last M-block) are never read (uniform branch) nor written.
//   No threadgroup memory, no barriers.
// ONLY CHECKABLE ON A MAC: that Metal accepts as_type<half2>(uint) and keeps half
//   subnormals in mt_e2m1x2 (MLX's own fp4 decoder relies on the same); speed.
#include "common.h"
// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;
constexpr uint ROWS = 4;
constexpr uint VPT = MB <= 2 ? 16 : 8;
constexpr uint WPT = VPT / 8;
constexpr uint STEP = 32 * VPT;

const uint M = m_rows;
const uint N = n_cols;
const uint K = k_cols;
const uint lane = thread_index_in_simdgroup;
const uint n0 =
    (threadgroup_position_in_grid.y * SIMDGROUPS + simdgroup_index_in_threadgroup) * ROWS;
const uint m0 = threadgroup_position_in_grid.z * MB;
const uint k_words = K / 8;
const uint k_groups = K >> gs_shift;

float acc[MB][ROWS];
for (uint m = 0; m < MB; ++m) {
  for (uint r = 0; r < ROWS; ++r) {
    acc[m][r] = 0.0f;
  }
}

for (uint k = lane * VPT; k < K; k += STEP) {
  float xr[MB][VPT];
  for (uint m = 0; m < MB; ++m) {
    if (m0 + m < M) {
      const size_t xo = size_t(m0 + m) * K + k;
      for (uint j = 0; j < VPT; ++j) {
        xr[m][j] = float(x[xo + j]);
      }
    } else {
      for (uint j = 0; j < VPT; ++j) {
        xr[m][j] = 0.0f;
      }
    }
  }
  for (uint r = 0; r < ROWS; ++r) {
    const uint n = n0 + r;
    const size_t wo = size_t(n) * k_words + k / 8;
    const float s = mt_fp4_scale<SCALE_MODE>(scales[size_t(n) * k_groups + (k >> gs_shift)]);
    float part[MB];
    for (uint m = 0; m < MB; ++m) {
      part[m] = 0.0f;
    }
    for (uint q = 0; q < WPT; ++q) {
      const uint word = w[wo + q];
      for (uint j = 0; j < 4; ++j) {
        const float2 v = float2(mt_e2m1x2(word >> (4 * j)));
        for (uint m = 0; m < MB; ++m) {
          part[m] += xr[m][8 * q + j] * v.x + xr[m][8 * q + j + 4] * v.y;
        }
      }
    }
    for (uint m = 0; m < MB; ++m) {
      acc[m][r] += s * part[m];
    }
  }
}

for (uint m = 0; m < MB; ++m) {
  for (uint r = 0; r < ROWS; ++r) {
    acc[m][r] = simd_sum(acc[m][r]);
  }
}
if (lane == 0) {
  for (uint m = 0; m < MB; ++m) {
    if (m0 + m < M) {
      const size_t oo = size_t(m0 + m) * N + n0;
      for (uint r = 0; r < ROWS; ++r) {
        out[oo + r] = T(acc[m][r]);
      }
    }
  }
}
