// moe_gather_qmm_dx.metal: the x-VJP of moe_gather_qmm, dx = g @ W[indices] (affine 4/8-bit,
// mxfp4, nvfp4, mxfp8), with the weights the forward multiplies by.
//
// MATH (rows m in [0, M), k in [0, K), float32 products and sums):
//   e        = indices[m]                                  (the expert of row m)
//   W[n, k]  = T(scale[e, n, k / gs] * q[e, n, k] + bias[e, n, k / gs])   (MODE 0, affine:
//              one float32 fma, rounded once to T, exactly as moe_gather_qmm_simdgroup's
//              mt_moe_dequant16; q the BITS-bit code, low bits first)
//              MODE 1 (mxfp4) / 2 (nvfp4): T(mt_fp4_scale<MODE>(scale) * e2m1(q)), BITS 4
//              MODE 3 (mxfp8): T(mt_fp4_scale<1>(scale) * e4m3(q)), BITS 8 (0x7F / 0xFF read
//              as +-480 like MLX's Metal decoder); the fp modes have no bias
//   dx[m, k] = sum_n float(g[m, n]) * float(W[n, k])      if e < E, else NaN
//   T = float: the rounding is the identity (the float32 weight itself).
//   SUMMATION ORDER (fixed for given shapes and template: bitwise reproducible run to run):
//   SIMD-group s of a threadgroup takes the 32-row blocks b = s, s + SG, s + 2 SG, ... of N
//   (rows n = 32 b .. 32 b + 31), in increasing order, each row in increasing n; each lane
//   accumulates, per k value of its word, acc = fma(g[m, n], W[n, k], acc) over those rows.
//   The SG partials of one k are then added in SIMD-group order 0, 1, ..., SG - 1
//   (((p0 + p1) + p2) + ...), through threadgroup memory, and written as float32.
//   OUT-OF-RANGE IDS: the id is read as uint (a negative int32 id becomes >= 2^31); an id
//   >= E makes dx[m, :] NaN, and no byte of w / scales / biases / g is read for row m.
//
// LAYOUTS (row-contiguous; mx.quantize of a stacked [E, N, K] weight):
//   g [M, N] T (the cotangent of the forward's output); w [E, N, K * BITS / 32] uint32
//   (PACK = 32 / BITS codes per word, low bits first); scales, biases [E, N, K / GROUP_SIZE]
//   T (scales may be negative); fp modes: scales uint8 (E8M0, group 32 / E4M3, group 16),
//   biases not read (the wrapper passes scales again); indices [M] uint32 or int32;
//   dx [M, K] float32. n_rows (M), n_experts (E), n_cols (N), k_dim (K): 0-d uint runtime
//   inputs (changing them never builds a new kernel). Template: T, BITS (4, 8), GROUP_SIZE
//   (32, 64, 128; nvfp4 16), MODE (0 affine, 1 mxfp4, 2 nvfp4, 3 mxfp8), SIMDGROUPS (SG) and
//   UNROLL (the launch plan's geometry: ops/moe_gather_qmm.py's DX_SIMDGROUPS, DX_UNROLL).
//   ADDRESS SPACES: indices of M < 8 rows arrive in the `constant` address space (a second
//   instantiation, as the forward's); the body reads every input through `auto` pointers
//   or direct indexing, so both forms compile. g, w, scales hold >= 32 elements.
//
// RANGE / ROUNDING: each weight is rounded to T once, from the float32 fma (the forward's
//   own value, bit for bit); g is T, widened exactly; each product and sum is one float32
//   fma. No intermediate is rounded to T or scaled, so the range is float32's.
//
// WORD MAPPING: threadgroup y = chunk c of 32 consecutive words of a weight row (K values
//   [32 PACK c, 32 PACK (c + 1)) clipped to K): lane l owns word w0 + l (w0 = 32 c), i.e.
//   the PACK consecutive k values 32 PACK c + PACK l + i, i < PACK, in every row n. So each
//   word-load instruction of a SIMD-group reads 128 contiguous bytes of one weight row
//   (one line, every sector used). The chunk's groups (32 / (GROUP_SIZE / PACK) <= 16 of
//   them, a group never straddling a chunk: GROUP_SIZE / PACK divides 32) are loaded one per
//   lane, scale and affine bias packed in one uint (expert_qdot.h's mt_group_bits; a float
//   T's bias apart) and passed to the lanes of their words by simd_shuffle. The g values of
//   a 32-row block are loaded one per lane (one 64- or 128-byte load) and broadcast to the
//   lanes row by row by simd_shuffle.
//
// LOADS (memory-level parallelism): a decode-sized call is latency-bound, so each SIMD-group
//   first issues the loads of UNROLL rows (UNROLL words per lane, UNROLL group uints), none
//   waiting for another, then decodes and accumulates them; the g values of a block are
//   loaded before its rows.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * SG, 1, 1): SG SIMD-groups of 32, splitting N (SUMMATION ORDER)
//   grid        = (32 * SG * M, ceil(K * BITS / 32 / 32), 1) threads: threadgroup_position_in
//                 _grid is (row m, word chunk, 0) (rows on x: CUDA caps grid y and z at
//                 65535 blocks; consecutive threadgroups are rows of one chunk, so sorted rows
//                 of one expert find its chunk in cache); every (m, k) is written by exactly
//                 one thread of exactly one threadgroup
//   N % 32 == 0 (whole 32-row blocks: every g / row load is in range), K % 32 == 0 and
//   K % GROUP_SIZE == 0 (a group never straddles a row end), UNROLL divides 32.
//   The only early return (an out-of-range id) is uniform over the threadgroup and comes
//   before the one barrier; shuffles are executed by all 32 lanes (lanes whose word lies
//   past the row end load nothing, shuffle along and skip the arithmetic).
//   threadgroup memory: SG * 32 * (PACK + 1) floats (the partials; PACK + 1: an odd lane
//   stride, no bank conflicts on the stores and at most 2-way on the reads).
//
// TRAFFIC per threadgroup (row m, chunk c), valid id: the chunk's words of each of expert
//   e's N rows once (32 words or fewer per row), the chunk's groups of each row once (scales,
//   and biases in affine mode), the g row once (N values); dx written once (32 PACK values
//   or fewer). Per row m over its chunks: the expert's N * K * BITS / 8 code bytes and N * K
//   / GROUP_SIZE scales (and biases) exactly once; g read once per chunk (cache hits after
//   the first). Invalid id: only the id (one read per thread), then NaN written.
//
// ONLY CHECKED ON A MAC: that Apple's compiler accepts this body (auto pointers into device
//   and constant inputs, simd_shuffle of uint and float with a ushort lane, a kernel-scope
//   threadgroup array sized by template parameters, expert_qdot.h's helpers), register use /
//   occupancy and the speed. The emulator checks the arithmetic, every memory access (bounds
//   and byte counts), the barrier and the SIMD-group functions; the CUDA translation
//   compiles in CI.
#include "common.h"
#include "expert_qdot.h"

// ---- kernel body ----
constexpr uint SG = SIMDGROUPS;
constexpr uint PACK = 32 / BITS;                  // codes per word: 8 (4-bit), 4 (8-bit)
constexpr uint GROUP_WORDS = GROUP_SIZE / PACK;   // words per group: 2..32, divides 32
constexpr uint CHUNK_GROUPS = 32 / GROUP_WORDS;   // groups of a 32-word chunk: 1..16
constexpr uint CHUNK_VALS = 32 * PACK;            // k values of a chunk
constexpr uint LD = PACK + 1;                     // padded stride of a lane's partials
constexpr uint THREADS = 32 * SG;
constexpr int SCALE_FORMAT = MODE == 3 ? 1 : MODE;  // mt_fp4_scale's: mxfp8 scales are E8M0
// Affine biases of a float T do not fit beside their scales in one shuffled uint.
constexpr bool BIAS_APART = MODE == 0 && sizeof(T) == 4;
constexpr uint MASK = (1u << BITS) - 1u;
static_assert(32 % UNROLL == 0, "UNROLL divides a 32-row block");

threadgroup float partials[SG * 32 * LD];  // per (SIMD-group, lane, value)

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint tid = thread_position_in_threadgroup.x;
const uint m = threadgroup_position_in_grid.x;
const uint N = n_cols;
const uint K = k_dim;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint word0 = threadgroup_position_in_grid.y * 32;
const uint k0 = word0 * PACK;
const uint vals = metal::min(CHUNK_VALS, K - k0);  // the chunk's k values inside K
device float* dx_chunk = dx + size_t(m) * K + k0;

const uint e = uint(indices[m]);
if (e >= n_experts) {
  // Out-of-range id (uniform over the threadgroup): NaN, nothing of the expert read.
  for (uint o = tid; o < vals; o += THREADS) {
    dx_chunk[o] = metal::numeric_limits<float>::quiet_NaN();
  }
  return;
}

const bool live = word0 + lane < words_per_row;  // this lane's word lies inside the row
const uint group0 = word0 / GROUP_WORDS;         // the chunk's first group
const bool loads_group = lane < CHUNK_GROUPS && group0 + lane < groups_per_row;
const ushort src = ushort(lane / GROUP_WORDS);   // the lane that loads this word's group
const size_t first_row = size_t(e) * N;
// auto: an input of fewer than 8 elements arrives in the constant address space.
const auto w_lane = w + first_row * words_per_row + word0 + lane;  // row n: + n * words_per_row
const auto s_lane = scales + first_row * groups_per_row + group0 + lane;
const auto b_lane = biases + first_row * groups_per_row + group0 + lane;
const auto g_lane = g + size_t(m) * N + lane;

float acc[PACK];
for (uint i = 0; i < PACK; ++i) {
  acc[i] = 0.0f;
}
for (uint n0 = sg * 32; n0 < N; n0 += SG * 32) {  // this SIMD-group's 32-row blocks
  const float g_block = float(g_lane[n0]);  // g[m, n0 + lane]
  for (uint r0 = 0; r0 < 32; r0 += UNROLL) {
    // 1. Every load of UNROLL rows, none waiting for another.
    uint words[UNROLL];
    uint group[UNROLL];        // the lane's group of each row: mt_group_bits (raw bits)
    float bias_apart[UNROLL];  // BIAS_APART only
    for (uint u = 0; u < UNROLL; ++u) {
      const size_t n = n0 + r0 + u;
      words[u] = live ? w_lane[n * words_per_row] : 0u;
      group[u] = 0u;
      bias_apart[u] = 0.0f;
      if (loads_group) {
        const size_t at = n * groups_per_row;
        if constexpr (MODE == 0) {
          const T b = b_lane[at];
          group[u] = mt_group_bits<MODE>(s_lane[at], b);
          if constexpr (BIAS_APART) {
            bias_apart[u] = float(b);
          }
        } else {
          group[u] = mt_group_bits<MODE>(s_lane[at], s_lane[at]);
        }
      }
    }
    // 2. Per row: its g value and its group's scale (and bias) from the lanes holding
    //    them (every lane shuffles), then each weight rounded to T and accumulated.
    for (uint u = 0; u < UNROLL; ++u) {
      const float gn = simd_shuffle(g_block, ushort(r0 + u));
      const uint gb = simd_shuffle(group[u], src);
      float s;
      float b = 0.0f;
      if constexpr (MODE == 0) {
        s = mt_group_scale<MODE, T>(gb);
        if constexpr (BIAS_APART) {
          b = simd_shuffle(bias_apart[u], src);
        } else {
          b = mt_group_bias<T>(gb);
        }
      } else {
        s = mt_fp4_scale<SCALE_FORMAT>(gb);  // the E8M0 / E4M3 scale code
      }
      if (live) {
        const uint word = words[u];
        if constexpr (MODE == 0) {
          for (uint i = 0; i < PACK; ++i) {
            const float q = float((word >> (BITS * i)) & MASK);
            acc[i] = metal::fma(gn, float(T(metal::fma(s, q, b))), acc[i]);
          }
        } else if constexpr (MODE == 3) {
          for (uint i = 0; i < 4; ++i) {
            acc[i] = metal::fma(gn, float(T(s * mt_fp4_scale<2>(word >> (8 * i)))), acc[i]);
          }
        } else {
          for (uint i = 0; i < 4; ++i) {  // codes i and i + 4 of the word at once
            const float2 v = float2(mt_e2m1x2(word >> (4 * i)));
            acc[i] = metal::fma(gn, float(T(s * v.x)), acc[i]);
            acc[i + 4] = metal::fma(gn, float(T(s * v.y)), acc[i + 4]);
          }
        }
      }
    }
  }
}

// The SG partials, added in SIMD-group order and written (consecutive threads, consecutive k).
for (uint i = 0; i < PACK; ++i) {
  partials[(sg * 32 + lane) * LD + i] = acc[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint o = tid; o < vals; o += THREADS) {
  const uint at = (o / PACK) * LD + o % PACK;  // lane o / PACK, value o % PACK
  float v = partials[at];
  for (uint s = 1; s < SG; ++s) {
    v += partials[s * 32 * LD + at];
  }
  dx_chunk[o] = v;
}
