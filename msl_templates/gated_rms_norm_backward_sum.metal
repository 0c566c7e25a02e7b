// gated_rms_norm_backward_sum.metal: dweight of gated_rms_norm's VJP from the per-threadgroup
// partial sums of gated_rms_norm_backward.metal.
//
// MATH: dw[i] = T(sum_{p < parts} partial[p, i]), p in order (the same bits every run), float32.
//
// LAYOUT: partial [parts, n] float32 (row-contiguous), dw [n] T (weight's dtype); n_cols (n)
//   and n_parts: 0-d uint32 runtime inputs.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (TG, 1, 1), TG = min(256, round_up(n, 32)); grid = (round_up(n, TG), 1, 1):
//   thread i owns column i; threads past n return (no barrier in this kernel).
// TRAFFIC: partial read once (parts * n * 4 bytes), dw written once.
#include "common.h"
// ---- kernel body ----
const uint col = thread_position_in_grid.x;
if (col >= n_cols) {
  return;
}
float acc = 0.0f;
for (uint p = 0; p < n_parts; ++p) {
  acc += partial[size_t(p) * n_cols + col];
}
dw[col] = T(acc);
