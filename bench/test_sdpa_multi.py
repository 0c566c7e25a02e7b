"""sdpa_multi: the kernel vs mx.fast.scaled_dot_product_attention on a cache slice vs the
reference composite. Bytes moved = q + the visible K/V once + out; flops = 4 * visible
(query, key) pairs * D.

Run: python -m pytest bench/test_sdpa_multi.py --benchmark-only (-k "kv4k and L8" etc.).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile._bench_cases import f64, sdpa_multi_terms
from mlx_metaltile._registry import TOLERANCES
from mlx_metaltile.ops.sdpa_multi import sdpa_multi_reference


def _check(case, provider, got, inputs):
    want, magnitude, p_magnitude = sdpa_multi_terms(**inputs)
    got = f64(got)
    tol = TOLERANCES[case.dtype_name]
    bound = tol.atol + tol.rtol * np.abs(want) + tol.accum * magnitude
    if provider == "mlx_native":
        # MLX's own attention may round scores or probabilities to the model dtype (its CPU
        # path does): allow two more roundings of the dtype, relative to the magnitude.
        bound = bound + 2 * tol.rtol * p_magnitude
    err = np.abs(got - want)
    assert np.all(err <= bound), (f"{provider} is wrong for {case.id}: max err "
                                  f"{err.max():.3g}, max err/bound {(err / bound).max():.3g}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("sdpa_multi"))
def test_sdpa_multi(benchmark, case, provider):
    run_case(benchmark, get_case("sdpa_multi", case), provider, sdpa_multi_reference,
             check=_check)
