"""One rank of tests/test_shard.py: ``python tests/shard_worker.py OUT BACKEND``.

Started by the test with MLX's ring backend environment (``MLX_RANK``, ``MLX_HOSTFILE``).
Each rank builds the same tiny models (same seed), computes the unsharded patched model's
logits, then shards a fresh copy with the architecture's own ``shard()`` and patches it in
both orders (``patch-shard``: patch, then shard; ``shard-patch``), and writes what it saw
to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_lm.models import cache as lmcache  # noqa: E402
from mlx_lm_models import CONFIGS, tiny_model  # noqa: E402

import mlx_metaltile as mt  # noqa: E402
from mlx_metaltile import backends  # noqa: E402
from mlx_metaltile import nn as mtnn  # noqa: E402

PROMPT = list(range(3, 35))  # 32 tokens x k=2 experts: the sorted prefill path
DECODE = (7, 11)
VERIFY = (13, 17, 19)
# Shard-compatible tiny models: heads and kv heads divisible by 2, and every dimension a
# sharded-to-all layer splits holds an even number of quantization groups (64 / 32).
MODELS = {
    "qwen3_moe": dict(moe_intermediate_size=128),  # attention + affine experts
    "qwen3": dict(linear_mode="mxfp4"),  # attention + mxfp4 linear layers
    # Gated-DeltaNet layers (gated norm), attention, experts and a sharded vocabulary
    "qwen3_5_moe": dict(text_config=dict(
        CONFIGS["qwen3_5_moe"]["text_config"], moe_intermediate_size=128,
        shared_expert_intermediate_size=128)),
}


def forward(model) -> list[mx.array]:
    cache = lmcache.make_prompt_cache(model)
    outs = [model(mx.array([PROMPT]), cache=cache)]
    outs += [model(mx.array([[t]]), cache=cache) for t in DECODE]
    outs.append(model(mx.array([VERIFY]), cache=cache))
    mx.eval(outs)
    return outs


def sharded_to_all(model) -> int:
    """Modules whose output sums per-rank partial results (sharded-to-all layers, and
    modules holding a sharding group: an all-reduce or gather in their __call__)."""
    return sum(type(m).__name__.endswith("ShardedToAllLinear")
               or getattr(m, "sharding_group", None) is not None
               for _, m in model.named_modules())


def unsharded(arch: str, backend: str) -> list[mx.array]:
    """The logits of the unsharded patched model."""
    model = tiny_model(arch, **MODELS[arch])
    mt.patch(model)
    with mt.use_backend(backend):
        return forward(model)


def run_case(arch: str, want, group, backend: str, order: str) -> dict:
    model = tiny_model(arch, **MODELS[arch])
    fallbacks_before = mtnn.fallbacks.copy()
    if order == "patch-shard":  # the report predates shard(): what runs is in "live"
        report = mt.patch(model)
        model.shard(group)
    else:
        model.shard(group)
        report = mt.patch(model)
    with mt.use_backend(backend):
        before = backends.launch_count(backend=backend)
        got = forward(model)
        launched = backends.launch_count(backend=backend) - before
    served = sorted({e.kind for e in report.replaced})
    left = {e.kind: e.detail for e in report.left}
    live = Counter(_kind(m) for _, m in model.named_modules())
    del live[None]
    errs = [mx.abs(g - w).max().item() for g, w in zip(got, want, strict=True)]
    scale = max(mx.abs(w).max().item() for w in want)
    out = dict(errs=errs, scale=scale, replaced=len(report.replaced), served=served,
               left=left, live=live, sharded_to_all=sharded_to_all(model), launched=launched,
               fallbacks=sum((mtnn.fallbacks - fallbacks_before).values()))
    if arch == "qwen3_moe" and order == "shard-patch":
        # a control: one MoE block without its all-reduce must fail the comparison
        model.model.layers[0].mlp.sharding_group = None
        with mt.use_backend(backend):
            bad = forward(model)
        out["control_errs"] = [mx.abs(b - w).max().item()
                               for b, w in zip(bad, want, strict=True)]
    mt.unpatch(model)
    return out


def _kind(module) -> str | None:
    """Which stand-in (or routed attention) this live module is, if any."""
    if hasattr(type(module), "_mlx_metaltile_base"):  # routed attention, MoE blocks
        return type(module)._mlx_metaltile_kind
    if isinstance(module, mtnn.Fp4Linear | mtnn.Fp4AllToShardedLinear
                  | mtnn.Fp4ShardedToAllLinear):
        return "fp4_linear"
    return {mtnn.SwitchGLU: "switch_glu", mtnn.GatedRMSNorm: "gated_rms_norm"}.get(
        type(module))


def main(out_dir: str, backend: str) -> None:
    group = mx.distributed.init(backend="ring", strict=True)
    cases = {}
    for arch in MODELS:
        want = unsharded(arch, backend)
        for order in ("patch-shard", "shard-patch"):
            cases[arch, order] = run_case(arch, want, group, backend, order)
    result = dict(rank=group.rank(), size=group.size(),
                  cases=[dict(arch=a, order=o, **r) for (a, o), r in cases.items()])
    Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
