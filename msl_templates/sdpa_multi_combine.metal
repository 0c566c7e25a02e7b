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
//   unnormalised sums overflowed float32 once kv_len * |v| did).
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
//   (there is no barrier; every shuffle below runs on a whole simdgroup). Lane i owns
//   columns i + 32*c. n_splits <= 32 * SPL = 128 (the split plans' MAX_SPLITS).
//   No threadgroup memory.
//
// DESIGN (latency: a row's work is a few KiB, the rows few at decode): lane i reads the
//   (m, lsum) of slices i + 32 j (j < SPL) in one round of loads and keeps their weights;
//   M and sum_s w_s are taken over the lanes by xor trees; then the slices' o rows are read
//   OB at a time, all OB loads issued before they are used, each slice's weight taken from
//   its lane by a shuffle. (Reading one slice after another cost a memory round trip per
//   slice: docs/nvidia-measurements.md, H200, revision f79c1dc.)
//
// REDUCTION ORDER: sum_s w_s: each lane's slices in increasing j, then the lanes by the
//   xor tree (partner 1, 2, 4, 8, 16; every lane gets the same bits), then the sink's
//   weight. o: the slices in increasing slice order.
// TRAFFIC: each (m, lsum) read once (by one lane), o_part read once, out written once.
// Checked only on a Mac: that Apple's compiler accepts the body, and the speed.
#include "common.h"
// ---- kernel body ----
constexpr int DPL = D / 32;
static_assert(D % 32 == 0, "head dim tiling");
constexpr int SPL = 4;  // slices per lane at most: n_splits <= 128
constexpr int OB = 8;   // slices whose o loads are in flight together

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

// Slices lane + 32 j: their (m, lsum), an absent slice as an empty one (m -inf, lsum 0).
float m_j[SPL];
float w_j[SPL];
for (int j = 0; j < SPL; ++j) {
  const uint s = lane + 32u * uint(j);
  m_j[j] = s < ns ? ml_part[(first + s) * 2u] : -INFINITY;
  w_j[j] = s < ns ? ml_part[(first + s) * 2u + 1u] : 0.0f;  // lsum, for now
}
float m_max = sink;
for (int j = 0; j < SPL; ++j) {
  m_max = max(m_max, m_j[j]);
}
for (ushort h = 16; h >= 1; h /= 2) {
  m_max = max(m_max, mt_shuffle_xor_converged(m_max, h));
}
float w_sum = 0.0f;
for (int j = 0; j < SPL; ++j) {
  const float m_s = m_j[j];
  w_j[j] = (m_s == m_max ? 1.0f : exp2(unit * (m_s - m_max))) * w_j[j];
  w_sum += w_j[j];
}
for (ushort h = 1; h < 32; h *= 2) {
  w_sum += mt_shuffle_xor_converged(w_sum, h);
}
if (has_sinks != 0u) {
  w_sum += sink == m_max ? 1.0f : exp2(unit * (sink - m_max));
}
const float inv = w_sum > 0.0f ? 1.0f / w_sum : NAN;  // no key, no sink: NaN, as MLX

float acc[DPL];
for (int c = 0; c < DPL; ++c) {
  acc[c] = 0.0f;
}
for (uint s0 = 0; s0 < ns; s0 += uint(OB)) {
  float ob[OB][DPL];
  for (int t = 0; t < OB; ++t) {
    const uint s = s0 + uint(t);
    for (int c = 0; c < DPL; ++c) {
      ob[t][c] = s < ns ? o_part[(first + s) * D + lane + 32u * uint(c)] : 0.0f;
    }
  }
  for (int t = 0; t < OB; ++t) {
    const uint s = s0 + uint(t);
    float mine = w_j[0];  // slice s's weight is w_j[s / 32] of lane s % 32
    for (int j = 1; j < SPL; ++j) {
      mine = s / 32u == uint(j) ? w_j[j] : mine;
    }
    const float w = mt_shuffle_converged(mine, ushort(s % 32u)) * inv;
    if (s < ns) {
      for (int c = 0; c < DPL; ++c) {
        acc[c] += w * ob[t][c];
      }
    }
  }
}
for (int c = 0; c < DPL; ++c) {
  out[size_t(row) * D + lane + 32u * uint(c)] = T(acc[c]);
}
