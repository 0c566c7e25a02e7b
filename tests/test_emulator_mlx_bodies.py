"""Bodies written for MLX's metal_kernel run unchanged on the emulator: mixed argument kinds
(0-d scalars, small arrays in constant space, bfloat16), bool/int/dtype templates, header
helpers, strided inputs with and without ensure_row_contiguous, several outputs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import requires_emulator

from mlx_metaltile import emulator as em

pytestmark = requires_emulator


def test_mixed_arguments_and_templates(rng):
    a = mx.array(rng.standard_normal((3, 6)).astype(np.float32))
    c = mx.array(rng.standard_normal((2, 2)).astype(np.float32)).astype(mx.bfloat16)
    kernel = em.metal_kernel(name="args", input_names=["a", "b", "c", "d"],
                             output_names=["o1", "o2"], source="""
        uint elem = thread_position_in_grid.x;
        T unused = a[0];
        (void)unused;
        if (FLAG) {
            o1[elem] = a[1] + b[2] + c[3] + d + K;
        } else {
            o1[elem] = 1;
        }
        o2[elem] = a[1] + b[2] + c[1] - d;
    """)
    o1, o2 = kernel(inputs=[a, mx.array([3, 4, 5]), c, 7.25],
                    template=[("FLAG", True), ("K", 3), ("T", mx.float16)],
                    grid=(6, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(3, 2), (3, 2)],
                    output_dtypes=[mx.float32, mx.int32])
    af = np.array(a).ravel()
    cf = np.array(c.astype(mx.float32)).ravel()
    np.testing.assert_allclose(np.array(o1), np.full((3, 2), af[1] + 5 + cf[3] + 7.25 + 3),
                               rtol=1e-6)
    np.testing.assert_array_equal(np.array(o2), np.full((3, 2), int(af[1] + 5 + cf[1] - 7.25)))
    assert o2.dtype == mx.int32


@pytest.mark.parametrize("contiguous", [True, False])
def test_tiled_strided_input(rng, contiguous):
    a = mx.array(rng.standard_normal((3, 6)).astype(np.float32))
    a = mx.tile(a[::2], [4, 1])
    body = ("uint elem = thread_position_in_grid.x;\n"
            + ("T tmp = inp[elem];\n" if contiguous else
               "uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);\n"
               "T tmp = inp[loc];\n")
            + "out[elem] = metal::precise::exp(tmp) * threads_per_simdgroup;")
    kernel = em.metal_kernel(name=f"tiled{contiguous}", input_names=["inp"],
                             output_names=["out"], source=body,
                             ensure_row_contiguous=contiguous)
    (out,) = kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype])
    np.testing.assert_allclose(np.array(out), np.exp(np.array(a)) * 32, rtol=1e-6)


def test_template_helper_in_header(rng):
    a = mx.array(rng.standard_normal((2, 2)).astype(np.float32))
    kernel = em.metal_kernel(name="helper", input_names=["a"], output_names=["out"],
                             header="template <typename T>\nT twice_exp(T x) {\n"
                                    "  return T(2) * metal::precise::exp(x);\n}\n",
                             source="uint e = thread_position_in_grid.x;\n"
                                    "out[e] = twice_exp(a[e]);")
    (out,) = kernel(inputs=[a], grid=(4, 1, 1), threadgroup=(2, 1, 1),
                    output_shapes=[(2, 2)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out), 2 * np.exp(np.array(a)), rtol=1e-6)


def test_same_name_different_sources_are_different_kernels():
    outs = []
    for k in (1, 2):
        kernel = em.metal_kernel(name="same", input_names=["a"], output_names=["out"],
                                 source=f"out[thread_position_in_grid.x] = a[0] + {k}.0f;")
        outs.append(kernel(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                           output_shapes=[(1,)], output_dtypes=[mx.float32])[0].item())
    assert outs == [1.0, 2.0]


def test_one_kernel_object_many_dtypes_and_shapes():
    kernel = em.metal_kernel(name="poly", input_names=["x"], output_names=["y"],
                             source="uint i = thread_position_in_grid.x;\n"
                                    "y[i] = x[i] * x[i];")
    for dtype in (mx.float32, mx.float16, mx.bfloat16, mx.int32):
        for n in (1, 7, 8, 100):
            x = mx.arange(n).astype(dtype)
            (y,) = kernel(inputs=[x], grid=(n, 1, 1), threadgroup=(32, 1, 1),
                          output_shapes=[(n,)], output_dtypes=[dtype])
            assert y.dtype == dtype
            np.testing.assert_array_equal(np.array(y.astype(mx.float32)),
                                          np.array((x * x).astype(mx.float32)))
