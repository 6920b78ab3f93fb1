// One batch of the Muon step (docs/algorithms.md section 1): matrices of one group and one wide
// shape m x n, the wide ones first, members [tall_begin, count) tall. Every path that steps Muon
// matrices runs its batches through this unit -- the single-process step, each distributed
// mode's owner computation, the gather mode's replicated computation and the dedicated mode's
// prepare() -- so that they all issue the same kernels on the same batches and agree bit for bit.
//
// The sequence: pass 1 momentum_norm (norms and statuses; the raise policy checks them before
// anything changes), then orthogonalize_momentum (pass 2 per orientation into the iteration
// buffer x, the orthogonalization of x in place, fresh or through CacheMuon, and the skip count),
// then update (pass 3 per orientation), or the caller ships x to the matrices' shards. A caller
// with many batches can issue each pass for all of them at once (add_pass).
#pragma once

#include <cstdint>
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
  // Pass 2 into x (count x m x n, the iteration dtype, wide orientation), the orthogonalization
  // of x in place and the skips of this step added to skip_counter (device int64).
  void orthogonalize_momentum(const BatchRef& x, const BatchOrtho& how,
                              int64_t* skip_counter) const;
  // The orthogonalization of x in place (runs of consecutive cache entries become one call).
  void orthogonalize(const BatchRef& x, const BatchOrtho& how) const;
  void count_skips(int64_t* skip_counter) const;
  // Pass 3: the weights of `slots` <- decay * W - step * O with each slot's coefficients, O
  // read from x (the update's wide orientation).
  void update(const BatchRef& x) const;
};

}  // namespace distmuon
