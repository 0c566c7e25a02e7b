"""simdgroup_matrix<T, 8, 8> against NumPy: Apple's lane layout, loads and stores with stride,
origin and transpose, multiply-accumulate in float / half / bfloat16."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import bf16_round, requires_emulator, run

from mlx_metaltile import emulator as em

pytestmark = requires_emulator


def test_thread_elements_follow_apples_layout():
    (out,) = run("""
        uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 m;
        simdgroup_load(m, inp, 8);
        out[lane * 2 + 0] = m.thread_elements()[0];
        out[lane * 2 + 1] = m.thread_elements()[1];
    """, {"inp": np.arange(64, dtype=np.float32)}, {"out": ((64,), mx.float32)}, (32, 1, 1),
        (32, 1, 1))
    lanes = np.arange(32)
    q = lanes // 4
    row = (q & 4) + (lanes // 2) % 4
    col = (q & 2) * 2 + (lanes % 2) * 2
    np.testing.assert_array_equal(out[0::2], row * 8 + col)
    np.testing.assert_array_equal(out[1::2], row * 8 + col + 1)


MMA = """
    simdgroup_matrix<T, 8, 8> a, b;
    simdgroup_matrix<U, 8, 8> c;
    simdgroup_load(a, A, LDA, ulong2(AX, AY), TA);
    simdgroup_load(b, B, LDB, ulong2(BX, BY), TB);
    simdgroup_load(c, C, 8);
    simdgroup_multiply_accumulate(c, a, b, c);
    simdgroup_store(c, out, 8);
"""


@pytest.mark.parametrize("dtype,acc", [(mx.float32, mx.float32), (mx.float16, mx.float32),
                                       (mx.float16, mx.float16), (mx.bfloat16, mx.float32)],
                         ids=["f32", "f16_acc32", "f16", "bf16_acc32"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
def test_multiply_accumulate_with_transposed_loads(rng, dtype, acc, ta, tb):
    # A and B are 8x8 blocks at an origin inside larger row-major buffers
    big_a = rng.standard_normal((12, 16)).astype(np.float32)
    big_b = rng.standard_normal((10, 11)).astype(np.float32)
    c0 = rng.standard_normal((8, 8)).astype(np.float32)
    ax, ay, bx, by = 5, 3, 2, 1
    a_mx = mx.array(big_a).astype(dtype)
    b_mx = mx.array(big_b).astype(dtype)
    c_mx = mx.array(c0).astype(acc)
    (out,) = run(MMA, {"A": a_mx, "B": b_mx, "C": c_mx}, {"out": ((8, 8), acc)},
                 (32, 1, 1), (32, 1, 1),
                 template=[("T", dtype), ("U", acc), ("LDA", 16), ("LDB", 11), ("AX", ax),
                           ("AY", ay), ("BX", bx), ("BY", by), ("TA", ta), ("TB", tb)])
    a64 = np.array(a_mx.astype(mx.float32), dtype=np.float64)[ay:ay + 8, ax:ax + 8]
    b64 = np.array(b_mx.astype(mx.float32), dtype=np.float64)[by:by + 8, bx:bx + 8]
    c64 = np.array(c_mx.astype(mx.float32), dtype=np.float64)
    want = (a64.T if ta else a64) @ (b64.T if tb else b64) + c64
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-5}[acc]
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


def test_store_with_origin_and_transpose_and_diagonal_constructor():
    (out,) = run("""
        simdgroup_float8x8 eye = simdgroup_float8x8(2.0f);
        simdgroup_float8x8 m;
        simdgroup_load(m, inp, 8);
        simdgroup_float8x8 r;
        simdgroup_multiply(r, m, eye);
        simdgroup_store(r, out, 16, ulong2(8, 1), true);
    """, {"inp": np.arange(64, dtype=np.float32)}, {"out": ((10, 16), mx.float32)},
        (32, 1, 1), (32, 1, 1), init_value=-1.0)
    want = np.full((10, 16), -1.0)
    want[1:9, 8:16] = (2 * np.arange(64).reshape(8, 8)).T
    np.testing.assert_array_equal(out, want)


def test_filled_matrix_and_threadgroup_source():
    (out,) = run("""
        threadgroup half tile[8 * 8];
        for (uint k = thread_index_in_simdgroup; k < 64; k += 32) tile[k] = half(inp[k]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_half8x8 a;
        simdgroup_load(a, &tile[0], 8);
        simdgroup_float8x8 ones = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
        simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.5f);
        simdgroup_multiply_accumulate(acc, a, ones, acc);
        simdgroup_store(acc, out, 8);
    """, {"inp": np.arange(64, dtype=np.float32) / 8}, {"out": ((8, 8), mx.float32)},
        (32, 1, 1), (32, 1, 1))
    a = (np.arange(64) / 8).reshape(8, 8)
    np.testing.assert_allclose(out, a.sum(1, keepdims=True) + 0.5 + np.zeros((8, 8)), rtol=1e-6)


def test_bfloat_result_rounds_once():
    a = np.full((8, 8), 1.0 + 2.0**-7, dtype=np.float32)
    (out,) = run("""
        simdgroup_bfloat8x8 a, b, c;
        simdgroup_load(a, A, 8);
        b = simdgroup_bfloat8x8(1.0f);
        simdgroup_multiply(c, a, b);
        simdgroup_store(c, out, 8);
    """, {"A": mx.array(a).astype(mx.bfloat16)}, {"out": ((8, 8), mx.bfloat16)}, (32, 1, 1),
        (32, 1, 1))
    np.testing.assert_array_equal(out, bf16_round(a))


@pytest.mark.parametrize("element", ["int", "uint", "short", "bool"])
def test_matrices_of_other_element_types_do_not_compile(element):
    # Metal's simdgroup_matrix holds half, bfloat or float only
    with pytest.raises(em.KernelCompileError) as info:
        run(f"simdgroup_matrix<{element}, 8, 8> m(1);\nout[0] = float(m.thread_elements()[0]);",
            {"d": mx.zeros((1,))}, {"out": ((1,), mx.float32)}, (32, 1, 1), (32, 1, 1),
            name="refused")
    first = str(info.value).splitlines()[0]
    assert first.startswith("[refused] the kernel does not compile: body:1:"), first
    assert "half, bfloat or float" in first
