"""expert_qmv: one dispatch over GPU-resident ids vs gather_qmm vs a host-side expert loop.

Providers: ``metaltile`` (our kernel), ``mlx_native`` (``mx.gather_qmm`` with the ids on the
device, as mlx-lm's SwitchLinear), ``mlx_host_loop`` (one ``mx.quantized_matmul`` per
selected expert, ids already on the host: the sync it needs is not timed) and
``reference``. Bytes moved = the selected experts' weights, scales and biases + x + out.
The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. x, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/expert_qmv.py``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import mlx.core as mx
import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

from mlx_metaltile.cases.expert_qmv import host_loop as _expert_qmv_host_loop
from mlx_metaltile.ops.expert_qmv import expert_qmv_reference


def _reference(x, w, scales, indices, biases=None, host_ids=None, group_size=None, bits=None,
               mode="affine"):
    return expert_qmv_reference(x, w, scales, biases, indices, group_size=group_size, bits=bits,
                                mode=mode)


def _reference_for(case):
    """The reference with what the case's ``ours`` carries as keywords (the mxfp4 cases'
    mode, group_size, bits and biases=None)."""
    return partial(_reference, **case.ours.keywords) if isinstance(case.ours, partial) \
        else _reference


def _skip_inexact_native(case):
    # MLX's CPU quantized matmuls accumulate float16/bfloat16 in that dtype (errors ~1e-3 to
    # 1e-2 of the sum of |terms| at K = 2048): far outside the table, so not timed there.
    # Its Metal kernels accumulate in float32 and are checked like ours.
    if mx.default_device() == mx.cpu and case.dtype != mx.float32:
        pytest.skip(f"MLX's CPU quantized matmul accumulates in {case.dtype_name}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("expert_qmv"))
def test_expert_qmv(benchmark, case, provider):
    case = get_case("expert_qmv", case)
    if provider == "mlx_native":
        _skip_inexact_native(case)
    run_case(benchmark, case, provider, _reference_for(case))


@pytest.mark.parametrize("case", case_ids("expert_qmv"))
def test_expert_qmv_host_loop(benchmark, case):
    case = get_case("expert_qmv", case)
    if isinstance(case.ours, partial) or case.wrt:
        pytest.skip("the host loop takes the affine forward cases' host ids")
    _skip_inexact_native(case)
    run_case(benchmark, replace(case, native=_expert_qmv_host_loop), "mlx_native", _reference,
             provider_name="mlx_host_loop")
