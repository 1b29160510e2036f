// cncore_jax's XLA FFI handler: a side-effecting custom call that hands XLA's own buffers to a
// Python function as memoryviews (inputs read-only, outputs writable), without copies.
//
// It is the FFI route to the core that JAX's `io_callback` takes through its own machinery:
// here XLA calls this handler directly (registered with jax.ffi.register_ffi_target), which
// takes the GIL and calls the dispatcher set by cn_set_dispatch with (fn_id, views).
// A Python exception becomes an FFI error carrying its type and message.
#include <Python.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static PyObject *g_dispatch = nullptr;  // owned reference
static char g_empty[1];                 // the address of zero-byte buffers

extern "C" void cn_set_dispatch(PyObject *fn) {
  Py_XINCREF(fn);
  Py_XSETREF(g_dispatch, fn);
}

static std::string pending_error() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  std::string msg = "cncore_jax host call failed";
  if (type != nullptr && value != nullptr) {
    PyObject *name = PyObject_GetAttrString(type, "__name__");
    PyObject *text = PyObject_Str(value);
    if (name && text) {
      const char *n = PyUnicode_AsUTF8(name), *t = PyUnicode_AsUTF8(text);
      if (n && t) msg = std::string(n) + ": " + t;
    }
    Py_XDECREF(name);
    Py_XDECREF(text);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return msg;
}

static PyObject *view(void *data, size_t bytes, int flags) {
  return PyMemoryView_FromMemory(bytes ? static_cast<char *>(data) : g_empty, (Py_ssize_t)bytes, flags);
}

static ffi::Error Call(int64_t fn_id, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string error;
  PyObject *views = PyTuple_New((Py_ssize_t)(args.size() + rets.size()));
  for (size_t i = 0; views && error.empty() && i < args.size(); i++) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) error = "cncore_jax: argument " + std::to_string(i) + " is not a buffer";
    else PyTuple_SET_ITEM(views, (Py_ssize_t)i, view(b->untyped_data(), b->size_bytes(), PyBUF_READ));
  }
  for (size_t i = 0; views && error.empty() && i < rets.size(); i++) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) error = "cncore_jax: result " + std::to_string(i) + " is not a buffer";
    else PyTuple_SET_ITEM(views, (Py_ssize_t)(args.size() + i),
                          view((*r)->untyped_data(), (*r)->size_bytes(), PyBUF_WRITE));
  }
  if (views == nullptr || g_dispatch == nullptr) error = "cncore_jax: the FFI bridge is not initialised";
  if (error.empty()) {
    PyObject *res = PyObject_CallFunction(g_dispatch, "LO", (long long)fn_id, views);
    if (res == nullptr) error = pending_error();
    Py_XDECREF(res);
  }
  Py_XDECREF(views);
  PyGILState_Release(gil);
  if (!error.empty()) return ffi::Error::Internal(error);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(cn_call, Call,
                              ffi::Ffi::Bind().Attr<int64_t>("fn_id").RemainingArgs().RemainingRets());
