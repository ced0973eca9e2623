// The worker processes of one round on this node: spawn, watch, stop.
//
// A WorkerGroup owns its workers (each leads its own process group) and one output thread that
// copies their stdout/stderr line by line to the agent's, prefixed with the rank, and optionally
// to a log file per worker. It is used from one thread (the agent loop); the workers get
// PR_SET_PDEATHSIG bound to the thread that calls Start(), so that thread must outlive them.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/subprocess.h"
#include "common/thread_annotations.h"
#include "efdl/status.h"

namespace efdl::agent {

class SparePool;

// What a stop needs of the control socket (ControlChannel, round_reports.h): the request, and
// which workers of the round answered it.
class StopChannel {
 public:
  virtual ~StopChannel() = default;
  // Sends "stop" to every connected worker of `round`; returns the local ranks it reached.
  virtual std::vector<int> RequestStop(int64_t round, bool graceful,
                                       const std::string& reason) = 0;
  // Local ranks of `round` that answered a stop with "stopping" (connected or not since).
  virtual std::vector<int> StoppingRanks(int64_t round) = 0;
  // Those of them that said they hold nothing on a GPU.
  virtual std::vector<int> ReleasedRanks(int64_t round) = 0;
};

struct WorkerSpec {
  int local_rank = 0;
  int rank = 0;
  std::map<std::string, std::string> env;   // added to the agent's environment
  std::string log_path;                     // empty: no log file
};

struct WorkerGroupOptions {
  std::vector<std::string> argv;
  // Appended to argv for every worker, spawned or pre-started (`efdl run --resume-args` on a
  // start that resumes the job).
  std::vector<std::string> extra_args;
  int64_t round = 0;
  std::vector<WorkerSpec> workers;
  // Where prefixed output lines go; not owned (tests pass pipes).
  int out_fd = STDOUT_FILENO;
  int err_fd = STDERR_FILENO;
  // Pre-started workers to activate instead of spawning (not owned; nullptr: always spawn).
  SparePool* spares = nullptr;
  // Kills the workers' process groups if the agent dies without doing it (not owned; nullptr:
  // only PR_SET_PDEATHSIG, which does not reach what the workers started).
  GroupReaper* reaper = nullptr;
};

struct WorkerExit {
  int local_rank = 0;
  int rank = 0;
  int wait_status = 0;
};

// A worker's output line saying that it could not connect to a peer: gloo's "connect
// [ADDR]:PORT: Connection refused", NCCL's "Connect to ADDR<PORT> failed : ...", the torch
// store client's "failed to connect to [ADDR]:PORT" / "trying to connect to (ADDR, PORT)".
struct PeerConnectError {
  int rank = 0;
  std::string address;   // as the line gives it
  std::string port;
  std::string line;      // the whole line, without the "[rank N] " prefix
};
// The address and port a line like those names; nullopt for any other line (rank left 0).
std::optional<PeerConnectError> ParsePeerConnectError(std::string_view line);

struct StopPolicy {
  bool graceful = true;        // ask connected workers over the control socket first
  std::string reason;
  std::chrono::milliseconds grace{std::chrono::seconds(10)};
  // With `graceful`: Stop() also returns once every worker still running has answered
  // "stopping" without a GPU (StopChannel::ReleasedRanks): its final snapshot is complete and
  // it touches no arena again, so the next round's workers may start while it exits (an
  // interpreter's exit takes 0.2-2 s). Retire() then finishes the stop sequence.
  bool release_after_snapshot = false;
};

class WorkerGroup {
 public:
  enum class State { kRunning, kSucceeded, kFailed };

  // Spawns every worker; on failure none is left running.
  static Result<std::unique_ptr<WorkerGroup>> Start(WorkerGroupOptions options);
  ~WorkerGroup();  // SIGKILLs the process groups still running, reaps, joins the output thread
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  int64_t round() const { return round_; }
  size_t size() const { return workers_.size(); }
  // The workers continue in `round` without a restart (in-process round change): `ranks[i]` is
  // the new global rank of the i-th worker (local rank i). Their output lines carry the new rank
  // from now on, and go to the log file `log_paths[i]` (given with --log-dir: the new round's
  // file; one that cannot be opened keeps the old file, with a warning).
  void Renumber(int64_t round, const std::vector<int>& ranks,
                const std::vector<std::string>& log_paths = {});
  // Reaps exited workers without blocking: kFailed as soon as one exited non-zero, kSucceeded
  // once all exited 0.
  State Poll();
  // The first worker seen exiting non-zero.
  const std::optional<WorkerExit>& first_failure() const { return first_failure_; }
  // The first worker Poll() saw exited 0 while another worker of the group still ran and none
  // had failed: at a job's end every worker exits 0 soon after, but when a failure follows, the
  // program returned early on that rank and its peers' collectives lost it (issue #32, blame).
  const std::optional<WorkerExit>& exited0_early() const { return exited0_early_; }
  // The first worker reaped with status 0, whenever (after a failure too).
  const std::optional<WorkerExit>& first_exited0() const { return first_exited0_; }
  int running() const;
  std::vector<pid_t> pids() const;

  // The stop sequence of docs/control-protocol.md; returns when every worker has exited (or,
  // with policy.release_after_snapshot, was released: see there). A `control` of nullptr means
  // no worker is reachable that way (all get SIGTERM at once). `terminate_now`: local ranks
  // that get SIGTERM at once, whatever the policy says: in-process workers that did not pause
  // within the grace already had theirs (a collective hung on a frozen peer).
  void Stop(const StopPolicy& policy, StopChannel* control,
            const std::vector<int>& terminate_now = {});
  // After a Stop() that returned with workers still running: reaps the ones that exited and
  // goes on with the stop sequence (SIGTERM, then SIGKILL, each after the policy's grace)
  // without blocking. True once every worker has exited; then Close() only joins the output.
  bool Retire();
  // SIGKILLs the process groups still running, reaps them and waits until their output has
  // been copied; the destructor does the same. Idempotent.
  void Close();
  // The first line any worker wrote saying it could not connect to a peer (complete once the
  // group is Close()d: the output thread may still be copying until then).
  std::optional<PeerConnectError> peer_connect_error() const;
  // The last kStderrTailLines lines `rank` wrote to stderr (each cut to kStderrTailChars),
  // oldest first; complete once Close()d, like peer_connect_error().
  std::vector<std::string> stderr_tail(int rank) const;
  static constexpr size_t kStderrTailLines = 8;
  static constexpr size_t kStderrTailChars = 400;

 private:
  struct Worker {
    WorkerSpec spec;
    Subprocess proc;
    bool reaped = false;
    std::optional<std::chrono::steady_clock::time_point> term_at;   // SIGTERM sent (Stop)
  };
  struct Stream {
    int fd = -1;            // read end, non-blocking
    int dest_fd = -1;       // agent's stdout or stderr
    size_t worker = 0;      // index into workers_ and names_
    std::string partial;    // bytes after the last newline
    bool is_stderr = false;
  };
  // What a worker's output lines are marked with; Renumber() changes it while the output
  // thread reads it.
  struct OutputName {
    int rank = 0;
    std::string prefix;     // "[rank N] "
    int log_fd = -1;        // the worker's log file (its two streams'), owned; -1: none
  };

  explicit WorkerGroup(WorkerGroupOptions options) : options_(std::move(options)) {}
  void PumpOutput();
  void DrainStream(Stream& s, bool final);
  void EmitLine(Stream& s, std::string_view line);
  bool ReapOne(Worker& w);
  // One pass of the stop sequence begun at stop_start_: reaps, escalates; true when all exited.
  bool StopStep();
  // Helpers the workers started in their groups must not outlive the round.
  void KillGroupStragglers();

  // 16 members: one round's processes need them together: the options and round, the workers
  // and what their exits said (first failure, early and first exit 0), the stop in progress
  // (policy, start), and the output thread's (streams, the mutex and the names, connect error
  // and stderr tails it guards, the wake pipe's two ends, the thread).
  const WorkerGroupOptions options_;
  int64_t round_ = 0;                 // options_.round, then Renumber()'s
  std::vector<Worker> workers_;
  std::vector<Stream> streams_;     // touched only by the output thread once it runs
  std::optional<WorkerExit> first_failure_;
  std::optional<WorkerExit> exited0_early_;
  std::optional<WorkerExit> first_exited0_;
  StopPolicy stop_policy_;                              // of the last Stop()
  std::chrono::steady_clock::time_point stop_start_{};
  mutable Mutex connect_error_mu_;
  std::vector<OutputName> names_ EFDL_GUARDED_BY(connect_error_mu_);   // by worker
  // Written by the output thread.
  std::optional<PeerConnectError> connect_error_ EFDL_GUARDED_BY(connect_error_mu_);
  std::map<int, std::deque<std::string>> stderr_tails_  // by rank
      EFDL_GUARDED_BY(connect_error_mu_);
  int wake_read_ = -1;
  int wake_write_ = -1;
  std::thread pump_;
};

}  // namespace efdl::agent
