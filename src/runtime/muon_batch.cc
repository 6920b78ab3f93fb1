#include "runtime/muon_batch.h"

#include "distmuon/error.h"

namespace distmuon {

void copy_block(Backend& backend, const void* src, DType src_t, void* dst, DType dst_t,
                int64_t rows, int64_t cols) {
  if (rows * cols == 0) return;
  if (src_t == dst_t) {
    backend.copy(dst, src, static_cast<size_t>(rows * cols) * dtype_size(src_t));
    return;
  }
  backend.scale_copy(BatchRef::packed(const_cast<void*>(src), src_t, 1, rows, cols), false,
                     ScaleSpec{}, BatchRef::packed(dst, dst_t, 1, rows, cols));
}

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

void issue_pass(Backend& backend, std::span<const MuonBatch> batches, MuonPass pass,
                std::span<const BatchRef> x) {
  std::vector<MuonPassBatch> passes;
  for (size_t k = 0; k < batches.size(); ++k)
    batches[k].add_pass(pass, pass == MuonPass::kNorm ? BatchRef{} : x[k], passes);
  backend.muon_pass_grouped(pass, passes);
}

void MuonBatch::momentum_norm() const { issue_pass(backend, {this, 1}, MuonPass::kNorm, {}); }

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

void MuonBatch::update(const BatchRef& x) const {
  issue_pass(backend, {this, 1}, MuonPass::kUpdate, {&x, 1});
}

namespace {

// The orthogonalization of every batch of a single-process step: batches whose products run
// grouped (OrthoConfig::grouped_products) and that iterate alike share every launch (one
// run_group); a batch through CacheMuon, or not grouped, runs alone.
void orthogonalize_shared(std::span<const MuonBatch> batches, std::span<const BatchRef> x,
                          std::span<const BatchOrtho> how) {
  const size_t n = batches.size();
  std::vector<bool> grouped(n), done(n, false);
  for (size_t k = 0; k < n; ++k)
    grouped[k] = batches[k].count > 0 && batches[k].resolved.grouped_products && !how[k].cache;
  for (size_t k = 0; k < n; ++k) {
    if (batches[k].count == 0 || done[k]) continue;
    if (!grouped[k]) {
      batches[k].orthogonalize(x[k], how[k]);
      continue;
    }
    std::vector<Orthogonalizer::GroupMember> members;
    for (size_t j = k; j < n; ++j)
      if (!done[j] && grouped[j] &&
          Orthogonalizer::same_schedule(batches[j].resolved, batches[k].resolved)) {
        members.push_back({batches[j].resolved, x[j], how[j].workspace, how[j].workspace_bytes});
        done[j] = true;
      }
    how[k].ortho->run_group(members, how[k].stats);
  }
}

}  // namespace

void run_batches(Backend& backend, std::span<const MuonBatch> batches, const BatchSequence& seq) {
  using Output = BatchSequence::Output;
  const size_t n = batches.size();
  if (seq.norms) {
    if (seq.share_launches)
      issue_pass(backend, batches, MuonPass::kNorm, {});
    else
      for (const MuonBatch& b : batches) b.momentum_norm();
  }
  if (seq.after_norms) seq.after_norms();
  std::vector<BatchRef> x(n);
  std::vector<BatchOrtho> how(n);
  auto input = [&](size_t k) {
    if (seq.stage)
      seq.stage(k, x[k]);
    else
      issue_pass(backend, batches.subspan(k, 1), MuonPass::kApply, {&x[k], 1});
  };
  auto output = [&](size_t k) {
    if (seq.output == Output::kUpdate) batches[k].update(x[k]);
    if (seq.output == Output::kCustom) seq.custom_output(k, x[k]);
  };
  if (seq.share_launches) {
    DM_CHECK(!seq.stage && seq.output == Output::kUpdate, "internal: a shared sequence updates");
    for (size_t k = 0; k < n; ++k) seq.resources(k, &x[k], &how[k]);
    issue_pass(backend, batches, MuonPass::kApply, x);
    orthogonalize_shared(batches, x, how);
    issue_pass(backend, batches, MuonPass::kUpdate, x);
    if (!seq.all_status.empty())
      backend.count_status(seq.all_status.data(), static_cast<int64_t>(seq.all_status.size()),
                           seq.skip_counter);
    return;
  }
  for (size_t k = 0; k < n; ++k) {
    seq.resources(k, &x[k], &how[k]);
    input(k);
    batches[k].orthogonalize(x[k], how[k]);
    if (!seq.skips_after_output) batches[k].count_skips(seq.skip_counter);
    output(k);
    if (seq.skips_after_output) batches[k].count_skips(seq.skip_counter);
  }
}

}  // namespace distmuon
