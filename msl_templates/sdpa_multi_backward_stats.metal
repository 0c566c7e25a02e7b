// sdpa_multi_backward_stats.metal: the first kernel of sdpa_multi's VJP (FlashAttention-2
// style; ops/sdpa_multi.py, _launch_backward, backward_plan). A tile of up to 4 * n_sg
// query rows (of the G * L rows sharing one KV head: L queries x G = Hq/Hkv heads) walks one
// slice of the visible keys once and writes, per row, the slice's softmax statistics and
// its share of Dr = dO . O, as partials that sdpa_multi_backward_dq_split.metal merges
// (one slice covering every key unless the plan splits the keys). Nothing [L, S] is
// stored, and no O vector: Dr needs only the partials' dot products.
//
// MATH (per query row r, float32, base-2 exponentials; scores as in sdpa_multi.metal):
//   d_j = a * dot(q_r, k_j) (+ mask), (a, b) = mt_score_unit(scale * log2(e)): the score
//   in units of b, visible keys j < kv_len (and j <= kv_len - L + l when causal).
//   Per slice s = keys [s * chunk, (s + 1) * chunk):
//   m_s = max_j d_j over the slice's visible keys (-inf where it has none),
//   l_s = sum_j 2^(b (d_j - m_s)),  u_s = sum_j 2^(b (d_j - m_s)) dot(dO_r, v_j).
//   The merge (the split dq kernel): m = max_s m_s, l = sum_s l_s 2^(b (m_s - m)); with the
//   sink (sink' = sinks[h] * log2(e) / b, only with has_sinks) m_f = max(m, sink'),
//   l_f = l 2^(b (m - m_f)) + 2^(b (sink' - m_f)): the logsumexp ln 2 * (b m_f + log2 l_f),
//   kept as two floats so that scores beyond float32's range (scale 1e38) still weigh their
//   keys right; Dr = (sum_s u_s 2^(b (m_s - m))) 2^(b (m - m_f)) / l_f = dot(dO_r, O_r)
//   with O_r = sum_j P_rj v_j in float32 (not the forward's rounded output).
//   MASK_KIND 1 (bool): a masked key scores -FLT_MAX (it keeps its weight in l_s and u_s:
//   a row whose keys are all masked averages v uniformly, as the forward). MASK_KIND 2
//   (additive): d += mask * log2(e) / b; a key whose score is -inf weighs 0.
//
// LAYOUT (row-contiguous): q, dout [B, Hq, L, D] T (the G*L rows of KV head (b, kvh) are
//   contiguous); k, v [B, Hkv, S, D] T (S = kv_rows; rows >= kv_len never read);
//   stats_part [B * Hkv, n_splits, G * L, 3] float32 (m_s, l_s, u_s). 0-d runtime inputs:
//   n_q (L), group (G), kv_len (clamped to [L, S] here: it may be device-side), kv_rows
//   (S), causal (0/1), kv_heads (Hkv), mask_block (0/1), mask_sb/sh/sl (the mask's element
//   strides, 0 on broadcast axes), chunk (keys per slice, a multiple of KB), n_splits as
//   uint; scale (float, times log2(e)), grad_scale (float, the plain scale). mask [MB, MH,
//   L, MC] (bool or T; a 1-element dummy when MASK_KIND == 0) read at column j - key0,
//   key0 = 0 or kv_len - L (block form). Template: T, D (multiple of 32), KB (keys per
//   staged block: 32, or 16 where 32 rows of D would pass 16 KiB), MASK_KIND (0 none or
//   causal, 1 bool, 2 additive) and MAX_SG (1, 2, 4 or 8: the most simdgroups the row
//   tiles hold, ops/sdpa_multi.py, bwd_split_max_simdgroups).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * n_sg, 1, 1), n_sg = 1, 2, 4 or 8 <= MAX_SG simdgroups of RS = 4
//   rows (a tile of 4 * n_sg rows; n_sg is read from threads_per_threadgroup, not a
//   template parameter); grid = (32 * n_sg, ceil(G*L / (4 * n_sg)), B * Hkv * n_splits),
//   threadgroup_position_in_grid = (0, tile, (b*Hkv + kvh) * n_splits + s), n_splits *
//   chunk >= the keys the launch covers (kv_len, or S with a device-side kv_len). Lane i
//   owns key kb + i of each staged block (lanes >= KB none). threadgroup memory, declared
//   for MAX_SG: kv_tile KB * (D + 4 / sizeof(T)) elements of T, q_tile and g_tile MAX_SG *
//   4 * D elements of T each (simdgroup sg's rows at 4 sg * D; <= 32 KiB with the dq_split
//   kernel's p_tile, the rule that sets MAX_SG). A slice past the tile's last visible key
//   (or past kv_len) writes (-inf, 0, 0). Every thread reaches every barrier (uniform loop
//   bounds).
//
// TRAFFIC per call: each visible K and V row is read once per row tile (ceil(G*L / (4 *
//   n_sg)) tiles per KV head; causal tiles stop at their last visible key); q and dO once
//   per slice; stats_part written once. Per 4 rows x 32 keys (a simdgroup and a block of V,
//   then of K), a lane reads its key's D elements of the tile once and the rows' 4 * D
//   elements (broadcasts of 4), for 4 * D fmas: no shuffle per (row, key). Per (row,
//   block): the online softmax's simd_max and two simd_sum.
//
// REDUCTION ORDER: keys in increasing order within the slice, whatever n_sg (a row's
//   results do not depend on n_sg: keys a tile walks past a row's last weigh 0). A score
//   and a dP are common.h's backward score expression (mt_rows4_dot: 16-column fma chunks
//   of a * float(q), or float(dO), from the staged rows with the key's (value's) elements, the chunks added
//   in order), as in sdpa_multi_backward_dq_split.metal and sdpa_multi_backward_dkv.metal:
//   every score is the same bits in the three kernels, so none exceeds the merged m and a
//   probability recomputed from (m_f, l_f) never exceeds 1 (b multiplies any rounding
//   difference of d: with scale 1e30 one ulp would overflow 2^(b (d - m))).
//
// Checked only on a Mac: that Apple's compiler accepts the body, and the speed. The
//   emulator checks the semantics, barriers, threadgroup races and the device traffic.
#include "common.h"
// ---- kernel body ----
constexpr int RS = 4;                             // rows per simdgroup (mt_rows4_dot)
constexpr int TSTRIDE = D + 4 / int(sizeof(T));   // odd word stride: lane-per-row reads
static_assert(D % 32 == 0 && D >= 64, "head dim tiling");
static_assert(KB == 16 || KB == 32, "key block");
static_assert(MAX_SG == 1 || MAX_SG == 2 || MAX_SG == 4 || MAX_SG == 8, "row tiles");
threadgroup T kv_tile[KB * TSTRIDE];
threadgroup T q_tile[MAX_SG * RS * D];  // q of each simdgroup's rows
threadgroup T g_tile[MAX_SG * RS * D];  // dO, the same rows

const uint tile_idx = threadgroup_position_in_grid.y;
const uint part_idx = threadgroup_position_in_grid.z;  // (b*Hkv + kvh) * n_splits + s
const uint n_parts = n_splits;
const uint bh = part_idx / n_parts;
const uint slice = part_idx - bh * n_parts;
const uint tid = thread_position_in_threadgroup.x;
const uint n_threads = threads_per_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;

const uint L = n_q;
const uint n_rows = group * L;
// Scalars read once into registers (each read of a 0-d input is a device load).
const uint S_rows = kv_rows;
const uint n_kv_heads = kv_heads;
const uint kvn = max(min(kv_len, S_rows), L);
const bool is_causal = causal != 0u;
const float2 score_unit = mt_score_unit(scale);
const float q_scale = score_unit.x;
const float unit = score_unit.y;
const uint key0 = mask_block != 0u ? kvn - L : 0u;
const float mask_unit = 1.4426950408889634f / unit;

// a tile of n_sg simdgroups (DISPATCH INVARIANTS)
const uint n_sg = n_threads / 32u;
const uint tile_rows = uint(RS) * n_sg;
const uint tile_row0 = tile_idx * tile_rows;
const uint row0 = tile_row0 + sg * uint(RS);
const uint nr = row0 < n_rows ? min(uint(RS), n_rows - row0) : 0u;

uint k_end = kvn;
if (is_causal) {  // the last key any row of the tile sees
  const uint last_row = min(tile_row0 + tile_rows, n_rows) - 1u;
  const uint span = last_row - tile_row0 + 1u;
  const uint l_first = tile_row0 % L;
  const uint l_last = last_row % L;
  const uint l_max = (span >= L || l_last < l_first) ? L - 1u : l_last;
  k_end = min(k_end, kvn - L + l_max + 1u);
}
const uint slice_keys = chunk;
const uint k_begin = min(slice * slice_keys, k_end);
const uint k_stop = min(k_begin + slice_keys, k_end);

const size_t q_row0 = size_t(bh) * n_rows;
uint lim[RS];
size_t mask_row[RS];
float m[RS];         // m_s so far
float l_sum[RS];     // l_s so far (relative to m)
float u_sum[RS];     // u_s so far (relative to m)
for (int rr = 0; rr < RS; ++rr) {
  const uint r = row0 + uint(rr);
  const bool valid = uint(rr) < nr;
  const uint head = (bh % n_kv_heads) * group + r / L;
  mask_row[rr] = size_t(bh / n_kv_heads) * mask_sb + size_t(head) * mask_sh
                 + size_t(r % L) * mask_sl;
  lim[rr] = !valid ? 0u : (is_causal ? kvn - L + r % L + 1u : kvn);
  m[rr] = -INFINITY;
  l_sum[rr] = 0.0f;
  u_sum[rr] = 0.0f;
}
// This simdgroup's rows of q and dO staged as T (mt_rows4_dot forms the operands a * float(q)
// and float(dO)), zeros past the last row; its own lanes write them and the block loop's
// first barrier publishes them.
threadgroup T* q_rows = q_tile + sg * uint(RS * D);
threadgroup T* g_rows = g_tile + sg * uint(RS * D);
for (uint e = lane; e < uint(RS * D); e += 32u) {
  const uint rr = e / uint(D);
  const size_t at = (q_row0 + row0) * D + e;
  q_rows[e] = rr < nr ? q[at] : T(0);
  g_rows[e] = rr < nr ? dout[at] : T(0);
}

const size_t head_off = size_t(bh) * S_rows * D;
const device T* k_head = k + head_off;
const device T* v_head = v + head_off;
// this lane's key row of a staged block (lanes >= KB read the last one; their keys are
// never visible: lane < nk <= KB)
const threadgroup T* key_row = kv_tile + min(lane, uint(KB) - 1u) * uint(TSTRIDE);

for (uint kb = k_begin; kb < k_stop; kb += uint(KB)) {
  const uint nk = min(uint(KB), k_stop - kb);
  const uint j = kb + lane;  // this lane's key

  // dP = dO . v_j for this lane's key (V staged first, then K), the four rows at once.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < uint(KB * D); e += n_threads) {
    const uint jj = e / uint(D);
    const uint d = e - jj * uint(D);
    kv_tile[jj * TSTRIDE + d] = jj < nk ? v_head[size_t(kb + jj) * D + d] : T(0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float dp[RS] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (nr > 0u) {
    mt_rows4_dot<T, D>(g_rows, 1.0f, key_row, dp);
  }

  // Scores of this lane's key (common.h's backward score expression: mt_rows4_dot).
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < uint(KB * D); e += n_threads) {
    const uint jj = e / uint(D);
    const uint d = e - jj * uint(D);
    kv_tile[jj * TSTRIDE + d] = jj < nk ? k_head[size_t(kb + jj) * D + d] : T(0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s[RS] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (nr > 0u) {
    mt_rows4_dot<T, D>(q_rows, q_scale, key_row, s);
  }

  for (int rr = 0; rr < RS; ++rr) {
    if (uint(rr) < nr) {  // online (m_s, l_s, u_s), as MATH
      bool ok = lane < nk && j < lim[rr];
      float sc = s[rr];
      if (MASK_KIND != 0 && ok && j >= key0) {
        const auto mv = mask[mask_row[rr] + (j - key0)];
        if (MASK_KIND == 1) {
          sc = bool(mv) ? sc : -FLT_MAX;  // a masked key keeps its weight
        } else {
          sc += float(mv) * mask_unit;
          ok = sc != -INFINITY;
        }
      }
      sc = ok ? sc : -INFINITY;
      const float m_new = max(m[rr], simd_max(sc));
      const float alpha = m[rr] == m_new ? 1.0f : exp2(unit * (m[rr] - m_new));
      const float p = ok ? exp2(unit * (sc - m_new)) : 0.0f;
      l_sum[rr] = l_sum[rr] * alpha + simd_sum(p);
      u_sum[rr] = u_sum[rr] * alpha + simd_sum(p * dp[rr]);
      m[rr] = m_new;
    }
  }
}

for (int rr = 0; rr < RS; ++rr) {
  if (uint(rr) < nr && lane == 0u) {
    const size_t at = (size_t(part_idx) * n_rows + row0 + uint(rr)) * 3u;
    stats_part[at] = m[rr];
    stats_part[at + 1u] = l_sum[rr];
    stats_part[at + 2u] = u_sum[rr];
  }
}
