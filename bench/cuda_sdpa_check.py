"""sdpa_multi against mx.fast.scaled_dot_product_attention on the CUDA backend, at decode and
verify shapes, with the split kernel's paths (MMA, vector, staged) side by side.

    python bench/cuda_sdpa_check.py [--variant mma vector staged]
        [--heads 32/8 16/2] [--dims 128 256] [--L 1 4 8] [--kv 1024 4096 16384]
        [--dtypes float16 bfloat16] [--iters 20] [--batch 8]
        [--vec-simdgroups-per-core 12] [--vec-min-keys 64] [--vec-max-splits 64]
        [--mma-min-rows 16] [--mma-min-queries 2] [--mma-simdgroups 4]
        [--mma-simdgroups-per-core 12] [--mma-simdgroups-per-core-pf0 8]
        [--mma-min-keys 128] [--mma-max-splits 64] [--mma-prefetch 1] [--mma-bounded 0]

Per case: native and ours in microseconds per call (median of --iters samples, each the
evaluation of --batch queued calls on rotating device copies of the inputs, as
``python -m mlx_metaltile bench`` times), native / ours, ours in GB/s (the visible K and V
once, q and the output once) and the largest error / tolerance bound against the float64
oracle (<= 1 passes the tolerance table). B = 1, full attention over kv_len = S keys.
--variant picks the split kernel's path (sdpa_multi.SPLIT_PATH["cuda"]; "mma" is the MMA
path where the plan takes it, from --mma-min-rows rows and --mma-min-queries queries, else
the vector path); several are timed in one run. "splits" is each path's KV slices. Needs
MLX's CUDA build and an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import mlx_metaltile as mt  # noqa: E402
from mlx_metaltile import backends  # noqa: E402
from mlx_metaltile._measure import copies, samples  # noqa: E402
from mlx_metaltile.cases import bound  # noqa: E402
from mlx_metaltile.cases.sdpa_multi import launch_counts, oracle  # noqa: E402
from mlx_metaltile.ops._common import clear_plans  # noqa: E402

op_module = importlib.import_module("mlx_metaltile.ops.sdpa_multi")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
BACKEND = "cuda"
TUNING = ("VEC_SIMDGROUPS_PER_CORE", "VEC_MIN_KEYS", "VEC_MAX_SPLITS", "MMA_MIN_ROWS",
          "MMA_MIN_QUERIES", "MMA_SIMDGROUPS", "MMA_SIMDGROUPS_PER_CORE",
          "MMA_SIMDGROUPS_PER_CORE_PF0", "MMA_MIN_KEYS", "MMA_MAX_SPLITS", "MMA_PREFETCH",
          "MMA_BOUNDED")


def error_ratio(out, want, limit) -> float:
    """Largest |ours - oracle| / tolerance bound (the tolerance table's, as the tests use)."""
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    err = np.abs(got - want)
    return float(np.max(np.where(np.isnan(err), np.inf, err / limit)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", nargs="+", default=["mma", "vector", "staged"],
                    choices=("mma", "vector", "staged"))
    ap.add_argument("--heads", nargs="+", default=["32/8", "16/2"])
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--L", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--kv", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=DTYPES)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    # the vector and MMA plans' tuning constants (ops/sdpa_multi.py), for sweeps: speed only
    for name in TUNING:
        ap.add_argument("--" + name.lower().replace("_", "-"), type=int,
                        default=getattr(op_module, name), help=f"sdpa_multi.{name}")
    args = ap.parse_args()
    for name in TUNING:
        setattr(op_module, name, getattr(args, name.lower()))
    why = backends.unavailable_reason(BACKEND)
    if why is not None:
        sys.exit(f"the {BACKEND} backend is unavailable here: {why}")
    with backends.use_backend(BACKEND):
        run(args)


def run(args) -> None:
    rng = np.random.default_rng(0)
    head = ["heads", "D", "L", "kv", "dtype", "native us"]
    for name in args.variant:
        head += [f"{name} splits", f"{name} us", f"{name} x", f"{name} GB/s", f"{name} err"]
    print(" | ".join(head))
    for heads, D, L, kv, dname in ((h, d, n, s, t) for h in args.heads for d in args.dims
                                   for n in args.L for s in args.kv for t in args.dtypes):
        Hq, Hkv = map(int, heads.split("/"))
        dtype = DTYPES[dname]
        scale = D ** -0.5

        def arr(shape, dtype=dtype):
            return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

        base = {"q": arr((1, Hq, L, D)), "k": arr((1, Hkv, kv, D)), "v": arr((1, Hkv, kv, D))}
        nbytes = sum(a.nbytes for a in base.values()) + base["q"].nbytes  # + the output
        inputs = copies(base, nbytes, 2, gpu=True)

        def native(q, k, v, scale=scale):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

        def ours(q, k, v, scale=scale):
            return mt.sdpa_multi(q, k, v, scale=scale)

        want, magnitude = oracle(base["q"], base["k"], base["v"], scale, False, kv)
        limit = bound(want, dtype, magnitude)
        t_native = statistics.median(samples(native, inputs, args.warmup, args.iters,
                                             args.batch))
        row = [heads, str(D), str(L), str(kv), dname, f"{t_native * 1e6:.1f}"]
        for name in args.variant:
            op_module.SPLIT_PATH[BACKEND] = name
            clear_plans()  # plans read SPLIT_PATH once
            pl = op_module.split_plan(BACKEND, 1, Hq, Hkv, L, D, kv, dtype)
            row.append(f"{pl['n_splits']}{'' if pl['path'] == name else ' ' + pl['path']}")
            before = launch_counts(BACKEND)
            out = ours(**base)
            mx.eval(out)
            assert launch_counts(BACKEND) == (before[0] + 1, before[1] + 1)
            err = error_ratio(out, want, limit)
            t = statistics.median(samples(ours, inputs, args.warmup, args.iters, args.batch))
            row += [f"{t * 1e6:.1f}", f"{t_native / t:.2f}", f"{nbytes / t / 1e9:.0f}",
                    f"{err:.2f}"]
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
