// See transfer_kernels.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "transfer_kernels.h"

namespace kvlayout::cuda {
namespace {

template <int Bytes>
struct UnitOf;
template <>
struct UnitOf<1> { using type = std::uint8_t; };
template <>
struct UnitOf<2> { using type = std::uint16_t; };
template <>
struct UnitOf<4> { using type = std::uint32_t; };
template <>
struct UnitOf<8> { using type = uint2; };
template <>
struct UnitOf<16> { using type = uint4; };

// grid.x: block position (after the skipped prefix); grid.y: kv * num_layers + layer.
template <int Direction, int Bytes>
__global__ void transfer_kernel(DeviceJob job, DeviceBatch batch) {
  using Unit = typename UnitOf<Bytes>::type;
  const std::int64_t i = batch.skip_prefix_blocks + blockIdx.x;
  const std::int64_t kv = blockIdx.y / job.num_layers;
  const std::int64_t layer = blockIdx.y % job.num_layers;
  const std::int64_t chunk = i / batch.blocks_per_chunk;
  const std::int64_t tokens = batch.chunk_tokens[chunk];
  const std::int64_t first_token = (i - chunk * batch.blocks_per_chunk) * job.block_size;
  const std::int64_t block = batch.block_ids[i];
  const std::int64_t elems_per_unit = Bytes / job.element_size;  // >= 1: unit is a multiple of the element
  const std::int64_t units_per_row = job.num_heads * job.head_size / elems_per_unit;
  const std::int64_t units = job.block_size * units_per_row;
  char* chunk_base = reinterpret_cast<char*>(batch.chunk_ptrs[chunk]) +
                     ((kv * job.num_layers + layer) * tokens + first_token) * job.row_bytes + job.row_offset;
  for (std::int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    const std::int64_t token = u / units_per_row;
    const std::int64_t r = (u % units_per_row) * elems_per_unit;
    const Location at = locate(job.format, job.sizes, job.block_stride,
                               Coord{layer, kv, block, token, r / job.head_size, r % job.head_size});
    Unit* cache = reinterpret_cast<Unit*>(reinterpret_cast<char*>(job.cache_ptrs[at.pointer]) + at.offset * job.element_size);
    Unit* row = reinterpret_cast<Unit*>(chunk_base + token * job.row_bytes + r * job.element_size);
    if constexpr (Direction == 0) {
      *row = *cache;
    } else {
      *cache = *row;
    }
  }
}

template <int Direction>
cudaError_t launch(const DeviceJob& job, const DeviceBatch& batch, int unit, cudaStream_t stream) {
  const std::int64_t blocks = batch.num_blocks - batch.skip_prefix_blocks;
  if (blocks <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(job.kv_size * job.num_layers));
  const dim3 threads(256);
  switch (unit) {
    case 16: transfer_kernel<Direction, 16><<<grid, threads, 0, stream>>>(job, batch); break;
    case 8: transfer_kernel<Direction, 8><<<grid, threads, 0, stream>>>(job, batch); break;
    case 4: transfer_kernel<Direction, 4><<<grid, threads, 0, stream>>>(job, batch); break;
    case 2: transfer_kernel<Direction, 2><<<grid, threads, 0, stream>>>(job, batch); break;
    case 1: transfer_kernel<Direction, 1><<<grid, threads, 0, stream>>>(job, batch); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

int launch_transfer(const DeviceJob& job, const DeviceBatch& batch, int direction, int unit, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = direction == 0 ? launch<0>(job, batch, unit, s) : launch<1>(job, batch, unit, s);
  return static_cast<int>(err);
}

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

const char* error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace kvlayout::cuda
