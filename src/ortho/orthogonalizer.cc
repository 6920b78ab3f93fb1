// Newton-Schulz and Gram Newton-Schulz over the Backend interface (ALGORITHMS.md 2 and 4).
//
// Each iteration is written once as a template over an executor: BackendExec issues the
// products on the backend, FlopCounter only counts them. ortho_flops() therefore counts exactly
// the operations run() performs.
#include <algorithm>
#include <utility>

#include "distmuon/error.h"
#include "distmuon/ortho.h"

namespace distmuon {
namespace {

// Issues operations on the backend and counts their FLOPs.
struct BackendExec {
  Backend& be;
  OrthoStats* stats;

  void add(double f) {
    if (stats) stats->flops += f;
  }
  // c = alpha a b^T-or-b + beta cin, with the product known symmetric.
  void sym(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double alpha, double beta,
           const BatchRef* cin, const BatchRef& c) {
    be.gemm_symmetric(oa, a, ob, b, alpha, beta, cin, c);
    add(sym_flops(c.rows, oa == Op::kN ? a.cols : a.rows) * c.count);
  }
  void dense(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double alpha, double beta,
             const BatchRef* cin, const BatchRef& c) {
    be.gemm(oa, a, ob, b, alpha, beta, cin, c);
    add(dense_flops(c.rows, c.cols, oa == Op::kN ? a.cols : a.rows) * c.count);
  }
  void plus_identity(const BatchRef& z, double a, const BatchRef& out) {
    be.lincomb(1.0, z, 0.0, nullptr, a, out);
  }
  void copy(const BatchRef& src, const BatchRef& dst) { be.scale_copy(src, false, {}, dst); }

  static double sym_flops(int64_t m, int64_t k) { return static_cast<double>(m) * (m + 1) * k; }
  static double dense_flops(int64_t m, int64_t n, int64_t k) { return 2.0 * m * n * k; }
};

// Counts FLOPs without touching memory.
struct FlopCounter {
  double flops = 0;
  void sym(Op oa, const BatchRef& a, Op, const BatchRef&, double, double, const BatchRef*,
           const BatchRef& c) {
    flops += BackendExec::sym_flops(c.rows, oa == Op::kN ? a.cols : a.rows) * c.count;
  }
  void dense(Op oa, const BatchRef& a, Op, const BatchRef&, double, double, const BatchRef*,
             const BatchRef& c) {
    flops += BackendExec::dense_flops(c.rows, c.cols, oa == Op::kN ? a.cols : a.rows) * c.count;
  }
  void plus_identity(const BatchRef&, double, const BatchRef&) {}
  void copy(const BatchRef&, const BatchRef&) {}
};

// Carves batches out of a workspace.
struct Carver {
  char* base;
  size_t used = 0;
  BatchRef take(DType t, int64_t count, int64_t rows, int64_t cols) {
    BatchRef r = BatchRef::packed(base ? base + used : nullptr, t, count, rows, cols);
    used += (r.bytes() + 255) / 256 * 256;
    return r;
  }
};

// Standard Newton-Schulz: X <- a X + (b A + c A^2) X with A = X X^T.
template <typename Exec>
void standard_iteration(Exec& e, const OrthoConfig& cfg, bool symmetric, const BatchRef& x,
                        const BatchRef& out, Carver& ws) {
  const int64_t c = x.count, m = x.rows, n = x.cols;
  BatchRef A = ws.take(x.dtype, c, m, m), B = ws.take(x.dtype, c, m, m);
  BatchRef other = ws.take(x.dtype, c, m, n);
  BatchRef cur = x;
  auto coef = coefficient_schedule(cfg);
  for (int i = 0; i < cfg.steps; ++i) {
    const auto [a, b, cc] = coef[i];
    if (symmetric) {
      e.sym(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, nullptr, A);
      e.sym(Op::kN, A, Op::kN, A, cc, b, &A, B);
    } else {
      e.dense(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, nullptr, A);
      e.dense(Op::kN, A, Op::kN, A, cc, b, &A, B);
    }
    const bool last = i + 1 == cfg.steps;
    BatchRef next = last && out.data != cur.data ? out : (cur.data == x.data ? other : x);
    e.dense(Op::kN, B, Op::kN, cur, 1.0f, a, &cur, next);
    cur = next;
  }
  if (cur.data != out.data) e.copy(cur, out);
}

// Gram Newton-Schulz: iterate polynomials of R = X X^T in the m x m space, apply Q once.
template <typename Exec>
void gram_iteration(Exec& e, const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out,
                    Carver& ws) {
  const int64_t c = x.count, m = x.rows, n = x.cols;
  const DType t = x.dtype;
  BatchRef R = ws.take(t, c, m, m), Z = ws.take(t, c, m, m), T = ws.take(t, c, m, m);
  BatchRef Q = ws.take(t, c, m, m), Qn = ws.take(t, c, m, m);
  BatchRef other = ws.take(t, c, m, n);
  auto coef = coefficient_schedule(cfg);
  auto restarts_at = [&](int i) {
    return i > 0 && std::find(cfg.restarts.begin(), cfg.restarts.end(), i) != cfg.restarts.end();
  };
  BatchRef cur = x;
  bool have_q = false;
  e.sym(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, nullptr, R);
  for (int i = 0; i < cfg.steps; ++i) {
    const auto [a, b, cc] = coef[i];
    if (restarts_at(i) && have_q) {
      // Fold Q into X and recompute R: resets the spurious negative eigenvalues that half
      // precision leaves in R and that the recurrence would otherwise amplify.
      BatchRef next = cur.data == x.data ? other : x;
      e.dense(Op::kN, Q, Op::kN, cur, 1.0f, 0.0f, nullptr, next);
      cur = next;
      e.sym(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, nullptr, R);
      have_q = false;
    }
    e.sym(Op::kN, R, Op::kN, R, cc, b, &R, Z);  // Z = b R + c R^2 (no aI here)
    if (!have_q) {
      e.plus_identity(Z, a, Q);  // Q = Z + a I
      have_q = true;
    } else {
      e.sym(Op::kN, Q, Op::kN, Z, 1.0f, a, &Q, Qn);  // Q = Q Z + a Q
      std::swap(Q, Qn);
    }
    const bool last = i + 1 == cfg.steps;
    if (!last && !restarts_at(i + 1)) {
      e.sym(Op::kN, R, Op::kN, Z, 1.0f, a, &R, T);  // T = R Z + a R
      e.sym(Op::kN, Z, Op::kN, T, 1.0f, a, &T, R);  // R = Z T + a T
    }
  }
  if (out.data != cur.data) {
    e.dense(Op::kN, Q, Op::kN, cur, 1.0f, 0.0f, nullptr, out);
  } else {  // a product may not overwrite its own input
    BatchRef tmp = cur.data == x.data ? other : x;
    e.dense(Op::kN, Q, Op::kN, cur, 1.0f, 0.0f, nullptr, tmp);
    e.copy(tmp, out);
  }
}

template <typename Exec>
void iterate(Exec& e, const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out,
             Carver& ws) {
  switch (cfg.iteration) {
    case Iteration::kStandardDense: standard_iteration(e, cfg, false, x, out, ws); break;
    case Iteration::kStandardSym: standard_iteration(e, cfg, true, x, out, ws); break;
    case Iteration::kGram: gram_iteration(e, cfg, x, out, ws); break;
    case Iteration::kAuto: DM_FAIL("internal: unresolved auto iteration");
  }
}

}  // namespace

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
  return fc.flops;
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
  BackendExec e{backend_, stats};
  iterate(e, r, x, out, ws);
}

void Orthogonalizer::orthogonalize(const OrthoConfig& cfg, const BatchRef& u, const BatchRef& out,
                                   OrthoStats* stats) {
  DM_CHECK(u.rows == out.rows && u.cols == out.cols && u.count == out.count,
           "orthogonalize: output shape differs from the input");
  const bool tall = u.rows > u.cols;
  const int64_t m = std::min(u.rows, u.cols), n = std::max(u.rows, u.cols);
  OrthoConfig r = resolve(cfg, m, n);
  const DType t = iteration_dtype(r);
  Buffer norms = backend_.alloc(sizeof(float) * std::max<int64_t>(1, u.count));
  Buffer xbuf = backend_.alloc(static_cast<size_t>(u.count * m * n) * dtype_size(t));
  const size_t ws_bytes = workspace_bytes(r, u.count, m, n);
  Buffer ws = backend_.alloc(ws_bytes);
  BatchRef x = BatchRef::packed(xbuf.data(), t, u.count, m, n);
  backend_.frob_norm(u, norms.as<float>());
  ScaleSpec spec{norms.as<float>(), norm_multiplier(r.coefficients), r.eps, 1.0};
  backend_.scale_copy(u, tall, spec, x);
  run(r, x, x, ws.data(), ws_bytes, stats);
  backend_.scale_copy(x, tall, {}, out);
  backend_.synchronize();  // the temporaries are released on return
}

}  // namespace distmuon
