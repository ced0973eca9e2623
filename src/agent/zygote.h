// The node's zygote: one python process (`python3 [options] -m efdl.preload --zygote FD`,
// python/efdl/preload.py) that paid for the interpreter and the imports once and forks the
// spares of the SparePool on request. A fork is ready in milliseconds and shares the zygote's
// pages copy-on-write, so a consumed spare is replaced at once (docs/agent.md, "Pre-started
// workers"; figures in docs/benchmarks.md).
//
// PROTOCOL (owned here; preload.py follows it). A SOCK_SEQPACKET socket pair, the zygote's end
// given as FD; every message is one JSON object in one packet.
//   zygote -> agent, once, after its imports: {"ready": true}; or {"error": "..."} and it exits
//     (its imports started threads: fork() would copy only one of them).
//   agent -> zygote: {"env": {NAME: VALUE, ...}} with four descriptors (SCM_RIGHTS): the read end
//     of the spare's message pipe, the write end of its ready pipe, the write ends of its stdout
//     and stderr pipes (the pipes of a started spare, SparePool).
//   zygote -> agent: {"pid": N} or {"error": "..."}.
//   agent -> zygote: {"import": [MODULE, ...]} without descriptors: import these too (a module
//     that fails to import is skipped); then {"ready": true} again, or {"error": "..."} and it
//     exits when they started a thread or torch initialised CUDA (a fork cannot use it).
//
// LEARNING THE PROGRAM'S IMPORTS. A worker forked from the zygote writes the installed modules
// its program imported (not private, from a site-packages/dist-packages directory or the
// standard library; never the program's own files) in import order as a JSON list to
// $EFDL_IMPORTS_DIR/imports-PID-N.json, 2 s and 30 s after its program started (a daemon thread:
// a worker stopped by SIGTERM never reaches its exit) and at its exit. The agent sends the ones the
// zygote lacks in an import request and forks the idle spares again once it answered. So a few
// seconds into the job, the program's `import sklearn` costs nothing at a round change either.
// A module that reads per-round variables at import time would see the zygote's environment:
// --no-learn-imports turns learning off.
// The zygote forks an intermediate process, which forks the spare, makes it a process group
// leader and exits; the zygote reaps the intermediate and only then answers. The spare is thus
// an orphan when the answer arrives, adopted by the agent, which must be a child subreaper
// (PR_SET_CHILD_SUBREAPER; Start refuses otherwise): the agent waits for it like for any child
// (Subprocess::Adopt). The spare waits until it is adopted, sets PR_SET_PDEATHSIG (and exits if
// its new parent is not the agent: the agent died meanwhile), takes the descriptors as its
// stdout and stderr, adds "env" to its environment, reseeds numpy's global generator if the
// zygote imported numpy (`random` reseeds itself at fork), and from then on is a started spare:
// it reports its imports done on the ready pipe and waits for its round's message.
//
// WHAT A FORK INHERITS, and why that is safe: the zygote's memory (the imported modules; it ran
// no program code and no torch operation, so torch's generator is in its start-up state as in a
// fresh interpreter), the interpreter's flags and hash seed (one per zygote instead of one per
// process: dict and set orders are the same on every local rank), its environment (the spare's
// start environment, applied per spare), and one thread: the zygote refuses to serve if its
// imports started a second one. It holds no CUDA context, no socket but its own end, and no
// lock; the zygote's descriptors other than the four passed are closed or replaced.
//
// Ownership: the Zygote owns the zygote process (its own process group, dying with the agent,
// listed with the GroupReaper). Destroying it closes the socket (the zygote exits at end of file)
// and stops the process; spares already forked are the SparePool's. Not thread-safe: used by the
// agent loop only.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/env_names.h"
#include "common/subprocess.h"
#include "efdl/status.h"

namespace efdl {
class GroupReaper;
}

namespace efdl::agent {

struct ZygoteOptions {
  std::vector<std::string> interpreter;         // `python3 -u`: the worker command's interpreter
  std::map<std::string, std::string> env_set;   // added to the agent's environment at start
  GroupReaper* reaper = nullptr;                // not owned
  // How long Fork waits for the zygote's answer.
  std::chrono::milliseconds fork_timeout{std::chrono::seconds(10)};
};

// The four pipe ends of one spare, as Fork hands them to the zygote (Fork closes them).
struct SpareDescriptors {
  int message_read = -1;
  int ready_write = -1;
  int stdout_write = -1;
  int stderr_write = -1;
};

// Where a forked worker writes its import report (the agent's own directory).
inline constexpr const char* kImportsDirVariable = envvar::kImportsDir;
// An import report's file name there: imports-PID-N.json, written as imports-PID-N.json.tmp and
// renamed (python/efdl/preload.py). `or_partial`: a report still being written counts too.
inline bool IsImportReportName(std::string_view name, bool or_partial = false) {
  return name.starts_with("imports-") &&
         (name.ends_with(".json") || (or_partial && name.ends_with(".json.tmp")));
}

// WHERE THE ZYGOTE FINDS EFDL. The zygote and the spares run `-m efdl.preload` with the worker's
// interpreter, which may not import efdl by itself (a torchrun program in a virtual or conda
// environment; `make install` not run). Before its first zygote the SparePool asks that
// interpreter (ProbeInterpreter) and, where it cannot import efdl, gives the zygote and the
// spares it starts - never a spawned worker - the directory of a package this agent knows
// (KnownPackageDirs) whose compiled part that interpreter loads (ChoosePackageDir): in front of
// PYTHONPATH, and named in kPreloadPathVariable. preload.py takes that entry out of sys.path and
// PYTHONPATH as soon as `efdl` is imported, before any other import: the program's sys.path is
// the one its interpreter gives it (the efdl modules already imported stay importable through
// the package's own path). Where no known package loads there (another Python version or ABI),
// the pool starts no spares and says so once (ChoosePackageDir's problem: the cost and the fix).
inline constexpr const char* kPreloadPathVariable = envvar::kPreloadPath;

// What the worker's interpreter says about itself (ProbeInterpreter).
struct InterpreterFacts {
  std::string version;                           // "3.11": sys.version_info
  std::vector<std::string> extension_suffixes;   // importlib.machinery.EXTENSION_SUFFIXES
  bool finds_efdl = false;                       // efdl is on its own path
};
// Runs `interpreter -c PROBE` with `env_set` added to this process's environment (what the
// zygote would start with), in this process's working directory. Fails when it does not answer
// within `timeout` or says nothing readable (not a Python 3 interpreter).
Result<InterpreterFacts> ProbeInterpreter(const std::vector<std::string>& interpreter,
                                          const std::map<std::string, std::string>& env_set,
                                          std::chrono::milliseconds timeout);

// The directories holding an efdl package (efdl/preload.py) that this agent knows, the first to
// be preferred: the one `make install` wrote next to this executable
// (<prefix>/lib/python<version>/{dist,site}-packages for <prefix>/bin/efdl) and the source tree's
// python/ directory this executable was built from (where the build puts _efdl*.so).
std::vector<std::string> KnownPackageDirs(const std::string& version);

struct PackageChoice {
  std::string python_dir;   // the directory to give the zygote; "": none needed, or none fits
  std::string problem;      // non-empty: none fits; why, what it costs and the fix, one line
};
// The decision on the probe's facts (pure; `known_dirs` as KnownPackageDirs returns them,
// `interpreter` the worker command's interpreter, for the messages): nothing when the
// interpreter finds efdl itself; else the first known directory with an _efdl*.so whose suffix
// the interpreter loads; else the problem. `source_python_dir` ("": not known) is where the fix
// command builds from.
PackageChoice ChoosePackageDir(const InterpreterFacts& facts,
                               const std::vector<std::string>& known_dirs,
                               const std::string& interpreter,
                               const std::string& source_python_dir);
// The python/ directory of the source tree this executable was built from ("" when it is gone).
std::string SourcePythonDir();

class Zygote {
 public:
  // Starts the zygote; does not wait for its imports (Ready). FailedPrecondition when this
  // process is not a child subreaper.
  static Result<std::unique_ptr<Zygote>> Start(ZygoteOptions options);
  ~Zygote();
  Zygote(const Zygote&) = delete;
  Zygote& operator=(const Zygote&) = delete;

  // Non-blocking: true once the zygote reported its imports done. FailedPrecondition when it
  // refused to serve (its reason), Unavailable when it died first (its exit and last stderr
  // line: an interpreter started the same way would fail too).
  Result<bool> Ready();
  // Logs what the zygote wrote to its stderr since the last call (import warnings), a line at a
  // time, so that its pipe never fills up and blocks it. Call regularly.
  void DrainOutput();
  // A descriptor that becomes readable when Ready may have news (for poll).
  int fd() const { return sock_; }
  // Sends an import request (protocol above); the zygote is not Ready until it answered.
  Status Import(const std::vector<std::string>& modules);
  // Forks a spare that takes `fds` (closed here in any case) and starts with `env` added to its
  // environment. The result is a child of this process, leading its own process group, listed
  // with the reaper; `stdout_read`/`stderr_read` become its pipe ends.
  Result<Subprocess> Fork(const std::map<std::string, std::string>& env, SpareDescriptors fds,
                          int stdout_read, int stderr_read);
  pid_t pid() const { return proc_.pid(); }
  // Non-blocking: its wait status once it exited (reaped), else nullopt.
  std::optional<int> Exited() { return proc_.Poll(); }

 private:
  Zygote(ZygoteOptions options, Subprocess proc, int sock)
      : options_(std::move(options)), proc_(std::move(proc)), sock_(sock) {}
  Status Died(const std::string& what);

  ZygoteOptions options_;
  Subprocess proc_;
  int sock_ = -1;
  bool ready_ = false;
  PipeLines stderr_lines_;
};

// Reaps the zombie children of this process that lead no process group: processes it adopted as
// a child subreaper (a worker's helper orphaned when the worker died, then killed with its
// group). A child that leads a group is a Subprocess's to reap and is left alone. Returns how
// many it reaped.
int ReapAdoptedOrphans();

}  // namespace efdl::agent
