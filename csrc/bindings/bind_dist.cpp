// Binds NcclCommunicator when the build has CUDA + NCCL; otherwise reports the missing capability.
#include "bindings/bindings.h"
#include "common/errors.h"

#ifdef SKYRL_TX_WITH_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace py = pybind11;

namespace skyrl_tx::bindings {

void bind_dist(py::module_& m) {
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
