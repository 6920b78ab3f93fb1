// The dedicated runtime's units and buckets (distmuon/dedicated.h).
#include <map>
#include <tuple>

#include "distmuon/dedicated.h"
#include "distmuon/error.h"
#include "plan/runtime_plan.h"

namespace distmuon {

std::string dedicated_unit(const std::string& param_name) {
  const size_t dot = param_name.rfind('.');
  const std::string module = dot == std::string::npos ? "" : param_name.substr(0, dot);
  const std::string layer = layer_prefix(module);
  return layer.empty() ? module : layer;
}

DedicatedLayout dedicated_layout(const std::vector<DedicatedMatrix>& matrices,
                                 const std::vector<std::string>& modules, const HsdpWorld& world) {
  world.check("dedicated layout");
  std::map<std::string, size_t> forward_position;
  for (size_t k = 0; k < modules.size(); ++k) forward_position.emplace(modules[k], k);

  DedicatedLayout out;
  const int n = static_cast<int>(matrices.size());
  out.unit_of.assign(n, -1);
  out.bucket_of.assign(n, -1);
  out.offset.assign(n, 0);

  // Units in forward order; each keeps its matrices in the order given.
  std::map<size_t, std::vector<int>> by_position;
  for (int j = 0; j < n; ++j) {
    const DedicatedMatrix& m = matrices[j];
    DM_CHECK(m.owner >= 0 && m.owner < world.size, "dedicated layout: matrix '", m.name,
             "' has owner ", m.owner, " outside the world of ", world.size);
    const std::string unit = dedicated_unit(m.name);
    const auto it = forward_position.find(unit);
    DM_CHECK(it != forward_position.end(), "dedicated layout: the layer '", unit, "' of matrix '",
             m.name, "' is not a module of the model");
    by_position[it->second].push_back(j);
  }
  for (auto& [position, js] : by_position) {
    const int u = static_cast<int>(out.units.size());
    out.units.push_back({modules[position], js, {}});
    for (int j : js) out.unit_of[j] = u;
  }

  // Buckets: per unit, one per (owner, dtype), ordered by owner then dtype name.
  for (size_t u = 0; u < out.units.size(); ++u) {
    DedicatedLayout::Unit& unit = out.units[u];
    std::map<std::tuple<int, std::string>, std::vector<int>> keys;
    for (int j : unit.matrices)
      keys[{matrices[j].owner, dtype_name(matrices[j].dtype)}].push_back(j);
    for (auto& [key, js] : keys) {
      DedicatedLayout::Bucket b;
      b.unit = static_cast<int>(u);
      b.owner = std::get<0>(key);
      b.dtype = matrices[js[0]].dtype;
      b.matrices = js;
      // flat (shard == size): the owner alone
      b.kept = world.position_of(b.owner) == world.my_position();
      const int index = static_cast<int>(out.buckets.size());
      for (int j : js) {
        out.bucket_of[j] = index;
        out.offset[j] = b.numel;
        b.numel = checked_add(b.numel, matrices[j].numel, "dedicated bucket");
      }
      unit.buckets.push_back(index);
      out.buckets.push_back(std::move(b));
    }
  }
  return out;
}

}  // namespace distmuon
