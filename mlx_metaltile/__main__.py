"""``python -m mlx_metaltile bench|check|kernels``: the benchmark table, a check of every
kernel variant against its float64 oracle, and the kernel registry."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt
from mlx_metaltile import _device, _measure, _show, backends


def _bench_cases():
    from mlx_metaltile.cases import cases
    return cases


class Progress:
    """``[i/n] case`` on one rewritten line of stderr, only when stderr is a terminal (a log
    file gets the table's plain lines and no carriage returns)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())

    def show(self, text: str) -> None:
        if self.live:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()

    def clear(self) -> None:
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()


# ---- the table --------------------------------------------------------------------------

def _unit(backend: str) -> tuple[str, float]:
    """Time unit of the table: us for a GPU's kernels, ms for CPU composites."""
    return ("us", 1.0) if backend in ("metal", "cuda") else ("ms", 1e-3)


def _num(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _time_cell(median_us, low_us, scale: float) -> str:
    if median_us is None or math.isnan(median_us):
        return "-"
    if low_us is None:  # saved before the spread was recorded
        return _num(median_us * scale)
    return f"{_num(median_us * scale)} ({_num(low_us * scale)})"


def _columns(timed: bool, peak, unit: str = "us") -> list[tuple[str, bool]]:
    """(header, right-aligned) of the table's columns."""
    cols = [("op", False), ("shape", False), ("dtype", False)]
    if timed:
        cols += [(f"native {unit} (min)", True), (f"ours {unit} (min)", True), ("ratio", True),
                 ("GB/s", True)]
        if peak:
            cols.append(("%peak", True))
    return cols + [("abs err", True), ("rel err", True), ("ok", False)]


def _cells(row: dict, timed: bool, peak, scale: float = 1.0) -> list[str]:
    cells = [row["op"], row["shape"], row["dtype"]]
    if timed:
        ratio, gbps = row.get("speedup"), row.get("gbps")
        cells += [_time_cell(row.get("native_us"), row.get("native_min_us"), scale),
                  _time_cell(row.get("ours_us"), row.get("ours_min_us"), scale),
                  "-" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}",
                  _num(gbps)]
        if peak:
            cells.append("-" if gbps is None else f"{100 * gbps / peak:.0f}%")
    rel = row.get("rel_err")
    return cells + [f"{row['max_err']:.2e}", "-" if rel is None else f"{rel:.1e}",
                    "✓" if row["within_tolerance"] else "✗"]


def _widths(labels: list[tuple[str, str, str]], timed: bool, peak, unit: str) -> list[int]:
    """Column widths known before the first case runs (rows print as they are measured):
    labels from the selected cases, numbers from the widest value their format gives."""
    widest = dict(op="", shape="", dtype="", native_us=99999.0, native_min_us=99999.0,
                  ours_us=99999.0, ours_min_us=99999.0, speedup=999.99, gbps=99999.9,
                  max_err=1.0, rel_err=1.0, within_tolerance=False)
    cols = _columns(timed, peak, unit)
    rows = [_cells(widest, timed, peak)] + [list(lbl) + [""] * (len(cols) - 3) for lbl in labels]
    return _show.fit_widths([c for c, _ in cols], rows)


def legend(timed: bool, iters, batch, untimed_reason: str = "", unit: str = "us") -> str:
    errs = ("abs err = max |ours - float64 oracle|; rel err = abs err / the largest magnitude "
            "of the outputs\n  (float64 sum of |terms|); ok = every element within the "
            "tolerance table")
    if not timed:
        return f"not timed: {untimed_reason}.\n  {errs}"
    return (f"{unit} per call: median (min) of {iters} samples, each evaluating {batch} "
            "queued call(s) on rotating input copies,\n  ours and native sampled in turns\n"
            "  ratio = native / ours (medians; > 1: ours is faster); GB/s = bytes the case "
            f"moves / ours median\n  {errs}")


def _print_table(meta: dict, results: list[dict], out=None) -> None:
    """A saved run's table (``--from``), fitted to its contents."""
    out = out or sys.stdout
    timed, peak = meta.get("timed", True), meta.get("peak_gbps")
    unit, scale = _unit(meta.get("backend", "?"))
    print(f"{meta.get('device', '?')}  backend: {meta.get('backend', '?')}  mlx "
          f"{meta.get('mlx_version', '?')}  mlx_metaltile {meta.get('package_version', '?')} "
          f"({meta.get('git_sha', '?')})", file=out)
    print("legend: " + legend(timed, meta.get("iters", "?"), meta.get("batch", "?"),
                              meta.get("untimed_reason", ""), unit), file=out)
    cols = _columns(timed, peak, unit)
    print(_show.Table([c for c, _ in cols], [_cells(r, timed, peak, scale) for r in results],
                      right=[r for _, r in cols]), file=out)
    per_op = summary(results, peak) if timed else None
    if per_op is not None:
        print(f"\n{per_op}", file=out)


def summary(results: list[dict], peak=None) -> _show.Table | None:
    """Per op, over its timed rows with a native time: the number of cases, the geometric
    mean of native / ours over all of them, over the forward cases and over the gradient
    cases (shape ``grad-...``), how many are at least as fast as native, and the best GB/s
    (with its % of ``peak``); None when no row has a ratio."""
    per_op: dict[str, list[dict]] = {}
    for row in results:
        ratio = row.get("speedup")
        if ratio is not None and math.isfinite(ratio) and ratio > 0:
            per_op.setdefault(row["op"], []).append(row)
    if not per_op:
        return None

    def geomean(rows):
        if not rows:
            return "-"
        return f"{math.exp(sum(math.log(r['speedup']) for r in rows) / len(rows)):.2f}"

    lines = []
    for op, rows in per_op.items():
        grad = [r for r in rows if r["shape"].startswith("grad-")]
        forward = [r for r in rows if not r["shape"].startswith("grad-")]
        best = max(r.get("gbps") or 0.0 for r in rows)
        best_cell = _num(best) + (f" ({100 * best / peak:.0f}%)" if peak else "")
        lines.append([op, str(len(rows)), geomean(rows), geomean(forward), geomean(grad),
                      str(sum(r["speedup"] >= 1.0 for r in rows)), best_cell])
    return _show.Table(["op", "cases", "all", "forward", "gradient", "ours >= native",
                        "best GB/s"], lines, right=[False] + [True] * 6,
                       title="per op: geometric mean of native / ours (> 1: ours is faster)")


# ---- bench --------------------------------------------------------------------------------

def _select(args, cases, quick: bool):
    """The cases the options ask for; an unknown op, or a shape text that matches no case,
    is a usage error listing the choices."""
    every = cases()
    ops = list(dict.fromkeys(c.op for c in every))
    for op in args.op or ():
        if op not in ops:
            args.parser.error(f"unknown --op {op!r}; choose from: {', '.join(ops)}")
    pool = [c for c in cases(quick=quick) if not args.op or c.op in args.op]
    for text in args.shape or ():
        if not any(text in c.label for c in pool):
            labels = ", ".join(dict.fromkeys(c.label for c in pool))
            subset = " (the short subset: --all for every shape)" if quick else ""
            args.parser.error(f"no case has a shape containing {text!r}{subset}; "
                              f"shapes: {labels}")
    return [c for c in pool if not args.shape or any(t in c.label for t in args.shape)]


def _plot(args, runs) -> None:
    from mlx_metaltile import plot
    try:
        plot.save(runs, args.plot)
    except (plot.MissingMatplotlib, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"saved the plot to {args.plot}")


def _save(path: str, meta: dict, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)


def cmd_bench(args) -> int:
    if getattr(args, "from_json", None):
        from mlx_metaltile import plot
        runs = plot.load(args.from_json)
        for path, meta, results in runs:
            print(f"== {path}")
            _print_table(meta, results)
        if args.plot:
            _plot(args, runs)
        return 0
    cases = _bench_cases()
    backend = backends.resolve_backend()
    device = _device.device_name()
    peak = _device.peak_gbps(device)
    gpu = backend in ("metal", "cuda")
    untimed_reason = _measure.EAGER.get(backend, "")
    timed = not untimed_reason
    if args.plot:  # before a long run: what would stop the plot at its end
        if not timed:
            args.parser.error(f"--plot needs timings; on {backend}: {untimed_reason}")
        from mlx_metaltile import plot
        try:
            plot.require_matplotlib()
        except plot.MissingMatplotlib as exc:
            args.parser.error(str(exc))
    iters = args.iters or (20 if gpu else 3)
    batch = args.batch or (8 if gpu else 1)
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    # Without a GPU the table times MLX's CPU composites: the full shape list would take an
    # hour and say little, so the short subset is the default there.
    quick = args.quick or not (gpu or args.all)
    selected = _select(args, cases, quick)
    note = {"reference": "no GPU kernel backend: 'ours' is the reference composite of native "
                         "MLX ops, so both sides are MLX timings on this device",
            "emulator": "kernels run by the CPU emulator: correctness only"}
    print(f"mlx_metaltile {mt.__version__}  mlx {mx.__version__}  device: {device}  "
          f"backend: {backend}")
    if backend in note:
        print(f"note: {note[backend]}")
    if quick and not args.quick:
        print("note: no GPU here: the short subset of shapes (--all runs every shape)")
    unit, scale = _unit(backend)
    print("legend: " + legend(timed, iters, batch, untimed_reason, unit))
    cols = _columns(timed, peak, unit)
    widths = _widths([(c.op, c.label, c.dtype_name) for c in selected], timed, peak, unit)
    right = [r for _, r in cols]
    print(_show.format_row([c for c, _ in cols], widths, right), flush=True)
    meta = dict(device=device, device_slug=_device.device_slug(device), peak_gbps=peak,
                backend=backend, mlx_version=mx.__version__, package_version=mt.__version__,
                git_sha=_device.git_sha(), platform=platform.platform(),
                time=time.strftime("%Y-%m-%dT%H:%M:%S"), iters=iters, batch=batch,
                timed=timed, untimed_reason=untimed_reason)
    rng = np.random.default_rng(0)
    progress = Progress()
    results = []
    for i, case in enumerate(selected, 1):
        progress.show(f"[{i}/{len(selected)}] {case.id} ...")
        inputs = _measure.copies(case.make(rng), case.nbytes, args.rotate, gpu)
        out = case.ours(**inputs[0])
        mx.eval(out)
        err = _measure.error(case, out, inputs[0])
        row = dict(op=case.op, shape=case.label, dtype=case.dtype_name, backend=backend,
                   bytes=case.nbytes, flops=case.flops, max_err=err.abs, rel_err=err.rel,
                   err_over_tol=err.ratio, within_tolerance=err.ok)
        if timed:
            row.update(_timings(case, inputs, warmup, iters, batch, progress))
        results.append(row)
        if args.json:  # after every case: a run cut short keeps what it measured
            _save(args.json, meta, results)
        progress.clear()
        print(_show.format_row(_cells(row, timed, peak, scale), widths, right), flush=True)
        del inputs, out
    progress.clear()
    per_op = summary(results, peak) if timed else None
    if per_op is not None:
        print(f"\n{per_op}")
    if args.json:
        print(f"saved {len(results)} results to {args.json}")
    if args.plot:
        _plot(args, [(device, meta, results)])
    return 0 if all(r["within_tolerance"] for r in results) else 1


def _timings(case, inputs, warmup, iters, batch, progress) -> dict:
    """Ours and native timed in turns (``_measure.samples_in_turns``); ours alone where the
    native op fails on this backend."""
    native = None
    if case.native is not None:
        try:
            mx.eval(case.native(**inputs[0]))
        except Exception as exc:  # a native op missing on this backend is a result too
            progress.clear()
            print(f"{case.id}: native MLX failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            ours, native = _measure.samples_in_turns([case.ours, case.native], inputs, warmup,
                                                     iters, batch)
    if native is None:
        ours = _measure.samples(case.ours, inputs, warmup, iters, batch)
    t_ours = statistics.median(ours)
    t_native = statistics.median(native) if native else float("nan")
    us = [1e6 * t for t in ours]
    return dict(native_us=t_native * 1e6, ours_us=t_ours * 1e6, speedup=t_native / t_ours,
                gbps=case.nbytes / t_ours / 1e9, ours_min_us=min(us), ours_samples_us=us,
                native_min_us=min(native) * 1e6 if native else None,
                native_samples_us=[1e6 * t for t in native] if native else None)


# ---- check and kernels --------------------------------------------------------------------

def cmd_check(args) -> int:
    from mlx_metaltile import _check
    backend = backends.resolve_backend()
    if backend not in backends.KERNEL_BACKENDS:
        avail = backends.available_backends()
        usable = [b for b in backends.KERNEL_BACKENDS if avail[b] is None]
        print(f"error: no kernel backend selected ({mt.get_backend()!r} runs {backend!r} here, "
              "which has no kernels to check); " +
              (f"run with --backend {usable[0]}" if usable else "none can run here: " +
               "; ".join(f"{b}: {avail[b]}" for b in backends.KERNEL_BACKENDS)),
              file=sys.stderr)
        return 2
    print(f"mlx_metaltile {mt.__version__}  mlx {mx.__version__}  device: "
          f"{_device.device_name()}  backend: {backend}")
    print("each kernel variant run once on the smallest benchmark case that launches it, "
          "against the float64 oracle; err/tol = the largest error / its tolerance bound "
          "(<= 1 passes)")
    progress = Progress()
    results = _check.check_variants(backend, progress=progress.show)
    progress.clear()
    print(_check.table(results))
    failed = sum(r.status == "FAIL" for r in results)
    unchecked = sum(r.status == "unchecked" for r in results)
    passed = sum(r.status == "pass" for r in results)
    print(f"{passed} passed, {failed} failed, {unchecked} unchecked (no case launches them "
          f"here), {len(results) - passed - failed - unchecked} not on this backend")
    return 1 if failed else 0


def cmd_kernels(args) -> int:
    print("backends:")
    for name, reason in backends.available_backends().items():
        print(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print(f"auto runs: {backends.resolve_backend('auto')}")
    print(_show.kernels())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_metaltile", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="time every op against native MLX, check vs oracle")
    bench.add_argument("--op", action="append", help="only this op (repeatable)")
    bench.add_argument("--shape", action="append", metavar="TEXT",
                       help="only shapes whose label contains TEXT (repeatable)")
    bench.add_argument("--quick", action="store_true",
                       help="a short subset of shapes (the default on a CPU backend)")
    bench.add_argument("--all", action="store_true",
                       help="every shape, also on a CPU backend")
    bench.add_argument("--backend", choices=backends.BACKENDS, help="default: auto")
    bench.add_argument("--json", metavar="PATH", help="save results with device and versions")
    bench.add_argument("--plot", metavar="PNG", help="draw native/ours and %% of peak "
                       "bandwidth per case (needs matplotlib: the [plot] extra)")
    bench.add_argument("--from", dest="from_json", action="append", metavar="JSON",
                       help="print and plot saved results instead of running (repeatable: "
                       "several machines in one plot)")
    bench.add_argument("--iters", type=int, help="timed samples (default 20 on a GPU, 3 on "
                       "a CPU backend)")
    bench.add_argument("--warmup", type=int, help="untimed calls (default 3 on a GPU, 1 on "
                       "a CPU backend)")
    bench.add_argument("--batch", type=int, help="calls evaluated per sample (default 8 on a "
                       "GPU, 1 on a CPU backend)")
    bench.add_argument("--rotate", type=int, default=2,
                       help="at least this many input copies to rotate through")
    bench.set_defaults(fn=cmd_bench, parser=bench)
    check = sub.add_parser("check", help="run every kernel variant once against its float64 "
                           "oracle on the current kernel backend")
    check.add_argument("--backend", choices=backends.KERNEL_BACKENDS,
                       help="default: what auto runs here")
    check.set_defaults(fn=cmd_check, parser=check)
    kernels = sub.add_parser("kernels", help="the backends (with the reasons one cannot run) "
                             "and the kernel registry")
    kernels.set_defaults(fn=cmd_kernels, parser=kernels)
    from mlx_metaltile import model_bench, moe_bench

    model_bench.add_parser(sub)
    moe_bench.add_parser(sub)
    args = parser.parse_args(argv)
    # --backend holds for this command only (a caller's process keeps its own choice)
    backend = getattr(args, "backend", None)
    try:
        scope = mt.use_backend(backend) if backend else contextlib.nullcontext()
        with scope:
            return args.fn(args)
    except backends.BackendUnavailableError as exc:
        if backend and f"{backend!r} is unavailable" in str(exc):
            args.parser.error(str(exc))
        raise
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
