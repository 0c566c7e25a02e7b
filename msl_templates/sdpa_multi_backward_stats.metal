// sdpa_multi_backward_stats.metal: the key-split backward's first kernel (sdpa_multi's VJP
// where the plan splits the keys: ops/sdpa_multi.py, backward_plan). A tile of up to
// 4 * n_sg query rows walks one slice of the visible keys once and writes, per row, the
// slice's softmax statistics and its share of Dr = dO . O, as partials that
// sdpa_multi_backward_dq_split.metal merges. Nothing [L, S] is stored, and no O vector:
// Dr needs only the partials' dot products.
//
// MATH (per query row r and slice s = keys [s * chunk, (s + 1) * chunk), float32, base-2
//   exponentials; scores, masks and visibility exactly as sdpa_multi_backward_dq.metal's
//   pass 0, see its MATH):
//   m_s = max_j d_j over the slice's visible keys (-inf where it has none),
//   l_s = sum_j 2^(b (d_j - m_s)),  u_s = sum_j 2^(b (d_j - m_s)) dot(dO_r, v_j).
//   The merge: m = max_s m_s, l = sum_s l_s 2^(b (m_s - m)), and with the sink (as the dq
//   kernel's pass 0) Dr = (sum_s u_s 2^(b (m_s - m))) 2^(b (m - m_f)) / l_f.
//   A bool-masked key (score -FLT_MAX) keeps its weight in l_s and u_s (it is in O); an
//   additive -inf key weighs 0. The sinks join in the merge, not here.
//
// LAYOUT (row-contiguous): q, dout [B, Hq, L, D] T; k, v [B, Hkv, S, D] T (rows >= kv_len
//   never read); stats_part [B * Hkv, n_splits, G * L, 3] float32 (m_s, l_s, u_s). 0-d
//   runtime inputs as in sdpa_multi_backward_dq.metal, plus chunk (keys per slice, a
//   multiple of KB) and n_splits. Template: T, D, KB, MASK_KIND (as the dq kernel).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * n_sg, 1, 1), n_sg = 1, 2, 4 or 8 simdgroups of RS = 4 rows (a
//   tile of 4 * n_sg rows; n_sg is read from threads_per_threadgroup, not a template
//   parameter); grid = (32 * n_sg, ceil(G*L / (4 * n_sg)), B * Hkv * n_splits),
//   threadgroup_position_in_grid = (0, tile, (b*Hkv + kvh) * n_splits + s), n_splits *
//   chunk >= the keys the launch covers (kv_len, or S with a device-side kv_len). Lane i
//   owns the q / dO columns i + 32c and key kb + i of each staged block. threadgroup
//   memory: kv_tile KB * (D + 4 / sizeof(T)) elements of T (<= 16.5 KiB, whatever n_sg).
//   A slice past the tile's last visible key (or past kv_len) writes (-inf, 0, 0). Every
//   thread reaches every barrier (uniform loop bounds).
//
// TRAFFIC per call: each visible K and V row is read once per row tile (ceil(G*L / (4 *
//   n_sg)) tiles per KV head; causal tiles stop at their last visible key); q and dO once
//   per slice; stats_part written once. Per (row, key): two simd_sum dot products (the
//   score and dP).
//
// REDUCTION ORDER: keys in increasing order within the slice, whatever n_sg (a row's
//   results do not depend on n_sg: keys a tile walks past a row's last weigh 0). A score
//   is the per-lane sum over c of (a * q[i + 32c]) * k[i + 32c], then simd_sum: the
//   expression of the dq and dk/dv kernels, so every kernel sees the same bits and a
//   probability recomputed from (m, l) never exceeds 1 (sdpa_multi_backward_dq.metal,
//   REDUCTION ORDER).
//
// Metal and the emulator keep the one-kernel form by default (BWD_SPLIT_BACKENDS): no
//   measurement on a Mac argues for the split there. Checked only on a Mac: that Apple's
//   compiler accepts the body, and the speed. The emulator checks the semantics, barriers,
//   threadgroup races and the device traffic.
#include "common.h"
// ---- kernel body ----
constexpr int DPL = D / 32;                       // columns per lane
constexpr int RS = 4;                             // rows per simdgroup
constexpr int TSTRIDE = D + 4 / int(sizeof(T));   // odd word stride: lane-per-row reads
static_assert(D % 32 == 0 && DPL >= 2, "head dim tiling");
static_assert(KB == 16 || KB == 32, "key block");
threadgroup T kv_tile[KB * TSTRIDE];

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
float qc[RS][DPL];   // a * q, columns lane + 32c
float gc[RS][DPL];   // dO, same columns
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
  for (int c = 0; c < DPL; ++c) {
    const size_t at = (q_row0 + r) * D + lane + 32u * uint(c);
    qc[rr][c] = valid ? q_scale * float(q[at]) : 0.0f;
    gc[rr][c] = valid ? float(dout[at]) : 0.0f;
  }
}

const size_t head_off = size_t(bh) * S_rows * D;
const device T* k_head = k + head_off;
const device T* v_head = v + head_off;

for (uint kb = k_begin; kb < k_stop; kb += uint(KB)) {
  const uint nk = min(uint(KB), k_stop - kb);
  const uint j = kb + lane;  // this lane's key

  // dP = dO . v_j for this lane's key (V staged first, then K).
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < uint(KB * D); e += n_threads) {
    const uint jj = e / uint(D);
    const uint d = e - jj * uint(D);
    kv_tile[jj * TSTRIDE + d] = jj < nk ? v_head[size_t(kb + jj) * D + d] : T(0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float dp[RS];
  for (int rr = 0; rr < RS; ++rr) {
    dp[rr] = 0.0f;
    if (uint(rr) < nr) {
      for (uint jj = 0; jj < nk; ++jj) {
        float part = 0.0f;
        for (int c = 0; c < DPL; ++c) {
          part += gc[rr][c] * float(kv_tile[jj * TSTRIDE + uint(c) * 32u + lane]);
        }
        const float total = simd_sum(part);
        dp[rr] = lane == jj ? total : dp[rr];
      }
    }
  }

  // Scores of this lane's key (the dq kernel's expression: the same bits).
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < uint(KB * D); e += n_threads) {
    const uint jj = e / uint(D);
    const uint d = e - jj * uint(D);
    kv_tile[jj * TSTRIDE + d] = jj < nk ? k_head[size_t(kb + jj) * D + d] : T(0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s[RS];
  for (int rr = 0; rr < RS; ++rr) {
    s[rr] = 0.0f;
    if (uint(rr) < nr) {
      for (uint jj = 0; jj < nk; ++jj) {
        float part = 0.0f;
        for (int c = 0; c < DPL; ++c) {
          part += qc[rr][c] * float(kv_tile[jj * TSTRIDE + uint(c) * 32u + lane]);
        }
        const float total = simd_sum(part);
        s[rr] = lane == jj ? total : s[rr];
      }
    }
  }

  for (int rr = 0; rr < RS; ++rr) {
    if (uint(rr) < nr) {  // online (m_s, l_s, u_s), as the dq kernel's pass 0
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
