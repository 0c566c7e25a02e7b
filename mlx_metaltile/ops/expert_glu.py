"""expert_glu: MoE decode gate and up projections with the gated activation, one dispatch.

mlx-lm's SwitchGLU runs the up and gate projections as two ``gather_qmm`` dispatches, then
the activation as a third: x is read twice and two ``[..., k, N]`` intermediates are written
and read back. This op reads x and each selected expert's gate and up rows once and writes
``act(gate) * up`` directly.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    MODE_IDS,
    MODES,
    QUANTIZED_PARAMS,
    dtype_name,
    empty_call,
    memo_check,
    memo_plan,
    on_stream,
    quantized_bindings,
    require_array,
    run_on,
    scalar,
)
from ._grad import (
    GATHER_QMM_REASON,
    _frozen_fn,
    refuse_shapeless,
    shapeless_tracing,
)
from .expert_qmv import (
    BCAST_DIMS,
    ROWS_PER_THREADGROUP,
    SIMDGROUPS,
    _bcast_dims,
    _bcast_input,
    _check_expert_qmv,
    _f32_experts,
    _f32_product,
    _k_groups,
    _out_shape,
    _x_vjp,
    f32_product,
    pair_dx,
    pair_ids,
    sum_pairs,
)
from .expert_qmv import _reference as _qmv_reference

OP = "expert_glu"
__all__ = ["expert_glu", "expert_glu_reference"]
# activation name -> the template's ACT. "silu": silu(gate) * up (mlx-lm's SwiGLU);
# "swiglu_oai": gpt-oss's clamped form (mlx-lm's SwigluOAI).
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
SWIGLU_OAI_ALPHA = 1.702  # mlx-lm's SwigluOAI defaults
SWIGLU_OAI_LIMIT = 7.0
# cuda plan: K is split (expert_qmv's _k_groups) only below this many warps. A warp here
# carries both projections' rows, twice expert_qmv's work per step, and the split's combine
# (a barrier, threadgroup partials, more SIMD-group sums) cost more than its warps gained:
# on an H200 (kernel time, Nsight Compute) the unsplit kernel took 21.3 / 21.4 / 40.1 us at
# the Qwen3-30B-A3B / Qwen3-Next-80B-A3B / gpt-oss-20b one-token shapes against 22.3 / 25.7 /
# 43.2 split for expert_qmv's 4096 warps. Small grids (a few rows) still split.
TARGET_WARPS = 1024


# The sharing form (the template's SHARE 1, SHARING: each distinct expert's gate and up rows
# read once per call for every pair naming it) from this many tokens on, where the ids are
# [P] and x one row per token or per pair (otherwise the broadcast walk, SHARE 0). One
# token's top-k ids are distinct: nothing to share. A backend not named keeps SHARE 0.
# Plans read it once (clear_plans()). Named by none: on an H100 the sharing form was slower
# (CUPTI, gpt-oss-20b's block at 4 tokens 95 -> 118 us, 8 tokens 182 -> 221, Qwen3-30B-A3B
# at 4 tokens 44.5 -> 57.9): the kernel is latency-bound, and leaders walking their sharers
# at 118 registers keep fewer warps in flight than the bytes saved are worth. Apple's decode
# GEMVs are latency-bound too; {"metal": 2} turns it on there for a Mac to measure.
SHARE_MIN_TOKENS: dict[str, int] = {}


def _bindings(share: int):
    def bindings():
        for binding in quantized_bindings(MODES)():
            for act in ACTIVATIONS.values():
                yield dict(binding, ACT=act, SHARE=share)
    return bindings


_INPUTS = (Arg("x", "T", 2),
           Arg("w_gate", "uint32", 3), Arg("scales_gate", "S", 3), Arg("biases_gate", "S", 3),
           Arg("w_up", "uint32", 3), Arg("scales_up", "S", 3), Arg("biases_up", "S", 3),
           Arg("bias_gate", "T", 2), Arg("bias_up", "T", 2),
           Arg("indices", "I", 1), Arg("bcast", "uint32", 1),
           *scalars("n_experts", "n_out", "k_in", "n_sel", "x_slot", "has_bias"),
           *scalars("alpha", "limit", dtype="float32"))
_GEOMETRY = ("threadgroup (64 * S, 1, 1): 2 row blocks of 4 rows of gate and up x S K groups "
             "(S = 1 on Metal; cuda: K split where the grid is small); grid (64 * S, "
             "ceil(N / 8), tokens * k): one threadgroup per (pair, 8-row tile)")
_NOTES = ("expert_qmv's modes; silu or swiglu_oai; optional per-expert biases; ids >= E (or "
          "< 0) give a NaN row")

SPEC, SHARED_SPEC = register(
    KernelSpec(
        op=OP, variant="simd_rows", template="expert_glu.metal", inputs=_INPUTS,
        outputs=(Arg("out", "T", 2),), params=(*QUANTIZED_PARAMS, "ACT", "SHARE"),
        bindings=_bindings(0), geometry=_GEOMETRY, notes=_NOTES,
    ),
    KernelSpec(
        op=OP, variant="shared_rows", template="expert_glu.metal", inputs=_INPUTS,
        outputs=(Arg("out", "T", 2),), params=(*QUANTIZED_PARAMS, "ACT", "SHARE"),
        bindings=_bindings(1),
        geometry=_GEOMETRY + "; the first pair naming an expert computes every pair naming "
                 "it (the others return at once), up to 4 per pass over its rows",
        notes=_NOTES + "; ids [P], x one row per token or per pair (bcast not read)",
    ),
)


@memo_check
def _check(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
           bias_gate, bias_up, activation, group_size, bits, mode) -> dict:
    """Validate (the projections as expert_qmv checks one, under this op's name); return the
    derived sizes."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"[{OP}] activation must be one of {tuple(ACTIVATIONS)}, "
                         f"got {activation!r}")
    try:
        info = _check_expert_qmv(x, w_gate, scales_gate, biases_gate, indices, group_size,
                                 bits, mode)
        _check_expert_qmv(x, w_up, scales_up, biases_up, indices, group_size, bits, mode)
    except (TypeError, ValueError) as err:  # same checks, this op's name
        raise type(err)(str(err).replace("[expert_qmv]", f"[{OP}]", 1)) from None
    for name, arr, ref in (("w_up", w_up, w_gate), ("scales_up", scales_up, scales_gate)):
        if tuple(arr.shape) != tuple(ref.shape):
            raise ValueError(f"[{OP}] {name} must have the gate's shape {tuple(ref.shape)}, "
                             f"got {tuple(arr.shape)}")
    if (bias_gate is None) != (bias_up is None):
        raise ValueError(f"[{OP}] bias_gate and bias_up must both be arrays or both None, got "
                         f"{type(bias_gate).__name__} and {type(bias_up).__name__}")
    if bias_gate is not None:
        want = (info["n_experts"], info["n_out"])
        for name, arr in (("bias_gate", bias_gate), ("bias_up", bias_up)):
            require_array(OP, name, arr)
            if tuple(arr.shape) != want:
                raise ValueError(f"[{OP}] {name} must have shape [E, N] = {want}, "
                                 f"got {tuple(arr.shape)}")
            if arr.dtype != x.dtype:
                raise TypeError(f"[{OP}] {name} must have x's dtype {dtype_name(x.dtype)}, "
                                f"got {dtype_name(arr.dtype)}")
    return {**info, "activation": activation, "has_bias": bias_gate is not None}


def _activate(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    if activation == "silu":
        return gate * mx.sigmoid(gate) * up
    gate = mx.minimum(gate, SWIGLU_OAI_LIMIT)
    up = mx.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1.0) * (gate * mx.sigmoid(SWIGLU_OAI_ALPHA * gate))


def _reference(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
               bias_gate, bias_up, info: dict) -> mx.array:
    """expert_qmv's composite for each projection, kept in float32 (one rounding at the end,
    as the kernel)."""
    gate, up = _projections(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
                            indices, bias_gate, bias_up, info)
    return _activate(gate, up, info["activation"]).astype(x.dtype)


def _launcher(info: dict, backend: str, dtype: mx.Dtype) -> Callable:
    """The kernel call of ``info``'s problem on ``backend``, prepared once: returns
    ``launch(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
    bias_gate, bias_up)``."""
    lead, k, n_out, n_in = info["lead"], info["k"], info["n_out"], info["in_features"]
    pairs = info["tokens"] * k
    squeeze = info["x_k_axis"] and info["shared"]
    dims = _bcast_dims(info)
    x_shape = idx_shape = None
    if len(dims) > BCAST_DIMS:  # more than the kernel walks: materialise (as expert_qmv)
        x_shape = (*lead, n_in) if info["shared"] else (*lead, k, n_in)
        idx_shape = (*lead, k)
        dims = _bcast_dims({**info, "x_lead": lead, "idx_lead": lead})
    tg = backends.SIMD_WIDTH * SIMDGROUPS * _k_groups(
        n_out, n_in, pairs, info["bits"], info["group_size"], 2, TARGET_WARPS, backend)
    share = _shares(info, dims, backend)
    prepared = backends.prepare(
        SHARED_SPEC if share else SPEC, backend,
        inputs={"x": None, "w_gate": None, "scales_gate": None, "biases_gate": None,
                "w_up": None, "scales_up": None, "biases_up": None, "bias_gate": None,
                "bias_up": None, "indices": None, "bcast": _bcast_input(tuple(dims)),
                "n_experts": scalar(info["n_experts"], mx.uint32),
                "n_out": scalar(n_out, mx.uint32), "k_in": scalar(n_in, mx.uint32),
                "n_sel": scalar(k, mx.uint32),
                "x_slot": scalar(0 if info["shared"] else 1, mx.uint32),
                "has_bias": scalar(int(info["has_bias"]), mx.uint32),
                "alpha": scalar(SWIGLU_OAI_ALPHA, mx.float32),
                "limit": scalar(SWIGLU_OAI_LIMIT, mx.float32)},
        template={"T": dtype, "BITS": info["bits"], "GROUP_SIZE": info["group_size"],
                  "MODE": MODE_IDS[info["mode"]], "ACT": ACTIVATIONS[info["activation"]],
                  "SHARE": int(share)},
        outputs={"out": (_out_shape(info), dtype)},  # [pairs, N] row-major, as written
        grid=(tg, -(-n_out // ROWS_PER_THREADGROUP), pairs), threadgroup=(tg, 1, 1),
    )

    def launch(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
               bias_gate, bias_up):
        if x_shape is not None:
            if squeeze:
                x = mx.squeeze(x, axis=-2)
            x = mx.broadcast_to(x, x_shape)
            indices = mx.broadcast_to(indices, idx_shape)
        if biases_gate is None:  # fp modes: never read
            biases_gate, biases_up = scales_gate, scales_up
        if bias_gate is None:  # never read (has_bias = 0)
            bias_gate = bias_up = x
        # x and indices as given (flat row-major memory to the kernel: expert_qmv's launch)
        (out,) = prepared(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
                          bias_gate, bias_up, indices)
        return out

    return launch


def _shares(info: dict, dims: tuple[tuple[int, int, int], ...], backend: str) -> bool:
    """Whether the launch takes the sharing form: SHARE_MIN_TOKENS tokens or more, the token
    grid one contiguous dimension (ids [P]; x one row per token, or per pair)."""
    tokens = info["tokens"]
    contiguous = ((tokens, 1 if info["shared"] else info["k"], info["k"]),)
    return (tokens >= SHARE_MIN_TOKENS.get(backend, tokens + 1)
            and dims in ((), contiguous))


def _valid(indices: mx.array, n_experts: int) -> mx.array:
    valid = indices < n_experts
    return valid & (indices >= 0) if indices.dtype == mx.int32 else valid


def _projections(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
                 bias_gate, bias_up, info: dict) -> tuple[mx.array, mx.array]:
    """gate and up [..., k, N] in float32 (NaN rows for ids outside [0, E))."""
    xf = x.astype(mx.float32)
    if info["mode"] == "affine":
        scales_gate, biases_gate, scales_up, biases_up = (
            a.astype(mx.float32) for a in (scales_gate, biases_gate, scales_up, biases_up))
    gate = _qmv_reference(xf, w_gate, scales_gate, biases_gate, indices, info)
    up = _qmv_reference(xf, w_up, scales_up, biases_up, indices, info)
    if info["has_bias"]:
        safe = mx.where(_valid(indices, info["n_experts"]), indices, 0)
        gate = gate + bias_gate[safe].astype(mx.float32)
        up = up + bias_up[safe].astype(mx.float32)
    return gate, up


def _kernel_dx(d_gate, d_up, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
               indices, x_shape, info: dict, backend: str) -> mx.array:
    """dx in float32 from d_gate and d_up [..., k, N] float32: each pair's d_gate Wg[e] +
    d_up Wu[e] (two launches of expert_qmv's x-VJP kernel; NaN rows for ids outside
    [0, E)), summed as expert_qmv's x-VJP sums them."""
    ids, n_out = pair_ids(indices, info), info["n_out"]
    d = (pair_dx(d_gate.reshape(-1, n_out), w_gate, scales_gate, biases_gate, ids, info,
                 backend)
         + pair_dx(d_up.reshape(-1, n_out), w_up, scales_up, biases_up, ids, info, backend))
    return sum_pairs(d, x_shape, info)


def _backward(g, x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
              bias_gate, bias_up, info: dict) -> list[mx.array]:
    """[dx] (+ [dbias_gate, dbias_up] with biases) for the cotangent g [..., k, N]: gate and
    up recomputed in float32, MLX's autodiff of the activation (zero where swiglu_oai
    clamps), then the transposed quantized products (expert_qmv's dx: a pair with an id
    outside [0, E) gives its x NaN). The biases' gradients sum each expert's pairs; a pair
    with an out-of-range id reads no bias row and adds nothing to them. Each projection's
    experts are gathered and widened once (expert_qmv's _f32_experts: at decode only the
    selected ones) for both its recomputation and its transposed product. On a kernel
    backend four launches instead, none widening an expert: gate and up by expert_qmv's
    kernel at float32 x and out (f32_product), d_gate Wg[e] and d_up Wu[e] by its x-VJP
    kernel at a float32 cotangent (pair_dx)."""
    backend = backends.resolve_backend()
    if backend != "reference":
        gate = f32_product(x, w_gate, scales_gate, biases_gate, indices, info, backend)
        up = f32_product(x, w_up, scales_up, biases_up, indices, info, backend)
    else:
        gate_experts = _f32_experts(w_gate, scales_gate, biases_gate, indices, info)
        up_experts = _f32_experts(w_up, scales_up, biases_up, indices, info)
        xf = mx.expand_dims(x.astype(mx.float32), -2 if info["x_k_axis"] else (-3, -2))
        gate = _f32_product(xf, gate_experts, info, transpose=True)
        up = _f32_product(xf, up_experts, info, transpose=True)
    if info["has_bias"]:
        safe = mx.where(_valid(indices, info["n_experts"]), indices, 0)
        gate = gate + bias_gate[safe].astype(mx.float32)
        up = up + bias_up[safe].astype(mx.float32)
    _, (d_gate, d_up) = mx.vjp(lambda a, b: _activate(a, b, info["activation"]), [gate, up],
                               [g.astype(mx.float32)])
    if backend != "reference":
        dx = _kernel_dx(d_gate, d_up, w_gate, scales_gate, biases_gate, w_up, scales_up,
                        biases_up, indices, x.shape, info, backend)
    else:
        dx = (_x_vjp(d_gate, None, None, None, None, x.shape, mx.float32, info, gate_experts)
              + _x_vjp(d_up, None, None, None, None, x.shape, mx.float32, info, up_experts))
    grads = [dx.astype(x.dtype)]
    if info["has_bias"]:
        ids_shape = (*info["lead"], info["k"])
        valid = mx.broadcast_to(_valid(indices, info["n_experts"]), ids_shape).reshape(-1)
        rows = mx.where(valid, mx.broadcast_to(indices, ids_shape).reshape(-1), 0)
        for d, bias in ((d_gate, bias_gate), (d_up, bias_up)):
            d = mx.where(valid[:, None], d.reshape(-1, info["n_out"]), 0.0)
            grads.append(mx.zeros(bias.shape, mx.float32).at[rows].add(d).astype(bias.dtype))
    return grads


def expert_glu_reference(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
                         indices, *, bias_gate=None, bias_up=None, activation: str = "silu",
                         mode: str = "affine", group_size: int | None = None,
                         bits: int | None = None, stream=None) -> mx.array:
    """Pure-MLX composite with :func:`expert_glu`'s contract (float32 inside, NaN rows)."""
    info = _check(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
                  bias_gate, bias_up, activation, group_size, bits, mode)
    with on_stream(OP, stream):
        if 0 in _out_shape(info):
            return mx.zeros(_out_shape(info), dtype=x.dtype)
        return _reference(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
                          indices, bias_gate, bias_up, info)


def expert_glu(x: mx.array, w_gate: mx.array, scales_gate: mx.array, biases_gate,
               w_up: mx.array, scales_up: mx.array, biases_up, indices: mx.array, *,
               bias_gate: mx.array | None = None, bias_up: mx.array | None = None,
               activation: str = "silu", mode: str = "affine", group_size: int | None = None,
               bits: int | None = None, stream=None) -> mx.array:
    """``act(x @ W_gate[e]^T + bias_gate[e]) * (x @ W_up[e]^T + bias_up[e])`` for each
    token's k experts named by device-resident ``indices``, in one dispatch.

    Args:
      x, indices, mode, group_size, bits: as :func:`expert_qmv` (x ``[..., K]`` one
        activation per token, or ``[..., k, K]`` one per expert; broadcasting alike).
      w_gate, scales_gate, biases_gate / w_up, scales_up, biases_up: the gate and up experts
        as ``mx.quantize`` returns them (mlx-lm's separate gate and up
        ``QuantizedSwitchLinear``), the same shapes; biases None in the fp modes. A fused
        gate_up tensor is not taken: pass its two halves.
      bias_gate, bias_up: optional per-expert output biases ``[E, N]`` in x's dtype (both
        or neither), as gpt-oss's experts hold them.
      activation: "silu" (``silu(gate) * up``, mlx-lm's SwiGLU: Qwen3, Mixtral, DeepSeek)
        or "swiglu_oai" (gpt-oss, mlx-lm's SwigluOAI: ``gate = min(gate, 7)``,
        ``up = clip(up, -7, 7)``, ``(up + 1) * gate * sigmoid(1.702 * gate)``).
      stream: the MLX stream or device to run on (None: the default).

    Returns: ``[..., k, N]`` in x's dtype; gate, up and the activation in float32, rounded
    once. An id outside ``[0, E)`` gives a NaN row.

    Differentiable with respect to x and the expert biases (gate and up recomputed in
    float32, MLX's autodiff of the activation: zero where swiglu_oai clamps; the transposed
    quantized products as :func:`expert_qmv`'s): a pair with an out-of-range id gives its x
    a NaN gradient, as its NaN output row, and adds nothing to the biases' gradients.
    Asking for the gradient of the quantized weights, scales or biases raises.

    Reference backend: ``mx.compile(shapeless=True)`` and ``mx.vmap`` raise an
    ``[expert_glu]`` error: the composite is ``mx.gather_qmm``, which MLX 0.32 cannot map
    and whose default ``lhs_indices`` a shapeless trace fixes. On metal / cuda MLX 0.32.4
    refuses both with its own message (custom kernels have no vmap or shape inference
    there). Mapping a quantized constant raises an ``[op]`` error on every backend. The
    emulator refuses both (eager). README: "mx.compile(shapeless=True) and mx.vmap".
    """
    run = _plan(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
                bias_gate, bias_up, activation, group_size, bits, mode,
                backends.resolve_backend(), stream)
    return run(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
               bias_gate, bias_up)


_NAMES = ("w_gate", "scales_gate", "biases_gate", "w_up", "scales_up", "biases_up")


@memo_plan
def _plan(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
          bias_gate, bias_up, activation, group_size, bits, mode, backend: str,
          stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
    bias_gate, bias_up)``. Reads no argument array but its shape and dtype."""
    info = _check(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
                  bias_gate, bias_up, activation, group_size, bits, mode)
    on_stream(OP, stream)  # refuses what is not a stream
    dtype, out_shape = x.dtype, _out_shape(info)
    if 0 in out_shape:
        return empty_call(OP, stream, out_shape, dtype)
    reference = backend == "reference"
    launch = None if reference else _launcher(info, backend, dtype)
    # The primals: x, the expert biases where given, the quantized constants (through
    # _frozen_fn: asking for their gradient raises; under mx.vmap it refuses the reference
    # composite, mx.gather_qmm; a custom kernel is refused by MLX), then the ids.
    present = tuple(a is not None for a in (w_gate, scales_gate, biases_gate, w_up,
                                            scales_up, biases_up))
    frozen = _frozen_fn(OP, _NAMES, present, GATHER_QMM_REASON if reference else None)
    n_bias = 2 if info["has_bias"] else 0

    all_present = all(present)

    def unpack(primals):
        biases = primals[1:1 + n_bias] if n_bias else (None, None)
        q = primals[1 + n_bias:-1]
        if not all_present:
            it = iter(q)
            q = [next(it) if s else None for s in present]
        return primals[0], q, biases, primals[-1]

    def composite(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
                  bias_gate, bias_up):
        return _reference(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
                          indices, bias_gate, bias_up, info)

    # on the call's stream (MLX may trace it again later: a kernel launch refuses the
    # emulator in a trace)
    forward = run_on(stream, composite if reference else launch)

    @mx.custom_function
    def op(*primals):
        x, q, (bg, bu), ids = unpack(primals)
        return forward(x, *q, ids, bg, bu)

    @op.vjp
    def op_vjp(primals, cotangent, output):
        x, q, (bg, bu), ids = unpack(primals)
        with on_stream(OP, stream):  # run at backward time: the stream again
            grads = _backward(cotangent, x, *q, ids, bg, bu, info)
            return (*grads, *(mx.zeros_like(a) for a in primals[1 + n_bias:]))

    def run(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, indices,
            bias_gate, bias_up):
        if not reference and all_present:  # the common case, without list building
            (first,) = frozen(w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up)
            return op(x, *((bias_gate, bias_up) if n_bias else ()), first, scales_gate,
                      biases_gate, w_up, scales_up, biases_up, indices)
        if reference and shapeless_tracing():
            refuse_shapeless(OP)
        quantized = (w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up)
        given = [a for a in quantized if a is not None]
        rest = given[1:]  # the node passes the first on (_frozen_fn)
        if reference:  # watched: a mapped input makes the node refuse first
            given += [mx.stop_gradient(a) for a in (x, indices, bias_gate, bias_up)
                      if a is not None]
        biases = (bias_gate, bias_up) if n_bias else ()
        return op(x, *biases, *frozen(*given), *rest, indices)

    return run_on(stream, run)
