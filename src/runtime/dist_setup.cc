// Distributed set-up: the registration is checked across ranks before any data moves (every
// rank reaches the same verdict from the same exchanged metadata, so an error is raised on all
// of them and nobody is left waiting in a collective), then owners are planned, rows of shards
// located, buckets formed and state allocated.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <sstream>

#include "common/fnv.h"
#include "common/log.h"
#include "distmuon/cost_table.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "runtime/engine_impl.h"
#include "runtime/mode_runner.h"

namespace distmuon {

Plan plan_owners(std::vector<PlanMatrix> matrices, const Topology& topo, const DistOptions& dist,
                 const OrthoConfig& ortho, DeviceKind device, const std::string& device_name) {
  DM_CHECK(!matrices.empty(), "plan_owners: no matrices");
  topo.validate();
  std::map<std::string, int64_t> ids;
  for (PlanMatrix& m : matrices)
    if (m.layer < 0) m.layer = layer_of(m.name, ids);
  RuntimePlanSpec spec;
  spec.solver = dist.planner;
  spec.ortho = ortho;
  spec.device = device;
  // The caller decides the costs alone (distmuon.torch.dedicate: one rank, and shares the plan).
  // A backend is made for its name only when a measured table is looked up.
  auto name = [&] {
    return !device_name.empty()
               ? device_name
               : make_backend(device == DeviceKind::kCUDA ? "cuda" : "cpu")->name();
  };
  spec.measured = read_measured_costs(plan_cost_source(dist.plan_costs), name, ortho).table;
  spec.owners = dist.owners;
  return make_runtime_plan(matrices, topo, spec);
}

namespace {

std::string error_text(const Error& e) {
  std::string s = e.what();
  if (s.rfind("distmuon: ", 0) == 0) s.erase(0, 10);
  return s;
}

// Whether rank 0 times the shape classes its store lacks before planning (DISTMUON_PLAN_MEASURE;
// auto: plan_measure_by_default).
bool measure_at_start(const Backend& be) {
  const std::string v = env::get("DISTMUON_PLAN_MEASURE");
  DM_CHECK(v == "auto" || v == "on" || v == "off", "DISTMUON_PLAN_MEASURE is '", v,
           "': use auto, on or off");
  if (v != "auto") return v == "on";
  return plan_measure_by_default(be.device().kind,
                                 std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") != nullptr,
                                 std::getenv("NCCL_MULTI_RANK_GPU_ENABLE") != nullptr);
}

// Times the classes of `shapes` the store lacks and adds them to it, so that the plan below
// (and every later run on this device) balances measured costs. A store that cannot be written
// costs the measurement, not the run: the plan then uses what the store holds.
void measure_missing_costs(Backend& be, const std::string& store, const std::vector<ShapeCount>& shapes,
                           const OrthoConfig& ortho) {
  ProfileOptions opts;
  opts.ks = {1, 4};
  opts.progress = false;
  try {
    const CachedCosts c = cached_cost_table(be, shapes, ortho, opts, store);
    if (c.shapes_measured > 0)
      DM_LOG(kInfo, "planner: timed ", c.shapes_measured, " shape classes at start-up into ",
             c.path, " (", c.shapes_reused, " were there)");
  } catch (const Error& e) {
    DM_LOG(kWarn, "planner: could not time the shape classes at start-up (", e.what(),
           "); planning on what the store holds");
  }
}

// Rank 0 reads the measured costs (its DistOptions::plan_costs, its store, first completed by
// measure_missing_costs where DISTMUON_PLAN_MEASURE says so) and every rank plans
// from the same numbers: ranks whose stores differ would otherwise plan differently and fail
// the plan-hash check. Every rank, rank 0 included, parses the text rank 0 sent, so the doubles
// are identical. Rank 0's read error becomes its set-up error (reported on every rank with the
// other set-up errors); the other ranks then plan on analytic costs, a plan nobody uses.
// The note (where the table came from, or why there is none) is rank 0's only.
MeasuredCosts rank0_measured_costs(Communicator& world, Backend& be, const std::string& setting,
                                   const OrthoConfig& ortho, const std::vector<ShapeCount>& shapes,
                                   std::string& local_error) {
  MeasuredCosts out;
  std::string text;
  bool measure = false;
  try {  // read on every rank: a bad setting is an error everywhere, not only on rank 0
    measure = measure_at_start(be);
  } catch (const Error& e) {
    if (local_error.empty()) local_error = error_text(e);
  }
  if (world.rank() == 0 && !shapes.empty() && local_error.empty()) {
    try {
      const PlanCostSource source = plan_cost_source(setting);
      if (source.kind == PlanCostSource::Kind::kAuto && measure)
        measure_missing_costs(be, source.path, shapes, ortho);
      out = read_measured_costs(source, [&] { return be.name(); }, ortho);
      if (out.table) text = cost_table_json({*out.table});
    } catch (const Error& e) {
      local_error = error_text(e);
    }
  }
  const std::vector<int64_t> lens = host_all_gather(world, be, {static_cast<int64_t>(text.size())});
  out.table.reset();
  if (lens[0] > 0) {
    const std::vector<char> all = host_all_gather_v(world, be, text, lens);
    out.table = parse_cost_tables(std::string(all.data(), all.size()), "rank 0's costs").front();
  }
  return out;
}

}  // namespace

bool plan_measure_by_default(DeviceKind kind, bool mps_partition, bool several_ranks_per_gpu) {
  return kind == DeviceKind::kCUDA && (mps_partition || !several_ranks_per_gpu);
}

void Engine::Impl::dist_setup() {
  dist.bind_streams(
      backend.native_stream());  // the set-up exchanges, and the communicators split from the world
  dist.rank = dist.world->rank();
  dist.world_size = dist.world->size();
  const std::string mode = dist_mode_name(dist.options.mode);
  // Replicated mode has no shards: its world is flat whatever the replicate degree.
  const int R = dist.options.mode == DistMode::kReplicated ? 1 : dist.options.replicate;

  // 1. Local checks, reported through the exchange so that every rank fails together.
  std::ostringstream err;
  for (const std::string& e : registry.registration_errors)
    err << (err.tellp() > 0 ? "; " : "") << e;
  if (err.tellp() == 0 && (R < 1 || dist.world_size % R != 0))
    err << "replicate degree " << dist.options.replicate << " does not divide the world size "
        << dist.world_size;
  if (err.tellp() == 0 && dist.options.planner != "milp" && dist.options.planner != "lpt" &&
      dist.options.planner != "round-robin")
    err << "unknown planner '" << dist.options.planner << "' (milp, lpt or round-robin)";
  if (err.tellp() == 0 && dist.options.wire_dtype == DType::kF16)
    err << "wire_dtype f16 is refused: its range would flush small gradients to zero (use bf16)";
  if (err.tellp() == 0 && dist.options.wire_dtype && !is_sharded_mode(dist.options.mode))
    err << "wire_dtype " << dtype_name(*dist.options.wire_dtype) << " applies to the sharded and "
        << "gather modes (they move gradients and updates); " << mode
        << " mode moves weights, which every rank must hold alike";
  for (const Param& p : registry.params) {
    if (!err.str().empty()) break;
    if (is_sharded_mode(dist.options.mode) && !p.spec.shard.sharded())
      err << "parameter '" << p.spec.name << "' has no shard: " << mode
          << " mode needs the local dim-0 rows of every parameter (ShardSpec)";
    else if (!is_sharded_mode(dist.options.mode) && p.spec.shard.sharded())
      err << "parameter '" << p.spec.name << "' has a shard, but " << mode
          << " mode takes full parameters";
  }
  std::string grouped = "auto";
  try {
    grouped = ShapeTuning::grouped_products_setting();
  } catch (const Error& e) {
    if (err.tellp() == 0) err << error_text(e);
  }
  std::string local_error = err.str();
  // Flat while the set-up fails (R may not divide the world): the exchange below still runs.
  dist.hsdp = {dist.world_size, local_error.empty() ? R : 1, dist.rank};
  dist.shard_size = dist.hsdp.shard();
  dist.my_r = dist.hsdp.my_replica();
  dist.my_s = dist.hsdp.my_position();

  // 2. What must be identical on every rank.
  std::ostringstream common;
  // Not the plan costs: rank 0's decide (rank0_measured_costs).
  common << "mode " << mode << ", planner " << dist.options.planner << ", device "
         << (backend.device().kind == DeviceKind::kCUDA ? "cuda" : "cpu") << ", replicate "
         << dist.options.replicate << ", bucket_bytes " << dist.options.bucket_bytes
         << ", batches_across_buckets " << dist.options.batches_across_buckets
         << ", wire_dtype "
         << (dist.options.wire_dtype ? dtype_name(*dist.options.wire_dtype) : "the parameters'")
         << ", grad_mean " << dist.options.grad_mean << ", check_grad_presence "
         << dist.options.check_grad_presence << ", caller_transfers "
         << dist.options.caller_transfers << ", fixed owners " << dist.options.owners.size()
         << ", nonfinite " << static_cast<int>(options.nonfinite) << ", DISTMUON_GROUPED_PRODUCTS "
         << grouped << "\n";
  for (size_t g = 0; g < registry.groups.size(); ++g) {
    const GroupOptions& o = registry.groups[g];
    common << "group " << g << " "
           << (o.kind == ParamKind::kMuon ? "muon " + algorithm_name(o.muon.ortho) + " momentum " +
                                                dtype_name(o.muon.momentum_dtype)
                                          : std::string("adamw"))
           << "\n";
  }
  for (size_t i = 0; i < registry.params.size(); ++i) {
    const ParamSpec& s = registry.params[i].spec;
    common << "parameter " << i << " '" << s.name << "' shape " << join_shape(s.shape) << " dtype "
           << dtype_name(s.dtype) << " group " << s.group << "\n";
  }
  const std::string text = common.str();

  // 3. The plan, from the registration only (identical inputs give identical plans). Costs
  // follow the first Muon group's algorithm; layers come from the parameter names.
  std::vector<PlanMatrix> pm;
  std::map<std::string, int64_t> layer_ids;
  RuntimePlanSpec spec;
  spec.solver = dist.options.planner;
  spec.device = backend.device().kind;
  spec.owners = dist.options.owners;
  bool have_ortho = false;
  for (size_t i = 0; i < registry.params.size() && local_error.empty(); ++i) {
    Param& p = registry.params[i];
    if (registry.groups[p.spec.group].kind != ParamKind::kMuon) continue;
    if (!have_ortho) spec.ortho = registry.groups[p.spec.group].muon.ortho;
    have_ortho = true;
    const int64_t layer = layer_of(p.spec.name, layer_ids);
    for (int64_t s = 0; s < p.layout.count; ++s) {
      PlanMatrix m;
      m.name = registry.slice_name(static_cast<int>(i), s);
      m.rows = p.layout.rows;
      m.cols = p.layout.cols;
      m.layer = layer;
      m.elem_bytes = static_cast<int64_t>(dtype_size(p.state0_dtype));
      pm.push_back(m);
    }
  }
  Topology topo{dist.world_size, dist.options.gpus_per_node, R};
  if (local_error.empty() && !dist.options.owners.empty() &&
      dist.options.owners.size() != pm.size())
    local_error = detail::concat("DistOptions::owners names ", dist.options.owners.size(),
                                 " owners but ", pm.size(), " Muon matrices are registered");
  if (local_error.empty() && dist.options.caller_transfers &&
      dist.options.mode != DistMode::kDedicated)
    local_error = detail::concat("caller_transfers is an option of the dedicated mode, not of ",
                                 mode, " mode");
  MeasuredCosts measured = rank0_measured_costs(*dist.world, backend, dist.options.plan_costs,
                                                spec.ortho, shape_counts(pm), local_error);
  spec.measured = std::move(measured.table);
  try {  // a planner error must reach every rank
    if (local_error.empty() && !pm.empty())
      dist.plan = make_runtime_plan(pm, topo, spec);
    else if (local_error.empty())
      dist.plan = plan_round_robin(pm, topo);  // no Muon matrices: the planner has nothing to do
  } catch (const Error& e) {
    local_error = error_text(e);
  }
  const bool time_limited = dist.plan.status.find("time limit") != std::string::npos;

  // 4. Exchange a fixed-size header, then details only where something differs.
  const std::vector<int64_t> hdr = {static_cast<int64_t>(fnv1a(text)),
                                    static_cast<int64_t>(text.size()),
                                    static_cast<int64_t>(dist.plan.hash),
                                    static_cast<int64_t>(local_error.size()), time_limited ? 1 : 0};
  const std::vector<int64_t> all = host_all_gather(*dist.world, backend, hdr);
  auto field = [&](int q, int f) { return all[static_cast<size_t>(q) * hdr.size() + f]; };
  std::vector<int64_t> err_len(dist.world_size), text_len(dist.world_size);
  bool any_error = false, differ = false, plans_differ = false, any_time_limited = false;
  for (int q = 0; q < dist.world_size; ++q) {
    err_len[q] = field(q, 3);
    text_len[q] = field(q, 1);
    any_error |= err_len[q] > 0;
    differ |= field(q, 0) != field(0, 0) || field(q, 1) != field(0, 1);
    plans_differ |= field(q, 2) != field(0, 2);
    any_time_limited |= field(q, 4) != 0;
  }
  // A MILP stopped by its CPU-time guard on some rank may have stopped elsewhere on others:
  // every rank then takes the deterministic LPT plan instead (same inputs, same plan).
  if (any_time_limited && !any_error && !differ) {
    spec.solver = "lpt";
    dist.plan = make_runtime_plan(pm, topo, spec);
    plans_differ = false;
  }
  if (dist.rank == 0 && !any_error && !dist.plan.costs.empty())
    DM_LOG(kInfo, "planner: ", dist.plan.solver, " on ", dist.plan.costs, "; ", measured.note);
  if (any_error) {
    std::vector<char> msgs = host_all_gather_v(*dist.world, backend, local_error, err_len);
    std::ostringstream os;
    os << "distributed set-up failed before any data moved:";
    int64_t off = 0;
    for (int q = 0; q < dist.world_size; ++q) {
      if (err_len[q]) os << "\n  rank " << q << ": " << std::string(&msgs[off], err_len[q]);
      off += err_len[q];
    }
    DM_FAIL(os.str());
  }
  if (differ) {
    DM_FAIL(
        "ranks registered different parameters or options (every rank needs the same "
        "options, groups, names, shapes and dtypes, in the same order):",
        text_differences(*dist.world, backend, text, text_len));
  }

  // 5. Shards: every shard group must tile dim 0, and replicas must hold the same rows.
  const size_t np = registry.params.size();
  for (Param& p : registry.params) p.matrices.clear();
  if (is_sharded_mode(dist.options.mode)) {
    std::vector<int64_t> mine(2 * np);
    for (size_t i = 0; i < np; ++i) {
      mine[2 * i] = registry.params[i].spec.shard.row_begin;
      mine[2 * i + 1] = registry.params[i].spec.shard.row_count;
    }
    const std::vector<int64_t> sh = host_all_gather(*dist.world, backend, mine);
    auto begin = [&](int q, size_t i) { return sh[q * 2 * np + 2 * i]; };
    auto count = [&](int q, size_t i) { return sh[q * 2 * np + 2 * i + 1]; };
    for (size_t i = 0; i < np; ++i) {
      const Param& p = registry.params[i];
      for (int r = 0; r < R; ++r) {
        std::vector<std::pair<int64_t, int>> parts;  // (begin, world rank) of non-empty shards
        for (int q = 0; q < dist.shard_size; ++q) {
          const int wr = dist.hsdp.at(r, q);
          DM_CHECK(begin(wr, i) == begin(q, i) && count(wr, i) == count(q, i), "parameter '",
                   p.spec.name, "': rank ", wr, " holds rows [", begin(wr, i), ", ",
                   begin(wr, i) + count(wr, i), ") but rank ", q,
                   " at the same shard position of replica 0 holds [", begin(q, i), ", ",
                   begin(q, i) + count(q, i), "); replicas must hold identical shards");
          if (count(wr, i) > 0) parts.emplace_back(begin(wr, i), wr);
        }
        std::sort(parts.begin(), parts.end());
        int64_t next = 0;
        for (auto [b, wr] : parts) {
          DM_CHECK(b == next, "parameter '", p.spec.name, "' (dim 0 = ", p.dim0,
                   "): the shards do not tile dim 0: rank ", wr, " starts at row ", b,
                   " where row ", next, " was expected (overlap or gap)");
          next = b + count(wr, i);
        }
        DM_CHECK(next == p.dim0, "parameter '", p.spec.name, "': the shards cover rows [0, ", next,
                 ") of dim 0 = ", p.dim0);
      }
    }
    // 6. Where each matrix's rows live, per shard position (replica 0's ranks stand for all).
    build_matrices([&](int q, size_t i) { return std::make_pair(begin(q, i), count(q, i)); });
  } else {
    build_matrices(nullptr);
  }
  for (int q = 0; q < dist.world_size && plans_differ; ++q)
    DM_CHECK(field(q, 2) == field(0, 2),
             "ranks computed different plans from the same "
             "registration: hash ",
             static_cast<uint64_t>(field(0, 2)), " on rank 0 but ",
             static_cast<uint64_t>(field(q, 2)), " on rank ", q,
             "; the planner must be a deterministic function of its inputs");

  // 7. The HSDP groups (collective over the world, same order everywhere). None with
  // caller_transfers: the caller moves the dedicated traffic over its own groups of the same
  // split (DedicatedTransfers); the step then only votes on the world.
  if (!caller_transfers()) dist.groups = HsdpComms(dist.world, dist.hsdp);
  dist.shard = dist.groups.shard();
  dist.replica = dist.groups.replica();

  tune_dist_shapes();
  allocate_state();
  assign_cache_entries();
  switch (dist.options.mode) {
    case DistMode::kGather:
      pipeline.runner = make_gather_runner(runner_context());
      break;
    case DistMode::kReplicated:
      pipeline.runner = make_replicated_runner(runner_context());
      break;
    case DistMode::kSharded:
      pipeline.runner = make_sharded_runner(runner_context());
      break;
    case DistMode::kDedicated:
      pipeline.runner = make_dedicated_runner(runner_context());
      break;
  }
  pipeline.runner->setup();
  built = true;
}

}  // namespace distmuon
