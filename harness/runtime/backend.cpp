// harness/runtime/backend.cpp — the backend-independent part of Backend: tracked
// allocation, names, and the default stream.
#include "harness/runtime/backend.hpp"

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

const char* activation_name(Activation a) { return a == Activation::gelu ? "gelu" : "relu"; }

Activation parse_activation(const std::string& s) {
  if (s == "gelu") return Activation::gelu;
  if (s == "relu") return Activation::relu;
  throw ConfigError("unknown activation \"" + s + "\" (expected gelu or relu)");
}

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
  st->ptr = bytes ? raw_alloc(bytes, space, s) : nullptr;
  memory_.on_alloc(category, bytes, now());
  st->release = [this](Storage& x) {
    memory_.on_free(x.category, x.bytes, now());
    if (x.ptr) raw_free(x.ptr, x.bytes, x.space, *x.stream);
  };
  return Tensor(std::move(st), std::move(shape), dtype);
}

}  // namespace moelab
