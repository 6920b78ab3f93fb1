// The simulator's step model: see sim_step.h.
#include "plan/sim_step.h"

#include <algorithm>
#include <map>

#include "distmuon/error.h"

namespace distmuon::sim_detail {
namespace {

// ---- the step's timeline ------------------------------------------------------------------------

struct Clock {
  double host = 0;     // the host has issued everything up to here
  double compute = 0;  // the compute stream has finished everything issued to it
  double comm = 0;     // the communicator's stream likewise
  double joined = 0;  // when this rank's NCCL kernel of the current collective started
  // When this rank's NCCL kernels held SMs, in order: [begin, end) and the share of the compute
  // they took (waiting for peers, then moving data); kernels beside them run at 1 - share.
  struct Busy {
    double begin, end, share;
  };
  std::vector<Busy> busy;
  size_t first_live = 0;  // busy[i] for i < first_live ended before `compute`
};

// The ranks of one step. Each host issues in program order: a kernel costs it nothing, a
// collective `issue_s`. A kernel starts once issued, after the kernels before it and after the
// collective it waits for (`after`, the runtime's wait_on_stream). A collective starts once every
// rank issued it and the kernels each issued before it finished (the communicator's stream
// waits for the caller's), after the collective before it; it ends at the same time everywhere.
// Where ranks share one GPU, a collective takes `share` of each rank's compute while it moves
// data (from when every rank joined to its end) and `wait_share` from when the rank's own NCCL
// kernel started until then (its CTAs spin on their SMs while they wait for the peers).
class Timeline {
 public:
  Timeline(int ranks, double issue_s, double share = 0, double wait_share = 0)
      : c_(static_cast<size_t>(ranks)), issue_(issue_s), share_(share), wait_share_(wait_share) {}
  void kernel(int q, double seconds, double after = 0) {
    Clock& c = c_[static_cast<size_t>(q)];
    double t = std::max({c.compute, c.host, after});
    // Walk the intervals NCCL kernels hold SMs in from t on.
    while (c.first_live < c.busy.size() && c.busy[c.first_live].end <= t) ++c.first_live;
    for (size_t i = c.first_live; i < c.busy.size() && seconds > 0; ++i) {
      const auto [b, e, s] = c.busy[i];
      if (t < b) {  // full speed until the interval
        const double free = std::min(seconds, b - t);
        t += free;
        seconds -= free;
        if (seconds <= 0) break;
      }
      const double slow = std::min(seconds / (1 - s), e - std::max(t, b));
      t = std::max(t, b) + slow;
      seconds -= slow * (1 - s);
    }
    c.compute = t + std::max(0.0, seconds);
  }
  // Returns when the collective ends. One that joins the group of the one before it
  // (Communicator::grouped) costs the host nothing more: the group is launched once; and its
  // device time is `seconds` less `saved` (StepModel::group_saving), the part of its latency
  // that overlaps the group's other operations.
  double collective(double seconds, bool joins_group = false, double saved = 0) {
    if (joins_group) seconds = std::max(0.0, seconds - saved);
    double start = 0;
    for (Clock& c : c_) {
      if (!joins_group) c.host += issue_;
      c.joined = std::max({c.host, c.compute, c.comm});
      start = std::max(start, c.joined);
    }
    const double end = start + seconds;
    for (Clock& c : c_) {
      if (wait_share_ > 0 && c.joined < start) c.busy.push_back({c.joined, start, wait_share_});
      if (share_ > 0 && seconds > 0) c.busy.push_back({start, end, share_});
      c.comm = end;
    }
    ++collectives_;
    if (!joins_group) ++launches_;
    return end;
  }
  // Every host waits until `t` (a collective it blocks on).
  void host_wait(double t) {
    for (Clock& c : c_) c.host = std::max(c.host, t);
  }
  // Every host waits for its device; returns when the last one is done.
  double sync() {
    double t = 0;
    for (Clock& c : c_) {
      c.host = c.compute = c.comm = std::max({c.host, c.compute, c.comm});
      t = std::max(t, c.host);
    }
    return t;
  }
  int64_t collectives() const { return collectives_; }
  int64_t launches() const { return launches_; }

 private:
  std::vector<Clock> c_;
  double issue_, share_, wait_share_;
  int64_t collectives_ = 0, launches_ = 0;
};

std::pair<int64_t, int64_t> chunk(int64_t dim0, int parts, int pos) {  // FSDP2's Shard(0)
  const int64_t cs = (dim0 + parts - 1) / parts;
  const int64_t b = std::min<int64_t>(pos * cs, dim0), e = std::min<int64_t>(b + cs, dim0);
  return {b, e - b};
}

// Elements of slice `slice` of tensor t that dim-0 shard position q of `parts` holds.
int64_t piece(const SimTensor& t, int64_t slice, int parts, int q) {
  const auto [b, n] = chunk(t.dim0, parts, q);
  const int64_t inner = t.numel / t.dim0;
  const int64_t first = slice * t.rows * t.cols, last = first + t.rows * t.cols;
  const int64_t start = std::max(b * inner, first), end = std::min((b + n) * inner, last);
  if (end <= start) return 0;
  return ((end - first) / t.cols - (start - first) / t.cols) * t.cols;
}

// A run: the matrices of one bucket that are one batched orthogonalization (gather: one shape;
// owner modes: one owner, plan batch and shape).
struct Run {
  int owner = 0;  // -1: every rank (gather)
  int64_t m = 0, n = 0, count = 0, elems = 0;
};

std::vector<Run> runs_of(const std::vector<int>& bucket, const std::vector<SimMatrix>& mats,
                         bool by_owner) {
  std::map<std::tuple<int, int, int64_t, int64_t>, Run> runs;
  for (int j : bucket) {
    const SimMatrix& mt = mats[static_cast<size_t>(j)];
    const auto key =
        std::make_tuple(by_owner ? mt.owner : -1, by_owner ? mt.batch : 0, mt.m(), mt.n());
    Run& r = runs[key];
    r.owner = by_owner ? mt.owner : -1;
    r.m = mt.m();
    r.n = mt.n();
    r.count += 1;
    r.elems += mt.elems;
  }
  std::vector<Run> out;
  for (auto& [key, r] : runs) out.push_back(r);
  return out;
}

// The owners' batches of the engine's step (build_owner_batches): the matrices of one owner, plan
// batch and shape, across buckets (across = true), each orthogonalized in the compute stage of
// its last bucket; or each run of a bucket alone (across = false, the engine's
// DistOptions::batches_across_buckets off). ready[b]: the bucket whose compute completes the
// updates of bucket b (the last bucket of any batch with a member in b).
struct OwnerBatches {
  struct Batch {
    int owner = 0, last = 0;
    int64_t m = 0, n = 0, count = 0;
    double elems = 0;
  };
  std::vector<Batch> batches;
  std::vector<int> ready;
  std::vector<std::vector<int>> ready_here;  // per bucket: the buckets whose ready it is
};

OwnerBatches owner_batches(const std::vector<std::vector<int>>& buckets,
                           const std::vector<SimMatrix>& mats, bool across) {
  OwnerBatches out;
  std::map<std::tuple<int, int, int64_t, int64_t, int>, size_t> index;
  std::vector<std::vector<int>> in_bucket(buckets.size());  // the batches with a member in b
  for (size_t b = 0; b < buckets.size(); ++b)
    for (int j : buckets[b]) {
      const SimMatrix& mt = mats[static_cast<size_t>(j)];
      const auto key =
          std::make_tuple(mt.owner, mt.batch, mt.m(), mt.n(), across ? 0 : static_cast<int>(b));
      auto it = index.find(key);
      if (it == index.end()) {
        it = index.emplace(key, out.batches.size()).first;
        out.batches.push_back({mt.owner, 0, mt.m(), mt.n(), 0, 0.0});
      }
      OwnerBatches::Batch& bt = out.batches[it->second];
      bt.last = static_cast<int>(b);
      bt.count += 1;
      bt.elems += static_cast<double>(mt.elems);
      if (in_bucket[b].empty() || in_bucket[b].back() != static_cast<int>(it->second))
        in_bucket[b].push_back(static_cast<int>(it->second));
    }
  out.ready.resize(buckets.size());
  out.ready_here.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    out.ready[b] = static_cast<int>(b);
    for (int i : in_bucket[b]) out.ready[b] = std::max(out.ready[b], out.batches[i].last);
    out.ready_here[static_cast<size_t>(out.ready[b])].push_back(static_cast<int>(b));
  }
  return out;
}

// The engine's buckets at a world size: consecutive matrices of about bucket_bytes (wire bytes of
// full matrices); one bucket at one rank, where nothing moves (dist_layout.cc).
std::vector<std::vector<int>> make_buckets(const std::vector<SimMatrix>& mats, int world,
                                           const CommModel& cm) {
  std::vector<std::vector<int>> buckets;
  const int64_t limit = world == 1 ? 0 : cm.bucket_bytes;
  int64_t bytes = 0;
  for (size_t j = 0; j < mats.size(); ++j) {
    const int64_t mb = mats[j].elems * cm.wire_elem_bytes;
    if (buckets.empty() || (limit > 0 && bytes + mb > limit)) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(static_cast<int>(j));
    bytes += mb;
  }
  return buckets;
}

// One world size: the layout, the costs of its pieces, and the modes' timelines.
class StepModel {
 public:
  StepModel(const std::vector<SimTensor>& tensors, std::vector<SimMatrix> mats, int world,
            int per_node, const CommModel& cm, const CostTable& costs)
      : tensors_(tensors),
        mats_(std::move(mats)),
        d_(world),
        per_node_(per_node),
        cm_(cm),
        costs_(costs),
        wire_(static_cast<double>(cm.wire_elem_bytes)),
        issue_(world > 1 ? cm.collective_latency_s : cm.local_collective_s),
        share_(world > 1 ? cm.comm_compute_share : 0),
        wait_share_(world > 1 ? cm.comm_wait_share : 0),
        buckets_(make_buckets(mats_, world, cm)) {}

  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }

  // The tensors of each FSDP2 unit, units in increasing order, a tensor without one alone.
  std::vector<std::vector<size_t>> units() const {
    std::map<std::pair<int64_t, size_t>, std::vector<size_t>> by;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const int64_t u = tensors_[i].unit;
      by[u >= 0 ? std::make_pair(u, size_t{0}) : std::make_pair(int64_t{-1}, i)].push_back(i);
    }
    std::vector<std::vector<size_t>> out;
    for (auto& [key, ts] : by) out.push_back(std::move(ts));
    return out;
  }

  // The FSDP2 emulation of distmuon-bench, a unit per layer (Workload::fsdp_units): before the
  // step one reduce per non-empty dim-0 shard of every tensor (to its holder: a rooted reduce, at
  // that rate where calibrated, as the dedicated mode's), after it one all-gather per tensor, each
  // unit's launched as one group each way. Every rank issues the same, so one clock stands for all.
  void fsdp(SimPoint& p) const {
    const Link r = root_reduce_link(d_, cm_, per_node_);
    Timeline rs(1, issue_), ag(1, issue_);
    for (const std::vector<size_t>& unit : units()) {
      bool joins = false;
      for (size_t i : unit) {
        const SimTensor& t = tensors_[i];
        const double inner = static_cast<double>(t.numel / t.dim0);
        for (int q = 0; q < d_; ++q) {
          const int64_t rows = chunk(t.dim0, d_, q).second;
          if (rows == 0) continue;
          const double b = static_cast<double>(rows) * inner * wire_;
          rs.collective(d_ == 1 ? local(b) : chain_seconds(b, d_, r), joins, group_saving(r));
          joins = true;
        }
      }
      joins = false;
      for (size_t i : unit) {
        const double b = static_cast<double>(tensors_[i].numel) * wire_;
        ag.collective(d_ == 1 ? local(b) : ring_allgather_seconds(b, d_, cm_, per_node_), joins,
                      group_saving(link(d_, cm_, per_node_)));
        joins = true;
      }
    }
    p.fsdp_reduce_scatter = rs.sync();
    p.fsdp_all_gather = ag.sync();
    p.fsdp_collectives = rs.collectives() + ag.collectives();
    p.fsdp_launches = rs.launches() + ag.launches();
  }

  void gather(SimPoint& p) const {
    Timeline t(d_, issue_, share_, wait_share_);
    vote(t);
    const size_t nb = buckets_.size();
    std::vector<double> gathered(nb);
    for (size_t b = 0; b < nb; ++b) {  // stage 0 of every bucket: statuses, then the rows
      const double statuses = t.collective(tiny());
      for (int q = 0; q < d_; ++q) t.kernel(q, 0, statuses);  // pass 2 waits for them
      const double bytes = elems(buckets_[b]) * wire_;
      gathered[b] =
          t.collective(d_ == 1 ? local(bytes) : ring_allgather_seconds(bytes, d_, cm_, per_node_));
    }
    int64_t runs = 0;
    for (size_t b = 0; b < nb; ++b) {  // stage 1: unpack, orthogonalize everything, apply
      const double e = elems(buckets_[b]);
      double ortho = 0;
      for (const Run& r : runs_of(buckets_[b], mats_, false)) {
        ortho += costs_.batch_seconds(r.m, r.n, r.count);
        ++runs;
      }
      for (int q = 0; q < d_; ++q)
        t.kernel(q, copy(e * wire_) + ortho + elementwise(e), gathered[b]);
    }
    p.gather_engine = t.sync();
    p.gather_collectives = t.collectives();
    p.gather_runs = runs;
  }

  void sharded(SimPoint& p) const {
    Timeline t(d_, issue_, share_, wait_share_);
    vote(t);
    const size_t nb = buckets_.size();
    std::vector<double> there(nb), back(nb), statuses(nb);
    // own: elements of the matrices q owns, less q's own rows of them (which go straight to and
    // from the stages, never through the all-to-alls); mine: elements of q's rows of every
    // matrix (the pack of stage 0 copies each once, to the all-to-all or the stage).
    std::vector<std::vector<double>> own(nb), mine(nb);
    std::vector<double> a2a(nb), a2a_back(nb);
    const OwnerWork w = owner_work();
    const OwnerBatches& ob = w.batches;
    const auto &ortho = w.ortho, &done = w.done;
    const auto& runs = w.runs;
    for (size_t b = 0; b < nb; ++b) {
      own[b].assign(static_cast<size_t>(d_), 0.0);
      mine[b].assign(static_cast<size_t>(d_), 0.0);
      std::vector<double> send(static_cast<size_t>(d_), 0.0), recv(send);
      for (int j : buckets_[b]) {
        const SimMatrix& mt = mats_[static_cast<size_t>(j)];
        own[b][static_cast<size_t>(mt.owner)] += static_cast<double>(mt.elems);
        for (int q = 0; q < d_; ++q) {
          const double e =
              static_cast<double>(piece(tensors_[static_cast<size_t>(mt.tensor)], mt.slice, d_, q));
          mine[b][static_cast<size_t>(q)] += e;
          if (q == mt.owner) {
            own[b][static_cast<size_t>(q)] -= e;
            recv[static_cast<size_t>(q)] += (static_cast<double>(mt.elems) - e) * wire_;
          } else {
            send[static_cast<size_t>(q)] += e * wire_;
          }
        }
      }
      if (cm_.uniform_all_to_all) {  // every pair moves the bucket's largest pair's elements
        std::vector<double> pair(static_cast<size_t>(d_) * d_, 0.0);  // [from * D + to]
        for (int j : buckets_[b]) {
          const SimMatrix& mt = mats_[static_cast<size_t>(j)];
          for (int q = 0; q < d_; ++q)
            if (q != mt.owner)
              pair[static_cast<size_t>(q) * d_ + mt.owner] += static_cast<double>(
                  piece(tensors_[static_cast<size_t>(mt.tensor)], mt.slice, d_, q));
        }
        const double block = *std::max_element(pair.begin(), pair.end()) * wire_;
        std::fill(send.begin(), send.end(), (d_ - 1) * block);
        std::fill(recv.begin(), recv.end(), (d_ - 1) * block);
      }
      // The all-to-alls: the slowest rank sets the pace.
      for (int q = 0; q < d_; ++q) {
        const size_t i = static_cast<size_t>(q);
        a2a[b] = std::max(a2a[b], alltoall_seconds(send[i], recv[i], d_, cm_, per_node_));
        a2a_back[b] = std::max(a2a_back[b], alltoall_seconds(recv[i], send[i], d_, cm_, per_node_));
      }
    }
    for (size_t b = 0; b < nb; ++b) {  // stage 0 of every bucket: pack, rows to their owners
      for (int q = 0; q < d_; ++q) t.kernel(q, copy(mine[b][static_cast<size_t>(q)] * wire_));
      there[b] = t.collective(a2a[b]);
    }
    // Stages 1 (unpack, orthogonalize the batches whose last bucket this is) and 2 (pack, the
    // statuses' all-reduce and the updates back in one launch: a bucket one slot after the
    // compute that completes it), pipelined.
    for (size_t s = 0; s <= nb; ++s) {
      if (s < nb) {
        for (int q = 0; q < d_; ++q)
          t.kernel(q, copy(own[s][static_cast<size_t>(q)] * wire_), there[s]);
        for (int q = 0; q < d_; ++q) {
          const size_t i = static_cast<size_t>(q);
          t.kernel(q, ortho[s][i] + elementwise(done[s][i]));
        }
      }
      if (s >= 1)
        for (const int c : ob.ready_here[s - 1]) {
          const size_t b = static_cast<size_t>(c);
          for (int q = 0; q < d_; ++q) t.kernel(q, copy(own[b][static_cast<size_t>(q)] * wire_));
          statuses[b] = t.collective(tiny());
          back[b] = t.collective(a2a_back[b], /*joins_group=*/true,
                                 group_saving(link(d_, cm_, per_node_)));
        }
    }
    for (size_t b = 0; b < nb; ++b)  // stage 3: apply, once the updates and statuses are in
      for (int q = 0; q < d_; ++q) t.kernel(q, 0, std::max(back[b], statuses[b]));
    p.sharded_engine = t.sync();
    p.sharded_collectives = t.collectives();
    p.sharded_launches = t.launches();
    p.owner_runs = std::max(p.owner_runs, *std::max_element(runs.begin(), runs.end()));
  }

  void dedicated(SimPoint& p) const {
    Timeline t(d_, issue_, share_, wait_share_);
    vote(t);
    const Link r = root_reduce_link(d_, cm_, per_node_);
    const Link bc = broadcast_link(d_, cm_, per_node_);
    const size_t nb = buckets_.size();
    std::vector<double> reduced(nb, 0.0);
    // Each bucket's reduces, and then its broadcasts, are launched as one group.
    for (size_t b = 0; b < nb; ++b) {  // stages 0-1 of every bucket: a reduce per matrix
      bool joins = false;
      for (int j : buckets_[b]) {
        const double bytes = static_cast<double>(mats_[static_cast<size_t>(j)].elems) * wire_;
        reduced[b] =
            t.collective(d_ == 1 ? local(bytes) : chain_seconds(bytes, d_, r), joins, group_saving(r));
        joins = true;
      }
    }
    const OwnerWork w = owner_work();
    const OwnerBatches& ob = w.batches;
    const auto &ortho = w.ortho, &done = w.done;
    const auto& runs = w.runs;
    // Stage 2 (the owner's step: the batches whose last bucket this is, once the bucket's
    // reduction landed) and, one slot after the compute that completes a bucket, stage 3: a
    // broadcast per matrix, the bucket's as one group. Pipelined.
    for (size_t s = 0; s <= nb; ++s) {
      if (s < nb) {
        std::vector<double> own(static_cast<size_t>(d_), 0.0);
        for (int j : buckets_[s])
          own[static_cast<size_t>(mats_[static_cast<size_t>(j)].owner)] +=
              static_cast<double>(mats_[static_cast<size_t>(j)].elems);
        for (int q = 0; q < d_; ++q) {
          const size_t i = static_cast<size_t>(q);
          // At D > 1 the owner first turns the summed gradient into the mean (in place).
          t.kernel(q, (d_ > 1 ? copy(own[i] * wire_) : 0) + ortho[s][i] + elementwise(done[s][i]),
                   reduced[s]);
        }
      }
      if (s >= 1)
        for (const int c : ob.ready_here[s - 1]) {
          bool joins = false;
          for (int j : buckets_[static_cast<size_t>(c)]) {
            const double bytes = static_cast<double>(mats_[static_cast<size_t>(j)].elems) * wire_;
            t.collective(d_ == 1 ? local(0) : chain_seconds(bytes, d_, bc),  // in place
                         joins, group_saving(bc));
            joins = true;
          }
        }
    }
    p.dedicated_engine = t.sync();
    p.dedicated_collectives = t.collectives();
    p.dedicated_launches = t.launches();
    p.owner_runs = std::max(p.owner_runs, *std::max_element(runs.begin(), runs.end()));
  }

  void adamw(SimPoint& p) const {
    Timeline t(d_, issue_, share_, wait_share_);
    vote(t);
    for (int q = 0; q < d_; ++q) t.kernel(q, p.adamw_update);
    p.adamw_engine = t.sync();
    p.adamw_collectives = t.collectives();
  }

 private:
  // The owners' batches (owner_batches) and what they cost: per bucket b and rank q, the seconds
  // and elements of q's batches that complete at b (their last bucket), and q's batch count.
  struct OwnerWork {
    OwnerBatches batches;
    std::vector<std::vector<double>> ortho, done;
    std::vector<int64_t> runs;
  };
  OwnerWork owner_work() const {
    OwnerWork w{owner_batches(buckets_, mats_, cm_.batches_across_buckets), {}, {}, {}};
    const size_t nb = buckets_.size(), d = static_cast<size_t>(d_);
    w.ortho.assign(nb, std::vector<double>(d, 0.0));
    w.done.assign(nb, std::vector<double>(d, 0.0));
    w.runs.assign(d, 0);
    for (const OwnerBatches::Batch& bt : w.batches.batches) {
      const size_t q = static_cast<size_t>(bt.owner), last = static_cast<size_t>(bt.last);
      w.ortho[last][q] += costs_.batch_seconds(bt.m, bt.n, bt.count);
      w.done[last][q] += bt.elems;
      w.runs[q] += 1;
    }
    return w;
  }
  // A step starts with the ranks' vote (an all-reduce of a few values the host waits for).
  void vote(Timeline& t) const {
    if (d_ > 1) t.host_wait(t.collective(tiny()));
  }
  // An all-reduce of a few values: latency only.
  double tiny() const { return d_ == 1 ? local(0) : 2 * (d_ - 1) * link(d_, cm_, per_node_).alpha; }
  // Reading and writing `bytes` at the memory bandwidth.
  double copy(double bytes) const { return 2 * bytes / cm_.hbm_bytes_per_s; }
  // A collective at one rank: NCCL's local copy of `bytes` (0: in place).
  double local(double bytes) const { return copy(bytes); }
  // What a collective on `l` saves after the first of its group: the share of its D-1 hops'
  // latency that NCCL overlaps with the group's other operations (CommModel::grouped_hop_share).
  double group_saving(const Link& l) const {
    return d_ == 1 ? 0 : (1 - cm_.grouped_hop_share) * (d_ - 1) * l.alpha;
  }
  double elementwise(double elems) const {
    return elems * cm_.elementwise_bytes / cm_.hbm_bytes_per_s;
  }
  double elems(const std::vector<int>& bucket) const {
    double e = 0;
    for (int j : bucket) e += static_cast<double>(mats_[static_cast<size_t>(j)].elems);
    return e;
  }

  const std::vector<SimTensor>& tensors_;
  std::vector<SimMatrix> mats_;
  int d_, per_node_;
  const CommModel& cm_;
  const CostTable& costs_;
  double wire_, issue_, share_, wait_share_;
  std::vector<std::vector<int>> buckets_;
};

}  // namespace

void play_step(const std::vector<SimTensor>& tensors, std::vector<SimMatrix> mats, int world,
               int per_node, const CommModel& cm, const CostTable& costs, SimPoint& sp) {
  const StepModel model(tensors, std::move(mats), world, per_node, cm, costs);
  sp.buckets = model.buckets();
  model.fsdp(sp);
  model.gather(sp);
  model.sharded(sp);
  model.dedicated(sp);
  model.adamw(sp);
}

}  // namespace distmuon::sim_detail
