"""mlx_metaltile.nn modules against mlx-lm's, module by module."""

from __future__ import annotations

import importlib
import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile import nn as mtnn
from mlx_metaltile._registry import TOLERANCES
from mlx_metaltile.moe_bench import dispatches

pytest.importorskip("mlx_lm")
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
N = 192  # not a power of two; the register variant of the kernel


def _oracle(h, gate, weight, eps):
    """float64 NumPy: weight * h * rsqrt(mean(h^2) + eps) * silu(gate)."""
    h, g, w = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (h, gate, weight))
    inv = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    return w * h * inv * g / (1.0 + np.exp(-g))


@pytest.mark.parametrize("h_dtype,gate_dtype,w_dtype", list(itertools.product(DTYPES, repeat=3)))
def test_gated_rms_norm_dtypes_as_mlx_lm(h_dtype, gate_dtype, w_dtype):
    mx.random.seed(1)
    h = mx.random.normal((3, 5, N)).astype(getattr(mx, h_dtype))
    gate = mx.random.normal((3, 5, N)).astype(getattr(mx, gate_dtype))
    original = Qwen3NextRMSNormGated(N, eps=1e-6)
    original.weight = (1 + 0.1 * mx.random.normal((N,))).astype(getattr(mx, w_dtype))
    ours = mtnn.GatedRMSNorm.from_module(original)
    assert ours.weight is original.weight and ours.eps == original.eps
    want = original(h, gate)
    # every op backend when the inputs share a dtype; the casts are backend-independent
    backend = "emulator" if h_dtype == gate_dtype == w_dtype else "reference"
    with mt.use_backend(backend):
        before = backends.launch_count(backend="emulator")
        got = ours(h, gate)
        assert backend == "reference" or backends.launch_count(backend="emulator") > before
    assert got.dtype == want.dtype == h.dtype
    # within one rounding to the output dtype of the float64 result (plus float32 error)
    tol = TOLERANCES[h_dtype]
    exact = _oracle(h, gate, ours.weight, 1e-6)
    err = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - exact)
    assert np.all(err <= tol.rtol * np.abs(exact) + tol.atol + tol.accum * np.abs(exact))
    assert ours(h).dtype == original(h).dtype  # no gate: mx.fast.rms_norm, as mlx-lm


def test_switch_glu_unserved_reasons():
    from mlx_lm.models.switch_layers import SwitchGLU

    glu = SwitchGLU(64, 64, 4)
    assert "SwitchLinear" in mtnn.switch_glu_unserved(glu)
    import mlx.nn as nn

    nn.quantize(glu, group_size=64, bits=4)
    assert mtnn.switch_glu_unserved(glu) is None
    glu = SwitchGLU(64, 64, 4)
    nn.quantize(glu, mode="mxfp4")
    assert mtnn.switch_glu_unserved(glu) is None
    glu = SwitchGLU(64, 64, 4)
    nn.quantize(glu, group_size=64, bits=6)
    assert "bits=6" in mtnn.switch_glu_unserved(glu)


def test_switch_glu_rechecks_replaced_experts():
    """The stand-in remembers its experts' check only while it holds the same projection
    and activation objects: a projection replaced after a call is checked again."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

    glu = SwitchGLU(64, 64, 4)
    nn.quantize(glu, group_size=64, bits=4)
    ours = mtnn.SwitchGLU.from_module(glu)
    assert ours.unserved() is None and ours.unserved() is None
    ours.up_proj = SwitchLinear(64, 64, 4)
    assert "SwitchLinear" in ours.unserved()
    ours.up_proj = glu.up_proj
    assert ours.unserved() is None
    ours.activation = None
    assert ours.unserved() == "no activation"


def test_moe_route_serves_floating_dtypes_as_issubdtype():
    """moe_route_serves' dtype set is mx.issubdtype(dtype, mx.floating)'s."""
    dtypes = [d for d in vars(mx).values() if isinstance(d, mx.Dtype)]
    assert len(dtypes) > 10
    for d in dtypes:
        assert (d in mtnn._FLOATING) == mx.issubdtype(d, mx.floating), d


def test_switch_glu_decode_follows_swapped_parts(monkeypatch):
    """What the decode call remembers per held projections and activation follows what
    mlx-lm's users swap after a call: new weights (load_weights) change the result, an
    activation expert_glu does not compute or a projection adapter (LoRA) changes what is
    served, biases added to gate and up are read, and the compiled pair is one per backend
    and stream, reused across calls."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU, SwitchLinear

    class ReluGLU(nn.Module):
        def __call__(self, x, gate):
            return nn.relu(gate) * x

    mx.random.seed(5)
    glu = SwitchGLU(64, 96, 6)
    nn.quantize(glu, group_size=32, bits=4)
    ours = mtnn.SwitchGLU.from_module(glu)
    x = mx.random.normal((1, 1, 64))
    logits = mx.random.normal((1, 1, 6))
    monkeypatch.setattr(mtnn, "COMPILED_BACKENDS", ("reference",))
    mtnn._decode_pair.cache_clear()
    try:
        with mt.use_backend("reference"):
            first = ours.route_combine(x, logits, 2, True)
            for _ in range(2):
                assert mx.array_equal(ours.route_combine(x, logits, 2, True), first).item()
            assert mtnn._decode_pair.cache_info().currsize == 1  # traced once, reused
            with mx.stream(mx.new_stream(mx.cpu)):
                ours.route_combine(x, logits, 2, True)
                ours.route_combine(x, logits, 2, True)
            assert mtnn._decode_pair.cache_info().currsize == 2  # one per stream
            ours.route_combine(x, logits, 2, True)
            assert mtnn._decode_pair.cache_info().currsize == 2

            down = ours.down_proj
            weights = {k: down[k] for k in ("scales", "biases")}
            down.update({k: 2 * v for k, v in weights.items()})  # as load_weights
            swapped = ours.route_combine(x, logits, 2, True)
            down.update(weights)
            assert not mx.allclose(swapped, first, rtol=1e-3).item()

            ours.activation = ReluGLU()  # expert_glu does not compute it: not this path
            assert ours.route_combine(x, logits, 2, True) is None
            ours.activation = SwiGLU()
            assert mx.array_equal(ours.route_combine(x, logits, 2, True), first).item()

            up = ours.up_proj
            ours.up_proj = SwitchLinear(64, 96, 6)  # an unquantized adapter
            assert ours.route_combine(x, logits, 2, True) is None
            assert "SwitchLinear" in ours.unserved(x)
            ours.up_proj = up
            assert mx.array_equal(ours.route_combine(x, logits, 2, True), first).item()

            ours.gate_proj.bias = mx.ones((6, 96))  # gate alone: expert_glu refuses
            assert ours.route_combine(x, logits, 2, True) is None
            ours.up_proj.bias = mx.ones((6, 96)).astype(mx.float16)  # not x's dtype
            assert ours.route_combine(x, logits, 2, True) is None
            ours.up_proj.bias = mx.ones((6, 96))
            biased = ours.route_combine(x, logits, 2, True)
            assert not mx.allclose(biased, first, rtol=1e-3).item()
            assert mtnn._decode_pair.cache_info().currsize == 3  # biases: another pair
    finally:
        mtnn._decode_pair.cache_clear()


@pytest.mark.parametrize("backend", ("reference", "emulator"))
@pytest.mark.parametrize("tokens", (3, 40))  # decode (expert_qmv) and sorted (moe_gather_qmm)
def test_switch_glu_built_like_mlx_lm(backend, tokens):
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(2)
    ours = mtnn.SwitchGLU(64, 96, 4, bias=True)  # mlx-lm's constructor and parameter tree
    theirs = SwitchGLU(64, 96, 4, bias=True)
    assert ({k: v.shape for k, v in tree_flatten(ours.parameters())}
            == {k: v.shape for k, v in tree_flatten(theirs.parameters())})
    ours.update(tree_map(lambda a: a + 0.01 * mx.random.normal(a.shape), ours.parameters()))
    theirs.update(ours.parameters())
    for m in (ours, theirs):
        nn.quantize(m, group_size=32, bits=8)
    theirs.update(ours.parameters())
    x = mx.random.normal((1, tokens, 64))
    ids = mx.random.randint(0, 4, (1, tokens, 2)).astype(mx.uint32)
    want = theirs(x, ids)
    with mt.use_backend(backend):
        before = backends.launch_count(backend="emulator")
        got = ours(x, ids)
        assert backend == "reference" or backends.launch_count(backend="emulator") > before
    tol = TOLERANCES["float32"]
    # A generous stand-in for the magnitude of the float32 sums (K = 96 terms of about
    # max|want| each); a wrong expert, row order or bias gives errors of order |want|.
    err = mx.abs(got - want)
    bound = tol.atol + tol.rtol * mx.abs(want) + tol.accum * 96 * mx.abs(want).max()
    assert got.shape == want.shape and bool(mx.all(err <= bound).item()), err.max().item()


@pytest.mark.parametrize("bias", (False, True))
def test_combine_compiled_as_plain(bias, monkeypatch):
    """SwitchGLU.combine's decode pair as an mx.compile'd function (what the GPU backends
    run; traced here on the reference backend) gives the plain call's result and gradients,
    traces once per shape, and still refuses a gradient of the quantized weights."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    glu = SwitchGLU(64, 96, 4, bias=bias)
    nn.quantize(glu, group_size=32, bits=4)
    ours = mtnn.SwitchGLU.from_module(glu)
    x = mx.random.normal((1, 3, 64))
    ids = mx.random.randint(0, 4, (1, 3, 2)).astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((1, 3, 2)), axis=-1)

    def loss(x, scores):
        return (ours.combine(x, ids, scores) ** 2).sum()

    down = ours.down_proj
    weights = {k: down[k] for k in ("scales", "biases")}

    def with_other_weights():  # the weights are inputs of the compiled graph, not constants
        down.update({k: 2 * v for k, v in weights.items()})
        try:
            return ours.combine(x, ids, scores)
        finally:
            down.update(weights)

    with mt.use_backend("reference"):
        want = ours.combine(x, ids, scores)
        want_other = with_other_weights()
        want_grads = mx.grad(loss, argnums=(0, 1))(x, scores)
        monkeypatch.setattr(mtnn, "COMPILED_BACKENDS", ("reference",))
        mtnn._decode_pair.cache_clear()
        traced = []
        plain_glu = mtnn.expert_glu
        monkeypatch.setattr(mtnn, "expert_glu", lambda *a, **k: traced.append(1) or
                            plain_glu(*a, **k))
        for _ in range(3):
            got = ours.combine(x, ids, scores)
        got_other = with_other_weights()
        assert len(traced) == 1  # traced once, then replayed
        got_grads = mx.grad(loss, argnums=(0, 1))(x, scores)
        scales = ours.gate_proj["scales"]

        def through_scales(w):
            ours.gate_proj["scales"] = w
            return ours.combine(x, ids, scores).sum()

        try:
            with pytest.raises(ValueError, match=r"^\[expert_glu\] no gradient"):
                mx.grad(through_scales)(scales)
        finally:
            ours.gate_proj["scales"] = scales
    mtnn._decode_pair.cache_clear()
    assert mx.allclose(got, want, rtol=1e-6, atol=1e-6).item()
    assert mx.allclose(got_other, want_other, rtol=1e-6, atol=1e-6).item()
    assert not mx.allclose(want_other, want, rtol=1e-3).item()
    for g, w in zip(got_grads, want_grads, strict=True):
        assert mx.allclose(g, w, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("normalize", (True, False))
def test_route_combine_compiled_as_plain(normalize, monkeypatch):
    """SwitchGLU.route_combine (moe_route, expert_glu, expert_down_combine in one call) is
    combine() of moe_route's ids and scores, gives the same result and gradients (x and the
    router logits) compiled as a GPU backend runs it (traced here on the reference backend)
    as plain, and on the emulator launches the three kernels once each."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(4)
    glu = SwitchGLU(64, 96, 6)
    nn.quantize(glu, group_size=32, bits=4)
    ours = mtnn.SwitchGLU.from_module(glu)
    x = mx.random.normal((1, 3, 64))
    logits = mx.random.normal((1, 3, 6))

    def loss(x, logits):
        return (ours.route_combine(x, logits, 2, normalize) ** 2).sum()

    with mt.use_backend("reference"):
        ids, scores = mt.moe_route(logits, 2, normalize=normalize)
        want = ours.combine(x, mx.stop_gradient(ids), scores)
        plain = ours.route_combine(x, logits, 2, normalize)
        want_grads = mx.grad(loss, argnums=(0, 1))(x, logits)
        monkeypatch.setattr(mtnn, "COMPILED_BACKENDS", ("reference",))
        mtnn._decode_pair.cache_clear()
        got = ours.route_combine(x, logits, 2, normalize)
        got_grads = mx.grad(loss, argnums=(0, 1))(x, logits)
    mtnn._decode_pair.cache_clear()
    assert mx.array_equal(plain, want).item()
    assert mx.allclose(got, want, rtol=1e-6, atol=1e-6).item()
    assert all(float(mx.abs(g).max()) > 0 for g in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert mx.allclose(g, w, rtol=1e-5, atol=1e-6).item()
    with mt.use_backend("emulator"):
        names = ("moe_route_simd_rows", "expert_glu_simd_rows",
                 "expert_down_combine_simd_rows")
        before = [backends.launch_count(n, "emulator") for n in names]
        emulated = ours.route_combine(x, logits, 2, normalize)
        mx.eval(emulated)
        assert [backends.launch_count(n, "emulator") - b
                for n, b in zip(names, before, strict=True)] == [1, 1, 1]
    _close(emulated, want, 2 * 96)
    assert ours.route_combine(x, logits.astype(mx.float16), 2, normalize) is None
    assert ours.route_combine(x, logits, 7, normalize) is None  # k > E


def test_sdpa_serves_array_masks_and_sinks():
    """Array masks over the keys and per-head sinks are served, and give what mlx-lm's own
    sdpa gives; masks of another width and sinks of another shape or dtype are not."""
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(0)

    def arr(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    cache = KVCache()
    cache.update_and_fetch(arr((1, 2, 20, 64)), arr((1, 2, 20, 64)))
    q = arr((1, 8, 4, 64))
    keys, values = cache.update_and_fetch(arr((1, 2, 4, 64)), arr((1, 2, 4, 64)))
    mask = mx.array(rng.random((4, 24)) < 0.7)
    sinks = arr((8,))
    fetched = (keys, values)
    assert mtnn.sdpa_unserved(q, keys, values, cache, mask, sinks, fetched) is None
    assert mtnn.sdpa_unserved(q, keys, values, cache, mask[:, :4], None,
                              fetched) == "array mask"
    assert mtnn.sdpa_unserved(q, keys, values, cache, mx.zeros((4, 24), mx.complex64),
                              None, fetched) == "array mask"
    assert mtnn.sdpa_unserved(q, keys, values, cache, None, sinks[:4], fetched) == "sinks"
    assert mtnn.sdpa_unserved(q, keys, values, cache, "window", None, fetched) == "mask"
    with backends.use_backend("reference"):
        got = mtnn.cached_attention(q, keys, values, cache, 0.125, mask, sinks)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask,
                                                sinks=sinks)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_sdpa_serves_only_the_cache_own_keys_and_values():
    """With a cache, only the very arrays its update_and_fetch returned are served (they are
    the buffer's first offset rows, which sdpa_multi reads instead): keys or values derived
    from them, or of the same shape but other arrays, or nothing fetched, go to mlx-lm."""
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(2)

    def arr(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    cache = KVCache()
    q = arr((1, 4, 3, 64))
    keys, values = cache.update_and_fetch(arr((1, 2, 3, 64)), arr((1, 2, 3, 64)))
    fetched = (keys, values)
    assert mtnn.sdpa_unserved(q, keys, values, cache, None, None, fetched) is None
    own = "keys or values are not the cache's own"
    assert mtnn.sdpa_unserved(q, keys * 2, values, cache, None, None, fetched) == own
    assert mtnn.sdpa_unserved(q, keys, keys, cache, None, None, fetched) == own
    assert mtnn.sdpa_unserved(q, keys, values, cache, None, None) == own
    assert mtnn.sdpa_unserved(q, keys, values, cache, None, None, None) == own
    copy = cache.keys[..., :3, :]  # the same rows, another array: not provably the buffer's
    assert mtnn.sdpa_unserved(q, copy, values, cache, None, None, fetched) == own


def test_cached_attention_decode_reuses_one_plan():
    """A decode loop through an mlx-lm KVCache builds one sdpa_multi plan for the cache's
    buffer, not one per token (kv_len goes as the 0-d array the kernels read), runs the
    kernels, and gives MLX's own sdpa over the cache's first offset rows at every step; an
    array mask (whose width is kv_len) still takes kv_len as an int."""
    from mlx_lm.models.cache import KVCache

    sdpa_module = importlib.import_module("mlx_metaltile.ops.sdpa_multi")
    rng = np.random.default_rng(1)

    def arr(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    cache = KVCache()
    cache.update_and_fetch(arr((1, 2, 30, 64)), arr((1, 2, 30, 64)))
    plans = sdpa_module._plan.memory
    with backends.use_backend("emulator"):
        before, ran = len(plans), backends.launch_count(backend="emulator")
        for _ in range(3):
            q = arr((1, 4, 1, 64))
            keys, values = cache.update_and_fetch(arr((1, 2, 1, 64)), arr((1, 2, 1, 64)))
            assert mtnn.sdpa_unserved(q, keys, values, cache, None, None,
                                      (keys, values)) is None
            got = mtnn.cached_attention(q, keys, values, cache, 0.125, None)
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)
            assert mx.allclose(got, want, atol=1e-5).item()
        assert len(plans) - before == 1
        # the split and combine kernels at each step
        assert backends.launch_count(backend="emulator") - ran == 6
        mask = mx.array(rng.random((1, cache.offset)) < 0.7)
        got = mtnn.cached_attention(q, keys, values, cache, 0.125, mask)
        assert len(plans) - before == 2  # a new one: int kv_len, array mask
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
        assert mx.allclose(got, want, atol=1e-5).item()


def _quantized_pair(activation, bias, mode):
    """(ours, mlx-lm's) SwitchGLU with the same quantized experts."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    theirs = SwitchGLU(64, 96, 5, activation=activation, bias=bias)
    theirs.update(tree_map(lambda a: 0.1 * mx.random.normal(a.shape), theirs.parameters()))
    nn.quantize(theirs, mode=mode, **({"group_size": 32, "bits": 4} if mode == "affine" else {}))
    return mtnn.SwitchGLU.from_module(theirs), theirs


def _close(got, want, terms):
    tol = TOLERANCES["float32"]
    err = mx.abs(got - want)
    bound = tol.atol + tol.rtol * mx.abs(want) + tol.accum * terms * mx.abs(want).max()
    assert got.shape == want.shape and bool(mx.all(err <= bound).item()), err.max().item()


@pytest.mark.parametrize("backend", ("reference", "emulator"))
@pytest.mark.parametrize("kind", ("silu", "swiglu_oai"))
def test_switch_glu_decode_and_combine_fused(backend, kind):
    """Decode: gate, up and the activation in one expert_glu launch (SwiGLU; gpt-oss's
    SwigluOAI with expert biases in mxfp4), the down projection by expert_qmv; combine()
    runs the block's score-weighted sum as expert_glu + expert_down_combine: two launches.
    Both against mlx-lm's modules."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    silu = kind == "silu"
    ours, theirs = _quantized_pair(SwiGLU() if silu else SwigluOAI(), bias=not silu,
                                   mode="affine" if silu else "mxfp4")
    assert mtnn.glu_activation(ours.activation) == kind
    x = mx.random.normal((2, 3, 64))
    ids = mx.random.randint(0, 5, (2, 3, 2)).astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((2, 3, 2)), axis=-1)
    want = theirs(x, ids)
    want_block = (want * scores[..., None]).sum(axis=-2)
    with mt.use_backend(backend):
        counts = {n: backends.launch_count(f"{n}_simd_rows", "emulator")
                  for n in ("expert_glu", "expert_qmv", "expert_down_combine")}
        got = ours(x, ids)
        got_block = ours.combine(x, ids, scores)
        mx.eval(got, got_block)
        ran = {n: backends.launch_count(f"{n}_simd_rows", "emulator") - c
               for n, c in counts.items()}
    if backend == "emulator":
        assert ran == {"expert_glu": 2, "expert_qmv": 1, "expert_down_combine": 1}
    _close(got, want, 96)
    _close(got_block, want_block, 2 * 96)


@pytest.mark.parametrize("backend", ("reference", "emulator"))
@pytest.mark.parametrize("kind", ("silu", "swiglu_oai"))
def test_switch_glu_decode_gradients(backend, kind):
    """A training step's gradients through the decode path (expert_glu + expert_qmv, and
    combine's expert_glu + expert_down_combine) w.r.t. x and the scores: nonzero and
    mlx-lm's modules' (MLX's autodiff of gather_qmm)."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    silu = kind == "silu"
    ours, theirs = _quantized_pair(SwiGLU() if silu else SwigluOAI(), bias=not silu,
                                   mode="affine" if silu else "mxfp4")
    x = mx.random.normal((2, 3, 64))
    ids = mx.random.randint(0, 5, (2, 3, 2)).astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((2, 3, 2)), axis=-1)
    r, r_block = mx.random.normal((2, 3, 2, 64)), mx.random.normal((2, 3, 64))

    def loss(module, x, scores):
        block = (module.combine(x, ids, scores) if module is ours
                 else (theirs(x, ids) * scores[..., None]).sum(axis=-2))
        return (module(x, ids) * r).sum() + (block * r_block).sum()

    want = mx.grad(lambda x, s: loss(theirs, x, s), argnums=(0, 1))(x, scores)
    with mt.use_backend(backend):
        counts = {n: backends.launch_count(f"{n}_simd_rows", "emulator")
                  for n in ("expert_glu", "expert_down_combine")}
        got = mx.grad(lambda x, s: loss(ours, x, s), argnums=(0, 1))(x, scores)
        mx.eval(got)
        ran = {n: backends.launch_count(f"{n}_simd_rows", "emulator") - c
               for n, c in counts.items()}
    if backend == "emulator":
        assert ran == {"expert_glu": 2, "expert_down_combine": 1}
    for g, w in zip(got, want, strict=True):
        assert bool(mx.any(g != 0).item())  # no silent zero
        _close(g, w, 4 * 96)


def test_switch_glu_combine_falls_back(monkeypatch):
    """An activation expert_glu does not compute, or prefill: the module's call, then the
    scores and the sum (no expert_down_combine launch)."""
    import mlx.nn as nn

    class ReluGLU(nn.Module):  # an activation expert_glu does not compute
        def __call__(self, x, gate):
            return nn.relu(gate) * x

    ours, theirs = _quantized_pair(ReluGLU(), bias=False, mode="affine")
    assert mtnn.glu_activation(ours.activation) is None
    x = mx.random.normal((1, 2, 64))
    ids = mx.array([[[0, 4], [2, 2]]], dtype=mx.uint32)
    scores = mx.softmax(mx.random.normal((1, 2, 2)), axis=-1)
    with mt.use_backend("emulator"):
        before = backends.launch_count("expert_down_combine_simd_rows", "emulator")
        got = ours.combine(x, ids, scores)
        mx.eval(got)
        assert backends.launch_count("expert_down_combine_simd_rows", "emulator") == before
    _close(got, (theirs(x, ids) * scores[..., None]).sum(axis=-2), 2 * 96)


@pytest.mark.parametrize("kind, native, patched", [("silu", 9, 4), ("swiglu_oai", 15, 6)])
def test_moe_block_dispatches_at_decode(kind, native, patched):
    """The README's counts: one decode token through mlx-lm's SwitchGLU and the block's
    score sum, through the patched SwitchGLU in the same block, and through combine() (two
    launches, nothing else), counted by moe_bench.dispatches from MLX's graph (the emulator
    runs our kernels eagerly: each launch is counted with its inputs' graph)."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    silu = kind == "silu"
    ours, theirs = _quantized_pair(SwiGLU() if silu else SwigluOAI(), bias=not silu,
                                   mode="affine" if silu else "mxfp4")
    x = mx.random.normal((1, 1, 64))
    ids = mx.array([[[0, 3, 4]]], dtype=mx.uint32)
    scores = mx.softmax(mx.random.normal((1, 1, 3)), axis=-1)
    mx.eval(x, ids, scores, theirs.parameters())

    def block(module):
        return (module(x, ids) * scores[..., None]).sum(axis=-2)

    assert dispatches(block, theirs).total() == native
    with mt.use_backend("emulator"):
        assert dispatches(block, ours).total() == patched
        assert dispatches(ours.combine, x, ids, scores) == {"kernel:expert_glu": 1,
                                                            "kernel:expert_down_combine": 1}
