// Stand-in for MLX's JIT header "mlx/backend/cuda/device/utils.cuh", used only by the
// standalone nvcc compile check (MLX embeds the real one in libmlx, not as a file).
// It declares what MLX's generated kernel signatures use: the CUDA half / bfloat16 types
// and the fixed-size Shape / Strides arrays passed as __grid_constant__ parameters.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>

namespace mlx::core::cu {

constexpr int MAX_NDIM = 10;  // MLX's limit on array dimensions in device code

using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;

}  // namespace mlx::core::cu
