"""``metal_kernel`` for the emulator: argument handling as in MLX, buffers, the launch, hazard
reports and per-launch counters."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .._msl.dtypes import numpy_type
from .._msl.kernel import Launch, MetalKernel
from .._msl.signature import InputInfo, generate
from . import _dwarf, _toolchain
from ._errors import HAZARD_CLASSES, EmulatorError, KernelHazard
from ._translate import translate

MAX_BUFFERS = 64
MAX_RAS = 16


# ---- ctypes mirrors of the runtime's structures (src/runtime.cpp) ----------------------------

class _BufDesc(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("src", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("span", ctypes.c_uint64),
        ("data_off", ctypes.c_int64),
        ("elem_size", ctypes.c_uint32),
        ("init_kind", ctypes.c_int32),
        ("pattern", ctypes.c_uint8 * 16),
    ]


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("kernel", ctypes.c_char_p),
        ("nbuf", ctypes.c_int32),
        ("bufs", ctypes.POINTER(_BufDesc)),
        ("grid", ctypes.c_uint32 * 3),
        ("tg", ctypes.c_uint32 * 3),
        ("strict", ctypes.c_int32),
        ("shuffle", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("force_fibers", ctypes.c_int32),
        ("nworkers", ctypes.c_int32),
        ("stack_size", ctypes.c_uint64),
        ("timeout_s", ctypes.c_double),
        ("site_starts", ctypes.POINTER(ctypes.c_uint64)),
        ("site_ids", ctypes.POINTER(ctypes.c_uint32)),
        ("nsites", ctypes.c_int64),
        ("site_state", ctypes.c_int32),
    ]


class _LaunchResult(ctypes.Structure):
    _fields_ = [
        ("status", ctypes.c_int32),
        ("hazard_kind", ctypes.c_int32),
        ("message", ctypes.c_char * 4096),
        ("ras", ctypes.c_uint64 * MAX_RAS),
        ("nras", ctypes.c_int32),
        ("has_thread", ctypes.c_int32),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("thread", ctypes.c_uint32 * 3),
        ("thread_index", ctypes.c_uint32),
        ("fault_ra", ctypes.c_uint64),
        ("bytes_read", ctypes.c_uint64 * MAX_BUFFERS),
        ("bytes_written", ctypes.c_uint64 * MAX_BUFFERS),
        ("threadgroups", ctypes.c_uint64),
        ("threads", ctypes.c_uint64),
        ("threadgroup_barriers", ctypes.c_uint64),
        ("simdgroup_barriers", ctypes.c_uint64),
        ("simd_collectives", ctypes.c_uint64),
        ("fiber_switches", ctypes.c_uint64),
        ("threadgroup_memory", ctypes.c_uint64),
        ("used_fibers", ctypes.c_int32),
        ("used_site_ids", ctypes.c_int32),
    ]


# ---- settings -------------------------------------------------------------------------------

def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"[emulator] {name} must be an integer, got {value!r}") from None


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"[emulator] {name} must be a number, got {value!r}") from None


@dataclass
class Settings:
    """How launches run. Defaults come from the environment:
    MLX_METALTILE_EMULATOR_STRICT=1, MLX_METALTILE_EMULATOR_SHUFFLE_SEED=<int>,
    MLX_METALTILE_EMULATOR_WORKERS=<n>, MLX_METALTILE_EMULATOR_STACK_KB=<kib>,
    MLX_METALTILE_EMULATOR_TIMEOUT_S=<seconds> (0: no limit)."""

    strict: bool = field(default_factory=lambda: bool(_env_int(
        "MLX_METALTILE_EMULATOR_STRICT", 0)))
    shuffle_seed: int | None = field(default_factory=lambda: _env_int(
        "MLX_METALTILE_EMULATOR_SHUFFLE_SEED", None))
    workers: int = field(default_factory=lambda: _env_int(
        "MLX_METALTILE_EMULATOR_WORKERS", min(4, os.cpu_count() or 1)))
    stack_kb: int = field(default_factory=lambda: _env_int(
        "MLX_METALTILE_EMULATOR_STACK_KB", 128))
    timeout_s: float = field(default_factory=lambda: _env_float(
        "MLX_METALTILE_EMULATOR_TIMEOUT_S", 120.0))


_settings = Settings()
_UNSET = object()


def configure(*, strict=_UNSET, shuffle_seed=_UNSET, workers=_UNSET, stack_kb=_UNSET,
              timeout_s=_UNSET) -> Settings:
    """Change how later launches run; returns the previous settings.

    strict: also report reads of threadgroup memory never written since the threadgroup
      started, and shuffles that read an inactive lane.
    shuffle_seed: None for the natural order; an int permutes (deterministically) the order in
      which the threads of each threadgroup run and the order of the threadgroups, to expose
      kernels whose result depends on it.
    workers: threads running threadgroups concurrently. stack_kb: stack per kernel thread.
    timeout_s: a launch running longer raises KernelTimeout (an endless loop or a spin-wait);
      0 disables the limit.
    """
    global _settings
    previous = Settings(**vars(_settings))
    if strict is not _UNSET:
        _settings.strict = bool(strict)
    if shuffle_seed is not _UNSET:
        if shuffle_seed is not None and (isinstance(shuffle_seed, bool)
                                         or not isinstance(shuffle_seed, int)):
            raise TypeError(f"[emulator] shuffle_seed must be an int or None, "
                            f"got {type(shuffle_seed).__name__}")
        _settings.shuffle_seed = shuffle_seed
    if workers is not _UNSET:
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 16:
            raise ValueError(f"[emulator] workers must be an int in [1, 16], got {workers!r}")
        _settings.workers = workers
    if stack_kb is not _UNSET:
        if isinstance(stack_kb, bool) or not isinstance(stack_kb, int) or stack_kb < 16:
            raise ValueError(f"[emulator] stack_kb must be an int >= 16, got {stack_kb!r}")
        _settings.stack_kb = stack_kb
    if timeout_s is not _UNSET:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or timeout_s < 0:
            raise ValueError(f"[emulator] timeout_s must be a number >= 0, got {timeout_s!r}")
        _settings.timeout_s = float(timeout_s)
    return previous


def settings() -> Settings:
    return Settings(**vars(_settings))


# ---- counters -------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchStats:
    """What one launch did. Byte counts are per buffer (by parameter name: inputs, their
    _shape/_strides/_ndim buffers, outputs), counting every load and store the compiled
    kernel code executes (atomics count as a read and a write)."""

    kernel: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    threadgroups: int
    threads: int
    bytes_read: dict[str, int]
    bytes_written: dict[str, int]
    threadgroup_barriers: int  # barrier releases (one per threadgroup per barrier)
    simdgroup_barriers: int
    simd_collectives: int  # SIMD-group / quad-group function evaluations
    threadgroup_memory: int  # bytes of threadgroup arrays (largest over threadgroups)
    fiber_switches: int  # 0 when the kernel ran without fibers (no barrier/SIMD function)
    used_fibers: bool
    # threads waited at one barrier / SIMD-group function through different return addresses,
    # and the module's debug information told whether that was one call of the source
    call_sites_from_debug_info: bool = False


_last_stats: LaunchStats | None = None
_stats_lock = threading.Lock()


def last_launch_stats() -> LaunchStats | None:
    """Counters of the most recent emulator launch in this process (None before any)."""
    return _last_stats


# ---- source lines of code addresses ---------------------------------------------------------

# Source lines of hazards come from GNU binutils' addr2line (reading the module's DWARF line
# tables). Without it a hazard still names kernel, threadgroup and thread, and says why the
# line is missing.
ADDR2LINE = "addr2line"
NO_ADDR2LINE = ("source line unavailable: addr2line (GNU binutils) was not found; install "
                "binutils to see it")


def addr2line_missing() -> bool:
    return shutil.which(ADDR2LINE) is None


@functools.lru_cache(maxsize=4096)
def _addr2line(path: str, offset: int) -> tuple[tuple[str, int], ...]:
    """Inline chain (innermost first) of (file basename, line) for a code offset."""
    tool = shutil.which(ADDR2LINE)
    if tool is None:
        return ()
    proc = subprocess.run([tool, "-e", path, "-i", hex(offset)], capture_output=True, text=True)
    frames = []
    for line in proc.stdout.splitlines():
        loc = line.strip().split(" (discriminator")[0]
        if ":" not in loc:
            continue
        file, _, num = loc.rpartition(":")
        try:
            frames.append((os.path.basename(file), int(num)))
        except ValueError:
            continue
    return tuple(frames)


class _Module:
    """One compiled kernel instantiation."""

    def __init__(self, path: Path, header: str, body: str):
        """`header` and `body` as the kernel's author wrote them (the translation keeps their
        line numbers): hazards quote these lines."""
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.fn = ctypes.cast(self.lib.mt_kernel_thread, ctypes.c_void_p).value
        self.header_lines = header.splitlines()
        self.body_lines = body.splitlines()
        self.needs_fibers = False
        self._sites = None  # (starts, ids, count) once read; False: unreadable

    def call_site_table(self):
        """The call-site identities of this module's code, read from its debug information
        the first time a launch needs them: (starts, ids, count) as ctypes arrays, or False."""
        if self._sites is None:
            table = _dwarf.call_site_table(self.path)
            if table is None:
                self._sites = False
            else:
                starts, ids = table
                self._sites = ((ctypes.c_uint64 * len(starts))(*starts),
                               (ctypes.c_uint32 * len(ids))(*ids), len(starts))
        return self._sites

    def _frames(self, rt, ra: int) -> tuple[tuple[str, int], ...]:
        buf = ctypes.create_string_buffer(4096)
        off = ctypes.c_uint64(0)
        if not ra or not rt.mt_addr_info(ctypes.c_uint64(ra), buf, 4096, ctypes.byref(off)):
            return ()
        return _addr2line(buf.value.decode(), max(off.value - 1, 0))

    def callers(self, rt, ras) -> list[str]:
        """The kernel lines along a call path (return addresses, innermost first), innermost
        first, without the innermost one (the call itself): ["body line 5", ...]."""
        lines = []
        for ra in ras:
            for file, line in self._frames(rt, ra):
                if file in ("body.metal", "header.metal"):
                    where = f"{'body' if file == 'body.metal' else 'header'} line {line}"
                    if not lines or lines[-1] != where:
                        lines.append(where)
        return lines[1:]

    def locate(self, rt, ra: int) -> tuple[str | None, str | None]:
        """("body line 12", line text) for a return address in this module's code."""
        if not ra:
            return None, None
        frames = self._frames(rt, ra)
        if not frames:
            return None, None
        for file, line in frames:
            if file in ("body.metal", "header.metal"):
                where = "body" if file == "body.metal" else "header"
                lines = self.body_lines if where == "body" else self.header_lines
                text = lines[line - 1].strip() if 0 < line <= len(lines) else None
                return f"{where} line {line}", text
        if frames and frames[-1][0] == "kernel.cpp":
            return "the kernel's entry (setting up its local variables)", None
        if frames:
            return f"{frames[0][0]}:{frames[0][1]} (emulator runtime)", None
        return None, None


# ---- the kernel object ----------------------------------------------------------------------

def _host_view(arr: mx.array) -> np.ndarray:
    """A NumPy view of an evaluated array's memory (bfloat16 as uint16)."""
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    if numpy_type(arr.dtype) is None:
        raise TypeError(f"[metal_kernel] the emulator does not support dtype {arr.dtype}")
    return np.asarray(arr)


class EmulatedKernel(MetalKernel):
    """Callable like the object ``mx.fast.metal_kernel`` returns; runs on the emulator."""

    executor = "emulator"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._modules: dict[str, _Module] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<emulated metal_kernel {self.name!r}>"

    def _module(self, gen) -> _Module:
        with self._lock:
            mod = self._modules.get(gen.source)
            if mod is None:
                cpp, header, body = translate(gen)
                path = _toolchain.build_kernel(cpp, header, body, self.name)
                _toolchain.runtime_library()  # its symbols must be loaded first
                mod = _Module(path, gen.header, gen.body)
                self._modules[gen.source] = mod
            return mod

    def _run(self, launch: Launch) -> list[mx.array]:
        arrays, out_shapes, out_dtypes = launch.inputs, launch.output_shapes, launch.output_dtypes
        grid, threadgroup, template = launch.grid, launch.threadgroup, launch.template
        init_value, verbose = launch.init_value, launch.verbose
        mx.eval(*arrays)
        infos = [InputInfo(a.dtype, a.ndim, a.size) for a in arrays]
        gen = generate(self.name, self.input_names, self.output_names, self.source,
                       self.header, infos, out_dtypes, template, self.atomic_outputs)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{gen.source}\n```")
        mod = self._module(gen)
        return self._launch(mod, gen, arrays, out_shapes, out_dtypes, grid, threadgroup,
                            init_value)

    # -- buffers ---------------------------------------------------------------------------

    def _buffers(self, gen, arrays, out_shapes, out_dtypes, init_value):
        keep = []  # host memory that must outlive the launch
        descs = []
        outputs = []
        views = {}

        def add(name, src=None, dst=None, span=0, data_off=0, elem=1, init_kind=0,
                pattern=b""):
            d = _BufDesc()
            d.name = name.encode()
            d.src = src
            d.dst = dst
            d.span = span
            d.data_off = data_off
            d.elem_size = elem
            d.init_kind = init_kind
            for i, b in enumerate(pattern[:16]):
                d.pattern[i] = b
            descs.append(d)

        for p in gen.params:
            if p.kind == "input":
                view = _host_view(arrays[p.index])
                if self.ensure_row_contiguous and not view.flags.c_contiguous:
                    view = np.ascontiguousarray(view)
                views[p.index] = view
                keep.append(view)
                item = view.itemsize
                if view.size == 0:
                    add(p.name, elem=item)
                    continue
                dims = list(zip(view.shape, view.strides, strict=True))
                lo = sum(min(0, (n - 1) * s) for n, s in dims)
                hi = sum(max(0, (n - 1) * s) for n, s in dims) + item
                add(p.name, src=view.ctypes.data + lo, span=hi - lo, data_off=-lo, elem=item)
            elif p.kind in ("shape", "strides", "ndim"):
                view = views[p.index]
                if p.kind == "shape":
                    host = np.array(view.shape, dtype=np.int32)
                elif p.kind == "strides":
                    host = np.array([s // view.itemsize for s in view.strides], dtype=np.int64)
                else:
                    host = np.array(view.ndim, dtype=np.int32)
                keep.append(host)
                add(p.name, src=host.ctypes.data, span=host.nbytes, elem=host.itemsize)
            else:
                dtype = out_dtypes[p.index]
                if numpy_type(dtype) is None:
                    raise TypeError(f"[metal_kernel] the emulator does not support output "
                                    f"dtype {dtype}")
                host = np.empty(out_shapes[p.index], dtype=numpy_type(dtype))
                outputs.append((host, dtype))
                keep.append(host)
                if init_value is None:
                    kind, pattern = 1, b""
                else:
                    value = mx.array(init_value, dtype=dtype)
                    pattern = bytes(_host_view(value).tobytes())
                    kind = 2
                add(p.name, dst=host.ctypes.data if host.size else None, span=host.nbytes,
                    elem=host.itemsize, init_kind=kind, pattern=pattern)
        return descs, outputs, keep

    # -- launch ----------------------------------------------------------------------------

    def _launch(self, mod, gen, arrays, out_shapes, out_dtypes, grid, threadgroup, init_value):
        global _last_stats
        rt = _toolchain.runtime_library()
        descs, outputs, keep = self._buffers(gen, arrays, out_shapes, out_dtypes, init_value)
        if len(descs) > MAX_BUFFERS:
            raise ValueError(f"[metal_kernel] too many buffers ({len(descs)} > {MAX_BUFFERS})")
        s = _settings
        bufs = (_BufDesc * max(1, len(descs)))(*descs)
        desc = _LaunchDesc()
        desc.fn = mod.fn
        desc.kernel = self.name.encode()
        desc.nbuf = len(descs)
        desc.bufs = bufs
        desc.grid[:] = list(grid)
        desc.tg[:] = list(threadgroup)
        desc.strict = int(s.strict)
        desc.shuffle = int(s.shuffle_seed is not None)
        desc.seed = (s.shuffle_seed or 0) & (2**64 - 1)
        desc.force_fibers = int(mod.needs_fibers)
        desc.nworkers = s.workers
        desc.stack_size = s.stack_kb * 1024
        desc.timeout_s = s.timeout_s
        result = _LaunchResult()
        while True:
            sites = mod._sites
            if sites:
                desc.site_starts, desc.site_ids, desc.nsites = sites
            desc.site_state = 0 if sites is None else 1 if sites else 2
            rt.mt_launch(ctypes.byref(desc), ctypes.byref(result))
            if result.status != 3 or desc.site_state != 0:
                break
            # threads met at one call through different return addresses: read the module's
            # call-site identities once, and run the launch again with them (with fibers)
            mod.call_site_table()
            desc.force_fibers = 1
        del keep  # the runtime copied what it needed
        if result.used_fibers:
            mod.needs_fibers = True
        names = [p.name for p in gen.params]
        stats = LaunchStats(
            kernel=self.name, grid=tuple(grid), threadgroup=tuple(threadgroup),
            threadgroups=result.threadgroups, threads=result.threads,
            bytes_read={n: int(result.bytes_read[i]) for i, n in enumerate(names)},
            bytes_written={n: int(result.bytes_written[i]) for i, n in enumerate(names)},
            threadgroup_barriers=result.threadgroup_barriers,
            simdgroup_barriers=result.simdgroup_barriers,
            simd_collectives=result.simd_collectives,
            threadgroup_memory=result.threadgroup_memory,
            fiber_switches=result.fiber_switches, used_fibers=bool(result.used_fibers),
            call_sites_from_debug_info=bool(result.used_site_ids))
        with _stats_lock:
            _last_stats = stats
        if result.status == 2:
            raise EmulatorError(f"[{self.name}] emulator error: "
                                f"{result.message.decode(errors='replace')}")
        if result.status == 1:
            raise self._hazard(rt, mod, result)
        out = []
        for host, dtype in outputs:
            arr = mx.array(host)
            out.append(arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr)
        return out

    def _hazard(self, rt, mod, r) -> KernelHazard:
        message = r.message.decode(errors="replace")
        no_lines = addr2line_missing()

        def path(m: re.Match) -> str:
            callers = mod.callers(rt, [r.ras[k] for k in range(int(m.group(1)),
                                                               int(m.group(2)))])
            return "".join(f", called from {c}" for c in callers)

        message = re.sub(r"@PATH(\d+)-(\d+)", path, message)
        for k in range(r.nras):
            where, _ = mod.locate(rt, r.ras[k])
            message = message.replace(f"@RA{k}", where or ("an unknown line (addr2line not "
                                                           "found)" if no_lines else
                                                           "an unknown line"))
        location, text = mod.locate(rt, r.fault_ra)
        parts = [f"[{self.name}] {message.rstrip('.')}"]
        threadgroup = thread = None
        if r.has_thread:
            threadgroup = tuple(r.threadgroup)
            thread = tuple(r.thread)
            parts.append(f"thread {thread} (index {r.thread_index}) of threadgroup "
                         f"{threadgroup}")
        if location:
            parts.append(f"at {location}" + (f": {text}" if text else ""))
        elif no_lines and r.fault_ra:
            parts.append(NO_ADDR2LINE)
        cls = HAZARD_CLASSES.get(r.hazard_kind, KernelHazard)
        return cls("; ".join(parts), kernel=self.name, threadgroup=threadgroup, thread=thread,
                   location=location, source_line=text)


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options=None) -> EmulatedKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs the kernel on the CPU emulator."""
    return EmulatedKernel(name, input_names, output_names, source, header,
                          ensure_row_contiguous, atomic_outputs, compile_options)
