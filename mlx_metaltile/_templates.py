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

import re
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


@cache
def read_text(filename: str) -> str:
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
