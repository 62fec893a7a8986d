// harness/tests/watchdog_test.cpp — the collective watchdog (harness/comm/watchdog.hpp) with
// fake communicators and ops: completed ops are dropped once each; an asynchronous error and
// an op pending past the timeout are failures whose message names the communicator and the
// op; nothing is reported early; unwatching drops what is pending; the thread reports a
// failure once, and a poll that never returns is reported by the monitor.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "harness/comm/watchdog.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

using Clock = CollectiveWatchdog::Clock;
using namespace std::chrono_literals;

// A fake op: done when `done` is set; counts its drops.
struct FakeOp {
  std::atomic<bool> done{false};
  std::atomic<int> drops{0};
};

void issue(CollectiveWatchdog& w, std::uint64_t h, const std::string& name, const std::shared_ptr<FakeOp>& op,
           Clock::time_point at) {
  w.issued(h, name, [op] { return op->done.load(); }, [op] { ++op->drops; }, at);
}

CollectiveWatchdog::Options options(double timeout_s) {
  CollectiveWatchdog::Options o;
  o.timeout_s = timeout_s;
  o.period = 1ms;
  return o;
}

TEST(CollectiveWatchdog, CompletedOpsAreDroppedOnceAndHealthyIsQuiet) {
  CollectiveWatchdog w(options(10), [](const std::string&) { FAIL() << "no failure expected"; });
  const auto h = w.watch("comm A", [] { return std::string(); });
  const auto t0 = Clock::now();
  auto a = std::make_shared<FakeOp>(), b = std::make_shared<FakeOp>();
  issue(w, h, "all_to_all_v", a, t0);
  issue(w, h, "all_reduce", b, t0);
  EXPECT_EQ(w.check(t0 + 1s), "");
  EXPECT_EQ(w.pending(), 2u);
  b->done = true;  // out of issue order: ops on different streams
  EXPECT_EQ(w.check(t0 + 2s), "");
  EXPECT_EQ(w.pending(), 1u);
  EXPECT_EQ(b->drops.load(), 1);
  EXPECT_EQ(a->drops.load(), 0);
  a->done = true;
  EXPECT_EQ(w.check(t0 + 3s), "");
  EXPECT_EQ(w.check(t0 + 4s), "");
  EXPECT_EQ(w.pending(), 0u);
  EXPECT_EQ(a->drops.load(), 1);
  EXPECT_EQ(b->drops.load(), 1);
}

TEST(CollectiveWatchdog, AnAsynchronousErrorNamesTheCommunicator) {
  CollectiveWatchdog w(options(0), [](const std::string&) {});
  std::string error;
  w.watch("comm A", [] { return std::string(); });
  w.watch("NCCL communicator rank 1 of 2 (world ranks 1, 3)", [&] { return error; });
  EXPECT_EQ(w.check(Clock::now()), "");
  error = "remote process exited or there was a network error";
  const std::string m = w.check(Clock::now());
  EXPECT_NE(m.find("NCCL communicator rank 1 of 2 (world ranks 1, 3)"), std::string::npos) << m;
  EXPECT_NE(m.find("asynchronous error: remote process exited"), std::string::npos) << m;
}

TEST(CollectiveWatchdog, AnOpPendingPastTheTimeoutIsAFailureNotBefore) {
  CollectiveWatchdog w(options(30), [](const std::string&) {});
  const auto h = w.watch("comm B", [] { return std::string(); });
  const auto t0 = Clock::now();
  auto old_done = std::make_shared<FakeOp>(), stuck = std::make_shared<FakeOp>(), fresh = std::make_shared<FakeOp>();
  issue(w, h, "barrier", old_done, t0 - 100s);  // long ago, but completed
  issue(w, h, "recv", stuck, t0);
  issue(w, h, "send", fresh, t0 + 20s);
  old_done->done = true;
  EXPECT_EQ(w.check(t0 + 29s), "");
  const std::string m = w.check(t0 + 31s);
  EXPECT_NE(m.find("recv on the comm B has not completed 31 s after it was issued"), std::string::npos) << m;
  EXPECT_NE(m.find("MOELAB_COLLECTIVE_TIMEOUT_S"), std::string::npos) << m;
  EXPECT_EQ(old_done->drops.load(), 1);
}

TEST(CollectiveWatchdog, NoTimeoutWhenDisabled) {
  CollectiveWatchdog w(options(0), [](const std::string&) {});
  const auto h = w.watch("comm C", [] { return std::string(); });
  auto op = std::make_shared<FakeOp>();
  issue(w, h, "all_gather", op, Clock::now() - 24h);
  EXPECT_EQ(w.check(Clock::now()), "");
}

TEST(CollectiveWatchdog, UnwatchDropsPendingOpsAndLaterOnes) {
  auto op = std::make_shared<FakeOp>(), late = std::make_shared<FakeOp>();
  {
    CollectiveWatchdog w(options(1), [](const std::string&) {});
    const auto h = w.watch("comm D", [] { return std::string("never polled after unwatch"); });
    issue(w, h, "all_reduce", op, Clock::now() - 1h);
    w.unwatch(h);
    EXPECT_EQ(op->drops.load(), 1);
    EXPECT_EQ(w.check(Clock::now()), "");
    issue(w, h, "send", late, Clock::now());  // on a communicator no longer watched
    EXPECT_EQ(late->drops.load(), 1);
    EXPECT_EQ(w.pending(), 0u);
  }
  auto kept = std::make_shared<FakeOp>();
  {
    CollectiveWatchdog w(options(1), [](const std::string&) {});
    issue(w, w.watch("comm E", [] { return std::string(); }), "all_reduce", kept, Clock::now());
  }
  EXPECT_EQ(kept->drops.load(), 1) << "the destructor drops what is still pending";
}

// What the watchdog's thread reported: every call of on_failure, waited for with a limit.
struct Reports {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  std::string message;
  std::function<void(const std::string&)> handler() {
    return [this](const std::string& m) {
      std::lock_guard lock(mu);
      ++calls;
      message = m;
      cv.notify_all();
    };
  }
  bool wait_first() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 10s, [&] { return calls > 0; });
  }
};

TEST(CollectiveWatchdog, TheThreadReportsAFailureOnce) {
  Reports r;
  std::atomic<bool> started{false};
  CollectiveWatchdog::Options o = options(0.05);
  o.on_thread_start = [&] { started = true; };
  CollectiveWatchdog w(o, r.handler());
  const auto h = w.watch("comm F", [] { return std::string(); });
  auto op = std::make_shared<FakeOp>();
  issue(w, h, "all_to_all_v", op, Clock::now());
  w.start();
  ASSERT_TRUE(r.wait_first()) << "no failure reported";
  std::this_thread::sleep_for(50ms);
  std::lock_guard lock(r.mu);
  EXPECT_EQ(r.calls, 1);
  EXPECT_TRUE(started.load());
  EXPECT_NE(r.message.find("all_to_all_v on the comm F has not completed"), std::string::npos) << r.message;
}

// A poll stuck in the device runtime (done() blocking, as cudaEventQuery can while another
// thread waits on a stuck device) is found by the monitor, which calls nothing that can block.
TEST(CollectiveWatchdog, AStuckPollIsReportedByTheMonitor) {
  Reports r;
  std::atomic<bool> release{false};
  {
    CollectiveWatchdog w(options(0.1), r.handler());
    const auto h = w.watch("comm G", [] { return std::string(); });
    w.issued(
        h, "all_reduce",
        [&] {
          while (!release) std::this_thread::sleep_for(1ms);
          return true;
        },
        [] {}, Clock::now() + 1h);  // the op itself is never late
    w.start();
    EXPECT_TRUE(r.wait_first()) << "the stuck poll was not reported";
    release = true;  // the poll returns; the watchdog stops as it goes
  }
  std::lock_guard lock(r.mu);
  EXPECT_EQ(r.calls, 1);
  EXPECT_NE(r.message.find("poll has not returned"), std::string::npos) << r.message;
}

TEST(CollectiveWatchdog, TimeoutFromTheEnvironment) {
  ::unsetenv("MOELAB_COLLECTIVE_TIMEOUT_S");
  EXPECT_EQ(collective_timeout_from_env(600), 600);
  ::setenv("MOELAB_COLLECTIVE_TIMEOUT_S", "0", 1);
  EXPECT_EQ(collective_timeout_from_env(600), 0);
  ::setenv("MOELAB_COLLECTIVE_TIMEOUT_S", "90.5", 1);
  EXPECT_EQ(collective_timeout_from_env(600), 90.5);
  for (const char* bad : {"-1", "ten", "5s", "inf", "nan"}) {
    ::setenv("MOELAB_COLLECTIVE_TIMEOUT_S", bad, 1);
    try {
      collective_timeout_from_env(600);
      ADD_FAILURE() << bad << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("MOELAB_COLLECTIVE_TIMEOUT_S"), std::string::npos) << e.what();
    }
  }
  ::unsetenv("MOELAB_COLLECTIVE_TIMEOUT_S");
}

}  // namespace
}  // namespace moelab
