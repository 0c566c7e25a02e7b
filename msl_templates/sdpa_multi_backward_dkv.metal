// sdpa_multi_backward_dkv.metal: backward pass 2 of sdpa_multi (FlashAttention-2 style). A
// threadgroup owns a block of 32 keys of one KV head and loops over every query row of
// the heads that share it (G = Hq/Hkv heads x L queries), recomputing each probability from
// the row's statistics (sdpa_multi_backward_dq.metal's stats): dK and dV of its keys are
// summed in registers, in one fixed order (no atomics: the same bits every run), and
// written once. With an additive mask it also writes dS, the mask's gradient.
//
// MATH (per key j < kv_len of KV head (b, kvh), float32, base-2 exponentials):
//   for each row r of the head group (query l = r % L of head kvh * G + r / L), with
//   (m, l, Dr) = stats[r]: d_rj = a * dot(q_r, k_j) (+ mask), (a, b) = mt_score_unit(scale *
//   log2(e)); P_rj = 2^(b (d_rj - m)) / l on visible keys (j <= kv_len - L + l when causal),
//   else 0; dS_rj = P_rj (dot(dO_r, v_j) - Dr)
//   dv_j = sum_r P_rj dO_r;  dk_j = scale * sum_r dS_rj q_r
//   dmask[r, j - key0] = dS_rj (MASK_KIND 2, for the mask's columns; summed to the mask's
//   own shape by the wrapper).
//   Masks, the sinks (inside m and l) and the rows that see nothing follow
//   sdpa_multi_backward_dq.metal: a bool-masked key keeps its P (uniform rows) with dS = 0;
//   an additive -inf key has P = 0; a row with l = 0 (the forward's NaN row) gives NaN for
//   every key j < kv_len. Keys j >= kv_len (up to S) get dk = dv = 0 and are never read.
//
// LAYOUT (row-contiguous): q, dout [B, Hq, L, D] T; k, v [B, Hkv, S, D] T; stats
//   [B*Hq*L, 3] float32 (m, l, Dr); dk, dv [B, Hkv, S, D] T; dmask [B*Hq*L, mask_cols]
//   float32 (a 1-element dummy unless MASK_KIND == 2). 0-d runtime inputs as in
//   sdpa_multi_backward_dq.metal, plus mask_cols (the mask's last axis: kv_len or L).
//   Template: T, D (multiple of 32), MASK_KIND.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (256, 1, 1): 8 simdgroups, simdgroup w owns keys kb + 4w .. kb + 4w + 3
//   (held in registers, lane i owns columns i + 32c);
//   grid = (256, ceil(S / 32), B * Hkv): threadgroup_position_in_grid = (0, key block,
//   b*Hkv + kvh). The rows are staged RB = 8 at a time (q, dO and stats) in threadgroup
//   memory: 2 * 8 * (D + 4 / sizeof(T)) elements of T and 24 floats. A block wholly past
//   kv_len only writes zeros. Every thread reaches every barrier (uniform loop bounds).
//
// TRAFFIC per call: each K and V row < kv_len is read once, rows >= kv_len never; q, dO and
//   stats are read once per key block (ceil(kv_len / 32) times); dk, dv written once (all S
//   rows), dmask once. Per (row, key): two simd_sum dot products.
//
// REDUCTION ORDER: rows in increasing order (g, then l); dot products as a per-lane sum
//   over the lane's columns, then simd_sum: the scores are sdpa_multi_backward_dq.metal's
//   bit for bit, so P = 2^(b (d - m)) / l never exceeds 1 (see there).
//
// Checked only on a Mac: that Apple's compiler accepts the body, register pressure (16 *
//   D / 32 floats of key state per thread), and the speed. The emulator checks the
//   semantics, barriers, threadgroup races and the device traffic.
#include "common.h"
// ---- kernel body ----
constexpr int DPL = D / 32;
constexpr int KPS = 4;                            // keys per simdgroup
constexpr int RB = 8;                             // rows staged at a time
constexpr int TSTRIDE = D + 4 / int(sizeof(T));
static_assert(D % 32 == 0, "head dim tiling");
threadgroup T q_tile[RB * TSTRIDE];
threadgroup T g_tile[RB * TSTRIDE];
threadgroup float st_tile[RB * 3];

const uint block = threadgroup_position_in_grid.y;
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
const float g_scale = grad_scale;
const uint kvn = max(min(kv_len, S_rows), L);
const bool is_causal = causal != 0u;
const float2 score_unit = mt_score_unit(scale);
const float q_scale = score_unit.x;
const float unit = score_unit.y;
const uint key0 = mask_block != 0u ? kvn - L : 0u;
const float mask_unit = 1.4426950408889634f / unit;
const uint kb = block * uint(8 * KPS);
const uint j0 = kb + sg * uint(KPS);  // this simdgroup's first key

const size_t q_row0 = size_t(bh) * n_rows;
const size_t head_off = size_t(bh) * S_rows * D;
float kr[KPS][DPL];
float vr[KPS][DPL];
float dkr[KPS][DPL];
float dvr[KPS][DPL];
for (int kk = 0; kk < KPS; ++kk) {
  const uint j = j0 + uint(kk);
  for (int c = 0; c < DPL; ++c) {
    const size_t at = head_off + size_t(j) * D + lane + 32u * uint(c);
    kr[kk][c] = j < kvn ? float(k[at]) : 0.0f;
    vr[kk][c] = j < kvn ? float(v[at]) : 0.0f;
    dkr[kk][c] = 0.0f;
    dvr[kk][c] = 0.0f;
  }
}

const uint n_keys = kb < kvn ? min(uint(8 * KPS), kvn - kb) : 0u;  // uniform
for (uint rb = 0; rb < (n_keys > 0u ? n_rows : 0u); rb += uint(RB)) {
  const uint nrb = min(uint(RB), n_rows - rb);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < uint(RB * D); e += n_threads) {
    const uint r = e / uint(D);
    const uint d = e - r * uint(D);
    const size_t at = (q_row0 + rb + r) * D + d;
    q_tile[r * TSTRIDE + d] = r < nrb ? q[at] : T(0);
    g_tile[r * TSTRIDE + d] = r < nrb ? dout[at] : T(0);
  }
  if (tid < uint(RB * 3)) {
    st_tile[tid] = tid / 3u < nrb ? stats[(q_row0 + rb) * 3u + tid] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = 0; i < nrb; ++i) {
    const uint r = rb + i;
    const uint l_idx = r % L;
    const uint head = (bh % n_kv_heads) * group + r / L;
    const size_t mrow = size_t(bh / n_kv_heads) * mask_sb + size_t(head) * mask_sh
                        + size_t(l_idx) * mask_sl;
    const uint lim = is_causal ? kvn - L + l_idx + 1u : kvn;
    const float m_r = st_tile[i * 3u];
    const float l_r = st_tile[i * 3u + 1u];
    const float d_r = st_tile[i * 3u + 2u];
    const bool nan_row = !(l_r > 0.0f);
    float qv[DPL];
    float qs[DPL];
    float gv[DPL];
    for (int c = 0; c < DPL; ++c) {
      qv[c] = float(q_tile[i * TSTRIDE + lane + 32u * uint(c)]);
      qs[c] = q_scale * qv[c];
      gv[c] = float(g_tile[i * TSTRIDE + lane + 32u * uint(c)]);
    }
    for (int kk = 0; kk < KPS; ++kk) {
      const uint j = j0 + uint(kk);
      if (j < kvn) {  // uniform over the simdgroup
        float sp = 0.0f;  // the score as the dq kernel sums it: the same bits
        float dpp = 0.0f;
        for (int c = 0; c < DPL; ++c) {
          sp += qs[c] * kr[kk][c];
          dpp += gv[c] * vr[kk][c];
        }
        float sc = simd_sum(sp);
        const float dp = simd_sum(dpp);
        bool ok = j < lim;
        bool live = ok;
        if (MASK_KIND != 0 && ok && j >= key0) {
          const auto mv = mask[mrow + (j - key0)];
          if (MASK_KIND == 1) {
            live = bool(mv);
            sc = live ? sc : -FLT_MAX;
          } else {
            sc += float(mv) * mask_unit;
            ok = sc != -INFINITY;
            live = ok;
          }
        }
        const float p = nan_row ? NAN : (ok ? exp2(unit * (sc - m_r)) / l_r : 0.0f);
        const float ds = nan_row ? NAN : (live ? p * (dp - d_r) : 0.0f);
        for (int c = 0; c < DPL; ++c) {
          dvr[kk][c] += p * gv[c];
          dkr[kk][c] += ds * qv[c];
        }
        if (MASK_KIND == 2 && lane == 0u && j >= key0 && j - key0 < mask_cols) {
          dmask[(q_row0 + r) * mask_cols + (j - key0)] = ds;
        }
      }
    }
  }
}

for (int kk = 0; kk < KPS; ++kk) {
  const uint j = j0 + uint(kk);
  if (j < S_rows) {
    for (int c = 0; c < DPL; ++c) {
      const size_t at = head_off + size_t(j) * D + lane + 32u * uint(c);
      dk[at] = T(g_scale * dkr[kk][c]);
      dv[at] = T(dvr[kk][c]);
    }
  }
}
