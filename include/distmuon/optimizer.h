// Hyperparameters of the Muon update (docs/algorithms.md section 1) and of AdamW for the parameters
// Muon does not handle, plus the rules that turn a parameter's shape into matrices.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/cache.h"
#include "distmuon/ortho.h"
#include "distmuon/types.h"

namespace distmuon {

// The shape-dependent factor on the orthogonalized update of an r x c matrix.
enum class ScaleMode : int {
  kOriginal = 0,       // sqrt(max(1, r / c))           (Keller Jordan, torch.optim.Muon)
  kMatchRmsAdamW = 1,  // 0.2 * sqrt(max(r, c))         (Moonlight: reuse AdamW's lr and wd)
  kSpectral = 2,       // sqrt(r / c)                   (dion)
};
ScaleMode parse_scale_mode(const std::string& s);  // "original" | "match_rms_adamw" | "spectral"
const char* scale_mode_name(ScaleMode m);
double shape_scale(ScaleMode mode, int64_t rows, int64_t cols);

struct MuonOptions {
  float lr = 0.02f;
  float momentum = 0.95f;
  bool nesterov = true;
  float weight_decay = 0.0f;
  ScaleMode scale = ScaleMode::kOriginal;
  OrthoConfig ortho;
  DType momentum_dtype = DType::kF32;
  // CacheMuon for the shapes that resolve to Gram NS (distmuon/cache.h); off by default.
  CacheOptions cache;
};

struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

enum class ParamKind : int { kMuon = 0, kAdamW = 1 };

struct GroupOptions {
  ParamKind kind = ParamKind::kMuon;
  MuonOptions muon;    // used when kind == kMuon
  AdamWOptions adamw;  // used when kind == kAdamW
};

// How a parameter of a given shape is seen as a batch of matrices: 2D (r, c) is one r x c
// matrix; 3D (e, r, c) is e matrices (stacked experts, per-head weights); 4D conv kernels
// (o, i, kh, kw) are one o x (i*kh*kw) matrix. Anything else throws, naming the parameter.
struct MatrixLayout {
  int64_t count = 0, rows = 0, cols = 0;
  bool tall() const { return rows > cols; }
  int64_t m() const { return rows < cols ? rows : cols; }  // small side
  int64_t n() const { return rows < cols ? cols : rows; }  // large side
};
MatrixLayout matrix_layout(const std::string& name, const std::vector<int64_t>& shape);

}  // namespace distmuon
