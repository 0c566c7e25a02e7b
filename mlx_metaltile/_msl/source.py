"""Source rewrites of MSL kernel text. All are line-preserving, so compiler messages and
debug line tables name the kernel's lines.

``compact`` serves the GPU executors (Metal, the CUDA layer): MLX hashes a custom kernel's
whole source on every launch (its library / module key), so the templates' comments and
indentation cost time per call there. The emulator keeps them (its messages quote lines).

The other rewrites serve the non-Metal executors (emulator, CUDA layer).

Half and bfloat literals (``1.0h``, ``2bf``) have no C++ spelling: they become
``MT_HALF_LITERAL(1.0f)`` / ``MT_BFLOAT_LITERAL(2)``, which each executor's header defines.

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

# A string or character literal (kept as it is), or a comment (dropped).
_LITERAL_OR_COMMENT = re.compile(
    r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def compact(source: str) -> str:
    """``source`` without comments and without each line's leading and trailing blanks, line
    for line (a block comment leaves its line breaks)."""

    def replace(m: re.Match) -> str:
        text = m.group(0)
        if text.startswith("//"):
            return ""
        if text.startswith("/*"):
            return "\n" * text.count("\n") or " "
        return text

    text = _LITERAL_OR_COMMENT.sub(replace, source)
    return "\n".join(line.strip() for line in text.split("\n"))


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


_HALF_LITERAL = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)(h|H|bf|BF)\b")


def rewrite_literals(source: str) -> str:
    """Turn MSL half / bfloat literals into ``MT_HALF_LITERAL`` / ``MT_BFLOAT_LITERAL``."""

    def replace(m: re.Match) -> str:
        number = m.group(1)
        macro = "MT_HALF_LITERAL" if m.group(2) in ("h", "H") else "MT_BFLOAT_LITERAL"
        return f"{macro}({number}{'f' if '.' in number or 'e' in number.lower() else ''})"

    return _HALF_LITERAL.sub(replace, source)


def threadgroup_declarations(source: str) -> list[tuple[str, str, str]]:
    """(name, dims, type) of each kernel-scope threadgroup declaration, in order."""
    return [(m.group("name"), re.sub(r"\s+", "", m.group("dims")), m.group("type").strip())
            for m in _DECL.finditer(source)]
