// A CPU test backend that can capture: while Backend::capture runs, every operation is recorded
// (its arguments copied) instead of run, and the graph runs the recorded operations again on
// each replay. What a device graph forbids fails the capture here too: allocations, host reads
// and synchronisation throw while recording. So the engine's graph logic is tested on the CPU
// with the same rules as on a GPU.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "distmuon/error.h"
#include "forwarding_backend.h"

namespace distmuon::test {

class RecordingBackend : public ForwardingBackend {
 public:
  int captures = 0;              // capture() calls
  int replays = 0;               // replay() calls
  bool fail_captures = false;    // every capture fails (as an uncapturable operation would)
  int64_t ops_run = 0;           // operations run eagerly or by a replay
  uint64_t epoch = 0;            // capture_epoch(): a test moves it as a workspace change would

  uint64_t capture_epoch() const override { return epoch; }

  std::unique_ptr<BackendGraph> capture(const std::function<void()>& issue) override {
    ++captures;
    recording_ = std::make_shared<std::vector<std::function<void()>>>();
    try {
      issue();
    } catch (const std::exception&) {
      recording_.reset();
      return nullptr;
    }
    auto ops = std::move(recording_);
    recording_.reset();
    if (fail_captures) return nullptr;
    return std::make_unique<Graph>(this, std::move(ops));
  }

  Buffer alloc(size_t b) override {
    forbid("alloc");
    return ForwardingBackend::alloc(b);
  }
  void copy_to_host(void* d, const void* s, size_t b) override {
    forbid("copy_to_host");
    ForwardingBackend::copy_to_host(d, s, b);
  }
  void copy_from_host(void* d, const void* s, size_t b) override {
    forbid("copy_from_host");
    ForwardingBackend::copy_from_host(d, s, b);
  }
  void synchronize() override { forbid("synchronize"); }
  void upload_small(void* d, const void* s, size_t b) override {
    std::vector<char> bytes(static_cast<const char*>(s), static_cast<const char*>(s) + b);
    run([=, this] { cpu_.copy_from_host(d, bytes.data(), bytes.size()); });
  }
  void copy(void* d, const void* s, size_t b) override {
    run([=, this] { cpu_.copy(d, s, b); });
  }
  void fill_zero(void* d, size_t b) override {
    run([=, this] { cpu_.fill_zero(d, b); });
  }
  void gemm(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double al, double be,
            const BatchRef* ci, const BatchRef& c) override {
    const std::optional<BatchRef> cin = ci ? std::optional<BatchRef>(*ci) : std::nullopt;
    run([=, this] { cpu_.gemm(oa, a, ob, b, al, be, cin ? &*cin : nullptr, c); });
  }
  void gemm_symmetric(Op oa, const BatchRef& a, Op ob, const BatchRef& b, double al, double be,
                      const BatchRef* ci, const BatchRef& c) override {
    const std::optional<BatchRef> cin = ci ? std::optional<BatchRef>(*ci) : std::nullopt;
    run([=, this] { cpu_.gemm_symmetric(oa, a, ob, b, al, be, cin ? &*cin : nullptr, c); });
  }
  void lincomb(double al, const BatchRef& a, double be, const BatchRef* b, double d,
               const BatchRef& o) override {
    const std::optional<BatchRef> bb = b ? std::optional<BatchRef>(*b) : std::nullopt;
    run([=, this] { cpu_.lincomb(al, a, be, bb ? &*bb : nullptr, d, o); });
  }
  void frob_norm(const BatchRef& a, double* n) override {
    run([=, this] { cpu_.frob_norm(a, n); });
  }
  void scale_copy(const BatchRef& s, bool t, const ScaleSpec& sc, const BatchRef& d) override {
    run([=, this] { cpu_.scale_copy(s, t, sc, d); });
  }
  void muon_momentum_norm(std::span<const MuonSlot> s, const float* mu, bool nes, double* n,
                          int32_t* st) override {
    std::vector<MuonSlot> v(s.begin(), s.end());
    run([=, this] { cpu_.muon_momentum_norm(v, mu, nes, n, st); });
  }
  void muon_momentum_apply(std::span<const MuonSlot> s, const float* mu, bool nes,
                           const int32_t* st, const ScaleSpec& sc, bool t,
                           const BatchRef& x) override {
    std::vector<MuonSlot> v(s.begin(), s.end());
    run([=, this] { cpu_.muon_momentum_apply(v, mu, nes, st, sc, t, x); });
  }
  void muon_update(std::span<const MuonSlot> s, const int32_t* st, const BatchRef& o,
                   bool t) override {
    std::vector<MuonSlot> v(s.begin(), s.end());
    run([=, this] { cpu_.muon_update(v, st, o, t); });
  }
  void adamw_check(std::span<const AdamSlot> s, int32_t* st) override {
    std::vector<AdamSlot> v(s.begin(), s.end());
    run([=, this] { cpu_.adamw_check(v, st); });
  }
  void adamw_update(std::span<const AdamSlot> s, const int32_t* st) override {
    std::vector<AdamSlot> v(s.begin(), s.end());
    run([=, this] { cpu_.adamw_update(v, st); });
  }
  void count_status(const int32_t* st, int64_t n, int64_t* c) override {
    run([=, this] { cpu_.count_status(st, n, c); });
  }
  // CacheMuon's operations, recorded like the rest (the base class's defaults read the host).
  void gemm_masked(const BatchMask& m, bool sym, Op oa, const BatchRef& a, Op ob,
                   const BatchRef& b, double al, double be, const BatchRef* ci,
                   const BatchRef& c) override {
    const std::optional<BatchRef> cin = ci ? std::optional<BatchRef>(*ci) : std::nullopt;
    run([=, this] { cpu_.gemm_masked(m, sym, oa, a, ob, b, al, be, cin ? &*cin : nullptr, c); });
  }
  void copy_masked(const BatchMask& m, const BatchRef& s, const BatchRef& d) override {
    run([=, this] { cpu_.copy_masked(m, s, d); });
  }
  void cache_gate(const CacheGateArgs& a) override {
    run([=, this] { cpu_.cache_gate(a); });
  }
  void fill_normal(const BatchRef& d, uint64_t seed, uint64_t counter) override {
    run([=, this] { cpu_.fill_normal(d, seed, counter); });
  }
  void fingerprint(const BatchRef& x, uint64_t* keys) override {
    run([=, this] { cpu_.fingerprint(x, keys); });
  }
  void fill_normal_keyed(const BatchRef& d, uint64_t seed, const uint64_t* keys) override {
    run([=, this] { cpu_.fill_normal_keyed(d, seed, keys); });
  }

 private:
  class Graph final : public BackendGraph {
   public:
    Graph(RecordingBackend* be, std::shared_ptr<std::vector<std::function<void()>>> ops)
        : be_(be), ops_(std::move(ops)) {}
    void replay() override {
      DM_CHECK(!be_->recording_, "replay inside a capture");
      ++be_->replays;
      for (const auto& op : *ops_) {
        op();
        ++be_->ops_run;
      }
    }

   private:
    RecordingBackend* be_;
    std::shared_ptr<std::vector<std::function<void()>>> ops_;
  };

  void run(std::function<void()> op) {
    if (recording_) {
      recording_->push_back(std::move(op));
      return;
    }
    op();
    ++ops_run;
  }
  void forbid(const char* what) const {
    DM_CHECK(!recording_, "recording backend: ", what, " inside a capture");
  }

  std::shared_ptr<std::vector<std::function<void()>>> recording_;
};

}  // namespace distmuon::test
