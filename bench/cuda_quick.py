"""Quick timing of gated_rms_norm on MLX's CUDA backend against the native MLX composite.

    python bench/cuda_quick.py [--json out.json]

Providers: ``metaltile`` (the MSL kernel through mlx_metaltile.cuda), ``mlx_native``
(``mx.fast.rms_norm(y, w, eps) * silu(z)``) and ``mlx_native_compiled`` (the same under
``mx.compile``). Each timed step evaluates ``BATCH`` independent calls on rotating input
buffers (more bytes than the L2 cache holds); only ``mx.eval`` of the already built graph is
timed, and the median over repeats of the time per call is reported. Bytes moved: y, z and w read once, out written once.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import time

import mlx.core as mx
import mlx.nn as nn

import mlx_metaltile as mt

SHAPES = ((4096, 128), (32, 4096), (4096, 4096))
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
PEAK_GBS = {"H100": 3350.0, "H200": 4800.0}  # published HBM bandwidth (DESIGN.md)
ROTATE_BYTES = 512 * 2**20
BATCH, REPEATS = 20, 15


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def peak_for(name: str) -> float | None:
    return next((v for k, v in PEAK_GBS.items() if k in name), None)


def time_provider(fn, sets, w) -> float:
    """Median seconds per call."""
    for i in range(3):
        mx.eval(fn(*sets[i % len(sets)], w))
    samples, k = [], 0
    for _ in range(REPEATS):
        outs = []
        for _ in range(BATCH):  # build the lazy graph first: only its evaluation is timed
            y, z = sets[k % len(sets)]
            outs.append(fn(y, z, w))
            k += 1
        start = time.perf_counter()
        mx.eval(outs)
        samples.append((time.perf_counter() - start) / BATCH)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    eps = 1e-5
    native = lambda y, z, w: mx.fast.rms_norm(y, w, eps) * nn.silu(z)  # noqa: E731
    compiled = mx.compile(native)

    def fused(y, z, w):
        with mt.use_backend("cuda"):
            return mt.gated_rms_norm(y, z, w, eps=eps)

    name = device_name()
    peak = peak_for(name)
    rows = []
    for dtype in DTYPES:
        for m, n in SHAPES:
            size = mx.zeros((1,), dtype).itemsize
            moved = (3 * m * n + n) * size
            count = max(2, min(256, math.ceil(ROTATE_BYTES / (2 * m * n * size))))
            sets = [(mx.random.normal((m, n)).astype(dtype), mx.random.normal((m, n)).astype(dtype))
                    for _ in range(count)]
            w = mx.random.normal((n,)).astype(dtype)
            mx.eval(sets, w)
            err = mx.max(mx.abs(fused(*sets[0], w).astype(mx.float32)
                                - native(*sets[0], w).astype(mx.float32))).item()
            for provider, fn in (("metaltile", fused), ("mlx_native", native),
                                 ("mlx_native_compiled", compiled)):
                sec = time_provider(fn, sets, w)
                gbs = moved / sec / 1e9
                rows.append(dict(provider=provider, rows=m, n=n, dtype=str(dtype).split(".")[-1],
                                 us=sec * 1e6, bytes=moved, gbs=gbs,
                                 pct_peak=100 * gbs / peak if peak else None,
                                 max_abs_diff_vs_native=err))
            del sets
    result = dict(device=name, peak_gbs=peak, mlx=mx.__version__, python=platform.python_version(),
                  batch=BATCH, repeats=REPEATS, results=rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    print(f"device: {name}   mlx {mx.__version__}   peak {peak} GB/s")
    print(f"{'dtype':9} {'shape':>11} {'provider':20} {'us':>9} {'GB/s':>8} {'%peak':>6} "
          f"{'vs native':>9}")
    for r in rows:
        base = next(x for x in rows if x["provider"] == "mlx_native" and x["rows"] == r["rows"]
                    and x["n"] == r["n"] and x["dtype"] == r["dtype"])
        pct = f"{r['pct_peak']:.0f}" if r["pct_peak"] is not None else "-"
        print(f"{r['dtype']:9} {r['rows']:>5}x{r['n']:<5} {r['provider']:20} {r['us']:9.1f} "
              f"{r['gbs']:8.0f} {pct:>6} {base['us'] / r['us']:8.2f}x")


if __name__ == "__main__":
    main()
