// The single-process step pipeline: registry, state, batching of same-shape matrices into
// classes, and the fused passes momentum -> orthogonalize -> update (ALGORITHMS.md section 1).
#include "distmuon/engine.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "distmuon/error.h"

namespace distmuon {

namespace {

struct Param {
  ParamSpec spec;
  int64_t numel = 0;
  MatrixLayout layout;  // Muon only
  Buffer state0;        // momentum_buffer (Muon) or exp_avg (AdamW)
  Buffer state1;        // exp_avg_sq (AdamW)
  DType state0_dtype = DType::kF32;
  int64_t step = 0;
  int cls = -1;            // Muon: its shape class
  int64_t first_member = 0;  // Muon: index of its first matrix in the class (cache entry)
};

// Muon matrices of one group and one shape: their momentum passes run as one launch list and
// their orthogonalization as one batch.
struct ShapeClass {
  int group = 0;
  int64_t rows = 0, cols = 0;
  std::vector<std::pair<int, int64_t>> members;  // (param index, slice within a 3D parameter)
  OrthoConfig resolved;
  Buffer x, workspace, norms, status;
  size_t workspace_bytes = 0;
  std::unique_ptr<TransformCache> cache;  // CacheMuon entries, one per member
  bool use_cache = false;                 // this step: cache enabled and the shape is Gram NS

  bool tall() const { return rows > cols; }
  int64_t m() const { return std::min(rows, cols); }
  int64_t n() const { return std::max(rows, cols); }
};

std::string join_shape(std::span<const int64_t> s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

}  // namespace

struct Engine::Impl {
  Backend& backend;
  EngineOptions options;
  std::vector<GroupOptions> groups;
  std::vector<Param> params;
  std::vector<ShapeClass> classes;
  bool built = false;
  Orthogonalizer ortho;
  EngineStats stats;
  Buffer skip_counter;  // int64 on the device
  Buffer adam_status;

  Impl(Backend& be, EngineOptions opt) : backend(be), options(opt), ortho(be) {
    skip_counter = backend.alloc(sizeof(int64_t));
    backend.fill_zero(skip_counter.data(), sizeof(int64_t));
  }

  void build_classes();
  void ensure_class_buffers(ShapeClass& c);
  void step(std::span<const ParamData> data);
  void check_inputs(std::span<const ParamData> data) const;
  void raise_if_nonfinite(const std::vector<std::vector<int>>& slot_params,
                          const std::vector<int>& adam_params);
  void run_cached(ShapeClass& c, const BatchRef& x, const std::vector<int64_t>& members);
  ShapeClass* cache_class(int param);
};

// Runs CacheMuon over the slots of a class. Slot k uses cache entry members[k]; parameters
// without a gradient leave gaps, so the batch goes in runs of consecutive entries.
void Engine::Impl::run_cached(ShapeClass& c, const BatchRef& x,
                              const std::vector<int64_t>& members) {
  const int32_t* status = c.status.as<int32_t>();
  for (size_t k0 = 0, k1; k0 < members.size(); k0 = k1) {
    for (k1 = k0 + 1; k1 < members.size() && members[k1] == members[k1 - 1] + 1;) ++k1;
    const int64_t len = static_cast<int64_t>(k1 - k0);
    BatchRef part = x.slice(static_cast<int64_t>(k0), len);
    ortho.run_cached(c.resolved, *c.cache, members[k0], part, part, status + k0,
                     c.workspace.data(), c.workspace_bytes, &stats.ortho);
  }
}

// The class holding a Muon parameter's cache entries, or null when it has none. Builds the
// classes (freezing the parameter list) so that a checkpoint can be restored before step 1.
ShapeClass* Engine::Impl::cache_class(int i) {
  Param& p = params[i];
  if (groups[p.spec.group].kind != ParamKind::kMuon) return nullptr;
  if (!built) build_classes();
  ShapeClass& c = classes[p.cls];
  ensure_class_buffers(c);
  return c.use_cache ? &c : nullptr;
}

Engine::Engine(Backend& backend, EngineOptions options)
    : impl_(std::make_unique<Impl>(backend, options)) {}
Engine::~Engine() = default;

int Engine::add_group(const GroupOptions& o) {
  DM_CHECK(!impl_->built, "groups must be added before the first step");
  if (o.kind == ParamKind::kMuon) {
    const MuonOptions& m = o.muon;
    DM_CHECK(m.lr >= 0, "Muon lr must be >= 0 (got ", m.lr, ")");
    DM_CHECK(m.momentum >= 0 && m.momentum < 1, "Muon momentum must be in [0, 1) (got ",
             m.momentum, ")");
    DM_CHECK(m.weight_decay >= 0, "Muon weight_decay must be >= 0 (got ", m.weight_decay, ")");
    DM_CHECK(m.momentum_dtype == DType::kF32 || m.momentum_dtype == DType::kBF16,
             "momentum dtype must be f32 or bf16");
    validate(m.cache, "Muon group cache options");
    coefficient_schedule(m.ortho.coefficients, m.ortho.steps);  // validates steps
  } else {
    const AdamWOptions& a = o.adamw;
    DM_CHECK(a.lr >= 0, "AdamW lr must be >= 0 (got ", a.lr, ")");
    DM_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
             "AdamW betas must be in [0, 1) (got ", a.beta1, ", ", a.beta2, ")");
    DM_CHECK(a.eps > 0, "AdamW eps must be > 0 (got ", a.eps, ")");
    DM_CHECK(a.weight_decay >= 0, "AdamW weight_decay must be >= 0");
  }
  impl_->groups.push_back(o);
  return static_cast<int>(impl_->groups.size()) - 1;
}

GroupOptions& Engine::group(int i) {
  DM_CHECK(i >= 0 && i < num_groups(), "no parameter group ", i);
  return impl_->groups[i];
}
int Engine::num_groups() const { return static_cast<int>(impl_->groups.size()); }
int Engine::num_params() const { return static_cast<int>(impl_->params.size()); }
const ParamSpec& Engine::param(int i) const {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  return impl_->params[i].spec;
}
Backend& Engine::backend() { return impl_->backend; }

int Engine::add_param(const ParamSpec& spec) {
  Impl& s = *impl_;
  DM_CHECK(!s.built, "parameter '", spec.name, "' added after the first step");
  DM_CHECK(spec.group >= 0 && spec.group < num_groups(), "parameter '", spec.name,
           "' names group ", spec.group, " but only ", num_groups(), " exist");
  Param p;
  p.spec = spec;
  p.numel = 1;
  for (int64_t d : spec.shape) {
    DM_CHECK(d > 0, "parameter '", spec.name, "' has shape ", join_shape(spec.shape),
             ": empty parameters cannot be optimized");
    p.numel *= d;
  }
  const GroupOptions& g = s.groups[spec.group];
  if (g.kind == ParamKind::kMuon) {
    p.layout = matrix_layout(spec.name, spec.shape);
    p.state0_dtype = g.muon.momentum_dtype;
    p.state0 = s.backend.alloc(static_cast<size_t>(p.numel) * dtype_size(p.state0_dtype));
    s.backend.fill_zero(p.state0.data(), p.state0.bytes());
    s.stats.muon_matrices += p.layout.count;
    s.stats.muon_params += p.numel;
  } else {
    p.state0 = s.backend.alloc(static_cast<size_t>(p.numel) * sizeof(float));
    p.state1 = s.backend.alloc(static_cast<size_t>(p.numel) * sizeof(float));
    s.backend.fill_zero(p.state0.data(), p.state0.bytes());
    s.backend.fill_zero(p.state1.data(), p.state1.bytes());
    s.stats.adamw_params += p.numel;
  }
  s.params.push_back(std::move(p));
  return static_cast<int>(s.params.size()) - 1;
}

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
    params[i].cls = static_cast<int>(it->second);
    params[i].first_member = static_cast<int64_t>(classes[it->second].members.size());
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
  if (!same) {
    c.x = backend.alloc(static_cast<size_t>(count * c.m() * c.n()) *
                        dtype_size(iteration_dtype(r)));
    c.workspace_bytes = Orthogonalizer::workspace_bytes(r, count, c.m(), c.n());
    c.workspace = backend.alloc(c.workspace_bytes);
    if (!c.norms) c.norms = backend.alloc(sizeof(float) * count);
    if (!c.status) c.status = backend.alloc(sizeof(int32_t) * count);
  }
  // CacheMuon: its options may change between steps; prepare() keeps the entries unless the
  // shape, dtype or algorithm changed.
  const CacheOptions& co = groups[c.group].muon.cache;
  c.use_cache = co.enabled && r.iteration == Iteration::kGram;
  if (!c.use_cache) return;
  if (!c.cache) c.cache = std::make_unique<TransformCache>(backend, co);
  c.cache->set_options(co);
  c.cache->prepare(r, count, c.m(), c.n());
  const size_t need = Orthogonalizer::cached_workspace_bytes(r, co, count, c.m(), c.n());
  if (need > c.workspace_bytes) {
    c.workspace_bytes = need;
    c.workspace = backend.alloc(need);
  }
}

void Engine::Impl::check_inputs(std::span<const ParamData> data) const {
  DM_CHECK(data.size() == params.size(), "step got ", data.size(), " parameters, ",
           params.size(), " are registered");
  for (size_t i = 0; i < data.size(); ++i) {
    const ParamData& d = data[i];
    const ParamSpec& spec = params[i].spec;
    DM_CHECK(d.param != nullptr, "parameter '", spec.name, "' has no data");
    if (!d.grad) continue;
    if (!d.grad_shape.empty()) {
      bool same = d.grad_shape.size() == spec.shape.size() &&
                  std::equal(d.grad_shape.begin(), d.grad_shape.end(), spec.shape.begin());
      DM_CHECK(same, "parameter '", spec.name, "' has shape ", join_shape(spec.shape),
               " but its gradient has shape ", join_shape(d.grad_shape));
    }
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
  DM_FAIL("non-finite gradient (NaN or Inf) in ", os.str(),
          "; the step was not applied (weights and optimizer state unchanged)");
}

void Engine::step(std::span<const ParamData> data) {
  Impl& s = *impl_;
  s.check_inputs(data);
  if (!s.built) s.build_classes();

  // Collect the slots that have a gradient in this step, per shape class.
  std::vector<std::vector<MuonSlot>> slots(s.classes.size());
  std::vector<std::vector<MuonUpdateCoef>> coefs(s.classes.size());
  std::vector<std::vector<int>> slot_params(s.classes.size());
  std::vector<std::vector<int64_t>> slot_member(s.classes.size());  // cache entry of each slot
  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    ShapeClass& c = s.classes[ci];
    s.ensure_class_buffers(c);
    const MuonOptions& opt = s.groups[c.group].muon;
    const double scale = shape_scale(opt.scale, c.rows, c.cols);
    for (size_t mi = 0; mi < c.members.size(); ++mi) {
      const auto [pi, slice] = c.members[mi];
      const Param& p = s.params[pi];
      const ParamData& d = data[pi];
      if (!d.grad) continue;
      slot_member[ci].push_back(static_cast<int64_t>(mi));
      const int64_t off = slice * c.rows * c.cols;
      auto at = [&](const void* base, DType t) {
        return const_cast<char*>(static_cast<const char*>(base)) + off * dtype_size(t);
      };
      MuonSlot slot;
      slot.grad = MatRef::of(at(d.grad, d.grad_dtype), d.grad_dtype, c.rows, c.cols);
      slot.momentum = MatRef::of(at(p.state0.data(), p.state0_dtype), p.state0_dtype, c.rows, c.cols);
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
                                 s.classes[ci].norms.as<float>(), s.classes[ci].status.as<int32_t>());
  }
  if (!adam_slots.empty()) s.backend.adamw_check(adam_slots, s.adam_status.as<int32_t>());
  if (s.options.nonfinite == NonFinitePolicy::kRaise) s.raise_if_nonfinite(slot_params, adam_params);

  for (size_t ci = 0; ci < s.classes.size(); ++ci) {
    ShapeClass& c = s.classes[ci];
    if (slots[ci].empty()) continue;
    const MuonOptions& opt = s.groups[c.group].muon;
    const int64_t n = static_cast<int64_t>(slots[ci].size());
    BatchRef x = BatchRef::packed(c.x.data(), iteration_dtype(c.resolved), n, c.m(), c.n());
    ScaleSpec norm{c.norms.as<float>(), norm_multiplier(c.resolved.coefficients), c.resolved.eps, 1.0};
    s.backend.muon_momentum_apply(slots[ci], opt.momentum, opt.nesterov, c.status.as<int32_t>(),
                                  norm, c.tall(), x);
    if (c.use_cache)
      s.run_cached(c, x, slot_member[ci]);
    else
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

TensorView Engine::state(int i, const std::string& name) {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  Param& p = impl_->params[i];
  const bool muon = impl_->groups[p.spec.group].kind == ParamKind::kMuon;
  Device dev = impl_->backend.device();
  if (muon && name == "momentum_buffer")
    return TensorView::contiguous(p.state0.data(), p.spec.shape, p.state0_dtype, dev);
  if (muon && name.rfind("cache_", 0) == 0) {
    ShapeClass* c = impl_->cache_class(i);
    DM_CHECK(c, "parameter '", p.spec.name, "' has no CacheMuon state (cache off or ",
             p.layout.rows, "x", p.layout.cols, " is not orthogonalized with Gram NS)");
    std::vector<int64_t> lead;
    if (p.spec.shape.size() == 3) lead.push_back(p.layout.count);
    return c->cache->state(name, p.first_member, p.layout.count, lead);
  }
  if (!muon && name == "exp_avg")
    return TensorView::contiguous(p.state0.data(), p.spec.shape, DType::kF32, dev);
  if (!muon && name == "exp_avg_sq")
    return TensorView::contiguous(p.state1.data(), p.spec.shape, DType::kF32, dev);
  DM_FAIL("parameter '", p.spec.name, "' has no state '", name, "'");
}

std::vector<std::string> Engine::state_names(int i) const {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  if (impl_->groups[impl_->params[i].spec.group].kind == ParamKind::kMuon) {
    std::vector<std::string> names = {"momentum_buffer"};
    if (impl_->cache_class(i))
      for (const std::string& n : TransformCache::state_names()) names.push_back(n);
    return names;
  }
  return {"exp_avg", "exp_avg_sq"};
}

int64_t Engine::param_step(int i) const {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  return impl_->params[i].step;
}
void Engine::set_param_step(int i, int64_t step) {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  DM_CHECK(step >= 0, "step must be >= 0");
  impl_->params[i].step = step;
}

EngineStats Engine::stats() {
  impl_->backend.synchronize();
  EngineStats st = impl_->stats;
  impl_->backend.copy_to_host(&st.nonfinite_skips, impl_->skip_counter.data(), sizeof(int64_t));
  for (ShapeClass& c : impl_->classes) {
    if (!c.cache) continue;
    std::vector<std::string> names;
    for (auto [pi, slice] : c.members) {
      const Param& p = impl_->params[pi];
      names.push_back(p.layout.count > 1 ? p.spec.name + "[" + std::to_string(slice) + "]"
                                         : p.spec.name);
    }
    CacheStats cs = c.cache->stats(names);
    st.ortho.flops += cs.flops;  // run_cached leaves its FLOPs to the cache's accounting
    st.cache.merge(cs);
  }
  return st;
}

}  // namespace distmuon
