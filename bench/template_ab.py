"""Variants of kernel templates timed against each other and native MLX on a GPU backend,
each variant's kernels built from its edited template text.

    python bench/template_ab.py --variants FILE [--op OP] [--shape TEXT] [--dtype NAME] \\
        [--rounds 10]

FILE is Python that defines ``VARIANTS = {name: variant}``, the first variant the
reference. A variant is a list of template edits ``[(template file, old, new), ...]`` (an
empty list: the templates as they are), or a dict with such a list under ``"edits"`` and
plan constants under ``"set"``: ``{"mlx_metaltile.ops.sdpa_multi.MMA_SIMDGROUPS": 2}``, each
module attribute set for the variant's calls and put back after (an op's plan reads its
constants when it is built, and each variant's plans are built afresh). Per bench case
(``cases()`` of the ops, selected as ``bench`` selects them), the sides are sampled as
``bench`` samples them (``_measure.samples_in_turns``: one sample of 8 queued calls per side
and round, the order reversed every other round). Each call of a variant is built with the
op's plans forgotten and the variant's edits applied through ``backends.override_template``
(every kernel of an edited template, built before or not, is built from the edited text),
so the graph it queues holds that variant's kernels. (Applied with ``_templates.override``
alone, a call would launch the kernels built before: every variant would time the same.)
A variant's edited kernels are built once and kept for its later calls, as the unedited
ones are, so that no side's timed evaluations launch kernel objects built for them.
Printed per case: native's median us, each variant's, and each variant's largest |difference|
from the reference's output on the same inputs, taken from its last timed call (the check that
an edit meant to keep the results does, and that the variant ran). Speed only: ``bench`` checks results against the float64 oracles.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import runpy
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

BATCH = 8  # calls per sample, as bench on a GPU


def applied(variant, kept: dict | None = None) -> contextlib.ExitStack:
    """A context holding ``variant`` (module docstring): its edits through
    ``backends.override_template``, one per template, and its plan constants set.
    ``kept``: the variant's own dict (one per variant, held across its calls): its edited
    kernels are built once and launched again call after call, as the unedited kernels are
    (built anew each call, a variant's kernels would pay a first launch's cost in every
    timed evaluation)."""
    from mlx_metaltile import backends

    if isinstance(variant, dict):
        edits, settings = variant.get("edits", ()), variant.get("set", {})
    else:
        edits, settings = variant, {}
    per_file: dict[str, list[tuple[str, str]]] = {}
    for filename, old, new in edits:
        per_file.setdefault(filename, []).append((old, new))
    stack = contextlib.ExitStack()
    try:
        for filename, pairs in per_file.items():
            own = None if kept is None else kept.setdefault(filename, {})
            stack.enter_context(backends.override_template(filename, *pairs, kept=own))
        for dotted, value in settings.items():
            module_name, name = dotted.rsplit(".", 1)
            module = importlib.import_module(module_name)
            stack.callback(setattr, module, name, getattr(module, name))  # it must exist
            setattr(module, name, value)
    except BaseException:  # an edit that does not apply, a constant that does not exist
        stack.close()
        raise
    return stack


def max_diff(a, b) -> float:
    """max |a - b|, a NaN on both sides counting as equal (an out-of-range id's row), on one
    side only as NaN."""
    import mlx.core as mx

    both = mx.isnan(a) & mx.isnan(b)
    return float(mx.max(mx.where(both, 0.0, mx.abs(a - b))).item())


def first_output(result):
    import mlx.core as mx

    out = result[0] if isinstance(result, (list, tuple)) else result
    return out.astype(mx.float32)


def time_variants(ours, native, inputs: list[dict], variants: dict, rounds: int,
                  batch: int = BATCH) -> tuple[dict[str, list[float]], dict[str, float]]:
    """({side: seconds per call, one per round}, {variant: max |output - reference's|}):
    ``native`` (None: not timed) and each variant of ``variants`` calling ``ours``, sampled
    in turns by ``_measure.samples_in_turns`` on the input sets ``inputs``. Each call of a
    variant is built inside its override with its plans built afresh, so the graph it
    queues holds that variant's kernels when the sample evaluates it. A variant's difference
    is taken from its last timed call against the reference variant's output for the same
    inputs: from a call timed, not from one made apart."""
    import mlx.core as mx

    from mlx_metaltile import _measure
    from mlx_metaltile.ops import _common

    names = list(variants)
    with applied(variants[names[0]]):
        _common.clear_plans()  # plans hold prepared launches of the kernels
        refs = [first_output(ours(**arrays)) for arrays in inputs]
        mx.eval(refs)
    last = {}

    kernels = {name: {} for name in names}  # each variant's edited kernels, kept

    def side(name):
        def call(**arrays):
            with applied(variants[name], kernels[name]):
                _common.clear_plans()  # the variant's plan constants
                out = ours(**arrays)
            last[name] = (arrays, out)
            return out
        return call

    sides = ([] if native is None else [("native", native)]) + [(n, side(n)) for n in names]
    samples = _measure.samples_in_turns([fn for _, fn in sides], inputs, 1, rounds, batch)
    _common.clear_plans()  # none built under a variant outlives it
    diffs = {}
    for name, (arrays, out) in last.items():
        at = next(i for i, given in enumerate(inputs)  # the input set by its arrays
                  if all(given[key] is value for key, value in arrays.items()))
        diffs[name] = max_diff(first_output(out), refs[at])
    return dict(zip((n for n, _ in sides), samples, strict=True)), diffs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", required=True, help="Python file defining VARIANTS")
    parser.add_argument("--op", action="append", help="ops (default: all)")
    parser.add_argument("--shape", action="append", help="cases whose label holds this text")
    parser.add_argument("--dtype", action="append", help="cases of this dtype name")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)

    import numpy as np

    from mlx_metaltile import _measure, backends
    from mlx_metaltile.cases import cases

    if backends.resolve_backend() not in ("cuda", "metal"):
        sys.exit("template_ab: needs a GPU backend (metal, or cuda: MLX's CUDA build)")
    variants = runpy.run_path(args.variants)["VARIANTS"]
    chosen = [c for c in cases() if (not args.op or c.op in args.op)
              and (not args.shape or any(t in c.label for t in args.shape))
              and (not args.dtype or c.dtype_name in args.dtype)]
    if not chosen:
        sys.exit("template_ab: no case matches")
    print("case | native | " + " | ".join(variants) + " | max |d| from "
          + next(iter(variants)))
    for n, case in enumerate(chosen):
        inputs = _measure.copies(case.make(np.random.default_rng(n)), case.nbytes, 2, True)
        times, diffs = time_variants(case.ours, case.native, inputs, variants, args.rounds)
        medians = [f"{np.median(t) * 1e6:.1f}" for t in times.values()]
        if case.native is None:
            medians.insert(0, "-")
        print(f"{case.id} | " + " | ".join(medians) + " | "
              + " ".join(f"{d:.1e}" for d in diffs.values()), flush=True)


if __name__ == "__main__":
    main()
