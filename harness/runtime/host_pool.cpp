// harness/runtime/host_pool.cpp — the caching pinned-host allocator (see host_pool.hpp).
#include "harness/runtime/host_pool.hpp"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <utility>

namespace moelab {

HostPool::HostPool(Callbacks cb) : cb_(std::move(cb)) {
  if (!cb_.allocate || !cb_.release || !cb_.record || !cb_.done || !cb_.drop)
    throw std::invalid_argument("HostPool: every callback must be set");
}

HostPool::~HostPool() {
  for (auto& [cls, blocks] : free_)
    for (auto& b : blocks) {
      if (b.marker) cb_.drop(b.marker);
      cb_.release(b.ptr);
    }
  // A block still in use belongs to a tensor that outlived its backend; its memory goes
  // with the backend.
  for (auto& [p, cls] : in_use_) cb_.release(p);
}

std::size_t HostPool::size_class(std::size_t bytes) {
  constexpr std::size_t kMin = 512, kPow2Limit = std::size_t{1} << 20;
  if (bytes <= kMin) return kMin;
  if (bytes <= kPow2Limit) return std::bit_ceil(bytes);
  const std::size_t step = std::bit_floor(bytes) / 4;
  return (bytes + step - 1) / step * step;
}

void* HostPool::allocate(std::size_t bytes) {
  const std::size_t cls = size_class(bytes);
  std::lock_guard lock(mu_);
  void* p = nullptr;
  std::size_t got = cls;  // the class of the block handed out
  // Its own class first, then the next two: a size that moves across a class boundary from
  // step to step (routing-dependent rows) reuses what it held instead of pinning more.
  std::size_t c = cls;
  for (int k = 0; k < 1 + kLargerClasses && !p; ++k, c = size_class(c + 1)) {
    auto it = free_.find(c);
    if (it == free_.end()) continue;
    auto& blocks = it->second;
    for (auto b = blocks.begin(); b != blocks.end(); ++b) {
      if (b->marker && !cb_.done(b->marker)) continue;  // the device may still use it
      if (b->marker) cb_.drop(b->marker);
      p = b->ptr;
      got = c;
      blocks.erase(b);
      break;
    }
  }
  if (!p) {
    p = cb_.allocate(cls);
    if (!p) {  // the driver refused: give back what the cache holds idle, then try once more
      release_ready_locked();
      p = cb_.allocate(cls);
    }
    if (!p) return nullptr;
    ++stats_.raw_allocs;
    stats_.bytes_held += cls;
    stats_.peak_bytes_held = std::max(stats_.peak_bytes_held, stats_.bytes_held);
  }
  in_use_.emplace(p, got);  // free() returns it to its own class
  stats_.bytes_in_use += got;
  ++stats_.requests;
  return p;
}

void HostPool::free(void* p, StreamHandle s) {
  std::lock_guard lock(mu_);
  auto it = in_use_.find(p);
  if (it == in_use_.end()) throw std::invalid_argument("HostPool::free of a pointer it did not hand out");
  const std::size_t cls = it->second;
  in_use_.erase(it);
  stats_.bytes_in_use -= cls;
  free_[cls].push_back(Cached{p, s ? cb_.record(s) : nullptr});
}

void HostPool::empty_cache() {
  std::lock_guard lock(mu_);
  release_ready_locked();
}

void HostPool::release_ready_locked() {
  for (auto& [cls, blocks] : free_) {
    std::vector<Cached> pending;
    for (auto& b : blocks) {
      if (b.marker && !cb_.done(b.marker)) {
        pending.push_back(b);
        continue;
      }
      if (b.marker) cb_.drop(b.marker);
      cb_.release(b.ptr);
      ++stats_.raw_releases;
      stats_.bytes_held -= cls;
    }
    blocks = std::move(pending);
  }
}

HostPool::Stats HostPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace moelab
