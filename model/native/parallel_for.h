// Work split over XLA's intra-op thread pool, shared by the native kernels (grouped_dot.cc,
// paged_attention.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace meshserve_native {

// Runs body(begin, end) over [0, count) in ranges of `grain` (the last one shorter), on the pool
// and this thread, and returns when every range is done. Ranges are claimed from a shared
// counter, so a task the pool starts late (or never) costs nothing but the caller's time.
template <typename Body>
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, int64_t grain,
                        const Body& body) {
  const int64_t ranges = (count + grain - 1) / grain;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), ranges - 1);
  if (helpers <= 0) {
    body(0, count);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  // Claims ranges until none is left; `body` is only reached through a claimed range, so a task
  // that starts after the call returned touches nothing of it.
  auto work = [state, ranges, count, grain, &body] {
    for (int64_t i; (i = state->next.fetch_add(1)) < ranges;) {
      body(i * grain, std::min(count, (i + 1) * grain));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([state, ranges, work] {
      if (state->next.load() < ranges) work();
    });
  work();
  while (state->done.load(std::memory_order_acquire) < ranges) std::this_thread::yield();
}

}  // namespace meshserve_native
