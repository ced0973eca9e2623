// FastCommit: the per-commit path of efdl.state.State in C++.
//
// State.commit() in Python re-derives on every call what its tensors are (the optimizer's
// groups and state, the keyword arguments, the data pointers) and formats the manifest's meta
// text; in a small training loop that Python work cost more than the copy itself
// (docs/snapshots.md, "Measured"). After a commit taken by the Python path, State builds a
// FastCommit from that commit's plan. Commit() then checks, with direct CPython calls, that
// everything the plan was built from is still what it was, formats the meta text and copies.
// When anything changed it copies nothing and returns nullopt: the Python path runs instead and
// builds a new FastCommit. So it decides nothing on its own; it only repeats a commit whose
// inputs are proven unchanged.
//
// What "unchanged" means, exactly as State._fast_key and efdl._manifest.MetaWriter define it:
//  - the State's model, optimizer, scheduler (None), model cache and plan are the same objects;
//  - the optimizer's param_groups: the same "params" lists, of the same lengths, and every
//    group's values equal to the fingerprint of the cached meta (hyper-parameters, e.g. lr);
//  - the optimizer's state: the same parameters with the same state objects (all tensors);
//  - keyword arguments: tensors are the same objects under the same names, every other value
//    is an int, float, bool, None or str (formatted as JSON by meta_text.h, the meta text's one
//    writer, which the Python path uses too), nothing else;
//  - every tensor's data_ptr() is the address the plan copies from.
// Every object compared by identity is held by a reference, so an address cannot be reused.
// The State's parts come as a "view" dict (efdl._commit.fast_view: the keys model, optimizer,
// scheduler, _plan, _model_cache and _values, made anew for each call) that is not kept: holding
// the State's objects through it would make a reference cycle through State._fast that
// Python's collector cannot see, keeping the engine and its persister thread alive after the
// State is gone.
//
// Needs the GIL for everything except the copy, which releases it.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "efdl/snapshot.h"
#include "efdl/status.h"

namespace efdl::python {

struct FastCommitInputs {
  pybind11::object engine;       // the SnapshotEngine (a pybind11 object)
  pybind11::object plan;         // the efdl._commit.Plan the commit used
  pybind11::list tensors;        // plan.originals: the tensors copied, in layout order
  std::vector<uintptr_t> ptrs;   // their data_ptr() values
  pybind11::object model_cache;  // the model part's cached entries (None without a model)
  pybind11::object fingerprint;  // the MetaWriter's cache[0]: (id(opt), [(len(params), *values)])
  std::string pickle_blob;       // the MetaWriter's cache[1]
  pybind11::object tensor_type;  // torch.Tensor
  std::string meta_tail;         // the program field: appended to the meta object's members
};

// Over 12 members on purpose: the Python objects whose sameness each commit checks, held once
// (model, optimizer, parameter lists, optimizer state, keyword tensors, their sources), and the
// interned names, so that the per-commit path allocates no Python object of its own.
class FastCommit {
 public:
  // Fails (InvalidArgument) when the inputs do not describe a state the fast path can repeat.
  // `state_dict`: the view dict now (efdl._commit.fast_view; read, not kept).
  static Result<std::unique_ptr<FastCommit>> Create(FastCommitInputs in,
                                                    const pybind11::dict& state_dict);

  // The snapshot's seq, or nullopt when an input changed (nothing was copied). Errors of the
  // copy itself (e.g. shared memory full) come back as a Status.
  Result<std::optional<uint64_t>> Commit(int64_t step, const pybind11::dict& state_dict);

  // The meta text Commit() would write now, or nullopt where it would decline (for tests).
  std::optional<std::string> MetaText(const pybind11::dict& state_dict);

  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }

 private:
  explicit FastCommit(FastCommitInputs in) : in_(std::move(in)) {}
  static Result<std::unique_ptr<FastCommit>> CreateOrThrow(FastCommitInputs in,
                                                           const pybind11::dict& state_dict);
  bool StateUnchanged(PyObject* state_dict) const;
  bool OptimizerUnchanged() const;
  bool PointersUnchanged() const;
  // Appends the keyword arguments as a JSON object; false where the fast path cannot.
  bool AppendKwargs(PyObject* state_dict, std::string& out) const;

  FastCommitInputs in_;
  snapshot::SnapshotEngine* engine_ = nullptr;
  pybind11::object model_, optimizer_;
  std::vector<pybind11::object> param_lists_;   // each group's "params" list
  std::vector<pybind11::object> opt_state_;     // parameter, its state values..., per entry
  std::vector<size_t> opt_state_sizes_;         // values per entry
  std::vector<std::pair<pybind11::object, pybind11::object>> kw_tensors_;  // (name, tensor)
  std::vector<snapshot::TensorSource> sources_;
  // Interned names, made once: the per-commit path allocates no Python objects of its own.
  pybind11::object data_ptr_name_, params_key_, model_key_, optimizer_key_, scheduler_key_,
      plan_key_, model_cache_key_, values_key_, param_groups_name_, state_name_;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

}  // namespace efdl::python
