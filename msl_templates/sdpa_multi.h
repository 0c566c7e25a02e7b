// sdpa_multi.h: the row and mask helpers that sdpa_multi's pass-1 kernels share
// (sdpa_multi.metal's staged and vector paths, sdpa_multi_mma.metal): one definition of
// the causal bounds, the mask's addressing and the mask rules (sdpa_multi.metal, MATH).
#pragma once

// Last visible key + 1 of query row r (query l = r % L): kvn, or kvn - L + l + 1 causal.
inline uint mt_sdpa_row_end(uint r, uint L, uint kvn, bool is_causal) {
  return is_causal ? kvn - L + r % L + 1u : kvn;
}

// The end of the keys [.., k_end) that rows first .. last (of one tile) need: a causal tile
// stops at the last key its latest query sees.
inline uint mt_sdpa_tile_end(uint k_end, uint first, uint last, uint L, uint kvn,
                             bool is_causal) {
  if (is_causal) {
    const uint span = last - first + 1u;
    const uint l_first = first % L;
    const uint l_last = last % L;
    const uint l_max = (span >= L || l_last < l_first) ? L - 1u : l_last;
    k_end = min(k_end, kvn - L + l_max + 1u);
  }
  return k_end;
}

// The mask's element at column 0 for query row r of KV head bh (batch bh / kv_heads).
inline size_t mt_sdpa_mask_row(uint bh, uint r, uint L, uint group, uint kv_heads, uint sb,
                               uint sh, uint sl) {
  const uint head = (bh % kv_heads) * group + r / L;  // query head of row r
  return size_t(bh / kv_heads) * sb + size_t(head) * sh + size_t(r % L) * sl;
}

// A visible score sc with the mask element mv applied (MASK_KIND 1 bool, 2 additive: see
// MATH); ok becomes false where an additive -inf makes the key weigh 0.
template <int MASK_KIND, typename MT>
inline float mt_sdpa_masked(float sc, MT mv, float mask_unit, thread bool& ok) {
  if (MASK_KIND == 1) {
    sc = bool(mv) ? sc : -FLT_MAX;
  } else {
    sc += float(mv) * mask_unit;
    ok = sc != -INFINITY;  // a -inf mask entry: the key weighs 0
  }
  return sc;
}
