"""expert_down_combine: MoE decode down projection, router-score weighting and the sum over
the k experts, one dispatch.

mlx-lm's MoE blocks run the down projection (``gather_qmm``, ``[..., k, D]`` written), then
multiply by the scores and sum over k (more dispatches, the intermediate read back). This op
writes ``[..., D]`` directly, summing the k experts in a fixed order (bitwise reproducible;
no atomics). From SHARE_MIN_TOKENS tokens (decode of several tokens, verify; a backend
listed there: none by default) it runs the token-block form: each distinct expert of a block
of tokens read once for all the block's pairs naming it, rather than once per (token, expert)
pair.
"""

from __future__ import annotations

import math
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
    require_float,
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
    ROWS_PER_THREADGROUP,
    SIMDGROUPS,
    _check_expert_qmv,
    _f32_experts,
    _f32_product,
    _x_vjp,
    pair_dx,
)
from .expert_qmv import _reference as _qmv_reference

OP = "expert_down_combine"
__all__ = ["expert_down_combine", "expert_down_combine_reference"]


def _bindings():
    for binding in quantized_bindings(MODES)():
        for r in dict.fromkeys((binding["T"], mx.float32)):  # scores in h's dtype or float32
            for share in (0, 1):  # per token, or the token-block form (_share_plan)
                yield dict(binding, R=r, SHARE=share)


(SPEC,) = register(
    KernelSpec(
        op=OP, variant="simd_rows", template="expert_down_combine.metal",
        inputs=(Arg("h", "T", 2), Arg("w", "uint32", 3), Arg("scales", "S", 3),
                Arg("biases", "S", 3), Arg("indices", "I", 1), Arg("scores", "R", 1),
                Arg("bias", "T", 2),
                *scalars("n_experts", "n_out", "k_in", "n_sel", "has_bias", "n_tokens",
                         "block_tokens")),
        outputs=(Arg("out", "T", 2),), params=(*QUANTIZED_PARAMS, "SHARE"),
        bindings=_bindings,
        geometry="threadgroup (64 * S, 1, 1): 2 row blocks of 4 output rows x S slot "
                 "groups (S = 1 on Metal: each SIMD-group sums all k slots; cuda: the k "
                 "slots spread over up to 8); grid (64 * S, ceil(D / 8), tokens): one "
                 "threadgroup per (token, 8-row tile), its k experts summed in a fixed "
                 "order. SHARE = 1 (from SHARE_MIN_TOKENS tokens): one threadgroup per "
                 "(block of TB tokens, 8-row tile), grid z = ceil(tokens / TB), each "
                 "distinct expert of the block read once for all its pairs",
        notes="expert_qmv's modes; scores in h's dtype or float32; optional per-expert "
              "biases; any id >= E (or < 0) makes the token's row NaN",
    ),
)


@memo_check
def _check(h, w, scales, biases, indices, scores, bias, group_size, bits, mode) -> dict:
    require_array(OP, "h", h)
    require_array(OP, "indices", indices)
    require_array(OP, "scores", scores)
    if indices.ndim < 1 or h.ndim != indices.ndim + 1 or tuple(h.shape[:-1]) != tuple(
            indices.shape):
        raise ValueError(f"[{OP}] h must be [..., k, N] with indices [..., k] of the same "
                         f"leading shape, got h {tuple(h.shape)} and indices "
                         f"{tuple(indices.shape)}")
    try:
        info = _check_expert_qmv(h, w, scales, biases, indices, group_size, bits, mode)
    except (TypeError, ValueError) as err:  # expert_qmv's checks, this op's name
        raise type(err)(str(err).replace("[expert_qmv]", f"[{OP}]", 1)) from None
    if tuple(scores.shape) != tuple(indices.shape):
        raise ValueError(f"[{OP}] scores must have indices' shape {tuple(indices.shape)}, "
                         f"got {tuple(scores.shape)}")
    sdt = require_float(OP, "scores", scores)
    if sdt not in (h.dtype, mx.float32):
        raise TypeError(f"[{OP}] scores must be float32 or h's dtype {dtype_name(h.dtype)}, "
                        f"got {dtype_name(sdt)}")
    if bias is not None:
        require_array(OP, "bias", bias)
        want = (info["n_experts"], info["n_out"])
        if tuple(bias.shape) != want:
            raise ValueError(f"[{OP}] bias must have shape [E, D] = {want}, "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != h.dtype:
            raise TypeError(f"[{OP}] bias must have h's dtype {dtype_name(h.dtype)}, "
                            f"got {dtype_name(bias.dtype)}")
    return info


def _out_shape(info: dict) -> tuple[int, ...]:
    return (*info["lead"], info["n_out"])


def _valid(indices: mx.array, n_experts: int) -> mx.array:
    valid = indices < n_experts
    return valid & (indices >= 0) if indices.dtype == mx.int32 else valid


def _expert_outputs(h, w, scales, biases, indices, bias, info: dict) -> mx.array:
    """y [..., k, D] = h @ W[e]^T + bias[e] per pair in float32 (NaN rows for bad ids)."""
    hf = h.astype(mx.float32)
    if info["mode"] == "affine":
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    y = _qmv_reference(hf, w, scales, biases, indices, info)  # NaN rows for bad ids
    if bias is not None:
        valid = _valid(indices, info["n_experts"])
        y = y + bias[mx.where(valid, indices, 0)].astype(mx.float32)
    return y


def _reference(h, w, scales, biases, indices, scores, bias, info: dict) -> mx.array:
    """expert_qmv's composite, then the scores and the sum over k, in float32."""
    y = _expert_outputs(h, w, scales, biases, indices, bias, info)
    y = (y * scores.astype(mx.float32)[..., None]).sum(axis=-2)
    return y.astype(h.dtype)


def _pair_outputs(h, experts: tuple, indices, bias, info: dict) -> mx.array:
    """_expert_outputs' y [..., k, D] from expert_qmv's _f32_experts operands."""
    y = _f32_product(h.astype(mx.float32)[..., None, :], experts, info, transpose=True)
    if bias is not None:
        y = y + bias[mx.where(_valid(indices, info["n_experts"]), indices, 0)].astype(
            mx.float32)
    return y


def _pair_dx(g, w, scales, biases, indices, info: dict, backend: str) -> mx.array:
    """u [..., k, N] float32: u_j = g W[e_j] per pair (g [..., D] broadcast over the k
    slots), expert_qmv's x-VJP kernel; NaN rows for ids outside [0, E)."""
    pairs = info["tokens"] * info["k"]
    rows = mx.broadcast_to(g[..., None, :], (*info["lead"], info["k"], info["n_out"]))
    u = pair_dx(rows.reshape(pairs, info["n_out"]), w, scales, biases, indices.reshape(-1),
                info, backend)
    return u.reshape(*info["lead"], info["k"], info["in_features"])


def _backward(g, h, w, scales, biases, indices, scores, bias, info: dict) -> list[mx.array]:
    """[dh, dscores] (+ [dbias]) for the cotangent g [..., D], in float32: dh_j = s_j g W[e_j]
    (expert_qmv's dx), dscores_j = g . y_j (y recomputed), dbias[e] = sum of s_j g over the
    pairs naming e. A pair with an id outside [0, E) gives its h row and its score NaN, as
    its NaN term, and adds nothing to the bias' gradient. The experts are gathered and
    widened once (expert_qmv's _f32_experts: at decode only the selected ones) for both
    products. On a kernel backend one launch instead: expert_qmv's x-VJP kernel (pair_dx)
    gives each pair's u_j = g W[e_j] in float32, then dh_j = s_j u_j and dscores_j =
    h_j . u_j + g . bias[e_j] (= g . y_j, the products reassociated: y is not recomputed)."""
    gf = g.astype(mx.float32)[..., None, :]
    sf = scores.astype(mx.float32)[..., None]
    backend = backends.resolve_backend()
    if backend != "reference":
        u = _pair_dx(g, w, scales, biases, indices, info, backend)
        dh = (u * sf).astype(h.dtype)
        ds = (u * h.astype(mx.float32)).sum(axis=-1)
        if bias is not None:
            valid = _valid(indices, info["n_experts"])
            ds = ds + (gf * bias[mx.where(valid, indices, 0)].astype(mx.float32)).sum(axis=-1)
        grads = [dh, ds.astype(scores.dtype)]
    else:
        experts = _f32_experts(w, scales, biases, indices, info)
        dh = _x_vjp(gf * sf, None, None, None, None, h.shape, h.dtype, info, experts)
        y = _pair_outputs(h, experts, indices, bias, info)
        grads = [dh, (gf * y).sum(axis=-1).astype(scores.dtype)]
    if bias is not None:
        valid = _valid(indices, info["n_experts"]).reshape(-1)
        rows = mx.where(valid, indices.reshape(-1), 0)
        d = mx.where(valid[:, None], (gf * sf).reshape(-1, info["n_out"]), 0.0)
        grads.append(mx.zeros(bias.shape, mx.float32).at[rows].add(d).astype(bias.dtype))
    return grads


MAX_SLOT_GROUPS = 8  # matches the template
MAX_SHARED = 2  # pairs walked together over one expert's rows (the template's)
BLOCK_PAIRS = 32  # a token block's pairs are one SIMD-group's lanes (the template's)
MAX_BLOCK_TOKENS = 8  # lane t * 4 + r holds the block's token t, row r (the template's)
# The token-block form (the template's SHARE = 1, its header says why): from
# SHARE_MIN_TOKENS tokens a call's tokens run in blocks of up to SHARE_TOKENS (and
# BLOCK_PAIRS // k) tokens per threadgroup, each distinct expert of a block read once.
# SHARE_SLOT_GROUPS_PER_TOKEN: the block's distinct experts go to S = min(MAX_SLOT_GROUPS,
# TB * this, TB * k) slot groups. Per backend; the emulator follows "metal"; a backend
# absent runs per token. Plans read these once (clear_plans()). SHARE_MIN_TOKENS names no
# backend: on an H100 the form was slower (CUPTI, gpt-oss-20b's block at 4 tokens 62 -> 130
# us, 8 tokens 118 -> 180, Qwen3-30B-A3B at 4 tokens 48 -> 53): a latency-bound kernel with
# TB times fewer threadgroups. {"metal": 2} turns it on for a Mac to measure.
SHARE_TOKENS: dict[str, int] = {"metal": 4, "cuda": 8}
SHARE_MIN_TOKENS: dict[str, int] = {}
SHARE_SLOT_GROUPS_PER_TOKEN: dict[str, int] = {"metal": 1, "cuda": MAX_SLOT_GROUPS}


# cuda's per-token plan: at most this many slot groups (256-thread threadgroups). With 8
# (512 threads at up to 126 registers: one threadgroup per SM) Qwen3-30B-A3B's one-token
# grid of 256 threadgroups ran in two waves on an H200's 132 SMs; with 4, two threadgroups
# fit per SM and it runs in one. Kernel time (Nsight Compute), 8 -> 4 groups, us:
# Qwen3-30B-A3B 18.7 -> 16.0, Qwen3-Next-80B-A3B 22.8 -> 18.0, gpt-oss-20b 41.4 -> 38.9; at 4
# tokens 61.8 -> 49.0 and 77.4 -> 55.7.
CUDA_SLOT_GROUPS = 4


def _slot_groups(k: int, backend: str) -> int:
    """The launch plan's S: SIMD-groups sharing one row block's k slots (the template's
    DISPATCH INVARIANTS). Metal keeps one (each SIMD-group walks all k slots, the plan the
    template was measured in); cuda spreads the slots evenly over at most CUDA_SLOT_GROUPS
    (k = 8: 4 groups of 2; k = 10: 4 groups of 3, the last of 1), for the warps an NVIDIA GPU
    needs in flight."""
    if backend != "cuda" or k <= 1:
        return 1
    per_group = -(-k // CUDA_SLOT_GROUPS)
    return -(-k // per_group)


def _share_plan(tokens: int, k: int, backend: str) -> tuple[int, int] | None:
    """(TB, S) of the token-block form for ``tokens`` tokens of k experts on ``backend``, or
    None (per token). TB: tokens per threadgroup, the fewest of SHARE_TOKENS, BLOCK_PAIRS //
    k and the call's tokens. S: slot groups per row block, dealt the block's distinct
    experts (SHARE_SLOT_GROUPS_PER_TOKEN): cuda min(8, TB * k), up to one SIMD-group per
    pair, as many warps in flight as a 512-thread threadgroup holds; Metal min(8, TB), the
    SIMD-groups per token of its per-token plan (one)."""
    key = "metal" if backend == "emulator" else backend
    if tokens < SHARE_MIN_TOKENS.get(key, math.inf):
        return None
    block = min(SHARE_TOKENS[key], BLOCK_PAIRS // k, MAX_BLOCK_TOKENS, tokens)
    if block < 2:
        return None
    return block, min(MAX_SLOT_GROUPS, block * SHARE_SLOT_GROUPS_PER_TOKEN[key], block * k)


def _launcher(info: dict, backend: str, dtype: mx.Dtype) -> Callable:
    """The kernel call of ``info``'s problem on ``backend``, prepared once: returns
    ``launch(h, w, scales, biases, indices, scores, bias)``."""
    n_out, n_in, k = info["n_out"], info["in_features"], info["k"]
    tokens = math.prod(info["lead"])
    share = _share_plan(tokens, k, backend)
    block, slot_groups = share or (1, _slot_groups(k, backend))
    tg = backends.SIMD_WIDTH * SIMDGROUPS * slot_groups
    has_bias = info["has_bias"]
    prepared = backends.prepare(
        SPEC, backend,
        inputs={"h": None, "w": None, "scales": None, "biases": None, "indices": None,
                "scores": None, "bias": None,
                "n_experts": scalar(info["n_experts"], mx.uint32),
                "n_out": scalar(n_out, mx.uint32), "k_in": scalar(n_in, mx.uint32),
                "n_sel": scalar(k, mx.uint32), "has_bias": scalar(int(has_bias), mx.uint32),
                "n_tokens": scalar(tokens, mx.uint32),
                "block_tokens": scalar(block, mx.uint32)},
        template={"T": dtype, "BITS": info["bits"], "GROUP_SIZE": info["group_size"],
                  "MODE": MODE_IDS[info["mode"]], "SHARE": int(share is not None)},
        outputs={"out": (_out_shape(info), dtype)},  # [tokens, N] row-major, as written
        grid=(tg, -(-n_out // ROWS_PER_THREADGROUP), -(-tokens // block)),
        threadgroup=(tg, 1, 1),
    )

    def launch(h, w, scales, biases, indices, scores, bias):
        if biases is None:  # fp modes: never read
            biases = scales
        # h, indices and scores as given: the kernel reads flat row-major memory (MLX copies
        # an array that is not row-contiguous), so no reshape node goes before it
        (out,) = prepared(h, w, scales, biases, indices, scores,
                          h if bias is None else bias)  # never read without a bias
        return out

    return launch


def expert_down_combine_reference(h, w, scales, biases, indices, scores, *, bias=None,
                                  mode: str = "affine", group_size: int | None = None,
                                  bits: int | None = None, stream=None) -> mx.array:
    """Pure-MLX composite with :func:`expert_down_combine`'s contract (float32 inside)."""
    info = _check(h, w, scales, biases, indices, scores, bias, group_size, bits, mode)
    with on_stream(OP, stream):
        if 0 in _out_shape(info) or info["k"] == 0:
            return mx.zeros(_out_shape(info), dtype=h.dtype)
        return _reference(h, w, scales, biases, indices, scores, bias, info)


def expert_down_combine(h: mx.array, w: mx.array, scales: mx.array, biases,
                        indices: mx.array, scores: mx.array, *, bias: mx.array | None = None,
                        mode: str = "affine", group_size: int | None = None,
                        bits: int | None = None, stream=None) -> mx.array:
    """``sum_j scores[..., j] * (h[..., j, :] @ W[e_j]^T + bias[e_j])`` over each token's k
    experts named by device-resident ``indices``, in one dispatch.

    Args:
      h: ``[..., k, N]`` float32/float16/bfloat16, one input per selected expert (what
        :func:`expert_glu` returns); sets the output dtype.
      w, scales, biases, mode, group_size, bits: the down experts as :func:`expert_qmv`
        takes them (``W [E, D, N]`` quantized).
      indices: ``[..., k]`` uint32 or int32 ids, h's leading shape (no broadcasting).
      scores: ``[..., k]`` router weights, float32 or h's dtype.
      bias: optional per-expert output bias ``[E, D]`` in h's dtype.
      stream: the MLX stream or device to run on (None: the default).

    Returns: ``[..., D]`` in h's dtype, accumulated in float32 and rounded once; the k
    experts are summed in an order fixed by the call's ids and shape (the template's
    REDUCTION ORDER), so results are bitwise reproducible run to run. If any of a token's
    ids is outside ``[0, E)`` that token's whole row is NaN (the call's other tokens are
    unaffected). k = 0 gives zeros.

    Reference backend: ``mx.compile(shapeless=True)`` and ``mx.vmap`` raise an
    ``[expert_down_combine]`` error: the composite is ``mx.gather_qmm``, which MLX 0.32
    cannot map and whose default ``lhs_indices`` a shapeless trace fixes. On metal / cuda
    MLX 0.32.4 refuses both with its own message (custom kernels have no vmap or shape
    inference there). Mapping a quantized constant raises an ``[op]`` error on every
    backend. The emulator refuses both (eager). README: "mx.compile(shapeless=True) and
    mx.vmap".
    """
    run = _plan(h, w, scales, biases, indices, scores, bias, group_size, bits, mode,
                backends.resolve_backend(), stream)
    return run(h, w, scales, biases, indices, scores, bias)


@memo_plan
def _plan(h, w, scales, biases, indices, scores, bias, group_size, bits, mode, backend: str,
          stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(h, w, scales, biases, indices, scores, bias)``. Reads no argument array but its
    shape and dtype."""
    info = {**_check(h, w, scales, biases, indices, scores, bias, group_size, bits, mode),
            "has_bias": bias is not None}
    on_stream(OP, stream)  # refuses what is not a stream
    dtype, out_shape = h.dtype, _out_shape(info)
    if 0 in out_shape or info["k"] == 0:
        return empty_call(OP, stream, out_shape, dtype)
    reference = backend == "reference"
    launch = None if reference else _launcher(info, backend, dtype)
    # The primals: h, scores, the bias where given, the quantized constants (through
    # _frozen_fn: asking for their gradient raises; under mx.vmap it refuses the reference
    # composite, mx.gather_qmm; a custom kernel is refused by MLX), then the ids.
    present = (True, True, biases is not None)
    frozen = _frozen_fn(OP, ("w", "scales", "biases"), present,
                        GATHER_QMM_REASON if reference else None)
    n_float = 3 if info["has_bias"] else 2

    def unpack(primals):
        q = primals[n_float:-1]
        if len(q) < 3:  # fp modes: no biases
            q = (*q, None)
        return primals[0], primals[1], primals[2] if n_float == 3 else None, q, primals[-1]

    def composite(h, w, scales, biases, indices, scores, bias):
        return _reference(h, w, scales, biases, indices, scores, bias, info)

    # on the call's stream (MLX may trace it again later: a kernel launch refuses the
    # emulator in a trace)
    forward = run_on(stream, composite if reference else launch)

    @mx.custom_function
    def op(*primals):
        h, s, b, (w, scales, biases), ids = unpack(primals)
        return forward(h, w, scales, biases, ids, s, b)

    @op.vjp
    def op_vjp(primals, cotangent, output):
        h, s, b, (w, scales, biases), ids = unpack(primals)
        with on_stream(OP, stream):  # run at backward time: the stream again
            grads = _backward(cotangent, h, w, scales, biases, ids, s, b, info)
            return (*grads, *(mx.zeros_like(a) for a in primals[n_float:]))

    def run(h, w, scales, biases, indices, scores, bias):
        if not reference and biases is not None:  # the common case, without list building
            (first,) = frozen(w, scales, biases)
            if bias is None:
                return op(h, scores, first, scales, biases, indices)
            return op(h, scores, bias, first, scales, biases, indices)
        if reference and shapeless_tracing():
            refuse_shapeless(OP)
        given = [a for a in (w, scales, biases) if a is not None]
        rest = given[1:]  # the node passes the first on (_frozen_fn)
        if reference:  # watched: a mapped input makes the node refuse first
            given += [mx.stop_gradient(a) for a in (h, indices, scores, bias)
                      if a is not None]
        extra = () if bias is None else (bias,)
        return op(h, scores, *extra, *frozen(*given), *rest, indices)

    return run_on(stream, run)
