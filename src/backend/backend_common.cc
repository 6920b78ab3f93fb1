// Backend-independent pieces: Buffer, argument checks and the backend factory.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "backend/backend_checks.h"
#include "backend/relative_error.h"
#include "backend/cpu/cpu_backend.h"
#include "distmuon/error.h"

namespace distmuon {

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    release_ = std::move(o.release_);
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void MemoryCounter::add(int64_t bytes) {
  const int64_t now = bytes_.fetch_add(bytes) + bytes;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

Buffer Backend::counted(void* ptr, size_t bytes, std::function<void(void*)> release) {
  const auto n = static_cast<int64_t>(bytes);
  memory_->add(n);
  return Buffer(ptr, bytes, [count = memory_, n, free = std::move(release)](void* q) {
    free(q);
    count->add(-n);
  });
}

void Buffer::reset() {
  if (ptr_ && release_) release_(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

double Backend::time_ms(int repeats, const std::function<void()>& prepare,
                        const std::function<void()>& run) {
  DM_CHECK(repeats >= 1, "time_ms: need at least one repetition (got ", repeats, ")");
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    if (prepare) prepare();
    synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    run();
    synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double relative_error(Backend& be, const BatchRef& a, const BatchRef& b) {
  DM_CHECK(a.count == b.count && a.rows == b.rows && a.cols == b.cols && a.dtype == b.dtype,
           "relative_error needs two batches of one shape and dtype");
  BatchRef diff = BatchRef::packed(nullptr, a.dtype, a.count, a.rows, a.cols);
  Buffer db = be.alloc(diff.bytes());
  diff.data = db.data();
  be.lincomb(1.0, a, -1.0, &b, 0.0, diff);
  Buffer norms = be.alloc(sizeof(double) * 2 * std::max<int64_t>(1, a.count));
  be.frob_norm(diff, norms.as<double>());
  be.frob_norm(b, norms.as<double>() + a.count);
  std::vector<double> h(2 * a.count);
  be.copy_to_host(h.data(), norms.data(), h.size() * sizeof(double));
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.count; ++i) {
    num += h[i] * h[i];
    den += h[a.count + i] * h[a.count + i];
  }
  const double r = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  return std::isfinite(r) ? r : INFINITY;
}

void Backend::gemm_grouped(std::span<const GemmProblem> problems) {
  for (const GemmProblem& p : problems)
    gemm(p.op_a, p.a, p.op_b, p.b, p.alpha, p.beta, p.c_in.data ? &p.c_in : nullptr, p.c);
}

void Backend::lincomb_grouped(std::span<const LincombProblem> problems) {
  for (const LincombProblem& p : problems)
    check_lincomb("lincomb_grouped", p.a, p.b.data ? &p.b : nullptr, p.diag, p.out);
  for (const LincombProblem& p : problems)
    lincomb(p.alpha, p.a, p.beta, p.b.data ? &p.b : nullptr, p.diag, p.out);
}

void Backend::muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches) {
  for (const MuonPassBatch& b : batches) switch (pass) {
      case MuonPass::kNorm:
        muon_momentum_norm(b.slots, b.mu, b.nesterov, b.norms, b.status);
        break;
      case MuonPass::kApply:
        muon_momentum_apply(b.slots, b.mu, b.nesterov, b.status, b.scale, b.transpose, b.x);
        break;
      case MuonPass::kUpdate:
        muon_update(b.slots, b.status, b.x, b.transpose);
        break;
    }
}

void Backend::tune_kernels(int64_t, int64_t, int64_t) {}

void Backend::upload_small(void* dst, const void* host_src, size_t bytes) {
  copy_from_host(dst, host_src, bytes);
}

void Backend::copy_blocks(std::span<const BlockCopy> copies) {
  check_block_copies(copies);
  for (const BlockCopy& c : copies) {
    if (c.numel == 0) continue;
    if (c.src_dtype == c.dst_dtype)
      copy(c.dst, c.src, static_cast<size_t>(c.numel) * dtype_size(c.src_dtype));
    else
      scale_copy(BatchRef::packed(const_cast<void*>(c.src), c.src_dtype, 1, 1, c.numel), false, {},
                 BatchRef::packed(c.dst, c.dst_dtype, 1, 1, c.numel));
  }
}

std::unique_ptr<BackendGraph> Backend::capture(const std::function<void()>&) { return nullptr; }
bool Backend::begin_if_selected(const BatchMask&, int64_t) { return false; }
bool Backend::begin_if_some_selected(const BatchMask&, int64_t) { return false; }
bool Backend::masked_capturable(DType) const { return false; }

void Backend::load_kernel_choices_json(const std::string& json) {
  DM_CHECK(json == "[]" || json.empty(), "backend '", name(),
           "' has no kernel variants, yet kernel choices were given: ", json.substr(0, 80));
}

int64_t Backend::batch_parts(int64_t) const { return 1; }

void Backend::run_parts(int64_t parts, const std::function<void(int64_t)>& f) {
  for (int64_t p = 0; p < parts; ++p) f(p);
}

namespace {
void check_layout(const char* what, const char* arg, const BatchRef& x) {
  DM_CHECK(x.rows >= 0 && x.cols >= 0 && x.count >= 0, what, ": ", arg, " has a negative size");
  DM_CHECK(x.ld >= x.cols, what, ": ", arg, " has ld ", x.ld, " < cols ", x.cols);
  DM_CHECK(x.count <= 1 || x.stride >= x.rows * x.ld || x.stride >= x.rows * x.cols, what, ": ",
           arg, " matrices overlap (stride ", x.stride, ")");
  DM_CHECK(x.data != nullptr || x.count * x.rows * x.cols == 0, what, ": ", arg, " is null");
}
}  // namespace

GemmDims check_gemm(const char* what, Op op_a, const BatchRef& a, Op op_b, const BatchRef& b,
                    const BatchRef* c_in, const BatchRef& c) {
  check_layout(what, "A", a);
  check_layout(what, "B", b);
  check_layout(what, "C", c);
  int64_t m = op_a == Op::kN ? a.rows : a.cols;
  int64_t k = op_a == Op::kN ? a.cols : a.rows;
  int64_t kb = op_b == Op::kN ? b.rows : b.cols;
  int64_t n = op_b == Op::kN ? b.cols : b.rows;
  DM_CHECK(k == kb, what, ": inner dimensions differ (", m, "x", k, " times ", kb, "x", n, ")");
  DM_CHECK(c.rows == m && c.cols == n, what, ": C is ", c.rows, "x", c.cols, ", expected ", m,
           "x", n);
  DM_CHECK(a.count == c.count && b.count == c.count, what, ": batch counts differ (", a.count,
           ", ", b.count, ", ", c.count, ")");
  if (c_in) {
    check_layout(what, "Cin", *c_in);
    DM_CHECK(c_in->rows == m && c_in->cols == n && c_in->count == c.count, what,
             ": Cin shape differs from C");
  }
  return {m, n, k};
}

void check_block_copies(std::span<const BlockCopy> copies) {
  for (const BlockCopy& c : copies)
    DM_CHECK(c.numel >= 0, "copy_blocks: a copy of ", c.numel, " elements");
}

void check_same_shape(const char* what, const BatchRef& a, const BatchRef& b) {
  DM_CHECK(a.count == b.count && a.rows == b.rows && a.cols == b.cols, what, ": shapes differ (",
           a.count, "x", a.rows, "x", a.cols, " vs ", b.count, "x", b.rows, "x", b.cols, ")");
}

void check_lincomb(const char* what, const BatchRef& a, const BatchRef* b, double diag,
                   const BatchRef& out) {
  check_same_shape(what, a, out);
  if (b) check_same_shape(what, *b, out);
  DM_CHECK(diag == 0.0 || out.rows == out.cols, what, ": identity term needs square matrices");
}

void check_slots(const char* what, std::span<const MuonSlot> slots, const BatchRef& x,
                 bool transpose) {
  DM_CHECK(static_cast<int64_t>(slots.size()) <= x.count, what, ": ", slots.size(),
           " matrices but room for ", x.count);
  for (const MuonSlot& s : slots) {
    int64_t r = transpose ? x.cols : x.rows, c = transpose ? x.rows : x.cols;
    DM_CHECK(s.grad.rows == r && s.grad.cols == c, what, ": gradient is ", s.grad.rows, "x",
             s.grad.cols, ", expected ", r, "x", c);
    DM_CHECK(s.momentum.rows == r && s.momentum.cols == c && s.weight.rows == r &&
                 s.weight.cols == c,
             what, ": momentum/weight shape differs from the gradient");
  }
}

#ifndef DISTMUON_HAVE_CUDA
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
#endif

std::unique_ptr<Backend> make_cuda_backend(int device);  // backend/cuda (only with CUDA)

std::unique_ptr<Backend> make_backend(const std::string& spec) {
  // "cpu", "cuda" (the current device) or "cuda:N".
  const std::string kind = spec.substr(0, spec.find(':'));
  int device = -1;
  if (kind.size() < spec.size()) {
    const std::string index = spec.substr(kind.size() + 1);
    DM_CHECK(kind == "cuda" && !index.empty() && index.size() <= 6 &&
                 index.find_first_not_of("0123456789") == std::string::npos,
             "bad backend '", spec, "' (expected cpu, cuda or cuda:N)");
    device = std::stoi(index);
  }
  if (kind == "cpu") return std::make_unique<CpuBackend>();
  if (kind == "cuda") {
#ifdef DISTMUON_HAVE_CUDA
    return make_cuda_backend(device);
#else
    (void)device;
    DM_FAIL(
        "this build of distmuon has no CUDA backend (it was configured without CUDA: "
        "DISTMUON_WITH_CUDA=OFF, the cpu-only preset, or no nvcc on the PATH)");
#endif
  }
  DM_FAIL("unknown backend '", spec, "' (expected cpu, cuda or cuda:N)");
}

}  // namespace distmuon
