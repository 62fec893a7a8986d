// harness/nn/grad_sync.cpp — bucketed gradient synchronisation and ZeRO-1's shards (see
// grad_sync.hpp).
//   ctest --test-dir build -R 'dp_mpi_test|tp_mpi_test|parallel_test'
#include "harness/nn/grad_sync.hpp"

#include <algorithm>

#include "harness/runtime/error.hpp"

namespace moelab {

BucketPlan plan_buckets(const std::vector<std::int64_t>& numel, const std::vector<bool>& expert,
                        std::int64_t bucket_elems, int dense_group, int expert_group) {
  MOELAB_CHECK(numel.size() == expert.size(), "plan_buckets: sizes and kinds differ");
  if (bucket_elems < 1) throw ConfigError("gradient bucket size " + std::to_string(bucket_elems) + " must be at least 1");
  BucketPlan plan;
  BucketPlan::Bucket open[2];
  open[1].expert = true;
  auto close = [&](BucketPlan::Bucket& bk) {
    if (bk.entries.empty()) return;
    const std::int64_t g = bk.expert ? expert_group : dense_group;
    bk.padded = (bk.elems + g - 1) / g * g;
    plan.buckets.push_back(std::move(bk));
    bk = BucketPlan::Bucket{};
  };
  // Reverse model order: the order in which backward finishes the gradients.
  for (std::size_t i = numel.size(); i-- > 0;) {
    BucketPlan::Bucket& bk = open[expert[i] ? 1 : 0];
    bk.expert = expert[i];
    bk.entries.push_back({i, bk.elems, numel[i]});
    bk.elems += numel[i];
    if (bk.elems >= bucket_elems) close(bk);
  }
  close(open[0]);
  close(open[1]);
  return plan;
}

struct GradSync::BucketState {
  Tensor grads;       // [padded] the gradients of the bucket's parameters, end to end
  Tensor values;      // [padded] their values (ZeRO-1)
  Tensor grad_shard;  // [padded/g] this rank's summed slice of grads, a view (ZeRO-1; the whole bucket when g = 1)
  Communicator* comm = nullptr;
  std::vector<std::pair<std::int64_t, std::int64_t>> tp_runs;  // (offset, count) summed over TP first
  struct ScaleRun {
    std::int64_t offset, count;
    int copies;
  };
  std::vector<ScaleRun> scale_runs;
  std::int64_t pending = 0;  // parameters whose gradient is not final yet (armed)
  bool issued = false;
  std::unique_ptr<Event> ready, updated;
};

GradSync::GradSync(Backend& b, Stream& compute, std::vector<ParamSlot> slots, Communicator& dp, Communicator& edp,
                   const TensorParallel& tp, const GradSyncOptions& opt)
    : b_(b), compute_(compute), slots_(std::move(slots)), opt_(opt) {
  MOELAB_CHECK(!slots_.empty(), "GradSync: no parameters");
  const DType dt = slots_.front().param.value.dtype();
  int blocks = 0;
  std::vector<std::int64_t> numel;
  std::vector<bool> expert;
  for (const auto& s : slots_) {
    MOELAB_CHECK(s.value && s.grad && s.param.value.dtype() == dt && s.param.grad.dtype() == dt,
                 "GradSync: parameter " + s.param.name + " has no tensors or another dtype");
    numel.push_back(s.param.value.numel());
    expert.push_back(!s.param.replicated);
    blocks = std::max(blocks, s.block + 1);
  }
  stream_ = &b.create_stream(StreamRole::aux, "grad_sync");
  dp_ = dp.dup();
  edp_ = edp.dup();
  if (tp.on()) tp_ = tp.comm->dup();
  plan_ = plan_buckets(numel, expert, opt.bucket_elems, opt.zero1 ? dp_->size() : 1, opt.zero1 ? edp_->size() : 1);
  by_block_.resize(static_cast<std::size_t>(blocks));
  done_ = b.create_event();

  // Every bucket's gradients (and under ZeRO-1 values) become one buffer; the owners' tensors
  // become views of it, with what they held copied in.
  auto rebind = [&](Tensor& buf, std::int64_t offset, Tensor* member, Tensor& mirror) {
    Tensor view = buf.rows(offset, member->numel()).reshape(member->shape());
    b.copy(compute, *member, view);
    *member = view;
    mirror = view;
  };
  for (std::size_t i = 0; i < plan_.buckets.size(); ++i) {
    const BucketPlan::Bucket& bk = plan_.buckets[i];
    auto st = std::make_unique<BucketState>();
    st->comm = bk.expert ? edp_.get() : dp_.get();
    st->ready = b.create_event();
    st->updated = b.create_event();
    st->grads = b.empty({bk.padded}, dt, MemCategory::gradients, compute);  // [padded]
    b.fill_zero(compute, st->grads);
    if (opt.zero1) {
      st->values = b.empty({bk.padded}, dt, MemCategory::weights, compute);  // [padded]
      b.fill_zero(compute, st->values);
    }
    for (const auto& e : bk.entries) {
      ParamSlot& s = slots_[e.param];
      rebind(st->grads, e.offset, s.grad, s.param.grad);
      if (opt.zero1) rebind(st->values, e.offset, s.value, s.param.value);
      by_block_[static_cast<std::size_t>(s.block)].push_back(i);
      if (s.param.tp_partial && tp_) {
        if (!st->tp_runs.empty() && st->tp_runs.back().first + st->tp_runs.back().second == e.offset)
          st->tp_runs.back().second += e.count;
        else
          st->tp_runs.emplace_back(e.offset, e.count);
      }
      if (s.param.grad_copies > 1) {
        auto& r = st->scale_runs;
        if (!r.empty() && r.back().copies == s.param.grad_copies && r.back().offset + r.back().count == e.offset)
          r.back().count += e.count;
        else
          r.push_back({e.offset, e.count, s.param.grad_copies});
      }
    }
    const int g = st->comm->size();
    if (opt.zero1 && g > 1) {
      // The reduce-scatter runs in place: the rank's slice of the bucket's gradient buffer is
      // its shard (as Megatron-Core's distributed optimizer reduce-scatters into its gradient
      // buffer), so ZeRO-1 adds no gradient memory.
      const std::int64_t n = bk.padded / g;
      st->grad_shard = st->grads.rows(st->comm->rank() * n, n);  // [padded/g]
    } else {
      st->grad_shard = st->grads;
    }
    st->pending = static_cast<std::int64_t>(bk.entries.size());
    state_.push_back(std::move(st));
  }
}

GradSync::~GradSync() = default;

std::vector<Param> GradSync::parameters() const {
  std::vector<Param> out;
  for (const auto& s : slots_) out.push_back(s.param);
  return out;
}

void GradSync::arm() { armed_ = true; }

void GradSync::block_done(int block) {
  if (!armed_ || block < 0 || block >= static_cast<int>(by_block_.size())) return;
  for (std::size_t i : by_block_[static_cast<std::size_t>(block)]) {
    BucketState& st = *state_[i];
    if (--st.pending == 0 && !st.issued) issue(i);
  }
}

void GradSync::issue(std::size_t i) {
  BucketState& st = *state_[i];
  Stream& s = *stream_;
  b_.record(*st.ready, compute_);
  b_.wait(s, *st.ready);
  PhaseScope ph(b_, "grad_sync");
  for (const auto& r : st.scale_runs) {  // the mean over the TP ranks' identical copies
    Tensor v = st.grads.rows(r.offset, r.count);
    b_.scale(s, v, 1.0f / static_cast<float>(r.copies), v);
  }
  for (const auto& [offset, count] : st.tp_runs) {
    Tensor v = st.grads.rows(offset, count);
    tp_->all_reduce(s, v);
  }
  if (st.comm->size() > 1) {
    if (opt_.zero1)
      st.comm->reduce_scatter(s, st.grads, st.grad_shard);
    else
      st.comm->all_reduce(s, st.grads);
  }
  st.issued = true;
}

void GradSync::finish() {
  for (std::size_t i = 0; i < state_.size(); ++i)
    if (!state_[i]->issued) issue(i);
  b_.record(*done_, *stream_);
  b_.wait(compute_, *done_);
  for (std::size_t i = 0; i < state_.size(); ++i) {
    state_[i]->issued = false;
    state_[i]->pending = static_cast<std::int64_t>(plan_.buckets[i].entries.size());
  }
  armed_ = false;
}

GradSync::Shard GradSync::shard(std::size_t i) {
  MOELAB_CHECK(opt_.zero1 && i < state_.size(), "GradSync::shard: ZeRO-1 buckets only");
  BucketState& st = *state_[i];
  const int g = st.comm->size();
  const std::int64_t n = plan_.buckets[i].padded / g;
  return {g > 1 ? st.values.rows(st.comm->rank() * n, n) : st.values, st.grad_shard, g};
}

void GradSync::gather_parameters(std::size_t i) {
  MOELAB_CHECK(opt_.zero1 && i < state_.size(), "GradSync::gather_parameters: ZeRO-1 buckets only");
  BucketState& st = *state_[i];
  const int g = st.comm->size();
  if (g == 1) return;  // the shard is the bucket, updated in place
  Stream& s = *stream_;
  b_.record(*st.updated, compute_);
  b_.wait(s, *st.updated);
  PhaseScope ph(b_, "optimizer");
  const std::int64_t n = plan_.buckets[i].padded / g;
  // MPI forbids a send buffer inside the receive buffer (but for MPI_IN_PLACE): send a copy.
  Tensor mine = b_.empty({n}, st.values.dtype(), MemCategory::buffers, s);  // [padded/g]
  b_.copy(s, st.values.rows(st.comm->rank() * n, n), mine);
  st.comm->all_gather(s, mine, st.values);
}

void GradSync::wait_parameters() {
  b_.record(*done_, *stream_);
  b_.wait(compute_, *done_);
}

}  // namespace moelab
