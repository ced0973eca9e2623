// The Rendezvous over etcd: one node's side of the protocol described in protocol.h.
//
// Four rooms: Registration (registration.h: the lease, the node key and the node's watches),
// Coordinator (coordinator.h, carrying out the pure decisions of coordination.h while the
// round record names this node), the node's part of the round (etcd_rendezvous_node.cc: join,
// acks, start, fencing, succession, leaving, suspension) and, here, the driver: the inputs the
// watches queue (the NodeDriver), the timers, and the dispatch of both, on one thread. The books
// and clocks the node keeps are in node_books.h.
//
// Threading: each EtcdRendezvous owns one NodeDriver, whose thread runs the whole state machine
// and makes every etcd call. With a DriverPool (efdl sim, issue #37) the same steps run as the
// node's strand on a thread shared with other nodes, never on two threads at once. Watch and
// keep-alive callbacks only append an Input to the driver's queue (under its mutex, never held
// while calling etcd or destroying a watch), so they never block the client's shared watch
// thread. Public methods other than Join/Leave only queue inputs too.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/log.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/etcd_rendezvous_impl.h"
#include "rendezvous/node_rules.h"

namespace efdl::rdzv {
namespace internal {
// ---------------------------------------------------------------------------------------------
// Plumbing

Registration::Callbacks EtcdRendezvous::RegistrationCallbacks() {
  Registration::Callbacks cb;
  cb.watch = [this](Registration::Stream stream, uint64_t generation) -> etcd::WatchCallback {
    switch (stream) {
      case Registration::Stream::kRound:
        return WatchInto(Input::Type::kRound, generation);
      case Registration::Stream::kAssign:
        return WatchInto(Input::Type::kAssign, generation);
      case Registration::Stream::kGaveUp:
        break;
    }
    return [this](const etcd::WatchUpdate& u) {
      if (!u.error.ok() || u.compacted) return;   // only information: no resync for it
      Input in;
      in.type = Input::Type::kGaveUp;
      in.events = u.events;
      Push(std::move(in));
    };
  };
  cb.coordinator_deleted = [this](uint64_t generation, const std::string& coordinator,
                                  int64_t revision) {
    Input in;
    in.type = Input::Type::kCoordDeleted;
    in.generation = generation;
    in.detail = coordinator;
    in.revision = revision;
    Push(std::move(in));
  };
  cb.lease_lost = [this](int64_t lease) {
    Input in;
    in.type = Input::Type::kLeaseLost;
    in.lease = lease;
    Push(std::move(in));
  };
  return cb;
}

void EtcdRendezvous::RequestResync() {
  Input in;
  in.type = Input::Type::kResync;
  in.generation = registration_.generation();
  Push(std::move(in));
}

void EtcdRendezvous::Push(Input in) { driver_.Push(std::move(in)); }

void NodeDriver::Start(Step step, Deadline deadline) {
  step_ = std::move(step);
  deadline_ = std::move(deadline);
  if (pool_ != nullptr) {
    strand_ = pool_->NewStrand([this] { return PoolStep(); });
    {
      MutexLock lock(mu_);
      driving_ = true;
    }
    pool_->Wake(strand_);   // as the thread's first pass: Join may have left work to do
  } else {
    thread_ = std::thread([this] { Loop(); });
  }
}

void NodeDriver::Push(Input in) {
  bool wake_strand = false;
  {
    MutexLock lock(mu_);
    if (stop_) return;
    inputs_.push_back(std::move(in));
    wake_strand = pool_ != nullptr && driving_;
  }
  if (wake_strand) {
    pool_->Wake(strand_);
  } else {
    cv_.notify_one();
  }
}

bool NodeDriver::Stop() {
  {
    MutexLock lock(mu_);
    if (stop_) return false;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (strand_) pool_->Close(strand_);
  return true;
}

void EtcdRendezvous::Emit(Event e) {
  EFDL_LOG_DEBUG("rdzv {}: event {} round {} {}", opt_.node_id, static_cast<int>(e.type), e.round,
                 e.message);
  events_.Push(std::move(e));
  if (opt_.on_event) opt_.on_event();
}

std::optional<Event> EtcdRendezvous::WaitEvent(std::chrono::milliseconds timeout) {
  return events_.Wait(timeout);
}

etcd::WatchCallback EtcdRendezvous::WatchInto(Input::Type type, uint64_t generation) {
  return [this, type, generation](const etcd::WatchUpdate& u) {
    Input in;
    in.generation = generation;
    if (!u.error.ok() || u.compacted) {
      EFDL_LOG_WARN("rdzv {}: watch interrupted ({}); re-reading", opt_.node_id,
                    u.compacted ? "compacted" : u.error.ToString());
      in.type = Input::Type::kResync;
      in.coordinator_watch = type == Input::Type::kNodes || type == Input::Type::kAcks;
    } else {
      in.type = type;
      in.events = u.events;
    }
    Push(std::move(in));
  };
}

void EtcdRendezvous::PushOutcome(Input::Type type, int64_t round, std::string detail,
                                 bool lost_peer) {
  Input in;
  in.type = type;
  in.round = round;
  in.detail = std::move(detail);
  in.lost_peer = lost_peer;
  Push(std::move(in));
}

void EtcdRendezvous::ReportWorkerFailure(int64_t round, const std::string& detail) {
  PushOutcome(Input::Type::kWorkerFailure, round, detail);
}

void EtcdRendezvous::ReportLostPeer(int64_t round, const std::string& detail,
                                    const std::string& cause) {
  PushOutcome(Input::Type::kWorkerFailure, round,
              cause.empty() ? detail : fmt::format("{}: {}", detail, cause), /*lost_peer=*/true);
}

void EtcdRendezvous::Withdraw(std::chrono::milliseconds cooldown) {
  Input in;
  in.type = Input::Type::kWithdraw;
  in.delay = cooldown;
  Push(std::move(in));
}

void EtcdRendezvous::ReportRestarts(int restarts) {
  notes_.SetRestarts(restarts);
  Input in;
  in.type = Input::Type::kRestarts;
  Push(std::move(in));
}

void EtcdRendezvous::ReportWorkersExited0(int64_t round, const std::string& ranks) {
  PushOutcome(Input::Type::kWorkersSucceeded, round, ranks);
}

void EtcdRendezvous::NoteWorkersReturned(int64_t round, const std::string& ranks) {
  PushOutcome(Input::Type::kWorkersReturned, round, ranks);
}

void NodeDriver::Loop() {
  MutexLock lock(mu_);
  bool first = true;   // Join may have made us coordinator of a job that needs no more input
  while (!stop_) {
    auto deadline = deadline_();
    if (inputs_.empty() && !std::exchange(first, false)) {
      if (deadline) {
        cv_.wait_until(lock, *deadline);
      } else {
        cv_.wait(lock);
      }
    }
    if (stop_) break;
    std::deque<Input> batch;
    batch.swap(inputs_);
    lock.unlock();
    step_(batch);
    lock.lock();
  }
}

std::optional<TimePoint> NodeDriver::PoolStep() {
  std::deque<Input> batch;
  {
    MutexLock lock(mu_);
    if (stop_) return std::nullopt;
    batch.swap(inputs_);
  }
  step_(batch);
  return deadline_();
}

void EtcdRendezvous::RunBatch(std::deque<Input>& batch) {
  for (auto& in : batch) {
    if (!finished_) Handle(in);
  }
  if (!finished_) {
    OnTimers();
    coordinator_.Step(Clock::now());
  }
}

std::optional<TimePoint> EtcdRendezvous::NextDeadline() const {
  std::optional<TimePoint> d;
  auto take = [&](std::optional<TimePoint> t) {
    if (t && (!d || *t < *d)) d = t;
  };
  if (finished_) return d;
  take(takeover_.at());
  take(rejoin_.NextDeadline());
  if (const auto& since = unplaced_.since()) {
    take(*since + opt_.join_timeout);
    take(unplaced_.NextNotice());
    if (round_.phase == Phase::kGathering && LogEnabled(LogLevel::kInfo)) {
      take(unplaced_.NextCount());
    }
    take(end_check_.NextCheck());
  }
  take(coordinator_.NextDeadline());
  return d;
}

void EtcdRendezvous::OnTimers() {
  auto now = Clock::now();
  // The notice is an info line: at a higher level nobody reads it, and it counts nothing.
  const bool notices = LogEnabled(LogLevel::kInfo);
  if (notices && round_.phase == Phase::kGathering && unplaced_.CountDue(now)) {
    CountRegistered(now);
  } else if (round_.phase != Phase::kGathering) {
    unplaced_.NotCounting(now);
  }
  if (unplaced_.NoticeDue(now) && notices) WaitNotice(now);
  if (!unplaced_.since()) {
    end_check_.NotChecking(now);
  } else if (end_check_.Due(now)) {
    CheckEveryNodeFailed();
    if (finished_) return;
  }
  if (takeover_.Due(now)) TakeOver();
  if (rejoin_.withdrawn()) CheckWithdrawn(now);
  if (rejoin_.Due(now)) {
    Status s = Register();
    if (s.ok()) {
      if (rejoin_.Rejoined()) {
        // The cool-down is over: `efdl status` no longer shows the node as excluded.
        if (auto del = client_.Delete(keys_.Excluded(opt_.node_id)); !del.ok()) {
          EFDL_LOG_WARN("rdzv {}: cannot remove this node's exclusion record: {}", opt_.node_id,
                        del.status().message());
        }
        EFDL_LOG_INFO("rdzv {}: cool-down over: registered in job {} again as a new member",
                      opt_.node_id, opt_.job_id);
      } else {
        EFDL_LOG_INFO("rdzv {}: rejoined job {} as a new member", opt_.node_id, opt_.job_id);
      }
    } else if (s.IsFailedPrecondition()) {
      Fail(s.message());  // the job was suspended meanwhile: retrying cannot help
      return;
    } else if (rejoin_.OutOfTime(now, opt_.join_timeout)) {
      Fail(fmt::format("node {} lost its lease and could not rejoin job {} within the join "
                       "timeout: {}",
                       opt_.node_id, opt_.job_id, s.message()));
      return;
    } else {
      rejoin_.Retry(now, UnitRandom());
    }
  }
  const std::optional<TimePoint> unplaced_since = unplaced_.since();
  if (unplaced_since && now - *unplaced_since >= opt_.join_timeout && opt_.world_size > 0) {
    Fail(fmt::format(
        "job {}: no round with this node formed within the join timeout of {} s (the registered "
        "nodes' --nproc-per-node never added up to --world-size {}); start nodes that make it "
        "add up",
        opt_.job_id, std::chrono::duration_cast<std::chrono::seconds>(opt_.join_timeout).count(),
        opt_.world_size));
  } else if (unplaced_since && now - *unplaced_since >= opt_.join_timeout) {
    Fail(fmt::format(
        "job {}: no round with this node formed within the join timeout of {} s (fewer than "
        "--nnodes MIN={} nodes were available); start more nodes or lower MIN",
        opt_.job_id, std::chrono::duration_cast<std::chrono::seconds>(opt_.join_timeout).count(),
        opt_.min_nodes));
  }
}

void EtcdRendezvous::CountRegistered(TimePoint now) {
  auto count = client_.Range(keys_.nodes, {.prefix = true, .count_only = true});
  if (count.ok()) {
    unplaced_.Counted(now, count->count);
  } else {
    unplaced_.CountFailed(now, std::string(count.status().message()));
  }
}

void EtcdRendezvous::WaitNotice(TimePoint now) {
  using std::chrono::duration_cast;
  using std::chrono::seconds;
  const int64_t left =
      duration_cast<seconds>(*unplaced_.since() + opt_.join_timeout - now).count();
  if (round_.phase == Phase::kGathering && unplaced_.count_error()) {
    EFDL_LOG_INFO("rdzv {}: waiting for a round of job {} (etcd not answering: {}); giving up "
                  "in {} s",
                  opt_.node_id, opt_.job_id, *unplaced_.count_error(), left);
    return;
  }
  if (round_.phase == Phase::kGathering && unplaced_.last_count()) {
    const int64_t n = unplaced_.last_count()->nodes;
    const int64_t age = duration_cast<seconds>(now - unplaced_.last_count()->at).count();
    const std::string as_of = age > 0 ? fmt::format(" as of {} s ago", age) : "";
    if (opt_.world_size > 0) {
      EFDL_LOG_INFO("rdzv {}: waiting for nodes whose processes add up to --world-size {}: {} "
                    "node(s) registered{}; giving up in {} s",
                    opt_.node_id, opt_.world_size, n, as_of, left);
    } else if (n < opt_.min_nodes) {
      EFDL_LOG_INFO("rdzv {}: waiting for {} more node(s): {} of at least {} registered{}; "
                    "giving up in {} s",
                    opt_.node_id, opt_.min_nodes - n, n, opt_.min_nodes, as_of, left);
    } else {
      EFDL_LOG_INFO("rdzv {}: waiting for round {} to form ({}): {} nodes registered{}; giving "
                    "up in {} s",
                    opt_.node_id, round_.round, PhaseName(round_.phase), n, as_of, left);
    }
    return;
  }
  // Otherwise what the node holds says what it waits for.
  const int64_t waited = duration_cast<seconds>(now - *unplaced_.since()).count();
  const std::string coordinator =
      round_.coordinator.empty() ? std::string("none yet") : round_.coordinator;
  std::string what;
  switch (round_.phase) {
    case Phase::kGathering:
      what = fmt::format(
          "waiting for round {} to gather (coordinator {} waits for {})", round_.round,
          coordinator,
          opt_.world_size > 0
              ? fmt::format("nodes whose processes add up to --world-size {}", opt_.world_size)
              : fmt::format("at least {} node(s), then up to {} or the last call",
                            opt_.min_nodes, opt_.max_nodes));
      break;
    case Phase::kProposed:
      what = fmt::format(
          "waiting for round {} to form (proposed; coordinator {} waits for the nodes' acks, {})",
          round_.round, coordinator,
          part_.acked_round >= round_.round ? "this node's came" : "this node has not acked");
      break;
    case Phase::kActive:
      what = fmt::format(
          "waiting for a place: round {} is active without this node (coordinator {} takes it "
          "into the next round, or as a standby at MAX)",
          round_.round, coordinator);
      break;
    default:
      what = fmt::format("waiting for round {} to form ({}; coordinator {})", round_.round,
                         PhaseName(round_.phase), coordinator);
      break;
  }
  EFDL_LOG_INFO("rdzv {}: {}; waited {} s; giving up in {} s", opt_.node_id, what, waited, left);
}

void EtcdRendezvous::CheckEveryNodeFailed() {
  auto count = client_.Range(keys_.nodes, {.prefix = true, .count_only = true});
  if (!count.ok()) return;
  end_check_.Counted(count->count);   // O(N) in etcd: the next one waits CountGap (node_books.h)
  if (count->count >= opt_.min_nodes) return;
  Fail(fmt::format(
      "job {} cannot go on: {}; {}, and {} of at least {} nodes remain. Fix the program, then "
      "start the job again",
      opt_.job_id, *end_check_.peer_gave_up(), *end_check_.OwnBreak(), count->count,
      opt_.min_nodes));
}

Status EtcdRendezvous::RecordGiveUp(const std::string& reason,
                                    const std::vector<std::string>& stderr_tail) {
  GaveUpRecord rec{reason, WallClockTimestamp(), stderr_tail};
  auto put = client_.Put(keys_.GaveUp(opt_.node_id), rec.Encode());
  if (!put.ok()) return put.status().WithContext("cannot record in etcd why this node gave up");
  return Status::OK();
}

Status EtcdRendezvous::RecordExclusion(const ExclusionRecord& record) {
  auto put = client_.Put(keys_.Excluded(opt_.node_id), record.Encode());
  if (!put.ok()) return put.status().WithContext("cannot record this node's exclusion in etcd");
  return Status::OK();
}

Status EtcdRendezvous::RecordLedger(const LedgerPart& part) {
  auto put = client_.Put(LedgerPartKey(opt_.job_id, opt_.node_id, part.round), part.Encode());
  if (!put.ok()) return put.status().WithContext("cannot write this node's ledger part");
  // Bounded: this node's parts of rounds more than kKeepRounds before this one go.
  if (part.round <= kKeepRounds) return Status::OK();
  const std::string mine = LedgerPrefix(opt_.job_id) + opt_.node_id + "/";
  const std::string oldest_kept = LedgerPartKey(opt_.job_id, opt_.node_id,
                                                part.round - kKeepRounds);
  auto keys = client_.Range(mine, {.prefix = true, .keys_only = true});
  if (!keys.ok()) return Status::OK();   // pruned at a later round
  for (const auto& kv : keys->kvs) {
    if (kv.key < oldest_kept && !kv.key.ends_with("/end")) (void)client_.Delete(kv.key);
  }
  return Status::OK();
}

Result<LedgerReport> EtcdRendezvous::ReadLedgerReport() {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  return ReadLedger(client_, opt_.job_id, now);
}

void EtcdRendezvous::PublishCompute(const ComputeRecord& record) {
  Input in;
  in.type = Input::Type::kPublishCompute;
  in.detail = record.Encode();
  Push(std::move(in));
}

Result<std::map<std::string, ComputeRecord>> EtcdRendezvous::ReadCompute() {
  auto range = client_.Range(keys_.compute, {.prefix = true});
  if (!range.ok()) return range.status().WithContext("cannot read the nodes' compute summaries");
  std::map<std::string, ComputeRecord> out;
  for (const auto& kv : range->kvs) {
    auto rec = ComputeRecord::Decode(kv.value);
    if (rec.ok()) out[kv.key.substr(keys_.compute.size())] = *rec;
  }
  return out;
}

Status EtcdRendezvous::RecordStragglers(const StragglerRecord& record) {
  auto put = client_.Put(keys_.stragglers, record.Encode());
  if (!put.ok()) return put.status().WithContext("cannot record the round's stragglers");
  return Status::OK();
}

Result<std::optional<StragglerRecord>> EtcdRendezvous::ReadStragglers() {
  auto get = client_.Get(keys_.stragglers);
  if (!get.ok()) return get.status().WithContext("cannot read the round's stragglers");
  if (!*get) return std::optional<StragglerRecord>{};
  auto rec = StragglerRecord::Decode((*get)->value);
  if (!rec.ok()) return rec.status();
  return std::optional<StragglerRecord>{*rec};
}

Status EtcdRendezvous::RecordLedgerEnd(const LedgerEnd& end) {
  auto put = client_.Put(LedgerEndKey(opt_.job_id, opt_.node_id), end.Encode());
  if (!put.ok()) return put.status().WithContext("cannot write this node's ledger end");
  return Status::OK();
}

void EtcdRendezvous::Handle(Input& in) {
  // Watch inputs from an older registration (before a fence or resync) are stale.
  if (in.type == Input::Type::kResync && in.coordinator_watch) {
    // A coordinator watch broke: re-read the job and watch again from the read's revision.
    if (coordinator_.active() && in.generation == coordinator_.generation()) {
      coordinator_.Stop();
      coordinator_.Start();
    }
    return;
  }
  bool watch_input = in.type == Input::Type::kRound || in.type == Input::Type::kAssign ||
                     in.type == Input::Type::kCoordDeleted || in.type == Input::Type::kResync;
  if (watch_input && in.generation != registration_.generation()) return;
  switch (in.type) {
    case Input::Type::kRound:
      for (const auto& e : in.events) {
        if (e.type == etcd::WatchEvent::Type::kDelete) continue;  // only a cleanup deletes it
        auto rec = RoundRecord::Decode(e.kv.value);
        if (!rec.ok()) {
          EFDL_LOG_WARN("rdzv {}: ignoring a bad round record: {}", opt_.node_id,
                        rec.status().ToString());
          continue;
        }
        ApplyRound(*rec, e.kv.mod_revision);
      }
      break;
    case Input::Type::kAssign:
      for (const auto& e : in.events) {
        if (e.type == etcd::WatchEvent::Type::kDelete) continue;
        auto rec = AssignRecord::Decode(e.kv.value);
        if (!rec.ok()) {
          EFDL_LOG_WARN("rdzv {}: ignoring a bad assignment record: {}", opt_.node_id,
                        rec.status().ToString());
          continue;
        }
        if (!assign_ || rec->round >= assign_->round) assign_ = *rec;
      }
      TryStart();
      break;
    case Input::Type::kNodes:
      if (coordinator_.active() && in.generation == coordinator_.generation()) {
        coordinator_.OnNodesEvents(in.events);
      }
      break;
    case Input::Type::kAcks:
      if (coordinator_.active() && in.generation == coordinator_.generation()) {
        coordinator_.OnAckEvents(in.events);
      }
      break;
    case Input::Type::kCoordDeleted:
      if (registration_.CoordinatorDeleted(in.detail, in.revision)) OnCoordinatorGone(in.detail);
      break;
    case Input::Type::kLeaseLost:
      if (in.lease == registration_.lease()) {
        // Registered again with a longer TTL: a lease that expired because its renewals did not
        // get through in time (node_rules.h TtlAfterExpiries) must not expire again and again.
        rejoin_.LeaseExpired();
        Fence(fmt::format("its lease expired or was revoked; it registers again with a TTL of "
                          "{} s", rejoin_.Ttl(opt_.ttl).count() / 1000.0));
      }
      break;
    case Input::Type::kGaveUp:
      for (const auto& e : in.events) {
        if (e.type == etcd::WatchEvent::Type::kDelete) continue;
        const std::string id = e.kv.key.substr(keys_.gaveup.size());
        if (id == opt_.node_id) continue;
        auto rec = GaveUpRecord::Decode(e.kv.value);
        std::string why = rec.ok() ? rec->reason : "(unreadable record)";
        if (rec.ok() && !rec->stderr_tail.empty()) {
          why += fmt::format("; its last stderr line: {}", rec->stderr_tail.back());
        }
        end_check_.PeerGaveUp(fmt::format("node {} gave up: {}", id, why));
        Emit(MakeEvent(Event::Type::kPeerGaveUp, CurrentRoundForEvents(), false,
                       *end_check_.peer_gave_up()));
      }
      // The job's size as far as this node knows it (the last formed round, or MIN) spreads the
      // nodes' first checks (node_books.h JobEndCheck).
      end_check_.CheckFrom(Clock::now(), std::max(round_.nnodes, opt_.min_nodes), UnitRandom());
      break;
    case Input::Type::kWorkerFailure: {
      end_check_.WorkersFailed(in.detail);
      acks_.CountFailure();
      // The ack key holds one record: a report about a round older than the one already
      // acked must not overwrite that ack (the coordinator would leave this node out).
      NoteOutcome(in.round, in.lost_peer ? kOutcomeLost : kOutcomeFailed, in.detail,
                  AckState::kFailed);
      if (in.round < part_.acked_round) break;
      if (round_.round == in.round && round_.phase == Phase::kActive) {
        const RoundRecord next = FailureProposal(round_, opt_.node_id, in.detail, in.lost_peer);
        if (!CasRoundAt(next, round_mod_rev_)) RereadRound();
      }
      break;
    }
    case Input::Type::kWorkersSucceeded:
      end_check_.WorkersSucceeded();
      NoteOutcome(in.round, kOutcomeDone, in.detail, AckState::kDone);
      break;
    case Input::Type::kWorkersReturned:
      // The outcome only (no "done" ack: the job completes on the exits).
      NoteOutcome(in.round, kOutcomeDone, in.detail, std::nullopt);
      break;
    case Input::Type::kResync:
      Resync();
      break;
    case Input::Type::kWithdraw:
      WithdrawFor(in.delay);
      break;
    case Input::Type::kRestarts: {
      const std::optional<int> counted = notes_.restarts();
      const std::optional<AckRecord> again =
          acks_.WithRestarts(registration_.lease(), counted.value_or(-1));
      if (!again) break;
      if (auto put = client_.Put(keys_.Ack(opt_.node_id), again->Encode(), registration_.lease());
          !put.ok()) {
        EFDL_LOG_DEBUG("rdzv {}: restart count not written: {}", opt_.node_id,
                       put.status().message());
      }
      break;
    }
    case Input::Type::kPublishCompute:
      // Under the lease, so a node that is gone leaves no summary behind; none while it holds
      // no lease (withdrawn, fenced).
      if (registration_.lease() != 0) {
        if (auto put = client_.Put(keys_.Compute(opt_.node_id), in.detail, registration_.lease());
            !put.ok()) {
          EFDL_LOG_DEBUG("rdzv {}: compute summary not written: {}", opt_.node_id,
                         put.status().message());
        }
      }
      break;
  }
}

void EtcdRendezvous::Resync() {
  EFDL_LOG_INFO("rdzv {}: resynchronising with etcd", opt_.node_id);
  coordinator_.Stop();
  auto reread = registration_.Rewatch();
  if (!reread.ok()) {
    Fence(reread.status().message());
    return;
  }
  if (reread->assign) {
    auto a = AssignRecord::Decode(reread->assign->value);
    if (a.ok()) assign_ = *a;
  }
  if (reread->round) {
    auto r = RoundRecord::Decode(reread->round->value);
    round_mod_rev_ = 0;
    if (r.ok()) ApplyRound(*r, reread->round->mod_revision);
  }
}
}  // namespace internal

std::unique_ptr<Rendezvous> NewEtcdRendezvous(etcd::Client& client, RendezvousOptions options,
                                              DriverPool* pool) {
  return std::make_unique<internal::EtcdRendezvous>(client, std::move(options), pool);
}

}  // namespace efdl::rdzv
