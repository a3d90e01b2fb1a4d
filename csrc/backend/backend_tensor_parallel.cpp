// Backend under tensor or expert parallelism: which LoRA factors a rank holds a shard of (or, for experts, whole
// or not at all), and the whole tensors one process would hold, gathered on the way out and split on the way in.
#include "backend/backend.h"

#include "common/errors.h"

namespace skyrl_tx::backend {

dist::TensorSplit Backend::lora_split(const models::NamedLoraModule& m, bool b, at::IntArrayRef local) const {
  const int64_t size = tensor_parallel().size();
  std::vector<int64_t> whole(local.begin(), local.end());
  dist::TensorSplit split;
  if (m.split != dist::TpSplit::kOwned && !tensor_parallel().enabled()) return split;  // experts over data parallel
  // B [out, r] of a column-parallel layer holds this rank's output rows (the lm_head's: its vocabulary rows, an
  // uneven split); A [r, in] of a row-parallel layer its input columns. The other factor is replicated. An expert's
  // factors are whole on the rank that holds the expert and empty elsewhere.
  if (b && m.split == dist::TpSplit::kColumn) {
    split.dim = 0;
    whole[0] = m.group == models::LoraGroup::kUnembed ? model_config().vocab_size : local[0] * size;
    if (!m.sections.empty()) {  // [q | k | v]: each section split on its own
      split.sections = m.sections;
      whole[0] = 0;
      for (int64_t n : m.sections) whole[0] += n;
    }
  } else if (!b && m.split == dist::TpSplit::kRow) {
    split.dim = 1;
    whole[1] = local[1] * size;
  } else if (m.split == dist::TpSplit::kOwned) {
    split.owner = m.owner;
    if (b) whole[0] = m.whole_out;
    else whole[1] = m.whole_in;
  } else {
    return split;
  }
  split.whole_shape = std::move(whole);
  return split;
}

optim::TrainableTensor Backend::lora_factor(const models::NamedLoraModule& m, int64_t slot, bool b) const {
  const std::string name = m.name + (b ? ".lora_B.weight" : ".lora_A.weight");
  optim::TrainableTensor t{name, b ? m.module->lora_b(slot) : m.module->lora_a(slot),
                           b ? m.module->lora_b_grad(slot) : m.module->lora_a_grad(slot), {}};
  if (split_group().enabled()) t.split = lora_split(m, b, t.param.sizes());
  return t;
}

std::vector<int64_t> Backend::whole_shape(const optim::TrainableTensor& t) const {
  if (!split_group().enabled() || t.split.replicated()) return t.param.sizes().vec();
  return t.split.whole_shape;
}

at::Tensor Backend::whole(const optim::TrainableTensor& t, const at::Tensor& local) const {
  return split_group().whole(local, t.split);
}

at::Tensor Backend::part(const optim::TrainableTensor& t, const at::Tensor& full) const {
  return split_group().part(full, t.split, t.param.sizes());
}

}  // namespace skyrl_tx::backend
