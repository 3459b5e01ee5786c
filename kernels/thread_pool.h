#pragma once

// A fixed set of worker threads for data-parallel kernel loops. ParallelFor splits [0, n) into
// chunks taken dynamically; the calling thread works too and returns when every chunk is done.
// Thread-safe; one ParallelFor at a time per pool (callers serialize, as a stream does).
//
// Each participant has a worker index in [0, threads()): the caller is 0. Kernels that need
// scratch take it from caller-provided workspace, one slice per worker index.

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace kvpool::kernels {

class ThreadPool final {
 public:
  // `threads` counts the caller: 1 runs everything on the caller. 0 = hardware concurrency.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) over disjoint ranges covering [0, n), `grain` items at a time.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
  // The same, with the index of the worker running each range: fn(worker, begin, end). No two
  // calls with the same worker index run at once.
  using WorkerFn = std::function<void(int, int64_t, int64_t)>;
  void ParallelForWorker(int64_t n, int64_t grain, const WorkerFn& fn);

 private:
  void WorkerLoop(int worker);
  void RunChunks(int worker);

  absl::Mutex mu_;
  std::vector<std::thread> workers_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumps per ParallelFor
  int busy_ ABSL_GUARDED_BY(mu_) = 0;             // workers inside the current job
  // The current job (read by workers after they see a new generation).
  const WorkerFn* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
  std::atomic<int64_t> next_{0};
};

}  // namespace kvpool::kernels
