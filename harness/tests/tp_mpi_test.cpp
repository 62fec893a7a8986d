// harness/tests/tp_mpi_test.cpp — tensor parallelism (and sequence parallelism) on N MPI ranks
// (cpu backend, Open MPI): a GPT-style dense model, a LLaMA-style one (RMSNorm, SwiGLU, rotary
// positions, grouped-query attention with the key/value heads split too) and an MoE model
// (with a shared expert), split over a TP group of all N ranks — heads, FFN columns and the
// vocabulary (embedding rows, LM-head columns, the vocabulary-parallel cross-entropy) — give the
// unsplit model's parameters, loss and every parameter gradient on the same seed; with a
// vocabulary that does not divide, the split model is the unsplit one with Megatron's padding.
//   mpirun --oversubscribe -np 4 build/harness/tests/tp_mpi_test
// Two microbatches are in flight (forward, forward, backward_input of the second, then of the
// first, backward_weight of both), the gradients completed by the synchroniser (GradSync) over
// the layout's groups; every split gradient is gathered back to its full shape. The reference
// is the same model with no tensor parallelism, run in each rank's own process.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "harness/comm/groups.hpp"
#include "harness/nn/grad_sync.hpp"
#include "harness/nn/model.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/parallel_test_util.hpp"

namespace moelab {
namespace {

std::uint64_t g_seed = 0;  // agreed across ranks in main()

enum class Kind { gpt, llama, moe };
const char* kind_name(Kind k) { return k == Kind::gpt ? "gpt" : k == Kind::llama ? "llama" : "moe"; }

TransformerConfig config(Kind k) {
  TransformerConfig c;
  c.name = kind_name(k);
  c.origin = "<test>";
  c.d_model = 32;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.d_ffn = 52;  // 13 columns per rank at TP = 4
  c.num_layers = 2;
  c.seq_len = 8;
  c.vocab_size = 44;  // 11 rows of the vocabulary per rank at TP = 4
  c.dtype = DType::f32;
  if (k == Kind::llama) {
    c.num_heads = 8;
    c.num_kv_heads = 4;  // two query heads per key/value head on every rank
    c.norm = NormKind::rmsnorm;
    c.mlp = MlpKind::swiglu;
    c.positions = PositionKind::rotary;
    c.tie_embeddings = false;
  }
  if (k == Kind::moe) {
    c.moe_layers = MoELayers::every_second;
    c.moe.name = "moe";
    c.moe.d_model = c.d_model;
    c.moe.d_hidden = 24;
    c.moe.num_experts = 4;
    c.moe.top_k = 2;
    c.moe.capacity_factor = 0.0;  // no dropping: capacity depends on the tokens a rank holds
    c.moe.dtype = DType::f32;
    c.shared_expert_hidden = 12;
  }
  return c;
}

struct Case {
  Kind kind;
  bool sp;
  bool ep = false;   // MoE: experts over an expert-parallel group of all ranks (else every rank holds all)
  bool pad = false;  // a vocabulary of 42, padded to a multiple of TP (44 at TP = 4)
  bool noisy = false;  // MoE: the noisy gate (the TP ranks hold the same tokens and must draw the same noise)
  double capacity = 0.0;  // MoE: a capacity factor that drops slots (without SP every TP rank holds all T tokens)
};
std::string case_name(const ::testing::TestParamInfo<Case>& p) {
  return std::string(kind_name(p.param.kind)) + (p.param.sp ? "_sp" : "") + (p.param.ep ? "_ep" : "") +
         (p.param.pad ? "_padded_vocab" : "") + (p.param.noisy ? "_noisy_gate" : "") +
         (p.param.capacity > 0 ? "_dropping" : "");
}

constexpr std::int64_t kSequences = 2;  // per microbatch: T = 16, divisible by 1, 2 and 4
constexpr int kMicrobatches = 2;

struct Result {
  std::vector<double> loss;                       // per microbatch
  std::map<std::string, std::vector<float>> value, grad;  // full shapes
  std::vector<std::int64_t> routed;               // per MoE layer and expert, over the TP group
  std::int64_t dropped = 0;                       // slots dropped by capacity, every MoE layer
  std::vector<double> aux;                        // per microbatch: the load-balancing loss, every MoE layer
  std::size_t held[2] = {0, 0}, left[2] = {0, 0};  // bytes charged to each microbatch in flight, and after
};

// The model split over pg's groups (on pg's backend), or unsplit on a backend of its own; its
// batches are tokens of the first data_vocab of the vocabulary.
Result run(Backend* pg_backend, ProcessGroups* pg, const TransformerConfig& cfg, std::int64_t data_vocab,
           std::uint64_t seed, bool sp, float aux_coef) {
  std::unique_ptr<Backend> own = pg ? nullptr : make_backend("cpu");
  Backend* b = pg ? pg_backend : own.get();
  auto self = make_self_communicator(*b);
  ModelOptions opt;
  opt.aux_loss_coef = aux_coef;
  opt.tp = pg ? &pg->tp() : nullptr;
  opt.sequence_parallel = sp;
  Communicator& ep = pg ? pg->ep() : *self;
  Model model(*b, ep, cfg, opt);
  model.init_parameters(seed);
  std::unique_ptr<GradSync> sync;
  if (pg) {
    sync = std::make_unique<GradSync>(*b, model.stream(), model.param_slots(), pg->dp(), pg->edp(),
                                      model.tensor_parallel(), GradSyncOptions{.bucket_elems = 1000});
    model.set_grad_sync(sync.get());
  }
  const auto next = synthetic_successor(data_vocab, seed);
  const float scale = 1.0f / static_cast<float>(kMicrobatches * kSequences * cfg.seq_len);
  std::vector<Batch> x;
  for (int mb = 0; mb < kMicrobatches; ++mb)
    x.push_back(test::token_batch(*b, cfg, next, kSequences, seed, 1, mb, 0, scale));
  model.zero_grad();
  Forwarded f0 = model.forward(x[0], {0, 0, 1});
  Forwarded f1 = model.forward(x[1], {0, 1, 1});
  Result res;
  for (int mb = 0; mb < kMicrobatches; ++mb) res.held[mb] = b->memory().microbatch_in_use()[mb];
  res.loss = {model.loss(*f0.saved), model.loss(*f1.saved)};
  // Under SP each TP rank holds its share of the sequence's load-balancing loss.
  for (Forwarded* f : {&f0, &f1}) {
    const double a = model.aux_loss(*f->saved);
    res.aux.push_back(pg && sp ? pg->tp().all_reduce_sum(a) : a);
  }
  for (MoEImpl* m : model.moe_layers()) {  // both microbatches' routing
    auto r = m->layer().routed_totals();
    if (pg && sp)  // each TP rank routed its own rows
      for (auto& n : r) n = std::llround(pg->tp().all_reduce_sum(static_cast<double>(n)));
    res.routed.insert(res.routed.end(), r.begin(), r.end());
    res.dropped += m->routing().dropped;
  }
  model.backward_input(*f1.saved, Tensor());
  model.backward_input(*f0.saved, Tensor());
  model.backward_weight(*f0.saved);
  if (sync) sync->arm();  // microbatch 1's weight gradients are the step's last
  model.backward_weight(*f1.saved);
  f0 = Forwarded{};  // the saved state, and y (the per-token losses)
  f1 = Forwarded{};
  if (sync) sync->finish();
  b->synchronize();
  for (int mb = 0; mb < kMicrobatches; ++mb) res.left[mb] = b->memory().microbatch_in_use()[mb];
  for (const Param& p : model.parameters()) {
    res.value[p.name] = pg ? test::full_tensor(*b, p, p.value, pg->tp(), pg->ep()) : b->download(p.value);
    res.grad[p.name] = pg ? test::full_tensor(*b, p, p.grad, pg->tp(), pg->ep()) : b->download(p.grad);
  }
  return res;
}

class TensorParallelMpi : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelMpi, LossAndGradientsEqualTheUnsplitModel) {
  const Case c = GetParam();
  auto b = make_backend("cpu");
  auto world = make_world_communicator(*b);
  const int n = world->size();
  TransformerConfig cfg = config(c.kind);
  // Padded, the split model's vocabulary is the unsplit model's of the padded size, whose
  // extra rows no token uses (Megatron's padding: their logits still enter the softmax).
  if (c.pad) cfg.vocab_size = 42;
  // The noisy gate keyed on the TP group (its lowest world rank, 0 here, as the reference's
  // rank): the same noise on every TP rank, whatever its rank in the expert-parallel group.
  if (c.noisy) cfg.moe.noisy_gate = true;
  // Capacity counts the tokens a rank routes: without SP every TP rank routes the unsplit
  // model's T, so the same slots are dropped (and get no expert output, nor its gradient).
  if (c.capacity > 0) cfg.moe.capacity_factor = c.capacity;
  TransformerConfig ref_cfg = cfg;
  ref_cfg.vocab_size = (cfg.vocab_size + n - 1) / n * n;
  const std::string spec = "tp=" + std::to_string(n) + (c.ep ? ",ep=" + std::to_string(n) : "");
  const GroupLayout layout = check_layout(ParallelLayout::parse(spec), n, n, cfg);
  ProcessGroups pg(*world, layout, gather_nodes(*world));
  // Under sequence parallelism the load-balancing loss is still the whole sequence's (its
  // counts summed over the TP group, as Megatron-Core does), so its value and gradient are the
  // unsplit model's.
  const float aux = 0.1f;
  // fp32 sums in another order may move a gate probability across a near-tie and flip a token's
  // expert: the ranks agree on a seed whose routing matches the reference's (the gradients
  // are then compared in full).
  std::uint64_t seed = g_seed;
  Result ref, tp;
  for (int attempt = 0;; ++attempt, seed = Rng::mix(seed, 99)) {
    ref = run(nullptr, nullptr, ref_cfg, cfg.vocab_size, seed, false, aux);
    tp = run(b.get(), &pg, cfg, cfg.vocab_size, seed, c.sp, aux);
    const bool same = world->all_reduce_max(tp.routed == ref.routed && tp.dropped == ref.dropped ? 0.0 : 1.0) == 0.0;
    if (same || attempt == 3) {
      EXPECT_TRUE(same) << "routing differs from the reference on every seed tried";
      break;
    }
  }
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + layout.to_string());
  if (c.capacity > 0) {
    EXPECT_GT(tp.dropped, 0) << "the capacity factor dropped nothing";
  }
  ASSERT_EQ(tp.value.size(), ref.value.size());
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    EXPECT_NEAR(tp.loss[static_cast<std::size_t>(mb)], ref.loss[static_cast<std::size_t>(mb)],
                1e-5 * ref.loss[static_cast<std::size_t>(mb)]);
    EXPECT_NEAR(tp.aux[static_cast<std::size_t>(mb)], ref.aux[static_cast<std::size_t>(mb)],
                1e-5 * ref.aux[static_cast<std::size_t>(mb)]);
    // The split model's saved state is charged to its microbatch (less of it than unsplit with
    // more than one rank, the heads, columns and, under SP, rows being split) and all returned.
    EXPECT_GT(tp.held[mb], 0u);
    if (n > 1 && c.kind != Kind::moe) {
      EXPECT_LT(tp.held[mb], ref.held[mb]);
    }
    EXPECT_EQ(tp.left[mb], 0u);
  }
  for (const auto& [name, v] : ref.value) {
    ASSERT_TRUE(tp.value.count(name)) << name;
    EXPECT_EQ(tp.value[name], v) << name << ": the split initialisation is not the unsplit one's";
    EXPECT_TRUE(test::all_close(name + " grad", tp.grad[name], test::to_double(ref.grad[name]), 2e-5));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallelMpi,
                         ::testing::Values(Case{Kind::gpt, false}, Case{Kind::gpt, true}, Case{Kind::llama, false},
                                           Case{Kind::llama, true}, Case{Kind::moe, false}, Case{Kind::moe, true},
                                           Case{Kind::moe, false, true}, Case{Kind::moe, true, true},
                                           Case{Kind::moe, false, true, false, true}, Case{Kind::moe, false, false, false, true},
                                           Case{Kind::gpt, true, false, true}, Case{Kind::llama, false, false, true},
                                           Case{.kind = Kind::moe, .sp = false, .capacity = 0.5},
                                           Case{.kind = Kind::moe, .sp = false, .ep = true, .capacity = 0.5}),
                         case_name);

// A size that does not split is a ConfigError naming it, before any collective.
TEST(TensorParallelMpi, SizesThatDoNotSplitAreConfigErrors) {
  auto b = make_backend("cpu");
  auto world = make_world_communicator(*b);
  if (world->size() == 1) GTEST_SKIP() << "needs two ranks";
  TransformerConfig cfg = config(Kind::gpt);
  cfg.num_heads = cfg.num_kv_heads = 1;
  cfg.d_model = 32;
  auto tp = world->dup();
  EXPECT_THROW(Model(*b, *world, cfg, {.tp = tp.get()}), ConfigError);
  cfg = config(Kind::gpt);
  cfg.d_ffn = 45;
  EXPECT_THROW(Model(*b, *world, cfg, {.tp = tp.get()}), ConfigError);
}

}  // namespace
}  // namespace moelab

int main(int argc, char** argv) { return moelab::test::mpi_test_main(argc, argv, moelab::g_seed); }
