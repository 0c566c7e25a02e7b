// common.h: helpers shared by several mlx-metaltile kernels.
//
// Inlined (once) into a kernel's header by the template renderer; MLX's own utils header
// (metal_stdlib, float16_t/bfloat16_t, ...) is already in front of it.
//
// SIMD width is 32 on every Apple GPU; the reductions below rely on it.
#pragma once

// Sum of one float per thread over the whole threadgroup.
// Every thread of the threadgroup must call it (it contains a barrier), with
// `scratch` a kernel-scope `threadgroup float[32]` array. All threads get the total.
// Reduction order: simd_sum within each SIMD-group, then simd_sum over the SIMD-group
// partials in SIMD-group order. A second call on the same scratch needs a barrier first.
inline float mt_threadgroup_sum(float value, threadgroup float* scratch, uint simd_lane,
                                uint simd_group, uint n_simd_groups) {
  value = simd_sum(value);
  if (simd_lane == 0) {
    scratch[simd_group] = value;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = simd_lane < n_simd_groups ? scratch[simd_lane] : 0.0f;
  return simd_sum(total);
}

// silu(z) = z * sigmoid(z) = z / (1 + exp(-z)); exp(-z) = inf for very negative z gives -0.
inline float mt_silu(float z) {
  return z / (1.0f + metal::exp(-z));
}
