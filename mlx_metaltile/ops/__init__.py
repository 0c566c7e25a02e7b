"""One module per op: checks, launcher, reference and public function."""

from .fp4_qmm import fp4_dequantize_reference, fp4_qmm, fp4_qmm_reference
from .gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from .moe_gather_qmm import moe_gather_qmm, moe_gather_qmm_reference

__all__ = [
    "fp4_dequantize_reference",
    "fp4_qmm",
    "fp4_qmm_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "moe_gather_qmm",
    "moe_gather_qmm_reference",
]
