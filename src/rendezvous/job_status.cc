#include "rendezvous/job_status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>

#include "rendezvous/protocol.h"
#include "rendezvous/status_pages.h"
#include "rendezvous/suspend.h"

namespace efdl::rdzv {

using nlohmann::json;

Result<JobStatus> ReadJobStatus(etcd::Client& client, const std::string& job_id) {
  EFDL_RETURN_IF_ERROR(ValidateId("job id", job_id));
  JobKeys keys(job_id);
  auto snap = client.Txn({}, {etcd::TxnOp::Get(keys.round), etcd::TxnOp::Get(keys.status),
                              etcd::TxnOp::Get(keys.nodes, true), etcd::TxnOp::Get(keys.ack, true),
                              etcd::TxnOp::Get(keys.complete),
                              etcd::TxnOp::Get(keys.suspended, true),
                              etcd::TxnOp::Get(keys.gaveup, true),
                              etcd::TxnOp::Get(StatusPagePrefix(keys), true),
                              etcd::TxnOp::Get(keys.excluded, true),
                              etcd::TxnOp::Get(keys.stragglers)});
  if (!snap.ok()) return snap.status().WithContext(fmt::format("cannot read job {}", job_id));
  if (snap->gets.size() != 10) return Status::Internal("etcd answered a short transaction");
  JobStatus out;
  out.job_id = job_id;
  out.complete = !snap->gets[4].kvs.empty();
  if (snap->gets[0].kvs.empty()) return out;
  out.exists = true;
  auto round = RoundRecord::Decode(snap->gets[0].kvs[0].value);
  if (!round.ok()) return round.status();
  out.round = round->round;
  out.phase = PhaseName(round->phase);
  out.coordinator = round->coordinator;
  out.world_size = round->world_size;
  out.nnodes = round->nnodes;
  out.master_addr = round->master_addr;
  out.master_port = round->master_port;
  out.message = round->message;
  for (const auto& kv : snap->gets[6].kvs) {
    auto rec = GaveUpRecord::Decode(kv.value);
    out.gave_up[kv.key.substr(keys.gaveup.size())] =
        rec.ok() ? *rec : GaveUpRecord{"(unreadable record)", "", {}};
  }
  for (const auto& kv : snap->gets[8].kvs) {
    auto rec = ExclusionRecord::Decode(kv.value);
    ExclusionRecord unreadable;
    unreadable.reason = "(unreadable record)";
    out.excluded[kv.key.substr(keys.excluded.size())] = rec.ok() ? *rec : unreadable;
  }
  if (!snap->gets[9].kvs.empty()) {
    auto rec = StragglerRecord::Decode(snap->gets[9].kvs[0].value);
    if (rec.ok() && rec->round == out.round && !rec->nodes.empty()) out.stragglers = *rec;
  }
  out.suspended = round->phase == Phase::kSuspended;
  if (out.suspended) {
    std::map<std::string, SuspendReport> reports;
    for (const auto& kv : snap->gets[5].kvs) {
      auto report = SuspendReport::Decode(kv.value);
      std::string node = kv.key.substr(keys.suspended.size());
      reports[node] = report.ok() ? *report : SuspendReport{};
      out.suspend_reports[node] = reports[node].step;
    }
    if (auto point = JobSuspendPoint(reports)) {
      out.suspended_step = point->step;
      out.suspended_seq = point->seq;
      out.suspended_epoch = point->epoch;
    }
  }

  std::map<std::string, NodeStatus> live;
  for (const auto& kv : snap->gets[2].kvs) {
    NodeStatus n;
    n.id = kv.key.substr(keys.nodes.size());
    auto rec = NodeRecord::Decode(kv.value);
    if (rec.ok()) {
      n.addr = rec->addr;
      n.nproc = rec->nproc;
      n.metrics = rec->metrics;
    }
    n.state = "waiting";
    live[n.id] = n;
  }
  for (const auto& kv : snap->gets[3].kvs) {
    auto it = live.find(kv.key.substr(keys.ack.size()));
    auto rec = AckRecord::Decode(kv.value);
    if (it == live.end() || !rec.ok()) continue;
    it->second.last_report = AckStateName(rec->state);
    it->second.last_report_round = rec->round;
    it->second.restarts = rec->restarts;
    it->second.no_prestart = rec->no_prestart;
  }
  if (!snap->gets[1].kvs.empty()) {
    // The status record is informational: a damaged one leaves the lists it would have filled
    // empty (nodes then show as waiting) instead of failing the whole command.
    auto st =
        StatusRecord::Decode(JoinStatusPages(snap->gets[1].kvs[0].value, snap->gets[7].kvs));
    if (st.ok()) {
      for (const auto& m : st->members) {
        auto it = live.find(m.id);
        NodeStatus n = it != live.end() ? it->second : NodeStatus{};
        n.id = m.id;
        if (n.addr.empty()) n.addr = m.addr;
        if (n.nproc == 0) n.nproc = m.nproc;
        n.node_rank = m.rank;
        n.state = it != live.end() ? "member" : "gone";
        if (it != live.end()) live.erase(it);
        out.members.push_back(n);
      }
      for (const auto& id : st->standbys) {
        auto it = live.find(id);
        if (it == live.end()) continue;
        it->second.state = "standby";
        out.standbys.push_back(it->second);
        live.erase(it);
      }
      for (const auto& e : st->events) out.events.push_back({e.time, e.message});
    }
  }
  for (auto& [id, n] : live) out.waiting.push_back(n);
  std::sort(out.members.begin(), out.members.end(),
            [](const NodeStatus& a, const NodeStatus& b) { return a.node_rank < b.node_rank; });
  return out;
}

namespace {
json NodeJson(const NodeStatus& n) {
  return {{"id", n.id},         {"addr", n.addr},
          {"nproc", n.nproc},   {"node_rank", n.node_rank},
          {"state", n.state},   {"last_report", n.last_report},
          {"last_report_round", n.last_report_round}, {"restarts", n.restarts},
          {"no_prestart", n.no_prestart}, {"metrics", n.metrics}};
}
}  // namespace

std::string JobStatus::ToJson() const {
  json j = {{"job_id", job_id},       {"exists", exists},     {"round", round},
            {"phase", phase},         {"coordinator", coordinator},
            {"world_size", world_size}, {"nnodes", nnodes},   {"master_addr", master_addr},
            {"master_port", master_port}, {"complete", complete}, {"message", message}};
  j["suspended"] = suspended;
  j["suspended_step"] = suspended_step ? json(*suspended_step) : json(nullptr);
  j["suspended_seq"] = suspended_seq ? json(*suspended_seq) : json(nullptr);
  j["suspended_epoch"] = suspended_epoch ? json(*suspended_epoch) : json(nullptr);
  json reports = json::object();
  for (const auto& [node, step] : suspend_reports) reports[node] = step ? json(*step) : json(nullptr);
  j["suspend_reports"] = reports;
  for (const auto* list : {&members, &standbys, &waiting}) {
    json arr = json::array();
    for (const auto& n : *list) arr.push_back(NodeJson(n));
    j[list == &members ? "members" : list == &standbys ? "standbys" : "waiting"] = arr;
  }
  json ev = json::array();
  for (const auto& e : events) ev.push_back({{"time", e.time}, {"message", e.message}});
  j["events"] = ev;
  json gave = json::object();
  for (const auto& [node, g] : gave_up) {
    gave[node] = {{"time", g.time}, {"reason", g.reason}, {"stderr", g.stderr_tail}};
  }
  j["gave_up"] = gave;
  json excl = json::object();
  for (const auto& [node, e] : excluded) {
    excl[node] = {{"time", e.time},         {"until", e.until},
                  {"reason", e.reason},     {"failures", e.failures},
                  {"exclusion", e.exclusion}, {"stderr", e.stderr_tail},
                  {"cause", e.cause.empty() ? "failures" : e.cause}};
  }
  j["excluded"] = excl;
  // The current round's stragglers, by node (issue #32 part 3); {} when none.
  json strag = json::object();
  if (stragglers) {
    for (const auto& n : stragglers->nodes) {
      strag[n.id] = {{"ranks", n.ranks},         {"compute_s", n.compute_s},
                     {"median_s", n.median_s},   {"windows", n.windows},
                     {"since", n.since},         {"round", stragglers->round},
                     {"factor", stragglers->factor}, {"window_s", stragglers->window_s}};
    }
  }
  j["stragglers"] = strag;
  return j.dump(2, ' ', false, json::error_handler_t::replace);  // stderr lines: any bytes
}

std::string JobStatus::PrometheusTargets() const {
  json targets = json::array();
  for (const auto* list : {&members, &standbys, &waiting}) {
    for (const auto& n : *list) {
      if (!n.metrics.empty() && n.state != "gone") targets.push_back(n.metrics);
    }
  }
  json groups = json::array();
  if (!targets.empty()) {
    groups.push_back({{"targets", targets}, {"labels", {{"efdl_job", job_id}}}});
  }
  return groups.dump(1);
}

std::string JobStatus::ToText() const {
  if (!exists) return fmt::format("job {}: no node has registered\n", job_id);
  // A suspended or completed job has no live round: its record's world size, node count and
  // master are zero and empty, so the first line says what the job is instead.
  std::string out;
  if (suspended) {
    out = fmt::format(
        "job {}: SUSPENDED after round {} {}; `efdl resume --job {}` continues it from there\n",
        job_id, round,
        suspended_step
            ? "at " + DescribeSuspendPoint(SuspendReport{suspended_step, "", suspended_seq,
                                                         suspended_epoch})
            : std::string("(no persisted step reported yet)"),
        job_id);
    for (const auto& [node, step] : suspend_reports) {
      out += fmt::format("  {:<24} stopped, persisted step {}\n", node,
                         step ? std::to_string(*step) : "-");
    }
  } else if (complete) {
    out = fmt::format("job {}: COMPLETE after round {} (its workers finished); `efdl reset --job "
                      "{}` lets the job id run again\n",
                      job_id, round, job_id);
  } else {
    out = fmt::format("job {}: round {} ({}), world size {}, {} node(s), master {}:{}\n", job_id,
                      round, phase, world_size, nnodes, master_addr, master_port);
  }
  out += fmt::format("  {:<24} {:<18} {:>5} {:>5} {:<8} {:<14} {:>8}\n", "NODE", "ADDRESS",
                     "PROCS", "RANK", "STATE", "LAST REPORT", "RESTARTS");
  for (const auto* list : {&members, &standbys, &waiting}) {
    for (const auto& n : *list) {
      out += fmt::format("  {:<24} {:<18} {:>5} {:>5} {:<8} {:<14} {:>8}\n", n.id, n.addr,
                         n.nproc, n.node_rank >= 0 ? std::to_string(n.node_rank) : "-", n.state,
                         n.last_report.empty()
                             ? "-"
                             : fmt::format("{} r{}", n.last_report, n.last_report_round),
                         n.restarts);
    }
  }
  // Prometheus' targets (docs/operations.md, "Metrics"): `efdl status --json` has them too.
  for (const auto* list : {&members, &standbys, &waiting}) {
    for (const auto& n : *list) {
      if (!n.metrics.empty()) {
        out += fmt::format("  {} serves metrics at http://{}/metrics\n", n.id, n.metrics);
      }
    }
  }
  for (const auto* list : {&members, &standbys, &waiting}) {
    for (const auto& n : *list) {
      if (n.no_prestart.empty()) continue;
      out += fmt::format("  {} runs WITHOUT PRE-STARTED WORKERS (each round starts its workers "
                         "cold): {}\n", n.id, n.no_prestart);
    }
  }
  for (const auto& [node, g] : gave_up) {
    out += fmt::format("  {} GAVE UP at {}: {}\n", node, g.time.empty() ? "?" : g.time,
                       g.reason);
    if (!g.stderr_tail.empty()) out += "    its last stderr lines:\n";
    for (const auto& line : g.stderr_tail) out += fmt::format("      {}\n", line);
  }
  for (const auto& [node, e] : excluded) {
    out += fmt::format("  {} EXCLUDED at {} until {} ({}; exclusion {}); it may rejoin then: "
                       "{}\n",
                       node, e.time.empty() ? "?" : e.time, e.until.empty() ? "?" : e.until,
                       e.cause == "straggler"
                           ? std::string("a straggler, --evict-stragglers")
                           : fmt::format("its own workers failed {} time(s)", e.failures),
                       e.exclusion, e.reason);
    if (!e.stderr_tail.empty()) out += "    its last stderr lines:\n";
    for (const auto& line : e.stderr_tail) out += fmt::format("      {}\n", line);
  }
  if (stragglers) {
    for (const auto& n : stragglers->nodes) {
      out += fmt::format("  {} is a STRAGGLER in round {} since {}: {} {} {:.3f} s of compute per "
                         "step, {:.1f}x the median {:.3f} s of the other nodes' ranks "
                         "(--straggler-factor {:g}, over {} summaries)\n",
                         n.id, stragglers->round, n.since.empty() ? "?" : n.since,
                         n.ranks.size() == 1 ? "rank" : "ranks", fmt::join(n.ranks, ", "),
                         n.compute_s, n.median_s > 0 ? n.compute_s / n.median_s : 0.0,
                         n.median_s, stragglers->factor, n.windows);
    }
  }
  if (!events.empty()) out += "recent events:\n";
  for (const auto& e : events) out += fmt::format("  {} {}\n", e.time, e.message);
  return out;
}

}  // namespace efdl::rdzv
