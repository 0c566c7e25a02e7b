"""gated_rms_norm: fused kernel vs MLX's rms_norm + gate composite vs the reference.

The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. y, z and weight, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/gated_rms_norm.py``."""

from __future__ import annotations

import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile.ops.gated_rms_norm import gated_rms_norm_reference


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("gated_rms_norm"))
def test_gated_rms_norm(benchmark, case, provider):
    run_case(benchmark, get_case("gated_rms_norm", case), provider, gated_rms_norm_reference)
