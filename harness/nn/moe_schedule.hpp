// harness/nn/moe_schedule.hpp — chunked schedules of the MoE layer: a chunk plan (which rows
// each chunk of the dispatch sends and receives) and the one issuer that runs a plan as
// dispatch / experts / combine steps on three streams with the events between them.
//
// A chunk is a piece of the all-to-all: FastMoE is one chunk; FasterMoE's smart schedule
// (He et al., PPoPP'22, §4) a chunk per group-wise step; MPipeMoE (Zhang et al., IPDPS'23,
// §III-A) a chunk per token partition. Only the planners differ: every one of them is run by
// issue_forward / issue_backward here, with the layer's public steps (moe_layer.hpp).
//
// Notation as in moe_layer.hpp: T tokens, M d_model, H d_hidden, El local experts, N rows of
// T_I (kept token-slots of this rank), R_c rows chunk c brings to this rank's experts.
//   ctest --test-dir build -R "moe_layer|fastermoe|mpipemoe"
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

class MoELayer;
struct MoESaved;

// One chunk of the dispatch. Its combine is the same exchange reversed: T_DO_c rows go back
// to the T_O rows its dispatch read from T_I.
struct Chunk {
  std::vector<Segment> sends;        // T_I -> each (peer, peer's local expert)
  std::vector<Segment> recvs;        // T_DI_c <- each (peer, my local expert)
  std::vector<std::int64_t> rows;    // [El] rows of each local expert in T_DI_c
  std::vector<std::int64_t> offset;  // [El] first row of each local expert in T_DI_c
  std::int64_t R = 0;                // rows of T_DI_c
};

// A communication stream and the communicator used from it (one communicator per stream).
struct Lane {
  Stream* stream = nullptr;
  Communicator* comm = nullptr;
};

// How a schedule issues its chunks. Issue order, forward (backward mirrors it with the
// combine exchange first): the dispatch of chunk i + lookahead, the experts of chunk i, the
// combine of chunk i, for i = 0, 1, ...
struct ChunkPlan {
  std::vector<Chunk> chunks;
  Lane dispatch;                 // each chunk's dispatch (forward) / dispatch backward
  Lane combine;                  // each chunk's combine (forward) / combine backward
  int lookahead = 0;             // FasterMoE: 1 (S_{i+1} is queued before C_i)
  // One chunk in flight (FastMoE): each buffer is made just before the step that writes it and
  // released once the compute stream has waited for its last reader. Otherwise (pipelined) the
  // other streams run ahead of the compute stream, so every buffer they touch is made before
  // the pipeline starts and released when it has ended.
  bool one_in_flight = false;
  // The layer's output (y forward, dx backward) made with the buffers, before the pipeline
  // (FasterMoE's implementation does so), rather than after it.
  bool output_first = false;
  bool skip_empty = false;       // no experts step for a chunk without rows (FasterMoE)
};

// The chunk that exchanges T_I rows with the peers `to` and T_DI rows with the peers `from`
// (FastMoE: both every rank; FasterMoE: the target and the source group of a step). Counts are
// per (peer, local expert of the receiver): sent[p*El + l] rows of T_I for local expert l of
// rank p (T_I is expert-major, hence destination-rank-major), recv[p*El + l] rows rank p sends
// to my local expert l. Segments are listed per peer in local-expert order on both sides so
// that they match; T_DI_c is local-expert-major, sources in the order of `from` within an expert.
Chunk peer_chunk(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv, std::int64_t El,
                 std::int64_t M, std::span<const int> to, std::span<const int> from);

}  // namespace moelab
