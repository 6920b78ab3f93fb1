// Whole-step graphs for the single-process step (EngineOptions::graphs): the step is captured the
// second time in a row its key is the same, and replayed while the key holds. The key names
// everything a captured step bakes in: the buffers it reads and writes (gradients, weights,
// state, the classes' iteration buffers and workspaces) and each class's resolved algorithm.
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
                         c.restarts.size(), c.custom_coefficients.size()});
  for (int r : c.restarts) key.push_back(static_cast<uint64_t>(r));
  for (const QuinticCoef& q : c.custom_coefficients)
    key.insert(key.end(), {bits(double{q.a}), bits(double{q.b}), bits(double{q.c})});
}

// A captured step's share of the orthogonalization counters, added again by every replay.
OrthoStats minus(const OrthoStats& a, const OrthoStats& b) {
  OrthoStats d;
  d.flops = a.flops - b.flops;
  d.matrices = a.matrices - b.matrices;
  d.calls = a.calls - b.calls;
  return d;
}
void add(OrthoStats& into, const OrthoStats& d) {
  into.flops += d.flops;
  into.matrices += d.matrices;
  into.calls += d.calls;
}

}  // namespace

bool Engine::Impl::graphs_enabled() const {
  const std::string e = env::get("DISTMUON_GRAPHS");
  return e.empty() ? options.graphs : env::get_bool("DISTMUON_GRAPHS");
}

std::vector<uint64_t> Engine::Impl::step_key(std::span<const ParamData> data) {
  std::vector<uint64_t> key;
  key.reserve(4 * params.size() + 16 * classes.size());
  for (size_t i = 0; i < params.size(); ++i)
    key.insert(key.end(), {bits(data[i].grad), static_cast<uint64_t>(data[i].grad_dtype),
                           bits(data[i].param)});
  for (const GroupOptions& o : groups)  // the fused passes take nesterov by value
    key.push_back(o.kind == ParamKind::kMuon && o.muon.nesterov ? 1 : 0);
  for (const ShapeClass& c : classes) {
    key.insert(key.end(), {bits(c.x.data()), bits(c.workspace.data()), c.workspace_bytes});
    add_config(key, c.resolved);
  }
  return key;
}

void Engine::Impl::local_step(std::span<const ParamData> data) {
  upload_scalars();  // eager, outside any graph: every step's hyperparameters reach the device
  // The classes' buffers follow the current options before anything is keyed or issued.
  bool cache_in_use = false;
  for (ShapeClass& c : classes) {
    ensure_class_buffers(c);
    cache_in_use = cache_in_use || caches[c.cache].use;
  }
  const bool eligible = graph_mode && options.nonfinite != NonFinitePolicy::kRaise && !cache_in_use;
  if (!eligible || backend.capturing()) {
    // Inside a caller's capture the step is recorded there; the engine's own graph stays (it may
    // not be destroyed while the stream is being captured).
    if (!eligible && !backend.capturing()) graph = {};
    issue_local_step(data);
    count_local_step(data);
    return;
  }
  std::vector<uint64_t> key = step_key(data);
  if (graph.exec && key == graph.key) {
    graph.exec->replay();
    add(stats.ortho, graph.ortho);
    stats.graph_replays += 1;
    count_local_step(data);
    return;
  }
  if (key == graph.key && graph.failures < kMaxCaptureFailures) {
    const OrthoStats before = stats.ortho;
    std::unique_ptr<BackendGraph> exec = backend.capture([&] { issue_local_step(data); });
    if (exec) {
      graph.exec = std::move(exec);
      graph.ortho = minus(stats.ortho, before);
      graph.exec->replay();
      stats.graph_captures += 1;
      count_local_step(data);
      return;
    }
    // Nothing ran: the counters go back and the step is issued eagerly below. A capture that
    // keeps failing (an operation that cannot be captured) is not tried again.
    stats.ortho = before;
    if (++graph.failures == kMaxCaptureFailures)
      DM_LOG(kWarn, "engine: the step could not be captured ", kMaxCaptureFailures,
             " times; steps are issued eagerly from now on");
  }
  graph.exec.reset();
  graph.key = std::move(key);
  issue_local_step(data);
  count_local_step(data);
}

}  // namespace distmuon
