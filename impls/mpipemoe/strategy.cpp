// impls/mpipemoe/strategy.cpp — see strategy.hpp.
#include "impls/mpipemoe/strategy.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <sstream>

#include "harness/runtime/error.hpp"

namespace moelab {

Throughputs default_throughputs() { return {156e12 * 0.8, 25e9, 24e9, 0.9, 0.9, 0.9}; }

bool offloads_t_di(const std::string& s) { return s == "S1" || s == "S3"; }
bool offloads_t_m(const std::string& s) { return s == "S1" || s == "S2"; }
bool recommunicates(const std::string& s) { return s == "S2" || s == "S4"; }
bool recomputes(const std::string& s) { return s == "S3" || s == "S4"; }

std::array<double, 3> work_vector(const std::string& s, double r) {
  // Q_forward + Q_backward (MPipeMoE §III-D's table, a T_M copy = r = H/M units of b·M).
  if (!(r > 0)) throw ConfigError("mpipemoe: work_vector needs H/M > 0, got " + std::to_string(r));
  if (s == "none") return {2 + 4, 2 + 2, 0 + 0};
  if (s == "S1") return {2 + 4, 2 + 2, 2 * (1 + r)};
  if (s == "S2") return {2 + 4, 2 + 3, 2 * r};
  if (s == "S3") return {2 + 5, 2 + 2, 1 + 1};
  if (s == "S4") return {2 + 5, 2 + 3, 0 + 0};
  throw ConfigError("mpipemoe: strategy = \"" + s + "\": expected one of none, S1, S2, S3, S4, auto");
}

StrategyCost strategy_cost(const std::string& s, const Throughputs& w, double b, double M, double H,
                           double elem_bytes) {
  const auto q = work_vector(s, H / M);
  StrategyCost c;
  c.strategy = s;
  const double v_comp = b * H * M;                // multiply-adds of one GEMM of the partition
  const double v_comm = b * M * elem_bytes;       // bytes of one all-to-all of the partition
  const double v_mem = v_comm;                    // bytes of one T_DI copy (a T_M copy counts H/M in q3)
  c.comp_s = q[0] * v_comp / (w.sigma * w.comp_flops / 2);  // FLOP/s -> multiply-adds/s
  c.comm_s = q[1] * v_comm / (w.mu * w.comm_bytes);
  c.mem_s = q[2] * v_mem / (w.eta * w.mem_bytes);
  c.cost_s = std::max({c.comp_s, c.comm_s, c.mem_s});  // Eq. 10
  return c;
}

namespace {

// kTieRule's order: true when a is preferred to b among tied candidates.
bool tie_preferred(const StrategyCost& a, const StrategyCost& b) {
  auto sorted = [](const StrategyCost& c) {
    std::array<double, 3> t{c.comp_s, c.comm_s, c.mem_s};
    std::sort(t.begin(), t.end(), std::greater<>());
    return t;
  };
  const auto ta = sorted(a), tb = sorted(b);
  auto less = [](double x, double y) { return x < y * (1 - kCostTieTolerance); };
  for (int i = 1; i < 3; ++i) {
    if (less(ta[i], tb[i])) return true;
    if (less(tb[i], ta[i])) return false;
  }
  if (a.device_bytes != b.device_bytes) return a.device_bytes < b.device_bytes;
  if (a.host_bytes != b.host_bytes) return a.host_bytes < b.host_bytes;
  return false;  // list order: the earlier stays
}

}  // namespace

std::string choose_strategy(const Throughputs& w, double b, double M, double H, const MemoryBudget& budget,
                            const std::array<MemoryNeed, 4>& needs, std::vector<StrategyCost>* costs,
                            double elem_bytes) {
  std::vector<StrategyCost> all;
  double cheapest = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < needs.size(); ++i) {
    StrategyCost c = strategy_cost(strategy_names()[i + 1], w, b, M, H, elem_bytes);
    c.device_bytes = needs[i].device_bytes;
    c.host_bytes = needs[i].host_bytes;
    c.fits = (budget.device_bytes <= 0 || c.device_bytes <= budget.device_bytes) &&
             (budget.host_bytes <= 0 || c.host_bytes <= budget.host_bytes);
    if (c.fits) cheapest = std::min(cheapest, c.cost_s);
    all.push_back(c);
  }
  // The candidates that fit and cost the minimum (within the tolerance); kTieRule among them.
  const StrategyCost* chosen = nullptr;
  int n_tied = 0;
  for (auto& c : all) {
    c.tied = c.fits && c.cost_s <= cheapest * (1 + kCostTieTolerance);
    if (!c.tied) continue;
    ++n_tied;
    if (!chosen || tie_preferred(c, *chosen)) chosen = &c;
  }
  if (n_tied == 1)
    for (auto& c : all) c.tied = false;  // a single cheapest candidate is no tie
  const std::string best = chosen ? chosen->strategy : std::string();
  if (costs) *costs = all;
  if (best.empty()) {
    // The configuration does not fit: the same error (exit 3) as an allocation that fails.
    std::size_t least = 0;
    for (std::size_t i = 1; i < needs.size(); ++i)
      if (needs[i].device_bytes < needs[least].device_bytes) least = i;
    std::ostringstream m;
    m << "mpipemoe: no restore strategy fits the memory budget (device ";
    if (budget.device_bytes > 0) m << budget.device_bytes / 1e9 << " GB"; else m << "unlimited";
    m << ", host ";
    if (budget.host_bytes > 0) m << budget.host_bytes / 1e9 << " GB"; else m << "unlimited";
    m << "); the smallest device need is " << strategy_names()[least + 1] << "'s, "
      << needs[least].device_bytes / 1e9 << " GB of activations + buffers";
    throw OutOfMemory(m.str());
  }
  return best;
}

}  // namespace moelab
