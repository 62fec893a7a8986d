// harness/fuzz/fuzz_catalogue.cpp — libFuzzer target: the input is the hardware catalogue,
// once as gpus.json and once as nodes.json (each beside the shipped other one, in a copy of
// experiments/hardware/ found through MOELAB_EXPERIMENTS), read as every cluster file that
// names a node or a GPU reads it: through two shipped clusters (an NVSwitch pair of nodes,
// a PCIe node). See fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "harness/fuzz/fuzz_common.hpp"
#include "harness/sim/cluster.hpp"

namespace {

namespace fs = std::filesystem;

// The scratch copy of experiments/: the shipped catalogue (kept in memory, written back
// before each load) and the two clusters.
struct Catalogue {
  fs::path dir;
  std::string gpus, nodes;
  Catalogue() {
    const fs::path shipped = fs::path(moelab::sim::experiments_dir()) / "hardware";
    const auto read = [](const fs::path& p) {
      std::ifstream in(p, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    };
    gpus = read(shipped / "gpus.json");
    nodes = read(shipped / "nodes.json");
    dir = moelab::fuzz::scratch_dir() / "experiments";
    for (const char* c : {"dgx-a100x2.json", "pcie-a30x1.json"})
      moelab::fuzz::write_file(dir / "hardware" / "clusters" / c, read(shipped / "clusters" / c));
    ::setenv("MOELAB_EXPERIMENTS", dir.c_str(), 1);
  }
  // The input as one catalogue file beside the shipped other, through the clusters that use it.
  void load_with(bool as_gpus, const std::string& bytes) {
    moelab::fuzz::write_file(dir / "hardware" / "gpus.json", as_gpus ? bytes : gpus);
    moelab::fuzz::write_file(dir / "hardware" / "nodes.json", as_gpus ? nodes : bytes);
    for (const char* c : {"dgx-a100x2", "pcie-a30x1"}) {
      moelab::fuzz::expect_input_errors([&] { (void)moelab::sim::to_json(moelab::sim::load_cluster(c)).dump(); });
      if (as_gpus) break;  // both name their GPU through nodes.json: one reads gpus.json as well as two
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Catalogue cat;
  const std::string bytes = moelab::fuzz::as_text(data, size);
  cat.load_with(true, bytes);
  cat.load_with(false, bytes);
  return 0;
}
