// The operations a custom loss may call: the allow-list, each bound to its ATen implementation.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loss/custom_loss_graph.h"

namespace skyrl_tx::loss {

/// A call's arguments matched to the operation's parameter names (nullptr: not given, or None).
class BoundArgs {
 public:
  BoundArgs(std::string what, std::vector<const Value*> values) : what_(std::move(what)), values_(std::move(values)) {}
  const Value* get(size_t i) const { return values_[i]; }
  const Value& need(size_t i, const char* name) const;  // InvalidArgument naming the parameter when absent
  at::Tensor tensor(size_t i, const char* name) const;  // a tensor argument (numbers are refused)
  at::Scalar scalar(size_t i, const char* name) const;  // a Python number
  int64_t integer(size_t i, const char* name) const;
  std::optional<int64_t> opt_integer(size_t i) const;
  bool flag(size_t i, bool fallback) const;
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::vector<const Value*> values_;
};

struct CustomLossOp {
  std::vector<std::string> params;  // positional order; keyword arguments are matched by these names
  std::function<Value(const BoundArgs&)> run;
};

/// "torch.exp", "operator.mul", "math.log", "torch.nn.functional.softplus", "builtins.getattr", ...
const CustomLossOp* find_function(const std::string& target);
/// Tensor methods called on their first argument: "exp", "sum", "clamp", ...
const CustomLossOp* find_method(const std::string& name);

/// Every allowed name, for the error that refuses another one.
std::vector<std::string> allowed_functions();
std::vector<std::string> allowed_methods();

}  // namespace skyrl_tx::loss
