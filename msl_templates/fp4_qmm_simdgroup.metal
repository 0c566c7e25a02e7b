// fp4_qmm_simdgroup.metal: fp4 (E2M1) quantized matmul, 32x32 output tiles on simdgroup
// matrices (every Apple GPU), optionally split along K.
//
// MATH (float32 accumulation, rounded once to OT):
//   out[p, m, n] = sum_{k in part p} float(x[m, k]) * wdq[n, k],
//   part p = [p Kp, min((p + 1) Kp, K)) (the last part is shorter when the parts are ragged)
//   With one part (Kp = K), OT = T and out is the result [M, N]. With several, OT = float and
//   out holds float32 partial sums [parts, M, N] that fp4_qmm_splitk_sum.metal adds up.
//   wdq[n, k] = e2m1(code (w[n, k / 8] >> 4 (k % 8)) & 0xF) * scale(n, k / GS)   (float32)
//   e2m1 -> {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}; scale = mt_fp4_scale<SCALE_MODE>(scales[n, g])
//   wdq is exact in float32 for E8M0 / E4M3 scales (a code times a power of two or a 4-bit
//   mantissa) and one float32 rounding for float scales; no weight is rounded before the
//   products (see STAGING: T holds the weights only where it holds them exactly).
// RANGE: code * scale overflows float32 for scales above FLT_MAX / 6 (E8M0 bytes 252..254,
//   2^125..2^127), though the result may be far below it: the tiles are staged as
//   wdq / 8 (|code| <= 6 < 8; exact, a power of two) and the accumulator is multiplied by 8
//   when stored, so any result that is finite in float32 comes out finite. COST: one
//   multiply per stored output. (wdq / 8 is subnormal for E8M0 bytes 1..3: exact where the
//   GPU keeps float32 subnormals, as the emulator does.)
//
// LAYOUT (row-contiguous): x [M, K] T; w [N, K / 8] uint32 (code j of a word at bits
//   [4j, 4j + 4)); scales [N, K / GS] ST; out [parts, M, N] OT. m_rows, n_cols, k_cols,
//   gs_shift, k_part: 0-d uint32 runtime inputs (M, N, K, log2 GS with GS in 16 .. 128, Kp).
// TEMPLATE: T, ST (uint8 or float: the wrapper passes float16 / bfloat16 scales as float32),
//   SCALE_MODE (0 float, 1 E8M0, 2 E4M3), OT (T, or float for split-K partial sums).
//
// DESIGN: a threadgroup of 128 threads (4 simdgroups) owns out[m_tile : +32, n_tile : +32]
//   and walks its part of K in steps of BK = 32. Per step, thread t stages row t / 4, columns
//   (t % 4) * 8 .. +8 of both operands into threadgroup memory (as S, see STAGING): 8 values
//   of x (zeros for rows past M) and one uint32 word of w (8 codes, decoded with mt_e2m1x2
//   -- integer bit placement, no table (common.h) -- and multiplied by the row's group
//   scale: each weight is dequantised once per threadgroup). Both are loaded into registers
//   before the first barrier of the step. Simdgroup s computes the 16x16 block (rows
//   16 (s / 2), columns 16 (s % 2)) as 2x2 simdgroup_float8x8 accumulators, 4 k-slices of
//   8 per step (B is loaded transposed: B[k][n] = ws[n][k]). The accumulators
//   go through threadgroup float memory (xs reused when it is float, else an array of their
//   own) so that the store to out can be guarded per row.
//   Split-K (as MLX's qmm_splitk) gives small-M problems enough threadgroups: the
//   wrapper targets about 512, in parts of whole 32-steps.
//
// STAGING (S = mt_fp4_staging<T, SCALE_MODE>: the fragments' element type): both tiles are
//   staged as S, which is T where every staged value is exactly a T value, else float; the
//   accumulators are float always (an S x S product is exact in float32: at most 11 + 11
//   significant bits, and the exponent range of float products is that of float staging),
//   so the result is bit for bit that of float staging on Apple.
//   x: a T value, exact in T.
//   wdq / 8 = e2m1 * scale / 8, e2m1 = c * 2^-1 with c in {0, 1, 2, 3, 4, 6, 8, 12} (at most
//   2 significant bits):
//   - E4M3 scale (nvfp4), half and bfloat: S = T. An E4M3 value is a 4-bit integer times
//     2^(e - 10) (normal, 1.mmm) or a 3-bit one times 2^-9 (subnormal), so the product is
//     an integer of at most 4 + 2 = 6 significant bits (15 * 3 = 45 the widest) times a
//     power of two; bfloat holds 8 significant bits, half 11. Range: |wdq / 8| lies in
//     [2^-9 * 2^-1 * 2^-3, 480 * 6 / 8] = [2^-13, 360], inside half's normal range
//     [2^-14, 65504] (and bfloat's). Exact.
//   - E8M0 scale (mxfp4), bfloat: S = T. c * 2^(s - 127 - 4) has 2 significant bits and an
//     exponent in [-131, 126]: bfloat has float32's exponent range, and its smallest
//     subnormal 2^-133 divides every such value (1.5 * 2^-130 is the finest); inf (s = 255)
//     stays inf. Exact (subnormals for bytes 1..3, as float staging: see RANGE).
//   - E8M0 scale, half: chosen per tile. c * 2^(s - 131) is a half value for every code
//     only for bytes s in 107 .. 143 (scales 2^-20 .. 2^16): below, 2^-24 (half's finest)
//     no longer divides it; above, 12 * 2^13 = 98304 > 65504 overflows. The bytes are data,
//     so before its K loop a threadgroup checks every scale byte of its 32 rows over its K
//     part (thread t: row t / 4, groups t % 4, t % 4 + 4, ...; simd_all, then the 4
//     SIMD-groups' verdicts through threadgroup memory): all in range, the tile stages in
//     half (TS, in the same threadgroup memory); any outside, in float (S). Either way the
//     result is the exact one (the products are exact and accumulate in float32 in the
//     same order), so a tile's choice never shows in the output; real mxfp4 checkpoints'
//     scales lie well inside 2^-20 .. 2^16.
//   - float scales: S = float. A float32 scale (24 significant bits) times c needs up to
//     26 bits, rounded once to float32 here: not a T value.
//   - float32 x: S = float.
//   Nothing is split into two T terms: the exact cases cover mxfp4 in bfloat and nvfp4, and
//   mxfp4 in half where the tile's scales allow it.
//   Apple: S = T halves the staging bytes and the fragment registers (what MLX's own Apple
//   qmm kernels stage, in T); the float accumulators' round trip then takes a float array
//   of its own (32 x 36 floats), so threadgroup memory is 9,216 bytes either way.
//   CUDA/NVIDIA: a product of two half or two bfloat fragments with a float accumulator
//   runs on the tensor cores (mt_cuda/matrix.cuh: mma.sync m16n8k8); S = float stays on
//   shuffles and FMAs (TF32 would break the tolerance table), so the float scales (and
//   mxfp4 with half x in a tile whose scales leave the range) lose the tensor cores on
//   NVIDIA rather than exactness. Before the per-tile choice, mxfp4 with half x ran at
//   about half of bfloat's speed on an H200 (bench, M 32 N 4096: 119 against 73 us).
//   Traffic (device loads, counted by the emulator): w ceil(M / 32) times, a scale once per
//   word (the 4 threads of a row load the same one for GS >= 32; half x with E8M0: once
//   more per tile, by the staging check), x N / 32 times (a
//   thread's 8 values through common.h's mt_load_live: one 16-byte access on cuda where x
//   is aligned), out once (parts times in float32 when split, then read once by the sum).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (128, 1, 1); grid = (128 * N / 32, ceil(M / 32), parts):
//   threadgroup_position_in_grid.x is the n tile, .y the m tile, .z the K part.
//   N % 32 == 0, K % 32 == 0, GS | K (checked): no column or K tail; 8 | GS, so the 8 codes
//   of a word share one scale. Kp is a multiple of 32 and parts = ceil(K / Kp): every part
//   has at least one 32-step and the last one ends at K (ragged parts: no step crosses K;
//   parts need not align with the groups, each word's scale is read with it).
//   Rows of x past M are not read (their pointer is clamped to row M - 1 and the value
//   replaced by 0) and rows of out past M are not written.
//   threadgroup memory: 2 x 32 x 36 S (+ 32 x 36 floats when S is not float) = 9216 bytes
//   (+ 4 for an unused 1-element array when S is float; + 16 (4 verdicts) for half x with
//   E8M0, 4 otherwise). Every thread reaches every barrier: the staging choice is uniform
//   per threadgroup (one barrier more, before the K loop, for half x with E8M0).
// ONLY CHECKABLE ON A MAC: simdgroup_load with transpose from a padded threadgroup float,
//   half or bfloat array, products of half / bfloat fragments into float accumulators,
//   the overloads of mt_fp4_out_tile, common.h's mt_sg_bmatrix (an alias template) and
//   mt_mma_pair, the compiler's register allocation for 4 accumulators,
//   that float -> bfloat conversion keeps the subnormal weights of E8M0 bytes 1..3 (as
//   the float staging needs float32 subnormals kept), that __METAL_VERSION__ >= 310 is
//   where MLX's bfloat16_t is Metal's bfloat (the guard of the bfloat staging), the float
//   tiles viewed as half through a threadgroup pointer cast, speed (both of half x's
//   stagings in one kernel: more code and registers, which only a Mac can weigh).
#include "common.h"

// The staging (fragment) type S: T where the staged weights are exactly T values (STAGING).
template <typename T, int SCALE_MODE>
struct mt_fp4_staging {
  typedef float type;
};
template <>
struct mt_fp4_staging<half, 2> {
  typedef half type;
};
// bfloat fragments need Metal's bfloat type (Metal 3.1, macOS 14); below it MLX's
// bfloat16_t is a struct that no simdgroup_matrix holds, and bfloat x stages float.
#if !defined(__METAL_VERSION__) || __METAL_VERSION__ >= 310
template <>
struct mt_fp4_staging<bfloat, 2> {
  typedef bfloat type;
};
template <>
struct mt_fp4_staging<bfloat, 1> {
  typedef bfloat type;
};
#endif
// The staging type of a tile whose scale bytes all lie in [MT_FP4_HALF_E8M0_MIN,
// MT_FP4_HALF_E8M0_MAX] (STAGING): half for half x with E8M0 scales, else S itself.
template <typename T, int SCALE_MODE>
struct mt_fp4_tile_staging {
  typedef typename mt_fp4_staging<T, SCALE_MODE>::type type;
};
template <>
struct mt_fp4_tile_staging<half, 1> {
  typedef half type;
};
#define MT_FP4_HALF_E8M0_MIN 107u
#define MT_FP4_HALF_E8M0_MAX 143u
// One step's operands into the staging tiles (as U): row lr, columns lc .. lc + 7; the
// weights as wdq / 8 (s: the row's group scale / 8).
template <typename U>
inline void mt_fp4_stage(threadgroup U* xs, threadgroup U* ws, thread const float* xv,
                         uint word, float s, uint at) {
  for (uint j = 0; j < 8; ++j) {
    xs[at + j] = U(xv[j]);  // exact: x is T
  }
  for (uint j = 0; j < 4; ++j) {
    const float2 v = float2(mt_e2m1x2(word >> (4 * j))) * s;
    ws[at + j] = U(v.x);  // exact where U is T (STAGING)
    ws[at + j + 4] = U(v.y);
  }
}
// The float accumulators' round trip: the x staging itself when it is float, else a float
// array of its own (overloads: no cast, valid for every S).
inline threadgroup float* mt_fp4_out_tile(threadgroup float* xs, threadgroup float*) {
  return xs;
}
template <typename U>
inline threadgroup float* mt_fp4_out_tile(threadgroup U*, threadgroup float* own) {
  return own;
}
// ---- kernel body ----
typedef typename mt_fp4_staging<T, SCALE_MODE>::type S;
typedef typename mt_fp4_tile_staging<T, SCALE_MODE>::type TS;
constexpr bool BY_RANGE = sizeof(TS) != sizeof(S);  // half x, E8M0: chosen per tile
constexpr uint BM = 32;
constexpr uint BN = 32;
constexpr uint BK = 32;
constexpr uint LD = BK + 4;  // padded row stride of the staging tiles (elements)
threadgroup S xs[BM * LD];
threadgroup S ws[BN * LD];
threadgroup float os_own[sizeof(S) == 4 ? 1 : BM * LD];
threadgroup float* os = mt_fp4_out_tile(xs, os_own);
threadgroup TS* xs_t = (threadgroup TS*)xs;  // the same memory as TS (BY_RANGE tiles)
threadgroup TS* ws_t = (threadgroup TS*)ws;
threadgroup uint in_range[BY_RANGE ? 4 : 1];  // per SIMD-group: its scale bytes allow TS

const uint M = m_rows;
const uint N = n_cols;
const uint K = k_cols;
const uint k_begin = threadgroup_position_in_grid.z * k_part;
const uint k_end = min(k_begin + k_part, K);  // the last part may be shorter
const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n_tile = threadgroup_position_in_grid.x * BN;
const uint m_tile = threadgroup_position_in_grid.y * BM;

// Staging role of this thread: row lr of both tiles, columns lc .. lc + 7.
const uint lr = tid / 4;
const uint lc = (tid % 4) * 8;
const bool x_row_ok = m_tile + lr < M;
const size_t x_off = size_t(min(m_tile + lr, M - 1)) * K + lc;
const size_t w_off = size_t(n_tile + lr) * (K / 8) + lc / 8;
const size_t s_off = size_t(n_tile + lr) * (K >> gs_shift);

// This simdgroup's 16x16 block of the tile.
const uint sm = (sg / 2) * 16;
const uint sn = (sg % 2) * 16;
simdgroup_float8x8 acc[2][2];
for (uint i = 0; i < 2; ++i) {
  for (uint j = 0; j < 2; ++j) {
    acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}

// BY_RANGE: this tile stages in TS when every scale byte of its 32 rows over its K part
// lies in the range (thread t checks row lr's groups t % 4, t % 4 + 4, ...); a uniform
// verdict for the whole threadgroup, so its branches below are uniform.
bool tile_in_t = false;
if (BY_RANGE) {
  bool ok = true;
  const uint g_end = ((k_end - 1) >> gs_shift) + 1;
  for (uint g = (k_begin >> gs_shift) + tid % 4; g < g_end; g += 4) {
    const uint b = uint(scales[s_off + g]);
    ok = ok && b >= MT_FP4_HALF_E8M0_MIN && b <= MT_FP4_HALF_E8M0_MAX;
  }
  const bool all_ok = simd_all(ok);
  if (simd_is_first()) {
    in_range[sg] = all_ok ? 1u : 0u;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile_in_t = (in_range[0] & in_range[1] & in_range[2] & in_range[3]) != 0u;
}

for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
  float xv[8];
  mt_load_live<8>(x + x_off + k0, x_row_ok, xv);
  const uint word = w[w_off + k0 / 8];
  const float s = 0.125f * mt_fp4_scale<SCALE_MODE>(scales[s_off + ((k0 + lc) >> gs_shift)]);

  threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous step's loads are done
  if (tile_in_t) {
    mt_fp4_stage(xs_t, ws_t, xv, word, s, lr * LD + lc);
  } else {
    mt_fp4_stage(xs, ws, xv, word, s, lr * LD + lc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint kk = 0; kk < BK; kk += 8) {
    if (tile_in_t) {
      simdgroup_matrix<TS, 8, 8> a[2];
      mt_sg_bmatrix<TS> b[2];
      for (uint i = 0; i < 2; ++i) {
        simdgroup_load(a[i], xs_t + (sm + 8 * i) * LD + kk, LD);
        mt_sg_load_b(b[i], ws_t + (sn + 8 * i) * LD + kk, LD, ulong2(0, 0), true);
      }
      for (uint j = 0; j < 2; ++j) {
        mt_mma_pair(acc[0][j], a[0], acc[1][j], a[1], b[j]);
      }
    } else {
      simdgroup_matrix<S, 8, 8> a[2];
      mt_sg_bmatrix<S> b[2];
      for (uint i = 0; i < 2; ++i) {
        simdgroup_load(a[i], xs + (sm + 8 * i) * LD + kk, LD);
        mt_sg_load_b(b[i], ws + (sn + 8 * i) * LD + kk, LD, ulong2(0, 0), true);
      }
      for (uint j = 0; j < 2; ++j) {
        mt_mma_pair(acc[0][j], a[0], acc[1][j], a[1], b[j]);
      }
    }
  }
}

threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading xs (os)
for (uint i = 0; i < 2; ++i) {
  for (uint j = 0; j < 2; ++j) {
    simdgroup_store(acc[i][j], os + (sm + 8 * i) * LD + sn + 8 * j, LD);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (x_row_ok) {
  const size_t o_off = (size_t(threadgroup_position_in_grid.z) * M + m_tile + lr) * N + n_tile + lc;
  for (uint j = 0; j < 8; ++j) {
    out[o_off + j] = OT(8.0f * os[lr * LD + lc + j]);  // undoes the staged wdq / 8
  }
}
