"""Quantization modes as ``mx.quantize`` describes them: defaults and the checks that tie a
mode to the arrays it was given (shared by expert_qmv, moe_gather_qmm and fp4_qmm)."""

from __future__ import annotations

import numbers

import mlx.core as mx

from ._common import dtype_name

# mode -> (default group_size, default bits), as mx.quantize (MLX 0.32). The fp modes fix both.
DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
# mode -> the MODE template parameter of the kernels (= common.h's mt_fp4_scale SCALE_MODE).
# mxfp8 (3) is mapped to its E8M0 scale format inside the kernels.
MODE_IDS = {"affine": 0, "mxfp4": 1, "nvfp4": 2, "mxfp8": 3}
SCALE_FORMATS = {"mxfp4": "E8M0", "nvfp4": "E4M3", "mxfp8": "E8M0"}


def as_int(op: str, name: str, value) -> int:
    """A Python or NumPy integer as an int (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"[{op}] {name} must be an int, got {type(value).__name__}")
    return int(value)


def check_mode(op: str, mode, modes: tuple[str, ...], *, or_none: bool = False) -> str:
    if not isinstance(mode, str) or mode not in modes:
        raise ValueError(f"[{op}] mode must be one of {modes}{' or None' if or_none else ''}, "
                         f"got {mode!r}")
    return mode


def resolve_sizes(op: str, mode: str, group_size, bits) -> tuple[int, int]:
    """(group_size, bits): None takes the mode's default; an fp mode fixes both."""
    default_gs, default_bits = DEFAULTS[mode]
    group_size = default_gs if group_size is None else as_int(op, "group_size", group_size)
    bits = default_bits if bits is None else as_int(op, "bits", bits)
    if mode != "affine":
        for name, value, want in (("group_size", group_size, default_gs),
                                  ("bits", bits, default_bits)):
            if value != want:
                raise ValueError(f"[{op}] mode {mode!r} has {name} {want} (as mx.quantize), "
                                 f"got {value}")
    return group_size, bits


def check_mode_arrays(op: str, mode: str, scales: mx.array, biases) -> None:
    """scales / biases as mx.quantize returns them for ``mode`` (scales already an array):
    affine: biases an array, scales not uint8; fp modes: biases None, scales uint8."""
    if mode == "affine":
        if biases is None:
            raise ValueError(f"[{op}] mode 'affine' needs biases (as mx.quantize returns "
                             "them), got None; fp4 weights need mode='mxfp4' or 'nvfp4'")
        if scales.dtype == mx.uint8:
            raise TypeError(f"[{op}] mode 'affine' takes scales in x's dtype, got uint8 "
                            "(E8M0 / E4M3 scales of mode 'mxfp4' / 'nvfp4'?)")
        return
    if biases is not None:
        raise ValueError(f"[{op}] mode {mode!r} takes biases=None (it has no bias), got "
                         f"{type(biases).__name__}")
    if scales.dtype != mx.uint8:
        raise TypeError(f"[{op}] mode {mode!r} needs uint8 {SCALE_FORMATS[mode]} scales (as "
                        f"mx.quantize returns them), got {dtype_name(scales.dtype)}")
