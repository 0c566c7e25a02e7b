// moe_route.metal: an MoE router's top-k experts and their scores, one SIMD-group per row.
//
// MATH (per row of E router logits l_0 .. l_{E-1}, all in float32, scores rounded once to T):
//   ids[r], r = 0 .. k-1: the k experts with the largest logits, slot 0 the largest; equal
//     logits in ascending expert index (the lower index takes the earlier slot). NaN ranks
//     above every number (+inf included), NaNs among themselves by index; -0 equals +0.
//   m = l[ids[0]] (the row's max), e_r = exp(l[ids[r]] - m) (0 for a -inf logit)
//   over_k != 0:    scores[r] = e_r / sum_{r' < k} e_r'        (softmax over the k selected)
//   over_k == 0:    scores[r] = e_r / sum_{j < E} exp(l_j - m)  (softmax over all E)
//   A row whose max m is not finite (a NaN logit anywhere in it, a +inf logit, or every
//   logit -inf) gets NaN scores, as softmax does there; its ids are still distinct and in
//   [0, E). -inf logits below a finite max are masked experts: score 0 where selected.
//
// HOW: each logit becomes an order-preserving uint key (mt_route_key: NaN the largest key,
//   -0 as +0). k rounds: round r takes the largest (key, -index) strictly below round r-1's
//   pick (each lane its own candidate, then simd_max of the keys and simd_min of the
//   indices holding that key); lane r keeps round r's pick. Since k <= E a pick always
//   exists. The softmax statistics are SIMD-group sums in float32.
//
// LAYOUT: logits [rows, E] T (row-contiguous); ids [rows, k] uint32, scores [rows, k] T.
//   n_rows, n_experts (E), top_k (k) and over_k (normalize: 1, else 0): 0-d uint32 runtime
//   inputs.
// TEMPLATE: T (the logits' and scores' dtype).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32, 8, 1); grid = (32, round_up(rows, 8), 1): thread_position_in_grid.y
//   is the row, one SIMD-group per row. 1 <= k <= E, k <= 32 (lane r < k holds slot r);
//   any E < 2^31. Lane l holds experts l + 32 j (j < N_REG) in registers; experts from
//   32 * N_REG on are read again from memory each round (E > 512). No threadgroup memory
//   and no barrier: a SIMD-group whose row is past n_rows returns as a whole (uniform), so
//   every max / min / sum over the lanes sees all 32 of them: common.h's converged promise
//   (mt_max_converged, mt_min_converged, mt_sum_converged; the emulator checks it).
// TRAFFIC: the row read once for E <= 512 (beyond, experts from 512 on once per round and once
//   more for the sum over all E: cache-resident), (4 + sizeof(T)) k bytes
//   per row written (ids uint32, scores T).
#include "common.h"

// An order-preserving key: a < b (as numbers) => key(a) < key(b); NaN (any payload or sign)
// above +inf; -0 and +0 one key. Integer only, so no math mode can change it. Every key of
// a logit is >= key(-inf) = 0x007FFFFF > 0, so 0 serves as "no candidate".
inline uint mt_route_key(float v) {
  const uint b = as_type<uint>(v);
  const uint magnitude = b & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {
    return 0xFFFFFFFFu;
  }
  if (magnitude == 0u) {
    return 0x80000000u;
  }
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float a key came from (NaN's key decodes to a NaN).
inline float mt_route_value(uint key) {
  return as_type<float>((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// exp(l - m) for a finite m: exactly 0 for l = -inf (a masked expert).
inline float mt_route_exp(uint key, float m) {
  return key == 0x007FFFFFu ? 0.0f : metal::precise::exp(mt_route_value(key) - m);
}
// ---- kernel body ----
constexpr uint N_REG = 16;  // experts per lane held in registers (E <= 512)
constexpr uint NAN_KEY = 0xFFFFFFFFu;      // mt_route_key(NaN)
constexpr uint POS_INF_KEY = 0xFF800000u;  // mt_route_key(+inf)
constexpr uint NEG_INF_KEY = 0x007FFFFFu;  // mt_route_key(-inf)

const uint row = thread_position_in_grid.y;
if (row >= n_rows) {
  return;
}
const uint lane = thread_index_in_simdgroup;
const uint n = n_experts;
const uint k = top_k;
const size_t base = size_t(row) * n;
const uint n_held = min(n, 32u * N_REG);  // experts [0, n_held) are in registers

uint keys[N_REG];
for (uint j = 0; j < N_REG; ++j) {
  const uint i = lane + 32u * j;
  keys[j] = i < n_held ? mt_route_key(float(logits[base + i])) : 0u;
}

// k rounds, each picking the largest (key, -index) below the previous pick.
uint prev_key = 0u;
uint prev_idx = 0u;
uint my_key = 0u;  // lane r: round r's pick
uint my_idx = 0u;
uint max_key = 0u;  // round 0's pick: the row's max
for (uint r = 0; r < k; ++r) {
  uint best_key = 0u;  // below every logit's key: no candidate yet
  uint best_idx = 0xFFFFFFFFu;
  // Visited in ascending index: a strictly larger key replaces, so ties keep the lower one.
  for (uint j = 0; j < N_REG; ++j) {
    const uint i = lane + 32u * j;
    const uint key = keys[j];
    const bool below = r == 0u || key < prev_key || (key == prev_key && i > prev_idx);
    if (i < n_held && below && key > best_key) {
      best_key = key;
      best_idx = i;
    }
  }
  for (uint i = n_held + lane; i < n; i += 32u) {
    const uint key = mt_route_key(float(logits[base + i]));
    const bool below = r == 0u || key < prev_key || (key == prev_key && i > prev_idx);
    if (below && key > best_key) {
      best_key = key;
      best_idx = i;
    }
  }
  prev_key = mt_max_converged(best_key);
  prev_idx = mt_min_converged(best_key == prev_key ? best_idx : 0xFFFFFFFFu);
  if (r == 0u) {
    max_key = prev_key;
  }
  if (lane == r) {
    my_key = prev_key;
    my_idx = prev_idx;
  }
}

const bool finite_max = max_key != NAN_KEY && max_key != POS_INF_KEY && max_key != NEG_INF_KEY;
const float m = finite_max ? mt_route_value(max_key) : 0.0f;
const float e = (finite_max && lane < k) ? mt_route_exp(my_key, m) : 0.0f;
float denom;
if (over_k != 0u) {
  denom = mt_sum_converged(e);
} else {
  float part = 0.0f;
  if (finite_max) {
    for (uint j = 0; j < N_REG; ++j) {
      if (lane + 32u * j < n_held) {
        part += mt_route_exp(keys[j], m);
      }
    }
    for (uint i = n_held + lane; i < n; i += 32u) {
      part += mt_route_exp(mt_route_key(float(logits[base + i])), m);
    }
  }
  denom = mt_sum_converged(part);
}

if (lane < k) {
  const size_t out = size_t(row) * k + lane;
  ids[out] = my_idx;
  scores[out] = finite_max ? T(e / denom) : T(NAN);
}
