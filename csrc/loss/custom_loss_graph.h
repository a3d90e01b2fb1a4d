// A custom loss as plain data (the SDK's CustomLossGraph, decoded by skyrl_tx/engine/custom_losses.py) and the
// values its nodes compute while it runs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace skyrl_tx::loss {

/// One argument of a node, as the SDK encodes it: a JSON scalar, a reference to an earlier node, a list, a tuple,
/// a slice [start, stop, step], Ellipsis or a dtype name. (Dicts appear only in the output node, which the engine
/// decodes into CustomLossSpec::metric_refs.)
struct GraphArg {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kRef, kList, kTuple, kSlice, kEllipsis, kDtype };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;  // kInt; kRef: the index of the node referred to (always an earlier one)
  double number = 0.0;
  std::string text;             // kString; kDtype: "float32", "int64", ...
  std::vector<GraphArg> items;  // kList, kTuple; kSlice: exactly 3 (start, stop, step; kNone where omitted)
};

/// One torch.fx node: op "placeholder" (an input), "call_function" (target e.g. "torch.exp", "operator.mul"),
/// "call_method" (target a tensor method, e.g. "sum"). The output node is not a GraphNode: see CustomLossSpec.
struct GraphNode {
  std::string op, name, target;
  std::vector<GraphArg> args;
  std::vector<std::pair<std::string, GraphArg>> kwargs;
};

/// A whole loss: inputs (logprobs first) with their ranks, the nodes in execution order, and what it returns.
struct CustomLossSpec {
  std::string name;
  std::vector<std::string> input_names;  // logprobs, then the loss_fn_inputs keys it reads
  std::vector<int64_t> input_ranks;      // 0 scalar, 1 [T], 2 [T, K]
  std::vector<GraphNode> nodes;
  int64_t loss_node = -1;                 // index into nodes: the scalar loss
  std::vector<std::string> metric_names;  // custom/<name>:sum | custom/<name>:mean
  std::vector<int64_t> metric_nodes;      // index into nodes, one per metric
};

/// A value while the graph runs: what torch.fx programs pass around (tensors, Python numbers, shapes, slices).
struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kTensor, kList, kTuple, kSlice, kEllipsis, kDtype };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0.0;
  std::string text;
  at::Tensor tensor;
  at::ScalarType dtype = at::kFloat;
  std::vector<Value> items;  // kList, kTuple; kSlice: start, stop, step

  static Value of(at::Tensor t) {
    Value v;
    v.kind = Kind::kTensor;
    v.tensor = std::move(t);
    return v;
  }
  static Value of_int(int64_t i) {
    Value v;
    v.kind = Kind::kInt;
    v.integer = i;
    return v;
  }
  static Value of_float(double x) {
    Value v;
    v.kind = Kind::kFloat;
    v.number = x;
    return v;
  }
  static Value of_bool(bool b) {
    Value v;
    v.kind = Kind::kBool;
    v.boolean = b;
    return v;
  }
  static Value tuple(std::vector<Value> items) {
    Value v;
    v.kind = Kind::kTuple;
    v.items = std::move(items);
    return v;
  }
  bool is_tensor() const { return kind == Kind::kTensor; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
};

}  // namespace skyrl_tx::loss
