// simd.h: barriers and SIMD-group / quad-group functions.
//
// A lane that calls a SIMD-group function blocks; once every unfinished lane of its SIMD-group
// is blocked, the lanes blocked at the same call -- the same source position reached through
// the same chain of calls -- are the active set and the function is evaluated over them (lanes
// that returned, or wait elsewhere, are inactive).
//
// Reduction order (fixed): simd_sum/product/min/max/and/or/xor combine the active lanes as a
// binary tree over lane numbers -- (0,1) (2,3) ... then (0,2) (4,6) ..., then (0,4) ... --
// with inactive lanes skipped. Prefix functions go in lane order.
// Shuffles: simd_shuffle_up/down leave a lane's own value when the source lane is outside the
// SIMD-group; reading an inactive lane gives poison (all bits set), or a hazard in strict mode.
// A lane/delta/mask argument outside the SIMD-group (>= 32, or >= 4 for quad_) is a hazard.
#pragma once

#include "mt_emu/math.h"

#define MT_AI inline __attribute__((always_inline))
// The caller's source position, as a defaulted last parameter of barriers and collectives.
#define MT_LOC std::source_location mt_loc = std::source_location::current()

namespace mt {
inline mt_site site_of(const std::source_location& l) {
  return mt_site{l.file_name(), l.line(), l.column()};
}
}  // namespace mt

namespace metal {

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

MT_AI void threadgroup_barrier(mem_flags = mem_flags::mem_none, MT_LOC) {
  const mt_site site = mt::site_of(mt_loc);
  mt_barrier(MT_BARRIER_THREADGROUP, &site);
}
MT_AI void simdgroup_barrier(mem_flags = mem_flags::mem_none, MT_LOC) {
  const mt_site site = mt::site_of(mt_loc);
  mt_barrier(MT_BARRIER_SIMDGROUP, &site);
}
inline void atomic_thread_fence(mem_flags, int = 0, int = 0) {}

struct simd_vote {
  typedef unsigned long vote_t;
  vote_t v;
  constexpr explicit simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return (v & 0xFFFFFFFFul) == 0xFFFFFFFFul; }
  bool any() const { return v != 0; }
};
struct quad_vote {
  typedef unsigned short vote_t;
  vote_t v;
  constexpr explicit quad_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return (v & 0xF) == 0xF; }
  bool any() const { return v != 0; }
};

}  // namespace metal

namespace mt {

enum coll_op {
  OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_AND, OP_OR, OP_XOR,
  OP_INC_SUM, OP_EXC_SUM, OP_INC_PRODUCT, OP_EXC_PRODUCT,
  OP_SHUFFLE, OP_UP, OP_DOWN, OP_XOR_SHUFFLE, OP_ROTATE_UP, OP_ROTATE_DOWN,
  OP_FILL_UP, OP_FILL_DOWN, OP_BROADCAST, OP_BROADCAST_FIRST,
  OP_BALLOT, OP_ALL, OP_ANY, OP_IS_FIRST, OP_ACTIVE,
  OP_MMA,
};

inline const char* op_name(int op, int width) {
  static const char* const simd[] = {
      "simd_sum", "simd_product", "simd_min", "simd_max", "simd_and", "simd_or", "simd_xor",
      "simd_prefix_inclusive_sum", "simd_prefix_exclusive_sum",
      "simd_prefix_inclusive_product", "simd_prefix_exclusive_product",
      "simd_shuffle", "simd_shuffle_up", "simd_shuffle_down", "simd_shuffle_xor",
      "simd_shuffle_rotate_up", "simd_shuffle_rotate_down", "simd_shuffle_and_fill_up",
      "simd_shuffle_and_fill_down", "simd_broadcast", "simd_broadcast_first", "simd_ballot",
      "simd_all", "simd_any", "simd_is_first", "simd_active_threads_mask",
      "simdgroup_multiply_accumulate"};
  static const char* const quad[] = {
      "quad_sum", "quad_product", "quad_min", "quad_max", "quad_and", "quad_or", "quad_xor",
      "quad_prefix_inclusive_sum", "quad_prefix_exclusive_sum",
      "quad_prefix_inclusive_product", "quad_prefix_exclusive_product",
      "quad_shuffle", "quad_shuffle_up", "quad_shuffle_down", "quad_shuffle_xor",
      "quad_shuffle_rotate_up", "quad_shuffle_rotate_down", "quad_shuffle_and_fill_up",
      "quad_shuffle_and_fill_down", "quad_broadcast", "quad_broadcast_first", "quad_ballot",
      "quad_all", "quad_any", "quad_is_first", "quad_active_threads_mask", "?"};
  return width == 4 ? quad[op] : simd[op];
}

template <class T> struct elem_of { using type = T; };
template <class T, int N> struct elem_of<metal::vec<T, N>> { using type = T; };

// The operand types MSL's SIMD-group and quad-group functions accept: T is a scalar or vector
// of an integer or floating-point type (bool is not one); Ti, for the bitwise reductions
// (and / or / xor), a scalar or vector of an integer type. Anything else does not compile,
// as under Metal. (64-bit integers are accepted here.)
template <class T> constexpr bool simd_t_v =
    is_num_v<typename elem_of<T>::type> && !std::is_same<typename elem_of<T>::type, bool>::value;
template <class T> constexpr bool simd_ti_v = is_int_v<typename elem_of<T>::type>;
#define MT_SIMD_T(name)                                                                      \
  static_assert(mt::simd_t_v<T>, "no matching function for call to '" #name "': its "        \
                "operand must be a scalar or vector of an integer or floating-point type "   \
                "(not bool)")
#define MT_SIMD_TI(name)                                                                     \
  static_assert(mt::simd_ti_v<T>, "no matching function for call to '" #name "': a "         \
                "bitwise SIMD-group function takes a scalar or vector of an integer type, "  \
                "not a floating-point or bool type")

template <class T> inline T combine(int op, const T& a, const T& b) {
  using E = typename elem_of<T>::type;
  switch (op) {
    case OP_SUM: case OP_INC_SUM: case OP_EXC_SUM:
      return T(a + b);
    case OP_PRODUCT: case OP_INC_PRODUCT: case OP_EXC_PRODUCT:
      return T(a * b);
    case OP_MIN:
      return T(metal::min(a, b));
    case OP_MAX:
      return T(metal::max(a, b));
    default:
      // (and / or / xor: integer operands only; the functions refuse others at compile time)
      if constexpr (std::is_integral<E>::value) {
        if (op == OP_AND) return T(a & b);
        if (op == OP_OR) return T(a | b);
        return T(a ^ b);
      }
      return a;
  }
}

// Evaluate one collective over the active lanes (non-null entries of L).
template <class T> int resolve(mt_coll* const* L, char* err, size_t err_len) {
  int first = 0;
  while (!L[first]) ++first;
  const int op = L[first]->op;
  const int width = L[first]->width;
  auto in = [&](int i) -> const T& { return *static_cast<const T*>(L[i]->in); };
  auto in2 = [&](int i) -> const T& { return *static_cast<const T*>(L[i]->in2); };
  auto out = [&](int i) -> T& { return *static_cast<T*>(L[i]->out); };
  const bool strict = mt_strict() != 0;
  for (int g0 = 0; g0 < 32; g0 += width) {
    int lead = -1;
    for (int i = g0; i < g0 + width; ++i)
      if (L[i]) {
        lead = i;
        break;
      }
    if (lead < 0) continue;
    switch (op) {
      case OP_SUM: case OP_PRODUCT: case OP_MIN: case OP_MAX:
      case OP_AND: case OP_OR: case OP_XOR: {
        if constexpr (std::is_default_constructible<T>::value) {
          T val[32];
          bool has[32];
          for (int i = 0; i < width; ++i) {
            has[i] = L[g0 + i] != nullptr;
            if (has[i]) val[i] = in(g0 + i);
          }
          for (int s = 1; s < width; s *= 2)
            for (int i = 0; i + s < width; i += 2 * s)
              if (has[i + s]) {
                val[i] = has[i] ? combine(op, val[i], val[i + s]) : val[i + s];
                has[i] = true;
              }
          for (int i = g0; i < g0 + width; ++i)
            if (L[i]) out(i) = val[0];
        }
        break;
      }
      case OP_INC_SUM: case OP_EXC_SUM: case OP_INC_PRODUCT: case OP_EXC_PRODUCT: {
        if constexpr (std::is_constructible<T, int>::value) {
          const bool sum = op == OP_INC_SUM || op == OP_EXC_SUM;
          const bool inclusive = op == OP_INC_SUM || op == OP_INC_PRODUCT;
          T acc = T(sum ? 0 : 1);
          for (int i = g0; i < g0 + width; ++i) {
            if (!L[i]) continue;
            T next = combine(op, acc, in(i));
            out(i) = inclusive ? next : acc;
            acc = next;
          }
        }
        break;
      }
      case OP_BALLOT: case OP_ALL: case OP_ANY: case OP_IS_FIRST: case OP_ACTIVE: {
        unsigned long votes = 0, active = 0;
        for (int i = g0; i < g0 + width; ++i) {
          if (!L[i]) continue;
          active |= 1ul << (i - g0);
          if (op != OP_IS_FIRST && op != OP_ACTIVE && *static_cast<const bool*>(L[i]->in))
            votes |= 1ul << (i - g0);
        }
        for (int i = g0; i < g0 + width; ++i) {
          if (!L[i]) continue;
          unsigned long r = op == OP_BALLOT   ? votes
                            : op == OP_ACTIVE ? active
                            : op == OP_ALL    ? (votes == active)
                            : op == OP_ANY    ? (votes != 0)
                                              : (i == lead);
          if (op == OP_BALLOT || op == OP_ACTIVE) {
            if (width == 4) {
              unsigned short q = (unsigned short)r;
              std::memcpy(L[i]->out, &q, sizeof q);
            } else {
              std::memcpy(L[i]->out, &r, sizeof r);
            }
          } else {
            bool b = r != 0;
            std::memcpy(L[i]->out, &b, 1);
          }
        }
        break;
      }
      default: {  // data movement: copy the source lane's bytes
        for (int i = g0; i < g0 + width; ++i) {
          if (!L[i]) continue;
          const int li = i - g0;
          const int64_t a = L[i]->arg;
          int src = i;
          bool fill = false;
          switch (op) {
            case OP_SHUFFLE: case OP_BROADCAST: src = g0 + int(a); break;
            case OP_BROADCAST_FIRST: src = lead; break;
            case OP_XOR_SHUFFLE: src = g0 + (li ^ int(a)); break;
            case OP_UP: src = li >= a ? i - int(a) : i; break;
            case OP_DOWN: src = li + a < width ? i + int(a) : i; break;
            case OP_ROTATE_UP: src = g0 + int((li - a + width * 64) % width); break;
            case OP_ROTATE_DOWN: src = g0 + int((li + a) % width); break;
            case OP_FILL_UP:
              if (li >= a) src = i - int(a);
              else { src = i + width - int(a); fill = true; }
              break;
            case OP_FILL_DOWN:
              if (li + a < width) src = i + int(a);
              else { src = i + int(a) - width; fill = true; }
              break;
            default: break;
          }
          if (!L[src]) {
            if (strict) {
              snprintf(err, err_len,
                       "%s: lane %d reads lane %d, which is not active at this call (strict "
                       "mode; Metal leaves the result undefined)",
                       op_name(op, width), li, src - g0);
              return i;
            }
            std::memset(L[i]->out, 0xFF, sizeof(T));  // undefined on a GPU: poison
            continue;
          }
          std::memcpy(L[i]->out, fill ? &in2(src) : &in(src), sizeof(T));
        }
        break;
      }
    }
  }
  return -1;
}

// `how`: resolve<T>, or resolve_converged<T> below for the converged helpers.
template <class T>
MT_AI T collective(const std::source_location& loc, int op, int width, const T& x,
                   int64_t arg = 0, const T* x2 = nullptr, mt_resolve_fn how = &resolve<T>) {
  T result;
  mt_coll c;
  c.op = op;
  c.width = width;
  c.arg = arg;
  c.in = &x;
  c.in2 = x2;
  c.in3 = nullptr;
  c.out = &result;
  c.resolve = how;
  c.site = site_of(loc);
  mt_collective(&c);
  return result;
}

// A collective whose caller promises every lane of the SIMD-group active (common.h's
// converged helpers): a hazard naming the first missing lane, else resolve<T>'s result.
inline const char* converged_name(int op) {
  return op == OP_SUM           ? "mt_sum_converged"
         : op == OP_MAX         ? "mt_max_converged"
         : op == OP_MIN         ? "mt_min_converged"
         : op == OP_XOR_SHUFFLE ? "mt_shuffle_xor_converged"
                                : "mt_shuffle_converged";
}

template <class T> int resolve_converged(mt_coll* const* L, char* err, size_t err_len) {
  for (int l = 0; l < 32; ++l) {
    if (!L[l]) {
      int lead = 0;
      while (!L[lead]) ++lead;
      snprintf(err, err_len,
               "%s: lane %d is not active at this call; the converged helpers promise all "
               "32 lanes of the SIMD-group",
               converged_name(L[lead]->op), l);
      return lead + 256 * MT_HZ_SIMD_LANE;
    }
  }
  return resolve<T>(L, err, err_len);
}

template <class T>
MT_AI T converged(const std::source_location& loc, int op, const T& x, int64_t arg) {
  return collective<T>(loc, op, 32, x, arg, nullptr, &resolve_converged<T>);
}

template <class R> MT_AI R vote(const std::source_location& loc, int op, int width, bool x) {
  R result{};
  bool in = x;
  mt_coll c;
  c.op = op;
  c.width = width;
  c.arg = 0;
  c.in = &in;
  c.in2 = nullptr;
  c.in3 = nullptr;
  c.out = &result;
  c.resolve = &resolve<bool>;
  c.site = site_of(loc);
  mt_collective(&c);
  return result;
}

// Lane arguments must name a lane of the SIMD-group (quad).
MT_AI void check_lane_arg(int op, int width, long value, const char* what) {
  if (value < 0 || value >= width) {
    static thread_local char msg[200];
    snprintf(msg, sizeof msg, "%s: %s %ld is outside the %s (0..%d)", op_name(op, width), what,
             value, width == 4 ? "quad-group" : "SIMD-group", width - 1);
    mt_hazard(MT_HZ_SIMD_LANE, msg);
  }
}

}  // namespace mt

namespace metal {

#define MT_SIMD_REDUCE(prefix, width, name, OP)                                              \
  template <class T> MT_AI T prefix##name(T x, MT_LOC) {                                    \
    MT_SIMD_T(prefix##name);                                                                 \
    return mt::collective(mt_loc, mt::OP, width, x);                                         \
  }
#define MT_SIMD_FAMILY(prefix, width)                                                        \
  MT_SIMD_REDUCE(prefix, width, sum, OP_SUM)                                                 \
  MT_SIMD_REDUCE(prefix, width, product, OP_PRODUCT)                                         \
  MT_SIMD_REDUCE(prefix, width, min, OP_MIN)                                                 \
  MT_SIMD_REDUCE(prefix, width, max, OP_MAX)                                                 \
  MT_SIMD_REDUCE(prefix, width, prefix_inclusive_sum, OP_INC_SUM)                            \
  MT_SIMD_REDUCE(prefix, width, prefix_exclusive_sum, OP_EXC_SUM)                            \
  MT_SIMD_REDUCE(prefix, width, prefix_inclusive_product, OP_INC_PRODUCT)                    \
  MT_SIMD_REDUCE(prefix, width, prefix_exclusive_product, OP_EXC_PRODUCT)                    \
  MT_SIMD_REDUCE(prefix, width, broadcast_first, OP_BROADCAST_FIRST)                         \
  template <class T> MT_AI T prefix##shuffle(T x, ushort lane, MT_LOC) {                              \
    MT_SIMD_T(prefix##shuffle);                                                              \
    mt::check_lane_arg(mt::OP_SHUFFLE, width, lane, "lane");                                 \
    return mt::collective(mt_loc, mt::OP_SHUFFLE, width, x, lane);                                   \
  }                                                                                          \
  template <class T> MT_AI T prefix##broadcast(T x, ushort lane, MT_LOC) {                            \
    MT_SIMD_T(prefix##broadcast);                                                            \
    mt::check_lane_arg(mt::OP_BROADCAST, width, lane, "lane");                               \
    return mt::collective(mt_loc, mt::OP_BROADCAST, width, x, lane);                                 \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_xor(T x, ushort mask, MT_LOC) {                          \
    MT_SIMD_T(prefix##shuffle_xor);                                                          \
    mt::check_lane_arg(mt::OP_XOR_SHUFFLE, width, mask, "mask");                             \
    return mt::collective(mt_loc, mt::OP_XOR_SHUFFLE, width, x, mask);                               \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_up(T x, ushort delta, MT_LOC) {                          \
    MT_SIMD_T(prefix##shuffle_up);                                                           \
    mt::check_lane_arg(mt::OP_UP, width, delta, "delta");                                    \
    return mt::collective(mt_loc, mt::OP_UP, width, x, delta);                                       \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_down(T x, ushort delta, MT_LOC) {                        \
    MT_SIMD_T(prefix##shuffle_down);                                                         \
    mt::check_lane_arg(mt::OP_DOWN, width, delta, "delta");                                  \
    return mt::collective(mt_loc, mt::OP_DOWN, width, x, delta);                                     \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_rotate_up(T x, ushort delta, MT_LOC) {                   \
    MT_SIMD_T(prefix##shuffle_rotate_up);                                                    \
    mt::check_lane_arg(mt::OP_ROTATE_UP, width, delta, "delta");                             \
    return mt::collective(mt_loc, mt::OP_ROTATE_UP, width, x, delta);                                \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_rotate_down(T x, ushort delta, MT_LOC) {                 \
    MT_SIMD_T(prefix##shuffle_rotate_down);                                                  \
    mt::check_lane_arg(mt::OP_ROTATE_DOWN, width, delta, "delta");                           \
    return mt::collective(mt_loc, mt::OP_ROTATE_DOWN, width, x, delta);                              \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_and_fill_up(T x, T fill, ushort delta, MT_LOC) {         \
    MT_SIMD_T(prefix##shuffle_and_fill_up);                                                  \
    mt::check_lane_arg(mt::OP_FILL_UP, width, delta, "delta");                               \
    return mt::collective(mt_loc, mt::OP_FILL_UP, width, x, delta, &fill);                           \
  }                                                                                          \
  template <class T> MT_AI T prefix##shuffle_and_fill_down(T x, T fill, ushort delta, MT_LOC) {       \
    MT_SIMD_T(prefix##shuffle_and_fill_down);                                                \
    mt::check_lane_arg(mt::OP_FILL_DOWN, width, delta, "delta");                             \
    return mt::collective(mt_loc, mt::OP_FILL_DOWN, width, x, delta, &fill);                         \
  }                                                                                          \
  template <class T>                                                                         \
  MT_AI T prefix##shuffle_and_fill_up(T x, T fill, ushort delta, ushort modulo, MT_LOC) {            \
    MT_SIMD_T(prefix##shuffle_and_fill_up);                                                  \
    if (modulo == 0 || modulo > width || (modulo & (modulo - 1)))                            \
      mt::check_lane_arg(mt::OP_FILL_UP, 0, modulo, "modulo");                               \
    mt::check_lane_arg(mt::OP_FILL_UP, modulo, delta, "delta");                              \
    return mt::collective(mt_loc, mt::OP_FILL_UP, modulo, x, delta, &fill);                          \
  }                                                                                          \
  template <class T>                                                                         \
  MT_AI T prefix##shuffle_and_fill_down(T x, T fill, ushort delta, ushort modulo, MT_LOC) {          \
    MT_SIMD_T(prefix##shuffle_and_fill_down);                                                \
    if (modulo == 0 || modulo > width || (modulo & (modulo - 1)))                            \
      mt::check_lane_arg(mt::OP_FILL_DOWN, 0, modulo, "modulo");                             \
    mt::check_lane_arg(mt::OP_FILL_DOWN, modulo, delta, "delta");                            \
    return mt::collective(mt_loc, mt::OP_FILL_DOWN, modulo, x, delta, &fill);                        \
  }                                                                                          \
  MT_AI bool prefix##all(bool x, MT_LOC) { return mt::vote<bool>(mt_loc, mt::OP_ALL, width, x); } \
  MT_AI bool prefix##any(bool x, MT_LOC) { return mt::vote<bool>(mt_loc, mt::OP_ANY, width, x); } \
  MT_AI bool prefix##is_first(MT_LOC) {                                                      \
    return mt::vote<bool>(mt_loc, mt::OP_IS_FIRST, width, true);                             \
  }                                                                                          \
  MT_AI bool prefix##is_helper_thread() { return false; }

MT_SIMD_FAMILY(simd_, 32)
MT_SIMD_FAMILY(quad_, 4)
// (and / or / xor are alternative tokens: these cannot be pasted by the macro)
template <class T> MT_AI T simd_and(T x, MT_LOC) {
  MT_SIMD_TI(simd_and);
  return mt::collective(mt_loc, mt::OP_AND, 32, x);
}
template <class T> MT_AI T simd_or(T x, MT_LOC) {
  MT_SIMD_TI(simd_or);
  return mt::collective(mt_loc, mt::OP_OR, 32, x);
}
template <class T> MT_AI T simd_xor(T x, MT_LOC) {
  MT_SIMD_TI(simd_xor);
  return mt::collective(mt_loc, mt::OP_XOR, 32, x);
}
template <class T> MT_AI T quad_and(T x, MT_LOC) {
  MT_SIMD_TI(quad_and);
  return mt::collective(mt_loc, mt::OP_AND, 4, x);
}
template <class T> MT_AI T quad_or(T x, MT_LOC) {
  MT_SIMD_TI(quad_or);
  return mt::collective(mt_loc, mt::OP_OR, 4, x);
}
template <class T> MT_AI T quad_xor(T x, MT_LOC) {
  MT_SIMD_TI(quad_xor);
  return mt::collective(mt_loc, mt::OP_XOR, 4, x);
}
// common.h's converged helpers (MT_SIMD_HELPERS): simd_shuffle, simd_shuffle_xor, simd_sum,
// simd_max and simd_min whose caller promises all 32 lanes of its SIMD-group active at the
// call. The promise is checked at every call: a lane that is not there (returned, elsewhere,
// or past a partial SIMD-group) is a hazard, where the simd_ function would have taken the
// active lanes.
#define MT_SIMD_HELPERS 1
template <class T> MT_AI T mt_shuffle_converged(T x, ushort lane, MT_LOC) {
  MT_SIMD_T(mt_shuffle_converged);
  mt::check_lane_arg(mt::OP_SHUFFLE, 32, lane, "lane");
  return mt::converged(mt_loc, mt::OP_SHUFFLE, x, lane);
}
template <class T> MT_AI T mt_shuffle_xor_converged(T x, ushort mask, MT_LOC) {
  MT_SIMD_T(mt_shuffle_xor_converged);
  mt::check_lane_arg(mt::OP_XOR_SHUFFLE, 32, mask, "mask");
  return mt::converged(mt_loc, mt::OP_XOR_SHUFFLE, x, mask);
}
template <class T> MT_AI T mt_sum_converged(T x, MT_LOC) {
  MT_SIMD_T(mt_sum_converged);
  return mt::converged(mt_loc, mt::OP_SUM, x, 0);
}
template <class T> MT_AI T mt_max_converged(T x, MT_LOC) {
  MT_SIMD_T(mt_max_converged);
  return mt::converged(mt_loc, mt::OP_MAX, x, 0);
}
template <class T> MT_AI T mt_min_converged(T x, MT_LOC) {
  MT_SIMD_T(mt_min_converged);
  return mt::converged(mt_loc, mt::OP_MIN, x, 0);
}
#undef MT_SIMD_FAMILY
#undef MT_SIMD_REDUCE
#undef MT_SIMD_T
#undef MT_SIMD_TI

MT_AI simd_vote simd_ballot(bool x, MT_LOC) {
  return simd_vote(mt::vote<unsigned long>(mt_loc, mt::OP_BALLOT, 32, x));
}
MT_AI simd_vote simd_active_threads_mask(MT_LOC) {
  return simd_vote(mt::vote<unsigned long>(mt_loc, mt::OP_ACTIVE, 32, true));
}
MT_AI quad_vote quad_ballot(bool x, MT_LOC) {
  return quad_vote(mt::vote<unsigned short>(mt_loc, mt::OP_BALLOT, 4, x));
}
MT_AI quad_vote quad_active_threads_mask(MT_LOC) {
  return quad_vote(mt::vote<unsigned short>(mt_loc, mt::OP_ACTIVE, 4, true));
}

}  // namespace metal
