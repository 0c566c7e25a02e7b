"""The emulator's MetalPerformancePrimitives subset against NumPy, on its own: matmul2d in the
direct-input form (tensor views over threadgroup memory, cooperative destination), with
cooperative inputs and destination, on device tensors with edges, and its hazards."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import requires_emulator, run, to_numpy
from tolerances import assert_close

from mlx_metaltile import emulator as em

pytestmark = requires_emulator

HEADER = """
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace mpp::tensor_ops;
"""

# Left [M][K] (or [K][M] transposed), right [K][N] (or [N][K]) staged in threadgroup memory;
# the destination is a cooperative tensor loaded from C, stored through its indices.
DIRECT = """
constexpr int LR = TL ? K : M, LC = TL ? M : K, RR = TR ? N : K, RC = TR ? K : N;
threadgroup T a_tg[LR * LC];
threadgroup U b_tg[RR * RC];
const uint lane = thread_index_in_simdgroup;
for (uint i = lane; i < uint(LR * LC); i += 32) a_tg[i] = A[i];
for (uint i = lane; i < uint(RR * RC); i += 32) b_tg[i] = B[i];
threadgroup_barrier(mem_flags::mem_threadgroup);
constexpr auto desc = matmul2d_descriptor(M, N, K, TL, TR, false,
    ACC ? matmul2d_descriptor::mode::multiply_accumulate : matmul2d_descriptor::mode::multiply);
matmul2d<desc, execution_simdgroup> op;
auto ta = tensor<threadgroup T, dextents<int32_t, 2>, tensor_inline>(
    a_tg, dextents<int32_t, 2>(LC, LR));
auto tb = tensor<threadgroup U, dextents<int32_t, 2>, tensor_inline>(
    b_tg, dextents<int32_t, 2>(RC, RR));
auto ct = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), V>();
ct.load(tensor(C, dextents<int32_t, 2>(N, M)));
op.run(ta, tb, ct);
for (uint16_t i = 0; i < ct.get_capacity(); ++i) {
  if (ct.is_valid_element(i)) {
    auto idx = ct.get_multidimensional_index(i);
    out[idx[1] * N + idx[0]] = ct[i];
  }
}
"""


def _values(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _oracle(a, b, c, ta, tb, acc):
    """(A @ B (+ C), magnitude) in float64; magnitude = |A| @ |B| (+ |C|), the sum of |terms|
    behind each output that bounds the float32 accumulation error (tests/tolerances.py)."""
    a64, b64, c64 = to_numpy(a), to_numpy(b), to_numpy(c)
    a64, b64 = (a64.T if ta else a64), (b64.T if tb else b64)
    prod, mag = a64 @ b64, np.abs(a64) @ np.abs(b64)
    return (prod + c64, mag + np.abs(c64)) if acc else (prod, mag)


@pytest.mark.parametrize("mnk", [(8, 32, 16), (16, 16, 32), (16, 32, 16)], ids=str)
@pytest.mark.parametrize("tl,tr", [(False, True), (False, False), (True, False), (True, True)],
                         ids=["nt", "nn", "tn", "tt"])
@pytest.mark.parametrize("types", [(mx.float16, mx.float16, mx.float32),
                                   (mx.bfloat16, mx.bfloat16, mx.float32),
                                   (mx.float32, mx.float32, mx.float32),
                                   (mx.bfloat16, mx.float16, mx.float32),
                                   (mx.float16, mx.float16, mx.float16)],
                         ids=["h.h.f", "b.b.f", "f.f.f", "b.h.f", "h.h.h"])
def test_direct_inputs_cooperative_destination(rng, mnk, tl, tr, types):
    M, N, K = mnk
    T, U, V = types
    a = _values(rng, (K, M) if tl else (M, K), T)
    b = _values(rng, (N, K) if tr else (K, N), U)
    c = _values(rng, (M, N), V)
    (out,) = run(DIRECT, {"A": a, "B": b, "C": c}, {"out": ((M, N), V)}, (32, 1, 1),
                 (32, 1, 1), header=HEADER, init_value=float("nan"),
                 template=[("T", T), ("U", U), ("V", V), ("M", M), ("N", N), ("K", K),
                           ("TL", tl), ("TR", tr), ("ACC", True)])
    want, magnitude = _oracle(a, b, c, tl, tr, True)
    assert_close(out, want, V, magnitude, what="matmul2d")


def test_multiply_mode_ignores_the_destination(rng):
    M, N, K = 8, 32, 16
    a, b = _values(rng, (M, K), mx.float16), _values(rng, (N, K), mx.float16)
    c = mx.full((M, N), 1e4, dtype=mx.float32)
    (out,) = run(DIRECT, {"A": a, "B": b, "C": c}, {"out": ((M, N), mx.float32)}, (32, 1, 1),
                 (32, 1, 1), header=HEADER,
                 template=[("T", mx.float16), ("U", mx.float16), ("V", mx.float32), ("M", M),
                           ("N", N), ("K", K), ("TL", False), ("TR", True), ("ACC", False)])
    # Tighter than the table's float32 row: half products are exact in float32, and this
    # checks that the destination's 1e4 is not added.
    np.testing.assert_allclose(out, _oracle(a, b, c, False, True, False)[0], rtol=1e-6,
                               atol=1e-5)


def test_half_destination_is_rounded_once(rng):
    """Sum in float, one rounding to half: a sum whose float partials are not halves."""
    M, N, K = 8, 32, 16
    a = mx.full((M, K), 1.0, dtype=mx.float16)
    col = np.array([2048.0] + [0.5] * 15, dtype=np.float32)  # 2048 + 15 * 0.5 = 2055.5
    b = mx.array(np.tile(col, (N, 1))).astype(mx.float16)  # [N][K]
    c = mx.zeros((M, N), dtype=mx.float16)
    (out,) = run(DIRECT, {"A": a, "B": b, "C": c}, {"out": ((M, N), mx.float16)}, (32, 1, 1),
                 (32, 1, 1), header=HEADER,
                 template=[("T", mx.float16), ("U", mx.float16), ("V", mx.float16), ("M", M),
                           ("N", N), ("K", K), ("TL", False), ("TR", True), ("ACC", True)])
    # 2055.5 rounds to 2056 in half; adding 0.5 in half 15 times would stay at 2048.
    np.testing.assert_array_equal(out, np.full((M, N), 2056.0))


COOP = """
constexpr auto desc = matmul2d_descriptor(M, N, K, TL, TR, false,
    matmul2d_descriptor::mode::multiply_accumulate);
matmul2d<desc, execution_simdgroup> op;
auto ca = op.template get_left_input_cooperative_tensor<T, T, float>();
auto cb = op.template get_right_input_cooperative_tensor<T, T, float>();
auto cd = op.template get_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
constexpr int LC = TL ? M : K, RC = TR ? K : N;
for (uint16_t i = 0; i < ca.get_capacity(); ++i) {
  if (ca.is_valid_element(i)) {
    auto c = ca.get_multidimensional_index(i);
    ca[i] = A[c[1] * LC + c[0]];
  }
}
for (uint16_t i = 0; i < cb.get_capacity(); ++i) {
  if (cb.is_valid_element(i)) {
    auto c = cb.get_multidimensional_index(i);
    cb[i] = B[c[1] * RC + c[0]];
  }
}
for (uint16_t i = 0; i < cd.get_capacity(); ++i) {
  cd[i] = 0.0f;
}
op.run(ca, cb, cd);
op.run(ca, cb, cd);  // accumulates: 2 * A @ B
cd.store(tensor(out, dextents<int32_t, 2>(N, M)));
"""


@pytest.mark.parametrize("tl,tr", [(False, False), (False, True), (True, False)],
                         ids=["nn", "nt", "tn"])
@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("half", "bfloat"))
def test_cooperative_inputs_and_destination(rng, tl, tr, dtype):
    """The (16, 16, 32) form: every operand a cooperative tensor filled through its indices."""
    M, N, K = 16, 16, 32
    a = _values(rng, (K, M) if tl else (M, K), dtype)
    b = _values(rng, (N, K) if tr else (K, N), dtype)
    (out,) = run(COOP, {"A": a, "B": b}, {"out": ((M, N), mx.float32)}, (32, 1, 1), (32, 1, 1),
                 header=HEADER, init_value=float("nan"),
                 template=[("T", dtype), ("M", M), ("N", N), ("K", K), ("TL", tl), ("TR", tr)])
    want, magnitude = _oracle(a, b, mx.zeros((M, N)), tl, tr, False)
    assert_close(out, 2 * want, mx.float32, 2 * magnitude, what="matmul2d cooperative")


def test_cooperative_layout_covers_each_element_once():
    """Each valid (lane, i) names a distinct element; together they cover the tile. The
    emulator's layout is its own (Apple's is implementation-defined)."""
    (owner, count) = run("""
        constexpr auto desc = matmul2d_descriptor(8, 12, 16);
        matmul2d<desc, execution_simdgroup> op;
        auto cd = op.template get_destination_cooperative_tensor<float, float, float>();
        const uint lane = thread_index_in_simdgroup;
        uint n = 0;
        for (uint16_t i = 0; i < cd.get_capacity(); ++i) {
          if (cd.is_valid_element(i)) {
            auto c = cd.get_multidimensional_index(i);
            out[c[1] * 12 + c[0]] = float(lane * 100 + i);
            n++;
          }
        }
        cap[lane] = float(n);
    """, {}, {"out": ((8, 12), mx.float32), "cap": ((32,), mx.float32)}, (32, 1, 1), (32, 1, 1),
        header=HEADER, init_value=-1.0)
    assert (owner >= 0).all()
    assert len(set(owner.ravel().tolist())) == 96
    assert count.sum() == 96 and count.max() == 3


DEVICE = """
constexpr auto desc = matmul2d_descriptor(16, 32, 16, false, true, false,
    ACC ? matmul2d_descriptor::mode::multiply_accumulate : matmul2d_descriptor::mode::multiply);
matmul2d<desc, execution_simdgroup> op;
auto ta = tensor(A, dextents<int32_t, 2>(16, ROWS));     // [ROWS][16], ROWS <= 16
auto tb = tensor(B, dextents<int32_t, 2>(16, 32));       // [32][16]
auto tc = tensor(out, dextents<int32_t, 2>(32, ROWS), array<int32_t, 2>({1, 40}));
op.run(ta, tb, tc);
"""


@pytest.mark.parametrize("acc", (False, True), ids=("multiply", "accumulate"))
def test_device_tensors_with_edges(rng, acc):
    """Rows past the left tensor's extent read as 0 and are not written; a strided
    destination keeps its padding columns; bytes read are counted per buffer."""
    rows = 11
    a = _values(rng, (rows, 16), mx.float32)
    b = _values(rng, (32, 16), mx.float32)
    (out,) = run(DEVICE, {"A": a, "B": b}, {"out": ((rows, 40), mx.float32)}, (32, 1, 1),
                 (32, 1, 1), header=HEADER, init_value=3.0,
                 template=[("ROWS", rows), ("ACC", acc)])
    want = np.full((rows, 40), 3.0)
    want[:, :32] = _oracle(a, b, mx.zeros(1), False, True, False)[0] + (3.0 if acc else 0.0)
    # Its own bound, tighter than the table's float32 row for these sums (K = 16 products
    # of N(0, 1)): it checks the edges, the strided destination and the accumulation.
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    stats = em.last_launch_stats()
    assert stats.bytes_read["A"] == rows * 16 * 4 and stats.bytes_read["B"] == 32 * 16 * 4
    assert stats.bytes_written["out"] == rows * 32 * 4
    assert stats.bytes_read["out"] == (rows * 32 * 4 if acc else 0)


# ---- hazards and refusals -------------------------------------------------------------

def _hazard(body: str, exc, match: str, inputs=None):
    with pytest.raises(exc, match=match):
        run(body, inputs or {"A": np.zeros(16 * 16, np.float32)},
            {"out": ((16, 32), mx.float32)}, (32, 1, 1), (32, 1, 1), header=HEADER)


RUN_PREFIX = """
constexpr auto desc = matmul2d_descriptor(16, 32, 16, false, true);
matmul2d<desc, execution_simdgroup> op;
auto ta = tensor(A, dextents<int32_t, 2>(16, 16));
auto tc = tensor(out, dextents<int32_t, 2>(32, 16));
"""


def test_every_lane_must_run():
    _hazard(RUN_PREFIX + """
        auto tb = tensor(A, dextents<int32_t, 2>(16, 16));
        if (thread_index_in_simdgroup == 7) return;
        op.run(ta, tb, tc);
    """, em.SimdgroupMatrixHazard, "lane 7 does not call run")


def test_operands_must_be_uniform():
    _hazard(RUN_PREFIX + """
        auto tb = tensor(A + (thread_index_in_simdgroup == 3 ? 16 : 0),
                         dextents<int32_t, 2>(16, 15));
        op.run(ta, tb, tc);
    """, em.SimdgroupMatrixHazard, "right tensor differs between lane 0 and lane 3")


def test_cooperative_index_past_capacity():
    _hazard(RUN_PREFIX + """
        auto cd = op.template get_destination_cooperative_tensor<decltype(ta), decltype(ta), float>();
        cd[cd.get_capacity()] = 1.0f;
    """, em.SimdgroupMatrixHazard, "not below get_capacity")


def test_static_slice_past_the_tensor():
    _hazard("""
        auto t = tensor(A, dextents<int32_t, 2>(16, 16));
        auto s = t.slice<16, 16>(0, 8);
        out[0] = float(s.get_extent(1));
    """, em.OutOfBoundsAccess, "static extent is larger")


def test_unsupported_type_combination_does_not_compile():
    _hazard(RUN_PREFIX + """
        auto tb = tensor(A, dextents<int32_t, 2>(16, 32));
        auto cd = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), half>();
        auto tf = tensor(A, dextents<int32_t, 2>(16, 16));
        op.run(tf, tb, cd);  // float x float -> half is not in Apple's table
    """, em.KernelCompileError, "element-type combination")


def test_out_of_bounds_tensor_read_is_caught():
    _hazard(RUN_PREFIX + """
        auto tb = tensor(A, dextents<int32_t, 2>(16, 32));  // 512 elements over a 256 buffer
        op.run(ta, tb, tc);
    """, em.OutOfBoundsAccess, "out-of-bounds read")


def test_version_gate_sees_metal4():
    """A kernel that includes the Metal 4 headers is compiled as MSL 4.0."""
    (out,) = run("out[0] = float(__METAL_VERSION__);", {}, {"out": ((1,), mx.float32)},
                 (32, 1, 1), (32, 1, 1), header=HEADER)
    assert out[0] == 400
    (out,) = run("out[0] = float(__METAL_VERSION__);", {}, {"out": ((1,), mx.float32)},
                 (32, 1, 1), (32, 1, 1))
    assert out[0] < 400
