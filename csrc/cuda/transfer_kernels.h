#pragma once
// The CUDA block transfer: the CPU engine's segments (kvlayout/transfer_plan.h), walked by
// one thread block per (moved block, segment). The thread block resolves its segment's two
// starts once; its threads then stride over the segment in `unit`-byte vectors with 32-bit
// offsets, kUnroll loads in flight each (the mapping is plan::task_of / for_each_unit,
// which the host tests run against the layout oracle).

#include <cstdint>

#include "kvlayout/transfer_plan.h"

namespace kvlayout::cuda {

struct DeviceJob {
  const plan::Segment* segments;     // device, the job's segment table
  std::uint32_t num_segments;        // at most 65535 (grid.y)
  std::uint32_t threads;             // per thread block (plan::threads_for)
  int depth;                         // plan::depth_for the segments
  const std::uint64_t* cache_ptrs;   // device, the job's pointer table
  std::uint32_t block_size;          // tokens per block
  std::int64_t row_bytes;            // the chunk's whole token row
};

struct DeviceBatch {
  const std::int64_t* block_ids;     // device
  std::uint32_t num_blocks;          // below 2^31
  const std::uint64_t* chunk_ptrs;   // device, one per chunk
  const std::int64_t* chunk_tokens;  // device
  std::uint32_t blocks_per_chunk;
  std::uint32_t skip_prefix_blocks;
};

// direction 0 = store (cache -> chunks), 1 = load. `unit` (1, 2, 4, 8 or 16 bytes) must
// divide every run, stride and offset of the segments and every pointer; the caller
// checks it. Returns the cudaError_t of the launch as an int (0 = success).
int launch_transfer(const DeviceJob& job, const DeviceBatch& batch, int direction, int unit, void* stream);

// Loads every transfer kernel into the current device's context now. CUDA loads a kernel
// at its first launch by default (lazy loading), and loading may wait for all the work
// already queued on the device, so a first copy queued behind other work would block the
// caller; a plan loads its kernels when it is prepared instead. Returns a cudaError_t.
int load_transfer_kernels();

// The number of CUDA devices (0 when there is no device or no driver).
int device_count();

// The message of a cudaError_t returned above.
const char* error_string(int error);

}  // namespace kvlayout::cuda
