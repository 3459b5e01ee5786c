#include "kernels/thread_pool.h"

#include <algorithm>

namespace kvpool::kernels {
namespace {

struct WaitForJob {
  const bool* stop;
  const uint64_t* generation;
  uint64_t seen;
  static bool Ready(WaitForJob* w) { return *w->stop || *w->generation != w->seen; }
};

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunks(int worker) {
  for (;;) {
    const int64_t begin = next_.fetch_add(grain_, std::memory_order_relaxed);
    if (begin >= n_) return;
    (*fn_)(worker, begin, std::min(n_, begin + grain_));
  }
}

void ThreadPool::WorkerLoop(int worker) {
  WaitForJob wait{&stop_, &generation_, 0};
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&WaitForJob::Ready, &wait));
      if (stop_) return;
      wait.seen = generation_;
      ++busy_;  // the job's parameters cannot change while busy_ > 0
    }
    RunChunks(worker);
    absl::MutexLock lock(&mu_);
    --busy_;
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  ParallelForWorker(n, grain, [&fn](int, int64_t begin, int64_t end) { fn(begin, end); });
}

void ThreadPool::ParallelForWorker(int64_t n, int64_t grain, const WorkerFn& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (workers_.empty() || n <= grain) {
    fn(0, 0, n);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    // A worker that woke late for the previous job may still be looking at its parameters.
    mu_.Await(absl::Condition(
        +[](int* busy) { return *busy == 0; }, &busy_));
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    next_.store(0, std::memory_order_relaxed);
    ++generation_;
  }
  RunChunks(0);
  // Every chunk has been taken; wait for the workers still running one.
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* busy) { return *busy == 0; }, &busy_));
}

}  // namespace kvpool::kernels
