// The argument handling and shared implementations behind the custom-loss allow-list (custom_loss_ops.cpp binds
// names to them): Python-number arithmetic, torch's tensor/number operand rules, reductions, indexing.
#include "loss/custom_loss_calls.h"

#include <ATen/TensorIndexing.h>

#include <cmath>

#include "common/errors.h"

namespace skyrl_tx::loss {

const Value& BoundArgs::need(size_t i, const char* name) const {
  SKYRL_TX_CHECK(values_[i] != nullptr, InvalidArgument, what_, ": argument '", name, "' is missing");
  return *values_[i];
}

at::Tensor BoundArgs::tensor(size_t i, const char* name) const {
  const Value& v = need(i, name);
  SKYRL_TX_CHECK(v.is_tensor(), InvalidArgument, what_, ": argument '", name, "' must be a tensor");
  return v.tensor;
}

at::Scalar BoundArgs::scalar(size_t i, const char* name) const {
  const Value& v = need(i, name);
  if (v.kind == Value::Kind::kInt) return at::Scalar(v.integer);
  if (v.kind == Value::Kind::kBool) return at::Scalar(v.boolean);
  SKYRL_TX_CHECK(v.kind == Value::Kind::kFloat, InvalidArgument, what_, ": argument '", name, "' must be a number");
  return at::Scalar(v.number);
}

int64_t BoundArgs::integer(size_t i, const char* name) const {
  const Value& v = need(i, name);
  SKYRL_TX_CHECK(v.kind == Value::Kind::kInt, InvalidArgument, what_, ": argument '", name, "' must be an int");
  return v.integer;
}

std::optional<int64_t> BoundArgs::opt_integer(size_t i) const {
  if (values_[i] == nullptr) return std::nullopt;
  return integer(i, "dim");
}

bool BoundArgs::flag(size_t i, bool fallback) const {
  if (values_[i] == nullptr) return fallback;
  SKYRL_TX_CHECK(values_[i]->kind == Value::Kind::kBool, InvalidArgument, what_, ": a flag must be True or False");
  return values_[i]->boolean;
}

namespace calls {

Value T(at::Tensor t) { return Value::of(std::move(t)); }

double as_double(const Value& v) {
  return v.kind == Value::Kind::kFloat ? v.number : v.kind == Value::Kind::kInt ? double(v.integer) : v.boolean;
}

// a ∘ b for two Python numbers: int when both are ints (and the operation keeps ints), else float.
Value number_op(char op, const Value& a, const Value& b) {
  const bool ints = a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat;
  const double x = as_double(a), y = as_double(b);
  switch (op) {
    case '+': return ints ? Value::of_int(int64_t(x) + int64_t(y)) : Value::of_float(x + y);
    case '-': return ints ? Value::of_int(int64_t(x) - int64_t(y)) : Value::of_float(x - y);
    case '*': return ints ? Value::of_int(int64_t(x) * int64_t(y)) : Value::of_float(x * y);
    case '/': return Value::of_float(x / y);
    case '^':
      return ints && y >= 0 ? Value::of_int(int64_t(std::llround(std::pow(x, y)))) : Value::of_float(std::pow(x, y));
    case '>': return Value::of_bool(x > y);
    case 'g': return Value::of_bool(x >= y);
    case '<': return Value::of_bool(x < y);
    case 'l': return Value::of_bool(x <= y);
    case '=': return Value::of_bool(x == y);
    case '!': return Value::of_bool(x != y);
  }
  throw Internal("custom loss: unknown number operation");
}

at::Scalar scalar_of(const Value& v) {
  return v.kind == Value::Kind::kInt ? at::Scalar(v.integer)
         : v.kind == Value::Kind::kBool ? at::Scalar(v.boolean) : at::Scalar(v.number);
}

// A binary operation with torch's operand rules: tensor ∘ tensor, tensor ∘ number, number ∘ tensor, numbers.
Value binary(char op, const BoundArgs& a) {
  const Value& x = a.need(0, "input");
  const Value& y = a.need(1, "other");
  SKYRL_TX_CHECK((x.is_tensor() || x.is_number()) && (y.is_tensor() || y.is_number()), InvalidArgument, a.what(),
                 ": operands must be tensors or numbers");
  if (!x.is_tensor() && !y.is_tensor()) return number_op(op, x, y);
  if (x.is_tensor() && y.is_tensor()) {
    const at::Tensor &p = x.tensor, &q = y.tensor;
    switch (op) {
      case '+': return T(at::add(p, q));
      case '-': return T(at::sub(p, q));
      case '*': return T(at::mul(p, q));
      case '/': return T(at::div(p, q));
      case '^': return T(at::pow(p, q));
      case '>': return T(at::gt(p, q));
      case 'g': return T(at::ge(p, q));
      case '<': return T(at::lt(p, q));
      case 'l': return T(at::le(p, q));
      case '=': return T(at::eq(p, q));
      case '!': return T(at::ne(p, q));
      case '&': return T(at::bitwise_and(p, q));
      case '|': return T(at::bitwise_or(p, q));
      case 'M': return T(at::maximum(p, q));
      case 'm': return T(at::minimum(p, q));
    }
  }
  const bool tensor_left = x.is_tensor();
  const at::Tensor& t = tensor_left ? x.tensor : y.tensor;
  const at::Scalar s = scalar_of(tensor_left ? y : x);
  switch (op) {  // as torch.Tensor's operators and their reflected forms compute them
    case '+': return T(at::add(t, s));
    case '*': return T(at::mul(t, s));
    case '-': return T(tensor_left ? at::sub(t, s) : at::rsub(t, s));
    case '/': return T(tensor_left ? at::div(t, s) : at::mul(at::reciprocal(t), s));
    case '^': return T(tensor_left ? at::pow(t, s) : at::pow(s, t));
    case '>': return T(tensor_left ? at::gt(t, s) : at::lt(t, s));
    case 'g': return T(tensor_left ? at::ge(t, s) : at::le(t, s));
    case '<': return T(tensor_left ? at::lt(t, s) : at::gt(t, s));
    case 'l': return T(tensor_left ? at::le(t, s) : at::ge(t, s));
    case '=': return T(at::eq(t, s));
    case '!': return T(at::ne(t, s));
    case '&': return T(at::bitwise_and(t, s));
    case '|': return T(at::bitwise_or(t, s));
    case 'M': return T(at::clamp_min(t, s));
    case 'm': return T(at::clamp_max(t, s));
  }
  throw Internal("custom loss: unknown binary operation");
}

std::vector<int64_t> int_list(const Value& v, const BoundArgs& a, const char* name) {
  if (v.kind == Value::Kind::kInt) return {v.integer};
  SKYRL_TX_CHECK(v.kind == Value::Kind::kList || v.kind == Value::Kind::kTuple, InvalidArgument, a.what(),
                 ": argument '", name, "' must be an int or a list of ints");
  std::vector<int64_t> out;
  for (const Value& item : v.items) {
    SKYRL_TX_CHECK(item.kind == Value::Kind::kInt, InvalidArgument, a.what(), ": '", name, "' must hold ints");
    out.push_back(item.integer);
  }
  return out;
}

std::optional<at::ScalarType> dtype_of(const BoundArgs& a, size_t i) {
  const Value* v = a.get(i);
  if (v == nullptr) return std::nullopt;
  SKYRL_TX_CHECK(v->kind == Value::Kind::kDtype, InvalidArgument, a.what(), ": 'dtype' must be a torch dtype");
  return v->dtype;
}

// sum / mean: over everything, or over `dim` (an int or a list) with keepdim.
Value reduce(bool mean, const BoundArgs& a) {
  at::Tensor t = a.tensor(0, "input");
  const std::optional<at::ScalarType> dtype = dtype_of(a, 3);
  if (a.get(1) == nullptr) return T(mean ? at::mean(t, dtype) : at::sum(t, dtype));
  const std::vector<int64_t> dims = int_list(*a.get(1), a, "dim");
  return T(mean ? at::mean(t, dims, a.flag(2, false), dtype) : at::sum(t, dims, a.flag(2, false), dtype));
}

// max / min: of everything, elementwise against `other` (a tensor), or along `dim` as (values, indices).
Value extreme(bool max, const BoundArgs& a) {
  at::Tensor t = a.tensor(0, "input");
  const Value* second = a.get(1);
  if (second == nullptr) return T(max ? at::max(t) : at::min(t));
  if (second->is_tensor()) return T(max ? at::maximum(t, second->tensor) : at::minimum(t, second->tensor));
  auto [values, indices] = max ? at::max(t, a.integer(1, "dim"), a.flag(2, false))
                               : at::min(t, a.integer(1, "dim"), a.flag(2, false));
  return Value::tuple({T(values), T(indices)});
}

Value clamp(const BoundArgs& a) {
  at::Tensor t = a.tensor(0, "input");
  const Value* lo = a.get(1);
  const Value* hi = a.get(2);
  SKYRL_TX_CHECK(lo != nullptr || hi != nullptr, InvalidArgument, a.what(), ": give min or max");
  if ((lo && lo->is_tensor()) || (hi && hi->is_tensor())) {
    auto bound = [&](const Value* v) -> std::optional<at::Tensor> {
      if (v == nullptr) return std::nullopt;
      return v->is_tensor() ? v->tensor : at::scalar_tensor(scalar_of(*v), t.options());
    };
    return T(at::clamp(t, bound(lo), bound(hi)));
  }
  auto bound = [&](const Value* v) -> std::optional<at::Scalar> {
    if (v == nullptr) return std::nullopt;
    return scalar_of(*v);
  };
  return T(at::clamp(t, bound(lo), bound(hi)));
}

Value where(const BoundArgs& a) {
  at::Tensor cond = a.tensor(0, "condition");
  const Value& x = a.need(1, "input");
  const Value& y = a.need(2, "other");
  if (x.is_tensor() && y.is_tensor()) return T(at::where(cond, x.tensor, y.tensor));
  if (x.is_tensor()) return T(at::where(cond, x.tensor, scalar_of(y)));
  if (y.is_tensor()) return T(at::where(cond, scalar_of(x), y.tensor));
  return T(at::where(cond, scalar_of(x), scalar_of(y)));
}

std::vector<at::Tensor> tensor_list(const Value& v, const BoundArgs& a) {
  SKYRL_TX_CHECK(v.kind == Value::Kind::kList || v.kind == Value::Kind::kTuple, InvalidArgument, a.what(),
                 ": 'tensors' must be a list of tensors");
  std::vector<at::Tensor> out;
  for (const Value& item : v.items) {
    SKYRL_TX_CHECK(item.is_tensor(), InvalidArgument, a.what(), ": 'tensors' must hold tensors only");
    out.push_back(item.tensor);
  }
  return out;
}

namespace {

at::indexing::TensorIndex index_of(const Value& v, const BoundArgs& a) {
  using namespace at::indexing;
  auto bound = [&](const Value& b) -> std::optional<c10::SymInt> {
    if (b.kind == Value::Kind::kNone) return std::nullopt;
    SKYRL_TX_CHECK(b.kind == Value::Kind::kInt, InvalidArgument, a.what(), ": slice bounds must be ints");
    return c10::SymInt(b.integer);
  };
  switch (v.kind) {
    case Value::Kind::kInt: return TensorIndex(v.integer);
    case Value::Kind::kBool: return TensorIndex(v.boolean);
    case Value::Kind::kNone: return TensorIndex(None);
    case Value::Kind::kEllipsis: return TensorIndex(Ellipsis);
    case Value::Kind::kTensor: return TensorIndex(v.tensor);
    case Value::Kind::kSlice: return TensorIndex(Slice(bound(v.items[0]), bound(v.items[1]), bound(v.items[2])));
    default: break;
  }
  throw InvalidArgument(str_cat(a.what(), ": an index must be an int, a slice, None, Ellipsis or a tensor"));
}

}  // namespace

Value getitem(const BoundArgs& a) {
  const Value& x = a.need(0, "input");
  const Value& key = a.need(1, "index");
  if (x.kind == Value::Kind::kTuple || x.kind == Value::Kind::kList) {  // shape[0], max(dim=...)[0]
    SKYRL_TX_CHECK(key.kind == Value::Kind::kInt, InvalidArgument, a.what(), ": a tuple index must be an int");
    const int64_t n = int64_t(x.items.size());
    const int64_t i = key.integer < 0 ? key.integer + n : key.integer;
    SKYRL_TX_CHECK(i >= 0 && i < n, InvalidArgument, a.what(), ": index ", key.integer, " out of range for ", n);
    return x.items[size_t(i)];
  }
  SKYRL_TX_CHECK(x.is_tensor(), InvalidArgument, a.what(), ": only tensors and tuples can be indexed");
  std::vector<at::indexing::TensorIndex> indices;
  if (key.kind == Value::Kind::kTuple) {
    for (const Value& item : key.items) indices.push_back(index_of(item, a));
  } else {
    indices.push_back(index_of(key, a));
  }
  return T(x.tensor.index(indices));
}

namespace {

Value shape_of(const at::Tensor& t) {
  std::vector<Value> dims;
  for (int64_t d : t.sizes()) dims.push_back(Value::of_int(d));
  return Value::tuple(std::move(dims));
}

}  // namespace

Value getattr(const BoundArgs& a) {
  at::Tensor t = a.tensor(0, "input");
  const Value& name = a.need(1, "name");
  SKYRL_TX_CHECK(name.kind == Value::Kind::kString, InvalidArgument, a.what(), ": attribute name must be a string");
  if (name.text == "shape") return shape_of(t);
  if (name.text == "ndim") return Value::of_int(t.dim());
  throw InvalidArgument(str_cat(a.what(), ": attribute '", name.text, "' is not available (only shape and ndim)"));
}

Value size(const BoundArgs& a) {
  at::Tensor t = a.tensor(0, "input");
  if (a.get(1) == nullptr) return shape_of(t);
  return Value::of_int(t.size(a.integer(1, "dim")));
}

}  // namespace calls
}  // namespace skyrl_tx::loss
