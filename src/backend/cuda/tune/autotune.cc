// The autotuner (see autotune.h).
#include "backend/cuda/tune/autotune.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "backend/cuda/launch/launchers.h"
#include "distmuon/error.h"

namespace distmuon::cuda {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

namespace {

// ||a - b||_F / ||b||_F over a whole batch, computed on the device (scratch: a copy of a).
double rel_err_device(CudaBackend& be, const BatchRef& a, const BatchRef& b, const BatchRef& scratch) {
  be.lincomb(1.0, a, -1.0, &b, 0.0, scratch);
  Buffer norms = be.alloc(sizeof(double) * 2 * std::max<int64_t>(1, a.count));
  be.frob_norm(scratch, norms.as<double>());
  be.frob_norm(b, norms.as<double>() + a.count);
  std::vector<double> h(2 * a.count);
  be.copy_to_host(h.data(), norms.data(), h.size() * sizeof(double));
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.count; ++i) {
    num += double(h[i]) * h[i];
    den += double(h[a.count + i]) * h[a.count + i];
  }
  const double r = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  return std::isfinite(r) ? r : INFINITY;
}

bool exactly_symmetric(CudaBackend& be, const BatchRef& c) {
  const size_t es = dtype_size(c.dtype);
  std::vector<uint8_t> h(static_cast<size_t>(c.rows * c.ld) * es);
  be.copy_to_host(h.data(), c.data, h.size());
  for (int64_t i = 0; i < c.rows; ++i)
    for (int64_t j = 0; j < i; ++j)
      if (std::memcmp(&h[(i * c.ld + j) * es], &h[(j * c.ld + i) * es], es) != 0) return false;
  return true;
}

}  // namespace

SymChoice tune_sym(CudaBackend& be, int64_t m, int64_t k, int64_t count, DType dtype,
                   const TuneOptions& opt) {
  SymChoice best;
  best.m = m;
  best.k = k;
  best.count = count;
  best.dtype = dtype;
  BatchRef x = BatchRef::packed(nullptr, dtype, count, m, k);
  Buffer xb = be.alloc(x.bytes());
  x.data = xb.data();
  launch_fill_normal(x.data, dtype, count * m * k, 0x5eed + m * 31 + k, 1.0f / std::sqrt(double(k)),
                     be.stream());
  BatchRef ref = BatchRef::packed(nullptr, dtype, count, m, m), out = ref, tmp = ref;
  Buffer rb = be.alloc(ref.bytes()), ob = be.alloc(ref.bytes()), tb = be.alloc(ref.bytes());
  ref.data = rb.data();
  out.data = ob.data();
  tmp.data = tb.data();
  const SymKernel saved = be.sym_kernel();
  be.set_sym_kernel(SymKernel::kDenseMirror);
  best.dense_ms = time_ms(be, opt.repeats, [&] {
    be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, ref);
  });
  best.kernel = SymKernel::kDenseMirror;
  best.ms = best.dense_ms;
  std::string line;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "dense+mirror %.3f ms", best.dense_ms);
  line = buf;
  if (be.has_sm90_kernels()) {
    for (SymKernel v : {SymKernel::kTri128, SymKernel::kTri256x128, SymKernel::kTri128Cluster2,
                        SymKernel::kTri128Pingpong}) {
      be.set_sym_kernel(v);
      DM_CHECK_CUDA(cudaMemsetAsync(out.data, 0xff, out.bytes(), be.stream()));  // NaN poison
      be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, out);
      const double err = rel_err_device(be, out, ref, tmp);
      const bool sym = exactly_symmetric(be, out);
      if (!(err <= 1e-2) || !sym) {
        std::snprintf(buf, sizeof(buf), ", %s rejected (err %.2g%s)", sym_kernel_name(v), err,
                      sym ? "" : ", not symmetric");
        line += buf;
        continue;
      }
      const double ms = time_ms(be, opt.repeats, [&] {
        be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, out);
      });
      std::snprintf(buf, sizeof(buf), ", %s %.3f ms", sym_kernel_name(v), ms);
      line += buf;
      if (ms < best.ms) {
        best.ms = ms;
        best.kernel = v;
      }
    }
  }
  be.set_sym_kernel(saved);
  be.set_sym_choice(m, k, count, dtype, best.kernel);
  if (opt.verbose)
    std::fprintf(stderr, "[tune] sym %s %lldx%lld k=%lld: %s -> %s\n", dtype_name(dtype),
                 (long long)count, (long long)m, (long long)k, line.c_str(), sym_kernel_name(best.kernel));
  return best;
}

OrthoConfig config_of(const AlgoCandidate& c, const OrthoConfig& base) {
  OrthoConfig cfg = parse_algorithm(c.algorithm, base);
  cfg.restarts = c.restarts;
  cfg.work_dtype = DType::kBF16;
  if (cfg.iteration == Iteration::kGram) cfg.gram_work_dtype = c.work_dtype;
  return cfg;
}

OrthoConfig config_of(const AlgoChoice& c, const OrthoConfig& base) {
  return config_of(AlgoCandidate{c.algorithm, c.restarts, c.work_dtype, c.ms, c.rel_err, true},
                   base);
}

std::string schedule_name(const OrthoConfig& base) {
  return coefficients_name(base.coefficients) + ":" + std::to_string(base.steps);
}

AlgoChoice tune_algorithm(CudaBackend& be, int64_t rows, int64_t cols, int64_t count,
                          const OrthoConfig& base, const TuneOptions& opt) {
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const int64_t nchk = std::min<int64_t>(count, opt.check_matrices);
  Orthogonalizer ortho(be);
  // Input: count random m x n matrices, normalised in fp32.
  BatchRef u = BatchRef::packed(nullptr, DType::kF32, count, m, n);
  Buffer ub = be.alloc(u.bytes());
  u.data = ub.data();
  launch_fill_normal(u.data, DType::kF32, count * m * n, 0xa1c0 + m * 7 + n, 1.0f, be.stream());
  Buffer nb = be.alloc(sizeof(double) * count);
  be.frob_norm(u, nb.as<double>());
  ScaleSpec spec{nb.as<double>(), norm_multiplier(base.coefficients), base.eps, 1.0};
  be.scale_copy(u, false, spec, u);  // in place: u is now X0 in fp32
  // Reference: the fp32 dense iteration on the first nchk matrices.
  OrthoConfig ref_cfg = base;
  ref_cfg.iteration = Iteration::kStandardDense;
  ref_cfg.work_dtype = DType::kF32;
  ref_cfg.gram_work_dtype.reset();
  BatchRef ref = BatchRef::packed(nullptr, DType::kF32, nchk, m, n);
  Buffer refb = be.alloc(ref.bytes());
  ref.data = refb.data();
  be.copy(ref.data, u.data, ref.bytes());
  {
    const size_t wsb = Orthogonalizer::workspace_bytes(ref_cfg, nchk, m, n);
    Buffer ws = be.alloc(wsb);
    ortho.run(ref_cfg, ref, ref, ws.data(), wsb);
  }
  struct Cand {
    std::string algo;
    std::vector<int> restarts;
    DType dt;
  };
  // Dense ns5 too: on small, launch-bound shapes (ResNet-18's convolutions, 64 x 147 to
  // 512 x 4608) cuBLAS's dense products beat the one-triangle kernels and the Gram iteration's
  // extra launches (bench/results/2026-12-01-h200-perf: ns5 1.77 ms, the tuned pick 2.14).
  std::vector<Cand> cands = {{"ns5", {}, DType::kBF16},
                             {"ns5-sym", {}, DType::kBF16},
                             {"gram-ns", {2}, DType::kF16},
                             {"gram-ns", {}, DType::kF16}};
  AlgoChoice best;
  best.rows = rows;
  best.cols = cols;
  best.count = count;
  best.ms = INFINITY;
  best.schedule = schedule_name(base);
  BatchRef out32 = BatchRef::packed(nullptr, DType::kF32, nchk, m, n), diff = out32;
  Buffer o32 = be.alloc(out32.bytes()), d32 = be.alloc(diff.bytes());
  out32.data = o32.data();
  diff.data = d32.data();
  std::string line;
  char buf[160];
  for (const Cand& c : cands) {
    AlgoChoice ac;
    ac.algorithm = c.algo;
    ac.restarts = c.restarts;
    ac.work_dtype = c.dt;
    OrthoConfig cfg = resolve(config_of(ac, base), m, n);
    const DType t = iteration_dtype(cfg);
    BatchRef x0 = BatchRef::packed(nullptr, t, count, m, n), x = x0;
    Buffer x0b = be.alloc(x0.bytes()), xb = be.alloc(x.bytes());
    x0.data = x0b.data();
    x.data = xb.data();
    be.scale_copy(u, false, ScaleSpec{}, x0);
    const size_t wsb = Orthogonalizer::workspace_bytes(cfg, count, m, n);
    Buffer ws = be.alloc(wsb);
    auto run_once = [&] {
      be.copy(x.data, x0.data, x.bytes());
      ortho.run(cfg, x, x, ws.data(), wsb);
    };
    run_once();
    be.scale_copy(x.slice(0, nchk), false, ScaleSpec{}, out32);
    const double err = rel_err_device(be, out32, ref, diff);
    const double copy_ms = time_ms(be, opt.repeats, [&] { be.copy(x.data, x0.data, x.bytes()); });
    const double ms = time_ms(be, opt.repeats, run_once) - copy_ms;
    const std::string name = c.algo + (c.algo == "gram-ns" ? (c.restarts.empty() ? "{}" : "{2}") : "");
    std::snprintf(buf, sizeof(buf), "%s%s %.3f ms err %.2e%s", line.empty() ? "" : ", ", name.c_str(), ms,
                  err, err <= opt.tolerance ? "" : " (rejected)");
    line += buf;
    best.candidates.push_back({c.algo, c.restarts, c.dt, ms, err, err <= opt.tolerance});
    if (err <= opt.tolerance && ms < best.ms) {
      best.algorithm = c.algo;
      best.restarts = c.restarts;
      best.work_dtype = c.dt;
      best.ms = ms;
      best.rel_err = err;
    }
  }
  DM_CHECK(std::isfinite(best.ms), "autotune: no algorithm passed the numerical check for ", rows,
           "x", cols, " (", line, ")");
  if (opt.verbose)
    std::fprintf(stderr, "[tune] algo %lldx%lldx%lld: %s -> %s\n", (long long)count, (long long)rows,
                 (long long)cols, line.c_str(), best.algorithm.c_str());
  return best;
}

}  // namespace distmuon::cuda
