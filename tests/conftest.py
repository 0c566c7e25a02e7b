"""Shared fixtures: backends as a test parameter, fresh random inputs."""

from __future__ import annotations

import contextlib
import re
import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_metaltile import _registry, backends

KERNEL_BACKENDS = ("emulator", "metal", "cuda")


def backend_params(*names: str):
    """pytest params for backends, marked so that absent ones skip with their reason."""
    params = []
    for name in names:
        marks = [getattr(pytest.mark, name)] if name in ("metal", "cuda") else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def require_backend(name: str) -> None:
    reason = backends.unavailable_reason(name)
    if reason is not None:
        pytest.skip(f"backend {name} unavailable: {reason}")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every kernel output starts as NaN on every kernel backend (not only through the
    emulator's own poison), so an element a kernel never writes fails its oracle."""
    real_launch = backends.launch

    def launch(*args, **kwargs):
        kwargs["init_value"] = float("nan")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(backends, "launch", launch)


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


# Methods of mx.array that evaluate its graph to read it on the host: conversions to Python
# scalars (truth tests, int(), float(), use as an index), text, DLPack and pickling.
SYNC_METHODS = ("item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__",
                "__complex__", "__repr__", "__str__", "__format__", "__dlpack__", "__getstate__")
# NumPy reads an mx.array through the buffer protocol, which patching __array__ does not
# reach (nor can Python 3.11 patch the buffer slot itself: memoryview(a) is not caught).
NUMPY_READERS = ("array", "asarray", "asanyarray", "ascontiguousarray")


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


def record_emulator_sources(monkeypatch, kernel) -> list[str]:
    """The generated source of every launch of an emulator kernel object from now on (it
    compiles one module per distinct source: what Metal would build as a pipeline)."""
    sources = []
    real_module = kernel._module

    def module(gen):
        sources.append(gen.source)
        return real_module(gen)

    monkeypatch.setattr(kernel, "_module", module)
    return sources


def input_space(source: str, name: str) -> tuple[str, str]:
    """(element type, address space) of array input ``name`` in a generated kernel source:
    MLX passes an input of fewer than 8 elements as ``constant``, others as ``device``."""
    (found,) = re.findall(rf"const (constant|device) (\w+)\* {name}\b", source)
    return found[1], found[0]


class LaunchRecorder:
    """Stands in for every kernel object: records each launch as (kernel name, template,
    inputs as (name, dtype, 0 for 0-d else 1), outputs as (name, dtype)) and returns zeros,
    so nothing runs."""

    def __init__(self):
        self.seen = []

    def get_kernel(self, spec, backend, input_names, output_names, atomic_outputs=False):
        def call(*, inputs, template, output_shapes, output_dtypes, **_):
            self.seen.append((spec.name, tuple(template),
                              tuple((n, a.dtype, min(a.ndim, 1))
                                    for n, a in zip(input_names, inputs, strict=True)),
                              tuple(zip(output_names, output_dtypes, strict=True))))
            return [mx.zeros(s, dtype=d)
                    for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return call

    def assert_declared(self):
        """Every recorded launch is one of the instantiations its op module declares (what
        the CUDA compile check builds)."""
        assert self.seen, "nothing was launched"
        for name, template, inputs, outputs in self.seen:
            declared = _registry.instantiations(_registry.get_spec(name))
            assert any(inst.template == template and inst.outputs == outputs
                       and tuple((n, d, min(nd, 1)) for n, d, nd in inst.inputs) == inputs
                       for inst in declared), (name, template, inputs, outputs)


@pytest.fixture
def launch_recorder(monkeypatch):
    """Ops launch through a LaunchRecorder, as on the metal backend."""
    recorder = LaunchRecorder()
    monkeypatch.setattr(backends, "get_kernel", recorder.get_kernel)
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "metal")
    return recorder
