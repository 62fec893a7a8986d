// harness/sim/engine.cpp — the discrete-event engine of the sim backend: dependency
// readiness, latencies, fluid max-min sharing of resources by progressive filling, and
// MPipeMoE-style interference between classes of work on one GPU. docs/PERFORMANCE.md
// ("The event engine") states the model; this file is its implementation.
//
// Units inside the simulation. A task's "alone time" T_i = max_d(amount_d / capacity_d) is
// how long it takes with every resource to itself. Its speed x_i is the fraction of that
// alone speed it currently gets (0 < x_i <= 1); it then uses x_i * s_id of resource d's
// capacity, where s_id = (amount_d / capacity_d) / T_i (s = 1 on its binding resource).
// Progress is kept as remaining alone-time: rem_i falls by x_i per second and the task ends
// when it reaches 0. Progressive filling raises every unfrozen x together, so on one resource
// tasks get equal shares (processor sharing), on a network of equal-capacity links it is
// classic max-min fair bandwidth, and in general it equalises dominant shares (DRF).
//
// Cost. Progressive filling has a useful property: the tasks frozen below level L were frozen
// by resources that saturated below L, and a task frozen at L uses none of those (it would
// have frozen there), so removing a task frozen at L leaves every task below L exactly as it
// was. An event therefore re-solves, per touched component (tasks linked through shared
// resources), only the tasks at or above the lowest level it removed (all of them when a
// task starts there); the others enter the solve as fixed usage. A task's remaining work is
// brought up to date only when its speed really changes. Work unrelated to a task thus never
// touches its arithmetic: adding unrelated tasks to a graph leaves the related times
// identical, bit for bit. An event costs O(links of the re-solved tasks · log resources) plus
// a scan of the active tasks' predicted ends.
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
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string task_label(const Task& t, std::size_t id) {
  return "task '" + t.name + "' (id " + std::to_string(id) + ")";
}

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("sim::Engine: " + msg); }

int class_index(WorkClass c) { return static_cast<int>(c); }

enum State : std::uint8_t { waiting, scheduled, active, done };

// What an event touches of a task, in one cache line.
struct Hot {
  double rem = 0;    // remaining alone-time at tlast
  double tlast = 0;  // when rem was last brought up to date
  double x = 0;      // current speed (fair speed times interference)
  double fair = 0;   // speed from progressive filling
  std::uint32_t slot_begin = 0, slot_end = 0;  // its demands in slots_
  std::uint32_t seen = 0;                      // epoch stamp: in the component being solved
  std::uint32_t slot = 0;                      // index in the active arrays while active
  std::uint32_t local = 0;                     // index in the component being solved
  std::int32_t gpu = -1;
  std::uint8_t cls = 0;
  State state = waiting;
};

struct Slot {
  int res;
  double share;  // fraction of the resource's capacity used at speed 1
};

// An active user of a resource: the task, which of its slots this is, and its share.
struct User {
  int task;
  std::uint32_t slot;
  double share;
};

// One run of the engine over a validated graph. Everything is indexed by task or resource id
// in plain vectors; nothing depends on hashing or addresses.
class Simulation {
 public:
  Simulation(const std::vector<Task>& tasks, const std::vector<double>& cap, const double (*factor)[4])
      : tasks_(tasks), cap_(cap), factor_(factor), n_(tasks.size()), nr_(cap.size()), hot_(tasks.size()) {}

  void run(std::vector<double>& ready, std::vector<double>& start, std::vector<double>& end,
           std::vector<double>& busy);

 private:
  using Start = std::pair<double, int>;  // (start time, task id)
  // A resource in the filling's heap. Equal levels may pop in either order: the tasks they
  // freeze get the same level either way (kLevelTol), and the heap's order is itself a
  // deterministic function of the component.
  struct Level {
    double level;
    std::uint32_t local;  // index in the component
    bool operator>(const Level& o) const { return level > o.level; }
  };
  // Per-resource bookkeeping of the current event.
  struct ResScratch {
    double theta = 0;  // lowest level removed from the resource in this event (0: a task started)
    std::uint32_t dirty = 0, seen = 0;
    std::uint32_t local = 0;  // index in the component being solved
  };
  // A (task, resource) pair of the component being solved, in local indices.
  struct Link {
    std::uint32_t local;
    double share;
  };

  void build();
  void next_epoch();
  void release(int i);
  void activate(int i, double t);
  void finish(int i, double t);
  void mark_resource(int r, double theta);
  void mark_gpu(int g);
  void solve_component(int r0, double t);
  void sift_level(std::size_t p);
  void pop_level();
  double speed_factor(const Hot& h) const;
  void set_speed(int i, double x, double t);

  const std::vector<Task>& tasks_;
  const std::vector<double>& cap_;
  const double (*factor_)[4];  // [victim][aggressor]
  std::size_t n_, nr_;

  // Graph, flattened.
  std::vector<Slot> slots_;            // demands with a positive share, per task contiguous
  std::vector<double> alone_;          // T_i
  std::vector<std::size_t> dep_off_;   // task -> tasks that depend on it
  std::vector<int> dependents_;
  std::vector<int> pending_;           // dependencies not yet ended
  int ngpu_ = 0;

  // Task state.
  std::vector<Hot> hot_;
  std::vector<double> ready_, start_, end_;
  // Active tasks, densely, with their predicted ends (infinity until their first solve). The
  // next end is found by scanning these: an event changes the speeds of a large part of the
  // tasks it re-solves, and a scan of a few thousand contiguous doubles costs less than
  // keeping a heap ordered through hundreds of key changes per event.
  std::vector<double> pred_;
  std::vector<int> active_;
  std::priority_queue<Start, std::vector<Start>, std::greater<>> starts_;

  // Resource state: active users (any order), busy time.
  std::vector<std::vector<User>> users_;
  std::vector<std::uint32_t> user_pos_;  // per slot: its index in its resource's user list
  std::vector<double> busy_, busy_since_;
  std::vector<ResScratch> res_;

  // Interference state: active tasks per (gpu, class), and the classed tasks per GPU.
  std::vector<int> class_count_;
  std::vector<std::uint8_t> class_mask_;  // per GPU: bit c set while a task of class c runs
  std::vector<std::vector<int>> gpu_tasks_;
  std::vector<std::size_t> gpu_pos_;
  std::vector<std::uint32_t> gpu_dirty_;

  // Per-event scratch, reset by bumping epoch_ instead of clearing arrays.
  std::uint32_t epoch_ = 0;
  std::vector<int> dirty_res_, dirty_gpu_;

  // The component being solved, in local indices so that the filling works on small,
  // contiguous arrays: its resources and their unfrozen users (comp_res_, user_off_, users_of_,
  // in breadth-first order), its tasks and their resources (comp_tasks_, link_off_, links_).
  // All are sized once for the whole graph: no growth checks in the inner loops.
  std::vector<int> comp_res_, comp_tasks_;
  std::vector<std::size_t> user_off_, link_off_;
  std::vector<Link> users_of_, links_;
  std::vector<double> l_w_, l_total_, l_fair_;  // unfrozen shares, usage; fair level or -1
  std::vector<int> l_unfrozen_;
  std::vector<std::uint32_t> batch_;
  std::vector<Level> fill_heap_;
};

void Simulation::build() {
  // Demands: drop zero amounts, merge repeated resources (sorted by id so the order in which
  // a task lists them does not matter), and express each as a share of the alone speed.
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
    Hot& h = hot_[i];
    h.slot_begin = static_cast<std::uint32_t>(slots_.size());
    for (const auto& [r, a] : dem) {
      // A share that underflows to 0 is no demand (and an alone time of 0 is no work).
      const double share = t_alone > 0 ? (a / cap_[static_cast<std::size_t>(r)]) / t_alone : 0.0;
      if (share > 0) slots_.push_back({r, share});
    }
    h.slot_end = static_cast<std::uint32_t>(slots_.size());
    h.gpu = tasks_[i].cls == WorkClass::none ? -1 : std::max(-1, tasks_[i].gpu);
    h.cls = static_cast<std::uint8_t>(class_index(tasks_[i].cls));
    ngpu_ = std::max(ngpu_, h.gpu + 1);
  }

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

  ready_.assign(n_, 0);
  start_.assign(n_, 0);
  end_.assign(n_, 0);
  users_.assign(nr_, {});
  user_pos_.assign(slots_.size(), 0);
  busy_.assign(nr_, 0);
  busy_since_.assign(nr_, 0);
  res_.assign(nr_, {});
  class_count_.assign(static_cast<std::size_t>(ngpu_) * 4, 0);
  class_mask_.assign(static_cast<std::size_t>(ngpu_), 0);
  gpu_tasks_.assign(static_cast<std::size_t>(ngpu_), {});
  gpu_pos_.assign(n_, 0);
  gpu_dirty_.assign(static_cast<std::size_t>(ngpu_), 0);
  comp_res_.assign(nr_, 0);
  comp_tasks_.assign(n_, 0);
  user_off_.assign(nr_ + 1, 0);
  link_off_.assign(n_ + 1, 0);
  users_of_.assign(slots_.size(), {});
  links_.assign(slots_.size(), {});
  l_w_.assign(nr_, 0);
  l_total_.assign(nr_, 0);
  l_unfrozen_.assign(nr_, 0);
  l_fair_.assign(n_, 0);
  batch_.assign(n_, 0);
}

// Stamps compare equal to epoch_ only within one event; on the (theoretical) wrap-around
// every stamp is cleared so that none can match by accident.
void Simulation::next_epoch() {
  if (++epoch_ != 0) return;
  for (Hot& h : hot_) h.seen = 0;
  for (ResScratch& r : res_) r.dirty = r.seen = 0;
  std::fill(gpu_dirty_.begin(), gpu_dirty_.end(), 0u);
  epoch_ = 1;
}

void Simulation::mark_resource(int r, double theta) {
  ResScratch& s = res_[static_cast<std::size_t>(r)];
  if (s.dirty != epoch_) {
    s.dirty = epoch_;
    s.theta = theta;
    dirty_res_.push_back(r);
  } else {
    s.theta = std::min(s.theta, theta);
  }
}

void Simulation::mark_gpu(int g) {
  auto& stamp = gpu_dirty_[static_cast<std::size_t>(g)];
  if (stamp == epoch_) return;
  stamp = epoch_;
  dirty_gpu_.push_back(g);
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
      hot_[j].state = scheduled;
      starts_.emplace(start_[j], static_cast<int>(j));
    }
  }
}

void Simulation::activate(int i, double t) {
  const auto u = static_cast<std::size_t>(i);
  Hot& h = hot_[u];
  if (h.slot_begin == h.slot_end) {  // no work: ends as it starts
    end_[u] = t;
    h.state = done;
    release(i);
    return;
  }
  h.state = active;
  h.rem = alone_[u];
  h.tlast = t;
  h.x = 0;
  h.fair = 0;
  h.slot = static_cast<std::uint32_t>(active_.size());
  active_.push_back(i);
  pred_.push_back(kInf);
  for (std::uint32_t s = h.slot_begin; s < h.slot_end; ++s) {
    const auto r = static_cast<std::size_t>(slots_[s].res);
    if (users_[r].empty()) busy_since_[r] = t;
    user_pos_[s] = static_cast<std::uint32_t>(users_[r].size());
    users_[r].push_back({i, s, slots_[s].share});
    mark_resource(slots_[s].res, 0.0);  // a new user: the whole component is re-solved
  }
  if (h.gpu >= 0) {
    auto& list = gpu_tasks_[static_cast<std::size_t>(h.gpu)];
    gpu_pos_[u] = list.size();
    list.push_back(i);
    if (++class_count_[static_cast<std::size_t>(h.gpu) * 4 + h.cls] == 1) {
      class_mask_[static_cast<std::size_t>(h.gpu)] |= static_cast<std::uint8_t>(1u << h.cls);
      mark_gpu(h.gpu);
    }
  }
}

void Simulation::finish(int i, double t) {
  const auto u = static_cast<std::size_t>(i);
  Hot& h = hot_[u];
  end_[u] = t;
  h.state = done;
  const int moved = active_.back();
  active_[h.slot] = moved;
  pred_[h.slot] = pred_.back();
  hot_[static_cast<std::size_t>(moved)].slot = h.slot;
  active_.pop_back();
  pred_.pop_back();
  for (std::uint32_t s = h.slot_begin; s < h.slot_end; ++s) {
    const auto r = static_cast<std::size_t>(slots_[s].res);
    auto& list = users_[r];
    const User last = list.back();
    list[user_pos_[s]] = last;
    user_pos_[last.slot] = user_pos_[s];
    list.pop_back();
    if (list.empty()) busy_[r] += t - busy_since_[r];
    mark_resource(slots_[s].res, h.fair);  // tasks below its level keep their speeds
  }
  if (h.gpu >= 0) {
    auto& list = gpu_tasks_[static_cast<std::size_t>(h.gpu)];
    const int last = list.back();
    list[gpu_pos_[u]] = last;
    gpu_pos_[static_cast<std::size_t>(last)] = gpu_pos_[u];
    list.pop_back();
    if (--class_count_[static_cast<std::size_t>(h.gpu) * 4 + h.cls] == 0) {
      class_mask_[static_cast<std::size_t>(h.gpu)] &= static_cast<std::uint8_t>(~(1u << h.cls));
      mark_gpu(h.gpu);
    }
  }
  release(i);
}

// The filling's min-heap of resources by level (std::greater order on Level).
void Simulation::sift_level(std::size_t p) {
  const std::size_t size = fill_heap_.size();
  const Level e = fill_heap_[p];
  for (;;) {
    std::size_t c = 2 * p + 1;
    if (c >= size) break;
    if (c + 1 < size) c += fill_heap_[c] > fill_heap_[c + 1] ? 1 : 0;
    if (!(e > fill_heap_[c])) break;
    fill_heap_[p] = fill_heap_[c];
    p = c;
  }
  fill_heap_[p] = e;
}

void Simulation::pop_level() {
  fill_heap_.front() = fill_heap_.back();
  fill_heap_.pop_back();
  if (!fill_heap_.empty()) sift_level(0);
}

// Re-solves the tasks at or above level theta connected to resource r0, then gives them
// their new speeds. This is the engine's inner loop; it works through raw pointers held in
// locals so that the compiler need not reload them after every store.
//
// 1. Gathering. Each resource's users are split at theta: those below keep their speeds
//    (their usage is summed as frozen), those at or above are the unfrozen users of this
//    solve. A user seen for the first time joins the component with its resources (breadth
//    first). Everything is numbered locally, so the filling works on small contiguous arrays.
// 2. Progressive filling. Every unfrozen task's speed rises together; the resource whose
//    level (1 - usage of its frozen users) / (shares of its unfrozen users) is lowest
//    saturates first and freezes its unfrozen users at that level. A resource's level only
//    rises as its users freeze elsewhere (they freeze at levels no higher than its own), so a
//    heap key is a lower bound: if the top's current level exceeds the next key, it moves
//    down with the new key. The level that freezes tasks sums the unfrozen shares afresh, so
//    long runs do not accumulate the rounding of the running sum.
void Simulation::solve_component(int r0, double t) {
  const std::uint32_t epoch = epoch_;
  const double theta = res_[static_cast<std::size_t>(r0)].theta;
  Hot* const hot = hot_.data();
  const Slot* const slots = slots_.data();
  ResScratch* const res = res_.data();
  int* const comp_res = comp_res_.data();
  int* const comp_tasks = comp_tasks_.data();
  std::size_t* const user_off = user_off_.data();
  std::size_t* const link_off = link_off_.data();
  Link* const users_of = users_of_.data();
  Link* const links = links_.data();
  double* const lw = l_w_.data();
  double* const ltotal = l_total_.data();
  int* const lunfrozen = l_unfrozen_.data();

  std::size_t m = 0, n = 0, nu = 0, nl = 0;
  res[r0].seen = epoch;
  res[r0].local = 0;
  comp_res[m++] = r0;
  for (std::size_t j = 0; j < m; ++j) {
    const auto& list = users_[static_cast<std::size_t>(comp_res[j])];
    user_off[j] = nu;
    const std::size_t first = nu;
    double w = 0, used = 0;
    for (const User& us : list) {
      Hot& h = hot[us.task];
      if (h.seen != epoch) {
        if (h.fair < theta) {  // keeps its speed
          used += h.fair * us.share;
          continue;
        }
        h.seen = epoch;
        h.local = static_cast<std::uint32_t>(n);
        comp_tasks[n] = us.task;
        link_off[n++] = nl;
        for (std::uint32_t k = h.slot_begin; k < h.slot_end; ++k) {
          ResScratch& other = res[slots[k].res];
          if (other.seen != epoch) {
            other.seen = epoch;
            other.local = static_cast<std::uint32_t>(m);
            comp_res[m++] = slots[k].res;
          }
          links[nl++] = {other.local, slots[k].share};
        }
      }
      users_of[nu++] = {h.local, us.share};
      w += us.share;
    }
    lw[j] = w;
    ltotal[j] = used;
    lunfrozen[j] = static_cast<int>(nu - first);
  }
  user_off[m] = nu;
  link_off[n] = nl;

  if (n > 0) {
    double* const fair = l_fair_.data();
    std::uint32_t* const batch = batch_.data();
    std::fill_n(fair, n, -1.0);
    fill_heap_.clear();
    // A resource whose level starts above 1 never saturates first: each task's binding
    // resource (share 1) has a level of at most 1, so every user freezes before it fills.
    for (std::size_t j = 0; j < m; ++j)
      if (const double start_level = (1 - ltotal[j]) / lw[j]; lunfrozen[j] > 0 && start_level <= 1)
        fill_heap_.push_back({start_level, static_cast<std::uint32_t>(j)});
    std::make_heap(fill_heap_.begin(), fill_heap_.end(), std::greater<>{});

    std::size_t unfrozen = n;
    double level = theta;
    while (unfrozen > 0) {
      const std::uint32_t j = fill_heap_.front().local;
      if (lunfrozen[j] == 0) {  // all its users froze elsewhere
        pop_level();
        continue;
      }
      const std::size_t size = fill_heap_.size();
      if (size > 1) {
        const double estimate = lw[j] > 0 ? (1 - ltotal[j]) / lw[j] : fill_heap_.front().level;
        double next = fill_heap_[1].level;
        if (size > 2 && fill_heap_[2].level < next) next = fill_heap_[2].level;
        if (estimate > next * (1 + kLevelTol)) {
          fill_heap_.front().level = estimate;
          sift_level(0);
          continue;
        }
      }
      pop_level();
      // Branch-free: whether a user is still unfrozen is as good as random.
      double w = 0;
      std::size_t nb = 0;
      for (std::size_t x = user_off[j]; x < user_off[j + 1]; ++x) {
        const bool open = fair[users_of[x].local] < 0;
        w += open ? users_of[x].share : 0.0;
        batch[nb] = users_of[x].local;
        nb += open ? 1 : 0;
      }
      const double l = (1 - ltotal[j]) / w;
      // Levels only rise; within kLevelTol they are equal (this also absorbs rounding that
      // would put a later level a hair below an earlier one, or below theta).
      if (l > level * (1 + kLevelTol)) level = l;
      for (std::size_t b = 0; b < nb; ++b) {
        const std::uint32_t k = batch[b];
        fair[k] = level;
        for (std::size_t e = link_off[k]; e < link_off[k + 1]; ++e) {
          const std::uint32_t jj = links[e].local;
          ltotal[jj] += level * links[e].share;
          lw[jj] -= links[e].share;
          --lunfrozen[jj];
        }
      }
      unfrozen -= nb;
    }
  }

  for (std::size_t k = 0; k < n; ++k) {
    const int i = comp_tasks[k];
    Hot& h = hot[i];
    h.fair = l_fair_[k];
    set_speed(i, h.fair * speed_factor(h), t);
  }
}

// Interference: slowed by factor(own class, aggressor) while an aggressor class runs on its
// GPU; with several, the smallest factor (the strongest aggressor binds).
double Simulation::speed_factor(const Hot& h) const {
  if (h.gpu < 0) return 1.0;
  const unsigned others = class_mask_[static_cast<std::size_t>(h.gpu)] & ~(1u << h.cls);
  double f = 1.0;
  for (int a = 1; a < 4; ++a)
    if (others & (1u << a)) f = std::min(f, factor_[h.cls][a]);
  return f;
}

// A task's remaining work is advanced only here, when its speed really changes, so the
// arithmetic of its progress depends on its own speed history alone.
void Simulation::set_speed(int i, double x, double t) {
  Hot& h = hot_[static_cast<std::size_t>(i)];
  if (x == h.x) return;
  if (h.x > 0) h.rem = std::max(0.0, h.rem - h.x * (t - h.tlast));
  h.tlast = t;
  h.x = x;
  pred_[h.slot] = t + h.rem / x;
}

void Simulation::run(std::vector<double>& ready, std::vector<double>& start, std::vector<double>& end,
                     std::vector<double>& busy) {
  build();
  for (std::size_t i = 0; i < n_; ++i)
    if (pending_[i] == 0) {
      start_[i] = tasks_[i].latency;
      hot_[i].state = scheduled;
      starts_.emplace(start_[i], static_cast<int>(i));
    }

  std::vector<int> due;
  for (;;) {
    double t = kInf;
    if (!starts_.empty()) t = starts_.top().first;
    {
      // Four independent minima: the scan then runs at load speed instead of waiting on
      // one chain of comparisons.
      double m0 = kInf, m1 = kInf, m2 = kInf, m3 = kInf;
      const std::size_t np = pred_.size();
      std::size_t k = 0;
      for (; k + 4 <= np; k += 4) {
        m0 = pred_[k] < m0 ? pred_[k] : m0;
        m1 = pred_[k + 1] < m1 ? pred_[k + 1] : m1;
        m2 = pred_[k + 2] < m2 ? pred_[k + 2] : m2;
        m3 = pred_[k + 3] < m3 ? pred_[k + 3] : m3;
      }
      for (; k < np; ++k) m0 = pred_[k] < m0 ? pred_[k] : m0;
      t = std::min({t, m0, m1, m2, m3});
    }
    if (!(t < kInf)) break;
    next_epoch();
    dirty_res_.clear();
    dirty_gpu_.clear();

    // 1. Tasks due now end, in id order.
    due.clear();
    for (std::size_t k = 0; k < pred_.size(); ++k)
      if (pred_[k] <= t) due.push_back(active_[k]);
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
        for (const User& us : users_[static_cast<std::size_t>(dirty_res_[swept])])
          if (pred_[hot_[static_cast<std::size_t>(us.task)].slot] <= horizon) due.push_back(us.task);
      if (!due.empty()) {
        std::sort(due.begin(), due.end());
        due.erase(std::unique(due.begin(), due.end()), due.end());
        for (int i : due) finish(i, t);
        changed = true;
      }
      if (!changed) break;
    }

    // 3. New fair speeds in the touched components, lowest removed level first (a solve from
    //    a lower level covers everything one from a higher level would); then interference
    //    on the touched GPUs.
    std::sort(dirty_res_.begin(), dirty_res_.end(), [&](int a, int b) {
      const double ta = res_[static_cast<std::size_t>(a)].theta, tb = res_[static_cast<std::size_t>(b)].theta;
      return ta < tb || (ta == tb && a < b);
    });
    for (int r : dirty_res_)
      if (res_[static_cast<std::size_t>(r)].seen != epoch_) solve_component(r, t);
    for (int g : dirty_gpu_)
      for (int i : gpu_tasks_[static_cast<std::size_t>(g)]) {
        const Hot& h = hot_[static_cast<std::size_t>(i)];
        set_speed(i, h.fair * speed_factor(h), t);
      }
  }

  for (std::size_t i = 0; i < n_; ++i)
    if (hot_[i].state != done)
      throw std::logic_error("sim::Engine: internal error: " + task_label(tasks_[i], i) + " never ended");
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

void Engine::set_interference(WorkClass victim, WorkClass aggressor, double factor) {
  if (victim == WorkClass::none || aggressor == WorkClass::none)
    bad("interference factors apply between compute, comm and memcpy, not to class none");
  if (victim == aggressor)
    bad(std::string("interference of ") + work_class_name(victim) +
        " with itself: tasks of one class share resources fairly and do not interfere");
  if (!(factor > 0 && factor <= 1))
    bad(std::string("interference factor for ") + work_class_name(victim) + " beside " + work_class_name(aggressor) +
        " is " + std::to_string(factor) + "; it must lie in (0, 1]");
  factor_[class_index(victim)][class_index(aggressor)] = factor;
}

void Engine::set_interference(WorkClass victim, double factor) {
  if (victim == WorkClass::none) bad("interference factors apply to compute, comm or memcpy, not to class none");
  if (!(factor > 0 && factor <= 1))
    bad(std::string("interference factor for ") + work_class_name(victim) + " is " + std::to_string(factor) +
        "; it must lie in (0, 1]");
  for (WorkClass a : {WorkClass::compute, WorkClass::comm, WorkClass::memcpy})
    if (a != victim) factor_[class_index(victim)][class_index(a)] = factor;
}

double Engine::interference(WorkClass victim, WorkClass aggressor) const {
  if (victim == WorkClass::none || aggressor == WorkClass::none || victim == aggressor) return 1.0;
  return factor_[class_index(victim)][class_index(aggressor)];
}

double Engine::interference(WorkClass victim) const {
  double f = 1.0;
  for (WorkClass a : {WorkClass::compute, WorkClass::comm, WorkClass::memcpy})
    if (a != victim) f = std::min(f, factor_[class_index(victim)][class_index(a)]);
  return victim == WorkClass::none ? 1.0 : f;
}

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
