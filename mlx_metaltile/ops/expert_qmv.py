"""expert_qmv: MoE decode GEMV over the experts a GPU router chose, in one dispatch.

A decode step's router picks ``k`` experts per token on the GPU. Fetching those ids to the
host to loop over ``mx.quantized_matmul`` costs a sync per layer; this op reads them from a
device array instead and computes every selected expert's quantized GEMV in one kernel.
Experts nobody selected are never read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    MODE_IDS,
    QUANTIZED_INPUTS,
    QUANTIZED_PARAMS,
    check_quantized,
    empty_call,
    keep_plan,
    memo_check,
    memo_plan,
    on_stream,
    plan_memory,
    run_on,
    scalar,
)
from ._grad import (
    GATHER_QMM_REASON,
    refuse_shapeless,
    shapeless_tracing,
    sum_to_shape,
    x_vjp_function,
)
from .moe_gather_qmm import (
    DX_INPUTS,
    DX_OUTPUTS,
    DX_PARAMS,
    dx_bindings,
    dx_launcher,
    gemv_bindings,
)

OP = "expert_qmv"
__all__ = ["expert_qmv", "expert_qmv_reference"]
SIMDGROUPS = 2  # SIMD-groups per threadgroup (matches the template)
ROWS = 4  # output rows per SIMD-group (matches the template)
ROWS_PER_THREADGROUP = SIMDGROUPS * ROWS


def _with_f32(bindings):
    """``bindings`` and, for each affine one of float16 / bfloat16, its float32 twin with
    the 16-bit scales kept (S): the fused MoE ops' backward multiplies float32 activations
    or cotangents by 16-bit experts without widening them (f32_product, f32_dx)."""
    def more():
        for binding in bindings():
            yield binding
            if binding["MODE"] == MODE_IDS["affine"] and binding["T"] != mx.float32:
                yield dict(binding, T=mx.float32)
    return more


(SPEC,) = register(
    KernelSpec(
        op=OP, variant="simd_rows", template="expert_qmv.metal",
        inputs=(*QUANTIZED_INPUTS, Arg("bcast", "uint32", 1),
                *scalars("n_experts", "n_out", "k_in", "n_sel", "x_slot")),
        outputs=(Arg("out", "T", 2),), params=(*QUANTIZED_PARAMS, "S", "ROUND"),
        bindings=_with_f32(gemv_bindings(False)),
        geometry="threadgroup (64 * S, 1, 1): 2 row blocks of 4 output rows x S K groups "
                 "(S = 1 on Metal; cuda: K split where the grid is small); "
                 "grid (64 * S, ceil(N / 8), tokens * k): one threadgroup per (pair, 8-row tile)",
        notes="affine bits 4/8, group_size 32/64/128; mxfp4, nvfp4, mxfp8; ids >= E (or "
              "< 0) give a NaN row",
    ),
)
# The x-VJP: moe_gather_qmm's dx kernel over the (token, expert) pairs, with the float32
# weights scale * q + bias (this op's weights are not rounded to x's dtype: ROUND false).
(DX_SPEC,) = register(
    KernelSpec(
        op=OP, variant="dx", template="moe_gather_qmm_dx.metal",
        inputs=DX_INPUTS, outputs=DX_OUTPUTS, params=DX_PARAMS,
        bindings=_with_f32(dx_bindings(False)),
        geometry="as moe_gather_qmm_dx (rows = the tokens * k pairs; N any)",
        notes="x-VJP per pair dx = g @ W[id] (float32 weights), summed over the k experts "
              "and the broadcast axes after it",
    ),
)
# Leading dimensions of the broadcast token grid the kernel walks (after merging): the
# `bcast` input holds (size, x row stride, indices stride) for each, BCAST_DIMS * 3 uints.
BCAST_DIMS = 4  # matches the template


def _broadcast_lead(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """NumPy broadcast of two leading shapes (aligned on the right, the shorter padded with
    1s on the left; sizes equal or 1), or None."""
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + tuple(a)
    b = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for p, q in zip(a, b, strict=True):
        if p != q and p != 1 and q != 1:
            return None
        out.append(q if p == 1 else p)
    return tuple(out)


@memo_check
def _check_expert_qmv(x, w, scales, biases, indices, group_size, bits, mode) -> dict:
    """Validate the inputs; return the derived sizes and the x layout."""
    group_size, bits, mode = check_quantized(OP, x, w, scales, biases, indices, group_size,
                                             bits, mode)
    affine = mode == "affine"
    coded = (("scales", scales), ("biases", biases)) if affine else (("scales", scales),)

    # weights: w [E, N, K*bits/32], scales/biases [E, N, K/group_size]
    for name, arr in (("w", w), *coded):
        if arr.ndim != 3:
            raise ValueError(f"[{OP}] {name} must have 3 dimensions [E, N, ...], got "
                             f"{arr.ndim} (shape {tuple(arr.shape)})")
    n_experts, n_out, words = w.shape
    for name, arr in coded:
        if tuple(arr.shape[:2]) != (n_experts, n_out):
            raise ValueError(f"[{OP}] {name} must have shape ({n_experts}, {n_out}, K/group_size) "
                             f"to match w {tuple(w.shape)}, got {tuple(arr.shape)}")
    if affine and tuple(biases.shape) != tuple(scales.shape):
        raise ValueError(f"[{OP}] biases must have scales' shape {tuple(scales.shape)}, "
                         f"got {tuple(biases.shape)}")
    if n_experts < 1:
        raise ValueError(f"[{OP}] w must hold at least one expert, got E = 0")
    in_features = words * 32 // bits
    if in_features < 1:
        raise ValueError(f"[{OP}] K must be >= 1, got w with {words} packed words per row")
    if in_features % group_size:
        raise ValueError(f"[{OP}] K = {in_features} (w's {words} words x {32 // bits} values "
                         f"of {bits} bits) must be a multiple of group_size {group_size}")
    n_groups = scales.shape[2]
    if n_groups * group_size != in_features:
        raise ValueError(f"[{OP}] scales must have K/group_size = {in_features}/{group_size} = "
                         f"{in_features // group_size} groups per row, got {n_groups} "
                         f"(w packs K = {in_features} at bits={bits}; are mode {mode!r}, bits "
                         "and group_size the ones used to quantize?)")

    # ids and activations
    if indices.ndim < 1:
        raise ValueError(f"[{OP}] indices must have at least 1 dimension [..., k], got 0")
    k = indices.shape[-1]
    idx_lead = tuple(indices.shape[:-1])
    if x.ndim < 1 or x.shape[-1] != in_features:
        got = x.shape[-1] if x.ndim else "a 0-d array"
        raise ValueError(f"[{OP}] x's last axis must be K = {in_features} (from w and bits="
                         f"{bits}), got {got} (x shape {tuple(x.shape)})")
    if x.ndim == indices.ndim + 1:
        if x.shape[-2] not in (k, 1):
            raise ValueError(f"[{OP}] x [..., k, K] (one input per expert, read from x.ndim "
                             f"= indices.ndim + 1 = {x.ndim}) must have x.shape[-2] = k = {k} "
                             f"(indices' last axis) or 1, got {x.shape[-2]}")
        # A k axis of size 1 broadcasts over the k experts (as in mx.gather_qmm): shared.
        shared = x.shape[-2] != k
        x_lead = tuple(x.shape[:-2])
    else:  # any other rank: one activation per token, [..., K]
        shared = True
        x_lead = tuple(x.shape[:-1])
    lead = _broadcast_lead(x_lead, idx_lead)
    if lead is None:
        raise ValueError(f"[{OP}] the leading dimensions of x {x_lead} and indices {idx_lead} "
                         "must broadcast (NumPy rules: aligned on the right, sizes equal "
                         "or 1)")
    tokens = math.prod(lead)
    if tokens * k >= 2**32:
        raise ValueError(f"[{OP}] too many (token, expert) pairs: {tokens * k} >= 2^32")
    return dict(n_experts=n_experts, n_out=n_out, in_features=in_features, k=k, lead=lead,
                x_lead=x_lead, idx_lead=idx_lead, tokens=tokens, shared=shared,
                x_k_axis=x.ndim == indices.ndim + 1, group_size=group_size, bits=bits,
                mode=mode)


def _out_shape(info: dict) -> tuple[int, ...]:
    return (*info["lead"], info["k"], info["n_out"])


def expert_qmv_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                         indices: mx.array, *, group_size: int | None = None,
                         bits: int | None = None, mode: str = "affine") -> mx.array:
    """Pure-MLX composite (``mx.gather_qmm(..., mode=mode)``) with the same contract, NaN
    rows included.

    Like the kernel it accumulates in float32 and rounds once: float16/bfloat16 inputs are
    widened first (only the selected experts' scales and biases when there are fewer
    (token, expert) pairs than experts, as in decode; all of them otherwise; the uint8
    scales of the fp modes stay as they are).
    """
    info = _check_expert_qmv(x, w, scales, biases, indices, group_size, bits, mode)
    out_shape = _out_shape(info)
    if 0 in out_shape:
        return mx.zeros(out_shape, dtype=x.dtype)
    return _reference(x, w, scales, biases, indices, info)


def _reference(x, w, scales, biases, indices, info: dict) -> mx.array:
    affine = info["mode"] == "affine"
    out_shape = _out_shape(info)
    valid = indices < info["n_experts"]
    if indices.dtype == mx.int32:
        valid = valid & (indices >= 0)
    safe = mx.where(valid, indices, 0).astype(mx.uint32)
    xq = mx.expand_dims(x, -2 if info["x_k_axis"] else (-3, -2))
    if x.dtype != mx.float32:
        pairs = info["tokens"] * info["k"]
        if pairs < info["n_experts"]:
            ids_shape = (*info["lead"], info["k"])
            selected = mx.broadcast_to(safe, ids_shape).reshape(pairs)
            w, scales = w[selected], scales[selected]
            biases = biases[selected] if affine else None
            safe = mx.arange(pairs, dtype=mx.uint32).reshape(ids_shape)
        xq = xq.astype(mx.float32)
        if affine:
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    y = mx.gather_qmm(xq, w, scales, biases, rhs_indices=safe, transpose=True,
                      group_size=info["group_size"], bits=info["bits"], mode=info["mode"])
    y = mx.squeeze(y, axis=-2)
    y = mx.where(mx.expand_dims(valid, -1), y, mx.array(float("nan"), dtype=y.dtype))
    if tuple(y.shape) != out_shape:  # never so far: a fixed-size op would pin a shapeless trace
        y = mx.broadcast_to(y, out_shape)
    return y.astype(x.dtype)


def _row_strides(shape: tuple[int, ...], rank: int, unit: int) -> list[int]:
    """Row-major strides (in ``unit``s) of ``shape`` right-aligned to ``rank`` dimensions,
    0 where the array has size 1 (a broadcast dimension) or no dimension at all."""
    shape = (1,) * (rank - len(shape)) + tuple(shape)
    strides, step = [], unit
    for n in reversed(shape):
        strides.append(step if n != 1 else 0)
        step *= n
    return strides[::-1]


def _bcast_dims(info: dict) -> tuple[tuple[int, int, int], ...]:
    """The token grid as (size, x row stride, indices stride) per dimension, outermost first:
    token t with coordinates c_d reads x row sum c_d * xs_d (+ slot j for a per-expert x)
    and ids at sum c_d * is_d + j. Dimensions of size 1 are dropped and neighbours that step
    both arrays alike are merged, so the list is short unless broadcasts alternate."""
    return _bcast_dims_of(info["lead"], info["k"], info["x_lead"], info["idx_lead"],
                          info["shared"])


@lru_cache(maxsize=1024)
def _bcast_dims_of(lead, k, x_lead, idx_lead, shared) -> tuple[tuple[int, int, int], ...]:
    rank = len(lead)
    xs = _row_strides(x_lead, rank, 1 if shared else k)
    ids = _row_strides(idx_lead, rank, k)
    dims: list[tuple[int, int, int]] = []
    for n, xd, idd in zip(lead, xs, ids, strict=True):
        if n == 1:
            continue
        if dims:
            pn, px, pi = dims[-1]
            if px == xd * n and pi == idd * n:
                dims[-1] = (pn * n, xd, idd)
                continue
        dims.append((n, xd, idd))
    return tuple(dims)


@lru_cache(maxsize=1024)
def _bcast_input(dims: tuple[tuple[int, int, int], ...]) -> mx.array:
    """The kernel's ``bcast`` input: BCAST_DIMS (size, x stride, ids stride) triples, the
    innermost last, padded on the outside with size-1 dimensions (cached: a decode loop
    passes the same array every step)."""
    padded = [(1, 0, 0)] * (BCAST_DIMS - len(dims)) + list(dims)
    return mx.array([v for triple in padded for v in triple], dtype=mx.uint32)


MAX_K_GROUPS = 8  # matches the template
# cuda plan: warps wanted in flight (an H100 holds 64 per SM on 132 SMs; a decode GEMV's
# grid of 4-row SIMD-groups gives 1-3 thousand at one token).
TARGET_WARPS = 4096


def _k_groups(n_out: int, n_in: int, pairs: int, bits: int, group_size: int, words: int,
              target_warps: int, backend: str) -> int:
    """The launch plan's S: SIMD-groups sharing one row block's K steps (the template's
    DISPATCH INVARIANTS; ``words``: the template's words per lane per step, at most). Metal
    keeps one. cuda splits K where the grid is small, for about ``target_warps`` warps, at most
    one per 32-lane step of K and MAX_K_GROUPS, the steps dealt evenly (the group with the
    most steps sets the time), and only where N is a multiple of 8 (no row block past N:
    every thread of a threadgroup reaches the combine's barrier)."""
    if backend != "cuda" or n_out % ROWS_PER_THREADGROUP:
        return 1
    lane_values = min(words, group_size * bits // 32) * (32 // bits)
    steps = -(-(n_in // lane_values) // backends.SIMD_WIDTH)
    warps = SIMDGROUPS * (n_out // ROWS_PER_THREADGROUP) * pairs
    wanted = max(1, min(MAX_K_GROUPS, steps, -(-target_warps // warps)))
    per_group = -(-steps // wanted)
    return -(-steps // per_group)


def _launcher(info: dict, backend: str, dtype: mx.Dtype,
              scale_dtype: mx.Dtype | None = None) -> Callable:
    """The kernel call of ``info``'s problem on ``backend``, prepared once: returns
    ``launch(x, w, scales, biases, indices)``; ``scale_dtype``: the affine scales' dtype
    where it is not ``dtype`` (f32_product)."""
    lead, k, n_out, n_in = info["lead"], info["k"], info["n_out"], info["in_features"]
    pairs = info["tokens"] * k
    dims = _bcast_dims(info)
    x_shape = idx_shape = None
    squeeze = info["x_k_axis"] and info["shared"]  # [..., 1, K]: one activation per token
    if len(dims) > BCAST_DIMS:
        # Broadcasts alternating over more dimensions than the kernel walks: materialise
        # both arrays on the token grid (a copy), which leaves one dimension.
        x_shape = (*lead, n_in) if info["shared"] else (*lead, k, n_in)
        idx_shape = (*lead, k)
        dims = _bcast_dims({**info, "x_lead": lead, "idx_lead": lead})
    tg = backends.SIMD_WIDTH * SIMDGROUPS * _k_groups(
        n_out, n_in, pairs, info["bits"], info["group_size"], 4, TARGET_WARPS, backend)
    prepared = backends.prepare(
        SPEC, backend,
        inputs={"x": None, "w": None, "scales": None, "biases": None, "indices": None,
                "bcast": _bcast_input(tuple(dims)),
                "n_experts": scalar(info["n_experts"], mx.uint32),
                "n_out": scalar(n_out, mx.uint32), "k_in": scalar(n_in, mx.uint32),
                "n_sel": scalar(k, mx.uint32),
                "x_slot": scalar(0 if info["shared"] else 1, mx.uint32)},
        template={"T": dtype, "BITS": info["bits"], "GROUP_SIZE": info["group_size"],
                  "MODE": MODE_IDS[info["mode"]],
                  "S": scale_dtype or (dtype if info["mode"] == "affine" else mx.uint8),
                  "ROUND": False},
        # [..., k, N] as the kernel writes it, [pairs, N] row-major: no reshape node after it
        outputs={"out": (_out_shape(info), dtype)},
        grid=(tg, -(-n_out // ROWS_PER_THREADGROUP), pairs), threadgroup=(tg, 1, 1),
    )

    def launch(x, w, scales, biases, indices):
        if x_shape is not None:
            if squeeze:
                x = mx.squeeze(x, axis=-2)
            x = mx.broadcast_to(x, x_shape)
            indices = mx.broadcast_to(indices, idx_shape)
        if biases is None:  # fp modes: the kernel never reads its biases input
            biases = scales
        # x and indices as given: the kernel reads them as flat row-major memory (MLX copies
        # one that is not row-contiguous), so no reshape or squeeze nodes go before it.
        (out,) = prepared(x, w, scales, biases, indices)
        return out

    return launch


def expert_qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
               indices: mx.array, *, group_size: int | None = None, bits: int | None = None,
               mode: str = "affine", stream=None) -> mx.array:
    """Quantized GEMVs of the experts named by device-resident ``indices``, one dispatch.

    Args:
      x: ``[..., K]`` (one activation per token, shared by its k experts: gate/up
        projections) or ``[..., k, K]`` (one input per selected expert: the down
        projection); float32/float16/bfloat16; sets the output dtype. The layout is read
        from the rank: ``x.ndim == indices.ndim + 1`` is one input per expert (a k axis of
        size 1 broadcasts over the k experts, as in ``mx.gather_qmm``); any other rank is
        one activation per token. So a per-expert x has exactly as many leading dimensions
        as indices (add size-1 axes to line them up).
      w: ``[E, N, K * bits / 32]`` uint32, as ``mx.quantize`` returns it for ``W [E, N, K]``.
      scales, biases: ``[E, N, K / group_size]``. mode "affine": both in x's dtype,
        ``W ~ scale * q + bias``. mode "mxfp4" / "nvfp4": uint8 E8M0 / E4M3 scales and
        ``biases=None``, ``W = scale * e2m1(q)`` (gpt-oss's experts as
        ``nn.quantize(mode="mxfp4")`` stores them); "mxfp8": uint8 E8M0 scales,
        ``W = scale * e4m3(q)`` (element bytes 0x7F / 0xFF, which mx.quantize never
        writes, read as +-480 like MLX's Metal decoder; MLX's CPU and the reference
        backend read NaN).
      indices: ``[..., k]`` uint32 or int32 expert ids, left on the device. The leading
        dimensions of x and indices broadcast with NumPy rules (aligned on the right, the
        shorter padded with 1s, sizes equal or 1), as ``mx.gather_qmm`` broadcasts them
        for ``x[..., None, None, :]`` (shared) or ``x[..., None, :]`` (per expert); the
        kernel reads broadcast arrays in place.
      group_size, bits: as ``mx.quantize`` for the mode; None takes its default. affine:
        group_size 32, 64 (default) or 128, bits 4 (default) or 8; mxfp4: 32 and 4;
        nvfp4: 16 and 4; mxfp8: 32 and 8.
      mode: "affine" (default), "mxfp4", "nvfp4" or "mxfp8"; a mode that contradicts the arrays
        (biases, scale dtype, group count) raises.
      stream: MLX's StreamOrDevice (None, an mx.Stream, an mx.Device, mx.cpu / mx.gpu):
        where the composite's ops or the kernel run.

    Returns: ``[..., k, N]`` in x's dtype, accumulated in float32. An id outside ``[0, E)``
    gives a NaN output row (no out-of-bounds read; nothing is synced to check it).

    Differentiable with respect to x (the transposed product with the float32 weights: on a
    kernel backend one launch of the ``expert_qmv_dx`` kernel, moe_gather_qmm's dx template
    without the rounding to x's dtype; on the reference backend MLX's
    ``gather_qmm(transpose=False)``; a pair with an out-of-range id gives its x a NaN
    gradient, as its NaN output row); asking for the gradient of w, scales or biases raises.

    Sizes, k and the broadcast pattern are runtime inputs: one kernel instantiation per
    (dtype, mode, bits, group_size, index dtype), plus one more the first time ``indices`` holds
    fewer than 8 ids (for example k = 2 for one token): MLX passes such small inputs in
    Metal's ``constant`` address space, which is a different kernel source.

    Reference backend: ``mx.compile(shapeless=True)`` and ``mx.vmap`` raise an
    ``[expert_qmv]`` error: the composite is ``mx.gather_qmm``, which MLX 0.32 cannot map
    and whose default ``lhs_indices`` a shapeless trace fixes. On metal / cuda MLX 0.32.4
    refuses both with its own message (custom kernels have no vmap or shape inference
    there). Mapping a quantized constant raises an ``[op]`` error on every backend. The
    emulator refuses both (eager). README: "mx.compile(shapeless=True) and mx.vmap".
    """
    run = _plan(x, w, scales, biases, indices, group_size, bits, mode,
                backends.resolve_backend(), stream)
    return run(x, w, scales, biases, indices)


@memo_plan
def _plan(x, w, scales, biases, indices, group_size, bits, mode, backend: str,
          stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(x, w, scales, biases, indices)``. Reads no argument array but its shape and
    dtype."""
    info = _check_expert_qmv(x, w, scales, biases, indices, group_size, bits, mode)
    out_shape = _out_shape(info)
    on_stream(OP, stream)  # refuses what is not a stream
    dtype, x_shape = x.dtype, tuple(x.shape)
    if 0 in out_shape:
        return empty_call(OP, stream, out_shape, dtype)
    reference = backend == "reference"
    launch = None if reference else _launcher(info, backend, dtype)
    k, n_out, n_in = info["k"], info["n_out"], info["in_features"]
    dx_launch = None if reference else dx_launcher(
        info["tokens"] * k, n_out, n_in, info["n_experts"], info["group_size"],
        info["bits"], info["mode"], dtype, backend, DX_SPEC, rounded=False)

    def composite(x, w, scales, biases, indices):
        return _reference(x, w, scales, biases, indices, info)

    def x_vjp(g, w, scales, biases, indices):  # at backward time: the stream again
        if dx_launch is None:
            return _x_vjp(g, w, scales, biases, indices, x_shape, dtype, info)
        # kernel backends: each pair's dx (float32, NaN for an out-of-range id), then summed
        # as _x_vjp sums them
        d = dx_launch(g.reshape(-1, n_out), w, scales, biases, pair_ids(indices, info),
                      False)
        return sum_pairs(d, x_shape, info).astype(dtype)

    # The forward and the VJP run on the call's stream (MLX may trace them again later).
    # mx.vmap: the reference composite (mx.gather_qmm) is refused by the constants'
    # wrapper, which watches the other inputs there; a kernel backend's custom kernel by
    # MLX (a refusal here would cost a call).
    call = x_vjp_function(OP, run_on(stream, composite if reference else launch),
                          run_on(stream, x_vjp), (True, True, biases is not None),
                          unmapped=GATHER_QMM_REASON if reference else None)

    def run(x, w, scales, biases, indices):
        if reference and shapeless_tracing():
            refuse_shapeless(OP)
        return call(x, (w, scales, biases), (indices,))

    return run_on(stream, run)


def _f32_experts(w, scales, biases, indices, info: dict) -> tuple:
    """The operands of float32 products over the selected experts, for the reference
    backend's backward passes (the fused ops'; kernel backends: f32_product, pair_dx):
    (w, scales, biases, ids, valid), ids in [0, len(w)) for mx.gather_qmm's
    rhs_indices, valid False for an id outside [0, E). MLX's gather_qmm widens float16 /
    bfloat16 scales and biases to x's float32 itself (an AsType of whole arrays): with
    fewer (token, expert) pairs than experts (decode) the pairs' experts are gathered first,
    so only their rows are widened, as in the forward composite; with more pairs the whole
    stack is. Nothing is gathered or widened where the scales are float32 or uint8 (the fp
    modes): gather_qmm reads only the selected experts then."""
    valid = indices < info["n_experts"]
    if indices.dtype == mx.int32:
        valid = valid & (indices >= 0)
    ids = mx.where(valid, indices, 0).astype(mx.uint32)
    if info["mode"] != "affine" or scales.dtype == mx.float32:
        return w, scales, biases, ids, valid
    pairs = info["tokens"] * info["k"]
    if pairs < info["n_experts"]:
        ids_shape = (*info["lead"], info["k"])
        selected = mx.broadcast_to(ids, ids_shape).reshape(pairs)
        w, scales, biases = w[selected], scales[selected], biases[selected]
        ids = mx.arange(pairs, dtype=mx.uint32).reshape(ids_shape)
    return w, scales.astype(mx.float32), biases.astype(mx.float32), ids, valid


def _f32_product(a, experts: tuple, info: dict, transpose: bool) -> mx.array:
    """mx.gather_qmm of float32 ``a`` [..., 1, K] (its leading axes broadcast with the
    ids') with ``_f32_experts``' operands, the size-1 axis dropped; NaN rows for the pairs
    with an id outside [0, E)."""
    w, scales, biases, ids, valid = experts
    d = mx.gather_qmm(a, w, scales, biases, rhs_indices=ids, transpose=transpose,
                      group_size=info["group_size"], bits=info["bits"], mode=info["mode"])
    return mx.where(valid[..., None], mx.squeeze(d, axis=-2), mx.array(float("nan")))


def _x_vjp(g, w, scales, biases, indices, x_shape, x_dtype, info: dict,
           experts: tuple | None = None) -> mx.array:
    """dx for the cotangent g [..., k, N]: g times the experts' weights (the transposed
    quantized product, MLX's gather_qmm(transpose=False)) in float32, summed over the axes
    x was broadcast along. A (token, expert) pair with an out-of-range id contributes NaN,
    as its output row is NaN. ``experts``: ``_f32_experts``' operands when the caller
    already has them (then w, scales, biases and indices are not read)."""
    if experts is None:
        experts = _f32_experts(w, scales, biases, indices, info)
    d = _f32_product(g.astype(mx.float32)[..., None, :], experts, info, transpose=False)
    return sum_pairs(d, x_shape, info).astype(x_dtype)


def pair_ids(indices: mx.array, info: dict) -> mx.array:
    """The expert id of each (token, expert) pair, [tokens * k] (ids broadcast to the token
    grid)."""
    return mx.broadcast_to(indices, (*info["lead"], info["k"])).reshape(-1)


def sum_pairs(d: mx.array, x_shape, info: dict) -> mx.array:
    """Each pair's dx ([tokens * k, K] or [..., k, K]) summed onto x's shape: over the k
    experts where the token's x is shared by them, then over the axes x was broadcast
    along."""
    d = d.reshape(*info["lead"], info["k"], info["in_features"])
    if not info["x_k_axis"]:  # one activation shared by the token's k experts
        d = mx.sum(d, axis=-2)
    return sum_to_shape(d, tuple(x_shape))


# ---- the fused MoE ops' backward on kernel backends -------------------------------------
# expert_glu and expert_down_combine recompute their products and take their transposed
# products here: this op's two kernels at float32 x / g, the experts read as stored (16-bit
# affine scales and biases too: no gathered or widened copy), float32 out, NaN rows for ids
# outside [0, E). The prepared launches are remembered per problem (clear_plans forgets them).
_KERNEL_PLANS = plan_memory()
_INFO_KEYS = ("n_experts", "n_out", "in_features", "k", "lead", "x_lead", "idx_lead",
              "tokens", "shared", "x_k_axis", "group_size", "bits", "mode")


def f32_product(x, w, scales, biases, indices, info: dict, backend: str) -> mx.array:
    """y [..., k, N] = x @ W[e]^T per pair in float32 (this op's forward kernel at float32 x
    and out, as the composite's float32 gather_qmm) for ``info``'s problem (this op's check
    of x, w, scales, biases, indices, x of any float dtype)."""
    scale_dtype = scales.dtype if info["mode"] == "affine" else None
    key = ("product", tuple(info[n] for n in _INFO_KEYS), backend, scale_dtype)
    launch = _KERNEL_PLANS.get(key) or keep_plan(
        _KERNEL_PLANS, key, _launcher(info, backend, mx.float32, scale_dtype))
    return launch(x.astype(mx.float32), w, scales, biases, indices)


def pair_dx(g, w, scales, biases, ids, info: dict, backend: str) -> mx.array:
    """dx [P, K] float32, row p = g[p] @ W[ids[p]] with the float32 weights (the x-VJP
    kernel, DX_SPEC) for g [P, N] in the experts' dtype or float32 and ids [P]; NaN rows for
    ids outside [0, E)."""
    affine = info["mode"] == "affine"
    if affine and g.dtype not in (scales.dtype, mx.float32):
        g = g.astype(mx.float32)
    scale_dtype = scales.dtype if affine else None
    rows = g.shape[0]
    key = ("dx", rows, info["n_out"], info["in_features"], info["n_experts"],
           info["group_size"], info["bits"], info["mode"], g.dtype, scale_dtype, backend)
    launch = _KERNEL_PLANS.get(key) or keep_plan(_KERNEL_PLANS, key, dx_launcher(
        rows, info["n_out"], info["in_features"], info["n_experts"], info["group_size"],
        info["bits"], info["mode"], g.dtype, backend, DX_SPEC, rounded=False,
        scale_dtype=scale_dtype))
    return launch(g, w, scales, biases, ids, False)
