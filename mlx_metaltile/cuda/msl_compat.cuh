// msl_compat.cuh: the subset of the Metal Shading Language that mlx-metaltile kernels use,
// implemented in CUDA C++ so the same kernel bodies compile under mx.fast.cuda_kernel.
//
// How it is used (mlx_metaltile/cuda/_translate.py): MLX's CUDA JIT puts its own
// device utils first, then our header (this file + the template's MSL helpers wrapped in
// `namespace mlx::core::cu`), then the generated `__global__` function holding the body.
// Everything below lives in `mlx::core::cu::metal` and is pulled into `mlx::core::cu` with a
// using-directive, so inside the kernel our `float4`, `uint3`, `min`, ... hide CUDA's global
// ones of the same name.
//
// Conventions followed here:
//  * half / bfloat are CUDA's __half / __nv_bfloat16 (what MLX passes for float16 /
//    bfloat16 arrays), with MSL's arithmetic: half op float -> float, half op int -> half.
//  * SIMD-groups are CUDA warps (both 32 lanes). SIMD functions act on the lanes active at
//    the call (__activemask()), as in MSL; with every lane active they use butterflies.
//  * simdgroup_matrix<T, 8, 8> holds its elements in mma.sync's per-lane layout, not
//    Apple's (matrix.cuh, included below, says which and why); half and bfloat products run
//    on tensor cores (sm_80+).
//  * Every function is __device__ explicitly: MLX's NVRTC would treat unannotated
//    functions as device code, nvcc (the CI compile check) would not.
#ifndef MLX_METALTILE_MSL_COMPAT_CUH
#define MLX_METALTILE_MSL_COMPAT_CUH

// The library, split as the emulator's include/mt_emu/ headers are.
#include "include/mt_cuda/prelude.cuh"
#include "include/mt_cuda/scalar.cuh"
#include "include/mt_cuda/vec.cuh"
#include "include/mt_cuda/math.cuh"
#include "include/mt_cuda/simd.cuh"
#include "include/mt_cuda/atomic.cuh"
#include "include/mt_cuda/matrix.cuh"
#include "include/mt_cuda/wide.cuh"
#include "include/mt_cuda/kernel.cuh"

#endif  // MLX_METALTILE_MSL_COMPAT_CUH
