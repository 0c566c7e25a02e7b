// sdpa_multi_backward_dkv.metal: the last kernel of sdpa_multi's VJP (FlashAttention-2
// style). A threadgroup owns a block of 32 keys of one KV head, one key per lane, and loops
// over every query row of the heads that share it (G = Hq/Hkv heads x L queries),
// recomputing each probability from the row's statistics (written by
// sdpa_multi_backward_dq_split.metal): dK and dV of its keys are summed in registers, in
// one fixed order (no atomics: the same bits every run), and written once. With an
// additive mask it also writes dS, the mask's gradient.
//
// MATH (per key j < kv_len of KV head (b, kvh), float32, base-2 exponentials):
//   for each row r of the head group (query l = r % L of head kvh * G + r / L), with
//   (m, l, Dr) = stats[r]: d_rj = dot(a * q_r, k_j) (+ mask), (a, b) =
//   mt_score_unit(scale * log2(e)); P_rj = 2^(b (d_rj - m)) / l on visible keys
//   (j <= kv_len - L + l when causal), else 0; dS_rj = P_rj (dot(dO_r, v_j) - Dr)
//   dv_j = sum_r P_rj dO_r;  dk_j = scale * sum_r dS_rj q_r
//   dmask[r, j - key0] = dS_rj (MASK_KIND 2, for the mask's columns; summed to the mask's
//   own shape by the wrapper).
//   Masks, the sinks (inside m and l) and the rows that see nothing follow
//   sdpa_multi_backward_dq_split.metal: a bool-masked key keeps its P (uniform rows) with
//   dS = 0; an additive -inf key has P = 0; a row with l = 0 (the forward's NaN row) gives
//   NaN for every key j < kv_len. Keys j >= kv_len (up to S) get dk = dv = 0 and are never
//   read. d_rj is the statistics' score bits (REDUCTION ORDER): d_rj <= m exactly (m is
//   one of them, or the sink above them), so P_rj <= 1 / l at any scale.
//
// LAYOUT (row-contiguous): q, dout [B, Hq, L, D] T; k, v [B, Hkv, S, D] T; stats
//   [B*Hq*L, 3] float32 (m, l, Dr); dk, dv [B, Hkv, S, D] T; dmask [B*Hq*L, mask_cols]
//   float32 (a 1-element dummy unless MASK_KIND == 2). 0-d runtime inputs as in
//   sdpa_multi_backward_stats.metal, plus mask_cols (the mask's last axis: kv_len or L).
//   Template: T, D (multiple of CPS), CPS (columns per simdgroup: 16 or 32), MASK_KIND.
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
//   threadgroup = (32 * NSG, 1, 1), NSG = D / CPS simdgroups; lane i of every simdgroup owns
//   key kb + i, simdgroup w owns columns [w * CPS, (w + 1) * CPS) of it (k, v, dk, dv in
//   registers); grid = (32 * NSG, ceil(S / 32), B * Hkv): threadgroup_position_in_grid =
//   (0, key block, b*Hkv + kvh). The rows are staged RB at a time (RB = 16 for D <= 64, 8
//   for D <= 128, 4 beyond): q and dO tiles RB * D elements of T each, stats RB * 3 floats,
//   and the score chunks [D / 16][RB][32] x 2 floats (whatever CPS): RB * (2 D sizeof(T) +
//   16 D + 12) bytes, at most 24,768 (D 64, float32; D 96 24,672 at RB 8; D 128 24,672;
//   D 256 24,624) <= 32 KiB. A block wholly past kv_len
//   only writes zeros. Every thread reaches every barrier (uniform loop bounds).
//
// TRAFFIC per call: each K and V row < kv_len is read once, rows >= kv_len never; q, dO and
//   stats are read once per key block (ceil(kv_len / 32) times); dk, dv written once (all S
//   rows), dmask once (by simdgroup 0, one coalesced row of 32 keys per query row). Per
//   (row, key) and simdgroup: 2 * CPS FMAs for the chunks, 2 * D / 16 threadgroup reads to
//   sum them, 2 * CPS FMAs into dk and dv; no SIMD-group function, no shuffle.
//
// REDUCTION ORDER: rows in increasing order (g, then l); each score and dP is common.h's
//   backward score expression: simdgroup w forms the CPS / 16 chunks of its columns
//   (mt_score_chunk: a fma chain over 16 columns of a * float(q), or float(dO), with the
//   key's float(k), or float(v)), writes them to threadgroup memory, and every lane sums
//   all D / 16 chunks in chunk order (mt_score_add): the same bits in every simdgroup, at
//   CPS 16 and 32 alike, and the same as the statistics and split dq kernels' scores.
//
// Checked only on a Mac: that Apple's compiler accepts the body, register pressure (4 * CPS
//   floats of key state per thread; nvcc sm_90, half, no spills: 94-125 registers at CPS 16,
//   161-188 at CPS 32), and the speed. The emulator checks the semantics, barriers,
//   threadgroup races and the device traffic.
#include "common.h"
// ---- kernel body ----
constexpr int NSG = D / CPS;                      // simdgroups, CPS columns each
constexpr int NCH = D / MT_SCORE_CHUNK;           // score chunks (common.h), CPS / 16 each
constexpr int CPG = CPS / MT_SCORE_CHUNK;         // chunks per simdgroup
constexpr int RB = D <= 64 ? 16 : (D <= 128 ? 8 : 4);  // rows staged at a time
static_assert((CPS == 16 || CPS == 32) && D % CPS == 0, "head dim tiling");
threadgroup T q_tile[RB * D];
threadgroup T g_tile[RB * D];
threadgroup float st_tile[RB * 3];
threadgroup float s_part[NCH * RB * 32];          // [NCH][RB][32]: chunks of (a q) . k
threadgroup float g_part[NCH * RB * 32];          // [NCH][RB][32]: chunks of dO . v

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
const uint kb = block * 32u;
const uint j = kb + lane;                         // this lane's key
const bool key_in = j < kvn;
const uint col0 = sg * uint(CPS);                 // this simdgroup's first column

const size_t q_row0 = size_t(bh) * n_rows;
const size_t key_at = (size_t(bh) * S_rows + j) * D + col0;
float kr[CPS];   // float(k)
float vr[CPS];
float dkr[CPS];
float dvr[CPS];
// 8 columns per access (mt_load8: 16-byte loads on CUDA where aligned; a lane's key is its
// own row, so element-wise loads would touch 32 rows per instruction for 2 or 4 bytes each)
for (int c = 0; c < CPS; c += 8) {
  float k8[8];
  float v8[8];
  if (key_in) {
    mt_load8(k + key_at + c, k8);
    mt_load8(v + key_at + c, v8);
  }
  for (int e = 0; e < 8; ++e) {
    kr[c + e] = key_in ? k8[e] : 0.0f;
    vr[c + e] = key_in ? v8[e] : 0.0f;
    dkr[c + e] = 0.0f;
    dvr[c + e] = 0.0f;
  }
}

const uint n_keys = kb < kvn ? min(32u, kvn - kb) : 0u;  // uniform
for (uint rb = 0; rb < (n_keys > 0u ? n_rows : 0u); rb += uint(RB)) {
  const uint nrb = min(uint(RB), n_rows - rb);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < nrb * uint(D); e += n_threads) {
    const size_t at = (q_row0 + rb) * D + e;
    q_tile[e] = q[at];
    g_tile[e] = dout[at];
  }
  if (tid < nrb * 3u) {
    st_tile[tid] = stats[(q_row0 + rb) * 3u + tid];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // this simdgroup's score chunks of both dot products (common.h's mt_score_chunk), for
  // every staged row (the row's q and dO values are the same address for all lanes:
  // broadcast reads)
  for (uint i = 0; i < nrb; ++i) {
    for (int cc = 0; cc < CPG; ++cc) {
      const uint ch = sg * uint(CPG) + uint(cc);
      const uint at = i * D + col0 + uint(cc * MT_SCORE_CHUNK);
      s_part[(ch * uint(RB) + i) * 32u + lane] =
          mt_score_chunk<T>(q_tile + at, q_scale, kr + cc * MT_SCORE_CHUNK);
      g_part[(ch * uint(RB) + i) * 32u + lane] =
          mt_score_chunk<T>(g_tile + at, 1.0f, vr + cc * MT_SCORE_CHUNK);
    }
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
    float sc = 0.0f;
    float dp = 0.0f;
    for (int c = 0; c < NCH; ++c) {  // chunk order (common.h): the same sums in every sg
      sc = mt_score_add(sc, s_part[(uint(c) * uint(RB) + i) * 32u + lane], c);
      dp = mt_score_add(dp, g_part[(uint(c) * uint(RB) + i) * 32u + lane], c);
    }
    bool ok = j < lim;  // lim <= kvn: a visible key is a key < kv_len
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
    // sc is the statistics' score bits (common.h): sc <= m_r, P <= 1 / l_r (MATH)
    const float p = !key_in ? 0.0f
                    : (nan_row ? NAN : (ok ? exp2(unit * (sc - m_r)) / l_r : 0.0f));
    const float ds = !key_in ? 0.0f : (nan_row ? NAN : (live ? p * (dp - d_r) : 0.0f));
    for (int c = 0; c < CPS; ++c) {
      dvr[c] += p * float(g_tile[i * D + col0 + c]);
      dkr[c] += ds * float(q_tile[i * D + col0 + c]);
    }
    if (MASK_KIND == 2 && sg == 0u && key_in && j >= key0 && j - key0 < mask_cols) {
      dmask[(q_row0 + r) * mask_cols + (j - key0)] = ds;
    }
  }
}

if (j < S_rows) {
  for (int c = 0; c < CPS; c += 8) {
    float dk8[8];
    float dv8[8];
    for (int e = 0; e < 8; ++e) {
      dk8[e] = key_in ? g_scale * dkr[c + e] : 0.0f;
      dv8[e] = key_in ? dvr[c + e] : 0.0f;
    }
    mt_store8(dk + key_at + c, dk8);
    mt_store8(dv + key_at + c, dv8);
  }
}
