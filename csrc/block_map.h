#pragma once
// Block maps: a request's KV moved between two registrations as byte runs.
//
// Python (kvlayout/transfer/block_maps.py) asks the layout algebra where every byte of both sides
// lives and hands over *slabs*: one per (layer, K/V, piece of a head's row) both sides
// hold, each with its base address on either side, the tensors it lies in, its width
// and its per-head and per-token strides. This file
//   - builds the runs (build_groups): walks the destination in memory order (the nest of
//     slab, block, slot and head levels that Python orders by the destination's strides,
//     blocks in id order), folds the innermost levels that are contiguous on both sides
//     into one emission, and merges each emission into the previous run when both sides
//     continue it, within one tensor on each side. Emitted in destination order, that
//     merge leaves the fewest runs; when the walk turns out not to be in destination
//     order (a layout whose levels interleave), the runs are sorted and merged again.
//     Finished runs are kept as groups (run_groups.h): the inner levels that do not fold
//     are emitted as rows and tiles of runs, not one run at a time, so a map of half a
//     million runs is a few thousand groups. Slabs of one shape (every layer's K and V)
//     make one pattern of runs, walked once and pasted at each (Walker::replay());
//   - validates runs against the tensors' byte spans before a byte moves (validate_runs,
//     validate_groups);
//   - copies them on the worker pool, split by bytes, with the GIL released, prefetching
//     or not as measured (copy_runs, copy_groups; prefetch_choice.h).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <utility>
#include <vector>

#include "prefetch_choice.h"
#include "run_groups.h"
#include "stream_copy.h"
#include "worker_pool.h"

// ByteRun and copy_byte_runs: the streaming, prefetching run copy of the CPU engine.

namespace kvlayout::block_map {

enum Level : int { kSlab = 0, kBlock = 1, kSlot = 2, kHead = 3 };

// One slab, all in bytes. `tail` is how many of the innermost nest levels (slot, head)
// are contiguous on both sides for this slab and so fold into one emission.
struct Slab {
  std::uint64_t src_base, dst_base;
  std::uint64_t src_tensor, dst_tensor;
  std::uint64_t width;
  std::uint64_t src_head_stride, dst_head_stride;
  std::uint64_t src_class, dst_class;  // index of the slab's (block, slot) strides
  std::uint64_t tail;
};
static_assert(sizeof(Slab) == 10 * sizeof(std::uint64_t), "Slab is the (S, 10) uint64 array's row");

struct Strides {
  std::uint64_t block, slot;
};

struct Request {
  const Slab* slabs;
  const std::int64_t* group_starts;  // slabs [group_starts[g], group_starts[g + 1]) share a destination tensor
  std::int64_t num_groups;
  int order[4];  // the nest, outermost first
  std::int64_t heads, tokens;
  const std::int64_t* src_blocks;
  std::int64_t src_block_size;
  const std::int64_t* dst_blocks;
  std::int64_t dst_block_size;
  const Strides* src_classes;
  std::int64_t num_src_classes;
  const Strides* dst_classes;
  std::int64_t num_dst_classes;
  std::int64_t first = 0;  // the first token moved: tokens [first, tokens) (the rest are the engine's)
  // Where each block id's page starts in its block, in slots, or null (every page a whole
  // block): pages finer than their blocks, a context-parallel rank's slice of a request
  // (kvlayout/transfer/context_parallel.py). Block b's token j is then at slot
  // page_slots[b] + j of block blocks[b].
  const std::int64_t* src_page_slots = nullptr;
  const std::int64_t* dst_page_slots = nullptr;
};

// The runs of one request, as groups (run_groups.h): rows [0, size) of a malloc'd table,
// which goes back to the TablePool when the map is dropped.
struct Built {
  detail::Table<RunGroup> groups;
  std::size_t size = 0;
  std::uint64_t runs = 0;  // the runs the groups hold
  bool walked_in_order = true;  // false: the walk was not in destination order, so runs were sorted

  Built() = default;
  Built(Built&&) = default;
  Built& operator=(Built&&) = default;
  ~Built() { detail::TablePool::instance().put(std::move(groups)); }
};

namespace detail {

// A tile's shape: `rows` rows, (sr, dr) apart, of `count` runs of n bytes, (ss, ds) apart.
struct Tile {
  std::uint64_t n, count, ss, ds, rows, sr, dr;

  // Whether Cursor::emit_tile() keeps tiles of this shape whole: two rows of two runs at
  // least, no run of one merging with the next run of it nor coming before it in the
  // destination.
  bool whole() const {
    const std::uint64_t row_dst_span = (count - 1) * ds + n, row_src_span = (count - 1) * ss + n;
    return rows >= 2 && count >= 2 && ds >= n && !(ss == n && ds == n) && dr >= row_dst_span &&
           !(dr == row_dst_span && sr == row_src_span);
  }
  // A whole tile of three rows of three runs at least: the tiles next_tile() follows on with.
  bool regular() const { return whole() && rows >= 3 && count >= 3; }
};

// Where finished runs go and the run being grown. Each emission merges into the current
// run where both sides continue it; a run never crosses from one tensor into another on
// either side (enter() ends the run where a leaf's tensors differ). A plain value: the
// walker's loops copy it into a local so the hot path stays in registers (kept in
// memory, it was reloaded after every store to the output, which may alias it), and
// the per-emission state is only the run and the output. Finished runs go to a Grouper;
// on the sorting pass (kTrackTensors) to a table of runs with their tensors, to be sorted.
template <bool kTrackTensors>
struct Cursor {
  Grouper* groups;  // !kTrackTensors only
  Table<ByteRun>* table;  // kTrackTensors only, with the tensors of each run
  Table<std::uint64_t>* src_table;
  Table<std::uint64_t>* dst_table;
  ByteRun* out = table ? table->rows : nullptr;
  ByteRun* limit = table ? table->rows + table->size : nullptr;
  // The current run. Empty (len 0), it sits where an emission would have to start to
  // continue it, so that absorbing one gives exactly that emission's run: at (0, 0)
  // after a change of destination tensor (another group, whose order is its own), at
  // (0, end of the last run) after a change of source tensor alone (the order check
  // still sees the last run's end).
  // Neither src and dst nor row_src and row_dst lie side by side: a group built from a
  // pair (next_tile's pushes) read it as one 16-byte word, which the pair's two 8-byte
  // stores cannot forward, and the load waited for the store buffer to drain: that one
  // load held a quarter of the samples of NHD -> HND's build with consecutive blocks.
  std::uint64_t src = 0, len = 0, dst = 0;
  std::uint64_t src_tensor = ~std::uint64_t{0}, dst_tensor = ~std::uint64_t{0};
  bool in_order = true;  // each group's runs came in destination order
  // Finished runs of the current run's length that the current run continues as a row
  // (row_count of them from (row_src, row_dst) at (row_ss, row_ds)), held back so that
  // the row goes to the Grouper in one piece with the current run when that finishes
  // (!kTrackTensors only; 0: none).
  std::uint64_t row_src = 0, row_count = 0, row_dst = 0, row_ss = 0, row_ds = 0;

  std::size_t used() const { return static_cast<std::size_t>(out - table->rows); }
  [[gnu::always_inline]] void enter(std::uint64_t st, std::uint64_t dt) {
    if (st == src_tensor && dt == dst_tensor) return;
    if (len != 0) flush();
    dst = dt == dst_tensor ? dst + len : 0;
    src = 0, len = 0;
    src_tensor = st, dst_tensor = dt;
  }
  [[gnu::always_inline]] void emit(std::uint64_t s, std::uint64_t d, std::uint64_t n) {
    if (d == dst + len && s == src + len) {
      if (row_count != 0) spill();  // the current run grows: the row before it is done
      len += n;
      return;
    }
    in_order &= d >= dst + len;
    if (len != 0) flush();
    src = s, dst = d, len = n;
  }
  // `count` emissions of n bytes, the i-th at (s + i * ss, d + i * ds): exactly what
  // emitting them one by one gives. Where they neither merge with each other nor come
  // out of destination order (ds >= n), only the first may merge into the current run
  // and only the last into the next emission: the runs before the last are held back
  // as a row.
  void emit_row(std::uint64_t s, std::uint64_t d, std::uint64_t n, std::uint64_t count, std::uint64_t ss,
                std::uint64_t ds) {
    if (ss == n && ds == n) return emit(s, d, n * count);
    if (kTrackTensors || count < 2 || ds < n) {
      for (std::uint64_t i = 0; i < count; ++i) emit(s + i * ss, d + i * ds, n);
      return;
    }
    emit(s, d, n);
    if (src == s && len == n) {  // the first run stands alone: the row starts with it
      row_src = s, row_dst = d, row_count = count - 1;
    } else {
      flush();
      row_src = s + ss, row_dst = d + ds, row_count = count - 2;
    }
    row_ss = ss, row_ds = ds;
    src = s + (count - 1) * ss, dst = d + (count - 1) * ds, len = n;
  }
  // The t.rows rows of emit_row(s + r * t.sr, d + r * t.dr, ...). Where no row's last run merges
  // with the next row's first or comes after it in the destination, the rows before the
  // last go to the Grouper whole and the last is held back as a row.
  void emit_tile(std::uint64_t s, std::uint64_t d, const Tile& t) {
    const std::uint64_t n = t.n, count = t.count, ss = t.ss, ds = t.ds, rows = t.rows, sr = t.sr, dr = t.dr;
    if (kTrackTensors || !t.whole()) {
      for (std::uint64_t r = 0; r < rows; ++r) emit_row(s + r * sr, d + r * dr, n, count, ss, ds);
      return;
    }
    const std::uint64_t last = rows - 1;
    emit(s, d, n);
    if (src == s && len == n) {  // the first run stands alone: rows 0 .. last - 1 are done
      groups->add_group(RunGroup{s, d, n, count, ss, ds, last, last > 1 ? sr : 0, last > 1 ? dr : 0});
    } else {
      flush();
      groups->add(s + ss, d + ds, n, count - 1, ss, ds);
      if (last > 1) groups->add_group(RunGroup{s + sr, d + dr, n, count, ss, ds, last - 1, last > 2 ? sr : 0, last > 2 ? dr : 0});
    }
    row_src = s + last * sr, row_dst = d + last * dr, row_count = count - 1, row_ss = ss, row_ds = ds;
    src = row_src + (count - 1) * ss, dst = row_dst + (count - 1) * ds, len = n;
  }
  // Whether the last emission was a tile of regular shape t as emit_tile() (or
  // next_tile()) leaves one: its last run current, its last row less that run held back,
  // and the Grouper's open group one that this row continues.
  bool after_tile(const Tile& t) const {
    if constexpr (kTrackTensors) return false;
    if (len != t.n || row_count != t.count - 1 || row_ss != t.ss || row_ds != t.ds || !groups->settled() ||
        src != row_src + (t.count - 1) * t.ss || dst != row_dst + (t.count - 1) * t.ds)
      return false;
    const RunGroup& g = groups->open();
    return g.len == t.n && g.count == t.count && g.src_step == t.ss && g.dst_step == t.ds &&
           (g.rows == 1 || (g.src_row == t.sr && g.dst_row == t.dr)) && row_src == g.src + g.rows * t.sr &&
           row_dst == g.dst + g.rows * t.dr;
  }
  // emit_tile(s, d, t) right after a tile of the same shape (after_tile(t)): the same
  // groups, written straight into the Grouper (emit_tile's general bookkeeping was half
  // the build of a permuted map). Either the tile's first run continues the last one (blocks
  // consecutive on both sides): the held row closes short of it, the two runs are one,
  // then the rest of the tile's first row and its middle rows, the last row held back; or
  // the held row completes the open group and the tile's rows but the last continue it
  // or start the next.
  void next_tile(const Tile& t, std::uint64_t s, std::uint64_t d) {
    if constexpr (!kTrackTensors) {
      if (s == src + len && d == dst + len) {
        groups->push(RunGroup{row_src, row_dst, t.n, t.count - 1, t.ss, t.ds, 1, 0, 0});
        groups->push(RunGroup{src, dst, 2 * t.n, 1, 0, 0, 1, 0, 0});
        groups->push(RunGroup{s + t.ss, d + t.ds, t.n, t.count - 1, t.ss, t.ds, 1, 0, 0});
        const bool stepped = t.rows > 3;
        groups->push(RunGroup{s + t.sr, d + t.dr, t.n, t.count, t.ss, t.ds, t.rows - 2, stepped ? t.sr : 0,
                              stepped ? t.dr : 0});
      } else {
        in_order &= d >= dst + len;
        RunGroup& g = groups->grow_open(1);  // the held row and the current run
        g.src_row = t.sr, g.dst_row = t.dr;
        if (s == g.src + g.rows * t.sr && d == g.dst + g.rows * t.dr)
          groups->grow_open(t.rows - 1);
        else
          groups->push(RunGroup{s, d, t.n, t.count, t.ss, t.ds, t.rows - 1, t.sr, t.dr});
      }
      row_src = s + (t.rows - 1) * t.sr, row_dst = d + (t.rows - 1) * t.dr;
      src = row_src + (t.count - 1) * t.ss, dst = row_dst + (t.count - 1) * t.ds;
    }
  }
  void flush() {
    if constexpr (kTrackTensors) {
      if (out == limit) out = grow(table, src_table, dst_table, used()), limit = table->rows + table->size;
      src_table->rows[used()] = src_tensor;
      dst_table->rows[used()] = dst_tensor;
      *out++ = ByteRun{src, dst, len};
    } else if (row_count != 0) {
      groups->add(row_src, row_dst, len, row_count + 1, row_ss, row_ds);
      row_count = 0;
    } else {
      groups->add(src, dst, len, 1, 0, 0);
    }
  }
  // The runs of groups p[0, n) (a slab's pattern, walked from a fresh cursor, in
  // destination order if `ordered`), moved by (ds, dd) into the tensors (st, dt): what
  // walking that slab gives. Runs merge across a slab's edge only: the first run goes
  // through emit() (continuing the current run where both sides do), the last becomes the
  // current run (which the next slab's first may continue), and the rest go to the
  // Grouper as they are.
  // A pattern of several slabs (Walker::replay_slot()) starts in the tensors (st, dt) and
  // ends in (st_last, dt_last), which the last run, current after the paste, is in.
  void paste(const RunGroup* p, std::size_t n, std::uint64_t ds, std::uint64_t dd, std::uint64_t st,
             std::uint64_t dt, bool ordered, std::uint64_t st_last, std::uint64_t dt_last) {
    if constexpr (!kTrackTensors) {
      if (n == 0) return;
      enter(st, dt);
      in_order &= ordered;
      const RunGroup& last = p[n - 1];
      const ByteRun a = p[0].run(0, 0), z = last.run(last.rows - 1, last.count - 1);
      emit(a.src + ds, a.dst + dd, a.len);
      if (n == 1 && p[0].runs() == 1) return;  // one run: one pair of tensors
      flush();
      groups->paste_inner(p, n, ds, dd);
      src = z.src + ds, dst = z.dst + dd, len = z.len;
      src_tensor = st_last, dst_tensor = dt_last;
    }
  }
  // The held-back row, without the current run.
  [[gnu::noinline]] void spill() {
    if constexpr (!kTrackTensors) groups->add(row_src, row_dst, len, row_count, row_ss, row_ds);
    row_count = 0;
  }
  void finish() {
    if (len != 0) flush();
    len = 0;
  }
  // Static, so the cursor's address never escapes (which would keep it in memory).
  [[gnu::noinline]] static ByteRun* grow(Table<ByteRun>* runs, Table<std::uint64_t>* src_tensors,
                                         Table<std::uint64_t>* dst_tensors, std::size_t n) {
    const std::size_t size = 2 * runs->size + 4096;
    runs->resize(size);
    src_tensors->resize(size);
    dst_tensors->resize(size);
    return runs->rows + n;
  }
};

// One slab at one head, with everything an emission reads in locals: the inner loops
// read no member of the walker (a store to the output may alias any uint64 in memory).
struct At {
  std::uint64_t src, dst;  // the slab's bases at this head
  const std::uint64_t* src_tok;  // (block, slot) offset of each token on each side
  const std::uint64_t* dst_tok;
  std::uint64_t src_slot, dst_slot;  // bytes from one slot to the next within a block
};

template <bool kTrackTensors>
class Walker {
 public:
  // `one_by_one`: every block through the general walk (emit_leaf()), none through the
  // block loops that serve whole blocks (tests hold both to one answer).
  Walker(const Request& q, const std::vector<std::int64_t>& positions, const std::vector<std::uint64_t>& src_tok,
         const std::vector<std::uint64_t>& dst_tok, Cursor<kTrackTensors> cursor, bool one_by_one = false,
         bool slabs_one_by_one = false)
      : q_(q), positions_(positions), src_tok_(src_tok), dst_tok_(dst_tok), cursor_(cursor), one_by_one_(one_by_one),
        replay_(!kTrackTensors && !slabs_one_by_one && q.order[0] == kSlab),
        slot_replay_(!kTrackTensors && !slabs_one_by_one && q.order[0] == kBlock && q.order[1] == kSlot &&
                     q.order[2] == kSlab),
        heads_over_pages_(q.order[1] == kBlock && q.order[2] == kHead && q.order[3] == kSlot &&
                          pages_share_blocks(q, positions)) {
    // The first source block boundary after each destination block's first token: a
    // division per block here, none per emission.
    boundary_.resize(static_cast<std::size_t>((q.tokens + q.dst_block_size - 1) / q.dst_block_size));
    for (const std::int64_t pos : positions) {
      const std::int64_t first = first_of(pos);
      boundary_[static_cast<std::size_t>(pos)] = (first / q.src_block_size + 1) * q.src_block_size;
    }
  }

  Cursor<kTrackTensors> run() {
    for (std::int64_t g = 0; g < q_.num_groups; ++g) {
      group_ = g;
      slab_ = &q_.slabs[q_.group_starts[g]];  // a nest whose slab level is inner sets it again
      level(0);
    }
    cursor_.finish();
    return cursor_;
  }

 private:
  // Whether two destination pages (positions in memory order) lie in one block: pages
  // finer than blocks (a context-parallel map's granules, several in a destination block).
  static bool pages_share_blocks(const Request& q, const std::vector<std::int64_t>& positions) {
    if (q.dst_page_slots == nullptr) return false;
    for (std::size_t k = 1; k < positions.size(); ++k)
      if (q.dst_blocks[positions[k]] == q.dst_blocks[positions[k - 1]]) return true;
    return false;
  }

  // The slab at head h, the cursor entering its tensors.
  [[gnu::always_inline]] At at(Cursor<kTrackTensors>& c, std::int64_t h) const {
    const Slab& s = *slab_;
    c.enter(s.src_tensor, s.dst_tensor);
    return At{s.src_base + static_cast<std::uint64_t>(h) * s.src_head_stride,
              s.dst_base + static_cast<std::uint64_t>(h) * s.dst_head_stride,
              src_tok_.data() + s.src_class * q_.tokens, dst_tok_.data() + s.dst_class * q_.tokens,
              q_.src_classes[s.src_class].slot, q_.dst_classes[s.dst_class].slot};
  }
  // The tokens [p, stop) of this destination block that lie in one source block, for
  // each such segment in order (the first source block boundary after the block's first
  // token is boundary_, then one every source block).
  template <class Body>
  [[gnu::always_inline]] void for_segments(Body body) const {
    const std::int64_t first = first_of(position_), end = first + slots(), step = q_.src_block_size;
    std::int64_t stop = std::min(end, boundary_[position_]);
    for (std::int64_t p = first; p < end; stop = std::min(end, stop + step)) {
      body(p, stop);
      p = stop;
    }
  }
  [[gnu::always_inline]] static void emit(Cursor<kTrackTensors>& c, const At& a, std::int64_t p, std::uint64_t n) {
    c.emit(a.src + a.src_tok[p], a.dst + a.dst_tok[p], n);
  }
  // The first token of the request in destination block position `pos` (a block the
  // request's first token cuts starts there), and the slots from it to the block's end.
  std::int64_t first_of(std::int64_t pos) const { return std::max(pos * q_.dst_block_size, q_.first); }
  std::int64_t slots() const {
    return std::min((position_ + 1) * q_.dst_block_size, q_.tokens) - first_of(position_);
  }

  // Level d and those inside it make their emissions without another call to level():
  // the innermost level, levels folded into one emission, a slot level with only a
  // folded head level inside, or tiled slot and head levels.
  bool leaf(int d) const {
    if (d == 4 || (slab_set_ && d >= 4 - static_cast<int>(slab_->tail)) || tiled(d)) return true;
    if (d == 3) return q_.order[3] != kSlab;  // an innermost slot or head level
    return d == 2 && q_.order[2] == kSlot && q_.order[3] == kHead && slab_set_ && slab_->tail >= 1;
  }

  // The emissions of a leaf level into the caller's cursor (inlined, so that a loop over
  // leaves keeps one cursor in registers throughout).
  [[gnu::always_inline]] void emit_leaf(int d, Cursor<kTrackTensors>& c) const {
    if (d == 4) return emit(c, at(c, head_), token_, slab_->width);
    if (tiled(d)) return emit_tiles(c);
    if (slab_set_ && d >= 4 - static_cast<int>(slab_->tail)) return folded(d, c);
    const std::uint64_t width = slab_->width;
    if (q_.order[d] == kSlot) {  // innermost, or only a folded head inside: no call per slot
      const bool head_folded = d == 2;
      return slot_rows(c, at(c, head_folded ? 0 : head_),
                       width * static_cast<std::uint64_t>(head_folded ? q_.heads : 1));
    }
    const At a = at(c, 0);  // an innermost head level
    c.emit_row(a.src + a.src_tok[token_], a.dst + a.dst_tok[token_], width, static_cast<std::uint64_t>(q_.heads),
               slab_->src_head_stride, slab_->dst_head_stride);
  }

  // The block's slots from the slab at `a`, `unit` bytes each: a row per segment of them
  // in one source block.
  [[gnu::always_inline]] void slot_rows(Cursor<kTrackTensors>& c, const At& a, std::uint64_t unit) const {
    for_segments([&](std::int64_t p, std::int64_t stop) __attribute__((always_inline)) {
      c.emit_row(a.src + a.src_tok[p], a.dst + a.dst_tok[p], unit, static_cast<std::uint64_t>(stop - p), a.src_slot,
                 a.dst_slot);
    });
  }

  // Levels 2 and 3 (slot and head, either way round, neither folded) as tiles: per
  // segment of the block's tokens in one source block, the inner level's emissions are
  // a row, the outer level's steps its rows.
  bool tiled(int d) const {
    const int inner = q_.order[2] | q_.order[3] << 2;
    return d == 2 && slab_set_ && (inner == (kSlot | kHead << 2) || inner == (kHead | kSlot << 2)) &&
           slab_->tail == 0;
  }
  [[gnu::always_inline]] void emit_tiles(Cursor<kTrackTensors>& c) const {
    if (q_.order[2] == kHead && first_of(position_) + slots() > boundary_[position_]) {
      // Heads outside slots, the block's tokens in several source blocks: a tile per
      // segment would visit every head once per segment, out of destination order (and
      // the runs then sorted); a row per head and segment keeps the order.
      for (std::int64_t h = 0; h < q_.heads; ++h) slot_rows(c, at(c, h), slab_->width);
      return;
    }
    const At a = at(c, 0);
    for_segments([&](std::int64_t p, std::int64_t stop) __attribute__((always_inline)) {
      c.emit_tile(a.src + a.src_tok[p], a.dst + a.dst_tok[p], tile(a, static_cast<std::uint64_t>(stop - p)));
    });
  }
  // The tile of `slots` slots of the slab at `a`.
  Tile tile(const At& a, std::uint64_t slots) const {
    const std::uint64_t width = slab_->width, heads = static_cast<std::uint64_t>(q_.heads);
    const std::uint64_t sh = slab_->src_head_stride, dh = slab_->dst_head_stride;
    if (q_.order[2] == kHead)  // heads outside slots: the slots are a row, one per head
      return Tile{width, slots, a.src_slot, a.dst_slot, heads, sh, dh};
    return Tile{width, heads, sh, dh, slots, a.src_slot, a.dst_slot};
  }
  // The block level over a leaf at level 2 (the slab level outside it): a full
  // destination block within one source block has the slab's block shape, so it goes to
  // whole(c, first token) with nothing recomputed; the others to emit_leaf(2) and then
  // other(). One cursor in registers throughout, as loop() keeps one.
  template <class Whole, class Other>
  [[gnu::always_inline]] void by_block(Whole whole, Other other) {
    Cursor<kTrackTensors> c = cursor_;
    const std::int64_t bs = q_.dst_block_size;
    for (const std::int64_t pos : positions_) {
      position_ = pos;
      const std::int64_t first = pos * bs;
      if (first >= q_.first && first + bs <= q_.tokens && boundary_[pos] >= first + bs) {
        whole(c, first);
      } else {
        emit_leaf(2, c);
        other();
      }
    }
    cursor_ = c;
  }
  // Heads outside slots, destination blocks cut into pages (a CP rank's granules in a side
  // that holds more of the request): a block's pages are consecutive positions, and each
  // page's head h lies
  // between head h of the block's pages before and after it, so a walk a page at a time
  // (its heads inside) goes back in the destination at every page (and its runs were
  // sorted: 5.2 ms for 32 layers of 1024 tokens at interleave 1). Each block's heads are
  // walked outside its pages instead: head by head, the block's pages in slot order,
  // which is the destination's memory order and leaves the runs the sort left.
  void heads_over_pages() {
    Cursor<kTrackTensors> c = cursor_;
    const std::vector<std::int64_t>& pos = positions_;
    for (std::size_t lo = 0, hi = 0; lo < pos.size(); lo = hi) {
      const std::int64_t block = q_.dst_blocks[pos[lo]];
      for (hi = lo + 1; hi < pos.size() && q_.dst_blocks[pos[hi]] == block;) ++hi;
      for (std::int64_t h = 0; h < q_.heads; ++h) {
        head_ = h;
        for (std::size_t k = lo; k < hi; ++k) {
          position_ = pos[k];
          emit_leaf(3, c);  // the page's slots at head h (folded or not)
        }
      }
    }
    cursor_ = c;
  }
  // Blocks whose slot and head levels fold (tail 2): one emission of all the block's bytes.
  void folded_by_block() {
    const At a = at(cursor_, 0);
    const std::uint64_t bytes = slab_->width * static_cast<std::uint64_t>(q_.heads * q_.dst_block_size);
    by_block([&](Cursor<kTrackTensors>& c, std::int64_t first)
                 __attribute__((always_inline)) { c.emit(a.src + a.src_tok[first], a.dst + a.dst_tok[first], bytes); },
             [] {});
  }
  // Blocks whose slot level holds only a folded head level (tail 1): a row of a run per slot.
  void rows_by_block() {
    const At a = at(cursor_, 0);
    const std::uint64_t unit = slab_->width * static_cast<std::uint64_t>(q_.heads);
    const auto slots = static_cast<std::uint64_t>(q_.dst_block_size);
    by_block(
        [&](Cursor<kTrackTensors>& c, std::int64_t first) __attribute__((always_inline)) {
          c.emit_row(a.src + a.src_tok[first], a.dst + a.dst_tok[first], unit, slots, a.src_slot, a.dst_slot);
        },
        [] {});
  }
  // Blocks as tiles (slot and head levels, neither folded): a tile that follows a tile of
  // the block shape goes to next_tile(); the rest, and the first, to emit_tiles().
  void tiles_by_block() {
    const At a = at(cursor_, 0);
    const Tile t = tile(a, static_cast<std::uint64_t>(q_.dst_block_size));
    const bool regular = t.regular();
    bool follows = false;
    by_block(
        [&](Cursor<kTrackTensors>& c, std::int64_t first) __attribute__((always_inline)) {
          if (follows) return c.next_tile(t, a.src + a.src_tok[first], a.dst + a.dst_tok[first]);
          emit_tiles(c);
          follows = regular && c.after_tile(t);
        },
        [&] { follows = false; });
  }

  // Levels d..3 fold into emissions: the slot level (if folded) by segments of tokens that
  // stay in one source block, the head level (if folded) whole. A head level folded over
  // an innermost slot level (tail 2, heads outside tokens on both sides) folds only for a
  // full destination block, whose one segment is a whole block on both sides.
  [[gnu::always_inline]] void folded(int d, Cursor<kTrackTensors>& c) const {
    bool slot = false, head = false;
    for (int k = d; k < 4; ++k) {
      slot |= q_.order[k] == kSlot;
      head |= q_.order[k] == kHead;
    }
    if (slot && head && q_.order[3] == kSlot && slots() != q_.dst_block_size) {
      for (std::int64_t h = 0; h < q_.heads; ++h) segments(h, slab_->width, c);
      return;
    }
    const std::int64_t h = head ? 0 : head_;
    const std::uint64_t unit = slab_->width * static_cast<std::uint64_t>(head ? q_.heads : 1);
    if (!slot) return emit(c, at(c, h), token_, unit);
    segments(h, unit, c);
  }

  [[gnu::always_inline]] void segments(std::int64_t h, std::uint64_t unit, Cursor<kTrackTensors>& c) const {
    const At a = at(c, h);
    for_segments([&](std::int64_t p, std::int64_t stop) __attribute__((always_inline)) { emit(c, a, p, unit * static_cast<std::uint64_t>(stop - p)); });
  }

  // Runs `body(index)` over a loop level; where the level inside is a leaf, the loop's
  // emissions go through one local cursor (copied in and out once, not per iteration).
  template <class Set>
  void loop(int d, std::int64_t n, const std::int64_t* values, Set set) {
    if (leaf(d + 1)) {
      Cursor<kTrackTensors> c = cursor_;
      for (std::int64_t i = 0; i < n; ++i) {
        set(values ? values[i] : i);
        emit_leaf(d + 1, c);
      }
      cursor_ = c;
      return;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      set(values ? values[i] : i);
      level(d + 1);
    }
  }

  void level(int d) {
    if (leaf(d)) {
      Cursor<kTrackTensors> c = cursor_;
      emit_leaf(d, c);
      cursor_ = c;
      return;
    }
    switch (q_.order[d]) {
      case kSlab: {
        const std::int64_t lo = q_.group_starts[group_], hi = q_.group_starts[group_ + 1];
        if (d == 2 && slot_replay_ && replay_slot(lo, hi)) return;
        for (std::int64_t s = lo; s < hi; ++s) {  // a slab's tail decides what is a leaf: no loop()
          slab_ = &q_.slabs[s];
          slab_set_ = true;
          if (d == 0 && replay_)
            replay();
          else
            level(d + 1);
        }
        slab_set_ = false;
        return;
      }
      case kBlock:
        if (d == 1 && slab_set_ && heads_over_pages_ && slab_->tail < 2) return heads_over_pages();
        if (d == 1 && slab_set_ && !one_by_one_) {  // the slab level outside: whole blocks by shape
          if (slab_->tail >= 2) return folded_by_block();
          if (tiled(2)) return tiles_by_block();
          if (q_.order[2] == kSlot && q_.order[3] == kHead && slab_->tail == 1) return rows_by_block();
        }
        return loop(d, static_cast<std::int64_t>(positions_.size()), positions_.data(),
                    [this](std::int64_t pos) { position_ = pos; });
      case kSlot: {
        const std::int64_t first = first_of(position_);
        return loop(d, slots(), nullptr, [this, first](std::int64_t j) { token_ = first + j; });
      }
      default:  // kHead
        return loop(d, q_.heads, nullptr, [this](std::int64_t h) { head_ = h; });
    }
  }

  // The outermost slab level: a slab whose shape (all but its bases and tensors) is an
  // earlier slab's makes the same emissions moved by the difference of bases, so its runs
  // are that slab's pattern pasted (the walk of 64 slabs was 64 walks of one; slabs of one
  // shape are every layer's K and V). Four patterns are kept, should a row cut in pieces
  // alternate shapes (the catalogue's such pairs walk slabs inside blocks: no paste). The
  // first slab of a shape is walked into a pattern from a fresh cursor, then pasted like
  // the others.
  struct Pattern {
    Slab slab{};  // the slab walked
    Table<RunGroup> groups;
    std::size_t size = 0;
    bool in_order = true;
    bool set = false;

    bool fits(const Slab& s) const {
      return set && s.width == slab.width && s.src_head_stride == slab.src_head_stride &&
             s.dst_head_stride == slab.dst_head_stride && s.src_class == slab.src_class &&
             s.dst_class == slab.dst_class && s.tail == slab.tail;
    }
  };
  static constexpr std::size_t kPatterns = 4;

  void replay() {
    if constexpr (!kTrackTensors) {
      const Slab& s = *slab_;
      Pattern* p = nullptr;
      for (Pattern& k : patterns_)
        if (k.fits(s)) p = &k;
      if (p == nullptr) {
        p = &patterns_[next_pattern_];
        next_pattern_ = (next_pattern_ + 1) % kPatterns;
        record(*p);
      }
      cursor_.paste(p->groups.rows, p->size, s.src_base - p->slab.src_base, s.dst_base - p->slab.dst_base,
                    s.src_tensor, s.dst_tensor, p->in_order, s.src_tensor, s.dst_tensor);
    }
  }
  void record(Pattern& p) {
    walk_into(p.groups, p.size, p.in_order, [this] { level(1); });
    p.slab = *slab_, p.set = true;
  }
  // The groups `walk` emits from a fresh cursor, into `table` (`size` of them, `in_order`
  // whether they came in destination order); the walker's cursor is as it was after.
  template <class Walk>
  void walk_into(Table<RunGroup>& table, std::size_t& size, bool& in_order, Walk walk) {
    if constexpr (!kTrackTensors) {
      const Cursor<kTrackTensors> outer = cursor_;
      Grouper groups(&table);
      cursor_ = Cursor<kTrackTensors>{&groups, nullptr, nullptr, nullptr};
      walk();
      cursor_.finish();
      groups.finish();
      size = groups.used(), in_order = cursor_.in_order;
      cursor_ = outer;
    }
  }

  // The slab level inside the block and slot levels (layers interleaved in the
  // destination: SGLang's page_first host pool, one run per token, layer and K/V): where
  // a group's slabs all step through tokens alike on each side (one stride class each),
  // the emissions of one token are those of the group's first token moved by the
  // difference of its token offsets, so the group's slabs are walked at its first token
  // into a pattern, pasted at each token after (the walk of 65536 runs was 14 ns a run,
  // down the whole nest for each). Returns false where the classes differ: walked.
  struct SlotPattern {
    Table<RunGroup> groups;
    std::size_t size = 0;
    bool in_order = true, uniform = false;
    std::int64_t group = -1;  // the group recorded; -1: none yet
    std::uint64_t src_at = 0, dst_at = 0;  // the token offsets of the token it was recorded at
  };

  bool replay_slot(std::int64_t lo, std::int64_t hi) {
    if constexpr (kTrackTensors) {
      return false;
    } else {
      SlotPattern& p = slot_pattern_;
      const Slab &a = q_.slabs[lo], &z = q_.slabs[hi - 1];
      const std::uint64_t src_at = src_tok_[a.src_class * q_.tokens + token_];
      const std::uint64_t dst_at = dst_tok_[a.dst_class * q_.tokens + token_];
      if (p.group != group_) {
        p.group = group_, p.uniform = true;
        for (std::int64_t s = lo; s < hi; ++s)
          p.uniform &= q_.slabs[s].src_class == a.src_class && q_.slabs[s].dst_class == a.dst_class;
        if (!p.uniform) return false;
        walk_into(p.groups, p.size, p.in_order, [&] {
          for (std::int64_t s = lo; s < hi; ++s) {
            slab_ = &q_.slabs[s];
            slab_set_ = true;
            level(3);
          }
          slab_set_ = false;
        });
        p.src_at = src_at, p.dst_at = dst_at;
      }
      if (!p.uniform) return false;
      cursor_.paste(p.groups.rows, p.size, src_at - p.src_at, dst_at - p.dst_at, a.src_tensor, a.dst_tensor,
                    p.in_order, z.src_tensor, z.dst_tensor);
      return true;
    }
  }

  const Request& q_;
  const std::vector<std::int64_t>& positions_;
  const std::vector<std::uint64_t>& src_tok_;
  const std::vector<std::uint64_t>& dst_tok_;
  Cursor<kTrackTensors> cursor_;
  std::vector<std::int64_t> boundary_;  // by destination block position
  const bool one_by_one_;
  const bool replay_;  // slabs of one shape pasted from a pattern (replay())
  const bool slot_replay_;  // a group's slabs at one token pasted at the others (replay_slot())
  const bool heads_over_pages_;  // a block's heads walked outside its pages (heads_over_pages())
  SlotPattern slot_pattern_;
  Pattern patterns_[kPatterns];
  std::size_t next_pattern_ = 0;  // the one recorded next, round the patterns
  const Slab* slab_ = nullptr;
  bool slab_set_ = false;
  std::int64_t group_ = 0, position_ = 0, token_ = 0, head_ = 0;
};

// (block, slot) offsets of every token of the request on one side, per stride class
// (`page_slots`: Request's).
inline std::vector<std::uint64_t> token_offsets(const std::int64_t* blocks, const std::int64_t* page_slots,
                                                std::int64_t block_size, const Strides* classes,
                                                std::int64_t num_classes, std::int64_t tokens) {
  std::vector<std::uint64_t> out(static_cast<std::size_t>(num_classes * tokens));
  for (std::int64_t c = 0; c < num_classes; ++c) {
    std::uint64_t* row = out.data() + c * tokens;
    for (std::int64_t p = 0, b = 0; p < tokens; p += block_size, ++b) {
      std::uint64_t base = static_cast<std::uint64_t>(blocks[b]) * classes[c].block;
      if (page_slots) base += static_cast<std::uint64_t>(page_slots[b]) * classes[c].slot;
      const std::int64_t n = std::min(block_size, tokens - p);
      for (std::int64_t j = 0; j < n; ++j) row[p + j] = base + static_cast<std::uint64_t>(j) * classes[c].slot;
    }
  }
  return out;
}

// At most how many emissions a walk makes: the rows the output is given (a run per
// emission at worst), so that no walk grows them.
inline std::size_t emissions_bound(const Request& q) {
  const std::int64_t segments = (q.tokens + q.src_block_size - 1) / q.src_block_size +
                                (q.tokens + q.dst_block_size - 1) / q.dst_block_size;
  // A partial destination block (the last, or the first the first token cuts) whose heads
  // fold over its slots emits per head.
  const auto partial_of = [&](std::int64_t rest) { return rest ? std::min(rest, rest / q.src_block_size + 2) : 0; };
  const std::int64_t cut = q.first % q.dst_block_size;  // the first block's slots before the first token
  const std::int64_t partial = partial_of(q.tokens % q.dst_block_size) + partial_of(cut ? q.dst_block_size - cut : 0);
  std::int64_t total = 0;
  const std::int64_t slabs = q.group_starts[q.num_groups];
  for (std::int64_t s = 0; s < slabs; ++s) {
    const std::uint64_t tail = q.slabs[s].tail;
    const bool slot_folded = (tail >= 1 && q.order[3] == kSlot) || (tail >= 2 && q.order[2] == kSlot);
    const bool head_folded = (tail >= 1 && q.order[3] == kHead) || (tail >= 2 && q.order[2] == kHead);
    total += (slot_folded ? std::min(segments, q.tokens) : q.tokens) * (head_folded ? 1 : q.heads);
    if (slot_folded && head_folded && q.order[3] == kSlot) total += (q.heads - 1) * partial;  // see folded()
  }
  return static_cast<std::size_t>(total);
}

}  // namespace detail

namespace detail {

// The sorting path's tables, kept per thread for the next build that takes it: fresh,
// their page faults cost more than the walk and the merge (about 2 us a page on a VM:
// 3 of the 3.6 ms a 65536-run map took). A thread keeps up to kKeepScratch bytes.
struct SortScratch {
  using Key = std::pair<std::uint64_t, std::size_t>;  // (destination, run index)
  Table<ByteRun> runs;
  Table<std::uint64_t> src_tensor, dst_tensor;
  std::vector<Key> keys, merged;
  std::vector<std::size_t> bounds, next;

  static constexpr std::size_t kKeepScratch = std::size_t{32} << 20;

  std::size_t bytes() const {
    return runs.size * sizeof(ByteRun) + (src_tensor.size + dst_tensor.size) * sizeof(std::uint64_t) +
           (keys.capacity() + merged.capacity()) * sizeof(Key);
  }
  // Rows for `n` runs at least (the walk grows them past that if it must).
  void reserve(std::size_t n) {
    if (runs.size >= n) return;
    runs.resize(n);
    src_tensor.resize(n);
    dst_tensor.resize(n);
  }
  void trim() {
    if (bytes() > kKeepScratch) *this = SortScratch{};
  }
};

inline SortScratch& sort_scratch() {
  thread_local SortScratch scratch;
  return scratch;
}

// runs[0, n) in destination order, as (destination, index) keys in s.keys. The walk
// emits each slab's runs in destination order, so the destinations come as a few
// ascending stretches (one a slab where layers interleave in the destination: SGLang's
// page_first host pool): the stretches are merged pairwise, log2(stretches) passes.
inline void by_destination(SortScratch& s, const ByteRun* runs, std::size_t n) {
  s.keys.resize(n);
  s.merged.resize(n);
  s.bounds.assign(1, 0);
  for (std::size_t k = 0; k < n; ++k) {
    s.keys[k] = {runs[k].dst, k};
    if (k > 0 && runs[k].dst < runs[k - 1].dst) s.bounds.push_back(k);
  }
  s.bounds.push_back(n);
  while (s.bounds.size() > 2) {
    s.next.assign(1, 0);
    for (std::size_t b = 0; b + 1 < s.bounds.size(); b += 2) {
      const std::size_t lo = s.bounds[b], mid = s.bounds[b + 1];
      const std::size_t hi = b + 2 < s.bounds.size() ? s.bounds[b + 2] : mid;
      std::merge(s.keys.begin() + lo, s.keys.begin() + mid, s.keys.begin() + mid, s.keys.begin() + hi,
                 s.merged.begin() + lo);
      s.next.push_back(hi);
    }
    s.keys.swap(s.merged);
    s.bounds.swap(s.next);
  }
}

// The map of the groups in `table`: its table, shrunk unless nearly full (a map held for
// long keeps little more than it needs). Shrunk to fit, the table went back to the pool
// too small for the next map of its size, whose build then grew it (a copy of all its
// groups) two groups before the end.
inline Built take(Table<RunGroup>&& table, std::size_t n, std::uint64_t runs, bool walked_in_order) {
  if (table.size > n + n / 4 + 64) table.resize(n + n / 8 + 64);
  Built out;
  out.groups = std::move(table);
  out.walked_in_order = walked_in_order;
  out.size = n;
  out.runs = runs;
  return out;
}

}  // namespace detail

// The runs of one request, as groups. `force_sort` takes the sorting path even when the
// walk is in destination order, `blocks_one_by_one` the general walk for every block
// (tests hold each path to the same answer).
inline Built build_groups(const Request& q, bool force_sort = false, bool blocks_one_by_one = false,
                          bool slabs_one_by_one = false) {
  if (q.tokens <= q.first || q.heads <= 0 || q.num_groups <= 0) return Built{};
  const std::int64_t dst_positions = (q.tokens + q.dst_block_size - 1) / q.dst_block_size;
  const std::int64_t first_position = q.first / q.dst_block_size;  // blocks before it hold no token moved
  std::vector<std::int64_t> positions(static_cast<std::size_t>(dst_positions - first_position));
  std::iota(positions.begin(), positions.end(), first_position);
  // Destination pages in memory order: by block id, then by where a page starts in it.
  const auto dst_slot = [&](std::int64_t a) { return q.dst_page_slots ? q.dst_page_slots[a] : 0; };
  std::stable_sort(positions.begin(), positions.end(), [&](std::int64_t a, std::int64_t b) {
    return q.dst_blocks[a] < q.dst_blocks[b] || (q.dst_blocks[a] == q.dst_blocks[b] && dst_slot(a) < dst_slot(b));
  });
  const auto src_tok = detail::token_offsets(q.src_blocks, q.src_page_slots, q.src_block_size, q.src_classes,
                                             q.num_src_classes, q.tokens);
  const auto dst_tok = detail::token_offsets(q.dst_blocks, q.dst_page_slots, q.dst_block_size, q.dst_classes,
                                             q.num_dst_classes, q.tokens);
  detail::Table<RunGroup> table = detail::TablePool::instance().take();
  if (!force_sort) {
    Grouper groups(&table);
    const auto end =
        detail::Walker<false>(q, positions, src_tok, dst_tok, {&groups, nullptr, nullptr, nullptr}, blocks_one_by_one,
                              slabs_one_by_one)
            .run();
    if (end.in_order) {
      groups.finish();
      return detail::take(std::move(table), groups.used(), groups.runs(), true);
    }
  }
  // The sorting path: the same walk as runs with their tensors, sorted by destination
  // and merged again.
  detail::SortScratch& s = detail::sort_scratch();
  s.reserve(detail::emissions_bound(q));
  const auto end =
      detail::Walker<true>(q, positions, src_tok, dst_tok, {nullptr, &s.runs, &s.src_tensor, &s.dst_tensor}).run();
  const ByteRun* r0 = s.runs.rows;
  const std::size_t n = end.used();
  detail::by_destination(s, r0, n);
  Grouper groups(&table);
  ByteRun run{};
  std::size_t last = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = s.keys[k].second;
    const ByteRun& r = r0[i];
    if (k > 0 && s.dst_tensor.rows[i] == s.dst_tensor.rows[last] && s.src_tensor.rows[i] == s.src_tensor.rows[last] &&
        run.dst + run.len == r.dst && run.src + run.len == r.src) {
      run.len += r.len;
      continue;
    }
    if (k > 0) groups.add(run.src, run.dst, run.len, 1, 0, 0);
    run = r;
    last = i;
  }
  if (n > 0) groups.add(run.src, run.dst, run.len, 1, 0, 0);
  s.trim();
  groups.finish();
  return detail::take(std::move(table), groups.used(), groups.runs(), false);
}

// -- validation ------------------------------------------------------------------------

// A tensor's bytes: `blocks` blocks of `block` bytes, `period` bytes apart, from `start`.
struct Span {
  std::uint64_t start, period, block, blocks;
  std::uint64_t end() const { return start + (blocks - 1) * period + block; }
  bool holds(std::uint64_t addr, std::uint64_t len) const {
    if (addr < start || addr >= end()) return false;
    const std::uint64_t off = addr - start, within = off % period;
    return off / period < blocks && within + len <= block && len <= block;
  }
};

// kSrcDstOverlap: `run` writes bytes `other` reads.
enum class Problem : int { kNone = 0, kSrcOutside = 1, kDstOutside = 2, kDstOverlap = 3, kSrcDstOverlap = 4, kEmpty = 5 };

struct Verdict {
  Problem problem = Problem::kNone;
  std::int64_t run = -1, other = -1;
};

namespace detail {

// Finds a span holding [addr, addr + len) among spans sorted by start (spans of padded,
// interleaved tensors may overlap, so earlier spans are tried too); `hint` is the last hit.
inline bool inside(const std::vector<Span>& spans, std::uint64_t addr, std::uint64_t len, std::size_t& hint) {
  if (hint < spans.size() && spans[hint].holds(addr, len)) return true;
  auto it = std::upper_bound(spans.begin(), spans.end(), addr, [](std::uint64_t a, const Span& s) { return a < s.start; });
  for (std::size_t k = static_cast<std::size_t>(it - spans.begin()); k-- > 0;) {
    if (spans[k].holds(addr, len)) {
      hint = k;
      return true;
    }
    if (spans.size() - k > 64) break;  // more overlapping spans than any registration has
  }
  return false;
}

// The per-run checks of a validation, run after run: each inside one tensor's blocks on
// each side (the spans found last tried first), and whether the destinations so far come
// in order.
struct RunChecks {
  const std::vector<Span>& src;
  const std::vector<Span>& dst;
  std::size_t src_hint = 0, dst_hint = 0;
  std::uint64_t dst_end = 0;  // the last run's
  bool any = false, dst_sorted = true;

  Problem check(const ByteRun& r) {
    if (r.len == 0) return Problem::kEmpty;
    if (!inside(src, r.src, r.len, src_hint)) return Problem::kSrcOutside;
    if (!inside(dst, r.dst, r.len, dst_hint)) return Problem::kDstOutside;
    follow(r.dst, r.dst + r.len);
    return Problem::kNone;
  }
  // Destinations [first, end) come next.
  void follow(std::uint64_t first, std::uint64_t end) {
    if (any && first < dst_end) dst_sorted = false;
    dst_end = end, any = true;
  }
};

// Two runs that overlap by `key` (their index order), or (-1, -1).
// (Sorted as (key, run) pairs: sorting run indices by a key read through them missed the
// cache on every comparison, twice as slow on half a million runs.)
template <class Key>
std::pair<std::int64_t, std::int64_t> first_overlap(const ByteRun* runs, std::size_t n, Key key) {
  std::vector<std::pair<std::uint64_t, std::size_t>> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = {key(runs[i]), i};
  std::sort(order.begin(), order.end());
  for (std::size_t k = 1; k < n; ++k) {
    const ByteRun& a = runs[order[k - 1].second];
    if (order[k].first < order[k - 1].first + a.len)
      return {static_cast<std::int64_t>(std::min(order[k - 1].second, order[k].second)),
              static_cast<std::int64_t>(std::max(order[k - 1].second, order[k].second))};
  }
  return {-1, -1};
}

inline bool spans_meet(const std::vector<Span>& a, const std::vector<Span>& b) {
  for (const Span& x : a)
    for (const Span& y : b)
      if (x.start < y.end() && y.start < x.end()) return true;
  return false;
}

}  // namespace detail

// Every run inside one source and one destination tensor's blocks, destination runs
// disjoint, and no run writing bytes another reads. Spans are sorted by start.
// `one_memory`: both sides' addresses are this process's; false where one side is a
// peer's (another address space, where its spans may repeat ours without sharing a byte).
// `dst_disjoint`: the caller knows the destinations are disjoint (a staged READ's scatter
// writes a map's runs, shown disjoint in the map's order), so out of order they are not
// sorted to check again (half a million runs: 25-50 ms).
inline Verdict validate_runs(const ByteRun* runs, std::size_t n, const std::vector<Span>& src,
                             const std::vector<Span>& dst, bool one_memory = true, bool dst_disjoint = false) {
  Verdict v;
  detail::RunChecks checks{src, dst};
  for (std::size_t i = 0; i < n; ++i) {
    const Problem p = checks.check(runs[i]);
    if (p != Problem::kNone) return {p, static_cast<std::int64_t>(i), -1};
  }
  if (!checks.dst_sorted && !dst_disjoint) {  // maps come in destination order; else sorted to check
    const auto [a, b] = detail::first_overlap(runs, n, [](const ByteRun& r) { return r.dst; });
    if (a >= 0) return {Problem::kDstOverlap, a, b};
  }
  if (one_memory && detail::spans_meet(src, dst)) {  // no run may read what another writes
    struct Edge {
      std::uint64_t at, len;
      bool write;
      std::size_t run;
    };
    std::vector<Edge> edges;
    edges.reserve(2 * n);
    for (std::size_t i = 0; i < n; ++i) {
      edges.push_back({runs[i].src, runs[i].len, false, i});
      edges.push_back({runs[i].dst, runs[i].len, true, i});
    }
    std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) { return a.at < b.at; });
    std::uint64_t write_end = 0, read_end = 0;
    std::size_t writer = 0, reader = 0;
    for (const Edge& e : edges) {
      if (e.write && e.at < read_end) return {Problem::kSrcDstOverlap, static_cast<std::int64_t>(e.run),
                                              static_cast<std::int64_t>(reader)};
      if (!e.write && e.at < write_end) return {Problem::kSrcDstOverlap, static_cast<std::int64_t>(writer),
                                                static_cast<std::int64_t>(e.run)};
      if (e.write && e.at + e.len > write_end) write_end = e.at + e.len, writer = e.run;
      if (!e.write && e.at + e.len > read_end) read_end = e.at + e.len, reader = e.run;
    }
  }
  return v;
}

namespace detail {

// Whether every run of a group lies in one block of one span, on a side where the group's
// steps never go back (so its runs lie between its first run and its last): the first
// and the last in the same block.
inline bool group_inside(const std::vector<Span>& spans, std::uint64_t first, std::uint64_t last, std::uint64_t len,
                         std::size_t& hint) {
  if (!inside(spans, first, len, hint)) return false;
  const Span& s = spans[hint];
  return s.holds(last, len) && (first - s.start) / s.period == (last - s.start) / s.period;
}

inline bool forward(std::uint64_t step) { return static_cast<std::int64_t>(step) >= 0; }

}  // namespace detail

// validate_runs over a map's groups: every run inside one tensor's blocks on each side. A
// group whose steps go forward on both sides and whose runs come in destination order is
// checked whole (its first and last runs in one block on each side); any other is read
// back a buffer at a time and checked run by run. A map whose runs do not come in
// destination order, or whose sides share memory, is read back whole and checked by
// validate_runs.
inline Verdict validate_groups(const RunGroup* groups, std::size_t n, const std::vector<Span>& src,
                               const std::vector<Span>& dst, bool one_memory = true) {
  constexpr std::size_t kChunk = 1024;
  ByteRun buf[kChunk];
  detail::RunChecks checks{src, dst};
  std::uint64_t at = 0;
  for (std::size_t g = 0; g < n; ++g) {
    const RunGroup& G = groups[g];
    const ByteRun first = G.run(0, 0), last = G.run(G.rows - 1, G.count - 1);
    const bool forward = detail::forward(G.src_step) && detail::forward(G.src_row) &&
                         detail::forward(G.dst_step) && detail::forward(G.dst_row);
    const bool ordered = G.len != 0 && forward && (G.count == 1 || G.dst_step >= G.len) &&
                         (G.rows == 1 || G.dst_row >= (G.count - 1) * G.dst_step + G.len);
    if (ordered && detail::group_inside(src, first.src, last.src, G.len, checks.src_hint) &&
        detail::group_inside(dst, first.dst, last.dst, G.len, checks.dst_hint)) {
      checks.follow(first.dst, last.dst + G.len);
      at += G.runs();
      continue;
    }
    GroupReader reader(&G, 1);
    for (std::size_t k; (k = reader.read(buf, kChunk)) != 0;) {
      for (std::size_t i = 0; i < k; ++i, ++at) {
        const Problem p = checks.check(buf[i]);
        if (p != Problem::kNone) return {p, static_cast<std::int64_t>(at), -1};
      }
    }
  }
  if (checks.dst_sorted && !(one_memory && detail::spans_meet(src, dst))) return {};
  std::vector<ByteRun> all(at);
  GroupReader(groups, n).read(all.data(), at);
  return validate_runs(all.data(), at, src, dst, one_memory);
}

// -- copying ---------------------------------------------------------------------------

namespace detail {

// Runs share(lo, hi) on up to `threads` pool threads, each a contiguous share of `total`
// bytes (of min_bytes_per_thread at least, where there are fewer); returns the threads used.
template <class Share>
int split_by_bytes(std::uint64_t total, int threads, std::uint64_t min_bytes_per_thread, Share share) {
  const std::uint64_t by_bytes = std::max<std::uint64_t>(1, total / std::max<std::uint64_t>(min_bytes_per_thread, 1));
  const int wanted = static_cast<int>(std::min<std::uint64_t>(static_cast<std::uint64_t>(std::max(threads, 1)), by_bytes));
  return transfer::WorkerPool::instance().run(wanted, [&](int part, int parts) {
    const std::uint64_t lo = total / parts * part + std::min<std::uint64_t>(part, total % parts);
    const std::uint64_t hi = lo + total / parts + (static_cast<std::uint64_t>(part) < total % parts ? 1 : 0);
    if (lo < hi) share(lo, hi);
  });
}

}  // namespace detail

// The prefetch choices (prefetch_choice.h) of the copies that no owner keeps choices for
// (a map's pair of sides keeps its own).
inline PrefetchChoices& shared_prefetch_choices() {
  static PrefetchChoices choices;
  return choices;
}

// Copies runs, whose destinations never overlap (validate_runs refuses those that do), in
// any order on up to `threads` threads of the pool, each a contiguous share of the bytes
// (a run may be split between two threads), prefetching as `mode` says (kAuto: as the
// owner's `choices` measure for this kind of copy, or the shared ones where there is no
// owner); returns the threads used.
inline int copy_runs(const ByteRun* runs, std::size_t n, int threads, std::uint64_t min_bytes_per_thread,
                     Prefetch mode = Prefetch::kAuto, PrefetchChoices* choices = nullptr) {
  if (n == 0) return 0;
  std::vector<std::uint64_t> ends(n);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) ends[i] = total += runs[i].len;
  PrefetchChoice& choice = (choices ? *choices : shared_prefetch_choices()).of(total, n, threads);
  return choice.run(mode, total, [&](bool prefetch) {
    return detail::split_by_bytes(total, threads, min_bytes_per_thread, [&](std::uint64_t lo, std::uint64_t hi) {
      std::size_t a = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
      const std::size_t b = static_cast<std::size_t>(std::lower_bound(ends.begin(), ends.end(), hi) - ends.begin());
      // runs a..b overlap [lo, hi); the first and last may be cut
      const auto piece = [&](std::size_t i) {
        const std::uint64_t start = ends[i] - runs[i].len;
        const std::uint64_t from = std::max(lo, start), to = std::min(hi, ends[i]);
        return ByteRun{runs[i].src + (from - start), runs[i].dst + (from - start), to - from};
      };
      const ByteRun head = piece(a);
      copy_byte_runs(&head, 1, prefetch, stream::Order::kAny);
      if (a == b) return;
      ++a;
      if (b > a) copy_byte_runs(runs + a, b - a, prefetch, stream::Order::kAny);
      const ByteRun tail = piece(b);
      copy_byte_runs(&tail, 1, prefetch, stream::Order::kAny);
    });
  });
}

// copy_runs over a map's groups: each thread reads its share of the runs back a buffer at
// a time (the first and last cut to the share) and copies them.
inline int copy_groups(const RunGroup* groups, std::size_t n, int threads, std::uint64_t min_bytes_per_thread,
                       Prefetch mode = Prefetch::kAuto, PrefetchChoices* choices = nullptr) {
  if (n == 0) return 0;
  std::vector<std::uint64_t> ends(n);
  std::uint64_t total = 0, runs = 0;
  for (std::size_t i = 0; i < n; ++i) ends[i] = total += groups[i].bytes(), runs += groups[i].runs();
  if (total == 0) return 0;
  PrefetchChoice& choice = (choices ? *choices : shared_prefetch_choices()).of(total, runs, threads);
  return choice.run(mode, total, [&](bool prefetch) {
    return detail::split_by_bytes(total, threads, min_bytes_per_thread, [&](std::uint64_t lo, std::uint64_t hi) {
      const auto a = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
      const std::uint64_t into = lo - (ends[a] - groups[a].bytes());
      GroupReader reader(groups, n);
      reader.seek(a, into / groups[a].len);
      std::uint64_t cut = into % groups[a].len, left = hi - lo;
      constexpr std::size_t kChunk = 1024;
      ByteRun buf[kChunk];
      while (left != 0) {
        std::size_t k = reader.read(buf, kChunk), i = 0;
        if (k == 0) return;
        buf[0].src += cut, buf[0].dst += cut, buf[0].len -= cut, cut = 0;
        for (; i < k && left != 0; ++i) {
          buf[i].len = std::min(buf[i].len, left);
          left -= buf[i].len;
        }
        copy_byte_runs(buf, i, prefetch, stream::Order::kAny);
      }
    });
  });
}

}  // namespace kvlayout::block_map
