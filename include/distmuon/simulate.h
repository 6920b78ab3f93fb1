// A cluster simulator for the Muon optimizer step: the compute of a plan (from the cost table)
// plus the communication of each mode under an alpha-beta model, for world sizes one does not
// have. Later measurements on real multi-GPU runs are compared with these predictions.
#pragma once

#include <string>
#include <vector>

#include "distmuon/plan.h"

namespace distmuon {

// Alpha-beta model: a message of b bytes costs alpha + b / beta. Defaults: NVLink 4 on H100 /
// H200 class nodes (900 GB/s bidirectional, 450 GB/s per direction per GPU) inside a node, and
// one InfiniBand NDR 400 Gb/s NIC per GPU (50 GB/s) between nodes; latencies of a few us.
struct CommModel {
  double intra_bytes_per_s = 450e9;
  double inter_bytes_per_s = 50e9;
  double intra_latency_s = 3e-6;
  double inter_latency_s = 6e-6;
  int64_t wire_elem_bytes = 2;  // bf16 gradients and updates on the wire
  // The elementwise passes around the orthogonalization (gradient and momentum, the Nesterov
  // input and its norm, the iterate in and out, the weight update), as bytes of memory traffic
  // per element a rank orthogonalizes, at the device's memory bandwidth. 44 bytes: measured on
  // the H200 at one rank with f32 parameters and momentum (gpt2-large: the dedicated step less
  // the measured orthogonalization costs: 7.7 ms over 708 M elements; with it the simulator
  // predicts the step at 28.1 ms against 28.1 measured, pi0 within 4 %). 0 leaves them out.
  double elementwise_bytes = 44;
  double hbm_bytes_per_s = 4.17e12;
  std::string describe() const;  // the assumptions, several lines
};

// Collective formulas used (D ranks, n GPUs per node; a ring crossing nodes runs at the
// inter-node bandwidth, since every GPU's ring edge to the next node is its own NIC):
// ring all-gather / reduce-scatter of `total` bytes: (D-1) alpha + (D-1)/D * total / beta.
double ring_allgather_seconds(double total_bytes, int world, const CommModel& cm, int per_node);
// Pipelined ring (chain) broadcasts or reduces, many at once with different roots, where the
// busiest rank forwards `bytes` in all: (D-1) alpha + bytes / beta.
double chain_seconds(double bytes, int world, const CommModel& cm, int per_node);
// Pairwise all-to-all where one rank sends `send` and receives `recv` bytes spread evenly over
// its peers: (D-1) alpha + max(intra part / intra beta, inter part / inter beta), the intra part
// being the (n-1)/(D-1) share that stays on the node.
double alltoall_seconds(double send_bytes, double recv_bytes, int world, const CommModel& cm,
                        int per_node);

struct SimPoint {
  int world = 1;
  std::string solver;   // the planner that placed the owners
  double makespan = 0;  // owner-mode compute: the plan's slowest owner
  double imbalance = 1;
  double gather_compute = 0, gather_comm = 0;
  double gather_elementwise = 0;  // every rank prepares and orthogonalizes every matrix
  double owner_step = 0;  // owner modes: the slowest owner's compute plus elementwise passes
  double sharded_comm = 0;
  double dedicated_comm = 0;
  double max_owner_bytes = 0;  // on the wire, the busiest owner
  std::vector<int> owner;      // the plan: owner rank of each matrix
  // Bytes the engine itself moves per rank (sent + received, as CommStats counts them; the
  // busiest rank; FSDP's and DDP's own collectives excluded; row shards taken as 1/D):
  //   gather:     all-gather of the gradient rows        (D-1) own + (total - own)
  //   replicated: broadcast of each matrix from its owner (D-1) b_o + (total - b_o)
  //   sharded:    all-to-all of rows to the owners and back  2 [(total - b_o) / D + b_o (D-1) / D]
  //   dedicated:  reduce to the owner, broadcast from it     2 (total - b_o) + 2 (D-1) b_o
  // with b_o the bytes of the matrices owner o holds, on the wire.
  double gather_bytes = 0, replicated_bytes = 0, sharded_bytes = 0, dedicated_bytes = 0;
  double gather() const { return gather_compute + gather_elementwise + gather_comm; }
  double sharded() const { return owner_step + sharded_comm; }
  double dedicated() const { return owner_step + dedicated_comm; }

  // The step as distmuon-bench times it (from local unreduced gradients to full updated weights
  // on every rank), which adds what a training step does around the optimizer:
  //   fsdp_comm          FSDP2's gradient reduce-scatter and weight all-gather (rings), paid by
  //                      gather, sharded and the AdamW baseline
  //   dedicated_exchange the dedicated mode's whole reduce-to-owner and broadcast (chains), where
  //                      dedicated() charges only what they add to FSDP2's rings
  //   adamw_update       fused AdamW on the rank's 1/D shard: bf16 weight and gradient read, f32
  //                      moments read and written, weight written (22 bytes per element)
  double fsdp_comm = 0, dedicated_exchange = 0, adamw_update = 0;
  double gather_step() const { return gather() + fsdp_comm; }
  double sharded_step() const { return sharded() + fsdp_comm; }
  double dedicated_step() const { return owner_step + dedicated_exchange; }
  double adamw_step() const { return adamw_update + fsdp_comm; }
};

// Predicted optimizer step time of the three modes at every world size in `worlds`:
// - gather: all-gather every full gradient (ring), every rank orthogonalizes everything;
// - sharded: all-to-all row shards to owners, owners compute, all-to-all updates back;
// - dedicated: reduce-to-owner and broadcast replace FSDP's reduce-scatter and all-gather inside
//   backward and forward. A rank forwards every matrix it does not own (G - B_o bytes) where the
//   ring collectives move (D-1)/D G, so the step pays the owner makespan plus twice the
//   difference, taken as not hidden (zero when owner bytes are balanced).
// Each adds its elementwise passes (CommModel::elementwise_bytes over the elements the rank
// orthogonalizes). FSDP's own collectives are outside all three.
// World sizes that are not a whole number of nodes are left out of the result.
std::vector<SimPoint> simulate(const std::vector<PlanMatrix>& matrices, const CostTable& costs,
                               const std::vector<int>& worlds, int gpus_per_node,
                               const CommModel& cm, const std::string& solver,
                               const PlanOptions& opts = {});

}  // namespace distmuon
