// Binds the sampling request/result structs (plain data; conversion only).
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "sampling/sampling_params.h"

namespace py = pybind11;

namespace skyrl_tx::bindings {

void bind_sampling(py::module_& m) {
  using namespace sampling;
  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init<>())
      .def_readwrite("max_tokens", &SamplingParams::max_tokens)
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("stop_tokens", &SamplingParams::stop_tokens)
      .def_readwrite("stop_strings", &SamplingParams::stop_strings)
      .def_readwrite("stop_at_eos", &SamplingParams::stop_at_eos);
  py::class_<SampleRequest>(m, "SampleRequest")
      .def(py::init<>())
      .def_readwrite("weights_id", &SampleRequest::weights_id)
      .def_readwrite("prompt", &SampleRequest::prompt)
      .def_readwrite("num_samples", &SampleRequest::num_samples)
      .def_readwrite("params", &SampleRequest::params)
      .def_readwrite("prompt_logprobs", &SampleRequest::prompt_logprobs)
      .def_readwrite("topk_prompt_logprobs", &SampleRequest::topk_prompt_logprobs)
      .def_readwrite("prompt_logprobs_last_n", &SampleRequest::prompt_logprobs_last_n)
      .def_readwrite("target_prompt_token_ids", &SampleRequest::target_prompt_token_ids)
      .def_readwrite("prompt_alt_tokens_k", &SampleRequest::prompt_alt_tokens_k)
      .def_readwrite("topk_sample_logprobs", &SampleRequest::topk_sample_logprobs);
  py::class_<SampledSequence>(m, "SampledSequence")
      .def_readonly("tokens", &SampledSequence::tokens)
      .def_readonly("logprobs", &SampledSequence::logprobs)
      .def_readonly("stop_reason", &SampledSequence::stop_reason)
      .def_readonly("topk_token_ids", &SampledSequence::topk_token_ids)
      .def_readonly("topk_logprobs", &SampledSequence::topk_logprobs);
  py::class_<SampleResult>(m, "SampleResult")
      .def_readonly("sequences", &SampleResult::sequences)
      .def_readonly("prompt_logprobs", &SampleResult::prompt_logprobs)
      .def_readonly("topk_prompt_token_ids", &SampleResult::topk_prompt_token_ids)
      .def_readonly("topk_prompt_logprobs", &SampleResult::topk_prompt_logprobs)
      .def_readonly("target_prompt_logprobs", &SampleResult::target_prompt_logprobs)
      .def_readonly("prompt_alt_token_ids", &SampleResult::prompt_alt_token_ids)
      .def_readonly("prompt_alt_logprobs", &SampleResult::prompt_alt_logprobs)
      .def_readonly("prompt_cache_hit_tokens", &SampleResult::prompt_cache_hit_tokens);
}

}  // namespace skyrl_tx::bindings
