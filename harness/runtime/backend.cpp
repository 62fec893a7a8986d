// harness/runtime/backend.cpp — the backend-independent part of Backend: tracked
// allocation, names, and the default stream.
#include "harness/runtime/backend.hpp"

#include <utility>

#include "harness/runtime/error.hpp"

namespace moelab {

const char* stream_role_name(StreamRole r) {
  switch (r) {
    case StreamRole::compute: return "compute";
    case StreamRole::dispatch: return "dispatch";
    case StreamRole::combine: return "combine";
    case StreamRole::h2d: return "h2d";
    case StreamRole::d2h: return "d2h";
    case StreamRole::aux: return "aux";
  }
  return "?";
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::gelu: return "gelu";
    case Activation::relu: return "relu";
    case Activation::gelu_tanh: return "gelu_tanh";
  }
  return "?";
}

GemmProblem padded_problem(const GemmProblem& p) {
  GemmProblem q = p;
  const std::int64_t S = p.token_stride;
  // A weight gradient (A transposed, B not): the tokens are the inner dimension k, the rows of
  // A [k,m] and B [k,n]. Otherwise they are m, the rows of A [m,k] and C [m,n].
  const bool wgrad = p.trans_a && !p.trans_b;
  const std::int64_t rows = wgrad ? p.k : p.m;
  MOELAB_CHECK(S > 0 && rows >= 0 && rows <= S,
               "padded_problem: " + std::to_string(rows) + " token rows in a stride of " + std::to_string(S));
  if (wgrad) {
    q.k = S;
    q.a = p.a.widen_rows(S);
    q.b = p.b.widen_rows(S);
  } else {
    MOELAB_CHECK(!p.trans_a, "padded_problem: the token rows of a problem with A transposed are its k (B not transposed)");
    q.m = S;
    q.a = p.a.widen_rows(S);
    q.c = p.c.widen_rows(S);
    if (p.aux.defined()) q.aux = p.aux.widen_rows(S);
  }
  return q;
}

std::int64_t common_token_stride(std::span<const GemmProblem> problems) {
  if (problems.empty()) return 0;
  const std::int64_t S = problems.front().token_stride;
  for (const auto& p : problems)
    if (p.token_stride != S) return 0;
  return S;
}

const char* gemm_epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::none: return "none";
    case GemmEpilogue::act_aux: return "act_aux";
    case GemmEpilogue::dact: return "dact";
  }
  return "?";
}

namespace {
constexpr Activation kActivations[] = {Activation::gelu, Activation::relu, Activation::gelu_tanh};
}  // namespace

const std::vector<std::string>& activation_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (Activation a : kActivations) v.emplace_back(activation_name(a));
    return v;
  }();
  return names;
}

Activation parse_activation(const std::string& s) {
  for (Activation a : kActivations)
    if (s == activation_name(a)) return a;
  throw ConfigError("unknown activation \"" + s + "\" (expected gelu, relu or gelu_tanh)");
}

const char* norm_name(NormKind k) { return k == NormKind::layernorm ? "layernorm" : "rmsnorm"; }

NormKind parse_norm(const std::string& s) {
  if (s == "layernorm") return NormKind::layernorm;
  if (s == "rmsnorm") return NormKind::rmsnorm;
  throw ConfigError("unknown norm \"" + s + "\" (expected layernorm or rmsnorm)");
}

// The transformer-block ops: a backend that has not implemented one says so by name.
namespace {
[[noreturn]] void not_on(const Backend& b, const char* op) {
  throw Unsupported(std::string(op) + " is not implemented on the " + b.name() + " backend");
}
}  // namespace
void check_gemm_epilogue(std::span<const GemmProblem> problems, GemmEpilogue ep) {
  MOELAB_CHECK(ep != GemmEpilogue::none, "grouped_gemm_epilogue: no epilogue (use grouped_gemm)");
  for (const auto& p : problems) {
    const std::string what = std::string("grouped_gemm_epilogue (") + gemm_epilogue_name(ep) + ")";
    MOELAB_CHECK(p.alpha == 1.0f && p.beta == 0.0f, what + ": alpha 1 and beta 0 only");
    MOELAB_CHECK(!p.trans_a, what + ": A transposed (a weight gradient) has no activation epilogue");
    MOELAB_CHECK(p.c.defined() && p.aux.defined() && p.aux.dtype() == p.c.dtype() && p.aux.numel() == p.m * p.n &&
                     p.c.numel() == p.m * p.n,
                 what + ": C and aux must both hold the [" + std::to_string(p.m) + "x" + std::to_string(p.n) +
                     "] product in one dtype: " + (p.c.defined() ? p.c.describe() : std::string("undefined")) +
                     ", " + (p.aux.defined() ? p.aux.describe() : std::string("undefined")));
  }
}

void Backend::grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep,
                                    Activation act, const char* name) {
  check_gemm_epilogue(problems, ep);
  std::vector<GemmProblem> ps(problems.begin(), problems.end());
  if (ep == GemmEpilogue::act_aux)
    for (auto& p : ps) std::swap(p.c, p.aux);  // the product into aux; C gets act(aux) below
  grouped_gemm(s, ps, name);
  for (const auto& p : ps) {
    if (p.m == 0 || p.n == 0) continue;
    if (ep == GemmEpilogue::act_aux) {
      Tensor out = p.aux;  // the caller's C (swapped above)
      activation_forward(s, act, p.c, out);
    } else {
      Tensor d = p.c;
      activation_backward(s, act, p.aux, d, d);
    }
  }
}

void Backend::embedding_forward(Stream&, const Tensor&, const Tensor&, const Tensor&, std::int64_t, Tensor&,
                                const VocabShard&) {
  not_on(*this, "embedding_forward");
}
void Backend::embedding_backward(Stream&, const Tensor&, const Tensor&, std::int64_t, Tensor&, Tensor&,
                                 const VocabShard&) {
  not_on(*this, "embedding_backward");
}
void Backend::norm_forward(Stream&, NormKind, float, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                           Tensor&) {
  not_on(*this, "norm_forward");
}
void Backend::norm_backward(Stream&, NormKind, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, Tensor&, Tensor&, Tensor&) {
  not_on(*this, "norm_backward");
}
void Backend::rope(Stream&, const AttentionShape&, float, bool, Tensor&) { not_on(*this, "rope"); }
void Backend::attention_forward(Stream&, const AttentionShape&, const Tensor&, Tensor&, Tensor&) {
  not_on(*this, "attention_forward");
}
void Backend::attention_backward(Stream&, const AttentionShape&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, Tensor&) {
  not_on(*this, "attention_backward");
}
void Backend::swiglu_forward(Stream&, const Tensor&, Tensor&) { not_on(*this, "swiglu_forward"); }
void Backend::swiglu_backward(Stream&, const Tensor&, const Tensor&, Tensor&) { not_on(*this, "swiglu_backward"); }
void Backend::add(Stream&, const Tensor&, const Tensor&, Tensor&) { not_on(*this, "add"); }
void Backend::gated_combine_forward(Stream&, const Tensor&, const Tensor&, const Tensor&, Tensor&) {
  not_on(*this, "gated_combine_forward");
}
void Backend::gated_combine_backward(Stream&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
                                     Tensor&, Tensor&) {
  not_on(*this, "gated_combine_backward");
}
void Backend::scale(Stream&, const Tensor&, float, Tensor&) { not_on(*this, "scale"); }
void Backend::cross_entropy_forward(Stream&, const Tensor&, const Tensor&, Tensor&, Tensor&, const VocabShard&) {
  not_on(*this, "cross_entropy_forward");
}
void Backend::cross_entropy_combine(Stream&, const Tensor&, const Tensor&, std::int64_t, Tensor&, Tensor&) {
  not_on(*this, "cross_entropy_combine");
}
void Backend::cross_entropy_backward(Stream&, const Tensor&, const Tensor&, const Tensor&, float, Tensor&,
                                     const VocabShard&) {
  not_on(*this, "cross_entropy_backward");
}
void Backend::optimizer_step(Stream&, const OptimizerStep&) { not_on(*this, "optimizer_step"); }

Stream& Backend::default_stream() {
  if (!default_stream_) default_stream_ = &create_stream(StreamRole::compute, "compute");
  return *default_stream_;
}

Tensor Backend::empty(std::vector<std::int64_t> shape, DType dtype, MemCategory category, Stream& s,
                      MemSpace space) {
  if (!supports(dtype))
    throw Unsupported(std::string("the ") + name() + " backend does not support " + dtype_name(dtype));
  std::int64_t n = 1;
  for (auto d : shape) {
    MOELAB_CHECK(d >= 0, "negative dimension in " + shape_str(shape));
    n *= d;
  }
  const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(dtype);
  if (space == MemSpace::host_pinned) category = MemCategory::host_pinned;
  auto st = std::make_shared<Storage>();
  st->bytes = bytes;
  st->space = space;
  st->category = category;
  st->stream = &s;
  st->microbatch = microbatch_;
  st->ptr = bytes ? raw_alloc(bytes, space, s) : nullptr;
  memory_.on_alloc(category, bytes, now(), microbatch_);
  if (capturing_) captured_.push_back(st);
  st->release = [this](Storage& x) {
    memory_.on_free(x.category, x.bytes, now(), x.microbatch);
    if (x.ptr) raw_free(x.ptr, x.bytes, x.space, *x.stream);
  };
  return Tensor(std::move(st), std::move(shape), dtype);
}

void Backend::start_capture() {
  MOELAB_CHECK(!capturing_, "Backend::start_capture while a capture is running");
  capturing_ = true;
  captured_.clear();
}

std::vector<std::weak_ptr<Storage>> Backend::stop_capture() {
  MOELAB_CHECK(capturing_, "Backend::stop_capture without start_capture");
  capturing_ = false;
  return std::exchange(captured_, {});
}

void Backend::relocate(const std::shared_ptr<Storage>& st, MemSpace space, MemCategory category, Stream& alloc_on,
                       Stream& copy_on) {
  MOELAB_CHECK(st && st->space != space, "Backend::relocate: the storage is already there");
  if (st->bytes == 0) {
    st->space = space;
    return;
  }
  // A flat view in a type whose size divides the bytes; a same-type copy moves bytes unchanged.
  const DType view = st->bytes % 4 == 0 ? DType::f32 : DType::bf16;
  MOELAB_CHECK(st->bytes % dtype_size(view) == 0, "Backend::relocate: " + std::to_string(st->bytes) + " bytes");
  const auto n = static_cast<std::int64_t>(st->bytes / dtype_size(view));
  Tensor dst;
  {
    MicrobatchScope m(*this, st->microbatch);
    dst = empty({n}, view, category, alloc_on, space);
  }
  copy(copy_on, Tensor(st, {n}, view), dst);
  // Swap locations: `st` (shared by every handle) takes the new bytes, `dst`'s storage the old,
  // freed when dst goes, ordered after the copy that reads them.
  Storage& now_new = *st;
  Storage& now_old = *dst.storage();
  std::swap(now_new.ptr, now_old.ptr);
  std::swap(now_new.space, now_old.space);
  std::swap(now_new.category, now_old.category);
  std::swap(now_new.stream, now_old.stream);
  now_old.stream = &copy_on;
}

}  // namespace moelab
