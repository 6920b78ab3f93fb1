// CudaBackend: device, stream, workspace, memory operations, and the dispatch of the fused
// passes to their launchers. The products live in cuda_gemm.cc.
#include <cstring>
#include <sstream>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch/cuda_backend_impl.h"
#include "backend/cuda/launch/sym_gemm.h"
#include "common/log.h"
#include "distmuon/env.h"

namespace distmuon {

namespace cuda {
const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}
}  // namespace cuda

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

bool cuda_available() { return cuda_device_count() > 0; }

std::unique_ptr<Backend> make_cuda_backend(int device) {
  CudaBackendOptions o;
  o.device = device;
  return std::make_unique<CudaBackend>(o);
}

const char* sym_kernel_name(SymKernel k) {
  switch (k) {
    case SymKernel::kAuto: return "auto";
    case SymKernel::kDenseMirror: return "dense+mirror";
    case SymKernel::kTri128: return "tri128";
    case SymKernel::kTri256x128: return "tri256x128";
    case SymKernel::kTri128Cluster2: return "tri128c2";
    case SymKernel::kTri128Pingpong: return "tri128pp";
  }
  return "?";
}

SymKernel parse_sym_kernel(const std::string& s) {
  for (SymKernel k : {SymKernel::kAuto, SymKernel::kDenseMirror, SymKernel::kTri128,
                      SymKernel::kTri256x128, SymKernel::kTri128Cluster2, SymKernel::kTri128Pingpong})
    if (s == sym_kernel_name(k)) return k;
  DM_FAIL("unknown symmetric kernel '", s, "' (auto, dense+mirror, tri128, tri256x128, tri128c2, tri128pp)");
}

LtPlan::~LtPlan() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (op) cublasLtMatmulDescDestroy(op);
}

void CudaBackend::Impl::use_workspace(char* ptr, size_t bytes) {
  DM_CHECK(bytes >= (1u << 20), "cuda: workspace of ", bytes, " bytes is below the 1 MiB minimum");
  if (ptr != workspace || bytes != workspace_bytes) ++epoch;
  workspace = ptr;
  workspace_bytes = bytes;
  // cuBLASLt gets up to 32 MiB (NVIDIA's recommendation for Hopper), at most half.
  lt_bytes = std::min<size_t>(size_t{32} << 20, bytes / 2) / 256 * 256;
}

cuda::Scratch CudaBackend::Impl::scratch() const {
  cuda::Scratch s;
  s.partials = reinterpret_cast<double*>(workspace + lt_bytes);
  s.partial_count = (workspace_bytes - lt_bytes) / sizeof(double);
  s.counters = static_cast<unsigned*>(counters.get());
  s.counter_count = kCounters;
  return s;
}

size_t CudaBackend::recommended_workspace_bytes() { return size_t{48} << 20; }

CudaBackend::CudaBackend(CudaBackendOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  int n = 0;
  DM_CHECK(cudaGetDeviceCount(&n) == cudaSuccess && n > 0,
           "cuda backend: no CUDA device is visible (", cudaGetErrorString(cudaGetLastError()), ")");
  if (options.device < 0) DM_CHECK_CUDA(cudaGetDevice(&options.device));
  DM_CHECK(options.device < n, "cuda backend: device ", options.device, " does not exist (", n,
           " visible)");
  s.device = options.device;
  DM_CHECK_CUDA(cudaSetDevice(s.device));
  cudaDeviceProp p{};
  DM_CHECK_CUDA(cudaGetDeviceProperties(&p, s.device));
  s.name = p.name;
  s.sm_count = p.multiProcessorCount;
  s.cc_major = p.major;
  s.cc_minor = p.minor;
  s.own_stream = cuda::make_stream();
  s.stream = s.own_stream.get();
  cublasLtHandle_t lt = nullptr;
  DM_CHECK_CUBLAS(cublasLtCreate(&lt));
  s.lt = cuda::LtHandle(lt);
  const size_t ws = options.workspace_bytes ? options.workspace_bytes : recommended_workspace_bytes();
  s.own_workspace = cuda::device_alloc(ws);
  s.own_bytes = ws;
  memory().add(static_cast<int64_t>(ws));
  s.use_workspace(static_cast<char*>(s.own_workspace.get()), ws);
  s.counters = cuda::device_alloc(sizeof(unsigned) * Impl::kCounters);
  DM_CHECK_CUDA(cudaMemset(s.counters.get(), 0, sizeof(unsigned) * Impl::kCounters));
}

CudaBackend::~CudaBackend() {
  if (impl_) cudaStreamSynchronize(impl_->stream);  // release nothing still in use
}

void CudaBackend::set_stream(cudaStream_t stream) { impl_->stream = stream; }
cudaStream_t CudaBackend::stream() const { return impl_->stream; }
size_t CudaBackend::workspace_bytes() const { return impl_->workspace_bytes; }

void CudaBackend::set_workspace(void* ptr, size_t bytes) {
  if (!ptr) {  // back to the backend's own (allocated again if a caller's replaced it)
    if (!impl_->own_workspace) {
      impl_->own_workspace = cuda::device_alloc(impl_->own_bytes);
      memory().add(static_cast<int64_t>(impl_->own_bytes));
    }
    impl_->use_workspace(static_cast<char*>(impl_->own_workspace.get()), impl_->own_bytes);
    return;
  }
  impl_->use_workspace(static_cast<char*>(ptr), bytes);
  if (impl_->own_workspace) memory().add(-static_cast<int64_t>(impl_->own_bytes));
  impl_->own_workspace.reset();
}

void CudaBackend::set_sym_kernel(SymKernel k) {
  if (k != impl_->forced) ++impl_->epoch;
  impl_->forced = k;
}
SymKernel CudaBackend::sym_kernel() const { return impl_->forced; }
void CudaBackend::set_sym_choice(int64_t m, int64_t k, int64_t count, DType dtype, SymKernel c,
                                 double ms, double dense_ms) {
  impl_->choose(cuda::SymChoice{m, k, count, dtype, c, ms, dense_ms});
}
void CudaBackend::Impl::choose(const cuda::SymChoice& c) {
  const SymKey key{c.m, c.k, c.count, static_cast<int>(c.dtype)};
  const auto it = sym_choices.find(key);
  if (it == sym_choices.end() || it->second.kernel != c.kernel) ++epoch;
  sym_choices[key] = c;
}
bool CudaBackend::has_sm90_kernels() const {
  return cuda::sym_sm90_built() && impl_->cc_major == 9 && impl_->cc_minor == 0;
}

SymKernel CudaBackend::resolve_sym_kernel(int64_t m, int64_t k, int64_t count, DType dtype) const {
  const bool half = dtype == DType::kBF16 || dtype == DType::kF16;
  if (!half || !has_sm90_kernels()) return SymKernel::kDenseMirror;
  if (impl_->forced != SymKernel::kAuto) return impl_->forced;
  auto it = impl_->sym_choices.find({m, k, count, static_cast<int>(dtype)});
  if (it != impl_->sym_choices.end()) return it->second.kernel;
  return cuda::heuristic_sym_kernel(m, k, count, impl_->sm_count, true);
}

std::string CudaBackend::device_name() const { return impl_->name; }
int CudaBackend::sm_count() const { return impl_->sm_count; }
Device CudaBackend::device() const { return Device{DeviceKind::kCUDA, impl_->device}; }

std::string CudaBackend::name() const {
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  std::ostringstream os;
  os << "cuda (" << impl_->name << ", sm_" << impl_->cc_major << impl_->cc_minor << ", "
     << impl_->sm_count << " SMs, runtime " << rt / 1000 << "." << (rt % 1000) / 10 << ", cuBLASLt "
     << cublasLtGetVersion() << (has_sm90_kernels() ? ", sm90 symmetric kernels" : "") << ")";
  return os.str();
}

// ---- memory ----------------------------------------------------------------------------------

Buffer CudaBackend::alloc(size_t bytes) {
  if (bytes == 0) return Buffer();
  void* p = nullptr;
  DM_CHECK_CUDA(cudaMalloc(&p, bytes));
  return counted(p, bytes, [](void* q) { cudaFree(q); });
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) DM_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, impl_->stream));
}
void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  DM_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl_->stream));
  DM_CHECK_CUDA(cudaStreamSynchronize(impl_->stream));
}
void CudaBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  DM_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl_->stream));
  DM_CHECK_CUDA(cudaStreamSynchronize(impl_->stream));  // the host buffer may die on return
}
void CudaBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) DM_CHECK_CUDA(cudaMemsetAsync(dst, 0, bytes, impl_->stream));
}
void CudaBackend::synchronize() { DM_CHECK_CUDA(cudaStreamSynchronize(impl_->stream)); }

// ---- elementwise -----------------------------------------------------------------------------

void CudaBackend::lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b,
                          double diag, const BatchRef& out) {
  cuda::launch_lincomb(alpha, a, beta, b, diag, out, impl_->sm_count, impl_->stream);
}
void CudaBackend::lincomb_grouped(std::span<const LincombProblem> problems) {
  cuda::launch_lincomb_grouped(problems, impl_->sm_count, impl_->stream);
}
void CudaBackend::frob_norm(const BatchRef& a, double* norms) {
  cuda::launch_frob_norm(a, norms, impl_->scratch(), impl_->sm_count, impl_->stream);
}
void CudaBackend::copy_blocks(std::span<const BlockCopy> copies) {
  cuda::launch_copy_blocks(copies, impl_->sm_count, impl_->stream);
}
void CudaBackend::scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                             const BatchRef& dst) {
  cuda::launch_scale_copy(src, transpose, scale, dst, impl_->sm_count, impl_->stream);
}
void CudaBackend::muon_momentum_norm(std::span<const MuonSlot> slots, const float* mu,
                                     bool nesterov, double* norms, int32_t* status) {
  MuonPassBatch b;
  b.slots = slots;
  b.mu = mu;
  b.nesterov = nesterov;
  b.norms = norms;
  b.status = status;
  muon_pass_grouped(MuonPass::kNorm, {&b, 1});
}
void CudaBackend::muon_momentum_apply(std::span<const MuonSlot> slots, const float* mu,
                                      bool nesterov, const int32_t* status,
                                      const ScaleSpec& scale, bool transpose, const BatchRef& x) {
  MuonPassBatch b;
  b.slots = slots;
  b.mu = mu;
  b.nesterov = nesterov;
  b.status = const_cast<int32_t*>(status);  // read only in this pass
  b.scale = scale;
  b.transpose = transpose;
  b.x = x;
  muon_pass_grouped(MuonPass::kApply, {&b, 1});
}
void CudaBackend::muon_update(std::span<const MuonSlot> slots, const int32_t* status,
                              const BatchRef& o, bool transpose) {
  MuonPassBatch b;
  b.slots = slots;
  b.status = const_cast<int32_t*>(status);  // read only in this pass
  b.transpose = transpose;
  b.x = o;
  muon_pass_grouped(MuonPass::kUpdate, {&b, 1});
}
void CudaBackend::muon_pass_grouped(MuonPass pass, std::span<const MuonPassBatch> batches) {
  cuda::launch_muon_pass(pass, batches, impl_->scratch(), impl_->sm_count, impl_->stream);
}
void CudaBackend::adamw_check(std::span<const AdamSlot> slots, int32_t* status) {
  cuda::launch_adamw_check(slots, status, impl_->sm_count, impl_->stream);
}
void CudaBackend::adamw_update(std::span<const AdamSlot> slots, const int32_t* status) {
  cuda::launch_adamw_update(slots, status, impl_->sm_count, impl_->stream);
}
void CudaBackend::upload_small(void* dst, const void* host_src, size_t bytes) {
  cuda::launch_upload_small(dst, host_src, bytes, impl_->stream);
}

namespace {
class CudaGraph final : public BackendGraph {
 public:
  CudaGraph(cuda::GraphExec exec, const cudaStream_t& stream)
      : exec_(std::move(exec)), stream_(stream) {}
  void replay() override { DM_CHECK_CUDA(cudaGraphLaunch(exec_.get(), stream_)); }

 private:
  cuda::GraphExec exec_;
  const cudaStream_t& stream_;  // the backend's current stream, read at each replay
};
}  // namespace

std::unique_ptr<BackendGraph> CudaBackend::capture(const std::function<void()>& issue) {
  // Captured on a private stream: the legacy default stream (torch's default) cannot be
  // captured, and a graph does not remember the stream it was captured on.
  Impl& s = *impl_;
  DM_CHECK(!s.own_capture, "CudaBackend::capture: already capturing");
  if (!s.capture_stream) s.capture_stream = cuda::make_stream();
  const cudaStream_t current = s.stream;
  s.stream = s.capture_stream.get();
  s.own_capture = true;
  // What throws inside an open conditional block ends the block's capture first, so that every
  // stream leaves capture mode and the outer capture can be ended and discarded.
  auto issue_closing_blocks = [&] {
    try {
      issue();
    } catch (...) {
      if (!s.open_blocks.empty()) {
        while (!s.open_blocks.empty()) {
          cudaGraph_t body = nullptr;
          cudaStreamEndCapture(s.stream, &body);  // the body belongs to the node: not destroyed
          s.stream = s.open_blocks.back().parent;
          s.open_blocks.pop_back();
        }
        // The outer graph is ended here and deliberately not destroyed: destroying one whose
        // conditional body's capture was invalidated (a host read inside the block) crashed the
        // driver in cuGraphDestroy (the NCCL engine tests at 4 and 8 ranks on an H200). A failed
        // capture is rare (the engine stops trying after three); the graph's memory is the price.
        cudaGraph_t outer = nullptr;
        cudaStreamEndCapture(s.stream, &outer);
        cudaGetLastError();
      }
      throw;
    }
    DM_CHECK(s.open_blocks.empty(), "CudaBackend::capture: ", s.open_blocks.size(),
             " conditional block(s) left open");
  };
  try {
    cuda::GraphExec exec = cuda::capture_graph(s.stream, issue_closing_blocks);
    s.stream = current;
    s.own_capture = false;
    return std::make_unique<CudaGraph>(std::move(exec), s.stream);
  } catch (const std::exception& e) {
    s.stream = current;
    s.own_capture = false;
    cudaGetLastError();  // what failed inside the capture must not fail the next launch
    DM_LOG(kWarn, "cuda: a graph capture failed (", e.what(), "); the work is issued eagerly");
    return nullptr;
  }
}

uint64_t CudaBackend::capture_epoch() const { return impl_->epoch; }

namespace {

// Adds a conditional node of `type` with `bodies` bodies after the stream's current
// dependencies, its condition set by a kernel issued just before it from the flags; the stream
// then continues after the node. Returns the node's body graphs (owned by the node).
const cudaGraph_t* add_selected_node(cudaStream_t stream, const BatchMask& mask, int64_t count,
                                     cudaGraphConditionalNodeType type, unsigned bodies) {
  DM_CHECK(mask.flags != nullptr, "begin_if_selected: no flags");
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  DM_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &st, nullptr, &graph));
  DM_CHECK(st == cudaStreamCaptureStatusActive, "begin_if_selected: the stream is not capturing");
  cudaGraphConditionalHandle handle{};
  DM_CHECK_CUDA(cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
  cuda::launch_set_if_selected(handle, mask.flags, mask.value, count, bodies == 2, stream);
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n = 0;
  DM_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &st, nullptr, &graph, &deps, &edges, &n));
  cudaGraphNodeParams p{};
  p.type = cudaGraphNodeTypeConditional;
  p.conditional.handle = handle;
  p.conditional.type = type;
  p.conditional.size = bodies;
  cudaGraphNode_t node = nullptr;
  DM_CHECK_CUDA(cudaGraphAddNode(&node, graph, deps, edges, n, &p));
  DM_CHECK_CUDA(
      cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
  return p.conditional.phGraph_out;
}

}  // namespace

// Whether a block may open: inside capture(), with DISTMUON_GRAPH_CONDITIONALS on (read at each
// capture, so that a benchmark can compare the two in one process).
bool CudaBackend::Impl::blocks_open(int64_t count) const {
  return own_capture && count > 0 && env::get_bool("DISTMUON_GRAPH_CONDITIONALS");
}

void CudaBackend::Impl::capture_body(cudaGraph_t body, cudaGraph_t all_body) {
  const size_t depth = open_blocks.size();
  if (body_streams.size() <= depth) body_streams.push_back(cuda::make_stream());
  const cudaStream_t on = body_streams[depth].get();
  DM_CHECK_CUDA(cudaStreamBeginCaptureToGraph(on, body, nullptr, nullptr, 0,
                                              cudaStreamCaptureModeThreadLocal));
  open_blocks.push_back({stream, all_body});
  stream = on;
}

bool CudaBackend::begin_if_selected(const BatchMask& mask, int64_t count) {
  Impl& s = *impl_;
  if (!s.blocks_open(count)) return false;
  const cudaGraph_t* bodies = add_selected_node(s.stream, mask, count, cudaGraphCondTypeIf, 1);
  s.capture_body(bodies[0], nullptr);
  return true;
}

bool CudaBackend::begin_if_some_selected(const BatchMask& mask, int64_t count) {
  Impl& s = *impl_;
  if (!s.blocks_open(count)) return false;
  // SWITCH: body 0 for some, body 1 for all; the condition 2 (none) runs neither.
  const cudaGraph_t* bodies = add_selected_node(s.stream, mask, count, cudaGraphCondTypeSwitch, 2);
  s.capture_body(bodies[0], bodies[1]);
  return true;
}

void CudaBackend::else_if_all_selected() {
  Impl& s = *impl_;
  DM_CHECK(!s.open_blocks.empty() && s.open_blocks.back().all_body,
           "else_if_all_selected: no block of begin_if_some_selected is open");
  Impl::OpenBlock& b = s.open_blocks.back();
  cudaGraph_t done = nullptr;
  DM_CHECK_CUDA(cudaStreamEndCapture(s.stream, &done));
  DM_CHECK_CUDA(cudaStreamBeginCaptureToGraph(s.stream, b.all_body, nullptr, nullptr, 0,
                                              cudaStreamCaptureModeThreadLocal));
  b.all_body = nullptr;
}

void CudaBackend::end_if_selected() {
  Impl& s = *impl_;
  DM_CHECK(!s.open_blocks.empty(), "end_if_selected: no conditional block is open");
  DM_CHECK(!s.open_blocks.back().all_body,
           "end_if_selected: the block's second body (else_if_all_selected) was not issued");
  cudaGraph_t body = nullptr;
  const cudaError_t err = cudaStreamEndCapture(s.stream, &body);
  s.stream = s.open_blocks.back().parent;
  s.open_blocks.pop_back();
  DM_CHECK_CUDA(err);
}

bool CudaBackend::capturing() const {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(impl_->stream, &st) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

void CudaBackend::count_status(const int32_t* status, int64_t n, int64_t* counter) {
  cuda::launch_count_status(status, n, counter, impl_->stream);
}

}  // namespace distmuon
