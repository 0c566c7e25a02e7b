"""expert_qmv against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import input_space, record_emulator_sources, strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.expert_qmv import (
    make_packed,
    make_weights,
    make_x,
    oracle,
    run_and_check,
)

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.expert_qmv")


def _dname(d):
    return str(d).rsplit(".", 1)[-1]


# ---- correctness ----------------------------------------------------------------------

@pytest.mark.parametrize("shared", (True, False), ids=("x_shared", "x_per_expert"))
@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_matches_oracle(any_backend, poisoned_outputs, rng, dtype, bits, group_size, shared):
    """N = 13 (a ragged 8-row tile), K = 3 groups (a partial 32-lane step), ids 0 / E-1 / repeats."""
    n_experts, n_out, n_in = 6, 13, 3 * group_size
    w, s, b = make_weights(rng, n_experts, n_out, n_in, dtype, group_size, bits)
    assert (to_f64(s) < 0).any() and (to_f64(s) > 0).any()  # negative scales are exercised
    ids = mx.array([[0, 5], [3, 3], [5, 0]], dtype=mx.uint32)
    x = make_x(rng, (3, n_in) if shared else (3, 2, n_in), dtype)
    run_and_check(x, w, s, b, ids, group_size, bits, any_backend)


@pytest.mark.parametrize("bits, n_in", [(4, 1664), (8, 800)])
def test_partial_step_splits_lane_words(any_backend, poisoned_outputs, rng, bits, n_in):
    """A step holds 128 words of a row, lane l words l, 32 + l, 64 + l, 96 + l: K of one full
    step and 80 or 72 words more, so the last step's third words cover only some lanes."""
    w, s, b = make_weights(rng, 4, 16, n_in, mx.bfloat16, 32, bits)
    ids = mx.array([[3, 0], [1, 1]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, n_in), mx.bfloat16), w, s, b, ids, 32, bits, any_backend)


@pytest.mark.parametrize("k", (1, 2, 8))
@pytest.mark.parametrize("shared", (True, False), ids=("x_shared", "x_per_expert"))
def test_top_k(any_backend, poisoned_outputs, rng, k, shared):
    n_experts, n_out, n_in = 9, 40, 256
    w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.float16, 64, 4)
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(4)])
    ids[0, 0], ids[-1, -1] = 0, n_experts - 1
    ids = mx.array(ids.astype(np.int32))
    x = make_x(rng, (4, n_in) if shared else (4, k, n_in), mx.float16)
    run_and_check(x, w, s, b, ids, 64, 4, any_backend)


@pytest.mark.parametrize("x_lead, idx_lead", [
    ((), ()),  # one token, unbatched
    ((2, 3), (2, 3)),  # [batch, tokens]
    ((1, 3), (2, 1)),  # both broadcast
    ((2, 1), (2, 3)),  # x broadcast over tokens
], ids=str)
@pytest.mark.parametrize("shared", (True, False), ids=("x_shared", "x_per_expert"))
def test_leading_dims_broadcast(any_backend, poisoned_outputs, rng, x_lead, idx_lead, shared):
    n_experts, k, n_out, n_in = 5, 2, 16, 128
    w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.bfloat16, 32, 8)
    ids = mx.array(rng.integers(0, n_experts, size=(*idx_lead, k)).astype(np.uint32))
    x = make_x(rng, (*x_lead, n_in) if shared else (*x_lead, k, n_in), mx.bfloat16)
    out = run_and_check(x, w, s, b, ids, 32, 8, any_backend)
    lead = np.broadcast_shapes(x_lead, idx_lead)
    assert tuple(out.shape) == (*lead, k, n_out)


RANK_BROADCASTS = [
    # (leading dims of x, indices shape, per-expert x, x and indices copied by the wrapper)
    ((), (3, 2, 2), False, False),  # one activation for every token
    ((2,), (3, 2, 2), False, False),  # x [2, K] against tokens [3, 2]
    ((1,), (3, 2, 2), False, False),
    ((2, 3), (2,), False, False),  # one routing for a [2, 3] grid of tokens
    ((5, 3, 2), (2, 2), False, False),  # x.ndim = indices.ndim + 2 (+1 is per expert)
    ((4, 1, 3), (7, 1, 5, 1, 2), False, False),  # broadcasts alternate over 4 dims
    ((2, 1, 2, 1, 2), (3, 1, 2, 1, 2, 1, 3), False, True),  # over 6: materialised
    ((1, 3), (2, 1, 2), True, False),  # per expert: equal ranks, sizes broadcast
    ((2, 1), (1, 3, 2), True, False),
]


@pytest.mark.parametrize("x_lead, idx_shape, per_expert, copied", RANK_BROADCASTS, ids=str)
def test_leading_dims_of_other_ranks_broadcast(any_backend, poisoned_outputs, launches, rng,
                                               x_lead, idx_shape, per_expert, copied):
    """NumPy broadcasting of the leading dims, ranks included, with the shape that
    mx.gather_qmm gives for x[..., None, None, :] (shared) or x[..., None, :] (per expert);
    the kernel gets x and indices as given (no broadcast copy) unless broadcasts alternate
    over more dimensions than it walks."""
    n_experts, n_out, n_in, k = 5, 16, 64, idx_shape[-1]
    w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.float32, 32, 4)
    ids = mx.array(rng.integers(0, n_experts, size=idx_shape).astype(np.uint32))
    x_shape = (*x_lead, k, n_in) if per_expert else (*x_lead, n_in)
    assert (len(x_shape) == ids.ndim + 1) == per_expert  # the layout the rank selects
    x = make_x(rng, x_shape, mx.float32)
    out = run_and_check(x, w, s, b, ids, 32, 4, any_backend)
    xq = x[..., None, :] if per_expert else x[..., None, None, :]
    native = mx.gather_qmm(xq, w, s, b, rhs_indices=ids, transpose=True, group_size=32, bits=4)
    assert tuple(out.shape) == tuple(native.shape[:-2]) + (n_out,)
    if any_backend != "reference":
        (inputs,) = (launch.inputs for launch in launches)
        pairs = out.size // n_out
        assert inputs[0].size == (pairs * n_in // (1 if per_expert else k) if copied
                                  else x.size)
        assert inputs[4].size == (pairs if copied else ids.size)


def test_x_k_axis_of_one_broadcasts(any_backend, poisoned_outputs, rng):
    """x [..., 1, K] with indices [..., k]: the size-1 k axis broadcasts (as in gather_qmm)."""
    n_experts, k, n_out, n_in = 6, 3, 24, 128
    w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.float16, 64, 8)
    ids = mx.array([[5, 0, 5], [2, 4, 1]], dtype=mx.uint32)
    x = make_x(rng, (2, 1, n_in), mx.float16)
    out = run_and_check(x, w, s, b, ids, 64, 8, any_backend)
    assert tuple(out.shape) == (2, k, n_out)
    native = mx.gather_qmm(x[..., None, :], w, s, b, rhs_indices=ids, transpose=True,
                           group_size=64, bits=8)
    assert tuple(out.shape) == tuple(native.shape[:-2]) + (n_out,)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_out_of_range_ids_give_nan_rows(any_backend, poisoned_outputs, rng, dtype):
    """ids E, 2^31 - 1 and -1 (int32): NaN rows, the valid rows exact, no hazard reported."""
    n_experts, n_out, n_in = 4, 24, 128
    w, s, b = make_weights(rng, n_experts, n_out, n_in, dtype, 64, 4)
    ids = mx.array([[0, n_experts], [2**31 - 1, 3], [-1, -1]], dtype=mx.int32)
    x = make_x(rng, (3, n_in), dtype)
    out = run_and_check(x, w, s, b, ids, 64, 4, any_backend)
    nan_rows = np.isnan(to_f64(out)).all(axis=-1)
    assert nan_rows.tolist() == [[False, True], [True, False], [True, True]]
    big = mx.array([[n_experts, 2**32 - 1]], dtype=mx.uint32)
    out = run_and_check(x[:1], w, s, b, big, 64, 4, any_backend)
    assert np.isnan(to_f64(out)).all()


@pytest.mark.parametrize("n_out", (1, 3))
def test_tiny_buffers(any_backend, poisoned_outputs, rng, n_out):
    """E = 1, K = 32: w and scales hold < 8 elements (MLX passes those as `constant`)."""
    w, s, b = make_packed(rng, 1, n_out, 32, mx.float16, 32, 4)
    ids = mx.array([[0]], dtype=mx.uint32)
    run_and_check(make_x(rng, (1, 32), mx.float16), w, s, b, ids, 32, 4, any_backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_large_magnitudes(any_backend, poisoned_outputs, rng, dtype):
    """Weights and activations ~1e2 (~10 in float16, whose range ends at 65504), K = 1024."""
    scale = 10.0 if dtype == mx.float16 else 1e2
    w, s, b = make_weights(rng, 3, 16, 1024, dtype, 128, 8, scale=scale)
    ids = mx.array([[2, 0]], dtype=mx.uint32)
    run_and_check(make_x(rng, (1, 1024), dtype, scale=scale), w, s, b, ids, 128, 8, any_backend)


def test_non_contiguous_inputs(any_backend, poisoned_outputs, rng):
    w, s, b = make_weights(rng, 4, 16, 256, mx.float32, 64, 4)
    x = make_x(rng, (256, 3), mx.float32).T  # [3, 256], transposed view
    ids = mx.array(np.array([[1, 3], [0, 2], [3, 3]], dtype=np.uint32).T.copy()).T  # [3, 2]
    run_and_check(x, w, s, b, ids, 64, 4, any_backend)


def test_non_contiguous_weights(any_backend, poisoned_outputs, rng):
    """Every other expert of a larger stack (strided w), scales as a transposed view, biases
    sliced along N, x strided along K, per-expert layout."""
    n_experts, n_out, n_in, gs = 5, 12, 256, 32
    w_big, s_big, b_big = make_packed(rng, 2 * n_experts, n_out + 3, n_in, mx.bfloat16, gs, 8)
    w = w_big[1::2, :n_out]
    s = mx.array(np.ascontiguousarray(to_f64(s_big[::2, :n_out]).transpose(0, 2, 1)))
    s = s.astype(mx.bfloat16).swapaxes(1, 2)  # [E, N, G] view of a [E, G, N] array
    b = b_big[:n_experts, 3:]
    x = make_x(rng, (2, 3, 2 * n_in), mx.bfloat16)[..., ::2]
    ids = mx.array([[4, 0, 2], [1, 1, 3]], dtype=mx.int32)
    run_and_check(x, w, s, b, ids, gs, 8, any_backend)


@pytest.mark.parametrize("shared, n_out, n_in", [
    (True, 768, 2048),  # gate/up projection
    (False, 2048, 768),  # down projection
], ids=("gate_up", "down"))
def test_qwen3_moe_decode_shape(any_backend, poisoned_outputs, rng, shared, n_out, n_in):
    """Qwen3-30B-A3B decode: E = 128, k = 8, 4-bit, group 64, bfloat16."""
    n_experts, k = 128, 8
    w, s, b = make_packed(rng, n_experts, n_out, n_in, mx.bfloat16, 64, 4)
    ids = mx.array(rng.permutation(n_experts)[:k].reshape(1, k).astype(np.uint32))
    x = make_x(rng, (1, n_in) if shared else (1, k, n_in), mx.bfloat16)
    run_and_check(x, w, s, b, ids, 64, 4, any_backend)


# ---- what the kernel reads (emulator counters) ------------------------------------------

def _emulator_stats():
    emulator = pytest.importorskip("mlx_metaltile.emulator")
    return emulator.last_launch_stats()


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 128), (8, 64)])
def test_reads_only_selected_experts(poisoned_outputs, rng, bits, group_size):
    """Bytes read from w / scales / biases = the selected (token, expert) pairs' rows, once each."""
    backends_ok = backends.unavailable_reason("emulator")
    if backends_ok is not None:
        pytest.skip(f"backend emulator unavailable: {backends_ok}")
    n_experts, n_out, n_in = 16, 20, 4 * group_size
    w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.float16, group_size, bits)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)  # repeated, 0, E-1, out of range
    x = make_x(rng, (2, n_in), mx.float16)
    with backends.use_backend("emulator"):
        run_and_check(x, w, s, b, ids, group_size, bits, "emulator")
    stats = _emulator_stats()
    pairs = 5  # valid (token, expert) pairs; the out-of-range one reads nothing
    assert stats.bytes_read["w"] == pairs * n_out * (n_in * bits // 32) * 4
    assert stats.bytes_read["scales"] == pairs * n_out * (n_in // group_size) * 2
    assert stats.bytes_read["biases"] == pairs * n_out * (n_in // group_size) * 2
    assert stats.bytes_written["out"] == 6 * n_out * 2  # every row once, the NaN row included
    assert stats.bytes_read["out"] == 0
    # x: each SIMD-group (4 output rows) of a valid pair loads its K activations once
    # (from cache on a GPU; DRAM sees x once per token).
    assert stats.bytes_read["x"] == pairs * -(-n_out // 4) * n_in * 2


@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(poisoned_outputs, rng, seed):
    """Strict mode (a shuffle may not read a lane that is not at it) with the threads and
    threadgroups run in a permuted order: ragged N, a partial 32-lane step, both layouts."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")

    w, s, b = make_weights(rng, 5, 13, 96, mx.bfloat16, 32, 4)
    ids = mx.array([[4, 0, 7], [2, 2, 1]], dtype=mx.int32)
    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            for x_shape in ((2, 96), (2, 3, 96)):
                run_and_check(make_x(rng, x_shape, mx.bfloat16), w, s, b, ids, 32, 4,
                              "emulator")


# ---- cuda's launch plan (a row block's K steps over S SIMD-groups), run on the emulator ----

QUANT = (("affine", 32, 4), ("affine", 64, 8), ("affine", 128, 4), ("mxfp4", 32, 4),
         ("nvfp4", 16, 4), ("mxfp8", 32, 8))


@pytest.fixture
def k_plan(monkeypatch):
    """The emulator launched with the cuda backend's plan: S = _k_groups(..., "cuda") K
    groups per row block, combined through threadgroup memory after a barrier."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    real = op_module._k_groups
    monkeypatch.setattr(op_module, "_k_groups", lambda *a: real(*a[:-1], "cuda"))
    with backends.use_backend("emulator"):
        yield


def _k_plan_ran(groups, valid_pairs):
    """The last launch ran ``groups`` K groups, each valid pair's threadgroups meeting the
    barrier once (an invalid pair's return before it)."""
    stats = _emulator_stats()
    assert stats.threadgroup == (64 * groups, 1, 1)
    tiles = stats.threadgroups // stats.grid[2]
    assert stats.threadgroup_barriers == tiles * valid_pairs
    return stats


def test_k_groups_of_each_plan():
    """cuda splits K where the grid is small and N is a multiple of 8; Metal never."""
    warps = op_module.TARGET_WARPS

    def plan(*a):
        return op_module._k_groups(*a[:-1], warps, a[-1])

    assert plan(768, 2048, 8, 4, 64, 4, "cuda") == 2  # Qwen3-30B-A3B up: 2 steps of K
    assert plan(512, 2048, 10, 4, 64, 4, "cuda") == 2  # Qwen3-Next up
    assert plan(2880, 2880, 4, 4, 32, 4, "cuda") == 2  # gpt-oss mxfp4, 3 steps
    assert plan(2048, 768, 8, 4, 64, 4, "cuda") == 1  # one step of K
    assert plan(768, 2048, 32, 4, 64, 4, "cuda") == 1  # 4 tokens: enough warps
    assert plan(16, 8192, 1, 8, 64, 4, "cuda") == 8  # at most MAX_K_GROUPS
    assert plan(20, 8192, 1, 4, 64, 4, "cuda") == 1  # N % 8 != 0
    assert {plan(768, 2048, 8, 4, 64, 4, b) for b in ("metal", "emulator")} == {1}


@pytest.mark.parametrize("mode, group_size, bits", QUANT, ids=lambda v: str(v))
def test_k_plan_matches_oracle(k_plan, poisoned_outputs, rng, mode, group_size, bits):
    """N = 16, K of 3 steps and a partial one (S = 4, the last group's step ragged), a pair
    with an invalid id (NaN row), both x layouts."""
    from mlx_metaltile.cases.expert_glu import make_experts, project

    per_step = 32 * min(4, group_size * bits // 32) * (32 // bits)
    n_in = 3 * per_step + 4 * group_size
    w, s, b, _ = make_experts(rng, 5, 16, n_in, mx.bfloat16, mode, group_size, bits)
    ids = mx.array([[4, 0], [5, 2]], dtype=mx.int32)
    for x_shape in ((2, n_in), (2, 2, n_in)):
        x = make_x(rng, x_shape, mx.bfloat16)
        out = mt.expert_qmv(x, w, s, b, ids, group_size=group_size, bits=bits, mode=mode)
        mx.eval(out)
        _k_plan_ran(4, valid_pairs=3)
        want, mag, valid = project(x, w, s, b, None, ids, mode, group_size, bits)
        got = to_f64(out)
        assert np.isnan(got[~valid]).all() and valid.sum() == 3
        assert_close(got[valid], want[valid], mx.bfloat16, magnitude=mag[valid],
                     what="expert_qmv[emulator, K groups]")


def test_k_plan_reads_each_selected_expert_once(k_plan, poisoned_outputs, rng):
    n_experts, n_out, n_in = 16, 24, 4096
    w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.float16, 64, 4)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, n_in), mx.float16), w, s, b, ids, 64, 4, "emulator")
    stats = _k_plan_ran(4, valid_pairs=5)
    pairs = 5
    assert stats.bytes_read["w"] == pairs * n_out * (n_in * 4 // 32) * 4
    assert stats.bytes_read["scales"] == stats.bytes_read["biases"] == (
        pairs * n_out * (n_in // 64) * 2)
    assert stats.bytes_written["out"] == 6 * n_out * 2 and stats.bytes_read["out"] == 0
    assert stats.bytes_read["x"] == pairs * -(-n_out // 4) * n_in * 2


@pytest.mark.parametrize("seed", (1, 2))
def test_k_plan_strict_shuffled(k_plan, poisoned_outputs, rng, seed):
    """Strict mode, threads and threadgroups in a permuted order, equal bits run to run."""

    w, s, b = make_weights(rng, 5, 8, 2048 + 256, mx.bfloat16, 32, 4)
    ids = mx.array([[4, 0, 3], [2, 2, 1]], dtype=mx.int32)
    x = make_x(rng, (2, 2048 + 256), mx.bfloat16)
    with strict_emulator(seed):
        out = run_and_check(x, w, s, b, ids, 32, 4, "emulator")
        _k_plan_ran(3, valid_pairs=6)
        again = mt.expert_qmv(x, w, s, b, ids, group_size=32, bits=4)
        assert mx.array_equal(out, again).item()


@pytest.mark.parametrize("old, new", [
    ("for (uint g = 0; g < k_groups; ++g) {", "for (uint g = 0; g < 1; ++g) {"),
    ("step += k_groups)", "step += 1)"),
], ids=("first_k_group_only", "every_group_all_steps"))
def test_k_plan_negative_control(k_plan, poisoned_outputs, broken_kernel, rng, old, new):
    broken_kernel(op_module.SPEC, (old, new))
    w, s, b = make_weights(rng, 4, 16, 2048, mx.float32, 64, 4)
    ids = mx.array([[1, 3]], dtype=mx.uint32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (1, 2048), mx.float32), w, s, b, ids, 64, 4, "emulator")


# ---- build once, stay lazy ---------------------------------------------------------------

def test_sizes_do_not_rebuild(kernel_backend, monkeypatch, launches, rng):
    """E, N, K, k, the token count, the broadcast pattern and the x layout are runtime
    inputs. MLX passes an input of fewer than 8 elements in the constant address space,
    which generates another source: after one call per index dtype with fewer than 8 and
    one with at least 8 ids, calls of other sizes build no kernel object, pass the same
    template arguments and (emulator) compile nothing new: exactly one instantiation per
    (index dtype, address space) served the whole test."""
    sources = None
    if kernel_backend == "emulator":
        sources = record_emulator_sources(monkeypatch,
                                          backends.get_kernel(op_module.SPEC, "emulator"))
    w, s, b = make_weights(rng, 4, 8, 128, mx.float16, 64, 4)
    for idx_dtype in (mx.uint32, mx.int32):
        for tokens in (1, 4):  # 2 ids (constant), 8 ids (device)
            ids = mx.array(rng.integers(0, 4, size=(tokens, 2)), dtype=idx_dtype)
            run_and_check(make_x(rng, (tokens, 128), mx.float16), w, s, b, ids, 64, 4,
                          kernel_backend)
    built = backends.built_kernels()
    warm = None if sources is None else set(sources)
    for n_experts, n_out, n_in, x_lead, idx_shape, shared in (
            (7, 17, 192, (3,), (3, 1), True), (7, 17, 192, (1,), (1, 3), False),
            (2, 40, 1024, (5,), (5, 2), True), (9, 1, 64, (2,), (2, 8), False),
            (5, 8, 64, (), (7,), True), (5, 8, 64, (2, 1), (1, 3, 3), True),
            (5, 8, 64, (3, 2), (2,), True), (3, 16, 128, (1, 2), (6, 1, 2), False)):
        w, s, b = make_weights(rng, n_experts, n_out, n_in, mx.float16, 64, 4)
        k = idx_shape[-1]
        for idx_dtype in (mx.uint32, mx.int32):
            ids = mx.array(rng.integers(0, n_experts, size=idx_shape), dtype=idx_dtype)
            x = make_x(rng, (*x_lead, n_in) if shared else (*x_lead, k, n_in), mx.float16)
            run_and_check(x, w, s, b, ids, 64, 4, kernel_backend)
    assert backends.built_kernels() == built
    assert {launch.template for launch in launches} == {
        (("T", mx.float16), ("BITS", 4), ("GROUP_SIZE", 64), ("MODE", 0), ("S", mx.float16),
         ("ROUND", False))}
    if sources is not None:
        new = set(sources) - warm
        assert not new, f"new instantiations: {[input_space(src, 'indices') for src in new]}"
        assert sorted(input_space(src, "indices") for src in warm) == [
            (t, space) for t in ("int32_t", "uint32_t") for space in ("constant", "device")]


def test_instantiations_match_the_launches(launch_recorder, rng):
    """The instantiations hook (CUDA compile check) describes what the launcher passes for
    every dtype, bits, group size, index dtype and x layout (recorded, nothing runs)."""
    for dtype in DTYPES:
        for bits in (4, 8):
            for gs in (32, 64, 128):
                x, w, s, b, ids = _ok(dtype=dtype, bits=bits, group_size=gs, n_in=128)
                for idx in (ids, ids.astype(mx.int32)):
                    mt.expert_qmv(x, w, s, b, idx, group_size=gs, bits=bits)
                    mt.expert_qmv(mx.zeros((2, 3, 128), dtype), w, s, b, idx,
                                  group_size=gs, bits=bits)
    assert len(launch_recorder.seen) == 3 * 2 * 3 * 2 * 2
    assert {name for name, *_ in launch_recorder.seen} == {op_module.SPEC.name}
    launch_recorder.assert_declared()


def test_router_indices_stay_on_device(no_host_sync, rng):
    """Ids from an argpartition router feed the op with no evaluation inside it."""
    n_experts, k, n_in = 8, 2, 128
    w, s, b = make_weights(rng, n_experts, 32, n_in, mx.float32, 64, 4)
    x = make_x(rng, (3, n_in), mx.float32)
    gate = make_x(rng, (n_in, n_experts), mx.float32)

    def route(x):
        logits = x @ gate
        return mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k].astype(mx.uint32)


    with no_host_sync():
        ids = route(x)
        out = mt.expert_qmv(x, w, s, b, ids, group_size=64, bits=4)
    want, mag, _ = oracle(x, w, s, b, ids, 64, 4)
    assert_close(out, want, mx.float32, magnitude=mag)
    compiled = mx.compile(lambda x: mt.expert_qmv(x, w, s, b, route(x), group_size=64, bits=4))
    assert_close(compiled(x), want, mx.float32, magnitude=mag)


def test_kernel_path_is_lazy(monkeypatch, no_host_sync, rng):
    """The launcher (broadcasts, runtime scalars, geometry, launch) syncs nothing either:
    the kernel is replaced by a stand-in that returns lazy outputs, as on a Mac."""
    seen = {}

    def fake_kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                    init_value=None):
        seen.update(inputs=inputs, grid=grid, threadgroup=threadgroup, template=template)
        return [mx.zeros(shape, dtype=dtype) for shape, dtype
                in zip(output_shapes, output_dtypes, strict=True)]


    w, s, b = make_weights(rng, 8, 40, 128, mx.bfloat16, 64, 4)
    x = make_x(rng, (2, 3, 128), mx.bfloat16)
    logits = make_x(rng, (2, 3, 8), mx.float32)
    with no_host_sync(), monkeypatch.context() as m:
        m.setattr(backends, "resolve_backend", lambda name=None: "metal")
        m.setattr(backends, "get_kernel", lambda *a, **k: fake_kernel)
        ids = mx.argpartition(-logits, kth=1, axis=-1)[..., :2]
        out = mt.expert_qmv(x, w, s, b, ids, group_size=64, bits=4)
    assert out.shape == (2, 3, 2, 40) and out.dtype == mx.bfloat16
    assert seen["grid"] == (64, 5, 12) and seen["threadgroup"] == (64, 1, 1)
    assert seen["template"] == [("T", mx.bfloat16), ("BITS", 4), ("GROUP_SIZE", 64),
                                ("MODE", 0), ("S", mx.bfloat16), ("ROUND", False)]


def test_empty_does_not_dispatch(kernel_backend, rng):
    """No tokens, k = 0 or N = 0: an empty result of the right shape and dtype, no launch."""
    w, s, b = make_weights(rng, 4, 8, 64, mx.float16, 64, 4)
    before = backends.launch_count()
    out = mt.expert_qmv(make_x(rng, (0, 64), mx.float16), w, s, b,
                        mx.zeros((0, 2), dtype=mx.uint32))
    assert out.shape == (0, 2, 8) and out.dtype == mx.float16
    out = mt.expert_qmv(make_x(rng, (3, 64), mx.float16), w, s, b,
                        mx.zeros((3, 0), dtype=mx.uint32))
    assert out.shape == (3, 0, 8)
    out = mt.expert_qmv(make_x(rng, (2, 3, 64), mx.bfloat16),
                        mx.zeros((4, 0, 8), dtype=mx.uint32), mx.zeros((4, 0, 1), mx.bfloat16),
                        mx.zeros((4, 0, 1), mx.bfloat16), mx.zeros((2, 3), dtype=mx.int32))
    assert out.shape == (2, 3, 0) and out.dtype == mx.bfloat16
    assert backends.launch_count() == before


# ---- negative controls: a deliberately wrong variant must fail the harness ----------------

@pytest.mark.parametrize("old, new", [
    ("acc[r] += s * dot + b * x_sum[wi];", "acc[r] += s * dot;"),  # forgets the biases
    ("const ushort src = ushort((32 * wi + lane) / GROUP_WORDS);",
     "const ushort src = ushort((32 * wi + lane) / GROUP_WORDS / 2);"),  # wrong scale group
    ("const uint g = mt_qmv_shuffle<PLAIN_SHUFFLES>(group[r], src);",
     "const uint g = mt_qmv_shuffle<PLAIN_SHUFFLES>(group[r], ushort(0));"),  # lane 0's scale
    ("const uint rows = metal::min(ROWS, n_rows_total - row0);",
     "const uint rows = metal::min(ROWS - 1, n_rows_total - row0);"),  # leaves rows unwritten
], ids=("no_bias", "wrong_group", "wrong_shuffle", "unwritten_rows"))
def test_negative_control_broken_kernel(kernel_backend, poisoned_outputs, broken_kernel, rng,
                                        old, new):
    broken_kernel(op_module.SPEC, (old, new))
    w, s, b = make_weights(rng, 4, 16, 256, mx.float32, 32, 4)
    ids = mx.array([[1, 3]], dtype=mx.uint32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (1, 256), mx.float32), w, s, b, ids, 32, 4, kernel_backend)


def test_negative_control_unguarded_id_is_a_hazard(broken_kernel, rng):
    """Without the in-kernel id guard, an out-of-range id reads out of bounds: the emulator
    must report it (so the guarded kernel's clean runs above mean something)."""
    emulator = pytest.importorskip("mlx_metaltile.emulator")
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    broken_kernel(op_module.SPEC, ("if (expert >= n_experts) {", "if (false) {"))
    w, s, b = make_weights(rng, 4, 16, 128, mx.float32, 64, 4)
    ids = mx.array([[1, 4000]], dtype=mx.uint32)
    with backends.use_backend("emulator"), pytest.raises(emulator.OutOfBoundsAccess):
        mx.eval(mt.expert_qmv(make_x(rng, (1, 128), mx.float32), w, s, b, ids))


def test_negative_control_reference_wrong_expert(monkeypatch, rng):
    """The oracle harness rejects a composite that applies the wrong experts."""
    real = op_module._reference

    def shifted(x, w, scales, biases, indices, info):
        return real(x, w, scales, biases, (indices + 1) % w.shape[0], info)

    monkeypatch.setattr(op_module, "_reference", shifted)
    w, s, b = make_weights(rng, 4, 16, 128, mx.float32, 64, 4)
    ids = mx.array([[0, 2]], dtype=mx.uint32)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (1, 128), mx.float32), w, s, b, ids, 64, 4, "reference")


# ---- bad input ------------------------------------------------------------------------

def _ok(dtype=mx.float16, bits=4, group_size=64, n_experts=4, n_out=8, n_in=128):
    w = mx.zeros((n_experts, n_out, n_in * bits // 32), dtype=mx.uint32)
    s = mx.ones((n_experts, n_out, n_in // group_size), dtype=dtype)
    x = mx.zeros((2, n_in), dtype=dtype)
    return x, w, s, s, mx.zeros((2, 3), dtype=mx.uint32)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda x, w, s, b, i: (x, w[0], s, b, i), ValueError, r"w must have 3 dimensions \[E, N, \.\.\.\], got 2"),
    (lambda x, w, s, b, i: (x, w, s[0], b, i), ValueError, "scales must have 3 dimensions"),
    (lambda x, w, s, b, i: (x, w, s, b[..., None], i), ValueError, "biases must have 3 dimensions"),
    (lambda x, w, s, b, i: (x, w, s[:3], b, i), ValueError, r"scales must have shape \(4, 8, K/group_size\)"),
    (lambda x, w, s, b, i: (x, w, s, b[:, :5], i), ValueError, r"biases must have shape \(4, 8, K/group_size\)"),
    (lambda x, w, s, b, i: (x, w, s, b[..., :1], i), ValueError, r"biases must have scales' shape"),
    (lambda x, w, s, b, i: (x, w, s[..., :1], b[..., :1], i), ValueError,
     r"scales must have K/group_size = 128/64 = 2 groups per row, got 1"),
    (lambda x, w, s, b, i: (x, w[..., :3], s, b, i), ValueError,
     "K = 24 .* must be a multiple of group_size 64"),
    (lambda x, w, s, b, i: (x, w[..., :0], s[..., :0], b[..., :0], i), ValueError, "K must be >= 1"),
    (lambda x, w, s, b, i: (x, w[:0], s[:0], b[:0], i), ValueError, "w must hold at least one expert, got E = 0"),
    (lambda x, w, s, b, i: (x[:, :64], w, s, b, i), ValueError, "x's last axis must be K = 128 .*got 64"),
    (lambda x, w, s, b, i: (mx.zeros((2, 3, 128), mx.float16), w, s, b, i[:, :2]), ValueError,
     r"x \[\.\.\., k, K\] \(one input per expert, read from x.ndim = indices.ndim \+ 1 = 3\) "
     r"must have x.shape\[-2\] = k = 2 \(indices' last axis\) or 1, got 3"),
    (lambda x, w, s, b, i: (mx.zeros((5, 3, 3, 128), mx.float16), w, s, b, i), ValueError,
     r"the leading dimensions of x \(5, 3, 3\) and indices \(2,\) must broadcast"),
    (lambda x, w, s, b, i: (x, w, s, b, i[0, 0]), ValueError, "indices must have at least 1 dim"),
    (lambda x, w, s, b, i: (mx.zeros((3, 128), mx.float16), w, s, b, i), ValueError,
     r"the leading dimensions of x \(3,\) and indices \(2,\) must broadcast"),
    (lambda x, w, s, b, i: (x, w, s, b, i.astype(mx.float32)), TypeError, "indices must be uint32 or int32, got float32"),
    (lambda x, w, s, b, i: (x, w, s, b, i.astype(mx.int64)), TypeError, "indices must be uint32 or int32, got int64"),
    (lambda x, w, s, b, i: (x, w.astype(mx.int32), s, b, i), TypeError, "w must be uint32"),
    (lambda x, w, s, b, i: (x.astype(mx.int32), w, s, b, i), TypeError, "x must be float32"),
    (lambda x, w, s, b, i: (x, w, s.astype(mx.float32), b, i), TypeError, "scales must have x's dtype float16, got float32"),
    (lambda x, w, s, b, i: (x, w, s, b.astype(mx.bfloat16), i), TypeError, "biases must have x's dtype"),
    (lambda x, w, s, b, i: (x, w, s, b, i.tolist()), TypeError, "indices must be an mx.array"),
])
def test_bad_input(mutate, exc, match):
    args = mutate(*_ok())
    with pytest.raises(exc, match=r"^\[expert_qmv\] " + match):
        mt.expert_qmv(*args)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(bits=3), ValueError, r"bits must be one of \(4, 8\), got 3"),
    (dict(bits=2), ValueError, "bits must be one of"),
    (dict(bits=4.0), TypeError, "bits must be an int"),
    (dict(group_size=16), ValueError, r"group_size must be one of \(32, 64, 128\), got 16"),
    (dict(group_size=True), TypeError, "group_size must be an int"),
])
def test_bad_bits_and_group_size(kwargs, exc, match):
    with pytest.raises(exc, match=r"^\[expert_qmv\] " + match):
        mt.expert_qmv(*_ok(), **kwargs)


def test_numpy_integer_settings(rng):
    """bits / group_size given as NumPy integers (e.g. read from a model config) work."""
    w, s, b = make_weights(rng, 3, 8, 128, mx.float32, 32, 8)
    x, ids = make_x(rng, (2, 128), mx.float32), mx.array([[2, 0], [1, 1]], dtype=mx.uint32)
    got = mt.expert_qmv(x, w, s, b, ids, group_size=np.int64(32), bits=np.int32(8))
    want = mt.expert_qmv(x, w, s, b, ids, group_size=32, bits=8)
    assert mx.array_equal(got, want).item()


def test_bits_inconsistent_with_packing():
    """w packed at 4 bits (K = 128) read with bits=8 (K = 64): the group count disagrees."""
    x, w, s, b, i = _ok(bits=4)
    with pytest.raises(ValueError, match=r"^\[expert_qmv\] scales must have K/group_size = "
                                         r"64/64 = 1 groups per row, got 2 \(w packs K = 64"):
        mt.expert_qmv(x, w, s, b, i, bits=8)


def test_bad_input_names_expected_shape_sizes():
    x, w, s, b, i = _ok()
    with pytest.raises(ValueError) as err:
        mt.expert_qmv(x[:, :100], w, s, b, i)
    assert "K = 128" in str(err.value) and "got 100" in str(err.value)
