// harness/runtime/host_pool.hpp — a caching allocator for pinned host memory, independent of
// any GPU API (tested by harness/tests/host_pool_test.cpp with a fake allocator).
//
// Pinning and unpinning host memory is expensive, and on CUDA releasing it synchronises the
// whole device (cudaFreeHost waits for every stream), which stalls an offloading step that
// frees a buffer while copies are in flight. The pool does what PyTorch's
// CachingHostAllocator does (c10/cuda/CachingHostAllocator.cpp):
//   - a request is rounded up to a size class and served from that class's free list;
//     only an empty list goes to the driver ("raw" allocation);
//   - a freed block is not reusable at once: the device may still be copying from or into
//     it. free() records a completion marker on the stream the allocation was ordered on
//     (moelab's stream-ordered rule: every other stream that used the block is ordered
//     before that point), and the block is handed out again only once the marker reports
//     completion. Nothing blocks: a block whose marker is pending is skipped;
//   - memory goes back to the driver only in empty_cache() and in the destructor.
// So after a warm-up step, a step that repeats the same pattern of requests makes no raw
// allocation at all.
//
// Size classes: the next power of two up to 1 MiB (at least 512 B); above, the next of four
// equal steps between two powers of two (at most 25 % slack, instead of up to 100 % for
// large offload buffers). A request takes a ready block of its own class, else one of the
// next kLargerClasses classes (no splitting): a buffer whose size moves across a class
// boundary from step to step (an MoE layer's routed rows) reuses its block instead of pinning
// another, at the cost of some slack (at most 4x below 1 MiB, about 1.6x above).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace moelab {

class HostPool {
 public:
  // An opaque completion marker (a cudaEvent_t on the cuda backend) and an opaque stream.
  using Marker = void*;
  using StreamHandle = const void*;

  struct Callbacks {
    std::function<void*(std::size_t bytes)> allocate;  // raw pinned bytes, or nullptr on failure
    std::function<void(void* p)> release;              // give raw bytes back to the driver
    std::function<Marker(StreamHandle s)> record;      // a marker that completes when s reaches this point
    std::function<bool(Marker m)> done;                // has it completed? (never blocks)
    std::function<void(Marker m)> drop;                // the pool no longer needs the marker
  };

  struct Stats {
    std::size_t bytes_held = 0;       // obtained from the driver and not yet released (class sizes)
    std::size_t bytes_in_use = 0;     // handed out and not yet freed (class sizes)
    std::size_t peak_bytes_held = 0;
    std::uint64_t requests = 0;       // allocate() calls served
    std::uint64_t raw_allocs = 0;     // calls of Callbacks::allocate that succeeded
    std::uint64_t raw_releases = 0;   // calls of Callbacks::release
  };

  explicit HostPool(Callbacks cb);
  // Releases every block, cached or not: call it once no stream uses pool memory any more
  // (the backend synchronises its streams first).
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // At least `bytes` (> 0) of pinned memory, or nullptr if the driver refuses even after the
  // completed cached blocks were released.
  void* allocate(std::size_t bytes);
  // Returns p (from allocate) to its class; reusable once work issued on `s` up to now has
  // completed. s == nullptr: no device work can touch it, reusable at once.
  void free(void* p, StreamHandle s);
  // Releases every cached block whose marker has completed; blocks in use or still pending
  // stay.
  void empty_cache();

  Stats stats() const;
  static std::size_t size_class(std::size_t bytes);
  static constexpr int kLargerClasses = 2;  // how many classes above its own a request may take

 private:
  struct Cached {
    void* ptr;
    Marker marker;  // nullptr: reusable now
  };
  void release_ready_locked();

  Callbacks cb_;
  mutable std::mutex mu_;
  std::map<std::size_t, std::vector<Cached>> free_;   // class size -> cached blocks, oldest first
  std::unordered_map<void*, std::size_t> in_use_;      // pointer -> its block's class size
  Stats stats_;
};

}  // namespace moelab
