"""``python -m mlx_metaltile bench|check|kernels``: what the table, the check and the registry
listing print, and how they fail."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import __main__ as cli
from mlx_metaltile import _check, backends
from mlx_metaltile.cases import cases
from mlx_metaltile.cases._base import oracle_and_magnitude

ROOT = Path(__file__).resolve().parent.parent
EMULATOR = backends.unavailable_reason("emulator")
needs_emulator = pytest.mark.skipif(EMULATOR is not None, reason=f"emulator: {EMULATOR}")


def _run(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess with stdout and stderr on pipes (not terminals)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mlx_metaltile", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _table(stdout: str) -> list[str]:
    """The case table's lines: from its header to the blank line before the per-op summary
    (or the end)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("op "))
    table = []
    for line in lines[start:]:
        if not line:
            break
        if not line.startswith("saved"):
            table.append(line)
    return table


@pytest.mark.parametrize("args, expected", [
    (["--op", "nosuchop"], "unknown --op 'nosuchop'; choose from: "
     + ", ".join(sorted({case.op for case in cases()}))),  # every op with cases, by name
    (["--op", "gated_rms_norm", "--shape", "999x1"],
     "no case has a shape containing '999x1' (the short subset: --all for every shape); "
     "shapes: 4096x128-yf32"),
])
def test_unknown_op_or_shape_is_a_usage_error_listing_the_choices(args, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "reference", *args])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


@needs_emulator
def test_emulator_table_is_untimed_and_says_why(tmp_path):
    out = tmp_path / "emu.json"
    res = _run("bench", "--quick", "--op", "gated_rms_norm", "--shape", "1x2048",
               "--backend", "emulator", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stdout + res.stderr  # no progress line off a terminal
    assert "not timed: the emulator runs each kernel on the CPU when the op is called" in res.stdout
    table = _table(res.stdout)
    assert table[0].split() == ["op", "shape", "dtype", "abs", "err", "rel", "err", "ok"]
    assert len(table) == 3 and all(row.endswith("✓") for row in table[1:])
    data = json.loads(out.read_text())
    assert data["meta"]["timed"] is False and "emulator" in data["meta"]["untimed_reason"]
    assert all("ours_us" not in r and "speedup" not in r for r in data["results"])


def test_every_op_has_grad_cases_one_of_them_in_the_short_subset():
    """Forward + backward cases: labelled grad-..., recording what they differentiate; each
    op has some, and exactly one in the short subset (what --shape grad selects without a
    GPU)."""
    every = cases()
    assert all(c.label.startswith("grad-") == bool(c.wrt) for c in every)
    ops = sorted({c.op for c in every})
    assert sorted({c.op for c in every if c.wrt}) == ops
    assert sorted(c.op for c in cases(quick=True) if c.wrt) == ops


def test_oracle_and_magnitude_share_one_evaluation_per_input_set():
    """A case's oracle and magnitude from one float64 computation: made once for the same
    input objects, again for any other input (never a previous set's result)."""
    calls = []

    def terms(x, scale):
        calls.append(x)
        return np.array(x) * scale, np.abs(np.array(x))

    exact, magnitude = oracle_and_magnitude(terms)
    a, b = mx.array([1.0, -2.0]), mx.array([1.0, -2.0])
    assert exact(x=a, scale=3.0).tolist() == [3.0, -6.0]
    assert magnitude(x=a, scale=3.0).tolist() == [1.0, 2.0] and len(calls) == 1
    assert exact(x=b, scale=3.0).tolist() == [3.0, -6.0] and len(calls) == 2  # equal, not same
    assert exact(x=b, scale=-1.0).tolist() == [-1.0, 2.0] and len(calls) == 3


@needs_emulator
def test_shape_grad_selects_the_forward_backward_cases(tmp_path):
    out = tmp_path / "grad.json"
    res = _run("bench", "--op", "expert_glu", "--shape", "grad", "--backend", "emulator",
               "--json", str(out))
    assert res.returncode == 0, res.stderr
    results = json.loads(out.read_text())["results"]
    want = [c.label for c in cases("expert_glu", quick=True) if c.wrt]
    assert [r["shape"] for r in results] == want
    assert all(r["within_tolerance"] for r in results)


def test_reference_table_times_with_spread_legend_and_fitted_columns(tmp_path):
    out = tmp_path / "ref.json"
    res = _run("bench", "--op", "gated_rms_norm", "--shape", "1x2048", "--backend", "reference",
               "--iters", "3", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stdout + res.stderr
    assert "ratio = native / ours (medians; > 1: ours is faster)" in res.stdout
    assert "per op: geometric mean of native / ours" in res.stdout
    assert "rel err = abs err / the largest magnitude" in res.stdout
    table = _table(res.stdout)
    assert "native ms (min)" in table[0] and "ours ms (min)" in table[0]
    # columns fit: every row ends in the header's last column (ok: one mark)
    assert {len(row) for row in table[1:]} == {table[0].rindex("ok") + 1}
    results = json.loads(out.read_text())["results"]
    meta = json.loads(out.read_text())["meta"]
    assert meta["git_sha"] and meta["mlx_version"] and meta["package_version"]
    for r in results:
        assert len(r["ours_samples_us"]) == 3 and r["ours_min_us"] <= r["ours_us"]
        assert 0 < r["rel_err"] < 1e-3 and r["within_tolerance"]
    # the saved run prints again, fitted to its contents
    again = _run("bench", "--from", str(out))
    assert again.returncode == 0 and _table(again.stdout)[1].split()[:3] == \
        table[1].split()[:3]


def test_samples_in_turns_alternate_sides_and_rotate_copies_across_them():
    """One sample per side per round, the order reversed every other round; the input
    copies rotate across all samples (no side re-reads the copies the other just read)."""
    from mlx_metaltile import _measure

    calls = []

    def side(name):
        def fn(x):
            calls.append((name, int(x.item())))
            return x + 1
        return fn

    inputs = [{"x": mx.array(i)} for i in range(5)]
    times = _measure.samples_in_turns([side("a"), side("b")], inputs, 1, 3, 2)
    assert [len(t) for t in times] == [3, 3] and all(s > 0 for t in times for s in t)
    timed = calls[2:]  # after one warmup call per side (copy 0)
    assert calls[:2] == [("a", 0), ("b", 0)]
    assert [n for n, _ in timed] == list("aabbbbaaaabb")
    assert [c for _, c in timed] == [i % 5 for i in range(12)]


def test_bench_summary_per_op_geometric_means():
    """The per-op summary: geometric means over all, forward and gradient rows, rows
    without a finite ratio left out, None when no row has one."""
    def row(op, shape, ratio, gbps=1.0):
        return dict(op=op, shape=shape, speedup=ratio, gbps=gbps)

    rows = [row("a", "s1", 2.0, 10.0), row("a", "s2", 0.5, 480.0), row("a", "grad-s1", 4.0),
            row("a", "s3", float("nan")), row("b", "s1", 1.0), row("c", "s1", None)]
    table = cli.summary(rows, peak=4800)
    assert table.header[:5] == ["op", "cases", "all", "forward", "gradient"]
    assert table.rows == [["a", "3", "1.59", "1.00", "4.00", "2", "480.0 (10%)"],
                          ["b", "1", "1.00", "1.00", "-", "1", "1.00 (0%)"]]
    assert cli.summary([row("c", "s1", None)]) is None


def test_bench_times_ours_alone_when_native_fails(capsys):
    """A native op that raises on this backend leaves ours timed and native empty, with a
    message naming the case."""
    case = cases("gated_rms_norm", quick=True)[0]

    def broken(**inputs):
        raise RuntimeError("no such op here")

    case = replace(case, native=broken)
    inputs = [case.make(np.random.default_rng(0))]
    row = cli._timings(case, inputs, 1, 2, 1, cli.Progress())
    assert len(row["ours_samples_us"]) == 2 and row["native_samples_us"] is None
    assert np.isnan(row["native_us"])
    assert f"{case.id}: native MLX failed: RuntimeError: no such op here" in \
        capsys.readouterr().err


def test_plot_from_saved_baselines(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "h200.png"
    res = _run("bench", "--from", "bench/baselines/nvidia-h200.json",
               "--from", "bench/baselines/nvidia-h200.json", "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    plain, tty = io.StringIO(), Tty()
    for stream in (plain, tty):
        progress = cli.Progress(stream)
        progress.show("[1/2] case")
        progress.clear()
    assert plain.getvalue() == "" and tty.getvalue().startswith("\r")


def test_kernels_gives_the_reasons(capsys):
    assert cli.main(["kernels"]) == 0
    out = capsys.readouterr().out
    for name, reason in backends.available_backends().items():
        assert f"{name:<10} {'available' if reason is None else 'unavailable: ' + reason}" in out
    assert "gated_rms_norm_row" in out and "geometry" in out


def test_check_needs_a_kernel_backend(capsys, monkeypatch):
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "reference")
    assert cli.main(["check"]) == 2
    assert "no kernel backend selected" in capsys.readouterr().err


@needs_emulator
def test_check_reports_unchecked_and_failures_never_as_passes():
    gated = min(cases("gated_rms_norm"), key=lambda c: c.nbytes)

    def wrong_oracle(**inputs):
        return gated.oracle(**inputs) + 1.0

    def only_a_broken_gated_case(op=None, quick=False):
        return [replace(gated, oracle=wrong_oracle)] if op == "gated_rms_norm" else []

    results = {r.kernel: r for r in _check.check_variants("emulator", only_a_broken_gated_case)}
    launched = [r for r in results.values() if r.case]
    assert launched and all(r.status == "FAIL" and r.error.ratio > 1 for r in launched)
    assert results["sdpa_multi_split"].status == "unchecked"
    assert results["fp4_qmm_mpp"].status == "unchecked"
    assert not any(r.status == "pass" for r in results.values())


@needs_emulator
def test_check_tries_each_dtype_of_a_shape_for_a_variant_asked_by_name():
    """fp4_qmm's decoded variant refuses float32 x: check moves on to the same shape's
    bfloat16 case and checks the variant there (at a small size here; float32 made the
    cheapest, so that it comes first)."""
    def small(rng, dtype):
        w, scales = mx.quantize(mx.array(rng.standard_normal((64, 128), dtype=np.float32)),
                                mode="mxfp4")[:2]
        x = mx.array(rng.standard_normal((9, 128), dtype=np.float32)).astype(dtype)
        return dict(x=x, w=w, scales=scales)

    shape = [c for c in cases("fp4_qmm") if c.label == "M1-N4096-K4096"
             and c.dtype in (mx.float32, mx.bfloat16)]
    fake = [replace(c, make=lambda rng, d=c.dtype: small(rng, d),
                    nbytes=1 if c.dtype == mx.float32 else 2) for c in shape]
    assert len(fake) == 2
    results = {r.kernel: r for r in _check.check_variants(
        "emulator", lambda op=None, quick=False: fake if op == "fp4_qmm" else [])}
    decoded = results["fp4_qmm_decoded"]
    assert decoded.status == "pass" and decoded.case.endswith("bfloat16"), decoded
    assert results["fp4_qmm_simdgroup"].case.endswith("float32")  # the cheapest dtype first


@needs_emulator
def test_check_lays_a_crash_to_the_kernels_it_launched():
    """A case that crashes after launching a kernel checked already fails that kernel; a
    kernel no case launches stays unchecked rather than taking the blame."""
    def small(rng, m):
        w, scales = mx.quantize(mx.array(rng.standard_normal((64, 128), dtype=np.float32)),
                                mode="mxfp4")[:2]
        x = mx.array(rng.standard_normal((m, 128), dtype=np.float32)).astype(mx.bfloat16)
        return dict(x=x, w=w, scales=scales)

    def crashes(**inputs):
        mx.eval(mt.fp4_qmm(**inputs))  # the auto choice at 40 rows: the tile kernel
        raise RuntimeError("boom")

    base = next(c for c in cases("fp4_qmm") if c.dtype == mx.bfloat16)
    fake = [replace(base, label="small", make=lambda rng: small(rng, 9), nbytes=1),
            replace(base, label="crash", make=lambda rng: small(rng, 40), nbytes=2,
                    ours=crashes)]
    results = {r.kernel: r for r in _check.check_variants(
        "emulator", lambda op=None, quick=False: fake if op == "fp4_qmm" else [])}
    tile = results["fp4_qmm_simdgroup"]
    assert tile.status == "FAIL" and "boom" in tile.detail and "crash" in tile.case, tile
    assert results["fp4_qmm_qmv_wfirst"].status == "unchecked"


def test_plot_is_refused_before_an_untimed_or_unplottable_run(capsys, monkeypatch):
    if EMULATOR is None:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "--backend", "emulator", "--plot", "x.png"])
        assert exc.value.code == 2 and "--plot needs timings" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "reference", "--plot", "x.png"])
    assert exc.value.code == 2
    assert "plotting needs matplotlib: pip install matplotlib" in capsys.readouterr().err
