"""mlx-metaltile: hand-written Metal kernels as drop-in MLX ops."""

from importlib import metadata as _metadata

from . import nn
from ._registry import KernelSpec
from ._show import current_backend, kernels, launches
from .backends import available_backends, get_backend, set_backend, use_backend
from .ops import OPS as _OPS
from .patch import PatchReport, patch, unpatch

globals().update(_OPS)  # each op, e.g. mlx_metaltile.gated_rms_norm (see ops/__init__.py)

try:
    __version__ = _metadata.version("mlx-metaltile")
except _metadata.PackageNotFoundError:  # a source checkout that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "KernelSpec",
    "PatchReport",
    "available_backends",
    "current_backend",
    "get_backend",
    "kernels",
    "launches",
    "nn",
    "patch",
    "set_backend",
    "unpatch",
    "use_backend",
    *_OPS,
]
