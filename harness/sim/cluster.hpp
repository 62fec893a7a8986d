// harness/sim/cluster.hpp — cluster models as data, calibration profiles, and the topology
// that turns them into the engine's resources and routes.
//
// Files (experiments/hardware/): gpus.json (GPU catalogue: peak rates, HBM, memory),
// nodes.json (node catalogue: GPUs per node, NVSwitch or PCIe switches, NICs, host links),
// clusters/<name>.json (a node type × a node count, fabric, efficiencies, interference
// factors). Every figure carries its source. Unknown names, missing fields and inconsistent
// values (GPUs not divisible by GPUs per PCIe switch, a multi-node cluster without NICs, a
// non-positive bandwidth, ...) throw ConfigError naming the file, the field and the value.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <optional>

#include "harness/runtime/dtype.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/sim/engine.hpp"

namespace moelab::sim {

struct GpuSpec {
  std::string name;          // "A100-SXM4-40GB"
  double flops_bf16 = 0;     // dense peak, FLOP/s
  double flops_tf32 = 0;
  double flops_fp32 = 0;
  double memory_bytes = 0;   // HBM capacity
  double hbm_bw = 0;         // bytes/s
  std::string source;
};

// How NCCL runs a point-to-point exchange (an all-to-all-v is grouped ncclSend/ncclRecv), as
// docs/PERFORMANCE.md ("All-to-all as NCCL runs it") states it. The defaults are the ideal
// links of a node file without a "p2p" object: no per-call or per-peer latency, no protocol
// overhead, never the LL protocol.
struct P2pModel {
  double base_latency_simple = 0;  // s per collective call (kernel and plan), Simple protocol
  double base_latency_ll = 0;      // s per collective call when every message is LL
  double ll_threshold = 0;         // bytes per peer: a message of at most this many bytes uses LL
  double ll_efficiency = 1;        // share of every link's rate an LL message's payload gets
  double intra_efficiency = 1;     // Simple: share of NVLink (or GPU-to-GPU PCIe) rate reached
  double net_efficiency = 1;       // Simple: share of the NIC rate reached
  double intra_peer_overhead = 0;  // s per earlier intra-node peer in a rank's round order
  double net_peer_overhead = 0;    // s per earlier remote peer (the proxy posts them one by one)
  std::string source;
  bool ideal() const {
    return base_latency_simple == 0 && base_latency_ll == 0 && ll_threshold == 0 && ll_efficiency == 1 &&
           intra_efficiency == 1 && net_efficiency == 1 && intra_peer_overhead == 0 && net_peer_overhead == 0;
  }
};

struct NodeSpec {
  std::string name;          // "dgx-a100"
  std::string gpu;           // a GpuSpec name
  int gpus = 8;
  std::string intra = "nvswitch";   // "nvswitch" or "pcie"
  double nvlink_bw = 0;             // nvswitch: per GPU per direction, bytes/s
  double nvlink_latency = 0;        // s
  // pcie: GPUs behind one switch (share its uplink). nvswitch: optional (0 = not modelled);
  // when set, a GPU's PCIe link carries its host copies and its GPUDirect RDMA NIC traffic,
  // and its switch's uplink the host copies of every GPU behind it (DGX A100: 2 per switch).
  int gpus_per_pcie_switch = 0;
  double pcie_bw = 0;               // GPU <-> its switch, per direction, bytes/s
  double pcie_switch_uplink_bw = 0; // switch <-> host, per direction, bytes/s
  double pcie_latency = 0;          // s
  int nics = 0;                     // per node; GPU i uses NIC i % nics (rail-optimised)
  double nic_bw = 0;                // per NIC per direction, bytes/s
  double nic_latency = 0;           // s per message
  double host_memory_bytes = 0;
  double host_copy_bw = 0;          // pinned host <-> device per GPU per direction (achieved)
  P2pModel p2p;                     // NCCL's all-to-all terms (the node file's "p2p" object)
  std::string source;
  bool pcie_switches() const { return gpus_per_pcie_switch > 0; }
};

// Datasheet efficiency curves, used when no calibration profile is given.
struct Efficiency {
  double gemm_max = 0.8;       // fraction of peak a large GEMM reaches
  double gemm_half_dim = 128;  // eff(m,n,k) = gemm_max * d / (d + gemm_half_dim), d = min(m,n,k)
  double mem = 0.8;            // fraction of HBM bandwidth reached by memory-bound kernels
  double launch_latency = 5e-6;  // s per kernel / library call
  std::string source;
};

// MPipeMoE's interference factors: the rate a stream keeps while another kind of work runs
// on the same GPU (sigma: compute, mu: communication, eta: host copies).
struct Interference {
  double sigma = 1, mu = 1, eta = 1;
  std::string source;
};

struct ClusterModel {
  std::string name, description, origin;
  GpuSpec gpu;
  NodeSpec node;
  int nodes = 1;
  std::string fabric = "infiniband";  // between nodes: "infiniband" or "ethernet"
  double fabric_latency = 0;          // extra per-message latency across nodes, s
  Efficiency efficiency;
  Interference interference;
  std::string source;

  int world_size() const { return nodes * node.gpus; }
  int node_of(int rank) const { return rank / node.gpus; }
  double peak_flops(DType t) const;  // bf16 -> flops_bf16, fp32 -> flops_fp32
};

// name: a file stem under experiments/hardware/clusters/ ("dgx-a100x8"), or a path to a
// cluster file. The catalogue folder is found from MOELAB_EXPERIMENTS (env) or the source
// tree's experiments/ (compiled in).
ClusterModel load_cluster(const std::string& name_or_path);
std::vector<std::string> cluster_names();
nlohmann::json to_json(const ClusterModel& m);
std::string experiments_dir();

// A calibration profile, written by `moelab calibrate` on a real GPU.
struct GemmSample {
  std::int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::f32;
  double seconds = 0;
};
struct Profile {
  std::string name, device, date, commit, origin;
  std::vector<GemmSample> gemm;
  double h2d_bw = 0, d2h_bw = 0;  // pinned, bytes/s
  double d2d_bw = 0;              // device copy, bytes read + written per second
  double elementwise_bw = 0;      // bytes/s reached by elementwise kernels
  double launch_latency = 0;      // s
  // The cuda backend's GEMM-path crossovers measured on this device (harness/runtime/
  // gemm_paths.hpp; docs/GPU.md, "Expert GEMM paths"): for cuda_set_gemm_path_table. The
  // sim's time model does not use them.
  std::optional<GemmPathTable> gemm_paths;
};
Profile load_profile(const std::string& path);  // ConfigError on bad files
nlohmann::json to_json(const Profile& p);
// A profile's "gemm_paths" object: {"source", "max_padding_waste", "tie_tolerance", "points":
// [{"precision", "op", "d_model", "d_hidden", "experts", "rows", "tflops": {"loop",
// "strided_batched", "grouped"}}]}. ConfigError naming the field (origin: the file).
GemmPathTable gemm_path_table_from_json(const nlohmann::json& j, const std::string& origin,
                                        const std::string& prefix = "gemm_paths.");
nlohmann::json to_json(const GemmPathTable& t);

// The kinds of link a transfer can cross, for accounting: NVLink (through the node's
// NVSwitch), PCIe (a GPU's link to its switch, or a switch's uplink) and the NICs between
// nodes.
enum class LinkClass { nvlink, pcie, nic };
const char* link_class_name(LinkClass c);

// Bytes by link class. A transfer counts once in every class it crosses: between nodes of a
// PCIe machine that is both PCIe and NIC.
struct LinkBytes {
  double nvlink = 0, pcie = 0, nic = 0;
  double& operator[](LinkClass c);
  double operator[](LinkClass c) const;
  LinkBytes& operator+=(const LinkBytes& o);
  nlohmann::json to_json() const;
};

// A route through the cluster: the resources a transfer occupies (all at once, as a fluid
// flow), its latency and the link classes it crosses.
struct Route {
  std::vector<int> resources;
  std::vector<LinkClass> resource_links;  // the class of each resource, in the same order
  double latency = 0;
  std::vector<LinkClass> links;
  bool inter_node = false;
};

// The cluster's resources registered in an engine (per GPU: SMs, HBM, NVLink out/in or PCIe
// up/down; per PCIe switch: uplink up/down; per NIC: out/in), the routes between them, and
// the time model of compute (from the profile when given, else the datasheet curves).
class Topology {
 public:
  Topology(const ClusterModel& m, Engine& e, const Profile* profile = nullptr);

  int sm(int rank) const;    // capacity 1.0: amounts are seconds of the whole GPU's SMs
  int hbm(int rank) const;   // capacity: HBM bytes/s
  Route p2p(int src, int dst) const;         // src != dst; NVLink, PCIe or NIC path
  Route host_to_device(int rank) const;
  Route device_to_host(int rank) const;

  // Seconds a GEMM [m,k]x[k,n] takes alone: profile (nearest measured shape, scaled by FLOPs)
  // or 2mnk / (peak(dtype) * eff(m,n,k)). The sim charges sm(rank) with these seconds, so
  // that sharing and interference apply to them. tf32: an fp32 GEMM on TF32 tensor cores,
  // priced at the GPU's TF32 peak on the datasheet curve (a profile's fp32 samples are
  // strict fp32 and do not apply).
  double gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k, DType t, bool tf32 = false) const;
  double mem_bw_effective() const;   // bytes/s for memory-bound kernels
  double launch_latency() const;
  const ClusterModel& model() const { return m_; }
  bool calibrated() const { return profile_ != nullptr; }

 private:
  const ClusterModel& m_;
  const Profile* profile_;
  std::vector<int> sm_, hbm_, link_out_, link_in_, switch_up_, switch_down_, nic_out_, nic_in_, host_link_;
  std::vector<int> gpu_pcie_up_, gpu_pcie_down_;  // nvswitch nodes with PCIe switches: each GPU's x16 link
  int switch_of(int rank) const;                  // global PCIe switch index of a rank
};

}  // namespace moelab::sim
