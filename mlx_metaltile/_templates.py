"""MSL kernel templates: read from package data, split into header and body, cached.

A template file (``msl_templates/<kernel>.metal``) holds, in order:
  * a comment block with the math, the layouts and the DISPATCH INVARIANTS,
  * optional ``#include "<file>.h"`` lines naming other files of msl_templates/
    (inlined, once each, into the header),
  * optional helper code (goes to ``metal_kernel``'s ``header``),
  * the marker line ``// ---- kernel body ----``, then the body that
    ``metal_kernel`` wraps in its generated signature.
"""

from __future__ import annotations

import contextlib
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

BODY_MARKER = "// ---- kernel body ----"
_INCLUDE = re.compile(r'^\s*#include\s+"([\w.\-]+)"\s*$', re.M)
_SOURCE_DIR = Path(__file__).resolve().parent.parent / "msl_templates"


@dataclass(frozen=True)
class Template:
    name: str
    header: str
    body: str


def _root():
    """The installed package data if present, else the source checkout's msl_templates/."""
    try:
        root = resources.files("mlx_metaltile.msl_templates")
        if root.joinpath("common.h").is_file():
            return root
    except (ModuleNotFoundError, TypeError):
        pass
    return _SOURCE_DIR


# Template texts standing in for files (filename -> text), set by ``override`` only.
_OVERRIDES: dict[str, str] = {}


def read_text(filename: str) -> str:
    text = _OVERRIDES.get(filename)
    return _read_file(filename) if text is None else text


@cache
def _read_file(filename: str) -> str:
    path = _root().joinpath(filename)
    if not path.is_file():
        raise FileNotFoundError(f"[mlx_metaltile] no MSL template named {filename!r}")
    return path.read_text(encoding="utf-8")


def list_templates() -> list[str]:
    return sorted(p.name for p in _root().iterdir() if p.name.endswith((".metal", ".h")))


def _inline_includes(text: str, seen: set[str]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _inline_includes(read_text(name), seen)

    return _INCLUDE.sub(replace, text)


@cache
def render(filename: str) -> Template:
    """Split a template into (header, body) with its local includes inlined."""
    text = read_text(filename)
    if BODY_MARKER not in text:
        raise ValueError(f"[mlx_metaltile] template {filename} has no '{BODY_MARKER}' line")
    head, body = text.split(BODY_MARKER, 1)
    header = _inline_includes(head, set())
    if _INCLUDE.search(body):
        raise ValueError(f"[mlx_metaltile] template {filename}: #include belongs above the body")
    return Template(name=filename, header=header, body=body.strip("\n") + "\n")


def override_tag(filename: str) -> str:
    """'' for a template read from its file, else a tag naming the overriding text (kernels
    built from it carry it in their name: a Metal library is cached by kernel name)."""
    text = _OVERRIDES.get(filename)
    return "" if text is None else f"_override{zlib.crc32(text.encode()):08x}"


@contextlib.contextmanager
def override(filename: str, *edits: tuple[str, str]) -> Iterator[None]:
    """Inside: template ``filename`` reads as its text with each (old, new) edit applied in
    turn (each ``old`` must occur; every occurrence is replaced). An ``old`` found only in a
    header the template includes edits that header's text inlined into the template (the
    other kernels including the header keep it as it is). Nests. The text only: a kernel
    object built before is still launched; ``backends.override_template`` sets those aside."""
    text = read_text(filename)
    for old, new in edits:
        if old not in text:
            text = _inline_includes(text, set())
        if old not in text:
            raise ValueError(f"[mlx_metaltile] {old!r} does not occur in template {filename}")
        text = text.replace(old, new)
    saved = _OVERRIDES.get(filename)
    _OVERRIDES[filename] = text
    render.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            del _OVERRIDES[filename]
        else:
            _OVERRIDES[filename] = saved
        render.cache_clear()
