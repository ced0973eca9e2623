#include "python/fast_commit.h"

#include <string_view>

#include "python/meta_text.h"

namespace py = pybind11;

namespace efdl::python {

namespace {

py::object Interned(const char* s) {
  return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(s));
}

// A borrowed item of a dict by a str key, nullptr when absent (or on an error, cleared).
PyObject* Item(PyObject* dict, const py::object& key) {
  PyObject* v = PyDict_GetItemWithError(dict, key.ptr());
  if (v == nullptr) PyErr_Clear();
  return v;
}

}  // namespace

Result<std::unique_ptr<FastCommit>> FastCommit::Create(FastCommitInputs in,
                                                       const py::dict& state_dict) {
  try {
    return CreateOrThrow(std::move(in), state_dict);
  } catch (const std::exception& e) {  // a cast of an object that is not what State keeps there
    PyErr_Clear();
    return Status::InvalidArgument(std::string("FastCommit: ") + e.what());
  }
}

Result<std::unique_ptr<FastCommit>> FastCommit::CreateOrThrow(FastCommitInputs in,
                                                              const py::dict& state_dict) {
  std::unique_ptr<FastCommit> f(new FastCommit(std::move(in)));
  const FastCommitInputs& x = f->in_;
  try {
    f->engine_ = x.engine.cast<snapshot::SnapshotEngine*>();
  } catch (const py::cast_error&) {
    return Status::InvalidArgument("FastCommit: engine is not a SnapshotEngine");
  }
  if (static_cast<size_t>(py::len(x.tensors)) != x.ptrs.size() ||
      x.ptrs.size() != f->engine_->layout().size()) {
    return Status::InvalidArgument("FastCommit: tensors, pointers and layout differ in number");
  }
  for (uintptr_t p : x.ptrs) {
    if (p == 0) return Status::InvalidArgument("FastCommit: a tensor without host memory");
    f->sources_.push_back({reinterpret_cast<const void*>(p)});
  }
  if (!state_dict.contains("scheduler") || !state_dict["scheduler"].is_none()) {
    return Status::InvalidArgument("FastCommit: a state with a scheduler");
  }
  f->model_ = state_dict["model"];
  f->optimizer_ = state_dict["optimizer"];
  f->data_ptr_name_ = Interned("data_ptr");
  f->params_key_ = Interned("params");
  f->model_key_ = Interned("model");
  f->optimizer_key_ = Interned("optimizer");
  f->scheduler_key_ = Interned("scheduler");
  f->plan_key_ = Interned("_plan");
  f->model_cache_key_ = Interned("_model_cache");
  f->values_key_ = Interned("_values");
  f->param_groups_name_ = Interned("param_groups");
  f->state_name_ = Interned("state");
  py::object groups_fp = py::reinterpret_borrow<py::tuple>(x.fingerprint)[1];
  if (!f->optimizer_.is_none()) {
    py::list groups = f->optimizer_.attr("param_groups");
    if (groups_fp.is_none() || py::len(groups_fp) != py::len(groups)) {
      return Status::InvalidArgument("FastCommit: the fingerprint does not match the groups");
    }
    for (py::handle g : groups) {
      f->param_lists_.push_back(py::reinterpret_borrow<py::dict>(g)["params"]);
    }
    py::dict state = f->optimizer_.attr("state");
    for (auto [p, st] : state) {
      if (!PyDict_Check(st.ptr())) {
        return Status::InvalidArgument("FastCommit: optimizer state that is not a dict");
      }
      f->opt_state_.push_back(py::reinterpret_borrow<py::object>(p));
      size_t n = 0;
      for (auto [key, v] : py::reinterpret_borrow<py::dict>(st)) {
        (void)key;
        if (PyObject_IsInstance(v.ptr(), x.tensor_type.ptr()) != 1) {
          PyErr_Clear();
          return Status::InvalidArgument("FastCommit: optimizer state that is not a tensor");
        }
        f->opt_state_.push_back(py::reinterpret_borrow<py::object>(v));
        ++n;
      }
      f->opt_state_sizes_.push_back(n);
    }
  }
  py::dict values = state_dict["_values"];
  for (auto [k, v] : values) {
    if (PyObject_IsInstance(v.ptr(), x.tensor_type.ptr()) == 1) {
      f->kw_tensors_.emplace_back(py::reinterpret_borrow<py::object>(k),
                                  py::reinterpret_borrow<py::object>(v));
    }
    PyErr_Clear();
  }
  return f;
}

bool FastCommit::StateUnchanged(PyObject* d) const {
  return Item(d, model_key_) == model_.ptr() && Item(d, optimizer_key_) == optimizer_.ptr() &&
         Item(d, scheduler_key_) == Py_None && Item(d, plan_key_) == in_.plan.ptr() &&
         Item(d, model_cache_key_) == in_.model_cache.ptr();
}

bool FastCommit::OptimizerUnchanged() const {
  if (optimizer_.is_none()) return true;
  PyObject* opt = optimizer_.ptr();
  auto groups = py::reinterpret_steal<py::object>(PyObject_GetAttr(opt, param_groups_name_.ptr()));
  if (!groups || !PyList_Check(groups.ptr())) {
    PyErr_Clear();
    return false;
  }
  PyObject* fps = PyTuple_GET_ITEM(in_.fingerprint.ptr(), 1);
  const Py_ssize_t ngroups = PyList_GET_SIZE(groups.ptr());
  if (ngroups != static_cast<Py_ssize_t>(param_lists_.size()) || !PyList_Check(fps) ||
      PyList_GET_SIZE(fps) != ngroups) {
    return false;
  }
  for (Py_ssize_t i = 0; i < ngroups; ++i) {
    PyObject* g = PyList_GET_ITEM(groups.ptr(), i);
    PyObject* fp = PyList_GET_ITEM(fps, i);
    if (!PyDict_Check(g) || !PyTuple_Check(fp)) return false;
    PyObject* params = Item(g, params_key_);
    if (params != param_lists_[i].ptr() || !PyList_Check(params)) return false;
    // The fingerprint: (len(params), *values) as efdl._manifest.MetaWriter made it.
    if (PyTuple_GET_SIZE(fp) != PyDict_Size(g) + 1) return false;
    const long len = PyLong_AsLong(PyTuple_GET_ITEM(fp, 0));
    if (len != PyList_GET_SIZE(params)) {
      PyErr_Clear();
      return false;
    }
    Py_ssize_t pos = 0, j = 1;
    PyObject *key, *value;
    while (PyDict_Next(g, &pos, &key, &value)) {
      int same = PyObject_RichCompareBool(value, PyTuple_GET_ITEM(fp, j++), Py_EQ);
      if (same != 1) {
        PyErr_Clear();
        return false;
      }
    }
  }
  py::object state = py::reinterpret_steal<py::object>(PyObject_GetAttr(opt, state_name_.ptr()));
  if (!state || !PyDict_Check(state.ptr()) ||
      PyDict_Size(state.ptr()) != static_cast<Py_ssize_t>(opt_state_sizes_.size())) {
    PyErr_Clear();
    return false;
  }
  Py_ssize_t pos = 0;
  PyObject *p, *st;
  size_t at = 0, entry = 0;
  while (PyDict_Next(state.ptr(), &pos, &p, &st)) {
    if (p != opt_state_[at++].ptr() || !PyDict_Check(st) ||
        PyDict_Size(st) != static_cast<Py_ssize_t>(opt_state_sizes_[entry++])) {
      return false;
    }
    Py_ssize_t spos = 0;
    PyObject *key, *v;
    while (PyDict_Next(st, &spos, &key, &v)) {
      if (v != opt_state_[at++].ptr()) return false;
    }
  }
  return true;
}

bool FastCommit::PointersUnchanged() const {
  PyObject* list = in_.tensors.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  if (n != static_cast<Py_ssize_t>(in_.ptrs.size())) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* r = PyObject_CallMethodNoArgs(PyList_GET_ITEM(list, i), data_ptr_name_.ptr());
    if (r == nullptr) {
      PyErr_Clear();
      return false;
    }
    const unsigned long long p = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    if (p != in_.ptrs[static_cast<size_t>(i)]) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

bool FastCommit::AppendKwargs(PyObject* state_dict, std::string& out) const {
  PyObject* values = Item(state_dict, values_key_);
  if (values == nullptr || !PyDict_Check(values)) return false;
  out += '{';
  bool first = true;
  size_t tensor_at = 0;
  Py_ssize_t pos = 0;
  PyObject *k, *v;
  std::string text;
  while (PyDict_Next(values, &pos, &k, &v)) {
    if (!PyUnicode_CheckExact(k)) return false;
    text.clear();
    switch (FormatKwarg(v, in_.tensor_type.ptr(), text)) {  // meta_text.h: the Python path's too
      case KwargKind::kJson:
        break;
      case KwargKind::kTensor: {
        // Not in the meta text; the same object under the same name as when built.
        if (tensor_at >= kw_tensors_.size()) return false;
        const auto& [name, tensor] = kw_tensors_[tensor_at++];
        if (tensor.ptr() != v || PyUnicode_Compare(name.ptr(), k) != 0) {
          PyErr_Clear();
          return false;
        }
        continue;
      }
      case KwargKind::kOther:
        return false;  // a value only the pickle carries exactly: the Python path's commit
    }
    if (!first) out += ',';
    first = false;
    AppendJsonString(out, k);
    out += ':';
    out += text;
  }
  out += '}';
  return tensor_at == kw_tensors_.size();
}

std::optional<std::string> FastCommit::MetaText(const py::dict& state_dict) {
  std::string kwargs;
  if (!AppendKwargs(state_dict.ptr(), kwargs)) return std::nullopt;
  return python::MetaText(kwargs, in_.pickle_blob, in_.meta_tail);
}

Result<std::optional<uint64_t>> FastCommit::Commit(int64_t step, const py::dict& state_dict) {
  std::optional<std::string> meta;
  if (StateUnchanged(state_dict.ptr()) && OptimizerUnchanged() && PointersUnchanged()) {
    meta = MetaText(state_dict);
  }
  if (!meta) {
    ++misses_;
    return std::optional<uint64_t>();
  }
  // The copy runs without the GIL; everything above needed it (it reads Python objects).
  Result<uint64_t> r = [&] {
    py::gil_scoped_release release;
    return engine_->Commit(sources_, step, *meta, {});
  }();
  if (!r.ok()) return r.status();
  ++hits_;
  return std::optional<uint64_t>(*r);
}

}  // namespace efdl::python
