// The CPU backend: the numerical reference of every Backend operation, and a usable backend
// for CPU training. Products run on OpenBLAS; half-precision buffers are stored as real
// bf16/fp16 bits and multiplied in fp32, so the GPU's rounding can be emulated exactly.
#pragma once

#include <cstdint>
#include <functional>

#include "distmuon/backend.h"

namespace distmuon {

namespace cpu {
// Elements above which one matrix's elementwise loop is shared by the threads (below, a thread
// per matrix: sharing would cost more than the loop).
inline constexpr int64_t kLoopElements = int64_t{1} << 16;
// The OpenMP threads the backend's loops may use: set_cpu_threads' count when one is set (the
// PyTorch front passes torch's intra-op pool size before each step), else the calling thread's
// OpenMP setting.
int threads();
// How many OpenMP threads may share a batch of n matrices: with one BLAS thread (what
// distmuon.torch sets: OpenBLAS's workers spin between calls and would take the cores from
// torch's forward and backward) the matrices are spread over threads(), whose pool sleeps
// once the loop is done; with several BLAS threads BLAS threads each product instead. 1 inside
// a parallel region (a part of a batch already has its thread).
int64_t matrix_threads(int64_t n);
// Calls f(i) for every matrix i of a batch of n, over matrix_threads(n) threads. The first
// exception is rethrown after the loop.
void for_each_matrix(int64_t n, const std::function<void(int64_t)>& f);

}  // namespace cpu

class CpuBackend final : public Backend {
 public:
  CpuBackend();

  Device device() const override { return Device{DeviceKind::kCPU, 0}; }
  std::string name() const override;

  Buffer alloc(size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}

  void gemm(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha, double beta,
            const BatchRef* c_in, const BatchRef& c) override;
  void gemm_symmetric(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha,
                      double beta, const BatchRef* c_in, const BatchRef& c) override;

  void lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b, double diag,
               const BatchRef& out) override;
  void frob_norm(const BatchRef& a, double* norms) override;
  void scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                  const BatchRef& dst) override;

  void muon_momentum_norm(std::span<const MuonSlot> slots, const float* mu, bool nesterov,
                          double* norms, int32_t* status) override;
  void muon_momentum_apply(std::span<const MuonSlot> slots, const float* mu, bool nesterov,
                           const int32_t* status, const ScaleSpec& scale, bool transpose,
                           const BatchRef& x) override;
  void muon_update(std::span<const MuonSlot> slots, const int32_t* status, const BatchRef& o,
                   bool transpose) override;
  void adamw_check(std::span<const AdamSlot> slots, int32_t* status) override;
  void adamw_update(std::span<const AdamSlot> slots, const int32_t* status) override;
  void count_status(const int32_t* status, int64_t n, int64_t* counter) override;
  void muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches) override;

  void gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a, Op op_b,
                   const BatchRef& b, double alpha, double beta, const BatchRef* c_in,
                   const BatchRef& c) override;
  void copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst) override;
  void cache_gate(const CacheGateArgs& args) override;
  void fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter) override;
  void fingerprint(const BatchRef& x, uint64_t* keys) override;
  void fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys) override;

  int64_t batch_parts(int64_t count) const override;
  void run_parts(int64_t parts, const std::function<void(int64_t)>& f) override;
};

}  // namespace distmuon
