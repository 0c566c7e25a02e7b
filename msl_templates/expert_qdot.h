// expert_qdot.h: the quantized dot of one lane's word and the shuffled group scales, for
// expert_glu, expert_down_combine and expert_qmv.
//
// expert_qmv.metal keeps its own copy of mt_expert_word_dot (mt_qmv_word_dot), so that its
// negative controls, which edit the template's text, can break its decode.
#pragma once
#include "common.h"

// ---- one word against its activations, affine codes without shift or int -> float --------
//
// Code i of a word (bits [BITS*i, BITS*(i+1)), i < PACK) lies in the word's low 16 bits for
// i < PACK / 2, else in the low 16 bits of word >> 16; at j = i % (PACK / 2) it is masked in
// place there as the integer c * 2^(BITS*j) < 2^16. OR-ed into the mantissa of 2^23
// (0x4B000000) it reads as the float 2^23 + c * 2^(BITS*j), exactly (below 2^24), and
// subtracting 2^23 leaves c * 2^(BITS*j), exactly. Its activation was multiplied by
// 2^-(BITS*j) (mt_expert_prescale; exact: a power of two, |x| >= 2^-114 stays normal), so
// each product, and hence each fma, is bitwise that of c * x. Per code: one and-or
// (mt_and_or: one LOP3 on NVIDIA, where ptxas made two of the plain expression), one
// subtract, one fma, all full-rate; plus one shift per word. The plain form costs a shift,
// a mask, an int -> float conversion (on NVIDIA a conversion-pipe instruction, listed far
// below the FP32 rate) and the fma: 4 instructions per code become 3 full-rate ones. Range: the pre-scaling is exact while |x| * 2^-12 (8-bit: 2^-8) stays
// a float32 normal, i.e. |x| >= 2^-114 (8-bit: 2^-118); an activation below that is rounded
// to a subnormal, or flushed to zero where float32 subnormals are (Apple's fast math).
// MLX's Metal qmv pre-scales x by 16^-i the same way (then converts), with the same range.

// The factor activation i of a word is multiplied by before mt_expert_word_dot (1 in the fp
// modes, whose codes are decoded as values).
template <int MODE, int BITS>
inline float mt_expert_prescale(int i) {
  constexpr int HALF = 16 / BITS;  // codes per 16 bits
  return MODE == 0 ? as_type<float>(uint(127 - BITS * (i % HALF)) << 23) : 1.0f;
}

// q * x summed over the PACK codes of one word against its PACK activations xv (pre-scaled
// by mt_expert_prescale); q as mt_expert_qdot's. Summed in code order i = 0, 1, ...
template <int MODE, int BITS>
inline float mt_expert_word_dot(uint word, thread const float* xv) {
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

// ---- a group's scale and bias through one shuffle -----------------------------------------
//
// A step's group scales (and affine biases) are loaded one group per lane and shuffled to the
// lanes holding that group's words, as raw bits: two 16-bit values share one uint (one
// shuffle, one register), decoded after the shuffle by the lane using them. ST is the
// scales' storage type: T (affine: scale, then bias in the high half; a float T carries
// only its scale here, its bias travels apart), uint8 (fp modes: the code, decoded by
// mt_fp4_scale). A 16-bit T is never reinterpreted itself (before Metal 3.1 MLX's
// bfloat16_t is a struct, which as_type does not take): a half goes through as_type of a
// half, a bfloat through the top half of its float32 value (exact: float32 extends
// bfloat's exponent and mantissa with zeros), decoded by a shift.

// Whether ST is half (else, among the 16-bit float types, bfloat).
template <typename ST>
inline bool mt_is_half() {
  return false;
}
template <>
inline bool mt_is_half<half>() {
  return true;
}

// The 16 bits of a half or bfloat v (low half of the result).
template <typename ST>
inline uint mt_bits16(ST v) {
  return mt_is_half<ST>() ? uint(as_type<ushort>(half(float(v))))
                          : as_type<uint>(float(v)) >> 16;
}

// float(v) from mt_bits16(v) in the low 16 bits of b (the high 16 are ignored).
template <typename ST>
inline float mt_from_bits16(uint b) {
  return mt_is_half<ST>() ? float(as_type<half>(ushort(b & 0xFFFFu)))
                          : as_type<float>(b << 16);
}

template <int MODE, typename ST, typename BT>
inline uint mt_group_bits(ST scale, BT bias) {
  if constexpr (MODE != 0) {
    return uint(scale);
  } else if constexpr (sizeof(ST) == 2) {
    return mt_bits16(scale) | (mt_bits16(bias) << 16);
  } else {
    return as_type<uint>(scale);
  }
}

template <int MODE, typename ST>
inline float mt_group_scale(uint bits) {
  if constexpr (MODE != 0) {
    return mt_fp4_scale<MODE == 3 ? 1 : MODE>(bits);
  } else if constexpr (sizeof(ST) == 2) {
    return mt_from_bits16<ST>(bits);
  } else {
    return as_type<float>(bits);
  }
}

// The affine bias of a 16-bit ST (the high half of mt_group_bits).
template <typename ST>
inline float mt_group_bias(uint bits) {
  return mt_from_bits16<ST>(bits >> 16);
}
