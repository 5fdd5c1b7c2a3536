// A small persistent thread pool shared by glm53's C++ FFI kernels (kernels/moe/csrc/qmatvec.cc,
// kernels/matmul/csrc/rowmm.cc); each kernel library holds its own pool.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <thread>

namespace glm53 {

// A small persistent pool: run(n, fn) calls fn(i) for i < n on the caller and the workers. A second caller
// while a run is in progress (XLA may run independent custom calls at once) runs its items itself.
class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) std::thread([this] { loop(); }).detach();
    n_workers_ = workers;
  }
  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || n_workers_ == 0 || n < 2) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = n_workers_;
      ++gen_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return gen_ != seen; });
        seen = gen_;
      }
      work();
      std::lock_guard<std::mutex> g(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }
  std::mutex busy_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t n_ = 0;
  int active_ = 0, n_workers_ = 0;
  uint64_t gen_ = 0;
};

inline std::atomic<Pool*>& pool_slot() {
  static std::atomic<Pool*> slot{nullptr};
  return slot;
}

// One pool per process, sized by the first call (leaked: its workers never exit). A forked child inherits the
// pool without the threads behind it, and would wait for them forever: the child's first call builds its own.
inline Pool& pool(int threads) {
  static const bool at_fork = [] {
    pthread_atfork(nullptr, nullptr, [] { pool_slot().store(nullptr); });
    return true;
  }();
  (void)at_fork;
  Pool* p = pool_slot().load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Pool* fresh = new Pool(std::max(0, threads - 1));
  // Two first callers at once: one pool wins, the other stays idle (leaked, as every pool is).
  return pool_slot().compare_exchange_strong(p, fresh, std::memory_order_acq_rel) ? *fresh : *p;
}

}  // namespace glm53
