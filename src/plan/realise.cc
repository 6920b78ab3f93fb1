// From per-owner counts to a concrete Plan: canonical owner order, node placement, the choice of
// concrete matrices (spreading layers), batches, loads and the hash.
#include <algorithm>
#include <map>
#include <numeric>

#include "distmuon/error.h"
#include "instance.h"

namespace distmuon::plan_detail {
namespace {

// Ranks for the canonically ordered owners: the heaviest communicators are dealt to nodes in a
// snake (0, 1, ..., N-1, N-1, ..., 0, ...) so that every node's NICs carry a similar share.
std::vector<int> place_on_nodes(const Instance& inst, const Counts& counts) {
  const int P = inst.owners();
  const int g = std::min(P, inst.topo.gpus_per_node);
  const int nodes = (P + g - 1) / g;
  std::vector<int> order(P);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return inst.comm(counts[a]) > inst.comm(counts[b]); });
  std::vector<int> rank_of(P);
  for (int i = 0; i < P; ++i) {
    const int round = i / nodes, pos = i % nodes;
    const int node = round % 2 == 0 ? pos : nodes - 1 - pos;
    rank_of[order[i]] = node * g + round;
  }
  return rank_of;
}

// Picks which concrete matrices of each class go to each owner. With spreading, each matrix goes
// to the owner (with a free slot of its class) holding the fewest matrices of its layer so far,
// then the one with the most free slots of the class, then the lowest rank.
void choose_matrices(const Instance& inst, const Counts& counts, std::vector<int>& owner) {
  const int P = inst.owners();
  const auto& mats = *inst.matrices;
  std::map<std::pair<int, int64_t>, int> layer_count;  // (owner, layer) -> matrices placed
  for (size_t s = 0; s < inst.classes.size(); ++s) {
    const ShapeClass& cl = inst.classes[s];
    std::vector<int> free(P);
    for (int o = 0; o < P; ++o) free[o] = counts[o][s];
    std::vector<int> members = cl.members;
    if (inst.opts.spread_layers) {
      std::stable_sort(members.begin(), members.end(),
                       [&](int a, int b) { return mats[a].layer < mats[b].layer; });
    }
    int next = 0;  // without spreading: fill owners in rank order
    for (int i : members) {
      int best = -1;
      if (inst.opts.spread_layers && mats[i].layer >= 0) {
        int best_layer = 0;
        for (int o = 0; o < P; ++o) {
          if (free[o] == 0) continue;
          auto it = layer_count.find({o, mats[i].layer});
          const int lc = it == layer_count.end() ? 0 : it->second;
          if (best < 0 || lc < best_layer || (lc == best_layer && free[o] > free[best])) {
            best = o;
            best_layer = lc;
          }
        }
      } else {
        while (free[next] == 0) ++next;
        best = next;
      }
      DM_CHECK(best >= 0, "internal: no free slot for matrix '", mats[i].name, "'");
      owner[i] = best;
      free[best] -= 1;
      layer_count[{best, mats[i].layer}] += 1;
    }
  }
}

}  // namespace

Plan realise(const Instance& inst, Counts counts, const std::string& solver) {
  const int P = inst.owners();
  DM_CHECK(static_cast<int>(counts.size()) == P, "internal: counts for ", counts.size(),
           " owners, world size ", P);
  for (size_t s = 0; s < inst.classes.size(); ++s) {
    int total = 0;
    for (const auto& c : counts) total += c[s];
    DM_CHECK(total == inst.classes[s].count(), "internal: ", solver, " placed ", total, " of ",
             inst.classes[s].count(), " matrices of shape ", inst.classes[s].shape());
  }
  // Canonical owner order: by load, then by the count vector. Two solutions that differ only by
  // a permutation of owners (owners are interchangeable in the model) give the same plan.
  std::sort(counts.begin(), counts.end(), [&](const auto& a, const auto& b) {
    const double la = inst.load(a), lb = inst.load(b);
    if (la != lb) return la > lb;
    return a > b;
  });
  const std::vector<int> rank_of = place_on_nodes(inst, counts);
  Counts by_rank(P);
  for (int o = 0; o < P; ++o) by_rank[rank_of[o]] = counts[o];

  Plan plan;
  plan.solver = solver;
  plan.owner.assign(inst.matrices->size(), -1);
  choose_matrices(inst, by_rank, plan.owner);
  finish(inst, plan);
  return plan;
}

void finish(const Instance& inst, Plan& plan) {
  const int P = inst.owners();
  const auto& mats = *inst.matrices;
  DM_CHECK(plan.owner.size() == mats.size(), "internal: plan has ", plan.owner.size(),
           " owners for ", mats.size(), " matrices");
  Counts counts(P, std::vector<int>(inst.classes.size(), 0));
  // Members of each (owner, class) in registration order.
  std::vector<std::vector<std::vector<int>>> held(
      P, std::vector<std::vector<int>>(inst.classes.size()));
  for (size_t i = 0; i < mats.size(); ++i) {
    const int o = plan.owner[i], s = inst.class_of[i];
    DM_CHECK(o >= 0 && o < P, "internal: matrix '", mats[i].name, "' has owner ", o);
    counts[o][s] += 1;
    held[o][s].push_back(static_cast<int>(i));
  }
  plan.batches.assign(P, {});
  plan.owner_load.assign(P, 0.0);
  plan.owner_comm_bytes.assign(P, 0.0);
  plan.owner_memory_bytes.assign(P, 0.0);
  for (int o = 0; o < P; ++o) {
    for (size_t s = 0; s < inst.classes.size(); ++s) {
      const ShapeClass& cl = inst.classes[s];
      const auto& list = held[o][s];
      size_t at = 0;
      for (int k = counts[o][s]; k > 0;) {
        const int b = cl.first_batch[k];
        plan.batches[o].emplace_back(list.begin() + at, list.begin() + at + b);
        at += b;
        k -= b;
      }
    }
    plan.owner_load[o] = inst.load(counts[o]);
    plan.owner_comm_bytes[o] = inst.comm(counts[o]);
    plan.owner_memory_bytes[o] = inst.memory(counts[o]);
  }
  plan.makespan = *std::max_element(plan.owner_load.begin(), plan.owner_load.end());
  const double mean =
      std::accumulate(plan.owner_load.begin(), plan.owner_load.end(), 0.0) / static_cast<double>(P);
  plan.imbalance = mean > 0 ? plan.makespan / mean : 1.0;

  // Matrices beyond the unavoidable ceil(n_layer / P) per owner for their layer.
  std::map<int64_t, int64_t> layer_size;
  std::map<std::pair<int64_t, int>, int64_t> on_owner;
  for (size_t i = 0; i < mats.size(); ++i) {
    if (mats[i].layer < 0) continue;
    layer_size[mats[i].layer] += 1;
    on_owner[{mats[i].layer, plan.owner[i]}] += 1;
  }
  plan.layer_collisions = 0;
  for (const auto& [key, n] : on_owner) {
    const int64_t allowed = (layer_size[key.first] + P - 1) / P;
    plan.layer_collisions += std::max<int64_t>(0, n - allowed);
  }
  plan.hash = plan_hash(plan);
}

}  // namespace distmuon::plan_detail
