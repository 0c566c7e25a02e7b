"""The dtypes an MSL kernel can take, and how each executor spells them (stated once)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # MLX's name: "float16"
    msl: str  # the spelling MLX writes in signatures and kernel names (its get_type_string)
    cuda: str  # the CUDA type MLX's cuda_kernel writes for it
    numpy: type | None  # the host view the emulator uses (bfloat16 as its bits), None: none


_TABLE = (
    DType("bool", "bool", "bool", np.bool_),
    DType("int8", "int8_t", "int8_t", np.int8),
    DType("int16", "int16_t", "int16_t", np.int16),
    DType("int32", "int32_t", "int32_t", np.int32),
    DType("int64", "int64_t", "int64_t", np.int64),
    DType("uint8", "uint8_t", "uint8_t", np.uint8),
    DType("uint16", "uint16_t", "uint16_t", np.uint16),
    DType("uint32", "uint32_t", "uint32_t", np.uint32),
    DType("uint64", "uint64_t", "uint64_t", np.uint64),
    DType("float16", "float16_t", "__half", np.float16),
    DType("bfloat16", "bfloat16_t", "__nv_bfloat16", np.uint16),
    DType("float32", "float", "float", np.float32),
    DType("float64", "double", "double", np.float64),
    DType("complex64", "complex64_t", "mlx::core::cu::complex64_t", None),
)
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}


def dtype_name(dtype) -> str:
    """'float16' for mx.float16 (or for the string 'float16')."""
    return str(dtype).rsplit(".", 1)[-1]


def lookup(dtype) -> DType:
    """The table entry of an mx.Dtype (or of its name)."""
    try:
        return DTYPES[dtype_name(dtype)]
    except KeyError:
        raise TypeError(f"[metal_kernel] unsupported dtype {dtype}") from None


def type_string(dtype: mx.Dtype) -> str:
    """The MSL spelling MLX uses for a dtype (float16 -> float16_t, ...)."""
    return lookup(dtype).msl


def cuda_type(dtype) -> str:
    """The CUDA type MLX's cuda_kernel uses for a dtype (float16 -> __half, ...)."""
    return lookup(dtype).cuda


def numpy_type(dtype) -> type | None:
    """The NumPy dtype of the host view of an array (bfloat16 as uint16), None if none."""
    entry = DTYPES.get(dtype_name(dtype))
    return entry.numpy if entry else None
