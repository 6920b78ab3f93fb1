// Orthogonalization of batches of same-shape matrices: Newton-Schulz (dense or symmetric
// products), Gram Newton-Schulz with restarts, with the coefficient schedules of Keller Jordan,
// Polar Express (two safety variants) and You. Written once against the Backend interface.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/types.h"

namespace distmuon {

class TransformCache;  // distmuon/cache.h
struct CacheOptions;

// How the iteration is organised. kAuto picks per shape (see choose_iteration()).
enum class Iteration : int {
  kStandardDense = 0,  // X <- aX + (bA + cA^2) X with dense products (torch.optim.Muon)
  kStandardSym = 1,    // the same, computing only one triangle of A = XX^T and A^2
  kGram = 2,           // the iteration in the m x m Gram space (docs/algorithms.md section 4)
  kAuto = 3,
};

// Coefficient schedules (docs/algorithms.md sections 2 and 3).
enum class Coefficients : int {
  kJordan = 0,           // (3.4445, -4.7750, 2.0315) on every step
  kPolarExpress = 1,     // reference code: safety 1.01 on all but the last step, norm * 1.01
  kPolarExpress105 = 2,  // Gram-NS / DMuon code: safety 1.05 on the first five rows
  kYou = 3,              // You's five-step set
  kCustom = 4,           // OrthoConfig::custom_coefficients (e.g. torch.optim.Muon's ns_coefficients)
};

struct QuinticCoef {
  double a, b, c;
};

// The most iteration steps an algorithm may run (a few dozen are ever useful).
inline constexpr int kMaxOrthoSteps = 100;

struct OrthoConfig {
  Iteration iteration = Iteration::kAuto;
  Coefficients coefficients = Coefficients::kJordan;
  int steps = 5;
  std::vector<int> restarts = {2};  // Gram NS: recompute R = XX^T before these step indices
  DType work_dtype = DType::kF32;   // dtype of the iteration (bf16/f16 on GPU, f32/f64 on CPU)
  // Gram NS runs in fp16 on GPUs (more mantissa than bf16); kAuto maps to this when the work
  // dtype is bf16. Leave unset to use work_dtype for both.
  std::optional<DType> gram_work_dtype;
  float eps = 1e-7f;
  // Used when coefficients == kCustom: row i on step i, the last row repeating after the end.
  std::vector<QuinticCoef> custom_coefficients;
  // Issue every product through Backend::gemm_grouped, so that batches of several shapes that
  // iterate alike share each launch (Orthogonalizer::run_group). The engine sets it for shape
  // classes whose products are too small to fill the device; the results differ from the
  // ordinary kernels' by rounding, so every path that orthogonalizes a class reads it from the
  // class's resolved config.
  bool grouped_products = false;
};

// Parses an algorithm spec: "ns5" | "ns" | "ns5-sym" | "ns-sym" | "gram-ns" | "auto", optionally
// followed by ":COEFFS" with COEFFS one of jordan, polar-express, polar-express-1.05, you, and
// ":STEPS". Examples: "ns5", "gram-ns:polar-express-1.05", "auto:you:6". Throws on bad specs.
OrthoConfig parse_algorithm(const std::string& spec, OrthoConfig base = {});
std::string iteration_name(Iteration it);
std::string coefficients_name(Coefficients c);
std::string algorithm_name(const OrthoConfig& cfg);  // inverse of parse_algorithm

// The (a, b, c) of every step, safety factors applied. The first form cannot express kCustom
// (it throws); the second reads the config's steps and custom rows.
std::vector<QuinticCoef> coefficient_schedule(Coefficients c, int steps);
std::vector<QuinticCoef> coefficient_schedule(const OrthoConfig& cfg);
// The factor the input norm is multiplied by before dividing (1.01 for kPolarExpress, else 1).
double norm_multiplier(Coefficients c);

// Pure shape heuristic for Iteration::kAuto. m <= n is the wide orientation. Gram NS costs
// (4T + 6a - 6) m^3 against T(3a + 1) m^3 for symmetric standard NS (a = n / m): it is cheaper
// once a > 1 in FLOPs, but it runs more small sequential products and its half-precision error
// grows with restarts, so it is chosen from a = 1.5 up (docs/algorithms.md section 4).
// An autotuner can replace this choice per shape (OrthoConfig.iteration set explicitly).
Iteration choose_iteration(int64_t m, int64_t n);

// Resolves kAuto for a shape and fills gram_work_dtype; returns the config actually run.
OrthoConfig resolve(const OrthoConfig& cfg, int64_t rows, int64_t cols);
// The dtype the resolved config iterates in (gram_work_dtype for Gram NS, else work_dtype).
DType iteration_dtype(const OrthoConfig& resolved);

// Counted FLOPs (2 per multiply-add; one triangle of a symmetric product counts m(m+1)k) of one
// orthogonalization of one rows x cols matrix with the resolved config.
double ortho_flops(const OrthoConfig& cfg, int64_t rows, int64_t cols);

// Work counters, accumulated across calls.
struct OrthoStats {
  double flops = 0;
  int64_t matrices = 0;
  int64_t calls = 0;
  void reset() { *this = OrthoStats{}; }
  OrthoStats& operator+=(const OrthoStats& o) {
    flops += o.flops;
    matrices += o.matrices;
    calls += o.calls;
    return *this;
  }
  OrthoStats operator-(const OrthoStats& o) const {
    return {flops - o.flops, matrices - o.matrices, calls - o.calls};
  }
};

// Orthogonalizes batches of wide (m <= n) matrices that are already normalised
// (||X||_F <= 1) and stored in the resolved work dtype. Tall matrices are handled by callers
// transposing into the wide orientation (scale_copy / muon_momentum_apply do this on the fly).
class Orthogonalizer {
 public:
  explicit Orthogonalizer(Backend& backend) : backend_(backend) {}

  // Workspace bytes `run` needs for `count` m x n matrices with the (resolved) config.
  static size_t workspace_bytes(const OrthoConfig& cfg, int64_t count, int64_t m, int64_t n);

  // x: count m x n matrices (work dtype), normalised; it is used as scratch and overwritten.
  // out: same shape, any float dtype, may alias x. workspace: at least workspace_bytes() of
  // backend memory.
  void run(const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out, void* workspace,
           size_t workspace_size, OrthoStats* stats = nullptr);

  // Several batches of wide matrices in place, each product of the iteration issued once for
  // all of them (Backend::gemm_grouped). Every batch must iterate alike (same_schedule: the same
  // operations in the same order; shapes may differ) and be in its config's work dtype; each
  // has its own workspace of workspace_bytes(). Each matrix gets the bits that run() with
  // grouped_products gives it alone.
  struct GroupMember {
    OrthoConfig cfg;  // resolved
    BatchRef x;
    void* workspace = nullptr;
    size_t workspace_size = 0;
  };
  void run_group(std::span<const GroupMember> members, OrthoStats* stats = nullptr);
  // Whether two resolved configs issue the same sequence of operations (iteration, steps,
  // restarts, coefficients, dtype), so that their batches can share a group.
  static bool same_schedule(const OrthoConfig& a, const OrthoConfig& b);

  // CacheMuon: like run() for Gram NS, but each matrix i of x uses entry first + i of `cache`
  // (prepared for this config and shape): the cached transform is applied where the device-side
  // gate accepts it, the fresh solve (which refills the entry) runs elsewhere. status (device,
  // one per matrix, may be null) marks matrices the step skips: their entries stay untouched
  // and their output is unspecified. stats gets the FLOPs known at issue time; the rest depends
  // on device decisions and is read from TransformCache::stats().
  void run_cached(const OrthoConfig& cfg, TransformCache& cache, int64_t first, const BatchRef& x,
                  const BatchRef& out, const int32_t* status, void* workspace,
                  size_t workspace_size, OrthoStats* stats = nullptr);
  // Workspace bytes run_cached needs for `count` m x n matrices.
  static size_t cached_workspace_bytes(const OrthoConfig& cfg, const CacheOptions& options,
                                       int64_t count, int64_t m, int64_t n);

  // Convenience for any orientation and dtype: normalises u (count r x c) by its Frobenius
  // norm, transposes tall matrices, runs the iteration and writes the polar-factor estimate
  // into out (count r x c, any float dtype). Allocates its own workspace.
  void orthogonalize(const OrthoConfig& cfg, const BatchRef& u, const BatchRef& out,
                     OrthoStats* stats = nullptr);

  Backend& backend() { return backend_; }

 private:
  Backend& backend_;
};

}  // namespace distmuon
