// harness/tests/groups_mpi_test.cpp — the process groups of every layout of an N-rank world on
// the cpu backend with Open MPI: each group's data-plane collectives (all-reduce, all-gather,
// reduce-scatter, all-to-all-v), issued for all six groups at once on six streams, and its
// control-plane calls give exactly the group's results; split with a negative color and dup
// of a split work.
//   mpirun --oversubscribe -np 4 build/harness/tests/groups_mpi_test
// Buffers hold small integers (exact in fp32), functions of the seed and the world rank, so
// every rank computes what each group must return.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "harness/comm/groups.hpp"
#include "harness/comm/world.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

std::uint64_t g_seed = 0;  // agreed across ranks in main()

// Element i of world rank w's buffer number `tag`: an integer in [0, 64).
float value(int w, int tag, std::int64_t i) {
  return static_cast<float>((g_seed % 997 + 31 * static_cast<std::uint64_t>(w) + 7 * static_cast<std::uint64_t>(tag) +
                             static_cast<std::uint64_t>(i)) % 64);
}
std::vector<float> values(int w, int tag, std::int64_t n, std::int64_t from = 0) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = value(w, tag, from + i);
  return v;
}
// Elements world rank `src` sends to world rank `dst` in the all-to-all-v: 1 to 3 of them.
std::int64_t a2a_count(int src, int dst) { return 1 + static_cast<std::int64_t>((g_seed + 3 * src + dst) % 3); }
float a2a_value(int src, int dst, std::int64_t j) { return static_cast<float>(100 * src + 10 * dst + j); }

// One group's buffers and what they must hold afterwards.
struct GroupCheck {
  Group g;
  std::vector<int> members;  // world ranks
  int me = 0;                // rank in the group
  Tensor reduce, gather_in, gather_out, scatter_in, scatter_out, a2a_in, a2a_out;
  std::vector<Segment> sends, recvs;
};

TEST(GroupsMpi, EveryLayoutsGroupsComputeOverTheirMembersOnly) {
  auto b = make_backend("cpu");
  auto world = make_world_communicator(*b);
  const int n = world->size(), w = world->rank();
  const NodeMap nodes = gather_nodes(*world);
  EXPECT_EQ(nodes.nodes(), 1);
  std::vector<Stream*> streams;
  for (Group g : kAllGroups) streams.push_back(&b->create_stream(StreamRole::aux, group_name(g)));
  const std::int64_t k = 5;  // all-gather and reduce-scatter block; all-reduce of 3k + 2
  for (const ParallelLayout& spec : enumerate_layouts(n)) {  // one host: every node check passes
    const GroupLayout l = check_layout(spec, n, n, std::nullopt);
    SCOPED_TRACE(l.to_string());
    ProcessGroups pg(*world, l, nodes);
    EXPECT_EQ(pg.node(), 0);
    EXPECT_EQ(pg.local_rank(), w);
    EXPECT_EQ(pg.coords(), l.coords(w));
    // Issue every group's collectives on its own stream, all at once.
    std::vector<GroupCheck> checks;
    for (Group g : kAllGroups) {
      Communicator& c = pg.group(g);
      Stream& s = *streams[static_cast<std::size_t>(g)];
      GroupCheck gc;
      gc.g = g;
      gc.members = l.members(g, w);
      gc.me = l.coords(w)[g];
      EXPECT_EQ(c.world_ranks(), gc.members) << group_name(g);
      EXPECT_EQ(c.rank(), gc.me) << group_name(g);
      const auto m = static_cast<std::int64_t>(gc.members.size());
      const int tag = static_cast<int>(g);
      gc.reduce = b->empty({3 * k + 2}, DType::f32, MemCategory::buffers, s);  // [3k+2]
      b->upload(values(w, tag, 3 * k + 2), gc.reduce);
      gc.gather_in = b->empty({k}, DType::f32, MemCategory::buffers, s);  // [k]
      b->upload(values(w, tag + 10, k), gc.gather_in);
      gc.gather_out = b->empty({m * k}, DType::f32, MemCategory::buffers, s);  // [m·k]
      gc.scatter_in = b->empty({m * k}, DType::f32, MemCategory::buffers, s);  // [m·k]
      b->upload(values(w, tag + 20, m * k), gc.scatter_in);
      gc.scatter_out = b->empty({k}, DType::f32, MemCategory::buffers, s);  // [k]
      std::int64_t out_len = 0, in_len = 0;
      for (int p = 0; p < m; ++p) {
        const int wp = gc.members[static_cast<std::size_t>(p)];
        gc.sends.push_back({p, out_len, a2a_count(w, wp)});
        out_len += a2a_count(w, wp);
        gc.recvs.push_back({p, in_len, a2a_count(wp, w)});
        in_len += a2a_count(wp, w);
      }
      std::vector<float> out;
      for (int wp : gc.members)
        for (std::int64_t j = 0; j < a2a_count(w, wp); ++j) out.push_back(a2a_value(w, wp, j));
      gc.a2a_out = b->empty({out_len}, DType::f32, MemCategory::buffers, s);  // [sum of sends]
      b->upload(out, gc.a2a_out);
      gc.a2a_in = b->empty({in_len}, DType::f32, MemCategory::buffers, s);  // [sum of receives]
      c.all_reduce(s, gc.reduce);
      c.all_gather(s, gc.gather_in, gc.gather_out);
      c.reduce_scatter(s, gc.scatter_in, gc.scatter_out);
      c.all_to_all_v(s, gc.a2a_out, gc.sends, gc.a2a_in, gc.recvs);
      checks.push_back(std::move(gc));
    }
    b->synchronize();
    for (const GroupCheck& gc : checks) {
      const int tag = static_cast<int>(gc.g);
      const std::string G = group_name(gc.g);
      std::vector<float> sum(static_cast<std::size_t>(3 * k + 2), 0.0f), gathered, scattered(static_cast<std::size_t>(k), 0.0f),
          received;
      for (int wp : gc.members) {
        const auto v = values(wp, tag, 3 * k + 2);
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
        const auto g = values(wp, tag + 10, k);
        gathered.insert(gathered.end(), g.begin(), g.end());
        const auto sc = values(wp, tag + 20, k, gc.me * k);  // my block of every member's input
        for (std::size_t i = 0; i < scattered.size(); ++i) scattered[i] += sc[i];
        for (std::int64_t j = 0; j < a2a_count(wp, w); ++j) received.push_back(a2a_value(wp, w, j));
      }
      EXPECT_EQ(b->download(gc.reduce), sum) << G << " all_reduce";
      EXPECT_EQ(b->download(gc.gather_out), gathered) << G << " all_gather";
      EXPECT_EQ(b->download(gc.scatter_out), scattered) << G << " reduce_scatter";
      EXPECT_EQ(b->download(gc.a2a_in), received) << G << " all_to_all_v";
    }
    // Control plane, group after group.
    for (Group g : kAllGroups) {
      Communicator& c = pg.group(g);
      const std::vector<int> m = l.members(g, w);
      const std::string G = group_name(g);
      std::vector<std::int64_t> send, want;
      for (int p : m)
        for (int j = 0; j < 3; ++j) {
          send.push_back(1000 * w + 10 * p + j);
          want.push_back(1000 * p + 10 * w + j);
        }
      EXPECT_EQ(c.exchange_counts(send), want) << G;
      c.barrier();
      double sum = 0;
      std::vector<std::string> names;
      for (int p : m) {
        sum += p + 0.5;
        names.push_back("rank" + std::to_string(p));
      }
      EXPECT_EQ(c.all_reduce_sum(w + 0.5), sum) << G;
      EXPECT_EQ(c.all_reduce_max(-w), static_cast<double>(-m.front())) << G;  // members ascend in every group
      EXPECT_EQ(c.all_gather_strings("rank" + std::to_string(w)), names) << G;
      // A dup of the group is the same group on a new channel.
      auto d = c.dup();
      EXPECT_EQ(d->world_ranks(), m) << G;
      Tensor one = b->empty({1}, DType::f32, MemCategory::buffers, b->default_stream());
      b->upload(std::vector<float>{1.0f}, one);
      d->all_reduce(b->default_stream(), one);
      EXPECT_EQ(b->download(one), std::vector<float>{static_cast<float>(m.size())}) << G << " dup";
    }
  }
}

TEST(GroupsMpi, SplitWithoutColorAndByKey) {
  auto b = make_backend("cpu");
  auto world = make_world_communicator(*b);
  const int n = world->size(), w = world->rank();
  // Odd ranks join none; the even ones are ordered by descending rank.
  auto evens = world->split(w % 2 ? -1 : 3, n - w);
  if (w % 2) {
    EXPECT_EQ(evens, nullptr);
  } else {
    ASSERT_NE(evens, nullptr);
    std::vector<int> want;
    for (int r = (n - 1) / 2 * 2; r >= 0; r -= 2) want.push_back(r);
    EXPECT_EQ(evens->world_ranks(), want);
    EXPECT_EQ(evens->world_rank(evens->rank()), w);
    EXPECT_EQ(evens->all_reduce_sum(w), static_cast<double>(std::accumulate(want.begin(), want.end(), 0)));
    auto again = evens->dup()->split(0, 0);  // ties in key: the order of the parent
    EXPECT_EQ(again->world_ranks(), want);
  }
  world->barrier();
}

}  // namespace
}  // namespace moelab

int main(int argc, char** argv) {
  moelab::init_world(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  // One seed for all ranks, fresh each run (rank 0 draws it).
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    const double s = moelab::world_rank() == 0 ? static_cast<double>(moelab::test::fresh_seed() >> 12) : 0.0;
    moelab::g_seed = static_cast<std::uint64_t>(comm->all_reduce_sum(s));
    if (moelab::world_rank() == 0) std::printf("seed %llu on %d ranks\n", static_cast<unsigned long long>(moelab::g_seed), moelab::world_size());
  }
  // Only rank 0 prints the gtest report; every rank's result decides the exit code.
  if (moelab::world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    rc = static_cast<int>(comm->all_reduce_max(rc));
  }
  moelab::finalize_world();
  return rc;
}
