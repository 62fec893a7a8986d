// harness/runtime/tensor.cpp
#include "harness/runtime/tensor.hpp"

#include <numeric>
#include <sstream>

#include "harness/runtime/error.hpp"

namespace moelab {

Tensor::Tensor(std::shared_ptr<Storage> s, std::vector<std::int64_t> shape, DType dtype, std::size_t offset)
    : storage_(std::move(s)), shape_(std::move(shape)), dtype_(dtype), offset_(offset) {
  for (auto d : shape_) MOELAB_CHECK(d >= 0, "negative dimension in " + shape_str(shape_));
  MOELAB_CHECK(offset_ + nbytes() <= storage_->bytes, "tensor view exceeds its storage");
}

std::int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim();
  MOELAB_CHECK(i >= 0 && i < ndim(), "dim index out of range for " + shape_str(shape_));
  return shape_[static_cast<std::size_t>(i)];
}

std::int64_t Tensor::numel() const {
  return std::accumulate(shape_.begin(), shape_.end(), std::int64_t{1}, std::multiplies<>());
}

void* Tensor::raw() const {
  if (!storage_ || !storage_->ptr) return nullptr;
  return static_cast<char*>(storage_->ptr) + offset_;
}

Tensor Tensor::rows(std::int64_t begin, std::int64_t count) const {
  MOELAB_CHECK(ndim() >= 1 && begin >= 0 && count >= 0 && begin + count <= shape_[0],
               "rows(" + std::to_string(begin) + ", " + std::to_string(count) + ") of " + shape_str(shape_));
  auto shape = shape_;
  shape[0] = count;
  const std::size_t row_bytes = shape_[0] ? nbytes() / static_cast<std::size_t>(shape_[0]) : 0;
  return Tensor(storage_, std::move(shape), dtype_, offset_ + static_cast<std::size_t>(begin) * row_bytes);
}

Tensor Tensor::widen_rows(std::int64_t count) const {
  MOELAB_CHECK(ndim() >= 1 && count >= 0, "widen_rows(" + std::to_string(count) + ") of " + shape_str(shape_));
  std::size_t row_bytes = dtype_size(dtype_);
  for (std::size_t i = 1; i < shape_.size(); ++i) row_bytes *= static_cast<std::size_t>(shape_[i]);
  MOELAB_CHECK(offset_ + static_cast<std::size_t>(count) * row_bytes <= storage_->bytes,
               "widen_rows(" + std::to_string(count) + ") of " + shape_str(shape_) + " runs past its storage");
  auto shape = shape_;
  shape[0] = count;
  return Tensor(storage_, std::move(shape), dtype_, offset_);
}

Tensor Tensor::select(std::int64_t i) const {
  Tensor r = rows(i, 1);
  r.shape_.erase(r.shape_.begin());
  return r;
}

Tensor Tensor::reshape(std::vector<std::int64_t> shape) const {
  Tensor r = *this;
  r.shape_ = std::move(shape);
  MOELAB_CHECK(r.numel() == numel(), "reshape " + shape_str(shape_) + " -> " + shape_str(r.shape_));
  return r;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

std::string Tensor::describe() const { return shape_str(shape_) + " " + dtype_name(dtype_); }

}  // namespace moelab
