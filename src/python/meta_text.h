// The meta text of State's snapshots (issue #31): its one writer, for State's Python path
// (python/efdl/_manifest.py MetaWriter, through efdl._efdl.meta_kwargs / meta_text /
// program_field) and the compiled commit path (fast_commit.h). The format is
//
//     {"kwargs":{...},"kwargs_exact":true,"pickle":"<base64>","program":"train.py"}
//
// (docs/snapshots.md; _manifest.py says what each member holds and how it is read back). Strings
// are written as Python's json.dumps writes them (ensure_ascii: every character outside printable
// ASCII as \uXXXX), so the text is the same byte for byte whichever path wrote it.
//
// Needs the GIL.
#pragma once

#include <Python.h>

#include <string>
#include <string_view>

namespace efdl::python {

// How a keyword argument goes into the meta text.
enum class KwargKind {
  kJson,    // written exactly as JSON (an int in int64's range, a finite float, a bool, None, a
            // str that has a UTF-8 form); the text is appended
  kTensor,  // an instance of the tensor type: not in the meta text (the snapshot's tensors)
  kOther,   // anything else: carried by the pickle (with a readable JSON form in "kwargs")
};
KwargKind FormatKwarg(PyObject* value, PyObject* tensor_type, std::string& text);

// Appends a str object as json.dumps writes it (ensure_ascii). False (and no error set) for an
// object that is not a str.
bool AppendJsonString(std::string& out, PyObject* str);

// The members after "kwargs": {"kwargs":<kwargs_json>,"kwargs_exact":true,"pickle":"<pickle>"
// <program_field>}.
std::string MetaText(std::string_view kwargs_json, std::string_view pickle_b64,
                     std::string_view program_field);

// ,"program":"<program>", or "" for a program without a name.
std::string ProgramField(PyObject* program);

}  // namespace efdl::python
