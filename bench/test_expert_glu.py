"""expert_glu: gate, up and the activation in one dispatch vs mlx-lm's SwitchGLU composite
(two ``gather_qmm`` and the activation; expert biases added as mlx-lm adds them) at one
decode token of Qwen3-30B-A3B, Qwen3-Next-80B-A3B and gpt-oss-20b (mxfp4, biases, clamped
SwiGLU). Bytes moved = the selected experts' gate and up weights + x + out.
The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. x and the expert biases, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/expert_glu.py``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile.ops.expert_glu import expert_glu_reference


def _reference(x, gate, up, indices, activation, mode):
    return expert_glu_reference(x, *gate[:3], *up[:3], indices, bias_gate=gate[3],
                                bias_up=up[3], activation=activation, mode=mode)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("expert_glu"))
def test_expert_glu(benchmark, case, provider):
    case = get_case("expert_glu", case)
    if provider == "mlx_native" and mx.default_device() == mx.cpu:
        pytest.skip("MLX's CPU quantized matmul accumulates bfloat16 in bfloat16 (inexact)")
    run_case(benchmark, case, provider, _reference)
