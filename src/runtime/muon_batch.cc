#include "runtime/muon_batch.h"

#include "distmuon/error.h"

namespace distmuon {

void MuonBatch::add_pass(MuonPass pass, const BatchRef& x,
                         std::vector<MuonPassBatch>& out) const {
  if (count == 0) return;
  DM_CHECK(static_cast<int64_t>(slots.size()) == count, "internal: ", slots.size(),
           " slots for a batch of ", count);
  MuonPassBatch b;
  b.mu = mu;
  b.nesterov = options.nesterov;
  if (pass == MuonPass::kNorm) {
    b.slots = slots;
    b.norms = norms;
    b.status = status;
    out.push_back(b);
    return;
  }
  for_each_orientation([&](int64_t k0, int64_t len, bool tall) {
    b.slots = slots.subspan(k0, len);
    b.status = status + k0;
    if (pass == MuonPass::kApply) b.scale = muon_input_scale(norms + k0, resolved);
    b.transpose = tall;
    b.x = x.slice(k0, len);
    out.push_back(b);
  });
}

namespace {
void issue_pass(const MuonBatch& batch, MuonPass pass, const BatchRef& x) {
  std::vector<MuonPassBatch> passes;
  batch.add_pass(pass, x, passes);
  batch.backend.muon_pass_grouped(pass, passes);
}
}  // namespace

void MuonBatch::momentum_norm() const { issue_pass(*this, MuonPass::kNorm, BatchRef{}); }

void MuonBatch::orthogonalize_momentum(const BatchRef& x, const BatchOrtho& how,
                                       int64_t* skip_counter) const {
  issue_pass(*this, MuonPass::kApply, x);
  orthogonalize(x, how);
  count_skips(skip_counter);
}

void MuonBatch::orthogonalize(const BatchRef& x, const BatchOrtho& how) const {
  if (!how.cache) {
    how.ortho->run(resolved, x, x, how.workspace, how.workspace_bytes, how.stats);
    return;
  }
  DM_CHECK(static_cast<int64_t>(how.entries.size()) == x.count, "internal: ", how.entries.size(),
           " cache entries for a batch of ", x.count);
  // Matrices without a gradient in this step leave gaps in the entries, so the batch goes in
  // runs of consecutive entries (usually one).
  for (size_t k0 = 0, k1; k0 < how.entries.size(); k0 = k1) {
    for (k1 = k0 + 1; k1 < how.entries.size() && how.entries[k1] == how.entries[k1 - 1] + 1;) ++k1;
    BatchRef part = x.slice(static_cast<int64_t>(k0), static_cast<int64_t>(k1 - k0));
    how.ortho->run_cached(resolved, *how.cache, how.entries[k0], part, part, status + k0,
                          how.workspace, how.workspace_bytes, how.stats);
  }
}

void MuonBatch::count_skips(int64_t* skip_counter) const {
  backend.count_status(status, count, skip_counter);
}

void MuonBatch::update(const BatchRef& x) const { issue_pass(*this, MuonPass::kUpdate, x); }

}  // namespace distmuon
