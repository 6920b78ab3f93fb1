// One batch of the Muon step (docs/algorithms.md section 1): matrices of one group and one wide
// shape m x n, the wide ones first, members [tall_begin, count) tall, and the one sequence that
// steps a list of them (run_batches). Every path that steps Muon matrices calls it -- the
// single-process step, each distributed mode's owner computation, the gather mode's replicated
// computation and the dedicated mode's prepare() -- so that they all issue the same kernels on
// the same batches and agree bit for bit; where they differ, BatchSequence says how and why.
//
// The sequence: pass 1 momentum_norm (norms and statuses; the raise policy checks them before
// anything changes), pass 2 per orientation into the iteration buffer x, the orthogonalization
// of x in place (fresh or through CacheMuon), the skip count, then pass 3 per orientation
// (update), or the caller ships x to the matrices' shards.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "backend/muon_ref.h"
#include "distmuon/backend.h"
#include "distmuon/cache.h"
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"

namespace distmuon {

// How the fused Muon passes normalise their input V (backend/muon_ref.h) into the iteration's X,
// from V's norms: X = V / (m ||V|| + eps * kMuonInputScale) = U / (m ||U|| + eps).
inline ScaleSpec muon_input_scale(const double* norms, const OrthoConfig& resolved) {
  return {norms, norm_multiplier(resolved.coefficients), resolved.eps * muon_ref::kMuonInputScale,
          1.0};
}

// Copies a rows x cols block from src to dst, converting the dtype when they differ.
void copy_block(Backend& backend, const void* src, DType src_t, void* dst, DType dst_t,
                int64_t rows, int64_t cols);

// Where a batch is orthogonalized: fresh, or through the CacheMuon entries of a cache class,
// where matrix k of the batch uses entry entries[k].
struct BatchOrtho {
  Orthogonalizer* ortho = nullptr;
  OrthoStats* stats = nullptr;
  TransformCache* cache = nullptr;  // nullptr: fresh
  std::span<const int64_t> entries;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Pass 3's coefficients of an m x n matrix of a group: W <- (1 - lr wd) W - lr scale O.
inline MuonUpdateCoef muon_update_coef(const MuonOptions& opt, int64_t rows, int64_t cols) {
  const double scale = shape_scale(opt.scale, rows, cols);
  return {1.0f - opt.lr * opt.weight_decay, static_cast<float>(opt.lr * scale)};
}

struct MuonBatch {
  Backend& backend;
  const MuonOptions& options;  // the group's
  const float* mu = nullptr;   // its momentum in backend memory (StepScalars)
  OrthoConfig resolved;        // the algorithm resolved for m x n
  int64_t count = 0, tall_begin = 0;
  // Per matrix: gradient, momentum and weight. Empty when the momentum was applied elsewhere
  // (gather mode stages V itself) -- then only orthogonalize() and count_skips() apply.
  std::span<const MuonSlot> slots;
  double* norms = nullptr;    // count entries: pass 1's momentum norms
  int32_t* status = nullptr;  // count entries: kStatusOk, or why the matrix is skipped

  // Calls f(k0, len, tall) for the wide part and the tall part, skipping an empty one: the
  // fused passes take one orientation per call.
  template <typename F>
  void for_each_orientation(F&& f) const {
    if (tall_begin > 0) f(int64_t{0}, tall_begin, false);
    if (count > tall_begin) f(tall_begin, count - tall_begin, true);
  }

  // This batch's share of a pass issued for several batches at once (Backend::muon_pass_grouped):
  // pass 1 over all its slots, passes 2 and 3 one entry per orientation, x as below.
  void add_pass(MuonPass pass, const BatchRef& x, std::vector<MuonPassBatch>& out) const;

  // Pass 1: the momentum's norms and the statuses.
  void momentum_norm() const;
  // The orthogonalization of x in place (runs of consecutive cache entries become one call).
  void orthogonalize(const BatchRef& x, const BatchOrtho& how) const;
  // The skips of this step (status entries not ok) added to skip_counter (device int64).
  void count_skips(int64_t* skip_counter) const;
  // Pass 3: the weights of `slots` <- decay * W - step * O with each slot's coefficients, O
  // read from x (the update's wide orientation).
  void update(const BatchRef& x) const;
};

// Issues one pass for every batch of the list at once (Backend::muon_pass_grouped); x[k] is
// batch k's iteration buffer (unused by pass 1).
void issue_pass(Backend& backend, std::span<const MuonBatch> batches, MuonPass pass,
                std::span<const BatchRef> x);

// How run_batches goes through its list. Where the paths differ, they differ here, each for the
// reason its field gives; everything else (the order of passes, products and updates) is one.
struct BatchSequence {
  // Pass 1 here. False where it ran before: the raise policy's pass1() (the driver checks every
  // status of every rank first), or gather mode's pass 1 on each rank's own rows.
  bool norms = true;
  // Between pass 1 and the rest, once for the list: the single process's AdamW check and raise
  // policy.
  std::function<void()> after_norms;
  // Batch k's iteration buffer and orthogonalization, asked right before its pass 2 (it may
  // grow the shared scratch and bind the batch's CacheMuon entries).
  std::function<void(size_t k, BatchRef* x, BatchOrtho* how)> resources;
  // Instead of pass 2: the caller writes batch k's X into x (gather mode normalises the V it
  // gathered across the shard group; the momentum was applied on each rank's rows).
  std::function<void(size_t k, const BatchRef& x)> stage;
  // What follows the orthogonalization of batch k: pass 3 (kUpdate); custom_output
  // (kCustom: the sharded mode ships x to the shards, gather mode applies its own rows); nothing
  // (kNone: prepare(), whose updates step() applies).
  enum class Output { kUpdate, kCustom, kNone };
  Output output = Output::kUpdate;
  std::function<void(size_t k, const BatchRef& x)> custom_output;
  // The single process shares launches across its shape classes: each pass goes out once for
  // every batch, classes whose products run grouped and iterate alike share one run_group, and
  // the skips are counted once over `all_status` (every class's entries, idle members' zero)
  // after the updates. Elsewhere (a bucket's runs, an owner's run, a prepared batch) each batch
  // goes through on its own after pass 1 of the list (Orthogonalizer::run or run_cached).
  bool share_launches = false;
  std::span<const int32_t> all_status;
  // Without share_launches, batch k's skips are counted right after its orthogonalization
  // (owner modes, prepare()), or after its custom output (gather mode, as it always did: the
  // count reads only the statuses, so the order changes no result, only the calls' order).
  bool skips_after_output = false;
  int64_t* skip_counter = nullptr;  // device int64
};

// One Muon step over `batches` (docs/algorithms.md section 1): pass 1, pass 2 and the
// orthogonalization, the skips, pass 3, as `seq` says.
void run_batches(Backend& backend, std::span<const MuonBatch> batches, const BatchSequence& seq);

}  // namespace distmuon
