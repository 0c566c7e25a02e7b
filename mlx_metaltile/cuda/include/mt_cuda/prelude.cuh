// mt_cuda/prelude.cuh: the CUDA headers the library needs and its function marker.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/limits>
#include <cuda/std/type_traits>

#define MT_FN __device__ __forceinline__
