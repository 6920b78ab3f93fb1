// Newton-Schulz and Gram Newton-Schulz over the Backend interface (docs/algorithms.md sections 2
// and 4). The iterations live in iteration.h as templates over an executor, so ortho_flops() counts
// exactly the operations run() performs.
#include <algorithm>
#include <vector>

#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "ortho/iteration.h"

namespace distmuon {

using ortho_detail::BackendExec;
using ortho_detail::Carver;
using ortho_detail::FlopCounter;
using ortho_detail::iterate;

size_t Orthogonalizer::workspace_bytes(const OrthoConfig& cfg, int64_t count, int64_t m,
                                       int64_t n) {
  OrthoConfig r = resolve(cfg, m, n);
  DType t = iteration_dtype(r);
  Carver ws{nullptr};
  BatchRef x = BatchRef::packed(nullptr, t, count, m, n);
  FlopCounter fc;
  iterate(fc, r, x, x, ws);
  return ws.used;
}

double ortho_flops(const OrthoConfig& cfg, int64_t rows, int64_t cols) {
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  if (m == 0) return 0;
  OrthoConfig r = resolve(cfg, m, n);
  Carver ws{nullptr};
  BatchRef x = BatchRef::packed(nullptr, iteration_dtype(r), 1, m, n);
  FlopCounter fc;
  iterate(fc, r, x, x, ws);
  return fc.total();
}

void Orthogonalizer::run(const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out,
                         void* workspace, size_t workspace_size, OrthoStats* stats) {
  DM_CHECK(x.rows <= x.cols, "orthogonalizer: input must be wide (m <= n), got ", x.rows, "x",
           x.cols);
  DM_CHECK(out.rows == x.rows && out.cols == x.cols && out.count == x.count,
           "orthogonalizer: output shape differs from the input");
  OrthoConfig r = resolve(cfg, x.rows, x.cols);
  DM_CHECK(x.dtype == iteration_dtype(r), "orthogonalizer: input is ", dtype_name(x.dtype),
           " but ", algorithm_name(r), " iterates in ", dtype_name(iteration_dtype(r)));
  if (stats) {
    stats->calls += 1;
    stats->matrices += x.count;
  }
  if (x.count == 0) return;
  const size_t need = workspace_bytes(r, x.count, x.rows, x.cols);
  DM_CHECK(workspace_size >= need, "orthogonalizer: workspace of ", workspace_size,
           " bytes, need ", need);
  Carver ws{static_cast<char*>(workspace)};
  const ortho_detail::IterationBuffers bufs = ortho_detail::carve_iteration(ws, r, x);
  const int64_t parts = std::max<int64_t>(1, std::min(backend_.batch_parts(x.count), x.count));
  if (parts == 1) {
    BackendExec e{backend_, stats};
    iterate(e, r, x, out, bufs);
    return;
  }
  // Consecutive parts of the batch, each iterating on its slice of every buffer from its own
  // thread (CPU): the same operations per matrix, so the same results.
  std::vector<OrthoStats> part_stats(static_cast<size_t>(parts));
  backend_.run_parts(parts, [&](int64_t p) {
    const int64_t first = x.count * p / parts, len = x.count * (p + 1) / parts - first;
    BackendExec e{backend_, stats ? &part_stats[static_cast<size_t>(p)] : nullptr};
    iterate(e, r, x.slice(first, len), out.slice(first, len), bufs.slice(first, len));
  });
  if (stats)
    for (const OrthoStats& ps : part_stats) stats->flops += ps.flops;
}

void Orthogonalizer::orthogonalize(const OrthoConfig& cfg, const BatchRef& u, const BatchRef& out,
                                   OrthoStats* stats) {
  DM_CHECK(u.rows == out.rows && u.cols == out.cols && u.count == out.count,
           "orthogonalize: output shape differs from the input");
  const bool tall = u.rows > u.cols;
  const int64_t m = std::min(u.rows, u.cols), n = std::max(u.rows, u.cols);
  OrthoConfig r = resolve(cfg, m, n);
  const DType t = iteration_dtype(r);
  Buffer norms = backend_.alloc(sizeof(double) * std::max<int64_t>(1, u.count));
  Buffer xbuf = backend_.alloc(static_cast<size_t>(u.count * m * n) * dtype_size(t));
  const size_t ws_bytes = workspace_bytes(r, u.count, m, n);
  Buffer ws = backend_.alloc(ws_bytes);
  BatchRef x = BatchRef::packed(xbuf.data(), t, u.count, m, n);
  backend_.frob_norm(u, norms.as<double>());
  ScaleSpec spec{norms.as<double>(), norm_multiplier(r.coefficients), r.eps, 1.0};
  backend_.scale_copy(u, tall, spec, x);
  run(r, x, x, ws.data(), ws_bytes, stats);
  backend_.scale_copy(x, tall, {}, out);
  backend_.synchronize();  // the temporaries are released on return
}

}  // namespace distmuon
