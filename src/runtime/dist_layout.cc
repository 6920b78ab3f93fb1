// Layout of a distributed engine: one DistMatrix per Muon matrix with its owner and the rows each
// shard position holds, buckets in registration order, and the state each rank keeps.
#include <algorithm>
#include <tuple>

#include "distmuon/error.h"
#include "runtime/engine_impl.h"

namespace distmuon {

void Engine::Impl::build_matrices(const ShardLookup& shard_of) {
  dist.mats.clear();
  record.adam_params.clear();
  for (size_t i = 0; i < registry.params.size(); ++i) {
    Param& p = registry.params[i];
    if (registry.groups[p.spec.group].kind != ParamKind::kMuon) {
      p.adam_index = static_cast<int>(record.adam_params.size());
      record.adam_params.push_back(static_cast<int>(i));
      continue;
    }
    for (int64_t s = 0; s < p.layout.count; ++s) {
      DistMatrix m;
      m.param = static_cast<int>(i);
      m.slice = s;
      m.rows = p.layout.rows;
      m.cols = p.layout.cols;
      m.group = p.spec.group;
      m.dtype = p.spec.dtype;
      // A narrower wire where asked, never a wider one.
      const std::optional<DType> w = dist.options.wire_dtype;
      m.wire = w && dtype_size(*w) < dtype_size(m.dtype) ? *w : m.dtype;
      const int j = static_cast<int>(dist.mats.size());
      m.owner = dist.plan.owner.at(j);
      DM_CHECK(m.owner >= 0 && m.owner < dist.world_size, "the plan gives matrix '", p.spec.name,
               "' to rank ", m.owner, " of a world of ", dist.world_size);
      m.owner_r = dist.hsdp.replica_of(m.owner);
      m.owner_s = dist.hsdp.position_of(m.owner);
      // A dim-0 shard is a contiguous range of the flattened parameter whose ends fall on row
      // boundaries of every matrix (dim-0 rows hold whole matrix rows: 2D and conv kernels, or
      // whole matrices: 3D), so its intersection with a matrix is a range of rows.
      m.lo.assign(dist.shard_size, 0);
      m.hi.assign(dist.shard_size, 0);
      const int64_t first = s * m.rows * m.cols, last = first + m.rows * m.cols;
      for (int q = 0; q < dist.shard_size; ++q) {
        auto [b, n] = shard_of ? shard_of(q, i) : std::pair<int64_t, int64_t>(0, p.dim0);
        const int64_t start = std::max(b * p.inner, first);
        const int64_t end = std::min((b + n) * p.inner, last);
        if (end <= start) continue;
        m.lo[q] = (start - first) / m.cols;
        m.hi[q] = (end - first) / m.cols;
      }
      p.matrices.push_back(j);
      dist.mats.push_back(std::move(m));
    }
  }

  // The plan's batches: each matrix in exactly one batch of its owner.
  std::vector<int> seen(dist.mats.size(), 0);
  for (size_t o = 0; o < dist.plan.batches.size(); ++o)
    for (size_t k = 0; k < dist.plan.batches[o].size(); ++k)
      for (int j : dist.plan.batches[o][k]) {
        DM_CHECK(j >= 0 && j < static_cast<int>(dist.mats.size()) &&
                     dist.mats[j].owner == static_cast<int>(o),
                 "the plan batches matrix ", j, " on rank ", o, " which does not own it");
        dist.mats[j].batch = static_cast<int>(k);
        seen[j] += 1;
      }
  for (size_t j = 0; j < dist.mats.size(); ++j)
    DM_CHECK(seen[j] == 1, "the plan puts matrix '", matrix_name(static_cast<int>(j)), "' in ",
             seen[j], " batches instead of one");

  // Buckets of consecutive matrices (registration order follows the layers) of one wire dtype,
  // each holding about bucket_bytes of full matrices. Buckets exist to overlap one bucket's
  // transfers with another's compute; they also cut the owner's batches at their borders. With
  // caller transfers, or in a world of one rank, the engine moves nothing, so everything is one
  // bucket and each shape class an owner holds is one batch, as in a single process (with 32 MiB
  // buckets, batches of one or two matrices, the H200 measured the dedicated step at 3.6x the
  // plain one at one rank, and gpt2-large's gather / sharded steps at 2.5x).
  dist.buckets.clear();
  const bool nothing_moves = caller_transfers() || dist.world_size == 1;
  const int64_t bucket_bytes = nothing_moves ? 0 : dist.options.bucket_bytes;
  int64_t bytes = 0;
  for (size_t j = 0; j < dist.mats.size(); ++j) {
    DistMatrix& m = dist.mats[j];
    const int64_t mb = m.numel() * static_cast<int64_t>(dtype_size(m.wire));
    const bool split =
        !dist.buckets.empty() && ((bucket_bytes > 0 && bytes + mb > bucket_bytes) ||
                                  dist.mats[dist.buckets.back().mats[0]].wire != m.wire);
    if (dist.buckets.empty() || split) {
      dist.buckets.emplace_back();
      bytes = 0;
    }
    dist.buckets.back().mats.push_back(static_cast<int>(j));
    m.bucket = static_cast<int>(dist.buckets.size()) - 1;
    bytes += mb;
  }
  // Runs of one owner, plan batch, group and wide shape m x n (gather: group and shape) are
  // contiguous after sorting, so each is one batched launch and one status range; inside a run
  // the wide matrices precede the tall ones, so each orientation is one slice of the batch.
  const bool by_owner = dist.options.mode != DistMode::kGather;
  int64_t offset = 0;
  for (Bucket& b : dist.buckets) {
    auto key = [&](int j) {
      const DistMatrix& a = dist.mats[j];
      return std::make_tuple(by_owner ? a.owner : 0, by_owner ? a.batch : 0, a.group, a.m(), a.n(),
                             a.tall(), j);
    };
    std::sort(b.mats.begin(), b.mats.end(), [&](int x, int y) { return key(x) < key(y); });
    b.status_offset = offset;
    offset += static_cast<int64_t>(b.mats.size());
  }
  record.n_status = offset + static_cast<int64_t>(record.adam_params.size());
}

void Engine::Impl::allocate_state() {
  stats.owned_matrices = 0;
  for (DistMatrix& m : dist.mats) {
    if (dist.options.mode == DistMode::kGather) {
      stats.owned_matrices += 1;
    } else if (m.owner == dist.rank) {
      const DType t = registry.params[m.param].state0_dtype;
      m.momentum = backend.alloc(static_cast<size_t>(m.numel()) * dtype_size(t));
      backend.fill_zero(m.momentum.data(), m.momentum.bytes());
      stats.owned_matrices += 1;
    }
  }
  for (Param& p : registry.params) {
    const bool muon = registry.groups[p.spec.group].kind == ParamKind::kMuon;
    if (muon && dist.options.mode != DistMode::kGather) continue;  // momentum lives with the owner
    const size_t n = static_cast<size_t>(std::max<int64_t>(p.local_numel, 1));
    p.state0 = backend.alloc(n * dtype_size(muon ? p.state0_dtype : DType::kF32));
    backend.fill_zero(p.state0.data(), p.state0.bytes());
    if (!muon) {
      p.state1 = backend.alloc(n * sizeof(float));
      backend.fill_zero(p.state1.data(), p.state1.bytes());
    }
  }
  record.allocate(backend, registry, static_cast<int64_t>(dist.mats.size()), stats.muon_matrices);
}

CommStats DistState::comm_stats() const {
  CommStats s;
  if (world) s += world->stats();
  s += groups.split_stats();
  return s;
}

}  // namespace distmuon
