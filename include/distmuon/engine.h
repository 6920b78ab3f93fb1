// The Engine: registry of parameters and their optimizer state, the step pipeline
// (collect -> compute -> publish) and its statistics. In a single process it is the whole
// optimizer; distributed modes plug a Communicator and a Plan into the same pipeline.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"

namespace distmuon {

enum class NonFinitePolicy : int {
  kSkip = 0,   // skip the affected matrices/tensors, count them (no host synchronisation)
  kRaise = 1,  // throw before any state is touched (synchronises once per step)
};

struct EngineOptions {
  NonFinitePolicy nonfinite = NonFinitePolicy::kSkip;
};

struct ParamSpec {
  std::string name;
  int group = 0;                // index returned by Engine::add_group
  std::vector<int64_t> shape;   // full logical shape
  DType dtype = DType::kF32;    // parameter dtype (the gradient may differ)
};

// The buffers of one parameter for one step. grad == nullptr: the parameter has no gradient in
// this step and is left alone (as torch.optim does).
struct ParamData {
  void* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  std::span<const int64_t> grad_shape;  // optional: checked against the parameter's shape
};

struct EngineStats {
  int64_t steps = 0;
  int64_t nonfinite_skips = 0;  // matrices/tensors skipped because of NaN/Inf gradients
  OrthoStats ortho;             // orthogonalization work done by this process (CacheMuon
                                // classes count what an ideal device does, see CacheStats)
  CacheStats cache;             // CacheMuon, summed over the shape classes that use it
  int64_t muon_matrices = 0;    // registered Muon matrices (3D params count once per slice)
  int64_t muon_params = 0;      // elements in Muon parameters
  int64_t adamw_params = 0;     // elements in AdamW parameters
};

class Engine {
 public:
  Engine(Backend& backend, EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Groups and parameters are registered before the first step.
  int add_group(const GroupOptions& options);
  GroupOptions& group(int index);  // hyperparameters may change between steps (schedulers)
  int num_groups() const;
  int add_param(const ParamSpec& spec);
  int num_params() const;
  const ParamSpec& param(int index) const;

  // One optimizer step over every registered parameter; data[i] belongs to parameter i.
  void step(std::span<const ParamData> data);

  // Optimizer state of a parameter, in backend memory, shaped like the parameter (fp32 unless
  // the group asks for bf16 momentum). Names: "momentum_buffer" (Muon), "exp_avg",
  // "exp_avg_sq" (AdamW). The view stays valid for the engine's lifetime.
  // With CacheMuon on a Gram-NS shape also "cache_q", "cache_age", "cache_key" (see
  // TransformCache::state; leading shape [] for a matrix, [e] for a 3D parameter). Reading them
  // freezes the parameter list (as a first step does); they stay valid until the group's cache
  // dtype, layout or algorithm changes.
  TensorView state(int param, const std::string& name);
  std::vector<std::string> state_names(int param) const;
  int64_t param_step(int param) const;  // steps taken by this parameter (AdamW bias correction)
  void set_param_step(int param, int64_t step);

  // Synchronises the backend to read device-side counters.
  EngineStats stats();
  Backend& backend();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace distmuon
