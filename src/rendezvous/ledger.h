// The goodput ledger (issue #33, docs/operations.md "Goodput and events"): what every round
// change cost a job, kept in etcd without a master.
//
// Each node writes one LedgerPart per round it ran workers in, once every local rank reported
// progress (or at once when it cannot see progress): when it first saw the change that ended its
// previous round, when its workers started and made progress again, its steps before and after
// (steps trained again), and what the round is (world size, nodes, why). It also writes an end
// record when it leaves (job complete, suspended, signal). Keys: <job prefix>ledger/<node>/r<N>
// and .../end, without a lease, so the ledger is readable after the job ended. Bounded: a node
// deletes its parts older than its newest minus kKeepRounds; the report then covers the rounds
// kept, and says from when.
//
// Summarize() turns the parts of all nodes into the job's events (one per round after the
// first: its pause split into phases) and its wall time split into categories that add up to it
// exactly: start-up, training kept, training lost (trained again), hung (until detected),
// rendezvous, restore (to the first progress: the State's restore and the first step, which the
// events tell apart), suspended. Goodput = training kept / wall time.
// Pure: unit-tested with made-up parts (tests/rendezvous/ledger_test.cc).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"

namespace efdl::rdzv {

inline constexpr int kKeepRounds = 64;

// One node's part of one round in the ledger: one field per key of its JSON (Encode/Decode),
// flat on purpose (issue #31): it is the record's wire form, written by NodeObserver and read
// by Summarize.
struct LedgerPart {
  std::string node;
  int64_t round = 0;
  int world = 0;                   // the round's world size and nodes
  int nnodes = 0;
  int prev_world = 0;              // of this node's previous round (0: none)
  int prev_nnodes = 0;
  std::string why;                 // the round's reason, as the coordinator wrote it
  bool graceful = false;           // the change that ended the previous round was orderly
  double sign = 0;                 // wall s: the first sign of the change here (0: none, a join)
  double detection_s = 0;          // a hang's silence before it was declared (0: not a hang)
  double start = 0;                // wall s: this node's workers of the round started
  double restored = 0;             // wall s: every local rank's State restored (0: unseen)
  double progress = 0;             // wall s: every local rank reported progress (0: unseen)
  // The round ended before every local rank reported progress (a failure at its first step):
  // written at that end, so that its time is not taken for training.
  bool ended_before_progress = false;
  int64_t step = -1;               // the first step reported in the round (-1: unknown)
  int64_t prev_step = -1;          // the last step reported in the previous round
  double prev_at = 0;              // wall s of that report
  double step_s = 0;               // seconds per step recently (0: unknown)
  double step_samples = 0;         // samples per rank per step recently (0: unknown)
  // The previous round's progress reports after its newest snapshot (State.commit() counts
  // them; the most over this node's ranks): what this round trains again. -1: unknown.
  int64_t uncommitted = -1;
  int min_nodes = 1;               // the job's --nnodes MIN
  double joined = 0;               // wall s this node joined the job (its first round only)

  std::string Encode() const;
  static Result<LedgerPart> Decode(const std::string& text);
};

// A node left the job: how ("complete", "suspended", "signal", "failed") and when.
struct LedgerEnd {
  std::string node;
  int64_t round = 0;
  double at = 0;
  std::string how;
  std::string Encode() const;
  static Result<LedgerEnd> Decode(const std::string& text);
};

std::string LedgerPrefix(const std::string& job_id);
std::string LedgerPartKey(const std::string& job_id, const std::string& node, int64_t round);
std::string LedgerEndKey(const std::string& job_id, const std::string& node);

// One change of the job's rounds as Summarize reconstructs it from the parts: what `efdl events`
// prints, one field per column or JSON key; flat on purpose (issue #31), it is a report.
struct LedgerEvent {
  int64_t round = 0;               // the round the change led to
  std::string kind;                // crash, failure, hang, join, leave, suspend, restart
  std::string why;
  bool graceful = false;
  double at = 0;                   // wall s: the first sign on any node
  int world_before = 0, world_after = 0;
  int nodes_before = 0, nodes_after = 0;
  std::vector<std::string> nodes;  // the nodes that wrote a part for the new round
  // The nodes of the previous round (in the ledger) not in the new one, and the other way
  // round: the node that crashed, left or was excluded; the node that joined.
  std::vector<std::string> left, joined;
  double detection_s = 0;          // phases, in order; they add up to pause_s
  double waiting_s = 0;            // fewer than --nnodes MIN nodes until enough joined
  double rendezvous_s = 0;
  double restore_s = 0;            // to every rank's State restored (all of it when unseen)
  double first_step_s = 0;         // from there to every rank's first progress report
  double pause_s = 0;              // the first sign to every rank's first progress
  // Trained again: the previous round's steps after its newest snapshot (the most any node
  // saw); without that count (programs that report with efdl.progress()), the last step
  // reported before the change minus the one the round resumed after.
  int64_t steps_lost = 0;
  // The samples of those steps, the whole job's: steps x samples per rank per step (EFDL's
  // samplers count them) x the previous round's world size. -1: unknown (no EFDL sampler).
  int64_t samples_lost = -1;
  double step_samples = 0;         // the samples per rank per step used there (0: unknown)
};

// The categories of the job's wall time (seconds); they add up to wall_s.
struct LedgerTotals {
  double wall_s = 0;
  std::map<std::string, double> seconds;   // startup, training, lost, hung, waiting (below
                                           // MIN), rendezvous, restore, suspended
  double goodput() const { return wall_s > 0 ? seconds.at("training") / wall_s : 0; }
};

struct LedgerReport {
  std::vector<LedgerEvent> events;   // oldest first
  LedgerTotals totals;
  bool complete = false;             // every node that ran the last round wrote its end
  double begin = 0, end = 0;         // wall s
  std::string ToJson() const;
  std::string ToText(size_t last_events) const;   // goodput, categories, the last events
};

// `now`: the end of a job still running (wall s).
LedgerReport Summarize(const std::vector<LedgerPart>& parts, const std::vector<LedgerEnd>& ends,
                       double now);

// The job's ledger records as etcd holds them (damaged ones skipped).
struct LedgerRecords {
  std::vector<LedgerPart> parts;
  std::vector<LedgerEnd> ends;
};
Result<LedgerRecords> ReadLedgerRecords(etcd::Client& client, const std::string& job_id);

// What changes whenever the ledger does: its key count and its newest modification revision,
// from one cheap read (keys only, one key). A poller reads the records again only when it moved.
Result<std::pair<int64_t, int64_t>> LedgerFingerprint(etcd::Client& client,
                                                      const std::string& job_id);

// ReadLedgerRecords, then Summarize.
Result<LedgerReport> ReadLedger(etcd::Client& client, const std::string& job_id, double now);

}  // namespace efdl::rdzv
