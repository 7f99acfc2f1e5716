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
#include <pthread.h>
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
    static TablePool* pool = [] {  // never destroyed: maps freed at exit still put back
      auto* p = new TablePool();
      pthread_atfork(nullptr, nullptr, [] { TablePool::instance().reset_after_fork(); });
      return p;
    }();
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

  // In a forked child only the forking thread exists: another may have held the lock, or
  // been moving a table, at the fork. A new lock and an empty pool (the parent's tables
  // are left where they are: a few pages the child shares with it until written).
  void reset_after_fork() {
    new (&mutex_) std::mutex();
    for (auto& t : free_) t.rows = nullptr, t.size = 0;
    count_ = 0, bytes_ = 0;
  }
};

}  // namespace detail

// Takes finished runs in order, as single runs, rows or whole groups, and keeps them as
// groups: a piece continues the current row where it has the row's length and steps and
// starts where the row's next run would; a finished row continues the current group where
// it has the group's row shape and starts where its next row would. The expansion of the
// groups is the sequence of runs given, always; how compact it is depends on the pieces.
//
// The open group and the open row are built in place, in the table's next two rows (the
// row in the one after the group): a row that starts a group becomes it where it lies, and
// a group is finished by counting it. Kept apart and copied in, each copy read a group
// back in 16-byte loads from the 8-byte stores just made, which the CPU cannot forward:
// building in place took bench-maps' NHD -> HND with consecutive blocks (16,192 groups)
// from 264-284 us to 177-243 us of native build (the two builds taking turns).
class Grouper {
 public:
  explicit Grouper(detail::Table<RunGroup>* table) : table_(table) { reserve(); }

  // The groups finished (all of them, after finish()).
  std::size_t used() const { return used_; }
  // The runs given so far (counted as they come: a pass over the groups after the build
  // read back a table that may be a megabyte).
  std::uint64_t runs() const { return runs_; }

  // `count` runs (src + i * src_step, dst + i * dst_step, len).
  void add(std::uint64_t src, std::uint64_t dst, std::uint64_t len, std::uint64_t count, std::uint64_t src_step,
           std::uint64_t dst_step) {
    runs_ += count;
    if (count == 1) src_step = dst_step = 0;
    if (has_row_) {
      RunGroup& row = table_->rows[used_ + has_group_];
      if (len == row.len) {
        const bool stepped = row.count >= 2;
        const std::uint64_t ss = stepped ? row.src_step : count >= 2 ? src_step : src - row.src;
        const std::uint64_t ds = stepped ? row.dst_step : count >= 2 ? dst_step : dst - row.dst;
        if ((count == 1 || (src_step == ss && dst_step == ds)) && src == row.src + row.count * ss &&
            dst == row.dst + row.count * ds) {
          row.count += count, row.src_step = ss, row.dst_step = ds;
          return;
        }
      }
      end_row();
    }
    table_->rows[used_ + has_group_] = RunGroup{src, dst, len, count, src_step, dst_step, 1, 0, 0};
    has_row_ = true;
  }

  // A whole group (its rows complete).
  void add_group(const RunGroup& g) {
    runs_ += g.runs();
    end_row();
    if (has_group_ && append_rows(table_->rows[used_], g)) return;
    if (has_group_) next_group();
    RunGroup& open = table_->rows[used_];
    open = g;
    if (g.rows == 1) open.src_row = open.dst_row = 0;
    has_group_ = true;
  }

  void finish() {
    end_row();
    if (has_group_) ++used_, has_group_ = false;
  }

  // The runs of groups p[0, n), moved by (ds, dd), all but the very first and the very
  // last run (which the caller's cursor takes, so that they merge with what comes before
  // and after): a slab's pattern pasted at another slab (Walker::replay()). Only the
  // first and the last group's pieces may join their neighbours; the groups between are
  // written as the pattern has them (one loop of stores, no checks).
  void paste_inner(const RunGroup* p, std::size_t n, std::uint64_t ds, std::uint64_t dd) {
    if (n == 0) return;
    piece(p[0], ds, dd, true, n == 1);
    if (n == 1) return;
    if (n > 2) {
      end_row();
      if (has_group_) next_group();
      if (used_ + n + 2 > table_->size) table_->resize(used_ + n + table_->size + 256);
      RunGroup* out = table_->rows + used_;
      for (std::size_t k = 1; k + 1 < n; ++k, ++out) {
        *out = p[k];
        out->src += ds, out->dst += dd;
        runs_ += p[k].runs();
      }
      used_ += n - 3, has_group_ = true;  // the last written is the open group
    }
    piece(p[n - 1], ds, dd, false, true);
  }

  // Whether a group is open and no row: then open() is the group the next rows would
  // join, and push() closes it.
  bool settled() const { return has_group_ && !has_row_; }
  // The open group (settled() only).
  const RunGroup& open() const { return table_->rows[used_]; }
  // The open group, `rows` more rows of it given (settled() only).
  RunGroup& grow_open(std::uint64_t rows) {
    RunGroup& g = table_->rows[used_];
    g.rows += rows;
    runs_ += rows * g.count;
    return g;
  }
  // Closes the open group; `g` (its rows complete, as add_group() would keep it) is the
  // open group now (settled() only).
  void push(const RunGroup& g) {
    runs_ += g.runs();
    next_group();
    table_->rows[used_] = g;
  }

 private:
  // Group g moved by (ds, dd), less its first run (`first`) and its last (`last`).
  void piece(const RunGroup& g, std::uint64_t ds, std::uint64_t dd, bool first, bool last) {
    const std::uint64_t src = g.src + ds, dst = g.dst + dd, rows = g.rows, count = g.count;
    std::uint64_t lo = 0, hi = rows;  // the rows added whole
    if (first) {  // row 0 from its second run (to its last but one if it is the last row too)
      const std::uint64_t end = rows == 1 && last ? count - 1 : count;
      if (end > 1) add(src + g.src_step, dst + g.dst_step, g.len, end - 1, g.src_step, g.dst_step);
      lo = 1;
    }
    if (last && hi > lo) --hi;
    if (hi > lo)
      add_group(RunGroup{src + lo * g.src_row, dst + lo * g.dst_row, g.len, count, g.src_step, g.dst_step, hi - lo,
                         hi - lo > 1 ? g.src_row : 0, hi - lo > 1 ? g.dst_row : 0});
    if (last && rows - 1 >= lo && count > 1)  // the last row but its last run
      add(src + (rows - 1) * g.src_row, dst + (rows - 1) * g.dst_row, g.len, count - 1, g.src_step, g.dst_step);
  }

  // The open row joins the open group, or becomes the next one where it lies.
  void end_row() {
    if (!has_row_) return;
    has_row_ = false;
    if (!has_group_) {
      has_group_ = true;
      return;
    }
    if (!append_rows(table_->rows[used_], table_->rows[used_ + 1])) next_group();
  }

  // Appends g's rows to `group` if they continue it.
  static bool append_rows(RunGroup& group, const RunGroup& g) {
    if (g.len != group.len || g.count != group.count || g.src_step != group.src_step || g.dst_step != group.dst_step)
      return false;
    const bool stepped = group.rows >= 2;
    const std::uint64_t sr = stepped ? group.src_row : g.rows >= 2 ? g.src_row : g.src - group.src;
    const std::uint64_t dr = stepped ? group.dst_row : g.rows >= 2 ? g.dst_row : g.dst - group.dst;
    if (g.rows >= 2 && (g.src_row != sr || g.dst_row != dr)) return false;
    if (g.src != group.src + group.rows * sr || g.dst != group.dst + group.rows * dr) return false;
    group.rows += g.rows, group.src_row = sr, group.dst_row = dr;
    return true;
  }

  // Finishes the open group: the row after it (if any) is the open group now.
  void next_group() {
    ++used_;
    reserve();
  }

  // Room for the open group and the open row.
  void reserve() {
    if (used_ + 2 > table_->size) table_->resize(2 * table_->size + 256);
  }

  detail::Table<RunGroup>* table_;
  std::size_t used_ = 0;     // groups finished: rows [0, used_) of the table
  std::uint64_t runs_ = 0;   // the runs given
  bool has_group_ = false;   // row used_ is the open group
  bool has_row_ = false;     // row used_ + has_group_ is the open row
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
