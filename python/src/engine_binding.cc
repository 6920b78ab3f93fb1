// distmuon._C.Engine: the C++ Engine with its backend, taking parameters and gradients as DLPack
// arrays. Every check here is about translating types (device, dtype, layout, count); the
// optimizer's own checks and all arithmetic live in the C++ Engine.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/engine.h"
#include "comm_binding.h"
#include "dlpack.h"
#ifdef DISTMUON_HAVE_CUDA
#include "distmuon/cuda_backend.h"
#endif

namespace distmuon::py {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

[[noreturn]] void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

nb::list tuned_dicts(const std::vector<TunedShape>& shapes) {
  nb::list out;
  for (const TunedShape& t : shapes) {
    nb::dict d;
    d["group"] = t.group;
    d["rows"] = t.rows;
    d["cols"] = t.cols;
    d["count"] = t.count;
    d["algorithm"] = algorithm_name(t.config);
    d["restarts"] = t.config.restarts;
    d["source"] = t.source;
    d["ms"] = t.ms;
    out.append(d);
  }
  return out;
}

// Owns the backend and the engine (the engine is destroyed first).
class PyEngine {
 public:
  PyEngine(const std::string& device, NonFinitePolicy nonfinite, bool graphs,
           const std::string& autotune)
      : backend_(make_backend(device)) {
    EngineOptions o{nonfinite};
    o.graphs = graphs;
    o.autotune = parse_autotune(autotune);
    engine_ = std::make_unique<Engine>(*backend_, o);
  }
  // Distributed: `comm` is kept alive by the Python object (keep_alive in the binding).
  PyEngine(const std::string& device, NonFinitePolicy nonfinite, PyComm& comm,
           const DistOptions& dist, uintptr_t stream, const std::string& autotune)
      : backend_(make_backend(device)) {
    set_stream(stream);  // torch's current stream, before the engine issues anything
    EngineOptions o{nonfinite};
    o.autotune = parse_autotune(autotune);
    engine_ = std::make_unique<Engine>(*backend_, *comm.comm, dist, o);
  }

  Engine& engine() { return *engine_; }
  Backend& backend() { return *backend_; }

  int add_param(const std::string& name, int group, const std::vector<int64_t>& shape,
                DType dtype, int64_t row_begin, int64_t row_count) {
    return engine_->add_param(ParamSpec{name, group, shape, dtype, ShardSpec{row_begin, row_count}});
  }

  // The CUDA backend issues its work on `stream` (a cudaStream_t as an integer). 0 is the legacy
  // default stream, which is torch's default stream: it must not mean "the backend's own"
  // (a non-blocking stream, unordered with torch's work: the engine read gradients that
  // backward was still writing).
  void set_stream(uintptr_t stream) {
#ifdef DISTMUON_HAVE_CUDA
    if (auto* cuda = dynamic_cast<CudaBackend*>(backend_.get())) {
      cuda->set_stream(reinterpret_cast<cudaStream_t>(stream));
      return;
    }
#endif
    if (stream != 0)
      value_error("set_stream: the " + backend_->name() + " backend has no streams");
  }

  // Checks that `a` can stand for parameter i's memory (or its gradient) without a copy.
  void check_array(const Array& a, int i, bool grad) const {
    const ParamSpec& spec = engine_->param(i);
    const std::string what =
        std::string(grad ? "gradient of parameter '" : "parameter '") + spec.name + "'";
    const Device dev = to_device(a), want = backend_->device();
    if (!(dev == want))
      value_error(what + " is on " + (dev.kind == DeviceKind::kCUDA ? "cuda:" : "cpu:") +
                  std::to_string(dev.index) + " but the engine's backend is " + backend_->name());
    const DType t = to_dtype(a.dtype(), what);
    if (!grad && t != spec.dtype)
      value_error(what + " is " + dtype_name(t) + " but was registered as " +
                  dtype_name(spec.dtype));
    if (!is_contiguous(a)) value_error(what + " is not contiguous");
    std::vector<int64_t> local = spec.shape;
    if (spec.shard.sharded()) local[0] = spec.shard.row_count;
    if (numel(shape_of(a)) != numel(local))
      value_error(what + " has shape " + shape_str(shape_of(a)) + " but the engine holds " +
                  (spec.shard.sharded() ? "a local shard of shape " : "") + shape_str(local));
  }

  // Dedicated mode with caller transfers: momentum and orthogonalization of the owned matrices of
  // parameters `index` now (see Engine::prepare).
  void prepare(const std::vector<int>& index, const std::vector<Array>& params,
               const std::vector<Array>& grads) {
    if (index.size() != params.size() || index.size() != grads.size())
      value_error("prepare got " + std::to_string(index.size()) + " indices, " +
                  std::to_string(params.size()) + " parameters and " +
                  std::to_string(grads.size()) + " gradients");
    std::vector<ParamData> data(index.size());
    for (size_t k = 0; k < index.size(); ++k) {
      const int i = index[k];
      if (i < 0 || i >= engine_->num_params()) value_error("prepare: no parameter " + std::to_string(i));
      check_array(params[k], i, false);
      check_array(grads[k], i, true);
      data[k].param = params[k].data();
      data[k].grad = grads[k].data();
      data[k].grad_dtype = to_dtype(grads[k].dtype(), "gradient");
    }
    nb::gil_scoped_release release;
    engine_->prepare(index, data);
  }

  void step(const std::vector<Array>& params, const std::vector<std::optional<Array>>& grads) {
    const int n = engine_->num_params();
    if (static_cast<int>(params.size()) != n || static_cast<int>(grads.size()) != n)
      value_error("step got " + std::to_string(params.size()) + " parameters and " +
                  std::to_string(grads.size()) + " gradients; " + std::to_string(n) +
                  " are registered");
    std::vector<ParamData> data(n);
    for (int i = 0; i < n; ++i) {
      check_array(params[i], i, false);
      data[i].param = params[i].data();
      if (grads[i]) {
        check_array(*grads[i], i, true);
        data[i].grad = grads[i]->data();
        data[i].grad_dtype = to_dtype(grads[i]->dtype(), "gradient");
      }
    }
    nb::gil_scoped_release release;  // the arrays stay referenced by the caller's lists
    engine_->step(data);
  }

  void setup() {
    nb::gil_scoped_release release;  // collective: Python communicators take the GIL
    engine_->setup();
  }
  std::vector<TunedShape> tune() {
    nb::gil_scoped_release release;  // collective, like setup()
    return engine_->tune();
  }
  void wait_published() {
    nb::gil_scoped_release release;
    engine_->wait_published();
  }

  nb::dict stats() {
    EngineStats s = engine_->stats();
    nb::dict d;
    d["steps"] = s.steps;
    d["nonfinite_skips"] = s.nonfinite_skips;
    d["ortho_flops"] = s.ortho.flops;
    d["ortho_matrices"] = s.ortho.matrices;
    d["ortho_calls"] = s.ortho.calls;
    d["muon_matrices"] = s.muon_matrices;
    d["muon_params"] = s.muon_params;
    d["adamw_params"] = s.adamw_params;
    d["owned_matrices"] = s.owned_matrices;
    d["memory_bytes"] = s.memory.bytes;
    d["memory_peak_bytes"] = s.memory.peak_bytes;
    d["graph_captures"] = s.graph_captures;
    d["graph_replays"] = s.graph_replays;
    d["issue_ms"] = s.issue_ms;
    d["comm_bytes_sent"] = s.comm.bytes_sent;
    d["comm_bytes_received"] = s.comm.bytes_received;
    d["comm_ops"] = s.comm.ops;
    d["comm_launches"] = s.comm.launches;
    const CacheStats& c = s.cache;
    nb::dict cache;
    cache["calls"] = c.calls;
    cache["matrices"] = c.matrices;
    cache["hits"] = c.hits;
    cache["refreshes"] = c.refreshes;
    cache["forced_refreshes"] = c.forced_refreshes;
    cache["unchecked_refreshes"] = c.unchecked_refreshes;
    cache["batch_refreshes"] = c.batch_refreshes;
    cache["skips"] = c.skips;
    cache["flops"] = c.flops;
    cache["fresh_flops"] = c.fresh_flops;
    cache["hit_rate"] = c.hit_rate();
    cache["flops_saved_fraction"] = c.flops_saved_fraction();
    cache["memory_bytes"] = c.memory_bytes;
    cache["residual_count"] = c.residual.count;
    cache["residual_mean"] = c.residual.mean;
    cache["residual_max"] = c.residual.max;
    cache["residual_p50"] = c.residual.p50;
    cache["residual_p90"] = c.residual.p90;
    cache["compared"] = c.compared;
    cache["update_error_mean"] = c.update_error_mean;
    cache["update_error_max"] = c.update_error_max;
    cache["alignment_mean"] = c.alignment_mean;
    cache["alignment_min"] = c.alignment_min;
    cache["latest_entries"] = c.latest_entries;
    cache["latest_with_residual"] = c.latest_with_residual;
    cache["latest_compared"] = c.latest_compared;
    cache["latest_hit_rate"] = c.latest_hit_rate;
    cache["latest_mean_residual"] = c.latest_mean_residual;
    cache["latest_update_error"] = c.latest_update_error;
    cache["latest_alignment"] = c.latest_alignment;
    d["cache"] = cache;
    return d;
  }

 private:
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Engine> engine_;
};

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<ParamSpec>(m, "ParamSpec")
      .def_ro("name", &ParamSpec::name)
      .def_ro("group", &ParamSpec::group)
      .def_ro("shape", &ParamSpec::shape)
      .def_ro("dtype", &ParamSpec::dtype)
      .def_prop_ro("row_begin", [](const ParamSpec& p) { return p.shard.row_begin; })
      .def_prop_ro("row_count", [](const ParamSpec& p) { return p.shard.row_count; });

  nb::enum_<DistMode>(m, "DistMode")
      .value("gather", DistMode::kGather)
      .value("replicated", DistMode::kReplicated)
      .value("sharded", DistMode::kSharded)
      .value("dedicated", DistMode::kDedicated);

  nb::class_<DistOptions>(m, "DistOptions")
      .def(nb::init<>())
      .def_rw("mode", &DistOptions::mode)
      .def_rw("replicate", &DistOptions::replicate)
      .def_rw("bucket_bytes", &DistOptions::bucket_bytes)
      .def_rw("batches_across_buckets", &DistOptions::batches_across_buckets)
      .def_rw("grad_mean", &DistOptions::grad_mean)
      .def_rw("defer_publish", &DistOptions::defer_publish)
      .def_rw("check_grad_presence", &DistOptions::check_grad_presence)
      .def_rw("gpus_per_node", &DistOptions::gpus_per_node)
      .def_rw("planner", &DistOptions::planner)
      .def_rw("plan_costs", &DistOptions::plan_costs)
      .def_rw("owners", &DistOptions::owners)
      .def_rw("caller_transfers", &DistOptions::caller_transfers)
      .def_prop_rw(
          "wire_dtype",
          [](const DistOptions& o) {
            return o.wire_dtype ? std::string(dtype_name(*o.wire_dtype)) : std::string();
          },
          [](DistOptions& o, const std::string& name) {
            if (name.empty())
              o.wire_dtype.reset();
            else
              o.wire_dtype = parse_dtype(name);
          },
          "what the sharded and gather modes send for wider parameters ('bf16', 'f32'; '': the "
          "parameters' own dtype)");

  m.def(
      "plan_owners",
      [](const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
         int64_t elem_bytes, int world_size, int replicate, const DistOptions& dist,
         const OrthoConfig& ortho, const std::string& device) {
        if (names.size() != shapes.size()) value_error("plan_owners: one shape per name");
        std::vector<PlanMatrix> pm;
        for (size_t k = 0; k < names.size(); ++k) {
          if (shapes[k].size() != 2) value_error("plan_owners: shapes are (rows, cols)");
          PlanMatrix m;
          m.name = names[k];
          m.rows = shapes[k][0];
          m.cols = shapes[k][1];
          m.elem_bytes = elem_bytes;
          pm.push_back(m);
        }
        const DeviceKind kind = device == "cuda" ? DeviceKind::kCUDA : DeviceKind::kCPU;
        Plan p;
        {
          nb::gil_scoped_release release;
          p = plan_owners(pm, Topology{world_size, dist.gpus_per_node, replicate}, dist, ortho,
                          kind);
        }
        nb::dict d;
        d["owner"] = p.owner;
        d["owner_load"] = p.owner_load;
        d["makespan"] = p.makespan;
        d["imbalance"] = p.imbalance;
        d["solver"] = p.solver;
        d["status"] = p.status;
        d["hash"] = p.hash;
        d["costs"] = p.costs;
        return d;
      },
      nb::arg("names"), nb::arg("shapes"), nb::arg("elem_bytes"), nb::arg("world_size"),
      nb::arg("replicate"), nb::arg("dist"), nb::arg("ortho"), nb::arg("device") = "cpu",
      "The owners Engine.setup() would plan for these Muon matrices (rows, cols), with the "
      "planner and costs of `dist`: a dict with 'owner' (world rank per matrix), 'owner_load', "
      "'makespan', 'imbalance', 'solver', 'status', 'hash', 'costs' (what the costs were).");

  nb::class_<PyEngine>(m, "Engine",
                       "The C++ optimizer engine on one backend ('cpu' or 'cuda'). Register "
                       "groups and parameters, then call step() with DLPack arrays.")
      .def(nb::init<const std::string&, NonFinitePolicy, bool, const std::string&>(),
           nb::arg("device") = "cpu", nb::arg("nonfinite") = NonFinitePolicy::kSkip,
           nb::arg("graphs") = true, nb::arg("autotune") = "on",
           "A single-process engine; `graphs`: EngineOptions::graphs (whole-step CUDA graphs); "
           "`autotune`: 'on', 'cached' or 'off' (EngineOptions::autotune).")
      .def(nb::init<const std::string&, NonFinitePolicy, PyComm&, const DistOptions&, uintptr_t,
                    const std::string&>(),
           nb::arg("device"), nb::arg("nonfinite"), nb::arg("comm"), nb::arg("dist"),
           nb::arg("stream") = 0, nb::arg("autotune") = "on", nb::keep_alive<1, 4>(),
           "A distributed engine over `comm` (kept alive by the engine); on CUDA its backend "
           "issues work on `stream`, which must be the stream `comm` was made for.")
      .def("add_group", [](PyEngine& e, const GroupOptions& g) { return e.engine().add_group(g); },
           nb::arg("options"))
      .def("group", [](PyEngine& e, int i) -> GroupOptions& { return e.engine().group(i); },
           nb::arg("index"), nb::rv_policy::reference_internal,
           "The live options of group `index` (assign fields between steps, e.g. for schedulers).")
      .def_prop_ro("num_groups", [](PyEngine& e) { return e.engine().num_groups(); })
      .def("add_param", &PyEngine::add_param, nb::arg("name"), nb::arg("group"), nb::arg("shape"),
           nb::arg("dtype"), nb::arg("row_begin") = 0, nb::arg("row_count") = -1,
           "Registers a parameter (full shape); row_count >= 0: this rank holds dim-0 rows "
           "[row_begin, row_begin + row_count) (sharded and gather modes).")
      .def("setup", &PyEngine::setup,
           "Freezes the registration (distributed: checks it across ranks, plans owners, "
           "allocates state). Collective; the first step() calls it otherwise.")
      .def("tune", [](PyEngine& e) { return tuned_dicts(e.tune()); },
           "Measures every `auto` shape class the measurement store lacks now (progress on "
           "stderr) and returns each class's answer as a dict (group, rows, cols, count, "
           "algorithm, restarts, source, ms). Freezes the registration; distributed: collective, "
           "before the first step.")
      .def("tuned_shapes", [](PyEngine& e) { return tuned_dicts(e.engine().tuned_shapes()); },
           "The answers of the last tuning (set-up or tune()), as tune() returns them.")
      .def("wait_published", &PyEngine::wait_published)
      .def("prepare", &PyEngine::prepare, nb::arg("index"), nb::arg("params"), nb::arg("grads"),
           "Dedicated mode with caller transfers: momentum and orthogonalization of the "
           "matrices this rank owns among parameters `index` now; the next step() applies them.")
      .def_prop_ro("prepared_matrices",
                   [](PyEngine& e) { return e.engine().prepared_matrices(); })
      .def("discard_prepared", [](PyEngine& e) { e.engine().discard_prepared(); },
           "Forgets the prepared matrices (their momentum has advanced): step() recomputes all.")
      .def("set_stream", &PyEngine::set_stream, nb::arg("stream"),
           "CUDA: issue the backend's work on this cudaStream_t (an integer; 0 is the legacy default "
           "stream, torch's default stream).")
      .def_prop_ro("distributed", [](PyEngine& e) { return e.engine().distributed(); })
      .def_prop_ro(
          "plan_costs",
          [](PyEngine& e) -> std::optional<std::string> {
            const Plan* p = e.engine().plan();
            return p ? std::optional<std::string>(p->costs) : std::nullopt;
          },
          "What the owner plan was costed on (distributed, after setup), e.g. 'measured costs "
          "for 5 of 7 shapes (...)'; None otherwise.")
      .def("owner", [](PyEngine& e, int i, int64_t slice) { return e.engine().owner(i, slice); },
           nb::arg("index"), nb::arg("slice") = 0,
           "World rank that orthogonalizes matrix `slice` of Muon parameter `index`.")
      .def(
          "matrix_state",
          [](PyEngine& e, int i, int64_t slice, const std::string& name) -> nb::object {
            const TensorView v = e.engine().matrix_state(i, slice, name);
            if (v.data == nullptr) return nb::none();
            return nb::cast(view_of(v, nb::find(e)));
          },
          nb::arg("index"), nb::arg("slice"), nb::arg("name") = "momentum_buffer",
          "A DLPack view of the state of matrix `slice` of a Muon parameter, or None where "
          "this rank does not hold it.")
      .def_prop_ro("num_params", [](PyEngine& e) { return e.engine().num_params(); })
      .def("param", [](PyEngine& e, int i) { return e.engine().param(i); }, nb::arg("index"))
      .def("step", &PyEngine::step, nb::arg("params"), nb::arg("grads"),
           "One optimizer step. params[i] and grads[i] (or None) belong to parameter i; they are "
           "used in place through DLPack, never copied.")
      .def(
          "state",
          [](PyEngine& e, int i, const std::string& name) -> nb::object {
            const TensorView v = e.engine().state(i, name);
            if (v.data == nullptr) return nb::none();
            return nb::cast(view_of(v, nb::find(e)));
          },
          nb::arg("index"), nb::arg("name"),
          "A DLPack view of parameter `index`'s state `name` in backend memory (no copy); None "
          "where this rank holds none of it (distributed momentum lives on its owner).")
      .def("state_names", [](PyEngine& e, int i) { return e.engine().state_names(i); },
           nb::arg("index"))
      .def("param_step", [](PyEngine& e, int i) { return e.engine().param_step(i); },
           nb::arg("index"), "The steps parameter `index` took, as this rank knows them.")
      .def(
          "param_steps",
          [](PyEngine& e) {
            nb::gil_scoped_release release;  // collective: Python communicators take the GIL
            return e.engine().param_steps();
          },
          "Every parameter's step count, the same on every rank (collective when distributed: "
          "a Muon matrix's skipped steps are counted where its momentum is kept).")
      .def("set_param_step",
           [](PyEngine& e, int i, int64_t s) { e.engine().set_param_step(i, s); },
           nb::arg("index"), nb::arg("step"))
      .def("stats", &PyEngine::stats)
      .def("synchronize", [](PyEngine& e) {
        nb::gil_scoped_release release;
        e.backend().synchronize();
      })
      .def_prop_ro("backend_name", [](PyEngine& e) { return e.backend().name(); });
}

}  // namespace distmuon::py
