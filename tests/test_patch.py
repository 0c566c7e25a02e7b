"""mt.patch on mlx-lm's own model classes: tiny random models, patched vs unpatched.

Float32 bound of the logits (argued, not fitted): each replaced module computes its output
within the op table's float32 accumulation error (``accum`` = 2e-6 relative to the
magnitude of the sums behind it), and so does the mlx-lm op it stands in for, with another
rounding order. The models are pre-norm residual stacks, so a relative change of one
module's output reaches the logits with a gain of about one; summed over the replaced
modules on the path (``n`` = replaced modules, each run once per forward; a served MoE
block and its SwitchGLU compute as one, ``SwitchGLU.combine``, and count once), the logits
of the two models differ by at most ``2 * accum * n * max|logits|``. (Expert routing is a top-k
of router logits; in float32 the tiny models' gaps between router logits are far above
this bound, so both models pick the same experts.)
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile import nn as mtnn
from mlx_metaltile._registry import TOLERANCES
from mlx_metaltile.ops._common import clear_plans

pytest.importorskip("mlx_lm")
from mlx_lm.generate import speculative_generate_step, stream_generate  # noqa: E402
from mlx_lm.models import cache as lmcache  # noqa: E402
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper  # noqa: E402
from mlx_lm_models import CONFIGS, VOCAB, tiny_model  # noqa: E402
from support import replaced_modules  # noqa: E402

ARCHS = tuple(CONFIGS)
MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_next", "qwen3_5_moe",
             "qwen2_moe")
# Attention on keys and values derived from what the cache holds (multi-head latent
# attention): with a cache every call runs mlx-lm's sdpa, counted as this fallback.
DERIVED_KV_ARCHS = ("deepseek_v3",)
# MoE blocks whose router module gives the ids and scores itself (MoERouting.router_ids),
# and their dispatches at one decode token (mlx-lm's block, the patched block): the README's
ROUTER_IDS_ARCHS = ("deepseek_v3", "granitemoe")
ROUTER_IDS_DISPATCHES = {"deepseek_v3": (31, 24), "granitemoe": (13, 6)}
NOT_OWN_KV = ("attention", "keys or values are not the cache's own")
BACKENDS = ("reference", "emulator")
PROMPT = list(range(3, 35))  # 32 tokens x k=2 experts = 64 pairs: the sorted prefill path
DECODE = (7, 11)
VERIFY = (13, 17, 19)  # one L=3 verification block after the decode steps
# Half-precision models: the patched model's distance to the float32 model may be at most
# this factor times the unpatched model's. Both round weights and activations the same way
# and accumulate in float32; they differ only in where intermediate results are rounded
# (rounding errors of similar size that may add up rather than cancel: 2). A wrong mask,
# stale cache rows or a wrong expert give distances of order one.
HALF_FACTOR = 2.0
# MoE routing is a top-k of router logits: a near tie flips under any change of rounding,
# moving that token's output by O(1) in either model. So the distance is taken per row
# (token position): the median row must be within HALF_FACTOR, and at most one row in
# HALF_OUTLIER_ROWS may exceed HALF_FACTOR times the unpatched model's worst row. A
# systematic error (mask, cache rows, expert ids, casts) moves most rows.
HALF_OUTLIER_ROWS = 16
_OPS = {"attention": "sdpa_multi",
        "switch_glu": ("expert_glu", "expert_qmv", "moe_gather_qmm"),
        "moe_block": ("expert_down_combine",),
        "gated_rms_norm": "gated_rms_norm", "fp4_linear": "fp4_qmm"}
COMBINE_KERNEL = "expert_down_combine_simd_rows"
_models: dict = {}


def model_for(arch: str, **kwargs):
    """A cached tiny model (tests leave it unpatched)."""
    key = (arch, tuple(sorted(kwargs.items())))
    if key not in _models:
        _models[key] = tiny_model(arch, **kwargs)
    return _models[key]


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the op calls mlx_metaltile.nn makes (kernel launches are counted separately)."""
    calls = {name: 0 for name in ("sdpa_multi", "expert_glu", "expert_qmv",
                                  "expert_down_combine", "moe_gather_qmm", "gated_rms_norm",
                                  "fp4_qmm")}
    for name in calls:
        op = getattr(mtnn, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(mtnn, name, counted)
    return calls


def forward(model, *, cache=None):
    """Logits of a prompt, two decode steps and an L=3 verification block through the cache."""
    cache = cache or lmcache.make_prompt_cache(model)
    outs = [model(mx.array([PROMPT]), cache=cache)]
    outs += [model(mx.array([[t]]), cache=cache) for t in DECODE]
    outs.append(model(mx.array([VERIFY]), cache=cache))
    mx.eval(outs)
    return outs


def expected_ops(report) -> set[str]:
    out = set()
    for e in report.replaced:
        ops = _OPS[e.kind]
        out.update((ops,) if isinstance(ops, str) else ops)
    if any(e.kind == "moe_block" for e in report.replaced):
        # every SwitchGLU of these models sits in a served block, whose combine takes the
        # down projection at decode (expert_down_combine), at prefill moe_gather_qmm
        out.discard("expert_qmv")
    return out


def logits_bound(report, want: mx.array) -> float:
    return 2 * TOLERANCES["float32"].accum * replaced_modules(report) * mx.abs(want).max().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_logits_and_unpatch(arch, backend, op_calls):
    _check_float32(model_for(arch), backend, op_calls, derived_kv=arch in DERIVED_KV_ARCHS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_mxfp4_experts(backend, op_calls):
    """gpt-oss as published: mxfp4 experts and its attention with sinks, both served."""
    model = model_for("gpt_oss", mode="mxfp4")
    report = mt.patch(model)
    mt.unpatch(model)
    assert not report.left and {e.kind for e in report.replaced} >= {"attention", "switch_glu"}
    _check_float32(model, backend, op_calls)
    assert op_calls["sdpa_multi"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ("mxfp4", "nvfp4"))
def test_fp4_linear_layers(mode, backend, op_calls):
    model = model_for("qwen3", linear_mode=mode)
    kinds = {e.kind for e in mt.patch(model).replaced}
    mt.unpatch(model)
    assert kinds == {"attention", "fp4_linear"}
    _check_float32(model, backend, op_calls)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ("nvfp4", "mxfp8"))
def test_fp_experts_generic_path(mode, backend, op_calls):
    """The other fp expert modes through the same SwitchGLU, on an architecture that does
    not ship them."""
    _check_float32(model_for("qwen3_moe", mode=mode), backend, op_calls)


def _check_float32(model, backend, op_calls, derived_kv: bool = False):
    """``derived_kv``: the model's attention derives its keys and values from the cache's
    contents, so every cached call must run mlx-lm's sdpa (DERIVED_KV_ARCHS)."""
    want = forward(model)
    report = mt.patch(model)
    try:
        assert report.replaced, str(report)
        refused = mtnn.fallbacks[NOT_OWN_KV]
        caches = lmcache.make_prompt_cache(model)
        with mt.use_backend(backend):
            before = backends.launch_count(backend=backend)
            combined = backends.launch_count(COMBINE_KERNEL, backend)
            got = forward(model, cache=caches)
            launched = backends.launch_count(backend=backend) - before
            combined = backends.launch_count(COMBINE_KERNEL, backend) - combined
        # the caches' update_and_fetch was watched only during the attention calls
        assert not any("update_and_fetch" in vars(c) for c in caches)
        ops = expected_ops(report)
        refused = mtnn.fallbacks[NOT_OWN_KV] - refused
        if derived_kv:  # every call of the prompt, 2 decode steps and the block, per layer
            ops.discard("sdpa_multi")
            assert refused == 4 * len(model.layers), refused
        else:
            assert refused == 0
        assert {name for name, n in op_calls.items() if n} == ops
        if backend == "emulator":
            assert launched >= sum(op_calls.values())
            # the MoE blocks at decode (2 steps) and verification (L=3): two dispatches
            blocks = sum(e.kind == "moe_block" for e in report.replaced)
            assert combined == 3 * blocks == op_calls["expert_down_combine"], combined
        for w, g in zip(want, got, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            err = mx.abs(g - w).max().item()
            assert err <= logits_bound(report, w), (err, logits_bound(report, w))
    finally:
        mt.unpatch(model)
    again = forward(model)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, again, strict=True))


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_distance(arch, dtype):
    exact = forward(model_for(arch))
    model = tiny_model(arch)
    model.set_dtype(getattr(mx, dtype))
    backend = "emulator" if arch == "qwen3_next" else "reference"  # every op, every dtype
    native = forward(model)
    report = mt.patch(model)
    assert report.replaced
    with mt.use_backend(backend):
        before = backends.launch_count(backend="emulator")
        patched = forward(model)
        if backend == "emulator":
            assert backends.launch_count(backend="emulator") > before
    mt.unpatch(model)
    _check_half_distance(patched, native, exact, (arch, dtype))


def _check_half_distance(patched, native, exact, label) -> None:
    """The patched half-precision model's logits (rows) against the float32 model's
    ``exact``: their median distance within HALF_FACTOR of the unpatched model's
    (``native``), and few rows past HALF_FACTOR times its largest."""
    def row_distances(outs):
        return mx.concatenate([mx.abs(o.astype(mx.float32) - e).max(-1).flatten()
                               for o, e in zip(outs, exact, strict=True)])

    patched, native = row_distances(patched), row_distances(native)
    got_med, want_med = mx.median(patched).item(), mx.median(native).item()
    assert got_med <= HALF_FACTOR * want_med, (*label, got_med, want_med)
    outliers = (patched > HALF_FACTOR * native.max()).sum().item()
    assert outliers * HALF_OUTLIER_ROWS <= patched.size, (*label, outliers)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("mode", ("mxfp4", "nvfp4"))
def test_fp4_linear_layers_half_on_cuda_plan(mode, dtype, monkeypatch):
    """fp4 linear layers of a half-precision model on the emulator with cuda's fp4_qmm plan
    (the skinny kernel from 2 to 32 rows: the L=3 verification block here): within the
    half-precision distance of the float32 model that mlx-lm's own layers keep."""
    fp4 = importlib.import_module("mlx_metaltile.ops.fp4_qmm")
    exact = forward(model_for("qwen3", linear_mode=mode))
    model = tiny_model("qwen3", linear_mode=mode)
    model.set_dtype(getattr(mx, dtype))
    native = forward(model)
    monkeypatch.setitem(fp4.SKINNY_M, "emulator", fp4.SKINNY_M["cuda"])
    clear_plans()  # plans read SKINNY_M once
    mt.patch(model)
    try:
        with mt.use_backend("emulator"):
            before = backends.launch_count("fp4_qmm_skinny", "emulator")
            patched = forward(model)
            assert backends.launch_count("fp4_qmm_skinny", "emulator") > before
    finally:
        mt.unpatch(model)
        monkeypatch.undo()
        clear_plans()
    _check_half_distance(patched, native, exact, (mode, dtype))


class _IdTokens:
    """The least a tokenizer needs for stream_generate: ids in, ids out."""

    eos_token_id = None

    def decode(self, ids):
        return " ".join(str(i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % VOCAB for c in text]


class _Tokenizer(TokenizerWrapper):
    def __init__(self):  # noqa: D107 - a wrapper without a Hugging Face tokenizer
        self._tokenizer = _IdTokens()
        self._detokenizer = NaiveStreamingDetokenizer(self._tokenizer)
        self._eos_token_ids = set()


def _greedy(model, **kwargs) -> list[int]:
    return [r.token for r in stream_generate(model, _Tokenizer(), PROMPT[:9], max_tokens=16,
                                             **kwargs)]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_identical(arch, op_calls):
    model = model_for(arch)
    want = _greedy(model)
    report = mt.patch(model)
    try:
        backend = "emulator" if arch in ("qwen3_moe", "qwen3_next") else "reference"
        with mt.use_backend(backend):
            combined = backends.launch_count(COMBINE_KERNEL, backend)
            got = _greedy(model)
            combined = backends.launch_count(COMBINE_KERNEL, backend) - combined
    finally:
        mt.unpatch(model)
    assert len(want) == 16 and got == want
    assert sum(op_calls.values()) > 0
    blocks = sum(e.kind == "moe_block" for e in report.replaced)
    assert (blocks > 0) == (arch in MOE_ARCHS + ROUTER_IDS_ARCHS)
    # the prompt (9 tokens x k=2 < 64 pairs) and each decode step: the blocks' combine
    assert op_calls["expert_down_combine"] >= 16 * blocks
    if backend == "emulator":
        assert combined == op_calls["expert_down_combine"]


@pytest.mark.parametrize("arch", ("qwen3_moe", "mixtral", "llama"))
def test_speculative_decoding_identical(arch, op_calls):
    model, draft = model_for(arch), model_for("qwen3", layers=1, seed=1)

    def tokens():
        steps = speculative_generate_step(mx.array(PROMPT[:9]), model, draft,
                                          num_draft_tokens=3, max_tokens=12)
        return [int(t) for t, _, _ in steps]

    want = tokens()
    mt.patch(model)
    mt.patch(draft)
    try:
        with mt.use_backend("emulator" if arch == "qwen3_moe" else "reference"):
            got = tokens()
    finally:
        mt.unpatch(model)
        mt.unpatch(draft)
    assert got == want
    assert op_calls["sdpa_multi"] > 0


def test_patch_twice_changes_nothing():
    model = model_for("qwen3_moe")
    first = mt.patch(model)
    try:
        classes = [type(m) for _, m in model.named_modules()]
        second = mt.patch(model)
        assert second.entries == first.entries
        assert [type(m) for _, m in model.named_modules()] == classes
    finally:
        mt.unpatch(model)
    assert not any(isinstance(m, mtnn.SwitchGLU) or hasattr(type(m), "_mlx_metaltile_base")
                   for _, m in model.named_modules())


def test_parameters_unchanged_and_weights_load_through_patch(tmp_path):
    model = tiny_model("qwen3_next")
    names = {k: (v.shape, v.dtype) for k, v in tree_flatten(model.parameters())}
    mt.patch(model)
    assert {k: (v.shape, v.dtype) for k, v in tree_flatten(model.parameters())} == names
    # save from the patched model, load other weights, load the saved ones back
    path = str(tmp_path / "w.safetensors")
    model.save_weights(path)
    other = tiny_model("qwen3_next", seed=5)
    model.load_weights(list(tree_flatten(other.parameters())))
    mt.unpatch(model)  # the originals come back with the weights loaded since
    want = forward(other)
    assert all(mx.array_equal(a, b).item() for a, b in zip(forward(model), want, strict=True))
    model.load_weights(path)
    assert all(mx.array_equal(a, b).item()
               for a, b in zip(forward(model), forward(model_for("qwen3_next")), strict=True))


def test_quantize_after_patch():
    module = importlib.import_module("mlx_lm.models.qwen3_moe")
    config = dict(CONFIGS["qwen3_moe"], model_type="qwen3_moe", vocab_size=VOCAB)
    model = module.Model(module.ModelArgs.from_dict(config))
    report = mt.patch(model)
    assert [e.kind for e in report.left] == ["moe_block", "switch_glu"] * 2
    assert "not QuantizedSwitchLinear" in report.left[0].detail  # the block says why too
    assert "not QuantizedSwitchLinear" in report.left[1].detail
    nn.quantize(model, group_size=64, bits=4)
    assert {e.kind for e in mt.patch(model).replaced} == {"attention", "moe_block",
                                                           "switch_glu"}
    mt.unpatch(model)


def test_unserved_experts_left_and_reported():
    model = tiny_model("qwen3_moe", bits=6)  # 6-bit affine: no kernel serves it
    want = forward(model)
    report = mt.patch(model)
    try:
        left = {e.kind: e.detail for e in report.left}
        assert "bits=6" in left["switch_glu"]
        assert {e.kind for e in report.replaced} == {"attention"}
        got = forward(model)
    finally:
        mt.unpatch(model)
    for a, b in zip(want, got, strict=True):  # only attention runs our op: its float32 bound
        assert mx.abs(a - b).max().item() <= logits_bound(report, a)


def test_moe_blocks_two_dispatches_and_unknown_blocks(op_calls):
    """Each known block's routing is mlx-lm's (the same experts, in the same slots); a
    block class the table does not name keeps its own code and is reported, its SwitchGLU
    still served."""
    from mlx_lm.models.switch_layers import SwitchGLU

    model = model_for("mixtral")
    report = mt.patch(model)
    try:
        blocks = [e for e in report.entries if e.kind == "moe_block"]
        assert [(e.path, e.module, e.replaced) for e in blocks] == [
            (f"model.layers.{i}.block_sparse_moe", "MixtralSparseMoeBlock", True)
            for i in range(2)]
        assert "expert_down_combine" in blocks[0].detail
    finally:
        mt.unpatch(model)

    class MyMoE(nn.Module):  # routing unknown to mlx_metaltile
        def __init__(self):
            super().__init__()
            self.switch_mlp = SwitchGLU(64, 64, 4)

        def __call__(self, x):
            return self.switch_mlp(x, mx.zeros((*x.shape[:-1], 2), mx.uint32)).sum(-2)

    holder = nn.Module()
    holder.moe = MyMoE()
    nn.quantize(holder, group_size=64, bits=4)
    x = mx.random.normal((1, 1, 64))
    want = holder.moe(x)
    report = mt.patch(holder)
    try:
        assert [(e.kind, e.replaced) for e in report.entries] == [("moe_block", False),
                                                                 ("switch_glu", True)]
        assert "MyMoE's routing is not known" in report.entries[0].detail
        assert type(holder.moe) is MyMoE
        got = holder.moe(x)
    finally:
        mt.unpatch(holder)
    assert op_calls["expert_qmv"] == 1 and op_calls["expert_down_combine"] == 0
    assert mx.abs(got - want).max().item() <= logits_bound(report, want)


# Dispatches of one MoE block call at one decode token, from MLX's graph: (mlx-lm's block,
# the patched block). The router's matmul (and Qwen3-Next's shared expert) are the same
# code on both sides; mlx-lm's top k and scores take 4 or 5 dispatches and its experts and
# score sum 9 (15 with gpt-oss's expert biases), ours 3 in all.
BLOCK_DISPATCHES = {"qwen3_moe": (15, 4), "qwen3_next": (23, 12), "qwen3_5_moe": (23, 12),
                    "gpt_oss": (20, 5), "mixtral": (14, 4), "olmoe": (14, 4),
                    "qwen2_moe": (22, 12)}
ROUTE_DISPATCHES = {"qwen3_moe": 5, "qwen3_next": 5, "qwen3_5_moe": 5, "gpt_oss": 3,
                    "mixtral": 4, "olmoe": 4, "qwen2_moe": 4}


def _block_dispatches(model, arch: str, router_ids: bool = False):
    """(native, ours, our kernels, native's replaced) dispatches of the model's first MoE
    block at one decode token, unpatched then patched, on the emulator (moe_bench's
    dispatches); everything of ours but the kernels must be mlx-lm's own (the router, a
    shared expert)."""
    from mlx_metaltile.moe_bench import dispatches

    block = next(m for _, m in model.named_modules() if mtnn.moe_routing(type(m)))
    assert mtnn.moe_routing(type(block)).router_ids == router_ids
    config = CONFIGS[arch].get("text_config", CONFIGS[arch])
    x = mx.random.normal((1, 1, config["hidden_size"]))
    mx.eval(x)
    with mt.use_backend("emulator"):
        native = dispatches(block, x)
        mt.patch(model)
        try:
            ours = dispatches(block, x)
        finally:
            mt.unpatch(model)
    kernels = Counter({k: v for k, v in ours.items() if k.startswith("kernel:")})
    shared = ours - kernels
    assert not shared - native, (shared, native)
    return native, ours, kernels, native - shared


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_block_dispatches_at_decode(arch):
    """The README's counts, from each block's graph (moe_bench.dispatches: on the emulator
    our kernels run eagerly and are counted at launch, with the graph of their inputs)."""
    model = model_for(arch, **({"mode": "mxfp4"} if arch == "gpt_oss" else {}))
    native, ours, kernels, replaced = _block_dispatches(model, arch)
    assert kernels == {"kernel:moe_route": 1, "kernel:expert_glu": 1,
                       "kernel:expert_down_combine": 1}, ours
    # replaced: mlx-lm's top k, scores, experts and score sum
    assert replaced["GatherQMM"] == 3 and replaced["ArgPartition"] == 1
    assert replaced.total() == (15 if arch == "gpt_oss" else 9) + ROUTE_DISPATCHES[arch]
    assert (native.total(), ours.total()) == BLOCK_DISPATCHES[arch], (native, ours)


@pytest.mark.parametrize("arch", ROUTER_IDS_ARCHS)
def test_router_ids_block_dispatches_at_decode(arch):
    """A block whose router gives the ids and scores (DeepSeek-V3's grouped sigmoid top k)
    keeps that code, mlx-lm's, and runs its experts and score sum as expert_glu +
    expert_down_combine: in place of mlx-lm's three gather_qmm, activation, product and sum."""
    model = model_for(arch)
    native, ours, kernels, replaced = _block_dispatches(model, arch, router_ids=True)
    assert kernels == {"kernel:expert_glu": 1, "kernel:expert_down_combine": 1}, ours
    assert replaced["GatherQMM"] == 3 and replaced.total() == 9, replaced
    assert (native.total(), ours.total()) == ROUTER_IDS_DISPATCHES[arch], (native, ours)


def test_unserved_cache_falls_back(op_calls):
    model = model_for("llama")

    def rotating():  # sliding-window caches: sdpa_multi has no window
        return [lmcache.RotatingKVCache(max_size=16) for _ in model.layers]

    want = forward(model, cache=rotating())
    mt.patch(model)
    before = mtnn.fallbacks.copy()
    try:
        got = forward(model, cache=rotating())
    finally:
        mt.unpatch(model)
    assert op_calls["sdpa_multi"] == 0
    ran = mtnn.fallbacks - before  # every call, each with its reason (the mask comes first)
    assert sum(ran.values()) == 4 * len(model.layers)
    assert ran["attention", "cache RotatingKVCache"] > 0, ran
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))


def test_attention_serves_only_the_backends_query_range(op_calls, monkeypatch):
    """A backend's SDPA_QUERIES_PER_BACKEND entry for the model's head dim sends the calls
    whose L falls outside it to mlx-lm's sdpa (counted as fallbacks) and the others to
    sdpa_multi; the logits stay those of the unpatched model."""
    model = model_for("llama")
    want = forward(model)
    backend, head_dim = backends.resolve_backend(), model.layers[0].self_attn.head_dim
    # the prompt (L = 32) and the decode steps (L = 1) fall outside, the L = 3 block inside
    monkeypatch.setitem(mtnn.SDPA_QUERIES_PER_BACKEND, backend, {head_dim: range(2, 9)})
    assert mtnn.sdpa_queries(head_dim) == range(2, 9)
    assert mtnn.sdpa_queries(head_dim * 2) == mtnn.SDPA_QUERIES  # another head dim
    assert mtnn.sdpa_queries(head_dim, "no such backend") == mtnn.SDPA_QUERIES
    assert mtnn.sdpa_queries(128, "cuda") == range(0)  # MLX's attention measured faster
    report = mt.patch(model)
    before = mtnn.fallbacks.copy()
    try:
        got = forward(model)
    finally:
        mt.unpatch(model)
    ran = mtnn.fallbacks - before
    layers = len(model.layers)
    assert ran == Counter({("attention", "queries per call outside sdpa_queries()"):
                           3 * layers}), ran
    assert op_calls["sdpa_multi"] == layers  # the verification block, once per layer
    for a, b in zip(want, got, strict=True):
        assert mx.abs(a - b).max().item() <= logits_bound(report, a)


def test_only_patched_instances_are_routed(op_calls):
    patched, plain = model_for("qwen3"), tiny_model("qwen3")
    mt.patch(patched)
    try:
        forward(plain)  # the same model module, an unpatched instance
        assert op_calls["sdpa_multi"] == 0
        forward(patched)
        assert op_calls["sdpa_multi"] > 0
    finally:
        mt.unpatch(patched)


def test_bad_input_and_nothing_to_serve():
    with pytest.raises(TypeError, match=r"^\[patch\] model must be an mlx.nn.Module, got dict"):
        mt.patch({"weight": mx.zeros(3)})
    with pytest.raises(TypeError, match=r"^\[unpatch\]"):
        mt.unpatch(3)
    report = mt.patch(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert report.entries == [] and "nothing" in str(report)


def test_report_prints_as_table():
    model = model_for("qwen3_next")
    report = mt.patch(model)
    mt.unpatch(model)
    text, page = str(report), report._repr_html_()
    assert text.splitlines()[0] == f"PatchReport: {len(report.replaced)} replaced, 0 left"
    for kind in ("gated_rms_norm", "switch_glu", "attention"):
        assert kind in text and f"<td>{kind}</td>" in page
    assert page.count("<tr>") == len(report.rows()) + 1


def test_package_imports_without_mlx_lm():
    code = ("import sys; sys.modules['mlx_lm'] = None; import mlx_metaltile as mt; "
            "import mlx.nn as nn; print(len(mt.patch(nn.Linear(4, 4)).entries))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr


def test_lora_on_a_patched_model(op_calls):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = tiny_model("qwen3_moe")
    report = mt.patch(model)
    keys = ["self_attn.q_proj", "mlp.switch_mlp.up_proj"]  # attention and experts
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": keys})
    model.update(_rescaled_lora(model))  # non-zero adapters, so they change the output
    assert "LoRASwitchLinear" in mtnn.switch_glu_unserved(model.model.layers[0].mlp.switch_mlp)
    adapted = forward(model)  # attention on sdpa_multi, adapted experts on mlx-lm's path
    assert op_calls["sdpa_multi"] > 0 and op_calls["expert_qmv"] == 0
    mt.unpatch(model)  # the adapters stay; the original modules run them
    got, base = forward(model), forward(model_for("qwen3_moe"))
    for g, a, b in zip(got, adapted, base, strict=True):
        assert mx.abs(g - a).max().item() <= logits_bound(report, g)
        assert mx.abs(g - b).max().item() > 1e-3


def _rescaled_lora(model):
    from mlx.utils import tree_map_with_path

    def grow(path, a):
        return mx.full(a.shape, 0.05, a.dtype) if path.endswith("lora_b") else a

    return tree_map_with_path(grow, model.trainable_parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_fp4_linear_layers(backend, op_calls):
    """mlx's tensor-parallel layers in mxfp4 (shard() on a one-process group here; two
    ranks in tests/test_shard.py) run fp4_qmm with their collectives."""
    model = tiny_model("qwen3", linear_mode="mxfp4")
    want = forward(model)
    model.shard(mx.distributed.init())
    report = mt.patch(model)
    try:
        kinds = Counter(type(m).__name__ for _, m in model.named_modules())
        assert kinds["Fp4AllToShardedLinear"] == 10 and kinds["Fp4ShardedToAllLinear"] == 4
        assert not report.left, str(report)
        with mt.use_backend(backend):
            got = forward(model)
    finally:
        mt.unpatch(model)
    assert op_calls["fp4_qmm"] > 0
    for a, b in zip(want, got, strict=True):
        assert mx.abs(a - b).max().item() <= logits_bound(report, a)
    assert all(type(m).__name__.startswith("Quantized") for _, m in model.named_modules()
               if "Sharded" in type(m).__name__)  # unpatch put mlx's layers back


def test_the_kv_cache_an_attention_call_was_given():
    """The cache watched during a patched attention call: the KVCache given as cache=, as
    another keyword or by position; none for other cache classes (a subclass too: its
    update_and_fetch may return other arrays) or no cache."""
    mtpatch = importlib.import_module("mlx_metaltile.patch")

    class Sub(lmcache.KVCache):
        pass

    cache, x = lmcache.KVCache(), mx.zeros((1,))
    assert mtpatch._kv_cache_arg((x, None), {"cache": cache}) is cache
    assert mtpatch._kv_cache_arg((x, None, cache), {}) is cache
    assert mtpatch._kv_cache_arg((x,), {"mask": None, "kv_cache": cache}) is cache
    assert mtpatch._kv_cache_arg((x,), {"cache": Sub()}) is None
    assert mtpatch._kv_cache_arg((x,), {"cache": lmcache.RotatingKVCache(8)}) is None
    assert mtpatch._kv_cache_arg((x,), {"cache": None}) is None
