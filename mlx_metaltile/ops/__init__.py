"""One module per op: checks, launcher, reference and public function."""

from .expert_qmv import expert_qmv, expert_qmv_reference
from .gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from .sdpa_multi import sdpa_multi, sdpa_multi_reference

__all__ = [
    "expert_qmv",
    "expert_qmv_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "sdpa_multi",
    "sdpa_multi_reference",
]
