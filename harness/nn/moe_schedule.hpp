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
#include <functional>
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
  // > 0: the padded layout (MoELayer::set_expert_layout): local expert l's rows start at l·stride,
  // R = El·stride, and every buffer of the chunk keeps its rows past an expert's own zero, so
  // that its GEMMs may run as one strided batch over `stride` rows per expert
  // (GemmProblem::token_stride). 0: packed, expert l's rows right after expert l-1's.
  std::int64_t stride = 0;
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
  // One chunk in flight (FastMoE): each buffer is made just before the step that writes it.
  // Otherwise (pipelined) the other streams run ahead of the compute stream, so every buffer
  // they touch is made before the pipeline starts (issue_forward has the whole rule).
  bool one_in_flight = false;
  // The layer's output (y forward, dx backward) made with the buffers, before the pipeline
  // (FasterMoE's implementation does so), rather than after it.
  bool output_first = false;
  bool skip_empty = false;       // no experts step for a chunk without rows (FasterMoE)
  // Every first exchange issued, then every experts step, then every second exchange
  // (lookahead is not used): FasterMoE as published issues its S, C and R loops so
  // (laekov/fastmoe v1.0.0 cuda/fastermoe/smart_schedule.h:139-229).
  bool phased = false;
  // Chunks in groups of this many (phased only): the experts of a group's chunks wait for the
  // group's last first exchange, its second exchanges for the group's last experts step (one
  // event per group, as FasterMoE's input_ready / output_ready per step).
  int group = 1;
  // The host waits for an exchange's stream after every exchange (MoELayer::host_wait), as
  // FastMoE's global_scatter / global_gather do (smgr->sync(1)).
  bool host_wait_exchanges = false;
  // The experts write a temporary that is then copied into the chunk's buffer (forward: T_DO_c;
  // backward: dT_DI_c), as FasterMoE's per-step callbacks do (y.copy_(y0), grad_x.copy_(x.grad)).
  bool copy_expert_outputs = false;
};

// The chunk that exchanges T_I rows with the peers `to` and T_DI rows with the peers `from`
// (FastMoE: both every rank; FasterMoE: the target and the source group of a step). Counts are
// per (peer, local expert of the receiver): sent[p*El + l] rows of T_I for local expert l of
// rank p (T_I is expert-major, hence destination-rank-major), recv[p*El + l] rows rank p sends
// to my local expert l. Segments are listed per peer in local-expert order on both sides so
// that they match; T_DI_c is local-expert-major, sources in the order of `from` within an expert.
// stride > 0: the padded layout (Chunk::stride), at least the rows of every local expert.
Chunk peer_chunk(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv, std::int64_t El,
                 std::int64_t M, std::span<const int> to, std::span<const int> from, std::int64_t stride = 0);

// The padded layout's stride for local experts of `rows` rows: the busiest one's rows, or 0
// (packed) when the padding, 1 - sum(rows) / (El · stride), is above max_waste or no expert
// has a row.
std::int64_t padded_stride(const std::vector<std::int64_t>& rows, double max_waste);

// Tutel's pipelined all-to-all (Hwang et al., "Tutel: Adaptive Mixture-of-Experts at Scale",
// MLSys'23, §3.3): one chunk's exchange cut into r chunks, chunk c taking rows
// [n·c/r, n·(c+1)/r) of every (peer, expert) segment of n rows. Sender and receiver cut the same
// n the same way, so no counts are exchanged again; each piece's T_DI_c is local-expert-major
// as the whole one is, and its sends are runs of the same T_I rows (no copy). `whole` must list
// its segments as peer_chunk does (per peer, local experts in order); El local experts, M row
// width. r = 1 gives `whole` back.
std::vector<Chunk> split_chunk(const Chunk& whole, std::int64_t El, std::int64_t M, int r);

// ---- issuing a plan ------------------------------------------------------------------------
// One chunk's tensors in a pass (rows R_c; views when a schedule reuses buffers).
struct ChunkTensors {
  Tensor t_di;             // [R_c,M] T_DI_c, saved for backward
  Tensor t_m;              // [R_c,H] T_M_c, saved for backward
  Tensor t_do;             // [R_c,M] forward: T_DO_c
  Tensor d_t_do, d_t_di;   // [R_c,M] backward: dT_DO_c, dT_DI_c
};

// Events reused from pass to pass. A queued wait keeps the generation of the event it waited
// for (CUDA semantics), so re-recording one never disturbs an earlier wait, and several
// microbatches' passes may share a pool.
class EventPool {
 public:
  explicit EventPool(Backend& b) : b_(b) {}
  void reset() { next_ = 0; }  // at the start of a pass
  Event* mark(Stream& s);      // an event recorded on s now
  void after(Stream& s, Event* e) {  // s waits for e (nothing for nullptr)
    if (e) b_.wait(s, *e);
  }
  void order(Stream& from, Stream& to) { after(to, mark(from)); }  // to waits for all of from so far

 private:
  Backend& b_;
  std::vector<std::unique_ptr<Event>> events_;
  std::size_t next_ = 0;
};

// The steps of a chunk, forward; in backward the same names stand for their mirrors (combine
// backward first, dispatch backward last).
enum class ChunkStep { dispatch, experts, combine };

// Per chunk, the events the issuer records: `in` the first exchange done (forward: dispatch;
// backward: combine backward), `computed` the experts done, `out` the second exchange done.
struct ChunkEvents {
  std::vector<Event*> in, computed, out;
  static Event* at(const std::vector<Event*>& v, int i) { return i >= 0 ? v[static_cast<std::size_t>(i)] : nullptr; }
};

// What a schedule adds to the issuer (MPipeMoE's memory reuse and restore strategies): its own
// buffers, the streams that wait for them, and work and waits around the steps.
class ChunkHooks {
 public:
  virtual ~ChunkHooks() = default;
  virtual void allocate() = 0;                  // on the compute stream, before the pipeline starts
  virtual ChunkTensors tensors(int chunk) = 0;  // views of them for a chunk
  virtual std::vector<Stream*> ready() { return {}; }  // more streams that wait for the buffers
  // The pass's output buffer once made, before the pipeline starts: T_O forward, dT_I backward
  // (for work a schedule adds on the rows its exchanges write there).
  virtual void output(const Tensor&) {}
  virtual void start(const ChunkEvents&) {}            // after that, before the first step
  virtual void before(ChunkStep, int, const ChunkEvents&) {}
  virtual void after(ChunkStep, int, const ChunkEvents&) {}
  virtual std::vector<Stream*> join() { return {}; }   // more streams the compute stream waits for at the end
  virtual void finish() {}                              // then: the pass's own buffers may go
};

// The buffers a pass made, handed back: the schedule decides when they go (MoELayer::run_forward).
struct PassBuffers {
  std::vector<ChunkTensors> chunks;  // per chunk: T_DO_c (forward); dT_DO_c, dT_DI_c (backward)
  Tensor d_t_i;                      // [N,M] backward: dT_I
  // A detached pass (PassPlacement::detach): its last exchange, which the compute stream has not
  // waited for. The caller waits for it before it reads the pass's output and before these
  // buffers go. An event of the layer's pool: valid until the layer's next pass starts.
  Event* done = nullptr;
};

// Compute of the caller's placed among a pass's steps (ScMoE's overlap schedule, Cai et al.,
// arXiv 2404.05019, §4: the routed experts in a chosen slot of the main stream, the all-to-alls
// beside it). `slot` is called once the plan's lead exchanges (ChunkPlan::lookahead of them) are
// issued and before the first experts step waits for its exchange: what it issues on the
// compute stream runs while those exchanges are in flight. With `detach` the pass ends without
// the compute stream waiting for its last exchange (PassBuffers::done), so the caller can issue
// more compute beside it. Not for schedules with hooks.
struct PassPlacement {
  std::function<void()> slot;
  bool detach = false;
};

// Runs sv.plan forward: for every chunk its dispatch (T_I -> T_DI_c, on the plan's dispatch
// lane), experts (compute stream) and combine (T_DO_c -> T_O rows, combine lane), in the plan's
// order, each step waiting for the one it reads from; the compute stream waits for the last
// exchanges at the end. Fills sv.t_o [N,M] and, unless hooks supply the buffers, sv.kept.
PassBuffers issue_forward(MoELayer& layer, MoESaved& sv, const Tensor& t_i, ChunkHooks* hooks = nullptr,
                          const PassPlacement* place = nullptr);
// The mirror: dT_O [N,M] -> per chunk combine backward (dT_O rows -> dT_DO_c), experts backward
// (-> dT_DI_c; with defer, the weight-gradient GEMMs left in sv), dispatch backward (dT_DI_c ->
// dT_I rows). One chunk in flight, d_t_o is released once sent.
PassBuffers issue_backward(MoELayer& layer, MoESaved& sv, Tensor& d_t_o, bool defer, ChunkHooks* hooks = nullptr,
                           const PassPlacement* place = nullptr);

}  // namespace moelab
