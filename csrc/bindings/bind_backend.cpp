// Binds Backend (held by shared_ptr); heavy calls release the GIL.
#include <pybind11/stl.h>

#include "backend/backend.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace skyrl_tx::bindings {

void bind_backend(py::module_& m) {
  using backend::Backend;
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<backend::OptimizerState>(m, "OptimizerState")
      .def(py::init<>())
      .def_readwrite("kind", &backend::OptimizerState::kind)
      .def_readwrite("step", &backend::OptimizerState::step)
      .def_readwrite("momentum", &backend::OptimizerState::momentum)
      .def_readwrite("exp_avg", &backend::OptimizerState::exp_avg)
      .def_readwrite("exp_avg_sq", &backend::OptimizerState::exp_avg_sq)
      .def_readwrite("master", &backend::OptimizerState::master);
  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def(py::init<const models::ModelConfig&, const backend::BackendConfig&, models::WeightMap,
                    std::shared_ptr<dist::Collectives>, std::shared_ptr<dist::Collectives>>(),
           py::arg("model_config"), py::arg("config"), py::arg("weights"), py::arg("tensor_parallel") = nullptr,
           py::arg("expert_parallel") = nullptr, Release())
      .def("create_adapter", &Backend::create_adapter, py::arg("adapter_id"), py::arg("lora_config"), Release())
      .def("remove_adapter", &Backend::remove_adapter, py::arg("adapter_id"), Release())
      .def("max_sampling_sequences", &Backend::max_sampling_sequences)
      .def("set_adapter_weights", &Backend::set_adapter_weights, py::arg("adapter_id"), py::arg("weights"), Release())
      .def("get_adapter_weights", &Backend::get_adapter_weights, py::arg("adapter_id"), Release())
      .def("adapter_module_names", &Backend::adapter_module_names, py::arg("adapter_id"))
      .def("token_logprobs", &Backend::token_logprobs, py::arg("input_tokens"), py::arg("target_tokens"),
           py::arg("adapter_ids"), Release())
      .def("create_full_model", &Backend::create_full_model, py::arg("model_id"), Release())
      .def("remove_model", &Backend::remove_model, py::arg("model_id"), Release())
      .def("forward_backward", &Backend::forward_backward, py::arg("requests"), Release())
      .def("forward", &Backend::forward, py::arg("requests"), Release())
      .def("attach_collectives", &Backend::attach_collectives, py::arg("group"))
      .def("optim_step", py::overload_cast<const std::string&, const optim::AdamParams&>(&Backend::optim_step),
           py::arg("model_id"), py::arg("params"), Release())
      .def("optim_step", py::overload_cast<const std::string&, const optim::DimuonParams&>(&Backend::optim_step),
           py::arg("model_id"), py::arg("params"), Release())
      .def("set_optimizer_kind", &Backend::set_optimizer_kind, py::arg("model_id"), py::arg("kind"), Release())
      .def("optimizer_kind", &Backend::optimizer_kind, py::arg("model_id"))
      .def("trainable_state",
           py::overload_cast<const std::string&, const std::set<std::string>&, bool>(&Backend::trainable_state,
                                                                                   py::const_),
           py::arg("model_id"), py::arg("names") = std::set<std::string>(), py::arg("model_dtype") = false, Release())
      .def("state_views", &Backend::state_views, py::arg("model_id"), Release())
      .def("weight_stamps", &Backend::weight_stamps, py::arg("model_id"))
      .def("frozen_bytes", &Backend::frozen_bytes)
      .def("snapshot_cost", &Backend::snapshot_cost, py::arg("model_id"))
      .def("trainable_grads", &Backend::trainable_grads, py::arg("model_id"), Release())
      .def("optimizer_state_bytes", &Backend::optimizer_state_bytes, py::arg("model_id"))
      .def("set_tokenizer_info", &Backend::set_tokenizer_info, py::arg("eos_tokens"), py::arg("token_bytes"))
      .def("snapshot_adapter", &Backend::snapshot_adapter, py::arg("adapter_id"), py::arg("snapshot_id"), Release())
      .def("remove_snapshot", &Backend::remove_snapshot, py::arg("snapshot_id"), Release())
      .def("has_snapshot", &Backend::has_snapshot, py::arg("snapshot_id"))
      .def("submit_sample", &Backend::submit_sample, py::arg("request"), Release())
      .def("optimizer_state", &Backend::optimizer_state, py::arg("model_id"), Release())
      .def("set_optimizer_state", &Backend::set_optimizer_state, py::arg("model_id"), py::arg("state"), Release())
      .def("set_trainable_state", &Backend::set_trainable_state, py::arg("model_id"), py::arg("weights"), Release())
      .def("load_snapshot", &Backend::load_snapshot, py::arg("snapshot_id"), py::arg("lora_config"),
           py::arg("weights"), Release())
      .def("load_frozen_model", &Backend::load_frozen_model, py::arg("snapshot_id"), py::arg("weights"), Release())
      .def("frozen_model_weights", &Backend::frozen_model_weights, py::arg("snapshot_id"), Release())
      .def("sample_step", &Backend::sample_step, Release())
      .def("sample_progress", &Backend::sample_progress, py::arg("sample_ids"), Release())
      .def("sampling_idle", &Backend::sampling_idle)
      .def("sample", &Backend::sample, py::arg("requests"), Release())
      .def_property_readonly("model_config", &Backend::model_config)
      .def_property_readonly("config", &Backend::config);
}

}  // namespace skyrl_tx::bindings
