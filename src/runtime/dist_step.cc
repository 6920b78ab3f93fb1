// The distributed step: ranks agree on which parameters step, buckets go through the mode's
// stages software-pipelined (the next bucket's communication overlaps the current bucket's
// compute), and AdamW parameters are updated beside them.
#include <algorithm>
#include <chrono>
#include <charconv>
#include <map>
#include <tuple>
#include <sstream>

#include "common/fnv.h"
#include "common/log.h"
#include "distmuon/error.h"
#include "runtime/engine_impl.h"
#include "runtime/mode_runner.h"

namespace distmuon {
namespace {

std::string rank_list(const std::vector<int>& r) {
  std::ostringstream os;
  for (size_t i = 0; i < r.size(); ++i) os << (i ? ", " : "") << r[i];
  return os.str();
}

// The shortest text that reads back as exactly `v` (0.95f prints as 0.95).
template <typename T>
std::string exact(T v) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

// The options a step reads, per group, written exactly (exact()), one line per group. Ranks
// must agree on them at every step: each matrix is updated by its owner with the owner's
// options, so a learning-rate scheduler
// stepped on some ranks only would otherwise mix learning rates silently. The registration-time
// options (algorithm, momentum dtype) are checked at set-up (dist_setup.cc); statistics and
// diagnostics (per-matrix cache stats, shadow solves) may differ.
std::string step_options_text(const std::vector<GroupOptions>& groups) {
  std::ostringstream os;
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupOptions& o = groups[g];
    os << "group " << g;
    if (o.kind == ParamKind::kAdamW) {
      const AdamWOptions& a = o.adamw;
      os << " adamw lr " << exact(a.lr) << " betas " << exact(a.beta1) << " " << exact(a.beta2)
         << " eps " << exact(a.eps) << " weight_decay " << exact(a.weight_decay) << "\n";
      continue;
    }
    const MuonOptions& m = o.muon;
    const OrthoConfig& c = m.ortho;
    os << " muon lr " << exact(m.lr) << " momentum " << exact(m.momentum) << " nesterov "
       << m.nesterov << " weight_decay " << exact(m.weight_decay) << " scale "
       << scale_mode_name(m.scale) << " " << algorithm_name(c) << " restarts";
    for (int r : c.restarts) os << " " << r;
    os << " work " << dtype_name(c.work_dtype) << " gram_work "
       << (c.gram_work_dtype ? dtype_name(*c.gram_work_dtype) : "unset") << " eps " << exact(c.eps);
    for (const QuinticCoef& q : c.custom_coefficients)
      os << " (" << exact(q.a) << " " << exact(q.b) << " " << exact(q.c) << ")";
    const CacheOptions& k = m.cache;
    if (k.enabled)
      os << " cache gamma " << exact(k.gamma) << " " << cache_residual_name(k.residual)
         << " probes " << k.probes << " staleness " << k.max_staleness << " backoff "
         << k.check_backoff << " dtype " << (k.dtype ? dtype_name(*k.dtype) : "work") << " "
         << cache_layout_name(k.layout) << " seed " << k.seed << " gate "
         << cache_gate_name(k.gate);
    os << "\n";
  }
  return os.str();
}

}  // namespace

// A parameter steps on every rank or on none. Sharded modes: ranks whose shard is empty do not
// vote. Dedicated mode: a rank without a gradient contributes zeros (as DDP treats unused
// parameters); other modes hold reduced gradients, so a partial set is an error. The vote also
// carries whether a rank's inputs failed their checks, so that every rank raises that error,
// and a digest of the step's options (step_options_text), so that ranks whose options differ
// all raise before anything changes. One all-reduce (max) of 2n + 5 values decides it all: for
// the digest, max(d) and max(-d) = -min(d) differ exactly when some rank's digest does.
void Engine::Impl::vote(StepContext& ctx) {
  const size_t n = registry.params.size();
  const bool sharded = is_sharded_mode(dist.options.mode);
  std::string input_error;
  try {
    check_inputs(ctx.data);
  } catch (const Error& e) {
    if (!dist.options.check_grad_presence) throw;  // no vote to carry it
    input_error = e.what();
    if (input_error.rfind("distmuon: ", 0) == 0) input_error.erase(0, 10);
  }
  ctx.active.assign(n, 0);
  ctx.has_local.assign(n, 0);
  std::vector<int32_t> v(2 * n + 5);
  for (size_t i = 0; i < n; ++i) {
    const bool has = input_error.empty() && ctx.data[i].grad != nullptr;
    const bool voter = !sharded || registry.params[i].local_numel > 0;
    ctx.has_local[i] = has;
    v[2 * i] = has && voter;       // max: some voter has a gradient
    v[2 * i + 1] = voter && !has;  // max: some voter has none
    ctx.active[i] = has || !voter;
  }
  // One rank agrees with itself: no exchange (its input errors are raised as they are).
  if (!dist.options.check_grad_presence || dist.world_size == 1) {
    if (!input_error.empty()) DM_FAIL(input_error);
    return;
  }
  const std::string options_text = step_options_text(registry.groups);
  const uint64_t digest = fnv1a(options_text);
  const int32_t d_hi = static_cast<int32_t>(digest >> 33);
  const int32_t d_lo = static_cast<int32_t>(digest & 0x7fffffff);
  v[2 * n] = input_error.empty() ? 0 : 1;
  v[2 * n + 1] = d_hi;
  v[2 * n + 2] = -d_hi;
  v[2 * n + 3] = d_lo;
  v[2 * n + 4] = -d_lo;
  host_all_reduce(*dist.world, backend, v, ReduceOp::kMax);
  if (v[2 * n] > 0) {
    const std::vector<int64_t> len =
        host_all_gather(*dist.world, backend, {static_cast<int64_t>(input_error.size())});
    const std::vector<char> all = host_all_gather_v(*dist.world, backend, input_error, len);
    std::ostringstream os;
    os << "step inputs failed their checks on "
       << std::count_if(len.begin(), len.end(), [](int64_t l) { return l > 0; })
       << " rank(s); nothing was changed:";
    int64_t off = 0;
    for (int q = 0; q < dist.world_size; ++q) {
      if (len[q]) os << "\n  rank " << q << ": " << std::string(&all[off], len[q]);
      off += len[q];
    }
    DM_FAIL(os.str());
  }
  if (v[2 * n + 1] != -v[2 * n + 2] || v[2 * n + 3] != -v[2 * n + 4]) {
    const std::vector<int64_t> len =
        host_all_gather(*dist.world, backend, {static_cast<int64_t>(options_text.size())});
    DM_FAIL(
        "ranks step with different options (each matrix would take its owner's: set them, and "
        "step any learning-rate scheduler, on every rank alike); nothing was changed:",
        text_differences(*dist.world, backend, options_text, len));
  }
  std::vector<size_t> bad;
  for (size_t i = 0; i < n; ++i) {
    const bool some_have = v[2 * i] > 0, all_have = v[2 * i + 1] == 0;
    ctx.active[i] = some_have && (dist.options.mode == DistMode::kDedicated || all_have);
    if (some_have && !ctx.active[i]) bad.push_back(i);
  }
  if (bad.empty()) return;
  std::vector<int64_t> mine(n);
  for (size_t i = 0; i < n; ++i)  // 1: has one, 0: has none, 2: empty shard (no vote)
    mine[i] = sharded && registry.params[i].local_numel == 0 ? 2 : (ctx.has_local[i] ? 1 : 0);
  const std::vector<int64_t> all = host_all_gather(*dist.world, backend, mine);
  std::ostringstream os;
  os << "ranks disagree on which parameters have a gradient in this step ("
     << dist_mode_name(dist.options.mode)
     << " mode expects reduced gradients: pass each one on every rank or on none):";
  for (size_t i : bad) {
    std::vector<int> with, without;
    for (int q = 0; q < dist.world_size; ++q) {
      const int64_t f = all[static_cast<size_t>(q) * n + i];
      if (f == 1) with.push_back(q);
      if (f == 0) without.push_back(q);
    }
    os << "\n  parameter '" << registry.params[i].spec.name << "' has one on ranks "
       << rank_list(with) << " but not on ranks " << rank_list(without);
  }
  DM_FAIL(os.str());
}

void Engine::Impl::prepare_buckets(StepContext& ctx) {
  const bool by_owner = dist.options.mode != DistMode::kGather;
  for (Bucket& b : dist.buckets) {
    b.act.clear();
    b.runs.clear();
    for (int j : b.mats)  // prepared matrices only take their update (apply_prepared)
      if (ctx.active[dist.mats[j].param] &&
          (prepared.is_prepared.empty() || !prepared.is_prepared[j]))
        b.act.push_back(j);
    for (int k = 0; k < static_cast<int>(b.act.size()); ++k) {
      const DistMatrix& m = dist.mats[b.act[k]];
      bool same = false;
      if (k > 0) {
        const DistMatrix& p = dist.mats[b.act[k - 1]];
        same = (!by_owner || (p.owner == m.owner && p.batch == m.batch)) && p.group == m.group &&
               p.m() == m.m() && p.n() == m.n();
      }
      if (same)
        b.runs.back().end = k + 1;
      else
        b.runs.push_back({k, k + 1, 0});
    }
    // The sort put the wide matrices of a run first: the first tall one starts the tall part.
    for (Bucket::Run& run : b.runs) {
      run.tall_begin = run.begin;
      while (run.tall_begin < run.end && !dist.mats[b.act[run.tall_begin]].tall()) ++run.tall_begin;
    }
  }
  build_owner_batches();
  upload_scalars();
  ctx.coef = record.scalars.coef();
}

// The owner batches of this step (owner modes): the runs of one owner, plan batch, group and wide
// shape gathered across buckets (with batches_across_buckets; else every run is a batch of its
// own), and for each bucket the batches its compute stage completes and the bucket whose compute
// stage completes its updates (Bucket::ready). Every rank computes the same from the same runs,
// so every rank issues the stages, and their collectives, in the same order.
void Engine::Impl::build_owner_batches() {
  dist.owner_batches.clear();
  for (size_t b = 0; b < dist.buckets.size(); ++b) {
    dist.buckets[b].completes.clear();
    dist.buckets[b].ready_buckets.clear();
    dist.buckets[b].ready = static_cast<int>(b);
  }
  auto finish = [&] {
    for (size_t b = 0; b < dist.buckets.size(); ++b)
      dist.buckets[dist.buckets[b].ready].ready_buckets.push_back(static_cast<int>(b));
  };
  if (dist.options.mode == DistMode::kGather) {  // every rank computes every bucket's runs
    finish();
    return;
  }
  // Pieces of each batch: (bucket, run), in bucket order.
  std::vector<std::vector<std::pair<int, int>>> pieces;
  std::map<std::tuple<int, int, int, int64_t, int64_t>, size_t> index;
  for (size_t b = 0; b < dist.buckets.size(); ++b) {
    const Bucket& bk = dist.buckets[b];
    for (size_t r = 0; r < bk.runs.size(); ++r) {
      const DistMatrix& m = dist.mats[bk.act[bk.runs[r].begin]];
      const auto key = std::make_tuple(m.owner, m.batch, m.group, m.m(), m.n());
      auto it = index.find(key);
      if (it == index.end() || !dist.options.batches_across_buckets) {
        pieces.emplace_back();
        it = index.insert_or_assign(key, pieces.size() - 1).first;
      }
      pieces[it->second].emplace_back(static_cast<int>(b), static_cast<int>(r));
    }
  }
  int64_t scratch = 0;
  for (const auto& ps : pieces) {
    OwnerBatch ob;
    ob.last = ps.back().first;
    // Wide members of every piece first, then the tall ones: each orientation one slice.
    for (int part = 0; part < 2; ++part) {
      for (auto [b, r] : ps) {
        const Bucket& bk = dist.buckets[b];
        const Bucket::Run& run = bk.runs[r];
        for (int k = part ? run.tall_begin : run.begin; k < (part ? run.end : run.tall_begin); ++k) {
          ob.mats.push_back(bk.act[k]);
          ob.status.push_back(bk.status_offset + k);
        }
      }
      if (part == 0) ob.tall_begin = static_cast<int64_t>(ob.mats.size());
    }
    ob.owner = dist.mats[ob.mats[0]].owner;
    ob.scratch = scratch;
    scratch += static_cast<int64_t>(ob.mats.size());
    for (auto [b, r] : ps) dist.buckets[b].ready = std::max(dist.buckets[b].ready, ob.last);
    dist.buckets[ob.last].completes.push_back(static_cast<int>(dist.owner_batches.size()));
    dist.owner_batches.push_back(std::move(ob));
  }
  finish();
}

// Stages order each other's collectives on the device (wait_on_stream makes the communicator's
// caller stream wait), so the communicators must follow the very stream the backend issues on:
// on another, kernels would read receive buffers before the collectives land, and collectives
// would read send buffers before the kernels that fill them. The caller may move the backend to
// another stream between calls (torch's current stream, a side stream), so every entry point
// that issues work binds them again.
void DistState::bind_streams(void* stream) {
  for (Communicator* c : {world, shard, replica})
    if (c) c->bind_stream(stream);
}

void DistState::wait_unchecked() {
  try {
    wait_all(unchecked);
  } catch (...) {
    unchecked.clear();  // abandoned (a timed-out NCCL communicator is aborted): raised once
    throw;
  }
}

void Engine::Impl::dist_step(std::span<const ParamData> data) {
  DM_LOG(kDebug, "step ", stats.steps, " begins");
  dist.bind_streams(backend.native_stream());
  if (pipeline.publish_pending) finish_publish();
  dist.wait_unchecked();  // left by a step that raised
  const CommStats before = dist.comm_stats();
  auto ctx = std::make_unique<StepContext>();
  ctx->data.assign(data.begin(), data.end());
  ctx->raise = options.nonfinite == NonFinitePolicy::kRaise;
  vote(*ctx);  // waits for the slowest rank: not issue time
  const auto t0 = std::chrono::steady_clock::now();
  prepare_buckets(*ctx);
  backend.fill_zero(record.step_status.data(),
                    static_cast<size_t>(record.n_status) * sizeof(int32_t));
  adam.begin(*ctx);
  if (!prepared.batches.empty()) apply_prepared(*ctx);

  // Three phases. (1) The stages before the compute stage (gradients on their way to the
  // owners) for every bucket first: they depend on no rank's compute, so all inbound traffic is
  // queued back to back and an owner's compute never waits behind another bucket's outbound
  // transfer, which needs the slowest owner of that bucket. (2) The compute stage and the stages
  // after it, software-pipelined: slot t computes bucket t (pass 1 of its runs, and the owner
  // batches whose last bucket it is) and moves on the results of the buckets that the compute of
  // bucket t-1 completed, so outbound transfers overlap the next bucket's compute. (3) The last stage, when it only waits
  // for the outbound transfers, for every bucket at the end: the host blocks on a bucket's
  // slowest owner only once everything is issued, so owners run their whole load back to back
  // (the planner balances the totals, not each bucket).
  const int stages = pipeline.runner->num_stages(), compute = pipeline.runner->compute_stage();
  const int n = static_cast<int>(dist.buckets.size());
  for (int s = 0; s < compute; ++s)
    for (int b = 0; b < n; ++b) pipeline.runner->run_stage(s, b, *ctx);
  if (ctx->raise) {
    for (int b = 0; b < n; ++b) pipeline.runner->pass1(b, *ctx);
    adam.check(*ctx);
    dist.wait_unchecked();  // the transfers' deadlines before the statuses' device synchronisation
    std::vector<std::string> names(static_cast<size_t>(record.n_status) -
                                   record.adam_params.size());
    for (const Bucket& b : dist.buckets)
      for (size_t k = 0; k < b.act.size(); ++k) names[b.status_offset + k] = matrix_name(b.act[k]);
    record.raise_if_nonfinite(backend, registry, dist.world, names);
  }
  const int tail = stages - 1 > compute ? stages - 1 : stages;  // phase 3's stage, if any
  auto run_or_defer = [&](int s, int b, bool after_last_compute) {
    if (dist.options.defer_publish && after_last_compute && pipeline.runner->deferrable(s))
      pipeline.deferred.emplace_back(s, b);
    else
      pipeline.runner->run_stage(s, b, *ctx);
  };
  // The stages after the compute stage follow, for bucket b, the compute stage of bucket
  // b.ready -- the one that completes b's updates, b itself unless an owner batch with a member in
  // b ends in a later bucket (build_owner_batches) -- by one slot per stage.
  const int span = tail - compute;
  for (int t = 0; t < n + span - 1; ++t)
    for (int s = compute; s < tail; ++s) {
      const int r = t - (s - compute);
      if (r < 0 || r >= n) continue;
      if (s == compute)
        run_or_defer(s, r, false);
      else
        for (int b : dist.buckets[r].ready_buckets) run_or_defer(s, b, t > n - 1);
    }
  if (tail < stages)
    for (int b = 0; b < n; ++b) run_or_defer(tail, b, true);
  if (!ctx->raise) adam.check(*ctx);
  adam.update();
  // Everything is issued: now the host checks that the collectives ordered on the device
  // complete (with their deadlines).
  stats.issue_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  DM_LOG(kDebug, "step issued; waiting for ", dist.unchecked.size(), " collectives");
  dist.wait_unchecked();
  for (size_t i = 0; i < registry.params.size(); ++i)
    if (ctx->active[i]) registry.params[i].step += 1;
  stats.steps += 1;
  if (!pipeline.deferred.empty()) {
    pipeline.pending_ctx = std::move(ctx);
    pipeline.publish_pending = true;
  }
  stats.comm += dist.comm_stats() - before;
}

void Engine::Impl::finish_publish() {
  dist.bind_streams(backend.native_stream());
  const CommStats before = dist.comm_stats();
  std::vector<std::pair<int, int>> items;
  items.swap(pipeline.deferred);
  pipeline.publish_pending = false;
  std::unique_ptr<StepContext> ctx = std::move(pipeline.pending_ctx);
  for (auto [s, b] : items) pipeline.runner->run_stage(s, b, *ctx);
  dist.wait_unchecked();
  stats.comm += dist.comm_stats() - before;
}

}  // namespace distmuon
