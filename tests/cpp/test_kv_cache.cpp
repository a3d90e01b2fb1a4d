// Tests sampling::KvCache (shapes, the lowest-first row allocator, copy_prefix, bytes()) and its sizing from a budget.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <vector>

#include "common/errors.h"
#include "sampling/kv_budget.h"
#include "sampling/kv_cache.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::sampling {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

KvCache make_cache(int64_t rows = 4, int64_t len = 6) {
  return KvCache(skyrl_tx::testing::tiny_qwen3_config(), rows, len, at::kFloat, at::kCPU);
}

TEST(KvCacheTest, AllocatesPerLayerZeroedStorage) {
  const models::ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  KvCache cache = make_cache(4, 6);
  ASSERT_EQ(static_cast<int64_t>(cache.keys().size()), c.num_hidden_layers);
  ASSERT_EQ(static_cast<int64_t>(cache.values().size()), c.num_hidden_layers);
  for (const auto& t : cache.keys()) {
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{4, c.num_key_value_heads, 6, c.resolved_head_dim()}));
    EXPECT_EQ(t.scalar_type(), at::kFloat);
    EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0);
  }
  EXPECT_EQ(cache.max_rows(), 4);
  EXPECT_EQ(cache.max_len(), 6);
  EXPECT_EQ(cache.free_rows(), 4);
}

TEST(KvCacheTest, AllocatesLowestRowFirstAndReturnsMinusOneWhenFull) {
  KvCache cache = make_cache(3);
  EXPECT_EQ(cache.allocate_row(), 0);
  EXPECT_EQ(cache.allocate_row(), 1);
  EXPECT_EQ(cache.allocate_row(), 2);
  EXPECT_EQ(cache.free_rows(), 0);
  EXPECT_EQ(cache.allocate_row(), -1);
  EXPECT_EQ(cache.free_rows(), 0);
}

TEST(KvCacheTest, ReleasedRowsAreReusedLowestFirst) {
  KvCache cache = make_cache(4);
  for (int i = 0; i < 4; ++i) cache.allocate_row();
  cache.release_row(2);
  cache.release_row(0);
  EXPECT_EQ(cache.free_rows(), 2);
  EXPECT_EQ(cache.allocate_row(), 0);
  EXPECT_EQ(cache.allocate_row(), 2);
  EXPECT_EQ(cache.allocate_row(), -1);
}

TEST(KvCacheTest, ReleasingAFreeRowIsAnError) {
  KvCache cache = make_cache(2);
  EXPECT_ANY_THROW(cache.release_row(1));
  EXPECT_ANY_THROW(cache.release_row(5));
}

TEST(KvCacheTest, RejectsDegenerateSizes) {
  const models::ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  EXPECT_THROW(KvCache(c, 0, 8, at::kFloat, at::kCPU), InvalidArgument);
  EXPECT_THROW(KvCache(c, 2, 1, at::kFloat, at::kCPU), InvalidArgument);
}

TEST(KvCacheTest, CopyPrefixCopiesEveryLayerAndLeavesTheRestAlone) {
  KvCache cache = make_cache(4, 6);
  at::Generator gen = make_gen(3);
  for (size_t l = 0; l < cache.keys().size(); ++l) {
    cache.keys()[l].copy_(randn(cache.keys()[l].sizes(), gen));
    cache.values()[l].copy_(randn(cache.values()[l].sizes(), gen));
  }
  std::vector<at::Tensor> keys_before, values_before;
  for (size_t l = 0; l < cache.keys().size(); ++l) {
    keys_before.push_back(cache.keys()[l].clone());
    values_before.push_back(cache.values()[l].clone());
  }
  const int64_t len = 4;
  cache.copy_prefix(1, {0, 3}, len);
  for (size_t l = 0; l < cache.keys().size(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& after = kv ? cache.values()[l] : cache.keys()[l];
      const at::Tensor& before = kv ? values_before[l] : keys_before[l];
      at::Tensor expected = before.clone();
      for (int64_t dst : {0, 3}) expected[dst].narrow(1, 0, len).copy_(before[1].narrow(1, 0, len));
      EXPECT_TENSOR_EQ(after, expected);
      // Positions [len, max_len) of the targets kept their own values.
      EXPECT_TENSOR_EQ(after[3].narrow(1, len, 2), before[3].narrow(1, len, 2));
      EXPECT_FALSE(at::equal(after[3].narrow(1, len, 2), before[1].narrow(1, len, 2)));
    }
  }
  // No targets: a no-op.
  at::Tensor k0 = cache.keys()[0].clone();
  cache.copy_prefix(2, {}, len);
  EXPECT_TENSOR_EQ(cache.keys()[0], k0);
}

TEST(KvCacheTest, BytesCountsKeysAndValuesOfEveryLayer) {
  const models::ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  KvCache f32 = make_cache(3, 5);
  const int64_t per_tensor = 3 * c.num_key_value_heads * 5 * c.resolved_head_dim();
  EXPECT_EQ(f32.bytes(), 2 * c.num_hidden_layers * per_tensor * 4);
  KvCache bf16(c, 3, 5, at::kBFloat16, at::kCPU);
  EXPECT_EQ(bf16.bytes(), 2 * c.num_hidden_layers * per_tensor * 2);
}

TEST(KvBudgetTest, RowBytesAreWhatEachRowOfARealCacheTakes) {
  for (const models::ModelConfig& c : {skyrl_tx::testing::tiny_qwen3_config(), skyrl_tx::testing::tiny_llama_config()}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      EXPECT_EQ(kv_cache_row_bytes(c, 7, dtype, 1) * 3, KvCache(c, 3, 7, dtype, at::kCPU).bytes());
    }
    // Tensor parallel: each rank holds its share of the KV heads.
    EXPECT_EQ(kv_cache_row_bytes(c, 7, at::kFloat, 2) * 2, kv_cache_row_bytes(c, 7, at::kFloat, 1));
    EXPECT_EQ(kv_cache_row_bytes(c, 7, at::kFloat, 2), KvCache(c, 1, 7, at::kFloat, at::kCPU, 2).bytes());
  }
}

TEST(KvBudgetTest, DeviceMemoryBudgetNeedsACudaDevice) {
  try {
    kv_rows_within_device_memory(at::kCPU, 0.5, 1024);
    FAIL() << "a CPU device has no memory fraction to size from";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("kv_cache_tokens"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace skyrl_tx::sampling
