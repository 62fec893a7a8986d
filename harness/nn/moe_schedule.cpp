// harness/nn/moe_schedule.cpp — see moe_schedule.hpp.
#include "harness/nn/moe_schedule.hpp"

#include <algorithm>
#include <numeric>

#include "harness/nn/moe_layer.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

Chunk peer_chunk(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv, std::int64_t El,
                 std::int64_t M, std::span<const int> to, std::span<const int> from, std::int64_t stride) {
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
  if (stride > 0) {
    MOELAB_CHECK(*std::max_element(ch.rows.begin(), ch.rows.end()) <= stride,
                 "peer_chunk: a local expert has more rows than the stride " + std::to_string(stride));
    for (std::int64_t l = 0; l < El; ++l) ch.offset[static_cast<std::size_t>(l)] = l * stride;
    ch.R = El * stride;
    ch.stride = stride;
  }
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

std::int64_t padded_stride(const std::vector<std::int64_t>& rows, double max_waste) {
  if (rows.empty()) return 0;
  const std::int64_t stride = *std::max_element(rows.begin(), rows.end());
  if (stride <= 0) return 0;
  const double total = static_cast<double>(std::accumulate(rows.begin(), rows.end(), std::int64_t{0}));
  const double waste = 1.0 - total / (static_cast<double>(rows.size()) * static_cast<double>(stride));
  return waste > max_waste ? 0 : stride;
}

std::vector<Chunk> split_chunk(const Chunk& whole, std::int64_t El, std::int64_t M, int r) {
  MOELAB_CHECK(r >= 1 && El >= 1 && M >= 1, "split_chunk: r = " + std::to_string(r));
  MOELAB_CHECK(whole.sends.size() % static_cast<std::size_t>(El) == 0 && whole.recvs.size() % static_cast<std::size_t>(El) == 0,
               "split_chunk: segments are not listed per (peer, local expert)");
  if (r == 1) return {whole};
  const auto part = [r](std::int64_t n, int c) { return n * (c + 1) / r - n * c / r; };
  const auto first = [r](std::int64_t n, int c) { return n * c / r; };
  std::vector<Chunk> out(static_cast<std::size_t>(r));
  for (int c = 0; c < r; ++c) {
    Chunk& ch = out[static_cast<std::size_t>(c)];
    ch.rows.assign(static_cast<std::size_t>(El), 0);
    for (std::size_t s = 0; s < whole.recvs.size(); ++s)
      ch.rows[s % static_cast<std::size_t>(El)] += part(whole.recvs[s].count / M, c);
    ch.offset.assign(static_cast<std::size_t>(El), 0);
    std::exclusive_scan(ch.rows.begin(), ch.rows.end(), ch.offset.begin(), std::int64_t{0});
    ch.R = std::accumulate(ch.rows.begin(), ch.rows.end(), std::int64_t{0});
    for (const Segment& sg : whole.sends) {  // a run of the segment's T_I rows
      const std::int64_t n = sg.count / M;
      ch.sends.push_back({sg.peer, sg.offset + first(n, c) * M, part(n, c) * M});
    }
    std::vector<std::int64_t> fill = ch.offset;  // next free row of each local expert in T_DI_c
    for (std::size_t s = 0; s < whole.recvs.size(); ++s) {
      const std::int64_t n = part(whole.recvs[s].count / M, c);
      std::int64_t& at = fill[s % static_cast<std::size_t>(El)];
      ch.recvs.push_back({whole.recvs[s].peer, at * M, n * M});
      at += n;
    }
  }
  return out;
}

Event* EventPool::mark(Stream& s) {
  if (next_ == events_.size()) events_.push_back(b_.create_event());
  Event* e = events_[next_++].get();
  b_.record(*e, s);
  return e;
}

namespace {
// What a forward and a backward pass share: the pass's events, the start of the pipeline and
// the order of the steps. `first` is the exchange that brings a chunk's rows to the experts
// (forward: dispatch; backward: combine backward), `second` the one that takes them back.
class Pass {
 public:
  struct Context {  // what every step is issued with
    Backend& b;
    const ModelConfig& cfg;
    const ChunkPlan& plan;
    Stream& c;   // compute
    Stream& ds;  // the dispatch lane's stream
    Stream& cs;  // the combine lane's stream
    EventPool& ev;
  };
  Pass(MoELayer& L, const ChunkPlan& plan, ChunkHooks* hooks, const PassPlacement* place)
      : ctx{L.backend(), L.config(), plan, L.compute_stream(), *plan.dispatch.stream, *plan.combine.stream,
            L.event_pool()},
        L_(L), hooks_(hooks), place_(place), n_(static_cast<int>(plan.chunks.size())) {
    MOELAB_CHECK(!plan.one_in_flight || !hooks, "a schedule with its own buffers is pipelined");
    MOELAB_CHECK(plan.group >= 1 && (plan.group == 1 || plan.phased), "a chunk plan's groups need the phased order");
    MOELAB_CHECK(!place || !hooks, "compute placed among a pass's steps needs a plan without hooks");
    ctx.ev.reset();
    e.in.assign(static_cast<std::size_t>(n_), nullptr);
    e.computed = e.out = e.in;
  }
  int chunks() const { return n_; }
  const Chunk& chunk(int i) const { return ctx.plan.chunks[static_cast<std::size_t>(i)]; }
  bool ahead() const { return !ctx.plan.one_in_flight; }
  // The last chunk of chunk i's group (ChunkPlan::group): the one whose events i's steps wait for.
  int group_last(int i) const { return std::min(n_ - 1, (i / ctx.plan.group + 1) * ctx.plan.group - 1); }
  // Pipelined: the compute stream has made every buffer; the first exchanges' lane and the
  // hooks' streams wait for that before they run ahead.
  void ready(Stream& first_lane) {
    Event* ready = ctx.ev.mark(ctx.c);
    ctx.ev.after(first_lane, ready);
    if (hooks_) {
      for (Stream* s : hooks_->ready()) ctx.ev.after(*s, ready);
      hooks_->start(e);
    }
  }
  // One step: the hooks' work before and after it around `issue`, which returns the stream
  // whose position marks the step done; the mark goes to done[i].
  template <class F>
  void step(ChunkStep kind, int i, std::vector<Event*>& done, F issue) {
    if (hooks_) hooks_->before(kind, i, e);
    Stream& s = issue();
    done[static_cast<std::size_t>(i)] = ctx.ev.mark(s);
    if (kind != ChunkStep::experts && ctx.plan.host_wait_exchanges)
      L_.host_wait(s, kind == ChunkStep::dispatch ? "dispatch" : "combine");
    if (hooks_) hooks_->after(kind, i, e);
  }
  // first(i + lookahead), experts(i), second(i) for i = 0, 1, ...; then the compute stream
  // waits for the last second exchange (the first lane's last step was waited for by the last
  // experts step) and for the hooks' streams. A placement's slot comes after the lead
  // exchanges; a detached pass leaves the last wait to its caller (`done`).
  // Phased (ChunkPlan::phased): every first exchange, every experts step, every second exchange.
  template <class First, class Experts, class Second>
  void run(First first, Experts experts, Second second) {
    if (ctx.plan.phased) {
      for (int i = 0; i < n_; ++i) first(i);
      if (place_ && place_->slot) place_->slot();
      for (int i = 0; i < n_; ++i) experts(i);
      for (int i = 0; i < n_; ++i) second(i);
    } else {
      const int lead = std::min(ctx.plan.lookahead, n_);
      for (int i = 0; i < lead; ++i) first(i);
      if (place_ && place_->slot) place_->slot();
      for (int i = 0; i < n_; ++i) {
        if (i + lead < n_) first(i + lead);
        experts(i);
        second(i);
      }
    }
    Event* last = e.out[static_cast<std::size_t>(n_ - 1)];
    if (place_ && place_->detach) {
      last_exchange = last;
      return;
    }
    ctx.ev.after(ctx.c, last);
    if (hooks_) {
      for (Stream* s : hooks_->join()) ctx.ev.order(*s, ctx.c);
      hooks_->finish();
    }
  }
  Context ctx;
  ChunkEvents e;
  Event* last_exchange = nullptr;  // detached: the compute stream has not waited for it

 private:
  MoELayer& L_;
  ChunkHooks* hooks_;
  const PassPlacement* place_;
  const int n_;
};
}  // namespace

// Buffers, forward and backward, are made on the compute stream and freed there (stream-ordered),
// so a buffer an exchange writes is made before the event the exchange waits for, and one it
// touches is freed only after the compute stream has waited for it. Pipelined (the other streams
// run ahead of the compute stream): all made before the `ready` event the first exchanges wait
// for. One chunk in flight: each made just before the step that writes it, and dT_O, the
// largest, released as soon as it is sent (the experts' backward runs without it). The pass
// hands the rest back (PassBuffers); hooks release their own in finish().
PassBuffers issue_forward(MoELayer& L, MoESaved& sv, const Tensor& t_i, ChunkHooks* hooks, const PassPlacement* place) {
  Pass pass(L, sv.plan, hooks, place);
  // Named references, not a structured binding: the steps' lambdas capture them, which clang
  // accepts only from version 16 (C++20's P1091R3), and the fuzz build uses clang.
  Backend& b = pass.ctx.b;
  const ModelConfig& cfg = pass.ctx.cfg;
  const ChunkPlan& plan = pass.ctx.plan;
  Stream &c = pass.ctx.c, &ds = pass.ctx.ds, &cs = pass.ctx.cs;
  EventPool& ev = pass.ctx.ev;
  ChunkEvents& e = pass.e;
  const int n = pass.chunks();
  const std::int64_t N = t_i.dim(0), M = cfg.d_model, H = cfg.d_hidden;
  const auto chunk = [&](int i) -> const Chunk& { return pass.chunk(i); };
  PassBuffers out;
  std::vector<ChunkTensors>& buf = out.chunks;
  buf.resize(static_cast<std::size_t>(n));
  const auto at = [&](int i) -> ChunkTensors& { return buf[static_cast<std::size_t>(i)]; };
  if (!hooks) sv.kept.assign(static_cast<std::size_t>(n), {});
  // The padded layout (Chunk::stride): T_DI_c and T_M_c start zero, so that their padding rows
  // are zero whichever path a GEMM takes (the exchange writes T_DI_c's own rows; a GEMM over the
  // problems' own rows leaves T_M_c's padding as it was; the activation keeps zero at zero).
  auto make_t_di = [&](int i) {  // T_DI_c [R_c,M]
    at(i).t_di = sv.kept[static_cast<std::size_t>(i)].t_di =
        b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::activations, c);
    if (chunk(i).stride > 0) b.fill_zero(c, at(i).t_di);
  };
  auto make_t_m_t_do = [&](int i) {  // T_M_c [R_c,H], T_DO_c [R_c,M]
    at(i).t_m = sv.kept[static_cast<std::size_t>(i)].t_m =
        b.empty({chunk(i).R, H}, cfg.dtype, MemCategory::activations, c);
    if (chunk(i).stride > 0) b.fill_zero(c, at(i).t_m);
    at(i).t_do = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::buffers, c);
  };
  if (pass.ahead()) {
    sv.t_o = b.empty({N, M}, cfg.dtype, MemCategory::activations, c);  // [N,M]
    if (hooks) {
      hooks->output(sv.t_o);
      hooks->allocate();
    }
    for (int i = 0; i < n; ++i) {
      if (hooks) {
        at(i) = hooks->tensors(i);
      } else {
        make_t_di(i);
        make_t_m_t_do(i);
      }
    }
    pass.ready(ds);
  }
  pass.run(
      [&](int i) {  // S_i: T_I rows -> T_DI_i
        if (!pass.ahead()) {
          make_t_di(i);
          ev.order(c, ds);
        }
        pass.step(ChunkStep::dispatch, i, e.in, [&]() -> Stream& {
          L.dispatch(ds, *plan.dispatch.comm, t_i, chunk(i), at(i).t_di);
          return ds;
        });
      },
      [&](int i) {  // C_i
        ev.after(c, e.in[static_cast<std::size_t>(pass.group_last(i))]);
        if (!pass.ahead()) make_t_m_t_do(i);
        pass.step(ChunkStep::experts, i, e.computed, [&]() -> Stream& {
          if (!(plan.skip_empty && chunk(i).R == 0)) {
            if (plan.copy_expert_outputs) {  // y0, then y.copy_(y0)
              Tensor y0 = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::buffers, c);
              L.experts(c, chunk(i), at(i).t_di, at(i).t_m, y0);
              b.copy(c, y0, at(i).t_do);
            } else {
              L.experts(c, chunk(i), at(i).t_di, at(i).t_m, at(i).t_do);
            }
          }
          if (!sv.t_o.defined()) sv.t_o = b.empty({N, M}, cfg.dtype, MemCategory::activations, c);  // before R_i waits
          return c;
        });
      },
      [&](int i) {  // R_i: T_DO_i -> T_O rows
        ev.after(cs, e.computed[static_cast<std::size_t>(pass.group_last(i))]);
        pass.step(ChunkStep::combine, i, e.out, [&]() -> Stream& {
          L.combine(cs, *plan.combine.comm, chunk(i), at(i).t_do, sv.t_o);
          return cs;
        });
      });
  out.done = pass.last_exchange;
  return out;
}

PassBuffers issue_backward(MoELayer& L, MoESaved& sv, Tensor& d_t_o, bool defer, ChunkHooks* hooks,
                           const PassPlacement* place) {
  Pass pass(L, sv.plan, hooks, place);
  Backend& b = pass.ctx.b;
  const ModelConfig& cfg = pass.ctx.cfg;
  const ChunkPlan& plan = pass.ctx.plan;
  Stream &c = pass.ctx.c, &ds = pass.ctx.ds, &cs = pass.ctx.cs;
  EventPool& ev = pass.ctx.ev;
  ChunkEvents& e = pass.e;
  const int n = pass.chunks();
  const std::int64_t N = d_t_o.dim(0), M = cfg.d_model;
  const auto chunk = [&](int i) -> const Chunk& { return pass.chunk(i); };
  PassBuffers out;
  std::vector<ChunkTensors>& buf = out.chunks;
  buf.resize(static_cast<std::size_t>(n));
  Tensor& d_t_i = out.d_t_i;  // [N,M]
  const auto at = [&](int i) -> ChunkTensors& { return buf[static_cast<std::size_t>(i)]; };
  auto make = [&](Tensor& t, int i) { t = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::buffers, c); };  // [R_i,M]
  // dT_DO_c starts zero in the padded layout (the exchange writes its own rows only).
  auto make_d_t_do = [&](Tensor& t, int i) {
    make(t, i);
    if (chunk(i).stride > 0) b.fill_zero(c, t);
  };
  if (!hooks)
    for (int i = 0; i < n; ++i) {
      at(i).t_di = sv.kept[static_cast<std::size_t>(i)].t_di;
      at(i).t_m = sv.kept[static_cast<std::size_t>(i)].t_m;
    }
  if (defer) sv.expert_wgrad.assign(static_cast<std::size_t>(n), {});
  if (pass.ahead()) {
    d_t_i = b.empty({N, M}, cfg.dtype, MemCategory::buffers, c);
    if (hooks) {
      hooks->output(d_t_i);
      hooks->allocate();
    }
    for (int i = 0; i < n; ++i) {
      if (hooks) {
        at(i) = hooks->tensors(i);
      } else {
        make_d_t_do(at(i).d_t_do, i);
        make(at(i).d_t_di, i);
      }
    }
    pass.ready(cs);
  }
  pass.run(
      [&](int i) {  // R'_i: dT_O rows -> dT_DO_i
        if (!pass.ahead()) {
          make_d_t_do(at(i).d_t_do, i);
          ev.order(c, cs);
        }
        pass.step(ChunkStep::combine, i, e.in, [&]() -> Stream& {
          L.combine_backward(cs, *plan.combine.comm, chunk(i), d_t_o, at(i).d_t_do);
          return cs;
        });
      },
      [&](int i) {  // C'_i
        ChunkTensors& t = at(i);
        ev.after(c, e.in[static_cast<std::size_t>(pass.group_last(i))]);
        if (!pass.ahead()) {
          if (i + 1 == n) d_t_o = Tensor();  // its last exchange is done
          make(t.d_t_di, i);
        }
        pass.step(ChunkStep::experts, i, e.computed, [&]() -> Stream& {
          if (!(plan.skip_empty && chunk(i).R == 0)) {
            MoESaved::ExpertWgrad* w = defer ? &sv.expert_wgrad[static_cast<std::size_t>(i)] : nullptr;
            if (w) w->chunk = static_cast<std::size_t>(i);
            if (plan.copy_expert_outputs) {  // x.grad, then grad_x.copy_(x.grad)
              Tensor gx = b.empty({chunk(i).R, M}, cfg.dtype, MemCategory::buffers, c);
              L.experts_backward(c, chunk(i), t.t_di, t.t_m, t.d_t_do, gx, w);
              b.copy(c, gx, t.d_t_di);
            } else {
              L.experts_backward(c, chunk(i), t.t_di, t.t_m, t.d_t_do, t.d_t_di, w);
            }
          }
          if (!d_t_i.defined()) d_t_i = b.empty({N, M}, cfg.dtype, MemCategory::buffers, c);  // before S'_i waits
          return c;
        });
      },
      [&](int i) {  // S'_i: dT_DI_i -> dT_I rows
        ev.after(ds, e.computed[static_cast<std::size_t>(pass.group_last(i))]);
        pass.step(ChunkStep::dispatch, i, e.out, [&]() -> Stream& {
          L.dispatch_backward(ds, *plan.dispatch.comm, chunk(i), at(i).d_t_di, d_t_i);
          return ds;
        });
      });
  out.done = pass.last_exchange;
  return out;
}

}  // namespace moelab
