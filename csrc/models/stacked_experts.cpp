// StackedExperts: an MoE layer's held experts' base weights in stacks, run as grouped GEMMs (at::_grouped_mm).
#include "models/stacked_experts.h"

#ifdef SKYRL_TX_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "common/errors.h"
#include "models/layers.h"
#include "ops/swiglu.h"

namespace skyrl_tx::models {

GroupedExpertGemm parse_grouped_expert_gemm(const std::string& name) {
  if (name == "auto") return GroupedExpertGemm::kAuto;
  if (name == "always") return GroupedExpertGemm::kAlways;
  if (name == "never") return GroupedExpertGemm::kNever;
  throw InvalidArgument(str_cat("backend config: grouped_expert_gemm must be \"auto\", \"always\" or \"never\" (got \"",
                                name, "\")"));
}

namespace {

using Projection = const lora::LoraLinear& (SwiGluMlp::*)() const;

// [n, out]: each expert's adapter update of its slice of `input` (zeros where no adapter applies), or undefined
// when no row of any expert has one (the base model; a batch of other layers' adapters).
at::Tensor adapter_updates(const std::vector<SwiGluMlp*>& experts, Projection projection, const at::Tensor& input,
                           const std::vector<int64_t>& counts, const std::vector<lora::AdapterSegments>& segments,
                           int64_t out_features) {
  std::vector<at::Tensor> updates;
  bool any = false;
  int64_t offset = 0;
  size_t with_rows = 0;
  for (size_t j = 0; j < experts.size(); ++j) {
    if (counts[j] == 0) continue;
    const lora::LoraLinear& linear = (experts[j]->*projection)();
    at::Tensor update = linear.adapter_update(input.narrow(0, offset, counts[j]), segments[with_rows++]);
    any = any || update.defined();
    updates.push_back(update.defined() ? update : at::zeros({counts[j], out_features}, input.options()));
    offset += counts[j];
  }
  return any ? at::cat(updates) : at::Tensor();
}

// The CUDA device's compute capability major version (0: not a CUDA tensor, or a build without CUDA).
int cuda_major(const at::Tensor& rows) {
#ifdef SKYRL_TX_WITH_CUDA
  if (rows.is_cuda()) return at::cuda::getDeviceProperties(rows.device().index())->major;
#endif
  (void)rows;
  return 0;
}

// Where libtorch has the op: any CPU dtype (its reference loop); on CUDA bfloat16 only, on compute capability
// >= 8.0 (a loop of GEMMs before 9.0, the CUTLASS grouped kernel from 9.0).
bool op_available(const at::Tensor& rows, bool fast_kernel_only) {
  if (rows.is_cpu()) return !fast_kernel_only;
  return rows.scalar_type() == at::kBFloat16 && cuda_major(rows) >= (fast_kernel_only ? 9 : 8);
}

}  // namespace

StackedExperts::StackedExperts(std::vector<SwiGluMlp*> experts, GroupedExpertGemm policy)
    : experts_(std::move(experts)), policy_(policy) {
  SKYRL_TX_INTERNAL_ASSERT(!experts_.empty(), "a stack needs at least one expert");
  const at::Tensor& first = experts_[0]->gate_proj().weight();  // [inter, hidden]
  intermediate_ = first.size(0);
  hidden_ = first.size(1);
  const int64_t count = static_cast<int64_t>(experts_.size());
  gate_up_ = at::empty({count, 2 * intermediate_, hidden_}, first.options());  // [E, 2 * inter, hidden]
  down_ = at::empty({count, hidden_, intermediate_}, first.options());         // [E, hidden, inter]
  for (int64_t j = 0; j < count; ++j) {
    SwiGluMlp& expert = *experts_[j];
    at::Tensor gate_up = gate_up_.select(0, j);
    expert.gate_proj().move_weight_into(gate_up.narrow(0, 0, intermediate_));
    expert.up_proj().move_weight_into(gate_up.narrow(0, intermediate_, intermediate_));
    expert.down_proj().move_weight_into(down_.select(0, j));
  }
}

bool StackedExperts::usable(const at::Tensor& rows) const {
  if (policy_ == GroupedExpertGemm::kNever) return false;
  if (!op_available(rows, /*fast_kernel_only=*/policy_ == GroupedExpertGemm::kAuto)) return false;
  const int64_t element = static_cast<int64_t>(rows.element_size());
  const bool aligned = (hidden_ * element) % 16 == 0 && (intermediate_ * element) % 16 == 0;
  return aligned && rows.scalar_type() == gate_up_.scalar_type() && !experts_[0]->gate_proj().weight().requires_grad();
}

at::Tensor StackedExperts::forward(const at::Tensor& rows, const std::vector<int64_t>& counts,
                                   const std::vector<lora::AdapterSegments>& segments) const {
  SKYRL_TX_INTERNAL_ASSERT(counts.size() == experts_.size(), "one row count per held expert");
  // offs[j]: the end of expert j's rows (int32 on the device, what the kernel reads).
  std::vector<int32_t> ends(counts.size());
  int64_t end = 0;
  for (size_t j = 0; j < counts.size(); ++j) ends[j] = static_cast<int32_t>(end += counts[j]);
  const at::Tensor offs = at::tensor(ends, at::TensorOptions().dtype(at::kInt)).to(rows.device());  // [E]
  // Transposed views of the stacks: [E, in, out] column-major slices, as the kernel wants its second operand.
  at::Tensor gate_up = at::_grouped_mm(rows, gate_up_.transpose(1, 2), offs);  // [n, 2 * inter]
  at::Tensor gate = gate_up.narrow(1, 0, intermediate_);                        // [n, inter]
  at::Tensor up = gate_up.narrow(1, intermediate_, intermediate_);              // [n, inter]
  if (at::Tensor update = adapter_updates(experts_, &SwiGluMlp::gate_proj, rows, counts, segments, intermediate_);
      update.defined()) {
    gate = gate + update;
  }
  if (at::Tensor update = adapter_updates(experts_, &SwiGluMlp::up_proj, rows, counts, segments, intermediate_);
      update.defined()) {
    up = up + update;
  }
  at::Tensor gated = ops::swiglu(gate, up);                                 // [n, inter], contiguous
  at::Tensor out = at::_grouped_mm(gated, down_.transpose(1, 2), offs);     // [n, hidden]
  if (at::Tensor update = adapter_updates(experts_, &SwiGluMlp::down_proj, gated, counts, segments, hidden_);
      update.defined()) {
    out = out + update;
  }
  return out;
}

}  // namespace skyrl_tx::models
