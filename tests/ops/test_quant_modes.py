"""Quantization modes as mx.quantize describes them (affine | mxfp4 | nvfp4 | mxfp8) in expert_qmv,
moe_gather_qmm and fp4_qmm: float64 oracles decoded from the formats' definitions, every
backend here, and the errors for a mode that contradicts its arrays."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import require_backend

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, check_rows, expect_launches, to_f64
from mlx_metaltile.cases.moe_gather_qmm import gemv_plan

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
FP_MODES = ("mxfp4", "nvfp4", "mxfp8")
FP4_MODES = ("mxfp4", "nvfp4")
GROUP = {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32}
BITS = {"mxfp4": 4, "nvfp4": 4, "mxfp8": 8}
qmv_module = importlib.import_module("mlx_metaltile.ops.expert_qmv")
gqmm_module = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm")


def _dname(d):
    return str(d).rsplit(".", 1)[-1]


# ---- the formats, decoded from their definitions (not from the kernels' bit tricks) ------

def e2m1(codes: np.ndarray) -> np.ndarray:
    """E2M1: sign bit 3; exponent bits 2-1 (bias 1, 0 = subnormal: 0.5 * mantissa);
    mantissa bit 0. Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    codes = codes.astype(np.int64)
    e, m = (codes >> 1) & 3, codes & 1
    mag = np.where(e == 0, 0.5 * m, 2.0 ** (e - 1) * (1 + m / 2))
    return np.where(codes & 8, -mag, mag)


def e8m0(b: np.ndarray) -> np.ndarray:
    """E8M0 (mxfp4 scale): 2^(b - 127); MLX reads b = 0 as 2^-127."""
    return 2.0 ** (b.astype(np.float64) - 127)


def e4m3(b: np.ndarray) -> np.ndarray:
    """E4M3 (nvfp4 scale, mxfp8 element): sign bit 7; exponent bits 6-3 (bias 7, 0 = subnormal:
    mantissa * 2^-9); mantissa bits 2-0."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m * 2.0**-9, 2.0 ** (e - 7) * (1 + m / 8))
    return np.where(b & 0x80, -mag, mag)


E2M1_VALUES = e2m1(np.arange(16))  # the 16 codes, decoded once


def dequantize64(w, scales, mode: str) -> np.ndarray:
    """[..., N, K*bits/32] uint32 words + [..., N, K/gs] uint8 scales -> float64 [..., N, K].
    fp4: code j of a word is at bits [4j, 4j + 4): the low nibble of its byte j // 2 (little
    endian) for even j, the high one for odd j. mxfp8: code j is byte j."""
    words = np.ascontiguousarray(np.asarray(w), dtype="<u4")
    b = words.view(np.uint8).reshape(*words.shape[:-1], -1)
    if mode == "mxfp8":
        values = e4m3(b)
    else:
        codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*words.shape[:-1], -1)
        values = E2M1_VALUES[codes]
    s = (e4m3 if mode == "nvfp4" else e8m0)(np.asarray(scales))
    return values * np.repeat(s, GROUP[mode], axis=-1)


def make_fp(rng, n_experts, n_out, n_in, mode, *, wide=False):
    """Random words and scales. fp4: every code equally likely; mxfp8: every E4M3 byte but
    0x7F / 0xFF (NaN encodings, read as +-480 by the kernels and NaN by MLX's CPU; never
    written by mx.quantize). E8M0 in 2^-6..2^6 (mxfp8: ..2^0; wide: from 2^-117 to 2^113,
    mxfp8 2^107); nvfp4:
    E4M3 of both signs, subnormals included, |s| <= 15 (wide: every finite byte up to
    +-448)."""
    shape = (n_experts, n_out, n_in * BITS[mode] // 32)
    if mode == "mxfp8":
        finite = np.setdiff1d(np.arange(256), (0x7F, 0xFF)).astype(np.uint8)
        w = rng.choice(finite, size=(*shape, 4)).view("<u4").reshape(shape)
    else:
        w = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
    g = (n_experts, n_out, n_in // GROUP[mode])
    if mode != "nvfp4":  # E8M0; mxfp8's elements reach 448 = 2^8.8: smaller scales
        top = 134 if mode == "mxfp4" else 128
        s = rng.integers(10, top + 107, size=g) if wide else rng.integers(121, top, size=g)
    else:
        mag = rng.integers(0, 0x7F, size=g) if wide else rng.integers(0, 11 * 8, size=g)
        s = mag | (rng.integers(0, 2, size=g) << 7)
    return mx.array(w), mx.array(s.astype(np.uint8))


def make_x(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _ids_valid(ids, n_experts):
    ids = np.array(ids).astype(np.int64)
    return ids, (ids >= 0) & (ids < n_experts)


# ---- expert_qmv ---------------------------------------------------------------------------

def qmv_oracle(x, w, scales, indices, mode):
    """out[t, j, n] = sum_k x[t(, j), k] * W[ids[t, j], n, k] (float64), NaN rows for ids
    outside [0, E); with the magnitude sum |x| |W|."""
    ids, valid = _ids_valid(indices, w.shape[0])
    xs = to_f64(x)
    if xs.ndim != ids.ndim + 1:
        xs = np.broadcast_to(xs[..., None, :], (*ids.shape, xs.shape[-1]))
    want = np.full((*ids.shape, w.shape[1]), np.nan)
    mag = np.zeros_like(want)
    wn, sn = np.array(w), np.array(scales)
    for e in np.unique(ids[valid]):  # one expert at a time: the real shapes are large
        wd = dequantize64(wn[e], sn[e], mode)
        at = ids == e
        want[at] = xs[at] @ wd.T
        mag[at] = np.abs(xs[at]) @ np.abs(wd).T
    return want, mag, valid


def run_qmv(x, w, scales, ids, mode, backend, kernel="expert_qmv_simd_rows"):
    with expect_launches(backend, 1, kernel):  # the kernel ran (never the reference)
        out = mt.expert_qmv(x, w, scales, None, ids, mode=mode)
        mx.eval(out)
    want, mag, valid = qmv_oracle(x, w, scales, ids, mode)
    check_rows(out, want, mag, valid, x.dtype, f"expert_qmv[{backend}, {mode}]")
    return out


@pytest.mark.parametrize("shared", (True, False), ids=("x_shared", "x_per_expert"))
@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_expert_qmv_fp_modes(any_backend, poisoned_outputs, rng, dtype, mode, shared):
    """N = 13 (a ragged row tile), K = 96 (a partial 32-lane step); ids first, last,
    repeated, out of range (E, and -1 as int32); no group_size or bits passed."""
    n_experts, n_out, n_in = 6, 13, 96
    w, s = make_fp(rng, n_experts, n_out, n_in, mode)
    index_dtype = mx.uint32 if shared else mx.int32
    bad = n_experts if shared else -1
    ids = mx.array([[0, 5], [3, 3], [5, bad], [2, 0]], dtype=index_dtype)
    x = make_x(rng, (4, n_in) if shared else (4, 2, n_in), dtype)
    run_qmv(x, w, s, ids, mode, any_backend)


@pytest.mark.parametrize("n_in", (16, 48))
def test_expert_qmv_nvfp4_k_multiple_of_16(any_backend, poisoned_outputs, rng, n_in):
    """nvfp4 groups of 16: K need not be a multiple of 32 (one lane chunk is one group)."""
    w, s = make_fp(rng, 3, 9, n_in, "nvfp4")
    ids = mx.array([[2, 0], [1, 1]], dtype=mx.uint32)
    run_qmv(make_x(rng, (2, n_in), mx.float16), w, s, ids, "nvfp4", any_backend)


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=_dname)
def test_expert_qmv_wide_scales(any_backend, poisoned_outputs, rng, dtype, mode):
    """Scales over 230 binades (mxfp4) / every finite E4M3 byte, both signs (nvfp4)."""
    w, s = make_fp(rng, 3, 16, 128, mode, wide=True)
    ids = mx.array([[2, 0, 1]], dtype=mx.uint32)
    run_qmv(make_x(rng, (1, 128), dtype), w, s, ids, mode, any_backend)


@pytest.mark.parametrize("shared", (
    pytest.param(True, id="gate_up"),
    pytest.param(False, id="down", marks=pytest.mark.slow),  # the same kernel path, per-expert x
))
def test_expert_qmv_gpt_oss_20b_decode(any_backend, poisoned_outputs, rng, shared):
    """gpt-oss-20b's expert matrices (mxfp4, K = N = 2880) at decode: one token, top-4
    (ids first, last and repeated among 8 experts of the real shape; about 12 s through the
    emulator)."""
    n_experts, n, k = 8, 2880, 2880
    w, s = make_fp(rng, n_experts, n, k, "mxfp4")
    ids = mx.array([[7, 0, 3, 3]], dtype=mx.int32)
    x = make_x(rng, (1, k) if shared else (1, 4, k), mx.bfloat16)
    run_qmv(x, w, s, ids, "mxfp4", any_backend)


def test_expert_qmv_matches_native_mxfp4_layout(any_backend, poisoned_outputs, rng):
    """Weights as nn.quantize(mode="mxfp4") / mlx-lm's QuantizedSwitchLinear store them:
    same result as the oracle, and as mx.gather_qmm(mode="mxfp4") within the tolerance."""
    wf = mx.array(rng.standard_normal((4, 32, 64)).astype(np.float32))
    w, s = mx.quantize(wf, mode="mxfp4")
    assert w.dtype == mx.uint32 and s.dtype == mx.uint8 and tuple(s.shape) == (4, 32, 2)
    ids = mx.array([[3, 1], [0, 0]], dtype=mx.uint32)
    x = make_x(rng, (2, 64), mx.float32)
    out = run_qmv(x, w, s, ids, "mxfp4", any_backend)
    native = mx.gather_qmm(x[..., None, None, :], w, s, None, rhs_indices=ids, mode="mxfp4")
    _, mag, _ = qmv_oracle(x, w, s, ids, "mxfp4")
    assert_close(out, native[..., 0, :], mx.float32, magnitude=mag, what="vs gather_qmm")


def test_expert_qmv_fp_reads_no_biases(rng):
    """Emulator counters: an fp mode reads the selected experts' words and scale bytes once
    and nothing of its biases input."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    w, s = make_fp(rng, 5, 16, 64, "nvfp4")
    ids = mx.array([[4, 1]], dtype=mx.uint32)
    with backends.use_backend("emulator"):
        run_qmv(make_x(rng, (1, 64), mx.float16), w, s, ids, "nvfp4", "emulator")
    stats = emulator.last_launch_stats()
    assert stats.bytes_read["w"] == 2 * 16 * 64 // 2
    assert stats.bytes_read["scales"] == 2 * 16 * 64 // 16
    assert stats.bytes_read.get("biases", 0) == 0


# ---- moe_gather_qmm -----------------------------------------------------------------------

def gqmm_oracle(x, w, scales, indices, mode, dtype):
    """out[m] = x[m] @ T(W[ids[m]]).T in float64 (each weight rounded once to x's dtype, the
    op's contract), NaN rows for ids outside [0, E); with the magnitude sum |x| |W|."""
    ids, valid = _ids_valid(indices, w.shape[0])
    xs = to_f64(x)
    want = np.full((xs.shape[0], w.shape[1]), np.nan)
    mag = np.zeros_like(want)
    wn, sn = np.array(w), np.array(scales)
    for e in np.unique(ids[valid]):
        wd = dequantize64(wn[e], sn[e], mode)  # exact in float32: round that to T
        wd = to_f64(mx.array(wd.astype(np.float32)).astype(dtype))
        at = ids == e
        want[at] = xs[at] @ wd.T
        mag[at] = np.abs(xs[at]) @ np.abs(wd).T
    return want, mag, valid


def run_gqmm(x, w, scales, ids, mode, backend):
    # the kernel the plan runs: the GEMV for few rows per expert (cuda), else simdgroup
    gemv = gqmm_module.uses_gemv(ids.size, w.shape[0], backend, None)
    kernel = (gqmm_module.GEMV_SPEC if gemv else gqmm_module.SIMDGROUP_SPEC).name
    with expect_launches(backend, 1, kernel):
        out = mt.moe_gather_qmm(x, w, scales, None, ids, mode=mode)
        mx.eval(out)
    want, mag, valid = gqmm_oracle(x, w, scales, ids, mode, x.dtype)
    check_rows(out, want, mag, valid, x.dtype, f"moe_gather_qmm[{backend}, {mode}]")
    return out


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_moe_gather_qmm_fp_modes(any_backend, poisoned_outputs, rng, dtype, mode):
    """13 rows (a ragged 8-row tile), unsorted ids with runs, first / last / repeated
    experts and out-of-range ids (E and -1); no group_size or bits passed."""
    n_experts, n_out, n_in = 5, 64, 128
    w, s = make_fp(rng, n_experts, n_out, n_in, mode)
    ids = mx.array([3, 3, 0, 4, 4, 4, 1, -1, 0, 2, 5, 4, 0], dtype=mx.int32)
    x = make_x(rng, (13, n_in), dtype)
    run_gqmm(x, w, s, ids, mode, any_backend)


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=_dname)
def test_moe_gather_qmm_wide_scales(any_backend, poisoned_outputs, rng, dtype, mode):
    w, s = make_fp(rng, 3, 32, 64, mode, wide=True)
    ids = mx.array([2, 0, 1, 1, 0], dtype=mx.uint32)
    run_gqmm(make_x(rng, (5, 64), dtype), w, s, ids, mode, any_backend)


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype, wide", [(mx.float16, False), (mx.bfloat16, True)],
                         ids=("float16", "bfloat16-wide-scales"))
def test_moe_gather_qmm_fp_modes_gemv(kernel_backend, poisoned_outputs, rng, dtype, wide,
                                      mode):
    """The GEMV plan (cuda's for few rows per expert) in every fp mode: unsorted ids, an
    out-of-range one, each weight rounded to x's dtype as the tiled kernel rounds it."""
    w, s = make_fp(rng, 5, 64, 128, mode, wide=wide)
    ids = mx.array([3, 3, 0, 4, -1, 1, 0, 2, 5], dtype=mx.int32)
    with gemv_plan(kernel_backend, 1e9):
        run_gqmm(make_x(rng, (9, 128), dtype), w, s, ids, mode, kernel_backend)


@pytest.mark.slow
def test_moe_gather_qmm_gpt_oss_20b(any_backend, poisoned_outputs, rng):
    """gpt-oss-20b's expert shape (mxfp4, K = N = 2880), 2 tokens x top-4, sorted rows."""
    w, s = make_fp(rng, 8, 2880, 2880, "mxfp4")
    ids = mx.array([0, 0, 2, 3, 5, 7, 7, 7], dtype=mx.uint32)
    run_gqmm(make_x(rng, (8, 2880), mx.bfloat16), w, s, ids, "mxfp4", any_backend)


def test_moe_gather_qmm_fp_modes_run_simdgroup(kernel_backend, rng):
    """The mpp kernel is affine only: auto picks simdgroup for the fp modes, and asking for
    mpp says so."""
    w, s = make_fp(rng, 2, 32, 64, "mxfp4")
    x, ids = make_x(rng, (3, 64), mx.float32), mx.array([1, 0, 1], dtype=mx.uint32)
    run_gqmm(x, w, s, ids, "mxfp4", kernel_backend)
    with pytest.raises(ValueError, match=r"\[moe_gather_qmm\] variant 'mpp' runs mode "
                                         r"'affine' only, got mode 'mxfp4'"):
        mt.moe_gather_qmm(x, w, s, None, ids, mode="mxfp4", variant="mpp")


def test_moe_gather_qmm_bits_default_is_mx_quantize(any_backend, rng):
    """bits defaults to 4 and group_size to 64 (mx.quantize's affine defaults)."""
    wf = mx.array(rng.standard_normal((3, 32, 128)).astype(np.float32))
    w, s, b = mx.quantize(wf)
    x, ids = make_x(rng, (4, 128), mx.float32), mx.array([0, 2, 2, 1], dtype=mx.uint32)
    got = mt.moe_gather_qmm(x, w, s, b, ids)
    want = mt.moe_gather_qmm(x, w, s, b, ids, group_size=np.int64(64), bits=np.int32(4))
    assert np.array_equal(np.array(got), np.array(want))


# ---- fp4_qmm ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", FP4_MODES)
def test_fp4_qmm_mode(any_backend, poisoned_outputs, rng, mode):
    """mode= names the format; nvfp4 needs no group_size; None reads it from the arrays."""
    w, s = make_fp(rng, 1, 64, 128, mode)
    w, s = w[0], s[0]
    x = make_x(rng, (3, 128), mx.float16)
    ref = np.einsum("mk,nk->mn", to_f64(x), dequantize64(w, s, mode))
    mag = np.einsum("mk,nk->mn", np.abs(to_f64(x)), np.abs(dequantize64(w, s, mode)))
    for kw in ({"mode": mode}, {}, {"mode": mode, "group_size": np.int64(GROUP[mode])}):
        before = backends.launch_count(backend=any_backend)
        out = mt.fp4_qmm(x, w, s, **kw)
        mx.eval(out)
        if any_backend != "reference":
            assert backends.launch_count(backend=any_backend) == before + 1
        assert_close(out, ref, mx.float16, magnitude=mag, what=f"fp4_qmm {kw}")


@pytest.mark.parametrize("mode", FP_MODES)
def test_numpy_integer_sizes_and_compile(any_backend, rng, mode):
    """NumPy integers as group_size / bits, and mx.compile (not through the eager emulator),
    give the plain call's result."""
    w, s = make_fp(rng, 3, 32, 64, mode)
    x, ids = make_x(rng, (4, 64), mx.float16), mx.array([2, 0, 1, 2], dtype=mx.uint32)
    sizes = dict(group_size=np.int64(GROUP[mode]), bits=np.int32(BITS[mode]))
    for op, idx in ((mt.expert_qmv, ids.reshape(2, 2)), (mt.moe_gather_qmm, ids)):
        xs = x[:2] if op is mt.expert_qmv else x
        plain = op(xs, w, s, None, idx, mode=mode)
        compiled = mx.compile(lambda a, op=op, idx=idx: op(a, w, s, None, idx, mode=mode))
        runs = [op(xs, w, s, None, idx, mode=mode, **sizes)]
        if any_backend != "emulator":
            runs.append(compiled(xs))
        for got in runs:
            assert np.array_equal(np.array(got), np.array(plain), equal_nan=True)


# ---- a mode that contradicts its arrays ---------------------------------------------------

def _affine_case(bits=4, group_size=64):
    w, s, b = mx.quantize(mx.zeros((2, 32, 128)), group_size=group_size, bits=bits)
    return w, s, b


def _fp_case(mode):
    return mx.quantize(mx.zeros((2, 32, 128)), mode=mode)


MISMATCHES = [
    # (description, arrays (w, scales, biases), kwargs, exception, message)
    ("affine without biases", lambda: (*_fp_case("mxfp4"), None), {},
     ValueError, r"mode 'affine' needs biases"),
    ("affine given uint8 scales", lambda: (_fp_case("mxfp4")[0], _fp_case("mxfp4")[1],
                                           mx.zeros((2, 32, 4))), {},
     TypeError, r"mode 'affine' takes scales in x's dtype, got uint8"),
    ("mxfp4 given biases", lambda: _affine_case(), {"mode": "mxfp4"},
     ValueError, r"mode 'mxfp4' takes biases=None"),
    ("nvfp4 given float scales", lambda: (*_affine_case()[:2], None), {"mode": "nvfp4"},
     TypeError, r"mode 'nvfp4' needs uint8 E4M3 scales"),
    ("nvfp4 arrays read as mxfp4", lambda: (*_fp_case("nvfp4"), None), {"mode": "mxfp4"},
     ValueError, r"(groups per row|must have shape)"),
    ("mxfp4 with group_size 64", lambda: (*_fp_case("mxfp4"), None),
     {"mode": "mxfp4", "group_size": 64}, ValueError, r"mode 'mxfp4' has group_size 32"),
    ("nvfp4 with bits 8", lambda: (*_fp_case("nvfp4"), None), {"mode": "nvfp4", "bits": 8},
     ValueError, r"mode 'nvfp4' has bits 4"),
    ("unknown mode", lambda: (*_fp_case("mxfp4"), None), {"mode": "fp4"},
     ValueError, r"mode must be one of \('affine', 'mxfp4', 'nvfp4', 'mxfp8'\), got 'fp4'"),
    ("mxfp8 with bits 4", lambda: (*_fp_case("mxfp8"), None), {"mode": "mxfp8", "bits": 4},
     ValueError, r"mode 'mxfp8' has bits 8"),
    ("mxfp4 arrays read as mxfp8", lambda: (*_fp_case("mxfp4"), None), {"mode": "mxfp8"},
     ValueError, r"(groups per row|must have shape)"),
    ("mode not a string", lambda: (*_fp_case("mxfp4"), None), {"mode": 1},
     ValueError, r"mode must be one of"),
]


@pytest.mark.parametrize("op", ("expert_qmv", "moe_gather_qmm"))
@pytest.mark.parametrize("what, arrays, kw, exc, match", MISMATCHES,
                         ids=[m[0] for m in MISMATCHES])
def test_mode_contradicting_arrays(any_backend, op, what, arrays, kw, exc, match):
    w, s, b = arrays()
    x = mx.zeros((2, 128), dtype=mx.float32)
    ids = mx.array([0, 1], dtype=mx.uint32)
    if op == "expert_qmv":
        ids = ids[None]
    with pytest.raises(exc, match=rf"^\[{op}\] .*{match}"):
        getattr(mt, op)(x, w, s, b, ids, **kw)


@pytest.mark.parametrize("kw, exc, match", [
    ({"mode": "affine"}, ValueError, r"mode must be one of \('mxfp4', 'nvfp4'\) or None, "
                                     r"got 'affine'"),
    ({"mode": "mxfp8"}, ValueError, r"mode must be one of \('mxfp4', 'nvfp4'\) or None, "
                                    r"got 'mxfp8'"),
    ({"mode": "nvfp4"}, ValueError, r"scales must have shape \[N, K/group_size\] = \(32, 8\) "
                                    r"\(group_size 16 of mode 'nvfp4'\), got \(32, 4\)"),
    ({"mode": "mxfp4", "group_size": 16}, ValueError, r"mode 'mxfp4' has group_size 32"),
    ({"mode": "mxfp4", "group_size": 32.0}, TypeError, r"group_size must be an int, got float"),
])
def test_fp4_qmm_mode_contradicting_arrays(any_backend, kw, exc, match):
    w, s = mx.quantize(mx.zeros((32, 128)), mode="mxfp4")
    with pytest.raises(exc, match=rf"^\[fp4_qmm\] {match}"):
        mt.fp4_qmm(mx.zeros((1, 128)), w, s, **kw)
    with pytest.raises(TypeError, match=r"^\[fp4_qmm\] mode 'mxfp4' needs uint8 E8M0"):
        mt.fp4_qmm(mx.zeros((1, 128)), w, s.astype(mx.float32), mode="mxfp4")


# ---- instantiations and negative controls -------------------------------------------------

def test_instantiations_cover_the_fp_launches(launch_recorder, rng):
    """Every fp-mode launch is an instantiation the op module declares (the CUDA compile
    check builds those)."""
    for mode in FP_MODES:
        w, s = make_fp(rng, 3, 32, 64, mode)
        for dtype in DTYPES:
            for index_dtype in (mx.uint32, mx.int32):
                x = make_x(rng, (9, 64), dtype)
                ids = mx.array([0, 2, 1, 1, 0, 2, 2, 1, 0], dtype=index_dtype)
                mt.expert_qmv(x[:3], w, s, None, ids.reshape(3, 3), mode=mode)
                mt.moe_gather_qmm(x, w, s, None, ids, mode=mode)
    launch_recorder.assert_declared()


# (op, what breaks, text replaced, replacement, the modes whose decode it breaks)
BREAKAGES = [
    ("expert_qmv", "e2m1_sign_dropped", "float2(mt_e2m1x2(word >> (4 * i)))",
     "float2(mt_e2m1x2((word >> (4 * i)) & 0x00770077u))", FP4_MODES),
    ("expert_qmv", "scale_byte_read_as_value", "s = mt_fp4_scale<SCALE_FORMAT>(g);",
     "s = float(g);", FP_MODES),
    ("expert_qmv", "e4m3_element_read_as_e8m0", "dot += mt_fp4_scale<2>(word >> (8 * i))",
     "dot += mt_fp4_scale<1>(word >> (8 * i))", ("mxfp8",)),
    ("moe_gather_qmm", "codes_i_plus_4_swapped", "dst[j * 8 + i + 4] = S(p.y);",
     "dst[j * 8 + i + 4] = S(p.x);", FP4_MODES),
    ("moe_gather_qmm", "scale_byte_read_as_value",
     "scale = mt_fp4_scale<SCALE_FORMAT>(w_scales[group]);", "scale = float(w_scales[group]);",
     FP_MODES),
    ("moe_gather_qmm", "e4m3_element_sign_dropped", "scale * mt_fp4_scale<2>(word >> (8 * i))",
     "scale * mt_fp4_scale<2>((word >> (8 * i)) & 0x7Fu)", ("mxfp8",)),
]
BROKEN_CASES = [pytest.param(op, tag, old, new, mode, id=f"{op}-{tag}-{mode}")
                for op, tag, old, new, modes in BREAKAGES for mode in modes]


@pytest.mark.parametrize("op, tag, old, new, mode", BROKEN_CASES)
def test_negative_control_broken_decode(poisoned_outputs, broken_kernel, rng, op, tag, old,
                                        new, mode):
    """A deliberately broken fp decode in the kernel must fail the oracle."""
    require_backend("emulator")
    w, s = make_fp(rng, 3, 32, 64, mode)
    x = make_x(rng, (4, 64), mx.float32)
    ids = mx.array([2, 0, 1, 2], dtype=mx.uint32)
    with backends.use_backend("emulator"), pytest.raises(AssertionError,
                                                         match="out of tolerance"):
        if op == "expert_qmv":
            broken_kernel(qmv_module.SPEC, (old, new))
            run_qmv(x[:2], w, s, ids.reshape(2, 2), mode, "emulator")
        else:
            broken_kernel(gqmm_module.SIMDGROUP_SPEC, (old, new))
            run_gqmm(x, w, s, ids, mode, "emulator")
