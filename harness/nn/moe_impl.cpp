// harness/nn/moe_impl.cpp — the registry of MoE implementations.
#include "harness/nn/moe_impl.hpp"

#include <map>
#include <mutex>

#include "harness/runtime/error.hpp"

namespace moelab {
namespace {
struct Entry {
  ImplFactory make;
  ImplOptionsCheck check;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}

const Entry& entry(const std::string& name) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string known;
    for (const auto& n : impl_names()) known += (known.empty() ? "" : ", ") + n;
    throw ConfigError("--impl " + name + ": unknown implementation (known: " + known + ")");
  }
  return it->second;
}
}  // namespace

void register_impl(const std::string& name, ImplFactory f, ImplOptionsCheck check) {
  registry()[name] = {std::move(f), std::move(check)};
}

void check_impl_options(const std::string& name, const nlohmann::json& options, const ImplCheckContext& run) {
  const Entry& e = entry(name);
  if (e.check) e.check(options, run);
}

std::vector<std::string> impl_names() {
  std::vector<std::string> v;
  for (const auto& [n, f] : registry()) v.push_back(n);
  return v;
}

std::unique_ptr<MoEImpl> make_impl(const std::string& name, Backend& b, Communicator& c, const ModelConfig& m,
                                   const nlohmann::json& options, MoEChannels* channels) {
  return entry(name).make(b, c, m, options, channels);
}

}  // namespace moelab
