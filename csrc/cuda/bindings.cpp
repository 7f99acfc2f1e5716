// kvlayout._cuda: the CUDA block transfer (built when CMake finds a CUDA toolkit).
// Device addresses cross as ints; kvlayout/transfer/cuda.py validates everything, and
// kvlayout._native.plan_segments builds the segment table it uploads.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "cuda/run_kernels.h"
#include "cuda/transfer_kernels.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

std::uint32_t checked_u32(std::int64_t v, std::int64_t limit, const char* what) {
  if (v < 0 || v >= limit) throw nb::value_error((std::string(what) + " is out of range").c_str());
  return static_cast<std::uint32_t>(v);
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "The CUDA block transfer over the transfer plan's segments.";
  m.def("device_count", &kvlayout::cuda::device_count, "CUDA devices visible (0 without a device or driver).");
  m.def(
      "load_kernels",
      [] {
        int err = kvlayout::cuda::load_transfer_kernels();
        if (err == 0) err = kvlayout::cuda::load_run_kernel();
        if (err != 0)
          throw nb::value_error(
              (std::string("loading the CUDA kernels failed: ") + kvlayout::cuda::error_string(err)).c_str());
      },
      "Load every kernel into the current device's context now, not at its first launch: under CUDA's lazy "
      "loading a first launch may wait for the work already queued on the device.");
  m.def(
      "transfer_blocks",
      [](int direction, std::uintptr_t segments, std::int64_t num_segments, std::int64_t largest_segment, int depth,
         std::uintptr_t cache_ptrs, std::int64_t block_size, std::int64_t row_bytes, int unit, std::uintptr_t block_ids,
         std::int64_t num_blocks, std::uintptr_t chunk_ptrs, std::uintptr_t chunk_tokens, std::int64_t blocks_per_chunk,
         std::int64_t skip_prefix_blocks, std::uintptr_t stream) {
        constexpr std::int64_t k31 = std::int64_t{1} << 31;
        if (unit != 1 && unit != 2 && unit != 4 && unit != 8 && unit != 16) throw nb::value_error("unit is 1, 2, 4, 8 or 16");
        const kvlayout::cuda::DeviceJob job{
            reinterpret_cast<const kvlayout::plan::Segment*>(segments),
            checked_u32(num_segments, 65536, "the number of segments"),
            kvlayout::plan::threads_for(checked_u32(largest_segment, k31, "a segment's bytes"),
                                        static_cast<std::uint32_t>(unit)),
            depth,
            reinterpret_cast<const std::uint64_t*>(cache_ptrs),
            checked_u32(block_size, k31, "the block size"),
            row_bytes};
        const kvlayout::cuda::DeviceBatch batch{reinterpret_cast<const std::int64_t*>(block_ids),
                                                checked_u32(num_blocks, k31, "the number of block ids"),
                                                reinterpret_cast<const std::uint64_t*>(chunk_ptrs),
                                                reinterpret_cast<const std::int64_t*>(chunk_tokens),
                                                checked_u32(blocks_per_chunk, k31, "blocks per chunk"),
                                                checked_u32(skip_prefix_blocks, k31, "the skipped prefix")};
        const int err = kvlayout::cuda::launch_transfer(job, batch, direction, unit, reinterpret_cast<void*>(stream));
        if (err != 0) throw nb::value_error((std::string("CUDA transfer failed: ") + kvlayout::cuda::error_string(err)).c_str());
      },
      "direction"_a, "segments"_a, "num_segments"_a, "largest_segment"_a, "depth"_a, "cache_ptrs"_a, "block_size"_a,
      "row_bytes"_a, "unit"_a, "block_ids"_a, "num_blocks"_a, "chunk_ptrs"_a, "chunk_tokens"_a, "blocks_per_chunk"_a,
      "skip_prefix_blocks"_a, "stream"_a,
      "Launch one job's transfer on `stream`: its segment table and pointer table, then the call's block ids, "
      "chunk addresses and chunk token counts (device addresses as ints).");
  m.def(
      "copy_runs",
      [](std::uintptr_t runs, std::uintptr_t items, std::int64_t num_items, std::uintptr_t stream) {
        if (num_items < 0 || num_items >= (std::int64_t{1} << 32)) throw nb::value_error("the number of items is out of range");
        const int err = kvlayout::cuda::launch_copy_runs(reinterpret_cast<const kvlayout::runs::Run*>(runs),
                                                         reinterpret_cast<const kvlayout::runs::Item*>(items),
                                                         static_cast<std::uint32_t>(num_items),
                                                         reinterpret_cast<void*>(stream));
        if (err != 0) throw nb::value_error((std::string("CUDA run copy failed: ") + kvlayout::cuda::error_string(err)).c_str());
      },
      "runs"_a, "items"_a, "num_items"_a, "stream"_a,
      "Launch the copy of a run table through its work items (kvlayout._native.plan_run_items) on `stream`, on "
      "the current device (device addresses as ints).");
}
