// harness/tests/pipeline_schedule_test.cpp — pipeline schedules as data: every generator's
// schedule is valid for many sizes and has the published bubble and memory (timing estimate
// with unit costs); the validator rejects each class of broken schedule with a one-line error
// naming the node.
//   ctest --test-dir build -R pipeline_schedule_test
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "harness/pipeline/schedule.hpp"
#include "harness/runtime/error.hpp"

namespace moelab::pipeline {
namespace {

// The ConfigError message validate() throws, or "" when the schedule is valid.
std::string rejection(const Schedule& s) {
  try {
    validate(s);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

int count(const Schedule& s, int stage, NodeKind k) {
  const auto& l = s.nodes[static_cast<std::size_t>(stage)];
  return static_cast<int>(std::count_if(l.begin(), l.end(), [&](const Node& n) { return n.kind == k; }));
}

TEST(PipelineSchedule, EveryGeneratorIsValidForManySizes) {
  for (const auto& name : schedule_names())
    for (int p = 1; p <= 5; ++p)
      for (int m = 1; m <= 10; ++m) {
        if (name == "interleaved" && m % p != 0) continue;
        for (int v : name == "interleaved" ? std::vector<int>{2, 3} : std::vector<int>{0}) {
          SCOPED_TRACE(name + " p=" + std::to_string(p) + " m=" + std::to_string(m) + " v=" + std::to_string(v));
          Schedule s;
          ASSERT_NO_THROW(s = make_schedule(name, p, m, v));
          const ScheduleAnalysis a = validate(s);
          for (int st = 0; st < p; ++st) {
            EXPECT_EQ(count(s, st, NodeKind::forward), m * s.chunks);
            EXPECT_EQ(count(s, st, NodeKind::backward_input), m * s.chunks);
            EXPECT_EQ(count(s, st, NodeKind::backward_weight), m * s.chunks);
            EXPECT_EQ(count(s, st, NodeKind::optimizer), 1);
            EXPECT_EQ(s.nodes[static_cast<std::size_t>(st)].back().kind, NodeKind::optimizer);
            EXPECT_GE(a.peak_in_flight[static_cast<std::size_t>(st)], 1);
          }
        }
      }
}

// Unit-cost estimates against the papers' formulas: GPipe and 1F1B idle (p-1)(F+B+W) of a
// makespan (m+p-1)(F+B+W), so bubble (p-1)/(m+p-1) on every stage (Narayanan et al. 2021
// §2.2.1); 1F1B keeps p-s microbatches in flight on stage s, GPipe all m.
TEST(PipelineSchedule, GPipeAnd1F1BHaveTheBubbleOfThePapers) {
  const NodeCosts c{1.0, 1.5, 0.5, 0.0};
  for (int p : {2, 4, 5})
    for (int m : {p, 2 * p + 1, 16}) {
      const double want = static_cast<double>(p - 1) / (m + p - 1);
      for (const char* name : {"gpipe", "1f1b"}) {
        const Schedule s = make_schedule(name, p, m);
        const ScheduleEstimate e = estimate(s, c);
        EXPECT_NEAR(e.makespan, (m + p - 1) * 3.0, 1e-9) << name << " p=" << p << " m=" << m;
        for (double b : e.bubble) EXPECT_NEAR(b, want, 1e-9) << name;
        const ScheduleAnalysis a = validate(s);
        for (int st = 0; st < p; ++st)
          EXPECT_EQ(a.peak_in_flight[static_cast<std::size_t>(st)], std::string(name) == "gpipe" ? m : std::min(m, p - st))
              << name << " stage " << st;
      }
    }
}

// Interleaving v chunks shrinks the bubble by v: (p-1)/v of a chunk-sized warm-up over
// m + (p-1)/v, i.e. (p-1)/(v·m + p-1) (Narayanan et al. 2021 §2.2.2), with the chunks' costs
// 1/v of a stage's.
TEST(PipelineSchedule, InterleavingDividesTheBubbleByTheChunks) {
  for (int p : {2, 4})
    for (int v : {2, 3})
      for (int m : {p, 2 * p, 4 * p}) {
        const Schedule s = make_schedule("interleaved", p, m, v);
        const double f = 1.0 / v;
        const ScheduleEstimate e = estimate(s, {f, f, f, 0.0});
        const double want = static_cast<double>(p - 1) / (v * m + p - 1);
        EXPECT_NEAR(e.mean_bubble(), want, 1e-9) << "p=" << p << " v=" << v << " m=" << m;
        EXPECT_LT(e.mean_bubble(), static_cast<double>(p - 1) / (m + p - 1));
      }
}

// ZB-H1 idles (p-1)(F+B-W) where 1F1B idles (p-1)(F+B+W): a third of it at equal costs
// (Qi et al. 2024, §3.1), with no more microbatches in flight on the first stage than 1F1B.
TEST(PipelineSchedule, ZeroBubbleH1IdlesAThirdOf1F1B) {
  for (int p : {2, 3, 4, 6})
    for (int m : {p, 2 * p, 3 * p + 1}) {
      const Schedule zb = make_schedule("zb-h1", p, m);
      const ScheduleEstimate e = estimate(zb, {1, 1, 1, 0});
      EXPECT_NEAR(e.makespan - 3.0 * m, (p - 1) * 1.0, 1e-9) << "p=" << p << " m=" << m;
      const ScheduleEstimate f = estimate(make_schedule("1f1b", p, m), {1, 1, 1, 0});
      EXPECT_NEAR((f.makespan - 3.0 * m) / (e.makespan - 3.0 * m), 3.0, 1e-9);
      EXPECT_LE(validate(zb).peak_in_flight[0], std::min(p, m));
    }
}

// ZB-V: the V-shape over two chunks keeps 1F1B's activation memory (2p chunk-microbatches of
// half a stage each) and idles less than ZB-H1 once there are enough microbatches.
TEST(PipelineSchedule, ZeroBubbleVKeepsMemoryAndBeatsH1) {
  for (int p : {2, 4})
    for (int m : {2 * p, 4 * p}) {
      const Schedule zv = make_schedule("zb-v", p, m);
      EXPECT_EQ(zv.placement, Placement::vshape);
      const ScheduleAnalysis a = validate(zv);
      for (int x : a.peak_in_flight) EXPECT_LE(x, 2 * p);
      const ScheduleEstimate e = estimate(zv, {0.5, 0.5, 0.5, 0});
      const ScheduleEstimate h = estimate(make_schedule("zb-h1", p, m), {1, 1, 1, 0});
      EXPECT_LT(e.mean_bubble(), h.mean_bubble()) << "p=" << p << " m=" << m;
    }
  // The V's turn is on the last stage: no send between its two chunks.
  const Schedule zv = make_schedule("zb-v", 3, 6);
  EXPECT_EQ(zv.place(2), (std::pair<int, int>{2, 0}));
  EXPECT_EQ(zv.place(3), (std::pair<int, int>{2, 1}));
  EXPECT_EQ(zv.place(5), (std::pair<int, int>{0, 1}));
  EXPECT_EQ(count(zv, 2, NodeKind::send_act), 6);  // chunk 1 down to stage 1 only
}

// A send's tensor is released once a later receive shows the peer got it; in 1F1B's steady
// state that is the next receive from that peer.
TEST(PipelineSchedule, SendsAreKnownDoneByALaterReceive) {
  const Schedule s = make_schedule("1f1b", 4, 8);
  const ScheduleAnalysis a = validate(s);
  int known = 0, total = 0;
  for (int st = 0; st < 4; ++st) {
    const auto& l = s.nodes[static_cast<std::size_t>(st)];
    for (std::size_t i = 0; i < l.size(); ++i) {
      const int at = a.send_done_at[static_cast<std::size_t>(st)][i];
      if (l[i].kind != NodeKind::send_act && l[i].kind != NodeKind::send_grad) {
        EXPECT_EQ(at, -1);
        continue;
      }
      ++total;
      if (at < 0) continue;
      ++known;
      EXPECT_GT(at, static_cast<int>(i));
      const NodeKind k = l[static_cast<std::size_t>(at)].kind;
      EXPECT_TRUE(k == NodeKind::recv_act || k == NodeKind::recv_grad) << describe(l[static_cast<std::size_t>(at)]);
    }
  }
  EXPECT_GT(known, total / 2);
}

TEST(PipelineSchedule, BadNamesAndSizesAreConfigErrors) {
  auto msg = [](auto f) {
    try {
      f();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg([] { make_schedule("1fb1", 2, 4); }).find("did you mean \"1f1b\""), std::string::npos);
  EXPECT_NE(msg([] { make_schedule("interleaved", 4, 6, 2); }).find("multiple of pp = 4"), std::string::npos);
  EXPECT_NE(msg([] { make_schedule("1f1b", 2, 4, 2); }).find("--chunks = 2"), std::string::npos);
  EXPECT_NE(msg([] { make_schedule("zb-v", 2, 4, 3); }).find("2 chunks"), std::string::npos);
  EXPECT_NE(msg([] { make_schedule("gpipe", 2, 0); }).find("--microbatches = 0"), std::string::npos);
  EXPECT_NE(msg([] { make_schedule("interleaved", 2, 4, 1); }).find("--chunks = 1"), std::string::npos);
}

// ---- the validator's rejections, one class each --------------------------------------------

Node n(NodeKind k, int mb, int c = 0) { return {k, mb, c}; }
constexpr auto kF = NodeKind::forward, kB = NodeKind::backward_input, kW = NodeKind::backward_weight,
               kSA = NodeKind::send_act, kRA = NodeKind::recv_act, kSG = NodeKind::send_grad,
               kRG = NodeKind::recv_grad, kOpt = NodeKind::optimizer;

// Two stages, two microbatches, written out by hand (1F1B order).
Schedule two_stages() {
  Schedule s;
  s.name = "hand";
  s.stages = 2;
  s.microbatches = 2;
  s.nodes = {{n(kF, 0), n(kSA, 0), n(kF, 1), n(kSA, 1), n(kRG, 0), n(kB, 0), n(kW, 0), n(kRG, 1), n(kB, 1), n(kW, 1),
              n(kOpt, -1)},
             {n(kRA, 0), n(kF, 0), n(kB, 0), n(kSG, 0), n(kW, 0), n(kRA, 1), n(kF, 1), n(kB, 1), n(kSG, 1), n(kW, 1),
              n(kOpt, -1)}};
  return s;
}

void expect_rejected(const Schedule& s, const std::vector<std::string>& parts) {
  const std::string m = rejection(s);
  ASSERT_FALSE(m.empty()) << "accepted";
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "\"" << p << "\" not in: " << m;
}

TEST(PipelineValidator, AcceptsTheHandWrittenSchedule) { EXPECT_EQ(rejection(two_stages()), ""); }

TEST(PipelineValidator, RejectsBBeforeItsF) {
  Schedule s = two_stages();
  std::swap(s.nodes[1][1], s.nodes[1][2]);  // B mb 0 before F mb 0 on stage 1
  expect_rejected(s, {"stage 1, position 1 (B mb 0 chunk 0)", "B before its F"});
}

TEST(PipelineValidator, RejectsWBeforeItsB) {
  Schedule s = two_stages();
  std::swap(s.nodes[0][5], s.nodes[0][6]);  // W mb 0 before B mb 0 on stage 0
  expect_rejected(s, {"stage 0, position 5 (W mb 0 chunk 0)", "W before its B"});
}

TEST(PipelineValidator, RejectsAnInputUsedBeforeItArrives) {
  Schedule s = two_stages();
  std::swap(s.nodes[1][5], s.nodes[1][6]);  // F mb 1 before its recv_act
  expect_rejected(s, {"stage 1, position 5 (F mb 1 chunk 0)", "uses its input before it exists", "no recv_act"});
  Schedule g = two_stages();
  std::swap(g.nodes[0][4], g.nodes[0][5]);  // B mb 0 before its recv_grad
  expect_rejected(g, {"stage 0, position 4 (B mb 0 chunk 0)", "output gradient before it exists"});
  Schedule x = two_stages();
  std::swap(x.nodes[0][0], x.nodes[0][1]);  // send_act before the F that makes it
  expect_rejected(x, {"stage 0, position 0 (send_act mb 0 chunk 0)", "before its F"});
}

TEST(PipelineValidator, RejectsAReceiveWithNoMatchingSend) {
  Schedule s = two_stages();
  s.nodes[0].insert(s.nodes[0].begin(), n(kRA, 0));  // virtual stage 0 receives nothing
  expect_rejected(s, {"stage 0, position 0 (recv_act mb 0 chunk 0)", "a receive with no matching send"});
  // Stage 0 sends mb 1 first, stage 1 expects mb 0 first.
  Schedule o = two_stages();
  o.nodes[0] = {n(kF, 1), n(kSA, 1), n(kF, 0), n(kSA, 0), n(kRG, 0), n(kB, 0), n(kW, 0), n(kRG, 1), n(kB, 1), n(kW, 1), n(kOpt, -1)};
  expect_rejected(o, {"stage 1, position 0 (recv_act mb 0 chunk 0)", "no matching send", "is microbatch 1"});
}

TEST(PipelineValidator, RejectsADeadlock) {
  Schedule s = two_stages();
  // Stage 1 wants microbatch 1's activation before it returns microbatch 0's gradient, while
  // stage 0 waits for that gradient before it sends microbatch 1.
  s.nodes[0] = {n(kF, 0), n(kSA, 0), n(kRG, 0), n(kB, 0), n(kW, 0), n(kF, 1), n(kSA, 1), n(kRG, 1), n(kB, 1), n(kW, 1), n(kOpt, -1)};
  s.nodes[1] = {n(kRA, 0), n(kF, 0), n(kRA, 1), n(kF, 1), n(kB, 0), n(kSG, 0), n(kW, 0), n(kB, 1), n(kSG, 1), n(kW, 1), n(kOpt, -1)};
  expect_rejected(s, {"deadlocks", "stage 0, position 2 (recv_grad mb 0 chunk 0) waits for stage 1",
                      "stage 1, position 2 (recv_act mb 1 chunk 0) waits for stage 0"});
}

TEST(PipelineValidator, RejectsAnUnfinishedMicrobatch) {
  Schedule s = two_stages();
  s.nodes[1].erase(s.nodes[1].begin() + 9);  // W mb 1 on stage 1
  expect_rejected(s, {"stage 1, position 7 (B mb 1 chunk 0)", "its W never runs", "microbatch 1 unfinished"});
  Schedule t = two_stages();
  t.nodes[1].erase(t.nodes[1].begin() + 8);  // stage 1 never sends mb 1's gradient
  expect_rejected(t, {"stage 1, position 7 (B mb 1 chunk 0)", "never sent", "microbatch 1 unfinished"});
  Schedule u = two_stages();
  u.nodes[0].erase(u.nodes[0].begin() + 2, u.nodes[0].begin() + 4);  // no F mb 1 at all on stage 0
  u.nodes[0].erase(u.nodes[0].begin() + 5, u.nodes[0].begin() + 8);
  expect_rejected(u, {"stage 0", "(F mb 1 chunk 0): never runs", "microbatch 1 unfinished"});
}

TEST(PipelineValidator, RejectsWorkTwiceOutOfRangeAndAfterTheOptimizer) {
  Schedule s = two_stages();
  s.nodes[0].insert(s.nodes[0].begin() + 7, n(kW, 0));
  expect_rejected(s, {"stage 0, position 7 (W mb 0 chunk 0)", "runs twice (first at position 6)"});
  Schedule r = two_stages();
  r.nodes[0][0].microbatch = 5;
  expect_rejected(r, {"stage 0, position 0 (F mb 5 chunk 0)", "out of range"});
  Schedule o = two_stages();
  std::swap(o.nodes[1][9], o.nodes[1][10]);
  expect_rejected(o, {"stage 1, position 10 (W mb 1 chunk 0)", "after the optimizer step"});
}

TEST(PipelineValidator, OffloadPlaceholdersAreChecked) {
  Schedule s = make_schedule("1f1b", 3, 6);
  add_offload(s, 1);
  EXPECT_EQ(rejection(s), "");
  EXPECT_EQ(count(s, 0, NodeKind::offload), 6);
  // A reload removed: the B would use offloaded activations.
  auto& l = s.nodes[1];
  l.erase(std::find_if(l.begin(), l.end(), [](const Node& x) { return x.kind == NodeKind::reload; }));
  expect_rejected(s, {"stage 1", "(B mb 0 chunk 0)", "offloaded"});
}

}  // namespace
}  // namespace moelab::pipeline
