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
#include "dlpack.h"

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

// Owns the backend and the engine (the engine is destroyed first).
class PyEngine {
 public:
  PyEngine(const std::string& device, NonFinitePolicy nonfinite)
      : backend_(make_backend(device)),
        engine_(std::make_unique<Engine>(*backend_, EngineOptions{nonfinite})) {}

  Engine& engine() { return *engine_; }
  Backend& backend() { return *backend_; }

  int add_param(const std::string& name, int group, const std::vector<int64_t>& shape,
                DType dtype) {
    return engine_->add_param(ParamSpec{name, group, shape, dtype});
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
    if (numel(shape_of(a)) != numel(spec.shape))
      value_error(what + " has shape " + shape_str(shape_of(a)) + " but the engine holds " +
                  shape_str(spec.shape));
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
      .def_ro("dtype", &ParamSpec::dtype);

  nb::class_<PyEngine>(m, "Engine",
                       "The C++ optimizer engine on one backend ('cpu' or 'cuda'). Register "
                       "groups and parameters, then call step() with DLPack arrays.")
      .def(nb::init<const std::string&, NonFinitePolicy>(), nb::arg("device") = "cpu",
           nb::arg("nonfinite") = NonFinitePolicy::kSkip)
      .def("add_group", [](PyEngine& e, const GroupOptions& g) { return e.engine().add_group(g); },
           nb::arg("options"))
      .def("group", [](PyEngine& e, int i) -> GroupOptions& { return e.engine().group(i); },
           nb::arg("index"), nb::rv_policy::reference_internal,
           "The live options of group `index` (assign fields between steps, e.g. for schedulers).")
      .def_prop_ro("num_groups", [](PyEngine& e) { return e.engine().num_groups(); })
      .def("add_param", &PyEngine::add_param, nb::arg("name"), nb::arg("group"), nb::arg("shape"),
           nb::arg("dtype"))
      .def_prop_ro("num_params", [](PyEngine& e) { return e.engine().num_params(); })
      .def("param", [](PyEngine& e, int i) { return e.engine().param(i); }, nb::arg("index"))
      .def("step", &PyEngine::step, nb::arg("params"), nb::arg("grads"),
           "One optimizer step. params[i] and grads[i] (or None) belong to parameter i; they are "
           "used in place through DLPack, never copied.")
      .def(
          "state",
          [](PyEngine& e, int i, const std::string& name) {
            return view_of(e.engine().state(i, name), nb::find(e));
          },
          nb::arg("index"), nb::arg("name"),
          "A DLPack view of parameter `index`'s state `name` in backend memory (no copy).")
      .def("state_names", [](PyEngine& e, int i) { return e.engine().state_names(i); },
           nb::arg("index"))
      .def("param_step", [](PyEngine& e, int i) { return e.engine().param_step(i); },
           nb::arg("index"))
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
