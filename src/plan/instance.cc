// Input validation, the matrices of a workload, and the aggregated instance the solvers use.
#include "instance.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "distmuon/error.h"
#include "distmuon/optimizer.h"
#include "distmuon/workload.h"

namespace distmuon {

void Topology::validate() const {
  DM_CHECK(world_size >= 1, "planner: world size must be >= 1 (got ", world_size, ")");
  DM_CHECK(gpus_per_node >= 1, "planner: GPUs per node must be >= 1 (got ", gpus_per_node, ")");
  DM_CHECK(world_size <= gpus_per_node || world_size % gpus_per_node == 0, "planner: world size ",
           world_size, " is not a multiple of ", gpus_per_node, " GPUs per node");
  DM_CHECK(replicate >= 1 && world_size % replicate == 0, "planner: HSDP replicate degree ",
           replicate, " does not divide the world size ", world_size);
}

std::vector<PlanMatrix> plan_matrices(const Workload& w, int64_t elem_bytes) {
  DM_CHECK(elem_bytes >= 1, "planner: element size must be >= 1 byte (got ", elem_bytes, ")");
  // One entry per matrix: a bound keeps a mistyped count from exhausting memory.
  constexpr int64_t kMaxMatrices = int64_t{1} << 20;
  DM_CHECK(w.muon_matrices() <= kMaxMatrices, "workload ", w.name, " has ", w.muon_matrices(),
           " Muon matrices; the planner handles at most ", kMaxMatrices);
  std::vector<PlanMatrix> out;
  for (const Workload::TensorRef& t : w.muon_tensors()) {
    const WorkloadEntry& e = w.muon[static_cast<size_t>(t.entry)];
    // As the engine sees the parameter: 3-D stacks are several matrices, 4-D convolution kernels
    // one (o, i*kh*kw) matrix.
    const MatrixLayout layout = matrix_layout(e.name, e.shape);
    const bool stacked = e.shape.size() == 3;
    for (int64_t j = 0; j < layout.count; ++j) {
      PlanMatrix m;
      m.name = e.name + "." + std::to_string(t.index) + (stacked ? "." + std::to_string(j) : "");
      m.rows = layout.rows;
      m.cols = layout.cols;
      m.layer = t.layer;
      m.elem_bytes = elem_bytes;
      out.push_back(std::move(m));
    }
  }
  return out;
}

std::vector<ShapeCount> shape_counts(const std::vector<PlanMatrix>& matrices) {
  std::vector<ShapeCount> out;
  std::map<std::pair<int64_t, int64_t>, size_t> at;
  for (const auto& m : matrices) {
    auto key = std::make_pair(m.rows, m.cols);
    auto it = at.find(key);
    if (it == at.end()) {
      at[key] = out.size();
      out.push_back({m.rows, m.cols, 1});
    } else {
      out[it->second].count += 1;
    }
  }
  return out;
}

namespace plan_detail {

std::string ShapeClass::shape() const { return std::to_string(m) + "x" + std::to_string(n); }

double Instance::load(const std::vector<int>& c) const {
  double t = 0;
  for (size_t s = 0; s < classes.size(); ++s) t += classes[s].load[c[s]];
  return t;
}

double Instance::comm(const std::vector<int>& c) const {
  double b = 0;
  for (size_t s = 0; s < classes.size(); ++s) b += c[s] * classes[s].comm_bytes;
  return b;
}

double Instance::memory(const std::vector<int>& c) const {
  // Batches run one after another, so only the largest batch's working memory is live at once.
  double state = 0, work = 0;
  for (size_t s = 0; s < classes.size(); ++s) {
    state += c[s] * classes[s].state_bytes;
    work = std::max(work, classes[s].work_bytes[c[s]]);
  }
  return state + work;
}

bool Instance::fits(const std::vector<int>& c) const {
  return opts.memory_cap_bytes <= 0 || memory(c) <= opts.memory_cap_bytes;
}

double Instance::makespan(const Counts& counts) const {
  double t = 0;
  for (const auto& c : counts) t = std::max(t, load(c));
  return t;
}

double Instance::trivial_lower_bound() const {
  double total = 0, single = 0;
  for (const auto& cl : classes) {
    // load[] is subadditive (a split is one of the options), so running a class in one place
    // is never dearer than running it in parts: the total is a valid bound on the summed load.
    total += cl.load[cl.count()];
    // An owner holding any matrix of the class pays at least its cheapest non-empty load.
    single = std::max(single, *std::min_element(cl.load.begin() + 1, cl.load.end()));
  }
  return std::max(total / owners(), single);
}

Instance build_instance(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                        const CostTable& costs, const PlanOptions& opts) {
  DM_CHECK(!matrices.empty(), "planner: no Muon matrices to plan (empty workload)");
  topo.validate();
  DM_CHECK(opts.max_batch >= 0, "planner: max batch must be >= 0 (got ", opts.max_batch, ")");
  DM_CHECK(opts.memory_cap_bytes >= 0, "planner: memory cap must be >= 0 (got ",
           opts.memory_cap_bytes, ")");
  Instance inst;
  inst.matrices = &matrices;
  inst.topo = topo;
  inst.opts = opts;

  std::map<std::tuple<int64_t, int64_t, int64_t>, int> class_of;
  for (size_t i = 0; i < matrices.size(); ++i) {
    const PlanMatrix& pm = matrices[i];
    DM_CHECK(pm.rows >= 1 && pm.cols >= 1, "planner: matrix '", pm.name, "' has shape ", pm.rows,
             "x", pm.cols);
    DM_CHECK(pm.elem_bytes >= 1, "planner: matrix '", pm.name, "' has element size ",
             pm.elem_bytes);
    auto key =
        std::make_tuple(std::min(pm.rows, pm.cols), std::max(pm.rows, pm.cols), pm.elem_bytes);
    auto it = class_of.find(key);
    if (it == class_of.end()) {
      it = class_of.emplace(key, static_cast<int>(inst.classes.size())).first;
      ShapeClass c;
      std::tie(c.m, c.n, c.elem_bytes) = key;
      inst.classes.push_back(c);
    }
    inst.classes[it->second].members.push_back(static_cast<int>(i));
  }

  for (ShapeClass& c : inst.classes) {
    const PlanMatrix& first = matrices[c.members.front()];
    DM_CHECK(costs.find(c.m, c.n) != nullptr, "planner: the cost table (", costs.describe(),
             ") has no entry for shape ", c.m, "x", c.n, " (matrix '", first.name, "')");
    const int count = c.count();
    const int cap =
        opts.max_batch > 0 ? static_cast<int>(std::min<int64_t>(opts.max_batch, count)) : count;
    const OrthoConfig cfg = resolve(opts.ortho, c.m, c.n);
    const double iter_bytes = static_cast<double>(dtype_size(iteration_dtype(cfg)));
    std::vector<double> batch(cap + 1, 0.0), batch_work(cap + 1, 0.0);
    for (int b = 1; b <= cap; ++b) {
      batch[b] = costs.batch_seconds(c.m, c.n, b);
      batch_work[b] = static_cast<double>(Orthogonalizer::workspace_bytes(cfg, b, c.m, c.n)) +
                      iter_bytes * b * c.m * c.n;
    }
    // Best split of k matrices into batches (costs need not be concave: measured points may
    // show a batch of 8 slower than two of 4). Ties keep the larger first batch.
    c.load.assign(count + 1, 0.0);
    c.first_batch.assign(count + 1, 0);
    c.work_bytes.assign(count + 1, 0.0);
    for (int k = 1; k <= count; ++k) {
      double best = -1;
      int best_b = 0;
      for (int b = std::min(k, cap); b >= 1; --b) {
        const double t = batch[b] + c.load[k - b];
        if (best < 0 || t < best * (1 - 1e-12)) {
          best = t;
          best_b = b;
        }
      }
      c.load[k] = best;
      c.first_batch[k] = best_b;
      c.work_bytes[k] = std::max(batch_work[best_b], c.work_bytes[k - best_b]);
    }
    const double numel = static_cast<double>(c.m) * c.n;
    c.comm_bytes = numel * static_cast<double>(opts.comm_elem_bytes);
    c.state_bytes = numel * static_cast<double>(c.elem_bytes);
    if (opts.memory_cap_bytes > 0) {
      const double need = c.state_bytes + c.work_bytes[1];
      DM_CHECK(need <= opts.memory_cap_bytes, "planner: memory cap of ",
               opts.memory_cap_bytes / (1 << 20), " MiB per owner cannot hold matrix '", first.name,
               "' (", first.rows, "x", first.cols, "): it needs ", need / (1 << 20),
               " MiB (momentum ", c.state_bytes / (1 << 20), " MiB + working memory ",
               c.work_bytes[1] / (1 << 20), " MiB)");
    }
  }
  // Most expensive classes first: LPT's order, and the order realise() spreads layers in.
  std::stable_sort(inst.classes.begin(), inst.classes.end(),
                   [](const ShapeClass& a, const ShapeClass& b) {
                     if (a.load[1] != b.load[1]) return a.load[1] > b.load[1];
                     return std::tie(a.m, a.n, a.elem_bytes) < std::tie(b.m, b.n, b.elem_bytes);
                   });
  inst.class_of.assign(matrices.size(), -1);
  for (size_t s = 0; s < inst.classes.size(); ++s)
    for (int i : inst.classes[s].members) inst.class_of[i] = static_cast<int>(s);
  return inst;
}

}  // namespace plan_detail
}  // namespace distmuon
