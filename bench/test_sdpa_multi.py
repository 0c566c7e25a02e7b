"""sdpa_multi: the kernel vs mx.fast.scaled_dot_product_attention on a cache slice vs the
reference composite. Bytes moved = q + the visible K/V once + out; flops = 4 * visible
(query, key) pairs * D. The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. q, k, v and the sinks, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/sdpa_multi.py``.

Run: python -m pytest bench/test_sdpa_multi.py --benchmark-only (-k "kv4k and L8" etc.).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROVIDERS, case_ids, default_check, get_case, run_case

from mlx_metaltile._registry import TOLERANCES
from mlx_metaltile.cases import bound, f64
from mlx_metaltile.cases.sdpa_multi import sdpa_multi_terms
from mlx_metaltile.ops.sdpa_multi import sdpa_multi_reference


def _check(case, provider, got, inputs):
    want, magnitude, p_magnitude = sdpa_multi_terms(**inputs)
    got = f64(got)
    limit = bound(want, case.dtype, magnitude)
    if provider == "mlx_native":
        # MLX's own attention may round scores or probabilities to the model dtype (its CPU
        # path does): allow two more roundings of the dtype, relative to the magnitude.
        limit = limit + 2 * TOLERANCES[case.dtype_name].rtol * p_magnitude
    err = np.abs(got - want)
    assert np.all(err <= limit), (f"{provider} is wrong for {case.id}: max err "
                                  f"{err.max():.3g}, max err/bound {(err / limit).max():.3g}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("sdpa_multi"))
def test_sdpa_multi(benchmark, case, provider):
    case = get_case("sdpa_multi", case)
    run_case(benchmark, case, provider, sdpa_multi_reference,
             check=default_check if case.wrt else _check)
