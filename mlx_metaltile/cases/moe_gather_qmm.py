"""moe_gather_qmm: float64 oracle from the math, benchmark cases, checked calls."""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
from functools import partial

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from .. import backends
from ..ops._common import clear_plans
from ..ops.moe_gather_qmm import DX_SPEC, GEMV_SPEC, VARIANT_SPECS, uses_gemv
from . import _mxfp4
from ._base import BenchCase, check_rows, grad_case, oracle_and_magnitude, to_f64, verify
from .expert_glu import dequantize

op_module = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm")

OP = "moe_gather_qmm"


# ---- the oracle, from the math ---------------------------------------------------------

def round_to(values: np.ndarray, dtype) -> np.ndarray:
    """float64 -> nearest value of ``dtype`` (ties to even), back in float64."""
    if dtype == mx.float32:
        return values.astype(np.float32).astype(np.float64)
    if dtype == mx.float16:
        return values.astype(np.float16).astype(np.float64)
    # bfloat16: 8 significant bits; the exponent range of float32 (no subnormal values here).
    mant, expo = np.frexp(values)
    return np.ldexp(np.rint(mant * 256.0) / 256.0, expo)


def unpack_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """[..., K*bits/32] uint32 words -> [..., K] codes, low bits first."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint64) * bits
    codes = (w.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*w.shape[:-1], w.shape[-1] * per_word).astype(np.float64)


def expert_weights(w, scales, biases, group_size, bits, dtype) -> np.ndarray:
    """One expert's W = dtype(scale * q + bias), float64 (scales, biases float64)."""
    q = unpack_codes(w, bits)
    wd = q * np.repeat(scales, group_size, axis=-1) + np.repeat(biases, group_size, axis=-1)
    return round_to(wd, dtype)


def oracle(x, w, scales, biases, indices, group_size, bits, dtype):
    """out[m] = W[e_m] @ x[m], W = dtype(scale * q + bias); NaN rows for e_m outside [0, E).

    Returns (out, magnitude): magnitude[m, n] = sum_k |x[m, k] * W[e_m, n, k]|. One expert
    is dequantized at a time (the stacks of the benchmarks are large).
    """
    xf = to_f64(x)
    ids = np.array(indices).astype(np.int64)
    wn = np.array(w)
    E, N = wn.shape[:2]
    s = to_f64(scales)
    b = to_f64(biases)
    out = np.full((xf.shape[0], N), np.nan)
    mag = np.zeros((xf.shape[0], N))
    for e in np.unique(ids):
        if not 0 <= e < E:
            continue
        wt = expert_weights(wn[e], s[e], b[e], group_size, bits, dtype)
        rows = ids == e
        out[rows] = xf[rows] @ wt.T
        mag[rows] = np.abs(xf[rows]) @ np.abs(wt).T
    return out, mag


def grad_oracle(x, w, scales, biases, indices, g, group_size, bits):
    """float64 [(dx, magnitude sum |terms|)] of the VJP with cotangent g [M, N]:
    dx[m] = g[m] @ W[e_m] with the weights the forward multiplies by (rounded to x's
    dtype); NaN rows for e_m outside [0, E)."""
    gf = to_f64(g)
    ids = np.array(indices).astype(np.int64)
    wn, s, b = np.array(w), to_f64(scales), to_f64(biases)
    E = wn.shape[0]
    dx = np.full((gf.shape[0], x.shape[-1]), np.nan)
    mag = np.zeros_like(dx)
    for e in np.unique(ids):
        if 0 <= e < E:
            wt = expert_weights(wn[e], s[e], b[e], group_size, bits, x.dtype)
            rows = ids == e
            dx[rows] = gf[rows] @ wt
            mag[rows] = np.abs(gf[rows]) @ np.abs(wt)
    return [(dx, mag)]


def dx_oracle(g, w, scales, biases, indices, group_size, bits, mode, dtype):
    """(dx, magnitude) in float64 of the x-VJP, every mode: dx[m] = g[m] @ W[e_m] with
    W = dtype(scale * q + bias) (fp modes: dtype(scale * fp(q))) decoded from the format's
    definition, then rounded once to ``dtype``; NaN rows for e_m outside [0, E)."""
    gf = to_f64(g)
    ids = np.array(indices).astype(np.int64)
    E = w.shape[0]
    K = w.shape[2] * 32 // bits
    dx = np.full((gf.shape[0], K), np.nan)
    mag = np.zeros_like(dx)
    for e in np.unique(ids):
        if 0 <= e < E:
            wt = round_to(dequantize(np.array(w[int(e)]), scales[int(e)],
                                     None if biases is None else biases[int(e)], mode,
                                     group_size, bits), dtype)
            rows = ids == e
            dx[rows] = gf[rows] @ wt
            mag[rows] = np.abs(gf[rows]) @ np.abs(wt)
    return dx, mag


# ---- inputs ----------------------------------------------------------------------------

def make_weights(rng, E, N, K, group_size, bits, dtype):
    """Random codes and per-group scales/biases in mx.quantize's layout (scales of both signs)."""
    w = mx.array(rng.integers(0, 2**32, size=(E, N, K * bits // 32), dtype=np.uint32))
    scales = rng.standard_normal((E, N, K // group_size)) * 0.05
    biases = rng.standard_normal((E, N, K // group_size)) * 0.5
    return (w, mx.array(scales.astype(np.float32)).astype(dtype),
            mx.array(biases.astype(np.float32)).astype(dtype))


def make_case(rng, E, M, N, K, group_size, bits, dtype, ids=None, index_dtype=mx.uint32):
    if ids is None:
        ids = np.sort(rng.integers(0, E, size=M))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    w, scales, biases = make_weights(rng, E, N, K, group_size, bits, dtype)
    return x, w, scales, biases, mx.array(np.asarray(ids), dtype=index_dtype)


def make_fp_weights(rng, E, N, K, mode):
    """Random codes and uint8 scales of an fp mode, in mx.quantize's layout (biases None).
    E8M0 scales near 1 (elements up to 6, mxfp8's up to 448); nvfp4's E4M3 scales are any
    byte of either sign. E4M3 bytes 0x7F / 0xFF (NaN to MLX's CPU, +-480 to the kernels;
    mx.quantize never writes them) are not drawn."""
    bits = 8 if mode == "mxfp8" else 4
    group_size = 16 if mode == "nvfp4" else 32
    words = rng.integers(0, 2**32, size=(E, N, K * bits // 32), dtype=np.uint32)
    if mode == "mxfp8":
        codes = words.view(np.uint8)
        codes[(codes & 0x7F) == 0x7F] -= 1
    w = mx.array(words)
    shape = (E, N, K // group_size)
    if mode == "nvfp4":
        scales = rng.integers(0, 256, size=shape)
        scales[(scales & 0x7F) == 0x7F] -= 1
    else:
        scales = rng.integers(116, 127, size=shape) if mode == "mxfp8" else \
            rng.integers(120, 131, size=shape)
    return w, mx.array(scales.astype(np.uint8)), None


def run_and_check_dx(g, w, scales, biases, indices, group_size, bits, mode, dtype, backend,
                     what=""):
    """The x-VJP of moe_gather_qmm (rows form, cotangent g [M, N]) against dx_oracle; on a
    kernel backend exactly one launch, of the dx kernel (never the composite). Returns dx."""
    M, K = g.shape[0], w.shape[2] * 32 // bits
    x = mx.zeros((M, K), dtype=dtype)  # dx does not depend on x
    before_all = backends.launch_count()
    before = backends.launch_count(DX_SPEC.name, backend)

    def forward(x):
        return mt.moe_gather_qmm(x, w, scales, biases, indices, group_size=group_size,
                                 bits=bits, mode=mode)

    _, (dx,) = mx.vjp(forward, [x], [g])
    mx.eval(dx)
    if backend != "reference":  # the forward's kernel, then the dx kernel: nothing else
        verify(backends.launch_count(DX_SPEC.name, backend) == before + 1, DX_SPEC.name)
        verify(backends.launch_count() == before_all + 2)
    else:  # the composite of native ops dispatches no kernel of ours
        verify(backends.launch_count() == before_all)
    want, mag = dx_oracle(g, w, scales, biases, indices, group_size, bits, mode, dtype)
    check_rows(dx, want, mag, ~np.isnan(want[:, 0]), dtype,
               f"moe_gather_qmm dx[{backend}/{mode}]{what}")
    if backend == "emulator":
        from mlx_metaltile import emulator

        stats = emulator.last_launch_stats()
        verify(stats.kernel.startswith(f"mt_{DX_SPEC.name}"), stats.kernel)
        partials = op_module.dx_slices(M, g.shape[1], K, bits, backend) * M * K
        verify(stats.bytes_written["dx"] == partials * 4, (
            f"{what}: {stats.bytes_written['dx']} bytes written to dx, expected each of the "
            f"{partials} float32 elements (every slice's partial of each) once"))
    return dx


def run_and_check(case, group_size, bits, dtype, backend, variant=None, what=""):
    x, w, scales, biases, indices = case
    # the kernel that must run: the plan's GEMV for few rows per expert, else the variant's
    gemv = uses_gemv(indices.size, w.shape[0], backend, variant)
    name = GEMV_SPEC.name if gemv else VARIANT_SPECS[variant or "simdgroup"].name
    before = backends.launch_count(backend=backend)
    before_all = backends.launch_count()
    before_name = backends.launch_count(name, backend)
    out = mt.moe_gather_qmm(x, w, scales, biases, indices, group_size=group_size, bits=bits,
                            variant=variant)
    mx.eval(out)
    if backend != "reference":  # prove the kernel ran (never the reference against itself)
        verify(backends.launch_count(name, backend) == before_name + 1, name)
        verify(backends.launch_count(backend=backend) == before + 1)
    else:  # the composite of native ops dispatches no kernel of ours
        verify(backends.launch_count() == before_all)
    want, mag = oracle(x, w, scales, biases, indices, group_size, bits, dtype)
    check_rows(out, want, mag, ~np.isnan(want[:, 0]), dtype,
               f"moe_gather_qmm[{backend}/{variant}]{what}")
    if backend == "emulator":
        # The emulator poisons outputs with NaN, the value of an out-of-range row: the byte
        # counter proves every output element was written, and exactly once.
        from mlx_metaltile import emulator

        stats = emulator.last_launch_stats()
        verify(stats.kernel.startswith(f"mt_{name}"), stats.kernel)
        verify(stats.bytes_written["out"] == out.size * dtype.size, (
            f"{what}: {stats.bytes_written['out']} bytes written to out, "
            f"expected each of the {out.size} elements once"))
    return out


# One checked call per registered kernel variant (tests/test_registry.py runs them for
# every registered variant on each kernel backend where it can run, so a variant added to
# the registry fails there until it has one here).
def _variant_call(variant, backend, rng):
    case = make_case(rng, 4, 13, 64, 128, 64, 4, mx.bfloat16)
    run_and_check(case, 64, 4, mx.bfloat16, backend, variant)


def _dx_call(backend, rng):
    x, w, scales, biases, indices = make_case(rng, 4, 13, 64, 128, 64, 4, mx.bfloat16)
    g = mx.array(rng.standard_normal((13, 64)).astype(np.float32)).astype(mx.bfloat16)
    run_and_check_dx(g, w, scales, biases, indices, 64, 4, "affine", mx.bfloat16, backend)


@contextlib.contextmanager
def gemv_plan(backend: str, rows_per_expert: float | None):
    """The plan's GEMV_ROWS_PER_EXPERT for ``backend`` set to ``rows_per_expert`` (None: not
    listed, the tiled kernels) inside the block, the plans rebuilt on entry and exit."""
    saved = op_module.GEMV_ROWS_PER_EXPERT
    plan = {b: v for b, v in saved.items() if b != backend}
    if rows_per_expert is not None:
        plan[backend] = rows_per_expert
    op_module.GEMV_ROWS_PER_EXPERT = plan
    clear_plans()
    try:
        yield
    finally:
        op_module.GEMV_ROWS_PER_EXPERT = saved
        clear_plans()


@contextlib.contextmanager
def dx_slicing(min_blocks: int | None):
    """The dx kernel's split of N forced on every kernel backend inside the block: as many
    slices as leave each DX_MIN_SLICE_BLOCKS = ``min_blocks`` 32-row blocks (a target of
    2^30 working threadgroups; 1 block: one block per slice); None: the plan as it is. The
    plans rebuilt on entry and exit."""
    saved = op_module.DX_SLICE_TARGET_TGS, op_module.DX_MIN_SLICE_BLOCKS
    if min_blocks is not None:
        op_module.DX_SLICE_TARGET_TGS = dict.fromkeys(("emulator", "metal", "cuda"), 2**30)
        op_module.DX_MIN_SLICE_BLOCKS = min_blocks
    clear_plans()
    try:
        yield
    finally:
        op_module.DX_SLICE_TARGET_TGS, op_module.DX_MIN_SLICE_BLOCKS = saved
        clear_plans()


def _gemv_call(backend, rng):
    with gemv_plan(backend, 4):
        case = make_case(rng, 4, 13, 64, 128, 64, 4, mx.bfloat16)
        run_and_check(case, 64, 4, mx.bfloat16, backend)


VARIANT_CALLS = {v: functools.partial(_variant_call, v) for v in VARIANT_SPECS}
VARIANT_CALLS[DX_SPEC.variant] = _dx_call  # the x-VJP kernel
VARIANT_CALLS[GEMV_SPEC.variant] = _gemv_call  # few rows per expert (cuda's plan)


# ---- benchmarks -------------------------------------------------------------------------

def _bench_terms(x, w, scales, biases, indices, *, group_size, bits):
    return oracle(x, w, scales, biases, indices, group_size, bits, x.dtype)[:2]


def _native(x, w, scales, biases, indices, *, group_size, bits):
    # MLX's own call for sorted MoE rows (x as [M, 1, K]): per-pair matvecs unless every
    # expert has >= 4 rows on average, then its tiled kernel.
    out = mx.gather_qmm(x[:, None, :], w, scales, biases, rhs_indices=indices, transpose=True,
                        group_size=group_size, bits=bits, sorted_indices=True)
    return out.reshape(x.shape[0], w.shape[1])


def _routing(tokens: int, n_experts: int, top_k: int, seed: int) -> np.ndarray:
    """Sorted expert ids of ``tokens`` tokens, each routed to ``top_k`` distinct experts."""
    rng = np.random.default_rng(seed)
    ids = [rng.choice(n_experts, size=top_k, replace=False) for _ in range(tokens)]
    return np.sort(np.concatenate(ids)).astype(np.uint32)


def _bench_make(rng, *, E, n, k, bits, ids, dtype, group_size):
    # Positive data: no cancellation, so the relative check of the suite holds.
    m = ids.shape[0]
    words = rng.integers(0, 2**32, size=(E, n, k * bits // 32), dtype=np.uint64)
    shape = (E, n, k // group_size)
    return dict(
        x=mx.array(rng.uniform(0.5, 1.0, (m, k)).astype(np.float32)).astype(dtype),
        w=mx.array(words.astype(np.uint32)),
        scales=mx.array(rng.uniform(0.5, 1.0, shape).astype(np.float32)
                        / (1 << bits)).astype(dtype),
        biases=mx.array(rng.uniform(0.0, 0.5, shape).astype(np.float32)).astype(dtype),
        indices=mx.array(ids))


def bench_cases() -> list[BenchCase]:
    out = []
    E, top_k, group_size = 128, 8, 64
    for n, k in ((768, 2048), (2048, 768)):
        for rows in (8, 32, 128, 1024):
            for bits, dtype in itertools.product((4, 8), (mx.bfloat16, mx.float32)):
                if dtype == mx.float32 and not (bits == 4 and n == 768 and rows in (8, 128)):
                    continue  # float32: a few cases (MLX's CPU gather_qmm is exact only there)
                ids = _routing(rows // top_k, E, top_k, seed=rows * 7 + n)

                make = partial(_bench_make, E=E, n=n, k=k, bits=bits, ids=ids, dtype=dtype,
                               group_size=group_size)
                touched = len(np.unique(ids))
                w_bytes = touched * n * (k * bits // 8 + 2 * (k // group_size) * dtype.size)
                nbytes = rows * k * dtype.size + w_bytes + rows * 4 + rows * n * dtype.size
                kw = dict(group_size=group_size, bits=bits)
                exact, magnitude = oracle_and_magnitude(partial(_bench_terms, **kw))
                out.append(BenchCase(
                    op=OP, label=f"M{rows}-N{n}-K{k}-E{E}-b{bits}", dtype=dtype,
                    make=make, ours=partial(mt.moe_gather_qmm, **kw),
                    native=partial(_native, **kw), oracle=exact, magnitude=magnitude,
                    nbytes=nbytes, flops=2 * rows * n * k,
                    quick=rows in (8, 128) and n == 768 and bits == 4 and dtype == mx.bfloat16))
    return out + _mxfp4_cases() + grad_bench_cases()


def _mxfp4_native(x, w, scales, indices):
    y = mx.gather_qmm(x[:, None, :], w, scales, None, rhs_indices=indices, transpose=True,
                      mode="mxfp4", sorted_indices=True)
    return y.reshape(x.shape[0], w.shape[1])


def _mxfp4_cases(dtype=mx.bfloat16) -> list[BenchCase]:
    """gpt-oss-20b's mxfp4 experts: expert-sorted rows of tokens x top_k (verification
    blocks, prefill)."""
    E, top_k, n, k = (_mxfp4.GPT_OSS_20B[key] for key in ("E", "top_k", "n", "k"))
    out = []
    for rows in (8, 32, 128):
        ids = np.sort(_mxfp4.routing(rows // top_k, E, top_k, seed=rows).reshape(-1))
        touched = len(np.unique(ids))
        nbytes = (rows * k * dtype.size + touched * n * (k // 2 + k // 32) + rows * 4
                  + rows * n * dtype.size)
        exact, magnitude = oracle_and_magnitude(partial(_mxfp4.product_terms, rounded=True))
        out.append(BenchCase(
            op=OP, label=f"gpt-oss-20b-mxfp4-M{rows}-N{n}-K{k}-E{E}",
            dtype=dtype, make=partial(_mxfp4.make, rows_x=(rows,), ids=ids, dtype=dtype, E=E,
                                      n=n, k=k),
            ours=partial(mt.moe_gather_qmm, biases=None, mode="mxfp4", group_size=32,
                         bits=4), native=_mxfp4_native,
            oracle=exact, magnitude=magnitude,
            nbytes=nbytes, flops=2 * rows * n * k, quick=rows == 32))
    return out


# ---- forward + backward vs MLX's autodiff of gather_qmm -----------------------------------

def _grad_terms(x, w, scales, biases, indices, g, *, group_size, bits):
    return grad_oracle(x, w, scales, biases, indices, g, group_size, bits)


def _grad_make(rng, *, n, **kw):
    inputs = _bench_make(rng, n=n, **kw)
    x = inputs["x"]
    g = rng.standard_normal((x.shape[0], n), dtype=np.float32)
    return dict(inputs, g=mx.array(g).astype(x.dtype))


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward w.r.t. x against MLX's autodiff of gather_qmm (sorted rows), at
    Qwen3-30B-A3B's gate/up shape (E = 128, top-8, N = 768, K = 2048, 4 bits): 8 rows (one
    token) and 1024 rows (128 tokens of prefill). bytes: the forward's (x, the touched
    experts' codes, scales and biases, the ids read, out written) plus the backward's (the
    same weights and ids again, g read, dx written: dx = g W needs no x)."""
    out = []
    E, top_k, group_size, bits, n, k = 128, 8, 64, 4, 768, 2048
    for rows in (8, 1024):
        for dtype in (mx.bfloat16, mx.float32) if rows == 8 else (mx.bfloat16,):
            ids = _routing(rows // top_k, E, top_k, seed=rows * 7 + n)
            touched = len(np.unique(ids))
            ds = dtype.size
            w_bytes = touched * n * (k * bits // 8 + 2 * (k // group_size) * ds)
            kw = dict(group_size=group_size, bits=bits)
            out.append(grad_case(
                op=OP, label=f"M{rows}-N{n}-K{k}-E{E}-b{bits}", dtype=dtype,
                make=partial(_grad_make, E=E, n=n, k=k, bits=bits, ids=ids, dtype=dtype,
                             group_size=group_size),
                ours=partial(mt.moe_gather_qmm, **kw), native=partial(_native, **kw),
                wrt=("x",), grad_oracle=partial(_grad_terms, **kw),
                nbytes=2 * w_bytes + 2 * rows * 4 + 2 * rows * k * ds + 2 * rows * n * ds,
                flops=2 * 2 * rows * n * k, quick=rows == 8 and dtype == mx.bfloat16))
    return out
