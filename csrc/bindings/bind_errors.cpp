// Translates core errors and c10 errors into the pure-Python classes of skyrl_tx.errors.
#include <c10/util/Exception.h>

#include "bindings/bindings.h"
#include "common/errors.h"

namespace py = pybind11;

namespace skyrl_tx::bindings {
namespace {

// The classes live in Python (skyrl_tx/errors.py) so the API layer can catch them without importing _C.
void raise_python(const char* class_name, const std::string& message) {
  py::object cls = py::module_::import("skyrl_tx.errors").attr(class_name);
  PyErr_SetString(cls.ptr(), message.c_str());
}

const char* python_class(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "InvalidArgumentError";
    case ErrorKind::kNotFound: return "NotFoundError";
    case ErrorKind::kConflict: return "ConflictError";
    case ErrorKind::kResourceExhausted: return "ResourceExhaustedError";
    case ErrorKind::kUnimplemented: return "UnimplementedError";
    case ErrorKind::kInternal: return "InternalError";
  }
  return "InternalError";
}

}  // namespace

void bind_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_python(python_class(e.kind()), e.message());
    } catch (const c10::OutOfMemoryError& e) {
      raise_python("ResourceExhaustedError", std::string("out of memory: ") + e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      raise_python("InvalidArgumentError", e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      raise_python("InvalidArgumentError", e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      raise_python("InvalidArgumentError", e.what_without_backtrace());
    } catch (const c10::Error& e) {
      raise_python("InternalError", e.what_without_backtrace());
    }
  });
  // Test hook: lets tests/ext check the C++ → Python mapping of every kind end to end.
  m.def("_raise_for_test", [](const std::string& kind, const std::string& message) {
    if (kind == "InvalidArgument") throw InvalidArgument(message);
    if (kind == "NotFound") throw NotFound(message);
    if (kind == "Conflict") throw Conflict(message);
    if (kind == "ResourceExhausted") throw ResourceExhausted(message);
    if (kind == "Unimplemented") throw Unimplemented(message);
    if (kind == "c10") TORCH_CHECK(false, message);
    if (kind == "c10_value") TORCH_CHECK_VALUE(false, message);
    throw Internal(message);
  });
}

}  // namespace skyrl_tx::bindings
