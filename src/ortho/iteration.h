// The iterations of the orthogonalizer written once as templates over an executor
// (docs/algorithms.md sections 2 and 4). BackendExec issues the operations on a backend,
// FlopCounter only counts them, so every FLOP figure equals what a run performs. Shared by the
// plain run (orthogonalizer.cc) and the CacheMuon run (cached_run.cc).
#pragma once

#include <algorithm>
#include <array>
#include <numeric>
#include <utility>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/error.h"
#include "distmuon/ortho.h"

namespace distmuon::ortho_detail {

inline double sym_flops(int64_t m, int64_t k) { return static_cast<double>(m) * (m + 1) * k; }
inline double dense_flops(int64_t m, int64_t n, int64_t k) { return 2.0 * m * n * k; }
inline int64_t inner(Op oa, const BatchRef& a) { return oa == Op::kN ? a.cols : a.rows; }
// Counted FLOPs of C = op(A) op(B) over a batch: one triangle when symmetric.
inline double product_flops(bool symmetric, Op oa, const BatchRef& a, const BatchRef& c) {
  const int64_t k = inner(oa, a);
  return (symmetric ? sym_flops(c.rows, k) : dense_flops(c.rows, c.cols, k)) * c.count;
}

// Issues operations on the backend. While a mask is set, products and copies touch only the
// selected matrices; their FLOPs are then not added here (the caller accounts for them once
// it knows how many matrices were selected, see FlopCounter buckets).
struct BackendExec {
  Backend& be;
  OrthoStats* stats = nullptr;
  bool grouped = false;  // unmasked products through gemm_grouped (OrthoConfig::grouped_products)
  BatchMask mask{};
  bool masked = false;

  void set_mask(const int32_t* flags, int32_t value) {
    mask = BatchMask{flags, value};
    masked = true;
  }
  void clear_mask() { masked = false; }
  void add(double f) {
    if (stats && !masked) stats->flops += f;
  }
  void sym(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double alpha, double beta,
           const BatchRef* cin, const BatchRef& c) {
    if (masked)
      be.gemm_masked(mask, true, oa, a, ob, b, alpha, beta, cin, c);
    else if (grouped)
      grouped_product(oa, a, ob, b, alpha, beta, cin, c);
    else
      be.gemm_symmetric(oa, a, ob, b, alpha, beta, cin, c);
    add(product_flops(true, oa, a, c));
  }
  void dense(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double alpha, double beta,
             const BatchRef* cin, const BatchRef& c) {
    if (masked)
      be.gemm_masked(mask, false, oa, a, ob, b, alpha, beta, cin, c);
    else if (grouped)
      grouped_product(oa, a, ob, b, alpha, beta, cin, c);
    else
      be.gemm(oa, a, ob, b, alpha, beta, cin, c);
    add(product_flops(false, oa, a, c));
  }
  // A group of one: the same kernel as the batch's share of a run_group launch, so a batch
  // orthogonalized alone gets the bits it gets in a group.
  void grouped_product(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double alpha,
                       double beta, const BatchRef* cin, const BatchRef& c) {
    const GemmProblem p{oa, a, ob, b, alpha, beta, cin ? *cin : BatchRef{}, c};
    be.gemm_grouped({&p, 1});
  }
  // out = z + a I. Never masked: it only writes m x m workspace, which unselected matrices
  // do not read afterwards.
  void plus_identity(const BatchRef& z, double a, const BatchRef& out) {
    be.lincomb(1.0, z, 0.0, nullptr, a, out);
  }
  void copy(const BatchRef& src, const BatchRef& dst) {
    if (masked)
      be.copy_masked(mask, src, dst);
    else
      be.scale_copy(src, false, {}, dst);
  }
  // Operations without FLOPs of interest; never masked.
  void convert(const BatchRef& src, const BatchRef& dst) { be.scale_copy(src, false, {}, dst); }
  void norm(const BatchRef& a, double* out) { be.frob_norm(a, out); }
  void fingerprint(const BatchRef& x, uint64_t* keys) { be.fingerprint(x, keys); }
  void normal(const BatchRef& dst, uint64_t seed, const uint64_t* keys) {
    be.fill_normal_keyed(dst, seed, keys);
  }
  void gate(const CacheGateArgs& args) { be.cache_gate(args); }
  bool masked_capturable(DType t) const { return be.masked_capturable(t); }
  // A block the device skips when `m` selects none of `count` matrices (inside a graph the
  // backend captures; elsewhere it runs, and its masked operations find no work).
  bool begin_if_selected(const BatchMask& m, int64_t count) {
    return be.begin_if_selected(m, count);
  }
  // The same with a second body, after else_if_all_selected, for when all of them are selected.
  bool begin_if_some_selected(const BatchMask& m, int64_t count) {
    return be.begin_if_some_selected(m, count);
  }
  void else_if_all_selected() { be.else_if_all_selected(); }
  void end_if_selected() { be.end_if_selected(); }
  // The operations that follow run unmasked but cost only matrices of decision `value` on an
  // ideal device (FlopCounter charges them so; clear_mask ends it).
  void charge_to(int32_t) {}
};

// Counts FLOPs without touching memory, in one bucket per mask state: bucket 0 for unmasked
// operations, bucket 1 + v for operations masked (or charged) to decision v (a CacheDecision).
struct FlopCounter {
  std::array<double, 5> bucket{};
  int current = 0;

  void set_mask(const int32_t*, int32_t value) { current = 1 + value; }
  void charge_to(int32_t value) { current = 1 + value; }
  void clear_mask() { current = 0; }
  double total() const { return std::accumulate(bucket.begin(), bucket.end(), 0.0); }
  void sym(Op oa, const BatchRef& a, Op, const BatchRef&, double, double, const BatchRef*,
           const BatchRef& c) {
    bucket[current] += product_flops(true, oa, a, c);
  }
  void dense(Op oa, const BatchRef& a, Op, const BatchRef&, double, double, const BatchRef*,
             const BatchRef& c) {
    bucket[current] += product_flops(false, oa, a, c);
  }
  void plus_identity(const BatchRef&, double, const BatchRef&) {}
  void copy(const BatchRef&, const BatchRef&) {}
  void convert(const BatchRef&, const BatchRef&) {}
  void norm(const BatchRef&, double*) {}
  void fingerprint(const BatchRef&, uint64_t*) {}
  void normal(const BatchRef&, uint64_t, const uint64_t*) {}
  void gate(const CacheGateArgs&) {}
  bool masked_capturable(DType) const { return false; }
  bool begin_if_selected(const BatchMask&, int64_t) { return false; }
  bool begin_if_some_selected(const BatchMask&, int64_t) { return false; }
  void else_if_all_selected() {}
  void end_if_selected() {}
};

// Batches of several shapes that iterate as one (Orthogonalizer::run_group): part i is batch i's
// buffer. `data` is part 0's, so that the iterations' tests of which buffer holds what (they
// swap buffers of every part together) read as for one batch.
struct BatchGroup {
  std::vector<BatchRef> parts;
  void* data = nullptr;
  explicit BatchGroup(std::vector<BatchRef> p = {})
      : parts(std::move(p)), data(parts.empty() ? nullptr : parts[0].data) {}
};

// Issues each operation once for every part of a group: products as one gemm_grouped call, the
// identity terms as one lincomb_grouped call, copies (rare: an output that is the input) per
// part. Plain solves only: no masks.
struct GroupExec {
  Backend& be;
  OrthoStats* stats = nullptr;

  void product(bool symmetric, Op oa, const BatchGroup& a, Op ob, const BatchGroup& b,
               double alpha, double beta, const BatchGroup* cin, const BatchGroup& c) {
    std::vector<GemmProblem> problems;
    problems.reserve(c.parts.size());
    for (size_t i = 0; i < c.parts.size(); ++i) {
      const BatchRef& ci = c.parts[i];
      problems.push_back({oa, a.parts[i], ob, b.parts[i], alpha, beta,
                          cin ? cin->parts[i] : BatchRef{}, ci});
      if (stats) stats->flops += product_flops(symmetric, oa, a.parts[i], ci);
    }
    be.gemm_grouped(problems);
  }
  void sym(Op oa, const BatchGroup& a, Op ob, const BatchGroup& b, double alpha, double beta,
           const BatchGroup* cin, const BatchGroup& c) {
    product(true, oa, a, ob, b, alpha, beta, cin, c);
  }
  void dense(Op oa, const BatchGroup& a, Op ob, const BatchGroup& b, double alpha, double beta,
             const BatchGroup* cin, const BatchGroup& c) {
    product(false, oa, a, ob, b, alpha, beta, cin, c);
  }
  void plus_identity(const BatchGroup& z, double a, const BatchGroup& out) {
    std::vector<LincombProblem> terms;
    terms.reserve(z.parts.size());
    for (size_t i = 0; i < z.parts.size(); ++i)
      terms.push_back({1.0, z.parts[i], 0.0, BatchRef{}, a, out.parts[i]});
    be.lincomb_grouped(terms);
  }
  void copy(const BatchGroup& src, const BatchGroup& dst) {
    for (size_t i = 0; i < src.parts.size(); ++i)
      be.scale_copy(src.parts[i], false, {}, dst.parts[i]);
  }
};

// Carves 256-byte aligned batches out of a workspace (base null: only measures).
struct Carver {
  char* base;
  size_t used = 0;
  BatchRef take(DType t, int64_t count, int64_t rows, int64_t cols) {
    BatchRef r = BatchRef::packed(base ? base + used : nullptr, t, count, rows, cols);
    used += (r.bytes() + 255) / 256 * 256;
    return r;
  }
  template <typename T>
  T* take_array(int64_t n) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (static_cast<size_t>(n) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
};

// Whether Gram NS restarts (folds Q into X and recomputes R) before step i.
inline bool restarts_at(const OrthoConfig& cfg, int i) {
  return i > 0 && i < cfg.steps &&
         std::find(cfg.restarts.begin(), cfg.restarts.end(), i) != cfg.restarts.end();
}

// Number of segments (restarts + 1) of a Gram-NS solve: the factors of its total transform.
inline int gram_segments(const OrthoConfig& cfg) {
  int s = 1;
  for (int i = 1; i < cfg.steps; ++i) s += restarts_at(cfg, i) ? 1 : 0;
  return s;
}

// The iterations' buffers, of one batch (BatchRef) or of a group (BatchGroup).
template <typename Batch>
struct GramBuffersOf {
  Batch R, Z, T, Q, Qn, other;  // five m x m and one m x n, all in the work dtype
  GramBuffersOf slice(int64_t first, int64_t n) const {
    return {R.slice(first, n),  Z.slice(first, n),  T.slice(first, n),
            Q.slice(first, n),  Qn.slice(first, n), other.slice(first, n)};
  }
};
using GramBuffers = GramBuffersOf<BatchRef>;

inline GramBuffers carve_gram(Carver& ws, DType t, int64_t c, int64_t m, int64_t n) {
  GramBuffers b;
  b.R = ws.take(t, c, m, m);
  b.Z = ws.take(t, c, m, m);
  b.T = ws.take(t, c, m, m);
  b.Q = ws.take(t, c, m, m);
  b.Qn = ws.take(t, c, m, m);
  b.other = ws.take(t, c, m, n);
  return b;
}

template <typename Batch>
struct StandardBuffersOf {
  Batch A, B, other;  // two m x m and one m x n, in the work dtype
  StandardBuffersOf slice(int64_t first, int64_t n) const {
    return {A.slice(first, n), B.slice(first, n), other.slice(first, n)};
  }
};
using StandardBuffers = StandardBuffersOf<BatchRef>;

inline StandardBuffers carve_standard(Carver& ws, DType t, int64_t c, int64_t m, int64_t n) {
  StandardBuffers b;
  b.A = ws.take(t, c, m, m);
  b.B = ws.take(t, c, m, m);
  b.other = ws.take(t, c, m, n);
  return b;
}

// Standard Newton-Schulz: X <- a X + (b A + c A^2) X with A = X X^T.
template <typename Exec, typename Batch>
void standard_iteration(Exec& e, const OrthoConfig& cfg, bool symmetric, const Batch& x,
                        const Batch& out, const StandardBuffersOf<Batch>& bufs) {
  const Batch A = bufs.A, B = bufs.B, other = bufs.other;
  const Batch* none = nullptr;
  Batch cur = x;
  auto coef = coefficient_schedule(cfg);
  for (int i = 0; i < cfg.steps; ++i) {
    const auto [a, b, cc] = coef[i];
    if (symmetric) {
      e.sym(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, none, A);
      e.sym(Op::kN, A, Op::kN, A, cc, b, &A, B);
    } else {
      e.dense(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, none, A);
      e.dense(Op::kN, A, Op::kN, A, cc, b, &A, B);
    }
    const bool last = i + 1 == cfg.steps;
    Batch next = last && out.data != cur.data ? out : (cur.data == x.data ? other : x);
    e.dense(Op::kN, B, Op::kN, cur, 1.0f, a, &cur, next);
    cur = next;
  }
  if (cur.data != out.data) e.copy(cur, out);
}

// Gram Newton-Schulz: iterate polynomials of R = X X^T in the m x m space, apply Q once.
// With r_ready, bufs.R already holds X X^T (CacheMuon computed it for its gate). After each
// segment (a restart or the end) on_segment(s, Q_s) sees that segment's left transform; the
// total transform is Q_last ... Q_0. Where q_out[s] has data, the last product of segment s
// writes Q_s there instead of the workspace (CacheMuon: straight into the cache storage, with
// no copy); a segment of one step has no product and leaves Q_s in the workspace.
template <typename Exec, typename Batch, typename OnSegment>
void gram_iteration(Exec& e, const OrthoConfig& cfg, const Batch& x, const Batch& out,
                    const GramBuffersOf<Batch>& bufs, bool r_ready, OnSegment&& on_segment,
                    const std::vector<Batch>& q_out = {}) {
  Batch R = bufs.R, Z = bufs.Z, T = bufs.T, Q = bufs.Q, Qn = bufs.Qn, other = bufs.other;
  Batch seg_q = Q;  // the segment's Q: Q, or q_out[segment] once its last product ran
  const Batch* none = nullptr;
  auto coef = coefficient_schedule(cfg);
  Batch cur = x;
  bool have_q = false;
  int segment = 0;
  if (!r_ready) e.sym(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, none, R);
  for (int i = 0; i < cfg.steps; ++i) {
    const auto [a, b, cc] = coef[i];
    if (restarts_at(cfg, i) && have_q) {
      // Fold Q into X and recompute R: resets the spurious negative eigenvalues that half
      // precision leaves in R and that the recurrence would otherwise amplify.
      on_segment(segment++, seg_q);
      Batch next = cur.data == x.data ? other : x;
      e.dense(Op::kN, seg_q, Op::kN, cur, 1.0f, 0.0f, none, next);
      cur = next;
      e.sym(Op::kN, cur, Op::kT, cur, 1.0f, 0.0f, none, R);
      have_q = false;
    }
    const bool last = i + 1 == cfg.steps;
    const bool segment_ends = last || restarts_at(cfg, i + 1);
    e.sym(Op::kN, R, Op::kN, R, cc, b, &R, Z);  // Z = b R + c R^2 (no aI here)
    if (!have_q) {
      e.plus_identity(Z, a, Q);  // Q = Z + a I
      have_q = true;
      seg_q = Q;
    } else {
      const bool direct = segment_ends && segment < static_cast<int>(q_out.size()) &&
                          q_out[segment].data != nullptr;
      e.sym(Op::kN, Q, Op::kN, Z, 1.0f, a, &Q, direct ? q_out[segment] : Qn);  // Q Z + a Q
      if (direct) {
        seg_q = q_out[segment];
      } else {
        std::swap(Q, Qn);
        seg_q = Q;
      }
    }
    if (!segment_ends) {
      e.sym(Op::kN, R, Op::kN, Z, 1.0f, a, &R, T);  // T = R Z + a R
      e.sym(Op::kN, Z, Op::kN, T, 1.0f, a, &T, R);  // R = Z T + a T
    }
  }
  on_segment(segment, seg_q);
  if (out.data != cur.data) {
    e.dense(Op::kN, seg_q, Op::kN, cur, 1.0f, 0.0f, none, out);
  } else {  // a product may not overwrite its own input
    Batch tmp = cur.data == x.data ? other : x;
    e.dense(Op::kN, seg_q, Op::kN, cur, 1.0f, 0.0f, none, tmp);
    e.copy(tmp, out);
  }
}

// The workspace buffers of one iteration over a batch, carved once; slice(first, n) gives the
// buffers of matrices [first, first + n), so that parts of a batch can iterate independently.
template <typename Batch>
struct IterationBuffersOf {
  StandardBuffersOf<Batch> standard;
  GramBuffersOf<Batch> gram;
  IterationBuffersOf slice(int64_t first, int64_t n) const {
    return {standard.slice(first, n), gram.slice(first, n)};
  }
};
using IterationBuffers = IterationBuffersOf<BatchRef>;

inline IterationBuffers carve_iteration(Carver& ws, const OrthoConfig& cfg, const BatchRef& x) {
  IterationBuffers b;
  switch (cfg.iteration) {
    case Iteration::kStandardDense:
    case Iteration::kStandardSym:
      b.standard = carve_standard(ws, x.dtype, x.count, x.rows, x.cols);
      break;
    case Iteration::kGram:
      b.gram = carve_gram(ws, x.dtype, x.count, x.rows, x.cols);
      break;
    case Iteration::kAuto:
      DM_FAIL("internal: unresolved auto iteration");
  }
  return b;
}

template <typename Exec, typename Batch, typename Buffers>
void iterate(Exec& e, const OrthoConfig& cfg, const Batch& x, const Batch& out,
             const Buffers& bufs) {
  switch (cfg.iteration) {
    case Iteration::kStandardDense:
      standard_iteration(e, cfg, false, x, out, bufs.standard);
      break;
    case Iteration::kStandardSym:
      standard_iteration(e, cfg, true, x, out, bufs.standard);
      break;
    case Iteration::kGram:
      gram_iteration(e, cfg, x, out, bufs.gram, false, [](int, const Batch&) {});
      break;
    case Iteration::kAuto:
      DM_FAIL("internal: unresolved auto iteration");
  }
}

template <typename Exec>
void iterate(Exec& e, const OrthoConfig& cfg, const BatchRef& x, const BatchRef& out, Carver& ws) {
  iterate(e, cfg, x, out, carve_iteration(ws, cfg, x));
}

}  // namespace distmuon::ortho_detail
