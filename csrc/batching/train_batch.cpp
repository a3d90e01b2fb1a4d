// Tinker training requests → validated rows, token-budgeted micro-batches and per-token loss inputs.
#include "batching/train_batch.h"

#include <algorithm>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::batching {
namespace {

at::Tensor float_input(const TrainDatum& d, const std::string& key, int64_t n, double fill, const std::string& where) {
  auto it = d.loss_fn_inputs.find(key);
  if (it == d.loss_fn_inputs.end()) return at::full({n}, fill, at::kFloat);
  const at::Tensor& t = it->second;
  SKYRL_TX_CHECK(t.dim() == 1 && t.numel() == n, InvalidArgument, where, ": loss_fn_inputs['", key,
                 "'] must have the input's length ", n, " (got shape ", shape_str(t), ")");
  at::Tensor out = t.to(at::kFloat).contiguous();
  SKYRL_TX_CHECK(at::isfinite(out).all().item<bool>(), InvalidArgument, where, ": loss_fn_inputs['", key,
                 "'] contains NaN or infinity");
  return out;
}

at::Tensor target_tokens(const TrainDatum& d, int64_t n, const std::string& where) {
  const at::Tensor& targets = d.loss_fn_inputs.at("target_tokens");
  SKYRL_TX_CHECK(targets.dim() == 1 && targets.numel() == n, InvalidArgument, where,
                 ": loss_fn_inputs['target_tokens'] must have the input's length ", n, " (got shape ",
                 shape_str(targets), ")");
  SKYRL_TX_CHECK(!at::isFloatingType(targets.scalar_type()), InvalidArgument, where,
                 ": loss_fn_inputs['target_tokens'] must be int64 (got ", targets.scalar_type(), ")");
  return targets.to(at::kLong);
}

// A custom loss reads the loss_fn_inputs its graph names, at their declared ranks ([] , [N] or [N, K]); the SDK
// sends every other key of the datum too, which it ignores.
TrainRow custom_row(TrainRow row, const TrainRequest& req, const TrainDatum& d, const std::string& where) {
  SKYRL_TX_CHECK(req.custom_loss != nullptr, InvalidArgument, where,
                 ": loss 'custom' needs loss_fn_config {'loss_id': ...} from create_custom_loss");
  const int64_t n = row.length();
  row.target_tokens = target_tokens(d, n, where);
  row.custom = req.custom_loss.get();
  const auto& names = row.custom->input_names();
  const auto& ranks = row.custom->input_ranks();
  for (size_t k = 1; k < names.size(); ++k) {
    auto it = d.loss_fn_inputs.find(names[k]);
    SKYRL_TX_CHECK(it != d.loss_fn_inputs.end(), InvalidArgument, where, ": custom loss '", row.custom->name(),
                   "' reads loss_fn_inputs['", names[k], "'], which the datum does not have");
    const at::Tensor& t = it->second;
    const bool fits = ranks[k] == 0 ? t.numel() == 1 : t.dim() == ranks[k] && t.size(0) == n;
    SKYRL_TX_CHECK(fits, InvalidArgument, where, ": loss_fn_inputs['", names[k], "'] has shape ", shape_str(t),
                   "; custom loss '", row.custom->name(), "' declared it with rank ", ranks[k],
                   ranks[k] ? str_cat(" and the input's length ", n, " first") : std::string());
    at::Tensor value = ranks[k] == 0 ? t.reshape({}) : t.contiguous();
    if (at::isFloatingType(value.scalar_type())) {
      value = value.to(at::kFloat);
      SKYRL_TX_CHECK(at::isfinite(value).all().item<bool>(), InvalidArgument, where, ": loss_fn_inputs['",
                     names[k], "'] contains NaN or infinity");
    }
    row.custom_inputs.push_back(value);
  }
  row.weights = at::ones({n}, at::kFloat);  // unused by the custom loss: its gradient comes from the graph
  row.sampling_logprobs = row.advantages = row.clip_low = row.clip_high = at::zeros({n}, at::kFloat);
  return row;
}

TrainRow validate_datum(const TrainRequest& req, size_t r, size_t i, loss::LossKind kind, const loss::LossConfig& cfg) {
  const TrainDatum& d = req.data[i];
  const std::string where = str_cat("forward_backward: request ", r, " (model '", req.model_id, "') datum ", i);
  TrainRow row;
  row.request = r, row.datum = i, row.kind = kind, row.beta = cfg.beta;
  SKYRL_TX_CHECK(d.input_tokens.dim() == 1 && d.input_tokens.numel() > 0, InvalidArgument, where,
                 ": model_input must hold at least one token (got shape ", shape_str(d.input_tokens), ")");
  row.input_tokens = d.input_tokens.to(at::kLong);
  const int64_t n = row.length();

  const auto& required = loss::required_inputs(kind);
  const auto& optional = loss::optional_inputs(kind);
  for (const auto& key : required) {
    SKYRL_TX_CHECK(d.loss_fn_inputs.count(key), InvalidArgument, where, ": loss '", loss::loss_name(kind),
                   "' needs loss_fn_inputs['", key, "']");
  }
  if (kind == loss::LossKind::kCustom) return custom_row(std::move(row), req, d, where);
  for (const auto& [key, tensor] : d.loss_fn_inputs) {
    const bool known = std::count(required.begin(), required.end(), key) + std::count(optional.begin(), optional.end(), key);
    SKYRL_TX_CHECK(known, InvalidArgument, where, ": loss_fn_inputs['", key, "'] is not an input of loss '",
                   loss::loss_name(kind), "'; remove it");
  }
  row.target_tokens = target_tokens(d, n, where);
  row.weights = float_input(d, "weights", n, 1.0, where);
  row.sampling_logprobs = float_input(d, "logprobs", n, 0.0, where);
  row.advantages = float_input(d, "advantages", n, 0.0, where);
  row.clip_low = float_input(d, "clip_low_threshold", n, cfg.clip_low, where);
  row.clip_high = float_input(d, "clip_high_threshold", n, cfg.clip_high, where);
  if (kind == loss::LossKind::kGspo) {
    // Without a sequence_ratio_mask the ratio averages over the tokens the loss trains on.
    row.ratio_mask = d.loss_fn_inputs.count("sequence_ratio_mask")
                         ? float_input(d, "sequence_ratio_mask", n, 0.0, where)
                         : ((row.advantages != 0) & (row.weights != 0)).to(at::kFloat);
  }
  return row;
}

}  // namespace

std::vector<TrainRow> validate_requests(const std::vector<TrainRequest>& requests) {
  std::vector<TrainRow> rows;
  for (size_t r = 0; r < requests.size(); ++r) {
    const TrainRequest& req = requests[r];
    const loss::LossKind kind = loss::parse_loss_kind(req.loss_fn);
    const loss::LossConfig cfg = loss::parse_loss_config(kind, req.loss_fn_config);
    for (size_t i = 0; i < req.data.size(); ++i) rows.push_back(validate_datum(req, r, i, kind, cfg));
  }
  return rows;
}

std::vector<std::vector<size_t>> plan_micro_batches(const std::vector<TrainRow>& rows,
                                                    const std::vector<size_t>& row_ids, int64_t token_budget,
                                                    int64_t max_rows, RowLayout layout) {
  std::vector<size_t> order = row_ids;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rows[a].length() > rows[b].length(); });
  std::vector<std::vector<size_t>> batches;
  // Padded: rows arrive longest first, so a batch's padded length is its first row's. Packed: tokens add up.
  int64_t longest = 0, tokens = 0;
  for (size_t id : order) {
    const int64_t next_rows = batches.empty() ? 0 : static_cast<int64_t>(batches.back().size()) + 1;
    const int64_t next_tokens = layout == RowLayout::kPacked ? tokens + rows[id].length() : next_rows * longest;
    if (batches.empty() || next_tokens > token_budget || (max_rows > 0 && next_rows > max_rows)) {
      batches.emplace_back();
      longest = rows[id].length();
      tokens = 0;
    }
    batches.back().push_back(id);
    tokens += rows[id].length();
  }
  return batches;
}

std::pair<PackedBatch, loss::LossInputs> pack_training_rows(const std::vector<const TrainRow*>& rows,
                                                            const std::vector<int64_t>& slots, int64_t vocab_size,
                                                            at::Device device, RowLayout layout) {
  std::vector<at::Tensor> inputs, targets;
  for (const TrainRow* row : rows) {
    inputs.push_back(row->input_tokens);
    targets.push_back(row->target_tokens);
  }
  PackedBatch batch = pack_sequences(inputs, targets, slots, vocab_size, device, layout);
  const int64_t N = batch.input_ids.numel();
  auto fopts = at::TensorOptions().dtype(at::kFloat);
  // All [N] (the flattened batch) on the host first, filled at each request's tokens, then moved once.
  at::Tensor kind = at::zeros({N}, at::kLong);
  at::Tensor w = at::zeros({N}, fopts), q = at::zeros({N}, fopts), adv = at::zeros({N}, fopts);
  at::Tensor lo = at::zeros({N}, fopts), hi = at::zeros({N}, fopts), beta = at::zeros({N}, fopts);
  at::Tensor ratio_mask = at::zeros({N}, fopts);
  bool has_sequence_losses = false;
  std::vector<loss::CustomLossRow> custom_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    const TrainRow& row = *rows[i];
    const int64_t begin = batch.token_offset[i], n = row.length();
    if (row.custom != nullptr) {
      std::vector<at::Tensor> on_device;
      for (const at::Tensor& t : row.custom_inputs) on_device.push_back(t.to(device));
      custom_rows.push_back({begin, n, i, row.custom, std::move(on_device)});
    }
    kind.narrow(0, begin, n).fill_(static_cast<int64_t>(row.kind));
    w.narrow(0, begin, n).copy_(row.weights);
    q.narrow(0, begin, n).copy_(row.sampling_logprobs);
    adv.narrow(0, begin, n).copy_(row.advantages);
    lo.narrow(0, begin, n).copy_(row.clip_low);
    hi.narrow(0, begin, n).copy_(row.clip_high);
    beta.narrow(0, begin, n).fill_(row.beta);
    if (row.ratio_mask.defined()) {
      ratio_mask.narrow(0, begin, n).copy_(row.ratio_mask);
      has_sequence_losses = true;
    }
  }
  auto to_device = [&](const at::Tensor& t) { return t.to(device); };
  // seq_log_ratio needs the model's logprobs: the micro-batch runner fills it (loss::sequence_log_ratio).
  loss::LossInputs in{to_device(kind), batch.valid.reshape({-1}), to_device(w), to_device(q), to_device(adv),
                      to_device(lo), to_device(hi), to_device(beta), to_device(ratio_mask), at::Tensor(),
                      has_sequence_losses, at::Tensor(), std::move(custom_rows)};
  return {std::move(batch), std::move(in)};
}

loss::LossInputs slice_inputs(const loss::LossInputs& in, int64_t begin, int64_t length) {
  auto s = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, begin, length) : t; };
  return {s(in.kind), s(in.valid), s(in.weights), s(in.sampling_logprobs), s(in.advantages),
          s(in.clip_low), s(in.clip_high), s(in.beta), s(in.ratio_mask), s(in.seq_log_ratio),
          in.has_sequence_losses, s(in.custom_grad), {}};
}

}  // namespace skyrl_tx::batching
