// efdl._efdl: the Python face of the C++ core (today: the snapshot engine).
//
// Statuses become Python exceptions only here: SnapshotError (a RuntimeError) carrying the
// Status message. Long operations (commit, restore, flush, candidates) run without the GIL
// (py::call_guard): their bodies make no Python call, and an error leaves them as a C++
// StatusError that the translator below turns into SnapshotError once the GIL is back.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/env_names.h"
#include "efdl/snapshot.h"
#include "health/progress_board.h"
#include "python/fast_commit.h"
#include "python/meta_text.h"
#include "snapshot/arena_dir.h"
#include "snapshot/persist_settings.h"
#include "snapshot/scope.h"

namespace py = pybind11;
namespace snap = efdl::snapshot;

namespace {

// Set once at module import; the exception type object lives as long as the module.
PyObject* g_snapshot_error = nullptr;  // NOLINT: Python exception types are process-wide

// A failed Status on its way out of a binding; needs no GIL to throw.
struct StatusError {
  efdl::Status status;
};

[[noreturn]] void Raise(const efdl::Status& s) { throw StatusError{s}; }

using ReleaseGil = py::call_guard<py::gil_scoped_release>;

template <class T>
T Unwrap(efdl::Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

void Check(const efdl::Status& s) {
  if (!s.ok()) Raise(s);
}

using TensorTuple = std::tuple<std::string, std::string, std::vector<int64_t>, uint64_t>;

py::list TensorsOf(const snap::Manifest& m) {
  py::list out;
  for (const auto& t : m.tensors) out.append(py::make_tuple(t.name, t.dtype, t.shape, t.nbytes));
  return out;
}

}  // namespace

PYBIND11_MODULE(_efdl, m) {
  m.doc() = "EFDL's C++ core: in-memory snapshots with asynchronous persistence";
  static py::exception<std::runtime_error> snapshot_error(m, "SnapshotError");
  g_snapshot_error = snapshot_error.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      PyErr_SetString(g_snapshot_error, e.status.message().c_str());
    }
  });

  py::class_<snap::SnapshotRef>(m, "SnapshotRef")
      .def_property_readonly("source",
                             [](const snap::SnapshotRef& r) {
                               return r.source == snap::SnapshotRef::Source::kMemory ? "memory"
                                                                                     : "storage";
                             })
      .def_readonly("path", &snap::SnapshotRef::path)
      .def_readonly("slot", &snap::SnapshotRef::slot)
      .def_property_readonly("seq", [](const snap::SnapshotRef& r) { return r.manifest.seq; })
      .def_property_readonly("step", [](const snap::SnapshotRef& r) { return r.manifest.step; })
      .def_property_readonly("wall_time",
                             [](const snap::SnapshotRef& r) { return r.manifest.wall_time; })
      .def_property_readonly("job", [](const snap::SnapshotRef& r) { return r.manifest.job; })
      .def_property_readonly("meta_json",
                             [](const snap::SnapshotRef& r) { return r.manifest.meta_json; })
      .def_property_readonly("tensors",
                             [](const snap::SnapshotRef& r) { return TensorsOf(r.manifest); })
      .def("__repr__", [](const snap::SnapshotRef& r) {
        return "<SnapshotRef " + std::string(r.source == snap::SnapshotRef::Source::kMemory
                                                 ? "memory"
                                                 : "storage") +
               " seq=" + std::to_string(r.manifest.seq) + " step=" +
               std::to_string(r.manifest.step) + ">";
      });

  m.attr("DEFAULT_SNAPSHOT_SLOTS") = snap::EngineOptions{}.num_slots;
  py::class_<snap::SnapshotEngine>(m, "SnapshotEngine")
      .def(py::init([](std::string job_id, std::string scope, std::string arena_path,
                       std::string storage_dir, int num_slots, int keep, bool persist,
                       int copy_threads, int64_t persist_min_interval_ms, std::string hmac_key,
                       bool commit_checksum) {
             snap::EngineOptions o;
             o.job_id = std::move(job_id);
             o.scope = std::move(scope);
             o.arena_path = std::move(arena_path);
             o.storage_dir = std::move(storage_dir);
             o.num_slots = num_slots;
             o.keep = keep;
             o.persist = persist;
             o.copy_threads = copy_threads;
             o.persist_min_interval = std::chrono::milliseconds(persist_min_interval_ms);
             o.hmac_key = std::move(hmac_key);
             o.commit_checksum = commit_checksum;
             return Unwrap(snap::SnapshotEngine::Open(std::move(o)));
           }),
           py::arg("job_id"), py::arg("scope"), py::arg("arena_path"), py::arg("storage_dir"),
           py::arg("num_slots") = snap::EngineOptions{}.num_slots, py::arg("keep") = 2, py::arg("persist") = true,
           py::arg("copy_threads") = 0, py::arg("persist_min_interval_ms") = 0,
           py::arg("hmac_key") = "", py::arg("commit_checksum") = false)
      .def(
          "set_layout",
          [](snap::SnapshotEngine& e, const std::vector<TensorTuple>& tensors) {
            std::vector<snap::TensorEntry> entries;
            entries.reserve(tensors.size());
            for (const auto& [name, dtype, shape, nbytes] : tensors) {
              entries.push_back({name, dtype, shape, 0, nbytes});
            }
            Check(e.SetLayout(std::move(entries)));
          },
          "Fixes the tensors (name, dtype, shape, nbytes) of the following commits.")
      .def(
          "commit",
          [](snap::SnapshotEngine& e, const std::vector<uintptr_t>& ptrs, int64_t step,
             const std::string& meta_json, const py::object& fill) {
            std::vector<snap::TensorSource> sources(ptrs.size());
            for (size_t i = 0; i < ptrs.size(); ++i) {
              sources[i].data = reinterpret_cast<const void*>(ptrs[i]);
            }
            snap::FillFn fill_fn;
            if (!fill.is_none()) {
              fill_fn = [&fill](size_t index, void* dst) -> efdl::Status {
                py::gil_scoped_acquire gil;
                try {
                  fill(index, reinterpret_cast<uintptr_t>(dst));
                } catch (py::error_already_set& err) {
                  return efdl::Status::Internal(std::string("device-to-host copy failed: ") +
                                                err.what());
                }
                return efdl::Status::OK();
              };
            }
            return Unwrap(e.Commit(sources, step, meta_json, fill_fn));
          },
          ReleaseGil(), py::arg("ptrs"), py::arg("step"), py::arg("meta_json"),
          py::arg("fill") = py::none(),
          "Copies the tensors at ptrs (0: call fill(index, address)) into shared memory and "
          "publishes them; returns the snapshot's seq.")
      .def(
          "flush",
          [](snap::SnapshotEngine& e, double timeout_s) {
            Check(e.Flush(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))));
          },
          ReleaseGil(), py::arg("timeout_s") = 60.0)
      .def("last_persist_error",
           [](const snap::SnapshotEngine& e) -> py::object {
             efdl::Status s = e.LastPersistStatus();
             if (s.ok()) return py::none();
             return py::str(s.message());
           })
      .def("candidates", &snap::SnapshotEngine::Candidates, ReleaseGil())
      .def(
          "restore",
          [](snap::SnapshotEngine& e, const snap::SnapshotRef& ref,
             const std::vector<uintptr_t>& ptrs) {
            std::vector<void*> dst(ptrs.size());
            for (size_t i = 0; i < ptrs.size(); ++i) dst[i] = reinterpret_cast<void*>(ptrs[i]);
            Check(e.Restore(ref, dst));
          },
          ReleaseGil(), py::arg("ref"), py::arg("ptrs"))
      .def_property_readonly("next_seq", &snap::SnapshotEngine::next_seq)
      .def("advance_seq", &snap::SnapshotEngine::AdvanceSeq, py::arg("seq"),
           "Makes the next commit's seq at least `seq` (aligns the ranks of a round).");

  // The persistence settings (snapshot/persist_settings.h): one parser, used by state.py and the
  // agent. A refused value is a ValueError (a setting, not a snapshot, is wrong), as it was when
  // state.py parsed them itself.
  py::class_<snap::PersistSettings>(m, "PersistSettings")
      .def_readonly("per_rank", &snap::PersistSettings::per_rank)
      .def_readonly("keep", &snap::PersistSettings::keep)
      .def_property_readonly("min_interval_ms",
                             [](const snap::PersistSettings& s) {
                               return static_cast<int64_t>(s.min_interval.count());
                             })
      .def_readonly("hmac_key", &snap::PersistSettings::hmac_key);
  m.def(
      "persist_settings",
      [] {
        const char* secret = std::getenv(efdl::envvar::kJobSecret);
        auto settings = snap::PersistSettingsFromEnvironment(
            [](const char* name) -> const char* { return std::getenv(name); },
            secret != nullptr ? secret : "");
        if (!settings.ok()) throw py::value_error(settings.status().message());
        return std::move(settings).value();
      },
      "EFDL_SNAPSHOT_PER_RANK, EFDL_SNAPSHOT_KEEP, EFDL_PERSIST_MIN_INTERVAL_MS and "
      "EFDL_SNAPSHOT_HMAC (keyed with EFDL_JOB_SECRET) of this process' environment; "
      "ValueError with one line for a refused value.");

  // The arena naming contract (snapshot/arena_dir.h): one owner, used by state.py and the agent.
  m.def("shm_dir", [] { return snap::ShmDir(std::getenv(efdl::envvar::kShmDir)); },
        "EFDL_SHM_DIR, or /dev/shm.");
  m.def("local_job_id", &snap::LocalJobId, py::arg("program"),
        "The job id of a program run without one: local-<stem>-<8 hex of its real path's SHA-1>");
  m.def("arena_path", &snap::ArenaPath, py::arg("dir"), py::arg("job"), py::arg("holder"),
        py::arg("scope"), "<dir>/efdl-<job>-<holder>-<scope>.arena");
  m.def("peer_arena_scope", &snap::PeerArenaScope, py::arg("scope"),
        "The scope of the peer copy of scope 'rank<N>' ('peer.rank<N>': issue #35 part 2).");
  m.def("holder_name", &snap::HolderName, py::arg("host"), py::arg("index"),
        "The arena holder '<host>.<index>' (what an agent passes its workers as "
        "EFDL_ARENA_HOLDER).");

  // Whose snapshot goes where (snapshot/scope.h): one owner, used by state.py and the agent.
  py::class_<snap::SnapshotRole>(m, "SnapshotRole")
      .def_readonly("scope", &snap::SnapshotRole::scope)
      .def_readonly("writes_arena", &snap::SnapshotRole::writes_arena)
      .def_readonly("stored", &snap::SnapshotRole::stored);
  m.def("snapshot_role", &snap::RoleOf, py::arg("per_rank"), py::arg("rank"), py::arg("local_rank"),
        "The arena scope of this process ('node' or 'rank<N>'), whether it writes that arena, and "
        "whether that arena's snapshots go to storage.");
  m.def("store_dir", &snap::StoreDir, py::arg("snapshot_dir"), py::arg("job"), py::arg("per_rank"),
        py::arg("rank"), "<snapshot_dir>/<job>, or <snapshot_dir>/<job>/rank-<rank> per rank.");
  py::class_<snap::HolderLock>(m, "HolderLock",
                               "A held arena holder lock (flock); released when dropped.")
      .def_static(
          "acquire",
          [](const std::string& dir, const std::string& job, const std::string& host,
             const std::string& what) {
            return Unwrap(snap::HolderLock::Acquire(dir, job, host, what));
          },
          py::arg("dir"), py::arg("job"), py::arg("host"), py::arg("what"))
      .def_static(
          "lock_shared",
          [](const std::string& dir, const std::string& job, const std::string& holder,
             const std::string& what) -> py::object {
            auto lock = Unwrap(snap::HolderLock::TryLockPath(
                snap::HolderLockPath(dir, job, holder), /*shared=*/true));
            if (lock == nullptr) return py::none();
            lock->SetOwner(what);
            return py::cast(std::move(lock));
          },
          py::arg("dir"), py::arg("job"), py::arg("holder"), py::arg("what"),
          "A shared lock on this holder (None when an agent holds it exclusively).")
      .def_property_readonly("holder", &snap::HolderLock::holder)
      .def_property_readonly("path", &snap::HolderLock::path)
      .def("remove_file", &snap::HolderLock::RemoveFile,
           "Unlinks the lock file (still held: nobody can take this one).");

  m.def("remove_orphan_locks", &snap::RemoveOrphanLocks, py::arg("dir"),
        "Removes lock files nobody holds and no arena belongs to; returns how many.");

  // The meta text of State's snapshots (python/meta_text.h): one writer for both commit paths.
  m.def(
      "meta_kwargs",
      [](const py::dict& values, const py::object& tensor_type,
         const py::object& display) -> py::tuple {
        namespace ep = efdl::python;
        std::string out = "{";
        py::object rest = py::none();
        bool first = true;
        std::string text;
        // A copy of the items: display() runs Python code.
        for (const py::handle item : py::list(values.attr("items")())) {
          const py::object key = item[py::int_(0)], value = item[py::int_(1)];
          text.clear();
          const ep::KwargKind kind = ep::FormatKwarg(value.ptr(), tensor_type.ptr(), text);
          if (kind == ep::KwargKind::kTensor) continue;
          if (kind == ep::KwargKind::kOther) {
            if (rest.is_none()) rest = py::dict();
            rest[key] = value;
            text = py::str(display(value)).cast<std::string>();
          }
          if (!first) out += ',';
          first = false;
          ep::AppendJsonString(out, py::str(key).ptr());
          out += ':';
          out += text;
        }
        out += '}';
        return py::make_tuple(py::str(out), rest);
      },
      py::arg("values"), py::arg("tensor_type"), py::arg("display"),
      "(the \"kwargs\" object's JSON text, a dict of the values only the pickle carries or "
      "None): values of the tensor type are left out, the others written exactly as JSON "
      "where it carries them exactly, else as display(value) (a JSON text).");
  m.def(
      "meta_text",
      [](const std::string& kwargs_json, const std::string& pickle_b64,
         const std::string& program_field) {
        return py::str(efdl::python::MetaText(kwargs_json, pickle_b64, program_field));
      },
      py::arg("kwargs_json"), py::arg("pickle_b64"), py::arg("program_field"),
      "{\"kwargs\":K,\"kwargs_exact\":true,\"pickle\":\"P\"<program_field>}");
  m.def(
      "program_field",
      [](const py::str& program) { return py::str(efdl::python::ProgramField(program.ptr())); },
      py::arg("program"), "',\"program\":\"<program>\"', or '' for an empty name.");

  using efdl::python::FastCommit;
  py::class_<FastCommit>(m, "FastCommit",
                         "efdl.state.State's per-commit path in C++ (src/python/fast_commit.h).")
      .def(py::init([](py::object engine, py::dict state_dict, py::object plan, py::list tensors,
                       std::vector<uintptr_t> ptrs, py::object model_cache,
                       py::tuple fingerprint, std::string pickle_blob, py::object tensor_type,
                       std::string meta_tail) {
             efdl::python::FastCommitInputs in{std::move(engine),      std::move(plan),
                                               std::move(tensors),     std::move(ptrs),
                                               std::move(model_cache), std::move(fingerprint),
                                               std::move(pickle_blob), std::move(tensor_type),
                                               std::move(meta_tail)};
             return Unwrap(FastCommit::Create(std::move(in), state_dict));
           }),
           py::arg("engine"), py::arg("state_dict"), py::arg("plan"), py::arg("tensors"),
           py::arg("ptrs"), py::arg("model_cache"), py::arg("fingerprint"),
           py::arg("pickle_blob"), py::arg("tensor_type"), py::arg("meta_tail") = "")
      .def(
          "commit",
          [](FastCommit& f, int64_t step, const py::dict& state_dict) -> py::object {
            std::optional<uint64_t> seq = Unwrap(f.Commit(step, state_dict));
            return seq ? py::object(py::int_(*seq)) : py::object(py::none());
          },
          py::arg("step"), py::arg("state_dict"),
          "Commits when nothing the fast path relies on changed (returns the seq); else copies "
          "nothing and returns None.")
      .def("meta_text",
           [](FastCommit& f, const py::dict& state_dict) -> py::object {
             auto text = f.MetaText(state_dict);
             return text ? py::object(py::str(*text)) : py::object(py::none());
           })
      .def_property_readonly("hits", &FastCommit::hits)
      .def_property_readonly("misses", &FastCommit::misses);

  // The progress board (src/health/progress_board.h, issue #32): a worker's reports to its agent.
  namespace health = efdl::health;
  struct Slot {
    std::unique_ptr<health::ProgressBoard> board;
    int slot = 0;
  };
  py::class_<Slot>(m, "ProgressSlot",
                   "This worker's slot of its agent's progress board (a few stores per report).")
      .def(py::init([](const std::string& path, int slot) {
             auto board = Unwrap(health::ProgressBoard::Open(path));
             if (slot < 0 || slot >= board->slots()) {
               Raise(efdl::Status::InvalidArgument("progress slot out of range"));
             }
             return Slot{std::move(board), slot};
           }),
           py::arg("path"), py::arg("slot"))
      .def(
          "beat",
          [](Slot& s, int64_t step, int64_t uncommitted, int64_t samples) {
            s.board->Beat(s.slot, step, static_cast<int32_t>(::getpid()), uncommitted, samples);
          },
          py::arg("step") = -1, py::arg("uncommitted") = -1, py::arg("samples") = -1)
      .def("committed", [](Slot& s) { s.board->Committed(s.slot); })
      .def("restored", [](Slot& s) { s.board->Restored(s.slot); })
      .def(
          "add_compute", [](Slot& s, int64_t ns) { s.board->AddCompute(s.slot, ns); },
          py::arg("ns"))
      .def(
          "expect_pause",
          [](Slot& s, double seconds) {
            s.board->ExpectPause(s.slot, seconds, static_cast<int32_t>(::getpid()));
          },
          py::arg("seconds"));
}
