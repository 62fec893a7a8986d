// harness/tests/sim_cluster_test.cpp — the sim backend's cluster models: the catalogue
// loads, routes use the right links with the right latencies, GEMM times follow the
// datasheet curve or the calibration profile, and every bad file is rejected with one
// message naming the file, the field and the value.
//
//   ctest --test-dir build -R sim_cluster
//   build/harness/tests/sim_cluster_test --gtest_filter='ClusterErrors*'
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/sim/engine.hpp"

namespace moelab::sim {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The catalogue as committed; every test starts from it with MOELAB_EXPERIMENTS unset, so
// that a value in the caller's environment cannot change what is tested.
class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* e = std::getenv("MOELAB_EXPERIMENTS")) saved_ = e;
    ::unsetenv("MOELAB_EXPERIMENTS");
  }
  void TearDown() override {
    if (saved_)
      ::setenv("MOELAB_EXPERIMENTS", saved_->c_str(), 1);
    else
      ::unsetenv("MOELAB_EXPERIMENTS");
    if (!tmp_.empty()) {
      std::error_code ec;
      fs::remove_all(tmp_, ec);
    }
  }

  // A fresh folder for this test, removed afterwards.
  fs::path tmp() {
    if (tmp_.empty()) {
      const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
      std::string name = std::string(info->test_suite_name()) + "_" + info->name();
      for (auto& ch : name)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      tmp_ = fs::temp_directory_path() / ("moelab_sim_cluster_test_" + std::to_string(::getpid()) + "_" + name);
      fs::remove_all(tmp_);
      fs::create_directories(tmp_);
    }
    return tmp_;
  }
  std::string write(const std::string& rel, const std::string& text) {
    const fs::path p = tmp() / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }
  std::string write(const std::string& rel, const json& j) { return write(rel, j.dump(2)); }

  // A copy of the committed gpus.json and nodes.json under tmp()/hardware, changed by
  // `edit_gpus` / `edit_nodes`, and MOELAB_EXPERIMENTS pointing at it.
  void use_catalogue_copy(const std::function<void(json&)>& edit_gpus = {},
                          const std::function<void(json&)>& edit_nodes = {}) {
    const fs::path real = fs::path(experiments_dir()) / "hardware";
    json gpus = json::parse(std::ifstream(real / "gpus.json"));
    json nodes = json::parse(std::ifstream(real / "nodes.json"));
    if (edit_gpus) edit_gpus(gpus);
    if (edit_nodes) edit_nodes(nodes);
    write("hardware/gpus.json", gpus);
    write("hardware/nodes.json", nodes);
    fs::create_directories(tmp() / "hardware" / "clusters");
    ::setenv("MOELAB_EXPERIMENTS", tmp().c_str(), 1);
  }
  // A cluster file in the copied catalogue.
  std::string write_cluster(const std::string& name, const json& j) { return write("hardware/clusters/" + name + ".json", j); }

  static json minimal_cluster(const std::string& node, int nodes) {
    return {{"node", node}, {"nodes", nodes}, {"source", "test"}};
  }

 private:
  std::optional<std::string> saved_;
  fs::path tmp_;
};

// The ConfigError message of f, or a marker that none was thrown.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a ConfigError: ") + e.what() + ">";
  }
  return "<no error>";
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nexpected: " << (part)

std::vector<std::string> names_of(const Engine& e, const Route& r) {
  std::vector<std::string> out;
  for (int id : r.resources) out.push_back(e.resource_name(id));
  return out;
}

// ---- the catalogue -------------------------------------------------------------------------

TEST_F(ClusterTest, EveryCatalogueClusterLoadsWithItsWorldSize) {
  const std::vector<std::pair<std::string, int>> expected = {
      {"a800x1", 8},   {"a800x2", 16},      {"dgx-a100x1", 8}, {"dgx-a100x2", 16}, {"dgx-a100x4", 32},
      {"dgx-a100x8", 64}, {"h100x1", 8},    {"h200x1", 8},     {"pcie-a30x1", 8}};
  const auto names = cluster_names();
  for (const auto& [name, world] : expected) {
    SCOPED_TRACE(name);
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end());
    const ClusterModel m = load_cluster(name);
    EXPECT_EQ(m.name, name);
    EXPECT_EQ(m.world_size(), world);
    EXPECT_FALSE(m.description.empty());
    EXPECT_FALSE(m.source.empty());
    EXPECT_FALSE(m.gpu.source.empty());
    EXPECT_FALSE(m.node.source.empty());
    EXPECT_FALSE(m.efficiency.source.empty());
    EXPECT_FALSE(m.interference.source.empty());
    for (double f : {m.interference.sigma, m.interference.mu, m.interference.eta}) {
      EXPECT_GT(f, 0.5);  // MPipeMoE: below 0.5 overlapping never pays; the defaults are far above
      EXPECT_LE(f, 1.0);
    }
    // The topology builds on every cluster and registers what the route tables promise.
    Engine e;
    Topology t(m, e);
    // sm, hbm, link out/in (+ h2d, d2h; + the PCIe link up/down of an NVSwitch node that models
    // its PCIe switches)
    const int per_gpu = m.node.intra == "nvswitch" ? (m.node.pcie_switches() ? 8 : 6) : 4;
    const int switches = m.node.pcie_switches() ? m.nodes * m.node.gpus / m.node.gpus_per_pcie_switch : 0;
    const int nics = m.nodes > 1 ? m.nodes * m.node.nics : 0;
    EXPECT_EQ(e.num_resources(), static_cast<std::size_t>(world * per_gpu + 2 * switches + 2 * nics));
  }
  // A name is also accepted as the path of its file.
  EXPECT_EQ(load_cluster(experiments_dir() + "/hardware/clusters/dgx-a100x8.json").world_size(), 64);
}

TEST_F(ClusterTest, CatalogueFiguresAreTheDatasheetOnes) {
  const ClusterModel a100 = load_cluster("dgx-a100x8");
  EXPECT_EQ(a100.gpu.name, "A100-SXM4-40GB");
  EXPECT_DOUBLE_EQ(a100.gpu.flops_bf16, 312e12);
  EXPECT_DOUBLE_EQ(a100.gpu.flops_fp32, 19.5e12);
  EXPECT_DOUBLE_EQ(a100.gpu.hbm_bw, 1555e9);
  EXPECT_EQ(a100.node.intra, "nvswitch");
  EXPECT_DOUBLE_EQ(a100.node.nvlink_bw, 300e9);
  EXPECT_EQ(a100.node.nics, 8);
  EXPECT_DOUBLE_EQ(a100.node.nic_bw, 25e9);
  EXPECT_EQ(a100.nodes, 8);
  EXPECT_EQ(a100.fabric, "infiniband");
  EXPECT_DOUBLE_EQ(a100.peak_flops(DType::bf16), 312e12);
  EXPECT_DOUBLE_EQ(a100.peak_flops(DType::f32), 19.5e12);
  EXPECT_THROW((void)a100.peak_flops(DType::f64), Unsupported);

  EXPECT_DOUBLE_EQ(load_cluster("a800x2").node.nvlink_bw, 200e9);
  const ClusterModel a30 = load_cluster("pcie-a30x1");
  EXPECT_EQ(a30.node.intra, "pcie");
  EXPECT_EQ(a30.node.gpus_per_pcie_switch, 2);
  EXPECT_DOUBLE_EQ(a30.gpu.flops_bf16, 165e12);
  const ClusterModel h100 = load_cluster("h100x1");
  EXPECT_DOUBLE_EQ(h100.node.nvlink_bw, 450e9);
  EXPECT_DOUBLE_EQ(h100.node.nic_bw, 50e9);
  EXPECT_DOUBLE_EQ(load_cluster("h200x1").gpu.hbm_bw, 4800e9);
}

// to_json writes a self-contained cluster file (node and GPU inline) that loads back to the
// same model: a result file's cluster can be re-run without the catalogue.
TEST_F(ClusterTest, ToJsonRoundTrips) {
  for (const auto& name : cluster_names()) {
    SCOPED_TRACE(name);
    const json j = to_json(load_cluster(name));
    const std::string path = write(name + ".json", j);
    EXPECT_EQ(to_json(load_cluster(path)), j);
  }
  // A catalogue GEMM calibration is recorded by name, never by this machine's path.
  EXPECT_EQ(to_json(load_cluster("dgx-a100x8"))["efficiency"]["calibration"], "a100-sxm4");
}

// ---- routes --------------------------------------------------------------------------------

TEST_F(ClusterTest, NvswitchRoutes) {
  const ClusterModel m = load_cluster("dgx-a100x2");
  Engine e;
  Topology t(m, e);
  EXPECT_EQ(e.resource_name(t.sm(9)), "rank9.sm");
  EXPECT_DOUBLE_EQ(e.resource_capacity(t.sm(9)), 1.0);
  EXPECT_EQ(e.resource_name(t.hbm(9)), "rank9.hbm");
  EXPECT_DOUBLE_EQ(e.resource_capacity(t.hbm(9)), m.gpu.hbm_bw);

  const Route in_node = t.p2p(0, 5);
  EXPECT_EQ(names_of(e, in_node), (std::vector<std::string>{"rank0.nvlink_out", "rank5.nvlink_in"}));
  EXPECT_DOUBLE_EQ(in_node.latency, m.node.nvlink_latency);
  for (int id : in_node.resources) EXPECT_DOUBLE_EQ(e.resource_capacity(id), 300e9);

  // Rank 3 is GPU 3 of node 0, rank 12 is GPU 4 of node 1: each uses its own rail's NIC, by
  // GPUDirect RDMA over its PCIe link to the switch it shares with that NIC.
  const Route across = t.p2p(3, 12);
  EXPECT_EQ(names_of(e, across),
            (std::vector<std::string>{"rank3.pcie_up", "node0.nic3.out", "node1.nic4.in", "rank12.pcie_down"}));
  EXPECT_EQ(across.resource_links,
            (std::vector<LinkClass>{LinkClass::pcie, LinkClass::nic, LinkClass::nic, LinkClass::pcie}));
  EXPECT_TRUE(across.inter_node);
  EXPECT_DOUBLE_EQ(across.latency, m.node.nic_latency + m.fabric_latency);
  EXPECT_GT(m.fabric_latency, 0.0);
  EXPECT_DOUBLE_EQ(e.resource_capacity(across.resources[0]), 24e9);
  EXPECT_DOUBLE_EQ(e.resource_capacity(across.resources[1]), 25e9);
  EXPECT_DOUBLE_EQ(e.resource_capacity(across.resources[2]), 25e9);
  EXPECT_DOUBLE_EQ(e.resource_capacity(across.resources[3]), 24e9);

  // Host copies: the GPU's own copy rate, its PCIe link, and the uplink of switch 1 (GPUs 2, 3).
  const Route h2d = t.host_to_device(3), d2h = t.device_to_host(3);
  EXPECT_EQ(names_of(e, h2d), (std::vector<std::string>{"rank3.h2d", "node0.switch1.down", "rank3.pcie_down"}));
  EXPECT_EQ(names_of(e, d2h), (std::vector<std::string>{"rank3.d2h", "rank3.pcie_up", "node0.switch1.up"}));
  EXPECT_EQ(names_of(e, t.device_to_host(10)), (std::vector<std::string>{"rank10.d2h", "rank10.pcie_up", "node1.switch1.up"}));
  EXPECT_DOUBLE_EQ(h2d.latency, m.node.pcie_latency);
  EXPECT_DOUBLE_EQ(e.resource_capacity(h2d.resources[0]), m.node.host_copy_bw);

  EXPECT_THROW((void)t.p2p(4, 4), std::invalid_argument);
  EXPECT_THROW((void)t.p2p(0, 16), std::invalid_argument);
  EXPECT_THROW((void)t.sm(-1), std::invalid_argument);
  EXPECT_THROW((void)t.host_to_device(16), std::invalid_argument);
}

TEST_F(ClusterTest, PcieRoutesWithinANode) {
  const ClusterModel m = load_cluster("pcie-a30x1");
  Engine e;
  Topology t(m, e);
  const Route same = t.p2p(0, 1);  // both behind switch 0
  EXPECT_EQ(names_of(e, same), (std::vector<std::string>{"rank0.pcie_up", "rank1.pcie_down"}));
  EXPECT_DOUBLE_EQ(same.latency, m.node.pcie_latency);
  const Route cross = t.p2p(1, 2);  // switch 0 -> switch 1, through both uplinks
  EXPECT_EQ(names_of(e, cross), (std::vector<std::string>{"rank1.pcie_up", "node0.switch0.up", "node0.switch1.down",
                                                          "rank2.pcie_down"}));
  EXPECT_DOUBLE_EQ(cross.latency, m.node.pcie_latency);
  EXPECT_DOUBLE_EQ(e.resource_capacity(cross.resources[0]), m.node.pcie_bw);
  EXPECT_DOUBLE_EQ(e.resource_capacity(cross.resources[1]), m.node.pcie_switch_uplink_bw);
  // Host copies share the GPU's link with its peer traffic and the uplink with its neighbour.
  EXPECT_EQ(names_of(e, t.host_to_device(7)), (std::vector<std::string>{"node0.switch3.down", "rank7.pcie_down"}));
  EXPECT_EQ(names_of(e, t.device_to_host(6)), (std::vector<std::string>{"rank6.pcie_up", "node0.switch3.up"}));
  EXPECT_DOUBLE_EQ(t.host_to_device(7).latency, m.node.pcie_latency);
}

TEST_F(ClusterTest, PcieRoutesAcrossNodes) {
  // The catalogue's PCIe server has no NICs; a cluster file may define its node inline.
  const ClusterModel base = load_cluster("pcie-a30x1");
  json node = to_json(base)["node"];
  node["name"] = "pcie-a30-2nic";
  node["nics"] = 2;
  node["nic_bw"] = 12.5e9;
  node["nic_latency"] = 6e-6;
  const json cluster = {{"node", node}, {"nodes", 2}, {"fabric", "ethernet"}, {"fabric_latency", 1e-6}, {"source", "test"}};
  const ClusterModel m = load_cluster(write("pcie2.json", cluster));
  EXPECT_EQ(m.name, "pcie2");
  EXPECT_EQ(m.world_size(), 16);
  Engine e;
  Topology t(m, e);
  const Route r = t.p2p(1, 11);  // GPU 1 of node 0 -> GPU 3 of node 1
  EXPECT_EQ(names_of(e, r),
            (std::vector<std::string>{"rank1.pcie_up", "node0.nic1.out", "node1.nic1.in", "rank11.pcie_down"}));
  EXPECT_DOUBLE_EQ(r.latency, 7e-6);
  EXPECT_DOUBLE_EQ(e.resource_capacity(r.resources[1]), 12.5e9);
  // Node 1's switches are numbered after node 0's.
  EXPECT_EQ(names_of(e, t.p2p(9, 10)), (std::vector<std::string>{"rank9.pcie_up", "node1.switch0.up",
                                                                  "node1.switch1.down", "rank10.pcie_down"}));
  EXPECT_EQ(names_of(e, t.host_to_device(10)), (std::vector<std::string>{"node1.switch1.down", "rank10.pcie_down"}));
}

// ---- time model ------------------------------------------------------------------------------

TEST_F(ClusterTest, GemmSecondsFromTheDatasheetCurve) {
  // pcie-a30x1 references no calibration: the datasheet curve (A30: 165 / 82 / 10.3 TFLOP/s).
  const ClusterModel m = load_cluster("pcie-a30x1");
  ASSERT_FALSE(m.efficiency.calibration);
  Engine e;
  Topology t(m, e);
  EXPECT_FALSE(t.calibrated());
  // d = min(m, n, k) = 1024: efficiency 0.8 * 1024 / (1024 + 128).
  const double eff = 0.8 * 1024.0 / 1152.0;
  EXPECT_DOUBLE_EQ(t.gemm_seconds(4096, 1024, 2048, DType::bf16), 2.0 * 4096 * 1024 * 2048 / (165e12 * eff));
  EXPECT_DOUBLE_EQ(t.gemm_seconds(4096, 2048, 1024, DType::f32), 2.0 * 4096 * 1024 * 2048 / (10.3e12 * eff));
  // fp32 on TF32 tensor cores (allow_tf32): the TF32 peak; bf16 is unaffected by the flag.
  EXPECT_DOUBLE_EQ(t.gemm_seconds(4096, 2048, 1024, DType::f32, true), 2.0 * 4096 * 1024 * 2048 / (82e12 * eff));
  EXPECT_DOUBLE_EQ(t.gemm_seconds(4096, 1024, 2048, DType::bf16, true), t.gemm_seconds(4096, 1024, 2048, DType::bf16));
  EXPECT_EQ(t.gemm_seconds(0, 1024, 1024, DType::bf16), 0.0);
  EXPECT_EQ(t.gemm_seconds(1024, 1024, 0, DType::bf16), 0.0);
  EXPECT_THROW((void)t.gemm_seconds(-1, 1, 1, DType::bf16), std::invalid_argument);
  EXPECT_THROW((void)t.gemm_seconds(8, 8, 8, DType::f64), Unsupported);
  EXPECT_DOUBLE_EQ(t.mem_bw_effective(), 933e9 * 0.8);
  EXPECT_DOUBLE_EQ(t.launch_latency(), 5e-6);
}

// The calibrated curve: t = max(2mnk / (peak * eff), elem * (mk + kn + mn) / mem_bw), eff =
// gemm_max * d / (d + gemm_half_dim), d = min(m, n, k), with the figures of the cluster's
// calibration file (experiments/hardware/calibration/), read here from the file itself; mem_bw
// scaled to the cluster's GPU by the datasheet HBM rates (the A800's and the H200's faster HBM).
TEST_F(ClusterTest, GemmSecondsFromTheCalibratedCurve) {
  const auto file = [](const std::string& name) {
    return json::parse(std::ifstream(fs::path(experiments_dir()) / "hardware" / "calibration" / (name + ".json")));
  };
  struct Case {
    const char* cluster;
    const char* calibration;
    double bf16, tf32, fp32;
    double hbm;  // the cluster GPU's datasheet HBM rate
  };
  for (const Case& c : {Case{"dgx-a100x1", "a100-sxm4", 312e12, 156e12, 19.5e12, 1555e9},
                        Case{"a800x1", "a100-sxm4", 312e12, 156e12, 19.5e12, 2039e9},
                        Case{"h100x1", "h100-sxm5", 989e12, 495e12, 67e12, 3350e9},
                        Case{"h200x1", "h100-sxm5", 989e12, 495e12, 67e12, 4800e9}}) {
    SCOPED_TRACE(c.cluster);
    const json f = file(c.calibration);
    const ClusterModel m = load_cluster(c.cluster);
    ASSERT_TRUE(m.efficiency.calibration);
    EXPECT_EQ(m.efficiency.calibration->name, c.calibration);
    Engine e;
    Topology t(m, e);
    EXPECT_FALSE(t.calibrated());  // no profile
    const double mem_bw = f["mem_bw"].get<double>() * c.hbm / f["hbm_bw"].get<double>();
    EXPECT_DOUBLE_EQ(t.gemm_mem_bw(), mem_bw);
    const auto expect = [&](std::int64_t mm, std::int64_t nn, std::int64_t kk, const char* curve, double peak,
                            double elem) {
      const json& cv = f["curves"][curve];
      const double d = static_cast<double>(std::min({mm, nn, kk}));
      const double eff = cv["gemm_max"].get<double>() * d / (d + cv["gemm_half_dim"].get<double>());
      const double x = static_cast<double>(mm), y = static_cast<double>(nn), z = static_cast<double>(kk);
      return std::max(2.0 * x * y * z / (peak * eff), elem * (x * z + z * y + x * y) / mem_bw);
    };
    // MPipeMoE's expert shapes: rows x d_model x d_hidden, from 64 rows (memory-bound on the
    // weights) to 8192.
    for (std::int64_t rows : {64, 512, 8192}) {
      EXPECT_DOUBLE_EQ(t.gemm_seconds(rows, 3072, 768, DType::bf16), expect(rows, 3072, 768, "bf16", c.bf16, 2));
      EXPECT_DOUBLE_EQ(t.gemm_seconds(rows, 8192, 2048, DType::f32, true), expect(rows, 8192, 2048, "tf32", c.tf32, 4));
      EXPECT_DOUBLE_EQ(t.gemm_seconds(2048, 8192, rows, DType::f32), expect(2048, 8192, rows, "fp32", c.fp32, 4));
    }
    // 64 x 8192 x 2048 in bf16 is bound by moving the 2048 x 8192 weight.
    EXPECT_DOUBLE_EQ(t.gemm_seconds(64, 8192, 2048, DType::bf16), 2.0 * (64.0 * 2048 + 2048.0 * 8192 + 64.0 * 8192) / mem_bw);
    EXPECT_THROW((void)t.gemm_seconds(8, 8, 8, DType::f64), Unsupported);
    // The launch cost is the calibration's, once per launch (not inside gemm_seconds).
    EXPECT_EQ(t.launch_latency(), f["launch_latency"].get<double>());
    EXPECT_EQ(m.efficiency.launch_latency, f["launch_latency"].get<double>());
  }
  // A measured profile still comes first for the launch latency.
  const ClusterModel h = load_cluster("h100x1");
  Profile p;
  p.name = "p";
  p.launch_latency = 3e-6;
  Engine eh;
  Topology th(h, eh, &p);
  EXPECT_EQ(th.launch_latency(), 3e-6);
}

// The fit's residuals and the launch cost add: a task of n launches starts n * launch_latency
// after it is ready (the sim backend's rule), so the launch cost adds exactly.
TEST_F(ClusterTest, CalibratedLaunchCostAddsExactly) {
  const ClusterModel m = load_cluster("h100x1");
  Engine e;
  Topology t(m, e);
  const double gemm = t.gemm_seconds(512, 3072, 768, DType::bf16);
  Task a;
  a.name = "gemm";
  a.gpu = 0;
  a.cls = WorkClass::compute;
  a.latency = 3 * t.launch_latency();
  a.demands = {{t.sm(0), gemm}};
  const int id = e.add_task(a);
  e.run();
  EXPECT_DOUBLE_EQ(e.task(id).end, 3 * m.efficiency.calibration->launch_latency + gemm);
}

TEST_F(ClusterTest, BadCalibrationFiles) {
  const json good =
      json::parse(std::ifstream(fs::path(experiments_dir()) / "hardware" / "calibration" / "h100-sxm5.json"));
  use_catalogue_copy();
  const auto with_calibration = [&](const std::string& name, const json& cal) {
    write("hardware/calibration/" + name + ".json", cal);
    json c = minimal_cluster("h100-node", 1);
    c["efficiency"] = {{"calibration", name}};
    write_cluster("c-" + name, c);
    return error_of([&] { (void)load_cluster("c-" + name); });
  };
  EXPECT_EQ(with_calibration("ok", good), "<no error>");
  // A precision the device was not measured in has no curve: the calibration loads, and a
  // GEMM of that precision is an error naming the calibration and what it has.
  json a = good;
  a["curves"].erase("tf32");
  EXPECT_EQ(with_calibration("a", a), "<no error>");
  {
    const ClusterModel m = load_cluster("c-a");
    Engine e;
    Topology t(m, e);
    EXPECT_GT(t.gemm_seconds(512, 3072, 768, DType::bf16), 0.0);
    const std::string err = error_of([&] { (void)t.gemm_seconds(512, 3072, 768, DType::f32, true); });
    EXPECT_HAS(err, "a.json): no curve");
    EXPECT_HAS(err, "no curve for tf32 GEMMs (it has bf16, fp32)");
  }
  json a2 = good;
  a2["curves"] = json::object();
  EXPECT_HAS(with_calibration("a2", a2), "c-a2.json: efficiency.calibration = \"a2\"");
  EXPECT_HAS(with_calibration("a2", a2), "a2.json: curves");
  EXPECT_HAS(with_calibration("a2", a2), "needs a curve for at least one of bf16, fp32, tf32");
  // The fitted sections a calibration may record (scripts/fit_gemm_efficiency.py --profile)
  // load; one of the wrong type is named.
  json a3 = good;
  a3["copies"] = {{"h2d", {{"bw", 5e10}, {"latency", 1e-5}}}};
  a3["interference"] = {{"compute_beside_memcpy", 0.94}};
  a3["overheads"] = {{"event_record", 2e-6}};
  a3["dispatch"] = {{"permute_bw", 2e12}, {"source", "test"}};
  EXPECT_EQ(with_calibration("a3", a3), "<no error>");
  a3["dispatch"].erase("source");  // the sim reads the dispatch rates: they name their source
  EXPECT_HAS(with_calibration("a3", a3), "a3.json: missing field \"dispatch.source\"");
  a3["dispatch"] = 3;
  EXPECT_HAS(with_calibration("a3", a3), "a3.json: dispatch");
  json b = good;
  b["curves"]["bf16"]["gemm_max"] = 1.5;
  EXPECT_HAS(with_calibration("b", b), "b.json: curves.bf16.gemm_max = 1.5 must be in (0, 1]");
  json d = good;
  d["launch_latency"] = -1e-6;
  EXPECT_HAS(with_calibration("d", d), "d.json: launch_latency = -1e-06 must be >= 0");
  json g = good;
  g["curves"]["tf32"]["gemm_half_dim_range"] = {200, 512};
  EXPECT_HAS(with_calibration("g", g), "g.json: curves.tf32.gemm_half_dim_range");
  json h = good;
  h["mem_bw"] = "fast";
  EXPECT_HAS(with_calibration("h", h), "h.json: mem_bw");
  json hb = good;
  hb["hbm_bw"] = 0;
  EXPECT_HAS(with_calibration("hb", hb), "hb.json: hbm_bw");
  json s = good;
  s["schema"] = "moelab.gemm_calibration/2";
  EXPECT_HAS(with_calibration("s", s), "s.json: schema");
  json u = good;
  u["curves"]["fp16"] = good["curves"]["bf16"];
  EXPECT_HAS(with_calibration("u", u), "u.json: unknown field \"curves.fp16\"");

  json unknown = minimal_cluster("h100-node", 1);
  unknown["efficiency"] = {{"calibration", "h100-sxm"}};
  write_cluster("unknown", unknown);
  EXPECT_HAS(error_of([] { (void)load_cluster("unknown"); }), "unknown GEMM calibration \"h100-sxm\"");
  // A datasheet figure beside a calibration would do nothing: rejected.
  write("hardware/calibration/ok.json", good);
  json both = minimal_cluster("h100-node", 1);
  both["efficiency"] = {{"calibration", "ok"}, {"gemm_max", 0.8}};
  write_cluster("both", both);
  EXPECT_HAS(error_of([] { (void)load_cluster("both"); }),
             "both.json: efficiency.gemm_max = 0.8 is replaced by efficiency.calibration");
}

TEST_F(ClusterTest, InterferenceMatrix) {
  use_catalogue_copy();
  json c = minimal_cluster("a800-node", 1);
  c["interference"] = {{"compute", {{"memcpy", 0.9}, {"comm", 0.8}}}, {"memcpy", {{"compute", 0.95}}}, {"mu", 0.7}};
  write_cluster("c", c);
  const ClusterModel m = load_cluster("c");
  EXPECT_EQ(m.interference.factor[0][2], 0.9);
  EXPECT_EQ(m.interference.factor[0][1], 0.8);
  EXPECT_EQ(m.interference.factor[2][0], 0.95);
  EXPECT_EQ(m.interference.factor[2][1], 1.0);  // absent: no interference
  EXPECT_EQ(m.interference.factor[1][0], 0.7);  // the single-factor form: both aggressors
  EXPECT_EQ(m.interference.factor[1][2], 0.7);
  EXPECT_EQ(m.interference.sigma, 0.8);  // the summary: the smallest factor of the victim
  EXPECT_EQ(m.interference.eta, 0.95);
  json b = minimal_cluster("a800-node", 1);
  b["interference"] = {{"compute", {{"compute", 0.9}}}};
  write_cluster("b", b);
  EXPECT_HAS(error_of([] { (void)load_cluster("b"); }), "b.json: unknown field \"interference.compute.compute\"");
  json d = minimal_cluster("a800-node", 1);
  d["interference"] = {{"sigma", 0.9}, {"compute", {{"comm", 0.8}}}};
  write_cluster("d", d);
  EXPECT_HAS(error_of([] { (void)load_cluster("d"); }), "interference.sigma and interference.compute both set");
  json g = minimal_cluster("a800-node", 1);
  g["interference"] = {{"comm", {{"memcpy", 0}}}};
  write_cluster("g", g);
  EXPECT_HAS(error_of([] { (void)load_cluster("g"); }), "g.json: interference.comm.memcpy = 0 must be in (0, 1]");
  // Every catalogue cluster's matrix: no factor below 0.5 (MPipeMoE: overlapping would not pay).
  for (const auto& name : std::vector<std::string>{"h100x1", "dgx-a100x8", "pcie-a30x1"}) {
    ::unsetenv("MOELAB_EXPERIMENTS");
    const ClusterModel cm = load_cluster(name);
    for (int v = 0; v < 3; ++v)
      for (int a = 0; a < 3; ++a) {
        EXPECT_GT(cm.interference.factor[v][a], 0.5);
        EXPECT_LE(cm.interference.factor[v][a], 1.0);
      }
  }
}

// The "host" object (docs/PERFORMANCE.md, "Host time"): absent is 0 and leaves the cluster's
// JSON as it was; set, it needs a source; bad values name the field.
TEST_F(ClusterTest, HostTimeTerms) {
  use_catalogue_copy();
  json plain = minimal_cluster("a800-node", 1);
  write_cluster("plain", plain);
  const ClusterModel p = load_cluster("plain");
  EXPECT_EQ(p.host.sync_latency, 0.0);
  EXPECT_EQ(p.host.issue_overhead, 0.0);
  EXPECT_FALSE(p.host.modelled());
  EXPECT_FALSE(to_json(p).contains("host"));
  json c = minimal_cluster("a800-node", 1);
  c["host"] = {{"sync_latency", 2e-5}, {"issue_overhead", 5e-6}, {"source", "a sweep point"}};
  write_cluster("c", c);
  const ClusterModel m = load_cluster("c");
  EXPECT_EQ(m.host.sync_latency, 2e-5);
  EXPECT_EQ(m.host.issue_overhead, 5e-6);
  EXPECT_EQ(to_json(m)["host"]["issue_overhead"], 5e-6);
  json nosrc = minimal_cluster("a800-node", 1);
  nosrc["host"] = {{"sync_latency", 1e-5}};
  write_cluster("nosrc", nosrc);
  EXPECT_HAS(error_of([] { (void)load_cluster("nosrc"); }), "nosrc.json: host.source is missing");
  json neg = minimal_cluster("a800-node", 1);
  neg["host"] = {{"issue_overhead", -1e-6}, {"source", "x"}};
  write_cluster("neg", neg);
  EXPECT_HAS(error_of([] { (void)load_cluster("neg"); }), "host.issue_overhead");
  json typo = minimal_cluster("a800-node", 1);
  typo["host"] = {{"sync_latncy", 1e-6}, {"source", "x"}};
  write_cluster("typo", typo);
  EXPECT_HAS(error_of([] { (void)load_cluster("typo"); }), "unknown field \"host.sync_latncy\"");
  json wrong = minimal_cluster("a800-node", 1);
  wrong["host"] = 5;
  write_cluster("wrong", wrong);
  EXPECT_HAS(error_of([] { (void)load_cluster("wrong"); }), "wrong.json: host: expected an object");
}

TEST_F(ClusterTest, GemmSecondsFromAProfile) {
  const json pj = {{"schema", "moelab.profile/1"},
                   {"name", "tiny-a100"},
                   {"device", "A100-SXM4-40GB"},
                   {"date", "2025-01-01"},
                   {"commit", "abc"},
                   {"gemm",
                    {{{"m", 1024}, {"n", 1024}, {"k", 1024}, {"dtype", "bf16"}, {"seconds", 1e-5}},
                     {{"m", 8192}, {"n", 8192}, {"k", 8192}, {"dtype", "bf16"}, {"seconds", 4e-3}},
                     {{"m", 1024}, {"n", 1024}, {"k", 1024}, {"dtype", "fp32"}, {"seconds", 1.2e-4}}}},
                   {"h2d_bw", 20e9},
                   {"d2h_bw", 19e9},
                   {"d2d_bw", 1.3e12},
                   {"elementwise_bw", 1.2e12},
                   {"launch_latency", 4e-6}};
  const Profile p = load_profile(write("profile.json", pj));
  EXPECT_EQ(p.name, "tiny-a100");
  ASSERT_EQ(p.gemm.size(), 3u);
  EXPECT_EQ(p.gemm[2].dtype, DType::f32);
  EXPECT_EQ(to_json(p), pj);

  const ClusterModel m = load_cluster("dgx-a100x1");
  Engine e;
  Topology t(m, e, &p);
  EXPECT_TRUE(t.calibrated());
  // Nearest sample in log space, its achieved FLOP/s applied to this shape's FLOPs.
  EXPECT_DOUBLE_EQ(t.gemm_seconds(2048, 1024, 1024, DType::bf16), 2e-5);         // 1024^3 sample, 2x the FLOPs
  EXPECT_DOUBLE_EQ(t.gemm_seconds(4096, 8192, 8192, DType::bf16), 2e-3);         // 8192^3 sample, half the FLOPs
  EXPECT_DOUBLE_EQ(t.gemm_seconds(1024, 1024, 512, DType::f32), 0.6e-4);         // the fp32 sample only
  EXPECT_EQ(t.gemm_seconds(1024, 0, 1024, DType::bf16), 0.0);
  EXPECT_DOUBLE_EQ(t.mem_bw_effective(), 1.2e12);
  EXPECT_DOUBLE_EQ(t.launch_latency(), 4e-6);
  EXPECT_DOUBLE_EQ(e.resource_capacity(t.host_to_device(0).resources[0]), 20e9);
  EXPECT_DOUBLE_EQ(e.resource_capacity(t.device_to_host(0).resources[0]), 19e9);

  // Unmeasured figures fall back to the cluster's own: its GEMM calibration (dgx-a100x1
  // references experiments/hardware/calibration/a100-sxm4.json) and datasheet rates.
  Profile partial;
  partial.device = "x";
  partial.gemm = {{1024, 1024, 1024, DType::f32, 1e-4}};
  Engine e2, e3;
  Topology t2(m, e2, &partial), plain(m, e3);
  EXPECT_DOUBLE_EQ(t2.gemm_seconds(4096, 1024, 2048, DType::bf16), plain.gemm_seconds(4096, 1024, 2048, DType::bf16));
  EXPECT_DOUBLE_EQ(t2.mem_bw_effective(), 1555e9 * 0.8);
  EXPECT_DOUBLE_EQ(t2.launch_latency(), m.efficiency.calibration->launch_latency);
  EXPECT_DOUBLE_EQ(e2.resource_capacity(t2.host_to_device(0).resources[0]), m.node.host_copy_bw);
}

// ---- errors --------------------------------------------------------------------------------

TEST_F(ClusterTest, UnknownClusterNameListsTheKnownOnes) {
  const std::string msg = error_of([] { (void)load_cluster("dgx-a100x9"); });
  EXPECT_HAS(msg, "unknown cluster \"dgx-a100x9\"");
  EXPECT_HAS(msg, "did you mean");
  EXPECT_HAS(msg, "pcie-a30x1");
  EXPECT_HAS(msg, "a800x2");
  EXPECT_HAS(error_of([] { (void)load_cluster(""); }), "unknown cluster \"\"");
  EXPECT_HAS(error_of([] { (void)load_cluster("/no/such/cluster.json"); }), "/no/such/cluster.json: cannot open cluster file");
}

TEST_F(ClusterTest, UnknownGpuName) {
  use_catalogue_copy({}, [](json& n) { n["nodes"]["dgx-a100-40gb"]["gpu"] = "A100-SXM4-40G"; });
  write_cluster("c", minimal_cluster("dgx-a100-40gb", 1));
  const std::string bad = error_of([] { (void)load_cluster("c"); });
  EXPECT_HAS(bad, "nodes.json: nodes.dgx-a100-40gb.gpu = \"A100-SXM4-40G\" is not a GPU of");
  EXPECT_HAS(bad, "did you mean \"A100-SXM4-40GB\"");
  EXPECT_HAS(bad, "known GPUs: ");
}

TEST_F(ClusterTest, UnknownNodeName) {
  use_catalogue_copy();
  write_cluster("c", minimal_cluster("dgx-h100", 1));
  const std::string msg = error_of([] { (void)load_cluster("c"); });
  EXPECT_HAS(msg, "c.json: node = \"dgx-h100\" is not a node of");
  EXPECT_HAS(msg, "known nodes: ");
  EXPECT_HAS(msg, "pcie-a30");
}

TEST_F(ClusterTest, MissingFields) {
  use_catalogue_copy([](json& g) { g["gpus"]["A30"].erase("hbm_bw"); },
                     [](json& n) { n["nodes"]["dgx-a100-40gb"].erase("nvlink_bw"); });
  write_cluster("a", minimal_cluster("dgx-a100-40gb", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("a"); }), "nodes.json: missing field \"nodes.dgx-a100-40gb.nvlink_bw\"");
  write_cluster("b", minimal_cluster("pcie-a30", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("b"); }), "gpus.json: missing field \"gpus.A30.hbm_bw\"");
  json c = minimal_cluster("a800-node", 1);
  c.erase("source");
  write_cluster("c", c);
  EXPECT_HAS(error_of([] { (void)load_cluster("c"); }), "c.json: missing field \"source\"");
  json d = minimal_cluster("a800-node", 1);
  d.erase("nodes");
  write_cluster("d", d);
  EXPECT_HAS(error_of([] { (void)load_cluster("d"); }), "d.json: missing field \"nodes\"");
}

TEST_F(ClusterTest, NegativeOrZeroBandwidth) {
  use_catalogue_copy([](json& g) { g["gpus"]["H100-SXM5-80GB"]["hbm_bw"] = 0; },
                     [](json& n) { n["nodes"]["dgx-a100-40gb"]["nic_bw"] = -25e9; });
  write_cluster("a", minimal_cluster("dgx-a100-40gb", 2));
  const std::string msg = error_of([] { (void)load_cluster("a"); });
  EXPECT_HAS(msg, "nodes.json: nodes.dgx-a100-40gb.nic_bw = -25000000000.0 must be > 0");
  write_cluster("b", minimal_cluster("h100-node", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("b"); }), "gpus.json: gpus.H100-SXM5-80GB.hbm_bw = 0 must be > 0");
}

TEST_F(ClusterTest, GpusNotDivisibleByGpusPerSwitch) {
  use_catalogue_copy({}, [](json& n) { n["nodes"]["pcie-a30"]["gpus_per_pcie_switch"] = 3; });
  write_cluster("c", minimal_cluster("pcie-a30", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("c"); }),
             "nodes.json: nodes.pcie-a30.gpus = 8 is not divisible by nodes.pcie-a30.gpus_per_pcie_switch = 3");
}

TEST_F(ClusterTest, MultiNodeWithoutNics) {
  use_catalogue_copy();
  write_cluster("c", minimal_cluster("pcie-a30", 2));
  EXPECT_HAS(error_of([] { (void)load_cluster("c"); }),
             "c.json: nodes = 2 but node \"pcie-a30\" has no NICs (nics = 0)");
}

TEST_F(ClusterTest, FieldsForTheOtherKindOfNodeAreRejected) {
  use_catalogue_copy({}, [](json& n) {
    n["nodes"]["pcie-a30"]["nvlink_bw"] = 300e9;
    n["nodes"]["h100-node"]["pcie_bw"] = 64e9;
  });
  write_cluster("a", minimal_cluster("pcie-a30", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("a"); }),
             "nodes.pcie-a30.nvlink_bw = 300000000000.0 is only used with intra = \"nvswitch\"");
  write_cluster("b", minimal_cluster("h100-node", 1));
  // An NVSwitch node may model its PCIe switches, but then with all three figures.
  EXPECT_HAS(error_of([] { (void)load_cluster("b"); }),
             "nodes.h100-node.gpus_per_pcie_switch is missing: an NVSwitch node that models its PCIe switches needs all of");
}

// NCCL's all-to-all terms and an NVSwitch node's PCIe switches: read from the node, overridden
// field by field by a cluster's "p2p", and every bad value is a ConfigError naming the field.
TEST_F(ClusterTest, P2pFiguresAndPcieSwitchesOfNvswitchNodes) {
  use_catalogue_copy();
  write_cluster("ok", minimal_cluster("dgx-a100-40gb", 2));
  const ClusterModel m = load_cluster("ok");
  EXPECT_EQ(m.node.gpus_per_pcie_switch, 2);
  EXPECT_DOUBLE_EQ(m.node.pcie_bw, 24e9);
  EXPECT_DOUBLE_EQ(m.node.pcie_switch_uplink_bw, 24e9);
  EXPECT_DOUBLE_EQ(m.node.p2p.ll_threshold, 16384);
  EXPECT_DOUBLE_EQ(m.node.p2p.intra_efficiency, 0.8);
  EXPECT_DOUBLE_EQ(m.node.p2p.net_peer_overhead, 2e-6);
  EXPECT_FALSE(m.node.p2p.source.empty());
  // A cluster overrides some of them and keeps the rest.
  json o = minimal_cluster("dgx-a100-40gb", 2);
  o["p2p"] = {{"net_efficiency", 0.95}, {"net_peer_overhead", 1e-6}, {"source", "test"}};
  write_cluster("over", o);
  const ClusterModel mo = load_cluster("over");
  EXPECT_DOUBLE_EQ(mo.node.p2p.net_efficiency, 0.95);
  EXPECT_DOUBLE_EQ(mo.node.p2p.net_peer_overhead, 1e-6);
  EXPECT_DOUBLE_EQ(mo.node.p2p.intra_efficiency, 0.8);
  EXPECT_EQ(mo.node.p2p.source, "test");

  json b = minimal_cluster("dgx-a100-40gb", 2);
  b["p2p"] = {{"intra_efficiency", 1.5}, {"source", "test"}};
  write_cluster("b", b);
  EXPECT_HAS(error_of([] { (void)load_cluster("b"); }), "b.json: p2p.intra_efficiency = 1.5 must be in (0, 1]");
  json c = minimal_cluster("dgx-a100-40gb", 2);
  c["p2p"] = {{"ll_threshold", -1}, {"source", "test"}};
  write_cluster("c", c);
  EXPECT_HAS(error_of([] { (void)load_cluster("c"); }), "c.json: p2p.ll_threshold = -1 must be >= 0");
  json d = minimal_cluster("dgx-a100-40gb", 2);
  d["p2p"] = {{"net_peer_overhed", 1e-6}, {"source", "test"}};
  write_cluster("d", d);
  EXPECT_HAS(error_of([] { (void)load_cluster("d"); }), "unknown field \"p2p.net_peer_overhed\" (did you mean \"p2p.net_peer_overhead\"?)");
  json e = minimal_cluster("dgx-a100-40gb", 2);
  e["p2p"] = {{"net_peer_overhead", 2.0}, {"source", "test"}};
  write_cluster("e", e);
  EXPECT_HAS(error_of([] { (void)load_cluster("e"); }), "e.json: p2p.net_peer_overhead = 2.0 is outside [0, 1] s");
  json f = minimal_cluster("dgx-a100-40gb", 2);
  f["p2p"] = 3;
  write_cluster("f", f);
  EXPECT_HAS(error_of([] { (void)load_cluster("f"); }), "f.json: p2p");

  // In the catalogue every figure of a node's p2p is required, and the PCIe switches come in
  // threes and divide the GPUs.
  use_catalogue_copy({}, [](json& n) {
    n["nodes"]["dgx-a100-40gb"]["p2p"].erase("ll_efficiency");
    n["nodes"]["dgx-a100-80gb"]["gpus_per_pcie_switch"] = 3;
    n["nodes"]["h100-node"]["p2p"]["base_latency_ll"] = -1e-6;
  });
  write_cluster("g", minimal_cluster("dgx-a100-40gb", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("g"); }), "nodes.dgx-a100-40gb.p2p.ll_efficiency");
  write_cluster("h", minimal_cluster("dgx-a100-80gb", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("h"); }),
             "nodes.dgx-a100-80gb.gpus = 8 is not divisible by nodes.dgx-a100-80gb.gpus_per_pcie_switch = 3");
  write_cluster("i", minimal_cluster("h100-node", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("i"); }), "nodes.h100-node.p2p.base_latency_ll = -1e-06 must be >= 0");
}

TEST_F(ClusterTest, BadClusterFields) {
  use_catalogue_copy();
  json a = minimal_cluster("a800-node", 2);
  a["fabric_latncy"] = 1e-6;
  write_cluster("a", a);
  EXPECT_HAS(error_of([] { (void)load_cluster("a"); }),
             "a.json: unknown field \"fabric_latncy\" (did you mean \"fabric_latency\"?)");
  json b = minimal_cluster("a800-node", 2);
  b["interference"] = {{"sigma", 1.5}};
  write_cluster("b", b);
  EXPECT_HAS(error_of([] { (void)load_cluster("b"); }), "b.json: interference.sigma = 1.5 must be in (0, 1]");
  json c = minimal_cluster("a800-node", 2);
  c["efficiency"] = {{"gemm_max", 0.8}, {"launch_latency", -1e-6}};
  write_cluster("c", c);
  EXPECT_HAS(error_of([] { (void)load_cluster("c"); }), "c.json: efficiency.launch_latency = -1e-06 must be >= 0");
  json d = minimal_cluster("a800-node", 0);
  write_cluster("d", d);
  EXPECT_HAS(error_of([] { (void)load_cluster("d"); }), "d.json: nodes: expected a positive integer, got 0");
  json f = minimal_cluster("a800-node", 1);
  f["fabric"] = "nvlink";
  write_cluster("f", f);
  EXPECT_HAS(error_of([] { (void)load_cluster("f"); }), "f.json: fabric = \"nvlink\" is not one of infiniband, ethernet");
  json g = minimal_cluster("a800-node", 1);
  g["schema"] = "moelab.cluster/2";
  write_cluster("g", g);
  EXPECT_HAS(error_of([] { (void)load_cluster("g"); }), "g.json: schema = \"moelab.cluster/2\" is not \"moelab.cluster/1\"");
}

TEST_F(ClusterTest, ClusterOverridesEfficiencyAndInterference) {
  use_catalogue_copy();
  json c = minimal_cluster("a800-node", 2);
  c["efficiency"] = {{"gemm_max", 0.7}};
  c["interference"] = {{"mu", 0.6}, {"source", "measured"}};
  write_cluster("c", c);
  const ClusterModel m = load_cluster("c");
  EXPECT_DOUBLE_EQ(m.efficiency.gemm_max, 0.7);
  EXPECT_DOUBLE_EQ(m.efficiency.mem, Efficiency{}.mem);  // unspecified: the struct default
  EXPECT_DOUBLE_EQ(m.interference.mu, 0.6);
  EXPECT_DOUBLE_EQ(m.interference.sigma, 1.0);
  EXPECT_EQ(m.interference.source, "measured");
  EXPECT_EQ(experiments_dir(), tmp().string());
}

TEST_F(ClusterTest, MalformedJson) {
  use_catalogue_copy();
  write("hardware/clusters/c.json", std::string("{ \"node\": \"a800-node\", \"nodes\": 2, }"));
  const std::string msg = error_of([] { (void)load_cluster("c"); });
  EXPECT_HAS(msg, "c.json: malformed JSON at line 1");
  write("hardware/clusters/d.json", std::string("{ \"node\": \"a800-node\", \"nodes\": 2, \"nodes\": 1, \"source\": \"x\" }"));
  EXPECT_HAS(error_of([] { (void)load_cluster("d"); }), "d.json: field \"nodes\" appears twice");
  write("hardware/nodes.json", std::string("[1, 2"));
  write_cluster("e", minimal_cluster("a800-node", 1));
  EXPECT_HAS(error_of([] { (void)load_cluster("e"); }), "nodes.json: malformed JSON");
}

TEST_F(ClusterTest, BadProfileFiles) {
  const json good = {{"schema", "moelab.profile/1"},
                     {"device", "H100"},
                     {"gemm", {{{"m", 64}, {"n", 64}, {"k", 64}, {"dtype", "bf16"}, {"seconds", 1e-6}}}}};
  EXPECT_EQ(load_profile(write("good.json", good)).name, "good");
  // What `moelab calibrate` adds: how it measured, and collectives for validating the sim.
  json full = good;
  full["mode"] = "measured";
  full["backend"] = "cuda";
  full["collectives"] = {{{"op", "all_to_all_v"}, {"ranks", 8}, {"bytes_per_peer", 4096}, {"seconds", 1e-4}, {"busbw", 3e8}}};
  EXPECT_EQ(load_profile(write("full.json", full)).device, "H100");
  EXPECT_HAS(error_of([&] { (void)load_profile((tmp() / "missing.json").string()); }),
             "missing.json: cannot open calibration profile");
  EXPECT_HAS(error_of([&] { (void)load_profile(write("bad.json", std::string("{\"schema\": "))); }),
             "bad.json: malformed JSON");

  const auto bad = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return error_of([&] { (void)load_profile(write("p.json", j)); });
  };
  EXPECT_HAS(bad([](json& j) { j["schema"] = "moelab.profile/0"; }),
             "p.json: schema = \"moelab.profile/0\" is not \"moelab.profile/1\"");
  EXPECT_HAS(bad([](json& j) { j.erase("schema"); }), "p.json: missing field \"schema\"");
  EXPECT_HAS(bad([](json& j) { j.erase("device"); }), "p.json: missing field \"device\"");
  EXPECT_HAS(bad([](json& j) { j["gemm"][0]["seconds"] = -1.0; }), "p.json: gemm[0].seconds = -1.0 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["gemm"][0]["dtype"] = "fp16"; }),
             "p.json: gemm[0].dtype = \"fp16\" is not one of fp32, bf16");
  EXPECT_HAS(bad([](json& j) { j["gemm"][0]["k"] = 0; }), "p.json: gemm[0].k: expected a positive integer, got 0");
  EXPECT_HAS(bad([](json& j) { j["gemm"][0]["secs"] = 1; }), "p.json: unknown field \"gemm[0].secs\"");
  EXPECT_HAS(bad([](json& j) { j["gemm"] = 3; }), "p.json: gemm: expected an array");
  EXPECT_HAS(bad([](json& j) { j["h2d_bw"] = -5e9; }), "p.json: h2d_bw = -5000000000.0 must be >= 0");
  EXPECT_HAS(bad([](json& j) { j["collectives"] = {{{"op", "all_to_all_v"}, {"ranks", 8}, {"bytes_per_peer", 64}, {"seconds", 0}}}; }),
             "p.json: collectives[0].seconds = 0 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["mode"] = "simulated"; }), "p.json: mode = \"simulated\" is not one of measured");
}

// A profile may carry the cuda backend's GEMM-path crossovers (harness/runtime/gemm_paths.hpp):
// read, written back unchanged, every bad field named.
TEST_F(ClusterTest, ProfileGemmPaths) {
  json good = {{"schema", "moelab.profile/1"},
               {"device", "H100"},
               {"gemm_paths",
                {{"source", "a test"},
                 {"max_padding_waste", 0.2},
                 {"points",
                  {{{"precision", "bf16"}, {"op", "fwd"}, {"d_model", 768}, {"d_hidden", 3072}, {"experts", 8},
                    {"rows", 64}, {"tflops", {{"loop", 35.0}, {"strided_batched", 116.7}, {"grouped", 98.9}}}},
                   {{"precision", "tf32"}, {"op", "wgrad"}, {"d_model", 768}, {"d_hidden", 3072}, {"experts", 8},
                    {"rows", 8192}, {"tflops", {{"loop", 300.0}}}}}}}}};
  const Profile p = load_profile(write("paths.json", good));
  ASSERT_TRUE(p.gemm_paths.has_value());
  EXPECT_EQ(p.gemm_paths->source, "a test");
  EXPECT_DOUBLE_EQ(p.gemm_paths->max_padding_waste, 0.2);
  EXPECT_DOUBLE_EQ(p.gemm_paths->tie_tolerance, GemmPathTable{}.tie_tolerance);  // the default
  ASSERT_EQ(p.gemm_paths->points.size(), 2u);
  const GemmPathPoint& w = p.gemm_paths->points[1];
  EXPECT_EQ(w.precision, "tf32");
  EXPECT_EQ(w.op, GemmOp::wgrad);
  EXPECT_EQ(w.rows, 8192);
  EXPECT_DOUBLE_EQ(w.tflops[static_cast<std::size_t>(GemmPath::loop)], 300.0);
  EXPECT_EQ(w.tflops[static_cast<std::size_t>(GemmPath::grouped)], 0.0);  // not measured
  EXPECT_EQ(to_json(p)["gemm_paths"], to_json(*p.gemm_paths));
  EXPECT_EQ(to_json(gemm_path_table_from_json(to_json(*p.gemm_paths), "again")), to_json(*p.gemm_paths));
  EXPECT_FALSE(load_profile(write("none.json", json{{"schema", "moelab.profile/1"}, {"device", "H100"}})).gemm_paths);
  // The H100 table survives the round trip.
  const GemmPathTable& h100 = default_gemm_path_table();
  const GemmPathTable back = gemm_path_table_from_json(to_json(h100), "h100");
  ASSERT_EQ(back.points.size(), h100.points.size());
  EXPECT_EQ(back.points[17].tflops, h100.points[17].tflops);

  const auto bad = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return error_of([&] { (void)load_profile(write("p.json", j)); });
  };
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"] = 1; }), "p.json: gemm_paths: expected an object");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"].erase("points"); }), "p.json: missing field \"gemm_paths.points\"");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["max_padding_waste"] = 1.5; }),
             "p.json: gemm_paths.max_padding_waste = 1.5 is outside [0, 1]");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["tie_tolerance"] = -0.1; }),
             "p.json: gemm_paths.tie_tolerance = -0.1 must be >= 0");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][0]["op"] = "bwd"; }),
             "p.json: gemm_paths.points[0].op = \"bwd\" is not one of fwd, dgrad, wgrad");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][0]["precision"] = "fp16"; }),
             "p.json: gemm_paths.points[0].precision = \"fp16\" is not one of bf16, fp32, tf32");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][0]["rows"] = 0; }),
             "p.json: gemm_paths.points[0].rows: expected a positive integer, got 0");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][0]["tflops"]["loop"] = -3; }),
             "p.json: gemm_paths.points[0].tflops.loop = -3 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][0]["tflops"]["batched"] = 3; }),
             "p.json: unknown field \"gemm_paths.points[0].tflops.batched\"");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][1]["tflops"] = json::object(); }),
             "p.json: gemm_paths.points[1].tflops: expected at least one of loop, strided_batched, grouped");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["points"][0].erase("experts"); }),
             "p.json: missing field \"gemm_paths.points[0].experts\"");
  EXPECT_HAS(bad([](json& j) { j["gemm_paths"]["point"] = 1; }), "p.json: unknown field \"gemm_paths.point\"");
}

// What `moelab calibrate` records beside the GEMMs for scripts/fit_gemm_efficiency.py (copies,
// overheads, interference, dispatch): read, written back as read, not used by the time
// model, and every bad field named.
TEST_F(ClusterTest, ProfileMeasurements) {
  const json base = {{"schema", "moelab.profile/1"}, {"device", "H100"}};
  json good = base;
  good["copies"] = {{{"kind", "h2d"}, {"bytes", 1048576}, {"seconds", 5e-5}},
                    {{"kind", "d2d"}, {"bytes", 4096}, {"seconds", 3e-6}}};
  good["overheads"] = {{"launch_latency", 4e-6}, {"sync_roundtrip", 1.2e-5}, {"stream_wait", 0}};
  good["interference"] = {{{"victim", "compute"}, {"aggressor", "h2d"}, {"alone_s", 1e-3}, {"together_s", 1.25e-3},
                           {"factor", 0.8}}};
  good["dispatch"] = {{{"op", "permute"}, {"rows", 4096}, {"width", 1024}, {"dtype", "bf16"}, {"bytes", 1.6e7},
                       {"seconds", 1e-5}},
                      {{"op", "exchange"}, {"ranks", 8}, {"bytes", 3.5e6}, {"seconds", 2e-5}}};
  const Profile p = load_profile(write("m.json", good));
  ASSERT_EQ(p.copies.size(), 2u);
  EXPECT_EQ(p.copies[0].kind, "h2d");
  EXPECT_EQ(p.copies[0].bytes, 1048576);
  EXPECT_EQ(p.copies[1].seconds, 3e-6);
  ASSERT_TRUE(p.overheads);
  EXPECT_EQ(p.overheads->launch_latency, 4e-6);
  EXPECT_FALSE(p.overheads->event_record);  // not measured
  EXPECT_EQ(p.overheads->stream_wait, 0.0);
  ASSERT_EQ(p.interference.size(), 1u);
  EXPECT_EQ(p.interference[0].aggressor, "h2d");
  EXPECT_EQ(p.interference[0].together_s, 1.25e-3);
  EXPECT_EQ(p.interference[0].factor, 0.8);
  ASSERT_EQ(p.dispatch.size(), 2u);
  EXPECT_EQ(p.dispatch[0].op, "permute");
  EXPECT_EQ(p.dispatch[0].width, 1024);
  EXPECT_EQ(p.dispatch[0].dtype, "bf16");
  EXPECT_EQ(p.dispatch[1].ranks, 8);
  EXPECT_EQ(p.dispatch[1].bytes, 3.5e6);
  // Written back as read; a profile without them is written as before.
  const json back = to_json(p);
  for (const char* k : {"copies", "overheads", "interference", "dispatch"}) EXPECT_EQ(back[k], good[k]) << k;
  EXPECT_EQ(to_json(load_profile(write("again.json", back))), back);
  const json plain = to_json(load_profile(write("plain.json", base)));
  for (const char* k : {"copies", "overheads", "interference", "dispatch"}) EXPECT_FALSE(plain.contains(k)) << k;
  // The time model reads none of them: the same GEMM, copy and launch figures as without.
  const ClusterModel m = load_cluster("h100x1");
  const Profile none = load_profile(write("none.json", base));
  Engine e1, e2;
  const Topology with(m, e1, &p), without(m, e2, &none);
  EXPECT_EQ(with.launch_latency(), without.launch_latency());
  EXPECT_EQ(with.gemm_seconds(512, 3072, 768, DType::bf16), without.gemm_seconds(512, 3072, 768, DType::bf16));
  EXPECT_EQ(with.mem_bw_effective(), without.mem_bw_effective());
  EXPECT_EQ(e1.resource_capacity(with.host_to_device(0).resources[0]),
            e2.resource_capacity(without.host_to_device(0).resources[0]));

  const auto bad = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return error_of([&] { (void)load_profile(write("p.json", j)); });
  };
  // copies
  EXPECT_HAS(bad([](json& j) { j["copies"] = 1; }), "p.json: copies: expected an array");
  EXPECT_HAS(bad([](json& j) { j["copies"][1] = 2; }), "p.json: copies[1]: expected an object");
  EXPECT_HAS(bad([](json& j) { j["copies"][1]["kind"] = "p2p"; }), "p.json: copies[1].kind = \"p2p\" is not one of h2d, d2h, d2d");
  EXPECT_HAS(bad([](json& j) { j["copies"][0]["bytes"] = 0; }), "p.json: copies[0].bytes: expected a positive integer, got 0");
  EXPECT_HAS(bad([](json& j) { j["copies"][0]["bytes"] = 1.5; }), "p.json: copies[0].bytes: expected a positive integer");
  EXPECT_HAS(bad([](json& j) { j["copies"][1]["seconds"] = 0; }), "p.json: copies[1].seconds = 0 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["copies"][0].erase("kind"); }), "p.json: missing field \"copies[0].kind\"");
  EXPECT_HAS(bad([](json& j) { j["copies"][0]["rate"] = 1; }), "p.json: unknown field \"copies[0].rate\"");
  // overheads
  EXPECT_HAS(bad([](json& j) { j["overheads"] = {1, 2}; }), "p.json: overheads: expected an object");
  EXPECT_HAS(bad([](json& j) { j["overheads"]["event_record"] = -1e-6; }),
             "p.json: overheads.event_record = -1e-06 must be >= 0");
  EXPECT_HAS(bad([](json& j) { j["overheads"]["sync_roundtrip"] = "slow"; }),
             "p.json: overheads.sync_roundtrip: expected a number");
  EXPECT_HAS(bad([](json& j) { j["overheads"]["stream_waits"] = 0; }),
             "p.json: unknown field \"overheads.stream_waits\" (did you mean \"overheads.stream_wait\"?)");
  // interference
  EXPECT_HAS(bad([](json& j) { j["interference"][0]["victim"] = "comm"; }),
             "p.json: interference[0].victim = \"comm\" is not one of compute, h2d, d2h");
  EXPECT_HAS(bad([](json& j) { j["interference"][0]["aggressor"] = "nccl"; }),
             "p.json: interference[0].aggressor = \"nccl\" is not one of compute, h2d, d2h");
  EXPECT_HAS(bad([](json& j) { j["interference"][0]["alone_s"] = -1; }), "p.json: interference[0].alone_s = -1 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["interference"][0]["together_s"] = 0; }),
             "p.json: interference[0].together_s = 0 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["interference"][0]["factor"] = 0; }),
             "p.json: interference[0].factor = 0 must be a finite number > 0");
  EXPECT_HAS(bad([](json& j) { j["interference"][0].erase("factor"); }), "p.json: missing field \"interference[0].factor\"");
  // dispatch
  EXPECT_HAS(bad([](json& j) { j["dispatch"][0]["op"] = "combine"; }),
             "p.json: dispatch[0].op = \"combine\" is not one of permute, unpermute, exchange");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][0].erase("op"); }), "p.json: missing field \"dispatch[0].op\"");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][0]["dtype"] = "fp16"; }),
             "p.json: dispatch[0].dtype = \"fp16\" is not one of fp32, bf16");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][0]["rows"] = -4; }), "p.json: dispatch[0].rows: expected a positive integer");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][0]["bytes"] = 0; }), "p.json: dispatch[0].bytes = 0 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][1]["seconds"] = -2e-5; }), "p.json: dispatch[1].seconds = -2e-05 must be > 0");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][1]["ranks"] = 0; }), "p.json: dispatch[1].ranks: expected a positive integer, got 0");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][1]["rows"] = 64; }), "p.json: unknown field \"dispatch[1].rows\"");
  EXPECT_HAS(bad([](json& j) { j["dispatch"][0]["ranks"] = 8; }), "p.json: unknown field \"dispatch[0].ranks\"");
  EXPECT_HAS(bad([](json& j) { j["dispatch"] = json::object(); }), "p.json: dispatch: expected an array");
}

}  // namespace
}  // namespace moelab::sim
