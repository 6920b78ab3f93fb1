#include "measure/time_ortho.h"

#include <algorithm>

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
  if (timing.graph)
    if (std::unique_ptr<BackendGraph> g = be.capture(run))
      return be.time_ms(timing.repeats, restore, [&] { g->replay(); });
  return be.time_ms(timing.repeats, restore, run);
}

}  // namespace distmuon::measure
