// A test backend that computes nothing: memory is host memory, every operation only counts
// itself. For properties of what the engine issues (how many operations a step takes) on model
// sizes the CPU could not compute in a test.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include "distmuon/backend.h"

namespace distmuon::test {

class NullBackend : public Backend {
 public:
  int64_t ops = 0;  // operations issued (memory operations included)

  Device device() const override { return Device{}; }
  std::string name() const override { return "null (computes nothing)"; }
  Buffer alloc(size_t b) override {
    void* p = std::calloc(1, b ? b : 1);
    return Buffer(p, b, [](void* q) { std::free(q); });
  }
  void copy(void*, const void*, size_t) override { ++ops; }
  void copy_to_host(void* d, const void*, size_t b) override { std::memset(d, 0, b); }
  void copy_from_host(void*, const void*, size_t) override { ++ops; }
  void fill_zero(void*, size_t) override { ++ops; }
  void synchronize() override {}
  void gemm(Op, const BatchRef&, Op, const BatchRef&, double, double, const BatchRef*,
            const BatchRef&) override { ++ops; }
  void gemm_symmetric(Op, const BatchRef&, Op, const BatchRef&, double, double, const BatchRef*,
                      const BatchRef&) override { ++ops; }
  // One launch per call, as a device with a grouped kernel (grouped_native) issues it.
  bool grouped_native = false;
  void gemm_grouped(std::span<const GemmProblem>) override { ++ops; }
  bool grouped_gemm_native(DType) const override { return grouped_native; }
  void lincomb(double, const BatchRef&, double, const BatchRef*, double, const BatchRef&) override {
    ++ops;
  }
  void lincomb_grouped(std::span<const LincombProblem> problems) override {
    if (grouped_native) ++ops;
    else Backend::lincomb_grouped(problems);
  }
  void frob_norm(const BatchRef&, double*) override { ++ops; }
  void scale_copy(const BatchRef&, bool, const ScaleSpec&, const BatchRef&) override { ++ops; }
  void muon_momentum_norm(std::span<const MuonSlot>, const float*, bool, double*,
                          int32_t*) override { ++ops; }
  void muon_momentum_apply(std::span<const MuonSlot>, const float*, bool, const int32_t*,
                           const ScaleSpec&, bool, const BatchRef&) override { ++ops; }
  void muon_update(std::span<const MuonSlot>, const int32_t*, const BatchRef&, bool) override {
    ++ops;
  }
  // A few launches per pass where the device groups them (as CUDA does), else one per batch.
  void muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches) override {
    if (grouped_native) ++ops;
    else Backend::muon_pass_grouped(pass, batches);
  }
  void adamw_check(std::span<const AdamSlot>, int32_t*) override { ++ops; }
  void adamw_update(std::span<const AdamSlot>, const int32_t*) override { ++ops; }
  void count_status(const int32_t*, int64_t, int64_t*) override { ++ops; }
};

}  // namespace distmuon::test
