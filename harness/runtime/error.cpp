// harness/runtime/error.cpp
#include "harness/runtime/error.hpp"

#include <sstream>

namespace moelab {

void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << "internal error: " << msg << " (" << expr << " at " << file << ":" << line << ")";
  throw std::logic_error(os.str());
}

}  // namespace moelab
