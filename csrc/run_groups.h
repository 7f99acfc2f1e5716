#pragma once
// Run groups: a block map's runs, held compactly.
//
// A permuted or re-sharded map has hundreds of thousands of runs that repeat one shape:
// a row of runs of one length at one step on each side (a head's slots, a token's heads),
// rows at one step (a block's heads). A RunGroup is such a block of rows; the map keeps
// its groups, not its runs, so building it writes a tenth or less of what the runs take
// (NHD -> HND: 0.3-1.2 MB of groups for 12.5 MB of runs), and the runs are read back
// (expanded) in order wherever a consumer needs them: a chunk at a time by the copy,
// whole for Python's `runs`.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>

#include "stream_copy.h"

namespace kvlayout::block_map {

// `rows` rows of `count` runs of `len` bytes: run (r, i) reads `len` bytes at
// src + r * src_row + i * src_step and writes them at dst + r * dst_row + i * dst_step
// (unsigned arithmetic, so a step may be negative). A single row's row steps are 0, a
// single run's steps are 0: two groups of one shape compare equal field by field.
struct RunGroup {
  std::uint64_t src, dst, len;
  std::uint64_t count, src_step, dst_step;
  std::uint64_t rows, src_row, dst_row;

  std::uint64_t runs() const { return rows * count; }
  std::uint64_t bytes() const { return rows * count * len; }
  ByteRun run(std::uint64_t r, std::uint64_t i) const {
    return ByteRun{src + r * src_row + i * src_step, dst + r * dst_row + i * dst_step, len};
  }
};
static_assert(sizeof(RunGroup) == 9 * sizeof(std::uint64_t), "RunGroup is the (G, 9) uint64 array's row");

namespace detail {

// A malloc'd table of rows of T, uninitialised (every row is written before it is read;
// zeroing them would double the walk's memory traffic); grows and shrinks in place where
// it can.
template <class T>
struct Table {
  T* rows = nullptr;
  std::size_t size = 0;  // rows allocated

  Table() = default;
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;
  Table(Table&& o) noexcept : rows(std::exchange(o.rows, nullptr)), size(std::exchange(o.size, 0)) {}
  Table& operator=(Table&& o) noexcept {
    std::swap(rows, o.rows);
    std::swap(size, o.size);
    return *this;
  }
  ~Table() { std::free(rows); }
  void resize(std::size_t n) {
    void* p = std::realloc(rows, std::max<std::size_t>(n, 1) * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    rows = static_cast<T*>(p), size = n;
  }
};

// Tables of groups that maps have let go of, kept for the next builds: a fresh table is a
// fresh mapping whose page faults cost more than the walk that fills it (about 2 us a
// page on a VM), and a server builds and drops maps of like sizes request after request.
class TablePool {
 public:
  static TablePool& instance() {
    static TablePool* pool = new TablePool();  // never destroyed: maps freed at exit still put back
    return *pool;
  }
  // The table put back last, or an empty one.
  Table<RunGroup> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (count_ == 0) return {};
    Table<RunGroup> t = std::move(free_[--count_]);
    bytes_ -= t.size * sizeof(RunGroup);
    return t;
  }
  // Keeps `t` if the pool has room (kTables tables, kBytes in all), else frees it.
  void put(Table<RunGroup>&& t) {
    const std::size_t bytes = t.size * sizeof(RunGroup);
    if (t.rows == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (count_ == kTables || bytes_ + bytes > kBytes) return;  // t frees itself
    free_[count_++] = std::move(t);
    bytes_ += bytes;
  }

 private:
  static constexpr std::size_t kTables = 8, kBytes = std::size_t{64} << 20;
  std::mutex mutex_;
  Table<RunGroup> free_[kTables];
  std::size_t count_ = 0, bytes_ = 0;
};

}  // namespace detail

// Takes finished runs in order, as single runs, rows or whole groups, and keeps them as
// groups: a piece continues the current row where it has the row's length and steps and
// starts where the row's next run would; a finished row continues the current group where
// it has the group's row shape and starts where its next row would. The expansion of the
// groups is the sequence of runs given, always; how compact it is depends on the pieces.
class Grouper {
 public:
  explicit Grouper(detail::Table<RunGroup>* table) : table_(table) {}

  std::size_t used() const { return used_; }

  // `count` runs (src + i * src_step, dst + i * dst_step, len).
  void add(std::uint64_t src, std::uint64_t dst, std::uint64_t len, std::uint64_t count, std::uint64_t src_step,
           std::uint64_t dst_step) {
    if (count == 1) src_step = dst_step = 0;
    if (row_.count != 0 && len == row_.len) {
      const bool stepped = row_.count >= 2;
      const std::uint64_t ss = stepped ? row_.src_step : count >= 2 ? src_step : src - row_.src;
      const std::uint64_t ds = stepped ? row_.dst_step : count >= 2 ? dst_step : dst - row_.dst;
      if ((count == 1 || (src_step == ss && dst_step == ds)) && src == row_.src + row_.count * ss &&
          dst == row_.dst + row_.count * ds) {
        row_.count += count, row_.src_step = ss, row_.dst_step = ds;
        return;
      }
    }
    end_row();
    row_ = RunGroup{src, dst, len, count, src_step, dst_step, 1, 0, 0};
  }

  // A whole group (its rows complete).
  void add_group(const RunGroup& g) {
    end_row();
    if (!append_rows(g)) {
      end_group();
      group_ = g;
      if (group_.rows == 1) group_.src_row = group_.dst_row = 0;
    }
  }

  void finish() {
    end_row();
    end_group();
  }

 private:
  // The current row joins the group, or starts the next one.
  void end_row() {
    if (row_.count == 0) return;
    if (!append_rows(row_)) {
      end_group();
      group_ = row_;
    }
    row_.count = 0;
  }

  // Appends g's rows to the group if they continue it.
  bool append_rows(const RunGroup& g) {
    if (group_.rows == 0 || g.len != group_.len || g.count != group_.count || g.src_step != group_.src_step ||
        g.dst_step != group_.dst_step)
      return false;
    const bool stepped = group_.rows >= 2;
    const std::uint64_t sr = stepped ? group_.src_row : g.rows >= 2 ? g.src_row : g.src - group_.src;
    const std::uint64_t dr = stepped ? group_.dst_row : g.rows >= 2 ? g.dst_row : g.dst - group_.dst;
    if (g.rows >= 2 && (g.src_row != sr || g.dst_row != dr)) return false;
    if (g.src != group_.src + group_.rows * sr || g.dst != group_.dst + group_.rows * dr) return false;
    group_.rows += g.rows, group_.src_row = sr, group_.dst_row = dr;
    return true;
  }

  void end_group() {
    if (group_.rows == 0) return;
    if (used_ == table_->size) table_->resize(2 * table_->size + 256);
    table_->rows[used_++] = group_;
    group_.rows = 0;
  }

  detail::Table<RunGroup>* table_;
  std::size_t used_ = 0;
  RunGroup row_{0, 0, 0, 0, 0, 0, 1, 0, 0};    // count 0: no row
  RunGroup group_{0, 0, 0, 0, 0, 0, 0, 0, 0};  // rows 0: no group
};

// Reads the runs of a table of groups back in order, a buffer at a time, from any run.
class GroupReader {
 public:
  GroupReader(const RunGroup* groups, std::size_t n) : g_(groups), n_(n) {}

  // Positions the reader at run `k` of group `group`.
  void seek(std::size_t group, std::uint64_t k) {
    group_ = group;
    if (group_ < n_) row_ = k / g_[group_].count, i_ = k % g_[group_].count;
  }

  // Up to `cap` next runs into `out`; 0 at the end.
  std::size_t read(ByteRun* out, std::size_t cap) {
    std::size_t k = 0;
    while (k < cap && group_ < n_) {
      const RunGroup& g = g_[group_];
      while (k < cap && row_ < g.rows) {
        const std::uint64_t take = std::min<std::uint64_t>(g.count - i_, cap - k);
        ByteRun r = g.run(row_, i_);
        for (std::uint64_t j = 0; j < take; ++j, r.src += g.src_step, r.dst += g.dst_step) out[k++] = r;
        i_ += take;
        if (i_ == g.count) i_ = 0, ++row_;
      }
      if (row_ == g.rows) ++group_, row_ = 0, i_ = 0;
    }
    return k;
  }

 private:
  const RunGroup* g_;
  std::size_t n_;
  std::size_t group_ = 0;
  std::uint64_t row_ = 0, i_ = 0;
};

}  // namespace kvlayout::block_map
