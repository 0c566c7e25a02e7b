"""Speed of the CPU emulator itself (run: pytest bench/test_emulator_speed.py --benchmark-only).

Figures quoted in mlx_metaltile/emulator/README.md come from these benchmarks.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

from mlx_metaltile import emulator as em

pytestmark = pytest.mark.skipif(em.unavailable_reason() is not None,
                                reason=f"emulator unavailable: {em.unavailable_reason()}")

BARRIER_HEAVY = """
    threadgroup float buf[1024];
    uint t = thread_position_in_threadgroup.x;
    float acc = inp[t];
    for (int i = 0; i < 32; ++i) {
      buf[t] = acc;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      acc += buf[(t + 1) % 1024] * 0.5f;
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[t] = acc;
"""


def _launch(kernel, x, n, tg):
    (out,) = kernel(inputs=[x], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
                    output_shapes=[(n,)], output_dtypes=[mx.float32])
    return out


def test_barrier_heavy_launch(benchmark):
    """One threadgroup of 1024 threads crossing 64 threadgroup barriers."""
    kernel = em.metal_kernel(name="bench_barriers", input_names=["inp"],
                             output_names=["out"], source=BARRIER_HEAVY)
    x = mx.arange(1024, dtype=mx.float32)
    _launch(kernel, x, 1024, 1024)  # compile outside the timing
    benchmark.pedantic(lambda: _launch(kernel, x, 1024, 1024), rounds=10, warmup_rounds=1)
    stats = em.last_launch_stats()
    assert stats.threadgroup_barriers == 64 and stats.used_fibers
    benchmark.extra_info.update(barriers=64, threads=1024,
                                fiber_switches=stats.fiber_switches)


SIMD_HEAVY = """
    uint t = thread_position_in_threadgroup.x;
    float acc = inp[t];
    for (int i = 0; i < 32; ++i) {
      acc = simd_sum(acc) * 0.03125f + simd_shuffle_xor(acc, ushort(i & 31));
    }
    out[t] = acc;
"""
DIVERGENT_HELPER = """
    uint t = thread_position_in_threadgroup.x;
    float acc = inp[t];
    for (int i = 0; i < 32; ++i) {
      if (t % 2 == 0) acc = red(acc) * 0.03125f; else acc = red(acc * 2.0f) * 0.03125f;
    }
    out[t] = acc;
"""


def test_simd_heavy_launch(benchmark):
    """One threadgroup of 1024 threads calling 64 SIMD-group functions (every lane, one path)."""
    kernel = em.metal_kernel(name="bench_simd", input_names=["inp"], output_names=["out"],
                             source=SIMD_HEAVY)
    x = mx.arange(1024, dtype=mx.float32)
    _launch(kernel, x, 1024, 1024)
    benchmark.pedantic(lambda: _launch(kernel, x, 1024, 1024), rounds=10, warmup_rounds=1)
    stats = em.last_launch_stats()
    assert stats.simd_collectives == 32 * 64 and not stats.call_sites_from_debug_info
    benchmark.extra_info.update(collectives=stats.simd_collectives,
                                fiber_switches=stats.fiber_switches)


def test_divergent_helper_launch(benchmark):
    """1024 threads calling a simd_sum helper from two branches, 32 times: two collectives per
    SIMD-group each time, told apart by call path (with the module's debug information)."""
    kernel = em.metal_kernel(name="bench_helper", input_names=["inp"], output_names=["out"],
                             source=DIVERGENT_HELPER,
                             header="inline float red(float v) { return simd_sum(v); }\n")
    x = mx.arange(1024, dtype=mx.float32)
    _launch(kernel, x, 1024, 1024)
    benchmark.pedantic(lambda: _launch(kernel, x, 1024, 1024), rounds=10, warmup_rounds=1)
    stats = em.last_launch_stats()
    assert stats.simd_collectives == 32 * 32 * 2 and stats.call_sites_from_debug_info
    benchmark.extra_info.update(collectives=stats.simd_collectives,
                                fiber_switches=stats.fiber_switches)


def test_barrier_free_launch(benchmark):
    """1M threads of an elementwise body (plain mode: no fibers)."""
    kernel = em.metal_kernel(name="bench_plain", input_names=["inp"], output_names=["out"],
                             source="uint i = thread_position_in_grid.x;\n"
                                    "out[i] = metal::exp(inp[i]) * 2.0f;")
    n = 1 << 20
    x = mx.zeros((n,))
    _launch(kernel, x, n, 256)
    benchmark.pedantic(lambda: _launch(kernel, x, n, 256), rounds=5, warmup_rounds=1)
    assert em.last_launch_stats().fiber_switches == 0
    benchmark.extra_info.update(threads=n)


_fresh = itertools.count()


def test_compile_a_new_kernel(benchmark):
    """A kernel never seen before: generate, compile against the precompiled header, load."""
    x = mx.zeros((64,))
    _launch(em.metal_kernel(name="warm", input_names=["inp"], output_names=["out"],
                            source="out[0] = inp[0];"), x, 1, 1)  # runtime + header built

    def compile_one():
        src = (f"// variant {next(_fresh)} {id(compile_one)}\n"
               "uint i = thread_position_in_grid.x;\nout[i] = simd_sum(inp[i]);")
        kernel = em.metal_kernel(name="bench_compile", input_names=["inp"],
                                 output_names=["out"], source=src)
        _launch(kernel, x, 64, 64)

    benchmark.pedantic(compile_one, rounds=5, warmup_rounds=0)
