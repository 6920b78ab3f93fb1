// A communicator under mpirun at any world size, on both rigs of dist_rig.h (MPI on host memory,
// NCCL on CUDA memory): every collective against values each rank can compute on its own, uneven
// and empty counts, in-place forms, sub-communicators, byte counters, outstanding operations,
// overlap through MPI's progress thread, a timeout that names the operation, and a teardown
// that waits for no other member.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <numeric>
#include <thread>

#include "common/half.h"
#include "dist_rig.h"
#include "distmuon/env.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

using test::Mirror;
using test::world;

// Buffers where the communicator moves data (host or device memory).
struct Bufs {
  std::unique_ptr<Backend> be = test::make_backend();
  template <typename T>
  Mirror<T> of(const std::vector<T>& v) {
    return Mirror<T>(*be, v);
  }
};

TEST(MpiComm, AllReduceSumMaxMinOverTypes) {
  Communicator& c = world();
  Bufs m;
  const int p = c.size(), r = c.rank();
  auto d = m.of<double>({1.0 * r, -2.0 * r, 0.5});
  c.all_reduce(d.data(), d.data(), 3, CommType::kF64, ReduceOp::kSum).wait();
  const double tri = p * (p - 1) / 2.0;
  EXPECT_EQ(d.get(), (std::vector<double>{tri, -2 * tri, 0.5 * p}));
  auto f = m.of<float>({static_cast<float>(r), static_cast<float>(-r)}), g = m.of<float>({0, 0});
  c.all_reduce(f.data(), g.data(), 2, CommType::kF32, ReduceOp::kMax).wait();
  EXPECT_EQ(g.get(), (std::vector<float>{static_cast<float>(p - 1), 0.0f}));
  auto i = m.of<int32_t>({r + 10});
  c.all_reduce(i.data(), i.data(), 1, CommType::kI32, ReduceOp::kMin).wait();
  EXPECT_EQ(i.get()[0], 10);
  auto l = m.of<int64_t>({int64_t{1} << 40});
  c.all_reduce(l.data(), l.data(), 1, CommType::kI64, ReduceOp::kSum).wait();
  EXPECT_EQ(l.get()[0], p * (int64_t{1} << 40));
  // bf16 and fp16 travel as 16-bit words and are added in fp32 (small integers are exact).
  auto b = m.of<uint16_t>({float_to_bf16(static_cast<float>(r + 1))});
  auto h = m.of<uint16_t>({float_to_f16(static_cast<float>(2 * r))});
  c.all_reduce(b.data(), b.data(), 1, CommType::kBF16, ReduceOp::kSum).wait();
  c.all_reduce(h.data(), h.data(), 1, CommType::kF16, ReduceOp::kMax).wait();
  EXPECT_EQ(bf16_to_float(b.get()[0]), p * (p + 1) / 2.0f);
  EXPECT_EQ(f16_to_float(h.get()[0]), 2.0f * (p - 1));
}

TEST(MpiComm, ReduceAndBroadcastFromEveryRoot) {
  Communicator& c = world();
  Bufs b;
  const int p = c.size(), r = c.rank();
  for (int root = 0; root < p; ++root) {
    auto mine = b.of<float>({1.0f + r, 2.0f}), out = b.of<float>({-1.0f, -1.0f});
    c.reduce(mine.data(), out.data(), 2, CommType::kF32, ReduceOp::kSum, root).wait();
    if (r == root) {
      EXPECT_EQ(out.get(), (std::vector<float>{p * (p + 1) / 2.0f, 2.0f * p}));
    } else {
      EXPECT_EQ(out.get(), (std::vector<float>{-1.0f, -1.0f}));  // untouched
    }
    // In place at the root.
    auto inplace = b.of<float>({1.0f});
    c.reduce(inplace.data(), inplace.data(), 1, CommType::kF32, ReduceOp::kSum, root).wait();
    if (r == root) {
      EXPECT_EQ(inplace.get()[0], static_cast<float>(p));
    }
    auto v = b.of<int64_t>({r == root ? 100 + root : -7, 5});
    c.broadcast(v.data(), 2, CommType::kI64, root).wait();
    EXPECT_EQ(v.get(), (std::vector<int64_t>{100 + root, 5}));
  }
}

TEST(MpiComm, GroupedOperationsCompleteTogetherWithTheirOwnResults) {
  // A reduce to every root, a broadcast from every root, an all-gather, an all-to-all and a
  // nested group, launched as one (NCCL: one group); each handle then holds its own result.
  Communicator& c = world();
  Bufs b;
  const int p = c.size(), r = c.rank();
  std::vector<Mirror<float>> sums, casts;
  for (int root = 0; root < p; ++root) {
    sums.push_back(b.of<float>({1.0f + r, 2.0f}));
    casts.push_back(b.of<float>({r == root ? 10.0f + root : -1.0f}));
  }
  std::vector<int64_t> ones(p, 1), displs(p);
  std::iota(displs.begin(), displs.end(), int64_t{0});
  auto mine = b.of<float>({100.0f + r}), all = b.of(std::vector<float>(p, -1.0f));
  std::vector<float> to_each(p);
  for (int q = 0; q < p; ++q) to_each[q] = 1000.0f * r + q;
  auto send = b.of(to_each), recv = b.of(std::vector<float>(p, -1.0f));
  auto total = b.of<int64_t>({r + 1});
  const CommStats before = c.stats();
  std::vector<CommHandle> handles;
  c.grouped([&] {
    for (int root = 0; root < p; ++root) {
      handles.push_back(c.reduce(sums[root].data(), sums[root].data(), 2, CommType::kF32,
                                 ReduceOp::kSum, root));
      handles.push_back(c.broadcast(casts[root].data(), 1, CommType::kF32, root));
    }
    handles.push_back(c.all_gather(mine.data(), all.data(), 1, CommType::kF32));
    c.grouped([&] {
      handles.push_back(c.all_to_all_v(send.data(), ones, displs, recv.data(), ones, displs,
                                       CommType::kF32));
      handles.push_back(c.all_reduce(total.data(), total.data(), 1, CommType::kI64, ReduceOp::kSum));
    });
  });
  wait_all(handles);
  EXPECT_EQ(c.stats().ops - before.ops, 2 * p + 3);  // counted as the operations they are
  // Launched as one where the communicator launches groups (NCCL), else one by one (MPI).
  EXPECT_EQ(c.stats().launches - before.launches, test::on_cuda() ? 1 : 2 * p + 3);
  for (int root = 0; root < p; ++root) {
    if (r == root) {
      EXPECT_EQ(sums[root].get(), (std::vector<float>{p * (p + 1) / 2.0f, 2.0f * p}));
    }
    EXPECT_EQ(casts[root].get()[0], 10.0f + root);
  }
  const std::vector<float> gathered = all.get(), received = recv.get();
  for (int q = 0; q < p; ++q) {
    EXPECT_EQ(gathered[q], 100.0f + q);
    EXPECT_EQ(received[q], 1000.0f * q + r);
  }
  EXPECT_EQ(total.get()[0], p * (p + 1) / 2);
}

TEST(MpiComm, AGroupThatThrowsStillLaunchesWhatItIssued) {
  Communicator& c = world();
  Bufs b;
  auto x = b.of<int64_t>({1});
  CommHandle h;
  EXPECT_THROW(c.grouped([&] {
    h = c.all_reduce(x.data(), x.data(), 1, CommType::kI64, ReduceOp::kSum);
    throw std::runtime_error("the caller's own error");
  }),
               std::runtime_error);
  h.wait();  // launched when the group ended
  EXPECT_EQ(x.get()[0], c.size());
  EXPECT_THROW(c.grouped([&] { (void)c.split(0, c.rank()); }), Error);  // a split never groups
  c.barrier().wait();  // the communicator goes on
}

TEST(MpiComm, WaitingInsideAGroupIsRefused) {
  if (!test::on_cuda()) GTEST_SKIP() << "MPI issues grouped operations as they come";
  Communicator& c = world();
  Bufs b;
  auto x = b.of<int64_t>({1});
  CommHandle h;
  try {
    c.grouped([&] {
      h = c.all_reduce(x.data(), x.data(), 1, CommType::kI64, ReduceOp::kSum);
      h.wait();
    });
    ADD_FAILURE() << "a wait inside grouped() returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inside grouped()"), std::string::npos) << e.what();
  }
  h.wait();  // an explicit wait still waits, and the group was launched
  EXPECT_EQ(x.get()[0], c.size());
  // NCCL's group is the thread's: another communicator's operation inside would join it unseen.
  std::unique_ptr<Communicator> other = test::make_world();
  auto y = b.of<int64_t>({1});
  CommHandle g;
  try {
    c.grouped([&] {
      g = c.all_reduce(x.data(), x.data(), 1, CommType::kI64, ReduceOp::kSum);
      (void)other->all_reduce(y.data(), y.data(), 1, CommType::kI64, ReduceOp::kSum);
    });
    ADD_FAILURE() << "another communicator's operation was issued inside grouped()";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another communicator's grouped()"), std::string::npos)
        << e.what();
  }
  g.wait();  // what the group issued before the error was launched
  EXPECT_EQ(x.get()[0], c.size() * c.size());
  other->barrier().wait();  // both go on
  c.barrier().wait();
}

TEST(MpiComm, AllGatherVWithUnevenAndEmptyCounts) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  // Member q contributes q % 3 elements (so member 0, 3, ... contribute none).
  std::vector<int64_t> counts(p), displs(p);
  for (int q = 0; q < p; ++q) counts[q] = q % 3;
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), int64_t{0});
  const int64_t total = displs.back() + counts.back();
  Bufs b;
  std::vector<float> send(counts[r]);
  for (int64_t k = 0; k < counts[r]; ++k) send[k] = 10.0f * r + k;
  auto send_d = b.of(send), recv_d = b.of(std::vector<float>(total + 1, -1.0f));
  c.all_gather_v(send_d.data(), counts[r], recv_d.data(), counts, displs, CommType::kF32).wait();
  const std::vector<float> recv = recv_d.get();
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < counts[q]; ++k) EXPECT_EQ(recv[displs[q] + k], 10.0f * q + k);
  EXPECT_EQ(recv[total], -1.0f);
  // In place: the own slot of recv is the send buffer.
  std::vector<int32_t> all(p, 0);
  all[r] = r * r;
  auto all_d = b.of(all);
  c.all_gather(all_d.data() + r, all_d.data(), 1, CommType::kI32).wait();
  all = all_d.get();
  for (int q = 0; q < p; ++q) EXPECT_EQ(all[q], q * q);
}

TEST(MpiComm, AllToAllVWithUnevenAndEmptyCounts) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  // Member s sends (s + d) % 3 elements to member d, valued 1000 s + 10 d + k.
  auto n = [](int s, int d) { return static_cast<int64_t>((s + d) % 3); };
  std::vector<int64_t> sc(p), sd(p), rc(p), rd(p);
  for (int q = 0; q < p; ++q) {
    sc[q] = n(r, q);
    rc[q] = n(q, r);
  }
  std::exclusive_scan(sc.begin(), sc.end(), sd.begin(), int64_t{0});
  std::exclusive_scan(rc.begin(), rc.end(), rd.begin(), int64_t{0});
  std::vector<double> send(sd.back() + sc.back());
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < sc[q]; ++k) send[sd[q] + k] = 1000.0 * r + 10.0 * q + k;
  Bufs b;
  auto send_d = b.of(send), recv_d = b.of(std::vector<double>(rd.back() + rc.back(), -1.0));
  const CommStats before = c.stats();
  c.all_to_all_v(send_d.data(), sc, sd, recv_d.data(), rc, rd, CommType::kF64).wait();
  const std::vector<double> recv = recv_d.get();
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < rc[q]; ++k) EXPECT_EQ(recv[rd[q] + k], 1000.0 * q + 10.0 * r + k);
  // The counters hold the payload to and from other members only.
  const CommStats d = c.stats() - before;
  int64_t sent = 0, got = 0;
  for (int q = 0; q < p; ++q)
    if (q != r) sent += sc[q], got += rc[q];
  EXPECT_EQ(d.bytes_sent, 8 * sent);
  EXPECT_EQ(d.bytes_received, 8 * got);
  EXPECT_EQ(d.ops, 1);
}

// Equal blocks at the members' places (the sharded mode's layout on windows: NCCL's own
// all-to-all), on the windows a communicator made under DISTMUON_NCCL_CTA_POLICY=zero gives:
// every member gets one or none alike (MPI: none; NCCL: where the members share symmetric
// memory), and the all-to-all on them puts every block in its place, the member's own included.
TEST(MpiComm, EqualBlocksAllToAllOnWindows) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  std::unique_ptr<Communicator> zc;
  {
    struct Env {  // unset however the block ends
      Env() { setenv("DISTMUON_NCCL_CTA_POLICY", "zero", 1); }
      ~Env() { unsetenv("DISTMUON_NCCL_CTA_POLICY"); }
    } env;
    zc = c.split(0, r);
  }
  constexpr int64_t kBlock = 5;
  const size_t bytes = static_cast<size_t>(p * kBlock) * sizeof(double);
  std::shared_ptr<void> ws = zc->alloc_window(bytes), wr = zc->alloc_window(bytes);
  Bufs b;
  auto have = b.of(std::vector<int32_t>{ws != nullptr, wr != nullptr});
  c.all_reduce(have.data(), have.data(), 2, CommType::kI32, ReduceOp::kSum).wait();
  const std::vector<int32_t> all = have.get();
  EXPECT_TRUE(all[0] == 0 || all[0] == p) << all[0] << " of " << p << " members got a window";
  EXPECT_EQ(all[0], all[1]);
  std::vector<double> send(static_cast<size_t>(p * kBlock));
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < kBlock; ++k) send[q * kBlock + k] = 1000.0 * r + 10.0 * q + k;
  Buffer own_s, own_r;
  if (!ws) own_s = b.be->alloc(bytes), own_r = b.be->alloc(bytes);
  void* s = ws ? ws.get() : own_s.data();
  void* d = wr ? wr.get() : own_r.data();
  b.be->copy_from_host(s, send.data(), bytes);
  b.be->synchronize();
  std::vector<int64_t> counts(static_cast<size_t>(p), kBlock), displs(static_cast<size_t>(p));
  for (int q = 0; q < p; ++q) displs[q] = q * kBlock;
  zc->all_to_all_v(s, counts, displs, d, counts, displs, CommType::kF64).wait();
  std::vector<double> recv(static_cast<size_t>(p * kBlock));
  b.be->synchronize();
  b.be->copy_to_host(recv.data(), d, bytes);
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < kBlock; ++k)
      EXPECT_EQ(recv[q * kBlock + k], 1000.0 * q + 10.0 * r + k) << "from " << q << ", " << k;
}

TEST(MpiComm, ByteCountersFollowTheDirectModel) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  Bufs b;
  auto buf = b.of(std::vector<float>(100, 0.0f));
  CommStats s0 = c.stats();
  c.broadcast(buf.data(), 100, CommType::kF32, 0).wait();
  CommStats d = c.stats() - s0;
  EXPECT_EQ(d.bytes_sent, r == 0 ? 400 * (p - 1) : 0);
  EXPECT_EQ(d.bytes_received, r == 0 ? 0 : 400);
  s0 = c.stats();
  c.reduce(buf.data(), buf.data(), 100, CommType::kF32, ReduceOp::kSum, p - 1).wait();
  d = c.stats() - s0;
  EXPECT_EQ(d.bytes_sent, r == p - 1 ? 0 : 400);
  EXPECT_EQ(d.bytes_received, r == p - 1 ? 400 * (p - 1) : 0);
  s0 = c.stats();
  c.all_reduce(buf.data(), buf.data(), 100, CommType::kF32, ReduceOp::kSum).wait();
  d = c.stats() - s0;
  EXPECT_EQ(d.bytes_sent, 4 * (2 * (p - 1) * 100 / p));
}

TEST(MpiComm, SplitFormsGroupsOrderedByKey) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  // Even and odd ranks, in reverse order of world rank.
  std::unique_ptr<Communicator> sub = c.split(r % 2, p - r);
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int q = p - 1; q >= 0; --q)
    if (q % 2 == r % 2) members.push_back(q);
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->world_ranks(), members);
  EXPECT_EQ(members[sub->rank()], r);
  Bufs b;
  auto v = b.of<int32_t>({r});
  sub->all_reduce(v.data(), v.data(), 1, CommType::kI32, ReduceOp::kSum).wait();
  EXPECT_EQ(v.get()[0], std::accumulate(members.begin(), members.end(), 0));
  // A negative color takes no part.
  std::unique_ptr<Communicator> none = c.split(r == 0 ? -1 : 0, r);
  EXPECT_EQ(none == nullptr, r == 0);
  if (none) {
    EXPECT_EQ(none->size(), p - 1);
    none->barrier().wait();
  }
}

TEST(MpiComm, OutstandingOperationsCompleteInAnyOrder) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  Bufs b;
  std::vector<Mirror<int64_t>> bufs;
  std::vector<CommHandle> hs;
  for (int k = 0; k < 8; ++k) {
    bufs.push_back(b.of(std::vector<int64_t>(1000, r + k)));
    hs.push_back(
        c.all_reduce(bufs[k].data(), bufs[k].data(), 1000, CommType::kI64, ReduceOp::kSum));
  }
  for (int k = 7; k >= 0; --k) hs[k].wait();  // newest first
  for (int k = 0; k < 8; ++k)
    EXPECT_EQ(bufs[k].get()[999],
              static_cast<int64_t>(p) * (p - 1) / 2 + static_cast<int64_t>(k) * p);
}

TEST(MpiComm, ProgressThreadAdvancesTransfersWhileTheHostComputes) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
  if (test::on_cuda()) GTEST_SKIP() << "MPI's progress thread";
  // A large all-reduce runs as a schedule of several rounds, each of which needs the library to
  // be entered on every rank: without a progress thread it stalls while the ranks compute.
  const int64_t n = 1 << 22;
  std::vector<float> buf(n, 1.0f);
  c.barrier().wait();
  CommHandle h = c.all_reduce(buf.data(), buf.data(), n, CommType::kF32, ReduceOp::kSum);
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));  // no MPI call on this thread
  const bool done = h.test();
  if (env::get_bool("DISTMUON_MPI_PROGRESS_THREAD")) {
    EXPECT_TRUE(done) << "the all-reduce did not advance in the background";
  }
  h.wait();
  EXPECT_EQ(buf[n - 1], static_cast<float>(c.size()));
}

TEST(MpiComm, TimeoutNamesTheOperationAndTheRanks) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  // A communicator of its own: NCCL aborts a communicator whose operation timed out.
  std::unique_ptr<Communicator> own = test::make_world();
  Communicator& c = *own;
  // NCCL connects its members at their first collective, which waits for all of them (within the
  // timeout too): the late arrival below must meet a connected communicator.
  c.barrier().wait();
  // Rank 0 enters the barrier at once and gives up after 0.3 s; the others arrive 1.5 s late.
  if (c.rank() == 0) {
    CommHandle h = c.barrier();
    try {
      h.wait(0.3);
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("barrier"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 0 of"), std::string::npos) << msg;
      EXPECT_NE(msg.find("world ranks 0,1"), std::string::npos) << msg;
      EXPECT_NE(msg.find("DISTMUON_COMM_TIMEOUT_S"), std::string::npos) << msg;
    }
    if (!test::on_cuda()) {
      h.wait();  // MPI: the operation is still valid and completes once the others arrive
    } else {
      // NCCL: the communicator was aborted; later calls fail at once instead of hanging.
      EXPECT_THROW(c.barrier(), Error);
    }
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    CommHandle h = c.barrier();
    if (!test::on_cuda()) {
      h.wait();
    } else {
      // Rank 0 aborted its side: whether this barrier still completes depends on how far the
      // abort got when this rank arrived (measured both ways on one H200). What must hold is
      // that it never hangs: it completes or raises within its own deadline.
      const auto start = std::chrono::steady_clock::now();
      try {
        h.wait(2.0);
      } catch (const Error&) {
      }
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(waited, 2.0 + 1.0) << "the wait outlived its deadline";
    }
  }
}

TEST(MpiComm, DeadlineRunsFromTheIssueNotFromTheWait) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  std::unique_ptr<Communicator> own = test::make_world();  // NCCL aborts it on the timeout
  Communicator& c = *own;
  c.barrier().wait();  // connected (NCCL connects at the first collective)
  // Rank 0 issues a barrier, computes for 2 s, then waits with a 2.5 s timeout; the others
  // arrive 5 s late. Counted from the issue the wait ends 2.5 s after it, not 2 + 2.5 s: a step
  // that waits for its collectives one after another is bounded by one timeout. (The bound
  // leaves 1.1 s for NCCL's abort, which took 0.6 s with 4 ranks on one loaded H200.)
  if (c.rank() == 0) {
    const auto issued = std::chrono::steady_clock::now();
    CommHandle h = c.barrier();
    std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    EXPECT_THROW(h.wait(2.5), TimeoutError);
    const double at =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - issued).count();
    EXPECT_GE(at, 2.5 - 0.05);
    EXPECT_LT(at, 3.6) << "the deadline was counted from the wait";
    if (!test::on_cuda()) h.wait(60.0);  // MPI: completes once the others arrive
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(5000));
    CommHandle h = c.barrier();
    if (!test::on_cuda()) {
      h.wait();
    } else {
      try {  // rank 0 aborted its side: complete or raise, within the deadline
        h.wait(2.0);
      } catch (const Error&) {
      }
    }
  }
}

TEST(MpiComm, ACommunicatorIsLetGoWithoutWaitingForTheOtherMembers) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  // Members destroy a communicator at different moments (Python collects an optimizer when its
  // own allocations say so). Rank 0 lets go of a used communicator first, then meets the others
  // in a collective on another one, which they reach before letting go of theirs: a teardown
  // that waited for every member (NCCL's finalize) would hold rank 0 there until its timeout.
  std::unique_ptr<Communicator> own = test::make_world();
  own->barrier().wait();  // connected and used
  Communicator& c = world();
  Bufs b;
  Mirror<int64_t> x = b.of(std::vector<int64_t>(4, 1));
  const auto t0 = std::chrono::steady_clock::now();
  if (c.rank() == 0) own.reset();
  c.all_reduce(x.data(), x.data(), 4, CommType::kI64, ReduceOp::kSum).wait(20.0);
  own.reset();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(x.get()[3], c.size());
  EXPECT_LT(s, 5.0) << "letting go of a communicator waited for the other members";
}

TEST(MpiComm, CommunicatorsLetGoGiveTheirMemoryBack) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  if (test::device_bytes_in_use() < 0) GTEST_SKIP() << "host memory: nothing to give back";
  // An engine builds several communicators and a training job may rebuild its optimizer; the
  // memory of the ones let go must come back (an NCCL abort as teardown kept it long enough that
  // the 4-rank tests which build many engines ran out of device memory). The device's count of
  // memory in use takes in every process on the GPU (the verification's other lanes), so what is
  // checked is this process's teardowns: each one let go ends by NCCL's destroy, which frees its
  // memory, not by an abort, and none is left in flight.
  Communicator& host = test::host_world();
  auto used = [] {
    std::unique_ptr<Communicator> c = test::make_world();
    c->barrier().wait();
    return c;
  };
  // (EXPECT: a rank that returned here would leave the others waiting in the collectives below)
  EXPECT_TRUE(wait_for_nccl_teardowns(30.0)) << "an earlier test's teardown is still in flight";
  const NcclTeardowns before = nccl_teardowns();
  const int64_t bytes_before = test::device_bytes_in_use();
  for (int i = 0; i < 11; ++i) used().reset();
  EXPECT_TRUE(wait_for_nccl_teardowns(30.0)) << "teardowns still in flight 30 s after";
  const NcclTeardowns after = nccl_teardowns();
  EXPECT_EQ(after.destroyed - before.destroyed, 11) << "communicators not destroyed";
  EXPECT_EQ(after.aborted, before.aborted) << "communicators aborted instead of destroyed";
  host.barrier().wait();
  if (host.rank() == 0)
    std::printf("[rig] 11 communicators let go: device memory in use %+lld MiB (every process)\n",
                static_cast<long long>((test::device_bytes_in_use() - bytes_before) >> 20));
}

TEST(MpiComm, BadArgumentsAreRejectedBeforeAnythingMoves) {
  Communicator& c = world();
  std::vector<int64_t> short_list(c.size() + 1, 0);
  float x = 0;
  EXPECT_THROW(
      c.all_to_all_v(&x, short_list, short_list, &x, short_list, short_list, CommType::kF32),
      Error);
  EXPECT_THROW(c.broadcast(&x, 1, CommType::kF32, c.size()), Error);
  EXPECT_THROW(c.reduce(&x, &x, -1, CommType::kF32, ReduceOp::kSum, 0), Error);
}

}  // namespace
}  // namespace distmuon
