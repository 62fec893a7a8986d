// harness/backends/cpu/mpi_comm.cpp — see mpi_comm.hpp.
#include "harness/backends/cpu/mpi_comm.hpp"

#include <climits>
#include <cstring>
#include <numeric>

#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::bf16: break;
  }
  throw Unsupported(std::string("MPI communicator: no reduction type for ") + dtype_name(t));
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(CpuBackend& b, MPI_Comm parent) : b_(b) {
    MPI_Comm_dup(parent, &data_);
    MPI_Comm_dup(parent, &ctrl_);
    MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(data_, &rank_);
    MPI_Comm_size(data_, &size_);
    // World rank of each member, for the topology and reports (MPI_Group_translate_ranks).
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    MPI_Comm_group(data_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    std::iota(ranks.begin(), ranks.end(), 0);
    world_ranks_.resize(ranks.size());
    MPI_Group_translate_ranks(mine, size_, ranks.data(), world, world_ranks_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Comm_free(&data_);
      MPI_Comm_free(&ctrl_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "mpi"; }
  std::unique_ptr<Communicator> dup() override { return std::make_unique<MpiCommunicator>(b_, data_); }
  // On the control-plane communicator: the data plane may be busy on a stream's worker.
  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm part = MPI_COMM_NULL;
    check(MPI_Comm_split(ctrl_, color < 0 ? MPI_UNDEFINED : color, key, &part), "MPI_Comm_split");
    if (part == MPI_COMM_NULL) return nullptr;
    auto c = std::make_unique<MpiCommunicator>(b_, part);
    MPI_Comm_free(&part);
    return c;
  }
  std::vector<int> world_ranks() const override { return world_ranks_; }

  void all_to_all_v(Stream& s, const Tensor& send, std::span<const Segment> sends, Tensor& recv,
                    std::span<const Segment> recvs) override {
    MOELAB_CHECK(send.dtype() == recv.dtype(), "all_to_all_v dtype mismatch");
    const std::size_t es = dtype_size(send.dtype());
    double local = 0;
    for (const auto& sg : sends) {
      check_segment(sg, send, "send");
      if (sg.peer == rank_) local += static_cast<double>(sg.count * static_cast<std::int64_t>(es));
    }
    for (const auto& sg : recvs) check_segment(sg, recv, "receive");
    std::vector<Segment> sv(sends.begin(), sends.end()), rv(recvs.begin(), recvs.end());
    const char* sp = static_cast<const char*>(send.raw());
    char* rp = static_cast<char*>(recv.raw());
    b_.enqueue(s, "all_to_all_v", cost_collective(segments_bytes_to_others(sends, rank_, send.dtype()), local),
               [this, sv = std::move(sv), rv = std::move(rv), sp, rp, es] {
                 std::vector<MPI_Request> reqs;
                 reqs.reserve(sv.size() + rv.size());
                 for (const auto& r : rv) {
                   if (!r.count) continue;
                   reqs.emplace_back();
                   check(MPI_Irecv(rp + r.offset * static_cast<std::int64_t>(es), bytes(r.count, es), MPI_BYTE,
                                   r.peer, 0, data_, &reqs.back()),
                         "MPI_Irecv");
                 }
                 for (const auto& x : sv) {
                   if (!x.count) continue;
                   reqs.emplace_back();
                   check(MPI_Isend(sp + x.offset * static_cast<std::int64_t>(es), bytes(x.count, es), MPI_BYTE,
                                   x.peer, 0, data_, &reqs.back()),
                         "MPI_Isend");
                 }
                 check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
               });
  }

  void all_gather(Stream& s, const Tensor& send, Tensor& recv) override {
    MOELAB_CHECK(recv.numel() == send.numel() * size_, "all_gather: recv must hold size * send elements");
    const void* sp = send.raw();
    void* rp = recv.raw();
    const int n = bytes(send.numel(), dtype_size(send.dtype()));
    b_.enqueue(s, "all_gather", cost_collective(static_cast<double>(n) * (size_ - 1), n), [=, this] {
      check(MPI_Allgather(sp, n, MPI_BYTE, rp, n, MPI_BYTE, data_), "MPI_Allgather");
    });
  }

  void reduce_scatter(Stream& s, const Tensor& send, Tensor& recv) override {
    MOELAB_CHECK(send.numel() == recv.numel() * size_, "reduce_scatter: send must hold size * recv elements");
    const MPI_Datatype t = mpi_type(send.dtype());
    const void* sp = send.raw();
    void* rp = recv.raw();
    const int n = count(recv.numel());
    const double b = static_cast<double>(recv.nbytes());
    // In place (recv is this rank's slice of send): MPI forbids overlapping buffers but for
    // MPI_IN_PLACE, whose input is the receive buffer and whose result lands at its start; the
    // result is then moved to this rank's slice.
    const bool in_place = rp == static_cast<const char*>(sp) + static_cast<std::size_t>(rank_) * recv.nbytes();
    const std::size_t bytes = recv.nbytes();
    b_.enqueue(s, "reduce_scatter", cost_collective(b * (size_ - 1), b), [=, this] {
      if (in_place) {
        void* whole = const_cast<void*>(sp);
        check(MPI_Reduce_scatter_block(MPI_IN_PLACE, whole, n, t, MPI_SUM, data_), "MPI_Reduce_scatter_block");
        if (rp != whole) std::memmove(rp, whole, bytes);
      } else {
        check(MPI_Reduce_scatter_block(sp, rp, n, t, MPI_SUM, data_), "MPI_Reduce_scatter_block");
      }
    });
  }

  void all_reduce(Stream& s, Tensor& buf) override {
    const MPI_Datatype t = mpi_type(buf.dtype());
    void* p = buf.raw();
    const int n = count(buf.numel());
    const double b = static_cast<double>(buf.nbytes());
    b_.enqueue(s, "all_reduce", cost_collective(2.0 * b * (size_ - 1) / size_, b), [=, this] {
      check(MPI_Allreduce(MPI_IN_PLACE, p, n, t, MPI_SUM, data_), "MPI_Allreduce");
    });
  }

  void send(Stream& s, const Tensor& t, int peer) override {
    const void* p = t.raw();
    const int n = bytes(t.numel(), dtype_size(t.dtype()));
    b_.enqueue(s, "send", cost_collective(n, 0), [=, this] { check(MPI_Send(p, n, MPI_BYTE, peer, 1, data_), "MPI_Send"); });
  }
  void recv(Stream& s, Tensor& t, int peer) override {
    void* p = t.raw();
    const int n = bytes(t.numel(), dtype_size(t.dtype()));
    b_.enqueue(s, "recv", cost_collective(0, n), [=, this] {
      check(MPI_Recv(p, n, MPI_BYTE, peer, 1, data_, MPI_STATUS_IGNORE), "MPI_Recv");
    });
  }

  void barrier() override { check(MPI_Barrier(ctrl_), "MPI_Barrier"); }

  std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& send) override {
    MOELAB_CHECK(send.size() % static_cast<std::size_t>(size_) == 0, "exchange_counts: size not a multiple of ranks");
    std::vector<std::int64_t> recv(send.size());
    const int c = static_cast<int>(send.size() / static_cast<std::size_t>(size_));
    check(MPI_Alltoall(send.data(), c, MPI_INT64_T, recv.data(), c, MPI_INT64_T, ctrl_), "MPI_Alltoall");
    return recv;
  }
  double all_reduce_max(double v) override {
    check(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, ctrl_), "MPI_Allreduce(max)");
    return v;
  }
  double all_reduce_sum(double v) override {
    check(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_SUM, ctrl_), "MPI_Allreduce(sum)");
    return v;
  }
  std::vector<std::string> all_gather_strings(const std::string& s) override {
    int len = static_cast<int>(s.size());
    std::vector<int> lens(static_cast<std::size_t>(size_)), displs(static_cast<std::size_t>(size_));
    check(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, ctrl_), "MPI_Allgather");
    int total = 0;
    for (int r = 0; r < size_; ++r) {
      displs[static_cast<std::size_t>(r)] = total;
      total += lens[static_cast<std::size_t>(r)];
    }
    std::string all(static_cast<std::size_t>(total), '\0');
    check(MPI_Allgatherv(s.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, ctrl_),
          "MPI_Allgatherv");
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r)
      out.push_back(all.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]),
                               static_cast<std::size_t>(lens[static_cast<std::size_t>(r)])));
    return out;
  }

 private:
  void check(int rc, const char* call) const {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw CommError("rank " + std::to_string(rank_) + ": " + call + " failed: " + std::string(msg, static_cast<std::size_t>(len)));
  }
  void check_segment(const Segment& sg, const Tensor& t, const char* what) const {
    if (sg.peer < 0 || sg.peer >= size_ || sg.offset < 0 || sg.count < 0 || sg.offset + sg.count > t.numel())
      throw CommError("rank " + std::to_string(rank_) + ": all_to_all_v " + what + " segment (peer " +
                      std::to_string(sg.peer) + ", offset " + std::to_string(sg.offset) + ", count " +
                      std::to_string(sg.count) + ") is outside the buffer " + t.describe() + " or the world of " +
                      std::to_string(size_));
  }
  int count(std::int64_t n) const {
    if (n > INT_MAX) throw CommError("rank " + std::to_string(rank_) + ": message of " + std::to_string(n) + " elements exceeds MPI's int count");
    return static_cast<int>(n);
  }
  int bytes(std::int64_t n, std::size_t es) const { return count(n * static_cast<std::int64_t>(es)); }

  CpuBackend& b_;
  MPI_Comm data_ = MPI_COMM_NULL, ctrl_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(CpuBackend& backend, MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(backend, comm);
}

}  // namespace moelab
