// distmuon._C: the C++ API's option types, enums and free functions, one to one. The PyTorch
// front (distmuon.torch) is written in Python on top of this module; nothing here knows torch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "distmuon/backend.h"
#include "distmuon/cache.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"

namespace nb = nanobind;
using namespace distmuon;

namespace distmuon::py {
void bind_engine(nb::module_& m);
void bind_comm(nb::module_& m);
void bind_dedicated(nb::module_& m);
}

namespace {

void bind_enums(nb::module_& m) {
  nb::enum_<DType>(m, "DType")
      .value("f64", DType::kF64)
      .value("f32", DType::kF32)
      .value("bf16", DType::kBF16)
      .value("f16", DType::kF16);
  nb::enum_<Iteration>(m, "Iteration")
      .value("ns", Iteration::kStandardDense)
      .value("ns_sym", Iteration::kStandardSym)
      .value("gram", Iteration::kGram)
      .value("auto", Iteration::kAuto);
  nb::enum_<Coefficients>(m, "Coefficients")
      .value("jordan", Coefficients::kJordan)
      .value("polar_express", Coefficients::kPolarExpress)
      .value("polar_express_1_05", Coefficients::kPolarExpress105)
      .value("you", Coefficients::kYou)
      .value("custom", Coefficients::kCustom);
  nb::enum_<ScaleMode>(m, "ScaleMode")
      .value("original", ScaleMode::kOriginal)
      .value("match_rms_adamw", ScaleMode::kMatchRmsAdamW)
      .value("spectral", ScaleMode::kSpectral);
  nb::enum_<ParamKind>(m, "ParamKind").value("muon", ParamKind::kMuon).value("adamw", ParamKind::kAdamW);
  nb::enum_<CacheResidual>(m, "CacheResidual")
      .value("exact", CacheResidual::kExact)
      .value("probe", CacheResidual::kProbe);
  nb::enum_<CacheLayout>(m, "CacheLayout")
      .value("product", CacheLayout::kProduct)
      .value("factors", CacheLayout::kFactors);
  nb::enum_<CacheGate>(m, "CacheGate")
      .value("matrix", CacheGate::kMatrix)
      .value("batch", CacheGate::kBatch);
  nb::enum_<NonFinitePolicy>(m, "NonFinitePolicy")
      .value("skip", NonFinitePolicy::kSkip)
      .value("raise_", NonFinitePolicy::kRaise);
}

void bind_options(nb::module_& m) {
  nb::class_<QuinticCoef>(m, "QuinticCoef")
      .def(nb::init<>())
      .def("__init__", [](QuinticCoef* k, double a, double b, double c) { new (k) QuinticCoef{a, b, c}; },
           nb::arg("a"), nb::arg("b"), nb::arg("c"))
      .def_rw("a", &QuinticCoef::a)
      .def_rw("b", &QuinticCoef::b)
      .def_rw("c", &QuinticCoef::c)
      .def("__repr__", [](const QuinticCoef& k) {
        return "QuinticCoef(" + std::to_string(k.a) + ", " + std::to_string(k.b) + ", " +
               std::to_string(k.c) + ")";
      });

  nb::class_<OrthoConfig>(m, "OrthoConfig")
      .def(nb::init<>())
      .def_rw("iteration", &OrthoConfig::iteration)
      .def_rw("coefficients", &OrthoConfig::coefficients)
      .def_rw("steps", &OrthoConfig::steps)
      .def_rw("restarts", &OrthoConfig::restarts)
      .def_rw("work_dtype", &OrthoConfig::work_dtype)
      .def_rw("gram_work_dtype", &OrthoConfig::gram_work_dtype)
      .def_rw("eps", &OrthoConfig::eps)
      .def_rw("custom_coefficients", &OrthoConfig::custom_coefficients)
      .def("__repr__", [](const OrthoConfig& c) { return "OrthoConfig(" + algorithm_name(c) + ")"; });

  nb::class_<CacheOptions>(m, "CacheOptions")
      .def(nb::init<>())
      .def_rw("enabled", &CacheOptions::enabled)
      .def_rw("gamma", &CacheOptions::gamma)
      .def_rw("residual", &CacheOptions::residual)
      .def_rw("probes", &CacheOptions::probes)
      .def_rw("max_staleness", &CacheOptions::max_staleness)
      .def_rw("check_backoff", &CacheOptions::check_backoff)
      .def_rw("gate", &CacheOptions::gate)
      .def_rw("dtype", &CacheOptions::dtype)
      .def_rw("layout", &CacheOptions::layout)
      .def_rw("per_matrix_stats", &CacheOptions::per_matrix_stats)
      .def_rw("shadow", &CacheOptions::shadow)
      .def_rw("seed", &CacheOptions::seed);

  nb::class_<MuonOptions>(m, "MuonOptions")
      .def(nb::init<>())
      .def_rw("lr", &MuonOptions::lr)
      .def_rw("momentum", &MuonOptions::momentum)
      .def_rw("nesterov", &MuonOptions::nesterov)
      .def_rw("weight_decay", &MuonOptions::weight_decay)
      .def_rw("scale", &MuonOptions::scale)
      .def_rw("ortho", &MuonOptions::ortho)
      .def_rw("momentum_dtype", &MuonOptions::momentum_dtype)
      .def_rw("cache", &MuonOptions::cache);

  nb::class_<AdamWOptions>(m, "AdamWOptions")
      .def(nb::init<>())
      .def_rw("lr", &AdamWOptions::lr)
      .def_rw("beta1", &AdamWOptions::beta1)
      .def_rw("beta2", &AdamWOptions::beta2)
      .def_rw("eps", &AdamWOptions::eps)
      .def_rw("weight_decay", &AdamWOptions::weight_decay);

  nb::class_<GroupOptions>(m, "GroupOptions")
      .def(nb::init<>())
      .def_rw("kind", &GroupOptions::kind)
      .def_rw("muon", &GroupOptions::muon)
      .def_rw("adamw", &GroupOptions::adamw);
}

void bind_functions(nb::module_& m) {
  m.def("parse_algorithm", &parse_algorithm, nb::arg("spec"), nb::arg("base") = OrthoConfig(),
        "Parses 'ns5', 'ns5-sym', 'gram-ns', 'auto', optionally ':COEFFS[:STEPS]'.");
  m.def("algorithm_name", &algorithm_name, nb::arg("config"));
  m.def("coefficient_schedule", nb::overload_cast<const OrthoConfig&>(&coefficient_schedule),
        nb::arg("config"), "The (a, b, c) of every step, safety factors applied.");
  m.def("norm_multiplier", &norm_multiplier, nb::arg("coefficients"));
  m.def("parse_scale_mode", &parse_scale_mode, nb::arg("name"));
  m.def("shape_scale", &shape_scale, nb::arg("mode"), nb::arg("rows"), nb::arg("cols"));
  m.def("ortho_flops", &ortho_flops, nb::arg("config"), nb::arg("rows"), nb::arg("cols"));
  m.def("resolve", &resolve, nb::arg("config"), nb::arg("rows"), nb::arg("cols"));
  m.def("cuda_available", &cuda_available, "True when this build has the CUDA backend and a GPU.");
  m.def("set_cpu_threads", &set_cpu_threads, nb::arg("threads"),
        "Threads of the CPU backend's loops for the process (0: OpenMP's setting); the front "
        "passes torch.get_num_threads() before each step.");
  m.def("cpu_threads", &cpu_threads, "Threads the CPU backend's next loop gets.");
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "distmuon C++ core (types only; the PyTorch front is distmuon.torch)";
  m.attr("__version__") = DISTMUON_VERSION;
  m.attr("MAX_ORTHO_STEPS") = kMaxOrthoSteps;
  // Torch tensors that view engine state (DLPack) keep the engine alive and may outlive module
  // teardown at interpreter exit; that is not a leak worth a report.
  nb::set_leak_warnings(false);
  auto error = nb::exception<Error>(m, "Error", PyExc_RuntimeError);
  nb::exception<TimeoutError>(m, "TimeoutError", error);
  bind_enums(m);
  bind_options(m);
  distmuon::py::bind_comm(m);
  distmuon::py::bind_engine(m);
  distmuon::py::bind_dedicated(m);
  bind_functions(m);
}
