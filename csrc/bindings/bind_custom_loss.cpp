// Binds CustomLoss: built from the SDK's wire form of a custom-loss graph (decoded here, node by node, into the
// plain structs of loss/custom_loss_graph.h; nothing in it is executed as Python).
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <map>

#include "bindings/bindings.h"
#include "common/errors.h"
#include "loss/custom_loss.h"
#include "loss/custom_loss_ops.h"

namespace py = pybind11;

namespace skyrl_tx::bindings {
namespace {

using loss::GraphArg;

constexpr int kMaxArgDepth = 16;  // nesting of lists/tuples in one argument

struct WireDecoder {
  const std::string& loss_name;
  std::map<std::string, int64_t> node_index;  // names of the nodes decoded so far

  [[noreturn]] void fail(const std::string& node, const std::string& message) const {
    throw InvalidArgument(str_cat("create_custom_loss: loss '", loss_name, "' node '", node, "': ", message));
  }

  GraphArg arg(py::handle value, const std::string& node, int depth) const {
    if (depth > kMaxArgDepth) fail(node, "arguments nest too deeply");
    GraphArg out;
    if (value.is_none()) return out;
    if (py::isinstance<py::bool_>(value)) {
      out.kind = GraphArg::Kind::kBool, out.boolean = value.cast<bool>();
    } else if (py::isinstance<py::int_>(value)) {
      out.kind = GraphArg::Kind::kInt, out.integer = value.cast<int64_t>();
    } else if (py::isinstance<py::float_>(value)) {
      out.kind = GraphArg::Kind::kFloat, out.number = value.cast<double>();
    } else if (py::isinstance<py::str>(value)) {
      out.kind = GraphArg::Kind::kString, out.text = value.cast<std::string>();
    } else if (py::isinstance<py::list>(value)) {
      out.kind = GraphArg::Kind::kList;
      for (py::handle item : value) out.items.push_back(arg(item, node, depth + 1));
    } else if (py::isinstance<py::dict>(value) && py::len(value) == 1) {
      auto [key_obj, inner] = *value.cast<py::dict>().begin();
      const std::string key = key_obj.cast<std::string>();
      if (key == "ref") {
        auto it = node_index.find(inner.cast<std::string>());
        if (it == node_index.end()) fail(node, "refers to '" + inner.cast<std::string>() + "', no earlier node");
        out.kind = GraphArg::Kind::kRef, out.integer = it->second;
      } else if (key == "tuple" || key == "slice") {
        out.kind = key == "tuple" ? GraphArg::Kind::kTuple : GraphArg::Kind::kSlice;
        if (!py::isinstance<py::list>(inner)) fail(node, "a " + key + " must hold a list");
        for (py::handle item : inner) out.items.push_back(arg(item, node, depth + 1));
      } else if (key == "ellipsis") {
        out.kind = GraphArg::Kind::kEllipsis;
      } else if (key == "float") {
        const std::string text = inner.cast<std::string>();
        out.kind = GraphArg::Kind::kFloat;
        if (text == "inf") out.number = std::numeric_limits<double>::infinity();
        else if (text == "-inf") out.number = -std::numeric_limits<double>::infinity();
        else if (text == "nan") out.number = std::numeric_limits<double>::quiet_NaN();
        else fail(node, "float '" + text + "' is not inf, -inf or nan");
      } else if (key == "dtype") {
        out.kind = GraphArg::Kind::kDtype, out.text = inner.cast<std::string>();
      } else {
        fail(node, "a '" + key + "' argument is not supported (only tensors, numbers, lists, tuples, slices, "
                   "Ellipsis and dtypes)");
      }
    } else {
      fail(node, "has an argument this server cannot read");
    }
    return out;
  }
};

// The output node's argument: (loss, {metric: tensor}) as {"tuple": [...]} or a list.
void decode_output(const WireDecoder& decoder, py::handle args, loss::CustomLossSpec& spec) {
  py::list list = args.cast<py::list>();
  py::handle result = list.size() == 1 ? list[0] : py::handle();
  py::object items;
  if (result && py::isinstance<py::dict>(result) && result.cast<py::dict>().contains("tuple"))
    items = result.cast<py::dict>()["tuple"];
  else if (result && py::isinstance<py::list>(result))
    items = py::reinterpret_borrow<py::object>(result);
  if (!items || py::len(items) != 2) decoder.fail("output", "the loss must return (loss, metrics)");
  GraphArg loss = decoder.arg(items.cast<py::list>()[0], "output", 0);
  if (loss.kind != GraphArg::Kind::kRef) decoder.fail("output", "the loss must be a tensor the graph computes");
  spec.loss_node = loss.integer;
  py::handle metrics = items.cast<py::list>()[1];
  if (!py::isinstance<py::dict>(metrics) || !metrics.cast<py::dict>().contains("dict"))
    decoder.fail("output", "metrics must be a dict");
  for (auto [key, value] : metrics.cast<py::dict>()["dict"].cast<py::dict>()) {
    GraphArg metric = decoder.arg(value, "output", 0);
    if (metric.kind != GraphArg::Kind::kRef)
      decoder.fail("output", "metric '" + key.cast<std::string>() + "' must be a tensor the graph computes");
    spec.metric_names.push_back(key.cast<std::string>());
    spec.metric_nodes.push_back(metric.integer);
  }
}

std::shared_ptr<loss::CustomLoss> from_wire(const std::string& name, const std::vector<std::string>& input_names,
                                            const std::vector<int64_t>& input_ranks, const py::list& nodes) {
  loss::CustomLossSpec spec;
  spec.name = name, spec.input_names = input_names, spec.input_ranks = input_ranks;
  WireDecoder decoder{name, {}};
  bool output_seen = false;
  for (py::handle item : nodes) {
    py::dict node = item.cast<py::dict>();
    const std::string op = node["op"].cast<std::string>(), node_name = node["name"].cast<std::string>();
    if (output_seen) decoder.fail(node_name, "comes after the output node");
    if (op == "output") {
      decode_output(decoder, node.contains("args") ? node["args"] : py::list(), spec);
      output_seen = true;
      continue;
    }
    loss::GraphNode out{op, node_name, node["target"].cast<std::string>(), {}, {}};
    if (node.contains("args"))
      for (py::handle a : node["args"]) out.args.push_back(decoder.arg(a, node_name, 0));
    if (node.contains("kwargs"))
      for (auto [key, value] : node["kwargs"].cast<py::dict>())
        out.kwargs.emplace_back(key.cast<std::string>(), decoder.arg(value, node_name, 0));
    if (decoder.node_index.count(node_name)) decoder.fail(node_name, "appears twice");
    decoder.node_index[node_name] = int64_t(spec.nodes.size());
    spec.nodes.push_back(std::move(out));
  }
  if (!output_seen) decoder.fail("output", "the graph has no output node");
  return std::make_shared<loss::CustomLoss>(std::move(spec));
}

}  // namespace

void bind_custom_loss(py::module_& m) {
  using loss::CustomLoss;
  py::class_<CustomLoss, std::shared_ptr<CustomLoss>>(m, "CustomLoss")
      .def_static("from_wire", &from_wire, py::arg("name"), py::arg("input_names"), py::arg("input_ranks"),
                  py::arg("nodes"),
                  "Rebuilds a create_custom_loss graph (the SDK's CustomLossGraph.nodes as JSON) from the "
                  "allow-list; InvalidArgumentError names the node it refuses.")
      .def_property_readonly("name", &CustomLoss::name)
      .def_property_readonly("input_names", &CustomLoss::input_names)
      .def_property_readonly("input_ranks", &CustomLoss::input_ranks)
      .def_property_readonly("metric_names", &CustomLoss::metric_names)
      .def("evaluate", [](const CustomLoss& self, const std::vector<at::Tensor>& inputs) {
             CustomLoss::Result r = self.evaluate(inputs);
             return std::make_pair(r.loss, r.metrics);
           }, py::arg("inputs"), "(loss, metrics) of one datum: inputs = [logprobs, *loss_fn_inputs in order]");
  m.def("custom_loss_allowed_functions", &loss::allowed_functions);
  m.def("custom_loss_allowed_methods", &loss::allowed_methods);
}

}  // namespace skyrl_tx::bindings
