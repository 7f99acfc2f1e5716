#pragma once
// A persistent pool of worker threads for the CPU block transfer.
//
// Threads are created on first use and reused by every later call (no thread per call),
// grown on demand up to a cap. A batch runs on the calling thread plus up to n-1
// workers. If the system refuses a thread (memory or pid limits), the pool keeps the
// threads it has and the batch runs on fewer: the process never aborts. One batch runs
// at a time; a caller that finds the pool busy (another Python thread, GIL released)
// runs its batch alone on its own thread instead of waiting. After fork() the child
// starts with an empty pool (the parent's threads do not exist there).

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>

namespace kvlayout::transfer {

class WorkerPool {
 public:
  // The pool never exits: leaked on purpose, so no thread is joined or destroyed while
  // the interpreter shuts down.
  static WorkerPool& instance() {
    static WorkerPool* pool = [] {
      auto* p = new WorkerPool();
      pthread_atfork(nullptr, nullptr, [] { WorkerPool::instance().reset_after_fork(); });
      return p;
    }();
    return *pool;
  }

  // The most threads a batch may use: the hardware's count (at least 1), at most 256.
  static int max_threads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp<unsigned>(hw == 0 ? 1u : hw, 1u, 256u));
  }

  // Calls task(i, n) for i in [0, n) with n <= wanted threads, the caller included, and
  // returns n (the number of parts the work was split into).
  int run(int wanted, const std::function<void(int, int)>& task) {
    wanted = std::clamp(wanted, 1, max_threads());
    if (wanted == 1) return serial(task);
    std::unique_lock<std::mutex> batch(batch_mu_, std::try_to_lock);
    if (!batch.owns_lock()) return serial(task);
    const int n = 1 + grow(wanted - 1);
    if (n == 1) return serial(task);
    std::unique_lock<std::mutex> lk(mu_);
    task_ = &task;
    parts_ = n;
    next_ = 0;
    pending_ = n;
    ++generation_;
    lk.unlock();
    cv_.notify_all();
    lk.lock();
    work(lk);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    task_ = nullptr;
    return n;
  }

  int num_workers() {
    std::lock_guard<std::mutex> lk(mu_);
    return workers_;
  }

 private:
  WorkerPool() = default;

  static int serial(const std::function<void(int, int)>& task) {
    task(0, 1);
    return 1;
  }

  // Claims parts of the current batch until none is left (mu_ held on entry and exit).
  void work(std::unique_lock<std::mutex>& lk) {
    while (task_ != nullptr && next_ < parts_) {
      const int i = next_++;
      const auto* task = task_;
      const int n = parts_;
      lk.unlock();
      (*task)(i, n);
      lk.lock();
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    std::uint64_t seen = generation_;
    for (;;) {
      cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      work(lk);
    }
  }

  // Tries to have at least `wanted` workers; returns how many there are (fewer when the
  // system refuses a thread).
  int grow(int wanted) {
    std::lock_guard<std::mutex> lk(mu_);
    while (workers_ < wanted) {
      try {
        std::thread([this] { loop(); }).detach();
      } catch (const std::system_error&) {
        break;
      } catch (const std::bad_alloc&) {
        break;
      }
      ++workers_;
    }
    return std::min(workers_, wanted);
  }

  // In a forked child only the forking thread exists: forget the parent's workers and
  // rebuild the locks, which another thread may have held at the fork.
  void reset_after_fork() {
    new (&mu_) std::mutex();
    new (&batch_mu_) std::mutex();
    new (&cv_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    workers_ = 0;
    task_ = nullptr;
    parts_ = next_ = pending_ = 0;
  }

  std::mutex batch_mu_;  // one batch at a time
  std::mutex mu_;        // everything below
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  int workers_ = 0;
  const std::function<void(int, int)>* task_ = nullptr;
  int parts_ = 0;
  int next_ = 0;
  int pending_ = 0;
  std::uint64_t generation_ = 0;
};

}  // namespace kvlayout::transfer
