"""What the ops run on: device name, a chip slug, published peak memory bandwidth."""

from __future__ import annotations

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
