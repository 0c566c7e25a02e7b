"""sdpa_multi: a block of L queries attending a shared (possibly preallocated) KV cache.

Block diffusion and speculative verification forward L tokens at once against a KV cache.
The kernel reads each visible cache row once for all L queries and all Hq/Hkv query heads
that share it (up to 32 query rows per threadgroup), splits the KV range across
threadgroups to fill the GPU, and merges the partial softmax results in a small second pass.
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from .. import _device, backends
from .._registry import Arg, KernelSpec, grid, register, scalars
from ._common import (
    FLOAT_TYPES,
    as_bool,
    dtype_name,
    keep_plan,
    memo_check,
    memo_plan,
    on_stream,
    plan_memory,
    require_array,
    require_finite_scalar,
    require_float,
    run_on,
    scalar,
)
from ._grad import sum_to_shape

OP = "sdpa_multi"
__all__ = ["sdpa_multi", "sdpa_multi_reference"]
HEAD_DIMS = (64, 96, 128, 256)
ROW_TILE = 32  # query rows per threadgroup (L * Hq/Hkv rows share one KV head)
KEY_BLOCK = 32  # keys per staged block (one per lane)
STAGE_BYTES = 16 * 1024  # most bytes of one staged K or V block
COMBINE_ROWS = 4  # output rows per combine threadgroup (one simdgroup each)
COMBINE_MAX_SPLITS = 128  # slices the combine kernel merges at most (its 32 * SPL)
# Splitting the KV range across threadgroups: aim for about TARGET_THREADS threads in
# flight, with slices of at least MIN_SPLIT_BLOCKS key blocks and at least MIN_KEYS_PER_ROW
# keys per query row of the tile (so re-reading q and writing partials stays small next to
# the K/V slice), and at most MAX_SPLITS slices. Tuning constants: they change speed, never
# results.
TARGET_THREADS = 32 * 1024
MIN_SPLIT_BLOCKS = 4
MIN_KEYS_PER_ROW = 16
MAX_SPLITS = 128
# The split kernel's paths, chosen per backend: "staged" (sdpa_multi.metal: 32-row tiles,
# K/V staged through threadgroup memory, lane per key), "vector" (sdpa_multi.metal: RS-row
# tiles, 4 simdgroups per KV slice, each lane reading D/32 contiguous elements of every K/V
# row) or "mma" (sdpa_multi_mma.metal on simdgroup_matrix products, for half / bfloat
# problems of at least MMA_MIN_ROWS query rows per KV head and MMA_MIN_QUERIES queries; the
# vector path for the others). The Metal plan keeps the staged path until the others are
# timed on a Mac; the emulator follows Metal (tests force each).
SPLIT_PATH = {"metal": "staged", "emulator": "staged", "cuda": "mma"}
VEC_ROWS = (4, 8, 16)  # rows per simdgroup (RS) the vector path is built for
VEC_SIMDGROUPS = 4  # simdgroups sharing a KV slice per threadgroup (the kernel's VSG)
# Simdgroups in flight per GPU core the vector plan aims for (12: three 4-simdgroup
# threadgroups, what an H100/H200 SM holds at the kernel's 132-140 registers per thread),
# its shortest slice and most slices (tuning constants: they change speed, never results).
VEC_SIMDGROUPS_PER_CORE = 12
VEC_MIN_KEYS = 64
VEC_MAX_SPLITS = 64
# The MMA path. Taken from G*L >= 16 rows and L >= 2: there the vector path's scalar FMAs
# and shuffles bound it (H100, h32/8 D128 f16: 0.28-0.36x native at L 8, 0.62x at L 4),
# while a decode step (L 1, G rows: usually <= 8, one 8-row fragment at most) reads K/V once
# on the vector path and is bound by memory. A huge MMA_MIN_ROWS disables it. Its tiles:
# up to MMA_SIMDGROUPS simdgroups of 8 rows; slices for about MMA_SIMDGROUPS_PER_CORE
# simdgroups per core with PF 1 (12: three 4-simdgroup threadgroups, what an H100/H200 SM
# holds at its 109-168 registers per thread at D 128), MMA_SIMDGROUPS_PER_CORE_PF0 with PF 0
# (8: two, measured when D 128 took 176-181 registers; at its 124-135 since the CUDA layer
# keeps fragments in mma.sync's layout, 12 with PF 0 measured slower than the PF 1 plan at
# every D 128 case on an H200; D 256, where PF 0 runs by default, takes 237-255), each at
# least MMA_MIN_KEYS keys, at
# most MMA_MAX_SPLITS (tuning constants: they change speed, never results).
MMA_MIN_ROWS = 16
MMA_MIN_QUERIES = 2
MMA_SIMDGROUPS = 4
MMA_SIMDGROUPS_PER_CORE = 12
MMA_SIMDGROUPS_PER_CORE_PF0 = 8
MMA_MIN_KEYS = 128
MMA_MAX_SPLITS = 64
# The MMA kernel's K/V staging (its template PF; sdpa_multi_mma.metal, PREFETCH): True
# fetches the next K or V block into registers while the current one is multiplied (D/16
# four-element pieces per thread) and reads q's fragments from threadgroup memory per block,
# for the head dims of MMA_PREFETCH_DIMS (D 256: K, V and q tiles would pass 32 KiB);
# False, and the other head dims, stage each block with loads then stores between barriers
# (nothing overlaps the loads) and hold q in registers. A tuning constant: every sum keeps
# its order, the results their bits (on the emulator; CUDA's compiler may contract the two
# kernels differently: last bits, within the tolerance table).
MMA_PREFETCH = True
MMA_PREFETCH_DIMS = (64, 96, 128)
# True: where the MMA kernel runs with PF 0 and no mask array at a head dim of
# MMA_BOUNDED_DIMS, the launch takes its copy compiled with CUDA's __launch_bounds__(128,
# MMA_BOUNDED_BLOCKS) (MMA_BOUNDED_SPEC): at most 168 registers per thread, so three
# 4-simdgroup threadgroups fit on an H100/H200 SM where the unbounded one (176-181 at D 128)
# fits two. nvcc sm_90 fits the bounded kernels without spills (half / bfloat D 128: 147 /
# 153 registers); with a mask they spill, hence not built (nor D 64 and 96: unbounded they
# use fewer). A tuning constant (Metal and the emulator run the same source either way):
# the same results.
MMA_BOUNDED = False
MMA_BOUNDED_DIMS = (128,)
MMA_BOUNDED_BLOCKS = 3
# Terms of T holding a probability (sdpa_multi_mma.metal, PROBABILITIES IN T).
MMA_TERMS = {mx.float16: 2, mx.bfloat16: 3}
LOG2E = 1.4426950408889634
MAX_SCALE = 3.4028234663852886e38 / LOG2E  # scale * log2(e) stays a finite float32



def _tiles(D: int, dtype: mx.Dtype) -> tuple[int, int]:
    """(RS rows per simdgroup, DC staged columns) of the split kernel for (D, dtype)."""
    rows_per_simdgroup = 4 if D > 128 else 8
    itemsize = dtype.size
    staged = D if KEY_BLOCK * D * itemsize <= STAGE_BYTES else D // 2
    return rows_per_simdgroup, staged


# MASK_KIND: the split kernel's mask path (template), and the element type MT of its mask.
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2


def _mask_type(kind: int, dtype: mx.Dtype) -> mx.Dtype:
    return dtype if kind == MASK_ADDITIVE else mx.bool_


def _vec_rows(D: int) -> tuple[int, ...]:
    """The vector path's RS choices for head dim D: q and o of RS rows take RS * D / 32
    floats each per lane, kept <= 32."""
    return tuple(rs for rs in VEC_ROWS if rs * D <= 32 * 32 or rs == VEC_ROWS[0])


def _split_bindings():
    for t in FLOAT_TYPES:
        for d in HEAD_DIMS:
            rs, dc = _tiles(d, t)
            tiles = [(rs, dc)] + [(r, 0) for r in _vec_rows(d)]  # staged, then vector (DC 0)
            for (rs, dc), kind in itertools.product(tiles, (MASK_NONE, MASK_BOOL, MASK_ADDITIVE)):
                yield {"T": t, "D": d, "RS": rs, "DC": dc, "MASK_KIND": kind,
                       "MT": _mask_type(kind, t)}


SPLIT_SPEC, COMBINE_SPEC = register(
    KernelSpec(
        op=OP, variant="split", template="sdpa_multi.metal",
        inputs=(Arg("q", "T", 4), Arg("k", "T", 4), Arg("v", "T", 4),
                *scalars("n_q", "group", "kv_len", "kv_rows", "chunk", "causal"),
                Arg("scale", "float32"), Arg("mask", "MT", 4),
                *scalars("mask_sb", "mask_sh", "mask_sl", "kv_heads", "mask_block")),
        outputs=(Arg("o_part", "float32", 3), Arg("ml_part", "float32", 3)),
        params=("T", "D", "RS", "DC", "MASK_KIND"), bindings=_split_bindings,
        geometry="staged path (DC > 0, Metal): rows = L*Hq/Hkv per KV head, tiles of 32; "
                 "TG = 32*(32/RS) threads (RS = 8, or 4 for D=256); grid (TG*n_splits, "
                 "ceil(rows/32), B*Hkv); each TG reads its KV slice once (staged 32 keys at a "
                 "time). vector path (DC = 0, CUDA): tiles of RS rows (RS >= Hq/Hkv where "
                 "registers allow); TG = 4 simdgroups sharing one KV slice, merged in "
                 "threadgroup memory; grid (TG*ceil(rows/RS), n_splits, B*Hkv)",
        notes="template T, D, RS, DC (0: vector path), MASK_KIND (none/bool/additive); L, "
              "kv_len (device-side too), S, G, chunk, causal, scale, the mask's strides and "
              "block form are runtime",
    ),
    KernelSpec(
        op=OP, variant="combine", template="sdpa_multi_combine.metal",
        inputs=(Arg("o_part", "float32", 3), Arg("ml_part", "float32", 3),
                *scalars("n_rows", "n_splits"), Arg("scale", "float32"),
                *scalars("n_q", "n_heads", "has_sinks"), Arg("sinks", "float32", 1)),
        outputs=(Arg("out", "T", 4),), params=("T", "D"),
        bindings=grid(T=FLOAT_TYPES, D=HEAD_DIMS),
        geometry="one simdgroup per output row, 4 rows per TG; grid (128*ceil(rows/4), 1, 1)",
        notes="template T, D; n_rows, n_splits, scale, L, Hq and the sinks are runtime",
    ),
)


def _mma_bindings():
    for t, d, pf, kind in itertools.product(MMA_TERMS, HEAD_DIMS, (1, 0),
                                            (MASK_NONE, MASK_BOOL, MASK_ADDITIVE)):
        if pf and d not in MMA_PREFETCH_DIMS:
            continue
        yield {"T": t, "D": d, "PT": MMA_TERMS[t], "PF": pf, "MASK_KIND": kind,
               "MT": _mask_type(kind, t)}


def _mma_bounded_bindings():
    for t, d in itertools.product(MMA_TERMS, MMA_BOUNDED_DIMS):
        yield {"T": t, "D": d, "PT": MMA_TERMS[t], "PF": 0, "MASK_KIND": MASK_NONE,
               "MT": _mask_type(MASK_NONE, t)}


_MMA = KernelSpec(
    op=OP, variant="split_mma", template="sdpa_multi_mma.metal",
    inputs=SPLIT_SPEC.inputs, outputs=SPLIT_SPEC.outputs,
    params=("T", "D", "PT", "PF", "MASK_KIND"), bindings=_mma_bindings,
    dtypes=("float16", "bfloat16"),
    geometry="pass 1 on 8x8 simdgroup_matrix products (half / bfloat): tiles of 8*NSG "
             "query rows (NSG = 1..4 simdgroups of 8 rows); TG = 32*NSG threads; grid "
             "(TG*ceil(rows/(8*NSG)), n_splits, B*Hkv); K/V staged 32 keys at a time, "
             "each read once per row tile (PF 1: the next block fetched into registers "
             "during the current one's products)",
    notes="template T, D, PT (terms of T per probability: 2 half, 3 bfloat), PF "
          "(MMA_PREFETCH), MASK_KIND; the same runtime inputs and partials as the split "
          "kernel",
)
MMA_SPEC, MMA_BOUNDED_SPEC = register(_MMA, replace(
    _MMA, variant="split_mma_bounded", bindings=_mma_bounded_bindings,
    cuda_launch_bounds=(128, MMA_BOUNDED_BLOCKS),
    notes=_MMA.notes + "; the PF 0, MASK_KIND 0 kernels for D 128 with CUDA launch bounds "
          "(128 threads, MMA_BOUNDED_BLOCKS per SM): MMA_BOUNDED"))


@dataclass(frozen=True)
class _Problem:
    """A validated call: shapes, the kv_len (int, or a 0-d uint32 array read on device),
    the mask (kind, the mask as a 4-D array in the kernel's element type, block form) and
    the sinks (float32 [Hq] or None)."""

    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    D: int
    kv_len: int | mx.array
    scale: float
    causal: bool
    mask_kind: int = MASK_NONE
    mask: mx.array | None = None
    block: bool = False
    sinks: mx.array | None = None


def _promotes_to(dtype: mx.Dtype, target: mx.Dtype) -> bool:
    """Whether MLX's type promotion of ``dtype`` with the float ``target`` gives ``target``
    (the rule MLX's sdpa applies to masks and sinks)."""
    return (dtype == target or dtype == mx.bool_ or mx.issubdtype(dtype, mx.integer)
            or (target == mx.float32 and dtype in (mx.float16, mx.bfloat16)))


def _check_kv_len(kv_len, L: int, S: int) -> int | None:
    """kv_len as a Python int (validated), or None for a 0-d integer array (clamped on
    device)."""
    if kv_len is None:
        if S < L:
            raise ValueError(f"[{OP}] the cache must hold at least the L={L} queries' rows "
                             f"(k and v with S >= {L} rows), got S={S}")
        return S
    if isinstance(kv_len, mx.array):
        if kv_len.ndim != 0:
            raise ValueError(f"[{OP}] kv_len as an mx.array must be 0-d, got shape "
                             f"{tuple(kv_len.shape)}")
        if not mx.issubdtype(kv_len.dtype, mx.integer):
            raise TypeError(f"[{OP}] kv_len as an mx.array must have an integer dtype, got "
                            f"{dtype_name(kv_len.dtype)}")
        if S < L:
            raise ValueError(f"[{OP}] the cache must hold at least the L={L} queries' rows "
                             f"(k and v with S >= {L} rows), got S={S}")
        return None  # read by the kernel; no host sync
    if isinstance(kv_len, bool) or not isinstance(kv_len, numbers.Integral):
        raise TypeError(f"[{OP}] kv_len must be a Python int, a 0-d integer mx.array or None, "
                        f"got {type(kv_len).__name__}")
    kv_len = int(kv_len)
    if not L <= kv_len <= S:
        raise ValueError(f"[{OP}] kv_len must satisfy L <= kv_len <= S, i.e. "
                         f"{L} <= kv_len <= {S}, got {kv_len}")
    return kv_len


def _check_mask(mask, q, B, Hq, L, kv_len):
    """(kind, the mask's 4-D shape, block form) of an array mask."""
    require_array(OP, "mask", mask)
    if mask.dtype == mx.bool_:
        kind = MASK_BOOL
    elif _promotes_to(mask.dtype, q.dtype):  # MLX's rule for additive masks
        kind = MASK_ADDITIVE
    else:
        raise TypeError(f"[{OP}] mask must be bool or an additive mask whose dtype promotes "
                        f"to q's dtype {dtype_name(q.dtype)}, got {dtype_name(mask.dtype)}")
    full = kv_len if isinstance(kv_len, int) else None
    want = f"[{B}, {Hq}, {L}, {full if full is not None else 'kv_len'}] (or [..., {L}]: the block form)"
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if mask.ndim > 4 or any(n not in (1, m) for n, m in zip(shape[:3], (B, Hq, L), strict=True)) \
            or shape[3] not in (full, L):
        raise ValueError(f"[{OP}] mask must broadcast to {want}, got shape "
                         f"{tuple(mask.shape)}")
    if mask.size >= 2**32:
        raise ValueError(f"[{OP}] mask too large: {mask.size} elements (expected < 2^32)")
    block = shape[3] != full  # last axis L: the last L visible keys (a full mask wins if both)
    return kind, shape, block


def _check_sdpa_multi(q, k, v, scale, causal, kv_len, mask=None, sinks=None) -> _Problem:
    """Validate the inputs; the problem with a device-side kv_len as a 0-d uint32 array, the
    mask as a 4-D array in the kernel's element type and the sinks in float32."""
    p, mask_shape = _validated(q, k, v, scale, causal, kv_len, mask, sinks)
    return _with_arrays(p, mask_shape, q.dtype, kv_len, mask, sinks)


def _with_arrays(p: _Problem, mask_shape: tuple | None, dtype: mx.Dtype, kv_len, mask,
                 sinks) -> _Problem:
    """``_validated``'s problem with the call's arrays (``_call_arrays``)."""
    if not (p.kv_len is None or mask_shape or sinks is not None):
        return p  # the remembered problem as it is (it holds no array)
    kv_len, mask, sinks = _call_arrays(p, mask_shape, dtype, kv_len, mask, sinks)
    return replace(p, kv_len=p.kv_len if kv_len is None else kv_len, mask=mask, sinks=sinks)


def _call_arrays(p: _Problem, mask_shape: tuple | None, dtype: mx.Dtype, kv_len, mask,
                 sinks) -> tuple:
    """The call's arrays as the kernels take them, None where absent: (a device-side kv_len
    as a 0-d uint32 array, the mask as a 4-D array in the kernel's element type, the sinks
    in float32)."""
    kv_len = None if p.kv_len is not None else _device_kv_len(kv_len)
    if mask_shape:
        mask = mask.reshape(mask_shape).astype(_mask_type(p.mask_kind, dtype))
    if sinks is not None:
        sinks = sinks.astype(dtype).astype(mx.float32)
    return kv_len, mask if mask_shape else None, sinks


def _device_kv_len(kv_len: mx.array) -> mx.array:
    """A 0-d integer kv_len as the split kernel's uint32 input: a uint32 one itself (not a
    copy: a host-known one, _msl.constants.scalar, stays known; the cuda executor packs
    it)."""
    return kv_len if kv_len.dtype == mx.uint32 else kv_len.astype(mx.uint32)


@memo_check
def _validated(q, k, v, scale, causal, kv_len, mask, sinks) -> tuple[_Problem, tuple | None]:
    """Every check of the inputs (their shapes, dtypes and scalar values only, so it is
    remembered per distinct arguments); (the problem without arrays: kv_len None where it is
    an array, mask and sinks None; the array mask's 4-D shape or None)."""
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
    kv_len = _check_kv_len(kv_len, L, S)
    causal = as_bool(OP, "causal", causal)
    scale = require_finite_scalar(OP, "scale", scale)
    if abs(scale) > MAX_SCALE:
        raise ValueError(f"[{OP}] scale must satisfy |scale| <= {MAX_SCALE:.4g} (the kernel "
                         f"takes scale * log2(e) as a finite float32), got {scale:g}")
    if S >= 2**31 or Hq * L >= 2**31:
        raise ValueError(f"[{OP}] problem too large: q {tuple(q.shape)}, k {tuple(k.shape)} "
                         "(expected S < 2^31 and Hq * L < 2^31)")
    kind, mask_shape, block = MASK_NONE, None, False
    if mask is not None:
        if causal:
            raise ValueError(f"[{OP}] pass either causal=True or mask=, not both (got "
                             f"causal=True and mask={mask!r:.40})")
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"[{OP}] a string mask must be 'causal', got {mask!r}")
            causal = True
        else:
            kind, mask_shape, block = _check_mask(mask, q, B, Hq, L, kv_len)
    if sinks is not None:
        require_array(OP, "sinks", sinks)
        if tuple(sinks.shape) != (Hq,):
            raise ValueError(f"[{OP}] sinks must have shape (Hq,) = ({Hq},), got "
                             f"{tuple(sinks.shape)}")
        if not _promotes_to(sinks.dtype, q.dtype):  # MLX's rule
            raise TypeError(f"[{OP}] sinks' dtype must promote to q's dtype "
                            f"{dtype_name(q.dtype)}, got {dtype_name(sinks.dtype)}")
    return _Problem(B, Hq, Hkv, L, S, D, kv_len, scale, causal, kind, None, block,
                    None), mask_shape


def sdpa_multi_reference(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                         causal: bool = False, kv_len: int | mx.array | None = None,
                         mask=None, sinks: mx.array | None = None) -> mx.array:
    """Pure-MLX composite of the same math (float32 inside, rounded once to q's dtype)."""
    return _reference(q, k, v, _check_sdpa_multi(q, k, v, scale, causal, kv_len, mask, sinks))


def _reference(q, k, v, p: _Problem) -> mx.array:
    B, Hq, Hkv, L, S, D = p.B, p.Hq, p.Hkv, p.L, p.S, p.D
    G = Hq // Hkv
    # Every cache row is scored and the rows past kv_len masked out (no slice by kv_len:
    # kv_len may be a device-side array). Their contents (NaN in a slack) are zeroed.
    n = p.kv_len if isinstance(p.kv_len, int) else mx.clip(p.kv_len.astype(mx.int32), L, S)
    keys = mx.arange(S)
    visible = keys < n  # [S]
    qf = q.astype(mx.float32).reshape(B, Hkv, G * L, D)
    kf = mx.where(visible[:, None], k.astype(mx.float32), 0.0)
    vf = mx.where(visible[:, None], v.astype(mx.float32), 0.0)
    # Scores as the kernels hold them (msl_templates/common.h, mt_score_unit): scale = a * b,
    # b a power of two, |a| < 4, so a * q.k stays finite where scale * q.k would not; the
    # softmax takes b * (d - max d), exact wherever scale * q.k is finite.
    a, b = _score_unit(p.scale)
    scores = ((qf * a) @ kf.swapaxes(-1, -2)).reshape(B, Hq, L, S)
    if p.causal:
        limit = (n - L + mx.arange(L)).reshape(L, 1)  # query l sees keys <= limit[l]
        visible = visible & (keys <= limit)
    if p.mask is not None:
        col = keys - (n - L if p.block else 0)  # the mask's column of each key
        width = p.mask.shape[-1]
        inside = (col >= 0) & (col < width)
        m = mx.take(p.mask, mx.clip(col, 0, width - 1), axis=-1)
        if p.mask_kind == MASK_BOOL:  # MLX's lowest finite score for a masked key
            scores = mx.where(inside & ~m, -3.4028234663852886e38, scores)
        else:
            scores = scores + mx.where(inside, m.astype(mx.float32) / b, 0.0)
    scores = mx.where(visible, scores, -math.inf)
    top = mx.max(scores, axis=-1, keepdims=True)
    if p.sinks is not None:
        sink = (p.sinks / b).reshape(1, Hq, 1, 1)  # in units of b, as the scores
        top = mx.maximum(top, sink)
    # exp(b * (d - max d)) summed within blocks of KEY_BLOCK keys, then across blocks: one
    # float32 sum over thousands of keys (mx.softmax, a matmul) drifts past the tolerance.
    e = mx.exp((scores - top) * b)
    pad = -S % KEY_BLOCK
    if pad:
        e = mx.pad(e, [(0, 0)] * 3 + [(0, pad)])
        vf = mx.pad(vf, [(0, 0), (0, 0), (0, pad), (0, 0)])
    nb = (S + pad) // KEY_BLOCK
    eb = e.reshape(B, Hkv, G * L, nb, KEY_BLOCK)
    den = mx.sum(mx.sum(eb, axis=-1), axis=-1)[..., None, None]
    if p.sinks is not None:  # the sink joins the denominator only
        den = den + mx.exp((sink - top) * b).reshape(B, Hkv, G * L, 1, 1)
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
        "path": "staged", "rs": rs, "dc": dc, "rows": rows, "n_tiles": n_tiles, "n_simdgroups": n_simdgroups,
        "n_splits": n_splits, "chunk": chunk, "threadgroup": (tg, 1, 1),
        "grid": (tg * n_splits, n_tiles, B * Hkv),
        "threadgroup_memory": KEY_BLOCK * (dc + pad) * dtype.size + ROW_TILE * KEY_BLOCK * 4,
    }


def vector_plan(B: int, Hq: int, Hkv: int, L: int, D: int, kv_len: int, dtype: mx.Dtype,
                cores: int | None = None) -> dict:
    """The vector path's launch geometry (sdpa_multi.metal, VECTOR PATH): tiles of RS rows
    (the smallest built RS >= Hq/Hkv, else the largest: a decode step is one tile per KV
    head, and a change of L or B builds no new kernel), threadgroups of VEC_SIMDGROUPS
    simdgroups sharing one KV slice, and enough slices for about VEC_SIMDGROUPS_PER_CORE
    simdgroups per core, each slice at least VEC_MIN_KEYS keys and MIN_KEYS_PER_ROW keys per
    row (partials stay small next to the K/V it reads), at most VEC_MAX_SPLITS."""
    rows = (Hq // Hkv) * L
    choices = _vec_rows(D)
    rs = next((r for r in choices if r >= Hq // Hkv), choices[-1])
    n_tiles = -(-rows // rs)
    keys_per_batch = KEY_BLOCK // rs
    nsg = VEC_SIMDGROUPS
    cores = cores or _device.gpu_cores() or _device.DEFAULT_GPU_CORES
    # rounded down: a last partial wave of threadgroups would cost a whole one
    want = max(1, min(cores * VEC_SIMDGROUPS_PER_CORE // (B * Hkv * n_tiles * nsg),
                      VEC_MAX_SPLITS))
    min_keys = max(VEC_MIN_KEYS, MIN_KEYS_PER_ROW * rs)
    # Up to min_keys * want keys the slices are min_keys long whatever kv_len is, so a
    # device-side kv_len (planned at S) sums in the same order as the same int kv_len.
    chunk = -(-max(min_keys, -(-kv_len // want)) // keys_per_batch) * keys_per_batch
    n_splits = -(-kv_len // chunk)
    tg = 32 * nsg
    return {
        "path": "vector", "rs": rs, "dc": 0, "rows": rows, "n_tiles": n_tiles,
        "n_simdgroups": nsg, "n_splits": n_splits, "chunk": chunk,
        "keys_per_batch": keys_per_batch, "threadgroup": (tg, 1, 1),
        "grid": (tg * n_tiles, n_splits, B * Hkv),
        # the simdgroups' partials, and the staged path's 1-element tile (16-byte aligned)
        "threadgroup_memory": nsg * rs * (D + 2) * 4 + 16,
    }


def mma_plan(B: int, Hq: int, Hkv: int, L: int, D: int, kv_len: int, dtype: mx.Dtype,
             cores: int | None = None) -> dict:
    """The MMA path's launch geometry (sdpa_multi_mma.metal): tiles of 8 * NSG query rows,
    NSG = min(MMA_SIMDGROUPS, ceil(rows / 8)) simdgroups of 8 rows, and enough slices of
    whole 32-key blocks for about MMA_SIMDGROUPS_PER_CORE (pf 1) or
    MMA_SIMDGROUPS_PER_CORE_PF0 simdgroups per core, each at least MMA_MIN_KEYS keys, at
    most MMA_MAX_SPLITS; pf 1 where MMA_PREFETCH takes D. Half and bfloat only."""
    if dtype not in MMA_TERMS:
        raise ValueError(f"[{OP}] the MMA path takes float16 or bfloat16, got "
                         f"{dtype_name(dtype)}")
    rows = (Hq // Hkv) * L
    nsg = min(MMA_SIMDGROUPS, -(-rows // 8))
    n_tiles = -(-rows // (8 * nsg))
    pf = int(MMA_PREFETCH and D in MMA_PREFETCH_DIMS)
    cores = cores or _device.gpu_cores() or _device.DEFAULT_GPU_CORES
    per_core = MMA_SIMDGROUPS_PER_CORE if pf else MMA_SIMDGROUPS_PER_CORE_PF0
    want = max(1, min(cores * per_core // (B * Hkv * n_tiles * nsg), MMA_MAX_SPLITS))
    # As the vector plan: up to MMA_MIN_KEYS * want keys the slices are MMA_MIN_KEYS long
    # whatever kv_len is (a device-side kv_len, planned at S, sums in the same order).
    chunk = -(-max(MMA_MIN_KEYS, -(-kv_len // want)) // KEY_BLOCK) * KEY_BLOCK
    n_splits = -(-kv_len // chunk)
    tg = 32 * nsg
    tile = KEY_BLOCK * (D + 8) * dtype.size
    return {
        "path": "mma", "pt": MMA_TERMS[dtype], "pf": pf, "rows": rows,
        "n_tiles": n_tiles, "n_simdgroups": nsg, "n_splits": n_splits, "chunk": chunk,
        "threadgroup": (tg, 1, 1), "grid": (tg * n_tiles, n_splits, B * Hkv),
        # K and V tiles apart where both fit in 32 KiB (the kernel's KV_APART), else one;
        # PF 1 (tiles apart) q's tile too
        "threadgroup_memory": tile * ((2 if 2 * tile <= 32 * 1024 else 1) + pf),
    }


def split_plan(backend: str, B: int, Hq: int, Hkv: int, L: int, D: int, kv_len: int,
               dtype: mx.Dtype) -> dict:
    """The split kernel's geometry on ``backend`` (SPLIT_PATH chooses the path)."""
    path = SPLIT_PATH.get(backend, "staged")
    if path == "mma":
        if (dtype in MMA_TERMS and L >= MMA_MIN_QUERIES
                and (Hq // Hkv) * L >= MMA_MIN_ROWS):
            return mma_plan(B, Hq, Hkv, L, D, kv_len, dtype)
        path = "vector"
    if path == "vector":
        return vector_plan(B, Hq, Hkv, L, D, kv_len, dtype)
    return plan(B, Hq, Hkv, L, D, kv_len, dtype)


def _mma_spec(pl: dict, D: int, mask_kind: int) -> KernelSpec:
    """The MMA kernel's spec for the plan ``pl``: MMA_BOUNDED_SPEC where MMA_BOUNDED takes
    it, else MMA_SPEC."""
    bounded = (MMA_BOUNDED and pl["pf"] == 0 and D in MMA_BOUNDED_DIMS
               and mask_kind == MASK_NONE)
    return MMA_BOUNDED_SPEC if bounded else MMA_SPEC


# MASK_KIND 0's dummy mask, never read; 16 bytes, as _NO_SINKS: MLX's CUDA allocator keeps
# arrays of at most 8 bytes in a slow managed pool (_msl/constants.py)
_NO_MASK = {0: mx.zeros((1, 1, 1, 16), dtype=mx.bool_)}


def _launcher(p: _Problem, mask_shape: tuple | None, has_sinks: bool, dtype: mx.Dtype,
              backend: str) -> tuple[backends.Prepared, backends.Prepared]:
    """The two kernel calls of the problem ``p`` (``_validated``'s: no arrays) on
    ``backend``, prepared once: ``split(q, k, v[, kv_len][, mask])`` and
    ``combine(o_part, ml_part[, sinks])``, given the call's arrays as ``_call_arrays``
    gives them (those absent left out)."""
    B, Hq, Hkv, L, S, D = p.B, p.Hq, p.Hkv, p.L, p.S, p.D
    shape = (B, Hq, L, D)
    device_kv_len = p.kv_len is None
    # A device-side kv_len: the grid covers the whole buffer; slices past kv_len see no key.
    pl = split_plan(backend, B, Hq, Hkv, L, D, S if device_kv_len else p.kv_len, dtype)
    if pl["n_splits"] > COMBINE_MAX_SPLITS:  # a plan constant set past what it merges
        raise ValueError(f"[{OP}] the split plan has {pl['n_splits']} KV slices; the combine "
                         f"kernel merges at most {COMBINE_MAX_SPLITS} (MAX_SPLITS, "
                         "VEC_MAX_SPLITS and MMA_MAX_SPLITS must stay within it)")
    n_out = B * Hq * L
    scale2 = scalar(p.scale * LOG2E, mx.float32)
    # Element strides of the row-contiguous 4-D mask, 0 on its broadcast (size-1) axes.
    mb, mh, ml, mc = mask_shape or _NO_MASK[0].shape
    strides = (mh * ml * mc if mb > 1 else 0, ml * mc if mh > 1 else 0, mc if ml > 1 else 0)
    if pl["path"] == "mma":
        split_spec, params = _mma_spec(pl, D, p.mask_kind), {"PT": pl["pt"], "PF": pl["pf"]}
    else:
        split_spec, params = SPLIT_SPEC, {"RS": pl["rs"], "DC": pl["dc"]}
    split = backends.prepare(
        split_spec, backend,
        inputs={"q": None, "k": None, "v": None, "n_q": scalar(L, mx.uint32),
                "group": scalar(Hq // Hkv, mx.uint32),
                "kv_len": None if device_kv_len else scalar(p.kv_len, mx.uint32),
                "kv_rows": scalar(S, mx.uint32), "chunk": scalar(pl["chunk"], mx.uint32),
                "causal": scalar(int(p.causal), mx.uint32), "scale": scale2,
                "mask": None if mask_shape else _NO_MASK[0],
                "mask_sb": scalar(strides[0], mx.uint32),
                "mask_sh": scalar(strides[1], mx.uint32),
                "mask_sl": scalar(strides[2], mx.uint32), "kv_heads": scalar(Hkv, mx.uint32),
                "mask_block": scalar(int(p.block), mx.uint32)},
        template={"T": dtype, "D": D, **params, "MASK_KIND": p.mask_kind},
        outputs={"o_part": ((n_out, pl["n_splits"], D), mx.float32),
                 "ml_part": ((n_out, pl["n_splits"], 2), mx.float32)},
        grid=pl["grid"], threadgroup=pl["threadgroup"],
        threadgroup_memory=pl["threadgroup_memory"],
    )
    n_tg = -(-n_out // COMBINE_ROWS)
    combine = backends.prepare(
        COMBINE_SPEC, backend,
        inputs={"o_part": None, "ml_part": None, "n_rows": scalar(n_out, mx.uint32),
                "n_splits": scalar(pl["n_splits"], mx.uint32), "scale": scale2,
                "n_q": scalar(L, mx.uint32), "n_heads": scalar(Hq, mx.uint32),
                "has_sinks": scalar(int(has_sinks), mx.uint32),
                "sinks": None if has_sinks else _NO_SINKS[0]},
        template={"T": dtype, "D": D}, outputs={"out": (shape, dtype)},
        grid=(32 * COMBINE_ROWS * n_tg, 1, 1), threadgroup=(32 * COMBINE_ROWS, 1, 1),
    )

    return split, combine


_NO_SINKS = {0: mx.zeros((4,), dtype=mx.float32)}  # has_sinks 0's dummy, never read


# ---- backward kernels (the VJP on a kernel backend) ---------------------------------------
# The dk/dv kernel: BWD_KEY_BLOCK keys per threadgroup, one per lane of every simdgroup; the
# D columns split among D / BWD_DKV_COLS simdgroups (its template CPS: each lane holds k, v,
# dk and dv of its key for CPS columns in registers, 4 * CPS floats). Both of
# BWD_DKV_COLS_CHOICES are declared instantiations, so either can be launched and timed: a
# tuning constant with the same bits at either (the score chunks do not depend on CPS).
# H100, float16, us per VJP: 16 and 32 alike at L 1 and L 32 (1130 to 1291 at L 32). The
# kernel stages its rows RB at a time (_bwd_dkv_rows: its constexpr RB, mirrored here for
# the threadgroup memory).
BWD_KEY_BLOCK = 32
BWD_DKV_COLS = 32
BWD_DKV_COLS_CHOICES = (16, 32)


def _bwd_dkv_rows(D: int) -> int:
    """Query rows the dk/dv kernel stages at a time for head dim D (its RB)."""
    return 16 if D <= 64 else 8 if D <= 128 else 4


def _bwd_dkv_geometry(D: int, dtype: mx.Dtype) -> tuple[int, int]:
    """(threads per threadgroup, threadgroup memory bytes) of the dk/dv kernel at
    BWD_DKV_COLS: q and dO tiles of RB rows in T, RB rows of stats and the score chunks
    [D / 16][RB][32] x 2 in float32 (whatever CPS: common.h's backward score expression)."""
    if BWD_DKV_COLS not in BWD_DKV_COLS_CHOICES:
        raise ValueError(f"[{OP}] BWD_DKV_COLS must be one of {BWD_DKV_COLS_CHOICES}, got "
                         f"{BWD_DKV_COLS!r}")
    n_sg, rows = D // BWD_DKV_COLS, _bwd_dkv_rows(D)
    return 32 * n_sg, rows * (2 * D * dtype.size + 2 * (D // 16) * 32 * 4 + 3 * 4)


def _bwd_key_block(D: int, dtype: mx.Dtype) -> int:
    """Keys per staged block of the statistics and dq kernels: 32, or 16 where 32 rows
    pass 16 KiB."""
    return 32 if 32 * D * dtype.size <= STAGE_BYTES else 16


def _bwd_bindings(with_kb: bool, with_max_sg: bool = False):
    def bindings():
        for t in FLOAT_TYPES:
            for d in HEAD_DIMS:
                for kind in (MASK_NONE, MASK_BOOL, MASK_ADDITIVE):
                    b = {"T": t, "D": d, "MASK_KIND": kind, "MT": _mask_type(kind, t)}
                    if with_kb:
                        b["KB"] = _bwd_key_block(d, t)
                    if with_max_sg:
                        b["MAX_SG"] = bwd_split_max_simdgroups(d, t)
                    yield b
    return bindings


def _bwd_dkv_bindings():
    for b in _bwd_bindings(False)():
        for cps in BWD_DKV_COLS_CHOICES:
            yield {**b, "CPS": cps}


_BWD_INPUTS = (Arg("q", "T", 4), Arg("k", "T", 4), Arg("v", "T", 4), Arg("dout", "T", 4),
               *scalars("n_q", "group", "kv_len", "kv_rows", "causal"),
               Arg("scale", "float32"), Arg("grad_scale", "float32"), Arg("mask", "MT", 4),
               *scalars("mask_sb", "mask_sh", "mask_sl", "kv_heads", "mask_block"))
(BWD_DKV_SPEC,) = register(
    KernelSpec(
        op=OP, variant="backward_dkv", template="sdpa_multi_backward_dkv.metal",
        inputs=(*_BWD_INPUTS, Arg("stats", "float32", 2), *scalars("mask_cols")),
        outputs=(Arg("dk", "T", 4), Arg("dv", "T", 4), Arg("dmask", "float32", 2)),
        params=("T", "D", "CPS", "MASK_KIND"), bindings=_bwd_dkv_bindings,
        geometry="the VJP, pass 2: 32 keys of one KV head per TG, one per lane; the D "
                 "columns split among NSG = D/CPS simdgroups; TG = 32*NSG threads, looping "
                 "over the G*L query rows RB at a time (16, 8 or 4 by D); grid (32*NSG, "
                 "ceil(S/32), B*Hkv); K/V rows < kv_len read once, none past it",
        notes="template T, D, CPS (columns per simdgroup, 16 or 32: BWD_DKV_COLS), "
              "MASK_KIND; each dot product as 16-column chunks summed through threadgroup "
              "memory in chunk order (no shuffles): the statistics' score bits at either "
              "CPS; dk/dv summed per key in a fixed row order (no atomics); an additive "
              "mask's dS written for the mask's columns",
    ),
)
_BWD_SPLIT_INPUTS = (*_BWD_INPUTS, *scalars("chunk", "n_splits"))
BWD_STATS_SPEC, BWD_DQ_SPLIT_SPEC = register(
    KernelSpec(
        op=OP, variant="backward_stats", template="sdpa_multi_backward_stats.metal",
        inputs=_BWD_SPLIT_INPUTS, outputs=(Arg("stats_part", "float32", 4),),
        params=("T", "D", "KB", "MASK_KIND", "MAX_SG"), bindings=_bwd_bindings(True, True),
        geometry="the VJP, pass 1a: 4*n_sg query rows of one KV head x one slice of "
                 "chunk keys (all keys unless the plan splits them) per TG (n_sg = 1, 2, 4 "
                 "or 8 <= MAX_SG simdgroups x 4 rows, a runtime choice); grid (32*n_sg, "
                 "ceil(G*L/(4*n_sg)), B*Hkv*n_splits); each "
                 "TG reads its slice's visible K/V once; lane per key",
        notes="template T, D, KB, MASK_KIND, MAX_SG (the most simdgroups the staged rows "
              "fit: bwd_split_max_simdgroups); writes each row's (m, l, sum P dO.v) per "
              "slice",
    ),
    KernelSpec(
        op=OP, variant="backward_dq_split", template="sdpa_multi_backward_dq_split.metal",
        inputs=(*_BWD_SPLIT_INPUTS, *scalars("has_sinks"), Arg("sinks", "float32", 1),
                Arg("stats_part", "float32", 4)),
        outputs=(Arg("dq_part", "float32", 4), Arg("stats", "float32", 2),
                 Arg("dsink_part", "float32", 1)),
        params=("T", "D", "KB", "MASK_KIND", "MAX_SG"), bindings=_bwd_bindings(True, True),
        geometry="the VJP, pass 1b: as backward_stats (TG 32*n_sg threads, grid "
                 "(32*n_sg, ceil(G*L/(4*n_sg)), B*Hkv*n_splits)); each TG merges its rows' "
                 "slice statistics, then reads its slice's visible K/V once",
        notes="template T, D, KB, MASK_KIND, MAX_SG; writes float32 dq partials per slice "
              "(summed by the wrapper) and, from slice 0, the rows' (m, l, dO.O) and "
              "dsinks terms",
    ),
)
BACKWARD_SPECS = (BWD_STATS_SPEC, BWD_DQ_SPLIT_SPEC, BWD_DKV_SPEC)
# The dq side: two kernels over slices of the keys (the slices' statistics, then the merge
# and each slice's partial dq), so that a decode-shaped VJP (few row tiles per KV head) can
# fill the GPU. The slices per backend: BWD_SPLIT_BACKENDS split where the plan finds more
# than one slice; every other backend (Metal, the emulator) takes one slice covering every
# key (no measurement on a Mac argues for the split there), its dq the one partial. A
# threadgroup holds n_sg simdgroups of 4 rows: the fewest (a power of two, at most
# BWD_SPLIT_MAX_SIMDGROUPS and at most bwd_split_max_simdgroups(D, dtype)) that hold the
# G*L rows, so a decode step's rows do not leave simdgroups idle; BWD_SPLIT_SIMDGROUPS
# forces n_sg (within the same cap). Slices for about BWD_SPLIT_WARPS_PER_CORE warps
# (threadgroups x n_sg) per GPU core, each at least BWD_SPLIT_MIN_KEYS keys (a multiple of
# KEY_BLOCK), at most BWD_SPLIT_MAX_SPLITS, and B * Hkv * n_splits within the grid's z limit
# (CUDA's 65535). BWD_SPLIT_FORCED (backend -> slice length; tests) sets the slices whatever
# the backend. Tuning constants: they change speed and the last bits of dq (n_sg changes
# none), never results beyond the tolerance table. H100, B 1, h32/8, L 1, 4K keys, D 128,
# float16, VJP us (native ~350): the former one-kernel dq side (32-row tiles, no split)
# 1672; split at 8 simdgroups 481-526 (slices of 64 to 512 keys alike); at n_sg 1 with
# 128 / 64 / 32-key slices 308 / 281 / 269 (BWD_SPLIT_WARPS_PER_CORE 64: the same plan
# there, the keys bound it).
BWD_SPLIT_BACKENDS = ("cuda",)
BWD_SPLIT_WARPS_PER_CORE = 32
BWD_SPLIT_MIN_KEYS = 32
BWD_SPLIT_MAX_SPLITS = 256
BWD_SPLIT_MAX_SIMDGROUPS = 8
BWD_SPLIT_SIMDGROUPS: int | None = None
BWD_SPLIT_FORCED: dict[str, int] = {}
SPLIT_SIMDGROUPS = (1, 2, 4, 8)  # the split kernels' tiles: 4 to 32 rows


# The cap on n_sg from the bytes (the one rule): the split kernels stage each simdgroup's 4
# rows of q and dO in T (lane per key: every lane reads them), so their threadgroup memory
# grows with n_sg; MAX_SG (a template parameter, a function of D and the dtype) is the
# largest n_sg of SPLIT_SIMDGROUPS for which the larger kernel's tiles, declared for it, fit
# backends.MAX_THREADGROUP_MEMORY: 8 for D 64, for D 96 and 128 in float16 / bfloat16; 4
# for D 96 in float32; 2 for D 128 in float32 and D 256 in float16 / bfloat16; 1 for D 256
# in float32. (Rows staged as float capped D 96 and D 128 in 16 bits at 4: H100, float16,
# h32/8, D 128, L 32, VJP us at n_sg 1 / 2 / 4: 5933 / 2035 / 1234.)
def bwd_split_memory(D: int, dtype: mx.Dtype, n_sg: int) -> tuple[int, int]:
    """Threadgroup bytes of (the statistics kernel, the split dq kernel) with tiles declared
    for ``n_sg`` simdgroups: kv_tile KB * (D + 4 / size) elements of the dtype, q_tile and
    g_tile 4 * n_sg rows of D elements of the dtype each, and the dq kernel's p_tile 4 * n_sg x 32 floats."""
    kb = _bwd_key_block(D, dtype)
    stats = kb * (D + 4 // dtype.size) * dtype.size + 2 * 4 * n_sg * D * dtype.size
    return stats, stats + 4 * n_sg * 32 * 4


def bwd_split_max_simdgroups(D: int, dtype: mx.Dtype) -> int:
    """MAX_SG of the split kernels for (D, dtype): the rule above."""
    return max(n for n in SPLIT_SIMDGROUPS
               if max(bwd_split_memory(D, dtype, n)) <= backends.MAX_THREADGROUP_MEMORY)


def _bwd_split_simdgroups(rows: int, cap: int) -> int:
    """n_sg of the split kernels' threadgroups for G*L = ``rows``, at most ``cap``."""
    if BWD_SPLIT_SIMDGROUPS is not None:
        if BWD_SPLIT_SIMDGROUPS not in SPLIT_SIMDGROUPS:
            raise ValueError(f"[{OP}] BWD_SPLIT_SIMDGROUPS must be one of {SPLIT_SIMDGROUPS}, "
                             f"got {BWD_SPLIT_SIMDGROUPS!r}")
        return min(BWD_SPLIT_SIMDGROUPS, cap)
    if BWD_SPLIT_MAX_SIMDGROUPS not in SPLIT_SIMDGROUPS:
        raise ValueError(f"[{OP}] BWD_SPLIT_MAX_SIMDGROUPS must be one of {SPLIT_SIMDGROUPS}, "
                         f"got {BWD_SPLIT_MAX_SIMDGROUPS!r}")
    n_sg = 1
    while n_sg < min(BWD_SPLIT_MAX_SIMDGROUPS, cap) and 4 * n_sg < rows:
        n_sg *= 2
    return n_sg


def backward_plan(backend: str, B: int, Hq: int, Hkv: int, L: int, D: int, kv_len: int,
                  dtype: mx.Dtype, cores: int | None = None) -> dict:
    """The dq side of the VJP on ``backend`` (the statistics kernel, then the split dq
    kernel): {"n_splits" (1: one slice covering every key), "chunk" (keys per slice),
    "n_sg" (simdgroups per threadgroup, at most bwd_split_max_simdgroups(D, dtype)),
    "n_tiles" (row tiles of 4 * n_sg rows per KV head), "kb" (the kernels' staged key
    block)}.
    ``kv_len``: the keys the launch covers (S with a device-side kv_len: slices past it see
    no key)."""
    rows = (Hq // Hkv) * L
    n_sg = _bwd_split_simdgroups(rows, bwd_split_max_simdgroups(D, dtype))
    n_tiles = -(-rows // (4 * n_sg))
    forced = BWD_SPLIT_FORCED.get(backend)
    if forced is not None:
        chunk = forced
    elif backend in BWD_SPLIT_BACKENDS:
        cores = cores or _device.gpu_cores() or _device.DEFAULT_GPU_CORES
        want = min(max(1, cores * BWD_SPLIT_WARPS_PER_CORE // (B * Hkv * n_tiles * n_sg)),
                   BWD_SPLIT_MAX_SPLITS, max(1, backends.MAX_GRID_Z // (B * Hkv)))
        chunk = max(BWD_SPLIT_MIN_KEYS, -(-kv_len // want))
    else:
        chunk = kv_len
    chunk = -(-chunk // KEY_BLOCK) * KEY_BLOCK  # whole key blocks (KB divides KEY_BLOCK)
    n_splits = -(-kv_len // chunk)
    if B * Hkv * n_splits > backends.MAX_GRID_Z:
        raise ValueError(f"[{OP}] the key-split VJP's grid needs B * Hkv * n_splits <= "
                         f"{backends.MAX_GRID_Z}, got {B} * {Hkv} * {n_splits}")
    return {"n_splits": n_splits, "chunk": chunk, "n_sg": n_sg, "n_tiles": n_tiles,
            "kb": _bwd_key_block(D, dtype)}


def _launch_backward(q, k, v, dout, p: _Problem, backend) -> tuple:
    """(dq, dk, dv, dsinks or None, dmask or None) for the cotangent ``dout``: the
    statistics kernel, then the split dq kernel over backward_plan's slices of the keys
    (dq's slice partials summed here; one slice: its partial is dq); then the dk/dv kernel
    (one pass over the keys). dsinks sums the rows' terms and an additive mask's dS is
    summed to the mask's shape here (small MLX reductions)."""
    B, Hq, Hkv, L, S, D = p.B, p.Hq, p.Hkv, p.L, p.S, p.D
    G = Hq // Hkv
    kv_len = scalar(p.kv_len, mx.uint32) if isinstance(p.kv_len, int) else p.kv_len
    mask = _NO_MASK[0] if p.mask is None else p.mask
    mb, mh, ml, mc = mask.shape
    strides = (mh * ml * mc if mb > 1 else 0, ml * mc if mh > 1 else 0, mc if ml > 1 else 0)
    n_out = B * Hq * L
    common = {"q": q, "k": k, "v": v, "dout": dout.astype(q.dtype),
              "n_q": scalar(L, mx.uint32), "group": scalar(G, mx.uint32), "kv_len": kv_len,
              "kv_rows": scalar(S, mx.uint32), "causal": scalar(int(p.causal), mx.uint32),
              "scale": scalar(p.scale * LOG2E, mx.float32),
              "grad_scale": scalar(p.scale, mx.float32), "mask": mask,
              "mask_sb": scalar(strides[0], mx.uint32),
              "mask_sh": scalar(strides[1], mx.uint32),
              "mask_sl": scalar(strides[2], mx.uint32), "kv_heads": scalar(Hkv, mx.uint32),
              "mask_block": scalar(int(p.block), mx.uint32)}
    # A device-side kv_len: the slices cover the whole buffer; those past kv_len see no key.
    bp = backward_plan(backend, B, Hq, Hkv, L, D, p.kv_len if isinstance(p.kv_len, int) else S,
                       q.dtype)
    template = {"T": q.dtype, "D": D, "KB": bp["kb"], "MASK_KIND": p.mask_kind}
    sink_inputs = {"has_sinks": scalar(int(p.sinks is not None), mx.uint32),
                   "sinks": p.sinks if p.sinks is not None else _NO_SINKS[0]}
    stats_outputs = {"stats": ((n_out, 3), mx.float32), "dsink_part": ((n_out,), mx.float32)}
    n_splits, rows = bp["n_splits"], G * L
    split_inputs = {**common, "chunk": scalar(bp["chunk"], mx.uint32),
                    "n_splits": scalar(n_splits, mx.uint32)}
    tg = 32 * bp["n_sg"]
    grid = (tg, bp["n_tiles"], B * Hkv * n_splits)
    max_sg = bwd_split_max_simdgroups(D, q.dtype)
    split_template = {**template, "MAX_SG": max_sg}
    stats_memory, dq_memory = bwd_split_memory(D, q.dtype, max_sg)  # tiles as declared
    (stats_part,) = backends.launch(
        BWD_STATS_SPEC, backend, inputs=split_inputs, template=split_template,
        outputs={"stats_part": ((B * Hkv, n_splits, rows, 3), mx.float32)},
        grid=grid, threadgroup=(tg, 1, 1), threadgroup_memory=stats_memory,
    )
    dq_part, stats, dsink_part = backends.launch(
        BWD_DQ_SPLIT_SPEC, backend,
        inputs={**split_inputs, **sink_inputs, "stats_part": stats_part},
        template=split_template,
        outputs={"dq_part": ((B * Hkv, n_splits, rows, D), mx.float32), **stats_outputs},
        grid=grid, threadgroup=(tg, 1, 1), threadgroup_memory=dq_memory,
    )
    if n_splits == 1:  # one slice: its partial is dq
        dq = dq_part.reshape(q.shape).astype(q.dtype)
    else:  # the slices' partials summed in one order (an MLX reduction: no atomics)
        dq = mx.sum(dq_part, axis=1).reshape(q.shape).astype(q.dtype)
    additive = p.mask_kind == MASK_ADDITIVE
    dkv_threads, dkv_memory = _bwd_dkv_geometry(D, q.dtype)
    dk, dv, dmask = backends.launch(
        BWD_DKV_SPEC, backend,
        inputs={**common, "stats": stats, "mask_cols": scalar(mc, mx.uint32)},
        template={"T": q.dtype, "D": D, "CPS": BWD_DKV_COLS, "MASK_KIND": p.mask_kind},
        outputs={"dk": (k.shape, k.dtype), "dv": (v.shape, v.dtype),
                 "dmask": ((n_out, mc) if additive else (1, 1), mx.float32)},
        grid=(dkv_threads, -(-S // BWD_KEY_BLOCK), B * Hkv),
        threadgroup=(dkv_threads, 1, 1), threadgroup_memory=dkv_memory,
    )
    dsinks = None
    if p.sinks is not None:
        dsinks = mx.sum(dsink_part.reshape(B, Hq, L), axis=(0, 2))
    if additive:  # dS on the mask's columns, summed over the mask's broadcast axes
        dmask = sum_to_shape(dmask.reshape(B, Hq, L, mc), p.mask.shape).astype(p.mask.dtype)
    else:
        dmask = None
    return dq, dk, dv, dsinks, dmask


def sdpa_multi(q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool = False,
               kv_len: int | mx.array | None = None, mask: str | mx.array | None = None,
               sinks: mx.array | None = None, stream=None) -> mx.array:
    """Attention of a block of L queries against the first ``kv_len`` rows of a KV cache,
    as ``mx.fast.scaled_dot_product_attention`` takes masks and sinks.

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
        ``mx.fast.scaled_dot_product_attention``). ``causal=True`` together with ``mask=``
        is refused.
      kv_len: valid cache rows (default S): a Python int with L <= kv_len <= S, or a 0-d
        integer ``mx.array`` read by the kernel (no host sync; the launch then covers all S
        rows and the kernel clamps kv_len to [L, S]). A runtime input either way: a decode
        loop with growing kv_len (or L, or B) builds no new kernel. The host-side plan
        (checks, geometry, prepared launches) is remembered per int kv_len, so a loop
        passing a growing int makes one per step (about 110 us of host time per call
        against 19, stand-in kernels on a 2-core x86 CPU); a 0-d array is planned once for
        S, its calls sharing one custom function (what the patched mlx-lm attention
        passes).
      mask: None, ``"causal"`` (as ``causal=True``), or an array of rank <= 4 broadcastable
        to ``[B, Hq, L, kv_len]`` (read in place: size-1 axes are broadcast by the kernel),
        bool (True = attend) or additive (a dtype that promotes to q's, as MLX requires;
        added to scale * q.k, -inf allowed). A mask whose last axis is L (where kv_len != L,
        or any array mask with a device-side kv_len) is the block form of speculative-tree
        verification: it covers the last L visible keys, and every key before them is
        visible. As in MLX 0.32's own sdpa, a row whose keys a bool mask hides all averages
        v over ``[0, kv_len)`` uniformly (masked keys score the lowest finite float), and a
        row whose scores an additive mask makes all -inf is NaN (0 with sinks).
      sinks: ``[Hq]`` in a dtype that promotes to q's (as MLX requires): one logit per query
        head that joins the softmax's denominator only (gpt-oss).
      stream: MLX's StreamOrDevice (None, an mx.Stream, an mx.Device, mx.cpu / mx.gpu):
        where the composite's ops or the kernel run.

    Returns: ``[B, Hq, L, D]`` in q's dtype; softmax and accumulation in float32.
    D must be one of 64, 96, 128, 256.

    Under ``mx.compile(..., shapeless=True)`` (reference backend) a device-side ``kv_len``
    changes from call to call without a new trace; other input shapes must stay those of the
    first trace (MLX refuses a change: the composite is shaped by them), and S must be a
    multiple of 32 (MLX 0.32: ``Pad cannot infer output shapes``). ``mx.vmap`` maps any axis
    of q, k, v on the reference backend. On metal / cuda MLX 0.32.4 refuses both with its
    own message (custom kernels have no vmap or shape inference there). The emulator refuses
    both (eager). README: "mx.compile(shapeless=True) and mx.vmap".

    Differentiable with respect to q, k, v, sinks and an additive mask on every backend.
    On a kernel backend the VJP is three backward kernels that recompute the softmax from
    per-row statistics (logsumexp), FlashAttention-2 style, and never hold an ``[L, S]``
    probability matrix: the statistics of slices of the keys, then their merge and a
    partial dq per slice (summed in a fixed order; one slice covering every key except
    where ``backward_plan`` splits the keys: by default on cuda, for problems of few row
    tiles such as a decode step), then dk and dv (each key's sum over the query rows of its
    head group in a fixed order: the same bits every run). Every kernel forms a score by
    one expression (common.h: 16-column fma chunks added in order), so a probability
    recomputed from the statistics is the one they were made from, at any scale. The sinks'
    gradient is the sum of per-row terms; an additive mask's is dS itself, written by the
    dk/dv kernel as ``[B, Hq, L, mask columns]`` and summed to the mask's shape. On the
    reference backend: MLX's autodiff of the composite. The cache rows at and beyond
    ``kv_len`` get a zero gradient (and are never read); a row that sees no key and no sink
    (NaN output) gives NaN gradients, as the float64 definition does.

    Pass the whole preallocated cache with ``kv_len`` rather than a slice of it: the
    kernels take row-contiguous inputs, so a non-contiguous view (``cache[:, :, :n]`` of a
    larger buffer) gives the same result but is first copied by MLX (so is a mask made by
    ``mx.broadcast_to``: pass its size-1 axes instead).
    """
    backend = backends.resolve_backend()
    if (type(kv_len) is mx.array and sinks is None and stream is None and type(q) is mx.array
            and type(k) is mx.array and type(v) is mx.array and type(scale) is float
            and type(causal) is bool and (mask is None or type(mask) is str)):
        # the patched attention's call (a device-side kv_len; no mask array, no sinks): its
        # plan by a key formed here, every field of _plan's that such a call can vary
        key = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, scale, causal,
               kv_len.shape, kv_len.dtype, mask, backend)
        run = _COMMON_PLANS.get(key)
        if run is None:
            run = keep_plan(_COMMON_PLANS, key, _plan(q, k, v, scale, causal, kv_len, mask,
                                                      sinks, backend, stream))
        return run(q, k, v, kv_len, mask, sinks)
    run = _plan(q, k, v, scale, causal, kv_len, mask, sinks, backend, stream)
    return run(q, k, v, kv_len, mask, sinks)


# The plans of sdpa_multi's common call (memo_plan's key over ten arguments costs about 2.5
# us of a decode step's attention call; stand-in kernels on a 2-core x86 CPU)
_COMMON_PLANS = plan_memory()


class _Calling(threading.local):
    """The array a plan's call gives as kv_len, for its forward's launch: MLX hands the
    forward of a custom function with a VJP other array objects than the call's, and a
    host-known kv_len (_msl.constants.scalar) is recognised by its object (the cuda executor
    packs it). The VJP takes the primal. Per thread: a plan may serve several at once."""

    kv_len: mx.array | None = None  # None outside a call (and in a thread making none)


@memo_plan
def _plan(q, k, v, scale, causal, kv_len, mask, sinks, backend: str, stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(q, k, v, kv_len, mask, sinks)``. Reads no argument array but its shape and
    dtype."""
    on_stream(OP, stream)  # refuses what is not a stream (before the checks)
    p, mask_shape = _validated(q, k, v, scale, causal, kv_len, mask, sinks)
    dtype, shape = q.dtype, tuple(q.shape)

    def problem_of(kv_len, mask, sinks) -> _Problem:  # the mask's and sinks' casts
        return _with_arrays(p, mask_shape, dtype, kv_len, mask, sinks)

    if p.B * p.Hq * p.L == 0:
        def empty(q, k, v, kv_len, mask, sinks):
            with on_stream(OP, stream):
                problem_of(kv_len, mask, sinks)
                return mx.zeros(shape, dtype=dtype)
        return empty
    if backend == "reference":
        def reference(q, k, v, kv_len, mask, sinks):
            with on_stream(OP, stream):  # MLX's autodiff of the composite; and no
                # custom_function, so shapeless compile traces it
                return _reference(q, k, v, problem_of(kv_len, mask, sinks))
        return reference
    # The primals: q, k, v, then the sinks, the mask and a device-side kv_len where given
    # (the latter two's cotangents zeros, an additive mask's its gradient), so that one
    # custom function serves every call of the plan (a decode loop builds none).
    has_sinks, device_kv_len = sinks is not None, p.kv_len is None
    additive = p.mask_kind == MASK_ADDITIVE
    split, combine = _launcher(p, mask_shape, has_sinks, dtype, backend)

    def arrays(rest) -> tuple:
        """(kv_len, mask, sinks), None where absent, of the primals after q, k, v."""
        it = iter(rest)
        sinks = next(it) if has_sinks else None
        mask = next(it) if mask_shape else None
        return next(it) if device_kv_len else None, mask, sinks

    # The call's own kv_len array for the forward launch (_Calling). The forward and the
    # call below bind the primals; those of a call with no mask array and no sinks (the
    # patched attention's decode and verify calls) without the general binding.
    calling = _Calling()
    if mask_shape or has_sinks:
        def forward(q, k, v, *rest):
            kv_len, mask, sinks = arrays(rest)
            own = calling.kv_len
            o_part, ml_part = split(q, k, v, *[a for a in (kv_len if own is None else own, mask)
                                               if a is not None])
            return (combine(o_part, ml_part, sinks) if has_sinks else combine(o_part, ml_part))[0]

        def run(q, k, v, kv_len, mask, sinks):
            kv_len, mask, sinks = _call_arrays(p, mask_shape, dtype, kv_len, mask, sinks)
            calling.kv_len = kv_len
            try:
                return op(q, k, v, *[a for a in (sinks, mask, kv_len) if a is not None])
            finally:
                calling.kv_len = None
    elif device_kv_len:
        def forward(q, k, v, kv_len):
            own = calling.kv_len
            o_part, ml_part = split(q, k, v, kv_len if own is None else own)
            return combine(o_part, ml_part)[0]

        def run(q, k, v, kv_len, mask, sinks):
            kv_len = _device_kv_len(kv_len)
            calling.kv_len = kv_len
            try:
                return op(q, k, v, kv_len)
            finally:
                calling.kv_len = None
    else:
        def forward(q, k, v):
            return combine(*split(q, k, v))[0]

        def run(q, k, v, kv_len, mask, sinks):
            return op(q, k, v)

    # on the call's stream (MLX may trace it again later: a kernel launch refuses the
    # emulator in a trace)
    op = mx.custom_function(run_on(stream, forward))

    @op.vjp
    def op_vjp(primals, cotangent, output):
        # The backward kernels: the softmax recomputed from per-row statistics.
        q, k, v, *rest = primals
        kv_len, mask, sinks = arrays(rest)
        pc = replace(p, kv_len=p.kv_len if kv_len is None else kv_len, mask=mask, sinks=sinks)
        with on_stream(OP, stream):
            dq, dk, dv, dsinks, dmask = _launch_backward(q, k, v, cotangent, pc, backend)
        if mask_shape and not additive:
            dmask = mx.zeros_like(mask)  # a bool mask: no gradient
        return (dq, dk, dv, *(g for g in (dsinks, dmask) if g is not None),
                *((mx.zeros_like(kv_len),) if device_kv_len else ()))

    return run_on(stream, run)  # the mask's and sinks' casts run on the stream too
