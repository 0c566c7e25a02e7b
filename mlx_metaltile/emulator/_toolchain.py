"""Compiling for the emulator: the host C++ compiler, the on-disk cache, the runtime library,
the precompiled header and the kernel modules.

Everything built is cached (``_cache``: where, who may write it, checked entries), keyed by a
hash of what went into it (compiler version, flags, runtime sources, kernel source).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from . import _abi, _cache
from ._errors import EmulatorError, KernelCompileError

PACKAGE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = PACKAGE_DIR / "include"
RUNTIME_SOURCE = PACKAGE_DIR / "src" / "runtime.cpp"  # a unity build of the files beside it
# Kernel modules are loaded with their symbols local; each names the runtime library (by its
# soname) as a needed library, which resolves to the copy already loaded.
MODULE_DLOPEN_MODE = ctypes.RTLD_LOCAL

# Kernel code: -O1 keeps compile time low; the thread-sanitizer instrumentation reports every
# load and store to the runtime (bounds checks, byte counters, threadgroup shadow memory);
# the bounds sanitizer checks indexing of fixed-size arrays (per-thread arrays, vectors);
# its handler is in the runtime (src/ubsan.inc);
# -g1 gives the line tables that map a faulting address back to the kernel's source line
# (read with pyelftools, in the compiler's default DWARF version);
# C++20 for std::source_location (barriers and SIMD functions are matched by source position,
# column included); MSL itself is C++17-based. Frame pointers let the runtime walk the call
# path of a thread waiting at a barrier or SIMD-group function (threads meet there only when
# they called it through the same chain of calls).
KERNEL_FLAGS = (
    "-std=c++20", "-O1", "-g1", "-fno-omit-frame-pointer", "-fPIC",
    "-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0",
    "-fsanitize=bounds", "-fno-sanitize-recover=bounds",
    "-fno-strict-aliasing", "-fwrapv", "-ffp-contract=off", "-fno-math-errno",
    "-fno-exceptions", "-fstack-clash-protection",
    "-Wno-attributes", "-Wno-unknown-pragmas",
)
RUNTIME_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-pthread")


def _compiler_candidates() -> list[str]:
    env = os.environ.get("MLX_METALTILE_CXX") or os.environ.get("CXX")
    return [env] if env else ["g++", "c++", "clang++"]


@functools.cache
def compiler() -> str | None:
    """Path of the C++ compiler the emulator uses, or None."""
    for name in _compiler_candidates():
        path = shutil.which(name)
        if path:
            return path
    return None


def unavailable_reason() -> str | None:
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return f"the emulator runs on Linux and macOS, not {sys.platform}"
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"the emulator supports x86-64 and arm64 hosts, not {platform.machine()}"
    if compiler() is None:
        wanted = " or ".join(_compiler_candidates())
        return f"no C++ compiler found (looked for {wanted}; set MLX_METALTILE_CXX)"
    try:
        root = _cache.root()
    except (_cache.CacheError, OSError) as e:
        return f"its cache cannot be used: {e}"
    return _runtime_unbuildable(compiler(), root)


_runtime_checked: dict[tuple[str, Path], str | None] = {}  # (compiler, cache) -> why not


def _runtime_unbuildable(cxx: str, root: Path) -> str | None:
    """Why the runtime library cannot be built, or None. A compiler may be present and still
    unable to build it (too old, no thread sanitizer, broken), so it is built here, once per
    compiler and cache folder in a process: from a warm cache this only checks the cached
    entry (milliseconds); the first time a toolchain is used it costs the build the first
    kernel would have paid."""
    key = (cxx, root)
    if key not in _runtime_checked:
        try:
            runtime_path()
            _runtime_checked[key] = None
        except _cache.CacheError as e:
            _runtime_checked[key] = f"its cache cannot be used: {e}"
        except (EmulatorError, OSError) as e:
            lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
            why = next((ln for ln in lines if "error" in ln), lines[-1] if lines else str(e))
            _runtime_checked[key] = (f"the C++ compiler {cxx} cannot build its runtime "
                                     f"library: {why}")
    return _runtime_checked[key]


@functools.cache
def _compiler_version() -> str:
    cxx = compiler()
    if cxx is None:
        raise EmulatorError(f"[emulator] {unavailable_reason()}")
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return out.stdout


@functools.cache
def runtime_sources_digest() -> str:
    files = sorted(p for p in [*INCLUDE_DIR.rglob("*"), *RUNTIME_SOURCE.parent.rglob("*")]
                   if p.is_file())
    parts = []
    for p in files:
        parts += [str(p.relative_to(PACKAGE_DIR)), p.read_bytes()]
    return _cache.digest(*parts)


@functools.cache
def toolchain_key() -> str:
    return _cache.digest(compiler() or "", _compiler_version(), " ".join(KERNEL_FLAGS),
                   " ".join(RUNTIME_FLAGS), runtime_sources_digest(), str(_abi.ABI_VERSION),
                   platform.machine())


def _failed(proc: subprocess.CompletedProcess, folder: Path) -> Exception | None:
    """The real cause of a failed compiler run outside the kernel's own code, if known."""
    if "No space left on device" in proc.stderr:
        return _cache.disk_full(folder)
    if "while reading precompiled header" in proc.stderr:
        return _cache.CacheError(f"[emulator] the precompiled header in the cache folder "
                                 f"{folder} cannot be read (corrupt): delete its pch-* folder "
                                 f"and it is rebuilt")
    return None


def _run(cmd: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise _failed(proc, cwd) or EmulatorError(f"[emulator] building {what} failed:\n"
                                                  f"{proc.stderr[-4000:]}")
    return proc


# The runtime library's own name, by which kernel modules linked against it name it.
_SONAME_FLAG = "-Wl,-install_name," if sys.platform == "darwin" else "-Wl,-soname,"


def _runtime_name() -> str:
    return f"mt_runtime-{toolchain_key()[:24]}.so"


_runtime_lock = threading.Lock()
_runtimes: dict[Path, Path] = {}  # cache folder -> its checked runtime library


def runtime_path() -> Path:
    """The emulator runtime library, built once per toolchain (checked once per process)."""
    root = _cache.folder("")
    with _runtime_lock:
        if root not in _runtimes:
            def build(tmp: Path) -> None:
                _run([compiler(), *RUNTIME_FLAGS, _SONAME_FLAG + _runtime_name(),
                      f"-I{INCLUDE_DIR}", str(RUNTIME_SOURCE), "-o", _runtime_name()], tmp,
                     "the emulator runtime")

            entry = _cache.entry(root, f"runtime-{toolchain_key()[:24]}", toolchain_key(), build)
            _runtimes[root] = entry / _runtime_name()
        return _runtimes[root]


@functools.cache
def runtime_library():
    """The loaded runtime library (a cffi library object), one per process: kernel modules
    built in any cache folder name it by its soname, which resolves to this copy."""
    return _abi.load_runtime(runtime_path())


_pch: dict[Path, Path] = {}


def precompiled_header() -> Path:
    """Folder holding mt_pch.h and its precompiled form (checked once per process)."""
    root = _cache.folder("")
    with _runtime_lock:
        if root not in _pch:
            def build(tmp: Path) -> None:
                (tmp / "mt_pch.h").write_text('#include "mt_emu/kernel.h"\n')
                proc = subprocess.run([compiler(), *KERNEL_FLAGS, f"-I{INCLUDE_DIR}", "-x",
                                       "c++-header", "mt_pch.h", "-o", "mt_pch.h.gch"], cwd=tmp,
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    # The headers themselves do not compile: report it (every kernel would
                    # fail), unless the cause is elsewhere.
                    raise _failed(proc, root) or EmulatorError(
                        f"[emulator] the runtime headers do not compile:\n"
                        f"{proc.stderr[-4000:]}")

            _pch[root] = _cache.entry(root, f"pch-{toolchain_key()[:24]}", toolchain_key(),
                                      build)
        return _pch[root]


_DIAG_FILE = re.compile(r"(?:(?<=\s)|^)(?:\./)?(body|header)\.metal:(\d+)(?::(\d+))?", re.M)
_KERNEL_CONTEXT = re.compile(r"^((?:body|header):\d+(?::\d+)?):\s+required from")
_ERROR = re.compile(r"^(?P<where>\S+?:\d+(?::\d+)?): (?:fatal )?error: (?P<what>.*)$")


def _map_diagnostics(stderr: str, name: str) -> tuple[str, str | None]:
    """Compiler output with the kernel's files named plainly, and the first error line.

    An error raised inside the runtime headers (a static_assert refusing an operand type,
    say) is headed by the kernel line whose call instantiated the header code."""
    lines = []
    first = None
    context = None  # the kernel line nearest the error in the current instantiation chain
    for line in stderr.splitlines():
        if "mt_pch.h" in line or "<command-line>" in line:
            continue
        line = _DIAG_FILE.sub(lambda m: f"{m.group(1)}:{m.group(2)}"
                              + (f":{m.group(3)}" if m.group(3) else ""), line)
        line = line.replace(str(INCLUDE_DIR) + "/", "")
        if "In instantiation of" in line:
            context = None
        elif context is None and (m := _KERNEL_CONTEXT.match(line)):
            context = m.group(1)
        if first is None and "error" in line:
            first = line.strip()
            m = _ERROR.match(first)
            if m and context and not m.group("where").startswith(("body:", "header:")):
                what = m.group("what").removeprefix("static assertion failed: ")
                first = f"{context}: error: {what}"
        lines.append(line)
    text = "\n".join(lines)
    if len(text) > 6000:
        text = text[:6000] + "\n... (truncated)"
    return text, first


def build_kernel(cpp: str, header: str, body: str, name: str) -> Path:
    """Compile one kernel instantiation into a shared module (cached, checked); return the
    module's path."""
    root = _cache.folder("kernels")
    source = _cache.digest(toolchain_key(), cpp, header, body)
    runtime = runtime_path()

    def build(tmp: Path) -> None:
        pch = precompiled_header()  # checked only when a kernel is compiled
        (tmp / "kernel.cpp").write_text(cpp)
        (tmp / "header.metal").write_text(header)
        (tmp / "body.metal").write_text(body)
        cmd = [compiler(), *KERNEL_FLAGS, f"-I{INCLUDE_DIR}", "-include", str(pch / "mt_pch.h"),
               f"-fdebug-prefix-map={tmp}=.", "-c", "kernel.cpp", "-o", "kernel.o"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            cause = _failed(proc, root)
            if cause is not None:
                raise cause
            text, first = _map_diagnostics(proc.stderr, name)
            raise KernelCompileError(f"[{name}] the kernel does not compile: "
                                     f"{first or 'see below'}\n{text}", kernel=name)
        # linked against the runtime: the module names it (by soname) as a needed library
        _run([compiler(), "-shared", "kernel.o", str(runtime), "-o", "kernel.so"], tmp,
             f"kernel {name}")
        os.unlink(tmp / "kernel.o")

    return _cache.entry(root, source[:24], source, build) / "kernel.so"
