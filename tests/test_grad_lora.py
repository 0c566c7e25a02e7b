"""Fine-tuning through mt.patch: one mlx-lm LoRA training step (mlx_lm.tuner's
linear_to_lora_layers and the trainer's default_loss) on a tiny patched model gives the
unpatched model's loss and LoRA gradients, float32, on the reference and emulator backends.

LoRA goes on the attention projections, so the quantized experts stay quantized and are
served by the patch: the gradients flow through every op the patch installs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile._registry import TOLERANCES

pytest.importorskip("mlx_lm")
from mlx_lm.tuner.trainer import default_loss  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402
from mlx_lm_models import tiny_model  # noqa: E402
from support import replaced_modules  # noqa: E402

LORA_KEYS = {
    "qwen3_next": ["self_attn.q_proj", "self_attn.o_proj", "linear_attn.in_proj_qkvz",
                   "linear_attn.out_proj"],
    "qwen3_moe": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj"],
    "deepseek_v3": ["self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"],
}
# (index of an MoE layer, hidden size) of the tiny models whose MoE block's dx is checked
MOE_LAYER = {"qwen3_moe": (0, 64), "deepseek_v3": (1, 128)}
BATCH = mx.array([[1, 5, 9, 33, 2, 7, 100, 64, 3, 11], [4, 8, 15, 16, 23, 42, 0, 0, 0, 0]])
LENGTHS = mx.array([[1, 9], [1, 5]])  # (first, last) scored target of each row
# the two dispatches forward, then their backward's kernels (expert_qmv's, on kernel backends)
DECODE_KERNELS = ("expert_glu_simd_rows", "expert_down_combine_simd_rows",
                  "expert_qmv_simd_rows", "expert_qmv_dx")


def _lora_model(arch: str):
    model = tiny_model(arch)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0,
                                     "keys": LORA_KEYS[arch]})
    # lora_b starts at zero (then lora_a's gradient is zero): random small adapters instead.
    mx.random.seed(1)
    model.update(tree_map(lambda a: mx.random.normal(a.shape) * 0.05,
                          model.trainable_parameters()))
    mx.eval(model.parameters())
    return model


def _step(model):
    (loss, _), grads = nn.value_and_grad(model, default_loss)(model, BATCH, LENGTHS)
    mx.eval(loss, grads)
    return loss, dict(tree_flatten(grads))


@pytest.mark.parametrize("backend", ("reference", "emulator"))
@pytest.mark.parametrize("arch", tuple(LORA_KEYS))
def test_lora_step_through_patched_model(arch, backend):
    model = _lora_model(arch)
    want_loss, want = _step(model)
    report = mt.patch(model)
    served = {e.kind for e in report.replaced}
    assert "switch_glu" in served and "attention" in served
    try:
        with backends.use_backend(backend):
            before = backends.launch_count()
            backward = backends.launch_count("gated_rms_norm_backward")
            loss, got = _step(model)
            launched = backends.launch_count() - before
            backward = backends.launch_count("gated_rms_norm_backward") - backward
    finally:
        mt.unpatch(model)
    if backend != "reference":
        assert launched > 0  # the kernels ran, forward and backward
        assert (backward > 0) == ("gated_rms_norm" in served)
    # As test_patch's logits bound: the float32 accumulation slack per replaced module.
    slack = 2 * TOLERANCES["float32"].accum * replaced_modules(report)
    assert abs(loss.item() - want_loss.item()) <= slack * abs(want_loss.item())
    assert set(want) <= set(got) and len(want) >= 8
    for name, g in want.items():
        assert np.any(np.array(g) != 0), name
        err = mx.abs(got[name] - g).max().item()
        assert err <= slack * mx.abs(g).max().item(), (name, err)


@pytest.mark.parametrize("backend", ("reference", "emulator"))
@pytest.mark.parametrize("arch", tuple(MOE_LAYER))
def test_lora_step_at_decode_through_patched_moe(arch, backend):
    """Two tokens per row (fewer token-expert pairs than PREFILL_MIN_PAIRS): the patched
    MoE blocks take the decode path in two dispatches (expert_glu, then
    expert_down_combine); the loss, the LoRA gradients and the gradient w.r.t. the MoE
    block's input x are the unpatched model's, nonzero. DeepSeek-V3's x gradient also
    flows through its router's float32 scores into expert_down_combine's score input."""
    model = _lora_model(arch)
    batch, lengths = BATCH[:, :3], mx.array([[1, 2], [1, 2]])
    layer, hidden = MOE_LAYER[arch]
    x = mx.random.normal((2, 1, hidden))
    r = mx.random.normal(x.shape)

    def run():
        (loss, _), grads = nn.value_and_grad(model, default_loss)(model, batch, lengths)
        dx = mx.grad(lambda x: (model.model.layers[layer].mlp(x) * r).sum())(x)
        mx.eval(loss, grads, dx)
        return loss, dict(tree_flatten(grads)), dx

    want_loss, want, want_dx = run()
    report = mt.patch(model)
    try:
        with backends.use_backend(backend):
            before = {n: backends.launch_count(n) for n in DECODE_KERNELS}
            loss, got, dx = run()
            ran = {n: backends.launch_count(n) - before[n] for n in DECODE_KERNELS}
    finally:
        mt.unpatch(model)
    if backend != "reference":
        assert all(ran.values()), ran  # the blocks' two-dispatch path ran, and its backward
    slack = 2 * TOLERANCES["float32"].accum * replaced_modules(report)
    assert abs(loss.item() - want_loss.item()) <= slack * abs(want_loss.item())
    assert np.any(np.array(want_dx) != 0)
    assert mx.abs(dx - want_dx).max().item() <= slack * mx.abs(want_dx).max().item()
    for name, g in want.items():
        assert np.any(np.array(g) != 0), name
        err = mx.abs(got[name] - g).max().item()
        assert err <= slack * mx.abs(g).max().item(), (name, err)
