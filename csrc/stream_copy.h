#pragma once
// Copies of byte runs at the memory's streaming rate: the CPU engines' copy primitive.
//
// A run list (the block transfer's walk, or a block map) jumps from run to run, and at
// each jump the hardware prefetcher starts over and, in a VM with nested paging, the
// address translation misses: cold page tables to walk on each side before the run's
// first line comes in. So cursors run ahead of the copy:
//   - a line cursor, kLineLead ahead, prefetches the source's lines after each jump (into
//     L2: into L1 did worse; a source that streams on from the last run is left to the
//     hardware prefetcher); lines of a long stretch go out in step with the copy, two
//     per 128 bytes copied, non-temporally (prefetch_once), in run lists (RunLines) and
//     the nested transfer walk alike;
//   - a page cursor, kPageLead ahead, touches one line of each page the copy will reach
//     (a prefetch, which walks the page tables), so the walk is done when the copy gets
//     there: of both sides in a run list (RunPages), of jumping destinations in the block
//     transfer (PageCursor). An earlier round measured a page touch as a loss; its
//     touches, like the line cursor's prefetches then, went out a page's worth at once.
// Measured for run lists (scattered 32 KiB runs of a 4 GiB pool into one buffer, back,
// and between two pools, against a flat streaming copy of the same bytes, one process,
// the variants taking turns, one thread): the line cursor's prefetches issued up to
// exactly kLineLead, not a page at a time, took a scattered source from 0.58-0.74x the
// flat copy to 0.81-0.96x; the page cursor took a scattered destination from 0.76-0.79x
// to 0.82-0.90x, both sides scattered from 0.53-0.65x to 0.81-0.87x, and runs that follow
// each other from 0.94x to 1.05x. On a busy day of the same machine the cursors cost more
// than they hid, so whether a copy runs them is measured per kind of copy
// (prefetch_choice.h).

// Where the CPU has AVX2 (asked at run time; the extension is built for baseline x86-64)
// runs are copied with 32-byte loads and non-temporal stores, which skip the
// read-for-ownership of each destination line; elsewhere with memcpy.
//
// Short runs that form a transposed tile (see Tile: what a map between head-major and
// token-major blocks lists) are copied in the order that reads their source as one
// stream, not in list order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvlayout {

struct ByteRun {
  std::uint64_t src;
  std::uint64_t dst;
  std::uint64_t len;
};

namespace stream {

inline constexpr std::uint64_t kPage = 4096;
// A long run is copied in pieces of this many bytes, the prefetch cursors moving on
// between them.
inline constexpr std::uint64_t kCursorStep = 4096;

// A read prefetch of the line at `address`, kLocality as __builtin_prefetch's (on x86-64:
// 3 prefetcht0, 2 prefetcht1, 0 prefetchnta).
template <int kLocality>
inline void prefetch_read(std::uint64_t address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(reinterpret_cast<const void*>(address), 0, kLocality);
#else
  (void)address;
#endif
}

inline void prefetch_line(std::uint64_t address) { prefetch_read<2>(address); }

// Prefetches, with `prefetch`, every line of [at, at + bytes) at once.
template <void (*prefetch)(std::uint64_t)>
inline void prefetch_lines(std::uint64_t at, std::uint64_t bytes) {
  for (std::uint64_t line = at & ~std::uint64_t{63}; line < at + bytes; line += 64) prefetch(line);
}

// A source line the copy reaches soon and reads once: prefetched non-temporally (in step
// with the copy, scattered 32 KiB runs of bench-transfer's pattern measured 0.78-0.85x a
// flat streaming copy with it, 0.72-0.74x into L2, in one process taking turns).
inline void prefetch_once(std::uint64_t address) { prefetch_read<0>(address); }

// A destination line, for its page walk: into L1 (into L2 did no better: 0.94-1.01x); the
// copy's streaming store then takes the line over.
inline void prefetch_destination(std::uint64_t address) {
#if defined(__x86_64__) || defined(__i386__)
  prefetch_read<3>(address);
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(reinterpret_cast<const void*>(address), 1, 3);
#else
  (void)address;
#endif
}

// How far ahead of the copy the page cursors touch pages (32 KiB: a block of the
// benchmarks' caches; 64 KiB and more measured no better).
inline constexpr std::uint64_t kPageLead = 32 << 10;

// How far ahead of the copy a LineCursor prefetches (8-32 KiB measured alike, 2-4 KiB
// was short).
inline constexpr std::uint64_t kLineLead = 16 << 10;

// The range being copied and the next one, as a map from positions to addresses:
// positions count bytes of the current range, then on into the next; a range given as
// address 0 maps to none (one that streams on from the last, or whose bytes do not lie
// back to back, so positions do not map to addresses).
class Ranges {
 public:
  // The range after the current one.
  void next(std::uint64_t address, std::uint64_t bytes) { next_ = {address, bytes}; }

  // The current range is copied: the next one becomes current.
  void advance() {
    current_ = next_;
    next_ = {};
  }

  // The address at position `at`, and in `left` the bytes from there to its range's end;
  // 0 where the range was given as 0 or `at` lies past both (left: unbounded).
  std::uint64_t address_at(std::uint64_t at, std::uint64_t& left) const {
    const Range& r = at < current_.bytes ? current_ : next_;
    const std::uint64_t offset = at < current_.bytes ? at : at - current_.bytes;
    if (offset >= r.bytes) {
      left = ~std::uint64_t{0};
      return 0;
    }
    left = r.bytes - offset;
    return r.address == 0 ? 0 : r.address + offset;
  }

  std::uint64_t bytes() const { return current_.bytes + next_.bytes; }

 private:
  struct Range {
    std::uint64_t address = 0;
    std::uint64_t bytes = 0;
  };
  Range current_, next_;
};

// The source ranges of the nested transfer walk, whose lines the copy prefetches in step
// with itself, kLineLead ahead (given the source where it jumps, or 0 for one that
// streams on from the last, left to the hardware prefetcher).
using LineCursor = Ranges;

// A cursor over Ranges kLead bytes ahead of the copy, calling touch() once per kGrain-byte
// unit of memory it passes (at a range's first byte, then at each unit's start).
template <std::uint64_t kGrain, std::uint64_t kLead, void (*touch)(std::uint64_t)>
class RangeCursor {
 public:
  void next(std::uint64_t address, std::uint64_t bytes) { ranges_.next(address, bytes); }

  // The current range (of `bytes`) is copied: the next one becomes current.
  void advance(std::uint64_t bytes) {
    issued_ = issued_ > bytes ? issued_ - bytes : 0;
    ranges_.advance();
  }

  // The copy has done `done` bytes of the current range.
  void up_to(std::uint64_t done) {
    const std::uint64_t limit = std::min(done + kLead, ranges_.bytes());
    while (issued_ < limit) {
      std::uint64_t left = 0;
      const std::uint64_t address = ranges_.address_at(issued_, left);
      if (address == 0) {
        issued_ += left;
        continue;
      }
      touch(address);
      issued_ += std::min(left, kGrain - address % kGrain);
    }
  }

 private:
  Ranges ranges_;
  std::uint64_t issued_ = 0;  // bytes of the current range, then the next, touched
};

// Touches one line of each destination page, for the page walks (given the destination,
// or 0 for one that streams on or is not back to back).
using PageCursor = RangeCursor<kPage, kPageLead, prefetch_destination>;

struct PlainCopy {
  static void copy(char* dst, const char* src, std::size_t n) { std::memcpy(dst, src, n); }
  // Copies n bytes while prefetching the n bytes at `ahead`, a line at a time between
  // its pieces, so the prefetches go out spread over the copy.
  static void copy_prefetching(char* dst, const char* src, std::size_t n, std::uint64_t ahead) {
    for (std::size_t at = 0; at < n; at += 256) {
      for (std::uint64_t line = 0; line < 256; line += 64) prefetch_once(ahead + at + line);
      std::memcpy(dst + at, src + at, std::min<std::size_t>(256, n - at));
    }
  }
  static void finish() {}
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVLAYOUT_STREAM_STORES 1

// Streaming stores (AVX2, 32 bytes) of the destination's whole 64-byte lines; the bytes
// before its first whole line and after its last go through memcpy. AVX2 beat SSE2's
// 16-byte streaming stores by 1.0-1.18x across the transfer benchmark's formats. A line a
// run only partly fills is never streamed: a write-combining buffer flushed with part of
// its line costs a partial write of the line, and the run beside it writes the rest. A
// scatter of NHD -> HND's 520,256 runs of 256 B into a cache whose tensors start 16 bytes
// into a line (bench-pd's, numpy's allocation) took 64 ms streaming from the first 32-byte
// boundary, 30 ms into the same cache line-aligned (one process, taking turns, 2026-12-07).
struct StreamCopy {
  // 128 bytes, each 32-byte load followed by its streaming store. Against four loads then
  // four stores, in copy_runs_body and a bare loop per run (a standalone program, one
  // thread, the shapes taking turns in one process, a fresh run list per copy, 15 rounds,
  // median ratio and p25-p75): scattered 32 KiB runs of a 2 GiB pool, prefetching, 1.10x
  // (1.10-1.11), 16 KiB runs 1.07x (1.07-1.09); without prefetching 1.02-1.08x; a flat
  // 128 MiB copy 1.01x (1.00-1.02); 256-byte HND runs and lanes alike (0.99-1.02x). Two
  // and two measured as one and one; eight and eight lost 20% on the flat copy.
  __attribute__((target("avx2"), always_inline)) static void stream128(char* dst, const char* src) {
    for (int at = 0; at < 128; at += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + at),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + at)));
  }
  // One 64-byte line: two 32-byte loads, then two streaming stores.
  __attribute__((target("avx2"), always_inline)) static void stream64(char* dst, const char* src) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
  }
  // The bytes of n at dst before its first whole 64-byte line (all n where it has none).
  static std::size_t line_head(const char* dst, std::size_t n) {
    return std::min(n, (64 - reinterpret_cast<std::uintptr_t>(dst) % 64) % 64);
  }
  __attribute__((target("avx2"))) static void copy(char* dst, const char* src, std::size_t n) {
    const std::size_t head = line_head(dst, n);
    if (head != 0) {
      std::memcpy(dst, src, head);
      dst += head, src += head, n -= head;
    }
    for (; n >= 128; dst += 128, src += 128, n -= 128) {
      stream128(dst, src);
    }
    if (n >= 64) stream64(dst, src), dst += 64, src += 64, n -= 64;
    if (n != 0) std::memcpy(dst, src, n);  // part of the last line
  }
  // Copies n bytes while prefetching the n bytes at `ahead`, two lines per 128 bytes
  // copied: prefetches spread over the copy, not issued in bursts between its pieces
  // (scattered 32 KiB runs: 0.82-0.91x a flat streaming copy against 0.68-0.77x with
  // bursts every 2 KiB, measured in one process, taking turns).
  __attribute__((target("avx2"))) static void copy_prefetching(char* dst, const char* src, std::size_t n,
                                                                std::uint64_t ahead) {
    if (n == 0) return;
    prefetch_once(ahead + n - 1);  // the last line, which the loop's pairs may not reach
    const std::size_t head = line_head(dst, n);
    if (head != 0) {
      std::memcpy(dst, src, head);
      dst += head, src += head, n -= head, ahead += head;
    }
    for (; n >= 128; dst += 128, src += 128, n -= 128, ahead += 128) {
      prefetch_once(ahead);
      prefetch_once(ahead + 64);
      stream128(dst, src);
    }
    if (n != 0) prefetch_once(ahead), copy(dst, src, n);
  }
  // Streaming stores are weakly ordered: fence them before the copy reports done.
  static void finish() { _mm_sfence(); }
};

inline bool can_stream() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#else
inline bool can_stream() { return false; }
#endif

// How many source bytes after a jump a line cursor prefetches before it leaves the
// stream to the hardware prefetcher: a whole block slab of the benchmarks' caches, the
// longest 64 KiB (fused K/V NHD; with 32 KiB its listed stores measured 0.70-0.77x a flat
// streaming copy, with 64 KiB 0.85-0.91x).
inline constexpr std::uint64_t kStreamStart = 64 << 10;

// A cursor through a run list kLineLead bytes ahead of its copy, naming the source bytes
// the copy prefetches as it goes: the first kStreamStart bytes after each jump of the
// source (a run that does not start where the last one ended), across runs. It moves in
// stretches, each prefetched whole or not at all, so the copy can prefetch a stretch's
// lines in step with its own (StreamCopy::copy_prefetching).
class RunLines {
 public:
  RunLines(const ByteRun* runs, std::size_t n) : run_(runs), end_(runs + n) { enter(~std::uint64_t{0}); }

  std::uint64_t position() const { return covered_; }  // bytes of the list passed

  // The source address the cursor stands at, where the stretch is to be prefetched; 0
  // where it is not (a source streaming on, or past the list's end).
  std::uint64_t address() const { return run_ != end_ && fresh_ != 0 ? run_->src + offset_ : 0; }

  // The bytes left in the stretch the cursor stands in (unbounded past the list's end).
  std::uint64_t left() const {
    if (run_ == end_) return ~std::uint64_t{0};
    const std::uint64_t in_run = run_->len - offset_;
    return fresh_ != 0 ? std::min(in_run, fresh_) : in_run;
  }

  // Moves on `bytes`, at most left().
  void advance(std::uint64_t bytes) {
    covered_ += bytes;
    if (run_ == end_) return;
    offset_ += bytes;
    fresh_ -= std::min(fresh_, bytes);
    if (offset_ == run_->len) {
      const std::uint64_t last_end = run_->src + run_->len;
      ++run_;
      enter(last_end);
    }
  }

  // Moves on to `limit` without prefetching (a cursor that fell behind the copy: past
  // tiles, which stream without help).
  void skip_to(std::uint64_t limit) {
    while (covered_ < limit) advance(std::min(left(), limit - covered_));
  }

  // Moves on to `limit`, prefetching what it passes at once.
  void prefetch_to(std::uint64_t limit) {
    while (covered_ < limit) {
      const std::uint64_t piece = std::min(left(), limit - covered_), at = address();
      if (at != 0) prefetch_lines<prefetch_line>(at, piece);
      advance(piece);
    }
  }

 private:
  void enter(std::uint64_t last_end) {
    while (run_ != end_ && run_->len == 0) ++run_;
    offset_ = 0;
    if (run_ != end_ && run_->src != last_end) fresh_ = kStreamStart;
  }

  const ByteRun* run_;
  const ByteRun* end_;
  std::uint64_t offset_ = 0;   // into the cursor's run
  std::uint64_t covered_ = 0;  // bytes of the list passed
  std::uint64_t fresh_ = 0;    // source bytes still to prefetch since the last jump
};

// A cursor through a run list ahead of its copy that touches one line of each page either
// side reaches, for the page walk (see the top of this file): the first line of a run on
// each side, then the first of each page, each page once while the runs stay in it.
class RunPages {
 public:
  RunPages(const ByteRun* runs, std::size_t n) : run_(runs), end_(runs + n) {}

  // Moves a cursor that fell behind the copy (past tiles) on to `limit`, touching nothing.
  void skip_to(std::uint64_t limit) {
    while (run_ != end_ && covered_ + (run_->len - offset_) <= limit) {
      covered_ += run_->len - offset_;
      offset_ = 0;
      ++run_;
    }
    if (run_ != end_ && covered_ < limit) offset_ += limit - covered_, covered_ = limit;
  }

  void up_to(std::uint64_t limit) {
    while (covered_ < limit && run_ != end_) {
      const std::uint64_t src = run_->src + offset_, dst = run_->dst + offset_;
      if (src / kPage != src_page_) prefetch_line(src), src_page_ = src / kPage;
      if (dst / kPage != dst_page_) prefetch_destination(dst), dst_page_ = dst / kPage;
      const std::uint64_t piece = std::min({run_->len - offset_, kPage - src % kPage, kPage - dst % kPage});
      offset_ += piece;
      covered_ += piece;
      if (offset_ == run_->len) ++run_, offset_ = 0;
    }
  }

 private:
  const ByteRun* run_;
  const ByteRun* end_;
  std::uint64_t offset_ = 0;   // into the cursor's run
  std::uint64_t covered_ = 0;  // bytes of the list passed
  std::uint64_t src_page_ = ~std::uint64_t{0}, dst_page_ = ~std::uint64_t{0};  // touched last
};

// Tiles: a block map between layouts that order heads and tokens differently (NHD into
// HND) lists, in destination order, short runs whose sources step by a token's row while
// their destinations follow each other: runs (a, b) = a * cols + b of length L read
// src + a * L + b * stride and write dst + (a * cols + b) * L. Copied in that order the
// source is read in `rows` interleaved strided streams; copied column by column (b outer)
// it reads one stream, the destination taking full-line streaming stores in any order.
// Measured on 256 B runs of NHD -> HND blocks: 1.6x the destination-order copy.
struct Tile {
  std::uint64_t src, dst, len, stride;
  std::size_t rows = 0, cols = 0;  // rows 0: not a tile
  ByteRun rest{};  // what is left of the tile's last run, when it runs on (len 0: nothing)
  std::uint64_t bytes() const { return len * rows * cols; }
};

// Runs longer than this are copied in list order: a long run streams on its own.
inline constexpr std::uint64_t kTileRunMax = 2048;
// A tile of more columns than this is copied in list order. Copied column by column, a
// tile writes `rows` streams `cols` runs apart: NHD blocks of 16 into HND blocks of 64
// (8 x 64 tiles of 256 B runs, consecutive ids, bench-maps' cold caches, A/B in one
// session) copied at 12.1-12.3 GB/s (0.85-0.88x the C copy of the same runs) by columns,
// 14.2-14.6 GB/s (1.00-1.02x) in list order; tiles of 16 columns (HND blocks of 16) keep
// their 1.2x.
inline constexpr std::size_t kTileColsMax = 32;

// The tile that starts at `first` and goes on through runs[0..n), if at least 2 x 2 runs
// form one; else rows 0, and cols says how many runs (first included) the search looked
// at, so the next search starts after them (a list is scanned once). Where the blocks of
// both sides follow each other the last run of a tile and the first of the next are one
// run: the tile's last run may be longer (Tile::rest is the rest of it), and the caller
// passes as `first` the last L bytes of a run longer than the next.
inline Tile find_tile(const ByteRun& first, const ByteRun* runs, std::size_t n) {
  Tile t{first.src, first.dst, first.len, 0, 0, 1};
  if (n < 3 || t.len == 0 || t.len > kTileRunMax) return t;
  t.stride = runs[0].src - t.src;
  const auto run = [&](std::size_t j) -> const ByteRun& { return j == 0 ? first : runs[j - 1]; };
  const auto starts = [&](std::size_t j, std::uint64_t a, std::uint64_t b) {
    return run(j).dst == t.dst + j * t.len && run(j).src == t.src + a * t.len + b * t.stride;
  };
  std::size_t cols = 1;
  while (cols <= n && run(cols).len == t.len && starts(cols, 0, cols)) ++cols;
  t.cols = cols;
  if (cols < 2 || t.stride == t.len || cols > kTileColsMax) return t;
  std::size_t rows = 1;
  for (; (rows + 1) * cols <= n + 1; ++rows) {
    bool row = true;
    for (std::size_t b = 0; b < cols && row; ++b) {
      const std::uint64_t len = run(rows * cols + b).len;
      row = starts(rows * cols + b, rows, b) && (len == t.len || (b == cols - 1 && len > t.len));
    }
    if (!row) break;
    const ByteRun& last = run(rows * cols + cols - 1);
    if (last.len > t.len) {  // runs on into what follows the tile: the tile ends here
      t.rest = ByteRun{last.src + t.len, last.dst + t.len, last.len - t.len};
      ++rows;
      break;
    }
  }
  if (rows >= 2) t.rows = rows;
  return t;
}

// The tile that starts in run r (runs[i], or what a tile before left of it) and goes on
// through runs[i + 1..n), in `head` the bytes of r before it; rows 0 where none does, and
// then cols says how many runs (r included) the search looked at.
inline Tile tile_at(const ByteRun& r, const ByteRun* runs, std::size_t n, std::size_t i, std::uint64_t& head) {
  // A run longer than the next may end in a tile's first run.
  const std::uint64_t next = runs[i + 1].len;
  head = r.len > next && next != 0 ? r.len - next : 0;
  return find_tile(ByteRun{r.src + head, r.dst + head, r.len - head}, runs + i + 1, n - i - 1);
}

// Walks runs[0..n) in order, each tile found there going to on_tile(tile, the index of its
// first run) and every other run, or piece of one a tile leaves, to on_run(run): the one
// scan for tiles.
template <class OnTile, class OnRun>
[[gnu::always_inline]] inline void scan_tiles(const ByteRun* runs, std::size_t n, OnTile on_tile, OnRun on_run) {
  std::size_t untiled = 0;  // runs before this one were searched already
  ByteRun left{};           // the rest of runs[i] after a tile, when len != 0
  for (std::size_t i = 0; i < n;) {
    const ByteRun r = left.len != 0 ? left : runs[i];
    left = ByteRun{};
    if (i >= untiled && i + 1 < n && r.len != 0) {
      std::uint64_t head = 0;
      const Tile tile = tile_at(r, runs, n, i, head);
      if (tile.rows != 0) {
        if (head != 0) on_run(ByteRun{r.src, r.dst, head});
        on_tile(tile, i);
        i += tile.rows * tile.cols - 1;  // the tile's last run
        left = tile.rest;
        if (left.len == 0) ++i;
        continue;
      }
      untiled = i + tile.cols;
    }
    on_run(r);
    ++i;
  }
}

// The index of the run in which scan_tiles finds its first tile, n where it finds none:
// the runs before it are copied as they are listed. Searched before the copy, not between
// its runs: bench-maps' HND -> DCP 4 (256-byte runs, a tile search every 4 runs, none
// found) copied at 0.91-0.98x the C copy of the same runs with the search between them,
// 1.10-1.18x with it done first, 1.24-1.29x with no search at all, as a bare loop of
// streaming stores does (one process, the copies taking turns, caches cold).
inline std::size_t first_tile(const ByteRun* runs, std::size_t n) {
  std::size_t untiled = 0;  // as scan_tiles'
  for (std::size_t i = 0; i + 1 < n; ++i) {
    if (i < untiled || runs[i].len == 0) continue;
    std::uint64_t head = 0;
    const Tile tile = tile_at(runs[i], runs, n, i, head);
    if (tile.rows != 0) return i;
    untiled = i + tile.cols;
  }
  return n;
}

// Copies a tile column by column (see Tile).
template <class Copy>
[[gnu::always_inline]] inline void copy_tile(const Tile& t) {
  for (std::size_t b = 0; b < t.cols; ++b)
    for (std::size_t a = 0; a < t.rows; ++a)
      Copy::copy(reinterpret_cast<char*>(t.dst + (a * t.cols + b) * t.len),
                 reinterpret_cast<const char*>(t.src + a * t.len + b * t.stride), t.len);
}

// How often (bytes copied) the page cursor moves on, and the longest piece a run is
// copied in between.
inline constexpr std::uint64_t kLookaheadStep = 2048;

// A stretch of the line cursor shorter than this is prefetched at once as the cursor
// reaches it, a longer one in step with the copy. Measured in one process, the ways
// taking turns, on scattered runs of a 4 GiB pool against a flat streaming copy: in step
// took 32 KiB runs from 0.72-0.78x (bursts every 2 KiB) to 0.80-0.86x and 16 KiB runs
// from 0.67-0.70x to 0.71-0.74x, but 2-4 KiB runs from 0.5-0.7x to 0.35-0.5x, where each
// run is a page walk and the bursts do better; 16 KiB stretches in bursts measured 0.58x.
inline constexpr std::uint64_t kSmoothMin = 8 << 10;

// Copies runs[0..n) in order, with Prefetch the line cursor kLineLead ahead (its lines
// prefetched in step with the copy) and the page cursor kPageLead ahead, each tile column
// by column without them; unfenced.
template <class Copy, bool Prefetch>
[[gnu::always_inline]] inline void copy_runs_body(const ByteRun* runs, std::size_t n) {
  RunLines lines(runs, n);
  RunPages pages(runs, n);
  std::uint64_t done = 0, next_step = 0;  // bytes of the list copied; where the page cursor moves next
  if constexpr (Prefetch) lines.prefetch_to(kLineLead);
  const auto copy_run = [&](const ByteRun& run) {
    auto* dst = reinterpret_cast<char*>(run.dst);
    const auto* src = reinterpret_cast<const char*>(run.src);
    const std::uint64_t len = run.len;
    if constexpr (!Prefetch) {
      Copy::copy(dst, src, len);
    } else {
      for (std::uint64_t at = 0; at < len;) {
        if (done + at >= next_step) {
          pages.skip_to(done + at);
          pages.up_to(done + at + kPageLead);
          next_step = done + at + kLookaheadStep;
          // After a tile the line cursor is behind: it catches up at once.
          if (lines.position() < done + at + kLineLead) {
            lines.skip_to(done + at);
            lines.prefetch_to(done + at + kLineLead);
          }
        }
        const std::uint64_t due = done + at + kLineLead;  // where the line cursor belongs
        while (lines.address() != 0 && lines.left() < kSmoothMin && lines.position() <= due)
          lines.prefetch_to(lines.position() + lines.left());
        if (lines.position() > due) {  // ahead, past short stretches: copy on until it is due
          const std::uint64_t piece = std::min({len - at, next_step - (done + at), lines.position() - due});
          Copy::copy(dst + at, src + at, piece);
          at += piece;
          continue;
        }
        const std::uint64_t piece = std::min({len - at, next_step - (done + at), lines.left()});
        const std::uint64_t ahead = lines.address();
        if (ahead != 0) {
          Copy::copy_prefetching(dst + at, src + at, piece, ahead);
        } else {
          Copy::copy(dst + at, src + at, piece);
        }
        lines.advance(piece);
        at += piece;
      }
    }
    done += len;
  };
  // A tile's runs have disjoint destinations, so its order leaves the same bytes.
  const auto copy_tile_of_runs = [&](const Tile& tile, std::size_t) {
    copy_tile<Copy>(tile);
    done += tile.bytes();
    next_step = done;  // the cursors catch up at the next step
  };
  // The runs before the first tile in a loop of their own, the rest through the scan.
  const std::size_t tiled = first_tile(runs, n);
  for (std::size_t i = 0; i < tiled; ++i) copy_run(runs[i]);
  if (tiled < n) scan_tiles(runs + tiled, n - tiled, copy_tile_of_runs, copy_run);
}

// Lanes: a run list whose destinations never overlap may be copied in any order, and one
// core reads a source that jumps every few KiB faster as several streams at once than one
// run after another. The list falls into source stretches (runs whose sources continue
// each other); lane k takes stretches k, k + kLanes, k + 2 kLanes, ..., and the copy takes
// up to kLaneStep bytes of each lane in turn, each lane prefetching its own source
// kLaneLead bytes ahead (on into its next stretch) and touching its destination's pages
// as it goes.
//
// Measured on this project's VM in a model (scattered runs of a 4 GiB pool on 4 KiB pages,
// one thread, the ways taking turns in one process, against a flat streaming copy of the
// same bytes), a scattered source into one buffer, in order -> in lanes: 1 KiB runs 0.21x
// -> 0.33x, 4 KiB 0.39x -> 0.64x, 8 KiB 0.45x -> 0.76x, 16 KiB 0.59x -> 0.81x, 32 KiB 0.74x
// -> 0.90x, 128 KiB 0.81x -> 0.94x, 512 KiB 0.94x -> 0.97x; both sides scattered, 32 KiB
// 0.71x -> 0.92x. Four lanes beat eight and 256-byte steps longer ones (at 32 KiB, 8 lanes:
// 0.74-0.83x; 1 KiB steps 0.80x, 4 KiB 0.65x). Neighbouring stretches go side by side:
// lanes of equal bytes (the list cut in kLanes parts) read the same block of kLanes layers
// at once, whose addresses lie a multiple of a layer's tensor apart and share cache sets
// (bench-transfer's store in the model: 0.84-0.87x, neighbours 0.91-0.93x); lanes of
// neighbouring runs would read one stretch of short runs (a head slice's rows) in kLanes
// places at once. Runs of 2 MiB stream as well alone (0.97x in order, 0.95x in lanes; the
// bound below 512 KiB, where lanes still measured 0.97x against 0.94x, errs on the side
// of the order), and a source that streams on (one buffer into scattered runs) is read
// faster as the one stream it is (32 KiB runs: 0.83x in order, 0.74x in lanes): so a list
// is copied in lanes only where its source jumps every kLaneStretchMin to kLaneStretchMax
// bytes on average.
inline constexpr std::size_t kLanes = 4;
inline constexpr std::uint64_t kLaneStep = 256;
inline constexpr std::uint64_t kLaneLead = 2048;
// The mean source stretch (bytes between two jumps of the source) over which a list is
// copied in lanes, and the least it moves.
// Not under 2 KiB: bench-maps' TP 1 -> 2 in NHD reads every other KiB of its source rows
// (a head slice), which the hardware prefetcher follows in order; in lanes it measured
// 0.46-0.49x a flat stream against 0.51-0.54x, though scattered 1 KiB runs gained in the
// model above.
inline constexpr std::uint64_t kLaneStretchMin = 2 << 10, kLaneStretchMax = 256 << 10;
inline constexpr std::uint64_t kLaneMinBytes = kLanes * (64 << 10);

// Whether a non-empty run starts a source stretch: its source does not go on from where
// the last non-empty run's ended (`next`, which it moves on).
inline bool starts_stretch(const ByteRun& run, std::uint64_t& next) {
  const bool jumps = run.src != next;
  next = run.src + run.len;
  return jumps;
}

// The runs of a list in stretches: runs[starts[s]..starts[s + 1]) is stretch s, runs whose
// sources continue each other (empty runs belong to the stretch before them).
inline std::vector<std::size_t> source_stretches(const ByteRun* runs, std::size_t n) {
  std::vector<std::size_t> starts;
  std::uint64_t next = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (runs[i].len == 0) continue;
    const bool jumps = starts_stretch(runs[i], next);
    if (starts.empty()) {
      starts.push_back(0);  // the first stretch holds any empty runs before it
    } else if (jumps) {
      starts.push_back(i);
    }
  }
  starts.push_back(n);
  return starts;
}

// The source stretches of a run list, as a Lane walks them: a cursor enters a stretch at
// its first non-empty run and moves on run by run.
class RunStretches {
 public:
  RunStretches(const ByteRun* runs, std::size_t n) : runs_(runs), starts_(source_stretches(runs, n)) {}

  std::size_t size() const { return starts_.size() - 1; }

  // A run list's destinations run forward within a stretch (see Lane::touch_pages).
  static constexpr bool kDestinationsReturn = false;

  struct Cursor {
    const ByteRun* run = nullptr;
    const ByteRun* end = nullptr;  // past the stretch's last run
  };

  // Puts c at the first non-empty run of stretch s, that run in `run`; false where none.
  bool enter(Cursor& c, std::size_t s, ByteRun& run) const {
    c.run = runs_ + starts_[s];
    c.end = runs_ + starts_[s + 1];
    return at_run(c, run);
  }

  // Moves c on to the next non-empty run of its stretch, in `run`; false past its end.
  bool next(Cursor& c, ByteRun& run) const {
    ++c.run;
    return at_run(c, run);
  }

 private:
  static bool at_run(Cursor& c, ByteRun& run) {
    for (; c.run != c.end; ++c.run) {
      if (c.run->len != 0) {
        run = *c.run;
        return true;
      }
    }
    return false;
  }

  const ByteRun* runs_;
  std::vector<std::size_t> starts_;
};

// One lane: every kLanes-th stretch of `Stretches` (RunStretches, or the transfer's nested
// moves) from stretch `first` on, with a copy position and a prefetch position kLaneLead
// ahead.
template <class Stretches>
class Lane {
 public:
  Lane() = default;
  Lane(const Stretches& stretches, std::size_t first) : stretches_(&stretches) {
    enter(copy_, first);
    ahead_ = copy_;
  }

  bool done() const { return copy_.run.len == 0; }

  // Prefetches the lane's first kLaneLead bytes.
  void prefetch_lead() { prefetch(kLaneLead); }

  // Copies the next piece (at most kLaneStep bytes, ending on a kLaneStep boundary of the
  // destination, so the pieces after a run's first are aligned), and with Prefetch moves
  // the prefetch position on as much.
  template <class Copy, bool Prefetch>
  [[gnu::always_inline]] void step() {
    const std::uint64_t piece = std::min(copy_.run.len, kLaneStep - copy_.run.dst % kLaneStep);
    Copy::copy(reinterpret_cast<char*>(copy_.run.dst), reinterpret_cast<const char*>(copy_.run.src), piece);
    move(copy_, piece);
    if constexpr (Prefetch) prefetch(piece);
  }

 private:
  struct Position {
    ByteRun run{};  // what is left of the current run (len 0: past the lane's end)
    typename Stretches::Cursor cursor{};
    std::size_t stretch = 0;
  };

  // Puts p at the first byte of stretch s, or of the lane's next one with bytes, or past
  // the lane's end.
  void enter(Position& p, std::size_t s) const {
    for (; s < stretches_->size(); s += kLanes) {
      if (stretches_->enter(p.cursor, s, p.run)) {
        p.stretch = s;
        return;
      }
    }
    p.run.len = 0;
  }

  // Moves p on `bytes`, at most what is left of its run.
  void move(Position& p, std::uint64_t bytes) const {
    p.run.src += bytes, p.run.dst += bytes, p.run.len -= bytes;
    if (p.run.len != 0) return;
    if (!stretches_->next(p.cursor, p.run)) enter(p, p.stretch + kLanes);
  }

  // Moves the prefetch position on `bytes`, prefetching each source line it passes and
  // touching each destination page it enters.
  void prefetch(std::uint64_t bytes) {
    while (bytes != 0 && ahead_.run.len != 0) {
      const std::uint64_t piece = std::min(bytes, ahead_.run.len), src = ahead_.run.src, dst = ahead_.run.dst;
      prefetch_lines<prefetch_once>(src, piece);
      touch_pages(dst, piece);
      move(ahead_, piece);
      bytes -= piece;
    }
  }

  // Touches one line of each destination page [dst, dst + bytes) reaches, unless the lane
  // touched it last: the last page, or where the stretches' destinations step back and
  // forth across a few pages (Stretches::kDestinationsReturn: a head-major block's rows,
  // 256 bytes at a time), the range of pages touched last, so each is touched once.
  void touch_pages(std::uint64_t dst, std::uint64_t bytes) {
    const std::uint64_t first = dst / kPage, last = (dst + bytes - 1) / kPage;
    if constexpr (Stretches::kDestinationsReturn) {
      if (first >= pages_.first && last <= pages_.last) return;
    } else {
      if (last == pages_.last) return;
    }
    for (std::uint64_t page = first; page <= last; ++page) {
      if (page >= pages_.first && page <= pages_.last) continue;
      prefetch_destination(std::max(dst, page * kPage));
      if (Stretches::kDestinationsReturn && page == pages_.last + 1) {
        pages_.last = page;
      } else if (Stretches::kDestinationsReturn && page + 1 == pages_.first) {
        pages_.first = page;
      } else {
        pages_ = {page, page};
      }
    }
  }

  const Stretches* stretches_ = nullptr;
  Position copy_, ahead_;
  struct {
    std::uint64_t first = 1, last = 0;  // first > last: none yet
  } pages_;  // the destination pages touched last (one, unless Stretches::kDestinationsReturn)
};

// Whether `bytes` in `stretches` source stretches are worth copying in lanes: at least
// kLaneMinBytes, and a source that jumps every kLaneStretchMin to kLaneStretchMax bytes on
// average.
inline bool lanes_pay(std::uint64_t bytes, std::uint64_t stretches) {
  return bytes >= kLaneMinBytes && bytes >= kLaneStretchMin * stretches && bytes < kLaneStretchMax * stretches;
}

// The bytes of runs[0..n) where they are worth copying in lanes (lanes_pay), else 0.
inline std::uint64_t lane_bytes(const ByteRun* runs, std::size_t n) {
  std::uint64_t total = 0, stretches = 0, next = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (runs[i].len == 0) continue;
    stretches += starts_stretch(runs[i], next);
    total += runs[i].len;
  }
  return lanes_pay(total, stretches) ? total : 0;
}

// Copies the stretches' runs, whose destinations must not overlap, in kLanes lanes (see
// Lane); unfenced.
template <class Copy, bool Prefetch, class Stretches>
[[gnu::always_inline]] inline void copy_in_lanes(const Stretches& stretches) {
  Lane<Stretches> lanes[kLanes];
  for (std::size_t k = 0; k < kLanes; ++k) {
    lanes[k] = Lane<Stretches>(stretches, k);
    if constexpr (Prefetch) lanes[k].prefetch_lead();
  }
  for (bool more = true; more;) {
    more = false;
    for (Lane<Stretches>& lane : lanes) {
      if (lane.done()) continue;
      lane.template step<Copy, Prefetch>();
      more = true;
    }
  }
}

// Copies runs[0..n), whose destinations must not overlap, in kLanes lanes; unfenced.
template <class Copy, bool Prefetch>
[[gnu::always_inline]] inline void copy_runs_in_lanes(const ByteRun* runs, std::size_t n) {
  copy_in_lanes<Copy, Prefetch>(RunStretches(runs, n));
}

// The run-list copies, each compiled once on its own: inlined into the transfer's listed
// walk (a flattened whole), the same body copied a model of bench-transfer's NHD stores
// at 0.74-0.83x a flat stream against 0.77-0.91x called (medians of 11, the two taking
// turns, five runs).
template <bool Prefetch>
__attribute__((noinline)) void copy_runs_plain(const ByteRun* runs, std::size_t n) {
  copy_runs_body<PlainCopy, Prefetch>(runs, n);
}

#if defined(KVLAYOUT_STREAM_STORES)
template <bool Prefetch>
__attribute__((target("avx2"), flatten, noinline)) void copy_runs_stream(const ByteRun* runs, std::size_t n) {
  copy_runs_body<StreamCopy, Prefetch>(runs, n);
}

__attribute__((target("avx2"), flatten, noinline)) inline void copy_runs_stream_in_lanes(const ByteRun* runs,
                                                                                       std::size_t n) {
  copy_runs_in_lanes<StreamCopy, true>(runs, n);
}
#endif

// How a run list may be copied: in list order (a later run wins where two overlap), or,
// where no two destinations overlap, in any order (in lanes where that pays: streaming
// stores, prefetching).
enum class Order : bool { kListed = false, kAny = true };

// Copies runs[0..n) with Copy's stores, the cursors ahead when Prefetch; unfenced.
template <class Copy, bool Prefetch, Order kOrder = Order::kListed>
void copy_runs_with(const ByteRun* runs, std::size_t n) {
#if defined(KVLAYOUT_STREAM_STORES)
  if constexpr (std::is_same_v<Copy, StreamCopy>) {
    if constexpr (Prefetch && kOrder == Order::kAny) {
      if (lane_bytes(runs, n) != 0) return copy_runs_stream_in_lanes(runs, n);
    }
    return copy_runs_stream<Prefetch>(runs, n);
  }
#endif
  copy_runs_plain<Prefetch>(runs, n);
}

// Copies runs[0..n) with streaming stores when `streaming` and the CPU has them, else
// with memcpy, with the cursors ahead when `prefetch`, in `order`, and fences what it
// streamed.
inline void copy_runs(bool streaming, const ByteRun* runs, std::size_t n, bool prefetch = true,
                      Order order = Order::kListed) {
#if defined(KVLAYOUT_STREAM_STORES)
  if (streaming && can_stream()) {
    if (!prefetch)
      copy_runs_with<StreamCopy, false>(runs, n);
    else if (order == Order::kAny)
      copy_runs_with<StreamCopy, true, Order::kAny>(runs, n);
    else
      copy_runs_with<StreamCopy, true>(runs, n);
    StreamCopy::finish();
    return;
  }
#endif
  (void)streaming, (void)order;
  prefetch ? copy_runs_plain<true>(runs, n) : copy_runs_plain<false>(runs, n);
}

#if defined(KVLAYOUT_STREAM_STORES)
// The benchmarks' yardstick: one range with 32-byte loads and non-temporal stores and no
// software prefetch, what a flat streaming copy of the same bytes reaches.
__attribute__((target("avx2"))) inline void flat_stream_avx2(char* dst, const char* src, std::size_t n) {
  StreamCopy::copy(dst, src, n);
  StreamCopy::finish();
}
#endif

// One range, as the benchmarks' flat streaming baseline (memcpy without AVX2).
inline void flat_stream(char* dst, const char* src, std::size_t n) {
#if defined(KVLAYOUT_STREAM_STORES)
  if (can_stream()) return flat_stream_avx2(dst, src, n);
#endif
  std::memcpy(dst, src, n);
}

}  // namespace stream

// Copies runs[0..n) in `order`: listed (a later run wins where two overlap; a tile's runs,
// which never overlap each other, go in source order), or any (no two destinations may
// overlap), with 32-byte loads and non-temporal stores where the CPU has AVX2, memcpy
// otherwise, with `prefetch` the cursors ahead of the copy (which the callers choose by
// measuring: prefetch_choice.h); fenced before it returns. Runs may be unaligned or
// empty; sources and destinations must not overlap each other.
inline void copy_byte_runs(const ByteRun* runs, std::size_t n, bool prefetch = true,
                           stream::Order order = stream::Order::kListed) {
  stream::copy_runs(true, runs, n, prefetch, order);
}

}  // namespace kvlayout
