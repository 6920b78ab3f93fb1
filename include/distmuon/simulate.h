// A cluster simulator for the Muon optimizer step: the compute of a plan (from the cost table)
// and the communication of each mode under an alpha-beta model with a host cost per collective,
// played as a timeline of the ranks' hosts and streams, for world sizes one does not have.
// Measurements on real multi-GPU runs and on the one-GPU cluster are compared with these
// predictions (bench/cluster/report.py).
#pragma once

#include <string>
#include <vector>

#include "distmuon/plan.h"
#include "distmuon/types.h"
#include "distmuon/workload.h"

namespace distmuon {

// Alpha-beta model: a message of b bytes costs alpha + b / beta. Defaults: NVLink 4 on H100 /
// H200 class nodes (900 GB/s bidirectional, 450 GB/s per direction per GPU) inside a node, and
// one InfiniBand NDR 400 Gb/s NIC per GPU (50 GB/s) between nodes; latencies of a few us.
struct CommModel {
  double intra_bytes_per_s = 450e9;
  double inter_bytes_per_s = 50e9;
  double intra_latency_s = 3e-6;
  double inter_latency_s = 6e-6;
  // The share of its D-1 hops' latency a collective pays when it follows another in one group
  // (Communicator::grouped: NCCL runs the group in one kernel, operations side by side). Fitted
  // on the one-GPU cluster at D = 8 (H100): pi0's FSDP2 emulation, 1135 collectives in 56 groups,
  // took 46 ms where every collective paying all its hops predicted 58 and none 34; 0.5 predicts
  // 46.0, and qwen's (253 in 16) 39.4 against 39.1-40.7 measured.
  double grouped_hop_share = 0.5;
  // Reductions (reduce, FSDP's reduce-scatter) inside a node, where they run at another rate
  // than gathers and broadcasts (an all-reduce's bus bandwidth); 0: intra_bytes_per_s.
  double intra_reduce_bytes_per_s = 0;
  // The dedicated mode's rooted collectives inside a node, where measured apart (a broadcast from
  // and a reduce to one rank run at their own bus bandwidth, 2.6x an all-gather's between two
  // MPS ranks): 0 keeps the rates above (broadcasts at intra_bytes_per_s, reduces at the
  // reductions').
  double intra_broadcast_bytes_per_s = 0;
  double intra_root_reduce_bytes_per_s = 0;
  // The sharded mode's all-to-alls inside a node, where measured apart (bus bandwidth as
  // nccl-tests counts it: the bytes a rank sends to its peers over the time; charged at the
  // all-gathers' rate, the one-GPU cluster's sharded steps at D = 2..8 came out 10-40 % short):
  // 0 keeps intra_bytes_per_s.
  double intra_alltoall_bytes_per_s = 0;
  // The sharded mode's all-to-alls in equal blocks, each pair's its bucket's largest (the
  // engine's layout on a communicator's windows, DISTMUON_NCCL_CTA_POLICY=zero); false: packed.
  bool uniform_all_to_all = false;
  int64_t wire_elem_bytes = 2;  // bf16 gradients and updates on the wire
  // What one collective costs the host that issues it, D > 1: the engine's NCCL communicator is
  // non-blocking, so NCCL launches each call from a thread of its own and the communicator polls
  // (50 us sleeps) until NCCL has accepted it. Paid in program order, one collective after the
  // other, while the device runs what was issued before (the step's timeline, simulate()).
  // Default: 143 us, measured on an H100 with two MPS ranks (distmuon-bench --calibrate's
  // nccl_collective_us; 768 back-to-back collectives of 8 KiB took 108 ms, 140 us each).
  double collective_latency_s = 143e-6;
  // The same at one rank, where NCCL copies locally without a thread (the bench's FSDP2
  // emulation and the engine still issue their collectives there). Default: 10 us, measured
  // likewise at one rank (512 collectives, 5.0 ms).
  double local_collective_s = 10e-6;
  // Where the ranks share one GPU (MPS): the share of a rank's compute a collective takes while
  // it moves data (SMs and memory bandwidth of the same chip). 0: none (ranks on GPUs of their
  // own).
  double comm_compute_share = 0;
  // Likewise while a rank's NCCL kernel has started and waits for its peers: its CTAs spin on
  // the SMs they hold. 0: a waiting kernel takes nothing.
  double comm_wait_share = 0;
  // Full-matrix bytes per bucket of the engine (DistOptions::bucket_bytes, distmuon-bench
  // --bucket-mb): buckets set how many collectives the gather and sharded modes issue, and cut
  // the owners' batches (each run of a bucket is one batched orthogonalization). <= 0: one bucket.
  int64_t bucket_bytes = kDefaultBucketBytes;
  // Owner modes: each owner orthogonalizes a plan batch (one owner, plan batch and shape) once,
  // when the last bucket holding a member has landed (DistOptions::batches_across_buckets, the
  // engine's default); false: one batch per run of a bucket, right after that bucket lands.
  bool batches_across_buckets = true;
  // The elementwise passes around the orthogonalization (gradient and momentum, the Nesterov
  // input and its norm, the iterate in and out, the weight update), as bytes of memory traffic
  // per element a rank orthogonalizes, at the device's memory bandwidth. 44 bytes: measured on
  // the H200 at one rank with f32 parameters and momentum (gpt2-large: the dedicated step less
  // the measured orthogonalization costs: 7.7 ms over 708 M elements; with it the simulator
  // predicts the step at 28.1 ms against 28.1 measured, pi0 within 4 %). 0 leaves them out.
  double elementwise_bytes = 44;
  double hbm_bytes_per_s = 4.17e12;
  // The AdamW baseline's fused pass, where measured apart (distmuon-bench --calibrate's
  // adamw_gbs); bytes as sim_step.h counts them. 0: kAdamWShareOfCopy of hbm_bytes_per_s, the
  // share the pass ran at between MPS parts of an H100 at D = 2, 4, 8 (84-87 %; charged at the
  // full copy rate, the uncalibrated D = 1 steps came out 21-22 % short).
  static constexpr double kAdamWShareOfCopy = 0.85;
  double adamw_bytes_per_s = 0;
  double adamw_pass_bytes_per_s() const {
    return adamw_bytes_per_s > 0 ? adamw_bytes_per_s : kAdamWShareOfCopy * hbm_bytes_per_s;
  }
  std::string describe() const;  // the assumptions, several lines
};

// A parameter tensor as the step around the optimizer moves it: FSDP2 shards its dim 0 (the
// bench's emulation reduces each shard to its holder and all-gathers each tensor, a layer's
// tensors as one group each way: Workload::fsdp_units); it holds `matrices` consecutive Muon
// matrices of rows x cols (3-D stacks several).
struct SimTensor {
  int64_t dim0 = 0, numel = 0;
  int64_t matrices = 1, rows = 0, cols = 0;
  int64_t unit = -1;  // its FSDP2 unit (the layer); units go in increasing order; -1: its own
};
// The Muon tensors of a workload in registration order (the order of plan_matrices()).
std::vector<SimTensor> sim_tensors(const Workload& workload);

// Collective formulas used (D ranks, n GPUs per node; a ring crossing nodes runs at the
// inter-node bandwidth, since every GPU's ring edge to the next node is its own NIC):
// ring all-gather / reduce-scatter of `total` bytes: (D-1) alpha + (D-1)/D * total / beta.
double ring_allgather_seconds(double total_bytes, int world, const CommModel& cm, int per_node);
// Pipelined ring (chain) broadcasts or reduces, many at once with different roots, where the
// busiest rank forwards `bytes` in all: (D-1) alpha + bytes / beta.
double chain_seconds(double bytes, int world, const CommModel& cm, int per_node);
// Pairwise all-to-all where one rank sends `send` and receives `recv` bytes spread evenly over
// its peers: (D-1) alpha + max(intra part / intra beta, inter part / inter beta), the intra part
// being the (n-1)/(D-1) share that stays on the node; inside a node, intra beta is
// intra_alltoall_bytes_per_s where given.
double alltoall_seconds(double send_bytes, double recv_bytes, int world, const CommModel& cm,
                        int per_node);

struct SimPoint {
  int world = 1;
  std::string solver;   // the planner that placed the owners
  double makespan = 0;  // owner-mode compute: the plan's slowest owner
  double imbalance = 1;

  // ---- terms (seconds), each alone: compute at the cost table's rates, traffic at beta --------
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
  // What a training step does around the optimizer, as bandwidth alone:
  //   fsdp_comm          FSDP2's gradient reduce-scatter and weight all-gather (rings)
  //   dedicated_exchange the dedicated mode's whole reduce-to-owner and broadcast (chains)
  //   adamw_update       fused AdamW on the rank's 1/D shard: bf16 weight and gradient read, f32
  //                      moments read and written, weight written (22 bytes per element)
  double fsdp_comm = 0, dedicated_exchange = 0, adamw_update = 0;

  // ---- the steps (seconds), from the timeline of simulate() ----------------------------------
  // The engine's step per mode (Engine::step, as distmuon-bench's engine_ms times it), the
  // slowest rank's.
  double gather_engine = 0, sharded_engine = 0, dedicated_engine = 0, adamw_engine = 0;
  // The bench's FSDP2 emulation around gather, sharded and adamw: the reduce of every dim-0
  // shard of every tensor before the step, the all-gather of every tensor after it.
  double fsdp_reduce_scatter = 0, fsdp_all_gather = 0;
  // Collectives issued per step: the FSDP2 emulation's, and each mode engine's (the vote that
  // starts a step at D > 1 included); the engine's buckets.
  int64_t fsdp_collectives = 0, gather_collectives = 0, sharded_collectives = 0,
          dedicated_collectives = 0, adamw_collectives = 0, buckets = 0;
  // Host launches: the FSDP2 emulation's (per layer a group of its reduces, one of its
  // all-gathers), the sharded mode's (per bucket the rows out, then the statuses with the rows
  // back; the vote) and the dedicated mode's (a group per bucket and stage, the vote).
  int64_t fsdp_launches = 0, sharded_launches = 0, dedicated_launches = 0;
  // Orthogonalizations the busiest owner runs (one per plan batch and shape, across buckets; one
  // per run of a bucket without CommModel::batches_across_buckets), and every rank in gather
  // mode (one per run of a bucket: shape).
  int64_t owner_runs = 0, gather_runs = 0;

  double gather() const { return gather_engine; }
  double sharded() const { return sharded_engine; }
  double dedicated() const { return dedicated_engine; }
  double fsdp() const { return fsdp_reduce_scatter + fsdp_all_gather; }
  // The step as distmuon-bench times it (from local unreduced gradients to full updated weights
  // on every rank): gather, sharded and the AdamW baseline inside the FSDP2 emulation, dedicated
  // alone (its engine reduces and broadcasts).
  double gather_step() const { return gather_engine + fsdp(); }
  double sharded_step() const { return sharded_engine + fsdp(); }
  double dedicated_step() const { return dedicated_engine; }
  double adamw_step() const { return adamw_engine + fsdp(); }
};

// Predicted optimizer step time of the modes at every world size in `worlds`. The plan places
// the owners; buckets of bucket_bytes consecutive matrices group the engine's traffic as the
// runtime does (dist_layout.cc), and each rank's step is a timeline (the runtime's phases,
// dist_step.cc): its host issues kernels and collectives in program order, paying
// collective_latency_s per collective; kernels run in order on its compute stream and start once
// issued and once the collectives they wait for ended; collectives run in order on the
// communicator's stream, once every rank issued them and the kernels issued before them ended.
// Per mode:
// - gather: per bucket a status all-reduce and an all-gather of the rows; every rank unpacks the
//   bucket and orthogonalizes every matrix (one batch per shape of the bucket);
// - sharded: per bucket the rows to their owners (pack, all-to-all, unpack), the owner's
//   batches, then a status all-reduce and the updates back (pack, all-to-all) in one launch;
// - dedicated: a reduce to the owner per matrix, the owner's batches, a broadcast per matrix;
// - adamw: fused AdamW on the rank's shard.
// A kernel costs the cost table's batch time (each run of a bucket is one batch) plus its
// elementwise passes (CommModel::elementwise_bytes per element orthogonalized) and staging
// copies (read + write of the wire bytes at hbm_bytes_per_s); a collective (D - 1) alpha plus
// its bytes over beta (reductions over intra_reduce_bytes_per_s where given), or at one rank
// the local copy NCCL makes. `tensors` (sim_tensors()) give the FSDP2 shards and units; empty:
// one tensor per matrix, each its own unit. World sizes that are not a whole number of nodes are
// left out. `plan_costs`, where given, is the table the owners are placed with when a run planned
// on other costs than the ones its steps take (an engine planning on analytic costs, timed with a
// measured table): the owners come from it, the batches (cut again, as the planners cut them)
// and every time from `costs`.
std::vector<SimPoint> simulate(const std::vector<PlanMatrix>& matrices, const CostTable& costs,
                               const std::vector<int>& worlds, int gpus_per_node,
                               const CommModel& cm, const std::string& solver,
                               const PlanOptions& opts = {},
                               const std::vector<SimTensor>& tensors = {},
                               const CostTable* plan_costs = nullptr);

}  // namespace distmuon
