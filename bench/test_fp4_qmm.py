"""fp4_qmm: our kernels vs MLX's mx.quantized_matmul(mode="mxfp4") vs the reference.

Shapes: M in {1, 8, 32, 512} (decode to prefill) x (N, K) in {(4096, 4096), (14336, 4096)},
float16 / bfloat16 / float32 activations, weights from mx.quantize(W, mode="mxfp4").
"""

from __future__ import annotations

import pytest
from conftest import PROVIDERS, run_case

from mlx_metaltile.cases import cases
from mlx_metaltile.ops.fp4_qmm import fp4_qmm_reference

CASES = cases("fp4_qmm")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fp4_qmm(benchmark, case, provider):
    run_case(benchmark, case, provider, fp4_qmm_reference)
