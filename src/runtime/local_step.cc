// The single-process step: batching of same-shape matrices into classes, and the fused passes
// momentum -> orthogonalize -> update (ALGORITHMS.md section 1), plus AdamW.
#include <algorithm>
#include <map>
#include <sstream>

#include "distmuon/error.h"
#include "runtime/engine_impl.h"

namespace distmuon {

void Engine::Impl::build_classes() {
  std::map<std::tuple<int, int64_t, int64_t>, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (groups[p.spec.group].kind != ParamKind::kMuon) continue;
    auto key = std::make_tuple(p.spec.group, p.layout.rows, p.layout.cols);
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, classes.size()).first;
      ShapeClass c;
      c.group = p.spec.group;
      c.rows = p.layout.rows;
      c.cols = p.layout.cols;
      classes.push_back(std::move(c));
    }
    for (int64_t s = 0; s < p.layout.count; ++s)
      classes[it->second].members.emplace_back(static_cast<int>(i), s);
  }
  adam_status = backend.alloc(sizeof(int32_t) * std::max<size_t>(1, params.size()));
  built = true;
}

// (Re)allocates a class's buffers when its resolved algorithm or work dtype changed.
void Engine::Impl::ensure_class_buffers(ShapeClass& c) {
  OrthoConfig r = resolve(groups[c.group].muon.ortho, c.m(), c.n());
  const int64_t count = static_cast<int64_t>(c.members.size());
  const bool same = c.x && r.iteration == c.resolved.iteration &&
                    iteration_dtype(r) == iteration_dtype(c.resolved) &&
                    r.steps == c.resolved.steps && r.restarts == c.resolved.restarts;
  c.resolved = r;
  if (same) return;
  c.x = backend.alloc(static_cast<size_t>(count * c.m() * c.n()) * dtype_size(iteration_dtype(r)));
  c.workspace_bytes = Orthogonalizer::workspace_bytes(r, count, c.m(), c.n());
  c.workspace = backend.alloc(c.workspace_bytes);
  if (!c.norms) c.norms = backend.alloc(sizeof(float) * count);
  if (!c.status) c.status = backend.alloc(sizeof(int32_t) * count);
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
  DM_FAIL("non-finite gradient (NaN or Inf) in ", os.str(),
          "; the step was not applied (weights and optimizer state unchanged)");
}

void Engine::Impl::local_step(std::span<const ParamData> data) {
  Impl& s = *this;

  // Collect the slots that have a gradient in this step, per shape class.
  std::vector<std::vector<MuonSlot>> slots(s.classes.size());
  std::vector<std::vector<MuonUpdateCoef>> coefs(s.classes.size());
  std::vector<std::vector<int>> slot_params(s.classes.size());
  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    ShapeClass& c = s.classes[ci];
    s.ensure_class_buffers(c);
    const MuonOptions& opt = s.groups[c.group].muon;
    const double scale = shape_scale(opt.scale, c.rows, c.cols);
    for (auto [pi, slice] : c.members) {
      const Param& p = s.params[pi];
      const ParamData& d = data[pi];
      if (!d.grad) continue;
      const int64_t off = slice * c.rows * c.cols;
      auto at = [&](const void* base, DType t) {
        return const_cast<char*>(static_cast<const char*>(base)) + off * dtype_size(t);
      };
      MuonSlot slot;
      slot.grad = MatRef::of(at(d.grad, d.grad_dtype), d.grad_dtype, c.rows, c.cols);
      slot.momentum =
          MatRef::of(at(p.state0.data(), p.state0_dtype), p.state0_dtype, c.rows, c.cols);
      slot.weight = MatRef::of(at(d.param, p.spec.dtype), p.spec.dtype, c.rows, c.cols);
      slots[ci].push_back(slot);
      slot_params[ci].push_back(pi);
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
                          p.spec.dtype, data[i].grad_dtype, p.numel});
    const AdamWOptions& a = g.adamw;
    adam_coefs.push_back({a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, p.step + 1});
  }

  // Pass 1 everywhere first, so that the raise policy can stop before any state changes.
  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    const MuonOptions& opt = s.groups[s.classes[ci].group].muon;
    if (slots[ci].empty()) continue;
    s.backend.muon_momentum_norm(slots[ci], opt.momentum, opt.nesterov,
                                 s.classes[ci].norms.as<float>(),
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
    BatchRef x = BatchRef::packed(c.x.data(), iteration_dtype(c.resolved), n, c.m(), c.n());
    ScaleSpec norm{c.norms.as<float>(), norm_multiplier(c.resolved.coefficients), c.resolved.eps,
                   1.0};
    s.backend.muon_momentum_apply(slots[ci], opt.momentum, opt.nesterov, c.status.as<int32_t>(),
                                  norm, c.tall(), x);
    s.ortho.run(c.resolved, x, x, c.workspace.data(), c.workspace_bytes, &s.stats.ortho);
    s.backend.muon_update(slots[ci], coefs[ci], c.status.as<int32_t>(), x, c.tall());
    s.backend.count_status(c.status.as<int32_t>(), n, s.skip_counter.as<int64_t>());
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
