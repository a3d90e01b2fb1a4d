// The shared implementations behind the custom-loss allow-list (custom_loss_ops.cpp binds names to them).
#pragma once

#include <optional>
#include <vector>

#include "loss/custom_loss_ops.h"

namespace skyrl_tx::loss::calls {

Value T(at::Tensor t);  // a tensor result
double as_double(const Value& v);
at::Scalar scalar_of(const Value& v);  // a Python number as a wrapped-number Scalar

/// a ∘ b for two Python numbers (int when both are ints and the operation keeps ints). Operations: + - * / ^ and
/// the comparisons > g(>=) < l(<=) = !.
Value number_op(char op, const Value& a, const Value& b);
/// The same operations, plus & | M(maximum) m(minimum), on tensors and numbers as torch's operators do them.
Value binary(char op, const BoundArgs& a);

std::vector<int64_t> int_list(const Value& v, const BoundArgs& a, const char* name);  // an int or a list of ints
std::optional<at::ScalarType> dtype_of(const BoundArgs& a, size_t i);
Value reduce(bool mean, const BoundArgs& a);    // sum / mean (input, dim, keepdim, dtype)
Value extreme(bool max, const BoundArgs& a);    // max / min (input, dim | other, keepdim)
Value clamp(const BoundArgs& a);                // (input, min, max): numbers or tensors
Value where(const BoundArgs& a);                // (condition, input, other)
std::vector<at::Tensor> tensor_list(const Value& v, const BoundArgs& a);
Value getitem(const BoundArgs& a);  // tensor indexing (ints, slices, None, Ellipsis, tensors) or a tuple's item
Value getattr(const BoundArgs& a);  // a tensor's shape or ndim
Value size(const BoundArgs& a);     // (input, dim)

}  // namespace skyrl_tx::loss::calls
