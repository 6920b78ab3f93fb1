// distmuon._C's dedicated runtime: its layout (units and buckets) and its transfers, whose
// memory stays the front's (a Python object lends bucket buffers and gradients as DLPack
// capsules; the transfers hold them while a collective uses them).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm_binding.h"
#include "distmuon/dedicated.h"
#include "distmuon/dedicated_transfers.h"
#include "distmuon/error.h"
#include "distmuon/hsdp.h"
#include "dlpack.h"

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

// DedicatedMemory over a Python object with bucket(b) and grads(b, present) (each a DLPack
// capsule of a contiguous tensor), release_bucket(b), drop_grad(j) and has_grad(j) -> bool.
// Called with the GIL held (every stage is entered from Python).
class PyMemory final : public DedicatedMemory {
 public:
  explicit PyMemory(nb::object impl) : impl_(std::move(impl)) {}
  Region bucket(int b) override { return region(impl_.attr("bucket")(b)); }
  void release_bucket(int b) override { impl_.attr("release_bucket")(b); }
  Region grads(int b, std::span<const int> present) override {
    return region(impl_.attr("grads")(b, std::vector<int>(present.begin(), present.end())));
  }
  void drop_grad(int j) override { impl_.attr("drop_grad")(j); }
  bool has_grad(int j) override { return nb::cast<bool>(impl_.attr("has_grad")(j)); }

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
};

// The memory adapter outlives the transfers (declared first, destroyed last).
struct PyTransfers {
  PyMemory memory;
  std::unique_ptr<DedicatedTransfers> transfers;
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
             uintptr_t stream) {
            new (self) PyTransfers{PyMemory(std::move(memory)), nullptr};
            try {
              self->transfers = std::make_unique<DedicatedTransfers>(
                  dedicated_matrices(names, numels, dtypes, owners), layout, hsdp,
                  world ? world->comm.get() : nullptr, control ? control->comm.get() : nullptr,
                  self->memory, stream_of(stream));
            } catch (...) {
              self->~PyTransfers();  // nanobind destroys only a constructed instance
              throw;
            }
          },
          nb::arg("layout"), nb::arg("names"), nb::arg("numels"), nb::arg("dtypes"),
          nb::arg("owners"), nb::arg("hsdp"), nb::arg("world").none(), nb::arg("control").none(),
          nb::arg("memory"), nb::arg("stream"), nb::keep_alive<1, 8>(), nb::keep_alive<1, 9>(),
          "`hsdp`: the dedicated world (HsdpWorld); `world`: its communicator (None for one "
          "member; split here in HSDP); `control`: a host communicator over it for the vote; "
          "`memory`: lends the buffers (bucket, release_bucket, grads, drop_grad, has_grad); "
          "`stream`: orders the split's collectives.")
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
          "used", [](PyTransfers& t, int b) { t.transfers->used(b); }, nb::arg("bucket"))
      .def(
          "release_unit", [](PyTransfers& t, int u) { t.transfers->release_unit(u); },
          nb::arg("unit"))
      .def(
          "release_all",
          [](PyTransfers& t, uintptr_t s) { t.transfers->release_all(stream_of(s)); },
          nb::arg("stream"))
      .def(
          "grad_ready",
          [](PyTransfers& t, int j, uintptr_t s) {
            return t.transfers->grad_ready(j, stream_of(s));
          },
          nb::arg("matrix"), nb::arg("stream"),
          "Returns, per unit whose matrices owned here all landed now, those matrices.")
      .def(
          "wait",
          [](PyTransfers& t, const std::vector<int>& js, uintptr_t s) {
            t.transfers->wait(js, stream_of(s));
          },
          nb::arg("matrices"), nb::arg("stream"))
      .def(
          "prepared", [](PyTransfers& t, const std::vector<int>& js) { t.transfers->prepared(js); },
          nb::arg("matrices"))
      .def(
          "finish", [](PyTransfers& t, uintptr_t s) { return t.transfers->finish(stream_of(s)); },
          nb::arg("stream"),
          "Returns the matrices owned here whose gradients are sums to divide by the world size.")
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
          [](const PyTransfers& t) {
            const CommStats s = t.transfers->traffic();
            nb::dict d;
            d["ops"] = s.ops;
            d["bytes_sent"] = s.bytes_sent;
            d["bytes_received"] = s.bytes_received;
            return d;
          },
          "What the dedicated traffic's communicators (shard group, replica group) moved so far: "
          "{'ops', 'bytes_sent', 'bytes_received'}.");
}

}  // namespace distmuon::py
