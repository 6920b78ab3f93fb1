// The CUDA backend's kernel-variant tuning (see autotune.h) and its part of the measurement
// layer's interface: device-event timing, the tuning fingerprint, the kernel choices as JSON.
#include "backend/cuda/tune/autotune.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_handles.h"
#include "backend/cuda/launch/cuda_backend_impl.h"
#include "backend/cuda/launch/launchers.h"
#include "backend/cuda/launch/sym_gemm.h"
#include "backend/relative_error.h"
#include "distmuon/error.h"

namespace distmuon::cuda {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

namespace {

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
  BatchRef ref = BatchRef::packed(nullptr, dtype, count, m, m), out = ref;
  Buffer rb = be.alloc(ref.bytes()), ob = be.alloc(ref.bytes());
  ref.data = rb.data();
  out.data = ob.data();
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
      const double err = relative_error(be, out, ref);
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
  be.set_sym_choice(m, k, count, dtype, best.kernel, best.ms, best.dense_ms);
  if (opt.verbose)
    std::fprintf(stderr, "[tune] sym %s %lldx%lld k=%lld: %s -> %s\n", dtype_name(dtype),
                 (long long)count, (long long)m, (long long)k, line.c_str(), sym_kernel_name(best.kernel));
  return best;
}

std::string tuning_fingerprint(const std::string& gpu_name) {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::ostringstream os;
  os << gpu_name << "|driver " << driver << "|runtime " << runtime << "|cublasLt "
     << cublasLtGetVersion() << "|sym r" << kSymKernelRevision
     << (sym_epilogue_mirror() ? "" : " (separate mirror)");
  return os.str();
}

}  // namespace distmuon::cuda

namespace distmuon {

double CudaBackend::time_ms(int repeats, const std::function<void()>& prepare,
                            const std::function<void()>& run) {
  DM_CHECK(repeats >= 1, "time_ms: need at least one repetition (got ", repeats, ")");
  std::vector<double> ms;
  cuda::Event e0 = cuda::make_event(), e1 = cuda::make_event();
  for (int i = 0; i < repeats; ++i) {
    if (prepare) prepare();
    DM_CHECK_CUDA(cudaEventRecord(e0.get(), stream()));
    run();
    DM_CHECK_CUDA(cudaEventRecord(e1.get(), stream()));
    DM_CHECK_CUDA(cudaEventSynchronize(e1.get()));
    float elapsed = 0;
    DM_CHECK_CUDA(cudaEventElapsedTime(&elapsed, e0.get(), e1.get()));
    ms.push_back(elapsed);
  }
  return cuda::median_of(ms);
}

std::string CudaBackend::tuning_fingerprint() const {
  return cuda::tuning_fingerprint(impl_->name);
}

void CudaBackend::tune_kernels(int64_t m, int64_t n, int64_t count) {
  cuda::TuneOptions to;
  to.repeats = 5;
  for (DType t : {DType::kF16, DType::kBF16})  // Gram NS's products, then standard NS's
    for (int64_t k : {n, m}) cuda::tune_sym(*this, m, k, count, t, to);
}

std::string CudaBackend::kernel_choices_json() const {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& [key, c] : impl_->sym_choices)
    all.push_back({{"m", c.m}, {"k", c.k}, {"count", c.count}, {"dtype", dtype_name(c.dtype)},
                   {"kernel", sym_kernel_name(c.kernel)}, {"ms", c.ms}, {"dense_ms", c.dense_ms}});
  return all.dump();
}

void CudaBackend::load_kernel_choices_json(const std::string& text) {
  std::vector<cuda::SymChoice> parsed;
  try {
    for (const nlohmann::json& e : nlohmann::json::parse(text)) {
      cuda::SymChoice c;
      c.m = e.at("m");
      c.k = e.at("k");
      c.count = e.at("count");
      c.dtype = parse_dtype(e.at("dtype"));
      c.kernel = parse_sym_kernel(e.at("kernel"));
      c.ms = e.value("ms", 0.0);
      c.dense_ms = e.value("dense_ms", 0.0);
      parsed.push_back(c);
    }
  } catch (const std::exception& e) {
    DM_FAIL("bad symmetric-kernel choice (", e.what(), ")");
  }
  for (const cuda::SymChoice& c : parsed) impl_->choose(c);  // all or nothing
}

}  // namespace distmuon
