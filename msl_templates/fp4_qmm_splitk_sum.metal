// fp4_qmm_splitk_sum.metal: the second pass of split-K fp4_qmm: add the float32 partial sums.
//
// MATH: out[i] = T(sum_{p < parts} partial[p, i]), parts in order (deterministic), float32.
//
// LAYOUT: partial [parts, M * N] float32 (row-contiguous, from fp4_qmm_simdgroup.metal);
//   out [M * N] T. n_parts (parts) and n_out (M * N): 0-d uint32 runtime inputs.
// TEMPLATE: T (the output dtype).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (256, 1, 1); grid = (round_up(ceil(M * N / 4), 256), 1, 1): thread t owns
//   outputs [4t, 4t + 4); M * N % 32 == 0 (N % 32 == 0), so a thread's 4 outputs are all in
//   range or all out of range (then it returns: no barrier in this kernel).
//   parts >= 2 (ragged K parts change nothing here: every part holds a full [M, N] partial).
// TRAFFIC: partial read once (parts * M * N * 4 bytes), out written once.
// ONLY CHECKABLE ON A MAC: whether the compiler turns the 4 scalar loads and stores into
//   vector accesses (the emulator counts bytes, not instructions), speed.
#include "common.h"
// ---- kernel body ----
const uint i0 = thread_position_in_grid.x * 4;
const uint total = n_out;
if (i0 >= total) {
  return;
}
float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
for (uint p = 0; p < n_parts; ++p) {
  const size_t base = size_t(p) * total + i0;
  for (uint j = 0; j < 4; ++j) {
    acc[j] += partial[base + j];
  }
}
for (uint j = 0; j < 4; ++j) {
  out[i0 + j] = T(acc[j]);
}
