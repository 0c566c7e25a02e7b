// fp4_qmm_skinny.metal: fp4 (E2M1) quantized matmul for a few rows of x (up to 32 per
// threadgroup), on 8x8 simdgroup_matrix products of half / bfloat fragments, w streamed
// once per block of rows of x with no threadgroup barrier in the K loop.
//
// MATH (float32 accumulation, rounded once to T):
//   out[m, n] = sum over the 32-wide K steps u of  c(n, u) * sum_{k in step u} x[m, k] a(n, k)
//   e2m1(n, k) = code (w[n, k / 8] >> 4 (k % 8)) & 0xF  -> {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}
//   E8M0 and float scales (group size GS >= 32: a step lies in one group g = 32 u / GS):
//     a = e2m1 (exact in half and bfloat), c(n, u) = scale(n, g) (mt_fp4_scale, common.h)
//   E4M3 scales (nvfp4, GS 16): a = e2m1 * scale(n, k / 16), exact in half and bfloat (at
//     most 2 + 4 significant bits; |a| in [2^-10, 2880], normal in both), c = 1.
//   Each product x * a is of two T values (exact in float32); the fragment products sum a
//   step's terms in float32, then c scales the step's sum once (as fp4_qmm_qmv.metal
//   applies a group's scale to a lane's partial sum).
//   REDUCTION ORDER (fixed for given shapes and launch plan): SIMD-group s of the S K slices
//   takes the steps [s * steps / S, (s + 1) * steps / S), in increasing order; within a
//   step, K fragments a = 0..3 in order (the order inside one product is the hardware's);
//   the S slice sums are added in order s = 0, 1, .. by one thread per output.
//
// LAYOUT (row-contiguous): x [M, K] T; w [N, K / 8] uint32 (code j of a word at bits
//   [4j, 4j + 4)); scales [N, K / GS] ST; out [M, N] T. m_rows, n_cols, k_cols, gs_shift:
//   0-d uint32 runtime inputs (M, N, K, log2 GS).
// TEMPLATE: T (half or bfloat), ST (uint8, or float: the wrapper passes float16 / bfloat16
//   scales as float32), SCALE_MODE (0 float with GS >= 32, 1 E8M0, 2 E4M3), MF (8-row
//   fragments of x per threadgroup: 1, 2 or 4; XR = 8 MF rows). S is read from
//   simdgroups_per_threadgroup.
//
// DESIGN: a threadgroup owns 32 rows of w (n0 .. n0 + 31) and XR rows of x; its S SIMD-groups
//   split K (REDUCTION ORDER). Lane l holds fragment row fm = mt_frag_row(l) and columns
//   fn, fn + 1 (fn = mt_frag_col(l), q = fn / 2) of every 8x8 fragment (common.h). Per step
//   it loads word 4 u + q of the rows n0 + 8 i + fm (i = 0..3): the 4 lanes of a fragment
//   row read the step's 4 consecutive words of their row of w (16 bytes), and the lane's
//   column pair of K fragment a (a = 0..3) is its codes a and a + 4 (mt_e2m1x2(word >> 4 a):
//   no data moves between lanes, no weight goes through threadgroup memory). So column c of
//   K fragment a is k = 32 u + 8 (c / 2) + a + 4 (c % 2) (PERMUTATION). The SIMD-group stages
//   its XR x 32 values of x for the step in that order in its own tile (xs[m][8 a + c]), and
//   reads x's fragments back transposed as the B side (mt_sg_load4); one K permutation on
//   both operands leaves every product and the set of terms of each sum unchanged.
//   Products: per K fragment a, the w fragments of rows 0-7 and 8-15 (16-23 and 24-31) share
//   x's B fragment (mt_mma_pair: one m16n8k8 of 16 rows on CUDA, none wasted). E8M0 / float:
//   the step's products go to zeroed sums d, then acc += c * d per element (the lane's row
//   is one row of w: its scale). E4M3: straight into acc.
//   Loads in flight: each step's 4 words (and scales) are loaded two steps ahead of their
//   products; x's values a and a + 4 of a unit (adjacent columns) go out in one 4-byte
//   store. Combine: each SIMD-group stores its accumulators ([s][n][m] floats); after one
//   barrier, thread t adds the S slices of outputs t, t + 32 S, ...
//   Why for NVIDIA: the GEMV-shaped kernel (fp4_qmm_qmv.metal) spends 2 conversions and an
//   FMA per code and row of x on the CUDA cores at M = 5..8; here the tensor cores take the
//   products (8 MF mma per 32-wide step of 32 rows) and the CUDA cores decode each code once.
//   Traffic (device loads, counted by the emulator): w and scales once per block of XR rows
//   of x (once in total for M <= XR: N K / 2 bytes of w); a scale per row and step (E4M3:
//   per word) by each of the 4 lanes of a fragment row (one line, from cache); x once per
//   threadgroup (N / 32 times in all, from cache), 8 values per mt_load_live; out once.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 S, 1, 1), S in [1, MAX_SLICES = 8];
//   grid = (32 S, N / 32, ceil(M / XR)): threadgroup_position_in_grid.y is the block of 32
//   rows of w, .z the block of XR rows of x.
//   N % 32 == 0 and K % 32 == 0 (checked): no row or K tail. GS divides K, GS >= 32 for E8M0
//   and float scales (a step in one group; the wrapper refuses float scales of group 16),
//   GS = 16 for E4M3 (a word in one group). A K slice may hold no step (S > steps): its sums
//   are 0. Rows of x past M are staged as zeros (not read) and their outputs not written.
//   No thread returns early: every thread reaches the combine's barrier.
//   Threadgroup memory: a region of 32 x XR floats per K slice (MAX_SLICES of them: 8 KiB
//   per MF), its x tile (XR x XS T) in the loop and its sums after. Regions of 128 XR bytes,
//   tile rows of XS = 40 T (80 bytes) and fragment offsets of 8 T: the 16-byte alignment
//   mt_sg_load4 promises.
//
// LAUNCH PLAN (ops/fp4_qmm.py, _skinny_rows and _skinny_slices): MF = 1 up to 8 rows of x,
//   else 2 (SKINNY_MAX_MF: blocks of 16 rows); S = min(MAX_SLICES, steps, ceil(4096 / the
//   grid's threadgroups)), lowered to deal the steps evenly (16 slices, in regions of 32 KiB
//   at MF 2, measured no faster on an H200: M 8 bfloat16 23.1-23.3 us at 8, 24.5-25.9 at 16).
//   Auto on cuda only (SKINNY_M, 2 to 32 rows of half / bfloat x): on Metal the tile
//   kernels keep these rows until a Mac measures this one.
//   Registers per thread (nvcc sm_90 --resource-usage, every scale format, no spills): MF 1
//   72-76, MF 2 90-102, MF 4 133-140 (MF 4 only where SKINNY_MAX_MF allows it).
//
// ONLY CHECKABLE ON A MAC: that Apple's compiler accepts the fragments written through
//   thread_elements() as the A side of products with transposed B fragments from
//   threadgroup memory, the float regions viewed as T through a threadgroup pointer cast,
//   the 4-byte vec<T, 2> stores into them, common.h's mt_sg_load4 and mt_mma_pair on these
//   types; registers and speed (whether it beats the tile kernels there at 2 to 32 rows).
#include "common.h"

// Step u's word of each of a lane's 4 rows of w (wr: its row n0 + fm at its word q; the rows
// 8 apart) and the scale that goes with it (sr: that row's scales): E8M0 / float, the step's
// group; E4M3, the group of the lane's word.
template <int SCALE_MODE, typename WP, typename SP>
inline void mt_skinny_fetch(WP wr, SP sr, uint k_words, uint k_groups, uint gs_shift, uint q,
                            uint u, thread uint* wq, thread float* sq) {
  const uint g = SCALE_MODE != 2 ? ((32u * u) >> gs_shift) : ((32u * u + 8u * q) >> gs_shift);
  for (uint i = 0; i < 4; ++i) {
    wq[i] = wr[size_t(8 * i) * k_words + 4u * u];
    sq[i] = mt_fp4_scale<SCALE_MODE>(sr[size_t(8 * i) * k_groups + g]);
  }
}
// ---- kernel body ----
constexpr uint XR = 8 * MF;                  // rows of x per threadgroup
constexpr uint XS = 40;                      // a staged row of x: 32 values + 8 padding
constexpr uint MAX_SLICES = 8;
constexpr uint REGION = 32 * XR;             // floats of one K slice's region
constexpr bool STEP_SCALED = SCALE_MODE != 2;  // c(n, u) scales the step's sums
static_assert(XS * sizeof(T) % 16 == 0, "mt_sg_load4 reads 16-byte aligned rows");
static_assert(XR * XS * sizeof(T) <= REGION * sizeof(float), "the x tile fits its region");

// K slice s's region: its x tile during the K loop, then its sums (its own bytes only).
threadgroup float regions[MAX_SLICES * REGION];

const uint M = m_rows;
const uint N = n_cols;
const uint K = k_cols;
const uint lane = thread_index_in_simdgroup;
const uint slices = simdgroups_per_threadgroup;
const uint slice = simdgroup_index_in_threadgroup;
const uint n0 = threadgroup_position_in_grid.y * 32u;
const uint m0 = threadgroup_position_in_grid.z * XR;
const uint k_words = K / 8u;
const uint k_groups = K >> gs_shift;
const uint steps = K / 32u;
const uint u_begin = steps * slice / slices;
const uint u_end = steps * (slice + 1u) / slices;
const uint fm = mt_frag_row(lane);
const uint q = mt_frag_col(lane) / 2u;
// This lane's rows of w: n0 + 8 i + fm, i = 0..3.
const auto w_row = w + size_t(n0 + fm) * k_words + q;
const auto s_row = scales + size_t(n0 + fm) * k_groups;

simdgroup_matrix<float, 8, 8> acc[4][MF];
for (uint i = 0; i < 4; ++i) {
  for (uint f = 0; f < MF; ++f) {
    acc[i][f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}

// The words and scales of the next two steps, loaded two steps ahead of their products.
uint wq[2][4];
float sq[2][4];
for (uint h = 0; h < 2; ++h) {
  if (u_begin + h < u_end) {
    mt_skinny_fetch<SCALE_MODE>(w_row, s_row, k_words, k_groups, gs_shift, q, u_begin + h,
                                wq[h], sq[h]);
  }
}
threadgroup float* mine = regions + slice * REGION;
threadgroup T* xt = reinterpret_cast<threadgroup T*>(mine);
for (uint u = u_begin; u < u_end; ++u) {
  uint wc[4];
  float sc[4];
  for (uint i = 0; i < 4; ++i) {
    wc[i] = wq[0][i];
    sc[i] = sq[0][i];
    wq[0][i] = wq[1][i];
    sq[0][i] = sq[1][i];
  }
  if (u + 2u < u_end) {  // the loads two steps ahead, in flight during this one
    mt_skinny_fetch<SCALE_MODE>(w_row, s_row, k_words, k_groups, gs_shift, q, u + 2u,
                                wq[1], sq[1]);
  }
  // x's XR x 32 values of the step, in PERMUTATION order: lane l takes units l + 32 j
  // (row t / 4, values 8 (t % 4) .. + 8 of the step).
  for (uint j = 0; j < MF; ++j) {
    const uint t = lane + 32u * j;
    const uint m = t / 4u;
    const uint i = t % 4u;
    const bool live = m0 + m < M;
    float v[8];
    mt_load_live<8>(x + size_t(live ? m0 + m : 0u) * K + 32u * u + 8u * i, live, v);
    for (uint a = 0; a < 4; ++a) {  // values a and a + 4: columns 2 i, 2 i + 1 of fragment a
      *reinterpret_cast<threadgroup vec<T, 2>*>(xt + m * XS + 8u * a + 2u * i) =
          vec<T, 2>(T(v[a]), T(v[a + 4]));  // exact: x is T
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  mt_sg_bmatrix<T> xb[MF][4];
  for (uint f = 0; f < MF; ++f) {
    mt_sg_load4(xb[f], xt + f * 8u * XS, XS, 8u, true);
  }
  simdgroup_matrix<float, 8, 8> d[4][MF];
  for (uint i = 0; i < 4; ++i) {
    for (uint f = 0; f < MF; ++f) {
      d[i][f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  for (uint a = 0; a < 4; ++a) {
    simdgroup_matrix<T, 8, 8> wa[4];
    for (uint i = 0; i < 4; ++i) {
      float2 v = float2(mt_e2m1x2(wc[i] >> (4u * a)));
      if constexpr (!STEP_SCALED) {
        v *= sc[i];  // exact in T (MATH)
      }
      wa[i].thread_elements()[0] = T(v.x);
      wa[i].thread_elements()[1] = T(v.y);
    }
    for (uint f = 0; f < MF; ++f) {
      if constexpr (STEP_SCALED) {
        mt_mma_pair(d[0][f], wa[0], d[1][f], wa[1], xb[f][a]);
        mt_mma_pair(d[2][f], wa[2], d[3][f], wa[3], xb[f][a]);
      } else {
        mt_mma_pair(acc[0][f], wa[0], acc[1][f], wa[1], xb[f][a]);
        mt_mma_pair(acc[2][f], wa[2], acc[3][f], wa[3], xb[f][a]);
      }
    }
  }
  if constexpr (STEP_SCALED) {
    for (uint i = 0; i < 4; ++i) {
      for (uint f = 0; f < MF; ++f) {
        acc[i][f].thread_elements()[0] += sc[i] * d[i][f].thread_elements()[0];
        acc[i][f].thread_elements()[1] += sc[i] * d[i][f].thread_elements()[1];
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // the tile is read before it is restaged
}

// The S slices' sums, [s][n][m], over their own x tiles (the loop's last simdgroup_barrier
// ordered the tile's reads before these stores), added in slice order.
for (uint i = 0; i < 4; ++i) {
  for (uint f = 0; f < MF; ++f) {
    simdgroup_store(acc[i][f], mine + 8u * i * XR + 8u * f, XR);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint o = thread_position_in_threadgroup.x; o < 32u * XR; o += 32u * slices) {
  const uint m = o / 32u;
  const uint r = o % 32u;
  if (m0 + m < M) {
    float total = 0.0f;
    for (uint s = 0; s < slices; ++s) {
      total += regions[s * REGION + r * XR + m];
    }
    out[size_t(m0 + m) * N + n0 + r] = T(total);
  }
}
