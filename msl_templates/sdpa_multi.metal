// sdpa_multi.metal: pass 1 of sdpa_multi. A tile of query rows (L queries x the G = Hq/Hkv
// query heads that share one KV head) attends one slice of the KV cache; the slice is read
// from device memory once for all rows of the tile. Writes partial softmax results (o
// divided by the slice's lsum); sdpa_multi_combine.metal merges the slices.
// Two paths, chosen by the template parameter DC (the launch plan picks one per backend,
// ops/sdpa_multi.py SPLIT_PATH): the STAGED PATH (DC > 0: 32-row tiles, K/V staged through
// threadgroup memory 32 keys at a time, one key per lane; the Metal plan) and the VECTOR PATH
// (DC = 0: RS-row tiles, 4 simdgroups per slice, each lane reading D/32 contiguous
// elements of every K/V row straight from device memory; the CUDA plan). Both share the
// math, the masks, the partials' layout and the combine below.
//
// MATH (per query row r of a KV head's group, all in float32; base-2 exponentials):
//   row r = g * L + l is query l of query head kvh * G + g (G = Hq / Hkv)
//   visible keys: j < kv_len, and j <= kv_len - L + l when causal (bottom-right aligned)
//   MASK_KIND 1 (bool) / 2 (additive): mask[b, h, l, c] read at column c = j - key0, key0 =
//     0 (the mask covers keys [0, kv_len)) or kv_len - L (block form: it covers the last L
//     keys, every key before them is visible). bool: False = not attended, scored as
//     -FLT_MAX (MLX's lowest finite score: a row whose keys are all masked averages v
//     uniformly, as MLX's own sdpa does); additive: s_j += mask (natural-log units), and a
//     key whose score is then -inf weighs 0.
//   s_j = (scale * log2(e)) * dot(q_r, k_j)             (`scale` arrives pre-multiplied)
//   held as d_j = a * dot(q_r, k_j) with (a, b) = mt_score_unit(scale * log2(e)) (common.h):
//   s_j - m = b * (d_j - max d), exact; m below is kept in units of d (b = 1 for |scale *
//   log2(e)| < 1, where d = s), so scores beyond float32's range (scale 1e38, ordinary q, k)
//   still weigh their keys right.
//   for the visible keys j of this slice: m = max_j s_j,  lsum = sum_j 2^(s_j - m),
//   o[d] = sum_j 2^(s_j - m) * v_j[d] / lsum            (the slice's softmax @ v)
//   softmax(scale * q.k) @ v == sum_s (2^(m_s - M) lsum_s / W) o_s, W = sum_s 2^(m_s - M)
//   lsum_s, over the slices s, M = max_s m_s. A slice that sees no key of a row writes
//   m = -INFINITY, lsum = 0, o = 0.
//
// RANGE: o is kept divided by the running lsum (after each 32-key block, the old o and the
//   block's p_j are weighted by lsum_old * alpha / lsum_new and p_j / lsum_new, which sum to
//   1), so every partial sum is a convex combination of v rows: it never exceeds max |v|,
//   where sum_j p_j v_j overflows float32 once kv_len * |v| does. COST: per row and block,
//   one simd_sum (the block's sum of p, which the lanes kept apart before) and a division;
//   per score one more multiply (by b, in the exponent); no extra pass over K or V.
//
// SPECIAL VALUES: masked keys and the running maximum before the first visible key are
//   -INFINITY, so any finite score (down to -FLT_MAX) is above them. The rescale factor
//   2^(m_old - m_new) is taken as 1 when m_old == m_new, so a row that has seen no key yet
//   (both -INFINITY) never computes 2^(-inf - -inf) = NaN; a masked key's probability is
//   set to 0, never computed. Relies on IEEE infinities (2^-inf = 0, max with -inf):
//   MLX builds metal_kernel sources in its "safe" math mode, which keeps them; the
//   difference of two finite scores may overflow to -inf too, and then also weighs 0.
//
// LAYOUT (row-contiguous, ensure_row_contiguous):
//   q [B, Hq, L, D] T: the G*L rows of KV head (b, kvh) are contiguous, row r at
//     ((b*Hkv + kvh) * G*L + r) * D
//   k, v [B, Hkv, S, D] T (S = kv_rows >= kv_len; rows >= kv_len are never read, and no
//     row >= S even if a launcher passed kv_len > S: the kernel clamps it)
//   o_part [B*Hq*L, n_splits, D] float32, ml_part [B*Hq*L, n_splits, 2] float32 (m, lsum)
//   0-d runtime inputs: n_q (L), group (G), kv_len, kv_rows (S), chunk (keys per slice,
//   a multiple of 32; of KB on the VECTOR PATH), causal (0/1) as uint, scale (float, times
//   log2(e)). kv_len may be
//   device-side: it is clamped to [L, S] here, and slices past it see no key.
//   mask [MB, MH, L, MC] (bool or T; a 1-element dummy when MASK_KIND == 0), read with the
//   element strides mask_sb, mask_sh, mask_sl (0 on a broadcast axis), column stride 1;
//   kv_heads (Hkv) and mask_block (0/1: key0 above) as uint.
//   ml_part's m is in units of d (as above): the combine takes the same scale to undo them.
//   Template: T, D (head dim, multiple of 32), RS (rows per simdgroup), DC (0: the VECTOR
//   PATH below; else the STAGED PATH's columns
//   staged at a time: D or D/2, a multiple of 32, with 32 * DC * sizeof(T) <= 16 KiB),
//   MASK_KIND (0 none or causal, 1 bool, 2 additive: the unmasked path reads no mask).
//
// DISPATCH INVARIANTS of the STAGED PATH (the wrapper derives them from validated shapes;
// the VECTOR PATH's are in its section below):
//   threadgroup = (32 * NSG, 1, 1), NSG = 32 / RS simdgroups (also when G*L < 32: the
//     simdgroups without rows still share the staging loads)
//   grid = (32 * NSG * n_splits, ceil(G*L / 32), B * Hkv):
//     threadgroup_position_in_grid = (slice, row tile, b * Hkv + kvh)
//   slice s covers keys [s * chunk, min((s + 1) * chunk, kv_len)); n_splits * chunk >= kv_len
//   simdgroup w of row tile t owns rows t*32 + w*RS .. + RS - 1 (those < G*L); lane i owns
//   key kb + i of each 32-key block kb, q columns [i*D/32, (i+1)*D/32) (shuffled to the
//   other lanes in vectors of up to 4) and o columns i + 32*c.
//   threadgroup memory: kv_tile, 32 * (DC + 4 / sizeof(T)) elements of T (<= 16.5 KiB), and
//   p_tile, 32 x 32 floats (each simdgroup's rows of probabilities of the current block).
//   Every thread reaches every barrier: loop bounds are uniform over the threadgroup.
//   Both paths' SIMD-group functions run with all 32 lanes of whole SIMD-groups (loop
//   bounds uniform over a SIMD-group, no early return): common.h's converged promise
//   (mt_shuffle_converged and its kin; the emulator checks it at every call).
//
// TRAFFIC per call: each visible key/value row is read by exactly one threadgroup per row
//   tile (ceil(G*L / 32) times in all; once when G*L <= 32). Causal slices stop at the last
//   key the tile's rows can see. q is read once per slice, partials written once
//   (float32: n_splits * G*L * (D + 2) * 4 bytes per KV head, read again by the combine).
//   A full tile does 32 rows * 32 keys * 2D multiply-adds per 2 * 32 * D * sizeof(T) bytes
//   of staged K/V (16 per byte in half): past 32 rows per KV head the kernel is bound by
//   its scalar FMAs rather than by bandwidth (the other row tiles of the same head read the
//   same keys at about the same time, so their re-reads may hit the GPU's caches: not
//   measured). A larger row tile would pay off with a simdgroup_matrix variant.
//
// REDUCTION ORDER: scores accumulate over d in increasing order; l and o accumulate over the
//   keys of a slice in increasing block order; a block's p are summed with simd_sum.
//
// VECTOR PATH (DC == 0), after MLX's own sdpa_vector kernels (a SIMD-group per key, each lane
//   holding D/32 contiguous elements of q, k and the output) extended to the RS query rows
//   of a tile so that K/V are read once for all of them:
//   threadgroup = (32 * VSG, 1, 1), VSG = 4 simdgroups sharing one KV slice (the launcher's
//     VEC_SIMDGROUPS must equal VSG); grid = (32 * VSG * ceil(G*L / RS), n_splits, B * Hkv):
//     threadgroup_position_in_grid = (row tile, slice, b * Hkv + kvh), the row tiles of one
//     slice adjacent (their re-reads of the same keys meet in the GPU's L2). Simdgroup sg
//     takes the slice's key batches sg, sg + VSG, ..., keeping its own (m, lsum, o) per
//     row; at the end each writes them to p_tile (VSG * RS * (D + 2) floats, <= 16.6 KiB),
//     one barrier, and simdgroup sg merges rows sg, sg + VSG, ... as the combine merges
//     slices (weights 2^(m_s - M) lsum_s / W, summing to 1) into the slice's entry.
//   Lane i holds columns w * 32 * VW + i * VW + e (w < NV, e < VW; VW = 4, 2 or 1 as D/32
//     allows: D 64 -> one 2-vector, 96 -> three scalars, 128 -> one 4-vector, 256 -> two
//     4-vectors) of q (pre-scaled) and o for each of the tile's RS rows, and reads the same
//     columns of each K and V row with one vector load per w: every K/V byte of the slice
//     is loaded by exactly one lane. Alignment: rows are D * sizeof(T) bytes (a multiple of
//     128) and a lane's first column a multiple of VW.
//   Keys go in batches of KB = 32 / RS: the RS * KB partial dot products of a lane are
//     summed over the lanes by a reduce-scatter (5 steps of simd_shuffle_xor, 31 shuffles:
//     at step h a lane keeps the half of its values whose index bit h matches its lane bit
//     and adds the partner's copy of them), after which lane i holds the whole score of row
//     i / KB, key i % KB. The batch's softmax update of a row runs on its KB lanes (max and
//     sum over log2(KB) xor steps; masks read once per (row, key)); then each lane takes the
//     rows' rescale factors and weights by simd_shuffle and updates o from the batch's V.
//     A batch's K and V rows are loaded together at its start (one memory round trip per
//     batch, 2 * KB * D * sizeof(T) bytes in flight per simdgroup), held in T until used.
//   Per key, one simdgroup, nr <= RS valid rows, NV loads per K or V row per lane:
//     loads per lane: 2 * NV vector loads (D 128 half: two 8-byte loads; D 256: four);
//     shuffles: (31 + 2 log2 KB) / KB + nr / KB + nr (RS 4, 4 rows: 9.1; RS 8, 8 rows: 18.8).
//     The staged path, per key: 2 * D / (32 * NSG) scalar loads per thread into threadgroup
//     memory (D 128, 4 simdgroups: two 16-bit loads), 2 * DPL + RS threadgroup reads per
//     lane, and per simdgroup with rows DPL * nr + 10 * nr / 32 shuffles of 32 bits (q
//     from the key's lane, each block's max and sum: 4 rows at D 128: 17.3; 8 rows: 34.5).
//   RS is chosen from G alone (a decode loop that changes L builds no new kernel): q and o
//     of RS rows take RS * D/32 floats each per lane (<= 32: RS 16 for D 64, 8 for D 96/128,
//     4 for D 256). TRAFFIC: each visible K/V byte is read once per KV head when G * L <= RS
//     (decode), else once per RS-row tile (ceil(G*L / RS) times; a causal tile stops at its
//     latest query's last key); q once per slice and simdgroup; partials as in the staged
//     path, one entry per slice.
//   REDUCTION ORDER: a score sums the lane's columns in increasing order, then the lanes by
//     the reduce-scatter's fixed tree; a simdgroup's l and o accumulate over its batches in
//     increasing key order; the simdgroups merge in order, then the combine the slices. Different from the staged
//     path's order (results differ in the last bits, both within the tolerance table).
//   CUDA (nvcc sm_90, half): 132 registers per thread at RS 4 / D 128, 140 at RS 8, 196 at
//     D 256, 126 at RS 16 / D 64, no spills (the staged path: 123); K/V as ld.global.v4.u16
//     (D 64: v2; D 96: scalar u16, coalesced).
//   Apple: the same structure as MLX's sdpa_vector on Apple GPUs (its cross-simdgroup
//     merge included), K/V read once at decode; the Metal plan keeps the staged path until the
//     two are timed on a Mac. Relies on vec<bfloat16_t, 4> (Metal 3.1's bfloat).
//
// Checked only on a Mac: that Apple's compiler accepts the body as written (the register
//   arrays are indexed with compile-time indices once the constant-trip loops unroll;
//   simd_shuffle of float2/float3/float4 for D = 64/96/128+), that the register arrays
//   (about 100 floats per thread at RS = 8) do not spill, that the padded kv_tile rows avoid
//   bank conflicts as intended, and the speed (including the split planner's tuning
//   constants in sdpa_multi.py). The emulator checks the semantics, barriers, races on
//   threadgroup memory (strict mode) and the device traffic.
#include "common.h"
#include "sdpa_multi.h"

// Copy rows [0, n_valid) of a 32-row block of a [.., D] matrix, columns [col0, col0 + DC),
// into tile (row stride TSTRIDE); rows >= n_valid are zero-filled, never read.
template <typename T, int D, int DC, int TSTRIDE>
inline void mt_sdpa_stage(threadgroup T* tile, const device T* src, uint n_valid, uint col0,
                          uint tid, uint n_threads) {
  for (uint e = tid; e < 32u * uint(DC); e += n_threads) {
    const uint j = e / uint(DC > 0 ? DC : 1);  // DC 0 (the vector path) never stages
    const uint d = e - j * uint(DC);
    tile[j * TSTRIDE + d] = j < n_valid ? src[size_t(j) * D + col0 + d] : T(0);
  }
}

// dst[0 .. VW) = the VW elements at src as float, in one vector load (VW = 4 or 2: src is
// VW-element aligned, as the VECTOR PATH's layout guarantees) or one scalar load (VW = 1).
// The VW elements at src as they are stored, in one load, in a VWS-vector (VWS = VW, or 2
// for VW = 1, the second element then 0): K and V rows stay in T until used.
template <int VW, int VWS, typename T>
inline vec<T, VWS> mt_sdpa_fetch(const device T* src) {
  vec<T, VWS> x = vec<T, VWS>(T(0));
  if (VW == 1) {
    x[0] = src[0];
  } else {
    x = *reinterpret_cast<const device vec<T, VWS>*>(src);
  }
  return x;
}

template <int VW, typename T>
inline void mt_sdpa_load(thread float* dst, const device T* src) {
  if (VW == 4) {
    const vec<T, 4> x = *reinterpret_cast<const device vec<T, 4>*>(src);
    dst[0] = float(x[0]);
    dst[1] = float(x[1]);
    dst[2] = float(x[2]);
    dst[3] = float(x[3]);
  } else if (VW == 2) {
    const vec<T, 2> x = *reinterpret_cast<const device vec<T, 2>*>(src);
    dst[0] = float(x[0]);
    dst[1] = float(x[1]);
  } else {
    dst[0] = float(src[0]);
  }
}
// ---- kernel body ----
constexpr int DPL = D / 32;                   // q / o columns per lane
constexpr int QV = DPL < 4 ? DPL : 4;         // q columns moved by one shuffle
constexpr int NQV = DPL / QV;                 // q vectors per lane
constexpr int CPL = DC / 32;                  // staged o columns per lane
constexpr int NCH = DC == 0 ? 1 : D / DC;     // column chunks per 32-key block
constexpr int LPC = 32 / NCH;                 // lanes whose q columns lie in one chunk
constexpr int TSTRIDE = DC + 4 / int(sizeof(T));  // odd word stride: lane-per-row reads hit
                                                  // 32 different banks
static_assert(D % 32 == 0 && DPL >= 2 && DPL % QV == 0, "head dim tiling");
static_assert(DC == 0 || (DC % 32 == 0 && D % DC == 0), "staged column chunks");
static_assert(RS >= 1 && RS <= 32 && 32 % RS == 0, "rows per simdgroup");
typedef vec<float, QV> qvec;
threadgroup T kv_tile[DC == 0 ? 1 : 32 * TSTRIDE];  // the vector path stages nothing
constexpr int VSG = 4;  // the vector path's simdgroups per threadgroup (VEC_SIMDGROUPS)
// staged: each simdgroup's rows of p; vector: each simdgroup's partial (o, m, lsum) rows
threadgroup float p_tile[DC == 0 ? VSG * RS * (D + 2) : 32 * 32];

const uint bh = threadgroup_position_in_grid.z;
const uint tid = thread_position_in_threadgroup.x;
const uint n_threads = threads_per_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;

const uint L = n_q;
const uint n_rows = group * L;                // query rows that share this KV head
const uint kvn = max(min(kv_len, kv_rows), L);  // never read past S; L <= kv_len (device kv_len)
const uint chunk_keys = chunk;
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

if (DC == 0) {
  // ---- VECTOR PATH (see its section above): VSG simdgroups share a slice of RS rows ----
  constexpr int VW = DPL % 4 == 0 ? 4 : (DPL % 2 == 0 ? 2 : 1);  // columns per load
  constexpr int NV = DPL / VW;  // loads per lane per K (or V) row
  constexpr int KB = 32 / RS;   // keys per batch: RS * KB = 32 scores, one per lane
  constexpr int VWS = VW == 1 ? 2 : VW;  // a loaded fragment's vector width
  typedef vec<T, VWS> tfrag;
  const uint n_splits = threadgroups_per_grid.y;
  const uint slice = threadgroup_position_in_grid.y;
  const uint row0 = threadgroup_position_in_grid.x * uint(RS);
  const uint nr = min(uint(RS), n_rows - row0);  // >= 1: the grid has ceil(rows / RS) tiles
  const uint k_begin = slice * chunk_keys;
  const uint k_end = mt_sdpa_tile_end(min(k_begin + chunk_keys, kvn), row0, row0 + nr - 1u,
                                      L, kvn, is_causal);

  // Lane layout: lane i holds columns w * 32 * VW + i * VW + e (w < NV, e < VW) of q and o;
  // after a batch's reduction it holds the score of row lr = lane / KB, key kb + lane % KB.
  const uint col0 = lane * uint(VW);
  const uint lr = lane / uint(KB);
  const uint lj = lane % uint(KB);
  float qr_v[RS][DPL];
  for (int rr = 0; rr < RS; ++rr) {
    for (int c = 0; c < DPL; ++c) {
      qr_v[rr][c] = 0.0f;
    }
    if (uint(rr) < nr) {
      for (int w = 0; w < NV; ++w) {
        mt_sdpa_load<VW>(&qr_v[rr][w * VW], q + (q_row0 + row0 + uint(rr)) * D
                                                + uint(w * 32 * VW) + col0);
      }
      for (int c = 0; c < DPL; ++c) {
        qr_v[rr][c] *= q_scale;
      }
    }
  }
  const bool lane_valid = lr < nr;
  const uint lane_lim = lane_valid ? mt_sdpa_row_end(row0 + lr, L, kvn, is_causal) : 0u;
  const size_t lane_mask_row = mt_sdpa_mask_row(bh, row0 + lr, L, group, kv_heads, mask_sb,
                                                mask_sh, mask_sl);
  float m_l = -INFINITY;  // the running max and sum of row lr (the same in its KB lanes)
  float l_l = 0.0f;
  float ov[RS][DPL];  // o of every row at this lane's columns, kept divided by its lsum
  for (int rr = 0; rr < RS; ++rr) {
    for (int c = 0; c < DPL; ++c) {
      ov[rr][c] = 0.0f;
    }
  }

  // Simdgroup sg takes batches sg, sg + VSG, ... of the slice.
  for (uint kb = k_begin + sg * uint(KB); kb < k_end; kb += uint(VSG * KB)) {
    // The batch's K and V rows, all loads issued before any is used (keys past k_end are
    // not read); then the partial scores sv[rr * KB + j] = q_rr . k_{kb + j} over this
    // lane's columns.
    const uint nk = min(uint(KB), k_end - kb);
    tfrag kf[KB][NV];
    tfrag vf[KB][NV];
    for (int j = 0; j < KB; ++j) {
      if (uint(j) < nk) {
        const size_t at = size_t(kb + uint(j)) * D + col0;
        for (int w = 0; w < NV; ++w) {
          kf[j][w] = mt_sdpa_fetch<VW, VWS>(k_head + at + w * 32 * VW);
          vf[j][w] = mt_sdpa_fetch<VW, VWS>(v_head + at + w * 32 * VW);
        }
      }
    }
    float sv[32];
    for (int i = 0; i < 32; ++i) {
      sv[i] = 0.0f;
    }
    for (int j = 0; j < KB; ++j) {
      if (uint(j) < nk) {
        for (int rr = 0; rr < RS; ++rr) {
          if (uint(rr) < nr) {
            for (int w = 0; w < NV; ++w) {
              for (int e = 0; e < VW; ++e) {
                sv[rr * KB + j] += qr_v[rr][w * VW + e] * float(kf[j][w][e]);
              }
            }
          }
        }
      }
    }
    // Reduce-scatter over the lanes (31 shuffles): at each step a lane keeps the half of
    // its values whose index has its lane bit, adding the partner's copy of them; after
    // the last, sv[0] is the full score of value index `lane` (row lr, key lj).
    for (int h = 16; h >= 1; h /= 2) {
      const bool upper = (lane & uint(h)) != 0u;
      for (int i = 0; i < h; ++i) {
        const float give = upper ? sv[i] : sv[i + h];
        const float keep = upper ? sv[i + h] : sv[i];
        sv[i] = keep + mt_shuffle_xor_converged(give, ushort(h));
      }
    }

    // Online softmax of row lr over the batch (its KB lanes), base 2, as the staged path.
    const uint key = kb + lj;
    bool ok = key < min(lane_lim, k_end);
    float sc = sv[0];
    if (MASK_KIND != 0 && ok && key >= key0) {
      sc = mt_sdpa_masked<MASK_KIND>(sc, mask[lane_mask_row + (key - key0)], mask_unit, ok);
    }
    sc = ok ? sc : -INFINITY;
    float bmax = sc;
    for (int h = 1; h < KB; h *= 2) {
      bmax = max(bmax, mt_shuffle_xor_converged(bmax, ushort(h)));
    }
    const float m_new = max(m_l, bmax);  // -INFINITY while no key was visible
    const float alpha = m_l == m_new ? 1.0f : exp2(unit * (m_l - m_new));
    const float p = ok ? exp2(unit * (sc - m_new)) : 0.0f;
    float bsum = p;
    for (int h = 1; h < KB; h *= 2) {
      bsum += mt_shuffle_xor_converged(bsum, ushort(h));
    }
    const float l_old = l_l * alpha;
    const float l_new = l_old + bsum;
    const float inv_l = l_new > 0.0f ? 1.0f / l_new : 0.0f;  // 0 until a key was visible
    const float wgt = p * inv_l;       // this key's weight in the new o
    const float keep = l_old * inv_l;  // the old o's weight: keep + sum of wgt = 1
    m_l = m_new;
    l_l = l_new;

    // o = keep * o + sum_j wgt_j v_j: each row's weights come from its lanes by shuffle.
    for (int rr = 0; rr < RS; ++rr) {
      if (uint(rr) < nr) {  // uniform over the simdgroup
        const float kr = mt_shuffle_converged(keep, ushort(rr * KB));
        for (int c = 0; c < DPL; ++c) {
          ov[rr][c] *= kr;
        }
      }
    }
    for (int j = 0; j < KB; ++j) {
      if (uint(j) < nk) {
        for (int rr = 0; rr < RS; ++rr) {
          if (uint(rr) < nr) {
            const float pj = mt_shuffle_converged(wgt, ushort(rr * KB + j));
            for (int w = 0; w < NV; ++w) {
              for (int e = 0; e < VW; ++e) {
                ov[rr][w * VW + e] += pj * float(vf[j][w][e]);
              }
            }
          }
        }
      }
    }
  }

  // Merge the simdgroups' partials through threadgroup memory (as the combine merges
  // slices, weights 2^(m_s - M) lsum_s / W summing to 1); simdgroup sg then writes rows
  // sg, sg + VSG, ... of the slice's entry (an empty slice: m = -INFINITY, lsum = 0, o = 0).
  threadgroup float* mine = p_tile + sg * uint(RS * (D + 2));
  for (int rr = 0; rr < RS; ++rr) {
    if (uint(rr) < nr) {
      for (int w = 0; w < NV; ++w) {
        for (int e = 0; e < VW; ++e) {
          mine[rr * (D + 2) + w * 32 * VW + e + int(col0)] = ov[rr][w * VW + e];
        }
      }
    }
  }
  if (lane_valid && lj == 0u) {
    mine[lr * uint(D + 2) + uint(D)] = m_l;
    mine[lr * uint(D + 2) + uint(D) + 1u] = l_l;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint rr = sg; rr < nr; rr += uint(VSG)) {
    const threadgroup float* row = p_tile + rr * uint(D + 2);  // simdgroup s: + s * RS*(D+2)
    float m_max = -INFINITY;
    for (int s2 = 0; s2 < VSG; ++s2) {
      m_max = max(m_max, row[s2 * RS * (D + 2) + D]);
    }
    float wt[VSG];
    float w_sum = 0.0f;
    for (int s2 = 0; s2 < VSG; ++s2) {
      const float m_s = row[s2 * RS * (D + 2) + D];
      wt[s2] = (m_s == m_max ? 1.0f : exp2(unit * (m_s - m_max)))
               * row[s2 * RS * (D + 2) + D + 1];
      w_sum += wt[s2];
    }
    const float inv = w_sum > 0.0f ? 1.0f / w_sum : 0.0f;  // 0: the slice saw no key
    const size_t entry = (q_row0 + row0 + rr) * n_splits + slice;
    for (int c = 0; c < DPL; ++c) {
      const uint col = lane + 32u * uint(c);
      float acc = 0.0f;
      for (int s2 = 0; s2 < VSG; ++s2) {
        acc += (wt[s2] * inv) * row[s2 * RS * (D + 2) + int(col)];
      }
      o_part[entry * D + col] = acc;
    }
    if (lane == 0u) {
      ml_part[entry * 2u] = m_max;
      ml_part[entry * 2u + 1u] = w_sum;
    }
  }
  return;
}

// ---- STAGED PATH: a 32-row tile per threadgroup, RS rows per simdgroup ----
const uint split = threadgroup_position_in_grid.x;
const uint tile_idx = threadgroup_position_in_grid.y;
const uint n_splits = threadgroups_per_grid.x;

// Rows of this simdgroup: row0 .. row0 + nr - 1 (nr may be 0 in a ragged last tile).
const uint tile_row0 = tile_idx * 32u;
const uint row0 = tile_row0 + sg * uint(RS);
const uint nr = row0 < n_rows ? min(uint(RS), n_rows - row0) : 0u;
threadgroup float* p_rows = p_tile + sg * uint(RS) * 32u;  // this simdgroup's rows of p

// Keys of this slice; a causal tile stops at the last key its rows can see.
const uint k_begin = split * chunk_keys;
const uint k_end = mt_sdpa_tile_end(min(k_begin + chunk_keys, kvn), tile_row0,
                                    min(tile_row0 + 32u, n_rows) - 1u, L, kvn, is_causal);

// Query rows in registers, pre-scaled: lane holds columns lane * DPL .. lane * DPL + DPL - 1.
qvec qr[RS][NQV];
uint lim[RS];  // last visible key + 1 of each row (0 for rows past n_rows)
size_t mask_row[RS];  // the row's mask element at column 0 (MASK_KIND != 0)
for (int rr = 0; rr < RS; ++rr) {
  const uint r = row0 + uint(rr);
  const bool valid = uint(rr) < nr;
  mask_row[rr] = mt_sdpa_mask_row(bh, r, L, group, kv_heads, mask_sb, mask_sh, mask_sl);
  lim[rr] = !valid ? 0u : mt_sdpa_row_end(r, L, kvn, is_causal);
  for (int w = 0; w < NQV; ++w) {
    for (int e = 0; e < QV; ++e) {
      const size_t at = (q_row0 + r) * D + lane * uint(DPL) + uint(w * QV + e);
      qr[rr][w][e] = valid ? q_scale * float(q[at]) : 0.0f;
    }
  }
}

// Running softmax state; o: lane holds columns lane + 32 * c.
float m[RS];
float l_sum[RS];  // the row's sum of exponentials so far (the same in every lane)
float o[RS][DPL];
for (int rr = 0; rr < RS; ++rr) {
  m[rr] = -INFINITY;  // no visible key seen yet
  l_sum[rr] = 0.0f;
  for (int c = 0; c < DPL; ++c) {
    o[rr][c] = 0.0f;
  }
}

for (uint kb = k_begin; kb < k_end; kb += 32u) {
  const uint nk = min(32u, k_end - kb);  // keys of this block (uniform)

  // Scores: lane owns key kb + lane; q columns come from their owning lane by shuffle.
  float s[RS];
  for (int rr = 0; rr < RS; ++rr) {
    s[rr] = 0.0f;
  }
  for (int ch = 0; ch < NCH; ++ch) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // earlier readers of kv_tile are done
    mt_sdpa_stage<T, D, DC, TSTRIDE>(kv_tile, k_head + size_t(kb) * D, nk, uint(ch * DC),
                                     tid, n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (nr > 0u) {
      for (int i = 0; i < LPC; ++i) {
        const ushort src = ushort(ch * LPC + i);
        for (int w = 0; w < NQV; ++w) {
          float kval[QV];
          for (int e = 0; e < QV; ++e) {
            kval[e] = float(kv_tile[lane * TSTRIDE + uint(i * DPL + w * QV + e)]);
          }
          for (int rr = 0; rr < RS; ++rr) {
            if (uint(rr) < nr) {
              const qvec qs = mt_shuffle_converged(qr[rr][w], src);
              for (int e = 0; e < QV; ++e) {
                s[rr] += qs[e] * kval[e];
              }
            }
          }
        }
      }
    }
  }

  // Online softmax over this block (base 2); masked keys get probability exactly 0.
  // p / lsum goes to this simdgroup's rows of p_tile; the barriers below publish it.
  for (int rr = 0; rr < RS; ++rr) {
    if (uint(rr) < nr) {
      bool ok = kb + lane < min(lim[rr], k_end);
      float sc = s[rr];
      if (MASK_KIND != 0 && ok && kb + lane >= key0) {
        sc = mt_sdpa_masked<MASK_KIND>(sc, mask[mask_row[rr] + (kb + lane - key0)],
                                       mask_unit, ok);
      }
      sc = ok ? sc : -INFINITY;
      const float m_new = max(m[rr], mt_max_converged(sc));  // -INFINITY while no key was visible
      const float alpha = m[rr] == m_new ? 1.0f : exp2(unit * (m[rr] - m_new));
      const float p = ok ? exp2(unit * (sc - m_new)) : 0.0f;
      const float l_old = l_sum[rr] * alpha;
      const float l_new = l_old + mt_sum_converged(p);
      const float inv_l = l_new > 0.0f ? 1.0f / l_new : 0.0f;  // 0 until a key was visible
      p_rows[uint(rr) * 32u + lane] = p * inv_l;
      const float keep = l_old * inv_l;  // weight of the old o: keep + sum_j p_j / l_new = 1
      for (int c = 0; c < DPL; ++c) {
        o[rr][c] *= keep;
      }
      l_sum[rr] = l_new;
      m[rr] = m_new;
    }
  }

  // o += p @ v_block: lane owns columns; p_j is a broadcast read of p_tile.
  for (int ch = 0; ch < NCH; ++ch) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mt_sdpa_stage<T, D, DC, TSTRIDE>(kv_tile, v_head + size_t(kb) * D, nk, uint(ch * DC),
                                     tid, n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (nr > 0u) {
      for (uint j = 0; j < nk; ++j) {
        float pj[RS];
        for (int rr = 0; rr < RS; ++rr) {
          pj[rr] = uint(rr) < nr ? p_rows[uint(rr) * 32u + j] : 0.0f;
        }
        for (int c = 0; c < CPL; ++c) {
          const float vval = float(kv_tile[j * TSTRIDE + uint(c) * 32u + lane]);
          for (int rr = 0; rr < RS; ++rr) {
            if (uint(rr) < nr) {
              o[rr][ch * CPL + c] += pj[rr] * vval;
            }
          }
        }
      }
    }
  }
}

// Partial results of this slice, one (row, slice) entry each.
for (int rr = 0; rr < RS; ++rr) {
  if (uint(rr) < nr) {
    const size_t entry = (q_row0 + row0 + uint(rr)) * n_splits + split;
    for (int c = 0; c < DPL; ++c) {
      o_part[entry * D + lane + 32u * uint(c)] = o[rr][c];
    }
    if (lane == 0u) {
      ml_part[entry * 2u] = m[rr];
      ml_part[entry * 2u + 1u] = l_sum[rr];
    }
  }
}
