// harness/runtime/error.hpp — the error types every moelab component throws.
//
// ConfigError  bad user input (workload/model/cluster files, CLI flags): exit code 2, the
//              message names the field and the offending value.
// CommError    a collective failed; the message names the rank and the call.
// Unsupported  a valid request this backend cannot serve (bf16 on cpu, for example).
// OutOfMemory  the device (real, or the sim's GPU model) has no room for an allocation: exit
//              code 3, the message names the rank, the request and the capacity.
#pragma once
#include <stdexcept>
#include <string>

namespace moelab {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// MOELAB_CHECK: an internal invariant (a bug in moelab, never bad user input).
[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& msg);
#define MOELAB_CHECK(cond, msg)                                                   \
  do {                                                                            \
    if (!(cond)) ::moelab::check_failed(#cond, __FILE__, __LINE__, (msg));       \
  } while (0)

}  // namespace moelab
