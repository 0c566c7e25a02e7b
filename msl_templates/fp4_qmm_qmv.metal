// fp4_qmm_qmv.metal: fp4 (E2M1) quantized matmul for small M (decode), shaped like a GEMV.
//
// MATH (float32 accumulation, rounded once to T):
//   out[m, n] = sum_g scale(n, g) * sum_{k in group g} float(x[m, k]) * e2m1(w, n, k)
//   e2m1(w, n, k) = code (w[n, k / 8] >> 4 (k % 8)) & 0xF  -> {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}
//   scale(n, g)   = mt_fp4_scale<SCALE_MODE>(scales[n, g])  (E8M0, E4M3 or a float; common.h)
//   REDUCTION ORDER (fixed for given shapes and launch plan: bitwise reproducible run to run):
//   K is walked in steps of STEP = 32 VPT values; the steps are dealt to the S K slices of a
//   row block, slice g taking steps g, g + S, ... (S = 1: every step). Lane l of slice g
//   accumulates its VPT values of each of its steps in increasing order (per word: codes j
//   and j + 4 together, j = 0..3, the group's scale applied once per VPT codes); the 32 lane
//   partials are combined by simd_sum (hardware order). S = 1: that is the output. S > 1:
//   the S slice sums are added in order g = 0, 1, ..., S - 1 (through threadgroup memory)
//   by slice 0. Both forms (WFIRST 0 / 1) add the same terms in this order (they differ in
//   which operand a lane holds), so at the same MB and S their results are equal bit for
//   bit (tested on the emulator).
//
// LAYOUT (row-contiguous): x [M, K] T; w [N, K / 8] uint32 (8 codes per word, code j at bits
//   [4j, 4j + 4)); scales [N, K / GS] ST; out [M, N] T. m_rows, n_cols, k_cols, gs_shift:
//   0-d uint32 runtime inputs (M, N, K, log2 GS), so a decode loop at any M never builds a
//   new kernel, and the group size (16, 32, 64 or 128) is not a template argument either.
// TEMPLATE: T (x / out dtype), ST (scale dtype: uint8 or float; the wrapper passes float16 /
//   bfloat16 scales as float32), SCALE_MODE (0 float, 1 E8M0, 2 E4M3), MB (rows of x per
//   threadgroup: 1, 2, 4 or 8), WFIRST (0 held x, 1 w-first: DESIGN; 1 is built at MB 8
//   only, as its own kernel fp4_qmm_qmv_wfirst, the one with cuda launch bounds). S (K
//   slices) is read from simdgroups_per_threadgroup, not a template argument: every plan
//   runs on the same 5 builds per (T, ST, SCALE_MODE) (a template S would build one kernel
//   per value, up to 8 times as many), and S only sets a loop stride and whether the
//   combine runs, both uniform.
//
// DESIGN: each simdgroup owns ROWS = 4 output columns n (rows of w), MB rows of x and the K
//   steps of its K slice; its 32 lanes split a step: a lane takes VPT consecutive k (VPT = 16
//   for MB <= 2, else 8, so the x values held in registers stay at <= 64 floats), i.e. VPT / 8
//   uint32 words per row of w, 8 bytes (MB <= 2) or 4 bytes per lane per row, contiguous
//   across the simdgroup.
//   Held x (WFIRST 0): the lane's x chunk (MB x VPT) is loaded once per step and reused for
//   the 4 rows of w; the codes are decoded two at a time (mt_e2m1x2: integer bit placement,
//   no table), dotted with x in float32, and the group's scale is applied once per VPT codes.
//   w-first (WFIRST 1): the step's 4 words (VPT 8) are loaded and decoded once into 16 half2
//   (exact: E2M1 values are halves) and the 4 scales read; then the MB rows of x are loaded
//   one at a time (VPT floats) and dotted with the 4 rows (half2 -> float2 per use). A lane
//   holds 16 + 4 + 8 registers of operands instead of 64 floats of x at MB 8, so MB 8 fits
//   the launch bounds (80 registers, no spills) and w is read once for M = 5..8; the price:
//   2 half -> float conversions per code and row of x (held x: one per code). Both forms:
//   simd_sum reduces over lanes; S = 1: lane 0 writes the MB x 4 outputs; S > 1: lane 0 of
//   each K slice stores its MB x 4 sums in threadgroup memory and, after one barrier, lane
//   (m, r) = (l / 4, l % 4) of K slice 0 adds the S of output (m, r) in slice order and
//   writes it.
//   Traffic (device loads, counted by the emulator): w once per block of MB rows of x (once
//   in total for M <= MB: N K / 2 bytes), whatever S and form; a scale once per VPT codes
//   (GS / VPT lanes load the same one: 2x the ideal N K / GS for GS 32 and VPT 16); x once
//   per simdgroup's steps (N / 4 times in all, from cache), 8 values per common.h mt_load8
//   (on cuda one 16-byte access where x is aligned: M1 N K 4096 bfloat16 15.1 -> 12.3 us of
//   kernel time on an H200); out once.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes and the backend):
//   threadgroup = (64 S, 1, 1): SIMD-group i is row block i % 2 of K slice i / 2,
//   S in [1, MAX_SLICES]; grid = (64 S, N / 8, ceil(M / MB))
//   N % 32 == 0 and K % 32 == 0 (checked), so N % 8 == 0: every (threadgroup, row block)
//   owns 4 valid rows of w (no thread returns early: all reach the combine's barrier) and
//   VPT divides K (no partial words, no column guard needed; the last step may be partial:
//   its lanes past K skip it). A K slice may hold no step (S > steps, only when forced):
//   its sums are 0.
//   GS divides K; VPT <= 16 <= GS, so a lane's VPT codes share one scale.
//   WFIRST 1: MB = 8 and 64 S <= 256 (its cuda launch bounds (256, 3): S <= 4).
//   Rows of x past M (ragged last M-block) are never read (uniform branch) nor written.
//   Threadgroup memory: MAX_SLICES * 2 * MB * 4 floats (256 MB bytes), used only when
//   S > 1; one barrier then, none at S = 1.
//
// LAUNCH PLANS (ops/fp4_qmm.py's _qmv_rows, _qmv_slices): Metal and the emulator: S = 1
//   and MB = next power of two >= min(M, 8): the plan as measured before (2 SIMD-groups x 4
//   rows, 64 threads, as MLX's own Metal qmv), no barrier. Whether S > 1 pays on Apple GPUs
//   is for a Mac to measure, so it is unchanged; its only cost there is the declared
//   partials array (256 B at MB = 1, 2 KB at MB = 8).
//   cuda: MB = next power of two >= min(M, 8) as well, MB 8 in the w-first form: M = 5..8
//   read w once (held x, cuda's plan before: MB <= 4, two blocks of rows at M = 5..8, w
//   read twice). Registers a thread (ptxas, sm_90, any T and scale format): held x MB 1..4
//   <= 80; held x MB 8 168 for 16-bit T (128 for float32), i.e. 12 warps an SM, and 400+
//   bytes of spills if capped at 85; w-first MB 8 117 unbounded, 80 (79 for float32 E8M0)
//   under its launch bounds (256, 3) with no spills: 24 warps an SM at S = 2 or 4.
//   S = min(steps of K, 8, ceil(4096 / warps)) lowered to deal the steps evenly (at most 4
//   at MB 8: the launch bounds' 256 threads). At N = K = 4096 one row of x runs 4096 warps
//   of 2 steps (S = 4) instead of 1024 warps of 8; M = 8, 4096 warps of 4 steps of MB 8
//   (S = 4) instead of 1024 of 16; N = 14336: S = 2 at every M <= 8.
//   ops/fp4_qmm.py's QMV_CUDA_MAX_MB (4: the plan before) and QMV_WFIRST (forces the form
//   at MB 8 on every backend) select the plan; clear_plans() makes a change take effect.
//
// ONLY CHECKABLE ON A MAC: that Metal accepts as_type<half2>(uint) and keeps half
//   subnormals in mt_e2m1x2 (MLX's own fp4 decoder relies on the same); speed.
#include "common.h"
// ---- kernel body ----
constexpr uint SIMDGROUPS = 2;
constexpr uint ROWS = 4;
constexpr uint VPT = MB <= 2 ? 16 : 8;
constexpr uint WPT = VPT / 8;
constexpr uint STEP = 32 * VPT;
constexpr uint MAX_SLICES = 8;  // SIMD-groups sharing one row block's K steps, at most

// Per (K slice, row block, row of x, row of w): a K slice's sum (S > 1 only).
threadgroup float partials[MAX_SLICES * SIMDGROUPS * MB * ROWS];

const uint M = m_rows;
const uint N = n_cols;
const uint K = k_cols;
const uint lane = thread_index_in_simdgroup;
const uint slices = simdgroups_per_threadgroup / SIMDGROUPS;  // the launch plan's S
const uint row_block = simdgroup_index_in_threadgroup % SIMDGROUPS;
const uint slice = simdgroup_index_in_threadgroup / SIMDGROUPS;
const uint n0 = (threadgroup_position_in_grid.y * SIMDGROUPS + row_block) * ROWS;
const uint m0 = threadgroup_position_in_grid.z * MB;
const uint k_words = K / 8;
const uint k_groups = K >> gs_shift;

float acc[MB][ROWS];
for (uint m = 0; m < MB; ++m) {
  for (uint r = 0; r < ROWS; ++r) {
    acc[m][r] = 0.0f;
  }
}

// K slice g takes the steps g, g + S, ...; a lane past K in the last step skips it.
for (uint k = slice * STEP + lane * VPT; k < K; k += slices * STEP) {
  if constexpr (WFIRST) {
    // w-first (DESIGN): the 4 rows' VPT codes decoded once and held as half2 (exact), then
    // the MB rows of x one at a time, each dotted with the 4 rows.
    half2 wv[ROWS][VPT / 2];
    float sr[ROWS];
    for (uint r = 0; r < ROWS; ++r) {
      const uint n = n0 + r;
      const size_t wo = size_t(n) * k_words + k / 8;
      sr[r] = mt_fp4_scale<SCALE_MODE>(scales[size_t(n) * k_groups + (k >> gs_shift)]);
      for (uint q = 0; q < WPT; ++q) {
        const uint word = w[wo + q];
        for (uint j = 0; j < 4; ++j) {
          wv[r][4 * q + j] = mt_e2m1x2(word >> (4 * j));
        }
      }
    }
    for (uint m = 0; m < MB; ++m) {
      if (m0 + m < M) {  // uniform
        const size_t xo = size_t(m0 + m) * K + k;
        float xm[VPT];
        for (uint j = 0; j < VPT; j += 8) {
          mt_load8(x + xo + j, xm + j);
        }
        for (uint r = 0; r < ROWS; ++r) {
          float part = 0.0f;  // the held-x form's terms in its order
          for (uint q = 0; q < WPT; ++q) {
            for (uint j = 0; j < 4; ++j) {
              const float2 v = float2(wv[r][4 * q + j]);
              part += xm[8 * q + j] * v.x + xm[8 * q + j + 4] * v.y;
            }
          }
          acc[m][r] += sr[r] * part;
        }
      }
    }
  } else {
    float xr[MB][VPT];
    for (uint m = 0; m < MB; ++m) {
      if (m0 + m < M) {
        const size_t xo = size_t(m0 + m) * K + k;
        for (uint j = 0; j < VPT; j += 8) {
          mt_load8(x + xo + j, xr[m] + j);
        }
      } else {
        for (uint j = 0; j < VPT; ++j) {
          xr[m][j] = 0.0f;
        }
      }
    }
    for (uint r = 0; r < ROWS; ++r) {
      const uint n = n0 + r;
      const size_t wo = size_t(n) * k_words + k / 8;
      const float s = mt_fp4_scale<SCALE_MODE>(scales[size_t(n) * k_groups + (k >> gs_shift)]);
      float part[MB];
      for (uint m = 0; m < MB; ++m) {
        part[m] = 0.0f;
      }
      for (uint q = 0; q < WPT; ++q) {
        const uint word = w[wo + q];
        for (uint j = 0; j < 4; ++j) {
          const float2 v = float2(mt_e2m1x2(word >> (4 * j)));
          for (uint m = 0; m < MB; ++m) {
            part[m] += xr[m][8 * q + j] * v.x + xr[m][8 * q + j + 4] * v.y;
          }
        }
      }
      for (uint m = 0; m < MB; ++m) {
        acc[m][r] += s * part[m];
      }
    }
  }
}

for (uint m = 0; m < MB; ++m) {
  for (uint r = 0; r < ROWS; ++r) {
    acc[m][r] = simd_sum(acc[m][r]);
  }
}
if (slices == 1u) {  // uniform over the threadgroup
  if (lane == 0) {
    for (uint m = 0; m < MB; ++m) {
      if (m0 + m < M) {
        const size_t oo = size_t(m0 + m) * N + n0;
        for (uint r = 0; r < ROWS; ++r) {
          out[oo + r] = T(acc[m][r]);
        }
      }
    }
  }
} else {  // no thread returned early (DISPATCH INVARIANTS): all reach the barrier
  threadgroup float* mine = partials + (slice * SIMDGROUPS + row_block) * MB * ROWS;
  if (lane == 0) {
    for (uint m = 0; m < MB; ++m) {
      for (uint r = 0; r < ROWS; ++r) {
        mine[m * ROWS + r] = acc[m][r];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint m = lane / ROWS;
  if (slice == 0 && lane < MB * ROWS && m0 + m < M) {
    float total = 0.0f;
    for (uint g = 0; g < slices; ++g) {  // fixed order: K slice 0, 1, ...
      total += partials[(g * SIMDGROUPS + row_block) * MB * ROWS + lane];
    }
    out[size_t(m0 + m) * N + n0 + lane % ROWS] = T(total);
  }
}
