// The MPI communicator under mpirun at any world size: every collective against values each rank
// can compute on its own, uneven and empty counts, in-place forms, sub-communicators, byte
// counters, overlap through the progress thread, and a timeout that names the operation.
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <thread>

#include "common/half.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "mpi_test_main.h"

namespace distmuon {
namespace {

using test::world;

TEST(MpiComm, AllReduceSumMaxMinOverTypes) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  std::vector<double> d = {1.0 * r, -2.0 * r, 0.5};
  c.all_reduce(d.data(), d.data(), 3, CommType::kF64, ReduceOp::kSum).wait();
  const double tri = p * (p - 1) / 2.0;
  EXPECT_EQ(d, (std::vector<double>{tri, -2 * tri, 0.5 * p}));
  std::vector<float> f = {static_cast<float>(r), static_cast<float>(-r)}, g(2);
  c.all_reduce(f.data(), g.data(), 2, CommType::kF32, ReduceOp::kMax).wait();
  EXPECT_EQ(g, (std::vector<float>{static_cast<float>(p - 1), 0.0f}));
  std::vector<int32_t> i = {r + 10};
  c.all_reduce(i.data(), i.data(), 1, CommType::kI32, ReduceOp::kMin).wait();
  EXPECT_EQ(i[0], 10);
  std::vector<int64_t> l = {int64_t{1} << 40};
  c.all_reduce(l.data(), l.data(), 1, CommType::kI64, ReduceOp::kSum).wait();
  EXPECT_EQ(l[0], p * (int64_t{1} << 40));
  // bf16 and fp16 travel as 16-bit words and are added in fp32 (small integers are exact).
  std::vector<uint16_t> b = {float_to_bf16(static_cast<float>(r + 1))};
  std::vector<uint16_t> h = {float_to_f16(static_cast<float>(2 * r))};
  c.all_reduce(b.data(), b.data(), 1, CommType::kBF16, ReduceOp::kSum).wait();
  c.all_reduce(h.data(), h.data(), 1, CommType::kF16, ReduceOp::kMax).wait();
  EXPECT_EQ(bf16_to_float(b[0]), p * (p + 1) / 2.0f);
  EXPECT_EQ(f16_to_float(h[0]), 2.0f * (p - 1));
}

TEST(MpiComm, ReduceAndBroadcastFromEveryRoot) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  for (int root = 0; root < p; ++root) {
    std::vector<float> mine = {1.0f + r, 2.0f}, out(2, -1.0f);
    c.reduce(mine.data(), out.data(), 2, CommType::kF32, ReduceOp::kSum, root).wait();
    if (r == root) {
      EXPECT_EQ(out, (std::vector<float>{p * (p + 1) / 2.0f, 2.0f * p}));
    } else {
      EXPECT_EQ(out, (std::vector<float>{-1.0f, -1.0f}));  // untouched
    }
    // In place at the root.
    std::vector<float> inplace = {1.0f};
    c.reduce(inplace.data(), inplace.data(), 1, CommType::kF32, ReduceOp::kSum, root).wait();
    if (r == root) {
      EXPECT_EQ(inplace[0], static_cast<float>(p));
    }
    std::vector<int64_t> v = {r == root ? 100 + root : -7, 5};
    c.broadcast(v.data(), 2, CommType::kI64, root).wait();
    EXPECT_EQ(v, (std::vector<int64_t>{100 + root, 5}));
  }
}

TEST(MpiComm, AllGatherVWithUnevenAndEmptyCounts) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  // Member q contributes q % 3 elements (so member 0, 3, ... contribute none).
  std::vector<int64_t> counts(p), displs(p);
  for (int q = 0; q < p; ++q) counts[q] = q % 3;
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), int64_t{0});
  const int64_t total = displs.back() + counts.back();
  std::vector<float> send(counts[r]);
  for (int64_t k = 0; k < counts[r]; ++k) send[k] = 10.0f * r + k;
  std::vector<float> recv(total + 1, -1.0f);
  c.all_gather_v(send.data(), counts[r], recv.data(), counts, displs, CommType::kF32).wait();
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < counts[q]; ++k) EXPECT_EQ(recv[displs[q] + k], 10.0f * q + k);
  EXPECT_EQ(recv[total], -1.0f);
  // In place: the own slot of recv is the send buffer.
  std::vector<int32_t> all(p, 0);
  all[r] = r * r;
  c.all_gather(all.data() + r, all.data(), 1, CommType::kI32).wait();
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
  std::vector<double> send(sd.back() + sc.back()), recv(rd.back() + rc.back(), -1.0);
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < sc[q]; ++k) send[sd[q] + k] = 1000.0 * r + 10.0 * q + k;
  const CommStats before = c.stats();
  c.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd, CommType::kF64).wait();
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

TEST(MpiComm, ByteCountersFollowTheDirectModel) {
  Communicator& c = world();
  const int p = c.size(), r = c.rank();
  std::vector<float> buf(100);
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
  std::vector<int32_t> v = {r};
  sub->all_reduce(v.data(), v.data(), 1, CommType::kI32, ReduceOp::kSum).wait();
  EXPECT_EQ(v[0], std::accumulate(members.begin(), members.end(), 0));
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
  std::vector<std::vector<int64_t>> bufs(8, std::vector<int64_t>(1000));
  std::vector<CommHandle> hs;
  for (int k = 0; k < 8; ++k) {
    for (auto& x : bufs[k]) x = r + k;
    hs.push_back(
        c.all_reduce(bufs[k].data(), bufs[k].data(), 1000, CommType::kI64, ReduceOp::kSum));
  }
  for (int k = 7; k >= 0; --k) hs[k].wait();  // newest first
  for (int k = 0; k < 8; ++k)
    EXPECT_EQ(bufs[k][999], static_cast<int64_t>(p) * (p - 1) / 2 + static_cast<int64_t>(k) * p);
}

TEST(MpiComm, ProgressThreadAdvancesTransfersWhileTheHostComputes) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
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
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
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
    }
    h.wait();  // the operation is still valid and completes once the others arrive
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    c.barrier().wait();
  }
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
