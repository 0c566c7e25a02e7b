"""fp4_qmm: ``x @ dequantize(w, scales).T`` against fp4 (E2M1) weights, in one kernel.

Takes MLX's layouts as they are: ``w, scales = mx.quantize(W, mode="mxfp4")`` (uint8 E8M0
scales, group 32), ``mode="nvfp4"`` (uint8 E4M3 scales, group 16, no global scale), or a plain
floating-point scale per group (float32 / float16 / bfloat16; groups of 16, 32, 64 or 128).
``mode=`` names MLX's mode; without it the format is read from the scales (dtype and groups).

Kernels (``variant=``):
  qmv        GEMV-shaped, for small M (decode); auto for M <= 8 (on cuda: at M = 1, and for
             float32 x or float scales of group 16 up to 8 rows, at M = 5..8 as its w-first
             kernel, fp4_qmm_qmv_wfirst: w read once)
  simdgroup  32x32 output tiles on simdgroup matrices; every Apple GPU; auto for M > 8
  skinny     few rows on 8x8 simdgroup matrices of half / bfloat (fp4_qmm_skinny: w streamed
             once per block of 8 or 16 rows of x, decoded straight into fragments, no
             threadgroup barrier in the K loop); auto on cuda for SKINNY_M[backend] rows (2
             to 32: tensor cores there), half and bfloat x, every scale format but float
             scales of group 16
  mpp        32x32 tiles on MetalPerformancePrimitives matmul2d (16, 16, 32); auto for M > 8
             on Metal when macOS >= 26.2 and the GPU generation is >= 17 (as MLX's NAX)
  decoded    W decoded once by a kernel (fp4_qmm_decoded) into a dtype that holds every
             weight exactly, then MLX's matmul (cuBLAS on cuda): x's dtype for bfloat16 x with
             uint8 scales and float16 x with E4M3, float32 for float16 x with E8M0
             (_decoded_dtype); auto from DECODED_MIN_M[backend] rows (DECODED_F32_MIN_M
             through float32; cuda only: a tuned GEMM library against the tile kernel's
             simdgroup-matrix products, which NVIDIA runs at a few % of its peak). The
             decoded W is a transient N x K array (32 MiB at 4096 x 4096 in 16 bits, 64 MiB
             in float32)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from .. import _device, backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    DEFAULTS,
    FLOAT_TYPES,
    MODE_IDS,
    as_int,
    check_mode,
    check_mode_arrays,
    choose_variant,
    dtype_name,
    float32_matmul,
    memo_check,
    memo_plan,
    on_stream,
    require_array,
    require_float,
    resolve_sizes,
    round_up,
    run_on,
    scalar,
)
from ._grad import shapeless_tracing, x_vjp_function
from .moe_gather_qmm import DX_INPUTS, DX_OUTPUTS, DX_PARAMS, dx_bindings, dx_launcher

OP = "fp4_qmm"
__all__ = ["fp4_dequantize_reference", "fp4_qmm", "fp4_qmm_reference"]
QMV_MAX_M = 8  # auto picks the GEMV-shaped kernel up to this many rows of x
QMV_SIMDGROUPS, QMV_ROWS_PER_TG = 2, 8  # a qmv K slice: 2 SIMD-groups x 4 rows of w
QMV_MAX_SLICES = 8  # SIMD-groups sharing one row block's K steps, at most (the template's)
# The qmv launch plan on cuda (the template's LAUNCH PLANS), as module constants that a
# script may set before calling ops._common.clear_plans() (a plan reads them once):
QMV_TARGET_WARPS = 4096  # K slices until about this many warps (an H100 holds 8448)
QMV_CUDA_MAX_MB = 8  # rows of x per threadgroup, at most: 1, 2, 4 or 8
QMV_SLICES: int | None = None  # an int 1..8 forces S on every backend; None: the plan's
# MB 8's form (the template's WFIRST): True w-first (QMV_WFIRST_SPEC, 80 registers under its
# launch bounds), False held x (168 registers); None: the plan's (w-first on cuda only).
QMV_WFIRST: bool | None = None
# MB 8 held x takes 168 registers a thread (ptxas, sm_90, 16-bit T): an SM's 65536 hold 12
# such warps, so one threadgroup of 64 S threads needs S <= 6; w-first's launch bounds
# allow 64 S <= 256.
QMV_MB8_MAX_SLICES = 4
QMV_WFIRST_BOUNDS = (256, 3)  # w-first's cuda launch bounds (read at import): 80 registers
TILE = 32  # BM = BN = BK of the tile kernels
TILE_THREADS = 128
SPLITK_TARGET_TGS = 512  # split K (simdgroup kernel) until about this many threadgroups run
SUM_THREADS = 256
# The decoded plan: auto on these backends from this many rows of x, where x's dtype holds
# every weight exactly (_decoded_dtype is x's dtype). A tuning constant: the same math either
# way (float32 accumulation rounded once; the GEMM's summation order is the library's).
# Measured on an H200 (bfloat16, mxfp4, N K 4096, us, tile kernel / decoded): M 32 61.9 /
# 67.3, M 64 93.4 / 62.7, M 512 553.8 / 100.8. Metal keeps its kernels until a Mac measures
# the plan there.
DECODED_MIN_M = {"cuda": 64}
# The same through float32 (float16 x with E8M0 scales; _decoded_dtype): a W twice the size
# and TF32 products. H200 (float16, mxfp4, K 4096, us, median of 10 samples of 8 calls, in
# turns; native / tile kernel / decoded): N 4096 M 64 53.0 / 110.4 / 161.8, M 128 80.2 /
# 166.9 / 174.1, M 256 134.9 / 287.6 / 182.4, M 512 241.8 / 531.3 / 207.5; N 14336 M 64
# 129.7 / 254.5 / 259.7, M 128 220.8 / 474.8 / 280.8, M 512 784.7 / 1761.8 / 404.7.
DECODED_F32_MIN_M = {"cuda": 128}
DECODE_THREADS = 256
# The skinny kernel (fp4_qmm_skinny.metal): auto on these backends for these rows of x
# (half / bfloat x, _skinny_fits); its K slices for about SKINNY_TARGET_WARPS warps (the
# template's LAUNCH PLAN). Tuning constants: the same math whichever kernel runs.
SKINNY_M = {"cuda": range(2, 33)}
SKINNY_TARGET_WARPS = 4096
SKINNY_ROWS = 32  # rows of w per threadgroup
SKINNY_MAX_SLICES = 8  # the template's MAX_SLICES
# 8-row fragments of x per threadgroup, at most (the template's MF): 2, measured on an H200
# (mxfp4, N = K = 4096, us, MF at most 4 / 2): bfloat16 M 24 62.3-64.6 / 54.8-60.1, M 32
# 62.5-64.3 / 54.1-61.2; float16 M 24 57.0-66.1 / 52.3-53.2, M 32 61.5-66.5 / 47.9 (two
# blocks of 16 rows, w read twice, against one of 32 whose products and staging double).
SKINNY_MAX_MF = 2
FLOAT_SCALE_GROUPS = (16, 32, 64, 128)
SCALE_FLOAT, SCALE_E8M0, SCALE_E4M3 = 0, 1, 2
MODES = ("mxfp4", "nvfp4")  # MLX's fp4 modes (uint8 scales); mode=None reads the scales
_MAX_DIM = 2**31



def _scale_formats() -> list[tuple[mx.Dtype, int, int]]:
    """(scale dtype as the kernels see it, group size, SCALE_MODE) of every accepted format
    (float16 / bfloat16 scales reach the kernels as float32)."""
    formats = [(mx.uint8, 32, SCALE_E8M0), (mx.uint8, 16, SCALE_E4M3)]
    return formats + [(mx.float32, gs, SCALE_FLOAT) for gs in FLOAT_SCALE_GROUPS]


def _bindings(**extra):
    """T: x / output dtype; ST, GS, SCALE_MODE: a scale format; ``extra``: name -> the
    values it takes for each T (a function of T)."""
    def bindings():
        for t in FLOAT_TYPES:
            for st, gs, mode in _scale_formats():
                base = {"T": t, "ST": st, "GS": gs, "SCALE_MODE": mode}
                choices = [[(name, v) for v in values(t)] for name, values in extra.items()]
                for combo in itertools.product(*choices):
                    yield {**base, **dict(combo)}
    return bindings


# x [M, K], w [N, K/8] (8 E2M1 codes a word), scales [N, K/group_size]; sizes at run time.
_ARGS = (Arg("x", "T", 2), Arg("w", "uint32", 2), Arg("scales", "ST", 2),
         *scalars("m_rows", "n_cols", "k_cols"))
_OUT = (Arg("out", "T", 2),)

QMV_SPEC, SIMDGROUP_SPEC, MPP_SPEC = register(
    KernelSpec(
        op=OP, variant="qmv", template="fp4_qmm_qmv.metal",
        inputs=(*_ARGS, *scalars("gs_shift")), outputs=_OUT,
        params=("T", "ST", "SCALE_MODE", "MB", "WFIRST"),
        bindings=_bindings(MB=lambda t: (1, 2, 4, 8), WFIRST=lambda t: (0,)),
        geometry="auto for M <= 8: threadgroup (64 * S, 1, 1) = 2 simdgroups x 4 rows of w "
                 "x S K slices; grid (64 * S, N/8, ceil(M/MB)), MB = next power of two >= "
                 "min(M, 8); S = 1 (cuda: K split for ~4096 warps, <= 8; MB 8: "
                 "QMV_WFIRST_SPEC)",
        notes="template: T, ST, SCALE_MODE, MB (rows of x per threadgroup), WFIRST (0 here: "
              "held x; QMV_WFIRST_SPEC: 1); group size and S (simdgroups_per_threadgroup) "
              "runtime",
    ),
    KernelSpec(
        op=OP, variant="simdgroup", template="fp4_qmm_simdgroup.metal",
        inputs=(*_ARGS, *scalars("gs_shift", "k_part")), outputs=(Arg("out", "OT", 3),),
        params=("T", "ST", "SCALE_MODE", "OT"),
        bindings=_bindings(OT=lambda t: (t, mx.float32)),
        geometry="32x32 output tile per threadgroup of 128 (4 simdgroups x 16x16 on "
                 "simdgroup_float8x8), BK = 32; grid (128 * N/32, ceil(M/32), parts): K split "
                 "in parts of whole 32-steps, the last one possibly shorter (float32 partials "
                 "+ fp4_qmm_splitk_sum) until ~512 threadgroups",
    ),
    KernelSpec(
        op=OP, variant="mpp", template="fp4_qmm_mpp.metal",
        inputs=_ARGS, outputs=_OUT, params=("T", "ST", "GS", "SCALE_MODE"),
        bindings=_bindings(),
        backends=("metal", "emulator"), features=(_device.MPP,),
        geometry="32x32 output tile per threadgroup of 128 (4 simdgroups, each a "
                 "matmul2d(16, 16, 32) on cooperative tensors), BK = 32; "
                 "grid (128 * N/32, ceil(M/32), 1); macOS >= 26.2, GPU generation >= 17",
    ),
)
(SPLITK_SUM_SPEC,) = register(
    KernelSpec(
        op=OP, variant="splitk_sum", template="fp4_qmm_splitk_sum.metal",
        inputs=(Arg("partial", "float32", 3), *scalars("n_parts", "n_out")), outputs=_OUT,
        params=("T",), bindings=lambda: ({"T": t} for t in FLOAT_TYPES),
        geometry="second pass of a split-K simdgroup call: threadgroup (256, 1, 1), 4 outputs "
                 "per thread; grid (round_up(M*N/4, 256), 1, 1)",
    ),
)
# qmv's w-first form at MB 8 (the template's WFIRST): its own kernel object, so that only it
# carries cuda launch bounds (cuda's plan at M = 5..8; variant="qmv" runs it there).
(QMV_WFIRST_SPEC,) = register(
    KernelSpec(
        op=OP, variant="qmv_wfirst", template="fp4_qmm_qmv.metal",
        inputs=QMV_SPEC.inputs, outputs=_OUT, params=QMV_SPEC.params,
        bindings=_bindings(MB=lambda t: (8,), WFIRST=lambda t: (1,)),
        cuda_launch_bounds=QMV_WFIRST_BOUNDS,
        geometry="qmv's at MB = 8 with S <= 4: threadgroup (64 * S, 1, 1), grid "
                 "(64 * S, N/8, ceil(M/8)); w-first: each step's 4 rows of w decoded once, "
                 "the 8 rows of x streamed past them",
    ),
)


def _skinny_fits(dtype: mx.Dtype | None, scale_mode: int | None,
                 group_size: int | None) -> bool:
    """Whether the skinny kernel takes x of ``dtype`` with these scales: half or bfloat x
    (its fragments) and a step of 32 codes in one scale group or each word's weights exact
    in x's dtype (float scales of group 16 are neither)."""
    return (dtype in (mx.float16, mx.bfloat16)
            and not (scale_mode == SCALE_FLOAT and group_size == 16))


def _skinny_bindings():
    formats = ((mx.uint8, SCALE_E8M0), (mx.uint8, SCALE_E4M3), (mx.float32, SCALE_FLOAT))
    for t in (mx.float16, mx.bfloat16):
        for st, mode in formats:  # the group size is a runtime input
            for mf in (1, 2, 4):
                yield {"T": t, "ST": st, "SCALE_MODE": mode, "MF": mf}


(SKINNY_SPEC,) = register(
    KernelSpec(
        op=OP, variant="skinny", template="fp4_qmm_skinny.metal",
        inputs=(*_ARGS, *scalars("gs_shift")), outputs=_OUT,
        params=("T", "ST", "SCALE_MODE", "MF"),
        bindings=_skinny_bindings, dtypes=("float16", "bfloat16"),
        geometry="threadgroup (32 S, 1, 1): S K slices of 32 rows of w and 8 MF rows of x; "
                 "grid (32 S, N / 32, ceil(M / (8 MF))); S for ~SKINNY_TARGET_WARPS warps, "
                 "<= 8",
        notes="template T (half / bfloat), ST, SCALE_MODE (float scales of group >= 32), MF "
              "(1, 2, 4: 8 MF rows of x per threadgroup); group size and S runtime",
    ),
)


def _decoded_dtype(dtype: mx.Dtype | None, scale_mode: int | None) -> mx.Dtype | None:
    """The dtype the decoded plan decodes W into for x of ``dtype`` with scales of
    ``scale_mode`` (fp4_qmm_decoded.metal), or None where it has none. x's own dtype where
    that holds every weight exactly: bfloat16 with E8M0 or E4M3 scales, float16 with E4M3.
    float32 for float16 x with E8M0 scales (those weights leave half's range): every weight
    (at most 6 significant bits) and every half value is exact in TF32 too, so MLX's float32
    matmul forms exact products whether or not it runs them in TF32. None for float scales
    (they add significant bits) and for float32 x (split for TF32, its forward missed
    float32's bound: the tensor cores' float32 accumulation)."""
    if scale_mode not in (SCALE_E8M0, SCALE_E4M3):
        return None
    if dtype == mx.bfloat16 or (dtype == mx.float16 and scale_mode == SCALE_E4M3):
        return dtype
    return mx.float32 if dtype == mx.float16 else None


def _decoded_min_m(backend: str, dtype: mx.Dtype | None, scale_mode: int | None) -> float:
    """Rows of x from which auto takes the decoded plan on ``backend`` (inf: never)."""
    decoded = _decoded_dtype(dtype, scale_mode)
    if decoded is None:
        return math.inf
    table = DECODED_MIN_M if decoded == dtype else DECODED_F32_MIN_M
    return table.get(backend, math.inf)


def _decoded_bindings():
    for t in FLOAT_TYPES:
        for st, _, mode in _scale_formats():
            decoded = _decoded_dtype(t, mode)
            if decoded is not None:
                yield {"D": decoded, "ST": st, "SCALE_MODE": mode}


(DECODED_SPEC,) = register(
    KernelSpec(
        op=OP, variant="decoded", template="fp4_qmm_decoded.metal",
        inputs=(Arg("w", "uint32", 2), Arg("scales", "ST", 2),
                *scalars("n_words", "k_words", "gs_shift"), Arg("factor", "float32")),
        outputs=(Arg("out", "D", 2),), params=("D", "ST", "SCALE_MODE"),
        bindings=_decoded_bindings, dtypes=("float16", "bfloat16"),
        geometry="one thread per word of w (8 weights): threadgroup (256, 1, 1), grid "
                 "(round_up(N*K/8, 256), 1, 1); then MLX's matmul of x and the decoded W",
        notes="template D (bfloat16 x with uint8 scales: bfloat16; float16 x: float16 with "
              "E4M3, float32 with E8M0), ST, SCALE_MODE; factor 1 (float16) or 2^-3 (runtime), "
              "undone after the matmul",
    ),
)
VARIANT_SPECS = {spec.variant: spec
                 for spec in (QMV_SPEC, SIMDGROUP_SPEC, MPP_SPEC, DECODED_SPEC, SKINNY_SPEC)}
# The x-VJP dx = g @ W for MLX's modes (uint8 E8M0 / E4M3 scales): moe_gather_qmm's dx
# kernel with one expert, every row's id 0, and the float32 weights (ROUND false: the
# forward's products use them unrounded). Float scales keep the composite.
_DX_MODES = {SCALE_E8M0: "mxfp4", SCALE_E4M3: "nvfp4"}
# Up to DX_MAX_M rows of x (decode, as the forward's GEMV: QMV_MAX_M): each run of rows
# walks all of W, so more rows read it again and again (H100, 512 rows of 4096 x 4096:
# 1650 us against native's 160); from there on the composite (W decoded once, a matmul).
DX_MAX_M = QMV_MAX_M


def _dx_bindings():
    fp_modes = {MODE_IDS[mode] for mode in _DX_MODES.values()}
    return (b for b in dx_bindings(False)() if b["MODE"] in fp_modes)


(DX_SPEC,) = register(
    KernelSpec(
        op=OP, variant="dx", template="moe_gather_qmm_dx.metal",
        inputs=DX_INPUTS, outputs=DX_OUTPUTS, params=DX_PARAMS,
        bindings=_dx_bindings,
        geometry="as moe_gather_qmm_dx with E = 1 (rows = M, every id 0)",
        notes="x-VJP dx = g @ W (float32 weights), mxfp4 / nvfp4 scales",
    ),
)


# ---- checks ---------------------------------------------------------------------------

def _group_size(scales: mx.array, k: int, group_size, mode) -> int:
    """The group size: the mode's (mx.quantize's; a contradicting group_size raises), else
    group_size, else read from the arrays: K / scales' groups per row where that is a group
    size of the scales' format, else 32."""
    if mode is not None:
        check_mode(OP, mode, MODES, or_none=True)
        check_mode_arrays(OP, mode, scales, None)
        return resolve_sizes(OP, mode, group_size, None)[0]
    if group_size is not None:
        return as_int(OP, "group_size", group_size)  # NumPy integers too
    groups = scales.shape[-1] if scales.ndim else 0
    inferred = k // groups if groups and k % groups == 0 else 0
    allowed = ((DEFAULTS["mxfp4"][0], DEFAULTS["nvfp4"][0]) if scales.dtype == mx.uint8
               else FLOAT_SCALE_GROUPS)
    return inferred if inferred in allowed else 32


def _scale_mode(scales: mx.array, group_size: int) -> int:
    """The scale format, from the scale dtype and the group size (an int, validated here)."""
    if scales.dtype == mx.uint8:
        if group_size == 32:
            return SCALE_E8M0
        if group_size == 16:
            return SCALE_E4M3
        raise ValueError(f"[{OP}] uint8 scales are E8M0 (mxfp4, group_size 32) or E4M3 "
                         f"(nvfp4, group_size 16); got group_size {group_size}")
    if scales.dtype in FLOAT_TYPES:
        if group_size not in FLOAT_SCALE_GROUPS:
            raise ValueError(f"[{OP}] group_size must be one of {FLOAT_SCALE_GROUPS} for "
                             f"floating-point scales, got {group_size}")
        return SCALE_FLOAT
    raise TypeError(f"[{OP}] scales must be uint8 (E8M0 / E4M3) or float32, float16, "
                    f"bfloat16, got {dtype_name(scales.dtype)}")


@memo_check
def _check_fp4_qmm(x, w, scales, group_size, mode=None) -> tuple[int, int, int, int, int]:
    """Validate the inputs; return (M, N, K, scale_mode, group_size)."""
    for name, arr in (("x", x), ("w", w), ("scales", scales)):
        require_array(OP, name, arr)
    require_float(OP, "x", x)
    if w.dtype != mx.uint32:
        raise TypeError(f"[{OP}] w must be uint32 (8 E2M1 codes per word), "
                        f"got {dtype_name(w.dtype)}")
    if w.ndim != 2:
        raise ValueError(f"[{OP}] w must have 2 dimensions [N, K/8], got {w.ndim} "
                         f"(shape {tuple(w.shape)})")
    group_size = _group_size(scales, w.shape[1] * 8, group_size, mode)
    scale_mode = _scale_mode(scales, group_size)
    if x.ndim < 1:
        raise ValueError(f"[{OP}] x must have at least 1 dimension [..., K], got 0")
    n, k = w.shape[0], w.shape[1] * 8
    if x.shape[-1] != k:
        raise ValueError(f"[{OP}] x's last axis must be K = 8 * w.shape[1] = {k}, "
                         f"got {x.shape[-1]} (x {tuple(x.shape)}, w {tuple(w.shape)})")
    if n % 32 or n == 0:
        raise ValueError(f"[{OP}] N (w.shape[0]) must be a positive multiple of 32, got {n}")
    if k % 32 or k == 0:
        raise ValueError(f"[{OP}] K (x.shape[-1] = 8 * w.shape[1]) must be a positive "
                         f"multiple of 32, got {k}")
    if k % group_size:
        raise ValueError(f"[{OP}] K = {k} must be a multiple of group_size {group_size}")
    want = (n, k // group_size)
    if tuple(scales.shape) != want:
        named = f" (group_size {group_size} of mode {mode!r})" if mode is not None else ""
        raise ValueError(f"[{OP}] scales must have shape [N, K/group_size] = {want}{named}, "
                         f"got {tuple(scales.shape)}")
    m = math.prod(x.shape[:-1])
    if max(m * k, n * k, m * n) >= _MAX_DIM:
        raise ValueError(f"[{OP}] problem too large for 32-bit indexing: M={m}, N={n}, K={k}")
    return m, n, k, scale_mode, group_size


# ---- reference ------------------------------------------------------------------------

# E2M1 code -> value (bit 3 sign, bits 2-1 exponent, bit 0 mantissa).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _e8m0_table() -> np.ndarray:
    """2^(s - 127) for s in 0..255 in float32 (s = 0 -> 2^-127, s = 255 -> inf; as MLX)."""
    bits = np.arange(256, dtype=np.uint32) << 23
    bits[0] = 0x00400000
    return bits.view(np.float32)


def _e4m3_table() -> np.ndarray:
    """E4M3 byte -> float32 following MLX's decoder (0x7F / 0xFF read as +-480, no NaN)."""
    b = np.arange(256, dtype=np.uint32)
    mag, e, mant = b & 0x7F, (b >> 3) & 0xF, b & 0x7
    normal = ((mag << 20) + (120 << 23)).astype(np.uint32).view(np.float32)
    value = np.where(e == 0, mant.astype(np.float32) * np.float32(2.0**-9), normal)
    return np.where(b & 0x80, -value, value).astype(np.float32)


_TABLES: dict[str, mx.array] = {}


def _table(name: str) -> mx.array:
    if name not in _TABLES:
        _TABLES[name] = mx.array({"e2m1": _E2M1, "e8m0": _e8m0_table(),
                                  "e4m3": _e4m3_table()}[name])
    return _TABLES[name]


def fp4_dequantize_reference(w: mx.array, scales: mx.array, group_size: int | None = None,
                             mode: str | None = None) -> mx.array:
    """The float32 weights [N, K] that ``fp4_qmm`` multiplies by (pure MLX)."""
    group_size = _group_size(scales, w.shape[1] * 8, group_size, mode)
    return _dequantize(w, scales, group_size, _scale_mode(scales, group_size), 1.0)


# code * scale overflows float32 for scales above FLT_MAX / 6 (E8M0 bytes 252..254): the
# products run on weights times WEIGHT_FACTOR (a power of two, exact; |code| <= 6 < 8) and
# the result is divided by it, so every result below float32's max stays finite.
WEIGHT_FACTOR = 0.125


def _dequantize(w, scales, group_size: int, mode: int, factor: float) -> mx.array:
    n, kw = w.shape
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    codes = ((w[:, :, None] >> shifts) & 0xF).reshape(n, kw * 8)
    values = mx.take(_table("e2m1"), codes)
    if mode == SCALE_FLOAT:
        s = scales.astype(mx.float32)
    else:
        s = mx.take(_table("e8m0" if mode == SCALE_E8M0 else "e4m3"), scales.astype(mx.uint32))
    values = values.reshape(n, -1, group_size) * (s * factor)[:, :, None]
    return values.reshape(n, kw * 8)


def fp4_qmm_reference(x: mx.array, w: mx.array, scales: mx.array, *,
                      group_size: int | None = None, mode: str | None = None) -> mx.array:
    """Pure-MLX composite of the same math (float32 products and sums, rounded once).

    The weights are decoded by tables that equal ``mx.dequantize(mode=...)`` bit for bit
    (tested) and also serve the float scales, which no MLX mode takes.
    """
    _, _, _, scale_mode, group_size = _check_fp4_qmm(x, w, scales, group_size, mode)
    return _reference(x, w, scales, group_size, scale_mode)


def _reference(x, w, scales, group_size: int, scale_mode: int) -> mx.array:
    wdq = _dequantize(w, scales, group_size, scale_mode, WEIGHT_FACTOR)
    out = mx.matmul(x.astype(mx.float32), wdq.T) * (1.0 / WEIGHT_FACTOR)
    return out.astype(x.dtype)


# ---- variant choice and launch --------------------------------------------------------

def _auto(backend: str, m: int, dtype: mx.Dtype | None, scale_mode: int | None,
          group_size: int | None = None) -> str:
    """The variant ``auto`` picks: skinny for SKINNY_M[backend] rows where it takes the
    arguments, else the GEMV for few rows, else mpp where the Metal device has matrix units,
    else decoded from _decoded_min_m's rows, else simdgroup."""
    if m in SKINNY_M.get(backend, ()) and _skinny_fits(dtype, scale_mode, group_size):
        return "skinny"
    if m <= QMV_MAX_M:
        return "qmv"
    if backend == "metal" and _device.metal_mpp_reason() is None:
        return "mpp"
    if m >= _decoded_min_m(backend, dtype, scale_mode):
        return "decoded"
    return "simdgroup"


def _choose(backend: str, m: int, variant, dtype: mx.Dtype | None = None,
            scale_mode: int | None = None, group_size: int | None = None
            ) -> KernelSpec | None:
    """The kernel for ``m`` rows of x of ``dtype`` with scales of ``scale_mode`` and
    ``group_size`` (these matter to the decoded and skinny plans only)."""
    spec = choose_variant(OP, VARIANT_SPECS, variant, backend,
                          lambda: _auto(backend, m, dtype, scale_mode, group_size))
    if spec is SKINNY_SPEC and dtype is not None and not _skinny_fits(
            dtype, scale_mode, group_size):
        raise ValueError(
            f"[{OP}] variant 'skinny' takes float16 or bfloat16 x with uint8 (mxfp4 / "
            "nvfp4) scales or float scales of group_size >= 32; got "
            f"{dtype_name(dtype)} x with {_SCALE_NAMES[scale_mode]} scales of group_size "
            f"{group_size}")
    if (spec is DECODED_SPEC and dtype is not None
            and _decoded_dtype(dtype, scale_mode) is None):
        raise ValueError(
            f"[{OP}] variant 'decoded' decodes W into a dtype that holds every weight "
            "exactly and multiplies in it: bfloat16 or float16 x with uint8 (mxfp4 / nvfp4) "
            f"scales; got {dtype_name(dtype)} x with {_SCALE_NAMES[scale_mode]} scales")
    return spec


_SCALE_NAMES = {SCALE_FLOAT: "float", SCALE_E8M0: "E8M0 (mxfp4)", SCALE_E4M3: "E4M3 (nvfp4)"}


def _qmv_rows(m: int, backend: str) -> int:
    """Rows of x per threadgroup of the qmv kernel (MB): next power of two >= min(M, 8), on
    cuda >= min(M, QMV_CUDA_MAX_MB) (the template's LAUNCH PLANS: MB 8's registers)."""
    most = QMV_CUDA_MAX_MB if backend == "cuda" else QMV_MAX_M
    return 1 << (min(m, most) - 1).bit_length()


def _qmv_wfirst(mb: int, backend: str) -> bool:
    """Whether the qmv launch runs the w-first form (QMV_WFIRST_SPEC; MB 8 only):
    QMV_WFIRST where set (every backend), else on cuda (the template's LAUNCH PLANS)."""
    if mb != 8:
        return False
    return backend == "cuda" if QMV_WFIRST is None else bool(QMV_WFIRST)


def _qmv_slices(m: int, n: int, k: int, mb: int, backend: str) -> int:
    """The qmv launch plan's S: SIMD-groups sharing one row block's K steps (the template's
    DISPATCH INVARIANTS). QMV_SLICES where set (every backend). Else Metal and the emulator
    keep one; cuda splits K where the grid is small, for about QMV_TARGET_WARPS warps, at
    most one slice per step of K (32 VPT values) and QMV_MAX_SLICES (QMV_MB8_MAX_SLICES at
    MB 8; w-first: within its launch bounds), the steps dealt evenly (the slice with the
    most steps sets the time)."""
    most = QMV_MAX_SLICES if mb < 8 else QMV_MB8_MAX_SLICES
    if _qmv_wfirst(mb, backend):  # its launch bounds' threads
        most = min(most, QMV_WFIRST_BOUNDS[0] // (backends.SIMD_WIDTH * QMV_SIMDGROUPS))
    if QMV_SLICES is not None:
        if not 1 <= QMV_SLICES <= QMV_MAX_SLICES:
            raise ValueError(f"[{OP}] QMV_SLICES must be None or 1..{QMV_MAX_SLICES}, "
                             f"got {QMV_SLICES}")
        return min(QMV_SLICES, most)
    if backend != "cuda":
        return 1
    steps = -(-k // (32 * (16 if mb <= 2 else 8)))  # the template's STEP = 32 VPT
    warps = QMV_SIMDGROUPS * (n // QMV_ROWS_PER_TG) * -(-m // mb)
    wanted = max(1, min(most, steps, -(-QMV_TARGET_WARPS // warps)))
    per_slice = -(-steps // wanted)
    return -(-steps // per_slice)


def _skinny_rows(m: int) -> int:
    """MF of the skinny kernel: 8-row fragments of x per threadgroup (1, 2 or 4; at most
    SKINNY_MAX_MF)."""
    return 1 << (min(-(-m // 8), SKINNY_MAX_MF) - 1).bit_length()


def _skinny_slices(m: int, n: int, k: int, mf: int) -> int:
    """The skinny launch plan's S (the template's LAUNCH PLAN): K slices for about
    SKINNY_TARGET_WARPS warps, at most one per 32-wide step and the template's MAX_SLICES,
    the steps dealt evenly."""
    steps = k // 32
    tgs = (n // SKINNY_ROWS) * -(-m // (8 * mf))
    wanted = max(1, min(SKINNY_MAX_SLICES, steps, -(-SKINNY_TARGET_WARPS // tgs)))
    per_slice = -(-steps // wanted)
    return -(-steps // per_slice)


def _split_k(m: int, n: int, k: int) -> tuple[int, int]:
    """(parts, Kp): how the simdgroup kernel splits K. As MLX's qmm_splitk, about
    SPLITK_TARGET_TGS threadgroups; each part is Kp = a whole number of 32-wide K steps, the
    last one shorter when the steps do not divide evenly (K = 32 * a prime still splits).
    No part is empty: parts = ceil(K / Kp). Parts need not align with groups: the kernel
    reads the scale of each word it decodes."""
    tiles = (n // TILE) * -(-m // TILE)
    steps = k // TILE
    parts = min(max(1, SPLITK_TARGET_TGS // tiles), steps)
    per_part = -(-steps // parts)
    return -(-steps // per_part), per_part * TILE


def _launcher(spec: KernelSpec, m: int, n: int, k: int, mode: int, group_size: int,
              dtype: mx.Dtype, scale_dtype: mx.Dtype, backend: str,
              out_shape: tuple[int, ...]) -> Callable:
    """The kernel call(s) of x [..., k] (m rows, read as the flat row-major [m, k]) on
    ``backend``, prepared once: returns ``launch(x, w, scales)``, whose output has
    ``out_shape`` ([..., n]: the [m, n] rows as written), so no reshape node goes around
    the kernels."""
    if scale_dtype in (mx.float16, mx.bfloat16):
        scale_dtype = mx.float32  # exact; one kernel build serves all float scales
    t = dtype
    # the group size is a runtime input of qmv and simdgroup, a template argument of mpp
    template = {"T": t, "ST": scale_dtype}
    if spec.variant == "mpp":
        template["GS"] = group_size
    template["SCALE_MODE"] = mode
    inputs = {"x": None, "w": None, "scales": None, "m_rows": scalar(m, mx.uint32),
              "n_cols": scalar(n, mx.uint32), "k_cols": scalar(k, mx.uint32)}
    parts, out_dtype = 1, t
    gs_shift = scalar(group_size.bit_length() - 1, mx.uint32)
    if spec.variant == "skinny":
        mf = _skinny_rows(m)
        threads = backends.SIMD_WIDTH * _skinny_slices(m, n, k, mf)
        template["MF"] = mf
        inputs["gs_shift"] = gs_shift
        grid = (threads, n // SKINNY_ROWS, -(-m // (8 * mf)))
        threadgroup = (threads, 1, 1)
        tg_mem = SKINNY_MAX_SLICES * SKINNY_ROWS * 8 * mf * 4  # the template's regions
    elif spec.variant == "qmv":
        mb = _qmv_rows(m, backend)
        threads = backends.SIMD_WIDTH * QMV_SIMDGROUPS * _qmv_slices(m, n, k, mb, backend)
        wfirst = _qmv_wfirst(mb, backend)
        spec = QMV_WFIRST_SPEC if wfirst else spec
        template.update(MB=mb, WFIRST=int(wfirst))
        inputs["gs_shift"] = gs_shift
        grid = (threads, n // QMV_ROWS_PER_TG, -(-m // mb))
        threadgroup = (threads, 1, 1)
        tg_mem = QMV_MAX_SLICES * QMV_ROWS_PER_TG * mb * 4  # the template's partials
    else:
        threadgroup = (TILE_THREADS, 1, 1)
        if spec.variant == "simdgroup":
            parts, k_part = _split_k(m, n, k)
            out_dtype = t if parts == 1 else mx.float32
            template["OT"] = out_dtype
            inputs.update(gs_shift=gs_shift, k_part=scalar(k_part, mx.uint32))
            # x and w tiles (rows padded to 36) in float, or in T plus a float output
            # tile (the template's STAGING); at most 9216 + 4 bytes either way
            tg_mem = 2 * TILE * (TILE + 4) * 4 + 4
        else:
            tg_mem = TILE * (TILE + 8) * 2 + 2 * TILE * 4  # half w tile + 2 x 32 scales
        grid = (TILE_THREADS * (n // TILE), -(-m // TILE), parts)
    prepared = backends.prepare(
        spec, backend, inputs=inputs, template=template,
        outputs={"out": ((parts, m, n) if parts > 1 else out_shape, out_dtype)},
        grid=grid, threadgroup=threadgroup, threadgroup_memory=tg_mem,
    )
    total = m * n
    summed = None if parts == 1 else backends.prepare(
        SPLITK_SUM_SPEC, backend,
        inputs={"partial": None, "n_parts": scalar(parts, mx.uint32),
                "n_out": scalar(total, mx.uint32)},
        template={"T": t}, outputs={"out": (out_shape, t)},
        grid=(round_up(-(-total // 4), SUM_THREADS), 1, 1), threadgroup=(SUM_THREADS, 1, 1),
    )

    def launch(x, w, scales):
        if scales.dtype in (mx.float16, mx.bfloat16):
            scales = scales.astype(mx.float32)
        (out,) = prepared(x, w, scales)
        if summed is None:
            return out
        (out,) = summed(out)
        return out

    return launch


def _decoder(n: int, k: int, mode: int, group_size: int, dtype: mx.Dtype,
             backend: str) -> tuple[Callable, float]:
    """DECODED_SPEC's kernel for w [n, k / 8] on ``backend``, prepared once: returns
    ``(decode, factor)``, ``decode(w, scales)`` giving W * factor [n, k] in ``dtype`` (a
    _decoded_dtype, exact; factor 1 for float16, whose E4M3 weights stay <= 2688, else
    WEIGHT_FACTOR, so that every E8M0-scaled weight stays finite)."""
    factor = 1.0 if dtype == mx.float16 else WEIGHT_FACTOR
    words = n * k // 8
    prepared = backends.prepare(
        DECODED_SPEC, backend,
        inputs={"w": None, "scales": None, "n_words": scalar(words, mx.uint32),
                "k_words": scalar(k // 8, mx.uint32),
                "gs_shift": scalar(group_size.bit_length() - 1, mx.uint32),
                "factor": scalar(factor, mx.float32)},
        template={"D": dtype, "ST": mx.uint8, "SCALE_MODE": mode},
        outputs={"out": ((n, k), dtype)},
        grid=(round_up(words, DECODE_THREADS), 1, 1), threadgroup=(DECODE_THREADS, 1, 1),
    )

    def decode(w, scales):
        return prepared(w, scales)[0]

    return decode, factor


def _product(a: mx.array, wd: mx.array, factor: float) -> mx.array:
    """``a @ wd / factor`` in a's 16-bit dtype by MLX's matmul (float32 accumulation, rounded
    once; the power-of-two factor undone exactly). wd in a's dtype, or float32: a is then
    taken to float32 (exact), the products exact in TF32 as in float32 (_decoded_dtype), the
    result rounded to a's dtype once. ``a * 1`` (exact) is a fresh buffer: MLX's CUDA matmul
    (cuBLASLt, MLX 0.32.4) raises on 16-bit operands that start off a 16-byte boundary, as a
    view may."""
    if wd.dtype == mx.float32:
        y = float32_matmul(a.astype(mx.float32), wd, a_exact=True, b_exact=True)
        return (y * (1.0 / factor)).astype(a.dtype)
    y = mx.matmul(a * 1, wd)
    return y if factor == 1.0 else y * (1.0 / factor)


def fp4_qmm(x: mx.array, w: mx.array, scales: mx.array, *, group_size: int | None = None,
            mode: str | None = None, variant: str | None = None, stream=None) -> mx.array:
    """``x @ dequantize(w, scales).T`` with fp4 (E2M1) weights, float32 accumulation.

    Args:
      x: ``[..., K]`` float32 / float16 / bfloat16; sets the output dtype.
      w: ``[N, K/8]`` uint32, 8 E2M1 codes per word (code j at bits [4j, 4j+4)), exactly as
        ``mx.quantize(W, mode="mxfp4")`` (or ``"nvfp4"``) returns it.
      scales: ``[N, K/group_size]``: uint8 E8M0 exponents (mxfp4, group_size 32), uint8 E4M3
        (nvfp4, group_size 16), or float32 / float16 / bfloat16 (a plain per-group scale;
        group_size 16, 32, 64 or 128).
      group_size: codes per scale; None: the mode's (32 mxfp4, 16 nvfp4), else read from
        the arrays (K / scales.shape[-1]).
      mode: "mxfp4" or "nvfp4" as ``mx.quantize`` names them (uint8 scales; a contradicting
        scale dtype, group_size or group count raises), or None to read the format from
        the scales.
        Decoding follows MLX's Metal kernels bit for bit: E8M0 s -> 2^(s - 127) (0 -> 2^-127,
        255 -> inf); E4M3 without NaN (0x7F / 0xFF read as +-480, which mx.quantize never
        writes); nvfp4's optional global scale is not taken.
      variant: None (auto) or "qmv", "skinny", "simdgroup", "mpp", "decoded" to force a
        kernel; a variant that cannot run on the current backend raises ValueError, as
        "decoded" does for float32 x and float scales and "skinny" for float32 x or float
        scales of group 16. Kernel backends only.
      stream: MLX's StreamOrDevice (None, an mx.Stream, an mx.Device, mx.cpu / mx.gpu):
        where the composite's ops or the kernel run.

    Returns: ``[..., N]`` in x's dtype. N and K must be multiples of 32.

    Differentiable with respect to x (``g @ W`` on the decoded weights, float32 accumulation:
    on a kernel backend with uint8 scales and at most DX_MAX_M (8) rows one launch of the
    ``fp4_qmm_dx`` kernel, moe_gather_qmm's dx template with one expert; more rows of 16-bit
    x with uint8 scales, W decoded by ``fp4_qmm_decoded`` as the decoded plan does and MLX's
    matmul; otherwise, float32 x, float scales and the reference backend: the composite,
    kept float32 where MLX multiplies float32 in TF32);
    asking for the gradient of w or scales raises.

    Reference backend: ``mx.compile(shapeless=True)`` (any leading dims of x) and
    ``mx.vmap`` over x work (mapping w or scales raises on every backend). On metal / cuda
    MLX 0.32.4 refuses both with its own message (custom kernels have no vmap or shape
    inference there). Mapping a quantized constant raises an ``[op]`` error on every
    backend. The emulator refuses both (eager). README: "mx.compile(shapeless=True) and
    mx.vmap".
    """
    run = _plan(x, w, scales, group_size, mode, variant, backends.resolve_backend(), stream)
    return run(x, w, scales)


@memo_plan
def _plan(x, w, scales, group_size, mode, variant, backend: str, stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(x, w, scales)``. Reads no argument array but its shape and dtype."""
    m, n, k, scale_mode, group_size = _check_fp4_qmm(x, w, scales, group_size, mode)
    out_shape = (*x.shape[:-1], n)
    spec = _choose(backend, m, variant, x.dtype, scale_mode, group_size)
    on_stream(OP, stream)  # refuses what is not a stream
    dtype, x_shape = x.dtype, tuple(x.shape)
    # The decode kernel (prepared once) serves the decoded plan's forward and, past DX_MAX_M
    # rows, the x-VJP's product, wherever the decoded plan takes x's dtype and the scales.
    decoded = _decoded_dtype(dtype, scale_mode)
    decoder = None
    if spec is not None and m > DX_MAX_M and decoded is not None:
        decoder = _decoder(n, k, scale_mode, group_size, decoded, backend)
    launch = None
    if spec is DECODED_SPEC and m > 0:
        decode, factor = decoder if decoder is not None else _decoder(
            n, k, scale_mode, group_size, decoded, backend)

        def launch(x, w, scales):  # W decoded (_decoded_dtype), then x @ W^T (_product)
            return _product(x.reshape(m, k), decode(w, scales).T, factor).reshape(out_shape)
    elif spec is not None and m > 0:
        launch = _launcher(spec, m, n, k, scale_mode, group_size, dtype, scales.dtype,
                           backend, out_shape)

    def forward(x, w, scales):
        if spec is None:
            return _reference(x, w, scales, group_size, scale_mode)
        if m == 0:
            return mx.zeros(out_shape, dtype=x.dtype)
        return launch(x, w, scales)  # any leading dims: the kernel reads flat rows

    dx_launch = None
    if spec is not None and 0 < m <= DX_MAX_M and scale_mode in _DX_MODES:
        dx_launch = dx_launcher(m, n, k, 1, group_size, 4, _DX_MODES[scale_mode], dtype,
                                backend, DX_SPEC, rounded=False)
        expert_ids = mx.array(np.zeros(m, np.uint32))  # every row's expert: the one w

    def x_vjp(g, w, scales):  # run at backward time: the stream again
        # dx = g @ W: the transposed product on the forward's decoded weights, float32.
        if dx_launch is not None:
            dx = dx_launch(g.reshape(m, n), w[None], scales[None], None, expert_ids, True)
            return dx.reshape(x_shape).astype(dtype)
        if decoder is not None and g.dtype == dtype:  # the decoded plan's product
            decode, factor = decoder
            return _product(g.reshape(m, n), decode(w, scales), factor).reshape(x_shape)
        # float32 to float32 accuracy where MLX multiplies float32 in TF32 (float32_matmul):
        # 16-bit g and the uint8-scaled weights (at most 6 significant bits) are exact in
        # TF32; float32 g and float-scaled weights are split.
        wdq = _dequantize(w, scales, group_size, scale_mode, WEIGHT_FACTOR)
        gf = g.reshape(-1, n).astype(mx.float32)
        dx = float32_matmul(gf, wdq, a_exact=g.dtype != mx.float32,
                            b_exact=scale_mode != SCALE_FLOAT)
        return (dx * (1.0 / WEIGHT_FACTOR)).reshape(x_shape).astype(dtype)

    forward = run_on(stream, forward)  # MLX may trace it again later: the stream again
    call = x_vjp_function(OP, forward, run_on(stream, x_vjp), (True, True),
                          names=("w", "scales"))

    def run(x, w, scales):
        if spec is None and shapeless_tracing():  # MLX's autodiff of the composite
            return forward(x, w, scales)
        return call(x, (w, scales))

    return run_on(stream, run)
