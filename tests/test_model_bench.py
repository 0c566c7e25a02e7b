"""model-bench end to end on the CPU, with the layer shapes shrunk (the real ones take
minutes per step on a CPU): the same code path as on a GPU, and its JSON."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_metaltile import model_bench, moe_bench  # noqa: E402
from mlx_metaltile import nn as mtnn  # noqa: E402


@pytest.mark.parametrize("compiled", (False, True))
def test_model_bench_runs_and_saves_json(compiled, monkeypatch, tmp_path, capsys):
    """``compiled``: as on a GPU backend, the MoE decode pair compiled (traced here on the
    reference backend) and the cache's offset passed to sdpa_multi as a 0-d kv_len; the
    per-op split still sees both MoE ops, and times mlx's sdpa over the offset's rows."""
    if compiled:
        monkeypatch.setattr(mtnn, "COMPILED_BACKENDS", ("reference",))
        monkeypatch.setattr(mtnn, "INT_KV_LEN_BACKENDS", ())
    mtnn._decode_pair.cache_clear()
    config, experts, rest = model_bench.ARCHS["qwen3_moe"]
    small = dict(config, hidden_size=128, intermediate_size=128, vocab_size=256, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1)
    monkeypatch.setitem(model_bench.ARCHS, "qwen3_moe", (small, experts, rest))
    path = tmp_path / "bench.json"
    assert model_bench.main(["--arch", "qwen3_moe", "--layers", "1", "--backend", "reference",
                             "--prefill", "32", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "not kernel timings" in out and "decode_ms" in out
    data = json.loads(path.read_text())
    assert data["meta"]["kernel_timings"] is False and data["meta"]["git_sha"]
    for key in ("decode_ms", "verify4_ms", "verify8_ms", "prefill_tok_s", "generate_tok_s"):
        assert data["native"][key] > 0 and data["patched"][key] > 0
    # one decode step: attention, and the MoE block in two dispatches
    assert set(data["split"]) == {"sdpa_multi", "expert_glu", "expert_down_combine"}
    for op in data["split"].values():  # each op next to mlx's own on the same arguments
        assert op["calls"] > 0 and op["ms"] > 0 and op["native_ms"] > 0
        assert op["max_abs_diff"] < 0.05  # bfloat16 model: rounding-level differences
    assert "built layer" not in err  # progress lines on a terminal only
    assert data["max_logit_diff"] < 1.0
    assert mtnn.COMPILED_BACKENDS == (("reference",) if compiled else ("metal", "cuda"))
    mtnn._decode_pair.cache_clear()


def test_model_bench_attention_choice(monkeypatch, tmp_path, capsys):
    """--attention mlx: every patched attention call runs mlx-lm's sdpa (fallbacks counted,
    no sdpa_multi in the split); the per-backend table is as it was afterwards."""
    config, experts, rest = model_bench.ARCHS["qwen3_moe"]
    small = dict(config, hidden_size=128, intermediate_size=128, vocab_size=256, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1)
    monkeypatch.setitem(model_bench.ARCHS, "qwen3_moe", (small, experts, rest))
    table = {k: dict(v) for k, v in mtnn.SDPA_QUERIES_PER_BACKEND.items()}
    path = tmp_path / "bench.json"
    assert model_bench.main(["--arch", "qwen3_moe", "--layers", "1", "--backend", "reference",
                             "--prefill", "8", "--iters", "1", "--attention", "mlx",
                             "--json", str(path)]) == 0
    assert "attention: mlx" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["meta"]["attention"] == "mlx"
    assert "sdpa_multi" not in data["split"] and "expert_glu" in data["split"]
    assert data["fallbacks"]["attention: queries per call outside sdpa_queries()"] > 0
    assert mtnn.SDPA_QUERIES_PER_BACKEND == table
    with model_bench.attention_choice("sdpa_multi", "cuda"):
        assert mtnn.sdpa_queries(128, "cuda") == mtnn.SDPA_QUERIES
    assert mtnn.SDPA_QUERIES_PER_BACKEND == table
    with pytest.raises(ValueError, match=r"\[model-bench\] attention must be one of"):
        with model_bench.attention_choice("cudnn", "cuda"):
            pass


def test_moe_bench_runs_and_saves_json(tmp_path, capsys):
    """moe-bench through the CLI at shrunk shapes: every block, both patched paths next to
    mlx-lm's block, outputs close to it, the switch point and the JSON."""
    from mlx_metaltile.__main__ import main

    path = tmp_path / "moe.json"
    assert main(["moe-bench", "--quick", "--backend", "reference", "--tokens", "1,16",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not kernel timings" in out and "native/best" in out
    data = json.loads(path.read_text())
    assert data["meta"]["kernel_timings"] is False and data["meta"]["quick"] is True
    assert set(data["blocks"]) == {"qwen3_moe", "qwen3_next", "gpt_oss", "glm4_moe"}
    for arch, block in data["blocks"].items():
        assert [r["tokens"] for r in block["rows"]] == [1, 16]
        k = block["rows"][0]["pairs"]
        for row in block["rows"]:
            assert min(row["native_us"], row["decode_us"], row["prefill_us"],
                       row["native_pipelined_us"], row["decode_pipelined_us"]) > 0
            assert row["pairs"] == row["tokens"] * k
            # bfloat16 blocks: mlx-lm's rounds k expert rows, k products and k - 1 partial
            # sums to bfloat16 (unit roundoff 2^-8), ours fewer; a wrong expert or score is
            # of the order of the output itself
            for path in ("decode", "prefill"):
                bound = 3 * k * 2**-8 * row["native_max_abs"]
                assert 0 < row[f"{path}_max_diff"] <= bound, (arch, path, row)
        assert block["dispatches"]["patched"] is None  # the reference backend: no kernels
        assert sum(block["dispatches"]["native"].values()) > 2


def test_moe_bench_forced_paths_and_bad_tokens(capsys):
    from mlx_metaltile import nn as mtnn
    from mlx_metaltile.__main__ import main

    with moe_bench.forced_path("prefill"):
        assert mtnn.prefill_min_pairs() == 0
        with moe_bench.forced_path("decode"):
            assert mtnn.prefill_min_pairs() > 1 << 40
        assert mtnn.prefill_min_pairs() == 0
    assert mtnn.prefill_min_pairs() == mtnn.PREFILL_MIN_PAIRS
    with pytest.raises(SystemExit):
        main(["moe-bench", "--tokens", "1,x"])
    assert "expected token counts like 1,2,4, got '1,x'" in capsys.readouterr().err


def test_moe_bench_counts_tokens_routed_apart(monkeypatch):
    """routed_apart: tokens whose experts differ from mlx-lm's routing, and how many of those
    differ at a tie of the k-th largest logit (all logits equal: every token is tied)."""
    block = moe_bench.build_block("qwen3_moe", quick=True)
    routing = mtnn.moe_routing(type(block.native))
    xs = [mx.random.normal((1, 3, block.hidden)).astype(mx.bfloat16) for _ in range(2)]
    assert moe_bench.routed_apart(block, xs) == (0, 0)  # random logits: no ties here
    router = getattr(block.native, routing.router)
    weights = {k: v for k, v in router.parameters().items() if k in ("scales", "biases")}
    router.update({k: mx.zeros_like(v) for k, v in weights.items()})
    try:
        apart, tied = moe_bench.routed_apart(block, xs)
        assert apart == tied == 6  # every token tied; mlx-lm keeps the higher ids here
        real = mtnn.MoERouting.mlx_lm_route

        def shifted(self, blk, logits):  # another set of experts, no tie involved
            ids, scores = real(self, blk, logits)
            return (ids + 1) % logits.shape[-1], scores

        router.update(weights)
        monkeypatch.setattr(mtnn.MoERouting, "mlx_lm_route", shifted)
        assert moe_bench.routed_apart(block, xs) == (6, 0)
    finally:
        router.update(weights)


def test_decode_and_verify_samples_alternate_sides(monkeypatch):
    """interleaved_steps takes a native round, then a patched round, ``iters`` times (so a
    drift during the run falls on both sides), and times every step and a generation on
    each side."""
    import types

    import mlx_metaltile as mt

    config, experts, rest = model_bench.ARCHS["qwen3_moe"]
    small = dict(config, hidden_size=128, intermediate_size=128, vocab_size=256, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1)
    monkeypatch.setitem(model_bench.ARCHS, "qwen3_moe", (small, experts, rest))
    model, cfg = model_bench.build("qwen3_moe", 1)
    order = []
    sides = types.SimpleNamespace(
        patch=lambda m: (order.append("patch"), mt.patch(m))[1],
        unpatch=lambda m: (order.append("unpatch"), mt.unpatch(m))[1])
    monkeypatch.setattr(model_bench, "mt", sides)
    rewound = []
    rewind = model_bench._rewind
    monkeypatch.setattr(model_bench, "_rewind",
                        lambda cache, n: (rewound.append(n), rewind(cache, n))[1])
    times = model_bench.interleaved_steps(model, cfg["vocab_size"], 8, iters=3)
    assert order == ["unpatch", "patch"] * 3
    # per side and round, each step: one untimed, then a sample of STEP_REPEATS
    per_round = [L for L in model_bench.STEPS.values()
                 for _ in range(1 + model_bench.STEP_REPEATS)]
    assert rewound == per_round * 2 * 3
    assert set(times) == {"native", "patched"}
    for side in times.values():
        assert set(side) == {*model_bench.STEPS, "generate_tok_s"} and min(side.values()) > 0
    assert type(model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert getattr(type(model.layers[0].mlp), "_mlx_metaltile_kind", None) == "moe_block"
    mt.unpatch(model)
