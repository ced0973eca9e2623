#include "rendezvous/coordinator.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <thread>
#include <utility>

#include "common/log.h"
#include "rendezvous/status_pages.h"

namespace efdl::rdzv {
namespace {

using nlohmann::json;

constexpr size_t kAssignBatch = 127;   // puts per txn, under etcd's default --max-txn-ops 128
constexpr size_t kAssignWriters = 8;   // assignment txns in flight at once (issue #37)
constexpr size_t kMaxStatusEvents = 32;

}  // namespace

namespace {

// How the assignment txns of a finalize went: all written, or not (a lost compare: error is OK).
struct BatchesOutcome {
  bool written = true;
  Status error;
};

// Sends `batches`, one txn each guarded by `guard`, with up to kAssignWriters in flight (the
// client is thread-safe; they are independent: a node starts only once it holds its assignment
// AND the active record, written after all of them). No batch is issued after the first one that
// failed or lost its compare. The writer threads are owned here and joined before it returns.
BatchesOutcome WriteBatches(etcd::Client& client, const etcd::Compare& guard,
                            const std::vector<std::vector<etcd::TxnOp>>& batches) {
  std::mutex mu;
  size_t next = 0;
  BatchesOutcome out;
  auto work = [&] {
    for (;;) {
      size_t i = 0;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!out.written || next == batches.size()) return;
        i = next++;
      }
      auto txn = client.Txn({guard}, batches[i]);
      if (txn.ok() && txn->succeeded) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (out.written) out = {false, txn.ok() ? Status::OK() : txn.status()};
    }
  };
  {
    std::vector<std::jthread> writers;   // joined when this block ends
    const size_t n = std::min(kAssignWriters, batches.size());
    for (size_t k = 1; k < n; ++k) writers.emplace_back(work);
    work();   // this thread is one of the writers
  }
  return out;
}

}  // namespace

void Coordinator::Record(const std::string& message) {
  EFDL_LOG_INFO("rdzv {} (coordinator of {}): {}", cfg_.node_id, cfg_.job_id, message);
  history_.push_back({{"time", WallClockTimestamp()}, {"message", message}});
  while (history_.size() > kMaxStatusEvents) history_.pop_front();
}

void Coordinator::Start() {
  ++generation_;
  view_ = JobView{};
  history_.clear();
  // One consistent snapshot of everything the coordinator needs: O(N), once per takeover.
  auto snap = client_.Txn({}, {etcd::TxnOp::Get(keys_.nodes, true),
                               etcd::TxnOp::Get(keys_.ack, true),
                               etcd::TxnOp::Get(keys_.assign, true),
                               etcd::TxnOp::Get(keys_.status)});
  if (!snap.ok() || snap->gets.size() != 4) {
    EFDL_LOG_WARN("rdzv {}: cannot read the job to coordinate it: {}", cfg_.node_id,
                  snap.ok() ? "short answer" : snap.status().ToString());
    host_.RequestResync();
    return;
  }
  JobSnapshot job;
  for (const auto& kv : snap->gets[0].kvs) {
    auto rec = NodeRecord::Decode(kv.value);
    if (rec.ok()) job.nodes.push_back({kv.key.substr(keys_.nodes.size()), {kv.create_revision, *rec}});
  }
  for (const auto& kv : snap->gets[1].kvs) {
    auto rec = AckRecord::Decode(kv.value);
    if (rec.ok()) job.acks.push_back({kv.key.substr(keys_.ack.size()), *rec});
  }
  for (const auto& kv : snap->gets[2].kvs) {
    auto rec = AssignRecord::Decode(kv.value);
    job.assigns.push_back({kv.key.substr(keys_.assign.size()), kv.mod_revision,
                           rec.ok() ? std::optional<AssignRecord>(*rec) : std::nullopt});
  }
  view_ = LoadJob(job, host_.round(), cfg_, CoordClock::now());
  if (!snap->gets[3].kvs.empty()) {
    json st = json::parse(snap->gets[3].kvs[0].value, nullptr, false);
    if (st.is_object() && st.contains("events") && st["events"].is_array()) {
      for (const auto& e : st["events"]) history_.push_back(e);
    }
  }
  auto w1 = client_.StartWatch(keys_.nodes, {true, snap->revision + 1, false},
                               host_.CoordinatorWatch(true, generation_));
  auto w2 = client_.StartWatch(keys_.ack, {true, snap->revision + 1, false},
                               host_.CoordinatorWatch(false, generation_));
  if (!w1.ok() || !w2.ok()) {
    host_.RequestResync();
    return;
  }
  nodes_watch_ = std::move(*w1);
  acks_watch_ = std::move(*w2);
  active_ = true;
  const RoundRecord& round = host_.round();
  Record(fmt::format("coordinating round {} ({}), {} nodes registered", round.round,
                     PhaseName(round.phase), view_.registered.size()));
}

void Coordinator::Stop() {
  if (!active_) return;
  active_ = false;
  ++generation_;
  nodes_watch_.reset();
  acks_watch_.reset();
}

void Coordinator::Execute(const EventOutcome& outcome) {
  for (const auto& line : outcome.history) Record(line);
  for (const auto& id : outcome.make_standby) AssignStandby(id);
}

namespace {

// Calls on_put(id, kv, record) for each put of a readable `Record` under `prefix` (a bad one is
// logged and skipped) and on_delete(id) for each deletion.
template <typename Record, typename OnPut, typename OnDelete>
void ForEachRecord(const std::vector<etcd::WatchEvent>& events, const std::string& prefix,
                   const char* what, const std::string& self, OnPut on_put, OnDelete on_delete) {
  for (const auto& e : events) {
    const std::string id = e.kv.key.substr(prefix.size());
    if (e.type == etcd::WatchEvent::Type::kDelete) {
      on_delete(id);
      continue;
    }
    auto rec = Record::Decode(e.kv.value);
    if (!rec.ok()) {
      EFDL_LOG_WARN("rdzv {}: ignoring a bad {} record at {}: {}", self, what, e.kv.key,
                    rec.status().ToString());
      continue;
    }
    on_put(id, e.kv, *rec);
  }
}

}  // namespace

void Coordinator::OnNodesEvents(const std::vector<etcd::WatchEvent>& events) {
  ForEachRecord<NodeRecord>(
      events, keys_.nodes, "node", cfg_.node_id,
      [&](const std::string& id, const etcd::KeyValue& kv, const NodeRecord& rec) {
        Execute(OnNodeRegistered(view_, host_.round(), id, {kv.create_revision, rec}, cfg_));
      },
      [&](const std::string& id) { Execute(OnNodeGone(view_, host_.round(), id)); });
}

void Coordinator::OnAckEvents(const std::vector<etcd::WatchEvent>& events) {
  ForEachRecord<AckRecord>(
      events, keys_.ack, "ack", cfg_.node_id,
      [&](const std::string& id, const etcd::KeyValue&, const AckRecord& rec) {
        Execute(OnAck(view_, host_.round(), id, rec, cfg_, CoordClock::now()));
      },
      [&](const std::string& id) { OnAckDeleted(view_, id); });
}

std::optional<CoordTime> Coordinator::NextDeadline() const {
  if (!active_) return std::nullopt;
  return NextCoordinatorDeadline(view_, host_.round(), cfg_);
}

void Coordinator::Step(CoordTime now) {
  if (!active_) return;
  if (status_stale_) {
    status_stale_ = false;
    WriteStatus();
  }
  StepAction act = DecideStep(view_, host_.round(), cfg_, now);
  switch (act.kind) {
    case StepAction::Kind::kNone:
      return;
    case StepAction::Kind::kSetDeputies:
      SetDeputies(std::move(act.deputies));
      return;
    case StepAction::Kind::kPropose:
      Propose(act.graceful, act.why);
      return;
    case StepAction::Kind::kFinalize:
      Finalize();
      return;
    case StepAction::Kind::kComplete:
      CompleteJob();
      return;
  }
}

void Coordinator::SetDeputies(std::vector<std::string> deputies) {
  RoundRecord next = host_.round();
  next.deputies = std::move(deputies);
  if (!host_.CasRound(next)) host_.RereadRound();
}

void Coordinator::Propose(bool graceful, const std::string& why) {
  RoundRecord next = BeginProposal(view_, host_.round(), cfg_, graceful, why);
  Record(fmt::format("proposing round {}: {}", next.round, why));
  if (host_.CasRound(next)) {
    view_.last_progress = CoordClock::now();
  } else {
    host_.RereadRound();
  }
}

void Coordinator::Finalize() {
  view_.last_progress = CoordClock::now();   // on an etcd error below, retry after a window
  FinalizeAction act = DecideFinalize(view_, host_.round(), cfg_);
  switch (act.kind) {
    case FinalizeAction::Kind::kWait:
      return;
    case FinalizeAction::Kind::kNotFormed:
      Record(act.history);
      if (!host_.CasRound(act.next)) host_.RereadRound();
      WriteStatus();
      return;
    case FinalizeAction::Kind::kForm:
      break;
  }
  // The peer-copy ring (issue #35 part 2): data in the members' records, no decision. The
  // members' records come first in act.writes, in plan order.
  const int64_t formed = host_.round().round;
  const std::vector<PeerCopyTarget> ring = PeerCopyRing(act.plan, [&](const std::string& id) {
    auto it = view_.acks.find(id);
    return it != view_.acks.end() && it->second.round == formed ? it->second.peer_copy_port
                                                                : uint16_t{0};
  });
  for (size_t i = 0; i < ring.size() && i < act.writes.size(); ++i) {
    act.writes[i].second.peer_copy = ring[i];
  }
  // Assignments first, in batches, each guarded by the round record we own: a coordinator that
  // was replaced meanwhile writes nothing. The active record only once every batch is written.
  std::vector<std::vector<etcd::TxnOp>> batches;
  const size_t total = act.writes.size() + act.stale.size();
  for (size_t i = 0; i < total; ++i) {
    if (i % kAssignBatch == 0) batches.emplace_back();
    if (i < act.writes.size()) {
      batches.back().push_back(
          etcd::TxnOp::Put(keys_.Assign(act.writes[i].first), act.writes[i].second.Encode()));
    } else {
      batches.back().push_back(etcd::TxnOp::Delete(keys_.Assign(act.stale[i - act.writes.size()])));
    }
  }
  const BatchesOutcome sent = WriteBatches(
      client_, etcd::Compare::ModRevisionIs(keys_.round, host_.round_revision()), batches);
  if (!sent.written) {
    if (!sent.error.ok()) {
      EFDL_LOG_WARN("rdzv {}: writing assignments failed: {}", cfg_.node_id,
                    sent.error.ToString());
    }
    host_.RereadRound();
    return;
  }
  AssignmentsWritten(view_, act);
  Record(act.history);
  if (!host_.CasRound(act.next)) {
    host_.RereadRound();
    return;
  }
  WriteStatus();
}

void Coordinator::AssignStandby(const std::string& id) {
  AssignRecord a{host_.round().round, 0, 0, true};
  auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, host_.round_revision())},
                         {etcd::TxnOp::Put(keys_.Assign(id), a.Encode())});
  if (txn.ok() && txn->succeeded) {
    Record(StandbyAssigned(view_, id, cfg_));
    status_stale_ = true;   // written by the next Step, once for every standby of the batch
  } else {
    host_.RereadRound();
  }
}

void Coordinator::CompleteJob() {
  const RoundRecord next = CompletionRecord(host_.round());
  Record(next.message);
  WriteStatus();
  auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, host_.round_revision())},
                         {etcd::TxnOp::Put(keys_.round, next.Encode()),
                          etcd::TxnOp::Put(keys_.complete,
                                           json{{"round", next.round},
                                                {"time", WallClockTimestamp()}}.dump())});
  if (!txn.ok() || !txn->succeeded) {
    host_.RereadRound();
    return;
  }
  host_.ApplyRound(next, txn->revision);
}

void Coordinator::WriteStatus() {
  json members = json::array();
  std::vector<std::pair<int, std::string>> ranked;
  for (const auto& id : view_.members) {
    auto r = view_.prev_rank.find(id);
    ranked.push_back({r != view_.prev_rank.end() ? r->second : 0, id});
  }
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [rank, id] : ranked) {
    auto it = view_.registered.find(id);
    const bool known = it != view_.registered.end();
    members.push_back({{"id", id},
                       {"rank", rank},
                       {"addr", known ? it->second.record.addr : ""},
                       {"nproc", known ? it->second.record.nproc : 0}});
  }
  json st = {{"round", host_.round().round},
             {"coordinator", cfg_.node_id},
             {"members", members},
             {"standbys", json(std::vector<std::string>(view_.standbys.begin(),
                                                        view_.standbys.end()))},
             {"events", json(std::vector<json>(history_.begin(), history_.end()))}};
  auto put = PutStatusRecord(client_, keys_, std::move(st));   // in pages at 4096+ nodes
  if (!put.ok()) {
    EFDL_LOG_WARN("rdzv {}: cannot write the job status: {}", cfg_.node_id,
                  put.status().ToString());
  }
}

}  // namespace efdl::rdzv
