// Newton-Schulz and Gram Newton-Schulz over the Backend interface (docs/algorithms.md sections 2
// and 4). The iterations live in iteration.h as templates over an executor, so ortho_flops() counts
// exactly the operations run() performs.
#include <algorithm>
#include <utility>
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

namespace {

// The checks run() and run_group() share; returns the resolved config.
OrthoConfig checked(const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out,
                    size_t workspace_size) {
  DM_CHECK(x.rows <= x.cols, "orthogonalizer: input must be wide (m <= n), got ", x.rows, "x",
           x.cols);
  DM_CHECK(out.rows == x.rows && out.cols == x.cols && out.count == x.count,
           "orthogonalizer: output shape differs from the input");
  OrthoConfig r = resolve(cfg, x.rows, x.cols);
  DM_CHECK(x.dtype == iteration_dtype(r), "orthogonalizer: input is ", dtype_name(x.dtype),
           " but ", algorithm_name(r), " iterates in ", dtype_name(iteration_dtype(r)));
  const size_t need = Orthogonalizer::workspace_bytes(r, x.count, x.rows, x.cols);
  DM_CHECK(x.count == 0 || workspace_size >= need, "orthogonalizer: workspace of ",
           workspace_size, " bytes, need ", need);
  return r;
}

}  // namespace

bool Orthogonalizer::same_schedule(const OrthoConfig& a, const OrthoConfig& b) {
  if (a.iteration != b.iteration || a.steps != b.steps || a.restarts != b.restarts ||
      iteration_dtype(a) != iteration_dtype(b) || a.coefficients != b.coefficients ||
      a.grouped_products != b.grouped_products)
    return false;
  // A named schedule is fixed by its name and the steps; a custom one by its rows.
  if (a.coefficients != Coefficients::kCustom) return true;
  auto same = [](const QuinticCoef& p, const QuinticCoef& q) {
    return p.a == q.a && p.b == q.b && p.c == q.c;
  };
  return std::equal(a.custom_coefficients.begin(), a.custom_coefficients.end(),
                    b.custom_coefficients.begin(), b.custom_coefficients.end(), same);
}

void Orthogonalizer::run(const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out,
                         void* workspace, size_t workspace_size, OrthoStats* stats) {
  const OrthoConfig r = checked(cfg, x, out, workspace_size);
  if (stats) {
    stats->calls += 1;
    stats->matrices += x.count;
  }
  if (x.count == 0) return;
  Carver ws{static_cast<char*>(workspace)};
  const ortho_detail::IterationBuffers bufs = ortho_detail::carve_iteration(ws, r, x);
  const int64_t parts = std::max<int64_t>(1, std::min(backend_.batch_parts(x.count), x.count));
  if (parts == 1) {
    BackendExec e{backend_, stats, r.grouped_products};
    iterate(e, r, x, out, bufs);
    return;
  }
  // Consecutive parts of the batch, each iterating on its slice of every buffer from its own
  // thread (CPU): the same operations per matrix, so the same results.
  std::vector<OrthoStats> part_stats(static_cast<size_t>(parts));
  backend_.run_parts(parts, [&](int64_t p) {
    const int64_t first = x.count * p / parts, len = x.count * (p + 1) / parts - first;
    BackendExec e{backend_, stats ? &part_stats[static_cast<size_t>(p)] : nullptr,
                  r.grouped_products};
    iterate(e, r, x.slice(first, len), out.slice(first, len), bufs.slice(first, len));
  });
  if (stats)
    for (const OrthoStats& ps : part_stats) stats->flops += ps.flops;
}

void Orthogonalizer::run_group(std::span<const GroupMember> members, OrthoStats* stats) {
  using ortho_detail::BatchGroup;
  std::vector<BatchRef> xs;
  std::vector<ortho_detail::IterationBuffers> bufs;
  const OrthoConfig* first = nullptr;
  for (const GroupMember& g : members) {
    DM_CHECK(g.cfg.iteration != Iteration::kAuto && g.cfg.grouped_products,
             "run_group: ", g.x.rows, "x", g.x.cols, "'s config must be resolved and have "
             "grouped_products set (the bits run() gives a batch alone)");
    checked(g.cfg, g.x, g.x, g.workspace_size);
    if (!first) first = &g.cfg;
    DM_CHECK(same_schedule(g.cfg, *first), "run_group: ", algorithm_name(g.cfg), " on ",
             g.x.rows, "x", g.x.cols, " does not iterate as ", algorithm_name(*first),
             " (Orthogonalizer::same_schedule)");
    if (stats) stats->matrices += g.x.count;
    if (g.x.count == 0) continue;
    Carver ws{static_cast<char*>(g.workspace)};
    bufs.push_back(ortho_detail::carve_iteration(ws, g.cfg, g.x));
    xs.push_back(g.x);
  }
  // One launch computes every member's product at once: no member may write what another
  // reads (on a device that would be a race inside one launch; the CPU would hide it).
  auto range = [](const void* p, size_t bytes) {
    const auto b = reinterpret_cast<uintptr_t>(p);
    return std::pair{b, b + bytes};
  };
  std::vector<std::pair<uintptr_t, uintptr_t>> used;
  for (const GroupMember& g : members) {
    if (g.x.count == 0) continue;
    used.push_back(range(g.x.data, g.x.bytes()));
    used.push_back(range(g.workspace, g.workspace_size));
  }
  for (size_t i = 0; i < used.size(); ++i)
    for (size_t j = i + 1; j < used.size(); ++j)
      DM_CHECK(used[i].second <= used[j].first || used[j].second <= used[i].first,
               "run_group: members ", i / 2, " and ", j / 2, " share memory (their ",
               i % 2 ? "workspace" : "input", " and ", j % 2 ? "workspace" : "input",
               "): every member needs its own");
  if (stats) stats->calls += static_cast<int64_t>(members.size());
  if (xs.empty()) return;
  // Each buffer of the iteration as a group of every member's buffer.
  auto group = [&](auto member) {
    std::vector<BatchRef> parts;
    for (const ortho_detail::IterationBuffers& b : bufs) parts.push_back(member(b));
    return BatchGroup(std::move(parts));
  };
  ortho_detail::IterationBuffersOf<BatchGroup> gb;
  gb.standard = {group([](auto& b) { return b.standard.A; }),
                 group([](auto& b) { return b.standard.B; }),
                 group([](auto& b) { return b.standard.other; })};
  gb.gram = {group([](auto& b) { return b.gram.R; }),  group([](auto& b) { return b.gram.Z; }),
             group([](auto& b) { return b.gram.T; }),  group([](auto& b) { return b.gram.Q; }),
             group([](auto& b) { return b.gram.Qn; }), group([](auto& b) { return b.gram.other; })};
  const BatchGroup x(xs);
  ortho_detail::GroupExec e{backend_, stats};
  iterate(e, *first, x, x, gb);
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
