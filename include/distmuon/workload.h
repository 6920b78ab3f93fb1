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
};

// Loads a built-in workload by name (see builtin_workloads()) or a JSON file of the same format
// by path. Throws with the list of names when neither exists or the file is malformed.
Workload load_workload(const std::string& name_or_path);
Workload parse_workload(const std::string& json_text, const std::string& origin);
std::vector<std::string> builtin_workloads();

}  // namespace distmuon
