"""mlx-metaltile quickstart: which backend runs the kernels here, each op checked against a
float64 oracle on it, the kernel registry, how many times each kernel launched, and a tiny
mlx-lm model patched with mt.patch against the unpatched one.

Runs on any machine: an Apple GPU (metal), an NVIDIA GPU (cuda), or only a CPU, where the
kernels run on the MSL emulator (a C++20 compiler is needed) or, without one, the ops run
their pure-MLX reference composites. Run: python examples/quickstart.py
"""

from itertools import islice

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_moe

import mlx_metaltile as mt
from mlx_metaltile import _measure, backends
from mlx_metaltile._registry import TOLERANCES
from mlx_metaltile.cases import cases

# 1. Backends: None = can run here, else the reason it cannot.
for name, reason in mt.available_backends().items():
    print(f"{name:<10} {'available' if reason is None else reason}")
available = [b for b in ("metal", "cuda", "emulator") if mt.available_backends()[b] is None]
backend = available[0] if available else "reference"
mt.set_backend(backend)
print("op calls run on:", mt.current_backend())

# 2. One op by hand: the fused gated RMSNorm against its definition in float64.
rng = np.random.default_rng(0)
# bfloat16 hidden states and gate, a float32 weight (any float dtypes; out in y's, as mlx-lm)
y = mx.array(rng.standard_normal((4, 2048), dtype=np.float32)).astype(mx.bfloat16)
z = mx.array(rng.standard_normal((4, 2048), dtype=np.float32)).astype(mx.bfloat16)
w = mx.array(rng.uniform(-2, 2, 2048).astype(np.float32))
out = mt.gated_rms_norm(y, z, w, eps=1e-5)
y64, z64 = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (y, z))
w64 = np.array(w, dtype=np.float64)
want = w64 * y64 / np.sqrt(np.mean(y64**2, axis=-1, keepdims=True) + 1e-5) * z64 / (1 + np.exp(-z64))
got = np.array(out.astype(mx.float32), dtype=np.float64)
rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
print(f"gated_rms_norm: max relative error {rel.max():.2e} (one bfloat16 rounding: up to "
      f"{2**-8:.2e})")

# 3. Every op on its smallest benchmark case, against the case's float64 oracle.
for op in dict.fromkeys(c.op for c in cases()):
    case = min(cases(op), key=lambda c: c.nbytes)
    inputs = case.make(np.random.default_rng(0))
    err = _measure.error(case, case.ours(**inputs), inputs)
    print(f"{case.id:<50} max |error| {err.abs:.2e}  relative {err.rel:.1e}  "
          f"{'within' if err.ok else 'OUTSIDE'} the tolerance table")
    assert err.ok, case.id

# 4. The kernel registry, and the kernels that ran above.
print(mt.kernels())
print(mt.launches())

# 5. A tiny random Qwen3-MoE from mlx-lm's own ModelArgs, 4-bit, patched in place.
args = qwen3_moe.ModelArgs(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, num_hidden_layers=2,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
    mlp_only_layers=[], moe_intermediate_size=64, norm_topk_prob=True)
mx.random.seed(0)
model = qwen3_moe.Model(args)
# random weights at a scale that keeps activations O(1) through the layers
model.update(tree_map(lambda a: a if a.ndim < 2 else mx.random.normal(a.shape) * 0.08,
                      model.parameters()))
nn.quantize(model, group_size=64, bits=4)
model.eval()
prompt = mx.array([list(range(3, 35))])
want = model(prompt)
mx.eval(want)  # the unpatched logits, computed before patching
report = mt.patch(model)
print(report)
before = backends.launch_count(backend=mt.current_backend())
got = model(prompt)
mx.eval(got)
launched = backends.launch_count(backend=mt.current_backend()) - before
# Each replaced module is within float32 accumulation error (accum, relative) of the module it
# stands in for; summed over the replaced modules (the bound tests/test_patch.py uses; a MoE
# block and its SwitchGLU compute as one, SwitchGLU.combine, so they count once):
err = mx.abs(got - want).max().item()
served = sum(e.kind != "moe_block" for e in report.replaced)
bound = 2 * TOLERANCES["float32"].accum * served * mx.abs(want).max().item()
print(f"patched forward: {launched} kernel launches; max |patched - unpatched| logits "
      f"{err:.2e} (bound {bound:.2e})")
assert err <= bound, (err, bound)


def greedy(n=8):
    return [token for token, _ in islice(generate_step(prompt[0, :9], model), n)]


patched_tokens = greedy()
mt.unpatch(model)
unpatched_tokens = greedy()
print("greedy tokens, patched:  ", patched_tokens)
print("greedy tokens, unpatched:", unpatched_tokens)
assert patched_tokens == unpatched_tokens
