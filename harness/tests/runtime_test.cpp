// harness/tests/runtime_test.cpp — the runtime on the cpu backend: the tracked allocator's
// figures against a hand count, streams that really run concurrently, events that order
// them, errors that surface at synchronize, the timeline, and the self communicator.
#include <gtest/gtest.h>

#include <thread>

#include "harness/backends/cpu/cpu_backend.hpp"
#include "harness/comm/communicator.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/parallel.hpp"
#include "harness/runtime/random.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

TEST(MemoryTracker, PeakMatchesHandCount) {
  CpuBackend b;
  Stream& s = b.default_stream();
  const auto MiB = std::size_t{1} << 20;
  auto idx = [](MemCategory c) { return static_cast<std::size_t>(c); };
  Tensor w = b.empty({256, 1024}, DType::f32, MemCategory::weights, s);          // 1 MiB
  Tensor g = b.empty({256, 1024}, DType::f32, MemCategory::gradients, s);        // 1 MiB
  {
    Tensor a1 = b.empty({512, 1024}, DType::f32, MemCategory::activations, s);   // 2 MiB
    Tensor buf = b.empty({128, 1024}, DType::f32, MemCategory::buffers, s);      // 0.5 MiB
    EXPECT_EQ(b.memory().device_in_use(), 4 * MiB + MiB / 2);
    Tensor view = a1.rows(10, 20);  // views allocate nothing
    EXPECT_EQ(b.memory().device_in_use(), 4 * MiB + MiB / 2);
  }  // a1, buf freed: 2 MiB in use
  EXPECT_EQ(b.memory().device_in_use(), 2 * MiB);
  Tensor a2 = b.empty({256, 1024}, DType::f32, MemCategory::activations, s);     // 1 MiB -> 3 MiB
  Tensor pinned = b.empty({1024, 1024}, DType::f32, MemCategory::buffers, s, MemSpace::host_pinned);  // host
  EXPECT_EQ(b.memory().peak_device(), 4 * MiB + MiB / 2);
  const auto at_peak = b.memory().at_peak();
  EXPECT_EQ(at_peak[idx(MemCategory::weights)], MiB);
  EXPECT_EQ(at_peak[idx(MemCategory::gradients)], MiB);
  EXPECT_EQ(at_peak[idx(MemCategory::activations)], 2 * MiB);
  EXPECT_EQ(at_peak[idx(MemCategory::buffers)], MiB / 2);
  EXPECT_EQ(b.memory().in_use(MemCategory::host_pinned), 4 * MiB);
  EXPECT_EQ(b.memory().peak_per_category()[idx(MemCategory::activations)], 2 * MiB);
  EXPECT_EQ(b.memory().timeline().size(), 8u);  // 6 allocations, 2 frees
  EXPECT_EQ(b.memory().timeline().back().in_use[idx(MemCategory::host_pinned)], 4 * MiB);
  b.memory().reset_peak();
  EXPECT_EQ(b.memory().peak_device(), 3 * MiB);
  EXPECT_TRUE(b.memory().timeline().empty());
}

// PipeOffload's offload and reload (Backend::relocate): a storage's bytes go to pinned host
// memory and back bit for bit (any bit pattern: int32 data whose floats would be NaNs or
// denormals), every handle and view follows, the tracker moves the bytes between device and
// host, and a capture records exactly what was allocated while it ran.
TEST(Relocate, OffloadAndReloadAreBitExactAndMoveTheMemory) {
  CpuBackend b;
  Stream& s = b.default_stream();
  Stream& d2h = b.create_stream(StreamRole::d2h, "d2h");
  Stream& h2d = b.create_stream(StreamRole::h2d, "h2d");
  Rng rng(test::fresh_seed());
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{3}, std::int64_t{1000}, std::int64_t{65537}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    b.start_capture();
    Tensor other = b.empty({4}, DType::f32, MemCategory::weights, s);
    Tensor t = b.empty({n}, DType::i32, MemCategory::activations, s);
    const auto made = b.stop_capture();
    ASSERT_EQ(made.size(), 2u);
    EXPECT_EQ(made[1].lock().get(), t.storage().get());
    std::vector<std::int32_t> bits(static_cast<std::size_t>(n));
    for (auto& v : bits) v = static_cast<std::int32_t>(rng.next());
    b.upload_i32(bits, t);
    Tensor view = n > 1 ? t.rows(1, n - 1) : t;
    const std::size_t dev = b.memory().device_in_use(), host = b.memory().in_use(MemCategory::host_pinned);
    b.relocate(t.storage(), MemSpace::host_pinned, MemCategory::host_pinned, d2h, d2h);
    EXPECT_EQ(t.space(), MemSpace::host_pinned);
    EXPECT_EQ(b.memory().device_in_use(), dev - t.nbytes());
    EXPECT_EQ(b.memory().in_use(MemCategory::host_pinned), host + t.nbytes());
    auto offloaded = b.create_event();  // the reload reads what the offload wrote
    b.record(*offloaded, d2h);
    b.wait(h2d, *offloaded);
    b.relocate(t.storage(), MemSpace::device, MemCategory::activations, h2d, h2d);
    EXPECT_EQ(t.space(), MemSpace::device);
    EXPECT_EQ(t.category(), MemCategory::activations);
    EXPECT_EQ(b.memory().device_in_use(), dev);
    EXPECT_EQ(b.memory().in_use(MemCategory::host_pinned), host);
    b.synchronize();
    EXPECT_EQ(b.download_i32(t), bits);
    if (n > 1) {
      EXPECT_EQ(b.download_i32(view), std::vector<std::int32_t>(bits.begin() + 1, bits.end()));
    }
  }
  EXPECT_THROW(b.stop_capture(), std::exception);  // none running
}

TEST(CpuStreams, RunConcurrentlyAndEventsOrderThem) {
  CpuBackend b;
  Stream& s1 = b.create_stream(StreamRole::compute, "a");
  Stream& s2 = b.create_stream(StreamRole::dispatch, "b");
  auto sleep_op = [](int ms) { return [ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }; };
  // Two 200 ms ops on two streams overlap: well under 400 ms together.
  const double t0 = b.now();
  b.enqueue(s1, "sleep", {}, sleep_op(200));
  b.enqueue(s2, "sleep", {}, sleep_op(200));
  b.synchronize();
  EXPECT_LT(b.now() - t0, 0.35);
  // With an event, s2's op starts only after s1's.
  b.clear_timeline();
  auto ev = b.create_event();
  b.enqueue(s1, "first", {}, sleep_op(100));
  b.record(*ev, s1);
  b.wait(s2, *ev);
  b.enqueue(s2, "second", {}, sleep_op(10));
  b.synchronize();
  const auto tl = b.timeline();
  ASSERT_EQ(tl.size(), 2u);
  const auto& first = tl[0].name == "first" ? tl[0] : tl[1];
  const auto& second = tl[0].name == "first" ? tl[1] : tl[0];
  EXPECT_GE(second.start, first.end);
  EXPECT_EQ(second.stream_name, "b");
}

TEST(CpuStreams, AFailedOpSurfacesAtSynchronize) {
  CpuBackend b;
  Stream& s = b.default_stream();
  b.enqueue(s, "boom", {}, [] { throw CommError("rank 0: planted failure"); });
  EXPECT_THROW(b.synchronize(s), CommError);
  b.enqueue(s, "fine", {}, [] {});
  EXPECT_NO_THROW(b.synchronize(s));  // the error is reported once
}

TEST(CpuBackend, GemmMatchesReferenceForAllTransposes) {
  CpuBackend b;
  Stream& s = b.default_stream();
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t m = 7, n = 5, k = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const auto ah = test::uniform(m * k, Rng::mix(seed, 1)), bh = test::uniform(k * n, Rng::mix(seed, 2)),
                 ch = test::uniform(m * n, Rng::mix(seed, 3));
      Tensor A = b.empty(ta ? std::vector<std::int64_t>{k, m} : std::vector<std::int64_t>{m, k}, DType::f32,
                         MemCategory::buffers, s);
      Tensor B = b.empty(tb ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n}, DType::f32,
                         MemCategory::buffers, s);
      Tensor C = b.empty({m, n}, DType::f32, MemCategory::buffers, s);
      b.upload(ah, A);
      b.upload(bh, B);
      b.upload(ch, C);
      b.gemm(s, {ta, tb, m, n, k, A, B, C, 2.0f, 0.5f}, "gemm");
      std::vector<double> ref(static_cast<std::size_t>(m * n));
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (std::int64_t p = 0; p < k; ++p)
            acc += static_cast<double>(ta ? ah[static_cast<std::size_t>(p * m + i)] : ah[static_cast<std::size_t>(i * k + p)]) *
                   (tb ? bh[static_cast<std::size_t>(j * k + p)] : bh[static_cast<std::size_t>(p * n + j)]);
          ref[static_cast<std::size_t>(i * n + j)] = 2.0 * acc + 0.5 * ch[static_cast<std::size_t>(i * n + j)];
        }
      EXPECT_TRUE(test::all_close("C", b.download(C), ref, 1e-5)) << "ta=" << ta << " tb=" << tb;
    }
}

// A world of one on the cpu backend, send = 0..9, recv zeroed.
struct SelfRig {
  CpuBackend b;
  std::unique_ptr<Communicator> comm = make_self_communicator(b);
  Stream& s = b.default_stream();
  Tensor send = b.empty({10}, DType::f32, MemCategory::buffers, s);
  Tensor recv = b.empty({10}, DType::f32, MemCategory::buffers, s);
  SelfRig() {
    b.upload(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, send);
    b.fill_zero(s, recv);
  }
};

TEST(SelfCommunicator, AllToAllVWithSegments) {
  SelfRig rig;
  auto& [b, comm, s, send, recv] = rig;
  const std::vector<Segment> sends = {{0, 0, 4}, {0, 4, 6}}, recvs = {{0, 6, 4}, {0, 0, 6}};
  comm->all_to_all_v(s, send, sends, recv, recvs);
  EXPECT_EQ(b.download(recv), (std::vector<float>{4, 5, 6, 7, 8, 9, 0, 1, 2, 3}));
  EXPECT_EQ(comm->exchange_counts({3, 4}), (std::vector<std::int64_t>{3, 4}));
  EXPECT_THROW(comm->send(s, send, 1), CommError);
}

// Segments that follow each other on both sides are one copy; a gap or a jump on either side
// starts another. Three runs here: [0,5) -> [0,5) (with an empty segment inside), 5 -> 9,
// [6,10) -> [5,9).
TEST(SelfCommunicator, AdjacentSegmentsMoveAsOneCopy) {
  SelfRig rig;
  auto& [b, comm, s, send, recv] = rig;
  const std::vector<Segment> sends = {{0, 0, 3}, {0, 3, 0}, {0, 3, 2}, {0, 5, 1}, {0, 6, 4}},
                             recvs = {{0, 0, 3}, {0, 3, 0}, {0, 3, 2}, {0, 9, 1}, {0, 5, 4}};
  b.clear_timeline();
  comm->all_to_all_v(s, send, sends, recv, recvs);
  EXPECT_EQ(b.download(recv), (std::vector<float>{0, 1, 2, 3, 4, 6, 7, 8, 9, 5}));
  std::size_t copies = 0;
  for (const OpRecord& r : b.timeline()) copies += r.name == "copy";
  EXPECT_EQ(copies, 3u);
  // A negative count is refused, not folded into a run.
  const std::vector<Segment> bad = {{0, 0, 5}, {0, 5, -2}, {0, 3, 2}};
  EXPECT_THROW(comm->all_to_all_v(s, send, bad, recv, bad), std::logic_error);
}

TEST(Tensor, ViewsShareStorage) {
  CpuBackend b;
  Stream& s = b.default_stream();
  Tensor t = b.empty({4, 3, 2}, DType::f32, MemCategory::buffers, s);
  b.upload(std::vector<float>(24, 1.0f), t);
  Tensor v = t.select(2);
  EXPECT_EQ(v.shape(), (std::vector<std::int64_t>{3, 2}));
  EXPECT_EQ(v.data<float>(), t.data<float>() + 12);
  EXPECT_EQ(t.rows(1, 2).numel(), 12);
  EXPECT_THROW(t.rows(3, 2), std::logic_error);
  EXPECT_THROW(b.empty({2}, DType::bf16, MemCategory::buffers, s), Unsupported);
}

// ---- random streams and the parallel loop that draws them -------------------------------------

// skip(n) leaves a stream where n next() calls would: a draw split at any point over threads
// gives the values of one serial draw, bit for bit.
TEST(Rng, SkipIsNDraws) {
  const std::uint64_t seed = test::fresh_seed();
  for (std::uint64_t n : {0ull, 1ull, 2ull, 7ull, 1000ull, 123457ull}) {
    Rng serial(seed), skipped(seed);
    for (std::uint64_t i = 0; i < n; ++i) serial.next();
    skipped.skip(n);
    EXPECT_EQ(serial.next(), skipped.next()) << n;
    EXPECT_EQ(serial.normal(), skipped.normal()) << n;
  }
}

TEST(ParallelFor, CoversEveryIndexOnceAndMatchesASerialDraw) {
  const std::uint64_t seed = test::fresh_seed();
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{4096}, std::size_t{100003}})
    for (std::size_t grain : {std::size_t{1}, std::size_t{64}, std::size_t{1} << 16}) {
      std::vector<int> hits(n, 0);
      std::vector<double> drawn(n);
      parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
        Rng r(seed);
        r.skip(2 * b);
        for (std::size_t i = b; i < e; ++i) {
          ++hits[i];
          drawn[i] = r.normal();
        }
      });
      Rng r(seed);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[i], 1) << "n " << n << " grain " << grain << " index " << i;
        ASSERT_EQ(drawn[i], r.normal()) << "n " << n << " grain " << grain << " index " << i;
      }
    }
}

}  // namespace
}  // namespace moelab
