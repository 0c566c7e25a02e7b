"""Barriers and SIMD-group functions inside helper functions: lanes meet at one call only when
they reach it through the same chain of calls. A helper called from two branches gives each
branch its own collective (over its active lanes), as on a GPU; one call of the source that
the compiler copied stays one meeting point. Checked against NumPy."""

from __future__ import annotations

import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import requires_emulator, run

from mlx_metaltile import emulator as em
from mlx_metaltile.emulator import _dwarf

pytestmark = requires_emulator
LANES = np.arange(32)
N = 64  # two SIMD-groups
T = np.arange(N)
X = 1.0 + T  # x of thread t
Y = 1000.0 + 10.0 * T  # y of thread t
SETUP = """
    uint t = thread_position_in_grid.x;
    ushort lane = thread_index_in_simdgroup;
    float x = 1.0f + float(t);
    float y = 1000.0f + 10.0f * float(t);
"""


def body(code: str, header: str, dtype=mx.float32, n: int = N, tg: int = N):
    (out,) = run(SETUP + code, {"d": mx.zeros((1,))}, {"out": ((n,), dtype)}, (n, 1, 1),
                 (tg, 1, 1), header=header)
    return out


def per_group(values: np.ndarray, member: np.ndarray, fn) -> np.ndarray:
    """fn over the members of each SIMD-group, broadcast to those members."""
    out = np.full(len(values), np.nan)
    for g in range(0, len(values), 32):
        m = np.zeros(len(values), bool)
        m[g:g + 32] = member[g:g + 32]
        if m.any():
            out[m] = fn(values[m])
    return out


def prefix_exclusive(values: np.ndarray, member: np.ndarray) -> np.ndarray:
    out = np.full(len(values), np.nan)
    for g in range(0, len(values), 32):
        acc = 0.0
        for t in range(g, min(g + 32, len(values))):
            if member[t]:
                out[t] = acc
                acc += values[t]
    return out


INLINE = "inline"
OUT_OF_LINE = "__attribute__((noinline))"  # a physical frame between the body and the call
KINDS = pytest.mark.parametrize("kind", [INLINE, OUT_OF_LINE], ids=["inlined", "out_of_line"])


@KINDS
def test_simd_sum_in_a_helper_called_from_two_branches(kind):
    header = f"{kind} float red(float v) {{ return simd_sum(v); }}\n"
    got = body("out[t] = lane < 16 ? red(x) : red(y);", header)
    low = LANES[T % 32] < 16
    want = np.where(low, per_group(X, low, np.sum), per_group(Y, ~low, np.sum))
    np.testing.assert_array_equal(got, want)
    # the example of the README: 120 and 37600 on a single SIMD-group of 0..31 / 100 * i
    got = body("float a; if (lane < 16) a = red(float(t)); else a = red(100.0f * float(t));\n"
               "out[t] = a;", header, n=32, tg=32)
    np.testing.assert_array_equal(got, np.where(LANES < 16, 120.0, 37600.0))


@KINDS
def test_shuffles_in_a_helper_read_only_their_branch(kind):
    header = (f"{kind} float down1(float v) {{ return simd_shuffle_down(v, 1); }}\n"
              f"{kind} float across(float v) {{ return simd_shuffle(v, ushort(lane_of() ^ 16)); }}\n")
    header = "inline ushort lane_of() { return ushort(mt_lane()); }\n" + header
    got = body("out[t] = lane < 16 ? down1(x) : down1(y);", header)
    lane = T % 32
    want = np.where(lane < 16, X[np.minimum(T + 1, N - 1)], Y[np.minimum(T + 1, N - 1)])
    want = np.where(lane == 31, Y, want)  # no lane above: keeps its own value
    want = np.where(lane == 15, np.nan, want)  # lane 16 runs the other branch: not active
    np.testing.assert_array_equal(got, want)
    # every lane reads a lane of the other branch: inactive, so poison (NaN)
    got = body("out[t] = lane < 16 ? across(x) : across(y);", header)
    assert np.isnan(got).all()
    previous = em.configure(strict=True)
    try:
        with pytest.raises(em.InvalidSimdLane, match="not active"):
            body("out[t] = lane < 16 ? across(x) : across(y);", header)
    finally:
        em.configure(**vars(previous))


@KINDS
def test_prefix_sum_and_ballot_in_helpers_called_from_two_branches(kind):
    header = (f"{kind} float scan(float v) {{ return simd_prefix_exclusive_sum(v); }}\n"
              f"{kind} uint vote(bool b) {{ return uint(ulong(simd_ballot(b))); }}\n")
    got = body("out[t] = lane % 3 == 0 ? scan(x) : scan(y);", header)
    a = (T % 32) % 3 == 0
    want = np.where(a, prefix_exclusive(X, a), prefix_exclusive(Y, ~a))
    np.testing.assert_array_equal(got, want)
    got = body("out[t] = lane < 10 ? vote(lane % 2 == 0) : vote(true);", header,
               dtype=mx.uint32)
    evens_below_10 = sum(1 << k for k in range(0, 10, 2))
    np.testing.assert_array_equal(got, np.where(T % 32 < 10, evens_below_10, 0xFFFFFC00))


@KINDS
def test_nested_helpers(kind):
    header = (f"{kind} float inner(float v) {{ return simd_sum(v); }}\n"
              f"{kind} float outer(float v, ushort lane) {{\n"
              "  return lane % 2 == 0 ? inner(v) : inner(-v);\n}\n")
    got = body("out[t] = lane < 16 ? outer(x, lane) : outer(y, lane);", header)
    lane = T % 32
    want = np.empty(N)
    for low in (True, False):
        for even in (True, False):
            m = ((lane < 16) == low) & ((lane % 2 == 0) == even)
            v = (X if low else Y) * (1 if even else -1)
            want[m] = per_group(v, m, np.sum)[m]
    np.testing.assert_array_equal(got, want)


@KINDS
def test_one_call_of_a_helper_in_a_loop_and_by_every_lane(kind):
    header = f"{kind} float red(float v) {{ return simd_sum(v); }}\n"
    got = body("float acc = x;\n"
               "for (int k = 0; k < 4; ++k) acc = red(acc * 0.5f + float(k)) / 32.0f + x;\n"
               "out[t] = acc;", header)
    acc = X.copy()
    for k in range(4):
        s = per_group(acc * 0.5 + k, np.ones(N, bool), np.sum)
        acc = s / 32.0 + X
    np.testing.assert_allclose(got, acc, rtol=1e-6)
    # every lane through the same path: one collective, no need for the debug information
    stats = em.last_launch_stats()
    assert stats.simd_collectives == 2 * 4 and not stats.call_sites_from_debug_info
    # a helper called at two places one after the other, by every lane
    got = body("out[t] = red(x) + 2.0f * red(y);", header)
    np.testing.assert_array_equal(got, per_group(X, T >= 0, np.sum)
                                  + 2 * per_group(Y, T >= 0, np.sum))


@KINDS
def test_a_helper_after_a_block_some_lanes_took_includes_every_lane(kind):
    """The lanes that skipped the block wait after it, at the helper's next call, for the
    lanes in the block (a GPU reconverges there), whichever lanes took it."""
    header = (f"{kind} float red(float v) {{ return simd_sum(v); }}\n"
              f"{kind} float twice(float v, ushort lane) {{\n"
              "  float a = 0.0f;\n  if (lane >= 27) a = red(v);\n  return a + red(v);\n}\n")
    got = body("float a = 0.0f;\nif (lane < 5) a = red(y);\nout[t] = a + red(x);", header)
    low = T % 32 < 5
    np.testing.assert_array_equal(got, np.where(low, per_group(Y, low, np.sum), 0.0)
                                  + per_group(X, T >= 0, np.sum))
    # two waits at one line of a helper, through different calls: ordered by the module's
    # debug information
    assert em.last_launch_stats().call_sites_from_debug_info
    got = body("out[t] = twice(x, lane);", header)
    high = T % 32 >= 27
    np.testing.assert_array_equal(got, np.where(high, per_group(X, high, np.sum), 0.0)
                                  + per_group(X, T >= 0, np.sum))


# The optimisation options make the compiler copy the simd_sum call into both branches of the
# first `if` (to thread the second one): two machine copies of one call of the source.
COPIED_HEADER = """
__attribute__((optimize("O3", "tracer"))) float twice(float v, uint lane) {
  if (lane < 7) v += 1.0f; else v -= 1.0f;
  float s = simd_sum(v);
  if (lane < 7) s *= 2.0f; else s += 3.0f;
  return s;
}
"""


def test_one_call_copied_by_the_compiler_is_one_collective():
    got = body("out[t] = twice(x, lane);", COPIED_HEADER)
    lane = T % 32
    v = np.where(lane < 7, X + 1, X - 1)
    s = per_group(v, T >= 0, np.sum)
    np.testing.assert_array_equal(got, np.where(lane < 7, 2 * s, s + 3))
    assert em.last_launch_stats().call_sites_from_debug_info


def test_one_barrier_copied_by_the_compiler_is_one_barrier():
    header = """
__attribute__((optimize("O3", "tracer"))) float rotate(threadgroup float* s, float v, uint t) {
  if (t < 7) v += 1.0f; else v -= 1.0f;
  s[t] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r = s[(t + 1) % 64];
  if (t < 7) r *= 2.0f; else r += 3.0f;
  return r;
}
"""
    got = body("threadgroup float s[64];\nout[t] = rotate(s, x, t);", header)
    v = np.where(T < 7, X + 1, X - 1)
    r = v[(T + 1) % 64]
    np.testing.assert_array_equal(got, np.where(T < 7, 2 * r, r + 3))
    stats = em.last_launch_stats()
    assert stats.threadgroup_barriers == 1 and stats.call_sites_from_debug_info


def _module(source: str, header: str):
    kernel = em.metal_kernel(name="inspected", input_names=["d"], output_names=["out"],
                             source=SETUP + source, header=header)
    kernel(inputs=[mx.zeros((1,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
           output_shapes=[(32,)], output_dtypes=[mx.float32])
    (mod,) = kernel._modules.values()
    return mod.path


def _return_addresses_of_calls_to(path, symbol: str) -> list[int]:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)],
                         capture_output=True, text=True).stdout.splitlines()
    return [int(out[k + 1].split(":")[0], 16) for k, line in enumerate(out)
            if f"<{symbol}@plt>" in line and re.search(r"\s(call|bl)\s", line)]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_call_site_identities_of_copies_and_of_different_calls():
    # what makes the test above meaningful: its module holds two machine calls of the
    # runtime's collective entry point, whose return addresses share one identity ...
    path = _module("out[t] = twice(x, lane);", COPIED_HEADER)
    calls = _return_addresses_of_calls_to(path, "mt_collective")
    table = _dwarf.call_site_table(path)
    assert len(calls) == 2
    assert len({_dwarf.identity_at(table, ra - 1) for ra in calls}) == 1
    # ... while two calls of one inlined helper have two
    path = _module("out[t] = lane < 16 ? red(x) : red(y);",
                   "inline float red(float v) { return simd_sum(v); }\n")
    calls = _return_addresses_of_calls_to(path, "mt_collective")
    table = _dwarf.call_site_table(path)
    assert len(calls) == 2
    ids = {_dwarf.identity_at(table, ra - 1) for ra in calls}
    assert len(ids) == 2 and _dwarf.UNKNOWN not in ids


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_call_site_identities_follow_the_source_order():
    # two calls of one inlined helper: the one written first has the smaller identity
    path = _module("float a = red(x);\nout[t] = a * red(y);",
                   "inline float red(float v) { return simd_sum(v); }\n")
    table, lines = _dwarf.call_site_table(path), _dwarf.line_table(path)
    calls = _return_addresses_of_calls_to(path, "mt_collective")
    assert len(calls) == 2
    by_line = sorted((_dwarf.source_frames(lines, ra - 1)[-1], _dwarf.identity_at(table, ra - 1))
                     for ra in calls)
    (first, a), (second, b) = by_line
    assert first == ("body.metal", 6) and second == ("body.metal", 7)  # after SETUP's 5 lines
    assert a < b


def test_barrier_in_a_helper_called_from_two_branches_is_divergence():
    header = "inline void sync() { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
    with pytest.raises(em.BarrierDivergence, match="can never all meet") as info:
        body("if (t < 32) sync();\nelse sync();\nout[t] = x;", header)
    msg = str(info.value)  # SETUP is 5 lines: the calls are on body lines 6 and 7
    assert "Threads 0-31 wait at threadgroup_barrier (header line 1, called from body line 6)" \
        in msg, msg
    assert "Threads 32-63 wait at threadgroup_barrier (header line 1, called from body line 7)" \
        in msg, msg
    # called by every thread, twice in a row: two barriers
    got = body("""
        threadgroup float s[64];
        s[t] = x;
        sync();
        float a = s[63 - t];
        sync();
        s[t] = 2.0f * a;
        sync();
        out[t] = s[(t + 1) % 64];
    """, header)
    np.testing.assert_array_equal(got, 2 * X[63 - (T + 1) % 64])
    assert em.last_launch_stats().threadgroup_barriers == 3


def test_without_debug_information_different_paths_are_an_error(monkeypatch):
    # never a guess: a module whose call sites cannot be identified stops with an error
    monkeypatch.setattr(_dwarf, "call_site_table", lambda path: None)
    header = "inline float red2(float v) { return simd_sum(v); }\n"
    with pytest.raises(em.EmulatorError, match="debug information"):
        body("out[t] = lane < 16 ? red2(x) : red2(y);", header)
