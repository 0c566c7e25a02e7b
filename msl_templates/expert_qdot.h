// expert_qdot.h: the quantized dot of one lane chunk, for expert_glu and expert_down_combine.
//
// The same function as expert_qmv.metal's (kept in that template so that its negative
// controls, which edit the template's text, can break its decode).
#pragma once
#include "common.h"

// q * x summed over the VALS values a lane holds: WORDS packed uint32 words of BITS-bit
// codes (already loaded) against VALS float activations; q is the unsigned integer (MODE 0),
// the E2M1 value (MODE 1, 2; BITS 4) or the E4M3 value (MODE 3; BITS 8).
template <int MODE, int BITS, int WORDS>
inline float mt_expert_qdot(thread const uint* words, thread const float* xv) {
  constexpr int PACK = 32 / BITS;
  constexpr uint MASK = (1u << BITS) - 1u;
  float dot = 0.0f;
  for (int wi = 0; wi < WORDS; ++wi) {
    const uint word = words[wi];
    if constexpr (MODE == 0) {
      for (int i = 0; i < PACK; ++i) {
        dot += float((word >> (BITS * i)) & MASK) * xv[wi * PACK + i];
      }
    } else if constexpr (MODE == 3) {
      for (int i = 0; i < 4; ++i) {
        dot += mt_fp4_scale<2>(word >> (8 * i)) * xv[wi * 4 + i];
      }
    } else {
      for (int i = 0; i < 4; ++i) {  // codes i and i + 4 of the word at once
        const float2 v = float2(mt_e2m1x2(word >> (4 * i)));
        dot += v.x * xv[wi * 8 + i] + v.y * xv[wi * 8 + i + 4];
      }
    }
  }
  return dot;
}
