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
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <optional>

#include "harness/runtime/dtype.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/runtime/op_types.hpp"
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

// A GEMM efficiency curve of one precision: eff(m,n,k) = gemm_max * d / (d + gemm_half_dim),
// d = min(m,n,k) (docs/PERFORMANCE.md, "GEMM efficiency against size").
struct GemmCurve {
  double gemm_max = 0.8;
  double gemm_half_dim = 128;
  double half_dim_lo = 0, half_dim_hi = 0;  // a swept parameter's documented range (0, 0: fitted)
  std::string source;
};

// A GEMM calibration (experiments/hardware/calibration/<name>.json, written by
// scripts/fit_gemm_efficiency.py from measurements): one GEMM [m,k]x[k,n] takes
//   launch_latency + max(2mnk / (peak * eff(m,n,k)), elem_bytes * (mk + kn + mn) / mem_bw),
// eff from the curve of its precision (bf16, fp32 = strict fp32, tf32 = fp32 on TF32 cores).
// A library path's curves, one per precision the path was measured in (absent: the path has
// no curve for that precision, and a call taking it is priced as the loop).
struct PathCurves {
  std::optional<GemmCurve> bf16, fp32, tf32;
  const GemmCurve* curve(const std::string& precision) const;  // "bf16", "fp32", "tf32"; null: none
};

// Per-path GEMM pricing (docs/PERFORMANCE.md, "GEMM paths in the sim"): the curves of the
// batched library paths (the main curves are the loop's, one cublasGemmEx per problem) and the
// crossover table that picks a call's path, as the cuda backend picks it
// (harness/runtime/gemm_paths.hpp).
struct GemmPathPricing {
  std::string source;
  PathCurves strided_batched, grouped;
  GemmPathTable table;
  const PathCurves* curves(GemmPath p) const;  // null for the loop
};

// The memory-bound kernels a calibration measured on its device (scripts/fit_gemm_efficiency.py
// --profile from `moelab calibrate`): the sim prices these ops at the device's own rates instead
// of one per-byte memory rate (docs/PERFORMANCE.md, "Kernel rates in the sim"). Each optional.
struct ActivationRate {
  Activation activation = Activation::gelu;
  bool backward = false;
  DType dtype = DType::f32;
  double elements_per_s = 0;  // of the kernel at the calibrated size, its memory traffic included
};
struct ExchangeFit {             // the world communicator's all-to-all with itself
  double bw = 0, latency = 0;    // t = latency + bytes / bw (bytes one way)
  std::vector<int> ranks;        // the world sizes it was measured on
};
struct KernelRates {
  std::optional<double> permute_bw, unpermute_bw;  // bytes read + written per second
  std::optional<ExchangeFit> exchange;
  std::vector<ActivationRate> activations;
  std::string dispatch_source, activations_source;
  const ActivationRate* activation(Activation a, bool backward, DType t) const;  // null: not measured
};

struct GemmCalibration {
  std::string name, origin, device;
  double launch_latency = 0;  // s per kernel / library call
  double mem_bw = 0;          // bytes/s of the roofline term, on the device measured
  // The datasheet HBM rate of that device (optional "hbm_bw"; 0: not given). Given, a cluster
  // of another part of the same architecture (an A100 or A800 80GB priced by the A100 40GB's
  // curves, an H200 by the H100's) scales mem_bw by its own GPU's hbm_bw over this.
  double hbm_bw = 0;
  std::optional<GemmCurve> bf16, fp32, tf32;  // absent: the device was not measured in it
  // The file's optional "paths" and "gemm_paths" objects (given together); absent: every
  // grouped GEMM call is priced as a loop of single GEMMs.
  std::optional<GemmPathPricing> paths;
  // The file's optional "dispatch" and "activations" objects.
  KernelRates kernels;
  std::string source;
  const GemmCurve& curve(DType t, bool on_tf32) const;  // Unsupported for other dtypes
};
// name: a file stem under experiments/hardware/calibration/ ("h100-sxm5") or a path.
GemmCalibration load_gemm_calibration(const std::string& name_or_path);

// GEMM efficiency and launch cost. With `calibration`, its curves and launch latency are used
// (the datasheet gemm_max, gemm_half_dim and launch_latency are then absent from the file);
// without, the datasheet curve eff = gemm_max * d / (d + gemm_half_dim), d = min(m,n,k).
struct Efficiency {
  double gemm_max = 0.8;       // fraction of peak a large GEMM reaches
  double gemm_half_dim = 128;  // eff(m,n,k) = gemm_max * d / (d + gemm_half_dim), d = min(m,n,k)
  double mem = 0.8;            // fraction of HBM bandwidth reached by memory-bound kernels
  double launch_latency = 5e-6;  // s per kernel / library call
  std::optional<GemmCalibration> calibration;
  std::string calibration_ref;   // as the cluster file names it
  std::string source;
};

// Interference between classes of work on one GPU: factor[victim][aggressor] is the rate a
// task of class `victim` keeps while a task of class `aggressor` runs on its GPU (indices:
// 0 compute, 1 comm, 2 memcpy; the diagonal is unused). With several aggressors the smallest
// factor applies (harness/sim/engine.hpp). sigma, mu and eta summarise the matrix per victim
// (its smallest factor): MPipeMoE's single-factor form, which the resource report gives.
struct Interference {
  double factor[3][3] = {{1, 1, 1}, {1, 1, 1}, {1, 1, 1}};
  double sigma = 1, mu = 1, eta = 1;
  std::string source;
  // Sets one victim's factor beside both aggressors (the single-factor form) and the summary.
  void set_victim(int victim, double f);
  void set(int victim, int aggressor, double f);  // and updates the summary
};

// The host's part of a step (docs/PERFORMANCE.md, "Host time"): the CPU thread that issues
// every operation of a rank. No published figure gives either term for the eager PyTorch
// stacks the papers ran; both are swept parameters, 0 (not modelled) unless a cluster file's
// "host" object sets them.
struct HostModel {
  double sync_latency = 0;    // s from the end of what a host synchronisation waits for to the host's next action
  double issue_overhead = 0;  // s of host time to issue one operation (kernel, library call, copy, collective)
  std::string source;
  bool modelled() const { return sync_latency > 0 || issue_overhead > 0; }
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
  HostModel host;
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
// What `moelab calibrate` measures beside the GEMMs, for scripts/fit_gemm_efficiency.py: the
// sim's time model reads none of it (it keeps the scalar rates above and the cluster's
// figures). Checked on load and written back by to_json(Profile).
struct CopySample {
  std::string kind;  // "h2d", "d2h", "d2d"
  std::int64_t bytes = 0;
  double seconds = 0;
};
struct ProfileOverheads {  // s; absent: not measured
  std::optional<double> launch_latency, event_record, sync_roundtrip, stream_wait;
};
struct InterferenceSample {
  std::string victim, aggressor;  // "compute", "h2d", "d2h"
  double alone_s = 0, together_s = 0, factor = 0;
};
struct ActivationSample {
  std::string activation;  // "gelu", "relu", "gelu_tanh"
  std::string direction;   // "forward", "backward"
  std::string dtype;       // "fp32", "bf16"
  std::int64_t elements = 0;
  double seconds = 0;
};
struct DispatchSample {
  std::string op;  // "permute" (rows, width, dtype) or "exchange" (ranks)
  std::int64_t rows = 0, width = 0;
  std::string dtype;  // "fp32", "bf16"
  std::int64_t ranks = 0;
  double bytes = 0, seconds = 0;
};

// One fused-epilogue GEMM (moelab calibrate, "epilogues"): one expert's FC1 ("fwd") or FC2
// dgrad ("dgrad") of rows x d_model x d_hidden, timed as the GEMM alone, the GEMM then its
// activation op, and the fused op. Recorded, not used by the time model: what the fusion saves,
// and how far the fused op is from the sim's price for it (its GEMM).
struct EpilogueSample {
  std::string op;          // "fwd", "dgrad"
  std::string activation;  // the fused activation ("gelu_tanh")
  std::string dtype;       // "fp32", "bf16"
  std::int64_t rows = 0, d_model = 0, d_hidden = 0;
  double gemm_s = 0, unfused_s = 0, fused_s = 0;
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
  std::vector<CopySample> copies;
  std::optional<ProfileOverheads> overheads;
  std::vector<InterferenceSample> interference;
  std::vector<DispatchSample> dispatch;
  std::vector<ActivationSample> activations;
  std::vector<EpilogueSample> epilogues;
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

// ConfigError when `path` is forced (moelab run --gemm-path) to a path other than the loop on
// a cluster whose GEMM calibration has no per-path data to price it.
void check_forced_gemm_path(const ClusterModel& m, std::optional<GemmPath> path);

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

  // Seconds a GEMM [m,k]x[k,n] takes alone: profile (nearest measured shape, scaled by FLOPs);
  // else, with a GEMM calibration, max(2mnk / (peak * eff(m,n,k)), bytes / mem_bw) on the
  // curve of its precision; else the datasheet 2mnk / (peak(dtype) * eff(m,n,k)). The sim charges sm(rank) with these seconds, so
  // that sharing and interference apply to them. tf32: an fp32 GEMM on TF32 tensor cores,
  // priced at the GPU's TF32 peak on the datasheet curve (a profile's fp32 samples are
  // strict fp32 and do not apply). The launch latency is not included (launch_latency()).
  double gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k, DType t, bool tf32 = false) const;
  // One grouped_gemm call (the experts' problems of one phase) as the cuda backend would run
  // it. Without per-path data in the cluster's GEMM calibration (GemmCalibration::paths): the
  // loop, as always: seconds = the sum of gemm_seconds, launches = the problems with m, n > 0.
  // With it: per type combination of the problems (A/B, C), the path choose_gemm_path takes
  // from the calibration's table; the loop as above, strided_batched and grouped one launch
  // and the sum of their curve's roofline times (docs/PERFORMANCE.md, "GEMM paths in the sim");
  // a path without a curve for the precision is priced as the loop.
  struct GroupedGemmPrice {
    double seconds = 0;         // on sm(rank), launches excluded
    std::int64_t launches = 0;  // library calls (and k = 0 fills), each adding launch_latency()
    std::string detail;         // the path of each type combination and why; "" without per-path data
    // Per library decision (a type combination, or the padded batch): the path it is priced
    // on and why, as the cuda backend's GemmPathLedger notes them; empty without per-path data.
    std::vector<std::pair<GemmPath, std::string>> decisions;
  };
  // grouped_available false: the call cannot take the grouped path (a fused-epilogue call:
  // cuBLASLt has no grouped matmul), as the cuda backend's chooser is told.
  GroupedGemmPrice grouped_gemm(std::span<const GemmProblem> problems, bool tf32, bool grouped_available = true) const;
  // The GEMM floor's yardstick (Backend::time_batched_gemms): each run of consecutive equal
  // problems as one strided-batched call on the calibration's strided_batched curve, where it
  // has per-path data and a curve for the precision; otherwise (and a run of one) the loop's
  // gemm_seconds. Launches excluded (back to back, hidden behind the previous kernel).
  double batched_gemm_seconds(std::span<const GemmProblem> problems, bool tf32) const;
  bool prices_gemm_paths() const;  // the calibration has per-path data
  // Pins every grouped_gemm call to one path where it can run (force_gemm_path; moelab run
  // --gemm-path), nullopt: the table's choice. A path other than the loop needs per-path data
  // (ConfigError otherwise: nothing could price it).
  void force_gemm_path(std::optional<GemmPath> path);
  // One problem on a path's curve: max(2mnk / (peak · eff), elem · (mk + kn + mn) / mem_bw).
  double path_gemm_seconds(const GemmCurve& curve, std::int64_t m, std::int64_t n, std::int64_t k, DType ab,
                           bool on_tf32) const;
  double mem_bw_effective() const;   // bytes/s for memory-bound kernels
  // The calibrated GEMM roofline's bytes/s: the calibration's mem_bw, scaled to this cluster's
  // GPU by the datasheet HBM rates where the calibration gives its device's
  // (GemmCalibration::hbm_bw). Needs a calibration.
  double gemm_mem_bw() const;
  // The cluster's GEMM calibration's kernel rates (KernelRates); null without a calibration.
  // Their rates (bytes/s, elements/s) are of the calibration's device: memory-bound kernels,
  // scale them by calibration_hbm_scale() on another part of its architecture.
  const KernelRates* kernel_rates() const;
  // The cluster GPU's datasheet HBM rate over the calibration device's (an H200 priced by the
  // H100's calibration: 4.8 / 3.35), 1 where either is not given or there is no calibration:
  // what gemm_mem_bw and the memory-bound kernel rates are scaled by.
  double calibration_hbm_scale() const;
  double launch_latency() const;     // profile, else calibration, else the datasheet figure
  const ClusterModel& model() const { return m_; }
  bool calibrated() const { return profile_ != nullptr; }

 private:
  const ClusterModel& m_;
  const Profile* profile_;
  std::optional<GemmPath> forced_path_;
  std::vector<int> sm_, hbm_, link_out_, link_in_, switch_up_, switch_down_, nic_out_, nic_in_, host_link_;
  std::vector<int> gpu_pcie_up_, gpu_pcie_down_;  // nvswitch nodes with PCIe switches: each GPU's x16 link
  int switch_of(int rank) const;                  // global PCIe switch index of a rank
};

}  // namespace moelab::sim
