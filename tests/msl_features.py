"""Small MSL kernels, one per language feature the executors must agree on.

tests/test_msl_conformance.py runs each on every executor available (emulator, cuda, metal)
and checks the results against NumPy, or checks that the executors in ``refused_by`` refuse
it with one message; tests/test_cuda_layer.py compiles the CUDA translations with nvcc (no
GPU). Each body is portable MSL (it would run under mx.fast.metal_kernel unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mlx_metaltile._templates import read_text


@dataclass(frozen=True)
class Feature:
    name: str
    source: str
    inputs: tuple[tuple[str, object, int], ...]  # (name, dtype, ndim); dtype may be "T"
    outputs: tuple[tuple[str, object], ...]  # (name, dtype); dtype may be "T"
    templates: tuple[tuple[tuple[str, object], ...], ...] = ((),)
    header: str = ""
    atomic_outputs: bool = False
    refused_by: frozenset[str] = frozenset()  # executors that refuse it when it is made
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def resolve(self, template) -> tuple[list, list]:
        """Inputs and outputs with "T" replaced by the template's T."""
        t = dict(template).get("T")
        ins = [(n, t if d == "T" else d, nd) for n, d, nd in self.inputs]
        outs = [(n, t if d == "T" else d) for n, d in self.outputs]
        return ins, outs


FLOATS = tuple((("T", t),) for t in (mx.float32, mx.float16, mx.bfloat16))

# SIMD-group functions on full and partial lane sets; one thread per element.
SIMD = Feature(
    name="simd",
    source="""
const uint i = thread_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
const T v = x[i];
sum[i] = float(simd_sum(v));
mx[i] = float(simd_max(v));
mn[i] = float(simd_min(v));
incl[i] = float(simd_prefix_inclusive_sum(v));
excl[i] = float(simd_prefix_exclusive_sum(v));
down[i] = float(simd_shuffle_down(v, ushort(3)));
up[i] = float(simd_shuffle_up(v, ushort(2)));
xr[i] = float(simd_shuffle_xor(v, ushort(5)));
bc[i] = float(simd_broadcast(v, ushort(7)));
shf[i] = float(simd_shuffle(v, ushort((lane * 3) % 32)));
qsum[i] = float(quad_sum(v));
qshf[i] = float(quad_shuffle_xor(v, ushort(1)));
// Only the first `active` lanes of each SIMD-group take part.
float part = -1.0f;
float part_first = -1.0f;
if (lane < active) {
  part = float(simd_sum(v));
  part_first = float(simd_broadcast_first(v));
}
partial[i] = part;
first[i] = part_first;
ballot[i] = uint(ulong(simd_ballot(v > T(0))) & 0xffffffffu);
anyall[i] = (simd_any(v > T(100)) ? 1u : 0u) | (simd_all(v > T(-100)) ? 2u : 0u);
""",
    inputs=(("x", "T", 1), ("active", mx.uint32, 0)),
    outputs=tuple((n, mx.float32) for n in
                  ("sum", "mx", "mn", "incl", "excl", "down", "up", "xr", "bc", "shf", "qsum",
                   "qshf", "partial", "first")) + (("ballot", mx.uint32), ("anyall", mx.uint32)),
    templates=FLOATS,
)

# common.h's converged helpers on full SIMD-groups (every lane active: the helpers' promise),
# as simd_sum, simd_max, simd_min, simd_shuffle and simd_shuffle_xor give them; a float and a uint
# shuffled.
CONVERGED = Feature(
    name="converged_helpers",
    header="#include <metal_stdlib>\nusing namespace metal;\n\n" + read_text("common.h"),
    source="""
const uint i = thread_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
const T v = x[i];
sum[i] = float(mt_sum_converged(v));
mx[i] = float(mt_max_converged(v));
mn[i] = float(mt_min_converged(v));
shf[i] = float(mt_shuffle_converged(v, ushort((lane * 5 + 3) % 32)));
xr[i] = float(mt_shuffle_xor_converged(v, ushort(5)));
bits[i] = mt_shuffle_converged(i * 7u, ushort(31 - lane));
""",
    inputs=(("x", "T", 1),),
    outputs=(("sum", mx.float32), ("mx", mx.float32), ("mn", mx.float32), ("shf", mx.float32),
             ("xr", mx.float32), ("bits", mx.uint32)),
    templates=FLOATS,
)

# Reconvergence: after an if-block that some lanes of each SIMD-group took (running SIMD-group
# functions inside it), every lane takes part in the next SIMD-group function or barrier, each
# kind in turn, a helper's too. `active` splits the lanes; in-block sums alternate sides.
RECONVERGE = Feature(
    name="reconvergence",
    header="""
#include <metal_stdlib>
using namespace metal;

inline float total(float v) {
  return simd_sum(v);
}
""",
    source="""
const uint i = thread_position_in_grid.x;
const uint lid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const float v = x[i];
threadgroup float t[64];
t[lid] = v;
float acc = 0.0f;
if (lane < active) { acc += simd_sum(v); }
sum[i] = simd_sum(v);
if (lane >= active) { acc += simd_sum(v); }
incl[i] = simd_prefix_inclusive_sum(v);
if (lane < active) { acc += simd_sum(v); }
excl[i] = simd_prefix_exclusive_sum(v);
if (lane >= active) { acc += simd_sum(v); }
down[i] = simd_shuffle_down(v, ushort(1));
if (lane < active) { acc += simd_sum(v); }
bc[i] = simd_broadcast(v, ushort(31));
if (lane >= active) { acc += simd_sum(v); }
mx[i] = simd_max(v);
if (lane < active) { acc += simd_sum(v); }
qsum[i] = quad_sum(v);
if (lane < active) { acc += total(v); }
helper[i] = total(v);
if (lane >= active) { acc += simd_sum(v); }
threadgroup_barrier(mem_flags::mem_threadgroup);
nb[i] = t[(lid + 1) % threads_per_threadgroup.x];
inside[i] = acc;
""",
    inputs=(("x", mx.float32, 1), ("active", mx.uint32, 0)),
    outputs=tuple((n, mx.float32) for n in
                  ("sum", "incl", "excl", "down", "bc", "mx", "qsum", "helper", "nb", "inside")),
)

# simdgroup_matrix<T, 8, 8>: loads (plain, transposed, with an origin, from threadgroup
# memory), multiply(-accumulate) and the per-lane layout of thread_elements(), which MSL leaves
# to the implementation (Apple's on Metal and the emulator, mma.sync's on CUDA): kernels read
# it through common.h's mt_frag_row / mt_frag_col / MT_FRAG_ROW_XOR0 / 1 (R, CC, X).
MATRIX = Feature(
    name="simdgroup_matrix",
    header="#include <metal_stdlib>\nusing namespace metal;\n\n" + read_text("common.h"),
    source="""
const uint lane = thread_index_in_simdgroup;
threadgroup T tile[16 * 16];
for (uint k = lane; k < 256; k += 32) {
  tile[k] = big[k];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_matrix<T, 8, 8> a;
simdgroup_matrix<T, 8, 8> b;
simdgroup_matrix<T, 8, 8> at;
simdgroup_matrix<T, 8, 8> blk;
simdgroup_float8x8 c;
simdgroup_float8x8 d;
simdgroup_float8x8 e;
simdgroup_load(a, A, 8);
simdgroup_load(b, B, 8);
simdgroup_load(c, C, 8);
simdgroup_load(at, A, 8, ulong2(0, 0), true);
simdgroup_load(blk, tile, 16, ulong2(8, 4));
simdgroup_multiply_accumulate(d, a, b, c);
simdgroup_multiply(e, at, b);
simdgroup_store(d, D, 8);
simdgroup_store(e, E, 8);
simdgroup_store(blk, F, 8);
simdgroup_store(d, DT, 8, ulong2(0, 0), true);
// An odd origin and an odd row stride: a lane's pair starts at an odd element offset in
// some rows of the block and at an even one in others.
simdgroup_matrix<T, 8, 8> odd;
simdgroup_load(odd, tile, 16, ulong2(3, 5));
simdgroup_store(odd, G, 9, ulong2(1, 0));
L[2 * lane] = float(a.thread_elements()[0]);
L[2 * lane + 1] = float(a.thread_elements()[1]);
R[lane] = mt_frag_row(lane);
CC[lane] = mt_frag_col(lane);
X[lane] = MT_FRAG_ROW_XOR0 | (MT_FRAG_ROW_XOR1 << 8);
""",
    inputs=(("A", "T", 2), ("B", "T", 2), ("C", mx.float32, 2), ("big", "T", 2)),
    outputs=(("D", mx.float32), ("E", mx.float32), ("F", "T"), ("DT", mx.float32),
             ("G", "T"), ("L", mx.float32), ("R", mx.uint32), ("CC", mx.uint32),
             ("X", mx.uint32)),
    templates=FLOATS,
)

# simdgroup_multiply_accumulate as kernels use it: a 16x16x16 product C + A B from 8x8 blocks
# of threadgroup tiles with a padded row stride (B staged transposed and loaded with
# transpose), chained over two k-blocks into a float accumulator (P) and a T accumulator (Q)
# (both stored with a stride and an origin); thread_elements() read after a product (L, LT),
# then written (in divergent code too) and chained into a further product, stored
# transposed (F).
MMA = Feature(
    name="simdgroup_products",
    source="""
const uint lane = thread_index_in_simdgroup;
constexpr uint LD = 20;  // padded row stride of the staged tiles
threadgroup T xa[16 * LD];
threadgroup T xbt[16 * LD];  // B transposed: xbt[n * LD + k] = B[k][n]
for (uint i = lane; i < 256; i += 32) {
  xa[(i / 16) * LD + i % 16] = A[i];
  xbt[(i % 16) * LD + i / 16] = B[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint bi = 0; bi < 2; ++bi) {
  for (uint bj = 0; bj < 2; ++bj) {
    simdgroup_float8x8 acc;
    simdgroup_load(acc, C, 16, ulong2(8 * bj, 8 * bi));
    simdgroup_matrix<T, 8, 8> acc_t = make_filled_simdgroup_matrix<T, 8, 8>(T(0));
    for (uint kk = 0; kk < 16; kk += 8) {
      simdgroup_matrix<T, 8, 8> a;
      simdgroup_matrix<T, 8, 8> b;
      simdgroup_load(a, xa, LD, ulong2(kk, 8 * bi));
      simdgroup_load(b, xbt, LD, ulong2(kk, 8 * bj), true);
      simdgroup_multiply_accumulate(acc, a, b, acc);
      simdgroup_multiply_accumulate(acc_t, a, b, acc_t);
    }
    simdgroup_store(acc, P, 16, ulong2(8 * bj, 8 * bi));
    simdgroup_store(acc_t, Q, 16, ulong2(8 * bj, 8 * bi));
  }
}
// The top-left blocks A0, B0 straight from device memory; E = A0 B0.
simdgroup_matrix<T, 8, 8> a0;
simdgroup_matrix<T, 8, 8> b0;
simdgroup_load(a0, A, 16);
simdgroup_load(b0, B, 16);
simdgroup_float8x8 e;
simdgroup_matrix<T, 8, 8> h;
simdgroup_multiply(e, a0, b0);
simdgroup_multiply(h, a0, b0);
for (uint j = 0; j < 2; ++j) {
  L[2 * lane + j] = e.thread_elements()[j];
  LT[2 * lane + j] = float(h.thread_elements()[j]);
  e.thread_elements()[j] *= 2.0f;
}
if (lane % 3 == 0) {
  e.thread_elements()[1] += 1.0f;
}
simdgroup_multiply_accumulate(e, a0, b0, e);
simdgroup_store(e, F, 8, ulong2(0, 0), true);
""",
    inputs=(("A", "T", 2), ("B", "T", 2), ("C", mx.float32, 2)),
    outputs=(("P", mx.float32), ("Q", "T"), ("L", mx.float32), ("LT", mx.float32),
             ("F", mx.float32)),
    templates=FLOATS,
)

# common.h's product helpers: mt_sg_bmatrix loaded by mt_sg_load_b (plain, and transposed
# from a transposed copy, with origins), products with it into float and T accumulators,
# and mt_mma_pair with either kind of B: P = C + A B (a pair), Q = A B in T (a pair), E =
# A's top rows times B (one product), R = A B (a pair with a plain simdgroup_matrix B);
# mt_sg_load4 of A and B blocks, plain and transposed (WA, WAT, WB, WBT).
PRODUCT_HELPERS = Feature(
    name="product_helpers",
    header="#include <metal_stdlib>\nusing namespace metal;\n\n" + read_text("common.h"),
    source="""
const uint lane = thread_index_in_simdgroup;
constexpr uint LD = 20;  // padded row stride of the staged tiles
threadgroup T xa[16 * LD];   // A [16, 8]
threadgroup T xb[8 * LD];    // B [8, 16]
threadgroup T xbt[16 * LD];  // B^T: xbt[n * LD + k] = B[k][n]
for (uint i = lane; i < 128; i += 32) {
  xa[(i / 8) * LD + i % 8] = A[i];
  xb[(i / 16) * LD + i % 16] = B[i];
  xbt[(i % 16) * LD + i / 16] = B[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_matrix<T, 8, 8> a0;
simdgroup_matrix<T, 8, 8> a1;
simdgroup_load(a0, xa, LD);
simdgroup_load(a1, xa, LD, ulong2(0, 8));
for (uint bj = 0; bj < 2; ++bj) {
  mt_sg_bmatrix<T> b;
  mt_sg_bmatrix<T> bt;
  mt_sg_load_b(b, xb, LD, ulong2(8 * bj, 0));
  mt_sg_load_b(bt, xbt, LD, ulong2(0, 8 * bj), true);  // the same block of B
  simdgroup_float8x8 p0;
  simdgroup_float8x8 p1;
  simdgroup_load(p0, C, 16, ulong2(8 * bj, 0));
  simdgroup_load(p1, C, 16, ulong2(8 * bj, 8));
  mt_mma_pair(p0, a0, p1, a1, b);
  simdgroup_store(p0, P, 16, ulong2(8 * bj, 0));
  simdgroup_store(p1, P, 16, ulong2(8 * bj, 8));
  simdgroup_matrix<T, 8, 8> h0 = make_filled_simdgroup_matrix<T, 8, 8>(T(0));
  simdgroup_matrix<T, 8, 8> h1 = make_filled_simdgroup_matrix<T, 8, 8>(T(0));
  mt_mma_pair(h0, a0, h1, a1, bt);
  simdgroup_store(h0, Q, 16, ulong2(8 * bj, 0));
  simdgroup_store(h1, Q, 16, ulong2(8 * bj, 8));
  simdgroup_float8x8 e = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(e, a0, bt, e);
  simdgroup_store(e, E, 16, ulong2(8 * bj, 0));
  simdgroup_matrix<T, 8, 8> bm;
  simdgroup_load(bm, xb, LD, ulong2(8 * bj, 0));
  simdgroup_float8x8 r0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_float8x8 r1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  mt_mma_pair(r0, a0, r1, a1, bm);
  simdgroup_store(r0, R, 16, ulong2(8 * bj, 0));
  simdgroup_store(r1, R, 16, ulong2(8 * bj, 8));
}
// mt_sg_load4: W [8, 32] in a tile of 16-byte rows, its four column blocks (step 8) read as
// A and as B blocks, plainly and transposed; the B blocks come out as I * B.
constexpr uint LW = 40;
threadgroup T wt[8 * LW];
for (uint i = lane; i < 256; i += 32) {
  wt[(i / 32) * LW + i % 32] = W[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_matrix<T, 8, 8> wa[4];
simdgroup_matrix<T, 8, 8> wat[4];
mt_sg_bmatrix<T> wb[4];
mt_sg_bmatrix<T> wbt[4];
mt_sg_load4(wa, wt, LW, 8u);
mt_sg_load4(wat, wt, LW, 8u, true);
mt_sg_load4(wb, wt, LW, 8u);
mt_sg_load4(wbt, wt, LW, 8u, true);
const simdgroup_matrix<T, 8, 8> eye(T(1));
for (uint m = 0; m < 4; ++m) {
  simdgroup_store(wa[m], WA, 32, ulong2(8 * m, 0));
  simdgroup_store(wat[m], WAT, 32, ulong2(8 * m, 0));
  simdgroup_float8x8 ib = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_float8x8 ibt = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(ib, eye, wb[m], ib);
  simdgroup_multiply_accumulate(ibt, eye, wbt[m], ibt);
  simdgroup_store(ib, WB, 32, ulong2(8 * m, 0));
  simdgroup_store(ibt, WBT, 32, ulong2(8 * m, 0));
}
""",
    inputs=(("A", "T", 2), ("B", "T", 2), ("C", mx.float32, 2), ("W", "T", 2)),
    outputs=(("P", mx.float32), ("Q", "T"), ("E", mx.float32), ("R", mx.float32),
             ("WA", "T"), ("WAT", "T"), ("WB", mx.float32), ("WBT", mx.float32)),
    templates=FLOATS,
)

# half / bfloat arithmetic with MSL's promotions, vectors, as_type, select, math.
SCALARS = Feature(
    name="scalars_vectors_math",
    source="""
const uint i = thread_position_in_grid.x;
if (i >= n) {
  return;
}
const T h = x[i];
const float f = h * 2.0f;        // T op float -> float
const T h2 = h * 2;              // T op int -> T
const T h3 = h + h;              // T op T -> T
float4 v = float4(f, float(h2), float(h3), 1.0f);
v = v * 0.5f + float4(1.0f);
v += float4(float2(1.0f, 2.0f), float2(3.0f));
const vec<T, 4> tv = vec<T, 4>(v);
const float4 back4 = float4(tv);
const uint bits = as_type<uint>(f);
const ushort hbits = as_type<ushort>(half(f));
const uint2 pair = as_type<uint2>(float2(f, 1.0f));
device float* row = out + i * 12;
row[0] = f;
row[1] = float(h2);
row[2] = dot(v, float4(1.0f));
row[3] = as_type<float>(bits);
row[4] = select(0.0f, 1.0f, h > 0.0f);
row[5] = clamp(f, -1.0f, 1.0f);
row[6] = metal::exp(min(f, 10.0f)) + metal::precise::rsqrt(abs(f) + 1.0f)
       + metal::fast::exp(-abs(f));
row[7] = float(hbits);
row[8] = back4.x + back4.w;
row[9] = float(pair.y == as_type<uint>(1.0f)) + (all(v > float4(-1000.0f)) ? 2.0f : 0.0f);
row[10] = float(max(h, T(0)) + min(h, T(0)));
row[11] = float(T(f)) + float(numeric_limits<T>::max() > T(1)) + (isnan(f) ? 100.0f : 0.0f);
""",
    inputs=(("x", "T", 1), ("n", mx.uint32, 0)),
    outputs=(("out", mx.float32),),
    templates=FLOATS,
)

# Device atomics through atomic_outputs (float add, uint max).
ATOMIC_OUT = Feature(
    name="atomic_outputs",
    source="""
const uint i = thread_position_in_grid.x;
atomic_fetch_add_explicit(&total[0], x[i], memory_order_relaxed);
atomic_fetch_max_explicit(&biggest[0], as_type<uint>(abs(x[i])), memory_order_relaxed);
atomic_fetch_min_explicit(&smallest[0], x[i], memory_order_relaxed);
""",
    inputs=(("x", mx.float32, 1),),
    outputs=(("total", mx.float32), ("biggest", mx.uint32), ("smallest", mx.float32)),
    atomic_outputs=True,
)

# Threadgroup atomics, threadgroup arrays, barriers, and partial edge threadgroups: run with a
# grid that is not a multiple of the threadgroup.
EDGE = Feature(
    name="edge_threadgroups",
    source="""
threadgroup atomic_uint count;
threadgroup float partials[32];
const uint i = thread_position_in_grid.x;
const uint lid = thread_index_in_threadgroup;
if (lid == 0) {
  atomic_store_explicit(&count, 0u, memory_order_relaxed);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
const float s = simd_sum(x[i]);
if (thread_index_in_simdgroup == 0) {
  partials[simdgroup_index_in_threadgroup] = s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float group_total = 0.0f;
for (uint g = 0; g < simdgroups_per_threadgroup; ++g) {
  group_total += partials[g];
}
tptg[i] = threads_per_threadgroup.x;
tpg[i] = threads_per_grid.x;
seen[i] = atomic_load_explicit(&count, memory_order_relaxed);
gsum[i] = group_total;
""",
    inputs=(("x", mx.float32, 1),),
    outputs=(("tptg", mx.uint32), ("tpg", mx.uint32), ("seen", mx.uint32),
             ("gsum", mx.float32)),
)

# A helper in the header (MSL `inline` function taking a threadgroup pointer), template
# int/bool arguments, half and bfloat literals.
HEADER = Feature(
    name="header_helpers",
    header="""
#include <metal_stdlib>
using namespace metal;

constant float kScale[2] = {0.5f, 2.0f};

template <typename U>
inline U twice(U v) {
  return v + v;
}

inline float sum_tile(const threadgroup float* t, uint n) {
  float s = 0.0f;
  for (uint k = 0; k < n; ++k) {
    s += t[k];
  }
  return s;
}
""",
    source="""
threadgroup float t[WIDTH];
const uint lid = thread_position_in_threadgroup.x;
t[lid] = float(x[lid]);
threadgroup_barrier(mem_flags::mem_threadgroup);
const float s = sum_tile(t, WIDTH);
out[lid] = twice(FLAG ? s * kScale[1] : s * kScale[0]) + (0.5h + float(0.5bf));
""",
    inputs=(("x", "T", 1),),
    outputs=(("out", mx.float32),),
    templates=((("T", mx.float16), ("WIDTH", 32), ("FLAG", True)),
               (("T", mx.bfloat16), ("WIDTH", 64), ("FLAG", False))),
)

# Swizzles (read, written, as values): the CUDA layer has none (C++ has no member syntax
# for them), so it refuses them when the kernel is made.
SWIZZLES = Feature(
    name="swizzles",
    source="""
const uint i = thread_position_in_grid.x;
float4 v = float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
const float2 a = v.xy + v.wz;
v.xy = v.yx;
const float3 b = v.zyx;
out[4 * i] = a.x;
out[4 * i + 1] = a.y;
out[4 * i + 2] = b.x + b.z;
out[4 * i + 3] = float4(v.rgba).r;
""",
    inputs=(("x", mx.float32, 1),),
    outputs=(("out", mx.float32),),
    refused_by=frozenset({"cuda"}),
)

# Packed vectors (3 elements without padding): refused by the CUDA layer as well.
PACKED = Feature(
    name="packed_vectors",
    source="""
const uint i = thread_position_in_grid.x;
const packed_float3 p = packed_float3(x[3 * i], x[3 * i + 1], x[3 * i + 2]);
const float3 f = float3(p);
out[i] = f.x + 2.0f * f.y + 4.0f * f.z + float(sizeof(packed_float3));
""",
    inputs=(("x", mx.float32, 1),),
    outputs=(("out", mx.float32),),
    refused_by=frozenset({"cuda"}),
)

# common.h's mt_round2<T>: pairs of float32 values rounded to T and read back (one vector
# conversion; the CUDA layer's cvt.rn.bf16x2 / f16x2), next to two scalar conversions.
ROUND2 = Feature(
    name="round2",
    header="#include <metal_stdlib>\nusing namespace metal;\n\n" + read_text("common.h"),
    source="""
const uint i = thread_position_in_grid.x;
if (i >= n) {
  return;
}
const float2 v = float2(x[2 * i], x[2 * i + 1]);
const float2 r = mt_round2<T>(v);
pair[2 * i] = r.x;
pair[2 * i + 1] = r.y;
scalar[2 * i] = float(T(v.x));
scalar[2 * i + 1] = float(T(v.y));
""",
    inputs=(("x", mx.float32, 1), ("n", mx.uint32, 0)),
    outputs=(("pair", mx.float32), ("scalar", mx.float32)),
    templates=FLOATS,
)

FEATURES = (SIMD, CONVERGED, RECONVERGE, MATRIX, MMA, PRODUCT_HELPERS, SCALARS, ATOMIC_OUT, EDGE, HEADER, SWIZZLES, PACKED,
            ROUND2)
