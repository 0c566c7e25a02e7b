"""sdpa_multi: a block of L queries attending a shared (possibly preallocated) KV cache.

Block diffusion and speculative verification forward L tokens at once against a KV cache.
The kernel reads each visible cache row once for all L queries and all Hq/Hkv query heads
that share it (up to 32 query rows per threadgroup), splits the KV range across
threadgroups to fill the GPU, and merges the partial softmax results in a small second pass.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, grid, register, scalars
from ._common import (
    FLOAT_TYPES,
    dtype_name,
    require_array,
    require_finite_scalar,
    require_float,
    scalar,
)

OP = "sdpa_multi"
__all__ = ["sdpa_multi", "sdpa_multi_reference"]
HEAD_DIMS = (64, 96, 128, 256)
ROW_TILE = 32  # query rows per threadgroup (L * Hq/Hkv rows share one KV head)
KEY_BLOCK = 32  # keys per staged block (one per lane)
STAGE_BYTES = 16 * 1024  # most bytes of one staged K or V block
COMBINE_ROWS = 4  # output rows per combine threadgroup (one simdgroup each)
# Splitting the KV range across threadgroups: aim for about TARGET_THREADS threads in
# flight, with slices of at least MIN_SPLIT_BLOCKS key blocks and at least MIN_KEYS_PER_ROW
# keys per query row of the tile (so re-reading q and writing partials stays small next to
# the K/V slice), and at most MAX_SPLITS slices. Tuning constants: they change speed, never
# results.
TARGET_THREADS = 32 * 1024
MIN_SPLIT_BLOCKS = 4
MIN_KEYS_PER_ROW = 16
MAX_SPLITS = 128
LOG2E = 1.4426950408889634
MAX_SCALE = 3.4028234663852886e38 / LOG2E  # scale * log2(e) stays a finite float32



def _tiles(D: int, dtype: mx.Dtype) -> tuple[int, int]:
    """(RS rows per simdgroup, DC staged columns) of the split kernel for (D, dtype)."""
    rows_per_simdgroup = 4 if D > 128 else 8
    itemsize = dtype.size
    staged = D if KEY_BLOCK * D * itemsize <= STAGE_BYTES else D // 2
    return rows_per_simdgroup, staged


def _split_bindings():
    for t in FLOAT_TYPES:
        for d in HEAD_DIMS:
            rs, dc = _tiles(d, t)
            yield {"T": t, "D": d, "RS": rs, "DC": dc}


SPLIT_SPEC, COMBINE_SPEC = register(
    KernelSpec(
        op=OP, variant="split", template="sdpa_multi.metal",
        inputs=(Arg("q", "T", 4), Arg("k", "T", 4), Arg("v", "T", 4),
                *scalars("n_q", "group", "kv_len", "kv_rows", "chunk", "causal"),
                Arg("scale", "float32")),
        outputs=(Arg("o_part", "float32", 3), Arg("ml_part", "float32", 3)),
        params=("T", "D", "RS", "DC"), bindings=_split_bindings,
        geometry="rows = L*Hq/Hkv per KV head, tiles of 32; TG = 32*(32/RS) threads "
                 "(RS = 8, or 4 for D=256); grid (TG*n_splits, ceil(rows/32), B*Hkv); "
                 "each TG reads its KV slice once (staged 32 keys at a time)",
        notes="template T, D, RS, DC; L, kv_len, S, G, chunk, causal, scale are runtime",
    ),
    KernelSpec(
        op=OP, variant="combine", template="sdpa_multi_combine.metal",
        inputs=(Arg("o_part", "float32", 3), Arg("ml_part", "float32", 3),
                *scalars("n_rows", "n_splits"), Arg("scale", "float32")),
        outputs=(Arg("out", "T", 4),), params=("T", "D"),
        bindings=grid(T=FLOAT_TYPES, D=HEAD_DIMS),
        geometry="one simdgroup per output row, 4 rows per TG; grid (128*ceil(rows/4), 1, 1)",
        notes="template T, D; n_rows, n_splits, scale are runtime",
    ),
)


def _check_sdpa_multi(q, k, v, scale, causal, kv_len):
    """Validate the inputs; return (B, Hq, Hkv, L, S, D, kv_len, scale, causal)."""
    for name, arr in (("q", q), ("k", k), ("v", v)):
        require_array(OP, name, arr)
    require_float(OP, "q", q)
    for name, arr in (("k", k), ("v", v)):
        if arr.dtype != q.dtype:
            raise TypeError(f"[{OP}] {name} must have q's dtype {dtype_name(q.dtype)}, "
                            f"got {dtype_name(arr.dtype)}")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim != 4:
            raise ValueError(f"[{OP}] {name} must have 4 dimensions [B, H, L or S, D], "
                             f"got {arr.ndim} (shape {tuple(arr.shape)})")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"[{OP}] k and v must have the same shape, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    B, Hq, L, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B:
        raise ValueError(f"[{OP}] k and v must have q's batch size {B}, got {Bk}")
    if Dk != D:
        raise ValueError(f"[{OP}] k and v must have q's head dim {D}, got {Dk}")
    if D not in HEAD_DIMS:
        raise ValueError(f"[{OP}] head dim must be one of {HEAD_DIMS}, got {D}")
    if Hkv < 1:
        raise ValueError(f"[{OP}] k and v must have at least 1 head, got {Hkv}")
    if Hq % Hkv:
        raise ValueError(f"[{OP}] q's heads ({Hq}) must be a multiple of k's heads ({Hkv})")
    if kv_len is None:
        if S < L:
            raise ValueError(f"[{OP}] the cache must hold at least the L={L} queries' rows "
                             f"(k and v with S >= {L} rows), got S={S}")
        kv_len = S
    elif isinstance(kv_len, bool) or not isinstance(kv_len, numbers.Integral):
        raise TypeError(f"[{OP}] kv_len must be a Python int or None, "
                        f"got {type(kv_len).__name__}")
    kv_len = int(kv_len)
    if not L <= kv_len <= S:
        raise ValueError(f"[{OP}] kv_len must satisfy L <= kv_len <= S, i.e. "
                         f"{L} <= kv_len <= {S}, got {kv_len}")
    if not isinstance(causal, bool):
        raise TypeError(f"[{OP}] causal must be a bool, got {type(causal).__name__}")
    scale = require_finite_scalar(OP, "scale", scale)
    if abs(scale) > MAX_SCALE:
        raise ValueError(f"[{OP}] scale must satisfy |scale| <= {MAX_SCALE:.4g} (the kernel "
                         f"takes scale * log2(e) as a finite float32), got {scale:g}")
    if S >= 2**31 or Hq * L >= 2**31:
        raise ValueError(f"[{OP}] problem too large: q {tuple(q.shape)}, k {tuple(k.shape)} "
                         "(expected S < 2^31 and Hq * L < 2^31)")
    return B, Hq, Hkv, L, S, D, kv_len, scale, causal


def sdpa_multi_reference(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                         causal: bool = False, kv_len: int | None = None) -> mx.array:
    """Pure-MLX composite of the same math (float32 inside, rounded once to q's dtype)."""
    B, Hq, Hkv, L, S, D, kv_len, scale, causal = _check_sdpa_multi(q, k, v, scale, causal,
                                                                   kv_len)
    return _reference(q, k, v, B, Hq, Hkv, L, D, kv_len, scale, causal)


def _reference(q, k, v, B, Hq, Hkv, L, D, kv_len, scale, causal) -> mx.array:
    G = Hq // Hkv
    qf = q.astype(mx.float32).reshape(B, Hkv, G * L, D)
    kf = k[:, :, :kv_len].astype(mx.float32)
    vf = v[:, :, :kv_len].astype(mx.float32)
    # Scores as the kernels hold them (msl_templates/common.h, mt_score_unit): scale = a * b,
    # b a power of two, |a| < 4, so a * q.k stays finite where scale * q.k would not; the
    # softmax takes b * (d - max d), exact wherever scale * q.k is finite.
    a, b = _score_unit(scale)
    scores = (qf * a) @ kf.swapaxes(-1, -2)  # [B, Hkv, G*L, kv_len]
    if causal:
        limit = mx.arange(kv_len - L, kv_len).reshape(L, 1)  # query l sees keys <= limit[l]
        visible = mx.arange(kv_len).reshape(1, kv_len) <= limit
        visible = mx.tile(visible, (G, 1))  # rows ordered (g, l)
        scores = mx.where(visible, scores, -math.inf)
    # exp(b * (d - max d)) summed within blocks of KEY_BLOCK keys, then across blocks: one
    # float32 sum over thousands of keys (mx.softmax, a matmul) drifts past the tolerance.
    e = mx.exp((scores - mx.max(scores, axis=-1, keepdims=True)) * b)
    pad = -kv_len % KEY_BLOCK
    if pad:
        e = mx.pad(e, [(0, 0)] * 3 + [(0, pad)])
        vf = mx.pad(vf, [(0, 0), (0, 0), (0, pad), (0, 0)])
    nb = (kv_len + pad) // KEY_BLOCK
    eb = e.reshape(B, Hkv, G * L, nb, KEY_BLOCK)
    den = mx.sum(mx.sum(eb, axis=-1), axis=-1)[..., None, None]
    pb = (eb / den).transpose(0, 1, 3, 2, 4)  # probabilities: no partial exceeds max |v|
    out = mx.sum(pb @ vf.reshape(B, Hkv, nb, KEY_BLOCK, D), axis=2).reshape(B, Hq, L, D)
    return out.astype(q.dtype)


def _score_unit(scale: float) -> tuple[float, float]:
    """(a, b) with scale = a * b, b a power of two, |a| < 4: (scale, 1) for |scale| < 1."""
    if abs(scale) < 1.0:
        return scale, 1.0
    e = min(math.frexp(scale)[1], 126)  # |scale| < 2^e
    return math.ldexp(scale, -e), math.ldexp(1.0, e)


def plan(B: int, Hq: int, Hkv: int, L: int, D: int, kv_len: int, dtype: mx.Dtype) -> dict:
    """The launch geometry for a validated problem (also used by tests and benchmarks)."""
    rs, dc = _tiles(D, dtype)
    rows = (Hq // Hkv) * L
    n_tiles = -(-rows // ROW_TILE)
    # A full tile of simdgroups even for few rows: the idle ones still share the staging.
    n_simdgroups = ROW_TILE // rs
    tg = 32 * n_simdgroups
    blocks = -(-kv_len // KEY_BLOCK)
    min_blocks = max(MIN_SPLIT_BLOCKS, -(-MIN_KEYS_PER_ROW * min(rows, ROW_TILE) // KEY_BLOCK))
    want = -(-TARGET_THREADS // (B * Hkv * n_tiles * tg))
    n_splits = max(1, min(want, blocks // min_blocks, MAX_SPLITS))
    chunk = -(-blocks // n_splits) * KEY_BLOCK
    n_splits = -(-kv_len // chunk)
    pad = 4 // dtype.size
    return {
        "rs": rs, "dc": dc, "rows": rows, "n_tiles": n_tiles, "n_simdgroups": n_simdgroups,
        "n_splits": n_splits, "chunk": chunk, "threadgroup": (tg, 1, 1),
        "grid": (tg * n_splits, n_tiles, B * Hkv),
        "threadgroup_memory": KEY_BLOCK * (dc + pad) * dtype.size + ROW_TILE * KEY_BLOCK * 4,
    }


def _launch(q, k, v, B, Hq, Hkv, L, S, D, kv_len, scale, causal, backend) -> mx.array:
    p = plan(B, Hq, Hkv, L, D, kv_len, q.dtype)
    n_out = B * Hq * L
    scale2 = scalar(scale * LOG2E, mx.float32)
    o_part, ml_part = backends.launch(
        SPLIT_SPEC, backend,
        inputs={"q": q, "k": k, "v": v, "n_q": scalar(L, mx.uint32),
                "group": scalar(Hq // Hkv, mx.uint32), "kv_len": scalar(kv_len, mx.uint32),
                "kv_rows": scalar(S, mx.uint32), "chunk": scalar(p["chunk"], mx.uint32),
                "causal": scalar(int(causal), mx.uint32), "scale": scale2},
        template={"T": q.dtype, "D": D, "RS": p["rs"], "DC": p["dc"]},
        outputs={"o_part": ((n_out, p["n_splits"], D), mx.float32),
                 "ml_part": ((n_out, p["n_splits"], 2), mx.float32)},
        grid=p["grid"], threadgroup=p["threadgroup"],
        threadgroup_memory=p["threadgroup_memory"],
    )
    n_tg = -(-n_out // COMBINE_ROWS)
    (out,) = backends.launch(
        COMBINE_SPEC, backend,
        inputs={"o_part": o_part, "ml_part": ml_part, "n_rows": scalar(n_out, mx.uint32),
                "n_splits": scalar(p["n_splits"], mx.uint32), "scale": scale2},
        template={"T": q.dtype, "D": D}, outputs={"out": (q.shape, q.dtype)},
        grid=(32 * COMBINE_ROWS * n_tg, 1, 1), threadgroup=(32 * COMBINE_ROWS, 1, 1),
    )
    return out


def sdpa_multi(q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool = False,
               kv_len: int | None = None) -> mx.array:
    """Attention of a block of L queries against the first ``kv_len`` rows of a KV cache.

    Args:
      q: ``[B, Hq, L, D]`` float32/float16/bfloat16; the L queries are the last L of the
        ``kv_len`` positions.
      k, v: ``[B, Hkv, S, D]`` in q's dtype (S >= kv_len: the cache may be preallocated);
        Hq must be a multiple of Hkv (query head h reads KV head h // (Hq/Hkv)).
      scale: Python float multiplying q.k, with |scale| <= 3.4e38 / log2(e) (about
        2.36e38). The scores may lie beyond float32's range (scale 1e38 with ordinary q, k):
        the kernels hold them as a * q.k with scale * log2(e) = a * 2^j, |a| < 4, so
        wherever that product is finite in float32 the result is the softmax of the
        definition: masked keys and empty KV slices are -inf inside the kernels, below every
        finite score.
      causal: False: every query sees keys ``[0, kv_len)``; True: query r sees
        ``[0, kv_len - L + r]`` (bottom-right aligned, as ``mask="causal"`` in
        ``mx.fast.scaled_dot_product_attention``).
      kv_len: valid cache rows, a Python int with L <= kv_len <= S (default S). A runtime
        input: a decode loop with growing kv_len (or L, or B) builds no new kernel.

    Returns: ``[B, Hq, L, D]`` in q's dtype; softmax and accumulation in float32.
    D must be one of 64, 96, 128, 256.

    Differentiable with respect to q, k and v on every backend, through MLX's autodiff of
    the reference composite (it recomputes the softmax; no backward kernel): the cache rows
    at and beyond ``kv_len`` get a zero gradient.

    Pass the whole preallocated cache with ``kv_len`` rather than a slice of it: the
    kernels take row-contiguous inputs, so a non-contiguous view (``cache[:, :, :n]`` of a
    larger buffer) gives the same result but is first copied by MLX.
    """
    B, Hq, Hkv, L, S, D, kv_len, scale, causal = _check_sdpa_multi(q, k, v, scale, causal,
                                                                   kv_len)
    if B * Hq * L == 0:
        return mx.zeros(q.shape, dtype=q.dtype)
    backend = backends.resolve_backend()

    def reference(q, k, v):
        return _reference(q, k, v, B, Hq, Hkv, L, D, kv_len, scale, causal)

    @mx.custom_function
    def op(q, k, v):
        if backend == "reference":
            return reference(q, k, v)
        return _launch(q, k, v, B, Hq, Hkv, L, S, D, kv_len, scale, causal, backend)

    @op.vjp
    def op_vjp(primals, cotangent, output):
        # MLX's autodiff of the composite, recomputing the softmax (no backward kernel yet).
        return tuple(mx.vjp(reference, list(primals), [cotangent])[1])

    return op(q, k, v)
