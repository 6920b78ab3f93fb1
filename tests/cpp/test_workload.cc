#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "distmuon/error.h"
#include "distmuon/plan.h"
#include "distmuon/types.h"
#include "distmuon/workload.h"

namespace distmuon {

TEST(Workload, BuiltinsLoadWithTheirPublishedSizes) {
  auto names = builtin_workloads();
  EXPECT_EQ(names.size(), 6u);
  Workload w = load_workload("gpt2-small");
  EXPECT_EQ(w.muon_params(), 84934656);
  EXPECT_EQ(w.adamw_params(), 39505152);
  EXPECT_EQ(w.muon_matrices(), 48);
  Workload q = load_workload("qwen2.5-7b");
  EXPECT_EQ(q.muon.size(), 7u);
  Workload q8 = q.first_layers(8);
  EXPECT_EQ(q8.muon_matrices(), 56);
  // DeepSeek-V2-Lite: 15.7B parameters; 26 MoE layers of 3 x 64 routed experts each.
  Workload ds = load_workload("deepseek-v2-lite");
  EXPECT_EQ(ds.muon_params() + ds.adamw_params(), 15706484224);
  EXPECT_EQ(ds.muon_matrices(), 27 * 4 + 3 + 26 * (1 + 3 * 64 + 3));
  // ResNet-18 as torchvision builds it: 11,689,512 parameters, 20 convolution kernels.
  Workload rn = load_workload("resnet18");
  EXPECT_EQ(rn.muon_params() + rn.adamw_params(), 11689512);
  EXPECT_EQ(rn.muon_matrices(), 20);
}

// Model order: layer by layer, the entries with one tensor count sharing their layers; another
// count is a group of its own (pi0: the vision tower's 27 layers apart from the 18 the language
// model and the action expert share). An FSDP2 unit is a layer's tensors.
TEST(Workload, TensorsComeLayerByLayerInModelOrder) {
  Workload w;
  w.name = "two-towers";
  w.muon = {{"q", {8, 8}, 3}, {"vision", {4, 4}, 2}, {"k", {8, 8}, 3}, {"experts", {4, 8, 8}, 2}};
  std::vector<std::string> names;
  std::vector<int64_t> layers;
  for (const Workload::TensorRef& t : w.muon_tensors()) {
    names.push_back(w.muon[static_cast<size_t>(t.entry)].name + "." + std::to_string(t.index));
    layers.push_back(t.layer);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"q.0", "k.0", "q.1", "k.1", "q.2", "k.2", "vision.0",
                                             "experts.0", "vision.1", "experts.1"}));
  EXPECT_EQ(layers, (std::vector<int64_t>{0, 0, 1, 1, 2, 2, 3, 3, 4, 4}));
  EXPECT_EQ(w.fsdp_units(), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}}));
  // The planner's matrices in the same order (a stack's matrices all in its tensor's layer).
  const std::vector<PlanMatrix> mats = plan_matrices(w);
  ASSERT_EQ(mats.size(), 6u + 2 + 2 * 4);
  EXPECT_EQ(mats[5].name, "k.2");
  EXPECT_EQ(mats[6].name, "vision.0");
  EXPECT_EQ(mats[7].name, "experts.0.0");
  EXPECT_EQ(mats[7].layer, 3);
  EXPECT_EQ(mats[15].name, "experts.1.3");
  EXPECT_EQ(mats[15].layer, 4);
  // pi0: 18 shared layers, the vision tower's 27, and its six single projections as one more
  // layer (count 1).
  EXPECT_EQ(load_workload("pi0").fsdp_units().size(), 18u + 27u + 1u);
}

TEST(Workload, ClearErrors) {
  EXPECT_THROW(load_workload("no-such-model"), Error);
  EXPECT_THROW(parse_workload("{not json", "x"), Error);
  EXPECT_THROW(parse_workload(R"({"name": "x", "muon": []})", "x"), Error);
  EXPECT_THROW(parse_workload(R"({"name": "x", "muon": [{"name": "a", "shape": [4, 0]}]})", "x"), Error);
  EXPECT_THROW(load_workload("gpt2-small").first_layers(0), Error);
}

std::string one_matrix(const std::string& shape, int64_t count = 1) {
  return R"({"name": "big", "muon": [{"name": "w", "shape": )" + shape +
         R"(, "count": )" + std::to_string(count) + "}]}";
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

// What a file lacks or gets wrong is named (a missing key used to surface as nlohmann's
// "[json.exception.out_of_range.403]"; negative layers and wrong totals passed).
TEST(Workload, MissingKeysNegativeLayersAndWrongTotalsAreNamed) {
  EXPECT_EQ(
      message_of([] { parse_workload(R"({"muon": [{"name": "a", "shape": [4, 4]}]})", "f"); }),
      "workload f: the file has no 'name'");
  EXPECT_EQ(
      message_of([] { parse_workload(R"({"name": "x", "muon": [{"shape": [4, 4]}]})", "f"); }),
      "workload f: an entry of 'muon' has no 'name'");
  EXPECT_EQ(message_of([] { parse_workload(R"({"name": "x", "muon": [{"name": "a"}]})", "f"); }),
            "workload f: entry 'a' has no 'shape'");
  EXPECT_EQ(message_of([] {
              parse_workload(
                  R"({"name": "x", "layers": -1, "muon": [{"name": "a", "shape": [4, 4]}]})", "f");
            }),
            "workload f: 'layers' must be >= 0 (got -1)");
  EXPECT_EQ(message_of([] {
              parse_workload(
                  R"({"name": "x", "muon_params": 15, "muon": [{"name": "a", "shape": [4, 4]}]})",
                  "f");
            }),
            "workload f: 'muon_params' says 15 but its entries hold 16 parameters");
  EXPECT_EQ(
      parse_workload(
          R"({"name": "x", "muon_params": 16, "muon": [{"name": "a", "shape": [4, 4]}]})", "f")
          .muon_params(),
      16);
}

// Shapes whose element count leaves int64 were accepted and wrapped (to a negative count, or to
// 0 for 2^32 x 2^32); every size derived from a workload is checked now.
TEST(Workload, SizesThatOverflowAreRefused) {
  EXPECT_EQ(message_of([] { parse_workload(one_matrix("[3037000500, 3037000500]"), "f.json"); }),
            "workload f.json is too large: workload entry 'w': shape [3037000500, 3037000500] "
            "has more elements than a 64-bit size holds");
  EXPECT_THROW(parse_workload(one_matrix("[4294967296, 4294967296]"), "x"), Error);
  // The element count fits but the count of tensors, or the bytes in f64, do not.
  EXPECT_THROW(parse_workload(one_matrix("[1000000, 1000000]", 10000000), "x"), Error);
  EXPECT_THROW(parse_workload(one_matrix("[2000000000, 2000000000]"), "x"), Error);
  // A large but representable workload parses; the planner bounds its matrix count.
  Workload w = parse_workload(one_matrix("[100000, 100000]", 1 << 21), "x");
  EXPECT_EQ(w.muon_matrices(), 1 << 21);
  EXPECT_EQ(message_of([&] { plan_matrices(w, 4); }),
            "workload big has 2097152 Muon matrices; the planner handles at most 1048576");
  // The C++ API checks as the parser does, whoever built the entry.
  WorkloadEntry e{"hand", {int64_t{1} << 32, int64_t{1} << 32}, 1};
  EXPECT_THROW(e.numel(), Error);
}

TEST(CheckedSizes, ProductsSumsAndBytes) {
  EXPECT_EQ(checked_mul(3, 5, "x"), 15);
  EXPECT_EQ(checked_numel({}, "x"), 1);
  EXPECT_EQ(checked_numel({2, 3, 4}, "x"), 24);
  EXPECT_EQ(checked_bytes(int64_t{1} << 60, DType::kBF16, "x"), int64_t{1} << 61);
  EXPECT_THROW(checked_bytes(int64_t{1} << 61, DType::kF64, "x"), Error);
  EXPECT_THROW(checked_mul(-1, 5, "x"), Error);
  EXPECT_THROW(checked_add(INT64_MAX, 1, "x"), Error);
  EXPECT_THROW(checked_numel({3037000500, 3037000500}, "x"), Error);
  EXPECT_THROW(checked_numel({4, -1}, "x"), Error);
}

TEST(Workload, UnknownKeysAreNamed) {
  // A file of another format used to read as "no Muon matrices"; a typo was ignored.
  EXPECT_NE(message_of([] { parse_workload(R"({"name": "x", "tensors": []})", "x"); })
                .find("unknown key 'tensors'"),
            std::string::npos);
  EXPECT_NE(message_of([] {
              parse_workload(R"({"name": "x", "muon": [{"name": "a", "shape": [4, 4], "dtype": "bf16"}]})",
                             "x");
            }).find("entry 'a' has an unknown key 'dtype'"),
            std::string::npos);
}

}  // namespace distmuon
