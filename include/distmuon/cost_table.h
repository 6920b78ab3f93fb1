// The planner's cost table: seconds to orthogonalize a batch of k same-shape matrices, per shape.
// Two sources: an analytic model (counted FLOPs and bytes over given rates plus a per-kernel
// overhead) and measurements of the Orthogonalizer on the active backend. Measured tables are
// kept in a cache file keyed by device name and library version and reused on the next start.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/ortho.h"

namespace distmuon {

// One shape to cost and how many matrices of it the workload has (the largest batch needed).
struct ShapeCount {
  int64_t rows = 0, cols = 0;
  int64_t count = 0;
};

struct CostPoint {
  int64_t k = 0;       // batch size
  double seconds = 0;  // time of one orthogonalization of the whole batch
};

// Points of one shape in the wide orientation (m <= n), sorted by k.
struct ShapeCost {
  int64_t m = 0, n = 0;
  std::vector<CostPoint> points;
};

class CostTable {
 public:
  // A table without shapes for the algorithm and work dtype of cfg, costed by `source`
  // ("analytic" or "measured") on `device`, by this library version.
  static CostTable empty(std::string source, std::string device, const OrthoConfig& cfg);

  std::string source;      // "analytic" or "measured"
  std::string device;      // Backend::name() of the measuring device, or the analytic rates
  std::string version;     // DISTMUON_VERSION of the library that produced the table
  std::string algorithm;   // algorithm_name() of the OrthoConfig that was costed
  std::string work_dtype;  // dtype_name() of the iteration

  // Adds or replaces the points of a shape (either orientation). Points need k >= 1, distinct
  // k and seconds > 0; they are sorted here.
  void set(int64_t rows, int64_t cols, std::vector<CostPoint> points);
  // The points of a shape (either orientation), or nullptr.
  const ShapeCost* find(int64_t rows, int64_t cols) const;
  // Seconds of one batch of k matrices. Batch cost is not linear in k (fixed per-call overheads
  // amortise over the batch), so this interpolates linearly between the stored points, scales
  // below the first point, and extends past the last point with the per-matrix slope of the last
  // segment. Throws naming the shape when the table has no entry for it.
  double batch_seconds(int64_t rows, int64_t cols, int64_t k) const;
  const std::map<std::pair<int64_t, int64_t>, ShapeCost>& shapes() const { return shapes_; }
  // Same key (device, version, algorithm, dtype): the cache merges and replaces by this.
  bool same_key(const CostTable& o) const;
  std::string describe() const;  // one line: source, device, algorithm, dtype, shapes

 private:
  std::map<std::pair<int64_t, int64_t>, ShapeCost> shapes_;  // key (m, n), m <= n
};

// Cost files hold a list of tables: {"format": "distmuon-cost-table", "format_version": 1,
// "tables": [...]}. read_cost_file throws with the path on a missing, corrupt (not JSON, bad
// fields) or foreign (another format, a newer format version) file.
std::vector<CostTable> read_cost_file(const std::string& path);
void write_cost_file(const std::string& path, const std::vector<CostTable>& tables);
std::string cost_table_json(const std::vector<CostTable>& tables);
std::vector<CostTable> parse_cost_tables(const std::string& json_text, const std::string& origin);
// Picks the table of `device` (empty: the file must hold exactly one device) made by this
// library version; throws naming the devices/versions present when none matches.
CostTable select_cost_table(const std::vector<CostTable>& tables, const std::string& device,
                            const std::string& origin);
// The table of a device `f` times slower at the work than the one measured (a part of the GPU:
// the whole GPU's GEMM rate over the part's). A batch's time splits into a fixed part, which
// the host's launches set whatever the device (the intercept at k = 0 of the line through the
// shape's first two points, between 0 and the first point), and the rest, scaled by f; a shape
// with one point is scaled whole.
// parts > 1: the device is one of `parts` partitions of the measured GPU's SMs (MPS ranks). A
// batch that ran at a share u of the table's best rate on the whole GPU is taken to have filled
// only that share of its SMs (wave quantization, small grids), which a part with fewer SMs does
// not lose: its work scales by max(1, f / parts, u f) instead of f. Measured on an H100 at
// D = 8 (profiled compute over D = 1's): pi0's orthogonalizations, further below the best rate
// than qwen2.5-7b's on the whole GPU, slowed 7.0x, qwen's 8.6x, a large GEMM 9.4x.
CostTable scale_costs(const CostTable& t, double f, int parts = 0);
// The measurement store's path (src/measure/store.h: a cost file that also holds the tuner's
// choices): DISTMUON_COST_CACHE, else $XDG_CACHE_HOME/distmuon/costs.json, else
// ~/.cache/distmuon/costs.json.
std::string default_cost_cache_path();

// ---- analytic ---------------------------------------------------------------------------------

// Rates of the analytic model. Defaults: an H200's dense bf16 GEMM rate and device copy
// bandwidth, on the low side of what H200s measured (781-806 TFLOP/s, 4.25-4.29 TB/s from one
// machine to another), and a per-kernel launch/tail overhead that makes small matrices cost
// more than their FLOPs (why batching pays).
struct AnalyticRates {
  double flops_per_s = 759e12;
  double bytes_per_s = 4.17e12;
  double launch_s = 4e-6;
  std::string describe() const;
};

// Approximate bytes moved through memory by one orthogonalization of one rows x cols matrix in
// `elem_bytes` precision (each product reads its inputs and writes its output once).
double ortho_bytes(const OrthoConfig& cfg, int64_t rows, int64_t cols, int64_t elem_bytes);
// Kernel launches of one batched orthogonalization (independent of the batch size).
int ortho_launches(const OrthoConfig& cfg, int64_t rows, int64_t cols);
// Seconds of a batch of k: launches * launch_s + k * max(flops / rate, bytes / bandwidth).
double analytic_batch_seconds(const OrthoConfig& cfg, const AnalyticRates& rates, int64_t rows,
                              int64_t cols, int64_t k);
// A table with a point for every k from 1 to the shape's count.
CostTable analytic_cost_table(const std::vector<ShapeCount>& shapes, const OrthoConfig& cfg,
                              const AnalyticRates& rates);

// ---- measured (src/measure/cost_profile.cc) ------------------------------------------------

struct ProfileOptions {
  std::vector<int64_t> ks = {1, 2, 4, 8};  // batch sizes timed (capped at each shape's count)
  int warmup = 1;
  int reps = 3;          // timed repetitions per point; the median is kept
  bool progress = true;  // one line per point on stderr
  uint64_t seed = 1;
};

// Times the Orthogonalizer on `be` for every shape and k of `shapes` that `reuse` (may be null)
// does not already hold; returns reuse's points plus the new ones.
CostTable measure_cost_table(Backend& be, const std::vector<ShapeCount>& shapes,
                             const OrthoConfig& cfg, const ProfileOptions& opts,
                             const CostTable* reuse = nullptr);

struct CachedCosts {
  CostTable table;
  std::string path;
  int shapes_reused = 0;    // shapes whose every point came from the cache
  int shapes_measured = 0;  // shapes with at least one new point
};
// Loads the table of (be.name(), DISTMUON_VERSION, cfg) from `cache_path` (empty: the
// measurement store), measures what is missing and writes the merged file back (other tables
// and the tuner's choices are kept). A corrupt or foreign file is an error, not silently
// overwritten.
CachedCosts cached_cost_table(Backend& be, const std::vector<ShapeCount>& shapes,
                              const OrthoConfig& cfg, const ProfileOptions& opts,
                              const std::string& cache_path = "");

}  // namespace distmuon
