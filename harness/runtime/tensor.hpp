// harness/runtime/tensor.hpp — a tensor: shape, dtype, and (except on sim) bytes.
//
// Row-major, contiguous. A Tensor is a cheap handle: copies share the same Storage, and
// views (rows(), select(), reshape()) share it too with a byte offset. The Storage is
// returned to its backend when the last handle goes away; its bytes stay charged to the
// MemoryTracker until then.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "harness/runtime/dtype.hpp"

namespace moelab {

class Stream;

struct Storage {
  void* ptr = nullptr;      // null on the sim backend (shapes only)
  std::size_t bytes = 0;
  MemSpace space = MemSpace::device;
  MemCategory category = MemCategory::buffers;
  Stream* stream = nullptr; // the stream the allocation is ordered on (frees are too)
  int microbatch = -1;      // the microbatch it was allocated for (kNoMicrobatch = none)
  std::function<void(Storage&)> release;  // set by the backend
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (release) release(*this);
  }
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> s, std::vector<std::int64_t> shape, DType dtype, std::size_t offset = 0);

  bool defined() const { return storage_ != nullptr; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  MemSpace space() const { return storage_->space; }
  MemCategory category() const { return storage_->category; }
  Stream* stream() const { return storage_ ? storage_->stream : nullptr; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  std::size_t offset() const { return offset_; }

  // Raw pointer (null on sim). data<T>() checks nothing but the pointer arithmetic.
  void* raw() const;
  template <class T>
  T* data() const {
    return static_cast<T*>(raw());
  }

  // Views sharing storage.
  Tensor rows(std::int64_t begin, std::int64_t count) const;  // slice of dim 0
  Tensor select(std::int64_t i) const;                         // drop dim 0: t[i]
  Tensor reshape(std::vector<std::int64_t> shape) const;       // same numel
  // The same first row and `count` rows, which may run past this view's rows up to the end
  // of the storage (a padded layout's rows beyond a view).
  Tensor widen_rows(std::int64_t count) const;

  std::string describe() const;  // "[T=1000, M=64] fp32" style, for messages

 private:
  std::shared_ptr<Storage> storage_;
  std::vector<std::int64_t> shape_;
  DType dtype_ = DType::f32;
  std::size_t offset_ = 0;  // bytes into storage
};

std::string shape_str(const std::vector<std::int64_t>& shape);

}  // namespace moelab
