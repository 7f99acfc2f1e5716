// See transfer_kernels.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "transfer_kernels.h"

namespace kvlayout::cuda {
namespace {

template <int Bytes>
struct UnitOf;
template <>
struct UnitOf<1> { using type = unsigned char; };
template <>
struct UnitOf<2> { using type = unsigned short; };
template <>
struct UnitOf<4> { using type = unsigned int; };
template <>
struct UnitOf<8> { using type = uint2; };
template <>
struct UnitOf<16> { using type = uint4; };

// 4 resident thread blocks of kMaxThreads caps a thread at 64 registers (of 64K per SM):
// half the SM's threads, each with kUnroll 16-byte loads in flight, covers the latency.
constexpr int kMinBlocks = 4;

// grid.x: the moved block (after the skipped prefix); grid.y: the segment.
template <int Direction, int Bytes, int Depth>
__global__ void __launch_bounds__(plan::kMaxThreads, kMinBlocks) transfer_kernel(DeviceJob job, DeviceBatch batch) {
  using Unit = typename UnitOf<Bytes>::type;
  const plan::Segment s = job.segments[blockIdx.y];  // a copy: the stores below cannot alias it
  const plan::Task t =
      plan::task_of(batch.block_ids, batch.skip_prefix_blocks, blockIdx.x, batch.blocks_per_chunk, job.block_size);
  char* const cache = reinterpret_cast<char*>(plan::cache_start(s, job.cache_ptrs[s.pointer], t.block));
  char* const chunk = reinterpret_cast<char*>(
      plan::chunk_start(s, batch.chunk_ptrs[t.chunk], batch.chunk_tokens[t.chunk], t.first_token, job.row_bytes));
  const char* __restrict__ const src = Direction == 0 ? cache : chunk;
  char* __restrict__ const dst = Direction == 0 ? chunk : cache;
  plan::for_each_unit<Depth>(s, Bytes, threadIdx.x, blockDim.x, [&](const plan::Offsets* o, const bool* live) {
    Unit v[plan::kUnroll];
#pragma unroll
    for (int k = 0; k < plan::kUnroll; ++k) {
      if (live[k]) v[k] = __ldg(reinterpret_cast<const Unit*>(src + (Direction == 0 ? o[k].cache : o[k].chunk)));
    }
#pragma unroll
    for (int k = 0; k < plan::kUnroll; ++k) {
      if (live[k]) *reinterpret_cast<Unit*>(dst + (Direction == 0 ? o[k].chunk : o[k].cache)) = v[k];
    }
  });
}

template <int Direction, int Bytes>
void launch_unit(const DeviceJob& job, const DeviceBatch& batch, dim3 grid, cudaStream_t stream) {
  plan::with_depth(job.depth, [&](auto depth) {
    transfer_kernel<Direction, Bytes, decltype(depth)::value><<<grid, dim3(job.threads), 0, stream>>>(job, batch);
  });
}

template <int Direction>
cudaError_t launch(const DeviceJob& job, const DeviceBatch& batch, int unit, cudaStream_t stream) {
  if (batch.num_blocks <= batch.skip_prefix_blocks || job.num_segments == 0) return cudaSuccess;
  if (job.depth < 0 || job.depth > plan::kMaxLoops) return cudaErrorInvalidValue;
  const dim3 grid(batch.num_blocks - batch.skip_prefix_blocks, job.num_segments);
  switch (unit) {
    case 16: launch_unit<Direction, 16>(job, batch, grid, stream); break;
    case 8: launch_unit<Direction, 8>(job, batch, grid, stream); break;
    case 4: launch_unit<Direction, 4>(job, batch, grid, stream); break;
    case 2: launch_unit<Direction, 2>(job, batch, grid, stream); break;
    case 1: launch_unit<Direction, 1>(job, batch, grid, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Looks up each depth's kernel of one direction and unit, which loads it (lazy loading).
template <int Direction, int Bytes>
cudaError_t load_unit() {
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, transfer_kernel<Direction, Bytes, 0>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, transfer_kernel<Direction, Bytes, 2>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, transfer_kernel<Direction, Bytes, plan::kMaxLoops>);
  return err;
}

template <int Direction>
cudaError_t load_direction() {
  for (const cudaError_t err : {load_unit<Direction, 1>(), load_unit<Direction, 2>(), load_unit<Direction, 4>(),
                                load_unit<Direction, 8>(), load_unit<Direction, 16>()}) {
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

int load_transfer_kernels() {
  cudaError_t err = load_direction<0>();
  if (err == cudaSuccess) err = load_direction<1>();
  return static_cast<int>(err);
}

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
