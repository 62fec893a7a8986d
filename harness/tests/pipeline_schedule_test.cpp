// harness/tests/pipeline_schedule_test.cpp — pipeline schedules as data: every generator's
// schedule is valid for many sizes and has the published bubble and memory (timing estimate
// with unit costs); the validator rejects each class of broken schedule with a one-line error
// naming the node.
//   ctest --test-dir build -R pipeline_schedule_test
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

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

// The ConfigError message `f` throws, or "".
template <class F>
std::string config_error(F f) {
  try {
    f();
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
  EXPECT_NE(config_error([] { make_schedule("1fb1", 2, 4); }).find("did you mean \"1f1b\""), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("interleaved", 4, 6, 2); }).find("multiple of pp = 4"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("1f1b", 2, 4, 2); }).find("--chunks = 2"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("zb-v", 2, 4, 3); }).find("2 chunks"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("gpipe", 2, 0); }).find("--microbatches = 0"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("interleaved", 2, 4, 1); }).find("--chunks = 1"), std::string::npos);
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

OffloadOptions offload_options(int chunks, bool lifespan, double transfer = 0, NodeCosts costs = {}) {
  OffloadOptions o;
  o.chunks = chunks;
  o.d2h = o.h2d = transfer;
  o.costs = costs;
  o.lifespan = lifespan;
  return o;
}

TEST(PipelineValidator, OffloadPlaceholdersAreChecked) {
  Schedule s = make_schedule("1f1b", 3, 6);
  add_offload(s, offload_options(1, false));
  EXPECT_EQ(rejection(s), "");
  EXPECT_EQ(count(s, 0, NodeKind::offload), 6);
  // A reload removed: the B would use offloaded activations.
  auto& l = s.nodes[1];
  l.erase(std::find_if(l.begin(), l.end(), [](const Node& x) { return x.kind == NodeKind::reload; }));
  expect_rejected(s, {"stage 1", "(B mb 0 chunk 0)", "offloaded"});
  // A reload before its offload.
  Schedule r = two_stages();
  r.nodes[0].insert(r.nodes[0].begin() + 1, n(NodeKind::reload, 0));
  r.nodes[0].insert(r.nodes[0].begin() + 2, n(NodeKind::offload, 0));
  expect_rejected(r, {"stage 0, position 1 (reload mb 0 chunk 0)", "without an offload"});
}

// ---- group-interleaved 1F1B (PipeOffload) --------------------------------------------------

int compute_nodes(const Schedule& s, int stage) {
  return count(s, stage, NodeKind::forward) + count(s, stage, NodeKind::backward_input) +
         count(s, stage, NodeKind::backward_weight);
}

TEST(GroupInterleaved, IsValidForEveryGroupChunksAndMicrobatches) {
  for (int p : {1, 2, 3, 4, 5, 6, 7, 8, 12, 16})
    for (int v : {2, 3})
      for (int m : {p, 2 * p, 3 * p + 1})
        for (int g = (p + 1) / 2; g <= p; ++g) {
          SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m) + " g=" + std::to_string(g));
          Schedule s;
          ASSERT_NO_THROW(s = make_schedule("group-interleaved", p, m, v, g));
          EXPECT_EQ(s.group, g);
          EXPECT_EQ(s.chunks, v);
          EXPECT_TRUE(s.split_backward);  // the authors' zero-bubble runtime
          const ScheduleAnalysis a = validate(s);
          for (int st = 0; st < p; ++st) {
            EXPECT_EQ(compute_nodes(s, st), 3 * m * v);
            // The building block's warm-up: g(v-1) + p - s chunk-microbatches in flight.
            EXPECT_EQ(a.peak_in_flight[static_cast<std::size_t>(st)], std::min(g * (v - 1) + p - st, m * v)) << "stage " << st;
          }
        }
  // The default group is the authors' ceil(p/2); the default chunks 2.
  EXPECT_EQ(make_schedule("group-interleaved", 5, 10).group, 3);
  EXPECT_EQ(make_schedule("group-interleaved", 5, 10).chunks, 2);
  // Fewer microbatches than a group: the last group is partial.
  EXPECT_EQ(rejection(make_schedule("group-interleaved", 6, 1, 3, 4)), "");
}

// p = 4, v = 2, g = 2, stage 0 (slot 3g·c + 3i + d for F of chunk c, member i; the block is
// 3gv = 12 slots): F0.0 @0, F1.0 @3, F0.1 @6, F1.1 @9. Member 0's last F is at 6; the first B
// comes (p-1)·3 + 1 = 10 slots later, @16: B0.1 @16, B1.1 @19, B0.0 @22, B1.0 @25, each W a
// slot after. Group r adds 12r to each slot and 2r to each microbatch; groups 0..3 for m = 8
// sorted by slot (B.W written as a pair):
//   0 F0.0  3 F1.0  6 F0.1  9 F1.1  12 F2.0  15 F3.0  16 B0.1  18 F2.1  19 B1.1  21 F3.1
//   22 B0.0  24 F4.0  25 B1.0  27 F5.0  28 B2.1  30 F4.1  31 B3.1  33 F5.1  34 B2.0  36 F6.0
//   37 B3.0  39 F7.0  40 B4.1  42 F6.1  43 B5.1  45 F7.1  46 B4.0  49 B5.0  52 B6.1  55 B7.1
//   58 B6.0  61 B7.0  (group 4's F8.0 @48, F9.0 @51, ... are past m and dropped)
TEST(GroupInterleaved, FirstStageFollowsTheBuildingBlock) {
  const Schedule s = make_schedule("group-interleaved", 4, 8, 2, 2);
  const std::string want =
      "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 B0.0 W0.0 F4.0 B1.0 W1.0 F5.0 B2.1 W2.1 F4.1 "
      "B3.1 W3.1 F5.1 B2.0 W2.0 F6.0 B3.0 W3.0 F7.0 B4.1 W4.1 F6.1 B5.1 W5.1 F7.1 B4.0 W4.0 B5.0 W5.0 B6.1 W6.1 "
      "B7.1 W7.1 B6.0 W6.0 B7.0 W7.0";
  std::string got;
  for (const Node& x : s.nodes[0])
    if (x.kind == NodeKind::forward || x.kind == NodeKind::backward_input || x.kind == NodeKind::backward_weight)
      got += (got.empty() ? "" : " ") + std::string(node_kind_name(x.kind)) + std::to_string(x.microbatch) + "." + std::to_string(x.chunk);
  EXPECT_EQ(got, want);
}

// With g = p the order of every stage's forwards and backwards is Megatron's (microbatch
// groups of p, chunk by chunk), but the warm-up is p·v - s forwards, not Megatron's
// 2(p-s-1) + (v-1)p + 1: the same peak only on the last stage, p - 1 - s fewer elsewhere
// (stage 0: M_a, not (1 + (p-1)/(pv))·M_a), and at m = p Megatron runs every forward first.
// At F = 1, B + W = 2 (the block's slots) and free transfers the makespan is never longer than
// Megatron's (B's gradient leaves before its W); smaller groups hold less and idle more.
TEST(GroupInterleaved, FullGroupAgainstMegatronInterleaving) {
  for (int p : {2, 3, 4, 6, 8})
    for (int v : {2, 3})
      for (int m : {p, 2 * p, 4 * p}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m));
        const Schedule gi = make_schedule("group-interleaved", p, m, v, p), mt = make_schedule("interleaved", p, m, v);
        const ScheduleAnalysis a = validate(gi), b = validate(mt);
        for (int st = 0; st < p; ++st) {
          const std::size_t i = static_cast<std::size_t>(st);
          EXPECT_EQ(a.peak_in_flight[i], std::min(p * v - st, m * v));
          // Megatron's interleaving runs every forward first when m = p (all_warmup_microbatches).
          EXPECT_EQ(b.peak_in_flight[i], m == p ? m * v : std::min(p * v + p - 1 - 2 * st, m * v));
          EXPECT_LE(a.peak_in_flight[i], b.peak_in_flight[i]);
          if (st == p - 1 && m > p) {
            EXPECT_EQ(a.peak_in_flight[i], b.peak_in_flight[i]);
          }
          // Same forwards and backwards in the same order, once the warm-ups are set aside.
          auto order = [&](const Schedule& s, NodeKind k) {
            std::vector<Node> o;
            for (const Node& x : s.nodes[i])
              if (x.kind == k) o.push_back(x);
            return o;
          };
          EXPECT_EQ(order(gi, NodeKind::forward), order(mt, NodeKind::forward));
          EXPECT_EQ(order(gi, NodeKind::backward_input), order(mt, NodeKind::backward_input));
        }
        // B's gradient leaves before its W (split backward): never slower than Megatron's.
        EXPECT_LE(estimate(gi, {1, 1, 1, 0}).makespan, estimate(mt, {1, 1, 1, 0}).makespan + 1e-9);
        for (int g = (p + 1) / 2; g < p; ++g) {
          const Schedule sg = make_schedule("group-interleaved", p, m, v, g);
          const ScheduleAnalysis c = validate(sg);
          for (int st = 0; st < p; ++st) EXPECT_LE(c.peak_in_flight[static_cast<std::size_t>(st)], a.peak_in_flight[static_cast<std::size_t>(st)]);
          EXPECT_GE(estimate(sg, {1, 1, 1, 0}).makespan, estimate(gi, {1, 1, 1, 0}).makespan - 1e-9);
        }
      }
}

// The authors run the order with B's gradient sent before W (their zero-bubble runtime), as
// make_schedule does; with B and W one pass every chunk boundary of the backward would wait
// one W more: the same order joined idles more than Megatron's, split it does not.
TEST(GroupInterleaved, SplittingTheBackwardShortensTheSameOrder) {
  for (const auto& [p, m, v, g] : std::vector<std::tuple<int, int, int, int>>{{4, 16, 2, 2}, {8, 24, 2, 4}, {8, 24, 3, 4}}) {
    const Schedule s = make_schedule("group-interleaved", p, m, v, g);
    ASSERT_TRUE(s.split_backward);
    Schedule t = s;
    t.split_backward = false;
    for (auto& l : t.nodes)
      l.erase(std::remove_if(l.begin(), l.end(), [](const Node& x) {
                return x.kind != NodeKind::forward && x.kind != NodeKind::backward_input && x.kind != NodeKind::backward_weight;
              }), l.end());
    add_communication(t);
    const double split = estimate(s, {1, 1, 1, 0}).makespan, whole = estimate(t, {1, 1, 1, 0}).makespan;
    const double megatron = estimate(make_schedule("interleaved", p, m, v), {1, 1, 1, 0}).makespan;
    EXPECT_LT(split, whole) << "p=" << p << " g=" << g;
    EXPECT_GT(whole, megatron) << "p=" << p << " g=" << g;
    EXPECT_LE(split, megatron + 1.0 + 1e-9) << "p=" << p << " g=" << g;
  }
}

TEST(GroupInterleaved, BadGroupsAndChunksAreConfigErrors) {
  EXPECT_NE(config_error([] { make_schedule("group-interleaved", 8, 16, 2, 3); }).find("--group = 3 must be from 4 to 8"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("group-interleaved", 8, 16, 2, 9); }).find("--group = 9"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("interleaved", 4, 8, 2, 2); }).find("--group = 2 applies to group-interleaved"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("group-interleaved", 4, 8, 1); }).find("--chunks = 1"), std::string::npos);
  EXPECT_NE(config_error([] { make_schedule("group-interleave", 4, 8); }).find("did you mean \"group-interleaved\""), std::string::npos);
}

// ---- the offload pass and the estimate with transfers --------------------------------------

// Per stage: most (microbatch, chunk) pairs of chunks >= k between their F and W at once.
std::vector<int> peak_kept(const Schedule& s, int k) {
  std::vector<int> out;
  for (const auto& l : s.nodes) {
    int now = 0, peak = 0;
    for (const Node& x : l) {
      if (x.chunk < k) continue;
      if (x.kind == NodeKind::forward) ++now;
      if (x.kind == NodeKind::backward_weight) --now;
      peak = std::max(peak, now);
    }
    out.push_back(peak);
  }
  return out;
}

// The compute nodes' times of a stage, in order.
std::vector<std::pair<double, double>> compute_times(const Schedule& s, const ScheduleEstimate& e, int st) {
  std::vector<std::pair<double, double>> out;
  const auto& l = s.nodes[static_cast<std::size_t>(st)];
  for (std::size_t i = 0; i < l.size(); ++i)
    if (l[i].kind == NodeKind::forward || l[i].kind == NodeKind::backward_input || l[i].kind == NodeKind::backward_weight)
      out.push_back(e.times[static_cast<std::size_t>(st)][i]);
  return out;
}

TEST(Offload, FreeTransfersOffloadEveryChosenChunkAndChangeNoTime) {
  const NodeCosts c{1.0, 1.5, 0.5, 0.1};
  for (const auto& [name, p, m, v, g] : std::vector<std::tuple<std::string, int, int, int, int>>{
           {"1f1b", 4, 8, 0, 0}, {"interleaved", 4, 8, 2, 0}, {"group-interleaved", 4, 9, 3, 2}, {"zb-v", 3, 6, 0, 0}, {"gpipe", 2, 3, 0, 0}})
    for (int k = 1; k <= 3; ++k) {
      SCOPED_TRACE(name + " k=" + std::to_string(k));
      const Schedule s0 = make_schedule(name, p, m, v, g);
      Schedule s = s0;
      const OffloadPlan plan = add_offload(s, offload_options(k, false, 0, c));
      const ScheduleAnalysis a = validate(s);
      const ScheduleEstimate e0 = estimate(s0, c), e = estimate(s, c);
      EXPECT_NEAR(e.makespan, e0.makespan, 1e-9);
      for (int st = 0; st < p; ++st) {
        const std::size_t i = static_cast<std::size_t>(st);
        const int want = m * std::min(k, s.chunks);
        EXPECT_EQ(plan.planned[i], want);
        EXPECT_EQ(plan.kept[i], want);
        EXPECT_EQ(plan.skipped_gap[i] + plan.skipped_peak[i], 0);
        EXPECT_EQ(count(s, st, NodeKind::offload), want);
        EXPECT_EQ(count(s, st, NodeKind::reload), want);
        EXPECT_EQ(plan.peak_resident[i], a.peak_resident[i]);
        EXPECT_EQ(plan.peak_host[i], a.peak_host[i]);
        EXPECT_LE(a.peak_resident[i], a.peak_in_flight[i]);
        EXPECT_EQ(a.peak_in_flight[i], validate(s0).peak_in_flight[i]);
        EXPECT_EQ(e.exposed[i], 0.0);
        EXPECT_EQ(e.d2h_busy[i] + e.h2d_busy[i], 0.0);
        EXPECT_EQ(compute_times(s, e, st), compute_times(s0, e0, st));
        // Each offload right after its F. Each reload before the latest compute node that
        // starts at least a B-duration before its B (and before that node's receives), or
        // right after its offload when there is none after the F.
        const auto& l = s.nodes[i];
        const auto& t = e.times[i];
        auto is_compute = [](NodeKind kind) {
          return kind == NodeKind::forward || kind == NodeKind::backward_input || kind == NodeKind::backward_weight;
        };
        for (std::size_t j = 0; j < l.size(); ++j) {
          if (l[j].kind == NodeKind::offload) {
            ASSERT_GT(j, 0u);
            EXPECT_EQ(l[j - 1], (Node{NodeKind::forward, l[j].microbatch, l[j].chunk}));
          }
          if (l[j].kind != NodeKind::reload) continue;
          std::size_t b = j + 1, f = j;
          while (l[b] != Node{NodeKind::backward_input, l[j].microbatch, l[j].chunk}) ++b;
          while (l[f] != Node{NodeKind::forward, l[j].microbatch, l[j].chunk}) --f;
          const double latest = t[b].first - c.backward_input + 1e-9;
          std::vector<std::size_t> early;  // compute nodes between F and B starting early enough
          for (std::size_t q = f + 1; q < b; ++q)
            if (is_compute(l[q].kind) && t[q].first <= latest) early.push_back(q);
          std::size_t next = j + 1;
          while (!is_compute(l[next].kind)) ++next;
          if (early.empty() || early.back() < j) {
            EXPECT_TRUE(early.empty()) << describe(l[j]);
            EXPECT_LT(j, f + 4) << describe(l[j]) << ": right after the offload";
          } else {
            EXPECT_EQ(next, early.back()) << describe(l[j]) << " at " << j;
            for (std::size_t q = j + 1; q < next; ++q)
              EXPECT_TRUE(l[q].kind == NodeKind::reload || l[q].kind == NodeKind::recv_act || l[q].kind == NodeKind::recv_grad)
                  << describe(l[q]);
            // ... and before all of that node's receives: none just before the reloads.
            std::size_t first = j;
            while (l[first - 1].kind == NodeKind::reload) --first;
            EXPECT_FALSE(l[first - 1].kind == NodeKind::recv_act || l[first - 1].kind == NodeKind::recv_grad)
                << describe(l[j]) << " at " << j << " follows " << describe(l[first - 1]);
          }
        }
      }
    }
}

// The gap rule, recomputed from the schedule's estimate: B.start - B - F.end <= 3(d2h + h2d)
// skips the pair (the authors' add_send_recv); what is left keeps its copies off the compute
// stream when the streams keep up.
TEST(Offload, TheGapRuleSkipsPairsTooCloseForBothCopies) {
  const NodeCosts c{1, 1, 1, 0};
  for (double x : {0.25, 0.5, 1.0, 2.0, 4.0})
    for (const auto& [name, p, m, v, g] : std::vector<std::tuple<std::string, int, int, int, int>>{
             {"1f1b", 4, 8, 0, 0}, {"interleaved", 4, 8, 2, 0}, {"group-interleaved", 4, 8, 2, 2}, {"group-interleaved", 6, 13, 3, 4}}) {
      SCOPED_TRACE(name + " x=" + std::to_string(x));
      const Schedule s0 = make_schedule(name, p, m, v, g);
      const ScheduleEstimate e0 = estimate(s0, c);
      Schedule s = s0;
      const OffloadPlan plan = add_offload(s, offload_options(1, false, x, c));
      for (int st = 0; st < p; ++st) {
        const auto& l = s0.nodes[static_cast<std::size_t>(st)];
        const auto& t = e0.times[static_cast<std::size_t>(st)];
        std::map<int, double> f_end;
        int close = 0;
        for (std::size_t i = 0; i < l.size(); ++i) {
          if (l[i].chunk != 0) continue;
          if (l[i].kind == NodeKind::forward) f_end[l[i].microbatch] = t[i].second;
          if (l[i].kind == NodeKind::backward_input && t[i].first - 1.0 - f_end[l[i].microbatch] <= 6 * x) ++close;
        }
        EXPECT_EQ(plan.skipped_gap[static_cast<std::size_t>(st)], close) << "stage " << st;
        EXPECT_EQ(plan.kept[static_cast<std::size_t>(st)], m - close);
        EXPECT_EQ(count(s, st, NodeKind::offload), m - close);
      }
      const ScheduleEstimate e = estimate(s, {1, 1, 1, 0, x, x});
      if (x <= 1.0) {
        for (double w : e.exposed) EXPECT_EQ(w, 0.0);
        EXPECT_NEAR(e.makespan, e0.makespan, 1e-9);
        // A reload's copy ends a B-duration before its B.
        for (int st = 0; st < p; ++st) {
          const auto& l = s.nodes[static_cast<std::size_t>(st)];
          for (std::size_t j = 0; j < l.size(); ++j) {
            if (l[j].kind != NodeKind::reload) continue;
            std::size_t b = j + 1;
            while (l[b] != Node{NodeKind::backward_input, l[j].microbatch, l[j].chunk}) ++b;
            EXPECT_LE(e.times[static_cast<std::size_t>(st)][j].second, e.times[static_cast<std::size_t>(st)][b].first - 1.0 + 1e-9);
          }
        }
      }
    }
}

// The lifespan rule drops only offloads that leave a stage's peak as it is.
TEST(Offload, TheLifespanRuleKeepsThePeakAndDropsTheRest) {
  for (const auto& [name, p, m, v, g] : std::vector<std::tuple<std::string, int, int, int, int>>{
           {"1f1b", 4, 16, 0, 0}, {"interleaved", 4, 8, 2, 0}, {"group-interleaved", 6, 12, 2, 3}, {"group-interleaved", 4, 9, 3, 4}, {"zb-v", 4, 8, 0, 0}})
    for (int k = 1; k <= 3; ++k) {
      SCOPED_TRACE(name + " k=" + std::to_string(k));
      Schedule all = make_schedule(name, p, m, v, g), few = all;
      const OffloadPlan a = add_offload(all, offload_options(k, false));
      const OffloadPlan b = add_offload(few, offload_options(k, true));
      for (int st = 0; st < p; ++st) {
        const std::size_t i = static_cast<std::size_t>(st);
        EXPECT_EQ(b.peak_resident[i], a.peak_resident[i]);
        EXPECT_EQ(b.kept[i] + b.skipped_peak[i], a.kept[i]);
        EXPECT_EQ(count(few, st, NodeKind::offload), b.kept[i]);
      }
    }
  // 1F1B, full offload: the last two stages hold at most 2 and 1 without offloading, which
  // free copies cannot lower; the first two keep nearly everything.
  Schedule s = make_schedule("1f1b", 4, 16);
  const OffloadPlan plan = add_offload(s, offload_options(1, true));
  EXPECT_EQ(plan.kept, (std::vector<int>{15, 15, 0, 0}));
  EXPECT_EQ(plan.skipped_peak, (std::vector<int>{1, 1, 16, 16}));
  EXPECT_EQ(plan.peak_resident, (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(plan.peak_host, (std::vector<int>{3, 2, 0, 0}));
}

// GPipe on one stage with both microbatches offloaded by hand: the d2h stream runs the two
// offloads one after the other, the reloads wait for them, the Bs for the reloads.
//   F0 [0,1] o0 [1,6] F1 [1,2] o1 [6,11] r1 [11,13] B1 [13,14] W1 [14,15] r0 [15,17] B0 [17,18] W0 [18,19]
// Which transfers the lifespan rule drops: it tries the shortest-lived first. Interleaved 1F1B,
// 4 stages, 8 microbatches, 2 chunks, chunk 0 offloaded with copies of 0.1 (F 1, B 2, W 0). On
// the last stage the gap rule keeps all 8; the lifespan rule drops microbatches 0 and 1 (they
// lower no peak) and one of 4 and 5, which can each be dropped without raising the stage's
// peak, but not both: 5, off the device for less time than 4 (its F's end to the end of the
// node before its reload, in the schedule's estimate without transfers).
TEST(Offload, TheLifespanRuleDropsTheShortestLivedFirst) {
  const NodeCosts c{1, 2, 0, 0};
  const int st = 3;
  const Schedule s0 = make_schedule("interleaved", 4, 8, 2);
  Schedule all = s0, few = s0;
  add_offload(all, offload_options(1, false, 0.1, c));
  const OffloadPlan plan = add_offload(few, offload_options(1, true, 0.1, c));
  auto offloaded = [&](const Schedule& s) {
    std::vector<int> mbs;
    for (const Node& x : s.nodes[st])
      if (x.kind == NodeKind::offload) mbs.push_back(x.microbatch);
    std::sort(mbs.begin(), mbs.end());
    return mbs;
  };
  EXPECT_EQ(offloaded(all), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(offloaded(few), (std::vector<int>{2, 3, 4, 6, 7}));
  // Time off the device, from the estimate of the schedule without transfers.
  const ScheduleEstimate e0 = estimate(s0, c);
  const auto& t = e0.times[st];
  std::map<int, double> off;
  std::map<int, std::size_t> f_at;
  std::size_t i = 0;  // position in s0's list
  for (const Node& x : all.nodes[st]) {
    if (x.kind == NodeKind::reload) off[x.microbatch] = t[i - 1].second - t[f_at.at(x.microbatch)].second;
    if (x.kind == NodeKind::offload || x.kind == NodeKind::reload) continue;
    if (x.kind == NodeKind::forward && x.chunk == 0) f_at[x.microbatch] = i;
    ++i;
  }
  EXPECT_LT(off.at(5), off.at(4));
  // Keeping the transfers of `keep` only: the stage's peak.
  auto peak_keeping = [&](const std::vector<int>& keep) {
    Schedule s = all;
    std::erase_if(s.nodes[st], [&](const Node& x) {
      return (x.kind == NodeKind::offload || x.kind == NodeKind::reload) &&
             std::find(keep.begin(), keep.end(), x.microbatch) == keep.end();
    });
    return validate(s).peak_resident[st];
  };
  EXPECT_EQ(peak_keeping({2, 3, 4, 6, 7}), plan.peak_resident[st]);
  EXPECT_EQ(peak_keeping({2, 3, 5, 6, 7}), plan.peak_resident[st]);
  EXPECT_GT(peak_keeping({2, 3, 6, 7}), plan.peak_resident[st]);
  EXPECT_EQ(peak_keeping({2, 3, 4, 5, 6, 7}), plan.peak_resident[st]);
}

TEST(Offload, TheEstimateQueuesCopiesAndExposesTheirWait) {
  Schedule s;
  s.name = "hand";
  s.microbatches = 2;
  s.nodes = {{n(kF, 0), n(NodeKind::offload, 0), n(kF, 1), n(NodeKind::offload, 1), n(NodeKind::reload, 1), n(kB, 1),
              n(kW, 1), n(NodeKind::reload, 0), n(kB, 0), n(kW, 0), n(kOpt, -1)}};
  const ScheduleEstimate e = estimate(s, {1, 1, 1, 0, 5, 2});
  using P = std::pair<double, double>;
  EXPECT_EQ(e.times[0], (std::vector<P>{{0, 1}, {1, 6}, {1, 2}, {6, 11}, {11, 13}, {13, 14}, {14, 15}, {15, 17}, {17, 18}, {18, 19}, {19, 19}}));
  EXPECT_DOUBLE_EQ(e.makespan, 19);
  EXPECT_DOUBLE_EQ(e.exposed[0], 11 + 2);
  EXPECT_DOUBLE_EQ(e.d2h_busy[0], 10);
  EXPECT_DOUBLE_EQ(e.h2d_busy[0], 4);
  EXPECT_DOUBLE_EQ(e.busy[0], 6);
  const ScheduleAnalysis a = validate(s);
  EXPECT_EQ(a.peak_in_flight[0], 2);
  EXPECT_EQ(a.peak_resident[0], 1);
  EXPECT_EQ(a.peak_host[0], 2);
  // Free copies: the times of the schedule without them.
  const ScheduleEstimate f = estimate(s, {1, 1, 1, 0});
  EXPECT_DOUBLE_EQ(f.makespan, 6);
  EXPECT_EQ(f.exposed[0], 0.0);
}

TEST(Offload, WithoutOffloadsResidentIsInFlight) {
  for (const auto& name : schedule_names()) {
    const ScheduleAnalysis a = validate(make_schedule(name, 4, 8));
    EXPECT_EQ(a.peak_resident, a.peak_in_flight) << name;
    EXPECT_EQ(a.peak_host, std::vector<int>(4, 0)) << name;
  }
}

TEST(Offload, BadOptionsAreConfigErrors) {
  Schedule s = make_schedule("1f1b", 2, 4);
  EXPECT_NE(config_error([&] { add_offload(s, offload_options(-1, true)); }).find("--offload-chunks = -1"), std::string::npos);
  EXPECT_NE(config_error([&] { add_offload(s, [] { OffloadOptions o; o.chunks = 1; o.d2h = -1; return o; }()); }).find("--offload-time"), std::string::npos);
  EXPECT_NE(config_error([&] { add_offload(s, [] { OffloadOptions o; o.chunks = 1; o.h2d = std::nan(""); return o; }()); }).find("--reload-time"), std::string::npos);
  add_offload(s, offload_options(1, false));
  EXPECT_NE(config_error([&] { add_offload(s, offload_options(1, true)); }).find("already has offload nodes"), std::string::npos);
  EXPECT_NE(config_error([] { expected_peak_activation(make_schedule("zb-v", 2, 4), 1); }).find("--offload-chunks = 1"), std::string::npos);
  EXPECT_NE(config_error([] { expected_peak_activation(make_schedule("zb-h1", 2, 4), 1); }).find("--offload-chunks = 1"), std::string::npos);
}

// ---- closed forms of the peak activation memory (docs/pipeline-memory.md) ------------------

TEST(PeakActivation, ClosedFormsMatchTheSchedules) {
  int checked = 0;
  for (const auto& name : schedule_names())
    for (int p = 1; p <= 8; ++p)
      for (int v : name == "interleaved" || name == "group-interleaved" ? std::vector<int>{2, 3, 4} : std::vector<int>{0})
        for (int m : {2 * p, 3 * p, 4 * p})
          for (int g = name == "group-interleaved" ? (p + 1) / 2 : 0; g <= (name == "group-interleaved" ? p : 0); ++g) {
            SCOPED_TRACE(name + " p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m) + " g=" + std::to_string(g));
            const Schedule s = make_schedule(name, p, m, v, g);
            const ScheduleAnalysis a = validate(s);
            const double unit = p * s.chunks;  // chunk-microbatches per M_a
            const std::vector<double> e = expected_peak_activation(s);
            ASSERT_EQ(e.size(), static_cast<std::size_t>(p));
            for (int st = 0; st < p; ++st) {
              EXPECT_NEAR(e[static_cast<std::size_t>(st)] * unit, a.peak_in_flight[static_cast<std::size_t>(st)], 1e-9) << "stage " << st;
              ++checked;
            }
            // Offloaded: what stays is the form; the copies add 0 to 2 (exactly 2 on full offload,
            // 1 on 1F1B's last stage where each B follows its F).
            const bool selective = name == "interleaved" || name == "group-interleaved";
            if (name == "zb-h1" || name == "zb-v") {
              // The deferred W keeps a reloaded microbatch on the device: ZB-H1's stage s holds
              // its s deferred ones besides the two of the copies (no closed form for ZB-V).
              // (Group-interleaved splits B and W too, but runs each W right after its B: its
              // forms are checked below.)
              Schedule o = s;
              const OffloadPlan plan = add_offload(o, offload_options(1 + s.chunks, false));
              for (int st = 0; st < p && name == "zb-h1"; ++st)
                EXPECT_EQ(plan.peak_resident[static_cast<std::size_t>(st)], std::min(st + 2, p)) << "stage " << st;
              continue;
            }
            for (int k = selective ? 1 : s.chunks; k <= s.chunks; ++k) {
              Schedule o = s;
              const OffloadPlan plan = add_offload(o, offload_options(k, false));
              const std::vector<double> f = expected_peak_activation(s, k);
              const std::vector<int> kept = peak_kept(s, k);
              for (int st = 0; st < p; ++st) {
                const std::size_t i = static_cast<std::size_t>(st);
                const double stays = f[i] * unit;
                EXPECT_NEAR(stays, kept[i], 1e-9) << "k=" << k << " stage " << st;
                EXPECT_GE(plan.peak_resident[i], stays - 1e-9);
                EXPECT_LE(plan.peak_resident[i], stays + 2 + 1e-9);
                if (k == s.chunks) {
                  EXPECT_EQ(plan.peak_resident[i], name == "1f1b" && st == p - 1 ? 1 : 2) << "stage " << st;
                }
                ++checked;
              }
            }
          }
  EXPECT_GT(checked, 6000);
  // Interleaved at m = p: Megatron runs every forward first, so every stage holds all m·v
  // chunk-microbatches (M_a), and with k chunks offloaded the other (v - k)·m.
  for (int p = 2; p <= 6; ++p)
    for (int v : {2, 3}) {
      const Schedule s = make_schedule("interleaved", p, p, v);
      const ScheduleAnalysis a = validate(s);
      for (int k = 0; k < v; ++k) {
        const std::vector<double> f = expected_peak_activation(s, k);
        const std::vector<int> kept = k > 0 ? peak_kept(s, k) : a.peak_in_flight;
        for (int st = 0; st < p; ++st) {
          EXPECT_NEAR(f[static_cast<std::size_t>(st)] * p * v, (v - k) * p, 1e-9);
          EXPECT_EQ(kept[static_cast<std::size_t>(st)], (v - k) * p) << "p=" << p << " v=" << v << " k=" << k << " stage " << st;
        }
      }
    }
  // The numbers the papers quote, on stage 0 in M_a.
  EXPECT_NEAR(expected_peak_activation(make_schedule("1f1b", 8, 16))[0], 1.0, 1e-12);
  EXPECT_NEAR(expected_peak_activation(make_schedule("interleaved", 8, 16, 2))[0], 1.0 + 7.0 / 16, 1e-12);
  EXPECT_NEAR(expected_peak_activation(make_schedule("group-interleaved", 8, 16, 2, 8))[0], 1.0, 1e-12);
  EXPECT_NEAR(expected_peak_activation(make_schedule("group-interleaved", 8, 16, 2, 4))[0], 0.75, 1e-12);
  EXPECT_NEAR(expected_peak_activation(make_schedule("group-interleaved", 8, 16, 2, 4), 1)[0], 0.25, 1e-12);
  EXPECT_NEAR(expected_peak_activation(make_schedule("gpipe", 4, 12))[0], 3.0, 1e-12);
}

}  // namespace
}  // namespace moelab::pipeline
