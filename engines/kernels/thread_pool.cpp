// The kernels' thread pool (thread_pool.h says why it spins).
#include "thread_pool.h"

#include <chrono>

#if defined(__x86_64__)
#include <immintrin.h>
#define TANDEM_PAUSE() _mm_pause()
#else
#define TANDEM_PAUSE() std::this_thread::yield()
#endif

namespace tandem_kernels {

namespace {
// Long enough to span the gaps inside a decode step (norms, attention, mlx's own ops), short
// enough that an idle server sleeps.
constexpr auto SPIN = std::chrono::microseconds(1500);

uint32_t generation_of(uint64_t ticket) {
  return static_cast<uint32_t>(ticket >> 32);
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::~ThreadPool() {
  stop_workers();
}

void ThreadPool::resize(int threads) {
  stop_workers();
  stopping_.store(false);
  for (int i = 1; i < threads; i++) {
    workers_.emplace_back([this] { work(); });
  }
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true);
  }
  wake_.notify_all();
  for (auto& worker : workers_) {
    worker.join();
  }
  workers_.clear();
}

void ThreadPool::parallel_for(int count, const std::function<void(int)>& body) {
  if (count <= 0) {
    return;
  }
  if (workers_.empty() || count == 1) {
    for (int i = 0; i < count; i++) {
      body(i);
    }
    return;
  }
  // Close the last loop (odd generation) before its body is replaced, then open this one
  // (even): a worker still holding the last loop's ticket can no longer claim a chunk.
  uint32_t closed = generation_of(ticket_.load()) | 1u;
  ticket_.store((static_cast<uint64_t>(closed) << 32) | 0xffffffffu, std::memory_order_release);
  body_.store(&body, std::memory_order_relaxed);
  count_.store(count, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  uint32_t open = closed + 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // a worker going to sleep sees it or is woken
    ticket_.store(static_cast<uint64_t>(open) << 32, std::memory_order_release);
  }
  wake_.notify_all();
  drain(open);
  while (done_.load(std::memory_order_acquire) < count) {
    TANDEM_PAUSE();
  }
}

void ThreadPool::drain(uint32_t generation) {
  uint64_t ticket = ticket_.load(std::memory_order_acquire);
  while (generation_of(ticket) == generation) {
    const int count = count_.load(std::memory_order_relaxed);
    const auto* body = body_.load(std::memory_order_relaxed);
    const int index = static_cast<int>(ticket & 0xffffffffu);
    if (index >= count) {
      return;
    }
    // Succeeds only while this loop is still open, so `body` and `count` were its own.
    if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel)) {
      (*body)(index);
      done_.fetch_add(1, std::memory_order_release);
      ticket = ticket_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::work() {
  uint32_t seen = generation_of(ticket_.load());
  auto is_new_loop = [&](uint64_t ticket) {
    uint32_t generation = generation_of(ticket);
    return generation != seen && generation % 2 == 0;
  };
  while (!stopping_.load()) {
    auto deadline = std::chrono::steady_clock::now() + SPIN;
    int polls = 0;
    while (!is_new_loop(ticket_.load(std::memory_order_acquire)) &&
           !stopping_.load(std::memory_order_relaxed)) {
      TANDEM_PAUSE();
      if (++polls % 64 != 0) {
        continue;
      }
      std::this_thread::yield();  // a thread with work on this core goes first
      if (std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] {
          return stopping_.load() || is_new_loop(ticket_.load());
        });
      }
    }
    if (stopping_.load()) {
      return;
    }
    seen = generation_of(ticket_.load(std::memory_order_acquire));
    drain(seen);
  }
}

}  // namespace tandem_kernels
