"""Bad inputs, generated systematically from one small valid call per public op: every
variant must be answered with a ValueError/TypeError whose message starts with ``[op]``, or
with a result that matches the op's float64 oracle (a variant that is in fact valid, such as
a broadcastable shape or another index dtype). A bare MLX error, another exception type or a
wrong result fails, named by the variant."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close
from mlx_metaltile.cases import expert_down_combine as edc_cases
from mlx_metaltile.cases import expert_glu as glu_cases
from mlx_metaltile.cases import expert_qmv as qmv_cases
from mlx_metaltile.cases import fp4_qmm as fp4_cases
from mlx_metaltile.cases import gated_rms_norm as norm_cases
from mlx_metaltile.cases import moe_gather_qmm as moe_cases
from mlx_metaltile.cases import moe_route as route_cases
from mlx_metaltile.cases import sdpa_multi as sdpa_cases
from mlx_metaltile.cases._base import to_f64
from mlx_metaltile.ops._common import DEFAULTS

BACKENDS = [b for b in ("reference", "emulator") if b in backends.available_backends()]

WRONG_DTYPES = (mx.int32, mx.uint8, mx.bool_, mx.float64, mx.float32, mx.float16)
BAD_FLOATS = (float("nan"), float("inf"), -1.0, 1e300, 10**400, True, "1e-5", None)
BAD_INTS = (0, -1, 3, 7, 1000, 64.5, "64", True, None)
BAD_STRINGS = ("bogus", "", 3, None)


def _resized(a: mx.array, axis: int, size: int) -> mx.array:
    """``a`` with ``size`` rows on ``axis`` (rows repeated from the start when growing)."""
    reps = -(-size // max(a.shape[axis], 1))
    big = mx.concatenate([a] * max(reps, 1), axis=axis)
    index = [slice(None)] * a.ndim
    index[axis] = slice(0, size)
    return big[tuple(index)]


def array_variants(name: str, a: mx.array) -> Iterator[tuple[str, Any]]:
    yield f"{name}=None", None
    yield f"{name}=list", a.tolist()
    for dt in WRONG_DTYPES:
        if dt != a.dtype:
            yield f"{name} as {dt}", a.astype(dt)
    if a.ndim:
        yield f"{name} without axis 0", a[0]
    yield f"{name} with a new axis 0", a[None]
    for axis in range(a.ndim):
        yield f"{name} axis {axis} size +1", _resized(a, axis, a.shape[axis] + 1)
        if a.shape[axis] > 1:
            yield f"{name} axis {axis} size 1", _resized(a, axis, 1)
        yield f"{name} axis {axis} empty", _resized(a, axis, 0)


def _show(value) -> str:
    """A one-line description of a bad value."""
    if isinstance(value, mx.array):
        return f"mx.array({value.tolist()}, {value.dtype})"
    text = repr(value)
    return text if len(text) < 40 else f"{text[:8]}...({len(text)} digits)"


def variants(valid: dict, scalars: dict) -> Iterator[tuple[str, dict]]:
    for name, value in valid.items():
        if isinstance(value, mx.array):
            for what, bad in array_variants(name, value):
                yield what, {**valid, name: bad}
    scalars = {**scalars, "stream": ("gpu0", 3, mx.float32)}
    if "indices" in valid:  # ids outside [0, E): NaN rows, as documented
        ids = valid["indices"]
        scalars["indices"] = (mx.full(ids.shape, 3, dtype=ids.dtype),
                              mx.full(ids.shape, -1, dtype=mx.int32),
                              mx.full(ids.shape, 2**32 - 1, dtype=mx.uint32))
    for name, bads in scalars.items():
        for bad in bads:
            yield f"{name}={_show(bad)}", {**valid, name: bad}


# ---- one small valid call per op, its bad scalars, its oracle check ---------------------

def _rng():
    return np.random.default_rng(19)


def _norm():
    rng = _rng()
    y, z = (mx.array(rng.standard_normal((2, 8)).astype(np.float32)) for _ in range(2))
    valid = {"y": y, "z": z, "weight": mx.array(rng.standard_normal(8).astype(np.float32)),
             "eps": 1e-5}

    def check(kw, out):
        want = norm_cases.oracle(kw["y"], kw["z"], kw["weight"], kw["eps"])
        assert tuple(out.shape) == want.shape and out.dtype == kw["y"].dtype
        mag, under = norm_cases.float32_error_scales(kw["y"], kw["z"], kw["weight"], kw["eps"],
                                                     want)
        assert_close(out, want, out.dtype, magnitude=mag, underflow_scale=under)

    return mt.gated_rms_norm, valid, {"eps": BAD_FLOATS}, check


def _sdpa():
    rng = _rng()
    q, k, v = sdpa_cases.make_inputs(rng, 1, 2, 1, 2, 4, 64, mx.float32)
    valid = {"q": q, "k": k, "v": v, "scale": 0.35, "causal": False, "kv_len": 3,
             "mask": None, "sinks": None}
    scalars = {"scale": BAD_FLOATS[:-1], "causal": ("yes", None, 2),
               "kv_len": (-1, 0, 1, 5, 10**30, 2.5, float("nan"), "3", True, mx.array([3]),
                          mx.array(3.0), mx.array(3, dtype=mx.int32), mx.array(9)),
               "mask": ("bogus", 3, mx.zeros((2, 4), dtype=mx.int32), mx.zeros((2, 5)),
                        mx.ones((2, 4), dtype=mx.bool_), mx.zeros((1, 2, 2, 4))),
               "sinks": (mx.zeros((3,)), mx.zeros((2,), dtype=mx.int32), mx.zeros((1, 2)),
                         [0.0, 0.0], mx.zeros((2,)))}

    def check(kw, out):
        n, L, S = kw["kv_len"], kw["q"].shape[2], kw["k"].shape[2]
        if isinstance(n, mx.array):  # read by the kernel, clamped to [L, S] (documented)
            n = min(max(n.item(), L), S)
        want, mag = sdpa_cases.oracle(kw["q"], kw["k"], kw["v"], kw["scale"], kw["causal"],
                                      S if n is None else n, kw["mask"],
                                      kw["sinks"])
        assert tuple(out.shape) == want.shape and out.dtype == kw["q"].dtype
        got = to_f64(out)
        nan = np.isnan(want)
        assert np.isnan(got[nan]).all()
        assert_close(np.where(nan, 0, got), np.where(nan, 0, want), out.dtype,
                     np.where(nan, 0, mag))

    return mt.sdpa_multi, valid, scalars, check


def _quant_scalars(modes=("affine", "mxfp4")):
    return {"group_size": BAD_INTS + (32, 128), "bits": BAD_INTS + (8,),
            "mode": BAD_STRINGS + tuple(m for m in modes if m != "affine")}


def _sizes(kw):
    gs, nb = DEFAULTS.get(kw.get("mode"), (None, None))
    return kw["group_size"] or gs, kw["bits"] or nb


def _check_rows(want, mag, valid, out, dtype):
    assert tuple(out.shape) == want.shape and out.dtype == dtype
    got = to_f64(out)
    assert np.isnan(got[~valid]).all()
    assert_close(got[valid], want[valid], dtype, magnitude=mag[valid])


def _expert_qmv():
    rng = _rng()
    w, s, b = qmv_cases.make_packed(rng, 3, 5, 64, mx.float32, 64, 4)
    valid = {"x": qmv_cases.make_x(rng, (2, 64), mx.float32), "w": w, "scales": s,
             "biases": b, "indices": mx.array([[0, 2], [1, 1]], dtype=mx.uint32),
             "group_size": None, "bits": None, "mode": "affine"}

    def check(kw, out):
        gs, nb = _sizes(kw)
        want, mag, ok = qmv_cases.oracle(kw["x"], kw["w"], kw["scales"], kw["biases"],
                                         kw["indices"], gs, nb)
        _check_rows(want, mag, ok, out, kw["x"].dtype)

    return mt.expert_qmv, valid, _quant_scalars(), check


def _moe():
    rng = _rng()
    x, w, s, b, ids = moe_cases.make_case(rng, 3, 3, 32, 64, 64, 4, mx.float32,
                                          ids=[0, 2, 2])
    valid = {"x": x, "w": w, "scales": s, "biases": b, "indices": ids,
             "group_size": None, "bits": None, "mode": "affine"}
    scalars = {**_quant_scalars(), "sorted_indices": ("yes", None),
               "variant": BAD_STRINGS[:-1]}

    def check(kw, out):
        gs, nb = _sizes(kw)
        x, ids = kw["x"], kw["indices"]
        if x.ndim == 3:  # mx.gather_qmm's form: out[i] = x[i or 0] @ W[ids[i]].T
            for i in range(ids.shape[0]):
                one = {**kw, "x": x[i if x.shape[0] > 1 else 0],
                       "indices": mx.full((x.shape[1],), ids[i].item(), dtype=ids.dtype)}
                check(one, out[i])
            return
        want, mag = moe_cases.oracle(x, kw["w"], kw["scales"], kw["biases"], ids, gs, nb,
                                     x.dtype)
        _check_rows(want, mag, ~np.isnan(want[:, 0]), out, x.dtype)

    return mt.moe_gather_qmm, valid, scalars, check


def _fp4():
    rng = _rng()
    x, w, s = fp4_cases.make_case(rng, 2, 32, 64, mx.float32, "e8m0", 32)
    valid = {"x": x, "w": w, "scales": s, "group_size": None, "mode": None}
    scalars = {"group_size": BAD_INTS + (16, 32), "mode": BAD_STRINGS[:-1] + ("affine",
                                                                          "nvfp4"),
               "variant": BAD_STRINGS[:-1]}

    def check(kw, out):
        k = kw["w"].shape[1] * 8
        gs = kw["group_size"] or k // kw["scales"].shape[-1]
        kind = "e8m0" if gs == 32 else "e4m3"
        if kw["scales"].dtype != mx.uint8:
            kind = str(kw["scales"].dtype).split(".")[-1]
        want, mag = fp4_cases.oracle(kw["x"], kw["w"], kw["scales"], kind, gs)
        assert tuple(out.shape) == want.shape and out.dtype == kw["x"].dtype
        assert_close(out, want, out.dtype, magnitude=mag)

    return mt.fp4_qmm, valid, scalars, check


def _glu():
    rng = _rng()
    gate = glu_cases.make_experts(rng, 3, 5, 64, mx.float32, bias=True)
    up = glu_cases.make_experts(rng, 3, 5, 64, mx.float32, bias=True)
    valid = {"x": glu_cases.make_x(rng, (2, 64), mx.float32),
             "w_gate": gate[0], "scales_gate": gate[1], "biases_gate": gate[2],
             "w_up": up[0], "scales_up": up[1], "biases_up": up[2],
             "indices": mx.array([[0, 2], [1, 1]], dtype=mx.uint32),
             "bias_gate": gate[3], "bias_up": up[3], "activation": "silu",
             "mode": "affine", "group_size": None, "bits": None}
    scalars = {**_quant_scalars(), "activation": BAD_STRINGS}

    def check(kw, out):
        gs, nb = _sizes(kw)
        g = (kw["w_gate"], kw["scales_gate"], kw["biases_gate"], kw["bias_gate"])
        u = (kw["w_up"], kw["scales_up"], kw["biases_up"], kw["bias_up"])
        want, mag, ok = glu_cases.oracle(kw["x"], g, u, kw["indices"], kw["activation"],
                                         kw["mode"], gs, nb)
        _check_rows(want, mag, ok, out, kw["x"].dtype)

    return mt.expert_glu, valid, scalars, check


def _down():
    rng = _rng()
    down = glu_cases.make_experts(rng, 3, 5, 64, mx.float32, bias=True)
    valid = {"h": glu_cases.make_x(rng, (2, 2, 64), mx.float32), "w": down[0],
             "scales": down[1], "biases": down[2],
             "indices": mx.array([[0, 2], [1, 1]], dtype=mx.uint32),
             "scores": edc_cases.make_scores(rng, (2, 2)), "bias": down[3],
             "mode": "affine", "group_size": None, "bits": None}

    def check(kw, out):
        gs, nb = _sizes(kw)
        d = (kw["w"], kw["scales"], kw["biases"], kw["bias"])
        want, mag, ok = edc_cases.oracle(kw["h"], d, kw["indices"], kw["scores"], kw["mode"],
                                         gs, nb)
        _check_rows(want, mag, ok, out, kw["h"].dtype)

    return mt.expert_down_combine, valid, _quant_scalars(), check


def _route():
    valid = {"logits": mx.array(_rng().standard_normal((2, 8)).astype(np.float32)), "k": 3,
             "normalize": True}

    def check(kw, out):
        ids, scores = out
        route_cases.check(ids, scores, kw["logits"], kw["k"], kw["normalize"], "moe_route")

    bad_k = (0, -1, 9, 33, 2.5, "3", True, None)
    return mt.moe_route, valid, {"k": bad_k, "normalize": (1, "yes", None)}, check


OPS: dict[str, Callable] = {
    "gated_rms_norm": _norm, "sdpa_multi": _sdpa, "expert_qmv": _expert_qmv,
    "moe_gather_qmm": _moe, "fp4_qmm": _fp4, "expert_glu": _glu,
    "expert_down_combine": _down, "moe_route": _route,
}


def judge(op: str, fn, check, kw: dict, backend: str) -> str | None:
    """None when ``kw`` is answered well, else what went wrong."""
    try:
        with backends.use_backend(backend):
            out = fn(**kw)
            mx.eval(out)
    except (ValueError, TypeError) as e:
        return None if str(e).startswith(f"[{op}]") else f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return f"{type(e).__name__}: {e}"
    try:
        check(kw, out)
    except Exception as e:  # noqa: BLE001
        return f"accepted with a wrong result: {type(e).__name__}: {str(e)[:200]}"
    return None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_bad_inputs_answered_with_op_error_or_correct_result(op, backend):
    fn, valid, scalars, check = OPS[op]()
    before = backends.launch_count(backend=backend)
    with backends.use_backend(backend):  # the valid call is accepted and right
        check(valid, fn(**valid))
    if backend != "reference":  # the kernels ran (never the reference against itself)
        assert backends.launch_count(backend=backend) > before
    failures, n = [], 0
    for what, kw in variants(valid, scalars):
        n += 1
        bad = judge(op, fn, check, kw, backend)
        if bad is not None:
            failures.append(f"{what}: {bad.splitlines()[0]}")
    print(f"{op}[{backend}]: {n - len(failures)}/{n} variants answered well")
    assert not failures, f"{len(failures)}/{n} variants answered badly:\n" + "\n".join(
        failures)


def test_judge_flags_bare_errors_and_wrong_results():
    """The judge can fail: a bare or unprefixed error, and a wrong result, are findings."""
    fn, valid, _, check = OPS["gated_rms_norm"]()

    def raising(exc):
        def fn(**kw):
            raise exc
        return fn

    ok = raising(ValueError("[gated_rms_norm] y must ..."))
    assert judge("gated_rms_norm", ok, check, valid, "reference") is None
    for exc in (ValueError("y must ..."), IndexError("[gated_rms_norm] x"),
                RuntimeError("[gated_rms_norm] x")):
        assert judge("gated_rms_norm", raising(exc), check, valid, "reference") is not None
    assert judge("gated_rms_norm", lambda **kw: fn(**kw) * 1.01, check, valid,
                 "reference").startswith("accepted with a wrong result")
