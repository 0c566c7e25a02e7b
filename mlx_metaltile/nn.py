"""Modules standing in for mlx-lm's, running this package's kernels.

Each holds the same parameters under the same names and shapes as the module it replaces
(``load_weights``, ``nn.quantize``, ``save_weights`` and LoRA adapters see no difference),
and each has one function saying whether it can serve a module (``*_unserved``: None, or
why not). When an op gains a feature (attention sinks, array masks) only that function
changes. A call the kernels cannot serve runs mlx-lm's own computation.

mlx-lm is imported only where its code runs (the fallbacks, SwitchGLU's constructor).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    sum_gradients,
)

from . import backends
from ._msl.constants import scalar
from .ops import (
    expert_down_combine,
    expert_glu,
    expert_qmv,
    fp4_qmm,
    gated_rms_norm,
    moe_gather_qmm,
    moe_route,
    sdpa_multi,
)
from .ops._common import DEFAULTS as _MODE_SIZES
from .ops.moe_route import MAX_K as _ROUTE_MAX_K
from .ops.sdpa_multi import _promotes_to

# (token, expert) pairs from which a SwitchGLU call runs the prefill path (moe_gather_qmm
# over expert-sorted rows) instead of the decode path (expert_glu + expert_qmv, or
# expert_glu + expert_down_combine through SwitchGLU.combine). mlx-lm sorts from the same
# count. The kernels' crossover differs per GPU: a backend measured with
# ``python -m mlx_metaltile moe-bench`` gets its own entry in PREFILL_MIN_PAIRS_PER_BACKEND;
# prefill_min_pairs() is the one place that reads the two.
PREFILL_MIN_PAIRS = 64
# cuda: moe-bench on an H100 (Qwen3-30B-A3B block, bf16): the decode path is faster at 8 and
# 32 pairs (4 tokens: 658 vs 888 us), the prefill path at 512 and 1024 (64 tokens: 1981 vs
# 2197 us); 64 to 256 pairs were not measured.
PREFILL_MIN_PAIRS_PER_BACKEND: dict[str, int] = {"cuda": 512}

_EXPERT_BITS = (4, 8)  # expert_qmv / moe_gather_qmm, affine mode
_EXPERT_GROUP_SIZES = (32, 64, 128)
_MGQ_TILE = 32  # moe_gather_qmm needs N and K multiples of this
SDPA_HEAD_DIMS = (64, 96, 128, 256)  # sdpa_multi
# Query rows per call (L) for which a routed attention call runs sdpa_multi; a call outside
# runs mlx-lm's own sdpa (mx.fast.scaled_dot_product_attention), counted in ``fallbacks``.
# A backend where models measured faster on MLX's attention kernels (``python -m
# mlx_metaltile model-bench --attention sdpa_multi`` against ``--attention mlx``) gets its own entry per head dim in SDPA_QUERIES_PER_BACKEND;
# sdpa_queries() is the one place that reads the two.
SDPA_QUERIES = range(1, 1 << 31)
# cuda: decode and verify steps (L = 1, 4, 8, 16) and a 512-token prefill of 4-layer models
# on an H100, 1024 cached tokens, native / patched with sdpa_multi / patched with MLX's
# attention: MLX's (cuDNN's flash kernels) was as fast or faster at head dim 128
# (Qwen3-30B-A3B, Mixtral) and 64 (gpt-oss, with sinks) at every L; at 256 (Qwen3-Next)
# sdpa_multi was faster from L = 1 to 16 (decode 1.00x against 0.85x) and MLX's at the
# prefill. Head dim 96 was not measured.
SDPA_QUERIES_PER_BACKEND: dict[str, dict[int, range]] = {
    "cuda": {64: range(0), 128: range(0), 256: range(1, 17)}}
# Calls of stand-ins (and routed attention) that ran mlx-lm's path: (kind, why) -> count.
fallbacks: Counter = Counter()


def _class_name(obj) -> str:
    return type(obj).__name__


def prefill_min_pairs(backend: str | None = None) -> int:
    """The token-expert pairs from which SwitchGLU runs its prefill path on ``backend``
    (None: the one an op call would run on now)."""
    return PREFILL_MIN_PAIRS_PER_BACKEND.get(backend or backends.resolve_backend(),
                                             PREFILL_MIN_PAIRS)


@contextlib.contextmanager
def backend_entry(table: dict, backend: str, value):
    """``table[backend] = value`` while inside (PREFILL_MIN_PAIRS_PER_BACKEND,
    SDPA_QUERIES_PER_BACKEND: how the benchmarks force one side); the entry as it was
    afterwards, absent if it was."""
    before = table.get(backend)
    table[backend] = value
    try:
        yield
    finally:
        if before is None:
            table.pop(backend, None)
        else:
            table[backend] = before


def sdpa_queries(head_dim: int, backend: str | None = None) -> range:
    """The query rows per call (L) for which routed attention with this head dim runs
    sdpa_multi on ``backend`` (None: the one an op call would run on now)."""
    table = SDPA_QUERIES_PER_BACKEND.get(backend or backends.resolve_backend())
    return SDPA_QUERIES if table is None else table.get(head_dim, SDPA_QUERIES)


# ---------------------------------------------------------------------------- gated norm


def gated_rms_norm_unserved(module) -> str | None:
    """None if :class:`GatedRMSNorm` can stand in for ``module`` (mlx-lm's
    ``Qwen3NextRMSNormGated``: a ``weight [n]`` and ``eps``), else why not."""
    weight = module.get("weight") if isinstance(module, nn.Module) else None
    if not isinstance(weight, mx.array) or weight.ndim != 1:
        return "no 1-D weight"
    if not isinstance(getattr(module, "eps", None), (int, float)):
        return "no numeric eps"
    return None


class GatedRMSNorm(nn.Module):
    """``rms_norm(h, weight, eps) * silu(gate)`` as mlx-lm's ``Qwen3NextRMSNormGated``.

    Same parameter (``weight [n]``), same output dtype (``hidden_states``'); computed in
    float32 and rounded once. Without a gate it is
    ``mx.fast.rms_norm`` as in mlx-lm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(hidden_size)

    @classmethod
    def from_module(cls, module) -> GatedRMSNorm:
        """A stand-in sharing ``module``'s weight (arrays are immutable: no copy)."""
        new = cls(1, module.eps)
        new.weight = module.weight
        new.train(module.training)
        return new

    def __call__(self, hidden_states: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is None:
            x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
            return x.astype(hidden_states.dtype)
        return gated_rms_norm(hidden_states, gate, self["weight"], self.eps)


# ---------------------------------------------------------------------------- experts


def switch_glu_unserved(module) -> str | None:
    """None if :class:`SwitchGLU` can run ``module``'s experts on the kernels, else why not.

    Served: ``gate_proj``, ``up_proj``, ``down_proj`` are mlx-lm ``QuantizedSwitchLinear``
    in affine mode at bits 4/8 and group size 32/64/128, or in mode mxfp4, nvfp4 (without a
    global scale) or mxfp8 at mx.quantize's sizes (expert_qmv and moe_gather_qmm),
    optionally with per-expert ``bias``; the activation is whatever the model holds.
    """
    projs = [module.get(name) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None for p in projs):
        return "no gate_proj/up_proj/down_proj"
    for p in projs:
        if _class_name(p) != "QuantizedSwitchLinear":
            return f"experts are {_class_name(p)}, not QuantizedSwitchLinear (quantize first)"
        mode = getattr(p, "mode", "affine")
        if mode not in _MODE_SIZES:
            return f"experts in mode {mode!r} (served: {tuple(_MODE_SIZES)})"
        if p.get("global_scale") is not None:
            return "experts with a global scale"
        group_size, bits = _sizes(p)
        if mode == "affine":
            if bits not in _EXPERT_BITS:
                return f"experts at bits={bits} (served: {_EXPERT_BITS})"
            if group_size not in _EXPERT_GROUP_SIZES:
                return f"experts at group_size={group_size} (served: {_EXPERT_GROUP_SIZES})"
            if p.get("biases") is None:
                return "affine experts without biases"
        elif (group_size, bits) != _MODE_SIZES[mode]:
            return f"{mode} experts at group_size={group_size}, bits={bits}"
    if getattr(module, "activation", None) is None:
        return "no activation"
    return None


def _sizes(proj) -> tuple[int, int]:
    """(group_size, bits) of quantized experts; None (nn.quantize's default) is the mode's."""
    default_gs, default_bits = _MODE_SIZES[getattr(proj, "mode", "affine")]
    group_size, bits = getattr(proj, "group_size", None), getattr(proj, "bits", None)
    return (default_gs if group_size is None else group_size,
            default_bits if bits is None else bits)


def glu_activation(activation) -> str | None:
    """expert_glu's name for an mlx-lm activation module (``SwiGLU``: "silu";
    ``SwigluOAI`` at its default alpha 1.702 and limit 7: "swiglu_oai"), else None."""
    kind = type(activation)
    if not kind.__module__.startswith("mlx_lm."):
        return None
    if kind.__name__ == "SwiGLU":
        return "silu"
    if kind.__name__ == "SwigluOAI" and (getattr(activation, "_alpha", None),
                                         getattr(activation, "_limit", None)) == (1.702, 7.0):
        return "swiglu_oai"
    return None


def _bias_rows(proj, indices: mx.array) -> mx.array | None:
    bias = proj.get("bias")
    return None if bias is None else bias[indices]


def _qargs(proj) -> tuple:
    return proj["weight"], proj["scales"], proj.get("biases")


# Backends on which SwitchGLU.combine's two decode dispatches run as one mx.compile'd
# function: MLX records the two ops' graph once per input shapes and replays it, instead of
# running each op's Python on every call (the decode step is host-bound there: on an H100
# host the patched Qwen3-30B-A3B block took 127 us to build against mlx-lm's 26, while its
# kernels ran in 48 us against 101). Not the emulator (it runs each kernel when called:
# nothing to trace) nor the reference backend (its composites are the ops' oracle twins).
# A replayed call runs no Python: launch counters (backends.launch_count) and wrappers of
# the ops see the traced call only (model-bench's per-op split empties this while it
# records a step).
COMPILED_BACKENDS = ("metal", "cuda")


def _stream_name(stream: mx.Stream) -> str:
    """``str(stream)`` (its device and index: MLX's Python streams have no index attribute
    and hash by object, and each ``mx.default_stream`` call makes a new object), looked up
    by equality among the streams seen: formatting one costs more than the comparisons."""
    for seen, name in _STREAM_NAMES:
        if seen == stream:
            return name
    name = str(stream)
    _STREAM_NAMES.append((stream, name))
    return name


_STREAM_NAMES: list[tuple[mx.Stream, str]] = []


@functools.lru_cache(maxsize=256)
def _decode_pair(activation: str, gate_q: tuple, down_q: tuple, given: tuple[bool, ...],
                 stream: str | None, route: tuple[int, bool] | None = None) -> Callable:
    """expert_glu then expert_down_combine for one static configuration (activation, the
    gate/up and down quantization, which arrays are given: fp modes have no biases, experts
    may have output biases), taking only the given arrays of (x, ids, scores, gate w/s/b,
    up w/s/b, down w/s/b, gate bias, up bias, down bias); ``stream``: None for the plain
    calls, else compiled, one per backend and stream (named in ``stream``: a compiled graph
    replays the kernels and the stream it was traced with). ``route``: (k, normalize) where
    the ids and scores are moe_route's of the router logits given in the ids' place (the
    scores' place then empty), one dispatch more in the same call."""
    (g_mode, g_gs, g_bits), (d_mode, d_gs, d_bits) = gate_q, down_q

    def pair(*arrays):
        it = iter(arrays)
        x, ids, scores, wg, sg, bg, wu, su, bu, wd, sd, bd, bias_g, bias_u, bias_d = (
            next(it) if g else None for g in given)
        if route is not None:
            ids, scores = moe_route(ids, route[0], normalize=route[1])
        ids = mx.stop_gradient(ids)
        hidden = expert_glu(x, wg, sg, bg, wu, su, bu, ids, bias_gate=bias_g, bias_up=bias_u,
                            activation=activation, mode=g_mode, group_size=g_gs, bits=g_bits)
        return expert_down_combine(hidden, wd, sd, bd, ids, scores, bias=bias_d, mode=d_mode,
                                   group_size=d_gs, bits=d_bits)

    return pair if stream is None else mx.compile(pair)


class SwitchGLU(nn.Module):
    """mlx-lm's ``SwitchGLU`` (gate/up/down experts, the model's activation) on the kernels.

    The same children (``gate_proj``, ``up_proj``, ``down_proj``) and ``activation`` object
    as the module it stands in for. Few (token, expert) pairs (decode, verification) run
    straight from the router's ids: ``expert_glu`` (gate, up and the activation in one
    dispatch, for mlx-lm's ``SwiGLU`` and ``SwigluOAI``; other activations: two
    ``expert_qmv`` and the activation), then ``expert_qmv`` for the down projection, which
    returns the per-expert rows ``[..., k, D]`` mlx-lm's contract promises (the MoE block
    applies the scores). :meth:`combine` also takes the scores and runs the down projection,
    the scores and the sum over k as one ``expert_down_combine`` dispatch: two dispatches per
    MoE block at decode for a block that calls it (:func:`moe_block`, which ``patch`` gives
    the blocks :data:`MOE_ROUTING` names). From :data:`PREFILL_MIN_PAIRS` pairs the
    rows are sorted by expert and run ``moe_gather_qmm``. Experts the kernels do not serve
    (see :func:`switch_glu_unserved`), or activations in another dtype than the quantization
    scales, run mlx-lm's own ``SwitchGLU`` computation.
    """

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int,
                 activation=None, bias: bool = False):
        from mlx_lm.models.switch_layers import SwiGLU, SwitchLinear

        super().__init__()  # as mlx-lm's constructor: nn.quantize makes the experts served
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = SwiGLU() if activation is None else activation

    @classmethod
    def from_module(cls, module) -> SwitchGLU:
        """A stand-in sharing ``module``'s children and activation object."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name in ("gate_proj", "up_proj", "down_proj", "activation"):
            setattr(new, name, getattr(module, name))
        new.train(module.training)
        return new

    def unserved(self, x: mx.array | None = None) -> str | None:
        """None if this call runs on the kernels, else why not."""
        return self._unserved(self._held(), x)

    @staticmethod
    def _unserved(held: tuple, x: mx.array | None) -> str | None:
        """:meth:`unserved` from :meth:`_held`'s memo."""
        reason = held[1]
        scales = held[0][1]["scales"] if reason is None else None
        if x is not None and scales is not None and scales.dtype != mx.uint8 and (
                x.dtype != scales.dtype):  # affine scales must be in x's dtype
            reason = f"activations in {x.dtype} but scales in {scales.dtype}"
        return reason

    def _experts_unserved(self) -> str | None:
        """:func:`switch_glu_unserved` of this module (remembered: :meth:`_held`)."""
        return self._held()[1]

    def _held(self) -> tuple:
        """((gate_proj, up_proj, down_proj, activation), :func:`switch_glu_unserved`'s
        reason, :func:`glu_activation`'s name where gate and up are quantized alike else
        None, the gate's and the down projection's (mode, group_size, bits)) of this module,
        remembered while it holds the same projection and activation objects: what these
        read of them (class, mode, sizes, which arrays they hold, the activation's kind) is
        set when they are made, and a decode step asks once per block. Their arrays (and
        so their dtypes) are read per call: ``load_weights`` swaps them."""
        held = (self.get("gate_proj"), self.get("up_proj"), self.get("down_proj"),
                getattr(self, "activation", None))
        memo = self.__dict__.get("_mlx_metaltile_unserved")
        if memo is None or any(a is not b for a, b in zip(memo[0], held, strict=True)):
            reason = switch_glu_unserved(self)
            activation = gate_q = down_q = None
            if reason is None:
                gate, up, down, act = held
                gate_q, down_q = ((p.mode, p.group_size, p.bits) for p in (gate, down))
                activation = glu_activation(act)
                if gate_q != (up.mode, up.group_size, up.bits):
                    activation = None
            memo = (held, reason, activation, gate_q, down_q)
            object.__setattr__(self, "_mlx_metaltile_unserved", memo)
        return memo

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        reason = self.unserved(x)
        if reason is not None:
            from mlx_lm.models.switch_layers import SwitchGLU as _MlxLmSwitchGLU

            fallbacks["switch_glu", reason] += 1
            return _MlxLmSwitchGLU.__call__(self, x, indices)
        indices = mx.stop_gradient(indices)
        if indices.size >= prefill_min_pairs() and self._sorted_path_fits():
            return self._prefill(x, indices)
        return self._decode(x, indices)

    def _sorted_path_fits(self) -> bool:
        hidden, dims = self.up_proj.output_dims, self.down_proj.output_dims
        return hidden % _MGQ_TILE == 0 and dims % _MGQ_TILE == 0

    def _project(self, proj, x, indices, rows=None):
        """One projection; ``rows`` is None (decode: ids straight from the router) or the
        expert-sorted ids of the prefill rows."""
        q = dict(group_size=proj.group_size, bits=proj.bits, mode=proj.mode)
        if rows is None:
            out = expert_qmv(x, *_qargs(proj), indices, **q)
            bias = _bias_rows(proj, indices)
        else:
            out = moe_gather_qmm(x, *_qargs(proj), rows, **q)
            bias = _bias_rows(proj, rows)
        return out if bias is None else out + bias

    def _decode(self, x: mx.array, indices: mx.array) -> mx.array:
        # x [..., D], indices [..., k] -> [..., k, D]
        hidden = self._hidden(x, indices, self._glu_activation(x))
        return self._project(self.down_proj, hidden, indices)

    def _hidden(self, x: mx.array, indices: mx.array, activation: str | None) -> mx.array:
        """activation(up, gate) [..., k, N] at decode: one expert_glu dispatch where
        ``activation`` (:meth:`_glu_activation`'s) is one it computes, else the two
        projections and the model's activation."""
        if activation is None:
            up = self._project(self.up_proj, x, indices)
            gate = self._project(self.gate_proj, x, indices)
            return self.activation(up, gate)
        gate, up = self.gate_proj, self.up_proj
        return expert_glu(x, *_qargs(gate), *_qargs(up), indices, bias_gate=gate.get("bias"),
                          bias_up=up.get("bias"), activation=activation, mode=gate.mode,
                          group_size=gate.group_size, bits=gate.bits)

    def _glu_activation(self, x: mx.array) -> str | None:
        """expert_glu's name for this module's activation, or None where expert_glu cannot
        run it (another activation, gate and up quantized differently, biases in another
        dtype than x)."""
        held = self._held()
        return None if held[1] is not None else self._glu_name(held, x)

    @staticmethod
    def _glu_name(held: tuple, x: mx.array) -> str | None:
        """:meth:`_glu_activation` from :meth:`_held`'s memo of served experts."""
        activation = held[2]
        if activation is None:
            return None
        b_gate, b_up = held[0][0].get("bias"), held[0][1].get("bias")
        if b_gate is None:
            return activation if b_up is None else None
        if b_up is None or b_gate.dtype != x.dtype or b_up.dtype != x.dtype:
            return None
        return activation

    def combine(self, x: mx.array, indices: mx.array, scores: mx.array) -> mx.array:
        """``(self(x, indices) * scores[..., None]).sum(axis=-2)`` as an MoE block computes
        it, [..., D] in the experts' output dtype. At decode with an activation expert_glu
        computes, two dispatches: expert_glu, then expert_down_combine (the down projection,
        the scores and the sum over k in a fixed order; a token with an id outside [0, E)
        gives a NaN row). Otherwise this module's call, then the scores and the sum."""
        if scores.shape == indices.shape and x.shape[:-1] == indices.shape[:-1]:
            y = self._decode_call(x, indices, scores, indices.size, None)
            if y is not None:
                return y
        y = self(x, indices)
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

    def route_combine(self, x: mx.array, logits: mx.array, k: int,
                      normalize: bool) -> mx.array | None:
        """``combine(x, ids, scores)`` of ``moe_route(logits, k, normalize=normalize)``'s
        ids and scores in one call of three dispatches (moe_route, expert_glu,
        expert_down_combine) where the decode path serves it and the scores come in x's
        dtype (logits in x's dtype, k <= moe_route's MAX_K), else None."""
        if (logits.dtype != x.dtype or not moe_route_serves(logits, k)
                or x.shape[:-1] != logits.shape[:-1]):
            return None
        return self._decode_call(x, logits, None, logits.size // logits.shape[-1] * k,
                                 (k, normalize))

    def _decode_call(self, x, indices, scores, pairs: int, route) -> mx.array | None:
        """The decode pair's output (``_decode_pair``, with ``route``) where this call takes
        the decode path with an activation expert_glu computes, else None."""
        held = self._held()
        backend = backends.resolve_backend()
        if (self._unserved(held, x) is not None or pairs >= prefill_min_pairs(backend)
                or (activation := self._glu_name(held, x)) is None):
            return None
        gate, up, down, _ = held[0]
        bias = down.get("bias")
        if bias is not None and bias.dtype != x.dtype:
            return None
        if scores is not None and scores.dtype not in (x.dtype, mx.float32):
            scores = scores.astype(mx.float32)
        arrays = (x, indices, scores, gate["weight"], gate["scales"], gate.get("biases"),
                  up["weight"], up["scales"], up.get("biases"), down["weight"],
                  down["scales"], down.get("biases"), gate.get("bias"), up.get("bias"), bias)
        pair = _decode_pair(activation, held[3], held[4],
                            tuple([a is not None for a in arrays]),
                            f"{backend} {_stream_name(mx.default_stream(mx.default_device()))}"
                            if backend in COMPILED_BACKENDS else None, route)
        return pair(*[a for a in arrays if a is not None])

    def _prefill(self, x: mx.array, indices: mx.array) -> mx.array:
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        rows = flat[order]
        xs = x.reshape(-1, x.shape[-1])[order // k]
        up = self._project(self.up_proj, xs, indices, rows)
        gate = self._project(self.gate_proj, xs, indices, rows)
        out = self._project(self.down_proj, self.activation(up, gate), indices, rows)
        out = out[mx.argsort(order)]
        return out.reshape(*indices.shape, out.shape[-1])


# ---------------------------------------------------------------------------- MoE blocks


@dataclass(frozen=True)
class MoERouting:
    """How an mlx-lm MoE block forms its experts' ids and scores: its ``__call__`` as data.

    ``softmax_first``: softmax over all experts, then the top k of the probabilities
    (Qwen3-MoE, Qwen3-Next, OLMoE); else the top k of the router logits, then a softmax
    over those k (Mixtral, gpt-oss). Up to moe_route's MAX_K experts per token both are
    :func:`moe_route`'s (``normalize``: scores that sum to one; the top k of the logits in
    float32, ties to the lower expert index); beyond it mlx-lm's ops as the block runs them,
    where ``negated`` says how it takes the top k: as ``argpartition(-g, kth=k - 1)[...,
    :k]`` (Mixtral, OLMoE), else as ``argpartition(g, kth=-k)[..., -k:]``. ``norm``: the
    attribute that asks for scores renormalised to sum to one after the top k. ``shared``:
    (expert, gate) attributes of a shared expert added as ``sigmoid(gate(x)) * expert(x)``
    (Qwen3-Next). ``plain_shared``: the attribute of a shared expert added as ``expert(x)``
    where the block has one (DeepSeek-V3's ``n_shared_experts``). ``flat``: the block runs on
    ``x.reshape(-1, D)`` (OLMoE). ``cast``: the score-weighted sum is cast to the experts'
    output dtype (Qwen3-MoE). ``router_ids``: the router module returns the (ids, scores)
    itself, by mlx-lm's code (DeepSeek-V3's gate: a grouped top k of sigmoid scores with a
    correction bias, times a scaling factor); the experts' :meth:`SwitchGLU.combine` then
    takes them (``top_k``, ``softmax_first``, ``negated`` and ``norm`` unused: the block
    need not have a ``top_k`` attribute).
    """

    router: str
    experts: str
    top_k: str
    softmax_first: bool
    negated: bool
    norm: str | None = None
    shared: tuple[str, str] | None = None
    plain_shared: str | None = None
    flat: bool = False
    cast: bool = False
    router_ids: bool = False

    def normalize(self, block) -> bool:
        """Whether the k scores sum to one (moe_route's ``normalize``): a softmax over the
        top k, or over all experts renormalised over the top k (the same numbers), else the
        probability over all experts."""
        return not self.softmax_first or (self.norm is not None
                                          and bool(getattr(block, self.norm)))

    def route(self, block, logits: mx.array) -> tuple[mx.array, mx.array]:
        """(ids, scores) [..., k] from the router's logits: moe_route's where k <= its
        MAX_K (the top k of the logits, ties to the lower expert, in float32 throughout),
        else as the block computes them."""
        k = getattr(block, self.top_k)
        if moe_route_serves(logits, k):
            ids, scores = moe_route(logits, k, normalize=self.normalize(block))
            return mx.stop_gradient(ids), scores
        return self.mlx_lm_route(block, logits)

    def mlx_lm_route(self, block, logits: mx.array) -> tuple[mx.array, mx.array]:
        """(ids, scores) [..., k] by the block's own ops (mlx-lm's argpartition: its slots
        and its choice among tied probabilities)."""
        k = getattr(block, self.top_k)
        g = mx.softmax(logits, axis=-1, precise=True) if self.softmax_first else logits
        if self.negated:
            ids = mx.argpartition(-g, kth=k - 1, axis=-1)[..., :k]
        else:
            ids = mx.argpartition(g, kth=-k, axis=-1)[..., -k:]
        ids = mx.stop_gradient(ids)
        scores = mx.take_along_axis(g, ids, axis=-1)
        if not self.softmax_first:
            scores = mx.softmax(scores, axis=-1, precise=True)
        if self.norm is not None and getattr(block, self.norm):
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return ids, scores


def moe_route_serves(logits: mx.array, k: int) -> bool:
    """Whether :func:`moe_route` takes this top k: float logits, 1 <= k <= min(E, its
    MAX_K)."""
    return (logits.dtype in _FLOATING
            and 1 <= k <= min(_ROUTE_MAX_K, logits.shape[-1]))


# mx.issubdtype(dtype, mx.floating)'s dtypes (a set lookup costs less than the call)
_FLOATING = frozenset((mx.float16, mx.bfloat16, mx.float32, mx.float64))


# mlx-lm's MoE block classes ("module.Class") whose routing is known. A block not named
# here keeps mlx-lm's code (its SwitchGLU is still served).
MOE_ROUTING = {
    "mlx_lm.models.qwen3_moe.Qwen3MoeSparseMoeBlock": MoERouting(
        "gate", "switch_mlp", "top_k", softmax_first=True, negated=False,
        norm="norm_topk_prob", cast=True),
    "mlx_lm.models.qwen3_next.Qwen3NextSparseMoeBlock": MoERouting(  # also Qwen3.5-MoE
        "gate", "switch_mlp", "top_k", softmax_first=True, negated=False,
        norm="norm_topk_prob", shared=("shared_expert", "shared_expert_gate")),
    "mlx_lm.models.olmoe.OlmoeSparseMoeBlock": MoERouting(
        "gate", "switch_mlp", "top_k", softmax_first=True, negated=True,
        norm="norm_topk_prob", flat=True),
    "mlx_lm.models.mixtral.MixtralSparseMoeBlock": MoERouting(
        "gate", "switch_mlp", "num_experts_per_tok", softmax_first=False, negated=True),
    "mlx_lm.models.gpt_oss.MLPBlock": MoERouting(
        "router", "experts", "num_experts_per_tok", softmax_first=False, negated=False),
    "mlx_lm.models.qwen2_moe.Qwen2MoeSparseMoeBlock": MoERouting(
        "gate", "switch_mlp", "top_k", softmax_first=True, negated=True,
        shared=("shared_expert", "shared_expert_gate")),
    "mlx_lm.models.mellum.MellumSparseMoeBlock": MoERouting(
        "gate", "switch_mlp", "top_k", softmax_first=True, negated=False,
        norm="norm_topk_prob"),
    "mlx_lm.models.jamba.JambaSparseMoeBlock": MoERouting(
        "router", "switch_mlp", "num_experts_per_tok", softmax_first=False, negated=True),
    # the router's own (ids, scores), the sum cast to the experts' dtype, a plain shared
    # expert where the block has one: DeepSeek-V3 (and Kimi-K2.5, its classes),
    # DeepSeek-V3.2, GLM-4.5 to 4.7, GLM-4.7-Flash, MiMo-V2-Flash and EXAONE-MoE, whose
    # blocks are the same code; Step-3.5 (its shared expert always there) and Granite-MoE
    # (router "router", no shared expert) the same but for those names
    **{f"mlx_lm.models.{name}": MoERouting(
        router, "switch_mlp", "num_experts_per_tok", softmax_first=False, negated=False,
        plain_shared=shared, cast=True, router_ids=True)
       for name, router, shared in (
           ("deepseek_v3.DeepseekV3MoE", "gate", "shared_experts"),
           ("deepseek_v32.DeepseekV32MoE", "gate", "shared_experts"),
           ("glm4_moe.MoE", "gate", "shared_experts"),
           ("glm4_moe_lite.Glm4MoeLiteMoE", "gate", "shared_experts"),
           ("mimo_v2_flash.MoE", "gate", "shared_experts"),
           ("exaone_moe.MoE", "gate", "shared_experts"),
           ("step3p5.Step3p5MoE", "gate", "share_expert"),
           ("granitemoe.GraniteMoeMoE", "router", None))},
}


def moe_routing(cls: type) -> MoERouting | None:
    """The routing of an mlx-lm MoE block class (or of a subclass made by ``patch``)."""
    return MOE_ROUTING.get(_qualified_name(getattr(cls, "_mlx_metaltile_base", cls)))


@functools.cache
def _qualified_name(cls: type) -> str:
    """"module.Class" of a class, formatted once (:func:`moe_block` asks on every call)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def moe_block_unserved(module) -> str | None:
    """None if ``module``'s calls can run :func:`moe_block` (a block class named in
    :data:`MOE_ROUTING` holding the attributes it names, experts a :class:`SwitchGLU` can
    serve), else why not."""
    routing = moe_routing(type(module))
    if routing is None:
        return (f"{_class_name(module)}'s routing is not known: mlx-lm's block applies the "
                "scores after SwitchGLU")
    for name in (routing.router, routing.experts, *(routing.shared or ())):
        if not isinstance(getattr(module, name, None), nn.Module):
            return f"no {name} module"
    plain = routing.plain_shared and getattr(module, routing.plain_shared, None)
    if plain is not None and not isinstance(plain, nn.Module):  # absent or None: not used
        return f"no {routing.plain_shared} module"
    if not routing.router_ids and not isinstance(getattr(module, routing.top_k, None), int):
        return f"no integer {routing.top_k}"
    experts = getattr(module, routing.experts)
    reason = None if isinstance(experts, SwitchGLU) else switch_glu_unserved(experts)
    return None if reason is None else f"its experts are not served ({reason})"


def moe_block(block, x: mx.array) -> mx.array:
    """An mlx-lm MoE block's call with the experts, the scores and the sum over k through
    :meth:`SwitchGLU.combine`: the router, the top k, the scores, the shared expert and the
    tensor-parallel collectives as the block computes them (:data:`MOE_ROUTING`). Experts
    that are not a :class:`SwitchGLU` now (adapters added after patching) run the block's
    own code."""
    routing = moe_routing(type(block))
    experts = getattr(block, routing.experts)
    if not isinstance(experts, SwitchGLU):
        fallbacks["moe_block", f"experts are {_class_name(experts)}"] += 1
        return block._mlx_metaltile_base.__call__(block, x)
    group = getattr(block, "sharding_group", None)
    if group is not None:
        x = sum_gradients(group)(x)
    shape = x.shape
    if routing.flat:
        x = x.reshape(-1, shape[-1])
    if routing.router_ids:  # the router gives the ids and scores; combine casts the sum
        ids, scores = getattr(block, routing.router)(x)
        y = experts.combine(x, ids, scores)
    else:
        y = _routed_sum(block, routing, experts, x)
    if routing.shared is not None:
        expert, gate = (getattr(block, name) for name in routing.shared)
        y = y + mx.sigmoid(gate(x)) * expert(x)
    if routing.plain_shared is not None:  # where the block has one
        expert = getattr(block, routing.plain_shared, None)
        if expert is not None:
            y = y + expert(x)
    if routing.flat:
        y = y.reshape(shape)
    if group is not None:
        y = mx.distributed.all_sum(y, group=group)
    return y


def _routed_sum(block, routing: MoERouting, experts: SwitchGLU, x: mx.array) -> mx.array:
    """The experts' score-weighted sum for a block whose top k and scores are formed from
    its router's logits (:meth:`MoERouting.route`)."""
    logits = getattr(block, routing.router)(x)
    y = experts.route_combine(x, logits, getattr(block, routing.top_k),
                              routing.normalize(block))
    if y is not None:
        return y
    ids, scores = routing.route(block, logits)
    if scores.dtype == x.dtype:  # else mlx-lm's product promotes: keep its form
        return experts.combine(x, ids, scores)
    rows = experts(x, ids)
    y = (rows * scores[..., None]).sum(axis=-2)
    return y.astype(rows.dtype) if routing.cast else y


# ---------------------------------------------------------------------------- fp4 linear

_FP4_MODES = ("mxfp4", "nvfp4")  # fp4_qmm


def fp4_linear_unserved(module) -> str | None:
    """None if :class:`Fp4Linear` can run ``module`` (an ``nn.QuantizedLinear`` in mode
    mxfp4 or nvfp4 at mx.quantize's sizes, N and K multiples of 32), else why not."""
    mode = getattr(module, "mode", "affine")
    if mode not in _FP4_MODES:
        return f"mode {mode!r} (fp4_qmm serves {_FP4_MODES})"
    if module.get("global_scale") is not None:
        return "a global scale"
    if (module.group_size, module.bits) != _MODE_SIZES[mode]:
        return f"{mode} at group_size={module.group_size}, bits={module.bits}"
    n, words = module["weight"].shape
    if n % 32 or (8 * words) % 32:
        return f"N={n}, K={8 * words} (fp4_qmm needs multiples of 32)"
    return None


class Fp4Linear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` in mode mxfp4 / nvfp4 through ``fp4_qmm`` (same parameters)."""

    @classmethod
    def from_module(cls, module) -> Fp4Linear:
        """A stand-in sharing ``module``'s arrays, sizes and frozen / training state."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.__dict__.update(module.__dict__)
        for key, value in module.items():
            new[key] = value
        return new

    def __call__(self, x: mx.array) -> mx.array:
        out = fp4_qmm(x, self["weight"], self["scales"], group_size=self.group_size,
                      mode=self.mode)
        return out + self["bias"] if "bias" in self else out


# mlx's tensor-parallel quantized layers (``shard_linear`` over mx.distributed) in mode
# mxfp4 / nvfp4: the same collectives around fp4_qmm on this rank's shard.
class Fp4AllToShardedLinear(QuantizedAllToShardedLinear):
    """``QuantizedAllToShardedLinear`` (mxfp4 / nvfp4) through ``fp4_qmm``."""

    from_module = classmethod(Fp4Linear.from_module.__func__)

    def __call__(self, x: mx.array) -> mx.array:
        x = sum_gradients(self.group)(x)
        out = fp4_qmm(x, self["weight"], self["scales"], group_size=self.group_size,
                      mode=self.mode)
        return out + self["bias"] if "bias" in self else out


class Fp4ShardedToAllLinear(QuantizedShardedToAllLinear):
    """``QuantizedShardedToAllLinear`` (mxfp4 / nvfp4) through ``fp4_qmm``."""

    from_module = classmethod(Fp4Linear.from_module.__func__)

    def __call__(self, x: mx.array) -> mx.array:
        out = fp4_qmm(x, self["weight"], self["scales"], group_size=self.group_size,
                      mode=self.mode)
        out = mx.distributed.all_sum(out, group=self.group)
        return out + self["bias"] if "bias" in self else out


# ---------------------------------------------------------------------------- attention


def attention_unserved(module) -> str | None:
    """None if an attention module's calls can go to sdpa_multi (each call still checks
    its cache and mask: see :func:`sdpa_unserved`), else why not."""
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim not in SDPA_HEAD_DIMS:
        return f"head_dim {head_dim} (sdpa_multi serves {SDPA_HEAD_DIMS})"
    return None


@functools.cache
def _kv_cache_class() -> type:
    """mlx-lm's KVCache, imported once (on the first cached call: the import statement is a
    lookup per call)."""
    from mlx_lm.models.cache import KVCache

    return KVCache


def sdpa_unserved(queries, keys, values, cache, mask, sinks, fetched=()) -> str | None:
    """None if one ``scaled_dot_product_attention`` call of mlx-lm can run on sdpa_multi
    over the cache's whole buffer, else why not. With a cache, ``fetched`` is the (keys,
    values) its ``update_and_fetch`` returned in this attention call: only those very
    arrays are the cache's first ``offset`` rows that sdpa_multi reads in their place."""
    if queries.shape[-2] not in sdpa_queries(queries.shape[-1]):
        return "queries per call outside sdpa_queries()"
    if sinks is not None and (not isinstance(sinks, mx.array)
                              or tuple(sinks.shape) != (queries.shape[1],)
                              or not _promotes_to(sinks.dtype, queries.dtype)):
        return "sinks"
    if isinstance(mask, mx.array):
        # MLX's form only (last axis = the keys): sdpa_multi reads a last axis of L as its
        # block form, where MLX would broadcast a last axis of 1.
        if (mask.ndim > 4 or mask.shape[-1] != keys.shape[-2]
                or not (mask.dtype == mx.bool_ or _promotes_to(mask.dtype, queries.dtype))):
            return "array mask"
    elif mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return "mask"
    if queries.shape[-1] not in SDPA_HEAD_DIMS or values.shape[-1] != queries.shape[-1]:
        return "head dim"
    if cache is None:
        return None if keys.dtype == queries.dtype else "dtype"
    if type(cache) is not _kv_cache_class():  # rotating, quantized, batched ... caches
        return f"cache {_class_name(cache)}"
    if cache.keys is None or cache.keys.dtype != queries.dtype:
        return "dtype"
    if (not fetched or len(fetched) != 2 or keys is not fetched[0]
            or values is not fetched[1] or keys.shape[-2] != cache.offset):
        return "keys or values are not the cache's own"
    return None


# Backends on which cached_attention passes the cache's offset as a Python int: the
# reference composite slices by an int kv_len, while a 0-d one makes it score and mask every
# row of the buffer.
INT_KV_LEN_BACKENDS = ("reference",)


def cached_attention(queries, keys, values, cache, scale: float, mask,
                     sinks=None) -> mx.array:
    """sdpa_multi over ``cache``'s whole preallocated buffer (``kv_len = cache.offset``),
    or over ``keys``/``values`` without a cache; call only where :func:`sdpa_unserved`
    says None."""
    if cache is None:
        return sdpa_multi(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    kv_len = cache.offset
    if (backends.resolve_backend() not in INT_KV_LEN_BACKENDS and not isinstance(mask, mx.array)
            and cache.keys.shape[-2] - kv_len < cache.step):
        # kv_len as the 0-d array the kernels read: sdpa_multi then plans for the buffer
        # (one plan per cache.step tokens, no more than step - 1 keys past kv_len) instead
        # of one plan per token (host time per call, stand-in kernels: 19 against 110 us)
        kv_len = scalar(kv_len, mx.uint32)
    return sdpa_multi(queries, cache.keys, cache.values, scale=scale, mask=mask, sinks=sinks,
                      kv_len=kv_len)
