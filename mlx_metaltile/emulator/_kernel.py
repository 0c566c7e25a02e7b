"""``metal_kernel`` for the emulator: argument handling as in MLX, buffers, the launch, hazard
reports and per-launch counters."""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .._msl.dtypes import numpy_type
from .._msl.kernel import Launch, MetalKernel
from .._msl.signature import InputInfo, generate
from . import _abi, _dwarf, _settings, _toolchain
from ._errors import HAZARD_CLASSES, EmulatorError, KernelHazard
from ._translate import translate

NO_LINES = "source line unavailable: the kernel module's debug information could not be read"


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
    # and the module's debug information told whether that was one call of the source (or
    # which of two calls outside the body comes first)
    call_sites_from_debug_info: bool = False


_last_stats: LaunchStats | None = None
_stats_lock = threading.Lock()


def last_launch_stats() -> LaunchStats | None:
    """Counters of the most recent emulator launch in this process (None before any)."""
    return _last_stats


# ---- one compiled kernel instantiation --------------------------------------------------------

class _Module:
    """One compiled kernel instantiation."""

    def __init__(self, path: Path, header: str, body: str):
        """`path`: a module the cache has checked. `header` and `body` as the kernel's author
        wrote them (the translation keeps their line numbers): hazards quote these lines."""
        self.path = path
        # symbols kept local: the module finds the runtime (loaded first) as its needed library
        _toolchain.runtime_library()
        self.lib = ctypes.CDLL(str(path), mode=_toolchain.MODULE_DLOPEN_MODE)
        self.fn = ctypes.cast(self.lib.mt_kernel_thread, ctypes.c_void_p).value
        self.header_lines = header.splitlines()
        self.body_lines = body.splitlines()
        self.needs_fibers = False
        self._sites = None  # (starts, ids, count) once read; False: unreadable
        self._lines = None  # the line table once read; False: unreadable

    def call_site_table(self):
        """The call-site identities of this module's code, read from its debug information
        the first time a launch needs them: (starts, ids, count) as C arrays, or False."""
        if self._sites is None:
            table = _dwarf.call_site_table(self.path)
            if table is None:
                self._sites = False
            else:
                starts, ids = table
                self._sites = (_abi.ffi.new("uint64_t[]", starts), _abi.ffi.new("uint32_t[]", ids),
                               len(starts))
        return self._sites

    def lines_readable(self) -> bool:
        if self._lines is None:
            self._lines = _dwarf.line_table(self.path) or False
        return self._lines is not False

    def _frames(self, rt, ra: int) -> tuple[tuple[str, int], ...]:
        if not ra or not self.lines_readable():
            return ()
        buf = _abi.ffi.new("char[]", 4096)
        off = _abi.ffi.new("uint64_t*")
        if not rt.mt_addr_info(ra, buf, 4096, off):
            return ()
        if Path(_abi.ffi.string(buf).decode()).resolve() != self.path.resolve():
            return ()  # not this module's code
        return _dwarf.source_frames(self._lines, max(off[0] - 1, 0))

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
        """The buffer descriptions (a C array), the outputs' host arrays with their dtypes,
        and what must stay alive during the launch."""
        if len(gen.params) > _abi.MAX_BUFFERS:
            raise ValueError(f"[metal_kernel] too many buffers ({len(gen.params)} > "
                             f"{_abi.MAX_BUFFERS})")
        descs = _abi.ffi.new("mt_buf_desc[]", max(1, len(gen.params)))
        keep = [descs]  # host memory that must outlive the launch
        outputs = []
        views = {}

        def add(k, name, src=0, dst=0, span=0, data_off=0, elem=1, init_kind=_abi.INIT_COPY,
                pattern=b""):
            d = descs[k]
            c_name = _abi.ffi.new("char[]", name.encode())
            keep.append(c_name)
            d.name = c_name
            d.src = _abi.ffi.cast("void*", src)
            d.dst = _abi.ffi.cast("void*", dst)
            d.span = span
            d.data_off = data_off
            d.elem_size = elem
            d.init_kind = init_kind
            d.pattern[0:len(pattern[:16])] = pattern[:16]

        for k, p in enumerate(gen.params):
            if p.kind == "input":
                view = _host_view(arrays[p.index])
                if self.ensure_row_contiguous and not view.flags.c_contiguous:
                    view = np.ascontiguousarray(view)
                views[p.index] = view
                keep.append(view)
                item = view.itemsize
                if view.size == 0:
                    add(k, p.name, elem=item)
                    continue
                dims = list(zip(view.shape, view.strides, strict=True))
                lo = sum(min(0, (n - 1) * s) for n, s in dims)
                hi = sum(max(0, (n - 1) * s) for n, s in dims) + item
                add(k, p.name, src=view.ctypes.data + lo, span=hi - lo, data_off=-lo,
                    elem=item)
            elif p.kind in ("shape", "strides", "ndim"):
                view = views[p.index]
                if p.kind == "shape":
                    host = np.array(view.shape, dtype=np.int32)
                elif p.kind == "strides":
                    host = np.array([s // view.itemsize for s in view.strides], dtype=np.int64)
                else:
                    host = np.array(view.ndim, dtype=np.int32)
                keep.append(host)
                add(k, p.name, src=host.ctypes.data, span=host.nbytes, elem=host.itemsize)
            else:
                dtype = out_dtypes[p.index]
                if numpy_type(dtype) is None:
                    raise TypeError(f"[metal_kernel] the emulator does not support output "
                                    f"dtype {dtype}")
                host = np.empty(out_shapes[p.index], dtype=numpy_type(dtype))
                outputs.append((host, dtype))
                keep.append(host)
                if init_value is None:
                    kind, pattern = _abi.INIT_POISON, b""
                else:
                    value = mx.array(init_value, dtype=dtype)
                    pattern = bytes(_host_view(value).tobytes())
                    kind = _abi.INIT_PATTERN
                add(k, p.name, dst=host.ctypes.data if host.size else 0, span=host.nbytes,
                    elem=host.itemsize, init_kind=kind, pattern=pattern)
        return descs, outputs, keep

    # -- launch ----------------------------------------------------------------------------

    def _launch(self, mod, gen, arrays, out_shapes, out_dtypes, grid, threadgroup, init_value):
        global _last_stats
        rt = _toolchain.runtime_library()
        descs, outputs, keep = self._buffers(gen, arrays, out_shapes, out_dtypes, init_value)
        s = _settings.current
        desc = _abi.ffi.new("mt_launch_desc*")
        c_name = _abi.ffi.new("char[]", self.name.encode())
        desc.fn = _abi.ffi.cast("void*", mod.fn)
        desc.kernel = c_name
        desc.nbuf = len(gen.params)
        desc.bufs = descs
        desc.grid = list(grid)
        desc.tg = list(threadgroup)
        desc.strict = int(s.strict)
        desc.shuffle = int(s.shuffle_seed is not None)
        desc.seed = (s.shuffle_seed or 0) & (2**64 - 1)
        desc.force_fibers = int(mod.needs_fibers)
        desc.nworkers = s.workers
        desc.stack_size = s.stack_kb * 1024
        desc.timeout_s = s.timeout_s
        result = _abi.ffi.new("mt_launch_result*")
        while True:
            sites = mod._sites
            if sites:
                desc.site_starts, desc.site_ids, desc.nsites = sites
            desc.site_state = 0 if sites is None else 1 if sites else 2
            rt.mt_launch(desc, result)
            if result.status != _abi.STATUS_NEED_SITES or desc.site_state != 0:
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
        if result.status == _abi.STATUS_ERROR:
            raise EmulatorError(f"[{self.name}] emulator error: "
                                f"{_abi.ffi.string(result.message).decode(errors='replace')}")
        if result.status == _abi.STATUS_HAZARD:
            raise self._hazard(rt, mod, result)
        out = []
        for host, dtype in outputs:
            arr = mx.array(host)
            out.append(arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr)
        return out

    def _hazard(self, rt, mod, r) -> KernelHazard:
        message = _abi.ffi.string(r.message).decode(errors="replace")
        no_lines = not mod.lines_readable()

        def path(m: re.Match) -> str:
            callers = mod.callers(rt, [r.ras[k] for k in range(int(m.group(1)),
                                                               int(m.group(2)))])
            return "".join(f", called from {c}" for c in callers)

        message = re.sub(r"@PATH(\d+)-(\d+)", path, message)
        for k in range(r.nras):
            where, _ = mod.locate(rt, r.ras[k])
            message = message.replace(f"@RA{k}", where or "an unknown line")
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
            parts.append(NO_LINES)
        cls = next((c for name, c in HAZARD_CLASSES.items()
                    if _abi.hazard_kind(name) == r.hazard_kind), KernelHazard)
        return cls("; ".join(parts), kernel=self.name, threadgroup=threadgroup, thread=thread,
                   location=location, source_line=text)


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options=None) -> EmulatedKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs the kernel on the CPU emulator."""
    return EmulatedKernel(name, input_names, output_names, source, header,
                          ensure_row_contiguous, atomic_outputs, compile_options)
