"""One module per op: checks, launcher, reference and public function."""

from .gated_rms_norm import gated_rms_norm, gated_rms_norm_reference

__all__ = ["gated_rms_norm", "gated_rms_norm_reference"]
