#pragma once
// Whether a CPU copy prefetches ahead of itself, chosen by measuring the copies.
//
// The copies' cursors (stream_copy.h) prefetch the lines of a source that jumps and touch
// the pages either side will reach. Where one core's copy is bound by memory latency that
// hides each jump: on a quiet day of this project's machine (a flat streaming copy at
// 14-17 GB/s) they took scattered 32 KiB runs from 0.58-0.74x the flat copy to 0.81-0.96x.
// Where the memory system is busy and one core is bound by bandwidth, the same prefetches
// only add requests: on a busy day (the flat copy at 7.5-9 GB/s), measured in one process,
// the two ways taking turns, they took bench-maps' scattered 32 KiB runs from 0.87-0.95x
// to 0.66-0.80x and its 2 MiB runs from 0.97-1.05x to 0.86-0.92x, while 1 KiB runs still
// gained (0.43-0.51x to 0.50-0.60x; docs/block-maps.md has the rows). Which way is faster
// depends on the machine, its load and the kind of copy, and the load changes while a
// server runs; so each kind of copy keeps the time per byte of both ways and runs the
// faster, giving the other a call now and then so that a change is seen: every kExplore
// calls where the ways are close, further apart the slower the other way is, so that
// trying it costs about kExploreCost of the time (an HND store's nested walk, the way
// without prefetching, runs at 0.55x a flat copy against 0.87x in lanes: one call in 8
// cost 7 % of the mean). A prefetch is
// a hint: either way the copy moves the same bytes, so the choice never changes a
// result, and threads that race on the estimates only ever change a choice.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>

namespace kvlayout {

// What a caller asks of a copy: measure (kAuto), or a fixed way for tests and benchmarks.
enum class Prefetch : int { kAuto = -1, kOff = 0, kOn = 1 };

class PrefetchChoice {
 public:
  // Calls that move fewer bytes are neither timed nor counted: their time is mostly the
  // call's own, and the clock would cost them.
  static constexpr std::uint64_t kMinBytes = 1 << 20;
  // After both ways ran kWarm times, taking turns, the slower runs every period() calls:
  // kExplore to kExploreMax, as far apart as keeps its cost near kExploreCost of the time.
  static constexpr std::uint64_t kWarm = 2, kExplore = 8, kExploreMax = 64;
  static constexpr double kExploreCost = 0.02;
  // A way's estimate is the least of its first kWarm measurements (the first copies into
  // fresh memory pay its page faults), then each measurement moves it this far towards it,
  // times the kExplore periods since the way's last one (up to all the way): the slower
  // way, measured every period() calls, follows a change as fast per call as the faster.
  static constexpr double kWeight = 0.25;

  PrefetchChoice() = default;
  PrefetchChoice(const PrefetchChoice& o) { *this = o; }
  PrefetchChoice& operator=(const PrefetchChoice& o) {
    calls_.store(o.calls_.load(kRelaxed), kRelaxed);
    explored_.store(o.explored_.load(kRelaxed), kRelaxed);
    for (int way = 0; way < 2; ++way) {
      cost_[way].store(o.cost_[way].load(kRelaxed), kRelaxed);
      measured_[way].store(o.measured_[way].load(kRelaxed), kRelaxed);
      last_[way].store(o.last_[way].load(kRelaxed), kRelaxed);
    }
    return *this;
  }

  // Whether a call moving `bytes` prefetches: the cheaper way per byte, the other once
  // period() calls have passed since it last ran; both in turns until each has run kWarm
  // times. Threads that race here may both explore: a hint either way.
  bool pick(std::uint64_t bytes) {
    if (bytes < kMinBytes) return faster();
    const std::uint64_t call = calls_.fetch_add(1, kRelaxed);
    if (call < 2 * kWarm) return call % 2 == 1;
    if (call - std::min(call, explored_.load(kRelaxed)) < period()) return faster();
    explored_.store(call, kRelaxed);
    return !faster();
  }

  // Calls from one run of the slower way to the next: (slower / faster - 1) / kExploreCost,
  // within [kExplore, kExploreMax]. Read at every call, so where the faster way slows down
  // (its estimate moves at every call) the other is tried sooner; where the slower one
  // speeds up, it is seen within kExploreMax calls.
  std::uint64_t period() const {
    const double off = cost(false), on = cost(true);
    if (off <= 0 || on <= 0) return kExplore;
    const double calls = std::ceil((std::max(off, on) / std::min(off, on) - 1.0) / kExploreCost);
    if (!(calls < static_cast<double>(kExploreMax))) return kExploreMax;  // NaN included
    return std::max(kExplore, static_cast<std::uint64_t>(calls));
  }

  // A call of `bytes` took `ns` the way it was picked.
  void record(bool prefetch, std::uint64_t bytes, std::uint64_t ns) {
    if (bytes < kMinBytes) return;
    const double per_byte = static_cast<double>(ns) / static_cast<double>(bytes);
    const int way = prefetch ? 1 : 0;
    const std::uint64_t seen = measured_[way].fetch_add(1, kRelaxed);
    const std::uint64_t call = calls_.load(kRelaxed), last = last_[way].exchange(call, kRelaxed);
    const double periods = static_cast<double>(call - std::min(call, last)) / static_cast<double>(kExplore);
    const double old = cost_[way].load(kRelaxed);
    const double now = seen == 0       ? per_byte
                       : seen < kWarm  ? std::min(old, per_byte)
                                       : old + (per_byte - old) * std::min(1.0, kWeight * std::max(1.0, periods));
    cost_[way].store(now, kRelaxed);
  }

  // The estimates (ns per byte, 0 before a way ran), for tests and benchmarks.
  double cost(bool prefetch) const { return cost_[prefetch ? 1 : 0].load(kRelaxed); }
  std::uint64_t calls() const { return calls_.load(kRelaxed); }

  // Runs copy(prefetch) as `mode` says, timing it where the choice is measured.
  template <class Copy>
  auto run(Prefetch mode, std::uint64_t bytes, Copy copy) {
    if (mode != Prefetch::kAuto) return copy(mode == Prefetch::kOn);
    const bool prefetch = pick(bytes);
    if (bytes < kMinBytes) return copy(prefetch);
    const auto start = std::chrono::steady_clock::now();
    auto result = copy(prefetch);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
    record(prefetch, bytes, static_cast<std::uint64_t>(ns.count()));
    return result;
  }

 private:
  static constexpr auto kRelaxed = std::memory_order_relaxed;
  // Prefetching until the other way is measured cheaper (the way the cursors were tuned).
  bool faster() const {
    const double off = cost(false), on = cost(true);
    return off == 0 || on == 0 || on <= off;
  }

  std::atomic<std::uint64_t> calls_{0};
  std::atomic<std::uint64_t> explored_{0};  // the last call that ran the slower way
  std::atomic<double> cost_[2] = {0.0, 0.0};
  std::atomic<std::uint64_t> measured_[2] = {0, 0};  // measurements of each way
  std::atomic<std::uint64_t> last_[2] = {0, 0};      // calls_ at each way's last measurement
};

// The choices of the copies one owner makes (a pair of block-map sides; all the copies
// that have no owner), one per kind of copy: its mean run's bit width (on a busy machine
// the cursors gained on 1 KiB runs and lost on 32 KiB ones), on one thread or more.
class PrefetchChoices {
 public:
  PrefetchChoice& of(std::uint64_t bytes, std::uint64_t runs, int threads) {
    const std::uint64_t mean = bytes / std::max<std::uint64_t>(runs, 1);
    const int width = mean == 0 ? 0 : 64 - __builtin_clzll(mean);
    return choices_[width][threads > 1 ? 1 : 0];
  }

 private:
  PrefetchChoice choices_[65][2];
};

}  // namespace kvlayout
