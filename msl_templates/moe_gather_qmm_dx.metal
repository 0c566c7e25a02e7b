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
//   ROUND = false (expert_qmv's x-VJP): W[n, k] is the float32 value, not rounded to T.
//   SUMMATION ORDER (fixed for given shapes, template and n_slices: bitwise reproducible
//   run to run): N's B = ceil(N / 32) 32-row blocks (rows n = 32 b .. 32 b + 31) are cut
//   into n_slices contiguous slices, slice z taking blocks [begin_z, end_z): q = B / n_slices
//   blocks each and one more for the first B % n_slices slices (begin_z = z q + min(z,
//   B % n_slices)). In the threadgroups of slice z, SIMD-group s takes the blocks
//   begin_z + s, begin_z + s + SG, ... < end_z, in increasing order, each row in increasing
//   n; each lane accumulates, per k value of its word and per row m of its run (TILES),
//   acc = fma(g[m, n], W[n, k], acc) over those n. The SG partials of one (m, k) are then
//   added in SIMD-group order 0, 1, ..., SG - 1 (((p0 + p1) + p2) + ...), through
//   threadgroup memory, and written as float32: slice z's partial P_z[m, k]. The wrapper
//   then adds the n_slices partials with mx.sum over the slice axis (MLX's column
//   reduction: an order fixed for given shapes and device, no atomics; exact for 2 slices).
//   With n_slices = 1 the partial is dx itself, nothing added after: slice 0 walks the
//   blocks s, s + SG, ... of all N. A row's sum depends on SG and n_slices only, not on
//   which tile, run or slot it falls in (nor on UNROLL or ROWS).
//   OUT-OF-RANGE IDS: the id is read as uint (a negative int32 id becomes >= 2^31); an id
//   >= E makes row m of every slice's partial NaN (so dx[m, :] is NaN), and no byte of w /
//   scales / biases / g is read for row m.
//
// LAYOUTS (row-contiguous; mx.quantize of a stacked [E, N, K] weight):
//   g [M, N] T (the cotangent of the forward's output); w [E, N, K * BITS / 32] uint32
//   (PACK = 32 / BITS codes per word, low bits first); scales, biases [E, N, K / GROUP_SIZE]
//   S (scales may be negative): S = T, or float16 / bfloat16 with T = float (a float32 g
//   against 16-bit experts: the fused MoE ops' backward, ROUND false); fp modes: S = uint8
//   scales (E8M0, group 32 / E4M3, group 16), biases not read (the wrapper passes scales
//   again); indices [M] uint32 or int32;
//   dx [n_slices, M, K] float32: slice z's partial at dx + z M K (n_slices = 1: dx [M, K]
//   itself). n_rows (M), n_experts (E), n_cols (N), k_dim (K), n_slices: 0-d uint runtime
//   inputs (changing them never builds a new kernel). Template: T, S, BITS (4, 8), GROUP_SIZE
//   (32, 64, 128; nvfp4 16), MODE (0 affine, 1 mxfp4, 2 nvfp4, 3 mxfp8), SIMDGROUPS (SG) and
//   UNROLL, ROWS (the launch plan's geometry: ops/moe_gather_qmm.py's DX_SIMDGROUPS,
//   DX_UNROLL, DX_ROWS), ROUND (the weights rounded to T: true for moe_gather_qmm).
//   ADDRESS SPACES: indices of M < 8 rows arrive in the `constant` address space (a second
//   instantiation, as the forward's); the body reads every input through `auto` pointers
//   or direct indexing, so both forms compile. g, w, scales hold >= 32 elements.
//
// RANGE / ROUNDING: each weight is rounded to T once, from the float32 fma (the forward's
//   own value, bit for bit); g is T, widened exactly; each product and sum is one float32
//   fma. No intermediate is rounded to T, so the range is float32's. fp modes with ROUND
//   false (float32 weights: expert_qmv's and fp4_qmm's x-VJPs) scale each weight by 2^-3
//   and the written partial by 2^3 (FP_DOWN / FP_UP), exact steps: a weight of an E8M0
//   scale up to 2^127 stays finite (6 * 2^127 would not), as in fp4_qmm's forward kernels;
//   the bits equal the unscaled sums' except where a term falls below float32's normal
//   range (scales under 2^-123).
//
// TILES: the rows are cut into tiles of ROWS consecutive rows (the wrapper sorts them by
//   expert first when ROWS > 1, unless the caller promised sorted ids, and un-permutes dx).
//   Inside a tile the rows sharing an expert form a run; threadgroup (tile, slot) computes
//   the run whose first row in the tile is `slot` (its leader); the tile's other slots exit
//   at once (uniformly, before any barrier), as moe_gather_qmm_simdgroup's slots. So each
//   weight is read and decoded (rounded to T) once per run and multiplied into the g values
//   of every row of the run: at prefill (a handful of rows per expert) the decode, most of
//   the arithmetic of a one-row kernel, is shared; at decode (distinct experts) each run is
//   one row and the kernel is the one-row kernel. Per-row work is behind uniform branches
//   on the run mask (no shuffle or fma for rows outside the run).
//
// WORD MAPPING: threadgroup y = chunk c of 32 consecutive words of a weight row (K values
//   [32 PACK c, 32 PACK (c + 1)) clipped to K): lane l owns word w0 + l (w0 = 32 c), i.e.
//   the PACK consecutive k values 32 PACK c + PACK l + i, i < PACK, in every row n. So each
//   word-load instruction of a SIMD-group reads 128 contiguous bytes of one weight row
//   (one line, every sector used). The chunk's groups (32 / (GROUP_SIZE / PACK) <= 16 of
//   them, a group never straddling a chunk: GROUP_SIZE / PACK divides 32) are loaded one per
//   lane, scale and affine bias packed in one uint (expert_qdot.h's mt_group_bits; a float
//   T's bias apart) and passed to the lanes of their words by simd_shuffle. The g values of
//   a 32-row block are loaded one per lane for each row m of the run (one 64- or 128-byte
//   load each) and broadcast to the lanes row n by row n by simd_shuffle.
//
// LOADS (memory-level parallelism): a decode-sized call is latency-bound, so each SIMD-group
//   first issues the loads of UNROLL weight rows (UNROLL words per lane, UNROLL group uints),
//   none waiting for another, then decodes and accumulates them; the g values of a block
//   are loaded before its rows. Registers: ROWS * PACK accumulators + PACK decoded weights
//   + 2-3 UNROLL loads + ROWS g values per lane; nvcc (CUDA translation, SG 8, UNROLL 8,
//   ROWS 4): 79-80 registers for bf16 (affine 4-bit GS 64, mxfp4; either ROUND), 95 for
//   float32, 80 for a float32 g with 16-bit scales (S), no spill (the slice's block range
//   added 0-2 to bf16's, 7-10 to float32's: 3 and 2 threadgroups of 256 per SM as before).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * SG, 1, 1): SG SIMD-groups of 32, splitting a slice of N (SUMMATION
//                 ORDER)
//   grid        = (32 * SG * ROWS * ceil(M / ROWS), ceil(K * BITS / 32 / 32), n_slices)
//                 threads: threadgroup_position_in_grid is (ROWS * tile + slot, word chunk,
//                 slice) (rows on x: CUDA caps grid y and z at 65535 blocks; consecutive
//                 threadgroups are rows of one chunk, so the tiles of one expert find its
//                 chunk in cache); slots past M exit; every (slice, m, k) is written by
//                 exactly one thread of exactly one threadgroup (its run's leader, or its own
//                 slot for a NaN row)
//   1 <= n_slices <= max(1, ceil(N / 32)) and <= 65535 (CUDA's grid z): the plan gives
//   every slice a block (N = 0: one empty slice). An empty slice would still be safe and right: its SIMD-groups walk no
//   block, reach every barrier and write zero partials.
//   N any: rows past N are neither loaded nor multiplied (moe_gather_qmm's N is a multiple
//   of 32; expert_qmv's any). K % GROUP_SIZE == 0 and K % PACK == 0 (a group never
//   straddles a row end; a chunk past the row end masks its words), UNROLL divides 32.
//   The early returns (a slot past M, an out-of-range id, a slot that leads no run) are
//   uniform over the threadgroup and come before any barrier; the per-row barriers are
//   behind the run mask, uniform too; shuffles are executed by all 32 lanes (lanes whose
//   word lies past the row end load nothing, shuffle along and skip the arithmetic).
//   threadgroup memory: SG * 32 * (PACK + 1) floats (the partials; PACK + 1: an odd lane
//   stride, no bank conflicts on the stores and at most 2-way on the reads).
//
// TRAFFIC per threadgroup (run, chunk c, slice z), valid id: the chunk's words of each of
//   expert e's rows in slice z once (32 words or fewer per row), the chunk's groups of each
//   of those rows once (scales, and biases in affine mode), the slice's part of the g row of
//   each run row once; its partial written once (32 PACK values or fewer per run row). Per
//   run over its chunks and slices: the expert's N * K * BITS / 8 code bytes and
//   N * K / GROUP_SIZE scales (and biases) exactly once (ROWS = 1: once per row); g read
//   once per chunk (cache hits after the first); n_slices M K partials written (and read
//   once by the sum after, for n_slices > 1). Each thread reads its slot's id and, for a
//   valid id, the tile's <= ROWS ids (cache hits), in every slice. Invalid id: only the
//   ids, then NaN written in every slice.
//
// LAUNCH PLAN (ops/moe_gather_qmm.py's dx_slices): n_slices is the fewest slices whose
//   working threadgroups (M, each row its own run at worst, times the chunks, times
//   n_slices) reach DX_SLICE_TARGET_TGS[backend], capped so that each slice keeps
//   DX_MIN_SLICE_BLOCKS blocks; a decode-sized grid on a large GPU otherwise leaves most
//   cores idle while each SIMD-group walks N / 32 / SG blocks in turn. cuda only: Metal and
//   the emulator take one slice (no Apple-side measurement argues for more, and one slice
//   writes dx directly, with no sum after).
//
// ONLY CHECKED ON A MAC: that Apple's compiler accepts this body (auto pointers into device
//   and constant inputs, simd_shuffle of uint and float with a ushort lane, a kernel-scope
//   threadgroup array sized by template parameters, expert_qdot.h's helpers), register use /
//   occupancy and the speed. The emulator checks the arithmetic, every memory access (bounds
//   and byte counts), the barrier and the SIMD-group functions; the CUDA translation
//   compiles in CI.
#include "common.h"
#include "expert_qdot.h"

// Two weights as the products use them: each rounded once to T (ROUND: moe_gather_qmm's
// weights; common.h's mt_round2), or the float32 values themselves (expert_qmv's).
template <typename T, bool ROUND>
inline float2 mt_dx_weights(float2 v) {
  return ROUND ? mt_round2<T>(v) : v;
}

// ---- kernel body ----
constexpr uint SG = SIMDGROUPS;
constexpr uint PACK = 32 / BITS;                  // codes per word: 8 (4-bit), 4 (8-bit)
constexpr uint GROUP_WORDS = GROUP_SIZE / PACK;   // words per group: 2..32, divides 32
constexpr uint CHUNK_GROUPS = 32 / GROUP_WORDS;   // groups of a 32-word chunk: 1..16
constexpr uint CHUNK_VALS = 32 * PACK;            // k values of a chunk
constexpr uint LD = PACK + 1;                     // padded stride of a lane's partials
constexpr uint THREADS = 32 * SG;
constexpr int SCALE_FORMAT = MODE == 3 ? 1 : MODE;  // mt_fp4_scale's: mxfp8 scales are E8M0
// Affine biases of a float S do not fit beside their scales in one shuffled uint.
constexpr bool BIAS_APART = MODE == 0 && sizeof(S) == 4;
constexpr uint MASK = (1u << BITS) - 1u;
// fp modes with float32 weights (ROUND false): each scale times FP_DOWN (2^-3, exact) so that
// code * scale stays finite for E8M0 scales up to 2^127 (6 * 2^127 overflows float32); the
// partials are multiplied by FP_UP = 8 when written. Power-of-two steps: the same bits as
// the unscaled sums wherever those are finite and normal (RANGE / ROUNDING).
constexpr float FP_DOWN = (MODE != 0 && !ROUND) ? 0.125f : 1.0f;
constexpr float FP_UP = (MODE != 0 && !ROUND) ? 8.0f : 1.0f;
static_assert(32 % UNROLL == 0, "UNROLL divides a 32-row block");
static_assert(ROWS >= 1 && ROWS <= 32, "a tile's run is a 32-bit mask");

threadgroup float partials[SG * 32 * LD];  // per (SIMD-group, lane, value)

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint tid = thread_position_in_threadgroup.x;
const uint row0 = (threadgroup_position_in_grid.x / ROWS) * ROWS;  // the tile's first row
const uint slot = threadgroup_position_in_grid.x % ROWS;
const uint M = n_rows;
const uint N = n_cols;
const uint K = k_dim;
const uint words_per_row = K / PACK;
const uint groups_per_row = K / GROUP_SIZE;
const uint word0 = threadgroup_position_in_grid.y * 32;
const uint k0 = word0 * PACK;
const uint vals = metal::min(CHUNK_VALS, K - k0);  // the chunk's k values inside K

// This threadgroup's slice of N: the 32-row blocks [block_begin, block_end) (SUMMATION
// ORDER); its partial's row m at dx + (slice M + m) K.
const uint slice = threadgroup_position_in_grid.z;
const uint n_blocks = (N + 31) / 32;
const uint slice_blocks = n_blocks / n_slices;
const uint longer_slices = n_blocks % n_slices;
const uint block_begin = slice * slice_blocks + metal::min(slice, longer_slices);
const uint block_end = block_begin + slice_blocks + (slice < longer_slices ? 1u : 0u);

const uint rows_here = metal::min(ROWS, M - row0);
if (slot >= rows_here) {
  return;  // past M (uniform over the threadgroup)
}
const uint e = uint(indices[row0 + slot]);
if (e >= n_experts) {
  // Out-of-range id (uniform over the threadgroup): NaN for this row in every slice's
  // partial, nothing of the expert read.
  device float* dx_nan = dx + (size_t(slice) * M + row0 + slot) * K + k0;
  for (uint o = tid; o < vals; o += THREADS) {
    dx_nan[o] = metal::numeric_limits<float>::quiet_NaN();
  }
  return;
}
uint run = 0u;        // bit r: row row0 + r has expert e (this threadgroup's rows)
bool leader = true;   // slot is the tile's first row with expert e
for (uint r = 0; r < rows_here; ++r) {
  const bool same = uint(indices[row0 + r]) == e;
  run |= same ? (1u << r) : 0u;
  leader = leader && !(same && r < slot);
}
if (!leader) {
  return;  // the run's leader computes this row (uniform over the threadgroup)
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
const auto g_lane = g + size_t(row0) * N + lane;  // tile row r: + r * N

float acc[ROWS][PACK];
for (uint r = 0; r < ROWS; ++r) {
  for (uint i = 0; i < PACK; ++i) {
    acc[r][i] = 0.0f;
  }
}
// This SIMD-group's blocks block_begin + sg, + SG, ... < block_end (first rows n0).
for (uint n0 = (block_begin + sg) * 32; n0 < block_end * 32; n0 += SG * 32) {
  float g_block[ROWS];  // g[row0 + r, n0 + lane] of the run's rows
  for (uint r = 0; r < ROWS; ++r) {
    const bool in_run = ((run >> r) & 1u) != 0u;
    g_block[r] = in_run && n0 + lane < N ? float(g_lane[size_t(r) * N + n0]) : 0.0f;
  }
  for (uint r0 = 0; r0 < 32; r0 += UNROLL) {
    if (n0 + r0 >= N) {
      break;  // uniform over the SIMD-group: the block's rows past N (a ragged N)
    }
    // 1. Every load of UNROLL rows, none waiting for another.
    uint words[UNROLL];
    uint group[UNROLL];        // the lane's group of each row: mt_group_bits (raw bits)
    float bias_apart[UNROLL];  // BIAS_APART only
    for (uint u = 0; u < UNROLL; ++u) {
      const size_t n = n0 + r0 + u;
      const bool row_in = n < N;
      words[u] = live && row_in ? w_lane[n * words_per_row] : 0u;
      group[u] = 0u;
      bias_apart[u] = 0.0f;
      if (loads_group && row_in) {
        const size_t at = n * groups_per_row;
        if constexpr (MODE == 0) {
          const S b = b_lane[at];
          group[u] = mt_group_bits<MODE>(s_lane[at], b);
          if constexpr (BIAS_APART) {
            bias_apart[u] = float(b);
          }
        } else {
          group[u] = mt_group_bits<MODE>(s_lane[at], s_lane[at]);
        }
      }
    }
    // 2. Per weight row: its group's scale (and bias) from the lane holding them (every
    //    lane shuffles), the PACK weights rounded to T, then each run row's g value
    //    (shuffled from the lane that loaded it) times them.
    for (uint u = 0; u < UNROLL; ++u) {
      if (n0 + r0 + u >= N) {
        break;  // uniform over the SIMD-group
      }
      const uint gb = simd_shuffle(group[u], src);
      float s;
      float b = 0.0f;
      if constexpr (MODE == 0) {
        s = mt_group_scale<MODE, S>(gb);
        if constexpr (BIAS_APART) {
          b = simd_shuffle(bias_apart[u], src);
        } else {
          b = mt_group_bias<S>(gb);
        }
      } else {
        s = mt_fp4_scale<SCALE_FORMAT>(gb) * FP_DOWN;  // the E8M0 / E4M3 scale code
      }
      float wv[PACK];  // the lane's PACK weights of row n, each rounded to T
      const uint word = words[u];
      if constexpr (MODE == 0) {
        for (uint i = 0; i < PACK; i += 2) {  // codes i and i + 1 rounded together
          const float q0 = float((word >> (BITS * i)) & MASK);
          const float q1 = float((word >> (BITS * (i + 1))) & MASK);
          const float2 p = mt_dx_weights<T, ROUND>(
              float2(metal::fma(s, q0, b), metal::fma(s, q1, b)));
          wv[i] = p.x;
          wv[i + 1] = p.y;
        }
      } else if constexpr (MODE == 3) {
        for (uint i = 0; i < 4; i += 2) {
          const float2 p = mt_dx_weights<T, ROUND>(
              float2(s * mt_fp4_scale<2>(word >> (8 * i)),
                     s * mt_fp4_scale<2>(word >> (8 * (i + 1)))));
          wv[i] = p.x;
          wv[i + 1] = p.y;
        }
      } else {
        for (uint i = 0; i < 4; ++i) {  // codes i and i + 4 of the word at once
          const float2 p = mt_dx_weights<T, ROUND>(s * float2(mt_e2m1x2(word >> (4 * i))));
          wv[i] = p.x;
          wv[i + 4] = p.y;
        }
      }
      for (uint r = 0; r < ROWS; ++r) {
        if (((run >> r) & 1u) != 0u) {  // uniform over the threadgroup
          const float gn = simd_shuffle(g_block[r], ushort(r0 + u));
          if (live) {
            for (uint i = 0; i < PACK; ++i) {
              acc[r][i] = metal::fma(gn, wv[i], acc[r][i]);
            }
          }
        }
      }
    }
  }
}

// Per run row: the SG partials, added in SIMD-group order and written (consecutive threads,
// consecutive k).
for (uint r = 0; r < ROWS; ++r) {
  if (((run >> r) & 1u) == 0u) {
    continue;  // uniform over the threadgroup
  }
  for (uint i = 0; i < PACK; ++i) {
    partials[(sg * 32 + lane) * LD + i] = acc[r][i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  device float* dx_chunk = dx + (size_t(slice) * M + row0 + r) * K + k0;
  for (uint o = tid; o < vals; o += THREADS) {
    const uint at = (o / PACK) * LD + o % PACK;  // lane o / PACK, value o % PACK
    float v = partials[at];
    for (uint s = 1; s < SG; ++s) {
      v += partials[s * 32 * LD + at];
    }
    dx_chunk[o] = v * FP_UP;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // partials free for the next row
}
