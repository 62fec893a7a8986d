// harness/runtime/memory.hpp — the tracked allocator's accounting: the single source of
// every memory figure moelab reports, on every backend.
//
// Bytes are charged in host program order: an allocation counts from the call that makes
// it to the call that frees it (the moment the last Tensor referring to it is destroyed).
// This is the logical footprint of the algorithm, identical on cpu, cuda and sim; the
// backends' real allocators (aligned malloc, cudaMallocAsync pools) sit underneath.
#pragma once
#include <array>
#include <cstddef>
#include <mutex>
#include <vector>

#include "harness/runtime/dtype.hpp"

namespace moelab {

using CategoryBytes = std::array<std::size_t, kNumMemCategories>;

struct MemSample {
  double time;          // backend clock (seconds): wall clock on cpu/cuda, virtual on sim
  CategoryBytes in_use; // bytes in use per category just after the change
};

class MemoryTracker {
 public:
  void on_alloc(MemCategory c, std::size_t bytes, double time);
  void on_free(MemCategory c, std::size_t bytes, double time);

  std::size_t in_use(MemCategory c) const;
  std::size_t in_use_total() const;
  // Device-side figures exclude MemCategory::host_pinned (host memory is not GPU memory).
  std::size_t device_in_use() const;
  std::size_t peak_device() const;          // highest device_in_use() ever seen
  CategoryBytes at_peak() const;            // per-category breakdown at that moment
  CategoryBytes peak_per_category() const;  // each category's own maximum
  std::vector<MemSample> timeline() const;

  // Start a new measurement window: peaks restart from the current use, timeline cleared.
  void reset_peak();

 private:
  void sample(double time);
  mutable std::mutex mu_;
  CategoryBytes in_use_{};
  CategoryBytes at_peak_{};
  CategoryBytes peak_cat_{};
  std::size_t peak_device_ = 0;
  std::vector<MemSample> timeline_;
};

}  // namespace moelab
