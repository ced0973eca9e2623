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
#include <string>
#include <string_view>
#include <vector>

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
  // Wait after an activation before starting the replacement, so that the new spare's imports
  // do not compete for the CPU with the start-up of the round that just began (a joining node's
  // fresh interpreter importing torch, init_process_group, the first steps).
  std::chrono::milliseconds refill_delay{std::chrono::seconds(5)};
  // WaitUntilImported gives up after this long (a slow disk, a huge import): joining late
  // must not become never joining.
  std::chrono::milliseconds import_timeout{std::chrono::seconds(60)};
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
  std::optional<Subprocess> Activate(int local_rank, const std::map<std::string, std::string>& env,
                                     int64_t round);
  // Blocks until every live spare has reported that its imports are done, import_timeout has
  // passed, or `interrupted` (asked a few times a second) returns true; keeps Maintain()ing
  // meanwhile, so a spare that dies disables the pool and ends the wait. Logs how many it waits
  // for and how long it took. Returns the number of spares still importing (0: all warm).
  size_t WaitUntilImported(const std::function<bool()>& interrupted);
  // Live spares that have not yet reported their imports done (reads their ready pipes).
  size_t Importing();
  // Kills every spare; slots are refilled by Maintain() only after the next Activate().
  void Clear();

  // Pids of the live spares (tests, status).
  std::vector<pid_t> pids() const;
  // False once a spare died on its own (the interpreter cannot import efdl.preload, ...): the
  // pool stops starting spares and every worker is spawned normally.
  bool enabled() const { return enabled_; }

 private:
  struct Slot {
    std::optional<Subprocess> proc;
    int message_fd = -1;                              // write end of the spare's pipe
    int ready_fd = -1;  // read end of its ready pipe; -1 once it reported (or closed it)
    std::map<std::string, std::string> started_with;  // start_env it was started with
    std::optional<std::chrono::steady_clock::time_point> due;  // refill at; none: no refill
  };
  explicit SparePool(SparePoolOptions options, PythonCommand cmd);
  void Discard(Slot& slot);
  Status StartSpare(int local_rank, Slot& slot);

  SparePoolOptions options_;
  PythonCommand cmd_;
  std::vector<Slot> slots_;
  bool enabled_ = true;
};

}  // namespace efdl::agent
