"""Each hazard the emulator reports: a deliberately broken kernel per hazard must raise its
exception, naming the kernel, the threadgroup, the thread and the source line."""

from __future__ import annotations

import faulthandler

import mlx.core as mx
import numpy as np
import pytest
from emulator_util import requires_emulator, run

from mlx_metaltile import emulator as em

pytestmark = requires_emulator
D = {"d": mx.zeros((1,))}


def hazard(exc, source, inputs=None, outputs=None, grid=(64, 1, 1), tg=(64, 1, 1), **kw):
    """Run a broken kernel: it must raise `exc`, naming the kernel, the threadgroup, a thread
    and the kernel's own source line (in the message and as attributes)."""
    with pytest.raises(exc) as info:
        run(source, inputs or D, outputs or {"out": ((64,), mx.float32)}, grid, tg,
            name="broken", **kw)
    err = info.value
    msg = str(err)
    assert msg.startswith("[broken] ") and err.kernel == "broken"
    assert err.threadgroup is not None and err.thread is not None, msg
    assert f"of threadgroup {err.threadgroup}" in msg and f"thread {err.thread}" in msg
    # a frame too large for the stack faults where the kernel sets up its locals
    lines = ("body line", "header line") + (("the kernel's entry",) if exc is em.StackOverflow
                                            else ())
    assert err.location is not None and err.location.startswith(lines), msg
    assert f"at {err.location}" in msg
    return err


def test_out_of_bounds_read_of_an_input():
    err = hazard(em.OutOfBoundsAccess, """
        uint i = thread_position_in_grid.x;
        out[i] = inp[i + 1];  // the last thread reads one past the end
    """, {"inp": np.zeros(64, np.float32)})
    assert "read of 4 bytes on buffer 'inp'" in str(err) and "element 64" in str(err)
    assert err.thread == (63, 0, 0) and err.threadgroup == (0, 0, 0)
    assert err.location == "body line 3" and err.source_line.startswith("out[i] = inp[i + 1];")


def test_out_of_bounds_write_of_an_output_and_negative_index():
    err = hazard(em.OutOfBoundsAccess, """
        int i = int(thread_position_in_grid.x);
        out[i - 1] = 1.0f;
    """)
    assert "write of 4 bytes on buffer 'out'" in str(err) and "element -1" in str(err)
    assert err.thread == (0, 0, 0)


def test_out_of_bounds_in_threadgroup_memory():
    err = hazard(em.OutOfBoundsAccess, """
        threadgroup float a[64];
        threadgroup float b[64];
        a[thread_index_in_threadgroup] = 1.0f;
        b[thread_index_in_threadgroup] = 2.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_index_in_threadgroup] = a[thread_index_in_threadgroup + 8];
    """)
    assert "threadgroup memory" in str(err) and err.location == "body line 7"


def test_threadgroup_memory_over_32_kib():
    err = hazard(em.ThreadgroupMemoryExceeded, """
        threadgroup float a[4096];
        threadgroup float b[4100];  // 16 KiB + 16400 bytes > 32 KiB
        a[0] = b[0] = 0.0f;
        out[0] = a[0];
    """, tg=(64, 1, 1))
    assert "32 KiB" in str(err) and "'b'" in str(err) and err.location == "body line 3"
    # the author's declaration is quoted, not the emulator's rewrite of it
    assert err.source_line == "threadgroup float b[4100];  // 16 KiB + 16400 bytes > 32 KiB"
    assert str(err).endswith(f"at body line 3: {err.source_line}")


def test_hazards_quote_the_lines_as_written():
    # a declaration over two lines keeps the line numbers after it; `1.0h` is quoted as is
    err = hazard(em.ThreadgroupMemoryExceeded, """
        threadgroup float
            a[4096];
        threadgroup half b[8200];
        a[0] = 0.0f;
        b[0] = 1.0h;
        out[0] = a[0] + float(b[0]);
    """)
    assert err.location == "body line 4" and err.source_line == "threadgroup half b[8200];"
    err = hazard(em.OutOfBoundsAccess, """
        threadgroup float
            a[64];
        a[thread_index_in_threadgroup] = 2.0f;
        out[thread_index_in_threadgroup + 1] = 1.0h * a[thread_index_in_threadgroup];
    """)
    assert err.location == "body line 5"
    assert err.source_line == "out[thread_index_in_threadgroup + 1] = 1.0h * a[thread_index_in_threadgroup];"


def test_exactly_32_kib_is_allowed():
    (out,) = run("""
        threadgroup float a[4096];
        threadgroup half b[8192];
        a[thread_index_in_threadgroup] = 1.0f;
        b[thread_index_in_threadgroup] = half(2.0f);
        out[thread_index_in_threadgroup] = a[thread_index_in_threadgroup] + float(b[thread_index_in_threadgroup]);
    """, D, {"out": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1))
    assert (out == 3).all() and em.last_launch_stats().threadgroup_memory == 32768


def test_threadgroups_of_more_than_1024_threads_are_refused():
    with pytest.raises(ValueError, match="maximum allowed threads per threadgroup"):
        run("out[0] = 1.0f;", D, {"out": ((1,), mx.float32)}, (2048, 1, 1), (64, 32, 1))


def test_early_return_before_a_barrier():
    err = hazard(em.BarrierDivergence, """
        uint i = thread_position_in_grid.x;
        if (i >= 40) return;  // the classic Mac freeze
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = 1.0f;
    """)
    assert "barrier divergence" in str(err) and "body line 4" in str(err)
    assert err.threadgroup == (0, 0, 0)


def test_threads_at_different_barriers_deadlock():
    err = hazard(em.BarrierDivergence, """
        uint i = thread_position_in_grid.x;
        if (i < 32) {
          threadgroup_barrier(mem_flags::mem_threadgroup);
        } else {
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[i] = 1.0f;
    """)
    assert "deadlock" in str(err) and err.threadgroup == (0, 0, 0)
    assert "Threads 0-31 wait at threadgroup_barrier (body line 4)" in str(err)
    assert "Threads 32-63 wait at threadgroup_barrier (body line 6)" in str(err)


def test_simdgroup_barrier_after_a_lane_returned():
    err = hazard(em.BarrierDivergence, """
        uint i = thread_position_in_grid.x;
        if (i % 32 == 5) return;
        simdgroup_barrier(mem_flags::mem_none);
        out[i] = 1.0f;
    """)
    msg = str(err)
    assert "lanes of SIMD-group 0 can never all meet" in msg
    assert "Threads 0-4, 6-31 wait at simdgroup_barrier (body line 4)" in msg
    assert "Threads 5 have returned" in msg
    assert "32" not in msg.split(";")[0]  # the other SIMD-group is not part of the report


@pytest.mark.parametrize("call", ["simd_shuffle(v, 40)", "simd_shuffle_down(v, 32)",
                                  "simd_shuffle_xor(v, 33)", "simd_broadcast(v, 99)",
                                  "quad_shuffle(v, 4)"])
def test_invalid_simd_lane_argument(call):
    err = hazard(em.InvalidSimdLane, f"""
        float v = float(thread_position_in_grid.x);
        out[thread_position_in_grid.x] = {call};
    """)
    assert call.split("(")[0] in str(err) and err.location == "body line 3"


def test_strict_mode_reports_reads_of_unwritten_threadgroup_memory():
    source = """
        threadgroup float partial[64];
        uint t = thread_index_in_threadgroup;
        if (t < 32) partial[t] = 1.0f;  // the upper half is never written
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = partial[63 - t];
    """
    (out,) = run(source, D, {"out": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1))
    assert np.isnan(out[:32]).all()  # poison, not zeros
    previous = em.configure(strict=True)
    try:
        err = hazard(em.UninitializedThreadgroupRead, source)
    finally:
        em.configure(**vars(previous))
    assert err.location == "body line 6" and err.thread[0] < 32


def test_stack_overflow_is_an_exception_not_a_crash():
    err = hazard(em.StackOverflow, """
        float big[100000];  // 400 KB on one thread's stack
        for (uint k = 0; k < 100000; ++k) big[k] = float(k) * inp[0];
        out[thread_position_in_grid.x] = big[thread_position_in_grid.x * 1000];
    """, {"inp": np.ones(8, np.float32)})
    assert "stack overflow" in str(err)


RECURSIVE_HEADER = """
inline float deep(const device float* p, uint n) {
  float local[64];
  for (uint k = 0; k < 64; ++k) local[k] = p[k % 8] * float(n);
  if (n == 0) return local[3];
  return deep(p, n - 1) + local[n % 64];
}
"""


def test_stack_overflow_in_a_recursive_helper_names_the_helper():
    err = hazard(em.StackOverflow, "out[thread_position_in_grid.x] = deep(inp, 100000u);",
                 {"inp": np.ones(8, np.float32)}, header=RECURSIVE_HEADER)
    # the line of the helper whose frame ran into the guard page
    assert err.location in ("header line 2", "header line 4", "header line 6"), str(err)


def test_hazard_in_an_out_of_line_helper_names_its_line():
    err = hazard(em.OutOfBoundsAccess, "out[thread_position_in_grid.x] = load(inp, 70);",
                 {"inp": np.zeros(64, np.float32)},
                 header="__attribute__((noinline)) float load(const device float* p, uint i) {\n"
                        "  return p[i];\n}\n")
    assert err.location == "header line 2" and err.source_line == "return p[i];"


def test_wild_pointer_is_a_memory_fault():
    err = hazard(em.MemoryFault, """
        device float* p = (device float*)(ulong(16));
        out[thread_position_in_grid.x] = p[thread_position_in_grid.x];
    """)
    assert err.location == "body line 3"


def test_integer_division_by_zero():
    err = hazard(em.ArithmeticFault, """
        int i = int(thread_position_in_grid.x);
        out[i] = float(100 / (i - 7));
    """)
    assert err.thread == (7, 0, 0)


def test_simdgroup_matrix_needs_a_full_simdgroup():
    hazard(em.SimdgroupMatrixHazard, """
        simdgroup_float8x8 a(1.0f), c(0.0f);
        if (thread_index_in_simdgroup < 31) simdgroup_multiply_accumulate(c, a, a, c);
        out[thread_position_in_grid.x] = c.thread_elements()[0];
    """, grid=(32, 1, 1), tg=(32, 1, 1))


def test_compile_errors_name_the_kernel_lines():
    with pytest.raises(em.KernelCompileError) as info:
        run("uint i = thread_position_in_grid.x;\nout[i] = undefined_name + 1.0f;", D,
            {"out": ((4,), mx.float32)}, (4, 1, 1), (4, 1, 1), name="broken")
    msg = str(info.value)
    assert msg.startswith("[broken] the kernel does not compile: body:2:")
    assert "undefined_name" in msg
    with pytest.raises(em.KernelCompileError, match="header:2:"):
        run("out[0] = 1.0f;", D, {"out": ((4,), mx.float32)}, (4, 1, 1), (4, 1, 1),
            header="// helpers\ninline float f() { return missing; }\n", name="broken")


def test_hazard_in_a_header_helper_names_the_header_line():
    err = hazard(em.OutOfBoundsAccess, "out[thread_position_in_grid.x] = load(inp, 70);",
                 {"inp": np.zeros(64, np.float32)},
                 header="inline float load(const device float* p, uint i) {\n"
                        "  return p[i];\n}\n")
    assert err.location == "header line 2"


def test_unreadable_debug_information_a_hazard_says_why_its_line_is_missing(monkeypatch):
    from mlx_metaltile.emulator import _dwarf

    monkeypatch.setattr(_dwarf, "line_table", lambda path: None)
    with pytest.raises(em.OutOfBoundsAccess) as info:
        run("out[thread_position_in_grid.x + 1] = 0.0f;", D, {"out": ((64,), mx.float32)},
            (64, 1, 1), (64, 1, 1), name="broken")
    err = info.value
    assert err.location is None and err.thread == (63, 0, 0)
    assert str(err).endswith("source line unavailable: the kernel module's debug "
                             "information could not be read"), str(err)


PRIVATE_ARRAY = """
  uint t = thread_position_in_grid.x;
  float a[4];
  for (int i = 0; i < 4; ++i) a[i] = inp[i] + float(t);
  out[t] = a[uint(inp[4])];
"""


def test_out_of_bounds_index_into_a_per_thread_array():
    inp = np.array([1, 2, 3, 4, 9], np.float32)
    err = hazard(em.OutOfBoundsAccess, PRIVATE_ARRAY, {"inp": inp})
    assert err.location == "body line 5" and err.source_line == "out[t] = a[uint(inp[4])];"
    assert err.thread == (0, 0, 0)
    assert "out-of-bounds index 9 into an array of type 'float [4]'" in str(err)
    # the same kernel with an index inside the array runs (the check raised, not the kernel)
    (out,) = run(PRIVATE_ARRAY, {"inp": np.array([1, 2, 3, 4, 2], np.float32)},
                 {"out": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1), name="in_bounds")
    np.testing.assert_array_equal(out, 3.0 + np.arange(64))


def test_builtin_memcpy_reading_past_a_buffer_end():
    source = ("uint t = thread_position_in_grid.x;\n"
              "float v[2];\n"
              "__builtin_memcpy(v, inp + t, n * sizeof(float));\n"
              "out[t] = v[0] + v[1];")
    inp = np.arange(64, dtype=np.float32)
    err = hazard(em.OutOfBoundsAccess, source, {"inp": inp, "n": np.uint32(2)})
    assert err.location == "body line 3" and err.thread == (63, 0, 0)
    assert "out-of-bounds read of 8 bytes on buffer 'inp'" in str(err)
    (out,) = run(source, {"inp": inp, "n": np.uint32(2)}, {"out": ((63,), mx.float32)},
                 (63, 1, 1), (63, 1, 1), name="memcpy_in_bounds")
    np.testing.assert_array_equal(out, inp[:63] + inp[1:])
    assert em.last_launch_stats().bytes_read["inp"] <= 63 * 8  # the check counts nothing


def test_write_through_a_const_cast_input_pointer():
    err = hazard(em.InputBufferWrite,
                 "const_cast<device float*>(inp)[thread_position_in_grid.x] = 0.0f;\n"
                 "out[thread_position_in_grid.x] = 1.0f;",
                 {"inp": np.ones(64, np.float32)})
    assert err.location == "body line 1"
    assert "write of 4 bytes to the input buffer 'inp'" in str(err)


def test_the_emulator_recovers_after_a_hazard():
    hazard(em.OutOfBoundsAccess, "out[thread_position_in_grid.x + 1] = 0.0f;")
    (out,) = run("out[thread_position_in_grid.x] = 2.0f;", D, {"out": ((64,), mx.float32)},
                 (64, 1, 1), (64, 1, 1))
    assert (out == 2).all()


def test_spin_wait_on_another_thread_times_out():
    previous = em.configure(timeout_s=1.0)
    try:
        err = hazard(em.KernelTimeout, """
            threadgroup atomic_uint flag;
            uint t = thread_index_in_threadgroup;
            if (t == 0) atomic_store_explicit(&flag, 0u, memory_order_relaxed);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (t == 1) {
              while (atomic_load_explicit(&flag, memory_order_relaxed) == 0u) {}
            }
            if (t == 2) atomic_store_explicit(&flag, 1u, memory_order_relaxed);
            out[t] = 1.0f;
        """)
    finally:
        em.configure(**vars(previous))
    assert "spin-waiting" in str(err) and err.location == "body line 7"


def test_endless_loop_without_memory_access_times_out():
    """A loop on registers only (no load or store to check the clock at) is interrupted by the
    watchdog's signal, in every worker, instead of hanging the process."""
    previous = em.configure(timeout_s=0.5, workers=2)
    try:
        err = hazard(em.KernelTimeout, """
            uint step = uint(inp[0]);  // 0: the loop never ends
            float acc = 0.0f;
            for (uint j = 0; j < 10; j += step) { acc = acc * 0.5f + 1.0f; }
            out[thread_position_in_grid.x] = acc;
        """, {"inp": np.zeros(8, np.float32)}, tg=(32, 1, 1))
    finally:
        em.configure(**vars(previous))
    assert "ran for more than 0.5 s" in str(err) and err.location == "body line 4"
    (out,) = run("out[thread_position_in_grid.x] = 3.0f;", D, {"out": ((64,), mx.float32)},
                 (64, 1, 1), (32, 1, 1))
    assert (out == 3).all()  # the next launch runs normally


def test_stack_overflow_caught_after_faulthandler_reinstalls_its_handler():
    was_enabled = faulthandler.is_enabled()
    faulthandler.enable()  # replaces the SIGSEGV handler
    try:
        hazard(em.StackOverflow, """
            float big[100000];
            for (uint k = 0; k < 100000; ++k) big[k] = float(k) * inp[0];
            out[thread_position_in_grid.x] = big[thread_position_in_grid.x * 1000];
        """, {"inp": np.ones(8, np.float32)})
    finally:
        if not was_enabled:
            faulthandler.disable()


def strict_run(source, **kw):
    previous = em.configure(strict=True)
    try:
        return run(source, D, {"out": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1), **kw)
    finally:
        em.configure(**vars(previous))


def test_strict_mode_reports_threadgroup_races():
    with pytest.raises(em.ThreadgroupRace, match="reads a byte written by thread 0") as info:
        strict_run("""
            threadgroup float s[64];
            uint t = thread_index_in_threadgroup;
            s[t] = float(t);
            out[t] = s[t > 0 ? t - 1 : 0];  // a neighbour's value, without a barrier
        """)
    assert info.value.location == "body line 5" and info.value.thread == (1, 0, 0)
    assert "body line 4" in str(info.value)  # where the other thread wrote
    with pytest.raises(em.ThreadgroupRace, match="writes a byte also written by"):
        strict_run("""
            threadgroup float s[1];
            s[0] = float(thread_index_in_threadgroup);  // every thread writes the same slot
            threadgroup_barrier(mem_flags::mem_threadgroup);
            out[thread_index_in_threadgroup] = s[0];
        """)


def test_strict_mode_accepts_barrier_separated_and_simdgroup_ordered_accesses():
    (out,) = strict_run("""
        threadgroup float s[64];
        threadgroup atomic_uint n;
        uint t = thread_index_in_threadgroup;
        if (t == 0) atomic_store_explicit(&n, 0u, memory_order_relaxed);
        s[t] = float(t);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float a = s[63 - t];
        atomic_fetch_add_explicit(&n, 1u, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        s[t] = a * 2.0f;                    // written again after everyone read: ordered
        simdgroup_barrier(mem_flags::mem_threadgroup);
        float b = s[(t & ~31u) + ((t + 1) & 31u)];  // a lane of the same SIMD-group
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = b + float(atomic_load_explicit(&n, memory_order_relaxed));
    """)
    t = np.arange(64)
    nxt = (t & ~31) + ((t + 1) & 31)
    np.testing.assert_array_equal(out, 2.0 * (63 - nxt) + 64)
