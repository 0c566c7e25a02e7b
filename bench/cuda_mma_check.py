"""simdgroup_matrix products on the CUDA backend: tensor cores (half / bfloat fragments) against
the shuffle-and-FMA path (float fragments), in one GEMM kernel written as the ops write theirs.

    python bench/cuda_mma_check.py [--m 512] [--n 4096] [--k 4096] [--iters 20]

The kernel is fp4_qmm_simdgroup.metal's tiling without the dequantisation: out[M, N] =
x[M, K] @ w[N, K]^T, a threadgroup of 4 simdgroups per 32x32 tile, K in steps of 32 staged in
threadgroup memory as S, 2x2 float accumulators per simdgroup. S = float (what fp4_qmm and
moe_gather_qmm stage for float32 x and where T would round a weight) multiplies on warp shuffles
and FMAs; S = T (half or bfloat, what they stage where exact) multiplies on mma.sync.
bench/cuda_fragments_check.py times the two ops themselves. Each result is checked against a float64 NumPy oracle under the
tolerance table before it is timed. Needs MLX's CUDA build and an NVIDIA GPU (sm_80+ for
the tensor cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from mlx_metaltile import cuda  # noqa: E402
from mlx_metaltile._measure import samples  # noqa: E402
from mlx_metaltile._registry import TOLERANCES  # noqa: E402

SOURCE = """
constexpr uint BM = 32;
constexpr uint BN = 32;
constexpr uint BK = 32;
constexpr uint LD = BK + 4;
threadgroup S xs[BM * LD];
threadgroup S ws[BN * LD];
threadgroup float os[BM * BN];
const uint M = m_rows;
const uint N = n_cols;
const uint K = k_cols;
const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n_tile = threadgroup_position_in_grid.x * BN;
const uint m_tile = threadgroup_position_in_grid.y * BM;
const uint lr = tid / 4;
const uint lc = (tid % 4) * 8;
const bool x_row_ok = m_tile + lr < M;
const size_t x_off = size_t(min(m_tile + lr, M - 1)) * K + lc;
const size_t w_off = size_t(n_tile + lr) * K + lc;
const uint sm = (sg / 2) * 16;
const uint sn = (sg % 2) * 16;
simdgroup_float8x8 acc[2][2];
for (uint i = 0; i < 2; ++i) {
  for (uint j = 0; j < 2; ++j) {
    acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}
for (uint k0 = 0; k0 < K; k0 += BK) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint j = 0; j < 8; ++j) {
    xs[lr * LD + lc + j] = x_row_ok ? S(x[x_off + k0 + j]) : S(0);
    ws[lr * LD + lc + j] = S(w[w_off + k0 + j]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint kk = 0; kk < BK; kk += 8) {
    simdgroup_matrix<S, 8, 8> a[2];
    simdgroup_matrix<S, 8, 8> b[2];
    for (uint i = 0; i < 2; ++i) {
      simdgroup_load(a[i], xs + (sm + 8 * i) * LD + kk, LD);
      simdgroup_load(b[i], ws + (sn + 8 * i) * LD + kk, LD, ulong2(0, 0), true);
    }
    for (uint i = 0; i < 2; ++i) {
      for (uint j = 0; j < 2; ++j) {
        simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
      }
    }
  }
}
for (uint i = 0; i < 2; ++i) {
  for (uint j = 0; j < 2; ++j) {
    simdgroup_store(acc[i][j], os + (sm + 8 * i) * BN + sn + 8 * j, BN);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (x_row_ok) {
  for (uint j = 0; j < 8; ++j) {
    out[(m_tile + lr) * N + n_tile + lc + j] = T(os[lr * BN + lc + j]);
  }
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=512)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    reason = cuda.unavailable_reason()
    if reason is not None:
        print(f"cuda backend unavailable: {reason}")
        return 1
    m, n, k = args.m, args.n, args.k
    if n % 32 or k % 32:
        raise ValueError(f"[cuda_mma_check] N and K must be multiples of 32, got N={n}, K={k}")
    kernel = cuda.metal_kernel(name="mt_mma_check", input_names=["x", "w", "m_rows", "n_cols",
                                                                 "k_cols"],
                               output_names=["out"], source=SOURCE)
    rng = np.random.default_rng(0)
    print(f"M={m} N={n} K={k}")
    for dtype in (mx.bfloat16, mx.float16):
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
        x64 = np.array(x.astype(mx.float32)).astype(np.float64)
        w64 = np.array(w.astype(mx.float32)).astype(np.float64)
        want = x64 @ w64.T
        mag = np.abs(x64) @ np.abs(w64).T
        name = str(dtype).rsplit(".", 1)[-1]
        tol = TOLERANCES[name]
        times = {}
        for stage in (mx.float32, dtype):
            def call(x, w, stage=stage, dtype=dtype):
                return kernel(inputs=[x, w, mx.array(m, mx.uint32), mx.array(n, mx.uint32),
                                      mx.array(k, mx.uint32)],
                              template=[("T", dtype), ("S", stage)],
                              grid=(128 * (n // 32), -(-m // 32), 1), threadgroup=(128, 1, 1),
                              output_shapes=[(m, n)], output_dtypes=[dtype],
                              init_value=float("nan"))[0]
            got = np.array(call(x, w).astype(mx.float32)).astype(np.float64)
            bound = tol.atol + tol.rtol * np.abs(want) + tol.accum * mag
            bad = int((~(np.abs(got - want) <= bound)).sum())
            if bad:
                print(f"{name}: staging {stage}: {bad} elements out of tolerance")
                return 1
            per_call = statistics.median(samples(call, [{"x": x, "w": w}], 3, args.iters, 8))
            times[stage] = per_call
            path = "shuffles + FMAs" if stage == mx.float32 else "mma.sync"
            print(f"{name:9s} fragments {str(stage).rsplit('.', 1)[-1]:9s} ({path:15s}): "
                  f"{per_call * 1e3:8.3f} ms  {2 * m * n * k / per_call / 1e12:6.2f} TFLOP/s")
        print(f"{name:9s} speed-up of {name} fragments: {times[mx.float32] / times[dtype]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
