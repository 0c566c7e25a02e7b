"""moe_gather_qmm against a float64 NumPy oracle, on every backend and variant available here."""

from __future__ import annotations

import functools
import importlib
import inspect

import mlx.core as mx
import numpy as np
import pytest
from support import (
    backend_params,
    input_space,
    record_emulator_sources,
    require_backend,
    strict_emulator,
)

import mlx_metaltile as mt
from mlx_metaltile import _device, backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.moe_gather_qmm import gemv_plan, make_case, oracle, run_and_check

op_module = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm")

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DTYPE_IDS = ("float32", "float16", "bfloat16")
VARIANTS = tuple(op_module.VARIANT_SPECS)


@pytest.fixture(params=backend_params("reference", "emulator", "metal", "cuda"))
def backend(request):
    require_backend(request.param)
    with backends.use_backend(request.param):
        yield request.param


@pytest.fixture(params=VARIANTS)
def variant(request, backend):
    """Both kernel paths where the backend runs them (the reference ignores the variant)."""
    name = request.param
    if backend == "reference":
        if name != VARIANTS[0]:
            pytest.skip("the reference backend has no kernel variants")
        return None
    if backend == "metal" and name == "mpp":
        reason = _device.metal_mpp_reason()
        if reason is not None:
            pytest.skip(f"mpp path unavailable: {reason}")
    if backend not in op_module.VARIANT_SPECS[name].backends:
        pytest.skip(f"variant {name} does not run on {backend}")
    return name


# (E, M, N, K, group_size, ids or None for sorted random), the shapes that break kernels
SHAPES = {
    "one_tile": (4, 8, 64, 64, 32, None),
    "multi_tile": (8, 16, 128, 128, 64, None),
    "ragged_m5": (4, 5, 64, 64, 32, [0, 0, 1, 1, 2]),
    "unsorted_repeats": (2, 13, 64, 128, 64, [0, 1] * 6 + [0]),
    "m1": (4, 1, 96, 64, 64, [3]),
    "first_last_expert": (6, 11, 32, 128, 128, [0, 0, 0, 2, 2, 5, 5, 5, 5, 5, 5]),
    "out_of_range_id": (4, 9, 64, 64, 32, [0, 1, 4, 1, 7, 2, 3, 3, 9]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_oracle(backend, variant, rng, dtype, bits, shape):
    E, M, N, K, gs, ids = SHAPES[shape]
    case = make_case(rng, E, M, N, K, gs, bits, dtype, ids)
    run_and_check(case, gs, bits, dtype, backend, variant, what=f" {shape}")


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_block_eight_experts(backend, variant, rng, dtype, bits):
    """A real decode block: one token's top-8 of 128 experts, 8 runs in one tile."""
    E, M, N, K, gs = 128, 8, 512, 2048, 64
    ids = np.sort(rng.choice(E, size=8, replace=False))
    case = make_case(rng, E, M, N, K, gs, bits, dtype, ids)
    run_and_check(case, gs, bits, dtype, backend, variant, what=" decode block")


def test_int32_indices_and_negative_id(backend, variant, rng):
    ids = np.array([-1, 0, 0, 1, 2, 2, 3, -5, 3], dtype=np.int32)
    case = make_case(rng, 4, 9, 64, 64, 32, 8, mx.float16, ids, index_dtype=mx.int32)
    run_and_check(case, 32, 8, mx.float16, backend, variant, what=" int32 ids")


def test_mx_quantize_layout(backend, variant, rng):
    """Weights straight from mx.quantize of a stacked [E, N, K] weight (scales of both signs)."""
    E, M, N, K, gs, bits = 4, 12, 64, 128, 64, 4
    dense = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(mx.float16)
    w, scales, biases = mx.quantize(dense, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.float16)
    ids = mx.array(np.sort(rng.integers(0, E, size=M)), dtype=mx.uint32)
    run_and_check((x, w, scales, biases, ids), gs, bits, mx.float16, backend, variant)


def test_large_magnitudes_bf16(backend, variant, rng):
    """bf16 activations and weights far from 1 (within half's range: the mpp path stages
    bfloat16 through half)."""
    E, M, N, K, gs, bits = 3, 10, 32, 64, 32, 8
    x, w, scales, biases, ids = make_case(rng, E, M, N, K, gs, bits, mx.bfloat16)
    x = x * 300.0
    scales = scales * 40.0
    biases = biases * 40.0
    run_and_check((x, w, scales, biases, ids), gs, bits, mx.bfloat16, backend, variant)


@pytest.mark.parametrize("offset", (1, 2, 3, 4))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_x_at_any_element_offset(backend, variant, rng, dtype, offset):
    """x a contiguous view starting `offset` elements into its buffer: the CUDA layer's
    wide loads of x (common.h's mt_load_live) are taken only where the address is aligned,
    element by element elsewhere."""
    E, M, N, K, gs, bits = 4, 13, 64, 128, 32, 4
    x, w, scales, biases, ids = make_case(rng, E, M, N, K, gs, bits, dtype)
    flat = mx.concatenate([mx.zeros((offset,), dtype=dtype), x.reshape(-1)])
    x = flat[offset:].reshape(x.shape)
    run_and_check((x, w, scales, biases, ids), gs, bits, dtype, backend, variant)


def test_non_contiguous_inputs(backend, variant, rng):
    """Transposed and column-sliced x, strided indices, every other expert of a weight stack:
    the wrapper hands the kernel row-contiguous copies, the results are those of the math."""
    E, M, N, K, gs, bits, dtype = 8, 12, 64, 128, 32, 4, mx.bfloat16
    x, w, scales, biases, ids = make_case(rng, E, M, N, K, gs, bits, dtype)
    x_t = mx.array(np.array(x.astype(mx.float32)).T.copy()).astype(dtype).T  # strides (1, M)
    x_cols = mx.concatenate([x, x * 3.0], axis=1)[:, K:] / 3.0  # a column slice
    half_ids = mx.array(rng.integers(0, E // 2, size=M), dtype=mx.uint32)
    ids_strided = mx.stack([half_ids, half_ids + 7], axis=1).reshape(-1)[::2]
    cases = {
        "transposed x": (x_t, w, scales, biases, ids),
        "column-sliced x": (x_cols, w, scales, biases, ids),
        "strided indices, every other expert": (x, w[::2], scales[::2], biases[::2],
                                                ids_strided),
    }
    for what, case in cases.items():
        run_and_check(case, gs, bits, dtype, backend, variant, what=f" {what}")


@pytest.mark.parametrize("variant_name", VARIANTS)
def test_sizes_do_not_rebuild(monkeypatch, rng, variant_name):
    """M, E, N and K are runtime inputs. MLX passes an input of fewer than 8 elements in the
    constant address space, which generates another source: after one call per index dtype
    with M < 8 and one with M >= 8, new sizes on either side build no kernel object and
    compile nothing new: exactly one instantiation per (index dtype, address space of the
    ids) served the whole test (x, w and scales always hold at least 32 elements)."""
    require_backend("emulator")
    spec = op_module.VARIANT_SPECS[variant_name]
    kernel = backends.get_kernel(spec, "emulator")
    sources = record_emulator_sources(monkeypatch, kernel)
    with backends.use_backend("emulator"):
        for index_dtype in (mx.uint32, mx.int32):
            for M in (5, 8):
                run_and_check(make_case(rng, 4, M, 64, 64, 32, 8, mx.float16,
                                        index_dtype=index_dtype),
                              32, 8, mx.float16, "emulator", variant_name)
        built = backends.built_kernels()
        warm = set(sources)
        for E, M, N, K in ((7, 13, 32, 96), (3, 1, 96, 64), (16, 9, 64, 160), (2, 7, 32, 32),
                           (5, 24, 64, 64), (9, 3, 32, 128)):
            for index_dtype in (mx.uint32, mx.int32):
                run_and_check(make_case(rng, E, M, N, K, 32, 8, mx.float16,
                                        index_dtype=index_dtype),
                              32, 8, mx.float16, "emulator", variant_name)
        assert backends.built_kernels() == built
        new = set(sources) - warm
        assert not new, f"new instantiations: {[input_space(src, 'indices') for src in new]}"
        assert sorted(input_space(src, "indices") for src in warm) == [
            (t, space) for t in ("int32_t", "uint32_t") for space in ("constant", "device")]


@pytest.mark.parametrize("variant_name", VARIANTS)
@pytest.mark.parametrize("bits", (4, 8))
def test_emulator_traffic_is_ideal(rng, variant_name, bits):
    """Bytes each buffer moved (emulator counters): every (tile, expert) run reads its
    expert's weight rows once, nothing for an out-of-range id, and writes each output once."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    E, N, K, gs, dtype = 6, 64, 256, 64, mx.bfloat16
    ids = [0, 0, 0, 1, 1, 2, 2, 2,  2, 2, 3, 9, 3, 5, 5, 5,  0, 5, 5]
    case = make_case(rng, E, len(ids), N, K, gs, bits, dtype, ids)
    with backends.use_backend("emulator"):
        run_and_check(case, gs, bits, dtype, "emulator", variant_name)
    stats = emulator.last_launch_stats()
    assert stats.kernel.startswith(f"mt_moe_gather_qmm_{variant_name}")
    tiles = [ids[i:i + 8] for i in range(0, len(ids), 8)]
    runs = sum(len({e for e in tile if e < E}) for tile in tiles)  # (tile, expert) pairs
    valid_rows = sum(e < E for e in ids)
    assert stats.bytes_read["w"] == runs * N * K * bits // 8
    if variant_name == "mpp":
        groups_per_row = K // gs  # one load per group
    else:  # one load per group per simdgroup range of 16-wide steps
        steps = K // 16
        groups_per_row = sum(
            len({step * 16 // gs for step in range(steps * sg // 4, steps * (sg + 1) // 4)})
            for sg in range(4))
    for name in ("scales", "biases"):
        assert stats.bytes_read[name] == runs * N * groups_per_row * dtype.size, name
    assert stats.bytes_read["x"] == valid_rows * K * dtype.size * (N // 32)
    assert stats.bytes_written["out"] == len(ids) * N * dtype.size
    assert stats.threadgroups == (N // 32) * 8 * len(tiles)


@pytest.mark.parametrize("variant_name", VARIANTS)
@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(rng, variant_name, seed):
    """Strict mode (no read of threadgroup memory before it is written) with the threads and
    threadgroups run in a permuted order: the result must not depend on either."""
    require_backend("emulator")

    ids = [0, 1, 0, 1, 2, 2, 5, 3,  3, 3, 0]
    case = make_case(rng, 4, len(ids), 64, 128, 32, 4, mx.float16, ids)
    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            run_and_check(case, 32, 4, mx.float16, "emulator", variant_name)


def test_empty_rows_do_not_dispatch(backend, rng):
    x, w, scales, biases, _ = make_case(rng, 2, 1, 32, 32, 32, 8, mx.float16)
    before = backends.launch_count()
    out = mt.moe_gather_qmm(x[:0], w, scales, biases, mx.zeros((0,), dtype=mx.uint32),
                            group_size=32, bits=8)
    assert out.shape == (0, 32) and out.dtype == mx.float16
    assert backends.launch_count() == before


def test_op_is_lazy_and_compiles(no_host_sync, rng):
    """No evaluation inside the op; it traces under mx.compile (reference backend)."""
    case = make_case(rng, 4, 8, 64, 64, 32, 4, mx.float32)


    with backends.use_backend("reference"):
        with no_host_sync():
            out = mt.moe_gather_qmm(*case, group_size=32, bits=4)
        want, mag = oracle(*case, 32, 4, mx.float32)
        assert_close(out, want, mx.float32, magnitude=mag)
        compiled = mx.compile(lambda *a: mt.moe_gather_qmm(*a, group_size=32, bits=4))
        assert_close(compiled(*case), want, mx.float32, magnitude=mag)
        case2 = make_case(rng, 4, 5, 64, 64, 32, 4, mx.float32, [3, 3, 0, 7, 1])
        want2, mag2 = oracle(*case2, 32, 4, mx.float32)
        got2 = to_f64(compiled(*case2))
        assert np.isnan(got2[3]).all()
        assert_close(np.delete(got2, 3, 0), np.delete(want2, 3, 0), mx.float32,
                     magnitude=np.delete(mag2, 3, 0))


def test_no_host_sync_in_the_op_module():
    """The op module never pulls data to the host (it stays lazy on every backend)."""
    source = inspect.getsource(op_module)
    for needle in (".item(", ".tolist(", "np.array(", "np.asarray(", "mx.eval(",
                   "mx.async_eval(", "import numpy"):
        assert needle not in source, needle


# ---- path selection ------------------------------------------------------------------

@pytest.mark.parametrize("mac, arch, ok", [
    ((26, 2), "applegpu_g17s", True),
    ((26, 3, 1), "applegpu_g17g", True),
    ((26, 2), "applegpu_g18p", True),
    ((26, 2), "applegpu_g17p", False),  # phone-class GPUs need generation 18
    ((26, 1), "applegpu_g17s", False),
    ((15, 5), "applegpu_g17s", False),
    ((26, 2), "applegpu_g16s", False),  # M4
    ((26, 2), "applegpu_g13g", False),  # M1
    ((26, 2), "", False),
])
def test_mpp_rule(monkeypatch, mac, arch, ok):
    monkeypatch.setattr(backends, "_metal_available", lambda: True)
    monkeypatch.setattr(_device, "macos_version", lambda: mac)
    monkeypatch.setattr(_device, "device_architecture", lambda: arch)
    reason = _device.metal_mpp_reason()
    assert (reason is None) == ok, reason
    assert op_module._select_variant(None, "metal").variant == ("mpp" if ok else "simdgroup")
    assert op_module._select_variant("simdgroup", "metal").variant == "simdgroup"
    if ok:
        assert op_module._select_variant("mpp", "metal").variant == "mpp"
    else:
        with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] variant 'mpp' is unavail"):
            op_module._select_variant("mpp", "metal")


@pytest.mark.parametrize("mac_ver, sysctl, want", [
    ("26.2", "", (26, 2)),
    ("15.6.1", "", (15, 6, 1)),
    ("16.0", "26.2\n", (26, 2)),  # the compatibility version of older-SDK builds
    ("16.0", "", (16, 0)),
    ("", "", ()),
])
def test_macos_version(monkeypatch, mac_ver, sysctl, want):
    monkeypatch.setattr(_device.platform, "mac_ver", lambda: (mac_ver, ("", "", ""), ""))
    monkeypatch.setattr(_device, "_sysctl", lambda name: sysctl)
    _device.macos_version.cache_clear()
    try:
        assert _device.macos_version() == want
    finally:
        _device.macos_version.cache_clear()


def test_variant_defaults_off_metal():
    assert op_module._select_variant(None, "emulator").variant == "simdgroup"
    assert op_module._select_variant("mpp", "emulator").variant == "mpp"
    assert op_module._select_variant(None, "cuda").variant == "simdgroup"
    with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] variant 'mpp' is unavailable on "
                                         r"the cuda backend"):
        op_module._select_variant("mpp", "cuda")


def test_mpp_unavailable_without_metal(monkeypatch):
    monkeypatch.setattr(backends, "_metal_available", lambda: False)
    assert _device.metal_mpp_reason() == "no Metal device"


def test_architecture_generation():
    gen = _device.architecture_generation
    assert gen("applegpu_g17s") == 17 and gen("applegpu_g13g") == 13
    assert gen("") == 0 and gen("ab") == 0 and gen("applegpu_gxxs") == 0


# ---- negative controls: a deliberately wrong variant must fail the harness -------------

# (what breaks, text replaced, replacement, ids of the case, what the harness must raise)
BREAKAGES = {
    "runs_share_one_expert": ("const bool same = uint(indices[row0 + r]) == e;",
                              "const bool same = true;", [0, 0, 1, 1, 1, 2, 3, 3],
                              "out of tolerance"),
    "rows_of_other_runs_stored": ("if (((run >> r) & 1u) != 0u) {", "if (true) {",
                                  [0, 0, 1, 1, 1, 2, 3, 3], None),
    # The poison of the emulator's outputs is NaN: only the write count sees this one.
    "nan_row_not_stored": ("= T(NAN);", ";", [0, 1, 9, 1, 2], "bytes written to out"),
    "no_expert_id_guard": ("if (e >= E) {", "if (false) {", [0, 1, 9, 1, 2], "OutOfBounds"),
    "no_ragged_row_mask": ("const uint rows_here = min(BM, M - row0);",
                           "const uint rows_here = BM;", [0, 0, 1, 1, 2], "OutOfBounds"),
}


@pytest.mark.parametrize("variant_name", VARIANTS)
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_negative_control(broken_kernel, rng, variant_name, breakage):
    """A deliberately broken kernel must fail the harness: wrong values, an output row
    written twice or a stray read (the emulator's bounds checks)."""
    backend = "emulator"
    require_backend(backend)
    from mlx_metaltile import emulator

    old, new, ids, expect = BREAKAGES[breakage]
    broken_kernel(op_module.VARIANT_SPECS[variant_name], (old, new))
    case = make_case(rng, 4, len(ids), 64, 64, 32, 8, mx.float32, ids)
    errors = (AssertionError, emulator.KernelHazard)
    with backends.use_backend(backend), pytest.raises(errors) as caught:
        run_and_check(case, 32, 8, mx.float32, backend, variant_name)
    if expect == "OutOfBounds":
        assert isinstance(caught.value, emulator.OutOfBoundsAccess), caught.value
    elif expect is not None:
        assert expect in str(caught.value), caught.value


def test_negative_control_reference_without_bias(monkeypatch, rng):
    """The oracle harness rejects a composite that forgets the biases."""
    real = op_module._reference

    def no_bias(x, w, scales, biases, indices, *args):
        return real(x, w, scales, mx.zeros_like(biases), indices, *args)

    monkeypatch.setattr(op_module, "_reference", no_bias)
    case = make_case(rng, 4, 8, 64, 64, 32, 8, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError,
                                                          match="out of tolerance"):
        run_and_check(case, 32, 8, mx.float32, "reference")


# ---- bad input -----------------------------------------------------------------------

def _ok(E=2, M=3, N=32, K=64, gs=32, bits=8, dtype=mx.float16):
    x = mx.zeros((M, K), dtype=dtype)
    w = mx.zeros((E, N, K * bits // 32), dtype=mx.uint32)
    s = mx.ones((E, N, K // gs), dtype=dtype)
    b = mx.zeros((E, N, K // gs), dtype=dtype)
    ids = mx.zeros((M,), dtype=mx.uint32)
    return x, w, s, b, ids


def _call(args, **kw):
    kw.setdefault("group_size", 32)
    kw.setdefault("bits", 8)
    return mt.moe_gather_qmm(*args, **kw)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda x, w, s, b, i: (x.astype(mx.int32), w, s, b, i), TypeError, "x must be float32"),
    (lambda x, w, s, b, i: (x, w, s.astype(mx.float32), b, i), TypeError,
     "scales must have x's dtype float16, got float32"),
    (lambda x, w, s, b, i: (x, w, s, b.astype(mx.bfloat16), i), TypeError,
     "biases must have x's dtype float16, got bfloat16"),
    (lambda x, w, s, b, i: (x, w.astype(mx.int32), s, b, i), TypeError, "w must be uint32"),
    (lambda x, w, s, b, i: (x, w, s, b, i.astype(mx.float32)), TypeError,
     "indices must be uint32 or int32, got float32"),
    (lambda x, w, s, b, i: (x[0], w, s, b, i), ValueError, "x must have at least 2 dimensions"),
    (lambda x, w, s, b, i: (x, w[0], s, b, i), ValueError, "w must have 3 dimensions, got 2"),
    (lambda x, w, s, b, i: (x, w, s, b, i[None]), ValueError,
     "indices must have 1 dimensions, got 2"),
    (lambda x, w, s, b, i: (x, w[:, :, :8], s, b, i), ValueError,
     r"w must have shape \(2, 32, 16\) for K=64 and bits=8"),
    (lambda x, w, s, b, i: (x, w, s[:, :, :1], b, i), ValueError,
     r"scales must have shape \(2, 32, 2\)"),
    (lambda x, w, s, b, i: (x, w, s, b[:1], i), ValueError, r"biases must have shape \(2, 32, 2\)"),
    (lambda x, w, s, b, i: (x, w, s, b, i[:2]), ValueError,
     r"indices must have shape \(3,\) \(one expert per row of x\), got \(2,\)"),
    (lambda x, w, s, b, i: (x, w[:, :16], s[:, :16], b[:, :16], i), None, None),  # N=16 below
    (lambda x, w, s, b, i: (x, w[:0], s[:0], b[:0], i), ValueError,
     "w must have at least one expert"),
    (lambda x, w, s, b, i: (x.tolist(), w, s, b, i), TypeError, "x must be an mx.array"),
    (lambda x, w, s, b, i: (x, w.astype(mx.float16), s, b, i), TypeError,
     r"w must be uint32 \(packed as mx.quantize returns it\), got float16"),
    (lambda x, w, s, b, i: (x, w, s, b, i.astype(mx.int64)), TypeError,
     "indices must be uint32 or int32, got int64"),
    (lambda x, w, s, b, i: (x, w, s.astype(mx.int32), b, i), TypeError,
     "scales must have x's dtype float16, got int32"),
    (lambda x, w, s, b, i: (x[:, :0], w, s, b, i), ValueError,
     "K \\(x.shape\\[1\\]\\) must be a positive multiple of the tile depth 32, got 0"),
    (lambda x, w, s, b, i: (x, w[:, :0], s[:, :0], b[:, :0], i), ValueError,
     r"w must have at least one expert and one row, got shape \(2, 0, 16\)"),
    (lambda x, w, s, b, i: (x, w[:1], s, b, i), ValueError,
     r"scales must have shape \(1, 32, 2\)"),
])
def test_bad_input(mutate, exc, match):
    args = mutate(*_ok())
    if exc is None:  # N = 16: not a multiple of 32
        exc, match = ValueError, "N \\(w.shape\\[1\\]\\) must be a multiple of 32, got 16"
    with pytest.raises(exc, match=r"^\[moe_gather_qmm\] " + match):
        _call(args)


def test_bad_k_tile_and_group():
    x, w, s, b, i = _ok(K=64)
    with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] K \(x.shape\[1\]\) must be a "
                                         r"positive multiple of the tile depth 32, got 48"):
        _call((x[:, :48], w, s, b, i))
    with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] K \(x.shape\[1\]\) must be a "
                                         r"multiple of group_size 128, got 64"):
        _call((x, w, s, b, i), group_size=128)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(bits=3), ValueError, r"bits must be one of \(4, 8\), got 3"),
    (dict(bits=8.0), TypeError, r"bits must be an int in \(4, 8\), got float"),
    (dict(bits=True), TypeError, r"bits must be an int in \(4, 8\), got bool"),
    (dict(group_size=16), ValueError, r"group_size must be one of \(32, 64, 128\), got 16"),
    (dict(variant="nax"), ValueError, r"variant must be None or one of \('simdgroup', 'mpp'\)"),
])
def test_bad_options(kw, exc, match):
    with pytest.raises(exc, match=r"^\[moe_gather_qmm\] " + match):
        _call(_ok(), **kw)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_requests_on_the_reference_backend(variant):
    """A kernel variant asked of the reference backend raises (as fp4_qmm does), rather
    than being dropped in silence; variant=None runs the composite."""
    args = _ok()
    with backends.use_backend("reference"):
        with pytest.raises(ValueError, match=rf"^\[moe_gather_qmm\] variant='{variant}' "
                                             r"needs a kernel backend \(metal, cuda, emulator\)"):
            _call(args, variant=variant)
        assert _call(args).shape == (args[0].shape[0], args[1].shape[1])


def test_mpp_request_on_cuda_raises(monkeypatch):
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "cuda")
    with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] variant 'mpp' is unavailable "
                                         r"on the cuda backend"):
        _call(_ok(), variant="mpp")


def test_mpp_request_on_metal_without_it_raises(monkeypatch):
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "metal")
    monkeypatch.setattr(backends, "_metal_available", lambda: True)
    monkeypatch.setattr(_device, "macos_version", lambda: (15, 6))
    with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] variant 'mpp' is unavailable "
                                         r"on the metal backend: needs macOS >= 26.2"):
        _call(_ok(), variant="mpp")


# ---- staging in T: exact, and every sum stays float -------------------------------------
#
# Row 0 of x holds 4096 at k = 0, 1 at k = 8 and -4096 at k = k_neg; every weight is 1
# (8-bit affine codes 1, scale 1, bias 0). Each product is exact and the float32 sum is 1;
# a sum rounded to half or bfloat between the terms loses the 1 (4097 is neither). K = 128:
# simdgroup 0 runs k 0..31, so k_neg = 16 puts all three terms in its float accumulator
# (three 8-wide slices) and k_neg = 32 puts -4096 in simdgroup 1's (the float partial sums).
SUM_CASES = {"accumulator": 16, "partial_sums": 32}


def check_float_sums(k_neg, dtype, backend):
    E, N, K, group_size, bits = 1, 32, 128, 32, 8
    xv = np.zeros((3, K))
    xv[0, [0, 8, k_neg]] = (4096.0, 1.0, -4096.0)
    xv[1, 8] = 1.0
    x = mx.array(xv.astype(np.float32)).astype(dtype)
    w = mx.array(np.full((E, N, K * bits // 32), 0x01010101, dtype=np.uint32))
    groups = (E, N, K // group_size)
    case = (x, w, mx.ones(groups, dtype=dtype), mx.zeros(groups, dtype=dtype),
            mx.array([0, 0, 0], dtype=mx.uint32))
    out = run_and_check(case, group_size, bits, dtype, backend, "simdgroup")
    want = np.repeat(np.array([[1.0], [1.0], [0.0]]), N, axis=1)
    np.testing.assert_array_equal(to_f64(out), want, err_msg="moe_gather_qmm float sums")


@pytest.mark.parametrize("where", SUM_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_staging_in_t_keeps_float_sums(kernel_backend, poisoned_outputs, dtype, where):
    """x and the weights staged in T, products and sums in float32: the exact result."""
    check_float_sums(SUM_CASES[where], dtype, kernel_backend)


# The sums rounded to T: in the accumulator, or while the partial sums are added.
SUM_BREAKS = {
    "accumulator": (("simdgroup_matrix<float, 8, 8> acc[BN / 8];",
                     "simdgroup_matrix<S, 8, 8> acc[BN / 8];"),
                    ("acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);",
                     "acc[j] = make_filled_simdgroup_matrix<S, 8, 8>(S(0.0f));"),
                    # T partial sums go to the W slices (T), as float ones did before
                    ("simdgroup_store(acc[j], sums + sg * SUMS_LD + j * 8, WS_LD);",
                     "simdgroup_store(acc[j], my_w + j * 8, WS_LD);"),
                    ("      v += sums[s * SUMS_LD + r * WS_LD + c];",
                     "      v += float(ws[s][r * WS_LD + c]);")),
    "partial_sums": (("      v += sums[s * SUMS_LD + r * WS_LD + c];",
                      "      v = float(T(v + sums[s * SUMS_LD + r * WS_LD + c]));"),),
}


@pytest.mark.parametrize("where", SUM_BREAKS)
@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("float16", "bfloat16"))
def test_negative_control_sums_rounded_to_t(kernel_backend, broken_kernel, dtype, where):
    broken_kernel(op_module.SIMDGROUP_SPEC, *SUM_BREAKS[where])
    with pytest.raises(AssertionError, match="out of tolerance|float sums"):
        check_float_sums(SUM_CASES[where], dtype, kernel_backend)


# ---- the x-VJP kernel (moe_gather_qmm_dx) ------------------------------------------------

from mlx_metaltile.cases.moe_gather_qmm import (  # noqa: E402
    dx_oracle,
    dx_slicing,
    make_fp_weights,
    make_weights,
    run_and_check_dx,
)

# (mode, bits, group_size): every quantization the op accepts
QUANTS = [("affine", b, gs) for b in (4, 8) for gs in (32, 64, 128)] + [
    ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
QUANT_IDS = [f"{m}-b{b}-gs{gs}" if m == "affine" else m for m, b, gs in QUANTS]


@pytest.fixture
def dx_sort_from_32(monkeypatch):
    """DX_SORT_MIN_ROWS = 32 inside the test, plans built with it forgotten after."""
    from mlx_metaltile.ops._common import clear_plans

    monkeypatch.setattr(op_module, "DX_SORT_MIN_ROWS", 32)
    clear_plans()
    yield
    clear_plans()


def dx_inputs(rng, E, M, N, K, mode, bits, gs, dtype):
    """Random weights of ``mode`` (affine scales of both signs, nvfp4 scales of any sign) and
    a cotangent g [M, N] in ``dtype``."""
    if mode == "affine":
        w, scales, biases = make_weights(rng, E, N, K, gs, bits, dtype)
    else:
        w, scales, biases = make_fp_weights(rng, E, N, K, mode)
    g = mx.array(rng.standard_normal((M, N)).astype(np.float32)).astype(dtype)
    return g, w, scales, biases


def dx_shapes(gs):
    """(what, E, M, N, K, ids, index dtype): M = 1, 5, 33; the smallest K (one group, at
    least 32) and N (32); K ragged against the 32-word chunks (32 * 32 / bits values); N
    with more 32-row blocks than the launch's SIMD-groups; first, last, duplicated and
    unsorted ids, out of range (E, E + 3, negative int32)."""
    k_min = max(32, gs)
    k_ragged = 5 * 64 if gs <= 64 else 3 * 128  # 4-bit: 1.25 chunks; 8-bit: 2.5 / 3
    ids33 = [5, 0, 3, 3, 6, 1, 0, 5, 2, 9, 4, 4, 4, 0, 1, 5, 2, 2, 3, 0, 5, 1, 6, 4, 3, 3,
             0, 1, 2, 5, 5, 4, 0]
    return [
        ("M1 smallest", 4, 1, 32, k_min, [3], mx.uint32),
        ("M5 unsorted, negative id", 4, 5, 32 * 9, k_min * 2, [2, 0, -1, 2, 3], mx.int32),
        ("M33 ragged K", 6, 33, 96, k_ragged, ids33, mx.uint32),
    ]


@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dx_matches_oracle(dx_sort_from_32, backend, poisoned_outputs, rng, dtype, quant):
    """dx = g @ W[ids] (the weights rounded to x's dtype) against the float64 oracle; on
    the kernel backends the dx kernel runs once per VJP and writes every element once.
    M = 33 rows are sorted by expert around the kernel, M = 5 are not."""
    mode, bits, gs = quant
    for what, E, M, N, K, ids, index_dtype in dx_shapes(gs):
        g, w, scales, biases = dx_inputs(rng, E, M, N, K, mode, bits, gs, dtype)
        indices = mx.array(np.array(ids, dtype=np.int64), dtype=index_dtype)
        run_and_check_dx(g, w, scales, biases, indices, gs, bits, mode, dtype, backend,
                         what=f" {what}")


@pytest.mark.parametrize("min_blocks", (None, 1), ids=("plan", "one_block_per_slice"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dx_gather_qmm_form(backend, poisoned_outputs, rng, dtype, min_blocks):
    """mx.gather_qmm's form: x [1, 3, K] broadcast against indices [4]: the kernel's rows
    summed over the broadcast axis (float32, then x's dtype); N split in 2 slices too."""
    if backend == "reference" and min_blocks is not None:
        pytest.skip("the reference backend has no slices")
    E, N, K, gs, bits = 5, 64, 128, 64, 4
    g, w, scales, biases = dx_inputs(rng, E, 12, N, K, "affine", bits, gs, dtype)
    g = g.reshape(4, 3, N)
    ids = np.array([4, 0, 4, 2], dtype=np.uint32)
    x = mx.zeros((1, 3, K), dtype=dtype)
    before = backends.launch_count(op_module.DX_SPEC.name, backend)
    with dx_slicing(min_blocks):
        assert op_module.dx_slices(12, N, K, bits, backend) == (1 if min_blocks is None else 2)
        _, (dx,) = mx.vjp(lambda x: mt.moe_gather_qmm(x, w, scales, biases, mx.array(ids),
                                                      group_size=gs, bits=bits), [x], [g])
        mx.eval(dx)
    if backend != "reference":
        assert backends.launch_count(op_module.DX_SPEC.name, backend) == before + 1
    rows, mag = dx_oracle(g.reshape(12, N), w, scales, biases, np.repeat(ids, 3), gs, bits,
                          "affine", dtype)
    assert dx.dtype == dtype and dx.shape == (1, 3, K)
    assert_close(dx, rows.reshape(4, 3, K).sum(0)[None], dtype,
                 np.abs(mag).reshape(4, 3, K).sum(0)[None], what="dx (broadcast form)")


def dx_rounding_case(dtype):
    """Two weight rows whose float32 values differ but round to the same T: row 0 is
    3 * (1 + 2^-p) (scale 1 + 2^-p, code 3, bias 0), a tie of T (p + 1 significant bits)
    rounded to even, 3 + 2^-(p-2); row 1 is that value exactly (scale 1, code 3, bias
    2^-(p-2)). With g = (1, -1, 0, ...) dx is 0 in T, and -2^-p with float32 weights. p = 10
    (float16), 7 (bfloat16), 23 (float32, where the weights are the float32 values)."""
    p = {mx.float16: 10, mx.bfloat16: 7, mx.float32: 23}[dtype]
    E, N, K, gs, bits = 1, 32, 32, 32, 8
    w = mx.array(np.full((E, N, K * bits // 32), 0x03030303, dtype=np.uint32))
    scales = np.ones((E, N, 1))
    biases = np.zeros((E, N, 1))
    scales[0, 0, 0] = 1 + 2.0**-p
    biases[0, 1, 0] = 2.0**-(p - 2)
    gv = np.zeros((2, N))
    gv[0, :2] = (1.0, -1.0)
    gv[1, 0] = 1.0
    as_t = [mx.array(a.astype(np.float32)).astype(dtype) for a in (scales, biases, gv)]
    return as_t[2], w, as_t[0], as_t[1], mx.array([0, 0], dtype=mx.uint32), gs, bits


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dx_weights_rounded_to_t(kernel_backend, poisoned_outputs, dtype):
    g, w, scales, biases, ids, gs, bits = dx_rounding_case(dtype)
    dx = run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype, kernel_backend)
    if dtype != mx.float32:
        assert (to_f64(dx)[0] == 0).all()


@pytest.mark.parametrize("rows, sort_min, min_blocks",
                         [(1, 2, None), (4, 2, None), (4, 64, None), (1, 2, 1), (4, 2, 1),
                          (4, 64, 1)],
                         ids=("one_row", "sorted_tiles", "tiles_as_given", "one_row_sliced",
                              "sorted_tiles_sliced", "tiles_as_given_sliced"))
def test_dx_reads_each_expert_once(monkeypatch, rng, rows, sort_min, min_blocks):
    """Emulator counters: each run (the rows of one expert in a tile of DX_ROWS rows, after
    the sort by expert from DX_SORT_MIN_ROWS rows) reads its expert's words, scales and
    biases exactly once, each of its rows its g row once per 32-word chunk of K, in all
    (N split in slices: each slice its own rows of W and columns of g); an invalid row
    reads none of them; every element of every slice's partial is written once."""
    require_backend("emulator")
    from mlx_metaltile import emulator
    from mlx_metaltile.ops._common import clear_plans

    monkeypatch.setattr(op_module, "DX_ROWS", rows)
    monkeypatch.setattr(op_module, "DX_SORT_MIN_ROWS", sort_min)
    clear_plans()
    E, N, K, gs, bits, dtype = 4, 96, 320, 32, 4, mx.bfloat16
    ids = [1, 1, 7, 0, 3, 3, 3, 5, 2, 1]
    g, w, scales, biases = dx_inputs(rng, E, len(ids), N, K, "affine", bits, gs, dtype)
    indices = mx.array(ids, dtype=mx.uint32)
    with backends.use_backend("emulator"), dx_slicing(min_blocks):
        slices = op_module.dx_slices(len(ids), N, K, bits, "emulator")
        run_and_check_dx(g, w, scales, biases, indices, gs, bits, "affine", dtype, "emulator")
    clear_plans()
    assert slices == (1 if min_blocks is None else N // 32)
    stats = emulator.last_launch_stats()
    assert stats.kernel.startswith(f"mt_{op_module.DX_SPEC.name}")
    in_order = sorted(ids) if rows > 1 and len(ids) >= sort_min else ids  # as launched
    tiles = [in_order[i:i + rows] for i in range(0, len(ids), rows)]
    runs = sum(len({e for e in tile if e < E}) for tile in tiles)
    valid = sum(0 <= e < E for e in ids)
    chunks = -(-(K * bits // 32) // 32)
    assert stats.bytes_read["w"] == runs * N * K * bits // 8
    for name in ("scales", "biases"):
        assert stats.bytes_read[name] == runs * N * (K // gs) * dtype.size, name
    assert stats.bytes_read["g"] == valid * chunks * N * dtype.size
    # ids: each thread its slot's, and a valid slot's the tile's (the run)
    per_thread = sum(1 + (len(tile) if e < E else 0) for tile in tiles for e in tile)
    threads = 32 * op_module.DX_SIMDGROUPS
    assert stats.bytes_read["indices"] == per_thread * chunks * slices * threads * 4
    assert stats.bytes_written["dx"] == slices * len(ids) * K * 4
    assert stats.threadgroups == len(tiles) * rows * chunks * slices


@pytest.mark.parametrize("min_blocks", (None, 2), ids=("plan", "sliced"))
@pytest.mark.parametrize("seed", (1, 2))
def test_dx_strict_shuffled_bitwise(rng, seed, min_blocks):
    """Strict mode (no read of threadgroup memory before it is written), threads and
    threadgroups in a permuted order: the fixed summation order gives the same bits (N's
    9 blocks in one slice, or in 4 slices of 3, 2, 2, 2 blocks)."""
    require_backend("emulator")
    E, N, K, gs, bits, dtype = 3, 288, 256, 64, 8, mx.float16
    ids = mx.array([2, 0, 2, 1, 0, 1, 1], dtype=mx.uint32)
    g, w, scales, biases = dx_inputs(rng, E, 7, N, K, "affine", bits, gs, dtype)
    with backends.use_backend("emulator"), dx_slicing(min_blocks):
        plain = run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype,
                                 "emulator")
        with strict_emulator(seed):
            shuffled = run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype,
                                        "emulator")
    assert np.array_equal(to_f64(plain), to_f64(shuffled))


def test_dx_geometry_constants(monkeypatch, rng):
    """DX_SIMDGROUPS / DX_UNROLL / DX_ROWS / DX_SLICE_TARGET_TGS / DX_MIN_SLICE_BLOCKS are
    read once per plan: other values (after clear_plans) launch that geometry and give the
    same bits (each row's sums keep their order: here each SIMD-group holds one 32-row
    block, so the SG partials are p0 + p1 + 0 ... whether the two blocks share a slice or
    not, and a row's products are added in the same order whichever tile or run it falls
    in); values out of range are refused."""
    require_backend("emulator")
    from mlx_metaltile.ops._common import clear_plans

    E, N, K, gs, bits, dtype = 3, 64, 128, 32, 4, mx.bfloat16
    ids = mx.array([1, 2, 0, 1, 1, 2, 7], dtype=mx.uint32)
    g, w, scales, biases = dx_inputs(rng, E, 7, N, K, "affine", bits, gs, dtype)
    results = []
    with backends.use_backend("emulator"):
        for sg, unroll, rows, sort_min, slices in (
                (8, 8, 4, 64, 1), (2, 1, 1, 2, 1), (2, 32, 2, 2, 1), (4, 4, 32, 2, 1),
                (2, 8, 4, 64, 1), (8, 8, 4, 64, 2), (2, 1, 1, 2, 2), (4, 4, 32, 2, 2)):
            monkeypatch.setattr(op_module, "DX_SIMDGROUPS", sg)
            monkeypatch.setattr(op_module, "DX_UNROLL", unroll)
            monkeypatch.setattr(op_module, "DX_ROWS", rows)
            monkeypatch.setattr(op_module, "DX_SORT_MIN_ROWS", sort_min)
            # 7 rows x 1 chunk: `slices` working threadgroups per (row, chunk)
            monkeypatch.setattr(op_module, "DX_SLICE_TARGET_TGS", {"emulator": slices * 7})
            monkeypatch.setattr(op_module, "DX_MIN_SLICE_BLOCKS", 1)
            clear_plans()
            assert op_module.dx_slices(7, N, K, bits, "emulator") == slices
            results.append(to_f64(run_and_check_dx(g, w, scales, biases, ids, gs, bits,
                                                   "affine", dtype, "emulator")))
        monkeypatch.setattr(op_module, "DX_UNROLL", 3)
        clear_plans()
        with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] DX_SIMDGROUPS"):
            run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype,
                             "emulator")
        monkeypatch.setattr(op_module, "DX_UNROLL", 8)
        for targets, min_blocks in (({"emulator": 0}, 1), ({"emulator": 8}, 0),
                                    ({"emulator": 8.0}, 1), ([("emulator", 8)], 1),
                                    ({"emulator": True}, 1)):
            monkeypatch.setattr(op_module, "DX_SLICE_TARGET_TGS", targets)
            monkeypatch.setattr(op_module, "DX_MIN_SLICE_BLOCKS", min_blocks)
            clear_plans()
            with pytest.raises(ValueError, match=r"^\[moe_gather_qmm\] DX_SLICE_TARGET_TGS"):
                run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype,
                                 "emulator")
    clear_plans()
    assert all(np.array_equal(results[0], r, equal_nan=True) for r in results[1:])


# A deliberately broken dx kernel must fail the harness: (edit, case, what must be raised).
DX_BREAKAGES = {
    "weights_not_rounded_to_t": (
        ("return ROUND ? mt_round2<T>(v) : v;", "return v;"), "rounding", None),
    # the random case's ids [0, 3, 1, 3, 9]: the first tile of 4 holds 3 runs
    "runs_share_one_expert": (
        ("const bool same = uint(indices[row0 + r]) == e;", "const bool same = true;"),
        "random", "out of tolerance"),
    "run_rows_not_stored": (
        ("  if (((run >> r) & 1u) == 0u) {\n    continue;",
         "  if (r != slot) {\n    continue;"), "random", None),
    "last_word_dropped": (
        ("const bool live = word0 + lane < words_per_row;",
         "const bool live = word0 + lane + 1 < words_per_row;"), "random", "out of tolerance"),
    "wrong_group": (
        ("const ushort src = ushort(lane / GROUP_WORDS);", "const ushort src = ushort(0);"),
        "random", "out of tolerance"),
    "last_simdgroup_partial_dropped": (
        ("for (uint s = 1; s < SG; ++s) {", "for (uint s = 1; s + 1 < SG; ++s) {"),
        "random", "out of tolerance"),
    "nan_row_not_stored": (
        ("dx_nan[o] = metal::numeric_limits<float>::quiet_NaN();", "continue;"),
        "random", "bytes written to dx"),
    "no_expert_id_guard": (("if (e >= n_experts) {", "if (false) {"), "random",
                           "OutOfBounds"),
}


@pytest.mark.parametrize("breakage", list(DX_BREAKAGES))
def test_dx_negative_control(broken_kernel, rng, breakage):
    require_backend("emulator")
    from mlx_metaltile import emulator

    edit, case, expect = DX_BREAKAGES[breakage]
    broken_kernel(op_module.DX_SPEC, edit)
    dtypes = (mx.float16, mx.bfloat16) if case == "rounding" else (mx.float32,)
    for dtype in dtypes:
        if case == "rounding":
            g, w, scales, biases, ids, gs, bits = dx_rounding_case(dtype)
        else:
            E, N, K, gs, bits = 4, 32 * 9, 320, 32, 4
            ids = mx.array([0, 3, 1, 3, 9], dtype=mx.uint32)
            g, w, scales, biases = dx_inputs(rng, E, 5, N, K, "affine", bits, gs, dtype)
        errors = (AssertionError, emulator.KernelHazard)
        with backends.use_backend("emulator"), pytest.raises(errors) as caught:
            run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype, "emulator")
        if expect == "OutOfBounds":
            assert isinstance(caught.value, emulator.OutOfBoundsAccess), caught.value
        elif expect is not None:
            assert expect in str(caught.value), caught.value
        else:  # wrong values or unwritten (NaN-poisoned) elements
            assert "out of tolerance" in str(caught.value) or "NaN row" in str(
                caught.value), caught.value


def test_dx_instantiations_cover_the_launches(launch_recorder, rng):
    """Every dx launch (each dtype, quantization and index dtype) is an instantiation
    DX_SPEC declares (what the CUDA compile check builds); recorded, nothing runs."""
    for dtype in DTYPES:
        for mode, bits, gs in QUANTS:
            g, w, scales, biases = dx_inputs(rng, 3, 9, 32, 128, mode, bits, gs, dtype)
            x = mx.zeros((9, 128), dtype=dtype)
            for index_dtype in (mx.uint32, mx.int32):
                ids = mx.array([0, 2, 1, 1, 0, 2, 2, 1, 0], dtype=index_dtype)
                forward = functools.partial(mt.moe_gather_qmm, w=w, scales=scales,
                                            biases=biases, indices=ids, group_size=gs,
                                            bits=bits, mode=mode)
                mx.vjp(forward, [x], [g])
    names = [name for name, *_ in launch_recorder.seen]
    assert names.count(op_module.DX_SPEC.name) == 3 * len(QUANTS) * 2
    launch_recorder.assert_declared()


# ---- the dx kernel's N split in slices (grid z, partials summed after) --------------------

# The fewest 32-row blocks per slice forced on the kernel backends (a huge target): one
# block per slice, or 2 or more (N's blocks shared unevenly: 9 blocks in 4 slices of 3, 2, 2,
# 2; 7 in 3 of 3, 2, 2).
DX_SLICINGS = {"one_block_per_slice": 1, "two_blocks_or_more": 2}
SLICED_QUANTS = [("affine", 4, 64), ("affine", 8, 32), ("mxfp4", 4, 32)]


@pytest.fixture(params=list(DX_SLICINGS))
def dx_sliced(request):
    """N split in slices on every kernel backend inside the test: the fewest blocks a slice
    takes."""
    with dx_slicing(DX_SLICINGS[request.param]):
        yield DX_SLICINGS[request.param]


@pytest.mark.parametrize("quant", SLICED_QUANTS, ids=[f"{m}-b{b}-gs{gs}" for m, b, gs in
                                                      SLICED_QUANTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dx_sliced_matches_oracle(dx_sort_from_32, dx_sliced, kernel_backend,
                                  poisoned_outputs, rng, dtype, quant):
    """dx_shapes (M = 1, 5, 33; out-of-range and negative ids; M = 33 sorted by expert) and
    ragged M = 7 with duplicated unsorted ids in tiles of DX_ROWS (runs), N split in slices;
    the partials' NaN poison proves each slice wrote its own place."""
    mode, bits, gs = quant
    ids7 = [2, 0, 2, 2, 5, 1, 1]
    shapes = dx_shapes(gs) + [("M7 runs", 4, 7, 32 * 7, max(64, gs), ids7, mx.int32)]
    for what, E, M, N, K, ids, index_dtype in shapes:
        slices = op_module.dx_slices(M, N, K, bits, kernel_backend)
        assert slices == max(1, N // 32 // dx_sliced)
        g, w, scales, biases = dx_inputs(rng, E, M, N, K, mode, bits, gs, dtype)
        indices = mx.array(np.array(ids, dtype=np.int64), dtype=index_dtype)
        run_and_check_dx(g, w, scales, biases, indices, gs, bits, mode, dtype,
                         kernel_backend, what=f" {what}, {slices} slices")


# The kernel's block loop and output as they were before slices (one walk over all of N).
DX_UNSPLIT = (
    ("for (uint n0 = (block_begin + sg) * 32; n0 < block_end * 32; n0 += SG * 32) {",
     "for (uint n0 = sg * 32; n0 < N; n0 += SG * 32) {"),
    ("dx + (size_t(slice) * M + row0 + slot) * K + k0", "dx + size_t(row0 + slot) * K + k0"),
    ("dx + (size_t(slice) * M + row0 + r) * K + k0", "dx + size_t(row0 + r) * K + k0"),
)


def test_dx_one_slice_is_the_unsplit_kernel(kernel_backend, rng):
    """One slice (the plan off cuda) gives the bits of the kernel without slices: the same
    blocks per SIMD-group in the same order (19 blocks: 2 or 3 per SIMD-group)."""
    E, N, K, gs, bits, dtype = 3, 32 * 19, 256, 64, 4, mx.bfloat16
    ids = mx.array([2, 0, 7, 2, 1, 1], dtype=mx.uint32)
    g, w, scales, biases = dx_inputs(rng, E, 6, N, K, "affine", bits, gs, dtype)
    with dx_slicing(None):
        op_module.DX_SLICE_TARGET_TGS = {}  # one slice on every backend (restored on exit)
        assert op_module.dx_slices(6, N, K, bits, kernel_backend) == 1
        split = run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype,
                                 kernel_backend)
        with backends.template_override(op_module.DX_SPEC, *DX_UNSPLIT):
            unsplit = run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype,
                                       kernel_backend)
    assert np.array_equal(to_f64(split), to_f64(unsplit), equal_nan=True)


def test_dx_sliced_is_reproducible(kernel_backend, rng):
    """A sliced dx (19 blocks in 9 slices of 3, 2, ... blocks), run twice: the same bits."""
    E, N, K, gs, bits, dtype = 3, 32 * 19, 256, 64, 4, mx.float16
    ids = mx.array([2, 0, 7, 2, 1, 1], dtype=mx.uint32)
    g, w, scales, biases = dx_inputs(rng, E, 6, N, K, "affine", bits, gs, dtype)
    with dx_slicing(2):
        assert op_module.dx_slices(6, N, K, bits, kernel_backend) == 9
        first, second = (to_f64(run_and_check_dx(g, w, scales, biases, ids, gs, bits,
                                                 "affine", dtype, kernel_backend))
                         for _ in range(2))
    assert np.array_equal(first, second, equal_nan=True)


@pytest.mark.parametrize("seed", (None, 3))
def test_dx_empty_slices_are_safe(monkeypatch, rng, seed):
    """More slices than N's blocks (the plan never makes one: 2 blocks, 5 slices): the empty
    slices walk no block, reach every barrier and write zero partials, so dx is still right
    (strict mode, threads shuffled or not)."""
    require_backend("emulator")
    E, N, K, gs, bits, dtype = 3, 64, 128, 64, 4, mx.float32
    ids = mx.array([2, 5, 0, 2], dtype=mx.int32)
    g, w, scales, biases = dx_inputs(rng, E, 4, N, K, "affine", bits, gs, dtype)
    with dx_slicing(None), backends.use_backend("emulator"), strict_emulator(seed):
        monkeypatch.setattr(op_module, "dx_slices", lambda *shape: 5)
        run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype, "emulator")


# A broken split of N must fail the harness (the random case: 9 blocks in 4 slices).
DX_SLICE_BREAKAGES = {
    "slices_share_slice_0s_place": (
        "dx + (size_t(slice) * M + row0 + r) * K + k0", "dx + size_t(row0 + r) * K + k0"),
    "every_slice_walks_all_blocks": (
        "n0 = (block_begin + sg) * 32; n0 < block_end * 32;", "n0 = sg * 32; n0 < N;"),
    "longer_slices_lose_their_extra_block": (
        "block_begin + slice_blocks + (slice < longer_slices ? 1u : 0u);",
        "block_begin + slice_blocks;"),
}


@pytest.mark.parametrize("breakage", list(DX_SLICE_BREAKAGES))
def test_dx_slice_negative_control(broken_kernel, rng, breakage):
    require_backend("emulator")
    from mlx_metaltile import emulator

    broken_kernel(op_module.DX_SPEC, DX_SLICE_BREAKAGES[breakage])
    E, N, K, gs, bits, dtype = 4, 32 * 9, 320, 32, 4, mx.float32
    ids = mx.array([0, 3, 1, 3, 9], dtype=mx.uint32)
    g, w, scales, biases = dx_inputs(rng, E, 5, N, K, "affine", bits, gs, dtype)
    with backends.use_backend("emulator"), dx_slicing(2), \
            pytest.raises((AssertionError, emulator.KernelHazard)) as caught:
        assert op_module.dx_slices(5, N, K, bits, "emulator") == 4
        run_and_check_dx(g, w, scales, biases, ids, gs, bits, "affine", dtype, "emulator")
    assert "out of tolerance" in str(caught.value) or "NaN row" in str(caught.value) or \
        isinstance(caught.value, emulator.KernelHazard), caught.value


def test_dx_slice_plan():
    """cuda splits N at the decode shapes that leave its SMs idle (Qwen3-30B-A3B's down
    projection: 8 pairs, N 2048, K 768, 4-bit; gpt-oss-20b: 16 pairs, N = K = 2880,
    mxfp4), each slice DX_MIN_SLICE_BLOCKS blocks or more; Metal, the emulator and the
    reference take one slice; so does a grid already at the target (prefill). Never more
    slices than CUDA's grid z takes."""
    slices = op_module.dx_slices
    min_blocks = op_module.DX_MIN_SLICE_BLOCKS
    for M, N, K in ((8, 2048, 768), (16, 2880, 2880)):
        assert slices(M, N, K, 4, "cuda") > 1
        assert all(slices(M, N, K, 4, b) == 1 for b in ("metal", "emulator", "reference"))
    assert slices(4096, 2048, 768, 4, "cuda") == 1
    target = op_module.DX_SLICE_TARGET_TGS["cuda"]
    for M in (1, 2, 8, 33, 512):
        for N in (1, 31, 32, 33, 96, 2048, 2880, 10**5):
            for K, bits in ((64, 4), (768, 4), (2880, 8)):
                n = slices(M, N, K, bits, "cuda")
                blocks = -(-N // 32)
                working = M * -(-(K * bits // 32) // 32)
                assert n >= 1 and (n == 1 or n * min_blocks <= blocks), (M, N, K, n)
                assert (n - 1) * working < target, (M, N, K, n)  # the fewest that reach it
                assert n * working >= target or (n + 1) * min_blocks > blocks, (M, N, K, n)
    with dx_slicing(1):
        assert slices(1, 2**31 - 1, 64, 4, "cuda") == 65535


# ---- the GEMV plan (few rows per expert: expert_qmv.metal with ROUND) ---------------------

@pytest.fixture
def gemv(kernel_backend):
    """The GEMV for every row count on the kernel backend (GEMV_ROWS_PER_EXPERT)."""
    with gemv_plan(kernel_backend, 1e9):
        yield kernel_backend


def test_gemv_plan_choice():
    """cuda's default: below 4 rows per expert, with variant None only; other backends keep
    the tiled kernels."""
    assert op_module.GEMV_ROWS_PER_EXPERT == {"cuda": 4}
    uses = op_module.uses_gemv
    assert uses(8, 128, "cuda", None) and uses(511, 128, "cuda", None)
    assert not uses(512, 128, "cuda", None) and not uses(0, 128, "cuda", None)
    assert not uses(8, 128, "cuda", "simdgroup")
    assert not any(uses(8, 128, b, None) for b in ("metal", "emulator", "reference"))


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemv_matches_oracle(gemv, poisoned_outputs, rng, dtype, bits):
    """The GEMV against the float64 oracle on the shapes that break kernels (M = 1, ragged,
    unsorted and repeated ids, first / last expert, out-of-range ids, int32 with negative
    ids); the plan's kernel ran (run_and_check's launch counters)."""
    for shape, (E, M, N, K, gs, ids) in SHAPES.items():
        case = make_case(rng, E, M, N, K, gs, bits, dtype, ids)
        run_and_check(case, gs, bits, dtype, gemv, None, what=f" gemv {shape}")
    ids = np.array([-1, 0, 3, 1, 2, 0, 3, -5, 3], dtype=np.int32)
    case = make_case(rng, 4, 9, 64, 64, 32, bits, dtype, ids, index_dtype=mx.int32)
    run_and_check(case, 32, bits, dtype, gemv, None, what=" gemv int32 ids")


def gemv_rounding_case(dtype):
    """x = (1 at k = 0, -1 at k = 32) against one weight row whose two groups hold
    3 * (1 + 2^-p) (scale 1 + 2^-p, code 3), a tie of T rounded to even to 3 + 2^-(p-2),
    and 3 + 2^-(p-2) itself (scale 1, code 3, bias 2^-(p-2)): 0 with the weights rounded to
    T, -2^-p with float32 weights (p as dx_rounding_case)."""
    p = {mx.float16: 10, mx.bfloat16: 7, mx.float32: 23}[dtype]
    E, N, K, gs, bits = 1, 32, 64, 32, 8
    w = mx.array(np.full((E, N, K * bits // 32), 0x03030303, dtype=np.uint32))
    scales, biases = np.ones((E, N, 2)), np.zeros((E, N, 2))
    scales[0, :, 0] = 1 + 2.0**-p
    biases[0, :, 1] = 2.0**-(p - 2)
    xv = np.zeros((1, K))
    xv[0, [0, 32]] = (1.0, -1.0)
    x, scales, biases = (mx.array(a.astype(np.float32)).astype(dtype)
                         for a in (xv, scales, biases))
    return (x, w, scales, biases, mx.array([0], dtype=mx.uint32)), gs, bits


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemv_weights_rounded_to_t(gemv, poisoned_outputs, dtype):
    case, gs, bits = gemv_rounding_case(dtype)
    out = run_and_check(case, gs, bits, dtype, gemv, None, what=" gemv rounding")
    if dtype != mx.float32:
        assert (to_f64(out) == 0).all(), to_f64(out)


def test_gemv_negative_control_unrounded_weights(broken_kernel, poisoned_outputs):
    """Weights left in float32 (expert_qmv's own contract) fail the rounding case."""
    require_backend("emulator")
    broken_kernel(op_module.GEMV_SPEC, (
        "mt_round2<T>(float2(metal::fma(s, q0, b), metal::fma(s, q1, b)))",
        "float2(metal::fma(s, q0, b), metal::fma(s, q1, b))"))
    case, gs, bits = gemv_rounding_case(mx.bfloat16)
    with backends.use_backend("emulator"), gemv_plan("emulator", 1e9), pytest.raises(
            AssertionError, match="out of tolerance"):
        run_and_check(case, gs, bits, mx.bfloat16, "emulator", None)


@pytest.mark.parametrize("bits", (4, 8))
def test_gemv_negative_control_wrong_shuffle(broken_kernel, poisoned_outputs, rng, bits):
    """Every lane taking lane 0's group scale fails the oracle on both shuffle paths
    (PLAIN_SHUFFLES: 4-bit rows through simd_shuffle, 8-bit through the converged one)."""
    require_backend("emulator")
    broken_kernel(op_module.GEMV_SPEC,
                  ("const uint g = mt_qmv_shuffle<PLAIN_SHUFFLES>(group[r], src);",
                   "const uint g = mt_qmv_shuffle<PLAIN_SHUFFLES>(group[r], ushort(0));"))
    case = make_case(rng, 4, 5, 64, 256, 32, bits, mx.bfloat16, np.array([0, 3, 1, 3, 2]))
    with backends.use_backend("emulator"), gemv_plan("emulator", 1e9), pytest.raises(
            AssertionError, match="out of tolerance"):
        run_and_check(case, 32, bits, mx.bfloat16, "emulator", None)


def test_gemv_traffic(rng):
    """Emulator counters: each valid row reads its expert's words, scales and biases once
    (in any order: no sort), a row with an out-of-range id reads none, out written once."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    E, N, K, gs, bits, dtype = 4, 64, 128, 64, 4, mx.bfloat16
    ids = [3, 0, 3, 9, 1, 0]
    case = make_case(rng, E, len(ids), N, K, gs, bits, dtype, ids)
    with backends.use_backend("emulator"), gemv_plan("emulator", 1e9):
        run_and_check(case, gs, bits, dtype, "emulator", None)
    stats = emulator.last_launch_stats()
    valid = sum(i < E for i in ids)
    assert stats.bytes_read["w"] == valid * N * K * bits // 8
    assert stats.bytes_read["scales"] == stats.bytes_read["biases"] == valid * N * K // gs * 2
