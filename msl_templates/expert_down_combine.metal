// expert_down_combine.metal: MoE decode down projection of the experts chosen by GPU-resident
// ids, scaled by the router scores and summed over the k experts, in one dispatch.
//
// MATH (token t, slots j < k, e_j = ids(t, j), d in [0, D)):
//   out[t, d] = sum_{j < k} score(t, j) * (sum_n h[t, j, n] * W[e_j, d, n] + bias[e_j, d])
//   (W dequantized per MODE exactly as in expert_qmv.metal; the bias term only if has_bias)
//   REDUCTION ORDER (fixed for a given k and launch plan: bitwise reproducible run to run):
//   the token's slots j are dealt to the S slot groups of a row block, slot group g taking
//   j = g, g + S, g + 2S, ... (S = 1: every slot). For each of its slots in increasing j, lane
//   l sums its chunks l, l + 32, ... in order into a partial (lane 0 then adds bias[e_j, d])
//   and adds score_j * partial to its accumulator; the 32 lane accumulators are combined by
//   one simd_sum. S = 1: that is the output. S > 1: the S slot-group sums are added in order
//   g = 0, 1, ..., S - 1 (through threadgroup memory) by slot group 0. float32 throughout,
//   rounded once to T.
//   No atomics.
//   OUT-OF-RANGE IDS: if any of the token's k ids is >= E (uint; negative int32 ids too) the
//   token's whole output row is NaN and nothing of its experts is read.
//
// LAYOUT (row-contiguous):
//   h       [T * k, N] T        the token's k expert inputs, token-major (expert_glu's output)
//   w       [E, D, N / PACK]    uint32;  scales / biases [E, D, N / GS] (fp modes: uint8
//                               scales, biases not read: the wrapper passes scales again)
//   indices [T * k] uint32/int32;  scores [T * k] float32, float16 or bfloat16
//   bias    [E, D] T (read only if has_bias; else the wrapper passes h, never read)
//   out     [T, D] T
//   n_experts (E), n_out (D), k_in (N), n_sel (k), has_bias: 0-d uint runtime inputs.
//   Template: T, BITS, GROUP_SIZE, MODE as expert_qmv.metal.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes and the backend):
//   threadgroup (64 * S, 1, 1): SIMD-group i is row block i % 2 of slot group i / 2, S in
//   [1, MAX_SLOT_GROUPS] (the kernel reads S from simdgroups_per_threadgroup);
//   grid (64 * S, ceil(D / 8), T): row block b of row-tile y owns rows [(2y + b) * 4, + 4) of
//   token z clipped to D (a block past D owns none, reads nothing, and still meets the
//   barrier); each output element is written by one lane, and each word/scale/bias of each
//   selected expert's rows is read by exactly one lane (scales/biases by a group's first
//   lane, shuffled to the others), by the one SIMD-group holding that slot and row block.
//   Threadgroup memory: MAX_SLOT_GROUPS * 8 floats, written and read (after one barrier)
//   only when S > 1. The only early return (an invalid id) is uniform over the threadgroup.
//   K % GS == 0 with GS a multiple of VALS, as expert_qmv.metal.
//
// LAUNCH PLANS: Metal: S = 1, threadgroup (64, 1, 1) as before: each SIMD-group walks the k
//   slots of its 4 rows, no barrier (the plan measured against MLX's Metal kernels; whether
//   S > 1 pays on Apple GPUs is for a Mac to measure, so it is left unchanged). cuda: the k
//   slots spread evenly over S = ceil(k / ceil(k / 8)) slot groups (k = 8: 8 groups of one
//   slot): Qwen3-30B-A3B decode (D = 2048, one token) runs 256 threadgroups of 16 warps
//   (4096 warps) instead of 512 warps that each walk 8 experts one after another.
//
// LOADS: as expert_qmv.metal's LOADS: per step, 4 words (nvfp4: 2) of each of the 4 rows,
//   the group leaders' scales and biases and the VALS activations, all issued before any is
//   used; then the shuffles and the arithmetic.
//
// TRAFFIC PER CALL: each valid token's k experts' down rows once, h once per (slot, row
//   block) (from cache after the first tile), ids and scores once per thread (broadcast loads),
//   out [T, D] once; no [T, k, D] intermediate exists.
//
// CHECKED ONLY ON A MAC: as expert_qmv.metal (same constructs), plus a kernel-scope
//   threadgroup array and threadgroup_barrier; S > 1 runs on the emulator in the tests.
#include "common.h"
#include "expert_qdot.h"
// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;         // row blocks per threadgroup
constexpr uint ROWS = 4;               // output rows per SIMD-group
constexpr uint MAX_SLOT_GROUPS = 8;    // SIMD-groups sharing one row block's slots, at most
constexpr uint PACK = 32 / BITS;
// Words per lane per step: 4, or one whole group where a group holds fewer (nvfp4: 2).
constexpr int WORDS = GROUP_SIZE * BITS / 32 < 4 ? GROUP_SIZE * BITS / 32 : 4;
constexpr uint VALS = WORDS * PACK;
constexpr uint LANES_PER_GROUP = GROUP_SIZE / VALS;
constexpr int SCALE_FORMAT = MODE == 3 ? 1 : MODE;

// Per (slot group, row block, row): a slot group's sum, combined in slot-group order.
threadgroup float partials[MAX_SLOT_GROUPS * SIMDGROUPS * ROWS];

const uint lane = thread_index_in_simdgroup;
const uint token = threadgroup_position_in_grid.z;
const uint slot_groups = simdgroups_per_threadgroup / SIMDGROUPS;  // the launch plan's S
const uint row_block = simdgroup_index_in_threadgroup % SIMDGROUPS;
const uint slot_group = simdgroup_index_in_threadgroup / SIMDGROUPS;
const uint row0 = (threadgroup_position_in_grid.y * SIMDGROUPS + row_block) * ROWS;
const uint n_rows_total = n_out;
// A row block past D (ragged D) has no rows: it reads nothing but still meets the barrier.
const uint rows = row0 < n_rows_total ? metal::min(ROWS, n_rows_total - row0) : 0u;
device T* out_rows = out + size_t(token) * n_rows_total + row0;
const uint k = n_sel;

bool all_valid = true;
for (uint j = 0; j < k; ++j) {
  all_valid = all_valid && uint(indices[token * k + j]) < n_experts;
}
if (!all_valid) {
  // An out-of-range id (uniform over the threadgroup): NaN row, nothing of the experts read.
  if (slot_group == 0 && lane < rows) {
    out_rows[lane] = T(metal::numeric_limits<float>::quiet_NaN());
  }
  return;
}

const uint K = k_in;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint n_chunks = rows == 0u ? 0u : K / VALS;
const ushort group_leader = ushort(lane & ~(LANES_PER_GROUP - 1));
const bool loads_group = (lane % LANES_PER_GROUP) == 0;

float acc[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
for (uint j = 0; j < k; ++j) {  // fixed order over the token's experts
  if (j % slot_groups != slot_group) {
    continue;  // another SIMD-group's slot (uniform over the SIMD-group)
  }
  const uint pair = token * k + j;
  const uint expert = uint(indices[pair]);
  const float score = float(scores[pair]);
  const size_t first_row = size_t(expert) * n_rows_total + row0;
  const auto w_rows = w + first_row * words_per_row;
  const auto s_rows = scales + first_row * groups_per_row;
  const auto b_rows = biases + first_row * groups_per_row;
  const auto h_row = h + size_t(pair) * K;
  float part[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint base = 0; base < n_chunks; base += 32) {  // trip count uniform
    const uint chunk = base + lane;
    const bool active = chunk < n_chunks;
    const uint group = chunk / LANES_PER_GROUP;
    // 1. Every load of the step, none waiting for another (expert_qmv.metal's LOADS).
    uint words[ROWS][WORDS];
    for (uint r = 0; r < ROWS; ++r) {
      for (int wi = 0; wi < WORDS; ++wi) {
        words[r][wi] = active && r < rows
                           ? w_rows[size_t(r) * words_per_row + chunk * WORDS + wi] : 0u;
      }
    }
    float scale[ROWS];
    float bias_g[ROWS];
    for (uint r = 0; r < ROWS; ++r) {
      scale[r] = bias_g[r] = 0.0f;
      if (active && loads_group && r < rows) {
        scale[r] = mt_fp4_scale<SCALE_FORMAT>(s_rows[r * groups_per_row + group]);
        if constexpr (MODE == 0) {
          bias_g[r] = float(b_rows[r * groups_per_row + group]);
        }
      }
    }
    float xv[VALS];
    for (uint i = 0; i < VALS; ++i) {
      xv[i] = active ? float(h_row[chunk * VALS + i]) : 0.0f;
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
      const float s = simd_shuffle(scale[r], group_leader);
      const float b = MODE == 0 ? simd_shuffle(bias_g[r], group_leader) : 0.0f;
      if (active) {
        const float dot = mt_expert_qdot<MODE, BITS, WORDS>(words[r], xv);
        if constexpr (MODE == 0) {
          part[r] += s * dot + b * x_sum;
        } else {
          part[r] += s * dot;
        }
      }
    }
  }
  for (uint r = 0; r < ROWS; ++r) {
    if (has_bias != 0u && lane == 0 && r < rows) {
      part[r] += float(bias[size_t(expert) * n_rows_total + row0 + r]);
    }
    acc[r] += score * part[r];
  }
}

if (slot_groups == 1u) {  // uniform over the threadgroup
  for (uint r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      break;  // uniform over the SIMD-group
    }
    const float total = simd_sum(acc[r]);
    if (lane == 0) {
      out_rows[r] = T(total);
    }
  }
} else {
  for (uint r = 0; r < ROWS; ++r) {
    const float total = simd_sum(acc[r]);  // 0 for rows past D
    if (lane == 0) {
      partials[(slot_group * SIMDGROUPS + row_block) * ROWS + r] = total;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (slot_group == 0 && lane < rows) {
    float total = 0.0f;
    for (uint g = 0; g < slot_groups; ++g) {  // fixed order: slot group 0, 1, ...
      total += partials[(g * SIMDGROUPS + row_block) * ROWS + lane];
    }
    out_rows[lane] = T(total);
  }
}
