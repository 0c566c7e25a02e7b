"""Checks and small helpers shared by the op modules."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Callable, Mapping

import mlx.core as mx
import numpy as np

from .. import _device
from .._msl import constants
from .._registry import Arg, Bindings, KernelSpec

FLOAT_TYPES = (mx.float32, mx.float16, mx.bfloat16)
INDEX_TYPES = (mx.uint32, mx.int32)
_FLOAT_SET = frozenset(FLOAT_TYPES)  # one hash instead of up to three comparisons


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def require_array(op: str, name: str, value) -> mx.array:
    if not isinstance(value, mx.array):
        raise TypeError(f"[{op}] {name} must be an mx.array, got {type(value).__name__}")
    return value


def require_float(op: str, name: str, arr: mx.array) -> mx.Dtype:
    """Check that ``arr`` is float32/float16/bfloat16; return its dtype."""
    dtype = arr.dtype
    if dtype not in _FLOAT_SET:
        raise TypeError(f"[{op}] {name} must be float32, float16 or bfloat16, "
                        f"got {dtype_name(dtype)}")
    return dtype


def require_ndim(op: str, name: str, arr: mx.array, ndim: int) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"[{op}] {name} must have {ndim} dimensions, got {arr.ndim} "
                         f"(shape {tuple(arr.shape)})")


def require_finite_scalar(op: str, name: str, value, *, minimum: float | None = None) -> float:
    """A Python or NumPy real number (bools refused) as a finite float."""
    if type(value) is not float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"[{op}] {name} must be a Python or NumPy real number, "
                            f"got {type(value).__name__}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range (e.g. 10**400)
            raise ValueError(f"[{op}] {name} must be finite, got an int of "
                             f"{int(value).bit_length()} bits (beyond float's range)") from None
    if not math.isfinite(value):
        raise ValueError(f"[{op}] {name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"[{op}] {name} must be >= {minimum}, got {value}")
    return value


def as_bool(op: str, name: str, value) -> bool:
    """A Python or NumPy bool as a bool (ints refused: 0/1 are not flags here)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"[{op}] {name} must be a bool (Python or NumPy), "
                        f"got {type(value).__name__}")
    return bool(value)


_NO_STREAM = contextlib.nullcontext()  # reentrant and stateless: one serves every call


def on_stream(op: str, stream):
    """The context an op call runs in: MLX's StreamOrDevice (None: the default stream; an
    mx.Stream; an mx.Device or mx.cpu / mx.gpu: that device's default stream). The
    composites' MLX ops and the kernel launches inside it all run on that stream."""
    if stream is None:
        return _NO_STREAM
    if not isinstance(stream, (mx.Stream, mx.Device, mx.DeviceType)):
        raise TypeError(f"[{op}] stream must be None, an mx.Stream or an mx.Device "
                        f"(mx.cpu, mx.gpu), got {type(stream).__name__}")
    return mx.stream(stream)


def run_on(stream, fn: Callable) -> Callable:
    """``fn`` with each call inside ``on_stream``'s context for ``stream`` (one it has
    accepted): ``fn`` itself for None, which has no context to enter (a plan's per-call
    path)."""
    if stream is None:
        return fn

    def on(*args):
        with mx.stream(stream):
            return fn(*args)

    return on


def empty_call(op: str, stream, shape: tuple[int, ...], dtype: mx.Dtype) -> Callable:
    """A plan's call for an empty output: zeros of ``shape`` on ``stream``, whatever the
    arrays (nothing to read or launch)."""
    def empty(*arrays):
        with on_stream(op, stream):
            return mx.zeros(shape, dtype=dtype)
    return empty


_CHECKED_MAX = 4096  # remembered results per check or plan function (a decode loop needs a few)


def _meta(value):
    """What a check may read of one argument: an array's shape and dtype (never its values:
    that would be a host sync), a scalar's type and value, a stream or device itself; None
    (unhashable) for anything else, whose call is then not remembered."""
    if isinstance(value, mx.array):
        return (value.shape, value.dtype)
    if value is None or isinstance(value, (str, int, float, np.generic, *_PLACES)):
        return (type(value), value)
    return None


_PLACES = (mx.Stream, mx.Device, mx.DeviceType)  # an op's stream= (only plans' keys hold one)
_PLAIN = frozenset((str, int, float, bool, type(None)))


def _key(args: tuple) -> tuple | None:
    """``_meta`` of every argument, flattened (two entries each: an array's shape is a tuple,
    a scalar's first entry its type, so no two arguments' entries can be confused); None if
    one is not remembered. The common types first: this runs on every op call."""
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is mx.array:
            add(a.shape)
            add(a.dtype)
        elif t in _PLAIN:
            add(t)
            add(a)
        else:
            meta = _meta(a)
            if meta is None:
                return None
            key += meta
    return tuple(key)


def memo_check(check: Callable) -> Callable:
    """``check`` (a result of plain Python values derived from the arguments' shapes, dtypes
    and scalar values only: no backend, device or other global state) remembered per
    distinct positional arguments: the
    per-call cost of an op in a decode loop is its checks, several times the launch. A call
    that raises is not remembered (it raises again next time); a result holding an array is
    never remembered."""
    return _memo(check, keep=lambda result: not _holds_array(result))


_PLANS: list[dict] = []  # every memo_plan's memory (clear_plans empties them)


def memo_plan(build: Callable) -> Callable:
    """``build`` (an op's plan for one call: everything derived from the arguments' shapes,
    dtypes and scalar values, with the backend and stream passed in as arguments: checks,
    geometry, prepared launches, the op's custom function) remembered per distinct
    positional arguments, as ``memo_check``'s, so that a repeat call only binds its arrays.
    A plan may hold arrays it made itself from that metadata (runtime scalars), never an
    argument array or anything computed from one. A call that raises is not remembered."""
    memo = _memo(build, keep=lambda result: True)
    _PLANS.append(memo.memory)
    return memo


def plan_memory() -> dict:
    """An empty dict that :func:`clear_plans` empties too: an op's own table of plans in front
    of its ``memo_plan`` (a key formed inline for its common call), each entry the plan
    ``memo_plan`` returned for those arguments."""
    memory: dict = {}
    _PLANS.append(memory)
    return memory


def keep_plan(memory: dict, key, plan):
    """``plan`` remembered in ``memory`` (a :func:`plan_memory`) under ``key``, the oldest
    entry forgotten past ``memo_plan``'s bound; returns ``plan``."""
    if len(memory) >= _CHECKED_MAX:
        del memory[next(iter(memory))]
    memory[key] = plan
    return plan


def clear_plans() -> None:
    """Forget every op's plans (the next call of each builds its plan again): for code that
    replaces an op's helpers or constants, which plans read once."""
    for memory in _PLANS:
        memory.clear()


def _memo(fn: Callable, keep: Callable) -> Callable:
    memo: dict = {}

    @functools.wraps(fn)
    def remembered(*args, **kwargs):
        key = _key(args)
        if kwargs or key is None:
            return fn(*args, **kwargs)
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value inside (a NumPy array scalar, say)
            return fn(*args)
        result = fn(*args)
        if keep(result):
            if len(memo) >= _CHECKED_MAX:  # forget the oldest: a decode loop's kv_len grows
                del memo[next(iter(memo))]  # by one a token, a new key each time
            memo[key] = result
        return result

    remembered.cache_clear = memo.clear
    remembered.memory = memo
    return remembered


def _holds_array(value) -> bool:
    if isinstance(value, mx.array):
        return True
    if isinstance(value, dict):
        return any(_holds_array(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_array(v) for v in value)
    return False


def scalar(value, dtype: mx.Dtype) -> mx.array:
    """A remembered 0-d array for a runtime kernel input (no per-call allocation in a loop;
    the cuda executor passes it packed: ``_msl/constants.py``)."""
    return constants.scalar(value, dtype)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ---- float32 products on TF32 hardware ------------------------------------------------

# MLX multiplies float32 matrices on TF32 tensor cores by default on NVIDIA GPUs (and M5-class
# Apple GPUs; MLX_ENABLE_TF32=0 turns it off for the whole process): each operand keeps 11 of
# its 24 significant bits, about 2^-11 relative error per product, where the tolerance table
# allows float32 accumulation (2e-6 of the sum of |terms|). A value whose low 13 significand
# bits are zero is exact in TF32, and TF32 products accumulate in float32.
_TF32_MASK = 0xFFFFE000


def tf32_split(a: mx.array) -> tuple[mx.array, mx.array]:
    """float32 ``a`` as ``hi + lo``: hi exact in TF32 (a with its low 13 significand bits
    cleared), lo = a - hi (exact in float32, at most 2^-10 of |a|: TF32 keeps its leading 11
    bits, so lo's own TF32 error is about 2^-22 of |a|; below 2^-136 for a subnormal a).
    Non-finite values stay in hi whole (lo 0): clearing a NaN's low bits could make it an
    infinity."""
    cut = mx.view(mx.view(a, mx.uint32) & _TF32_MASK, mx.float32)
    finite = mx.isfinite(a)
    hi = mx.where(finite, cut, a)
    return hi, mx.where(finite, a - hi, 0.0)


def float32_matmul(a: mx.array, b: mx.array, *, a_exact: bool = False,
                   b_exact: bool = False) -> mx.array:
    """``a @ b`` for float32 2-D ``a`` [M, N] and ``b`` [N, K] to float32 accuracy whether or
    not MLX runs float32 products in TF32: an operand not marked exact in TF32 (``a_exact``,
    ``b_exact``: every value has at most 11 significant bits) is split by
    :func:`tf32_split`, both pieces in one product where the other is exact ([hi; lo] @ b, or
    a @ [hi, lo]), the small terms added first. The error: float32 accumulation, plus about
    2^-22 of the sum of |terms| for the pieces' own TF32 rounding and the lo x lo term left
    out. Costs two products' work (three with both split) where one would do without TF32."""
    if a_exact and b_exact:
        return mx.matmul(a, b)
    if b_exact:
        m = a.shape[0]
        both = mx.matmul(mx.concatenate(tf32_split(a)), b)
        return both[m:] + both[:m]
    b_hi, b_lo = tf32_split(b)
    if a_exact:
        k = b.shape[1]
        both = mx.matmul(a, mx.concatenate([b_hi, b_lo], axis=1))
        return both[:, k:] + both[:, :k]
    m = a.shape[0]
    a_hi, a_lo = tf32_split(a)
    both = mx.matmul(mx.concatenate([a_hi, a_lo]), b_hi)
    return (both[m:] + mx.matmul(a_hi, b_lo)) + both[:m]


# ---- quantized weights: mx.quantize's modes ------------------------------------------

BITS = (4, 8)  # affine
GROUP_SIZES = (32, 64, 128)  # affine
# mode -> (default group_size, default bits), as mx.quantize (MLX 0.32). The fp modes fix both.
DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
# mode -> the MODE template parameter of the kernels (= common.h's mt_fp4_scale SCALE_MODE).
# mxfp8 (3) is mapped to its E8M0 scale format inside the kernels.
MODE_IDS = {"affine": 0, "mxfp4": 1, "nvfp4": 2, "mxfp8": 3}
MODES = tuple(MODE_IDS)
SCALE_FORMATS = {"mxfp4": "E8M0", "nvfp4": "E4M3", "mxfp8": "E8M0"}


def as_int(op: str, name: str, value) -> int:
    """A Python or NumPy integer as an int (bool refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"[{op}] {name} must be an int, got {type(value).__name__}")
    return int(value)


def require_int_choice(op: str, name: str, value, choices: tuple[int, ...]) -> int:
    """An int (NumPy integers too) among ``choices``, returned as a plain int (a plain int
    keys the template)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"[{op}] {name} must be an int in {choices}, got {type(value).__name__}")
    value = int(value)
    if value not in choices:
        raise ValueError(f"[{op}] {name} must be one of {choices}, got {value}")
    return value


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


def check_quantized(op: str, x, w, scales, biases, indices, group_size, bits,
                    mode) -> tuple[int, int, str]:
    """The checks every op over ``mx.quantize``d expert weights makes: the mode and the
    arrays it implies (affine: scales and biases in x's dtype, bits and group_size among
    the supported ones; fp modes: uint8 scales, biases None, the mode's sizes), array
    types, x float, w packed uint32, uint32/int32 expert ids. Shapes are each op's.
    Returns (group_size, bits, mode)."""
    mode = check_mode(op, mode, MODES)
    for name, arr in (("x", x), ("w", w), ("scales", scales), ("indices", indices)):
        require_array(op, name, arr)
    check_mode_arrays(op, mode, scales, biases)
    if mode == "affine":  # None: mx.quantize's default; else an int among the supported ones
        require_array(op, "biases", biases)
        default_gs, default_bits = DEFAULTS[mode]
        bits = require_int_choice(op, "bits", default_bits if bits is None else bits, BITS)
        group_size = require_int_choice(op, "group_size",
                                        default_gs if group_size is None else group_size,
                                        GROUP_SIZES)
    else:
        group_size, bits = resolve_sizes(op, mode, group_size, bits)
    if w.dtype != mx.uint32:
        raise TypeError(f"[{op}] w must be uint32 (packed as mx.quantize returns it), "
                        f"got {dtype_name(w.dtype)}")
    require_float(op, "x", x)
    if mode == "affine":  # fp modes: uint8 scales (checked above)
        for name, arr in (("scales", scales), ("biases", biases)):
            if arr.dtype != x.dtype:
                raise TypeError(f"[{op}] {name} must have x's dtype {dtype_name(x.dtype)}, "
                                f"got {dtype_name(arr.dtype)}")
    if indices.dtype not in INDEX_TYPES:
        raise TypeError(f"[{op}] indices must be uint32 or int32, "
                        f"got {dtype_name(indices.dtype)}")
    return group_size, bits, mode


# The leading arguments and the template of the kernels over them (T: x's dtype, S: the
# scales' (x's dtype in affine mode, uint8 in the fp modes, which pass their scales again as
# the unread biases), I: the ids').
QUANTIZED_INPUTS = (Arg("x", "T", 2), Arg("w", "uint32", 3), Arg("scales", "S", 3),
                    Arg("biases", "S", 3), Arg("indices", "I", 1))
QUANTIZED_PARAMS = ("T", "BITS", "GROUP_SIZE", "MODE")


def quantized_bindings(modes: tuple[str, ...]) -> Bindings:
    """Every (dtype, mode, bits, group_size, index dtype) the launchers make for ``modes``:
    affine at each supported bits x group_size, an fp mode at its own sizes."""
    def bindings():
        for t in FLOAT_TYPES:
            for mode in modes:
                sizes = ([(bits, gs) for bits in BITS for gs in GROUP_SIZES]
                         if mode == "affine" else [DEFAULTS[mode][::-1]])
                s = t if mode == "affine" else mx.uint8
                for bits, gs in sizes:
                    for i in INDEX_TYPES:
                        yield dict(T=t, S=s, BITS=bits, GROUP_SIZE=gs, MODE=MODE_IDS[mode],
                                   I=i)
    return bindings


def variant_reason(spec: KernelSpec, backend: str) -> str | None:
    """None if kernel variant ``spec`` runs on ``backend`` here, else why not."""
    for feature in spec.features:
        reason = _device.unsupported_reason(feature, backend)
        if reason is not None:
            return reason
    if backend not in spec.backends:
        return f"the {backend} backend does not run it"
    return None


def choose_variant(op: str, specs: Mapping[str, KernelSpec], variant, backend: str,
                   auto: Callable[[], str]) -> KernelSpec | None:
    """The kernel an op call runs: ``variant`` forced (checked against ``backend``) or
    ``auto()``'s pick; None on the reference backend, where forcing a variant is refused."""
    if variant is not None and (not isinstance(variant, str) or variant not in specs):
        raise ValueError(f"[{op}] variant must be None or one of {tuple(specs)}, "
                         f"got {variant!r}")
    if backend == "reference":
        if variant is not None:
            raise ValueError(f"[{op}] variant={variant!r} needs a kernel backend (metal, cuda, "
                             "emulator); the reference backend runs the pure-MLX composite")
        return None
    if variant is None:
        return specs[auto()]
    reason = variant_reason(specs[variant], backend)
    if reason is not None:
        raise ValueError(f"[{op}] variant {variant!r} is unavailable on the {backend} backend: "
                         f"{reason}")
    return specs[variant]
