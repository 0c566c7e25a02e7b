"""Readable views for a terminal and a notebook: text tables that fit their contents (with an
HTML form for Jupyter), the kernel registry and launch counts as tables, and the backend an
op call will actually run on."""

from __future__ import annotations

import html
from collections.abc import Sequence

from . import _registry, backends


def fit_widths(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    """Each column's width: its widest cell, header included."""
    return [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]


def format_row(cells: Sequence[str], widths: Sequence[int], right: Sequence[bool]) -> str:
    """One line of a table: cells padded to ``widths`` (right-aligned where ``right``)."""
    out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
    return "  ".join(out).rstrip()


class Table:
    """Rows of strings under a header; ``str()`` is aligned text, Jupyter shows HTML."""

    def __init__(self, header: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool] | None = None, title: str = ""):
        self.header = list(header)
        self.rows = [list(map(str, r)) for r in rows]
        self.right = list(right) if right is not None else [False] * len(self.header)
        self.title = title

    def __str__(self) -> str:
        widths = fit_widths(self.header, self.rows)
        lines = [self.title] if self.title else []
        lines.append(format_row(self.header, widths, self.right))
        lines += [format_row(r, widths, self.right) for r in self.rows]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def cell(tag, text, right):
            style = ' style="text-align:right"' if right else ' style="text-align:left"'
            return f"<{tag}{style}>{html.escape(text)}</{tag}>"
        head = "".join(cell("th", h, r) for h, r in zip(self.header, self.right, strict=True))
        body = "".join("<tr>" + "".join(cell("td", c, r) for c, r in
                                         zip(row, self.right, strict=True)) + "</tr>"
                       for row in self.rows)
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class KernelTable(tuple):
    """The kernel registry (a tuple of ``KernelSpec``) that prints as a table."""

    def table(self) -> Table:
        rows = [(s.name, s.template, ",".join(s.dtypes), ",".join(s.backends), s.geometry)
                for s in self]
        return Table(("kernel", "template", "dtypes", "backends", "geometry"), rows,
                     title=f"{len(self)} kernel variants")

    def __str__(self) -> str:
        return str(self.table())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


def kernels() -> KernelTable:
    """Every registered kernel variant, in registration order (shown as a table)."""
    return KernelTable(_registry.kernels())


def launches() -> Table:
    """How many times each kernel was launched in this process, per backend."""
    counts = {}
    for backend in backends.KERNEL_BACKENDS:
        for spec in _registry.kernels():
            n = backends.launch_count(spec.name, backend)
            if n:
                counts[(backend, spec.name)] = n
    rows = [(b, k, str(n)) for (b, k), n in counts.items()]
    return Table(("backend", "kernel", "launches"), rows, right=(False, False, True),
                 title="kernel launches in this process")


def current_backend() -> str:
    """The concrete backend the next op call on this thread runs on ('metal', 'cuda',
    'emulator' or 'reference'): ``get_backend()`` with ``auto`` resolved."""
    return backends.resolve_backend()


def launch_stats(stats) -> Table:
    """An emulator ``LaunchStats`` (``mlx_metaltile.emulator.last_launch_stats()``) as a table:
    the launch's counters, then the device bytes read and written per buffer."""
    rows = [(name, str(getattr(stats, name))) for name in
            ("kernel", "grid", "threadgroup", "threadgroups", "threads", "threadgroup_barriers",
             "simdgroup_barriers", "simd_collectives", "threadgroup_memory", "fiber_switches")]
    for buf in dict.fromkeys([*stats.bytes_read, *stats.bytes_written]):
        rows.append((f"bytes {buf}", f"read {stats.bytes_read.get(buf, 0):,}, written "
                                     f"{stats.bytes_written.get(buf, 0):,}"))
    return Table(("counter", "value"), rows, title="the emulator's last launch")
