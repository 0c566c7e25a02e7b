"""Runtime scalars whose values the host knows: one 0-d array per (value, dtype), remembered
with its bits, so an executor can pass it other than as a 0-d array.

Why: MLX's CUDA allocator keeps arrays of at most 8 bytes (every 0-d uint32 or float32) in
one small managed-memory pool that the host also writes; a kernel reading such an array pays
a round trip to it (an H100, a kernel whose blocks read one 0-d input: 18 us instead of 1.6
us; an array of 16 bytes: 1.7 us). The cuda executor packs the known scalars of a launch into
one array of at least 16 bytes instead (``mlx_metaltile.cuda``). Metal passes 0-d arrays by
reference from unified memory and takes them as they are.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from .dtypes import lookup

# dtype -> how its bits travel: the 32-bit scalar dtypes (the ones kernels take)
PACKABLE = {mx.uint32: "uint", mx.int32: "int", mx.float32: "float"}
# Distinct scalars remembered, the oldest forgotten first: a decode step needs a few dozen,
# and an attention kv_len is a new one every token.
_LIMIT = 8192
_made: dict[tuple, mx.array] = {}
# id -> (weak reference, bits, (its PACKABLE type, bits)) of every live scalar made here: one
# forgotten by _made but still held (by an op's remembered plan, say) keeps its bits
_bits: dict[int, tuple[weakref.ref, int, tuple[str, int]]] = {}


def scalar(value, dtype: mx.Dtype) -> mx.array:
    """The 0-d array of ``value`` in ``dtype``, made once per (value, dtype)."""
    # a float by its bits: -0.0 == 0.0 and NaN != NaN would make value a wrong key
    key = (type(value), value.hex() if isinstance(value, float) else value, dtype)
    array = _made.get(key)
    if array is None:
        array = mx.array(value, dtype=dtype)
        while len(_made) >= _LIMIT:
            del _made[next(iter(_made))]
        _made[key] = array
        bits = _bits_of(value, dtype)
        if bits is not None:
            at = id(array)
            _bits[at] = (weakref.ref(array, lambda _, at=at: _bits.pop(at, None)), bits,
                         (PACKABLE[dtype], bits))
    return array


def _bits_of(value, dtype: mx.Dtype) -> int | None:
    """The 32 bits ``mx.array(value, dtype)`` holds, from the Python value (reading the
    array back would be a host read), or None (not a packable dtype, or a value NumPy does
    not convert exactly as a C cast: that scalar then travels as its 0-d array)."""
    if dtype not in PACKABLE or isinstance(value, bool) and dtype == mx.float32:
        return None
    kind = lookup(dtype).numpy
    try:
        with np.errstate(all="raise"):
            return int(np.array(value, dtype=kind).reshape(1).view(np.uint32)[0])
    except (OverflowError, FloatingPointError, ValueError, TypeError):
        return None


def known_bits(array: mx.array) -> int | None:
    """The 32 bits of a remembered scalar made by :func:`scalar`, else None."""
    entry = _bits.get(id(array))
    return entry[1] if entry is not None and entry[0]() is array else None


def packed_form(array: mx.array) -> tuple[str, int] | None:
    """(its PACKABLE type, its 32 bits) of a remembered scalar made by :func:`scalar`, else
    None: what an executor packing it needs, in one look-up (one tuple per scalar)."""
    entry = _bits.get(id(array))
    return entry[2] if entry is not None and entry[0]() is array else None
