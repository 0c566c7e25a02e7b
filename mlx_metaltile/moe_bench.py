"""``python -m mlx_metaltile moe-bench``: one MoE block, mlx-lm's vs patched, per token count.

Builds mlx-lm's own MoE block class (router + SwitchGLU, and Qwen3-Next's shared expert)
at a published model's shapes with random quantized weights in bfloat16, patches a shallow
copy of it (the same arrays), and times, interleaved in one run: mlx-lm's block (native),
the patched block forced onto its decode path (expert_glu + expert_down_combine) and forced
onto its prefill path (expert-sorted moe_gather_qmm), at each token count. Each sample
queues several block calls on different inputs (so different experts: weights come from
device memory, not a cache) and evaluates them together; the figure is the median sample
divided by the calls. The crossover of the two paths is the value to give
``mlx_metaltile.nn.PREFILL_MIN_PAIRS_PER_BACKEND`` for the backend measured.

Dispatches per block at one token are counted from MLX's graph (:func:`dispatches`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import platform
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

import mlx_metaltile as mt
from mlx_metaltile import _device, backends, model_bench
from mlx_metaltile import nn as mtnn

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
# arch -> mlx-lm's block class in mlx_lm.models.<arch>; shapes and quantization are
# model_bench.ARCHS' (Qwen3-30B-A3B: 128 experts, k=8, 2048 -> 768, affine 4-bit group 64;
# Qwen3-Next-80B-A3B: 512, k=10, 2048 -> 512 + a shared expert; gpt-oss-20b: 32, k=4,
# 2880 -> 2880, mxfp4 experts with biases, SwigluOAI; GLM-4.5-Air: 128, k=8, 4096 -> 1408
# + a shared expert, the router's own grouped top k of sigmoid scores).
BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen3_next": "Qwen3NextSparseMoeBlock",
          "gpt_oss": "MLPBlock", "glm4_moe": "MoE"}
# --quick: the same blocks shrunk (experts and k kept where the CPU allows)
QUICK = {
    "qwen3_moe": dict(hidden_size=128, moe_intermediate_size=64, num_experts=16),
    "qwen3_next": dict(hidden_size=128, moe_intermediate_size=64, num_experts=16,
                       shared_expert_intermediate_size=64),
    "gpt_oss": dict(hidden_size=128, intermediate_size=128, num_local_experts=8),
    "glm4_moe": dict(hidden_size=128, moe_intermediate_size=64, n_routed_experts=16),
}
PATHS = ("native", "decode", "prefill")
PIPELINED = ("native", "decode")  # also timed with each call handed over as it is built

# Primitives that run no kernel: views of their input (reshapes, slices and broadcasts of
# contiguous arrays, stop_gradient) and mx.custom_function's wrapper (the ops' VJPs),
# which shares its forward's output buffers.
_NO_DISPATCH = frozenset({"Reshape", "ExpandDims", "Squeeze", "Broadcast", "StopGradient",
                          "View", "Slice", "CustomTransforms"})


def _graph_primitives(arrays) -> list[str]:
    """The primitives of the arrays' unevaluated graph (``mx.export_to_dot``'s nodes)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return re.findall(r'label ="([A-Za-z_]+)', dot.getvalue())


def dispatches(fn, *args) -> Counter:
    """Kernel dispatches of ``fn(*args)`` by primitive name, from MLX's graph: every
    primitive of the lazy graph that runs a kernel (not in :data:`_NO_DISPATCH`), and on a
    backend that runs this package's kernels eagerly (the emulator) each launch, as
    "kernel:<name>", plus the graph its inputs had when launched (the emulator evaluates
    them then). The arguments must be evaluated; the result is left unevaluated."""
    found: Counter = Counter()
    eager = backends.resolve_backend() not in backends.GPU_BACKENDS
    call = backends.Prepared.__call__

    def counted(prepared, *arrays):
        if eager:
            found.update(_graph_primitives(prepared.bind(arrays)))
            found[f"kernel:{prepared.spec.op}"] += 1
        return call(prepared, *arrays)

    backends.Prepared.__call__ = counted
    try:
        out = fn(*args)
    finally:
        backends.Prepared.__call__ = call
    found.update(_graph_primitives(out if isinstance(out, list | tuple) else [out]))
    for name in _NO_DISPATCH:
        found.pop(name, None)
    return found


@dataclass
class Block:
    native: nn.Module  # mlx-lm's block
    patched: nn.Module  # a shallow copy of it (the same arrays), patched
    report: mt.PatchReport
    hidden: int
    top_k: int


def build_block(arch: str, quick: bool = False, dtype=mx.bfloat16) -> Block:
    """mlx-lm's MoE block of ``arch`` with random weights, and its patched copy."""
    config, (e_mode, e_gs, e_bits), (mode, gs, bits) = model_bench.ARCHS[arch]
    config = dict(config, model_type=arch, num_hidden_layers=1,
                  **(QUICK[arch] if quick else {}))
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(0)
    native = getattr(module, BLOCKS[arch])(module.ModelArgs.from_dict(config))
    native.set_dtype(dtype)
    experts = getattr(native, mtnn.moe_routing(type(native)).experts)
    for name in ("gate_proj", "up_proj", "down_proj"):  # the float experts are never made
        setattr(experts, name, model_bench._random_experts(getattr(experts, name), e_mode,
                                                           e_gs, e_bits))
    nn.quantize(native, group_size=gs, bits=bits, mode=mode,
                class_predicate=lambda _, m: type(m) is nn.Linear)
    native.eval()
    mx.eval(native.parameters())
    holder = nn.Module()  # patch walks a model's children: the copy is one
    holder.block = patched = copy.copy(native)  # the same children; replaced in the copy
    report = mt.patch(holder)
    if {e.kind for e in report.replaced} != {"moe_block", "switch_glu"}:
        raise RuntimeError(f"[moe-bench] the {arch} block was not patched whole:\n{report}")
    return Block(native, patched, report, config["hidden_size"],
                 getattr(native, mtnn.moe_routing(type(native)).top_k))


@contextlib.contextmanager
def forced_path(path: str):
    """Make patched SwitchGLUs take their decode or prefill path at every pair count on
    the backend in use ("auto": :func:`mlx_metaltile.nn.prefill_min_pairs` as set)."""
    if path == "auto":
        yield
        return
    with mtnn.backend_entry(mtnn.PREFILL_MIN_PAIRS_PER_BACKEND, backends.resolve_backend(),
                            0 if path == "prefill" else 1 << 62):
        yield


def _sample(fn, xs) -> float:
    """Seconds per call of ``fn`` over the queued inputs, evaluated together."""
    t = time.perf_counter()
    mx.eval([fn(x) for x in xs])
    mx.synchronize()
    return (time.perf_counter() - t) / len(xs)


def _pipelined(fn, xs) -> float:
    """Seconds per call of ``fn`` over the inputs, each call handed to ``mx.async_eval`` as
    soon as it is built, as mlx-lm's generate hands over a decode step: the host builds
    call i + 1 while the GPU runs call i."""
    t = time.perf_counter()
    for x in xs:
        mx.async_eval(fn(x))
    mx.synchronize()
    return (time.perf_counter() - t) / len(xs)


def routed_apart(block: Block, xs) -> tuple[int, int]:
    """Over the inputs' tokens: (how many moe_route gives another set of experts than
    mlx-lm's routing, how many of those have a tie at the k-th largest logit). On a tie
    mlx-lm's argpartition keeps whichever expert its partition leaves, moe_route the lower
    index, and the block's outputs then differ by that expert's share of the token."""
    routing = mtnn.moe_routing(type(block.native))
    apart = tied = 0
    if routing.router_ids:  # the router's own ids on both sides
        return apart, tied
    for x in xs:
        logits = getattr(block.native, routing.router)(x)
        ours, _ = routing.route(block.native, logits)
        theirs, _ = routing.mlx_lm_route(block.native, logits)
        k = ours.shape[-1]
        ranked = mx.sort(logits.astype(mx.float32).reshape(-1, logits.shape[-1]), axis=-1)
        boundary_tie = (ranked[:, -k] == ranked[:, -k - 1]) if k < logits.shape[-1] else (
            mx.zeros(ranked.shape[:1], dtype=mx.bool_))
        differs = (mx.sort(ours.reshape(-1, k), axis=-1)
                   != mx.sort(theirs.reshape(-1, k), axis=-1)).any(axis=-1)
        apart += differs.sum().item()
        tied += (differs & boundary_tie).sum().item()
    return apart, tied


def measure(block: Block, tokens: int, iters: int, reps: int) -> dict:
    """Median us per block call of each path at ``tokens`` tokens, and the largest
    difference of the patched paths' outputs from the native one."""
    xs = [mx.random.normal((1, tokens, block.hidden)).astype(mx.bfloat16)
          for _ in range(reps)]
    mx.eval(xs)
    calls = {"native": block.native, "decode": block.patched, "prefill": block.patched}
    want = block.native(xs[0]).astype(mx.float32)
    out = {"tokens": tokens, "pairs": tokens * block.top_k}
    for path in ("decode", "prefill"):
        with forced_path(path):
            got = block.patched(xs[0]).astype(mx.float32)
            out[f"{path}_max_diff"] = mx.abs(got - want).max().item()
    out["native_max_abs"] = mx.abs(want).max().item()
    out["routed_apart"], out["routed_apart_tied"] = routed_apart(block, xs)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(iters + 1):  # the first round warms up
        for path in PATHS[i % 3:] + PATHS[:i % 3]:  # each path first in turn
            with forced_path("auto" if path == "native" else path):
                t = _sample(calls[path], xs)
            if i:
                times[path].append(t)
    piped: dict[str, list[float]] = {p: [] for p in PIPELINED}
    for i in range(iters + 1):
        for path in PIPELINED[i % 2:] + PIPELINED[:i % 2]:
            with forced_path("auto" if path == "native" else path):
                t = _pipelined(calls[path], xs)
            if i:
                piped[path].append(t)
    for path in PATHS:
        out[f"{path}_us"] = 1e6 * sorted(times[path])[len(times[path]) // 2]
    for path in PIPELINED:
        out[f"{path}_pipelined_us"] = 1e6 * sorted(piped[path])[len(piped[path]) // 2]
    return out


def block_dispatches(block: Block) -> dict:
    """Dispatches of one block call at one token, native and patched (decode path), by
    primitive, from MLX's graph (:func:`dispatches`)."""
    x = mx.random.normal((1, 1, block.hidden)).astype(mx.bfloat16)
    mx.eval(x)
    native = dispatches(block.native, x)
    if backends.resolve_backend() not in backends.KERNEL_BACKENDS:
        return {"native": dict(native), "patched": None}  # its composites are not kernels
    with forced_path("decode"):
        patched = dispatches(block.patched, x)
    return {"native": dict(native), "patched": dict(patched)}


def switch_point(rows: list[dict]) -> int | None:
    """The fewest pairs from which the prefill path is faster at every count measured
    (None: the decode path is faster at the largest count)."""
    point = None
    for row in reversed(rows):
        if row["prefill_us"] >= row["decode_us"]:
            break
        point = row["pairs"]
    return point


def _table(rows: list[dict]) -> str:
    head = ("tokens", "pairs", "native us", "decode us", "prefill us", "auto",
            "native/best", "pipelined: native us", "decode us", "native/decode",
            "max|diff|/max|y|", "routed apart (tied)")
    body = []
    for r in rows:
        best = min(r["decode_us"], r["prefill_us"])
        diff = max(r["decode_max_diff"], r["prefill_max_diff"]) / r["native_max_abs"]
        body.append((str(r["tokens"]), str(r["pairs"]), f"{r['native_us']:.1f}",
                     f"{r['decode_us']:.1f}", f"{r['prefill_us']:.1f}", r["auto"],
                     f"{r['native_us'] / best:.2f}x", f"{r['native_pipelined_us']:.1f}",
                     f"{r['decode_pipelined_us']:.1f}",
                     f"{r['native_pipelined_us'] / r['decode_pipelined_us']:.2f}x",
                     f"{diff:.2g}", f"{r['routed_apart']} ({r['routed_apart_tied']})"))
    widths = [max(len(c[i]) for c in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in (head, *body))


def _count_line(counts: dict) -> str:
    short = Counter()  # mx.compile'd functions are named after all their ops: "Compiled"
    for name, n in counts.items():
        short["Compiled" if name.startswith("Compiled") else name] += n
    return f"{short.total()}: " + ", ".join(f"{k} x{v}" if v > 1 else k
                                            for k, v in sorted(short.items()))


def run(args) -> int:
    try:
        import mlx_lm
    except ImportError:
        print("moe-bench needs mlx-lm: pip install 'mlx-metaltile[mlx-lm]'", file=sys.stderr)
        return 2
    scope = mt.use_backend(args.backend) if args.backend else contextlib.nullcontext()
    with scope:
        return _run(args, mlx_lm.__version__)


def _run(args, mlx_lm_version: str) -> int:
    backend = backends.resolve_backend()
    gpu = backend in backends.GPU_BACKENDS
    iters = args.iters or (20 if gpu else 1)
    reps = args.reps or (8 if gpu else 1)
    tokens = sorted(set(args.tokens or TOKENS))  # ascending: switch_point reads them so
    device = _device.device_name()
    print(f"moe-bench  mlx {mx.__version__}  mlx-lm {mlx_lm_version}  device: {device}  "
          f"backend: {backend}  bfloat16  median of {iters} samples x {reps} calls"
          + ("  (--quick: shrunk shapes)" if args.quick else ""))
    if not gpu:
        print("NOTE: no GPU kernel backend here: the patched block runs "
              f"{backend} code, so these numbers are not kernel timings")
    results = {}
    for arch in args.arch or list(BLOCKS):
        block = build_block(arch, args.quick)
        counts = block_dispatches(block)
        rows = []
        for t in tokens:
            row = measure(block, t, iters, reps)
            row["auto"] = ("prefill" if row["pairs"] >= mtnn.prefill_min_pairs()
                           and block.patched[_experts(block)]._sorted_path_fits()
                           else "decode")
            rows.append(row)
        point = switch_point(rows)
        results[arch] = dict(rows=rows, dispatches=counts, switch_point_pairs=point,
                             prefill_min_pairs=mtnn.prefill_min_pairs())
        print(f"\n{arch} ({BLOCKS[arch]}): {block.top_k} of "
              f"{block.native[_experts(block)].up_proj.weight.shape[0]} experts, hidden "
              f"{block.hidden}")
        print(_table(rows))
        print(f"dispatches per block at 1 token (MLX graph): native "
              f"{_count_line(counts['native'])}")
        print("  patched (decode path) " + (_count_line(counts["patched"]) if counts["patched"]
                                            else f"n/a (the {backend} backend runs no kernels)"))
        print(f"prefill path faster from {point} pairs on" if point is not None else
              "decode path faster up to the largest count on", f"{backend} (PREFILL_MIN_PAIRS"
              f" in use: {mtnn.prefill_min_pairs()}; set "
              f"mlx_metaltile.nn.PREFILL_MIN_PAIRS_PER_BACKEND[{backend!r}])")
    if args.json:
        meta = dict(device=device, backend=backend, kernel_timings=gpu, quick=args.quick,
                    mlx_version=mx.__version__, mlx_lm_version=mlx_lm_version,
                    package_version=mt.__version__, git_sha=_device.git_sha(),
                    platform=platform.platform(), time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    iters=iters, reps=reps, dtype="bfloat16")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, blocks=results), f, indent=1)
        print(f"saved to {args.json}")
    return 0


def _experts(block: Block) -> str:
    return mtnn.moe_routing(type(block.native)).experts


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected token counts like 1,2,4, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return counts


def add_parser(sub) -> None:
    """The ``moe-bench`` subcommand of ``python -m mlx_metaltile``."""
    p = sub.add_parser("moe-bench", help="one MoE block, mlx-lm's vs patched (decode and "
                       "prefill paths), per token count")
    p.add_argument("--arch", action="append", choices=sorted(BLOCKS),
                   help="only this model's block (repeatable; default all)")
    p.add_argument("--tokens", type=_counts, help="comma-separated token counts (default "
                   + ",".join(map(str, TOKENS)) + ")")
    p.add_argument("--backend", choices=backends.BACKENDS, help="default: auto")
    p.add_argument("--iters", type=int, help="timed samples (default 20 on a GPU, 1 elsewhere)")
    p.add_argument("--reps", type=int, help="block calls queued per sample, each on its own "
                   "input (default 8 on a GPU, 1 elsewhere)")
    p.add_argument("--quick", action="store_true", help="shrunk shapes (a CPU check of the "
                   "code path)")
    p.add_argument("--json", metavar="PATH", help="save results with device and versions")
    p.set_defaults(fn=run, parser=p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_metaltile.moe_bench")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["moe-bench", *(argv if argv is not None else sys.argv[1:])])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
