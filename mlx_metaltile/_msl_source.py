"""The source pre-pass shared by the non-Metal executors (emulator, CUDA layer).

MSL declares threadgroup memory at kernel scope (``threadgroup float tile[8][33];``) and uses
the same word as an address space on pointers (``threadgroup float* p``). A C++ or CUDA
compiler needs the two told apart: declarations become

    MT_THREADGROUP_ARRAY(name, dims, type...)

(e.g. ``MT_THREADGROUP_ARRAY(tile, [8][33], float)``), which each executor's header defines
(``__shared__ float tile[8][33]`` on CUDA; a per-threadgroup allocation on the emulator),
while every other ``threadgroup`` stays as it is for the executor's header to map.
Line numbers are preserved (one declaration stays on one line).
"""

from __future__ import annotations

import re

_DECL = re.compile(
    r"(?:^|(?<=[;{}]))(?P<ws>\s*)threadgroup\s+(?P<type>[^;=*&(){}]+?)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]+\]\s*)*);",
    re.M,
)


def rewrite_threadgroup_declarations(source: str) -> str:
    """Turn each ``threadgroup T name[dims];`` declaration into ``MT_THREADGROUP_ARRAY``."""

    def replace(m: re.Match) -> str:
        dims = re.sub(r"\s+", "", m.group("dims"))
        type_ = re.sub(r"\s+", " ", m.group("type").strip())
        # a declaration written over several lines keeps them (later line numbers hold)
        lines = m.group(0).count("\n") - m.group("ws").count("\n")
        return (f"{m.group('ws')}"
                f"MT_THREADGROUP_ARRAY({m.group('name')}, {dims}, {type_});" + "\n" * lines)

    return _DECL.sub(replace, source)


def threadgroup_declarations(source: str) -> list[tuple[str, str, str]]:
    """(name, dims, type) of each kernel-scope threadgroup declaration, in order."""
    return [(m.group("name"), re.sub(r"\s+", "", m.group("dims")), m.group("type").strip())
            for m in _DECL.finditer(source)]
