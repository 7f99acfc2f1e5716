#pragma once
// The per-run passes of a NIXL plan (kvlayout/transfer/nixl/plans.py), one pass each over a
// map's (N, 3) runs where numpy took several over strided columns:
//   - check_runs: the first run with no bytes, or running past the end of the address
//     space on either side;
//   - stretches: the runs in one side's address order cut into *stretches* (runs back to
//     back on that side, within one of its memory intervals), each run given the next
//     bytes of a staging buffer laid out stretch after stretch: the staged plan's
//     descriptors (one per stretch) and its local copy (one per run).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "block_map.h"
#include "stream_copy.h"

namespace kvlayout::staging {

enum class RunProblem : int { kNone = 0, kEmpty = 1, kSrcWraps = 2, kDstWraps = 3 };

struct RunCheck {
  RunProblem problem = RunProblem::kNone;
  std::int64_t run = -1;
};

inline RunCheck check_runs(const ByteRun* runs, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const ByteRun& r = runs[i];
    const auto at = static_cast<std::int64_t>(i);
    if (r.len == 0) return {RunProblem::kEmpty, at};
    if (r.src + r.len < r.src) return {RunProblem::kSrcWraps, at};
    if (r.dst + r.len < r.dst) return {RunProblem::kDstWraps, at};
  }
  return {};
}

// A side's memory as spans of one block each (the native engine's form of the sorted,
// disjoint intervals [starts[k], ends[k]); empty ones hold nothing and are left out).
inline std::vector<block_map::Span> interval_spans(const std::uint64_t* starts, const std::uint64_t* ends,
                                                   std::size_t n) {
  std::vector<block_map::Span> out;
  for (std::size_t k = 0; k < n; ++k)
    if (ends[k] > starts[k]) out.push_back({starts[k], ends[k] - starts[k], ends[k] - starts[k], 1});
  return out;
}

// The first of n rows [addr[i * as], + len[i * ls]) inside none of `intervals`, or -1.
inline std::int64_t first_outside(const std::uint64_t* addr, std::ptrdiff_t as, const std::uint64_t* len,
                                  std::ptrdiff_t ls, std::size_t n, const std::vector<block_map::Span>& intervals) {
  std::size_t hint = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::ptrdiff_t>(i);
    if (!block_map::detail::inside(intervals, addr[k * as], len[k * ls], hint)) return k;
  }
  return -1;
}

// The address of run i on side `col` (0 source, 1 destination), and on the other side.
inline std::uint64_t on(const ByteRun& r, int col) { return col == 0 ? r.src : r.dst; }
inline std::uint64_t off(const ByteRun& r, int col) { return col == 0 ? r.dst : r.src; }

// Whether the runs' addresses on side `col` never decrease (then the address order is the
// runs' own, and no sort is needed).
inline bool sorted_on(const ByteRun* runs, std::size_t n, int col) {
  for (std::size_t i = 1; i < n; ++i)
    if (on(runs[i], col) < on(runs[i - 1], col)) return false;
  return true;
}

// Whether the runs on side `col` are disjoint and in ascending address order (each ends
// at or before the next starts): what a map's destinations are, checked in one pass.
inline bool disjoint_on(const ByteRun* runs, std::size_t n, int col) {
  for (std::size_t i = 1; i < n; ++i)
    if (on(runs[i], col) < on(runs[i - 1], col) + runs[i - 1].len) return false;
  return true;
}

// Calls visit(i) for each run i by address on side `col`, ties in run order (what a
// stable sort gives). Each address less the bits all runs share at the bottom (alignment)
// and the top (one process's addresses lie close) packs with its run's position into one
// word, so that an LSD radix sort of the words, 11 bits a pass over the address bits, is
// stable by construction: a map's half a million runs are two passes. Where the two do
// not fit one word (spans past 2^(64 - position bits) alignment units: 2^44 for a million
// runs), a stable comparison sort. Each calling thread keeps its two scratch buffers (16
// bytes a run of its largest call): fresh 4 MB buffers cost more in page faults than a pass.
inline std::vector<std::uint64_t>& sort_scratch(int which) {
  thread_local std::vector<std::uint64_t> buffers[2];  // one pair per thread, whatever the visitor
  return buffers[which];
}

template <class Visit>
void in_address_order(const ByteRun* runs, std::size_t n, int col, Visit visit) {
  if (sorted_on(runs, n, col)) {
    for (std::size_t i = 0; i < n; ++i) visit(i);
    return;
  }
  std::uint64_t low = ~std::uint64_t{0}, high = 0, differ = 0;
  const std::uint64_t first = on(runs[0], col);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t a = on(runs[i], col);
    low = std::min(low, a), high = std::max(high, a), differ |= a ^ first;
  }
  const int shift = differ ? __builtin_ctzll(differ) : 0;
  const int bits = 64 - __builtin_clzll(((high - low) >> shift) | 1);
  const int index_bits = 64 - __builtin_clzll(static_cast<std::uint64_t>(n - 1) | 1);
  std::vector<std::uint64_t>& words = sort_scratch(0);
  std::vector<std::uint64_t>& spare = sort_scratch(1);
  words.resize(n), spare.resize(n);
  if (bits + index_bits > 64) {
    for (std::size_t i = 0; i < n; ++i) words[i] = i;
    std::stable_sort(words.begin(), words.end(),
                     [&](std::uint64_t a, std::uint64_t b) { return on(runs[a], col) < on(runs[b], col); });
    for (std::size_t i = 0; i < n; ++i) visit(static_cast<std::size_t>(words[i]));
    return;
  }
  for (std::size_t i = 0; i < n; ++i) words[i] = ((on(runs[i], col) - low) >> shift) << index_bits | i;
  constexpr int kDigit = 11;
  constexpr std::uint64_t kMask = (std::uint64_t{1} << kDigit) - 1;
  std::vector<std::size_t> count(kMask + 1);
  for (int at = index_bits; differ != 0 && at < index_bits + bits; at += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (std::size_t i = 0; i < n; ++i) ++count[(words[i] >> at) & kMask];
    std::size_t sum = 0;
    for (std::size_t& c : count) sum += std::exchange(c, sum);
    for (std::size_t i = 0; i < n; ++i) spare[count[(words[i] >> at) & kMask]++] = words[i];
    words.swap(spare);
  }
  const std::uint64_t index = (std::uint64_t{1} << index_bits) - 1;
  for (std::size_t i = 0; i < n; ++i) visit(static_cast<std::size_t>(words[i] & index));
}

// The positions of the runs by address on side `col` (in_address_order).
inline std::vector<std::int64_t> address_order(const ByteRun* runs, std::size_t n, int col) {
  std::vector<std::int64_t> order(n);
  std::int64_t* out = order.data();
  in_address_order(runs, n, col, [&](std::size_t i) { *out++ = static_cast<std::int64_t>(i); });
  return order;
}

// Whether a run at `next` of `len` bytes extends the stretch at [at, at + bytes): it
// starts where the stretch ends and the two lie inside one interval. A stretch ends where
// the next run would take it from one interval into the next (two tensors that touch:
// vLLM's layers, one after another in one allocation), so it is one descriptor inside one
// registered region, and the runs on each side of the boundary still go as stretches.
inline bool extends(const std::vector<block_map::Span>& intervals, std::uint64_t at, std::uint64_t bytes,
                    std::uint64_t next, std::uint64_t len, std::size_t& hint) {
  return next == at + bytes && block_map::detail::inside(intervals, at, bytes + len, hint);
}

// What the staged layout holds per stretch.
struct Stretches {
  std::vector<std::int64_t> first;       // its first run, as a position in the address order
  std::vector<std::uint64_t> at;         // its address on side `col`
  std::vector<std::uint64_t> staged_at;  // its address in the staging buffer
  std::vector<std::uint64_t> bytes;
};

// Copies of the staged layout, per run in address order: none, (other side, staging)
// (a gather before a WRITE) or (staging, other side) (a scatter after a READ).
enum class Copies : int { kNone = 0, kToStaging = 1, kFromStaging = 2 };

// `order` (n positions, or null for the runs' own order) lists the runs by address on
// side `col`; `intervals` are that side's memory (sorted, disjoint). A stretch never
// crosses from one interval into the next (extends). `copies_out` (n rows, or null) gets
// the copies.
inline Stretches stretches(const ByteRun* runs, std::size_t n, const std::int64_t* order, int col,
                           const std::vector<block_map::Span>& intervals, std::uint64_t base, Copies copies,
                           ByteRun* copies_out) {
  Stretches out;
  const auto run = [&](std::size_t k) -> const ByteRun& { return runs[order ? order[k] : k]; };
  std::size_t hint = 0;
  std::uint64_t offset = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const ByteRun& r = run(k);
    if (copies_out != nullptr) {
      copies_out[k] = copies == Copies::kToStaging ? ByteRun{off(r, col), base + offset, r.len}
                                                   : ByteRun{base + offset, off(r, col), r.len};
    }
    if (k > 0 && extends(intervals, out.at.back(), out.bytes.back(), on(r, col), r.len, hint)) {
      out.bytes.back() += r.len;
    } else {
      out.first.push_back(static_cast<std::int64_t>(k));
      out.at.push_back(on(r, col));
      out.staged_at.push_back(base + offset);
      out.bytes.push_back(r.len);
    }
    offset += r.len;
  }
  return out;
}

// How many stretches stretches() cuts the runs into, in address order on side `col`,
// without laying them out or listing the order: what pricing a staged layout needs.
inline std::size_t stretch_count(const ByteRun* runs, std::size_t n, int col,
                                 const std::vector<block_map::Span>& intervals) {
  std::size_t count = 0, hint = 0;
  std::uint64_t at = 0, bytes = 0;
  in_address_order(runs, n, col, [&](std::size_t i) {
    const ByteRun& r = runs[i];
    if (count != 0 && extends(intervals, at, bytes, on(r, col), r.len, hint)) {
      bytes += r.len;
      return;
    }
    ++count, at = on(r, col), bytes = r.len;
  });
  return count;
}

}  // namespace kvlayout::staging
