"""moe_gather_qmm: MoE grouped quantized matmul (affine, mxfp4, nvfp4, mxfp8) over sorted rows.

Each row ``m`` of ``x`` (a token paired with one of its selected experts, rows sorted by
expert) is multiplied by the transposed quantized weight of its expert ``indices[m]``:
``out[m] = x[m] @ W[indices[m]].T``. The kernels cut the rows into tiles of 8; inside a tile
the rows sharing an expert form a run that dequantises its expert's weight tile once per K
step, so the op is fast from a handful of rows (decode, verification blocks) to thousands
(prefill), where MLX switches between per-pair matvecs and a tiled kernel.

Two kernel paths, one op: ``simdgroup`` (8x8 ``simdgroup_matrix``, every Apple GPU) and
``mpp`` (MetalPerformancePrimitives ``matmul2d`` on the matrix units of Metal 4 GPUs,
macOS >= 26.2 and GPU generation >= 17, the rule MLX uses for its NAX kernels; affine only:
the fp modes run the simdgroup path).
"""

from __future__ import annotations

import functools
import platform
import subprocess

import mlx.core as mx

from .. import backends
from .._registry import FLOAT_DTYPES, KernelInstance, KernelSpec, register
from ._common import (
    FLOAT_TYPES,
    INDEX_TYPES,
    dtype_name,
    require_array,
    require_float,
    require_ndim,
    scalar,
)
from ._modes import MODE_IDS, check_mode, check_mode_arrays, resolve_sizes

OP = "moe_gather_qmm"
BM = 8  # rows per tile (both paths)
BN = 32  # output columns per threadgroup (both paths)
K_TILE = 32  # K must be a multiple of this tile depth (both paths)
SLOTS = BM  # threadgroups per (tile, column block): one per possible run start
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
# (mode, group size, bits) of the fp modes (uint8 scales, no biases), as mx.quantize
FP_MODES = (("mxfp4", 32, 4), ("nvfp4", 16, 4), ("mxfp8", 32, 8))
VARIANTS = ("simdgroup", "mpp")
SIMDGROUP_THREADS = 128  # 4 simdgroups split K
SIMDGROUP_TG_MEMORY = (4 * 8 * 16 + 4 * 16 * 36) * 4  # bytes, as in the template
MPP_THREADS = 32  # one simdgroup: the matmul2d execution_simdgroup scope
MAX_DIM = 2**31 - 1

SIMDGROUP_SPEC, MPP_SPEC = register(
    KernelSpec(
        op=OP, variant="simdgroup", template="moe_gather_qmm_simdgroup.metal",
        dtypes=FLOAT_DTYPES,
        geometry="threadgroup (128,1,1) = 4 simdgroups splitting K; grid (128*N/32, 8, "
                 "ceil(M/8)): (32-column block, run slot, 8-row tile); one run per "
                 "threadgroup, empty slots exit",
        notes="8x8 simdgroup_matrix float products; every Apple GPU; affine, mxfp4, nvfp4, "
              "mxfp8",
    ),
    KernelSpec(
        op=OP, variant="mpp", template="moe_gather_qmm_mpp.metal", dtypes=FLOAT_DTYPES,
        geometry="threadgroup (32,1,1) = one simdgroup; grid (32*N/32, 8, ceil(M/8)): "
                 "(32-column block, run slot, 8-row tile); matmul2d (8, 32, 16)",
        backends=("metal", "emulator"),
        notes="MetalPerformancePrimitives matmul2d; Metal 4, macOS >= 26.2, GPU gen >= 17; "
              "affine only",
    ),
)
_SPECS = {"simdgroup": SIMDGROUP_SPEC, "mpp": MPP_SPEC}
_INPUTS = ("x", "w", "scales", "biases", "indices", "n_rows", "n_experts", "n_cols", "k_dim")
_OUTPUTS = ("out",)


def _check_moe_gather_qmm(x, w, scales, biases, indices, group_size, bits, mode):
    """Validate the inputs; return (M, N, K, E, group_size, bits)."""
    mode = check_mode(OP, mode, MODES)
    for name, arr in (("x", x), ("w", w), ("scales", scales), ("indices", indices)):
        require_array(OP, name, arr)
    check_mode_arrays(OP, mode, scales, biases)
    affine = mode == "affine"
    group_size, bits = resolve_sizes(OP, mode, group_size, bits)
    coded = (("scales", scales), ("biases", biases)) if affine else (("scales", scales),)
    if affine:
        require_array(OP, "biases", biases)
        if bits not in BITS:
            raise ValueError(f"[{OP}] bits must be one of {BITS}, got {bits}")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"[{OP}] group_size must be one of {GROUP_SIZES}, "
                             f"got {group_size}")
    require_float(OP, "x", x)
    for name, arr in coded if affine else ():  # fp modes: uint8 scales (checked above)
        if arr.dtype != x.dtype:
            raise TypeError(f"[{OP}] {name} must have x's dtype {dtype_name(x.dtype)}, "
                            f"got {dtype_name(arr.dtype)}")
    if w.dtype != mx.uint32:
        raise TypeError(f"[{OP}] w must be uint32 (packed as mx.quantize returns it), "
                        f"got {dtype_name(w.dtype)}")
    if indices.dtype not in INDEX_TYPES:
        raise TypeError(f"[{OP}] indices must be uint32 or int32, "
                        f"got {dtype_name(indices.dtype)}")
    require_ndim(OP, "x", x, 2)
    require_ndim(OP, "w", w, 3)
    for name, arr in coded:
        require_ndim(OP, name, arr, 3)
    require_ndim(OP, "indices", indices, 1)
    M, K = x.shape
    E, N, k_words = w.shape
    if K < K_TILE or K % K_TILE:
        raise ValueError(f"[{OP}] K (x.shape[1]) must be a positive multiple of the tile "
                         f"depth {K_TILE}, got {K}")
    if K % group_size:
        raise ValueError(f"[{OP}] K (x.shape[1]) must be a multiple of group_size "
                         f"{group_size}, got {K}")
    if E < 1 or N < 1:
        raise ValueError(f"[{OP}] w must have at least one expert and one row, "
                         f"got shape {tuple(w.shape)}")
    if k_words * 32 != K * bits:
        raise ValueError(f"[{OP}] w must have shape ({E}, {N}, {K * bits // 32}) for K={K} "
                         f"and bits={bits} (K*bits/32 words per row), got {tuple(w.shape)}")
    if N % BN:
        raise ValueError(f"[{OP}] N (w.shape[1]) must be a multiple of {BN}, got {N}")
    want = (E, N, K // group_size)
    for name, arr in coded:
        if tuple(arr.shape) != want:
            raise ValueError(f"[{OP}] {name} must have shape {want} (w's [E, N] and "
                             f"K/group_size with K={K}, group_size={group_size} of mode "
                             f"{mode!r}), got {tuple(arr.shape)}")
    if tuple(indices.shape) != (M,):
        raise ValueError(f"[{OP}] indices must have shape ({M},) (one expert per row of x), "
                         f"got {tuple(indices.shape)}")
    for name, value in (("M", M), ("N", N), ("K", K), ("E", E)):
        if value > MAX_DIM:
            raise ValueError(f"[{OP}] {name} must be < 2^31, got {value}")
    return M, N, K, E, group_size, bits


def _unpack_codes(w: mx.array, bits: int) -> mx.array:
    """[..., K*bits/32] uint32 -> [..., K] uint32 codes (low bits first)."""
    per_word = 32 // bits
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    codes = mx.bitwise_and(mx.right_shift(w[..., None], shifts), (1 << bits) - 1)
    return codes.reshape(*w.shape[:-1], w.shape[-1] * per_word)


def _dequantize_rounded(w, scales, biases, group_size: int, bits: int, dtype,
                        mode: str) -> mx.array:
    """W = T(scale * q + bias) (fp modes: T(scale * fp(q)), MLX's own mx.dequantize, exact
    in float32) computed in float32 and rounded once to T; float32 result."""
    if mode != "affine":
        wf = mx.dequantize(w, scales, None, group_size=group_size, bits=bits, mode=mode,
                           dtype=mx.float32)
        return wf.astype(dtype).astype(mx.float32)
    q = _unpack_codes(w, bits).astype(mx.float32)
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)
    wf = (groups * scales.astype(mx.float32)[..., None]
          + biases.astype(mx.float32)[..., None])
    return wf.reshape(q.shape).astype(dtype).astype(mx.float32)


def moe_gather_qmm_reference(x, w, scales, biases, indices, *, group_size: int | None = None,
                             bits: int | None = None, mode: str = "affine") -> mx.array:
    """Pure-MLX composite of the same math (float32 accumulation, rounded once).

    It materialises float32 weights for min(M, E) experts: [M or E, N, K] (memory-hungry for
    big shapes; it is the test oracle's twin and the fallback, not a fast path). MLX's
    ``mx.gather_qmm`` is not used: it does not round each weight to x's dtype first.
    """
    M, N, K, E, group_size, bits = _check_moe_gather_qmm(x, w, scales, biases, indices,
                                                          group_size, bits, mode)
    if M == 0:
        return mx.zeros((0, N), dtype=x.dtype)
    valid = indices < E
    if indices.dtype == mx.int32:
        valid = valid & (indices >= 0)
    safe = mx.where(valid, indices, 0).astype(mx.uint32)
    xf = x.astype(mx.float32)
    if M <= E:  # gather the packed rows of each row's expert: [M, N, K]
        wr = _dequantize_rounded(w[safe], scales[safe],
                                 None if biases is None else biases[safe], group_size, bits,
                                 x.dtype, mode)
        out = (wr @ xf[:, :, None])[:, :, 0]
    else:  # dequantise every expert once: [E, N, K]
        wd = _dequantize_rounded(w, scales, biases, group_size, bits, x.dtype, mode)
        out = mx.gather_mm(xf[:, None, :], wd.swapaxes(-1, -2), rhs_indices=safe)[:, 0, :]
    out = mx.where(valid[:, None], out, mx.array(float("nan"), dtype=mx.float32))
    return out.astype(x.dtype)


def _parse_version(release: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in release.strip().split(".")) if release.strip() else ()
    except ValueError:
        return ()


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                              timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=1)
def _macos_version() -> tuple[int, ...]:
    version = _parse_version(platform.mac_ver()[0])
    if version[:1] == (16,):
        # macOS 26 shows Python builds linked against an older SDK the compatibility version
        # 16.x; the kernel's product version is the real one.
        version = _parse_version(_sysctl("kern.osproductversion")) or version
    return version


@functools.cache
def _device_architecture() -> str:
    """The Metal device's architecture name, e.g. 'applegpu_g17s' (read once per process)."""
    info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        arch = info_fn().get("architecture", "")
    except Exception:  # no Metal device (or an MLX without the call)
        return ""
    return arch if isinstance(arch, str) else ""


def _architecture_generation(arch: str) -> int:
    """'applegpu_g17s' -> 17: the two digits before the last character, as MLX reads them."""
    if len(arch) < 3:
        return 0
    tens, ones = arch[-3], arch[-2]
    return int(tens) * 10 + int(ones) if (tens + ones).isdigit() else 0


def mpp_unavailable_reason() -> str | None:
    """None if this Metal device runs the MPP (matrix-unit) path, else why not.

    The rule MLX uses for its NAX kernels: macOS >= 26.2 and GPU generation >= 17
    (>= 18 for phone-class GPUs, architecture names ending in 'p').
    """
    if not backends._metal_available():
        return "no Metal device"
    mac = _macos_version()
    if mac < (26, 2):
        shown = ".".join(map(str, mac)) or "unknown"
        return f"needs macOS >= 26.2 (MetalPerformancePrimitives), got {shown}"
    arch = _device_architecture()
    gen = _architecture_generation(arch)
    need = 18 if arch.endswith("p") else 17
    if gen < need:
        return f"needs GPU generation >= {need} (matrix units, M5 or later), got {arch or 'unknown'}"
    return None


def _check_variant(variant) -> None:
    if variant is not None and (not isinstance(variant, str) or variant not in VARIANTS):
        raise ValueError(f"[{OP}] variant must be one of {VARIANTS} or None, got {variant!r}")


def _select_variant(variant: str | None, backend: str, mode: str = "affine") -> str:
    """The kernel variant to run on ``backend`` (a kernel backend) for ``mode`` (the mpp
    kernel is affine only: the fp modes run the simdgroup kernel)."""
    if mode != "affine":
        if variant == "mpp":
            raise ValueError(f"[{OP}] variant 'mpp' runs mode 'affine' only, got mode "
                             f"{mode!r}; use variant='simdgroup' (or None)")
        return "simdgroup"
    if backend == "metal":
        reason = mpp_unavailable_reason()
        if variant == "mpp" and reason is not None:
            raise ValueError(f"[{OP}] variant 'mpp' is unavailable on this device: {reason}; "
                             "use variant='simdgroup'")
        return variant or ("mpp" if reason is None else "simdgroup")
    if variant == "mpp" and backend not in MPP_SPEC.backends:
        raise ValueError(f"[{OP}] variant 'mpp' does not run on the {backend} backend "
                         f"(only on {MPP_SPEC.backends}); use variant='simdgroup'")
    return variant or "simdgroup"


def _template(dtype: mx.Dtype, bits: int, group_size: int, mode: str) -> tuple:
    return (("T", dtype), ("BITS", bits), ("GROUP_SIZE", group_size), ("MODE", MODE_IDS[mode]))


def instantiations(spec: KernelSpec) -> tuple[KernelInstance, ...]:
    """Every instantiation ``_launch`` can make (for compile checks of other backends)."""
    # (bits, group_size, mode, scale dtype or None for x's): affine (both variants), then the
    # fp modes (simdgroup only; uint8 scales, passed again as the unread biases).
    formats = [(bits, gs, "affine", None) for bits in BITS for gs in GROUP_SIZES]
    if spec.variant == "simdgroup":
        formats += [(bits, gs, mode, mx.uint8) for mode, gs, bits in FP_MODES]
    out = []
    for dtype in FLOAT_TYPES:
        for bits, group_size, mode, st in formats:
            st = st or dtype
            for index_dtype in INDEX_TYPES:
                out.append(KernelInstance(
                    template=_template(dtype, bits, group_size, mode),
                    inputs=(("x", dtype, 2), ("w", mx.uint32, 3), ("scales", st, 3),
                            ("biases", st, 3), ("indices", index_dtype, 1),
                            *((name, mx.uint32, 0) for name in _INPUTS[5:])),
                    outputs=(("out", dtype),),
                ))
    return tuple(out)


def _launch(x, w, scales, biases, indices, M, N, K, E, group_size, bits, backend,
            variant, mode) -> mx.array:
    spec = _SPECS[variant]
    if biases is None:  # fp modes: the kernel never reads its biases input
        biases = scales
    if variant == "simdgroup":
        threads, tg_memory = SIMDGROUP_THREADS, SIMDGROUP_TG_MEMORY
    else:
        threads = MPP_THREADS
        tg_memory = 2 * (BM * 16 + BN * 16) * (4 if x.dtype == mx.float32 else 2)
    n_tiles = -(-M // BM)
    (out,) = backends.launch(
        spec, backend,
        inputs=(x, w, scales, biases, indices, scalar(M, mx.uint32), scalar(E, mx.uint32),
                scalar(N, mx.uint32), scalar(K, mx.uint32)),
        input_names=_INPUTS, output_names=_OUTPUTS,
        template=_template(x.dtype, bits, group_size, mode),
        grid=(threads * (N // BN), SLOTS, n_tiles), threadgroup=(threads, 1, 1),
        threadgroup_memory=tg_memory,
        output_shapes=((M, N),), output_dtypes=(x.dtype,),
    )
    return out


def moe_gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                   indices: mx.array, *, group_size: int | None = None,
                   bits: int | None = None, mode: str = "affine",
                   variant: str | None = None) -> mx.array:
    """``out[m] = x[m] @ dequantize(w[indices[m]]).T`` for expert-sorted MoE rows.

    Args:
      x: ``[M, K]`` float32/float16/bfloat16 activations (token x selected expert rows).
      w: ``[E, N, K*bits/32]`` uint32, a stacked ``[E, N, K]`` weight as ``mx.quantize``
        returns it for ``mode``.
      scales, biases: ``[E, N, K/group_size]``. mode "affine": both in x's dtype (scales
        may be negative). mode "mxfp4" / "nvfp4": uint8 E8M0 / E4M3 scales and
        ``biases=None`` (as ``nn.quantize(mode="mxfp4")`` / mlx-lm's QuantizedSwitchLinear
        store gpt-oss's experts); "mxfp8": uint8 E8M0 scales, E4M3 elements (bytes
        0x7F / 0xFF, which mx.quantize never writes, read as +-480 like MLX's Metal
        decoder; MLX's CPU and the reference backend read NaN).
      indices: ``[M]`` uint32/int32, the expert of each row. Any order is correct; sorted
        (equal ids adjacent) is fast. An id outside ``[0, E)`` yields a NaN row and reads
        nothing out of bounds.
      group_size, bits: as ``mx.quantize`` for the mode; None takes its default. affine:
        group_size 32, 64 (default) or 128, bits 4 (default) or 8; mxfp4: 32 and 4;
        nvfp4: 16 and 4; mxfp8: 32 and 8.
      mode: "affine" (default), "mxfp4", "nvfp4" or "mxfp8"; a mode that contradicts the arrays
        (biases, scale dtype, group count) raises.
      variant: None (choose from the device), ``"simdgroup"`` or ``"mpp"``: a kernel
        backend's choice; a variant that cannot run on the current backend, or any variant
        on the reference backend, raises ValueError (as in ``fp4_qmm``). The ``mpp``
        path stages float16/bfloat16 operands as half: bfloat16 activations beyond half's
        range (|x| > 65504) overflow there; ``simdgroup`` has no such limit. The fp modes
        run ``simdgroup`` (``mpp`` is affine only; asking for it raises).

    Requires N % 32 == 0 and K % 32 == 0. Each weight is dequantised as
    ``T(scale * q + bias)`` (fp modes: ``T(scale * fp(q))``) (rounded once to x's dtype, as MLX's quantized kernels see it)
    and the products are accumulated in float32.

    Returns: ``[M, N]`` in x's dtype.

    M, E, N and K are runtime inputs: one kernel instantiation per (variant, dtype, mode,
    bits, group_size, index dtype), plus one more the first time M < 8: MLX passes inputs of
    fewer than 8 elements in Metal's ``constant`` address space, a different kernel source.
    """
    M, N, K, E, group_size, bits = _check_moe_gather_qmm(x, w, scales, biases, indices,
                                                          group_size, bits, mode)
    _check_variant(variant)
    backend = backends.resolve_backend()
    if backend == "reference" and variant is not None:
        raise ValueError(f"[{OP}] variant={variant!r} needs a kernel backend (metal, cuda, "
                         "emulator); the reference backend runs the pure-MLX composite")
    chosen = _select_variant(variant, backend, mode) if backend != "reference" else None
    if M == 0:
        return mx.zeros((0, N), dtype=x.dtype)
    if backend == "reference":
        return moe_gather_qmm_reference(x, w, scales, biases, indices,
                                        group_size=group_size, bits=bits, mode=mode)
    return _launch(x, w, scales, biases, indices, M, N, K, E, group_size, bits, backend,
                   chosen, mode)
