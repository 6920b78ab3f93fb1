// Whole-step graphs for the single-process step (EngineOptions::graphs): the step is captured the
// second time in a row its key is the same, and replayed while the key holds. The key names
// everything a captured step bakes in: the buffers it reads and writes (gradients, weights,
// state, the classes' iteration buffers and workspaces), each class's resolved algorithm and
// the CacheMuon options its gate and probes take by value, and the backend's capture epoch (its
// own workspace and kernel choices).
// What changes from step to step without changing the key -- learning rates, weight decay,
// momentum, AdamW's betas and step counts -- is read on the device from StepScalars, uploaded
// before the replay (local_step), outside the graph.
#include <cstring>

#include "common/log.h"
#include "distmuon/env.h"
#include "runtime/engine_impl.h"

namespace distmuon {

namespace {

uint64_t bits(const void* p) { return reinterpret_cast<uintptr_t>(p); }
uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

void add_config(std::vector<uint64_t>& key, const OrthoConfig& c) {
  key.insert(key.end(), {static_cast<uint64_t>(c.iteration), static_cast<uint64_t>(c.coefficients),
                         static_cast<uint64_t>(c.steps), static_cast<uint64_t>(c.work_dtype),
                         static_cast<uint64_t>(iteration_dtype(c)), bits(double{c.eps}),
                         c.restarts.size(), c.custom_coefficients.size(),
                         c.grouped_products ? 1u : 0u});
  for (int r : c.restarts) key.push_back(static_cast<uint64_t>(r));
  for (const QuinticCoef& q : c.custom_coefficients)
    key.insert(key.end(), {bits(double{q.a}), bits(double{q.b}), bits(double{q.c})});
}

void add_cache_options(std::vector<uint64_t>& key, const CacheOptions& o) {
  key.insert(key.end(), {bits(o.gamma), static_cast<uint64_t>(o.residual),
                         static_cast<uint64_t>(o.probes), static_cast<uint64_t>(o.max_staleness),
                         static_cast<uint64_t>(o.check_backoff),
                         o.dtype ? static_cast<uint64_t>(*o.dtype) + 1 : 0,
                         static_cast<uint64_t>(o.layout), o.seed,
                         static_cast<uint64_t>(o.gate)});
}

}  // namespace

bool LocalStep::graphs_enabled(const EngineOptions& options) {
  const std::string e = env::get("DISTMUON_GRAPHS");
  return e.empty() ? options.graphs : env::get_bool("DISTMUON_GRAPHS");
}

bool Engine::Impl::steps_replay() const {
  if (dist.world || !local.graph_mode || options.nonfinite == NonFinitePolicy::kRaise) return false;
  for (const GroupOptions& g : registry.groups)
    if (g.kind == ParamKind::kMuon && g.muon.cache.enabled && g.muon.cache.shadow) return false;
  return true;
}

std::vector<uint64_t> LocalStep::key(Backend& backend, const Registry& registry,
                                     const std::vector<CacheClass>& caches,
                                     std::span<const ParamData> data) const {
  std::vector<uint64_t> key;
  key.reserve(4 * registry.params.size() + 16 * classes.size() + 1);
  key.push_back(backend.capture_epoch());  // the backend's workspace and kernel choices
  for (size_t i = 0; i < registry.params.size(); ++i)
    key.insert(key.end(), {bits(data[i].grad), static_cast<uint64_t>(data[i].grad_dtype),
                           bits(data[i].param)});
  for (const GroupOptions& o : registry.groups)  // the fused passes take nesterov by value
    key.push_back(o.kind == ParamKind::kMuon && o.muon.nesterov ? 1 : 0);
  for (const ShapeClass& c : classes) {
    key.insert(key.end(), {bits(c.x.data()), bits(c.workspace.data()), c.workspace_bytes});
    add_config(key, c.resolved);
    const CacheClass& cc = caches[c.cache];
    key.push_back(cc.use ? 1 : 0);
    if (cc.use) add_cache_options(key, registry.groups[cc.group].muon.cache);
  }
  return key;
}

void Engine::Impl::local_step(std::span<const ParamData> data) {
  upload_scalars();  // eager, outside any graph: every step's hyperparameters reach the device
  // The classes' buffers follow the current options before anything is keyed or issued.
  // CacheMuon's shadow mode reads the device on the host, as the raise policy does.
  // (steps_replay() states the same rule per group, for the tuner; this per-class form is the
  // one the GPU verification ran: folding the two waits for the next device run.)
  bool shadow = false;
  for (ShapeClass& c : local.classes) {
    ensure_class_buffers(c);
    const CacheClass& cc = resources.caches[c.cache];
    shadow = shadow || (cc.use && registry.groups[cc.group].muon.cache.shadow);
  }
  const bool eligible = local.graph_mode && options.nonfinite != NonFinitePolicy::kRaise && !shadow;
  const bool in_callers_capture = backend.capturing();
  if (!eligible || in_callers_capture) {
    // Inside a caller's capture the step is recorded there; the engine's own graph stays (it may
    // not be destroyed while the stream is being captured).
    if (!in_callers_capture) local.graph = {};
    issue_local_step(data);
    count_local_step(data);
    return;
  }
  std::vector<uint64_t> key = local.key(backend, registry, resources.caches, data);
  if (local.graph.exec && key == local.graph.key) {
    local.graph.exec->replay();
    stats.ortho += local.graph.ortho;
    for (size_t i = 0; i < local.graph.cache.size(); ++i)
      if (resources.caches[i].cache) resources.caches[i].cache->add_replayed(local.graph.cache[i]);
    stats.graph_replays += 1;
    count_local_step(data);
    return;
  }
  if (key == local.graph.key && local.graph.failures < LocalStep::kMaxCaptureFailures) {
    const OrthoStats before = stats.ortho;
    std::vector<TransformCache::Ledger> ledgers(resources.caches.size());
    for (size_t i = 0; i < resources.caches.size(); ++i)
      if (resources.caches[i].cache) ledgers[i] = resources.caches[i].cache->ledger();
    bool issued = false;
    std::unique_ptr<BackendGraph> exec = backend.capture([&] {
      issued = true;
      issue_local_step(data);
    });
    if (!exec && !issued) {
      // This backend does not capture (the CPU's): nothing to retry, nothing to warn about.
      DM_LOG(kDebug, "engine: ", backend.name(), " does not capture; steps are issued eagerly");
      local.graph_mode = false;
    } else if (exec) {
      local.graph.exec = std::move(exec);
      local.graph.ortho = stats.ortho - before;
      local.graph.cache.assign(resources.caches.size(), {});
      for (size_t i = 0; i < resources.caches.size(); ++i)
        if (resources.caches[i].cache)
          local.graph.cache[i] = resources.caches[i].cache->ledger() - ledgers[i];
      local.graph.exec->replay();
      stats.graph_captures += 1;
      count_local_step(data);
      return;
    } else {
      // Nothing ran: the counters go back and the step is issued eagerly below. A capture that
      // keeps failing (an operation that cannot be captured) is not tried again.
      stats.ortho = before;
      for (size_t i = 0; i < resources.caches.size(); ++i)
        if (resources.caches[i].cache)
          resources.caches[i].cache->add_replayed(ledgers[i] - resources.caches[i].cache->ledger());
      if (++local.graph.failures == LocalStep::kMaxCaptureFailures)
        DM_LOG(kWarn, "engine: the step could not be captured ", LocalStep::kMaxCaptureFailures,
               " times; steps are issued eagerly from now on");
    }
  }
  local.graph.exec.reset();
  local.graph.key = std::move(key);
  issue_local_step(data);
  count_local_step(data);
}

}  // namespace distmuon
