// Test helper: the message of the InvalidArgument a call throws.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"

namespace skyrl_tx::testing {

// Message of the InvalidArgument `fn` throws ("" and a test failure when it throws nothing).
template <typename Fn>
std::string invalid_argument_message(Fn fn) {
  try {
    fn();
  } catch (const skyrl_tx::InvalidArgument& e) {
    return e.message();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
}

}  // namespace skyrl_tx::testing
