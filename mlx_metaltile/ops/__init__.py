"""One module per op: checks, launcher, reference and public function."""

from .expert_qmv import expert_qmv, expert_qmv_reference
from .fp4_qmm import fp4_dequantize_reference, fp4_qmm, fp4_qmm_reference
from .gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from .moe_gather_qmm import moe_gather_qmm, moe_gather_qmm_reference
from .sdpa_multi import sdpa_multi, sdpa_multi_reference

__all__ = [
    "expert_qmv",
    "expert_qmv_reference",
    "fp4_dequantize_reference",
    "fp4_qmm",
    "fp4_qmm_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "moe_gather_qmm",
    "moe_gather_qmm_reference",
    "sdpa_multi",
    "sdpa_multi_reference",
]
