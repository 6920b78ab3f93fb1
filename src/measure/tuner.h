// The algorithm tuner: which orthogonalization runs Iteration::kAuto for a class of same-shape
// matrices, chosen by measuring the candidates on the backend (time_ortho.h) and kept in the
// measurement store (store.h) under the backend's tuning fingerprint and the tuner's version.
//  - Candidates: dense ns5, ns5-sym (bf16), Gram NS (fp16) with restart sets {2} and {}.
//  - A candidate is accepted only within `tolerance` relative Frobenius error of the fp32 dense
//    iteration on the same input (the float64 reference is too slow for 3584 x 18944 on the
//    host; fp32 sits ~1e-5 from it); the fastest accepted one is the choice.
// The choice rules are pure functions and the measurement is injected (AlgorithmTuner), so that
// they are tested on the CPU with a fake clock.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/ortho.h"

namespace distmuon::measure {

// The numerical check's bar: a candidate is accepted within this relative Frobenius error of the
// fp32 dense iteration (measured by the tuner, predicted by the cost model).
constexpr double kAcceptTolerance = 2e-2;

// The tuner's candidate set: measurements of an older set are not reused (they never timed the
// candidates added since). 2: dense ns5 joined ns5-sym and gram-ns.
constexpr int kTunerVersion = 2;
// "<fingerprint>|tuner 2": the store key of a backend's choices and kernel choices measured by
// issuing each solve; with `graph`, "<fingerprint>|tuner 2|graph replay": the algorithm choices
// measured as graph replays (OrthoTiming::graph), for engines that replay their step.
std::string tuner_key(const std::string& fingerprint, bool graph = false);

// What the tuner may do when asked for the algorithm of Iteration::kAuto.
struct TunePolicy {
  bool measure = true;  // measure shapes without a stored choice (slow; progress on stderr)
  // Also accept Gram NS without a restart. Off by default: the error check runs on random
  // inputs, whose spectra do not show the half-precision drift that restarts correct on real
  // momentum (fp16's rounding of X X^T leaves small negative eigenvalues that the recurrence
  // grows where the spectrum sits near zero, as heavy-tailed momenta's does); the published
  // choice keeps a restart before step 2.
  bool allow_restart_free = false;
};

// One measured candidate of an algorithm choice.
struct AlgoCandidate {
  std::string algorithm;      // parse_algorithm() spec, e.g. "gram-ns" or "ns5-sym"
  std::vector<int> restarts;  // Gram NS restart set
  DType work_dtype = DType::kBF16;
  double ms = 0;
  double rel_err = 0;         // against the fp32 dense iteration on the same input
  bool accepted = false;      // passed the numerical check
};

// The algorithm for count matrices rows x cols: the fastest accepted candidate (algorithm ...
// rel_err) and every candidate measured, so that a caller with a narrower policy (restart
// sets) can pick among them without measuring again.
struct AlgoChoice {
  int64_t rows = 0, cols = 0, count = 0;
  std::string algorithm;
  std::vector<int> restarts;
  DType work_dtype = DType::kBF16;
  double ms = 0;
  double rel_err = 0;
  std::string schedule = "jordan:5";  // coefficients and steps the candidates ran with
  std::vector<AlgoCandidate> candidates;  // entries written before they existed: the choice alone
};

// Appends a measured (or predicted) candidate to `choice`; an accepted one faster than the
// choice so far becomes the choice (algorithm ... rel_err).
void add_candidate(AlgoChoice& choice, const AlgoCandidate& c);
// The candidates, unmeasured, in the order they are measured.
std::vector<AlgoCandidate> tuner_candidates();
// The OrthoConfig a candidate stands for.
OrthoConfig config_of(const AlgoCandidate& c, const OrthoConfig& base);
// "jordan:5": the coefficients and step count a choice was measured with (AlgoChoice::schedule).
std::string schedule_name(const OrthoConfig& base);

// The fastest accepted candidate whose Gram-NS restart set contains 2 (standard NS has none to
// check); with allow_restart_free any accepted one. nullptr when none qualifies.
const AlgoCandidate* select_candidate(const AlgoChoice& c, bool allow_restart_free);
// The stored choice for count wide m x n matrices measured with `schedule`: same sides in either
// orientation and the same batch size (another batch size is the cost model's to scale,
// algo_model.h). nullptr when none.
const AlgoChoice* find_choice(const std::vector<AlgoChoice>& all, int64_t m, int64_t n,
                              int64_t count, const std::string& schedule);

// ---- measuring ---------------------------------------------------------------------------------

struct TuneOptions {
  // The candidates take turns: `rounds` rounds, each timing every candidate `repeats` times
  // (median); a candidate's time is the median over the rounds. Drift in the device's clock (a
  // GPU warming up) then falls on every candidate alike instead of on whichever came last: run
  // one after another, two candidates 6 % apart were timed alike on an H200.
  int rounds = 3;
  int repeats = 3;
  double tolerance = kAcceptTolerance;  // acceptance threshold
  int check_matrices = 2;   // matrices of the batch checked against the fp32 reference
  bool verbose = true;      // one line per shape on stderr
  bool graph = false;       // time graph replays (OrthoTiming::graph)
};

// Milliseconds and relative error of one candidate's configuration (already resolved) in one
// round; the error is read in round 0 only (the check runs once per candidate).
struct CandidateResult {
  double ms = 0;
  double rel_err = 0;
};
using MeasureCandidate = std::function<CandidateResult(const OrthoConfig& cfg, int round)>;

// Measures every candidate through `measure`, round by round (TuneOptions::rounds), and keeps the
// fastest accepted one; throws naming the shape and every result when none passes the check.
// The name of a candidate as its log lines and reports write it: "ns5", "ns5-sym",
// "gram-ns{2}", "gram-ns{}".
std::string candidate_name(const AlgoCandidate& c);
AlgoChoice choose_algorithm(int64_t rows, int64_t cols, int64_t count, const OrthoConfig& base,
                            const TuneOptions& opt, const MeasureCandidate& measure);
// choose_algorithm on the backend: random inputs, the Orthogonalizer timed by time_ortho.h.
AlgoChoice tune_algorithm(Backend& be, int64_t rows, int64_t cols, int64_t count,
                          const OrthoConfig& base, const TuneOptions& opt);

// ---- the store -----------------------------------------------------------------------------

std::vector<AlgoChoice> load_algo_choices(const std::string& store, const std::string& key);
// Merges into the store under `key`: algorithm choices (same shape, batch size and schedule
// replace the old entry) and the backend's kernel choices (kernel_choices_json text; entries of
// the same product replace the old ones).
void save_tuning(const std::string& store, const std::string& key,
                 const std::vector<AlgoChoice>& algo, const std::string& kernel_choices_json);

// Where an answer of the tuner came from.
enum class TuneSource {
  kStored,     // measured earlier at this shape and batch size (the store)
  kMeasured,   // measured now
  kPredicted,  // the cost model, calibrated on the stored shapes (algo_model.h)
};
const char* tune_source_name(TuneSource s);  // "stored", "measured", "predicted"

struct TunedConfig {
  OrthoConfig config;  // resolved for the shape
  TuneSource source = TuneSource::kStored;
  double ms = 0;  // the pick's measured (or predicted) milliseconds for the batch
};

// The engine's question: the configuration of `auto` for count wide m x n matrices.
//  - This shape and batch size in the store: its choice.
//  - Else, when the policy measures: a measurement now (stored for the next run).
//  - Else the cost model on what the store holds (never stored: it is not a measurement).
//  - nullopt: not the tuner's case (not a bf16 `auto` with a built-in schedule), or an empty
//    store and no measuring; resolve()'s heuristic decides.
class AlgorithmTuner {
 public:
  // Measures one shape (e.g. tune_algorithm); called only when the store has no choice.
  using MeasureShape = std::function<AlgoChoice(int64_t m, int64_t n, int64_t count,
                                                const OrthoConfig& base)>;
  // The kernel choices to store beside a fresh measurement; empty function: none.
  using KernelChoices = std::function<std::string()>;
  // Algorithm choices live under `key`, the kernel choices under `kernel_key` (default: `key`).
  AlgorithmTuner(std::string store, std::string key, MeasureShape measure,
                 KernelChoices kernels = {}, std::string kernel_key = "");
  // base with the iteration, restarts and work dtypes of the choice (above). `progress` prefixes
  // the log lines (e.g. "3/12").
  std::optional<TunedConfig> config_for(const OrthoConfig& base, int64_t m, int64_t n,
                                        int64_t count, const TunePolicy& policy,
                                        const std::string& progress = "");

 private:
  std::string store_, key_, kernel_key_;
  MeasureShape measure_;
  KernelChoices kernels_;
  std::optional<std::vector<AlgoChoice>> stored_;  // read on first use
};

// The tuner of a backend (its fingerprint, the default store, tune_kernels + tune_algorithm);
// nullopt for a backend that is not tuned (empty tuning_fingerprint). `graph`: the candidates are
// timed as graph replays and kept under tuner_key(fingerprint, true) (a single-process engine
// with whole-step graphs); the kernel choices stay under tuner_key(fingerprint).
std::optional<AlgorithmTuner> backend_tuner(Backend& be, bool graph = false);
// Hands the backend the kernel choices stored for it. A store that cannot be read is ignored
// with a log line here (kernel choices only change speed); the planner's read reports it.
void install_kernel_choices(Backend& be);

}  // namespace distmuon::measure
