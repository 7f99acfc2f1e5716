// See transfer_kernels.h.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// Calls f(std::integral_constant<int, U>{}) with the compiled unit U equal to `unit`
// (1, 2, 4, 8 or 16 bytes); false for any other.
template <class F>
bool with_unit(int unit, F&& f) {
  switch (unit) {
    case 16: f(std::integral_constant<int, 16>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 1: f(std::integral_constant<int, 1>{}); return true;
    default: return false;
  }
}

// The kernel a launch of `unit` and `depth` runs, as f(kernel) (the compiled instances:
// with_unit's units by plan::with_depth's depths).
template <int Direction, class F>
bool with_kernel(int unit, int depth, F&& f) {
  return with_unit(unit, [&](auto bytes) {
    plan::with_depth(depth, [&](auto d) { f(transfer_kernel<Direction, decltype(bytes)::value, decltype(d)::value>); });
  });
}

template <int Direction>
cudaError_t launch(const DeviceJob& job, const DeviceBatch& batch, int unit, cudaStream_t stream) {
  if (batch.num_blocks <= batch.skip_prefix_blocks || job.num_segments == 0) return cudaSuccess;
  if (job.depth < 0 || job.depth > plan::kMaxLoops) return cudaErrorInvalidValue;
  const dim3 grid(batch.num_blocks - batch.skip_prefix_blocks, job.num_segments);
  const bool known = with_kernel<Direction>(unit, job.depth, [&](auto kernel) {
    kernel<<<grid, dim3(job.threads), 0, stream>>>(job, batch);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

// Looks up every kernel of one direction (each unit, each depth), which loads it.
template <int Direction>
cudaError_t load_direction() {
  cudaError_t err = cudaSuccess;
  for (int unit = 1; unit <= 16; unit *= 2) {
    for (int depth = 0; depth <= plan::kMaxLoops; ++depth) {
      with_kernel<Direction>(unit, depth, [&](auto kernel) {
        cudaFuncAttributes attributes;
        if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, kernel);
      });
    }
  }
  return err;
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
