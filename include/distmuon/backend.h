// The Backend interface: a small set of batched operations on buffers in one device's memory.
// Everything above it (orthogonalization, the optimizer, the distributed engine) is written
// once against this interface and never branches on the backend. The CPU backend is the
// numerical reference; the CUDA backend is where speed lives.
//
// Conventions
// - Matrices are row-major (MatRef / BatchRef). A batch holds same-shape matrices.
// - Operations are asynchronous with respect to the host on devices that allow it; they run in
//   issue order on the backend's current stream. Scalars that depend on data (norms, status
//   flags) stay in device memory so that no operation needs a host synchronisation.
// - Half-precision inputs are multiplied with fp32 accumulation and rounded once on output.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "distmuon/types.h"

namespace distmuon {

enum class Op : int { kN = 0, kT = 1 };  // use a matrix as stored, or its transpose

// An owning allocation in backend memory (RAII: released with the Buffer).
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* ptr, size_t bytes, std::function<void(void*)> release)
      : ptr_(ptr), bytes_(bytes), release_(std::move(release)) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void reset();
  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

// How `scale_copy` scales each matrix b: factor_b = alpha / (norm_mul * norms[b] + eps) when
// `norms` (device memory, one double per matrix) is given, else factor_b = alpha. Norms are
// doubles because the Frobenius norm of a finite float32 matrix can exceed float's range (a
// gradient near 3e38 has a norm of 1e40: as a float it overflowed to Inf and a finite gradient
// was skipped as non-finite). They keep float's precision (src/backend/muon_ref.h).
struct ScaleSpec {
  const double* norms = nullptr;
  double norm_mul = 1.0;
  double eps = 1e-7;
  double alpha = 1.0;
};

// Per-matrix scalars of the final Muon update W <- W * decay - step * O.
struct MuonUpdateCoef {
  float decay = 1.0f;  // 1 - lr * weight_decay
  float step = 0.0f;   // lr * shape scale
};

// One Muon matrix as the fused elementwise kernels see it. `grad` and `weight` may have any
// float dtype; `momentum` is fp32 (or bf16 by option). All three have the same shape.
struct MuonSlot {
  MatRef grad;
  MatRef momentum;
  MatRef weight;
  // Optional (backend memory, one int64): how often pass 2 skipped this matrix, kept beside its
  // momentum, so that a skipped step does not count as one taken.
  int64_t* skips = nullptr;
  // Pass 3's coefficients (backend memory, one MuonUpdateCoef), read on the device so that a
  // captured step replays with the values uploaded for the step it runs in. Only muon_update
  // reads it.
  const MuonUpdateCoef* coef = nullptr;
};

// One batch of a fused Muon pass issued together with others (Backend::muon_pass_grouped): the
// arguments of its single-batch call. Each pass reads the fields its single call takes.
enum class MuonPass { kNorm, kApply, kUpdate };  // muon_momentum_norm / _apply / muon_update
struct MuonPassBatch {
  std::span<const MuonSlot> slots;
  const float* mu = nullptr;  // kNorm, kApply
  bool nesterov = false;      // kNorm, kApply
  double* norms = nullptr;    // kNorm writes
  int32_t* status = nullptr;  // kNorm writes; kApply reads; kUpdate reads (may be null)
  ScaleSpec scale;            // kApply
  bool transpose = false;     // kApply, kUpdate
  BatchRef x;                 // kApply writes; kUpdate reads
};

// Hyperparameters of one AdamW step; per tensor so that parameter groups can differ.
struct AdamCoef {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based step count for bias correction of slots without a step counter
};

// One AdamW tensor (flat, `numel` elements). `param`/`grad` any float dtype, exp_avg and
// exp_avg_sq fp32.
struct AdamSlot {
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType param_dtype = DType::kF32;
  DType grad_dtype = DType::kF32;
  int64_t numel = 0;
  // The tensor's step count in backend memory (one int64: steps taken so far), or null. When
  // set, adamw_update reads it on the device, so a captured CUDA graph replays with the right
  // bias correction; see adamw_update.
  int64_t* step = nullptr;
  // The step's hyperparameters (backend memory, one AdamCoef; required by adamw_update), read
  // on the device like `step`.
  const AdamCoef* coef = nullptr;
};

// A recorded sequence of backend operations (Backend::capture) that runs again, on the same
// buffers, each time replay() is called. It reads every buffer, scalars included, at replay.
class BackendGraph {
 public:
  virtual ~BackendGraph() = default;
  virtual void replay() = 0;  // issued on the backend's current stream
};

// Status values written by the checking kernels (int32 per matrix/tensor, device memory).
enum StepStatus : int32_t { kStatusOk = 0, kStatusNonFinite = 1 };

// A per-matrix predicate in device memory: matrix i of a batch is active when
// flags[i] == value. Masked operations leave every output of an inactive matrix untouched and
// do not read its inputs, so a device can skip that work without the host reading the flags.
struct BatchMask {
  const int32_t* flags = nullptr;  // one per matrix of the batch, device memory
  int32_t value = 1;
};

// One product of Backend::gemm_grouped.
struct GemmProblem {
  Op op_a = Op::kN;
  BatchRef a;
  Op op_b = Op::kN;
  BatchRef b;
  double alpha = 1.0, beta = 0.0;
  BatchRef c_in;  // data null: none (beta ignored)
  BatchRef c;
};

// One term of Backend::lincomb_grouped: out = alpha a + beta b + diag I.
struct LincombProblem {
  double alpha = 1.0;
  BatchRef a;
  double beta = 0.0;
  BatchRef b;  // data null: none (beta ignored)
  double diag = 0.0;
  BatchRef out;
};

// ---- CacheMuon gate (docs/algorithms.md section 5) -------------------------------------------

// What cache_gate decided for a matrix (int32 per matrix, device memory).
enum CacheDecision : int32_t {
  kCacheRefresh = 0,  // run the fresh solve and refill the entry
  kCacheHit = 1,      // use the cached transform: D = Q X
  kCacheSkip = 2,     // the step skips this matrix (non-finite input): entry untouched
  kCacheCheck = 3,    // (planning only) the entry is due for its residual test
};

// Residual histogram of cache_gate: bin 0 holds r < 1e-3, bin b in [1, 24] holds
// 1e-3 * 10^((b-1)/4) <= r < 1e-3 * 10^(b/4), the last bin r >= 1e3.
constexpr int kCacheHistBins = 26;

// Per-matrix statistics cache_gate accumulates: `kCacheStatFields` doubles per matrix.
enum CacheStatField : int {
  kCacheStatHits = 0,
  kCacheStatRefreshes,  // every refresh, forced ones included
  kCacheStatForced,     // refreshes without a usable entry: empty, stale, wrong key, non-finite
  kCacheStatSkips,
  kCacheStatUnchecked,  // refreshes of a usable entry whose test the back-off left out
  kCacheStatBatch,      // refreshes of a matrix that passed its own test, sent by the per-batch
                        // gate because another matrix of its call did not
  kCacheStatTested,     // residuals computed for a test (what the test's FLOPs are charged on)
  kCacheStatChecks,     // finite residuals of tested entries (the right key, due; stale
                        // ones included): the sums, extremes and histogram below
  kCacheStatResSum,
  kCacheStatResSqSum,
  kCacheStatResMin,     // initialise to +inf
  kCacheStatResMax,
  kCacheStatResLast,
  kCacheStatHist,       // first of kCacheHistBins counters
  kCacheStatFields = kCacheStatHist + kCacheHistBins,
};

// Arguments of Backend::cache_gate; every pointer is device memory with `count` entries.
// For matrix i, with r = residual[i] * residual_scale:
//   skip      if status != null and status[i] != kStatusOk: nothing is written but stats[Skips];
//   tested    = entry_key[i] == key and (misses == null or cache_ref::due_for_check(misses[i],
//               backoff)): r is read only for these (elsewhere it may be garbage);
//   usable    = entry_key[i] == key and (max_age <= 0 or age[i] < max_age);
//   hit       = usable and tested and r finite and r <= gamma;
//   on a hit: age[i] += 1, misses[i] = 0; on a refresh: age[i] = 0, entry_key[i] = key (the
//   caller then refills Q in the same stream), misses[i] += 1 when the entry was usable (a
//   failed or left-out test), else 0. stats (if given) count the decision; when the entry was
//   tested and r is finite (stale entries included), r enters the residual stats. A non-finite
//   Q needs no test of its own: every residual is a product with Q, so it is non-finite too.
// With `batch` (the per-batch gate, CacheGate::kBatch) the call is all or nothing: it hits only
// if every matrix that is not skipped would hit by the rule above; otherwise each of them
// refreshes, and one that would have hit alone is counted in stats[Batch] and its misses move as
// for a failed test (cache_ref::gate_one says why). Skipped matrices never block the others.
// With `plan`, only decision[i] is written, before any residual exists: kCacheCheck where the
// matrix will be tested, kCacheSkip or kCacheRefresh elsewhere (so that the caller can leave
// the residual's work out when no matrix needs it).
struct CacheGateArgs {
  int64_t count = 0;
  const double* residual = nullptr;  // raw norms from frob_norm
  double residual_scale = 1.0;       // 1/sqrt(m) (exact) or 1/sqrt(m k) (k probes)
  const int32_t* status = nullptr;   // optional step status (kStatusOk = take part)
  double key = 0;                    // fingerprint of the current shape/dtype/algorithm, != 0
  double* entry_key = nullptr;       // in/out: key the entry was filled under (0: empty)
  float* age = nullptr;              // in/out: hits since the entry was filled
  int32_t max_age = 0;               // maximum staleness S (<= 0: unlimited)
  double gamma = 0;
  int32_t* decision = nullptr;       // out: CacheDecision
  double* stats = nullptr;           // optional, count x kCacheStatFields, accumulated
  float* misses = nullptr;           // optional in/out: refreshes since the entry's last hit
  int32_t backoff = 0;               // longest interval between tests after misses (<= 1: none)
  bool plan = false;                 // write only the decisions kCacheCheck / Skip / Refresh
  bool batch = false;                // one decision for the whole call (ignored by `plan`)
};

// One contiguous copy of `numel` elements, converting src_dtype to dst_dtype where they differ
// (Backend::copy_blocks).
struct BlockCopy {
  const void* src = nullptr;
  DType src_dtype = DType::kF32;
  void* dst = nullptr;
  DType dst_dtype = DType::kF32;
  int64_t numel = 0;
};

// What a backend holds in its memory (Backend::memory_use): the Buffers it made that are still
// alive and, CUDA, its own workspace; now and at the most since the backend was made. The
// caller's memory (parameters, gradients a framework owns) is not in it.
struct MemoryUse {
  int64_t bytes = 0;
  int64_t peak_bytes = 0;
};

// The count behind memory_use, shared with the release of every Buffer counted in it (a Buffer
// may outlive its backend). Thread-safe.
class MemoryCounter {
 public:
  void add(int64_t bytes);  // + held, - released
  MemoryUse use() const { return {bytes_.load(), peak_.load()}; }

 private:
  std::atomic<int64_t> bytes_{0}, peak_{0};
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // e.g. "cpu (OpenBLAS 0.3.21, 2 threads)"

  // ---- memory -------------------------------------------------------------------------------
  virtual Buffer alloc(size_t bytes) = 0;
  // Bytes held (see MemoryUse); a backend that does not count reports zeros.
  MemoryUse memory_use() const { return memory_->use(); }
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // device to device
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  // A few kilobytes from host memory to backend memory, in stream order, without a host
  // synchronisation: the host bytes may be reused once the call returns, and inside a capture
  // the copy is recorded with the bytes of this call (CUDA: they travel as kernel parameters).
  // This is how a step's hyperparameters reach the device. Default: copy_from_host.
  virtual void upload_small(void* dst, const void* host_src, size_t bytes);
  // Many copies in one call: the distributed modes move each bucket's rows between the
  // parameters, the stages and the communication buffers, a block per matrix and rank. No copy
  // may read or write what another copy of the call writes: they may run concurrently. Every
  // copy is checked before any is issued. Default: one copy (or scale_copy, to convert) each;
  // CUDA: one launch per 128.
  virtual void copy_blocks(std::span<const BlockCopy> copies);
  // Waits until every operation issued so far has completed.
  virtual void synchronize() = 0;
  // The device stream operations are issued on (CUDA: the cudaStream_t, nullptr being the
  // legacy default stream); nullptr where there is none (CPU).
  virtual void* native_stream() const { return nullptr; }

  // ---- graphs --------------------------------------------------------------------------------
  // Records what `issue` issues into a graph instead of running it. Returns null in two cases:
  // this backend cannot capture (the default: `issue` is not called), or the capture failed (an
  // operation that cannot be captured, such as an allocation or a host read, ran inside `issue`;
  // the error is logged and cleared, and nothing issued ran). The operations must not depend on
  // host values that change between replays: per-step scalars go through upload_small before
  // the replay, outside the graph.
  virtual std::unique_ptr<BackendGraph> capture(const std::function<void()>& issue);
  // Whether the current stream is being captured by someone else (a caller's CUDA graph): then
  // the engine issues into that capture rather than capturing or replaying its own graph.
  virtual bool capturing() const { return false; }
  // Changes whenever the backend changes something a captured graph holds by address or by
  // choice (CUDA: its workspace, its symmetric-kernel choices): a graph captured under another
  // epoch must not be replayed (the engine keys its step graph by it). Default: never changes.
  virtual uint64_t capture_epoch() const { return 0; }
  // A block of operations that the device skips when no matrix of a batch is selected: inside a
  // graph this backend captures (CUDA: a conditional graph node, its condition set by a kernel
  // from `mask` when the graph runs), what is issued between begin_if_selected and
  // end_if_selected runs only if some flags[i] == value, i < count. Everywhere else (eager
  // issue, a caller's capture, the default) the block always runs, and its masked operations
  // find no work. Returns whether a block was opened; only then must end_if_selected follow.
  // Blocks nest. A block may hold only device work: no host read, no synchronisation.
  virtual bool begin_if_selected(const BatchMask& mask, int64_t count);
  // A block with two bodies: what is issued after begin_if_some_selected runs when some but not
  // all of the flags select, what is issued after else_if_all_selected when all do, and nothing
  // when none does. It opens where begin_if_selected would; where it does not (returns false),
  // the caller issues the first body alone, which therefore must be right for any selection.
  // The second body may drop the mask (CacheMuon: a batch that refreshes whole runs the tuned
  // kernels of a plain solve). end_if_selected closes it.
  virtual bool begin_if_some_selected(const BatchMask& mask, int64_t count);
  virtual void else_if_all_selected() {}
  virtual void end_if_selected() {}

  // ---- matrix products ----------------------------------------------------------------------
  // C = alpha * op(A) op(B) + beta * Cin, batched. Cin may alias C or be null (beta ignored).
  virtual void gemm(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha,
                    double beta, const BatchRef* c_in, const BatchRef& c) = 0;
  // Same contract, but the caller guarantees the product is symmetric (X X^T, or a product of
  // two commuting symmetric matrices). Only one triangle is computed and then mirrored, so
  // the result is exactly symmetric. Cin must be symmetric as well.
  virtual void gemm_symmetric(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b,
                              double alpha, double beta, const BatchRef* c_in,
                              const BatchRef& c) = 0;

  // Several products of different shapes: problems[i] is C = alpha * op(A) op(B) + beta * Cin
  // over its own batch (c_in.data null: no source; it may alias c). A backend with a grouped
  // kernel (grouped_gemm_native) runs them in as few launches as it can (CUDA: one per dtype,
  // kind of B and 24 problems), which pays off where each product is
  // too small to fill the device. Each matrix's result depends only on its own operands, not
  // on the other problems of the call, but it differs from gemm()'s by rounding: callers that
  // must agree bit for bit take the same route for the same shapes (OrthoConfig's
  // grouped_products). No problem may write what another reads. Default: gemm() per problem.
  virtual void gemm_grouped(std::span<const GemmProblem> problems);
  // Whether gemm_grouped is one launch for this work dtype (else it is the default's loop).
  virtual bool grouped_gemm_native(DType) const { return false; }

  // ---- small batched helpers ----------------------------------------------------------------
  // out = alpha * a + beta * b + diag * I (b may be null; diag needs square matrices).
  virtual void lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b, double diag,
                       const BatchRef& out) = 0;
  // lincomb for batches of several shapes at once: each result equals that problem's lincomb()
  // bit for bit, whatever shares the call. Every problem is checked before any is issued. No
  // problem may write what another reads. Default: lincomb() per problem (CUDA: one launch per
  // 48 matrices, where a solve of many small classes would launch one per class).
  virtual void lincomb_grouped(std::span<const LincombProblem> problems);
  // norms[i] = ||a_i||_F, accumulated in double and rounded to float's precision in double's
  // range (src/backend/muon_ref.h): every finite input has a finite norm. Non-finite entries
  // make the norm NaN/Inf.
  virtual void frob_norm(const BatchRef& a, double* norms) = 0;
  // dst_i = factor_i * op(src_i) rounded to dst's dtype (transpose: dst is src^T).
  virtual void scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                          const BatchRef& dst) = 0;

  // ---- fused Muon elementwise passes ---------------------------------------------------------
  // `mu` is one float in backend memory (read on the device: a momentum schedule does not
  // change what a captured step issues).
  // Pass 1 (reads only): with B' = mu * B + G, U = G + mu * B' (nesterov) or B', and V its
  // scaled float form (src/backend/muon_ref.h), writes norms[i] = ||V_i||_F and status[i] =
  // kStatusNonFinite if G_i has NaN/Inf or B'_i overflows B's dtype. Every finite gradient
  // whose momentum fits has a finite norm.
  virtual void muon_momentum_norm(std::span<const MuonSlot> slots, const float* mu, bool nesterov,
                                  double* norms, int32_t* status) = 0;
  // Pass 2: for slots whose status is ok, B <- B' and x_i = factor_i * V_i (transposed when
  // `transpose`; the product in double, rounded once to x's dtype), with factor_i from `scale`
  // (normally the norms of pass 1, with eps * muon_ref::kMuonInputScale). Skipped slots keep B,
  // get x_i = 0 and count one skip in their `skips` counter.
  virtual void muon_momentum_apply(std::span<const MuonSlot> slots, const float* mu, bool nesterov,
                                   const int32_t* status, const ScaleSpec& scale, bool transpose,
                                   const BatchRef& x) = 0;
  // Pass 3: for slots whose status is ok, W <- decay * W - step * O_i (O_i^T when transpose),
  // with each slot's `coef`.
  virtual void muon_update(std::span<const MuonSlot> slots, const int32_t* status,
                           const BatchRef& o, bool transpose) = 0;
  // One pass over several batches (different shapes, groups and outputs), as the single calls
  // one after the other would do it, in as few launches as the backend can (CUDA: one per 24
  // matrices and kind of kernel). Each matrix's result equals its single call's. Where a step
  // has many small matrices, their per-batch launches cost more than the work. No batch may
  // write what another reads. Default: the single call per batch.
  virtual void muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches);

  // ---- AdamW for the non-matrix parameters ---------------------------------------------------
  // status[i] = kStatusNonFinite if grad i has NaN/Inf.
  virtual void adamw_check(std::span<const AdamSlot> slots, int32_t* status) = 0;
  // Decoupled weight decay + bias-corrected Adam for slots whose status is ok (status may be
  // null: all ok), with each slot's `coef`. A slot with a step counter uses t = *step + 1 for
  // the bias correction and stores t back (only when it is updated: a skipped step does not
  // count); a slot without one uses coef.step (taken as 1 when below: the device cannot refuse
  // it without a host read). Bias terms: 1 - beta^t in double, then fp32 (src/backend/adam_ref.h).
  virtual void adamw_update(std::span<const AdamSlot> slots, const int32_t* status) = 0;

  // counter[0] += number of non-zero entries of status[0..n) (device memory, int64 counter), so
  // that skip counts accumulate without a host synchronisation.
  virtual void count_status(const int32_t* status, int64_t n, int64_t* counter) = 0;

  // ---- masked and CacheMuon operations ---------------------------------------------------------
  // The defaults below are correct on any backend but synchronise and round-trip through host
  // memory; a device backend overrides them with kernels that read flags on the device. A
  // masked product can skip work without the host knowing the count, e.g. a batched kernel
  // whose thread blocks read flags[batch index] and return, or a grouped GEMM whose per-group
  // problem sizes live in device memory and are set to zero for inactive matrices.

  // gemm (symmetric = false) or gemm_symmetric (true) for the matrices `mask` selects; C (and
  // the reading of A, B, Cin) of the others is skipped. Selected matrices get exactly the bits
  // the unmasked operation gives.
  virtual void gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a,
                           Op op_b, const BatchRef& b, double alpha, double beta,
                           const BatchRef* c_in, const BatchRef& c);
  // dst_i = src_i rounded to dst's dtype for the matrices `mask` selects; others untouched.
  // This is the device-side select: e.g. "out_i = candidate_i where decision_i == hit".
  virtual void copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst);
  // Whether gemm_masked and copy_masked on batches of dtype t (every operand in t, A not
  // transposed) can be captured in a graph: they decide on the device, without a host read.
  // Only such operations may be issued inside a conditional block (begin_if_selected).
  // Default: false (the defaults above synchronise).
  virtual bool masked_capturable(DType t) const;
  // The CacheMuon accept/refresh decision (see CacheGateArgs), as cache_ref::gate_call takes
  // it; a device backend takes it on the device (with `batch`, reducing over the call's
  // matrices) without a host synchronisation. Default: on the host, synchronising.
  virtual void cache_gate(const CacheGateArgs& args);
  // Fills dst with standard normal values: element (b, r, c) gets normal_sample(seed,
  // counter + (b * rows + r) * cols + c) (src/backend/cache_ref.h defines it exactly, so
  // every backend draws the same numbers), rounded to dst's dtype.
  virtual void fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter);
  // keys[b] (backend memory) = a hash of matrix b alone: of 64 of its elements, evenly spaced
  // over its positions, with their bits and positions, and of its shape (cache_ref.h). The same
  // matrix gives the same key in any batch and on any backend.
  virtual void fingerprint(const BatchRef& x, uint64_t* keys);
  // Normal values drawn per matrix: element (b, r, c) of dst gets normal_sample(seed ^ keys[b],
  // r * cols + c), rounded to dst's dtype (keys in backend memory, one per matrix). With keys
  // from fingerprint(), a matrix's draws depend on it alone, not on its batch (CacheMuon's
  // probes: every mode decides as one process).
  virtual void fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys);

  // ---- measurement support (src/measure times algorithms through these) ---------------------
  // Median milliseconds of `repeats` runs of `run`, each after an untimed `prepare` (may be
  // empty; e.g. restoring an input the run overwrites). Callers warm up first. On a device the
  // time between events on the backend's stream around each run; default: the host clock
  // around synchronize().
  virtual double time_ms(int repeats, const std::function<void()>& prepare,
                         const std::function<void()>& run);
  // What this backend's measurements depend on (device, driver, library versions), so that a
  // stored measurement is never applied to another machine or library; empty: this backend is
  // not tuned (its algorithm for Iteration::kAuto is the heuristic of resolve()). Default: empty.
  virtual std::string tuning_fingerprint() const { return {}; }
  // Kernel-variant tuning, the backend's own business: measures its variants of the products an
  // orthogonalization of `count` m x n matrices (m <= n) issues and uses the fastest from now
  // on. Default: nothing to tune.
  virtual void tune_kernels(int64_t m, int64_t n, int64_t count);
  // The per-shape kernel choices as JSON array text, for the measurement store to keep, and
  // taking such a text back (entries it does not understand are an error). Default: "[]".
  virtual std::string kernel_choices_json() const { return "[]"; }
  virtual void load_kernel_choices_json(const std::string& json);

  // ---- host concurrency ----------------------------------------------------------------------
  // How many consecutive parts an algorithm may split a batch of `count` independent matrices
  // into, to issue each part's operations from its own host thread through run_parts. A device
  // backend answers 1 (one kernel already covers the batch); the CPU backend its OpenMP threads,
  // so that each thread runs whole matrices and the threads meet once per batch, not once per
  // operation. Results do not depend on the split.
  virtual int64_t batch_parts(int64_t count) const;
  // Calls f(part) for every part in [0, parts), concurrently where batch_parts allowed it. The
  // first exception is rethrown once every part has returned.
  virtual void run_parts(int64_t parts, const std::function<void(int64_t part)>& f);

  // A Buffer of `bytes` at `ptr` that `release` frees, counted in memory_use() while it lives:
  // the backend's own allocations, and memory of its device that another library allocated for
  // the engine (a communicator's window, Communicator::alloc_window).
  Buffer counted(void* ptr, size_t bytes, std::function<void(void*)> release);

 protected:
  MemoryCounter& memory() { return *memory_; }  // memory held outside Buffers (a workspace)

 private:
  std::shared_ptr<MemoryCounter> memory_ = std::make_shared<MemoryCounter>();
};

// Creates the backend for `kind`: "cpu", "cuda" (the calling thread's current CUDA device) or
// "cuda:N"; throws with a clear message when the build or the machine does not support it.
std::unique_ptr<Backend> make_backend(const std::string& kind);

// The threads of the CPU backend's loops (a batch's matrices spread over them while OpenBLAS
// runs on one thread, docs/design.md). threads >= 1 fixes the count for the process: the
// PyTorch front passes torch's intra-op pool size (torch.get_num_threads()) before each step,
// so that the engine uses the threads torch uses, whichever OpenMP runtime torch has and
// whichever thread steps. 0 (the start) takes the calling thread's OpenMP setting
// (omp_get_max_threads). cpu_threads() is the count the next loop of the calling thread gets.
void set_cpu_threads(int threads);
int cpu_threads();

// True when this build has the CUDA backend and a CUDA device is visible.
bool cuda_available();
// CUDA devices visible to this process (0 without CUDA or without a device).
int cuda_device_count();

}  // namespace distmuon
