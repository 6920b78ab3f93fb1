// The dedicated runtime's layout (distmuon/dedicated.h): the unit of a parameter is the
// planner's layer, units follow the model's forward order, and buckets group a unit's matrices
// by owner and dtype, kept by the owner and (HSDP) by the owner's shard position elsewhere.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "distmuon/dedicated.h"
#include "distmuon/error.h"
#include "plan/runtime_plan.h"

namespace distmuon {
namespace {

TEST(DedicatedLayout, UnitIsThePlannersLayerElseTheModule) {
  EXPECT_EQ(dedicated_unit("transformer.h.3.mlp.c_fc.weight"), "transformer.h.3");
  EXPECT_EQ(dedicated_unit("blocks.0.qkv.weight"), "blocks.0");
  EXPECT_EQ(dedicated_unit("gate.weight"), "gate");
  EXPECT_EQ(dedicated_unit("w"), "");                 // the root module
  EXPECT_EQ(dedicated_unit("h.3"), "h");              // a ParameterList entry: its module is h
  EXPECT_EQ(dedicated_unit("enc.b12.w"), "enc.b12");  // digits inside a component: no layer
  // Matrices the planner puts in one layer share a unit, and those of two layers do not.
  std::map<std::string, int64_t> ids;
  const std::vector<std::string> names = {"transformer.h.3.mlp.c_fc.weight",
                                          "transformer.h.3.attn.c_attn.weight",
                                          "transformer.h.4.attn.c_attn.weight"};
  for (const std::string& a : names)
    for (const std::string& b : names)
      EXPECT_EQ(layer_of(a, ids) == layer_of(b, ids), dedicated_unit(a) == dedicated_unit(b));
}

const std::vector<std::string> kModules = {"",         "embed", "h",      "h.0", "h.0.up",
                                           "h.0.attn", "h.1",   "h.1.up", "head"};

TEST(DedicatedLayout, UnitsInForwardOrderAndBucketsPerOwnerAndDtype) {
  // Registration order differs from the forward order: head first.
  const std::vector<DedicatedMatrix> mats = {
      {"head.weight", 12, DType::kF32, 0},   {"h.1.up.weight", 6, DType::kF32, 1},
      {"h.0.up.weight", 10, DType::kF32, 1}, {"h.0.attn.weight", 4, DType::kF32, 0},
      {"h.0.attn.bias2", 3, DType::kF32, 1}, {"h.0.up.scale", 5, DType::kBF16, 1},
  };
  const DedicatedLayout l = dedicated_layout(mats, kModules, {2, 1, 1});
  ASSERT_EQ(l.units.size(), 3u);
  EXPECT_EQ(l.units[0].module, "h.0");
  EXPECT_EQ(l.units[0].matrices, (std::vector<int>{2, 3, 4, 5}));
  EXPECT_EQ(l.units[1].module, "h.1");
  EXPECT_EQ(l.units[2].module, "head");
  EXPECT_EQ(l.unit_of, (std::vector<int>{2, 1, 0, 0, 0, 0}));

  // Unit h.0: owner 0's f32, then owner 1's bf16 before its f32 (by dtype name).
  ASSERT_EQ(l.units[0].buckets, (std::vector<int>{0, 1, 2}));
  ASSERT_EQ(l.buckets.size(), 5u);
  EXPECT_EQ(l.buckets[0].owner, 0);
  EXPECT_EQ(l.buckets[0].matrices, (std::vector<int>{3}));
  EXPECT_EQ(l.buckets[1].dtype, DType::kBF16);
  EXPECT_EQ(l.buckets[1].matrices, (std::vector<int>{5}));
  EXPECT_EQ(l.buckets[2].dtype, DType::kF32);
  EXPECT_EQ(l.buckets[2].matrices, (std::vector<int>{2, 4}));
  EXPECT_EQ(l.buckets[2].numel, 13);
  EXPECT_EQ(l.offset[2], 0);
  EXPECT_EQ(l.offset[4], 10);  // packed in the order given
  EXPECT_EQ(l.bucket_of, (std::vector<int>{4, 3, 2, 0, 2, 1}));
  // Member 1 keeps the buckets it owns, no other.
  for (const auto& b : l.buckets) EXPECT_EQ(b.kept, b.owner == 1);
}

TEST(DedicatedLayout, HsdpRelaysKeepTheBucketsOfTheirShardPosition) {
  // 2 replicas x 2 shard positions: member 3 is at replica 1, position 1.
  const std::vector<DedicatedMatrix> mats = {{"h.0.up.weight", 4, DType::kF32, 0},
                                             {"h.0.attn.weight", 4, DType::kF32, 1},
                                             {"h.1.up.weight", 4, DType::kF32, 2},
                                             {"h.1.attn.weight", 4, DType::kF32, 3}};
  const DedicatedLayout l = dedicated_layout(mats, kModules, {4, 2, 3});
  ASSERT_EQ(l.buckets.size(), 4u);
  for (const auto& b : l.buckets) EXPECT_EQ(b.kept, b.owner % 2 == 1) << b.owner;
}

TEST(DedicatedLayout, RejectsOwnersOutsideTheWorldAndUnitsThatAreNoModule) {
  EXPECT_THROW(dedicated_layout({{"h.0.up.weight", 4, DType::kF32, 2}}, kModules, {2, 1, 0}),
               Error);
  EXPECT_THROW(dedicated_layout({{"blocks.0.up.weight", 4, DType::kF32, 0}}, kModules, {2, 1, 0}),
               Error);
  EXPECT_THROW(dedicated_layout({{"h.0.up.weight", 4, DType::kF32, 0}}, kModules, {3, 2, 0}),
               Error);  // 3 members are not 2 equal replicas
  EXPECT_THROW(dedicated_layout({{"h.0.up.weight", 4, DType::kF32, 0}}, kModules, {2, 1, 2}),
               Error);  // this member is not in the world
}

TEST(HsdpWorld, PlacesMemberRTimesShardPlusSAtReplicaRPositionS) {
  const HsdpWorld w{6, 2, 4};  // 2 replicas x 3 positions
  EXPECT_EQ(w.shard(), 3);
  EXPECT_EQ(w.my_replica(), 1);
  EXPECT_EQ(w.my_position(), 1);
  EXPECT_EQ(w.at(1, 2), 5);
  EXPECT_EQ(w.shard_group(1), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(w.replica_group(2), (std::vector<int>{2, 5}));
  const HsdpWorld flat{3, 1, 2};
  EXPECT_EQ(flat.shard_group(0), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(flat.my_position(), 2);
  EXPECT_NO_THROW(w.check("test"));
  EXPECT_THROW((HsdpWorld{3, 2, 0}.check("test")), Error);
  EXPECT_THROW((HsdpWorld{2, 1, 2}.check("test")), Error);
}

}  // namespace
}  // namespace distmuon
