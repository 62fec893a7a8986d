// harness/runtime/memory.cpp
#include "harness/runtime/memory.hpp"

#include "harness/runtime/error.hpp"

namespace moelab {

namespace {
std::size_t device_sum(const CategoryBytes& b) {
  std::size_t s = 0;
  for (int c = 0; c < kNumMemCategories; ++c)
    if (c != static_cast<int>(MemCategory::host_pinned)) s += b[static_cast<std::size_t>(c)];
  return s;
}
}  // namespace

void MemoryTracker::on_alloc(MemCategory c, std::size_t bytes, double time, int microbatch) {
  std::lock_guard lk(mu_);
  auto& cur = in_use_[static_cast<std::size_t>(c)];
  cur += bytes;
  auto& pk = peak_cat_[static_cast<std::size_t>(c)];
  if (cur > pk) pk = cur;
  if (microbatch != kNoMicrobatch && c != MemCategory::host_pinned) {
    auto& m = mb_in_use_[microbatch];
    m += bytes;
    auto& mp = mb_peak_[microbatch];
    if (m > mp) mp = m;
  }
  const std::size_t dev = device_sum(in_use_);
  if (dev > peak_device_) {
    peak_device_ = dev;
    at_peak_ = in_use_;
    mb_at_peak_ = mb_in_use_;
  }
  sample(time);
}

void MemoryTracker::on_free(MemCategory c, std::size_t bytes, double time, int microbatch) {
  std::lock_guard lk(mu_);
  auto& cur = in_use_[static_cast<std::size_t>(c)];
  MOELAB_CHECK(cur >= bytes, std::string("freeing more ") + category_name(c) + " bytes than allocated");
  cur -= bytes;
  if (microbatch != kNoMicrobatch && c != MemCategory::host_pinned) {
    auto it = mb_in_use_.find(microbatch);
    MOELAB_CHECK(it != mb_in_use_.end() && it->second >= bytes,
                 "freeing more bytes of microbatch " + std::to_string(microbatch) + " than allocated");
    it->second -= bytes;
  }
  sample(time);
}

void MemoryTracker::sample(double time) { timeline_.push_back({time, in_use_}); }

std::size_t MemoryTracker::in_use(MemCategory c) const {
  std::lock_guard lk(mu_);
  return in_use_[static_cast<std::size_t>(c)];
}
std::size_t MemoryTracker::in_use_total() const {
  std::lock_guard lk(mu_);
  std::size_t s = 0;
  for (auto b : in_use_) s += b;
  return s;
}
std::size_t MemoryTracker::device_in_use() const {
  std::lock_guard lk(mu_);
  return device_sum(in_use_);
}
std::size_t MemoryTracker::peak_device() const {
  std::lock_guard lk(mu_);
  return peak_device_;
}
CategoryBytes MemoryTracker::at_peak() const {
  std::lock_guard lk(mu_);
  return at_peak_;
}
CategoryBytes MemoryTracker::peak_per_category() const {
  std::lock_guard lk(mu_);
  return peak_cat_;
}
std::vector<MemSample> MemoryTracker::timeline() const {
  std::lock_guard lk(mu_);
  return timeline_;
}
std::map<int, std::size_t> MemoryTracker::microbatch_in_use() const {
  std::lock_guard lk(mu_);
  return mb_in_use_;
}
std::map<int, std::size_t> MemoryTracker::microbatch_peak() const {
  std::lock_guard lk(mu_);
  return mb_peak_;
}
std::map<int, std::size_t> MemoryTracker::at_peak_microbatches() const {
  std::lock_guard lk(mu_);
  return mb_at_peak_;
}
void MemoryTracker::reset_peak() {
  std::lock_guard lk(mu_);
  mb_peak_ = mb_in_use_;
  mb_at_peak_ = mb_in_use_;
  peak_cat_ = in_use_;
  at_peak_ = in_use_;
  peak_device_ = device_sum(in_use_);
  timeline_.clear();
}

}  // namespace moelab
