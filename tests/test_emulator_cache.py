"""The emulator's compile cache: private folders only, every entry checked before it is
loaded (planted or corrupt entries are rebuilt, never used), stale builds removed, an
unwritable cache replaced by a private one, a full disk named as such. Each test uses a
private cache folder."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import requires_emulator

from mlx_metaltile import emulator as em
from mlx_metaltile._msl.signature import InputInfo, generate
from mlx_metaltile.emulator import _cache, _toolchain
from mlx_metaltile.emulator._translate import translate

pytestmark = requires_emulator
ROOT = Path(__file__).resolve().parents[1]
PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen("%s", "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
void mt_kernel_thread(void) {}
int mt_rt_abi_version(void) { return %d; }
"""


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache(shared_cache, monkeypatch):
    """A private cache folder (shared by this module's tests: its runtime and precompiled
    header are built once)."""
    monkeypatch.setenv("MLX_METALTILE_CACHE", str(shared_cache))
    return shared_cache / "emulator"


def _source(scale: float) -> str:
    return f"// {uuid.uuid4().hex}\nout[thread_position_in_grid.x] = inp[thread_position_in_grid.x] * {scale:.1f}f;"


def _build_only(source: str, name: str) -> Path:
    """Build a kernel's cache entry without loading it (a module loaded once stays loaded
    under its path, which would hide what the cache hands out later)."""
    gen = generate(name, ["inp"], ["out"], source, "", [InputInfo(mx.float32, 1, 64)],
                   [mx.float32])
    return _toolchain.build_kernel(*translate(gen), name)


def _run(source: str, name: str) -> np.ndarray:
    kernel = em.metal_kernel(name=name, input_names=["inp"], output_names=["out"],
                             source=source)
    (out,) = kernel(inputs=[mx.arange(64, dtype=mx.float32)], grid=(64, 1, 1),
                    threadgroup=(32, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.float32])
    assert em.last_launch_stats().kernel == name  # it ran
    return np.array(out)


def _plant(path: Path, marker: Path) -> None:
    src = path.with_name("planted.c")
    src.write_text(PLANT % (marker, 0))
    subprocess.run([_toolchain.compiler(), "-x", "c", "-shared", "-fPIC", str(src), "-o",
                    str(path)], check=True)
    src.unlink()


# ---- who may write the cache ------------------------------------------------------------------

def test_a_cache_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("MLX_METALTILE_CACHE", str(folder))
    reason = em.unavailable_reason()
    assert reason is not None and "writable by group or others" in reason
    assert str(folder) in reason and f"chmod go-w {folder}" in reason
    with pytest.raises(_cache.CacheError, match="writable by group or others"):
        _run(_source(2), "refused")


def test_a_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_METALTILE_CACHE", str(tmp_path / "theirs"))
    monkeypatch.setattr(_cache.os, "geteuid", lambda: os.getuid() + 1)
    reason = em.unavailable_reason()
    assert reason is not None and f"belongs to user id {os.getuid()}" in reason
    assert "MLX_METALTILE_CACHE" in reason


# ---- whether the emulator can run here -----------------------------------------------------

FAILING_CXX = """#!/bin/sh
echo "$@" >> "{log}"
echo "cc1plus: error: this compiler is broken" >&2
exit 1
"""


def test_a_compiler_that_cannot_build_the_runtime_makes_it_unavailable(tmp_path):
    """Found when the backend's availability is asked, not at the first kernel; asked again,
    the answer is remembered (the compiler runs once per process)."""
    log = tmp_path / "calls.log"
    cxx = tmp_path / "broken-c++"
    cxx.write_text(FAILING_CXX.format(log=log))
    cxx.chmod(0o700)
    (tmp_path / "cache").mkdir(mode=0o700)
    probe = ("from mlx_metaltile import backends; from mlx_metaltile import emulator as em; "
             "print(em.unavailable_reason()); print(backends.available_backends()['emulator']); "
             "print(em.unavailable_reason())")
    env = {**os.environ, "MLX_METALTILE_CXX": str(cxx),
           "MLX_METALTILE_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    want = (f"the C++ compiler {cxx} cannot build its runtime library: "
            "cc1plus: error: this compiler is broken")
    assert out == [want] * 3
    builds = [ln for ln in log.read_text().splitlines() if "runtime.cpp" in ln]
    assert len(builds) == 1


def test_an_entry_file_others_can_write_is_refused(cache):
    source = _source(3)
    so = _build_only(source, "group_writable")
    so.chmod(0o666)
    with pytest.raises(_cache.CacheError, match=f"cache file {so} is writable by group"):
        _run(source, "group_writable")


# ---- nothing from the cache is used unchecked ---------------------------------------------------

def _zero_length(so: Path, other: Path) -> None:
    so.write_bytes(b"")


def _overwritten(so: Path, other: Path) -> None:
    data = bytearray(so.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 256] = b"\xcc" * 256
    so.write_bytes(bytes(data))


def _other_module(so: Path, other: Path) -> None:
    shutil.copyfile(other, so)


def _other_entry(so: Path, other: Path) -> None:
    for f in other.parent.iterdir():
        shutil.copyfile(f, so.parent / f.name)


def _truncated_record(so: Path, other: Path) -> None:
    (so.parent / "record.json").write_text('{"source": ')


@pytest.mark.parametrize("damage", [_zero_length, _overwritten, _other_module, _other_entry,
                                    _truncated_record])
def test_a_corrupt_kernel_module_is_rebuilt_not_used(cache, damage):
    name = f"victim_{damage.__name__.strip('_')}"
    source = _source(2)
    so = _build_only(source, name)
    other = _build_only(_source(5), "other")
    damage(so, other)
    with pytest.warns(RuntimeWarning, match=f"rebuilding the cache entry {so.parent}"):
        out = _run(source, name)
    np.testing.assert_array_equal(out, np.arange(64) * 2.0)


def test_a_planted_kernel_module_never_runs(cache, tmp_path):
    source = _source(2)
    so = _build_only(source, "planted")
    marker = tmp_path / "marker"
    _plant(so, marker)
    with pytest.warns(RuntimeWarning, match="rebuilding the cache entry"):
        out = _run(source, "planted")
    np.testing.assert_array_equal(out, np.arange(64) * 2.0)
    assert not marker.exists()


def test_a_truncated_precompiled_header_is_rebuilt(cache, monkeypatch):
    _run(_source(2), "before")
    (pch,) = cache.glob("pch-*")
    gch = pch / "mt_pch.h.gch"
    gch.write_bytes(gch.read_bytes()[:1000])
    monkeypatch.setattr(_toolchain, "_pch", {})  # as a new process finds it
    with pytest.warns(RuntimeWarning, match=f"rebuilding the cache entry {pch}"):
        out = _run(_source(4), "after_pch")
    np.testing.assert_array_equal(out, np.arange(64) * 4.0)


PLANTED_RUNTIME = """
import mlx.core as mx
from mlx_metaltile import emulator as em
k = em.metal_kernel(name="k", input_names=["inp"], output_names=["out"],
                    source="out[thread_position_in_grid.x] = 2.0f * inp[thread_position_in_grid.x];")
(o,) = k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
         output_shapes=[(4,)], output_dtypes=[mx.float32])
assert o.tolist() == [2.0] * 4
print("ok")
"""


def test_a_planted_runtime_library_never_runs(cache, tmp_path):
    _run(_source(2), "runtime_built")  # the private cache has its runtime entry
    (runtime,) = cache.glob("runtime-*/mt_runtime-*.so")
    marker = tmp_path / "marker"
    _plant(runtime, marker)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLX_METALTILE_CACHE=str(cache.parent))
    proc = subprocess.run([sys.executable, "-W", "default", "-c", PLANTED_RUNTIME], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "rebuilding the cache entry" in proc.stderr
    assert not marker.exists()


def test_modules_and_runtime_keep_their_symbols_local(cache):
    _run(_source(2), "local_symbols")
    everything = ctypes.CDLL(None)
    for symbol in ("mt_kernel_thread", "mt_launch", "__tsan_read4"):
        with pytest.raises(AttributeError):
            getattr(everything, symbol)


# ---- stale builds, unwritable and full caches -----------------------------------------------------

def test_stale_build_folders_are_removed_unless_a_build_holds_them(cache, monkeypatch):
    kernels = cache / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    old = time.time() - 2 * _cache.STALE_AFTER_S
    stale, busy, fresh = (Path(tempfile.mkdtemp(dir=kernels, prefix="build-"))
                          for _ in range(3))
    lock = os.open(busy / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        for folder in (stale, busy):
            os.utime(folder, (old, old))
        monkeypatch.setattr(_cache, "_cleaned", set())  # as a new process finds them
        _cache.folder("kernels")
        assert not stale.exists() and busy.exists() and fresh.exists()
    finally:
        os.close(lock)
        shutil.rmtree(busy)
        shutil.rmtree(fresh)


def test_an_unwritable_cache_falls_back_to_a_private_one_said_once(tmp_path, monkeypatch):
    folder = tmp_path / "readonly"
    (folder / "emulator").mkdir(parents=True)
    monkeypatch.setenv("MLX_METALTILE_CACHE", str(folder))
    if os.geteuid() == 0:  # permissions do not stop root: the file system says no
        def refuse(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(_cache.tempfile, "mkstemp", refuse)
    else:
        (folder / "emulator").chmod(0o555)
    with pytest.warns(RuntimeWarning, match="cannot be written") as warned:
        assert em.unavailable_reason() is None
        root = _cache.root()
        assert _cache.root() == root
    assert len(warned) == 1
    assert root != folder / "emulator" and oct(root.stat().st_mode & 0o777) == "0o700"
    monkeypatch.undo()
    (folder / "emulator").chmod(0o755)


def test_a_full_disk_is_named_as_such(cache, monkeypatch):
    real = subprocess.run

    def full(cmd, *args, **kwargs):
        if "-c" in cmd:  # the kernel's compilation
            return subprocess.CompletedProcess(cmd, 1, "", "kernel.o: No space left on device")
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(_toolchain.subprocess, "run", full)
    with pytest.raises(_cache.CacheError, match="no space left on the device holding the "
                                                "cache folder"):
        _run(_source(6), "disk_full")
