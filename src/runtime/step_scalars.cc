// The step's hyperparameters in backend memory (runtime/step_state.h), and filling them from the
// groups' current options.
#include "distmuon/error.h"
#include "runtime/engine_impl.h"

namespace distmuon {

void StepScalars::allocate(Backend& backend, int64_t groups, int64_t matrices,
                           int64_t adam_params) {
  coef_at = static_cast<size_t>(adam_params) * sizeof(AdamCoef);
  mu_at = coef_at + static_cast<size_t>(matrices) * sizeof(MuonUpdateCoef);
  const size_t bytes = mu_at + static_cast<size_t>(groups) * sizeof(float);
  host.assign(bytes, 0);
  device = backend.alloc(std::max<size_t>(bytes, 16));
}

void Engine::Impl::allocate_scalars() {
  record.scalars.allocate(backend, static_cast<int64_t>(registry.groups.size()),
                          dist.world ? static_cast<int64_t>(dist.mats.size()) : stats.muon_matrices,
                          static_cast<int64_t>(record.adam_params.size()));
}

void Engine::Impl::upload_scalars() {
  for (size_t g = 0; g < registry.groups.size(); ++g)
    record.scalars.set_mu(static_cast<int>(g), registry.groups[g].kind == ParamKind::kMuon
                                                   ? registry.groups[g].muon.momentum
                                                   : 0.0f);
  if (dist.world) {
    for (size_t j = 0; j < dist.mats.size(); ++j)
      record.scalars.set_coef(static_cast<int64_t>(j),
                              muon_update_coef(registry.groups[dist.mats[j].group].muon,
                                               dist.mats[j].rows, dist.mats[j].cols));
  } else {
    for (const Param& p : registry.params)
      if (registry.groups[p.spec.group].kind == ParamKind::kMuon)
        for (int64_t s = 0; s < p.layout.count; ++s)
          record.scalars.set_coef(
              p.first_matrix + s,
              muon_update_coef(registry.groups[p.spec.group].muon, p.layout.rows, p.layout.cols));
  }
  for (size_t k = 0; k < record.adam_params.size(); ++k) {
    const Param& p = registry.params[record.adam_params[k]];
    const AdamWOptions& a = registry.groups[p.spec.group].adamw;
    record.scalars.set_adam(static_cast<int64_t>(k),
                            {a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, p.step + 1});
  }
  record.scalars.upload(backend);
}

}  // namespace distmuon
