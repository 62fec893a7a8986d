// harness/comm/watchdog.hpp — a watchdog for collectives that a device runs asynchronously
// (NCCL), as PyTorch's ProcessGroupNCCL has one (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp).
//
// An NCCL collective that cannot complete does not fail: its kernel waits for the peer, and the
// host waits for the kernel in a stream synchronisation that never returns, so no error can be
// caught and no rank exits. Two cases, both found by polling from a thread of its own:
//   - the communicator reports an asynchronous error (ncclCommGetAsyncError: a connection to
//     a peer lost, a remote failure, an internal error of NCCL's proxy thread);
//   - an op has not completed `timeout_s` after it was issued: a peer process that died or hangs
//     where no network notices it (NVLink and shared-memory transports never report one), or a
//     rank that skipped a collective the others issued.
// The polls themselves call into the device runtime (cudaEventQuery), which may block while
// another thread holds its lock waiting for the stuck device (a cudaFree, a cudaFreeHost), as
// PyTorch found (its "heartbeat monitor"). So a second thread, which calls nothing but the
// clock, checks that polls keep completing: one that has not returned `timeout_s` after it
// began is a failure too.
// Either way it calls on_failure(message) once, from its thread, with a message naming the
// communicator (its rank, its size, its world ranks) and the op. moelab's handler
// (make_world_communicator, harness/comm/world.cpp) prints it and aborts every rank
// (abort_world): the waiting thread cannot be woken, and the other ranks wait too.
//
// Independent of any GPU API: communicators and ops are given as callbacks
// (harness/tests/watchdog_test.cpp drives it with fakes; harness/backends/cuda/nccl_comm.cpp
// with NCCL and CUDA events).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moelab {

class CollectiveWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    double timeout_s = 600;  // an op pending this long is a failure; 0: no limit (errors only)
    std::chrono::milliseconds period{200};  // how often the thread polls
    std::function<void()> on_thread_start;  // run first on the thread (cuda: select the device)
  };

  CollectiveWatchdog(Options o, std::function<void(const std::string&)> on_failure);
  ~CollectiveWatchdog();  // stops the thread; drops every op still held
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // A communicator to poll, named for messages ("NCCL communicator rank 1 of 2 (world ranks
  // 1, 3)"); async_error() returns "" while it is healthy, else what went wrong. It is called
  // from the watchdog's thread. Returns the handle for issued() and unwatch().
  std::uint64_t watch(std::string name, std::function<std::string()> async_error);
  // Forgets the communicator and drops its pending ops (call before destroying it).
  void unwatch(std::uint64_t handle);

  // An op issued on communicator `handle` at `at`: done() says, without blocking, whether it
  // has completed (it is called from the watchdog's thread); drop() is called exactly once,
  // when the watchdog no longer needs the op (completed, unwatched, or the watchdog destroyed).
  void issued(std::uint64_t handle, std::string op, std::function<bool()> done, std::function<void()> drop,
              Clock::time_point at = Clock::now());

  // One poll at `now`: drops the completed ops; returns the first failure's message, or "".
  std::string check(Clock::time_point now);

  // Starts the thread: check() every period; at the first failure, on_failure(message) once,
  // then the thread ends. With a timeout, also the monitor of the polls. Without start(),
  // nothing polls (tests call check()).
  void start();

  std::size_t pending() const;  // ops not yet seen completed

 private:
  struct Op {
    std::string name;
    std::function<bool()> done;
    std::function<void()> drop;
    Clock::time_point at;
  };
  struct Source {
    std::string name;
    std::function<std::string()> async_error;
    std::vector<Op> ops;  // in issue order
  };
  void run();
  void monitor();
  bool next_period();  // sleeps one period; false once stopping or failed
  void fail(const std::string& message);  // on_failure once, whichever thread finds it first

  Options opt_;
  std::function<void(const std::string&)> on_failure_;
  mutable std::mutex mu_;  // sources_ and next_; held while a poll calls done() and async_error()
  // The threads sleep on their own lock: the monitor must not wait for a poll stuck under mu_.
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::uint64_t next_ = 1;
  std::map<std::uint64_t, Source> sources_;
  std::thread thread_, monitor_;
  std::atomic<bool> failed_{false};
  // When the poll in progress began (steady clock ticks), or 0 between polls.
  std::atomic<Clock::rep> poll_began_{0};
};

// The timeout from the environment: MOELAB_COLLECTIVE_TIMEOUT_S (seconds, >= 0; 0 disables
// it), else `fallback`. A value that is not a number >= 0 is a ConfigError naming the variable.
double collective_timeout_from_env(double fallback = 600);

}  // namespace moelab
