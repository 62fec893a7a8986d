// harness/nn/tensor_parallel.cpp — the edges of a tensor-parallel region and the cut of a
// split parameter (see tensor_parallel.hpp).
//   ctest --test-dir build -R tp_mpi_test
#include "harness/nn/tensor_parallel.hpp"

#include "harness/runtime/error.hpp"

namespace moelab {

Tensor TensorParallel::enter(Backend& b, Stream& s, const Tensor& x, MemCategory cat) const {
  if (!sp()) return x;
  Tensor full = b.empty({x.dim(0) * size(), x.dim(1)}, x.dtype(), cat, s);  // [T,M]
  comm->all_gather(s, x, full);
  return full;
}

Tensor TensorParallel::enter_backward(Backend& b, Stream& s, Tensor d_in, MemCategory cat) const {
  if (!on()) return d_in;
  if (!sp()) {
    comm->all_reduce(s, d_in);
    return d_in;
  }
  Tensor mine = b.empty({d_in.dim(0) / size(), d_in.dim(1)}, d_in.dtype(), cat, s);  // [T/TP,M]
  comm->reduce_scatter(s, d_in, mine);
  return mine;
}

Tensor TensorParallel::leave(Backend& b, Stream& s, Tensor y, MemCategory cat) const {
  return enter_backward(b, s, std::move(y), cat);
}

Tensor TensorParallel::leave_backward(Backend& b, Stream& s, const Tensor& dy, MemCategory cat) const {
  return enter(b, s, dy, cat);
}

// ---- split parameters ----------------------------------------------------------------------

std::vector<std::pair<std::int64_t, std::int64_t>> TpShard::pieces(int r) const {
  if (!split()) return {{0, full}};
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (const auto& [start, len] : segments) {
    const std::int64_t part = len / size;
    out.emplace_back(start + r * part, part);
  }
  return out;
}

std::int64_t TpShard::local() const { return split() ? full / size : full; }

TpShard tp_shard(const TensorParallel& tp, int dim, std::int64_t full,
                 std::vector<std::pair<std::int64_t, std::int64_t>> segments, const std::string& what) {
  TpShard sh;
  if (!tp.on()) return sh;
  sh.dim = dim;
  sh.full = full;
  sh.segments = segments.empty() ? std::vector<std::pair<std::int64_t, std::int64_t>>{{0, full}} : std::move(segments);
  sh.rank = tp.rank();
  sh.size = tp.size();
  for (const auto& seg : sh.segments)
    if (seg.second % sh.size != 0)
      throw ConfigError(what + ": " + std::to_string(seg.second) + " is not divisible by the tensor-parallel size " +
                        std::to_string(sh.size));
  return sh;
}

namespace {
// Calls f(full_index, part_index) for every element of rank r's part.
template <class F>
void for_each_shard_element(std::int64_t rows, std::int64_t cols, const TpShard& sh, int r, F f) {
  const auto pieces = sh.pieces(r);
  std::int64_t at = 0;
  if (!sh.split()) {
    for (std::int64_t i = 0; i < rows * cols; ++i) f(i, i);
  } else if (sh.dim == 0) {
    for (const auto& [start, len] : pieces)
      for (std::int64_t i = start; i < start + len; ++i)
        for (std::int64_t c = 0; c < cols; ++c) f(i * cols + c, at++);
  } else {
    for (std::int64_t i = 0; i < rows; ++i)
      for (const auto& [start, len] : pieces)
        for (std::int64_t c = start; c < start + len; ++c) f(i * cols + c, at++);
  }
}
}  // namespace

std::vector<float> take_shard(const std::vector<float>& full, std::int64_t rows, std::int64_t cols, const TpShard& sh,
                              int rank) {
  MOELAB_CHECK(static_cast<std::int64_t>(full.size()) == rows * cols, "take_shard: size");
  const std::int64_t n = sh.split() ? rows * cols / sh.size : rows * cols;
  std::vector<float> part(static_cast<std::size_t>(n));
  for_each_shard_element(rows, cols, sh, rank, [&](std::int64_t i, std::int64_t j) {
    part[static_cast<std::size_t>(j)] = full[static_cast<std::size_t>(i)];
  });
  return part;
}

void place_shard(std::vector<float>& full, std::int64_t rows, std::int64_t cols, const TpShard& sh, int rank,
                 const std::vector<float>& part) {
  MOELAB_CHECK(static_cast<std::int64_t>(full.size()) == rows * cols, "place_shard: size");
  for_each_shard_element(rows, cols, sh, rank, [&](std::int64_t i, std::int64_t j) {
    full[static_cast<std::size_t>(i)] = part[static_cast<std::size_t>(j)];
  });
}

}  // namespace moelab
