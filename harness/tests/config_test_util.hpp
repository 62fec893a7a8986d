// harness/tests/config_test_util.hpp — helpers of the input-file tests (config_test,
// model_config_test): a fresh folder per test, the message of a ConfigError, and the table
// of bad files that each must be rejected with one line naming the file and the field.
#pragma once
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "harness/runtime/error.hpp"

namespace moelab::test {

namespace fs = std::filesystem;

// A fresh folder per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (auto& ch : name)
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    path_ = fs::temp_directory_path() / ("moelab_test_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(file(name)) << text;
    return file(name);
  }
  // Files whose name has ".tmp." in it: what an interrupted atomic write would leave.
  std::vector<std::string> temp_files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(path_))
      if (e.path().filename().string().find(".tmp.") != std::string::npos) out.push_back(e.path().string());
    return out;
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// The ConfigError message of f, or a marker that none was thrown.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no ConfigError>";
}

inline void expect_contains(const std::string& msg, const std::vector<std::string>& parts) {
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "expected \"" << p << "\" in: " << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
}

// One bad file: `edit` turns a valid document into it; the message must contain `expect`.
struct BadCase {
  std::string name;                           // test name
  std::function<void(nlohmann::json&)> edit;  // applied to the valid document
  std::vector<std::string> expect;            // substrings of the message (besides the file name)
};

inline void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

// Writes `valid` edited by c to a file, loads it with `load`, and checks the message: one
// line, starting with the file's path, containing every expected part.
inline void expect_rejected(const nlohmann::json& valid, const BadCase& c,
                            const std::function<void(const std::string&)>& load) {
  TempDir dir;
  nlohmann::json j = valid;
  c.edit(j);
  const auto path = dir.write("bad.json", j.dump(2));
  const std::string msg = error_of([&] { load(path); });
  expect_contains(msg, c.expect);
  EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << "message does not start with the file: " << msg;
}

}  // namespace moelab::test
