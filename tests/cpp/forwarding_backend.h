// A test backend that forwards every required Backend operation to a CPU backend and keeps the
// base class's defaults for the optional ones (masked products, copies, the cache gate). Tests
// derive from it to exercise those defaults or to observe what an algorithm issues.
#pragma once

#include <string>

#include "backend/cpu/cpu_backend.h"

namespace distmuon::test {

class ForwardingBackend : public Backend {
 public:
  Device device() const override { return cpu_.device(); }
  std::string name() const override { return "forwarding to " + cpu_.name(); }
  Buffer alloc(size_t b) override { return cpu_.alloc(b); }
  void copy(void* d, const void* s, size_t b) override { cpu_.copy(d, s, b); }
  void copy_to_host(void* d, const void* s, size_t b) override { cpu_.copy_to_host(d, s, b); }
  void copy_from_host(void* d, const void* s, size_t b) override { cpu_.copy_from_host(d, s, b); }
  void fill_zero(void* d, size_t b) override { cpu_.fill_zero(d, b); }
  void synchronize() override {}
  void gemm(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double al, double be,
            const BatchRef* ci, const BatchRef& c) override {
    cpu_.gemm(oa, a, ob, b, al, be, ci, c);
  }
  void gemm_symmetric(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double al, double be,
                      const BatchRef* ci, const BatchRef& c) override {
    cpu_.gemm_symmetric(oa, a, ob, b, al, be, ci, c);
  }
  void lincomb(double al, const BatchRef& a, double be, const BatchRef* b, double d,
               const BatchRef& o) override {
    cpu_.lincomb(al, a, be, b, d, o);
  }
  void frob_norm(const BatchRef& a, double* n) override { cpu_.frob_norm(a, n); }
  void scale_copy(const BatchRef& s, bool t, const ScaleSpec& sc, const BatchRef& d) override {
    cpu_.scale_copy(s, t, sc, d);
  }
  void muon_momentum_norm(std::span<const MuonSlot> s, const float* mu, bool nes, double* n,
                          int32_t* st) override {
    cpu_.muon_momentum_norm(s, mu, nes, n, st);
  }
  void muon_momentum_apply(std::span<const MuonSlot> s, const float* mu, bool nes,
                           const int32_t* st, const ScaleSpec& sc, bool t,
                           const BatchRef& x) override {
    cpu_.muon_momentum_apply(s, mu, nes, st, sc, t, x);
  }
  void muon_update(std::span<const MuonSlot> s, const int32_t* st, const BatchRef& o,
                   bool t) override {
    cpu_.muon_update(s, st, o, t);
  }
  void adamw_check(std::span<const AdamSlot> s, int32_t* st) override { cpu_.adamw_check(s, st); }
  void adamw_update(std::span<const AdamSlot> s, const int32_t* st) override {
    cpu_.adamw_update(s, st);
  }
  void count_status(const int32_t* st, int64_t n, int64_t* c) override {
    cpu_.count_status(st, n, c);
  }

 protected:
  CpuBackend cpu_;
};

}  // namespace distmuon::test
