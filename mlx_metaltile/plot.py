"""Bench results as a picture: native/ours per case (top) and ours as a % of the device's peak
memory bandwidth (bottom), one colour per run, so several machines' baselines compare in
one figure. Needs matplotlib (``pip install "mlx-metaltile[plot]"``), imported only here.

    from mlx_metaltile import plot
    plot.save(plot.load(["bench/baselines/nvidia-h200.json"]), "h200.png")
"""

from __future__ import annotations

import json
import math

OPS_ORDER = ("gated_rms_norm", "fp4_qmm", "moe_gather_qmm", "expert_qmv", "expert_glu",
             "expert_down_combine", "moe_route", "sdpa_multi")
MARKERS = {"float16": "o", "bfloat16": "s", "float32": "^"}


class MissingMatplotlib(ImportError):
    pass


def require_matplotlib():
    """matplotlib's Figure class, or MissingMatplotlib saying how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingMatplotlib("plotting needs matplotlib: pip install matplotlib (or the "
                                "package's [plot] extra)") from exc
    return Figure


def load(paths) -> list[tuple[str, dict, list[dict]]]:
    """(label, meta, results) of each saved ``bench --json`` file."""
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        runs.append((str(path), data["meta"], data["results"]))
    return runs


def _label(name: str, meta: dict, names: list[str]) -> str:
    device = meta.get("device", name)
    label = f"{device} ({meta.get('backend', '?')}, {meta.get('git_sha', '?')})"
    return label if sum(n == device for n in names) <= 1 else f"{label} {name}"


NARROW_SECTION = 16  # cases: narrower sections' names may collide with a neighbour's


def figure(runs):
    """A matplotlib Figure of ``runs`` = [(name, meta, results), ...] (no pyplot: it works
    without a display)."""
    Figure = require_matplotlib()
    timed = [(n, m, r) for n, m, r in runs if m.get("timed", True)
             and any(x.get("ours_us") is not None for x in r)]
    if not timed:
        raise ValueError("[plot] no timed results: runs on the emulator record correctness "
                         "only")
    nbytes: dict[tuple, int] = {}  # every case of every run: grouped by op, then by size
    for _, _, results in timed:
        for r in results:
            nbytes.setdefault((r["op"], r["shape"], r["dtype"]), r.get("bytes", 0))
    order = {op: i for i, op in enumerate(OPS_ORDER)}
    cases = sorted(nbytes, key=lambda k: (order.get(k[0], len(order)), k[0], nbytes[k]))
    x_of = {k: i for i, k in enumerate(cases)}
    fig = Figure(figsize=(max(8.0, 0.055 * len(cases) + 4), 7.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    names = [m.get("device", n) for n, m, _ in timed]
    colours = [f"C{i}" for i in range(len(timed))]
    no_peak, ratios = [], [1.0]
    for (name, meta, results), colour in zip(timed, colours, strict=True):
        label = _label(name, meta, names)
        peak = meta.get("peak_gbps")
        if not peak:
            no_peak.append(label)
        for dtype, marker in MARKERS.items():
            rows = [r for r in results if r["dtype"] == dtype and r.get("ours_us")]
            ratio = [(x_of[(r["op"], r["shape"], r["dtype"])], r["speedup"]) for r in rows
                     if r.get("speedup") is not None and not math.isnan(r["speedup"])]
            ratios += [v for _, v in ratio]
            if ratio:
                top.scatter(*zip(*ratio, strict=True), s=14, marker=marker, color=colour,
                            alpha=0.8)
            if peak:
                bw = [(x_of[(r["op"], r["shape"], r["dtype"])], 100 * r["gbps"] / peak)
                      for r in rows]
                bottom.scatter(*zip(*bw, strict=True), s=14, marker=marker, color=colour,
                               alpha=0.8)
        top.scatter([], [], color=colour, label=label)  # one legend entry per run
    for dtype, marker in MARKERS.items():
        top.scatter([], [], marker=marker, color="grey", label=dtype)
    lo, hi = min(ratios), max(ratios)
    top.axhline(1.0, color="black", lw=0.8)
    top.set_yscale("log")
    ticks = [t for t in (0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20) if lo / 1.5 <= t <= hi * 1.5]
    top.set_yticks(ticks, [f"{t:g}" for t in ticks])
    top.minorticks_off()
    top.set_ylabel("native MLX time / ours\n(> 1: ours is faster)")
    top.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncols=len(timed) + 3,
               frameon=False)
    bottom.set_ylabel("ours: % of peak memory\nbandwidth (bytes moved / time)")
    bottom.set_ylim(bottom=0)
    if no_peak:
        bottom.text(0.01, 0.95, "peak bandwidth unknown: " + "; ".join(no_peak),
                    transform=bottom.transAxes, fontsize=8, va="top")
    # op sections: separators, names on the x axis
    starts = [i for i, k in enumerate(cases) if i == 0 or cases[i - 1][0] != k[0]]
    for ax in (top, bottom):
        for s in starts[1:]:
            ax.axvline(s - 0.5, color="grey", lw=0.6, ls=":")
        ax.grid(axis="y", alpha=0.3)
    ends = starts[1:] + [len(cases)]
    labels, lowered = [], False
    for s, e in zip(starts, ends, strict=True):
        # neighbouring narrow sections: every other name two lines lower, so none overlap
        lowered = e - s < NARROW_SECTION and not lowered
        labels.append(("\n\n" if lowered else "") + f"{cases[s][0]}\n({e - s} cases)")
    bottom.set_xticks([(s + e - 1) / 2 for s, e in zip(starts, ends, strict=True)], labels)
    top.tick_params(axis="x", length=0)
    bottom.tick_params(axis="x", length=0)
    bottom.set_xlabel("cases of each op in order of bytes moved")
    bottom.set_xlim(-1, len(cases))
    fig.suptitle("mlx-metaltile vs native MLX, per benchmark case")
    return fig


def save(runs, path: str) -> None:
    figure(runs).savefig(path, dpi=130)
