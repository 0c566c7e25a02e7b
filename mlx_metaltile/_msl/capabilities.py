"""MSL features that an executor does not provide, refused when the kernel is made.

A kernel using one fails at ``metal_kernel(...)`` with the same message on every executor
that lacks the feature, never later with a compiler error. The CUDA layer has no swizzles
(``v.xy`` is member syntax C++ cannot give a struct without rewriting the source) and no
packed vectors; the emulator and Metal have both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_COMPONENTS = r"(?:[xyzw]{2,4}|[rgba]{2,4})"
_SCALARS = r"(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)"


@dataclass(frozen=True)
class Feature:
    name: str  # what the message calls it
    pattern: re.Pattern
    lacking: frozenset[str]  # executors that refuse it


FEATURES: tuple[Feature, ...] = (
    Feature("vector swizzles (such as .xy)",
            re.compile(rf"\.{_COMPONENTS}\b(?!\s*\()"), frozenset({"cuda"})),
    Feature("packed vector types (such as packed_float3)",
            re.compile(rf"\bpacked_{_SCALARS}[234]\b"), frozenset({"cuda"})),
)


def check_supported(executor: str, kernel: str, source: str, header: str) -> None:
    """Raise ValueError if the kernel uses an MSL feature this executor lacks."""
    for feature in FEATURES:
        if executor in feature.lacking and (feature.pattern.search(source)
                                            or feature.pattern.search(header)):
            raise ValueError(f"[metal_kernel] kernel {kernel!r} uses {feature.name}, which "
                             f"the {executor} executor does not support.")
