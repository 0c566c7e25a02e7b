// gated_rms_norm_backward.metal: the VJP of gated_rms_norm, fused: dy, dz and per-threadgroup
// partial sums of dweight from one kernel.
//
// MATH (per row of length n, float32; s = silu(z), sg = sigmoid(z), g the cotangent):
//   forward out = w * y * k * s, k = rsqrt(mean(y^2) + eps)
//   a_i  = g_i * w_i * s_i
//   dy_i = k * a_i - k^3 / n * y_i * sum_j a_j y_j
//   dz_i = g_i * w_i * y_i * k * sg_i * (1 + z_i * (1 - sg_i))       (silu')
//   dw_i = sum over rows of g_i * y_i * k * s_i
// RANGE: as the forward (gated_rms_norm.metal), y is scaled by the row's max |y| m, u = y / m,
//   K = mt_rms_factor(...) = m * k, so y * k = u * K and
//   dy_i = (a_i - (K^2 / n) * u_i * sum_j a_j u_j) * (K / m),  K^2 / n <= 1:
//   no intermediate overflows or underflows where the gradient itself is a finite float32.
//
// LAYOUT: y [rows, n] T, g [rows, n] T (the cotangent, in the output's dtype: y's), z [rows, n]
//   ZT, w [n] in any float dtype (read through float()), row-contiguous; dy [rows, n] T,
//   dz [rows, n] ZT, dw_partial [groups, n] float32
//   (row p: the sum over the rows of threadgroup p). n_cols, n_rows, rows_per_group (uint)
//   and eps (float): 0-d runtime inputs.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (TG, 1, 1), TG = min(1024, round_up(ceil(n / 4), 32));
//   grid = (TG, groups, 1), groups = ceil(rows / rows_per_group): threadgroup p takes rows
//   [p * rows_per_group, min(rows, (p + 1) * rows_per_group)) one after another.
//   Thread t holds elements [c * 4 TG + 4t, ... + 4) of chunk c; past n they read as 0.
//   threadgroup memory: 3 x 32 floats. Every thread reaches every barrier (no early return).
// TRAFFIC: a row of n <= 4096 (one chunk) is read once (y, z, w, g) and dy, dz written once;
//   longer rows are read three times (max, sums, outputs). dw_partial: groups * n floats
//   written once; the wrapper sums its rows in a fixed order (deterministic, no atomics).
#include "common.h"
// ---- kernel body ----
constexpr uint ITEMS = 4;
threadgroup float tg_max[32];
threadgroup float tg_ss[32];
threadgroup float tg_dot[32];

const uint lid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sgi = simdgroup_index_in_threadgroup;
const uint n_simd = threads_per_threadgroup.x / 32;
const uint n = n_cols;
const uint chunk = threads_per_threadgroup.x * ITEMS;
const uint n_chunks = (n + chunk - 1) / chunk;
const uint group = threadgroup_position_in_grid.y;
const uint row0 = group * rows_per_group;
const uint row_end = min(row0 + rows_per_group, n_rows);

float yv[ITEMS];
float zv[ITEMS];
float wv[ITEMS];
float gv[ITEMS];
float dwv[ITEMS];
for (uint j = 0; j < ITEMS; ++j) {
  dwv[j] = 0.0f;
}
for (uint row = row0; row < row_end; ++row) {
  const size_t base = size_t(row) * n;
  // pass 1: the row's max |y| (a one-chunk row stays in registers from here on)
  float abs_max = 0.0f;
  for (uint c = 0; c < n_chunks; ++c) {
    for (uint j = 0; j < ITEMS; ++j) {
      const uint col = c * chunk + lid * ITEMS + j;
      const bool inside = col < n;
      yv[j] = inside ? float(y[base + col]) : 0.0f;
      zv[j] = inside ? float(z[base + col]) : 0.0f;
      wv[j] = inside ? float(w[col]) : 0.0f;
      gv[j] = inside ? float(g[base + col]) : 0.0f;
      abs_max = max(abs_max, metal::fabs(yv[j]));
    }
  }
  const float row_max = mt_threadgroup_max(abs_max, tg_max, lane, sgi, n_simd);
  const float m = row_max > 0.0f ? row_max : 1.0f;  // any m > 0 serves an all-zero row
  // pass 2: sum u^2 and sum a * u
  float ss = 0.0f;
  float au = 0.0f;
  for (uint c = 0; c < n_chunks; ++c) {
    for (uint j = 0; j < ITEMS; ++j) {
      if (n_chunks > 1) {
        const uint col = c * chunk + lid * ITEMS + j;
        const bool inside = col < n;
        yv[j] = inside ? float(y[base + col]) : 0.0f;
        zv[j] = inside ? float(z[base + col]) : 0.0f;
        wv[j] = inside ? float(w[col]) : 0.0f;
        gv[j] = inside ? float(g[base + col]) : 0.0f;
      }
      const float u = yv[j] / m;
      ss += u * u;
      au += gv[j] * wv[j] * mt_silu(zv[j]) * u;
    }
  }
  const float total = mt_threadgroup_sum(ss, tg_ss, lane, sgi, n_simd);
  const float dot = mt_threadgroup_sum(au, tg_dot, lane, sgi, n_simd);
  const float K = mt_rms_factor(m, total, n, eps);
  const float c_u = (K * K / float(n)) * dot;  // K^2 / n <= 1
  const float k_row = K / m;                  // the row's rsqrt(mean(y^2) + eps)
  // pass 3: dy, dz, and this row's share of dw
  for (uint c = 0; c < n_chunks; ++c) {
    for (uint j = 0; j < ITEMS; ++j) {
      const uint col = c * chunk + lid * ITEMS + j;
      const bool inside = col < n;
      if (n_chunks > 1) {
        yv[j] = inside ? float(y[base + col]) : 0.0f;
        zv[j] = inside ? float(z[base + col]) : 0.0f;
        wv[j] = inside ? float(w[col]) : 0.0f;
        gv[j] = inside ? float(g[base + col]) : 0.0f;
      }
      if (inside) {
        const float u = yv[j] / m;
        const float s = mt_silu(zv[j]);
        const float sg = 1.0f / (1.0f + metal::exp(-zv[j]));
        const float a = gv[j] * wv[j] * s;
        dy[base + col] = T((a - c_u * u) * k_row);
        dz[base + col] = ZT(gv[j] * wv[j] * u * K * (sg * (1.0f + zv[j] * (1.0f - sg))));
        const float dw_term = gv[j] * u * K * s;
        if (n_chunks == 1) {
          dwv[j] += dw_term;
        } else {
          const size_t at = size_t(group) * n + col;
          dw_partial[at] = (row == row0 ? 0.0f : dw_partial[at]) + dw_term;
        }
      }
    }
  }
  // The next row's reductions rewrite the scratch arrays: wait until every thread read them.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (n_chunks == 1) {
  for (uint j = 0; j < ITEMS; ++j) {
    const uint col = lid * ITEMS + j;
    if (col < n) {
      dw_partial[size_t(group) * n + col] = dwv[j];
    }
  }
}
