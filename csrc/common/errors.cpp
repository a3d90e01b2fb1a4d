// Names of the error kinds, shared by logs and the Python bindings.
#include "common/errors.h"

namespace skyrl_tx {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "InvalidArgument";
    case ErrorKind::kNotFound: return "NotFound";
    case ErrorKind::kConflict: return "Conflict";
    case ErrorKind::kResourceExhausted: return "ResourceExhausted";
    case ErrorKind::kUnimplemented: return "Unimplemented";
    case ErrorKind::kInternal: return "Internal";
  }
  return "Internal";
}

}  // namespace skyrl_tx
