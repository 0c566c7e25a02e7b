// sdpa_multi.metal: pass 1 of sdpa_multi. A tile of up to 32 query rows (L queries x the
// G = Hq/Hkv query heads that share one KV head) attends one slice of the KV cache; the slice
// is read from device memory once for all rows of the tile. Writes unnormalised partial
// softmax results; sdpa_multi_combine.metal merges the slices.
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
//   a multiple of 32), causal (0/1) as uint, scale (float, times log2(e)). kv_len may be
//   device-side: it is clamped to [L, S] here, and slices past it see no key.
//   mask [MB, MH, L, MC] (bool or T; a 1-element dummy when MASK_KIND == 0), read with the
//   element strides mask_sb, mask_sh, mask_sl (0 on a broadcast axis), column stride 1;
//   kv_heads (Hkv) and mask_block (0/1: key0 above) as uint.
//   ml_part's m is in units of d (as above): the combine takes the same scale to undo them.
//   Template: T, D (head dim, multiple of 32), RS (rows per simdgroup), DC (columns
//   staged at a time: D or D/2, a multiple of 32, with 32 * DC * sizeof(T) <= 16 KiB),
//   MASK_KIND (0 none or causal, 1 bool, 2 additive: the unmasked path reads no mask).
//
// DISPATCH INVARIANTS (the wrapper derives them from validated shapes):
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
// Checked only on a Mac: that Apple's compiler accepts the body as written (the register
//   arrays are indexed with compile-time indices once the constant-trip loops unroll;
//   simd_shuffle of float2/float3/float4 for D = 64/96/128+), that the register arrays
//   (about 100 floats per thread at RS = 8) do not spill, that the padded kv_tile rows avoid
//   bank conflicts as intended, and the speed (including the split planner's tuning
//   constants in sdpa_multi.py). The emulator checks the semantics, barriers, races on
//   threadgroup memory (strict mode) and the device traffic.
#include "common.h"

// Copy rows [0, n_valid) of a 32-row block of a [.., D] matrix, columns [col0, col0 + DC),
// into tile (row stride TSTRIDE); rows >= n_valid are zero-filled, never read.
template <typename T, int D, int DC, int TSTRIDE>
inline void mt_sdpa_stage(threadgroup T* tile, const device T* src, uint n_valid, uint col0,
                          uint tid, uint n_threads) {
  for (uint e = tid; e < 32u * uint(DC); e += n_threads) {
    const uint j = e / uint(DC);
    const uint d = e - j * uint(DC);
    tile[j * TSTRIDE + d] = j < n_valid ? src[size_t(j) * D + col0 + d] : T(0);
  }
}
// ---- kernel body ----
constexpr int DPL = D / 32;                   // q / o columns per lane
constexpr int QV = DPL < 4 ? DPL : 4;         // q columns moved by one shuffle
constexpr int NQV = DPL / QV;                 // q vectors per lane
constexpr int CPL = DC / 32;                  // staged o columns per lane
constexpr int NCH = D / DC;                   // column chunks per 32-key block
constexpr int LPC = 32 / NCH;                 // lanes whose q columns lie in one chunk
constexpr int TSTRIDE = DC + 4 / int(sizeof(T));  // odd word stride: lane-per-row reads hit
                                                  // 32 different banks
static_assert(D % 32 == 0 && DPL >= 2 && DPL % QV == 0, "head dim tiling");
static_assert(DC % 32 == 0 && D % DC == 0, "staged column chunks");
static_assert(RS >= 1 && RS <= 32 && 32 % RS == 0, "rows per simdgroup");
typedef vec<float, QV> qvec;
threadgroup T kv_tile[32 * TSTRIDE];
threadgroup float p_tile[32 * 32];

const uint split = threadgroup_position_in_grid.x;
const uint tile_idx = threadgroup_position_in_grid.y;
const uint bh = threadgroup_position_in_grid.z;
const uint n_splits = threadgroups_per_grid.x;
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

// Rows of this simdgroup: row0 .. row0 + nr - 1 (nr may be 0 in a ragged last tile).
const uint tile_row0 = tile_idx * 32u;
const uint row0 = tile_row0 + sg * uint(RS);
const uint nr = row0 < n_rows ? min(uint(RS), n_rows - row0) : 0u;
threadgroup float* p_rows = p_tile + sg * uint(RS) * 32u;  // this simdgroup's rows of p

// Keys of this slice; a causal tile stops at the last key its rows can see.
const uint k_begin = split * chunk_keys;
uint k_end = min(k_begin + chunk_keys, kvn);
if (is_causal) {
  const uint last_row = min(tile_row0 + 32u, n_rows) - 1u;
  const uint span = last_row - tile_row0 + 1u;
  const uint l_first = tile_row0 % L;
  const uint l_last = last_row % L;
  const uint l_max = (span >= L || l_last < l_first) ? L - 1u : l_last;
  k_end = min(k_end, kvn - L + l_max + 1u);
}

// Query rows in registers, pre-scaled: lane holds columns lane * DPL .. lane * DPL + DPL - 1.
const size_t q_row0 = size_t(bh) * n_rows;
qvec qr[RS][NQV];
uint lim[RS];  // last visible key + 1 of each row (0 for rows past n_rows)
size_t mask_row[RS];  // the row's mask element at column 0 (MASK_KIND != 0)
for (int rr = 0; rr < RS; ++rr) {
  const uint r = row0 + uint(rr);
  const bool valid = uint(rr) < nr;
  const uint head = (bh % kv_heads) * group + r / L;  // query head of row r
  mask_row[rr] = size_t(bh / kv_heads) * mask_sb + size_t(head) * mask_sh
                 + size_t(r % L) * mask_sl;
  lim[rr] = !valid ? 0u : (is_causal ? kvn - L + r % L + 1u : kvn);
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

const size_t head_off = size_t(bh) * kv_rows * D;
const device T* k_head = k + head_off;
const device T* v_head = v + head_off;

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
              const qvec qs = simd_shuffle(qr[rr][w], src);
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
        const auto mv = mask[mask_row[rr] + (kb + lane - key0)];
        if (MASK_KIND == 1) {
          sc = bool(mv) ? sc : -FLT_MAX;
        } else {
          sc += float(mv) * mask_unit;
          ok = sc != -INFINITY;  // a -inf mask entry: the key weighs 0
        }
      }
      sc = ok ? sc : -INFINITY;
      const float m_new = max(m[rr], simd_max(sc));  // -INFINITY while no key was visible
      const float alpha = m[rr] == m_new ? 1.0f : exp2(unit * (m[rr] - m_new));
      const float p = ok ? exp2(unit * (sc - m_new)) : 0.0f;
      const float l_old = l_sum[rr] * alpha;
      const float l_new = l_old + simd_sum(p);
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
