// The CUDA backend (NVIDIA Hopper, sm_90a): every Backend operation on one device, batched over
// same-shape matrices, issued on a caller-given stream, with a caller-visible workspace.
//
// - Dense products: cuBLASLt (bf16/fp16/fp32/fp64 inputs, fp32 accumulation for half types).
// - Symmetric products: a CUTLASS sm90 warp-specialized kernel whose tile scheduler visits
//   only the lower-triangle tiles, followed by a mirror kernel (or, as a fallback, a dense
//   cuBLASLt product and the mirror). Result exactly symmetric.
// - Fused elementwise passes: multi-tensor kernels whose pointer tables travel by value as
//   kernel parameters, so a whole step can be captured in a CUDA graph and replayed.
// Nothing in a step synchronises with the host or allocates memory: scratch lives in the
// workspace (owned by the backend unless the caller provides one) sized at construction.
// This header keeps CUDA's own headers out: cudaStream_t is declared as CUDA declares it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "distmuon/backend.h"

typedef struct CUstream_st* cudaStream_t;  // identical to the CUDA runtime's declaration

namespace distmuon {

// Which kernel computes a symmetric product. kAuto: the tuned choice, else a shape heuristic.
enum class SymKernel : int {
  kAuto = 0,
  kDenseMirror = 1,    // cuBLASLt dense product + mirror (any dtype, any layout)
  kTri128 = 2,         // CUTLASS sm90 cooperative, 128x128x64 tiles, lower tiles only
  kTri256x128 = 3,     // CUTLASS sm90 cooperative, 256x128x64 tiles, lower tiles only
  kTri128Cluster2 = 4,  // CUTLASS sm90 cooperative, 128x128x64 tiles, 2x1 cluster (multicast B)
  kTri128Pingpong = 5   // CUTLASS sm90 ping-pong (two consumer warpgroups, one tile each)
};
const char* sym_kernel_name(SymKernel k);
SymKernel parse_sym_kernel(const std::string& s);

struct CudaBackendOptions {
  // CUDA device ordinal; -1: the calling thread's current device (what torch.cuda.device(...) or
  // a launcher's cudaSetDevice(local_rank) selected).
  int device = -1;
  // Workspace the backend allocates for itself at construction (0: recommended size). Ignored
  // once set_workspace() hands it caller memory.
  size_t workspace_bytes = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(CudaBackendOptions options = {});
  ~CudaBackend() override;

  // ---- stream and workspace ------------------------------------------------------------------
  // Every later operation is issued on `stream`, taken literally: nullptr is the legacy default
  // stream (torch's default stream is that one, handle 0), never a stand-in for the backend's
  // own non-blocking stream, which it starts on. The workspace (and an engine's hyperparameters
  // in device memory) are used in stream order: switching streams while work is in flight is
  // the caller's ordering problem. A graph the engine captured replays on the current stream;
  // changing the workspace or a kernel choice (set_workspace, set_sym_kernel, set_sym_choice,
  // tune_kernels, load_kernel_choices_json) moves capture_epoch(), so the engine captures its
  // step again instead of replaying one that holds the old workspace or kernels.
  void set_stream(cudaStream_t stream);
  cudaStream_t stream() const;
  void* native_stream() const override { return stream(); }
  // Bytes of scratch the backend needs: cuBLASLt's workspace plus reduction partials.
  static size_t recommended_workspace_bytes();
  size_t workspace_bytes() const;
  // Use caller-owned device memory (at least 1 MiB; recommended_workspace_bytes() for full
  // speed) instead of the backend's own; nullptr returns to the backend's own.
  void set_workspace(void* ptr, size_t bytes);

  // ---- kernel choice -------------------------------------------------------------------------
  // Forces one symmetric-product kernel (kAuto: cache, then heuristic). Variants that cannot run
  // a given product (dtype, alignment, layout) fall back to kDenseMirror.
  void set_sym_kernel(SymKernel k);
  SymKernel sym_kernel() const;
  // The kernel a symmetric product of `count` m x m outputs with inner size k would use now.
  SymKernel resolve_sym_kernel(int64_t m, int64_t k, int64_t count, DType dtype) const;
  // Records a per-shape choice (the kernel tuner's result) for kAuto, with the times it measured
  // (kept in kernel_choices_json for the record; 0: not measured).
  void set_sym_choice(int64_t m, int64_t k, int64_t count, DType dtype, SymKernel choice,
                      double ms = 0, double dense_ms = 0);
  bool has_sm90_kernels() const;  // built with CUTLASS and running on compute capability 9.0

  std::string device_name() const;
  int sm_count() const;

  // ---- Backend -------------------------------------------------------------------------------
  Device device() const override;
  std::string name() const override;
  Buffer alloc(size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_blocks(std::span<const BlockCopy> copies) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override;

  void gemm(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha, double beta,
            const BatchRef* c_in, const BatchRef& c) override;
  void gemm_symmetric(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha,
                      double beta, const BatchRef* c_in, const BatchRef& c) override;
  // Launches of the grouped kernel (kernels/grouped_gemm_kernel.cuh) for bf16 and fp16 problems
  // with A as stored: one per dtype, kind of B (as stored, transposed) and 24 problems, usually
  // one per call. Other problems (fp32, A transposed) go through gemm() one by one.
  void gemm_grouped(std::span<const GemmProblem> problems) override;
  bool grouped_gemm_native(DType t) const override;
  void lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b, double diag,
               const BatchRef& out) override;
  void lincomb_grouped(std::span<const LincombProblem> problems) override;
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
  void muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches) override;
  void adamw_check(std::span<const AdamSlot> slots, int32_t* status) override;
  void adamw_update(std::span<const AdamSlot> slots, const int32_t* status) override;
  void upload_small(void* dst, const void* host_src, size_t bytes) override;
  // CUDA graphs, captured on a private stream (thread-local mode) and replayed on the current.
  std::unique_ptr<BackendGraph> capture(const std::function<void()>& issue) override;
  bool capturing() const override;
  uint64_t capture_epoch() const override;
  // Inside capture(): a conditional graph node (IF; SWITCH with two bodies for
  // begin_if_some_selected) whose bodies are captured on a stream of its own; a one-block kernel
  // sets its condition from the flags when the graph runs.
  bool begin_if_selected(const BatchMask& mask, int64_t count) override;
  bool begin_if_some_selected(const BatchMask& mask, int64_t count) override;
  void else_if_all_selected() override;
  void end_if_selected() override;
  void count_status(const int32_t* status, int64_t n, int64_t* counter) override;
  // Half precision on sm_90: the masked products' CUTLASS kernels (launch/cuda_masked.cc).
  bool masked_capturable(DType t) const override;
  // Masked and CacheMuon operations without host synchronisation (launch/cuda_masked.cc says how
  // a masked product skips the work of unselected matrices).
  void gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a, Op op_b,
                   const BatchRef& b, double alpha, double beta, const BatchRef* c_in,
                   const BatchRef& c) override;
  void copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst) override;
  void cache_gate(const CacheGateArgs& args) override;
  void fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter) override;
  void fingerprint(const BatchRef& x, uint64_t* keys) override;
  void fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys) override;
  // Measurement support (src/backend/cuda/tune/autotune.cc): device-event timing; the GPU, driver,
  // runtime and cuBLASLt versions as the fingerprint; the symmetric-kernel choices as JSON
  // entries {"m", "k", "count", "dtype", "kernel", "ms", "dense_ms"}.
  double time_ms(int repeats, const std::function<void()>& prepare,
                 const std::function<void()>& run) override;
  std::string tuning_fingerprint() const override;
  void tune_kernels(int64_t m, int64_t n, int64_t count) override;
  std::string kernel_choices_json() const override;
  void load_kernel_choices_json(const std::string& json) override;

  struct Impl;  // src/backend/cuda/launch/cuda_backend_impl.h

 private:
  // A masked product on the CUTLASS kernels with the flags in their tile scheduler; false when
  // no such kernel can run it.
  bool masked_on_device(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a, Op op_b,
                        const BatchRef& b, double alpha, double beta, const BatchRef* c_in,
                        const BatchRef& c, int64_t k);
  std::unique_ptr<Impl> impl_;
};

}  // namespace distmuon
