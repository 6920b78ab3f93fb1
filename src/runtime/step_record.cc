// What the StepRecord (runtime/step_state.h) does with what it owns: its buffers, the step's
// hyperparameters filled from the groups' current options, the skip counts per parameter and
// the raise policy's check of the statuses.
#include <algorithm>
#include <sstream>

#include "common/log.h"
#include "distmuon/error.h"
#include "runtime/dist_exchange.h"
#include "runtime/muon_batch.h"
#include "runtime/step_state.h"

namespace distmuon {

void StepScalars::allocate(Backend& backend, int64_t groups, int64_t matrices,
                           int64_t adam_params) {
  coef_at = static_cast<size_t>(adam_params) * sizeof(AdamCoef);
  mu_at = coef_at + static_cast<size_t>(matrices) * sizeof(MuonUpdateCoef);
  const size_t bytes = mu_at + static_cast<size_t>(groups) * sizeof(float);
  host.assign(bytes, 0);
  device = backend.alloc(std::max<size_t>(bytes, 16));
}

void StepRecord::allocate(Backend& backend, const Registry& registry, int64_t matrices,
                          int64_t muon_matrices) {
  const size_t entries = static_cast<size_t>(std::max<int64_t>(n_status, 1));
  step_status = backend.alloc(entries * sizeof(int32_t));
  step_norms = backend.alloc(entries * sizeof(double));
  scalars.allocate(backend, static_cast<int64_t>(registry.groups.size()), matrices,
                   static_cast<int64_t>(adam_params.size()));
  step_counts = backend.alloc(sizeof(int64_t) * std::max<size_t>(1, registry.params.size()));
  std::vector<int64_t> h(registry.params.size());
  for (size_t i = 0; i < registry.params.size(); ++i) h[i] = registry.params[i].step;
  backend.copy_from_host(step_counts.data(), h.data(), h.size() * sizeof(int64_t));
  matrix_skips = backend.alloc(sizeof(int64_t) * std::max<int64_t>(1, muon_matrices));
  backend.fill_zero(matrix_skips.data(), matrix_skips.bytes());
}

void StepRecord::upload_scalars(Backend& backend, const Registry& registry, const DistState& dist) {
  for (size_t g = 0; g < registry.groups.size(); ++g)
    scalars.set_mu(static_cast<int>(g), registry.groups[g].kind == ParamKind::kMuon
                                            ? registry.groups[g].muon.momentum
                                            : 0.0f);
  if (dist.world) {
    for (size_t j = 0; j < dist.mats.size(); ++j)
      scalars.set_coef(static_cast<int64_t>(j),
                       muon_update_coef(registry.groups[dist.mats[j].group].muon, dist.mats[j].rows,
                                        dist.mats[j].cols));
  } else {
    for (const Param& p : registry.params)
      if (registry.groups[p.spec.group].kind == ParamKind::kMuon)
        for (int64_t s = 0; s < p.layout.count; ++s)
          scalars.set_coef(p.first_matrix + s, muon_update_coef(registry.groups[p.spec.group].muon,
                                                                p.layout.rows, p.layout.cols));
  }
  for (size_t k = 0; k < adam_params.size(); ++k) {
    const Param& p = registry.params[adam_params[k]];
    const AdamWOptions& a = registry.groups[p.spec.group].adamw;
    scalars.set_adam(static_cast<int64_t>(k),
                     {a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, p.step + 1});
  }
  scalars.upload(backend);
}

std::vector<int64_t> StepRecord::skips_per_param(Backend& backend, const Registry& registry,
                                                 int64_t muon_matrices) const {
  std::vector<int64_t> per_param(registry.params.size(), 0);
  if (!matrix_skips) return per_param;
  std::vector<int64_t> m(static_cast<size_t>(muon_matrices));
  backend.synchronize();
  backend.copy_to_host(m.data(), matrix_skips.data(), m.size() * sizeof(int64_t));
  for (size_t i = 0; i < registry.params.size(); ++i) {
    const Param& p = registry.params[i];
    if (registry.groups[p.spec.group].kind != ParamKind::kMuon) continue;
    for (int64_t s = 0; s < p.layout.count; ++s)
      per_param[i] = std::max(per_param[i], m[p.first_matrix + s]);
  }
  return per_param;
}

// Every rank sees every status before anything changes, so all raise together.
void StepRecord::raise_if_nonfinite(Backend& backend, const Registry& registry, Communicator* world,
                                    const std::vector<std::string>& muon_names) const {
  DM_LOG(kDebug, "the host waits for the device (step statuses)");
  backend.synchronize();
  DM_LOG(kDebug, "the device reached the step statuses");
  std::vector<int32_t> st(static_cast<size_t>(n_status));
  backend.copy_to_host(st.data(), step_status.data(), st.size() * sizeof(int32_t));
  if (world) host_all_reduce(*world, backend, st, ReduceOp::kMax);
  std::vector<std::string> bad;
  for (size_t k = 0; k < muon_names.size(); ++k)
    if (st[k] != kStatusOk && !muon_names[k].empty()) bad.push_back(muon_names[k]);
  const size_t first_adam = static_cast<size_t>(n_status) - adam_params.size();
  for (size_t k = 0; k < adam_params.size(); ++k)
    if (st[first_adam + k] != kStatusOk) bad.push_back(registry.params[adam_params[k]].spec.name);
  if (bad.empty()) return;
  std::ostringstream os;
  for (size_t i = 0; i < bad.size(); ++i) os << (i ? ", " : "") << "'" << bad[i] << "'";
  DM_FAIL("non-finite gradient (NaN or Inf), or a momentum beyond the range of its dtype, in ",
          os.str(), "; the step was not applied", world ? " on any rank" : "",
          " (weights and optimizer state unchanged)");
}

}  // namespace distmuon
