// harness/fuzz/fuzz_training_data.cpp — libFuzzer target: `moelab run --model … --data SPEC`'s
// reader (harness/nn/text_data.hpp). The input's first byte picks the sequence length (1–64)
// and the vocabulary (255, too small for bytes, or 256..511); the rest is either a spec
// starting "markov:" (the Markov source's K parsed and used) or the bytes of a text file read
// by path. A source that opens must give training and validation batches of the asked shape
// whose tokens lie in [0, vocab), and for markov:K an entropy rate of ln K. See fuzz_common.hpp
// for the oracle, docs/FUZZING.md for runs.
#include <cmath>

#include "harness/fuzz/fuzz_common.hpp"
#include "harness/nn/text_data.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  if (size == 0) return 0;
  const std::int64_t seq = 1 + data[0] % 64;
  const std::int64_t vocab = (data[0] & 0x80) ? 255 : 256 + data[0];
  const std::string rest = fuzz::as_text(data + 1, size - 1);
  const bool markov = rest.rfind("markov:", 0) == 0;
  const std::string spec =
      markov ? rest.substr(0, rest.find('\n')) : fuzz::write_file(fuzz::scratch_dir() / "text.txt", rest);
  fuzz::expect_input_errors([&] {
    const TrainingData d = TrainingData::open(spec, vocab, seq, 1);
    const auto check = [&](const TokenBatch& tb, std::int64_t B, const char* what) {
      if (static_cast<std::int64_t>(tb.ids.size()) != B * seq || tb.targets.size() != tb.ids.size())
        fuzz::finding("a batch of the wrong size", what);
      for (std::size_t i = 0; i < tb.ids.size(); ++i)
        if (tb.ids[i] < 0 || tb.ids[i] >= vocab || tb.targets[i] < 0 || tb.targets[i] >= vocab)
          fuzz::finding("a token outside the vocabulary", what);
    };
    for (std::uint64_t step = 1; step <= 3; ++step) check(d.train(3, 7, step, 0, 1), 3, "train");
    for (int i = 0; i < 3; ++i) check(d.validation(2, i, 3), 2, "validation");
    check(d.validation(1, 0, 1), 1, "one validation window");
    if (markov && !(std::isfinite(d.entropy_rate()) && d.entropy_rate() >= 0))
      fuzz::finding("a Markov source without a finite entropy rate", spec);
  });
  return 0;
}
