"""Compile the CUDA translation of every registered kernel, without a GPU (test tooling).

Each kernel template gives one translation unit holding all its instantiations (those its
spec declares, ``instantiations(spec)``), in exactly the text MLX's cuda_kernel builds, plus
one instantiation with the overhanging-grid guard. Two compilers can check it:

  * nvcc, device code only (``-cubin``: front end, optimiser and ptxas, so shared-memory and
    register limits are checked too);
  * NVRTC, when its library can be found, with the options MLX's JIT uses
    (--device-as-default-execution-space, sm_90a): NVRTC has no host compiler behind it, so
    it rejects host-only builtins that nvcc's front end lets through.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mlx_metaltile import backends
from mlx_metaltile._msl.constants import PACKABLE
from mlx_metaltile._registry import KernelInstance, KernelSpec, instantiations
from mlx_metaltile.cuda import _translate as tr

DEFAULT_ARCH = "sm_90"
# Folder holding the real mlx/backend/cuda/device/*.cuh (else the bundled stub is used).
INCLUDE_ENV = "MLX_METALTILE_MLX_CUDA_INCLUDE"
# Path of libnvrtc.so to use (else the CUDA toolkit's or the nvidia-cuda-nvrtc wheel's).
NVRTC_ENV = "MLX_METALTILE_NVRTC"


@dataclass(frozen=True)
class CompileResult:
    unit: str
    ok: bool
    seconds: float
    log: str
    command: tuple[str, ...]


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").is_file():
            return str(Path(root, "bin", "nvcc"))
    return None


def stub_include_dir() -> Path:
    """A folder holding a stand-in for MLX's ``mlx/backend/cuda/device/utils.cuh``.

    MLX embeds its device headers in libmlx (they are not files of the wheel); for a
    standalone nvcc check the stub declares what the generated signatures use.
    """
    return Path(__file__).resolve().with_name("cuda_stub")


def device_include_dir() -> Path:
    env = os.environ.get(INCLUDE_ENV)
    return Path(env) if env else stub_include_dir()


def spec_definitions(spec: KernelSpec, instances: Iterable[KernelInstance]) -> tuple[str, str]:
    """(header, kernel definitions) of every instance of ``spec``, as MLX would build them."""
    header, body = backends.kernel_text(spec, "cuda")
    name = f"mt_{spec.name}"
    header = tr.translate_header(header)
    if spec.cuda_launch_bounds:
        header += tr.launch_bounds_directive(*spec.cuda_launch_bounds)
    body = tr.prepass_body(body)
    definitions = []
    instances = list(instances)
    # Each instance as the ops launch it (its 32-bit scalars packed) on whole grids, and the
    # first one also with the guard and with its scalars as 0-d arrays.
    variants = ([(inst, False, True) for inst in instances]
                + [(inst, True, True) for inst in instances[:1]]
                + [(inst, False, False) for inst in instances[:1]])
    for inst, guarded, packed in variants:
        input_names = [n for n, _, _ in inst.inputs]
        output_names = [n for n, _ in inst.outputs]
        packed_types = [PACKABLE.get(dtype) if packed and nd == 0 else None
                        for _, dtype, nd in inst.inputs]
        wrapped = tr.translate_body(body, input_names, output_names,
                                    scalar_inputs=[nd == 0 for _, _, nd in inst.inputs],
                                    guarded=guarded, atomic_outputs=inst.atomic_outputs,
                                    packed_types=packed_types)
        unpacked = [a for a, t in zip(inst.inputs, packed_types, strict=True) if t is None]
        params = [(cuda_name, dtype, ndim) for cuda_name, (_, dtype, ndim)
                  in zip(wrapped.input_names[:len(unpacked)], unpacked, strict=True)]
        if any(packed_types):
            params.append((tr.PACKED_INPUT, "uint32", 1))
        if guarded:
            params.append((tr.GRID_INPUT, "uint32", 1))
        outputs = [(cuda_name, dtype) for cuda_name, (_, dtype)
                   in zip(wrapped.output_names, inst.outputs, strict=True)]
        suffix = ("_g" if guarded else "") + ("" if packed else "_s")
        function = tr.mlx_kernel_name(name + suffix, inst.template)
        definitions.append(tr.kernel_definition(function, wrapped.source, params, outputs,
                                                inst.template))
    return header, "".join(definitions)


def spec_unit(spec: KernelSpec, instances: Iterable[KernelInstance] | None = None) -> str:
    """The translation unit checked for ``spec`` (all its instantiations)."""
    header, definitions = spec_definitions(
        spec, instantiations(spec) if instances is None else instances)
    return tr.translation_unit(header, [definitions])


def nvcc_command(nvcc: str, source: Path, output: Path, arch: str = DEFAULT_ARCH,
                 include: Path | None = None) -> list[str]:
    return [nvcc, f"-arch={arch}", "-std=c++17", "-cubin", "-o", str(output),
            f"-I{include or device_include_dir()}", str(source)]


def compile_units(units: Mapping[str, str], *, arch: str = DEFAULT_ARCH,
                  jobs: int | None = None, nvcc: str | None = None,
                  workdir: str | os.PathLike | None = None) -> dict[str, CompileResult]:
    """Compile each named unit with nvcc, in parallel; never raises on compile errors."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("[cuda] nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    jobs = jobs or max(1, os.cpu_count() or 1)
    tmp = tempfile.TemporaryDirectory(prefix="mt_cuda_") if workdir is None else None
    root = Path(tmp.name if tmp else workdir)
    root.mkdir(parents=True, exist_ok=True)

    def run(item: tuple[str, str]) -> CompileResult:
        unit, text = item
        source = root / f"{unit}.cu"
        source.write_text(text, encoding="utf-8")
        cmd = nvcc_command(nvcc, source, root / f"{unit}.cubin", arch)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return CompileResult(unit, proc.returncode == 0, time.perf_counter() - start,
                             (proc.stdout + proc.stderr).strip(), tuple(cmd))

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return {r.unit: r for r in pool.map(run, units.items())}
    finally:
        if tmp is not None:
            tmp.cleanup()


# ---- NVRTC -------------------------------------------------------------------------------

def _toolkit_include() -> Path | None:
    """The CUDA toolkit's include folder (cuda_fp16.h, cooperative_groups.h, cccl/)."""
    candidates = []
    nvcc = find_nvcc()
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent / "include")
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(Path(root) / "include")
    for base in sys.path:
        candidates.append(Path(base) / "nvidia" / "cu13" / "include")
    return next((c for c in candidates if (c / "cuda_fp16.h").is_file()), None)


def _nvrtc_candidates() -> list[Path]:
    found = [Path(os.environ[NVRTC_ENV])] if os.environ.get(NVRTC_ENV) else []
    roots = []
    nvcc = find_nvcc()
    if nvcc:
        roots.append(Path(os.path.realpath(nvcc)).parent.parent)
    roots += [Path(r) for r in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if r]
    for root in roots:
        found += sorted((root / "lib64").glob("libnvrtc.so*"))
    for base in sys.path:
        for sub in ("cu13", "cuda_nvrtc"):
            found += sorted((Path(base) / "nvidia" / sub / "lib").glob("libnvrtc.so*"))
    return [p for p in found if p.is_file() and "builtins" not in p.name and ".alt." not in p.name]


_NVRTC: list = []  # [library or None] once looked up
_NVRTC_LOCK = threading.Lock()


def load_nvrtc():
    """The NVRTC library (ctypes), or None if none can be loaded here."""
    with _NVRTC_LOCK:
        if not _NVRTC:
            _NVRTC.append(_open_nvrtc())
        return _NVRTC[0]


def _open_nvrtc():
    for path in _nvrtc_candidates():
        try:
            # libnvrtc dlopens its builtins by name: load them first from the same folder.
            for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
                if ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None


def nvrtc_options(arch: str = DEFAULT_ARCH + "a") -> list[str]:
    """MLX's JIT options (jit_module.cpp), with include paths for a standalone check."""
    opts = ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
            f"--include-path={device_include_dir()}"]
    toolkit = _toolkit_include()
    if toolkit is not None:
        opts.append(f"--include-path={toolkit}")
        if (toolkit / "cccl").is_dir():
            opts.append(f"--include-path={toolkit / 'cccl'}")
    return opts


def nvrtc_compile(unit: str, text: str, options: list[str] | None = None) -> CompileResult:
    lib = load_nvrtc()
    if lib is None:
        raise FileNotFoundError("[cuda] libnvrtc not found (set MLX_METALTILE_NVRTC)")
    options = options or nvrtc_options()
    start = time.perf_counter()
    prog = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{unit}.cu".encode(),
                                    0, None, None)
    if status != 0:
        return CompileResult(unit, False, 0.0, f"nvrtcCreateProgram failed ({status})",
                             ("nvrtc", *options))
    try:
        args = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        status = lib.nvrtcCompileProgram(prog, len(options), args)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(max(size.value, 1))
        lib.nvrtcGetProgramLog(prog, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return CompileResult(unit, status == 0, time.perf_counter() - start,
                         log.value.decode(errors="replace").strip(), ("nvrtc", *options))


def nvrtc_compile_units(units: Mapping[str, str], *, jobs: int | None = None,
                        options: list[str] | None = None) -> dict[str, CompileResult]:
    """Compile each named unit with NVRTC (in-process, in parallel threads)."""
    options = options or nvrtc_options()
    jobs = jobs or max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = pool.map(lambda item: nvrtc_compile(item[0], item[1], options), units.items())
        return {r.unit: r for r in results}


# ---- PTX: what a kernel's CUDA translation issues ----------------------------------------

PTX_OPS = ("mma", "movmatrix", "ldmatrix", "ld.shared", "st.shared", "ld.global", "shfl",
           "add.f32", "bar")


def ptx_text(unit: str, *, arch: str = DEFAULT_ARCH, nvcc: str | None = None) -> str:
    """The PTX nvcc makes of one translation unit (raises on a compile error)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("[cuda] nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    with tempfile.TemporaryDirectory(prefix="mt_ptx_") as tmp:
        source, out = Path(tmp, "unit.cu"), Path(tmp, "unit.ptx")
        source.write_text(unit, encoding="utf-8")
        cmd = nvcc_command(nvcc, source, out, arch)
        cmd[cmd.index("-cubin")] = "-ptx"
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"[cuda] nvcc -ptx failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return out.read_text(encoding="utf-8")


def ptx_counts(ptx: str) -> list[dict[str, int]]:
    """Per kernel (.entry) of ``ptx``, how many instructions start with each of PTX_OPS (a
    kernel's unrolled loops count once per unrolled copy)."""
    kernels = []
    for body in ptx.split(".entry ")[1:]:
        ops = []
        for line in body.splitlines():
            words = line.split()
            if not words or words[0].startswith(("//", ".", "{", "}", "$", ")", "(")):
                continue
            if words[0].startswith("@"):  # a guard predicate
                words = words[1:]
            if words:
                ops.append(words[0])
        kernels.append({op: sum(o.startswith(op) for o in ops) for op in PTX_OPS})
    return kernels


def spec_instance(spec: KernelSpec, **template) -> KernelInstance:
    """The declared instance of ``spec`` whose template has these values (dtypes by name)."""
    def matches(inst):
        t = dict(inst.template)
        return all(str(t.get(k)).rsplit(".", 1)[-1] == str(v) for k, v in template.items())
    found = [inst for inst in instantiations(spec) if matches(inst)]
    if not found:
        raise ValueError(f"no instance of {spec.name} with {template}")
    return found[0]


if __name__ == "__main__":
    # python tests/nvcc_check.py OP SPEC_NAME [KEY=VALUE ...]: PTX instruction counts of one
    # declared instance as the ops launch it, e.g.
    #   python tests/nvcc_check.py sdpa_multi MMA_SPEC T=bfloat16 D=128 PF=1 MASK_KIND=0
    import importlib

    op, spec_name, *pairs = sys.argv[1:]
    spec = getattr(importlib.import_module(f"mlx_metaltile.ops.{op}"), spec_name)
    inst = spec_instance(spec, **dict(p.split("=", 1) for p in pairs))
    counts = ptx_counts(ptx_text(spec_unit(spec, [inst])))[0]
    print(spec.name, dict(inst.template))
    print("  ".join(f"{k} {v}" for k, v in counts.items()))
