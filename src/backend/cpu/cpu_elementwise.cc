// Elementwise and reduction operations of the CPU backend: the readable reference for the
// fused CUDA kernels. Loops are parallelised over rows with OpenMP.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "backend/adam_ref.h"
#include "backend/muon_ref.h"
#include "backend/backend_checks.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_dtype.h"
#include "backend/cpu/cpu_simd_passes.h"
#include "distmuon/env.h"

extern "C" char* openblas_get_config(void);
extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace distmuon {

using cpu::dispatch;
using cpu::from_float;
using cpu::to_float;
using muon_ref::float_precision;
using muon_ref::scaled_input;

CpuBackend::CpuBackend() {
  int64_t threads = env::get_int("DISTMUON_NUM_THREADS");
  DM_CHECK(threads >= 0 && threads <= 4096, "DISTMUON_NUM_THREADS=", threads,
           " is not a thread count (0: the BLAS library's default)");
  if (threads > 0) openblas_set_num_threads(static_cast<int>(threads));
}

std::string CpuBackend::name() const {
  return std::string("cpu (") + openblas_get_config() + ", " +
         std::to_string(openblas_get_num_threads()) + " threads)";
}

Buffer CpuBackend::alloc(size_t bytes) {
  if (bytes == 0) return Buffer();
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  DM_CHECK(p != nullptr, "cpu: out of memory allocating ", bytes, " bytes");
  return counted(p, bytes, [](void* q) { std::free(q); });
}

void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) { copy(dst, src, bytes); }
void CpuBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  copy(dst, src, bytes);
}
void CpuBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

void CpuBackend::lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b,
                         double diag, const BatchRef& out) {
  check_lincomb("lincomb", a, b, diag, out);
  for (int64_t i = 0; i < out.count; ++i) {
    MatRef ma = a.matrix(i), mo = out.matrix(i);
    MatRef mb = b ? b->matrix(i) : MatRef{};
    if (ma.dtype == DType::kF32 && mo.dtype == DType::kF32 && (!b || mb.dtype == DType::kF32)) {
      // The same float operations as below, in loops the compiler vectorizes (Gram NS's
      // Q = Z + a I on every solve).
      const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
      const float fd = static_cast<float>(diag);
      for (int64_t r = 0; r < mo.rows; ++r) {
        const float* pa = static_cast<const float*>(ma.data) + r * ma.ld;
        const float* pb = b ? static_cast<const float*>(mb.data) + r * mb.ld : nullptr;
        float* po = static_cast<float*>(mo.data) + r * mo.ld;
        if (pb)
          for (int64_t c = 0; c < mo.cols; ++c) po[c] = fa * pa[c] + fb * pb[c];
        else
          for (int64_t c = 0; c < mo.cols; ++c) po[c] = fa * pa[c];
        if (r < mo.cols) po[r] += fd;
      }
      continue;
    }
    dispatch(ma.dtype, [&](auto ta) {
      dispatch(mo.dtype, [&](auto to) {
        using A = decltype(ta);
        using O = decltype(to);
        using C = cpu::compute_t<O>;
        const A* pa = static_cast<const A*>(ma.data);
        O* po = static_cast<O*>(mo.data);
        auto bval = [&](int64_t r, int64_t c) -> C {
          if (!b) return 0;
          return dispatch(mb.dtype, [&](auto tb) -> C {
            using B = decltype(tb);
            return static_cast<C>(to_float(static_cast<const B*>(mb.data)[r * mb.ld + c]));
          });
        };
        for (int64_t r = 0; r < mo.rows; ++r)
          for (int64_t c = 0; c < mo.cols; ++c) {
            C v = C(alpha) * C(to_float(pa[r * ma.ld + c]));
            if (b) v += C(beta) * bval(r, c);
            if (r == c) v += C(diag);
            po[r * mo.ld + c] = from_float<O>(v);
          }
      });
    });
  }
}

void CpuBackend::frob_norm(const BatchRef& a, double* norms) {
  for (int64_t i = 0; i < a.count; ++i) {
    MatRef m = a.matrix(i);
    double sum = 0;
    dispatch(m.dtype, [&](auto tag) {
      using S = decltype(tag);
      const S* p = static_cast<const S*>(m.data);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c) {
          double v = to_float(p[r * m.ld + c]);
          sum += v * v;
        }
    });
    norms[i] = float_precision(std::sqrt(sum));
  }
}

namespace {
double scale_factor(const ScaleSpec& s, int64_t i) {
  if (!s.norms) return s.alpha;
  return s.alpha / (s.norm_mul * s.norms[i] + s.eps);
}
}  // namespace

void CpuBackend::scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                            const BatchRef& dst) {
  DM_CHECK(src.count == dst.count, "scale_copy: batch counts differ");
  DM_CHECK(transpose ? (dst.rows == src.cols && dst.cols == src.rows)
                     : (dst.rows == src.rows && dst.cols == src.cols),
           "scale_copy: destination is ", dst.rows, "x", dst.cols, " for a ", src.rows, "x",
           src.cols, " source", transpose ? " (transposed)" : "");
  for (int64_t i = 0; i < src.count; ++i) {
    MatRef ms = src.matrix(i), md = dst.matrix(i);
    double f = scale_factor(scale, i);
    dispatch(ms.dtype, [&](auto ts) {
      dispatch(md.dtype, [&](auto td) {
        using S = decltype(ts);
        using D = decltype(td);
        const S* ps = static_cast<const S*>(ms.data);
        D* pd = static_cast<D*>(md.data);
        // The product in double: a factor of a huge norm (1e-40) is not a normal float.
#pragma omp parallel for num_threads(cpu::threads()) if (ms.rows * ms.cols > cpu::kLoopElements)
        for (int64_t r = 0; r < ms.rows; ++r)
          for (int64_t c = 0; c < ms.cols; ++c) {
            const double v = f * static_cast<double>(to_float(ps[r * ms.ld + c]));
            int64_t at = transpose ? c * md.ld + r : r * md.ld + c;
            pd[at] = from_float<D>(v);
          }
      });
    });
  }
}

// ---- fused Muon passes ------------------------------------------------------------------------

namespace {
// Calls f(grad*, momentum*, weight*) with the slot's storage types resolved.
template <typename F>
void with_slot(const MuonSlot& s, F&& f) {
  dispatch(s.grad.dtype, [&](auto tg) {
    dispatch(s.momentum.dtype, [&](auto tm) {
      dispatch(s.weight.dtype, [&](auto tw) {
        f(static_cast<decltype(tg)*>(s.grad.data), static_cast<decltype(tm)*>(s.momentum.data),
          static_cast<decltype(tw)*>(s.weight.data));
      });
    });
  });
}

// Whether pass 2 can store the new momentum: finite once rounded to the momentum's dtype.
template <typename B>
inline bool momentum_fits(float b_new) {
  return std::isfinite(to_float(from_float<B>(b_new)));
}

// Whether a slot (and X, where given) takes the AVX-512 passes: every buffer fp32.
bool simd_slot(const MuonSlot& s, const MatRef* x = nullptr) {
  return cpu::avx512_available() && s.grad.dtype == DType::kF32 &&
         s.momentum.dtype == DType::kF32 && s.weight.dtype == DType::kF32 &&
         (!x || x->dtype == DType::kF32);
}
// Rows per block of the AVX-512 passes (a multiple of their 16-row transposed tiles).
constexpr int64_t kSimdRows = 32;

// Matrix i of a batch, for each pass: what the single calls and muon_pass_grouped run per matrix.
void norm_matrix(std::span<const MuonSlot> slots, int64_t i, float mu, bool nesterov, double* norms,
                 int32_t* status) {
  const MuonSlot& s = slots[i];
  double sum = 0;
  bool finite = true;
  const bool shared = s.grad.rows * s.grad.cols > cpu::kLoopElements;
  if (simd_slot(s)) {
    const int64_t rows = s.grad.rows;
#pragma omp parallel for num_threads(cpu::threads()) reduction(+ : sum) reduction(&& : finite) \
    if (shared)
    for (int64_t r0 = 0; r0 < rows; r0 += kSimdRows) {
      double part = 0;
      bool fin = true;
      cpu::simd::norm_rows(static_cast<const float*>(s.grad.data), s.grad.ld,
                           static_cast<const float*>(s.momentum.data), s.momentum.ld, r0,
                           std::min(rows, r0 + kSimdRows), s.grad.cols, mu, nesterov, &part, &fin);
      sum += part;
      finite = finite && fin;
    }
  } else
  with_slot(s, [&](auto* g, auto* b, auto*) {
    using B = std::remove_pointer_t<decltype(b)>;
#pragma omp parallel for num_threads(cpu::threads()) reduction(+ : sum) reduction(&& : finite) \
    if (shared)
    for (int64_t r = 0; r < s.grad.rows; ++r)
      for (int64_t c = 0; c < s.grad.cols; ++c) {
        float gv = to_float(g[r * s.grad.ld + c]);
        float bn = mu * to_float(b[r * s.momentum.ld + c]) + gv;
        const float v = scaled_input(gv, bn, mu, nesterov);
        finite = finite && std::isfinite(gv) && momentum_fits<B>(bn);
        sum += static_cast<double>(v) * v;
      }
  });
  norms[i] = float_precision(std::sqrt(sum));
  status[i] = finite && std::isfinite(sum) ? kStatusOk : kStatusNonFinite;
}

void apply_matrix(std::span<const MuonSlot> slots, int64_t i, float mu, bool nesterov,
                  const int32_t* status, const ScaleSpec& scale, bool transpose,
                  const BatchRef& x) {
  const MuonSlot& s = slots[i];
  MatRef mx = x.matrix(i);
  const bool ok = status[i] == kStatusOk;
  const double f = ok ? scale_factor(scale, i) : 0.0;
  if (!ok && s.skips) *s.skips += 1;
  const bool shared = s.grad.rows * s.grad.cols > cpu::kLoopElements;
  if (ok && simd_slot(s, &mx)) {
    const int64_t rows = s.grad.rows;
#pragma omp parallel for num_threads(cpu::threads()) if (shared)
    for (int64_t r0 = 0; r0 < rows; r0 += kSimdRows)
      cpu::simd::apply_rows(static_cast<const float*>(s.grad.data), s.grad.ld,
                            static_cast<float*>(s.momentum.data), s.momentum.ld, r0,
                            std::min(rows, r0 + kSimdRows), s.grad.cols, mu, nesterov, f,
                            static_cast<float*>(mx.data), mx.ld, transpose);
    return;
  }
  with_slot(s, [&](auto* g, auto* b, auto*) {
    using B = std::remove_pointer_t<decltype(b)>;
    dispatch(mx.dtype, [&](auto tx) {
      using X = decltype(tx);
      X* px = static_cast<X*>(mx.data);
      auto element = [&](int64_t r, int64_t c) {
        double xv = 0.0;
        if (ok) {
          float gv = to_float(g[r * s.grad.ld + c]);
          float bn = mu * to_float(b[r * s.momentum.ld + c]) + gv;
          b[r * s.momentum.ld + c] = from_float<B>(bn);
          xv = static_cast<double>(scaled_input(gv, bn, mu, nesterov)) * f;
        }
        px[transpose ? c * mx.ld + r : r * mx.ld + c] = from_float<X>(xv);
      };
      const int64_t rows = s.grad.rows, cols = s.grad.cols;
      if (!transpose) {
#pragma omp parallel for num_threads(cpu::threads()) if (shared)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) element(r, c);
        return;
      }
      // Written transposed: tiles of kTile rows, so that x gets runs of kTile consecutive
      // elements rather than one element per cache line.
      constexpr int64_t kTile = 32;
#pragma omp parallel for num_threads(cpu::threads()) if (shared)
      for (int64_t r0 = 0; r0 < rows; r0 += kTile)
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r) element(r, c);
    });
  });
}

void update_matrix(std::span<const MuonSlot> slots, int64_t i, const int32_t* status,
                   const BatchRef& o, bool transpose) {
  if (status && status[i] != kStatusOk) return;
  const MuonSlot& s = slots[i];
  MatRef mo = o.matrix(i);
  const bool shared = s.weight.rows * s.weight.cols > cpu::kLoopElements;
  if (simd_slot(s, &mo)) {
    const int64_t rows = s.weight.rows;
#pragma omp parallel for num_threads(cpu::threads()) if (shared)
    for (int64_t r0 = 0; r0 < rows; r0 += kSimdRows)
      cpu::simd::update_rows(static_cast<const float*>(mo.data), mo.ld, transpose,
                             static_cast<float*>(s.weight.data), s.weight.ld, r0,
                             std::min(rows, r0 + kSimdRows), s.weight.cols, s.coef->decay,
                             s.coef->step);
    return;
  }
  with_slot(s, [&](auto*, auto*, auto* w) {
    using W = std::remove_pointer_t<decltype(w)>;
    using C = cpu::compute_t<W>;
    dispatch(mo.dtype, [&](auto to) {
      using O = decltype(to);
      const O* po = static_cast<const O*>(mo.data);
      const C decay = s.coef->decay, step = s.coef->step;
#pragma omp parallel for num_threads(cpu::threads()) if (shared)
      for (int64_t r = 0; r < s.weight.rows; ++r)
        for (int64_t c = 0; c < s.weight.cols; ++c) {
          C ov = to_float(po[transpose ? c * mo.ld + r : r * mo.ld + c]);
          C wv = to_float(w[r * s.weight.ld + c]);
          w[r * s.weight.ld + c] = from_float<W>(decay * wv - step * ov);
        }
    });
  });
}

void pass_matrix(MuonPass pass, const MuonPassBatch& b, int64_t i) {
  switch (pass) {
    case MuonPass::kNorm:
      norm_matrix(b.slots, i, *b.mu, b.nesterov, b.norms, b.status);
      break;
    case MuonPass::kApply:
      apply_matrix(b.slots, i, *b.mu, b.nesterov, b.status, b.scale, b.transpose, b.x);
      break;
    case MuonPass::kUpdate:
      update_matrix(b.slots, i, b.status, b.x, b.transpose);
      break;
  }
}
}  // namespace

void CpuBackend::muon_momentum_norm(std::span<const MuonSlot> slots, const float* mu_ptr,
                                    bool nesterov, double* norms, int32_t* status) {
  const float mu = *mu_ptr;
  cpu::for_each_matrix(static_cast<int64_t>(slots.size()),
                       [&](int64_t i) { norm_matrix(slots, i, mu, nesterov, norms, status); });
}

void CpuBackend::muon_momentum_apply(std::span<const MuonSlot> slots, const float* mu_ptr,
                                     bool nesterov, const int32_t* status, const ScaleSpec& scale,
                                     bool transpose, const BatchRef& x) {
  check_slots("muon_momentum_apply", slots, x, transpose);
  const float mu = *mu_ptr;
  cpu::for_each_matrix(static_cast<int64_t>(slots.size()), [&](int64_t i) {
    apply_matrix(slots, i, mu, nesterov, status, scale, transpose, x);
  });
}

void CpuBackend::muon_update(std::span<const MuonSlot> slots, const int32_t* status,
                             const BatchRef& o, bool transpose) {
  check_slots("muon_update", slots, o, transpose);
  check_coefs("muon_update", slots);
  cpu::for_each_matrix(static_cast<int64_t>(slots.size()),
                       [&](int64_t i) { update_matrix(slots, i, status, o, transpose); });
}

// The small matrices of every batch in one loop over the threads: the pool wakes and meets once
// per pass rather than once per shape class. Each meeting waits for the slowest thread, and on
// a machine whose other processes hold cores a woken thread may wait milliseconds for one. A
// larger matrix keeps its batch's call, whose loops share the threads inside the matrix.
void CpuBackend::muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches) {
  for (const MuonPassBatch& b : batches) {
    if (pass == MuonPass::kApply) check_slots("muon_momentum_apply", b.slots, b.x, b.transpose);
    if (pass == MuonPass::kUpdate) {
      check_slots("muon_update", b.slots, b.x, b.transpose);
      check_coefs("muon_update", b.slots);
    }
  }
  std::vector<std::pair<const MuonPassBatch*, int64_t>> small;
  for (const MuonPassBatch& b : batches) {
    const int64_t n = static_cast<int64_t>(b.slots.size());
    if (n > 0 && b.slots[0].grad.rows * b.slots[0].grad.cols > cpu::kLoopElements) {
      cpu::for_each_matrix(n, [&](int64_t i) { pass_matrix(pass, b, i); });
      continue;
    }
    for (int64_t i = 0; i < n; ++i) small.emplace_back(&b, i);
  }
  cpu::for_each_matrix(static_cast<int64_t>(small.size()),
                       [&](int64_t k) { pass_matrix(pass, *small[k].first, small[k].second); });
}

// ---- AdamW ------------------------------------------------------------------------------------

void CpuBackend::adamw_check(std::span<const AdamSlot> slots, int32_t* status) {
  for (size_t i = 0; i < slots.size(); ++i) {
    bool finite = true;
    dispatch(slots[i].grad_dtype, [&](auto tg) {
      const auto* g = static_cast<const decltype(tg)*>(slots[i].grad);
#pragma omp parallel for num_threads(cpu::threads()) reduction(&& : finite) \
    if (slots[i].numel > cpu::kLoopElements)
      for (int64_t j = 0; j < slots[i].numel; ++j) finite = finite && std::isfinite(to_float(g[j]));
    });
    status[i] = finite ? kStatusOk : kStatusNonFinite;
  }
}

void CpuBackend::adamw_update(std::span<const AdamSlot> slots, const int32_t* status) {
  check_coefs("adamw_update", slots);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (status && status[i] != kStatusOk) continue;
    const AdamSlot& s = slots[i];
    const AdamCoef& k = *s.coef;
    const int64_t t = s.step ? *s.step + 1 : std::max<int64_t>(k.step, 1);
    if (s.step) *s.step = t;
    const adam_ref::Bias bias = adam_ref::bias(k.lr, k.beta1, k.beta2, t);
    const float step_size = bias.step_size, bc2_sqrt = bias.bc2_sqrt;
    const float decay = adam_ref::decay(k.lr, k.weight_decay);
    float* m = static_cast<float*>(s.exp_avg);
    float* v = static_cast<float*>(s.exp_avg_sq);
    dispatch(s.grad_dtype, [&](auto tg) {
      dispatch(s.param_dtype, [&](auto tp) {
        using P = decltype(tp);
        const auto* g = static_cast<const decltype(tg)*>(s.grad);
        P* p = static_cast<P*>(s.param);
#pragma omp parallel for num_threads(cpu::threads()) if (s.numel > cpu::kLoopElements)
        for (int64_t j = 0; j < s.numel; ++j) {
          float gv = to_float(g[j]);
          float mj = k.beta1 * m[j] + (1.0f - k.beta1) * gv;
          float vj = k.beta2 * v[j] + (1.0f - k.beta2) * gv * gv;
          m[j] = mj;
          v[j] = vj;
          float pv = static_cast<float>(to_float(p[j])) * decay;
          pv -= step_size * mj / (std::sqrt(vj) / bc2_sqrt + k.eps);
          p[j] = from_float<P>(pv);
        }
      });
    });
  }
}

void CpuBackend::count_status(const int32_t* status, int64_t n, int64_t* counter) {
  for (int64_t i = 0; i < n; ++i) counter[0] += status[i] != kStatusOk ? 1 : 0;
}

}  // namespace distmuon
