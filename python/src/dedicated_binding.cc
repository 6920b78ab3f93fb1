// distmuon._C's dedicated runtime: its layout (units and buckets) and its transfers, whose
// memory stays the front's (a Python object lends bucket buffers and gradients as DLPack
// capsules; the transfers hold them while a collective uses them).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm_binding.h"
#include "distmuon/dedicated.h"
#include "distmuon/dedicated_transfers.h"
#include "distmuon/error.h"
#include "distmuon/hsdp.h"
#include "dlpack.h"
#ifdef DISTMUON_HAVE_CUDA
#include "distmuon/cuda_backend.h"
#endif

namespace distmuon::py {

namespace {

[[noreturn]] void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

std::vector<DedicatedMatrix> dedicated_matrices(const std::vector<std::string>& names,
                                                const std::vector<int64_t>& numels,
                                                const std::vector<DType>& dtypes,
                                                const std::vector<int>& owners) {
  if (numels.size() != names.size() || dtypes.size() != names.size() ||
      owners.size() != names.size())
    value_error("dedicated: one numel, dtype and owner per name");
  std::vector<DedicatedMatrix> mats;
  for (size_t k = 0; k < names.size(); ++k)
    mats.push_back({names[k], numels[k], dtypes[k], owners[k]});
  return mats;
}

// DedicatedMemory over the front's memory (distmuon.torch's _dedicated_layout.Memory), lent to
// the transfers rather than asked for on backward's path:
// - gradients: the front copies each gradient into its bucket's flat gradient buffer before it
//   reports it ready, lending that buffer with the bucket's first one (grad_ready's `lend`), so
//   the bucket's reduction takes the buffer as it is; non-owners drop their gradients as they
//   lend them. Only what finish() sends otherwise (a matrix without a gradient here, a gradient
//   accumulated without reporting it, several backwards) is asked of the front's
//   grads(b, present), and has_grad(j) for the vote;
// - weights: asked of the front's bucket(b) when a forward stage needs a bucket (it materialises
//   it); the buckets the transfers release are collected and returned by the stage that released
//   them, for the front to free.
// Called with the GIL held (every stage is entered from Python).
class PyMemory final : public DedicatedMemory {
 public:
  PyMemory(nb::object impl, const DedicatedLayout& layout)
      : impl_(std::move(impl)),
        buckets_(layout.buckets.size()),
        bucket_of_(layout.bucket_of),
        lent_(layout.buckets.size()),
        adopted_(layout.bucket_of.size(), 0) {
    for (size_t b = 0; b < layout.buckets.size(); ++b) buckets_[b] = layout.buckets[b].matrices;
  }
  Region bucket(int b) override { return region(impl_.attr("bucket")(b)); }
  void release_bucket(int b) override { released_.push_back(b); }
  Region grads(int b, std::span<const int> present) override {
    Region lent = std::exchange(lent_[b], {});
    const bool whole = lent.data != nullptr && std::all_of(present.begin(), present.end(),
                                                           [&](int j) { return adopted_[j] != 0; });
    for (int j : buckets_[b]) adopted_[j] = 0;
    if (whole) {
      sent_.push_back(b);
      return lent;
    }
    return region(impl_.attr("grads")(b, std::vector<int>(present.begin(), present.end())));
  }
  void drop_grad(int) override {}  // dropped by the front as it lent it
  bool has_grad(int j) override { return nb::cast<bool>(impl_.attr("has_grad")(j)); }

  // The front copied matrix j's gradient into its bucket's lent buffer; `flat` (a DLPack capsule,
  // or None) is a buffer lent now, the bucket's for its next reduction.
  void lend(int j, nb::handle flat) {
    if (j < 0 || j >= static_cast<int>(bucket_of_.size()))
      value_error("dedicated: no matrix " + std::to_string(j));
    const int b = bucket_of_[j];
    if (!flat.is_none()) {
      lent_[b] = region(nb::borrow<nb::object>(flat));
      for (int k : buckets_[b]) adopted_[k] = 0;
    }
    if (lent_[b].data == nullptr)
      value_error("dedicated: matrix " + std::to_string(j) + "'s gradient is reported without " +
                  "a lent buffer of its bucket");
    adopted_[j] = 1;
  }
  // What the last stage released (weights the front may free) and sent of what was lent.
  std::vector<int> take_released() { return std::exchange(released_, {}); }
  std::vector<int> take_sent() { return std::exchange(sent_, {}); }
  // finish() reset the transfers: nothing stays lent.
  void reset() {
    std::fill(lent_.begin(), lent_.end(), Region{});
    std::fill(adopted_.begin(), adopted_.end(), 0);
    sent_.clear();
  }

 private:
  static Region region(nb::object capsule) {
    auto array = std::shared_ptr<Array>(new Array(nb::cast<Array>(capsule)), [](Array* a) {
      nb::gil_scoped_acquire gil;  // the last reference may go where the GIL is not held
      delete a;
    });
    if (!is_contiguous(*array))
      value_error("dedicated: a buffer the transfers move is not contiguous");
    return {array->data(), array};
  }
  nb::object impl_;
  std::vector<std::vector<int>> buckets_;  // the matrices of each bucket
  std::vector<int> bucket_of_;
  std::vector<Region> lent_;   // per bucket: the gradient buffer lent for its next reduction
  std::vector<char> adopted_;  // per matrix: its gradient is in its bucket's lent buffer
  std::vector<int> released_, sent_;
};

// The backend the owners' sums are divided on (the mean; DedicatedTransfers' `mean`): a CPU
// backend, or on CUDA one of the smallest workspace, since it only scales buffers; none for one
// member. Its CUDA stream is each dividing stage's, set by on_stream().
std::unique_ptr<Backend> mean_backend(const std::string& device, int index, int members) {
  if (members == 1) return nullptr;
  if (device == "cpu") return make_backend("cpu");
#ifdef DISTMUON_HAVE_CUDA
  if (device == "cuda") return std::make_unique<CudaBackend>(CudaBackendOptions{index, 1u << 20});
#endif
  (void)index;
  value_error("dedicated: no backend for device '" + device + "' in this build");
}

void on_stream(Backend* b, uintptr_t stream) {
#ifdef DISTMUON_HAVE_CUDA
  if (auto* cuda = dynamic_cast<CudaBackend*>(b))
    cuda->set_stream(reinterpret_cast<cudaStream_t>(stream));
#else
  (void)b;
  (void)stream;
#endif
}

// The backend and the memory adapter outlive the transfers (declared first, destroyed last).
struct PyTransfers {
  std::unique_ptr<Backend> mean;
  PyMemory memory;
  std::unique_ptr<DedicatedTransfers> transfers;
  // Puts the mean's backend on `stream` for a stage that may divide.
  void divide_on(uintptr_t stream) {
    if (mean) on_stream(mean.get(), stream);
  }
};

void* stream_of(uintptr_t s) { return reinterpret_cast<void*>(s); }

}  // namespace

void bind_dedicated(nb::module_& m) {
  nb::class_<HsdpWorld>(m, "HsdpWorld",
                        "The HSDP world (distmuon/hsdp.h): size = replicate x shard members, "
                        "member r * shard + s at replica r, shard position s.")
      .def(
          "__init__",
          [](HsdpWorld* self, int size, int replicate, int member) {
            const HsdpWorld w{size, replicate, member};
            try {
              w.check("HsdpWorld");
            } catch (const Error& e) {
              value_error(e.what());
            }
            new (self) HsdpWorld(w);
          },
          nb::arg("size"), nb::arg("replicate"), nb::arg("member"))
      .def_ro("size", &HsdpWorld::size)
      .def_ro("replicate", &HsdpWorld::replicate)
      .def_ro("member", &HsdpWorld::member)
      .def_prop_ro("shard", &HsdpWorld::shard)
      .def(
          "coords",
          [](const HsdpWorld& w, int q) { return std::pair(w.replica_of(q), w.position_of(q)); },
          nb::arg("member"), "(replica, shard position) of a member.")
      .def("at", &HsdpWorld::at, nb::arg("replica"), nb::arg("position"),
           "The member at (replica, shard position).")
      .def("shard_group", &HsdpWorld::shard_group, nb::arg("replica"),
           "The members of a replica's shard group, in group order.")
      .def("replica_group", &HsdpWorld::replica_group, nb::arg("position"),
           "The members of a shard position's replica group, in group order.");
  m.def("dedicated_unit", &dedicated_unit, nb::arg("name"),
        "The unit (layer module) of a dedicated parameter: the planner's layer rule on its module "
        "path ('transformer.h.3.mlp.c_fc.weight' -> 'transformer.h.3'), else its module.");
  nb::class_<DedicatedLayout::Unit>(m, "DedicatedUnit")
      .def_ro("module", &DedicatedLayout::Unit::module)
      .def_ro("matrices", &DedicatedLayout::Unit::matrices)
      .def_ro("buckets", &DedicatedLayout::Unit::buckets);
  nb::class_<DedicatedLayout::Bucket>(m, "DedicatedBucket")
      .def_ro("unit", &DedicatedLayout::Bucket::unit)
      .def_ro("owner", &DedicatedLayout::Bucket::owner)
      .def_ro("dtype", &DedicatedLayout::Bucket::dtype)
      .def_ro("matrices", &DedicatedLayout::Bucket::matrices)
      .def_ro("numel", &DedicatedLayout::Bucket::numel)
      .def_ro("kept", &DedicatedLayout::Bucket::kept);
  nb::class_<DedicatedLayout>(m, "DedicatedLayout")
      .def_ro("units", &DedicatedLayout::units)
      .def_ro("buckets", &DedicatedLayout::buckets)
      .def_ro("unit_of", &DedicatedLayout::unit_of)
      .def_ro("bucket_of", &DedicatedLayout::bucket_of)
      .def_ro("offset", &DedicatedLayout::offset);
  m.def(
      "dedicated_layout",
      [](const std::vector<std::string>& names, const std::vector<int64_t>& numels,
         const std::vector<DType>& dtypes, const std::vector<int>& owners,
         const std::vector<std::string>& modules, const HsdpWorld& world) {
        return dedicated_layout(dedicated_matrices(names, numels, dtypes, owners), modules, world);
      },
      nb::arg("names"), nb::arg("numels"), nb::arg("dtypes"), nb::arg("owners"), nb::arg("modules"),
      nb::arg("world"),
      "The dedicated runtime's units (layers, in the forward order of `modules`) and buckets "
      "(per unit, owner and dtype: one flat buffer, one broadcast) of these matrices, owners "
      "given as members of a world of replicate x shard.");

  // Stages take `stream`: torch's current cudaStream_t as an integer (0 on the CPU).
  nb::class_<PyTransfers>(m, "DedicatedTransfers",
                          "The dedicated runtime's transfers (distmuon/dedicated_transfers.h).")
      .def(
          "__init__",
          [](PyTransfers* self, const DedicatedLayout& layout,
             const std::vector<std::string>& names, const std::vector<int64_t>& numels,
             const std::vector<DType>& dtypes, const std::vector<int>& owners,
             const HsdpWorld& hsdp, PyComm* world, PyComm* control, nb::object memory,
             uintptr_t stream, const std::string& device, int device_index) {
            std::unique_ptr<Backend> mean = mean_backend(device, device_index, hsdp.size);
            new (self) PyTransfers{std::move(mean), PyMemory(std::move(memory), layout), nullptr};
            try {
              self->transfers = std::make_unique<DedicatedTransfers>(
                  dedicated_matrices(names, numels, dtypes, owners), layout, hsdp,
                  world ? world->comm.get() : nullptr, control ? control->comm.get() : nullptr,
                  self->memory, stream_of(stream), self->mean.get());
            } catch (...) {
              self->~PyTransfers();  // nanobind destroys only a constructed instance
              throw;
            }
          },
          nb::arg("layout"), nb::arg("names"), nb::arg("numels"), nb::arg("dtypes"),
          nb::arg("owners"), nb::arg("hsdp"), nb::arg("world").none(), nb::arg("control").none(),
          nb::arg("memory"), nb::arg("stream"), nb::arg("device"), nb::arg("device_index"),
          nb::keep_alive<1, 8>(), nb::keep_alive<1, 9>(),
          "`hsdp`: the dedicated world (HsdpWorld); `world`: its communicator (None for one "
          "member; split here in HSDP); `control`: a host communicator over it for the vote; "
          "`memory`: the front's memory (bucket, grads, has_grad: what a stage asks for off "
          "backward's path); `stream`: orders the split's collectives; `device`, "
          "`device_index`: where the buffers live (the owners' means are computed there).")
      .def("begin_forward", [](PyTransfers& t) { t.transfers->begin_forward(); })
      .def(
          "issue",
          [](PyTransfers& t, int unit, uintptr_t s) { t.transfers->issue(unit, stream_of(s)); },
          nb::arg("unit"), nb::arg("stream"))
      .def(
          "wait_unit",
          [](PyTransfers& t, int unit, uintptr_t s) { t.transfers->wait_unit(unit, stream_of(s)); },
          nb::arg("unit"), nb::arg("stream"))
      .def(
          "used",
          [](PyTransfers& t, int b) {
            t.transfers->used(b);
            return !t.memory.take_released().empty();
          },
          nb::arg("bucket"), "True when the bucket's weights may go now (the front frees them).")
      .def(
          "release_unit",
          [](PyTransfers& t, int u) {
            t.transfers->release_unit(u);
            return t.memory.take_released();
          },
          nb::arg("unit"), "The buckets whose weights may go now (the front frees them).")
      .def(
          "release_all",
          [](PyTransfers& t, uintptr_t s) {
            t.transfers->release_all(stream_of(s));
            return t.memory.take_released();
          },
          nb::arg("stream"), "The buckets whose weights may go now (the front frees them).")
      .def(
          "grad_ready",
          [](PyTransfers& t, int j, uintptr_t s, nb::handle lend) {
            t.memory.lend(j, lend);
            std::vector<std::vector<int>> landed = t.transfers->grad_ready(j, stream_of(s));
            return std::pair(std::move(landed), t.memory.take_sent());
          },
          nb::arg("matrix"), nb::arg("stream"), nb::arg("lend").none() = nb::none(),
          "Matrix j's gradient is in its bucket's lent buffer (`lend`: the bucket's buffer, lent "
          "with its first gradient). Returns (per unit whose matrices owned here all landed now, "
          "those matrices; the buckets whose lent buffers went into a reduction).")
      .def(
          "wait",
          [](PyTransfers& t, const std::vector<int>& js, uintptr_t s) {
            t.divide_on(s);
            t.transfers->wait(js, stream_of(s));
          },
          nb::arg("matrices"), nb::arg("stream"),
          "The matrices' reductions complete for work on `stream`; those owned here hold their "
          "means.")
      .def(
          "prepared", [](PyTransfers& t, const std::vector<int>& js) { t.transfers->prepared(js); },
          nb::arg("matrices"))
      .def(
          "finish",
          [](PyTransfers& t, uintptr_t s) {
            struct Reset {  // the transfers reset, raising or not: nothing stays lent
              PyMemory& memory;
              ~Reset() { memory.reset(); }
            } reset{t.memory};
            t.divide_on(s);
            return t.transfers->finish(stream_of(s));
          },
          nb::arg("stream"),
          "Completes the step's reductions; the owners' gradients hold their means. Returns the "
          "matrices owned here it divided.")
      .def(
          "publish", [](PyTransfers& t, uintptr_t s) { t.transfers->publish(stream_of(s)); },
          nb::arg("stream"))
      .def(
          "wait_published",
          [](PyTransfers& t, uintptr_t s) { t.transfers->wait_published(stream_of(s)); },
          nb::arg("stream"))
      .def(
          "broadcast_bucket",
          [](PyTransfers& t, int b, Array buf, uintptr_t s) {
            if (!is_contiguous(buf)) value_error("broadcast_bucket: the buffer is not contiguous");
            const DedicatedLayout& layout = t.transfers->layout();
            if (b < 0 || b >= static_cast<int>(layout.buckets.size()) ||
                static_cast<int64_t>(buf.size()) != layout.buckets[b].numel)
              value_error("broadcast_bucket: no bucket " + std::to_string(b) + " of that size");
            t.transfers->broadcast_bucket(b, buf.data(), stream_of(s));
          },
          nb::arg("bucket"), nb::arg("buffer"), nb::arg("stream"))
      .def(
          "traffic",
          [](const PyTransfers& t) { return comm_stats_dict(t.transfers->traffic()); },
          "What the dedicated traffic's communicators (shard group, replica group) moved so far: "
          "{'ops', 'bytes_sent', 'bytes_received'}.");
}

}  // namespace distmuon::py
