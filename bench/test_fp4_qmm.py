"""fp4_qmm: our kernels vs MLX's mx.quantized_matmul(mode="mxfp4") vs the reference.

Shapes: M in {1, 8, 32, 512} (decode to prefill) x (N, K) in {(4096, 4096), (14336, 4096)},
float16 / bfloat16 / float32 activations, weights from mx.quantize(W, mode="mxfp4").
The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. x, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/fp4_qmm.py``.
"""

from __future__ import annotations

import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile.ops.fp4_qmm import fp4_qmm_reference


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("fp4_qmm"))
def test_fp4_qmm(benchmark, case, provider):
    run_case(benchmark, get_case("fp4_qmm", case), provider, fp4_qmm_reference)
