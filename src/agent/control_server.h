// The agent's end of the control socket (docs/control-protocol.md): a unix stream socket, mode
// 0600, speaking line-delimited JSON with the workers of this node.
//
// It only transports: it welcomes the workers of the current round, sends them requests (stop,
// pause, their next round's place, flush answers) and queues what they report (WorkerReport,
// FlushRequest) for the agent's loop to take; the books of those reports are the agent's
// (round_reports.h). What it keeps itself: who is connected and for which round, and the newest
// step any worker committed, which it answers a "restore" query with on its own thread.
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

// A worker's report about its round (docs/control-protocol.md), queued in the order received.
// Its round is the worker's own (the one it said hello for, or was assigned): the message's
// "round" is not trusted. Only from a worker that said hello, except kPersisted.
struct WorkerReport {
  enum class Kind {
    kStopping,    // "stopping": it answered a stop and takes its final snapshot
    kPaused,      // "paused": an in-process worker left its round
    kReturned,    // "returned": its program returned (in-process)
    kFailed,      // "failed": a collective of its round failed (in-process)
    kRaised,      // "raised": its program raised (in-process)
    kPersisted,   // "persisted": it wrote a snapshot of `step` to storage
  };
  Kind kind = Kind::kStopping;
  int64_t round = -1;
  int rank = -1;
  int local_rank = -1;
  int64_t step = -1;       // the step it named; -1: none
  bool released = false;   // kStopping with "gpu": false (it holds nothing on a GPU)
  std::string message;     // kFailed, kRaised
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
  // The newest step any worker reported (committed, stopping or paused), if any.
  std::optional<int64_t> newest_step() const;
  // In-process round changes (efdl.elastic.run; docs/control-protocol.md).
  // Local ranks of `round` that are connected and said "in_process".
  std::vector<int> InProcessRanks(int64_t round) const;
  // Sends "pause" to every connected in-process worker of `round`; returns the local ranks
  // reached.
  std::vector<int> RequestPause(int64_t round, bool graceful, const std::string& reason);
  // Sends the in-process worker of `round` with `local_rank` its place in `new_round`, global
  // rank `new_rank` (a "round" line with those typed fields and `env`, the environment a worker
  // started for it would get), and counts
  // it a worker of `new_round` from now on. False when no such worker is connected.
  bool AssignRound(int64_t round, int local_rank, int64_t new_round, int new_rank,
                   const std::map<std::string, std::string>& env);
  // The workers' reports received since the last call, oldest first (at most kMaxReports wait;
  // more are dropped with a warning: nobody takes them).
  std::vector<WorkerReport> TakeReports();
  static constexpr size_t kMaxReports = 4096;
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
  // Queues `report` of `client` (its round and ranks filled in).
  void Report(const Client& client, WorkerReport report) EFDL_REQUIRES(mutex_);
  // Sends {type, round, graceful, reason} to the connected workers of `round` (only those that
  // said "in_process" with `in_process_only`); returns their local ranks.
  std::vector<int> SendToRound(const char* type, int64_t round, bool graceful,
                               const std::string& reason, bool in_process_only);

  // 13 members, as a socket server needs them: the socket and its serving thread (options, the
  // listening fd, the wake pipe's two ends, the thread, the mutex) and what the mutex guards
  // (the clients, the round, the newest step, the queues of reports and flushes with the
  // reports' drop warning, the connection counter).
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
  std::vector<WorkerReport> reports_ EFDL_GUARDED_BY(mutex_);   // not yet taken
  bool reports_dropped_ EFDL_GUARDED_BY(mutex_) = false;        // warned once
  std::vector<FlushRequest> flushes_ EFDL_GUARDED_BY(mutex_);   // not yet taken
  uint64_t next_connection_ EFDL_GUARDED_BY(mutex_) = 1;
};

}  // namespace efdl::agent
