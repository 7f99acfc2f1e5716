#pragma once
// The CUDA block transfer: the same job as the CPU engine (csrc/transfer.h), one CUDA
// block per (chunk block, kv, layer), threads striding over the block's rows in `unit`
// byte vectors; every address comes from the generated indexer (kvlayout::locate).

#include <cstdint>

#include "kvlayout/indexing.cuh"

namespace kvlayout::cuda {

struct DeviceJob {
  EngineKVFormat format;
  Sizes sizes;
  std::int64_t block_stride;      // elements; 0 = tight
  std::int64_t element_size;      // bytes
  const std::uint64_t* cache_ptrs;  // device array, the job's pointer table
  std::int64_t kv_size;
  std::int64_t num_layers;
  std::int64_t block_size;
  std::int64_t num_heads;
  std::int64_t head_size;         // elements of one head's row for this job
  std::int64_t row_bytes;         // the chunk's whole token row
  std::int64_t row_offset;        // where this job's row starts in it (bytes)
};

struct DeviceBatch {
  const std::int64_t* block_ids;    // device
  std::int64_t num_blocks;
  const std::uint64_t* chunk_ptrs;  // device, one per chunk
  const std::int64_t* chunk_tokens; // device
  std::int64_t blocks_per_chunk;
  std::int64_t skip_prefix_blocks;
};

// direction 0 = store (cache -> chunks), 1 = load. `unit` (1, 2, 4, 8 or 16 bytes) must
// divide every contiguous run, row offset and pointer alignment; the caller checks it.
// Returns the cudaError_t of the launch as an int (0 = success).
int launch_transfer(const DeviceJob& job, const DeviceBatch& batch, int direction, int unit, void* stream);

// The number of CUDA devices (0 when there is no device or no driver).
int device_count();

// The message of a cudaError_t returned above.
const char* error_string(int error);

}  // namespace kvlayout::cuda
