"""The wheel carries the emulator: its Python modules, MSL runtime headers and runtime source."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_carries_the_emulator(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("mlx_metaltile-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    pkg = "mlx_metaltile/emulator/"
    expected = [pkg + f for f in ("__init__.py", "_kernel.py", "_toolchain.py",
                                  "_abi.py", "_settings.py", "_dwarf.py",
                                  "_translate.py", "src/runtime.cpp", "src/fibers.inc",
                                  "include/mt_emu/launch.h", "README.md",
                                  "include/metal_stdlib", "include/metal_simdgroup",
                                  "include/mt_emu/kernel.h", "include/mt_emu/abi.h")]
    expected.append("mlx_metaltile/_msl/signature.py")
    missing = [n for n in expected if n not in names]
    assert not missing, f"missing from the wheel: {missing}"
    source_headers = {p.relative_to(ROOT / "mlx_metaltile").as_posix()
                      for p in (ROOT / "mlx_metaltile/emulator/include").rglob("*") if p.is_file()}
    assert {"mlx_metaltile/" + h for h in source_headers} <= names
