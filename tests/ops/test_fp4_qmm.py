"""fp4_qmm against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import require_backend, strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import _device, backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.fp4_qmm import (
    dequantize64,
    make_case,
    make_scales,
    make_w,
    make_x,
    oracle,
    run_and_check,
    run_and_check_dx,
)
from mlx_metaltile.ops._common import clear_plans, tf32_split, variant_reason

op_module = importlib.import_module("mlx_metaltile.ops.fp4_qmm")
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
VARIANTS = tuple(op_module.VARIANT_SPECS)
# (scale kind, group size): the scale formats fp4_qmm accepts.
SCALE_KINDS = (("e8m0", 32), ("e4m3", 16), ("float32", 32), ("float16", 64),
               ("bfloat16", 128), ("float32", 16))
dtype_id = lambda d: str(d).rsplit(".", 1)[-1]  # noqa: E731
SCALE_MODES = {"e8m0": op_module.SCALE_E8M0, "e4m3": op_module.SCALE_E4M3, "float32":
               op_module.SCALE_FLOAT, "float16": op_module.SCALE_FLOAT,
               "bfloat16": op_module.SCALE_FLOAT}


@pytest.fixture
def no_split(monkeypatch):
    """The simdgroup kernel in one pass (no split-K), whatever the shape."""
    monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", 1)


def kernel_variant(backend: str, variant: str, dtype=None, kind: str = "e8m0",
                   group_size: int = 32) -> None:
    """Skip a variant the backend cannot run here (mpp needs an M5-class Mac or emulator MPP),
    or for x of ``dtype`` with ``kind`` scales of ``group_size`` (decoded: 16-bit x with
    uint8 scales; skinny: half / bfloat x, no float scales of group 16; their
    refusals elsewhere are tested apart)."""
    if variant == "decoded" and dtype is not None and op_module._decoded_dtype(
            dtype, SCALE_MODES[kind]) is None:
        pytest.skip(f"decoded: {dtype_id(dtype)} x with {kind} scales is refused")
    if variant == "skinny" and dtype is not None and not op_module._skinny_fits(
            dtype, SCALE_MODES[kind], group_size):
        pytest.skip(f"skinny: {dtype_id(dtype)} x with {kind}/{group_size} scales is refused")
    if variant == "mpp":
        reason = variant_reason(op_module.MPP_SPEC, backend)
        if reason is not None:
            pytest.skip(f"mpp on {backend}: {reason}")


# ---- the kernels against the oracle ---------------------------------------------------

@pytest.mark.parametrize("nk", (64, 128, 256), ids=lambda v: f"NK{v}")
@pytest.mark.parametrize("m", (1, 3, 8, 32, 33, 100), ids=lambda v: f"M{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_oracle(kernel_backend, poisoned_outputs, rng, variant, dtype, m, nk):
    kernel_variant(kernel_backend, variant, dtype)
    x, w, s = make_case(rng, m, nk, nk, dtype)
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("nk", (64, 128, 256))
@pytest.mark.parametrize("m", (1, 3, 8, 32, 33, 100))
def test_auto_matches_oracle(any_backend, poisoned_outputs, rng, m, nk):
    """Every M x N=K of the issue, through the automatic choice (bfloat16)."""
    x, w, s = make_case(rng, m, nk, nk, mx.bfloat16)
    expect = None
    if any_backend in ("emulator", "cuda"):
        expect = op_module._auto(any_backend, m, mx.bfloat16, op_module.SCALE_E8M0, 32)
    run_and_check(x, w, s, "e8m0", 32, any_backend, expect=expect)


@pytest.mark.parametrize("kind, group_size", SCALE_KINDS, ids=[f"{k}-g{g}" for k, g in SCALE_KINDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_scale_formats(kernel_backend, poisoned_outputs, rng, variant, dtype, kind, group_size):
    kernel_variant(kernel_backend, variant, dtype, kind, group_size)
    m = 5 if variant == "qmv" else 37
    x, w, s = make_case(rng, m, 64, 128, dtype, kind, group_size)
    run_and_check(x, w, s, kind, group_size, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("m, nk", ((9, 64), (33, 128), (100, 256)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_simdgroup_without_split(kernel_backend, poisoned_outputs, no_split, rng, dtype, m, nk):
    """The one-pass path (what large problems take): rows and columns of several tiles."""
    assert op_module._split_k(m, nk, nk) == (1, nk)
    x, w, s = make_case(rng, m, nk, nk, dtype)
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant="simdgroup", expect="simdgroup")


@pytest.mark.parametrize("m, n, k, parts, k_part", [
    (1, 64, 256, 8, 32), (33, 4096, 4096, 2, 2048), (32, 4096, 4096, 4, 1024),
    (40, 64, 96, 3, 32), (1, 32, 128, 4, 32), (512, 4096, 4096, 1, 4096),
    (32, 14336, 4096, 1, 4096),
    # ragged: the last part is shorter (K = 32 * 7, 32 * 5, 32 * 127)
    (9, 4096, 224, 4, 64), (9, 4096, 160, 3, 64), (33, 4096, 4064, 2, 2048),
])
def test_split_k(m, n, k, parts, k_part):
    """About 512 threadgroups (as MLX's qmm_splitk), parts of whole 32-steps, the last one
    possibly shorter, none empty."""
    assert op_module._split_k(m, n, k) == (parts, k_part)


def test_split_k_invariants():
    """For every shape: Kp a multiple of 32, the parts cover K, no part is empty, and no more
    threadgroups than the target once K is split (unless one part per tile already is)."""
    for m in (1, 9, 33, 100, 512):
        for n in (32, 64, 4096, 14336):
            for k in range(32, 4097, 32):
                parts, kp = op_module._split_k(m, n, k)
                tiles = (n // 32) * -(-m // 32)
                assert kp % 32 == 0 and parts * kp >= k > (parts - 1) * kp, (m, n, k)
                assert parts == 1 or tiles * parts <= op_module.SPLITK_TARGET_TGS, (m, n, k)


# (K, group size, scale kind, split target) -> ragged parts, some not aligned with the groups
RAGGED = [
    (160, 32, "e8m0", 6, 3, 64),       # 5 steps: 2 + 2 + 1
    (160, 16, "e4m3", 6, 3, 64),       # nvfp4 groups of 16
    (224, 32, "float32", 8, 4, 64),    # 7 steps: 2 + 2 + 2 + 1
    (448, 64, "float16", 10, 5, 96),   # 14 steps: 3 x 4 + 2; parts end inside groups of 64
    (640, 128, "bfloat16", 14, 7, 96),  # 20 steps: 3 x 6 + 2; inside groups of 128
]


@pytest.mark.parametrize("k, gs, kind, target, parts, k_part", RAGGED,
                         ids=[f"K{r[0]}-{r[2]}-g{r[1]}-p{r[4]}" for r in RAGGED])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_ragged_split_k(kernel_backend, poisoned_outputs, monkeypatch, rng, dtype, k, gs, kind,
                        target, parts, k_part):
    """Split-K with a shorter last part, through the tile kernel and the sum kernel."""
    monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", target)
    m, n = 9, 64
    assert op_module._split_k(m, n, k) == (parts, k_part) and k % k_part
    x, w, s = make_case(rng, m, n, k, dtype, kind, gs)
    run_and_check(x, w, s, kind, gs, kernel_backend, variant="simdgroup", expect="simdgroup")
    if kernel_backend == "emulator":
        from mlx_metaltile import emulator

        stats = emulator.last_launch_stats()  # the sum kernel read every part once
        assert stats.kernel.endswith("fp4_qmm_splitk_sum")
        assert stats.bytes_read["partial"] == parts * m * n * 4


@pytest.mark.parametrize("kind, group_size", SCALE_KINDS, ids=[f"{k}-g{g}" for k, g in SCALE_KINDS])
def test_reference_scale_formats(rng, kind, group_size):
    x, w, s = make_case(rng, 7, 64, 128, mx.bfloat16, kind, group_size, lead=(7,))
    with backends.use_backend("reference"):
        run_and_check(x, w, s, kind, group_size, "reference")


@pytest.mark.parametrize("variant", VARIANTS)
def test_float16_large_scales_do_not_overflow(kernel_backend, poisoned_outputs, rng, variant):
    """W up to 6 * 2^16 (past half's range) against small half activations: results O(100).

    A kernel that staged scaled weights in half would produce inf here."""
    kernel_variant(kernel_backend, variant, mx.float16)
    x = make_x(rng, (9,), 128, mx.float16, scale=2.0**-12)
    w = make_w(rng, 64, 128)
    s = mx.array((127 + rng.integers(12, 17, size=(64, 4))).astype(np.uint8))
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_scales_over_ninety_binades(kernel_backend, poisoned_outputs, rng, variant, dtype):
    """E8M0 exponents from 2^-60 to 2^30 in one matrix (float and bfloat16 ranges)."""
    kernel_variant(kernel_backend, variant, dtype)
    x, w = make_x(rng, (11,), 128, dtype), make_w(rng, 64, 128)
    s = make_scales(rng, 64, 128, "e8m0", 32, spread=60)
    assert np.ptp(np.array(s).astype(int)) > 60
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_leading_dims_and_non_contiguous_x(kernel_backend, poisoned_outputs, rng, variant):
    kernel_variant(kernel_backend, variant)
    dtype = mx.bfloat16 if variant == "decoded" else mx.float16  # decoded: exact in x's dtype
    base = make_x(rng, (2, 64, 5), 1, dtype).reshape(2, 64, 5)
    x = mx.swapaxes(mx.concatenate([base, base], axis=-1), 1, 2)  # [2, 10, 64], strided
    w, s = make_w(rng, 96, 64), make_scales(rng, 96, 64, "e8m0", 32)
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("offset", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("m", (1, 8, 33), ids=lambda v: f"M{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_x_at_any_element_offset(kernel_backend, poisoned_outputs, rng, variant, dtype, m,
                                 offset):
    """x a contiguous view starting `offset` elements into its buffer: the CUDA layer's
    wide loads of x (common.h's mt_load8 / mt_load_live) are taken only where the address
    is aligned, element by element elsewhere."""
    kernel_variant(kernel_backend, variant, dtype)
    x, w, s = make_case(rng, m, 64, 128, dtype)
    flat = mx.concatenate([mx.zeros((offset,), dtype=dtype), x.reshape(-1)])
    run_and_check(flat[offset:].reshape(x.shape), w, s, "e8m0", 32, kernel_backend,
                  variant=variant, expect=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_contiguous_w_and_scales(kernel_backend, poisoned_outputs, rng, variant):
    """Strided views of w and scales (every other row of a bigger matrix; a transposed copy
    transposed back) give the same results as their contiguous copies would (decoded:
    bfloat16 x and E8M0 scales, which it takes)."""
    kernel_variant(kernel_backend, variant)
    m = 3 if variant == "qmv" else 35
    kind, gs, dtype = ("e8m0", 32, mx.bfloat16) if variant == "decoded" else (
        "float16", 32, mx.float16 if variant == "skinny" else mx.float32)
    w_big, s_big = make_w(rng, 128, 128), make_scales(rng, 128, 128, kind, gs)
    w, s = w_big[::2], mx.swapaxes(mx.swapaxes(s_big, 0, 1)[:, 1::2], 0, 1)  # [64, 16], [64, 4]
    x = make_x(rng, (m,), 128, dtype)
    run_and_check(x, w, s, kind, gs, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_large_activations(kernel_backend, poisoned_outputs, rng, variant):
    """bfloat16 x far outside half's range (|x| up to ~2^40) and tiny (~2^-40): the matmul
    takes x in its own dtype, nothing rounds or overflows it through half."""
    kernel_variant(kernel_backend, variant)
    m = 6 if variant == "qmv" else 40
    mag = np.exp2(rng.integers(-40, 41, size=(m, 1))).astype(np.float32)
    x = mx.array(rng.standard_normal((m, 128)).astype(np.float32) * mag).astype(mx.bfloat16)
    w, s = make_w(rng, 64, 128), make_scales(rng, 64, 128, "e8m0", 32)
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant, expect=variant)


@pytest.mark.parametrize("lead", ((0,), (2, 0), (0, 3)), ids=str)
def test_empty_x_returns_empty_without_dispatch(any_backend, rng, lead):
    w, s = make_w(rng, 32, 64), make_scales(rng, 32, 64, "e8m0", 32)
    before = backends.launch_count()
    for variant in (None, *((VARIANTS[:2]) if any_backend != "reference" else ())):
        out = mt.fp4_qmm(mx.zeros((*lead, 64), dtype=mx.bfloat16), w, s, variant=variant)
        assert out.shape == (*lead, 32) and out.dtype == mx.bfloat16
        mx.eval(out)
    assert backends.launch_count() == before


@pytest.mark.parametrize("variant, m, target", [("qmv", 5, None), ("simdgroup", 33, None),
                                               ("simdgroup", 9, 6), ("mpp", 33, None),
                                               ("skinny", 20, None)])
@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(poisoned_outputs, monkeypatch, rng, variant, m, target, seed):
    """Strict mode (reads of threadgroup memory nobody wrote, races between barriers) with
    threads and threadgroups run in a permuted order: the result must not depend on it."""
    require_backend("emulator")
    kernel_variant("emulator", variant)

    if target is not None:  # ragged split-K: 3 parts, then the sum kernel
        monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", target)
    x, w, s = make_case(rng, m, 64, 160, mx.float16, "e4m3", 16)
    with strict_emulator(seed), backends.use_backend("emulator"):
        run_and_check(x, w, s, "e4m3", 16, "emulator", variant=variant, expect=variant)


def test_negative_control_skinny_tile_barrier(broken_kernel, rng):
    """Without the SIMD-group barrier at the end of each step, a lane restages (or stores
    its sums over) the x tile that other lanes still read: strict mode reports the race."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    broken_kernel(op_module.SKINNY_SPEC, (
        "  simdgroup_barrier(mem_flags::mem_threadgroup);  // the tile is read before", "  //"))
    x, w, s = make_case(rng, 20, 64, 160, mx.float16, "e4m3", 16)
    with strict_emulator(1), backends.use_backend("emulator"), pytest.raises(
            emulator.ThreadgroupRace, match=r"^\[mt_fp4_qmm_skinny\w*\] strict mode: data race"):
        mx.eval(mt.fp4_qmm(x, w, s, group_size=16, variant="skinny"))


def test_vector_x(any_backend, rng):
    x, w, s = make_x(rng, (), 64, mx.float32), make_w(rng, 32, 64), make_scales(rng, 32, 64,
                                                                                "e8m0", 32)
    out = run_and_check(x, w, s, "e8m0", 32, any_backend)
    assert out.shape == (32,)


# ---- decode: bit-exact against MLX's own dequantize -------------------------------------

def _decode_case(rng, kind):
    n, k, gs = 64, 64, (32 if kind == "e8m0" else 16)
    w = make_w(rng, n, k)
    if kind == "e8m0":  # every exponent whose products stay normal floats: 2^-125 .. 2^123
        s = rng.permutation(np.arange(2, 251))[: n * k // gs].reshape(n, k // gs)
    else:  # every finite E4M3 byte (0x7F / 0xFF are NaN encodings, decoded apart below)
        s = rng.choice(np.setdiff1d(np.arange(256), (0x7F, 0xFF)), size=(n, k // gs))
    return w, mx.array(s.astype(np.uint8)), gs


@pytest.mark.parametrize("kind", ("e8m0", "e4m3"))
def test_reference_decode_bit_exact_with_mlx(rng, kind):
    w, s, gs = _decode_case(rng, kind)
    mode = "mxfp4" if kind == "e8m0" else "nvfp4"
    ours = np.array(op_module.fp4_dequantize_reference(w, s, gs))
    theirs = np.array(mx.dequantize(w, s, group_size=gs, mode=mode, dtype=mx.float32))
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # -0 included
    assert np.array_equal(ours, dequantize64(w, s, kind, gs))  # and the oracle, exactly


@pytest.mark.parametrize("kind", ("e8m0", "e4m3"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_decode_equals_mlx_dequantize(kernel_backend, poisoned_outputs, rng, variant,
                                             kind):
    """x = I makes out = W^T: each output is 1 * w plus products 0 * w' (k != m), exactly w
    in float32. So wherever mx.dequantize gives a nonzero weight, the kernel's output must
    have the same bit pattern. The sign of a zero weight is not observable through any
    output: the accumulators start at +0, 0 * x is +-0, and +0 + -0 = +0, so code 8 (-0)
    and code 0 (+0) give the same results for every finite x. There the check is what can
    be checked: the output is +0 (sign bit clear), while mx.dequantize returns -0 for
    code 8 (present in the case)."""
    kernel_variant(kernel_backend, variant)
    w, s, gs = _decode_case(rng, kind)
    # decoded, skinny: bfloat16 x (each weight is exact in bfloat16, and 1 * w + 0s is w)
    x = mx.eye(64, dtype=mx.bfloat16 if variant in ("decoded", "skinny") else mx.float32)
    out = mt.fp4_qmm(x, w, s, group_size=gs, variant=variant)
    mode = "mxfp4" if kind == "e8m0" else "nvfp4"
    theirs = np.array(mx.dequantize(w, s, group_size=gs, mode=mode, dtype=mx.float32))
    got = np.ascontiguousarray(np.array(out.astype(mx.float32)).T)
    got_bits, their_bits = got.view(np.uint32), theirs.view(np.uint32)
    zero = theirs == 0
    assert (their_bits[zero] == 0x80000000).any() and (their_bits[zero] == 0).any()
    assert np.array_equal(got_bits[~zero], their_bits[~zero]), (
        np.argwhere((got_bits != their_bits) & ~zero)[:4])
    assert (got_bits[zero] == 0).all(), np.argwhere(zero & (got_bits != 0))[:4]


def test_e4m3_nan_encodings_follow_mlx_metal():
    """0x7F / 0xFF (E4M3 NaN) read as +-480 like MLX's Metal decoder (MLX's CPU gives NaN);
    mx.quantize never produces them."""
    table = op_module._e4m3_table()
    assert table[0x7F] == 480.0 and table[0xFF] == -480.0 and table[0x7E] == 448.0
    assert table[0x01] == 2.0**-9 and table[0x08] == 2.0**-6 and table[0x38] == 1.0


def test_mxfp4_from_mx_quantize(any_backend, rng):
    """The real pipeline: W -> mx.quantize(mode="mxfp4") -> fp4_qmm."""
    wf = mx.array(rng.standard_normal((128, 256)).astype(np.float32))
    w, s = mx.quantize(wf, mode="mxfp4")[:2]
    x = make_x(rng, (2, 3), 256, mx.bfloat16)
    run_and_check(x, w, s, "e8m0", 32, any_backend)


def test_nvfp4_from_mx_quantize(any_backend, rng):
    wf = mx.array(rng.standard_normal((64, 128)).astype(np.float32))
    w, s = mx.quantize(wf, mode="nvfp4")[:2]
    x = make_x(rng, (12,), 128, mx.float16)
    run_and_check(x, w, s, "e4m3", 16, any_backend)


# ---- path choice, laziness, no rebuilds ------------------------------------------------

def test_auto_choice_by_backend_and_m(monkeypatch):
    choose = op_module._choose
    assert choose("emulator", 1, None) is op_module.QMV_SPEC
    assert choose("emulator", 8, None) is op_module.QMV_SPEC
    assert choose("emulator", 9, None) is op_module.SIMDGROUP_SPEC
    assert choose("emulator", 512, None) is op_module.SIMDGROUP_SPEC
    low, e8m0, e4m3 = (op_module.DECODED_MIN_M["cuda"], op_module.SCALE_E8M0,
                       op_module.SCALE_E4M3)
    skinny = op_module.SKINNY_M["cuda"]
    assert choose("cuda", 1, None, mx.bfloat16, e8m0, 32) is op_module.QMV_SPEC
    for m in (skinny[0], skinny[len(skinny) // 2], skinny[-1]):
        assert choose("cuda", m, None, mx.bfloat16, e8m0, 32) is op_module.SKINNY_SPEC
        assert choose("cuda", m, None, mx.float16, e4m3, 16) is op_module.SKINNY_SPEC
        assert choose("cuda", m, None, mx.float16, op_module.SCALE_FLOAT, 64) is \
            op_module.SKINNY_SPEC
        # float32 x, float scales of group 16: the kernels before
        assert choose("cuda", m, None, mx.float32, e8m0, 32) is not op_module.SKINNY_SPEC
        assert choose("cuda", m, None, mx.bfloat16, op_module.SCALE_FLOAT, 16) is not \
            op_module.SKINNY_SPEC
    assert choose("emulator", 8, None, mx.bfloat16, e8m0, 32) is op_module.QMV_SPEC
    assert choose("cuda", skinny[-1] + 1, None, mx.bfloat16, e8m0) is op_module.SIMDGROUP_SPEC
    assert choose("cuda", low - 1, None, mx.bfloat16, e8m0) is op_module.SIMDGROUP_SPEC
    assert choose("cuda", low, None, mx.bfloat16, e8m0) is op_module.DECODED_SPEC
    assert choose("cuda", low, None, mx.float16, e4m3) is op_module.DECODED_SPEC
    wide = op_module.DECODED_F32_MIN_M["cuda"]  # float16 x, E8M0: decoded into float32
    assert choose("cuda", max(wide - 1, skinny[-1] + 1), None, mx.float16, e8m0) is \
        op_module.SIMDGROUP_SPEC
    assert choose("cuda", wide, None, mx.float16, e8m0) is op_module.DECODED_SPEC
    for dtype, mode in ((mx.float32, e8m0), (mx.float32, e4m3),
                        (mx.bfloat16, op_module.SCALE_FLOAT)):  # no decoded dtype
        assert choose("cuda", 512, None, dtype, mode) is op_module.SIMDGROUP_SPEC
    assert choose("cuda", 512, "simdgroup", mx.bfloat16, e8m0) is op_module.SIMDGROUP_SPEC
    assert choose("emulator", 512, None, mx.bfloat16, e8m0) is op_module.SIMDGROUP_SPEC
    assert choose("emulator", 9, "decoded", mx.bfloat16, e8m0) is op_module.DECODED_SPEC
    monkeypatch.setattr(_device, "metal_mpp_reason", lambda: None)
    assert choose("metal", 8, None) is op_module.QMV_SPEC
    assert choose("metal", 9, None) is op_module.MPP_SPEC
    assert choose("metal", 9, "simdgroup") is op_module.SIMDGROUP_SPEC
    monkeypatch.setattr(_device, "metal_mpp_reason",
                        lambda: "needs macOS >= 26.2 (MetalPerformancePrimitives), got 15.6")
    assert choose("metal", 512, None) is op_module.SIMDGROUP_SPEC
    with pytest.raises(ValueError, match=r"^\[fp4_qmm\] variant 'mpp' is unavailable on the "
                                         r"metal backend: needs macOS >= 26.2"):
        choose("metal", 512, "mpp")
    with pytest.raises(ValueError, match=r"^\[fp4_qmm\] variant 'mpp' is unavailable on the "
                                         r"cuda backend"):
        choose("cuda", 64, "mpp")
    assert choose("metal", 100, "qmv") is op_module.QMV_SPEC


@pytest.mark.parametrize("release, sysctl, arch, expected", [
    ("26.2", "", "applegpu_g17s", True), ("26.3.1", "", "applegpu_g17g", True),
    ("26.1", "", "applegpu_g17s", False), ("15.6", "", "applegpu_g17s", False),
    ("26.2", "", "applegpu_g16s", False), ("26.2", "", "applegpu_g17p", False),
    ("26.2", "", "applegpu_g18p", True), ("27.0", "", "applegpu_g15g", False),
    # Python built against an older SDK reports macOS 26 as 16.x: the real version decides
    ("16.0", "26.2\n", "applegpu_g17s", True), ("16.0", "26.1\n", "applegpu_g17s", False),
])
def test_mpp_detection(monkeypatch, release, sysctl, arch, expected):
    """The device rule of MLX's NAX kernels, as mlx_metaltile._device states it."""
    monkeypatch.setattr(backends, "_metal_available", lambda: True)
    monkeypatch.setattr(_device.platform, "mac_ver", lambda: (release, ("", "", ""), "arm64"))
    monkeypatch.setattr(_device, "_sysctl", lambda name: sysctl)
    monkeypatch.setattr(_device, "device_architecture", lambda: arch)
    _device.macos_version.cache_clear()
    try:
        reason = variant_reason(op_module.MPP_SPEC, "metal")
        assert (reason is None) is expected, reason
        assert (op_module._choose("metal", 64, None) is op_module.MPP_SPEC) is expected
        if not expected:
            with pytest.raises(ValueError, match=r"^\[fp4_qmm\] variant 'mpp' is unavailable "
                                                 r"on the metal backend: needs "):
                op_module._choose("metal", 64, "mpp")
    finally:
        _device.macos_version.cache_clear()


def test_variant_requests_on_the_reference_backend(rng):
    x, w, s = make_case(rng, 4, 32, 32, mx.float32)
    with backends.use_backend("reference"):
        with pytest.raises(ValueError, match=r"^\[fp4_qmm\] variant='qmv' needs a kernel"):
            mt.fp4_qmm(x, w, s, variant="qmv")


@pytest.mark.parametrize("variant", ("gemv", "", 3, "MPP"))
def test_unknown_variant(kernel_backend, rng, variant):
    x, w, s = make_case(rng, 4, 32, 32, mx.float32)
    with pytest.raises(ValueError, match=r"^\[fp4_qmm\] variant must be None or one of"):
        mt.fp4_qmm(x, w, s, variant=variant)


def _emulator_instantiations() -> dict[str, int]:
    """Kernel sources the emulator compiled so far, per fp4_qmm kernel (one per distinct
    generated source: what Metal would compile as a new pipeline)."""
    return {name: len(kernel._modules) for (backend, name), kernel in
            backends._kernel_cache.items() if backend == "emulator" and "fp4_qmm" in name}


@pytest.mark.parametrize("variant", (None, *VARIANTS))
def test_sizes_do_not_rebuild(kernel_backend, rng, variant):
    """M, N, K (and the split) are runtime inputs: once each template class has run, calls at
    new sizes build no kernel object and (on the emulator) compile no new source. (Every
    array input holds >= 32 elements, N and K being multiples of 32, so MLX never passes
    one in the constant address space: no second source per template class.)"""
    kernel_variant(kernel_backend, variant)
    # warm-up: every template class this variant can take (qmv: MB = 1, 2, 4, 8;
    # simdgroup: one pass (OT = T) and split (OT = float), the split at 40 rows too, past
    # the skinny kernel's rows on cuda)
    warm = [(1, 32, 64), (2, 32, 64), (3, 32, 64), (5, 32, 64), (40, 64, 32), (9, 64, 64),
            (40, 64, 64)]
    dtype = mx.bfloat16 if variant == "decoded" else mx.float16  # decoded: exact in x's dtype
    for m, n, k in warm:
        x, w, s = make_case(rng, m, n, k, dtype)
        run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant)
    built = backends.built_kernels()
    compiled = _emulator_instantiations()
    for m, n, k in [(1, 96, 160), (2, 64, 96), (4, 32, 128), (7, 96, 64), (8, 64, 224),
                    (33, 96, 160), (41, 32, 96), (64, 64, 128), (100, 96, 32)]:
        x, w, s = make_case(rng, m, n, k, dtype)
        run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant)
    assert backends.built_kernels() == built
    assert _emulator_instantiations() == compiled


def test_instantiations_match_the_launches(launch_recorder, monkeypatch, rng):
    """The instantiations hook (CUDA compile check) describes what the launcher passes:
    every variant, scale format, dtype, M block and split (recorded, nothing runs)."""
    monkeypatch.setattr(_device, "metal_mpp_reason", lambda: None)
    for dtype in DTYPES:
        for kind, gs in SCALE_KINDS:
            x, w, s = make_case(rng, 40, 64, 128, dtype, kind, gs)
            for variant in VARIANTS:
                if variant == "decoded" and op_module._decoded_dtype(
                        dtype, SCALE_MODES[kind]) is None:
                    continue  # refused (test_decoded_refuses_what_x_dtype_cannot_hold)
                if variant == "skinny" and not op_module._skinny_fits(
                        dtype, SCALE_MODES[kind], gs):
                    continue  # refused (test_skinny_refuses_what_it_cannot_take)
                for m in (1, 2, 3, 8, 9, 17, 40):
                    mt.fp4_qmm(x[:m], w, s, group_size=gs, variant=variant)
    names = {name for name, *_ in launch_recorder.seen}
    assert names == {f"fp4_qmm_{v}" for v in (*VARIANTS, "splitk_sum")}
    launch_recorder.assert_declared()


def test_instantiations_match_the_cuda_launches(launch_recorder, monkeypatch, rng):
    """The same for cuda's plans: qmv (MB 8 w-first, its own kernel; MB 8 held x forced) and
    skinny (M 2..32, half / bfloat x)."""
    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "cuda")
    clear_plans()
    for dtype in DTYPES:
        for kind, gs in SCALE_KINDS:
            x, w, s = make_case(rng, 32, 64, 128, dtype, kind, gs)
            for wfirst in (None, False):
                monkeypatch.setattr(op_module, "QMV_WFIRST", wfirst)
                clear_plans()
                for m in (1, 2, 3, 5, 8, 9, 17, 32):
                    mt.fp4_qmm(x[:m], w, s, group_size=gs)
    clear_plans()
    names = {name for name, *_ in launch_recorder.seen}
    assert names == {"fp4_qmm_qmv", "fp4_qmm_qmv_wfirst", "fp4_qmm_skinny",
                     "fp4_qmm_simdgroup", "fp4_qmm_splitk_sum"}
    launch_recorder.assert_declared()


@pytest.mark.parametrize("kind, group_size", (("e8m0", 32), ("e4m3", 16), ("bfloat16", 64)))
def test_op_is_lazy_and_compiles(no_host_sync, rng, kind, group_size):
    """On the reference backend: no evaluation inside the op (the result stays a lazy graph
    node inside a bigger graph), and it traces under mx.compile, at two sizes of M."""
    x, w, s = make_case(rng, 6, 64, 64, mx.float32, kind, group_size)


    with backends.use_backend("reference"):
        with no_host_sync():
            out = mt.fp4_qmm(x * 2.0, w, s, group_size=group_size) * 0.5  # exact scalings
        want, mag = oracle(x, w, s, kind, group_size)
        assert_close(out, want, mx.float32, magnitude=mag)
        compiled = mx.compile(lambda a, b, c: mt.fp4_qmm(a, b, c, group_size=group_size))
        for rows in (6, 11):
            xr = make_x(rng, (rows,), 64, mx.float32)
            want, mag = oracle(xr, w, s, kind, group_size)
            assert_close(compiled(xr, w, s), want, mx.float32, magnitude=mag)


# ---- negative controls: a deliberately wrong kernel must fail the harness ----------------

# Each breaks one thing a weaker harness could miss: the decode's pair order (qmv), the
# scale (simdgroup), the last k-slice of each step (mpp), each row's own scales (decoded:
# row 0's for all).
BREAKS = {
    "qmv": ("xr[m][8 * q + j] * v.x + xr[m][8 * q + j + 4] * v.y",
            "xr[m][8 * q + j] * v.y + xr[m][8 * q + j + 4] * v.x"),
    "simdgroup": ("float2(mt_e2m1x2(word >> (4 * j))) * s", "float2(mt_e2m1x2(word >> (4 * j)))"),
    "mpp": ("mt_e2m1x2(word >> (4 * j))", "mt_e2m1x2(word >> (4 * (j & 2)))"),
    "decoded": ("size_t(row) * ((k_words * 8) >> gs_shift)", "size_t(0)"),
    # skinny: x staged in plain K order, not the permutation its w fragments take
    "skinny": ("vec<T, 2>(T(v[a]), T(v[a + 4]))", "vec<T, 2>(T(v[a + 4]), T(v[a]))"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_negative_control_broken_kernel(kernel_backend, broken_kernel, rng, variant):
    kernel_variant(kernel_backend, variant)
    broken_kernel(op_module.VARIANT_SPECS[variant], BREAKS[variant])
    # qmv at M = 3: its held-x kernel on every backend (the w-first form has its own controls)
    x, w, s = make_case(rng, 3 if variant == "qmv" else 33, 64, 64,
                        {"decoded": mx.bfloat16, "skinny": mx.float16}.get(variant, mx.float32))
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant=variant)


# Split-K breaks: the sum drops the last part; the tile kernel drops the last K step of a
# ragged last part (or reads past K with no clamp: a fault on the emulator).
SPLIT_BREAKS = {
    "sum_drops_a_part": ("SPLITK_SUM_SPEC", "p < n_parts", "p + 1 < n_parts", AssertionError),
    "last_part_short": ("SIMDGROUP_SPEC", "min(k_begin + k_part, K)",
                        "min(k_begin + k_part, K - BK)", AssertionError),
    "last_part_unclamped": ("SIMDGROUP_SPEC", "min(k_begin + k_part, K)", "(k_begin + k_part)",
                            "OutOfBoundsAccess"),
}


@pytest.mark.parametrize("brk", SPLIT_BREAKS)
def test_negative_control_broken_split_k(kernel_backend, monkeypatch, broken_kernel, rng, brk):
    attr, old, new, exc = SPLIT_BREAKS[brk]
    if isinstance(exc, str):  # a fault only the emulator reports
        if kernel_backend != "emulator":
            pytest.skip("out-of-bounds reads are reported by the emulator")
        from mlx_metaltile import emulator
        exc = getattr(emulator, exc)
    broken_kernel(getattr(op_module, attr), (old, new))
    monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", 6)
    x, w, s = make_case(rng, 9, 64, 160, mx.float32)  # 3 parts of 64, 64, 32
    assert op_module._split_k(9, 64, 160) == (3, 64)
    with pytest.raises(exc, match="out of tolerance" if exc is AssertionError else None):
        run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant="simdgroup")


# The row guards of a ragged M, removed one at a time: each must fault on the emulator.
UNGUARDED = {
    "qmv-load": ("qmv", "if (m0 + m < M) {\n        const size_t xo", "if (true) {\n        const size_t xo"),
    "qmv-store": ("qmv", "      if (m0 + m < M) {\n        const size_t oo",
                  "      if (true) {\n        const size_t oo"),
    "simdgroup-store": ("simdgroup", "if (x_row_ok) {\n  const", "if (true) {\n  const"),
    # two guards, each enough: the clamped row pointer and the select of 0
    "simdgroup-load": ("simdgroup", ("min(m_tile + lr, M - 1)", "k0, x_row_ok, xv"),
                       ("(m_tile + lr)", "k0, true, xv")),
    "mpp-load": ("mpp", "a[i] = row < M ? x[", "a[i] = true ? x["),
    "mpp-store": ("mpp", "    if (row < M) {\n      out", "    if (true) {\n      out"),
    "skinny-load": ("skinny", ("size_t(live ? m0 + m : 0u)", "live, v);"),
                    ("size_t(m0 + m)", "true, v);")),
    "skinny-store": ("skinny", "  if (m0 + m < M) {\n    float total",
                     "  if (true) {\n    float total"),
}


@pytest.mark.parametrize("brk", UNGUARDED)
def test_negative_control_unguarded_rows_fault_on_the_emulator(broken_kernel, rng, brk):
    """Without a row guard, a ragged M reads past x or writes past out: the emulator says so."""
    require_backend("emulator")
    variant, old, new = UNGUARDED[brk]
    kernel_variant("emulator", variant)
    from mlx_metaltile import emulator

    edits = zip(old, new, strict=True) if isinstance(old, tuple) else [(old, new)]
    broken_kernel(op_module.VARIANT_SPECS[variant], *edits)
    x, w, s = make_case(rng, 5 if variant == "qmv" else 33, 32, 64,
                        mx.float16 if variant == "skinny" else mx.float32)
    with backends.use_backend("emulator"), pytest.raises(emulator.OutOfBoundsAccess):
        mx.eval(mt.fp4_qmm(x, w, s, variant=variant))


def test_negative_control_reference_decode(monkeypatch, rng):
    """The oracle harness rejects a decoder that drops the sign bit."""
    real = op_module._E2M1.copy()
    monkeypatch.setattr(op_module, "_E2M1", np.abs(real))
    monkeypatch.setattr(op_module, "_TABLES", {})
    x, w, s = make_case(rng, 4, 32, 64, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tol"):
        run_and_check(x, w, s, "e8m0", 32, "reference")


# ---- bad input ------------------------------------------------------------------------

def _ok():
    return (mx.zeros((3, 64), dtype=mx.float16), mx.zeros((32, 8), dtype=mx.uint32),
            mx.full((32, 2), 127, dtype=mx.uint8))


@pytest.mark.parametrize("mutate, kwargs, exc, match", [
    (lambda x, w, s: (x.astype(mx.int32), w, s), {}, TypeError, "x must be float32"),
    (lambda x, w, s: (x, w.astype(mx.int32), s), {}, TypeError, "w must be uint32"),
    (lambda x, w, s: (x, w.view(mx.uint8), s), {}, TypeError, "w must be uint32"),
    (lambda x, w, s: (x, w, s.astype(mx.int32)), {}, TypeError, "scales must be uint8"),
    (lambda x, w, s: (x, w, s), {"group_size": 64}, ValueError,
     r"uint8 scales are E8M0 \(mxfp4, group_size 32\) or E4M3"),
    (lambda x, w, s: (x, w, s.astype(mx.float32)), {"group_size": 8}, ValueError,
     r"group_size must be one of \(16, 32, 64, 128\)"),
    (lambda x, w, s: (x, w, s), {"group_size": 32.0}, TypeError, "group_size must be an int"),
    (lambda x, w, s: (x[:, :32], w, s), {}, ValueError, "x's last axis must be K = 8 \\* w"),
    (lambda x, w, s: (x, w.reshape(1, 32, 8), s), {}, ValueError, "w must have 2 dimensions"),
    (lambda x, w, s: (x, w[:16], s[:16]), {}, ValueError, "N .* must be a positive multiple"),
    (lambda x, w, s: (x[:, :48], w[:, :6], s[:, :3]), {"group_size": 16}, ValueError,
     r"K \(x.shape\[-1\] = 8 \* w.shape\[1\]\) must be a positive multiple of 32, got 48"),
    (lambda x, w, s: (x, w, s[:, :1]), {}, ValueError,
     r"scales must have shape \[N, K/group_size\] = \(32, 2\), got \(32, 1\)"),
    (lambda x, w, s: (x, w, s.astype(mx.float32)), {"group_size": 64}, ValueError,
     r"scales must have shape \[N, K/group_size\] = \(32, 1\)"),
    (lambda x, w, s: (x, w, s.astype(mx.float32)), {"group_size": 128}, ValueError,
     "K = 64 must be a multiple of group_size 128"),
    (lambda x, w, s: (x[0, 0], w, s), {}, ValueError, "x must have at least 1 dimension"),
    (lambda x, w, s: (x, np.zeros((32, 8), np.uint32), s), {}, TypeError,
     "w must be an mx.array"),
    (lambda x, w, s: (x.astype(mx.uint32), w, s), {}, TypeError,
     "x must be float32, float16 or bfloat16, got uint32"),
    (lambda x, w, s: (x.astype(mx.bool_), w, s), {}, TypeError, "x must be float32"),
    (lambda x, w, s: (x, w.astype(mx.float32), s), {}, TypeError,
     r"w must be uint32 \(8 E2M1 codes per word\), got float32"),
    (lambda x, w, s: (x, w, s.astype(mx.uint32)), {}, TypeError,
     "scales must be uint8 .* got uint32"),
    (lambda x, w, s: (x, w, s.astype(mx.float32)), {"group_size": 0}, ValueError,
     "group_size must be one of"),
    (lambda x, w, s: (x, w, s.astype(mx.float32)), {"group_size": -32}, ValueError,
     "group_size must be one of"),
    (lambda x, w, s: (x, w, s), {"group_size": "32"}, TypeError, "group_size must be an int"),
    (lambda x, w, s: (x, w.reshape(-1), s), {}, ValueError,
     r"w must have 2 dimensions \[N, K/8\], got 1"),
    (lambda x, w, s: (x, w, s.reshape(-1)), {}, ValueError,
     r"scales must have shape \[N, K/group_size\] = \(32, 2\), got \(64,\)"),
    (lambda x, w, s: (x, w, s[None]), {}, ValueError, r"scales must have shape .* \(1, 32, 2\)"),
    (lambda x, w, s: (x, w, s[:16]), {}, ValueError,
     r"scales must have shape \[N, K/group_size\] = \(32, 2\), got \(16, 2\)"),
    (lambda x, w, s: (x, w[:0], s[:0]), {}, ValueError,
     "N .* must be a positive multiple of 32, got 0"),
    (lambda x, w, s: (x[:, :0], w[:, :0], s[:, :0]), {}, ValueError,
     r"K \(x.shape\[-1\] = 8 \* w.shape\[1\]\) must be a positive multiple of 32, got 0"),
    (lambda x, w, s: (x, mx.zeros((48, 8), dtype=mx.uint32), mx.full((48, 2), 127, mx.uint8)),
     {}, ValueError, "N .* must be a positive multiple of 32, got 48"),
])
def test_bad_input(mutate, kwargs, exc, match):
    x, w, s = mutate(*_ok())
    with pytest.raises(exc, match=r"^\[fp4_qmm\] " + match):
        mt.fp4_qmm(x, w, s, **kwargs)


# ---- traffic, from the emulator's per-buffer counters ----------------------------------

@pytest.mark.parametrize("variant, m", [("qmv", 1), ("qmv", 5), ("simdgroup", 33), ("mpp", 33)])
def test_emulator_traffic(poisoned_outputs, no_split, rng, variant, m):
    """Device bytes per buffer, against the ideal (each input once, the output once).

    w is read exactly once per block of M rows, out written exactly once. The excess is by
    design and hits the cache: x is read by each simdgroup of qmv (N / 4 times), each
    threadgroup of simdgroup (N / 32 times), the two simdgroups of an mpp threadgroup that
    share rows (N / 16 times), and
    the scale of a group is loaded once per VPT codes (qmv, VPT = 16 for MB <= 2, else 8)
    or per uint32 word (simdgroup) instead of once per group."""
    require_backend("emulator")
    kernel_variant("emulator", variant)
    from mlx_metaltile import emulator

    n, k = 64, 256
    x, w, s = make_case(rng, m, n, k, mx.bfloat16)
    with backends.use_backend("emulator"):
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant=variant, expect=variant)
    stats = emulator.last_launch_stats()
    read = {name: stats.bytes_read[name] for name in ("x", "w", "scales")}
    if variant == "qmv":
        m_blocks, x_reads = 1, n // 4  # each simdgroup (4 rows of w) reads its x rows
        scale_loads = n * k // (16 if op_module._qmv_rows(m, "emulator") <= 2 else 8)
    else:
        m_blocks, x_reads = -(-m // 32), (n // 32 if variant == "simdgroup" else n // 16)
        scale_loads = n * k // 8
    assert read["w"] == m_blocks * n * k // 2  # ideal: n * k / 2
    assert read["scales"] == m_blocks * scale_loads  # ideal: n * k / 32
    assert read["x"] == x_reads * m * k * 2  # ideal: m * k * 2
    assert stats.bytes_written["out"] == m * n * 2  # ideal


@pytest.mark.parametrize("kind, group_size", (("e8m0", 32), ("e4m3", 16)))
@pytest.mark.parametrize("m", (5, 9, 20))
def test_emulator_traffic_skinny(poisoned_outputs, rng, m, kind, group_size):
    """The skinny kernel: w once per block of 8 MF rows of x (once at M <= 8 and M <= 16);
    x once per threadgroup (N / 32 times), only its live rows; each scale byte by the 4
    lanes of a fragment row, once per 32-wide step (E8M0: the step's group; E4M3: each
    lane's word's), i.e. n k / 8 bytes per block; out once."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    n, k = 64, 512
    x, w, s = make_case(rng, m, n, k, mx.bfloat16, kind, group_size)
    with backends.use_backend("emulator"):
        run_and_check(x, w, s, kind, group_size, "emulator", variant="skinny", expect="skinny")
    stats = emulator.last_launch_stats()
    m_blocks = -(-m // (8 * op_module._skinny_rows(m)))
    assert m_blocks == (1 if m <= 16 else 2)
    assert stats.bytes_read["w"] == m_blocks * n * k // 2  # ideal: n * k / 2 per block
    assert stats.bytes_read["scales"] == m_blocks * n * k // 8
    assert stats.bytes_read["x"] == n // 32 * m * k * 2
    assert stats.bytes_written["out"] == m * n * 2 and stats.bytes_read["out"] == 0


def test_emulator_traffic_half_tiles(poisoned_outputs, no_split, rng):
    """Half x with E8M0 scales: a tile's scale bytes are read once more, by the check that
    picks its staging (n k / 32 bytes per block of 32 rows); w, x and out as for bfloat16."""
    require_backend("emulator")
    kernel_variant("emulator", "simdgroup")
    from mlx_metaltile import emulator

    m, n, k = 33, 64, 256
    x, w, s = make_case(rng, m, n, k, mx.float16)
    with backends.use_backend("emulator"):
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="simdgroup", expect="simdgroup")
    stats = emulator.last_launch_stats()
    m_blocks = -(-m // 32)
    assert stats.bytes_read["scales"] == m_blocks * (n * k // 8 + n * k // 32)
    assert stats.bytes_read["w"] == m_blocks * n * k // 2
    assert stats.bytes_read["x"] == n // 32 * m * k * 2
    assert stats.bytes_written["out"] == m * n * 2


def test_emulator_traffic_split_k(poisoned_outputs, rng):
    """Split-K: the second pass reads the float32 partials once and writes out once."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    m, n, k = 3, 64, 256
    parts, _ = op_module._split_k(m, n, k)
    assert parts == 8
    x, w, s = make_case(rng, m, n, k, mx.float16)
    with backends.use_backend("emulator"):
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="simdgroup", expect="simdgroup")
    stats = emulator.last_launch_stats()
    assert stats.kernel.endswith("fp4_qmm_splitk_sum")
    assert stats.bytes_read["partial"] == parts * m * n * 4
    assert stats.bytes_written["out"] == m * n * 2


# ---- qmv's K slices (cuda's plan: a row block's K steps over S SIMD-groups), on the emulator

# K = 1152 = 2.25 steps of 512 (MB <= 2) or 4.5 of 256 (MB >= 4): a partial last step, and
# steps that S = 2, 3, 4 do not divide evenly (4 > 3 steps: a slice with none); every group
# size divides it.
K_SLICED = 1152


@pytest.fixture
def qmv_slices(monkeypatch):
    """``force(S)``: qmv launches from then on run S K slices (QMV_SLICES), on the emulator."""
    require_backend("emulator")

    def force(slices):
        monkeypatch.setattr(op_module, "QMV_SLICES", slices)
        clear_plans()  # plans read QMV_SLICES once

    with backends.use_backend("emulator"):
        yield force
    clear_plans()


@pytest.fixture
def cuda_plan(monkeypatch):
    """The emulator launched with the cuda backend's qmv plan (its MB, S and form)."""
    require_backend("emulator")
    for name in ("_qmv_rows", "_qmv_slices", "_qmv_wfirst"):
        real = getattr(op_module, name)
        monkeypatch.setattr(op_module, name, lambda *a, real=real: real(*a[:-1], "cuda"))
    clear_plans()
    with backends.use_backend("emulator"):
        yield
    clear_plans()


def _ran_slices(slices, m_blocks, wfirst=False):
    """The last launch was qmv (``wfirst``: its w-first form) with ``slices`` K slices and
    ``m_blocks`` blocks of rows of x, every threadgroup meeting the combine's barrier once
    (none at S = 1)."""
    from mlx_metaltile import emulator

    stats = emulator.last_launch_stats()
    assert stats.kernel.endswith("fp4_qmm_qmv_wfirst" if wfirst else "fp4_qmm_qmv")
    assert stats.threadgroup == (64 * slices, 1, 1) and stats.grid[2] == m_blocks
    assert stats.threadgroup_barriers == (stats.threadgroups if slices > 1 else 0)
    return stats


def test_qmv_plan_of_each_backend(monkeypatch):
    """cuda: MB up to 8 (w-first at 8) and K sliced for about 4096 warps, the steps dealt
    evenly; Metal and the emulator: MB up to 8 (held x), S = 1; QMV_SLICES forces S
    everywhere."""
    rows, slices = op_module._qmv_rows, op_module._qmv_slices
    # (M, N, K) -> cuda's (MB, S): the benchmark shapes
    for (m, n, k), want in {(1, 4096, 4096): (1, 4), (8, 4096, 4096): (8, 4),
                            (3, 4096, 4096): (4, 4), (1, 14336, 4096): (1, 2),
                            (8, 14336, 4096): (8, 2), (1, 32, 4096): (1, 8),
                            (1, 4096, 1152): (1, 3), (5, 32, 1152): (8, 3),
                            (1, 4096, 32): (1, 1)}.items():
        mb = rows(m, "cuda")
        assert (mb, slices(m, n, k, mb, "cuda")) == want, (m, n, k)
    for backend in ("metal", "emulator"):
        assert [rows(m, backend) for m in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
        assert slices(1, 4096, 4096, 1, backend) == 1
    for m in (1, 2, 3, 5, 8):
        for n in (32, 256, 4096, 14336):
            for k in range(32, 8193, 32):
                mb = rows(m, "cuda")
                s = slices(m, n, k, mb, "cuda")
                steps = -(-k // (32 * (16 if mb <= 2 else 8)))
                per = -(-steps // s)
                assert 1 <= s <= min(8, steps) and (s - 1) * per < steps <= s * per, (m, n, k)
    assert rows(8, "cuda") == 8 and slices(1, 32, 8192, 8, "cuda") == 4  # MB 8's registers
    monkeypatch.setattr(op_module, "QMV_MB8_MAX_SLICES", 8)  # w-first: its launch bounds
    assert slices(1, 32, 8192, 8, "cuda") == 4 and slices(1, 32, 8192, 8, "metal") == 1
    monkeypatch.setattr(op_module, "QMV_WFIRST", False)  # held x: the cap alone
    assert slices(1, 32, 8192, 8, "cuda") == 8
    monkeypatch.setattr(op_module, "QMV_MB8_MAX_SLICES", 4)
    monkeypatch.setattr(op_module, "QMV_WFIRST", None)
    monkeypatch.setattr(op_module, "QMV_CUDA_MAX_MB", 4)  # the plan before w-first
    assert rows(8, "cuda") == 4 and slices(8, 4096, 4096, 4, "cuda") == 2
    monkeypatch.setattr(op_module, "QMV_SLICES", 3)
    assert slices(1, 4096, 4096, 1, "metal") == slices(1, 32, 32, 1, "cuda") == 3
    monkeypatch.setattr(op_module, "QMV_SLICES", 9)
    with pytest.raises(ValueError, match=r"^\[fp4_qmm\] QMV_SLICES must be None or 1..8"):
        slices(1, 4096, 4096, 1, "cuda")


@pytest.mark.parametrize("slices", (2, 3))
@pytest.mark.parametrize("m", (1, 2, 3, 5, 8), ids=lambda v: f"M{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_qmv_slices_match_oracle(qmv_slices, poisoned_outputs, rng, dtype, m, slices):
    qmv_slices(slices)
    for n in (32, 256):
        x, w, s = make_case(rng, m, n, K_SLICED, dtype)
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="qmv", expect="qmv")
        _ran_slices(slices, 1)


@pytest.mark.parametrize("kind, group_size", SCALE_KINDS, ids=[f"{k}-g{g}" for k, g in SCALE_KINDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_qmv_slices_scale_formats(qmv_slices, poisoned_outputs, rng, dtype, kind, group_size):
    """mxfp4, nvfp4 and float scales with S = 4 (MB 2: 3 steps, one slice without any; MB
    4: 5 steps)."""
    qmv_slices(4)
    for m in (2, 3):
        x, w, s = make_case(rng, m, 64, K_SLICED, dtype, kind, group_size)
        run_and_check(x, w, s, kind, group_size, "emulator", variant="qmv", expect="qmv")
        _ran_slices(4, 1)


@pytest.mark.parametrize("m, k, mb, slices", [
    (1, K_SLICED, 1, 3), (2, K_SLICED, 2, 3), (3, K_SLICED, 4, 5), (5, K_SLICED, 8, 3),
    (8, K_SLICED, 8, 3), (1, 4096, 1, 8), (7, 4096, 8, 4), (12, K_SLICED, 8, 3),
    (64, K_SLICED, 8, 3)])
def test_qmv_cuda_plan_matches_oracle(cuda_plan, poisoned_outputs, rng, m, k, mb, slices):
    """cuda's own plan at N = 32 (8 warps without slices): MB 8 w-first from M = 5 (one
    block of rows of x up to 8; variant="qmv" at M = 12 and 64: ceil(M / 8) blocks, the
    last one ragged at 12) and S up to 8 (4 at MB 8). (x / 16: sums of 4096 terms stay
    inside half's range.)"""
    for dtype, (kind, gs) in zip(DTYPES, (("e8m0", 32), ("e4m3", 16), ("bfloat16", 64)),
                                 strict=True):
        x = make_x(rng, (m,), k, dtype, scale=1 / 16)
        w, s = make_w(rng, 32, k), make_scales(rng, 32, k, kind, gs)
        expect = "qmv_wfirst" if mb == 8 else "qmv"
        run_and_check(x, w, s, kind, gs, "emulator", variant="qmv", expect=expect)
        _ran_slices(slices, -(-m // mb), wfirst=mb == 8)


@pytest.mark.parametrize("seed", (1, 2))
def test_qmv_slices_strict_shuffled(qmv_slices, poisoned_outputs, rng, seed):
    """Strict mode (threadgroup memory read before it is written, races between barriers),
    threads and threadgroups in a permuted order: equal bits run to run."""
    qmv_slices(3)
    x, w, s = make_case(rng, 5, 64, K_SLICED, mx.float16, "e4m3", 16)
    with strict_emulator(seed):
        out = run_and_check(x, w, s, "e4m3", 16, "emulator", variant="qmv", expect="qmv")
        _ran_slices(3, 1)
        again = mt.fp4_qmm(x, w, s, group_size=16, variant="qmv")
        assert mx.array_equal(out, again).item()


def test_qmv_slices_traffic_and_no_rebuild(qmv_slices, poisoned_outputs, rng):
    """S is a runtime input: other S build nothing new. Whatever S, w is read once, a scale
    once per VPT codes, x once per row block and out written once."""
    from mlx_metaltile import emulator

    m, n = 3, 64  # MB 4, VPT 8
    x, w, s = make_case(rng, m, n, K_SLICED, mx.bfloat16)
    qmv_slices(1)
    run_and_check(x, w, s, "e8m0", 32, "emulator", variant="qmv", expect="qmv")
    built, compiled = backends.built_kernels(), _emulator_instantiations()
    for slices in (2, 5, 8):
        qmv_slices(slices)
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="qmv", expect="qmv")
        stats = emulator.last_launch_stats()
        assert stats.threadgroup == (64 * slices, 1, 1)
        assert stats.bytes_read["w"] == n * K_SLICED // 2
        assert stats.bytes_read["scales"] == n * K_SLICED // 8
        assert stats.bytes_read["x"] == (n // 4) * m * K_SLICED * 2
        assert stats.bytes_written["out"] == m * n * 2 and stats.bytes_read["out"] == 0
    assert backends.built_kernels() == built and _emulator_instantiations() == compiled


# ---- qmv's w-first form (MB 8; cuda's plan at M = 5..8), forced on the emulator --------

@pytest.fixture
def wfirst(monkeypatch):
    """qmv launches from then on run MB 8 in the w-first form (QMV_WFIRST), on the emulator."""
    require_backend("emulator")
    monkeypatch.setattr(op_module, "QMV_WFIRST", True)
    clear_plans()  # plans read QMV_WFIRST once
    with backends.use_backend("emulator"):
        yield
    clear_plans()


def test_qmv_cuda_plan_reads_w_once_at_m5_to_8(monkeypatch):
    """cuda's plan at M = 5..8: one block of 8 rows of x (w read once), w-first, S within its
    launch bounds; QMV_CUDA_MAX_MB = 4 gives back two blocks of 4 (w read twice)."""
    rows, slices, wf = op_module._qmv_rows, op_module._qmv_slices, op_module._qmv_wfirst
    bound = op_module.QMV_WFIRST_BOUNDS[0]
    for m in (5, 6, 7, 8):
        for n, k in ((32, 1152), (4096, 4096), (14336, 4096), (32, 8192)):
            mb = rows(m, "cuda")
            assert mb == 8 and -(-m // mb) == 1 and wf(mb, "cuda"), (m, n, k)
            assert 64 * slices(m, n, k, mb, "cuda") <= bound, (m, n, k)
        for backend in ("metal", "emulator"):  # Apple's plan: MB 8, held x
            assert rows(m, backend) == 8 and not wf(8, backend)
    assert not any(wf(mb, "cuda") for mb in (1, 2, 4))
    monkeypatch.setattr(op_module, "QMV_CUDA_MAX_MB", 4)
    assert all(rows(m, "cuda") == 4 for m in (5, 6, 7, 8))
    monkeypatch.setattr(op_module, "QMV_WFIRST", False)
    monkeypatch.setattr(op_module, "QMV_CUDA_MAX_MB", 8)
    assert not wf(8, "cuda")
    monkeypatch.setattr(op_module, "QMV_WFIRST", True)
    assert wf(8, "metal") and not wf(4, "metal")


@pytest.mark.parametrize("m", (5, 7, 8), ids=lambda v: f"M{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_qmv_wfirst_matches_oracle(wfirst, poisoned_outputs, rng, dtype, m):
    """Every scale format, N = 64, K = 1152 (a partial last step), S = 1."""
    for kind, gs in SCALE_KINDS:
        x, w, s = make_case(rng, m, 64, K_SLICED, dtype, kind, gs)
        run_and_check(x, w, s, kind, gs, "emulator", variant="qmv", expect="qmv_wfirst")
        _ran_slices(1, 1, wfirst=True)


@pytest.mark.parametrize("slices", (1, 3, 4))
def test_qmv_wfirst_equals_held_x(monkeypatch, poisoned_outputs, rng, slices):
    """The same terms in the same order (the template's REDUCTION ORDER): the w-first form
    gives the held-x form's bits, whatever S."""
    require_backend("emulator")
    monkeypatch.setattr(op_module, "QMV_SLICES", slices)
    x, w, s = make_case(rng, 7, 64, K_SLICED, mx.float16, "e4m3", 16)
    outs = []
    with backends.use_backend("emulator"):
        for form in (False, True):
            monkeypatch.setattr(op_module, "QMV_WFIRST", form)
            clear_plans()
            expect = "qmv_wfirst" if form else "qmv"
            outs.append(run_and_check(x, w, s, "e4m3", 16, "emulator", variant="qmv",
                                      expect=expect))
            _ran_slices(slices, 1, wfirst=form)
    clear_plans()
    assert mx.array_equal(outs[0], outs[1]).item()


@pytest.mark.parametrize("max_mb, w_reads", ((8, 1), (4, 2)))
def test_qmv_cuda_plan_traffic_at_m8(monkeypatch, cuda_plan, poisoned_outputs, rng, max_mb,
                                     w_reads):
    """cuda's plan at M = 8 (S = 3): MB 8 w-first reads w exactly once, the plan with
    QMV_CUDA_MAX_MB = 4 (two blocks of rows, S = 5) twice; a scale once per VPT = 8 codes
    of each block, x once per row block, out written once."""
    monkeypatch.setattr(op_module, "QMV_CUDA_MAX_MB", max_mb)
    clear_plans()  # plans read QMV_CUDA_MAX_MB once
    m, n = 8, 64
    x, w, s = make_case(rng, m, n, K_SLICED, mx.bfloat16)
    expect = "qmv_wfirst" if max_mb == 8 else "qmv"
    run_and_check(x, w, s, "e8m0", 32, "emulator", variant="qmv", expect=expect)
    stats = _ran_slices(3 if max_mb == 8 else 5, w_reads, wfirst=max_mb == 8)
    assert stats.bytes_read["w"] == w_reads * n * K_SLICED // 2
    assert stats.bytes_read["scales"] == w_reads * n * K_SLICED // 8
    assert stats.bytes_read["x"] == (n // 4) * m * K_SLICED * 2
    assert stats.bytes_written["out"] == m * n * 2 and stats.bytes_read["out"] == 0


# Each breaks the w-first form alone: the decode's pair order, the last row of w of a step.
WFIRST_BREAKS = {
    "pair_order": ("xm[8 * q + j] * v.x + xm[8 * q + j + 4] * v.y",
                   "xm[8 * q + j] * v.y + xm[8 * q + j + 4] * v.x"),
    "three_rows": ("acc[m][r] += sr[r] * part;", "acc[m][r] += r < 3 ? sr[r] * part : 0.0f;"),
}


@pytest.mark.parametrize("brk", WFIRST_BREAKS)
def test_qmv_wfirst_negative_control(wfirst, broken_kernel, rng, brk):
    broken_kernel(op_module.QMV_WFIRST_SPEC, WFIRST_BREAKS[brk])
    x, w, s = make_case(rng, 6, 32, 256, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="qmv", expect="qmv_wfirst")


def test_qmv_wfirst_negative_control_unguarded_rows(wfirst, broken_kernel, rng):
    """The w-first row guard removed: a ragged M (5 of 8 rows) reads past x."""
    from mlx_metaltile import emulator

    broken_kernel(op_module.QMV_WFIRST_SPEC, ("if (m0 + m < M) {  // uniform", "if (true) {"))
    x, w, s = make_case(rng, 5, 32, 64, mx.float32)
    with pytest.raises(emulator.OutOfBoundsAccess):
        mx.eval(mt.fp4_qmm(x, w, s, variant="qmv"))


SLICE_BREAKS = {
    "first_slice_only": ("for (uint g = 0; g < slices; ++g)", "for (uint g = 0; g < 1; ++g)"),
    "every_slice_all_steps": ("k += slices * STEP", "k += STEP"),
}


@pytest.mark.parametrize("brk", SLICE_BREAKS)
def test_qmv_slices_negative_control(qmv_slices, broken_kernel, rng, brk):
    broken_kernel(op_module.QMV_SPEC, SLICE_BREAKS[brk])
    qmv_slices(3)
    x, w, s = make_case(rng, 3, 32, K_SLICED, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="qmv", expect="qmv")


def test_qmv_slices_negative_control_unguarded_store(qmv_slices, broken_kernel, rng):
    """The combine's row guard removed: a ragged M writes past out (S > 1's own store)."""
    from mlx_metaltile import emulator

    broken_kernel(op_module.QMV_SPEC, ("lane < MB * ROWS && m0 + m < M", "lane < MB * ROWS"))
    qmv_slices(2)
    x, w, s = make_case(rng, 5, 32, K_SLICED, mx.float32)
    with pytest.raises(emulator.OutOfBoundsAccess):
        mx.eval(mt.fp4_qmm(x, w, s, variant="qmv"))


def test_qmv_slices_negative_control_missing_barrier(qmv_slices, broken_kernel, rng):
    """Combining without waiting for the other slices' sums: strict mode must say so."""
    from mlx_metaltile import emulator

    barrier = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
    broken_kernel(op_module.QMV_SPEC, (barrier, ""))
    qmv_slices(3)
    x, w, s = make_case(rng, 3, 32, K_SLICED, mx.float32)
    with strict_emulator(1), pytest.raises((emulator.ThreadgroupRace,
                                            emulator.UninitializedThreadgroupRead)):
        mx.eval(mt.fp4_qmm(x, w, s, variant="qmv"))


# ---- staging (the simdgroup template's STAGING): T fragments only where exact ----------
#
# Each case sets every weight of group g to code_g * scale_g and places a few x values so
# that every float32 product and sum of the float-staged kernel is exact: the result must
# equal the float64 oracle rounded once to T, bit for bit. The cases the template keeps on
# float fragments are built so that rounding a weight to T changes the result (overflow to
# inf, or a cancellation that leaves only the bits T drops); the cases it stages in T use
# the widest products (6 significant bits) and the ends of the scale range.

N_STAGE = 32
E2M1 = {0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 4.0: 6, 6.0: 7}  # value -> code
# name: (x dtype, scale kind, group size, [(scale, e2m1 value) per group],
#        [{k: x value} per row of x], whether the template stages the weights in T)
STAGING = {
    # 6 * 2^17 / 8 = 98304 > 65504: a half weight would be inf
    "e8m0-half-overflow": (mx.float16, "e8m0", 32, [(144, 6.0), (144, 4.0)],
                           [{0: 2.0**-10, 32: -(2.0**-10)}], False),
    # (1 + 2^-20) * 6 is no bfloat / half value: a T weight leaves 0, not 6 * 2^-20
    "float-scale-bfloat16": (mx.bfloat16, "float32", 32, [(1 + 2.0**-20, 6.0), (1.0, 6.0)],
                             [{0: 1.0, 32: -1.0}], False),
    "float-scale-half": (mx.float16, "float32", 32, [(1 + 2.0**-20, 6.0), (1.0, 6.0)],
                         [{0: 1.0, 32: -1.0}], False),
    # E8M0 bytes 107 and 143, the range a half tile takes: 0.5 * 2^-20 / 8 = 2^-24 (half's
    # finest) and 6 * 2^16 / 8 = 49152 are half values
    "e8m0-half-in-range": (mx.float16, "e8m0", 32, [(107, 0.5), (143, 6.0)],
                           [{0: 1.0}, {32: 2.0**-10}], True),
    # byte 106: 0.5 * 2^-21 / 8 = 2^-25 is no half value (a half weight would be 0)
    "e8m0-half-underflow": (mx.float16, "e8m0", 32, [(106, 0.5), (127, 1.0)], [{0: 1.0}],
                            False),
    # E4M3 1.875 * 1.5 = 2.8125 (6 bits), 1.25 * 2, 480 * 6, 2^-9 * 0.5 (the smallest)
    "e4m3-half": (mx.float16, "e4m3", 16, [(0x3F, 1.5), (0x3A, 2.0), (0x7F, 6.0), (0x01, 0.5)],
                  [{0: 1.0, 16: -1.0}, {32: 2.0**-10, 48: 2.0**10}], True),
    "e4m3-bfloat16": (mx.bfloat16, "e4m3", 16,
                      [(0x3F, 1.5), (0x3A, 2.0), (0x7F, 6.0), (0x01, 0.5)],
                      [{0: 1.0, 16: -1.0}, {32: 2.0**-10, 48: 2.0**10}], True),
    # E8M0 2^127 * 6 (float32 holds it only as the staged / 8) and 2^-126 * 1.5 (subnormal
    # once staged: 1.5 * 2^-129)
    "e8m0-bfloat16": (mx.bfloat16, "e8m0", 32, [(254, 6.0), (1, 1.5)],
                      [{0: 2.0**-120}, {32: 2.0**100}], True),
    "e4m3-float32": (mx.float32, "e4m3", 16, [(0x3F, 1.5), (0x3A, 2.0), (0x7F, 6.0), (0x01, 0.5)],
                     [{0: 1.0, 16: -1.0}, {32: 2.0**-10, 48: 2.0**10}], False),
}


def _staging_case(dtype, kind, gs, groups, rows):
    k = gs * len(groups)
    codes = np.repeat(np.array([E2M1[v] for _, v in groups], dtype=np.uint32), gs)
    words = (codes.reshape(-1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(axis=1)
    w = mx.array(np.tile(words.astype(np.uint32), (N_STAGE, 1)))
    raw = np.tile(np.array([s for s, _ in groups]), (N_STAGE, 1))
    scales = mx.array(raw.astype(np.uint8 if kind in ("e8m0", "e4m3") else np.float32))
    xv = np.zeros((len(rows), k), dtype=np.float64)
    for r, row in enumerate(rows):
        for col, value in row.items():
            xv[r, col] = value
    x = mx.array(xv.astype(np.float32)).astype(dtype)
    assert np.array_equal(to_f64(x), xv)  # every x value is a T value
    return x, w, scales


def check_staging(name, backend):
    dtype, kind, gs, groups, rows, _ = STAGING[name]
    x, w, s = _staging_case(dtype, kind, gs, groups, rows)
    out = run_and_check(x, w, s, kind, gs, backend, variant="simdgroup", expect="simdgroup")
    want = oracle(x, w, s, kind, gs)[0]
    exact = to_f64(mx.array(want.astype(np.float32)).astype(dtype))  # rounded once to T
    assert np.array_equal(np.asarray(want, np.float32).astype(np.float64), want)
    np.testing.assert_array_equal(to_f64(out), exact, err_msg=f"fp4_qmm staging {name}")


@pytest.mark.parametrize("split", (False, True), ids=("one-pass", "split-k"))
@pytest.mark.parametrize("name", STAGING)
def test_staging_is_exact(kernel_backend, poisoned_outputs, monkeypatch, name, split):
    """The weights the template stages in T are exactly T values, and the ones it keeps in
    float would not be: the result is the exact one, rounded once."""
    monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", 512 if split else 1)
    check_staging(name, kernel_backend)


KEPT_FLOAT = [name for name, case in STAGING.items() if not case[-1] and case[0] != mx.float32]


@pytest.mark.parametrize("name", KEPT_FLOAT)
def test_negative_control_weights_staged_in_t(kernel_backend, broken_kernel, monkeypatch,
                                              name):
    """Staging every weight in T (the rounding the template avoids for mxfp4 with half x
    and for float scales) must fail the staging cases."""
    broken_kernel(op_module.SIMDGROUP_SPEC, ("struct mt_fp4_staging {\n  typedef float type;",
                                             "struct mt_fp4_staging {\n  typedef T type;"))
    monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", 1)
    with pytest.raises(AssertionError):
        check_staging(name, kernel_backend)


# Half x with E8M0 scales stages a tile in half when its scale bytes allow (the range) and
# in float otherwise: edits of the range, and of the half tiles' staging alone.
TILE_RANGE_BREAKS = {
    "max_past_half": (("#define MT_FP4_HALF_E8M0_MAX 143u", "#define MT_FP4_HALF_E8M0_MAX 144u"),
                      "e8m0-half-overflow"),
    "min_past_half": (("#define MT_FP4_HALF_E8M0_MIN 107u", "#define MT_FP4_HALF_E8M0_MIN 106u"),
                      "e8m0-half-underflow"),
    "half_tiles_scaled": (("mt_fp4_stage(xs_t, ws_t, xv, word, s,",
                           "mt_fp4_stage(xs_t, ws_t, xv, word, 2.0f * s,"),
                          "e8m0-half-in-range"),
}


@pytest.mark.parametrize("split", (False, True), ids=("one-pass", "split-k"))
@pytest.mark.parametrize("brk", TILE_RANGE_BREAKS)
def test_negative_control_half_tile_range(kernel_backend, broken_kernel, monkeypatch, brk,
                                          split):
    """Each edit fails its staging case, so that case ran the path the edit touches; the
    half tiles' edit leaves the out-of-range cases exact, so those ran in float."""
    edit, failing = TILE_RANGE_BREAKS[brk]
    broken_kernel(op_module.SIMDGROUP_SPEC, edit)
    monkeypatch.setattr(op_module, "SPLITK_TARGET_TGS", 512 if split else 1)
    with pytest.raises(AssertionError):
        check_staging(failing, kernel_backend)
    if brk == "half_tiles_scaled":
        check_staging("e8m0-half-overflow", kernel_backend)
        check_staging("e8m0-half-underflow", kernel_backend)


@pytest.mark.parametrize("dtype, kind, group_size, scales", [
    (mx.float32, "e8m0", 32, "E8M0"), (mx.float32, "e4m3", 16, "E4M3"),
    (mx.float16, "float32", 32, "float"), (mx.bfloat16, "float16", 64, "float")], ids=str)
def test_decoded_refuses_what_x_dtype_cannot_hold(kernel_backend, rng, dtype, kind, group_size,
                                                  scales):
    """The decoded plan multiplies exact weights: forced where no dtype it multiplies in
    holds every weight exactly (float scales) or where float32 x would multiply in TF32, it
    raises instead of rounding."""
    x, w, s = make_case(rng, 40, 64, 128, dtype, kind, group_size)
    with pytest.raises(ValueError, match=rf"^\[fp4_qmm\] variant 'decoded' decodes W into "
                                         rf"a dtype that .* got {dtype_id(dtype)} x with "
                                         rf"{scales}"):
        mt.fp4_qmm(x, w, s, group_size=group_size, variant="decoded")


def test_decoded_through_float32_under_tf32(kernel_backend, tf32_matmul, poisoned_outputs,
                                            rng):
    """float16 x with E8M0 scales (weights over 18 binades, outside half's range): the
    decoded plan decodes W into float32 and multiplies there, under a matmul that keeps
    TF32's 11 significand bits as MLX's CUDA default does. Forward and dx against the
    float64 oracle, the decode kernel launched for each."""
    x, w = make_x(rng, (40,), 128, mx.float16), make_w(rng, 64, 128)
    s = make_scales(rng, 64, 128, "e8m0", 32)
    run_and_check(x, w, s, "e8m0", 32, kernel_backend, variant="decoded", expect="decoded")
    run_and_check_dx(x, w, s, make_x(rng, (40,), 64, mx.float16), "e8m0", 32, kernel_backend)


@pytest.mark.parametrize("mf", (2, 4), ids=("MF2", "MF4"))
@pytest.mark.parametrize("target", (1, 10**6), ids=("S1", "Smax"))
@pytest.mark.parametrize("m, k", ((2, 96), (16, 160), (31, 512), (33, 64), (70, 544)))
@pytest.mark.parametrize("kind, group_size", (("e8m0", 32), ("e4m3", 16), ("float16", 128)))
def test_skinny_slices_and_row_blocks(kernel_backend, poisoned_outputs, monkeypatch, rng,
                                      mf, target, m, k, kind, group_size):
    """The skinny kernel's plans: one K slice, or as many as the steps allow (K = 544: 17
    steps over 6 slices, the last one shorter), M past one block of rows (blocks of 16 or 32 rows: MF 2, the
    plan's, or 4; the last block ragged), every scale format it takes."""
    if k % group_size:
        pytest.skip("K must hold whole groups")
    monkeypatch.setattr(op_module, "SKINNY_MAX_MF", mf)
    monkeypatch.setattr(op_module, "SKINNY_TARGET_WARPS", target)
    clear_plans()
    x, w, s = make_case(rng, m, 96, k, mx.bfloat16 if m % 2 else mx.float16, kind,
                        group_size)
    run_and_check(x, w, s, kind, group_size, kernel_backend, variant="skinny",
                  expect="skinny")
    clear_plans()


@pytest.mark.parametrize("dtype, kind, group_size, scales", [
    (mx.float32, "e8m0", 32, "E8M0"), (mx.float32, "float32", 64, "float"),
    (mx.float16, "float32", 16, "float"), (mx.bfloat16, "bfloat16", 16, "float")], ids=str)
def test_skinny_refuses_what_it_cannot_take(kernel_backend, rng, dtype, kind, group_size,
                                            scales):
    """The skinny kernel multiplies half / bfloat fragments, a 32-wide K step under one
    scale (or each word's weights exact in x's dtype): forced on float32 x or float scales
    of group 16, it raises naming what it got."""
    x, w, s = make_case(rng, 8, 64, 128, dtype, kind, group_size)
    with pytest.raises(ValueError, match=rf"^\[fp4_qmm\] variant 'skinny' takes float16 or "
                                         rf"bfloat16 x .* got {dtype_id(dtype)} x with "
                                         rf"{scales}.* scales of group_size {group_size}$"):
        mt.fp4_qmm(x, w, s, group_size=group_size, variant="skinny")


def test_negative_control_skinny_step_scales(broken_kernel, rng):
    """The skinny kernel scales each 32-wide step by its own group's scale: the next step's
    scale in its place (for one element of each pair) fails the oracle (groups of 32
    differ)."""
    require_backend("emulator")
    broken_kernel(op_module.SKINNY_SPEC, ("acc[i][f].thread_elements()[0] += sc[i] *",
                                          "acc[i][f].thread_elements()[0] += sq[0][i] *"))
    x, w, s = make_case(rng, 9, 64, 2048, mx.bfloat16, "e8m0", 32)  # 4 steps a slice
    assert op_module._skinny_slices(9, 64, 2048, 2) == 8
    with backends.use_backend("emulator"), pytest.raises(AssertionError,
                                                         match="out of tolerance"):
        run_and_check(x, w, s, "e8m0", 32, "emulator", variant="skinny", expect="skinny")


# ---- the x-VJP (dx = g @ W) -------------------------------------------------------------

@pytest.mark.parametrize("lead", ((1,), (5,), (33,), (2, 3), (5, 7)),
                         ids=("M1", "M5", "M33", "2x3", "5x7"))
@pytest.mark.parametrize("kind, group_size", SCALE_KINDS[:3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dx_matches_oracle(any_backend, poisoned_outputs, rng, dtype, kind, group_size, lead):
    """MLX's modes run the dx kernel (one expert, every id 0; float32 weights) up to
    DX_MAX_M rows; more rows the decoded product where x's dtype holds the weights, else
    (and float scales) the composite; all against the float64 gradient, leading dimensions
    kept."""
    x = make_x(rng, lead, 128, dtype)
    w, s = make_w(rng, 96, 128), make_scales(rng, 96, 128, kind, group_size)
    g = make_x(rng, lead, 96, dtype)
    run_and_check_dx(x, w, s, g, kind, group_size, any_backend)


@pytest.fixture
def tf32_matmul(monkeypatch):
    """mx.matmul as TF32 tensor cores run it (MLX's default for float32 on NVIDIA GPUs):
    float32 operands keep their leading 11 significand bits, the products accumulate in
    float32."""
    real = mx.matmul

    def cut(a):
        if a.dtype != mx.float32:
            return a
        return mx.view(mx.view(a, mx.uint32) & 0xFFFFE000, mx.float32)

    monkeypatch.setattr(mx, "matmul", lambda a, b, **kw: real(cut(a), cut(b), **kw))


@pytest.mark.parametrize("kind, group_size", SCALE_KINDS[:4])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dx_composite_accurate_under_tf32(any_backend, tf32_matmul, rng, dtype, kind,
                                          group_size):
    """The composite's dx (more than DX_MAX_M rows) keeps the float32 tolerance where
    mx.matmul runs float32 in TF32: float32 g and float-scaled weights are split into
    TF32-exact pieces."""
    lead = (op_module.DX_MAX_M + 25,)
    x = make_x(rng, lead, 128, dtype)
    w, s = make_w(rng, 96, 128), make_scales(rng, 96, 128, kind, group_size)
    run_and_check_dx(x, w, s, make_x(rng, lead, 96, dtype), kind, group_size, any_backend)


@pytest.mark.parametrize("kind, group_size", (SCALE_KINDS[0], SCALE_KINDS[2]))
def test_dx_composite_tf32_negative_control(any_backend, tf32_matmul, rng, monkeypatch, kind,
                                            group_size):
    """One plain product in place of the split fails the float32 check under TF32: float32 g
    (E8M0 weights), float32 g and float32-scaled weights."""
    monkeypatch.setattr(op_module, "float32_matmul",
                        lambda a, b, **exact: mx.matmul(a, b))
    lead = (op_module.DX_MAX_M + 25,)
    x = make_x(rng, lead, 128, mx.float32)
    w, s = make_w(rng, 96, 128), make_scales(rng, 96, 128, kind, group_size)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check_dx(x, w, s, make_x(rng, lead, 96, mx.float32), kind, group_size,
                         any_backend)


def test_tf32_split_pieces(rng):
    """hi has its low 13 significand bits clear, hi + lo == a exactly, |lo| <= 2^-10 |a|
    (subnormal a: below 2^-136); infinities and NaNs stay whole in hi."""
    a = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 2.0 ** rng.integers(
        -140, 120, 4000), np.array([0.0, -0.0, 3.4e38, -1e-45, np.inf, -np.inf, np.nan],
                                   np.float32)]).astype(np.float32)
    hi, lo = (np.array(v) for v in tf32_split(mx.array(a)))
    fin = np.isfinite(a)
    assert not np.any(hi[fin].view(np.uint32) & 0x1FFF)
    np.testing.assert_array_equal(hi[fin].astype(np.float64) + lo[fin], a[fin])
    normal = fin & (np.abs(a) >= 2.0 ** -126)
    assert np.all(np.abs(lo[normal]) <= np.abs(a[normal]) * 2.0 ** -10)
    assert np.all(np.abs(lo[fin & ~normal]) < 2.0 ** -136)  # subnormals: the low 13 bits
    np.testing.assert_array_equal(hi[~fin], a[~fin])
    assert not np.any(lo[~fin])


@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=dtype_id)
def test_dx_scales_over_ninety_binades(kernel_backend, poisoned_outputs, rng, dtype):
    x, w = make_x(rng, (3,), 128, dtype), make_w(rng, 64, 128)
    s = make_scales(rng, 64, 128, "e8m0", 32, spread=60)
    run_and_check_dx(x, w, s, make_x(rng, (3,), 64, dtype), "e8m0", 32, kernel_backend)


def test_dx_negative_control(kernel_backend, broken_kernel, rng):
    """The dx kernel without its E2M1 scale must fail the gradient check."""
    old = "mt_dx_weights<T, ROUND>(s * float2(mt_e2m1x2(word >> (4 * i))))"
    broken_kernel(op_module.DX_SPEC,
                  (old, "mt_dx_weights<T, ROUND>(float2(mt_e2m1x2(word >> (4 * i))))"))
    x, w, s = make_case(rng, 2, 64, 128, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check_dx(x, w, s, make_x(rng, (2,), 64, mx.float32), "e8m0", 32,
                         kernel_backend)


def test_dx_decoded_negative_control(kernel_backend, broken_kernel, rng):
    """More rows in bfloat16: the decode kernel without each row's own scales fails the
    gradient check (so the decoded product is what ran)."""
    broken_kernel(op_module.DECODED_SPEC, BREAKS["decoded"])
    x, w, s = make_case(rng, 33, 64, 128, mx.bfloat16)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check_dx(x, w, s, make_x(rng, (33,), 64, mx.bfloat16), "e8m0", 32,
                         kernel_backend)


def test_dx_instantiations_match_the_launches(launch_recorder, rng):
    """The dx kernel's declared instantiations cover its launches (every dtype, both
    uint8 scale formats, M below the 8 ids passed as constants and at it)."""
    for dtype in DTYPES:
        for kind, gs in SCALE_KINDS[:2]:
            x, w, s = make_case(rng, 8, 64, 128, dtype, kind, gs)
            for m in (1, 8):
                g = make_x(rng, (m,), 64, dtype)
                mx.vjp(lambda x, w=w, s=s, gs=gs: mt.fp4_qmm(x, w, s, group_size=gs),
                       [x[:m]], [g])
    names = {name for name, *_ in launch_recorder.seen}
    assert "fp4_qmm_dx" in names
    launch_recorder.assert_declared()
