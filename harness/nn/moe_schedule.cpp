// harness/nn/moe_schedule.cpp — see moe_schedule.hpp.
#include "harness/nn/moe_schedule.hpp"

#include <numeric>

#include "harness/nn/moe_layer.hpp"

namespace moelab {

Chunk peer_chunk(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv, std::int64_t El,
                 std::int64_t M, std::span<const int> to, std::span<const int> from) {
  const auto at = [El](int p, std::int64_t l) { return static_cast<std::size_t>(p * El + l); };
  const auto W = static_cast<int>(sent.size() / static_cast<std::size_t>(El));
  std::vector<std::int64_t> first_row(static_cast<std::size_t>(W) + 1, 0);  // first T_I row of each peer
  for (int p = 0; p < W; ++p)
    first_row[static_cast<std::size_t>(p) + 1] =
        first_row[static_cast<std::size_t>(p)] +
        std::accumulate(sent.begin() + static_cast<std::ptrdiff_t>(at(p, 0)),
                        sent.begin() + static_cast<std::ptrdiff_t>(at(p, El)), std::int64_t{0});
  Chunk ch;
  ch.rows.assign(static_cast<std::size_t>(El), 0);
  for (int p : from)
    for (std::int64_t l = 0; l < El; ++l) ch.rows[static_cast<std::size_t>(l)] += recv[at(p, l)];
  ch.offset.assign(static_cast<std::size_t>(El), 0);
  std::exclusive_scan(ch.rows.begin(), ch.rows.end(), ch.offset.begin(), std::int64_t{0});
  ch.R = std::accumulate(ch.rows.begin(), ch.rows.end(), std::int64_t{0});
  std::vector<std::int64_t> fill = ch.offset;  // next free row of each local expert in T_DI_c
  for (std::size_t k = 0; k < to.size(); ++k) {
    std::int64_t row = first_row[static_cast<std::size_t>(to[k])];
    for (std::int64_t l = 0; l < El; ++l) {
      ch.sends.push_back({to[k], row * M, sent[at(to[k], l)] * M});
      row += sent[at(to[k], l)];
    }
    for (std::int64_t l = 0; l < El; ++l) {
      const std::int64_t nr = recv[at(from[k], l)];
      ch.recvs.push_back({from[k], fill[static_cast<std::size_t>(l)] * M, nr * M});
      fill[static_cast<std::size_t>(l)] += nr;
    }
  }
  return ch;
}

Event* EventPool::mark(Stream& s) {
  if (next_ == events_.size()) events_.push_back(b_.create_event());
  Event* e = events_[next_++].get();
  b_.record(*e, s);
  return e;
}

// Buffers, forward and backward, are made on the compute stream and freed there (stream-ordered),
// so a buffer an exchange writes is made before the event the exchange waits for, and one it
// touches is freed only after the compute stream has waited for it. Pipelined (the other streams
// run ahead of the compute stream): all made before the `ready` event the first exchanges wait
// for, freed at the end. One chunk in flight: each made just before the step that writes it;
// the layer's input to the chunks (T_I, dT_O) and dT_DO freed as soon as their last reader is
// done, the rest at the end.
void issue_forward(MoELayer& L, MoESaved& sv, Tensor t_i, ChunkHooks* hooks) {
  Backend& b = L.backend();
  const ModelConfig& cfg = L.config();
  const ChunkPlan& plan = sv.plan;
  Stream& c = L.compute_stream();
  Stream& ds = *plan.dispatch.stream;
  Stream& cs = *plan.combine.stream;
  EventPool& ev = L.event_pool();
  ev.reset();
  const int n = static_cast<int>(plan.chunks.size());
  const bool ahead = !plan.one_in_flight;
  const std::int64_t N = t_i.dim(0), M = cfg.d_model, H = cfg.d_hidden;
  const auto chunk = [&](int i) -> const Chunk& { return plan.chunks[static_cast<std::size_t>(i)]; };
  ChunkEvents e;
  e.in.assign(static_cast<std::size_t>(n), nullptr);
  e.computed = e.out = e.in;
  std::vector<ChunkTensors> buf(static_cast<std::size_t>(n));
  if (!hooks) sv.kept.assign(static_cast<std::size_t>(n), {});
  auto make_t_di = [&](int i) {  // T_DI_c [R_c,M]
    sv.kept[static_cast<std::size_t>(i)].t_di = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::activations, c);
  };
  auto make_t_m_t_do = [&](int i) {  // T_M_c [R_c,H], T_DO_c [R_c,M]
    sv.kept[static_cast<std::size_t>(i)].t_m = b.empty({chunk(i).R, H}, cfg.dtype, MemCategory::activations, c);
    buf[static_cast<std::size_t>(i)].t_do = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::buffers, c);
  };
  auto tensors = [&](int i) -> ChunkTensors& {
    ChunkTensors& t = buf[static_cast<std::size_t>(i)];
    if (hooks) {
      t = hooks->tensors(i);
    } else {
      t.t_di = sv.kept[static_cast<std::size_t>(i)].t_di;
      t.t_m = sv.kept[static_cast<std::size_t>(i)].t_m;
    }
    return t;
  };
  if (ahead) {
    sv.t_o = b.empty({N, M}, cfg.dtype, MemCategory::activations, c);  // [N,M]
    if (hooks) {
      hooks->allocate();
    } else {
      for (int i = 0; i < n; ++i) {
        make_t_di(i);
        make_t_m_t_do(i);
      }
    }
    Event* ready = ev.mark(c);
    ev.after(ds, ready);
    if (hooks)
      for (Stream* s : hooks->ready()) ev.after(*s, ready);
    if (hooks) hooks->start(e);
  }

  auto dispatch_step = [&](int i) {  // S_i: T_I rows -> T_DI_i
    if (!ahead) {
      make_t_di(i);
      ev.after(ds, ev.mark(c));
    }
    ChunkTensors& t = tensors(i);
    if (hooks) hooks->before(ChunkStep::dispatch, i, e);
    L.dispatch(ds, *plan.dispatch.comm, t_i, chunk(i), t.t_di);
    e.in[static_cast<std::size_t>(i)] = ev.mark(ds);
    if (hooks) hooks->after(ChunkStep::dispatch, i, e);
  };
  auto experts_step = [&](int i) {  // C_i
    ev.after(c, e.in[static_cast<std::size_t>(i)]);
    if (!ahead) {
      if (i + 1 == n) t_i = Tensor();  // its last dispatch is done
      make_t_m_t_do(i);
    }
    ChunkTensors& t = tensors(i);
    if (!hooks) t.t_do = buf[static_cast<std::size_t>(i)].t_do;
    if (hooks) hooks->before(ChunkStep::experts, i, e);
    if (!(plan.skip_empty && chunk(i).R == 0)) L.experts(c, chunk(i), t.t_di, t.t_m, t.t_do);
    if (!ahead && !sv.t_o.defined()) sv.t_o = b.empty({N, M}, cfg.dtype, MemCategory::activations, c);
    e.computed[static_cast<std::size_t>(i)] = ev.mark(c);
    if (hooks) hooks->after(ChunkStep::experts, i, e);
  };
  auto combine_step = [&](int i) {  // R_i: T_DO_i -> T_O rows
    ChunkTensors& t = buf[static_cast<std::size_t>(i)];
    ev.after(cs, e.computed[static_cast<std::size_t>(i)]);
    if (hooks) hooks->before(ChunkStep::combine, i, e);
    L.combine(cs, *plan.combine.comm, chunk(i), t.t_do, sv.t_o);
    e.out[static_cast<std::size_t>(i)] = ev.mark(cs);
    if (hooks) hooks->after(ChunkStep::combine, i, e);
  };

  const int ahead_by = std::min(plan.lookahead, n);
  for (int i = 0; i < ahead_by; ++i) dispatch_step(i);
  for (int i = 0; i < n; ++i) {
    if (i + ahead_by < n) dispatch_step(i + ahead_by);
    experts_step(i);
    combine_step(i);
  }
  // The dispatch lane's last step was waited for by the last experts step.
  ev.after(c, e.out[static_cast<std::size_t>(n - 1)]);
  if (hooks) {
    for (Stream* s : hooks->join()) ev.order(*s, c);
    hooks->finish();
  }
}

Tensor issue_backward(MoELayer& L, MoESaved& sv, Tensor d_t_o, bool defer, ChunkHooks* hooks) {
  Backend& b = L.backend();
  const ModelConfig& cfg = L.config();
  const ChunkPlan& plan = sv.plan;
  Stream& c = L.compute_stream();
  Stream& ds = *plan.dispatch.stream;
  Stream& cs = *plan.combine.stream;
  EventPool& ev = L.event_pool();
  ev.reset();
  const int n = static_cast<int>(plan.chunks.size());
  const bool ahead = !plan.one_in_flight;
  const std::int64_t N = d_t_o.dim(0), M = cfg.d_model;
  const auto chunk = [&](int i) -> const Chunk& { return plan.chunks[static_cast<std::size_t>(i)]; };
  ChunkEvents e;
  e.in.assign(static_cast<std::size_t>(n), nullptr);
  e.computed = e.out = e.in;
  std::vector<ChunkTensors> buf(static_cast<std::size_t>(n));
  Tensor d_t_i;
  auto make = [&](Tensor& t, int i) { t = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::buffers, c); };  // [R_i,M]
  auto tensors = [&](int i) -> ChunkTensors& {
    ChunkTensors& t = buf[static_cast<std::size_t>(i)];
    if (hooks) {
      t = hooks->tensors(i);
    } else {
      t.t_di = sv.kept[static_cast<std::size_t>(i)].t_di;
      t.t_m = sv.kept[static_cast<std::size_t>(i)].t_m;
    }
    return t;
  };
  if (defer) sv.expert_wgrad.assign(static_cast<std::size_t>(n), {});
  if (ahead) {
    d_t_i = b.empty({N, M}, cfg.dtype, MemCategory::buffers, c);  // [N,M]
    if (hooks) {
      hooks->allocate();
    } else {
      for (int i = 0; i < n; ++i) {
        make(buf[static_cast<std::size_t>(i)].d_t_do, i);
        make(buf[static_cast<std::size_t>(i)].d_t_di, i);
      }
    }
    Event* ready = ev.mark(c);
    ev.after(cs, ready);
    if (hooks)
      for (Stream* s : hooks->ready()) ev.after(*s, ready);
    if (hooks) hooks->start(e);
  }

  auto combine_step = [&](int i) {  // R'_i: dT_O rows -> dT_DO_i
    if (!ahead) {
      make(buf[static_cast<std::size_t>(i)].d_t_do, i);
      ev.after(cs, ev.mark(c));
    }
    const Tensor d_t_do = buf[static_cast<std::size_t>(i)].d_t_do, d_t_di = buf[static_cast<std::size_t>(i)].d_t_di;
    ChunkTensors& t = tensors(i);
    if (!hooks) {
      t.d_t_do = d_t_do;
      t.d_t_di = d_t_di;
    }
    if (hooks) hooks->before(ChunkStep::combine, i, e);
    L.combine_backward(cs, *plan.combine.comm, chunk(i), d_t_o, t.d_t_do);
    e.in[static_cast<std::size_t>(i)] = ev.mark(cs);
    if (hooks) hooks->after(ChunkStep::combine, i, e);
  };
  auto experts_step = [&](int i) {  // C'_i
    ChunkTensors& t = buf[static_cast<std::size_t>(i)];
    ev.after(c, e.in[static_cast<std::size_t>(i)]);
    if (!ahead) {
      if (i + 1 == n) d_t_o = Tensor();  // its last exchange is done
      make(t.d_t_di, i);
    }
    if (hooks) hooks->before(ChunkStep::experts, i, e);
    if (!(plan.skip_empty && chunk(i).R == 0)) {
      MoESaved::ExpertWgrad* w = defer ? &sv.expert_wgrad[static_cast<std::size_t>(i)] : nullptr;
      if (w) w->chunk = static_cast<std::size_t>(i);
      L.experts_backward(c, chunk(i), t.t_di, t.t_m, t.d_t_do, t.d_t_di, w);
    }
    if (!ahead) {
      t.d_t_do = Tensor();  // read by the compute stream alone (kept by a deferred dW2)
      if (!d_t_i.defined()) d_t_i = b.empty({N, M}, cfg.dtype, MemCategory::buffers, c);
    }
    e.computed[static_cast<std::size_t>(i)] = ev.mark(c);
    if (hooks) hooks->after(ChunkStep::experts, i, e);
  };
  auto dispatch_step = [&](int i) {  // S'_i: dT_DI_i -> dT_I rows
    ChunkTensors& t = buf[static_cast<std::size_t>(i)];
    ev.after(ds, e.computed[static_cast<std::size_t>(i)]);
    if (hooks) hooks->before(ChunkStep::dispatch, i, e);
    L.dispatch_backward(ds, *plan.dispatch.comm, chunk(i), t.d_t_di, d_t_i);
    e.out[static_cast<std::size_t>(i)] = ev.mark(ds);
    if (hooks) hooks->after(ChunkStep::dispatch, i, e);
  };

  const int ahead_by = std::min(plan.lookahead, n);
  for (int i = 0; i < ahead_by; ++i) combine_step(i);
  for (int i = 0; i < n; ++i) {
    if (i + ahead_by < n) combine_step(i + ahead_by);
    experts_step(i);
    dispatch_step(i);
  }
  // The combine lane's last step was waited for by the last experts step.
  ev.after(c, e.out[static_cast<std::size_t>(n - 1)]);
  if (hooks) {
    for (Stream* s : hooks->join()) ev.order(*s, c);
    hooks->finish();
  }
  return d_t_i;
}

}  // namespace moelab
