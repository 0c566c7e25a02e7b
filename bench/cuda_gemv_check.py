"""The MoE decode GEMVs (expert_qmv, expert_glu, expert_down_combine) against their native
MLX composites, on a GPU backend, at the bench cases' model shapes, 1 and 4 tokens, bfloat16.

    MLX_METALTILE_BACKEND=cuda python bench/cuda_gemv_check.py [--tokens 1 4] [--only qwen3]
        [--samples 9] [--batch 20] [--no-oracle]

Native composites are what mlx-lm runs (mx.gather_qmm per projection; the activation; for
the down projection the score multiply and the sum over k). Each sample evaluates --batch
queued calls cycling through copies of the inputs (distinct buffers, so the rotation moves
more bytes than the L2 holds: mlx_metaltile/_measure.py); the median over --samples is
printed per call; 'x nat' is native us / ours us (above 1: ours is faster). GB/s counts the bytes a call must move: the selected experts' weights,
scales, biases (and expert biases) once, x and out once. err/tol is the largest
|ours - oracle| over the tolerance table's bound (float64 oracle from the math; <= 1
passes), for ours and native alike. Needs a GPU backend (cuda or metal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import mlx_metaltile as mt  # noqa: E402
from mlx_metaltile import backends  # noqa: E402
from mlx_metaltile._measure import copies, samples  # noqa: E402
from mlx_metaltile.cases import bound, to_f64  # noqa: E402
from mlx_metaltile.cases import expert_glu as glu_cases  # noqa: E402
from mlx_metaltile.cases.expert_down_combine import make_scores  # noqa: E402
from mlx_metaltile.cases.expert_glu import activate, bench_make, project  # noqa: E402

DTYPE = mx.bfloat16
SIZES = {"affine": (64, 4), "mxfp4": (32, 4)}  # mode -> (group_size, bits)
# (model, E, k, hidden D, expert width N, mode, activation, expert biases)
MODELS = (*glu_cases.SHAPES,
          ("mixtral-8x7b", 8, 2, 4096, 14336, "affine", "silu", False))


@dataclass(frozen=True)
class Case:
    op: str
    label: str
    inputs: dict  # flat: every array a top-level value, so the copies rotate all of them
    ours: object
    native: object
    oracle: object  # inputs -> (want, magnitude) in float64
    nbytes: int


def _selected_bytes(indices, *per_expert) -> int:
    """Bytes of the distinct selected experts' rows of each [E, ...] array given."""
    touched = len(np.unique(np.array(indices)))
    return touched * sum(a[0].nbytes for a in per_expert if a is not None)


def _linear(x, w, scales, biases, bias, indices, mode):
    """mlx-lm's QuantizedSwitchLinear at decode, x [..., 1, 1, K] or [..., k, 1, K]."""
    return glu_cases.switch_linear(x, w, scales, biases, bias, indices, mode)


def qmv_case(rng, model, tokens, shared) -> Case:
    label, n_experts, k, hidden, width, mode, _act, _bias = model
    n_in, n_out = (hidden, width) if shared else (width, hidden)
    gs, bits = SIZES[mode]
    experts, ids = bench_make(rng, E=n_experts, k=k, n_in=n_in, n_out=n_out, mode=mode,
                              bias=False, dtype=DTYPE, tokens=tokens)
    w, s, b, _ = experts(n_out, n_in)
    x_shape = (tokens, n_in) if shared else (tokens, k, n_in)
    x = mx.array(rng.standard_normal(x_shape, dtype=np.float32)).astype(DTYPE)
    inputs = dict(x=x, w=w, scales=s, biases=b, indices=ids)

    def ours(x, w, scales, biases, indices):
        return mt.expert_qmv(x, w, scales, biases, indices, group_size=gs, bits=bits,
                             mode=mode)

    def native(x, w, scales, biases, indices):
        xq = x[..., None, None, :] if shared else x[..., None, :]
        return mx.squeeze(_linear(xq, w, scales, biases, None, indices, mode), axis=-2)

    def oracle(x, w, scales, biases, indices):
        y, mag, _ = project(x, w, scales, biases, None, indices, mode, gs, bits)
        return y, mag

    nbytes = (_selected_bytes(ids, w, s, b) + x.nbytes + ids.size * n_out * DTYPE.size)
    name = f"{label}-{'up' if shared else 'down'}-{n_in}to{n_out}-{mode}"
    return Case("expert_qmv", name, inputs, ours, native, oracle, nbytes)


def glu_case(rng, model, tokens) -> Case:
    label, n_experts, k, hidden, width, mode, act, bias = model
    gs, bits = SIZES[mode]
    experts, ids = bench_make(rng, E=n_experts, k=k, n_in=hidden, n_out=width, mode=mode,
                              bias=bias, dtype=DTYPE, tokens=tokens)
    wg, sg, bg, cg = experts(width, hidden)
    wu, su, bu, cu = experts(width, hidden)
    x = mx.array(rng.standard_normal((tokens, hidden), dtype=np.float32)).astype(DTYPE)
    inputs = dict(x=x, wg=wg, sg=sg, bg=bg, cg=cg, wu=wu, su=su, bu=bu, cu=cu, indices=ids)

    def ours(x, wg, sg, bg, cg, wu, su, bu, cu, indices):
        return mt.expert_glu(x, wg, sg, bg, wu, su, bu, indices, bias_gate=cg, bias_up=cu,
                             activation=act, mode=mode, group_size=gs, bits=bits)

    def native(x, wg, sg, bg, cg, wu, su, bu, cu, indices):
        xe = mx.expand_dims(x, (-2, -3))
        u = _linear(xe, wu, su, bu, cu, indices, mode)
        g = _linear(xe, wg, sg, bg, cg, indices, mode)
        return glu_cases.native_activation(act)(u, g).squeeze(-2)

    def oracle(x, wg, sg, bg, cg, wu, su, bu, cu, indices):
        g, mg, _ = project(x, wg, sg, bg, cg, indices, mode, gs, bits)
        u, mu, _ = project(x, wu, su, bu, cu, indices, mode, gs, bits)
        want, dg, du = activate(g, u, act)
        return want, dg * mg + du * mu + np.abs(want)

    nbytes = (_selected_bytes(ids, wg, sg, bg, cg, wu, su, bu, cu) + x.nbytes
              + ids.size * width * DTYPE.size)
    return Case("expert_glu", f"{label}-{hidden}to{width}-{mode}", inputs, ours, native,
                oracle, nbytes)


def down_case(rng, model, tokens) -> Case:
    label, n_experts, k, hidden, width, mode, _act, bias = model
    gs, bits = SIZES[mode]
    experts, ids = bench_make(rng, E=n_experts, k=k, n_in=width, n_out=hidden, mode=mode,
                              bias=bias, dtype=DTYPE, tokens=tokens)
    w, s, b, c = experts(hidden, width)
    h = mx.array(rng.standard_normal((tokens, k, width), dtype=np.float32)).astype(DTYPE)
    inputs = dict(h=h, w=w, scales=s, biases=b, bias=c, indices=ids,
                  scores=make_scores(rng, (tokens, k), DTYPE))

    def ours(h, w, scales, biases, bias, indices, scores):
        return mt.expert_down_combine(h, w, scales, biases, indices, scores, bias=bias,
                                      mode=mode, group_size=gs, bits=bits)

    def native(h, w, scales, biases, bias, indices, scores):
        y = _linear(mx.expand_dims(h, -2), w, scales, biases, bias, indices, mode).squeeze(-2)
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

    def oracle(h, w, scales, biases, bias, indices, scores):
        y, mag, _ = project(h, w, scales, biases, bias, indices, mode, gs, bits)
        sc = to_f64(scores)[..., None]
        return (sc * y).sum(axis=-2), (np.abs(sc) * mag).sum(axis=-2)

    nbytes = (_selected_bytes(ids, w, s, b, c) + h.nbytes + tokens * hidden * DTYPE.size)
    return Case("expert_down_combine", f"{label}-{width}to{hidden}-{mode}", inputs, ours,
                native, oracle, nbytes)


def error_ratio(got, want, mag) -> float:
    """max |got - want| / bound over the elements (NaN counts as infinitely wrong)."""
    err = np.abs(to_f64(got) - want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isnan(err), np.inf, err / bound(want, DTYPE, mag))
    return float(np.max(ratio))


def median_us(fn, case: Case, n_samples: int, batch: int) -> float:
    rotation = copies(case.inputs, case.nbytes, min_rotate=2, gpu=True)
    times = samples(fn, rotation, warmup=3, iters=n_samples, batch=batch)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--only", default="",
                        help="run the cases whose 'op model' contains this")
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--batch", type=int, default=20, help="calls queued per sample")
    parser.add_argument("--no-oracle", action="store_true",
                        help="skip the float64 oracle (slow at Mixtral's shapes)")
    args = parser.parse_args()
    backend = backends.resolve_backend()
    if backend not in ("cuda", "metal"):
        print(f"needs a GPU backend (MLX_METALTILE_BACKEND=cuda or metal), got {backend!r}")
        return 2
    print(f"backend {backend}, device {mx.default_device()}, {DTYPE}, median of "
          f"{args.samples} samples x {args.batch} queued calls")
    head = (f"{'op':<20} {'case':<44} {'T':>2} {'native us':>10} {'ours us':>9} "
            f"{'x nat':>6} {'GB/s':>7} {'err/tol ours':>13} {'native':>7}")
    print(head)
    rng = np.random.default_rng(0)
    ok = True
    builders = (("expert_qmv", partial(qmv_case, shared=True)),
                ("expert_qmv", partial(qmv_case, shared=False)),
                ("expert_glu", glu_case), ("expert_down_combine", down_case))
    for tokens in args.tokens:
        for model in MODELS:
            for op, build in builders:
                if args.only not in f"{op} {model[0]}":
                    continue
                case = build(rng, model, tokens)
                ours = case.ours(**case.inputs)
                native = case.native(**case.inputs)
                mx.eval(ours, native)
                if args.no_oracle:
                    e_ours = e_native = float("nan")
                else:
                    want, mag = case.oracle(**case.inputs)
                    e_ours, e_native = (error_ratio(o, want, mag) for o in (ours, native))
                    ok = ok and e_ours <= 1.0
                t_native = median_us(case.native, case, args.samples, args.batch)
                t_ours = median_us(case.ours, case, args.samples, args.batch)
                print(f"{case.op:<20} {case.label:<44} {tokens:>2} {t_native:>10.1f} "
                      f"{t_ours:>9.1f} {t_native / t_ours:>6.2f} "
                      f"{case.nbytes / t_ours / 1e3:>7.0f} {e_ours:>13.3f} "
                      f"{e_native:>7.3f}", flush=True)
                del case, ours, native
    if not ok:
        print("FAIL: a result of ours is outside the tolerance table")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
