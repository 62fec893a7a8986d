// harness/tests/sim_test_util.hpp — a toy cluster model for the sim backend's closed-form tests
// (sim_alltoall_test, sim_host_test): round figures, no launch latency, so that an op's time is
// its work and the terms under test alone.
#pragma once

#include "harness/sim/cluster.hpp"

namespace moelab::test {

// `nodes` nodes of `gpus` GPUs on an NVSwitch, one NIC per GPU when there are several nodes,
// with NCCL's p2p terms p (default: ideal flows).
inline sim::ClusterModel toy_cluster(int gpus, int nodes, const sim::P2pModel& p = {}) {
  sim::ClusterModel m;
  m.name = "toy";
  m.gpu = {"toy-gpu", 100e12, 50e12, 20e12, 80e9, 2e12, "test"};
  m.node.name = "toy-node";
  m.node.gpu = "toy-gpu";
  m.node.gpus = gpus;
  m.node.intra = "nvswitch";
  m.node.nvlink_bw = 300e9;
  m.node.nvlink_latency = 3e-6;
  m.node.pcie_latency = 3e-6;
  m.node.nics = nodes > 1 ? gpus : 0;
  m.node.nic_bw = 25e9;
  m.node.nic_latency = 5e-6;
  m.node.host_memory_bytes = 1e12;
  m.node.host_copy_bw = 24e9;
  m.node.p2p = p;
  m.nodes = nodes;
  m.fabric_latency = 0.5e-6;
  m.efficiency.launch_latency = 0;
  return m;
}

}  // namespace moelab::test
