// expert_glu.metal: MoE decode gate and up projections of the experts chosen by GPU-resident
// ids, with the gated activation, in one dispatch (quantized experts as expert_qmv.metal).
//
// MATH (pair p = (token t, slot j), e = ids(t, j), n in [0, N)):
//   g = sum_k x_p[k] * Wg[e, n, k] + bias_gate[e, n],  u = sum_k x_p[k] * Wu[e, n, k] + bias_up[e, n]
//   (W dequantized per MODE exactly as in expert_qmv.metal; the bias terms only if has_bias)
//   ACT 0 (silu):       out[p, n] = g / (1 + exp(-g)) * u
//   ACT 1 (swiglu_oai): gc = min(g, limit), uc = clamp(u, -limit, limit),
//                       out[p, n] = (uc + 1) * gc / (1 + exp(-alpha * gc))   (mlx-lm SwigluOAI)
//   g and u are evaluated as expert_qmv evaluates one row (float32 lane chunks, simd_sum),
//   the activation in float32, rounded once to T.
//   OUT-OF-RANGE IDS: an id >= E (uint; negative int32 ids too) gives a NaN row; nothing of
//   the expert is read for that pair.
//
// LAYOUT (row-contiguous): x, indices, bcast, the runtime sizes and the broadcast token grid
//   exactly as expert_qmv.metal; w_gate / w_up [E, N, K / PACK] uint32, scales_* / biases_*
//   [E, N, K / GS] (fp modes: uint8 scales, biases_* not read), bias_gate / bias_up [E, N] T
//   (read only if has_bias; otherwise the wrapper passes x, never read), alpha / limit
//   float32 scalars (ACT 1), out [P, N] T.
//   Template: T, BITS, GROUP_SIZE, MODE as expert_qmv; ACT in {0, 1}.
//
// DISPATCH INVARIANTS: as expert_qmv.metal's, launch plans included: threadgroup
//   (64 * S, 1, 1), grid (64 * S, ceil(N / 8), P), S K groups per row block (S = 1 on Metal;
//   cuda: K split where the grid is small, only where N % 8 == 0); row block s of row-tile y
//   owns rows [(2y + s) * 4, + 4) of BOTH projections, so each (pair, row) is written by one
//   lane and each word/scale/bias of the selected expert's gate and up rows is read by
//   exactly one lane; the activations x_p are loaded once per row block for both projections.
//   REDUCTION ORDER as expert_qmv.metal's for g and u alike (S > 1: the K groups' sums added
//   in group order, then bias and activation by group 0's lane 0).
//
// LOADS: as expert_qmv.metal's LOADS: each 32-lane step issues all of its loads first (2
//   words of each of the 4 rows of both projections: 16 words per lane, as expert_qmv's 4 x
//   4; the group leaders' scales and biases; the activations), then shuffles and computes.
//   2 words per projection keeps the registers near expert_qmv's (16 words, 16 activations).
//
// TRAFFIC PER CALL: the valid pairs' gate and up rows once each, x once per row block (from
//   cache after the first tile: DRAM sees it once per token), out [P, N] once.
//
// CHECKED ONLY ON A MAC: as expert_qmv.metal (same constructs), plus metal::exp / metal::min
//   / metal::clamp on float.
#include "common.h"
#include "expert_qdot.h"
// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;
constexpr uint ROWS = 4;
constexpr uint PACK = 32 / BITS;
// Words per lane per step and projection: 2 (16 words in flight with both projections).
constexpr int WORDS = 2;
constexpr uint VALS = WORDS * PACK;
constexpr uint LANES_PER_GROUP = GROUP_SIZE / VALS;
constexpr int SCALE_FORMAT = MODE == 3 ? 1 : MODE;
constexpr uint MAX_K_GROUPS = 8;

// Per (K group, row block, row): a K group's gate and up sums (S > 1 only).
threadgroup float partials[MAX_K_GROUPS * SIMDGROUPS * ROWS * 2];

const uint lane = thread_index_in_simdgroup;
const uint pair = threadgroup_position_in_grid.z;
const uint k_groups = simdgroups_per_threadgroup / SIMDGROUPS;  // the launch plan's S
const uint row_block = simdgroup_index_in_threadgroup % SIMDGROUPS;
const uint k_group = simdgroup_index_in_threadgroup / SIMDGROUPS;
const uint row0 = (threadgroup_position_in_grid.y * SIMDGROUPS + row_block) * ROWS;
const uint n_rows_total = n_out;
if (row0 >= n_rows_total) {
  return;  // uniform over the SIMD-group
}
const uint rows = metal::min(ROWS, n_rows_total - row0);
device T* out_rows = out + size_t(pair) * n_rows_total + row0;

constexpr int BCAST_DIMS = 4;
const uint token = pair / n_sel;
const uint slot = pair - token * n_sel;
uint x_at = slot * x_slot;
uint id_at = slot;
uint rest = token;
for (int d = BCAST_DIMS - 1; d >= 0; --d) {
  const uint size = bcast[3 * d];
  const uint c = rest % size;
  rest /= size;
  x_at += c * bcast[3 * d + 1];
  id_at += c * bcast[3 * d + 2];
}

const uint expert = uint(indices[id_at]);
if (expert >= n_experts) {
  if (k_group == 0 && lane < rows) {
    out_rows[lane] = T(metal::numeric_limits<float>::quiet_NaN());
  }
  return;
}

const uint K = k_in;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint n_chunks = K / VALS;
const size_t first_row = size_t(expert) * n_rows_total + row0;
const auto wg_rows = w_gate + first_row * words_per_row;
const auto sg_rows = scales_gate + first_row * groups_per_row;
const auto bg_rows = biases_gate + first_row * groups_per_row;
const auto wu_rows = w_up + first_row * words_per_row;
const auto su_rows = scales_up + first_row * groups_per_row;
const auto bu_rows = biases_up + first_row * groups_per_row;
const auto x_row = x + size_t(x_at) * K;
const ushort group_leader = ushort(lane & ~(LANES_PER_GROUP - 1));
const bool loads_group = (lane % LANES_PER_GROUP) == 0;

float acc_g[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
float acc_u[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
// K group g takes the steps g, g + S, ... (trip count uniform over the SIMD-group).
for (uint base = 32 * k_group; base < n_chunks; base += 32 * k_groups) {
  const uint chunk = base + lane;
  const bool active = chunk < n_chunks;
  const uint group = chunk / LANES_PER_GROUP;
  // 1. Every load of the step, none waiting for another (expert_qmv.metal's LOADS): the
  //    words of all rows of both projections, the leaders' scales (and biases), x.
  uint words_g[ROWS][WORDS];
  uint words_u[ROWS][WORDS];
  for (uint r = 0; r < ROWS; ++r) {
    for (int wi = 0; wi < WORDS; ++wi) {
      const bool here = active && r < rows;
      const size_t at = size_t(r) * words_per_row + chunk * WORDS + wi;
      words_g[r][wi] = here ? wg_rows[at] : 0u;
      words_u[r][wi] = here ? wu_rows[at] : 0u;
    }
  }
  float scale_g[ROWS], scale_u[ROWS], bias_g[ROWS], bias_u[ROWS];
  for (uint r = 0; r < ROWS; ++r) {
    scale_g[r] = scale_u[r] = bias_g[r] = bias_u[r] = 0.0f;
    if (active && loads_group && r < rows) {
      const uint at = r * groups_per_row + group;
      scale_g[r] = mt_fp4_scale<SCALE_FORMAT>(sg_rows[at]);
      scale_u[r] = mt_fp4_scale<SCALE_FORMAT>(su_rows[at]);
      if constexpr (MODE == 0) {
        bias_g[r] = float(bg_rows[at]);
        bias_u[r] = float(bu_rows[at]);
      }
    }
  }
  float xv[VALS];
  for (uint i = 0; i < VALS; ++i) {
    xv[i] = active ? float(x_row[chunk * VALS + i]) : 0.0f;
  }
  // 2. Shuffles and arithmetic.
  float x_sum = 0.0f;
  for (uint i = 0; i < VALS; ++i) {
    x_sum += xv[i];
  }
  for (uint r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      break;  // uniform over the SIMD-group
    }
    float sg = scale_g[r], bg = bias_g[r], su = scale_u[r], bu = bias_u[r];
    sg = simd_shuffle(sg, group_leader);
    su = simd_shuffle(su, group_leader);
    if constexpr (MODE == 0) {
      bg = simd_shuffle(bg, group_leader);
      bu = simd_shuffle(bu, group_leader);
    }
    if (active) {
      const float dg = mt_expert_qdot<MODE, BITS, WORDS>(words_g[r], xv);
      const float du = mt_expert_qdot<MODE, BITS, WORDS>(words_u[r], xv);
      if constexpr (MODE == 0) {
        acc_g[r] += sg * dg + bg * x_sum;
        acc_u[r] += su * du + bu * x_sum;
      } else {
        acc_g[r] += sg * dg;
        acc_u[r] += su * du;
      }
    }
  }
}

if (k_groups > 1u) {  // uniform; every row block holds ROWS rows here (DISPATCH INVARIANTS)
  for (uint r = 0; r < ROWS; ++r) {
    const float g_sum = simd_sum(acc_g[r]);
    const float u_sum = simd_sum(acc_u[r]);
    if (lane == 0) {
      const uint at = ((k_group * SIMDGROUPS + row_block) * ROWS + r) * 2;
      partials[at] = g_sum;
      partials[at + 1] = u_sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (k_group != 0) {
    return;  // uniform over the SIMD-group; no barrier follows
  }
  for (uint r = 0; r < ROWS; ++r) {
    float g_sum = 0.0f;
    float u_sum = 0.0f;
    for (uint g = 0; g < k_groups; ++g) {  // fixed order: K group 0, 1, ...
      const uint at = ((g * SIMDGROUPS + row_block) * ROWS + r) * 2;
      g_sum += partials[at];
      u_sum += partials[at + 1];
    }
    // Lane 0 holds the totals, the other lanes 0: the simd_sums below return them exactly.
    acc_g[r] = lane == 0 ? g_sum : 0.0f;
    acc_u[r] = lane == 0 ? u_sum : 0.0f;
  }
}

for (uint r = 0; r < ROWS; ++r) {
  if (r >= rows) {
    break;  // uniform over the SIMD-group
  }
  float g = simd_sum(acc_g[r]);
  float u = simd_sum(acc_u[r]);
  if (lane == 0) {
    if (has_bias != 0u) {
      const size_t at = size_t(expert) * n_rows_total + row0 + r;
      g += float(bias_gate[at]);
      u += float(bias_up[at]);
    }
    float y;
    if constexpr (ACT == 0) {
      y = g / (1.0f + metal::exp(-g)) * u;
    } else {
      const float gc = metal::min(g, limit);
      const float uc = metal::clamp(u, -limit, limit);
      y = (uc + 1.0f) * (gc / (1.0f + metal::exp(-alpha * gc)));
    }
    out_rows[r] = T(y);
  }
}
