// Binds the training request/result structs and AdamParams (plain data; conversion only).
#include <pybind11/stl.h>

#include "batching/train_batch.h"
#include "bindings/bindings.h"
#include "optim/adamw.h"
#include "optim/dimuon.h"

namespace py = pybind11;

namespace skyrl_tx::bindings {

void bind_training(py::module_& m) {
  using namespace batching;
  py::class_<TrainDatum>(m, "TrainDatum")
      .def(py::init<>())
      .def(py::init([](at::Tensor input_tokens, std::map<std::string, at::Tensor> inputs) {
             return TrainDatum{std::move(input_tokens), std::move(inputs)};
           }),
           py::arg("input_tokens"), py::arg("loss_fn_inputs"))
      .def_readwrite("input_tokens", &TrainDatum::input_tokens)
      .def_readwrite("loss_fn_inputs", &TrainDatum::loss_fn_inputs);
  py::class_<TrainRequest>(m, "TrainRequest")
      .def(py::init<>())
      .def(py::init([](std::string model_id, std::vector<TrainDatum> data, std::string loss_fn,
                       std::map<std::string, double> config) {
             return TrainRequest{std::move(model_id), std::move(data), std::move(loss_fn), std::move(config)};
           }),
           py::arg("model_id"), py::arg("data"), py::arg("loss_fn") = "cross_entropy",
           py::arg("loss_fn_config") = std::map<std::string, double>{})
      .def_readwrite("model_id", &TrainRequest::model_id)
      .def_readwrite("data", &TrainRequest::data)
      .def_readwrite("loss_fn", &TrainRequest::loss_fn)
      .def_readwrite("loss_fn_config", &TrainRequest::loss_fn_config)
      .def_property(
          "custom_loss",
          [](const TrainRequest& r) { return std::const_pointer_cast<loss::CustomLoss>(r.custom_loss); },
          [](TrainRequest& r, std::shared_ptr<loss::CustomLoss> loss) { r.custom_loss = std::move(loss); });
  py::class_<DatumOutput>(m, "DatumOutput")
      .def_readonly("logprobs", &DatumOutput::logprobs)
      .def_readonly("elementwise_loss", &DatumOutput::elementwise_loss)
      .def_readonly("custom_values", &DatumOutput::custom_values);
  py::class_<TrainResult>(m, "TrainResult")
      .def_readonly("loss_fn_outputs", &TrainResult::loss_fn_outputs)
      .def_readonly("metrics", &TrainResult::metrics);

  using optim::AdamParams;
  py::class_<AdamParams>(m, "AdamParams")
      .def(py::init<>())
      .def_readwrite("learning_rate", &AdamParams::learning_rate)
      .def_readwrite("beta1", &AdamParams::beta1)
      .def_readwrite("beta2", &AdamParams::beta2)
      .def_readwrite("eps", &AdamParams::eps)
      .def_readwrite("weight_decay", &AdamParams::weight_decay)
      .def_readwrite("grad_clip_norm", &AdamParams::grad_clip_norm)
      .def("validate", &AdamParams::validate);

  using optim::DimuonParams;
  py::class_<DimuonParams>(m, "DimuonParams")
      .def(py::init<>())
      .def_readwrite("learning_rate", &DimuonParams::learning_rate)
      .def_readwrite("grad_clip_norm", &DimuonParams::grad_clip_norm)
      .def_readwrite("beta1", &DimuonParams::beta1)
      .def("validate", &DimuonParams::validate);
  m.def("newton_schulz", &optim::newton_schulz, py::arg("x"),
        "Dimuon's batched Newton–Schulz orthogonalisation of x [n, r, k] (r <= k), float32.");
}

}  // namespace skyrl_tx::bindings
