// The layout of the dedicated runtime over a model, fixed once by a front end before training
// (distmuon.torch.dedicate): which layer ("unit") each dedicated matrix belongs to, and the
// buckets that make one broadcast per owner per layer. The front keeps a flat buffer per bucket
// and makes each parameter a view into it at its offset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/hsdp.h"
#include "distmuon/types.h"

namespace distmuon {

// The unit of a parameter: the module of its layer, the planner's layer rule on its module path
// ("transformer.h.3.mlp.c_fc.weight" -> "transformer.h.3"), else its owning module
// ("proj.weight" -> "proj", "w" -> "", the root).
std::string dedicated_unit(const std::string& param_name);

struct DedicatedMatrix {
  std::string name;  // parameter name (the model's named_parameters())
  int64_t numel = 0;
  DType dtype = DType::kF32;
  int owner = 0;  // member of the dedicated world (an HsdpWorld) that owns it
};

struct DedicatedLayout {
  // A layer: the module whose forward needs the matrices (broadcast before it runs).
  struct Unit {
    std::string module;         // its path in the model ("" is the root)
    std::vector<int> matrices;  // in the order given
    std::vector<int> buckets;
  };
  // The matrices of one unit owned by one member, of one dtype: one flat buffer, one broadcast.
  struct Bucket {
    int unit = 0;
    int owner = 0;
    DType dtype = DType::kF32;
    std::vector<int> matrices;  // in the order given, packed in this order
    int64_t numel = 0;
    // This member holds the buffer between steps: the owner, and in HSDP the members at the
    // owner's shard position in the other replicas (they relay it inside their shard group).
    bool kept = false;
  };
  std::vector<Unit> units;              // in forward order (the order of `modules`)
  std::vector<Bucket> buckets;          // unit by unit; inside one by (owner, dtype name)
  std::vector<int> unit_of, bucket_of;  // per matrix
  std::vector<int64_t> offset;          // per matrix: elements into its bucket's buffer
};

// `modules`: every module path of the model in forward order (named_modules()); each matrix's
// unit must be among them. Throws on an owner outside the world or a world that is not
// replicate x shard.
DedicatedLayout dedicated_layout(const std::vector<DedicatedMatrix>& matrices,
                                 const std::vector<std::string>& modules,
                                 const HsdpWorld& world);

}  // namespace distmuon
