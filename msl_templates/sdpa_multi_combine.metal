// sdpa_multi_combine.metal: pass 2 of sdpa_multi. Merges the per-slice partial softmax
// results of sdpa_multi.metal into the output rows.
//
// MATH (per output row, float32, base-2 exponentials, rounded once to T):
//   M = max_s m_s;  w_s = 2^(b (m_s - M)) lsum_s;  out[d] = sum_s (w_s / sum_t w_t) * o_s[d]
//   b = mt_score_unit(scale).y (common.h): the maxima m_s are in the split kernel's score
//   units d = s / b. o_s is the slice's softmax @ v, already divided by lsum_s.
//   2^(b (m_s - M)) is taken as 1 when m_s == M. A slice that saw no key of the row has
//   m_s = -INFINITY, lsum_s = 0, o_s = 0, so w_s = 2^-inf = 0 once any slice saw a key
//   (whatever the finite scores: M may be anything down to -FLT_MAX), and no
//   2^(-inf - -inf) = NaN is formed when none did. SINKS (has_sinks != 0): the sink logit
//   sinks[h] of the row's query head h joins the denominator only, as one more slice with
//   m = sinks[h] * log2(e) / b, lsum = 1, o = 0. A row with sum_s w_s == 0 (every key
//   masked by an additive -inf and no sink) is written as NaN, as MLX's own sdpa gives.
//   Relies on IEEE infinities, as sdpa_multi.metal does (MLX's default "safe" math mode).
// RANGE: the weights w_s / sum_t w_t sum to 1, so no partial sum exceeds max |v| (merging
//   unnormalised sums overflowed float32 once kv_len * |v| did). COST: one more loop over
//   the (m, lsum) pairs of the row (8 bytes per slice), no extra read of o_part.
//
// LAYOUT: o_part [n_rows, n_splits, D] float32, ml_part [n_rows, n_splits, 2] float32
//   (m, lsum), out [n_rows, D] T (n_rows = B*Hq*L: the rows of q [B, Hq, L, D]), all
//   row-contiguous.
//   0-d runtime inputs: n_rows, n_splits (uint), scale (float, the split kernel's),
//   n_q (L), n_heads (Hq), has_sinks (0/1) as uint; sinks [Hq] float32 (a 1-element dummy
//   when has_sinks == 0). Row r is query r % L of head (r / L) % Hq.
//   Template: T, D (multiple of 32).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * RPT, 1, 1), RPT rows per threadgroup, one simdgroup per row;
//   grid = (32 * RPT * ceil(n_rows / RPT), 1, 1); simdgroups past n_rows return at once
//   (there is no barrier). Lane i owns columns i + 32*c.
//   No threadgroup memory.
//
// REDUCTION ORDER: slices are merged in increasing slice order.
// TRAFFIC: every lane reads each (m, lsum) of its row at the same address, in three loops
//   (the emulator's counters see 32 reads per loop); o_part is read once, out written once.
// Checked only on a Mac: that Apple's compiler accepts the body, and the speed.
#include "common.h"
// ---- kernel body ----
constexpr int DPL = D / 32;
static_assert(D % 32 == 0, "head dim tiling");

const uint rows_per_tg = threads_per_threadgroup.x / 32u;
const uint row = threadgroup_position_in_grid.x * rows_per_tg + simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
if (row >= n_rows) {
  return;
}
const uint ns = n_splits;
const size_t first = size_t(row) * ns;
const float unit = mt_score_unit(scale).y;
// The sink of the row's query head: one more logit, with no value (lsum 1, o 0).
const float sink = has_sinks != 0u
    ? sinks[(row / n_q) % n_heads] * (1.4426950408889634f / unit) : -INFINITY;

float m_max = sink;
for (uint s = 0; s < ns; ++s) {
  m_max = max(m_max, ml_part[(first + s) * 2u]);
}

float w_sum = has_sinks != 0u ? (sink == m_max ? 1.0f : exp2(unit * (sink - m_max))) : 0.0f;
for (uint s = 0; s < ns; ++s) {
  const float m_s = ml_part[(first + s) * 2u];
  w_sum += (m_s == m_max ? 1.0f : exp2(unit * (m_s - m_max))) * ml_part[(first + s) * 2u + 1u];
}
const float inv = w_sum > 0.0f ? 1.0f / w_sum : NAN;  // no key, no sink: NaN, as MLX

float acc[DPL];
for (int c = 0; c < DPL; ++c) {
  acc[c] = 0.0f;
}
for (uint s = 0; s < ns; ++s) {
  const size_t entry = first + s;
  const float m_s = ml_part[entry * 2u];
  const float w = (m_s == m_max ? 1.0f : exp2(unit * (m_s - m_max))) * ml_part[entry * 2u + 1u]
                  * inv;
  for (int c = 0; c < DPL; ++c) {
    acc[c] += w * o_part[entry * D + lane + 32u * uint(c)];
  }
}
for (int c = 0; c < DPL; ++c) {
  out[size_t(row) * D + lane + 32u * uint(c)] = T(acc[c]);
}
