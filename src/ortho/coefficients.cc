// Coefficient schedules, algorithm names and the per-shape choice of iteration
// (docs/algorithms.md sections 2-4).
#include <algorithm>
#include <cmath>
#include <sstream>

#include "distmuon/error.h"
#include "distmuon/ortho.h"

namespace distmuon {

namespace {

constexpr QuinticCoef kJordan{3.4445, -4.7750, 2.0315};

// Polar Express base rows (Amsel et al., polar_express/basic.py), before safety factors.
constexpr QuinticCoef kPolarExpressBase[] = {
    {8.28721201814563, -23.595886519098837, 17.300387312530933},
    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
    {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
    {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
    {1.875, -1.25, 0.375},
};

// The Gram-NS / DMuon rows, safety 1.05 already applied (as published, to full precision).
constexpr QuinticCoef kPolarExpress105[] = {
    {7.8925828744244084, -20.383013945879568, 13.555306149406924},
    {3.9114848681354308, -2.5464635929060884, 0.42689883196730738},
    {3.7606579556974231, -2.5128190182165628, 0.43236473490700728},
    {3.1603996736862872, -2.1496495188984981, 0.39963669076643887},
    {2.1910971618617303, -1.4416620102146629, 0.32814648762315501},
};

constexpr QuinticCoef kYou[] = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
    {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
};

QuinticCoef with_safety(QuinticCoef k, double s) {
  return {k.a / s, k.b / (s * s * s), k.c / (s * s * s * s * s)};
}

template <size_t N>
QuinticCoef row(const QuinticCoef (&table)[N], int i) {
  return table[std::min<size_t>(static_cast<size_t>(i), N - 1)];
}

}  // namespace

std::vector<QuinticCoef> coefficient_schedule(Coefficients c, int steps) {
  DM_CHECK(steps >= 1, "orthogonalization needs at least one step (got ", steps, ")");
  std::vector<QuinticCoef> out;
  for (int i = 0; i < steps; ++i) {
    switch (c) {
      case Coefficients::kJordan: out.push_back(kJordan); break;
      case Coefficients::kPolarExpress: {
        // The reference code divides every step but the last by the 1.01 safety factor.
        QuinticCoef k = row(kPolarExpressBase, i);
        out.push_back(i + 1 < steps ? with_safety(k, 1.01) : k);
        break;
      }
      case Coefficients::kPolarExpress105:
        // Five published rows with safety 1.05; step i > 5 takes base row i (row 6 close to, row 7
        // on the converged one).
        out.push_back(i < 5 ? kPolarExpress105[i] : row(kPolarExpressBase, i));
        break;
      case Coefficients::kYou: out.push_back(row(kYou, i)); break;
      case Coefficients::kCustom:
        DM_FAIL("custom coefficients live in OrthoConfig::custom_coefficients: call "
                "coefficient_schedule(const OrthoConfig&)");
    }
  }
  return out;
}

std::vector<QuinticCoef> coefficient_schedule(const OrthoConfig& cfg) {
  if (cfg.coefficients != Coefficients::kCustom) return coefficient_schedule(cfg.coefficients, cfg.steps);
  DM_CHECK(cfg.steps >= 1, "orthogonalization needs at least one step (got ", cfg.steps, ")");
  const auto& rows = cfg.custom_coefficients;
  DM_CHECK(!rows.empty(), "custom coefficients selected but none given");
  for (const QuinticCoef& k : rows)
    DM_CHECK(std::isfinite(k.a) && std::isfinite(k.b) && std::isfinite(k.c),
             "custom coefficients must be finite (got ", k.a, ", ", k.b, ", ", k.c, ")");
  std::vector<QuinticCoef> out;
  for (int i = 0; i < cfg.steps; ++i) out.push_back(rows[std::min<size_t>(i, rows.size() - 1)]);
  return out;
}

double norm_multiplier(Coefficients c) { return c == Coefficients::kPolarExpress ? 1.01 : 1.0; }

std::string iteration_name(Iteration it) {
  switch (it) {
    case Iteration::kStandardDense: return "ns";
    case Iteration::kStandardSym: return "ns-sym";
    case Iteration::kGram: return "gram-ns";
    case Iteration::kAuto: return "auto";
  }
  return "?";
}

std::string coefficients_name(Coefficients c) {
  switch (c) {
    case Coefficients::kJordan: return "jordan";
    case Coefficients::kPolarExpress: return "polar-express";
    case Coefficients::kPolarExpress105: return "polar-express-1.05";
    case Coefficients::kYou: return "you";
    case Coefficients::kCustom: return "custom";
  }
  return "?";
}

std::string algorithm_name(const OrthoConfig& cfg) {
  std::string s = iteration_name(cfg.iteration);
  if (s == "ns" || s == "ns-sym") s.insert(2, std::to_string(cfg.steps));
  // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on ":" + std::string temporaries.
  if (cfg.coefficients != Coefficients::kJordan)
    s.append(":").append(coefficients_name(cfg.coefficients));
  if ((s.rfind("ns", 0) != 0 || cfg.coefficients != Coefficients::kJordan) && cfg.steps != 5)
    s.append(":").append(std::to_string(cfg.steps));
  return s;
}

namespace {
// The step count of an algorithm name: 1 to kMaxOrthoSteps.
int parse_steps(const std::string& digits, const std::string& spec) {
  const bool number =
      !digits.empty() && digits.size() <= 4 && std::all_of(digits.begin(), digits.end(), ::isdigit);
  const int steps = number ? std::stoi(digits) : 0;
  DM_CHECK(steps >= 1 && steps <= kMaxOrthoSteps, "bad step count in algorithm '", spec,
           "' (expected 1 to ", kMaxOrthoSteps, ")");
  return steps;
}
}  // namespace

OrthoConfig parse_algorithm(const std::string& spec, OrthoConfig base) {
  std::vector<std::string> parts;
  std::stringstream ss(spec);
  for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
  DM_CHECK(!parts.empty() && !parts[0].empty(), "empty algorithm name");
  const std::string& name = parts[0];
  OrthoConfig cfg = base;
  auto starts = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  if (name == "auto") {
    cfg.iteration = Iteration::kAuto;
  } else if (name == "gram-ns" || name == "gram") {
    cfg.iteration = Iteration::kGram;
  } else if (starts("ns")) {
    // ns, ns5, ns-sym, ns5-sym, ns7 ...
    std::string rest = name.substr(2);
    bool sym = rest.size() >= 4 && rest.compare(rest.size() - 4, 4, "-sym") == 0;
    if (sym) rest.resize(rest.size() - 4);
    if (!rest.empty()) cfg.steps = parse_steps(rest, spec);
    cfg.iteration = sym ? Iteration::kStandardSym : Iteration::kStandardDense;
  } else {
    DM_FAIL("unknown algorithm '", spec,
            "' (expected ns (also ns5), ns-sym (ns5-sym), gram-ns or auto, optionally "
            ":COEFFS[:STEPS] with COEFFS one of jordan, polar-express, polar-express-1.05, you)");
  }
  if (parts.size() >= 2 && !parts[1].empty()) {
    const std::string& c = parts[1];
    if (c == "jordan") cfg.coefficients = Coefficients::kJordan;
    else if (c == "polar-express" || c == "pe") cfg.coefficients = Coefficients::kPolarExpress;
    else if (c == "polar-express-1.05" || c == "pe105") cfg.coefficients = Coefficients::kPolarExpress105;
    else if (c == "you") cfg.coefficients = Coefficients::kYou;
    else if (c == "custom") DM_FAIL("custom coefficients are set through OrthoConfig::custom_coefficients, not in '", spec, "'");
    else DM_FAIL("unknown coefficient set '", c, "' in '", spec, "'");
  }
  if (parts.size() >= 3) {
    cfg.steps = parse_steps(parts[2], spec);
  }
  DM_CHECK(parts.size() <= 3, "bad algorithm '", spec, "'");
  DM_CHECK(cfg.steps >= 1 && cfg.steps <= kMaxOrthoSteps, "step count ", cfg.steps,
           " out of range (1 to ", kMaxOrthoSteps, ")");
  return cfg;
}

Iteration choose_iteration(int64_t m, int64_t n) {
  if (m > n) std::swap(m, n);
  if (m == 0) return Iteration::kStandardSym;
  const double alpha = static_cast<double>(n) / static_cast<double>(m);
  return alpha >= 1.5 ? Iteration::kGram : Iteration::kStandardSym;
}

OrthoConfig resolve(const OrthoConfig& cfg, int64_t rows, int64_t cols) {
  OrthoConfig r = cfg;
  if (r.iteration == Iteration::kAuto) r.iteration = choose_iteration(rows, cols);
  if (!r.gram_work_dtype) r.gram_work_dtype = r.work_dtype == DType::kBF16 ? DType::kF16 : r.work_dtype;
  for (int i : r.restarts) DM_CHECK(i >= 0, "negative restart index ", i);
  return r;
}

}  // namespace distmuon

namespace distmuon {
DType iteration_dtype(const OrthoConfig& r) {
  DM_CHECK(r.iteration != Iteration::kAuto, "iteration_dtype needs a resolved config");
  return r.iteration == Iteration::kGram && r.gram_work_dtype ? *r.gram_work_dtype : r.work_dtype;
}
}  // namespace distmuon
