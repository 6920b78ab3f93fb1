// `auto` per shape (docs/algorithms.md section 4: chosen per shape, measured where it can be): the
// measurement layer's choice (measure/tuner.h: stored, measured, or predicted by the cost model) under the
// engine's policy, or the pure heuristic of resolve(). Distributed engines take rank 0's choices
// everywhere, so that every rank runs the same algorithm on the same matrix (gather mode solves
// every matrix on every rank and keeps its own rows: different algorithms would tear a matrix
// apart).
#include <optional>
#include <sstream>

#include "distmuon/env.h"
#include "distmuon/error.h"
#include "measure/tuner.h"
#include "runtime/engine_impl.h"

namespace distmuon {

AutoTune parse_autotune(const std::string& s) {
  if (s == "off" || s == "0") return AutoTune::kOff;
  if (s == "cached") return AutoTune::kCached;
  if (s == "on" || s == "1") return AutoTune::kOn;
  DM_FAIL("unknown autotune mode '", s, "' (expected off, cached or on)");
}

namespace {

// Everything of a group's config that the tuned answer depended on: a change of any of it
// between steps (a scheduler editing the group) falls back to the heuristic, never to a stale
// choice.
std::string tuned_key(int group, int64_t m, int64_t n, const OrthoConfig& base) {
  std::ostringstream os;
  os << group << "|" << m << "x" << n << "|" << algorithm_name(base) << "|"
     << dtype_name(base.work_dtype) << "|"
     << (base.gram_work_dtype ? dtype_name(*base.gram_work_dtype) : "-") << "|" << base.eps << "|"
     << base.custom_coefficients.size();
  return os.str();
}

// A tuned answer as one line of text (the distributed exchange carries it): its source and
// milliseconds, then the fields it sets.
std::string encode(const measure::TunedConfig& t) {
  const OrthoConfig& c = t.config;
  std::ostringstream os;
  os.precision(17);
  os << static_cast<int>(t.source) << " " << t.ms << " " << static_cast<int>(c.iteration) << " "
     << static_cast<int>(c.work_dtype) << " "
     << (c.gram_work_dtype ? static_cast<int>(*c.gram_work_dtype) : -1);
  for (int r : c.restarts) os << " " << r;
  return os.str();
}

measure::TunedConfig decode(const std::string& line, const OrthoConfig& base) {
  std::istringstream is(line);
  int src = 0, it = 0, wd = 0, gd = 0;
  measure::TunedConfig t;
  is >> src >> t.ms >> it >> wd >> gd;
  DM_CHECK(!is.fail() && it >= 0 && it <= 2 && src >= 0 && src <= 2, "internal: bad tuned choice '",
           line, "'");
  t.source = static_cast<measure::TuneSource>(src);
  t.config = base;
  t.config.iteration = static_cast<Iteration>(it);
  t.config.work_dtype = static_cast<DType>(wd);
  if (gd >= 0) t.config.gram_work_dtype = static_cast<DType>(gd);
  t.config.restarts.clear();
  for (int r; is >> r;) t.config.restarts.push_back(r);
  return t;
}

}  // namespace

OrthoConfig ShapeTuning::resolve_shape(int group, int64_t m, int64_t n) const {
  if (std::optional<OrthoConfig> g = grouped_auto(group, m, n)) return *g;
  const OrthoConfig& base = groups[group].muon.ortho;
  OrthoConfig r = resolve(base, m, n);
  if (base.iteration == Iteration::kAuto && !tuned.empty()) {
    auto it = tuned.find(tuned_key(group, m, n, base));
    if (it != tuned.end()) r = it->second;
  }
  r.grouped_products = grouped_products(group, m, n, iteration_dtype(r));
  return r;
}

std::string ShapeTuning::grouped_products_setting() {
  std::string v = env::get("DISTMUON_GROUPED_PRODUCTS");
  if (v.empty()) v = "auto";
  DM_CHECK(v == "auto" || v == "off" || v == "all", "DISTMUON_GROUPED_PRODUCTS=", v,
           ": expected auto, off or all");
  return v;
}

std::optional<OrthoConfig> ShapeTuning::grouped_auto(int group, int64_t m, int64_t n) const {
  // `auto` for a class that shares its launches: Gram NS, one schedule for all of them, so that
  // they all share every launch. Timed alone and ungrouped, the tuner would pick per class what
  // is fastest alone (ns5 for ResNet-18's classes: 0.94 ms a step on an H200, where grouped
  // Gram NS takes 0.73).
  OrthoConfig g = groups[group].muon.ortho;
  if (g.iteration != Iteration::kAuto) return std::nullopt;
  g.iteration = Iteration::kGram;
  OrthoConfig r = resolve(g, m, n);
  if (!grouped_products(group, m, n, iteration_dtype(r))) return std::nullopt;
  r.grouped_products = true;
  return r;
}

bool ShapeTuning::grouped_products(int group, int64_t m, int64_t n, DType work) const {
  if (grouped_setting == "off") return false;
  if (grouped_setting == "all") return true;
  if (!backend.grouped_gemm_native(work) || m > kGroupedMaxRows) return false;
  // The class's count over every rank (tune_shapes' shapes), so that every mode and rank that
  // orthogonalizes it decides alike, whatever share of it each holds.
  const auto it = shape_counts.find({group, m, n});
  const int64_t count = it == shape_counts.end() ? 0 : it->second;
  return count > 0 && static_cast<double>(count) * m * m * n <= kGroupedMaxWork;
}

void ShapeTuning::tune(const std::vector<TuneShape>& shapes, const EngineOptions& options,
                       bool replay, Communicator* world) {
  grouped_setting = grouped_products_setting();
  shape_counts.clear();
  for (const TuneShape& t : shapes) shape_counts[{t.group, t.m, t.n}] = t.count;
  AutoTune mode = options.autotune;
  if (const std::string e = env::get("DISTMUON_AUTOTUNE"); !e.empty()) mode = parse_autotune(e);
  if (force_measure) mode = AutoTune::kOn;
  bool restart_free = options.allow_restart_free;
  if (!env::get("DISTMUON_AUTOTUNE_RESTART_FREE").empty())
    restart_free = env::get_bool("DISTMUON_AUTOTUNE_RESTART_FREE");
  measure::install_kernel_choices(backend);  // kernel variants: on every rank, each its device
  std::vector<TuneShape> todo;
  report.clear();
  for (const TuneShape& t : shapes) {
    if (groups[t.group].kind != ParamKind::kMuon ||
        groups[t.group].muon.ortho.iteration != Iteration::kAuto)
      continue;
    if (std::optional<OrthoConfig> g = grouped_auto(t.group, t.m, t.n))  // not timed
      report.push_back({t.group, t.m, t.n, t.count, *g, "grouped", 0.0});
    else
      todo.push_back(t);
  }
  const bool ask = mode != AutoTune::kOff && !todo.empty();
  std::string answers;  // one line per shape: an encoded answer, or "-" for the heuristic
  if (ask && (!world || world->rank() == 0)) {
    const measure::TunePolicy policy{mode == AutoTune::kOn, restart_free};
    // An engine that replays its step is timed as it runs: graph replays.
    std::optional<measure::AlgorithmTuner> tuner = measure::backend_tuner(backend, replay);
    for (size_t i = 0; i < todo.size(); ++i) {
      const TuneShape& t = todo[i];
      std::optional<measure::TunedConfig> out;
      if (tuner)
        out = tuner->config_for(groups[t.group].muon.ortho, t.m, t.n, t.count, policy,
                                std::to_string(i + 1) + "/" + std::to_string(todo.size()));
      answers += (out ? encode(*out) : std::string("-")) + "\n";
    }
  }
  if (ask && world && world->size() > 1) {  // every rank takes rank 0's answers
    const std::vector<int64_t> len =
        host_all_gather(*world, backend, {static_cast<int64_t>(answers.size())});
    const std::vector<char> all = host_all_gather_v(*world, backend, answers, len);
    answers.assign(all.data(), static_cast<size_t>(len[0]));
  }
  std::istringstream is(answers);
  std::string line;
  for (const TuneShape& t : todo) {
    const OrthoConfig& base = groups[t.group].muon.ortho;
    const std::string key = tuned_key(t.group, t.m, t.n, base);
    TunedShape r{t.group, t.m, t.n, t.count, resolve(base, t.m, t.n), "heuristic", 0.0};
    if (std::getline(is, line) && !line.empty() && line != "-") {
      const measure::TunedConfig a = decode(line, base);
      r.config = tuned[key] = resolve(a.config, t.m, t.n);
      r.source = measure::tune_source_name(a.source);
      r.ms = a.ms;
    } else {
      tuned.erase(key);
    }
    report.push_back(r);
  }
}

void Engine::Impl::tune_shapes(const std::vector<TuneShape>& shapes) {
  tuning.tune(shapes, options, steps_replay(), dist.world);
}

std::vector<TuneShape> Engine::Impl::class_shapes() const {
  std::vector<TuneShape> shapes;
  for (const ShapeClass& c : local.classes)
    shapes.push_back({c.group, c.m, c.n, static_cast<int64_t>(c.members.size())});
  return shapes;
}

void Engine::Impl::tune_dist_shapes() {
  std::vector<TuneShape> shapes;
  for (const DistMatrix& d : dist.mats) {
    bool found = false;
    for (TuneShape& t : shapes)
      if (t.group == d.group && t.m == d.m() && t.n == d.n()) {
        t.count += 1;
        found = true;
      }
    if (!found) shapes.push_back({d.group, d.m(), d.n(), 1});
  }
  tune_shapes(shapes);
}

std::vector<TunedShape> Engine::tune() {
  Impl& s = *impl_;
  DM_CHECK(!(s.built && s.dist.world),
           "tune() on a distributed engine that is already set up: its owners and buffers were "
           "planned for the algorithms tune() would change; call tune() instead of setup() "
           "(distmuon.torch.Muon.tune() rebuilds its engines)");
  s.tuning.force_measure = true;
  try {
    if (s.built)
      s.tune_shapes(s.class_shapes());
    else
      setup();
  } catch (...) {
    s.tuning.force_measure = false;
    throw;
  }
  s.tuning.force_measure = false;
  return s.tuning.report;
}

std::vector<TunedShape> Engine::tuned_shapes() const { return impl_->tuning.report; }

OrthoConfig Engine::resolved_ortho(int i) {
  DM_CHECK(i >= 0 && i < num_params(), "no parameter ", i);
  Impl& s = *impl_;
  const Param& p = s.registry.params[i];
  DM_CHECK(s.registry.groups[p.spec.group].kind == ParamKind::kMuon, "parameter '", p.spec.name,
           "' is updated with AdamW, not orthogonalized");
  setup();
  return s.tuning.resolve_shape(p.spec.group, std::min(p.layout.rows, p.layout.cols),
                                std::max(p.layout.rows, p.layout.cols));
}

}  // namespace distmuon
