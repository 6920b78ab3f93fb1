// The single-process step: batching of same-shape matrices into classes, and the fused passes
// momentum -> orthogonalize -> update (docs/algorithms.md section 1), plus AdamW.
#include <algorithm>
#include <map>

#include "distmuon/error.h"
#include "runtime/engine_impl.h"

namespace distmuon {

void Engine::Impl::build_classes() {
  // Classes by (group, m, n): a tall weight and a wide one with the same sides (an MLP's up and
  // down projections) share one orthogonalization batch. Wide members first, then tall ones,
  // each in registration order, so that each orientation is one slice of the batch.
  std::map<std::tuple<int, int64_t, int64_t>, size_t> index;
  std::vector<std::vector<std::pair<int, int64_t>>> tall;
  for (size_t i = 0; i < registry.params.size(); ++i) {
    const Param& p = registry.params[i];
    if (registry.groups[p.spec.group].kind != ParamKind::kMuon) continue;
    const int64_t m = std::min(p.layout.rows, p.layout.cols);
    const int64_t n = std::max(p.layout.rows, p.layout.cols);
    auto key = std::make_tuple(p.spec.group, m, n);
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, local.classes.size()).first;
      ShapeClass c;
      c.group = p.spec.group;
      c.m = m;
      c.n = n;
      local.classes.push_back(std::move(c));
      tall.emplace_back();
    }
    auto& into =
        p.layout.rows > p.layout.cols ? tall[it->second] : local.classes[it->second].members;
    for (int64_t s = 0; s < p.layout.count; ++s) into.emplace_back(static_cast<int>(i), s);
  }
  for (size_t ci = 0; ci < local.classes.size(); ++ci) {
    ShapeClass& c = local.classes[ci];
    c.wide_members = static_cast<int64_t>(c.members.size());
    c.members.insert(c.members.end(), tall[ci].begin(), tall[ci].end());
    c.cache = resources.cache_class_of(c.group, c.m, c.n);
    CacheClass& cc = resources.caches[c.cache];
    for (size_t k = 0; k < c.members.size(); ++k) {
      auto [pi, slice] = c.members[k];
      Param& p = registry.params[pi];
      p.cls = static_cast<int>(ci);
      if (slice == 0) p.first_member = static_cast<int64_t>(k);
      cc.names.push_back(registry.slice_name(pi, slice));
    }
  }
  // Statuses and norms: one entry per Muon matrix (class by class), then one per AdamW parameter.
  record.adam_params.clear();
  int64_t muon_matrices = 0;
  for (const ShapeClass& c : local.classes) muon_matrices += static_cast<int64_t>(c.members.size());
  for (size_t i = 0; i < registry.params.size(); ++i)
    if (registry.groups[registry.params[i].spec.group].kind != ParamKind::kMuon) {
      registry.params[i].adam_index = static_cast<int>(record.adam_params.size());
      record.adam_params.push_back(static_cast<int>(i));
    }
  record.n_status = muon_matrices + static_cast<int64_t>(record.adam_params.size());
  record.allocate(backend, registry, stats.muon_matrices, stats.muon_matrices);
  tune_shapes(class_shapes());
  built = true;
}

// (Re)allocates a class's buffers when its resolved algorithm or work dtype changed, and binds
// its cache entries to the current options.
void Engine::Impl::ensure_class_buffers(ShapeClass& c) {
  OrthoConfig r = tuning.resolve_shape(c.group, c.m, c.n);
  const int64_t count = static_cast<int64_t>(c.members.size());
  const bool same = c.x && r.iteration == c.resolved.iteration &&
                    iteration_dtype(r) == iteration_dtype(c.resolved) &&
                    r.steps == c.resolved.steps && r.restarts == c.resolved.restarts;
  c.resolved = r;
  if (!same) {
    c.x = backend.alloc(static_cast<size_t>(count * c.m * c.n) * dtype_size(iteration_dtype(r)));
    c.workspace_bytes = Orthogonalizer::workspace_bytes(r, count, c.m, c.n);
    c.workspace = backend.alloc(c.workspace_bytes);
  }
  size_t need = 0;
  if (resources.prepare_cache(resources.caches[c.cache], r, count, &need) &&
      need > c.workspace_bytes) {
    c.workspace_bytes = need;
    c.workspace = backend.alloc(need);
  }
}

void Engine::Impl::issue_local_step(std::span<const ParamData> data) {
  StepContext ctx;
  ctx.data.assign(data.begin(), data.end());
  ctx.raise = options.nonfinite == NonFinitePolicy::kRaise;
  ctx.active.resize(registry.params.size());
  for (size_t i = 0; i < registry.params.size(); ++i) ctx.active[i] = data[i].grad != nullptr;
  ctx.has_local = ctx.active;
  backend.fill_zero(record.step_status.data(),
                    static_cast<size_t>(record.n_status) * sizeof(int32_t));

  // One batch per shape class: its members that have a gradient in this step (wide ones first),
  // with consecutive status entries from the class's first one.
  struct ClassStep {
    std::vector<MuonSlot> slots;
    std::vector<int64_t> entries;  // the members' cache entries
    int64_t tall_begin = 0;
  };
  std::vector<ClassStep> steps(local.classes.size());
  std::vector<MuonBatch> batches;
  std::vector<std::string> status_names(
      static_cast<size_t>(record.n_status - record.adam_params.size()));
  int64_t status_offset = 0;
  for (size_t ci = 0; ci < local.classes.size(); ++ci) {
    const ShapeClass& c = local.classes[ci];  // its buffers follow the options (local_step)
    ClassStep& cs = steps[ci];
    for (size_t k = 0; k < c.members.size(); ++k) {
      const auto [pi, slice] = c.members[k];
      const Param& p = registry.params[pi];
      const ParamData& d = data[pi];
      if (!d.grad) continue;
      const int64_t rows = p.layout.rows, cols = p.layout.cols, offset = slice * rows * cols;
      auto at = [&](const void* base, DType t) {
        return const_cast<char*>(static_cast<const char*>(base)) + offset * dtype_size(t);
      };
      status_names[status_offset + cs.slots.size()] = registry.slice_name(pi, slice);
      cs.slots.push_back(
          {MatRef::of(at(d.grad, d.grad_dtype), d.grad_dtype, rows, cols),
           MatRef::of(at(p.state0.data(), p.state0_dtype), p.state0_dtype, rows, cols),
           MatRef::of(at(d.param, p.spec.dtype), p.spec.dtype, rows, cols),
           record.skips_of(p, slice), record.scalars.coef(p.first_matrix + slice)});
      cs.entries.push_back(static_cast<int64_t>(k));
      if (static_cast<int64_t>(k) < c.wide_members) cs.tall_begin += 1;
    }
    const int64_t count = static_cast<int64_t>(cs.slots.size());
    batches.push_back({backend, registry.groups[c.group].muon, record.scalars.mu(c.group),
                       c.resolved, count, cs.tall_begin, cs.slots,
                       record.step_norms.as<double>() + status_offset,
                       record.step_status.as<int32_t>() + status_offset});
    status_offset += static_cast<int64_t>(c.members.size());
  }

  adam.begin(ctx);
  // Each fused pass goes out for every class at once (Backend::muon_pass_grouped: a few launches
  // where a step has many small classes). Pass 1 everywhere first, so that the raise policy can
  // stop before any state changes.
  BatchSequence seq;
  seq.after_norms = [&] {
    adam.check(ctx);
    if (ctx.raise) record.raise_if_nonfinite(backend, registry, dist.world, status_names);
  };
  seq.resources = [&](size_t ci, BatchRef* x, BatchOrtho* how) {
    const ShapeClass& c = local.classes[ci];
    *x = BatchRef::packed(c.x.data(), iteration_dtype(c.resolved), batches[ci].count, c.m, c.n);
    *how = resources.batch_ortho(c.cache, steps[ci].entries, c.workspace.data(), c.workspace_bytes);
  };
  seq.share_launches = true;
  // The skips of every class at once: entries of matrices without a gradient stay zero.
  seq.all_status = {record.step_status.as<int32_t>(), static_cast<size_t>(status_offset)};
  seq.skip_counter = record.skip_counter.as<int64_t>();
  run_batches(backend, batches, seq);
  adam.update();
}

void Engine::Impl::count_local_step(std::span<const ParamData> data) {
  for (size_t i = 0; i < registry.params.size(); ++i)
    if (data[i].grad) registry.params[i].step += 1;
  stats.steps += 1;
}

}  // namespace distmuon
