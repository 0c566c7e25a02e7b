// expert_down_combine.metal: MoE decode down projection of the experts chosen by GPU-resident
// ids, scaled by the router scores and summed over the k experts, in one dispatch.
//
// MATH (token t, slots j < k, e_j = ids(t, j), d in [0, D)):
//   out[t, d] = sum_{j < k} score(t, j) * (sum_n h[t, j, n] * W[e_j, d, n] + bias[e_j, d])
//   (W dequantized per MODE exactly as in expert_qmv.metal; the bias term only if has_bias),
//   evaluated per uint32 word of PACK codes as expert_glu.metal evaluates g:
//   scale_g * sum_i q_i * h_i + bias_g * sum_i h_i (fp modes: scale_g * sum_i v_i * h_i), in
//   float32 through mt_expert_word_dot (expert_qdot.h: shift- and conversion-free affine
//   codes, each product bitwise that of q_i * h_i).
//   REDUCTION ORDER (fixed for given ids, k and launch plan: bitwise reproducible run to
//   run). Per token (SHARE = 0): the token's slots j are dealt to the S slot groups of a row
//   block, slot group g taking j = g, g + S, g + 2S, ... (S = 1: every slot). For each of its
//   slots in increasing j, lane l sums its words (WORD MAPPING) step after step, word 0, 1,
//   ... of each step, into a partial (lane 0 then adds bias[e_j, d]) and adds
//   score_j * partial to its accumulator; the 32 lane accumulators are combined by one
//   simd_sum. S = 1: that is the output. S > 1: the S slot-group sums are added in order
//   g = 0, 1, ..., S - 1 (through threadgroup memory) by slot group 0.
//   Token block (SHARE = 1, BLOCK PLAN): the block's distinct experts u = 0, 1, ... (pair
//   order of first appearance) are dealt to the slot groups, g taking u = g, g + S, ...; for
//   each of its experts in increasing u, the expert's pairs in increasing pair order, in
//   passes of up to MAX_SHARED: lane l sums each pass pair's words as above into that pair's
//   partial (lane 0 adds bias[e, d]); one simd_sum per (pair, row) gives the pair's
//   projection, and score * projection is added to the (token, row) accumulator, which
//   lane t * 4 + r holds. The S slot-group accumulators are added in order g = 0, 1, ...
//   (S = 1: none). So a token's k terms are summed in an order fixed by the block's ids,
//   not in slot order as per token: the two forms may differ in the last bits (each within
//   the tolerance table against the float64 oracle). float32 throughout, rounded once to
//   T. No atomics.
//   OUT-OF-RANGE IDS: if any of the token's k ids is >= E (uint; negative int32 ids too) the
//   token's whole output row is NaN and nothing of its experts is read for it (SHARE: the
//   block's other tokens are unaffected; an expert one of them names is read for that one).
//
// LAYOUT (row-contiguous):
//   h       [T * k, N] T        the token's k expert inputs, token-major (expert_glu's output)
//   w       [E, D, N / PACK]    uint32;  scales / biases [E, D, N / GS] (fp modes: uint8
//                               scales, biases not read: the wrapper passes scales again)
//   indices [T * k] uint32/int32;  scores [T * k] float32, float16 or bfloat16
//   bias    [E, D] T (read only if has_bias; else the wrapper passes h, never read)
//   out     [T, D] T
//   n_experts (E), n_out (D), k_in (N), n_sel (k), has_bias, n_tokens (T, the call's
//   tokens), block_tokens (TB, SHARE only): 0-d uint runtime inputs.
//   Template: T, BITS, GROUP_SIZE, MODE as expert_qmv.metal; SHARE: 0 per token, 1 the
//   token-block form (one threadgroup column per TB tokens, each distinct expert of the
//   block read once per MAX_SHARED of its pairs).
//
// BLOCK PLAN (SHARE = 1): the block's n = TB' * k pairs (TB' = its tokens, the last block
//   ragged) are one SIMD-group's lanes, lane q holding pair q's id; each SIMD-group forms
//   the plan alone (no threadgroup memory, no barrier): a ballot of the out-of-range ids
//   gives the invalid tokens; n shuffles give lane q the mask of the valid-token pairs
//   naming its expert (its sharers); a ballot of the lanes with no earlier sharer gives each
//   distinct expert's first pair, in pair order. A slot group walks its experts' rows once
//   per pass of up to MAX_SHARED sharers: a step's words, scales and biases loaded once,
//   then, word by word, each pass pair's activations of the word and the word's dot with
//   each (the word decoded once for all of them). MAX_SHARED = 2: 4 would hold 4 pairs'
//   partials of 4 rows and pushes float32 and mxfp4 instantiations past 128 registers (130
//   to 133); with random routing at 4 tokens a distinct expert has 3 or more pairs rarely
//   (gpt-oss-20b: 4%; 8 tokens 13%), and its second pass finds the rows just read in cache.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes and the backend):
//   threadgroup (64 * S, 1, 1): SIMD-group i is row block i % 2 of slot group i / 2, S in
//   [1, MAX_SLOT_GROUPS] (the kernel reads S from simdgroups_per_threadgroup);
//   grid (64 * S, ceil(D / 8), T) per token, (64 * S, ceil(D / 8), ceil(T / TB)) for SHARE,
//   2 <= TB <= 8 and TB * k <= 32: row block b of row-tile y owns rows [(2y + b) * 4, + 4)
//   of token z (SHARE: of tokens [z * TB, + TB) clipped to T) clipped to D (a block past D
//   owns none, reads nothing, and still meets the barrier); each output element is written
//   by one lane, and each word/scale/bias of each selected expert's rows is read by exactly
//   one lane per pass, by the one SIMD-group holding that slot (SHARE: that distinct expert)
//   and row block: word w0 + 32 * wi + l of a step by lane l, group g0 + j by lane j (a step
//   of 32 * WORDS words holds whole groups, at most 32: WORDS <= GS / PACK), h's row once
//   per (pair, row block).
//   Threadgroup memory: MAX_SLOT_GROUPS * 8 floats (SHARE: * 64), written and read (after
//   one barrier) only when S > 1. The only early return (per token, an invalid id) is
//   uniform over the threadgroup.
//   K % GS == 0 (a group never straddles the row end; a partial last step masks the words
//   and groups past it). Every branch around a SIMD-group function is uniform over the
//   SIMD-group, and threadgroups hold whole SIMD-groups: the per-token path's group
//   shuffles and row sums keep common.h's converged promise (mt_shuffle_converged,
//   mt_sum_converged; the emulator checks it).
//
// LAUNCH PLANS: Metal: S = 1, threadgroup (64, 1, 1) as before: each SIMD-group walks the k
//   slots of its 4 rows, no barrier (the plan measured against MLX's Metal kernels; whether
//   S > 1 pays on Apple GPUs is for a Mac to measure, so it is left unchanged). cuda: the k
//   slots spread evenly over S = ceil(k / ceil(k / 4)) slot groups (k = 8: 4 groups of two
//   slots; CUDA_SLOT_GROUPS in ops/expert_down_combine.py says why 4 and not 8):
//   Qwen3-30B-A3B decode (D = 2048, one token) runs 256 threadgroups of 8 warps, two per
//   SM, one wave, instead of 512 warps that each walk 8 experts one after another.
//   SHARE (ops/expert_down_combine.py SHARE_TOKENS, SHARE_MIN_TOKENS, _share_plan; one token
//   stays per token): from 2 tokens, TB = min(SHARE_TOKENS, 32 // k, T) tokens per
//   threadgroup. cuda: TB up to 8 (a call of up to 8 decode or verify tokens is one block
//   where k <= 4: gpt-oss-20b at 4 tokens reads ~12.5 distinct experts instead of 16 pairs'
//   rows, at 8 ~20.5 instead of 32; k = 8: blocks of 4, Qwen3-30B-A3B ~28.4 of 32), S =
//   min(8, TB * k): 512-thread threadgroups, the most a threadgroup holds at up to 128
//   registers, so the warps resident per SM stay those of the per-token plan (one
//   threadgroup of 16 warps per H100 SM, against two of 8 per token): the grid
//   has TB times fewer threadgroups, each slot group walking ~distinct / S experts (gpt-oss
//   4 tokens: 360 threadgroups of 16 warps, 1 or 2 experts each, against 1440 of 8 warps
//   with one pair each). Metal: TB = 4, S = TB, the per-token plan's SIMD-groups per token
//   (one) kept, each walking about as many experts as one per-token SIMD-group walks k
//   pairs, with fewer bytes: Apple GPUs run MoE decode far below their bandwidth (an M3
//   Ultra analysis puts a 35B-A3B MoE at 34% of its roofline), so bytes are saved without
//   giving up SIMD-groups; TB = 4 rather than 8 keeps threadgroups at 256 threads (S = TB)
//   and the blocks of k = 8 models whole. Off by default on every backend (SHARE_MIN_TOKENS
//   names none): on an H100 (CUPTI, the patched block's decode path) the form was slower,
//   gpt-oss-20b at 4 tokens 62 -> 130 us, 8 tokens 118 -> 180, Qwen3-30B-A3B at 4 tokens
//   48 -> 53: the kernel is latency-bound and the grid has TB times fewer threadgroups.
//   Unmeasured on a Mac: SHARE_MIN_TOKENS = {"metal": 2} turns it on there.
//
// WORD MAPPING and LOADS: as expert_glu.metal's (the reasons for both GPUs are stated
//   there), one projection: in a step of 32 * WORDS words of a row, lane l holds words
//   w0 + 32 * wi + l of each of the 4 rows (each word-load instruction reads 128 contiguous
//   bytes) and their PACK activations of h each; the step's groups are loaded one per lane
//   (scale and affine bias as one uint, mt_group_bits) and shuffled to the lanes of their
//   words. All of a step's loads (SHARE: its words, scales and biases; the activations
//   word by word, CHUNK_WORDS) are issued before any is used: WORDS = 4 words of each
//   row (16 per lane; nvfp4 2 of each row), 4 group uints, WORDS * PACK activations. WORDS stays 4 (not
//   expert_glu's 2 per projection): Qwen3-30B-A3B's down rows (N = 768: 96 words) are one
//   step, all of a slot's loads in flight at once, where 2 would take two dependent trips;
//   the cuda plan's threadgroups (256 threads per token, 512 for SHARE) hold as many per
//   SM either way.
//   Registers (CUDA, ptxas for bf16 4-bit affine GS 64, the three kernels MLX builds): per
//   token 126 with size_t row offsets (as expert_glu.metal's; 120-123 before them,
//   114-119 before SHARE; its loads as they were: CHUNK_WORDS), SHARE
//   95-104 (before the size_t offsets); over every instantiation, after them, at most 128,
//   none spilling (a 512-thread threadgroup needs 128 or fewer).
//
// TRAFFIC PER CALL: per token: each valid token's k experts' down rows once; SHARE: each
//   block's distinct experts of valid tokens' down rows once per pass (one, unless more
//   than MAX_SHARED of the block's pairs name it): with every call's tokens one block, each
//   distinct expert once per call. h once per (pair, row block) (from cache after the first
//   tile), ids and scores once per thread (broadcast loads), out [T, D] once; no [T, k, D]
//   intermediate exists.
//
// CHECKED ONLY ON A MAC: as expert_qmv.metal (same constructs), plus a kernel-scope
//   threadgroup array and threadgroup_barrier, and (SHARE) simd_ballot read through
//   simd_vote::vote_t, popcount and ctz; S > 1 and SHARE run on the emulator in the tests.
#include "common.h"
#include "expert_qdot.h"
// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;         // row blocks per threadgroup
constexpr uint ROWS = 4;               // output rows per SIMD-group
constexpr uint MAX_SLOT_GROUPS = 8;    // SIMD-groups sharing one row block's slots, at most
constexpr uint MAX_SHARED = 2;         // SHARE: pairs of one expert walked together, at most
// Pairs walked per pass over an expert's rows: SHARE, up to MAX_SHARED; else one slot.
constexpr uint PASS_PAIRS = SHARE != 0 ? MAX_SHARED : 1u;
constexpr uint PACK = 32 / BITS;
// Words per lane per step: 4, or one group's words where a group holds fewer (nvfp4: 2), so
// that a step holds at most 32 groups (one per lane).
constexpr int WORDS = GROUP_SIZE / PACK < 4 ? GROUP_SIZE / PACK : 4;
// Words of a step whose activations are loaded together: per token the whole step (all
// of a step's loads in flight at once, LOADS); SHARE one word, for each of the pass's pairs,
// the word decoded once and used for each (over whole steps ptxas decodes all of a step's
// words once for all the pairs and holds the values: 160 registers in mxfp4).
constexpr int CHUNK_WORDS = SHARE != 0 ? 1 : WORDS;
constexpr uint STEP_WORDS = 32 * WORDS;                  // words of a row per 32-lane step
constexpr uint GROUP_WORDS = GROUP_SIZE / PACK;          // words per group: 2..32, divides 32
constexpr uint STEP_GROUPS = STEP_WORDS / GROUP_WORDS;   // groups per step: 2..32
// Affine biases of a float T do not fit beside their scales in one shuffled uint.
constexpr bool BIAS_APART = MODE == 0 && sizeof(T) == 4;
// Per (slot group, row block): a slot group's sums, combined in slot-group order: per token,
// one per row; SHARE, one per lane (lane t * ROWS + r holds the block's token t, row r).
constexpr uint HELD = SHARE != 0 ? 32u : ROWS;

threadgroup float partials[MAX_SLOT_GROUPS * SIMDGROUPS * HELD];

const uint lane = thread_index_in_simdgroup;
const uint slot_groups = simdgroups_per_threadgroup / SIMDGROUPS;  // the launch plan's S
const uint row_block = simdgroup_index_in_threadgroup % SIMDGROUPS;
const uint slot_group = simdgroup_index_in_threadgroup / SIMDGROUPS;
const uint row0 = (threadgroup_position_in_grid.y * SIMDGROUPS + row_block) * ROWS;
const uint n_rows_total = n_out;
// A row block past D (ragged D) has no rows: it reads nothing but still meets the barrier.
const uint rows = row0 < n_rows_total ? metal::min(ROWS, n_rows_total - row0) : 0u;
const uint k = n_sel;
// The threadgroup's tokens [token0, token0 + n_tokens_here) and their pairs from pair0.
const uint token0 = threadgroup_position_in_grid.z * (SHARE != 0 ? block_tokens : 1u);
const uint n_tokens_here = SHARE != 0 ? metal::min(block_tokens, n_tokens - token0) : 1u;
const uint pair0 = token0 * k;
device T* out_rows = out + size_t(token0) * n_rows_total + row0;

// The work of the threadgroup, as items walked in a fixed order, each an expert and the
// pairs using it. Per token (SHARE = 0): item j is slot j's expert and pair. SHARE: item u
// is the block's u-th distinct expert of a valid token (pair order of first appearance) with
// every pair of a valid token naming it (BLOCK PLAN); each SIMD-group forms the plan alone,
// lane q holding pair q (a block has at most 32 pairs).
uint items = k;
uint lane_expert = 0u;   // SHARE: pair `lane`'s expert
uint lane_sharers = 0u;  // SHARE: the pairs of valid tokens naming it (bit q: pair q)
uint firsts = 0u;        // SHARE: each item's first pair (bit q: pair q)
uint bad = 0u;           // SHARE: the pairs with an id outside [0, E)
const uint token_pairs = k < 32u ? (1u << k) - 1u : ~0u;
if constexpr (SHARE != 0) {
  const uint n_pairs = n_tokens_here * k;  // <= 32 (DISPATCH INVARIANTS)
  const bool here = lane < n_pairs;
  lane_expert = here ? uint(indices[pair0 + lane]) : 0u;
  bad = uint(static_cast<simd_vote::vote_t>(simd_ballot(here && lane_expert >= n_experts)));
  const bool live = here && ((bad >> (lane / k * k)) & token_pairs) == 0u;
  const uint live_pairs = uint(static_cast<simd_vote::vote_t>(simd_ballot(live)));
  for (uint q = 0; q < n_pairs; ++q) {  // uniform trip count
    if (simd_shuffle(lane_expert, ushort(q)) == lane_expert) {
      lane_sharers |= 1u << q;
    }
  }
  lane_sharers &= live_pairs;
  const bool first = live && (lane_sharers & ((1u << lane) - 1u)) == 0u;
  firsts = uint(static_cast<simd_vote::vote_t>(simd_ballot(first)));
  items = metal::popcount(firsts);
} else {
  bool all_valid = true;
  for (uint j = 0; j < k; ++j) {
    all_valid = all_valid && uint(indices[token0 * k + j]) < n_experts;
  }
  if (!all_valid) {
    // An out-of-range id (uniform over the threadgroup): NaN row, nothing of the experts read.
    if (slot_group == 0 && lane < rows) {
      out_rows[lane] = T(metal::numeric_limits<float>::quiet_NaN());
    }
    return;
  }
}

const uint K = k_in;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint n_steps = rows == 0u ? 0u : (words_per_row + STEP_WORDS - 1) / STEP_WORDS;

float acc[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};  // per token: the lane's sums of its rows
float held = 0.0f;                            // SHARE: lane t * ROWS + r's (token t, row r)
uint rest = firsts;
for (uint item = 0; item < items; ++item) {  // fixed order over the items
  uint first = item;  // the item's first pair
  if constexpr (SHARE != 0) {
    first = metal::ctz(rest);
    rest &= rest - 1u;
  }
  if (item % slot_groups != slot_group) {
    continue;  // another SIMD-group's item (uniform over the SIMD-group)
  }
  const uint expert = SHARE != 0 ? simd_shuffle(lane_expert, ushort(first))
                                 : uint(indices[pair0 + first]);
  uint sharers = SHARE != 0 ? simd_shuffle(lane_sharers, ushort(first)) : 0u;
  const size_t first_row = size_t(expert) * n_rows_total + row0;
  const auto w_rows = w + first_row * words_per_row;
  const auto s_rows = scales + first_row * groups_per_row;
  const auto b_rows = biases + first_row * groups_per_row;
  do {  // passes over the expert's rows: PASS_PAIRS of its pairs each
    uint pairs[PASS_PAIRS];
    uint n_pass = 1u;
    pairs[0] = first;
    if constexpr (SHARE != 0) {
      n_pass = 0u;
      for (uint i = 0; i < PASS_PAIRS; ++i) {
        pairs[i] = sharers == 0u ? 0u : metal::ctz(sharers);
        n_pass += sharers == 0u ? 0u : 1u;
        sharers &= sharers - 1u;
      }
    }
    float part[PASS_PAIRS][ROWS];
    for (uint i = 0; i < PASS_PAIRS; ++i) {
      for (uint r = 0; r < ROWS; ++r) {
        part[i][r] = 0.0f;
      }
    }
    for (uint step = 0; step < n_steps; ++step) {  // trip count uniform
      const uint word0 = step * STEP_WORDS;
      const uint group0 = step * STEP_GROUPS;
      // Lane l's words of the step: word0 + 32 * wi + l (WORD MAPPING).
      bool in_row[WORDS];
      for (int wi = 0; wi < WORDS; ++wi) {
        in_row[wi] = word0 + 32 * wi + lane < words_per_row;
      }
      // 1. The expert's loads of the step, none waiting for another (LOADS): the words of
      //    all rows, the step's scales (and biases) one group per lane.
      uint words[ROWS][WORDS];
      const auto w_step = w_rows + word0 + lane;
      for (uint r = 0; r < ROWS; ++r) {
        for (int wi = 0; wi < WORDS; ++wi) {
          words[r][wi] =
              in_row[wi] && r < rows ? w_step[size_t(r) * words_per_row + 32 * wi] : 0u;
        }
      }
      const bool loads_group = lane < STEP_GROUPS && group0 + lane < groups_per_row;
      const auto s_step = s_rows + group0 + lane;
      const auto b_step = b_rows + group0 + lane;
      uint group[ROWS];        // the lane's group of each row: mt_group_bits
      float bias_apart[ROWS];  // BIAS_APART only
      for (uint r = 0; r < ROWS; ++r) {
        group[r] = 0u;
        bias_apart[r] = 0.0f;
        if (loads_group && r < rows) {
          const size_t at = size_t(r) * groups_per_row;
          if constexpr (MODE == 0) {
            const T b = b_step[at];
            group[r] = mt_group_bits<MODE>(s_step[at], b);
            if constexpr (BIAS_APART) {
              bias_apart[r] = float(b);
            }
          } else {
            group[r] = mt_group_bits<MODE>(s_step[at], s_step[at]);
          }
        }
      }
      // 2. Per chunk of CHUNK_WORDS words (per token: the whole step; SHARE: one word):
      //    each pair's activations of the chunk, then per row and word the group's scale
      //    (and bias) shuffled in and the word's dot with each pair's activations.
      for (int c0 = 0; c0 < WORDS; c0 += CHUNK_WORDS) {
        float xv[PASS_PAIRS][CHUNK_WORDS * PACK];
        float x_sum[PASS_PAIRS][CHUNK_WORDS];  // per word: the affine bias term
        for (uint i = 0; i < PASS_PAIRS; ++i) {
          const auto h_chunk = h + size_t(pair0 + pairs[i]) * K
                               + (word0 + 32 * c0 + lane) * PACK;
          for (int c = 0; c < CHUNK_WORDS; ++c) {
            x_sum[i][c] = 0.0f;
            for (uint v = 0; v < PACK; ++v) {
              const bool loads = in_row[c0 + c] && i < n_pass;
              float x = loads ? float(h_chunk[32 * PACK * c + v]) : 0.0f;
              x_sum[i][c] += x;
              xv[i][c * PACK + v] = x * mt_expert_prescale<MODE, BITS>(v);
            }
          }
        }
        for (uint r = 0; r < ROWS; ++r) {
          if (r >= rows) {
            break;  // uniform over the SIMD-group
          }
          for (int c = 0; c < CHUNK_WORDS; ++c) {
            const int wi = c0 + c;
            // The lane holding word wi's group: (32 * wi + l) / GROUP_WORDS.
            const ushort src = ushort((32 * wi + lane) / GROUP_WORDS);
            const uint g = mt_shuffle_converged(group[r], src);
            const float s = mt_group_scale<MODE, T>(g);
            float b = 0.0f;
            if constexpr (BIAS_APART) {
              b = mt_shuffle_converged(bias_apart[r], src);
            } else if constexpr (MODE == 0) {
              b = mt_group_bias<T>(g);
            }
            if (!in_row[wi]) {
              continue;
            }
            for (uint i = 0; i < PASS_PAIRS; ++i) {
              if (i >= n_pass) {
                break;  // uniform over the SIMD-group
              }
              const float dot = mt_expert_word_dot<MODE, BITS>(words[r][wi],
                                                               xv[i] + c * PACK);
              if constexpr (MODE == 0) {
                part[i][r] += s * dot + b * x_sum[i][c];
              } else {
                part[i][r] += s * dot;
              }
            }
          }
        }
      }
    }
    // 3. The pass's pairs: lane 0 adds the expert's bias (read once per pass), then
    //    score * partial goes to the pair's token: per token into the lane's acc; SHARE,
    //    summed over the lanes, into the lane holding (token, row).
    float row_bias[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (uint r = 0; r < ROWS; ++r) {
      if (has_bias != 0u && lane == 0 && r < rows) {
        row_bias[r] = float(bias[first_row + r]);
      }
    }
    for (uint i = 0; i < PASS_PAIRS; ++i) {
      if (i >= n_pass) {
        break;  // uniform over the SIMD-group
      }
      const float score = float(scores[pair0 + pairs[i]]);
      for (uint r = 0; r < ROWS; ++r) {
        const float partial = part[i][r] + row_bias[r];
        if constexpr (SHARE != 0) {
          const float total = simd_sum(partial);
          if (lane == pairs[i] / k * ROWS + r) {
            held += score * total;
          }
        } else {
          acc[r] += score * partial;
        }
      }
    }
  } while (sharers != 0u);
}

if constexpr (SHARE != 0) {
  // Lane t * ROWS + r writes (token t, row r): NaN for a token with an invalid id.
  const uint t = lane / ROWS;
  const uint r = lane % ROWS;
  const bool writes = t < n_tokens_here && r < rows;
  const bool valid = ((bad >> (metal::min(t, 31u / k) * k)) & token_pairs) == 0u;
  float total = held;
  if (slot_groups > 1u) {  // uniform over the threadgroup
    partials[(slot_group * SIMDGROUPS + row_block) * HELD + lane] = held;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    total = 0.0f;
    for (uint g = 0; g < slot_groups; ++g) {  // fixed order: slot group 0, 1, ...
      total += partials[(g * SIMDGROUPS + row_block) * HELD + lane];
    }
  }
  if (slot_group == 0 && writes) {
    out_rows[size_t(t) * n_rows_total + r] =
        valid ? T(total) : T(metal::numeric_limits<float>::quiet_NaN());
  }
} else if (slot_groups == 1u) {  // uniform over the threadgroup
  for (uint r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      break;  // uniform over the SIMD-group
    }
    const float total = mt_sum_converged(acc[r]);
    if (lane == 0) {
      out_rows[r] = T(total);
    }
  }
} else {
  for (uint r = 0; r < ROWS; ++r) {
    const float total = mt_sum_converged(acc[r]);  // 0 for rows past D
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
