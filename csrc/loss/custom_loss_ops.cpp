// The custom-loss allow-list: torch / operator / math functions and tensor methods, each bound by name to its ATen
// implementation (custom_loss_calls.h). Python-number operands follow torch's wrapped-number rules (a Python float
// does not promote a float32 tensor), as they do when the SDK runs the same graph client-side.
#include "loss/custom_loss_ops.h"

#include <map>

#include "common/errors.h"
#include "loss/custom_loss_calls.h"

namespace skyrl_tx::loss {

namespace {

using namespace calls;  // NOLINT: the table below is a list of these calls
using OpMap = std::map<std::string, CustomLossOp>;

void add_unary(OpMap& functions, OpMap& methods, const std::string& name, at::Tensor (*fn)(const at::Tensor&)) {
  CustomLossOp op{{"input"}, [fn](const BoundArgs& a) { return T(fn(a.tensor(0, "input"))); }};
  functions["torch." + name] = op;
  methods[name] = op;
}

// clang-format off
const std::pair<OpMap, OpMap>& tables() {
  static const std::pair<OpMap, OpMap> built = [] {
    OpMap f, m;
    add_unary(f, m, "exp", at::exp); add_unary(f, m, "log", at::log); add_unary(f, m, "log1p", at::log1p);
    add_unary(f, m, "expm1", at::expm1); add_unary(f, m, "abs", at::abs); add_unary(f, m, "neg", at::neg);
    add_unary(f, m, "sqrt", at::sqrt); add_unary(f, m, "rsqrt", at::rsqrt); add_unary(f, m, "square", at::square);
    add_unary(f, m, "sigmoid", at::sigmoid); add_unary(f, m, "tanh", at::tanh); add_unary(f, m, "relu", at::relu);
    add_unary(f, m, "sign", at::sign); add_unary(f, m, "reciprocal", at::reciprocal);
    add_unary(f, m, "isfinite", at::isfinite); add_unary(f, m, "logical_not", at::logical_not);
    add_unary(f, m, "floor", at::floor); add_unary(f, m, "ceil", at::ceil);
    f["torch.nn.functional.relu"] = f["torch.relu"];
    f["torch.nn.functional.logsigmoid"] = {{"input"}, [](const BoundArgs& a) {
      return T(at::log_sigmoid(a.tensor(0, "input")));
    }};
    f["torch.nn.functional.softplus"] = {{"input", "beta", "threshold"}, [](const BoundArgs& a) {
      return T(at::softplus(a.tensor(0, "input"), a.get(1) ? a.scalar(1, "beta") : at::Scalar(1),
                            a.get(2) ? a.scalar(2, "threshold") : at::Scalar(20)));
    }};
    // F.softplus and F.logsigmoid are C builtins: torch.fx names them by their home module.
    f["torch._C._nn.softplus"] = f["torch.nn.functional.softplus"];
    f["torch._C._nn.log_sigmoid"] = f["torch.nn.functional.logsigmoid"];
    const std::pair<const char*, char> binaries[] = {{"add", '+'}, {"sub", '-'}, {"mul", '*'}, {"div", '/'},
        {"true_divide", '/'}, {"pow", '^'}, {"gt", '>'}, {"ge", 'g'}, {"lt", '<'}, {"le", 'l'}, {"eq", '='},
        {"ne", '!'}, {"maximum", 'M'}, {"minimum", 'm'}, {"logical_and", '&'}, {"logical_or", '|'}};
    for (const auto& [name, op] : binaries) {
      CustomLossOp bound{{"input", "other"}, [op = op](const BoundArgs& a) { return binary(op, a); }};
      f[std::string("torch.") + name] = bound;
      m[name] = bound;
    }
    const std::pair<const char*, char> operators[] = {{"add", '+'}, {"sub", '-'}, {"mul", '*'}, {"truediv", '/'},
        {"pow", '^'}, {"gt", '>'}, {"ge", 'g'}, {"lt", '<'}, {"le", 'l'}, {"eq", '='}, {"ne", '!'}, {"and_", '&'},
        {"or_", '|'}};
    for (const auto& [name, op] : operators)
      f[std::string("operator.") + name] = {{"input", "other"},
                                            [op = op](const BoundArgs& a) { return binary(op, a); }};
    f["operator.neg"] = {{"input"}, [](const BoundArgs& a) {
      const Value& x = a.need(0, "input");
      return x.is_tensor() ? T(at::neg(x.tensor)) : number_op('-', Value::of_int(0), x);
    }};
    f["operator.getitem"] = {{"input", "index"}, getitem};
    f["getattr"] = {{"input", "name"}, getattr};  // torch.fx names Python's builtin without its module
    f["builtins.getattr"] = f["getattr"];
    for (const char* name : {"exp", "log", "sqrt", "log1p", "expm1"}) {
      f[std::string("math.") + name] = {{"x"}, [name = std::string(name)](const BoundArgs& a) {
        const Value& x = a.need(0, "x");
        SKYRL_TX_CHECK(x.is_number(), InvalidArgument, a.what(), ": math.", name, " takes a number");
        const double v = as_double(x);
        return Value::of_float(name == "exp" ? std::exp(v) : name == "log" ? std::log(v) : name == "sqrt"
                               ? std::sqrt(v) : name == "log1p" ? std::log1p(v) : std::expm1(v));
      }};
    }
    CustomLossOp sum{{"input", "dim", "keepdim", "dtype"}, [](const BoundArgs& a) { return reduce(false, a); }};
    CustomLossOp mean{{"input", "dim", "keepdim", "dtype"}, [](const BoundArgs& a) { return reduce(true, a); }};
    CustomLossOp max{{"input", "dim", "keepdim"}, [](const BoundArgs& a) { return extreme(true, a); }};
    CustomLossOp min{{"input", "dim", "keepdim"}, [](const BoundArgs& a) { return extreme(false, a); }};
    CustomLossOp logsumexp{{"input", "dim", "keepdim"}, [](const BoundArgs& a) {
      return T(at::logsumexp(a.tensor(0, "input"), int_list(a.need(1, "dim"), a, "dim"), a.flag(2, false)));
    }};
    // torch.nn.functional's versions record `_stacklevel` too (ignored, as torch ignores it).
    CustomLossOp softmax{{"input", "dim", "_stacklevel", "dtype"}, [](const BoundArgs& a) {
      return T(at::softmax(a.tensor(0, "input"), a.integer(1, "dim"), dtype_of(a, 3)));
    }};
    CustomLossOp log_softmax{{"input", "dim", "_stacklevel", "dtype"}, [](const BoundArgs& a) {
      return T(at::log_softmax(a.tensor(0, "input"), a.integer(1, "dim"), dtype_of(a, 3)));
    }};
    CustomLossOp clamp_op{{"input", "min", "max"}, clamp};
    for (auto& [name, op] : std::vector<std::pair<std::string, CustomLossOp>>{{"sum", sum}, {"mean", mean},
             {"max", max}, {"min", min}, {"logsumexp", logsumexp}, {"softmax", softmax},
             {"log_softmax", log_softmax}, {"clamp", clamp_op}, {"clip", clamp_op}}) {
      f["torch." + name] = op;
      m[name] = op;
    }
    f["torch.nn.functional.softmax"] = softmax;
    f["torch.nn.functional.log_softmax"] = log_softmax;
    f["torch.where"] = {{"condition", "input", "other"}, where};
    f["torch.zeros_like"] = {{"input"}, [](const BoundArgs& a) { return T(at::zeros_like(a.tensor(0, "input"))); }};
    f["torch.ones_like"] = {{"input"}, [](const BoundArgs& a) { return T(at::ones_like(a.tensor(0, "input"))); }};
    f["torch.full_like"] = {{"input", "fill_value"}, [](const BoundArgs& a) {
      return T(at::full_like(a.tensor(0, "input"), a.scalar(1, "fill_value")));
    }};
    f["torch.stack"] = {{"tensors", "dim"}, [](const BoundArgs& a) {
      return T(at::stack(tensor_list(a.need(0, "tensors"), a), a.opt_integer(1).value_or(0)));
    }};
    f["torch.cat"] = {{"tensors", "dim"}, [](const BoundArgs& a) {
      return T(at::cat(tensor_list(a.need(0, "tensors"), a), a.opt_integer(1).value_or(0)));
    }};
    f["torch.numel"] = {{"input"}, [](const BoundArgs& a) { return Value::of_int(a.tensor(0, "input").numel()); }};
    m["numel"] = f["torch.numel"];
    m["dim"] = {{"input"}, [](const BoundArgs& a) { return Value::of_int(a.tensor(0, "input").dim()); }};
    m["size"] = {{"input", "dim"}, size};
    m["detach"] = {{"input"}, [](const BoundArgs& a) { return T(a.tensor(0, "input").detach()); }};
    m["clone"] = {{"input"}, [](const BoundArgs& a) { return T(a.tensor(0, "input").clone()); }};
    m["float"] = {{"input"}, [](const BoundArgs& a) { return T(a.tensor(0, "input").to(at::kFloat)); }};
    m["to"] = {{"input", "dtype"}, [](const BoundArgs& a) {
      std::optional<at::ScalarType> dtype = dtype_of(a, 1);
      SKYRL_TX_CHECK(dtype.has_value(), InvalidArgument, a.what(), ": to() takes a dtype only");
      return T(a.tensor(0, "input").to(*dtype));
    }};
    m["type_as"] = {{"input", "other"}, [](const BoundArgs& a) {
      return T(a.tensor(0, "input").to(a.tensor(1, "other").scalar_type()));
    }};
    m["unsqueeze"] = {{"input", "dim"}, [](const BoundArgs& a) {
      return T(a.tensor(0, "input").unsqueeze(a.integer(1, "dim")));
    }};
    m["squeeze"] = {{"input", "dim"}, [](const BoundArgs& a) {
      at::Tensor t = a.tensor(0, "input");
      return T(a.get(1) ? t.squeeze(a.integer(1, "dim")) : t.squeeze());
    }};
    m["reshape"] = {{"input", "shape"}, [](const BoundArgs& a) {
      return T(a.tensor(0, "input").reshape(int_list(a.need(1, "shape"), a, "shape")));
    }};
    m["masked_fill"] = {{"input", "mask", "value"}, [](const BoundArgs& a) {
      const Value& v = a.need(2, "value");
      at::Tensor t = a.tensor(0, "input"), mask = a.tensor(1, "mask");
      return T(v.is_tensor() ? t.masked_fill(mask, v.tensor) : t.masked_fill(mask, scalar_of(v)));
    }};
    m["gather"] = {{"input", "dim", "index"}, [](const BoundArgs& a) {
      return T(a.tensor(0, "input").gather(a.integer(1, "dim"), a.tensor(2, "index")));
    }};
    f["torch.gather"] = m["gather"];
    m["where"] = {{"input", "condition", "other"}, [](const BoundArgs& a) {  // x.where(cond, y): self comes first
      at::Tensor self = a.tensor(0, "input");
      at::Tensor other = a.need(2, "other").is_tensor() ? a.tensor(2, "other")
                                                        : at::scalar_tensor(a.scalar(2, "other"), self.options());
      return T(at::where(a.tensor(1, "condition"), self, other));
    }};
    return std::pair<OpMap, OpMap>{std::move(f), std::move(m)};
  }();
  return built;
}
// clang-format on

std::vector<std::string> keys(const OpMap& map) {
  std::vector<std::string> out;
  for (const auto& [name, op] : map) out.push_back(name);
  return out;
}

}  // namespace

const CustomLossOp* find_function(const std::string& target) {
  auto it = tables().first.find(target);
  return it == tables().first.end() ? nullptr : &it->second;
}

const CustomLossOp* find_method(const std::string& name) {
  auto it = tables().second.find(name);
  return it == tables().second.end() ? nullptr : &it->second;
}

std::vector<std::string> allowed_functions() { return keys(tables().first); }
std::vector<std::string> allowed_methods() { return keys(tables().second); }

}  // namespace skyrl_tx::loss
