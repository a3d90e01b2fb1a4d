// Binds Collectives (c10d, every build) and NcclCommunicator (CUDA + NCCL builds only).
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/errors.h"
#include "dist/collectives.h"
#include "dist/weight_sync.h"

#ifdef SKYRL_TX_WITH_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace py = pybind11;

namespace skyrl_tx::bindings {

void bind_dist(py::module_& m) {
  using dist::Collectives;
  py::class_<dist::CollectiveStats>(m, "CollectiveStats")
      .def_readonly("calls", &dist::CollectiveStats::calls)
      .def_readonly("bytes", &dist::CollectiveStats::bytes)
      .def_readonly("seconds", &dist::CollectiveStats::seconds)
      .def("__repr__", [](const dist::CollectiveStats& s) {
        return str_cat("CollectiveStats(calls=", s.calls, ", bytes=", s.bytes, ", seconds=", s.seconds, ")");
      });
  py::class_<Collectives, std::shared_ptr<Collectives>>(m, "Collectives")
      .def(py::init([](py::object group) {
             // torch.distributed's ProcessGroup object → the C++ c10d::ProcessGroup it wraps (a new reference).
             auto* raw = group.cast<c10d::ProcessGroup*>();
             // Destroyed without the GIL: the last reference may be the process group's, whose destructor joins
             // Gloo's worker threads, and a worker finishing a collective on a tensor Python has seen needs the
             // GIL to drop it (a deadlock, seen as a rank that never exits, when the GIL is held here).
             return std::shared_ptr<Collectives>(
                 new Collectives(c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(raw)), [](Collectives* c) {
                   if (PyGILState_Check()) {
                     py::gil_scoped_release no_gil;
                     delete c;
                   } else {
                     delete c;
                   }
                 });
           }),
           py::arg("process_group"))
      .def_property_readonly("rank", &Collectives::rank)
      .def_property_readonly("world_size", &Collectives::world_size)
      .def("all_reduce_sum", &Collectives::all_reduce_sum, py::arg("tensor"), py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_sum_flat", [](Collectives& c, std::vector<at::Tensor> tensors) { c.all_reduce_sum_flat(tensors); },
           py::arg("tensors"), py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_sum", &Collectives::reduce_scatter_sum, py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Collectives::all_gather, py::arg("shard"), py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Collectives::broadcast, py::arg("tensor"), py::arg("root"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &Collectives::all_to_all, py::arg("input"), py::arg("send"), py::arg("recv"),
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Collectives::barrier, py::call_guard<py::gil_scoped_release>())
      .def("stats", &Collectives::stats)
      .def("reset_stats", &Collectives::reset_stats);
  py::class_<dist::WeightSyncStats>(m, "WeightSyncStats")
      .def_readonly("version", &dist::WeightSyncStats::version)
      .def_readonly("tensors", &dist::WeightSyncStats::tensors)
      .def_readonly("bytes", &dist::WeightSyncStats::bytes)
      .def_readonly("buckets", &dist::WeightSyncStats::buckets)
      .def_readonly("seconds", &dist::WeightSyncStats::seconds);
  py::class_<dist::WeightSync, std::shared_ptr<dist::WeightSync>>(m, "WeightSync")
      .def(py::init<std::shared_ptr<Collectives>, int, int64_t>(), py::arg("group"), py::arg("root"),
           py::arg("bucket_bytes"))
      .def("sync",
           [](dist::WeightSync& w, int64_t version, const std::map<std::string, at::Tensor>& tensors,
              const std::string& device) { return w.sync(version, tensors, c10::Device(device)); },
           py::arg("version"), py::arg("tensors"), py::arg("device") = "cpu", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("last", &dist::WeightSync::last)
      .def_property_readonly("is_root", &dist::WeightSync::is_root);
  m.def("split_rows_by_tokens", &dist::split_rows_by_tokens, py::arg("row_tokens"), py::arg("world_size"));
#ifdef SKYRL_TX_WITH_NCCL
  using dist::NcclCommunicator;
  py::class_<NcclCommunicator, std::shared_ptr<NcclCommunicator>>(m, "NcclCommunicator")
      .def(py::init<const std::string&, int, int, int>(), py::arg("unique_id"), py::arg("rank"),
           py::arg("world_size"), py::arg("device_index"), py::call_guard<py::gil_scoped_release>())
      .def_static("create_unique_id", [] { return py::bytes(NcclCommunicator::create_unique_id()); })
      .def("broadcast", &NcclCommunicator::broadcast, py::arg("tensor"), py::arg("root"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_sum", &NcclCommunicator::all_reduce_sum, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &NcclCommunicator::rank)
      .def_property_readonly("world_size", &NcclCommunicator::world_size);
#else
  (void)m;
#endif
}

}  // namespace skyrl_tx::bindings
