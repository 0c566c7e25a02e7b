"""SIMD-group and quad-group functions against NumPy: reductions (also divergent), every
shuffle's edge semantics, votes, prefix scans, partial SIMD-groups, fiber-order permutation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import bf16_round, requires_emulator, run

from mlx_metaltile import emulator as em

pytestmark = requires_emulator
LANES = np.arange(32)


def per_lane(expr: str, n: int = 32, dtype=mx.float32, setup: str = "", tg: int | None = None):
    """out[i] = expr for each thread i of one threadgroup of n threads; `v` is 100 + lane id
    (float) and `lane` the index in the SIMD-group."""
    src = f"""
        uint i = thread_position_in_grid.x;
        ushort lane = thread_index_in_simdgroup;
        float v = 100.0f + float(i);
        {setup}
        out[i] = {expr};
    """
    (out,) = run(src, {"dummy": mx.zeros((1,))}, {"out": ((n,), dtype)}, (n, 1, 1),
                 (tg or n, 1, 1))
    return out


def test_simd_reductions_full_group():
    v = 100.0 + LANES
    assert np.all(per_lane("simd_sum(v)") == v.sum())
    assert np.all(per_lane("simd_product(v / 100.0f)") == pytest.approx(np.prod(v / 100), rel=1e-5))
    assert np.all(per_lane("simd_min(v)") == 100)
    assert np.all(per_lane("simd_max(v)") == 131)
    assert np.all(per_lane("simd_and(uint(i) | 64u)", dtype=mx.uint32) == 64)
    assert np.all(per_lane("simd_or(1u << (i % 8))", dtype=mx.uint32) == 255)
    assert np.all(per_lane("simd_xor(uint(i))", dtype=mx.uint32) == np.bitwise_xor.reduce(LANES))


def test_simd_sum_fixed_tree_order():
    # 1e8 and -1e8 cancel only when they meet first: lanes (0,1) pair in the tree.
    setup = "float x = lane == 0 ? 1e8f : lane == 1 ? -1e8f : 1.0f;"
    assert np.all(per_lane("simd_sum(x)", setup=setup) == 30.0)
    # lanes 0 and 16 meet at the last level, after 1e8 has absorbed the 1.0s of lanes 1..15
    setup = "float x = lane == 0 ? 1e8f : lane == 16 ? -1e8f : 1.0f;"
    got = per_lane("simd_sum(x)", setup=setup)
    left = np.float32(1e8) + np.float32(1) + np.float32(2) + np.float32(4) + np.float32(8)
    right = np.float32(-1e8) + np.float32(1) + np.float32(2) + np.float32(4) + np.float32(8)
    np.testing.assert_array_equal(got, np.float32(left + right))


def test_divergent_simd_sum_uses_active_lanes_only():
    got = per_lane("lane % 3 == 0 ? simd_sum(v) : -1.0f")
    want = np.where(LANES % 3 == 0, (100.0 + LANES[LANES % 3 == 0]).sum(), -1)
    np.testing.assert_array_equal(got, want)


def test_two_call_sites_in_different_branches_are_separate():
    got = per_lane("lane < 10 ? simd_sum(v) : simd_sum(2.0f * v)")
    want = np.where(LANES < 10, (100.0 + LANES[:10]).sum(), 2 * (100.0 + LANES[10:]).sum())
    np.testing.assert_array_equal(got, want)


def test_simd_sum_after_early_return_of_some_lanes():
    src = """
        uint i = thread_position_in_grid.x;
        if (i % 32 >= 20) return;
        out[i] = simd_sum(float(i));
    """
    (out,) = run(src, {"d": mx.zeros((1,))}, {"out": ((64,), mx.float32)}, (64, 1, 1),
                 (64, 1, 1))
    np.testing.assert_array_equal(out[:20], np.arange(20).sum())
    np.testing.assert_array_equal(out[32:52], np.arange(32, 52).sum())
    assert np.all(np.isnan(out[20:32]))


def test_partial_last_simd_group():
    got = per_lane("simd_sum(v)", n=40)
    np.testing.assert_array_equal(got[:32], (100.0 + np.arange(32)).sum())
    np.testing.assert_array_equal(got[32:], (100.0 + np.arange(32, 40)).sum())


@pytest.mark.parametrize("delta", [0, 1, 5, 31])
def test_shuffle_up_keeps_low_lanes(delta):
    got = per_lane(f"simd_shuffle_up(v, {delta})")
    np.testing.assert_array_equal(got, 100 + np.where(LANES >= delta, LANES - delta, LANES))


@pytest.mark.parametrize("delta", [0, 1, 16, 31])
def test_shuffle_down_keeps_high_lanes(delta):
    got = per_lane(f"simd_shuffle_down(v, {delta})")
    np.testing.assert_array_equal(got, 100 + np.where(LANES + delta < 32, LANES + delta, LANES))


def test_shuffle_xor_rotate_broadcast():
    np.testing.assert_array_equal(per_lane("simd_shuffle_xor(v, 5)"), 100 + (LANES ^ 5))
    np.testing.assert_array_equal(per_lane("simd_shuffle_rotate_up(v, 3)"),
                                  100 + (LANES - 3) % 32)
    np.testing.assert_array_equal(per_lane("simd_shuffle_rotate_down(v, 3)"),
                                  100 + (LANES + 3) % 32)
    np.testing.assert_array_equal(per_lane("simd_shuffle(v, (lane * 7) % 32)"),
                                  100 + (LANES * 7) % 32)
    np.testing.assert_array_equal(per_lane("simd_broadcast(v, 9)"), 109)
    np.testing.assert_array_equal(per_lane("lane < 4 ? -1.0f : simd_broadcast_first(v)"),
                                  np.where(LANES < 4, -1, 104))


def test_shuffle_and_fill():
    up = per_lane("simd_shuffle_and_fill_up(v, v + 1000.0f, 3)")
    np.testing.assert_array_equal(up, np.where(LANES >= 3, 100 + LANES - 3, 1100 + LANES + 29))
    down = per_lane("simd_shuffle_and_fill_down(v, v + 1000.0f, 3)")
    np.testing.assert_array_equal(down, np.where(LANES < 29, 103 + LANES, 1100 + LANES - 29))
    # with a modulo of 8: each group of 8 lanes shuffles on its own
    up8 = per_lane("simd_shuffle_and_fill_up(v, v + 1000.0f, 2, 8)")
    g = LANES % 8
    np.testing.assert_array_equal(up8, np.where(g >= 2, 100 + LANES - 2, 1100 + LANES + 6))


def test_quad_shuffle_edges_and_fill_with_modulo():
    """The quad_ shuffles keep or fill at the edges of each group of 4, as the simd_ ones do at
    the edges of the SIMD-group; fill variants with a modulo wrap within each group."""
    q = LANES % 4
    base = LANES - q
    np.testing.assert_array_equal(per_lane("quad_shuffle_up(v, 1)"),
                                  100 + np.where(q >= 1, LANES - 1, LANES))
    np.testing.assert_array_equal(per_lane("quad_shuffle_up(v, 3)"),
                                  100 + np.where(q >= 3, LANES - 3, LANES))
    np.testing.assert_array_equal(per_lane("quad_shuffle_down(v, 3)"),
                                  100 + np.where(q + 3 < 4, LANES + 3, LANES))
    np.testing.assert_array_equal(per_lane("quad_shuffle_rotate_up(v, 1)"),
                                  100 + base + (q - 1) % 4)
    np.testing.assert_array_equal(per_lane("quad_shuffle_rotate_down(v, 3)"),
                                  100 + base + (q + 3) % 4)
    np.testing.assert_array_equal(per_lane("quad_shuffle_and_fill_up(v, v + 1000.0f, 1)"),
                                  np.where(q >= 1, 100 + LANES - 1, 1100 + base + q + 3))
    np.testing.assert_array_equal(per_lane("quad_shuffle_and_fill_down(v, v + 1000.0f, 2)"),
                                  np.where(q + 2 < 4, 102 + LANES, 1100 + base + q - 2))
    np.testing.assert_array_equal(per_lane("quad_broadcast_first(v)"), 100 + base)
    g = LANES % 8
    down8 = per_lane("simd_shuffle_and_fill_down(v, v + 1000.0f, 2, 8)")
    np.testing.assert_array_equal(down8, np.where(g + 2 < 8, 102 + LANES, 1100 + LANES + 2 - 8))
    np.testing.assert_array_equal(per_lane("simd_shuffle_rotate_up(v, 0)"), 100 + LANES)
    np.testing.assert_array_equal(per_lane("simd_shuffle_rotate_down(v, 31)"),
                                  100 + (LANES + 31) % 32)


def test_shuffle_of_vectors_and_64_bit():
    got = per_lane("simd_shuffle_down(float2(v, -v), 1).y")
    np.testing.assert_array_equal(got, -(100 + np.where(LANES < 31, LANES + 1, LANES)))
    got = per_lane("float(simd_shuffle(ulong(i) << 40, 3) >> 40)")
    np.testing.assert_array_equal(got, 3)


def test_votes_and_first():
    got = per_lane("uint(ulong(simd_ballot(lane % 4 == 1)))", dtype=mx.uint32)
    np.testing.assert_array_equal(got, sum(1 << k for k in range(1, 32, 4)))
    np.testing.assert_array_equal(per_lane("simd_all(v > 99.0f) ? 1.0f : 0.0f"), 1)
    np.testing.assert_array_equal(per_lane("simd_all(v > 100.0f) ? 1.0f : 0.0f"), 0)
    np.testing.assert_array_equal(per_lane("simd_any(v == 131.0f) ? 1.0f : 0.0f"), 1)
    got = per_lane("lane < 5 ? -1.0f : (simd_is_first() ? 1.0f : 0.0f)")
    np.testing.assert_array_equal(got, np.where(LANES < 5, -1, LANES == 5))
    got = per_lane("lane >= 8 ? uint(ulong(simd_active_threads_mask())) : 7u", dtype=mx.uint32)
    np.testing.assert_array_equal(got, np.where(LANES >= 8, 0xFFFFFF00, 7))


def test_prefix_scans_over_active_lanes():
    v = 100.0 + LANES
    np.testing.assert_array_equal(per_lane("simd_prefix_inclusive_sum(v)"), np.cumsum(v))
    np.testing.assert_array_equal(per_lane("simd_prefix_exclusive_sum(v)"),
                                  np.cumsum(v) - v)
    got = per_lane("lane % 2 == 0 ? simd_prefix_exclusive_sum(1.0f) : -1.0f")
    np.testing.assert_array_equal(got, np.where(LANES % 2 == 0, LANES // 2, -1))
    got = per_lane("simd_prefix_inclusive_product(lane < 10 ? 2.0f : 1.0f)")
    np.testing.assert_array_equal(got, 2.0 ** np.minimum(LANES + 1, 10))


def test_quad_functions():
    q = LANES % 4
    np.testing.assert_array_equal(per_lane("quad_sum(v)"),
                                  (100 + LANES - q) * 4 + 6)
    np.testing.assert_array_equal(per_lane("quad_shuffle(v, 3)"), 100 + LANES - q + 3)
    np.testing.assert_array_equal(per_lane("quad_shuffle_down(v, 1)"),
                                  100 + np.where(q < 3, LANES + 1, LANES))
    np.testing.assert_array_equal(per_lane("quad_shuffle_xor(v, 2)"), 100 + (LANES ^ 2))
    np.testing.assert_array_equal(per_lane("quad_broadcast(v, 1)"), 100 + LANES - q + 1)
    got = per_lane("float(ushort(quad_ballot(lane % 2 == 0)))")
    np.testing.assert_array_equal(got, 0b0101)
    np.testing.assert_array_equal(per_lane("quad_prefix_exclusive_sum(1.0f)"), q)
    np.testing.assert_array_equal(per_lane("thread_index_in_quadgroup + 0.0f"), q)


def test_bitwise_reductions_of_integer_vectors_and_quads():
    got = per_lane("simd_or(uint2(1u << (i % 8), 1u << (i % 3))).y", dtype=mx.uint32)
    np.testing.assert_array_equal(got, 7)
    got = per_lane("quad_or(1u << (i % 4))", dtype=mx.uint32)
    np.testing.assert_array_equal(got, 15)
    got = per_lane("quad_and(int(i) | 64)", dtype=mx.int32)
    np.testing.assert_array_equal(got, (LANES - LANES % 4) | 64)
    got = per_lane("quad_xor(ushort(i))", dtype=mx.uint32)
    np.testing.assert_array_equal(got, np.bitwise_xor.reduce(LANES.reshape(8, 4), axis=1)
                                  .repeat(4))


@pytest.mark.parametrize("call,function", [
    ("simd_or(x)", "simd_or"),
    ("simd_and(x)", "simd_and"),
    ("simd_xor(half(x))", "simd_xor"),
    ("simd_or(float2(x, x)).x", "simd_or"),
    ("quad_or(x)", "quad_or"),
    ("quad_and(bfloat16_t(x))", "quad_and"),
    ("quad_xor(float4(x)).y", "quad_xor"),
    ("simd_and(x > 1.0f)", "simd_and"),
    ("simd_sum(x > 1.0f)", "simd_sum"),
    ("quad_prefix_exclusive_sum(x > 1.0f)", "quad_prefix_exclusive_sum"),
    ("simd_shuffle(x > 1.0f, 1)", "simd_shuffle"),
    ("quad_broadcast(x > 1.0f, 0)", "quad_broadcast"),
])
def test_operand_types_metal_refuses_do_not_compile(call, function):
    # bitwise reductions take integers only, and no SIMD-group function takes bool: Metal
    # rejects these calls, so the emulator must not run them (it used to return garbage)
    with pytest.raises(em.KernelCompileError) as info:
        run(f"float x = float(thread_position_in_grid.x);\nout[0] = float({call});",
            {"d": mx.zeros((1,))}, {"out": ((1,), mx.float32)}, (32, 1, 1), (32, 1, 1),
            name="refused")
    msg = str(info.value)
    assert msg.startswith("[refused] the kernel does not compile: body:2:"), msg
    assert f"no matching function for call to '{function}'" in msg.splitlines()[0], msg


def _tree_sum(values, rnd):
    """The documented simd_sum order: pairs (0,1), (2,3), ..., then (0,2), ..., each sum
    rounded to the lane type."""
    values = [rnd(x) for x in values]
    while len(values) > 1:
        values = [rnd(np.float32(values[i]) + np.float32(values[i + 1]))
                  for i in range(0, len(values), 2)]
    return float(values[0])


@pytest.mark.parametrize("msl,small,rnd", [
    ("half", 2.0**-12, lambda x: np.float32(np.float16(x))),
    ("bfloat16_t", 2.0**-9, lambda x: np.float32(bf16_round(np.float32(x)))),
], ids=["half", "bfloat16"])
def test_half_and_bfloat_simd_sum_round_in_their_type(msl, small, rnd):
    # lane 0 holds 1, the others a quarter of the type's spacing at 1: each partial sum that
    # meets lane 0's value rounds back, so the result depends on rounding at every step
    values = np.where(LANES == 0, 1.0, small)
    got = per_lane(f"float(simd_sum({msl}(x)))", setup=f"float x = lane == 0 ? 1.0f : {small!r}f;")
    want = _tree_sum(values, rnd)
    assert want != float(rnd(values.sum()))  # the oracle tells the two apart
    np.testing.assert_array_equal(got, want)


def test_inactive_source_lane_gives_poison_or_strict_hazard():
    expr = "lane < 16 ? simd_shuffle_down(v, 8) : -1.0f"
    got = per_lane(expr)
    np.testing.assert_array_equal(got[:8], 108 + LANES[:8])
    assert np.all(np.isnan(got[8:16]))  # lanes 16..23 did not take part
    previous = em.configure(strict=True)
    try:
        with pytest.raises(em.InvalidSimdLane, match="reads lane 16, which is not active"):
            per_lane(expr)
    finally:
        em.configure(**vars(previous))


def test_converged_helpers_on_a_full_group():
    """common.h's converged helpers: simd_sum's and simd_shuffle's results where every lane
    of the SIMD-group is active (their promise)."""
    v = 100.0 + LANES
    np.testing.assert_array_equal(per_lane("mt_sum_converged(v)"), per_lane("simd_sum(v)"))
    assert np.all(per_lane("mt_sum_converged(v)") == v.sum())
    assert np.all(per_lane("mt_max_converged(v)") == v.max())
    assert np.all(per_lane("mt_min_converged(uint(i) ^ 5u)", dtype=mx.uint32) == 0)
    np.testing.assert_array_equal(
        per_lane("mt_shuffle_converged(v, ushort((lane * 5 + 3) % 32))"), v[(LANES * 5 + 3) % 32])
    np.testing.assert_array_equal(per_lane("mt_shuffle_xor_converged(v, ushort(6))"),
                                  v[LANES ^ 6])


@pytest.mark.parametrize("expr, n, missing", [
    ("lane < 16 ? mt_sum_converged(v) : -1.0f", 32, 16),  # a divergent branch
    ("lane == 3 ? -1.0f : mt_shuffle_converged(v, ushort(0))", 32, 3),
    ("mt_shuffle_converged(v, ushort(0))", 16, 16),  # a partial SIMD-group
    ("lane >= 8 ? mt_max_converged(v) : 0.0f", 32, 0),
    ("lane != 7 ? mt_min_converged(v) : 0.0f", 32, 7),
    ("lane < 31 ? mt_shuffle_xor_converged(v, ushort(1)) : 0.0f", 32, 31),
], ids=("branch", "one_lane", "partial_group", "max", "min", "xor"))
def test_converged_helpers_refuse_a_missing_lane(expr, n, missing):
    """The converged promise is checked at every call: a missing lane is a hazard (where
    simd_sum / simd_shuffle would take the active lanes, CUDA's constant mask would not)."""
    with pytest.raises(em.InvalidSimdLane,
                       match=f"lane {missing} is not active at this call; the converged"):
        per_lane(expr, n=n)
    plain = expr.replace("mt_", "simd_").replace("simd_shuffle_converged", "simd_shuffle")
    per_lane(plain.replace("_converged", ""), n=n)  # the plain calls run


def test_fiber_order_permutation_exposes_order_dependence():
    # the last writer of a shared slot wins: depends on the order threads run in
    src = """
        threadgroup float slot[1];
        slot[0] = float(thread_position_in_threadgroup.x);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = slot[0];
    """
    results = set()
    previous = em.configure()
    try:
        for seed in (None, 1, 2, 3):
            em.configure(shuffle_seed=seed)
            (out,) = run(src, {"d": mx.zeros((1,))}, {"out": ((64,), mx.float32)}, (64, 1, 1),
                         (64, 1, 1))
            results.add(float(out[0]))
    finally:
        em.configure(**vars(previous))
    assert len(results) > 1
    # an order-independent kernel gives the same result under every permutation
    previous = em.configure()
    try:
        outs = []
        for seed in (None, 7, 8):
            em.configure(shuffle_seed=seed)
            outs.append(per_lane("simd_sum(v) + simd_shuffle_xor(v, 1)", n=64))
    finally:
        em.configure(**vars(previous))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_one_source_barrier_is_one_barrier_whatever_the_compiler_does():
    # Branches right before a barrier or a SIMD function let the compiler duplicate the call
    # into each path; threads on either path still meet at the same barrier / collective.
    (out,) = run("""
        threadgroup float shared[64];
        uint t = thread_index_in_threadgroup;
        float v = float(t);
        if (t % 3 == 0) { shared[t] = v * 2.0f; } else { shared[t] = v; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float s;
        if (t < 7) { v += 1.0f; } else { v -= 1.0f; }
        s = simd_sum(v);
        out[t] = s + shared[63 - t];
    """, {"d": mx.zeros((1,))}, {"out": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1))
    t = np.arange(64)
    shared = np.where(t % 3 == 0, 2.0 * t, t)
    v = np.where(t < 7, t + 1.0, t - 1.0)
    sums = np.repeat([v[:32].sum(), v[32:].sum()], 32)
    np.testing.assert_array_equal(out, sums + shared[63 - t])


EXTENSION_HEADER = """
#include <metal_stdlib>
// A collective defined outside the runtime, as extension headers do: a record on the lane's
// stack, a resolve function, mt_collective(). (No source position: lanes meet by code
// address.)
inline float ext_lane_sum(float x) {
  float out;
  mt_coll c;
  c.op = mt::OP_SUM;
  c.width = 32;
  c.arg = 0;
  c.in = &x;
  c.in2 = nullptr;
  c.in3 = nullptr;
  c.out = &out;
  c.resolve = &mt::resolve<float>;
  mt_collective(&c);
  return out;
}
"""


def test_extension_collective_without_source_position():
    (out,) = run("uint i = thread_position_in_grid.x;\nout[i] = ext_lane_sum(float(i));",
                 {"d": mx.zeros((1,))}, {"out": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1),
                 header=EXTENSION_HEADER)
    np.testing.assert_array_equal(out, np.repeat([np.arange(32).sum(), np.arange(32, 64).sum()],
                                                 32))
