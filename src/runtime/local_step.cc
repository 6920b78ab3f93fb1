// The single-process step: batching of same-shape matrices into classes, and the fused passes
// momentum -> orthogonalize -> update (docs/algorithms.md section 1), plus AdamW.
#include <algorithm>
#include <map>
#include <sstream>

#include "distmuon/error.h"
#include "runtime/engine_impl.h"

namespace distmuon {

void Engine::Impl::build_classes() {
  // Classes by (group, m, n): a tall weight and a wide one with the same sides (an MLP's up and
  // down projections) share one orthogonalization batch. Wide members first, then tall ones,
  // each in registration order, so that each orientation is one slice of the batch.
  std::map<std::tuple<int, int64_t, int64_t>, size_t> index;
  std::vector<std::vector<std::pair<int, int64_t>>> tall;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (groups[p.spec.group].kind != ParamKind::kMuon) continue;
    const int64_t m = std::min(p.layout.rows, p.layout.cols);
    const int64_t n = std::max(p.layout.rows, p.layout.cols);
    auto key = std::make_tuple(p.spec.group, m, n);
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, classes.size()).first;
      ShapeClass c;
      c.group = p.spec.group;
      c.m = m;
      c.n = n;
      classes.push_back(std::move(c));
      tall.emplace_back();
    }
    auto& into = p.layout.rows > p.layout.cols ? tall[it->second] : classes[it->second].members;
    for (int64_t s = 0; s < p.layout.count; ++s) into.emplace_back(static_cast<int>(i), s);
  }
  for (size_t ci = 0; ci < classes.size(); ++ci) {
    ShapeClass& c = classes[ci];
    c.wide_members = static_cast<int64_t>(c.members.size());
    c.members.insert(c.members.end(), tall[ci].begin(), tall[ci].end());
    c.cache = cache_class_of(c.group, c.m, c.n);
    CacheClass& cc = caches[c.cache];
    for (size_t k = 0; k < c.members.size(); ++k) {
      auto [pi, slice] = c.members[k];
      Param& p = params[pi];
      p.cls = static_cast<int>(ci);
      if (slice == 0) p.first_member = static_cast<int64_t>(k);
      cc.names.push_back(p.layout.count > 1 ? p.spec.name + "[" + std::to_string(slice) + "]"
                                            : p.spec.name);
    }
  }
  adam_status = backend.alloc(sizeof(int32_t) * std::max<size_t>(1, params.size()));
  allocate_step_counts();
  std::vector<TuneShape> shapes;
  for (const ShapeClass& c : classes)
    shapes.push_back({c.group, c.m, c.n, static_cast<int64_t>(c.members.size())});
  tune_shapes(shapes);
  built = true;
}

// (Re)allocates a class's buffers when its resolved algorithm or work dtype changed, and binds
// its cache entries to the current options.
void Engine::Impl::ensure_class_buffers(ShapeClass& c) {
  OrthoConfig r = resolve_shape(c.group, c.m, c.n);
  const int64_t count = static_cast<int64_t>(c.members.size());
  const bool same = c.x && r.iteration == c.resolved.iteration &&
                    iteration_dtype(r) == iteration_dtype(c.resolved) &&
                    r.steps == c.resolved.steps && r.restarts == c.resolved.restarts;
  c.resolved = r;
  if (!same) {
    c.x = backend.alloc(static_cast<size_t>(count * c.m * c.n) * dtype_size(iteration_dtype(r)));
    c.workspace_bytes = Orthogonalizer::workspace_bytes(r, count, c.m, c.n);
    c.workspace = backend.alloc(c.workspace_bytes);
    if (!c.norms) c.norms = backend.alloc(sizeof(double) * count);
    if (!c.status) c.status = backend.alloc(sizeof(int32_t) * count);
  }
  size_t need = 0;
  if (prepare_cache(caches[c.cache], r, count, &need) && need > c.workspace_bytes) {
    c.workspace_bytes = need;
    c.workspace = backend.alloc(need);
  }
}

void Engine::Impl::raise_if_nonfinite(const std::vector<std::vector<int>>& slot_params,
                                      const std::vector<int>& adam_params) {
  backend.synchronize();
  std::vector<std::string> bad;
  for (size_t ci = 0; ci < classes.size(); ++ci) {
    std::vector<int32_t> st(slot_params[ci].size());
    backend.copy_to_host(st.data(), classes[ci].status.data(), st.size() * sizeof(int32_t));
    for (size_t k = 0; k < st.size(); ++k) {
      const std::string& name = params[slot_params[ci][k]].spec.name;
      if (st[k] != kStatusOk && (bad.empty() || bad.back() != name)) bad.push_back(name);
    }
  }
  if (!adam_params.empty()) {
    std::vector<int32_t> st(adam_params.size());
    backend.copy_to_host(st.data(), adam_status.data(), st.size() * sizeof(int32_t));
    for (size_t k = 0; k < st.size(); ++k)
      if (st[k] != kStatusOk) bad.push_back(params[adam_params[k]].spec.name);
  }
  if (bad.empty()) return;
  std::ostringstream os;
  for (size_t i = 0; i < bad.size(); ++i) os << (i ? ", " : "") << "'" << bad[i] << "'";
  DM_FAIL("non-finite gradient (NaN or Inf), or a momentum beyond the range of its dtype, in ",
          os.str(),
          "; the step was not applied (weights and optimizer state unchanged)");
}

void Engine::Impl::local_step(std::span<const ParamData> data) {
  Impl& s = *this;

  // Collect the slots that have a gradient in this step, per shape class (wide slots first).
  std::vector<std::vector<MuonSlot>> slots(s.classes.size());
  std::vector<std::vector<MuonUpdateCoef>> coefs(s.classes.size());
  std::vector<std::vector<int>> slot_params(s.classes.size());
  std::vector<std::vector<int64_t>> slot_member(s.classes.size());  // its cache entry
  std::vector<int64_t> wide_slots(s.classes.size(), 0);
  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    ShapeClass& c = s.classes[ci];
    s.ensure_class_buffers(c);
    const MuonOptions& opt = s.groups[c.group].muon;
    for (size_t mi = 0; mi < c.members.size(); ++mi) {
      const auto [pi, slice] = c.members[mi];
      const Param& p = s.params[pi];
      const ParamData& d = data[pi];
      if (!d.grad) continue;
      const int64_t rows = p.layout.rows, cols = p.layout.cols;
      const int64_t off = slice * rows * cols;
      auto at = [&](const void* base, DType t) {
        return const_cast<char*>(static_cast<const char*>(base)) + off * dtype_size(t);
      };
      MuonSlot slot;
      slot.grad = MatRef::of(at(d.grad, d.grad_dtype), d.grad_dtype, rows, cols);
      slot.momentum = MatRef::of(at(p.state0.data(), p.state0_dtype), p.state0_dtype, rows, cols);
      slot.weight = MatRef::of(at(d.param, p.spec.dtype), p.spec.dtype, rows, cols);
      slot.skips = s.skips_of(p, slice);
      slots[ci].push_back(slot);
      slot_params[ci].push_back(pi);
      slot_member[ci].push_back(static_cast<int64_t>(mi));
      if (static_cast<int64_t>(mi) < c.wide_members) wide_slots[ci] += 1;
      const double scale = shape_scale(opt.scale, rows, cols);
      coefs[ci].push_back({1.0f - opt.lr * opt.weight_decay, static_cast<float>(opt.lr * scale)});
    }
  }
  std::vector<int> adam_params;
  std::vector<AdamSlot> adam_slots;
  std::vector<AdamCoef> adam_coefs;
  for (size_t i = 0; i < s.params.size(); ++i) {
    Param& p = s.params[i];
    const GroupOptions& g = s.groups[p.spec.group];
    if (g.kind != ParamKind::kAdamW || !data[i].grad) continue;
    adam_params.push_back(static_cast<int>(i));
    adam_slots.push_back({data[i].param, data[i].grad, p.state0.data(), p.state1.data(),
                          p.spec.dtype, data[i].grad_dtype, p.numel, s.step_count(i)});
    const AdamWOptions& a = g.adamw;
    adam_coefs.push_back({a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, p.step + 1});
  }

  // Pass 1 everywhere first, so that the raise policy can stop before any state changes.
  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    const MuonOptions& opt = s.groups[s.classes[ci].group].muon;
    if (slots[ci].empty()) continue;
    s.backend.muon_momentum_norm(slots[ci], opt.momentum, opt.nesterov,
                                 s.classes[ci].norms.as<double>(),
                                 s.classes[ci].status.as<int32_t>());
  }
  if (!adam_slots.empty()) s.backend.adamw_check(adam_slots, s.adam_status.as<int32_t>());
  if (s.options.nonfinite == NonFinitePolicy::kRaise)
    s.raise_if_nonfinite(slot_params, adam_params);

  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    ShapeClass& c = s.classes[ci];
    if (slots[ci].empty()) continue;
    const MuonOptions& opt = s.groups[c.group].muon;
    const int64_t n = static_cast<int64_t>(slots[ci].size());
    int32_t* status = c.status.as<int32_t>();
    BatchRef x = BatchRef::packed(c.x.data(), iteration_dtype(c.resolved), n, c.m, c.n);
    const std::span<const MuonSlot> all(slots[ci]);
    const std::span<const MuonUpdateCoef> all_coefs(coefs[ci]);
    // The fused passes once per orientation, on the wide slice [0, nw) and the tall one.
    const int64_t nw = wide_slots[ci];
    auto per_orientation = [&](auto&& pass) {
      if (nw > 0) pass(0, nw, false);
      if (n > nw) pass(nw, n - nw, true);
    };
    per_orientation([&](int64_t k0, int64_t len, bool tall) {
      s.backend.muon_momentum_apply(all.subspan(k0, len), opt.momentum, opt.nesterov, status + k0,
                                    muon_input_scale(c.norms.as<double>() + k0, c.resolved), tall,
                                    x.slice(k0, len));
    });
    s.orthogonalize(c.cache, c.resolved, x, slot_member[ci], status, c.workspace.data(),
                    c.workspace_bytes);
    per_orientation([&](int64_t k0, int64_t len, bool tall) {
      s.backend.muon_update(all.subspan(k0, len), all_coefs.subspan(k0, len), status + k0,
                            x.slice(k0, len), tall);
    });
    s.backend.count_status(status, n, s.skip_counter.as<int64_t>());
  }
  if (!adam_slots.empty()) {
    s.backend.adamw_update(adam_slots, adam_coefs, s.adam_status.as<int32_t>());
    s.backend.count_status(s.adam_status.as<int32_t>(), static_cast<int64_t>(adam_slots.size()),
                           s.skip_counter.as<int64_t>());
  }
  for (size_t i = 0; i < s.params.size(); ++i)
    if (data[i].grad) s.params[i].step += 1;
  s.stats.steps += 1;
}

}  // namespace distmuon
