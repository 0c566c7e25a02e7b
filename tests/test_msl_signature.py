"""The kernel source MLX's metal_kernel generates, reproduced by mlx_metaltile._msl.signature
(shared by the emulator and the CUDA layer)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_metaltile._msl.signature import (
    METAL_ATTRIBUTES,
    InputInfo,
    generate,
    kernel_name,
    type_string,
)

EXP = """
        uint elem = thread_position_in_grid.x;
        T tmp = inp[elem];
        out[elem] = metal::exp(tmp);
"""


def test_mlx_documentation_example():
    gen = generate("myexp", ["inp"], ["out"], EXP, "", [InputInfo(mx.float16, 2, 64)],
                   [mx.float16], [("T", mx.float32)])
    name = "custom_kernel_myexp__float_float16_t_float16_t"
    assert gen.kernel_name == name
    assert gen.source == (
        "template <typename T>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* inp [[buffer(0)]],\n"
        "  device float16_t* out [[buffer(1)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{EXP}\n}}\n\n"
        f'template [[host_name("{name}")]] [[kernel]] decltype({name}<float>) {name}<float>;\n')


def test_constant_space_reference_and_shape_parameters():
    src = "x_shape x_strides x_ndim s_shape small_ndim"
    gen = generate("k", ["x", "s", "small"], ["out"], src, "// header\n",
                   [InputInfo(mx.float32, 2, 8), InputInfo(mx.float32, 0, 1),
                    InputInfo(mx.int32, 1, 7)], [mx.float32])
    assert [(p.name, p.msl_type, p.buffer) for p in gen.params] == [
        ("x", "const device float*", 0),
        ("x_shape", "const constant int*", 1),
        ("x_strides", "const constant int64_t*", 2),
        ("x_ndim", "const constant int&", 3),
        ("s", "const constant float&", 4),  # 0-d: by reference, never shape parameters
        ("small", "const constant int32_t*", 5),  # fewer than 8 elements: constant space
        ("small_ndim", "const constant int&", 6),
        ("out", "device float*", 7),
    ]
    assert gen.source.startswith("// header\n[[kernel]] void custom_kernel_k_float_floats_int32_tc_float(")
    assert gen.source.rstrip().endswith("}")  # no template: no instantiation line
    assert gen.attributes == ()


def test_attributes_only_when_mentioned_in_mlx_order():
    src = "threads_per_threadgroup thread_index_in_simdgroup grid_size"
    gen = generate("k", [], ["out"], src, "", [], [mx.float32])
    assert gen.attributes == (("grid_size", "uint3"), ("thread_index_in_simdgroup", "uint"),
                              ("threads_per_threadgroup", "uint3"))
    assert len(METAL_ATTRIBUTES) == 20


def test_template_values_and_atomic_outputs():
    gen = generate("k", ["a"], ["o1", "o2"], "", "", [InputInfo(mx.bfloat16, 1, 100)],
                   [mx.float32, mx.uint32], [("T", mx.bfloat16), ("N", -3), ("B", True)],
                   atomic_outputs=True)
    assert gen.template_values == ("bfloat16_t", "-3", "1")
    assert "template <typename T, int N, bool B>" in gen.source
    assert "device atomic<float>* o1 [[buffer(1)]]" in gen.source
    assert "device atomic<uint32_t>* o2 [[buffer(2)]]) {" in gen.source
    assert gen.kernel_name == kernel_name("k", gen.template_values,
                                          [InputInfo(mx.bfloat16, 1, 100)],
                                          [mx.float32, mx.uint32])
    with pytest.raises(ValueError, match="Invalid template argument"):
        generate("k", [], ["o"], "", "", [], [mx.float32], [("T", "float")])


def test_type_strings():
    assert [type_string(d) for d in (mx.float32, mx.float16, mx.bfloat16, mx.uint8, mx.bool_)] \
        == ["float", "float16_t", "bfloat16_t", "uint8_t", "bool"]
