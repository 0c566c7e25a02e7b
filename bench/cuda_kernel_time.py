"""GPU kernel time per call of bench cases (no host launch in the figure), under Nsight
Compute, for comparing two revisions of a kernel on an NVIDIA GPU.

    ncu --csv --metrics gpu__time_duration.sum --profile-from-start off --log-file run.csv \\
        python bench/cuda_kernel_time.py [--op OP] [--shape TEXT] [--dtype NAME] [--calls 5] \\
        [--native] > run.txt
    python bench/cuda_kernel_time.py --parse run.txt before=old.csv after=run.csv

    ncu ... python bench/cuda_kernel_time.py --arch gpt_oss [--layers 4] [--context 1024]
    python bench/cuda_kernel_time.py --parse run.txt run=run.csv --kernels 8

``bench`` times the evaluation of queued calls, which at decode sizes is mostly the host's
launch; this script times the kernels alone. Per case (``cases()`` of the ops, as ``bench``
selects them; ``--native``: each case's native composite too, after ours, labelled
``<id>-native``): inputs made and two untimed calls, then a marker kernel, ``--calls`` calls
each evaluated, and another marker. Nsight Compute profiles what lies between
``cudaProfilerStart`` / ``Stop`` (through CuPy, where installed; without it drop
``--profile-from-start off`` and every kernel is profiled, the markers still delimit the
cases), with its defaults: caches flushed and clocks at base before each kernel. ``--parse``
sums ``gpu__time_duration`` between each case's markers over ``--calls`` (the float64 oracle
is not run: check results with ``bench``) and prints one column per log, in us.

``--arch``: the cases are model_bench's model at published shapes, one decode step (L 1)
and one verification step (L 4) after ``--context`` cached tokens, native then patched
(each step evaluated, its tokens then trimmed from the cache): the GPU time of a step with
no launch gaps, against its wall time in model-bench. ``--kernels N`` adds, per case, the
N kernels (by name) with the most time per call, so two sides' steps can be read kernel
by kernel.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

MARKER = re.compile(r"mt_case_(begin|end)_(\d+)")


def _marker(name: str, inp) -> None:
    """One launch of a one-thread kernel named ``name`` (``inp``: an evaluated float32
    array, so that no other kernel runs with it)."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=name, input_names=["inp"], output_names=["out"],
                                 source="out[0] = inp[0];")
    (out,) = kernel(inputs=[inp], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.float32])
    mx.eval(out)


def _timed_case(i: int, label: str, calls: int, call, zero, profiler) -> None:
    """Two untimed calls, then ``calls`` calls between case i's markers."""
    import mlx.core as mx

    for _ in range(2):
        call()
    mx.synchronize()
    if profiler is not None:
        profiler.profilerStart()
    _marker(f"mt_case_begin_{i}", zero)
    for _ in range(calls):
        call()
    _marker(f"mt_case_end_{i}", zero)
    mx.synchronize()
    if profiler is not None:
        profiler.profilerStop()
    print(f"case {i} {calls} {label}", flush=True)


def _profiler():
    try:
        from cupy.cuda import runtime as profiler
    except ImportError:
        profiler = None
    return profiler


def _arch_cases(arch: str, args, first: int, zero, profiler) -> int:
    """model_bench's model for ``arch``: its decode (L 1) and verification (L 4) steps,
    native then patched, as four cases numbered from ``first``; the next free number."""
    import mlx.core as mx

    import mlx_metaltile as mt
    from mlx_metaltile import model_bench as mb

    model, config = mb.build(arch, args.layers)
    vocab = config["vocab_size"]
    cache = mb._make_cache(model)
    mx.eval(model(mb._tokens(args.context, vocab, 1), cache=cache))

    def step(tokens):
        mx.eval(model(tokens, cache=cache))
        mb._rewind(cache, tokens.shape[1])

    i = first
    for side in ("native", "patched"):
        mt.patch(model) if side == "patched" else mt.unpatch(model)
        for L in (1, 4):
            tokens = mb._tokens(L, vocab, 2)
            _timed_case(i, f"{arch}-{side}-L{L}", args.calls, functools.partial(step, tokens),
                        zero, profiler)
            i += 1
    mt.unpatch(model)
    return i


def run(args) -> None:
    import mlx.core as mx
    import numpy as np

    from mlx_metaltile import backends
    from mlx_metaltile.cases import cases

    if backends.resolve_backend() != "cuda":
        sys.exit("cuda_kernel_time: needs the cuda backend (MLX's CUDA build and a GPU)")
    profiler, zero = _profiler(), mx.zeros((1,))
    mx.eval(zero)
    if args.arch:
        first = 0
        for arch in args.arch:
            first = _arch_cases(arch, args, first, zero, profiler)
        return
    chosen = [c for c in cases() if (not args.op or c.op in args.op)
              and (not args.shape or any(t in c.label for t in args.shape))
              and (not args.dtype or c.dtype_name in args.dtype)]
    if not chosen:
        sys.exit("cuda_kernel_time: no case matches")
    i = 0
    for n, case in enumerate(chosen):
        inputs = case.make(np.random.default_rng(n))
        mx.eval([v for v in inputs.values() if isinstance(v, mx.array)])
        sides = [("", case.ours)]
        if args.native and case.native is not None:
            sides.append(("-native", case.native))
        for suffix, fn in sides:
            _timed_case(i, case.id + suffix, args.calls,
                        lambda fn=fn, inputs=inputs: mx.eval(fn(**inputs)), zero, profiler)
            i += 1


UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernel_us(log: str, calls: dict[int, int]) -> dict[int, float]:
    """Nsight Compute's CSV (``--csv --metrics gpu__time_duration.sum``): us of kernel time
    per call of each case, the kernels between its markers summed."""
    return _totals(kernel_split(log, calls))


def _totals(split: dict[int, dict[str, float]]) -> dict[int, float]:
    return {case: sum(kernels.values()) for case, kernels in split.items()}


def short_name(kernel: str) -> str:
    """A kernel's name without its parameter list, return type and template arguments."""
    name = kernel.split("(", 1)[0].split("<", 1)[0].strip()
    return name.removeprefix("void ").strip()


def kernel_split(log: str, calls: dict[int, int]) -> dict[int, dict[str, float]]:
    """:func:`kernel_us` per kernel name (:func:`short_name`): {case: {name: us per
    call}}."""
    text = log[log.find('"ID"'):]
    out: dict[int, dict[str, float]] = {}
    case = None
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        mark = MARKER.search(row["Kernel Name"])
        if mark:
            case = int(mark.group(2)) if mark.group(1) == "begin" else None
            if case is not None:
                out[case] = {}
            continue
        if case is not None:
            unit = row["Metric Unit"]
            if unit not in UNITS:
                raise ValueError(f"cuda_kernel_time: unknown time unit {unit!r} in {row}")
            value = float(row["Metric Value"].replace(",", "")) * UNITS[unit]
            name = short_name(row["Kernel Name"])
            out[case][name] = out[case].get(name, 0.0) + value / calls[case]
    return out


def parse(args) -> None:
    names, calls = {}, {}
    for line in Path(args.parse[0]).read_text().splitlines():
        if line.startswith("case "):
            _, i, n, name = line.split(maxsplit=3)
            names[int(i)], calls[int(i)] = name, int(n)
    splits = []
    for spec in args.parse[1:]:
        label, path = spec.split("=", 1)
        splits.append((label, kernel_split(Path(path).read_text(), calls)))
    columns = [(label, _totals(split)) for label, split in splits]
    print("case | " + " | ".join(label for label, _ in columns))
    for i, name in sorted(names.items()):
        cells = [f"{col[i]:.1f}" if i in col else "-" for _, col in columns]
        print(f"{name} | " + " | ".join(cells))
    for label, split in splits if args.kernels else ():
        for i, name in sorted(names.items()):
            top = sorted(split.get(i, {}).items(), key=lambda kv: -kv[1])[:args.kernels]
            print(f"{label} {name}: " + ", ".join(f"{k} {us:.1f}" for k, us in top))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", action="append", help="only this op (repeatable)")
    p.add_argument("--shape", action="append", help="only labels containing TEXT")
    p.add_argument("--dtype", action="append", help="only this dtype (float16, ...)")
    p.add_argument("--calls", type=int, default=5, help="timed calls (steps) per case")
    p.add_argument("--native", action="store_true",
                   help="also each case's native composite (a case of its own, after ours)")
    p.add_argument("--arch", action="append",
                   help="model_bench's model: its decode and verify steps (repeatable)")
    p.add_argument("--layers", type=int, default=4, help="--arch: decoder layers")
    p.add_argument("--context", type=int, default=1024, help="--arch: cached tokens")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="--parse: also the N kernels with the most time per case")
    p.add_argument("--parse", nargs="+", metavar=("RUN_TXT", "LABEL=CSV"),
                   help="print us per call from a run's stdout and ncu logs")
    args = p.parse_args(argv)
    parse(args) if args.parse else run(args)


if __name__ == "__main__":
    main()
