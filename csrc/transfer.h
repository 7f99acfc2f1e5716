#pragma once
// The native CPU block transfer: paged KV cache <-> token-major chunk buffers.
//
// Python (kvlayout/transfer.py) validates everything and hands over jobs: one per group
// of pointers that share a geometry (a whole registration, or one plane of a per-layer
// tuple). For each (chunk block, kv, layer) a job asks the generated indexer where each
// piece of the block starts, then walks the piece's loop nest (from the layout algebra's
// copy plan) copying contiguous runs. Everything below is in bytes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kvlayout/indexing.cuh"
#include "worker_pool.h"

namespace kvlayout::transfer {

inline constexpr int kMaxLoops = 4;

struct Loop {
  std::int64_t extent;
  std::int64_t chunk_stride;  // bytes
  std::int64_t cache_stride;  // bytes
};

// A part of a block's copy that stays on one pointer (see kvlayout.algebra.Piece).
struct Piece {
  std::int64_t head;          // coordinate where the piece starts (token 0)
  std::int64_t elem;
  std::int64_t chunk_offset;  // bytes from the token row's start in the chunk
  std::int64_t run;           // contiguous bytes per innermost copy
  int num_loops;
  Loop loops[kMaxLoops];      // outermost first
};

struct Job {
  EngineKVFormat format;
  Sizes sizes;
  std::int64_t block_stride;  // elements; 0 = tight
  std::int64_t element_size;  // bytes
  std::vector<std::uintptr_t> cache_ptrs;  // the job's pointer table
  std::vector<Piece> pieces;
  std::int64_t kv_size;
  std::int64_t num_layers;
  std::int64_t block_size;
  std::int64_t chunk_row_bytes;  // the chunk's whole token row (all jobs' rows together)
};

struct Batch {
  const std::int64_t* block_ids;
  std::int64_t num_blocks;
  const std::uintptr_t* chunk_ptrs;  // one per chunk
  const std::int64_t* chunk_tokens;  // T of each chunk
  std::int64_t blocks_per_chunk;
  std::int64_t skip_prefix_blocks;
};

enum class Direction { kStore = 0, kLoad = 1 };  // store: cache -> chunk; load: chunk -> cache

namespace detail {

template <Direction D>
inline void walk(char* chunk, char* cache, const Loop* loops, int n, std::int64_t run) {
  if (n == 0) {
    if constexpr (D == Direction::kStore) {
      std::memcpy(chunk, cache, static_cast<std::size_t>(run));
    } else {
      std::memcpy(cache, chunk, static_cast<std::size_t>(run));
    }
    return;
  }
  const Loop& l = loops[0];
  for (std::int64_t i = 0; i < l.extent; ++i) walk<D>(chunk + i * l.chunk_stride, cache + i * l.cache_stride, loops + 1, n - 1, run);
}

template <Direction D>
void run_range(const std::vector<Job>& jobs, const Batch& b, std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t chunk = i / b.blocks_per_chunk;
    const std::int64_t block = b.block_ids[i];
    const std::int64_t tokens = b.chunk_tokens[chunk];
    char* chunk_base = reinterpret_cast<char*>(b.chunk_ptrs[chunk]);
    for (const Job& job : jobs) {
      const std::int64_t first_token = (i - chunk * b.blocks_per_chunk) * job.block_size;
      for (std::int64_t kv = 0; kv < job.kv_size; ++kv) {
        for (std::int64_t layer = 0; layer < job.num_layers; ++layer) {
          char* row = chunk_base + ((kv * job.num_layers + layer) * tokens + first_token) * job.chunk_row_bytes;
          for (const Piece& p : job.pieces) {
            const Location at = locate(job.format, job.sizes, job.block_stride, Coord{layer, kv, block, 0, p.head, p.elem});
            char* cache = reinterpret_cast<char*>(job.cache_ptrs[static_cast<std::size_t>(at.pointer)]) +
                          at.offset * job.element_size;
            walk<D>(row + p.chunk_offset, cache, p.loops, p.num_loops, p.run);
          }
        }
      }
    }
  }
}

}  // namespace detail

// The index of the first block id outside [0, num_blocks), or -1 when all are inside.
inline std::int64_t first_bad_block_id(const Batch& b, std::int64_t num_blocks) {
  for (std::int64_t i = 0; i < b.num_blocks; ++i) {
    if (b.block_ids[i] < 0 || b.block_ids[i] >= num_blocks) return i;
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

// Moves blocks [skip_prefix_blocks, num_blocks) of the batch, split over up to `threads`
// threads of the shared pool (fewer when there is less work); returns the threads used.
inline int run(const std::vector<Job>& jobs, const Batch& b, Direction d, int threads) {
  const std::int64_t begin = b.skip_prefix_blocks, end = b.num_blocks;
  if (end <= begin) return 0;
  const int wanted = static_cast<int>(std::min<std::int64_t>(std::max(threads, 1), end - begin));
  return WorkerPool::instance().run(wanted, [&](int part, int parts) {
    const std::int64_t per = (end - begin + parts - 1) / parts;
    const std::int64_t lo = begin + part * per, hi = std::min(end, lo + per);
    if (lo >= hi) return;
    if (d == Direction::kStore) {
      detail::run_range<Direction::kStore>(jobs, b, lo, hi);
    } else {
      detail::run_range<Direction::kLoad>(jobs, b, lo, hi);
    }
  });
}

}  // namespace kvlayout::transfer
