// fp4_qmm_decoded.metal: fp4 (E2M1) weights decoded to D, for fp4_qmm's decoded plan (W decoded
// once, then MLX's matmul: where a tuned GEMM library multiplies faster than the tile kernel).
//
// MATH: out[n, k] = D(e2m1(code (w[n, k / 8] >> 4 (k % 8)) & 0xF) * scale(n, k / GS) * factor)
//   e2m1 -> {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}; scale = mt_fp4_scale<SCALE_MODE>(scales[n, g]);
//   factor: a power of two (1 or 2^-3, the wrapper's; 2^-3 keeps every E8M0-scaled weight
//   finite in float32 / bfloat: |code| <= 6 < 8). The float32 product is exact for E8M0 / E4M3
//   scales, as the tile kernel's weights (fp4_qmm_simdgroup.metal). D is declared only where
//   every weight of the scale format is a value of it, so the conversion is exact: x's
//   bfloat (E8M0 and E4M3), x's half (E4M3, factor 1), or float for half x with E8M0 scales
//   (ops/fp4_qmm.py, _decoded_dtype).
//
// LAYOUT (row-contiguous): w [N, K / 8] uint32 (code j of a word at bits [4j, 4j + 4));
//   scales [N, K / GS] ST; out [N, K] D. n_words (N K / 8), k_words (K / 8), gs_shift (log2 GS,
//   GS in 16 .. 128): 0-d uint32 runtime inputs; factor: 0-d float32.
// TEMPLATE: D (output dtype: float16, bfloat16 or float32), ST (uint8), SCALE_MODE (1 E8M0,
//   2 E4M3).
//
// DESIGN: thread t decodes word t (row t / k_words): its 8 codes with mt_e2m1x2 (two at a time:
//   codes j and j + 4), times the word's group scale (8 | GS: one scale a word), stored as 8
//   consecutive outputs (common.h's mt_store8: 16-byte stores on cuda where aligned).
// TRAFFIC: w read once, a scale once per word (GS / 8 threads read the same one, from cache),
//   out written once: N K (1/2 + sizeof(D)) bytes.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (256, 1, 1); grid = (round_up(N K / 8, 256), 1, 1); threads past n_words
//   return (no barrier in this kernel). K % 32 == 0 and GS | K (checked by fp4_qmm).
// ONLY CHECKABLE ON A MAC: speed.
#include "common.h"
// ---- kernel body ----
const uint t = thread_position_in_grid.x;
if (t >= n_words) {
  return;
}
const uint row = t / k_words;
const uint k0 = (t - row * k_words) * 8;
const uint word = w[t];
const float s = factor * mt_fp4_scale<SCALE_MODE>(scales[size_t(row) * ((k_words * 8) >> gs_shift) + (k0 >> gs_shift)]);
float v[8];
for (uint j = 0; j < 4; ++j) {
  const float2 pair = float2(mt_e2m1x2(word >> (4 * j))) * s;
  v[j] = pair.x;
  v[j + 4] = pair.y;
}
mt_store8(out + size_t(t) * 8, v);
