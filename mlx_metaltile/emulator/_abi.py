"""The binding to the emulator runtime's C interface, read from its one statement:
include/mt_emu/launch.h (structures, status codes, hazard kinds, ABI version)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from ._errors import EmulatorError

LAUNCH_HEADER = Path(__file__).resolve().parent / "include" / "mt_emu" / "launch.h"


def _cdef_text() -> str:
    text = LAUNCH_HEADER.read_text()
    m = re.search(r"// ---- cdef begin\n(.*)// ---- cdef end", text, re.S)
    if m is None:
        raise EmulatorError(f"[emulator] {LAUNCH_HEADER} lacks its cdef markers")
    return m.group(1)


# Parsing the header takes tens of milliseconds: done on first use, not at import.
_NAMES = {
    "ABI_VERSION": "MT_ABI_VERSION", "MAX_BUFFERS": "MT_MAX_BUFFERS", "MAX_RAS": "MT_MAX_RAS",
    "MESSAGE_LEN": "MT_MESSAGE_LEN",
    "STATUS_OK": "MT_STATUS_OK", "STATUS_HAZARD": "MT_STATUS_HAZARD",
    "STATUS_ERROR": "MT_STATUS_ERROR", "STATUS_NEED_SITES": "MT_STATUS_NEED_SITES",
    "INIT_COPY": "MT_INIT_COPY", "INIT_POISON": "MT_INIT_POISON",
    "INIT_PATTERN": "MT_INIT_PATTERN",
}


@functools.cache
def _binding():
    """(ffi, constants): the cffi declarations, and the #define and enum values."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(_cdef_text())
    return ffi, ffi.dlopen(None)  # no library: only the constants are read from it


def __getattr__(name: str):
    """``ffi`` and the constants of _NAMES (ABI_VERSION, STATUS_HAZARD, ...)."""
    if name == "ffi":
        return _binding()[0]
    if name in _NAMES:
        return getattr(_binding()[1], _NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hazard_kind(name: str) -> int:
    """The value of MT_HZ_<name>."""
    return getattr(_binding()[1], f"MT_HZ_{name}")


@functools.cache
def load_runtime(path: Path):
    """The runtime library at `path` (checked by the caller), with its ABI version checked.
    Its symbols stay local: kernel modules name it as a needed library (see _toolchain)."""
    ffi, consts = _binding()
    lib = ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_LOCAL)
    if lib.mt_rt_abi_version() != consts.MT_ABI_VERSION:
        raise EmulatorError(f"[emulator] the runtime library {path} has ABI version "
                            f"{lib.mt_rt_abi_version()}, expected {consts.MT_ABI_VERSION}; "
                            f"delete it "
                            f"and it is rebuilt")
    return lib
