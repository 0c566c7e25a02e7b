"""moe_route: an MoE router's top-k experts and their scores, one dispatch.

After the router matmul mlx-lm's MoE blocks run softmax, argpartition, take_along_axis and
(with renormalisation) a sum and a divide: five small kernels per block and step. This op
reads the logits once and writes the k ids and scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    FLOAT_TYPES,
    as_bool,
    as_int,
    memo_check,
    memo_plan,
    on_stream,
    require_array,
    require_float,
    round_up,
    run_on,
    scalar,
)
from ._grad import shapeless_tracing

OP = "moe_route"
__all__ = ["moe_route", "moe_route_reference"]
MAX_K = 32  # lane r of the row's SIMD-group holds slot r (the template's invariants)
MAX_EXPERTS = 2**31 - 1  # ids are uint32; the template indexes with uint
ROWS_PER_GROUP = 8  # SIMD-groups (rows) per threadgroup

(SPEC,) = register(
    KernelSpec(
        op=OP, variant="simd_rows", template="moe_route.metal",
        inputs=(Arg("logits", "T", 2),
                *scalars("n_rows", "n_experts", "top_k", "over_k")),
        outputs=(Arg("ids", "uint32", 2), Arg("scores", "T", 2)), params=("T",),
        bindings=lambda: ({"T": t} for t in FLOAT_TYPES),
        geometry="one SIMD-group per row, 8 rows per threadgroup of (32, 8, 1); "
                 "grid (32, round_up(rows, 8), 1); k <= 32, any E (registers up to 512)",
        notes="k rounds of SIMD argmax over order-preserving keys (NaN largest, ties to the "
              "lower index); softmax statistics in float32",
    ),
)

_U32_ALL = 0xFFFFFFFF
_SIGN = 0x80000000


@memo_check
def _check(logits, k, normalize) -> tuple[int, int, int, bool]:
    """Validate the arguments; return (E, rows, k, normalize)."""
    require_array(OP, "logits", logits)
    require_float(OP, "logits", logits)
    if logits.ndim < 1:
        raise ValueError(f"[{OP}] logits must have at least 1 dimension ([..., E]), got 0")
    n = logits.shape[-1]
    if n < 1:
        raise ValueError(f"[{OP}] the last axis of logits (E, the experts) must be >= 1, "
                         f"got {n}")
    if n > MAX_EXPERTS:
        raise ValueError(f"[{OP}] the last axis of logits (E) must be <= {MAX_EXPERTS}, "
                         f"got {n}")
    k = as_int(OP, "k", k)
    if k < 1:
        raise ValueError(f"[{OP}] k must be >= 1, got {k}")
    if k > MAX_K:
        raise ValueError(f"[{OP}] k must be <= {MAX_K} (the largest the kernel serves), "
                         f"got {k}")
    if k > n:
        raise ValueError(f"[{OP}] k must be <= E = {n} (the last axis of logits), got {k}")
    normalize = as_bool(OP, "normalize", normalize)
    return n, math.prod(logits.shape[:-1]), k, normalize


def _keys(lf: mx.array) -> mx.array:
    """The template's order-preserving uint32 key of each float32 logit (mt_route_key):
    NaN the largest, -0 as +0."""
    bits = lf.view(mx.uint32)
    mag = bits & 0x7FFFFFFF
    all_ones = mx.array(_U32_ALL, dtype=mx.uint32)
    key = mx.where((bits & _SIGN) != 0, all_ones - bits, bits | _SIGN)
    key = mx.where(mag == 0, mx.array(_SIGN, dtype=mx.uint32), key)
    return mx.where(mag > 0x7F800000, all_ones, key)


def _top_k(lf: mx.array, k: int) -> mx.array:
    """The k ids of the largest keys, slot 0 the largest, equal keys by ascending index:
    one uint64 sort key per expert, (inverted key, index)."""
    n = lf.shape[-1]
    inverted = (mx.array(_U32_ALL, dtype=mx.uint32) - _keys(lf)).astype(mx.uint64)
    order = (inverted << 32) | mx.arange(n, dtype=mx.uint64)
    return mx.argsort(order, axis=-1)[..., :k].astype(mx.uint32)


def _softmax_exp(x: mx.array, m: mx.array) -> mx.array:
    """exp(x - m) with exactly 0 at x = -inf (m finite, else masked by the caller)."""
    return mx.where(x == -math.inf, 0.0, mx.exp(x - m))


def _lane_sum(terms: mx.array) -> mx.array:
    """The sum over the last axis in the template's order: expert i in lane i % 32, each
    lane's terms summed, then the 32 lanes (a float32 sum of E terms in one sequence would
    gather up to E roundings)."""
    n = terms.shape[-1]
    pad = -n % 32
    if pad:
        terms = mx.pad(terms, [(0, 0)] * (terms.ndim - 1) + [(0, pad)])
    lanes = terms.reshape(*terms.shape[:-1], -1, 32).sum(axis=-2)
    return lanes.sum(axis=-1, keepdims=True)


def _reference(logits, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Pure-MLX composite of the template's math (float32 inside, scores rounded once)."""
    lf = mx.stop_gradient(logits).astype(mx.float32)  # ids: no gradient through the sort
    ids = _top_k(lf, k)
    lf = logits.astype(mx.float32)
    sel = mx.take_along_axis(lf, ids, axis=-1)
    m = sel[..., :1]
    finite = mx.isfinite(m)
    m = mx.where(finite, m, 0.0)
    e = _softmax_exp(sel, m)
    denom = e.sum(axis=-1, keepdims=True) if normalize else _lane_sum(_softmax_exp(lf, m))
    scores = mx.where(finite, e / denom, math.nan)
    return ids, scores.astype(logits.dtype)


def _backward(logits, ids, g, normalize: bool) -> mx.array:
    """dlogits for the scores' cotangent g [..., k], in float32 from the logits:
    normalize: s = softmax(l[ids]), dl[ids] = s (g - sum(g s)), 0 elsewhere;
    else: p = softmax(l) over all E, s = p[ids], dl = p (G - sum(g s)) with G = g at ids."""
    lf = logits.astype(mx.float32)
    gf = g.astype(mx.float32)
    if normalize:
        s = mx.softmax(mx.take_along_axis(lf, ids, axis=-1), axis=-1, precise=True)
        ds = s * (gf - (gf * s).sum(axis=-1, keepdims=True))
        dl = mx.put_along_axis(mx.zeros_like(lf), ids, ds, axis=-1)
    else:
        p = mx.softmax(lf, axis=-1, precise=True)
        s = mx.take_along_axis(p, ids, axis=-1)
        big_g = mx.put_along_axis(mx.zeros_like(lf), ids, gf, axis=-1)
        dl = p * (big_g - (gf * s).sum(axis=-1, keepdims=True))
    return dl.astype(logits.dtype)


def _launcher(n: int, rows: int, k: int, normalize: bool, lead: tuple[int, ...],
              dtype: mx.Dtype, backend: str) -> Callable:
    """The kernel call of ``rows`` rows of E = ``n`` logits (leading shape ``lead``) on
    ``backend``, prepared once: returns ``launch(logits) -> (ids, scores)``."""
    prepared = backends.prepare(
        SPEC, backend,
        inputs={"logits": None, "n_rows": scalar(rows, mx.uint32),
                "n_experts": scalar(n, mx.uint32), "top_k": scalar(k, mx.uint32),
                "over_k": scalar(int(normalize), mx.uint32)},
        template={"T": dtype},
        outputs={"ids": ((rows, k), mx.uint32), "scores": ((rows, k), dtype)},
        grid=(32, round_up(rows, ROWS_PER_GROUP), 1), threadgroup=(32, ROWS_PER_GROUP, 1),
    )
    out_shape = (*lead, k)

    def launch(logits):
        ids, scores = prepared(logits.reshape(rows, n))
        return ids.reshape(out_shape), scores.reshape(out_shape)

    return launch


def moe_route_reference(logits: mx.array, k: int, *, normalize: bool = True,
                        stream=None) -> tuple[mx.array, mx.array]:
    """Pure-MLX composite with :func:`moe_route`'s contract (float32 inside)."""
    _, rows, k, normalize = _check(logits, k, normalize)
    with on_stream(OP, stream):
        if rows == 0:
            return _empty(logits, k)
        return _reference(logits, k, normalize)


def _empty(logits, k: int) -> tuple[mx.array, mx.array]:
    shape = (*logits.shape[:-1], k)
    return mx.zeros(shape, dtype=mx.uint32), mx.zeros(shape, dtype=logits.dtype)


@memo_plan
def _plan(logits, k, normalize, backend: str, stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(logits) -> (ids, scores)``, an mx.custom_function whose VJP is the composite of
    ``_backward``. Reads no argument array but its shape and dtype."""
    n, rows, k, normalize = _check(logits, k, normalize)
    on_stream(OP, stream)  # refuses what is not a stream
    if rows == 0:
        def empty(logits):
            with on_stream(OP, stream):
                return _empty(logits, k)
        return empty
    reference = backend == "reference"
    if reference:
        def forward(logits):
            return _reference(logits, k, normalize)
    else:
        forward = _launcher(n, rows, k, normalize, tuple(logits.shape[:-1]), logits.dtype,
                            backend)

    # on the call's stream (MLX may trace it again later)
    op = mx.custom_function(run_on(stream, forward))

    @op.vjp
    def op_vjp(logits, cotangents, outputs):  # one primal: MLX passes the array itself
        with on_stream(OP, stream):  # run at backward time: the stream again
            return _backward(logits, outputs[0], cotangents[1], normalize)

    def run(logits):
        if reference and shapeless_tracing():
            raise ValueError(
                f"[{OP}] mx.compile(shapeless=True) is not supported on the reference "
                "backend: its composite reads the logits' bits (mx.view), which MLX (0.32) "
                "cannot trace shapeless; compile without shapeless=True (one trace per shape)")
        return op(logits)

    return run_on(stream, run)


def moe_route(logits: mx.array, k: int, *, normalize: bool = True,
              stream=None) -> tuple[mx.array, mx.array]:
    """An MoE router's top-k experts and their scores from its logits, in one dispatch.

    ``ids, scores = moe_route(logits, k)`` replaces mlx-lm's softmax, argpartition,
    take_along_axis (and renormalisation) after the router matmul.

    Args:
      logits: ``[..., E]`` float32/float16/bfloat16, the router's output; E >= 1, any E
        (up to 2^31 - 1).
      k: experts per row, a Python or NumPy int, 1 <= k <= min(E, 32).
      normalize: True: the softmax over the k selected logits (= the softmax over all E
        renormalised over the k: Mixtral, gpt-oss, Qwen3-MoE / Qwen3-Next with
        ``norm_topk_prob``); False: each selected expert's softmax probability over all E
        (Qwen3-MoE without ``norm_topk_prob``, OLMoE).
      stream: MLX's StreamOrDevice (None, an mx.Stream, an mx.Device, mx.cpu / mx.gpu):
        where the composite's ops or the kernel run.

    Returns: ``(ids, scores)``, both ``[..., k]``: ids uint32, the k experts with the
    largest logits, slot 0 the largest; equal logits take slots in ascending expert index
    (deterministic). scores in logits' dtype, computed in float32 and rounded once.

    Edge values: NaN ranks above every number, so a row holding a NaN selects it (lowest
    index first) and all its k scores are NaN (as softmax); its ids stay distinct and in
    [0, E). -inf logits are masked experts: selected only when fewer than k are finite,
    with score 0, while the row's max is finite; a row whose max is +inf or -inf (every
    expert masked) gets NaN scores, as softmax does. -0 and +0 are equal logits.

    Differentiable with respect to logits through the scores (the ids are integers; as
    ``mx.argpartition``'s, indexing with them inside a differentiated function needs
    ``mx.stop_gradient(ids)``, which mlx-lm's MoE blocks apply): the
    VJP is a float32 composite of MLX ops (the softmax's Jacobian over the k selected, or
    over all E scattered from the selected ones), in logits' dtype.

    Reference backend: ``mx.compile`` and ``mx.vmap`` (any axis of logits) work;
    ``mx.compile(shapeless=True)`` raises a ``[moe_route]`` error (the composite orders the
    logits by their bits, ``mx.view``, which MLX 0.32 cannot trace shapeless). On metal /
    cuda MLX 0.32.4 refuses shapeless and vmap with its own message (custom kernels have
    no vmap or shape inference there). The emulator refuses both (eager). README:
    "mx.compile(shapeless=True) and mx.vmap".
    """
    return _plan(logits, k, normalize, backends.resolve_backend(), stream)(logits)
