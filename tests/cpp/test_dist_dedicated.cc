// The dedicated runtime's transfers (distmuon/dedicated_transfers.h) under mpirun at any world
// size, flat and (at 4 ranks) HSDP 2 x 2: gradients reach their owners summed whatever order
// each rank completes them in, the vote skips matrices without a gradient anywhere and sends
// zeros for those missing here, a second backward before the step is reduced again, a gradient
// after its update was prepared fails on every rank (and the next step still works), forward
// broadcasts bring every bucket from its owner and free it after its last gradient, and HSDP
// owners publish their weights to the other replicas; one backward reduces each bucket once, as
// one buffer (exact collective count and bytes); given a backend, the transfers turn the owners'
// sums into means. Each runs with owners spread over neighbouring
// matrices and with each layer on one owner (buckets of several matrices).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dist_rig.h"
#include "distmuon/dedicated_transfers.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

using test::Mirror;

// Three layers of two matrices; owners spread over the world.
const std::vector<std::string> kModules = {"",      "h",     "h.0", "h.0.a", "h.0.b", "h.1",
                                           "h.1.a", "h.1.b", "h.2", "h.2.a", "h.2.b"};
const std::vector<std::string> kNames = {"h.0.a.w", "h.0.b.w", "h.1.a.w",
                                         "h.1.b.w", "h.2.a.w", "h.2.b.w"};
constexpr int64_t kNumel = 5;

float grad_value(int rank, int j, int k, int round) {
  return static_cast<float>((rank + 1) * (j + 2) + k) * 0.5f + static_cast<float>(round * 3);
}

// The front's memory: one weight buffer per bucket, gradients as a front keeps them: each a
// tensor of its own from backward, or a view into its bucket's gradient buffer once the
// transfers asked for that (the owner keeps the views; non-owners drop theirs once sent), with
// what the transfers asked for counted.
class Memory final : public DedicatedMemory {
 public:
  Memory(Backend& be, const DedicatedLayout& layout, int member,
         const std::vector<DedicatedMatrix>& mats)
      : be_(be), layout_(layout), member_(member), mats_(mats), grads_(mats.size()) {
    for (const DedicatedLayout::Bucket& b : layout.buckets)
      buckets_.emplace_back(be, std::vector<float>(b.numel, -1.0f));
    released.assign(layout.buckets.size(), 0);
    grad_buffers_.resize(layout.buckets.size());
  }
  Region bucket(int b) override { return {buckets_[b].data(), nullptr}; }
  void release_bucket(int b) override { ++released[b]; }
  Region grads(int b, std::span<const int> present) override {
    const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
    if (std::find(bucket.matrices.begin(), bucket.matrices.end(), fail_grad) !=
        bucket.matrices.end()) {  // once: a front whose gradient cannot be lent (OOM)
      const int j = std::exchange(fail_grad, -1);
      DM_FAIL("gradient ", j, " cannot be lent");
    }
    const std::shared_ptr<Mirror<float>>& held = grad_buffers_[b];
    const bool views = held && std::all_of(bucket.matrices.begin(), bucket.matrices.end(),
                                           [&](int j) {
                                             return grads_[j].buf == held &&
                                                    grads_[j].offset == layout_.offset[j];
                                           });
    if (views) {
      ++lent_as_is;
      return {held->data(), held};
    }
    ++copied;  // compacted into a fresh buffer
    std::vector<float> flat(static_cast<size_t>(bucket.numel), 0.0f);
    for (int j : present) {
      if (!grads_[j].buf) {  // none here: zeros (the owner keeps them as its gradient)
        ++zero_filled;
        continue;
      }
      const std::vector<float> g = values(grads_[j]);
      std::copy(g.begin(), g.end(), flat.begin() + layout_.offset[j]);
    }
    auto buf = std::make_shared<Mirror<float>>(be_, flat);
    if (bucket.owner == member_) {
      for (int j : present) grads_[j] = {buf, layout_.offset[j]};
      grad_buffers_[b] = buf;
    }
    return {buf->data(), buf};  // a dropped gradient lives on while it travels
  }
  void drop_grad(int j) override {
    EXPECT_NE(mats_[j].owner, member_) << "the owner keeps its gradient";
    grads_[j] = {};
  }
  bool has_grad(int j) override { return grads_[j].buf != nullptr; }

  // Backward accumulating into matrix j's gradient (in place into a view).
  void accumulate(int j, const std::vector<float>& g) {
    Grad& d = grads_[j];
    if (!d.buf) {
      d = {std::make_shared<Mirror<float>>(be_, g), 0};
      return;
    }
    std::vector<float> v = d.buf->get();
    for (size_t k = 0; k < g.size(); ++k) v[d.offset + k] += g[k];
    d.buf->set(v);
  }
  // zero_grad(set_to_none=False): the gradients stay where they are, zeroed.
  void zero(int j) {
    Grad& d = grads_[j];
    if (!d.buf) return;
    std::vector<float> v = d.buf->get();
    std::fill(v.begin() + d.offset, v.begin() + d.offset + kNumel, 0.0f);
    d.buf->set(v);
  }
  std::optional<std::vector<float>> grad_values(int j) const {
    if (!grads_[j].buf) return std::nullopt;
    return values(grads_[j]);
  }
  std::vector<float> bucket_values(int b) const { return buckets_[b].get(); }
  void set_bucket(int b, const std::vector<float>& v) { buckets_[b].set(v); }

  std::vector<int> released;
  int zero_filled = 0;  // present matrices sent as zeros (no gradient here)
  int copied = 0;       // bucket buffers compacted from gradients of their own
  int lent_as_is = 0;   // bucket buffers whose gradients already were views of it
  int fail_grad = -1;   // the next request for this matrix's bucket throws

 private:
  struct Grad {
    std::shared_ptr<Mirror<float>> buf;
    int64_t offset = 0;
  };
  static std::vector<float> values(const Grad& d) {
    const std::vector<float> all = d.buf->get();
    return {all.begin() + d.offset, all.begin() + d.offset + kNumel};
  }
  Backend& be_;
  const DedicatedLayout& layout_;
  int member_;
  const std::vector<DedicatedMatrix>& mats_;
  std::vector<Mirror<float>> buckets_;
  std::vector<Grad> grads_;
  std::vector<std::shared_ptr<Mirror<float>>> grad_buffers_;  // the owner's, per bucket
};

// Who owns what: spread (neighbouring matrices on different members: one-matrix buckets at
// several ranks) or by layer (each layer's matrices on one member: one bucket of two).
enum class Owners { kSpread, kByLayer };

struct Rig {
  // `mean`: the transfers divide the owners' sums on the rig's backend.
  explicit Rig(int replicate, Owners owners = Owners::kSpread, bool mean = false) {
    Communicator& w = test::world();
    world = {w.size(), replicate, w.rank()};
    for (size_t j = 0; j < kNames.size(); ++j) {
      const size_t owner = owners == Owners::kSpread ? j * 5 + 1 : j / 2;
      mats.push_back({kNames[j], kNumel, DType::kF32, static_cast<int>(owner % w.size())});
    }
    layout = dedicated_layout(mats, kModules, world);
    memory.emplace(*be, layout, world.member, mats);
    const bool many = w.size() > 1;
    // The vote's communicator of its own (on the MPI rig the world is the host world).
    if (many) control = test::host_world().split(0, w.rank());
    transfers.emplace(mats, layout, world, many ? &w : nullptr, control.get(), *memory,
                      be->native_stream(), mean ? be.get() : nullptr);
  }
  // The world outlives this rig's backend: back to the default stream before that stream goes.
  ~Rig() {
    transfers.reset();
    if (world.size > 1) test::world().bind_stream(nullptr);
  }
  Rig(const Rig&) = delete;
  Rig& operator=(const Rig&) = delete;
  std::vector<float> grad_of(int rank, int j, int round) const {
    std::vector<float> g(kNumel);
    for (int k = 0; k < kNumel; ++k) g[k] = grad_value(rank, j, k, round);
    return g;
  }
  // What the owner holds after the reduction: the sum over the ranks that sent a gradient.
  std::vector<float> sum_of(int j, const std::vector<int>& rounds) const {
    std::vector<float> s(kNumel, 0.0f);
    for (int q = 0; q < world.size; ++q)
      for (int round : rounds)
        for (int k = 0; k < kNumel; ++k) s[k] += grad_value(q, j, k, round);
    return s;
  }
  // The owner's mean: the sum divided by the world size.
  std::vector<float> mean_of(int j, const std::vector<int>& rounds) const {
    std::vector<float> s = sum_of(j, rounds);
    for (float& x : s) x /= static_cast<float>(world.size);
    return s;
  }
  bool mine(int j) const { return mats[j].owner == world.member; }
  // The stages order their results on the backend's stream, which the Mirrors synchronise.
  void* stream() const { return be->native_stream(); }

  std::unique_ptr<Backend> be = test::make_backend();
  HsdpWorld world;
  std::vector<DedicatedMatrix> mats;
  DedicatedLayout layout;
  std::optional<Memory> memory;
  std::unique_ptr<Communicator> control;
  std::optional<DedicatedTransfers> transfers;
};

class DedicatedTransfersTest : public ::testing::TestWithParam<Owners> {};

std::vector<int> replicate_degrees() {
  const int size = test::world().size();
  return size == 4 ? std::vector<int>{1, 2} : std::vector<int>{1};
}

TEST_P(DedicatedTransfersTest, GradientsReachTheirOwnersSummedInAnyCompletionOrder) {
  for (int replicate : replicate_degrees()) {
    Rig rig(replicate, GetParam());
    const int n = static_cast<int>(kNames.size());
    std::vector<int> order(n);
    for (int j = 0; j < n; ++j) order[j] = j;  // forward order: against the expected one
    std::rotate(order.begin(), order.begin() + rig.world.member % n, order.end());
    std::vector<int> landed;
    for (int j : order) {
      rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, 0));
      for (const std::vector<int>& js : rig.transfers->grad_ready(j, rig.stream()))
        landed.insert(landed.end(), js.begin(), js.end());
    }
    std::vector<int> to_average = rig.transfers->finish(rig.stream());
    std::vector<int> owned;
    for (int j = 0; j < n; ++j) {
      if (!rig.mine(j)) {
        EXPECT_FALSE(rig.memory->has_grad(j)) << "a non-owner keeps the gradient it sent";
        continue;
      }
      owned.push_back(j);
      test::expect_close(*rig.memory->grad_values(j), rig.sum_of(j, {0}), kNames[j]);
    }
    std::sort(landed.begin(), landed.end());
    EXPECT_EQ(to_average, rig.world.size > 1 ? owned : std::vector<int>{});
    // Landed during backward (host communicators: once complete), never twice.
    EXPECT_TRUE(std::includes(owned.begin(), owned.end(), landed.begin(), landed.end()));
    EXPECT_EQ(std::adjacent_find(landed.begin(), landed.end()), landed.end());
  }
}

// A member whose gradient could not be read when it was ready (the hook raised) sends it at the
// next stage, still in its place in the order: the members stay matched and the sums are whole.
TEST_P(DedicatedTransfersTest, AGradientThatCouldNotBeReadIsSentLaterInItsPlace) {
  Rig rig(1, GetParam());
  const int n = static_cast<int>(kNames.size());
  std::vector<int> order(n);
  for (int j = 0; j < n; ++j) order[j] = n - 1 - j;  // backward order
  if (rig.world.member == 0) rig.memory->fail_grad = order[1];
  for (int j : order) {
    rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, 0));
    try {
      rig.transfers->grad_ready(j, rig.stream());
    } catch (const Error& e) {
      EXPECT_EQ(rig.world.member, 0);
      EXPECT_NE(std::string(e.what()).find("cannot be lent"), std::string::npos) << e.what();
    }
  }
  rig.transfers->finish(rig.stream());
  for (int j = 0; j < n; ++j)
    if (rig.mine(j)) test::expect_close(*rig.memory->grad_values(j), rig.sum_of(j, {0}), kNames[j]);
}

// A member without a gradient for the first matrix of the order holds every matrix back until
// step(); another forward before step() would pair its broadcasts with the others' reductions.
// It fails on every member instead, changes nothing (step() then reduces everything), and a
// forward after step() or after an even backward passes the check.
TEST_P(DedicatedTransfersTest, AForwardAfterAnUnevenBackwardFailsOnEveryMemberAndStepStillWorks) {
  // On a stream (NCCL) the other members' reductions wait on the device for member 1, which
  // issues its part only at finish(); this rig's gradients are host mirrors that synchronise the
  // device on every write, so the members would wait there forever (seen at 8 ranks on the H200):
  // the hazard docs/dedicated.md names (no device synchronisation between an uneven backward and
  // step()). The check itself is host code on the control communicator, the same on both rigs.
  if (test::on_cuda()) GTEST_SKIP() << "needs host-side gradients (see the comment)";
  Rig rig(1, GetParam());
  if (rig.world.size == 1) GTEST_SKIP() << "one member holds nothing back";
  const int n = static_cast<int>(kNames.size());
  const int first = n - 1;  // the reduction order starts with the last layer's last matrix
  rig.transfers->begin_forward();
  for (int j = n - 1; j >= 0; --j) {
    if (rig.world.member == 1 && j == first) continue;  // no gradient here
    rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, 0));
    rig.transfers->grad_ready(j, rig.stream());
  }
  try {
    rig.transfers->begin_forward();
    ADD_FAILURE() << "a forward after an uneven backward did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("before step()"), std::string::npos) << e.what();
  }
  rig.transfers->finish(rig.stream());
  for (int j = 0; j < n; ++j) {
    if (!rig.mine(j)) continue;
    std::vector<float> want = rig.sum_of(j, {0});
    if (j == first)  // member 1 sent zeros
      for (int k = 0; k < kNumel; ++k) want[k] -= grad_value(1, j, k, 0);
    test::expect_close(*rig.memory->grad_values(j), want, kNames[j]);
  }
  rig.transfers->begin_forward();  // the first since step(): no check
  rig.transfers->begin_forward();  // nothing sent anywhere: the check passes
  rig.transfers->finish(rig.stream());
}

TEST_P(DedicatedTransfersTest, TheVoteSkipsMatricesWithoutAGradientAnywhere) {
  Rig rig(1, GetParam());
  // Matrix 0: a gradient on rank 0 only (the others send zeros at finish); matrix 1: none.
  if (rig.world.member == 0) {
    rig.memory->accumulate(0, rig.grad_of(0, 0, 0));
    rig.transfers->grad_ready(0, rig.stream());
  }
  const std::vector<int> to_average = rig.transfers->finish(rig.stream());
  if (rig.mine(0)) {
    test::expect_close(*rig.memory->grad_values(0), rig.grad_of(0, 0, 0), "matrix 0");
    EXPECT_EQ(to_average, rig.world.size > 1 ? std::vector<int>{0} : std::vector<int>{});
  }
  EXPECT_FALSE(rig.memory->has_grad(1));
  const int expected_zeros = rig.world.member == 0 || rig.world.size == 1 ? 0 : 1;
  EXPECT_EQ(rig.memory->zero_filled, expected_zeros);
}

TEST_P(DedicatedTransfersTest, ASecondBackwardBeforeTheStepIsReducedAgain) {
  Rig rig(1, GetParam());
  const int n = static_cast<int>(kNames.size());
  std::vector<int> all(n);
  for (int j = 0; j < n; ++j) all[j] = j;
  for (int round = 0; round < 2; ++round) {
    for (int j = n - 1; j >= 0; --j) {
      rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, round));
      rig.transfers->grad_ready(j, rig.stream());
    }
    // The owner accumulates into the buffer its reduction writes: the first backward's
    // reductions complete before the second backward runs (autograd's order on one stream).
    if (round == 0) rig.transfers->wait(all, rig.stream());
  }
  rig.transfers->finish(rig.stream());
  for (int j = 0; j < n; ++j)
    if (rig.mine(j))
      test::expect_close(*rig.memory->grad_values(j), rig.sum_of(j, {0, 1}), kNames[j]);
}

// With a backend the owners' sums become means in the transfers: at finish(), or at wait() for
// the matrices the owner takes early (overlap_step), once either way.
TEST_P(DedicatedTransfersTest, WithABackendTheOwnersHoldTheMeanOnce) {
  for (int replicate : replicate_degrees()) {
    Rig rig(replicate, GetParam(), /*mean=*/true);
    const int n = static_cast<int>(kNames.size());
    for (int step = 0; step < 2; ++step) {
      std::vector<int> waited;
      for (int j = n - 1; j >= 0; --j) {
        rig.memory->zero(j);  // the owner's views of the last step (none elsewhere)
        rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, step));
        for (const std::vector<int>& js : rig.transfers->grad_ready(j, rig.stream())) {
          if (step == 0) continue;  // the second step takes the landed layers early
          rig.transfers->wait(js, rig.stream());
          waited.insert(waited.end(), js.begin(), js.end());
        }
      }
      const std::vector<int> divided = rig.transfers->finish(rig.stream());
      std::vector<int> rest;
      for (int j = 0; j < n; ++j) {
        if (!rig.mine(j)) continue;
        if (std::find(waited.begin(), waited.end(), j) == waited.end()) rest.push_back(j);
        test::expect_close(*rig.memory->grad_values(j), rig.mean_of(j, {step}), kNames[j]);
      }
      EXPECT_EQ(divided, rig.world.size > 1 ? rest : std::vector<int>{}) << "step " << step;
    }
  }
}

TEST_P(DedicatedTransfersTest, AGradientAfterItsUpdateWasPreparedFailsOnEveryRank) {
  Rig rig(1, GetParam());
  if (rig.world.size == 1) GTEST_SKIP() << "one rank reduces nothing";
  const int n = static_cast<int>(kNames.size());
  auto backward = [&](int j, int round) {
    rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, round));
    for (const std::vector<int>& js : rig.transfers->grad_ready(j, rig.stream())) {
      rig.transfers->wait(js, rig.stream());  // the owner prepares the landed layer's updates
      rig.transfers->prepared(js);
    }
  };
  // The last matrix of the reduction order comes after the others completed, so its arrival
  // lands (and prepares) the other layers; then a second backward reaches the prepared ones.
  for (int j = n - 1; j >= 1; --j) backward(j, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  backward(0, 0);
  for (int j = n - 1; j >= 0; --j) backward(j, 1);
  try {
    rig.transfers->finish(rig.stream());
    ADD_FAILURE() << "a late gradient did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no_sync()"), std::string::npos) << e.what();
  }
  // The state was reset: the next step reduces afresh.
  for (int j = 0; j < n; ++j)
    if (!rig.mine(j)) rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, 0));
  for (int j = n - 1; j >= 0; --j) rig.transfers->grad_ready(j, rig.stream());
  rig.transfers->finish(rig.stream());
}

// One backward issues one reduction per bucket (a bucket's matrices have one owner), of the
// bucket's flat gradient buffer, during backward (not at step()); in HSDP one more across
// replicas at the owner's shard position. The owner keeps its gradients as views of the buffer:
// after zero_grad(set_to_none=False) the next backward accumulates there and the buffer is lent
// as it is, without a copy.
TEST_P(DedicatedTransfersTest, OneBackwardReducesEachBucketOnceAsOneBuffer) {
  for (int replicate : replicate_degrees()) {
    Rig rig(replicate, GetParam());
    if (rig.world.size == 1) GTEST_SKIP() << "one member moves nothing";
    const int n = static_cast<int>(kNames.size());
    const int shard = rig.world.size / replicate;
    const int my_s = rig.world.member % shard, my_r = rig.world.member / shard;
    const int64_t es = sizeof(float);
    // What this member's communicators count for one backward.
    CommStats want;
    int owned = 0;
    const int buckets = static_cast<int>(rig.layout.buckets.size());
    for (const DedicatedLayout::Bucket& b : rig.layout.buckets) {
      const int owner_s = b.owner % shard, owner_r = b.owner / shard;
      owned += b.owner == rig.world.member;
      want.ops += 1;  // in the shard group, to the owner's shard position
      if (owner_s == my_s)
        want.bytes_received += (shard - 1) * b.numel * es;
      else
        want.bytes_sent += b.numel * es;
      if (replicate == 1 || owner_s != my_s) continue;
      want.ops += 1;  // across replicas, to the owner
      if (owner_r == my_r)
        want.bytes_received += (replicate - 1) * b.numel * es;
      else
        want.bytes_sent += b.numel * es;
    }
    // One per matrix before: fewer wherever a bucket holds several.
    if (GetParam() == Owners::kByLayer) {
      EXPECT_EQ(buckets, n / 2);
    }
    for (int step = 0; step < 2; ++step) {
      const CommStats before = rig.transfers->traffic();
      const int copied = rig.memory->copied, lent = rig.memory->lent_as_is;
      for (int j = n - 1; j >= 0; --j) {
        rig.memory->zero(j);  // the owner's views of the last step (none elsewhere)
        rig.memory->accumulate(j, rig.grad_of(rig.world.member, j, step));
        rig.transfers->grad_ready(j, rig.stream());
      }
      const CommStats in_backward = rig.transfers->traffic() - before;
      EXPECT_GE(in_backward.ops, buckets) << "every bucket's reduction starts during backward";
      EXPECT_LE(in_backward.ops, want.ops);
      rig.transfers->finish(rig.stream());
      const CommStats got = rig.transfers->traffic() - before;
      EXPECT_EQ(got.ops, want.ops) << "step " << step;
      EXPECT_EQ(got.bytes_sent, want.bytes_sent) << "step " << step;
      EXPECT_EQ(got.bytes_received, want.bytes_received) << "step " << step;
      for (int j = 0; j < n; ++j)
        if (rig.mine(j))
          test::expect_close(*rig.memory->grad_values(j), rig.sum_of(j, {step}), kNames[j]);
      // Non-owners (and relays) compact the gradients backward made; the owner too at first.
      EXPECT_EQ(rig.memory->copied - copied, step == 0 ? buckets : buckets - owned);
      EXPECT_EQ(rig.memory->lent_as_is - lent, step == 0 ? 0 : owned);
    }
  }
}

TEST_P(DedicatedTransfersTest, ForwardBringsEachBucketFromItsOwnerAndFreesItAfterItsGradients) {
  for (int replicate : replicate_degrees()) {
    Rig rig(replicate, GetParam());
    const int shard = rig.world.size / replicate;
    const int my_r = rig.world.member / shard;
    auto owner_values = [&](int b) {
      std::vector<float> v(rig.layout.buckets[b].numel);
      for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(b * 100 + k);
      return v;
    };
    for (size_t b = 0; b < rig.layout.buckets.size(); ++b)
      if (rig.layout.buckets[b].owner == rig.world.member)
        rig.memory->set_bucket(static_cast<int>(b), owner_values(static_cast<int>(b)));
    // HSDP: owners publish to their replicas first (the relays then hold the weights).
    rig.transfers->publish(rig.stream());
    rig.transfers->wait_published(rig.stream());
    rig.transfers->begin_forward();
    rig.transfers->issue(0, rig.stream());
    const int units = static_cast<int>(rig.layout.units.size());
    for (int u = 0; u < units; ++u) {
      rig.transfers->wait_unit(u, rig.stream());
      rig.transfers->issue(u + 1, rig.stream());
      for (int b : rig.layout.units[u].buckets)
        test::expect_close(
            rig.memory->bucket_values(b), owner_values(b),
            "bucket " + std::to_string(b) + " (replica " + std::to_string(my_r) + ")");
    }
    for (size_t b = 0; b < rig.layout.buckets.size(); ++b) {
      const int grads = static_cast<int>(rig.layout.buckets[b].matrices.size());
      for (int g = 0; g < grads; ++g) {
        EXPECT_EQ(rig.memory->released[b], 0) << "bucket " << b << " freed before its gradients";
        rig.transfers->used(static_cast<int>(b));
      }
      EXPECT_EQ(rig.memory->released[b], 1) << "bucket " << b;
    }
    rig.transfers->release_all(rig.stream());
  }
}

INSTANTIATE_TEST_SUITE_P(Owners, DedicatedTransfersTest,
                         ::testing::Values(Owners::kSpread, Owners::kByLayer),
                         [](const ::testing::TestParamInfo<Owners>& info) {
                           return info.param == Owners::kSpread ? "spread" : "by_layer";
                         });

}  // namespace
}  // namespace distmuon
