"""Tiny random mlx-lm models, built from mlx-lm's own ModelArgs and classes, quantized.

Every width is a multiple of 64 (the quantization group size) and head dims are 64 (one
of sdpa_multi's), so each kernel path runs; two layers keep the emulator fast.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn

VOCAB = 128
_ROPE = dict(rope_theta=10000.0, max_position_embeddings=512)
_QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                 moe_intermediate_size=64, norm_topk_prob=True)
_LINEAR_ATTN = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=64,
                    linear_value_head_dim=64, linear_conv_kernel_dim=4,
                    full_attention_interval=2)

CONFIGS = {
    "llama": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, **_ROPE),
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, **_ROPE),
    "qwen3_moe": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, **_QWEN_MOE, **_ROPE),
    "mixtral": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, num_local_experts=8,
                    num_experts_per_tok=2, rope_theta=10000.0),
    # not named by mlx_metaltile anywhere: goes through the generic SwitchGLU path
    "olmoe": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                  num_experts=8, num_experts_per_tok=2, rope_theta=10000.0,
                  max_position_embeddings=512),
    # softmax over all experts, then the top k (no renormalisation); a gated shared expert
    "qwen2_moe": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
                      num_experts=8, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, rms_norm_eps=1e-6),
    "gpt_oss": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=64, head_dim=64,
                    num_attention_heads=2, num_key_value_heads=1, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=8, rope_theta=10000),
    "qwen3_next": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       rms_norm_eps=1e-6, partial_rotary_factor=0.25,
                       shared_expert_intermediate_size=64, **_LINEAR_ATTN, **_QWEN_MOE,
                       **_ROPE),
    # multi-head latent attention (DeepSeek-V3, Kimi-K2): the cache holds a latent and a
    # rotary key; attention runs on keys and values derived from them (mlx-lm's sdpa, not
    # sdpa_multi over the cache); the MoE block's grouped sigmoid routing is mlx-lm's
    "deepseek_v3": dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                        kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=64,
                        v_head_dim=64, qk_nope_head_dim=64, n_group=2, topk_group=1,
                        num_experts_per_tok=2, first_k_dense_replace=1,
                        max_position_embeddings=512),
    # its router module gives the ids and scores (a softmax over the top k of the logits);
    # no shared expert
    "granitemoe": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                       num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                       logits_scaling=1.0, attention_multiplier=0.125,
                       embedding_multiplier=1.0, residual_multiplier=1.0,
                       max_position_embeddings=512, attention_bias=False, rope_theta=10000.0,
                       num_local_experts=8, num_experts_per_tok=2),
    "qwen3_5": dict(text_config=dict(
        model_type="qwen3_5", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=VOCAB,
        rms_norm_eps=1e-6, **_LINEAR_ATTN)),
    "qwen3_5_moe": dict(text_config=dict(
        model_type="qwen3_5_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=VOCAB,
        rms_norm_eps=1e-6, shared_expert_intermediate_size=64, **_LINEAR_ATTN,
        **{k: v for k, v in _QWEN_MOE.items() if k != "mlp_only_layers"})),
}


def tiny_model(arch: str, *, seed: int = 0, mode: str = "affine", bits: int = 4,
               linear_mode: str = "affine", layers: int | None = None, **config):
    """mlx-lm's ``Model`` for ``arch`` with random weights, ``nn.quantize``d: experts in
    ``mode`` (affine: at ``bits``), linear layers in ``linear_mode``, the rest affine 4-bit.
    ``config`` overrides entries of the architecture's tiny ModelArgs."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = dict(CONFIGS[arch], model_type=arch, **config)
    if "text_config" not in config:
        config["vocab_size"] = VOCAB
    if layers is not None:
        config["num_hidden_layers"] = layers
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Random weights at a scale that keeps activations O(1) through the layers.
    model.update(_rescaled(model.parameters()))
    experts = dict(group_size=64, bits=bits) if mode == "affine" else dict(mode=mode)
    nn.quantize(model, **experts, class_predicate=lambda _, m: type(m).__name__ == "SwitchLinear")
    if linear_mode != "affine":
        nn.quantize(model, mode=linear_mode, class_predicate=lambda _, m: type(m) is nn.Linear)
    nn.quantize(model, group_size=64, bits=4)
    model.eval()
    mx.eval(model.parameters())
    return model


def _rescaled(params):
    from mlx.utils import tree_map

    return tree_map(lambda a: a if a.ndim < 2 else mx.random.normal(a.shape) * 0.08, params)
