// kvlayout._native: the C++ format table and the host indexers, for Python.
//
// Formats cross this boundary as plain ints (the canonical enum is the generated Python
// IntEnum); tests pin this table against it.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kvlayout/engine_kv_format.h"
#include "kvlayout/indexing.cuh"
#include "transfer.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

kvlayout::EngineKVFormat checked_format(std::int32_t value) {
  bool known = false;
  kvlayout::format_facts(static_cast<kvlayout::EngineKVFormat>(value), &known);
  if (!known) throw nb::value_error(("unknown engine KV format value " + std::to_string(value)).c_str());
  return static_cast<kvlayout::EngineKVFormat>(value);
}

kvlayout::Sizes checked_sizes(const std::vector<std::int64_t>& values) {
  if (values.size() != static_cast<std::size_t>(kvlayout::kNumSizeFields))
    throw nb::value_error(("expected " + std::to_string(kvlayout::kNumSizeFields) + " sizes (size_fields() order), got " +
                           std::to_string(values.size()))
                              .c_str());
  return kvlayout::sizes_from(values.data());
}

nb::dict facts_dict(const kvlayout::FormatFacts& f) {
  nb::dict d;
  d["value"] = static_cast<std::int32_t>(f.format);
  d["name"] = std::string(f.name);
  d["shape"] = std::string(f.shape);
  d["kv_size"] = f.kv_size;
  d["list_depth"] = f.list_depth;
  d["deprecated"] = f.deprecated;
  for (int i = 0; i < kvlayout::kNumFacts; ++i) d[kvlayout::kFactNames[i]] = kvlayout::fact_value(f, i);
  return d;
}

using CoordArray = nb::ndarray<const std::int64_t, nb::shape<-1, 6>, nb::c_contig, nb::device::cpu>;
using LocationArray = nb::ndarray<nb::numpy, std::int64_t, nb::shape<-1, 2>>;
using IntArray = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using PtrArray = nb::ndarray<const std::uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
constexpr int kPieceFields = 5 + 3 * kvlayout::transfer::kMaxLoops;
using PieceArray = nb::ndarray<const std::int64_t, nb::shape<-1, kPieceFields>, nb::c_contig, nb::device::cpu>;

// (format, sizes, block_stride, element_size, cache_ptrs, pieces, kv_size, num_layers, block_size, chunk_row_bytes)
using JobArgs = std::tuple<std::int32_t, std::vector<std::int64_t>, std::int64_t, std::int64_t, PtrArray, PieceArray,
                           std::int64_t, std::int64_t, std::int64_t, std::int64_t>;

kvlayout::transfer::Job make_job(const JobArgs& a) {
  const auto& [format, sizes, block_stride, element_size, ptrs, pieces, kv_size, num_layers, block_size, row_bytes] = a;
  const auto* first = reinterpret_cast<const std::uintptr_t*>(ptrs.data());
  kvlayout::transfer::Job job{checked_format(format), checked_sizes(sizes), block_stride, element_size,
                              std::vector<std::uintptr_t>(first, first + ptrs.shape(0)), {}, kv_size, num_layers,
                              block_size, row_bytes};
  for (std::size_t i = 0; i < pieces.shape(0); ++i) {
    const std::int64_t* r = pieces.data() + i * kPieceFields;
    kvlayout::transfer::Piece p{r[0], r[1], r[2], r[3], static_cast<int>(r[4]), {}};
    if (p.num_loops < 0 || p.num_loops > kvlayout::transfer::kMaxLoops) throw nb::value_error("a piece has too many loops");
    for (int l = 0; l < p.num_loops; ++l) p.loops[l] = {r[5 + 3 * l], r[6 + 3 * l], r[7 + 3 * l]};
    job.pieces.push_back(p);
  }
  return job;
}

class TransferPlan {
 public:
  TransferPlan(const std::vector<JobArgs>& job_args, std::int64_t num_blocks) : num_blocks_(num_blocks) {
    for (const auto& a : job_args) jobs_.push_back(make_job(a));
  }

  std::int64_t first_bad_block_id(IntArray block_ids) const {
    const kvlayout::transfer::Batch batch{block_ids.data(), static_cast<std::int64_t>(block_ids.shape(0)), nullptr,
                                          nullptr, 1, 0};
    return kvlayout::transfer::first_bad_block_id(batch, num_blocks_);
  }

  // Ids must be in range (first_bad_block_id) before this is asked.
  std::int64_t first_repeated_block_id(IntArray block_ids, std::int64_t skip) const {
    const auto n = static_cast<std::int64_t>(block_ids.shape(0));
    if (skip < 0 || skip > n) throw nb::value_error("skip is outside [0, len(block_ids)]");
    return kvlayout::transfer::first_repeated_block_id(block_ids.data(), n, skip, num_blocks_);
  }

  std::tuple<std::int64_t, int> run(int direction, IntArray block_ids, PtrArray chunk_ptrs, IntArray chunk_tokens,
                                    std::int64_t blocks_per_chunk, std::int64_t skip_prefix_blocks, int num_threads) {
    if (direction != 0 && direction != 1) throw nb::value_error("direction is 0 (store) or 1 (load)");
    if (blocks_per_chunk <= 0) throw nb::value_error("blocks_per_chunk must be positive");
    if (chunk_ptrs.shape(0) != chunk_tokens.shape(0)) throw nb::value_error("one token count per chunk");
    const auto count = static_cast<std::int64_t>(block_ids.shape(0));
    if (static_cast<std::int64_t>(chunk_ptrs.shape(0)) < (count + blocks_per_chunk - 1) / blocks_per_chunk)
      throw nb::value_error("too few chunks for the blocks");
    const kvlayout::transfer::Batch batch{block_ids.data(), count,
                                          reinterpret_cast<const std::uintptr_t*>(chunk_ptrs.data()),
                                          chunk_tokens.data(), blocks_per_chunk, skip_prefix_blocks};
    nb::gil_scoped_release release;
    const std::int64_t bad = kvlayout::transfer::first_bad_block_id(batch, num_blocks_);
    if (bad >= 0) return {bad, 0};
    const int used = kvlayout::transfer::run(jobs_, batch, static_cast<kvlayout::transfer::Direction>(direction),
                                             num_threads);
    return {-1, used};
  }

 private:
  std::vector<kvlayout::transfer::Job> jobs_;
  std::int64_t num_blocks_;
};

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "The C++ side of kvlayout: the generated format table and host indexers.";

  m.def(
      "format_table",
      [] {
        std::vector<nb::dict> rows;
        for (auto f : kvlayout::kAllFormats) rows.push_back(facts_dict(kvlayout::format_facts(f)));
        return rows;
      },
      "One dict per format: value, name, shape, kv_size, list_depth, deprecated and every fact.");

  m.def(
      "size_fields",
      [] {
        std::vector<std::string> names;
        for (auto n : kvlayout::kSizeFieldNames) names.emplace_back(n);
        return names;
      },
      "The order of the sizes the indexers take.");

  m.def(
      "locate",
      [](std::int32_t format, const std::vector<std::int64_t>& sizes, std::int64_t block_stride,
         const std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>& coord) {
        const auto [layer, kv, block, token, head, elem] = coord;
        const auto loc = kvlayout::locate(checked_format(format), checked_sizes(sizes), block_stride,
                                          kvlayout::Coord{layer, kv, block, token, head, elem});
        return std::make_tuple(loc.pointer, loc.offset);
      },
      "format"_a, "sizes"_a, "block_stride"_a, "coord"_a,
      "(pointer index, element offset) of a (layer, kv, block, token, head, elem) coordinate.");

  m.def(
      "locate_many",
      [](std::int32_t format, const std::vector<std::int64_t>& sizes, std::int64_t block_stride, CoordArray coords) {
        const auto fmt = checked_format(format);
        const auto s = checked_sizes(sizes);
        const std::size_t n = coords.shape(0);
        auto* out = new std::int64_t[n * 2];
        nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::int64_t*>(p); });
        const std::int64_t* c = coords.data();
        for (std::size_t i = 0; i < n; ++i) {
          const std::int64_t* r = c + 6 * i;
          const auto loc = kvlayout::locate(fmt, s, block_stride, kvlayout::Coord{r[0], r[1], r[2], r[3], r[4], r[5]});
          out[2 * i] = loc.pointer;
          out[2 * i + 1] = loc.offset;
        }
        return LocationArray(out, {n, 2}, owner);
      },
      "format"_a, "sizes"_a, "block_stride"_a, "coords"_a, "locate() over an (n, 6) int64 array of coordinates.");

  nb::class_<TransferPlan>(m, "TransferPlan",
                           "A registration's copy jobs, built once; run() moves blocks with raw pointers "
                           "(kvlayout.transfer validates, and keeps the tensors alive).")
      .def(nb::init<const std::vector<JobArgs>&, std::int64_t>(), "jobs"_a, "num_blocks"_a)
      .def("first_bad_block_id", &TransferPlan::first_bad_block_id, "block_ids"_a,
           "The index of the first block id outside [0, num_blocks), or -1.")
      .def("first_repeated_block_id", &TransferPlan::first_repeated_block_id, "block_ids"_a, "skip"_a,
           "The index of the first block id after the skipped ones that repeats an earlier one there, or -1.")
      .def("run", &TransferPlan::run, "direction"_a, "block_ids"_a, "chunk_ptrs"_a, "chunk_tokens"_a,
           "blocks_per_chunk"_a, "skip_prefix_blocks"_a, "num_threads"_a,
           "Copy blocks (0: cache -> chunks, 1: chunks -> cache) on up to num_threads pool threads. Returns "
           "(index of the first block id out of range or -1, threads used); nothing moves when an id is bad.");

  m.def("pool_workers", [] { return kvlayout::transfer::WorkerPool::instance().num_workers(); },
        "Worker threads the transfer pool has created so far (they persist across calls).");
  m.def("max_threads", &kvlayout::transfer::WorkerPool::max_threads,
        "The most threads one transfer uses: the hardware's thread count (at most 256).");
}
