// expert_glu.metal: MoE decode gate and up projections of the experts chosen by GPU-resident
// ids, with the gated activation, in one dispatch (quantized experts as expert_qmv.metal).
//
// MATH (pair p = (token t, slot j), e = ids(t, j), n in [0, N)):
//   g = sum_k x_p[k] * Wg[e, n, k] + bias_gate[e, n],  u = sum_k x_p[k] * Wu[e, n, k] + bias_up[e, n]
//   (W dequantized per MODE exactly as in expert_qmv.metal; the bias terms only if has_bias)
//   ACT 0 (silu):       out[p, n] = g / (1 + exp(-g)) * u
//   ACT 1 (swiglu_oai): gc = min(g, limit), uc = clamp(u, -limit, limit),
//                       out[p, n] = (uc + 1) * gc / (1 + exp(-alpha * gc))   (mlx-lm SwigluOAI)
//   g and u are evaluated per uint32 word of PACK codes, in float32:
//     affine: scale_g * sum_i q_i * x_i + bias_g * sum_i x_i   (g the word's group)
//     fp modes: scale_g * sum_i v_i * x_i
//   (mt_expert_word_dot, expert_qdot.h: the affine codes are read without a shift or an
//   int -> float conversion against activations pre-scaled by powers of two, each product
//   bitwise that of q_i * x_i), reduced over the SIMD-group, the activation in float32,
//   rounded once to T.
//   REDUCTION ORDER (fixed for given shapes and launch plan: bitwise reproducible run to run),
//   for g and u alike: the 32-lane steps of K (STEP_WORDS = 64 words of a row each) are dealt
//   to the S K groups of a row block, group g taking steps g, g + S, ...; lane l adds, step
//   after step in increasing order, its word 0 then its word 1 (WORD MAPPING) to its
//   partial; the 32 partials are combined by simd_sum (hardware order). S > 1: the S group
//   sums are added in order g = 0, 1, ... (threadgroup memory) by group 0's lane 0, which
//   then adds the bias and applies the activation.
//   OUT-OF-RANGE IDS: an id >= E (uint; negative int32 ids too) gives a NaN row; nothing of
//   the expert is read for that pair.
//
// SHARING (SHARE 1, the shared_rows variant): several tokens' pairs often name the same
//   expert (decode of a few tokens, verification blocks). The threadgroup of pair p returns
//   at once (before any barrier) if an earlier pair q < p names the same valid expert e;
//   the first pair naming e (the leader) computes every pair naming e, in passes over e's
//   rows of MAX_SHARED pairs each (ascending pair order; more pairs: another pass, whose
//   weights are mostly L2 hits). A pass loads each step's gate and up words, scales and
//   biases once and, for each of its pairs, that pair's activations, and adds that pair's
//   own partials: every pair's sums are formed from the same words, lanes, K groups and
//   combine in the same order as in SHARE 0, so the output is bitwise that of SHARE 0
//   (checked on the emulator). An out-of-range id never leads or joins a group (its own
//   threadgroup writes its NaN row); ids duplicated within a token share like any others.
//   Finding the group: each SIMD-group of the threadgroup scans the ids in 32-lane chunks
//   (simd_any: an earlier pair names e; simd_min: the next pair naming e), the same verdict
//   in every SIMD-group (all read the same ids), so returns and trip counts are uniform
//   over the threadgroup. The layout is restricted to what decode passes: ids [P], x one
//   row per token (x_slot 0: pair q reads row q / n_sel) or per pair (x_slot 1: row q);
//   bcast is not read (the wrapper takes SHARE 0 for other broadcasts).
//   Why MAX_SHARED = 4: gpt-oss-20b (k 4) at 4 tokens names an expert at most 4 times (top-k
//   ids are distinct within a token), one pass; the pass's accumulators (2 x 4 rows per
//   pair) and the activations it keeps in flight set the registers (below).
//   When the wrapper takes it (SHARE_MIN_TOKENS in ops/expert_glu.py): one token's top-k
//   ids are distinct, nothing to share, so 1-token decode keeps SHARE 0; from 2 tokens the
//   weight bytes can only fall (each distinct expert's rows once per MAX_SHARED of its pairs
//   instead of once per pair), at the cost of a serial pass per group in one threadgroup
//   (up to 4x a pair's arithmetic), ceil(P / 32) + MAX_SHARED id chunks scanned per
//   threadgroup (cache hits) and the registers below. Off by default on every backend:
//   on an H100 (CUPTI, the patched block's decode path) it was slower, gpt-oss-20b at 4
//   tokens 95 -> 118 us, 8 tokens 182 -> 221, Qwen3-30B-A3B at 4 tokens 44.5 -> 57.9: the
//   kernel is latency-bound, and fewer, heavier threadgroups at 118 registers keep fewer
//   loads in flight than the saved bytes are worth. Apple's decode GEMVs are latency-bound
//   too, so Metal stays off until a Mac measures it (SHARE_MIN_TOKENS = {"metal": 2}).
//
// LAYOUT (row-contiguous): x, indices, bcast, the runtime sizes and the broadcast token grid
//   exactly as expert_qmv.metal; w_gate / w_up [E, N, K / PACK] uint32, scales_* / biases_*
//   [E, N, K / GS] (fp modes: uint8 scales, biases_* not read), bias_gate / bias_up [E, N] T
//   (read only if has_bias; otherwise the wrapper passes x, never read), alpha / limit
//   float32 scalars (ACT 1), out [P, N] T.
//   Template: T, BITS, GROUP_SIZE, MODE as expert_qmv; ACT in {0, 1}; SHARE in {0, 1}
//   (SHARING).
//
// WORD MAPPING: in a step starting at word w0 of a row, lane l holds words w0 + l and
//   w0 + 32 + l of each row of both projections and their PACK activations each
//   (x_p[(w0 + 32 * wi + l) * PACK + i]); the step's GS-groups (STEP_GROUPS = 64 / (GS / PACK),
//   2..32) are loaded one per lane, lane j holding group g0 + j of each row, and shuffled
//   to the lanes of that group's words (lane (32 * wi + l) / (GS / PACK)). Scale and
//   affine bias travel as one uint (mt_group_bits: two 16-bit values; a float T's bias
//   apart) and are decoded after the shuffle.
//   Why for both GPUs: each word-load instruction of a SIMD-group reads 128 contiguous
//   bytes (one 128-byte line: every sector fetched is used; NVIDIA counts 4 sectors where
//   the former lane-contiguous chunks of 2 words per lane spread one instruction over 256
//   bytes, 8 sectors of which half were used, and Apple's SIMD-group loads likewise
//   coalesce into fewer, fully used lines); a row's scales and biases of a step are one
//   contiguous load per row instead of one per row and word; and a lane's activations are
//   PACK contiguous values per word (lane stride PACK * sizeof(T) bytes instead of 2 PACK:
//   an activation load instruction spans half the lines it did). The activations are L1 /
//   cache hits after a pair's first row block (x_p is K values); they are loaded directly,
//   not staged in threadgroup memory: staging would add a store, a barrier and a load per
//   value for a saving of about one cache wavefront per load, and a padded threadgroup
//   array for 16 SIMD-groups x 512 floats would exceed Apple's 32 KB.
//
// DISPATCH INVARIANTS: launch plans as expert_qmv.metal's: threadgroup (64 * S, 1, 1), grid
//   (64 * S, ceil(N / 8), P), S K groups per row block (S = 1 on Metal; cuda: K split where
//   the grid is small, only where N % 8 == 0: no thread returns before the combine's
//   barrier); row block s of row-tile y owns rows [(2y + s) * 4, + 4) of BOTH projections,
//   so each (pair, row) is written by one lane. Each word of the selected expert's gate and
//   up rows is read by exactly one lane (word w0 + 32 * wi + l by lane l of the K group
//   holding the step), each group's scale and bias by exactly one lane (group g0 + j by
//   lane j; GS / PACK words per group divides 32, so a step holds whole groups), and x_p
//   once per row block for both projections. K % GS == 0 (a group never straddles the row
//   end; a partial last step masks words and groups past it). Every early return and every
//   branch around a SIMD-group function is uniform over the SIMD-group, and threadgroups
//   hold whole SIMD-groups: the group shuffles and row sums of a step keep common.h's
//   converged promise (mt_shuffle_converged, mt_sum_converged; the emulator checks it).
//   SHARE 1: per pass instead of per pair (SHARING); the pairs of a pass go through the
//   K groups' combine one after another (a barrier between two: `partials` stays sized for
//   one pair, 512 bytes), and a pass after the first starts with a barrier (group 0 has read
//   the last sums). Each (pair, row) is still written by one lane: the leader's.
//
// LOADS: each 32-lane step issues all of its loads first (2 words of each of the 4 rows of
//   both projections: 16 words per lane, 8 group uints, 16 activations), then shuffles and
//   computes: the loads of a step overlap their latencies.
//   Addresses: a row's offsets are size_t, so word wi of a row is its lane's first word plus
//   a constant (on NVIDIA one address per row and step instead of three instructions per
//   load; with mt_and_or's single lop3 per code, SASS per step 1054 -> 876 instructions,
//   bf16 4-bit affine).
//   Registers (CUDA, ptxas for bf16 4-bit affine GS 64): 77 (72 before the size_t offsets;
//   118 before the word mapping, the packed group uints and the shift-free dot): an H100 SM
//   holds 12 threadgroups of 2 warps (the unsplit plan cuda runs at the models' shapes), so
//   Qwen3-30B-A3B's 768 threadgroups run in one wave.
//   SHARE 0 before the size_t offsets (packed-scalar kernels: bf16 affine 4-bit 72, 8-bit 64, mxfp4
//   swiglu_oai 72, float32 affine 4-bit 93). SHARE 1: 118 (bf16 affine 4-bit; 8-bit 118,
//   mxfp4 swiglu_oai 123, float32 119): 4 pairs' accumulators (32 floats) and the pass's
//   activation loads the compiler keeps in flight; 16 warps per H100 SM instead of 28 for
//   the threadgroups that do work (MAX_SHARED = 2 would give about 93). No spills, no
//   stack frame (the loops over a pass's pairs are unrolled: share[s] and acc_*[s][r] stay
//   in registers).
//
// TRAFFIC PER CALL: the valid pairs' gate and up rows once each, x once per row block (from
//   cache after the first tile: DRAM sees it once per token), out [P, N] once.
//   SHARE 1: each distinct valid expert's gate and up rows (words, scales, biases) and bias
//   rows once per pass, ceil(pairs naming it / MAX_SHARED) passes (once at decode); x, out
//   as SHARE 0; ids: ceil(p / 32) 32-id chunks by pair p's threadgroup to find an earlier
//   pair, and the leader up to ceil((P - p) / 32) + MAX_SHARED more (cache hits).
//
// CHECKED ONLY ON A MAC: as expert_qmv.metal (same constructs), plus metal::exp / metal::min
//   / metal::clamp on float, simd_shuffle of a uint, and the register count / occupancy on
//   Apple GPUs.
#include "common.h"
#include "expert_qdot.h"
// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;
constexpr uint ROWS = 4;
constexpr uint PACK = 32 / BITS;
// Words per lane per step and projection: 2 (16 words in flight with both projections).
constexpr int WORDS = 2;
constexpr uint VALS = WORDS * PACK;
constexpr uint STEP_WORDS = 32 * WORDS;                  // words of a row per 32-lane step
constexpr uint GROUP_WORDS = GROUP_SIZE / PACK;          // words per group: 2..32, divides 32
constexpr uint STEP_GROUPS = STEP_WORDS / GROUP_WORDS;   // groups per step: 2..32
// Affine biases of a float T do not fit beside their scales in one shuffled uint.
constexpr bool BIAS_APART = MODE == 0 && sizeof(T) == 4;
constexpr uint MAX_K_GROUPS = 8;
// SHARE 1: pairs computed by one pass over an expert's weights (more: another pass).
constexpr uint MAX_SHARED = 4;
constexpr uint SHARERS = SHARE ? MAX_SHARED : 1;

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
const uint n_pairs = threadgroups_per_grid.z;

// The pair's id and x row: SHARE 1 takes the contiguous layout (ids [P]; pair q's x row q
// with x_slot 1, q / n_sel with x_slot 0: computed per pair of a pass below); SHARE 0
// walks the broadcast token grid.
uint x_at = 0;
uint id_at = pair;
if constexpr (!SHARE) {
  constexpr int BCAST_DIMS = 4;
  const uint token = pair / n_sel;
  const uint slot = pair - token * n_sel;
  x_at = slot * x_slot;
  id_at = slot;
  uint rest = token;
  for (int d = BCAST_DIMS - 1; d >= 0; --d) {
    const uint size = bcast[3 * d];
    if (size == 1u) {
      continue;  // a padding dimension (c = 0): skips two integer divisions
    }
    const uint c = rest % size;
    rest /= size;
    x_at += c * bcast[3 * d + 1];
    id_at += c * bcast[3 * d + 2];
  }
}

const uint expert = uint(indices[id_at]);
if (expert >= n_experts) {
  if (k_group == 0 && lane < rows) {
    out[size_t(pair) * n_rows_total + row0 + lane] =
        T(metal::numeric_limits<float>::quiet_NaN());
  }
  return;
}
if constexpr (SHARE) {
  // An earlier pair naming this expert leads its share group and computes this pair: return
  // (uniform over the threadgroup: every SIMD-group sees the same ids; before any barrier).
  for (uint q0 = 0; q0 < pair; q0 += 32) {
    const uint q = q0 + lane;
    if (simd_any(q < pair && uint(indices[q]) == expert)) {
      return;
    }
  }
}

const uint K = k_in;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint n_steps = (words_per_row + STEP_WORDS - 1) / STEP_WORDS;
const size_t first_row = size_t(expert) * n_rows_total + row0;
const auto wg_rows = w_gate + first_row * words_per_row;
const auto sg_rows = scales_gate + first_row * groups_per_row;
const auto bg_rows = biases_gate + first_row * groups_per_row;
const auto wu_rows = w_up + first_row * words_per_row;
const auto su_rows = scales_up + first_row * groups_per_row;
const auto bu_rows = biases_up + first_row * groups_per_row;

// Passes over the expert's rows, each computing the next SHARERS pairs naming it (SHARE 0:
// one pass, this pair). cursor: the first pair a SHARE pass may still take.
uint cursor = pair;
for (uint pass = 0;; ++pass) {
  uint share[SHARERS];  // the pass's pairs: share[0, n_share)
  uint n_share = 0;
  if constexpr (SHARE) {
    #pragma clang loop unroll(full)  // share[s], acc_*[s] in registers
    for (uint s = 0; s < SHARERS; ++s) {
      uint at = n_pairs;  // the first pair >= cursor naming the expert (n_pairs: none)
      for (uint q0 = cursor; q0 < n_pairs && at == n_pairs; q0 += 32) {
        const uint q = q0 + lane;
        at = simd_min(q < n_pairs && uint(indices[q]) == expert ? q : n_pairs);
      }
      share[s] = at;
      n_share = at < n_pairs ? s + 1 : n_share;
      cursor = at < n_pairs ? at + 1 : n_pairs;
    }
  } else {
    share[0] = pair;
    n_share = pass == 0u ? 1u : 0u;
  }
  if (n_share == 0u) {
    break;  // uniform over the threadgroup
  }
  if (k_groups > 1u && pass > 0u) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the last pass's partials are read
  }

  float acc_g[SHARERS][ROWS];
  float acc_u[SHARERS][ROWS];
  #pragma clang loop unroll(full)  // share[s], acc_*[s] in registers
  for (uint s = 0; s < SHARERS; ++s) {
    for (uint r = 0; r < ROWS; ++r) {
      acc_g[s][r] = acc_u[s][r] = 0.0f;
    }
  }
  // K group g takes the steps g, g + S, ... (trip count uniform over the SIMD-group).
  for (uint step = k_group; step < n_steps; step += k_groups) {
    const uint word0 = step * STEP_WORDS;
    const uint group0 = step * STEP_GROUPS;
    // Lane l's words of the step: word0 + 32 * wi + l (WORD MAPPING).
    bool in_row[WORDS];
    for (int wi = 0; wi < WORDS; ++wi) {
      in_row[wi] = word0 + 32 * wi + lane < words_per_row;
    }
    // 1. Every load of the step, none waiting for another (LOADS): the words of all rows of
    //    both projections, the step's scales (and biases) one group per lane, x.
    //    Offsets in size_t: a row's word wi is then its lane's first word plus a constant
    //    (one address per row and step, not one per load, on NVIDIA).
    uint words_g[ROWS][WORDS];
    uint words_u[ROWS][WORDS];
    for (uint r = 0; r < ROWS; ++r) {
      const size_t at = size_t(r) * words_per_row + word0 + lane;
      for (int wi = 0; wi < WORDS; ++wi) {
        const bool here = in_row[wi] && r < rows;
        words_g[r][wi] = here ? wg_rows[at + 32 * wi] : 0u;
        words_u[r][wi] = here ? wu_rows[at + 32 * wi] : 0u;
      }
    }
    const bool loads_group = lane < STEP_GROUPS && group0 + lane < groups_per_row;
    uint group_g[ROWS], group_u[ROWS];  // the lane's group of each row: mt_group_bits
    float bias_g[ROWS], bias_u[ROWS];   // BIAS_APART only
    for (uint r = 0; r < ROWS; ++r) {
      group_g[r] = group_u[r] = 0u;
      bias_g[r] = bias_u[r] = 0.0f;
      if (loads_group && r < rows) {
        const size_t at = size_t(r) * groups_per_row + group0 + lane;
        if constexpr (MODE == 0) {
          const T bg = bg_rows[at];
          const T bu = bu_rows[at];
          group_g[r] = mt_group_bits<MODE>(sg_rows[at], bg);
          group_u[r] = mt_group_bits<MODE>(su_rows[at], bu);
          if constexpr (BIAS_APART) {
            bias_g[r] = float(bg);
            bias_u[r] = float(bu);
          }
        } else {
          group_g[r] = mt_group_bits<MODE>(sg_rows[at], sg_rows[at]);
          group_u[r] = mt_group_bits<MODE>(su_rows[at], su_rows[at]);
        }
      }
    }
    // Each pair of the pass: its activations against the step's words (SHARE 1: the words,
    // scales and biases above loaded once for all of them).
    #pragma clang loop unroll(full)  // share[s], acc_*[s] in registers
    for (uint s = 0; s < SHARERS; ++s) {
      if (s >= n_share) {
        break;  // uniform over the threadgroup
      }
      const uint x_of = SHARE ? (x_slot != 0u ? share[s] : share[s] / n_sel) : x_at;
      const auto x_row = x + size_t(x_of) * K;
      float xv[VALS];
      for (int wi = 0; wi < WORDS; ++wi) {
        // the word's activations
        const auto x_word = x_row + (size_t(word0) + lane + 32 * wi) * PACK;
        for (uint i = 0; i < PACK; ++i) {
          xv[wi * PACK + i] = in_row[wi] ? float(x_word[i]) : 0.0f;
        }
      }
      // 2. Shuffles and arithmetic. x_sum[wi]: word wi's activations summed (the affine bias
      //    term), before they are pre-scaled for mt_expert_word_dot.
      float x_sum[WORDS];
      for (int wi = 0; wi < WORDS; ++wi) {
        x_sum[wi] = 0.0f;
        for (uint i = 0; i < PACK; ++i) {
          x_sum[wi] += xv[wi * PACK + i];
          xv[wi * PACK + i] *= mt_expert_prescale<MODE, BITS>(i);
        }
      }
      for (uint r = 0; r < ROWS; ++r) {
        if (r >= rows) {
          break;  // uniform over the SIMD-group
        }
        for (int wi = 0; wi < WORDS; ++wi) {
          // The lane holding word wi's group: (32 * wi + l) / GROUP_WORDS.
          const ushort src = ushort((32 * wi + lane) / GROUP_WORDS);
          const uint gg = mt_shuffle_converged(group_g[r], src);
          const uint gu = mt_shuffle_converged(group_u[r], src);
          const float sg = mt_group_scale<MODE, T>(gg);
          const float su = mt_group_scale<MODE, T>(gu);
          float bg = 0.0f;
          float bu = 0.0f;
          if constexpr (BIAS_APART) {
            bg = mt_shuffle_converged(bias_g[r], src);
            bu = mt_shuffle_converged(bias_u[r], src);
          } else if constexpr (MODE == 0) {
            bg = mt_group_bias<T>(gg);
            bu = mt_group_bias<T>(gu);
          }
          if (in_row[wi]) {
            const float dg = mt_expert_word_dot<MODE, BITS>(words_g[r][wi], xv + wi * PACK);
            const float du = mt_expert_word_dot<MODE, BITS>(words_u[r][wi], xv + wi * PACK);
            if constexpr (MODE == 0) {
              acc_g[s][r] += sg * dg + bg * x_sum[wi];
              acc_u[s][r] += su * du + bu * x_sum[wi];
            } else {
              acc_g[s][r] += sg * dg;
              acc_u[s][r] += su * du;
            }
          }
        }
      }
    }
  }

  if (k_groups > 1u) {  // uniform; every row block holds ROWS rows here (DISPATCH INVARIANTS)
    // The pass's pairs one after another through `partials` (sized for one: threadgroup
    // memory bounds Apple's occupancy).
    #pragma clang loop unroll(full)  // share[s], acc_*[s] in registers
    for (uint s = 0; s < SHARERS; ++s) {
      if (s >= n_share) {
        break;  // uniform over the threadgroup
      }
      if (s > 0u) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // pair s - 1's sums are read
      }
      for (uint r = 0; r < ROWS; ++r) {
        const float g_sum = mt_sum_converged(acc_g[s][r]);
        const float u_sum = mt_sum_converged(acc_u[s][r]);
        if (lane == 0) {
          const uint at = ((k_group * SIMDGROUPS + row_block) * ROWS + r) * 2;
          partials[at] = g_sum;
          partials[at + 1] = u_sum;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (k_group == 0) {  // uniform over the SIMD-group
        for (uint r = 0; r < ROWS; ++r) {
          float g_sum = 0.0f;
          float u_sum = 0.0f;
          for (uint g = 0; g < k_groups; ++g) {  // fixed order: K group 0, 1, ...
            const uint at = ((g * SIMDGROUPS + row_block) * ROWS + r) * 2;
            g_sum += partials[at];
            u_sum += partials[at + 1];
          }
          // Lane 0 holds the totals, the other lanes 0: the simd_sums below return them
          // exactly.
          acc_g[s][r] = lane == 0 ? g_sum : 0.0f;
          acc_u[s][r] = lane == 0 ? u_sum : 0.0f;
        }
      }
    }
    if (k_group != 0) {
      continue;  // uniform over the SIMD-group: the next pass (its barrier comes first)
    }
  }

  #pragma clang loop unroll(full)  // acc_*[s][r] in registers
  for (uint r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      break;  // uniform over the SIMD-group
    }
    float bias_g = 0.0f;  // the expert's bias of row r: read once for the pass's pairs
    float bias_u = 0.0f;
    if (lane == 0 && has_bias != 0u) {
      const size_t at = size_t(expert) * n_rows_total + row0 + r;
      bias_g = float(bias_gate[at]);
      bias_u = float(bias_up[at]);
    }
    #pragma clang loop unroll(full)  // share[s], acc_*[s] in registers
    for (uint s = 0; s < SHARERS; ++s) {
      if (s >= n_share) {
        break;  // uniform over the threadgroup
      }
      float g = mt_sum_converged(acc_g[s][r]);
      float u = mt_sum_converged(acc_u[s][r]);
      if (lane == 0) {
        if (has_bias != 0u) {
          g += bias_g;
          u += bias_u;
        }
        float y;
        if constexpr (ACT == 0) {
          y = g / (1.0f + metal::exp(-g)) * u;
        } else {
          const float gc = metal::min(g, limit);
          const float uc = metal::clamp(u, -limit, limit);
          y = (uc + 1.0f) * (gc / (1.0f + metal::exp(-alpha * gc)));
        }
        out[size_t(share[s]) * n_rows_total + row0 + r] = T(y);
      }
    }
  }
}  // passes
