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
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvlayout/transfer_plan.h"
#include "worker_pool.h"

namespace kvlayout::transfer {

// A job's segments as one direction walks them: each segment's loops ordered by the stride
// of the side it reads (the cache's for a store, the chunk's for a load), so reads stream
// within a block (a head-major HND block loads 1.35x faster in chunk order).
struct Walk {
  std::vector<plan::Segment> by_chunk;  // (kv, layer, piece): the chunk's order
  std::vector<plan::Segment> by_cache;  // the cache's address order
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
  std::vector<plan::Segment> by_cache = segments;
  std::stable_sort(by_cache.begin(), by_cache.end(), [](const plan::Segment& a, const plan::Segment& b) {
    return a.pointer != b.pointer ? a.pointer < b.pointer : a.cache_offset < b.cache_offset;
  });
  return Walk{std::move(segments), std::move(by_cache)};
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
    for (const plan::Segment& s : job.store.by_cache) {
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

namespace detail {

struct PlainCopy {
  static void copy(char* dst, const char* src, std::size_t n) { std::memcpy(dst, src, n); }
  static void finish() {}
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVLAYOUT_STREAM_STORES 1
// Streaming stores (AVX2, 32 bytes) from the first 32-byte-aligned destination byte; the
// unaligned head and the tail under 32 bytes go through memcpy. AVX2 beat SSE2's 16-byte
// streaming stores by 1.0-1.18x across the benchmark's formats; the extension is built
// for baseline x86-64, so this function alone is compiled for AVX2 and chosen at run time.
struct StreamCopy {
  __attribute__((target("avx2"))) static void copy(char* dst, const char* src, std::size_t n) {
    const std::size_t head = std::min(n, (32 - reinterpret_cast<std::uintptr_t>(dst) % 32) % 32);
    if (head != 0) {
      std::memcpy(dst, src, head);
      dst += head, src += head, n -= head;
    }
    for (; n >= 128; dst += 128, src += 128, n -= 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
    }
    for (; n >= 32; dst += 32, src += 32, n -= 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    if (n != 0) std::memcpy(dst, src, n);
  }
  // Streaming stores are weakly ordered: fence them before the part reports done.
  static void finish() { _mm_sfence(); }
};

inline bool can_stream() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#else
inline bool can_stream() { return false; }
#endif

// The loop nest of a segment, N levels deep, as plain nested loops (outermost first).
template <int N, class Run>
inline void nest(const plan::Loop* loops, char* chunk, char* cache, const Run& run) {
  if constexpr (N == 0) {
    run(chunk, cache);
  } else {
    const std::uint32_t extent = loops->extent.divisor;
    const std::int64_t cs = loops->chunk_stride, ks = loops->cache_stride;
    for (std::uint32_t i = 0; i < extent; ++i) nest<N - 1>(loops + 1, chunk + i * cs, cache + i * ks, run);
  }
}

template <Direction D, class Copy>
inline void move_segment(const plan::Segment& s, char* chunk, char* cache) {
  const std::size_t bytes = s.run.divisor;
  const auto run = [bytes](char* c, char* k) {
    if constexpr (D == Direction::kStore) {
      Copy::copy(c, k, bytes);
    } else {
      Copy::copy(k, c, bytes);
    }
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

// Blocks [lo, hi) of the batch, chunk by chunk. Layer-major walks each (kv, layer) slab of
// a chunk through all its blocks before the next slab, so the chunk side streams;
// block-major finishes a block before the next, its segments in cache order, so the cache
// side streams where a block's slabs are adjacent (a cross-layer block). Either way each
// byte's last writer is the same, so the order never changes the result.
template <Direction D, class Copy>
void run_range(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo, std::int64_t hi, bool layer_major) {
  const std::int64_t per = b.blocks_per_chunk;
  for (std::int64_t c = lo / per; c * per < hi; ++c) {
    const std::int64_t i0 = std::max(lo, c * per), i1 = std::min(hi, (c + 1) * per);
    const std::uint64_t chunk = b.chunk_ptrs[c];
    const std::int64_t tokens = b.chunk_tokens[c];
    const auto move = [&](const Job& job, const plan::Segment& s, std::int64_t i) {
      const std::int64_t first_token = (i - c * per) * job.block_size;
      auto* row = reinterpret_cast<char*>(plan::chunk_start(s, chunk, tokens, first_token, job.row_bytes));
      auto* cache = reinterpret_cast<char*>(plan::cache_start(s, job.cache_ptrs[s.pointer], b.block_ids[i]));
      move_segment<D, Copy>(s, row, cache);
    };
    if (layer_major) {
      for (const Job& job : jobs)
        for (const plan::Segment& s : walk_of<D>(job).by_chunk)
          for (std::int64_t i = i0; i < i1; ++i) move(job, s, i);
    } else {
      for (std::int64_t i = i0; i < i1; ++i)
        for (const Job& job : jobs)
          for (const plan::Segment& s : walk_of<D>(job).by_cache) move(job, s, i);
    }
  }
  Copy::finish();
}

template <Direction D>
void run_part(const std::vector<Job>& jobs, const Batch& b, std::int64_t lo, std::int64_t hi, bool layer_major,
              bool stream) {
#if defined(KVLAYOUT_STREAM_STORES)
  if (stream) return run_range<D, StreamCopy>(jobs, b, lo, hi, layer_major);
#endif
  (void)stream;
  run_range<D, PlainCopy>(jobs, b, lo, hi, layer_major);
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
    for (const Job& job : jobs)
      for (const plan::Segment& s : job.store.by_chunk) block_bytes += s.bytes;
  }
  std::vector<Job> jobs;
  CacheSpans spans;
  std::int64_t block_bytes = 0;  // bytes per block moved
};

struct Options {
  Order order = Order::kAuto;
  std::int64_t stream_min_bytes = kStreamMinBytes;
};

// kAuto: the order whose read side streams the longer stretch, and on a tie the one whose
// write side does. Reads decide first: streaming stores make the write order cheap, while
// a read stream is what the prefetchers keep ahead of. On the benchmark's cases this
// stores cross-layer and flash-infer blocks (slabs adjacent in the cache) block-major and
// moves everything else layer-major, the faster order of each in same-run measurements.
inline bool layer_major(const Plan& p, Direction d, std::int64_t blocks_per_chunk, const Options& o) {
  if (o.order != Order::kAuto || p.jobs.empty()) return o.order == Order::kLayerMajor;
  const std::int64_t rows = p.jobs.front().block_size * p.jobs.front().row_bytes;  // a block in a chunk slab
  const std::int64_t chunk_layer = blocks_per_chunk * rows, chunk_block = rows;
  const std::int64_t cache_layer = p.spans.segment, cache_block = p.spans.block;
  const bool store = d == Direction::kStore;
  const std::int64_t read_layer = store ? cache_layer : chunk_layer, read_block = store ? cache_block : chunk_block;
  if (read_layer != read_block) return read_layer > read_block;
  return (store ? chunk_layer : cache_layer) >= (store ? chunk_block : cache_block);
}

// Moves blocks [skip_prefix_blocks, num_blocks) of the batch, split over up to `threads`
// threads of the shared pool (fewer when there is less work); returns the threads used.
// Each part is a contiguous range of blocks, so the bytes do not depend on the split.
inline int run(const Plan& p, const Batch& b, Direction d, int threads, const Options& o = {}) {
  const std::int64_t begin = b.skip_prefix_blocks, end = b.num_blocks;
  if (end <= begin || p.jobs.empty()) return 0;
  const bool by_layer = layer_major(p, d, b.blocks_per_chunk, o);
  const bool stream = detail::can_stream() && (end - begin) * p.block_bytes >= o.stream_min_bytes;
  const int wanted = static_cast<int>(std::min<std::int64_t>(std::max(threads, 1), end - begin));
  return WorkerPool::instance().run(wanted, [&](int part, int parts) {
    const std::int64_t per = (end - begin + parts - 1) / parts;
    const std::int64_t lo = begin + part * per, hi = std::min(end, lo + per);
    if (lo >= hi) return;
    if (d == Direction::kStore) {
      detail::run_part<Direction::kStore>(p.jobs, b, lo, hi, by_layer, stream);
    } else {
      detail::run_part<Direction::kLoad>(p.jobs, b, lo, hi, by_layer, stream);
    }
  });
}

}  // namespace kvlayout::transfer
