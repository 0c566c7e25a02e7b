"""moe_route (an MoE router's top-k ids and scores in one dispatch) vs mlx-lm's routing
after the router matmul (softmax, argpartition, take_along_axis and the renormalisation),
at the router shapes of Qwen3-30B-A3B, Qwen3-Next-80B-A3B, gpt-oss-20b and OLMoE, one token
and 512. Both sides end in the same put_along_axis of the scores to [tokens, E] (so that
argpartition's unordered slots compare). The ``grad-`` cases time forward + backward
(``mx.vjp`` w.r.t. the logits); their bytes are stated in
``mlx_metaltile/cases/moe_route.py``."""

from __future__ import annotations

import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile.cases.moe_route import dense
from mlx_metaltile.ops.moe_route import moe_route_reference


def _reference(logits, k, normalize):
    return dense(*moe_route_reference(logits, k, normalize=normalize), logits.shape[-1])


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("moe_route"))
def test_moe_route(benchmark, case, provider):
    run_case(benchmark, get_case("moe_route", case), provider, _reference)
