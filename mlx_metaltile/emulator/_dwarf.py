"""Call-site identities from a kernel module's debug information (ELF, DWARF 2-5).

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
for itself).
Only the standard sections are read (.debug_info, .debug_abbrev, .debug_line, .debug_ranges,
.debug_rnglists, .debug_addr, .debug_str_offsets); anything unexpected makes it return None.
"""

from __future__ import annotations

import struct
import zlib
from bisect import bisect_right
from pathlib import Path

_SHF_COMPRESSED = 0x800
_TAG_INLINED_SUBROUTINE = 0x1D
_AT_LOW_PC, _AT_HIGH_PC, _AT_RANGES = 0x11, 0x12, 0x55
_AT_ADDR_BASE, _AT_RNGLISTS_BASE = 0x73, 0x74

# DW_FORM_* with a fixed size (in bytes; "addr" and "offset" depend on the unit)
_FIXED = {0x0B: 1, 0x0C: 1, 0x11: 1, 0x25: 1, 0x29: 1,  # data1 flag ref1 strx1 addrx1
          0x05: 2, 0x12: 2, 0x26: 2, 0x2A: 2,           # data2 ref2 strx2 addrx2
          0x27: 3, 0x2B: 3,                             # strx3 addrx3
          0x06: 4, 0x13: 4, 0x1C: 4, 0x28: 4, 0x2C: 4,  # data4 ref4 ref_sup4 strx4 addrx4
          0x07: 8, 0x14: 8, 0x20: 8, 0x24: 8,           # data8 ref8 ref_sig8 ref_sup8
          0x1E: 16, 0x19: 0, 0x21: 0}                   # data16 flag_present implicit_const
_OFFSET_FORMS = {0x0E, 0x10, 0x17, 0x1D, 0x1F, 0x1F20, 0x1F21}  # strp ref_addr sec_offset ...
_ULEB_FORMS = {0x0F, 0x15, 0x1A, 0x1B, 0x22, 0x23, 0x1F01, 0x1F02}  # udata ref_udata strx ...


UNKNOWN = 0xFFFFFFFF


class _Unsupported(Exception):
    pass


def _uleb(b: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = b[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7


def _sleb(b: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = b[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            if byte & 0x40:
                result -= 1 << shift
            return result, i


def _sections(data: bytes) -> dict[str, bytes]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise _Unsupported("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + k * shentsize) for k in range(shnum)]
    strtab_off = headers[shstrndx][4]
    out = {}
    for name_off, _type, flags, _addr, off, size in headers:
        end = data.index(b"\0", strtab_off + name_off)
        name = data[strtab_off + name_off:end].decode()
        if not name.startswith(".debug_"):
            continue
        body = data[off:off + size]
        if flags & _SHF_COMPRESSED:
            ch_type, = struct.unpack_from("<I", body, 0)
            if ch_type != 1:  # ELFCOMPRESS_ZLIB
                raise _Unsupported(f"compressed section {name}")
            body = zlib.decompress(body[24:])
        out[name] = body
    return out


def _abbrevs(sec: bytes, off: int) -> dict[int, tuple[int, bool, list[tuple[int, int, int]]]]:
    table = {}
    i = off
    while True:
        code, i = _uleb(sec, i)
        if code == 0:
            return table
        tag, i = _uleb(sec, i)
        children = sec[i] != 0
        i += 1
        attrs = []
        while True:
            at, i = _uleb(sec, i)
            form, i = _uleb(sec, i)
            const = 0
            if form == 0x21:  # implicit_const
                const, i = _sleb(sec, i)
            if at == 0 and form == 0:
                break
            attrs.append((at, form, const))
        table[code] = (tag, children, attrs)


class _Unit:
    def __init__(self, version: int, addr_size: int, offset_size: int):
        self.version = version
        self.addr_size = addr_size
        self.offset_size = offset_size
        self.base = 0          # the unit's DW_AT_low_pc
        self.addr_base = 8
        self.rnglists_base = 0


def _read_form(b: bytes, i: int, form: int, const: int, u: _Unit) -> tuple[object, int]:
    """(value, next index); blocks and strings come back as None."""
    if form in _FIXED:
        n = _FIXED[form]
        if form == 0x21:
            return const, i
        if form == 0x19:
            return True, i
        if n in (1, 2, 4, 8):
            return int.from_bytes(b[i:i + n], "little"), i + n
        return None, i + n
    if form == 0x01:  # addr
        return int.from_bytes(b[i:i + u.addr_size], "little"), i + u.addr_size
    if form in _OFFSET_FORMS:
        n = u.offset_size if (form != 0x10 or u.version >= 3) else u.addr_size
        return int.from_bytes(b[i:i + n], "little"), i + n
    if form in _ULEB_FORMS:
        return _uleb(b, i)
    if form == 0x0D:  # sdata
        return _sleb(b, i)
    if form == 0x08:  # string
        return None, b.index(b"\0", i) + 1
    if form in (0x09, 0x18):  # block, exprloc
        n, i = _uleb(b, i)
        return None, i + n
    if form == 0x0A:
        return None, i + 1 + b[i]
    if form == 0x03:
        return None, i + 2 + int.from_bytes(b[i:i + 2], "little")
    if form == 0x04:
        return None, i + 4 + int.from_bytes(b[i:i + 4], "little")
    if form == 0x16:  # indirect
        real, i = _uleb(b, i)
        return _read_form(b, i, real, const, u)
    raise _Unsupported(f"DW_FORM 0x{form:x}")


def _addrx(secs: dict[str, bytes], u: _Unit, index: int) -> int:
    sec = secs.get(".debug_addr")
    if sec is None:
        raise _Unsupported("addrx without .debug_addr")
    at = u.addr_base + index * u.addr_size
    return int.from_bytes(sec[at:at + u.addr_size], "little")


def _ranges(secs: dict[str, bytes], u: _Unit, value: int, form: int) -> list[tuple[int, int]]:
    out = []
    base = u.base
    if u.version < 5:
        sec = secs.get(".debug_ranges", b"")
        i = value
        top = (1 << (8 * u.addr_size)) - 1
        while True:
            lo, hi = struct.unpack_from("<QQ" if u.addr_size == 8 else "<II", sec, i)
            i += 2 * u.addr_size
            if lo == 0 and hi == 0:
                return out
            if lo == top:
                base = hi
            else:
                out.append((base + lo, base + hi))
    sec = secs.get(".debug_rnglists", b"")
    i = value
    if form == 0x23:  # rnglistx: an index into the offsets table after rnglists_base
        at = u.rnglists_base + value * u.offset_size
        i = u.rnglists_base + int.from_bytes(sec[at:at + u.offset_size], "little")
    a = u.addr_size
    while True:
        kind = sec[i]
        i += 1
        if kind == 0:  # end_of_list
            return out
        if kind == 1:  # base_addressx
            x, i = _uleb(sec, i)
            base = _addrx(secs, u, x)
        elif kind in (2, 3):  # startx_endx, startx_length
            x, i = _uleb(sec, i)
            y, i = _uleb(sec, i)
            lo = _addrx(secs, u, x)
            out.append((lo, _addrx(secs, u, y) if kind == 2 else lo + y))
        elif kind == 4:  # offset_pair
            x, i = _uleb(sec, i)
            y, i = _uleb(sec, i)
            out.append((base + x, base + y))
        elif kind == 5:  # base_address
            base = int.from_bytes(sec[i:i + a], "little")
            i += a
        elif kind == 6:  # start_end
            lo, hi = int.from_bytes(sec[i:i + a], "little"), int.from_bytes(sec[i + a:i + 2 * a],
                                                                            "little")
            i += 2 * a
            out.append((lo, hi))
        elif kind == 7:  # start_length
            lo = int.from_bytes(sec[i:i + a], "little")
            n, i = _uleb(sec, i + a)
            out.append((lo, lo + n))
        else:
            raise _Unsupported(f"DW_RLE 0x{kind:x}")


def _inlined_instances(secs: dict[str, bytes]) -> list[tuple[int, int, int, int]]:
    """(lo, hi, depth, entry offset) for every address range of every inlined instance."""
    info = secs.get(".debug_info")
    abbrev = secs.get(".debug_abbrev")
    if info is None or abbrev is None:
        raise _Unsupported("no .debug_info")
    out = []
    cu = 0
    while cu < len(info):
        length, = struct.unpack_from("<I", info, cu)
        i = cu + 4
        offset_size = 4
        if length == 0xFFFFFFFF:
            length, = struct.unpack_from("<Q", info, i)
            i += 8
            offset_size = 8
        end = i + length
        version, = struct.unpack_from("<H", info, i)
        i += 2
        if version >= 5:
            unit_type, addr_size = info[i], info[i + 1]
            i += 2
            abbrev_off = int.from_bytes(info[i:i + offset_size], "little")
            i += offset_size
            if unit_type not in (1, 3):  # compile, partial: others hold no code ranges
                cu = end
                continue
        else:
            abbrev_off = int.from_bytes(info[i:i + offset_size], "little")
            i += offset_size
            addr_size = info[i]
            i += 1
        u = _Unit(version, addr_size, offset_size)
        table = _abbrevs(abbrev, abbrev_off)
        depth = 0
        first = True
        while i < end:
            die = i
            code, i = _uleb(info, i)
            if code == 0:
                depth -= 1
                continue
            tag, children, attrs = table[code]
            low = high = rng = None
            high_is_offset = False
            rng_form = 0
            for at, form, const in attrs:
                value, i = _read_form(info, i, form, const, u)
                if at == _AT_LOW_PC:
                    low = _addrx(secs, u, value) if form in (0x1B, 0x29, 0x2A, 0x2B, 0x2C,
                                                             0x1F01) else value
                elif at == _AT_HIGH_PC:
                    high = value
                    high_is_offset = form != 0x01
                elif at == _AT_RANGES:
                    rng, rng_form = value, form
                elif at == _AT_ADDR_BASE:
                    u.addr_base = value
                elif at == _AT_RNGLISTS_BASE:
                    u.rnglists_base = value
            if first:  # the unit's own entry: the base of its range lists
                u.base = low or 0
                first = False
            elif tag == _TAG_INLINED_SUBROUTINE:
                spans = []
                if low is not None and high is not None:
                    spans = [(low, low + high if high_is_offset else high)]
                elif rng is not None:
                    spans = _ranges(secs, u, rng, rng_form)
                out += [(lo, hi, depth, die) for lo, hi in spans if hi > lo]
            if children:
                depth += 1
        cu = end
    return out


def _line_rows(secs: dict[str, bytes]) -> list[tuple[int, object]]:
    """(address, row identity) for every line-table row; None marks the end of a sequence."""
    sec = secs.get(".debug_line")
    if sec is None:
        raise _Unsupported("no .debug_line")
    rows = []
    p = 0
    while p < len(sec):
        length, = struct.unpack_from("<I", sec, p)
        i = p + 4
        offset_size = 4
        if length == 0xFFFFFFFF:
            length, = struct.unpack_from("<Q", sec, i)
            i += 8
            offset_size = 8
        end = i + length
        version, = struct.unpack_from("<H", sec, i)
        i += 2
        addr_size = 8
        if version >= 5:
            addr_size = sec[i]
            i += 2
        header_length = int.from_bytes(sec[i:i + offset_size], "little")
        i += offset_size
        program = i + header_length
        min_inst = sec[i]
        i += 1
        if version >= 4:
            i += 1  # maximum_operations_per_instruction (1 outside VLIW targets)
        default_is_stmt = sec[i]
        line_base = struct.unpack_from("<b", sec, i + 1)[0]
        line_range, opcode_base = sec[i + 2], sec[i + 3]
        lengths = sec[i + 4:i + 4 + opcode_base - 1]
        del default_is_stmt
        i = program

        def reset():
            return 0, 1, 1, 0  # address, file, line, column

        addr, file, line, col = reset()
        while i < end:
            op = sec[i]
            i += 1
            if op >= opcode_base:
                adj = op - opcode_base
                addr += (adj // line_range) * min_inst
                line += line_base + adj % line_range
                rows.append((addr, (p, file, line, col)))
            elif op == 0:
                n, i = _uleb(sec, i)
                sub = sec[i]
                if sub == 1:  # end_sequence
                    rows.append((addr, None))
                    addr, file, line, col = reset()
                elif sub == 2:  # set_address
                    addr = int.from_bytes(sec[i + 1:i + n], "little")
                i += n
            elif op == 1:  # copy
                rows.append((addr, (p, file, line, col)))
            elif op == 2:
                x, i = _uleb(sec, i)
                addr += x * min_inst
            elif op == 3:
                x, i = _sleb(sec, i)
                line += x
            elif op == 4:
                file, i = _uleb(sec, i)
            elif op == 5:
                col, i = _uleb(sec, i)
            elif op == 8:  # const_add_pc
                addr += ((255 - opcode_base) // line_range) * min_inst
            elif op == 9:  # fixed_advance_pc
                addr += int.from_bytes(sec[i:i + 2], "little")
                i += 2
            elif op in (6, 7, 10, 11):
                pass
            else:  # set_isa or an opcode this reader does not know: skip its operands
                for _ in range(lengths[op - 1]):
                    _, i = _uleb(sec, i)
        del addr_size
        p = end
    return rows


def call_site_table(path: str | Path) -> tuple[list[int], list[int]] | None:
    """(starts, ids): code offset starts[k] up to starts[k + 1] has identity ids[k]. None
    when the module's debug information cannot be read."""
    try:
        secs = _sections(Path(path).read_bytes())
        instances = _inlined_instances(secs)
        rows = _line_rows(secs)
    except (_Unsupported, IndexError, KeyError, ValueError, struct.error, zlib.error):
        return None
    # Sweep the code once: at each boundary, the row in force and the inlined instances that
    # contain the address (innermost last).
    events: list[tuple[int, int, object]] = []  # (address, order, payload)
    for addr, row in rows:
        events.append((addr, 0 if row is None else 1, ("row", row)))
    for lo, hi, depth, die in instances:
        events.append((hi, 0, ("leave", (depth, die))))
        events.append((lo, 1, ("enter", (depth, die))))
    events.sort(key=lambda e: (e[0], e[1]))
    row = None
    active: dict[tuple[int, int], int] = {}
    ids: dict[object, int] = {}
    starts: list[int] = []
    values: list[int] = []
    k = 0
    while k < len(events):
        at = events[k][0]
        while k < len(events) and events[k][0] == at:
            kind, payload = events[k][2]
            if kind == "row":
                row = payload
            elif kind == "enter":
                active[payload] = active.get(payload, 0) + 1
            elif active.get(payload, 0) > 1:
                active[payload] -= 1
            else:
                active.pop(payload, None)
            k += 1
        key = (row, tuple(die for _, die in sorted(active)))
        ident = UNKNOWN if key == (None, ()) else ids.setdefault(key, len(ids))
        if not values or values[-1] != ident:
            starts.append(at)
            values.append(ident)
    return starts, values


def identity_at(table: tuple[list[int], list[int]], offset: int) -> int | None:
    """The identity of a code offset in a table from call_site_table (None before it)."""
    starts, values = table
    k = bisect_right(starts, offset) - 1
    return values[k] if k >= 0 else None
