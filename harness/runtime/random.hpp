// harness/runtime/random.hpp — small, portable, seedable random numbers.
//
// SplitMix64 gives the same stream on every platform and compiler (std::normal_distribution
// does not), so parameters and inputs generated from a seed are identical on every rank,
// every backend and in every test's float64 reference.
#pragma once
#include <cmath>
#include <cstdint>

namespace moelab {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  // Seed derived from several keys: Rng(mix(seed, rank, step)).
  static std::uint64_t mix(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
    Rng r(a ^ 0x9e3779b97f4a7c15ULL);
    r.s_ ^= b * 0xbf58476d1ce4e5b9ULL;
    r.next();
    r.s_ ^= c * 0x94d049bb133111ebULL;
    return r.next();
  }
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // The stream as it is after n more next() calls (SplitMix64's state advances by a constant):
  // a loop can start anywhere in a stream, so a long draw can be split over threads.
  // uniform() takes one next(), normal() two.
  void skip(std::uint64_t n) { s_ += n * 0x9e3779b97f4a7c15ULL; }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  double normal() {  // Box-Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t s_;
};

}  // namespace moelab
