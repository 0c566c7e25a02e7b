"""The ops' remembered plans (ops/_common.memo_plan): a repeat call with other arrays of the
same shapes reuses the plan and computes with its own arrays (forward and gradient, bitwise
as with a fresh plan), and a plan keeps no argument array alive."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile.ops._common import _PLANS, clear_plans

E, N, K = 4, 64, 128


def _calls(rng) -> dict:
    """op -> (a call of its differentiable first argument, the arguments): small problems,
    every array fresh from ``rng``."""
    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    def ids(*shape):
        return mx.array(rng.integers(0, E, shape), dtype=mx.uint32)

    wq, s, b = mx.quantize(arr(E, N, K), group_size=64, bits=4)
    wu, su, bu = mx.quantize(arr(E, N, K), group_size=64, bits=4)
    wd, sd, bd = mx.quantize(arr(E, N, N), group_size=64, bits=4)
    wf, sf = mx.quantize(arr(N, K), mode="mxfp4")[:2]
    return {
        "gated_rms_norm": (lambda y, z, w: mt.gated_rms_norm(y, z, w),
                           (arr(3, N), arr(3, N), arr(N))),
        "expert_qmv": (lambda x, w, s, b, i: mt.expert_qmv(x, w, s, b, i),
                       (arr(2, K), wq, s, b, ids(2, 2))),
        "expert_glu": (lambda x, *rest: mt.expert_glu(x, *rest),
                       (arr(2, K), wq, s, b, wu, su, bu, ids(2, 2))),
        "expert_down_combine": (lambda h, w, s, b, i, sc: mt.expert_down_combine(
            h, w, s, b, i, sc), (arr(2, 2, N), wd, sd, bd, ids(2, 2), arr(2, 2))),
        "fp4_qmm": (lambda x, w, s: mt.fp4_qmm(x, w, s, mode="mxfp4"),
                    (arr(2, K), wf, sf)),
        "moe_gather_qmm": (lambda x, w, s, b, i: mt.moe_gather_qmm(x, w, s, b, i),
                           (arr(3, K), wq, s, b, ids(3))),
        "sdpa_multi": (lambda q, k, v: mt.sdpa_multi(q, k, v, scale=0.125, kv_len=33),
                       (arr(1, 4, 2, 64), arr(1, 2, 40, 64), arr(1, 2, 40, 64))),
        # the scores (normalize=False: their sum is not 1, so its gradient is not 0)
        "moe_route": (lambda x: mt.moe_route(x, 3, normalize=False)[1], (arr(3, 40),)),
    }


def _run(call, args):
    """The output and the gradient of its sum w.r.t. the first argument, evaluated."""
    out = call(*args)
    grad = mx.grad(lambda a: call(a, *args[1:]).astype(mx.float32).sum())(args[0])
    mx.eval(out, grad)
    return out, grad


def _plans() -> int:
    return sum(len(memory) for memory in _PLANS)


def _same(a, b) -> bool:
    return mx.array_equal(a, b, equal_nan=True).item()


OPS = ("gated_rms_norm", "expert_qmv", "expert_glu", "expert_down_combine", "fp4_qmm",
       "moe_gather_qmm", "sdpa_multi", "moe_route")


@pytest.mark.parametrize("op", OPS)
def test_a_remembered_plan_computes_with_the_calls_arrays(any_backend, op):
    first = _calls(np.random.default_rng(1))[op]
    call, args = _calls(np.random.default_rng(2))[op]
    mx.eval(*first[1], *args)
    _run(*first)  # builds the plan
    built = _plans()
    assert built > 0
    out, grad = _run(call, args)  # other arrays, the same shapes: the same plan
    assert _plans() == built
    clear_plans()
    want_out, want_grad = _run(call, args)  # a fresh plan
    assert _same(out, want_out) and _same(grad, want_grad)
    assert not _same(out, _run(*first)[0])  # the arrays differ: so must the results


@pytest.mark.parametrize("op", OPS)
def test_a_plan_keeps_no_argument_alive(any_backend, op):
    call, args = _calls(np.random.default_rng(3))[op]
    mx.eval(*args)
    refs = [weakref.ref(a) for a in args]
    _run(call, args)
    assert _plans() > 0
    del call, args
    gc.collect()
    assert all(ref() is None for ref in refs)
