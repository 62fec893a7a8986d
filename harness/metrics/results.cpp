// harness/metrics/results.cpp — provenance of a result (date, commit) and the atomic writer
// every result and trace file goes through (see results.hpp).
//
// Atomic means: the JSON is written to "<path>.tmp.<pid>" in the destination's own folder
// (rename is only atomic within one file system), flushed to disk with fsync, then renamed
// over <path>. A reader sees the old file or the complete new one, never a truncated one,
// and a run that fails before the end leaves nothing behind.
// Tested by harness/tests/config_test.cpp (ctest -R config).
#include "harness/metrics/results.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <stdexcept>

namespace moelab {

std::string utc_now_iso8601() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// build_commit() is generated at build time (cmake/build_info.cmake).

namespace {

[[noreturn]] void write_failed(const std::string& path, const std::string& what, int err) {
  throw std::runtime_error("cannot write " + path + ": " + what + (err ? std::string(": ") + std::strerror(err) : ""));
}

}  // namespace

std::string write_json_atomic_temp(const std::string& path) { return path + ".tmp." + std::to_string(::getpid()); }

void write_json_atomic(const std::string& path, const nlohmann::json& j, int indent) {
  namespace fs = std::filesystem;
  // Invalid UTF-8 (a device name, say) is replaced rather than making the whole write fail.
  const std::string text = j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";

  const fs::path dest(path);
  const fs::path folder = dest.has_parent_path() ? dest.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) write_failed(path, "cannot create folder " + folder.string() + " (" + ec.message() + ")", 0);

  const std::string tmp = write_json_atomic_temp(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) write_failed(path, "cannot create " + tmp, errno);

  auto abandon = [&](const std::string& what, int err, bool close_fd) {
    if (close_fd) ::close(fd);
    ::unlink(tmp.c_str());
    write_failed(path, what, err);
  };

  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      abandon("write to " + tmp + " failed", errno, true);
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) abandon("fsync of " + tmp + " failed", errno, true);
  if (::close(fd) != 0) abandon("close of " + tmp + " failed", errno, false);
  if (::rename(tmp.c_str(), path.c_str()) != 0) abandon("rename of " + tmp + " failed", errno, false);

  // Make the rename itself durable; a failure here loses nothing already visible.
  const int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace moelab
