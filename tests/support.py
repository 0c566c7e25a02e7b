"""Helpers of the test suite that test modules import by name (fixtures are in
conftest.py files: tests/conftest.py for every test, tests/ops/conftest.py for the ops)."""

from __future__ import annotations

import contextlib
import re

import mlx.core as mx
import pytest

from mlx_metaltile import _registry, backends

KERNEL_BACKENDS = ("emulator", "metal", "cuda")


def dtype_id(d: mx.Dtype) -> str:
    """A dtype's short name, for pytest ids (``float16``)."""
    return str(d).split(".")[-1]


def backend_params(*names: str):
    """pytest params for backends, marked so that absent ones skip with their reason."""
    params = []
    for name in names:
        marks = [getattr(pytest.mark, name)] if name in ("metal", "cuda") else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@contextlib.contextmanager
def strict_emulator(shuffle_seed):
    """Inside: emulator launches in strict mode with the threads' order permuted by
    ``shuffle_seed``; outside, the settings as they were."""
    from mlx_metaltile import emulator

    previous = emulator.configure(strict=True, shuffle_seed=shuffle_seed)
    try:
        yield
    finally:
        emulator.configure(strict=previous.strict, shuffle_seed=previous.shuffle_seed)


def require_backend(name: str) -> None:
    reason = backends.unavailable_reason(name)
    if reason is not None:
        pytest.skip(f"backend {name} unavailable: {reason}")


# Methods of mx.array that evaluate its graph to read it on the host: conversions to Python
# scalars (truth tests, int(), float(), use as an index), text, DLPack and pickling.
SYNC_METHODS = ("item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__",
                "__complex__", "__repr__", "__str__", "__format__", "__dlpack__", "__getstate__")
# NumPy reads an mx.array through the buffer protocol, which patching __array__ does not
# reach (nor can Python 3.11 patch the buffer slot itself: memoryview(a) is not caught).
NUMPY_READERS = ("array", "asarray", "asanyarray", "ascontiguousarray")


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

    def get_kernel(self, spec, backend):
        def call(*, inputs, template, output_shapes, output_dtypes, **_):
            self.seen.append((spec.name, tuple(template),
                              tuple((n, a.dtype, min(a.ndim, 1))
                                    for n, a in zip(spec.input_names, inputs, strict=True)),
                              tuple(zip(spec.output_names, output_dtypes, strict=True))))
            return [mx.zeros(s, dtype=d)
                    for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return call

    def assert_declared(self):
        """Every recorded launch is one of the instantiations its spec declares (what the
        CUDA compile check builds)."""
        assert self.seen, "nothing was launched"
        for name, template, inputs, outputs in self.seen:
            declared = _registry.instantiations(_registry.get_spec(name))
            assert any(inst.template == template and inst.outputs == outputs
                       and tuple((n, d, min(nd, 1)) for n, d, nd in inst.inputs) == inputs
                       for inst in declared), (name, template, inputs, outputs)


def replaced_modules(report) -> int:
    """``n`` of the patched models' float32 bound (tests/test_patch.py): the replaced
    modules on the forward path; a served MoE block and its SwitchGLU compute as one
    (``SwitchGLU.combine``), so they count once."""
    return sum(e.kind != "moe_block" for e in report.replaced)
