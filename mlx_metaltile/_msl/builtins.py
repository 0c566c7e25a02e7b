"""The MSL built-in attributes, with how each executor provides them (stated once).

On Metal they are kernel parameters (``uint3 thread_position_in_grid
[[thread_position_in_grid]]``) that MLX adds when the body mentions them, in the order below.
The emulator reads them from the runtime's per-thread ids (``mt_ids* t``); the CUDA layer
computes them from CUDA's indices, with the fields in braces filled by ``cuda/_translate.py``
(``{grid}`` and ``{tptg}`` depend on whether the grid overhangs the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

SIMD_WIDTH = 32  # Apple SIMD-groups and NVIDIA warps alike


@dataclass(frozen=True)
class Builtin:
    name: str
    type: str  # MSL type: "uint" or "uint3"
    emulator: str  # C++ expression over ``const mt_ids* t``
    cuda: str  # CUDA expression template (fields: see cuda/_translate.py)


def _ids3(field: str) -> str:
    return f"uint3(t->{field}[0], t->{field}[1], t->{field}[2])"


# In MLX's order (the order of the generated parameters).
BUILTINS: tuple[Builtin, ...] = (
    Builtin("dispatch_quadgroups_per_threadgroup", "uint",
            "t->dispatch_quadgroups_per_threadgroup", "(({dispatch_size} + 3u) / 4u)"),
    Builtin("dispatch_simdgroups_per_threadgroup", "uint",
            "t->dispatch_simdgroups_per_threadgroup",
            "(({dispatch_size} + {width_minus_1}u) / {width}u)"),
    Builtin("dispatch_threads_per_threadgroup", "uint3",
            _ids3("dispatch_threads_per_threadgroup"), "{block_dim}"),
    Builtin("grid_origin", "uint3", "uint3(0u, 0u, 0u)", "uint3(0u)"),
    Builtin("grid_size", "uint3", _ids3("threads_per_grid"), "{grid}"),
    Builtin("quadgroup_index_in_threadgroup", "uint", "t->quadgroup_index_in_threadgroup",
            "({linear} / 4u)"),
    Builtin("quadgroups_per_threadgroup", "uint", "t->quadgroups_per_threadgroup",
            "(({size} + 3u) / 4u)"),
    Builtin("simdgroup_index_in_threadgroup", "uint", "t->simdgroup_index_in_threadgroup",
            "({linear} / {width}u)"),
    Builtin("simdgroups_per_threadgroup", "uint", "t->simdgroups_per_threadgroup",
            "(({size} + {width_minus_1}u) / {width}u)"),
    Builtin("thread_execution_width", "uint", f"{SIMD_WIDTH}u", "{width}u"),
    Builtin("thread_index_in_quadgroup", "uint", "t->thread_index_in_quadgroup",
            "({linear} % 4u)"),
    # warps are cut from the linear thread index, so the lane is that index mod 32
    Builtin("thread_index_in_simdgroup", "uint", "t->thread_index_in_simdgroup",
            "({linear} % {width}u)"),
    Builtin("thread_index_in_threadgroup", "uint", "t->thread_index_in_threadgroup",
            "{linear}"),
    Builtin("thread_position_in_grid", "uint3", _ids3("thread_position_in_grid"),
            "{position}"),
    Builtin("thread_position_in_threadgroup", "uint3",
            _ids3("thread_position_in_threadgroup"), "{thread_idx}"),
    Builtin("threadgroup_position_in_grid", "uint3", _ids3("threadgroup_position_in_grid"),
            "{block_idx}"),
    Builtin("threadgroups_per_grid", "uint3", _ids3("threadgroups_per_grid"), "{grid_dim}"),
    Builtin("threads_per_grid", "uint3", _ids3("threads_per_grid"), "{grid}"),
    Builtin("threads_per_simdgroup", "uint", f"{SIMD_WIDTH}u", "{width}u"),
    Builtin("threads_per_threadgroup", "uint3", _ids3("threads_per_threadgroup"), "{tptg}"),
)
BY_NAME: dict[str, Builtin] = {b.name: b for b in BUILTINS}

# (attribute, type) in MLX's order
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = tuple((b.name, b.type) for b in BUILTINS)
