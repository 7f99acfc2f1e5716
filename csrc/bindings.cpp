// kvlayout._native: the C++ format table and the host indexers, for Python.
//
// Formats cross this boundary as plain ints (the canonical enum is the generated Python
// IntEnum); tests pin this table against it.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "block_map.h"
#include "staging.h"
#include "kvlayout/engine_kv_format.h"
#include "kvlayout/indexing.cuh"
#include "kvlayout/run_plan.h"
#include "stream_copy.h"
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
constexpr int kPieceFields = 5 + 3 * kvlayout::plan::kMaxLoops;
using PieceArray = nb::ndarray<const std::int64_t, nb::shape<-1, kPieceFields>, nb::c_contig, nb::device::cpu>;

// (format, sizes, block_stride, element_size, cache_ptrs, pieces, kv_size, num_layers, block_size, chunk_row_bytes,
//  repeats: pointer-table entries whose memory an earlier entry holds, which a load skips)
using JobArgs = std::tuple<std::int32_t, std::vector<std::int64_t>, std::int64_t, std::int64_t, PtrArray, PieceArray,
                           std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::vector<std::int64_t>>;

// The job's segments; std::invalid_argument (a ValueError) for a plan the engines cannot walk.
std::vector<kvlayout::plan::Segment> segments_of(const JobArgs& a) {
  const auto& [format, sizes, block_stride, element_size, ptrs, pieces, kv_size, num_layers, block_size, row_bytes,
               repeats] = a;
  kvlayout::plan::JobSpec spec{checked_format(format), checked_sizes(sizes), block_stride, element_size, kv_size,
                               num_layers, block_size, row_bytes, {}};
  for (std::size_t i = 0; i < pieces.shape(0); ++i) {
    const std::int64_t* r = pieces.data() + i * kPieceFields;
    kvlayout::plan::PieceSpec p{r[0], r[1], r[2], r[3], static_cast<int>(r[4]), {}, {}, {}};
    for (int l = 0; l < kvlayout::plan::kMaxLoops; ++l) {
      p.extent[l] = r[5 + 3 * l];
      p.chunk_stride[l] = r[6 + 3 * l];
      p.cache_stride[l] = r[7 + 3 * l];
    }
    spec.pieces.push_back(p);
  }
  auto segments = kvlayout::plan::build_segments(spec);
  for (const auto& s : segments)
    if (s.pointer >= ptrs.shape(0)) throw nb::value_error("a segment points past the job's pointer table");
  for (const std::int64_t r : repeats)
    if (r <= 0 || r >= static_cast<std::int64_t>(ptrs.shape(0)))
      throw nb::value_error("a repeated pointer is not a later entry of the job's pointer table");
  return segments;
}

// A direction argument: 0 stores (cache -> chunks), 1 loads.
int checked_direction(int direction) {
  if (direction != 0 && direction != 1) throw nb::value_error("direction is 0 (store) or 1 (load)");
  return direction;
}

// A blocks_per_chunk argument: each chunk holds at least one block.
std::int64_t checked_blocks_per_chunk(std::int64_t blocks_per_chunk) {
  if (blocks_per_chunk <= 0) throw nb::value_error("blocks_per_chunk must be positive");
  return blocks_per_chunk;
}

// The segments one direction moves: a load leaves out the repeated pointers' segments.
std::vector<kvlayout::plan::Segment> direction_segments(const JobArgs& a, int direction) {
  checked_direction(direction);
  auto segments = segments_of(a);
  return direction == 1 ? kvlayout::transfer::without_pointers(segments, std::get<10>(a)) : segments;
}

kvlayout::transfer::Job make_job(const JobArgs& a) {
  const PtrArray& ptrs = std::get<4>(a);
  const auto* first = reinterpret_cast<const std::uintptr_t*>(ptrs.data());
  return kvlayout::transfer::make_job(std::vector<std::uintptr_t>(first, first + ptrs.shape(0)), segments_of(a),
                                     std::get<8>(a), std::get<9>(a), std::get<10>(a));
}

// A copy's prefetch argument: -1 measures which way is faster (prefetch_choice.h), 0 and 1
// fix it (for tests and benchmarks).
kvlayout::Prefetch prefetch_mode(int prefetch) {
  if (prefetch < -1 || prefetch > 1) throw nb::value_error("prefetch is -1 (measured), 0 (off) or 1 (on)");
  return static_cast<kvlayout::Prefetch>(prefetch);
}

class TransferPlan {
 public:
  TransferPlan(const std::vector<JobArgs>& job_args, std::int64_t num_blocks, int order, std::int64_t stream_min_bytes,
               int prefetch, bool listed, bool lanes)
      : plan_(make_jobs(job_args)),
        num_blocks_(num_blocks),
        options_{checked_order(order), stream_min_bytes, prefetch_mode(prefetch), listed, lanes} {}

  // Whether a call's moves are listed and copied as runs (transfer::listed).
  bool listed(int direction, std::int64_t blocks_per_chunk) const {
    return walk(direction, blocks_per_chunk) == kvlayout::transfer::WalkKind::kListed;
  }

  // Whether a call's nested moves may be copied in lanes (transfer::lanes).
  bool lanes(int direction, std::int64_t blocks_per_chunk) const {
    return walk(direction, blocks_per_chunk) == kvlayout::transfer::WalkKind::kNestedInLanes;
  }

  std::tuple<std::int64_t, int> run(int direction, IntArray block_ids, PtrArray chunk_ptrs, IntArray chunk_tokens,
                                    std::int64_t blocks_per_chunk, std::int64_t skip_prefix_blocks, int num_threads) {
    const auto batch = batch_of(direction, block_ids, chunk_ptrs, chunk_tokens, blocks_per_chunk, skip_prefix_blocks);
    nb::gil_scoped_release release;
    const std::int64_t bad = kvlayout::transfer::first_bad_block_id(batch.block_ids, batch.num_blocks, num_blocks_);
    if (bad >= 0) return {bad, 0};
    const int used = kvlayout::transfer::run(plan_, batch, static_cast<kvlayout::transfer::Direction>(direction),
                                             num_threads, options_);
    return {-1, used};
  }

  // The bytes a one-thread call with these arguments copies in lanes (transfer::bytes_in_lanes).
  std::uint64_t bytes_in_lanes(int direction, IntArray block_ids, PtrArray chunk_ptrs, IntArray chunk_tokens,
                               std::int64_t blocks_per_chunk, std::int64_t skip_prefix_blocks) const {
    const auto batch = batch_of(direction, block_ids, chunk_ptrs, chunk_tokens, blocks_per_chunk, skip_prefix_blocks);
    return kvlayout::transfer::bytes_in_lanes(plan_, batch, static_cast<kvlayout::transfer::Direction>(direction),
                                              options_);
  }

  std::tuple<std::uint64_t, double, double> prefetch_costs(int direction, bool many_threads) const {
    const auto& c = plan_.prefetch_choices[checked_direction(direction)][many_threads ? 1 : 0];
    return {c.calls(), c.cost(false), c.cost(true)};
  }

 private:
  static std::vector<kvlayout::transfer::Job> make_jobs(const std::vector<JobArgs>& job_args) {
    std::vector<kvlayout::transfer::Job> jobs;
    for (const auto& a : job_args) jobs.push_back(make_job(a));
    return jobs;
  }

  kvlayout::transfer::WalkKind walk(int direction, std::int64_t blocks_per_chunk) const {
    const auto d = static_cast<kvlayout::transfer::Direction>(checked_direction(direction));
    const bool layer_major =
        kvlayout::transfer::layer_major(plan_, d, checked_blocks_per_chunk(blocks_per_chunk), options_);
    return kvlayout::transfer::walk_kind(plan_, d, layer_major, options_);
  }

  // A call's arguments, checked (the block ids are checked against the pool by run()).
  static kvlayout::transfer::Batch batch_of(int direction, const IntArray& block_ids, const PtrArray& chunk_ptrs,
                                            const IntArray& chunk_tokens, std::int64_t blocks_per_chunk,
                                            std::int64_t skip_prefix_blocks) {
    checked_direction(direction);
    checked_blocks_per_chunk(blocks_per_chunk);
    if (chunk_ptrs.shape(0) != chunk_tokens.shape(0)) throw nb::value_error("one token count per chunk");
    const auto count = static_cast<std::int64_t>(block_ids.shape(0));
    if (static_cast<std::int64_t>(chunk_ptrs.shape(0)) < (count + blocks_per_chunk - 1) / blocks_per_chunk)
      throw nb::value_error("too few chunks for the blocks");
    const auto* chunks = reinterpret_cast<const std::uintptr_t*>(chunk_ptrs.data());
    return kvlayout::transfer::Batch{block_ids.data(), count, chunks, chunk_tokens.data(), blocks_per_chunk,
                                     skip_prefix_blocks};
  }

  static kvlayout::transfer::Order checked_order(int order) {
    if (order < -1 || order > 1) throw nb::value_error("order is -1 (auto), 0 (block-major) or 1 (layer-major)");
    return static_cast<kvlayout::transfer::Order>(order);
  }

  kvlayout::transfer::Plan plan_;
  std::int64_t num_blocks_;
  kvlayout::transfer::Options options_;
};

using RunArray = nb::ndarray<const std::uint64_t, nb::shape<-1, 3>, nb::c_contig, nb::device::cpu>;

// copy_runs over an (N, 3) table of (source, destination, length), for its tests: with
// streaming false the memcpy path runs even where the CPU has AVX2; prefetch runs the
// cursors or not.
void copy_byte_runs(RunArray runs, bool streaming, bool prefetch, bool any_order) {
  static_assert(sizeof(kvlayout::ByteRun) == 24, "a run is three uint64");
  const auto* table = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  const std::size_t n = runs.shape(0);
  nb::gil_scoped_release release;
  kvlayout::stream::copy_runs(streaming, table, n, prefetch,
                              any_order ? kvlayout::stream::Order::kAny : kvlayout::stream::Order::kListed);
}

// The tiles the run copy finds in an (N, 3) table, as (first run, rows, cols) rows: the
// scan copy_runs makes, for its tests.
std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> tiles_of(RunArray runs) {
  const auto* table = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  const std::size_t n = runs.shape(0);
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> out;
  kvlayout::stream::scan_tiles(
      table, n, [&](const kvlayout::stream::Tile& t, std::size_t i) { out.emplace_back(i, t.rows, t.cols); },
      [](const kvlayout::ByteRun&) {});
  return out;
}

// The benchmarks' flat streaming copy of nbytes, split in contiguous parts over up to
// num_threads pool threads; returns the threads used.
int flat_stream(std::uintptr_t dst, std::uintptr_t src, std::uint64_t nbytes, int num_threads) {
  nb::gil_scoped_release release;
  if (nbytes == 0) return 0;
  const std::uint64_t wanted = std::clamp<std::uint64_t>(num_threads, 1, nbytes);
  return kvlayout::transfer::WorkerPool::instance().run(static_cast<int>(wanted), [&](int part, int parts) {
    const std::uint64_t per = (nbytes + parts - 1) / parts;
    const std::uint64_t lo = part * per, hi = std::min(nbytes, lo + per);
    if (lo < hi) kvlayout::stream::flat_stream(reinterpret_cast<char*>(dst + lo), reinterpret_cast<const char*>(src + lo), hi - lo);
  });
}

using RunTable = nb::ndarray<nb::numpy, std::uint64_t, nb::shape<-1, 3>>;

const kvlayout::runs::Run* runs_of(const RunArray& runs) {
  static_assert(sizeof(kvlayout::runs::Run) == 3 * sizeof(std::uint64_t), "a run is three uint64");
  return reinterpret_cast<const kvlayout::runs::Run*>(runs.data());
}

// The CUDA run executor's work items (kvlayout/run_plan.h), each as three uint64 (offset,
// bytes, run | count << 32: the device's bytes); ValueError for a run that wraps around.
RunTable plan_run_items(RunArray runs) {
  const auto items = kvlayout::runs::plan_items(runs_of(runs), runs.shape(0));
  auto* out = new std::uint64_t[items.size() * 3];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  std::memcpy(out, items.data(), items.size() * sizeof(kvlayout::runs::Item));
  return RunTable(out, {items.size(), 3}, owner);
}

using UnitRows = nb::ndarray<nb::numpy, std::uint64_t, nb::shape<-1, 5>>;

// Every unit the CUDA grid copies for the runs through the items, by the kernel's own
// mapping compiled for the host: rows (run, offset in the run, width, source, destination),
// thread by thread (for tests).
UnitRows run_units(RunArray runs, RunArray items) {
  namespace kr = kvlayout::runs;
  const kr::Run* table = runs_of(runs);
  const auto* plan = reinterpret_cast<const kr::Item*>(items.data());
  const std::size_t n = runs.shape(0);
  std::vector<std::uint64_t> rows;
  for (std::size_t i = 0; i < items.shape(0); ++i) {
    const kr::Item& item = plan[i];
    if (item.run >= n || (item.count != 0 && item.run + std::uint64_t{item.count} > n) ||
        (item.count == 0 && (item.offset > table[item.run].len || item.bytes > table[item.run].len - item.offset)))
      throw nb::value_error("an item lies outside the runs");
    if (item.count != 0 && (item.offset == 0 || item.offset > kr::kWarp || item.count * item.offset > kr::kThreads))
      throw nb::value_error("a pack's lanes do not fit a thread block");
    for (std::uint32_t t = 0; t < kr::kThreads; ++t) {
      const std::int64_t at = kr::run_of(item, t);
      if (at < 0) continue;
      const auto run = static_cast<std::uint64_t>(at);
      const auto record = [&](std::uint64_t s, std::uint64_t d, std::uint64_t width) {
        rows.insert(rows.end(), {run, s - table[run].src, width, s, d});
      };
      kr::for_each_unit_of(
          item, table, t, [&](std::uint64_t s, std::uint64_t d) { record(s, d, 1); },
          [&](std::uint32_t unit, std::uint64_t s, std::uint64_t d, std::uint64_t step, std::uint32_t count) {
            for (std::uint32_t k = 0; k < count; ++k) record(s + k * step, d + k * step, unit);
          });
    }
  }
  auto* out = new std::uint64_t[rows.size()];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  std::copy(rows.begin(), rows.end(), out);
  return UnitRows(out, {rows.size() / 5, 5}, owner);
}

using SegmentArray = nb::ndarray<nb::numpy, std::uint8_t, nb::shape<-1, sizeof(kvlayout::plan::Segment)>>;
using UnitArray = nb::ndarray<nb::numpy, std::int64_t, nb::shape<-1, 4>>;

// (segment table, one row of bytes per segment; widest unit; largest segment's bytes;
// kernel depth): what the CUDA plan uploads and launches with.
std::tuple<SegmentArray, std::uint32_t, std::uint32_t, int> plan_segments(const JobArgs& a, int direction) {
  const auto segments = direction_segments(a, direction);
  const std::size_t n = segments.size() * sizeof(kvlayout::plan::Segment);
  auto* out = new std::uint8_t[n];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint8_t*>(p); });
  std::memcpy(out, segments.data(), n);
  return {SegmentArray(out, {segments.size(), sizeof(kvlayout::plan::Segment)}, owner),
          kvlayout::plan::widest_unit(segments, std::get<9>(a)), kvlayout::plan::largest_bytes(segments),
          kvlayout::plan::depth_for(segments.data(), segments.size())};
}

// Every unit the CUDA grid would copy for one job, through the kernels' own mapping
// (kvlayout/transfer_plan.h) compiled for the host: rows (pointer index, cache byte offset
// from that pointer, chunk index, chunk byte offset), in grid order.
UnitArray device_units(const JobArgs& a, IntArray block_ids, IntArray chunk_tokens, std::int64_t blocks_per_chunk,
                       std::int64_t skip, std::uint32_t unit, int direction) {
  namespace kp = kvlayout::plan;
  const auto segments = direction_segments(a, direction);
  const std::int64_t block_size = std::get<8>(a), row_bytes = std::get<9>(a);
  if (unit != 1 && unit != 2 && unit != 4 && unit != 8 && unit != 16) throw nb::value_error("unit is 1, 2, 4, 8 or 16");
  const std::uint32_t threads = kp::threads_for(kp::largest_bytes(segments), unit);
  const int depth = kp::depth_for(segments.data(), segments.size());
  const auto count = static_cast<std::int64_t>(block_ids.shape(0));
  if (blocks_per_chunk <= 0 || skip < 0 || skip > count || count >= (std::int64_t{1} << 31))
    throw nb::value_error("bad batch");
  std::vector<std::int64_t> rows;
  for (std::uint32_t x = 0; x < static_cast<std::uint32_t>(count - skip); ++x) {
    const kp::Task t = kp::task_of(block_ids.data(), static_cast<std::uint32_t>(skip), x,
                                   static_cast<std::uint32_t>(blocks_per_chunk), static_cast<std::uint32_t>(block_size));
    if (t.chunk >= chunk_tokens.shape(0)) throw nb::value_error("too few chunks for the blocks");
    for (const kp::Segment& s : segments) {
      const std::uint64_t cache = kp::cache_start(s, 0, t.block);
      const std::uint64_t chunk = kp::chunk_start(s, 0, chunk_tokens.data()[t.chunk], t.first_token, row_bytes);
      const auto record = [&](const kp::Offsets* o, const bool* live) {
        for (int k = 0; k < kp::kUnroll; ++k) {
          if (!live[k]) continue;
          rows.insert(rows.end(), {static_cast<std::int64_t>(s.pointer), static_cast<std::int64_t>(cache + o[k].cache),
                                   static_cast<std::int64_t>(t.chunk), static_cast<std::int64_t>(chunk + o[k].chunk)});
        }
      };
      kp::with_depth(depth, [&](auto d) {
        for (std::uint32_t thread = 0; thread < threads; ++thread)
          kp::for_each_unit<decltype(d)::value>(s, unit, thread, threads, record);
      });
    }
  }
  auto* out = new std::int64_t[rows.size()];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::int64_t*>(p); });
  std::copy(rows.begin(), rows.end(), out);
  return UnitArray(out, {rows.size() / 4, 4}, owner);
}

// -- block maps (csrc/block_map.h) -------------------------------------------------------

using U64Rows = nb::ndarray<const std::uint64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using MapRuns = nb::ndarray<nb::numpy, std::uint64_t, nb::shape<-1, 3>>;
using MapGroups = nb::ndarray<nb::numpy, std::uint64_t, nb::shape<-1, 9>>;
using ConstGroups = nb::ndarray<const std::uint64_t, nb::shape<-1, 9>, nb::c_contig, nb::device::cpu>;

const std::uint64_t* rows_of(const U64Rows& a, std::size_t width, const char* name) {
  if (a.shape(1) != width)
    throw nb::value_error((std::string(name) + " must have " + std::to_string(width) + " columns").c_str());
  return a.data();
}

std::tuple<MapGroups, std::uint64_t, bool> build_groups(U64Rows slabs, IntArray group_starts, std::tuple<int, int, int, int> order,
                                      std::int64_t heads, std::int64_t tokens, IntArray src_blocks,
                                      std::int64_t src_block_size, IntArray dst_blocks, std::int64_t dst_block_size,
                                      U64Rows src_classes, U64Rows dst_classes, bool force_sort,
                                      bool blocks_one_by_one, bool slabs_one_by_one, std::int64_t first_token,
                                      std::optional<IntArray> src_page_slots,
                                      std::optional<IntArray> dst_page_slots) {
  namespace bm = kvlayout::block_map;
  const auto* slab_rows = reinterpret_cast<const bm::Slab*>(rows_of(slabs, 10, "slabs"));
  const auto* src_cls = reinterpret_cast<const bm::Strides*>(rows_of(src_classes, 2, "src_classes"));
  const auto* dst_cls = reinterpret_cast<const bm::Strides*>(rows_of(dst_classes, 2, "dst_classes"));
  const auto num_slabs = static_cast<std::int64_t>(slabs.shape(0));
  if (src_block_size <= 0 || dst_block_size <= 0 || tokens < 0 || heads < 0)
    throw nb::value_error("block sizes must be positive, tokens and heads non-negative");
  if (first_token < 0 || first_token > tokens) throw nb::value_error("first_token must lie in [0, tokens]");
  if (static_cast<std::int64_t>(src_blocks.shape(0)) * src_block_size < tokens ||
      static_cast<std::int64_t>(dst_blocks.shape(0)) * dst_block_size < tokens)
    throw nb::value_error("too few block ids for the tokens");
  // A page's slots lie in its block: each page starts at a slot from which block_size fit.
  const auto page_slots = [](const std::optional<IntArray>& given, const IntArray& blocks, std::int64_t page,
                              const char* name) {
    if (!given) return static_cast<const std::int64_t*>(nullptr);
    const IntArray& slots = *given;
    if (slots.shape(0) != blocks.shape(0))
      throw nb::value_error((std::string(name) + " must hold one slot per block id").c_str());
    for (std::size_t i = 0; i < slots.shape(0); ++i)
      if (slots.data()[i] < 0 || slots.data()[i] % page)
        throw nb::value_error((std::string(name) + " must be non-negative multiples of the block size").c_str());
    return slots.data();
  };
  const std::int64_t* src_slots = page_slots(src_page_slots, src_blocks, src_block_size, "src_page_slots");
  const std::int64_t* dst_slots = page_slots(dst_page_slots, dst_blocks, dst_block_size, "dst_page_slots");
  const auto groups = static_cast<std::int64_t>(group_starts.shape(0)) - 1;
  if (groups < 0 || group_starts.data()[0] != 0 || group_starts.data()[groups] != num_slabs)
    throw nb::value_error("group_starts must run from 0 to the number of slabs");
  for (std::int64_t g = 0; g < groups; ++g)
    if (group_starts.data()[g + 1] <= group_starts.data()[g]) throw nb::value_error("groups must be non-empty");
  for (std::int64_t s = 0; s < num_slabs; ++s) {
    const bm::Slab& r = slab_rows[s];
    if (r.src_class >= src_classes.shape(0) || r.dst_class >= dst_classes.shape(0) || r.tail > 2 || r.width == 0)
      throw nb::value_error("a slab names a stride class that does not exist, or has no bytes");
  }
  const auto [o0, o1, o2, o3] = order;
  int seen = 0;
  for (int o : {o0, o1, o2, o3}) {
    if (o < 0 || o > 3) throw nb::value_error("order holds the levels 0-3");
    seen |= 1 << o;
  }
  if (seen != 15) throw nb::value_error("order must name each level once");
  {
    const int levels[4] = {o0, o1, o2, o3};
    const auto at = [&](int level) { return std::find(levels, levels + 4, level) - levels; };
    if (at(bm::kSlot) < at(bm::kBlock))  // the walk counts a block's slots from its block
      throw nb::value_error("order puts the slot level outside the block level");
  }
  const bm::Request q{slab_rows, group_starts.data(), groups, {o0, o1, o2, o3}, heads, tokens,
                      src_blocks.data(), src_block_size, dst_blocks.data(), dst_block_size,
                      src_cls, static_cast<std::int64_t>(src_classes.shape(0)),
                      dst_cls, static_cast<std::int64_t>(dst_classes.shape(0)), first_token,
                      src_slots, dst_slots};
  auto* built = new bm::Built();
  {
    nb::gil_scoped_release release;
    *built = bm::build_groups(q, force_sort, blocks_one_by_one, slabs_one_by_one);
  }
  nb::capsule owner(built, [](void* p) noexcept { delete static_cast<bm::Built*>(p); });
  auto* data = reinterpret_cast<std::uint64_t*>(built->groups.rows);
  const bool in_order = built->walked_in_order;
  const std::uint64_t runs = built->runs;
  return {MapGroups(data, {built->size, 9}, owner), runs, in_order};
}

// A table of groups from Python, checked so that reading it back cannot run away: every
// group holds at least one run, and all of them at most 2^40.
const kvlayout::block_map::RunGroup* groups_of(const ConstGroups& groups, std::uint64_t* runs = nullptr) {
  const auto* g = reinterpret_cast<const kvlayout::block_map::RunGroup*>(groups.data());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < groups.shape(0); ++i) {
    if (g[i].rows == 0 || g[i].count == 0 || g[i].rows > (std::uint64_t{1} << 40) / g[i].count ||
        (total += g[i].runs()) > (std::uint64_t{1} << 40))
      throw nb::value_error("groups: each group needs rows and runs, at most 2^40 runs in all");
  }
  if (runs) *runs = total;
  return g;
}

// The runs of a table of groups, in order ((N, 3) uint64).
MapRuns expand_groups(ConstGroups groups) {
  std::uint64_t n = 0;
  const auto* g = groups_of(groups, &n);
  auto* out = new std::uint64_t[std::max<std::uint64_t>(3 * n, 1)];
  {
    nb::gil_scoped_release release;
    kvlayout::block_map::GroupReader(g, groups.shape(0)).read(reinterpret_cast<kvlayout::ByteRun*>(out), n);
  }
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  return MapRuns(out, {static_cast<std::size_t>(n), 3}, owner);
}

// Consecutive runs given one at a time, as the builder's Grouper keeps them (for tests).
MapGroups group_runs(nb::ndarray<const std::uint64_t, nb::shape<-1, 3>, nb::c_contig, nb::device::cpu> runs) {
  auto* table = new kvlayout::block_map::detail::Table<kvlayout::block_map::RunGroup>();
  kvlayout::block_map::Grouper grouper(table);
  const std::uint64_t* r = runs.data();
  for (std::size_t i = 0; i < runs.shape(0); ++i) grouper.add(r[3 * i], r[3 * i + 1], r[3 * i + 2], 1, 0, 0);
  grouper.finish();
  const std::size_t n = grouper.used();
  nb::capsule owner(table, [](void* p) noexcept {
    delete static_cast<kvlayout::block_map::detail::Table<kvlayout::block_map::RunGroup>*>(p);
  });
  return MapGroups(reinterpret_cast<std::uint64_t*>(table->rows), {n, 9}, owner);
}

std::vector<kvlayout::block_map::Span> spans_of(const U64Rows& a, const char* name) {
  const std::uint64_t* d = rows_of(a, 4, name);
  std::vector<kvlayout::block_map::Span> out;
  for (std::size_t i = 0; i < a.shape(0); ++i) {
    const kvlayout::block_map::Span s{d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]};
    if (s.blocks == 0 || s.period == 0 || s.block == 0 || s.block > s.period)
      throw nb::value_error((std::string(name) + ": a span needs blocks, a period and a block that fits it").c_str());
    out.push_back(s);
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.start < y.start; });
  return out;
}

using ConstRunArray = nb::ndarray<const std::uint64_t, nb::shape<-1, 3>, nb::c_contig, nb::device::cpu>;

using kvlayout::block_map::Problem;

std::tuple<Problem, std::int64_t, std::int64_t> validate_runs(ConstRunArray runs, U64Rows src_spans, U64Rows dst_spans,
                                                              bool dst_disjoint) {
  const auto src = spans_of(src_spans, "src_spans"), dst = spans_of(dst_spans, "dst_spans");
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  nb::gil_scoped_release release;
  const auto v = kvlayout::block_map::validate_runs(r, runs.shape(0), src, dst, true, dst_disjoint);
  return {v.problem, v.run, v.other};
}

std::tuple<Problem, std::int64_t, std::int64_t, int> copy_runs(ConstRunArray runs, U64Rows src_spans, U64Rows dst_spans,
                                                          int num_threads, std::uint64_t min_bytes_per_thread,
                                                          bool validate, int prefetch) {
  const auto mode = prefetch_mode(prefetch);
  const auto src = spans_of(src_spans, "src_spans"), dst = spans_of(dst_spans, "dst_spans");
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  const std::size_t n = runs.shape(0);
  nb::gil_scoped_release release;
  const auto v = validate ? kvlayout::block_map::validate_runs(r, n, src, dst) : kvlayout::block_map::Verdict{};
  if (v.problem != Problem::kNone) return {v.problem, v.run, v.other, 0};
  const int used = kvlayout::block_map::copy_runs(r, n, num_threads, min_bytes_per_thread, mode);
  return {Problem::kNone, -1, -1, used};
}

std::tuple<Problem, std::int64_t, std::int64_t> validate_groups(ConstGroups groups, U64Rows src_spans, U64Rows dst_spans,
                                                                bool one_memory) {
  const auto src = spans_of(src_spans, "src_spans"), dst = spans_of(dst_spans, "dst_spans");
  const auto* g = groups_of(groups);
  nb::gil_scoped_release release;
  const auto v = kvlayout::block_map::validate_groups(g, groups.shape(0), src, dst, one_memory);
  return {v.problem, v.run, v.other};
}

std::tuple<Problem, std::int64_t, std::int64_t, int> copy_groups(ConstGroups groups, U64Rows src_spans, U64Rows dst_spans,
                                                            int num_threads, std::uint64_t min_bytes_per_thread,
                                                            int prefetch, kvlayout::PrefetchChoices* choices) {
  const auto mode = prefetch_mode(prefetch);
  const auto src = spans_of(src_spans, "src_spans"), dst = spans_of(dst_spans, "dst_spans");
  const auto* g = groups_of(groups);
  const std::size_t n = groups.shape(0);
  nb::gil_scoped_release release;
  const auto v = kvlayout::block_map::validate_groups(g, n, src, dst);
  if (v.problem != Problem::kNone) return {v.problem, v.run, v.other, 0};
  const int used = kvlayout::block_map::copy_groups(g, n, num_threads, min_bytes_per_thread, mode, choices);
  return {Problem::kNone, -1, -1, used};
}

// kvlayout.registration.memory.MemoryWatch's comparison, in one native pass: no torch
// function mode on (torch's accessors would call it), each tensor a plain torch.Tensor (its
// type compared, none of its methods called where it is not), at the data pointer read when
// the map was made, and each storage at its address and of its size, read through torch's
// own accessors (handed in: nothing here knows torch's layout). From cold caches each Python
// step of the same comparison cost microseconds: on bench-maps' SGL conv TP 1->2 (36 runs of
// 8 KiB) the Python check measured ~80 us of a ~250 us copy() (copy() and its checks in
// one native call: see GroupCopy::copy_watched).
class TensorWatch {
 public:
  TensorWatch(nb::tuple tensors, nb::tuple owners, std::vector<std::uint64_t> expected, nb::handle plain,
              nb::object mode_on, nb::object data_ptr, nb::object storage, nb::object storage_ptr,
              nb::object storage_bytes)
      : tensors_(std::move(tensors)), owners_(std::move(owners)), expected_(std::move(expected)),
        plain_(nb::borrow(plain)), mode_on_(std::move(mode_on)), data_ptr_(std::move(data_ptr)),
        storage_(std::move(storage)), storage_ptr_(std::move(storage_ptr)), storage_bytes_(std::move(storage_bytes)) {
    if (!PyType_Check(plain_.ptr())) throw nb::type_error("plain must be a type (torch.Tensor)");
    if (expected_.size() != tensors_.size() + 2 * owners_.size())
      throw nb::value_error("expected holds a data pointer per tensor, then a start per storage, then a size per storage");
  }

  // True while no torch function mode is on and every tensor is plain and where it was and
  // every storage unchanged; False otherwise (what moved is the placements' to say).
  bool unmoved() const {
    if (nb::cast<bool>(mode_on_())) return false;
    const std::size_t n = tensors_.size(), k = owners_.size();
    for (std::size_t i = 0; i < n; ++i)
      if (Py_TYPE(tensors_[i].ptr()) != reinterpret_cast<PyTypeObject*>(plain_.ptr())) return false;
    for (std::size_t i = 0; i < n; ++i)
      if (read(data_ptr_, tensors_[i]) != expected_[i]) return false;
    for (std::size_t i = 0; i < k; ++i) {
      const nb::object s = storage_(owners_[i]);
      if (read(storage_ptr_, s) != expected_[n + i] || read(storage_bytes_, s) != expected_[n + k + i]) return false;
    }
    return true;
  }

 private:
  static std::uint64_t read(const nb::object& accessor, nb::handle of) { return nb::cast<std::uint64_t>(accessor(of)); }

  nb::tuple tensors_, owners_;
  std::vector<std::uint64_t> expected_;
  nb::object plain_, mode_on_, data_ptr_, storage_, storage_ptr_, storage_bytes_;
};

// A map's groups and both sides' spans, copied out of Python's arrays once and validated
// once (validate_groups): nothing of them can change after, so each copy() only copies. What
// can change between copies, the tensors' memory, is the caller's to check first
// (kvlayout.registration.memory.MemoryWatch). Keeps no Python array and converts none per call.
class GroupCopy {
 public:
  GroupCopy(ConstGroups groups, U64Rows src_spans, U64Rows dst_spans, kvlayout::PrefetchChoices* choices,
            const TensorWatch* watch)
      : src_(spans_of(src_spans, "src_spans")), dst_(spans_of(dst_spans, "dst_spans")), choices_(choices),
        watch_(watch) {
    const auto* g = groups_of(groups);
    groups_.assign(g, g + groups.shape(0));
    nb::gil_scoped_release release;
    verdict_ = kvlayout::block_map::validate_groups(groups_.data(), groups_.size(), src_, dst_);
  }

  std::tuple<Problem, std::int64_t, std::int64_t> verdict() const {
    return {verdict_.problem, verdict_.run, verdict_.other};
  }

  // The copy on up to num_threads pool threads (GIL released), returning the threads used;
  // -1, copying nothing, where the verdict refuses the runs. A plain int: a tuple and an
  // enum cost a small map's copy() some microseconds from cold caches.
  int copy(int num_threads) {
    if (verdict_.problem != Problem::kNone) return -1;
    nb::gil_scoped_release release;
    return kvlayout::block_map::copy_groups(groups_.data(), groups_.size(), num_threads, kMinBytesPerThread,
                                            kvlayout::Prefetch::kAuto, choices_);
  }

  // copy() as a map's copy() calls it, its checks here too: -2, copying nothing, where the
  // call takes the full checks (num_threads not a plain int from 1 to the pool's size, or
  // the watch sees a mode on, a tensor not plain or memory moved); -1 where the verdict
  // refuses the runs; else the copy's threads.
  int copy_watched(nb::handle num_threads) {
    if (!PyLong_CheckExact(num_threads.ptr())) return -2;
    int overflow = 0;
    const long n = PyLong_AsLongAndOverflow(num_threads.ptr(), &overflow);
    static const int most = kvlayout::transfer::WorkerPool::max_threads();  // Python's MAX_THREADS, read once
    if (overflow != 0 || n < 1 || n > most) return -2;
    if (watch_ == nullptr || !watch_->unmoved()) return -2;
    return copy(static_cast<int>(n));
  }

  static constexpr std::uint64_t kMinBytesPerThread = 256 << 10;  // copy_groups' default

 private:
  std::vector<kvlayout::block_map::RunGroup> groups_;
  std::vector<kvlayout::block_map::Span> src_, dst_;
  kvlayout::PrefetchChoices* choices_;  // the map's pair's (kept alive by this object)
  const TensorWatch* watch_;             // both sides' tensors (kept alive by this object), or none
  kvlayout::block_map::Verdict verdict_;
};

// -- NIXL plans' per-run passes (csrc/staging.h) -----------------------------------------

template <class T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> vector_array(std::vector<T>&& v) {
  auto* held = new std::vector<T>(std::move(v));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(held->data(), {held->size()}, owner);
}

std::tuple<kvlayout::staging::RunProblem, std::int64_t> check_runs(ConstRunArray runs) {
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  nb::gil_scoped_release release;
  const auto c = kvlayout::staging::check_runs(r, runs.shape(0));
  return {c.problem, c.run};
}

void check_col(int col) {
  if (col != 0 && col != 1) throw nb::value_error("col is 0 (source) or 1 (destination)");
}

// A side's memory intervals [starts[k], ends[k]) as the native engine's spans.
std::vector<kvlayout::block_map::Span> intervals_of(const PtrArray& starts, const PtrArray& ends) {
  if (starts.shape(0) != ends.shape(0)) throw nb::value_error("starts and ends must be as long");
  return kvlayout::staging::interval_spans(starts.data(), ends.data(), starts.shape(0));
}

bool runs_sorted_on(ConstRunArray runs, int col) {
  check_col(col);
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  nb::gil_scoped_release release;
  return kvlayout::staging::sorted_on(r, runs.shape(0), col);
}

bool runs_disjoint_on(ConstRunArray runs, int col) {
  check_col(col);
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  nb::gil_scoped_release release;
  return kvlayout::staging::disjoint_on(r, runs.shape(0), col);
}

// One side's (address, length, device) descriptor rows of a table of runs.
MapRuns descriptor_rows(ConstRunArray runs, int col, std::uint64_t device) {
  check_col(col);
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  const std::size_t n = runs.shape(0);
  auto* out = new std::uint64_t[std::max<std::size_t>(3 * n, 1)];
  {
    nb::gil_scoped_release release;
    for (std::size_t i = 0; i < n; ++i)
      out[3 * i] = kvlayout::staging::on(r[i], col), out[3 * i + 1] = r[i].len, out[3 * i + 2] = device;
  }
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  return MapRuns(out, {n, 3}, owner);
}

using StridedU64 = nb::ndarray<const std::uint64_t, nb::ndim<1>, nb::device::cpu>;

std::int64_t first_outside(StridedU64 addr, StridedU64 lengths, PtrArray starts, PtrArray ends) {
  if (addr.shape(0) != lengths.shape(0) || starts.shape(0) != ends.shape(0))
    throw nb::value_error("addr and lengths, and starts and ends, must be as long");
  const auto intervals = kvlayout::staging::interval_spans(starts.data(), ends.data(), starts.shape(0));
  nb::gil_scoped_release release;
  return kvlayout::staging::first_outside(addr.data(), addr.stride(0), lengths.data(), lengths.stride(0),
                                          addr.shape(0), intervals);
}

using U64Out = nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>>;
using I64Out = nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>;

I64Out address_order(ConstRunArray runs, int col) {
  check_col(col);
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  std::vector<std::int64_t> order;
  {
    nb::gil_scoped_release release;
    order = kvlayout::staging::address_order(r, runs.shape(0), col);
  }
  return vector_array(std::move(order));
}

std::size_t stretch_count(ConstRunArray runs, int col, PtrArray starts, PtrArray ends) {
  check_col(col);
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  const auto intervals = intervals_of(starts, ends);
  nb::gil_scoped_release release;
  return kvlayout::staging::stretch_count(r, runs.shape(0), col, intervals);
}

std::tuple<MapRuns, I64Out, U64Out, U64Out, U64Out> stretches(ConstRunArray runs, IntArray order, int col,
                                                             PtrArray starts, PtrArray ends, std::uint64_t base,
                                                             int copies) {
  namespace sg = kvlayout::staging;
  check_col(col);
  if (copies < 0 || copies > 2) throw nb::value_error("copies is 0 (none), 1 (to staging) or 2 (from staging)");
  const auto intervals = intervals_of(starts, ends);
  const auto* r = reinterpret_cast<const kvlayout::ByteRun*>(runs.data());
  const std::size_t n = runs.shape(0);
  if (order.shape(0) != 0 && order.shape(0) != n) throw nb::value_error("order lists every run, or none");
  for (std::size_t k = 0; k < order.shape(0); ++k)
    if (order.data()[k] < 0 || static_cast<std::size_t>(order.data()[k]) >= n)
      throw nb::value_error("order holds a position outside the runs");
  const std::size_t rows = copies ? n : 0;
  auto* out = new std::uint64_t[std::max<std::size_t>(3 * rows, 1)];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  sg::Stretches st;
  {
    nb::gil_scoped_release release;
    st = sg::stretches(r, n, order.shape(0) ? order.data() : nullptr, col, intervals, base,
                       static_cast<sg::Copies>(copies), copies ? reinterpret_cast<kvlayout::ByteRun*>(out) : nullptr);
  }
  return {MapRuns(out, {rows, 3}, owner), vector_array(std::move(st.first)), vector_array(std::move(st.at)),
          vector_array(std::move(st.staged_at)), vector_array(std::move(st.bytes))};
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "The C++ side of kvlayout: the generated format table and host indexers.";

  // The refusals' reasons, named here once: Python keys its messages by these members.
  nb::enum_<Problem>(m, "MapProblem", "Why validate_runs refuses a table of runs (csrc/block_map.h).")
      .value("none", Problem::kNone)
      .value("src_outside", Problem::kSrcOutside, "A run's source bytes lie in no source span.")
      .value("dst_outside", Problem::kDstOutside, "A run's destination bytes lie in no destination span.")
      .value("dst_overlap", Problem::kDstOverlap, "Two runs write the same bytes.")
      .value("src_dst_overlap", Problem::kSrcDstOverlap, "A run writes bytes another run reads.")
      .value("empty", Problem::kEmpty, "A run has no bytes.");
  using kvlayout::staging::RunProblem;
  nb::enum_<RunProblem>(m, "RunProblem", "Why check_runs refuses a map's runs as NIXL descriptors (csrc/staging.h).")
      .value("none", RunProblem::kNone)
      .value("empty", RunProblem::kEmpty, "A run has no bytes.")
      .value("src_wraps", RunProblem::kSrcWraps, "A run's source runs past the end of the address space.")
      .value("dst_wraps", RunProblem::kDstWraps, "A run's destination runs past the end of the address space.");

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
      .def(nb::init<const std::vector<JobArgs>&, std::int64_t, int, std::int64_t, int, bool, bool>(), "jobs"_a,
           "num_blocks"_a, "order"_a = -1, "stream_min_bytes"_a = kvlayout::transfer::kStreamMinBytes,
           "prefetch"_a = -1, "listed"_a = true, "lanes"_a = true,
           "order: -1 chooses per call, 0 walks block-major, 1 layer-major; calls moving at least "
           "stream_min_bytes write with streaming stores; prefetch -1 measures whether prefetching ahead of the "
           "copy is faster, per direction, 0 leaves the coming moves to the hardware, 1 prefetches; listed "
           "False copies one-run segments with the nested walk too; lanes False never copies nested moves in lanes "
           "(the knobs exist for tests and benchmarks).")
      .def("listed", &TransferPlan::listed, "direction"_a, "blocks_per_chunk"_a,
           "Whether a call's moves are listed as runs and copied by the run-list engine: every segment one run, "
           "an order that makes the source jump from move to move, and listed not turned off.")
      .def("lanes", &TransferPlan::lanes, "direction"_a, "blocks_per_chunk"_a,
           "Whether a call's moves take the nested walk in lanes: segments of several runs, an order that makes "
           "the source jump from move to move, and lanes not turned off (each group of moves then takes lanes "
           "where its source stretches pay).")
      .def("bytes_in_lanes", &TransferPlan::bytes_in_lanes, "direction"_a, "block_ids"_a, "chunk_ptrs"_a,
           "chunk_tokens"_a, "blocks_per_chunk"_a, "skip_prefix_blocks"_a,
           "The bytes a one-thread call with these arguments copies in lanes, where it streams and prefetches: "
           "for tests (block ids are not checked here).")
      .def("prefetch_costs", &TransferPlan::prefetch_costs, "direction"_a, "many_threads"_a = false,
           "(calls measured, ns per byte without prefetching, ns per byte with; 0 before a way ran) of one "
           "direction's measured choice, for tests.")
      .def("run", &TransferPlan::run, "direction"_a, "block_ids"_a, "chunk_ptrs"_a, "chunk_tokens"_a,
           "blocks_per_chunk"_a, "skip_prefix_blocks"_a, "num_threads"_a,
           "Copy blocks (0: cache -> chunks, 1: chunks -> cache) on up to num_threads pool threads. Returns "
           "(index of the first block id out of range or -1, threads used); nothing moves when an id is bad.");

  // Block id checks, shared by the CPU and CUDA plans (kvlayout.transfer asks before running).
  m.def(
      "first_bad_block_id",
      [](IntArray block_ids, std::int64_t num_blocks) {
        return kvlayout::transfer::first_bad_block_id(block_ids.data(), static_cast<std::int64_t>(block_ids.shape(0)),
                                                      num_blocks);
      },
      "block_ids"_a, "num_blocks"_a, "The index of the first block id outside [0, num_blocks), or -1.");
  m.def(
      "first_repeated_block_id",
      [](IntArray block_ids, std::int64_t skip, std::int64_t num_blocks) {
        const auto n = static_cast<std::int64_t>(block_ids.shape(0));
        if (skip < 0 || skip > n) throw nb::value_error("skip is outside [0, len(block_ids)]");
        // the bitmap it keeps holds the pool's ids only: one outside would be a write past it
        if (kvlayout::transfer::first_bad_block_id(block_ids.data(), n, num_blocks) >= 0)
          throw nb::value_error("a block id is outside [0, num_blocks)");
        return kvlayout::transfer::first_repeated_block_id(block_ids.data(), n, skip, num_blocks);
      },
      "block_ids"_a, "skip"_a, "num_blocks"_a,
      "The index of the first block id after the skipped ones that repeats an earlier one there, or -1 (ids "
      "outside [0, num_blocks) are a ValueError).");
  m.def("plan_segments", &plan_segments, "job"_a, "direction"_a = 0,
        "(segment table (a row of bytes per segment), widest copy unit, largest segment bytes, kernel depth) of a "
        "job in one direction (a load leaves out repeated pointers), for the CUDA plan.");
  m.def("device_units", &device_units, "job"_a, "block_ids"_a, "chunk_tokens"_a, "blocks_per_chunk"_a, "skip"_a,
        "unit"_a, "direction"_a = 0,
        "The units the CUDA grid copies for a job in one direction, by the kernels' mapping run on the host (for "
        "tests).");

  m.def("build_groups", &build_groups, "slabs"_a, "group_starts"_a, "order"_a, "heads"_a, "tokens"_a, "src_blocks"_a,
        "src_block_size"_a, "dst_blocks"_a, "dst_block_size"_a, "src_classes"_a, "dst_classes"_a,
        "force_sort"_a = false, "blocks_one_by_one"_a = false, "slabs_one_by_one"_a = false, "first_token"_a = 0,
        "src_page_slots"_a = nb::none(), "dst_page_slots"_a = nb::none(),
        "A block map's runs as groups ((G, 9) uint64: src, dst, len, count, src_step, dst_step, rows, src_row, "
        "dst_row; see csrc/run_groups.h) from its slabs, how many runs they hold, and whether the walk was in "
        "destination order (else the runs were sorted and merged again). *_page_slots: where each block id's page "
        "starts in its block, in slots (pages finer than blocks), or None: every page a whole block.");
  m.def("expand_groups", &expand_groups, "groups"_a, "The runs of a table of groups, in order ((N, 3) uint64).");
  m.def("group_runs", &group_runs, "runs"_a,
        "A table of runs as the map builder's Grouper keeps them, given one by one (for tests).");
  m.def("validate_groups", &validate_groups, "groups"_a, "src_spans"_a, "dst_spans"_a, "one_memory"_a = true,
        "validate_runs over the runs a table of groups holds (one_memory=False: the sides are two processes' "
        "addresses, so a source may repeat a destination's without sharing a byte).");
  m.def("first_outside", &first_outside, "addr"_a, "lengths"_a, "starts"_a, "ends"_a,
        "The first row [addr, addr + length) inside none of the sorted disjoint intervals [starts, ends), "
        "or -1.");
  m.def("check_runs", &check_runs, "runs"_a,
        "(problem, run): RunProblem.none when every run has bytes and ends inside the address space on both "
        "sides; else the first run's RunProblem.");
  m.def("runs_sorted_on", &runs_sorted_on, "runs"_a, "col"_a,
        "Whether the runs' addresses on side col (0 source, 1 destination) never decrease.");
  m.def("runs_disjoint_on", &runs_disjoint_on, "runs"_a, "col"_a,
        "Whether the runs on side col (0 source, 1 destination) are disjoint in ascending address order.");
  m.def("descriptor_rows", &descriptor_rows, "runs"_a, "col"_a, "device"_a,
        "Side col's (address, length, device) rows of a table of runs, for NIXL.");
  m.def("address_order", &address_order, "runs"_a, "col"_a,
        "The positions of the runs ((N, 3) uint64) by address on side col (0 source, 1 destination), ties in run "
        "order: numpy's stable argsort of that column, by a radix sort.");
  m.def("stretch_count", &stretch_count, "runs"_a, "col"_a, "starts"_a, "ends"_a,
        "How many stretches stretches() cuts the runs into by address on side col (the length of its first "
        "array), without laying them out.");
  m.def("stretches", &stretches, "runs"_a, "order"_a, "col"_a, "starts"_a, "ends"_a, "base"_a, "copies"_a,
        "The staged layout of runs in order (empty: their own) by address on side col, cut into stretches back "
        "to back there within one of its intervals (starts, ends): the copies ((N, 3); copies 1 (other side, "
        "staging), 2 (staging, other side), 0 none), and per stretch its first position, address, staging "
        "address (base + offset) and bytes.");
  m.def("copy_groups", &copy_groups, "groups"_a, "src_spans"_a, "dst_spans"_a, "num_threads"_a,
        "min_bytes_per_thread"_a = 256 << 10, "prefetch"_a = -1, "choices"_a.none() = nb::none(),
        "copy_runs over the runs a table of groups holds, read back a buffer at a time; prefetch -1 "
        "measures in choices (the PrefetchChoices the caller keeps for its copies) or, given None, in the "
        "ones copy_runs shares.");
  nb::class_<TensorWatch>(m, "TensorWatch",
                          "kvlayout.registration.memory.MemoryWatch's comparison in one native pass (torch's "
                          "accessors handed in).")
      .def(nb::init<nb::tuple, nb::tuple, std::vector<std::uint64_t>, nb::handle, nb::object, nb::object, nb::object,
                    nb::object, nb::object>(),
           "tensors"_a, "owners"_a, "expected"_a, "plain"_a, "mode_on"_a, "data_ptr"_a, "storage"_a, "storage_ptr"_a,
           "storage_bytes"_a)
      .def("unmoved", &TensorWatch::unmoved,
           "No torch function mode on, every tensor of type plain at its data pointer, every storage (read "
           "through its owner tensor) at its address and of its size, as expected lists them.");
  nb::class_<GroupCopy>(m, "GroupCopy",
                        "A map's groups and spans held for its copies: copied and validated once (validate_groups), "
                        "then copied per call with no conversion or validation; the tensors' memory is the caller's "
                        "to check before each call.")
      .def(nb::init<ConstGroups, U64Rows, U64Rows, kvlayout::PrefetchChoices*, const TensorWatch*>(), "groups"_a,
           "src_spans"_a, "dst_spans"_a, "choices"_a, "watch"_a.none() = nb::none(), nb::keep_alive<1, 5>(),
           nb::keep_alive<1, 6>())
      .def("verdict", &GroupCopy::verdict, "validate_groups' answer, (problem, run, other run), from construction.")
      .def("copy", &GroupCopy::copy, "num_threads"_a,
           "Copy on up to num_threads pool threads (prefetching as the choices measure; GIL released) and "
           "return the threads used, or -1, copying nothing, where verdict() refuses the runs.")
      .def("copy_watched", &GroupCopy::copy_watched, "num_threads"_a.none(),
           "copy() after the watch's check, in one call: -2, copying nothing, where num_threads is not a plain int "
           "from 1 to max_threads() or the watch (given at construction) finds something moved; -1 where verdict() "
           "refuses the runs.");
  m.def("validate_runs", &validate_runs, "runs"_a, "src_spans"_a, "dst_spans"_a, "dst_disjoint"_a = false,
        "(problem, run, other run): MapProblem.none when every run lies in one source and one destination "
        "tensor's blocks (spans: start, period, block, blocks), destination runs are disjoint and none reads "
        "what another writes; else the first refused run's MapProblem. dst_disjoint: the caller knows the "
        "destinations are disjoint (they are not sorted to check where out of order).");
  m.def("copy_runs", &copy_runs, "runs"_a, "src_spans"_a, "dst_spans"_a, "num_threads"_a,
        "min_bytes_per_thread"_a = 256 << 10, "validate"_a = true, "prefetch"_a = -1,
        "validate_runs, then (if valid) copy the runs on up to num_threads pool threads, split by bytes, GIL "
        "released; returns validate_runs' answer and the threads used. validate=False is for runs a caller "
        "has validated itself (and kept read-only since). prefetch -1 measures whether prefetching ahead of "
        "the copy is faster for copies of this kind (in choices shared with copy_groups given none), 0 and 1 "
        "fix it.");
  nb::class_<kvlayout::PrefetchChoice>(m, "PrefetchChoice",
                                       "A copy's measured choice of prefetching or not (csrc/prefetch_choice.h), "
                                       "standalone, for its tests.")
      .def(nb::init<>())
      .def("pick", &kvlayout::PrefetchChoice::pick, "bytes"_a, "Whether a call moving bytes prefetches.")
      .def("record", &kvlayout::PrefetchChoice::record, "prefetch"_a, "bytes"_a, "ns"_a,
           "A call of bytes took ns the way it was picked.")
      .def("cost", &kvlayout::PrefetchChoice::cost, "prefetch"_a, "The estimate, ns per byte (0: not measured).")
      .def("calls", &kvlayout::PrefetchChoice::calls)
      .def("period", &kvlayout::PrefetchChoice::period,
           "Calls from one run of the slower way to the next, as the estimates stand.")
      .def_prop_ro_static("min_bytes", [](nb::handle) { return kvlayout::PrefetchChoice::kMinBytes; })
      .def_prop_ro_static("explore", [](nb::handle) { return kvlayout::PrefetchChoice::kExplore; })
      .def_prop_ro_static("explore_max", [](nb::handle) { return kvlayout::PrefetchChoice::kExploreMax; })
      .def_prop_ro_static("warm", [](nb::handle) { return kvlayout::PrefetchChoice::kWarm; });
  nb::class_<kvlayout::PrefetchChoices>(m, "PrefetchChoices",
                                        "The measured prefetch choices of one owner's copies, one per kind of "
                                        "copy (csrc/prefetch_choice.h).")
      .def(nb::init<>())
      .def("of", &kvlayout::PrefetchChoices::of, "bytes"_a, "runs"_a, "threads"_a, nb::rv_policy::reference_internal,
           "The choice copies of bytes in runs on threads share.");

  m.def("copy_byte_runs", &copy_byte_runs, "runs"_a.noconvert(), "streaming"_a = true, "prefetch"_a = true,
        "any_order"_a = false,
        "Copy an (N, 3) uint64 table of (source address, destination address, length) runs in order, GIL "
        "released (raw addresses: for tests; streaming=False takes the memcpy path, prefetch=False runs no "
        "cursors ahead of the copy, any_order=True lets runs whose destinations never overlap go in any "
        "order, in lanes where that pays).");
  m.def("lane_bytes", [](RunArray runs) {
          return kvlayout::stream::lane_bytes(reinterpret_cast<const kvlayout::ByteRun*>(runs.data()), runs.shape(0));
        }, "runs"_a.noconvert(),
        "The bytes of an (N, 3) uint64 run table where an any-order copy takes it in lanes (enough bytes, a "
        "source jumping every 2 to 256 KiB on average), else 0: for tests.");
  m.def("tiles_of", &tiles_of, "runs"_a.noconvert(),
        "The tiles copy_byte_runs copies column by column in an (N, 3) uint64 run table, as (first run, rows, "
        "cols) tuples (for tests).");
  m.def("flat_stream", &flat_stream, "dst"_a, "src"_a, "nbytes"_a, "num_threads"_a = 1,
        "A flat streaming copy of nbytes from src to dst (32-byte loads, non-temporal stores; raw addresses, for "
        "the benchmarks' baseline), on up to num_threads pool threads. Returns the threads used.");

  m.def("plan_run_items", &plan_run_items, "runs"_a.noconvert(),
        "The CUDA run executor's thread-block work items of an (N, 3) uint64 run table, as an (M, 3) uint64 "
        "array (offset, bytes, run | count << 32).");
  m.def("run_units", &run_units, "runs"_a.noconvert(), "items"_a.noconvert(),
        "Every unit the CUDA run kernel copies, by its mapping run on the host: rows (run, offset, width, "
        "source, destination) (for tests).");

  m.def("pool_workers", [] { return kvlayout::transfer::WorkerPool::instance().num_workers(); },
        "Worker threads the transfer pool has created so far (they persist across calls).");
  m.def("max_threads", &kvlayout::transfer::WorkerPool::max_threads,
        "The most threads one transfer uses: the hardware's thread count (at most 256).");
}
