// moe_gather_qmm_simdgroup.metal: MoE grouped quantized matmul (affine 4/8-bit, mxfp4,
// nvfp4, mxfp8) over expert-sorted rows, 8x8 simdgroup_matrix products (every Apple GPU since M1).
//
// MATH (rows m in [0, M), output columns n in [0, N), float32 accumulation, rounded once):
//   e        = indices[m]                                  (the expert of row m)
//   W[n, k]  = T(scale[e, n, k / gs] * q[e, n, k] + bias[e, n, k / gs])
//              (the dequantised weight, rounded once to the activation dtype T, as MLX's
//               quantized kernels see it; q = the BITS-bit code, low bits first)
//              MODE 1 (mxfp4) / 2 (nvfp4): W[n, k] = T(mt_fp4_scale<MODE>(scale[e, n, k / gs])
//              * e2m1(q[e, n, k])), BITS 4, no bias (common.h's E8M0 / E4M3 / E2M1 decode)
//              MODE 3 (mxfp8): the same with E8M0 scales and E4M3 elements (common.h's E4M3
//              helper: 0x7F / 0xFF read as +-480 like MLX's Metal decoder), BITS 8
//   out[m,n] = T( sum_k float(x[m, k]) * float(W[n, k]) )  if e < E, else NaN
//
// LAYOUTS (row-contiguous; mx.quantize of a stacked [E, N, K] weight):
//   x [M, K] T; w [E, N, K * BITS / 32] uint32 (32 / BITS codes per word, low bits first);
//   scales, biases [E, N, K / GROUP_SIZE] T; indices [M] uint32 or int32 (a negative int32
//   reads as a huge uint and is out of range); out [M, N] T. fp modes: scales uint8 (E8M0,
//   group 32 / E4M3, group 16); biases is not read (the wrapper passes scales again).
//   n_rows (M), n_experts (E), n_cols (N), k_dim (K) are 0-d uint runtime inputs: changing
//   them never builds a new kernel. Template: T, BITS (4 or 8), GROUP_SIZE (32, 64, 128),
//   MODE 0 (affine); MODE 1: BITS 4, GROUP_SIZE 32; MODE 2: BITS 4, GROUP_SIZE 16;
//   MODE 3: BITS 8, GROUP_SIZE 32.
//   ADDRESS SPACES: MLX passes an input of fewer than 8 elements in the `constant` address
//   space, a different generated source: indices of M < 8 rows compile a second
//   instantiation next to the `device` one, once per process and (T, BITS, GROUP_SIZE,
//   index type). x, w, scales and biases always hold >= 32 elements (N, K multiples of
//   32). The body indexes `indices` directly, so both forms compile.
//
// TILING: the rows are cut into tiles of BM = 8 consecutive rows. Inside a tile the rows
//   that share an expert form a run (for sorted indices: a run of equal ids). Threadgroup
//   (bx, slot, tile) computes out[run rows, 32 bx : 32 bx + 32] for the run whose first row
//   in the tile is `slot`; the other slots of the tile exit at once (uniformly, before any
//   barrier). So each run reads and dequantises its expert's W tile once per K step, whatever
//   the number of runs in the tile, and x rows of other runs are never read.
//   The 4 simdgroups split K into 4 contiguous ranges of BK = 16 steps. Per step a
//   simdgroup stages x (8 x 16, rows outside the run zeroed) and W^T (16 x 32, lane l
//   dequantises output column 32 bx + l) in its own threadgroup slices, in T, then does
//   2 x 4 products 8x8x8 of T fragments into four float 8x8 accumulators (8 rows x 32
//   columns); the codes and x values of the next step are fetched into registers before
//   the products. The 4 partial accumulators are summed through threadgroup memory in
//   simdgroup order 0, 1, 2, 3 (a fixed reduction order) and the run's rows are written.
//   An out-of-range expert id (>= E) reads no weight: its slot writes NaN to its own row.
//
// STAGING IN T (exact): every staged value is a T value already -- x is T and each weight
//   is T(...) by the MATH above (as MLX's quantized kernels see it; the oracle rounds the
//   same way) -- so T fragments hold exactly what float fragments held, a product of two
//   T values is exact in float32 (half: 11 + 11 <= 24 significant bits; bfloat 8 + 8; the
//   exponent range of a float product equals that of the float fragments'), and the sums
//   stay in float accumulators: the result is bit for bit that of float staging. float32
//   inputs stage float, as before. No tolerance is involved: the affine weights are
//   rounded to T by the op's definition (not by the staging), so no bound has to absorb
//   a staging rounding, and the op's scale * q + bias stays one float32 fma, rounded once.
//   Apple: T staging halves the staging bytes and the fragment registers of half / bfloat
//   (what MLX's own Apple qmm kernels stage); the float partial sums then need a float
//   array of their own (sums, 4 x 8 x 36 floats), which float32 inputs do not (they reuse
//   ws, as before): 5,632 + 4,608 = 10,240 bytes for half / bfloat, 11,264 for float32.
//   CUDA/NVIDIA: a product of two half or two bfloat fragments with a float accumulator
//   runs on the tensor cores (mt_cuda/matrix.cuh: mma.sync m16n8k8); float32 inputs stay
//   on shuffles and FMAs (TF32 would break the tolerance table).
//   The body names the staging type S (T; mt_moe_staging): S = float is the former
//   float-staged kernel, the same result.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (128, 1, 1): 4 simdgroups of 32
//   grid        = (128 * N / 32, 8, ceil(M / 8)) threads: threadgroup_position_in_grid is
//                 (column block, slot, row tile)
//   N % 32 == 0, K % 32 == 0 (a multiple of BK and of GROUP_SIZE), GROUP_SIZE % 16 == 0
//   threadgroup memory: (4 x 8 x 16 + 4 x 16 x 36) T + (T not float) 4 x 8 x 36 floats:
//   10,240 bytes (half, bfloat) or 11,264 bytes (float32, + 4 for an unused sums[1])
//   indices are read only for rows < M; expert ids are checked against E before any access.
//
// TRAFFIC per call: for each (tile, distinct expert in the tile): N * K * BITS / 8 bytes of
//   codes and 2 * N * K / GROUP_SIZE scale/bias elements (fp modes: N * K / GROUP_SIZE
//   scale bytes, no bias) (a group cut by a K-split boundary
//   is loaded by both simdgroups: at most 3 extra per weight row). A lane's codes of one
//   step (BK codes of its own weight row: 8 bytes at 4 bits, 16 at 8) come through
//   common.h's mt_load_codes: one access on cuda where aligned (each row is a multiple of 16
//   bytes and a step's words start at a multiple of their size). x rows are read N / 32
//   times (once per column block; the other reads hit cache; a lane's 4 values per step
//   through common.h's mt_load_live: one 8- or 16-byte access on cuda where x is aligned);
//   out written once (M * N).
//   Each thread also reads its slot's id and the tile's <= 8 ids (36 bytes, cache hits);
//   the slots of a tile that lead no run exit after those reads.
//
// ONLY CHECKED ON A MAC: that Apple's compiler accepts this body as written (half /
//   bfloat / float simdgroup_matrix loads from threadgroup memory, products of half or
//   bfloat fragments into float accumulators, the overloads of mt_moe_sums,
//   make_filled_simdgroup_matrix), that __METAL_VERSION__ < 310 is where MLX's bfloat16_t
//   is not Metal's bfloat (the guard of mt_moe_staging), and its speed (the argument
//   above: fewer bytes, no more registers). The emulator checks the arithmetic, every
//   memory access and the barriers.
#include "common.h"

// Dequantise 16 consecutive codes of one weight row that lie in one quantisation group,
// rounding each weight once to T (two at a time: one vector conversion, which the CUDA
// layer issues as one instruction), stored as the staging type S (exact: S holds every T).
// `words` points at the first word. MODE 0: scale * q + bias; MODE 1, 2 (BITS 4):
// scale * e2m1(q); MODE 3 (BITS 8): scale * e4m3(q); the fp modes have no bias.
template <typename T, typename S, int MODE, int BITS, typename WordPtr>
inline void mt_moe_dequant16(WordPtr words, float scale, float bias, thread S* dst) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint MASK = (1u << BITS) - 1u;
  for (int j = 0; j < 16 / PER_WORD; ++j) {
    const uint word = words[j];
    if constexpr (MODE == 0) {
      for (int i = 0; i < PER_WORD; i += 2) {  // codes i and i + 1
        const float q0 = float((word >> (BITS * i)) & MASK);
        const float q1 = float((word >> (BITS * (i + 1))) & MASK);
        const float2 p = mt_round2<T>(float2(metal::fma(scale, q0, bias),
                                             metal::fma(scale, q1, bias)));
        dst[j * PER_WORD + i] = S(p.x);
        dst[j * PER_WORD + i + 1] = S(p.y);
      }
    } else if constexpr (MODE == 3) {
      for (int i = 0; i < 4; i += 2) {
        const float2 p = mt_round2<T>(float2(scale * mt_fp4_scale<2>(word >> (8 * i)),
                                             scale * mt_fp4_scale<2>(word >> (8 * (i + 1)))));
        dst[j * 4 + i] = S(p.x);
        dst[j * 4 + i + 1] = S(p.y);
      }
    } else {
      for (int i = 0; i < 4; ++i) {  // codes i and i + 4 of the word at once
        const float2 p = mt_round2<T>(scale * float2(mt_e2m1x2(word >> (4 * i))));
        dst[j * 8 + i] = S(p.x);
        dst[j * 8 + i + 4] = S(p.y);
      }
    }
  }
}

// The staging and fragment type S: T (STAGING IN T). bfloat fragments need Metal's bfloat
// type (Metal 3.1, macOS 14); below it MLX's bfloat16_t is a struct that no
// simdgroup_matrix holds, and bfloat x stages float (the same result).
template <typename T>
struct mt_moe_staging {
  typedef T type;
};
#if defined(__METAL_VERSION__) && __METAL_VERSION__ < 310
template <>
struct mt_moe_staging<bfloat16_t> {
  typedef float type;
};
#endif

// Where the float partial sums go: the W staging itself when it is float (S = float),
// else their own float array (overloads: no cast, valid for every S).
inline threadgroup float* mt_moe_sums(threadgroup float* ws, threadgroup float*) { return ws; }
template <typename U>
inline threadgroup float* mt_moe_sums(threadgroup U*, threadgroup float* own) { return own; }
// ---- kernel body ----
constexpr uint SG = 4;           // simdgroups per threadgroup (K split)
constexpr uint BM = 8;           // rows per tile
constexpr uint BN = 32;          // output columns per threadgroup
constexpr uint BK = 16;          // K step of a simdgroup
constexpr uint WS_LD = BN + 4;   // padded row length of the staged W^T block
constexpr uint PER_WORD = 32 / BITS;
constexpr int SCALE_FORMAT = MODE == 3 ? 1 : MODE;  // mt_fp4_scale's: mxfp8 scales are E8M0
typedef typename mt_moe_staging<T>::type S;
threadgroup S xs[SG][BM * BK];
threadgroup S ws[SG][BK * WS_LD];
// The float partial sums of the K split: ws itself when S is float, else their own array.
constexpr uint SUMS_LD = sizeof(S) == 4 ? BK * WS_LD : BM * WS_LD;  // one simdgroup's
threadgroup float sums_own[sizeof(S) == 4 ? 1 : SG * BM * WS_LD];

const uint n_block = threadgroup_position_in_grid.x;
const uint slot = threadgroup_position_in_grid.y;
const uint row0 = threadgroup_position_in_grid.z * BM;
const uint M = n_rows;
const uint E = n_experts;
const uint N = n_cols;
const uint K = k_dim;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n0 = n_block * BN;

const uint rows_here = min(BM, M - row0);
if (slot >= rows_here) {
  return;
}
const uint e = uint(indices[row0 + slot]);
if (e >= E) {
  // Out-of-range expert: NaN for this row, no weight read.
  if (tid < BN) {
    out[size_t(row0 + slot) * N + n0 + tid] = T(NAN);
  }
  return;
}
uint run = 0;          // bit r: row r of the tile belongs to this run
bool leader = true;    // slot is the first row of the tile with expert e
for (uint r = 0; r < rows_here; ++r) {
  const bool same = uint(indices[row0 + r]) == e;
  run |= same ? (1u << r) : 0u;
  leader = leader && !(same && r < slot);
}
if (!leader) {
  return;
}

// This lane's weight row (output column n0 + lane of expert e).
const size_t w_row = size_t(e) * N + n0 + lane;
const auto w_words = w + w_row * (K / PER_WORD);
const auto w_scales = scales + w_row * (K / GROUP_SIZE);
const auto w_biases = biases + w_row * (K / GROUP_SIZE);
// This lane's x slice: row xr of the tile, 4 values from xk.
const uint xr = lane / 4;
const uint xk = (lane % 4) * 4;
const bool x_live = ((run >> xr) & 1u) != 0u;
const auto x_row = x + size_t(row0 + (x_live ? xr : 0u)) * K + xk;

threadgroup S* my_x = xs[sg];
threadgroup S* my_w = ws[sg];
threadgroup float* sums = mt_moe_sums(&ws[0][0], sums_own);
simdgroup_matrix<float, 8, 8> acc[BN / 8];
for (uint j = 0; j < BN / 8; ++j) {
  acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

const uint n_steps = K / BK;
const uint step_begin = (n_steps * sg) / SG;
const uint step_end = (n_steps * (sg + 1)) / SG;
constexpr uint WORDS = BK / PER_WORD;  // packed words of one row per step
uint group = 0xFFFFFFFFu;  // the quantisation group whose scale and bias are loaded
float scale = 0.0f;
float bias = 0.0f;
uint wq[WORDS];  // the fetched step: this lane's codes and x values
float xq[4];
if (step_begin < step_end) {
  mt_load_codes<WORDS>(w_words + step_begin * WORDS, wq);
  mt_load_live<4>(x_row + step_begin * BK, x_live, xq);
}
for (uint step = step_begin; step < step_end; ++step) {
  const uint k0 = step * BK;
  if (k0 / GROUP_SIZE != group) {
    group = k0 / GROUP_SIZE;
    scale = mt_fp4_scale<SCALE_FORMAT>(w_scales[group]);  // 0: float(scale)
    if constexpr (MODE == 0) {
      bias = float(w_biases[group]);
    }
  }
  for (uint i = 0; i < 4; ++i) {
    my_x[xr * BK + xk + i] = S(xq[i]);  // exact: x is T
  }
  S wv[BK];
  mt_moe_dequant16<T, S, MODE, BITS>(wq, scale, bias, wv);
  for (uint i = 0; i < BK; ++i) {
    my_w[i * WS_LD + lane] = wv[i];
  }
  // Fetch the next step while this one is multiplied.
  if (step + 1 < step_end) {
    mt_load_codes<WORDS>(w_words + (step + 1) * WORDS, wq);
    mt_load_live<4>(x_row + (step + 1) * BK, x_live, xq);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint kk = 0; kk < BK; kk += 8) {
    simdgroup_matrix<S, 8, 8> a;
    simdgroup_load(a, my_x + kk, BK);
    for (uint j = 0; j < BN / 8; ++j) {
      simdgroup_matrix<S, 8, 8> b;
      simdgroup_load(b, my_w + kk * WS_LD + j * 8, WS_LD);
      simdgroup_multiply_accumulate(acc[j], a, b, acc[j]);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
}

// Partial sums of the 4 simdgroups -> rows 0..7 of each simdgroup's own slice of sums
// (float32: its own W slice, as before), then summed.
for (uint j = 0; j < BN / 8; ++j) {
  simdgroup_store(acc[j], sums + sg * SUMS_LD + j * 8, WS_LD);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint o = tid; o < BM * BN; o += SG * 32) {
  const uint r = o / BN;
  const uint c = o % BN;
  if (((run >> r) & 1u) != 0u) {
    float v = 0.0f;
    for (uint s = 0; s < SG; ++s) {
      v += sums[s * SUMS_LD + r * WS_LD + c];
    }
    out[size_t(row0 + r) * N + n0 + c] = T(v);
  }
}
