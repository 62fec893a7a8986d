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
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/runtime/error.hpp"

namespace moelab::json_fields {

using nlohmann::json;



// At most `max` bytes of s, not ending inside a UTF-8 sequence.
inline std::string cut_utf8(const std::string& s, std::size_t max) {
  if (s.size() <= max) return s;
  std::size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // s[n] continues a sequence
  return s.substr(0, n);
}

// A value as it appears in the file (strings keep their quotes), cut to about `max`
// characters so that a message stays one readable line. Written with an explicit stack and
// stopped once the excerpt is long enough: a value nested thousands of levels deep (or a
// 100 MB string) costs no more than a short one, and never recurses. Control characters are
// escaped, so the excerpt has no line breaks.
inline std::string show(const json& v, std::size_t max = 60) {
  std::string out;
  const auto scalar = [&](const json& x) {
    if (x.is_string()) {  // cut before escaping: the dump of a long string is never built
      const json cut = cut_utf8(x.get_ref<const std::string&>(), max + 1);
      out += cut.dump(-1, ' ', false, json::error_handler_t::replace);
    } else {
      out += x.dump(-1, ' ', false, json::error_handler_t::replace);  // numbers, literals: short
    }
  };
  struct Open {
    const json* container;
    json::const_iterator next;
  };
  std::vector<Open> open;  // at most max + 1 deep: each level writes a bracket
  const auto start = [&](const json& x) {
    if (x.is_object() || x.is_array()) {
      out += x.is_object() ? '{' : '[';
      open.push_back({&x, x.cbegin()});
    } else {
      scalar(x);
    }
  };
  start(v);
  while (!open.empty() && out.size() <= max) {
    Open& top = open.back();
    if (top.next == top.container->cend()) {
      out += top.container->is_object() ? '}' : ']';
      open.pop_back();
      continue;
    }
    if (top.next != top.container->cbegin()) out += ',';
    if (top.container->is_object())
      out += json(cut_utf8(top.next.key(), max + 1)).dump(-1, ' ', false, json::error_handler_t::replace) + ':';
    const json& child = *top.next;
    ++top.next;
    start(child);  // may grow `open`: `top` is not used after this
  }
  if (out.size() > max) out = cut_utf8(out, max > 3 ? max - 3 : 0) + "...";
  return out;
}

// Raw text (a command-line value, a library's message) as one short line: control
// characters written as \n, \t, \r or \u00XX, cut to about `max` bytes.
inline std::string one_line(const std::string& text, std::size_t max = 60) {
  std::string out;
  for (const char ch : cut_utf8(text, max + 1)) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(u));
      out += buf;
    } else {
      out += ch;
    }
  }
  if (out.size() > max || text.size() > max) out = cut_utf8(out, max > 3 ? max - 3 : 0) + "...";
  return out;
}

// "<origin>: <msg>". The origin is a path or a flag's value as the user gave it: one line,
// cut to a readable length (a path can hold line breaks, a flag a pasted file).
[[noreturn]] inline void fail(const std::string& origin, const std::string& msg) {
  throw ConfigError(one_line(origin, 240) + ": " + msg);
}

// nlohmann's message without its "[json.exception.out_of_range.406] " prefix: the reader
// wants what is wrong, not which exception class said so.
inline std::string library_message(const json::exception& e) {
  std::string what = e.what();
  if (what.rfind("[json.exception.", 0) == 0)
    if (const auto close = what.find("] "); close != std::string::npos) what = what.substr(close + 2);
  return one_line(what, 200);
}

// 0.5, 1000, 1e+06: a bound as a person would write it.
inline std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// A name in a message, in quotes. Names can come from the input (a field's key, a catalogue
// entry, a file's "name"): one line, cut, like every value a message quotes. Named so that
// argument-dependent lookup cannot pick std::quoted instead.
inline std::string quote(const std::string& s) { return "\"" + one_line(s, 120) + "\""; }

// "a, b, c": each item one short line, at most 32 of them (a catalogue may hold thousands).
inline std::string join(const std::vector<std::string>& items) {
  constexpr std::size_t kMaxItems = 32;
  std::string s;
  for (std::size_t i = 0; i < items.size() && i < kMaxItems; ++i) s += (s.empty() ? "" : ", ") + one_line(items[i], 60);
  if (items.size() > kMaxItems) s += ", ... (" + std::to_string(items.size() - kMaxItems) + " more)";
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
    // The distance is at least the difference in length: a long word (a file pasted into a
    // flag) is never compared letter by letter with every name.
    if ((word.size() > k.size() ? word.size() - k.size() : k.size() - word.size()) >= best_d) continue;
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
// Files have fields; an implementation's --impl-options have options, and their messages
// read the way the option was written: `unknown option "partitons" = 2 (did you mean
// "partitions"?)`, `partitions = "many": expected a positive integer`.
enum class Wording { field, option };

class Fields {
 public:
  Fields(const json& obj, std::string origin, std::string prefix, std::vector<std::string> known,
         Wording wording = Wording::field)
      : obj_(obj), origin_(std::move(origin)), prefix_(std::move(prefix)), known_(std::move(known)), wording_(wording) {
    const char* noun = wording_ == Wording::option ? "option" : "field";
    for (const auto& [key, value] : obj_.items()) {
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      std::string msg = std::string("unknown ") + noun + " " + quote(prefix_ + key);
      if (wording_ == Wording::option) msg += " = " + show(value, 40);
      if (const std::string best = closest(key, known_); !best.empty())
        msg += " (did you mean " + quote(prefix_ + best) + "?)";
      else
        msg += std::string(" (known ") + noun + "s: " + join(known_) + ")";
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
    if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
      std::string msg = path(key) + " = " + show(*v) + " is not one of " + join(choices);
      if (const std::string best = closest(s, choices); !best.empty()) msg += " (did you mean " + quote(best) + "?)";
      fail(origin_, msg);
    }
    return s;
  }

  [[noreturn]] void wrong_type(const char* key, const json& v, const char* expected) const {
    if (wording_ == Wording::option) fail(origin_, path(key) + " = " + show(v) + ": expected " + expected);
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
  Wording wording_ = Wording::field;
};

// A parse error's position as nlohmann reports it ("parse error at line 3, column 5: ..."),
// without the library's "[json.exception.parse_error.101]" prefix, on one short line (the
// library quotes the last token read, which can be a whole 100 KB string).
inline std::string describe_parse_error(const json::parse_error& e) {
  std::string what = e.what();
  const auto at = what.find("at line ");
  if (at != std::string::npos) return "malformed JSON " + one_line(what.substr(at), 200);
  const auto colon = what.find("parse error");
  return "malformed JSON: " + one_line(colon != std::string::npos ? what.substr(colon) : what, 200);
}

// How deep arrays and objects may nest in an input file. moelab's files nest four levels at
// most; the bound keeps every later walk over a parsed value (copies, comparisons, dumps,
// which recurse) far from the stack's limit, whatever a file holds.
constexpr std::size_t kMaxNesting = 64;

// Parses text (comments allowed), rejecting repeated keys with their path and nesting deeper
// than kMaxNesting. Every error of the JSON library (syntax, a number beyond a double's range
// such as 1e999, ...) becomes a one-line ConfigError naming `origin` and, where the parser
// was inside a field, the field's path.
inline json parse_text(const std::string& text, const std::string& origin) {
  struct Level {
    std::set<std::string> keys;
    std::string key;  // the field being read (objects)
  };
  std::vector<Level> stack;
  // "model.capacity_factor": the fields the parser is inside (array levels add nothing).
  const auto where = [&](std::size_t levels) {
    std::string path;
    for (std::size_t i = 0; i < levels && i < stack.size(); ++i)
      if (!stack[i].key.empty()) path += (path.empty() ? "" : ".") + stack[i].key;
    return path;
  };
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (stack.size() >= kMaxNesting) {
          const std::string path = where(stack.size());
          fail(origin, (path.empty() ? std::string("the document") : quote(path)) +
                           " nests arrays and objects more than " + std::to_string(kMaxNesting) +
                           " levels deep (moelab's files need a few)");
        }
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
            const std::string path = where(stack.size() - 1);
            fail(origin, "field " + quote((path.empty() ? "" : path + ".") + key) + " appears twice");
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
  } catch (const json::exception& e) {  // out_of_range.406: a number too large for a double
    const std::string path = where(stack.size());
    fail(origin, (path.empty() ? "" : one_line(path, 120) + ": ") + library_message(e));
  }
}

// Runs `read` (which parses and checks one input file) and turns any error of the JSON
// library that escapes the field readers into a ConfigError naming the file: bad input must
// never surface as the library's bare exception (exit 1, no file named).
template <class Read>
auto reading(const std::string& origin, Read&& read) -> decltype(read()) {
  try {
    return read();
  } catch (const json::exception& e) {
    fail(origin, library_message(e));
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

// ---- options given on the command line ------------------------------------------------------

// The JSON object of a command-line flag such as --impl-options '{"partitions": 4}'. Messages
// start with the flag and a short, escaped excerpt of the value (a value can be a whole file
// pasted by mistake); repeated keys, malformed JSON and anything but an object are errors.
inline json parse_options(const std::string& text, const std::string& flag) {
  const std::string origin = flag + " '" + one_line(text, 40) + "'";
  json j = parse_text(text, origin);
  if (!j.is_object()) fail(origin, "expected a JSON object such as {\"name\": value}, got " + show(j, 40));
  return j;
}

// Typed reading of an options object (an implementation's --impl-options): unknown names are
// errors with the closest known name suggested, and every value is checked with a one-line
// message naming the option and its value, exactly as fields of a file are.
//
//   json_fields::Options o(impl_options, "--impl-options", {"partitions", "strategy"});
//   const int n = static_cast<int>(o.positive_int("partitions", 4, 1024));
//   const std::string s = o.choice("strategy", "auto", {"auto", "s1", "s2"});
class Options {
 public:
  // `origin` names the reader in messages ("mpipemoe", "--impl-options"); null options are {}.
  Options(json obj, std::string origin, std::vector<std::string> known)
      : obj_(checked_object(std::move(obj), origin, known)),
        fields_(obj_, std::move(origin), "", std::move(known), Wording::option) {}
  Options(const Options&) = delete;  // fields_ refers to obj_
  Options& operator=(const Options&) = delete;

  bool has(const char* key) const { return fields_.find(key) != nullptr; }
  // An integer in [1, hi].
  std::int64_t positive_int(const char* key, std::int64_t fallback, std::int64_t hi) const {
    return fields_.integer_or(key, fallback, 1, hi);
  }
  // An integer in [lo, hi], 0 <= lo <= hi.
  std::int64_t integer(const char* key, std::int64_t fallback, std::int64_t lo, std::int64_t hi) const {
    const json* v = fields_.find(key);
    if (!v) return fallback;
    const std::int64_t n = fields_.integer(key, *v, std::clamp<std::int64_t>(lo, 0, 1), hi);
    if (n < lo) fields_.bad_value(key, "must be >= " + std::to_string(lo));
    return n;
  }
  bool boolean(const char* key, bool fallback) const { return fields_.boolean_or(key, fallback); }
  std::string string(const char* key, const std::string& fallback) const { return fields_.string_or(key, fallback); }
  // One of `choices` (the message lists them and suggests the closest).
  std::string choice(const char* key, const std::string& fallback, const std::vector<std::string>& choices) const {
    return fields_.choice_or(key, fallback, choices);
  }
  // A finite number in [lo, hi].
  double number(const char* key, double fallback, double lo, double hi) const {
    const double x = fields_.number_or(key, fallback);
    if (fields_.find(key) && !(x >= lo && x <= hi))
      fields_.bad_value(key, "must be in [" + number_text(lo) + ", " + number_text(hi) + "]");
    return x;
  }
  // A number in (0, hi] when given; nullopt when absent.
  std::optional<double> positive_number(const char* key, double hi) const {
    if (!has(key)) return std::nullopt;
    const double x = fields_.number_or(key, 0);
    if (!(x > 0)) fields_.bad_value(key, "must be > 0");
    if (!(x <= hi)) fields_.bad_value(key, "must be at most " + number_text(hi));
    return x;
  }
  // "<key> = <value as written> <what>": for the checks that relate several options.
  [[noreturn]] void bad_value(const char* key, const std::string& what) const { fields_.bad_value(key, what); }
  const json& value() const { return obj_; }

 private:
  static json checked_object(json j, const std::string& origin, const std::vector<std::string>& known) {
    if (j.is_null()) return json::object();
    if (!j.is_object())
      fail(origin, "expected a JSON object such as {" + quote(known.empty() ? std::string("name") : known.front()) +
                       ": value}, got " + show(j, 40));
    return j;
  }
  json obj_;
  Fields fields_;
};

}  // namespace moelab::json_fields
