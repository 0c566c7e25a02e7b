"""moe_gather_qmm and fp4_qmm on the CUDA backend: half / bfloat fragments (tensor cores) against
the float fragments the kernels staged before, and against native MLX.

    MLX_METALTILE_BACKEND=cuda python bench/cuda_fragments_check.py [--iters 20]
        [--dtype bfloat16 float16] [--m 128 512]

Cases: the bench cases of mlx_metaltile/cases/ (moe_gather_qmm, fp4_qmm) whose rows M are
in --m, in the dtypes of --dtype. For each, three calls on the same inputs: ours (the
simdgroup kernel as it is: x and the weights staged as T fragments where exact, see the
templates' STAGING), ours with the staging type forced to float (the former kernel, built
through backends.template_override under its own name) and native MLX (mx.gather_qmm /
mx.quantized_matmul). Each result is compared with the case's float64 oracle before it is
timed: "err" is the max |got - oracle|, "/tol" that over the tolerance bound of the
largest-error element (<= 1 passes; native MLX rounds differently and may exceed it).
Times: median seconds per call over --iters samples of 8 queued calls, on rotating copies
of the inputs. Exit status 1 if one of ours is out of tolerance.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from mlx_metaltile import _device, _measure, backends  # noqa: E402
from mlx_metaltile.cases import fp4_qmm as fp4_cases  # noqa: E402
from mlx_metaltile.cases import moe_gather_qmm as moe_cases  # noqa: E402

# op -> (its simdgroup kernel's spec, the edit that stages float fragments again)
FLOAT_STAGING = {
    "moe_gather_qmm": (importlib.import_module("mlx_metaltile.ops.moe_gather_qmm").SIMDGROUP_SPEC,
                       ("typedef typename mt_moe_staging<T>::type S;", "typedef float S;")),
    "fp4_qmm": (importlib.import_module("mlx_metaltile.ops.fp4_qmm").SIMDGROUP_SPEC,
                ("typedef typename mt_fp4_staging<T, SCALE_MODE>::type S;", "typedef float S;")),
}
BATCH, WARMUP = 8, 3


def _rows(label: str) -> int | None:
    found = re.search(r"(?:^|-)M(\d+)-", label)
    return int(found.group(1)) if found else None


def _select(ms, dtypes):
    cases = moe_cases.bench_cases() + fp4_cases.bench_cases()
    return [c for c in cases if _rows(c.label) in ms and c.dtype_name in dtypes]


def _measure_call(case, fn, inputs, iters, timed):
    """(error against the oracle, median seconds per call or nan)."""
    out = fn(**inputs[0])
    mx.eval(out)
    err = _measure.error(case, out, inputs[0])
    if not timed:
        return err, float("nan")
    return err, statistics.median(_measure.samples(fn, inputs, WARMUP, iters, BATCH))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--m", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"],
                        choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    backend = backends.resolve_backend()
    untimed = _measure.EAGER.get(backend) or (
        "no GPU kernel backend" if backend == "reference" else None)
    if backend != "cuda":
        print(f"note: backend {backend!r}, not cuda (set MLX_METALTILE_BACKEND=cuda)"
              + (f": not timed ({untimed})" if untimed else ""))
    cases = _select(set(args.m), set(args.dtype))
    if not cases:
        print(f"no bench case with M in {args.m} and dtype in {args.dtype}")
        return 1
    print(f"device: {_device.device_name()}  backend: {backend}  mlx {mx.__version__}  "
          f"iters {args.iters} x {BATCH} calls")
    head = (f"{'op':15s} {'case':42s} {'dtype':8s} | {'T frag ms':>9s} {'err':>8s} {'/tol':>5s} "
            f"| {'float ms':>9s} {'/tol':>5s} | {'native ms':>9s} {'/tol':>5s} "
            f"| {'T/float':>7s} {'T/native':>8s}")
    print(head)
    print("-" * len(head))
    rng = np.random.default_rng(0)
    failed = False
    for case in cases:
        inputs = _measure.copies(case.make(rng), case.nbytes, 2, backend in ("cuda", "metal"))
        ours, t_ours = _measure_call(case, case.ours, inputs, args.iters, not untimed)
        spec, edit = FLOAT_STAGING[case.op]
        with backends.template_override(spec, edit):
            flt, t_flt = _measure_call(case, case.ours, inputs, args.iters, not untimed)
        try:
            nat, t_nat = _measure_call(case, case.native, inputs, args.iters, not untimed)
            nat_tol = f"{nat.ratio:5.2f}"
        except Exception as exc:  # a native op missing on this backend is a result too
            print(f"{case.id}: native MLX failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            t_nat, nat_tol = float("nan"), "  -  "
        failed |= not (ours.ok and flt.ok)
        print(f"{case.op:15s} {case.label:42s} {case.dtype_name:8s} | {t_ours * 1e3:9.3f} "
              f"{ours.abs:8.2e} {ours.ratio:5.2f} | {t_flt * 1e3:9.3f} {flt.ratio:5.2f} | "
              f"{t_nat * 1e3:9.3f} {nat_tol} | {t_flt / t_ours:6.2f}x {t_nat / t_ours:7.2f}x",
              flush=True)
        del inputs
    print("T/float: speed-up of T fragments over float fragments (same kernel otherwise); "
          "T/native: ours against native MLX (> 1: ours faster)")
    if failed:
        print("FAILED: a kernel of ours is out of tolerance (/tol > 1)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
