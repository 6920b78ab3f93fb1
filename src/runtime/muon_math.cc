// Shape rules and scale modes of the Muon update (docs/algorithms.md section 1).
#include <algorithm>
#include <cmath>
#include <sstream>

#include "distmuon/error.h"
#include "distmuon/optimizer.h"

namespace distmuon {

ScaleMode parse_scale_mode(const std::string& s) {
  if (s == "original") return ScaleMode::kOriginal;
  if (s == "match_rms_adamw") return ScaleMode::kMatchRmsAdamW;
  if (s == "spectral") return ScaleMode::kSpectral;
  DM_FAIL("unknown scale mode '", s, "' (expected original, match_rms_adamw or spectral)");
}

const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kOriginal:
      return "original";
    case ScaleMode::kMatchRmsAdamW:
      return "match_rms_adamw";
    case ScaleMode::kSpectral:
      return "spectral";
  }
  return "?";
}

double shape_scale(ScaleMode mode, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  switch (mode) {
    case ScaleMode::kOriginal:
      return std::sqrt(std::max(1.0, r / c));
    case ScaleMode::kMatchRmsAdamW:
      return 0.2 * std::sqrt(std::max(r, c));
    case ScaleMode::kSpectral:
      return std::sqrt(r / c);
  }
  return 1.0;
}

namespace {
std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}
}  // namespace

MatrixLayout matrix_layout(const std::string& name, const std::vector<int64_t>& shape) {
  for (int64_t d : shape)
    DM_CHECK(d > 0, "parameter '", name, "' has shape ", shape_str(shape),
             ": empty parameters cannot be optimized");
  switch (shape.size()) {
    case 2:
      return {1, shape[0], shape[1]};
    case 3:
      return {shape[0], shape[1], shape[2]};  // a batch of matrices
    case 4: {                                 // conv: out x (in*kh*kw)
      const std::string what = "parameter '" + name + "'";
      const int64_t inner = checked_numel({shape[1], shape[2], shape[3]}, what);
      return {1, shape[0], inner};
    }
    default:
      DM_FAIL("parameter '", name, "' has shape ", shape_str(shape),
              ": Muon needs a matrix (2D), a batch of matrices (3D) or a conv kernel (4D); "
              "put it in an AdamW group");
  }
}

}  // namespace distmuon
