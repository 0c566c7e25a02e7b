// sdpa_multi_mma.metal: pass 1 of sdpa_multi on 8x8 simdgroup_matrix products (the MMA
// PATH; half and bfloat only). A tile of up to 32 query rows of one KV head's G*L rows
// attends one slice of the KV cache: S = Q K^T, the online softmax on S's fragments, O +=
// P V. Writes exactly sdpa_multi.metal's partials (o divided by the slice's lsum; m, lsum),
// which sdpa_multi_combine.metal merges.
//
// MATH: sdpa_multi.metal's MATH, RANGE and SPECIAL VALUES, with the same helpers
//   (sdpa_multi.h: causal bounds bottom-right aligned, the mask's addressing and rules:
//   bool False = -FLT_MAX, additive in natural-log units, -inf weighs 0, the block form,
//   kv_len clamped to [L, S]). Scores: d_j = a * dot(q_r, k_j) with (a, b) =
//   mt_score_unit(scale * log2(e)); here dot(q_r, k_j) is a float32 fragment product of the
//   unscaled T values (each product of two T values exact, summed in float32), multiplied by
//   a afterwards (the other paths scale q first: the same value up to float32 rounding).
//   RANGE, one difference: dot(q_r, k_j) itself must be finite in float32 (always for half
//   inputs: D * 65504^2 < 3.4e38; bfloat rows with |q| |k| near 1e19 could overflow where a
//   * q was finite).
//   Per 32-key block, row r: m_new = max(m, max_j d_j), alpha = 2^(b (m - m_new)) (1 when
//   equal), p_j = 2^(b (d_j - m_new)) (0 for a masked key), l_new = l alpha + sum_j p_j,
//   w_j = p_j / l_new, keep = l alpha / l_new: o = keep * o + sum_j w_j v_j (o stays a convex
//   combination of v rows, as sdpa_multi.metal's RANGE).
//
// PROBABILITIES IN T (exact to float32 accumulation): a fragment product needs P in T, and
//   one rounding of w_j to T (2^-11 relative in half, 2^-8 in bfloat) would exceed the
//   tolerance table's float32 accumulation term. So w_j is split into PT terms of T whose sum
//   is w_j to float32 precision, each multiplied by the same V fragment:
//     bfloat, PT = 3: w = t0 + t1 + t2, t_i = bfloat(w - t0 - .. - t_{i-1}): 8 + 8 + 8
//       significant bits hold float32's 24 exactly (bfloat has float32's exponent range);
//       two terms would leave up to 2^-18 w, above the table's 2e-6.
//     half, PT = 2: w = t0 + t1 / 2^11, t1 = half((w - t0) * 2^11): error at most 2^-24 w
//       (round to nearest; 2^-36 absolute where t1 falls among half's subnormals), the 2^11
//       keeping t1 a normal half; t1's products are summed apart, added to o times 2^-11.
//   Measured on the emulator: with t0 alone (w rounded once to T) random problems of 300 to
//   2000 keys fall out of the table in both types (test_negative_control_one_term).
//   Every product of two T values is exact in float32; the sums are float32 (the tensor
//   cores' sums on CUDA: float32 precision or better).
//
// LAYOUT: as sdpa_multi.metal (q [B, Hq, L, D], k, v [B, Hkv, S, D] T; o_part [B*Hq*L,
//   n_splits, D] and ml_part [B*Hq*L, n_splits, 2] float32; the same 0-d runtime inputs:
//   n_q, group, kv_len (device-side too), kv_rows, chunk (a multiple of 32), causal, scale,
//   mask with mask_sb, mask_sh, mask_sl, kv_heads, mask_block).
//   Template: T (half or bfloat), D (64, 96, 128, 256), PT (2 for half, 3 for bfloat: above),
//   PF (1: PREFETCH below, D 64, 96, 128; 0: each block staged in place), MASK_KIND (0 none
//   or causal, 1 bool, 2 additive; MT the mask's element type).
//
// PREFETCH (PF 1): the loads of the next K or V block are issued before the current
//   products, into registers, and stored to threadgroup memory after them: per 32-key block,
//   K's registers -> K tile, V's loads issued, barrier, S = Q K^T and the softmax, V's
//   registers -> V tile, the next K block's loads issued (none past the slice's, or the
//   tile's causal, last key), barrier, P V. One block of one matrix in registers (D/16
//   four-element pieces per thread, slot tid's: piece e of a block belongs to slot e % 128;
//   with fewer than 128 threads the other slots are staged at the store, loads then stores:
//   their loads are not overlapped). The slice's first K block is fetched before q is
//   staged. q stays in a tile of its own, its fragments loaded per block (the registers they
//   took pay for the fetched block's). The same two barriers per block as PF 0, the same
//   products in the same order: the same results, bit for bit, as the MSL is written (the
//   emulator checks it; on CUDA the compiler may contract the two kernels' float operations
//   into FMAs differently: last bits differ there, within the table). K and V tiles apart
//   only (D 64, 96, 128). PF 0: each block's K and V loads, then stores, between barriers
//   (nothing overlaps the loads); q held in registers.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * NSG, 1, 1), NSG = 1 .. 4 simdgroups, read at run time: the row tile
//     holds TR = 8 * NSG rows, simdgroup sg rows tile_row0 + 8 sg .. + 7 (those < G*L)
//   grid = (32 * NSG * ceil(G*L / TR), n_splits, B * Hkv): threadgroup_position_in_grid =
//     (row tile, slice, b * Hkv + kvh), the row tiles of one slice adjacent
//   slice s covers keys [s * chunk, min((s + 1) * chunk, kv_len)); n_splits * chunk >= kv_len
//   threadgroup memory: kv_tile, 32 x (D + 8) elements of T for K and as many for V where
//     both fit in 32 KiB (KV_APART: D 64, 96, 128; D 128: 17,408 bytes), else one tile for
//     both (D 256: 16,896 bytes): q's TR rows first, then each block's K and V, staged
//     together (two barriers per block), or K then V (four). PF 1: a third tile for q's TR
//     rows (D 128: 26,112 bytes in all), K and V as PREFETCH. Rows past the block's keys are
//     zero-filled (0 * NaN would poison o). Every thread reaches every barrier. Rows of
//     (D + 8) * sizeof(T) bytes and fragment columns at multiples of 8: each 4-fragment read
//     (mt_sg_load4) starts 16-byte aligned, as it promises.
//   Lane l of a simdgroup holds row fm = mt_frag_row(l) and columns fn, fn + 1, fn =
//     mt_frag_col(l), of each 8x8 fragment (common.h: the executor's thread_elements() layout,
//     Apple's on Metal and the emulator, mma.sync's on CUDA): its row's scores of a block are
//     8 of S's 4 key fragments, and the 4 lanes sharing a row (lane bits MT_FRAG_ROW_XOR0 and
//     MT_FRAG_ROW_XOR1) reduce its max and sum with two simd_shuffle_xor each.
//   Registers per lane: q, D/8 T fragments (2 elements each; PF 1: one at a time); o, D/8
//     float fragments; S 4; P 4 x PT T fragments; PF 1: D/16 vec<T, 4> pieces of the next
//     block.
//   CUDA (nvcc sm_90 --resource-usage, no mask / bool / additive; fragments in mma.sync's
//     layout, K and V as mt_sg_bmatrix, mt_cuda/matrix.cuh), PF 0: half D 64 88 / 86 / 96
//     registers per thread, D 96 93 / 106 / 104, D 128 132 / 130 / 132, D 256 242 / 236 /
//     255; bfloat D 64 101 / 87 / 96, D 96 105 / 107 / 156, D 128 133 / 130 / 128, D 256 242
//     / 236 / 255. PF 1 (q from its tile): half D 64 88 / 84 / 88, D 96 92 / 110 / 105, D 128
//     152 / 158 / 158; bfloat D 64 94 / 88 / 88, D 96 112 / 166 / 180, D 128 148 / 162 /
//     160: at D 128 three 4-simdgroup threadgroups per SM (<= 168) either way (PF 1 reads
//     q's fragments one at a time: four at once took 208 with an additive mask). No spills,
//     no stack (the unrolled loops below: without them nvcc kept q and o in local memory),
//     except D 256 with an additive mask: 84 (half) / 92 (bfloat) bytes of spill stores (not
//     timed; such calls are rare: an additive mask array at head dim 256). With launch
//     bounds (128, 3) (MMA_BOUNDED in ops/sdpa_multi.py: PF 0, no mask, D 128), in Apple's
//     layout: half 147, bfloat 153, no spills; with a mask they spill. Products of half /
//     bfloat fragments run on the tensor cores: one mma.sync m16n8k8 each, K and V read in
//     its B layout by one ldmatrix per 4 fragments (mt_sg_load4: the tiles' 16-byte rows),
//     no movmatrix, and P V's terms 0 and 1 paired in one (mt_mma_pair: PT m16n8k8 per V
//     fragment become PT - 1). Per bfloat D 128 block and simdgroup, PTX: 192 mma, 32
//     ldmatrix and 16 shared loads (q), against 256 mma, 256 movmatrix and 288
//     scalar shared loads before.
//
// TRAFFIC per call: each visible K/V row is read once per row tile (ceil(G*L / TR) times;
//   once when G*L <= 32); a causal tile stops at the last key its rows see, and a simdgroup
//   whose rows see no key of a block skips its products (it still stages; PF 1 fetches no
//   row past that last key: the same bytes). q is read once per slice, the partials written
//   once (as sdpa_multi.metal).
//   Work per 32-key block and simdgroup (8 rows): 4 * D/8 products for S and PT * 4 * D/8
//   for P V (on CUDA (PT - 1) * 4 * D/8 instructions, above), against the staged path's
//   8 * 32 * 2D scalar FMAs per row group.
//
// REDUCTION ORDER: a score sums d in fragments of 8 in increasing order (the order inside
//   a product is the hardware's); a block's max and sum over the row's 4 lanes by the xor
//   tree (XOR0, then XOR1: column pairs (0 + 1) + (2 + 3) in either layout); o accumulates
//   the keys of a block by fragments of 8 in increasing order, the half t1 terms apart and
//   added at the block's end, blocks in increasing order; PF 0 and PF 1 alike. Different
//   from the staged and vector paths (last bits differ, all within the tolerance table).
//
// Checked only on a Mac: that Apple's compiler accepts the body as written (half and bfloat
//   simdgroup_matrix loads from threadgroup memory, transposed loads, products of T fragments
//   into float fragments, thread_elements() in the lane layout above, the vec<T, 4> loads
//   and threadgroup stores, PF 1's thread array of vec<T, 4> passed by pointer, common.h's
//   product helpers: the alias template mt_sg_bmatrix, mt_sg_load4 taking a thread array of
//   fragments by pointer and a templated fragment type; bfloat needs Metal 3.1's bfloat),
//   that nothing spills (PF 1's registers included), and the speed of each PF. The emulator
//   checks the semantics, the lane layout, barriers, races on threadgroup memory (strict
//   mode) and the device traffic; nvcc the CUDA translation and its registers.
#include "common.h"
#include "sdpa_multi.h"

// Stage rows [0, n_valid) of a block of n_rows rows of a [.., D] matrix into tile (row
// stride TS), four elements per load; rows n_valid .. n_rows - 1 are zero-filled.
template <typename T, int D, int TS>
inline void mt_sdpa_mma_stage(threadgroup T* tile, const device T* src, uint n_valid,
                              uint n_rows, uint tid, uint n_threads) {
  constexpr uint Q4 = uint(D) / 4u;  // 4-element pieces per row
  for (uint e = tid; e < n_rows * Q4; e += n_threads) {
    const uint j = e / Q4;
    const uint c = (e - j * Q4) * 4u;
    vec<T, 4> x = vec<T, 4>(T(0));
    if (j < n_valid) {
      x = *reinterpret_cast<const device vec<T, 4>*>(src + size_t(j) * D + c);
    }
    *reinterpret_cast<threadgroup vec<T, 4>*>(tile + j * TS + c) = x;
  }
}

// The same for a 32-row block of K and of V at once (both loads issued before the stores).
template <typename T, int D, int TS>
inline void mt_sdpa_mma_stage_kv(threadgroup T* k_tile, threadgroup T* v_tile,
                                 const device T* k_src, const device T* v_src, uint n_valid,
                                 uint tid, uint n_threads) {
  constexpr uint Q4 = uint(D) / 4u;
  for (uint e = tid; e < 32u * Q4; e += n_threads) {
    const uint j = e / Q4;
    const uint c = (e - j * Q4) * 4u;
    vec<T, 4> xk = vec<T, 4>(T(0));
    vec<T, 4> xv = vec<T, 4>(T(0));
    if (j < n_valid) {
      xk = *reinterpret_cast<const device vec<T, 4>*>(k_src + size_t(j) * D + c);
      xv = *reinterpret_cast<const device vec<T, 4>*>(v_src + size_t(j) * D + c);
    }
    *reinterpret_cast<threadgroup vec<T, 4>*>(k_tile + j * TS + c) = xk;
    *reinterpret_cast<threadgroup vec<T, 4>*>(v_tile + j * TS + c) = xv;
  }
}

// PF 1 (PREFETCH below): a 32-row block of K or V as 32 * D / 4 four-element pieces, piece
// e held by slot e % 128 (N = D / 16 pieces a slot: e = slot + 128 i, so that a thread's
// addresses differ by constants). Thread tid fetches slot tid's pieces into registers; the
// slots past n_threads (fewer than 4 simdgroups) are staged at the store, straight from
// src. Rows n_valid .. 31 read as zeros.
template <typename T, int D, int N>
inline void mt_sdpa_mma_fetch(thread vec<T, 4>* buf, const device T* src, uint n_valid,
                              uint tid) {
  constexpr uint Q4 = uint(D) / 4u;
  #pragma clang loop unroll(full)
  for (int i = 0; i < N; ++i) {
    const uint e = tid + uint(i) * 128u;
    const uint j = e / Q4;
    buf[i] = vec<T, 4>(T(0));
    if (j < n_valid) {
      buf[i] = *reinterpret_cast<const device vec<T, 4>*>(src + size_t(e) * 4u);
    }
  }
}

// Store a fetched block into tile, then stage slots n_threads .. 127 straight from src.
template <typename T, int D, int TS, int N>
inline void mt_sdpa_mma_put(threadgroup T* tile, const thread vec<T, 4>* buf,
                            const device T* src, uint n_valid, uint tid, uint n_threads) {
  constexpr uint Q4 = uint(D) / 4u;
  #pragma clang loop unroll(full)
  for (int i = 0; i < N; ++i) {
    const uint e = tid + uint(i) * 128u;
    const uint j = e / Q4;
    *reinterpret_cast<threadgroup vec<T, 4>*>(tile + e * 4u + j * uint(TS - D)) = buf[i];
  }
  for (uint slot = tid + n_threads; slot < 128u; slot += n_threads) {
    for (int i = 0; i < N; ++i) {
      const uint e = slot + uint(i) * 128u;
      const uint j = e / Q4;
      vec<T, 4> x = vec<T, 4>(T(0));
      if (j < n_valid) {
        x = *reinterpret_cast<const device vec<T, 4>*>(src + size_t(e) * 4u);
      }
      *reinterpret_cast<threadgroup vec<T, 4>*>(tile + e * 4u + j * uint(TS - D)) = x;
    }
  }
}

// ---- kernel body ----
// Every loop over fragments, terms or a lane's 8 scores is unrolled: their arrays then live
// in registers (nvcc left the unannotated ones in local memory).
constexpr int DF = D / 8;    // 8-column fragments of a q / k / v / o row
constexpr int TS = D + 8;    // kv_tile row stride: 16 bytes of padding (fragment loads of
                             // 8 rows hit 8 different 4-bank groups)
constexpr float TERM_SCALE = PT == 2 ? 2048.0f : 1.0f;  // t_i's weight is TERM_SCALE^-i
static_assert(D % 32 == 0, "head dim");
static_assert(TS * sizeof(T) % 16 == 0, "mt_sg_load4 reads 16-byte aligned rows");
static_assert(PT >= 2 && PT <= 3, "probability terms");
constexpr int PF_N = D / 16;  // PF 1: pieces per slot of a fetched block
constexpr bool KV_APART = 2 * 32 * TS * int(sizeof(T)) <= 32 * 1024;  // K and V tiles
static_assert(PF == 0 || KV_APART, "PF 1 keeps K, V and q in tiles of their own");
// PF 1: q's tile after V's (fragments loaded per block), else q staged into K's tile once
threadgroup T kv_tile[(KV_APART ? 2 : 1) * 32 * TS + (PF ? 32 * TS : 0)];
threadgroup T* q_tile = kv_tile + (PF ? 2 * 32 * TS : 0);
threadgroup T* v_tile = kv_tile + (KV_APART ? 32 * TS : 0);

const uint tile = threadgroup_position_in_grid.x;
const uint slice = threadgroup_position_in_grid.y;
const uint bh = threadgroup_position_in_grid.z;
const uint n_splits = threadgroups_per_grid.y;
const uint tid = thread_position_in_threadgroup.x;
const uint n_threads = threads_per_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;

const uint L = n_q;
const uint n_rows = group * L;                  // query rows that share this KV head
const uint kvn = max(min(kv_len, kv_rows), L);  // never read past S; L <= kv_len (device kv_len)
const bool is_causal = causal != 0u;
const float2 score_unit = mt_score_unit(scale);
const float q_scale = score_unit.x;  // scores in units of b = score_unit.y
const float unit = score_unit.y;
const uint key0 = mask_block != 0u ? kvn - L : 0u;  // the mask's column 0
const float mask_unit = 1.4426950408889634f / unit;  // natural-log mask -> score units
const size_t q_row0 = size_t(bh) * n_rows;
const size_t head_off = size_t(bh) * kv_rows * D;
const device T* k_head = k + head_off;
const device T* v_head = v + head_off;

// The tile's rows and keys; a causal tile stops at the last key its latest query sees, and
// each simdgroup at the last key of its own rows (sg_end: uniform over the simdgroup).
const uint tile_rows = n_threads / 4u;  // 8 per simdgroup
const uint tile_row0 = tile * tile_rows;
const uint tile_valid = min(tile_rows, n_rows - tile_row0);  // >= 1
const uint k_begin = slice * chunk;
const uint k_end = mt_sdpa_tile_end(min(k_begin + chunk, kvn), tile_row0,
                                    tile_row0 + tile_valid - 1u, L, kvn, is_causal);
const uint row0 = tile_row0 + sg * 8u;
const uint nr = row0 < n_rows ? min(8u, n_rows - row0) : 0u;
const uint sg_end = nr == 0u ? 0u : mt_sdpa_tile_end(k_end, row0, row0 + nr - 1u, L, kvn,
                                                     is_causal);

// This lane's row of every fragment and its first column (DISPATCH INVARIANTS).
const uint fm = mt_frag_row(lane);
const uint fn = mt_frag_col(lane);
const uint r = row0 + fm;
const bool row_valid = fm < nr;
const uint lim = row_valid ? mt_sdpa_row_end(r, L, kvn, is_causal) : 0u;  // 0: no key
const size_t mask_row = mt_sdpa_mask_row(bh, r, L, group, kv_heads, mask_sb, mask_sh,
                                         mask_sl);

// PF 1: the registers holding the next K or V block, and the slice's first K block fetched
// before q is staged.
vec<T, 4> pre[PF ? PF_N : 1];
if (PF && k_begin < k_end) {
  mt_sdpa_mma_fetch<T, D, PF_N>(pre, k_head + size_t(k_begin) * D, min(32u, k_end - k_begin),
                                tid);
}

// q: the tile's rows staged once; with PF 0 each simdgroup keeps its 8 rows as D/8
// fragments, with PF 1 it loads them from q_tile per block (fewer registers).
mt_sdpa_mma_stage<T, D, TS>(q_tile, q + (q_row0 + tile_row0) * D, tile_valid, tile_rows,
                            tid, n_threads);
threadgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_matrix<T, 8, 8> qf[PF ? 1 : DF];
#pragma clang loop unroll(full)
for (int i = 0; i < (PF ? 0 : DF); i += 4) {
  mt_sg_load4(qf + i, kv_tile + sg * 8u * TS + uint(i * 8), TS, 8u);
}

// Running softmax state of row fm (the same in its 4 lanes); o kept divided by its lsum.
float m_run = -INFINITY;  // no visible key seen yet
float l_run = 0.0f;
simdgroup_matrix<float, 8, 8> of[DF];
#pragma clang loop unroll(full)
for (int i = 0; i < DF; ++i) {
  of[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

for (uint kb = k_begin; kb < k_end; kb += 32u) {
  const uint nk = min(32u, k_end - kb);  // keys of this block (uniform)
  const bool live = kb < sg_end;         // this simdgroup's rows see a key of the block
  if (PF) {  // the fetched K block into its tile, then V's fetch issued (PREFETCH)
    mt_sdpa_mma_put<T, D, TS, PF_N>(kv_tile, pre, k_head + size_t(kb) * D, nk, tid,
                                    n_threads);
    mt_sdpa_mma_fetch<T, D, PF_N>(pre, v_head + size_t(kb) * D, nk, tid);
  } else {  // K (and V where apart) staged: loads, then stores
    threadgroup_barrier(mem_flags::mem_threadgroup);  // earlier readers of kv_tile are done
    if (KV_APART) {
      mt_sdpa_mma_stage_kv<T, D, TS>(kv_tile, v_tile, k_head + size_t(kb) * D,
                                     v_head + size_t(kb) * D, nk, tid, n_threads);
    } else {
      mt_sdpa_mma_stage<T, D, TS>(kv_tile, k_head + size_t(kb) * D, nk, 32u, tid, n_threads);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  simdgroup_matrix<T, 8, 8> pf[PT][4];  // the block's weights w_j as PT terms
  if (live) {
    // S = Q K^T: key fragment j from K's rows 8j .. 8j + 7, read transposed (column block i
    // of the 4 key fragments at once; PF 1 reads q's fragment i from its tile; every sf[j]
    // sums its D/8 products in increasing i).
    simdgroup_matrix<float, 8, 8> sf[4];
    #pragma clang loop unroll(full)
    for (int j = 0; j < 4; ++j) {
      sf[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    #pragma clang loop unroll(full)
    for (int i = 0; i < DF; ++i) {
      if (PF) {
        simdgroup_load(qf[0], q_tile + sg * 8u * TS + uint(i * 8), TS);
      }
      mt_sg_bmatrix<T> kf[4];
      mt_sg_load4(kf, kv_tile + uint(i * 8), TS, 8u * TS, true);
      #pragma clang loop unroll(full)
      for (int j = 0; j < 4; ++j) {
        simdgroup_multiply_accumulate(sf[j], qf[PF ? 0 : i], kf[j], sf[j]);
      }
    }

    // Online softmax of row fm over the block (base 2), as sdpa_multi.metal: masked keys
    // get probability exactly 0; the row's 4 lanes reduce by xor over lane bits 0 and 3
    // (converged: the products above already needed the whole SIMD-group).
    float sc[8];
    bool ok[8];
    float bmax = -INFINITY;
    #pragma clang loop unroll(full)
    for (int j = 0; j < 4; ++j) {
      #pragma clang loop unroll(full)
      for (int e = 0; e < 2; ++e) {
        const uint key = kb + uint(j * 8 + e) + fn;
        bool vis = key < min(lim, k_end);
        float s = q_scale * sf[j].thread_elements()[e];
        if (MASK_KIND != 0 && vis && key >= key0) {
          s = mt_sdpa_masked<MASK_KIND>(s, mask[mask_row + (key - key0)], mask_unit, vis);
        }
        sc[j * 2 + e] = vis ? s : -INFINITY;
        ok[j * 2 + e] = vis;
        bmax = max(bmax, sc[j * 2 + e]);
      }
    }
    bmax = max(bmax, mt_shuffle_xor_converged(bmax, ushort(MT_FRAG_ROW_XOR0)));
    bmax = max(bmax, mt_shuffle_xor_converged(bmax, ushort(MT_FRAG_ROW_XOR1)));
    const float m_new = max(m_run, bmax);  // -INFINITY while no key was visible
    const float alpha = m_run == m_new ? 1.0f : exp2(unit * (m_run - m_new));
    float p[8];
    float bsum = 0.0f;
    #pragma clang loop unroll(full)
    for (int c = 0; c < 8; ++c) {
      p[c] = ok[c] ? exp2(unit * (sc[c] - m_new)) : 0.0f;
      bsum += p[c];
    }
    bsum += mt_shuffle_xor_converged(bsum, ushort(MT_FRAG_ROW_XOR0));
    bsum += mt_shuffle_xor_converged(bsum, ushort(MT_FRAG_ROW_XOR1));
    const float l_old = l_run * alpha;
    const float l_new = l_old + bsum;
    const float inv_l = l_new > 0.0f ? 1.0f / l_new : 0.0f;  // 0 until a key was visible
    const float keep = l_old * inv_l;  // the old o's weight: keep + sum of w_j = 1
    m_run = m_new;
    l_run = l_new;
    #pragma clang loop unroll(full)
    for (int j = 0; j < 4; ++j) {
      #pragma clang loop unroll(full)
      for (int e = 0; e < 2; ++e) {
        float rest = p[j * 2 + e] * inv_l;  // w_j, split into PT terms of T
        float weight = 1.0f;
        #pragma clang loop unroll(full)
        for (int t = 0; t < PT; ++t) {
          const T part = T(rest * weight);
          pf[t][j].thread_elements()[e] = part;
          rest -= float(part) / weight;  // exact: part is rest * weight rounded
          weight *= TERM_SCALE;
        }
      }
    }
    #pragma clang loop unroll(full)
    for (int i = 0; i < DF; ++i) {
      of[i].thread_elements()[0] *= keep;
      of[i].thread_elements()[1] *= keep;
    }
  }

  if (PF) {  // the fetched V block into its tile, then the next K block's fetch issued
    mt_sdpa_mma_put<T, D, TS, PF_N>(v_tile, pre, v_head + size_t(kb) * D, nk, tid,
                                    n_threads);
    if (kb + 32u < k_end) {  // never past the slice's (or the tile's causal) last key
      mt_sdpa_mma_fetch<T, D, PF_N>(pre, k_head + size_t(kb + 32u) * D,
                                    min(32u, k_end - kb - 32u), tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else if (!KV_APART) {  // V into K's tile (uniform: a constant)
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with K
    mt_sdpa_mma_stage<T, D, TS>(v_tile, v_head + size_t(kb) * D, nk, 32u, tid, n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (live) {
    // o += P V: term 0 straight into o, the others summed apart and added with their
    // weight TERM_SCALE^-1 (bfloat: 1).
    #pragma clang loop unroll(full)
    for (int i = 0; i < DF; ++i) {
      simdgroup_matrix<float, 8, 8> lo = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      mt_sg_bmatrix<T> vf[4];
      mt_sg_load4(vf, v_tile + uint(i * 8), TS, 8u * TS);  // V's rows 8j .. 8j + 7
      #pragma clang loop unroll(full)
      for (int j = 0; j < 4; ++j) {
        mt_mma_pair(of[i], pf[0][j], lo, pf[1][j], vf[j]);  // terms 0, 1: one product on CUDA
        #pragma clang loop unroll(full)
        for (int t = 2; t < PT; ++t) {
          simdgroup_multiply_accumulate(lo, pf[t][j], vf[j], lo);
        }
      }
      if (PT > 1) {
        of[i].thread_elements()[0] += lo.thread_elements()[0] * (1.0f / TERM_SCALE);
        of[i].thread_elements()[1] += lo.thread_elements()[1] * (1.0f / TERM_SCALE);
      }
    }
  }
}

// Partial results of this slice, one (row, slice) entry each (an empty slice: m =
// -INFINITY, lsum = 0, o = 0).
if (row_valid) {
  const size_t entry = (q_row0 + r) * n_splits + slice;
  #pragma clang loop unroll(full)
  for (int i = 0; i < DF; ++i) {
    *reinterpret_cast<device float2*>(o_part + entry * D + uint(i * 8) + fn) =
        float2(of[i].thread_elements()[0], of[i].thread_elements()[1]);
  }
  if ((lane & (MT_FRAG_ROW_XOR0 | MT_FRAG_ROW_XOR1)) == 0u) {  // the row's first lane
    ml_part[entry * 2u] = m_run;
    ml_part[entry * 2u + 1u] = l_run;
  }
}
