// Tests lora::AdapterRegistry slot allocation and LoraConfig validation.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "lora/adapter_registry.h"
#include "lora/lora_config.h"

namespace skyrl_tx::lora {
namespace {

bool message_has(const Error& e, const std::string& part) { return e.message().find(part) != std::string::npos; }

TEST(AdapterRegistry, AllocatesLowestFreeSlotFirst) {
  AdapterRegistry reg(3);
  EXPECT_EQ(reg.num_slots(), 4);
  EXPECT_EQ(reg.num_active(), 0);
  EXPECT_EQ(reg.allocate("a", {}), 1);
  EXPECT_EQ(reg.allocate("b", {}), 2);
  EXPECT_EQ(reg.allocate("c", {}), 3);
  EXPECT_EQ(reg.num_active(), 3);
  EXPECT_EQ(reg.slot_of("a"), 1);
  EXPECT_EQ(reg.slot_of("b"), 2);
  EXPECT_EQ(reg.slot_of("c"), 3);
  EXPECT_TRUE(reg.contains("b"));
  EXPECT_FALSE(reg.contains("d"));
}

TEST(AdapterRegistry, EmptyIdIsTheBaseModel) {
  AdapterRegistry reg(2);
  EXPECT_EQ(reg.slot_of(""), 0);
  EXPECT_THROW(reg.allocate("", {}), InvalidArgument);
  EXPECT_THROW(reg.release(""), InvalidArgument);
}

TEST(AdapterRegistry, DuplicateIdIsConflict) {
  AdapterRegistry reg(2);
  reg.allocate("a", {});
  try {
    reg.allocate("a", {});
    ADD_FAILURE() << "duplicate id accepted";
  } catch (const Conflict& e) {
    EXPECT_TRUE(message_has(e, "'a'")) << e.what();
  }
  EXPECT_EQ(reg.num_active(), 1);
}

TEST(AdapterRegistry, FullIsResourceExhausted) {
  AdapterRegistry reg(2);
  reg.allocate("a", {});
  reg.allocate("b", {});
  try {
    reg.allocate("c", {});
    ADD_FAILURE() << "allocation beyond capacity accepted";
  } catch (const ResourceExhausted& e) {
    EXPECT_TRUE(message_has(e, "max_lora_adapters")) << e.what();
  }
  EXPECT_FALSE(reg.contains("c"));
}

TEST(AdapterRegistry, UnknownIdIsNotFound) {
  AdapterRegistry reg(2);
  reg.allocate("a", {});
  EXPECT_THROW(reg.slot_of("nope"), NotFound);
  EXPECT_THROW(reg.release("nope"), NotFound);
  EXPECT_THROW(reg.config_of("nope"), NotFound);
}

TEST(AdapterRegistry, ReleaseThenReuseLowestSlot) {
  AdapterRegistry reg(3);
  reg.allocate("a", {});
  reg.allocate("b", {});
  reg.allocate("c", {});
  EXPECT_EQ(reg.release("a"), 1);  // released before the higher slot 3:
  EXPECT_EQ(reg.release("c"), 3);  // the free list must still hand out 1 first
  EXPECT_FALSE(reg.contains("a"));
  EXPECT_THROW(reg.slot_of("a"), NotFound);
  EXPECT_EQ(reg.allocate("d", {}), 1);  // lowest of {1, 3}
  EXPECT_EQ(reg.allocate("e", {}), 3);
  EXPECT_EQ(reg.num_active(), 3);
  EXPECT_THROW(reg.allocate("f", {}), ResourceExhausted);
}

TEST(AdapterRegistry, KeepsEachAdaptersConfig) {
  AdapterRegistry reg(2);
  LoraConfig one;
  one.rank = 4;
  one.alpha = 8.0;
  one.seed = 11;
  LoraConfig two;
  two.rank = 16;
  two.train_mlp = false;
  reg.allocate("one", one);
  reg.allocate("two", two);
  EXPECT_EQ(reg.config_of("one").rank, 4);
  EXPECT_EQ(reg.config_of("one").seed, 11u);
  EXPECT_DOUBLE_EQ(reg.config_of("one").scaling(), 2.0);
  EXPECT_EQ(reg.config_of("two").rank, 16);
  EXPECT_FALSE(reg.config_of("two").train_mlp);
  reg.release("one");
  EXPECT_THROW(reg.config_of("one"), NotFound);
}

TEST(AdapterRegistry, NeedsAtLeastOneSlot) { EXPECT_THROW(AdapterRegistry(0), InvalidArgument); }

TEST(LoraConfig, ScalingIsAlphaOverRank) {
  LoraConfig c;
  c.rank = 8;
  c.alpha = 16.0;
  EXPECT_DOUBLE_EQ(c.scaling(), 2.0);
}

TEST(LoraConfig, ValidateRejectsBadFields) {
  LoraConfig ok;
  ok.rank = 8;
  EXPECT_NO_THROW(ok.validate(8));

  LoraConfig too_big = ok;
  too_big.rank = 9;
  try {
    too_big.validate(8);
    ADD_FAILURE() << "rank above max accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(message_has(e, "max_lora_rank")) << e.what();
  }

  LoraConfig zero_rank = ok;
  zero_rank.rank = 0;
  EXPECT_THROW(zero_rank.validate(8), InvalidArgument);

  LoraConfig bad_alpha = ok;
  bad_alpha.alpha = 0.0;
  try {
    bad_alpha.validate(8);
    ADD_FAILURE() << "alpha 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(message_has(e, "alpha")) << e.what();
  }

  LoraConfig no_target = ok;
  no_target.train_attn = no_target.train_mlp = no_target.train_unembed = false;
  EXPECT_THROW(no_target.validate(8), InvalidArgument);
  no_target.train_unembed = true;
  EXPECT_NO_THROW(no_target.validate(8));
}

}  // namespace
}  // namespace skyrl_tx::lora
