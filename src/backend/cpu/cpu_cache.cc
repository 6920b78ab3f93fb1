// The CPU backend's masked copy, CacheMuon gate and probe generator. Flags live in host memory
// here, so the masked operations simply skip unselected matrices.
#include "backend/backend_checks.h"
#include "backend/cache_ref.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_dtype.h"

namespace distmuon {

using cpu::dispatch;
using cpu::from_float;
using cpu::to_float;

void CpuBackend::copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst) {
  check_same_shape("copy_masked", src, dst);
  DM_CHECK(mask.flags != nullptr || src.count == 0, "copy_masked: no flags");
  for (int64_t i = 0; i < src.count; ++i) {
    if (mask.flags[i] != mask.value) continue;
    MatRef ms = src.matrix(i), md = dst.matrix(i);
    dispatch(ms.dtype, [&](auto ts) {
      dispatch(md.dtype, [&](auto td) {
        using S = decltype(ts);
        using D = decltype(td);
        const S* ps = static_cast<const S*>(ms.data);
        D* pd = static_cast<D*>(md.data);
        for (int64_t r = 0; r < ms.rows; ++r)
          for (int64_t c = 0; c < ms.cols; ++c)
            pd[r * md.ld + c] = from_float<D>(to_float(ps[r * ms.ld + c]));
      });
    });
  }
}

void CpuBackend::cache_gate(const CacheGateArgs& args) {
  DM_CHECK(args.count == 0 ||
               ((args.plan || args.residual) && args.entry_key && args.age && args.decision),
           "cache_gate: missing buffers");
  DM_CHECK(args.key != 0, "cache_gate: key 0 is reserved for empty entries");
  cache_ref::gate_call(args);
}

void CpuBackend::fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter) {
  for (int64_t b = 0; b < dst.count; ++b) {
    MatRef m = dst.matrix(b);
    const uint64_t base = counter + static_cast<uint64_t>(b * dst.rows * dst.cols);
    dispatch(m.dtype, [&](auto tag) {
      using S = decltype(tag);
      S* p = static_cast<S*>(m.data);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c)
          p[r * m.ld + c] = from_float<S>(
              cache_ref::normal_sample(seed, base + static_cast<uint64_t>(r * m.cols + c)));
    });
  }
}

void CpuBackend::fingerprint(const BatchRef& x, uint64_t* keys) {
  const size_t es = dtype_size(x.dtype);
  for (int64_t b = 0; b < x.count; ++b) {
    const char* base = static_cast<const char*>(x.matrix(b).data);
    keys[b] = cache_ref::fingerprint_matrix(x.rows, x.cols, x.ld, [&](int64_t off) {
      return cache_ref::element_bits(base + off * es, es);
    });
  }
}

void CpuBackend::fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys) {
  for (int64_t b = 0; b < dst.count; ++b) {
    MatRef m = dst.matrix(b);
    dispatch(m.dtype, [&](auto tag) {
      using S = decltype(tag);
      S* p = static_cast<S*>(m.data);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c)
          p[r * m.ld + c] = from_float<S>(cache_ref::normal_sample(
              seed ^ keys[b], static_cast<uint64_t>(r * m.cols + c)));
    });
  }
}

}  // namespace distmuon
