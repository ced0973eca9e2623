// StragglerWatch: one node's part of straggler detection (issue #32 part 3; the rule:
// src/health/straggler_rules.h; docs/operations.md "Stragglers"). The workers add their compute
// time per step to their progress slots (python/efdl/_compute.py); the Agent hands the watch
// their progress reports about every second (SampleDue, then Sample). The watch keeps the
// round's samples, publishes a summary of this node's ranks every period under its lease, reads
// whether the round's judge named this node and, on node rank 0 of the round, is that judge.
// Nothing per step goes to etcd.
//
// It only decides and records what is its own (compute/<node>, stragglers, the metrics' compute
// and straggler gauges, its log lines): when this node must leave the job as a straggler
// (--evict-stragglers) it returns an Eviction, and the Agent records the exclusion, withdraws
// from the job and stops its workers (Agent::CheckStragglers).
//
// Single-threaded: called from the Agent's loop. Times are passed in (tests use fake ones).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "health/hang_monitor.h"
#include "health/straggler_rules.h"
#include "metrics/agent_metrics.h"
#include "rendezvous/protocol.h"
#include "rendezvous/rendezvous.h"

namespace efdl::agent {

class StragglerWatch {
 public:
  // What the watch needs of the job and the node (from AgentOptions).
  struct Config {
    health::StragglerPolicy policy;              // --straggler-factor/-window, --evict-stragglers
    std::string job_id;
    std::string node_id;
    int min_nodes = 1;                           // --nnodes MIN: no eviction below it
    std::chrono::milliseconds exclude_cooldown{0};   // the first exclusion's cool-down
    metrics::AgentMetrics* metrics = nullptr;    // null: none
  };
  // This node must leave the job as a straggler: the exclusion record (cause "straggler") to
  // write, and its cool-down (it doubles with each of this node's straggler exclusions).
  struct Eviction {
    rdzv::ExclusionRecord record;
    std::chrono::milliseconds cooldown{0};
  };

  // Of `rendezvous` the watch calls only PublishCompute, ReadCompute, ReadStragglers and
  // RecordStragglers; it must outlive the watch.
  StragglerWatch(Config config, rdzv::Rendezvous& rendezvous)
      : config_(std::move(config)), rdzv_(rendezvous) {}

  // Whether a sample is due at `now` (about every second; false when detection is off). A true
  // answer schedules the next one, so call Sample now if the round's workers are watched.
  bool SampleDue(std::chrono::steady_clock::time_point now);
  // One sample of the ranks of `round` (this node's place: round, nnodes, rank_offset,
  // node_rank) from their progress `reports`; when due, publishes this node's summary, reads
  // whether the judge named it, and judges (node rank 0). An Eviction when this node was just
  // named and --evict-stragglers lets it leave (MIN other nodes go on without it).
  std::optional<Eviction> Sample(std::chrono::steady_clock::time_point now,
                                 const rdzv::Assignment& round,
                                 const std::vector<health::HangMonitor::RankSample>& reports);

 private:
  void Judge(const rdzv::Assignment& round);
  // The judge named this node: its exclusion when the job can go on without it (else one line).
  std::optional<Eviction> Evict(const rdzv::Assignment& round,
                                const rdzv::StragglerRecord::Node& me);
  // Warns once about a failed read of etcd's records.
  void WarnRead(const Status& status);

  // 14 members: the config, the rendezvous and the state of one round's detection, which the
  // rule's pure parts (straggler_rules.h) leave to their caller.
  const Config config_;
  rdzv::Rendezvous& rdzv_;
  // This node's ranks' compute-time samples of the round `compute_round_`, its summaries'
  // number, when the next sample, summary and judgement are due.
  health::ComputeWindow compute_window_;
  int64_t compute_round_ = -1;
  int64_t compute_seq_ = 0;
  std::chrono::steady_clock::time_point next_compute_sample_{};
  std::chrono::steady_clock::time_point next_compute_publish_{};
  std::chrono::steady_clock::time_point next_judgement_{};
  // The judge (node rank 0 only) and when it named each straggler.
  std::optional<health::StragglerJudge> judge_;
  std::map<std::string, std::string> straggler_since_;
  // Whether the judge names this node now; the lines said once; this node's straggler
  // exclusions (the cool-down doubles).
  bool named_straggler_ = false;
  bool straggler_min_noted_ = false;
  bool straggler_read_warned_ = false;
  int straggler_exclusions_ = 0;
};

}  // namespace efdl::agent
