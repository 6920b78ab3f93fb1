// The cluster simulator: plans at each world size, then prices each mode's communication with
// the alpha-beta formulas of simulate.h.
#include "distmuon/simulate.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "distmuon/error.h"

namespace distmuon {
namespace {

// Fused AdamW per element (bf16 weight and gradient read, f32 moments read and written, weight
// written).
constexpr double kAdamWBytesPerElement = 2 + 2 + 8 + 8 + 2;

struct Link {
  double alpha, beta;
};

// A collective over `world` ranks is paced by its slowest hop: NVLink while it stays in one
// node, the per-GPU NIC once it spans nodes.
Link link(int world, const CommModel& cm, int per_node) {
  if (world <= per_node) return {cm.intra_latency_s, cm.intra_bytes_per_s};
  return {cm.inter_latency_s, cm.inter_bytes_per_s};
}

}  // namespace

std::string CommModel::describe() const {
  char buf[1024];
  std::snprintf(
      buf, sizeof(buf),
      "  alpha-beta model: a message of b bytes costs alpha + b / beta\n"
      "  intra-node: beta %.0f GB/s per GPU per direction (NVLink 4 class), alpha %.1f us\n"
      "  inter-node: beta %.0f GB/s per GPU (InfiniBand NDR 400 Gb/s, one NIC per GPU), "
      "alpha %.1f us\n"
      "  on the wire: %lld bytes per element (gradients and updates)\n"
      "  all-gather (gather mode): ring, (D-1) alpha + (D-1)/D * G / beta, beta of the slowest "
      "hop\n"
      "  all-to-all (sharded mode, twice): pairwise, (D-1) alpha + max(intra share / intra beta, "
      "inter share / inter beta) for the busiest owner\n"
      "  reduce + broadcast (dedicated mode): ring chains replacing FSDP's reduce-scatter and "
      "all-gather; only their extra volume is charged\n"
      "  compute: the cost table's batch times; gather runs every matrix on every rank, owner "
      "modes the plan's makespan\n"
      "  elementwise passes: %.0f bytes per element a rank orthogonalizes at %.2f TB/s\n"
      "  not modelled: staging copies of the modes that move rows (pack / unpack), FSDP's own "
      "collectives, overlap of the optimizer with anything else",
      intra_bytes_per_s / 1e9, intra_latency_s * 1e6, inter_bytes_per_s / 1e9,
      inter_latency_s * 1e6, static_cast<long long>(wire_elem_bytes), elementwise_bytes,
      hbm_bytes_per_s / 1e12);
  return buf;
}

double ring_allgather_seconds(double total_bytes, int world, const CommModel& cm, int per_node) {
  DM_CHECK(world >= 1, "simulator: world size must be >= 1 (got ", world, ")");
  if (world == 1) return 0;
  const Link l = link(world, cm, per_node);
  return (world - 1) * l.alpha + (world - 1.0) / world * total_bytes / l.beta;
}

double chain_seconds(double bytes, int world, const CommModel& cm, int per_node) {
  DM_CHECK(world >= 1, "simulator: world size must be >= 1 (got ", world, ")");
  if (world == 1) return 0;
  const Link l = link(world, cm, per_node);
  return (world - 1) * l.alpha + bytes / l.beta;
}

double alltoall_seconds(double send_bytes, double recv_bytes, int world, const CommModel& cm,
                        int per_node) {
  DM_CHECK(world >= 1, "simulator: world size must be >= 1 (got ", world, ")");
  if (world == 1) return 0;
  const double bytes = std::max(send_bytes, recv_bytes);
  if (world <= per_node) return (world - 1) * cm.intra_latency_s + bytes / cm.intra_bytes_per_s;
  const double intra_share = (per_node - 1.0) / (world - 1.0);
  return (world - 1) * cm.inter_latency_s +
         std::max(bytes * intra_share / cm.intra_bytes_per_s,
                  bytes * (1 - intra_share) / cm.inter_bytes_per_s);
}

std::vector<SimPoint> simulate(const std::vector<PlanMatrix>& matrices, const CostTable& costs,
                               const std::vector<int>& worlds, int gpus_per_node,
                               const CommModel& cm, const std::string& solver,
                               const PlanOptions& opts) {
  DM_CHECK(!worlds.empty(), "simulator: no world sizes given");
  DM_CHECK(cm.intra_bytes_per_s > 0 && cm.inter_bytes_per_s > 0 && cm.intra_latency_s >= 0 &&
               cm.inter_latency_s >= 0 && cm.wire_elem_bytes >= 1 && cm.elementwise_bytes >= 0 &&
               cm.hbm_bytes_per_s > 0,
           "simulator: bandwidths must be > 0, latencies and elementwise bytes >= 0");
  const double elementwise_s = cm.elementwise_bytes / cm.hbm_bytes_per_s;  // per element
  // Everything on one rank, batched: what the gather baseline computes on every rank.
  Topology one;
  one.world_size = 1;
  one.gpus_per_node = gpus_per_node;
  const double all_compute = plan_lpt(matrices, one, costs, opts).makespan;
  double total = 0;
  for (const auto& m : matrices)
    total += static_cast<double>(m.rows) * m.cols * static_cast<double>(cm.wire_elem_bytes);

  std::vector<SimPoint> out;
  for (int d : worlds) {
    Topology topo;
    topo.world_size = d;
    topo.gpus_per_node = gpus_per_node;
    if (d > gpus_per_node && d % gpus_per_node != 0) continue;  // not a whole number of nodes
    const Plan plan = make_plan(solver, matrices, topo, costs, opts);
    SimPoint sp;
    sp.world = d;
    sp.solver = solver;
    sp.makespan = plan.makespan;
    sp.imbalance = plan.imbalance;
    sp.gather_compute = all_compute;
    sp.gather_elementwise = total / static_cast<double>(cm.wire_elem_bytes) * elementwise_s;
    std::vector<double> bytes(d, 0.0);
    for (size_t i = 0; i < matrices.size(); ++i)
      bytes[plan.owner[i]] += static_cast<double>(matrices[i].rows) * matrices[i].cols *
                              static_cast<double>(cm.wire_elem_bytes);
    const double b_max = *std::max_element(bytes.begin(), bytes.end());
    const double b_min = *std::min_element(bytes.begin(), bytes.end());
    sp.max_owner_bytes = b_max;
    sp.owner = plan.owner;
    if (d > 1) {
      sp.gather_bytes = (d - 1.0) * total / d + (total - total / d);
      for (int o = 0; o < d; ++o) {
        const double b = bytes[o];
        sp.replicated_bytes = std::max(sp.replicated_bytes, (d - 1.0) * b + (total - b));
        sp.sharded_bytes = std::max(sp.sharded_bytes, 2 * ((total - b) / d + b * (d - 1.0) / d));
        sp.dedicated_bytes = std::max(sp.dedicated_bytes, 2 * (total - b) + 2 * (d - 1.0) * b);
      }
    }
    for (int o = 0; o < d; ++o)
      sp.owner_step = std::max(
          sp.owner_step,
          plan.owner_load[o] + bytes[o] / static_cast<double>(cm.wire_elem_bytes) * elementwise_s);
    if (d > 1) {
      sp.gather_comm = ring_allgather_seconds(total, d, cm, gpus_per_node);
      // There: each rank sends its 1/D row shard of what others own and the owner receives the
      // other D-1 shards of its matrices; back: the reverse. The busiest rank sets the pace.
      double a2a = 0;
      for (int o = 0; o < d; ++o)
        a2a = std::max(a2a, alltoall_seconds((total - bytes[o]) / d, bytes[o] * (d - 1.0) / d, d,
                                             cm, gpus_per_node));
      sp.sharded_comm = 2 * a2a;
      const double chains = chain_seconds(total - b_min, d, cm, gpus_per_node);
      const double rings = ring_allgather_seconds(total, d, cm, gpus_per_node);
      sp.dedicated_comm = 2 * std::max(0.0, chains - rings);
      sp.fsdp_comm = 2 * rings;
      sp.dedicated_exchange = 2 * chains;
    }
    sp.adamw_update = kAdamWBytesPerElement * total / static_cast<double>(cm.wire_elem_bytes) / d /
                      cm.hbm_bytes_per_s;
    out.push_back(sp);
  }
  return out;
}

}  // namespace distmuon
