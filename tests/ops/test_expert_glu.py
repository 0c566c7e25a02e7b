"""expert_glu against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import to_f64
from mlx_metaltile.cases.expert_glu import (
    make_experts,
    make_x,
    project,
    run_and_check,
    sharing,
)

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.expert_glu")
# (mode, group_size, bits): affine at both widths and each group size once, the fp modes
QUANT = (("affine", 32, 4), ("affine", 64, 8), ("affine", 128, 4), ("mxfp4", 32, 4),
         ("nvfp4", 16, 4), ("mxfp8", 32, 8))


def _dname(d):
    return str(d).rsplit(".", 1)[-1]


def _pair(rng, n_experts, n_out, n_in, dtype, mode="affine", group_size=64, bits=4,
          bias=False, scale=1.0):
    return tuple(make_experts(rng, n_experts, n_out, n_in, dtype, mode, group_size, bits,
                              bias=bias, scale=scale) for _ in range(2))


SHARED = op_module.SHARED_SPEC.name
UNSHARED = op_module.SPEC.name


@pytest.fixture
def emulated():
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    with backends.use_backend("emulator"):
        yield


def _passes(ids, n_experts, max_shared=4):
    """Per valid expert named by ``ids``, ceil(its pairs / MAX_SHARED): the passes the
    sharing form makes over its rows (SHARING)."""
    ids = np.array(ids).astype(np.int64).ravel()
    counts = np.bincount(ids[(ids >= 0) & (ids < n_experts)], minlength=n_experts)
    return -(-counts // max_shared)


def _assert_reads(stats, *, expert_reads, valid_pairs, pairs, n_out, n_in, itemsize,
                  mode="affine", group_size=64, bits=4, bias=True):
    """Emulator counters: each projection's rows (words, scales, biases) and bias rows read
    ``expert_reads`` times (of one expert), x once per 4-row block per valid pair, out
    written once, [pairs, N]."""
    scale_size = itemsize if mode == "affine" else 1
    for proj in ("gate", "up"):
        assert stats.bytes_read[f"w_{proj}"] == expert_reads * n_out * (n_in * bits // 32) * 4
        scale_bytes = expert_reads * n_out * (n_in // group_size) * scale_size
        assert stats.bytes_read[f"scales_{proj}"] == scale_bytes
        assert stats.bytes_read[f"biases_{proj}"] == (scale_bytes if mode == "affine" else 0)
        assert stats.bytes_read.get(f"bias_{proj}", 0) == (
            expert_reads * n_out * itemsize if bias else 0)
    assert stats.bytes_read["x"] == valid_pairs * -(-n_out // 4) * n_in * itemsize
    assert stats.bytes_written["out"] == pairs * n_out * itemsize
    assert stats.bytes_read["out"] == 0


# ---- correctness ----------------------------------------------------------------------

@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("mode, group_size, bits", QUANT, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_matches_oracle(any_backend, poisoned_outputs, rng, dtype, mode, group_size, bits,
                        activation, bias):
    """N = 13 (a ragged 8-row tile), K = 4 groups of 32 (a partial 32-lane step for the
    wider groups), ids 0 / E-1 / repeated within a token."""
    n_experts, n_out, n_in = 6, 13, 4 * max(group_size, 32)
    gate, up = _pair(rng, n_experts, n_out, n_in, dtype, mode, group_size, bits, bias=bias)
    ids = mx.array([[0, 5], [3, 3], [5, 0]], dtype=mx.uint32)
    x = make_x(rng, (3, n_in), dtype)
    run_and_check(x, gate, up, ids, any_backend, activation=activation, mode=mode,
                  group_size=group_size, bits=bits)


@pytest.mark.parametrize("mode, group_size, bits, n_in", [
    ("affine", 32, 4, 896), ("affine", 32, 8, 416), ("nvfp4", 16, 4, 896),
    ("mxfp8", 32, 8, 416)], ids=lambda v: str(v))
def test_partial_step_splits_lane_words(any_backend, poisoned_outputs, rng, mode, group_size,
                                        bits, n_in):
    """A step holds 64 words of a row, lane l words l and 32 + l: K of one full step and 48
    or 40 words more, so the last step's second words cover only some lanes (and, with S > 1
    on cuda, the K groups hold unequal numbers of words)."""
    gate, up = _pair(rng, 4, 16, n_in, mx.bfloat16, mode, group_size, bits, bias=True)
    ids = mx.array([[3, 0], [1, 1]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, n_in), mx.bfloat16), gate, up, ids, any_backend,
                  activation="swiglu_oai", mode=mode, group_size=group_size, bits=bits)


@pytest.mark.parametrize("bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("activation", ("silu", "swiglu_oai"))
def test_activations_and_biases(any_backend, poisoned_outputs, rng, activation, bias):
    """Gate and up values spread over [-20, 20] so swiglu_oai's clamps (gate <= 7, |up| <= 7)
    and silu's negative tail are exercised."""
    n_experts, n_out, n_in = 4, 24, 256
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.float32, bias=bias, scale=0.5)
    ids = mx.array([[1, 3, 0]], dtype=mx.int32)
    x = make_x(rng, (1, n_in), mx.float32)
    out = run_and_check(x, gate, up, ids, any_backend, activation=activation)
    g = project(x, *gate, ids, "affine", 64, 4)[0]
    u = project(x, *up, ids, "affine", 64, 4)[0]
    assert (g > 7).any() and (g < -7).any() and (np.abs(u) > 7).any()  # clamps are exercised
    assert out.shape == (1, 3, n_out)


@pytest.mark.parametrize("k", range(1, 11))
def test_top_k(any_backend, poisoned_outputs, rng, k):
    """k = 1..10 per token, first and last expert ids, an id repeated within a token."""
    n_experts, n_out, n_in = 12, 16, 128
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.bfloat16, bias=True)
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(2)])
    ids[0, 0], ids[-1, -1] = 0, n_experts - 1
    if k > 1:
        ids[1, 0] = ids[1, 1]  # duplicated within a token
    x = make_x(rng, (2, n_in), mx.bfloat16)
    run_and_check(x, gate, up, mx.array(ids.astype(np.uint32)), any_backend,
                  activation="swiglu_oai" if k % 2 else "silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_out_of_range_ids_give_nan_rows(any_backend, poisoned_outputs, rng, dtype):
    n_experts, n_out, n_in = 4, 12, 128
    gate, up = _pair(rng, n_experts, n_out, n_in, dtype, bias=True)
    ids = mx.array([[0, n_experts], [2**31 - 1, 3], [-1, -1]], dtype=mx.int32)
    out = run_and_check(make_x(rng, (3, n_in), dtype), gate, up, ids, any_backend)
    nan_rows = np.isnan(to_f64(out)).all(axis=-1)
    assert nan_rows.tolist() == [[False, True], [True, False], [True, True]]


@pytest.mark.parametrize("x_shape", [(2, 1, 64), (2, 3, 2, 64)], ids=("shared", "per_expert"))
def test_leading_dims_broadcast(any_backend, poisoned_outputs, rng, x_shape):
    """x and indices broadcast as in expert_qmv (x [2, 1, K] against ids [2, 3, k]), and x
    as one input per expert ([..., k, K], x.ndim = indices.ndim + 1)."""
    gate, up = _pair(rng, 5, 16, 64, mx.float16, group_size=32)
    ids = mx.array(rng.integers(0, 5, size=(2, 3, 2)).astype(np.uint32))
    out = run_and_check(make_x(rng, x_shape, mx.float16), gate, up, ids, any_backend,
                        group_size=32)
    assert out.shape == (2, 3, 2, 16)


def test_large_magnitudes(any_backend, poisoned_outputs, rng):
    gate, up = _pair(rng, 3, 16, 1024, mx.bfloat16, group_size=128, bits=8, scale=30.0)
    ids = mx.array([[2, 0]], dtype=mx.uint32)
    run_and_check(make_x(rng, (1, 1024), mx.bfloat16, scale=30.0), gate, up, ids, any_backend,
                  group_size=128, bits=8)


def test_stream_argument(rng):
    gate, up = _pair(rng, 3, 8, 64, mx.float32, group_size=32)
    x, ids = make_x(rng, (1, 64), mx.float32), mx.array([[2, 1]], dtype=mx.uint32)
    q = dict(group_size=32, bits=4)
    got = mt.expert_glu(x, *gate[:3], *up[:3], ids, stream=mx.cpu, **q)
    want = mt.expert_glu(x, *gate[:3], *up[:3], ids, **q)
    assert mx.array_equal(got, want).item()


# ---- what the kernel reads (emulator counters) ------------------------------------------

@pytest.mark.parametrize("share", (False, True), ids=("per_pair", "shared"))
@pytest.mark.parametrize("mode, group_size, bits", [("affine", 64, 4), ("mxfp4", 32, 4)])
def test_reads_each_selected_expert_once(emulated, poisoned_outputs, rng, mode, group_size,
                                         bits, share):
    """SHARE 0: per (token, valid expert) its gate rows, up rows (words, scales, biases) and
    bias rows once each. The sharing form: per distinct valid expert, once per call (expert
    3 named by 4 pairs, 0 by 2). Both: x loaded once per SIMD-group for both projections
    (DRAM sees it once per token, from cache after); out written once, [tokens, k, N]."""
    from mlx_metaltile import emulator

    n_experts, n_out, n_in = 16, 20, 4 * group_size
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.float16, mode, group_size, bits,
                     bias=True)
    # repeated within and across tokens, 0, E-1, invalid (reads nothing)
    ids = mx.array([[3, 3, 0], [15, 7, 99], [0, 3, 3]], dtype=mx.uint32)
    x = make_x(rng, (3, n_in), mx.float16)
    with sharing("emulator", 2 if share else None):
        run_and_check(x, gate, up, ids, "emulator", mode=mode, group_size=group_size,
                      bits=bits, kernel=SHARED if share else UNSHARED)
    _assert_reads(emulator.last_launch_stats(), expert_reads=4 if share else 8,
                  valid_pairs=8, pairs=9, n_out=n_out, n_in=n_in, itemsize=2, mode=mode,
                  group_size=group_size, bits=bits)


def test_no_bias_reads_no_bias(poisoned_outputs, rng):
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    from mlx_metaltile import emulator

    gate, up = _pair(rng, 4, 8, 64, mx.float32, group_size=32)
    with backends.use_backend("emulator"):
        run_and_check(make_x(rng, (1, 64), mx.float32), gate, up,
                      mx.array([[1, 2]], dtype=mx.uint32), "emulator", group_size=32)
    stats = emulator.last_launch_stats()
    assert stats.bytes_read.get("bias_gate", 0) == stats.bytes_read.get("bias_up", 0) == 0


# ids of 5 tokens x k 3 (E = 6): expert 2 named by 8 pairs (twice or three times within a
# token too: 2 passes of MAX_SHARED), first and last experts by 2 each, and out-of-range
# ids (-1, 6, 7) between the pairs of those groups.
SHARE_IDS = ((2, 5, 0), (2, 2, -1), (0, 2, 6), (2, 7, 5), (2, 2, 2))


@pytest.mark.parametrize("x_per_pair", (False, True), ids=("x_per_token", "x_per_pair"))
@pytest.mark.parametrize("mode, group_size, bits, activation, bias", [
    ("affine", 32, 4, "silu", False), ("affine", 64, 8, "swiglu_oai", True),
    ("mxfp4", 32, 4, "swiglu_oai", True)], ids=lambda v: str(v))
def test_shared_experts_match_oracle_and_unshared(emulated, poisoned_outputs, rng, mode,
                                                   group_size, bits, activation, bias,
                                                   x_per_pair):
    """The sharing form against the oracle, each distinct expert's rows read once per pass
    (ceil(pairs naming it / 4)), and bitwise equal to SHARE 0 on the same call."""
    from mlx_metaltile import emulator

    n_experts, n_out, n_in = 6, 13, 4 * max(group_size, 32)
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.bfloat16, mode, group_size, bits,
                     bias=bias)
    ids = mx.array(SHARE_IDS, dtype=mx.int32)
    x = make_x(rng, (5, 3, n_in) if x_per_pair else (5, n_in), mx.bfloat16)
    q = dict(activation=activation, mode=mode, group_size=group_size, bits=bits)
    with sharing("emulator", 2):
        shared = run_and_check(x, gate, up, ids, "emulator", kernel=SHARED, **q)
    _assert_reads(emulator.last_launch_stats(), expert_reads=int(_passes(ids, 6).sum()),
                  valid_pairs=12, pairs=15, n_out=n_out, n_in=n_in, itemsize=2, mode=mode,
                  group_size=group_size, bits=bits, bias=bias)
    assert _passes(ids, 6).tolist() == [1, 0, 2, 0, 0, 1]
    unshared = run_and_check(x, gate, up, ids, "emulator", kernel=UNSHARED, **q)
    assert mx.array_equal(shared, unshared, equal_nan=True).item()


@pytest.mark.parametrize("old, new", [
    ("n_share = at < n_pairs ? s + 1 : n_share;", "n_share = at < n_pairs ? 1u : n_share;"),
], ids=("leader_skips_its_sharers",))
def test_negative_control_shared(emulated, poisoned_outputs, broken_kernel, rng, old, new):
    """A leader computing only the first pair of each pass leaves its sharers' rows
    unwritten (NaN)."""
    broken_kernel(op_module.SHARED_SPEC, (old, new))
    gate, up = _pair(rng, 6, 13, 128, mx.bfloat16, group_size=32, bias=True)
    with sharing("emulator", 2), pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (5, 128), mx.bfloat16), gate, up,
                      mx.array(SHARE_IDS, dtype=mx.int32), "emulator", group_size=32,
                      kernel=SHARED)


def test_negative_control_shared_without_leader_return(emulated, broken_kernel, rng):
    """Every pair of a group computing the whole group gives the right rows but reads the
    expert once per pair: the counters catch it."""
    from mlx_metaltile import emulator

    broken_kernel(op_module.SHARED_SPEC,
                  ("if (simd_any(q < pair && uint(indices[q]) == expert)) {", "if (false) {"))
    gate, up = _pair(rng, 6, 13, 128, mx.bfloat16, group_size=32)
    with sharing("emulator", 2):
        run_and_check(make_x(rng, (2, 128), mx.bfloat16), gate, up,
                      mx.array([[1, 4], [4, 1]], dtype=mx.uint32), "emulator", group_size=32,
                      kernel=SHARED)
    with pytest.raises(AssertionError):
        _assert_reads(emulator.last_launch_stats(), expert_reads=2, valid_pairs=4, pairs=4,
                      n_out=13, n_in=128, itemsize=2, group_size=32, bias=False)


@pytest.mark.parametrize("seed, share", [(1, False), (2, True)])
def test_emulator_strict_shuffled(emulated, poisoned_outputs, rng, seed, share):
    """Strict mode (a shuffle may not read a lane that is not at it) with threads and
    threadgroups run in a permuted order: ragged N, a partial 32-lane step, both layouts;
    SHARE 0 and the sharing form."""
    gate, up = _pair(rng, 5, 13, 96, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 7], [2, 2, 1], [1, 4, 2]], dtype=mx.int32)
    with strict_emulator(seed), sharing("emulator", 2 if share else None):
        for x_shape in ((3, 96), (3, 3, 96)):
            run_and_check(make_x(rng, x_shape, mx.bfloat16), gate, up, ids, "emulator",
                          activation="swiglu_oai", group_size=32,
                          kernel=SHARED if share else UNSHARED)


# ---- cuda's launch plan (a row block's K steps over S SIMD-groups), run on the emulator ----

def test_k_groups_of_the_cuda_plan():
    """cuda splits expert_glu's K only below its TARGET_WARPS (1024): the one-token grids of
    the MoE models run unsplit, a grid of a few row blocks still splits."""
    from mlx_metaltile.ops.expert_qmv import TARGET_WARPS as QMV_TARGET_WARPS

    assert op_module.TARGET_WARPS == 1024 < QMV_TARGET_WARPS

    def plan(n_out, n_in, pairs, bits, group_size):
        return op_module._k_groups(n_out, n_in, pairs, bits, group_size, 2,
                                   op_module.TARGET_WARPS, "cuda")

    assert plan(768, 2048, 8, 4, 64) == 1  # Qwen3-30B-A3B, one token
    assert plan(512, 2048, 10, 4, 64) == 1  # Qwen3-Next-80B-A3B
    assert plan(2880, 2880, 4, 4, 32) == 1  # gpt-oss-20b, mxfp4
    assert plan(16, 2048, 2, 4, 64) == 4  # 8 warps: K split over its 4 steps
    assert plan(20, 2048, 2, 4, 64) == 1  # N % 8 != 0



@pytest.fixture
def k_plan(monkeypatch):
    """The emulator launched with the cuda backend's plan (expert_qmv's _k_groups)."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    real = op_module._k_groups
    monkeypatch.setattr(op_module, "_k_groups", lambda *a: real(*a[:-1], "cuda"))
    with backends.use_backend("emulator"):
        yield


def _k_plan_ran(groups, barriers):
    """The last launch split K over ``groups`` SIMD-groups with ``barriers`` barriers per
    8-row tile (SHARE 0: one per valid pair; the sharing form: per group of c pairs, one per
    pass after the first and 2 n - 1 per pass of n pairs)."""
    from mlx_metaltile import emulator

    stats = emulator.last_launch_stats()
    assert stats.threadgroup == (64 * groups, 1, 1)
    tiles = stats.threadgroups // stats.grid[2]
    assert stats.threadgroup_barriers == tiles * barriers
    return stats


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("mode, group_size, bits", QUANT, ids=lambda v: str(v))
def test_k_plan_matches_oracle(k_plan, poisoned_outputs, rng, mode, group_size, bits,
                               activation, bias):
    """N = 16, K of 3 steps and a partial one (S = 4), a pair with an invalid id."""
    per_step = 32 * 2 * (32 // bits)
    n_in = 3 * per_step + 4 * group_size
    gate, up = _pair(rng, 5, 16, n_in, mx.bfloat16, mode, group_size, bits, bias=bias,
                     scale=0.5)
    ids = mx.array([[4, 0], [5, 2]], dtype=mx.int32)
    out = run_and_check(make_x(rng, (2, n_in), mx.bfloat16), gate, up, ids, "emulator",
                        activation=activation, mode=mode, group_size=group_size, bits=bits)
    _k_plan_ran(4, barriers=3)
    assert np.isnan(to_f64(out)).all(axis=-1).tolist() == [[False, False], [True, False]]


def test_k_plan_reads_each_selected_expert_once(k_plan, poisoned_outputs, rng):
    n_experts, n_out, n_in = 16, 24, 2048
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.float16, bias=True)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, n_in), mx.float16), gate, up, ids, "emulator")
    _assert_reads(_k_plan_ran(4, barriers=5), expert_reads=5, valid_pairs=5, pairs=6,
                  n_out=n_out, n_in=n_in, itemsize=2)


def test_k_plan_shared_passes(k_plan, poisoned_outputs, rng):
    """The sharing form with K split: all 9 pairs name the last expert (passes of 4, 4 and 1
    pairs, each pair through the combine in turn), against the oracle, the expert's rows
    read 3 times, bitwise equal to SHARE 0."""
    n_experts, n_out, n_in = 4, 16, 1024 + 128
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.float16, group_size=32, bias=True)
    ids = mx.full((3, 3), n_experts - 1, dtype=mx.uint32)
    x = make_x(rng, (3, n_in), mx.float16)
    with sharing("emulator", 2):
        shared = run_and_check(x, gate, up, ids, "emulator", group_size=32, kernel=SHARED)
    _assert_reads(_k_plan_ran(3, barriers=(7 + 7 + 1) + 2), expert_reads=3, valid_pairs=9,
                  pairs=9, n_out=n_out, n_in=n_in, itemsize=2, group_size=32)
    unshared = run_and_check(x, gate, up, ids, "emulator", group_size=32, kernel=UNSHARED)
    _k_plan_ran(3, barriers=9)
    assert mx.array_equal(shared, unshared).item()


@pytest.mark.parametrize("seed, share", [(1, False), (2, True)])
def test_k_plan_strict_shuffled(k_plan, poisoned_outputs, rng, seed, share):
    gate, up = _pair(rng, 5, 8, 1024 + 128, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 3], [2, 2, 1]], dtype=mx.int32)
    x = make_x(rng, (2, 1024 + 128), mx.bfloat16)
    with strict_emulator(seed), sharing("emulator", 2 if share else None):
        out = run_and_check(x, gate, up, ids, "emulator", group_size=32,
                            kernel=SHARED if share else UNSHARED)
        _k_plan_ran(3, barriers=7 if share else 6)  # shared: expert 2's pair of pairs, 3
        again = mt.expert_glu(x, *gate[:3], *up[:3], ids, bias_gate=gate[3], bias_up=up[3],
                              group_size=32)
        assert mx.array_equal(out, again).item()


@pytest.mark.parametrize("old, new", [
    ("for (uint g = 0; g < k_groups; ++g) {", "for (uint g = 0; g < 1; ++g) {"),
    ("u_sum += partials[at + 1];", "u_sum += partials[at];"),
], ids=("first_k_group_only", "gate_sums_for_up"))
def test_k_plan_negative_control(k_plan, poisoned_outputs, broken_kernel, rng, old, new):
    broken_kernel(op_module.SPEC, (old, new))
    gate, up = _pair(rng, 4, 16, 1024, mx.float32, group_size=32, scale=0.5)
    ids = mx.array([[1, 3]], dtype=mx.uint32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (1, 1024), mx.float32), gate, up, ids, "emulator",
                      group_size=32)


# ---- build once ----------------------------------------------------------------------------

def test_instantiations_match_the_launches(launch_recorder, rng):
    """The instantiations hook (CUDA compile check) describes what the launcher passes for
    every dtype, mode, activation and index dtype, both forms (recorded as on metal, nothing
    runs)."""
    with sharing("metal", 2):
        n = _launch_every_form(rng)
    assert len(launch_recorder.seen) == n
    assert {name for name, *_ in launch_recorder.seen} == {UNSHARED, SHARED}
    launch_recorder.assert_declared()


def _launch_every_form(rng) -> int:
    n = 0
    for dtype in DTYPES:
        for mode, gs, bits in (*QUANT, ("affine", 64, 4)):
            gate, up = _pair(rng, 3, 8, 128, dtype, mode, gs, bits, bias=True)
            for activation in ("silu", "swiglu_oai"):
                for tokens in (1, 2):  # SHARE 0, the sharing form (on: from 2 tokens)
                    for idx in (mx.uint32, mx.int32):
                        mt.expert_glu(make_x(rng, (tokens, 128), dtype), *gate[:3], *up[:3],
                                      mx.array([[0, 2]] * tokens, dtype=idx),
                                      bias_gate=gate[3], bias_up=up[3],
                                      activation=activation, mode=mode, group_size=gs,
                                      bits=bits)
                        n += 1
    return n


def test_kernel_path_is_lazy(monkeypatch, no_host_sync, rng):
    """The launcher syncs nothing: the kernel is replaced by a stand-in returning lazy
    outputs, as on a Mac; its grid and template are the documented ones."""
    seen = {}

    def fake_kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                    init_value=None):
        seen.update(grid=grid, threadgroup=threadgroup, template=template)
        return [mx.zeros(shape, dtype=dtype) for shape, dtype
                in zip(output_shapes, output_dtypes, strict=True)]

    gate, up = _pair(rng, 8, 40, 128, mx.bfloat16, bias=True)
    x = make_x(rng, (2, 3, 128), mx.bfloat16)
    logits = make_x(rng, (2, 3, 8), mx.float32)
    with no_host_sync(), monkeypatch.context() as m:
        m.setattr(backends, "resolve_backend", lambda name=None: "metal")
        m.setattr(backends, "get_kernel", lambda *a, **k: fake_kernel)
        ids = mx.argpartition(-logits, kth=1, axis=-1)[..., :2]
        out = mt.expert_glu(x, *gate[:3], *up[:3], ids, bias_gate=gate[3], bias_up=up[3],
                            activation="swiglu_oai")
    assert out.shape == (2, 3, 2, 40) and out.dtype == mx.bfloat16
    assert seen["grid"] == (64, 5, 12) and seen["threadgroup"] == (64, 1, 1)
    assert seen["template"] == [("T", mx.bfloat16), ("BITS", 4), ("GROUP_SIZE", 64),
                                ("MODE", 0), ("ACT", 1), ("SHARE", 0)]  # off by default


@pytest.mark.parametrize("backend", ("metal", "cuda"))
def test_plan_shares_from_min_tokens(monkeypatch, rng, backend):
    """The plan takes the sharing form from SHARE_MIN_TOKENS tokens on where a backend is
    named there (none by default), only where ids are [P] and x one row per token or per
    pair; the kernels are stand-ins (nothing runs)."""
    seen = []

    def get_kernel(spec, name):
        def kernel(*, inputs, output_shapes, output_dtypes, template, **_):
            seen.append((spec.name, dict(template)["SHARE"]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype
                    in zip(output_shapes, output_dtypes, strict=True)]
        return kernel

    gate, up = _pair(rng, 4, 8, 64, mx.float16, group_size=32)

    def form(x_shape, ids_shape):
        mt.expert_glu(make_x(rng, x_shape, mx.float16), *gate[:3], *up[:3],
                      mx.zeros(ids_shape, dtype=mx.uint32), group_size=32)
        return seen.pop()

    assert backend not in op_module.SHARE_MIN_TOKENS
    with monkeypatch.context() as m:
        m.setattr(backends, "resolve_backend", lambda name=None: backend)
        m.setattr(backends, "get_kernel", get_kernel)
        assert form((2, 64), (2, 3)) == (UNSHARED, 0)  # off by default
        with sharing(backend, 2):
            assert form((1, 64), (1, 3)) == (UNSHARED, 0)
            assert form((2, 64), (2, 3)) == (SHARED, 1)
            assert form((2, 3, 64), (2, 3)) == (SHARED, 1)          # x per pair
            assert form((2, 2, 1, 64), (2, 2, 3)) == (SHARED, 1)    # [..., 1, K]
            assert form((2, 1, 64), (2, 3, 3)) == (UNSHARED, 0)     # x broadcast over 3
            assert form((1, 64), (4, 3)) == (UNSHARED, 0)           # x broadcast over 4
        with sharing(backend, 3):
            assert form((2, 64), (2, 3)) == (UNSHARED, 0)
            assert form((3, 64), (3, 3)) == (SHARED, 1)


def test_empty_does_not_dispatch(kernel_backend, rng):
    gate, up = _pair(rng, 4, 8, 64, mx.float16, group_size=32)
    before = backends.launch_count()
    out = mt.expert_glu(make_x(rng, (0, 64), mx.float16), *gate[:3], *up[:3],
                        mx.zeros((0, 2), dtype=mx.uint32), group_size=32)
    assert out.shape == (0, 2, 8) and out.dtype == mx.float16
    assert backends.launch_count() == before


# ---- negative controls --------------------------------------------------------------------

@pytest.mark.parametrize("old, new, activation", [
    ("su = mt_group_scale<MODE, T>(gu);", "su = mt_group_scale<MODE, T>(gg);", "silu"),
    ("acc_u[s][r] += su * du + bu * x_sum[wi];", "acc_u[s][r] += su * du;", "silu"),
    ("bias_u = float(bias_up[at]);", "bias_u = 0.0f;", "silu"),
    ("const float gc = metal::min(g, limit);", "const float gc = g;", "swiglu_oai"),
    ("y = g / (1.0f + metal::exp(-g)) * u;", "y = g * u;", "silu"),
], ids=("gate_scale_for_up", "no_up_affine_bias", "no_expert_bias", "no_clamp", "no_silu"))
def test_negative_control_broken_kernel(kernel_backend, poisoned_outputs, broken_kernel, rng,
                                        old, new, activation):
    broken_kernel(op_module.SPEC, (old, new))
    gate, up = _pair(rng, 4, 16, 256, mx.float32, group_size=32, bias=True, scale=0.5)
    ids = mx.array([[1, 3]], dtype=mx.uint32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (1, 256), mx.float32), gate, up, ids, kernel_backend,
                      activation=activation, group_size=32)


def test_negative_control_unguarded_id_is_a_hazard(broken_kernel, rng):
    emulator = pytest.importorskip("mlx_metaltile.emulator")
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    broken_kernel(op_module.SPEC, ("if (expert >= n_experts) {", "if (false) {"))
    gate, up = _pair(rng, 4, 16, 128, mx.float32)
    ids = mx.array([[1, 4000]], dtype=mx.uint32)
    with backends.use_backend("emulator"), pytest.raises(emulator.OutOfBoundsAccess):
        mx.eval(mt.expert_glu(make_x(rng, (1, 128), mx.float32), *gate[:3], *up[:3], ids))


def test_negative_control_reference_wrong_activation(monkeypatch, rng):
    """The oracle harness rejects a composite that swaps gate and up."""
    real = op_module._activate
    monkeypatch.setattr(op_module, "_activate", lambda g, u, act: real(u, g, act))
    gate, up = _pair(rng, 4, 16, 128, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError,
                                                           match="out of tolerance"):
        run_and_check(make_x(rng, (1, 128), mx.float32), gate, up,
                      mx.array([[0, 2]], dtype=mx.uint32), "reference")


# ---- bad input ------------------------------------------------------------------------

def _ok(n_in=128):
    w = mx.zeros((4, 8, n_in // 8), dtype=mx.uint32)
    s = mx.ones((4, 8, n_in // 64), dtype=mx.float16)
    return (mx.zeros((2, n_in), mx.float16), w, s, s, w, s, s,
            mx.zeros((2, 3), dtype=mx.uint32))


@pytest.mark.parametrize("mutate, kwargs, exc, match", [
    (lambda a: a, dict(activation="gelu"), ValueError,
     r"activation must be one of \('silu', 'swiglu_oai'\), got 'gelu'"),
    (lambda a: a, dict(bias_gate=mx.zeros((4, 8), mx.float16)), ValueError,
     "bias_gate and bias_up must both be arrays or both None"),
    (lambda a: a, dict(bias_gate=mx.zeros((4, 7), mx.float16),
                       bias_up=mx.zeros((4, 7), mx.float16)), ValueError,
     r"bias_gate must have shape \[E, N\] = \(4, 8\), got \(4, 7\)"),
    (lambda a: a, dict(bias_gate=mx.zeros((4, 8), mx.float32),
                       bias_up=mx.zeros((4, 8), mx.float32)), TypeError,
     "bias_gate must have x's dtype float16, got float32"),
    (lambda a: (*a[:4], a[4][:3], a[5][:3], a[6][:3], a[7]), {}, ValueError,
     r"w_up must have the gate's shape \(4, 8, 16\), got \(3, 8, 16\)"),
    (lambda a: (a[0][:, :64], *a[1:]), {}, ValueError, "x's last axis must be K = 128"),
    (lambda a: (*a[:7], a[7].astype(mx.float32)), {}, TypeError,
     "indices must be uint32 or int32"),
])
def test_bad_input(mutate, kwargs, exc, match):
    with pytest.raises(exc, match=r"^\[expert_glu\] " + match):
        mt.expert_glu(*mutate(_ok()), **kwargs)
