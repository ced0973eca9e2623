// The node's part of the round (protocol.h): joining, taking the round record, acking,
// starting, fencing, taking over from a vanished coordinator, handing coordination over when
// leaving, and suspension. Runs on the driver thread (etcd_rendezvous.cc).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/net.h"
#include "rendezvous/coordination.h"
#include "rendezvous/etcd_rendezvous_impl.h"
#include "rendezvous/node_rules.h"
#include "rendezvous/suspend.h"

namespace efdl::rdzv::internal {
namespace {

using nlohmann::json;

// --- Horovod (docs/horovod.md): a second port offered in each ack, the rank-0 node's offer in
// the round record (coordination.cc), each node's cross layout (and, for rank 0, the member
// list) from its assign.

// A free port for the Horovod rendezvous, distinct from the master port offered with it.
uint16_t OfferHorovodPort(const std::string& advertise_addr, uint16_t master_port) {
  const std::string host = advertise_addr.empty() ? "127.0.0.1" : advertise_addr;
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto port = PickFreePort(host);
    if (!port.ok()) port = PickFreePort("0.0.0.0");
    if (port.ok() && *port != master_port) return *port;
  }
  return 0;
}

void AddHorovodPlace(const RoundRecord& round, const AssignRecord& assign, Assignment& a) {
  a.horovod_port = round.horovod_port;
  if (assign.standby) return;
  a.cross_rank = assign.cross_rank;
  a.cross_size = assign.cross_size;
  a.horovod_hosts = assign.hosts;
  a.horovod_clients = assign.host_addrs;
}

}  // namespace

Status EtcdRendezvous::Join() {
  EFDL_RETURN_IF_ERROR(ValidateId("job id", opt_.job_id));
  EFDL_RETURN_IF_ERROR(ValidateId("node id", opt_.node_id));
  if (opt_.min_nodes < 1 || opt_.max_nodes < opt_.min_nodes) {
    return Status::InvalidArgument(fmt::format(
        "--nnodes {}:{} is invalid: need 1 <= MIN <= MAX", opt_.min_nodes, opt_.max_nodes));
  }
  if (opt_.nproc < 1) return Status::InvalidArgument("--nproc-per-node must be at least 1");
  if (driver_.started()) return Status::FailedPrecondition("Join() was already called");
  unplaced_.SpreadCounts(opt_.max_nodes, UnitRandom());
  Status s = Register();
  // An etcd too slow to answer a registration in time (thousands of agents starting at once):
  // try again after a jittered back-off (node_rules.h JoinBackoff) within the join timeout,
  // instead of failing the agent or hammering etcd again at once.
  const auto join_deadline = Clock::now() + opt_.join_timeout;
  for (int attempt = 0; s.IsDeadlineExceeded() && Clock::now() < join_deadline; ++attempt) {
    const auto wait = rejoin_.Backoff(attempt, UnitRandom());
    EFDL_LOG_WARN("rdzv {}: etcd did not answer the registration in time ({}); trying again in "
                  "{} ms", opt_.node_id, s.message(), wait.count());
    std::this_thread::sleep_for(wait);
    s = Register();
  }
  if (s.code() == Status::Code::kAlreadyExists) s = WaitOutStaleRegistration(std::move(s));
  EFDL_RETURN_IF_ERROR(s);
  driver_.Start([this](std::deque<Input>& batch) { RunBatch(batch); },
                [this] { return NextDeadline(); });
  return Status::OK();
}

Status EtcdRendezvous::WaitOutStaleRegistration(Status taken) {
  // A dead holder's lease runs down with the clock; a live one's is renewed (every TTL/3), so
  // its remaining time stays above that line. Seconds granularity: allow 2 s of slack.
  const auto start = Clock::now();
  const auto deadline = start + opt_.join_timeout;
  std::optional<int64_t> first_left;
  while (Clock::now() < deadline) {
    auto kv = client_.Get(keys_.Node(opt_.node_id));
    if (!kv.ok()) return kv.status().WithContext("cannot read the node's registration");
    if (kv->has_value()) {
      auto left = client_.LeaseTimeToLive((*kv)->lease);
      if (left.ok()) {
        double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
        if (!first_left) {
          first_left = *left;
          EFDL_LOG_INFO("rdzv {}: node id '{}' is still registered in job {} ({} s left on its "
                        "lease): waiting for it to expire, in case it is a previous agent of "
                        "this node that died", opt_.node_id, opt_.node_id, opt_.job_id, *left);
        } else if (static_cast<double>(*left) > static_cast<double>(*first_left) - elapsed + 2.0) {
          return taken;   // renewed meanwhile: another live agent
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    Status s = Register();
    if (s.code() != Status::Code::kAlreadyExists) {
      if (s.ok() && first_left) {
        EFDL_LOG_INFO("rdzv {}: the previous registration expired; registered", opt_.node_id);
      }
      return s;
    }
  }
  return taken;
}

Status EtcdRendezvous::Register() {
  assign_.reset();
  RoundRecord fresh;
  fresh.round = 1;
  fresh.phase = Phase::kGathering;
  fresh.coordinator = opt_.node_id;
  fresh.message = "job started";
  const auto began = Clock::now();
  const NodeRecord me{opt_.advertise_addr, opt_.nproc, opt_.program, opt_.metrics_addr};
  auto joined = registration_.Open(me, rejoin_.Ttl(opt_.ttl), fresh);
  rejoin_.NoteJoinLatency(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began));
  if (!joined.ok()) return joined.status();
  part_.acked_round = 0;
  round_mod_rev_ = 0;
  unplaced_.Since(Clock::now());
  ApplyRound(joined->round, joined->round_revision);
  // A coordinator that is gone (crashed before anyone was around to be its deputy) is replaced
  // by whoever notices first; the CAS makes that safe.
  if (!finished_ && round_.coordinator != opt_.node_id && round_.phase != Phase::kComplete) {
    auto ck = client_.Get(keys_.Node(round_.coordinator));
    if (ck.ok() && !ck->has_value()) TakeOver();
  }
  return Status::OK();
}

void EtcdRendezvous::ApplyRound(const RoundRecord& rec, int64_t mod_rev) {
  if (mod_rev <= round_mod_rev_) return;
  const int64_t held_round = round_mod_rev_ == 0 ? 0 : round_.round;
  if (round_mod_rev_ != 0 && IsTakeOver(round_, rec)) takeover_.SawTakeOver(Clock::now());
  round_ = rec;
  round_mod_rev_ = mod_rev;
  if (rec.phase == Phase::kSuspended) {
    OnSuspended(rec);
    return;
  }
  if (rec.phase == Phase::kComplete) {
    std::string when;
    if (auto done = client_.Get(keys_.complete); done.ok() && done->has_value()) {
      auto j = json::parse((*done)->value, nullptr, false);
      if (j.is_object() && j.contains("time") && j["time"].is_string()) {
        when = " at " + j["time"].get<std::string>();
      }
    }
    Emit(MakeEvent(Event::Type::kJobComplete, rec.round, false,
                   fmt::format("every worker of the job succeeded; completed{}", when)));
    coordinator_.Stop();
    ReleaseRegistration(false);
    return;
  }
  if (ClosesStartedRound(rec, Part())) {
    if (!part_.started_standby) {
      Emit(MakeEvent(Event::Type::kRoundClosing, part_.started_round, rec.graceful, rec.message));
      if (!rec.graceful) {
        end_check_.RoundBroke(fmt::format("round {}: {}", part_.started_round, rec.message));
      }
    }
    part_.started_round = 0;
    part_.started_standby = false;
    unplaced_.Since(Clock::now());
  }
  if (ShouldAck(rec, Part())) {
    SendAck(AckState::kAck, rec.round);
  } else if (AnnouncesLate(held_round, rec, Part())) {
    EFDL_LOG_INFO("rdzv {}: a proposal was decided before this node saw it (now round {}, "
                  "{}); announcing itself to coordinator {}",
                  opt_.node_id, rec.round, PhaseName(rec.phase), rec.coordinator);
    SendAck(AckState::kAck, rec.round);
  }
  if (rec.coordinator == opt_.node_id && !coordinator_.active()) {
    coordinator_.Start();
  } else if (rec.coordinator != opt_.node_id && coordinator_.active()) {
    coordinator_.Stop();
  }
  TryStart();            // first: a member that starts now must not set up a waiter's watch
  UpdateDeputyWatch();
}

void EtcdRendezvous::TryStart() {
  if (!MayStart(round_, assign_, Part())) return;
  Event e;
  e.type = Event::Type::kRoundStarted;
  e.round = round_.round;
  e.graceful = round_.graceful;
  Assignment& a = e.assignment;
  a.round = round_.round;
  a.standby = assign_->standby;
  a.nnodes = round_.nnodes;
  a.world_size = round_.world_size;
  a.master_addr = round_.master_addr;
  a.master_port = round_.master_port;
  a.agent_store = round_.agent_store;
  if (!a.standby) {
    a.node_rank = assign_->node_rank;
    a.rank_offset = assign_->rank_offset;
    a.nproc = opt_.nproc;
  }
  AddHorovodPlace(round_, *assign_, a);
  e.message = !a.standby             ? round_.message
              : opt_.world_size > 0 ? "standby: the round's processes already add up to the "
                                      "world size"
                                    : "standby: the job is at its maximum size";
  a.early_exit = assign_->early_exit;
  if (!a.standby) a.peer_copy = assign_->peer_copy;
  part_.started_round = round_.round;
  part_.started_standby = a.standby;
  acks_.ClearOutcome();   // news of the rounds before this one is told
  unplaced_.Placed();
  Emit(std::move(e));
  UpdateDeputyWatch();   // a waiter that became a member stops following (keeps the watch)
}

void EtcdRendezvous::SendAck(AckState state, int64_t round) {
  if (registration_.lease() == 0) return;
  AckRecord ack;
  ack.round = round;
  ack.state = state;
  ack.restarts = acks_.Restarts(notes_);
  ack.no_prestart = notes_.no_prestart();
  acks_.AddOutcome(ack);
  if (state == AckState::kAck) {
    if (const uint16_t store = notes_.agent_store_port(); store != 0) {
      ack.port = store;
      ack.agent_store = true;
    } else {
      auto port = PickFreePort(opt_.advertise_addr.empty() ? "127.0.0.1" : opt_.advertise_addr);
      if (!port.ok()) port = PickFreePort("0.0.0.0");
      ack.port = port.ok() ? *port : 0;
    }
    ack.horovod_port = OfferHorovodPort(opt_.advertise_addr, ack.port);
    ack.peer_copy_port = notes_.peer_copy_port();
    part_.acked_round = round;
  }
  acks_.Sent(ack, registration_.lease());
  auto put = client_.Put(keys_.Ack(opt_.node_id), ack.Encode(), registration_.lease());
  if (!put.ok()) {
    EFDL_LOG_WARN("rdzv {}: cannot record '{}' for round {}: {}", opt_.node_id,
                  AckStateName(state), round, put.status().ToString());
  }
}

void EtcdRendezvous::NoteOutcome(int64_t round, const char* outcome, const std::string& detail,
                                 std::optional<AckState> report) {
  if (round < part_.started_round) return;   // news of a round this node already left behind
  acks_.NoteOutcome(round, outcome, detail);
  if (round >= part_.acked_round) {
    if (report) SendAck(*report, round);
    return;
  }
  // The node acked the next proposal before its agent saw its workers end (the proposal came
  // from a peer whose collective lost them): the same ack again, now with the outcome, while
  // the proposal is still open (an ack of a decided round would read as a join).
  std::optional<AckRecord> ack = acks_.LastAckOf(part_.acked_round);
  if (registration_.lease() == 0 || !ack || round_.round != part_.acked_round ||
      round_.phase != Phase::kProposed) {
    return;
  }
  acks_.AddOutcome(*ack);
  ack->restarts = acks_.Restarts(notes_);
  acks_.Sent(*ack, registration_.lease());
  auto put = client_.Put(keys_.Ack(opt_.node_id), ack->Encode(), registration_.lease());
  if (!put.ok()) {
    EFDL_LOG_WARN("rdzv {}: cannot record the outcome of round {}: {}", opt_.node_id, round,
                  put.status().ToString());
  }
}

bool EtcdRendezvous::CasRoundAt(const RoundRecord& rec, int64_t expect_mod_rev) {
  auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, expect_mod_rev)},
                         {etcd::TxnOp::Put(keys_.round, rec.Encode())});
  if (!txn.ok()) {
    EFDL_LOG_WARN("rdzv {}: cannot write the round record: {}", opt_.node_id,
                  txn.status().ToString());
    return false;
  }
  if (!txn->succeeded) return false;
  ApplyRound(rec, txn->revision);
  return true;
}

void EtcdRendezvous::RereadRound() {
  auto rd = client_.Get(keys_.round);
  if (!rd.ok() || !rd->has_value()) return;
  auto rec = RoundRecord::Decode((*rd)->value);
  if (rec.ok()) ApplyRound(*rec, (*rd)->mod_revision);
}

void EtcdRendezvous::UpdateDeputyWatch() {
  // node_rules.h WhomToFollow: deputies, and every node that runs no place of an active round
  // (after the deputies), so that a round whose coordinator and deputies all died is taken over.
  const Succession& succession = takeover_.Follow(WhomToFollow(round_, Part()));
  if (succession.follow == registration_.followed()) return;
  takeover_.Disarm();
  // A deputy reads the coordinator's key first; the others (spread) follow it from the round
  // record's revision, written while that coordinator was alive, at no request's cost: through
  // the watch kept open since they last followed it when it covers that revision (a member
  // re-rounding under the same coordinator), else a new one (node_rules.h FollowWatch).
  const int64_t after = succession.spread ? round_mod_rev_ : 0;
  if (registration_.FollowCoordinator(succession.follow, after)) {
    OnCoordinatorGone(succession.follow);
  }
}

void EtcdRendezvous::OnCoordinatorGone(const std::string& coordinator) {
  if (coordinator != registration_.followed() || round_.coordinator != coordinator ||
      takeover_.at()) {
    return;
  }
  const Succession& succession = takeover_.succession();
  auto delay = succession.after_steps * opt_.takeover_step;
  // A job whose coordinators keep vanishing (leases lost to an overloaded etcd) slows its
  // takeovers down instead of churning through coordinators (node_rules.h TakeoverBackoff).
  const auto now = Clock::now();
  const size_t recent = takeover_.Recent(now);
  if (auto extra = TakeoverBackoff(recent); extra.count() > 0) {
    EFDL_LOG_INFO("rdzv {}: {} takeovers in the last {} s: waiting {} ms more before taking "
                  "over from {}", opt_.node_id, recent,
                  std::chrono::duration_cast<std::chrono::seconds>(kTakeoverPeriod).count(),
                  extra.count(), coordinator);
    delay += extra;
  }
  if (succession.spread) {
    std::uniform_int_distribution<int64_t> extra(0, kSpreadSteps * opt_.takeover_step.count());
    delay += std::chrono::milliseconds(extra(rng_));
  }
  takeover_.Arm(now + delay);
}

void EtcdRendezvous::TakeOver() {
  auto rd = client_.Get(keys_.round);
  if (!rd.ok() || !rd->has_value()) return;
  auto rec = RoundRecord::Decode((*rd)->value);
  if (!rec.ok() || rec->phase == Phase::kComplete) return;
  if (rec->phase == Phase::kSuspended) {
    ApplyRound(*rec, (*rd)->mod_revision);
    return;
  }
  // Someone else may have taken over already; only replace a coordinator that is really gone.
  if (rec->coordinator == opt_.node_id) return;
  auto ck = client_.Get(keys_.Node(rec->coordinator));
  if (!ck.ok() || ck->has_value()) {
    ApplyRound(*rec, (*rd)->mod_revision);
    return;
  }
  const std::string gone = rec->coordinator;
  const RoundRecord next = TakeOverRecord(*rec, opt_.node_id);
  if (CasRoundAt(next, (*rd)->mod_revision)) {
    if (gone.empty()) {  // a resumed (or reset) job's round has no coordinator yet
      EFDL_LOG_INFO("rdzv {}: took over coordination of resumed job {}", opt_.node_id,
                    opt_.job_id);
    } else {
      EFDL_LOG_INFO("rdzv {}: took over coordination of job {} from {}", opt_.node_id,
                    opt_.job_id, gone);
    }
  } else {
    RereadRound();
  }
}

int64_t EtcdRendezvous::CurrentRoundForEvents() const {
  return part_.started_round != 0 ? part_.started_round : round_.round;
}

void EtcdRendezvous::Fence(const std::string& why) {
  if (finished_ || registration_.lease() == 0) return;
  int64_t round = CurrentRoundForEvents();
  EFDL_LOG_WARN("rdzv {}: fenced out of round {}: {}", opt_.node_id, round, why);
  registration_.Fence();   // first: from now on nothing of the old round is published
  Emit(MakeEvent(Event::Type::kFenced, round, false,
                 fmt::format("node {} was fenced out of round {}: {}", opt_.node_id, round, why)));
  part_.fenced_round = std::max(part_.fenced_round, FencedRound(round_, Part()));
  StopTakingPart();
  // At once while etcd is fast; spread when it is slow (a crowd fenced together by an
  // overloaded etcd must not register again all at once: node_rules.h JoinBackoff).
  rejoin_.Fenced(Clock::now(), UnitRandom());
}

void EtcdRendezvous::WithdrawFor(std::chrono::milliseconds cooldown) {
  if (finished_) return;
  const auto now = Clock::now();
  EFDL_LOG_INFO("rdzv {}: withdrawing from job {} for {} s (excluded): leaving round {}",
                opt_.node_id, opt_.job_id,
                std::chrono::duration_cast<std::chrono::seconds>(cooldown).count(),
                CurrentRoundForEvents());
  // As Leave() does, on the driver thread: out of the round first (no watch of the round any
  // more, so the hand-over below is not applied to this node), then announce the leaving, hand
  // coordination over, and revoke the lease (the node key and the ack go with it).
  StopTakingPart();
  rejoin_.Cancel();
  if (registration_.lease() != 0) {
    SendAck(AckState::kLeaving, round_.round);
    HandOverCoordination();
    registration_.Release();
  }
  events_.Clear();   // the agent hears of rounds again once the node has registered anew
  rejoin_.Withdrawn(now, cooldown);
}

void EtcdRendezvous::CheckWithdrawn(TimePoint now) {
  if (!rejoin_.WithdrawnCheckDue(now)) return;
  auto rd = client_.Get(keys_.round);
  if (!rd.ok() || !rd->has_value()) return;
  auto rec = RoundRecord::Decode((*rd)->value);
  if (rec.ok() && (rec->phase == Phase::kComplete || rec->phase == Phase::kSuspended)) {
    // Registering reads it and says so (kJobComplete; a suspended job refuses the node).
    EFDL_LOG_INFO("rdzv {}: job {} is {} while this node is excluded: registering now to "
                  "learn it", opt_.node_id, opt_.job_id, PhaseName(rec->phase));
    rejoin_.RejoinAt(now);
  }
}

void EtcdRendezvous::Fail(const std::string& message) {
  EFDL_LOG_ERROR("rdzv {}: {}", opt_.node_id, message);
  int64_t round = CurrentRoundForEvents();
  // Out of the job first, so that an agent acting on the event finds the node gone.
  ReleaseRegistration(false);
  Emit(MakeEvent(Event::Type::kFailed, round, false, message));
}

void EtcdRendezvous::ReleaseRegistration(bool announce_leaving) {
  finished_ = true;
  coordinator_.Stop();
  registration_.StopWatching();
  takeover_.Disarm();
  rejoin_.Cancel();
  unplaced_.Placed();
  if (announce_leaving && registration_.lease() != 0) {
    SendAck(AckState::kLeaving, round_.round);
    HandOverCoordination();
  }
  registration_.Release();
}

// Without this, a leaving coordinator would simply vanish: its deputy would notice the deleted
// node key and close the round as if the coordinator had crashed (workers stopped by signal,
// the steps since the last commit lost). Instead the leaver writes the next round itself, naming
// its first live deputy as coordinator and marking the change graceful, so every member stops
// its workers at a commit. Runs on the caller's thread after the driver stopped, so it writes
// with a plain CAS and does not apply the record to itself (it must not ack the new round).
void EtcdRendezvous::HandOverCoordination() {
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto rd = client_.Get(keys_.round);
    if (!rd.ok() || !rd->has_value()) return;
    auto rec = RoundRecord::Decode((*rd)->value);
    if (!rec.ok() || rec->coordinator != opt_.node_id || rec->phase == Phase::kComplete ||
        rec->phase == Phase::kSuspended) {
      return;
    }
    std::string successor;
    for (const auto& d : rec->deputies) {
      if (d == opt_.node_id) continue;
      auto ck = client_.Get(keys_.Node(d));
      if (ck.ok() && ck->has_value()) {
        successor = d;
        break;
      }
    }
    // Nobody to hand over to: a node that registers later finds the coordinator gone and
    // takes over (Register), as after a crash.
    if (successor.empty()) return;
    const RoundRecord next = HandOverRecord(*rec, opt_.node_id, successor);
    auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, (*rd)->mod_revision)},
                           {etcd::TxnOp::Put(keys_.round, next.Encode())});
    if (!txn.ok()) {
      EFDL_LOG_WARN("rdzv {}: cannot hand coordination over to {} (its deputy takes over when "
                    "this node's lease ends): {}", opt_.node_id, successor,
                    txn.status().ToString());
      return;
    }
    if (txn->succeeded) {
      EFDL_LOG_INFO("rdzv {}: leaving job {}: handed coordination over to {} (round {})",
                    opt_.node_id, opt_.job_id, successor, next.round);
      return;
    }
  }
}

void EtcdRendezvous::Leave() {
  if (!driver_.Stop()) return;   // left before
  if (!finished_) {
    ReleaseRegistration(true);
  } else if (registration_.lease() != 0) {
    ReleaseRegistration(false);  // suspended: the lease was kept until now
  }
}

Status EtcdRendezvous::ReportSuspended(const std::optional<PersistedPoint>& persisted) {
  SuspendReport report;
  report.time = WallClockTimestamp();
  if (persisted) {
    report.step = persisted->step;
    if (persisted->seq > 0) report.seq = persisted->seq;
    report.epoch = persisted->epoch;
  }
  auto put = client_.Put(keys_.Suspended(opt_.node_id), report.Encode());
  if (!put.ok()) {
    return put.status().WithContext(
        fmt::format("job {}: cannot record node {}'s suspend step", opt_.job_id, opt_.node_id));
  }
  return Status::OK();
}

void EtcdRendezvous::OnSuspended(const RoundRecord& rec) {
  if (finished_) return;
  Emit(MakeEvent(Event::Type::kSuspended, CurrentRoundForEvents(), /*graceful=*/true,
                 rec.message.empty() ? fmt::format("job {} is suspended", opt_.job_id)
                                     : rec.message));
  finished_ = true;
  StopTakingPart();
  rejoin_.Cancel();
}

void EtcdRendezvous::StopTakingPart() {
  part_.started_round = 0;
  part_.started_standby = false;
  coordinator_.Stop();
  registration_.StopWatching();
  takeover_.Disarm();
  unplaced_.Placed();
}

}  // namespace efdl::rdzv::internal
