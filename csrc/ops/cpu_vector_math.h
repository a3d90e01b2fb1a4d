// Vector helpers shared by the fused CPU ops' loop files (cpu_vector_kernels.cpp, deltanet_cpu_kernels.cpp), which
// CMake builds with -mavx2 -mfma: include it only there. Internal linkage, so each file keeps its own copy.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace skyrl_tx::ops::cpu_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;

// sum(a[i] * b[i]) over [0, n) in float.
float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float sum = at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The lanes of a vector that [i, i + left) fills: a partial one at a ragged tail.
int64_t lanes(int64_t left) { return left < Vec::size() ? left : Vec::size(); }

}  // namespace
}  // namespace skyrl_tx::ops::cpu_kernels
