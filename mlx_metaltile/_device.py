"""What the ops run on: device name, a chip slug, published peak memory bandwidth, and
what each backend can run (the GPU features a kernel variant needs)."""

from __future__ import annotations

import functools
import platform
import re
import subprocess
from pathlib import Path

import mlx.core as mx

# Published peak memory bandwidth, GB/s (chip name as MLX reports it, lower-case).
PEAK_GBPS = {
    "apple m1": 68, "apple m1 pro": 200, "apple m1 max": 400, "apple m1 ultra": 800,
    "apple m2": 100, "apple m2 pro": 200, "apple m2 max": 400, "apple m2 ultra": 800,
    "apple m3": 100, "apple m3 pro": 150, "apple m3 ultra": 819,
    "apple m4": 120, "apple m4 pro": 273,
    "apple m5": 153, "apple m5 max": 614,
    "nvidia h100 80gb hbm3": 3350, "nvidia h100": 3350, "nvidia h200": 4800,
}
# Chips published with more than one figure (binned parts) are left out: "unknown" beats a guess.

# GPU cores (NVIDIA SMs; Apple GPU cores) by chip name as MLX reports it, lower-case: launch
# plans size their grids by it. DEFAULT_GPU_CORES stands in for a chip not listed.
GPU_CORES = {"nvidia h100 80gb hbm3": 132, "nvidia h100": 132, "nvidia h200": 132}
DEFAULT_GPU_CORES = 132


def device_name() -> str:
    try:
        info = mx.metal.device_info() if mx.metal.is_available() else mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or "unknown")
    except Exception:
        return "unknown"


def device_slug(name: str | None = None) -> str:
    name = (name or device_name()).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def peak_gbps(name: str | None = None) -> float | None:
    return PEAK_GBPS.get((name or device_name()).lower().strip())


@functools.cache
def gpu_cores() -> int | None:
    """This machine's GPU core count (GPU_CORES), None if its chip is not listed."""
    return GPU_CORES.get(device_name().lower().strip())


def git_sha() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
        return (sha + ("+dirty" if dirty.strip() else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- capabilities ----------------------------------------------------------------------

MPP = "MetalPerformancePrimitives"  # matmul2d on cooperative tensors (Metal 4 matrix units)


def _parse_version(release: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in release.strip().split(".")) if release.strip() else ()
    except ValueError:
        return ()


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                              timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=1)
def macos_version() -> tuple[int, ...]:
    version = _parse_version(platform.mac_ver()[0])
    if version[:1] == (16,):
        # macOS 26 shows Python builds linked against an older SDK the compatibility version
        # 16.x; the kernel's product version is the real one.
        version = _parse_version(_sysctl("kern.osproductversion")) or version
    return version


@functools.cache
def device_architecture() -> str:
    """The Metal device's architecture name, e.g. 'applegpu_g17s' (read once per process)."""
    info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        arch = info_fn().get("architecture", "")
    except Exception:  # no Metal device (or an MLX without the call)
        return ""
    return arch if isinstance(arch, str) else ""


def architecture_generation(arch: str) -> int:
    """'applegpu_g17s' -> 17: the two digits before the last character, as MLX reads them."""
    if len(arch) < 3:
        return 0
    tens, ones = arch[-3], arch[-2]
    return int(tens) * 10 + int(ones) if (tens + ones).isdigit() else 0


def metal_mpp_reason() -> str | None:
    """None if this Metal device runs MetalPerformancePrimitives' matrix units, else why not.

    The rule MLX uses for its NAX kernels: macOS >= 26.2 and GPU generation >= 17
    (>= 18 for phone-class GPUs, architecture names ending in 'p').
    """
    from . import backends  # the Metal probe lives with the backend controls

    if not backends._metal_available():
        return "no Metal device"
    mac = macos_version()
    if mac < (26, 2):
        shown = ".".join(map(str, mac)) or "unknown"
        return f"needs macOS >= 26.2 (MetalPerformancePrimitives), got {shown}"
    arch = device_architecture()
    gen = architecture_generation(arch)
    need = 18 if arch.endswith("p") else 17
    if gen < need:
        return f"needs GPU generation >= {need} (matrix units, M5 or later), got {arch or 'unknown'}"
    return None


def unsupported_reason(feature: str, backend: str) -> str | None:
    """None if ``backend`` runs kernels that use ``feature`` here, else why not.

    The emulator models MetalPerformancePrimitives (its include/MetalPerformancePrimitives);
    the CUDA layer does not translate it.
    """
    if feature != MPP:
        raise ValueError(f"[mlx_metaltile] unknown feature {feature!r}; expected {MPP!r}")
    if backend == "metal":
        return metal_mpp_reason()
    if backend == "emulator":
        return None
    return f"the {backend} backend has no MetalPerformancePrimitives"
