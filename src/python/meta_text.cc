#include "python/meta_text.h"

#include <charconv>
#include <cmath>

namespace efdl::python {

namespace {

constexpr char kHex[] = "0123456789abcdef";

void AppendEscape(std::string& out, Py_UCS4 unit) {
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(unit >> shift) & 0xf];
}

}  // namespace

bool AppendJsonString(std::string& out, PyObject* str) {
  if (!PyUnicode_Check(str)) return false;
  const int kind = PyUnicode_KIND(str);
  const void* data = PyUnicode_DATA(str);
  const Py_ssize_t n = PyUnicode_GET_LENGTH(str);
  out += '"';
  for (Py_ssize_t i = 0; i < n; ++i) {
    const Py_UCS4 c = PyUnicode_READ(kind, data, i);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c >= ' ' && c <= '~') {
          out += static_cast<char>(c);
        } else if (c > 0xffff) {  // a surrogate pair, as json.dumps writes it
          const Py_UCS4 v = c - 0x10000;
          AppendEscape(out, 0xd800 | ((v >> 10) & 0x3ff));
          AppendEscape(out, 0xdc00 | (v & 0x3ff));
        } else {
          AppendEscape(out, c);
        }
    }
  }
  out += '"';
  return true;
}

KwargKind FormatKwarg(PyObject* v, PyObject* tensor_type, std::string& text) {
  if (PyBool_Check(v)) {
    text += v == Py_True ? "true" : "false";
    return KwargKind::kJson;
  }
  if (PyLong_CheckExact(v)) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0 || (x == -1 && PyErr_Occurred())) {  // beyond int64: the pickle's
      PyErr_Clear();
      return KwargKind::kOther;
    }
    char num[32];
    text.append(num, std::to_chars(num, num + sizeof num, x).ptr);
    return KwargKind::kJson;
  }
  if (PyFloat_CheckExact(v)) {
    const double x = PyFloat_AS_DOUBLE(v);
    if (!std::isfinite(x)) return KwargKind::kOther;
    // repr(float): the shortest round trip, "1.0" not "1".
    char* r = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, nullptr);
    if (r == nullptr) {
      PyErr_Clear();
      return KwargKind::kOther;
    }
    text += r;
    PyMem_Free(r);
    return KwargKind::kJson;
  }
  if (v == Py_None) {
    text += "null";
    return KwargKind::kJson;
  }
  if (PyUnicode_CheckExact(v)) {
    // A str without a UTF-8 form (a lone surrogate) has no valid JSON text for the manifest's
    // parser either: the pickle carries it.
    if (PyUnicode_AsUTF8AndSize(v, nullptr) == nullptr) {
      PyErr_Clear();
      return KwargKind::kOther;
    }
    AppendJsonString(text, v);
    return KwargKind::kJson;
  }
  const int is_tensor = tensor_type != nullptr ? PyObject_IsInstance(v, tensor_type) : 0;
  if (is_tensor < 0) PyErr_Clear();
  return is_tensor == 1 ? KwargKind::kTensor : KwargKind::kOther;
}

std::string MetaText(std::string_view kwargs_json, std::string_view pickle_b64,
                     std::string_view program_field) {
  std::string meta;
  meta.reserve(kwargs_json.size() + pickle_b64.size() + program_field.size() + 48);
  meta += "{\"kwargs\":";
  meta += kwargs_json;
  meta += ",\"kwargs_exact\":true,\"pickle\":\"";
  meta += pickle_b64;
  meta += '"';
  meta += program_field;
  meta += '}';
  return meta;
}

std::string ProgramField(PyObject* program) {
  if (!PyUnicode_Check(program) || PyUnicode_GET_LENGTH(program) == 0) return "";
  std::string out = ",\"program\":";
  AppendJsonString(out, program);
  return out;
}

}  // namespace efdl::python
