// The CPU backend: the numerical reference of every Backend operation, and a usable backend
// for CPU training. Products run on OpenBLAS; half-precision buffers are stored as real
// bf16/fp16 bits and multiplied in fp32, so the GPU's rounding can be emulated exactly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

#include "distmuon/backend.h"

namespace distmuon {

namespace cpu {
// How many OpenMP threads may share a batch of n matrices: with one BLAS thread (what
// distmuon.torch sets: OpenBLAS's workers spin between calls and would take the cores from
// torch's forward and backward) the matrices are spread over OpenMP threads, whose pool sleeps
// once the loop is done; with several BLAS threads BLAS threads each product instead. 1 inside
// a parallel region (a part of a batch already has its thread).
int64_t matrix_threads(int64_t n);
// Calls f(i) for every matrix i of a batch of n, over matrix_threads(n) threads. The first
// exception is rethrown after the loop.
void for_each_matrix(int64_t n, const std::function<void(int64_t)>& f);

// Calls f(r, c) for every element of a rows x cols matrix: row by row or, when the loop also
// touches the transposed matrix (`tiled`), in 32 x 32 tiles, so that the row-major and the
// column-major side both stay within a few cache lines. Large matrices are split over OpenMP
// threads (a no-op inside for_each_matrix's parallel loop).
template <typename F>
void for_each_element(int64_t rows, int64_t cols, bool tiled, F&& f) {
  const int64_t tile = tiled ? 32 : 1;  // rows per iteration of the parallel loop
  const int64_t tiles = (rows + tile - 1) / tile;
#pragma omp parallel for if (rows * cols > (1 << 16))
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = t * tile, r1 = std::min(rows, r0 + tile);
    if (!tiled) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c) f(r, c);
      continue;
    }
    for (int64_t c0 = 0; c0 < cols; c0 += tile)
      for (int64_t c = c0; c < std::min(cols, c0 + tile); ++c)
        for (int64_t r = r0; r < r1; ++r) f(r, c);
  }
}
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
  void frob_norm(const BatchRef& a, float* norms) override;
  void scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                  const BatchRef& dst) override;

  void muon_momentum_norm(std::span<const MuonSlot> slots, float mu, bool nesterov, float* norms,
                          int32_t* status) override;
  void muon_momentum_apply(std::span<const MuonSlot> slots, float mu, bool nesterov,
                           const int32_t* status, const ScaleSpec& scale, bool transpose,
                           const BatchRef& x) override;
  void muon_update(std::span<const MuonSlot> slots, std::span<const MuonUpdateCoef> coef,
                   const int32_t* status, const BatchRef& o, bool transpose) override;

  void adamw_check(std::span<const AdamSlot> slots, int32_t* status) override;
  void adamw_update(std::span<const AdamSlot> slots, std::span<const AdamCoef> coef,
                    const int32_t* status) override;
  void count_status(const int32_t* status, int64_t n, int64_t* counter) override;

  void gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a, Op op_b,
                   const BatchRef& b, double alpha, double beta, const BatchRef* c_in,
                   const BatchRef& c) override;
  void copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst) override;
  void cache_gate(const CacheGateArgs& args) override;
  void fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter) override;

  int64_t batch_parts(int64_t count) const override;
  void run_parts(int64_t parts, const std::function<void(int64_t)>& f) override;
};

}  // namespace distmuon
