#include "bench_model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "common/half.h"
#include "distmuon/error.h"

namespace distmuon::bench {

int64_t Tensor::numel() const { return checked_numel(shape, "tensor '" + name + "'"); }

void check_fits(const Backend& be, const Workload& w, DType param_dtype, bool include_adamw) {
  if (be.device().kind != DeviceKind::kCPU) return;
  const int64_t muon = w.muon_params(), adamw = include_adamw ? w.adamw_params() : 0;
  // Weights and gradients, momentum (f32) and the two Adam moments (f32).
  const double need = static_cast<double>(muon + adamw) * 2 * dtype_size(param_dtype) +
                      static_cast<double>(muon) * 4 + static_cast<double>(adamw) * 8;
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  DM_CHECK(need < have, "workload ", w.name, " needs ", need / (1 << 30),
           " GiB on the CPU but the machine has ", have / (1 << 30),
           " GiB (use --layers to keep fewer layers)");
}

GaussianFiller::GaussianFiller(Backend& be, DType dtype, uint64_t seed, int64_t pool_size)
    : be_(be), dtype_(dtype), rng_(seed) {
  DM_CHECK(pool_size > (int64_t{1} << 20), "a Gaussian pool needs more than 2^20 values");
  pool_.resize(static_cast<size_t>(pool_size));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : pool_) v = nd(rng_);
}

void GaussianFiller::fill(void* dst, int64_t numel, double scale) {
  const int64_t chunk = 1 << 20;
  std::vector<uint8_t> host(static_cast<size_t>(std::min(numel, chunk)) * dtype_size(dtype_));
  std::uniform_int_distribution<size_t> off(0, pool_.size() - chunk - 1);
  for (int64_t start = 0; start < numel; start += chunk) {
    const int64_t n = std::min(chunk, numel - start);
    const float* src = pool_.data() + off(rng_);
    for (int64_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(src[i] * scale);
      switch (dtype_) {
        case DType::kF32: reinterpret_cast<float*>(host.data())[i] = v; break;
        case DType::kF64: reinterpret_cast<double*>(host.data())[i] = v; break;
        case DType::kBF16: reinterpret_cast<uint16_t*>(host.data())[i] = float_to_bf16(v); break;
        case DType::kF16: reinterpret_cast<uint16_t*>(host.data())[i] = float_to_f16(v); break;
      }
    }
    be_.copy_from_host(static_cast<char*>(dst) + start * dtype_size(dtype_), host.data(),
                       static_cast<size_t>(n) * dtype_size(dtype_));
  }
}

BenchModel::BenchModel(Backend& be, const Workload& w, DType dtype, bool include_adamw,
                       uint64_t seed)
    : be_(be), dtype_(dtype), filler_(be, dtype, seed) {
  auto add = [&](const WorkloadEntry& e, bool muon) {
    for (int64_t l = 0; l < e.count; ++l) {
      Tensor t;
      t.name = e.name + "." + std::to_string(l);
      t.shape = e.shape;
      t.muon = muon;
      size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(dtype);
      t.weight = be.alloc(bytes);
      t.grad = be.alloc(bytes);
      filler_.fill(t.weight.data(), t.numel(), 0.02);
      filler_.fill(t.grad.data(), t.numel(), 1e-3);
      tensors_.push_back(std::move(t));
    }
  };
  for (const auto& e : w.muon) add(e, true);
  if (include_adamw)
    for (const auto& e : w.adamw) add(e, false);
}

void BenchModel::register_with(Engine& engine, const MuonOptions& muon,
                               const AdamWOptions& adamw) const {
  GroupOptions gm;
  gm.kind = ParamKind::kMuon;
  gm.muon = muon;
  engine.add_group(gm);
  GroupOptions ga;
  ga.kind = ParamKind::kAdamW;
  ga.adamw = adamw;
  engine.add_group(ga);
  for (const Tensor& t : tensors_) engine.add_param({t.name, t.muon ? 0 : 1, t.shape, dtype_});
}

std::vector<ParamData> BenchModel::step_data() const {
  std::vector<ParamData> d;
  for (const Tensor& t : tensors_) d.push_back({t.weight.data(), t.grad.data(), dtype_, {}});
  return d;
}

void BenchModel::refresh_gradients() {
  for (Tensor& t : tensors_) filler_.fill(t.grad.data(), t.numel(), 1e-3);
}

void BenchModel::restart_gradients(uint64_t seed) {
  filler_.rng().seed(seed);
  refresh_gradients();
}

void BenchModel::drift_gradients(double eps) {
  DM_CHECK(dtype_ == DType::kF32, "--drift needs f32 parameters");
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Tensor& t : tensors_) {
    if (!t.muon) continue;
    std::vector<float> g(static_cast<size_t>(t.numel()));
    be_.copy_to_host(g.data(), t.grad.data(), g.size() * sizeof(float));
    double ss = 0;
    for (float v : g) ss += double(v) * v;
    const float sigma = static_cast<float>(eps * std::sqrt(ss / g.size()));
    for (float& v : g) v += sigma * nd(filler_.rng());
    be_.copy_from_host(t.grad.data(), g.data(), g.size() * sizeof(float));
  }
}

int64_t BenchModel::muon_params() const {
  int64_t n = 0;
  for (const Tensor& t : tensors_) n += t.muon ? t.numel() : 0;
  return n;
}
int64_t BenchModel::adamw_params() const {
  int64_t n = 0;
  for (const Tensor& t : tensors_) n += t.muon ? 0 : t.numel();
  return n;
}
int64_t BenchModel::muon_matrices() const {
  int64_t n = 0;
  for (const Tensor& t : tensors_) n += t.muon ? (t.shape.size() == 3 ? t.shape[0] : 1) : 0;
  return n;
}

}  // namespace distmuon::bench
