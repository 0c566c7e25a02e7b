"""mx.compile(shapeless=True) and mx.vmap on every op: what runs (against the op called
without the transform), what is refused with an [op] error, and MLX's own refusals that a
future MLX may lift (recorded here so that the change is noticed)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import backend_params, require_backend

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.ops._common import clear_plans
from mlx_metaltile.ops._grad import shapeless_tracing

E, N, K = 6, 64, 128


@pytest.fixture(scope="module")
def t():
    """Evaluated weights (no lazy random graph leaks into a trace) and an input maker."""
    rng = np.random.default_rng(7)

    def arr(shape, dtype=mx.float32):
        a = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        mx.eval(a)
        return a

    def ids(shape):
        a = mx.array(rng.integers(0, E, shape), dtype=mx.uint32)
        mx.eval(a)
        return a

    wq, s, b = mx.quantize(arr((E, N, K)), group_size=64, bits=4)
    wd, sd, bd = mx.quantize(arr((E, N, N)), group_size=64, bits=4)
    wf, sf = mx.quantize(arr((N, K)), mode="mxfp4")[:2]
    out = dict(arr=arr, ids=ids, wq=wq, s=s, b=b, wd=wd, sd=sd, bd=bd, wf=wf, sf=sf,
               w100=arr((100,)), k=arr((1, 2, 64, 64)), v=arr((1, 2, 64, 64)))
    mx.eval(*(v for v in out.values() if isinstance(v, mx.array)))
    return out


def _same(a, b) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b, equal_nan=True).item()


def test_shapeless_probe():
    """The ops' test for a shapeless trace (MLX 0.32 has no query; ops/_grad.py reads how
    mx.mean is built): true inside mx.compile(shapeless=True) only."""
    seen = []

    def fn(a):
        seen.append(shapeless_tracing())
        return a + 1

    a = mx.zeros((3,))
    fn(a)
    mx.eval(mx.compile(fn)(a), mx.vmap(fn)(a), mx.grad(lambda a: fn(a).sum())(a))
    mx.eval(mx.compile(fn, shapeless=True)(a))
    assert seen == [False, False, False, False, True]


# ---- mx.compile(shapeless=True) -----------------------------------------------------------

def _calls(t):
    """name -> (op of its array arguments, arguments for a leading size n)."""
    arr, ids = t["arr"], t["ids"]
    return {
        "gated_rms_norm": (lambda y, z: mt.gated_rms_norm(y, z, t["w100"]),
                           lambda n: (arr((n, 100)), arr((n, 100)))),
        "gated_rms_norm 3-d": (lambda y, z: mt.gated_rms_norm(y, z, t["w100"]),
                               lambda n: (arr((2, n, 100)), arr((2, n, 100)))),
        "fp4_qmm": (lambda x: mt.fp4_qmm(x, t["wf"], t["sf"], mode="mxfp4"),
                    lambda n: (arr((n, K)),)),
        "moe_gather_qmm rows": (lambda x, i: mt.moe_gather_qmm(x, t["wq"], t["s"], t["b"], i),
                                lambda n: (arr((n, K)), ids((n,)))),
        "moe_gather_qmm gather_qmm form": (
            lambda x, i: mt.moe_gather_qmm(x, t["wq"], t["s"], t["b"], i),
            lambda n: (arr((n, 1, 1, K)), ids((n, 2)))),
        "sdpa_multi kv_len": (  # a device-side kv_len: the shapes stay, kv_len changes
            lambda q, n: mt.sdpa_multi(q, t["k"], t["v"], scale=0.125, kv_len=n),
            lambda n: (arr((1, 4, 2, 64)), mx.array(n + 30))),
    }


SHAPELESS = ("gated_rms_norm", "gated_rms_norm 3-d", "fp4_qmm", "moe_gather_qmm rows",
             "moe_gather_qmm gather_qmm form", "sdpa_multi kv_len")


@pytest.mark.parametrize("name", SHAPELESS)
@pytest.mark.parametrize("sizes", [(3, 5, 1, 9), (9, 1, 12, 3)], ids=["from3", "from9"])
def test_shapeless_compile_reference(t, name, sizes):
    """On the reference backend one shapeless trace serves every later size: each call
    equals the op called directly (bitwise). From 9, the rows form of moe_gather_qmm traces
    its mx.gather_mm branch (more ids than experts)."""
    if name == "moe_gather_qmm gather_qmm form" and sizes[0] == 9:
        pytest.skip("refused: test_shapeless_gather_qmm_form_many_ids_refused")
    call, make = _calls(t)[name]
    with backends.use_backend("reference"):
        compiled = mx.compile(call, shapeless=True)
        for n in sizes:
            args = make(n)
            assert _same(compiled(*args), call(*args)), n


@pytest.mark.parametrize("name", ["gated_rms_norm", "fp4_qmm", "moe_gather_qmm rows"])
def test_shapeless_gradients_reference(t, name):
    """Inside a shapeless trace the reference backend's ops are their plain composites (no
    mx.custom_function, which MLX cannot trace shapeless): MLX's autodiff of the composite,
    within 2e-6 of the largest entry of the op's own VJP (which test_grad.py checks against
    float64 gradients)."""
    call, make = _calls(t)[name]
    argnums = (0, 1) if name == "gated_rms_norm" else 0
    with backends.use_backend("reference"):
        for n in (3, 5):  # moe_gather_qmm: fewer ids than experts (see the test below)
            args = make(n)
            c = t["arr"]((n, 100 if name == "gated_rms_norm" else N))

            def loss(*a, c=c):
                return (call(*a) * c).sum()

            want = mx.grad(loss, argnums=argnums)(*args)
            got = mx.compile(mx.grad(loss, argnums=argnums), shapeless=True)(*args)
            for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)),
                            strict=True):
                assert g.shape == w.shape
                bound = 2e-6 * mx.max(mx.abs(w)).item()
                assert mx.max(mx.abs(g - w)).item() <= bound


def test_shapeless_gradient_gather_mm_refused_by_mlx(t):
    """With more ids than experts the rows form's composite is mx.gather_mm with explicit
    lhs_indices; MLX 0.32 cannot trace its gradient shapeless (a scatter)."""
    call, make = _calls(t)["moe_gather_qmm rows"]
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=r"^\[Primitive::output_shapes\] Scatter Sum cannot infer output "
                              r"shapes\.$"):
        mx.eval(mx.compile(mx.grad(lambda x, i: call(x, i).sum()), shapeless=True)(*make(9)))


def test_shapeless_gated_weight_gradient(t):
    """gated_rms_norm's weight gradient (a sum over rows) in a shapeless trace, other rows
    counts than the trace's (larger ones: MLX 0.32's compiled shapeless graphs can crash
    when an axis traced larger than 1 is called with 1, which this op's graph avoids only
    on the forward pass)."""
    y, z = t["arr"]((3, 100)), t["arr"]((3, 100))

    def loss(w, y, z):
        return mt.gated_rms_norm(y, z, w).sum()

    with backends.use_backend("reference"):
        grad = mx.compile(mx.grad(loss), shapeless=True)
        for n in (3, 7, 5):
            y, z = t["arr"]((n, 100)), t["arr"]((n, 100))
            want = mx.grad(loss)(t["w100"], y, z)
            got = grad(t["w100"], y, z)
            assert mx.max(mx.abs(got - want)).item() <= 2e-6 * mx.max(mx.abs(want)).item()


@pytest.mark.parametrize("op", ["expert_qmv", "expert_glu", "expert_down_combine"])
def test_shapeless_refused_expert_ops(t, op):
    """The expert ops' composite is mx.gather_qmm, whose default lhs_indices MLX fixes at
    the trace (a batch of 1 after a trace of 3 would silently broadcast to 3): refused."""
    x, i, sc = t["arr"]((3, K)), t["ids"]((3, 2)), t["arr"]((3, 2))
    h = t["arr"]((3, 2, N))
    call = {
        "expert_qmv": lambda x, i: mt.expert_qmv(x, t["wq"], t["s"], t["b"], i),
        "expert_glu": lambda x, i: mt.expert_glu(x, t["wq"], t["s"], t["b"], t["wq"],
                                                 t["s"], t["b"], i),
        "expert_down_combine": lambda h, i: mt.expert_down_combine(h, t["wd"], t["sd"],
                                                                   t["bd"], i, sc),
    }[op]
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=rf"^\[{op}\] mx.compile\(shapeless=True\) is not supported on "
                              r"the reference backend: its composite is mx.gather_qmm"):
        mx.compile(call, shapeless=True)(h if op == "expert_down_combine" else x, i)


def test_shapeless_refused_moe_route(t):
    """moe_route's composite orders the logits by their bits (mx.view), which MLX 0.32
    cannot trace shapeless: refused with an [op] error, not MLX's."""
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=r"^\[moe_route\] mx.compile\(shapeless=True\) is not supported "
                              r"on the reference backend: its composite reads the logits' bits"):
        mx.compile(lambda x: mt.moe_route(x, 2), shapeless=True)(t["arr"]((3, 8)))


def test_mlx_view_has_no_shapeless_trace():
    """Why moe_route refuses a shapeless trace. An MLX that can trace mx.view shapeless
    fails this test: then lift the refusal (and the README's row)."""
    with pytest.raises(ValueError, match=r"^\[Primitive::output_shapes\] View uint32 cannot "
                                         r"infer output shapes\.$"):
        mx.eval(mx.compile(lambda a: a.view(mx.uint32), shapeless=True)(mx.zeros((3,))))


def test_shapeless_gather_qmm_form_many_ids_refused(t):
    call, make = _calls(t)["moe_gather_qmm gather_qmm form"]
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=r"^\[moe_gather_qmm\] mx.compile\(shapeless=True\) of "
                              r"mx.gather_qmm's form with more ids \(18\) than experts \(6\)"):
        mx.compile(call, shapeless=True)(*make(9))


def test_mlx_refuses_custom_function_shapeless():
    """MLX 0.32.4 cannot trace an mx.custom_function with a custom transform shapeless:
    every op on a kernel backend is one (its VJP), so none compiles shapeless there. A
    future MLX that can fails this test: then lift the refusal in the README."""
    @mx.custom_function
    def f(a):
        return a * 2

    @f.vjp
    def f_vjp(primals, cotangent, output):
        return cotangent * 2

    with pytest.raises(ValueError, match=r"^\[Primitive::output_shapes\] CustomTransforms "
                                         r"cannot infer output shapes\.$"):
        mx.eval(mx.compile(f, shapeless=True)(mx.zeros((3,))))


@pytest.mark.parametrize("backend", backend_params("metal", "cuda"))
def test_shapeless_kernel_backend_refused_by_mlx(t, backend):
    require_backend(backend)
    call, make = _calls(t)["fp4_qmm"]
    with backends.use_backend(backend), pytest.raises(ValueError, match="cannot infer output "
                                                                        "shapes"):
        mx.eval(mx.compile(call, shapeless=True)(*make(3)))


# ---- mx.vmap --------------------------------------------------------------------------------

def _vmap_cases(t):
    """name -> (op, mapped arguments with the mapped axis, in_axes)."""
    arr, ids = t["arr"], t["ids"]
    return {
        "gated_rms_norm y, z": (lambda y, z: mt.gated_rms_norm(y, z, t["w100"]),
                                (arr((3, 2, 100)), arr((3, 2, 100))), 0),
        "gated_rms_norm axis 1": (lambda y, z: mt.gated_rms_norm(y, z, t["w100"]),
                                  (arr((2, 3, 100)), arr((2, 3, 100))), 1),
        "gated_rms_norm weight": (lambda w, y: mt.gated_rms_norm(y, y, w),
                                  (arr((3, 100)), arr((2, 100))), (0, None)),
        "sdpa_multi q, k, v": (lambda q, k, v: mt.sdpa_multi(q, k, v, scale=0.125),
                               (arr((3, 1, 4, 2, 64)), arr((3, 1, 2, 40, 64)),
                                arr((3, 1, 2, 40, 64))), 0),
        "fp4_qmm x": (lambda x: mt.fp4_qmm(x, t["wf"], t["sf"], mode="mxfp4"),
                      (arr((3, 5, K)),), 0),
        "moe_gather_qmm rows": (lambda x, i: mt.moe_gather_qmm(x, t["wq"], t["s"], t["b"], i),
                                (arr((3, 4, K)), ids((3, 4))), 0),
        "moe_gather_qmm gather_qmm form": (
            lambda x, i: mt.moe_gather_qmm(x, t["wq"], t["s"], t["b"], i),
            (arr((2, 3, 1, 1, K)), ids((2, 3, 2))), 0),
        "moe_route logits axis 1": (lambda x: _routed(mt.moe_route(x, 3)),
                                    (arr((2, 4, 40)),), 1),
    }


def _routed(out):
    """moe_route's (ids, scores) as one array (the ids exact in float32)."""
    return mx.concatenate([a.astype(mx.float32) for a in out], axis=-1)


@pytest.mark.parametrize("name", ["gated_rms_norm y, z", "gated_rms_norm axis 1",
                                  "gated_rms_norm weight", "sdpa_multi q, k, v", "fp4_qmm x",
                                  "moe_gather_qmm rows", "moe_gather_qmm gather_qmm form",
                                  "moe_route logits axis 1"])
def test_vmap_reference(t, name):
    """Where MLX maps the reference composite: the mapped result equals the op on each
    slice (bitwise)."""
    call, args, in_axes = _vmap_cases(t)[name]
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    size = next(a.shape[ax] for a, ax in zip(args, axes, strict=True) if ax is not None)
    with backends.use_backend("reference"):
        got = mx.vmap(call, in_axes=in_axes)(*args)
        want = mx.stack([call(*(a if ax is None else mx.take(a, j, axis=ax)
                                for a, ax in zip(args, axes, strict=True)))
                         for j in range(size)])
        assert _same(got, want)


def _expert_calls(t):
    x, i, sc, h = t["arr"]((2, 3, K)), t["ids"]((2, 3, 2)), t["arr"]((2, 3, 2)), \
        t["arr"]((2, 3, 2, N))
    return {
        "expert_qmv": (lambda x, i: mt.expert_qmv(x, t["wq"], t["s"], t["b"], i), (x, i)),
        "expert_glu": (lambda x, i: mt.expert_glu(x, t["wq"], t["s"], t["b"], t["wq"],
                                                  t["s"], t["b"], i), (x, i)),
        "expert_down_combine": (lambda h, i, s: mt.expert_down_combine(
            h, t["wd"], t["sd"], t["bd"], i, s), (h, i, sc)),
    }


@pytest.mark.parametrize("op", ["expert_qmv", "expert_glu", "expert_down_combine"])
@pytest.mark.parametrize("in_axes", [0, (0, None)], ids=["all", "first"])
def test_vmap_refused_gather_qmm(t, op, in_axes):
    """MLX cannot map mx.gather_qmm (the expert ops' composite): an [op] error naming it,
    not MLX's 'GatherQMM::vmap NYI'."""
    call, args = _expert_calls(t)[op]
    if isinstance(in_axes, tuple):  # only the activations mapped: the others one slice
        in_axes = in_axes + (None,) * (len(args) - 2)
        args = (args[0], *(a[0] for a in args[1:]))
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=rf"^\[{op}\] mx.vmap is not supported here: its reference "
                              r"composite is mx.gather_qmm, .*GatherQMM::vmap NYI"):
        mx.eval(mx.vmap(call, in_axes=in_axes)(*args))


def test_vmap_refused_gather_mm(t):
    """moe_gather_qmm with more ids than experts takes mx.gather_mm, which MLX cannot map."""
    x, i = t["arr"]((2, 5, 1, 2, K)), t["ids"]((2, 5, 2))
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=r"^\[moe_gather_qmm\] mx.vmap is not supported here: .*"
                              r"mx.gather_mm for more ids \(10\) than experts \(6\)"):
        mx.eval(mx.vmap(lambda x, i: mt.moe_gather_qmm(x, t["wq"], t["s"], t["b"], i))(x, i))


@pytest.mark.parametrize("op", ["expert_qmv", "moe_gather_qmm", "fp4_qmm"])
def test_vmap_over_quantized_weights_refused(t, op):
    """The quantized constants cannot be mapped (by any backend): an [op] error naming the
    argument and its axis."""
    x = t["arr"]((3, K))
    if op == "fp4_qmm":
        w = mx.stack([t["wf"]] * 2, axis=1)
        fn = lambda w: mt.fp4_qmm(x, w, t["sf"], mode="mxfp4")  # noqa: E731
    else:
        w = mx.stack([t["wq"]] * 2, axis=1)
        ids = t["ids"]((3, 2) if op == "expert_qmv" else (3,))
        fn = lambda w: getattr(mt, op)(x, w, t["s"], t["b"], ids)  # noqa: E731
    with backends.use_backend("reference"), pytest.raises(
            ValueError, match=rf"^\[{op}\] mx.vmap over w is not supported \(axis 1\)"):
        mx.eval(mx.vmap(fn, in_axes=1)(w))


@pytest.mark.parametrize("op", ["expert_qmv", "moe_gather_qmm", "fp4_qmm"])
def test_vmap_over_quantized_weights_refused_kernel_path(t, monkeypatch, op):
    """On a kernel backend's code path too (cuda, the kernel replaced by the reference
    composite: this machine has no GPU) a mapped quantized constant is refused by the
    constants' wrapper before MLX meets the kernel."""
    mod = importlib.import_module(f"mlx_metaltile.ops.{op}")
    stand_in = {  # the launcher's arguments -> a launch running the reference composite
        "expert_qmv": lambda info, backend, dtype: lambda *a: mod._reference(*a, info),
        "moe_gather_qmm": lambda spec, M, N, K, E, gs, bits, mode, dtype, backend:
            lambda x, w, s, b, i: mod._reference(x, w, s, b, i, None, M, N, E, gs, bits, mode),
        "fp4_qmm": lambda spec, m, n, k, mode, gs, dtype, scale_dtype, backend, out_shape:
            lambda x, w, s: mod._reference(x, w, s, gs, mode),
    }[op]
    monkeypatch.setattr(mod, "_launcher", stand_in)
    if op == "moe_gather_qmm":  # cuda's GEMV plan off: the stood-in tiled launcher runs
        monkeypatch.setattr(mod, "GEMV_ROWS_PER_EXPERT", {})
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "cuda")
    clear_plans()
    try:
        test_vmap_over_quantized_weights_refused(t, op)
    finally:
        clear_plans()


@pytest.mark.parametrize("backend", backend_params("metal", "cuda"))
@pytest.mark.parametrize("op", ["gated_rms_norm y, z", "sdpa_multi q, k, v", "fp4_qmm x",
                                "moe_gather_qmm rows", "moe_route logits axis 1"])
def test_vmap_kernel_backend_mlx_error(t, backend, op):
    """MLX cannot map custom kernels (MLX 0.32.4): its own error reaches the caller (an
    [op] refusal first would cost about 6 us a call). An MLX that maps them fails this."""
    require_backend(backend)
    call, args, in_axes = _vmap_cases(t)[op]
    with backends.use_backend(backend), pytest.raises(
            ValueError, match=r"\[Primitive::vmap\] Not implemented for CustomKernel"):
        mx.eval(mx.vmap(call, in_axes=in_axes)(*args))
