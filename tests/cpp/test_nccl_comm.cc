// The NCCL communicator on the GPU machine (world size 1 there): every collective on device
// memory, the in-place forms, split, counters, the timeout that aborts the communicator, the
// device-side wait (wait_on_stream), and the distributed engine over NCCL against the
// single-process engine on the CUDA backend. Skips cleanly where no CUDA device is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "common/half.h"
#include "distmuon/comm.h"
#include "distmuon/cuda_backend.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

class DeviceVec {  // a few values in CUDA memory (RAII)
 public:
  template <typename T>
  explicit DeviceVec(const std::vector<T>& host) : bytes_(host.size() * sizeof(T)) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(bytes_, 1)), cudaSuccess);
    cudaMemcpy(p_, host.data(), bytes_, cudaMemcpyHostToDevice);
  }
  ~DeviceVec() { cudaFree(p_); }
  template <typename T>
  std::vector<T> get() const {
    std::vector<T> out(bytes_ / sizeof(T));
    cudaDeviceSynchronize();
    cudaMemcpy(out.data(), p_, bytes_, cudaMemcpyDeviceToHost);
    return out;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

class NcclComm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_available()) GTEST_SKIP() << "no NCCL build or no CUDA device";
    comm_ = make_nccl_communicator(nccl_unique_id(), 0, 1);
  }
  std::unique_ptr<Communicator> comm_;
};

TEST_F(NcclComm, CollectivesOnOneRank) {
  Communicator& c = *comm_;
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.device().kind, DeviceKind::kCUDA);
  DeviceVec a(std::vector<float>{1, 2, 3}), b(std::vector<float>{0, 0, 0});
  c.all_reduce(a.as<float>(), b.as<float>(), 3, CommType::kF32, ReduceOp::kSum).wait();
  EXPECT_EQ(b.get<float>(), (std::vector<float>{1, 2, 3}));
  c.reduce(a.as<float>(), a.as<float>(), 3, CommType::kF32, ReduceOp::kMax, 0).wait();
  EXPECT_EQ(a.get<float>(), (std::vector<float>{1, 2, 3}));
  DeviceVec h(std::vector<uint16_t>{float_to_bf16(1.5f), float_to_bf16(-2.0f)});
  c.all_reduce(h.as<uint16_t>(), h.as<uint16_t>(), 2, CommType::kBF16, ReduceOp::kSum).wait();
  EXPECT_EQ(bf16_to_float(h.get<uint16_t>()[0]), 1.5f);
  DeviceVec l(std::vector<int64_t>{42});
  c.broadcast(l.as<int64_t>(), 1, CommType::kI64, 0).wait();
  EXPECT_EQ(l.get<int64_t>()[0], 42);
  // all_gather_v and all_to_all_v: the self part is a copy.
  DeviceVec g(std::vector<double>{0, 0, 7, 8}), s(std::vector<double>{7, 8});
  std::vector<int64_t> cnt = {2}, dsp = {2}, zero = {0};
  c.all_gather_v(s.as<double>(), 2, g.as<double>(), cnt, dsp, CommType::kF64).wait();
  EXPECT_EQ(g.get<double>(), (std::vector<double>{0, 0, 7, 8}));
  DeviceVec r(std::vector<double>{0, 0, 0});
  std::vector<int64_t> rd = {1};
  c.all_to_all_v(s.as<double>(), cnt, zero, r.as<double>(), cnt, rd, CommType::kF64).wait();
  EXPECT_EQ(r.get<double>(), (std::vector<double>{0, 7, 8}));
  c.barrier().wait();
  EXPECT_EQ(c.stats().bytes_sent, 0);  // one member: nothing leaves it
  EXPECT_EQ(c.stats().ops, 7);
  std::unique_ptr<Communicator> sub = c.split(0, 0);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  DeviceVec x(std::vector<int32_t>{5});
  sub->all_reduce(x.as<int32_t>(), x.as<int32_t>(), 1, CommType::kI32, ReduceOp::kMin).wait();
  EXPECT_EQ(x.get<int32_t>()[0], 5);
}

// DISTMUON_NCCL_BLOCKING=1 makes blocking communicators (launches on the caller's thread): the
// same collectives and split; any other value than 0 or 1 is refused before NCCL is called.
TEST(NcclCommConfig, BlockingCommunicatorsWorkAndBadValuesAreRefused) {
  if (!nccl_available()) GTEST_SKIP() << "no NCCL build or no CUDA device";
  struct Restore {  // the value the run started with
    const char* was = std::getenv("DISTMUON_NCCL_BLOCKING");
    std::string value = was ? was : "";
    ~Restore() {
      if (was) setenv("DISTMUON_NCCL_BLOCKING", value.c_str(), 1);
      else unsetenv("DISTMUON_NCCL_BLOCKING");
    }
  } restore;
  setenv("DISTMUON_NCCL_BLOCKING", "2", 1);
  try {
    make_nccl_communicator(nccl_unique_id(), 0, 1);
    ADD_FAILURE() << "a bad DISTMUON_NCCL_BLOCKING was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DISTMUON_NCCL_BLOCKING='2' is not a boolean"),
              std::string::npos)
        << e.what();
  }
  setenv("DISTMUON_NCCL_BLOCKING", "1", 1);
  std::unique_ptr<Communicator> c = make_nccl_communicator(nccl_unique_id(), 0, 1);
  DeviceVec a(std::vector<float>{1, 2, 3}), b(std::vector<float>{0, 0, 0});
  c->all_reduce(a.as<float>(), b.as<float>(), 3, CommType::kF32, ReduceOp::kSum).wait();
  EXPECT_EQ(b.get<float>(), (std::vector<float>{1, 2, 3}));
  std::unique_ptr<Communicator> sub = c->split(0, 0);
  ASSERT_NE(sub, nullptr);
  CommHandle h1, h2;
  c->grouped([&] {
    h1 = c->all_reduce(a.as<float>(), a.as<float>(), 3, CommType::kF32, ReduceOp::kMax);
    h2 = c->broadcast(b.as<float>(), 3, CommType::kF32, 0);
  });
  h1.wait();
  h2.wait();
  EXPECT_EQ(a.get<float>(), (std::vector<float>{1, 2, 3}));
}

void CUDART_CB sleep_host(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); }

TEST_F(NcclComm, TimeoutAbortsAndNamesTheOperation) {
  // The collective starts after the caller's stream, which a host function keeps busy.
  cudaStream_t user = nullptr;
  ASSERT_EQ(cudaStreamCreate(&user), cudaSuccess);
  auto c = make_nccl_communicator(nccl_unique_id(), 0, 1, user);
  DeviceVec a(std::vector<float>{1});
  ASSERT_EQ(cudaLaunchHostFunc(user, sleep_host, nullptr), cudaSuccess);
  CommHandle h = c->all_reduce(a.as<float>(), a.as<float>(), 1, CommType::kF32, ReduceOp::kSum);
  try {
    h.wait(0.3);
    ADD_FAILURE() << "expected a timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce on nccl:world"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(c->barrier(), Error);  // aborted: later calls fail instead of hanging
  cudaStreamSynchronize(user);
  cudaStreamDestroy(user);
}

// A member's abort can let a collective pending elsewhere complete with undefined data and no
// error; one that ran 90 % of its timeout on the device therefore times out although complete.
// Here: a 256 MiB copy (~0.1-0.2 ms on the device) against a 20 us timeout, waited for only
// once the device is idle, so that the deadline check never sees it pending.
TEST_F(NcclComm, ACollectiveThatRanNearlyItsTimeoutOnTheDeviceTimesOut) {
  const int64_t n = int64_t(64) << 20;  // floats
  void *src = nullptr, *dst = nullptr;
  ASSERT_EQ(cudaMalloc(&src, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, n * sizeof(float)), cudaSuccess);
  comm_->all_reduce(src, dst, n, CommType::kF32, ReduceOp::kSum).wait();  // warm, 300 s timeout
  comm_->set_timeout(20e-6);
  CommHandle h = comm_->all_reduce(src, dst, n, CommType::kF32, ReduceOp::kSum);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  try {
    h.wait();
    ADD_FAILURE() << "expected a timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("on the device"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm_->barrier(), Error);  // aborted
  cudaFree(src);
  cudaFree(dst);
}

TEST_F(NcclComm, WaitOnStreamOrdersOnTheDeviceWithoutBlockingTheHost) {
  // The caller's stream is held busy by a host function: wait_on_stream() must return at once,
  // leave the handle pending, and still order a copy issued afterwards on that stream after the
  // collective's result.
  cudaStream_t user = nullptr;
  ASSERT_EQ(cudaStreamCreate(&user), cudaSuccess);
  auto c = make_nccl_communicator(nccl_unique_id(), 0, 1, user);
  DeviceVec a(std::vector<float>{2, 3}), b(std::vector<float>{0, 0}), out(std::vector<float>{0, 0});
  ASSERT_EQ(cudaLaunchHostFunc(user, sleep_host, nullptr), cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  CommHandle h = c->all_reduce(a.as<float>(), b.as<float>(), 2, CommType::kF32, ReduceOp::kSum);
  h.wait_on_stream();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 500.0) << "wait_on_stream() blocked the host";
  EXPECT_TRUE(h.pending()) << "the completion is still to be checked on the host";
  ASSERT_EQ(cudaMemcpyAsync(out.as<float>(), b.as<float>(), 2 * sizeof(float),
                            cudaMemcpyDeviceToDevice, user),
            cudaSuccess);
  h.wait();  // the host check, within the communicator's deadline
  EXPECT_FALSE(h.pending());
  cudaStreamSynchronize(user);
  EXPECT_EQ(out.get<float>(), (std::vector<float>{2, 3}));
  cudaStreamDestroy(user);
}

TEST_F(NcclComm, EngineModesEqualTheSingleProcessEngine) {
  if (!cuda_available()) GTEST_SKIP() << "this build has no CUDA backend";
  // The communicator is bound to the backend's own (non-blocking) stream, as the engine
  // requires: its stages order each other's collectives on that stream.
  for (DistMode mode :
       {DistMode::kGather, DistMode::kReplicated, DistMode::kSharded, DistMode::kDedicated}) {
    auto be = make_backend("cuda");
    auto comm = make_nccl_communicator(nccl_unique_id(), 0, 1, be->native_stream());
    DistOptions opt;
    opt.mode = mode;
    Engine ref(*be), dist(*be, *comm, opt);
    GroupOptions g;
    g.muon.ortho.work_dtype = DType::kF32;
    for (Engine* e : {&ref, &dist}) e->add_group(g);
    const bool sharded = mode == DistMode::kSharded || mode == DistMode::kGather;
    ParamSpec spec{"w", 0, {24, 40}, DType::kF32};
    ref.add_param(spec);
    if (sharded) spec.shard = {0, 24};
    dist.add_param(spec);
    std::vector<float> w(960), gr(960);
    for (int i = 0; i < 960; ++i) {
      w[i] = static_cast<float>((i * 37) % 17 - 8) / 16.0f;
      gr[i] = static_cast<float>((i * 11) % 13 - 6) / 32.0f;
    }
    DeviceVec w1(w), w2(w), g1(gr);
    ParamData d1{w1.as<float>(), g1.as<float>(), DType::kF32, {}};
    ParamData d2{w2.as<float>(), g1.as<float>(), DType::kF32, {}};
    for (int s = 0; s < 3; ++s) {
      ref.step({&d1, 1});
      dist.step({&d2, 1});
    }
    be->synchronize();
    EXPECT_EQ(w1.get<float>(), w2.get<float>()) << dist_mode_name(mode);
  }
}

void CUDART_CB sleep_short(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

TEST_F(NcclComm, EngineCommunicatorsFollowTheBackendsStream) {
  // The communicator is made on the legacy stream while the backend issues on its own
  // non-blocking stream, and the backend moves to yet another stream halfway. Each step's
  // gradient lands on the backend's stream only after a host function held that stream busy:
  // a collective that followed any other stream would read the stale gradient (zeros) and the
  // weights would differ from the single-process engine's. (The engine used to refuse the
  // mismatch, and the PyTorch front's dedicated runtime tripped over it.)
  if (!cuda_available()) GTEST_SKIP() << "this build has no CUDA backend";
  for (DistMode mode : {DistMode::kSharded, DistMode::kGather, DistMode::kDedicated}) {
    SCOPED_TRACE(dist_mode_name(mode));
    auto be = make_backend("cuda");
    auto* cuda = dynamic_cast<CudaBackend*>(be.get());
    ASSERT_NE(cuda, nullptr);
    auto comm = make_nccl_communicator(nccl_unique_id(), 0, 1, nullptr);
    DistOptions opt;
    opt.mode = mode;
    Engine ref(*be), dist(*be, *comm, opt);
    GroupOptions g;
    g.muon.ortho.work_dtype = DType::kF32;
    for (Engine* e : {&ref, &dist}) e->add_group(g);
    const bool sharded = mode == DistMode::kSharded || mode == DistMode::kGather;
    ParamSpec spec{"w", 0, {24, 40}, DType::kF32};
    ref.add_param(spec);
    if (sharded) spec.shard = {0, 24};
    dist.add_param(spec);
    std::vector<float> w(960);
    for (int i = 0; i < 960; ++i) w[i] = static_cast<float>((i * 37) % 17 - 8) / 16.0f;
    DeviceVec w1(w), w2(w), g1(std::vector<float>(960, 0.0f)), g2(std::vector<float>(960, 0.0f));
    cudaStream_t other = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
    for (int s = 0; s < 4; ++s) {
      if (s == 2) cuda->set_stream(other);
      std::vector<float> gr(960);
      for (int i = 0; i < 960; ++i) gr[i] = static_cast<float>((i * 11 + s) % 13 - 6) / 32.0f;
      // The reference's gradient is in place before it steps.
      be->copy_from_host(g1.as<float>(), gr.data(), gr.size() * sizeof(float));
      be->synchronize();
      ParamData d1{w1.as<float>(), g1.as<float>(), DType::kF32, {}};
      ref.step({&d1, 1});
      be->synchronize();
      // The distributed engine's gradient arrives late on the backend's stream.
      cudaStream_t st = static_cast<cudaStream_t>(be->native_stream());
      ASSERT_EQ(cudaLaunchHostFunc(st, sleep_short, nullptr), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(g2.as<float>(), g1.as<float>(), 960 * sizeof(float),
                                cudaMemcpyDeviceToDevice, st),
                cudaSuccess);
      ParamData d2{w2.as<float>(), g2.as<float>(), DType::kF32, {}};
      dist.step({&d2, 1});
      dist.wait_published();
      EXPECT_EQ(comm->caller_stream().value(), be->native_stream());
      be->synchronize();
      EXPECT_EQ(w1.get<float>(), w2.get<float>()) << "step " << s;
      // Zero the late gradient on the backend's stream, so the next step cannot see it early.
      be->fill_zero(g2.as<float>(), 960 * sizeof(float));
      be->synchronize();
    }
    cuda->set_stream(nullptr);
    be->synchronize();
    cudaStreamDestroy(other);
  }
}

}  // namespace
}  // namespace distmuon
