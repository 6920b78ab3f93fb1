// The registry of an Engine: its parameter groups and its parameters as registered
// (engine.cc), with the layout of each Muon parameter's matrices and the optimizer state of the
// parameters that keep it beside their weights. Fixed once setup() has run.
#pragma once

#include <string>
#include <vector>

#include "distmuon/engine_types.h"

namespace distmuon {

struct Param {
  ParamSpec spec;
  int64_t numel = 0;        // of the full parameter
  int64_t dim0 = 0;         // full size of dim 0
  int64_t inner = 0;        // elements per dim-0 row
  int64_t local_rows = 0;   // dim-0 rows held by this rank (dim0 when not sharded)
  int64_t local_numel = 0;  // elements held by this rank
  MatrixLayout layout;      // Muon only
  Buffer state0;            // momentum (single process, gather) or exp_avg (AdamW)
  Buffer state1;            // exp_avg_sq (AdamW)
  DType state0_dtype = DType::kF32;
  int64_t step =
      0;  // Muon: steps with a gradient (see StepRecord::matrix_skips); AdamW: step_counts
  int64_t first_matrix = 0;   // Muon: index of its first matrix among all Muon matrices
  std::vector<int> matrices;  // distributed Muon: indices into DistState::mats, one per slice
  int adam_index = -1;        // AdamW: position among the AdamW parameters
  int cls = -1;               // single process, Muon: its shape class
  int64_t first_member = 0;   // single process, Muon: its first slice's position in the class
};

struct Registry {
  std::vector<GroupOptions> groups;
  std::vector<Param> params;
  std::vector<std::string> registration_errors;  // distributed: reported by setup() everywhere

  bool is_muon(const Param& p) const { return groups[p.spec.group].kind == ParamKind::kMuon; }
  // "param", or "param[slice]" for a matrix of a 3D parameter.
  std::string slice_name(int param, int64_t slice) const;
};

}  // namespace distmuon
