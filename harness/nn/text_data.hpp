// harness/nn/text_data.hpp — training data for quality runs (`moelab run --model … --data SPEC`):
// real text read as bytes (one token per byte, so the model's vocab_size must be at least 256),
// or a synthetic Markov source whose entropy rate is known, as a floor that a model's
// validation loss can be held against.
//   SPEC = a file path (text; the fortunes corpus, any document), several paths joined by ','
//          (read in order, one corpus), or markov:K (K successors per token, uniform: entropy
//          rate ln K nats per token).
// The last tenth of a text (at least 4·(S+1) bytes) is held out for validation; training
// windows of S+1 bytes start at random offsets of the rest, deterministic in (seed, step,
// microbatch, rank); validation windows are fixed, evenly spaced over the held-out part, so
// that every variant and every evaluation sees the same ones.
#pragma once
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "harness/config/json_fields.hpp"
#include "harness/nn/data.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"

namespace moelab {

class TrainingData {
 public:
  // ConfigError naming the spec for a file that cannot be read or is too short for S, a bad K,
  // or a vocabulary too small for the source.
  static TrainingData open(const std::string& spec, std::int64_t vocab, std::int64_t seq, std::uint64_t seed) {
    TrainingData d;
    d.spec_ = spec;
    d.seq_ = seq;
    if (spec.rfind("markov:", 0) == 0) {
      const std::string k = spec.substr(7);
      std::int64_t K = 0;
      for (char ch : k) {
        if (ch < '0' || ch > '9' || K > (1 << 20)) throw ConfigError("--data " + json_fields::quote(spec) + ": expected markov:K with K a positive integer");
        K = K * 10 + (ch - '0');
      }
      if (k.empty() || K < 1 || K > vocab)
        throw ConfigError("--data " + json_fields::quote(spec) + ": K must be between 1 and the model's vocab_size " + std::to_string(vocab));
      d.markov_ = true;
      d.vocab_ = vocab;
      d.k_ = K;
      // succ[t·K + j] = π[(t + j) mod V] for a permutation π drawn once per seed: K distinct
      // successors per token, each taken with probability 1/K, so the entropy rate is ln K.
      const std::vector<std::int32_t> pi = synthetic_successor(vocab, Rng::mix(seed, 0x6d61726b));
      d.succ_.resize(static_cast<std::size_t>(vocab * K));
      for (std::int64_t t = 0; t < vocab; ++t)
        for (std::int64_t j = 0; j < K; ++j)
          d.succ_[static_cast<std::size_t>(t * K + j)] = pi[static_cast<std::size_t>((t + j) % vocab)];
      return d;
    }
    if (vocab < 256)
      throw ConfigError("--data " + json_fields::quote(spec) + ": text is read as bytes (256 tokens), but the model's vocab_size is " +
                        std::to_string(vocab));
    std::string text;
    std::size_t from = 0;
    while (from <= spec.size()) {
      const std::size_t comma = spec.find(',', from);
      const std::string path = spec.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
      std::ifstream in(path, std::ios::binary);
      if (path.empty() || !in) throw ConfigError("--data " + json_fields::quote(path) + ": cannot read the file");
      text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    const auto held = std::max<std::int64_t>(static_cast<std::int64_t>(text.size()) / 10, 4 * (seq + 1));
    if (static_cast<std::int64_t>(text.size()) < held + 4 * (seq + 1))
      throw ConfigError("--data " + json_fields::quote(spec) + ": " + std::to_string(text.size()) + " bytes is too short for windows of " +
                        std::to_string(seq + 1) + " bytes (need " + std::to_string(held + 4 * (seq + 1)) + ")");
    const auto cut = text.size() - static_cast<std::size_t>(held);
    d.train_.assign(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(cut));
    d.valid_.assign(text.begin() + static_cast<std::ptrdiff_t>(cut), text.end());
    return d;
  }

  const std::string& spec() const { return spec_; }
  bool synthetic() const { return markov_; }
  // The source's entropy rate in nats per token where it is known (markov:K: ln K), else NaN.
  double entropy_rate() const { return markov_ ? std::log(static_cast<double>(k_)) : std::nan(""); }
  std::int64_t train_bytes() const { return static_cast<std::int64_t>(train_.size()); }
  std::int64_t valid_bytes() const { return static_cast<std::int64_t>(valid_.size()); }

  // B training sequences of S tokens and their next tokens.
  TokenBatch train(std::int64_t B, std::uint64_t seed, std::uint64_t step, int mb, int rank) const {
    Rng rng(Rng::mix(Rng::mix(seed, step), Rng::mix(static_cast<std::uint64_t>(mb) + 1, static_cast<std::uint64_t>(rank) + 1)));
    return draw(B, rng, false, 0);
  }
  // Validation batch i of B sequences (fixed windows; markov: a fixed seed per i).
  TokenBatch validation(std::int64_t B, int i, int of) const {
    Rng rng(Rng::mix(0x76616c69, static_cast<std::uint64_t>(i)));
    return draw(B, rng, true, static_cast<std::int64_t>(i) * B, static_cast<std::int64_t>(of) * B);
  }

 private:
  TokenBatch draw(std::int64_t B, Rng& rng, bool valid, std::int64_t first, std::int64_t total = 1) const {
    TokenBatch tb;
    const std::int64_t S = seq_;
    tb.ids.resize(static_cast<std::size_t>(B * S));
    tb.targets.resize(tb.ids.size());
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<std::int32_t> w(static_cast<std::size_t>(S + 1));
      if (markov_) {
        auto t = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(vocab_));
        for (auto& x : w) {
          x = t;
          t = succ_[static_cast<std::size_t>(t) * static_cast<std::size_t>(k_) + rng.next() % static_cast<std::uint64_t>(k_)];
        }
      } else {
        const auto& src = valid ? valid_ : train_;
        const auto span = static_cast<std::int64_t>(src.size()) - (S + 1);
        // Validation: window first + b of `total`, evenly spaced; training: a random offset.
        const std::int64_t at = valid ? (total > 1 ? (first + b) * span / (total - 1) : 0)
                                      : static_cast<std::int64_t>(rng.next() % static_cast<std::uint64_t>(span + 1));
        for (std::int64_t j = 0; j <= S; ++j) w[static_cast<std::size_t>(j)] = src[static_cast<std::size_t>(at + j)];
      }
      for (std::int64_t j = 0; j < S; ++j) {
        tb.ids[static_cast<std::size_t>(b * S + j)] = w[static_cast<std::size_t>(j)];
        tb.targets[static_cast<std::size_t>(b * S + j)] = w[static_cast<std::size_t>(j + 1)];
      }
    }
    return tb;
  }

  std::string spec_;
  std::int64_t seq_ = 0;
  bool markov_ = false;
  std::int64_t vocab_ = 0, k_ = 0;
  std::vector<std::int32_t> succ_;
  std::vector<std::uint8_t> train_, valid_;
};

}  // namespace moelab
