"""MSL types on the emulator against NumPy: half and bfloat16 rounding, vectors and swizzles,
as_type, select, math, numeric limits, MLX's prelude, atomics."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from emulator_util import bf16_round, requires_emulator, run

pytestmark = requires_emulator


def test_half_conversion_rounds_to_nearest_even(rng):
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-8, 5, 500),
                        [65504, 65519.99, 65520, 1e-8, 2.0**-24 * 0.5, 2.0**-24 * 0.51,
                         1 + 2.0**-11, 1 + 3 * 2.0**-11, -0.0, np.inf, np.nan]])
    x = x.astype(np.float32)
    (out,) = run("out[thread_position_in_grid.x] = half(inp[thread_position_in_grid.x]);",
                 {"inp": x}, {"out": ((x.size,), mx.float16)}, (x.size, 1, 1), (64, 1, 1))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(out, want)


def test_half_arithmetic_rounds_each_operation():
    # (1 + 2^-11) rounds to 1 in half before the subtraction: the result is 0, not 2^-11.
    (out,) = run("""
        half a = half(1.0f), b = half(0.00048828125f), c = half(1.0f);
        half r = a + b - c;
        out[0] = float(r);
        out[1] = float(half(a * half(3.0f)) / half(7.0f));
    """, {"d": mx.zeros((1,))}, {"out": ((2,), mx.float32)}, (1, 1, 1), (1, 1, 1))
    assert out[0] == 0.0
    assert out[1] == float(np.float16(np.float16(3.0) / np.float16(7.0)))


def test_bfloat16_conversion_rounds_to_nearest_even(rng):
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-30, 30, 500),
                        [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, 3.4e38, -0.0,
                         np.inf, -np.inf]]).astype(np.float32)
    (out,) = run("out[thread_position_in_grid.x] = bfloat16_t(inp[thread_position_in_grid.x]);",
                 {"inp": x}, {"out": ((x.size,), mx.bfloat16)}, (x.size, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, bf16_round(x).astype(np.float64))
    # and MLX agrees with the same oracle
    np.testing.assert_array_equal(np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)),
                                  bf16_round(x))


def test_bfloat16_arithmetic_and_promotion():
    (out,) = run("""
        bfloat16_t a = bfloat16_t(1.0f), b = bfloat16_t(0.00390625f);  // 2^-8
        out[0] = float(a + b);              // bfloat + bfloat -> bfloat: 1 + 2^-8 ties to 1
        out[1] = a + 0.00390625f;           // bfloat + float -> float
        out[2] = float(-a * bfloat16_t(3.0f));
        out[3] = float(bfloat16_t(2.0f) / bfloat16_t(3.0f));
    """, {"d": mx.zeros((1,))}, {"out": ((4,), mx.float32)}, (1, 1, 1), (1, 1, 1))
    assert out[0] == 1.0
    assert out[1] == 1.00390625
    assert out[2] == -3.0
    assert out[3] == bf16_round(np.float32(bf16_round(np.float32(2.0)) / np.float32(3.0)))


def test_vectors_swizzles_and_constructors():
    (out,) = run("""
        float4 v = float4(1.0f, 2.0f, 3.0f, 4.0f);
        float2 a = v.xy * 2.0f + v.zw;          // (5, 8)
        float3 b = float3(a, 9.0f);
        v.xy = v.yx;                             // (2, 1, 3, 4)
        v.zw += float2(10.0f);                   // (2, 1, 13, 14)
        half4 h = half4(v);
        int2 k = int2(7, -3) / 2;                // (3, -1)
        uint4 u = uint4(1, 2, 3, 4) << 1u;
        bool4 c = v > float4(1.5f);
        float4 s = select(float4(0.0f), v, c);   // (2, 0, 13, 14)
        packed_float3 p = packed_float3(b);
        out[0] = a.x; out[1] = a.y; out[2] = b.z;
        out[3] = v.x; out[4] = v.y; out[5] = v.z; out[6] = v.w;
        out[7] = float(h.w); out[8] = float(k.x); out[9] = float(k.y);
        out[10] = float(u.w); out[11] = s.y + s.z; out[12] = float(all(c.zw)) + float(any(c));
        out[13] = dot(v, float4(1.0f)); out[14] = p.z + float(sizeof(float3)) + float(sizeof(packed_float3));
        out[15] = float4(v.rgba).b + float4(v.wzyx).x;  // a swizzle is a value, not a vector
    """, {"d": mx.zeros((1,))}, {"out": ((16,), mx.float32)}, (1, 1, 1), (1, 1, 1))
    np.testing.assert_array_equal(out, [5, 8, 9, 2, 1, 13, 14, 14, 3, -1, 8, 13, 2, 30,
                                        9 + 16 + 12, 13 + 14])


def test_as_type_and_bits():
    (out,) = run("""
        out[0] = as_type<uint>(1.0f);
        out[1] = as_type<ushort>(half(1.0f));
        out[2] = as_type<ushort>(bfloat16_t(1.0f));
        out[3] = as_type<uint>(half2(half(1.0f), half(-2.0f)));
        out[4] = popcount(0xF0F0u) + 100u * clz(1u) + 10000u * ctz(8u);
        out[5] = extract_bits(0xABCDu, 4u, 8u);
    """, {"d": mx.zeros((1,))}, {"out": ((6,), mx.uint32)}, (1, 1, 1), (1, 1, 1))
    assert out[0] == 0x3F800000 and out[1] == 0x3C00 and out[2] == 0x3F80
    assert out[3] == (0xC000 << 16) | 0x3C00
    assert out[4] == 8 + 100 * 31 + 10000 * 3 and out[5] == 0xBC


def test_math_and_limits(rng):
    x = rng.uniform(0.1, 4.0, 64).astype(np.float32)
    (out,) = run("""
        uint i = thread_position_in_grid.x;
        float v = inp[i];
        out[i * 8 + 0] = metal::exp(v);
        out[i * 8 + 1] = metal::precise::rsqrt(v);
        out[i * 8 + 2] = fast::log(v);
        out[i * 8 + 3] = clamp(v, 1.0f, 2.0f);
        out[i * 8 + 4] = metal::pow(v, 1.5f);
        out[i * 8 + 5] = metal::tanh(v - 2.0f);
        out[i * 8 + 6] = float(metal::exp(half(v)));
        out[i * 8 + 7] = mix(v, 10.0f, 0.25f);
    """, {"inp": x}, {"out": ((64 * 8,), mx.float32)}, (64, 1, 1), (64, 1, 1))
    out = out.reshape(64, 8)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out[:, 0], np.exp(x64), rtol=2e-7)
    np.testing.assert_allclose(out[:, 1], 1 / np.sqrt(x64), rtol=2e-7)
    np.testing.assert_allclose(out[:, 2], np.log(x64), rtol=2e-7, atol=1e-7)
    np.testing.assert_array_equal(out[:, 3], np.clip(x, 1, 2))
    np.testing.assert_allclose(out[:, 4], x64 ** 1.5, rtol=3e-7)
    np.testing.assert_allclose(out[:, 5], np.tanh(x64 - 2), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[:, 6], np.exp(x.astype(np.float16).astype(np.float64)),
                               rtol=1e-3)
    np.testing.assert_allclose(out[:, 7], x64 + (10 - x64) * 0.25, rtol=1e-6)
    (lim,) = run("""
        out[0] = Limits<float>::max; out[1] = Limits<float>::finite_min;
        out[2] = float(numeric_limits<half>::max()); out[3] = float(Limits<bfloat16_t>::min);
        out[4] = float(metal::numeric_limits<bfloat16_t>::max());
        out[5] = float(metal::numeric_limits<int>::max());
        out[6] = max(uint(3), 5u) + min(2, -4) + abs(-2);
        out[7] = metal::fmax(NAN, 1.0f);
    """, {"d": mx.zeros((1,))}, {"out": ((8,), mx.float32)}, (1, 1, 1), (1, 1, 1))
    assert lim[0] == np.inf and lim[1] == -np.finfo(np.float32).max and lim[2] == 65504
    assert lim[3] == -np.inf and lim[4] == float(bf16_round(np.float32(3.3895314e38)))
    assert lim[5] == 2.0**31 and lim[6] == 5 - 4 + 2 and lim[7] == 1


def test_headers_include_metal_stdlib_and_helpers():
    header = """
    #include <metal_stdlib>
    #include <metal_simdgroup>
    using namespace metal;
    template <typename T> inline T twice(const device T* p, uint i) { return p[i] * T(2); }
    """
    x = np.arange(10, dtype=np.float32)
    (out,) = run("out[thread_position_in_grid.x] = twice(inp, thread_position_in_grid.x) + 0.5h;",
                 {"inp": x}, {"out": ((10,), mx.float32)}, (10, 1, 1), (10, 1, 1),
                 header=header)
    np.testing.assert_array_equal(out, 2 * x + 0.5)


def test_atomic_outputs_histogram(rng):
    ids = rng.integers(0, 8, 1000).astype(np.uint32)
    vals = rng.standard_normal(1000).astype(np.float32)
    (counts, sums) = run("""
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&counts[ids[i]], 1u, memory_order_relaxed);
        atomic_fetch_add_explicit(&sums[ids[i]], vals[i], memory_order_relaxed);
    """, {"ids": ids, "vals": vals}, {"counts": ((8,), mx.uint32), "sums": ((8,), mx.float32)},
        (1000, 1, 1), (256, 1, 1), init_value=0, atomic_outputs=True)
    np.testing.assert_array_equal(counts, np.bincount(ids, minlength=8))
    np.testing.assert_allclose(sums, np.bincount(ids, vals, minlength=8), rtol=1e-5, atol=1e-5)


def test_threadgroup_atomics_and_compare_exchange():
    (out,) = run("""
        threadgroup atomic_uint counter;
        if (thread_index_in_threadgroup == 0) atomic_store_explicit(&counter, 0u, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        atomic_fetch_max_explicit(&counter, thread_index_in_threadgroup, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint expected = 63u;
        bool swapped = atomic_compare_exchange_weak_explicit(&counter, &expected, 1000u,
                          memory_order_relaxed, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_index_in_threadgroup] = atomic_load_explicit(&counter, memory_order_relaxed)
                                            + (swapped ? 1u : 0u);
    """, {"d": mx.zeros((1,))}, {"out": ((64,), mx.uint32)}, (64, 1, 1), (64, 1, 1))
    assert sorted(out.tolist()) == [1000] * 63 + [1001]


def test_threadgroup_memory_shared_and_pointers():
    (out,) = run("""
        threadgroup float tile[4][33];
        threadgroup float* row = &tile[thread_position_in_threadgroup.y][0];
        row[thread_position_in_threadgroup.x] = float(thread_index_in_threadgroup);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint x = thread_position_in_threadgroup.x, y = thread_position_in_threadgroup.y;
        out[thread_position_in_grid.y * 32 + thread_position_in_grid.x] = tile[3 - y][31 - x];
    """, {"d": mx.zeros((1,))}, {"out": ((8 * 32,), mx.float32)}, (32, 8, 1), (32, 4, 1))
    lin = np.arange(128).reshape(4, 32)[::-1, ::-1].ravel()
    np.testing.assert_array_equal(out, np.concatenate([lin, lin]))
