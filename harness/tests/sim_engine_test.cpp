// harness/tests/sim_engine_test.cpp — the sim backend's event engine against times worked
// out by hand: chains, sharing (processor sharing, max-min fairness), multi-resource tasks,
// interference, the alpha-beta cost of an all-to-all, busy time, determinism, and the
// errors a malformed graph raises; and, on random graphs, against a brute-force reference
// that re-solves everything at every event (the engine re-solves only what an event can
// change).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/sim/engine.hpp"

namespace moelab::sim {
namespace {

// Relative tolerance for values reached through several floating-point steps.
constexpr double kRel = 1e-12;
constexpr double kInf = std::numeric_limits<double>::infinity();

void expect_rel(double actual, double expected, const std::string& what = "") {
  EXPECT_NEAR(actual, expected, kRel * std::abs(expected)) << what;
}

Task make_task(std::string name, std::vector<Demand> demands, std::vector<int> deps = {}, double latency = 0,
               int gpu = -1, WorkClass cls = WorkClass::none) {
  Task t;
  t.name = std::move(name);
  t.demands = std::move(demands);
  t.deps = std::move(deps);
  t.latency = latency;
  t.gpu = gpu;
  t.cls = cls;
  return t;
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(SimEngine, SerialChainTakesTheSumOfItsTimes) {
  Engine e;
  const int r0 = e.add_resource("r0", 3.0);
  const int r1 = e.add_resource("r1", 7.5);
  const double lat[] = {0.125, 0.3, 0.0, 1e-6, 0.02};
  const double amt[] = {1.0, 2.2, 0.7, 5.0, 0.01};
  const int res[] = {r0, r1, r0, r1, r0};
  int prev = -1;
  for (int k = 0; k < 5; ++k) {
    std::vector<int> deps;
    if (prev >= 0) deps.push_back(prev);
    prev = e.add_task(make_task("t" + std::to_string(k), {{res[k], amt[k]}}, deps, lat[k]));
  }
  e.run();
  double t = 0, busy0 = 0, busy1 = 0;
  for (int k = 0; k < 5; ++k) {
    const Task& tk = e.task(k);
    EXPECT_DOUBLE_EQ(tk.ready, t);
    t += lat[k];
    EXPECT_DOUBLE_EQ(tk.start, t);
    const double d = amt[k] / e.resource_capacity(res[k]);
    t += d;
    EXPECT_DOUBLE_EQ(tk.end, t);
    (res[k] == r0 ? busy0 : busy1) += d;
  }
  EXPECT_DOUBLE_EQ(e.makespan(), t);
  EXPECT_DOUBLE_EQ(e.busy_time(r0), busy0);  // latencies are not busy time
  EXPECT_DOUBLE_EQ(e.busy_time(r1), busy1);
}

TEST(SimEngine, IndependentTasksOnDifferentResourcesTakeTheMax) {
  Engine e;
  const int r0 = e.add_resource("r0", 2.0), r1 = e.add_resource("r1", 4.0);
  e.add_task(make_task("a", {{r0, 3.0}}));   // 1.5 s
  e.add_task(make_task("b", {{r1, 10.0}}));  // 2.5 s
  e.run();
  EXPECT_DOUBLE_EQ(e.task(0).end, 1.5);
  EXPECT_DOUBLE_EQ(e.task(1).end, 2.5);
  EXPECT_DOUBLE_EQ(e.makespan(), 2.5);
}

TEST(SimEngine, EqualTasksOnOneResourceEndTogetherAtTwiceTheirTime) {
  Engine e;
  const int r = e.add_resource("r", 3.0);
  e.add_task(make_task("a", {{r, 1.3}}));
  e.add_task(make_task("b", {{r, 1.3}}));
  e.run();
  const double a = 1.3 / 3.0;
  EXPECT_DOUBLE_EQ(e.task(0).end, 2 * a);
  EXPECT_EQ(e.task(0).end, e.task(1).end);  // the same event, bit for bit
  EXPECT_DOUBLE_EQ(e.busy_time(r), 2 * a);  // overlapping use counts once
}

TEST(SimEngine, UnequalTasksShareAsProcessorSharing) {
  Engine e;
  const int r = e.add_resource("r", 1.0);
  e.add_task(make_task("short", {{r, 0.3}}));
  e.add_task(make_task("long", {{r, 0.7}}));
  e.run();
  expect_rel(e.task(0).end, 2 * 0.3);     // half the resource until it ends
  expect_rel(e.task(1).end, 0.3 + 0.7);   // then all of it
  expect_rel(e.busy_time(r), 1.0);
}

TEST(SimEngine, ProcessorSharingOfManyTasksIsWorkConserving) {
  // n tasks of sizes a_1 <= ... <= a_n at t = 0 on one resource: the k-th ends at
  // end_{k-1} + (n - k + 1) * (a_k - a_{k-1}), the last at sum(a) / capacity.
  Engine e;
  const double cap = 2.5;
  const int r = e.add_resource("r", cap);
  std::mt19937_64 rng(7);
  std::vector<double> amounts;
  for (int k = 0; k < 40; ++k) amounts.push_back(0.1 + static_cast<double>(rng() % 1000) / 97.0);
  for (std::size_t k = 0; k < amounts.size(); ++k)
    e.add_task(make_task("t" + std::to_string(k), {{r, amounts[k]}}));
  e.run();
  std::vector<std::size_t> order(amounts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return amounts[x] < amounts[y]; });
  double t = 0, prev = 0;
  const auto n = static_cast<double>(amounts.size());
  for (std::size_t k = 0; k < order.size(); ++k) {
    const double a = amounts[order[k]];
    t += (n - static_cast<double>(k)) * (a - prev) / cap;
    prev = a;
    expect_rel(e.task(static_cast<int>(order[k])).end, t, "task " + std::to_string(order[k]));
  }
  const double total = std::accumulate(amounts.begin(), amounts.end(), 0.0);
  expect_rel(e.makespan(), total / cap);
  expect_rel(e.busy_time(r), total / cap);
}

TEST(SimEngine, TaskWithTwoDemandsIsLimitedByTheSlowerOne) {
  Engine e;
  const int fast = e.add_resource("fast", 10.0), slow = e.add_resource("slow", 2.0);
  e.add_task(make_task("ab", {{fast, 5.0}, {slow, 3.0}}));  // 0.5 s and 1.5 s: 1.5 s
  e.add_task(make_task("ba", {{fast, 30.0}, {slow, 1.0}}, {}, 2.0));  // 3 s and 0.5 s: 3 s
  e.run();
  EXPECT_DOUBLE_EQ(e.task(0).end, 1.5);
  EXPECT_DOUBLE_EQ(e.task(1).end, 5.0);
  EXPECT_DOUBLE_EQ(e.busy_time(fast), 4.5);
  EXPECT_DOUBLE_EQ(e.busy_time(slow), 4.5);  // used (below capacity) for as long as the tasks run
}

TEST(SimEngine, MaxMinFairnessGivesUnusedShareToOthers) {
  // r1 = 10 units/s, r2 = 4 units/s. A uses r1 (12 units), B uses r1 and r2 (8 units each),
  // C uses r2 (4 units). Progressive filling: r2 saturates first (B and C at 2 units/s each);
  // A then takes what B leaves of r1: 10 - 2 = 8 units/s.
  //   A: 12 / 8 = 1.5 s.  At 1.5: B and C have done 3 units; r2 still binds both at 2/s.
  //   C: 1 unit left at 2/s, ends at 2.0.  B: 5 - 1 = 4 units left at 4/s, ends at 3.0.
  Engine e;
  const int r1 = e.add_resource("r1", 10.0), r2 = e.add_resource("r2", 4.0);
  e.add_task(make_task("A", {{r1, 12.0}}));
  e.add_task(make_task("B", {{r1, 8.0}, {r2, 8.0}}));
  e.add_task(make_task("C", {{r2, 4.0}}));
  e.run();
  expect_rel(e.task(0).end, 1.5);
  expect_rel(e.task(2).end, 2.0);
  expect_rel(e.task(1).end, 3.0);
  expect_rel(e.busy_time(r1), 3.0);
  expect_rel(e.busy_time(r2), 3.0);
}

TEST(SimEngine, InterferenceSlowsDifferentClassesOnTheSameGpu) {
  for (bool same_gpu : {true, false}) {
    Engine e;
    e.set_interference(WorkClass::compute, 0.8);  // sigma
    e.set_interference(WorkClass::comm, 0.9);     // mu
    const int sm = e.add_resource("sm0", 1.0), link = e.add_resource("link0", 100.0);
    e.add_task(make_task("gemm", {{sm, 1.0}}, {}, 0, 0, WorkClass::compute));             // 1 s alone
    e.add_task(make_task("a2a", {{link, 45.0}}, {}, 0, same_gpu ? 0 : 1, WorkClass::comm));  // 0.45 s alone
    e.run();
    if (same_gpu) {
      // Both slowed while both run: the comm task ends at 0.45 / 0.9 = 0.5; the GEMM has done
      // 0.8 * 0.5 = 0.4 of its second by then and runs the remaining 0.6 at full speed.
      expect_rel(e.task(1).end, 0.5);
      expect_rel(e.task(0).end, 0.5 + (1.0 - 0.8 * 0.5));
    } else {
      EXPECT_DOUBLE_EQ(e.task(1).end, 0.45);
      EXPECT_DOUBLE_EQ(e.task(0).end, 1.0);
    }
  }
}

// The matrix form: factor(victim, aggressor) slows the victim only while that aggressor class
// runs on its GPU; with two aggressors the smaller factor applies.
TEST(SimEngine, InterferenceMatrixSlowsOnlyBesideTheNamedAggressor) {
  for (WorkClass aggressor : {WorkClass::memcpy, WorkClass::comm}) {
    SCOPED_TRACE(work_class_name(aggressor));
    Engine e;
    e.set_interference(WorkClass::compute, WorkClass::memcpy, 0.5);  // compute beside memcpy
    e.set_interference(WorkClass::memcpy, WorkClass::compute, 0.8);  // memcpy beside compute
    EXPECT_EQ(e.interference(WorkClass::compute, WorkClass::memcpy), 0.5);
    EXPECT_EQ(e.interference(WorkClass::compute, WorkClass::comm), 1.0);
    EXPECT_EQ(e.interference(WorkClass::compute), 0.5);  // the smallest over aggressors
    const int sm = e.add_resource("sm0", 1.0), link = e.add_resource("link0", 1.0);
    e.add_task(make_task("gemm", {{sm, 1.0}}, {}, 0, 0, WorkClass::compute));  // 1 s alone
    e.add_task(make_task("other", {{link, 0.4}}, {}, 0, 0, aggressor));          // 0.4 s alone
    e.run();
    if (aggressor == WorkClass::memcpy) {
      // The copy runs at 0.8: it ends at 0.4 / 0.8 = 0.5; by then the GEMM has done 0.5 * 0.5
      // of its second and does the remaining 0.75 alone.
      expect_rel(e.task(1).end, 0.5);
      expect_rel(e.task(0).end, 0.5 + (1.0 - 0.5 * 0.5));
    } else {
      // No factor for compute beside comm nor for comm beside compute: nobody slows.
      EXPECT_DOUBLE_EQ(e.task(1).end, 0.4);
      EXPECT_DOUBLE_EQ(e.task(0).end, 1.0);
    }
  }
  // Two aggressors at once: the smaller factor (0.5 beside memcpy, not 0.7 beside comm).
  Engine e;
  e.set_interference(WorkClass::compute, WorkClass::memcpy, 0.5);
  e.set_interference(WorkClass::compute, WorkClass::comm, 0.7);
  const int sm = e.add_resource("sm0", 1.0), l1 = e.add_resource("l1", 1.0), l2 = e.add_resource("l2", 1.0);
  e.add_task(make_task("gemm", {{sm, 1.0}}, {}, 0, 0, WorkClass::compute));
  e.add_task(make_task("copy", {{l1, 0.2}}, {}, 0, 0, WorkClass::memcpy));  // 0 .. 0.2
  e.add_task(make_task("a2a", {{l2, 0.6}}, {}, 0, 0, WorkClass::comm));     // 0 .. 0.6
  e.run();
  // 0 .. 0.2 at 0.5 (both run), 0.2 .. 0.6 at 0.7 (comm only), then alone.
  expect_rel(e.task(0).end, 0.6 + (1.0 - 0.5 * 0.2 - 0.7 * 0.4));
  // Errors: a class with itself, class none, a factor outside (0, 1].
  EXPECT_THROW(e.set_interference(WorkClass::compute, WorkClass::compute, 0.5), std::invalid_argument);
  EXPECT_THROW(e.set_interference(WorkClass::none, WorkClass::comm, 0.5), std::invalid_argument);
  EXPECT_THROW(e.set_interference(WorkClass::comm, WorkClass::memcpy, 1.5), std::invalid_argument);
  EXPECT_THROW(e.set_interference(WorkClass::comm, WorkClass::memcpy, 0.0), std::invalid_argument);
  // The single-factor form sets both aggressors of the victim.
  e.set_interference(WorkClass::comm, 0.9);
  EXPECT_EQ(e.interference(WorkClass::comm, WorkClass::compute), 0.9);
  EXPECT_EQ(e.interference(WorkClass::comm, WorkClass::memcpy), 0.9);
}

TEST(SimEngine, InterferenceNeedsAnotherClassAndDoesNotRedistribute) {
  Engine e;
  e.set_interference(WorkClass::compute, 0.8);
  e.set_interference(WorkClass::comm, 0.9);
  e.set_interference(WorkClass::memcpy, 0.5);
  EXPECT_EQ(e.interference(WorkClass::memcpy), 0.5);
  const int sm = e.add_resource("sm0", 1.0), link = e.add_resource("link0", 1.0);
  const int other = e.add_resource("other", 1.0);
  // Two GEMMs share the SMs (0.5 each) and are slowed to 0.4 each by a comm task on the same
  // GPU; the 0.2 of SM time they leave is not handed out. A task of class none on the same
  // GPU, and a compute task on another resource of the same class, slow nobody.
  e.add_task(make_task("g1", {{sm, 1.0}}, {}, 0, 0, WorkClass::compute));
  e.add_task(make_task("g2", {{sm, 1.0}}, {}, 0, 0, WorkClass::compute));
  e.add_task(make_task("a2a", {{link, 0.9}}, {}, 0, 0, WorkClass::comm));  // 0.9 / 0.9 = 1.0 s
  e.add_task(make_task("plain", {{other, 3.0}}, {}, 0, 0, WorkClass::none));
  e.run();
  expect_rel(e.task(2).end, 1.0);
  // At 1.0 each GEMM has 1 - 0.4 = 0.6 left; then 0.5 each: 1.2 s more.
  expect_rel(e.task(0).end, 2.2);
  EXPECT_EQ(e.task(0).end, e.task(1).end);
  EXPECT_DOUBLE_EQ(e.task(3).end, 3.0);

  Engine same;  // same class on one GPU: sharing only
  same.set_interference(WorkClass::compute, 0.5);
  const int s2 = same.add_resource("sm", 1.0), s3 = same.add_resource("sm-b", 1.0);
  same.add_task(make_task("g1", {{s2, 1.0}}, {}, 0, 0, WorkClass::compute));
  same.add_task(make_task("g2", {{s3, 2.0}}, {}, 0, 0, WorkClass::compute));
  same.run();
  EXPECT_DOUBLE_EQ(same.task(0).end, 1.0);
  EXPECT_DOUBLE_EQ(same.task(1).end, 2.0);
}

TEST(SimEngine, AllToAllMatchesTheAlphaBetaFormula) {
  const double B = 25e9, s = 3.7e6, alpha = 7e-6;
  for (int n : {2, 4, 8}) {
    Engine e;
    std::vector<int> out, in;
    for (int r = 0; r < n; ++r) {
      out.push_back(e.add_resource("out" + std::to_string(r), B));
      in.push_back(e.add_resource("in" + std::to_string(r), B));
    }
    for (int src = 0; src < n; ++src)
      for (int dst = 0; dst < n; ++dst)
        if (src != dst)
          e.add_task(make_task("f" + std::to_string(src) + "_" + std::to_string(dst),
                               {{out[static_cast<std::size_t>(src)], s}, {in[static_cast<std::size_t>(dst)], s}}, {},
                               alpha, src, WorkClass::comm));
    e.run();
    const double expected = alpha + (n - 1) * s / B;
    for (std::size_t i = 0; i < e.num_tasks(); ++i) {
      expect_rel(e.task(static_cast<int>(i)).end, expected, "N=" + std::to_string(n));
      EXPECT_EQ(e.task(static_cast<int>(i)).end, e.task(0).end);  // one event ends them all
    }
    for (int r = 0; r < n; ++r) expect_rel(e.busy_time(out[static_cast<std::size_t>(r)]), (n - 1) * s / B);
  }
}

TEST(SimEngine, ZeroWorkTasksEndAtTheirStart) {
  Engine e;
  const int r = e.add_resource("r", 1.0);
  const int a = e.add_task(make_task("a", {{r, 1.0}}));
  const int b = e.add_task(make_task("marker", {}, {a}, 0.25));
  const int c = e.add_task(make_task("zero", {{r, 0.0}}, {b}, 0.5));
  const int d = e.add_task(make_task("after", {{r, 2.0}}, {c}));
  e.run();
  EXPECT_DOUBLE_EQ(e.task(b).start, 1.25);
  EXPECT_DOUBLE_EQ(e.task(b).end, 1.25);
  EXPECT_DOUBLE_EQ(e.task(c).end, 1.75);
  EXPECT_DOUBLE_EQ(e.task(d).end, 3.75);
  EXPECT_DOUBLE_EQ(e.busy_time(r), 3.0);
}

TEST(SimEngine, ReadyIsTheLatestDependencyEnd) {
  Engine e;
  const int r0 = e.add_resource("r0", 1.0), r1 = e.add_resource("r1", 1.0);
  const int join = e.add_task(make_task("join", {{r0, 1.0}}, {2, 1}, 0.5));  // deps listed before they exist
  e.add_task(make_task("short", {{r0, 1.0}}));
  e.add_task(make_task("long", {{r1, 3.0}}));
  e.run();
  EXPECT_DOUBLE_EQ(e.task(join).ready, 3.0);
  EXPECT_DOUBLE_EQ(e.task(join).start, 3.5);
  EXPECT_DOUBLE_EQ(e.task(join).end, 4.5);
}

TEST(SimEngine, RepeatedDemandsOnOneResourceAdd) {
  Engine e;
  const int r = e.add_resource("r", 2.0);
  e.add_task(make_task("split", {{r, 1.0}, {r, 3.0}}));
  e.run();
  EXPECT_DOUBLE_EQ(e.task(0).end, 2.0);
}

// Random DAGs: no task beats its alone time, no resource delivers more than its capacity
// while busy, and every task starts latency after its last dependency.
TEST(SimEngine, RandomGraphsRespectCapacitiesAndDependencies) {
  std::mt19937_64 rng(2024);
  auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  Engine e;
  e.set_interference(WorkClass::compute, 0.7);
  e.set_interference(WorkClass::comm, 0.85);
  const int nres = 12;
  for (int r = 0; r < nres; ++r) e.add_resource("r" + std::to_string(r), uniform(0.5, 4.0));
  std::vector<double> alone;
  for (int i = 0; i < 400; ++i) {
    std::vector<Demand> dem;
    const auto nd = static_cast<int>(rng() % 4);
    double t_alone = 0;
    for (int k = 0; k < nd; ++k) {
      const auto r = static_cast<int>(rng() % nres);
      const double a = uniform(0.0, 2.0);
      dem.push_back({r, a});
      t_alone = std::max(t_alone, a / e.resource_capacity(r));
    }
    std::vector<int> deps;
    for (int k = 0; k < 3 && i > 0; ++k)
      if (rng() % 2) deps.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(i)));
    const auto cls = static_cast<WorkClass>(rng() % 4);
    e.add_task(make_task("t" + std::to_string(i), dem, deps, uniform(0.0, 0.1), static_cast<int>(rng() % 3), cls));
    alone.push_back(t_alone);
  }
  e.run();
  std::vector<double> total(nres, 0.0);
  for (std::size_t i = 0; i < e.num_tasks(); ++i) {
    const Task& t = e.task(static_cast<int>(i));
    double ready = 0;
    for (int d : t.deps) ready = std::max(ready, e.task(d).end);
    EXPECT_EQ(t.ready, ready);
    EXPECT_EQ(t.start, t.ready + t.latency);
    EXPECT_GE(t.end - t.start, alone[i] * (1 - 1e-9)) << t.name;
    for (const Demand& d : t.demands) total[static_cast<std::size_t>(d.resource)] += d.amount;
  }
  for (int r = 0; r < nres; ++r) {
    EXPECT_LE(total[static_cast<std::size_t>(r)], e.resource_capacity(r) * e.busy_time(r) * (1 + 1e-9)) << r;
    EXPECT_LE(e.busy_time(r), e.makespan());
  }
}

// ---- against a brute-force reference ---------------------------------------------------------

// The model written the plainest way: at every event, every active task's fair speed is
// recomputed from scratch by progressive filling over all resources, and time advances to
// the next start or finish. No components, no reuse, no tolerances beyond the obvious.
std::vector<double> reference_ends(const Engine& e) {
  const std::size_t n = e.num_tasks(), nr = e.num_resources();
  std::vector<double> alone(n, 0), rem(n, 0), start(n, kInf), end(n, kInf);
  std::vector<std::vector<std::pair<std::size_t, double>>> share(n);  // (resource, share)
  auto cap = [&](std::size_t r) { return e.resource_capacity(static_cast<int>(r)); };
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<double> amount(nr, 0);
    for (const Demand& d : e.task(static_cast<int>(i)).demands)
      amount[static_cast<std::size_t>(d.resource)] += d.amount;
    for (std::size_t r = 0; r < nr; ++r) alone[i] = std::max(alone[i], amount[r] / cap(r));
    for (std::size_t r = 0; r < nr; ++r)
      if (amount[r] > 0) share[i].emplace_back(r, amount[r] / cap(r) / alone[i]);
    rem[i] = alone[i];
  }
  std::vector<bool> started(n, false), ended(n, false);
  double t = 0;
  for (;;) {
    // Starts: every task whose dependencies have all ended.
    bool progress = true;
    while (progress) {
      progress = false;
      for (std::size_t i = 0; i < n; ++i) {
        if (started[i]) continue;
        const Task& ti = e.task(static_cast<int>(i));
        double ready = 0;
        bool ok = true;
        for (int d : ti.deps) {
          ok = ok && ended[static_cast<std::size_t>(d)];
          if (ok) ready = std::max(ready, end[static_cast<std::size_t>(d)]);
        }
        if (!ok || ready + ti.latency > t) continue;
        started[i] = true;
        start[i] = ready + ti.latency;
        if (alone[i] == 0) {
          end[i] = start[i];
          ended[i] = true;
          progress = true;
        }
      }
    }
    std::vector<std::size_t> act;
    for (std::size_t i = 0; i < n; ++i)
      if (started[i] && !ended[i]) act.push_back(i);
    // Progressive filling over all active tasks.
    std::vector<double> fair(n, -1), used(nr, 0);
    std::size_t open = act.size();
    double level = 0;
    while (open > 0) {
      double best = kInf;
      for (std::size_t r = 0; r < nr; ++r) {
        double w = 0;
        for (std::size_t i : act)
          for (const auto& [rr, s] : share[i])
            if (rr == r && fair[i] < 0) w += s;
        if (w > 0) best = std::min(best, (1 - used[r]) / w);
      }
      level = std::max(level, best);
      for (std::size_t r = 0; r < nr; ++r) {
        double w = 0;
        for (std::size_t i : act)
          for (const auto& [rr, s] : share[i])
            if (rr == r && fair[i] < 0) w += s;
        if (w > 0 && (1 - used[r]) / w <= level * (1 + 1e-12))
          for (std::size_t i : act)
            for (const auto& [rr, s] : share[i])
              if (rr == r && fair[i] < 0) {
                fair[i] = level;
                --open;
                for (const auto& [r2, s2] : share[i]) used[r2] += level * s2;
              }
      }
    }
    // Interference, then the next event.
    std::vector<double> x(n, 0);
    double next = kInf;
    for (std::size_t i : act) {
      const Task& ti = e.task(static_cast<int>(i));
      bool slowed = false;
      if (ti.gpu >= 0 && ti.cls != WorkClass::none)
        for (std::size_t j : act) {
          const Task& tj = e.task(static_cast<int>(j));
          slowed = slowed || (j != i && tj.gpu == ti.gpu && tj.cls != WorkClass::none && tj.cls != ti.cls);
        }
      x[i] = fair[i] * (slowed ? e.interference(ti.cls) : 1.0);
      next = std::min(next, t + rem[i] / x[i]);
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (started[i]) continue;
      const Task& ti = e.task(static_cast<int>(i));
      double ready = 0;
      bool ok = true;
      for (int d : ti.deps) {
        ok = ok && ended[static_cast<std::size_t>(d)];
        if (ok) ready = std::max(ready, end[static_cast<std::size_t>(d)]);
      }
      if (ok) next = std::min(next, ready + ti.latency);
    }
    if (next == kInf) break;
    for (std::size_t i : act) {
      rem[i] -= x[i] * (next - t);
      if (rem[i] <= 1e-12 * alone[i]) {
        end[i] = next;
        ended[i] = true;
      }
    }
    t = next;
  }
  return end;
}

TEST(SimEngine, MatchesABruteForceReferenceOnRandomGraphs) {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937_64 rng(seed);
    auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * static_cast<double>(rng() >> 11) * 0x1.0p-53; };
    Engine e;
    e.set_interference(WorkClass::compute, 0.75);
    e.set_interference(WorkClass::comm, 0.9);
    e.set_interference(WorkClass::memcpy, 0.6);
    const int nres = 2 + static_cast<int>(rng() % 6);
    for (int r = 0; r < nres; ++r) e.add_resource("r" + std::to_string(r), uniform(0.5, 3.0));
    const int ntask = 10 + static_cast<int>(rng() % 50);
    for (int i = 0; i < ntask; ++i) {
      Task t;
      t.name = "t" + std::to_string(i);
      const auto nd = static_cast<int>(rng() % 4);
      for (int k = 0; k < nd; ++k) {
        // Some amounts repeat exactly, so that ties (tasks ending together) occur.
        const double a = rng() % 3 == 0 ? 1.0 : uniform(0.05, 2.0);
        t.demands.push_back({static_cast<int>(rng() % static_cast<std::uint64_t>(nres)), a});
      }
      for (int k = 0; k < 2 && i > 0; ++k)
        if (rng() % 3 == 0) t.deps.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(i)));
      t.latency = rng() % 2 ? 0.0 : uniform(0.0, 0.5);
      t.gpu = static_cast<int>(rng() % 3) - 1;
      t.cls = static_cast<WorkClass>(rng() % 4);
      e.add_task(t);
    }
    e.run();
    const std::vector<double> ref = reference_ends(e);
    for (std::size_t i = 0; i < e.num_tasks(); ++i)
      EXPECT_NEAR(e.task(static_cast<int>(i)).end, ref[i], 1e-9 * std::max(1.0, ref[i]))
          << "seed " << seed << " task " << i;
  }
}

// ---- determinism ----------------------------------------------------------------------------

// A small MoE-like step on 4 GPUs: a GEMM per GPU, an all-to-all of uneven flows that each
// wait for their source's GEMM, a second GEMM per GPU after all its incoming flows, and a
// background GEMM per GPU overlapping the communication (interference). `gpu0`, `scale` and
// `prefix` make a copy on other GPUs with other sizes.
struct Spec {
  std::string name;
  std::vector<std::pair<std::string, double>> demands;
  std::vector<std::string> deps;
  double latency = 0;
  int gpu = -1;
  WorkClass cls = WorkClass::none;
};

void moe_like(const std::string& prefix, int gpu0, double scale, std::vector<std::pair<std::string, double>>& res,
              std::vector<Spec>& tasks) {
  const int n = 4;
  auto g = [&](int r) { return prefix + std::to_string(r); };
  for (int r = 0; r < n; ++r) {
    res.emplace_back(g(r) + ".sm", 1.0);
    res.emplace_back(g(r) + ".out", 10.0);
    res.emplace_back(g(r) + ".in", 10.0);
  }
  for (int r = 0; r < n; ++r) {
    tasks.push_back({g(r) + ".gemm1", {{g(r) + ".sm", scale * 0.1 * (r + 1)}}, {}, 1e-5, gpu0 + r, WorkClass::compute});
    tasks.push_back({g(r) + ".bg", {{g(r) + ".sm", scale * 0.9}}, {}, 0.0, gpu0 + r, WorkClass::compute});
  }
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d)
      if (s != d) {
        const double bytes = scale * 0.37 * (s * n + d + 1);
        tasks.push_back({g(s) + ">" + g(d), {{g(s) + ".out", bytes}, {g(d) + ".in", bytes}}, {g(s) + ".gemm1"}, 2e-6,
                         gpu0 + s, WorkClass::comm});
      }
  for (int d = 0; d < n; ++d) {
    Spec t{g(d) + ".gemm2", {{g(d) + ".sm", scale * 0.2}}, {g(d) + ".gemm1"}, 1e-5, gpu0 + d, WorkClass::compute};
    for (int s = 0; s < n; ++s)
      if (s != d) t.deps.push_back(g(s) + ">" + g(d));
    tasks.push_back(t);
  }
}

// Builds an engine from specs inserted in the given orders; returns name -> task id.
std::map<std::string, int> build(Engine& e, const std::vector<std::pair<std::string, double>>& res,
                                 const std::vector<std::size_t>& res_order, const std::vector<Spec>& tasks,
                                 const std::vector<std::size_t>& task_order) {
  e.set_interference(WorkClass::compute, 0.8);
  e.set_interference(WorkClass::comm, 0.9);
  std::map<std::string, int> rid, tid;
  for (std::size_t k : res_order) rid[res[k].first] = e.add_resource(res[k].first, res[k].second);
  for (std::size_t pos = 0; pos < task_order.size(); ++pos) tid[tasks[task_order[pos]].name] = static_cast<int>(pos);
  for (std::size_t k : task_order) {
    const Spec& s = tasks[k];
    Task t = make_task(s.name, {}, {}, s.latency, s.gpu, s.cls);
    for (const auto& [r, a] : s.demands) t.demands.push_back({rid.at(r), a});
    for (const auto& d : s.deps) t.deps.push_back(tid.at(d));
    e.add_task(t);
  }
  return tid;
}

TEST(SimEngine, SameGraphGivesBitIdenticalTimes) {
  std::vector<std::pair<std::string, double>> res;
  std::vector<Spec> tasks;
  moe_like("g", 0, 1.0, res, tasks);
  std::vector<std::size_t> ro(res.size()), to(tasks.size());
  std::iota(ro.begin(), ro.end(), 0);
  std::iota(to.begin(), to.end(), 0);
  Engine a, b;
  build(a, res, ro, tasks, to);
  build(b, res, ro, tasks, to);
  a.run();
  b.run();
  for (std::size_t i = 0; i < a.num_tasks(); ++i) {
    EXPECT_EQ(a.task(static_cast<int>(i)).start, b.task(static_cast<int>(i)).start);
    EXPECT_EQ(a.task(static_cast<int>(i)).end, b.task(static_cast<int>(i)).end);
  }
  const double first = a.makespan();
  a.run();  // running again recomputes the same times
  EXPECT_EQ(a.makespan(), first);
  for (std::size_t r = 0; r < a.num_resources(); ++r)
    EXPECT_EQ(a.busy_time(static_cast<int>(r)), b.busy_time(static_cast<int>(r)));
}

TEST(SimEngine, UnrelatedTasksDoNotChangeTheTimesOfOthers) {
  std::vector<std::pair<std::string, double>> res;
  std::vector<Spec> tasks;
  moe_like("g", 0, 1.0, res, tasks);
  const std::size_t nres_related = res.size(), ntask_related = tasks.size();
  moe_like("h", 10, 1.37, res, tasks);  // other GPUs, other resources, interleaving event times

  // Alone: only the related graph.
  std::vector<std::size_t> ro(nres_related), to(ntask_related);
  std::iota(ro.begin(), ro.end(), 0);
  std::iota(to.begin(), to.end(), 0);
  Engine alone;
  const auto id_alone = build(alone, res, ro, tasks, to);
  alone.run();

  // With the unrelated graph, inserted in two different ways: after the related tasks, and
  // shuffled in between them (the related ones keep their relative order).
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<std::size_t> ro2(res.size()), to2;
    std::iota(ro2.begin(), ro2.end(), 0);
    if (variant == 0) {
      to2.resize(tasks.size());
      std::iota(to2.begin(), to2.end(), 0);
    } else {
      std::rotate(ro2.begin(), ro2.begin() + static_cast<std::ptrdiff_t>(nres_related), ro2.end());
      std::vector<std::size_t> unrelated;
      for (std::size_t k = ntask_related; k < tasks.size(); ++k) unrelated.push_back(k);
      std::mt19937_64 rng(99);
      for (std::size_t k = unrelated.size(); k > 1; --k) std::swap(unrelated[k - 1], unrelated[rng() % k]);
      std::size_t u = 0;
      for (std::size_t k = 0; k < ntask_related; ++k) {
        to2.push_back(k);
        if (k % 2 == 0 && u < unrelated.size()) to2.push_back(unrelated[u++]);
      }
      while (u < unrelated.size()) to2.push_back(unrelated[u++]);
    }
    Engine both;
    const auto id_both = build(both, res, ro2, tasks, to2);
    both.run();
    for (std::size_t k = 0; k < ntask_related; ++k) {
      const Task& x = alone.task(id_alone.at(tasks[k].name));
      const Task& y = both.task(id_both.at(tasks[k].name));
      EXPECT_EQ(x.start, y.start) << x.name << " variant " << variant;
      EXPECT_EQ(x.end, y.end) << x.name << " variant " << variant;
    }
  }
}

// ---- errors ---------------------------------------------------------------------------------

TEST(SimEngine, CycleIsRejectedNamingATaskInIt) {
  Engine e;
  const int r = e.add_resource("r", 1.0);
  e.add_task(make_task("free", {{r, 1.0}}));
  e.add_task(make_task("cyc_a", {{r, 1.0}}, {3}));
  e.add_task(make_task("cyc_b", {{r, 1.0}}, {1}));
  e.add_task(make_task("cyc_c", {{r, 1.0}}, {2}));
  e.add_task(make_task("downstream", {{r, 1.0}}, {3}));
  const std::string msg = what_of([&] { e.run(); });
  EXPECT_NE(msg.find("cycle"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cyc_"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("downstream"), std::string::npos) << msg;

  Engine self;
  self.add_task(make_task("me", {}, {0}));
  EXPECT_NE(what_of([&] { self.run(); }).find("'me'"), std::string::npos);
}

TEST(SimEngine, BadInputThrowsInvalidArgument) {
  {
    Engine e;
    e.add_task(make_task("t", {}, {5}));
    const std::string msg = what_of([&] { e.run(); });
    EXPECT_NE(msg.find("unknown task id 5"), std::string::npos) << msg;
  }
  {
    Engine e;
    e.add_task(make_task("t", {}, {-1}));
    EXPECT_THROW(e.run(), std::invalid_argument);
  }
  {
    Engine e;
    EXPECT_THROW(e.add_resource("zero", 0.0), std::invalid_argument);
    EXPECT_THROW(e.add_resource("negative", -1.0), std::invalid_argument);
    EXPECT_THROW(e.add_resource("nan", std::nan("")), std::invalid_argument);
    EXPECT_EQ(e.num_resources(), 0u);
  }
  {
    Engine e;
    EXPECT_THROW(e.set_interference(WorkClass::compute, 1.5), std::invalid_argument);
    EXPECT_THROW(e.set_interference(WorkClass::comm, 0.0), std::invalid_argument);
    EXPECT_THROW(e.set_interference(WorkClass::none, 0.5), std::invalid_argument);
    EXPECT_EQ(e.interference(WorkClass::compute), 1.0);
    EXPECT_NO_THROW(e.set_interference(WorkClass::memcpy, 1.0));
  }
  {
    Engine e;
    const int r = e.add_resource("r", 1.0);
    e.add_task(make_task("neg", {{r, -1.0}}));
    const std::string msg = what_of([&] { e.run(); });
    EXPECT_NE(msg.find("'neg'"), std::string::npos) << msg;
  }
  {
    Engine e;
    e.add_resource("r", 1.0);
    e.add_task(make_task("badres", {{3, 1.0}}));
    EXPECT_THROW(e.run(), std::invalid_argument);
  }
  {
    Engine e;
    e.add_task(make_task("late", {}, {}, -1.0));
    EXPECT_THROW(e.run(), std::invalid_argument);
  }
}

TEST(SimEngine, EmptyGraph) {
  Engine e;
  const int r = e.add_resource("r", 1.0);
  e.run();
  EXPECT_EQ(e.makespan(), 0.0);
  EXPECT_EQ(e.busy_time(r), 0.0);
  EXPECT_STREQ(work_class_name(WorkClass::memcpy), "memcpy");
}

}  // namespace
}  // namespace moelab::sim
