"""Emulator basics against NumPy: elementwise and strided bodies (MLX documentation style),
grid geometry, partial edge threadgroups, template arguments, init_value, counters."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import requires_emulator, run

import mlx_metaltile as mt
from mlx_metaltile import emulator as em
from mlx_metaltile._msl.signature import METAL_ATTRIBUTES

pytestmark = requires_emulator


def test_elementwise_exp_like_mlx_docs(rng):
    a = mx.array(rng.standard_normal((4, 16)).astype(np.float32)).astype(mx.float16)
    kernel = em.metal_kernel(name="myexp", input_names=["inp"], output_names=["out"], source="""
        uint elem = thread_position_in_grid.x;
        T tmp = inp[elem];
        out[elem] = metal::exp(tmp);
    """)
    (out,) = kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype])
    assert out.dtype == mx.float16 and out.shape == a.shape
    want = np.exp(np.array(a.astype(mx.float32), dtype=np.float64)).astype(np.float16)
    np.testing.assert_array_equal(np.array(out), want)


STRIDED = """
    uint elem = thread_position_in_grid.x;
    uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
    T tmp = inp[loc];
    out[elem] = metal::exp(tmp);
"""


@pytest.mark.parametrize("view", ["transposed", "sliced", "reversed", "broadcast"])
def test_strided_input_with_elem_to_loc(rng, view):
    base = mx.array(rng.standard_normal((6, 8)).astype(np.float32))
    a = {"transposed": base.T, "sliced": base[1:5:2, ::3], "reversed": base[::-1, 2:],
         "broadcast": mx.broadcast_to(base[2:3], (5, 8))}[view]
    # negative strides need a signed location (a uint one wraps: out of bounds on a Mac too)
    src = STRIDED.replace("uint loc = elem_to_loc(elem,", "int64_t loc = elem_to_loc(int64_t(elem),")
    kernel = em.metal_kernel(name="strided_exp", input_names=["inp"], output_names=["out"],
                             source=src if view == "reversed" else STRIDED,
                             ensure_row_contiguous=False)
    (out,) = kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
                    threadgroup=(32, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype])
    np.testing.assert_allclose(np.array(out), np.exp(np.array(a)), rtol=1e-6)
    stats = em.last_launch_stats()
    assert stats.bytes_read["inp"] == a.size * 4  # each element once
    assert stats.bytes_written["out"] == a.size * 4
    assert set(stats.bytes_read) == {"inp", "inp_shape", "inp_strides", "inp_ndim", "out"}


def test_unsigned_wrap_is_reported_on_its_buffer(rng):
    a = mx.array(rng.standard_normal((6, 8)).astype(np.float32))[::-1]
    kernel = em.metal_kernel(name="strided_exp", input_names=["inp"], output_names=["out"],
                             source=STRIDED, ensure_row_contiguous=False)
    with pytest.raises(em.OutOfBoundsAccess, match="buffer 'inp'.*element 42949672") as info:
        kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
               threadgroup=(32, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype])
    assert info.value.location == "body line 4"


def test_row_contiguous_copy_gives_contiguous_strides(rng):
    a = mx.array(rng.standard_normal((6, 8)).astype(np.float32)).T
    (strides, shape) = run("""
        uint i = thread_position_in_grid.x;
        if (i < 2) { s[i] = inp_strides[i]; sh[i] = inp_shape[i]; }
    """, {"inp": a}, {"s": ((2,), mx.int64), "sh": ((2,), mx.int32)}, (2, 1, 1), (2, 1, 1))
    np.testing.assert_array_equal(strides, [6, 1])
    np.testing.assert_array_equal(shape, [8, 6])


def test_grid_counts_threads_and_edges_report_real_size():
    # grid 70 x 5 with threadgroups of 32 x 2: edge groups are 6 wide and 1 high.
    (pos, tpt, tg, sgs, tpg) = run("""
        uint3 g = thread_position_in_grid;
        uint i = g.y * 70 + g.x;
        pos[i] = g.x + 1000 * g.y;
        tpt[i] = threads_per_threadgroup.x + 100 * threads_per_threadgroup.y;
        tg[i] = threadgroup_position_in_grid.x + 100 * threadgroup_position_in_grid.y;
        sgs[i] = simdgroups_per_threadgroup * 100 + thread_index_in_simdgroup;
        tpg[i] = threads_per_grid.x * 100 + threadgroups_per_grid.y;
    """, {"dummy": mx.zeros((1,))},
        {k: ((5 * 70,), mx.uint32) for k in ("pos", "tpt", "tg", "sgs", "tpg")},
        (70, 5, 1), (32, 2, 1))
    x, y = np.meshgrid(np.arange(70), np.arange(5))
    x, y = x.ravel(), y.ravel()
    np.testing.assert_array_equal(pos, x + 1000 * y)
    width = np.where(x >= 64, 6, 32)
    height = np.where(y >= 4, 1, 2)
    np.testing.assert_array_equal(tpt, width + 100 * height)
    np.testing.assert_array_equal(tg, x // 32 + 100 * (y // 2))
    lin = (x % 32) + (y % 2) * width
    np.testing.assert_array_equal(sgs, -(-(width * height) // 32) * 100 + lin % 32)
    np.testing.assert_array_equal(tpg, 70 * 100 + 3)
    stats = em.last_launch_stats()
    assert stats.threads == 350 and stats.threadgroups == 9


def test_threadgroup_clamped_to_grid_like_mlx():
    (tpt,) = run("out[thread_position_in_grid.x] = threads_per_threadgroup.x;",
                 {"dummy": mx.zeros((1,))}, {"out": ((5,), mx.uint32)}, (5, 1, 1), (256, 1, 1))
    np.testing.assert_array_equal(tpt, 5)


def test_template_arguments_int_bool_dtype():
    (out,) = run("""
        uint i = thread_position_in_grid.x;
        out[i] = T(i * N) + (FLAG ? T(1) : T(0));
    """, {"dummy": mx.zeros((1,))}, {"out": ((8,), mx.float16)}, (8, 1, 1), (8, 1, 1),
        template=[("T", mx.float16), ("N", 3), ("FLAG", True)])
    np.testing.assert_array_equal(out, np.arange(8) * 3 + 1)


def test_scalar_and_small_inputs_by_reference_and_constant():
    (out,) = run("out[thread_position_in_grid.x] = a + b[1] + float(c);",
                 {"a": 1.5, "b": mx.array([1.0, 2.0, 3.0]), "c": 4},
                 {"out": ((4,), mx.float32)}, (4, 1, 1), (4, 1, 1))
    np.testing.assert_array_equal(out, 7.5)


def test_init_value_and_poisoned_outputs():
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    (out,) = run(src, {"dummy": mx.zeros((1,))}, {"out": ((6,), mx.float32)}, (6, 1, 1),
                 (6, 1, 1), init_value=-2.0)
    np.testing.assert_array_equal(out, [1, -2, 1, -2, 1, -2])
    (out,) = run(src, {"dummy": mx.zeros((1,))}, {"out": ((6,), mx.float32)}, (6, 1, 1),
                 (6, 1, 1))
    assert np.all(np.isnan(out[1::2]))  # never written: poison, not zeros


def test_multiple_outputs_and_dtypes():
    (a, b, c) = run("""
        uint i = thread_position_in_grid.x;
        a[i] = bfloat16_t(float(i) + 0.5f);
        b[i] = int8_t(-int(i));
        c[i] = i % 2 == 0;
    """, {"dummy": mx.zeros((1,))}, {"a": ((4,), mx.bfloat16), "b": ((4,), mx.int8),
                                     "c": ((4,), mx.bool_)}, (4, 1, 1), (4, 1, 1))
    np.testing.assert_array_equal(a, [0.5, 1.5, 2.5, 3.5])
    np.testing.assert_array_equal(b, [0, -1, -2, -3])
    np.testing.assert_array_equal(c, [True, False, True, False])


def test_verbose_prints_generated_source(capsys):
    run("out[0] = inp[0];", {"inp": mx.zeros((10,))}, {"out": ((1,), mx.float32)}, (1, 1, 1),
        (1, 1, 1), name="verbose_k")
    kernel = em.metal_kernel(name="verbose_k", input_names=["inp"], output_names=["out"],
                             source="out[0] = inp[0];")
    kernel(inputs=[mx.zeros((10,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
           output_shapes=[(1,)], output_dtypes=[mx.float32], verbose=True)
    printed = capsys.readouterr().out
    assert "Generated source code for `verbose_k`" in printed
    assert "const device float* inp [[buffer(0)]]" in printed


def test_argument_errors_mirror_mlx():
    kernel = em.metal_kernel(name="k", input_names=["a", "b"], output_names=["out"],
                             source="out[0] = a[0];")
    with pytest.raises(ValueError, match="Expected `inputs` to have size 2 but got size 1"):
        kernel(inputs=[mx.zeros((2,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
               output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="greater than the maximum allowed threads"):
        kernel(inputs=[mx.zeros((2,)), mx.zeros((2,))], grid=(2048, 1, 1),
               threadgroup=(1025, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="Invalid template argument"):
        kernel(inputs=[mx.zeros((2,)), mx.zeros((2,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
               output_shapes=[(1,)], output_dtypes=[mx.float32], template=[("T", 1.5)])
    with pytest.raises(TypeError, match="32-bit int"):  # never truncated to a small grid
        kernel(inputs=[mx.zeros((2,)), mx.zeros((2,))], grid=(2**32 + 1, 1, 1),
               threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(TypeError):  # keyword arguments only, as MLX's kernel objects
        kernel([mx.zeros((2,)), mx.zeros((2,))], [(1,)], [mx.float32], (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="at least one output"):
        em.metal_kernel(name="k", input_names=[], output_names=[], source="")


def test_barrier_free_kernel_runs_without_fibers():
    run("out[thread_position_in_grid.x] = 1.0f;", {"dummy": mx.zeros((1,))},
        {"out": ((4096,), mx.float32)}, (4096, 1, 1), (256, 1, 1))
    stats = em.last_launch_stats()
    assert not stats.used_fibers and stats.fiber_switches == 0


def test_counters_of_a_threadgroup_reduction():
    src = """
        threadgroup float partial[4];
        uint t = thread_position_in_threadgroup.x;
        float v = simd_sum(inp[thread_position_in_grid.x]);
        if (thread_index_in_simdgroup == 0) partial[simdgroup_index_in_threadgroup] = v;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (t == 0) out[threadgroup_position_in_grid.x] = partial[0] + partial[1] + partial[2] + partial[3];
    """
    x = np.arange(512, dtype=np.float32)
    (out,) = run(src, {"inp": x}, {"out": ((4,), mx.float32)}, (512, 1, 1), (128, 1, 1))
    np.testing.assert_array_equal(out, x.reshape(4, 128).sum(1))
    s = em.last_launch_stats()
    assert s.used_fibers and s.threadgroups == 4 and s.threads == 512
    assert s.bytes_read["inp"] == 512 * 4 and s.bytes_written["out"] == 4 * 4
    assert s.threadgroup_barriers == 4  # one barrier per threadgroup
    assert s.simd_collectives == 16  # one simd_sum per SIMD-group
    assert s.threadgroup_memory == 16


def test_use_backend_emulator_runs_the_kernel(rng):
    from mlx_metaltile import backends

    y = mx.array(rng.standard_normal((3, 40)).astype(np.float32))
    w = mx.ones((40,))
    run("out[0] = 1.0f;", {"d": mx.zeros((1,))}, {"out": ((1,), mx.float32)}, (1, 1, 1),
        (1, 1, 1), name="not_the_op")  # no stale statistics from an earlier test
    before = backends.launch_count(backend="emulator")
    with mt.use_backend("emulator"):
        out = mt.gated_rms_norm(y, y, w)
    assert backends.launch_count(backend="emulator") == before + 1
    stats = em.last_launch_stats()
    assert stats.kernel.startswith("mt_gated_rms_norm")
    assert stats.bytes_read["y"] == y.nbytes and stats.bytes_written["out"] == y.nbytes
    ref = mt.ops.gated_rms_norm_reference(y, y, w)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-6)


CONCURRENT = r"""
import sys
import mlx.core as mx
from mlx_metaltile import emulator as em
k = em.metal_kernel(name="race", input_names=["inp"], output_names=["out"],
                    source="// %s\nout[thread_position_in_grid.x] = inp[0] + 1.0f;")
(o,) = k(inputs=[mx.ones((8,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
         output_shapes=[(4,)], output_dtypes=[mx.float32])
assert o.tolist() == [2.0] * 4
print("ok")
"""


def _race(tmp_path, env, n):
    root = Path(__file__).resolve().parents[1]
    script = CONCURRENT % uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=str(root), **env)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err


def test_concurrent_processes_share_the_cache(tmp_path):
    """Three processes building the same new kernel at once all succeed (atomic installs)."""
    _race(tmp_path, {}, 3)


@pytest.mark.slow
def test_concurrent_processes_build_a_cold_cache(tmp_path):
    """Two processes starting on an empty cache race on the runtime library, the
    precompiled header and the kernel: all succeed, and the cache holds one of each, with no
    build directory left behind."""
    cache = tmp_path / "cache"
    _race(tmp_path, {"MLX_METALTILE_CACHE": str(cache)}, 2)
    root = cache / "emulator"
    assert len(list(root.glob("runtime-*/mt_runtime-*.so"))) == 1
    pch = list(root.glob("pch-*"))
    assert len(pch) == 1 and (pch[0] / "mt_pch.h.gch").is_file()
    assert len(list((root / "kernels").glob("*/kernel.so"))) == 1
    assert all((entry / "record.json").is_file()
               for entry in [*root.glob("runtime-*"), *pch, *(root / "kernels").iterdir()])
    leftovers = [p.name for p in root.rglob("*build*")]
    assert not leftovers, leftovers


def test_all_twenty_attributes_compile_and_report():
    names = [a for a, _ in METAL_ATTRIBUTES]
    terms = [f"float({a}.x + {a}.y + {a}.z)" if t == "uint3" else f"float({a})"
             for a, t in METAL_ATTRIBUTES]
    src = "uint i = thread_index_in_threadgroup + 64 * threadgroup_position_in_grid.x;\n"
    src += "".join(f"out[i * 20 + {k}] = {term};\n" for k, term in enumerate(terms))
    (out,) = run(src, {"d": mx.zeros((1,))}, {"out": ((100 * 20,), mx.float32)},
                 (100, 1, 1), (64, 1, 1))
    out = out.reshape(100, 20)
    col = dict(zip(names, out.T, strict=True))
    t = np.arange(100)
    np.testing.assert_array_equal(col["thread_position_in_grid"], t)  # (t, 0, 0)
    np.testing.assert_array_equal(col["threads_per_threadgroup"], np.where(t < 64, 66, 38))
    np.testing.assert_array_equal(col["dispatch_threads_per_threadgroup"], 66)
    np.testing.assert_array_equal(col["simdgroups_per_threadgroup"], 2)  # 64 and 36 threads
    np.testing.assert_array_equal(col["dispatch_simdgroups_per_threadgroup"], 2)
    np.testing.assert_array_equal(col["thread_execution_width"], 32)
    np.testing.assert_array_equal(col["threads_per_simdgroup"], 32)
    np.testing.assert_array_equal(col["grid_size"], 102)
    np.testing.assert_array_equal(col["grid_origin"], 0)
    np.testing.assert_array_equal(col["threadgroups_per_grid"], 4)
    np.testing.assert_array_equal(col["quadgroup_index_in_threadgroup"], (t % 64) // 4)
    np.testing.assert_array_equal(col["thread_index_in_quadgroup"], t % 4)
    np.testing.assert_array_equal(col["quadgroups_per_threadgroup"], np.where(t < 64, 16, 9))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16],
                         ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 100, 256, 1000])
def test_threadgroup_tree_reduction_with_partial_edge(rng, dtype, n):
    """Shared-memory halving reduction; the last threadgroup is partial (n % 128)."""
    src = """
        threadgroup float buf[128];
        uint t = thread_position_in_threadgroup.x;
        uint size = threads_per_threadgroup.x;  // real size: partial at the edge
        buf[t] = float(inp[thread_position_in_grid.x]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint s = 64; s > 0; s >>= 1) {
          if (t < s && t + s < size) buf[t] += buf[t + s];
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (t == 0) out[threadgroup_position_in_grid.x] = buf[0];
    """
    x = mx.array(rng.standard_normal(n).astype(np.float32)).astype(dtype)
    groups = -(-n // 128)
    (out,) = run(src, {"inp": x}, {"out": ((groups,), mx.float32)}, (n, 1, 1), (128, 1, 1))
    xs = np.array(x.astype(mx.float32), dtype=np.float64)
    want = [xs[g * 128:(g + 1) * 128].sum() for g in range(groups)]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert em.last_launch_stats().threadgroup_barriers == groups * 8
