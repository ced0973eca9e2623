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
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/subprocess.h"
#include "efdl/status.h"

namespace efdl::agent {

class ControlServer;
class SparePool;

struct WorkerSpec {
  int local_rank = 0;
  int rank = 0;
  std::map<std::string, std::string> env;   // added to the agent's environment
  std::string log_path;                     // empty: no log file
};

struct WorkerGroupOptions {
  std::vector<std::string> argv;
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
};

class WorkerGroup {
 public:
  enum class State { kRunning, kSucceeded, kFailed };

  // Spawns every worker; on failure none is left running.
  static Result<std::unique_ptr<WorkerGroup>> Start(WorkerGroupOptions options);
  ~WorkerGroup();  // SIGKILLs the process groups still running, reaps, joins the output thread
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  int64_t round() const { return options_.round; }
  // Reaps exited workers without blocking: kFailed as soon as one exited non-zero, kSucceeded
  // once all exited 0.
  State Poll();
  // The first worker seen exiting non-zero.
  const std::optional<WorkerExit>& first_failure() const { return first_failure_; }
  int running() const;
  std::vector<pid_t> pids() const;

  // The stop sequence of docs/control-protocol.md; returns when every worker has exited. A
  // `control` of nullptr means no worker is reachable that way (all get SIGTERM at once).
  void Stop(const StopPolicy& policy, ControlServer* control);
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
  };
  struct Stream {
    int fd = -1;            // read end, non-blocking
    int dest_fd = -1;       // agent's stdout or stderr
    int log_fd = -1;        // shared by a worker's two streams; owned by log_fds_
    int rank = 0;
    std::string prefix;     // "[rank N] "
    std::string partial;    // bytes after the last newline
    bool is_stderr = false;
  };

  explicit WorkerGroup(WorkerGroupOptions options) : options_(std::move(options)) {}
  void PumpOutput();
  void DrainStream(Stream& s, bool final);
  void EmitLine(Stream& s, std::string_view line);
  bool ReapOne(Worker& w);

  const WorkerGroupOptions options_;
  std::vector<Worker> workers_;
  std::vector<Stream> streams_;     // touched only by the output thread once it runs
  std::vector<int> log_fds_;
  std::optional<WorkerExit> first_failure_;
  mutable std::mutex connect_error_mu_;
  std::optional<PeerConnectError> connect_error_;   // written by the output thread
  std::map<int, std::deque<std::string>> stderr_tails_;   // by rank; under connect_error_mu_
  int wake_read_ = -1;
  int wake_write_ = -1;
  std::thread pump_;
};

}  // namespace efdl::agent
