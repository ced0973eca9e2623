// What `efdl dashboard` shows: the job's status from etcd (rdzv::JobStatus, the same reading as
// `efdl status --json`), the steps its nodes' metrics endpoints report, and what the dashboard
// accumulated across polls: the throughput timeline, every event it saw (the status record keeps
// only the recent ones), and the round changes it saw; and the job's goodput ledger
// (rdzv::ReadLedger, the same report as `efdl events --json`): goodput, its categories and every
// event with its phases, read from etcd each poll, so it is there after the job ended too. Pure:
// the poller passes the wall time and the results of each poll; ToJson() is the document the page
// polls (GET /api/state).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dashboard/metrics_text.h"
#include "dashboard/throughput.h"
#include "efdl/status.h"
#include "rendezvous/job_status.h"
#include "rendezvous/ledger.h"

namespace efdl::dashboard {

// One node's /metrics endpoint at one poll.
struct NodeScrape {
  std::string node;
  std::string target;          // HOST:PORT, as announced in etcd
  bool ok = false;
  std::string error;           // why not (!ok)
  NodeMetrics metrics;
};

// An event on the timeline: from the job's status record (kind "event"), or a change of the
// round the dashboard saw between two polls (kind "round").
struct TimelineEvent {
  double t = 0;                // wall seconds since the epoch
  std::string time;            // ISO-8601 UTC
  std::string kind;
  std::string message;
};

// "2026-12-06T05:50:58.123Z" (WallClockTimestamp) -> seconds since the epoch; nullopt if not so.
std::optional<double> ParseIsoTime(const std::string& text);
std::string FormatIsoTime(double t);

class DashboardState {
 public:
  static constexpr size_t kMaxEvents = 500;

  DashboardState(std::string job_id, std::string etcd);

  // One poll at wall time `now`: the status read from etcd (or why it could not be read) and
  // the scrapes of the nodes' endpoints.
  void Update(double now, const Result<rdzv::JobStatus>& status,
              const std::vector<NodeScrape>& scrapes);
  // The job's ledger read at the same poll (or why it could not be read: the last one read
  // stays).
  void UpdateLedger(const Result<rdzv::LedgerReport>& ledger);

  // The page's document: {"job", "etcd", "now", "polls", "etcd_error", "status": the
  // `efdl status --json` object of the last successful read (null before one), "scrapes":
  // {node: {target, ok, error, ranks: [{rank, step, steps_per_s}]}}, "throughput": [[t,
  // rank_steps_per_s, job_steps_per_s, ranks, round, world_size], ...], "events": [{t, time,
  // kind, message}, ...] oldest first, "ledger": rdzv::LedgerReport::ToJson()'s object of the
  // last successful read (`efdl events --json`'s; null before one), "ledger_error"}.
  std::string ToJson() const;

  const std::deque<TimelineEvent>& events() const { return events_; }
  const ThroughputHistory& throughput() const { return throughput_; }

 private:
  void AddEvent(TimelineEvent e);

  std::string job_id_;
  std::string etcd_;
  double now_ = 0;
  uint64_t polls_ = 0;
  std::string etcd_error_;
  std::optional<rdzv::JobStatus> status_;   // the last one read
  std::optional<rdzv::LedgerReport> ledger_;   // the last one read
  std::string ledger_error_;
  std::vector<NodeScrape> scrapes_;
  ThroughputHistory throughput_;
  std::deque<TimelineEvent> events_;        // by time
  // The last round change drawn: "R:active:W", "R:suspended" or "R:complete" (transient
  // phases, gathering and proposed, draw none).
  std::string drawn_round_;
};

}  // namespace efdl::dashboard
