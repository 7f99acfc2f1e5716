#pragma once
// The block transfer's plan, shared by the CPU engine (csrc/transfer.h) and the CUDA
// kernels (csrc/cuda/transfer_kernels.cu), so both move exactly the same bytes.
//
// A job's copy (the layout algebra's copy plan, from kvlayout/transfer/plan.py) is resolved
// once, on the host, into segments: one per (kv, layer, piece). A segment knows where it
// starts in the cache (a pointer-table entry, a byte offset at block 0 and a byte step
// per block id, all from the generated indexer) and in the chunk (its slab kv*NL + layer
// and a byte offset in the block's first token row), and its loop nest of contiguous
// runs. Nothing is located per block or per byte after that.
//
// Inside a segment every position and offset fits 31 bits (checked when it is built), so
// the device splits a byte position into (run, byte) and the run index into loop digits
// with 32-bit multiply-shift divisions by divisors fixed at plan time.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvlayout/host_device.h"
#include "kvlayout/indexing.cuh"

namespace kvlayout::plan {

inline constexpr int kMaxLoops = 4;
inline constexpr std::uint64_t kMaxSegmentBytes = std::uint64_t{1} << 31;  // positions are < 2^31

// n / divisor for n < 2^31 as one widening multiply and a shift (Granlund-Montgomery):
// multiplier = ceil(2^shift / divisor), shift = 31 + ceil(log2 divisor).
struct FastDiv {
  std::uint32_t divisor;
  std::uint32_t multiplier;
  std::uint32_t shift;

  KVLAYOUT_HOST_DEVICE std::uint32_t div(std::uint32_t n) const {
    return static_cast<std::uint32_t>((static_cast<std::uint64_t>(n) * multiplier) >> shift);
  }
};

struct Loop {
  FastDiv extent;
  std::uint32_t chunk_stride;  // bytes
  std::uint32_t cache_stride;  // bytes
};

struct Segment {
  std::int64_t cache_offset;   // bytes from its pointer at block id 0
  std::int64_t block_step;     // bytes from one block id to the next
  std::uint32_t pointer;       // entry of the job's pointer table
  std::uint32_t slab;          // kv * num_layers + layer: the chunk slab it fills
  std::uint32_t chunk_offset;  // bytes from the block's first token row in that slab
  std::uint32_t bytes;         // bytes per block: the runs times the run
  FastDiv run;                 // contiguous bytes per copy
  std::uint32_t num_loops;
  Loop loops[kMaxLoops];       // outermost first
};

// The table crosses from the host compiler to the device compiler as bytes.
static_assert(sizeof(FastDiv) == 12 && sizeof(Loop) == 20, "plan structs are packed tables");
static_assert(sizeof(Segment) == 128 && offsetof(Segment, loops) == 48, "plan structs are packed tables");

// The first cache byte of a segment of block id `block`, from its pointer's address.
KVLAYOUT_HOST_DEVICE inline std::uint64_t cache_start(const Segment& s, std::uint64_t pointer, std::int64_t block) {
  return pointer + static_cast<std::uint64_t>(s.cache_offset + block * s.block_step);
}

// The first chunk byte of a segment whose block starts at token `first_token` of a chunk
// of `tokens` tokens with rows of `row_bytes`.
KVLAYOUT_HOST_DEVICE inline std::uint64_t chunk_start(const Segment& s, std::uint64_t chunk, std::int64_t tokens,
                                                      std::int64_t first_token, std::int64_t row_bytes) {
  return chunk + static_cast<std::uint64_t>((s.slab * tokens + first_token) * row_bytes + s.chunk_offset);
}

// The bytes from a segment's first cache byte to past its last (its bytes, when dense).
KVLAYOUT_HOST_DEVICE inline std::int64_t cache_extent(const Segment& s) {
  std::int64_t end = s.run.divisor;
  for (std::uint32_t l = 0; l < s.num_loops; ++l)
    end += static_cast<std::int64_t>(s.loops[l].extent.divisor - 1) * s.loops[l].cache_stride;
  return end;
}

// The bytes from a segment's first chunk byte to past its last.
KVLAYOUT_HOST_DEVICE inline std::int64_t chunk_extent(const Segment& s) {
  std::int64_t end = s.run.divisor;
  for (std::uint32_t l = 0; l < s.num_loops; ++l)
    end += static_cast<std::int64_t>(s.loops[l].extent.divisor - 1) * s.loops[l].chunk_stride;
  return end;
}

struct Offsets {
  std::uint32_t chunk;
  std::uint32_t cache;
};

// Where byte `pos` (< s.bytes) of a segment lies, from its two starts: the run it is in,
// split into loop digits innermost first, plus its place in the run. Compiled for at most
// Depth loops (s.num_loops <= Depth), so shallow plans carry no deeper loop's state.
template <int Depth>
KVLAYOUT_HOST_DEVICE inline Offsets offsets_at(const Segment& s, std::uint32_t pos) {
  std::uint32_t r = s.run.div(pos);
  const std::uint32_t within = pos - r * s.run.divisor;
  Offsets o{within, within};
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int l = Depth - 1; l >= 0; --l) {
    if (l < static_cast<int>(s.num_loops)) {
      const Loop& loop = s.loops[l];
      const std::uint32_t q = loop.extent.div(r);
      const std::uint32_t digit = r - q * loop.extent.divisor;
      o.chunk += digit * loop.chunk_stride;
      o.cache += digit * loop.cache_stride;
      r = q;
    }
  }
  return o;
}

// -- the CUDA grid ------------------------------------------------------------------------
// Thread block (x, y) moves segment y of the (skip + x)-th block of the call; its threads
// stride over the segment in `unit`-byte steps, `kUnroll` units in flight each. Kernels
// are compiled for loop nests of depth 0 (whole-block runs), 2 (head-major blocks) and
// kMaxLoops (anything).

inline constexpr int kUnroll = 4;
inline constexpr std::uint32_t kMaxThreads = 256;

// The depth a job's kernels are compiled for: the shallowest that holds every segment.
inline int depth_for(const Segment* segments, std::size_t n) {
  std::uint32_t deepest = 0;
  for (std::size_t i = 0; i < n; ++i) deepest = deepest > segments[i].num_loops ? deepest : segments[i].num_loops;
  return deepest == 0 ? 0 : deepest <= 2 ? 2 : kMaxLoops;
}

template <int D>
struct Depth {
  static constexpr int value = D;
};

// Calls f(Depth<D>{}) with the compiled depth D that serves `depth` (see depth_for).
template <class F>
inline void with_depth(int depth, F&& f) {
  if (depth == 0) {
    f(Depth<0>{});
  } else if (depth <= 2) {
    f(Depth<2>{});
  } else {
    f(Depth<kMaxLoops>{});
  }
}

struct Task {
  std::int64_t block;         // the block id
  std::uint32_t chunk;        // which chunk
  std::uint32_t first_token;  // where the block starts in it
};

KVLAYOUT_HOST_DEVICE inline Task task_of(const std::int64_t* block_ids, std::uint32_t skip, std::uint32_t x,
                                         std::uint32_t blocks_per_chunk, std::uint32_t block_size) {
  const std::uint32_t i = skip + x;
  const std::uint32_t chunk = i / blocks_per_chunk;
  return Task{block_ids[i], chunk, (i - chunk * blocks_per_chunk) * block_size};
}

// Calls copy(offsets, live) with kUnroll offsets per step, `live[k]` false past the end:
// thread `thread` of `threads` takes units thread, thread + threads, ... of the segment.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <int Depth, class Copy>
KVLAYOUT_HOST_DEVICE inline void for_each_unit(const Segment& s, std::uint32_t unit, std::uint32_t thread,
                                               std::uint32_t threads, Copy&& copy) {
  const std::uint32_t stride = threads * unit;
  for (std::uint32_t pos = thread * unit; pos < s.bytes; pos += stride * kUnroll) {
    Offsets o[kUnroll];
    bool live[kUnroll];
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int k = 0; k < kUnroll; ++k) {
      const std::uint32_t p = pos + static_cast<std::uint32_t>(k) * stride;
      live[k] = p < s.bytes;
      o[k] = offsets_at<Depth>(s, live[k] ? p : 0);
    }
    copy(o, live);
  }
}

// Threads per thread block: enough for the largest segment's units at kUnroll each, a
// power of two from a warp up to kMaxThreads.
inline std::uint32_t threads_for(std::uint32_t max_segment_bytes, std::uint32_t unit) {
  const std::uint64_t wanted = (std::uint64_t{max_segment_bytes} / unit + kUnroll - 1) / kUnroll;
  std::uint32_t threads = 32;
  while (threads < kMaxThreads && threads < wanted) threads *= 2;
  return threads;
}

// -- building (host) ----------------------------------------------------------------------

inline FastDiv fast_div(std::uint64_t divisor) {
  if (divisor == 0 || divisor > kMaxSegmentBytes) throw std::invalid_argument("a plan divisor is out of range");
  std::uint32_t log = 0;
  while ((std::uint64_t{1} << log) < divisor) ++log;
  const std::uint32_t shift = 31 + log;
  const std::uint64_t multiplier = ((std::uint64_t{1} << shift) + divisor - 1) / divisor;
  return FastDiv{static_cast<std::uint32_t>(divisor), static_cast<std::uint32_t>(multiplier), shift};
}

// One piece of a job's copy plan, in bytes (kvlayout.layout.algebra.Piece; loops outermost first).
struct PieceSpec {
  std::int64_t head;
  std::int64_t elem;
  std::int64_t chunk_offset;  // bytes from the token row's start in the chunk
  std::int64_t run;           // bytes
  int num_loops;
  std::int64_t extent[kMaxLoops];
  std::int64_t chunk_stride[kMaxLoops];
  std::int64_t cache_stride[kMaxLoops];
};

struct JobSpec {
  EngineKVFormat format;
  Sizes sizes;                // num_blocks(sizes) block ids exist
  std::int64_t block_stride;  // elements; 0 = tight
  std::int64_t element_size;  // bytes
  std::int64_t kv_size;
  std::int64_t num_layers;
  std::int64_t block_size;
  std::int64_t row_bytes;     // the chunk's whole token row
  std::vector<PieceSpec> pieces;
};

namespace detail {

[[noreturn]] inline void refuse(const std::string& what) { throw std::invalid_argument("transfer plan: " + what); }

inline std::uint32_t checked_u31(std::int64_t v, const char* what) {
  if (v < 0 || static_cast<std::uint64_t>(v) >= kMaxSegmentBytes) refuse(std::string(what) + " is outside [0, 2^31)");
  return static_cast<std::uint32_t>(v);
}

// The cache bytes a piece's loops from `first` on span (its run included); whether that
// and every stride of those loops fit a segment's 31 bits.
inline bool fits_from(const PieceSpec& p, int first) {
  std::int64_t end = p.run;
  for (int l = first; l < p.num_loops; ++l) {
    if (p.cache_stride[l] < 0 || static_cast<std::uint64_t>(p.cache_stride[l]) >= kMaxSegmentBytes) return false;
    end += (p.extent[l] - 1) * p.cache_stride[l];
    if (static_cast<std::uint64_t>(end) >= kMaxSegmentBytes) return false;
  }
  return true;
}

// At most this many segments come of one piece cut along its outer loops.
inline constexpr std::int64_t kMaxCuts = std::int64_t{1} << 16;

}  // namespace detail

// The segments of a job, in (kv, layer, piece) order. A piece whose cache bytes do not fit
// 31 bits (heads outside blocks: a head's blocks span most of a layer) is cut along its
// outermost loops, one segment per index of each cut loop. Refuses a plan the engines
// cannot walk: a block id that does not move its bytes by a fixed step on one pointer, or
// a segment whose positions or offsets still do not fit 31 bits.
inline std::vector<Segment> build_segments(const JobSpec& job) {
  using detail::checked_u31;
  std::vector<Segment> out;
  const std::int64_t blocks = num_blocks(job.sizes);
  if (blocks < 1 || job.kv_size < 1 || job.num_layers < 1 || job.block_size < 1 || job.element_size < 1)
    detail::refuse("sizes must be positive");
  checked_u31(job.block_size * job.row_bytes, "a block's rows in a chunk");
  for (const PieceSpec& p : job.pieces) {
    if (p.num_loops < 0 || p.num_loops > kMaxLoops) detail::refuse("a piece has too many loops");
    for (int l = 0; l < p.num_loops; ++l)
      if (p.extent[l] < 1) detail::refuse("a loop is empty");
  }
  for (std::int64_t kv = 0; kv < job.kv_size; ++kv) {
    for (std::int64_t layer = 0; layer < job.num_layers; ++layer) {
      for (const PieceSpec& p : job.pieces) {
        const auto at = [&](std::int64_t block) {
          return locate(job.format, job.sizes, job.block_stride, Coord{layer, kv, block, 0, p.head, p.elem});
        };
        const Location first = at(0), second = at(blocks > 1 ? 1 : 0), last = at(blocks - 1);
        const std::int64_t step = second.offset - first.offset;
        if (first.pointer < 0 || second.pointer != first.pointer || last.pointer != first.pointer ||
            last.offset - first.offset != (blocks - 1) * step)
          detail::refuse("block ids do not step through one pointer by a fixed stride");
        // (cache shift, chunk offset) of each cut, and the loops left to each segment
        std::vector<std::pair<std::int64_t, std::int64_t>> cuts{{0, p.chunk_offset}};
        int kept = 0;
        while (kept < p.num_loops && !detail::fits_from(p, kept)) {
          if (static_cast<std::int64_t>(cuts.size()) * p.extent[kept] > detail::kMaxCuts)
            detail::refuse("a piece's cache extent is outside [0, 2^31) even cut into 65536 segments");
          std::vector<std::pair<std::int64_t, std::int64_t>> finer;
          for (const auto& [cache, chunk] : cuts)
            for (std::int64_t d = 0; d < p.extent[kept]; ++d)
              finer.emplace_back(cache + d * p.cache_stride[kept], chunk + d * p.chunk_stride[kept]);
          cuts = std::move(finer);
          ++kept;
        }
        for (const auto& [cache, chunk] : cuts) {
          Segment s{};
          s.cache_offset = first.offset * job.element_size + cache;
          s.block_step = step * job.element_size;
          s.pointer = static_cast<std::uint32_t>(first.pointer);
          s.slab = static_cast<std::uint32_t>(kv * job.num_layers + layer);
          s.chunk_offset = checked_u31(chunk, "a piece's chunk offset");
          s.run = fast_div(checked_u31(p.run, "a run"));
          s.num_loops = static_cast<std::uint32_t>(p.num_loops - kept);
          std::int64_t runs = 1, chunk_end = chunk + p.run, cache_end = p.run;
          for (int l = kept; l < p.num_loops; ++l) {
            s.loops[l - kept] = Loop{fast_div(static_cast<std::uint64_t>(checked_u31(p.extent[l], "a loop extent"))),
                                     checked_u31(p.chunk_stride[l], "a chunk stride"),
                                     checked_u31(p.cache_stride[l], "a cache stride")};
            runs *= p.extent[l];
            chunk_end += (p.extent[l] - 1) * p.chunk_stride[l];
            cache_end += (p.extent[l] - 1) * p.cache_stride[l];
            checked_u31(runs * p.run, "a segment's bytes");
          }
          s.bytes = checked_u31(runs * p.run, "a segment's bytes");
          checked_u31(chunk_end, "a segment's chunk extent");
          checked_u31(cache_end, "a segment's cache extent");
          out.push_back(s);
        }
      }
    }
  }
  return out;
}

// The bytes of the largest segment (what sizes a job's thread blocks).
inline std::uint32_t largest_bytes(const std::vector<Segment>& segments) {
  std::uint32_t largest = 0;
  for (const Segment& s : segments) largest = s.bytes > largest ? s.bytes : largest;
  return largest;
}

// The widest power of two up to 16 bytes that divides every run, stride and offset of the
// segments and the chunk row: the device's copy unit before pointer alignment narrows it.
inline std::uint32_t widest_unit(const std::vector<Segment>& segments, std::int64_t row_bytes) {
  std::uint64_t bits = static_cast<std::uint64_t>(row_bytes) | 16;
  for (const Segment& s : segments) {
    bits |= static_cast<std::uint64_t>(s.cache_offset) | static_cast<std::uint64_t>(s.block_step) | s.chunk_offset |
            s.run.divisor;
    for (std::uint32_t l = 0; l < s.num_loops; ++l) bits |= s.loops[l].chunk_stride | s.loops[l].cache_stride;
  }
  return static_cast<std::uint32_t>(bits & (~bits + 1));  // the lowest set bit
}

}  // namespace kvlayout::plan
