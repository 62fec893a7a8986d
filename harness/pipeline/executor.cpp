// harness/pipeline/executor.cpp — this rank's stage of a pipeline running a schedule's node
// list. See executor.hpp.
//   ctest --test-dir build -R 'pipeline_(sim|mpi)'
#include "harness/pipeline/executor.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include "harness/runtime/error.hpp"

namespace moelab::pipeline {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "full") return Recompute::full;
  if (s == "selective") return Recompute::selective;
  throw ConfigError("--recompute \"" + s + "\": expected none, selective or full");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::full: return "full";
    case Recompute::selective: return "selective";
  }
  return "?";
}

LayerRange virtual_stage_layers(const TransformerConfig& cfg, int virtual_stages, int vstage, bool pad) {
  const int L = cfg.num_layers, V = virtual_stages;
  if (V < 1 || (!pad && L % V != 0))
    throw ConfigError(cfg.origin + ": num_layers = " + std::to_string(L) + " is not divisible by the " +
                      std::to_string(V) +
                      " virtual stages (pp x chunks): every virtual stage holds as many layers (Megatron's rule; "
                      "--pad-layers splits unevenly)");
  const int per = (L + V - 1) / V, short_by = per * V - L;
  // One layer fewer on the virtual stages V-1, 0, 1, ..., short_by-2 (the authors' get_offset).
  auto size = [&](int v) {
    const bool fewer = short_by > 0 && (v == V - 1 || v < short_by - 1);
    return per - (fewer ? 1 : 0);
  };
  if (short_by > V)
    throw ConfigError(cfg.origin + ": num_layers = " + std::to_string(L) + " is too few for " + std::to_string(V) +
                      " virtual stages (pp x chunks), even split unevenly");
  int first = 0;
  for (int v = 0; v < vstage; ++v) first += size(v);
  const LayerRange r{first, first + size(vstage)};
  if (r.first == r.last && vstage != 0 && vstage != V - 1)
    throw ConfigError(cfg.origin + ": num_layers = " + std::to_string(L) + " split unevenly over " + std::to_string(V) +
                      " virtual stages (pp x chunks) leaves virtual stage " + std::to_string(vstage) +
                      " with no layer and neither the embedding nor the head");
  return r;
}

void check_pipeline(const TransformerConfig& cfg, const Schedule& s, bool pad) {
  for (int v = 0; v < s.virtual_stages(); ++v) virtual_stage_layers(cfg, s.virtual_stages(), v, pad);
}

std::string node_label(const Node& n) {
  static const char* kShort[] = {"F", "B", "W", "SA", "RA", "SG", "RG", "OFF", "RL", "OPT"};
  if (n.kind == NodeKind::optimizer) return "OPT";
  return std::string(kShort[static_cast<int>(n.kind)]) + std::to_string(n.microbatch) + "." + std::to_string(n.chunk);
}

std::string label_kind(const std::string& label) {
  std::size_t i = 0;
  while (i < label.size() && std::isalpha(static_cast<unsigned char>(label[i]))) ++i;
  return label.substr(0, i);
}

// One (microbatch, chunk) on this stage between its receive and its W.
struct PipelineStage::Slot {
  Tensor input;            // [T,M] received (or ids / the local hand-over), held for recompute
  Event* input_ready = nullptr;
  Forwarded fw;            // the chunk's saved state
  Tensor out;              // [T,M] F's output until sent or handed over
  Tensor dy;               // [T,M] received output gradient
  Event* dy_ready = nullptr;
  Tensor dx;               // [T,M] B's input gradient until sent or handed over
  // Offloading: what the forward allocated (weakly), what is on the host, and the copies' events.
  std::vector<std::weak_ptr<Storage>> made;
  std::weak_ptr<Storage> input_storage;  // the received or handed-over input, saved by the first block
  std::vector<std::shared_ptr<Storage>> away;
  std::size_t away_bytes = 0;
  Event* offloaded = nullptr;
  Event* reloaded = nullptr;
};

namespace {
// Colour of a sending stage: neighbours around the ring of p stages get different colours
// (2 for even p, 3 for odd p > 1), so a rank's send and receive of one kind and direction use
// different communicators.
int colour(int stage, int p) { return p % 2 == 0 || stage != p - 1 || p == 1 ? stage % 2 : 2; }
int colours(int p) { return p % 2 == 0 ? 2 : p == 1 ? 1 : 3; }
bool up(int from, int to, int p) { return (from + 1) % p == to; }
}  // namespace

PipelineStage::PipelineStage(Backend& b, const TransformerConfig& cfg, const Schedule& s, Communicator& pp,
                             Communicator& ep, const PipelineOptions& opt)
    : b_(b), cfg_(cfg), s_(s), pp_(pp), opt_(opt), stage_(pp.rank()), events_(b) {
  if (pp.size() != s.stages)
    throw ConfigError("schedule " + s.name + " has " + std::to_string(s.stages) + " stages, the pipeline group " +
                      std::to_string(pp.size()) + " ranks");
  if (opt.tokens < 1) throw ConfigError("pipeline: tokens per microbatch = " + std::to_string(opt.tokens) + " must be positive");
  analysis_ = validate(s);
  check_pipeline(cfg, s, opt.pad_layers);
  offloaded_.assign(static_cast<std::size_t>(s.microbatches * s.chunks), 0);
  for (const Node& n : s.nodes[static_cast<std::size_t>(stage_)])
    if (n.kind == NodeKind::offload) offloaded_[static_cast<std::size_t>(n.microbatch * s.chunks + n.chunk)] = 1;
  const bool offloads = std::any_of(offloaded_.begin(), offloaded_.end(), [](char c) { return c != 0; });
  if (offloads && opt.recompute == Recompute::full)
    throw ConfigError("schedule " + s.name + ": activation offloading with --recompute full (full recomputation keeps "
                      "only each chunk's input; offload what it would recompute, or recompute, not both)");
  if (offloads) {
    d2h_ = &b.create_stream(StreamRole::d2h, "offload_d2h");
    h2d_ = &b.create_stream(StreamRole::h2d, "offload_h2d");
  }
  host_capacity_ = opt.host_capacity_bytes > 0 ? opt.host_capacity_bytes
                                                : b.machine_rates(1, 1, 1, cfg.dtype).host_memory_bytes;
  for (int c = 0; c < s.chunks; ++c) {
    const LayerRange r = virtual_stage_layers(cfg, s.virtual_stages(), s.virtual_stage(stage_, c), opt.pad_layers);
    ModelOptions mo = opt.model;
    mo.allow_empty_range = opt.pad_layers;
    const int vs = s.virtual_stage(stage_, c);
    mo.without_embedding = vs != 0;
    mo.without_head = vs != s.virtual_stages() - 1;
    mo.first_layer = r.first;
    mo.last_layer = r.last;
    mo.tied_embedding_copy = true;
    mo.recompute_norms = opt.recompute == Recompute::selective;
    chunks_.push_back(std::make_unique<Model>(b, ep, cfg, mo));
  }
  // One communicator per (kind, direction, sender colour) that the schedule uses, duplicated
  // by every stage in the same order.
  const int p = s.stages;
  std::vector<std::tuple<int, int>> used;
  for (int st = 0; st < p; ++st)
    for (const Node& n : s.nodes[static_cast<std::size_t>(st)]) {
      if (n.kind != NodeKind::send_act && n.kind != NodeKind::send_grad) continue;
      const int vs = s.virtual_stage(st, n.chunk);
      const int to = s.place(n.kind == NodeKind::send_act ? vs + 1 : vs - 1).first;
      const std::tuple<int, int> k{n.kind == NodeKind::send_grad ? 1 : 0, up(st, to, p) ? 1 : 0};
      if (std::find(used.begin(), used.end(), k) == used.end()) used.push_back(k);
    }
  std::sort(used.begin(), used.end());
  for (const auto& [grad, dir] : used)
    for (int c = 0; c < colours(p); ++c) comms_[{grad, dir, c}] = pp.dup();
  // The embedding group: the stages of the first and the last virtual stage.
  const int first_stage = s.place(0).first, last_stage = s.place(s.virtual_stages() - 1).first;
  if (cfg.tie_embeddings && first_stage != last_stage) {
    const bool member = stage_ == first_stage || stage_ == last_stage;
    embedding_group_ = pp.split(member ? 0 : -1, stage_);
  }
  slots_.resize(static_cast<std::size_t>(s.microbatches * s.chunks));
}

PipelineStage::~PipelineStage() = default;

std::vector<Model*> PipelineStage::chunks() {
  std::vector<Model*> v;
  for (auto& c : chunks_) v.push_back(c.get());
  return v;
}

bool PipelineStage::has_embedding() const {
  return std::any_of(chunks_.begin(), chunks_.end(), [](const auto& c) { return c->has_embedding(); });
}
bool PipelineStage::has_head() const {
  return std::any_of(chunks_.begin(), chunks_.end(), [](const auto& c) { return c->has_head(); });
}

std::vector<Param> PipelineStage::parameters() {
  std::vector<Param> v;
  for (auto& c : chunks_)
    for (auto& p : c->parameters()) v.push_back(p);
  return v;
}

std::vector<const Stream*> PipelineStage::transfer_streams() const {
  std::vector<const Stream*> v;
  for (const auto& [k, ch] : channels_) v.push_back(ch.stream);
  return v;
}

PipelineStage::Channel& PipelineStage::channel(bool gradient, bool send, int peer) {
  const std::tuple<int, int, int> key{gradient ? 1 : 0, send ? 1 : 0, peer};
  auto it = channels_.find(key);
  if (it != channels_.end()) return it->second;
  const int p = s_.stages, from = send ? stage_ : peer, to = send ? peer : stage_;
  Channel ch;
  ch.comm = comms_.at({gradient ? 1 : 0, up(from, to, p) ? 1 : 0, colour(from, p)}).get();
  ch.peer = peer;
  const std::string name = std::string("pp_") + (send ? "send_" : "recv_") + (gradient ? "grad_" : "act_") +
                           (send ? "to" : "from") + std::to_string(peer);
  ch.stream = &b_.create_stream(StreamRole::aux, name);
  return channels_.emplace(key, ch).first->second;
}

void PipelineStage::init_parameters(std::uint64_t seed) {
  for (auto& c : chunks_) c->init_parameters(seed);
  sync_tied(true);
}

void PipelineStage::set_gradient_sync(Communicator* dp, Communicator* edp) {
  dp_ = dp;
  edp_ = edp;
}

// The copies of tied word embeddings on this stage (one per chunk holding the embedding or the
// head's copy) made equal: values (the copy starts at zero, so a sum is the embedding) or
// gradients (each copy's share summed).
void PipelineStage::sync_tied(bool values) {
  if (!cfg_.tie_embeddings) return;
  std::vector<Param> held;
  for (auto& c : chunks_)
    for (auto& p : c->parameters())
      if (p.name == "embedding.wte") held.push_back(p);
  if (held.size() < 2 && !embedding_group_) return;
  Stream& s = stream();
  auto pick = [&](Param& p) -> Tensor& { return values ? p.value : p.grad; };
  if (held.size() == 2) b_.add(s, pick(held[0]), pick(held[1]), pick(held[0]));
  if (embedding_group_ && !held.empty()) embedding_group_->all_reduce(s, pick(held[0]));
  if (held.size() == 2) b_.copy(s, pick(held[0]), pick(held[1]));
}

void PipelineStage::use_bucketed_sync(const GradSyncOptions& opt) {
  if (!dp_ || !edp_) throw std::logic_error("PipelineStage::use_bucketed_sync before set_gradient_sync");
  if (opt.zero1 && embedding_group_)
    throw ConfigError("ZeRO-1 with tie_embeddings and the embedding and the LM head on different pipeline stages is "
                      "not supported (the embedding group would sum a sharded gradient); untie them or drop ZeRO-1");
  // Both copies on this stage (two chunks of an interleaved or V schedule): with dp > 1 each
  // chunk's synchroniser reduce-scatters its own copy's gradient into its own shard, which the
  // tied sum (on the full gradients, after) would never reach.
  if (opt.zero1 && cfg_.tie_embeddings && dp_->size() > 1) {
    int copies = 0;
    for (auto& c : chunks_)
      for (auto& p : c->parameters()) copies += p.name == "embedding.wte";
    if (copies > 1)
      throw ConfigError("ZeRO-1 with tie_embeddings and the embedding and the LM head in different chunks of pipeline "
                        "stage " + std::to_string(stage_) + " is not supported (each chunk's optimizer would update its "
                        "copy from its own shard of one copy's gradient); untie them or drop ZeRO-1");
  }
  syncs_.clear();
  for (auto& c : chunks_) {
    syncs_.push_back(std::make_unique<GradSync>(b_, stream(), c->param_slots(), *dp_, *edp_, c->tensor_parallel(), opt));
    c->set_grad_sync(syncs_.back().get());
  }
  last_w_.assign(chunks_.size(), -1);
  const auto& nodes = s_.nodes[static_cast<std::size_t>(stage_)];
  for (int pos = 0; pos < static_cast<int>(nodes.size()); ++pos)
    if (nodes[static_cast<std::size_t>(pos)].kind == NodeKind::backward_weight)
      last_w_[static_cast<std::size_t>(nodes[static_cast<std::size_t>(pos)].chunk)] = pos;
}

void PipelineStage::make_optimizer(const OptimizerConfig& oc) {
  optimizers_.clear();
  if (syncs_.empty()) {
    optimizers_.push_back(std::make_unique<Optimizer>(b_, stream(), parameters(), oc));
  } else {
    for (auto& sync : syncs_) optimizers_.push_back(std::make_unique<Optimizer>(b_, stream(), *sync, oc));
  }
}

// The one place gradients are summed across ranks before the optimizer step.
void PipelineStage::sync_gradients() {
  PhaseScope ph(b_, "grad_sync");
  if (!syncs_.empty()) {
    // The buckets were issued during the last W passes; the rest now, then the embedding
    // group's sum (sums commute: DP first, then the two copies, gives the same total).
    for (auto& sync : syncs_) sync->finish();
    sync_tied(false);
    return;
  }
  sync_tied(false);
  // Always: besides the DP and expert-DP sums, the chunks complete their TP-partial gradients
  // and average the experts' TP copies (Model::all_reduce_gradients), which tensor parallelism
  // needs at dp = 1.
  if (dp_)
    for (auto& c : chunks_) c->all_reduce_gradients(*dp_, edp_);
}

void PipelineStage::step(const std::vector<Batch>& data, std::uint64_t step) {
  if (static_cast<int>(data.size()) != s_.microbatches)
    throw ConfigError("pipeline step: " + std::to_string(data.size()) + " batches for " + std::to_string(s_.microbatches) +
                      " microbatches");
  for (auto& c : chunks_) c->zero_grad();
  events_.reset();
  losses_.assign(has_head() ? static_cast<std::size_t>(s_.microbatches) : 0, Tensor());
  for (auto& sl : slots_) sl = std::make_unique<Slot>();
  offload_stats_ = OffloadStats{};
  offload_stats_.chunk_bytes.assign(static_cast<std::size_t>(s_.chunks), 0);
  host_bytes_ = 0;
  const auto& nodes = s_.nodes[static_cast<std::size_t>(stage_)];
  for (int pos = 0; pos < static_cast<int>(nodes.size()); ++pos) {
    run_node(pos, nodes[static_cast<std::size_t>(pos)], data, step);
    // Sends the schedule now shows received: the compute stream orders itself after them and
    // lets their tensors go.
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (analysis_.send_done_at[static_cast<std::size_t>(stage_)][static_cast<std::size_t>(it->first)] == pos) {
        b_.wait(stream(), *it->second.done);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [pos, ps] : pending_) b_.wait(stream(), *ps.done);
  pending_.clear();
  for (auto& sl : slots_) sl.reset();
}

void PipelineStage::run_node(int pos, const Node& n, const std::vector<Batch>& data, std::uint64_t step) {
  NodeScope label(b_, node_label(n));
  Stream& compute = stream();
  if (n.kind == NodeKind::optimizer) {
    sync_gradients();
    if (!optimizers_.empty())
      for (auto& o : optimizers_) o->step();
    else if (optimizer_)
      optimizer_->step();
    return;
  }
  const int V = s_.virtual_stages(), vs = s_.virtual_stage(stage_, n.chunk), mb = n.microbatch;
  auto slot = [&](int chunk) -> Slot& { return *slots_[static_cast<std::size_t>(mb * s_.chunks + chunk)]; };
  Slot& x = slot(n.chunk);
  Model& model = *chunks_[static_cast<std::size_t>(n.chunk)];
  const auto [prev_stage, prev_chunk] = vs > 0 ? s_.place(vs - 1) : std::pair{-1, -1};
  const auto [next_stage, next_chunk] = vs + 1 < V ? s_.place(vs + 1) : std::pair{-1, -1};
  const Batch& d = data[static_cast<std::size_t>(mb)];
  auto batch_for = [&](const Tensor& input) {
    Batch bt;
    bt.input = input;
    if (model.has_head()) bt.targets = d.targets;
    bt.loss_scale = d.loss_scale;
    return bt;
  };
  // [T,M] ([T/tp,M] under sequence parallelism) in the model dtype, allocated on the compute stream for microbatch mb; the transfer
  // stream waits for the allocation.
  auto receive = [&](bool gradient, int peer, Event*& ready) {
    Tensor buf;
    {
      MicrobatchScope m(b_, mb);
      // Under sequence parallelism the residual stream between stages is the rank's T/tp rows
      // (Korthikanti et al. 2022 §4.2.2; Megatron sends the [s/t, b, h] shard between stages).
      const bool sp = opt_.model.sequence_parallel && opt_.model.tp && opt_.model.tp->size() > 1;
      const std::int64_t rows = sp ? opt_.tokens / opt_.model.tp->size() : opt_.tokens;
      buf = b_.empty({rows, cfg_.d_model}, cfg_.dtype, gradient ? MemCategory::buffers : MemCategory::activations,
                     compute);
    }
    Channel& ch = channel(gradient, false, peer);
    events_.order(compute, *ch.stream);
    ch.comm->recv(*ch.stream, buf, ch.peer);
    ready = events_.mark(*ch.stream);
    return buf;
  };
  auto send = [&](bool gradient, int peer, Tensor& t) {
    Channel& ch = channel(gradient, true, peer);
    events_.order(compute, *ch.stream);
    ch.comm->send(*ch.stream, t, ch.peer);
    pending_[pos] = {std::move(t), events_.mark(*ch.stream)};
    t = Tensor();
  };

  switch (n.kind) {
    case NodeKind::recv_act: x.input = receive(false, prev_stage, x.input_ready); break;
    case NodeKind::recv_grad: x.dy = receive(true, next_stage, x.dy_ready); break;
    case NodeKind::forward: {
      if (vs == 0) {
        x.input = d.input;
      } else if (prev_stage == stage_) {
        x.input = std::move(slot(prev_chunk).out);  // the V's turn: handed over on this stage
        slot(prev_chunk).out = Tensor();
      } else {
        events_.after(compute, x.input_ready);
      }
      const bool offload = offloaded_[static_cast<std::size_t>(mb * s_.chunks + n.chunk)] != 0;
      if (offload) {
        if (vs > 0) x.input_storage = x.input.storage();
        b_.start_capture();
      }
      try {
        x.fw = model.forward(batch_for(x.input), {0, mb, step});
      } catch (...) {
        if (offload) b_.stop_capture();
        throw;
      }
      if (offload) x.made = b_.stop_capture();
      if (model.has_head()) losses_[static_cast<std::size_t>(mb)] = x.fw.y;
      else x.out = x.fw.y;
      x.fw.y = Tensor();
      // Full recomputation keeps only the chunk's input (Chen et al. 2016).
      if (opt_.recompute == Recompute::full) x.fw.saved.reset();
      else x.input = Tensor();
      break;
    }
    case NodeKind::send_act: send(false, next_stage, x.out); break;
    case NodeKind::backward_input: {
      Tensor dy;
      if (vs + 1 < V) {
        if (next_stage == stage_) {
          dy = std::move(slot(next_chunk).dx);
          slot(next_chunk).dx = Tensor();
        } else {
          events_.after(compute, x.dy_ready);
          dy = std::move(x.dy);
          x.dy = Tensor();
        }
      }
      if (x.reloaded) events_.after(compute, x.reloaded);  // the saved activations are back
      if (!x.fw.saved) {  // recompute the forward
        NodeScope r(b_, "R" + std::to_string(mb) + "." + std::to_string(n.chunk));
        Forwarded f = model.forward(batch_for(x.input), {0, mb, step});
        x.fw.saved = std::move(f.saved);
        x.input = Tensor();
      }
      x.dx = model.backward_input(*x.fw.saved, dy);
      break;
    }
    case NodeKind::send_grad: send(true, prev_stage, x.dx); break;
    case NodeKind::backward_weight:
      if (!syncs_.empty() && pos == last_w_[static_cast<std::size_t>(n.chunk)]) syncs_[static_cast<std::size_t>(n.chunk)]->arm();
      model.backward_weight(*x.fw.saved);
      x.fw.saved.reset();
      break;
    case NodeKind::offload: offload(n, x); break;
    case NodeKind::reload: reload(n, x); break;
    case NodeKind::optimizer: break;
  }
}

// ---- activation offloading ----------------------------------------------------------------

void PipelineStage::offload(const Node& n, Slot& x) {
  // What the forward left alive for its backward: its own activations (not the output being
  // sent, not the loss) and the input it keeps.
  const Storage* out = x.out.defined() ? x.out.storage().get() : nullptr;
  const Storage* loss = n.microbatch < static_cast<int>(losses_.size()) && losses_[static_cast<std::size_t>(n.microbatch)].defined()
                            ? losses_[static_cast<std::size_t>(n.microbatch)].storage().get()
                            : nullptr;
  std::vector<std::weak_ptr<Storage>> found = std::move(x.made);
  found.push_back(x.input_storage);
  x.made.clear();
  x.input_storage.reset();
  // Nor a tensor a send still holds (pending_): today's schedules offload right after the F,
  // before its send, but a schedule that sent first would otherwise move bytes the send may
  // not have read yet.
  const auto sending = [&](const Storage* st) {
    for (const auto& [pos, ps] : pending_)
      if (ps.t.defined() && ps.t.storage().get() == st) return true;
    return false;
  };
  std::size_t bytes = 0;
  for (auto& w : found) {
    std::shared_ptr<Storage> st = w.lock();
    if (!st || st.get() == out || st.get() == loss || sending(st.get()) || st->space != MemSpace::device ||
        st->category != MemCategory::activations || st->microbatch != n.microbatch || st->bytes == 0)
      continue;
    if (std::find(x.away.begin(), x.away.end(), st) != x.away.end()) continue;
    bytes += st->bytes;
    x.away.push_back(std::move(st));
  }
  if (x.away.empty()) return;
  if (host_capacity_ > 0 && static_cast<double>(host_bytes_ + bytes) > host_capacity_) {
    char msg[400];
    std::snprintf(msg, sizeof msg,
                  "pipeline stage %d (rank %d): offloading %s's saved activations (%.3f GiB) would hold %.3f GiB of "
                  "pinned host memory, more than the %.3f GiB this GPU's share of its node's host memory allows: "
                  "offload fewer chunks (--offload-chunks) or use more pipeline stages",
                  stage_, b_.rank(), node_label({NodeKind::forward, n.microbatch, n.chunk}).c_str(),
                  static_cast<double>(bytes) / (1 << 30), static_cast<double>(host_bytes_ + bytes) / (1 << 30),
                  host_capacity_ / (1 << 30));
    throw OutOfMemory(msg);
  }
  events_.order(stream(), *d2h_);  // after the forward that wrote them
  for (auto& st : x.away) b_.relocate(st, MemSpace::host_pinned, MemCategory::host_pinned, *d2h_, *d2h_);
  x.offloaded = events_.mark(*d2h_);
  x.away_bytes = bytes;
  host_bytes_ += bytes;
  offload_stats_.transfers += 1;
  offload_stats_.bytes += bytes;
  offload_stats_.peak_host_bytes = std::max(offload_stats_.peak_host_bytes, host_bytes_);
  auto& per_chunk = offload_stats_.chunk_bytes[static_cast<std::size_t>(n.chunk)];
  per_chunk = std::max(per_chunk, bytes);
}

void PipelineStage::reload(const Node& n, Slot& x) {
  (void)n;
  if (x.away.empty()) return;
  // Issued when the compute stream reaches this node (the schedule places it there, and its
  // estimate times it so): the copy waits for the work before it in the list, not only for
  // the host, which runs ahead; and for its own offload to be complete.
  events_.order(stream(), *h2d_);
  events_.after(*h2d_, x.offloaded);
  for (auto& st : x.away) {
    // Allocated in stream order on the copy stream, charged to the microbatch's activations;
    // then owned by the compute stream, which waits for this copy before its B and frees the
    // bytes after its W.
    b_.relocate(st, MemSpace::device, MemCategory::activations, *h2d_, *h2d_);
    st->stream = &stream();
  }
  x.reloaded = events_.mark(*h2d_);
  host_bytes_ -= x.away_bytes;
  x.away.clear();
  x.away_bytes = 0;
}

// ---- figures from the timeline -------------------------------------------------------------

std::vector<StageWork> stage_work(const std::vector<OpRecord>& ops, const std::vector<std::pair<double, double>>& steps,
                                  const std::vector<std::string>& transfer_stream_names) {
  std::vector<StageWork> out;
  for (const auto& [t0, t1] : steps) {
    std::vector<std::pair<double, double>> iv;
    for (const auto& op : ops) {
      if (op.end < t0 || op.start > t1) continue;
      const std::string k = label_kind(op.node);
      if (k != "F" && k != "B" && k != "W" && k != "R") continue;
      if (std::find(transfer_stream_names.begin(), transfer_stream_names.end(), op.stream_name) != transfer_stream_names.end())
        continue;
      iv.push_back({std::max(op.start, t0), std::min(op.end, t1)});
    }
    StageWork w;
    std::sort(iv.begin(), iv.end());
    double cur_s = 0, cur_e = -std::numeric_limits<double>::infinity();
    for (const auto& [s, e] : iv) {
      if (s > cur_e) {
        if (cur_e > cur_s) w.busy += cur_e - cur_s;
        cur_s = s;
        cur_e = e;
      } else {
        cur_e = std::max(cur_e, e);
      }
    }
    if (!iv.empty()) {
      if (cur_e > cur_s) w.busy += cur_e - cur_s;
      w.first = iv.front().first;
      w.last = 0;
      for (const auto& [s, e] : iv) w.last = std::max(w.last, e);
    }
    out.push_back(w);
  }
  return out;
}

}  // namespace moelab::pipeline
