#include <gtest/gtest.h>

#include "distmuon/error.h"
#include "distmuon/workload.h"

namespace distmuon {

TEST(Workload, BuiltinsLoadWithTheirPublishedSizes) {
  auto names = builtin_workloads();
  EXPECT_EQ(names.size(), 4u);
  Workload w = load_workload("gpt2-small");
  EXPECT_EQ(w.muon_params(), 84934656);
  EXPECT_EQ(w.adamw_params(), 39505152);
  EXPECT_EQ(w.muon_matrices(), 48);
  Workload q = load_workload("qwen2.5-7b");
  EXPECT_EQ(q.muon.size(), 7u);
  Workload q8 = q.first_layers(8);
  EXPECT_EQ(q8.muon_matrices(), 56);
}

TEST(Workload, ClearErrors) {
  EXPECT_THROW(load_workload("no-such-model"), Error);
  EXPECT_THROW(parse_workload("{not json", "x"), Error);
  EXPECT_THROW(parse_workload(R"({"name": "x", "muon": []})", "x"), Error);
  EXPECT_THROW(parse_workload(R"({"name": "x", "muon": [{"name": "a", "shape": [4, 0]}]})", "x"), Error);
  EXPECT_THROW(load_workload("gpt2-small").first_layers(0), Error);
}

}  // namespace distmuon
