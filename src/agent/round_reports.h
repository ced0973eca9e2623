// What the workers of this node said on the control socket about their rounds, kept by the
// agent (issue #31 step 1; docs/control-protocol.md): who answered a stop ("stopping", and
// released without a GPU), who paused in-process, whose program returned, the in-process
// failures not yet handled, the newest step persisted. The ControlServer only transports: it
// queues each worker's report (WorkerReport) and RoundReports keeps the books of them.
//
// RoundReports is pure bookkeeping (fed reports, asked questions); ControlChannel is the
// agent's channel to its workers: it sends through a ControlServer and answers from the books
// of that server's reports, taken in before each question. Both single-threaded.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "agent/control_server.h"
#include "agent/worker_group.h"

namespace efdl::agent {

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

class RoundReports {
 public:
  // At most this many ranks returned per round, and failures waiting (a worker has one of each).
  static constexpr size_t kMaxPerRound = 256;

  // One report, in the order the server received them.
  void Add(const WorkerReport& report);
  // Forgets the rounds before `round` (keeps the books bounded).
  void ForgetBefore(int64_t round);

  // Local ranks of `round` that answered a stop with "stopping".
  std::vector<int> StoppingRanks(int64_t round) const { return Of(stopping_, round); }
  // Those of them whose "stopping" said `"gpu": false`: nothing of theirs is on a GPU, so a
  // new worker may start while they exit (WorkerGroup's StopPolicy::release_after_snapshot).
  std::vector<int> ReleasedRanks(int64_t round) const { return Of(released_, round); }
  // Local ranks that said "paused" for `round`.
  std::vector<int> PausedRanks(int64_t round) const { return Of(paused_, round); }
  // Local ranks of `round` whose program returned in-process ("returned"), each once; not one
  // that said "stopping" in that round before (it exits 0 because it was asked to): a
  // collective failure after it on this node was this node's early exit (issue #32, blame).
  std::vector<int> ReturnedRanks(int64_t round) const { return Of(returned_, round); }
  // The failures reported ("failed", "raised") since the last call, oldest first.
  std::vector<InProcessFailure> TakeInProcessFailures();
  // The newest step a worker reported as persisted to storage ("persisted"), if any.
  std::optional<int64_t> newest_persisted_step() const { return newest_persisted_; }

 private:
  using ByRound = std::map<int64_t, std::vector<int>>;
  static std::vector<int> Of(const ByRound& m, int64_t round);

  ByRound stopping_;
  ByRound released_;
  ByRound paused_;
  ByRound returned_;
  std::vector<InProcessFailure> failures_;   // not yet taken
  std::optional<int64_t> newest_persisted_;
};

// The agent's channel to its workers over `server` (which must outlive it): requests go out
// through the server, questions are answered from the books of its reports (each question takes
// the server's new reports in first).
class ControlChannel : public StopChannel {
 public:
  explicit ControlChannel(ControlServer& server) : server_(server) {}

  ControlServer& server() { return server_; }
  // The books, with every report the server holds taken in.
  RoundReports& books();

  // StopChannel (WorkerGroup::Stop).
  std::vector<int> RequestStop(int64_t round, bool graceful, const std::string& reason) override {
    return server_.RequestStop(round, graceful, reason);
  }
  std::vector<int> StoppingRanks(int64_t round) override { return books().StoppingRanks(round); }
  std::vector<int> ReleasedRanks(int64_t round) override { return books().ReleasedRanks(round); }

  std::vector<int> PausedRanks(int64_t round) { return books().PausedRanks(round); }
  std::vector<int> ReturnedRanks(int64_t round) { return books().ReturnedRanks(round); }
  std::vector<InProcessFailure> TakeInProcessFailures() { return books().TakeInProcessFailures(); }
  std::optional<int64_t> newest_persisted_step() { return books().newest_persisted_step(); }

 private:
  ControlServer& server_;
  RoundReports books_;
};

}  // namespace efdl::agent
