"""``python -m mlx_metaltile bench|kernels``: the benchmark table and the kernel registry."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt
from mlx_metaltile import _device, backends
from mlx_metaltile._registry import TOLERANCES

ROTATE_BYTES = 512 * 2**20  # bytes moved per rotation: several times any GPU's L2/SLC
COPY_BUDGET = 4 * 2**30  # memory the input copies may take
MAX_COPIES = 64


def _time(fn, inputs: list[dict], warmup: int, iters: int, batch: int) -> float:
    """Median seconds per call: each sample evaluates ``batch`` calls queued together (so
    launch latency overlaps as in model code), cycling through the input copies."""
    for i in range(warmup):
        mx.eval(fn(**inputs[i % len(inputs)]))
    times, k = [], 0
    for _ in range(iters):
        outs = []
        for _ in range(batch):  # build the lazy graph first: only its evaluation is timed
            outs.append(fn(**inputs[k % len(inputs)]))
            k += 1
        start = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def _copies(inputs: dict, case, min_rotate: int, gpu: bool) -> list[dict]:
    """Device copies of one input set, enough that the bytes a rotation touches exceed the
    last-level cache several times over (without exceeding COPY_BUDGET of memory); on a CPU
    backend only ``min_rotate``."""
    in_bytes = sum(v.nbytes for v in inputs.values() if isinstance(v, mx.array))
    wanted = -(-ROTATE_BYTES // max(case.nbytes, 1))
    fits = max(COPY_BUDGET // max(in_bytes, 1), 1)
    count = max(min_rotate, min(wanted, fits, MAX_COPIES)) if gpu else min_rotate
    copies = [inputs]
    for _ in range(count - 1):  # distinct buffers: the cache cannot serve one copy's lines
        copies.append({k: (v + 0 if isinstance(v, mx.array) and v.ndim else v)
                       for k, v in inputs.items()})
        mx.eval([v for v in copies[-1].values() if isinstance(v, mx.array)])
    return copies


def _error(case, got: mx.array, inputs: dict) -> tuple[float, bool]:
    """Max abs error vs the float64 oracle, and whether it is inside the tolerance table."""
    want = case.oracle(**inputs)
    got64 = _to_f64(got)
    tol = TOLERANCES[case.dtype_name]
    err = np.abs(got64 - want)
    mag = case.magnitude(**inputs) if case.magnitude is not None else np.abs(want)
    bound = tol.atol + tol.rtol * np.abs(want) + tol.accum * mag
    ok = bool(np.all(err <= bound))
    return float(np.nanmax(err)) if err.size else 0.0, ok


def _save(path: str, meta: dict, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)


def _to_f64(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    return np.array(a).astype(np.float64)


def cmd_bench(args) -> int:
    from mlx_metaltile._bench_cases import cases

    if args.backend:
        mt.set_backend(args.backend)
    backend = backends.resolve_backend()
    device = _device.device_name()
    peak = _device.peak_gbps(device)
    gpu = backend in ("metal", "cuda")
    iters = args.iters or (20 if gpu else 3)
    batch = args.batch or (8 if gpu else 1)
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    # Without a GPU the table times MLX's CPU composites: the full shape list would take an
    # hour and say little, so the short subset is the default there.
    quick = args.quick or not (gpu or args.all)
    selected = [c for c in cases(quick=quick) if (not args.op or c.op in args.op)
                and (not args.shape or any(part in c.label for part in args.shape))]
    print(f"mlx_metaltile {mt.__version__}  mlx {mx.__version__}  device: {device}  "
          f"backend: {backend}" + ("" if backend in ("metal", "cuda") else
                                   "  (no GPU kernel backend here: 'ours' is the "
                                   "reference composite)" if backend == "reference" else ""))
    header = (f"{'op':<16} {'shape':<22} {'dtype':<9} {'native us':>10} {'ours us':>10} "
              f"{'ratio':>6} {'GB/s':>8}" + (f" {'%peak':>6}" if peak else "") +
              f" {'max err':>9}  ok")
    if quick and not args.quick:
        print("(no GPU here: the short subset of shapes; --all runs every shape)")
    print(header)
    meta = dict(device=device, device_slug=_device.device_slug(device), peak_gbps=peak,
                backend=backend, mlx_version=mx.__version__, package_version=mt.__version__,
                git_sha=_device.git_sha(), platform=platform.platform(),
                time=time.strftime("%Y-%m-%dT%H:%M:%S"), iters=iters, batch=batch)
    rng = np.random.default_rng(0)
    results = []
    for i, case in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] {case.id} ...", end="\r", file=sys.stderr, flush=True)
        inputs = _copies(case.make(rng), case, args.rotate, gpu)
        out = case.ours(**inputs[0])
        mx.eval(out)
        err, ok = _error(case, out, inputs[0])
        t_ours = _time(case.ours, inputs, warmup, iters, batch)
        t_native = float("nan")
        if case.native is not None:
            try:
                t_native = _time(case.native, inputs, warmup, iters, batch)
            except Exception as exc:  # a native op missing on this backend is a result too
                print(f"{case.id}: native MLX failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
        gbps = case.nbytes / t_ours / 1e9
        row = dict(op=case.op, shape=case.label, dtype=case.dtype_name, backend=backend,
                   native_us=t_native * 1e6, ours_us=t_ours * 1e6,
                   speedup=t_native / t_ours, gbps=gbps, bytes=case.nbytes, flops=case.flops,
                   max_err=err, within_tolerance=ok)
        results.append(row)
        if args.json:  # after every case: a run cut short keeps what it measured
            _save(args.json, meta, results)
        line = (f"{case.op:<16} {case.label:<22} {case.dtype_name:<9} {row['native_us']:>10.1f} "
                f"{row['ours_us']:>10.1f} {row['speedup']:>6.2f} {gbps:>8.1f}")
        if peak:
            line += f" {100 * gbps / peak:>5.0f}%"
        print(f"{line} {err:>9.2e}  {'✓' if ok else '✗'}", flush=True)
        del inputs, out
    print(" " * 60, end="\r", file=sys.stderr)
    if args.json:
        print(f"saved {len(results)} results to {args.json}")
    return 0 if all(r["within_tolerance"] for r in results) else 1


def cmd_kernels(args) -> int:
    avail = backends.available_backends()
    print("backends: " + ", ".join(f"{k}{'' if v is None else ' (unavailable)'}"
                                   for k, v in avail.items()))
    print(f"{'kernel':<34} {'template':<34} {'dtypes':<27} geometry")
    for spec in mt.kernels():
        print(f"{spec.name:<34} {spec.template:<34} {','.join(spec.dtypes):<27} {spec.geometry}")
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
    bench.add_argument("--iters", type=int, help="timed samples (default 20 on a GPU, 3 on "
                       "a CPU backend)")
    bench.add_argument("--warmup", type=int, help="untimed calls (default 3 on a GPU, 1 on "
                       "a CPU backend)")
    bench.add_argument("--batch", type=int, help="calls evaluated per sample (default 8 on a "
                       "GPU, 1 on a CPU backend)")
    bench.add_argument("--rotate", type=int, default=2,
                       help="at least this many input copies to rotate through")
    bench.set_defaults(fn=cmd_bench)
    kernels = sub.add_parser("kernels", help="list the kernel registry")
    kernels.set_defaults(fn=cmd_kernels)
    from mlx_metaltile import model_bench

    model_bench.add_parser(sub)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
