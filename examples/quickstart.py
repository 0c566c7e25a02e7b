"""mlx-metaltile quickstart: which backend runs the kernels here, each op checked against a
float64 oracle on it, the kernel registry, and how many times each kernel launched.

Runs on any machine: an Apple GPU (metal), an NVIDIA GPU (cuda), or only a CPU, where the
kernels run on the MSL emulator (a C++20 compiler is needed) or, without one, the ops run
their pure-MLX reference composites. Run: python examples/quickstart.py
"""

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt
from mlx_metaltile import _measure
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
