// harness/runtime/timeline.cpp
#include "harness/runtime/timeline.hpp"

namespace moelab {

void Timeline::add(OpRecord r) {
  std::lock_guard lk(mu_);
  records_.push_back(std::move(r));
}
std::vector<OpRecord> Timeline::records() const {
  std::lock_guard lk(mu_);
  return records_;
}
void Timeline::clear() {
  std::lock_guard lk(mu_);
  records_.clear();
}

}  // namespace moelab
