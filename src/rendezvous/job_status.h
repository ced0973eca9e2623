// A job's state as `efdl status` shows it, read from etcd in one request.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

struct NodeStatus {
  std::string id;
  std::string addr;
  int nproc = 0;
  int node_rank = -1;          // -1: not a member of the current round
  // "member" (in the formed round), "standby", "waiting" (registered, not placed yet), or
  // "gone" (a member of the last formed round whose lease ended).
  std::string state;
  std::string last_report;     // the node's latest report: ack, done, failed, leaving (or "")
  int64_t last_report_round = 0;
  int restarts = 0;            // worker failures this node reported
  // Why the node runs without pre-started workers, from its latest report ("": it has them).
  std::string no_prestart;
  std::string metrics;         // its Prometheus endpoint HOST:PORT ("": none announced)
};

struct JobEvent {
  std::string time;            // ISO-8601 UTC
  std::string message;
};

// What `efdl status` shows, one field per field of its JSON (ToJson, whose names are stable
// and read by the dashboard and scripts): flat on purpose (issue #31), it is a report, not a
// room with behaviour.
struct JobStatus {
  std::string job_id;
  bool exists = false;         // false: no agent ever registered this job
  int64_t round = 0;
  std::string phase;           // gathering | proposed | active | complete
  std::string coordinator;
  int world_size = 0;
  int nnodes = 0;
  std::string master_addr;
  int master_port = 0;
  bool complete = false;
  bool suspended = false;      // `efdl suspend` ran and `efdl resume` did not yet
  std::optional<int64_t> suspended_step;   // the step of the snapshot the job resumes from
  std::optional<uint64_t> suspended_seq;   // that snapshot's commit sequence number, if known
  std::optional<int64_t> suspended_epoch;  // its "epoch" keyword argument, if any
  std::map<std::string, std::optional<int64_t>> suspend_reports;  // node -> its reported step
  std::string message;         // why the round last changed
  std::vector<NodeStatus> members;    // in rank order (including "gone" ones)
  std::vector<NodeStatus> standbys;
  std::vector<NodeStatus> waiting;
  std::vector<JobEvent> events;       // recent membership and round events, oldest first
  // Nodes that left for good because their workers kept failing: node -> when and why.
  std::map<std::string, GaveUpRecord> gave_up;   // by node
  // Nodes excluded from the job's rounds for a cool-down because their own workers kept failing
  // (issue #32): node -> when, why and until when. A node's record goes once it registers again.
  std::map<std::string, ExclusionRecord> excluded;   // by node
  // The current round's stragglers as its judge found them (issue #32 part 3): nullopt when no
  // record of this round exists (none found, or the judge has not written yet).
  std::optional<StragglerRecord> stragglers;

  std::string ToJson() const;         // one JSON object, stable field names
  std::string ToText() const;         // a human-readable multi-line table
  // The nodes' announced metrics endpoints as Prometheus file_sd JSON: one group labelled
  // efdl_job (`efdl status --prometheus-targets`; "[]" when no node announced one).
  std::string PrometheusTargets() const;
};

// Reads the job's status; NotFound-free: a job nobody registered gives exists = false.
Result<JobStatus> ReadJobStatus(etcd::Client& client, const std::string& job_id);

}  // namespace efdl::rdzv
