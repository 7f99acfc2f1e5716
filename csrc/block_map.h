#pragma once
// Block maps: a request's KV moved between two registrations as byte runs.
//
// Python (kvlayout/transfer/block_maps.py) asks the layout algebra where every byte of both sides
// lives and hands over *slabs*: one per (layer, K/V, piece of a head's row) both sides
// hold, each with its base address on either side, the tensors it lies in, its width
// and its per-head and per-token strides. This file
//   - builds the runs (build_runs): walks the destination in memory order (the nest of
//     slab, block, slot and head levels that Python orders by the destination's strides,
//     blocks in id order), folds the innermost levels that are contiguous on both sides
//     into one emission, and merges each emission into the previous run when both sides
//     continue it, within one tensor on each side. Emitted in destination order, that
//     merge leaves the fewest runs; when the walk turns out not to be in destination
//     order (a layout whose levels interleave), the runs are sorted and merged again;
//   - validates runs against the tensors' byte spans before a byte moves (validate_runs);
//   - copies them on the worker pool, split by bytes, with the GIL released (copy_runs).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "stream_copy.h"
#include "worker_pool.h"

// ByteRun and copy_byte_runs: the streaming, prefetching run copy of the CPU engine.

namespace kvlayout::block_map {

enum Level : int { kSlab = 0, kBlock = 1, kSlot = 2, kHead = 3 };

// One slab, all in bytes. `tail` is how many of the innermost nest levels (slot, head)
// are contiguous on both sides for this slab and so fold into one emission.
struct Slab {
  std::uint64_t src_base, dst_base;
  std::uint64_t src_tensor, dst_tensor;
  std::uint64_t width;
  std::uint64_t src_head_stride, dst_head_stride;
  std::uint64_t src_class, dst_class;  // index of the slab's (block, slot) strides
  std::uint64_t tail;
};
static_assert(sizeof(Slab) == 10 * sizeof(std::uint64_t), "Slab is the (S, 10) uint64 array's row");

struct Strides {
  std::uint64_t block, slot;
};

struct Request {
  const Slab* slabs;
  const std::int64_t* group_starts;  // slabs [group_starts[g], group_starts[g + 1]) share a destination tensor
  std::int64_t num_groups;
  int order[4];  // the nest, outermost first
  std::int64_t heads, tokens;
  const std::int64_t* src_blocks;
  std::int64_t src_block_size;
  const std::int64_t* dst_blocks;
  std::int64_t dst_block_size;
  const Strides* src_classes;
  std::int64_t num_src_classes;
  const Strides* dst_classes;
  std::int64_t num_dst_classes;
};

struct Built {
  std::vector<ByteRun> runs;
  bool walked_in_order = true;  // false: the walk was not in destination order, so runs were sorted
};

namespace detail {

// Merges each emission into the current run where both sides continue it in the same
// tensors; the current run is kept apart from the output so the hot path stays in registers.
template <bool kTrackTensors>
struct Sink {
  std::vector<ByteRun> runs;
  std::vector<std::uint64_t> src_tensor, dst_tensor;  // kept only for the sorting pass
  std::uint64_t src = 0, dst = 0, len = 0;              // the current run (len 0: none yet)
  std::uint64_t cur_src_tensor = 0, cur_dst_tensor = 0;
  std::int64_t cur_group = -1;
  bool in_order = true;

  void emit(std::uint64_t s, std::uint64_t d, std::uint64_t n, const Slab& slab, std::int64_t group) {
    if (len != 0) {
      if (d == dst + len && s == src + len && slab.dst_tensor == cur_dst_tensor && slab.src_tensor == cur_src_tensor) {
        len += n;
        return;
      }
      if (group == cur_group && d < dst + len) in_order = false;
      flush();
    }
    src = s, dst = d, len = n;
    cur_src_tensor = slab.src_tensor, cur_dst_tensor = slab.dst_tensor, cur_group = group;
  }
  void flush() {
    runs.push_back(ByteRun{src, dst, len});
    if constexpr (kTrackTensors) {
      src_tensor.push_back(cur_src_tensor);
      dst_tensor.push_back(cur_dst_tensor);
    }
  }
  void finish() {
    if (len != 0) flush();
    len = 0;
  }
};

template <bool kTrackTensors>
class Walker {
 public:
  Walker(const Request& q, const std::vector<std::int64_t>& positions, const std::vector<std::uint64_t>& src_tok,
         const std::vector<std::uint64_t>& dst_tok, Sink<kTrackTensors>& sink)
      : q_(q), positions_(positions), src_tok_(src_tok), dst_tok_(dst_tok), sink_(sink) {
    // The first source block boundary after each destination block's first token: a
    // division per block here, none per emission.
    boundary_.resize(positions.size());
    for (std::size_t pos = 0; pos < positions.size(); ++pos) {
      const std::int64_t first = static_cast<std::int64_t>(pos) * q.dst_block_size;
      boundary_[pos] = (first / q.src_block_size + 1) * q.src_block_size;
    }
  }

  void run() {
    for (std::int64_t g = 0; g < q_.num_groups; ++g) {
      group_ = g;
      slab_ = &q_.slabs[q_.group_starts[g]];  // a nest whose slab level is inner sets it again
      level(0);
    }
  }

 private:
  std::uint64_t src_at(std::int64_t p, std::int64_t h) const {
    return slab_->src_base + src_tok_[slab_->src_class * q_.tokens + p] + h * slab_->src_head_stride;
  }
  std::uint64_t dst_at(std::int64_t p, std::int64_t h) const {
    return slab_->dst_base + dst_tok_[slab_->dst_class * q_.tokens + p] + h * slab_->dst_head_stride;
  }
  std::int64_t slots() const { return std::min(q_.dst_block_size, q_.tokens - position_ * q_.dst_block_size); }

  // Levels d..3 fold into emissions: the slot level (if folded) by segments of tokens that
  // stay in one source block, the head level (if folded) whole. A head level folded over
  // an innermost slot level (tail 2, heads outside tokens on both sides) folds only for a
  // full destination block, whose one segment is a whole block on both sides.
  void folded(int d) {
    bool slot = false, head = false;
    for (int k = d; k < 4; ++k) {
      slot |= q_.order[k] == kSlot;
      head |= q_.order[k] == kHead;
    }
    if (slot && head && q_.order[3] == kSlot && slots() != q_.dst_block_size) {
      for (std::int64_t h = 0; h < q_.heads; ++h) segments(h, slab_->width);
      return;
    }
    const std::int64_t h = head ? 0 : head_;
    const std::uint64_t unit = slab_->width * (head ? q_.heads : 1);
    if (!slot) {
      sink_.emit(src_at(token_, h), dst_at(token_, h), unit, *slab_, group_);
      return;
    }
    segments(h, unit);
  }

  void segments(std::int64_t h, std::uint64_t unit) {
    const std::int64_t first = position_ * q_.dst_block_size, end = first + slots();
    std::int64_t stop = std::min(end, boundary_[position_]);
    for (std::int64_t p = first; p < end; stop = std::min(end, stop + q_.src_block_size)) {
      sink_.emit(src_at(p, h), dst_at(p, h), unit * static_cast<std::uint64_t>(stop - p), *slab_, group_);
      p = stop;
    }
  }

  void level(int d) {
    if (d == 4) {
      sink_.emit(src_at(token_, head_), dst_at(token_, head_), slab_->width, *slab_, group_);
      return;
    }
    if (slab_set_ && d >= 4 - static_cast<int>(slab_->tail)) return folded(d);
    switch (q_.order[d]) {
      case kSlab: {
        const std::int64_t lo = q_.group_starts[group_], hi = q_.group_starts[group_ + 1];
        for (std::int64_t s = lo; s < hi; ++s) {
          slab_ = &q_.slabs[s];
          slab_set_ = true;
          level(d + 1);
        }
        slab_set_ = false;
        return;
      }
      case kBlock:
        for (const std::int64_t pos : positions_) {
          position_ = pos;
          level(d + 1);
        }
        return;
      case kSlot: {
        const std::int64_t first = position_ * q_.dst_block_size, n = slots();
        const bool head_folded = d == 2 && q_.order[3] == kHead && slab_set_ && slab_->tail >= 1;
        if (d == 3 || head_folded) {  // innermost (or only a folded head inside): no call per slot
          const std::int64_t h = head_folded ? 0 : head_;
          const std::uint64_t unit = slab_->width * (head_folded ? q_.heads : 1);
          for (std::int64_t p = first; p < first + n; ++p) sink_.emit(src_at(p, h), dst_at(p, h), unit, *slab_, group_);
          return;
        }
        for (std::int64_t p = first; p < first + n; ++p) {
          token_ = p;
          level(d + 1);
        }
        return;
      }
      default: {  // kHead
        if (d == 3) {
          for (std::int64_t h = 0; h < q_.heads; ++h)
            sink_.emit(src_at(token_, h), dst_at(token_, h), slab_->width, *slab_, group_);
          return;
        }
        for (std::int64_t h = 0; h < q_.heads; ++h) {
          head_ = h;
          level(d + 1);
        }
        return;
      }
    }
  }

  const Request& q_;
  const std::vector<std::int64_t>& positions_;
  const std::vector<std::uint64_t>& src_tok_;
  const std::vector<std::uint64_t>& dst_tok_;
  Sink<kTrackTensors>& sink_;
  std::vector<std::int64_t> boundary_;  // by destination block position
  const Slab* slab_ = nullptr;
  bool slab_set_ = false;
  std::int64_t group_ = 0, position_ = 0, token_ = 0, head_ = 0;
};

// (block, slot) offsets of every token of the request on one side, per stride class.
inline std::vector<std::uint64_t> token_offsets(const std::int64_t* blocks, std::int64_t block_size,
                                                const Strides* classes, std::int64_t num_classes, std::int64_t tokens) {
  std::vector<std::uint64_t> out(static_cast<std::size_t>(num_classes * tokens));
  for (std::int64_t c = 0; c < num_classes; ++c) {
    std::uint64_t* row = out.data() + c * tokens;
    for (std::int64_t p = 0, b = 0; p < tokens; p += block_size, ++b) {
      const std::uint64_t base = static_cast<std::uint64_t>(blocks[b]) * classes[c].block;
      const std::int64_t n = std::min(block_size, tokens - p);
      for (std::int64_t j = 0; j < n; ++j) row[p + j] = base + static_cast<std::uint64_t>(j) * classes[c].slot;
    }
  }
  return out;
}

// At most how many emissions a walk makes (what the output reserves: a run per emission
// at worst, and growing a large vector costs a copy of it).
inline std::size_t emissions_bound(const Request& q) {
  const std::int64_t segments = (q.tokens + q.src_block_size - 1) / q.src_block_size +
                                (q.tokens + q.dst_block_size - 1) / q.dst_block_size;
  std::int64_t total = 0;
  const std::int64_t slabs = q.group_starts[q.num_groups];
  for (std::int64_t s = 0; s < slabs; ++s) {
    const std::uint64_t tail = q.slabs[s].tail;
    const bool slot_folded = (tail >= 1 && q.order[3] == kSlot) || (tail >= 2 && q.order[2] == kSlot);
    const bool head_folded = (tail >= 1 && q.order[3] == kHead) || (tail >= 2 && q.order[2] == kHead);
    total += (slot_folded ? std::min(segments, q.tokens) : q.tokens) * (head_folded ? 1 : q.heads);
  }
  return static_cast<std::size_t>(total);
}

}  // namespace detail

inline constexpr std::size_t kScratchBytes = std::size_t{1} << 20;  // walks up to this size use the scratch

// The runs of one request. `force_sort` takes the sorting path even when the walk is in
// destination order (tests hold both paths to the same answer).
inline Built build_runs(const Request& q, bool force_sort = false) {
  Built out;
  if (q.tokens <= 0 || q.heads <= 0 || q.num_groups <= 0) return out;
  const std::int64_t dst_positions = (q.tokens + q.dst_block_size - 1) / q.dst_block_size;
  std::vector<std::int64_t> positions(static_cast<std::size_t>(dst_positions));
  std::iota(positions.begin(), positions.end(), 0);
  std::stable_sort(positions.begin(), positions.end(),
                   [&](std::int64_t a, std::int64_t b) { return q.dst_blocks[a] < q.dst_blocks[b]; });
  const auto src_tok =
      detail::token_offsets(q.src_blocks, q.src_block_size, q.src_classes, q.num_src_classes, q.tokens);
  const auto dst_tok =
      detail::token_offsets(q.dst_blocks, q.dst_block_size, q.dst_classes, q.num_dst_classes, q.tokens);
  if (!force_sort) {
    // A small map's walk writes into a buffer this thread keeps between calls (a fresh
    // allocation of a few hundred KiB is a fresh mapping whose page faults cost more than
    // the walk) and the map gets an exact copy; a large one is written in place (copying
    // it would double the memory traffic, which is what bounds a large walk).
    thread_local std::vector<ByteRun> scratch;
    const std::size_t bound = detail::emissions_bound(q);
    const bool small = bound * sizeof(ByteRun) <= kScratchBytes;
    detail::Sink<false> sink;
    if (small) sink.runs.swap(scratch);
    sink.runs.clear();
    sink.runs.reserve(bound);
    detail::Walker<false>(q, positions, src_tok, dst_tok, sink).run();
    sink.finish();
    const bool in_order = sink.in_order;
    if (small) {
      if (in_order) out.runs.assign(sink.runs.begin(), sink.runs.end());
      scratch.swap(sink.runs);
    } else if (in_order) {
      if (sink.runs.capacity() > 2 * sink.runs.size() + 4096) sink.runs.shrink_to_fit();  // merges left it sparse
      out.runs = std::move(sink.runs);
    }
    if (in_order) return out;
  }
  // The sorting path: the same walk, its runs sorted by destination and merged again.
  detail::Sink<true> sink;
  detail::Walker<true>(q, positions, src_tok, dst_tok, sink).run();
  sink.finish();
  std::vector<std::size_t> idx(sink.runs.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return sink.runs[a].dst < sink.runs[b].dst; });
  out.walked_in_order = false;
  out.runs.reserve(idx.size());
  std::size_t last = 0;
  for (std::size_t k = 0; k < idx.size(); ++k) {
    const ByteRun& r = sink.runs[idx[k]];
    if (k > 0) {
      ByteRun& prev = out.runs.back();
      if (sink.dst_tensor[idx[k]] == sink.dst_tensor[last] && sink.src_tensor[idx[k]] == sink.src_tensor[last] &&
          prev.dst + prev.len == r.dst && prev.src + prev.len == r.src) {
        prev.len += r.len;
        continue;
      }
    }
    out.runs.push_back(r);
    last = idx[k];
  }
  return out;
}

// -- validation ------------------------------------------------------------------------

// A tensor's bytes: `blocks` blocks of `block` bytes, `period` bytes apart, from `start`.
struct Span {
  std::uint64_t start, period, block, blocks;
  std::uint64_t end() const { return start + (blocks - 1) * period + block; }
  bool holds(std::uint64_t addr, std::uint64_t len) const {
    if (addr < start || addr >= end()) return false;
    const std::uint64_t off = addr - start, within = off % period;
    return off / period < blocks && within + len <= block && len <= block;
  }
};

// kSrcDstOverlap: `run` writes bytes `other` reads.
enum class Problem : int { kNone = 0, kSrcOutside = 1, kDstOutside = 2, kDstOverlap = 3, kSrcDstOverlap = 4, kEmpty = 5 };

struct Verdict {
  Problem problem = Problem::kNone;
  std::int64_t run = -1, other = -1;
};

namespace detail {

// Finds a span holding [addr, addr + len) among spans sorted by start (spans of padded,
// interleaved tensors may overlap, so earlier spans are tried too); `hint` is the last hit.
inline bool inside(const std::vector<Span>& spans, std::uint64_t addr, std::uint64_t len, std::size_t& hint) {
  if (hint < spans.size() && spans[hint].holds(addr, len)) return true;
  auto it = std::upper_bound(spans.begin(), spans.end(), addr, [](std::uint64_t a, const Span& s) { return a < s.start; });
  for (std::size_t k = static_cast<std::size_t>(it - spans.begin()); k-- > 0;) {
    if (spans[k].holds(addr, len)) {
      hint = k;
      return true;
    }
    if (spans.size() - k > 64) break;  // more overlapping spans than any registration has
  }
  return false;
}

// Two runs of `order` (sorted by `key`) that overlap, or (-1, -1).
template <class Key>
std::pair<std::int64_t, std::int64_t> first_overlap(const ByteRun* runs, std::vector<std::size_t>& order, Key key) {
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return key(runs[a]) < key(runs[b]); });
  for (std::size_t k = 1; k < order.size(); ++k) {
    const ByteRun& a = runs[order[k - 1]];
    if (key(runs[order[k]]) < key(a) + a.len)
      return {static_cast<std::int64_t>(std::min(order[k - 1], order[k])),
              static_cast<std::int64_t>(std::max(order[k - 1], order[k]))};
  }
  return {-1, -1};
}

inline bool spans_meet(const std::vector<Span>& a, const std::vector<Span>& b) {
  for (const Span& x : a)
    for (const Span& y : b)
      if (x.start < y.end() && y.start < x.end()) return true;
  return false;
}

}  // namespace detail

// Every run inside one source and one destination tensor's blocks, destination runs
// disjoint, and no run writing bytes another reads. Spans are sorted by start.
inline Verdict validate_runs(const ByteRun* runs, std::size_t n, const std::vector<Span>& src,
                             const std::vector<Span>& dst) {
  Verdict v;
  std::size_t src_hint = 0, dst_hint = 0;
  bool dst_sorted = true;
  for (std::size_t i = 0; i < n; ++i) {
    const ByteRun& r = runs[i];
    const auto at = static_cast<std::int64_t>(i);
    if (r.len == 0) return {Problem::kEmpty, at, -1};
    if (!detail::inside(src, r.src, r.len, src_hint)) return {Problem::kSrcOutside, at, -1};
    if (!detail::inside(dst, r.dst, r.len, dst_hint)) return {Problem::kDstOutside, at, -1};
    if (i > 0 && r.dst < runs[i - 1].dst + runs[i - 1].len) dst_sorted = false;
  }
  if (!dst_sorted) {  // maps come in destination order; anything else is sorted to check
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    const auto [a, b] = detail::first_overlap(runs, order, [](const ByteRun& r) { return r.dst; });
    if (a >= 0) return {Problem::kDstOverlap, a, b};
  }
  if (detail::spans_meet(src, dst)) {  // one memory on both sides: no run may read what another writes
    struct Edge {
      std::uint64_t at, len;
      bool write;
      std::size_t run;
    };
    std::vector<Edge> edges;
    edges.reserve(2 * n);
    for (std::size_t i = 0; i < n; ++i) {
      edges.push_back({runs[i].src, runs[i].len, false, i});
      edges.push_back({runs[i].dst, runs[i].len, true, i});
    }
    std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) { return a.at < b.at; });
    std::uint64_t write_end = 0, read_end = 0;
    std::size_t writer = 0, reader = 0;
    for (const Edge& e : edges) {
      if (e.write && e.at < read_end) return {Problem::kSrcDstOverlap, static_cast<std::int64_t>(e.run),
                                              static_cast<std::int64_t>(reader)};
      if (!e.write && e.at < write_end) return {Problem::kSrcDstOverlap, static_cast<std::int64_t>(writer),
                                                static_cast<std::int64_t>(e.run)};
      if (e.write && e.at + e.len > write_end) write_end = e.at + e.len, writer = e.run;
      if (!e.write && e.at + e.len > read_end) read_end = e.at + e.len, reader = e.run;
    }
  }
  return v;
}

// -- copying ---------------------------------------------------------------------------

// Copies runs on up to `threads` threads of the pool, each a contiguous share of the bytes
// (a run may be split between two threads); returns the threads used.
template <class CopyRuns>
int copy_runs(const ByteRun* runs, std::size_t n, int threads, std::uint64_t min_bytes_per_thread, CopyRuns copy) {
  if (n == 0) return 0;
  std::vector<std::uint64_t> ends(n);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) ends[i] = total += runs[i].len;
  const std::uint64_t by_bytes = std::max<std::uint64_t>(1, total / std::max<std::uint64_t>(min_bytes_per_thread, 1));
  const int wanted = static_cast<int>(std::min<std::uint64_t>(static_cast<std::uint64_t>(std::max(threads, 1)), by_bytes));
  return transfer::WorkerPool::instance().run(wanted, [&](int part, int parts) {
    const std::uint64_t lo = total / parts * part + std::min<std::uint64_t>(part, total % parts);
    const std::uint64_t hi = lo + total / parts + (static_cast<std::uint64_t>(part) < total % parts ? 1 : 0);
    if (lo >= hi) return;
    std::size_t a = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
    const std::size_t b = static_cast<std::size_t>(std::lower_bound(ends.begin(), ends.end(), hi) - ends.begin());
    // runs a..b overlap [lo, hi); the first and last may be cut
    const auto piece = [&](std::size_t i) {
      const std::uint64_t start = ends[i] - runs[i].len;
      const std::uint64_t from = std::max(lo, start), to = std::min(hi, ends[i]);
      return ByteRun{runs[i].src + (from - start), runs[i].dst + (from - start), to - from};
    };
    const ByteRun head = piece(a);
    copy(&head, 1);
    if (a == b) return;
    ++a;
    if (b > a) copy(runs + a, b - a);
    const ByteRun tail = piece(b);
    copy(&tail, 1);
  });
}

}  // namespace kvlayout::block_map
