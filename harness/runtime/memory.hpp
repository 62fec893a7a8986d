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
#include <map>
#include <mutex>
#include <vector>

#include "harness/runtime/dtype.hpp"

namespace moelab {

using CategoryBytes = std::array<std::size_t, kNumMemCategories>;

struct MemSample {
  double time;          // backend clock (seconds): wall clock on cpu/cuda, virtual on sim
  CategoryBytes in_use; // bytes in use per category just after the change
};

// An allocation made while a microbatch is current (Backend::MicrobatchScope) is also
// charged to that microbatch, so that a schedule with several microbatches in flight can
// say how much each one holds (activations of microbatch 3 at the peak, ...).
constexpr int kNoMicrobatch = -1;

class MemoryTracker {
 public:
  void on_alloc(MemCategory c, std::size_t bytes, double time, int microbatch = kNoMicrobatch);
  void on_free(MemCategory c, std::size_t bytes, double time, int microbatch = kNoMicrobatch);

  std::size_t in_use(MemCategory c) const;
  std::size_t in_use_total() const;
  // Device-side figures exclude MemCategory::host_pinned (host memory is not GPU memory).
  std::size_t device_in_use() const;
  std::size_t peak_device() const;          // highest device_in_use() ever seen
  CategoryBytes at_peak() const;            // per-category breakdown at that moment
  CategoryBytes peak_per_category() const;  // each category's own maximum
  std::vector<MemSample> timeline() const;
  // Device bytes held by each microbatch now, and each one's own maximum (since reset_peak);
  // at_peak_microbatches(): what each held at the moment of the device peak.
  std::map<int, std::size_t> microbatch_in_use() const;
  std::map<int, std::size_t> microbatch_peak() const;
  std::map<int, std::size_t> at_peak_microbatches() const;

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
  std::map<int, std::size_t> mb_in_use_, mb_peak_, mb_at_peak_;
};

}  // namespace moelab
