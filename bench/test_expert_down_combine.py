"""expert_down_combine (down projection, router scores and the sum over k in one dispatch)
vs mlx-lm (``gather_qmm``, then the MoE block's ``(y * scores[..., None]).sum(-2)``), and a
whole MoE block at decode: expert_glu + expert_down_combine (2 dispatches) vs mlx-lm's
SwitchGLU and the block's score sum, at one token of Qwen3-30B-A3B, Qwen3-Next-80B-A3B and
gpt-oss-20b (mxfp4). Bytes moved = the selected experts' weights + activations + out.
The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. h, the scores and the expert bias, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/expert_down_combine.py``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROVIDERS, case_ids, run_case, short_id

from mlx_metaltile.cases import cases
from mlx_metaltile.cases.expert_down_combine import block_cases
from mlx_metaltile.ops.expert_down_combine import expert_down_combine_reference
from mlx_metaltile.ops.expert_glu import expert_glu_reference

_BLOCKS = {short_id(c): c for c in block_cases()}


def _skip_cpu_native(provider):
    if provider == "mlx_native" and mx.default_device() == mx.cpu:
        pytest.skip("MLX's CPU quantized matmul accumulates bfloat16 in bfloat16 (inexact)")


def _reference(h, down, indices, scores, mode):
    return expert_down_combine_reference(h, *down[:3], indices, scores, bias=down[3],
                                         mode=mode)


def _block_reference(x, gate, up, down, indices, scores, activation, mode):
    h = expert_glu_reference(x, *gate[:3], *up[:3], indices, bias_gate=gate[3],
                             bias_up=up[3], activation=activation, mode=mode)
    return expert_down_combine_reference(h, *down[:3], indices, scores, bias=down[3],
                                         mode=mode)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("expert_down_combine"))
def test_expert_down_combine(benchmark, case, provider):
    case = {short_id(c): c for c in cases("expert_down_combine")}[case]
    _skip_cpu_native(provider)
    run_case(benchmark, case, provider, _reference)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", list(_BLOCKS))
def test_moe_block(benchmark, case, provider):
    _skip_cpu_native(provider)
    run_case(benchmark, _BLOCKS[case], provider, _block_reference)
