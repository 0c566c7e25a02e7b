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
from mlx_metaltile.cases.expert_glu import make_experts, make_x, project, run_and_check

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

@pytest.mark.parametrize("mode, group_size, bits", [("affine", 64, 4), ("mxfp4", 32, 4)])
def test_reads_each_selected_expert_once(poisoned_outputs, rng, mode, group_size, bits):
    """Per (token, valid expert): its gate rows, up rows (words, scales, biases) and bias
    rows once each; x loaded once per SIMD-group for both projections (DRAM sees it once
    per token, from cache after); out written once, [tokens, k, N]."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    from mlx_metaltile import emulator

    n_experts, n_out, n_in = 16, 20, 4 * group_size
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.float16, mode, group_size, bits,
                     bias=True)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)  # repeated, 0, E-1, invalid
    x = make_x(rng, (2, n_in), mx.float16)
    with backends.use_backend("emulator"):
        run_and_check(x, gate, up, ids, "emulator", mode=mode, group_size=group_size,
                      bits=bits)
    stats = emulator.last_launch_stats()
    pairs = 5  # valid (token, expert) pairs; the out-of-range one reads nothing
    words = pairs * n_out * (n_in * bits // 32) * 4
    scale_bytes = pairs * n_out * (n_in // group_size) * (2 if mode == "affine" else 1)
    for proj in ("gate", "up"):
        assert stats.bytes_read[f"w_{proj}"] == words
        assert stats.bytes_read[f"scales_{proj}"] == scale_bytes
        assert stats.bytes_read[f"biases_{proj}"] == (scale_bytes if mode == "affine" else 0)
        assert stats.bytes_read[f"bias_{proj}"] == pairs * n_out * 2
    assert stats.bytes_read["x"] == pairs * -(-n_out // 4) * n_in * 2
    assert stats.bytes_written["out"] == 6 * n_out * 2 and stats.bytes_read["out"] == 0


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


@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(poisoned_outputs, rng, seed):
    """Strict mode (a shuffle may not read a lane that is not at it) with threads and
    threadgroups run in a permuted order: ragged N, a partial 32-lane step, both layouts."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")

    gate, up = _pair(rng, 5, 13, 96, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 7], [2, 2, 1]], dtype=mx.int32)
    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            for x_shape in ((2, 96), (2, 3, 96)):
                run_and_check(make_x(rng, x_shape, mx.bfloat16), gate, up, ids, "emulator",
                              activation="swiglu_oai", group_size=32)


# ---- cuda's launch plan (a row block's K steps over S SIMD-groups), run on the emulator ----

@pytest.fixture
def k_plan(monkeypatch):
    """The emulator launched with the cuda backend's plan (expert_qmv's _k_groups)."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    real = op_module._k_groups
    monkeypatch.setattr(op_module, "_k_groups", lambda *a: real(*a[:-1], "cuda"))
    with backends.use_backend("emulator"):
        yield


def _k_plan_ran(groups, valid_pairs):
    from mlx_metaltile import emulator

    stats = emulator.last_launch_stats()
    assert stats.threadgroup == (64 * groups, 1, 1)
    tiles = stats.threadgroups // stats.grid[2]
    assert stats.threadgroup_barriers == tiles * valid_pairs
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
    _k_plan_ran(4, valid_pairs=3)
    assert np.isnan(to_f64(out)).all(axis=-1).tolist() == [[False, False], [True, False]]


def test_k_plan_reads_each_selected_expert_once(k_plan, poisoned_outputs, rng):
    n_experts, n_out, n_in = 16, 24, 2048
    gate, up = _pair(rng, n_experts, n_out, n_in, mx.float16, bias=True)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, n_in), mx.float16), gate, up, ids, "emulator")
    stats = _k_plan_ran(4, valid_pairs=5)
    pairs = 5
    for proj in ("gate", "up"):
        assert stats.bytes_read[f"w_{proj}"] == pairs * n_out * (n_in * 4 // 32) * 4
        assert stats.bytes_read[f"scales_{proj}"] == pairs * n_out * (n_in // 64) * 2
        assert stats.bytes_read[f"bias_{proj}"] == pairs * n_out * 2
    assert stats.bytes_read["x"] == pairs * -(-n_out // 4) * n_in * 2
    assert stats.bytes_written["out"] == 6 * n_out * 2 and stats.bytes_read["out"] == 0


@pytest.mark.parametrize("seed", (1, 2))
def test_k_plan_strict_shuffled(k_plan, poisoned_outputs, rng, seed):

    gate, up = _pair(rng, 5, 8, 1024 + 128, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 3], [2, 2, 1]], dtype=mx.int32)
    x = make_x(rng, (2, 1024 + 128), mx.bfloat16)
    with strict_emulator(seed):
        out = run_and_check(x, gate, up, ids, "emulator", group_size=32)
        _k_plan_ran(3, valid_pairs=6)
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
    every dtype, mode, activation and index dtype (recorded, nothing runs)."""
    n = 0
    for dtype in DTYPES:
        for mode, gs, bits in (*QUANT, ("affine", 64, 4)):
            gate, up = _pair(rng, 3, 8, 128, dtype, mode, gs, bits, bias=True)
            for activation in ("silu", "swiglu_oai"):
                for ids in (mx.array([[0, 2]], dtype=mx.uint32),
                            mx.array([[0, 2]], dtype=mx.int32)):
                    mt.expert_glu(make_x(rng, (1, 128), dtype), *gate[:3], *up[:3], ids,
                                  bias_gate=gate[3], bias_up=up[3], activation=activation,
                                  mode=mode, group_size=gs, bits=bits)
                    n += 1
    assert len(launch_recorder.seen) == n
    assert {name for name, *_ in launch_recorder.seen} == {op_module.SPEC.name}
    launch_recorder.assert_declared()


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
                                ("MODE", 0), ("ACT", 1)]


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
    ("acc_u[r] += su * du + bu * x_sum[wi];", "acc_u[r] += su * du;", "silu"),
    ("u += float(bias_up[at]);", "u += 0.0f;", "silu"),
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
