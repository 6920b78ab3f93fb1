// Workloads: the matrix shapes of real models that every benchmark and plan uses
// (workloads/*.json, embedded into the library at build time).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace distmuon {

struct WorkloadEntry {
  std::string name;
  std::vector<int64_t> shape;  // one tensor's shape
  int64_t count = 1;           // how many such tensors (typically one per layer)
  int64_t numel() const;
};

struct Workload {
  std::string name;
  std::string source;
  int64_t layers = 0;
  std::vector<WorkloadEntry> muon;   // matrices orthogonalized by Muon
  std::vector<WorkloadEntry> adamw;  // everything else (AdamW)

  int64_t muon_params() const;
  int64_t adamw_params() const;
  int64_t muon_matrices() const;
  // Keeps at most `k` tensors of every entry (the first k layers), for short runs.
  Workload first_layers(int64_t k) const;
  // The Muon tensors in model order, as a model registers its parameters: layer by layer (every
  // entry's tensor of layer 0, then of layer 1, ...), where the k-th tensor of every entry with
  // the same count belongs to layer k of that count group, the groups in the order of their
  // first entry. Qwen: every entry has one tensor per decoder layer; Pi0: the language model and
  // the action expert share their 18 layers, the vision tower has its own 27, the six single
  // projections form one more. The planner spreads a layer's matrices over owners; the
  // benchmarks register the tensors in this order and shard a layer as one FSDP2 unit.
  struct TensorRef {
    int entry = 0;       // index into `muon`
    int64_t index = 0;   // which of the entry's `count` tensors
    int64_t layer = 0;   // its layer
  };
  std::vector<TensorRef> muon_tensors() const;
  // The tensors (indices into muon_tensors()) of each layer, in order: the units an FSDP2 model
  // sharded block by block (fully_shard per layer) reduce-scatters and all-gathers with one
  // collective each. What distmuon-bench's FSDP2 emulation and the simulator issue.
  std::vector<std::vector<int>> fsdp_units() const;
};

// Loads a built-in workload by name (see builtin_workloads()) or a JSON file of the same format
// by path. Throws with the list of names when neither exists or the file is malformed.
Workload load_workload(const std::string& name_or_path);
Workload parse_workload(const std::string& json_text, const std::string& origin);
std::vector<std::string> builtin_workloads();

}  // namespace distmuon
