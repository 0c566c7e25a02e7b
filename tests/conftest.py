"""Shared fixtures: backends as a test parameter, fresh random inputs."""

from __future__ import annotations

import contextlib
import os
import zlib

# The float64 oracles and the tolerance table hold float32 to float32 precision; MLX runs
# float32 matmuls in TF32 by default on NVIDIA GPUs (and M5-class Apple GPUs), which the
# composites behind the reference backend and the VJPs use. Tests ask for full float32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np
import pytest
from support import (
    KERNEL_BACKENDS,
    NUMPY_READERS,
    SYNC_METHODS,
    LaunchRecorder,
    backend_params,
    require_backend,
)

from mlx_metaltile import backends
from mlx_metaltile.ops._common import clear_plans


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test starts with no remembered op plans: a test that replaces an op's helpers,
    constants or launcher sees them used (a plan reads them once, when it is built)."""
    clear_plans()
    yield
    clear_plans()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every kernel output starts as NaN on every kernel backend (not only through the
    emulator's own poison), so an element a kernel never writes fails its oracle."""
    real_prepare = backends.prepare

    def prepare(*args, **kwargs):
        kwargs["init_value"] = float("nan")
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(backends, "prepare", prepare)
    clear_plans()


@pytest.fixture(params=backend_params(*KERNEL_BACKENDS))
def kernel_backend(request):
    """Each kernel-executing backend available here (emulator in CI)."""
    require_backend(request.param)
    with backends.use_backend(request.param):
        yield request.param


@pytest.fixture(params=backend_params("reference", *KERNEL_BACKENDS))
def any_backend(request):
    """The reference backend plus each kernel-executing backend available here."""
    require_backend(request.param)
    with backends.use_backend(request.param):
        yield request.param


@pytest.fixture
def rng(request):
    """A fresh generator per test (seeded from the test id so failures reproduce)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def no_host_sync(monkeypatch):
    """A context inside which evaluating the graph or reading an array on the host raises:
    an op called there may only add nodes to the lazy graph."""
    def sync(*args, **kwargs):
        raise AssertionError("the op evaluated its graph")

    def numpy_reader(real):
        def read(obj, *args, **kwargs):
            if isinstance(obj, mx.array):
                sync()
            return real(obj, *args, **kwargs)
        return read

    @contextlib.contextmanager
    def forbid():
        with monkeypatch.context() as m:
            m.setattr(mx, "eval", sync)
            m.setattr(mx, "async_eval", sync)
            for name in SYNC_METHODS:
                m.setattr(mx.array, name, sync, raising=False)
            for name in NUMPY_READERS:
                m.setattr(np, name, numpy_reader(getattr(np, name)))
            yield
    return forbid


@pytest.fixture
def launch_recorder(monkeypatch):
    """Ops launch through a LaunchRecorder, as on the metal backend."""
    recorder = LaunchRecorder()
    monkeypatch.setattr(backends, "get_kernel", recorder.get_kernel)
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "metal")
    return recorder
