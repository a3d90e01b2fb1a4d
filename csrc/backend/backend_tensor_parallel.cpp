// Backend under tensor parallelism: which LoRA factors a rank holds a shard of, and the whole tensors one process
// would hold, gathered on the way out of the backend and split on the way in.
#include "backend/backend.h"

#include "common/errors.h"

namespace skyrl_tx::backend {

optim::TrainableTensor Backend::lora_factor(const models::NamedLoraModule& m, int64_t slot, bool b) const {
  const std::string name = m.name + (b ? ".lora_B.weight" : ".lora_A.weight");
  optim::TrainableTensor t{name, b ? m.module->lora_b(slot) : m.module->lora_a(slot),
                           b ? m.module->lora_b_grad(slot) : m.module->lora_a_grad(slot)};
  const int64_t size = tensor_parallel().size();
  // B [out, r] of a column-parallel layer holds this rank's output rows (the lm_head's: its vocabulary rows, an
  // uneven split); A [r, in] of a row-parallel layer its input columns. The other factor is replicated.
  if (b && m.split == dist::TpSplit::kColumn) {
    t.split_dim = 0;
    t.split_size = m.group == models::LoraGroup::kUnembed ? model_config().vocab_size
                                                           : m.module->out_features() * size;
  } else if (!b && m.split == dist::TpSplit::kRow) {
    t.split_dim = 1;
    t.split_size = m.module->in_features() * size;
  }
  return t;
}

std::vector<int64_t> Backend::whole_shape(const optim::TrainableTensor& t) const {
  std::vector<int64_t> shape(t.param.sizes().begin(), t.param.sizes().end());
  if (tensor_parallel().enabled() && t.split_dim >= 0) shape[t.split_dim] = t.split_size;
  return shape;
}

at::Tensor Backend::whole(const optim::TrainableTensor& t, const at::Tensor& local) const {
  if (!tensor_parallel().enabled() || t.split_dim < 0) return local.detach();
  return tensor_parallel().gather(local.detach(), t.split_dim, t.split_size);
}

at::Tensor Backend::part(const optim::TrainableTensor& t, const at::Tensor& full) const {
  if (!tensor_parallel().enabled() || t.split_dim < 0) return full;
  return tensor_parallel().narrow(full, t.split_dim);
}

}  // namespace skyrl_tx::backend
