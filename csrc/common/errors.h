// Typed errors thrown by the core; the bindings map each kind to a Python class and an HTTP status.
#pragma once

#include <exception>
#include <sstream>
#include <string>
#include <vector>

namespace skyrl_tx {

enum class ErrorKind { kInvalidArgument, kNotFound, kConflict, kResourceExhausted, kUnimplemented, kInternal };

const char* error_kind_name(ErrorKind kind);

/// Base of every error the core throws. `message()` is user-facing; file/line are kept apart for logs.
class Error : public std::exception {
 public:
  Error(ErrorKind kind, std::string message, const char* file = "", int line = 0)
      : kind_(kind), message_(std::move(message)), file_(file), line_(line) {}
  const char* what() const noexcept override { return message_.c_str(); }
  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  ErrorKind kind_;
  std::string message_;
  const char* file_;
  int line_;
};

#define SKYRL_TX_DEFINE_ERROR(Name)                                                 \
  class Name : public Error {                                                       \
   public:                                                                          \
    explicit Name(std::string message, const char* file = "", int line = 0)       \
        : Error(ErrorKind::k##Name, std::move(message), file, line) {}              \
  };
SKYRL_TX_DEFINE_ERROR(InvalidArgument)
SKYRL_TX_DEFINE_ERROR(NotFound)
SKYRL_TX_DEFINE_ERROR(Conflict)
SKYRL_TX_DEFINE_ERROR(ResourceExhausted)
SKYRL_TX_DEFINE_ERROR(Unimplemented)
SKYRL_TX_DEFINE_ERROR(Internal)
#undef SKYRL_TX_DEFINE_ERROR

/// Concatenates streamable parts into one message string.
template <typename... Parts>
std::string str_cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// "a, b, c": the choices an error message lists.
inline std::string join_with_commas(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

}  // namespace skyrl_tx

/// Throws skyrl_tx::Kind with a message built from the remaining parts when `cond` is false.
#define SKYRL_TX_CHECK(cond, Kind, ...)                                               \
  do {                                                                                \
    if (!(cond)) throw ::skyrl_tx::Kind(::skyrl_tx::str_cat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

/// Broken internal invariant: maps to a 500, never to a user error.
#define SKYRL_TX_INTERNAL_ASSERT(cond, ...) \
  SKYRL_TX_CHECK(cond, Internal, "internal invariant violated: " #cond " ", ##__VA_ARGS__)
