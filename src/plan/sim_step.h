// The simulator's step model (simulate.cc): each mode's step at one world size played as a
// timeline of every rank's host, compute stream and communicator stream, with the runtime's
// buckets, batches and collectives (dist_step.cc, distmuon-bench's FSDP2 emulation).
#pragma once

#include <cstdint>
#include <vector>

#include "distmuon/simulate.h"

namespace distmuon::sim_detail {

// Fused AdamW per element (bf16 weight and gradient read, f32 moments read and written, weight
// written).
constexpr double kAdamWBytesPerElement = 2 + 2 + 8 + 8 + 2;

struct Link {
  double alpha, beta;
};

// A collective over `world` ranks is paced by its slowest hop: NVLink while it stays in one
// node, the per-GPU NIC once it spans nodes.
inline Link link(int world, const CommModel& cm, int per_node) {
  if (world <= per_node) return {cm.intra_latency_s, cm.intra_bytes_per_s};
  return {cm.inter_latency_s, cm.inter_bytes_per_s};
}

// `l` with an intra-node rate of its own where one is given (> 0) and the collective stays inside
// a node.
inline Link at_intra_rate(Link l, int world, int per_node, double intra_bytes_per_s) {
  if (world <= per_node && intra_bytes_per_s > 0) l.beta = intra_bytes_per_s;
  return l;
}
// Reductions (intra_reduce_bytes_per_s); the dedicated mode's broadcasts and the reduces to one
// rank (the dedicated mode's, the FSDP2 emulation's), which fall back to the gathers' and the
// reductions' rates.
inline Link reduce_link(int world, const CommModel& cm, int per_node) {
  return at_intra_rate(link(world, cm, per_node), world, per_node, cm.intra_reduce_bytes_per_s);
}
inline Link broadcast_link(int world, const CommModel& cm, int per_node) {
  return at_intra_rate(link(world, cm, per_node), world, per_node, cm.intra_broadcast_bytes_per_s);
}
inline Link root_reduce_link(int world, const CommModel& cm, int per_node) {
  return at_intra_rate(reduce_link(world, cm, per_node), world, per_node,
                       cm.intra_root_reduce_bytes_per_s);
}
// The sharded mode's all-to-alls, which fall back to the gathers' rate.
inline Link alltoall_link(int world, const CommModel& cm, int per_node) {
  return at_intra_rate(link(world, cm, per_node), world, per_node, cm.intra_alltoall_bytes_per_s);
}

// A pipelined chain (a broadcast from or a reduce to one rank) over `world` ranks on `l`, the
// busiest rank forwarding `bytes`: (D-1) alpha + bytes / beta.
inline double chain_seconds(double bytes, int world, Link l) {
  return (world - 1) * l.alpha + bytes / l.beta;
}

// One Muon matrix of the layout at a world size.
struct SimMatrix {
  int64_t rows = 0, cols = 0, elems = 0;
  int tensor = 0;
  int64_t slice = 0;
  int owner = 0, batch = 0;
  int64_t m() const { return std::min(rows, cols); }
  int64_t n() const { return std::max(rows, cols); }
};

// Plays every mode's step at `world` ranks (`per_node` to a node) on the plan behind `mats`
// (their owners and batches set): fills sp's buckets, collectives, *_engine and *_step terms and
// the FSDP2 emulation's.
void play_step(const std::vector<SimTensor>& tensors, std::vector<SimMatrix> mats, int world,
               int per_node, const CommModel& cm, const CostTable& costs, SimPoint& sp);

}  // namespace distmuon::sim_detail
