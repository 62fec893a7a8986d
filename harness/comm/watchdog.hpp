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
// Either way it calls on_failure(message) once, from its thread, with a message naming the
// communicator (its rank, its size, its world ranks) and the op. moelab's handler
// (make_world_communicator, harness/comm/world.cpp) prints it and aborts every rank
// (abort_world): the waiting thread cannot be woken, and the other ranks wait too.
//
// Independent of any GPU API: communicators and ops are given as callbacks
// (harness/tests/watchdog_test.cpp drives it with fakes; harness/backends/cuda/nccl_comm.cpp
// with NCCL and CUDA events).
#pragma once
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
  // then the thread ends. Without start(), nothing polls (tests call check()).
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

  Options opt_;
  std::function<void(const std::string&)> on_failure_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::uint64_t next_ = 1;
  std::map<std::uint64_t, Source> sources_;
  std::thread thread_;
};

// The timeout from the environment: MOELAB_COLLECTIVE_TIMEOUT_S (seconds, >= 0; 0 disables
// it), else `fallback`. A value that is not a number >= 0 is a ConfigError naming the variable.
double collective_timeout_from_env(double fallback = 600);

}  // namespace moelab
