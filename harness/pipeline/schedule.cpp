// harness/pipeline/schedule.cpp — pipeline schedules as data: generators, the validator and
// the timing estimate. See schedule.hpp.
//   ctest --test-dir build -R pipeline_schedule_test
#include "harness/pipeline/schedule.hpp"

#include <algorithm>
#include <limits>
#include <map>
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
// 2(p-s-1) + (v-1)p forwards.
void interleaved(Schedule& s) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, total = m * v;
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  for (int st = 0; st < p; ++st) {
    auto& l = s.nodes[static_cast<std::size_t>(st)];
    const int warm = std::min(2 * (p - st - 1) + (v - 1) * p, total);
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

const std::vector<std::string> kNames = {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"};

[[noreturn]] void bad_schedule(const Schedule& s, int stage, int pos, const Node& n, const std::string& why) {
  throw ConfigError("schedule " + s.name + ": stage " + std::to_string(stage) + ", position " + std::to_string(pos) + " (" +
                    describe(n) + "): " + why);
}

}  // namespace

std::vector<std::string> schedule_names() { return kNames; }

Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks) {
  if (std::find(kNames.begin(), kNames.end(), name) == kNames.end()) {
    std::string msg = "--schedule " + json_fields::quote(name) + " is not a schedule";
    if (const std::string best = json_fields::closest(name, kNames); !best.empty())
      msg += " (did you mean " + json_fields::quote(best) + "?)";
    else
      msg += " (gpipe, 1f1b, interleaved, zb-h1, zb-v)";
    throw ConfigError(msg);
  }
  if (stages < 1) throw ConfigError("schedule " + name + ": pp = " + std::to_string(stages) + " must be at least 1");
  if (microbatches < 1)
    throw ConfigError("schedule " + name + ": --microbatches = " + std::to_string(microbatches) + " must be at least 1");
  Schedule s;
  s.name = name;
  s.stages = stages;
  s.microbatches = microbatches;
  if (name == "interleaved") {
    s.chunks = chunks == 0 ? 2 : chunks;
    if (s.chunks < 2)
      throw ConfigError("schedule interleaved: --chunks = " + std::to_string(s.chunks) +
                        " must be at least 2 (one chunk per stage is 1f1b)");
    if (microbatches % stages != 0)
      throw ConfigError("schedule interleaved: --microbatches = " + std::to_string(microbatches) +
                        " must be a multiple of pp = " + std::to_string(stages) + " (Megatron's interleaved 1F1B)");
  } else if (name == "zb-v") {
    if (chunks != 0 && chunks != 2)
      throw ConfigError("schedule zb-v: --chunks = " + std::to_string(chunks) + ": the V-shape has 2 chunks per stage");
    s.chunks = 2;
    s.placement = Placement::vshape;
  } else if (chunks > 1) {
    throw ConfigError("schedule " + name + ": --chunks = " + std::to_string(chunks) +
                      " applies to interleaved (and zb-v, always 2); " + name + " has one chunk per stage");
  }
  s.split_backward = name == "zb-h1" || name == "zb-v";
  s.nodes.resize(static_cast<std::size_t>(stages));
  if (name == "gpipe") gpipe(s);
  else if (name == "1f1b") one_f_one_b(s);
  else if (name == "interleaved") interleaved(s);
  else if (name == "zb-h1") zb_h1(s);
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

void add_offload(Schedule& s, int chunks) {
  for (auto& l : s.nodes) {
    std::vector<Node> out;
    for (const Node& n : l) {
      if (n.kind == NodeKind::backward_input && n.chunk < chunks) out.push_back({NodeKind::reload, n.microbatch, n.chunk});
      out.push_back(n);
      if (n.kind == NodeKind::forward && n.chunk < chunks) out.push_back({NodeKind::offload, n.microbatch, n.chunk});
    }
    l = std::move(out);
  }
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

  // 1. Each stage on its own, in order: every value exists where it is used, nothing twice.
  for (int st = 0; st < p; ++st) {
    const auto& l = s.nodes[idx(st)];
    a.send_done_at[idx(st)].assign(l.size(), -1);
    std::vector<std::vector<Work>> work(idx(m), std::vector<Work>(idx(v)));
    int in_flight = 0, optimizer_at = -1;
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
          break;
        case NodeKind::reload:
          twice(x.reload);
          if (x.offload < 0) fail("reload without an offload before it");
          if (x.b >= 0) fail("reload after its B");
          break;
        case NodeKind::optimizer: break;
      }
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
  const int p = s.stages;
  auto idx = [](int i) { return static_cast<std::size_t>(i); };
  ScheduleEstimate e;
  e.busy.assign(idx(p), 0);
  e.times.resize(idx(p));
  std::vector<double> t(idx(p), 0);
  std::vector<int> pc(idx(p), 0);
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
        } else if (n.kind == NodeKind::backward_weight) {
          dur = c.backward_weight;
        }
        if (dur > 0) {
          first = std::min(first, start);
          last = std::max(last, start + dur);
          e.busy[idx(st)] += dur;
        }
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

}  // namespace moelab::pipeline
