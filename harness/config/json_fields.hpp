// harness/config/json_fields.hpp — reading moelab's JSON input files with one-line errors.
//
// Shared by every reader of user-written JSON (workload files, the hardware catalogue,
// cluster files, calibration profiles) so that they all fail the same way: ConfigError with
// "<file>: <field path> ... <value>", because the person reading the message is looking at
// that file. Unknown fields are errors, not warnings: a misspelt optional field would
// otherwise silently fall back to its default and change the experiment. Repeated keys are
// errors too (legal JSON, but almost always an edit that forgot to remove the old line).
#pragma once
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/runtime/error.hpp"

namespace moelab::json_fields {

using nlohmann::json;

[[noreturn]] inline void fail(const std::string& origin, const std::string& msg) {
  throw ConfigError(origin + ": " + msg);
}

// A value as it appears in the file (strings keep their quotes); long ones are cut so that
// the message stays one readable line.
inline std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Named so that argument-dependent lookup cannot pick std::quoted instead.
inline std::string quote(const std::string& s) { return "\"" + s + "\""; }

// "a, b, c"
inline std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& i : items) s += (s.empty() ? "" : ", ") + i;
  return s;
}

inline std::size_t edit_distance(const std::string& a, const std::string& b) {
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

// The closest of `known` to `word` when it is a plausible misspelling (fewer than 3 edits),
// else "". Returned by value: callers often pass a temporary list.
inline std::string closest(const std::string& word, const std::vector<std::string>& known) {
  const std::string* best = nullptr;
  std::size_t best_d = 3;
  for (const auto& k : known) {
    const std::size_t d = edit_distance(word, k);
    if (d < best_d) {
      best_d = d;
      best = &k;
    }
  }
  return best ? *best : std::string();
}

// Reads the fields of one JSON object. `prefix` is the object's path ("model.") so that
// messages name fields the way the file nests them.
class Fields {
 public:
  Fields(const json& obj, std::string origin, std::string prefix, std::vector<std::string> known)
      : obj_(obj), origin_(std::move(origin)), prefix_(std::move(prefix)), known_(std::move(known)) {
    for (const auto& [key, value] : obj_.items()) {
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      std::string msg = "unknown field " + quote(prefix_ + key);
      if (const std::string best = closest(key, known_); !best.empty())
        msg += " (did you mean " + quote(prefix_ + best) + "?)";
      else
        msg += " (known fields: " + join(known_) + ")";
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
    if (!v) fail(origin_, "missing field " + quote(path(key)));
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

  double number(const char* key) const {
    const json& v = require(key);
    if (!v.is_number()) wrong_type(key, v, "a number");
    return v.get<double>();
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
  std::string string(const char* key) const {
    const json& v = require(key);
    if (!v.is_string()) wrong_type(key, v, "a string");
    return v.get<std::string>();
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
    if (std::find(choices.begin(), choices.end(), s) == choices.end())
      fail(origin_, path(key) + " = " + show(*v) + " is not one of " + join(choices));
    return s;
  }

  [[noreturn]] void wrong_type(const char* key, const json& v, const char* expected) const {
    fail(origin_, path(key) + ": expected " + expected + ", got " + show(v));
  }
  [[noreturn]] void too_large(const char* key, const json& v, std::int64_t hi) const {
    fail(origin_, path(key) + " = " + show(v) + " is too large (at most " + std::to_string(hi) + ")");
  }
  // "<path> = <value as written> <what>", e.g. "nodes.x.nic_bw = -25e9 must be > 0".
  [[noreturn]] void bad_value(const char* key, const std::string& what) const {
    const json* v = find(key);
    fail(origin_, path(key) + " = " + (v ? show(*v) : std::string("(absent)")) + " " + what);
  }

 private:
  const json& obj_;
  std::string origin_, prefix_;
  std::vector<std::string> known_;
};

// A parse error's position as nlohmann reports it ("parse error at line 3, column 5: ..."),
// without the library's "[json.exception.parse_error.101]" prefix.
inline std::string describe_parse_error(const json::parse_error& e) {
  std::string what = e.what();
  const auto at = what.find("at line ");
  if (at != std::string::npos) return "malformed JSON " + what.substr(at);
  const auto colon = what.find("parse error");
  return "malformed JSON: " + (colon != std::string::npos ? what.substr(colon) : what);
}

// Parses text (comments allowed), rejecting repeated keys with their path.
inline json parse_text(const std::string& text, const std::string& origin) {
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
            fail(origin, "field " + quote(path + key) + " appears twice");
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

// Reads and parses a JSON file; `what` names the kind of file in messages ("workload file").
inline json read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail(path, "is a folder, not a " + what);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open " + what + ": " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(path, "cannot read " + what + ": " + std::strerror(errno));
  return parse_text(text.str(), path);
}

}  // namespace moelab::json_fields
