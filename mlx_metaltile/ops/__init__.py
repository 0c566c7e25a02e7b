"""One module per op: checks, launcher, reference and public function."""

from .gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from .sdpa_multi import sdpa_multi, sdpa_multi_reference

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "sdpa_multi", "sdpa_multi_reference"]
