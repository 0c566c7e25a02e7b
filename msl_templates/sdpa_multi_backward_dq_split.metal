// sdpa_multi_backward_dq_split.metal: the second kernel of sdpa_multi's VJP (ops/
// sdpa_multi.py, _launch_backward, backward_plan). A tile of up to 4 * n_sg query rows
// merges its rows' slice statistics (sdpa_multi_backward_stats.metal), then walks one slice
// of the visible keys once, forming dS and a float32 partial dq; the wrapper sums the
// partials over the slices (one slice, unless the plan splits the keys: its partial is
// dq). The threadgroups of slice 0 write the rows' statistics (for
// sdpa_multi_backward_dkv.metal) and dsinks terms.
//
// MATH (per query row r, float32, base-2 exponentials; scores, masks and visibility as
//   sdpa_multi_backward_stats.metal, see its MATH):
//   merge: m = max_s m_s; w_s = 2^(b (m_s - m)) (0 where m_s = -inf: an empty slice);
//     l = sum_s w_s l_s, U = sum_s w_s u_s; then the sink (sink' = sinks[h] log2(e) / b):
//     m_f = max(m, sink'), l_f = l 2^(b (m - m_f)) + 2^(b (sink' - m_f)),
//     Dr = U 2^(b (m - m_f)) / l_f (NaN where l_f = 0, as there).
//   slice s: P_rj = 2^(b (d_j - m_f)) / l_f, dP_rj = dot(dO_r, v_j),
//     dS_rj = P_rj (dP_rj - Dr), dq_part[s, r] = scale * sum_{j in s} dS_rj k_j;
//     the wrapper sums dq_part over s (a slice with no visible key gives 0; a row with
//     l_f = 0 gives NaN from every slice that holds a key j < kv_len, slice 0 included).
//   stats[r] = (m_f, l_f, Dr), dsink_part[r] = -2^(b (sink' - m_f)) / l_f * Dr (slice 0;
//     0 without sinks; summed by the wrapper).
//   A bool-masked key (score -FLT_MAX) keeps its P but its score does not depend on q, k:
//   its dS is 0. A row that sees no key and no sink (l_f = 0: the forward's NaN row) gets
//   P = dS = NaN for every key j < kv_len, as the float64 definition (exp(-inf - -inf))
//   gives. dq_part sums dS_rj k_j unnormalised (dq's own range).
//
// LAYOUT (row-contiguous): q, dout [B, Hq, L, D] T; k, v [B, Hkv, S, D] T (rows >= kv_len
//   never read); stats_part [B * Hkv, n_splits, G * L, 3] float32 (the stats kernel's);
//   dq_part [B * Hkv, n_splits, G * L, D] float32; stats [B*Hq*L, 3] float32 (m, l, Dr);
//   dsink_part [B*Hq*L] float32. 0-d runtime inputs as the stats kernel's, plus has_sinks
//   (0/1, uint) and sinks [Hq] float32 (a 1-element dummy without sinks). Template: T, D,
//   KB, MASK_KIND, MAX_SG (as the stats kernel).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes): as
//   sdpa_multi_backward_stats.metal, with the same chunk, n_splits and n_sg: threadgroup =
//   (32 * n_sg, 1, 1) (n_sg = 1, 2, 4 or 8 <= MAX_SG simdgroups of RS = 4 rows, from
//   threads_per_threadgroup); grid = (32 * n_sg, ceil(G*L / (4 * n_sg)), B * Hkv *
//   n_splits), threadgroup_position_in_grid = (0, tile, (b*Hkv + kvh) * n_splits + s).
//   Lane i owns key kb + i of each staged block (lanes >= KB none) for the scores and dP,
//   and the dq columns i + 32c. threadgroup memory, declared for MAX_SG: the stats
//   kernel's kv_tile, q_tile and g_tile, and p_tile MAX_SG * 4 x 32 floats (simdgroup sg
//   uses rows 4 sg .. 4 sg + 3); MAX_SG is the most simdgroups for which this is <= 32 KiB
//   (ops/sdpa_multi.py, bwd_split_max_simdgroups). Every thread reaches every barrier
//   (uniform loop bounds).
//
// TRAFFIC per call: each visible K and V row is read once per row tile (ceil(G*L / (4 *
//   n_sg)) per KV head); q and dO once per slice; stats_part once per slice (n_splits * 3
//   floats per row); dq_part written once; stats and dsink_part once. Per 4 rows x 32 keys
//   (a simdgroup and a block of V, then of K): as the stats kernel, a lane reads its key's
//   D tile elements once and the rows' 4 * D elements (broadcasts of 4) for 4 * D fmas,
//   no shuffle per (row, key); then dq: per staged key D / 32 tile reads per lane and 4 *
//   D / 32 fmas, dS read from p_tile (a broadcast).
//
// REDUCTION ORDER: the merge: lane i takes the slices i, i + 32, .. in increasing order,
//   then simd_max / simd_sum, the same in every threadgroup of the row, so all slices see
//   the same (m_f, l_f, Dr) bits. Keys in increasing order within the slice, whatever n_sg
//   (keys a tile walks past a row's last weigh 0: a row's results do not depend on n_sg).
//   Scores and dP by common.h's backward score expression (mt_rows4_dot: 16-column fma
//   chunks added in order), as the stats and dk/dv kernels: the scores here are the stats
//   kernel's bit for bit, so none exceeds the merged m and no P recomputed here exceeds 1.
//   dq: keys in increasing order.
//
// Checked only on a Mac: that Apple's compiler accepts the body, and the speed. The
//   emulator checks the semantics, barriers, threadgroup races and the device traffic.
#include "common.h"
// ---- kernel body ----
constexpr int DPL = D / 32;                       // dq columns per lane
constexpr int RS = 4;                             // rows per simdgroup (mt_rows4_dot)
constexpr int TSTRIDE = D + 4 / int(sizeof(T));   // odd word stride: lane-per-row reads
static_assert(D % 32 == 0 && DPL >= 2, "head dim tiling");
static_assert(KB == 16 || KB == 32, "key block");
static_assert(MAX_SG == 1 || MAX_SG == 2 || MAX_SG == 4 || MAX_SG == 8, "row tiles");
threadgroup T kv_tile[KB * TSTRIDE];
threadgroup T q_tile[MAX_SG * RS * D];  // q of each simdgroup's rows
threadgroup T g_tile[MAX_SG * RS * D];  // dO, the same rows
threadgroup float p_tile[MAX_SG * RS * 32];

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
const bool with_sinks = has_sinks != 0u;
const float g_scale = grad_scale;
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
threadgroup float* p_rows = p_tile + sg * uint(RS) * 32u;

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
const device float* head_parts = stats_part + size_t(bh) * n_parts * n_rows * 3u;
float acc[RS][DPL];  // sum dS k, columns lane + 32c
uint lim[RS];
size_t mask_row[RS];
float m[RS];         // m_f
float l_sum[RS];     // l_f
float dd[RS];        // Dr
for (int rr = 0; rr < RS; ++rr) {
  const uint r = row0 + uint(rr);
  const bool valid = uint(rr) < nr;
  const uint head = (bh % n_kv_heads) * group + r / L;
  mask_row[rr] = size_t(bh / n_kv_heads) * mask_sb + size_t(head) * mask_sh
                 + size_t(r % L) * mask_sl;
  lim[rr] = !valid ? 0u : (is_causal ? kvn - L + r % L + 1u : kvn);
  m[rr] = -INFINITY;
  l_sum[rr] = 0.0f;
  dd[rr] = 0.0f;
  for (int c = 0; c < DPL; ++c) {
    acc[rr][c] = 0.0f;
  }
  if (valid) {  // merge the slices' (m_s, l_s, u_s); then the sink joins
    float m_lane = -INFINITY;
    for (uint sl = lane; sl < n_parts; sl += 32u) {
      m_lane = max(m_lane, head_parts[(size_t(sl) * n_rows + r) * 3u]);
    }
    const float m_keys = simd_max(m_lane);
    float l_lane = 0.0f;
    float u_lane = 0.0f;
    for (uint sl = lane; sl < n_parts; sl += 32u) {
      const size_t at = (size_t(sl) * n_rows + r) * 3u;
      const float m_s = head_parts[at];
      const float w = m_s == -INFINITY ? 0.0f
                      : (m_s == m_keys ? 1.0f : exp2(unit * (m_s - m_keys)));
      l_lane += w * head_parts[at + 1u];
      u_lane += w * head_parts[at + 2u];
    }
    const float l_keys_m = simd_sum(l_lane);  // relative to m_keys
    const float u_keys_m = simd_sum(u_lane);
    const float sink_s = with_sinks ? sinks[head] * mask_unit : -INFINITY;
    const float m_f = max(m_keys, sink_s);
    const float key_w = m_keys == m_f ? 1.0f : exp2(unit * (m_keys - m_f));
    const float p_sink = !with_sinks ? 0.0f
                         : (sink_s == m_f ? 1.0f : exp2(unit * (sink_s - m_f)));
    const float l_f = l_keys_m * key_w + p_sink;
    m[rr] = m_f;
    l_sum[rr] = l_f;
    dd[rr] = l_f > 0.0f ? u_keys_m * key_w / l_f : NAN;
    if (slice == 0u && lane == 0u) {
      stats[(q_row0 + r) * 3u] = m_f;
      stats[(q_row0 + r) * 3u + 1u] = l_f;
      stats[(q_row0 + r) * 3u + 2u] = dd[rr];
      dsink_part[q_row0 + r] = !with_sinks ? 0.0f : -(p_sink / l_f) * dd[rr];
    }
  }
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

  // dP = dO . v_j for this lane's key (V staged first, K after it for dq), four rows at once.
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
    if (uint(rr) < nr) {
      bool ok = lane < nk && j < lim[rr];
      bool live = ok;  // the score depends on q and k
      float sc = s[rr];
      if (MASK_KIND != 0 && ok && j >= key0) {
        const auto mv = mask[mask_row[rr] + (j - key0)];
        if (MASK_KIND == 1) {
          live = bool(mv);
          sc = live ? sc : -FLT_MAX;
        } else {
          sc += float(mv) * mask_unit;
          ok = sc != -INFINITY;
          live = ok;
        }
      }
      const bool nan_row = !(l_sum[rr] > 0.0f);
      const float p = ok ? exp2(unit * (sc - m[rr])) / l_sum[rr] : 0.0f;
      p_rows[uint(rr) * 32u + lane] = nan_row ? NAN : (live ? p * (dp[rr] - dd[rr]) : 0.0f);
    }
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // p_rows published
  if (nr > 0u) {  // acc += dS_j k_j (K still staged)
    for (uint jj = 0; jj < nk; ++jj) {
      float w[RS];
      for (int rr = 0; rr < RS; ++rr) {
        w[rr] = uint(rr) < nr ? p_rows[uint(rr) * 32u + jj] : 0.0f;
      }
      for (int c = 0; c < DPL; ++c) {
        const float x = float(kv_tile[jj * TSTRIDE + uint(c) * 32u + lane]);
        for (int rr = 0; rr < RS; ++rr) {
          if (uint(rr) < nr) {
            acc[rr][c] += w[rr] * x;
          }
        }
      }
    }
  }
}

for (int rr = 0; rr < RS; ++rr) {
  if (uint(rr) < nr) {
    for (int c = 0; c < DPL; ++c) {
      dq_part[(size_t(part_idx) * n_rows + row0 + uint(rr)) * D + lane + 32u * uint(c)] =
          g_scale * acc[rr][c];
    }
  }
}
