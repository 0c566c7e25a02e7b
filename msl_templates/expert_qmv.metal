// expert_qmv.metal: MoE decode GEMV, quantized experts (affine 4/8-bit, mxfp4, nvfp4,
// mxfp8) chosen by GPU-resident ids.
//
// MATH (pair p = (token t, slot j), e = ids(t, j), n in [0, N)):
//   MODE 0 (affine):
//   out[p, n] = sum_{k < K} x_p[k] * (scale[e, n, g] * q[e, n, k] + bias[e, n, g]),  g = k / GS
//   q[e, n, k] = (w[e, n, k / PACK] >> (BITS * (k % PACK))) & (2^BITS - 1),  PACK = 32 / BITS
//   MODE 1 (mxfp4) / 2 (nvfp4), BITS = 4, no bias:
//   out[p, n] = sum_{k < K} x_p[k] * mt_fp4_scale<MODE>(scale[e, n, g]) * e2m1(q[e, n, k])
//   (scales uint8: E8M0, group 32 / E4M3, group 16; decoded by common.h's helpers)
//   MODE 3 (mxfp8), BITS = 8, no bias: the same with E8M0 scales (group 32) and E4M3
//   elements, decoded by common.h's E4M3 helper (0x7F / 0xFF read as +-480 like MLX's Metal
//   decoder; MLX's CPU reads NaN; mx.quantize writes neither)
//   Evaluated per uint32 word of PACK codes (a group holds GS / PACK words) as
//     scale * sum_i q_i * x_i + bias * sum_i x_i   (affine; fp modes: scale * sum_i v_i * x_i)
//   in float32 (mt_qmv_word_dot: affine codes masked in place and read through the mantissa
//   of 2^23 against activations pre-scaled by powers of two, each product bitwise that of
//   q_i * x_i; expert_qdot.h states why), then reduced over the SIMD-group and rounded once
//   to T. x_p is x's row
//   xrow(t, j) and ids(t, j) is indices[irow(t) + j] (BROADCAST below).
//   REDUCTION ORDER (fixed for given shapes and launch plan: bitwise reproducible run to run):
//   the 32-lane steps of K are dealt to the S K groups of a row block, group g taking steps
//   g, g + S, ... (S = 1: every step); lane l of group g accumulates its words (WORD
//   MAPPING), step after step in increasing order, word 0, 1, ... of each step; the 32 lane
//   partials are combined by simd_sum (hardware order). S = 1: that is
//   the output. S > 1: the S group sums are added in order g = 0, 1, ..., S - 1 (through
//   threadgroup memory) by group 0.
//   ROUND = true (moe_gather_qmm's rows on this GEMV, ops/moe_gather_qmm.py): each weight is
//   moe_gather_qmm's, rounded once to T from its float32 value, W = T(fma(scale, q, bias))
//   (fp modes: T(scale * v), exact in float32), and the word's term is
//   sum_i float(W_i) * x_i in code order (mt_qmv_word_dot_rounded; activations not
//   pre-scaled, no bias term apart); the reduction order is the same. About twice the
//   arithmetic per code: a conversion to T and back per weight, two weights per conversion
//   instruction on CUDA (common.h's mt_round2; ptxas sm_90, bf16 4-bit rows: F2FP.BF16
//   pairs instead of one F2F per weight).
//   OUT-OF-RANGE IDS: the id is read as uint (a negative int32 id becomes >= 2^31), and an id
//   >= E makes the whole output row out[p, :] NaN; no byte of w/scales/biases is read for p.
//
// LAYOUT (row-contiguous, ensure_row_contiguous):
//   x       [X_ROWS, K] T      the rows of x as given: one activation per token shared by
//                              its k experts (x_slot = 0), or one row per (token, slot)
//                              (x_slot = 1); tokens may share rows (broadcast)
//   w       [E, N, K / PACK]   uint32, element i of a word at bits [i*BITS, (i+1)*BITS)
//   scales  [E, N, K / GS] S,  biases [E, N, K / GS] S   (scales may be negative); the
//           template's S is T, or float16 / bfloat16 with T = float (a float32 x and out
//           against 16-bit experts: the fused MoE ops' backward recomputes its products so)
//           fp modes: S = uint8 scales; biases is not read (the wrapper passes scales again)
//   indices [I_ROWS * k] uint32 or int32, k ids per row; tokens may share rows (broadcast)
//   bcast   [3 * BCAST_DIMS] uint: (size, x row stride, indices stride) per dimension of the
//           token grid, outermost first, unused outer ones (1, 0, 0)
//   out     [P, N] T, P = tokens * k pairs, token-major (the broadcast token grid)
//   n_experts (E), n_out (N), k_in (K), n_sel (k), x_slot: 0-d uint runtime inputs, so
//   changing any of them (or the broadcast pattern) never builds a new kernel.
//   Template: T, S (above), BITS in {4, 8}, GS in {32, 64, 128}, MODE 0 (affine);
//             MODE 1 (mxfp4): BITS 4, GS 32; MODE 2 (nvfp4): BITS 4, GS 16;
//             MODE 3 (mxfp8): BITS 8, GS 32; ROUND (MATH).
//
// BROADCAST: the leading dimensions of x and indices broadcast against each other (NumPy
//   rules; the wrapper merges them into at most BCAST_DIMS dimensions, or materialises
//   both arrays when broadcasts alternate over more). Pair p = t * k + j; t's coordinate
//   c_d in dimension d (row-major over the sizes) gives xrow(t, j) = sum_d c_d * xs_d +
//   j * x_slot and irow(t) = sum_d c_d * is_d, a stride being 0 where that array is
//   broadcast. Computed by every thread from uniform values (a few divisions; the padding
//   dimensions of size 1 are skipped).
//
// ADDRESS SPACES: MLX passes an input of fewer than 8 elements in the `constant` address
//   space, which changes the generated source. indices holding fewer than 8 ids (decode
//   with k < 8, one token) therefore compile a second instantiation next to the `device`
//   one, once per process and (T, BITS, GS, index type); so do toy-sized w / scales /
//   biases. The body reads them through `auto` pointers, so both forms compile; bcast
//   always has 12 elements (device). Padding the ids to 8 would cost a copy per call instead
//   of one extra compile.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes and the backend):
//   threadgroup = (32 * SIMDGROUPS * S, 1, 1): SIMD-group i is row block i % SIMDGROUPS of
//   K group i / SIMDGROUPS, S in [1, MAX_K_GROUPS] (read from simdgroups_per_threadgroup)
//   grid        = (64 * S, ceil(N / (SIMDGROUPS * ROWS)), P)
//   threadgroup_position_in_grid.z is the pair; row block s of row-tile y owns output rows
//   [(y * SIMDGROUPS + s) * ROWS, + ROWS) clipped to N: each (pair, row) is written by exactly
//   one lane, and each word/scale/bias of the selected expert's rows is read by exactly one
//   lane, of the one K group holding that step: word w0 + 32 * wi + l of a step by lane l,
//   group g0 + j of a step by lane j (a step of 32 * WORDS words holds whole groups, at most
//   32: WORDS <= GS / PACK), passed to the lanes of its words by mt_qmv_shuffle.
//   S > 1 only where N % (SIMDGROUPS * ROWS) == 0: no row block lies past N, so no thread
//   returns before the combine's barrier (the only other early return, an invalid id, is
//   uniform over the threadgroup). Threadgroup memory: MAX_K_GROUPS * 8 floats, used only
//   when S > 1.
//   K % GS == 0 (a group never straddles the row end; a partial last step masks the words
//   and groups past it; nvfp4's K need only be a multiple of 16).
//   Every early return is uniform over a SIMD-group and threadgroups hold whole SIMD-groups,
//   so the group shuffles and row sums always see a full SIMD-group: common.h's converged
//   promise (mt_shuffle_converged, mt_sum_converged; the emulator checks it), kept by every
//   instantiation; PLAIN_SHUFFLES below says which take the plain calls instead.
//
// LAUNCH PLANS: Metal: S = 1, threadgroup (64, 1, 1), no barrier: the plan measured against
//   MLX's Metal qmv (2 SIMD-groups x 4 rows, as MLX's own); whether S > 1 pays on Apple
//   GPUs is for a Mac to measure, so it is unchanged. cuda: S = min(steps of K, 8,
//   ceil(4096 / warps)) where the grid's warps are few, lowered to deal the steps evenly
//   (ops/expert_qmv.py's _k_groups): Qwen3-30B-A3B's gate/up at one
//   token (N = 768, K = 2048, 8 pairs) runs 768 threadgroups of 4 warps (3072 warps, each
//   one step of K) instead of 1536 warps of two steps.
//
// LOADS (memory-level parallelism): a decode GEMV moves few bytes, so its time is DRAM latency
//   times the number of dependent round trips; what matters is how many loads each lane has
//   in flight. Each 32-lane step first issues every load it needs, none waiting for another:
//   WORDS words of each of the ROWS rows (16 words at 4 and 8 bits, 8 for nvfp4), one
//   group's scale (and bias) of each row, the VALS activations; then the shuffles and the
//   arithmetic. (Before: per row, scale load -> shuffle -> word load -> math, one row after the
//   other: a chain of dependent latencies per step.) MLX's own Apple qmv kernels likewise load
//   all of a step's weights before computing; Apple GPUs are latency-bound at decode as well
//   (few SIMD-groups per core), so the same order serves both. Loads stay scalar (uint32
//   words, T activations): MLX passes row-contiguous views that may start at any element
//   (e.g. a reshaped slice), so no wider alignment is known from the shapes; the WORD
//   MAPPING makes the lanes' words of one load instruction contiguous instead.
//   Registers: 16 words + VALS (<= 32) activations + 4 group uints per lane; ptxas (CUDA,
//   bf16 4-bit affine GS 64): 92 (101 before the word mapping, the packed group uints and
//   the shift-free dot); float32 x and out with bf16 scales (S): 93-100, no spill.
//
// WORD MAPPING: in a step starting at word w0 of a row, lane l holds words w0 + 32 * wi + l
//   (wi < WORDS) of each row and their PACK activations each; the step's groups (32 * WORDS
//   / (GS / PACK) <= 32) are loaded one per lane, scale and affine bias as one uint
//   (expert_qdot.h's mt_group_bits: two 16-bit values; a float S's bias apart), shuffled
//   to the lanes of their words and decoded there. Why for both GPUs: each word-load
//   instruction of a SIMD-group reads 128 contiguous bytes (one 128-byte line, every
//   sector used, where the former 4 contiguous words per lane spread one instruction over
//   512 bytes, a quarter of each sector used by it; Apple's SIMD-group loads likewise
//   coalesce into fewer, fully used lines); the scales and biases of a row's step are one
//   contiguous load; a lane's activations are PACK contiguous values per word (lane stride
//   PACK * sizeof(T) bytes instead of 4 PACK: an activation load spans a quarter of the
//   lines it did). expert_glu.metal states why the activations are not staged in
//   threadgroup memory.
//
// TRAFFIC PER CALL: w, scales and (affine) biases of each valid pair's expert once (the selected
//   experts' bytes; unselected experts and out-of-range ids read nothing), out once. x is
//   loaded once per row block (K values per 4 rows, each K group its own steps), i.e. from cache after the first tile of
//   a pair, as in MLX's qmv kernels; the pair's id and the 12 bcast words are broadcast
//   loads, one per thread. A broadcast x or indices is read in place (no copy).
//
// CHECKED ONLY ON A MAC: that Apple's compiler accepts this body (address-space deduction of
//   `auto` pointers for device and constant inputs, a kernel-scope threadgroup array, simd_shuffle
//   with a ushort lane, numeric_limits NaN converted to bfloat, expert_qdot.h's constructs:
//   as_type between half and ushort, an explicitly specialised function template;
//   mt_qmv_shuffle's and mt_qmv_sum's choice on a bool template parameter), register
//   use / occupancy, and the performance (GB/s vs mx.gather_qmm). The emulator checks the arithmetic, the bounds,
//   the SIMD-group collectives and the read counts; the CUDA translation compiles in CI.
#include "common.h"
#include "expert_qdot.h"

// expert_qdot.h's mt_expert_word_dot, kept here as this template's own text so that its
// negative controls (which edit the template) can break its decode: q * x summed over the
// PACK codes of one word against its PACK activations xv (pre-scaled by
// mt_expert_prescale), in code order; q is the unsigned integer (MODE 0: masked in place,
// read through the mantissa of 2^23, exact), the E2M1 value (MODE 1, 2; BITS 4) or the E4M3
// value (MODE 3; BITS 8).
template <int MODE, int BITS>
inline float mt_qmv_word_dot(uint word, thread const float* xv) {
  constexpr int HALF = 16 / BITS;
  constexpr uint MASK = (1u << BITS) - 1u;
  float dot = 0.0f;
  if constexpr (MODE == 0) {
    for (int h = 0; h < 2; ++h) {
      const uint part = h == 0 ? word : word >> 16;
      for (int j = 0; j < HALF; ++j) {
        // 2^23 + c * 2^(BITS*j)
        const uint code = mt_and_or(part, MASK << (BITS * j), 0x4B000000u);
        dot += (as_type<float>(code) - 8388608.0f) * xv[h * HALF + j];
      }
    }
  } else if constexpr (MODE == 3) {
    for (int i = 0; i < 4; ++i) {
      dot += mt_fp4_scale<2>(word >> (8 * i)) * xv[i];
    }
  } else {
    for (int i = 0; i < 4; ++i) {  // codes i and i + 4 of the word at once
      const float2 v = float2(mt_e2m1x2(word >> (4 * i)));
      dot += v.x * xv[i] + v.y * xv[i + 4];
    }
  }
  return dot;
}

// ROUND (moe_gather_qmm's rows): the word's weights as moe_gather_qmm defines them, each
// rounded once to T from its float32 value (affine: fma(s, q, b); fp modes: s * v, exact),
// times the activations as given (not pre-scaled), summed in code order.
template <typename T, int MODE, int BITS>
inline float mt_qmv_word_dot_rounded(uint word, thread const float* xv, float s, float b) {
  constexpr uint MASK = (1u << BITS) - 1u;
  float dot = 0.0f;
  if constexpr (MODE == 0) {
    for (int i = 0; i < 32 / BITS; i += 2) {  // codes i and i + 1 rounded together
      const float q0 = float((word >> (BITS * i)) & MASK);
      const float q1 = float((word >> (BITS * (i + 1))) & MASK);
      const float2 wv = mt_round2<T>(float2(metal::fma(s, q0, b), metal::fma(s, q1, b)));
      dot += wv.x * xv[i];
      dot += wv.y * xv[i + 1];
    }
  } else if constexpr (MODE == 3) {
    for (int i = 0; i < 4; i += 2) {
      const float2 wv = mt_round2<T>(float2(s * mt_fp4_scale<2>(word >> (8 * i)),
                                            s * mt_fp4_scale<2>(word >> (8 * (i + 1)))));
      dot += wv.x * xv[i];
      dot += wv.y * xv[i + 1];
    }
  } else {
    for (int i = 0; i < 4; ++i) {  // codes i and i + 4 of the word at once
      const float2 wv = mt_round2<T>(s * float2(mt_e2m1x2(word >> (4 * i))));
      dot += wv.x * xv[i] + wv.y * xv[i + 4];
    }
  }
  return dot;
}
// PLAIN_SHUFFLES (the 4-bit affine ROUND instantiations: moe_gather_qmm's rows) shuffle and
// sum through the plain simd_shuffle / simd_sum, the others through common.h's converged
// helpers. The same values and the same order either way. Measured on an H200 (CUDA;
// moe_gather_qmm bfloat16, 4-bit, us per call, converged / plain): M 32 N 768 K 2048 85.4 /
// 57.6, M 128 253.4 / 135.1, the revision before the converged helpers 132.5 at M 128;
// 8-bit ROUND 148.5 / 153.4 and expert_qmv's own 4-bit rows (Mixtral up 78.2 / 74.4)
// within the run's noise, so they keep the converged calls (which saved 2 to 8% of the MoE
// decode kernels' time when they came). On CUDA the plain calls ask for __activemask() per call,
// and ptxas (sm_90) then built this instantiation in 72 registers and a 96-byte stack
// frame instead of 100 registers: 28 warps per SM instead of 20. Since the row loop is
// unrolled by pragma (kernel body) it builds in 96 registers and no stack frame. On Metal
// both are simd_shuffle / simd_sum.
template <bool PLAIN, typename V>
inline V mt_qmv_shuffle(V v, ushort src) {
  return PLAIN ? simd_shuffle(v, src) : mt_shuffle_converged(v, src);
}

template <bool PLAIN>
inline float mt_qmv_sum(float v) {
  return PLAIN ? simd_sum(v) : mt_sum_converged(v);
}

// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;         // SIMD-groups per threadgroup
constexpr uint ROWS = 4;               // output rows per SIMD-group
constexpr uint PACK = 32 / BITS;       // values per uint32 word
// Words per lane per step: 4, or one group's words where a group holds fewer (nvfp4: 2), so
// that a step holds at most 32 groups (one per lane).
constexpr int WORDS = GROUP_SIZE / PACK < 4 ? GROUP_SIZE / PACK : 4;
constexpr uint VALS = WORDS * PACK;    // values per lane per step: 32 (4-bit), 16 (8-bit, nvfp4)
constexpr uint STEP_WORDS = 32 * WORDS;                  // words of a row per 32-lane step
constexpr uint GROUP_WORDS = GROUP_SIZE / PACK;          // words per group: 2..32, divides 32
constexpr uint STEP_GROUPS = STEP_WORDS / GROUP_WORDS;   // groups per step: 2..32
constexpr int SCALE_FORMAT = MODE == 3 ? 1 : MODE;  // mt_fp4_scale's: mxfp8 scales are E8M0
// Affine biases of a float S do not fit beside their scales in one shuffled uint.
constexpr bool BIAS_APART = MODE == 0 && sizeof(S) == 4;
constexpr uint MAX_K_GROUPS = 8;       // SIMD-groups sharing one row block's K, at most
constexpr bool PLAIN_SHUFFLES = ROUND && MODE == 0 && BITS == 4;  // mt_qmv_shuffle's

// Per (K group, row block, row): a K group's sum, combined in K-group order (S > 1 only).
threadgroup float partials[MAX_K_GROUPS * SIMDGROUPS * ROWS];

const uint lane = thread_index_in_simdgroup;
const uint pair = threadgroup_position_in_grid.z;
const uint k_groups = simdgroups_per_threadgroup / SIMDGROUPS;  // the launch plan's S
const uint row_block = simdgroup_index_in_threadgroup % SIMDGROUPS;
const uint k_group = simdgroup_index_in_threadgroup / SIMDGROUPS;
const uint row0 = (threadgroup_position_in_grid.y * SIMDGROUPS + row_block) * ROWS;
const uint n_rows_total = n_out;
if (row0 >= n_rows_total) {
  return;  // uniform over the SIMD-group: a row tile past N
}
const uint rows = metal::min(ROWS, n_rows_total - row0);
device T* out_rows = out + size_t(pair) * n_rows_total + row0;

// Broadcast token grid: x row and ids row of this pair (uniform over the threadgroup).
constexpr int BCAST_DIMS = 4;
const uint token = pair / n_sel;
const uint slot = pair - token * n_sel;
uint x_at = slot * x_slot;
uint id_at = slot;
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

const uint expert = uint(indices[id_at]);
if (expert >= n_experts) {
  // Out-of-range id (uniform over the threadgroup): NaN row, nothing of the expert is read.
  if (k_group == 0 && lane < rows) {
    out_rows[lane] = T(metal::numeric_limits<float>::quiet_NaN());
  }
  return;
}

const uint K = k_in;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint n_steps = (words_per_row + STEP_WORDS - 1) / STEP_WORDS;
const size_t first_row = size_t(expert) * n_rows_total + row0;
// auto: an input of fewer than 8 elements arrives in the constant address space.
const auto w_rows = w + first_row * words_per_row;
const auto s_rows = scales + first_row * groups_per_row;
const auto b_rows = biases + first_row * groups_per_row;
const auto x_row = x + size_t(x_at) * K;

float acc[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
// K group g takes the steps g, g + S, ... (trip count uniform over the SIMD-group).
for (uint step = k_group; step < n_steps; step += k_groups) {
  const uint word0 = step * STEP_WORDS;
  const uint group0 = step * STEP_GROUPS;
  // Lane l's words of the step: word0 + 32 * wi + l (WORD MAPPING).
  bool in_row[WORDS];
  for (int wi = 0; wi < WORDS; ++wi) {
    in_row[wi] = word0 + 32 * wi + lane < words_per_row;
  }
  // 1. Every load of the step, none of them waiting for another: the words of all rows,
  //    the step's scales (and biases) one group per lane, the activations.
  uint words[ROWS][WORDS];
  const auto w_step = w_rows + word0 + lane;
  for (uint r = 0; r < ROWS; ++r) {
    for (int wi = 0; wi < WORDS; ++wi) {
      words[r][wi] = in_row[wi] && r < rows ? w_step[size_t(r) * words_per_row + 32 * wi] : 0u;
    }
  }
  const bool loads_group = lane < STEP_GROUPS && group0 + lane < groups_per_row;
  const auto s_step = s_rows + group0 + lane;
  const auto b_step = b_rows + group0 + lane;
  uint group[ROWS];        // the lane's group of each row: mt_group_bits (raw bits)
  float bias_apart[ROWS];  // BIAS_APART only
  for (uint r = 0; r < ROWS; ++r) {
    group[r] = 0u;
    bias_apart[r] = 0.0f;
    if (loads_group && r < rows) {
      const size_t at = size_t(r) * groups_per_row;
      if constexpr (MODE == 0) {
        const S b = b_step[at];
        group[r] = mt_group_bits<MODE>(s_step[at], b);
        if constexpr (BIAS_APART) {
          bias_apart[r] = float(b);
        }
      } else {
        group[r] = mt_group_bits<MODE>(s_step[at], s_step[at]);
      }
    }
  }
  float xv[VALS];
  const auto x_step = x_row + (word0 + lane) * PACK;  // the lane's first word's activations
  for (int wi = 0; wi < WORDS; ++wi) {
    for (uint i = 0; i < PACK; ++i) {
      xv[wi * PACK + i] = in_row[wi] ? float(x_step[32 * PACK * wi + i]) : 0.0f;
    }
  }
  // 2. The arithmetic; each word's group scale (and bias) shuffled from the lane that loaded
  //    it. x_sum[wi]: word wi's activations summed (the affine bias term), before they are
  //    pre-scaled for mt_qmv_word_dot.
  float x_sum[WORDS];
  for (int wi = 0; wi < WORDS; ++wi) {
    x_sum[wi] = 0.0f;
    for (uint i = 0; i < PACK && !ROUND; ++i) {
      x_sum[wi] += xv[wi * PACK + i];
      xv[wi * PACK + i] *= mt_expert_prescale<MODE, BITS>(i);
    }
  }
  // Unrolled: words[r], group[r] and acc[r] stay in registers. ptxas left this loop rolled
  // for the 4-bit ROUND rows (moe_gather_qmm's), which then kept them in local memory.
  #pragma clang loop unroll(full)
  for (uint r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      break;  // uniform over the SIMD-group
    }
    for (int wi = 0; wi < WORDS; ++wi) {
      // The lane holding word wi's group: (32 * wi + l) / GROUP_WORDS.
      const ushort src = ushort((32 * wi + lane) / GROUP_WORDS);
      const uint g = mt_qmv_shuffle<PLAIN_SHUFFLES>(group[r], src);
      float s;
      float b = 0.0f;
      if constexpr (MODE == 0) {
        s = mt_group_scale<MODE, S>(g);
        if constexpr (BIAS_APART) {
          b = mt_qmv_shuffle<PLAIN_SHUFFLES>(bias_apart[r], src);
        } else {
          b = mt_group_bias<S>(g);
        }
      } else {
        s = mt_fp4_scale<SCALE_FORMAT>(g);  // the E8M0 / E4M3 scale code
      }
      if (in_row[wi] && ROUND) {
        acc[r] += mt_qmv_word_dot_rounded<T, MODE, BITS>(words[r][wi], xv + wi * PACK, s, b);
      } else if (in_row[wi]) {
        const float dot = mt_qmv_word_dot<MODE, BITS>(words[r][wi], xv + wi * PACK);
        if constexpr (MODE == 0) {
          acc[r] += s * dot + b * x_sum[wi];
        } else {
          acc[r] += s * dot;  // no bias term (0 * an infinite x_sum would be NaN)
        }
      }
    }
  }
}

if (k_groups == 1u) {  // uniform over the threadgroup
  for (uint r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      break;  // uniform over the SIMD-group
    }
    const float total = mt_qmv_sum<PLAIN_SHUFFLES>(acc[r]);
    if (lane == 0) {
      out_rows[r] = T(total);
    }
  }
} else {  // every row block holds ROWS rows here (DISPATCH INVARIANTS): no thread returned
  for (uint r = 0; r < ROWS; ++r) {
    const float total = mt_qmv_sum<PLAIN_SHUFFLES>(acc[r]);
    if (lane == 0) {
      partials[(k_group * SIMDGROUPS + row_block) * ROWS + r] = total;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (k_group == 0 && lane < rows) {
    float total = 0.0f;
    for (uint g = 0; g < k_groups; ++g) {  // fixed order: K group 0, 1, ...
      total += partials[(g * SIMDGROUPS + row_block) * ROWS + lane];
    }
    out_rows[lane] = T(total);
  }
}
