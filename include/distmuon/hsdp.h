// The HSDP world, described once: `size` = replicate x shard members; member r * shard + s is at
// replica r, shard position s (FSDP and flat worlds: replicate 1, the shard group is the world).
// The engine's distributed state, the dedicated layout and transfers, and the PyTorch front
// (distmuon._C.HsdpWorld) read member -> (replica, position) from here, and split a world
// communicator into its shard and replica groups with HsdpComms.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distmuon/comm.h"

namespace distmuon {

struct HsdpWorld {
  int size = 1;
  int replicate = 1;
  int member = 0;  // this rank's

  // Throws (the message starts with `what`) unless size is replicate equal shard groups and
  // member is one of them.
  void check(const std::string& what) const;
  int shard() const { return size / replicate; }
  int replica_of(int m) const { return m / shard(); }
  int position_of(int m) const { return m % shard(); }
  int at(int replica, int position) const { return replica * shard() + position; }
  int my_replica() const { return replica_of(member); }
  int my_position() const { return position_of(member); }
  // The members of replica r's shard group, and of position s's replica group, in group order.
  std::vector<int> shard_group(int r) const;
  std::vector<int> replica_group(int s) const;
};

// A world communicator's HSDP groups: `shard` (the world itself when replicate == 1) and
// `replica` (nullptr when replicate == 1). Making them is collective over the world (the same
// order on every member); the world must outlive them.
class HsdpComms {
 public:
  HsdpComms() = default;
  HsdpComms(Communicator* world, const HsdpWorld& w);
  Communicator* shard() const { return shard_; }
  Communicator* replica() const { return replica_.get(); }
  // What the shard group (when split) and the replica group moved.
  CommStats split_stats() const;

 private:
  std::unique_ptr<Communicator> shard_owned_, replica_;
  Communicator* shard_ = nullptr;
};

}  // namespace distmuon
