// harness/nn/moe_impl.cpp — the registry of MoE implementations.
#include "harness/nn/moe_impl.hpp"

#include <map>
#include <mutex>

#include "harness/runtime/error.hpp"

namespace moelab {
namespace {
std::map<std::string, ImplFactory>& registry() {
  static std::map<std::string, ImplFactory> r;
  return r;
}
}  // namespace

void register_impl(const std::string& name, ImplFactory f) { registry()[name] = std::move(f); }

std::vector<std::string> impl_names() {
  std::vector<std::string> v;
  for (const auto& [n, f] : registry()) v.push_back(n);
  return v;
}

std::unique_ptr<MoEImpl> make_impl(const std::string& name, Backend& b, Communicator& c, const ModelConfig& m,
                                   const nlohmann::json& options, MoEChannels* channels) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string known;
    for (const auto& n : impl_names()) known += (known.empty() ? "" : ", ") + n;
    throw ConfigError("--impl " + name + ": unknown implementation (known: " + known + ")");
  }
  return it->second(b, c, m, options, channels);
}

}  // namespace moelab
