#include "rendezvous/coordination.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace efdl::rdzv {
namespace {

// The Horovod port `id` offered with its ack of `round` (0: none).
uint16_t OfferedHorovodPort(const std::map<std::string, AckRecord>& acks, const std::string& id,
                            int64_t round) {
  auto it = acks.find(id);
  return it != acks.end() && it->second.round == round ? it->second.horovod_port : 0;
}

// Whether a node that turns up during an active round gets a re-round (else it is a standby).
bool RoomForNewMember(const JobView& v, const CoordinatorConfig& cfg) {
  // Fragmented mode: an active round adds up to exactly world_size, so a newcomer can only
  // wait; re-planning now could swap running members for fewer, larger nodes (a needless
  // restart). The set is re-chosen when a member leaves or fails.
  if (cfg.world_size > 0) return false;
  return static_cast<int>(v.members.size()) < cfg.max_nodes;
}

std::vector<std::string> PickDeputies(const JobView& v, const std::vector<std::string>& preferred,
                                      const std::string& self) {
  std::vector<std::string> out;
  for (const auto& id : preferred) {
    if (out.size() == kMaxDeputies) break;
    if (id != self && v.registered.count(id)) out.push_back(id);
  }
  return out;
}

bool Excluded(const JobView& v, const std::string& id) {
  return v.unresponsive.count(id) > 0 || v.leaving.count(id) > 0;
}

// How many registered nodes are excluded (unresponsive or leaving): O(excluded log N).
size_t ExcludedRegistered(const JobView& v) {
  size_t n = 0;
  for (const auto& id : v.unresponsive) n += v.registered.count(id);
  for (const auto& id : v.leaving) n += v.registered.count(id) && !v.unresponsive.count(id);
  return n;
}

// Keeps v.round_acks true of `id`'s newest ack (nullptr: it has none).
void NoteAck(JobView& v, const std::string& id, const AckRecord* ack) {
  v.round_acks.ack.erase(id);
  v.round_acks.done.erase(id);
  if (!ack || ack->round != v.round_acks.round) return;
  if (ack->state == AckState::kAck) v.round_acks.ack.insert(id);
  if (ack->state == AckState::kDone) v.round_acks.done.insert(id);
}

}  // namespace

RegisteredNodes::RegisteredNodes(std::initializer_list<Map::value_type> nodes) {
  for (const auto& [id, info] : nodes) Put(id, info);
}

void RegisteredNodes::Put(const std::string& id, const MemberInfo& info) {
  auto [it, added] = nodes_.try_emplace(id, info);
  if (!added) {
    by_join_.erase({it->second.create_revision, id});
    it->second = info;
  }
  by_join_.insert({info.create_revision, id});
}

bool RegisteredNodes::Erase(const std::string& id) {
  auto it = nodes_.find(id);
  if (it == nodes_.end()) return false;
  by_join_.erase({it->second.create_revision, id});
  nodes_.erase(it);
  return true;
}

void JobView::WantReround(bool graceful, std::string why) {
  reround = true;
  if (!graceful) reround_graceful = false;
  reround_why = std::move(why);
}

JobView LoadJob(const JobSnapshot& snap, const RoundRecord& round, const CoordinatorConfig& cfg,
                CoordTime now) {
  JobView v;
  v.window = cfg.liveness_window;
  v.last_progress = now;
  for (const auto& [id, info] : snap.nodes) v.registered.Put(id, info);
  for (const auto& [id, ack] : snap.acks) {
    v.acks[id] = ack;
    // A node on its way out (e.g. the coordinator that just handed over) is not waited for.
    if (ack.state == AckState::kLeaving) v.leaving.insert(id);
  }
  v.round_acks.round = round.round;
  for (const auto& [id, a] : v.acks) NoteAck(v, id, &a);
  int64_t last_formed = 0;
  std::map<std::string, AssignRecord> assigns;
  std::set<std::string> restarted;
  for (const auto& a : snap.assigns) {
    v.assign_keys.insert(a.id);
    if (!a.record) continue;
    // A node registered after its assignment was written is a new incarnation of that id (an
    // agent restarted with the same --node-id): it runs nothing of that round.
    if (auto r = v.registered.find(a.id);
        r != v.registered.end() && r->second.create_revision > a.mod_revision) {
      if (a.record->round == round.round && !a.record->standby) restarted.insert(a.id);
      continue;
    }
    assigns[a.id] = *a.record;
    if (!a.record->standby) last_formed = std::max(last_formed, a.record->round);
  }
  const bool active = round.phase == Phase::kActive;
  v.formed_round = last_formed;
  for (const auto& [id, a] : assigns) {
    if (a.round != last_formed) continue;
    if (!a.standby) v.prev_rank[id] = a.node_rank;
    if (!a.standby && !v.registered.count(id)) v.gone_members.insert(id);
    if (active && a.round == round.round && v.registered.count(id)) {
      (a.standby ? v.standbys : v.members).insert(id);
    }
  }
  // A coordinator that took over an active round re-checks what it may have missed.
  if (active) {
    for (const auto& [id, a] : assigns) {
      if (a.round == round.round && !a.standby && !v.registered.count(id)) {
        v.WantReround(false, fmt::format("node {} left", id));
      }
    }
    for (const auto& id : restarted) {   // its old incarnation's workers died with it
      v.WantReround(false, fmt::format("node {} restarted", id));
    }
  }
  return v;
}

EventOutcome OnNodeRegistered(JobView& v, const RoundRecord& round, const std::string& id,
                              const MemberInfo& info, const CoordinatorConfig& cfg) {
  EventOutcome out;
  v.registered.Put(id, info);
  v.unresponsive.erase(id);
  if (round.phase == Phase::kActive && !v.members.count(id) && !v.standbys.count(id)) {
    if (RoomForNewMember(v, cfg)) {
      v.WantReround(true, fmt::format("node {} joined", id));
    } else {
      out.make_standby.push_back(id);
    }
  }
  return out;
}

EventOutcome OnNodeGone(JobView& v, const RoundRecord& round, const std::string& id) {
  EventOutcome out;
  v.registered.Erase(id);
  v.acks.erase(id);
  NoteAck(v, id, nullptr);
  if (v.prev_rank.erase(id)) v.gone_members.insert(id);   // back: a new member, it goes last
  v.unresponsive.erase(id);
  const bool was_leaving = v.leaving.erase(id) > 0;
  v.standbys.erase(id);
  if (v.members.erase(id) && round.phase == Phase::kActive) {
    v.WantReround(was_leaving, fmt::format("node {} {}", id, was_leaving ? "left" : "is gone"));
  }
  out.history.push_back(
      fmt::format("node {} {}", id, was_leaving ? "left" : "is gone (lease ended)"));
  return out;
}

EventOutcome OnAck(JobView& v, const RoundRecord& round, const std::string& id,
                   const AckRecord& ack, const CoordinatorConfig& cfg, CoordTime now) {
  EventOutcome out;
  v.acks[id] = ack;
  v.unresponsive.erase(id);
  if (ack.round == round.round && v.round_acks.round != round.round) {
    v.round_acks = {round.round, {}, {}};
  }
  NoteAck(v, id, &ack);
  switch (ack.state) {
    case AckState::kAck:
      if (round.phase == Phase::kProposed && ack.round == round.round) {
        v.last_progress = now;
      } else if (round.phase == Phase::kActive && v.registered.count(id) &&
                 !v.members.count(id) && !v.standbys.count(id)) {
        // A node left out for not acking in time announced itself again: treat as a join,
        // and be more patient with the next proposal.
        v.window = std::min(v.window * 2, cfg.liveness_window * 8);
        if (RoomForNewMember(v, cfg)) {
          v.WantReround(true, fmt::format("node {} is back", id));
        } else {
          out.make_standby.push_back(id);
        }
      }
      break;
    case AckState::kFailed:
      if (round.phase == Phase::kActive && ack.round == round.round && v.members.count(id)) {
        // A collective that lost its peer is not this node's failure (NameCause names the
        // cause once the next round is decided). An own failure says how, as the node's own
        // proposal would (FailureProposal), when its ack carries this round's detail.
        const bool detail = ack.prev_round == ack.round && !ack.prev_detail.empty();
        v.WantReround(false, ack.prev_outcome == kOutcomeLost
                                 ? fmt::format("the workers of node {} lost a peer", id)
                             : detail ? fmt::format("workers of node {} failed: {}", id,
                                                    ack.prev_detail)
                                      : fmt::format("workers of node {} failed", id));
      }
      break;
    case AckState::kLeaving:
      v.leaving.insert(id);
      break;
    case AckState::kDone:
      break;
  }
  return out;
}

void OnAckDeleted(JobView& v, const std::string& id) {
  v.acks.erase(id);
  NoteAck(v, id, nullptr);
}

std::vector<Candidate> Candidates(const JobView& v, const RoundRecord& round, bool acked_only) {
  std::vector<Candidate> out;
  out.reserve(v.registered.size());
  for (const auto& [id, m] : v.registered) {
    auto a = v.acks.find(id);
    const bool acked = a != v.acks.end() && a->second.round == round.round &&
                       a->second.state == AckState::kAck;
    if (acked_only && (!acked || v.leaving.count(id))) continue;
    if (!acked_only && Excluded(v, id)) continue;
    out.push_back({id, m.create_revision, m.record.nproc, m.record.addr,
                   acked ? a->second.port : uint16_t{0}, acked && a->second.agent_store});
  }
  return out;
}

StepAction DecideStep(JobView& v, const RoundRecord& round, const CoordinatorConfig& cfg,
                      CoordTime now) {
  StepAction act;
  switch (round.phase) {
    case Phase::kGathering: {
      // O(log N + excluded) per step (it runs once per batch of join events): the count from
      // the sizes, the deputies (the oldest others) from the front of the join order.
      const int count = static_cast<int>(v.registered.size() - ExcludedRegistered(v));
      std::vector<std::string> deputies;
      for (const auto& [rev, id] : v.registered.by_join()) {
        if (deputies.size() == kMaxDeputies) break;
        if (id != cfg.node_id && !Excluded(v, id)) deputies.push_back(id);
      }
      bool formed = count >= cfg.min_nodes;
      bool full = count >= cfg.max_nodes;
      if (cfg.world_size > 0 && formed) {   // fragmented mode: only the planner knows
        formed = full = PlanRound(Candidates(v, round, false), v.prev_rank, cfg.plan()).formed;
      }
      auto set_deputies = [&] {
        if (deputies != round.deputies) {
          act.kind = StepAction::Kind::kSetDeputies;
          act.deputies = std::move(deputies);
        }
      };
      if (!formed) {
        v.min_reached_at.reset();
        set_deputies();
        return act;
      }
      if (!v.min_reached_at) v.min_reached_at = now;
      const bool survivors = !v.prev_rank.empty();   // a re-round after a formed one: no last call
      if (full || survivors || now >= *v.min_reached_at + cfg.last_call) {
        act.kind = StepAction::Kind::kPropose;
        act.graceful = round.graceful;
        act.why = round.message.empty() ? "enough nodes registered" : round.message;
      } else {
        set_deputies();
      }
      return act;
    }
    case Phase::kProposed: {
      // Cheap test first: the full O(N) check runs only once as many nodes acked as it needs.
      const size_t expected = v.registered.size() - ExcludedRegistered(v);
      bool all = v.round_acks.round == round.round && v.round_acks.ack.size() >= expected;
      for (auto it = v.registered.begin(); all && it != v.registered.end(); ++it) {
        if (Excluded(v, it->first)) continue;
        auto a = v.acks.find(it->first);
        all = a != v.acks.end() && a->second.round == round.round &&
              a->second.state == AckState::kAck;
      }
      if (all && !round.graceful) {
        // Only lost peers reported yet: give the node that caused it the window to say so.
        const RoundCause cause = NameCause(v, round);
        all = !cause.lost || cause.named;
      }
      if (all || now >= v.last_progress + v.window) act.kind = StepAction::Kind::kFinalize;
      return act;
    }
    case Phase::kActive: {
      // Cheap test first (members report done one by one): the walk runs once enough did.
      const bool done =
          !v.members.empty() && v.round_acks.round == round.round &&
          v.round_acks.done.size() >= v.members.size() &&
          std::all_of(v.members.begin(), v.members.end(), [&](const std::string& id) {
            auto a = v.acks.find(id);
            return a != v.acks.end() && a->second.round == round.round &&
                   a->second.state == AckState::kDone;
          });
      if (done) {
        act.kind = StepAction::Kind::kComplete;
      } else if (v.reround) {
        act.kind = StepAction::Kind::kPropose;
        act.graceful = v.reround_graceful;
        act.why = v.reround_why;
      }
      return act;
    }
    case Phase::kComplete:
    case Phase::kSuspended:
      return act;
  }
  return act;
}

std::optional<CoordTime> NextCoordinatorDeadline(const JobView& v, const RoundRecord& round,
                                                 const CoordinatorConfig& cfg) {
  if (round.phase == Phase::kGathering && v.min_reached_at) {
    return *v.min_reached_at + cfg.last_call;
  }
  if (round.phase == Phase::kProposed) return v.last_progress + v.window;
  return std::nullopt;
}

namespace {
// A proposed round has no layout yet: the finalize step fills it in from the acks.
void ClearLayout(RoundRecord& r) {
  r.world_size = 0;
  r.nnodes = 0;
  r.master_addr.clear();
  r.master_port = 0;
  r.horovod_port = 0;
  r.agent_store = false;
}
}  // namespace

RoundRecord BeginProposal(JobView& v, const RoundRecord& round, const CoordinatorConfig& cfg,
                          bool graceful, const std::string& why) {
  RoundRecord next = round;
  if (round.phase != Phase::kGathering) next.round = round.round + 1;
  next.phase = Phase::kProposed;
  next.coordinator = cfg.node_id;
  next.graceful = graceful;
  next.message = why;
  ClearLayout(next);
  v.reround = false;
  v.reround_graceful = true;
  v.reround_why.clear();
  v.min_reached_at.reset();
  return next;
}

FinalizeAction DecideFinalize(JobView& v, const RoundRecord& round,
                              const CoordinatorConfig& cfg) {
  FinalizeAction act;
  const std::vector<Candidate> acked = Candidates(v, round, true);
  const std::vector<Candidate> everyone = Candidates(v, round, false);
  act.plan = PlanRound(acked, v.prev_rank, cfg.plan());
  if (!act.plan.formed && PlanRound(everyone, v.prev_rank, cfg.plan()).formed) {
    // Enough nodes are registered but too few answered yet: a stall (etcd or the machines
    // slow), not a verdict on the silent ones. Giving up would mark most nodes unresponsive
    // and cascade into more rounds; wait another window instead (the join timeout still bounds
    // each node's wait, and leases still remove the dead).
    return act;
  }
  std::set<std::string> answered;
  for (const auto& c : acked) answered.insert(c.id);
  for (const auto& c : everyone) {
    if (!answered.count(c.id)) v.unresponsive.insert(c.id);
  }
  act.next = round;
  if (!act.plan.formed) {
    act.kind = FinalizeAction::Kind::kNotFormed;
    act.next.round = round.round + 1;   // a proposal number is never reused
    act.next.phase = Phase::kGathering;
    act.next.message = fmt::format("round {} not formed: {} of at least {} nodes answered",
                                   round.round, acked.size(), cfg.min_nodes);
    act.history = act.next.message;
    return act;
  }
  act.kind = FinalizeAction::Kind::kForm;
  const Plan& plan = act.plan;
  const RoundCause cause = NameCause(v, round);
  std::vector<AssignRecord> member_assigns = MemberAssignments(round.round, plan);
  std::vector<std::string> order;
  auto early = [&](const std::string& id) {
    return std::find(cause.early_exit.begin(), cause.early_exit.end(), id) !=
           cause.early_exit.end();
  };
  for (size_t i = 0; i < plan.members.size(); ++i) {
    member_assigns[i].early_exit = early(plan.members[i].id);
    act.writes.push_back({plan.members[i].id, std::move(member_assigns[i])});
    order.push_back(plan.members[i].id);
  }
  for (const auto& id : plan.standbys) {
    AssignRecord standby{round.round, 0, 0, true};
    standby.early_exit = early(id);
    act.writes.push_back({id, std::move(standby)});
    order.push_back(id);
  }
  if (!cause.message.empty()) act.next.message = cause.message;
  for (const auto& id : v.assign_keys) {
    if (!v.registered.count(id)) act.stale.push_back(id);
  }
  act.next.phase = Phase::kActive;
  act.next.world_size = plan.world_size;
  act.next.nnodes = static_cast<int>(plan.members.size());
  act.next.master_addr = plan.master_addr;
  act.next.master_port = plan.master_port;
  act.next.agent_store = plan.agent_store;
  act.next.horovod_port =
      plan.members.empty() ? 0 : OfferedHorovodPort(v.acks, plan.members.front().id, round.round);
  act.next.deputies = PickDeputies(v, order, cfg.node_id);
  act.history = fmt::format("round {} formed: {} nodes, world size {}, {} standby, {} left out",
                            round.round, plan.members.size(), plan.world_size,
                            plan.standbys.size(), v.unresponsive.size());
  if (!cause.message.empty()) act.history += fmt::format("; the cause: {}", cause.message);
  return act;
}

RoundCause NameCause(const JobView& v, const RoundRecord& round) {
  RoundCause cause;
  if (round.graceful || v.formed_round == 0) return cause;
  struct Named {
    std::string id, detail;
  };
  std::vector<Named> own, done, missing;
  std::vector<std::string> lost;
  std::set<std::string> formed;
  for (const auto& [id, rank] : v.prev_rank) formed.insert(id);
  formed.insert(v.gone_members.begin(), v.gone_members.end());
  for (const auto& id : formed) {
    auto a = v.acks.find(id);
    const bool reported = a != v.acks.end() && a->second.prev_round == v.formed_round;
    const std::string outcome = reported ? a->second.prev_outcome : "";
    const std::string detail = reported ? a->second.prev_detail : "";
    const bool answered = a != v.acks.end() && a->second.round == round.round &&
                          a->second.state == AckState::kAck;
    if (outcome == kOutcomeFailed) {
      own.push_back({id, detail});
    } else if (outcome == kOutcomeLost) {
      lost.push_back(id);
    } else if (outcome == kOutcomeDone) {
      done.push_back({id, detail});
    } else if (v.gone_members.count(id) || !v.registered.count(id)) {
      missing.push_back({id, "is gone (its lease ended or it left)"});
    } else if (!answered) {
      missing.push_back({id, "stopped answering (it did not ack the next round)"});
    }
  }
  cause.lost = !lost.empty();
  cause.named = !own.empty() || !missing.empty() || !done.empty();
  if (lost.empty()) return cause;
  const std::string losers = fmt::format("{}", fmt::join(lost, ", "));
  auto more = [](size_t n) {
    return n > 1 ? fmt::format(" (and {} more node(s))", n - 1) : std::string();
  };
  if (!own.empty()) {
    cause.message = fmt::format("workers of node {} failed: {}{}", own.front().id,
                                own.front().detail.empty() ? "a worker failed" : own.front().detail,
                                more(own.size()));
  } else if (!missing.empty()) {
    cause.message = fmt::format("node {} {}{}; the collectives of node(s) {} lost it",
                                missing.front().id, missing.front().detail,
                                more(missing.size()), losers);
  } else if (!done.empty()) {
    for (const auto& d : done) cause.early_exit.push_back(d.id);
    cause.message = fmt::format(
        "workers of node {} failed: {} exited 0 before the job completed{}; the collectives of "
        "node(s) {} lost it",
        done.front().id, done.front().detail.empty() ? "its workers" : done.front().detail,
        more(done.size()), losers);
  } else {
    cause.message = fmt::format("the collectives of node(s) {} lost a peer; no node named the "
                                "cause", losers);
  }
  return cause;
}

void AssignmentsWritten(JobView& v, const FinalizeAction& formed) {
  for (const auto& w : formed.writes) v.assign_keys.insert(w.first);
  for (const auto& id : formed.stale) v.assign_keys.erase(id);
  v.formed_round = formed.next.round;
  v.gone_members.clear();
  v.prev_rank.clear();
  v.members.clear();
  for (const auto& m : formed.plan.members) {
    v.prev_rank[m.id] = m.node_rank;
    v.members.insert(m.id);
  }
  v.standbys = {formed.plan.standbys.begin(), formed.plan.standbys.end()};
}

std::string StandbyAssigned(JobView& v, const std::string& id, const CoordinatorConfig& cfg) {
  v.standbys.insert(id);
  v.assign_keys.insert(id);
  return cfg.world_size > 0
             ? fmt::format("node {} is a standby (the round already adds up to world size {})",
                           id, cfg.world_size)
             : fmt::format("node {} is a standby (the job is at its maximum of {} nodes)", id,
                           cfg.max_nodes);
}

RoundRecord CompletionRecord(const RoundRecord& round) {
  RoundRecord next = round;
  next.phase = Phase::kComplete;
  next.message = fmt::format("job complete: every worker of round {} succeeded", round.round);
  return next;
}

RoundRecord TakeOverRecord(const RoundRecord& round, const std::string& self) {
  RoundRecord next = round;
  const std::string& gone = round.coordinator;
  next.coordinator = self;
  std::erase(next.deputies, self);
  next.graceful = false;
  // An empty coordinator is a resumed job's (suspend.h): keep its "resumed ..." message.
  if (!gone.empty()) next.message = fmt::format("coordinator {} is gone; {} took over", gone, self);
  if (round.phase != Phase::kGathering) {
    next.round = round.round + 1;
    next.phase = Phase::kProposed;
  }
  return next;
}

bool IsTakeOver(const RoundRecord& prev, const RoundRecord& next) {
  return !prev.coordinator.empty() && next.coordinator != prev.coordinator && !next.graceful &&
         next.message == fmt::format("coordinator {} is gone; {} took over", prev.coordinator,
                                     next.coordinator);
}

RoundRecord HandOverRecord(const RoundRecord& round, const std::string& self,
                           const std::string& successor) {
  RoundRecord next = round;
  next.coordinator = successor;
  std::erase(next.deputies, successor);
  std::erase(next.deputies, self);
  next.graceful = true;
  next.message =
      fmt::format("node {} left (it was the coordinator; {} took over)", self, successor);
  if (round.phase != Phase::kGathering) {
    next.round = round.round + 1;
    next.phase = Phase::kProposed;
    ClearLayout(next);
  }
  return next;
}

}  // namespace efdl::rdzv
