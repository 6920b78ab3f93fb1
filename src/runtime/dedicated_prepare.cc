// Dedicated mode with caller transfers: the owner's work on a matrix starts as soon as the
// caller has its final gradient (during backward), and step() only applies the update.
//
// prepare() runs momentum and orthogonalization for a set of owned matrices, batched by (plan
// batch, group, wide shape) exactly as step() batches them, into a per-rank arena that holds one
// slot per owned matrix (the orthogonalized update in the iteration dtype, its norm and status).
// The arena is handed out front to back during a step and reset by apply_prepared(), which
// step() calls before its own pipeline (that then skips the prepared matrices). The results
// equal step()'s bit for bit: the same kernels on the same batches.
#include <algorithm>
#include <tuple>

#include "distmuon/error.h"
#include "runtime/engine_impl.h"
#include "runtime/mode_runner.h"

namespace distmuon {
namespace {

char* at(const void* base, int64_t elems, DType t) {
  return const_cast<char*>(static_cast<const char*>(base)) +
         elems * static_cast<int64_t>(dtype_size(t));
}

int64_t full_offset(const DistMatrix& m) { return m.slice * m.rows * m.cols; }

}  // namespace

void Engine::Impl::prepare(std::span<const int> ps, std::span<const ParamData> data) {
  DM_CHECK(caller_transfers(),
           "prepare() needs the dedicated mode with DistOptions::caller_transfers");
  DM_CHECK(options.nonfinite != NonFinitePolicy::kRaise,
           "prepare() cannot honour nonfinite=raise: state would change before the statuses of "
           "the whole step are known (prepare nothing, or use the skip policy)");
  DM_CHECK(ps.size() == data.size(), "prepare() got ", ps.size(), " parameters and ", data.size(),
           " data entries");
  if (prepared.is_prepared.empty()) prepared.is_prepared.assign(dist.mats.size(), 0);
  upload_scalars();  // the momentum passes below read mu from it

  // The owned matrices among `ps`, in step()'s batching order.
  std::vector<std::pair<int, const ParamData*>> sel;
  for (size_t k = 0; k < ps.size(); ++k) {
    const int i = ps[k];
    DM_CHECK(i >= 0 && i < static_cast<int>(registry.params.size()), "prepare(): no parameter ", i);
    const Param& p = registry.params[i];
    DM_CHECK(registry.groups[p.spec.group].kind == ParamKind::kMuon, "prepare(): parameter '",
             p.spec.name, "' is not a Muon parameter");
    for (int j : p.matrices) {
      if (dist.mats[j].owner != dist.rank) continue;
      DM_CHECK(data[k].grad != nullptr && data[k].param != nullptr, "prepare(): parameter '",
               p.spec.name, "' needs its gradient and weights on its owner, rank ", dist.rank);
      DM_CHECK(!prepared.is_prepared[j], "prepare(): matrix '", matrix_name(j),
               "' was already prepared in this step (gradients must be final when prepared)");
      sel.emplace_back(j, &data[k]);
    }
  }
  if (sel.empty()) return;
  auto key = [&](int j) {
    const DistMatrix& a = dist.mats[j];
    return std::make_tuple(a.batch, a.group, a.m(), a.n(), a.tall(), j);
  };
  std::sort(sel.begin(), sel.end(), [&](auto& x, auto& y) { return key(x.first) < key(y.first); });

  // The arena: sized at the first prepare() of a step for every matrix this rank owns.
  PreparedUpdates& arena = prepared;
  if (arena.batches.empty()) {
    size_t bytes = 0;
    int64_t owned = 0;
    for (const DistMatrix& m : dist.mats) {
      if (m.owner != dist.rank) continue;
      const OrthoConfig r = tuning.resolve_shape(m.group, m.m(), m.n());
      bytes += static_cast<size_t>(m.numel()) * dtype_size(iteration_dtype(r));
      owned += 1;
    }
    if (bytes > arena.x.bytes()) arena.x = backend.alloc(bytes);
    if (!arena.status) {
      arena.norms = backend.alloc(sizeof(double) * std::max<int64_t>(owned, 1));
      arena.status = backend.alloc(sizeof(int32_t) * std::max<int64_t>(owned, 1));
    }
    arena.x_used = 0;
    arena.slots_used = 0;
  }

  for (size_t b0 = 0, b1; b0 < sel.size(); b0 = b1) {
    const DistMatrix& m0 = dist.mats[sel[b0].first];
    for (b1 = b0 + 1; b1 < sel.size(); ++b1) {
      const DistMatrix& m = dist.mats[sel[b1].first];
      if (m.batch != m0.batch || m.group != m0.group || m.m() != m0.m() || m.n() != m0.n()) break;
    }
    const int count = static_cast<int>(b1 - b0);
    const OrthoConfig r = tuning.resolve_shape(m0.group, m0.m(), m0.n());
    PreparedUpdates::Batch pb;
    pb.x_dtype = iteration_dtype(r);
    pb.tall_begin = count;
    std::vector<MuonSlot> slots;
    for (int k = 0; k < count; ++k) {
      const int j = sel[b0 + k].first;
      const DistMatrix& m = dist.mats[j];
      const ParamData& d = *sel[b0 + k].second;
      if (m.tall() && pb.tall_begin == count) pb.tall_begin = k;
      pb.mats.push_back(j);
      slots.push_back(
          {MatRef::of(at(d.grad, full_offset(m), d.grad_dtype), d.grad_dtype, m.rows, m.cols),
           MatRef::of(m.momentum.data(), registry.params[m.param].state0_dtype, m.rows, m.cols),
           MatRef::of(at(d.param, full_offset(m), m.dtype), m.dtype, m.rows, m.cols),
           record.skips_of(registry.params[m.param], m.slice)});
    }
    const size_t x_bytes = static_cast<size_t>(count * m0.m() * m0.n()) * dtype_size(pb.x_dtype);
    DM_CHECK(arena.x_used + x_bytes <= arena.x.bytes() &&
                 arena.slots_used + count <= static_cast<int64_t>(arena.status.bytes() / 4),
             "internal: prepare arena exhausted");
    pb.x_offset = arena.x_used;
    pb.slot = arena.slots_used;
    arena.x_used += x_bytes;
    arena.slots_used += count;

    const MuonBatch batch{backend,
                          registry.groups[m0.group].muon,
                          record.scalars.mu(m0.group),
                          r,
                          count,
                          pb.tall_begin,
                          slots,
                          arena.norms.as<double>() + pb.slot,
                          arena.status.as<int32_t>() + pb.slot};
    // Pass 1, pass 2 and the orthogonalization as step() runs them; step() applies the update
    // (apply_prepared).
    std::vector<int64_t> entries;
    BatchSequence seq;
    seq.resources = [&](size_t, BatchRef* x, BatchOrtho* how) {
      for (int j : pb.mats) entries.push_back(dist.mats[j].cache_entry);
      // The iteration buffer is the arena's slot: the shared scratch holds only the workspace.
      *how = resources.prepare_batch(r, m0.cache, entries, count, m0.m(), m0.n(), nullptr);
      *x = BatchRef::packed(arena.x.as<char>() + pb.x_offset, pb.x_dtype, count, m0.m(), m0.n());
    };
    seq.output = BatchSequence::Output::kNone;
    seq.skip_counter = record.skip_counter.as<int64_t>();
    run_batches(backend, {&batch, 1}, seq);
    for (int j : pb.mats) arena.is_prepared[j] = 1;
    arena.batches.push_back(std::move(pb));
  }
}

void Engine::Impl::apply_prepared(const StepContext& ctx) {
  for (const PreparedUpdates::Batch& pb : prepared.batches) {
    const DistMatrix& m0 = dist.mats[pb.mats[0]];
    const int count = static_cast<int>(pb.mats.size());
    std::vector<MuonSlot> slots;
    for (int j : pb.mats) {
      const DistMatrix& m = dist.mats[j];
      const void* w = ctx.data[m.param].param;
      DM_CHECK(w != nullptr, "step(): prepared matrix '", matrix_name(j), "' has no weights");
      MatRef ref = MatRef::of(at(w, full_offset(m), m.dtype), m.dtype, m.rows, m.cols);
      slots.push_back({ref, ref, ref, nullptr, ctx.coef + j});  // the update reads only W
    }
    const MuonBatch batch{backend,
                          registry.groups[m0.group].muon,
                          record.scalars.mu(m0.group),
                          {},
                          count,
                          pb.tall_begin,
                          slots,
                          nullptr,
                          prepared.status.as<int32_t>() + pb.slot};
    batch.update(BatchRef::packed(prepared.x.as<char>() + pb.x_offset, pb.x_dtype, count,
                                         m0.m(), m0.n()));
  }
  prepared.reset();
}

void PreparedUpdates::reset() {
  batches.clear();
  std::fill(is_prepared.begin(), is_prepared.end(), 0);
  x_used = 0;
  slots_used = 0;
}

void Engine::prepare(std::span<const int> params, std::span<const ParamData> data) {
  if (!impl_->built) setup();
  impl_->prepare(params, data);
}

void Engine::discard_prepared() { impl_->prepared.reset(); }

int64_t Engine::prepared_matrices() const {
  int64_t n = 0;
  for (char p : impl_->prepared.is_prepared) n += p;
  return n;
}

}  // namespace distmuon
