"""model-bench end to end on the CPU, with the layer shapes shrunk (the real ones take
minutes per step on a CPU): the same code path as on a GPU, and its JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_lm")
from mlx_metaltile import model_bench  # noqa: E402


def test_model_bench_runs_and_saves_json(monkeypatch, tmp_path, capsys):
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
    for key in ("decode_ms", "verify4_ms", "verify8_ms", "prefill_tok_s"):
        assert data["native"][key] > 0 and data["patched"][key] > 0
    assert set(data["split"]) == {"sdpa_multi", "expert_qmv"}  # one decode step
    for op in data["split"].values():  # each op next to mlx's own on the same arguments
        assert op["calls"] > 0 and op["ms"] > 0 and op["native_ms"] > 0
        assert op["max_abs_diff"] < 0.05  # bfloat16 model: rounding-level differences
    assert "built layer" not in err  # progress lines on a terminal only
    assert data["max_logit_diff"] < 1.0
