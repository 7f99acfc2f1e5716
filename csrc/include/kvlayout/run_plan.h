#pragma once
// The CUDA executor of byte runs (a block map's runs: source, destination, length), split
// into thread-block work items on the host and walked by one kernel
// (csrc/cuda/run_kernels.cu). The mapping from (item, thread) to the units a thread
// copies is compiled for the host too, so tests enumerate every unit a grid would copy.
//
// A work item is either a slice of one run, up to kSliceBytes, that all the block's
// threads stride over, or a pack of short runs (at most kShortBytes each), a group of
// lanes per run: as few lanes as move the pack's longest run in one pass (kUnroll units
// each), so a pack of 256-byte runs moves 64 of them at once, not one per warp. Inside a
// slice or run, where source and destination agree modulo 16 the body moves in 16-byte
// units (8-byte where they agree modulo 8) from the first aligned source byte, and the
// head and tail before and after it move in bytes.
// Slices after a run's first start on the source's 16-byte grid, so only a run's first
// slice has a head.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvlayout/host_device.h"

namespace kvlayout::runs {

struct Run {
  std::uint64_t src;
  std::uint64_t dst;
  std::uint64_t len;
};

struct Item {
  std::uint64_t offset;  // a slice's first byte in its run; a pack's lanes per run
  std::uint64_t bytes;   // a slice's bytes (a pack: its runs' bytes, for the record)
  std::uint32_t run;     // the slice's run, or the pack's first run
  std::uint32_t count;   // 0: a slice; else the pack's runs [run, run + count)
};

static_assert(sizeof(Run) == 24 && sizeof(Item) == 24, "tables cross to the device as bytes");

inline constexpr std::uint32_t kThreads = 256;  // per thread block
inline constexpr std::uint32_t kWarp = 32;
inline constexpr int kUnroll = 4;  // body units in flight per thread
// A slice is a few passes of the whole block (kThreads * 16 bytes * kUnroll = 16 KiB).
inline constexpr std::uint64_t kSliceBytes = std::uint64_t{64} << 10;
// A run a warp moves in one pass (32 lanes * 16 bytes * kUnroll) goes in a pack.
inline constexpr std::uint64_t kShortBytes = std::uint64_t{kWarp} * 16 * kUnroll;

// The unit width of a range from src to dst: the widest of 16, 8, 4, 2 and 1 bytes modulo
// which both agree (a 132-byte indexer row or a 4-byte head slice still moves in words).
KVLAYOUT_HOST_DEVICE inline std::uint32_t unit_of(std::uint64_t src, std::uint64_t dst) {
  const std::uint64_t d = (src ^ dst) | 16;
  return static_cast<std::uint32_t>(d & (~d + 1));  // the lowest set bit, at most 16
}

// The units thread `t` of `threads` moves of the range [src, src + n) -> [dst, dst + n):
// copy_byte(s, d) for each byte of the head (up to src's first `unit`-aligned byte) and of
// the tail, and copy_body(unit, s, d, step, count) for `count` (at most kUnroll) units at
// s + k * step -> d + k * step of the body.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Bytes, class Body>
KVLAYOUT_HOST_DEVICE inline void for_each_unit(std::uint64_t src, std::uint64_t dst, std::uint64_t n,
                                               std::uint32_t t, std::uint32_t threads, Bytes&& copy_byte,
                                               Body&& copy_body) {
  const std::uint32_t unit = unit_of(src, dst);
  std::uint64_t head = (unit - src % unit) % unit;
  head = head < n ? head : n;
  const std::uint64_t units = (n - head) / unit;
  const std::uint64_t body_end = head + units * unit;
  for (std::uint64_t i = t; i < head; i += threads) copy_byte(src + i, dst + i);
  for (std::uint64_t i = body_end + t; i < n; i += threads) copy_byte(src + i, dst + i);
  const std::uint64_t step = std::uint64_t{threads} * unit;
  for (std::uint64_t u = t; u < units; u += std::uint64_t{threads} * kUnroll) {
    const std::uint64_t left = (units - u + threads - 1) / threads;  // this thread's units from u on
    const std::uint32_t count = left < kUnroll ? static_cast<std::uint32_t>(left) : kUnroll;
    copy_body(unit, src + head + u * unit, dst + head + u * unit, step, count);
  }
}

// The lanes a packed run of `len` bytes gets: enough for its 16-byte units at kUnroll
// each (a power of two, at most a warp; runs with no common 16-byte alignment move in
// smaller units, in more passes).
KVLAYOUT_HOST_DEVICE inline std::uint32_t lanes_for(std::uint64_t len) {
  const std::uint64_t wanted = (len + 16 * kUnroll - 1) / (16 * kUnroll);
  std::uint32_t lanes = 1;
  while (lanes < kWarp && lanes < wanted) lanes *= 2;
  return lanes;
}

// The run thread `t` of a block works on in `item`, or -1 in a pack past its runs.
KVLAYOUT_HOST_DEVICE inline std::int64_t run_of(const Item& item, std::uint32_t t) {
  if (item.count == 0) return item.run;
  const std::uint32_t group = t / static_cast<std::uint32_t>(item.offset);
  return group < item.count ? std::int64_t{item.run} + group : -1;
}

// What thread `t` of a block copies of `item`: the slice with all threads, or in a pack
// its group's run.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Bytes, class Body>
KVLAYOUT_HOST_DEVICE inline void for_each_unit_of(const Item& item, const Run* runs, std::uint32_t t,
                                                  Bytes&& copy_byte, Body&& copy_body) {
  if (item.count == 0) {
    const Run r = runs[item.run];
    for_each_unit(r.src + item.offset, r.dst + item.offset, item.bytes, t, kThreads, copy_byte, copy_body);
    return;
  }
  const std::int64_t run = run_of(item, t);
  if (run < 0) return;
  const Run r = runs[run];
  const auto lanes = static_cast<std::uint32_t>(item.offset);
  for_each_unit(r.src, r.dst, r.len, t % lanes, lanes, copy_byte, copy_body);
}

// The work items of runs[0..n), in run order. Refuses a run that wraps around the
// address space, and more runs than an item can index.
inline std::vector<Item> plan_items(const Run* runs, std::size_t n) {
  if (n >= (std::uint64_t{1} << 32)) throw std::invalid_argument("copy_runs: at most 2^32 - 1 runs");
  std::vector<Item> items;
  Item pack{0, 0, 0, 0};
  const auto close_pack = [&] {
    if (pack.count != 0) items.push_back(pack);
    pack = Item{0, 0, 0, 0};
  };
  for (std::size_t i = 0; i < n; ++i) {
    const Run& r = runs[i];
    if (r.src + r.len < r.src || r.dst + r.len < r.dst)
      throw std::invalid_argument("copy_runs: run " + std::to_string(i) + " wraps around the address space");
    if (r.len == 0) {
      if (pack.count != 0) ++pack.count;  // an empty run in a pack is a group with nothing to do
      if (pack.count != 0 && pack.count * pack.offset == kThreads) close_pack();
      continue;
    }
    if (r.len <= kShortBytes) {
      const std::uint64_t lanes = lanes_for(r.len);
      const std::uint64_t wider = pack.offset > lanes ? pack.offset : lanes;
      if (pack.count != 0 && (pack.count + 1) * wider > kThreads) close_pack();  // it does not fit
      if (pack.count == 0) pack = Item{lanes, 0, static_cast<std::uint32_t>(i), 0};
      pack.offset = pack.offset > lanes ? pack.offset : lanes;
      ++pack.count;
      pack.bytes += r.len;
      if (pack.count * pack.offset == kThreads) close_pack();
      continue;
    }
    close_pack();
    // Cuts where src is 16-byte aligned, kSliceBytes apart.
    const std::uint64_t first = kSliceBytes - r.src % 16;
    for (std::uint64_t at = 0; at < r.len;) {
      const std::uint64_t end = at == 0 ? first : at + kSliceBytes;
      const std::uint64_t stop = end < r.len ? end : r.len;
      items.push_back(Item{at, stop - at, static_cast<std::uint32_t>(i), 0});
      at = stop;
    }
  }
  close_pack();
  return items;
}

}  // namespace kvlayout::runs
