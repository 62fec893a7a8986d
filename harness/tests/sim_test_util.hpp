// harness/tests/sim_test_util.hpp — a toy cluster model for the sim backend's closed-form tests
// (sim_backend_test, sim_alltoall_test, sim_host_test): round figures and no launch latency, so
// that an op's time is its work and the terms under test alone.
#pragma once

#include "harness/sim/cluster.hpp"

namespace moelab::test {

// One node of n GPUs on an NVSwitch of per-port bandwidth bw (bytes/s) and latency lat; or
// `nodes` such nodes joined by one NIC per GPU.
inline sim::ClusterModel toy_cluster(int gpus, double bw, double lat, int nodes = 1, double nic_bw = 0,
                                     double nic_lat = 0) {
  sim::ClusterModel m;
  m.name = "toy";
  m.gpu = {"toy-gpu", 100e12, 50e12, 20e12, 80e9, 2e12, "test"};
  m.node.name = "toy-node";
  m.node.gpu = "toy-gpu";
  m.node.gpus = gpus;
  m.node.intra = "nvswitch";
  m.node.nvlink_bw = bw;
  m.node.nvlink_latency = lat;
  m.node.nics = nodes > 1 ? gpus : 0;
  m.node.nic_bw = nic_bw;
  m.node.nic_latency = nic_lat;
  m.node.host_memory_bytes = 1e12;
  m.node.host_copy_bw = 25e9;
  m.nodes = nodes;
  m.efficiency.launch_latency = 0;  // analytic cases: no launch overhead
  return m;
}

}  // namespace moelab::test
