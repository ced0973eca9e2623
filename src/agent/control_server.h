// The agent's end of the control socket (docs/control-protocol.md): a unix stream socket, mode
// 0600, speaking line-delimited JSON with the workers of this node.
//
// One thread of its own serves every connection; it is started by Start() and joined by the
// destructor, which also removes the socket file. All public methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "efdl/status.h"

namespace efdl::agent {

// A worker's "flush" request (State.flush() under the agent): persist the newest snapshot of
// its arena `scope` to storage and answer when that is done. Answered with AnswerFlush().
struct FlushRequest {
  uint64_t connection = 0;     // which connection asked (connections are numbered, never reused)
  std::string id_json;         // the request's "id", as JSON text, echoed in the answer
  std::string scope;           // "node" or "rank<N>": which arena (state.py's naming)
  int local_rank = -1;
  std::chrono::milliseconds timeout{0};
};

// An in-process worker's report that a collective of its round failed ("failed";
// docs/control-protocol.md "In-process round changes"): it leaves the round, goes back to its
// newest snapshot and waits for the next round. The agent reports the round broken.
struct InProcessFailure {
  int64_t round = 0;
  int rank = -1;
  int local_rank = -1;
  std::string message;
  // "raised": the program's own exception on this rank (not a collective that lost a peer),
  // said before its process tears down; the node's own failure.
  bool own = false;
};

struct ControlServerOptions {
  std::string socket_path;   // created (must not exist); removed again by the destructor
  std::string job_id;
  std::string node_id;
};

class ControlServer {
 public:
  static Result<std::unique_ptr<ControlServer>> Start(ControlServerOptions options);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  const std::string& path() const { return options_.socket_path; }

  // The round whose workers are welcome; a hello from another round is answered with "stop".
  void SetRound(int64_t round);
  // True when the worker with this local rank said hello for `round` and is still connected.
  bool IsConnected(int64_t round, int local_rank) const;
  // Sends "stop" to every connected worker of `round`; returns the local ranks it reached.
  std::vector<int> RequestStop(int64_t round, bool graceful, const std::string& reason);
  // The newest step any worker reported (committed or stopping), if any.
  std::optional<int64_t> newest_step() const;
  // Local ranks of `round` that answered a stop with "stopping" (connected or not since).
  std::vector<int> StoppingRanks(int64_t round) const;
  // Those of them whose "stopping" said `"gpu": false`: nothing of theirs is on a GPU, so a
  // new worker may start while they exit (WorkerGroup's StopPolicy::release_after_snapshot).
  std::vector<int> ReleasedRanks(int64_t round) const;
  // In-process round changes (efdl.elastic.run; docs/control-protocol.md).
  // Local ranks of `round` that are connected and said "in_process".
  std::vector<int> InProcessRanks(int64_t round) const;
  // Sends "pause" to every connected in-process worker of `round`; returns the local ranks
  // reached.
  std::vector<int> RequestPause(int64_t round, bool graceful, const std::string& reason);
  // Local ranks that said "paused" for `round` (connected or not since).
  std::vector<int> PausedRanks(int64_t round) const;
  // Sends the in-process worker of `round` with `local_rank` its place in `new_round`, global
  // rank `new_rank` (a "round" line with those typed fields and `env`, the environment a worker
  // started for it would get), and counts
  // it a worker of `new_round` from now on. False when no such worker is connected.
  bool AssignRound(int64_t round, int local_rank, int64_t new_round, int new_rank,
                   const std::map<std::string, std::string>& env);
  // Local ranks of `round` whose program returned (or exited 0) in-process ("returned"): a
  // collective failure after it on this node was this node's early exit (issue #32, blame).
  std::vector<int> ReturnedRanks(int64_t round) const;
  // The failures reported ("failed") since the last call, oldest first.
  std::vector<InProcessFailure> TakeInProcessFailures();
  // The newest step a worker reported as persisted to storage ("persisted"), if any.
  std::optional<int64_t> newest_persisted_step() const;
  // Flush requests received since the last call, oldest first (the agent's loop takes them).
  std::vector<FlushRequest> TakeFlushRequests();
  // Answers a flush request: a "reply" with `persisted` (false: this node does not write that
  // arena to storage) when `status` is OK, else an "error" with its message. Dropped when the
  // worker has disconnected meanwhile.
  void AnswerFlush(const FlushRequest& request, const Status& status, bool persisted);

 private:
  struct Client {
    uint64_t connection = 0;
    std::string buffer;        // bytes read, not yet a full line
    bool said_hello = false;
    int pid = 0;
    int rank = -1;
    int local_rank = -1;
    int64_t round = -1;
    bool in_process = false;   // said "in_process": takes round changes without a restart
  };

  explicit ControlServer(ControlServerOptions options) : options_(std::move(options)) {}
  void Serve();
  // Handles one line from client `fd`; returns false when the connection must be closed.
  bool HandleLine(int fd, Client& client, const std::string& line) EFDL_REQUIRES(mutex_);
  void SendLocked(int fd, const std::string& json_line) EFDL_REQUIRES(mutex_);
  // Sends {type, round, graceful, reason} to the connected workers of `round` (only those that
  // said "in_process" with `in_process_only`); returns their local ranks.
  std::vector<int> SendToRound(const char* type, int64_t round, bool graceful,
                               const std::string& reason, bool in_process_only);

  const ControlServerOptions options_;
  int listen_fd_ = -1;
  int wake_read_ = -1;   // a byte on wake_write_ ends Serve()
  int wake_write_ = -1;
  std::thread thread_;

  mutable Mutex mutex_;
  // By fd; fds closed by Serve only.
  std::map<int, Client> clients_ EFDL_GUARDED_BY(mutex_);
  int64_t round_ EFDL_GUARDED_BY(mutex_) = -1;
  std::optional<int64_t> newest_step_ EFDL_GUARDED_BY(mutex_);
  std::optional<int64_t> newest_persisted_ EFDL_GUARDED_BY(mutex_);
  std::map<int64_t, std::vector<int>> stopping_ EFDL_GUARDED_BY(mutex_);   // by round
  std::map<int64_t, std::vector<int>> released_ EFDL_GUARDED_BY(mutex_);   // by round
  std::map<int64_t, std::vector<int>> paused_ EFDL_GUARDED_BY(mutex_);     // by round
  std::map<int64_t, std::vector<int>> returned_ EFDL_GUARDED_BY(mutex_);   // by round
  std::vector<InProcessFailure> failures_ EFDL_GUARDED_BY(mutex_);        // not yet taken
  std::vector<FlushRequest> flushes_ EFDL_GUARDED_BY(mutex_);             // not yet taken
  uint64_t next_connection_ EFDL_GUARDED_BY(mutex_) = 1;
};

}  // namespace efdl::agent
