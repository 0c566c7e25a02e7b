// sdpa_multi_backward_dq.metal: backward pass 1 of sdpa_multi (FlashAttention-2 style). A
// tile of up to 32 query rows (L queries x the G = Hq/Hkv query heads sharing one KV head)
// walks the visible keys twice: pass 0 recomputes the row's softmax statistics and its
// output, pass 1 forms dS and accumulates dQ. Writes dq, the per-row statistics (for
// sdpa_multi_backward_dkv.metal) and each row's term of dsinks. Nothing [L, S] is stored.
//
// MATH (per query row r, float32, base-2 exponentials; scores as in sdpa_multi.metal):
//   d_j = a * dot(q_r, k_j) (+ mask), (a, b) = mt_score_unit(scale * log2(e)): the score
//   in units of b, visible keys j < kv_len (and j <= kv_len - L + l when causal).
//   pass 0: m = max(max_j d_j, sink'), l = sum_j 2^(b (d_j - m)) + 2^(b (sink' - m)),
//     sink' = sinks[h] * log2(e) / b (the sink term only with has_sinks); this (m, l) is
//     the logsumexp lse = ln 2 * (b m + log2 l), kept as two floats so that scores beyond
//     float32's range (scale 1e38) still weigh their keys right.
//     O_r = sum_j P_rj v_j (in float32, not the forward's rounded output), P_rj =
//     2^(b (d_j - m)) / l;  Dr = dot(dO_r, O_r).
//   pass 1: dP_rj = dot(dO_r, v_j);  dS_rj = P_rj (dP_rj - Dr);  dq_r = scale * sum_j dS_rj k_j
//   dsink_part[r] = -2^(b (sink' - m)) / l * Dr  (0 without sinks; summed by the wrapper)
//   MASK_KIND 1 (bool): a masked key scores -FLT_MAX (its P is kept: a row whose keys are
//   all masked averages v uniformly, as the forward) but its score does not depend on q, k,
//   so its dS is 0. MASK_KIND 2 (additive): s += mask; a key whose score is -inf has P = 0.
//   A row that sees no key and no sink (l = 0: the forward's NaN row) gets P = dS = NaN for
//   every key j < kv_len, as the float64 definition (exp(-inf - -inf)) gives.
//
// RANGE: pass 0 keeps O divided by the running l, as the forward (a convex combination of
//   v rows); pass 1 sums dS_rj k_j unnormalised (dq's own range).
//
// LAYOUT (row-contiguous): q, dout [B, Hq, L, D] T (the G*L rows of KV head (b, kvh) are
//   contiguous); k, v [B, Hkv, S, D] T (S = kv_rows; rows >= kv_len never read);
//   dq [B, Hq, L, D] T; stats [B*Hq*L, 3] float32 (m, l, Dr); dsink_part [B*Hq*L] float32.
//   0-d runtime inputs: n_q (L), group (G), kv_len (clamped to [L, S] here: it may be
//   device-side), kv_rows (S), causal (0/1), kv_heads (Hkv), mask_block (0/1), has_sinks
//   (0/1), mask_sb/sh/sl (the mask's element strides, 0 on broadcast axes) as uint;
//   scale (float, times log2(e)), grad_scale (float, the plain scale). mask [MB, MH, L, MC]
//   (bool or T; a 1-element dummy when MASK_KIND == 0) read at column j - key0, key0 = 0 or
//   kv_len - L (block form); sinks [Hq] float32 (a 1-element dummy without sinks).
//   Template: T, D (multiple of 32), KB (keys per staged block: 32, or 16 where 32 rows of
//   D would pass 16 KiB), MASK_KIND (0 none or causal, 1 bool, 2 additive).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (256, 1, 1): 8 simdgroups of RS = 4 rows (a 32-row tile);
//   grid = (256, ceil(G*L / 32), B * Hkv): threadgroup_position_in_grid = (0, tile, b*Hkv+kvh).
//   Lane i owns the q / dO / o / dq columns i + 32c; each dot product (a score, a dP) is a
//   simd_sum, kept by lane i for key kb + i of each staged block (lanes >= KB own none).
//   threadgroup memory: kv_tile KB * (D + 4 / sizeof(T)) elements of T (<= 16.5 KiB) and
//   p_tile 32 x 32 floats. Every thread reaches every barrier (uniform loop bounds).
//
// TRAFFIC per call: each visible K and V row is read twice per row tile (once per pass;
//   ceil(G*L / 32) tiles per KV head; causal tiles stop at their last visible key); q read
//   once, dO once; dq, stats, dsink_part written once. Per (row, key) and pass: one
//   simd_sum dot product (two in pass 1).
//   The KV range is not split across threadgroups (the forward splits it): B * Hkv *
//   ceil(G*L / 32) threadgroups in all, few for decode-sized L. Where backward_plan
//   (ops/sdpa_multi.py) splits it, sdpa_multi_backward_stats.metal and
//   sdpa_multi_backward_dq_split.metal run instead of this kernel (by default on cuda only).
//
// REDUCTION ORDER: keys in increasing order in both passes. A score is the per-lane sum
//   over c of (a * q[i + 32c]) * k[i + 32c], then simd_sum: exactly as the dk/dv kernel
//   computes it, so both kernels (and both passes) see the same bits, and a probability
//   recomputed from (m, l) never exceeds 1 (b multiplies any rounding difference of d:
//   with scale 1e30 one ulp would overflow 2^(b (d - m))). Dr with simd_sum.
//
// Checked only on a Mac: that Apple's compiler accepts the body, that it contracts the two
//   kernels' score sums alike (the same expression), register pressure (about 4 * (3 * D /
//   32) floats of row state per thread), and the speed. The emulator checks the semantics,
//   barriers, threadgroup races and the device traffic.
#include "common.h"
// ---- kernel body ----
constexpr int DPL = D / 32;                       // columns per lane
constexpr int RS = 4;                             // rows per simdgroup
constexpr int TSTRIDE = D + 4 / int(sizeof(T));   // odd word stride: lane-per-row reads
static_assert(D % 32 == 0 && DPL >= 2, "head dim tiling");
static_assert(KB == 16 || KB == 32, "key block");
threadgroup T kv_tile[KB * TSTRIDE];
threadgroup float p_tile[32 * 32];

const uint tile_idx = threadgroup_position_in_grid.y;
const uint bh = threadgroup_position_in_grid.z;
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

const uint tile_row0 = tile_idx * 32u;
const uint row0 = tile_row0 + sg * uint(RS);
const uint nr = row0 < n_rows ? min(uint(RS), n_rows - row0) : 0u;
threadgroup float* p_rows = p_tile + sg * uint(RS) * 32u;

uint k_end = kvn;
if (is_causal) {  // the last key any row of the tile sees
  const uint last_row = min(tile_row0 + 32u, n_rows) - 1u;
  const uint span = last_row - tile_row0 + 1u;
  const uint l_first = tile_row0 % L;
  const uint l_last = last_row % L;
  const uint l_max = (span >= L || l_last < l_first) ? L - 1u : l_last;
  k_end = min(k_end, kvn - L + l_max + 1u);
}

const size_t q_row0 = size_t(bh) * n_rows;
float qc[RS][DPL];   // a * q, columns lane + 32c
float gc[RS][DPL];   // dO, same columns
float acc[RS][DPL];  // pass 0: O / l; pass 1: sum dS k (same columns)
uint lim[RS];
size_t mask_row[RS];
float m[RS];
float l_sum[RS];
float dd[RS];        // Dr
float sink_s[RS];    // the sink in score units (-INFINITY without one)
for (int rr = 0; rr < RS; ++rr) {
  const uint r = row0 + uint(rr);
  const bool valid = uint(rr) < nr;
  const uint head = (bh % n_kv_heads) * group + r / L;
  mask_row[rr] = size_t(bh / n_kv_heads) * mask_sb + size_t(head) * mask_sh
                 + size_t(r % L) * mask_sl;
  lim[rr] = !valid ? 0u : (is_causal ? kvn - L + r % L + 1u : kvn);
  sink_s[rr] = (valid && with_sinks) ? sinks[head] * mask_unit : -INFINITY;
  m[rr] = -INFINITY;
  l_sum[rr] = 0.0f;
  dd[rr] = 0.0f;
  for (int c = 0; c < DPL; ++c) {
    const size_t at = (q_row0 + r) * D + lane + 32u * uint(c);
    qc[rr][c] = valid ? q_scale * float(q[at]) : 0.0f;
    gc[rr][c] = valid ? float(dout[at]) : 0.0f;
    acc[rr][c] = 0.0f;
  }
}

const size_t head_off = size_t(bh) * S_rows * D;
const device T* k_head = k + head_off;
const device T* v_head = v + head_off;

for (int pass = 0; pass < 2; ++pass) {
  for (uint kb = 0; kb < k_end; kb += uint(KB)) {
    const uint nk = min(uint(KB), k_end - kb);
    const uint j = kb + lane;  // this lane's key

    // pass 1: dP = dO . v_j for this lane's key (V staged first, K after it for dq).
    float dp[RS];
    for (int rr = 0; rr < RS; ++rr) {
      dp[rr] = 0.0f;
    }
    if (pass == 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint e = tid; e < uint(KB * D); e += n_threads) {
        const uint jj = e / uint(D);
        const uint d = e - jj * uint(D);
        kv_tile[jj * TSTRIDE + d] = jj < nk ? v_head[size_t(kb + jj) * D + d] : T(0);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int rr = 0; rr < RS; ++rr) {
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
    }

    // Scores of this lane's key (the same code in both passes).
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
          const float total = simd_sum(part);  // as the dk/dv kernel: the same bits
          s[rr] = lane == jj ? total : s[rr];
        }
      }
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
        if (pass == 0) {  // online softmax, as sdpa_multi.metal
          sc = ok ? sc : -INFINITY;
          const float m_new = max(m[rr], simd_max(sc));
          const float alpha = m[rr] == m_new ? 1.0f : exp2(unit * (m[rr] - m_new));
          const float p = ok ? exp2(unit * (sc - m_new)) : 0.0f;
          const float l_old = l_sum[rr] * alpha;
          const float l_new = l_old + simd_sum(p);
          const float inv_l = l_new > 0.0f ? 1.0f / l_new : 0.0f;
          p_rows[uint(rr) * 32u + lane] = p * inv_l;
          const float keep = l_old * inv_l;
          for (int c = 0; c < DPL; ++c) {
            acc[rr][c] *= keep;
          }
          l_sum[rr] = l_new;
          m[rr] = m_new;
        } else {
          const bool nan_row = !(l_sum[rr] > 0.0f);
          const float p = ok ? exp2(unit * (sc - m[rr])) / l_sum[rr] : 0.0f;
          p_rows[uint(rr) * 32u + lane] = nan_row ? NAN : (live ? p * (dp[rr] - dd[rr]) : 0.0f);
        }
      }
    }

    if (pass == 0) {  // O += P v (V replaces K in the tile)
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint e = tid; e < uint(KB * D); e += n_threads) {
        const uint jj = e / uint(D);
        const uint d = e - jj * uint(D);
        kv_tile[jj * TSTRIDE + d] = jj < nk ? v_head[size_t(kb + jj) * D + d] : T(0);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // p_rows (and V) published
    if (nr > 0u) {  // pass 0: acc += P_j v_j; pass 1: acc += dS_j k_j (K still staged)
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

  if (pass == 0) {  // the sink joins the statistics; Dr = dO . O; acc restarts for dq
    for (int rr = 0; rr < RS; ++rr) {
      if (uint(rr) < nr) {
        const uint r = row0 + uint(rr);
        const float m_f = max(m[rr], sink_s[rr]);
        const float l_keys = m[rr] == m_f ? l_sum[rr] : l_sum[rr] * exp2(unit * (m[rr] - m_f));
        const float p_sink = !with_sinks ? 0.0f
                             : (sink_s[rr] == m_f ? 1.0f : exp2(unit * (sink_s[rr] - m_f)));
        const float l_f = l_keys + p_sink;
        const float ratio = l_f > 0.0f ? l_keys / l_f : NAN;  // O = acc * ratio
        float part = 0.0f;
        for (int c = 0; c < DPL; ++c) {
          part += gc[rr][c] * (acc[rr][c] * ratio);
          acc[rr][c] = 0.0f;
        }
        dd[rr] = simd_sum(part);
        m[rr] = m_f;
        l_sum[rr] = l_f;
        if (lane == 0u) {
          stats[(q_row0 + r) * 3u] = m_f;
          stats[(q_row0 + r) * 3u + 1u] = l_f;
          stats[(q_row0 + r) * 3u + 2u] = dd[rr];
          dsink_part[q_row0 + r] = !with_sinks ? 0.0f : -(p_sink / l_f) * dd[rr];
        }
      }
    }
  }
}

for (int rr = 0; rr < RS; ++rr) {
  if (uint(rr) < nr) {
    for (int c = 0; c < DPL; ++c) {
      dq[(q_row0 + row0 + uint(rr)) * D + lane + 32u * uint(c)] = T(g_scale * acc[rr][c]);
    }
  }
}
