// harness/config/workload.cpp — reading and checking workload files (see workload.hpp).
//
// Every message is one line, "<file>: <field path> ... <value>", because the person reading
// it is looking at that file: `tiny.json: model.top_k = 9 must be <= model.num_experts = 8`.
// Unknown fields are errors, not warnings: a misspelt optional field ("topk") would
// otherwise silently fall back to its default and change the experiment.
// Tested by harness/tests/config_test.cpp (ctest -R config).
#include "harness/config/workload.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <vector>

#include "harness/runtime/error.hpp"

namespace moelab {

using nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& origin, const std::string& msg) { throw ConfigError(origin + ": " + msg); }

// A value as it appears in the file (strings keep their quotes); long ones are cut so that
// the message stays one readable line.
std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0u : 1u)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Reads the fields of one JSON object. `prefix` is the object's path ("model.") so that
// messages name fields the way the file nests them.
class Fields {
 public:
  Fields(const json& obj, std::string origin, std::string prefix, std::vector<std::string> known)
      : obj_(obj), origin_(std::move(origin)), prefix_(std::move(prefix)), known_(std::move(known)) {
    for (const auto& [key, value] : obj_.items()) {
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      std::string msg = "unknown field " + quoted(prefix_ + key);
      const std::string* best = nullptr;
      std::size_t best_d = 3;  // suggest only close spellings
      for (const auto& k : known_) {
        const std::size_t d = edit_distance(key, k);
        if (d < best_d) {
          best_d = d;
          best = &k;
        }
      }
      if (best)
        msg += " (did you mean " + quoted(prefix_ + *best) + "?)";
      else
        msg += " (known fields: " + known_list() + ")";
      fail(origin_, msg);
    }
  }

  std::string path(const char* key) const { return prefix_ + key; }
  const std::string& origin() const { return origin_; }

  const json* find(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
  }
  const json& require(const char* key) const {
    const json* v = find(key);
    if (!v) fail(origin_, "missing field " + quoted(path(key)));
    return *v;
  }

  // An integer in [lo, hi]. JSON has one number type, so 1e3 and 64.0 are accepted as the
  // integers they denote; 1.5 and "64" are not.
  std::int64_t integer(const char* key, const json& v, std::int64_t lo, std::int64_t hi) const {
    const char* expected = lo > 0 ? "a positive integer" : "a non-negative integer";
    std::int64_t n = 0;
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(hi)) too_large(key, v, hi);
      n = static_cast<std::int64_t>(u);
    } else if (v.is_number_integer()) {
      n = v.get<std::int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!std::isfinite(d) || d != std::floor(d)) wrong_type(key, v, expected);
      if (d >= 9.2e18) too_large(key, v, hi);
      if (d <= -9.2e18) wrong_type(key, v, expected);
      n = static_cast<std::int64_t>(d);
    } else {
      wrong_type(key, v, expected);
    }
    if (n < lo) wrong_type(key, v, expected);
    if (n > hi) too_large(key, v, hi);
    return n;
  }
  std::int64_t integer(const char* key, std::int64_t lo, std::int64_t hi) const {
    return integer(key, require(key), lo, hi);
  }
  std::int64_t integer_or(const char* key, std::int64_t fallback, std::int64_t lo, std::int64_t hi) const {
    const json* v = find(key);
    return v ? integer(key, *v, lo, hi) : fallback;
  }

  double number_or(const char* key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) wrong_type(key, *v, "a number");
    return v->get<double>();
  }
  bool boolean_or(const char* key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) wrong_type(key, *v, "true or false");
    return v->get<bool>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) wrong_type(key, *v, "a string");
    return v->get<std::string>();
  }
  // One of a fixed set of words; the message lists them.
  std::string choice_or(const char* key, const std::string& fallback, const std::vector<std::string>& choices) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) wrong_type(key, *v, "a string");
    const auto s = v->get<std::string>();
    if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
      std::string list;
      for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
      fail(origin_, path(key) + " = " + show(*v) + " is not one of " + list);
    }
    return s;
  }

  [[noreturn]] void wrong_type(const char* key, const json& v, const char* expected) const {
    fail(origin_, path(key) + ": expected " + expected + ", got " + show(v));
  }
  [[noreturn]] void too_large(const char* key, const json& v, std::int64_t hi) const {
    fail(origin_, path(key) + " = " + show(v) + " is too large (at most " + std::to_string(hi) + ")");
  }

 private:
  std::string known_list() const {
    std::string s;
    for (const auto& k : known_) s += (s.empty() ? "" : ", ") + k;
    return s;
  }
  const json& obj_;
  std::string origin_, prefix_;
  std::vector<std::string> known_;
};

constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

ModelConfig parse_model_at(const json& j, const std::string& origin, const std::string& prefix) {
  const std::string name = prefix.empty() ? "the model" : prefix.substr(0, prefix.size() - 1);
  if (!j.is_object()) fail(origin, name + ": expected an object, got " + show(j));
  Fields f(j, origin, prefix,
           {"name", "description", "d_model", "d_hidden", "num_experts", "top_k", "capacity_factor", "activation",
            "noisy_gate", "renormalize", "dtype"});
  ModelConfig m;
  m.name = f.string_or("name", m.name);
  (void)f.string_or("description", "");
  m.d_model = f.integer("d_model", 1, kInt64Max);
  m.d_hidden = f.integer("d_hidden", 1, kInt64Max);
  m.num_experts = f.integer("num_experts", 1, kIntMax);
  m.top_k = static_cast<int>(f.integer("top_k", 1, kIntMax));
  if (m.top_k > m.num_experts)
    fail(origin, f.path("top_k") + " = " + std::to_string(m.top_k) + " must be <= " + f.path("num_experts") + " = " +
                     std::to_string(m.num_experts));
  m.capacity_factor = f.number_or("capacity_factor", m.capacity_factor);
  if (!(m.capacity_factor >= 0.0) || !std::isfinite(m.capacity_factor))
    fail(origin, f.path("capacity_factor") + " = " + show(*f.find("capacity_factor")) +
                     " must be a finite number >= 0 (0 means no capacity limit)");
  m.activation = parse_activation(f.choice_or("activation", activation_name(m.activation), {"gelu", "relu"}));
  m.noisy_gate = f.boolean_or("noisy_gate", m.noisy_gate);
  m.renormalize = f.boolean_or("renormalize", m.renormalize);
  m.dtype = parse_dtype(f.choice_or("dtype", dtype_name(m.dtype), {"fp32", "bf16"}));
  return m;
}

// "experiments/workloads/tiny.json" -> "tiny": the default name of a workload.
std::string stem_of(const std::string& origin) {
  const std::string stem = std::filesystem::path(origin).stem().string();
  return stem.empty() || stem[0] == '<' ? "workload" : stem;
}

// A parse error's position as nlohmann reports it ("parse error at line 3, column 5: ..."),
// without the library's "[json.exception.parse_error.101]" prefix.
std::string describe_parse_error(const json::parse_error& e) {
  std::string what = e.what();
  const auto at = what.find("at line ");
  if (at != std::string::npos) return "malformed JSON " + what.substr(at);
  const auto colon = what.find("parse error");
  return "malformed JSON: " + (colon != std::string::npos ? what.substr(colon) : what);
}

// Duplicate keys are legal JSON and nlohmann keeps the last one; in a workload file a
// repeated field is almost always an edit that forgot to remove the old line.
json parse_text(const std::string& text, const std::string& origin) {
  struct Level {
    std::set<std::string> keys;
    std::string key;
  };
  std::vector<Level> stack;
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        stack.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto key = parsed.get<std::string>();
        if (!stack.empty()) {
          if (!stack.back().keys.insert(key).second) {
            std::string path;
            for (std::size_t i = 0; i + 1 < stack.size(); ++i)
              if (!stack[i].key.empty()) path += stack[i].key + ".";
            fail(origin, "field " + quoted(path + key) + " appears twice");
          }
          stack.back().key = key;
        }
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    fail(origin, describe_parse_error(e));
  }
}

}  // namespace

// ceil(cf * k * T / E). A product that lands within rounding error of an integer is taken
// as that integer, so that cf = 1.1 with k*T/E = 100 gives 110 slots, not 111.
std::int64_t ModelConfig::capacity(std::int64_t tokens) const {
  if (capacity_factor <= 0.0 || num_experts <= 0) return 0;
  const double x =
      capacity_factor * static_cast<double>(top_k) * static_cast<double>(tokens) / static_cast<double>(num_experts);
  const double r = std::round(x);
  if (std::abs(x - r) <= 1e-9 * std::max(1.0, r)) return static_cast<std::int64_t>(r);
  return static_cast<std::int64_t>(std::ceil(x));
}

ModelConfig parse_model(const json& j, const std::string& origin) { return parse_model_at(j, origin, "model."); }

WorkloadConfig parse_workload(const json& j, const std::string& origin) {
  if (!j.is_object()) fail(origin, "expected a JSON object at the top level, got " + show(j));
  Fields f(j, origin, "",
           {"name", "description", "model", "tokens_per_rank", "steps", "warmup", "seed", "expert_parallel"});
  WorkloadConfig w;
  w.origin = origin;
  w.name = f.string_or("name", stem_of(origin));
  w.description = f.string_or("description", "");
  w.model = parse_model_at(f.require("model"), origin, "model.");
  w.tokens_per_rank = f.integer("tokens_per_rank", 1, kInt64Max);
  w.steps = static_cast<int>(f.integer_or("steps", w.steps, 1, kIntMax));
  w.warmup = static_cast<int>(f.integer_or("warmup", w.warmup, 0, kIntMax));
  if (const json* s = f.find("seed")) {
    if (s->is_number_unsigned())
      w.seed = s->get<std::uint64_t>();
    else
      w.seed = static_cast<std::uint64_t>(f.integer("seed", *s, 0, kInt64Max));
  }
  w.expert_parallel = static_cast<int>(f.integer_or("expert_parallel", w.expert_parallel, 0, kIntMax));
  return w;
}

WorkloadConfig load_workload(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail(path, "is a folder, not a workload file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open workload file: ") + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(path, std::string("cannot read workload file: ") + std::strerror(errno));
  return parse_workload(parse_text(text.str(), path), path);
}

void validate_for_world(const WorkloadConfig& w, int world_size) {
  MOELAB_CHECK(world_size >= 1, "world size " + std::to_string(world_size));
  const int ep = w.expert_parallel > 0 ? w.expert_parallel : world_size;
  if (ep != world_size)
    fail(w.origin, "expert_parallel = " + std::to_string(w.expert_parallel) + " but " + std::to_string(world_size) +
                       (world_size == 1 ? " rank was" : " ranks were") +
                       " launched (expert parallelism spans every rank: launch " + std::to_string(ep) +
                       " ranks, or set expert_parallel to 0)");
  if (w.model.num_experts % ep != 0) {
    std::string msg = "model.num_experts = " + std::to_string(w.model.num_experts) +
                      " is not divisible by the expert-parallel degree " + std::to_string(ep);
    if (ep > w.model.num_experts)
      msg += " (more ranks than experts: every rank holds at least one expert, so launch at most " +
             std::to_string(w.model.num_experts) + " ranks)";
    else
      msg += " (every rank must hold the same number of experts)";
    fail(w.origin, msg);
  }
}

json to_json(const ModelConfig& m) {
  return {{"name", m.name},
          {"d_model", m.d_model},
          {"d_hidden", m.d_hidden},
          {"num_experts", m.num_experts},
          {"top_k", m.top_k},
          {"capacity_factor", m.capacity_factor},
          {"activation", activation_name(m.activation)},
          {"noisy_gate", m.noisy_gate},
          {"renormalize", m.renormalize},
          {"dtype", dtype_name(m.dtype)}};
}

json to_json(const WorkloadConfig& w) {
  return {{"name", w.name},
          {"description", w.description},
          {"model", to_json(w.model)},
          {"tokens_per_rank", w.tokens_per_rank},
          {"steps", w.steps},
          {"warmup", w.warmup},
          {"seed", w.seed},
          {"expert_parallel", w.expert_parallel}};
}

}  // namespace moelab
