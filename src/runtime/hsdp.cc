// The HSDP world and its communicators (distmuon/hsdp.h).
#include "distmuon/hsdp.h"

#include "distmuon/error.h"

namespace distmuon {

void HsdpWorld::check(const std::string& what) const {
  DM_CHECK(size >= 1 && replicate >= 1 && size % replicate == 0, what, ": a world of ", size,
           " members is not ", replicate, " replicas of equal shard groups");
  DM_CHECK(member >= 0 && member < size, what, ": member ", member, " is outside the world of ",
           size);
}

std::vector<int> HsdpWorld::shard_group(int r) const {
  std::vector<int> out;
  for (int s = 0; s < shard(); ++s) out.push_back(at(r, s));
  return out;
}

std::vector<int> HsdpWorld::replica_group(int s) const {
  std::vector<int> out;
  for (int r = 0; r < replicate; ++r) out.push_back(at(r, s));
  return out;
}

HsdpComms::HsdpComms(Communicator* world, const HsdpWorld& w) : shard_(world) {
  if (world == nullptr || w.replicate == 1) return;
  shard_owned_ = world->split(w.my_replica(), w.my_position());
  replica_ = world->split(w.my_position(), w.my_replica());
  shard_ = shard_owned_.get();
}

CommStats HsdpComms::split_stats() const {
  CommStats s;
  if (shard_owned_) s += shard_owned_->stats();
  if (replica_) s += replica_->stats();
  return s;
}

}  // namespace distmuon
