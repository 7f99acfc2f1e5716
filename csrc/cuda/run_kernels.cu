// See run_kernels.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "run_kernels.h"

namespace kvlayout::cuda {
namespace {

// 4 resident thread blocks of 256 threads cap a thread at 64 registers.
constexpr int kMinBlocks = 4;

// `count` units at s + k * step -> d + k * step, all loads in flight before the stores.
template <class Unit>
__device__ inline void copy_units(std::uint64_t s, std::uint64_t d, std::uint64_t step, std::uint32_t count) {
  Unit v[runs::kUnroll];
#pragma unroll
  for (int k = 0; k < runs::kUnroll; ++k) {
    if (k < count) v[k] = __ldg(reinterpret_cast<const Unit*>(s + k * step));
  }
#pragma unroll
  for (int k = 0; k < runs::kUnroll; ++k) {
    if (k < count) *reinterpret_cast<Unit*>(d + k * step) = v[k];
  }
}

// The same for units of 4, 2 or 1 bytes, one at a time: wider paths in flight would cost
// the kernel registers it does not have (64: see kMinBlocks), and such runs are rare.
__device__ inline void copy_narrow(std::uint32_t unit, std::uint64_t s, std::uint64_t d, std::uint64_t step,
                                   std::uint32_t count) {
  for (std::uint32_t k = 0; k < count; ++k, s += step, d += step) {
    if (unit == 4) {
      *reinterpret_cast<unsigned int*>(d) = __ldg(reinterpret_cast<const unsigned int*>(s));
    } else if (unit == 2) {
      *reinterpret_cast<unsigned short*>(d) = __ldg(reinterpret_cast<const unsigned short*>(s));
    } else {
      *reinterpret_cast<unsigned char*>(d) = __ldg(reinterpret_cast<const unsigned char*>(s));
    }
  }
}

// Thread block x takes items x, x + gridDim.x, ...; its threads (or, in a pack, its
// warps) stride over the units plan_items and for_each_unit_of give them.
__global__ void __launch_bounds__(runs::kThreads, kMinBlocks)
    copy_runs_kernel(const runs::Run* __restrict__ table, const runs::Item* __restrict__ items,
                     std::uint32_t num_items) {
  // 64-bit: a 32-bit index stepping past the last item could wrap below num_items.
  for (std::uint64_t i = blockIdx.x; i < num_items; i += gridDim.x) {
    const runs::Item item = items[i];
    runs::for_each_unit_of(
        item, table, threadIdx.x,
        [](std::uint64_t s, std::uint64_t d) {
          *reinterpret_cast<unsigned char*>(d) = __ldg(reinterpret_cast<const unsigned char*>(s));
        },
        [](std::uint32_t unit, std::uint64_t s, std::uint64_t d, std::uint64_t step, std::uint32_t count) {
          if (unit == 16) {
            copy_units<uint4>(s, d, step, count);
          } else if (unit == 8) {
            copy_units<uint2>(s, d, step, count);
          } else {
            copy_narrow(unit, s, d, step, count);
          }
        });
  }
}

}  // namespace

int launch_copy_runs(const runs::Run* runs, const runs::Item* items, std::uint32_t num_items, void* stream) {
  if (num_items == 0) return 0;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return static_cast<int>(err);
  // Enough thread blocks to fill every SM twice over; the rest of the items are strided.
  const std::uint32_t most = static_cast<std::uint32_t>(sms > 0 ? sms : 1) * kMinBlocks * 2;
  const dim3 grid(num_items < most ? num_items : most);
  copy_runs_kernel<<<grid, dim3(runs::kThreads), 0, static_cast<cudaStream_t>(stream)>>>(runs, items, num_items);
  return static_cast<int>(cudaGetLastError());
}

int load_run_kernel() {
  cudaFuncAttributes attributes;
  return static_cast<int>(cudaFuncGetAttributes(&attributes, copy_runs_kernel));
}

}  // namespace kvlayout::cuda
