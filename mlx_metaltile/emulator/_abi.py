"""The binding to the emulator runtime's C interface, read from its one statement:
include/mt_emu/launch.h (structures, status codes, hazard kinds, ABI version)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import cffi

from ._errors import EmulatorError

LAUNCH_HEADER = Path(__file__).resolve().parent / "include" / "mt_emu" / "launch.h"


def _cdef_text() -> str:
    text = LAUNCH_HEADER.read_text()
    m = re.search(r"// ---- cdef begin\n(.*)// ---- cdef end", text, re.S)
    if m is None:
        raise EmulatorError(f"[emulator] {LAUNCH_HEADER} lacks its cdef markers")
    return m.group(1)


ffi = cffi.FFI()
ffi.cdef(_cdef_text())
# The constants (#define and enum values), without loading any library.
_consts = ffi.dlopen(None)
ABI_VERSION: int = _consts.MT_ABI_VERSION
MAX_BUFFERS: int = _consts.MT_MAX_BUFFERS
MAX_RAS: int = _consts.MT_MAX_RAS
MESSAGE_LEN: int = _consts.MT_MESSAGE_LEN
STATUS_OK: int = _consts.MT_STATUS_OK
STATUS_HAZARD: int = _consts.MT_STATUS_HAZARD
STATUS_ERROR: int = _consts.MT_STATUS_ERROR
STATUS_NEED_SITES: int = _consts.MT_STATUS_NEED_SITES
INIT_COPY: int = _consts.MT_INIT_COPY
INIT_POISON: int = _consts.MT_INIT_POISON
INIT_PATTERN: int = _consts.MT_INIT_PATTERN


def hazard_kind(name: str) -> int:
    """The value of MT_HZ_<name>."""
    return getattr(_consts, f"MT_HZ_{name}")


@functools.cache
def load_runtime(path: Path):
    """The runtime library at `path` (checked by the caller), with its ABI version checked.
    Its symbols stay local: kernel modules name it as a needed library (see _toolchain)."""
    lib = ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_LOCAL)
    if lib.mt_rt_abi_version() != ABI_VERSION:
        raise EmulatorError(f"[emulator] the runtime library {path} has ABI version "
                            f"{lib.mt_rt_abi_version()}, expected {ABI_VERSION}; delete it "
                            f"and it is rebuilt")
    return lib
