"""Fixtures of the op tests: a spy on every kernel launch, and deliberately broken kernels
for the negative controls."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, NamedTuple

import pytest

from mlx_metaltile import backends


class Launch(NamedTuple):
    name: str  # the kernel's registered name
    backend: str
    template: tuple  # (parameter, value) in the kernel's order
    inputs: tuple  # the input arrays, in the kernel's order
    stats: Any  # the emulator's launch statistics (None on other backends)

    @property
    def key(self) -> tuple:
        """What makes a new compiled kernel: name, template, (dtype, ndim) of every input."""
        return (self.name, self.template, tuple((a.dtype, a.ndim) for a in self.inputs))


@pytest.fixture
def launches(monkeypatch) -> list[Launch]:
    """Every kernel launch from now on, in order, as a Launch (the kernel runs as usual)."""
    records = []
    real_call = backends.Prepared.__call__

    def spy(prepared, *arrays):
        outs = real_call(prepared, *arrays)
        spec, backend = prepared.spec, prepared.backend
        stats = None
        if backend == "emulator":  # eager: the launch has run
            stats = importlib.import_module("mlx_metaltile.emulator").last_launch_stats()
        template = tuple((name, prepared.template[name]) for name in spec.params)
        records.append(Launch(spec.name, backend, template, tuple(prepared.bind(arrays)),
                              stats))
        return outs

    monkeypatch.setattr(backends.Prepared, "__call__", spy)
    return records


@pytest.fixture
def broken_kernel():
    """``broken_kernel(spec, (old, new), ...)``: until the test ends, ``spec``'s kernels are
    built from its template with those edits (mlx_metaltile.backends.template_override)."""
    with contextlib.ExitStack() as stack:
        yield lambda spec, *edits: stack.enter_context(backends.template_override(spec, *edits))
