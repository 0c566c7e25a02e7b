"""moe_gather_qmm: the kernel vs mx.gather_qmm (sorted rows) vs the pure-MLX reference.

E=128 experts with top-8 routing, M in {8, 32, 128, 1024} rows (tokens x 8), the two MoE
projection shapes N=768/K=2048 and N=2048/K=768, bits 4 and 8, bfloat16 (and float32 for a
few), group size 64. ``extra_info`` records the bytes a perfect kernel moves (x, the touched
experts' codes, scales and biases, indices, out) and 2*M*N*K flops.
The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. x, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/moe_gather_qmm.py``.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile.ops.moe_gather_qmm import moe_gather_qmm_reference


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("moe_gather_qmm"))
def test_moe_gather_qmm(benchmark, case, provider):
    case = get_case("moe_gather_qmm", case)
    if provider == "mlx_native" and case.dtype != mx.float32 and not mx.metal.is_available():
        # MLX's CPU gather_qmm accumulates bfloat16 in bfloat16 (hundreds of ulps off at
        # K=2048): the suite's correctness check rejects it, so only float32 is timed here.
        pytest.skip("MLX's CPU gather_qmm accumulates in the activation dtype (inexact)")
    # the reference with the keywords the case's ours carries (group_size and bits; the
    # mxfp4 cases' mode and biases=None too); a grad case's is the op on the reference backend
    run_case(benchmark, case, provider,
             None if case.wrt else partial(moe_gather_qmm_reference, **case.ours.keywords))
