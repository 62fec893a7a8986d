// harness/comm/watchdog.cpp — see watchdog.hpp.
#include "harness/comm/watchdog.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

// "42 s ... (MOELAB_COLLECTIVE_TIMEOUT_S sets the limit, 0 disables it)": the tail of a timeout.
std::string after_seconds(double age, const std::string& what) {
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.0f", age);
  return secs + (" s" + what) + " (MOELAB_COLLECTIVE_TIMEOUT_S sets the limit, 0 disables it)";
}

}  // namespace

CollectiveWatchdog::CollectiveWatchdog(Options o, std::function<void(const std::string&)> on_failure)
    : opt_(std::move(o)), on_failure_(std::move(on_failure)) {}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (monitor_.joinable()) monitor_.join();
  for (auto& [h, src] : sources_)
    for (auto& op : src.ops) op.drop();
}

std::uint64_t CollectiveWatchdog::watch(std::string name, std::function<std::string()> async_error) {
  std::lock_guard lock(mu_);
  const std::uint64_t h = next_++;
  sources_.emplace(h, Source{std::move(name), std::move(async_error), {}});
  return h;
}

void CollectiveWatchdog::unwatch(std::uint64_t handle) {
  std::vector<Op> ops;
  {
    std::lock_guard lock(mu_);
    auto it = sources_.find(handle);
    if (it == sources_.end()) return;
    ops = std::move(it->second.ops);
    sources_.erase(it);
  }
  for (auto& op : ops) op.drop();
}

void CollectiveWatchdog::issued(std::uint64_t handle, std::string op, std::function<bool()> done,
                                std::function<void()> drop, Clock::time_point at) {
  std::unique_lock lock(mu_);
  auto it = sources_.find(handle);
  if (it == sources_.end()) {
    lock.unlock();
    drop();
    return;
  }
  it->second.ops.push_back(Op{std::move(op), std::move(done), std::move(drop), at});
}

std::string CollectiveWatchdog::check(Clock::time_point now) {
  std::vector<std::function<void()>> drops;
  std::string failure;
  {
    std::lock_guard lock(mu_);
    for (auto& [h, src] : sources_) {
      std::vector<Op> left;
      for (auto& op : src.ops) {
        if (op.done())
          drops.push_back(std::move(op.drop));
        else
          left.push_back(std::move(op));
      }
      src.ops = std::move(left);
      if (!failure.empty()) continue;
      if (std::string err = src.async_error(); !err.empty()) {
        failure = src.name + " reported an asynchronous error: " + err;
        continue;
      }
      if (opt_.timeout_s > 0 && !src.ops.empty()) {
        // The oldest pending op: ops on one stream complete in issue order, and any op pending
        // this long means the communicator is stuck.
        const Op* oldest = &src.ops.front();
        for (const auto& op : src.ops)
          if (op.at < oldest->at) oldest = &op;
        const double age = std::chrono::duration<double>(now - oldest->at).count();
        if (age >= opt_.timeout_s)
          failure = oldest->name + " on the " + src.name + " has not completed " +
                    after_seconds(age, " after it was issued: a peer rank has failed or is not taking part in it");
      }
    }
  }
  for (auto& d : drops) d();
  return failure;
}

std::size_t CollectiveWatchdog::pending() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& [h, src] : sources_) n += src.ops.size();
  return n;
}

void CollectiveWatchdog::start() {
  std::lock_guard lock(stop_mu_);
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { run(); });
  if (opt_.timeout_s > 0) monitor_ = std::thread([this] { monitor(); });
}

void CollectiveWatchdog::fail(const std::string& message) {
  if (!failed_.exchange(true)) on_failure_(message);
}

bool CollectiveWatchdog::next_period() {
  std::unique_lock lock(stop_mu_);
  stop_cv_.wait_for(lock, opt_.period, [this] { return stop_; });
  return !stop_ && !failed_;
}

void CollectiveWatchdog::run() {
  if (opt_.on_thread_start) opt_.on_thread_start();
  while (next_period()) {
    const Clock::time_point now = Clock::now();
    poll_began_ = now.time_since_epoch().count();
    const std::string failure = check(now);
    poll_began_ = 0;
    if (!failure.empty()) return fail(failure);
  }
}

void CollectiveWatchdog::monitor() {
  while (next_period()) {
    const Clock::rep began = poll_began_;
    if (began == 0) continue;
    const double age = std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(began)).count();
    if (age >= opt_.timeout_s)
      return fail("the collective watchdog's poll has not returned in " +
                  after_seconds(age, ": the device runtime is blocked (a collective that cannot complete, while the "
                                     "host waits on the device)"));
  }
}

double collective_timeout_from_env(double fallback) {
  const char* v = std::getenv("MOELAB_COLLECTIVE_TIMEOUT_S");
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const double s = std::strtod(v, &end);
  if (errno != 0 || end == v || *end != '\0' || !std::isfinite(s) || s < 0)
    throw ConfigError(std::string("MOELAB_COLLECTIVE_TIMEOUT_S = \"") + v +
                      "\": expected a number of seconds >= 0 (0 disables the collective timeout)");
  return s;
}

}  // namespace moelab
