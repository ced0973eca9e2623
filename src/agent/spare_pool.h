// Pre-started ("spare") python workers: a new round activates a process that already paid for
// the interpreter start and `import torch`, instead of spawning one from scratch.
//
// A spare is `<python> [interpreter options] -m efdl.preload <fd>` (python/efdl/preload.py): it
// imports the heavy modules and then blocks reading <fd>, a pipe whose write end the pool keeps.
// Activate() writes one JSON message there ({"round", "argv", "env"}: the program's arguments
// and the complete environment a freshly spawned worker would get) and closes the pipe; the
// spare then sets os.environ, sys.argv, sys.path[0] and __main__ as the python command line
// would and runs the program. Each spare reads exactly one message, so a spare is used for one
// round at most; the pool forgets a spare the moment it hands it over.
//
// By default the spares are forked from the node's zygote (zygote.h): one interpreter that did
// the imports once; a consumed spare is then replaced at once, with no refill delay, and the
// spares share the zygote's pages. Where the zygote cannot serve (it died, refused, or a local
// rank's start environment differs from its own), spares are started as their own interpreters
// as described here, after one line saying why. Where the worker's interpreter cannot import
// efdl by itself (a virtual environment), the zygote and the started spares are given the
// package this agent knows, and the program still sees only its own path; where no known
// package loads in that interpreter (another Python version), the pool starts nothing and says
// so once, as a warning (zygote.h, "Where the zygote finds efdl").
//
// A spare gets a second pipe (`-m efdl.preload <fd> <ready fd>`): it writes one byte there and
// closes it once its imports are done, so that a starting agent can join the rendezvous only
// when its spares are warm (WaitUntilImported) and the running nodes keep training meanwhile.
//
// Environment variables a library may read while being imported (OMP_NUM_THREADS, ...) must
// already be right when the spare starts: a spare is only activated when every variable of the
// worker's environment other than the per-round ones (IsRoundVariable) has the value the spare
// started with; otherwise it is discarded and the worker is spawned normally.
//
// Ownership and threads: the pool owns its spares (each leads its own process group, with
// PR_SET_PDEATHSIG bound to the thread that spawns it, so that thread must outlive them); the
// destructor and Clear() SIGKILL and reap them. Not thread-safe: used by the agent loop only.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "agent/learned_imports.h"
#include "agent/zygote.h"
#include "common/subprocess.h"
#include "efdl/status.h"

namespace efdl::agent {

// The interpreter part of a python command line (`python3 -u`) and the program part (`train.py
// --lr 1`, or `-m pkg.train --lr 1`); nullopt for a command a spare cannot stand in for (not a
// python interpreter, `-c`, stdin, or an interpreter option outside a known-harmless set).
struct PythonCommand {
  std::vector<std::string> interpreter;
  std::vector<std::string> program;
};
std::optional<PythonCommand> ParsePythonCommand(const std::vector<std::string>& argv);

// Variables that change from round to round and are read by the program at run time, not at
// import: RANK, WORLD_SIZE, MASTER_*, EFDL_*, TORCHELASTIC_*, HOROVOD_*, ...
bool IsRoundVariable(std::string_view name);

struct SparePoolOptions {
  std::vector<std::string> command;                // the worker command (a python command)
  int nproc = 1;                                   // one spare per local rank
  // Added to the agent's environment when a spare starts, per local rank (missing: none).
  std::map<int, std::map<std::string, std::string>> start_env;
  // Fork the spares from a zygote (zygote.h). false: every spare is its own interpreter.
  bool zygote = true;
  // Without a zygote: wait after an activation before starting the replacement, so that the new
  // spare's imports do not compete for the CPU with the start-up of the round that just began (a
  // joining node's fresh interpreter importing torch, init_process_group, the first steps). A
  // fork from the zygote imports nothing and is made at once.
  std::chrono::milliseconds refill_delay{std::chrono::seconds(5)};
  // WaitUntilImported gives up after this long (a slow disk, a huge import): joining late
  // must not become never joining.
  std::chrono::milliseconds import_timeout{std::chrono::seconds(60)};
  // Workers forked from the zygote report their program's imports here (zygote.h, "Learning
  // the program's imports"); the pool has the zygote import them. Empty: no learning.
  std::string imports_dir;
  // The user asked for spares (--prestart): falling back to spawned workers is a warning.
  // Otherwise (the default for python commands) it is logged as information.
  bool requested = false;
  // Kills the spares' process groups if the agent dies without doing it (not owned).
  GroupReaper* reaper = nullptr;
};

class SparePool {
 public:
  // InvalidArgument when the command is not one ParsePythonCommand accepts.
  static Result<std::unique_ptr<SparePool>> Create(SparePoolOptions options);
  ~SparePool();  // Clear()
  SparePool(const SparePool&) = delete;
  SparePool& operator=(const SparePool&) = delete;

  // Starts the spares that are missing and due (every empty slot at the first call; after an
  // activation, once refill_delay has passed); notices spares that died on their own. Call
  // regularly from the owning thread.
  void Maintain();
  // The spare of `local_rank`, told to run the program with `env` added to the agent's
  // environment (exactly what Subprocess::Spawn would give a worker) for `round`; nullopt (and
  // the slot emptied) when there is no live spare or it started with a different environment.
  // The returned process still has its stdout/stderr pipes (which may already hold output of
  // its imports).
  // `extra_args` follow the program's own arguments (efdl run --resume-args).
  std::optional<Subprocess> Activate(int local_rank, const std::map<std::string, std::string>& env,
                                     int64_t round,
                                     const std::vector<std::string>& extra_args = {});
  // Runs `program` (the program part of a python command line: {"-m", "module", ...}) instead
  // of the worker command in local rank 0's spare, if it is warm (imports done), with `env`
  // added to that spare's start environment; its slot is refilled without the refill delay.
  // The agent's own helpers run this way (agent_store.h). nullopt when no spare is warm.
  std::optional<Subprocess> ActivateProgram(const std::vector<std::string>& program,
                                            const std::map<std::string, std::string>& env);
  // Blocks until every live spare has reported that its imports are done, import_timeout has
  // passed, or `interrupted` (asked a few times a second) returns true; keeps Maintain()ing
  // meanwhile, so a spare that dies disables the pool and ends the wait. Logs how many it waits
  // for and how long it took. Returns the number of spares still importing (0: all warm).
  size_t WaitUntilImported(const std::function<bool()>& interrupted);
  // Live spares that have not yet reported their imports done (reads their ready pipes).
  size_t Importing();
  // Kills every spare; slots are refilled by Maintain() only after the next Activate().
  void Clear();

  // A zygote that dies after its imports is started again this many times, then spares are
  // started as their own interpreters.
  static constexpr int kMaxZygoteRestarts = 3;

  // Pids of the live spares (tests, status).
  std::vector<pid_t> pids() const;
  // The zygote's pid while one runs.
  std::optional<pid_t> zygote_pid() const;
  // False once a spare died on its own (the interpreter cannot import efdl.preload, ...): the
  // pool stops starting spares and every worker is spawned normally.
  bool enabled() const { return enabled_; }
  // Once !enabled(): why the node runs without pre-started workers (one line, for `efdl status`).
  const std::string& off_reason() const { return off_reason_; }

 private:
  struct Slot {
    std::optional<Subprocess> proc;
    int message_fd = -1;                              // write end of the spare's pipe
    int ready_fd = -1;  // read end of its ready pipe; -1 once it reported (or closed it)
    std::map<std::string, std::string> started_with;  // start_env it was started with
    std::optional<std::chrono::steady_clock::time_point> due;  // refill at; none: no refill
  };
  explicit SparePool(SparePoolOptions options, PythonCommand cmd);
  // Asks the worker's interpreter where it finds efdl (zygote.h, "Where the zygote finds
  // efdl"): sets preload_path_, or turns the pool off with a warning when no package fits.
  void FindPackage();
  // `env` plus preload_path_ in front of PYTHONPATH and as kPreloadPathVariable: what the zygote
  // and a started spare (never a worker) start with.
  std::map<std::string, std::string> WithPreloadPath(std::map<std::string, std::string> env) const;
  void Discard(Slot& slot);
  // Writes the spare's one message (`program` for `round` with `env`) and hands it over.
  std::optional<Subprocess> Hand(int local_rank, Slot& slot, int64_t round,
                                 const std::vector<std::string>& program,
                                 const std::map<std::string, std::string>& env);
  Status StartSpare(int local_rank, Slot& slot);
  // One line about the pool: a warning when the user asked for spares, else information.
  void Say(const std::string& line) const;
  // Says `line`, kills every spare and the zygote, and starts no more (workers are spawned).
  void Disable(const std::string& line);
  // Starts the zygote if due and reads its news; false while it is still importing.
  bool ZygoteSettled();
  void ZygoteFailed(const Status& why);
  bool ForksFor(int local_rank) const;
  // The zygote answered an import request: `ok`, or it refused (learning is turned off and a
  // new zygote imports without them). False when the caller must settle a new zygote.
  bool ImportAnswered(const Result<bool>& ready);

  // 12 members: the options and command, the slots, whether the pool is on (and why not), the
  // zygote's life (the package given to it, the process, ready, off, restarts, its start
  // environment), the learned imports.
  SparePoolOptions options_;
  PythonCommand cmd_;
  std::vector<Slot> slots_;
  bool enabled_ = true;
  std::string off_reason_;                           // why !enabled_
  std::string preload_path_;                         // the efdl package given to the zygote
  std::unique_ptr<Zygote> zygote_;
  bool zygote_ready_ = false;
  bool zygote_off_ = false;                          // failed once: spares are started
  int zygote_restarts_ = 0;                          // after dying once it was ready
  // The start environment the zygote runs with (local rank 0's, or the one learned last).
  std::map<std::string, std::string> zygote_env_;
  // The program's imports reported by its workers and the zygote's side of them
  // (learned_imports.h).
  LearnedImports learned_;
};

}  // namespace efdl::agent
