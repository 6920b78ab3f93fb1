#include "measure/time_ortho.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "distmuon/error.h"

namespace distmuon::measure {

OrthoInput make_ortho_input(Backend& be, int64_t m, int64_t n, int64_t count,
                            const OrthoConfig& base, uint64_t seed) {
  DM_CHECK(m >= 1 && n >= 1 && count >= 1, "measure: bad input shape ", count, " x ", m, "x", n);
  OrthoInput in;
  in.batch = BatchRef::packed(nullptr, DType::kF32, count, m, n);
  in.storage = be.alloc(in.batch.bytes());
  in.batch.data = in.storage.data();
  be.fill_normal(in.batch, seed, 0);
  Buffer norms = be.alloc(sizeof(double) * count);
  be.frob_norm(in.batch, norms.as<double>());
  const ScaleSpec spec{norms.as<double>(), norm_multiplier(base.coefficients), base.eps, 1.0};
  be.scale_copy(in.batch, false, spec, in.batch);
  be.synchronize();  // `norms` is released on return
  return in;
}

double time_orthogonalizer(Backend& be, const OrthoConfig& cfg, const BatchRef& input,
                           const OrthoTiming& timing, const BatchRef* results) {
  DM_CHECK(timing.repeats >= 0 && timing.warmup >= 0,
           "measure: need repeats >= 0 and warmup >= 0 (got ", timing.repeats, ", ", timing.warmup,
           ")");
  const int64_t count = input.count, m = input.rows, n = input.cols;
  const OrthoConfig r = resolve(cfg, m, n);
  BatchRef x = BatchRef::packed(nullptr, iteration_dtype(r), count, m, n);
  Buffer xb = be.alloc(x.bytes());
  x.data = xb.data();
  const size_t ws_bytes = Orthogonalizer::workspace_bytes(r, count, m, n);
  Buffer ws = be.alloc(std::max<size_t>(ws_bytes, 1));
  Orthogonalizer ortho(be);
  auto restore = [&] { be.scale_copy(input, false, ScaleSpec{}, x); };
  auto run = [&] { ortho.run(r, x, x, ws.data(), ws_bytes); };
  if (results) {
    DM_CHECK(results->dtype == DType::kF32 && results->rows == m && results->cols == n &&
                 results->count <= count,
             "measure: results must be fp32 ", m, "x", n, " matrices, at most ", count);
    restore();
    run();
    be.scale_copy(x.slice(0, results->count), false, ScaleSpec{}, *results);
  }
  if (timing.repeats == 0) return 0;
  for (int i = 0; i < timing.warmup; ++i) {
    restore();
    run();
  }
  return be.time_ms(timing.repeats, restore, run);
}

double relative_error(Backend& be, const BatchRef& a, const BatchRef& b) {
  DM_CHECK(a.count == b.count && a.rows == b.rows && a.cols == b.cols && a.dtype == DType::kF32 &&
               b.dtype == DType::kF32,
           "measure: relative_error needs two fp32 batches of one shape");
  BatchRef diff = BatchRef::packed(nullptr, DType::kF32, a.count, a.rows, a.cols);
  Buffer db = be.alloc(diff.bytes());
  diff.data = db.data();
  be.lincomb(1.0, a, -1.0, &b, 0.0, diff);
  Buffer norms = be.alloc(sizeof(double) * 2 * std::max<int64_t>(1, a.count));
  be.frob_norm(diff, norms.as<double>());
  be.frob_norm(b, norms.as<double>() + a.count);
  std::vector<double> h(2 * a.count);
  be.copy_to_host(h.data(), norms.data(), h.size() * sizeof(double));
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.count; ++i) {
    num += h[i] * h[i];
    den += h[a.count + i] * h[a.count + i];
  }
  const double r = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  return std::isfinite(r) ? r : INFINITY;
}

}  // namespace distmuon::measure
