// A client's custom loss rebuilt from the allow-list (loss/custom_loss_ops.h) and interpreted node by node on ATen:
// autograd records the ops, so the training pass gets d loss / d logprobs from the same run that computes the loss.
#include "loss/custom_loss.h"

#include <optional>

#include "common/errors.h"
#include "loss/custom_loss_ops.h"

namespace skyrl_tx::loss {
namespace {

std::optional<at::ScalarType> parse_dtype(const std::string& name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "float64" || name == "double") return at::kDouble;
  if (name == "int64" || name == "long") return at::kLong;
  if (name == "int32" || name == "int") return at::kInt;
  if (name == "bool") return at::kBool;
  return std::nullopt;
}

// Every reference in `arg` names an earlier node; dtypes are known ones.
void check_arg(const GraphArg& arg, int64_t node, const std::string& where) {
  if (arg.kind == GraphArg::Kind::kRef) {
    SKYRL_TX_CHECK(arg.integer >= 0 && arg.integer < node, InvalidArgument, where,
                   " refers to a node that does not come before it");
  }
  if (arg.kind == GraphArg::Kind::kDtype) {
    SKYRL_TX_CHECK(parse_dtype(arg.text).has_value(), InvalidArgument, where, " uses dtype '", arg.text,
                   "'; allowed: float32, float64, int64, int32, bool");
  }
  if (arg.kind == GraphArg::Kind::kSlice) {
    SKYRL_TX_CHECK(arg.items.size() == 3, InvalidArgument, where, " has a slice without start, stop and step");
  }
  for (const GraphArg& item : arg.items) check_arg(item, node, where);
}

const CustomLossOp* op_of(const GraphNode& node) {
  return node.op == "call_function" ? find_function(node.target) : find_method(node.target);
}

Value resolve(const GraphArg& arg, const std::vector<Value>& values) {
  Value v;
  switch (arg.kind) {
    case GraphArg::Kind::kNone: return v;
    case GraphArg::Kind::kBool: return Value::of_bool(arg.boolean);
    case GraphArg::Kind::kInt: return Value::of_int(arg.integer);
    case GraphArg::Kind::kFloat: return Value::of_float(arg.number);
    case GraphArg::Kind::kRef: return values[size_t(arg.integer)];
    case GraphArg::Kind::kString: v.kind = Value::Kind::kString, v.text = arg.text; return v;
    case GraphArg::Kind::kEllipsis: v.kind = Value::Kind::kEllipsis; return v;
    case GraphArg::Kind::kDtype: v.kind = Value::Kind::kDtype, v.dtype = *parse_dtype(arg.text); return v;
    case GraphArg::Kind::kList: v.kind = Value::Kind::kList; break;
    case GraphArg::Kind::kTuple: v.kind = Value::Kind::kTuple; break;
    case GraphArg::Kind::kSlice: v.kind = Value::Kind::kSlice; break;
  }
  for (const GraphArg& item : arg.items) v.items.push_back(resolve(item, values));
  return v;
}

// Matches positional and keyword arguments to the operation's parameter names (extra positional ints after a
// `shape` parameter are the shape, as in x.reshape(2, 3)).
Value call(const CustomLossOp& op, const std::string& what, std::vector<Value> args,
           std::vector<std::pair<std::string, Value>> kwargs) {
  if (!op.params.empty() && op.params.back() == "shape" && args.size() > op.params.size()) {
    Value shape;
    shape.kind = Value::Kind::kTuple;
    shape.items.assign(args.begin() + int64_t(op.params.size()) - 1, args.end());
    args.resize(op.params.size() - 1);
    args.push_back(shape);
  }
  SKYRL_TX_CHECK(args.size() <= op.params.size(), InvalidArgument, what, " takes at most ", op.params.size(),
                 " arguments, got ", args.size());
  std::vector<const Value*> bound(op.params.size(), nullptr);
  for (size_t i = 0; i < args.size(); ++i) bound[i] = args[i].kind == Value::Kind::kNone ? nullptr : &args[i];
  for (const auto& [key, value] : kwargs) {
    size_t i = 0;
    while (i < op.params.size() && op.params[i] != key) ++i;
    SKYRL_TX_CHECK(i < op.params.size(), InvalidArgument, what, " has no argument '", key, "'; it takes ",
                   join_with_commas(op.params));
    SKYRL_TX_CHECK(i >= args.size(), InvalidArgument, what, " got argument '", key, "' twice");
    bound[i] = value.kind == Value::Kind::kNone ? nullptr : &value;
  }
  return op.run(BoundArgs(what, std::move(bound)));
}

}  // namespace

CustomLoss::CustomLoss(CustomLossSpec spec) : spec_(std::move(spec)) {
  const std::string& name = spec_.name;
  const int64_t inputs = int64_t(spec_.input_names.size());
  SKYRL_TX_CHECK(inputs >= 1 && inputs <= kMaxCustomLossInputs, InvalidArgument, "custom loss '", name, "': takes ",
                 inputs, " inputs; logprobs and at most ", kMaxCustomLossInputs - 1, " loss_fn_inputs");
  SKYRL_TX_CHECK(spec_.input_names[0] == "logprobs" && spec_.input_ranks.at(0) == 1, InvalidArgument,
                 "custom loss '", name, "': the first input must be logprobs of rank 1 ([T]; rank-2 target_tokens "
                 "are not supported by this server)");
  for (int64_t rank : spec_.input_ranks) {
    SKYRL_TX_CHECK(rank >= 0 && rank <= 2, InvalidArgument, "custom loss '", name, "': input ranks are 0, 1 or 2");
  }
  const int64_t count = int64_t(spec_.nodes.size());
  SKYRL_TX_CHECK(count <= kMaxCustomLossNodes, InvalidArgument, "custom loss '", name, "': ", count,
                 " nodes; at most ", kMaxCustomLossNodes);
  int64_t placeholders = 0;
  for (int64_t i = 0; i < count; ++i) {
    const GraphNode& node = spec_.nodes[size_t(i)];
    const std::string where = str_cat("custom loss '", name, "': node '", node.name, "'");
    if (node.op == "placeholder") {
      SKYRL_TX_CHECK(placeholders < inputs && node.target == spec_.input_names[size_t(placeholders)],
                     InvalidArgument, where, " is input '", node.target, "', but the declared inputs are ",
                     join_with_commas(spec_.input_names), " in that order");
      ++placeholders;
      continue;
    }
    SKYRL_TX_CHECK(node.op == "call_function" || node.op == "call_method", InvalidArgument, where, " is a ",
                   node.op, " node; a custom loss may only call torch/math/operator functions and tensor methods");
    SKYRL_TX_CHECK(op_of(node) != nullptr, InvalidArgument, where, " calls ",
                   node.op == "call_method" ? "method '" : "'", node.target,
                   "', which this server does not run; allowed: ",
                   join_with_commas(node.op == "call_method" ? allowed_methods() : allowed_functions()));
    SKYRL_TX_CHECK(node.op == "call_function" || !node.args.empty(), InvalidArgument, where,
                   " calls a method without the tensor it is called on");
    if (node.target == "getattr" || node.target == "builtins.getattr") {  // tensor attributes: shape, ndim only
      const bool known = node.args.size() == 2 && node.args[1].kind == GraphArg::Kind::kString &&
                         (node.args[1].text == "shape" || node.args[1].text == "ndim");
      SKYRL_TX_CHECK(known, InvalidArgument, where, " reads an attribute other than a tensor's shape or ndim");
    }
    for (const GraphArg& arg : node.args) check_arg(arg, i, where);
    for (const auto& [key, arg] : node.kwargs) check_arg(arg, i, where);
  }
  SKYRL_TX_CHECK(placeholders == inputs, InvalidArgument, "custom loss '", name, "': the graph reads ", placeholders,
                 " inputs, but ", inputs, " are declared");
  SKYRL_TX_CHECK(spec_.loss_node >= 0 && spec_.loss_node < count, InvalidArgument, "custom loss '", name,
                 "': it must return (loss, metrics) with the loss a tensor computed by the graph");
  SKYRL_TX_CHECK(spec_.metric_names.size() == spec_.metric_nodes.size(), Internal, "custom loss metrics");
  for (int64_t node : spec_.metric_nodes) {
    SKYRL_TX_CHECK(node >= 0 && node < count, InvalidArgument, "custom loss '", name,
                   "': every metric must be a tensor computed by the graph");
  }
}

CustomLoss::Result CustomLoss::evaluate(const std::vector<at::Tensor>& inputs) const {
  SKYRL_TX_CHECK(inputs.size() == spec_.input_names.size(), Internal, "custom loss '", spec_.name, "': ",
                 inputs.size(), " inputs for ", spec_.input_names.size());
  std::vector<Value> values(spec_.nodes.size());
  size_t next_input = 0;
  for (size_t i = 0; i < spec_.nodes.size(); ++i) {
    const GraphNode& node = spec_.nodes[i];
    if (node.op == "placeholder") {
      values[i] = Value::of(inputs[next_input++]);
      continue;
    }
    const std::string what = str_cat("custom loss '", spec_.name, "': node '", node.name, "' (", node.target, ")");
    std::vector<Value> args;
    for (const GraphArg& arg : node.args) args.push_back(resolve(arg, values));
    std::vector<std::pair<std::string, Value>> kwargs;
    for (const auto& [key, arg] : node.kwargs) kwargs.emplace_back(key, resolve(arg, values));
    try {
      values[i] = call(*op_of(node), what, std::move(args), std::move(kwargs));
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // ATen's own checks (shapes, dtypes): the client's graph, the client's error
      throw InvalidArgument(str_cat(what, " failed: ", e.what()));
    }
  }
  auto scalar = [&](int64_t node, const std::string& what) {
    const Value& v = values[size_t(node)];
    SKYRL_TX_CHECK(v.is_tensor() && v.tensor.dim() == 0, InvalidArgument, "custom loss '", spec_.name, "': ", what,
                   " must be a scalar tensor");
    return v.tensor;
  };
  Result result{scalar(spec_.loss_node, "the loss"), {}};
  for (size_t m = 0; m < spec_.metric_nodes.size(); ++m)
    result.metrics.push_back(scalar(spec_.metric_nodes[m], "metric '" + spec_.metric_names[m] + "'").detach());
  return result;
}

void add_custom_metrics(const CustomLoss& loss, const std::vector<std::vector<double>>& per_datum,
                        std::map<std::string, double>& metrics) {
  double total = 0.0;
  std::vector<double> sums(loss.metric_names().size(), 0.0);
  for (const std::vector<double>& values : per_datum) {
    total += values.at(0);
    for (size_t m = 0; m < sums.size(); ++m) sums[m] += values.at(m + 1);
  }
  metrics["loss:sum"] = total;
  for (size_t m = 0; m < sums.size(); ++m) {
    const std::string& key = loss.metric_names()[m];
    const bool mean = key.size() >= 5 && key.compare(key.size() - 5, 5, ":mean") == 0;
    metrics[key] = mean && !per_datum.empty() ? sums[m] / double(per_datum.size()) : sums[m];
  }
}

}  // namespace skyrl_tx::loss
