// harness/pipeline/schedule.cpp — pipeline schedules as data: generators, the validator and
// the timing estimate. See schedule.hpp.
//   ctest --test-dir build -R pipeline_schedule_test
#include "harness/pipeline/schedule.hpp"

#include <algorithm>
#include <limits>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "harness/config/json_fields.hpp"
#include "harness/runtime/error.hpp"

namespace moelab::pipeline {

const char* node_kind_name(NodeKind k) {
  switch (k) {
    case NodeKind::forward: return "F";
    case NodeKind::backward_input: return "B";
    case NodeKind::backward_weight: return "W";
    case NodeKind::send_act: return "send_act";
    case NodeKind::recv_act: return "recv_act";
    case NodeKind::send_grad: return "send_grad";
    case NodeKind::recv_grad: return "recv_grad";
    case NodeKind::offload: return "offload";
    case NodeKind::reload: return "reload";
    case NodeKind::optimizer: return "optimizer";
  }
  return "?";
}

std::string describe(const Node& n) {
  if (n.kind == NodeKind::optimizer) return "optimizer";
  return std::string(node_kind_name(n.kind)) + " mb " + std::to_string(n.microbatch) + " chunk " + std::to_string(n.chunk);
}

const char* placement_name(Placement p) { return p == Placement::vshape ? "vshape" : "interleaved"; }

int Schedule::virtual_stage(int stage, int chunk) const {
  if (placement == Placement::vshape) return chunk == 0 ? stage : 2 * stages - 1 - stage;
  return chunk * stages + stage;
}

std::pair<int, int> Schedule::place(int vstage) const {
  if (placement == Placement::vshape) return vstage < stages ? std::pair{vstage, 0} : std::pair{2 * stages - 1 - vstage, 1};
  return {vstage % stages, vstage / stages};
}

namespace {

// ---- generators: the compute order (F, B, W) of each stage ---------------------------------

Node F(int mb, int c = 0) { return {NodeKind::forward, mb, c}; }
Node B(int mb, int c = 0) { return {NodeKind::backward_input, mb, c}; }
Node W(int mb, int c = 0) { return {NodeKind::backward_weight, mb, c}; }

// GPipe (Huang et al. 2019, Fig. 2c): every forward, then the backwards in reverse order.
void gpipe(Schedule& s) {
  for (auto& st : s.nodes) {
    for (int mb = 0; mb < s.microbatches; ++mb) st.push_back(F(mb));
    for (int mb = s.microbatches; mb-- > 0;) {
      st.push_back(B(mb));
      st.push_back(W(mb));
    }
  }
}

// PipeDream-Flush (Narayanan et al. 2021 §2.2.1): stage s runs p-s-1 warm-up forwards, then
// one forward and one backward alternately, then the remaining backwards.
void one_f_one_b(Schedule& s) {
  const int p = s.stages, m = s.microbatches;
  for (int st = 0; st < p; ++st) {
    auto& l = s.nodes[static_cast<std::size_t>(st)];
    const int warm = std::min(p - st - 1, m);
    for (int i = 0; i < warm; ++i) l.push_back(F(i));
    for (int i = 0; i < m - warm; ++i) {
      l.push_back(F(warm + i));
      l.push_back(B(i));
      l.push_back(W(i));
    }
    for (int i = m - warm; i < m; ++i) {
      l.push_back(B(i));
      l.push_back(W(i));
    }
  }
}

// Megatron's interleaved 1F1B (Narayanan et al. 2021 §2.2.2; megatron/core/pipeline_parallel/
// schedules.py): the k-th forward of a stage is chunk (k mod pv) / p of microbatch
// (k / pv)·p + k mod p, backwards run the chunks in reverse; stage s warms up with
// 2(p-s-1) + (v-1)p forwards, or with all of them when m = p (Megatron's
// all_warmup_microbatches: every forward first, then every backward).
void interleaved(Schedule& s) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, total = m * v;
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  for (int st = 0; st < p; ++st) {
    auto& l = s.nodes[static_cast<std::size_t>(st)];
    const int warm = m == p ? total : std::min(2 * (p - st - 1) + (v - 1) * p, total);
    auto backward = [&](int k) {
      l.push_back(B(mb_of(k), chunk_of(k, false)));
      l.push_back(W(mb_of(k), chunk_of(k, false)));
    };
    for (int k = 0; k < warm; ++k) l.push_back(F(mb_of(k), chunk_of(k, true)));
    for (int k = 0; k < total - warm; ++k) {
      l.push_back(F(mb_of(warm + k), chunk_of(warm + k, true)));
      backward(k);
    }
    for (int k = total - warm; k < total; ++k) backward(k);
  }
}

// ZB-H1 (Qi et al. 2024 §3.1; the authors' DeepSpeed schedule ZeroBubbleH1Pipeline): 1F1B's
// warm-up, then stage s runs s (F, B) pairs with their W deferred, then (F, B, W), then the
// remaining (B, W), then the s deferred W fill the cool-down bubble. The number of
// microbatches in flight stays 1F1B's p on the first stage.
void zb_h1(Schedule& s) {
  const int p = s.stages, m = s.microbatches;
  for (int st = 0; st < p; ++st) {
    auto& l = s.nodes[static_cast<std::size_t>(st)];
    int f = 0, b = 0, w = 0;
    for (int i = 0; i < std::min(p - st - 1, m); ++i) l.push_back(F(f++));
    for (int i = 0; i < st && f < m; ++i) {
      l.push_back(F(f++));
      l.push_back(B(b++));
    }
    while (f < m) {
      l.push_back(F(f++));
      l.push_back(B(b++));
      l.push_back(W(w++));
    }
    while (b < m) {
      l.push_back(B(b++));
      l.push_back(W(w++));
    }
    while (w < m) l.push_back(W(w++));
  }
}

// A greedy list scheduler over unit-time F, B and W: whenever a stage is free it runs a ready
// B (the oldest microbatch, the later virtual stage first), else a ready F while fewer than
// `limit` (microbatch, chunk) pairs are between their F and their W, else the oldest pending
// W; otherwise it waits for the next arrival. Used for ZB-V with limit 2p (the activation
// memory of 1F1B: 2p chunks of half a stage, Qi et al. 2024 §6). Any order it produces is one
// a timed run followed, so it cannot deadlock.
void greedy(Schedule& s, int limit) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, V = s.virtual_stages();
  const double kInf = std::numeric_limits<double>::infinity();
  // ready times of inputs: act[mb][vstage] (F's input), grad[mb][vstage] (B's output gradient)
  std::vector<std::vector<double>> act(static_cast<std::size_t>(m), std::vector<double>(static_cast<std::size_t>(V), kInf));
  std::vector<std::vector<double>> grad = act;
  for (int mb = 0; mb < m; ++mb) act[static_cast<std::size_t>(mb)][0] = 0;
  struct Stage {
    double t = 0;
    std::vector<std::vector<int>> state;  // [mb][chunk]: 0 none, 1 F done, 2 B done, 3 W done
    int in_flight = 0, done = 0;
  };
  std::vector<Stage> st(static_cast<std::size_t>(p));
  for (auto& x : st) x.state.assign(static_cast<std::size_t>(m), std::vector<int>(static_cast<std::size_t>(v), 0));
  const int per_stage = 3 * m * v;
  auto idx = [](int i) { return static_cast<std::size_t>(i); };
  for (;;) {
    // The stage that can act earliest, and what it runs.
    int best_stage = -1;
    Node best{};
    double best_t = kInf;
    for (int si = 0; si < p; ++si) {
      Stage& x = st[idx(si)];
      if (x.done == per_stage) continue;
      // Candidates with their ready times; pick by time, then priority B > F > W.
      double t_b = kInf, t_f = kInf, t_w = kInf;
      Node nb{}, nf{}, nw{};
      for (int mb = 0; mb < m; ++mb)
        for (int c = v; c-- > 0;) {
          const int vs = s.virtual_stage(si, c), state = x.state[idx(mb)][idx(c)];
          if (state == 1) {
            const double r = std::max(x.t, vs == V - 1 ? x.t : grad[idx(mb)][idx(vs)]);
            if (r < t_b) t_b = r, nb = B(mb, c);
          } else if (state == 0 && x.in_flight < limit) {
            const double r = std::max(x.t, act[idx(mb)][idx(vs)]);
            if (r < t_f) t_f = r, nf = F(mb, c);
          } else if (state == 2 && t_w == kInf) {
            t_w = x.t, nw = W(mb, c);
          }
        }
      double t = std::min({t_b, t_f, t_w});
      Node n = t_b == t ? nb : t_f == t ? nf : nw;
      if (t < best_t) best_t = t, best_stage = si, best = n;
    }
    if (best_stage < 0) break;
    Stage& x = st[idx(best_stage)];
    const int vs = s.virtual_stage(best_stage, best.chunk);
    const double end = best_t + 1.0;
    auto& state = x.state[idx(best.microbatch)][idx(best.chunk)];
    if (best.kind == NodeKind::forward) {
      state = 1;
      ++x.in_flight;
      if (vs + 1 < V) act[idx(best.microbatch)][idx(vs + 1)] = end;
    } else if (best.kind == NodeKind::backward_input) {
      state = 2;
      if (vs > 0) grad[idx(best.microbatch)][idx(vs - 1)] = end;
    } else {
      state = 3;
      --x.in_flight;
    }
    ++x.done;
    x.t = end;
    s.nodes[idx(best_stage)].push_back(best);
  }
}

// PipeOffload's group-interleaved 1F1B (Wan et al. 2025), built as the authors'
// GroupBuildingBlockScheduler builds it (megatron/core/pipeline_parallel/zerobubble/scheduler/
// group_interleaved_1f1b.py), in unit slots (F, B and W one slot each):
//  1. the building block (get_optimal_building_block, f_offset 1 and b_offset 2; with
//     g >= ceil(p/2) its min_k is 1): stage d runs F of (chunk c, group member i) at slot
//     3g·c + 3i + d. The first B, of member 0's last chunk, comes (p-1-d)·(1 + 2) + 1 slots
//     after member 0's last F: the forward's way on to the last stage, one slot a stage, and
//     the backward's way back, B and W two slots a stage. Then B of (chunk v-1-c, member i)
//     at first_b + 3g·c + 3i, its W in the next slot. F, B and W fall on slots d, d+1, d+2
//     (mod 3), so the block repeats every 3gv slots without a collision.
//  2. unrolled, each pass at its own slot (unroll_building_block), repeated ceil(m/g) times
//     3gv slots apart with the microbatches g apart (repeat_building_block), and the
//     microbatches past m dropped (remove_redundant_micro).
//  3. stage d delayed by min(d, e) slots, e the least slack between a chunk's F on the first
//     stage and the previous chunk's F on the last (shift_schedule2meet_dependency), then
//     squeezed: slot by slot, a stage runs its next pass once the pass it depends on ran in
//     an earlier slot (squeeze_without_change_order).
// Step 3 fixes the slots' times, never a stage's order, which is all a Schedule keeps: here
// it checks that slack is never negative and that the squeeze runs every pass (the order
// cannot deadlock); timing is estimate()'s. B and W are separate passes (split_backward true,
// as on the authors' zero-bubble runtime): the block's b_offset 2 is a stage's B and W, and B's
// gradient moves on before W.
void group_interleaved(Schedule& s, int g) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, V = s.virtual_stages(), block = 3 * g * v;
  const int groups = (m + g - 1) / g;
  auto idx = [](int i) { return static_cast<std::size_t>(i); };
  std::vector<std::map<int, Node>> slots(idx(p));  // per stage: slot -> pass
  for (int d = 0; d < p; ++d) {
    std::vector<std::pair<int, Node>> bb;  // the building block: (slot, pass of group member i)
    for (int c = 0; c < v; ++c)
      for (int i = 0; i < g; ++i) bb.push_back({3 * g * c + 3 * i + d, F(i, c)});
    const int first_b = 3 * g * (v - 1) + d + 3 * (p - 1 - d) + 1;
    for (int c = 0; c < v; ++c)
      for (int i = 0; i < g; ++i) {
        const int b = first_b + 3 * g * c + 3 * i;
        bb.push_back({b, B(i, v - 1 - c)});
        bb.push_back({b + 1, W(i, v - 1 - c)});
      }
    std::vector<bool> used(idx(block), false);
    for (const auto& [slot, n] : bb) {
      if (used[idx(slot % block)]) throw std::logic_error("group-interleaved: building block collides at slot " + std::to_string(slot));
      used[idx(slot % block)] = true;
    }
    for (int r = 0; r < groups; ++r)
      for (const auto& [slot, n] : bb)
        if (n.microbatch + g * r < m) slots[idx(d)][slot + block * r] = {n.kind, n.microbatch + g * r, n.chunk};
  }
  // 3. The shift's slack: chunk c's F on stage 0 after chunk c-1's F on the last stage.
  std::map<std::pair<int, int>, int> last_f;  // (mb, chunk) -> slot on stage p-1
  for (const auto& [slot, n] : slots[idx(p - 1)])
    if (n.kind == NodeKind::forward) last_f[{n.microbatch, n.chunk}] = slot;
  int slack = p - 1;
  for (const auto& [slot, n] : slots[0])
    if (n.chunk > 0) slack = std::min(slack, slot - 1 - last_f.at({n.microbatch, n.chunk - 1}));
  if (slack < 0) throw std::logic_error("group-interleaved: a chunk starts before the previous one ends");
  for (int d = 0; d < p; ++d)
    for (const auto& [slot, n] : slots[idx(d)]) s.nodes[idx(d)].push_back(n);
  // The squeeze: a pass waits for the pass of its dependent virtual stage (F: the previous, B:
  // the next, W: none), run in an earlier slot.
  std::set<std::tuple<NodeKind, int, int>> ran;  // (kind, mb, virtual stage)
  std::vector<std::size_t> next(idx(p), 0);
  for (std::size_t left = static_cast<std::size_t>(3 * m * v * p); left > 0;) {
    std::vector<std::tuple<NodeKind, int, int>> now;
    for (int d = 0; d < p; ++d) {
      const auto& l = s.nodes[idx(d)];
      if (next[idx(d)] == l.size()) continue;
      const Node& n = l[next[idx(d)]];
      const int vs = s.virtual_stage(d, n.chunk);
      const int dep = std::clamp(n.kind == NodeKind::forward ? vs - 1 : n.kind == NodeKind::backward_input ? vs + 1 : vs, 0, V - 1);
      if (dep == vs || ran.count({n.kind, n.microbatch, dep})) {
        now.push_back({n.kind, n.microbatch, vs});
        ++next[idx(d)];
      }
    }
    if (now.empty()) throw std::logic_error("group-interleaved: the squeeze stalls (the order deadlocks)");
    ran.insert(now.begin(), now.end());
    left -= now.size();
  }
}

const std::vector<std::string> kNames = {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "group-interleaved"};

[[noreturn]] void bad_schedule(const Schedule& s, int stage, int pos, const Node& n, const std::string& why) {
  throw ConfigError("schedule " + s.name + ": stage " + std::to_string(stage) + ", position " + std::to_string(pos) + " (" +
                    describe(n) + "): " + why);
}

}  // namespace

std::vector<std::string> schedule_names() { return kNames; }

Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks, int group) {
  if (std::find(kNames.begin(), kNames.end(), name) == kNames.end()) {
    std::string msg = "--schedule " + json_fields::quote(name) + " is not a schedule";
    if (const std::string best = json_fields::closest(name, kNames); !best.empty()) {
      msg += " (did you mean " + json_fields::quote(best) + "?)";
    } else {
      std::string all;
      for (const auto& k : kNames) all += (all.empty() ? "" : ", ") + k;
      msg += " (" + all + ")";
    }
    throw ConfigError(msg);
  }
  if (stages < 1) throw ConfigError("schedule " + name + ": pp = " + std::to_string(stages) + " must be at least 1");
  if (microbatches < 1)
    throw ConfigError("schedule " + name + ": --microbatches = " + std::to_string(microbatches) + " must be at least 1");
  const bool grouped = name == "group-interleaved";
  if (group != 0 && !grouped)
    throw ConfigError("schedule " + name + ": --group = " + std::to_string(group) + " applies to group-interleaved only");
  Schedule s;
  s.name = name;
  s.stages = stages;
  s.microbatches = microbatches;
  if (name == "interleaved" || grouped) {
    s.chunks = chunks == 0 ? 2 : chunks;
    if (s.chunks < 2)
      throw ConfigError("schedule " + name + ": --chunks = " + std::to_string(s.chunks) +
                        " must be at least 2 (one chunk per stage is 1f1b)");
    if (!grouped && microbatches % stages != 0)
      throw ConfigError("schedule interleaved: --microbatches = " + std::to_string(microbatches) +
                        " must be a multiple of pp = " + std::to_string(stages) + " (Megatron's interleaved 1F1B)");
  } else if (name == "zb-v") {
    if (chunks != 0 && chunks != 2)
      throw ConfigError("schedule zb-v: --chunks = " + std::to_string(chunks) + ": the V-shape has 2 chunks per stage");
    s.chunks = 2;
    s.placement = Placement::vshape;
  } else if (chunks > 1) {
    throw ConfigError("schedule " + name + ": --chunks = " + std::to_string(chunks) +
                      " applies to interleaved, group-interleaved (and zb-v, always 2); " + name + " has one chunk per stage");
  }
  // The authors' range: ceil(p/2) (GroupBuildingBlockScheduler's default min_group_size) to p
  // (their README's --interleave-group-size; create_schedule caps the group at p).
  const int least_group = (stages + 1) / 2;
  if (grouped && group == 0) group = least_group;
  if (grouped && (group < least_group || group > stages))
    throw ConfigError("schedule group-interleaved: --group = " + std::to_string(group) + " must be from " +
                      std::to_string(least_group) + " to " + std::to_string(stages) + " (ceil(pp/2) to pp = " +
                      std::to_string(stages) + ")");
  if (grouped) s.group = group;
  // Group-interleaved runs on the authors' zero-bubble runtime, where B's gradient leaves before
  // its W (Wan et al. 2025; sail-sg/zero-bubble-pipeline-parallelism, --enable-zb-runtime).
  s.split_backward = name == "zb-h1" || name == "zb-v" || name == "group-interleaved";
  s.nodes.resize(static_cast<std::size_t>(stages));
  if (name == "gpipe") gpipe(s);
  else if (name == "1f1b") one_f_one_b(s);
  else if (name == "interleaved") interleaved(s);
  else if (name == "zb-h1") zb_h1(s);
  else if (grouped) group_interleaved(s, group);
  else greedy(s, 2 * stages);
  add_communication(s);
  validate(s);
  return s;
}

void add_communication(Schedule& s) {
  const int V = s.virtual_stages();
  for (int st = 0; st < s.stages; ++st) {
    std::vector<Node> out;
    const auto& in = s.nodes[static_cast<std::size_t>(st)];
    for (std::size_t i = 0; i < in.size(); ++i) {
      const Node& n = in[i];
      if (n.kind == NodeKind::optimizer) continue;
      const int vs = s.virtual_stage(st, n.chunk);
      const bool prev_remote = vs > 0 && s.place(vs - 1).first != st;
      const bool next_remote = vs + 1 < V && s.place(vs + 1).first != st;
      if (n.kind == NodeKind::forward) {
        if (prev_remote) out.push_back({NodeKind::recv_act, n.microbatch, n.chunk});
        out.push_back(n);
        if (next_remote) out.push_back({NodeKind::send_act, n.microbatch, n.chunk});
      } else if (n.kind == NodeKind::backward_input) {
        if (next_remote) out.push_back({NodeKind::recv_grad, n.microbatch, n.chunk});
        out.push_back(n);
        // Without the split, B and its W are one backward pass: the gradient leaves after both.
        if (!s.split_backward && i + 1 < in.size() && in[i + 1] == Node{NodeKind::backward_weight, n.microbatch, n.chunk})
          out.push_back(in[++i]);
        if (prev_remote) out.push_back({NodeKind::send_grad, n.microbatch, n.chunk});
      } else {
        out.push_back(n);
      }
    }
    out.push_back({NodeKind::optimizer, -1, 0});
    s.nodes[static_cast<std::size_t>(st)] = std::move(out);
  }
}

// ---- PipeOffload's offload pass --------------------------------------------------------------

namespace {

bool is_compute(NodeKind k) {
  return k == NodeKind::forward || k == NodeKind::backward_input || k == NodeKind::backward_weight;
}

// One (microbatch, chunk) the pass may offload, on one stage: where its F and B are, where its
// reload would go (before the node at `reload_before`, after the offload when that is F + 1),
// and for how long its activations would be off the device (F's end to the reload's place).
struct Transfer {
  int f = -1, b = -1, reload_before = -1;
  double off_time = 0;
};

// The most activations resident on the stage's device over its list, with the given
// transfers: F adds one, W removes one, an offload (right after its F) removes one, a
// reload (before reload_before) adds one back.
int peak_resident_with(const std::vector<Node>& l, const std::vector<const Transfer*>& xs) {
  std::vector<int> before(l.size() + 1, 0), after(l.size(), 0);  // per position: reloads before it, offloads after it
  for (const Transfer* x : xs) {
    ++before[static_cast<std::size_t>(x->reload_before)];
    ++after[static_cast<std::size_t>(x->f)];
  }
  int now = 0, peak = 0;
  for (std::size_t i = 0; i < l.size(); ++i) {
    now += before[i];
    peak = std::max(peak, now);
    if (l[i].kind == NodeKind::forward) ++now;
    if (l[i].kind == NodeKind::backward_weight) --now;
    peak = std::max(peak, now);
    now -= after[i];
  }
  return peak;
}

}  // namespace

OffloadPlan add_offload(Schedule& s, const OffloadOptions& o) {
  if (o.chunks < 0) throw ConfigError("--offload-chunks = " + std::to_string(o.chunks) + " must be at least 0");
  auto time_ok = [](double x) { return std::isfinite(x) && x >= 0; };
  if (!time_ok(o.d2h)) throw ConfigError("--offload-time = " + std::to_string(o.d2h) + " must be a time of at least 0");
  if (!time_ok(o.h2d)) throw ConfigError("--reload-time = " + std::to_string(o.h2d) + " must be a time of at least 0");
  for (const auto& l : s.nodes)
    for (const Node& n : l)
      if (n.kind == NodeKind::offload || n.kind == NodeKind::reload)
        throw ConfigError("schedule " + s.name + ": already has offload nodes (" + describe(n) + "); add_offload runs once");
  const ScheduleEstimate e = estimate(s, o.costs);  // validates
  auto idx = [](int i) { return static_cast<std::size_t>(i); };
  const int p = s.stages, m = s.microbatches, v = s.chunks;
  OffloadPlan plan;
  for (auto* x : {&plan.planned, &plan.kept, &plan.skipped_gap, &plan.skipped_peak}) x->assign(idx(p), 0);
  const double eps = 1e-9 * std::max({1.0, e.makespan, o.costs.backward_input});
  for (int st = 0; st < p; ++st) {
    auto& l = s.nodes[idx(st)];
    const auto& t = e.times[idx(st)];
    std::vector<std::vector<Transfer>> xs(idx(m), std::vector<Transfer>(idx(v)));
    std::vector<const Transfer*> live;
    for (int pos = 0; pos < static_cast<int>(l.size()); ++pos) {
      const Node& n = l[idx(pos)];
      if (n.chunk >= o.chunks || (n.kind != NodeKind::forward && n.kind != NodeKind::backward_input)) continue;
      Transfer& x = xs[idx(n.microbatch)][idx(n.chunk)];
      if (n.kind == NodeKind::forward) {
        x.f = pos;
        ++plan.planned[idx(st)];
        continue;
      }
      x.b = pos;
      const double f_end = t[idx(x.f)].second, b_start = t[idx(pos)].first, b_len = t[idx(pos)].second - b_start;
      if (o.d2h + o.h2d > 0 && b_start - b_len - f_end <= 3 * (o.d2h + o.h2d) + eps) {
        ++plan.skipped_gap[idx(st)];
        continue;
      }
      // The latest compute node before B starting early enough that the copy ends one
      // B-duration before B; the reload goes before its receives.
      const double latest = b_start - o.costs.backward_input - o.h2d + eps;
      int q = -1;
      for (int i = pos - 1; i > x.f; --i)
        if (is_compute(l[idx(i)].kind) && t[idx(i)].first <= latest) {
          q = i;
          break;
        }
      if (q < 0) {
        x.reload_before = x.f + 1;
      } else {
        while (q - 1 > x.f && (l[idx(q - 1)].kind == NodeKind::recv_act || l[idx(q - 1)].kind == NodeKind::recv_grad)) --q;
        x.reload_before = q;
      }
      x.off_time = t[idx(x.reload_before - 1)].second - f_end;
      live.push_back(&x);
    }
    // The lifespan rule: shortest time off the device first, drop what leaves the peak as it is.
    if (o.lifespan) {
      std::vector<const Transfer*> order = live;
      std::stable_sort(order.begin(), order.end(), [](const Transfer* a, const Transfer* b) { return a->off_time < b->off_time; });
      int peak = peak_resident_with(l, live);
      for (const Transfer* x : order) {
        std::vector<const Transfer*> without;
        for (const Transfer* y : live)
          if (y != x) without.push_back(y);
        const int p2 = peak_resident_with(l, without);
        if (p2 <= peak) {
          live = std::move(without);
          peak = p2;
          ++plan.skipped_peak[idx(st)];
        }
      }
    }
    plan.kept[idx(st)] = static_cast<int>(live.size());
    std::vector<bool> offload_after(l.size(), false);
    for (const Transfer* x : live) offload_after[idx(x->f)] = true;
    // Reloads issued at one place go in the order of their B.
    std::vector<std::vector<Node>> reloads(l.size() + 1);
    std::vector<const Transfer*> by_b = live;
    std::sort(by_b.begin(), by_b.end(), [](const Transfer* a, const Transfer* b) { return a->b < b->b; });
    for (const Transfer* x : by_b) {
      const Node& bn = l[idx(x->b)];
      reloads[idx(x->reload_before)].push_back({NodeKind::reload, bn.microbatch, bn.chunk});
    }
    std::vector<Node> out;
    for (std::size_t i = 0; i < l.size(); ++i) {
      out.insert(out.end(), reloads[i].begin(), reloads[i].end());
      out.push_back(l[i]);
      if (offload_after[i]) out.push_back({NodeKind::offload, l[i].microbatch, l[i].chunk});
    }
    l = std::move(out);
  }
  const ScheduleAnalysis a = validate(s);
  plan.peak_resident = a.peak_resident;
  plan.peak_host = a.peak_host;
  return plan;
}

// ---- the validator -------------------------------------------------------------------------

namespace {

// What one stage has done to one (microbatch, chunk) so far.
struct Work {
  int f = -1, b = -1, w = -1;                      // positions, -1: not yet
  int recv_act = -1, recv_grad = -1, send_act = -1, send_grad = -1, offload = -1, reload = -1;
};

bool is_send(NodeKind k) { return k == NodeKind::send_act || k == NodeKind::send_grad; }
bool is_recv(NodeKind k) { return k == NodeKind::recv_act || k == NodeKind::recv_grad; }

}  // namespace

ScheduleAnalysis validate(const Schedule& s) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, V = s.virtual_stages();
  if (p < 1 || m < 1 || v < 1 || static_cast<int>(s.nodes.size()) != p)
    throw ConfigError("schedule " + s.name + ": " + std::to_string(s.nodes.size()) + " node lists for pp = " +
                      std::to_string(p) + " stages (microbatches " + std::to_string(m) + ", chunks " + std::to_string(v) + ")");
  if (s.placement == Placement::vshape && v != 2)
    throw ConfigError("schedule " + s.name + ": the V-shape placement needs 2 chunks per stage, not " + std::to_string(v));
  auto idx = [](int i) { return static_cast<std::size_t>(i); };
  ScheduleAnalysis a;
  a.send_done_at.resize(idx(p));
  a.peak_in_flight.assign(idx(p), 0);
  a.peak_resident.assign(idx(p), 0);
  a.peak_host.assign(idx(p), 0);

  // 1. Each stage on its own, in order: every value exists where it is used, nothing twice.
  for (int st = 0; st < p; ++st) {
    const auto& l = s.nodes[idx(st)];
    a.send_done_at[idx(st)].assign(l.size(), -1);
    std::vector<std::vector<Work>> work(idx(m), std::vector<Work>(idx(v)));
    int in_flight = 0, resident = 0, host = 0, optimizer_at = -1;
    for (int pos = 0; pos < static_cast<int>(l.size()); ++pos) {
      const Node& n = l[idx(pos)];
      auto fail = [&](const std::string& why) { bad_schedule(s, st, pos, n, why); };
      if (optimizer_at >= 0) fail("comes after the optimizer step (position " + std::to_string(optimizer_at) + ")");
      if (n.kind == NodeKind::optimizer) {
        optimizer_at = pos;
        continue;
      }
      if (n.microbatch < 0 || n.microbatch >= m) fail("microbatch out of range (the step has " + std::to_string(m) + ")");
      if (n.chunk < 0 || n.chunk >= v) fail("chunk out of range (a stage has " + std::to_string(v) + ")");
      Work& x = work[idx(n.microbatch)][idx(n.chunk)];
      const int vs = s.virtual_stage(st, n.chunk);
      const auto [prev_stage, prev_chunk] = vs > 0 ? s.place(vs - 1) : std::pair{-1, -1};
      const auto [next_stage, next_chunk] = vs + 1 < V ? s.place(vs + 1) : std::pair{-1, -1};
      auto twice = [&](int& at) {
        if (at >= 0) fail("runs twice (first at position " + std::to_string(at) + ")");
        at = pos;
      };
      const std::string vname = "virtual stage " + std::to_string(vs);
      switch (n.kind) {
        case NodeKind::forward:
          twice(x.f);
          if (vs > 0) {
            if (prev_stage == st && work[idx(n.microbatch)][idx(prev_chunk)].f < 0)
              fail("uses its input before it exists (F mb " + std::to_string(n.microbatch) + " chunk " +
                   std::to_string(prev_chunk) + " of this stage makes it, later or never)");
            if (prev_stage != st && x.recv_act < 0)
              fail("uses its input before it exists (no recv_act of it before; stage " + std::to_string(prev_stage) +
                   " makes it)");
          }
          ++in_flight;
          ++resident;
          a.peak_in_flight[idx(st)] = std::max(a.peak_in_flight[idx(st)], in_flight);
          break;
        case NodeKind::backward_input:
          twice(x.b);
          if (x.f < 0) fail("B before its F");
          if (x.offload >= 0 && x.reload < 0) fail("its activations are offloaded (position " + std::to_string(x.offload) + ") and never reloaded before it");
          if (vs + 1 < V) {
            if (next_stage == st && work[idx(n.microbatch)][idx(next_chunk)].b < 0)
              fail("uses its output gradient before it exists (B mb " + std::to_string(n.microbatch) + " chunk " +
                   std::to_string(next_chunk) + " of this stage makes it, later or never)");
            if (next_stage != st && x.recv_grad < 0)
              fail("uses its output gradient before it exists (no recv_grad of it before; stage " +
                   std::to_string(next_stage) + " makes it)");
          }
          break;
        case NodeKind::backward_weight:
          twice(x.w);
          if (x.b < 0) fail("W before its B");
          --in_flight;
          --resident;
          break;
        case NodeKind::send_act:
          twice(x.send_act);
          if (x.f < 0) fail("sends the forward's output before its F");
          if (vs + 1 == V) fail("a send with no receiver: " + vname + " is the last");
          if (next_stage == st) fail("a send with no receiver: the next virtual stage is on this stage (handed over locally)");
          break;
        case NodeKind::send_grad:
          twice(x.send_grad);
          if (x.b < 0) fail("sends the input gradient before its B");
          if (vs == 0) fail("a send with no receiver: virtual stage 0 has no previous stage");
          if (prev_stage == st) fail("a send with no receiver: the previous virtual stage is on this stage (handed over locally)");
          break;
        case NodeKind::recv_act:
          twice(x.recv_act);
          if (vs == 0) fail("a receive with no matching send: virtual stage 0 reads the data");
          if (prev_stage == st) fail("a receive with no matching send: the previous virtual stage is on this stage");
          break;
        case NodeKind::recv_grad:
          twice(x.recv_grad);
          if (vs + 1 == V) fail("a receive with no matching send: " + vname + " is the last (the loss)");
          if (next_stage == st) fail("a receive with no matching send: the next virtual stage is on this stage");
          break;
        case NodeKind::offload:
          twice(x.offload);
          if (x.f < 0 || x.b >= 0) fail("offload outside its F .. B");
          --resident;
          ++host;
          break;
        case NodeKind::reload:
          twice(x.reload);
          if (x.offload < 0) fail("reload without an offload before it");
          if (x.b >= 0) fail("reload after its B");
          ++resident;
          --host;
          break;
        case NodeKind::optimizer: break;
      }
      a.peak_resident[idx(st)] = std::max(a.peak_resident[idx(st)], resident);
      a.peak_host[idx(st)] = std::max(a.peak_host[idx(st)], host);
    }
    // Nothing left undone.
    const int end = static_cast<int>(l.size());
    for (int mb = 0; mb < m; ++mb)
      for (int c = 0; c < v; ++c) {
        const Work& x = work[idx(mb)][idx(c)];
        const int vs = s.virtual_stage(st, c);
        auto unfinished = [&](int at, NodeKind kind, const std::string& what) {
          const Node n{kind, mb, c};
          throw ConfigError("schedule " + s.name + ": stage " + std::to_string(st) + ", position " +
                            (at >= 0 ? std::to_string(at) : "end " + std::to_string(end)) + " (" + describe(n) + "): " +
                            what + " (microbatch " + std::to_string(mb) + " unfinished)");
        };
        if (x.f < 0) unfinished(-1, NodeKind::forward, "never runs");
        if (x.b < 0) unfinished(x.f, NodeKind::forward, "its B never runs");
        if (x.w < 0) unfinished(x.b, NodeKind::backward_input, "its W never runs");
        if (vs + 1 < V && s.place(vs + 1).first != st && x.send_act < 0)
          unfinished(x.f, NodeKind::forward, "its output is never sent (send_act)");
        if (vs > 0 && s.place(vs - 1).first != st && x.send_grad < 0)
          unfinished(x.b, NodeKind::backward_input, "its input gradient is never sent (send_grad)");
        if (x.offload >= 0 && x.reload < 0) unfinished(x.offload, NodeKind::offload, "never reloaded");
      }
  }

  // 2. All stages together: sends and receives matched in order per (kind, from, to); a
  // receive waits for its send. Vector clocks (Lamport 1978; Mattern 1989) tell a sender when
  // its send is known to have arrived.
  struct Sent {
    int stage, pos, microbatch, vstage;
    std::vector<int> clock;
    int recv_pos = -1;  // the receiver's position, once received
  };
  std::map<std::tuple<int, int, int>, std::vector<Sent>> sent;  // (kind 0 act / 1 grad, from, to)
  std::map<std::tuple<int, int, int>, std::size_t> received;
  std::vector<int> pc(idx(p), 0);
  std::vector<std::vector<int>> clock(idx(p), std::vector<int>(idx(p), 0));
  std::vector<std::vector<std::pair<int, std::tuple<int, int, int>>>> pending(idx(p));  // sends not known done: (pos, channel)
  std::map<std::pair<int, int>, std::pair<std::tuple<int, int, int>, std::size_t>> send_entry;  // (stage, pos) -> entry
  auto peer_of = [&](int st, const Node& n) {
    const int vs = s.virtual_stage(st, n.chunk);
    const bool to_next = n.kind == NodeKind::send_act || n.kind == NodeKind::recv_grad;
    return s.place(to_next ? vs + 1 : vs - 1).first;
  };
  for (;;) {
    bool progress = false, all_done = true;
    for (int st = 0; st < p; ++st) {
      const auto& l = s.nodes[idx(st)];
      while (pc[idx(st)] < static_cast<int>(l.size())) {
        const int pos = pc[idx(st)];
        const Node& n = l[idx(pos)];
        if (is_recv(n.kind)) {
          const int from = peer_of(st, n), kind = n.kind == NodeKind::recv_act ? 0 : 1;
          const auto key = std::tuple{kind, from, st};
          auto& q = sent[key];
          const std::size_t k = received[key];
          if (k >= q.size()) break;  // blocked until the send runs
          Sent& x = q[k];
          const int want_vs = s.virtual_stage(st, n.chunk) + (kind == 0 ? -1 : 1);
          if (x.microbatch != n.microbatch || x.vstage != want_vs)
            bad_schedule(s, st, pos, n,
                         "a receive with no matching send: " + std::string(kind == 0 ? "send_act" : "send_grad") +
                             " number " + std::to_string(k + 1) + " from stage " + std::to_string(from) +
                             " (position " + std::to_string(x.pos) + ") is microbatch " + std::to_string(x.microbatch) +
                             " of virtual stage " + std::to_string(x.vstage));
          x.recv_pos = pos;
          ++received[key];
          for (int t = 0; t < p; ++t) clock[idx(st)][idx(t)] = std::max(clock[idx(st)][idx(t)], x.clock[idx(t)]);
        }
        clock[idx(st)][idx(st)] = pos + 1;
        if (is_send(n.kind)) {
          const int to = peer_of(st, n), kind = n.kind == NodeKind::send_act ? 0 : 1;
          const auto key = std::tuple{kind, st, to};
          sent[key].push_back({st, pos, n.microbatch, s.virtual_stage(st, n.chunk), clock[idx(st)], -1});
          send_entry[{st, pos}] = {key, sent[key].size() - 1};
          pending[idx(st)].push_back({pos, key});
        }
        // Sends of this stage now known to have arrived.
        auto& pend = pending[idx(st)];
        for (std::size_t i = 0; i < pend.size();) {
          const auto& [spos, key] = pend[i];
          const Sent& x = sent[key][send_entry[{st, spos}].second];
          const int to = std::get<2>(key);
          if (x.recv_pos >= 0 && clock[idx(st)][idx(to)] > x.recv_pos) {
            a.send_done_at[idx(st)][idx(spos)] = pos;
            pend.erase(pend.begin() + static_cast<std::ptrdiff_t>(i));
          } else {
            ++i;
          }
        }
        ++pc[idx(st)];
        progress = true;
      }
      if (pc[idx(st)] < static_cast<int>(l.size())) all_done = false;
    }
    if (all_done) break;
    if (!progress) {
      std::string msg = "schedule " + s.name + " deadlocks:";
      int shown = 0;
      for (int st = 0; st < p; ++st) {
        const auto& l = s.nodes[idx(st)];
        if (pc[idx(st)] >= static_cast<int>(l.size())) continue;
        if (shown == 4) {
          msg += " ...";
          break;
        }
        const Node& n = l[idx(pc[idx(st)])];
        msg += std::string(shown++ ? ";" : "") + " stage " + std::to_string(st) + ", position " +
               std::to_string(pc[idx(st)]) + " (" + describe(n) + ") waits for stage " + std::to_string(peer_of(st, n));
      }
      throw ConfigError(msg);
    }
  }
  for (const auto& [key, q] : sent)
    if (received[key] < q.size()) {
      const Sent& x = q[received[key]];
      bad_schedule(s, x.stage, x.pos, s.nodes[idx(x.stage)][idx(x.pos)],
                   "never received by stage " + std::to_string(std::get<2>(key)));
    }
  return a;
}

// ---- timing estimate -----------------------------------------------------------------------

double ScheduleEstimate::mean_bubble() const {
  if (bubble.empty()) return 0;
  double s = 0;
  for (double b : bubble) s += b;
  return s / static_cast<double>(bubble.size());
}

ScheduleEstimate estimate(const Schedule& s, const NodeCosts& c) {
  validate(s);
  const int p = s.stages, m = s.microbatches, v = s.chunks;
  auto idx = [](int i) { return static_cast<std::size_t>(i); };
  ScheduleEstimate e;
  e.busy.assign(idx(p), 0);
  e.exposed.assign(idx(p), 0);
  e.d2h_busy.assign(idx(p), 0);
  e.h2d_busy.assign(idx(p), 0);
  e.times.resize(idx(p));
  std::vector<double> t(idx(p), 0), d2h_free(idx(p), 0), h2d_free(idx(p), 0);
  std::vector<int> pc(idx(p), 0);
  // Per stage and (microbatch, chunk): F's end, the offload copy's end, the reload copy's end
  // (-1: none).
  struct Copies {
    double f_end = 0, offloaded = -1, reloaded = -1;
  };
  std::vector<std::vector<std::vector<Copies>>> copies(idx(p), std::vector<std::vector<Copies>>(idx(m), std::vector<Copies>(idx(v))));
  // arrival times of sends per (kind, from, to), in order
  std::map<std::tuple<int, int, int>, std::vector<double>> arrive;
  std::map<std::tuple<int, int, int>, std::size_t> taken;
  auto peer_of = [&](int st, const Node& n) {
    const int vs = s.virtual_stage(st, n.chunk);
    const bool to_next = n.kind == NodeKind::send_act || n.kind == NodeKind::recv_grad;
    return s.place(to_next ? vs + 1 : vs - 1).first;
  };
  double first = std::numeric_limits<double>::infinity(), last = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int st = 0; st < p; ++st) {
      const auto& l = s.nodes[idx(st)];
      e.times[idx(st)].resize(l.size());
      while (pc[idx(st)] < static_cast<int>(l.size())) {
        const Node& n = l[idx(pc[idx(st)])];
        double start = t[idx(st)], dur = 0;
        Copies* x = n.kind == NodeKind::optimizer ? nullptr : &copies[idx(st)][idx(n.microbatch)][idx(n.chunk)];
        if (n.kind == NodeKind::offload || n.kind == NodeKind::reload) {
          // A copy on its stream; the compute stream goes on.
          const bool off = n.kind == NodeKind::offload;
          double& stream = off ? d2h_free[idx(st)] : h2d_free[idx(st)];
          const double begin = off ? std::max(x->f_end, stream) : std::max({start, stream, x->offloaded});
          stream = begin + (off ? c.offload : c.reload);
          (off ? x->offloaded : x->reloaded) = stream;
          (off ? e.d2h_busy : e.h2d_busy)[idx(st)] += stream - begin;
          e.times[idx(st)][idx(pc[idx(st)])] = {begin, stream};
          ++pc[idx(st)];
          progress = true;
          continue;
        }
        if (is_recv(n.kind)) {
          const auto key = std::tuple{n.kind == NodeKind::recv_act ? 0 : 1, peer_of(st, n), st};
          auto& q = arrive[key];
          if (taken[key] >= q.size()) break;
          start = std::max(start, q[taken[key]++]);
        } else if (is_send(n.kind)) {
          arrive[{n.kind == NodeKind::send_act ? 0 : 1, st, peer_of(st, n)}].push_back(start + c.p2p);
        } else if (n.kind == NodeKind::forward) {
          dur = c.forward;
        } else if (n.kind == NodeKind::backward_input) {
          dur = c.backward_input;
          if (x->reloaded > start) {
            e.exposed[idx(st)] += x->reloaded - start;
            start = x->reloaded;
          }
        } else if (n.kind == NodeKind::backward_weight) {
          dur = c.backward_weight;
        }
        if (dur > 0) {
          first = std::min(first, start);
          last = std::max(last, start + dur);
          e.busy[idx(st)] += dur;
        }
        if (n.kind == NodeKind::forward) x->f_end = start + dur;
        e.times[idx(st)][idx(pc[idx(st)])] = {start, start + dur};
        t[idx(st)] = start + dur;
        ++pc[idx(st)];
        progress = true;
      }
    }
  }
  e.makespan = last > first ? last - first : 0;
  for (int st = 0; st < p; ++st) e.bubble.push_back(e.makespan > 0 ? 1.0 - e.busy[idx(st)] / e.makespan : 0.0);
  return e;
}

// ---- closed forms of the peak activation memory (docs/pipeline-memory.md) -------------------

std::vector<double> expected_peak_activation(const Schedule& s, int offload_chunks) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, k = std::min(offload_chunks, v), group = s.group;
  if (k < 0) throw ConfigError("--offload-chunks = " + std::to_string(offload_chunks) + " must be at least 0");
  const bool grouped = s.name == "group-interleaved";
  if (grouped && (group < (p + 1) / 2 || group > p))
    throw ConfigError("schedule group-interleaved: the closed form needs its --group (" + std::to_string(group) + ")");
  // A deferred W keeps a reloaded (microbatch, chunk) on the device (group-interleaved runs W
  // right after B):
  // no form for zb-h1 and zb-v offloaded; a selective offload needs chunks.
  if (k > 0 && ((s.split_backward && !grouped) || (k < v && s.name != "interleaved" && !grouped)))
    throw ConfigError("schedule " + s.name + ": --offload-chunks = " + std::to_string(k) +
                      ": the closed form of an offload is derived for gpipe and 1f1b (full), interleaved and "
                      "group-interleaved");
  std::vector<double> out;
  for (int d = 0; d < p; ++d) {
    // Chunk-microbatches resident at the peak, each M_a/(p·v).
    int n = 0;
    if (k == v) n = 0;  // every activation leaves the device between its F and its reload
    else if (s.name == "gpipe") n = m;
    else if (s.name == "1f1b") n = std::min(p - d, m);
    else if (s.name == "zb-h1") n = std::min(p, m);
    else if (s.name == "zb-v") n = std::min(2 * p, 2 * m);
    else if (s.name == "interleaved" && m == p) n = (v - k) * m;  // every forward first: all kept chunks of all m
    else if (s.name == "interleaved") n = std::min(p * (v - 1 - k) + (k == 0 ? 2 * (p - d) - 1 : std::min(2 * (p - d) - 1, p)), m * v);
    else if (grouped) n = std::min(group * (v - 1 - k) + (k == 0 ? p - d : std::min(p - d, group)), m * v);
    else throw ConfigError("schedule " + s.name + ": no closed form for its activation memory");
    out.push_back(static_cast<double>(n) / (p * v));
  }
  return out;
}

}  // namespace moelab::pipeline
