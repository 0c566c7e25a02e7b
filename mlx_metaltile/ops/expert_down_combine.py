"""expert_down_combine: MoE decode down projection, router-score weighting and the sum over
the k experts, one dispatch.

mlx-lm's MoE blocks run the down projection (``gather_qmm``, ``[..., k, D]`` written), then
multiply by the scores and sum over k (more dispatches, the intermediate read back). This op
writes ``[..., D]`` directly, summing the k experts in a fixed order (bitwise reproducible;
no atomics).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    BITS,
    DEFAULTS,
    FLOAT_TYPES,
    GROUP_SIZES,
    INDEX_TYPES,
    MODE_IDS,
    MODES,
    QUANTIZED_PARAMS,
    dtype_name,
    require_array,
    require_float,
    scalar,
)
from .expert_qmv import ROWS_PER_THREADGROUP, SIMDGROUPS, _check_expert_qmv
from .expert_qmv import _reference as _qmv_reference

OP = "expert_down_combine"
__all__ = ["expert_down_combine", "expert_down_combine_reference"]


def _bindings():
    for t in FLOAT_TYPES:
        for mode in MODES:
            sizes = ([(b, gs) for b in BITS for gs in GROUP_SIZES] if mode == "affine"
                     else [DEFAULTS[mode][::-1]])
            s = t if mode == "affine" else mx.uint8
            for bits, gs in sizes:
                for i in INDEX_TYPES:
                    for r in dict.fromkeys((t, mx.float32)):
                        yield dict(T=t, S=s, BITS=bits, GROUP_SIZE=gs, MODE=MODE_IDS[mode],
                                   I=i, R=r)


(SPEC,) = register(
    KernelSpec(
        op=OP, variant="simd_rows", template="expert_down_combine.metal",
        inputs=(Arg("h", "T", 2), Arg("w", "uint32", 3), Arg("scales", "S", 3),
                Arg("biases", "S", 3), Arg("indices", "I", 1), Arg("scores", "R", 1),
                Arg("bias", "T", 2),
                *scalars("n_experts", "n_out", "k_in", "n_sel", "has_bias")),
        outputs=(Arg("out", "T", 2),), params=QUANTIZED_PARAMS, bindings=_bindings,
        geometry="threadgroup (64, 1, 1): 2 SIMD-groups x 4 output rows; "
                 "grid (64, ceil(D / 8), tokens): one threadgroup per (token, 8-row tile), "
                 "its k experts summed in order",
        notes="expert_qmv's modes; scores in h's dtype or float32; optional per-expert "
              "biases; any id >= E (or < 0) makes the token's row NaN",
    ),
)


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


def _reference(h, w, scales, biases, indices, scores, bias, info: dict) -> mx.array:
    """expert_qmv's composite, then the scores and the sum over k, in float32."""
    hf = h.astype(mx.float32)
    if info["mode"] == "affine":
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    y = _qmv_reference(hf, w, scales, biases, indices, info)  # NaN rows for bad ids
    if bias is not None:
        valid = indices < info["n_experts"]
        if indices.dtype == mx.int32:
            valid = valid & (indices >= 0)
        y = y + bias[mx.where(valid, indices, 0)].astype(mx.float32)
    y = (y * scores.astype(mx.float32)[..., None]).sum(axis=-2)
    return y.astype(h.dtype)


def _launch(h, w, scales, biases, indices, scores, bias, info: dict, backend: str):
    n_out, n_in, k = info["n_out"], info["in_features"], info["k"]
    tokens = math.prod(info["lead"])
    hs = h.reshape(-1, n_in)
    if biases is None:  # fp modes: never read
        biases = scales
    tg = backends.SIMD_WIDTH * SIMDGROUPS
    (out,) = backends.launch(
        SPEC, backend,
        inputs={"h": hs, "w": w, "scales": scales, "biases": biases,
                "indices": indices.reshape(-1), "scores": scores.reshape(-1),
                "bias": hs if bias is None else bias,  # never read without a bias
                "n_experts": scalar(info["n_experts"], mx.uint32),
                "n_out": scalar(n_out, mx.uint32), "k_in": scalar(n_in, mx.uint32),
                "n_sel": scalar(k, mx.uint32),
                "has_bias": scalar(int(bias is not None), mx.uint32)},
        template={"T": h.dtype, "BITS": info["bits"], "GROUP_SIZE": info["group_size"],
                  "MODE": MODE_IDS[info["mode"]]},
        outputs={"out": ((tokens, n_out), h.dtype)},
        grid=(tg, -(-n_out // ROWS_PER_THREADGROUP), tokens), threadgroup=(tg, 1, 1),
    )
    return out.reshape(_out_shape(info))


def _run(impl, args, stream):
    if stream is None:
        return impl(*args)
    with mx.stream(stream):
        return impl(*args)


def expert_down_combine_reference(h, w, scales, biases, indices, scores, *, bias=None,
                                  mode: str = "affine", group_size: int | None = None,
                                  bits: int | None = None, stream=None) -> mx.array:
    """Pure-MLX composite with :func:`expert_down_combine`'s contract (float32 inside)."""
    info = _check(h, w, scales, biases, indices, scores, bias, group_size, bits, mode)
    if 0 in _out_shape(info) or info["k"] == 0:
        return mx.zeros(_out_shape(info), dtype=h.dtype)
    return _run(_reference, (h, w, scales, biases, indices, scores, bias, info), stream)


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
    experts are summed in slot order (j = 0, 1, ...), so results are bitwise reproducible
    run to run. If any of a token's ids is outside ``[0, E)`` that token's whole row is NaN.
    k = 0 gives zeros.
    """
    info = _check(h, w, scales, biases, indices, scores, bias, group_size, bits, mode)
    if 0 in _out_shape(info) or info["k"] == 0:
        return mx.zeros(_out_shape(info), dtype=h.dtype)
    args = (h, w, scales, biases, indices, scores, bias, info)
    backend = backends.resolve_backend()
    if backend == "reference":
        return _run(_reference, args, stream)
    return _run(_launch, (*args, backend), stream)
