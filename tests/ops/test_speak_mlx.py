"""MLX's calling conventions on every op: stream=, NumPy scalars, gated_rms_norm's dtypes,
moe_gather_qmm in mx.gather_qmm's form, the emulator under transformations (the transforms
themselves: test_transforms.py)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated
from support import backend_params, require_backend

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases import gated_rms_norm as gated_cases
from mlx_metaltile.cases import moe_gather_qmm as moe_cases

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
E, N, K = 6, 64, 128


@pytest.fixture(scope="module")
def inputs():
    """One small evaluated input set per op (no lazy random graph leaks into a trace)."""
    rng = np.random.default_rng(14)

    def arr(shape, dtype=mx.float32, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    wq, s, b = mx.quantize(arr((E, N, K)), group_size=64, bits=4)
    wf, sf = mx.quantize(arr((N, K)), mode="mxfp4")[:2]
    out = dict(
        y=arr((3, 100)), z=arr((3, 100)), w=arr((100,)),
        wq=wq, s=s, b=b, wf=wf, sf=sf,
        xq=arr((3, K)), ids=mx.array([[1, 5], [0, 3], [3, 3]], dtype=mx.uint32),
        xg=arr((3, 1, 2, K)), x2=arr((4, K)), ids2=mx.array([0, 2, 2, 5], dtype=mx.uint32),
        q=arr((1, 4, 2, 64)), k=arr((1, 2, 40, 64)), v=arr((1, 2, 40, 64)),
        xf=arr((5, K)), lg=arr((3, 40)),
    )
    mx.eval(*out.values())
    return out


def _calls(t):
    """op name -> f(**options) calling the op on ``t`` (options: stream and the like)."""
    return {
        "gated_rms_norm": lambda **o: mt.gated_rms_norm(t["y"], t["z"], t["w"], **o),
        "expert_qmv": lambda **o: mt.expert_qmv(t["xq"], t["wq"], t["s"], t["b"], t["ids"],
                                                **o),
        "moe_gather_qmm": lambda **o: mt.moe_gather_qmm(t["xg"], t["wq"], t["s"], t["b"],
                                                        t["ids"], **o),
        "sdpa_multi": lambda **o: mt.sdpa_multi(t["q"], t["k"], t["v"], scale=0.125, **o),
        "fp4_qmm": lambda **o: mt.fp4_qmm(t["xf"], t["wf"], t["sf"], mode="mxfp4", **o),
        "moe_route": lambda **o: _ids_and_scores(mt.moe_route(t["lg"], 4, **o)),
    }


def _ids_and_scores(out):
    """moe_route's (ids, scores) as one array, compared as the other ops' outputs."""
    return mx.stack([a.astype(mx.float32) for a in out])


OPS = tuple(_calls({}))


# ---- stream= --------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_stream_runs_there_with_the_same_result(any_backend, inputs, op):
    call = _calls(inputs)[op]
    want = call()
    mx.eval(want)
    default = mx.default_stream(mx.default_device())
    device = mx.gpu if any_backend in backends.GPU_BACKENDS else mx.cpu  # where it can run
    for stream in (mx.new_stream(device), device, mx.Device(device), None):
        before = backends.launch_count(backend=any_backend)
        got = call(stream=stream)
        mx.eval(got)
        if any_backend != "reference":  # the kernel ran on that stream
            assert backends.launch_count(backend=any_backend) > before
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want, equal_nan=True).item(), (op, stream)
        assert mx.default_stream(mx.default_device()) == default  # the context was left


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params("metal", "cuda"))
def test_cpu_stream_on_a_gpu_backend(inputs, op, backend):
    require_backend(backend)
    with backends.use_backend(backend), pytest.raises(
            ValueError, match=rf"^\[{op}\] the {backend} backend runs kernels on the GPU"):
        mx.eval(_calls(inputs)[op](stream=mx.cpu))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stream", ["cpu", 0, mx.float32])
def test_stream_of_the_wrong_type(inputs, op, stream):
    with pytest.raises(TypeError, match=rf"^\[{op}\] stream must be None, an mx.Stream or an "
                                         rf"mx.Device \(mx.cpu, mx.gpu\), got "):
        _calls(inputs)[op](stream=stream)


@pytest.mark.skipif(mx.metal.is_available() or mx.cuda.is_available(),
                    reason="a GPU exists here")
@pytest.mark.parametrize("op", OPS)
def test_gpu_stream_without_gpu_is_mlx_error(any_backend, inputs, op):
    with pytest.raises(ValueError, match="Cannot get gpu stream without gpu backend"):
        mx.eval(_calls(inputs)[op](stream=mx.gpu))


# ---- NumPy scalars ----------------------------------------------------------------------

def _same(a, b) -> bool:
    return mx.array_equal(a, b, equal_nan=True).item()


def test_numpy_scalars_as_python_numbers(any_backend, inputs):
    t = inputs
    want = mt.gated_rms_norm(t["y"], t["z"], t["w"], eps=1e-5)
    for eps in (np.float32(1e-5), np.float64(1e-5)):
        # np.float32(1e-5) is not 1e-5, but the kernel takes eps as a float32: the same
        assert _same(mt.gated_rms_norm(t["y"], t["z"], t["w"], eps=eps), want)
    assert _same(mt.gated_rms_norm(t["y"], t["z"], t["w"], eps=np.int64(0)),
                 mt.gated_rms_norm(t["y"], t["z"], t["w"], eps=0))
    want = mt.sdpa_multi(t["q"], t["k"], t["v"], scale=0.125, causal=True, kv_len=33)
    for scale, causal, kv_len in ((np.float32(0.125), np.True_, np.int64(33)),
                                  (np.float64(0.125), np.bool_(True), np.int32(33))):
        assert _same(mt.sdpa_multi(t["q"], t["k"], t["v"], scale=scale, causal=causal,
                                   kv_len=kv_len), want)
    q = dict(group_size=np.int64(64), bits=np.int64(4))
    assert _same(mt.expert_qmv(t["xq"], t["wq"], t["s"], t["b"], t["ids"], **q),
                 mt.expert_qmv(t["xq"], t["wq"], t["s"], t["b"], t["ids"]))
    assert _same(mt.moe_gather_qmm(t["xg"], t["wq"], t["s"], t["b"], t["ids"], **q,
                                   sorted_indices=np.False_),
                 mt.moe_gather_qmm(t["xg"], t["wq"], t["s"], t["b"], t["ids"]))
    assert _same(mt.fp4_qmm(t["xf"], t["wf"], t["sf"], group_size=np.int32(32)),
                 mt.fp4_qmm(t["xf"], t["wf"], t["sf"], mode="mxfp4"))


@pytest.mark.parametrize("op, kwargs, exc, match", [
    ("gated_rms_norm", {"eps": np.True_}, TypeError, "eps must be a Python or NumPy real"),
    ("gated_rms_norm", {"eps": np.float64(np.inf)}, ValueError, "eps must be finite"),
    ("gated_rms_norm", {"eps": 10**400}, ValueError, "eps must be finite"),
    ("sdpa_multi", {"causal": np.int64(1)}, TypeError, "causal must be a bool"),
    ("sdpa_multi", {"causal": 1}, TypeError, "causal must be a bool"),
    ("expert_qmv", {"bits": np.float64(4)}, TypeError, "bits must be an int"),
    ("expert_qmv", {"group_size": np.True_}, TypeError, "group_size must be an int"),
    ("moe_gather_qmm", {"bits": np.int64(3)}, ValueError, r"bits must be one of \(4, 8\)"),
    ("moe_gather_qmm", {"sorted_indices": 1}, TypeError, "sorted_indices must be a bool"),
    ("fp4_qmm", {"group_size": np.float32(32)}, TypeError, "group_size must be an int"),
])
def test_numpy_scalar_refusals(inputs, op, kwargs, exc, match):
    if op == "fp4_qmm":  # group_size with mode=None
        call = lambda **o: mt.fp4_qmm(inputs["xf"], inputs["wf"], inputs["sf"], **o)  # noqa: E731
    else:
        call = _calls(inputs)[op]
    with pytest.raises(exc, match=rf"^\[{op}\] {match}"):
        call(**kwargs)


# ---- gated_rms_norm: weight in any float dtype, output in y's ------------------------------

def _mlx_lm_dtype(y, z, w) -> mx.Dtype:
    norm = Qwen3NextRMSNormGated(w.shape[0], eps=1e-5)
    norm.weight = w
    return norm(y, z).dtype


@pytest.mark.parametrize("y_dtype, z_dtype, w_dtype", list(itertools.product(DTYPES, repeat=3)),
                         ids=lambda d: str(d).rsplit(".", 1)[-1])
def test_gated_dtype_mix_reference(rng, y_dtype, z_dtype, w_dtype):
    y, z, w = gated_cases.make_inputs(rng, (3,), 100, mx.float32, mx.float32)
    y, z, w = y.astype(y_dtype), z.astype(z_dtype), w.astype(w_dtype)
    assert _mlx_lm_dtype(y, z, w) == y_dtype  # the rule we match
    with backends.use_backend("reference"):
        gated_cases.run_and_check(y, z, w, 1e-5, "reference")


# Every pair of (y, z, w) dtypes in 9 kernels (an orthogonal array), each variant's n.
PAIRWISE = [(DTYPES[a], DTYPES[b], DTYPES[(a + b) % 3]) for a in range(3) for b in range(3)]


@pytest.mark.parametrize("n", (100, 1000))
@pytest.mark.parametrize("y_dtype, z_dtype, w_dtype", PAIRWISE,
                         ids=lambda d: str(d).rsplit(".", 1)[-1])
def test_gated_dtype_mix_kernels(kernel_backend, rng, n, y_dtype, z_dtype, w_dtype):
    y, z, w = gated_cases.make_inputs(rng, (3,), n, mx.float32, mx.float32)
    gated_cases.run_and_check(y.astype(y_dtype), z.astype(z_dtype), w.astype(w_dtype), 1e-5,
                              kernel_backend)


def test_gated_rms_norm_stand_in_has_no_casts(rng):
    """mlx_metaltile.nn.GatedRMSNorm passes its inputs as mlx-lm's module holds them."""
    from mlx_metaltile.nn import GatedRMSNorm

    y, z, w = gated_cases.make_inputs(rng, (2,), 64, mx.float32, mx.float32)
    ours = GatedRMSNorm(64, eps=1e-5)
    ours.weight = w.astype(mx.float16)
    out = ours(y.astype(mx.bfloat16), z)
    assert out.dtype == mx.bfloat16
    assert _same(out, mt.gated_rms_norm(y.astype(mx.bfloat16), z, ours.weight, 1e-5))


# ---- moe_gather_qmm in mx.gather_qmm's form ------------------------------------------------

def _gather_oracle(x, w, scales, biases, ids, dtype):
    """mx.gather_qmm(x, ..., rhs_indices=ids, transpose=True) from the row oracle: every
    batch's M rows times its expert."""
    lead = np.broadcast_shapes(x.shape[:-2], ids.shape)
    m = x.shape[-2]
    xb = np.broadcast_to(to_f64(x), (*lead, m, K)).reshape(-1, K)
    ib = np.repeat(np.broadcast_to(np.array(ids), lead).reshape(-1), m)
    want, mag = moe_cases.oracle(mx.array(xb.astype(np.float32)).astype(dtype), w, scales,
                                 biases, mx.array(ib), 64, 4, dtype)
    return want.reshape(*lead, m, N), mag.reshape(*lead, m, N)


@pytest.mark.parametrize("x_shape, ids_shape", [
    ((5, 1, 1, K), (5, 2)),  # mlx-lm's SwitchGLU: x[..., None, None, :], indices [..., k]
    ((2, 3, 1, 1, K), (2, 3, 4)),  # [B, L] tokens, k = 4
    ((3, 2, K), (3,)),  # M = 2 rows per batch
    ((1, 4, K), (2, 3)),  # x broadcast over the ids
])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).rsplit(".", 1)[-1])
def test_gather_qmm_form(any_backend, rng, x_shape, ids_shape, dtype):
    x = mx.array(rng.standard_normal(x_shape).astype(np.float32)).astype(dtype)
    w, s, b = moe_cases.make_weights(rng, E, N, K, 64, 4, dtype)
    ids = rng.integers(0, E, size=ids_shape)
    ids.flat[0], ids.flat[-1] = E - 1, E + 3  # the last expert, an out-of-range id
    ids = mx.array(ids.astype(np.uint32))
    before = backends.launch_count(backend=any_backend)
    out = mt.moe_gather_qmm(x, w, s, b, ids)
    mx.eval(out)
    if any_backend != "reference":
        assert backends.launch_count(backend=any_backend) == before + 1
    want_shape = mx.gather_qmm(x, w, s, b, rhs_indices=ids % E, transpose=True).shape
    assert out.shape == want_shape and out.dtype == dtype
    want, mag = _gather_oracle(x, w, s, b, ids, dtype)
    got = to_f64(out)
    bad = np.isnan(want)
    assert bad.any() and np.isnan(got[bad]).all()
    assert_close(got[~bad], want[~bad], dtype, magnitude=mag[~bad],
                 what=f"moe_gather_qmm[{any_backend}] gather form")
    # the caller's promise of sorted ids runs the rows as given: the same result
    order = np.argsort(np.array(ids).reshape(-1), kind="stable")
    if len(ids_shape) == 1 and x_shape[0] == ids_shape[0]:
        xs, idss = x[mx.array(order)], ids[mx.array(order)]
        fast = mt.moe_gather_qmm(xs, w, s, b, idss, sorted_indices=True)
        assert _same(fast, out[mx.array(order)])


def test_gather_qmm_form_matches_mlx(rng):
    """Same values as MLX's own mx.gather_qmm within its rounding (float32)."""
    x = mx.array(rng.standard_normal((4, 1, 1, K)).astype(np.float32))
    w, s, b = moe_cases.make_weights(rng, E, N, K, 64, 4, mx.float32)
    ids = mx.array(rng.integers(0, E, size=(4, 2)).astype(np.uint32))
    got = mt.moe_gather_qmm(x, w, s, b, ids)
    want = mx.gather_qmm(x, w, s, b, rhs_indices=ids, transpose=True)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()


@pytest.mark.parametrize("x_shape, ids_shape, match", [
    ((K,), (1,), r"x must have at least 2 dimensions \(\[M, K\] rows or \[\.\.\., M, K\]"),
    ((3, 1, K), (2,), r"x's batch dimensions \(3,\) \(x \[\.\.\., M, K\]\) and indices "
                      r"\(2,\) must broadcast"),
    ((4, K), (4, 1), "indices must have 1 dimensions, got 2"),
])
def test_gather_qmm_form_bad_shapes(rng, x_shape, ids_shape, match):
    x = mx.zeros(x_shape)
    w, s, b = moe_cases.make_weights(rng, E, N, K, 64, 4, mx.float32)
    with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] " + match):
        mt.moe_gather_qmm(x, w, s, b, mx.zeros(ids_shape, dtype=mx.uint32))


# ---- mx.compile(shapeless=True), mx.vmap ------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("transform", ["compile", "shapeless", "vmap"])
def test_emulator_is_eager(inputs, op, transform):
    """Under a transformation the emulator says what it is and what to do instead."""
    from support import require_backend

    require_backend("emulator")
    t = inputs
    first = {"gated_rms_norm": "y", "expert_qmv": "xq", "moe_gather_qmm": "xg",
             "sdpa_multi": "q", "fp4_qmm": "xf", "moe_route": "lg"}[op]

    def fn(a):  # the op of its first input (traced)
        return _calls({**t, first: a})[op]()

    a = t[first] if transform != "vmap" else mx.stack([t[first], t[first]])
    fn = {"compile": mx.compile, "shapeless": lambda f: mx.compile(f, shapeless=True),
          "vmap": mx.vmap}[transform](fn)
    with backends.use_backend("emulator"), pytest.raises(
            ValueError, match=rf"^\[{op}\] the emulator backend runs kernels eagerly .* cannot be "
                              r"traced by mx.compile or mx.vmap; .*use_backend\('reference'\)"):
        mx.eval(fn(a))
