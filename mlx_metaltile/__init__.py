"""mlx-metaltile: hand-written Metal kernels as drop-in MLX ops."""

from ._registry import KernelSpec
from ._show import current_backend, kernels, launches
from .backends import available_backends, get_backend, set_backend, use_backend
from .ops import expert_qmv, fp4_qmm, gated_rms_norm, moe_gather_qmm, sdpa_multi

__version__ = "0.1.0"

__all__ = [
    "KernelSpec",
    "available_backends",
    "current_backend",
    "expert_qmv",
    "fp4_qmm",
    "gated_rms_norm",
    "get_backend",
    "kernels",
    "launches",
    "moe_gather_qmm",
    "sdpa_multi",
    "set_backend",
    "use_backend",
]
