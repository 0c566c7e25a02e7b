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
the fp modes run the simdgroup path). With few rows per expert a backend's plan may run the
rows on expert_qmv's GEMV instead (``gemv``, the same rounded weights: cuda below
GEMV_ROWS_PER_EXPERT rows per expert).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from .. import _device, backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    MODE_IDS,
    MODES,
    QUANTIZED_INPUTS,
    QUANTIZED_PARAMS,
    as_bool,
    check_quantized,
    choose_variant,
    memo_check,
    memo_plan,
    on_stream,
    quantized_bindings,
    require_ndim,
    run_on,
    scalar,
)
from ._grad import shapeless_tracing, sum_to_shape, x_vjp_function

OP = "moe_gather_qmm"
__all__ = ["moe_gather_qmm", "moe_gather_qmm_reference"]
BM = 8  # rows per tile (both paths)
BN = 32  # output columns per threadgroup (both paths)
K_TILE = 32  # K must be a multiple of this tile depth (both paths)
SLOTS = BM  # threadgroups per (tile, column block): one per possible run start
SIMDGROUP_THREADS = 128  # 4 simdgroups split K
MPP_THREADS = 32  # one simdgroup: the matmul2d execution_simdgroup scope
MAX_DIM = 2**31 - 1

_SIGNATURE = dict(
    inputs=(*QUANTIZED_INPUTS, *scalars("n_rows", "n_experts", "n_cols", "k_dim")),
    outputs=(Arg("out", "T", 2),), params=QUANTIZED_PARAMS,
)

SIMDGROUP_SPEC, MPP_SPEC = register(
    KernelSpec(
        op=OP, variant="simdgroup", template="moe_gather_qmm_simdgroup.metal", **_SIGNATURE,
        bindings=quantized_bindings(MODES),
        geometry="threadgroup (128,1,1) = 4 simdgroups splitting K; grid (128*N/32, 8, "
                 "ceil(M/8)): (32-column block, run slot, 8-row tile); one run per "
                 "threadgroup, empty slots exit",
        notes="8x8 simdgroup_matrix float products; every Apple GPU; affine, mxfp4, nvfp4, "
              "mxfp8",
    ),
    KernelSpec(
        op=OP, variant="mpp", template="moe_gather_qmm_mpp.metal", **_SIGNATURE,
        bindings=quantized_bindings(("affine",)),
        geometry="threadgroup (32,1,1) = one simdgroup; grid (32*N/32, 8, ceil(M/8)): "
                 "(32-column block, run slot, 8-row tile); matmul2d (8, 32, 16)",
        backends=("metal", "emulator"), features=(_device.MPP,),
        notes="MetalPerformancePrimitives matmul2d; Metal 4, macOS >= 26.2, GPU gen >= 17; "
              "affine only",
    ),
)
VARIANT_SPECS = {"simdgroup": SIMDGROUP_SPEC, "mpp": MPP_SPEC}

# The x-VJP kernel's geometry (read once per plan; clear_plans() after changing them):
# SIMD-groups per threadgroup splitting N, weight rows whose loads are issued together, and
# rows per tile (the rows of one expert in a tile share each decoded weight), and the row
# count from which DX_ROWS > 1 sorts the rows by expert first (as the forward does; fewer
# rows, e.g. one token's distinct experts at decode, rarely share one).
DX_SIMDGROUPS = 8
DX_UNROLL = 8
DX_ROWS = 4
DX_SORT_MIN_ROWS = 64
# Splitting N across threadgroups (grid z, one float32 partial per slice, summed after): per
# backend, about how many working threadgroups to aim for (absent: one slice), and the
# fewest 32-row blocks of N a slice takes. cuda: a small grid (decode) leaves most of the
# GPU's 132 SMs idle while each SIMD-group walks its blocks serially; 528 = 4 per SM.
# H100, forward + backward us, one slice / 528 (one run each, this machine's spread is
# +-15%): expert_down_combine gpt-oss-20b (4 tokens) 398 / 266, fp4_qmm M1 4096^2 61 / 57;
# expert_qmv Qwen3-30B-A3B down 49 / 54 and gpt-oss 141 / 150, moe_gather_qmm M8 53 / 50.
DX_SLICE_TARGET_TGS = {"cuda": 528}
DX_MIN_SLICE_BLOCKS = 8


def dx_bindings(rounded: bool):
    """The forward's instantiations, each at the current DX_SIMDGROUPS / DX_UNROLL /
    DX_ROWS; ``rounded``: the weights rounded to T (ROUND)."""
    def bindings():
        for binding in quantized_bindings(MODES)():
            yield dict(binding, SIMDGROUPS=DX_SIMDGROUPS, UNROLL=DX_UNROLL, ROWS=DX_ROWS,
                       ROUND=rounded)
    return bindings


# S: the scales' and biases' type (T, or 16-bit with a float32 g: expert_qmv's f32_dx)
DX_PARAMS = (*QUANTIZED_PARAMS, "S", "SIMDGROUPS", "UNROLL", "ROWS", "ROUND")
# The dx template's signature (this op's and expert_qmv's x-VJP): dx holds one [M, K]
# partial per slice of N.
DX_INPUTS = (Arg("g", "T", 2), *QUANTIZED_INPUTS[1:],
             *scalars("n_rows", "n_experts", "n_cols", "k_dim", "n_slices"))
DX_OUTPUTS = (Arg("dx", "float32", 3),)


(DX_SPEC,) = register(KernelSpec(
    op=OP, variant="dx", template="moe_gather_qmm_dx.metal",
    inputs=DX_INPUTS, outputs=DX_OUTPUTS, params=DX_PARAMS, bindings=dx_bindings(True),
    geometry="threadgroup (32*SG,1,1) = SG simdgroups splitting a slice of N; grid "
             "(32*SG*R*ceil(M/R), ceil(K*BITS/32/32), S): (row slot of an R-row tile, "
             "32-word chunk of K, slice of N's 32-row blocks); one run of equal ids per "
             "threadgroup, other slots exit; the S partials [S, M, K] summed after; "
             "SG = DX_SIMDGROUPS, R = DX_ROWS, S = dx_slices (DX_SLICE_TARGET_TGS)",
    notes="x-VJP dx = g @ W[ids] (weights rounded to T as the forward's), float32 out; "
          "affine, mxfp4, nvfp4, mxfp8",
))


def gemv_bindings(rounded: bool):
    """expert_qmv.metal's instantiations: every quantized binding with ROUND = ``rounded``
    (true: this op's weights, rounded to T)."""
    def bindings():
        for binding in quantized_bindings(MODES)():
            yield dict(binding, ROUND=rounded)
    return bindings


# Few rows per expert: the rows as expert_qmv's GEMV pairs (one id each), with this op's
# rounded weights (ROUND), from cuda's plan (GEMV_ROWS_PER_EXPERT).
(GEMV_SPEC,) = register(KernelSpec(
    op=OP, variant="gemv", template="expert_qmv.metal",
    inputs=(*QUANTIZED_INPUTS, Arg("bcast", "uint32", 1),
            *scalars("n_experts", "n_out", "k_in", "n_sel", "x_slot")),
    outputs=(Arg("out", "T", 2),), params=(*QUANTIZED_PARAMS, "S", "ROUND"),
    bindings=gemv_bindings(True),
    geometry="as expert_qmv (pairs = the M rows, k = 1): threadgroup (64 * S, 1, 1), grid "
             "(64 * S, ceil(N / 8), M); rows in any order (no sort)",
    notes="the plan's choice below GEMV_ROWS_PER_EXPERT rows per expert; weights rounded "
          "to T as the simdgroup kernel's",
))
# The plan's switch (read once per plan; clear_plans() after changing it): with variant
# None, M rows run on the GEMV where M < GEMV_ROWS_PER_EXPERT[backend] * E, i.e. while an
# expert has few rows on average; a backend not listed keeps the tiled kernels. The
# tiled kernel's 8-row tiles hold one or two rows of an expert there, so its 128-thread
# threadgroups stage a whole K walk of W for a row or two (H100: 54 GB/s at 8 rows of
# Qwen3-30B-A3B's up projection); the GEMV streams each row's weights with every load in
# flight. MLX's gather_qmm switches from per-row matvecs to its tiled kernel at 4 rows
# per expert. Metal is not listed: whether the GEMV beats the simdgroup / mpp tile there
# is for a Mac to measure.
GEMV_ROWS_PER_EXPERT = {"cuda": 4}


def uses_gemv(M: int, E: int, backend: str, variant) -> bool:
    """Whether the plan runs M rows on the GEMV (GEMV_SPEC) rather than a tiled kernel."""
    per_expert = GEMV_ROWS_PER_EXPERT.get(backend)
    return variant is None and per_expert is not None and 0 < M < per_expert * E


def _lead(x, indices) -> tuple[int, ...] | None:
    """The batch shape of mx.gather_qmm's form (x [..., M, K] with x.ndim >= 3: x.shape[:-2]
    broadcast with indices.shape), or None for the row form (2-D x, one id per row)."""
    if x.ndim < 2:
        raise ValueError(f"[{OP}] x must have at least 2 dimensions ([M, K] rows or "
                         f"[..., M, K] as mx.gather_qmm), got {x.ndim} (shape {tuple(x.shape)})")
    if x.ndim == 2:
        require_ndim(OP, "indices", indices, 1)
        return None
    try:
        return tuple(mx.broadcast_shapes(tuple(x.shape[:-2]), tuple(indices.shape)))
    except ValueError:
        raise ValueError(f"[{OP}] x's batch dimensions {tuple(x.shape[:-2])} (x [..., M, K]) "
                         f"and indices {tuple(indices.shape)} must broadcast (NumPy rules, as "
                         "mx.gather_qmm's rhs_indices)") from None


@memo_check
def _check_moe_gather_qmm(x, w, scales, biases, indices, group_size, bits, mode):
    """Validate the inputs; return (M, N, K, E, group_size, bits, mode, lead): M the rows
    the kernel runs (all of them in mx.gather_qmm's form), lead its batch shape or None."""
    group_size, bits, mode = check_quantized(OP, x, w, scales, biases, indices, group_size,
                                             bits, mode)
    coded = (("scales", scales), ("biases", biases)) if mode == "affine" else \
        (("scales", scales),)
    lead = _lead(x, indices)
    require_ndim(OP, "w", w, 3)
    for name, arr in coded:
        require_ndim(OP, name, arr, 3)
    M, K = x.shape[-2:]
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
    if lead is None and tuple(indices.shape) != (M,):
        raise ValueError(f"[{OP}] indices must have shape ({M},) (one expert per row of x), "
                         f"got {tuple(indices.shape)}")
    if lead is not None:
        M *= math.prod(lead)
    for name, value in (("M", M), ("N", N), ("K", K), ("E", E)):
        if value > MAX_DIM:
            raise ValueError(f"[{OP}] {name} must be < 2^31, got {value}")
    return M, N, K, E, group_size, bits, mode, lead


def _unpack_codes(w: mx.array, bits: int) -> mx.array:
    """[..., K*bits/32] uint32 -> [..., K] uint32 codes (low bits first). Flatten, not a
    reshape to fixed sizes: it stays right under mx.compile(shapeless=True)."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    codes = mx.bitwise_and(mx.right_shift(w[..., None], shifts), (1 << bits) - 1)
    return mx.flatten(codes, -2, -1)


def _dequantize_rounded(w, scales, biases, group_size: int, bits: int, dtype,
                        mode: str) -> mx.array:
    """W = T(scale * q + bias) (fp modes: T(scale * fp(q)), MLX's own mx.dequantize, exact
    in float32) computed in float32 and rounded once to T; float32 result."""
    if mode != "affine":
        wf = mx.dequantize(w, scales, None, group_size=group_size, bits=bits, mode=mode,
                           dtype=mx.float32)
        return wf.astype(dtype).astype(mx.float32)
    q = _unpack_codes(w, bits).astype(mx.float32)
    groups = mx.unflatten(q, -1, (-1, group_size))
    wf = (groups * scales.astype(mx.float32)[..., None]
          + biases.astype(mx.float32)[..., None])
    return mx.flatten(wf, -2, -1).astype(dtype).astype(mx.float32)


def moe_gather_qmm_reference(x, w, scales, biases, indices, *, group_size: int | None = None,
                             bits: int | None = None, mode: str = "affine") -> mx.array:
    """Pure-MLX composite of the same math (float32 accumulation, rounded once).

    It materialises float32 weights for min(ids, E) experts: [ids or E, N, K] (memory-hungry
    for big shapes; it is the test oracle's twin and the fallback, not a fast path). MLX's
    ``mx.gather_qmm`` is not used: it does not round each weight to x's dtype first.
    """
    M, N, K, E, group_size, bits, mode, lead = _check_moe_gather_qmm(
        x, w, scales, biases, indices, group_size, bits, mode)
    return _reference(x, w, scales, biases, indices, lead, M, N, E, group_size, bits, mode)


def _reference(x, w, scales, biases, indices, lead, M, N, E, group_size, bits,
               mode) -> mx.array:
    """Both forms on mx.gather_qmm's broadcasting (the row form as x[:, None, :]), with no
    reshape to fixed sizes, so it traces under mx.compile(shapeless=True) (gather_mm's
    lhs_indices given as a running count: its default is fixed at the trace)."""
    if M == 0:
        return mx.zeros((*lead, x.shape[-2], N) if lead else (0, N), dtype=x.dtype)
    xf = x.astype(mx.float32)
    if lead is None:
        xf = mx.expand_dims(xf, 1)  # [M, 1, K]: one row per id
    valid = indices < E
    if indices.dtype == mx.int32:
        valid = valid & (indices >= 0)
    safe = mx.where(valid, indices, 0).astype(mx.uint32)
    if indices.size <= E:  # the packed weights of each id's expert: [*ids, N, K]
        wr = _dequantize_rounded(w[safe], scales[safe],
                                 None if biases is None else biases[safe], group_size, bits,
                                 x.dtype, mode)
        out = xf @ wr.swapaxes(-1, -2)
    else:  # dequantise every expert once: [E, N, K]
        wd = _dequantize_rounded(w, scales, biases, group_size, bits, x.dtype, mode)
        lhs = None if lead is not None else mx.cumsum(mx.ones_like(safe), axis=0) - 1
        out = mx.gather_mm(xf, wd.swapaxes(-1, -2), lhs_indices=lhs, rhs_indices=safe)
    out = mx.where(mx.expand_dims(valid, (-2, -1)), out, mx.array(float("nan"), mx.float32))
    if lead is None:
        out = mx.squeeze(out, 1)
    return out.astype(x.dtype)


def _rows(x, indices, lead: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """mx.gather_qmm's form as rows: x [*lead, Mx, K] -> [rows, K] (batch-major) and one
    expert id per row (the batch's id for each of its Mx rows)."""
    Mx, K = x.shape[-2:]
    rows = mx.broadcast_to(x, (*lead, Mx, K)).reshape(-1, K)
    return rows, _row_ids(indices, lead, Mx)


def _row_ids(indices, lead: tuple[int, ...], Mx: int) -> mx.array:
    """The expert id of each of ``_rows``' rows."""
    ids = mx.broadcast_to(indices, lead).reshape(-1)
    return mx.repeat(ids, Mx) if Mx > 1 else ids


def _auto(backend: str) -> str:
    """The variant ``auto`` picks: mpp where the Metal device has matrix units."""
    return "mpp" if backend == "metal" and _device.metal_mpp_reason() is None else "simdgroup"


def _select_variant(variant, backend: str, mode: str = "affine") -> KernelSpec | None:
    """The kernel for ``mode`` (the mpp kernel is affine only: the fp modes run the
    simdgroup kernel)."""
    if mode != "affine":
        if variant == "mpp" and backend != "reference":
            raise ValueError(f"[{OP}] variant 'mpp' runs mode 'affine' only, got mode "
                             f"{mode!r}; use variant='simdgroup' (or None)")
        return choose_variant(OP, VARIANT_SPECS, variant, backend, lambda: "simdgroup")
    return choose_variant(OP, VARIANT_SPECS, variant, backend, lambda: _auto(backend))


def _simdgroup_tg_memory(dtype) -> int:
    """Threadgroup bytes of the simdgroup kernel, as in its template: x (4 x 8 x 16) and W^T
    (4 x 16 x 36) staged in T, and the float partial sums (4 x 8 x 36) in an array of their
    own unless T is float32 (they reuse the W slices; a 1-element array remains)."""
    staged = 4 * 8 * 16 + 4 * 16 * 36
    if dtype == mx.float32:
        return staged * 4 + 4
    return staged * 2 + 4 * 8 * 36 * 4


def _dims(M: int, E: int, N: int, K: int) -> dict:
    """The shape inputs both kernels of this module take (0-d uint32, packed by the host)."""
    return {"n_rows": scalar(M, mx.uint32), "n_experts": scalar(E, mx.uint32),
            "n_cols": scalar(N, mx.uint32), "k_dim": scalar(K, mx.uint32)}


def _launcher(spec: KernelSpec, M: int, N: int, K: int, E: int, group_size: int, bits: int,
              mode: str, dtype: mx.Dtype, backend: str) -> Callable:
    """The kernel call of M rows on ``backend``, prepared once: returns
    ``launch(x, w, scales, biases, indices)`` (x [M, K], indices [M])."""
    if spec.variant == "simdgroup":
        threads, tg_memory = SIMDGROUP_THREADS, _simdgroup_tg_memory(dtype)
    else:
        threads = MPP_THREADS
        tg_memory = 2 * (BM * 16 + BN * 16) * (4 if dtype == mx.float32 else 2)
    n_tiles = -(-M // BM)
    prepared = backends.prepare(
        spec, backend,
        inputs={"x": None, "w": None, "scales": None, "biases": None, "indices": None,
                **_dims(M, E, N, K)},
        template={"T": dtype, "BITS": bits, "GROUP_SIZE": group_size,
                  "MODE": MODE_IDS[mode]},
        outputs={"out": ((M, N), dtype)},
        grid=(threads * (N // BN), SLOTS, n_tiles), threadgroup=(threads, 1, 1),
        threadgroup_memory=tg_memory,
    )
    return _rows_launch(prepared)


def _gemv_launcher(M: int, N: int, K: int, E: int, group_size: int, bits: int, mode: str,
                   dtype: mx.Dtype, backend: str) -> Callable:
    """GEMV_SPEC's call of M rows on ``backend``, prepared once: returns
    ``launch(x, w, scales, biases, indices)`` (x [M, K], indices [M], any order)."""
    from .expert_qmv import (  # expert_qmv imports this module
        ROWS_PER_THREADGROUP,
        SIMDGROUPS,
        TARGET_WARPS,
        _bcast_input,
        _k_groups,
    )

    tg = backends.SIMD_WIDTH * SIMDGROUPS * _k_groups(N, K, M, bits, group_size, 4,
                                                      TARGET_WARPS, backend)
    prepared = backends.prepare(
        GEMV_SPEC, backend,
        inputs={"x": None, "w": None, "scales": None, "biases": None, "indices": None,
                "bcast": _bcast_input(((M, 1, 1),)), "n_experts": scalar(E, mx.uint32),
                "n_out": scalar(N, mx.uint32), "k_in": scalar(K, mx.uint32),
                "n_sel": scalar(1, mx.uint32), "x_slot": scalar(0, mx.uint32)},
        template={"T": dtype, "BITS": bits, "GROUP_SIZE": group_size,
                  "MODE": MODE_IDS[mode], "S": dtype if mode == "affine" else mx.uint8,
                  "ROUND": True},
        outputs={"out": ((M, N), dtype)},
        grid=(tg, -(-N // ROWS_PER_THREADGROUP), M), threadgroup=(tg, 1, 1),
    )
    return _rows_launch(prepared)


def _rows_launch(prepared) -> Callable:
    """``launch(x, w, scales, biases, indices)`` -> out of a prepared forward kernel (the fp
    modes' kernels never read their biases input: scales stand in)."""
    def launch(x, w, scales, biases, indices):
        (out,) = prepared(x, w, scales, scales if biases is None else biases, indices)
        return out

    return launch


def _dx_chunks(K: int, bits: int) -> int:
    """The dx kernel's grid y: 32-word chunks of a packed weight row."""
    return -(-(K * bits // 32) // 32)


def dx_slices(M: int, N: int, K: int, bits: int, backend: str) -> int:
    """How many slices of N's 32-row blocks the dx kernel of M rows splits N into on
    ``backend``: the fewest whose working threadgroups (M, each row its own run at worst,
    times K's 32-word chunks, times the slices) reach DX_SLICE_TARGET_TGS[backend], but
    no more than leaves each slice DX_MIN_SLICE_BLOCKS blocks (nor than CUDA's grid z
    allows); 1 for a backend not listed."""
    targets, min_blocks = DX_SLICE_TARGET_TGS, DX_MIN_SLICE_BLOCKS
    if not (isinstance(targets, dict) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 1
            for t in targets.values())
            and isinstance(min_blocks, int) and not isinstance(min_blocks, bool)
            and min_blocks >= 1):
        raise ValueError(f"[{OP}] DX_SLICE_TARGET_TGS must be a dict of backend -> int >= 1 "
                         f"and DX_MIN_SLICE_BLOCKS an int >= 1, got {targets!r} and "
                         f"{min_blocks!r}")
    target = targets.get(backend)
    if target is None:
        return 1
    working = max(1, M * _dx_chunks(K, bits))
    n_blocks = -(-N // 32)
    return max(1, min(-(-target // working), n_blocks // min_blocks,
                      backends.MAX_GRID_Z))


def dx_launcher(M: int, N: int, K: int, E: int, group_size: int, bits: int, mode: str,
                dtype: mx.Dtype, backend: str, spec: KernelSpec = DX_SPEC,
                rounded: bool = True, scale_dtype: mx.Dtype | None = None) -> Callable:
    """The x-VJP kernel (``spec``, this template; ``rounded``: the weights rounded to T;
    ``scale_dtype``: the affine scales' dtype where it is not ``dtype``) of
    M rows on ``backend``, prepared once: returns
    ``launch(g, w, scales, biases, indices, sorted_indices)`` -> dx [M, K] float32 (NaN
    rows for out-of-range ids): the kernel's partials over ``dx_slices`` slices of N,
    summed; with DX_ROWS > 1 and M >= DX_SORT_MIN_ROWS the rows are sorted by expert
    around the kernel unless ``sorted_indices``."""
    sg, unroll, rows, sort_min = DX_SIMDGROUPS, DX_UNROLL, DX_ROWS, DX_SORT_MIN_ROWS
    if not (isinstance(sg, int) and 1 <= sg <= 32 and isinstance(unroll, int)
            and unroll >= 1 and 32 % unroll == 0 and isinstance(rows, int)
            and 1 <= rows <= 32):
        raise ValueError(f"[{OP}] DX_SIMDGROUPS must be an int in [1, 32], DX_UNROLL an "
                         f"int dividing 32 and DX_ROWS an int in [1, 32], got {sg!r}, "
                         f"{unroll!r} and {rows!r}")
    pack = 32 // bits
    chunks = _dx_chunks(K, bits)
    n_slices = dx_slices(M, N, K, bits, backend)  # each slice >= 1 block of N (N > 0)
    prepared = backends.prepare(
        spec, backend,
        inputs={"g": None, "w": None, "scales": None, "biases": None, "indices": None,
                **_dims(M, E, N, K), "n_slices": scalar(n_slices, mx.uint32)},
        template={"T": dtype, "BITS": bits, "GROUP_SIZE": group_size,
                  "MODE": MODE_IDS[mode],
                  "S": scale_dtype or (dtype if mode == "affine" else mx.uint8),
                  "SIMDGROUPS": sg, "UNROLL": unroll,
                  "ROWS": rows, "ROUND": rounded},
        outputs={"dx": ((n_slices, M, K), mx.float32)},
        grid=(32 * sg * rows * -(-M // rows), chunks, n_slices),
        threadgroup=(32 * sg, 1, 1), threadgroup_memory=sg * 32 * (pack + 1) * 4,
    )

    def dx_of(g, w, scales, biases, indices):
        (partials,) = prepared(g, w, scales, biases, indices)
        if n_slices == 1:
            return partials.reshape(M, K)
        return mx.sum(partials, axis=0)  # MLX's reduction: a fixed order, no atomics

    def launch(g, w, scales, biases, indices, sorted_indices):
        if biases is None:  # fp modes: the kernel never reads its biases input
            biases = scales
        if sorted_indices or rows == 1 or M < max(2, sort_min):
            return dx_of(g, w, scales, biases, indices)
        order = mx.argsort(indices)  # the rows of one expert adjacent: one run per tile
        dx = dx_of(g[order], w, scales, biases, indices[order])
        return dx[mx.argsort(order)]

    return launch


def moe_gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                   indices: mx.array, *, group_size: int | None = None,
                   bits: int | None = None, mode: str = "affine",
                   sorted_indices: bool = False, variant: str | None = None,
                   stream=None) -> mx.array:
    """``out[m] = x[m] @ dequantize(w[indices[m]]).T`` for MoE rows, or ``mx.gather_qmm``'s
    form ``mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True)``.

    Args:
      x: float32/float16/bfloat16 activations, either
        ``[M, K]`` rows (token x selected expert), one expert id per row in ``indices [M]``
        (fast when the caller sorted them; taken in the order given), or
        ``[..., M, K]`` (3 or more dimensions) as ``mx.gather_qmm`` takes it: the batch
        dimensions ``x.shape[:-2]`` broadcast with ``indices.shape`` (NumPy rules) and each
        batch's M rows use its expert (mlx-lm's SwitchGLU passes ``x[..., None, None, :]``
        and ``indices [..., k]``). The rows are sorted by expert inside (argsort, gather,
        and the inverse permutation after) unless ``sorted_indices=True``. For
        ``mx.gather_qmm``'s 2-D meaning (every id applied to all M rows) pass ``x[None]``.
      w: ``[E, N, K*bits/32]`` uint32, a stacked ``[E, N, K]`` weight as ``mx.quantize``
        returns it for ``mode``.
      scales, biases: ``[E, N, K/group_size]``. mode "affine": both in x's dtype (scales
        may be negative). mode "mxfp4" / "nvfp4": uint8 E8M0 / E4M3 scales and
        ``biases=None`` (as ``nn.quantize(mode="mxfp4")`` / mlx-lm's QuantizedSwitchLinear
        store gpt-oss's experts); "mxfp8": uint8 E8M0 scales, E4M3 elements (bytes
        0x7F / 0xFF, which mx.quantize never writes, read as +-480 like MLX's Metal
        decoder; MLX's CPU and the reference backend read NaN).
      indices: uint32/int32 expert ids: ``[M]`` for 2-D x, else broadcastable with
        ``x.shape[:-2]``. Any order is correct; sorted (equal ids adjacent) is fast. An id
        outside ``[0, E)`` yields NaN rows and reads nothing out of bounds.
      group_size, bits: as ``mx.quantize`` for the mode; None takes its default. affine:
        group_size 32, 64 (default) or 128, bits 4 (default) or 8; mxfp4: 32 and 4;
        nvfp4: 16 and 4; mxfp8: 32 and 8.
      mode: "affine" (default), "mxfp4", "nvfp4" or "mxfp8"; a mode that contradicts the arrays
        (biases, scale dtype, group count) raises.
      variant: None (choose from the device and the rows: on cuda, fewer than
        GEMV_ROWS_PER_EXPERT rows per expert run a GEMV), ``"simdgroup"`` or ``"mpp"``: a kernel
        backend's choice; a variant that cannot run on the current backend, or any variant
        on the reference backend, raises ValueError (as in ``fp4_qmm``). Both variants
        stage x and the weights in x's own dtype (exact), so the same inputs give the same
        products on either; ``mpp`` needs MetalPerformancePrimitives (macOS >= 26.2). The
        fp modes run ``simdgroup`` (``mpp`` is affine only; asking for it raises).
      sorted_indices: as in ``mx.gather_qmm``: True promises the batch's ids are sorted
        (the form with 3-D or more x then runs its rows as given, no sort).
      stream: MLX's StreamOrDevice (None, an mx.Stream, an mx.Device, mx.cpu / mx.gpu):
        where the composite's ops or the kernels run.

    Requires N % 32 == 0 and K % 32 == 0. Each weight is dequantised as
    ``T(scale * q + bias)`` (fp modes: ``T(scale * fp(q))``) (rounded once to x's dtype, as MLX's quantized kernels see it)
    and the products are accumulated in float32.

    Returns: ``[M, N]`` (2-D x) or ``[*broadcast(x.shape[:-2], indices.shape), M, N]``,
    in x's dtype.

    Differentiable with respect to x (``g @ W[indices]`` with the same rounded weights; a
    row with an out-of-range id gets a NaN gradient, as its NaN output); asking for the
    gradient of w, scales or biases raises. On a kernel backend the gradient is one kernel
    (``moe_gather_qmm_dx``: each row reads its expert's weights once, no dequantised copy).

    M, E, N and K are runtime inputs: one kernel instantiation per (variant, dtype, mode,
    bits, group_size, index dtype), plus one more the first time M < 8: MLX passes inputs of
    fewer than 8 elements in Metal's ``constant`` address space, a different kernel source.

    Reference backend: ``mx.compile(shapeless=True)`` (rows: any M; ``mx.gather_qmm``'s
    form: traced with at most E ids) and ``mx.vmap`` over x and indices (while one call has
    at most E ids: more take ``mx.gather_mm``, which MLX cannot map or trace shapeless, and
    raise). On metal / cuda (MLX 0.32.4) ``mx.compile(shapeless=True)`` raises MLX's
    ``[Primitive::output_shapes] CustomTransforms cannot infer output shapes.`` and
    ``mx.vmap`` MLX's ``[Primitive::vmap] Not implemented for CustomKernel.`` (MLX maps the
    kernel before any rule of the op; a first node refusing with an ``[op]`` error would
    cost about 6 us a call), except that mapping a quantized constant raises an ``[op]``
    error on every backend; the emulator refuses both (eager). README:
    "mx.compile(shapeless=True) and mx.vmap".
    """
    run = _plan(x, w, scales, biases, indices, group_size, bits, mode, sorted_indices,
                variant, backends.resolve_backend(), stream)
    return run(x, w, scales, biases, indices)


@memo_plan
def _plan(x, w, scales, biases, indices, group_size, bits, mode, sorted_indices, variant,
          backend: str, stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(x, w, scales, biases, indices)``. Reads no argument array but its shape and
    dtype."""
    M, N, K, E, group_size, bits, mode, lead = _check_moe_gather_qmm(
        x, w, scales, biases, indices, group_size, bits, mode)
    sorted_indices = as_bool(OP, "sorted_indices", sorted_indices)
    spec = _select_variant(variant, backend, mode)
    on_stream(OP, stream)  # refuses what is not a stream
    dtype, x_shape, n_ids = x.dtype, tuple(x.shape), indices.size
    launch = dx_launch = None
    gemv = spec is not None and uses_gemv(M, E, backend, variant)
    if gemv:
        launch = _gemv_launcher(M, N, K, E, group_size, bits, mode, dtype, backend)
    elif spec is not None and M > 0:
        launch = _launcher(spec, M, N, K, E, group_size, bits, mode, dtype, backend)
    if spec is not None and M > 0:
        dx_launch = dx_launcher(M, N, K, E, group_size, bits, mode, dtype, backend)

    def forward(x, w, scales, biases, indices):
        if launch is None:
            return _reference(x, w, scales, biases, indices, lead, M, N, E, group_size,
                              bits, mode)
        out_shape = (*lead, x.shape[-2], N)
        rows, ids = _rows(x, indices, lead)
        if sorted_indices or gemv or M < 2:  # the GEMV takes the rows in any order
            return launch(rows, w, scales, biases, ids).reshape(out_shape)
        order = mx.argsort(ids)  # rows of one expert adjacent: each tile reads it once
        out = launch(rows[order], w, scales, biases, ids[order])
        return out[mx.argsort(order)].reshape(out_shape)

    def x_vjp(g, w, scales, biases, indices):  # at backward time: the stream again
        if lead is None:
            if dx_launch is not None:  # kernel backends: the dx kernel (float32 out)
                return dx_launch(g, w, scales, biases, indices, sorted_indices).astype(dtype)
            return _x_vjp(g, w, scales, biases, indices, E, group_size, bits, mode, dtype)
        # mx.gather_qmm's form: the rows' gradients, summed over the axes x was
        # broadcast along (in float32).
        ids = _row_ids(indices, lead, x_shape[-2])
        if dx_launch is not None:
            d = dx_launch(g.reshape(-1, N), w, scales, biases, ids, sorted_indices)
        else:
            d = _x_vjp(g.reshape(-1, N), w, scales, biases, ids, E, group_size, bits, mode,
                       dtype, out_dtype=mx.float32)
        d = d.reshape(*lead, x_shape[-2], K)
        return sum_to_shape(d, x_shape).astype(dtype)

    if launch is not None and lead is None:  # rows: the kernel's own layout
        forward = launch
    # The forward and the VJP run on the call's stream (MLX may trace them again later).
    forward, x_vjp = run_on(stream, forward), run_on(stream, x_vjp)
    present = (True, True, biases is not None)
    if spec is not None:  # mx.vmap: MLX refuses the custom kernel itself
        call = x_vjp_function(OP, forward, x_vjp, present)

        def run(x, w, scales, biases, indices):
            return call(x, (w, scales, biases), (indices,))

        return run_on(stream, run)
    # mx.vmap: the composite maps unless it takes mx.gather_mm (more ids than experts),
    # which MLX cannot map: then the constants' wrapper refuses.
    gather_mm = None if n_ids <= E else (
        f"its reference composite takes mx.gather_mm for more ids ({n_ids}) than "
        f"experts ({E}), which MLX (0.32) cannot map; pass the mapped axis as a leading "
        "dimension of x and indices")
    call = x_vjp_function(OP, forward, x_vjp, present, unmapped=gather_mm)

    def run_reference(x, w, scales, biases, indices):
        if shapeless_tracing():
            if lead is not None and n_ids > E:
                raise ValueError(
                    f"[{OP}] mx.compile(shapeless=True) of mx.gather_qmm's form with more "
                    f"ids ({n_ids}) than experts ({E}) is not supported on the "
                    "reference backend: its composite's mx.gather_mm fixes its default "
                    "lhs_indices at the trace (MLX 0.32); pass rows (2-D x) or compile "
                    "without shapeless=True")
            return forward(x, w, scales, biases, indices)
        return call(x, (w, scales, biases), (indices,))

    return run_on(stream, run_reference)


def _x_vjp(g, w, scales, biases, indices, E, group_size, bits, mode, dtype,
           out_dtype=None) -> mx.array:
    """The reference backend's x-VJP (the kernel backends launch DX_SPEC's kernel, the same
    math): dx[m] = g[m] @ W[indices[m]] with the weights the forward multiplies by (each
    rounded to x's dtype), float32; a row with an out-of-range id gets NaN, as its output.
    Returned in ``out_dtype`` (default: x's dtype). float32 x: the rounding is exact, so
    MLX's gather_qmm(transpose=False) in float32 multiplies by those weights without
    materialising them. float16/bfloat16: the rounded weights of the rows' experts (fewer
    rows than experts: one copy per row) or of the whole stack (otherwise), whichever is
    smaller: the row count is a shape, so the choice needs no host sync."""
    valid = indices < E
    if indices.dtype == mx.int32:
        valid = valid & (indices >= 0)
    safe = mx.where(valid, indices, 0).astype(mx.uint32)
    gf = g.astype(mx.float32)[:, None, :]
    if dtype == mx.float32:
        d = mx.gather_qmm(gf, w, scales, biases, rhs_indices=safe, transpose=False,
                          group_size=group_size, bits=bits, mode=mode)[:, 0, :]
    elif g.shape[0] < E:  # [M, N, K]: only the experts the rows name
        wd = _rounded_weights(w[safe], scales[safe], None if biases is None else
                              biases[safe], group_size, bits, dtype, mode)
        d = mx.matmul(gf, wd)[:, 0, :]
    else:
        wd = _rounded_weights(w, scales, biases, group_size, bits, dtype, mode)  # [E, N, K]
        d = mx.gather_mm(gf, wd, rhs_indices=safe)[:, 0, :]
    return mx.where(valid[:, None], d, mx.array(float("nan"))).astype(out_dtype or dtype)


def _rounded_weights(w, scales, biases, group_size: int, bits: int, dtype,
                     mode: str) -> mx.array:
    """``_dequantize_rounded``'s float32 weights (the same values), for the backward. Affine
    codes are read as bytes (4 bits: low nibble first, the order of ``_unpack_codes`` on
    MLX's little-endian devices) instead of shifted out of words per element: no [..., K]
    uint32 intermediate. (mx.compile would fuse the steps, but MLX runs a compiled function
    uncompiled inside a VJP, where its inputs are tracers.)"""
    if mode != "affine":
        return _dequantize_rounded(w, scales, biases, group_size, bits, dtype, mode)
    codes = w.view(mx.uint8)
    if bits == 4:
        codes = mx.flatten(mx.stack([codes & 15, codes >> 4], axis=-1), -2, -1)
    q = mx.unflatten(codes, -1, (-1, group_size)).astype(mx.float32)
    wf = q * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return mx.flatten(wf.astype(dtype).astype(mx.float32), -2, -1)
