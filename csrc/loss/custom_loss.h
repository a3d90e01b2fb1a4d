// A client's custom loss (SDK create_custom_loss), rebuilt from the allow-list and run per datum in the training pass.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "loss/custom_loss_graph.h"

namespace skyrl_tx::loss {

inline constexpr int64_t kMaxCustomLossInputs = 16;   // the SDK's limit, logprobs included
inline constexpr int64_t kMaxCustomLossNodes = 1024;  // bounds the work one loss can ask for per datum

/// A validated graph: every call is an allowed operation, every reference points to an earlier node, the inputs
/// are logprobs (rank 1) and named loss_fn_inputs of rank 0-2. Nothing the client sent is ever executed as code.
class CustomLoss {
 public:
  /// Throws InvalidArgument naming the offending node (an operation off the allow-list, a bad reference, ...).
  explicit CustomLoss(CustomLossSpec spec);

  const std::string& name() const { return spec_.name; }
  const std::vector<std::string>& input_names() const { return spec_.input_names; }  // logprobs first
  const std::vector<int64_t>& input_ranks() const { return spec_.input_ranks; }
  const std::vector<std::string>& metric_names() const { return spec_.metric_names; }

  struct Result {
    at::Tensor loss;                  // 0-dim; differentiable in inputs[0]
    std::vector<at::Tensor> metrics;  // 0-dim, one per metric_names()
  };
  /// Runs the graph on one datum: inputs[0] its target logprobs [T], then its loss_fn_inputs in input_names order.
  /// Errors while running (a shape mismatch, a non-scalar loss) are InvalidArgument naming the node.
  Result evaluate(const std::vector<at::Tensor>& inputs) const;

 private:
  CustomLossSpec spec_;
};

/// Per-datum values [loss, metrics...] of a request's data combined as the SDK combines them client-side: the loss
/// summed into "loss:sum", each metric summed (":sum") or averaged over the data (":mean").
void add_custom_metrics(const CustomLoss& loss, const std::vector<std::vector<double>>& per_datum,
                        std::map<std::string, double>& metrics);

}  // namespace skyrl_tx::loss
