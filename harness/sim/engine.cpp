// harness/sim/engine.cpp — the discrete-event engine of the sim backend: dependency
// readiness, latencies, fluid max-min sharing of resources by progressive filling, and
// MPipeMoE-style interference between classes of work on one GPU. docs/PERFORMANCE.md
// ("The event engine") states the model; this file is its implementation.
//
// Units inside the simulation. A task's "alone time" T_i = max_d(amount_d / capacity_d) is
// how long it takes with every resource to itself. Its progress speed x_i is the fraction of
// that alone speed it currently gets (0 < x_i <= 1); it then uses x_i * s_id of resource d's
// capacity, where s_id = (amount_d / capacity_d) / T_i (so s = 1 on its binding resource).
// Progress is kept as remaining alone-time: rem_i falls by x_i per second and the task ends
// when it reaches 0. Progressive filling raises every unfrozen x together, so on one resource
// the tasks get equal shares (processor sharing) and on a network of equal-capacity links it
// is classic max-min fair bandwidth; in general it equalises dominant shares (DRF).
//
// Cost. An event re-solves only the connected components (tasks linked through shared
// resources) that the event touched, and a task's remaining work is brought up to date only
// when its speed really changes. Work unrelated to a task therefore never touches its
// arithmetic: adding unrelated tasks to a graph leaves the related times identical, bit for
// bit, and an event costs O(demands in the touched components · log resources).
#include "harness/sim/engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace moelab::sim {

const char* work_class_name(WorkClass c) {
  switch (c) {
    case WorkClass::none: return "none";
    case WorkClass::compute: return "compute";
    case WorkClass::comm: return "comm";
    case WorkClass::memcpy: return "memcpy";
  }
  return "unknown";
}

namespace {

// Two finishes this close (relative to the current time) are one event: a task predicted
// to end within kTimeTol·t of an event that frees one of its resources ends with it. Without
// it, tasks that end together analytically but not to the last bit (a+b versus 2a) would
// each cause an event and a re-solve, and leave remainders of 1e-16 seconds behind.
constexpr double kTimeTol = 1e-12;
// Saturation levels this close (relative) are the same level: the tasks they freeze get the
// very same speed, so symmetric tasks stay bit-identical and end in the same event.
constexpr double kLevelTol = 1e-12;

std::string task_label(const Task& t, std::size_t id) {
  return "task '" + t.name + "' (id " + std::to_string(id) + ")";
}

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("sim::Engine: " + msg); }

int class_index(WorkClass c) { return static_cast<int>(c); }

// Indexed binary min-heap of active tasks keyed by (predicted end, id). A speed change moves
// a task in place instead of leaving stale entries behind, so the heap never holds more
// than the active tasks however many times their speeds change.
class FinishHeap {
 public:
  explicit FinishHeap(const std::vector<double>& key, std::size_t n) : key_(key), pos_(n, -1) {}
  bool empty() const { return heap_.empty(); }
  int top() const { return heap_.front(); }
  bool contains(int i) const { return pos_[static_cast<std::size_t>(i)] >= 0; }
  void update(int i) {  // insert, or restore order after key_[i] changed
    auto& p = pos_[static_cast<std::size_t>(i)];
    if (p < 0) {
      p = static_cast<int>(heap_.size());
      heap_.push_back(i);
    }
    sift_down(sift_up(static_cast<std::size_t>(p)));
  }
  int pop() {
    const int i = heap_.front();
    erase(i);
    return i;
  }
  void erase(int i) {
    const auto p = static_cast<std::size_t>(pos_[static_cast<std::size_t>(i)]);
    pos_[static_cast<std::size_t>(i)] = -1;
    const int last = heap_.back();
    heap_.pop_back();
    if (last == i) return;
    heap_[p] = last;
    pos_[static_cast<std::size_t>(last)] = static_cast<int>(p);
    sift_down(sift_up(p));
  }

 private:
  bool less(int a, int b) const {
    const double ka = key_[static_cast<std::size_t>(a)], kb = key_[static_cast<std::size_t>(b)];
    return ka < kb || (ka == kb && a < b);
  }
  void place(std::size_t p, int i) {
    heap_[p] = i;
    pos_[static_cast<std::size_t>(i)] = static_cast<int>(p);
  }
  std::size_t sift_up(std::size_t p) {
    const int i = heap_[p];
    while (p > 0) {
      const std::size_t parent = (p - 1) / 2;
      if (!less(i, heap_[parent])) break;
      place(p, heap_[parent]);
      p = parent;
    }
    place(p, i);
    return p;
  }
  std::size_t sift_down(std::size_t p) {
    const int i = heap_[p];
    const std::size_t n = heap_.size();
    for (;;) {
      std::size_t c = 2 * p + 1;
      if (c >= n) break;
      if (c + 1 < n && less(heap_[c + 1], heap_[c])) ++c;
      if (!less(heap_[c], i)) break;
      place(p, heap_[c]);
      p = c;
    }
    place(p, i);
    return p;
  }

  const std::vector<double>& key_;
  std::vector<int> pos_;
  std::vector<int> heap_;
};

// One run of the engine over a validated graph. Everything is indexed by task, resource or
// demand-slot id in plain vectors; nothing depends on hashing or addresses.
class Simulation {
 public:
  Simulation(const std::vector<Task>& tasks, const std::vector<double>& cap, const double* factor)
      : tasks_(tasks), cap_(cap), factor_(factor), n_(tasks.size()), nr_(cap.size()),
        finish_heap_(pred_, tasks.size()) {}

  void run(std::vector<double>& ready, std::vector<double>& start, std::vector<double>& end,
           std::vector<double>& busy);

 private:
  enum State : unsigned char { waiting, scheduled, active, done };
  using Event = std::pair<double, int>;  // (start time, task id)
  struct Level {
    double level;
    int res;
    std::uint32_t version;
    bool operator>(const Level& o) const { return level > o.level || (level == o.level && res > o.res); }
  };

  void build();
  void release(int i);
  void activate(int i, double t);
  void finish(int i, double t);
  void mark_resource(int r);
  void mark_gpu(int g);
  void solve_component(int r0);
  void freeze(int i, double level);
  void mark_update(int i);
  bool slowed(int i) const;
  void set_speed(int i, double x, double t);
  std::size_t slot_begin(int i) const { return slot_off_[static_cast<std::size_t>(i)]; }
  std::size_t slot_end(int i) const { return slot_off_[static_cast<std::size_t>(i) + 1]; }

  const std::vector<Task>& tasks_;
  const std::vector<double>& cap_;
  const double* factor_;
  std::size_t n_, nr_;

  // Graph, flattened. A demand slot is one (task, resource) pair with a positive amount.
  std::vector<std::size_t> slot_off_;  // task -> its slots [off[i], off[i+1])
  std::vector<int> slot_res_, slot_task_;
  std::vector<double> slot_share_;     // s: fraction of the capacity used at full speed
  std::vector<std::size_t> slot_pos_;  // index of the slot in its resource's user list
  std::vector<double> alone_;          // T_i
  std::vector<std::size_t> dep_off_;   // task -> tasks that depend on it
  std::vector<int> dependents_;
  std::vector<int> pending_;           // dependencies not yet ended
  int ngpu_ = 0;

  // Task state.
  std::vector<State> state_;
  std::vector<double> ready_, start_, end_;
  std::vector<double> rem_;    // remaining alone-time at tlast_
  std::vector<double> tlast_;
  std::vector<double> x_;      // current speed (after interference)
  std::vector<double> fair_;   // fair speed from progressive filling (before interference)
  std::vector<double> pred_;   // predicted end at the current speed
  FinishHeap finish_heap_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> starts_;

  // Resource state.
  std::vector<std::vector<int>> users_;  // active slots on the resource
  std::vector<double> busy_, busy_since_;

  // Interference state: active tasks per (gpu, class), and the classed tasks per GPU.
  std::vector<int> class_count_;
  std::vector<std::vector<int>> gpu_tasks_;
  std::vector<std::size_t> gpu_pos_;

  // Per-event scratch, reset by bumping epoch_ instead of clearing arrays.
  std::uint64_t epoch_ = 0;
  std::vector<std::uint64_t> res_dirty_, res_seen_, gpu_dirty_, task_seen_, task_frozen_, task_upd_;
  std::vector<int> dirty_res_, dirty_gpu_, update_;
  std::vector<int> comp_res_, comp_tasks_;
  std::vector<double> fill_w_, fill_used_;  // unfrozen share sum, frozen usage, per resource
  std::vector<int> fill_unfrozen_;
  std::vector<std::uint32_t> fill_version_;
  std::vector<Level> fill_heap_;
};

void Simulation::build() {
  // Demands: drop zero amounts, merge repeated resources (sorted by id so the order in which
  // a task lists them does not matter), and express each as a share of the alone speed.
  slot_off_.assign(n_ + 1, 0);
  alone_.assign(n_, 0);
  std::vector<std::pair<int, double>> dem;
  for (std::size_t i = 0; i < n_; ++i) {
    dem.clear();
    for (const Demand& d : tasks_[i].demands)
      if (d.amount > 0) dem.emplace_back(d.resource, d.amount);
    std::sort(dem.begin(), dem.end());
    std::size_t k = 0;
    for (std::size_t j = 0; j < dem.size(); ++j) {
      if (k > 0 && dem[k - 1].first == dem[j].first)
        dem[k - 1].second += dem[j].second;
      else
        dem[k++] = dem[j];
    }
    dem.resize(k);
    double t_alone = 0;
    for (const auto& [r, a] : dem) t_alone = std::max(t_alone, a / cap_[static_cast<std::size_t>(r)]);
    if (!std::isfinite(t_alone))
      bad(task_label(tasks_[i], i) + " would take longer than the largest representable time");
    alone_[i] = t_alone;
    for (const auto& [r, a] : dem) {
      // A share that underflows to 0 is no demand (and an alone time of 0 is no work).
      const double share = t_alone > 0 ? (a / cap_[static_cast<std::size_t>(r)]) / t_alone : 0.0;
      if (!(share > 0)) continue;
      slot_res_.push_back(r);
      slot_task_.push_back(static_cast<int>(i));
      slot_share_.push_back(share);
    }
    slot_off_[i + 1] = slot_res_.size();
    ngpu_ = std::max(ngpu_, tasks_[i].gpu + 1);
  }
  slot_pos_.assign(slot_res_.size(), 0);

  // Reverse edges, counting repeated dependencies as often as they are listed (each end
  // decrements pending_ once per listing).
  dep_off_.assign(n_ + 1, 0);
  pending_.assign(n_, 0);
  for (std::size_t i = 0; i < n_; ++i)
    for (int d : tasks_[i].deps) {
      ++dep_off_[static_cast<std::size_t>(d) + 1];
      ++pending_[i];
    }
  for (std::size_t i = 0; i < n_; ++i) dep_off_[i + 1] += dep_off_[i];
  dependents_.assign(dep_off_[n_], 0);
  std::vector<std::size_t> fill(dep_off_.begin(), dep_off_.end() - 1);
  for (std::size_t i = 0; i < n_; ++i)
    for (int d : tasks_[i].deps) dependents_[fill[static_cast<std::size_t>(d)]++] = static_cast<int>(i);

  state_.assign(n_, waiting);
  ready_.assign(n_, 0);
  start_.assign(n_, 0);
  end_.assign(n_, 0);
  rem_.assign(n_, 0);
  tlast_.assign(n_, 0);
  x_.assign(n_, 0);
  fair_.assign(n_, 0);
  pred_.assign(n_, 0);
  users_.assign(nr_, {});
  busy_.assign(nr_, 0);
  busy_since_.assign(nr_, 0);
  class_count_.assign(static_cast<std::size_t>(ngpu_) * 4, 0);
  gpu_tasks_.assign(static_cast<std::size_t>(ngpu_), {});
  gpu_pos_.assign(n_, 0);
  res_dirty_.assign(nr_, 0);
  res_seen_.assign(nr_, 0);
  gpu_dirty_.assign(static_cast<std::size_t>(ngpu_), 0);
  task_seen_.assign(n_, 0);
  task_frozen_.assign(n_, 0);
  task_upd_.assign(n_, 0);
  fill_w_.assign(nr_, 0);
  fill_used_.assign(nr_, 0);
  fill_unfrozen_.assign(nr_, 0);
  fill_version_.assign(nr_, 0);
}

void Simulation::mark_resource(int r) {
  auto& stamp = res_dirty_[static_cast<std::size_t>(r)];
  if (stamp == epoch_) return;
  stamp = epoch_;
  dirty_res_.push_back(r);
}

void Simulation::mark_gpu(int g) {
  auto& stamp = gpu_dirty_[static_cast<std::size_t>(g)];
  if (stamp == epoch_) return;
  stamp = epoch_;
  dirty_gpu_.push_back(g);
}

void Simulation::mark_update(int i) {
  auto& stamp = task_upd_[static_cast<std::size_t>(i)];
  if (stamp == epoch_) return;
  stamp = epoch_;
  update_.push_back(i);
}

// Dependency i has ended: its dependents whose last dependency it was are scheduled to
// start at ready + latency. ready is the latest end among the dependencies.
void Simulation::release(int i) {
  const double e = end_[static_cast<std::size_t>(i)];
  for (std::size_t k = dep_off_[static_cast<std::size_t>(i)]; k < dep_off_[static_cast<std::size_t>(i) + 1]; ++k) {
    const auto j = static_cast<std::size_t>(dependents_[k]);
    ready_[j] = std::max(ready_[j], e);
    if (--pending_[j] == 0) {
      start_[j] = ready_[j] + tasks_[j].latency;
      state_[j] = scheduled;
      starts_.emplace(start_[j], static_cast<int>(j));
    }
  }
}

void Simulation::activate(int i, double t) {
  const auto u = static_cast<std::size_t>(i);
  if (slot_begin(i) == slot_end(i)) {  // no work: ends as it starts
    end_[u] = t;
    state_[u] = done;
    release(i);
    return;
  }
  state_[u] = active;
  rem_[u] = alone_[u];
  tlast_[u] = t;
  x_[u] = 0;
  fair_[u] = 0;
  for (std::size_t s = slot_begin(i); s < slot_end(i); ++s) {
    const int r = slot_res_[s];
    auto& list = users_[static_cast<std::size_t>(r)];
    if (list.empty()) busy_since_[static_cast<std::size_t>(r)] = t;
    slot_pos_[s] = list.size();
    list.push_back(static_cast<int>(s));
    mark_resource(r);
  }
  const Task& task = tasks_[u];
  if (task.gpu >= 0 && task.cls != WorkClass::none) {
    auto& list = gpu_tasks_[static_cast<std::size_t>(task.gpu)];
    gpu_pos_[u] = list.size();
    list.push_back(i);
    if (++class_count_[static_cast<std::size_t>(task.gpu) * 4 + class_index(task.cls)] == 1) mark_gpu(task.gpu);
  }
  mark_update(i);
}

void Simulation::finish(int i, double t) {
  const auto u = static_cast<std::size_t>(i);
  end_[u] = t;
  state_[u] = done;
  if (finish_heap_.contains(i)) finish_heap_.erase(i);
  for (std::size_t s = slot_begin(i); s < slot_end(i); ++s) {
    const int r = slot_res_[s];
    auto& list = users_[static_cast<std::size_t>(r)];
    const int moved = list.back();
    list[slot_pos_[s]] = moved;
    slot_pos_[static_cast<std::size_t>(moved)] = slot_pos_[s];
    list.pop_back();
    if (list.empty()) busy_[static_cast<std::size_t>(r)] += t - busy_since_[static_cast<std::size_t>(r)];
    mark_resource(r);
  }
  const Task& task = tasks_[u];
  if (task.gpu >= 0 && task.cls != WorkClass::none) {
    auto& list = gpu_tasks_[static_cast<std::size_t>(task.gpu)];
    const int moved = list.back();
    list[gpu_pos_[u]] = moved;
    gpu_pos_[static_cast<std::size_t>(moved)] = gpu_pos_[u];
    list.pop_back();
    if (--class_count_[static_cast<std::size_t>(task.gpu) * 4 + class_index(task.cls)] == 0) mark_gpu(task.gpu);
  }
  release(i);
}

void Simulation::freeze(int i, double level) {
  task_frozen_[static_cast<std::size_t>(i)] = epoch_;
  fair_[static_cast<std::size_t>(i)] = level;
  for (std::size_t s = slot_begin(i); s < slot_end(i); ++s) {
    const auto r = static_cast<std::size_t>(slot_res_[s]);
    fill_used_[r] += level * slot_share_[s];
    fill_w_[r] -= slot_share_[s];
    --fill_unfrozen_[r];
  }
}

// Progressive filling over the component of resource r0: every unfrozen task's speed rises
// together; the resource whose level (1 - frozen usage) / (unfrozen shares) is lowest
// saturates first and freezes its unfrozen users at that level. A resource's level only
// rises as its users freeze elsewhere (they freeze at levels no higher than its own), so a
// heap key is a lower bound: a popped resource whose current level exceeds the next key goes
// back with the new key. The level that freezes tasks is recomputed exactly from the user
// list, not from the running sums, so long runs do not accumulate rounding.
void Simulation::solve_component(int r0) {
  comp_res_.clear();
  comp_tasks_.clear();
  res_seen_[static_cast<std::size_t>(r0)] = epoch_;
  comp_res_.push_back(r0);
  for (std::size_t q = 0; q < comp_res_.size(); ++q) {
    for (int s : users_[static_cast<std::size_t>(comp_res_[q])]) {
      const int i = slot_task_[static_cast<std::size_t>(s)];
      if (task_seen_[static_cast<std::size_t>(i)] == epoch_) continue;
      task_seen_[static_cast<std::size_t>(i)] = epoch_;
      comp_tasks_.push_back(i);
      for (std::size_t k = slot_begin(i); k < slot_end(i); ++k) {
        const auto r = static_cast<std::size_t>(slot_res_[k]);
        if (res_seen_[r] == epoch_) continue;
        res_seen_[r] = epoch_;
        comp_res_.push_back(static_cast<int>(r));
      }
    }
  }

  fill_heap_.clear();
  for (int r : comp_res_) {
    const auto u = static_cast<std::size_t>(r);
    double w = 0;
    for (int s : users_[u]) w += slot_share_[static_cast<std::size_t>(s)];
    fill_w_[u] = w;
    fill_used_[u] = 0;
    fill_unfrozen_[u] = static_cast<int>(users_[u].size());
    fill_heap_.push_back({1 / w, r, ++fill_version_[u]});
  }
  std::make_heap(fill_heap_.begin(), fill_heap_.end(), std::greater<>{});
  auto pop = [&] {
    std::pop_heap(fill_heap_.begin(), fill_heap_.end(), std::greater<>{});
    Level e = fill_heap_.back();
    fill_heap_.pop_back();
    return e;
  };
  auto push = [&](Level e) {
    fill_heap_.push_back(e);
    std::push_heap(fill_heap_.begin(), fill_heap_.end(), std::greater<>{});
  };

  std::size_t unfrozen = comp_tasks_.size();
  double level = 0;
  while (unfrozen > 0) {
    const Level e = pop();
    const auto r = static_cast<std::size_t>(e.res);
    if (e.version != fill_version_[r] || fill_unfrozen_[r] == 0) continue;
    if (!fill_heap_.empty()) {
      const double estimate = fill_w_[r] > 0 ? (1 - fill_used_[r]) / fill_w_[r] : e.level;
      if (estimate > fill_heap_.front().level * (1 + kLevelTol)) {
        push({estimate, e.res, ++fill_version_[r]});
        continue;
      }
    }
    double used = 0, w = 0;
    for (int s : users_[r]) {
      const auto i = static_cast<std::size_t>(slot_task_[static_cast<std::size_t>(s)]);
      if (task_frozen_[i] == epoch_)
        used += fair_[i] * slot_share_[static_cast<std::size_t>(s)];
      else
        w += slot_share_[static_cast<std::size_t>(s)];
    }
    const double l = (1 - used) / w;
    // Levels only rise; within kLevelTol they are equal (also absorbs rounding that would
    // make a later level a hair lower than an earlier one).
    if (l > level * (1 + kLevelTol)) level = l;
    for (int s : users_[r]) {
      const int i = slot_task_[static_cast<std::size_t>(s)];
      if (task_frozen_[static_cast<std::size_t>(i)] == epoch_) continue;
      freeze(i, level);
      --unfrozen;
    }
  }
  for (int i : comp_tasks_) mark_update(i);
}

bool Simulation::slowed(int i) const {
  const Task& t = tasks_[static_cast<std::size_t>(i)];
  if (t.gpu < 0 || t.cls == WorkClass::none) return false;
  const std::size_t base = static_cast<std::size_t>(t.gpu) * 4;
  for (int c = 1; c < 4; ++c)
    if (c != class_index(t.cls) && class_count_[base + static_cast<std::size_t>(c)] > 0) return true;
  return false;
}

// A task's remaining work is advanced only here, when its speed really changes, so the
// arithmetic of its progress depends on its own speed history alone.
void Simulation::set_speed(int i, double x, double t) {
  const auto u = static_cast<std::size_t>(i);
  if (x == x_[u]) return;
  if (x_[u] > 0) rem_[u] = std::max(0.0, rem_[u] - x_[u] * (t - tlast_[u]));
  tlast_[u] = t;
  x_[u] = x;
  pred_[u] = t + rem_[u] / x;
  finish_heap_.update(i);
}

void Simulation::run(std::vector<double>& ready, std::vector<double>& start, std::vector<double>& end,
                     std::vector<double>& busy) {
  build();
  for (std::size_t i = 0; i < n_; ++i)
    if (pending_[i] == 0) {
      start_[i] = tasks_[i].latency;
      state_[i] = scheduled;
      starts_.emplace(start_[i], static_cast<int>(i));
    }

  std::vector<int> due;
  for (;;) {
    double t = std::numeric_limits<double>::infinity();
    if (!starts_.empty()) t = starts_.top().first;
    if (!finish_heap_.empty()) t = std::min(t, pred_[static_cast<std::size_t>(finish_heap_.top())]);
    if (!(t < std::numeric_limits<double>::infinity())) break;
    ++epoch_;
    dirty_res_.clear();
    dirty_gpu_.clear();
    update_.clear();

    // 1. Tasks due now end, in id order.
    due.clear();
    while (!finish_heap_.empty() && pred_[static_cast<std::size_t>(finish_heap_.top())] <= t)
      due.push_back(finish_heap_.pop());
    std::sort(due.begin(), due.end());
    for (int i : due) finish(i, t);

    // 2. Until nothing changes: tasks due to start now start (zero-work ones end at once and
    //    may release more), and users of a resource the event touched whose predicted end is
    //    within the tolerance end now too.
    const double horizon = t + kTimeTol * t;
    std::size_t swept = 0;
    for (;;) {
      bool changed = false;
      while (!starts_.empty() && starts_.top().first <= t) {
        const int i = starts_.top().second;
        starts_.pop();
        activate(i, t);
        changed = true;
      }
      due.clear();
      for (; swept < dirty_res_.size(); ++swept)
        for (int s : users_[static_cast<std::size_t>(dirty_res_[swept])]) {
          const int i = slot_task_[static_cast<std::size_t>(s)];
          if (finish_heap_.contains(i) && pred_[static_cast<std::size_t>(i)] <= horizon) due.push_back(i);
        }
      if (!due.empty()) {
        std::sort(due.begin(), due.end());
        due.erase(std::unique(due.begin(), due.end()), due.end());
        for (int i : due) finish(i, t);
        changed = true;
      }
      if (!changed) break;
    }

    // 3. New fair speeds in the touched components; interference on the touched GPUs.
    for (int r : dirty_res_)
      if (res_seen_[static_cast<std::size_t>(r)] != epoch_ && !users_[static_cast<std::size_t>(r)].empty())
        solve_component(r);
    for (int g : dirty_gpu_)
      for (int i : gpu_tasks_[static_cast<std::size_t>(g)]) mark_update(i);
    for (int i : update_) {
      const auto u = static_cast<std::size_t>(i);
      if (state_[u] != active) continue;
      const double f = slowed(i) ? factor_[class_index(tasks_[u].cls)] : 1.0;
      set_speed(i, fair_[u] * f, t);
    }
  }

  for (std::size_t i = 0; i < n_; ++i)
    if (state_[i] != done) bad("internal error: " + task_label(tasks_[i], i) + " never ended");
  ready = std::move(ready_);
  start = std::move(start_);
  end = std::move(end_);
  busy = std::move(busy_);
}

}  // namespace

int Engine::add_resource(std::string name, double capacity) {
  if (!(capacity > 0) || !std::isfinite(capacity))
    bad("resource '" + name + "' has capacity " + std::to_string(capacity) + "; it must be positive and finite");
  res_name_.push_back(std::move(name));
  res_cap_.push_back(capacity);
  return static_cast<int>(res_cap_.size() - 1);
}

int Engine::add_task(Task t) {
  tasks_.push_back(std::move(t));
  return static_cast<int>(tasks_.size() - 1);
}

void Engine::set_interference(WorkClass victim, double factor) {
  if (victim == WorkClass::none) bad("interference factors apply to compute, comm or memcpy, not to class none");
  if (!(factor > 0 && factor <= 1))
    bad(std::string("interference factor for ") + work_class_name(victim) + " is " + std::to_string(factor) +
        "; it must lie in (0, 1]");
  factor_[static_cast<int>(victim)] = factor;
}

double Engine::interference(WorkClass victim) const { return factor_[static_cast<int>(victim)]; }

void Engine::run() {
  const std::size_t n = tasks_.size();
  for (std::size_t r = 0; r < res_cap_.size(); ++r)
    if (!(res_cap_[r] > 0) || !std::isfinite(res_cap_[r]))
      bad("resource '" + res_name_[r] + "' has a non-positive capacity");
  for (std::size_t i = 0; i < n; ++i) {
    const Task& t = tasks_[i];
    if (!(t.latency >= 0) || !std::isfinite(t.latency))
      bad(task_label(t, i) + " has latency " + std::to_string(t.latency) + "; it must be finite and >= 0");
    for (const Demand& d : t.demands) {
      if (d.resource < 0 || static_cast<std::size_t>(d.resource) >= res_cap_.size())
        bad(task_label(t, i) + " demands unknown resource id " + std::to_string(d.resource) + " (" +
            std::to_string(res_cap_.size()) + " resources)");
      if (!(d.amount >= 0) || !std::isfinite(d.amount))
        bad(task_label(t, i) + " demands amount " + std::to_string(d.amount) + " of resource '" +
            res_name_[static_cast<std::size_t>(d.resource)] + "'; amounts must be finite and >= 0");
    }
    for (int d : t.deps)
      if (d < 0 || static_cast<std::size_t>(d) >= n)
        bad(task_label(t, i) + " depends on unknown task id " + std::to_string(d) + " (" + std::to_string(n) +
            " tasks)");
  }

  // Cycle check (Kahn). A task left over has a left-over dependency; following those must
  // revisit a task, and the walk from that task back to itself is a cycle to report.
  {
    std::vector<int> indeg(n, 0);
    std::vector<std::vector<int>> out(n);
    for (std::size_t i = 0; i < n; ++i)
      for (int d : tasks_[i].deps) {
        ++indeg[i];
        out[static_cast<std::size_t>(d)].push_back(static_cast<int>(i));
      }
    std::vector<int> queue;
    for (std::size_t i = 0; i < n; ++i)
      if (indeg[i] == 0) queue.push_back(static_cast<int>(i));
    for (std::size_t q = 0; q < queue.size(); ++q)
      for (int j : out[static_cast<std::size_t>(queue[q])])
        if (--indeg[static_cast<std::size_t>(j)] == 0) queue.push_back(j);
    if (queue.size() < n) {
      std::size_t cur = 0;
      while (indeg[cur] == 0) ++cur;
      std::vector<int> seen_at(n, -1);
      std::vector<std::size_t> walk;
      while (seen_at[cur] < 0) {
        seen_at[cur] = static_cast<int>(walk.size());
        walk.push_back(cur);
        for (int d : tasks_[cur].deps)
          if (indeg[static_cast<std::size_t>(d)] > 0) {
            cur = static_cast<std::size_t>(d);
            break;
          }
      }
      // walk[seen_at[cur]..] is the cycle, each task depending on the next.
      std::string path;
      for (auto k = static_cast<std::size_t>(seen_at[cur]); k < walk.size(); ++k)
        path += "'" + tasks_[walk[k]].name + "' -> ";
      path += "'" + tasks_[cur].name + "'";
      bad("dependency cycle through " + task_label(tasks_[cur], cur) + ": " + path + " (each waits for the next)");
    }
  }

  std::vector<double> ready, start, end;
  Simulation sim(tasks_, res_cap_, factor_);
  sim.run(ready, start, end, res_busy_);
  for (std::size_t i = 0; i < n; ++i) {
    tasks_[i].ready = ready[i];
    tasks_[i].start = start[i];
    tasks_[i].end = end[i];
  }
}

double Engine::makespan() const {
  double m = 0;
  for (const Task& t : tasks_) m = std::max(m, t.end);
  return m;
}

double Engine::busy_time(int resource) const {
  if (resource < 0 || static_cast<std::size_t>(resource) >= res_cap_.size())
    throw std::out_of_range("sim::Engine::busy_time: unknown resource id " + std::to_string(resource));
  const auto r = static_cast<std::size_t>(resource);
  return r < res_busy_.size() ? res_busy_[r] : 0.0;
}

}  // namespace moelab::sim
