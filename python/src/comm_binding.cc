// distmuon._C.Communicator: the engine's communicators as opaque Python objects.
//
// - make_nccl_communicator(): the engine's NCCL communicator (CUDA memory), from a unique id that
//   rank 0 made with nccl_unique_id() and shared out of band (distmuon.torch uses
//   torch.distributed for that).
// - PythonCommunicator: a Communicator whose collectives are methods of a Python object
//   (distmuon.torch runs them over a torch.distributed process group, e.g. gloo on the CPU).
//   This file only turns raw buffers into DLPack arrays and Python errors into distmuon errors;
//   the collectives themselves are the Python object's. The operations of one grouped() reach
//   Python as one call (its batch()) and complete together: one test or wait in Python for all.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "distmuon/comm.h"
#include "distmuon/error.h"
#include "comm_binding.h"
#include "dlpack.h"

namespace distmuon::py {

nb::dict comm_stats_dict(const CommStats& s) {
  nb::dict d;
  d["ops"] = s.ops;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  return d;
}

namespace {

nb::dlpack::dtype comm_dlpack_dtype(CommType t) {
  using Code = nb::dlpack::dtype_code;
  switch (t) {
    case CommType::kF64: return {static_cast<uint8_t>(Code::Float), 64, 1};
    case CommType::kF32: return {static_cast<uint8_t>(Code::Float), 32, 1};
    case CommType::kF16: return {static_cast<uint8_t>(Code::Float), 16, 1};
    case CommType::kBF16: return {static_cast<uint8_t>(Code::Bfloat), 16, 1};
    case CommType::kI32: return {static_cast<uint8_t>(Code::Int), 32, 1};
    case CommType::kI64: return {static_cast<uint8_t>(Code::Int), 64, 1};
    case CommType::kU8: return {static_cast<uint8_t>(Code::UInt), 8, 1};
  }
  DM_FAIL("unknown communicator element type");
}

// A Python exception in one line: its type and the first line of its message, without the
// traceback that nanobind's what() appends (the error reaches the user inside another one).
std::string one_line(nb::python_error& e) {
  const std::string type = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
  std::string msg = nb::cast<std::string>(nb::str(e.value()));
  msg = msg.substr(0, msg.find('\n'));
  return msg.empty() ? type : type + ": " + msg;
}

// Runs a Python call with the GIL held; a Python exception becomes a distmuon error (a
// TimeoutError when the Python side says so, with the message of every communicator's timeouts
// when the call waited timeout_s), so that the engine's own error handling applies.
template <typename F>
auto call_python(const std::string& what, F&& f, double timeout_s = 0) {
  std::string message;
  bool timeout = false;
  {
    nb::gil_scoped_acquire gil;
    try {
      return f();
    } catch (nb::python_error& e) {
      timeout = e.matches(PyExc_TimeoutError);
      message = one_line(e);
    }
  }
  if (timeout && timeout_s > 0)
    throw TimeoutError(comm_timeout_message(what, timeout_s), __FILE__, __LINE__);
  if (timeout) throw TimeoutError(what + ": " + message, __FILE__, __LINE__);
  DM_FAIL(what, ": ", message);
}

// What a PythonCommunicator launched: one operation, or every operation of one grouped() (one
// Python call for all, completing together). `pending`: the Python object the launch returned
// (None: complete), with test() -> bool and wait(timeout_s) -> None.
struct PyLaunch {
  nb::object pending;
  bool launched = false, done = false;
  std::string failed;  // why the launch failed (its operations raise it)
  ~PyLaunch() {
    nb::gil_scoped_acquire gil;  // releases the Python object (and the arrays it holds)
    pending.reset();
  }
};

// One operation of a PythonCommunicator; those of one group share their launch, so that one
// test() or wait() reaching Python completes them all.
class PyRequest final : public CommRequest {
 public:
  PyRequest(std::shared_ptr<PyLaunch> launch, std::string what)
      : launch_(std::move(launch)), what_(std::move(what)) {}
  bool test() override {
    check_launched();
    if (launch_->done) return true;
    launch_->done =
        call_python(what_, [&] { return nb::cast<bool>(launch_->pending.attr("test")()); });
    return launch_->done;
  }
  void wait(double timeout_s) override {
    check_launched();
    if (launch_->done) return;
    // What is left of the deadline from the issue; at least 1 ms, because a zero duration means
    // "no limit" to torch's Work.wait.
    const double left = std::max(seconds_left(timeout_s), 1e-3);
    call_python(
        what_,
        [&] {
          launch_->pending.attr("wait")(left);
          return 0;
        },
        timeout_s);
    launch_->done = true;
  }
  bool launched() const override { return launch_->launched || !launch_->failed.empty(); }

 private:
  void check_launched() const {
    if (!launch_->failed.empty()) DM_FAIL(what_, ": its group failed to launch: ", launch_->failed);
    DM_CHECK(launch_->launched, what_, ": waited on inside grouped(), before the group was launched");
  }
  std::shared_ptr<PyLaunch> launch_;
  std::string what_;
};

// A DLPack array over `count` elements of a communicator buffer, or None when there are none.
nb::object buffer(const void* p, int64_t count, CommType t, const Device& dev) {
  if (count == 0 || p == nullptr) return nb::none();
  const size_t shape[1] = {static_cast<size_t>(count)};
  // The engine owns the memory; the capsule only satisfies nanobind's export (no deleter).
  nb::capsule owner(p, [](void*) noexcept {});
  return nb::cast(Array(const_cast<void*>(p), 1, shape, owner, nullptr, comm_dlpack_dtype(t),
                        to_dlpack_device(dev), dev.index));
}

// Elements spanned by counts/displacements (the extent of the buffer they address).
int64_t extent(std::span<const int64_t> counts, std::span<const int64_t> displs) {
  int64_t e = 0;
  for (size_t q = 0; q < counts.size(); ++q)
    if (counts[q] > 0) e = std::max(e, displs[q] + counts[q]);
  return e;
}

std::vector<int64_t> vec(std::span<const int64_t> s) { return {s.begin(), s.end()}; }

// Binds a communicator that follows a stream to `stream`, where one is given.
void bind_to(PyComm& c, std::optional<uintptr_t> stream) {
  if (stream) c.comm->bind_stream(reinterpret_cast<void*>(*stream));
}

CommType array_comm_type(const Array& a) {
  if (!is_contiguous(a)) throw nb::value_error("communicator buffers must be contiguous");
  const nb::dlpack::dtype t = a.dtype();
  for (CommType c : {CommType::kF64, CommType::kF32, CommType::kBF16, CommType::kF16,
                     CommType::kI32, CommType::kI64, CommType::kU8}) {
    const nb::dlpack::dtype d = comm_dlpack_dtype(c);
    if (d.code == t.code && d.bits == t.bits && d.lanes == t.lanes) return c;
  }
  throw nb::value_error("unsupported dtype for a communicator buffer");
}

class PythonCommunicator final : public Communicator {
 public:
  PythonCommunicator(nb::object impl, int rank, int size, std::string name,
                     std::vector<int> world_ranks, Device device)
      : Communicator(rank, size, std::move(name), std::move(world_ranks)),
        impl_(std::move(impl)),
        device_(device) {}
  ~PythonCommunicator() override {
    nb::gil_scoped_acquire gil;
    calls_.reset();
    impl_.reset();
  }
  Device device() const override { return device_; }

 protected:
  std::unique_ptr<CommRequest> do_all_reduce(const void* send, void* recv, int64_t count,
                                             CommType type, ReduceOp op) override {
    return issue("all_reduce", [&] {
      return nb::make_tuple(buf(send, count, type), buf(recv, count, type), static_cast<int>(type),
                            static_cast<int>(op));
    });
  }
  std::unique_ptr<CommRequest> do_reduce(const void* send, void* recv, int64_t count, CommType type,
                                         ReduceOp op, int root) override {
    return issue("reduce", [&] {
      return nb::make_tuple(buf(send, count, type),
                            rank() == root ? buf(recv, count, type) : nb::none(),
                            static_cast<int>(type), static_cast<int>(op), root);
    });
  }
  std::unique_ptr<CommRequest> do_broadcast(void* buf_, int64_t count, CommType type,
                                            int root) override {
    return issue("broadcast", [&] {
      return nb::make_tuple(buf(buf_, count, type), static_cast<int>(type), root);
    });
  }
  std::unique_ptr<CommRequest> do_all_gather_v(const void* send, int64_t send_count, void* recv,
                                               std::span<const int64_t> recv_counts,
                                               std::span<const int64_t> recv_displs,
                                               CommType type) override {
    return issue("all_gather_v", [&] {
      return nb::make_tuple(buf(send, send_count, type),
                            buf(recv, extent(recv_counts, recv_displs), type), vec(recv_counts),
                            vec(recv_displs), static_cast<int>(type));
    });
  }
  std::unique_ptr<CommRequest> do_all_to_all_v(const void* send,
                                               std::span<const int64_t> send_counts,
                                               std::span<const int64_t> send_displs, void* recv,
                                               std::span<const int64_t> recv_counts,
                                               std::span<const int64_t> recv_displs,
                                               CommType type) override {
    return issue("all_to_all_v", [&] {
      return nb::make_tuple(buf(send, extent(send_counts, send_displs), type), vec(send_counts),
                            vec(send_displs), buf(recv, extent(recv_counts, recv_displs), type),
                            vec(recv_counts), vec(recv_displs), static_cast<int>(type));
    });
  }
  std::unique_ptr<CommRequest> do_barrier() override {
    return issue("barrier", [&] { return nb::make_tuple(); });
  }
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    // The Python side agrees on the groups and returns (impl, rank, size, name, world_ranks),
    // or None where this member takes no part.
    nb::gil_scoped_acquire gil;  // first: `r` is released under it
    nb::object r = call_python(describe("split"), [&] { return impl_.attr("split")(color, key); });
    if (r.is_none()) return nullptr;
    nb::tuple t = nb::cast<nb::tuple>(r);
    return std::make_unique<PythonCommunicator>(
        nb::borrow<nb::object>(t[0]), nb::cast<int>(t[1]), nb::cast<int>(t[2]),
        nb::cast<std::string>(t[3]), nb::cast<std::vector<int>>(t[4]), device_);
  }

 private:
  nb::object buf(const void* p, int64_t count, CommType t) const {
    return buffer(p, count, t, device_);
  }
  // Calls impl.<op>(*args()) now, or inside grouped() records (op, args) for the group's one
  // call at its end.
  template <typename F>
  std::unique_ptr<CommRequest> issue(const char* op, F&& args) {
    const std::string what = describe(op);
    if (group_) {
      call_python(what, [&] {
        nb::cast<nb::list>(calls_).append(nb::make_tuple(op, args()));
        return 0;
      });
      return std::make_unique<PyRequest>(group_, what);
    }
    auto launch = std::make_shared<PyLaunch>();
    launch->pending = call_python(what, [&] { return nb::object(impl_.attr(op)(*args())); });
    launch->launched = true;
    launch->done = launch->pending.is_none();
    return std::make_unique<PyRequest>(std::move(launch), what);
  }

  // grouped(): the operations go to Python as one call, impl.batch([(op, args), ...]), which
  // issues them in order and returns one object for them all (TorchCollectives.batch).
  void do_group_begin() override {
    nb::gil_scoped_acquire gil;
    group_ = std::make_shared<PyLaunch>();
    calls_ = nb::list();
  }
  void do_group_end() override {
    std::shared_ptr<PyLaunch> launch = std::exchange(group_, nullptr);
    nb::gil_scoped_acquire gil;
    nb::object calls = std::exchange(calls_, nb::object());
    if (nb::len(calls) == 0) {
      launch->launched = launch->done = true;
      return;
    }
    try {
      launch->pending = call_python(describe("batch"), [&] { return impl_.attr("batch")(calls); });
    } catch (const std::exception& e) {
      launch->failed = e.what();
      throw;
    }
    launch->launched = true;
    launch->done = launch->pending.is_none();
  }
  bool launches_groups() const override { return true; }

  nb::object impl_;
  Device device_;
  std::shared_ptr<PyLaunch> group_;  // while grouped() issues: the group's launch
  nb::object calls_;                 // and its (op, args) so far
};

}  // namespace

void bind_comm(nb::module_& m) {
  auto comm = nb::class_<PyComm>(m, "Communicator",
                     "A distmuon communicator (NCCL, or collectives run by a Python object).")
      .def_prop_ro("rank", [](PyComm& c) { return c.comm->rank(); })
      .def_prop_ro("size", [](PyComm& c) { return c.comm->size(); })
      .def_prop_ro("name", [](PyComm& c) { return c.comm->name(); })
      .def_prop_ro("world_ranks", [](PyComm& c) { return c.comm->world_ranks(); })
      .def_prop_ro("timeout_s", [](PyComm& c) { return c.comm->timeout_s(); })
      .def("set_timeout", [](PyComm& c, double s) { c.comm->set_timeout(s); }, nb::arg("seconds"))
      .def(
          "stats",
          [](PyComm& c) { return comm_stats_dict(c.comm->stats()); },
          "Bytes moved and operations issued by this member so far.");

  // A few collectives on DLPack arrays, for the front (checkpoint state and tensor-parallel
  // parameters move on the engine's communicator), tests and measurements (the engine calls the
  // C++ methods directly). Each waits for completion. `stream` (a cudaStream_t as an integer):
  // a communicator that follows a stream (NCCL) is bound to it first, so that the operation
  // starts after the work issued there (the arrays' producers) and its results are visible to
  // the work issued there afterwards.
  comm.def(
          "all_reduce",
          [](PyComm& c, Array a, int op, std::optional<uintptr_t> stream) {
            const CommType t = array_comm_type(a);
            void* p = a.data();
            const int64_t n = static_cast<int64_t>(a.size());
            nb::gil_scoped_release release;
            bind_to(c, stream);
            c.comm->all_reduce(p, p, n, t, static_cast<ReduceOp>(op)).wait();
          },
          nb::arg("array"), nb::arg("op") = 0, nb::arg("stream").none() = nb::none(),
          "In place; op 0 sum, 1 max, 2 min.")
      .def(
          "broadcast",
          [](PyComm& c, Array a, int root, std::optional<uintptr_t> stream) {
            const CommType t = array_comm_type(a);
            void* p = a.data();
            const int64_t n = static_cast<int64_t>(a.size());
            nb::gil_scoped_release release;
            bind_to(c, stream);
            c.comm->broadcast(p, n, t, root).wait();
          },
          nb::arg("array"), nb::arg("root"), nb::arg("stream").none() = nb::none())
      .def(
          "all_to_all_v",
          [](PyComm& c, Array send, const std::vector<int64_t>& send_counts,
             const std::vector<int64_t>& send_displs, Array recv,
             const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
             std::optional<uintptr_t> stream) {
            const CommType t = array_comm_type(send);
            if (array_comm_type(recv) != t)
              throw nb::value_error("all_to_all_v: send and recv have different dtypes");
            if (send_counts.size() != send_displs.size() ||
                recv_counts.size() != recv_displs.size() ||
                extent(send_counts, send_displs) > static_cast<int64_t>(send.size()) ||
                extent(recv_counts, recv_displs) > static_cast<int64_t>(recv.size()))
              throw nb::value_error("all_to_all_v: counts and displacements outside the arrays");
            const void* sp = send.data();
            void* rp = recv.data();
            nb::gil_scoped_release release;
            bind_to(c, stream);
            c.comm->all_to_all_v(sp, send_counts, send_displs, rp, recv_counts, recv_displs, t)
                .wait();
          },
          nb::arg("send"), nb::arg("send_counts"), nb::arg("send_displs"), nb::arg("recv"),
          nb::arg("recv_counts"), nb::arg("recv_displs"), nb::arg("stream").none() = nb::none())
      .def("barrier", [](PyComm& c) {
        nb::gil_scoped_release release;
        c.comm->barrier().wait();
      });

  m.def("mpi_available", &mpi_available, "True when this build has the MPI communicator.");
  m.def(
      "make_mpi_world",
      []() {
        nb::gil_scoped_release release;
        return PyComm{make_mpi_world()};
      },
      "A communicator over MPI_COMM_WORLD (host memory; the process must run under mpirun).");

  m.def(
      "make_python_communicator",
      [](nb::object impl, int rank, int size, const std::string& name,
         const std::vector<int>& world_ranks, const std::string& device, int device_index) {
        const Device dev{device == "cuda" ? DeviceKind::kCUDA : DeviceKind::kCPU, device_index};
        return PyComm{std::make_unique<PythonCommunicator>(std::move(impl), rank, size, name,
                                                           world_ranks, dev)};
      },
      nb::arg("impl"), nb::arg("rank"), nb::arg("size"), nb::arg("name"), nb::arg("world_ranks"),
      nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      "A communicator whose collectives are methods of `impl` (all_reduce, reduce, broadcast, "
      "all_gather_v, all_to_all_v, barrier, split), called with DLPack arrays (None for empty "
      "buffers) and member ranks; each returns None (done) or an object with test() and "
      "wait(timeout_s). A TimeoutError raised there becomes distmuon's TimeoutError.");

  m.def("nccl_available", &nccl_available, "True when this build has the NCCL communicator.");
  m.def(
      "wait_for_nccl_teardowns",
      [](double timeout_s) {
        nb::gil_scoped_release release;
        return wait_for_nccl_teardowns(timeout_s);
      },
      nb::arg("timeout_s"),
      "Waits up to timeout_s for the NCCL communicators let go to be torn down (their device "
      "memory back); True when none is left in flight.");
  m.def(
      "nccl_teardowns",
      []() {
        const NcclTeardowns t = nccl_teardowns();
        return nb::make_tuple(t.in_flight, t.destroyed, t.aborted);
      },
      "The NCCL communicators this process has let go: (still being torn down, destroyed, "
      "aborted).");
  m.def(
      "nccl_unique_id",
      []() {
        const NcclUniqueId id = nccl_unique_id();
        return nb::bytes(id.bytes, sizeof(id.bytes));
      },
      "A new NCCL unique id (rank 0 makes it and shares it with the others).");
  m.def(
      "make_nccl_communicator",
      [](nb::bytes id, int rank, int size, uintptr_t stream) {
        NcclUniqueId uid;
        if (id.size() != sizeof(uid.bytes))
          throw nb::value_error("an NCCL unique id has 128 bytes");
        std::memcpy(uid.bytes, id.c_str(), sizeof(uid.bytes));
        nb::gil_scoped_release release;  // initialisation waits for the other members
        return PyComm{make_nccl_communicator(uid, rank, size, reinterpret_cast<void*>(stream))};
      },
      nb::arg("unique_id"), nb::arg("rank"), nb::arg("size"), nb::arg("stream") = 0,
      "The engine's NCCL communicator on the current CUDA device, ordered with the cudaStream_t "
      "`stream` (an integer handle; 0: the legacy default stream).");
}

}  // namespace distmuon::py
