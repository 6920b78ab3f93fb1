// CacheMuon (docs/algorithms.md section 5): reuse the total left transform Q of the last fresh
// Gram Newton-Schulz solve while a residual test says it still orthogonalizes the current
// normalised momentum X. Per step and matrix: D = Q X is accepted when
// ||D D^T - I||_F / sqrt(m) <= gamma (measured exactly in Gram space from R = X X^T, or
// estimated with Gaussian probes), else a fresh solve runs (reusing R) and refills the entry.
// The decision is taken on the device (Backend::cache_gate); nothing waits for the host.
//
// Orientation: the cache works on the wide matrix X (m x n, m <= n). For a tall weight
// (r > c) X = U^T, so in the weight's own orientation the update is O = U Q^T.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/ortho.h"
#include "distmuon/types.h"

namespace distmuon {

enum class CacheResidual : int {
  kExact = 0,  // ||Q R Q^T - I||_F from R = X X^T (which a refresh reuses): 3 m^3 per matrix
  kProbe = 1,  // ||(Q R Q^T - I) W||_F / sqrt(k) with k Gaussian probes W: O(m n k), no R
};

// What a fresh solve with restarts leaves in the cache.
enum class CacheLayout : int {
  kProduct = 0,  // one m x m matrix Q = Q_last ... Q_first (costs m^3 per restart on refresh)
  kFactors = 1,  // every segment's Q (one per restart + 1); each use applies them in turn
};

// What one cache_gate call decides on (Backend::cache_gate: a call is one batch of matrices).
enum class CacheGate : int {
  kMatrix = 0,  // each matrix alone: it hits when its own residual passes
  // The call as a whole: it hits only if every matrix taking part (not skipped) passes, else every
  // one of them refreshes. A call of mixed decisions runs the masked solve, which on small,
  // launch-bound shapes costs more than a fresh solve (1.09-1.11x at 12 x 384 x 1536), so there
  // only calls that hit whole save time. Decisions then depend on how matrices are batched (in
  // the distributed modes, on the mode and the plan: docs/cachemuon.md).
  kBatch = 1,
};

struct CacheOptions {
  bool enabled = false;  // off: every step runs the fresh solve and no cache memory is held
  double gamma = 2.0;    // accept while the residual is <= gamma (0 accepts nothing in practice)
  // Probes by default: they decide like the exact residual (the same hit rates and losses in the
  // quality study at gamma 2 and 15) and cost far less on large shapes (a hit 0.24x of a fresh
  // solve against 0.41x on qwen2.5-7b's MLP; on small launch-bound shapes the exact one is a
  // little cheaper: 1.15x against 1.21x of the fresh step at 384 x 1536).
  CacheResidual residual = CacheResidual::kProbe;
  int probes = 8;         // k, for kProbe
  int max_staleness = 0;  // S: an entry serves at most S steps after its refresh (0: no limit)
  // Back-off of the residual test: an entry that keeps refreshing is tested at 0, 1, 2, 4, ...
  // misses in a row, the interval doubling up to the largest power of two <= this (at most
  // 65536); in between it refreshes without a test. Inside a graph the backend captures, a call none of whose matrices is due
  // skips the test's kernels on the device. 0 or 1: every entry is tested on every call.
  int check_backoff = 0;
  CacheGate gate = CacheGate::kMatrix;
  // Storage precision of Q (f32, f16, bf16; f64 for references). Unset: the iteration's work
  // dtype, so that no call converts Q and a refresh writes it straight from the solve.
  std::optional<DType> dtype;
  CacheLayout layout = CacheLayout::kProduct;
  bool per_matrix_stats = false;  // CacheStats::per_matrix is filled
  // Diagnostics: also run the fresh solve for accepted matrices and record how far the accepted
  // update is from it (and, in probe mode, the exact residual beside the estimate). Costs a
  // fresh solve and a host synchronisation per call; not counted in the FLOPs.
  bool shadow = false;
  // Probe streams: matrix i's probes are drawn from seed ^ (a fingerprint of its input), so they
  // depend on the matrix alone, not on its batch or on the calls before it.
  uint64_t seed = 0x5eed;
};

// Parses "exact" | "probe", "product" | "factors", "matrix" | "batch"; throws on other names.
CacheResidual parse_cache_residual(const std::string& s);
CacheLayout parse_cache_layout(const std::string& s);
CacheGate parse_cache_gate(const std::string& s);
const char* cache_residual_name(CacheResidual r);
const char* cache_layout_name(CacheLayout l);
const char* cache_gate_name(CacheGate g);
// The storage dtype of Q for a solve configured by `resolved` (its work dtype unless set).
DType cache_storage_dtype(const CacheOptions& o, const OrthoConfig& resolved);
// Throws, naming `what`, when an option is out of range.
void validate(const CacheOptions& o, const std::string& what);

struct CacheResidualSummary {
  int64_t count = 0;  // residuals measured against a valid entry
  double mean = 0, min = 0, max = 0;
  double p50 = 0, p90 = 0;  // from the histogram (bins of a quarter decade)
  std::array<double, kCacheHistBins> histogram{};
};

struct CacheMatrixStats {
  std::string name;  // set by the engine ("param" or "param[slice]"), else "#index"
  int64_t hits = 0, refreshes = 0, forced = 0, skips = 0, unchecked = 0;
  int64_t batch = 0;  // refreshes the per-batch gate sent although its own test passed
  double age = 0;  // hits since the last refresh
  double mean_residual = 0, max_residual = 0, last_residual = 0;
  double max_update_error = 0;  // shadow mode only
};

// Accumulated over every call since construction (or reset_stats).
struct CacheStats {
  int64_t calls = 0;
  int64_t matrices = 0;  // matrix orthogonalizations that went through the cache
  int64_t hits = 0, refreshes = 0, forced_refreshes = 0, skips = 0;
  int64_t unchecked_refreshes = 0;  // refreshes the check back-off sent without a test
  // Refreshes of matrices that passed their own test, sent by the per-batch gate because another
  // matrix of their call did not (0 under CacheGate::kMatrix).
  int64_t batch_refreshes = 0;
  double flops = 0;        // counted FLOPs of an ideal device: the test's on the matrices it
                           // tested, R for every matrix with the exact residual; hit: D = Q X;
                           // refresh: the fresh solve reusing R (probes: with R) + building Q
  double fresh_flops = 0;  // what fresh Gram NS costs for the same matrices
  CacheResidualSummary residual;
  size_t memory_bytes = 0;  // Q storage + per-entry metadata
  // Shadow mode: relative Frobenius error ||D - O_fresh|| / ||O_fresh|| over accepted updates,
  // and the probe estimate over the exact residual (probe mode).
  int64_t compared = 0;
  double update_error_mean = 0, update_error_max = 0;
  int64_t probe_compared = 0;
  double probe_ratio_min = 0, probe_ratio_max = 0, probe_ratio_mean = 0;
  // Shadow mode: cosine between each accepted update and the fresh one (1: same direction).
  double alignment_mean = 0, alignment_min = 0;
  // The latest call of every entry in use (filled under the current configuration): the share
  // that reused its transform, the mean of their latest measured residuals (entries with one;
  // an entry the check back-off left untested keeps the residual of its last test) and, in
  // shadow mode, the mean relative error and alignment of the accepted updates among them (0 and
  // 1 when none was accepted). When every matrix steps every step these are the last step's
  // values, read without any per-step synchronisation.
  int64_t latest_entries = 0, latest_with_residual = 0, latest_compared = 0;
  double latest_hit_rate = 0, latest_mean_residual = 0;
  double latest_update_error = 0, latest_alignment = 0;
  std::vector<CacheMatrixStats> per_matrix;

  double hit_rate() const;              // hits / (hits + refreshes)
  double flops_saved_fraction() const;  // 1 - flops / fresh_flops
  // Adds `o` (another shape class); quantiles are recomputed from the merged histogram.
  void merge(const CacheStats& o);
};

// The per-matrix transform cache of one batch of same-shape matrices (a shape class). Entries
// are addressed by index; Orthogonalizer::run_cached uses a contiguous range of them.
class TransformCache {
 public:
  TransformCache(Backend& backend, const CacheOptions& options);
  ~TransformCache();
  TransformCache(const TransformCache&) = delete;
  TransformCache& operator=(const TransformCache&) = delete;

  // Binds the cache to `count` wide m x n matrices orthogonalized with `resolved` (Gram NS).
  // Any change of shape, count, work dtype, cache dtype, layout or algorithm (coefficients,
  // steps, restarts, eps) gives a new key: entries filled under the old key are never reused.
  // Storage is reallocated (and state views invalidated) only when its size or dtype changes.
  void prepare(const OrthoConfig& resolved, int64_t count, int64_t m, int64_t n);
  // gamma, probes, staleness, back-off, gate, stats and shadow take effect at the next call;
  // dtype and layout at the next prepare().
  void set_options(const CacheOptions& options);
  const CacheOptions& options() const;

  bool prepared() const;
  int64_t count() const;
  int64_t m() const;
  int64_t n() const;
  int segments() const;  // m x m matrices per entry (1 for kProduct)
  double key() const;    // fingerprint of the prepared configuration (never 0)

  // Empties entries [first, first + n) (n < 0: to the end); they refresh at their next use.
  void invalidate(int64_t first = 0, int64_t n = -1);

  // State of entries [first, first + n) in backend memory, for checkpoints:
  // "cache_q": lead x segments x m x m (the segments dimension only for kFactors) in the cache
  // dtype; "cache_age": lead, f32 (hits since refresh); "cache_key": lead, f64 (0 = empty);
  // "cache_misses": lead, f32 (refreshes since the last hit: the check back-off's state).
  // `lead` is the leading shape the caller wants (its product must be n). Writing a Q or age
  // through the view is an import; a key that differs from key() makes the entry refresh.
  TensorView state(const std::string& name, int64_t first, int64_t n,
                   const std::vector<int64_t>& lead);
  static std::vector<std::string> state_names();
  // Throws, listing state_names(), unless `name` is one of them.
  static void check_state_name(const std::string& name);

  CacheStats stats(const std::vector<std::string>& names = {});  // synchronises
  void reset_stats();
  size_t memory_bytes() const;

  // The host's accounting of the calls issued so far. A replayed graph (the engine's whole-step
  // graphs) runs calls without issuing them again: the engine adds the captured calls' share,
  // the difference of the ledgers around the capture, once per replay. Hits and refreshes need
  // nothing: the replayed gate kernels count them on the device.
  struct Ledger {
    int64_t calls = 0, matrices = 0;
    double flops_fixed = 0, flops_fresh = 0;
    Ledger operator-(const Ledger& o) const {
      return {calls - o.calls, matrices - o.matrices, flops_fixed - o.flops_fixed,
              flops_fresh - o.flops_fresh};
    }
  };
  Ledger ledger() const;
  void add_replayed(const Ledger& captured);

  struct Impl;  // internal: src/ortho/cache_impl.h

 private:
  friend class Orthogonalizer;
  std::unique_ptr<Impl> impl_;
};

}  // namespace distmuon
