"""The pytest-benchmark suites in bench/: one group per case, string parameters that
serialise, and extra_info that says what ran where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_cuda_kernel_time_parses_nsight_compute_csv(tmp_path):
    """bench/cuda_kernel_time.py --parse: the kernels between a case's markers summed per
    call in us (ns values with thousands separators, other units converted), kernels outside
    the markers and other metrics ignored, an unknown unit refused."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import cuda_kernel_time as kt
    finally:
        sys.path.remove(str(ROOT / "bench"))
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"\n')

    def row(i, name, unit, value, metric="gpu__time_duration.sum"):
        return (f'"{i}","1","python3","h","{name}(const float *, float *)","1","7","(1, 1, 1)",'
                f'"(1, 1, 1)","0","9.0","m","{metric}","{unit}","{value}"\n')

    log = ("==PROF== Connected\n" + head + row(0, "setup_kernel", "ns", "9,999")
           + row(1, "custom_kernel_mt_case_begin_0", "ns", "2,880")
           + row(2, "custom_kernel_mt_op", "ns", "10,000")
           + row(3, "custom_kernel_mt_op", "ns", "10,000", metric="sm__cycles")
           + row(4, "custom_kernel_mt_sum", "us", "2.5")
           + row(5, "custom_kernel_mt_case_end_0", "ns", "2,000")
           + row(6, "between", "ns", "50,000")
           + row(7, "custom_kernel_mt_case_begin_1", "ns", "1,000")
           + row(8, "custom_kernel_mt_op", "ms", "0.012")
           + row(9, "custom_kernel_mt_case_end_1", "ns", "1,000"))
    got = kt.kernel_us(log, {0: 2, 1: 4})
    assert got == pytest.approx({0: (10.0 + 2.5) / 2, 1: 12.0 / 4})
    split = kt.kernel_split(log, {0: 2, 1: 4})
    assert split == {0: pytest.approx({"custom_kernel_mt_op": 5.0, "custom_kernel_mt_sum": 1.25}),
                     1: pytest.approx({"custom_kernel_mt_op": 3.0})}
    assert kt.short_name("void mlx::core::cu::qmv<(int)4, float>(const float *)") == (
        "mlx::core::cu::qmv")
    with pytest.raises(ValueError, match="unknown time unit 'cycle'"):
        kt.kernel_us(head + row(0, "custom_kernel_mt_case_begin_0", "ns", "1")
                     + row(1, "k", "cycle", "5"), {0: 1})
    (tmp_path / "run.txt").write_text("case 0 2 fp4_qmm-M1-N4096-K4096-bfloat16\n"
                                      "case 1 4 expert_qmv-x-float16\n")
    (tmp_path / "a.csv").write_text(log)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_kernel_time.py"),
                          "--parse", str(tmp_path / "run.txt"), f"old={tmp_path / 'a.csv'}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["case | old", "fp4_qmm-M1-N4096-K4096-bfloat16 | 6.2",
                                       "expert_qmv-x-float16 | 3.0"]
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_kernel_time.py"),
                          "--parse", str(tmp_path / "run.txt"), f"old={tmp_path / 'a.csv'}",
                          "--kernels", "1"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[3:] == [
        "old fp4_qmm-M1-N4096-K4096-bfloat16: custom_kernel_mt_op 5.0",
        "old expert_qmv-x-float16: custom_kernel_mt_op 3.0"]


def _template_ab():
    """bench/template_ab.py as a module."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import template_ab
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return template_ab


def _norm_inputs():
    """gated_rms_norm's y, z [4, 64] and w [64], float32, fixed seed."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    return tuple(mx.array(rng.standard_normal(s).astype(np.float32))
                 for s in ((4, 64), (4, 64), (64,)))


def test_template_ab_times_each_variant_on_its_own_kernels():
    """bench/template_ab.py's time_variants: every side sampled each round, and each
    variant's timed calls launch kernels built from its own edits (the emulator runs a kernel
    when the op is called): a variant that keeps the math reads no difference from the
    reference, one that drops silu reads one, from the calls it timed."""
    import mlx.core as mx

    import mlx_metaltile as mt
    from mlx_metaltile import backends

    ab = _template_ab()
    y, z, w = _norm_inputs()

    def edits(old, new):  # both of the plan's small-row kernels
        return [(f, old, new) for f in ("gated_rms_norm.metal", "gated_rms_norm_simd_rows.metal")]

    variants = {"as is": [], "same": edits("mt_silu(z_reg[j])", "mt_silu(z_reg[j] + 0.0f)"),
                "no silu": edits("mt_silu(z_reg[j])", "(z_reg[j])")}
    with backends.use_backend("emulator"):
        before = mt.gated_rms_norm(y, z, w)
        times, diffs = ab.time_variants(
            lambda y, z, w: mt.gated_rms_norm(y, z, w), None, [{"y": y, "z": z, "w": w}],
            variants, rounds=2, batch=2)
        after = mt.gated_rms_norm(y, z, w)  # no variant's kernel outlives the timing
    assert {side: len(t) for side, t in times.items()} == dict.fromkeys(variants, 2)
    assert diffs["as is"] == diffs["same"] == 0.0 and diffs["no silu"] > 0.1
    assert mx.array_equal(after, before)


def test_template_ab_builds_each_variants_kernels_once(monkeypatch):
    """A variant's edited kernels are built once and launched again in its later calls (as
    the unedited side's are): the kernel objects built during a timing do not grow with
    its rounds."""

    from mlx_metaltile import backends

    ab = _template_ab()
    y, z, w = _norm_inputs()
    built = []
    factory = backends._factory

    def counting(backend):
        make = factory(backend)

        def build(**kwargs):
            built.append(kwargs["name"])
            return make(**kwargs)
        return build

    monkeypatch.setattr(backends, "_factory", counting)
    files = ("gated_rms_norm.metal", "gated_rms_norm_simd_rows.metal")
    variants = {"as is": [], "same": [(f, "mt_silu(z_reg[j])", "mt_silu(z_reg[j] + 0.0f)")
                                      for f in files]}
    counts = []
    with backends.use_backend("emulator"):
        import mlx_metaltile as mt
        mt.gated_rms_norm(y, z, w)  # the unedited kernel built before the timings
        for rounds in (1, 3):
            built.clear()
            ab.time_variants(lambda y, z, w: mt.gated_rms_norm(y, z, w), None,
                             [{"y": y, "z": z, "w": w}], variants, rounds=rounds, batch=2)
            counts.append(len(built))
    assert counts[0] == counts[1] == 1, counts


def test_template_ab_sets_plan_constants_per_variant():
    """A variant's plan constants ("set") hold for its calls only: moe_gather_qmm's GEMV
    plan switched on for the emulator launches the GEMV in that variant's calls alone (one
    warm-up call and a sample per round), with the same results as the tiles to float32
    rounding, and the constant is put back."""
    import importlib

    import mlx.core as mx
    import numpy as np

    import mlx_metaltile as mt
    from mlx_metaltile import backends
    from mlx_metaltile.cases.moe_gather_qmm import make_case

    ab = _template_ab()
    op = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm")
    x, w, scales, biases, indices = make_case(np.random.default_rng(0), 4, 5, 64, 128, 32, 4,
                                              mx.float32)
    inputs = {"x": x, "w": w, "scales": scales, "biases": biases, "indices": indices}
    plan = op.GEMV_ROWS_PER_EXPERT
    variants = {"tiles": [], "gemv": {"set": {
        "mlx_metaltile.ops.moe_gather_qmm.GEMV_ROWS_PER_EXPERT": {"emulator": 4}}}}
    with backends.use_backend("emulator"):
        before = backends.launch_count(op.GEMV_SPEC.name, "emulator")
        _, diffs = ab.time_variants(
            lambda **a: mt.moe_gather_qmm(**a, group_size=32, bits=4), None, [inputs],
            variants, rounds=2, batch=2)
        launched = backends.launch_count(op.GEMV_SPEC.name, "emulator") - before
    assert launched == 1 + 2 * 2
    assert op.GEMV_ROWS_PER_EXPERT is plan
    assert diffs["tiles"] == 0.0 and 0.0 < diffs["gemv"] < 1e-4
