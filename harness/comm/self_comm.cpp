// harness/comm/self_comm.cpp — a world of one rank. Every collective degenerates to local
// copies issued on the backend, so a single-rank run needs neither MPI nor NCCL.
#include <cstring>
#include <string>

#include "harness/comm/communicator.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

Tensor flat_segment(const Tensor& t, std::int64_t offset, std::int64_t count) {
  return t.reshape({t.numel()}).rows(offset, count);
}

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(Backend& b) : b_(b) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string kind() const override { return "self"; }
  std::unique_ptr<Communicator> dup() override { return std::make_unique<SelfCommunicator>(b_); }
  std::unique_ptr<Communicator> split(int color, int) override {
    return color < 0 ? nullptr : std::make_unique<SelfCommunicator>(b_);
  }

  void all_to_all_v(Stream& s, const Tensor& send, std::span<const Segment> sends, Tensor& recv,
                    std::span<const Segment> recvs) override {
    MOELAB_CHECK(sends.size() == recvs.size(), "self all_to_all_v: send and receive segment lists differ");
    std::vector<const Segment*> s_live, r_live;
    for (std::size_t i = 0; i < sends.size(); ++i) {
      MOELAB_CHECK(sends[i].peer == 0 && recvs[i].peer == 0 && sends[i].count == recvs[i].count,
                   "self all_to_all_v: segment to a rank other than 0");
      MOELAB_CHECK(sends[i].count >= 0, "self all_to_all_v: segment " + std::to_string(i) + " has a negative count");
      if (!sends[i].count) continue;
      s_live.push_back(&sends[i]);
      r_live.push_back(&recvs[i]);
    }
    for (const SelfCopy& c : self_copies(s_live, r_live)) {
      Tensor dst = flat_segment(recv, c.to, c.count);
      b_.copy(s, flat_segment(send, c.from, c.count), dst);
    }
  }
  void all_gather(Stream& s, const Tensor& send, Tensor& recv) override { b_.copy(s, send, recv); }
  void reduce_scatter(Stream& s, const Tensor& send, Tensor& recv) override { b_.copy(s, send, recv); }
  void all_reduce(Stream&, Tensor&) override {}
  void send(Stream&, const Tensor&, int peer) override { bad_peer(peer); }
  void recv(Stream&, Tensor&, int peer) override { bad_peer(peer); }

  void barrier() override {}
  std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& send) override { return send; }
  double all_reduce_max(double v) override { return v; }
  double all_reduce_sum(double v) override { return v; }
  std::vector<std::string> all_gather_strings(const std::string& s) override { return {s}; }

 private:
  [[noreturn]] static void bad_peer(int peer) {
    throw CommError("rank 0: send/recv with peer " + std::to_string(peer) + " in a world of one rank");
  }
  Backend& b_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(Backend& backend) {
  return std::make_unique<SelfCommunicator>(backend);
}

}  // namespace moelab
