// harness/backends/cuda/nccl_comm.cpp — NcclCommunicator (see nccl_comm.hpp).
//
// Data plane: every call is one NCCL operation (or one ncclGroupStart/End of point-to-point
// calls for all_to_all_v) on the caller's stream, wrapped in a CudaOpScope so that the
// timeline shows it like any other op. Data moves as bytes (ncclChar) except where NCCL
// must know the type to reduce.
//
// Control plane: small blocking exchanges through a private stream and a device scratch
// buffer; they are metadata (token counts, timings), never on the critical path of a step.
//
// With a watchdog (NcclWatch: the world communicator of several ranks and its splits), an event
// recorded after every op, data or control plane, lets its thread see ops that never complete.
#include "harness/backends/cuda/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <utility>
#include <vector>

#include "harness/backends/cuda/cuda_backend.hpp"
#include "harness/comm/watchdog.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

static_assert(NCCL_UNIQUE_ID_BYTES == 128, "ncclUniqueId is expected to be 128 bytes");

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
  }
  return ncclChar;
}

// CUDA events for the watchdog's ops, reused: one is recorded after every op of a watched
// communicator and comes back once the watchdog has seen it complete (from its thread).
class EventRecycler {
 public:
  ~EventRecycler() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  // On the calling thread's current device (the communicator's).
  cudaEvent_t take() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (err != cudaSuccess) throw CommError(std::string("cudaEventCreate (collective watchdog) failed: ") + cudaGetErrorString(err));
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard lock(mu_);
    free_.push_back(e);
  }

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// What the watchdog polls: NCCL's asynchronous error of the communicator ("" while healthy).
std::string nccl_async_error(ncclComm_t comm) {
  ncclResult_t st = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm, &st);
  if (r != ncclSuccess) return std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(r);
  if (st == ncclSuccess || st == ncclInProgress) return "";
  std::string m = ncclGetErrorString(st);
  const char* last = ncclGetLastError(comm);
  if (last && *last) m += std::string(" (") + last + ")";
  return m + " (run with NCCL_DEBUG=WARN for details)";
}

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`. world_ranks: the world rank of each member, by rank in `comm`.
  // watchdog: shared with the communicator it was split from, or null (none).
  NcclCommunicator(Backend& b, ncclComm_t comm, int rank, int size, std::vector<int> world_ranks,
                   std::shared_ptr<CollectiveWatchdog> watchdog)
      : b_(b), device_(cuda_device_of(b)), comm_(comm), rank_(rank), size_(size), world_ranks_(std::move(world_ranks)),
        watchdog_(std::move(watchdog)) {
    try {
      cuda(cudaSetDevice(device_), "cudaSetDevice");
      cuda(cudaStreamCreateWithFlags(&ctrl_, cudaStreamNonBlocking), "cudaStreamCreate");
    } catch (...) {
      ncclCommDestroy(comm_);  // the destructor does not run for a throwing constructor
      throw;
    }
    if (watchdog_) watch_handle_ = watchdog_->watch(describe(), [c = comm_] { return nccl_async_error(c); });
  }
  ~NcclCommunicator() override {
    if (watchdog_) watchdog_->unwatch(watch_handle_);  // before the communicator goes
    cudaSetDevice(device_);
    // Destroyed while an error unwinds: a collective this rank issued may never be matched by
    // the others, and ncclCommDestroy (and every stream synchronisation after it) would wait
    // for it for ever, before main could abort the world. ncclCommAbort ends what is pending.
    if (comm_ && std::uncaught_exceptions() > 0) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (ctrl_) cudaStreamSynchronize(ctrl_);
    if (scratch_) cudaFree(scratch_);
    if (ctrl_) cudaStreamDestroy(ctrl_);
    if (comm_) ncclCommDestroy(comm_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "nccl"; }

  std::unique_ptr<Communicator> dup() override { return split(0, rank_); }

  // ncclCommSplit orders a color's ranks by key, then by rank here (nccl.h) — MPI_Comm_split's
  // rule, which split_members computes from an all-gather of every rank's (color, key, world
  // rank): NCCL itself does not tell a member the others' world ranks. The all-gather also
  // runs on the ranks that leave (NCCL_SPLIT_NOCOLOR), since ncclCommSplit is collective.
  std::unique_ptr<Communicator> split(int color, int key) override {
    set_device();
    const auto all = all_gather_i64({color < 0 ? -1 : color, key, world_ranks_[static_cast<std::size_t>(rank_)]});
    std::vector<std::pair<int, int>> color_key;
    for (int r = 0; r < size_; ++r)
      color_key.emplace_back(static_cast<int>(all[3 * static_cast<std::size_t>(r)]),
                             static_cast<int>(all[3 * static_cast<std::size_t>(r) + 1]));
    ncclComm_t c = nullptr;
    nccl(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &c, nullptr), "ncclCommSplit");
    if (color < 0) {
      if (c) ncclCommDestroy(c);
      return nullptr;
    }
    const std::vector<int> members = split_members(color_key, color);
    std::vector<int> world;
    int me = -1;
    for (std::size_t i = 0; i < members.size(); ++i) {
      world.push_back(static_cast<int>(all[3 * static_cast<std::size_t>(members[i]) + 2]));
      if (members[i] == rank_) me = static_cast<int>(i);
    }
    int nccl_rank = -1, nccl_size = -1;
    const ncclResult_t r1 = ncclCommUserRank(c, &nccl_rank), r2 = ncclCommCount(c, &nccl_size);
    if (r1 != ncclSuccess || r2 != ncclSuccess || nccl_rank != me || nccl_size != static_cast<int>(members.size())) {
      ncclCommDestroy(c);
      fail("ncclCommSplit(color " + std::to_string(color) + ", key " + std::to_string(key) + ") gave rank " +
           std::to_string(nccl_rank) + " of " + std::to_string(nccl_size) + ", expected " + std::to_string(me) +
           " of " + std::to_string(members.size()));
    }
    return std::make_unique<NcclCommunicator>(b_, c, me, static_cast<int>(members.size()), std::move(world), watchdog_);
  }
  std::vector<int> world_ranks() const override { return world_ranks_; }

  // ---- data plane ----------------------------------------------------------------------

  void all_to_all_v(Stream& s, const Tensor& send, std::span<const Segment> sends, Tensor& recv,
                    std::span<const Segment> recvs) override {
    if (send.dtype() != recv.dtype()) fail("all_to_all_v: send is " + send.describe() + ", recv " + recv.describe());
    const auto es = static_cast<std::int64_t>(dtype_size(send.dtype()));
    double local = 0;
    std::vector<const Segment*> self_sends, self_recvs;
    for (const auto& sg : sends) {
      check_segment(sg, send, "send");
      if (sg.peer == rank_ && sg.count) {
        local += static_cast<double>(sg.count * es);
        self_sends.push_back(&sg);
      }
    }
    for (const auto& sg : recvs) {
      check_segment(sg, recv, "receive");
      if (sg.peer == rank_ && sg.count) self_recvs.push_back(&sg);
    }
    if (self_sends.size() != self_recvs.size())
      fail("all_to_all_v: " + std::to_string(self_sends.size()) + " non-empty segments to self but " +
           std::to_string(self_recvs.size()) + " from self");
    for (std::size_t i = 0; i < self_sends.size(); ++i)
      if (self_sends[i]->count != self_recvs[i]->count)
        fail("all_to_all_v: segment " + std::to_string(i) + " to self sends " + std::to_string(self_sends[i]->count) +
             " elements but receives " + std::to_string(self_recvs[i]->count));

    set_device();
    CudaOpScope op(b_, s, "all_to_all_v",
                   cost_collective(segments_bytes_to_others(sends, rank_, send.dtype()), local));
    const cudaStream_t st = cuda_native_stream(s);
    const char* sp = static_cast<const char*>(send.raw());
    char* rp = static_cast<char*>(recv.raw());
    // The rank's own rows never touch the network: device copies, adjacent segments as one.
    for (const SelfCopy& c : self_copies(self_sends, self_recvs))
      cuda(cudaMemcpyAsync(rp + c.to * es, sp + c.from * es, static_cast<std::size_t>(c.count * es),
                           cudaMemcpyDeviceToDevice, st),
           "cudaMemcpyAsync (all_to_all_v to self)");
    // One group of point-to-point calls; NCCL matches those between a pair of ranks in
    // issue order, which is the Segment contract. Empty segments are skipped on both sides.
    nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    const char* first_call = "";
    auto keep = [&](ncclResult_t r, const char* call) {
      if (r != ncclSuccess && first == ncclSuccess) {
        first = r;
        first_call = call;
      }
    };
    for (const auto& sg : recvs)
      if (sg.peer != rank_ && sg.count)
        keep(ncclRecv(rp + sg.offset * es, static_cast<std::size_t>(sg.count * es), ncclChar, sg.peer, comm_, st),
             "ncclRecv");
    for (const auto& sg : sends)
      if (sg.peer != rank_ && sg.count)
        keep(ncclSend(sp + sg.offset * es, static_cast<std::size_t>(sg.count * es), ncclChar, sg.peer, comm_, st),
             "ncclSend");
    keep(ncclGroupEnd(), "ncclGroupEnd");  // always close the group, even after a failed call
    nccl(first, first_call);
    watched("all_to_all_v", st);
  }

  void all_gather(Stream& s, const Tensor& send, Tensor& recv) override {
    if (recv.numel() != send.numel() * size_ || recv.dtype() != send.dtype())
      fail("all_gather: recv " + recv.describe() + " must hold " + std::to_string(size_) + " x send " +
           send.describe());
    set_device();
    const auto n = static_cast<double>(send.nbytes());
    CudaOpScope op(b_, s, "all_gather", cost_collective(n * (size_ - 1), n));
    nccl(ncclAllGather(send.raw(), recv.raw(), send.nbytes(), ncclChar, comm_, cuda_native_stream(s)),
         "ncclAllGather");
    watched("all_gather", cuda_native_stream(s));
  }

  void reduce_scatter(Stream& s, const Tensor& send, Tensor& recv) override {
    if (send.numel() != recv.numel() * size_ || recv.dtype() != send.dtype())
      fail("reduce_scatter: send " + send.describe() + " must hold " + std::to_string(size_) + " x recv " +
           recv.describe());
    set_device();
    const auto b = static_cast<double>(recv.nbytes());
    CudaOpScope op(b_, s, "reduce_scatter", cost_collective(b * (size_ - 1), b));
    nccl(ncclReduceScatter(send.raw(), recv.raw(), static_cast<std::size_t>(recv.numel()), nccl_type(recv.dtype()),
                           ncclSum, comm_, cuda_native_stream(s)),
         "ncclReduceScatter");
    watched("reduce_scatter", cuda_native_stream(s));
  }

  void all_reduce(Stream& s, Tensor& buf) override {
    set_device();
    const auto b = static_cast<double>(buf.nbytes());
    // Ring all-reduce: each rank sends 2(n-1)/n of the buffer.
    CudaOpScope op(b_, s, "all_reduce", cost_collective(2.0 * b * (size_ - 1) / size_, b));
    nccl(ncclAllReduce(buf.raw(), buf.raw(), static_cast<std::size_t>(buf.numel()), nccl_type(buf.dtype()), ncclSum,
                       comm_, cuda_native_stream(s)),
         "ncclAllReduce");
    watched("all_reduce", cuda_native_stream(s));
  }

  void send(Stream& s, const Tensor& t, int peer) override {
    check_peer(peer, "send");
    set_device();
    CudaOpScope op(b_, s, "send", cost_collective(static_cast<double>(t.nbytes()), 0));
    nccl(ncclSend(t.raw(), t.nbytes(), ncclChar, peer, comm_, cuda_native_stream(s)), "ncclSend");
    watched("send", cuda_native_stream(s));
  }

  void recv(Stream& s, Tensor& t, int peer) override {
    check_peer(peer, "recv");
    set_device();
    CudaOpScope op(b_, s, "recv", cost_collective(0, static_cast<double>(t.nbytes())));
    nccl(ncclRecv(t.raw(), t.nbytes(), ncclChar, peer, comm_, cuda_native_stream(s)), "ncclRecv");
    watched("recv", cuda_native_stream(s));
  }

  // ---- control plane -------------------------------------------------------------------

  void barrier() override {
    set_device();
    void* d = scratch(sizeof(int));
    cuda(cudaMemsetAsync(d, 0, sizeof(int), ctrl_), "cudaMemsetAsync");
    nccl(ncclAllReduce(d, d, 1, ncclInt32, ncclSum, comm_, ctrl_), "ncclAllReduce (barrier)");
    watched("barrier", ctrl_);
    sync_ctrl();
  }

  std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& send) override {
    if (send.size() % static_cast<std::size_t>(size_) != 0)
      fail("exchange_counts: " + std::to_string(send.size()) + " values is not a multiple of " +
           std::to_string(size_) + " ranks");
    std::vector<std::int64_t> out(send.size());
    if (send.empty()) return out;
    set_device();
    const std::size_t bytes = send.size() * sizeof(std::int64_t);
    char* d = static_cast<char*>(scratch(2 * bytes));
    cuda(cudaMemcpyAsync(d, send.data(), bytes, cudaMemcpyHostToDevice, ctrl_), "cudaMemcpyAsync");
    nccl(ncclAlltoAll(d, d + bytes, send.size() / static_cast<std::size_t>(size_), ncclInt64, comm_, ctrl_),
         "ncclAlltoAll (exchange_counts)");
    watched("exchange_counts", ctrl_);
    cuda(cudaMemcpyAsync(out.data(), d + bytes, bytes, cudaMemcpyDeviceToHost, ctrl_), "cudaMemcpyAsync");
    sync_ctrl();
    return out;
  }

  double all_reduce_max(double v) override { return reduce_double(v, ncclMax, "ncclAllReduce (max)"); }
  double all_reduce_sum(double v) override { return reduce_double(v, ncclSum, "ncclAllReduce (sum)"); }

  std::vector<std::string> all_gather_strings(const std::string& s) override {
    set_device();
    // Lengths first, then every string padded to the longest.
    const auto n = static_cast<std::size_t>(size_);
    const std::vector<std::int64_t> lens = all_gather_i64({static_cast<std::int64_t>(s.size())});
    const auto longest = static_cast<std::size_t>(std::max<std::int64_t>(1, *std::max_element(lens.begin(), lens.end())));
    std::string padded(longest, '\0');
    std::memcpy(padded.data(), s.data(), s.size());
    std::string all(longest * n, '\0');
    char* d = static_cast<char*>(scratch(longest * (n + 1)));
    cuda(cudaMemcpyAsync(d, padded.data(), longest, cudaMemcpyHostToDevice, ctrl_), "cudaMemcpyAsync");
    nccl(ncclAllGather(d, d + longest, longest, ncclChar, comm_, ctrl_), "ncclAllGather (strings)");
    watched("all_gather_strings", ctrl_);
    cuda(cudaMemcpyAsync(all.data(), d + longest, longest * n, cudaMemcpyDeviceToHost, ctrl_), "cudaMemcpyAsync");
    sync_ctrl();
    std::vector<std::string> out;
    for (std::size_t r = 0; r < n; ++r) out.push_back(all.substr(r * longest, static_cast<std::size_t>(lens[r])));
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw CommError("rank " + std::to_string(rank_) + ": " + what);
  }
  void nccl(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess) return;
    std::string msg = "rank " + std::to_string(rank_) + ": " + call + " failed: " + ncclGetErrorString(r);
    if (comm_) {
      const char* last = ncclGetLastError(comm_);
      if (last && *last) msg += std::string(" (") + last + ")";
    }
    throw CommError(msg);
  }
  void cuda(cudaError_t e, const char* call) const {
    if (e != cudaSuccess)
      throw CommError("rank " + std::to_string(rank_) + ": " + call + " failed: " + cudaGetErrorString(e));
  }
  void set_device() const {
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != device_) cuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  void check_segment(const Segment& sg, const Tensor& t, const char* what) const {
    if (sg.peer < 0 || sg.peer >= size_ || sg.offset < 0 || sg.count < 0 || sg.offset + sg.count > t.numel())
      fail(std::string("all_to_all_v ") + what + " segment (peer " + std::to_string(sg.peer) + ", offset " +
           std::to_string(sg.offset) + ", count " + std::to_string(sg.count) + ") is outside the buffer " +
           t.describe() + " or the world of " + std::to_string(size_));
  }
  void check_peer(int peer, const char* call) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      fail(std::string(call) + " with peer " + std::to_string(peer) + " in a world of " + std::to_string(size_));
  }
  void* scratch(std::size_t bytes) {
    if (bytes > scratch_bytes_) {
      sync_ctrl();
      if (scratch_) cuda(cudaFree(scratch_), "cudaFree");
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      const std::size_t want = std::max<std::size_t>(bytes, 4096);
      cuda(cudaMalloc(&scratch_, want), "cudaMalloc (control-plane scratch)");
      scratch_bytes_ = want;
    }
    return scratch_;
  }
  void sync_ctrl() const { cuda(cudaStreamSynchronize(ctrl_), "cudaStreamSynchronize (control plane)"); }
  // Hands the op just issued on `st` to the watchdog: an event recorded after it tells it when
  // the op has completed.
  void watched(const char* op, cudaStream_t st) {
    if (!watchdog_) return;
    cudaEvent_t ev = events_->take();
    cuda(cudaEventRecord(ev, st), "cudaEventRecord (collective watchdog)");
    watchdog_->issued(
        watch_handle_, op, [ev] { return cudaEventQuery(ev) != cudaErrorNotReady; },
        [events = events_, ev] { events->give(ev); });
  }
  // "NCCL communicator rank 1 of 4 (world ranks 1, 3, 5, 7) on device 1", for messages.
  std::string describe() const {
    std::string w;
    for (std::size_t i = 0; i < world_ranks_.size() && i < 8; ++i)
      w += (i ? ", " : "") + std::to_string(world_ranks_[i]);
    if (world_ranks_.size() > 8) w += ", ...";
    return "NCCL communicator rank " + std::to_string(rank_) + " of " + std::to_string(size_) + " (world ranks " + w +
           ") on device " + std::to_string(device_);
  }
  // Every rank's `mine` (the same count on each), concatenated in rank order.
  std::vector<std::int64_t> all_gather_i64(const std::vector<std::int64_t>& mine) {
    const std::size_t bytes = mine.size() * sizeof(std::int64_t);
    std::vector<std::int64_t> out(mine.size() * static_cast<std::size_t>(size_));
    char* d = static_cast<char*>(scratch(bytes * (static_cast<std::size_t>(size_) + 1)));
    cuda(cudaMemcpyAsync(d, mine.data(), bytes, cudaMemcpyHostToDevice, ctrl_), "cudaMemcpyAsync");
    nccl(ncclAllGather(d, d + bytes, mine.size(), ncclInt64, comm_, ctrl_), "ncclAllGather (int64)");
    watched("all_gather (int64)", ctrl_);
    cuda(cudaMemcpyAsync(out.data(), d + bytes, out.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, ctrl_),
         "cudaMemcpyAsync");
    sync_ctrl();
    return out;
  }
  double reduce_double(double v, ncclRedOp_t op, const char* call) {
    set_device();
    void* d = scratch(sizeof(double));
    cuda(cudaMemcpyAsync(d, &v, sizeof v, cudaMemcpyHostToDevice, ctrl_), "cudaMemcpyAsync");
    nccl(ncclAllReduce(d, d, 1, ncclFloat64, op, comm_, ctrl_), call);
    watched(op == ncclMax ? "all_reduce_max" : "all_reduce_sum", ctrl_);
    cuda(cudaMemcpyAsync(&v, d, sizeof v, cudaMemcpyDeviceToHost, ctrl_), "cudaMemcpyAsync");
    sync_ctrl();
    return v;
  }

  Backend& b_;
  int device_;
  ncclComm_t comm_ = nullptr;
  int rank_, size_;
  std::vector<int> world_ranks_;
  cudaStream_t ctrl_ = nullptr;
  void* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  std::shared_ptr<CollectiveWatchdog> watchdog_;
  std::uint64_t watch_handle_ = 0;
  std::shared_ptr<EventRecycler> events_ = std::make_shared<EventRecycler>();
};

}  // namespace

std::array<char, 128> nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw CommError(std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  std::array<char, 128> out{};
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(Backend& cuda_backend, const std::array<char, 128>& id, int rank,
                                                     int size, NcclWatch watch) {
  if (!is_cuda_backend(cuda_backend))
    throw CommError("rank " + std::to_string(rank) + ": the NCCL communicator needs the cuda backend, not " +
                    cuda_backend.name());
  const int device = cuda_device_of(cuda_backend);
  if (cudaSetDevice(device) != cudaSuccess)
    throw CommError("rank " + std::to_string(rank) + ": cudaSetDevice(" + std::to_string(device) + ") failed");
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), id.size());
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, size, uid, rank);
  if (r != ncclSuccess) {
    // NCCL's own reason (ncclGetLastError takes a null communicator for a failed init): a
    // duplicate GPU, a version mismatch between ranks, a network setup failure.
    const char* last = ncclGetLastError(nullptr);
    throw CommError("rank " + std::to_string(rank) + ": ncclCommInitRank on device " + std::to_string(device) +
                    " failed: " + ncclGetErrorString(r) + (last && *last ? std::string(" (") + last + ")" : "") +
                    " (run with NCCL_DEBUG=WARN for details)");
  }
  std::vector<int> world(static_cast<std::size_t>(size));
  std::iota(world.begin(), world.end(), 0);
  std::shared_ptr<CollectiveWatchdog> watchdog;
  if (watch.on_failure) {
    CollectiveWatchdog::Options o;
    o.timeout_s = watch.timeout_s;
    o.on_thread_start = [device] { cudaSetDevice(device); };  // else CUDA would open a context on device 0
    watchdog = std::make_shared<CollectiveWatchdog>(std::move(o), std::move(watch.on_failure));
  }
  auto c = std::make_unique<NcclCommunicator>(cuda_backend, comm, rank, size, std::move(world), watchdog);
  if (watchdog) watchdog->start();
  return c;
}

}  // namespace moelab
