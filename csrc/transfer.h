#pragma once
// The native CPU block transfer: paged KV cache <-> token-major chunk buffers.
//
// Python (kvlayout/transfer/plan.py) validates everything and hands over jobs: one per group
// of pointers that share a geometry (a whole registration, or one plane of a per-layer
// tuple). Each job is resolved once into segments (kvlayout/transfer_plan.h, the plan the
// CUDA kernels walk too); a call then only adds block ids and chunk addresses to them and
// walks each segment's runs with flat loops. Everything below is in bytes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvlayout/transfer_plan.h"
#include "prefetch_choice.h"
#include "stream_copy.h"
#include "worker_pool.h"

namespace kvlayout::transfer {

// A job's segments as one direction walks them: each segment's loops ordered by the stride
// of the side it reads (the cache's for a store, the chunk's for a load), so reads stream
// within a block (a head-major HND block loads 1.35x faster in chunk order).
struct Walk {
  // A segment, and whether it is dense on each side.
  struct Step {
    plan::Segment segment;
    bool cache_dense;  // its bytes fill its extent on that side
    bool chunk_dense;
  };
  std::vector<Step> by_chunk;  // (kv, layer, piece): the chunk's order
  std::vector<Step> by_cache;  // the cache's address order
  bool one_run_each = true;    // every segment is one run, back to back on both sides
};

struct Job {
  std::vector<std::uintptr_t> cache_ptrs;  // the job's pointer table
  Walk store, load;
  std::int64_t block_size;
  std::int64_t row_bytes;  // the chunk's whole token row (all jobs' rows together)
};

inline Walk make_walk(std::vector<plan::Segment> segments, bool read_chunk) {
  for (plan::Segment& s : segments) {
    std::stable_sort(s.loops, s.loops + s.num_loops, [read_chunk](const plan::Loop& a, const plan::Loop& b) {
      return read_chunk ? a.chunk_stride > b.chunk_stride : a.cache_stride > b.cache_stride;
    });
  }
  std::vector<Walk::Step> steps;
  for (const plan::Segment& s : segments) {
    const std::int64_t cache = plan::cache_extent(s), chunk = plan::chunk_extent(s);
    steps.push_back(Walk::Step{s, cache == s.bytes, chunk == s.bytes});
  }
  std::vector<Walk::Step> by_cache = steps;
  std::stable_sort(by_cache.begin(), by_cache.end(), [](const Walk::Step& x, const Walk::Step& y) {
    const plan::Segment &a = x.segment, &b = y.segment;
    return a.pointer != b.pointer ? a.pointer < b.pointer : a.cache_offset < b.cache_offset;
  });
  const bool one_run_each = std::all_of(steps.begin(), steps.end(), [](const Walk::Step& step) {
    return step.segment.run.divisor == step.segment.bytes;
  });
  return Walk{std::move(steps), std::move(by_cache), one_run_each};
}

// The segments of pointers other than `repeats`: layers sharing one KV cache list its
// memory once per layer, and a load writes it once, from the first layer's chunk slot.
inline std::vector<plan::Segment> without_pointers(const std::vector<plan::Segment>& segments,
                                                   const std::vector<std::int64_t>& repeats) {
  std::vector<plan::Segment> kept;
  for (const plan::Segment& s : segments)
    if (std::find(repeats.begin(), repeats.end(), static_cast<std::int64_t>(s.pointer)) == repeats.end())
      kept.push_back(s);
  return kept;
}

// `repeats`: pointer-table entries whose memory an earlier entry holds (shared layers):
// a store fills their chunk slots too, a load skips them.
inline Job make_job(std::vector<std::uintptr_t> cache_ptrs, const std::vector<plan::Segment>& segments,
                    std::int64_t block_size, std::int64_t row_bytes, const std::vector<std::int64_t>& repeats = {}) {
  auto load = repeats.empty() ? segments : without_pointers(segments, repeats);
  return Job{std::move(cache_ptrs), make_walk(segments, false), make_walk(std::move(load), true), block_size,
             row_bytes};
}

// The most bytes of one block that lie back to back in the cache: one segment's when it
// fills its extent (else its run), or a chain of such segments, each starting where the
// last ended (what a block-major walk, in cache order, reads in one stream).
struct CacheSpans {
  std::int64_t segment = 0;
  std::int64_t block = 0;
};

inline CacheSpans cache_spans(const std::vector<Job>& jobs) {
  CacheSpans out;
  for (const Job& job : jobs) {
    std::int64_t chain = 0, end = -1;
    std::uint32_t pointer = 0;
    for (const Walk::Step& step : job.store.by_cache) {
      const plan::Segment& s = step.segment;
      const bool dense = plan::cache_extent(s) == s.bytes;
      chain = dense && s.pointer == pointer && s.cache_offset == end ? chain + s.bytes : (dense ? s.bytes : 0);
      pointer = s.pointer;
      end = dense ? s.cache_offset + s.bytes : -1;
      out.segment = std::max<std::int64_t>(out.segment, dense ? s.bytes : s.run.divisor);
      out.block = std::max(out.block, std::max(chain, out.segment));
    }
  }
  return out;
}

struct Batch {
  const std::int64_t* block_ids;
  std::int64_t num_blocks;
  const std::uintptr_t* chunk_ptrs;  // one per chunk
  const std::int64_t* chunk_tokens;  // T of each chunk
  std::int64_t blocks_per_chunk;
  std::int64_t skip_prefix_blocks;
};

enum class Direction { kStore = 0, kLoad = 1 };  // store: cache -> chunk; load: chunk -> cache

// A call that moves at least this many bytes writes with streaming (non-temporal) stores
// where the CPU has them (x86-64 with AVX2): its destination outgrows the caches anyway,
// and skipping the read-for-ownership of each destination line saves a third of the
// memory traffic (1.3-1.6x on the benchmark's 512 MiB moves).
inline constexpr std::int64_t kStreamMinBytes = std::int64_t{8} << 20;

// How a part of a call walks its moves.
enum class WalkKind {
  kNested,         // detail::run_range
  kListed,         // detail::run_range_listed: every segment one run
  kNestedInLanes,  // detail::run_range_in_lanes: segments of several runs, with streaming stores and prefetching
};

namespace detail {

inline bool can_stream() { return stream::can_stream(); }

// Of a move's cache side and chunk side (addresses, strides, extents, density), the one a
// direction reads from (a store reads the cache) and the one it writes to.
template <Direction D, class T>
constexpr T source_of(T cache, T chunk) {
  return D == Direction::kStore ? cache : chunk;
}
template <Direction D, class T>
constexpr T destination_of(T cache, T chunk) {
  return D == Direction::kStore ? chunk : cache;
}

// The loop nest of a segment, N levels deep, as plain nested loops (outermost first).
template <int N, class Run>
[[gnu::always_inline]] inline void nest(const plan::Loop* loops, char* chunk, char* cache, const Run& run) {
  if constexpr (N == 0) {
    run(chunk, cache);
  } else {
    const std::uint32_t extent = loops->extent.divisor;
    const std::int64_t cs = loops->chunk_stride, ks = loops->cache_stride;
    for (std::uint32_t i = 0; i < extent; ++i) nest<N - 1>(loops + 1, chunk + i * cs, cache + i * ks, run);
  }
}

// Copies a segment's runs, asking `ahead` at each run and every stream::kCursorStep bytes
// inside a long one (pieces end on the destination's grid) what to prefetch in step with
// the copy: ahead.at(bytes copied so far, left) is an address (0 for nothing), `left` the
// bytes from there that belong to it. A short run is one piece, prefetched whole from
// there (a few bytes past its range, at worst: a hint, which never faults).
template <Direction D, class Copy, class Ahead>
[[gnu::always_inline]] inline void move_segment(const plan::Segment& s, char* chunk, char* cache, Ahead& ahead) {
  const std::uint64_t bytes = s.run.divisor;
  std::uint64_t done = 0;
  const auto run = [bytes, &done, &ahead](char* c, char* k) {
    char* dst = destination_of<D>(k, c);
    const char* src = source_of<D>(k, c);
    std::uint64_t left = 0;
    if (bytes <= stream::kCursorStep) {
      if (const std::uint64_t lines = ahead.at(done, left); lines != 0) {
        Copy::copy_prefetching(dst, src, bytes, lines);
      } else {
        Copy::copy(dst, src, bytes);
      }
      done += bytes;
      return;
    }
    for (std::uint64_t at = 0; at < bytes;) {
      const auto here = reinterpret_cast<std::uint64_t>(dst + at);
      std::uint64_t piece = std::min(bytes - at, ((here | (stream::kCursorStep - 1)) + 1) - here);
      if (const std::uint64_t lines = ahead.at(done + at, left); lines != 0) {
        piece = std::min(piece, left);
        Copy::copy_prefetching(dst + at, src + at, piece, lines);
      } else {
        Copy::copy(dst + at, src + at, piece);
      }
      at += piece;
    }
    done += bytes;
  };
  switch (s.num_loops) {
    case 0: return nest<0>(s.loops, chunk, cache, run);
    case 1: return nest<1>(s.loops, chunk, cache, run);
    case 2: return nest<2>(s.loops, chunk, cache, run);
    case 3: return nest<3>(s.loops, chunk, cache, run);
    default: return nest<4>(s.loops, chunk, cache, run);
  }
}

template <Direction D>
const Walk& walk_of(const Job& job) {
  return D == Direction::kStore ? job.store : job.load;
}

// Visits the moves of blocks [lo, hi) of the batch, chunk by chunk: visit(step, chunk
// address, cache address) for each (segment, block). Layer-major walks each (kv, layer)
// slab of a chunk through all its blocks before the next slab, so the chunk side streams;
// block-major finishes a block before the next, its segments in cache order, so the cache
// side streams where a block's slabs are adjacent (a cross-layer block). Either way each
// byte's last writer is the same, so the order never changes the result.
template <Direction D, class Visit>
[[gnu::always_inline]] inline void for_each_move(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo,
                                                 std::int64_t hi, bool layer_major, Visit& visit) {
  const std::int64_t per = b.blocks_per_chunk;
  for (std::int64_t c = lo / per; c * per < hi; ++c) {
    const std::int64_t i0 = std::max(lo, c * per), i1 = std::min(hi, (c + 1) * per);
    const std::uint64_t chunk = b.chunk_ptrs[c];
    const std::int64_t tokens = b.chunk_tokens[c];
    const auto move = [&](const Job& job, const Walk::Step& step, std::int64_t i) {
      const plan::Segment& s = step.segment;
      const std::int64_t first_token = (i - c * per) * job.block_size;
      auto* row = reinterpret_cast<char*>(plan::chunk_start(s, chunk, tokens, first_token, job.row_bytes));
      auto* cache = reinterpret_cast<char*>(plan::cache_start(s, job.cache_ptrs[s.pointer], b.block_ids[i]));
      visit(step, row, cache);
    };
    if (layer_major) {
      for (const Job& job : jobs)
        for (const Walk::Step& step : walk_of<D>(job).by_chunk)
          for (std::int64_t i = i0; i < i1; ++i) move(job, step, i);
    } else {
      for (std::int64_t i = i0; i < i1; ++i)
        for (const Job& job : jobs)
          for (const Walk::Step& step : walk_of<D>(job).by_cache) move(job, step, i);
    }
  }
}

// The cursors of the nested walk, asked once per run (the walk's runs may be 256 bytes:
// asking each cursor at each run cost HND loads 0.05-0.08x of a flat streaming copy):
// the page cursor moves on every stream::kCursorStep bytes, and the lines to prefetch in
// step with the copy, kLineLead ahead (as in a run list), are found then or where the
// stretch they were found in ends. Positions count bytes of the move being copied.
template <bool Prefetch>
struct Cursors {
  stream::LineCursor lines;
  stream::PageCursor pages;

  // The source address to prefetch in step with a copy at position `at` (0: none), and in
  // `left` the bytes from there that lie in one stretch.
  [[gnu::always_inline]] std::uint64_t at(std::uint64_t position, std::uint64_t& left) {
    if constexpr (!Prefetch) {
      (void)position, (void)left;
      return 0;
    } else {
      if (position >= next_step_ || position >= lines_until_) refresh(position);
      left = lines_until_ - position;
      return lines_base_ == 0 ? 0 : lines_base_ + position;
    }
  }

  // The move was copied: positions start over at the next.
  void moved() { next_step_ = lines_until_ = 0; }

 private:
  void refresh(std::uint64_t position) {
    if (position >= next_step_) {
      pages.up_to(position);
      next_step_ = position + stream::kCursorStep;
    }
    std::uint64_t left = 0;
    const std::uint64_t address = lines.address_at(position + stream::kLineLead, left);
    lines_until_ = position + std::min<std::uint64_t>(left, std::uint64_t{1} << 48);
    // lines_base_ + position is the address kLineLead ahead (0: nothing to prefetch there)
    lines_base_ = address == 0 ? 0 : address - position;
  }

  std::uint64_t next_step_ = 0;    // where the page cursor moves on next
  std::uint64_t lines_until_ = 0;  // where the stretch of lines_base_ ends
  std::uint64_t lines_base_ = 0;
};

// The walk runs one (segment, block) behind itself, so each move is known before its copy
// starts: where the next move's source jumps (does not continue this one's) and is dense,
// its lines are prefetched kLineLead bytes ahead of the copy (stream::LineCursor), so a
// scattered block finds its first lines in; and where the next move's destination jumps
// and is dense, one line of each of its pages is touched kPageLead ahead
// (stream::PageCursor), so the page walks of a scattered block are done before the
// streaming stores reach it. Measured in one process, the variants taking turns, one
// thread, on bench-transfer's moves: loads into scattered blocks went from 0.76x to 0.88x
// a flat streaming copy (NHD) and 0.70x to 0.77x (HND); touching the pages of jumping
// sources as well, or of every dense side, did no better, and stores were unchanged. On a
// busy day of the same machine the cursors lost on some formats (cross-layer loads 0.80-0.92x
// with them, 0.94-0.95x without) and won on others (HND stores 0.75-0.87x, 0.69-0.80x
// without), so each plan measures which way is faster (Plan::prefetch_choices).
// Where each segment is one run and the source jumps, the listed walk below serves.
template <Direction D, class Copy, bool Prefetch>
[[gnu::always_inline]] inline void run_range(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo,
                                             std::int64_t hi, bool layer_major) {
  struct Move {
    const Walk::Step* step = nullptr;
    char* chunk = nullptr;
    char* cache = nullptr;
  };
  Move pending;
  Cursors<Prefetch> cursors;
  stream::LineCursor& lines = cursors.lines;
  stream::PageCursor& pages = cursors.pages;
  std::uint64_t source_end = 0, destination_end = 0;  // past the pending move's extent on each side
  const auto copy_pending = [&]() {
    move_segment<D, Copy>(pending.step->segment, pending.chunk, pending.cache, cursors);
    cursors.moved();
  };
  const auto visit = [&](const Walk::Step& step, char* chunk, char* cache) {
    const auto k = reinterpret_cast<std::uint64_t>(cache), c = reinterpret_cast<std::uint64_t>(chunk);
    const std::uint64_t source = source_of<D>(k, c), destination = destination_of<D>(k, c);
    const bool dense = source_of<D>(step.cache_dense, step.chunk_dense);
    const bool destination_dense = destination_of<D>(step.cache_dense, step.chunk_dense);
    const bool jumps = dense && source != source_end;
    const bool destination_jumps = destination_dense && destination != destination_end;
    const std::int64_t cache_extent = plan::cache_extent(step.segment), chunk_extent = plan::chunk_extent(step.segment);
    source_end = source + source_of<D>(cache_extent, chunk_extent);
    destination_end = destination + destination_of<D>(cache_extent, chunk_extent);
    const std::uint64_t bytes = step.segment.bytes;
    lines.next(jumps ? source : 0, bytes);
    pages.next(destination_jumps ? destination : 0, bytes);
    if (pending.step != nullptr) {
      copy_pending();
      lines.advance();
      pages.advance(pending.step->segment.bytes);
    } else {
      lines.advance();
      pages.advance(0);
    }
    pending = Move{&step, chunk, cache};
  };
  for_each_move<D>(jobs, b, lo, hi, layer_major, visit);
  if (pending.step != nullptr) {
    lines.next(0, 0);
    pages.next(0, 0);
    copy_pending();
  }
  Copy::finish();
}

// How many runs the listed walk lists before it copies them (24 KiB of table): a table's
// last runs get no lookahead into the next, one cold jump per 1,024 runs of 2 KiB or more.
inline constexpr std::size_t kListedRuns = 1024;

// Where every segment is one run on both sides (a block's K or V slab in NHD-like caches,
// an MLA block, a cross-layer slab), the walk lists its moves as byte runs, joining those
// that continue each other on both sides, a table at a time, and the run-list engine that
// block maps copy with (stream::copy_runs_with) copies each table, its cursors a run list
// ahead of the copy (in lanes where the source jumps every few KiB: the table's
// destinations never overlap). Where the source jumps from move to move (see listed()) that copy is
// faster than run_range's. Measured in one process on bench-transfer's moves (256
// scattered blocks of a 2,048-block pool, 512 MiB), the two walks taking turns, one
// thread, prefetching, five runs: layer-major stores went from 0.59-0.80x a flat
// streaming copy to 0.72-0.91x (flash-attn and flash-infer NHD, MLA, SGLang, fused K/V;
// 0.1x more in the median), block-major cross-layer loads from 0.74-0.85x to 0.82-0.97x;
// on two threads both walks measured 0.85-0.95x. Of the engine's cursors, the page touch
// of the source makes the difference: without page touches the listed stores measured
// 0.74-0.75x, with the source's alone 0.86-0.87x. run_range given the same touches (a page
// cursor on jumping sources, one on every dense destination) and 2 KiB steps measured no
// better (0.72-0.76x), though a trace showed it issuing the same prefetches at the same
// copy positions; the cause is not found. (callgrind counts about 190 million instructions
// for a 512 MiB store nested, 90 million listed, most of the difference LineCursor's
// per-line loop; yet a LineCursor issuing the same lines in a tight loop made the nested
// walk slower, 0.60-0.68x against 0.70-0.80x.) Segments of several short runs (HND) stay with
// run_range: listed, their 256-byte runs cost about 4 ns each to list and copy, a third
// of the copy.
template <Direction D, class Copy, bool Prefetch>
[[gnu::always_inline]] inline void run_range_listed(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo,
                                                    std::int64_t hi, bool layer_major) {
  ByteRun table[kListedRuns];
  std::size_t n = 0;
  const auto visit = [&](const Walk::Step& step, char* chunk, char* cache) {
    const auto k = reinterpret_cast<std::uint64_t>(cache), c = reinterpret_cast<std::uint64_t>(chunk);
    const ByteRun run{source_of<D>(k, c), destination_of<D>(k, c), step.segment.bytes};
    if (n != 0) {
      ByteRun& last = table[n - 1];
      if (last.src + last.len == run.src && last.dst + last.len == run.dst) {
        last.len += run.len;
        return;
      }
      if (n == kListedRuns) {
        stream::copy_runs_with<Copy, Prefetch, stream::Order::kAny>(table, n);
        n = 0;
      }
    }
    table[n++] = run;
  };
  for_each_move<D>(jobs, b, lo, hi, layer_major, visit);
  stream::copy_runs_with<Copy, Prefetch, stream::Order::kAny>(table, n);
  Copy::finish();
}

// A move of the nested walk as lanes take it: a segment's runs, in its walk's loop order,
// from a source and to a destination address.
struct NestMove {
  const Walk::Step* step;
  std::uint64_t src, dst;
};

// The source stretches of a list of nested moves, as a stream::Lane walks them (see
// stream::RunStretches): moves whose sources are dense and continue each other form one,
// and a cursor steps through a move's runs by its loop nest, as an odometer.
template <Direction D>
class MoveStretches {
 public:
  MoveStretches(const NestMove* moves, std::size_t n) : moves_(moves) {
    std::uint64_t next = 0;  // where the last move's source ended, when dense (else 0)
    for (std::size_t i = 0; i < n; ++i) {
      const Walk::Step& step = *moves[i].step;
      const bool dense = source_of<D>(step.cache_dense, step.chunk_dense);
      if (i == 0 || !dense || moves[i].src != next) starts_.push_back(i);
      next = dense ? moves[i].src + step.segment.bytes : 0;
      bytes_ += step.segment.bytes;
    }
    starts_.push_back(n);
  }

  std::size_t size() const { return starts_.size() - 1; }
  std::uint64_t bytes() const { return bytes_; }

  // A move's destination may step back and forth across its pages (a head-major block's
  // rows, 256 bytes at a time): lanes remember the range of pages they touched.
  static constexpr bool kDestinationsReturn = true;

  struct Cursor {
    const NestMove* move = nullptr;
    const NestMove* end = nullptr;   // past the stretch's last move
    std::uint64_t src = 0, dst = 0;  // the current run's first byte on each side
    std::uint64_t inner_left = 0;    // runs of the innermost loop after the current one
    std::uint32_t index[plan::kMaxLoops] = {};  // of the loops outside the innermost
  };

  // Puts c at the first run of stretch s, in `run` (a move has bytes: true).
  bool enter(Cursor& c, std::size_t s, ByteRun& run) const {
    c.move = moves_ + starts_[s];
    c.end = moves_ + starts_[s + 1];
    std::fill(c.index, c.index + plan::kMaxLoops, 0);
    start(c, run);
    return true;
  }

  // Moves c on to the next run of its move, or the first of the stretch's next move, in
  // `run`; false past the stretch's end. The innermost loop takes the short way.
  [[gnu::always_inline]] bool next(Cursor& c, ByteRun& run) const {
    const plan::Segment& s = c.move->step->segment;
    if (c.inner_left != 0) {
      --c.inner_left;
      const plan::Loop& inner = s.loops[s.num_loops - 1];
      c.src += source_stride(inner), c.dst += destination_stride(inner);
      run = ByteRun{c.src, c.dst, s.run.divisor};
      return true;
    }
    return next_outer(c, run);
  }

 private:
  static std::uint64_t source_stride(const plan::Loop& loop) {
    return source_of<D>(loop.cache_stride, loop.chunk_stride);
  }
  static std::uint64_t destination_stride(const plan::Loop& loop) {
    return destination_of<D>(loop.cache_stride, loop.chunk_stride);
  }

  // next() where the innermost loop has run its course (counted in inner_left, not in
  // index): the loops outside it as an odometer.
  bool next_outer(Cursor& c, ByteRun& run) const {
    const plan::Segment& s = c.move->step->segment;
    if (s.num_loops != 0) {
      const plan::Loop& inner = s.loops[s.num_loops - 1];
      c.src -= (inner.extent.divisor - 1) * source_stride(inner);
      c.dst -= (inner.extent.divisor - 1) * destination_stride(inner);
      for (std::uint32_t l = s.num_loops - 1; l-- > 0;) {
        const plan::Loop& loop = s.loops[l];
        if (++c.index[l] < loop.extent.divisor) {
          c.src += source_stride(loop), c.dst += destination_stride(loop);
          c.inner_left = inner.extent.divisor - 1;
          run = ByteRun{c.src, c.dst, s.run.divisor};
          return true;
        }
        c.index[l] = 0;  // a full turn of every loop leaves them all at 0 for the next move
        c.src -= (loop.extent.divisor - 1) * source_stride(loop);
        c.dst -= (loop.extent.divisor - 1) * destination_stride(loop);
      }
    }
    if (++c.move == c.end) return false;
    start(c, run);
    return true;
  }

  static void start(Cursor& c, ByteRun& run) {
    const plan::Segment& s = c.move->step->segment;
    c.src = c.move->src, c.dst = c.move->dst;
    c.inner_left = s.num_loops == 0 ? 0 : s.loops[s.num_loops - 1].extent.divisor - 1;
    run = ByteRun{c.src, c.dst, s.run.divisor};
  }

  const NestMove* moves_;
  std::vector<std::size_t> starts_;
  std::uint64_t bytes_ = 0;
};

// How many moves the nested walk in lanes gathers before it copies them: as few whole
// chunks of blocks as hold this many (fewer where the call ends first).
inline constexpr std::size_t kLaneMoves = 1024;

// Visits blocks [lo, hi) of the batch in groups of whole chunks (the first and last
// cut at lo and hi) of kLaneMoves moves or more: group(stretches of the group's moves,
// first block, past its last block).
template <Direction D, class Group>
inline void for_each_group_of_moves(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo, std::int64_t hi,
                                    bool layer_major, Group&& group) {
  std::size_t moves_per_block = 0;
  for (const Job& job : jobs) moves_per_block += walk_of<D>(job).by_chunk.size();
  const auto moves_per_chunk = static_cast<std::size_t>(b.blocks_per_chunk) * std::max<std::size_t>(moves_per_block, 1);
  const auto chunks_per_group = static_cast<std::int64_t>((kLaneMoves + moves_per_chunk - 1) / moves_per_chunk);
  std::vector<NestMove> moves;
  const auto gather = [&moves](const Walk::Step& step, char* chunk, char* cache) {
    const auto k = reinterpret_cast<std::uint64_t>(cache), c = reinterpret_cast<std::uint64_t>(chunk);
    moves.push_back(NestMove{&step, source_of<D>(k, c), destination_of<D>(k, c)});
  };
  for (std::int64_t group_lo = lo; group_lo < hi;) {
    const std::int64_t group_hi = std::min(hi, (group_lo / b.blocks_per_chunk + chunks_per_group) * b.blocks_per_chunk);
    moves.clear();
    for_each_move<D>(jobs, b, group_lo, group_hi, layer_major, gather);
    group(MoveStretches<D>(moves.data(), moves.size()), group_lo, group_hi);
    group_lo = group_hi;
  }
}

// The nested walk where segments hold several runs (HND: a 256-byte run per head and
// token) and the source jumps from move to move: the moves of each group of chunks are
// gathered, and where their source stretches pay (stream::lanes_pay) they are copied in
// lanes (stream::copy_in_lanes), each lane stepping through its moves' loop nests; a
// group whose source streams on (consecutive blocks) takes run_range. Its destinations
// never overlap: a store's are chunk slots, a load's are blocks, which it writes once.
// Measured on bench-transfer's HND store (256 scattered blocks, 512 MiB, one thread, one
// process, the walks taking turns): 0.70-0.74x a flat streaming copy nested, 0.88-0.91x in
// lanes (0.80-0.82x before each lane touched a destination page once per move, not at
// each step that came back to it).
template <Direction D, class Copy>
[[gnu::always_inline]] inline void run_range_in_lanes(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo,
                                                      std::int64_t hi, bool layer_major) {
  for_each_group_of_moves<D>(jobs, b, lo, hi, layer_major,
                             [&](const MoveStretches<D>& stretches, std::int64_t group_lo, std::int64_t group_hi) {
                               if (stream::lanes_pay(stretches.bytes(), stretches.size())) {
                                 stream::copy_in_lanes<Copy, true>(stretches);
                               } else {
                                 run_range<D, Copy, true>(jobs, b, group_lo, group_hi, layer_major);
                               }
                             });
  Copy::finish();
}

// One part of a call: the listed walk, the nested one, or the nested one in lanes (which
// needs streaming stores and prefetching: the nested walk serves it otherwise, as run lists
// take lanes only with both).
template <Direction D, class Copy, bool Prefetch>
[[gnu::always_inline]] inline void run_walk(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo,
                                            std::int64_t hi, bool layer_major, WalkKind walk) {
  if (walk == WalkKind::kListed) return run_range_listed<D, Copy, Prefetch>(jobs, b, lo, hi, layer_major);
#if defined(KVLAYOUT_STREAM_STORES)
  if constexpr (Prefetch && std::is_same_v<Copy, stream::StreamCopy>) {
    if (walk == WalkKind::kNestedInLanes) return run_range_in_lanes<D, Copy>(jobs, b, lo, hi, layer_major);
  }
#endif
  run_range<D, Copy, Prefetch>(jobs, b, lo, hi, layer_major);
}

template <Direction D, bool Prefetch>
void run_part_plain(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo, std::int64_t hi, bool layer_major,
                    WalkKind walk) {
  run_walk<D, stream::PlainCopy, Prefetch>(jobs, b, lo, hi, layer_major, walk);
}

#if defined(KVLAYOUT_STREAM_STORES)
// Compiled for AVX2 as a whole, so the streaming copy of each run inlines into the walk.
template <Direction D, bool Prefetch>
__attribute__((target("avx2"), flatten)) void run_part_stream(const std::vector<Job>& jobs, const Batch& b,
                                                              std::int64_t lo, std::int64_t hi, bool layer_major,
                                                              WalkKind walk) {
  run_walk<D, stream::StreamCopy, Prefetch>(jobs, b, lo, hi, layer_major, walk);
}
#endif

template <Direction D>
void run_part(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo, std::int64_t hi, bool layer_major,
              bool streaming, bool prefetch, WalkKind walk) {
#if defined(KVLAYOUT_STREAM_STORES)
  if (streaming)
    return prefetch ? run_part_stream<D, true>(jobs, b, lo, hi, layer_major, walk)
                    : run_part_stream<D, false>(jobs, b, lo, hi, layer_major, walk);
#endif
  (void)streaming;
  return prefetch ? run_part_plain<D, true>(jobs, b, lo, hi, layer_major, walk)
                  : run_part_plain<D, false>(jobs, b, lo, hi, layer_major, walk);
}

}  // namespace detail

// The index of the first block id outside [0, num_blocks), or -1 when all are inside.
inline std::int64_t first_bad_block_id(const std::int64_t* ids, std::int64_t num_ids, std::int64_t num_blocks) {
  for (std::int64_t i = 0; i < num_ids; ++i) {
    if (ids[i] < 0 || ids[i] >= num_blocks) return i;
  }
  return -1;
}

// The index of the first block id in [skip, num_ids) that repeats an earlier one there,
// or -1: a load writes each block once (with two chunks for one block, which wins would
// depend on the thread schedule).
inline std::int64_t first_repeated_block_id(const std::int64_t* ids, std::int64_t num_ids, std::int64_t skip,
                                            std::int64_t num_blocks) {
  const std::int64_t n = num_ids - skip;
  if (n <= 1) return -1;
  if (num_blocks <= 4096 * n) {  // a bitmap of the pool is cheap next to the copy
    std::vector<std::uint64_t> seen(static_cast<std::size_t>((num_blocks + 63) / 64));
    for (std::int64_t i = skip; i < num_ids; ++i) {
      const auto b = static_cast<std::uint64_t>(ids[i]);
      std::uint64_t& word = seen[b / 64];
      if (word & (std::uint64_t{1} << (b % 64))) return i;
      word |= std::uint64_t{1} << (b % 64);
    }
    return -1;
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> order;  // (id, index)
  order.reserve(static_cast<std::size_t>(n));
  for (std::int64_t i = skip; i < num_ids; ++i) order.emplace_back(ids[i], i);
  std::sort(order.begin(), order.end());
  std::int64_t first = -1;
  for (std::size_t k = 1; k < order.size(); ++k) {
    if (order[k].first == order[k - 1].first && (first < 0 || order[k].second < first)) first = order[k].second;
  }
  return first;
}

enum class Order { kAuto = -1, kBlockMajor = 0, kLayerMajor = 1 };

// A registration's jobs, with what every call's choices need.
struct Plan {
  explicit Plan(std::vector<Job> j) : jobs(std::move(j)), spans(cache_spans(jobs)) {
    for (const Job& job : jobs) {
      for (const Walk::Step& step : job.store.by_chunk) block_bytes += step.segment.bytes;
      one_run_each[0] = one_run_each[0] && job.store.one_run_each;
      one_run_each[1] = one_run_each[1] && job.load.one_run_each;
    }
  }
  std::vector<Job> jobs;
  CacheSpans spans;
  std::int64_t block_bytes = 0;            // bytes per block moved
  bool one_run_each[2] = {true, true};  // every job's segments one run each, per direction (store, load)
  // Whether the walk prefetches, measured (prefetch_choice.h) per direction (store, load)
  // and for one thread or more; a plan is shared by the threads that call it.
  mutable PrefetchChoice prefetch_choices[2][2];
};

struct Options {
  Order order = Order::kAuto;
  std::int64_t stream_min_bytes = kStreamMinBytes;
  Prefetch prefetch = Prefetch::kAuto;  // the cursors ahead of the copy, measured (or fixed: tests, benchmarks)
  bool listed = true;  // one-run segments take the listed walk (false: never; tests, benchmarks)
  bool lanes = true;   // segments of several runs may take the nested walk in lanes (false: never)
};

// kAuto: the order with the longer stretch of back-to-back bytes on either side, and on a
// tie the one whose read side streams longer. With the next move's lines prefetched (see
// run_range), a jump costs about the same on either side, so the longest
// stream wins: this stores and loads cross-layer blocks (slabs adjacent in the cache)
// block-major and moves everything else layer-major, flash-infer's K/V-adjacent blocks
// included (their store was 0.8x block-major, 0.9-1.0x layer-major, in same-run A/B).
inline bool layer_major(const Plan& p, Direction d, std::int64_t blocks_per_chunk, const Options& o) {
  if (o.order != Order::kAuto || p.jobs.empty()) return o.order == Order::kLayerMajor;
  const std::int64_t rows = p.jobs.front().block_size * p.jobs.front().row_bytes;  // a block in a chunk slab
  const std::int64_t chunk_layer = blocks_per_chunk * rows, chunk_block = rows;
  const std::int64_t cache_layer = p.spans.segment, cache_block = p.spans.block;
  const std::int64_t longest_layer = std::max(chunk_layer, cache_layer);
  const std::int64_t longest_block = std::max(chunk_block, cache_block);
  if (longest_layer != longest_block) return longest_layer > longest_block;
  return d == Direction::kStore ? cache_layer >= cache_block : chunk_layer >= chunk_block;
}

namespace detail {
// Whether the order streams the destination, so the source jumps from move to move:
// layer-major stores (each chunk slab from block after block), block-major loads.
inline bool source_jumps(Direction d, bool layer_major) { return layer_major == (d == Direction::kStore); }
// Whether every segment of the plan's walk in direction d is one run.
inline bool every_segment_one_run(const Plan& p, Direction d) {
  return p.one_run_each[d == Direction::kStore ? 0 : 1];
}
}  // namespace detail

// Whether a call takes the listed walk: every segment one run, and an order that streams
// the destination, so the source jumps from move to move (layer-major stores, block-major
// loads), unless the options turn it off. Where the destination jumps instead, run_range's
// page cursor does as well or better: in the A/B of run_range_listed (three runs), MLA
// loads (layer-major) measured 0.60-0.78x listed against 0.66-0.88x, cross-layer stores
// (block-major) 0.85-1.04x against 0.90-1.01x, the other loads alike.
inline bool listed(const Plan& p, Direction d, bool layer_major, const Options& o) {
  return o.listed && detail::source_jumps(d, layer_major) && detail::every_segment_one_run(p, d);
}

// Whether a call may take the nested walk in lanes: segments of several runs in some job,
// an order in which the source jumps from move to move (as for the listed walk), unless
// the options turn it off; each group of moves then takes lanes where its stretches pay.
inline bool lanes(const Plan& p, Direction d, bool layer_major, const Options& o) {
  return o.lanes && detail::source_jumps(d, layer_major) && !detail::every_segment_one_run(p, d);
}

// How a call walks its moves.
inline WalkKind walk_kind(const Plan& p, Direction d, bool layer_major, const Options& o) {
  if (listed(p, d, layer_major, o)) return WalkKind::kListed;
  return lanes(p, d, layer_major, o) ? WalkKind::kNestedInLanes : WalkKind::kNested;
}

// Moves blocks [skip_prefix_blocks, num_blocks) of the batch, split over up to `threads`
// threads of the shared pool (fewer when there is less work); returns the threads used.
// Each part is a contiguous range of blocks, so the bytes do not depend on the split.
inline int run(const Plan& p, const Batch& b, Direction d, int threads, const Options& o = {}) {
  const std::int64_t begin = b.skip_prefix_blocks, end = b.num_blocks;
  if (end <= begin || p.jobs.empty()) return 0;
  const bool by_layer = layer_major(p, d, b.blocks_per_chunk, o);
  const WalkKind walk = walk_kind(p, d, by_layer, o);
  const bool stream = detail::can_stream() && (end - begin) * p.block_bytes >= o.stream_min_bytes;
  const int wanted = static_cast<int>(std::min<std::int64_t>(std::max(threads, 1), end - begin));
  PrefetchChoice& choice = p.prefetch_choices[d == Direction::kStore ? 0 : 1][wanted > 1 ? 1 : 0];
  const auto bytes = static_cast<std::uint64_t>((end - begin) * p.block_bytes);
  return choice.run(o.prefetch, bytes, [&](bool prefetch) {
    return WorkerPool::instance().run(wanted, [&](int part, int parts) {
      const std::int64_t per = (end - begin + parts - 1) / parts;
      const std::int64_t lo = begin + part * per, hi = std::min(end, lo + per);
      if (lo >= hi) return;
      if (d == Direction::kStore) {
        detail::run_part<Direction::kStore>(p.jobs, b, lo, hi, by_layer, stream, prefetch, walk);
      } else {
        detail::run_part<Direction::kLoad>(p.jobs, b, lo, hi, by_layer, stream, prefetch, walk);
      }
    });
  });
}

// The bytes a one-thread call copies in lanes where it streams and prefetches (for tests:
// which groups of a nested walk pay for lanes).
inline std::uint64_t bytes_in_lanes(const Plan& p, const Batch& b, Direction d, const Options& o = {}) {
  const bool by_layer = layer_major(p, d, b.blocks_per_chunk, o);
  if (walk_kind(p, d, by_layer, o) != WalkKind::kNestedInLanes || b.num_blocks <= b.skip_prefix_blocks) return 0;
  std::uint64_t bytes = 0;
  const auto count = [&bytes](const auto& stretches, std::int64_t, std::int64_t) {
    if (stream::lanes_pay(stretches.bytes(), stretches.size())) bytes += stretches.bytes();
  };
  if (d == Direction::kStore) {
    detail::for_each_group_of_moves<Direction::kStore>(p.jobs, b, b.skip_prefix_blocks, b.num_blocks, by_layer, count);
  } else {
    detail::for_each_group_of_moves<Direction::kLoad>(p.jobs, b, b.skip_prefix_blocks, b.num_blocks, by_layer, count);
  }
  return bytes;
}

}  // namespace kvlayout::transfer
