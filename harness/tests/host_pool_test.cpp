// harness/tests/host_pool_test.cpp — the caching pinned-host allocator's policy
// (harness/runtime/host_pool.hpp) against a fake driver that counts its calls and fake
// completion markers that the test completes by hand. No GPU needed.
//   ctest --test-dir build -R host_pool_test
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "harness/runtime/host_pool.hpp"

namespace moelab {
namespace {

// A fake driver: "pinned" memory is malloc'd, each marker is a flag the test sets; a stream
// is any pointer, and complete(s) completes every marker recorded on s so far.
struct FakeDriver {
  int allocs = 0, releases = 0, records = 0, drops = 0;
  bool refuse = false;  // the next raw allocations fail
  std::set<void*> live;
  std::vector<std::unique_ptr<std::pair<const void*, bool>>> markers;  // (stream, done)

  HostPool::Callbacks callbacks() {
    HostPool::Callbacks cb;
    cb.allocate = [this](std::size_t bytes) -> void* {
      if (refuse) return nullptr;
      ++allocs;
      void* p = std::malloc(bytes);
      live.insert(p);
      return p;
    };
    cb.release = [this](void* p) {
      ++releases;
      EXPECT_EQ(live.erase(p), 1u) << "released twice or never allocated";
      std::free(p);
    };
    cb.record = [this](HostPool::StreamHandle s) -> HostPool::Marker {
      ++records;
      markers.push_back(std::make_unique<std::pair<const void*, bool>>(s, false));
      return markers.back().get();
    };
    cb.done = [](HostPool::Marker m) { return static_cast<std::pair<const void*, bool>*>(m)->second; };
    cb.drop = [this](HostPool::Marker) { ++drops; };
    return cb;
  }
  void complete(const void* stream) {
    for (auto& m : markers)
      if (m->first == stream) m->second = true;
  }
};

char streams[2];  // two fake streams: only their addresses matter
const void* const A = &streams[0];
const void* const B = &streams[1];

TEST(HostPool, SizeClasses) {
  EXPECT_EQ(HostPool::size_class(1), 512u);
  EXPECT_EQ(HostPool::size_class(512), 512u);
  EXPECT_EQ(HostPool::size_class(513), 1024u);
  EXPECT_EQ(HostPool::size_class(1000), 1024u);
  EXPECT_EQ(HostPool::size_class(1 << 20), 1u << 20);
  // Above 1 MiB: quarter steps between powers of two.
  EXPECT_EQ(HostPool::size_class((1 << 20) + 1), (1u << 20) + (1u << 18));
  EXPECT_EQ(HostPool::size_class(3u << 20), 3u << 20);
  EXPECT_EQ(HostPool::size_class((3u << 20) + 1), (3u << 20) + (1u << 19));
  EXPECT_EQ(HostPool::size_class(100'000'000), 100'663'296u);  // 64 Mi * 1.5
  for (std::size_t b : {1u, 600u, 5000u, 1u << 21, 123'456'789u}) {
    EXPECT_GE(HostPool::size_class(b), b);
    EXPECT_LE(HostPool::size_class(b), std::max<std::size_t>(512, b <= (1u << 20) ? 2 * b : b + b / 4));
  }
}

TEST(HostPool, ReusesBySizeClass) {
  FakeDriver d;
  HostPool pool(d.callbacks());
  void* p = pool.allocate(1000);
  pool.free(p, nullptr);  // no stream: reusable at once
  EXPECT_EQ(pool.allocate(700), p);  // same class (1 KiB)
  void* q = pool.allocate(1000);     // p is in use: a new block
  EXPECT_NE(q, p);
  pool.free(q, nullptr);
  EXPECT_NE(pool.allocate(5000), q);  // a smaller block never serves a larger request
  EXPECT_EQ(d.allocs, 3);
}

// A size that moves across class boundaries (an MoE layer's routed rows from step to step)
// takes a ready block of up to two classes above its own before going to the driver, and the
// block goes back to its own class; three classes above is too far.
TEST(HostPool, TakesABlockOfUpToTwoLargerClasses) {
  FakeDriver d;
  HostPool pool(d.callbacks());
  const std::size_t big = 5u << 20;  // 5 MiB: the classes below it are 4, 3.5 and 3 MiB
  void* p = pool.allocate(big);
  pool.free(p, nullptr);
  void* q = pool.allocate((7u << 19) - 100);  // the 3.5 MiB class, whose next two are 4 and 5 MiB
  EXPECT_EQ(q, p);
  EXPECT_EQ(pool.stats().bytes_in_use, big);  // counted at the block's own class
  pool.free(q, nullptr);
  EXPECT_EQ(pool.allocate(big), p);           // back in its own class
  pool.free(p, nullptr);
  void* r = pool.allocate(3u << 20);          // 3 MiB: three classes below 5 MiB
  EXPECT_NE(r, p);
  EXPECT_EQ(d.allocs, 2);
  // Its own class first: with a ready block of each, the exact one is taken.
  pool.free(r, nullptr);
  EXPECT_EQ(pool.allocate(3u << 20), r);
  EXPECT_EQ(pool.allocate(big), p);
}

TEST(HostPool, NoReuseBeforeTheMarkerCompletes) {
  FakeDriver d;
  HostPool pool(d.callbacks());
  void* p = pool.allocate(4096);
  pool.free(p, A);
  EXPECT_EQ(d.records, 1);
  void* q = pool.allocate(4096);  // stream A has not passed the free: p must not come back
  EXPECT_NE(q, p);
  d.complete(B);  // another stream completing says nothing about A
  pool.free(q, B);
  d.complete(B);
  EXPECT_EQ(pool.allocate(4096), q);  // q's marker (on B) completed, p's (on A) did not
  void* r = pool.allocate(4096);
  EXPECT_NE(r, p);
  d.complete(A);
  pool.free(r, nullptr);
  // Both p (now complete) and r are free; the oldest comes first.
  EXPECT_EQ(pool.allocate(4096), p);
  EXPECT_EQ(pool.allocate(4096), r);
  EXPECT_EQ(d.allocs, 3);
  EXPECT_EQ(d.drops, 2);  // p's and q's markers, once each
}

// An offloading step: per layer, buffers of three sizes are taken in forward and freed in
// backward on two streams; the device completes everything by the end of the step.
void offload_step(HostPool& pool, FakeDriver& d) {
  const std::size_t sizes[] = {3000, 70'000, 5'000'000};
  std::vector<std::pair<void*, const void*>> held;
  for (int layer = 0; layer < 4; ++layer)
    for (std::size_t s : sizes) held.emplace_back(pool.allocate(s + static_cast<std::size_t>(layer)), layer % 2 ? A : B);
  while (!held.empty()) {
    pool.free(held.back().first, held.back().second);
    held.pop_back();
    // A reload before the next free: the device has not finished with what was just freed.
    void* tmp = pool.allocate(70'000);
    pool.free(tmp, A);
  }
  d.complete(A);
  d.complete(B);
}

TEST(HostPool, SecondIdenticalStepMakesNoRawAllocation) {
  FakeDriver d;
  HostPool pool(d.callbacks());
  offload_step(pool, d);
  const int warm = d.allocs;
  EXPECT_GT(warm, 12);  // the step's 12 buffers plus reload blocks whose markers were pending
  const auto before = pool.stats();
  offload_step(pool, d);
  EXPECT_EQ(d.allocs, warm);
  EXPECT_EQ(pool.stats().raw_allocs, before.raw_allocs);
  EXPECT_EQ(pool.stats().bytes_held, before.bytes_held);
  EXPECT_EQ(pool.stats().requests, 2 * before.requests);
  EXPECT_EQ(d.releases, 0);  // nothing goes back to the driver before empty_cache()
}

TEST(HostPool, StatisticsCountBytesAndCalls) {
  FakeDriver d;
  HostPool pool(d.callbacks());
  void* a = pool.allocate(1000);            // 1 KiB class
  void* b = pool.allocate(3u << 20);        // 3 MiB class
  auto st = pool.stats();
  EXPECT_EQ(st.bytes_in_use, 1024u + (3u << 20));
  EXPECT_EQ(st.bytes_held, 1024u + (3u << 20));
  EXPECT_EQ(st.raw_allocs, 2u);
  EXPECT_EQ(st.requests, 2u);
  pool.free(a, A);
  st = pool.stats();
  EXPECT_EQ(st.bytes_in_use, 3u << 20);
  EXPECT_EQ(st.bytes_held, 1024u + (3u << 20));  // cached, not released
  pool.empty_cache();                              // a's marker is pending: a stays
  EXPECT_EQ(pool.stats().bytes_held, 1024u + (3u << 20));
  EXPECT_EQ(d.releases, 0);
  d.complete(A);
  pool.empty_cache();
  st = pool.stats();
  EXPECT_EQ(st.bytes_held, 3u << 20);
  EXPECT_EQ(st.raw_releases, 1u);
  EXPECT_EQ(st.peak_bytes_held, 1024u + (3u << 20));
  EXPECT_EQ(d.releases, 1);
  pool.free(b, nullptr);
  EXPECT_EQ(pool.stats().bytes_in_use, 0u);
  EXPECT_THROW(pool.free(b, nullptr), std::invalid_argument);  // not handed out (any more)
}

TEST(HostPool, RefusalReleasesIdleBlocksAndRetries) {
  FakeDriver d;
  HostPool pool(d.callbacks());
  void* a = pool.allocate(1000);
  pool.free(a, nullptr);  // idle in the 1 KiB class
  d.refuse = true;
  EXPECT_EQ(pool.allocate(70'000), nullptr);  // released a, retried, refused again
  EXPECT_EQ(d.releases, 1);
  EXPECT_EQ(pool.stats().bytes_held, 0u);
  d.refuse = false;
  EXPECT_NE(pool.allocate(70'000), nullptr);
}

TEST(HostPool, DestructionReleasesEverything) {
  FakeDriver d;
  {
    HostPool pool(d.callbacks());
    void* a = pool.allocate(100);
    pool.allocate(200'000);  // still in use at destruction
    pool.free(a, A);         // pending marker at destruction
  }
  EXPECT_EQ(d.allocs, 2);
  EXPECT_EQ(d.releases, 2);
  EXPECT_EQ(d.drops, 1);
  EXPECT_TRUE(d.live.empty());
}

}  // namespace
}  // namespace moelab
