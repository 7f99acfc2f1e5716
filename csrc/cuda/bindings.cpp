// kvlayout._cuda: the CUDA block transfer (built when CMake finds a CUDA toolkit).
// Device addresses cross as ints; kvlayout/cuda_transfer.py validates everything.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/transfer_kernels.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cuda, m) {
  m.doc() = "The CUDA block transfer over the generated indexers.";
  m.def("device_count", &kvlayout::cuda::device_count, "CUDA devices visible (0 without a device or driver).");
  m.def(
      "transfer_blocks",
      [](int direction, std::int32_t format, const std::vector<std::int64_t>& sizes, std::int64_t block_stride,
         std::int64_t element_size, std::uintptr_t cache_ptrs, std::int64_t kv_size, std::int64_t num_layers,
         std::int64_t block_size, std::int64_t num_heads, std::int64_t head_size, std::int64_t row_bytes,
         std::int64_t row_offset, int unit, std::uintptr_t block_ids, std::int64_t num_blocks, std::uintptr_t chunk_ptrs,
         std::uintptr_t chunk_tokens, std::int64_t blocks_per_chunk, std::int64_t skip_prefix_blocks,
         std::uintptr_t stream) {
        if (sizes.size() != static_cast<std::size_t>(kvlayout::kNumSizeFields)) throw nb::value_error("wrong number of sizes");
        const kvlayout::cuda::DeviceJob job{static_cast<kvlayout::EngineKVFormat>(format),
                                            kvlayout::sizes_from(sizes.data()),
                                            block_stride,
                                            element_size,
                                            reinterpret_cast<const std::uint64_t*>(cache_ptrs),
                                            kv_size,
                                            num_layers,
                                            block_size,
                                            num_heads,
                                            head_size,
                                            row_bytes,
                                            row_offset};
        const kvlayout::cuda::DeviceBatch batch{reinterpret_cast<const std::int64_t*>(block_ids), num_blocks,
                                                reinterpret_cast<const std::uint64_t*>(chunk_ptrs),
                                                reinterpret_cast<const std::int64_t*>(chunk_tokens), blocks_per_chunk,
                                                skip_prefix_blocks};
        const int err = kvlayout::cuda::launch_transfer(job, batch, direction, unit, reinterpret_cast<void*>(stream));
        if (err != 0) throw nb::value_error((std::string("CUDA transfer failed: ") + kvlayout::cuda::error_string(err)).c_str());
      },
      "direction"_a, "format"_a, "sizes"_a, "block_stride"_a, "element_size"_a, "cache_ptrs"_a, "kv_size"_a,
      "num_layers"_a, "block_size"_a, "num_heads"_a, "head_size"_a, "row_bytes"_a, "row_offset"_a, "unit"_a,
      "block_ids"_a, "num_blocks"_a, "chunk_ptrs"_a, "chunk_tokens"_a, "blocks_per_chunk"_a, "skip_prefix_blocks"_a,
      "stream"_a, "Launch one job's transfer on `stream` (device addresses as ints).");
}
