// harness/comm/communicator.cpp
#include "harness/comm/communicator.hpp"

namespace moelab {

double segments_bytes_to_others(std::span<const Segment> sends, int self, DType dtype) {
  double b = 0;
  for (const auto& s : sends)
    if (s.peer != self) b += static_cast<double>(s.count) * static_cast<double>(dtype_size(dtype));
  return b;
}

}  // namespace moelab
