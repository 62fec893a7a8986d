// harness/fuzz/fuzz_common.hpp — what every libFuzzer target of harness/fuzz shares: the
// oracle (bad input may only end in ConfigError, or OutOfMemory where a reader sizes
// something, each with a one-line message of bounded length; anything else — another
// exception, a crash, a sanitizer report, a hang — is a finding) and a scratch folder for the
// readers that take a path.
//
//   scripts/fuzz.sh                        # build (clang, ASan+UBSan) and a bounded run of each
//   build-fuzz/harness/fuzz/fuzz_workload harness/fuzz/corpus/workload -max_total_time=60
// See docs/FUZZING.md.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <typeinfo>

#include "harness/runtime/error.hpp"

namespace moelab::fuzz {

// A message of bad input is one line that a person reads in a terminal: the readers cut every
// value they quote (json_fields::show, one_line), so even a hostile file gives a short line.
constexpr std::size_t kMaxMessage = 4096;

[[noreturn]] inline void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "moelab fuzz finding: %s: %.2000s\n", what, detail.c_str());
  std::abort();
}

inline void check_message(const std::exception& e) {
  const std::string msg = e.what();
  if (msg.find('\n') != std::string::npos) finding("a message of several lines", msg);
  if (msg.size() > kMaxMessage) finding("a message longer than 4096 bytes", msg.substr(0, 300) + "...");
  if (msg.empty()) finding("an empty message", typeid(e).name());
}

// Runs `f` on the input: ConfigError (and OutOfMemory) are the expected outcomes of bad input.
template <class F>
void expect_input_errors(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    check_message(e);
  } catch (const OutOfMemory& e) {
    check_message(e);
  } catch (const std::exception& e) {
    finding((std::string("an unexpected ") + typeid(e).name()).c_str(), e.what());
  } catch (...) {
    finding("an exception of unknown type", "");
  }
}

// A folder of this process for the readers that open a path (tmpfs when there is one, so that
// a million executions do not wear a disk), removed when the fuzzer exits normally.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
    fs::path d = base / ("moelab-fuzz-" + std::to_string(::getpid()));
    fs::create_directories(d);
    std::atexit([] {
      std::error_code e;
      std::filesystem::remove_all(scratch_dir(), e);
    });
    return d;
  }();
  return dir;
}

inline std::string write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path.string();
}

inline std::string as_text(const std::uint8_t* data, std::size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace moelab::fuzz
