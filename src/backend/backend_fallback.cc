// Default implementations of the masked and CacheMuon operations, written with the other
// Backend operations and host round trips. They are correct on any backend but synchronise, so
// a device backend overrides them; they let a new backend run CacheMuon before it has kernels.
#include <vector>

#include "backend/backend_checks.h"
#include "backend/cache_ref.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

std::vector<int32_t> host_flags(Backend& be, const BatchMask& mask, int64_t count) {
  DM_CHECK(mask.flags != nullptr || count == 0, "masked operation without flags");
  std::vector<int32_t> f(static_cast<size_t>(count));
  be.synchronize();
  be.copy_to_host(f.data(), mask.flags, f.size() * sizeof(int32_t));
  return f;
}

BatchRef one(const BatchRef& b, int64_t i) { return b.slice(i, 1); }

}  // namespace

void Backend::gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a,
                          Op op_b, const BatchRef& b, double alpha, double beta,
                          const BatchRef* c_in, const BatchRef& c) {
  check_gemm("gemm_masked", op_a, a, op_b, b, c_in, c);
  std::vector<int32_t> f = host_flags(*this, mask, c.count);
  for (int64_t i = 0; i < c.count; ++i) {
    if (f[i] != mask.value) continue;
    BatchRef ci = c_in ? one(*c_in, i) : BatchRef{};
    if (symmetric)
      gemm_symmetric(op_a, one(a, i), op_b, one(b, i), alpha, beta, c_in ? &ci : nullptr,
                     one(c, i));
    else
      gemm(op_a, one(a, i), op_b, one(b, i), alpha, beta, c_in ? &ci : nullptr, one(c, i));
  }
}

void Backend::copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst) {
  check_same_shape("copy_masked", src, dst);
  std::vector<int32_t> f = host_flags(*this, mask, src.count);
  for (int64_t i = 0; i < src.count; ++i)
    if (f[i] == mask.value) scale_copy(one(src, i), false, {}, one(dst, i));
}

void Backend::cache_gate(const CacheGateArgs& args) {
  const size_t n = static_cast<size_t>(args.count);
  std::vector<double> residual(n);
  std::vector<float> age(n), misses(n);
  std::vector<int32_t> status(n), decision(n);
  std::vector<double> key(n), stats(args.stats ? n * kCacheStatFields : 0);
  synchronize();
  if (!args.plan) copy_to_host(residual.data(), args.residual, n * sizeof(double));
  copy_to_host(age.data(), args.age, n * sizeof(float));
  copy_to_host(key.data(), args.entry_key, n * sizeof(double));
  if (args.misses) copy_to_host(misses.data(), args.misses, n * sizeof(float));
  if (args.status) copy_to_host(status.data(), args.status, n * sizeof(int32_t));
  if (args.stats) copy_to_host(stats.data(), args.stats, stats.size() * sizeof(double));
  CacheGateArgs h = args;
  h.residual = residual.data();
  h.status = args.status ? status.data() : nullptr;
  h.entry_key = key.data();
  h.age = age.data();
  h.misses = args.misses ? misses.data() : nullptr;
  h.decision = decision.data();
  h.stats = args.stats ? stats.data() : nullptr;
  cache_ref::gate_call(h);
  copy_from_host(args.decision, decision.data(), n * sizeof(int32_t));
  if (!args.plan) {
    copy_from_host(args.age, age.data(), n * sizeof(float));
    copy_from_host(args.entry_key, key.data(), n * sizeof(double));
    if (args.misses) copy_from_host(args.misses, misses.data(), n * sizeof(float));
    if (args.stats) copy_from_host(args.stats, stats.data(), stats.size() * sizeof(double));
  }
  synchronize();  // the host vectors die on return
}

namespace {
// Matrix b of dst = normal_sample(seed, first + j) for its elements j in row-major order.
void fill_normals(Backend& be, const BatchRef& dst, int64_t b, uint64_t seed, uint64_t first) {
  std::vector<double> v(static_cast<size_t>(dst.rows * dst.cols));
  for (size_t j = 0; j < v.size(); ++j) v[j] = cache_ref::normal_sample(seed, first + j);
  // Stage through device memory: scale_copy reads device buffers on every backend.
  Buffer staged = be.alloc(v.size() * sizeof(double));
  be.copy_from_host(staged.data(), v.data(), v.size() * sizeof(double));
  be.scale_copy(BatchRef::packed(staged.data(), DType::kF64, 1, dst.rows, dst.cols), false, {},
                one(dst, b));
  be.synchronize();
}
}  // namespace

void Backend::fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter) {
  for (int64_t b = 0; b < dst.count; ++b)
    fill_normals(*this, dst, b, seed, counter + static_cast<uint64_t>(b * dst.rows * dst.cols));
}

void Backend::fingerprint(const BatchRef& x, uint64_t* keys) {
  const size_t es = dtype_size(x.dtype);
  std::vector<uint64_t> k(static_cast<size_t>(x.count));
  for (int64_t b = 0; b < x.count; ++b) {
    const char* base = static_cast<const char*>(x.matrix(b).data);
    k[b] = cache_ref::fingerprint_matrix(x.rows, x.cols, x.ld, [&](int64_t off) {
      uint64_t bits = 0;  // little-endian: the element's bytes are the low bytes
      copy_to_host(&bits, base + off * es, es);
      return bits;
    });
  }
  copy_from_host(keys, k.data(), k.size() * sizeof(uint64_t));
  synchronize();  // k dies on return
}

void Backend::fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys) {
  std::vector<uint64_t> k(static_cast<size_t>(dst.count));
  copy_to_host(k.data(), keys, k.size() * sizeof(uint64_t));
  for (int64_t b = 0; b < dst.count; ++b) fill_normals(*this, dst, b, seed ^ k[b], 0);
}

}  // namespace distmuon
