// harness/comm/communicator.hpp — one interface for every collective moelab issues.
//
// Implementations: SelfCommunicator (a world of one rank, any backend), MpiCommunicator
// (Open MPI, host buffers, for the cpu backend), NcclCommunicator (device buffers, cuda
// backend; its unique id is broadcast over MPI). The sim backend brings its own.
//
// Data-plane calls are stream-ordered like every other op: they are issued on a stream and
// complete in that stream's order. Control-plane calls (barrier, exchange_counts, the host
// all-reduces) block the host and are meant for small metadata.
//
// One communicator must be used from one stream at a time (all ranks must issue its calls in
// the same order). To let two collectives overlap — MPipeMoE's dispatch and combine, say —
// give each its own communicator with dup().
//
// Groups: split() carves a communicator into disjoint sub-communicators with MPI_Comm_split's
// semantics (MPI 4.0, section 7.4.2): the ranks passing the same color form one, ordered by
// key and then by their rank in the parent. Ranks and peers are always numbered within the
// communicator; world_ranks() translates them to the world (for the topology, node placement
// and reports). harness/comm/groups.hpp builds the TP/PP/DP/EP groups of a layout this way.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "harness/runtime/backend.hpp"

namespace moelab {

// A contiguous run of `count` elements at element `offset` of a buffer, to or from `peer`.
// Segments between the same pair of ranks are matched in the order they are listed.
struct Segment {
  int peer = 0;
  std::int64_t offset = 0;
  std::int64_t count = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string kind() const = 0;  // "self", "mpi", "nccl", "sim"
  // An independent channel over the same ranks (collective: every rank must call it).
  virtual std::unique_ptr<Communicator> dup() = 0;
  // Collective over this communicator (every rank calls it, in the same order as its other
  // control-plane calls): the ranks with the same color >= 0 form a new communicator, ranked
  // by key, ties by rank here. color < 0 (MPI_UNDEFINED): this rank joins none, nullptr.
  // Like dup(), a setup call: not while this communicator's data plane is busy on a stream
  // (NCCL communicators are not thread-safe). The default throws Unsupported (a test double
  // that never splits).
  virtual std::unique_ptr<Communicator> split(int color, int key);
  // The world rank of each member, indexed by rank in this communicator. The default is the
  // identity over size(): right for a world communicator.
  virtual std::vector<int> world_ranks() const;
  int world_rank(int rank) const;  // world_ranks()[rank]

  // ---- data plane (stream-ordered) -----------------------------------------------------
  // All-to-all-v: send's segments go to their peers, recv's segments are filled from theirs.
  // Element type is the tensors' dtype (send and recv must agree).
  virtual void all_to_all_v(Stream& s, const Tensor& send, std::span<const Segment> sends, Tensor& recv,
                            std::span<const Segment> recvs) = 0;
  // recv = concatenation over ranks of send (recv.numel == size * send.numel).
  virtual void all_gather(Stream& s, const Tensor& send, Tensor& recv) = 0;
  // recv = this rank's slice of the element-wise sum over ranks (send.numel == size * recv.numel).
  // recv may be this rank's slice of send itself (send.rows(rank * n, n): in place, as NCCL
  // allows it); send's other slices are then left undefined.
  virtual void reduce_scatter(Stream& s, const Tensor& send, Tensor& recv) = 0;
  // buf = element-wise sum over ranks, in place.
  virtual void all_reduce(Stream& s, Tensor& buf) = 0;
  virtual void send(Stream& s, const Tensor& t, int peer) = 0;
  virtual void recv(Stream& s, Tensor& t, int peer) = 0;

  // ---- control plane (blocking, host values) -------------------------------------------
  virtual void barrier() = 0;
  // All-to-all of equal blocks of int64: send has size()*c values (block p for rank p); the
  // result has size()*c values (block p from rank p).
  virtual std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& send) = 0;
  virtual double all_reduce_max(double v) = 0;
  virtual double all_reduce_sum(double v) = 0;
  // Gather a string from every rank to all (used to agree on device names, errors, ...).
  virtual std::vector<std::string> all_gather_strings(const std::string& s) = 0;
};

// Bytes this rank sends to other ranks (self excluded) for an all_to_all_v: the comm_bytes
// of its cost descriptor.
double segments_bytes_to_others(std::span<const Segment> sends, int self, DType dtype);

// A rank's rows to itself as device copies: sends[i] pairs with recvs[i] (equal counts, none
// empty), and pairs that continue the previous one on both sides join its copy (an MoE layer's
// per-expert segments in the packed layout are one run: one copy, not one per local expert).
// Offsets and counts in elements, in the segments' order.
struct SelfCopy {
  std::int64_t from = 0, to = 0, count = 0;
};
std::vector<SelfCopy> self_copies(std::span<const Segment* const> sends, std::span<const Segment* const> recvs);

// split()'s membership rule, for implementations that compute it themselves: given every
// rank's (color, key) by rank, the ranks that share `color`, ordered by key then rank.
std::vector<int> split_members(std::span<const std::pair<int, int>> color_key, int color);

// A world of one rank: every collective is a local copy on the backend.
std::unique_ptr<Communicator> make_self_communicator(Backend& backend);

}  // namespace moelab
