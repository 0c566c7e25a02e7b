"""The pytest-benchmark suites in bench/: one group per case, string parameters that
serialise, and extra_info that says what ran where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench_run(nodes: list[str], out: Path) -> subprocess.CompletedProcess:
    """pytest-benchmark on ``nodes`` in a run of its own, also when this suite runs under
    xdist (its workers' PYTEST_* variables would switch the benchmarks off in the child)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *nodes, "--benchmark-only",
                           f"--benchmark-json={out}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_one_group_per_case_with_serialisable_params(tmp_path):
    out = tmp_path / "bench.json"
    node = "bench/test_gated_rms_norm.py::test_gated_rms_norm[1x2048-y=T-f16-{}]"
    providers = ("mlx_native", "reference", "emulator")
    res = _bench_run([node.format(p) for p in providers], out)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = {b["params"]["provider"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert set(runs) <= set(providers) and {"mlx_native", "reference"} <= set(runs)
    for provider in ("mlx_native", "reference"):
        run = runs[provider]
        assert run["group"] == "gated_rms_norm[1x2048-y=T-f16]"
        assert run["params"] == {"case": "1x2048-y=T-f16", "provider": provider}
        info = run["extra_info"]
        assert info["backend"].startswith("mlx-") and info["mlx_version"] and info["device"]
        assert info["gbps"] == info["bytes"] / run["stats"]["median"] / 1e9
    if "emulator" in runs:  # in a group of its own, without GB/s
        emulated = runs["emulator"]
        assert emulated["group"].endswith("(emulator: not a kernel timing)")
        assert "gbps" not in emulated["extra_info"] and emulated["extra_info"]["backend"] == \
            "emulator"


def test_grad_case_runs_every_provider_through_the_vjp(tmp_path):
    """A forward + backward case: MLX's autodiff of the native composite and the op on the
    reference backend, both checked against the float64 gradients, in the case's group."""
    out = tmp_path / "bench.json"
    node = "bench/test_gated_rms_norm.py::test_gated_rms_norm[grad-32x2048-f16-{}]"
    res = _bench_run([node.format(p) for p in ("mlx_native", "reference")], out)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = {b["params"]["provider"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert set(runs) == {"mlx_native", "reference"}
    assert {r["group"] for r in runs.values()} == {"gated_rms_norm[grad-32x2048-f16]"}
