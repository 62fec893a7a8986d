// harness/runtime/gemm_paths.hpp — which GEMM library path runs one grouped GEMM call (the
// experts' problems of one phase), chosen per call from measured crossovers.
//
// Three ways a GPU GEMM library can run E problems, all in cuBLAS (docs/GPU.md, "Expert GEMM
// paths", has the numbers and where they come from):
//   loop             one cublasGemmEx per problem: every problem gets cuBLAS's best kernel for
//                    its shape, at the price of one launch each (wins for large experts)
//   strided_batched  one cublasGemmStridedBatchedEx: equal shapes whose operands sit at fixed
//                    strides in memory (many small experts)
//   grouped          one cublasGemmGroupedBatchedEx over any shapes (only where it wins)
// The choice is a pure function of the problems' shapes, their precision, whether their
// operands are equally strided (or padded to a fixed row stride), and a crossover table of
// achieved TFLOP/s per path; no CUDA types, so it is unit-tested without a GPU
// (harness/tests/gemm_paths_test.cpp). The cuda backend calls it in grouped_gemm.
//   ctest --test-dir build -R gemm_paths
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "harness/runtime/dtype.hpp"

namespace moelab {

enum class GemmPath { loop, strided_batched, grouped };
constexpr int kNumGemmPaths = 3;
const char* gemm_path_name(GemmPath p);  // "loop", "strided_batched", "grouped"
bool parse_gemm_path(const std::string& s, GemmPath& out);

// Which expert GEMM a row-major problem C = op(A)·op(B) is: fwd X·W (no transpose), dgrad
// dY·Wᵀ (B transposed), wgrad Xᵀ·dY (A transposed: the tokens are the inner dimension). A
// problem with both transposed is priced as fwd.
enum class GemmOp { fwd, dgrad, wgrad };
const char* gemm_op_name(GemmOp o);  // "fwd", "dgrad", "wgrad"
bool parse_gemm_op(const std::string& s, GemmOp& out);

struct GemmShape {
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;

  GemmOp op() const;
  std::int64_t rows() const;   // the token dimension: k for wgrad, m otherwise
  std::int64_t width() const;  // the product of the other two (d_model · d_hidden for an expert)
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
  bool operator==(const GemmShape&) const = default;
};

// One measured call: `experts` problems of `rows` tokens each, [rows, d_model]·[d_model,
// d_hidden] (or its dgrad/wgrad), and the TFLOP/s each path reached on it (0: not measured).
struct GemmPathPoint {
  std::string precision = "bf16";  // "bf16", "fp32" (exact) or "tf32" (fp32 on TF32 tensor cores)
  GemmOp op = GemmOp::fwd;
  std::int64_t d_model = 0, d_hidden = 0, experts = 0, rows = 0;
  std::array<double, kNumGemmPaths> tflops{};  // indexed by GemmPath
};

// The crossover table: measured points and the two policy thresholds.
struct GemmPathTable {
  std::string source;  // where the figures come from (device, library, precision, how)
  // The strided path over padded rows is refused when more than this share of its rows is
  // padding, whatever the estimate says: padded rows also cost memory and the activation's
  // pass, which the table does not price.
  double max_padding_waste = 0.125;
  // Estimates within this relative distance of the fastest count as a tie, which goes to the
  // first of strided_batched, loop, grouped (one launch; then no device pointer arrays).
  double tie_tolerance = 0.02;
  std::vector<GemmPathPoint> points;
};

// Measured on one NVIDIA H100 80GB HBM3, cuBLAS 13, bf16 in and out, fp32 accumulate: the
// three expert GEMMs (fwd, dgrad, wgrad) of d_model/d_hidden 768/3072 and 2048/8192, 8 and 64
// experts, 64 to 8192 rows per expert, median of 20 (docs/GPU.md).
const GemmPathTable& default_gemm_path_table();

// The table's TFLOP/s for `path` on a call of `experts` problems of `rows` rows, op `op` and
// width d_model·d_hidden `width`: the points of that precision (all points when it has none),
// op (all ops when none), then the nearest width and expert count (in ratio; ties to the
// smaller), interpolated linearly in log(rows) between measured rows and held flat beyond
// them. 0 when the table has no figure for the path. `note` (optional) gets what was
// substituted.
double gemm_path_tflops(const GemmPathTable& t, GemmPath path, const std::string& precision, GemmOp op,
                        std::int64_t width, std::int64_t experts, std::int64_t rows, std::string* note = nullptr);

// One call as the chooser sees it.
struct GemmCall {
  std::vector<GemmShape> problems;  // the problems that multiply (m, n, k > 0)
  std::string precision = "bf16";
  // One strided batch runs them as they are: equal shapes and scalars, operands at fixed
  // strides (strided_runs below says so from the operands' addresses).
  bool strided = false;
  // > 0: the caller keeps every problem's token rows at a fixed stride of this many rows with
  // the padding rows zero-filled, so one strided batch over padded_rows rows per problem gives
  // the same result (the padding adds zero rows to fwd/dgrad outputs nobody reads and zero
  // terms to wgrad sums). 0: no such layout.
  std::int64_t padded_rows = 0;
  // The problems one strided batch over padded_rows runs: `problems` and the experts without a
  // row, whose padded problems are all padding (0: problems.size()).
  std::int64_t padded_batch = 0;
  bool grouped_available = true;  // the library has a grouped kernel for the call's types
};

struct GemmPathChoice {
  GemmPath path = GemmPath::loop;
  std::string why;  // one line: the estimates and what decided
  // Estimated seconds per path (indexed by GemmPath); +infinity where the path cannot run
  // or the table has no figure for it.
  std::array<double, kNumGemmPaths> seconds{};
  double padding_waste = 0;       // of the strided path: padding rows / all its rows
  std::int64_t strided_rows = 0;  // rows per problem the strided path runs (0: it cannot run)
};

// The path for one call: a single problem is one cublasGemmEx; otherwise the fastest estimate
// (the table's rate for each problem's rows, summed over the problems; the strided path at
// its padded rows), ties broken as GemmPathTable says.
GemmPathChoice choose_gemm_path(const GemmCall& call, const GemmPathTable& table);

// `choice` (choose_gemm_path's for `call`) with the path pinned to `forced` where that path can
// run the call as it is (the loop always; strided_batched when the call is one equal, equally
// strided batch; grouped when it has several problems and the library a kernel for their
// types), the table's choice otherwise; `why` says which. The one rule behind `moelab run
// --gemm-path` on both the cuda backend and the sim (an ablation, and a replay of a build that
// always took one path), and behind calibrate's per-path measurements.
GemmPathChoice force_gemm_path(GemmPathChoice choice, GemmPath forced, const GemmCall& call);

// The same for a padded call (GemmCall::padded_rows) forced to strided_batched: one strided
// batch over the padded rows whatever its padding waste (`choice`: choose_gemm_path's for the
// padded call). A padded call forced to another path runs the problems' own rows instead.
GemmPathChoice force_padded_batch(GemmPathChoice choice, std::int64_t padded_rows);

// ---- the paths a backend took --------------------------------------------------------------

// One op name's calls on one path (moelab run records them as metrics.gemm_paths_taken).
struct GemmPathUse {
  std::string op;
  GemmPath path = GemmPath::loop;
  std::int64_t calls = 0;
  std::string last_why;  // the last decision's reason
};

// The calls of a backend's grouped_gemm per (op name, path): one per library decision (a type
// combination of a call's problems, or its padded batch); calls that only fill or scale C
// (k = 0) are not counted. Thread-safe (the cuda backend notes from every stream's thread).
class GemmPathLedger {
 public:
  void note(const std::string& op, GemmPath path, const std::string& why);
  std::vector<GemmPathUse> uses() const;  // by op name, then path

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, GemmPathUse> uses_;
};

// ---- strided batches from the operands' addresses ------------------------------------------

struct GemmOperands {
  GemmShape shape;
  float alpha = 1.0f, beta = 0.0f;
  DType ab = DType::f32, c_type = DType::f32;
  std::uint64_t a = 0, b = 0, c = 0;  // byte addresses of A, B and C
};

// A run [begin, end) of problems that one strided-batched call computes exactly as the
// problems say: equal shapes, scalars and types; problem i's operands at A_begin + (i -
// begin)·stride_a and so on (element strides, whole elements); C strides of at least one C
// (m·n elements) so that no two problems write the same element; A and B may repeat
// (stride 0).
struct StridedRun {
  std::size_t begin = 0, end = 0;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  std::size_t size() const { return end - begin; }
};

// The problems cut greedily into maximal runs, in order; a problem that fits no run with its
// neighbours is a run of one.
std::vector<StridedRun> strided_runs(std::span<const GemmOperands> problems);

struct GemmProblem;  // harness/runtime/backend.hpp
// A problem's shape, scalars, types and operand addresses (Tensor::raw()).
GemmOperands gemm_operands(const GemmProblem& p);

// The chooser's view of a padded call (GemmProblem::token_stride, the same on every problem):
// the problems that multiply, padded_rows = the stride and every problem (those without a row
// too) in the padded batch; strided is left false (the problems' own rows are not one batch).
GemmCall padded_gemm_call(std::span<const GemmProblem> problems, std::string precision);

}  // namespace moelab
