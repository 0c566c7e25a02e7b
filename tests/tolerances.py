"""The tolerance check, for the test modules that import it from here (it lives in
mlx_metaltile.cases, shared with the benchmarks)."""

from mlx_metaltile._registry import TOLERANCES, Tolerance
from mlx_metaltile.cases import FLOAT32_TINY, assert_close, to_f64

__all__ = ["FLOAT32_TINY", "TOLERANCES", "Tolerance", "assert_close", "to_f64"]
