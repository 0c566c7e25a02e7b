"""expert_down_combine against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import importlib
import itertools

import mlx.core as mx
import numpy as np
import pytest
from support import strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import to_f64
from mlx_metaltile.cases.expert_down_combine import make_scores, run_and_check
from mlx_metaltile.cases.expert_glu import make_experts, make_x

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.expert_down_combine")
QUANT = (("affine", 32, 4), ("affine", 64, 8), ("affine", 128, 4), ("mxfp4", 32, 4),
         ("nvfp4", 16, 4), ("mxfp8", 32, 8))


def _dname(d):
    return str(d).rsplit(".", 1)[-1]


# ---- correctness ----------------------------------------------------------------------

@pytest.mark.parametrize("bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("mode, group_size, bits", QUANT, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_matches_oracle(any_backend, poisoned_outputs, rng, dtype, mode, group_size, bits,
                        bias):
    """D = 13 (a ragged 8-row tile), N = 4 groups, ids 0 / E-1 / repeated in a token, scores
    in h's dtype (float32 scores in test_score_dtypes)."""
    n_experts, d, n = 6, 13, 4 * max(group_size, 32)
    down = make_experts(rng, n_experts, d, n, dtype, mode, group_size, bits, bias=bias)
    ids = mx.array([[0, 5], [3, 3], [5, 0]], dtype=mx.uint32)
    run_and_check(make_x(rng, (3, 2, n), dtype), down, ids, make_scores(rng, (3, 2), dtype),
                  any_backend, mode=mode, group_size=group_size, bits=bits)


@pytest.mark.parametrize("mode, group_size, bits, n", [
    ("affine", 32, 4, 1664), ("affine", 32, 8, 800), ("nvfp4", 16, 4, 896),
    ("mxfp8", 32, 8, 800)], ids=lambda v: str(v))
def test_partial_step_splits_lane_words(any_backend, poisoned_outputs, rng, mode, group_size,
                                        bits, n):
    """A step holds 32 * WORDS words of a row (128; nvfp4 64), lane l words l, 32 + l, ...:
    N of one full step and 80, 72 or 48 words more, so the last step's third (nvfp4:
    second) words cover only some lanes."""
    down = make_experts(rng, 4, 16, n, mx.bfloat16, mode, group_size, bits, bias=True)
    ids = mx.array([[3, 0], [1, 1]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, 2, n), mx.bfloat16), down, ids,
                  make_scores(rng, (2, 2), mx.bfloat16), any_backend, mode=mode,
                  group_size=group_size, bits=bits)


@pytest.mark.parametrize("k", range(1, 11))
def test_top_k(any_backend, poisoned_outputs, rng, k):
    """k = 1..10 experts summed per token: first and last ids, a repeated id, signed scores."""
    n_experts, d, n = 12, 16, 128
    down = make_experts(rng, n_experts, d, n, mx.bfloat16, bias=True)
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(2)])
    ids[0, 0], ids[-1, -1] = 0, n_experts - 1
    if k > 1:
        ids[1, 0] = ids[1, 1]
    scores = mx.array(rng.standard_normal((2, k)).astype(np.float32))
    run_and_check(make_x(rng, (2, k, n), mx.bfloat16), down,
                  mx.array(ids.astype(np.int32)), scores, any_backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_score_dtypes(any_backend, poisoned_outputs, rng, dtype):
    down = make_experts(rng, 5, 24, 64, dtype, group_size=32)
    ids = mx.array([[[4, 1, 2]], [[0, 0, 3]]], dtype=mx.uint32)  # [2, 1, 3]: leading dims
    out = run_and_check(make_x(rng, (2, 1, 3, 64), dtype), down, ids,
                        make_scores(rng, (2, 1, 3)), any_backend, group_size=32)
    assert out.shape == (2, 1, 24)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_out_of_range_id_makes_the_token_nan(any_backend, poisoned_outputs, rng, dtype):
    n_experts, d, n = 4, 12, 128
    down = make_experts(rng, n_experts, d, n, dtype, bias=True)
    ids = mx.array([[0, n_experts], [2, 3], [-1, 1], [2**31 - 1, 0]], dtype=mx.int32)
    out = run_and_check(make_x(rng, (4, 2, n), dtype), down, ids,
                        make_scores(rng, (4, 2), dtype), any_backend)
    assert np.isnan(to_f64(out)).all(axis=-1).tolist() == [True, False, True, True]


def test_large_magnitudes(any_backend, poisoned_outputs, rng):
    down = make_experts(rng, 3, 16, 1024, mx.bfloat16, group_size=128, bits=8, scale=30.0)
    ids = mx.array([[2, 0, 1]], dtype=mx.uint32)
    run_and_check(make_x(rng, (1, 3, 1024), mx.bfloat16, scale=30.0), down, ids,
                  make_scores(rng, (1, 3)), any_backend, group_size=128, bits=8)


def test_bitwise_reproducible(kernel_backend, rng):
    """The sum over k has a fixed order: repeated calls give identical bits."""
    down = make_experts(rng, 8, 40, 256, mx.bfloat16, bias=True)
    ids = mx.array([[7, 1, 1, 0, 5]], dtype=mx.uint32)
    h, s = make_x(rng, (1, 5, 256), mx.bfloat16), make_scores(rng, (1, 5))
    outs = [mt.expert_down_combine(h, *down[:3], ids, s, bias=down[3]) for _ in range(3)]
    mx.eval(outs)
    assert all(mx.array_equal(o, outs[0]).item() for o in outs[1:])


def test_stream_argument(rng):
    down = make_experts(rng, 3, 8, 64, mx.float32, group_size=32)
    h, ids = make_x(rng, (1, 2, 64), mx.float32), mx.array([[2, 1]], dtype=mx.uint32)
    s = make_scores(rng, (1, 2))
    got = mt.expert_down_combine(h, *down[:3], ids, s, group_size=32, stream=mx.cpu)
    want = mt.expert_down_combine(h, *down[:3], ids, s, group_size=32)
    assert mx.array_equal(got, want).item()


# ---- what the kernel reads (emulator counters) ------------------------------------------

@pytest.fixture
def per_token(monkeypatch):
    """Every call per token (the token-block form off)."""
    monkeypatch.setattr(op_module, "_share_plan", lambda tokens, k, backend: None)


@pytest.mark.parametrize("mode, group_size, bits", [("affine", 64, 4), ("mxfp4", 32, 4)])
def test_reads_each_selected_expert_once(per_token, poisoned_outputs, rng, mode, group_size,
                                         bits):
    """Per token: per valid token and slot, the expert's down rows (words, scales, biases,
    bias) once; h once per SIMD-group; ids and scores broadcast loads; only [tokens, D] written (no
    [tokens, k, D] intermediate). A token with an invalid id reads no expert byte."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    from mlx_metaltile import emulator

    n_experts, d, n = 16, 20, 4 * group_size
    down = make_experts(rng, n_experts, d, n, mx.float16, mode, group_size, bits, bias=True)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)  # token 1 is NaN
    with backends.use_backend("emulator"):
        run_and_check(make_x(rng, (2, 3, n), mx.float16), down, ids,
                      make_scores(rng, (2, 3), mx.float16), "emulator", mode=mode,
                      group_size=group_size, bits=bits)
    stats = emulator.last_launch_stats()
    slots = 3  # token 0's three (token, slot) pairs
    scale_bytes = slots * d * (n // group_size) * (2 if mode == "affine" else 1)
    assert stats.bytes_read["w"] == slots * d * (n * bits // 32) * 4
    assert stats.bytes_read["scales"] == scale_bytes
    assert stats.bytes_read["biases"] == (scale_bytes if mode == "affine" else 0)
    assert stats.bytes_read["bias"] == slots * d * 2
    assert stats.bytes_read["h"] == slots * -(-d // 4) * n * 2
    assert stats.bytes_written["out"] == 2 * d * 2 and stats.bytes_read["out"] == 0


@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(poisoned_outputs, rng, seed):
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")

    down = make_experts(rng, 5, 13, 96, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 3], [2, 2, 1]], dtype=mx.int32)
    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            run_and_check(make_x(rng, (2, 3, 96), mx.bfloat16), down, ids,
                          make_scores(rng, (2, 3)), "emulator", group_size=32)


# ---- cuda's launch plan (a row block's k slots over S SIMD-groups), run on the emulator ----

@pytest.fixture
def slot_plan(monkeypatch, per_token):
    """The emulator launched with the cuda backend's per-token plan: S = _slot_groups(k,
    "cuda") slot groups per row block, combined through threadgroup memory after a barrier."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    real = op_module._slot_groups
    monkeypatch.setattr(op_module, "_slot_groups", lambda k, backend: real(k, "cuda"))
    with backends.use_backend("emulator"):
        yield


def _plan_ran(k, valid_tokens):
    """The last launch used cuda's plan for k (threadgroup 64 * S; when S > 1 one barrier
    release per threadgroup of a token with valid ids: the others return before it)."""
    from mlx_metaltile import emulator

    stats = emulator.last_launch_stats()
    slot_groups = op_module._slot_groups(k, "cuda")
    assert stats.threadgroup == (64 * slot_groups, 1, 1)
    tiles = stats.threadgroups // stats.grid[2]
    assert stats.threadgroup_barriers == (tiles * valid_tokens if slot_groups > 1 else 0)
    return stats


def test_slot_groups_of_each_plan():
    """cuda spreads k slots evenly over at most CUDA_SLOT_GROUPS (4) slot groups; Metal
    keeps one."""
    assert op_module.CUDA_SLOT_GROUPS == 4
    assert [op_module._slot_groups(k, "cuda") for k in range(1, 17)] == [
        1, 2, 3, 4, 3, 3, 4, 4, 3, 4, 4, 4, 4, 4, 4, 4]
    assert {op_module._slot_groups(k, b) for k in range(1, 17)
            for b in ("metal", "emulator", "reference")} == {1}


@pytest.mark.parametrize("k", (2, 3, 8, 10))
@pytest.mark.parametrize("mode, group_size, bits", QUANT, ids=lambda v: str(v))
def test_slot_plan_matches_oracle(slot_plan, poisoned_outputs, rng, mode, group_size, bits, k):
    """D = 13 (a ragged last row block; D = 20 below has one past D), a token with an invalid
    id (NaN row), signed float32 scores, biases."""
    n_experts, d, n = 11, 13, 2 * max(group_size, 32)
    down = make_experts(rng, n_experts, d, n, mx.bfloat16, mode, group_size, bits, bias=True)
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(3)]).astype(np.int32)
    ids[2, k - 1] = n_experts
    scores = mx.array(rng.standard_normal((3, k)).astype(np.float32))
    out = run_and_check(make_x(rng, (3, k, n), mx.bfloat16), down, mx.array(ids), scores,
                        "emulator", mode=mode, group_size=group_size, bits=bits)
    _plan_ran(k, valid_tokens=2)
    assert np.isnan(to_f64(out)).all(axis=-1).tolist() == [False, False, True]


def test_slot_plan_reads_each_selected_expert_once(slot_plan, poisoned_outputs, rng):
    """The read-once invariant under cuda's plan: each (slot, row block) is one SIMD-group's."""
    n_experts, d, n, k = 16, 20, 256, 3
    down = make_experts(rng, n_experts, d, n, mx.float16, bias=True)
    ids = mx.array([[3, 3, 0], [15, 7, 99]], dtype=mx.uint32)  # token 1 is NaN
    run_and_check(make_x(rng, (2, k, n), mx.float16), down, ids,
                  make_scores(rng, (2, k), mx.float16), "emulator")
    stats = _plan_ran(k, valid_tokens=1)
    slots, scale_bytes = 3, 3 * d * (n // 64) * 2
    assert stats.bytes_read["w"] == slots * d * (n * 4 // 32) * 4
    assert stats.bytes_read["scales"] == stats.bytes_read["biases"] == scale_bytes
    assert stats.bytes_read["bias"] == slots * d * 2
    assert stats.bytes_read["h"] == slots * -(-d // 4) * n * 2
    assert stats.bytes_written["out"] == 2 * d * 2 and stats.bytes_read["out"] == 0


@pytest.mark.parametrize("old, new", [
    ("for (uint g = 0; g < slot_groups; ++g) {", "for (uint g = 0; g < 1; ++g) {"),
    ("if (item % slot_groups != slot_group) {", "if (item % slot_groups == slot_group) {"),
], ids=("first_slot_group_only", "other_groups_slots"))
def test_slot_plan_negative_control(slot_plan, poisoned_outputs, broken_kernel, rng, old, new):
    """The slot groups' combine and the dealing of slots must matter under cuda's plan."""
    broken_kernel(op_module.SPEC, (old, new))
    down = make_experts(rng, 6, 16, 128, mx.float32, bias=True)
    ids = mx.array([[1, 3, 0, 5]], dtype=mx.uint32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (1, 4, 128), mx.float32), down, ids,
                      make_scores(rng, (1, 4)), "emulator")


@pytest.mark.parametrize("seed", (1, 2))
def test_slot_plan_strict_shuffled(slot_plan, poisoned_outputs, rng, seed):
    """Strict mode (no read of unwritten threadgroup memory, no shuffle of an absent lane),
    threads and threadgroups in a permuted order, and bitwise equal results run to run."""

    down = make_experts(rng, 5, 13, 96, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 3, 1, 2], [2, 2, 1, 0, 0]], dtype=mx.int32)
    h, s = make_x(rng, (2, 5, 96), mx.bfloat16), make_scores(rng, (2, 5))
    with strict_emulator(seed):
        out = run_and_check(h, down, ids, s, "emulator", group_size=32)
        _plan_ran(5, valid_tokens=2)
        again = mt.expert_down_combine(h, *down[:3], ids, s, bias=down[3], group_size=32)
        assert mx.array_equal(out, again).item()


# ---- build once ----------------------------------------------------------------------------

def test_instantiations_match_the_launches(share_on, launch_recorder, rng):
    n = 0
    for dtype in DTYPES:
        for mode, gs, bits in (*QUANT, ("affine", 64, 4)):
            down = make_experts(rng, 3, 8, 128, dtype, mode, gs, bits, bias=True)
            for ids, sdt, tokens in itertools.product((mx.uint32, mx.int32),
                                                      (dtype, mx.float32), (1, 2)):
                # one token per token, two the token-block form (SHARE = 1)
                mt.expert_down_combine(make_x(rng, (tokens, 2, 128), dtype), *down[:3],
                                       mx.array([[0, 2]] * tokens, dtype=ids),
                                       make_scores(rng, (tokens, 2), sdt), bias=down[3],
                                       mode=mode, group_size=gs, bits=bits)
                n += 1
    assert len(launch_recorder.seen) == n
    assert {name for name, *_ in launch_recorder.seen} == {op_module.SPEC.name}
    assert {dict(t)["SHARE"] for _, t, *_ in launch_recorder.seen} == {0, 1}
    launch_recorder.assert_declared()


def test_kernel_path_is_lazy(monkeypatch, no_host_sync, rng):
    seen = {}

    def fake_kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                    init_value=None):
        seen.update(grid=grid, threadgroup=threadgroup, template=template)
        return [mx.zeros(shape, dtype=dtype) for shape, dtype
                in zip(output_shapes, output_dtypes, strict=True)]

    down = make_experts(rng, 8, 40, 128, mx.bfloat16, bias=True)
    h = make_x(rng, (2, 3, 2, 128), mx.bfloat16)
    logits = make_x(rng, (2, 3, 8), mx.float32)
    with no_host_sync(), monkeypatch.context() as m:
        m.setattr(backends, "resolve_backend", lambda name=None: "metal")
        m.setattr(backends, "get_kernel", lambda *a, **k: fake_kernel)
        ids = mx.argpartition(-logits, kth=1, axis=-1)[..., :2]
        scores = mx.softmax(mx.take_along_axis(logits, ids, axis=-1), axis=-1)
        out = mt.expert_down_combine(h, *down[:3], ids, scores, bias=down[3])
    assert out.shape == (2, 3, 40) and out.dtype == mx.bfloat16
    # six tokens, Metal's plan by default: one threadgroup per (token, 8-row tile), S = 1
    assert seen["grid"] == (64, 5, 6) and seen["threadgroup"] == (64, 1, 1)
    assert seen["template"] == [("T", mx.bfloat16), ("BITS", 4), ("GROUP_SIZE", 64),
                                ("MODE", 0), ("SHARE", 0)]


def test_empty_does_not_dispatch(kernel_backend, rng):
    down = make_experts(rng, 4, 8, 64, mx.float16, group_size=32)
    before = backends.launch_count()
    out = mt.expert_down_combine(make_x(rng, (0, 2, 64), mx.float16), *down[:3],
                                 mx.zeros((0, 2), dtype=mx.uint32), mx.zeros((0, 2)),
                                 group_size=32)
    assert out.shape == (0, 8) and out.dtype == mx.float16
    out = mt.expert_down_combine(make_x(rng, (3, 0, 64), mx.float16), *down[:3],
                                 mx.zeros((3, 0), dtype=mx.uint32), mx.zeros((3, 0)),
                                 group_size=32)
    assert out.shape == (3, 8) and not out.any().item()
    assert backends.launch_count() == before


# ---- negative controls --------------------------------------------------------------------

@pytest.mark.parametrize("tokens", (1, 3), ids=("per_token", "token_block"))
@pytest.mark.parametrize("old, new", [
    ("const float score = float(scores[pair0 + pairs[i]]);", "const float score = 1.0f;"),
    ("item < items; ++item) {  // fixed", "item < 1; ++item) {  // fixed"),
    ("row_bias[r] = float(bias[first_row + r]);", "row_bias[r] = 0.0f;"),
    ("h + size_t(pair0 + pairs[i]) * K", "h + size_t(pair0) * K"),
], ids=("no_scores", "first_expert_only", "no_bias", "wrong_h_row"))
def test_negative_control_broken_kernel(kernel_backend, poisoned_outputs, broken_kernel, rng,
                                        old, new, tokens):
    broken_kernel(op_module.SPEC, (old, new))
    down = make_experts(rng, 4, 16, 256, mx.float32, group_size=32, bias=True)
    ids = mx.array([[1, 3, 0], [2, 1, 1], [0, 3, 2]][:tokens], dtype=mx.uint32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (tokens, 3, 256), mx.float32), down, ids,
                      make_scores(rng, (tokens, 3)), kernel_backend, group_size=32)


def test_negative_control_unguarded_id_is_a_hazard(broken_kernel, rng):
    emulator = pytest.importorskip("mlx_metaltile.emulator")
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    broken_kernel(op_module.SPEC, ("if (!all_valid) {", "if (false) {"))
    down = make_experts(rng, 4, 16, 128, mx.float32)
    ids = mx.array([[1, 4000]], dtype=mx.uint32)
    with backends.use_backend("emulator"), pytest.raises(emulator.OutOfBoundsAccess):
        mx.eval(mt.expert_down_combine(make_x(rng, (1, 2, 128), mx.float32), *down[:3], ids,
                                       make_scores(rng, (1, 2))))


def test_negative_control_reference_without_scores(monkeypatch, rng):
    real = op_module._reference
    monkeypatch.setattr(op_module, "_reference",
                        lambda h, w, s, b, i, sc, bias, info: real(h, w, s, b, i,
                                                                   mx.ones_like(sc), bias,
                                                                   info))
    down = make_experts(rng, 4, 16, 128, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError,
                                                           match="out of tolerance"):
        run_and_check(make_x(rng, (1, 2, 128), mx.float32), down,
                      mx.array([[0, 2]], dtype=mx.uint32), make_scores(rng, (1, 2)),
                      "reference")


# ---- bad input ------------------------------------------------------------------------

def _ok():
    w = mx.zeros((4, 8, 16), dtype=mx.uint32)
    s = mx.ones((4, 8, 2), dtype=mx.float16)
    return (mx.zeros((2, 3, 128), mx.float16), w, s, s, mx.zeros((2, 3), dtype=mx.uint32),
            mx.ones((2, 3), mx.float16))


@pytest.mark.parametrize("mutate, kwargs, exc, match", [
    (lambda a: (a[0][:, :2], *a[1:]), {}, ValueError,
     r"h must be \[\.\.\., k, N\] with indices \[\.\.\., k\] of the same leading shape"),
    (lambda a: (a[0][0], *a[1:]), {}, ValueError, r"h must be \[\.\.\., k, N\]"),
    (lambda a: (*a[:5], a[5][:, :2]), {}, ValueError,
     r"scores must have indices' shape \(2, 3\), got \(2, 2\)"),
    (lambda a: (*a[:5], a[5].astype(mx.bfloat16)), {}, TypeError,
     "scores must be float32 or h's dtype float16, got bfloat16"),
    (lambda a: (*a[:5], a[5].astype(mx.int32)), {}, TypeError, "scores must be float32"),
    (lambda a: a, dict(bias=mx.zeros((4, 7), mx.float16)), ValueError,
     r"bias must have shape \[E, D\] = \(4, 8\), got \(4, 7\)"),
    (lambda a: a, dict(bias=mx.zeros((4, 8), mx.float32)), TypeError,
     "bias must have h's dtype float16"),
    (lambda a: (a[0][..., :64], *a[1:]), {}, ValueError, "x's last axis must be K = 128"),
])
def test_bad_input(mutate, kwargs, exc, match):
    with pytest.raises(exc, match=r"^\[expert_down_combine\] " + match):
        mt.expert_down_combine(*mutate(_ok()), **kwargs)


# ---- the token-block form: each distinct expert of a block read once for its pairs ---------

@pytest.fixture
def share_on(monkeypatch):
    """The token-block form from 2 tokens on Metal (so the emulator) and cuda: it is off by
    default (SHARE_MIN_TOKENS names no backend), plans rebuilt."""
    from mlx_metaltile.ops._common import clear_plans

    monkeypatch.setattr(op_module, "SHARE_MIN_TOKENS", {"metal": 2, "cuda": 2})
    clear_plans()
    yield
    clear_plans()


def test_share_plan_is_off_by_default():
    assert op_module.SHARE_MIN_TOKENS == {}
    assert all(op_module._share_plan(t, 4, b) is None
               for t in (2, 4, 8) for b in ("metal", "emulator", "cuda"))


@pytest.fixture(params=("metal", "cuda"))
def share_plan(request, monkeypatch, share_on):
    """The emulator launched with that backend's token-block plan (_share_plan): TB tokens
    per threadgroup, their distinct experts dealt to S slot groups."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    real, key = op_module._share_plan, request.param
    monkeypatch.setattr(op_module, "_share_plan", lambda t, k, backend: real(t, k, key))
    with backends.use_backend("emulator"):
        yield key


def _share_ran(key, tokens, k):
    """The last launch was the token-block form of ``key``'s plan: threadgroup 64 * S, one
    threadgroup column per block of TB tokens."""
    from mlx_metaltile import emulator

    block, slot_groups = op_module._share_plan(tokens, k, key)
    stats = emulator.last_launch_stats()
    assert stats.threadgroup == (64 * slot_groups, 1, 1)
    assert stats.grid[2] == -(-tokens // block)
    return stats


def test_share_plan_of_each_backend(share_on):
    """(TB, S): TB the fewest of SHARE_TOKENS, 32 // k and the tokens; S cuda min(8, TB * k),
    Metal min(8, TB); one token (or TB < 2) per token."""
    plan = op_module._share_plan
    assert [plan(t, k, "cuda") for t, k in ((1, 8), (2, 4), (4, 8), (8, 4), (16, 4), (4, 10),
                                            (9, 3), (4, 17), (4, 32))] == [
        None, (2, 8), (4, 8), (8, 8), (8, 8), (3, 8), (8, 8), None, None]
    assert [plan(t, k, "metal") for t, k in ((1, 8), (2, 1), (4, 8), (8, 4), (4, 10))] == [
        None, (2, 2), (4, 4), (4, 4), (3, 3)]
    assert plan(4, 8, "emulator") == plan(4, 8, "metal")
    assert plan(4, 8, "reference") is None


def _block_ids(rng, tokens, k, n_experts):
    """Ids with tokens sharing experts, one token repeating an id, the first and last
    experts, expert 1 named by more pairs than MAX_SHARED, and one invalid id (token 2)."""
    ids = rng.integers(0, 4, (tokens, k))
    ids[:, 0] = 1
    ids[0, 0], ids[-1, -1] = 0, n_experts - 1
    if k > 1:
        ids[3, 1] = ids[3, 0]
    ids[2, -1] = n_experts
    return ids.astype(np.uint32)


def _check_blocks(rng, backend, k, score_dtype, mode="affine", group_size=64, bits=4):
    """Eleven tokens (a ragged last block under each plan), D = 13 (a ragged row block), only
    token 2's row NaN, signed scores, biases."""
    tokens, n_experts, d, n = 11, 9, 13, 2 * max(group_size, 32)
    down = make_experts(rng, n_experts, d, n, mx.bfloat16, mode, group_size, bits, bias=True)
    ids = _block_ids(rng, tokens, k, n_experts)
    scores = mx.array(rng.standard_normal((tokens, k)).astype(np.float32)).astype(score_dtype)
    out = run_and_check(make_x(rng, (tokens, k, n), mx.bfloat16), down, mx.array(ids),
                        scores, backend, mode=mode, group_size=group_size, bits=bits)
    assert np.isnan(to_f64(out)).all(axis=-1).tolist() == [t == 2 for t in range(tokens)]


@pytest.mark.parametrize("k", (1, 3, 10))
@pytest.mark.parametrize("mode, group_size, bits", [
    ("affine", 32, 4), ("affine", 64, 8), ("mxfp4", 32, 4), ("nvfp4", 16, 4)],
    ids=lambda v: str(v))
def test_share_plan_matches_oracle(share_plan, poisoned_outputs, rng, mode, group_size, bits,
                                   k):
    """Scores in h's dtype (float32 below)."""
    _check_blocks(rng, "emulator", k, mx.bfloat16, mode, group_size, bits)
    _share_ran(share_plan, 11, k)


@pytest.mark.parametrize("k", (1, 3, 10))
def test_share_plan_of_the_backend(share_on, kernel_backend, poisoned_outputs, rng, k):
    """The backend's own token-block plan (on cuda TB = 8 where 8 k <= 32, S = 8), float32
    scores."""
    assert op_module._share_plan(11, k, kernel_backend) is not None
    _check_blocks(rng, kernel_backend, k, mx.float32)


@pytest.mark.parametrize("ids, pairs", [
    ([[3, 3], [0, 3], [15, 7], [3, 99]], {3: 3, 0: 1, 15: 1, 7: 1}),  # token 3 is NaN
    ([[5, 5], [5, 5], [5, 5], [5, 5]], {5: 8}),  # more pairs than MAX_SHARED
], ids=("shared", "one_expert"))
def test_share_plan_reads_each_distinct_expert_once(share_plan, poisoned_outputs, rng, ids,
                                                    pairs):
    """One block of 4 tokens: each distinct expert of a valid token's down rows (words,
    scales, biases, bias) read once per pass of up to MAX_SHARED of its pairs, whatever the
    pairs naming it; h once per (valid pair, row block); only [tokens, D] written."""
    n_experts, d, n = 16, 20, 256
    down = make_experts(rng, n_experts, d, n, mx.float16, bias=True)
    ids = mx.array(ids, dtype=mx.uint32)
    run_and_check(make_x(rng, (4, 2, n), mx.float16), down, ids,
                  make_scores(rng, (4, 2), mx.float16), "emulator")
    stats = _share_ran(share_plan, 4, 2)
    reads = sum(-(-n // op_module.MAX_SHARED) for n in pairs.values())  # expert passes
    live = sum(pairs.values())
    assert stats.bytes_read["w"] == reads * d * (n * 4 // 32) * 4
    assert stats.bytes_read["scales"] == stats.bytes_read["biases"] == reads * d * (n // 64) * 2
    assert stats.bytes_read["bias"] == reads * d * 2
    assert stats.bytes_read["h"] == live * -(-d // 4) * n * 2
    assert stats.bytes_written["out"] == 4 * d * 2 and stats.bytes_read["out"] == 0


@pytest.mark.parametrize("old, new", [
    ("if (lane == pairs[i] / k * ROWS + r) {", "if (lane == r) {"),
    ("} while (sharers != 0u);", "} while (false);"),
    ("total += partials[(g * SIMDGROUPS + row_block) * HELD + lane];",
     "total += partials[row_block * HELD + lane];"),
], ids=("one_token", "first_pass_only", "first_slot_group_only"))
def test_share_plan_negative_control(share_plan, poisoned_outputs, broken_kernel, rng, old,
                                     new):
    """The pairs' tokens, the passes over an expert and the slot groups' combine matter."""
    broken_kernel(op_module.SPEC, (old, new))
    down = make_experts(rng, 6, 16, 128, mx.float32, bias=True)
    ids = mx.array([[1, 3], [1, 5], [1, 1], [0, 1]], dtype=mx.uint32)  # 5 pairs name 1
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(make_x(rng, (4, 2, 128), mx.float32), down, ids,
                      make_scores(rng, (4, 2)), "emulator")


def test_share_plan_strict_shuffled(share_plan, poisoned_outputs, rng):
    """Strict mode, threads and threadgroups in a permuted order, bitwise equal results run
    to run (the fixed order of the REDUCTION ORDER)."""
    down = make_experts(rng, 5, 13, 96, mx.bfloat16, group_size=32, bias=True)
    ids = mx.array([[4, 0, 3], [2, 2, 1], [0, 4, 4], [1, 0, 2], [3, 3, 3]], dtype=mx.int32)
    h, s = make_x(rng, (5, 3, 96), mx.bfloat16), make_scores(rng, (5, 3))
    with strict_emulator(1):
        out = run_and_check(h, down, ids, s, "emulator", group_size=32)
        _share_ran(share_plan, 5, 3)
    with strict_emulator(2):
        again = mt.expert_down_combine(h, *down[:3], ids, s, bias=down[3], group_size=32)
    assert mx.array_equal(out, again).item()
