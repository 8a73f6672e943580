// A small pool for the CPU kernels: the calling thread and its workers split one loop.
//
// mlx runs a stream's primitives one after another on one thread; a decode step is a few
// hundred matmuls of 10-500 microseconds each, so waking a sleeping thread per call (tens of
// microseconds) would cost as much as the work. Workers therefore spin for a short while
// after each loop, then sleep until the next one. While spinning they yield the core every
// 64 polls: on two cores a spinning worker held one of them against mlx's stream thread,
// the Python thread building the next step and the API process (perf: 26% of a served
// decode's samples were that spin). Chunks are handed out one at a time, so a thread slowed
// by a busy core (the API process, another server) just takes fewer of them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem_kernels {

class ThreadPool {
 public:
  static ThreadPool& instance();

  // Threads that share a loop, the caller included (at least 1).
  int threads() const {
    return static_cast<int>(workers_.size()) + 1;
  }
  void resize(int threads);

  // Calls body(index) for every index in [0, count), spread over the pool; returns when all
  // are done. One loop at a time: mlx calls it from its stream's thread.
  void parallel_for(int count, const std::function<void(int)>& body);

  ~ThreadPool();

 private:
  ThreadPool() = default;
  void work();
  void stop_workers();
  // Runs chunks of loop `generation` until none is left; false if that loop is over.
  void drain(uint32_t generation);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  // (generation << 32) | next chunk: a claim fails once the caller has moved on.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<const std::function<void(int)>*> body_{nullptr};
  std::atomic<int> count_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stopping_{false};
};

}  // namespace tandem_kernels
