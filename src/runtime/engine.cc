// The Engine's public API: registry of groups and parameters, optimizer state, statistics. The
// step itself lives in local_step.cc (single process) and dist_step.cc (distributed).
#include "distmuon/engine.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "distmuon/error.h"
#include "runtime/engine_impl.h"
#include "runtime/mode_runner.h"

namespace distmuon {

std::string join_shape(std::span<const int64_t> s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

DistMode parse_dist_mode(const std::string& s) {
  if (s == "gather") return DistMode::kGather;
  if (s == "replicated") return DistMode::kReplicated;
  if (s == "sharded") return DistMode::kSharded;
  if (s == "dedicated") return DistMode::kDedicated;
  DM_FAIL("unknown distributed mode '", s, "' (expected gather, replicated, sharded or dedicated)");
}

const char* dist_mode_name(DistMode m) {
  switch (m) {
    case DistMode::kGather:
      return "gather";
    case DistMode::kReplicated:
      return "replicated";
    case DistMode::kSharded:
      return "sharded";
    case DistMode::kDedicated:
      return "dedicated";
  }
  return "?";
}

Engine::Impl::Impl(Backend& be, EngineOptions opt)
    : backend(be),
      options(opt),
      tuning(be, registry.groups),
      resources(be, registry.groups, tuning, stats.ortho),
      adam(be, registry, record, dist) {
  local.graph_mode = LocalStep::graphs_enabled(options);
  record.skip_counter = backend.alloc(sizeof(int64_t));
  backend.fill_zero(record.skip_counter.data(), sizeof(int64_t));
}

Engine::Impl::~Impl() {
  // A publication left in flight must land before the buffers it writes are released.
  try {
    if (pipeline.publish_pending) finish_publish();
  } catch (...) {
  }
  // So must the collectives a step that raised left unchecked: they may write into the runner's
  // staging buffers, which `pipeline` (declared after `dist`) releases first. Each handle waits
  // (or, after a failure on its communicator, is abandoned) as it goes.
  dist.unchecked.clear();
}

Engine::Engine(Backend& backend, EngineOptions options)
    : impl_(std::make_unique<Impl>(backend, options)) {}

Engine::Engine(Backend& backend, Communicator& world, const DistOptions& dist,
               EngineOptions options)
    : impl_(std::make_unique<Impl>(backend, options)) {
  DM_CHECK(world.device().kind == backend.device().kind, "the communicator ", world.name(),
           " moves ", world.device().kind == DeviceKind::kCPU ? "host" : "CUDA",
           " memory but the backend ", backend.name(), " computes elsewhere");
  impl_->dist.world = &world;
  impl_->dist.options = dist;
}

Engine::~Engine() = default;

int Engine::add_group(const GroupOptions& o) {
  DM_CHECK(!impl_->built, "groups must be added before the first step");
  if (o.kind == ParamKind::kMuon) {
    const MuonOptions& m = o.muon;
    DM_CHECK(m.lr >= 0, "Muon lr must be >= 0 (got ", m.lr, ")");
    DM_CHECK(m.momentum >= 0 && m.momentum < 1, "Muon momentum must be in [0, 1) (got ", m.momentum,
             ")");
    DM_CHECK(m.weight_decay >= 0, "Muon weight_decay must be >= 0 (got ", m.weight_decay, ")");
    DM_CHECK(m.momentum_dtype == DType::kF32 || m.momentum_dtype == DType::kBF16,
             "momentum dtype must be f32 or bf16");
    validate(m.cache, "Muon group cache options");
    coefficient_schedule(m.ortho);  // validates steps and custom rows
  } else {
    const AdamWOptions& a = o.adamw;
    DM_CHECK(a.lr >= 0, "AdamW lr must be >= 0 (got ", a.lr, ")");
    DM_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
             "AdamW betas must be in [0, 1) (got ", a.beta1, ", ", a.beta2, ")");
    DM_CHECK(a.eps > 0, "AdamW eps must be > 0 (got ", a.eps, ")");
    DM_CHECK(a.weight_decay >= 0, "AdamW weight_decay must be >= 0");
  }
  impl_->registry.groups.push_back(o);
  return static_cast<int>(impl_->registry.groups.size()) - 1;
}

GroupOptions& Engine::group(int i) {
  DM_CHECK(i >= 0 && i < num_groups(), "no parameter group ", i);
  return impl_->registry.groups[i];
}
int Engine::num_groups() const { return static_cast<int>(impl_->registry.groups.size()); }
int Engine::num_params() const { return static_cast<int>(impl_->registry.params.size()); }
const ParamSpec& Engine::param(int i) const {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  return impl_->registry.params[i].spec;
}
Backend& Engine::backend() { return impl_->backend; }
bool Engine::distributed() const { return impl_->dist.world != nullptr; }
const DistOptions& Engine::dist_options() const { return impl_->dist.options; }
const Plan* Engine::plan() const {
  return impl_->dist.world && impl_->built ? &impl_->dist.plan : nullptr;
}

int Engine::Impl::add_param(const ParamSpec& spec) {
  Impl& s = *this;
  DM_CHECK(!s.built, "parameter '", spec.name, "' added after the first step");
  DM_CHECK(spec.group >= 0 && spec.group < static_cast<int>(s.registry.groups.size()),
           "parameter '", spec.name, "' names group ", spec.group, " but only ",
           static_cast<int>(s.registry.groups.size()), " exist");
  Param p;
  p.spec = spec;
  for (int64_t d : spec.shape)
    DM_CHECK(d > 0, "parameter '", spec.name, "' has shape ", join_shape(spec.shape),
             ": empty parameters cannot be optimized");
  DM_CHECK(!spec.shape.empty(), "parameter '", spec.name, "' is a scalar; give it shape [1]");
  // Every buffer of it (the parameter, its gradient, its state: at most 8 bytes an element)
  // must have a size in bytes that int64 holds.
  p.numel = checked_numel(spec.shape, "parameter '" + spec.name + "'");
  checked_bytes(p.numel, DType::kF64, "parameter '" + spec.name + "'");
  p.dim0 = spec.shape[0];
  p.inner = p.numel / p.dim0;
  const ShardSpec& sh = spec.shard;
  if (sh.sharded()) {
    DM_CHECK(s.dist.world != nullptr, "parameter '", spec.name,
             "' has a shard but the engine is not distributed");
    DM_CHECK(sh.row_begin >= 0 && sh.row_begin + sh.row_count <= p.dim0, "parameter '", spec.name,
             "': shard rows [", sh.row_begin, ", ", sh.row_begin + sh.row_count,
             ") are outside dim 0 of size ", p.dim0);
  }
  p.local_rows = sh.sharded() ? sh.row_count : p.dim0;
  p.local_numel = p.local_rows * p.inner;
  const GroupOptions& g = s.registry.groups[spec.group];
  if (g.kind == ParamKind::kMuon) {
    p.layout = matrix_layout(spec.name, spec.shape);
    p.state0_dtype = g.muon.momentum_dtype;
    p.first_matrix = s.stats.muon_matrices;
    s.stats.muon_matrices += p.layout.count;
    s.stats.muon_params += p.numel;
  } else {
    s.stats.adamw_params += p.numel;
  }
  // A distributed engine allocates state in setup(), once the owners are known.
  if (!s.dist.world) {
    const size_t n = static_cast<size_t>(p.numel);
    p.state0 =
        s.backend.alloc(n * dtype_size(g.kind == ParamKind::kMuon ? p.state0_dtype : DType::kF32));
    s.backend.fill_zero(p.state0.data(), p.state0.bytes());
    if (g.kind == ParamKind::kAdamW) {
      p.state1 = s.backend.alloc(n * sizeof(float));
      s.backend.fill_zero(p.state1.data(), p.state1.bytes());
    }
  }
  s.registry.params.push_back(std::move(p));
  return static_cast<int>(s.registry.params.size()) - 1;
}

int Engine::add_param(const ParamSpec& spec) {
  Impl& s = *impl_;
  DM_CHECK(!s.built, "parameter '", spec.name, "' added after the first step");
  if (!s.dist.world) return s.add_param(spec);
  // Distributed: an error on one rank must reach every rank (setup() reports it everywhere);
  // thrown here it would leave the other ranks waiting for this one until the timeout.
  try {
    return s.add_param(spec);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind("distmuon: ", 0) == 0) msg.erase(0, 10);
    s.registry.registration_errors.push_back(msg);
    Param p;
    p.spec = spec;
    s.registry.params.push_back(std::move(p));
    return static_cast<int>(s.registry.params.size()) - 1;
  }
}

void Engine::Impl::check_inputs(std::span<const ParamData> data) const {
  DM_CHECK(data.size() == registry.params.size(), "step got ", data.size(), " parameters, ",
           registry.params.size(), " are registered");
  for (size_t i = 0; i < data.size(); ++i) {
    const ParamData& d = data[i];
    const Param& p = registry.params[i];
    const std::string where =
        dist.world ? detail::concat(" (rank ", dist.rank, ")") : std::string();
    // With caller transfers only the owners of a Muon parameter's matrices need its buffers.
    const bool optional =
        caller_transfers() && !d.grad && registry.groups[p.spec.group].kind == ParamKind::kMuon;
    DM_CHECK(d.param != nullptr || p.local_numel == 0 || optional, "parameter '", p.spec.name,
             "' has no data", where);
    if (!d.grad || d.grad_shape.empty()) continue;
    std::vector<int64_t> want = p.spec.shape;
    want[0] = p.local_rows;
    bool same = d.grad_shape.size() == want.size() &&
                std::equal(d.grad_shape.begin(), d.grad_shape.end(), want.begin());
    DM_CHECK(same, "parameter '", p.spec.name, "' has ",
             p.spec.shard.sharded() ? "local shard shape " : "shape ", join_shape(want),
             " but its gradient has shape ", join_shape(d.grad_shape), where);
  }
}

void Engine::setup() {
  Impl& s = *impl_;
  if (s.built) return;
  if (s.dist.world)
    s.dist_setup();
  else
    s.build_classes();
}

void Engine::step(std::span<const ParamData> data) {
  Impl& s = *impl_;
  if (!s.built) setup();
  if (s.dist.world) {
    s.dist_step(data);  // checks the inputs and shares any error with every rank
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  s.check_inputs(data);
  s.local_step(data);
  s.stats.issue_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::wait_published() {
  if (impl_->pipeline.publish_pending) impl_->finish_publish();
}

int Engine::owner(int param, int64_t slice) const {
  DM_CHECK(param >= 0 && param < num_params(), "no parameter ", param);
  const Param& p = impl_->registry.params[param];
  DM_CHECK(impl_->registry.groups[p.spec.group].kind == ParamKind::kMuon, "parameter '",
           p.spec.name, "' is not a Muon parameter");
  DM_CHECK(slice >= 0 && slice < p.layout.count, "parameter '", p.spec.name, "' has ",
           p.layout.count, " matrices, not ", slice + 1);
  if (!impl_->dist.world) return 0;
  DM_CHECK(impl_->built, "owners are known after setup()");
  return impl_->dist.mats[p.matrices[slice]].owner;
}

TensorView Engine::matrix_state(int i, int64_t slice, const std::string& name) {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  Param& p = impl_->registry.params[i];
  const bool muon = impl_->registry.groups[p.spec.group].kind == ParamKind::kMuon;
  DM_CHECK(muon && (name == "momentum_buffer" || name.rfind("cache_", 0) == 0), "parameter '",
           p.spec.name, "' has no matrix state '", name, "'");
  DM_CHECK(slice >= 0 && slice < p.layout.count, "parameter '", p.spec.name, "' has ",
           p.layout.count, " matrices, not ", slice + 1);
  // CacheMuon entries live where the matrix is orthogonalized (the owner; everywhere in gather
  // mode and in a single process).
  if (name != "momentum_buffer") return impl_->cache_view(i, slice, 1, name, {});
  const Device dev = impl_->backend.device();
  const std::vector<int64_t> shape = {p.layout.rows, p.layout.cols};
  const size_t es = dtype_size(p.state0_dtype);
  const int64_t off = slice * p.layout.rows * p.layout.cols;
  if (!impl_->dist.world || impl_->dist.options.mode == DistMode::kGather) {
    // Single process: the whole parameter; gather: only a whole-matrix local shard qualifies.
    if (impl_->dist.world && (p.local_numel != p.numel))
      return TensorView{nullptr, shape, {}, p.state0_dtype, dev};
    return TensorView::contiguous(p.state0.as<char>() + off * es, shape, p.state0_dtype, dev);
  }
  DM_CHECK(impl_->built, "distributed state exists after setup()");
  const DistMatrix& m = impl_->dist.mats[p.matrices[slice]];
  return TensorView::contiguous(m.momentum.data(), shape, p.state0_dtype, dev);
}

TensorView Engine::state(int i, const std::string& name) {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  Impl& s = *impl_;
  Param& p = s.registry.params[i];
  const bool muon = s.registry.groups[p.spec.group].kind == ParamKind::kMuon;
  const Device dev = s.backend.device();
  DM_CHECK(!s.dist.world || s.built, "distributed state exists after setup()");
  std::vector<int64_t> local = p.spec.shape;
  local[0] = p.local_rows;
  if (muon && name == "momentum_buffer") {
    if (s.dist.world && s.dist.options.mode != DistMode::kGather) {
      DM_CHECK(p.layout.count == 1, "parameter '", p.spec.name, "' holds ", p.layout.count,
               " matrices with their own owners: read them with matrix_state()");
      const DistMatrix& m = s.dist.mats[p.matrices[0]];
      return TensorView::contiguous(m.momentum.data(), p.spec.shape, p.state0_dtype, dev);
    }
    return TensorView::contiguous(p.state0.data(), local, p.state0_dtype, dev);
  }
  if (muon && name.rfind("cache_", 0) == 0) {
    // One entry per matrix: leading shape [] for a matrix, [e] for a 3D parameter. Owner modes:
    // like momentum, a parameter whose matrices have several owners is read per matrix.
    DM_CHECK(!s.dist.world || s.dist.options.mode == DistMode::kGather || p.layout.count == 1,
             "parameter '", p.spec.name, "' holds ", p.layout.count,
             " matrices with their own owners: read their cache state with matrix_state()");
    std::vector<int64_t> lead;
    if (p.spec.shape.size() == 3) lead.push_back(p.layout.count);
    return s.cache_view(i, 0, p.layout.count, name, lead);
  }
  if (!muon && name == "exp_avg")
    return TensorView::contiguous(p.state0.data(), local, DType::kF32, dev);
  if (!muon && name == "exp_avg_sq")
    return TensorView::contiguous(p.state1.data(), local, DType::kF32, dev);
  DM_FAIL("parameter '", p.spec.name, "' has no state '", name, "'");
}

std::vector<std::string> Engine::state_names(int i) const {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  if (impl_->registry.groups[impl_->registry.params[i].spec.group].kind == ParamKind::kMuon)
    return impl_->muon_state_names(i);
  return {"exp_avg", "exp_avg_sq"};
}

std::string Registry::slice_name(int param, int64_t slice) const {
  const Param& p = params[param];
  return p.layout.count > 1 ? p.spec.name + "[" + std::to_string(slice) + "]" : p.spec.name;
}

int64_t Engine::param_step(int i) const {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  Impl& s = *impl_;
  if (s.registry.groups[s.registry.params[i].spec.group].kind == ParamKind::kMuon)
    return s.registry.params[i].step -
           s.record.skips_per_param(s.backend, s.registry, s.stats.muon_matrices)[i];
  if (!s.record.step_counts) return s.registry.params[i].step;
  int64_t v = 0;
  s.backend.synchronize();
  s.backend.copy_to_host(&v, s.record.step_count(i), sizeof(int64_t));
  return v;
}

std::vector<int64_t> Engine::param_steps() {
  Impl& s = *impl_;
  std::vector<int64_t> skips =
      s.record.skips_per_param(s.backend, s.registry, s.stats.muon_matrices);
  // Skips are counted where each matrix's momentum is: every rank takes the largest count.
  if (s.dist.world && s.built && s.dist.world_size > 1) {
    std::vector<int32_t> v(skips.begin(), skips.end());
    host_all_reduce(*s.dist.world, s.backend, v, ReduceOp::kMax);
    skips.assign(v.begin(), v.end());
  }
  std::vector<int64_t> adamw(s.registry.params.size());
  if (s.record.step_counts) {
    s.backend.synchronize();
    s.backend.copy_to_host(adamw.data(), s.record.step_counts.data(),
                           adamw.size() * sizeof(int64_t));
  }
  std::vector<int64_t> out(s.registry.params.size());
  for (size_t i = 0; i < s.registry.params.size(); ++i) {
    const Param& p = s.registry.params[i];
    const bool muon = s.registry.groups[p.spec.group].kind == ParamKind::kMuon;
    out[i] = muon ? p.step - skips[i] : s.record.step_counts ? adamw[i] : p.step;
  }
  return out;
}

void Engine::set_param_step(int i, int64_t step) {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  DM_CHECK(step >= 0, "step must be >= 0");
  Impl& s = *impl_;
  Param& p = s.registry.params[i];
  p.step = step;
  if (s.record.step_counts)
    s.backend.copy_from_host(s.record.step_count(i), &step, sizeof(int64_t));
  if (s.record.matrix_skips && s.registry.groups[p.spec.group].kind == ParamKind::kMuon)
    s.backend.fill_zero(s.record.skips_of(p, 0), sizeof(int64_t) * p.layout.count);
}

EngineStats Engine::stats() {
  Impl& s = *impl_;
  s.backend.synchronize();
  EngineStats st = s.stats;
  s.backend.copy_to_host(&st.nonfinite_skips, s.record.skip_counter.data(), sizeof(int64_t));
  if (!s.dist.world) st.owned_matrices = st.muon_matrices;
  st.cache = s.resources.cache_stats();
  st.memory = s.backend.memory_use();
  st.ortho.flops += st.cache.flops;  // run_cached leaves its FLOPs to the cache's accounting
  return st;
}

}  // namespace distmuon
