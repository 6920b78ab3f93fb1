// One CacheMuon call on a batch (docs/algorithms.md section 5), written as a template over the
// executor like the plain iterations, so that the FLOPs charged per hit and per refresh are
// exactly what the masked operations do. The passes of a call, each for what it decides:
//   1. only where the storage dtype was set apart from the work dtype: Q converted to it;
//   2. residual: exact ||Q R Q^T - I|| from R = X X^T, or k probes ||(Q R Q^T - I) W||; it is
//      also what refuses a non-finite Q (every residual is a product with Q), so Q's own norm
//      is never taken; an empty or foreign entry is told by its key, an old one by its age;
//   3. Backend::cache_gate decides hit / refresh / skip per matrix on the device (with the
//      check back-off, a plan pass before pass 2 marks the matrices due for a test; with
//      CacheGate::kBatch the call hits whole or refreshes whole);
//   4. refresh (masked): the Gram-NS solve, reusing R, writes the entry's new transform into
//      the storage itself (copied only where the storage dtype differs, a segment has a
//      single step, or in shadow mode);
//   5. hit (masked): D = Q X.
// Pass 4 is a block the device skips inside a captured graph when the gate refreshes no matrix
// of the batch and runs unmasked when it refreshes all (Backend::begin_if_some_selected); pass 2
// is one it skips when the back-off tests none (Backend::begin_if_selected).
#include <algorithm>
#include <cmath>
#include <vector>

#include "distmuon/cache.h"
#include "distmuon/error.h"
#include "ortho/cache_impl.h"
#include "ortho/iteration.h"

namespace distmuon {
namespace {

using namespace ortho_detail;

struct CachedBuffers {
  GramBuffers g;
  BatchRef P, P2;            // running product of segment transforms (kProduct, restarts)
  BatchRef qw_all;           // cached Q converted to the work dtype (when dtypes differ)
  std::vector<BatchRef> qw;  // per segment: the transforms the gate and the hits use
  BatchRef W, A, B, U;       // probes: W, two m x k scratch, U = X^T V (n x k)
  uint64_t* keys = nullptr;  // probes: each matrix's fingerprint, the key of its probe stream
  BatchRef cand, cand2;      // shadow: candidate for every matrix
  double *res = nullptr, *res_exact = nullptr;
  double *fresh_norm = nullptr, *diff_norm = nullptr, *cand_norm = nullptr;
  int32_t* decision = nullptr;
};

struct Setup {
  const OrthoConfig& cfg;
  const CacheOptions& opt;
  int segs;        // m x m matrices stored per entry (1 for kProduct)
  int solve_segs;  // segments of the fresh solve (restarts + 1)
  bool convert;    // the cache dtype differs from the work dtype
};

CachedBuffers carve_cached(Carver& ws, const Setup& s, DType t, int64_t c, int64_t m, int64_t n) {
  CachedBuffers b;
  b.g = carve_gram(ws, t, c, m, n);
  if (s.opt.layout == CacheLayout::kProduct && s.solve_segs > 1) {
    b.P = ws.take(t, c, m, m);
    b.P2 = ws.take(t, c, m, m);
  }
  if (s.convert) {
    b.qw_all = ws.take(t, c, s.segs * m, m);
    for (int k = 0; k < s.segs; ++k) {
      BatchRef v{nullptr, t, c, m, m, m, s.segs * m * m};
      if (b.qw_all.data) v.data = static_cast<char*>(b.qw_all.data) + k * m * m * dtype_size(t);
      b.qw.push_back(v);
    }
  }
  if (s.opt.residual == CacheResidual::kProbe) {
    const int64_t k = s.opt.probes;
    b.W = ws.take(t, c, m, k);
    b.A = ws.take(t, c, m, k);
    b.B = ws.take(t, c, m, k);
    b.U = ws.take(t, c, n, k);
    b.keys = ws.take_array<uint64_t>(c);
  }
  if (s.opt.shadow) {
    b.cand = ws.take(t, c, m, n);
    b.cand2 = ws.take(t, c, m, n);
  }
  b.res = ws.take_array<double>(c);
  b.res_exact = ws.take_array<double>(c);
  b.fresh_norm = ws.take_array<double>(c);
  b.diff_norm = ws.take_array<double>(c);
  if (s.opt.shadow) b.cand_norm = ws.take_array<double>(c);
  b.decision = ws.take_array<int32_t>(c);
  return b;
}

// raw_i = ||Q_i R_i Q_i^T - I||_F with Q = Q_{S-1} ... Q_0, in Gram space (no m x n product).
template <typename Exec>
void exact_residual(Exec& e, const CachedBuffers& b, double* raw) {
  BatchRef M = b.g.R;
  for (const BatchRef& q : b.qw) {
    e.dense(Op::kN, q, Op::kN, M, 1.0, 0.0, nullptr, b.g.Z);    // Z = Q_s M
    e.sym(Op::kN, b.g.Z, Op::kT, q, 1.0, 0.0, nullptr, b.g.T);  // T = Q_s M Q_s^T
    M = b.g.T;
  }
  e.plus_identity(b.g.T, -1.0, b.g.T);
  e.norm(b.g.T, raw);
}

// raw_i = ||(Q R Q^T - I) W||_F for k Gaussian probes W, without forming R: O(m n k). Each
// matrix's probes are keyed by its input's fingerprint: they depend on the matrix alone, not on
// the batch it is in or on how many calls came before, so every mode (whose inputs are the same
// bits) draws them, and decides, as one process does.
template <typename Exec>
void probe_residual(Exec& e, const CachedBuffers& b, const BatchRef& x, uint64_t seed,
                    double* raw) {
  e.fingerprint(x, b.keys);
  e.normal(b.W, seed, b.keys);
  auto flip = [&](const BatchRef& cur) { return cur.data == b.A.data ? b.B : b.A; };
  BatchRef cur = b.W;
  for (size_t s = b.qw.size(); s-- > 0;) {  // V = Q^T W = Q_0^T ... Q_{S-1}^T W
    BatchRef next = flip(cur);
    e.dense(Op::kT, b.qw[s], Op::kN, cur, 1.0, 0.0, nullptr, next);
    cur = next;
  }
  e.dense(Op::kT, x, Op::kN, cur, 1.0, 0.0, nullptr, b.U);  // U = X^T V
  BatchRef y = flip(cur);
  e.dense(Op::kN, x, Op::kN, b.U, 1.0, 0.0, nullptr, y);  // Y = X U = R V
  cur = y;
  for (size_t s = 0; s < b.qw.size(); ++s) {  // Q Y - W
    const bool last = s + 1 == b.qw.size();
    BatchRef next = flip(cur);
    e.dense(Op::kN, b.qw[s], Op::kN, cur, 1.0, last ? -1.0 : 0.0, last ? &b.W : nullptr, next);
    cur = next;
  }
  e.norm(cur, raw);
}

// dst = Q_{S-1} ... Q_0 src, alternating between scratch a and b (b may alias src, which is
// only read by the first product).
template <typename Exec>
void apply_chain(Exec& e, const std::vector<BatchRef>& q, const BatchRef& src, const BatchRef& dst,
                 const BatchRef& a, const BatchRef& b) {
  BatchRef cur = src;
  for (size_t s = 0; s < q.size(); ++s) {
    BatchRef next = cur.data == a.data ? b : a;
    if (s + 1 == q.size() && dst.data != cur.data) next = dst;
    e.dense(Op::kN, q[s], Op::kN, cur, 1.0, 0.0, nullptr, next);
    cur = next;
  }
  if (cur.data != dst.data) e.copy(cur, dst);
}

// The fresh Gram-NS solve with R already in b.g.R; it leaves the entry's new transform(s) in
// the cache storage `target` (one batch per stored segment). With `direct` (the solve runs
// under the refresh mask, which keeps the hits' entries untouched, and the storage has the
// work dtype) the products write there themselves; otherwise store(src, dst) copies.
template <typename Exec, typename Store>
void fresh_solve(Exec& e, const Setup& s, const CachedBuffers& b, const BatchRef& x,
                 const BatchRef& out, const std::vector<BatchRef>& target, bool direct,
                 Store&& store) {
  const bool compose = s.opt.layout == CacheLayout::kProduct && s.solve_segs > 1;
  std::vector<BatchRef> q_out;
  if (compose)
    q_out = {b.P};  // Q_0 starts the running product in place
  else if (direct)
    q_out = target;
  BatchRef P = b.P, P2 = b.P2;
  auto on_segment = [&](int k, const BatchRef& q) {
    if (!compose) {
      if (q.data != target[k].data) store(q, target[k]);
      return;
    }
    if (k == 0) {
      if (q.data != P.data) e.copy(q, P);
      return;
    }
    // P <- Q_k P as a symmetric product, one triangle (m^3; a dense product costs 2 m^3). The
    // two commute: Q_k is a polynomial of R_k = P R_0 P and P one of R_0. Computed in floating
    // point they commute up to rounding, so one triangle errs by about the product's own
    // rounding; and the gate measures the stored P before any reuse. Keeping the factors
    // instead (CacheLayout::kFactors) saves this m^3 per refresh but costs 2 m^2 n more per
    // hit: it pays only below m / n hits per refresh.
    const bool final = k + 1 == s.solve_segs;
    const BatchRef dst = final && direct ? target[0] : P2;
    e.sym(Op::kN, q, Op::kN, P, 1.0, 0.0, nullptr, dst);
    if (final && !direct) store(dst, target[0]);
    std::swap(P, P2);
  };
  gram_iteration(e, s.cfg, x, out, b.g, true, on_segment, q_out);
}

struct Call {
  BatchRef q_entries;           // cache storage of the batch's entries, (segs m) x m each
  std::vector<BatchRef> q_seg;  // cache storage per stored segment
  CacheGateArgs gate;
};

template <typename Exec>
void cached_flow(Exec& e, const Setup& s, const Call& call, const CachedBuffers& b,
                 const BatchRef& x, const BatchRef& out) {
  if (s.convert) e.convert(call.q_entries, b.qw_all);
  const bool exact = s.opt.residual == CacheResidual::kExact;
  // Blocks the device skips open only where the masked products inside them can be captured
  // (Backend::masked_capturable): one that reads the flags on the host fails the capture, and a
  // failed capture with an open block cannot be cleaned up.
  const bool blocks = e.masked_capturable(x.dtype);
  // R = X X^T starts the exact test and every refresh, so every matrix pays for it.
  if (exact) e.sym(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, b.g.R);
  // With the check back-off, the test is a block the device skips (inside a captured graph)
  // when no matrix is due for it; a plan pass of the gate marks the ones that are. Where no
  // block can open the plan would be a wasted launch: the gate applies the back-off either way.
  bool test_block = false;
  if (s.opt.check_backoff > 1 && blocks) {
    CacheGateArgs plan = call.gate;
    plan.plan = true;
    e.gate(plan);
    test_block = e.begin_if_selected(BatchMask{b.decision, kCacheCheck}, x.count);
  }
  e.charge_to(kCacheCheck);
  if (exact)
    exact_residual(e, b, b.res);
  else
    probe_residual(e, b, x, s.opt.seed, b.res);
  e.clear_mask();
  if (test_block) e.end_if_selected();
  e.gate(call.gate);
  // The refresh path is a block the device skips, inside a captured graph, when the gate sent
  // no matrix down it: a call of hits then costs its test and one product, without the
  // solve's ~20 launches. The hit path (one masked product) is not: a conditional node costs
  // about 10 us on the H200, more than one launch that finds no work (3-5 us).
  // When the gate sends every matrix down it, the block's second body runs the solve unmasked:
  // the tuned kernels of a plain solve (cuBLASLt for Q X) instead of the masked ones, so that
  // a batch that refreshes whole costs a fresh solve plus its test (12 x 384 x 1536 on the
  // H200: 1.07-1.25x a fresh solve, 1.18-1.38x through the masked solve).
  auto refresh = [&] {
    // Probe mode never formed R: only the refreshed matrices pay for it.
    if (!exact) e.sym(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, b.g.R);
    fresh_solve(e, s, b, x, out, call.q_seg, !s.convert,
                [&](const BatchRef& src, const BatchRef& dst) { e.copy(src, dst); });
  };
  e.set_mask(b.decision, kCacheRefresh);
  const bool refresh_block =
      blocks && e.begin_if_some_selected(BatchMask{b.decision, kCacheRefresh}, x.count);
  refresh();
  if (refresh_block) {
    e.else_if_all_selected();
    e.clear_mask();
    refresh();
    e.end_if_selected();
  }
  e.set_mask(b.decision, kCacheHit);
  apply_chain(e, b.qw, x, out, b.g.other, x);
  e.clear_mask();
}

// Shadow mode: the same decisions and outputs, plus the fresh solve for every matrix, so the
// accepted update can be compared with the fresh one. Synchronises to read the comparison.
void shadow_flow(BackendExec& e, const Setup& s, const Call& call, const CachedBuffers& b,
                 const BatchRef& x, const BatchRef& out, TransformCache::Impl& ci, int64_t first) {
  Backend& be = e.be;
  if (s.convert) e.convert(call.q_entries, b.qw_all);
  e.sym(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, b.g.R);
  exact_residual(e, b, b.res_exact);
  const bool probe = s.opt.residual == CacheResidual::kProbe;
  if (probe) probe_residual(e, b, x, s.opt.seed, b.res);
  CacheGateArgs gate = call.gate;
  gate.residual = probe ? b.res : b.res_exact;
  e.gate(gate);
  apply_chain(e, b.qw, x, b.cand, b.g.other, b.cand2);  // x stays intact
  const BatchMask refresh{b.decision, kCacheRefresh}, hit{b.decision, kCacheHit};
  fresh_solve(e, s, b, x, out, call.q_seg, false,  // unmasked: every entry goes through a copy
              [&](const BatchRef& src, const BatchRef& dst) { be.copy_masked(refresh, src, dst); });
  e.norm(out, b.fresh_norm);
  e.norm(b.cand, b.cand_norm);
  be.lincomb(1.0, b.cand, -1.0, &out, 0.0, b.cand2);
  e.norm(b.cand2, b.diff_norm);
  be.copy_masked(hit, b.cand, out);

  const size_t c = static_cast<size_t>(x.count);
  std::vector<int32_t> dec(c);
  std::vector<double> res(c), exact(c), fresh(c), diff(c), cand(c);
  be.synchronize();
  be.copy_to_host(cand.data(), b.cand_norm, c * sizeof(double));
  be.copy_to_host(dec.data(), b.decision, c * sizeof(int32_t));
  be.copy_to_host(res.data(), gate.residual, c * sizeof(double));
  be.copy_to_host(exact.data(), b.res_exact, c * sizeof(double));
  be.copy_to_host(fresh.data(), b.fresh_norm, c * sizeof(double));
  be.copy_to_host(diff.data(), b.diff_norm, c * sizeof(double));
  for (size_t i = 0; i < c; ++i) {
    const size_t k = static_cast<size_t>(first) + i;
    if (dec[i] != kCacheHit) continue;
    const double err = fresh[i] > 0 ? diff[i] / fresh[i] : diff[i];
    // cos(D, O) from the three norms: ||D - O||^2 = ||D||^2 + ||O||^2 - 2 <D, O>.
    const double d = cand[i], o = fresh[i], dd = diff[i];
    const double cos =
        d > 0 && o > 0 ? std::clamp((d * d + o * o - dd * dd) / (2 * d * o), -1.0, 1.0) : 0.0;
    ci.sh_sum[k] += err;
    ci.sh_max[k] = std::max(ci.sh_max[k], err);
    ci.sh_cos_sum[k] += cos;
    ci.sh_cos_min[k] = std::min(ci.sh_cos_min[k], cos);
    ci.sh_n[k] += 1;
    ci.sh_last_err[k] = err;
    ci.sh_last_cos[k] = cos;
    ci.sh_seen[k] = 1;
    if (probe && exact[i] > 0 && std::isfinite(res[i])) {
      const double ratio = (res[i] * gate.residual_scale) / (exact[i] / std::sqrt(double(x.rows)));
      ci.pr_min = std::min(ci.pr_min, ratio);
      ci.pr_max = std::max(ci.pr_max, ratio);
      ci.pr_sum += ratio;
      ci.pr_n += 1;
    }
  }
}

Setup make_setup(const OrthoConfig& r, const CacheOptions& o, DType qtype, DType work) {
  const int solve_segs = gram_segments(r);
  const int segs = o.layout == CacheLayout::kProduct ? 1 : solve_segs;
  return Setup{r, o, segs, solve_segs, qtype != work};
}

}  // namespace

size_t Orthogonalizer::cached_workspace_bytes(const OrthoConfig& cfg, const CacheOptions& o,
                                              int64_t count, int64_t m, int64_t n) {
  OrthoConfig r = resolve(cfg, m, n);
  DM_CHECK(r.iteration == Iteration::kGram, "CacheMuon needs Gram NS");
  Carver ws{nullptr};
  Setup s = make_setup(r, o, cache_storage_dtype(o, r), iteration_dtype(r));
  carve_cached(ws, s, iteration_dtype(r), count, m, n);
  return ws.used;
}

void Orthogonalizer::run_cached(const OrthoConfig& cfg, TransformCache& cache, int64_t first,
                                const BatchRef& x, const BatchRef& out, const int32_t* status,
                                void* workspace, size_t workspace_size, OrthoStats* stats) {
  TransformCache::Impl& ci = *cache.impl_;
  const int64_t c = x.count, m = x.rows, n = x.cols;
  DM_CHECK(m <= n, "run_cached: input must be wide (m <= n), got ", m, "x", n);
  DM_CHECK(out.rows == m && out.cols == n && out.count == c,
           "run_cached: output shape differs from the input");
  OrthoConfig r = resolve(cfg, m, n);
  DM_CHECK(r.iteration == Iteration::kGram, "CacheMuon reuses the Gram-NS transform, but ", m, "x",
           n, " resolves to ", algorithm_name(r));
  const DType t = iteration_dtype(r);
  DM_CHECK(x.dtype == t, "run_cached: input is ", dtype_name(x.dtype), " but ", algorithm_name(r),
           " iterates in ", dtype_name(t));
  DM_CHECK(
      ci.prepared && ci.m == m && ci.n == n && ci.key == cache_key(r, m, n, ci.qtype, ci.layout),
      "run_cached: the cache is not prepared for ", algorithm_name(r), " on ", m, "x", n, " in ",
      dtype_name(t), " (call TransformCache::prepare)");
  DM_CHECK(first >= 0 && first + c <= ci.count, "run_cached: entries [", first, ", ", first + c,
           ") outside the cache's ", ci.count);
  validate(ci.opt, "cache");
  if (stats) {
    stats->calls += 1;
    stats->matrices += c;
  }
  if (c == 0) return;
  CacheOptions o = ci.opt;
  o.layout = ci.layout;  // the storage decides
  const Setup s = make_setup(r, o, ci.qtype, t);
  const size_t need = cached_workspace_bytes(r, o, c, m, n);
  DM_CHECK(workspace_size >= need, "run_cached: workspace of ", workspace_size, " bytes, need ",
           need);

  // FLOPs per matrix of each path, from the same flow with a counting executor.
  FlopCounter fc;
  {
    Carver cw{nullptr};
    CachedBuffers fb = carve_cached(cw, s, t, 1, m, n);
    Call fcall;
    fcall.q_seg.assign(s.segs, BatchRef{nullptr, ci.qtype, 1, m, m, m, s.segs * m * m});
    if (!s.convert) fb.qw = fcall.q_seg;
    BatchRef x1 = BatchRef::packed(nullptr, t, 1, m, n);
    cached_flow(fc, s, fcall, fb, x1, x1);
  }
  ci.charge(fc.bucket[1 + kCacheCheck], fc.bucket[1 + kCacheHit], fc.bucket[1 + kCacheRefresh]);
  ci.calls += 1;
  ci.matrices += c;
  ci.flops_fixed += fc.bucket[0] * c;
  ci.flops_fresh += ortho_flops(r, m, n) * c;

  Carver ws{static_cast<char*>(workspace)};
  CachedBuffers b = carve_cached(ws, s, t, c, m, n);
  Call call;
  call.q_entries = ci.q_entries(first, c);
  for (int k = 0; k < s.segs; ++k) call.q_seg.push_back(ci.q_segment(first, c, k));
  if (!s.convert) b.qw = call.q_seg;
  CacheGateArgs& g = call.gate;
  g.count = c;
  g.residual = b.res;
  g.residual_scale = 1.0 / std::sqrt(static_cast<double>(m) *
                                     (o.residual == CacheResidual::kProbe ? o.probes : 1));
  g.status = status;
  g.key = ci.key;
  g.entry_key = ci.key_at(first);
  g.age = ci.age_at(first);
  g.max_age = o.max_staleness;
  g.gamma = o.gamma;
  g.misses = ci.misses_at(first);
  g.backoff = o.check_backoff;
  g.batch = o.gate == CacheGate::kBatch;
  g.decision = b.decision;
  g.stats = ci.stats_at(first);

  BackendExec e{backend_, nullptr, r.grouped_products};
  ci.dirty = true;
  if (o.shadow)
    shadow_flow(e, s, call, b, x, out, ci, first);
  else
    cached_flow(e, s, call, b, x, out);
}

}  // namespace distmuon
