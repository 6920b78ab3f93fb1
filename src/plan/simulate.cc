// The cluster simulator: plans at each world size, prices each mode's traffic with the
// alpha-beta formulas of simulate.h, and plays each mode's step as a timeline of the ranks'
// hosts, compute streams and communicator stream (sim_step.cc).
#include "distmuon/simulate.h"

#include <algorithm>
#include <cstdio>

#include "distmuon/error.h"
#include "distmuon/optimizer.h"
#include "plan/sim_step.h"

namespace distmuon {

using sim_detail::kAdamWBytesPerElement;
using sim_detail::Link;
using sim_detail::link;
using sim_detail::SimMatrix;

std::vector<SimTensor> sim_tensors(const Workload& w) {
  std::vector<SimTensor> out;
  for (const Workload::TensorRef& t : w.muon_tensors()) {
    const WorkloadEntry& e = w.muon[static_cast<size_t>(t.entry)];
    const MatrixLayout l = matrix_layout(e.name, e.shape);
    out.push_back({e.shape.at(0), e.numel(), l.count, l.rows, l.cols, t.layer});
  }
  return out;
}

std::string CommModel::describe() const {
  char buf[4096];
  std::snprintf(
      buf, sizeof(buf),
      "  alpha-beta model: a message of b bytes costs alpha + b / beta\n"
      "  intra-node: beta %.0f GB/s per GPU per direction (NVLink 4 class), alpha %.1f us; "
      "reductions %.0f GB/s; the dedicated mode's broadcasts %.0f GB/s, reduces %.0f GB/s; the "
      "sharded mode's all-to-alls %.0f GB/s\n"
      "  inter-node: beta %.0f GB/s per GPU (InfiniBand NDR 400 Gb/s, one NIC per GPU), "
      "alpha %.1f us\n"
      "  on the wire: %lld bytes per element (gradients and updates)\n"
      "  per collective: %.1f us of the issuing host (D > 1; %.1f us at one rank, where NCCL "
      "copies locally), in program order, while the device runs what was issued before\n"
      "  buckets of %.0f MiB of full matrices (the engine's exchange and batches)\n"
      "  all-gather (gather mode, per bucket): ring, (D-1) alpha + (D-1)/D * bytes / beta, beta "
      "of the slowest hop\n"
      "  all-to-all (sharded mode, twice per bucket): pairwise, (D-1) alpha + max(intra share / "
      "intra beta, inter share / inter beta) for the busiest owner; %s\n"
      "  reduce + broadcast (dedicated mode, per matrix): chains, (D-1) alpha + bytes / beta\n"
      "  a collective after the first of its group pays %.0f %% of its (D-1) alpha\n"
      "  FSDP2 around gather, sharded and AdamW (distmuon-bench's emulation): a rooted reduce "
      "per dim-0 shard and an all-gather per tensor\n"
      "  compute: the cost table's batch times (gather: every matrix on every rank, one batch "
      "per shape and bucket; owner modes: each owner's plan batches, %s)\n"
      "  elementwise passes: %.0f bytes per element a rank orthogonalizes, staging copies "
      "(pack / unpack) read + write, at %.2f TB/s; the AdamW baseline's fused pass %.0f bytes "
      "per element at %.2f TB/s\n"
      "  where ranks share a GPU: a collective moving data takes %.0f %% of each rank's compute, "
      "one waiting for its peers %.0f %%\n"
      "  not modelled: the host's kernel launches, ranks starting a step at different times",
      intra_bytes_per_s / 1e9, intra_latency_s * 1e6,
      // Inside a node (one rank of a one-GPU node), with each rate's fallback.
      sim_detail::reduce_link(1, *this, 1).beta / 1e9,
      sim_detail::broadcast_link(1, *this, 1).beta / 1e9,
      sim_detail::root_reduce_link(1, *this, 1).beta / 1e9,
      sim_detail::alltoall_link(1, *this, 1).beta / 1e9, inter_bytes_per_s / 1e9,
      inter_latency_s * 1e6, static_cast<long long>(wire_elem_bytes), collective_latency_s * 1e6,
      local_collective_s * 1e6, static_cast<double>(bucket_bytes) / (1 << 20),
      uniform_all_to_all ? "every pair an equal block, its bucket's largest (windows)"
                         : "packed blocks",
      grouped_hop_share * 100,
      batches_across_buckets ? "each batch once its last bucket has landed"
                             : "cut at the buckets' borders",
      elementwise_bytes, hbm_bytes_per_s / 1e12, sim_detail::kAdamWBytesPerElement,
      adamw_pass_bytes_per_s() / 1e12, comm_compute_share * 100, comm_wait_share * 100);
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
  return sim_detail::chain_seconds(bytes, world, link(world, cm, per_node));
}

double alltoall_seconds(double send_bytes, double recv_bytes, int world, const CommModel& cm,
                        int per_node) {
  DM_CHECK(world >= 1, "simulator: world size must be >= 1 (got ", world, ")");
  if (world == 1) return 0;
  const double bytes = std::max(send_bytes, recv_bytes);
  if (world <= per_node) {
    const Link l = sim_detail::alltoall_link(world, cm, per_node);
    return (world - 1) * l.alpha + bytes / l.beta;
  }
  const double intra_share = (per_node - 1.0) / (world - 1.0);
  return (world - 1) * cm.inter_latency_s +
         std::max(bytes * intra_share / cm.intra_bytes_per_s,
                  bytes * (1 - intra_share) / cm.inter_bytes_per_s);
}

std::vector<SimPoint> simulate(const std::vector<PlanMatrix>& matrices, const CostTable& costs,
                               const std::vector<int>& worlds, int gpus_per_node,
                               const CommModel& cm, const std::string& solver,
                               const PlanOptions& opts, const std::vector<SimTensor>& tensors,
                               const CostTable* plan_costs) {
  DM_CHECK(!worlds.empty(), "simulator: no world sizes given");
  DM_CHECK(cm.intra_bytes_per_s > 0 && cm.inter_bytes_per_s > 0 && cm.intra_latency_s >= 0 &&
               cm.inter_latency_s >= 0 && cm.wire_elem_bytes >= 1 && cm.elementwise_bytes >= 0 &&
               cm.hbm_bytes_per_s > 0 && cm.intra_reduce_bytes_per_s >= 0 &&
               cm.intra_broadcast_bytes_per_s >= 0 && cm.intra_root_reduce_bytes_per_s >= 0 &&
               cm.intra_alltoall_bytes_per_s >= 0 && cm.adamw_bytes_per_s >= 0 &&
               cm.collective_latency_s >= 0 && cm.local_collective_s >= 0 &&
               cm.grouped_hop_share >= 0 && cm.grouped_hop_share <= 1,
           "simulator: bandwidths must be > 0, latencies and elementwise bytes >= 0, the grouped "
           "hop share in [0, 1]");
  DM_CHECK(cm.comm_compute_share >= 0 && cm.comm_compute_share < 1 && cm.comm_wait_share >= 0 &&
               cm.comm_wait_share < 1,
           "simulator: the communication's shares of the compute must be in [0, 1) (got ",
           cm.comm_compute_share, " moving, ", cm.comm_wait_share, " waiting)");
  // The tensors the matrices come from (one each when not given).
  std::vector<SimTensor> ts = tensors;
  if (ts.empty())
    for (const PlanMatrix& m : matrices) ts.push_back({m.rows, m.rows * m.cols, 1, m.rows, m.cols});
  std::vector<SimMatrix> layout;
  for (size_t t = 0; t < ts.size(); ++t) {
    const SimTensor& st = ts[t];
    DM_CHECK(st.dim0 >= 1 && st.rows >= 1 && st.cols >= 1 && st.matrices >= 1 &&
                 st.numel == st.matrices * st.rows * st.cols && st.numel % st.dim0 == 0,
             "simulator: tensor ", t, " is inconsistent (dim0 ", st.dim0, ", ", st.numel,
             " elements, ", st.matrices, " matrices of ", st.rows, " x ", st.cols, ")");
    for (int64_t s = 0; s < st.matrices; ++s) {
      const size_t j = layout.size();
      DM_CHECK(j < matrices.size() && matrices[j].rows == st.rows && matrices[j].cols == st.cols,
               "simulator: the tensors do not hold the matrices (matrix ", j, ")");
      SimMatrix m;
      m.rows = st.rows;
      m.cols = st.cols;
      m.elems = st.rows * st.cols;
      m.tensor = static_cast<int>(t);
      m.slice = s;
      layout.push_back(m);
    }
  }
  DM_CHECK(layout.size() == matrices.size(), "simulator: the tensors hold ", layout.size(),
           " matrices, not ", matrices.size());

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
    Plan plan = make_plan(solver, matrices, topo, plan_costs ? *plan_costs : costs, opts);
    if (plan_costs) plan = plan_fixed(matrices, topo, costs, plan.owner, opts);
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
      // The dedicated mode's way in (reduces) and out (broadcasts), at their own rates.
      const Link in = sim_detail::root_reduce_link(d, cm, gpus_per_node);
      const Link back = sim_detail::broadcast_link(d, cm, gpus_per_node);
      const double chains = sim_detail::chain_seconds(total - b_min, d, in) +
                            sim_detail::chain_seconds(total - b_min, d, back);
      const double rings = ring_allgather_seconds(total, d, cm, gpus_per_node);
      sp.dedicated_comm = std::max(0.0, chains - 2 * rings);
      sp.fsdp_comm = 2 * rings;
      sp.dedicated_exchange = chains;
    }
    sp.adamw_update = kAdamWBytesPerElement * total / static_cast<double>(cm.wire_elem_bytes) / d /
                      cm.adamw_pass_bytes_per_s();

    // The timelines, on this plan's owners and batches.
    std::vector<SimMatrix> mats = layout;
    for (size_t j = 0; j < mats.size(); ++j) mats[j].owner = plan.owner[j];
    for (size_t o = 0; o < plan.batches.size(); ++o)
      for (size_t k = 0; k < plan.batches[o].size(); ++k)
        for (int j : plan.batches[o][k]) mats[static_cast<size_t>(j)].batch = static_cast<int>(k);
    sim_detail::play_step(ts, std::move(mats), d, gpus_per_node, cm, costs, sp);
    out.push_back(sp);
  }
  return out;
}

}  // namespace distmuon
