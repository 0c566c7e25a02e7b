"""mlx-metaltile: hand-written Metal kernels as drop-in MLX ops."""

from . import nn
from ._registry import KernelSpec
from ._show import current_backend, kernels, launches
from .backends import available_backends, get_backend, set_backend, use_backend
from .ops import expert_qmv, fp4_qmm, gated_rms_norm, moe_gather_qmm, sdpa_multi
from .patch import PatchReport, patch, unpatch

__version__ = "0.1.0"

__all__ = [
    "KernelSpec",
    "PatchReport",
    "available_backends",
    "current_backend",
    "expert_qmv",
    "fp4_qmm",
    "gated_rms_norm",
    "get_backend",
    "kernels",
    "launches",
    "moe_gather_qmm",
    "nn",
    "patch",
    "sdpa_multi",
    "set_backend",
    "unpatch",
    "use_backend",
]
