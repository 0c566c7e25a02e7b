"""A kernel module's debug information (ELF, DWARF 2-5, read with pyelftools): the source
lines of a code address, and call-site identities.

``source_frames(line_table(path), offset)`` gives the inline chain of (file, line) of a code offset,
innermost first (what ``addr2line -i`` prints): the line-table row of the address, then the
call site of each inlined function containing it.

Threads meet at a barrier or SIMD-group function when they call it through the same chain of
call sites. The runtime sees that chain as return addresses (one per physical frame); the
compiler may have copied one call of the source into several places of the machine code
(jump threading, loop header copies, unrolling), so two different return addresses can be
one call of the source. This module gives every code address of a module an identity that
such copies share and distinct calls do not:

* the chain of inlined-function instances containing the address (DW_TAG_inlined_subroutine
  entries: one per inlined call of the source; a copy made after inlining stays inside the
  same instance, whose address ranges then cover both copies), and
* the line-table row of the address (file, line, column), which tells apart two calls of a
  function that was not inlined from the same function body.

``call_site_table(path)`` returns that identity as a step function over the module's code:
sorted start offsets and, for each, a small integer (equal integers: the same identity;
UNKNOWN for code the debug information does not describe, where an address can only stand
for itself). The integers are numbered in source order: within one function, a smaller
integer is a call written earlier (compared by the source positions of the inlined calls
containing the address, outermost first, then its own line and column; header.metal before
body.metal), which lets the runtime run the SIMD-group function written first when lanes
wait at different ones.
The debug information is read with pyelftools (imported on the first call: most kernels never
need the table); anything it cannot read makes it return None.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from pathlib import Path

UNKNOWN = 0xFFFFFFFF


def _spans(range_lists, cu, die, base: int) -> list[tuple[int, int]]:
    """The address ranges of a DIE (range_lists: the module's, or None; base: the DIE's unit's
    DW_AT_low_pc, which relative ranges start from)."""
    from elftools.dwarf.ranges import BaseAddressEntry

    attrs = die.attributes
    if "DW_AT_low_pc" in attrs and "DW_AT_high_pc" in attrs:
        low, high = attrs["DW_AT_low_pc"].value, attrs["DW_AT_high_pc"]
        # DW_FORM_addr(x): an address; a constant class form: the length of the range
        return [(low, high.value if high.form.startswith("DW_FORM_addr") else low + high.value)]
    if "DW_AT_ranges" not in attrs:
        return []
    if range_lists is None:
        raise ValueError("DW_AT_ranges without .debug_ranges or .debug_rnglists")
    out = []
    for entry in range_lists.get_range_list_at_offset(attrs["DW_AT_ranges"].value, cu):
        if isinstance(entry, BaseAddressEntry):
            base = entry.base_address
        elif entry.is_absolute:
            out.append((entry.begin_offset, entry.end_offset))
        else:
            out.append((base + entry.begin_offset, base + entry.end_offset))
    return out


def _code_scopes(die):
    """The entries below a DIE, but not those below a type or a declaration (no code there)."""
    for child in die.iter_children():
        yield child
        if not child.tag.endswith("_type") and "DW_AT_declaration" not in child.attributes:
            yield from _code_scopes(child)


def _position(program, file: int, line: int, column: int) -> tuple:
    """A source position that sorts in the kernel's text order: the header, the body, others."""
    name = _file_name(program, file) if program is not None else None
    return ({"header.metal": 0, "body.metal": 1}.get(name, 2), name or "", line, column)


def _read(path: str | Path) -> tuple[list[tuple[int, int, int]], list[tuple[int, object]],
                                     dict[int, tuple]]:
    """(lo, hi, DIE offset) for every address range of every inlined instance, (address,
    row identity) for every line-table row, None marking the end of a sequence, and the
    source position of each row identity and of each inlined instance's call."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        if not elf.has_dwarf_info(strict=True):
            raise ValueError("no .debug_info")
        dwarf = elf.get_dwarf_info(relocate_dwarf_sections=False, follow_links=False)
        if dwarf.debug_line_sec is None:
            raise ValueError("no .debug_line")
        range_lists = dwarf.range_lists()
        instances, rows, positions = [], [], {}
        for cu in dwarf.iter_CUs():
            top = cu.get_top_DIE()
            base = top.attributes["DW_AT_low_pc"].value if "DW_AT_low_pc" in top.attributes else 0
            program = dwarf.line_program_for_CU(cu)
            for die in _code_scopes(top):
                if die.tag == "DW_TAG_inlined_subroutine":
                    instances += [(lo, hi, die.offset)
                                  for lo, hi in _spans(range_lists, cu, die, base) if hi > lo]
                    a = die.attributes
                    positions[die.offset] = _position(
                        program, a["DW_AT_call_file"].value if "DW_AT_call_file" in a else -1,
                        *(a[k].value if k in a else 0
                          for k in ("DW_AT_call_line", "DW_AT_call_column")))
            if program is None:
                continue
            for entry in program.get_entries():
                s = entry.state
                if s is not None and not s.end_sequence:
                    row = (program.program_start_offset, s.file, s.line, s.column)
                    positions[row] = _position(program, s.file, s.line, s.column)
                    rows.append((s.address, row))
                elif s is not None:
                    rows.append((s.address, None))
    return instances, rows, positions


def call_site_table(path: str | Path) -> tuple[list[int], list[int]] | None:
    """(starts, ids): code offset starts[k] up to starts[k + 1] has identity ids[k]. None
    when the module's debug information cannot be read."""
    from elftools.common.exceptions import DWARFError, ELFError

    try:
        instances, rows, positions = _read(path)
    # (besides its own exceptions, pyelftools meets malformed input with these)
    except (ELFError, DWARFError, ArithmeticError, AssertionError, IndexError, KeyError,
            ValueError):
        return None
    # Sweep the code once: at each boundary, the row in force and the inlined instances that
    # contain the address.
    events: list[tuple[int, int, str, object]] = []  # (address, order, kind, payload)
    for addr, row in rows:
        events.append((addr, 0 if row is None else 1, "row", row))
    for lo, hi, die in instances:
        events.append((hi, 0, "leave", die))
        events.append((lo, 1, "enter", die))
    events.sort(key=lambda e: (e[0], e[1]))
    row = None
    active: Counter[int] = Counter()
    ids: dict[object, int] = {}
    starts: list[int] = []
    values: list[int] = []
    k = 0
    while k < len(events):
        at = events[k][0]
        while k < len(events) and events[k][0] == at:
            _, _, kind, payload = events[k]
            if kind == "row":
                row = payload
            elif kind == "enter":
                active[payload] += 1
            elif active[payload] > 1:
                active[payload] -= 1
            else:
                del active[payload]
            k += 1
        key = (row, tuple(sorted(active)))  # DIE offsets: the outermost instance first
        ident = UNKNOWN if key == (None, ()) else ids.setdefault(key, len(ids))
        if not values or values[-1] != ident:
            starts.append(at)
            values.append(ident)
    # Renumber in source order: the positions of the inlined calls containing the code
    # (outermost first), then its own line-table row (unknown parts last).
    last = (3, "", 0, 0)

    def source_order(item):
        (row, active), ident = item
        return ([positions.get(die, last) for die in active]
                + [positions.get(row, last) if row is not None else last], ident)

    rank = {ident: k for k, (_, ident) in enumerate(sorted(ids.items(), key=source_order))}
    return starts, [UNKNOWN if v == UNKNOWN else rank[v] for v in values]


def identity_at(table: tuple[list[int], list[int]], offset: int) -> int | None:
    """The identity of a code offset in a table from call_site_table (None before it)."""
    starts, values = table
    k = bisect_right(starts, offset) - 1
    return values[k] if k >= 0 else None


# ---- source lines ------------------------------------------------------------------------------

def _file_name(program, index: int) -> str | None:
    """The base name of file `index` of a line program (DWARF 5 counts files from 0)."""
    entries = program.header["file_entry"]
    k = index if program.header["version"] >= 5 else index - 1
    if not 0 <= k < len(entries):
        return None
    name = entries[k].name
    return Path(name.decode(errors="replace") if isinstance(name, bytes) else name).name


def _read_lines(path: str | Path):
    """(rows, calls): rows sorted by address as (address, file, line), file None at the end
    of a sequence; calls as (lo, hi, depth, file, line) for every address range of every
    inlined call (depth: how many inlined calls contain it)."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        if not elf.has_dwarf_info(strict=True):
            raise ValueError("no .debug_info")
        dwarf = elf.get_dwarf_info(relocate_dwarf_sections=False, follow_links=False)
        range_lists = dwarf.range_lists()
        rows, calls = [], []
        for cu in dwarf.iter_CUs():
            program = dwarf.line_program_for_CU(cu)
            if program is None:
                continue
            for entry in program.get_entries():
                st = entry.state
                if st is not None:
                    rows.append((st.address, None if st.end_sequence else
                                 _file_name(program, st.file), st.line))
            top = cu.get_top_DIE()
            base = top.attributes["DW_AT_low_pc"].value if "DW_AT_low_pc" in top.attributes else 0
            stack = [(top, 0)]
            while stack:
                die, depth = stack.pop()
                for child in die.iter_children():
                    if child.tag.endswith("_type") or "DW_AT_declaration" in child.attributes:
                        continue
                    inner = depth
                    if child.tag == "DW_TAG_inlined_subroutine":
                        inner = depth + 1
                        a = child.attributes
                        file = _file_name(program, a["DW_AT_call_file"].value) \
                            if "DW_AT_call_file" in a else None
                        line = a["DW_AT_call_line"].value if "DW_AT_call_line" in a else 0
                        calls += [(lo, hi, inner, file, line)
                                  for lo, hi in _spans(range_lists, cu, child, base) if hi > lo]
                    stack.append((child, inner))
    rows.sort(key=lambda r: (r[0], r[1] is not None))
    return rows, calls


def line_table(path: str | Path):
    """The source lines of a module's code, for source_frames; None when unreadable."""
    from elftools.common.exceptions import DWARFError, ELFError

    try:
        return _read_lines(path)
    except (OSError, ELFError, DWARFError, ArithmeticError, AssertionError, IndexError,
            KeyError, ValueError):
        return None


def source_frames(table, offset: int) -> tuple[tuple[str, int], ...]:
    """Inline chain (innermost first) of (file base name, line) for a code offset in a
    line_table; () for code the debug information does not describe."""
    rows, calls = table
    k = bisect_right(rows, offset, key=lambda r: r[0]) - 1
    if k < 0 or rows[k][1] is None:
        return ()
    frames = [(rows[k][1], rows[k][2])]
    for _lo, _hi, _depth, file, line in sorted((c for c in calls if c[0] <= offset < c[1]),
                                               key=lambda c: -c[2]):
        if file is not None:
            frames.append((file, line))
    return tuple(frames)
