// Host-side launchers of the CUDA backend's own kernels (kernels/ holds the device code). Each
// validates its arguments, splits long slot lists into launches of the kernels' table size, and
// checks the launch. Nothing here allocates or synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <span>

#include "distmuon/backend.h"

namespace distmuon::cuda {

// Scratch memory for grid-wide reductions, in stream order.
struct Scratch {
  double* partials = nullptr;
  size_t partial_count = 0;       // doubles available
  unsigned* counters = nullptr;   // self-resetting tickets, zero between launches
  int counter_count = 0;
};

// Blocks per matrix for a memory-bound pass over `numel` elements (pure heuristic): enough
// blocks to keep every SM busy with several resident blocks, each block moving at least 16K
// elements so that the per-block reduction and launch costs stay small.
int blocks_per_matrix(int64_t numel, int64_t matrices, int sm_count);

// Backend::muon_pass_grouped (and the single-batch passes as one batch): launches of up to
// kMaxMuonSlots matrices of any shapes per kind of kernel (flat, or transposing for tall
// matrices in passes 2 and 3). Every batch is checked before anything is issued.
void launch_muon_pass(MuonPass pass, std::span<const MuonPassBatch> batches,
                      const Scratch& scratch, int sm_count, cudaStream_t stream);

void launch_lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b, double diag,
                    const BatchRef& out, int sm_count, cudaStream_t stream);
void launch_lincomb_grouped(std::span<const LincombProblem> problems, int sm_count,
                            cudaStream_t stream);
void launch_frob_norm(const BatchRef& a, double* norms, const Scratch& scratch, int sm_count,
                      cudaStream_t stream);
void launch_scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                       const BatchRef& dst, int sm_count, cudaStream_t stream);
void launch_copy_blocks(std::span<const BlockCopy> copies, int sm_count, cudaStream_t stream);

void launch_adamw_check(std::span<const AdamSlot> slots, int32_t* status, int sm_count,
                        cudaStream_t stream);
void launch_adamw_update(std::span<const AdamSlot> slots, const int32_t* status, int sm_count,
                         cudaStream_t stream);
// Backend::upload_small: the bytes travel in kernel parameters, a few kilobytes per launch.
void launch_upload_small(void* dst, const void* host_src, size_t bytes, cudaStream_t stream);
void launch_count_status(const int32_t* status, int64_t n, int64_t* counter, cudaStream_t stream);

// Copies the strict lower triangle of every square matrix of `c` onto its upper triangle (with
// flags: only of the matrices b with flags[b] == value). diagonal_block > 0 (a multiple of 64):
// only inside the diagonal blocks of that many rows, where a symmetric kernel that stores the
// rest of the upper triangle in its epilogue left it (sym_diagonal_block).
void launch_mirror(const BatchRef& c, cudaStream_t stream, const int32_t* flags = nullptr,
                   int32_t value = 1, int64_t diagonal_block = 0);

// ---- CacheMuon (kernels/cache_kernels.cuh) ----
// Backend::cache_gate: one thread per matrix runs cache_ref::gate_one (the per-batch gate: one
// block over the call, which ANDs the matrices' votes first).
void launch_cache_gate(const CacheGateArgs& args, cudaStream_t stream);
// dst_i = src_i rounded to dst's dtype where flags[i] == value; other matrices untouched.
void launch_copy_masked(const BatchRef& src, const BatchRef& dst, const int32_t* flags,
                        int32_t value, int sm_count, cudaStream_t stream);
// Backend::fill_normal: element (b, r, c) = cache_ref::normal_sample(seed, counter +
// (b * rows + r) * cols + c), rounded to dst's dtype.
void launch_fill_normal_ref(const BatchRef& dst, uint64_t seed, uint64_t counter, int sm_count,
                            cudaStream_t stream);
// Backend::fingerprint and Backend::fill_normal_keyed (cache_ref.h defines both exactly).
void launch_fingerprint(const BatchRef& x, uint64_t* keys, cudaStream_t stream);
void launch_fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys,
                              int sm_count, cudaStream_t stream);

// Sets a conditional graph node's condition from how many flags[i] == value, i < count (one
// block; the node's graph must be the one running). An IF node's (two_bodies false): 1 where
// any does, else 0. A SWITCH node's of two bodies: 0 where some but not all do, 1 where all
// do, 2 (no body) where none does.
void launch_set_if_selected(cudaGraphConditionalHandle handle, const int32_t* flags, int32_t value,
                            int64_t count, bool two_bodies, cudaStream_t stream);

}  // namespace distmuon::cuda

namespace distmuon::cuda {
// Fills n elements with independent N(0, scale^2) values (counter-based: same seed, same data).
void launch_fill_normal(void* data, DType dtype, int64_t n, uint64_t seed, float scale,
                        cudaStream_t stream);
}  // namespace distmuon::cuda
