// The Rendezvous over etcd: one node's side of the protocol described in protocol.h.
//
// Threading: each EtcdRendezvous owns one driver thread that runs the whole state machine and
// makes every etcd call. Watch and keep-alive callbacks only append an Input to a queue (under
// in_mu_, which is never held while calling etcd or destroying a watch), so they never block
// the client's shared watch thread. Public methods other than Join/Leave only queue inputs too.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/net.h"
#include "common/thread_annotations.h"
#include "rendezvous/protocol.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/rendezvous.h"
#include "rendezvous/suspend.h"

namespace efdl::rdzv {
namespace {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using nlohmann::json;

constexpr size_t kAssignBatch = 127;   // puts per txn, under etcd's default --max-txn-ops 128
constexpr size_t kMaxDeputies = 3;
constexpr size_t kMaxStatusEvents = 32;
// While a node waits for a round, how often it says what it waits for (issue #22).
constexpr std::chrono::seconds kWaitNoticeInterval{15};

struct Input {
  enum class Type {
    kRound, kAssign, kNodes, kAcks, kCoordGone, kLeaseLost, kWorkerFailure, kWorkersSucceeded,
    kResync, kGaveUp
  };
  Type type = Type::kRound;
  uint64_t generation = 0;              // watch inputs: the registration/watch set they belong to
  std::vector<etcd::WatchEvent> events;
  int64_t round = 0;
  int64_t lease = 0;
  std::string detail;
  bool coordinator_watch = false;       // kResync from a coordinator watch (nodes/ or ack/)
};

Event MakeEvent(Event::Type type, int64_t round, bool graceful, std::string message) {
  Event e;
  e.type = type;
  e.round = round;
  e.graceful = graceful;
  e.message = std::move(message);
  return e;
}

struct MemberInfo {
  int64_t create_revision = 0;
  NodeRecord record;
};

// --- Horovod (docs/horovod.md): a second port offered in each ack, the rank-0 node's offer in
// the round record, each node's cross layout (and, for rank 0, the member list) from its assign.

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

// The Horovod port `id` offered with its ack of `round` (0: none).
uint16_t OfferedHorovodPort(const std::map<std::string, AckRecord>& acks, const std::string& id,
                            int64_t round) {
  auto it = acks.find(id);
  return it != acks.end() && it->second.round == round ? it->second.horovod_port : 0;
}

void AddHorovodPlace(const RoundRecord& round, const AssignRecord& assign, Assignment& a) {
  a.horovod_port = round.horovod_port;
  if (assign.standby) return;
  a.cross_rank = assign.cross_rank;
  a.cross_size = assign.cross_size;
  a.horovod_hosts = assign.hosts;
  a.horovod_clients = assign.host_addrs;
}

class EtcdRendezvous final : public Rendezvous {
 public:
  EtcdRendezvous(etcd::Client& client, RendezvousOptions options)
      : client_(client), opt_(std::move(options)), keys_(opt_.job_id) {}
  ~EtcdRendezvous() override { Leave(); }

  Status Join() override;
  std::optional<Event> WaitEvent(std::chrono::milliseconds timeout) override;
  void ReportWorkerFailure(int64_t round, const std::string& detail) override;
  void ReportWorkersSucceeded(int64_t round) override;
  void Leave() override;
  Status ReportSuspended(const std::optional<PersistedPoint>& persisted) override;
  Status RecordGiveUp(const std::string& reason,
                      const std::vector<std::string>& stderr_tail) override;
  Status CheckSameProgram();   // Join: refuses a program other than the registered nodes'
  bool MayPublish(double committed_at) const override;
  void SetKeeper(std::unique_ptr<etcd::LeaseKeeper> keeper, bool fenced);

 private:
  // --- plumbing ---
  void Push(Input in);
  void Emit(Event e);
  void DriverLoop();
  void Handle(Input& in);
  std::optional<TimePoint> NextDeadline() const;
  void OnTimers();
  // While this node waits for a round: a line every kWaitNoticeInterval saying for what.
  void WaitNotice(TimePoint now);
  // A peer gave up and this node's own workers failed too: end the job here as well when fewer
  // than MIN nodes remain (no round can form), instead of waiting out the join timeout.
  void CheckEveryNodeFailed(TimePoint now);
  etcd::WatchCallback WatchInto(Input::Type type, uint64_t generation);

  // --- node side ---
  Status Register();                    // lease, node key, round key, watches
  // Join() found the node id taken: waits (up to the join timeout) while the holder's lease is
  // not being renewed — the registration of a previous agent of this node that died — and
  // registers once it expired; returns `taken` as soon as the lease is seen renewed (a live
  // agent uses the id).
  Status WaitOutStaleRegistration(Status taken);
  void ApplyRound(const RoundRecord& rec, int64_t mod_rev);
  void TryStart();
  void SendAck(AckState state, int64_t round);
  bool CasRound(const RoundRecord& rec, int64_t expect_mod_rev);   // true when we won
  void RereadRound();
  void UpdateDeputyWatch();
  void TakeOver();
  void Fence(const std::string& why);
  void Fail(const std::string& message);
  void ReleaseRegistration(bool announce_leaving);
  // A coordinator that leaves names its successor and proposes the next round itself (graceful).
  void HandOverCoordination();
  int64_t CurrentRoundForEvents() const;
  // P round says suspended: emit kSuspended once and stop all protocol work; the lease stays
  // until the agent's Leave(), so `efdl suspend` sees the node until its workers are down.
  void OnSuspended(const RoundRecord& rec);
  // Out of every round (fenced, suspended): no started round, no coordination, no watch of the
  // round, the assignment or the coordinator; the lease is the caller's business.
  void StopTakingPart();

  // --- coordinator side ---
  void BecomeCoordinator();
  void StopCoordinating();
  void OnNodesEvents(const std::vector<etcd::WatchEvent>& events);
  void OnAckEvents(const std::vector<etcd::WatchEvent>& events);
  void CoordinatorStep();
  void Propose(bool graceful, std::string why);
  void Finalize();
  void CompleteJob();
  void AssignStandby(const std::string& id);
  // Whether a node that turns up during an active round gets a re-round (else it is a standby).
  bool RoomForNewMember() const;
  std::vector<Candidate> Registered(bool acked_only) const;
  std::vector<std::string> PickDeputies(const std::vector<std::string>& preferred) const;
  void Record(const std::string& message);
  void WriteStatus();
  bool IsCoordinator() const { return coordinating_; }

  etcd::Client& client_;
  const RendezvousOptions opt_;
  const JobKeys keys_;

  Mutex in_mu_;
  std::condition_variable_any in_cv_;
  std::deque<Input> inputs_ EFDL_GUARDED_BY(in_mu_);
  bool stop_ EFDL_GUARDED_BY(in_mu_) = false;
  bool left_ EFDL_GUARDED_BY(in_mu_) = false;

  Mutex ev_mu_;
  std::condition_variable_any ev_cv_;
  std::deque<Event> events_ EFDL_GUARDED_BY(ev_mu_);

  std::thread driver_;

  // Everything below is owned by the driver thread (and by Join before the thread starts, and
  // by Leave after it stopped).
  uint64_t generation_ = 0;             // bumped at each (re)registration and resync
  int64_t lease_ = 0;
  mutable Mutex keeper_mu_;   // MayPublish reads these from the persister's thread
  std::unique_ptr<etcd::LeaseKeeper> keeper_ EFDL_GUARDED_BY(keeper_mu_);
  bool fenced_ EFDL_GUARDED_BY(keeper_mu_) = false;   // the lease was lost; until re-registered
  double fenced_at_wall_ EFDL_GUARDED_BY(keeper_mu_) = 0;   // when last fenced (epoch s)
  std::unique_ptr<etcd::Watch> round_watch_, assign_watch_, deputy_watch_;
  // gaveup/ of the job from the first registration on; lives as long as the rendezvous.
  std::unique_ptr<etcd::Watch> gaveup_watch_;
  std::optional<std::string> peer_gave_up_;     // "node X gave up: why", the newest
  std::optional<std::string> own_failure_;      // this node's last worker failure, until a success
  TimePoint last_wait_notice_{};
  TimePoint next_failed_check_{};
  std::string deputy_target_;
  std::optional<TimePoint> takeover_at_;
  RoundRecord round_;
  int64_t round_mod_rev_ = 0;
  std::optional<AssignRecord> assign_;
  int64_t acked_round_ = 0;
  int64_t started_round_ = 0;
  bool started_standby_ = false;
  int64_t fenced_round_ = 0;
  int restarts_ = 0;
  bool finished_ = false;               // complete, failed or left: no more protocol work
  std::optional<TimePoint> unplaced_since_;
  std::optional<TimePoint> rejoin_at_;
  std::optional<TimePoint> fenced_since_;

  // Coordinator state.
  bool coordinating_ = false;
  uint64_t coord_generation_ = 0;
  std::unique_ptr<etcd::Watch> nodes_watch_, acks_watch_;
  std::map<std::string, MemberInfo> registered_;
  std::map<std::string, AckRecord> acks_;
  std::map<std::string, int> prev_rank_;       // members of the last formed round
  std::set<std::string> members_, standbys_, leaving_, unresponsive_, assign_keys_;
  std::optional<TimePoint> min_reached_at_;
  // Nodes that acked the proposal of round `first` (a cheap count for the proposed phase).
  std::pair<int64_t, std::set<std::string>> acked_round_ids_;
  TimePoint last_progress_{};
  // The liveness window in use: doubled (up to 8x the configured one) each time a node that
  // was left out for a late ack announces itself again, so a slow machine or etcd does not
  // cascade into round after round.
  std::chrono::milliseconds window_{0};
  bool reround_ = false;
  bool reround_graceful_ = true;
  std::string reround_why_;
  std::deque<json> history_;
};

// ---------------------------------------------------------------------------------------------
// Plumbing

void EtcdRendezvous::Push(Input in) {
  {
    MutexLock lock(in_mu_);
    if (stop_) return;
    inputs_.push_back(std::move(in));
  }
  in_cv_.notify_one();
}

void EtcdRendezvous::Emit(Event e) {
  EFDL_LOG_DEBUG("rdzv {}: event {} round {} {}", opt_.node_id, static_cast<int>(e.type), e.round,
                 e.message);
  {
    MutexLock lock(ev_mu_);
    events_.push_back(std::move(e));
  }
  ev_cv_.notify_all();
  if (opt_.on_event) opt_.on_event();
}

std::optional<Event> EtcdRendezvous::WaitEvent(std::chrono::milliseconds timeout) {
  MutexLock lock(ev_mu_);
  if (!ev_cv_.wait_for(lock, timeout, [&]() EFDL_REQUIRES(ev_mu_) { return !events_.empty(); })) {
    return std::nullopt;
  }
  Event e = std::move(events_.front());
  events_.pop_front();
  return e;
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

void EtcdRendezvous::ReportWorkerFailure(int64_t round, const std::string& detail) {
  Input in;
  in.type = Input::Type::kWorkerFailure;
  in.round = round;
  in.detail = detail;
  Push(std::move(in));
}

void EtcdRendezvous::ReportWorkersSucceeded(int64_t round) {
  Input in;
  in.type = Input::Type::kWorkersSucceeded;
  in.round = round;
  Push(std::move(in));
}

void EtcdRendezvous::DriverLoop() {
  MutexLock lock(in_mu_);
  bool first = true;   // Join may have made us coordinator of a job that needs no more input
  while (!stop_) {
    auto deadline = NextDeadline();
    if (inputs_.empty() && !std::exchange(first, false)) {
      if (deadline) {
        in_cv_.wait_until(lock, *deadline);
      } else {
        in_cv_.wait(lock);
      }
    }
    if (stop_) break;
    std::deque<Input> batch;
    batch.swap(inputs_);
    lock.unlock();
    for (auto& in : batch) {
      if (!finished_) Handle(in);
    }
    if (!finished_) {
      OnTimers();
      if (IsCoordinator()) CoordinatorStep();
    }
    lock.lock();
  }
}

std::optional<TimePoint> EtcdRendezvous::NextDeadline() const {
  std::optional<TimePoint> d;
  auto take = [&](std::optional<TimePoint> t) {
    if (t && (!d || *t < *d)) d = t;
  };
  if (finished_) return d;
  take(takeover_at_);
  take(rejoin_at_);
  if (unplaced_since_) {
    take(*unplaced_since_ + opt_.join_timeout);
    take(std::max(*unplaced_since_, last_wait_notice_) + kWaitNoticeInterval);
    if (peer_gave_up_ && own_failure_) take(next_failed_check_);
  }
  if (coordinating_) {
    if (round_.phase == Phase::kGathering && min_reached_at_) take(*min_reached_at_ + opt_.last_call);
    if (round_.phase == Phase::kProposed) take(last_progress_ + window_);
  }
  return d;
}

void EtcdRendezvous::OnTimers() {
  auto now = Clock::now();
  if (unplaced_since_ && now >= std::max(*unplaced_since_, last_wait_notice_) +
                                    kWaitNoticeInterval) {
    last_wait_notice_ = now;
    WaitNotice(now);
  }
  if (unplaced_since_ && peer_gave_up_ && own_failure_ && now >= next_failed_check_) {
    next_failed_check_ = now + std::chrono::seconds(1);
    CheckEveryNodeFailed(now);
    if (finished_) return;
  }
  if (takeover_at_ && now >= *takeover_at_) {
    takeover_at_.reset();
    TakeOver();
  }
  if (rejoin_at_ && now >= *rejoin_at_) {
    rejoin_at_.reset();
    Status s = Register();
    if (s.ok()) {
      fenced_since_.reset();
      EFDL_LOG_INFO("rdzv {}: rejoined job {} as a new member", opt_.node_id, opt_.job_id);
    } else if (s.IsFailedPrecondition()) {
      Fail(s.message());  // the job was suspended meanwhile: retrying cannot help
      return;
    } else if (fenced_since_ && now - *fenced_since_ >= opt_.join_timeout) {
      Fail(fmt::format("node {} lost its lease and could not rejoin job {} within the join "
                       "timeout: {}",
                       opt_.node_id, opt_.job_id, s.message()));
      return;
    } else {
      rejoin_at_ = now + std::chrono::seconds(1);
    }
  }
  if (unplaced_since_ && now - *unplaced_since_ >= opt_.join_timeout && opt_.world_size > 0) {
    Fail(fmt::format(
        "job {}: no round with this node formed within the join timeout of {} s (the registered "
        "nodes' --nproc-per-node never added up to --world-size {}); start nodes that make it "
        "add up",
        opt_.job_id, std::chrono::duration_cast<std::chrono::seconds>(opt_.join_timeout).count(),
        opt_.world_size));
  } else if (unplaced_since_ && now - *unplaced_since_ >= opt_.join_timeout) {
    Fail(fmt::format(
        "job {}: no round with this node formed within the join timeout of {} s (fewer than "
        "--nnodes MIN={} nodes were available); start more nodes or lower MIN",
        opt_.job_id, std::chrono::duration_cast<std::chrono::seconds>(opt_.join_timeout).count(),
        opt_.min_nodes));
  }
}

void EtcdRendezvous::WaitNotice(TimePoint now) {
  const auto left = std::chrono::duration_cast<std::chrono::seconds>(
      *unplaced_since_ + opt_.join_timeout - now);
  auto count = client_.Range(keys_.nodes, {.prefix = true, .count_only = true});
  if (!count.ok()) {
    EFDL_LOG_INFO("rdzv {}: waiting for a round of job {} (etcd not answering: {}); giving up in "
                  "{} s",
                  opt_.node_id, opt_.job_id, count.status().message(), left.count());
    return;
  }
  const int64_t n = count->count;
  if (opt_.world_size > 0) {
    EFDL_LOG_INFO("rdzv {}: waiting for nodes whose processes add up to --world-size {}: {} "
                  "node(s) registered; giving up in {} s",
                  opt_.node_id, opt_.world_size, n, left.count());
  } else if (n < opt_.min_nodes) {
    EFDL_LOG_INFO("rdzv {}: waiting for {} more node(s): {} of at least {} registered; giving up "
                  "in {} s",
                  opt_.node_id, opt_.min_nodes - n, n, opt_.min_nodes, left.count());
  } else {
    EFDL_LOG_INFO("rdzv {}: waiting for round {} to form ({}): {} nodes registered; giving up "
                  "in {} s",
                  opt_.node_id, round_.round, PhaseName(round_.phase), n, left.count());
  }
}

void EtcdRendezvous::CheckEveryNodeFailed(TimePoint now) {
  (void)now;
  auto count = client_.Range(keys_.nodes, {.prefix = true, .count_only = true});
  if (!count.ok() || count->count >= opt_.min_nodes) return;
  Fail(fmt::format(
      "job {} cannot go on: {}; this node's workers failed too ({}), and {} of at least {} nodes "
      "remain. Fix the program, then start the job again",
      opt_.job_id, *peer_gave_up_, *own_failure_, count->count, opt_.min_nodes));
}

Status EtcdRendezvous::RecordGiveUp(const std::string& reason,
                                    const std::vector<std::string>& stderr_tail) {
  GaveUpRecord rec{reason, WallClockTimestamp(), stderr_tail};
  auto put = client_.Put(keys_.GaveUp(opt_.node_id), rec.Encode());
  if (!put.ok()) return put.status().WithContext("cannot record in etcd why this node gave up");
  return Status::OK();
}

void EtcdRendezvous::Handle(Input& in) {
  // Watch inputs from an older registration (before a fence or resync) are stale.
  if (in.type == Input::Type::kResync && in.coordinator_watch) {
    // A coordinator watch broke: re-read the job and watch again from the read's revision.
    if (coordinating_ && in.generation == coord_generation_) {
      StopCoordinating();
      BecomeCoordinator();
    }
    return;
  }
  bool watch_input = in.type == Input::Type::kRound || in.type == Input::Type::kAssign ||
                     in.type == Input::Type::kCoordGone || in.type == Input::Type::kResync;
  if (watch_input && in.generation != generation_) return;
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
      if (in.generation == coord_generation_ && coordinating_) OnNodesEvents(in.events);
      break;
    case Input::Type::kAcks:
      if (in.generation == coord_generation_ && coordinating_) OnAckEvents(in.events);
      break;
    case Input::Type::kCoordGone:
      if (in.detail == deputy_target_ && round_.coordinator == deputy_target_ && !takeover_at_) {
        auto it = std::find(round_.deputies.begin(), round_.deputies.end(), opt_.node_id);
        auto index = it - round_.deputies.begin();
        takeover_at_ = Clock::now() + index * opt_.takeover_step;
      }
      break;
    case Input::Type::kLeaseLost:
      if (in.lease == lease_) Fence("its lease expired or was revoked");
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
        peer_gave_up_ = fmt::format("node {} gave up: {}", id, why);
        Emit(MakeEvent(Event::Type::kPeerGaveUp, CurrentRoundForEvents(), false, *peer_gave_up_));
      }
      next_failed_check_ = Clock::now();
      break;
    case Input::Type::kWorkerFailure: {
      own_failure_ = in.detail;
      ++restarts_;
      // The ack key holds one record: a report about a round older than the one already
      // acked must not overwrite that ack (the coordinator would leave this node out).
      if (in.round < acked_round_) break;
      SendAck(AckState::kFailed, in.round);
      if (round_.round == in.round && round_.phase == Phase::kActive) {
        RoundRecord next = round_;
        next.round = round_.round + 1;
        next.phase = Phase::kProposed;
        next.coordinator = opt_.node_id;
        next.graceful = false;
        next.message = fmt::format("workers of node {} failed: {}", opt_.node_id, in.detail);
        // Keep the deputies but never name ourselves (a coordinator is not its own deputy).
        std::erase(next.deputies, opt_.node_id);
        if (!CasRound(next, round_mod_rev_)) RereadRound();
      }
      break;
    }
    case Input::Type::kWorkersSucceeded:
      own_failure_.reset();
      if (in.round >= acked_round_) SendAck(AckState::kDone, in.round);
      break;
    case Input::Type::kResync:
      EFDL_LOG_INFO("rdzv {}: resynchronising with etcd", opt_.node_id);
      StopCoordinating();
      round_watch_.reset();
      assign_watch_.reset();
      deputy_watch_.reset();
      deputy_target_.clear();
      {
        ++generation_;
        auto rd = client_.Get(keys_.round);
        auto as = client_.Get(keys_.Assign(opt_.node_id));
        if (!rd.ok() || !as.ok()) {
          Fence("etcd could not be re-read after a broken watch");
          break;
        }
        int64_t rev = std::max((*rd) ? (*rd)->mod_revision : 0, (*as) ? (*as)->mod_revision : 0);
        auto w1 = client_.StartWatch(keys_.round, {false, rev + 1, false},
                                     WatchInto(Input::Type::kRound, generation_));
        auto w2 = client_.StartWatch(keys_.Assign(opt_.node_id), {false, rev + 1, false},
                                     WatchInto(Input::Type::kAssign, generation_));
        if (!w1.ok() || !w2.ok()) {
          Fence("watches could not be restarted");
          break;
        }
        round_watch_ = std::move(*w1);
        assign_watch_ = std::move(*w2);
        if (*as) {
          auto a = AssignRecord::Decode((*as)->value);
          if (a.ok()) assign_ = *a;
        }
        if (*rd) {
          auto r = RoundRecord::Decode((*rd)->value);
          round_mod_rev_ = 0;
          if (r.ok()) ApplyRound(*r, (*rd)->mod_revision);
        }
      }
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Node side

Status EtcdRendezvous::Join() {
  EFDL_RETURN_IF_ERROR(ValidateId("job id", opt_.job_id));
  EFDL_RETURN_IF_ERROR(ValidateId("node id", opt_.node_id));
  if (opt_.min_nodes < 1 || opt_.max_nodes < opt_.min_nodes) {
    return Status::InvalidArgument(fmt::format(
        "--nnodes {}:{} is invalid: need 1 <= MIN <= MAX", opt_.min_nodes, opt_.max_nodes));
  }
  if (opt_.nproc < 1) return Status::InvalidArgument("--nproc-per-node must be at least 1");
  if (driver_.joinable()) return Status::FailedPrecondition("Join() was already called");
  EFDL_RETURN_IF_ERROR(CheckSameProgram());
  Status s = Register();
  if (s.code() == Status::Code::kAlreadyExists) s = WaitOutStaleRegistration(std::move(s));
  EFDL_RETURN_IF_ERROR(s);
  driver_ = std::thread([this] { DriverLoop(); });
  return Status::OK();
}

Status EtcdRendezvous::CheckSameProgram() {
  if (opt_.program.empty()) return Status::OK();
  auto nodes = client_.Range(keys_.nodes, {.prefix = true});
  if (!nodes.ok()) return nodes.status().WithContext("cannot read the job's nodes");
  for (const auto& kv : nodes->kvs) {
    auto rec = NodeRecord::Decode(kv.value);
    const std::string id = kv.key.substr(keys_.nodes.size());
    if (!rec.ok() || rec->program.empty() || rec->program == opt_.program ||
        id == opt_.node_id) {
      continue;
    }
    return Status::FailedPrecondition(fmt::format(
        "job '{}' runs {} (node {}), this node {}: the nodes of one job run one program. Give "
        "this one its own --job, or start it with the same command as the others",
        opt_.job_id, rec->program, id, opt_.program));
  }
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
  ++generation_;
  assign_.reset();
  int64_t ttl_s = std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::seconds>(opt_.ttl + std::chrono::milliseconds(999))
             .count());
  auto grant = client_.LeaseGrant(ttl_s);
  if (!grant.ok()) {
    return grant.status().WithContext(fmt::format("job {}: cannot register node {} in etcd",
                                                  opt_.job_id, opt_.node_id));
  }
  int64_t lease = grant->id;
  auto keeper = client_.KeepAlive(lease, [this, lease] {
    Input in;
    in.type = Input::Type::kLeaseLost;
    in.lease = lease;
    Push(std::move(in));
  });
  auto drop_lease = [&] { (void)client_.LeaseRevoke(lease); };
  if (!keeper.ok()) {
    drop_lease();
    return keeper.status().WithContext("cannot keep the node's lease alive");
  }
  NodeRecord me{opt_.advertise_addr, opt_.nproc, opt_.program};
  // One request registers the node and reads the round record (the common case); only the
  // first node of a job needs a second one to create the record.
  auto reg = client_.Txn({etcd::Compare::KeyMissing(keys_.Node(opt_.node_id))},
                         {etcd::TxnOp::Put(keys_.Node(opt_.node_id), me.Encode(), lease),
                          etcd::TxnOp::Get(keys_.round)});
  if (!reg.ok() || !reg->succeeded) {
    keeper->reset();
    drop_lease();
    if (!reg.ok()) return reg.status().WithContext("cannot register the node");
    return Status::AlreadyExists(fmt::format(
        "node id '{}' is already registered in job '{}' by an agent whose lease is kept alive "
        "(another agent uses this id): give this node another --node-id",
        opt_.node_id, opt_.job_id));
  }
  int64_t join_rev = reg->revision;
  RoundRecord fresh;
  fresh.round = 1;
  fresh.phase = Phase::kGathering;
  fresh.coordinator = opt_.node_id;
  fresh.message = "job started";
  RoundRecord current = fresh;
  int64_t read_rev = reg->revision;
  int64_t current_rev = 0;
  const etcd::KeyValue* found = nullptr;
  Result<etcd::TxnResult> rd = etcd::TxnResult{};
  if (!reg->gets.empty() && !reg->gets[0].kvs.empty()) {
    found = &reg->gets[0].kvs[0];
  } else {
    rd = client_.Txn({etcd::Compare::KeyMissing(keys_.round)},
                     {etcd::TxnOp::Put(keys_.round, fresh.Encode())},
                     {etcd::TxnOp::Get(keys_.round)});
    if (!rd.ok()) {
      keeper->reset();
      drop_lease();
      return rd.status().WithContext("cannot read the job's round");
    }
    read_rev = rd->revision;
    current_rev = rd->revision;
    if (!rd->succeeded && !rd->gets.empty() && !rd->gets[0].kvs.empty()) found = &rd->gets[0].kvs[0];
  }
  if (found != nullptr) {
    auto dec = RoundRecord::Decode(found->value);
    if (!dec.ok()) {
      keeper->reset();
      drop_lease();
      return dec.status().WithContext(fmt::format("job {} has a damaged round record in etcd",
                                                  opt_.job_id));
    }
    current = *dec;
    current_rev = found->mod_revision;
    if (current.phase == Phase::kSuspended) {
      keeper->reset();
      drop_lease();
      auto info = ReadSuspension(client_, opt_.job_id);
      return Status::FailedPrecondition(
          SuspendedJobMessage(opt_.job_id, info.ok() ? info->point : std::nullopt));
    }
  }
  auto w1 = client_.StartWatch(keys_.round, {false, read_rev + 1, false},
                               WatchInto(Input::Type::kRound, generation_));
  auto w2 = client_.StartWatch(keys_.Assign(opt_.node_id), {false, join_rev + 1, false},
                               WatchInto(Input::Type::kAssign, generation_));
  if (!w1.ok() || !w2.ok()) {
    keeper->reset();
    drop_lease();
    return (!w1.ok() ? w1.status() : w2.status()).WithContext("cannot watch the job");
  }
  lease_ = lease;
  SetKeeper(std::move(*keeper), false);
  round_watch_ = std::move(*w1);
  assign_watch_ = std::move(*w2);
  if (!gaveup_watch_) {
    // Records written after this node joined; one that cannot be watched is only information.
    auto w3 = client_.StartWatch(keys_.gaveup, {true, join_rev + 1, false},
                                 [this](const etcd::WatchUpdate& u) {
                                   if (!u.error.ok() || u.compacted) return;
                                   Input in;
                                   in.type = Input::Type::kGaveUp;
                                   in.events = u.events;
                                   Push(std::move(in));
                                 });
    if (w3.ok()) gaveup_watch_ = std::move(*w3);
  }
  acked_round_ = 0;
  round_mod_rev_ = 0;
  unplaced_since_ = Clock::now();
  EFDL_LOG_DEBUG("rdzv {}: registered in job {} (lease {:x}, revision {})", opt_.node_id,
                 opt_.job_id, lease, join_rev);
  ApplyRound(current, current_rev);
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
    StopCoordinating();
    ReleaseRegistration(false);
    return;
  }
  if (started_round_ != 0 && (rec.round != started_round_ || rec.phase != Phase::kActive)) {
    if (!started_standby_) {
      Emit(MakeEvent(Event::Type::kRoundClosing, started_round_, rec.graceful, rec.message));
    }
    started_round_ = 0;
    started_standby_ = false;
    unplaced_since_ = Clock::now();
  }
  if (rec.phase == Phase::kProposed && rec.round > acked_round_ && rec.round > fenced_round_) {
    SendAck(AckState::kAck, rec.round);
  }
  if (rec.coordinator == opt_.node_id && !coordinating_) {
    BecomeCoordinator();
  } else if (rec.coordinator != opt_.node_id && coordinating_) {
    StopCoordinating();
  }
  TryStart();            // first: a member that starts now must not set up a waiter's watch
  UpdateDeputyWatch();
}

void EtcdRendezvous::TryStart() {
  if (round_.phase != Phase::kActive || !assign_ || assign_->round != round_.round ||
      started_round_ == round_.round || round_.round <= fenced_round_) {
    return;
  }
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
  started_round_ = round_.round;
  started_standby_ = a.standby;
  unplaced_since_.reset();
  Emit(std::move(e));
  UpdateDeputyWatch();   // a waiter that became a member drops its watch of the coordinator
}

void EtcdRendezvous::SendAck(AckState state, int64_t round) {
  if (lease_ == 0) return;
  AckRecord ack;
  ack.round = round;
  ack.state = state;
  ack.restarts = restarts_;
  if (state == AckState::kAck) {
    auto port = PickFreePort(opt_.advertise_addr.empty() ? "127.0.0.1" : opt_.advertise_addr);
    if (!port.ok()) port = PickFreePort("0.0.0.0");
    ack.port = port.ok() ? *port : 0;
    ack.horovod_port = OfferHorovodPort(opt_.advertise_addr, ack.port);
    acked_round_ = round;
  }
  auto put = client_.Put(keys_.Ack(opt_.node_id), ack.Encode(), lease_);
  if (!put.ok()) {
    EFDL_LOG_WARN("rdzv {}: cannot record '{}' for round {}: {}", opt_.node_id,
                  AckStateName(state), round, put.status().ToString());
  }
}

bool EtcdRendezvous::CasRound(const RoundRecord& rec, int64_t expect_mod_rev) {
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
  const bool named = std::find(round_.deputies.begin(), round_.deputies.end(), opt_.node_id) !=
                     round_.deputies.end();
  // A node waiting outside an active round (a newcomer or a standby) also watches the
  // coordinator, after every named deputy (Handle: index = deputies.size()): when the whole round
  // died at once its deputies are dead too, and without this nobody would ever take over. Only
  // nodes outside the round do it, so a formed job of N members adds no watches.
  const bool waiting_outside = round_.phase == Phase::kActive &&
                               (started_round_ == 0 || started_standby_);
  bool deputy = round_.coordinator != opt_.node_id && !round_.coordinator.empty() &&
                (named || waiting_outside);
  std::string target = deputy ? round_.coordinator : std::string();
  if (target == deputy_target_) return;
  deputy_watch_.reset();
  takeover_at_.reset();
  deputy_target_ = target;
  if (target.empty()) return;
  auto ck = client_.Get(keys_.Node(target));
  if (!ck.ok()) return;
  if (!ck->has_value()) {
    Input in;
    in.type = Input::Type::kCoordGone;
    in.generation = generation_;
    in.detail = target;
    Handle(in);
    return;
  }
  uint64_t gen = generation_;
  auto w = client_.StartWatch(
      keys_.Node(target), {false, (*ck)->mod_revision + 1, false},
      [this, gen, target](const etcd::WatchUpdate& u) {
        bool gone = !u.error.ok() || u.compacted;
        for (const auto& e : u.events) gone |= e.type == etcd::WatchEvent::Type::kDelete;
        if (!gone) return;
        Input in;
        in.type = Input::Type::kCoordGone;
        in.generation = gen;
        in.detail = target;
        Push(std::move(in));
      });
  if (w.ok()) deputy_watch_ = std::move(*w);
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
  RoundRecord next = *rec;
  std::string gone = rec->coordinator;
  next.coordinator = opt_.node_id;
  std::erase(next.deputies, opt_.node_id);
  next.graceful = false;
  // An empty coordinator is a resumed job's (suspend.h): keep its "resumed ..." message.
  if (!gone.empty()) {
    next.message = fmt::format("coordinator {} is gone; {} took over", gone, opt_.node_id);
  }
  if (rec->phase != Phase::kGathering) {
    next.round = rec->round + 1;
    next.phase = Phase::kProposed;
  }
  if (CasRound(next, (*rd)->mod_revision)) {
    EFDL_LOG_INFO("rdzv {}: took over coordination of job {} from {}", opt_.node_id, opt_.job_id,
                  gone);
  } else {
    RereadRound();
  }
}

int64_t EtcdRendezvous::CurrentRoundForEvents() const {
  return started_round_ != 0 ? started_round_ : round_.round;
}

void EtcdRendezvous::Fence(const std::string& why) {
  if (finished_ || lease_ == 0) return;
  int64_t round = CurrentRoundForEvents();
  EFDL_LOG_WARN("rdzv {}: fenced out of round {}: {}", opt_.node_id, round, why);
  SetKeeper(nullptr, true);   // first: from now on nothing of the old round is published
  Emit(MakeEvent(Event::Type::kFenced, round, false,
                 fmt::format("node {} was fenced out of round {}: {}", opt_.node_id, round, why)));
  fenced_round_ = std::max(round, round_.round);
  StopTakingPart();
  lease_ = 0;
  ++generation_;
  fenced_since_ = Clock::now();
  rejoin_at_ = Clock::now();
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
  StopCoordinating();
  round_watch_.reset();
  assign_watch_.reset();
  deputy_watch_.reset();
  takeover_at_.reset();
  rejoin_at_.reset();
  unplaced_since_.reset();
  if (lease_ != 0) {
    if (announce_leaving) {
      SendAck(AckState::kLeaving, round_.round);
      HandOverCoordination();
    }
    SetKeeper(nullptr, false);
    Status s = client_.LeaseRevoke(lease_);
    if (!s.ok() && !s.IsNotFound()) {
      EFDL_LOG_WARN("rdzv {}: could not revoke the lease (others will see it expire after "
                    "the TTL): {}", opt_.node_id, s.ToString());
    }
    lease_ = 0;
  }
  SetKeeper(nullptr, false);
}

void EtcdRendezvous::SetKeeper(std::unique_ptr<etcd::LeaseKeeper> keeper, bool fenced) {
  std::unique_ptr<etcd::LeaseKeeper> old;
  MutexLock lock(keeper_mu_);
  old = std::move(keeper_);   // destroyed after the lock is released
  keeper_ = std::move(keeper);
  fenced_ = fenced;
  if (fenced) {
    fenced_at_wall_ =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
            .count();
  }
}

bool EtcdRendezvous::MayPublish(double committed_at) const {
  MutexLock lock(keeper_mu_);
  if (fenced_ || committed_at < fenced_at_wall_) return false;
  // Without a lease (before the first registration, after leaving) nothing newer can be fenced
  // against it; with one, only until its local expiry.
  return keeper_ == nullptr || std::chrono::steady_clock::now() < keeper_->expires_at();
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
    RoundRecord next = *rec;
    next.coordinator = successor;
    std::erase(next.deputies, successor);
    std::erase(next.deputies, opt_.node_id);
    next.graceful = true;
    next.message = fmt::format("node {} left (it was the coordinator; {} took over)",
                               opt_.node_id, successor);
    if (rec->phase != Phase::kGathering) {
      next.round = rec->round + 1;
      next.phase = Phase::kProposed;
      next.world_size = 0;
      next.nnodes = 0;
      next.master_addr.clear();
      next.master_port = 0;
      next.horovod_port = 0;
    }
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
  {
    MutexLock lock(in_mu_);
    if (left_) return;
    left_ = true;
    stop_ = true;
  }
  in_cv_.notify_all();
  if (driver_.joinable()) driver_.join();
  if (!finished_) {
    ReleaseRegistration(true);
  } else if (lease_ != 0) {
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
  rejoin_at_.reset();
}

void EtcdRendezvous::StopTakingPart() {
  started_round_ = 0;
  started_standby_ = false;
  StopCoordinating();
  round_watch_.reset();
  assign_watch_.reset();
  deputy_watch_.reset();
  deputy_target_.clear();
  takeover_at_.reset();
  unplaced_since_.reset();
}

// ---------------------------------------------------------------------------------------------
// Coordinator side

void EtcdRendezvous::Record(const std::string& message) {
  EFDL_LOG_INFO("rdzv {} (coordinator of {}): {}", opt_.node_id, opt_.job_id, message);
  history_.push_back({{"time", WallClockTimestamp()}, {"message", message}});
  while (history_.size() > kMaxStatusEvents) history_.pop_front();
}

void EtcdRendezvous::BecomeCoordinator() {
  ++coord_generation_;
  registered_.clear();
  acks_.clear();
  prev_rank_.clear();
  members_.clear();
  standbys_.clear();
  leaving_.clear();
  unresponsive_.clear();
  assign_keys_.clear();
  history_.clear();
  min_reached_at_.reset();
  reround_ = false;
  // One consistent snapshot of everything the coordinator needs: O(N), once per takeover.
  auto snap = client_.Txn({}, {etcd::TxnOp::Get(keys_.nodes, true), etcd::TxnOp::Get(keys_.ack, true),
                               etcd::TxnOp::Get(keys_.assign, true),
                               etcd::TxnOp::Get(keys_.status)});
  if (!snap.ok() || snap->gets.size() != 4) {
    EFDL_LOG_WARN("rdzv {}: cannot read the job to coordinate it: {}", opt_.node_id,
                  snap.ok() ? "short answer" : snap.status().ToString());
    Input in;
    in.type = Input::Type::kResync;
    in.generation = generation_;
    Push(std::move(in));
    return;
  }
  for (const auto& kv : snap->gets[0].kvs) {
    auto rec = NodeRecord::Decode(kv.value);
    if (rec.ok()) registered_[kv.key.substr(keys_.nodes.size())] = {kv.create_revision, *rec};
  }
  for (const auto& kv : snap->gets[1].kvs) {
    auto rec = AckRecord::Decode(kv.value);
    if (!rec.ok()) continue;
    std::string id = kv.key.substr(keys_.ack.size());
    acks_[id] = *rec;
    // A node on its way out (e.g. the coordinator that just handed over) is not waited for.
    if (rec->state == AckState::kLeaving) leaving_.insert(id);
  }
  acked_round_ids_ = {round_.round, {}};
  for (const auto& [id, a] : acks_) {
    if (a.round == round_.round && a.state == AckState::kAck) acked_round_ids_.second.insert(id);
  }
  int64_t last_formed = 0;
  std::map<std::string, AssignRecord> assigns;
  std::set<std::string> restarted;
  for (const auto& kv : snap->gets[2].kvs) {
    auto rec = AssignRecord::Decode(kv.value);
    std::string id = kv.key.substr(keys_.assign.size());
    assign_keys_.insert(id);
    if (!rec.ok()) continue;
    // A node registered after its assignment was written is a new incarnation of that id (an
    // agent restarted with the same --node-id): it runs nothing of that round.
    if (auto r = registered_.find(id); r != registered_.end() &&
                                       r->second.create_revision > kv.mod_revision) {
      if (rec->round == round_.round && !rec->standby) restarted.insert(id);
      continue;
    }
    assigns[id] = *rec;
    if (!rec->standby) last_formed = std::max(last_formed, rec->round);
  }
  for (const auto& [id, a] : assigns) {
    if (a.round != last_formed) continue;
    if (!a.standby) prev_rank_[id] = a.node_rank;
    bool current = round_.phase == Phase::kActive && a.round == round_.round;
    if (current && registered_.count(id)) (a.standby ? standbys_ : members_).insert(id);
  }
  if (!snap->gets[3].kvs.empty()) {
    json st = json::parse(snap->gets[3].kvs[0].value, nullptr, false);
    if (st.is_object() && st.contains("events") && st["events"].is_array()) {
      for (const auto& e : st["events"]) history_.push_back(e);
    }
  }
  uint64_t gen = coord_generation_;
  auto w1 = client_.StartWatch(keys_.nodes, {true, snap->revision + 1, false},
                               WatchInto(Input::Type::kNodes, gen));
  auto w2 = client_.StartWatch(keys_.ack, {true, snap->revision + 1, false},
                               WatchInto(Input::Type::kAcks, gen));
  if (!w1.ok() || !w2.ok()) {
    Input in;
    in.type = Input::Type::kResync;
    in.generation = generation_;
    Push(std::move(in));
    return;
  }
  nodes_watch_ = std::move(*w1);
  acks_watch_ = std::move(*w2);
  coordinating_ = true;
  window_ = opt_.liveness_window;
  last_progress_ = Clock::now();
  // A coordinator that took over an active round re-checks what it may have missed.
  if (round_.phase == Phase::kActive) {
    for (const auto& [id, a] : assigns) {
      if (a.round == round_.round && !a.standby && !registered_.count(id)) {
        reround_ = true;
        reround_graceful_ = false;
        reround_why_ = fmt::format("node {} left", id);
      }
    }
    for (const auto& id : restarted) {   // its old incarnation's workers died with it
      reround_ = true;
      reround_graceful_ = false;
      reround_why_ = fmt::format("node {} restarted", id);
    }
  }
  Record(fmt::format("coordinating round {} ({}), {} nodes registered", round_.round,
                     PhaseName(round_.phase), registered_.size()));
}

void EtcdRendezvous::StopCoordinating() {
  if (!coordinating_) return;
  coordinating_ = false;
  ++coord_generation_;
  nodes_watch_.reset();
  acks_watch_.reset();
}

void EtcdRendezvous::OnNodesEvents(const std::vector<etcd::WatchEvent>& events) {
  for (const auto& e : events) {
    std::string id = e.kv.key.substr(keys_.nodes.size());
    if (e.type == etcd::WatchEvent::Type::kPut) {
      auto rec = NodeRecord::Decode(e.kv.value);
      if (!rec.ok()) {
        EFDL_LOG_WARN("rdzv {}: ignoring a bad node record at {}: {}", opt_.node_id, e.kv.key,
                      rec.status().ToString());
        continue;
      }
      registered_[id] = {e.kv.create_revision, *rec};
      unresponsive_.erase(id);
      if (round_.phase == Phase::kActive && !members_.count(id) && !standbys_.count(id)) {
        if (RoomForNewMember()) {
          reround_ = true;
          reround_why_ = fmt::format("node {} joined", id);
        } else {
          AssignStandby(id);
        }
      }
    } else {
      registered_.erase(id);
      acks_.erase(id);
      acked_round_ids_.second.erase(id);
      prev_rank_.erase(id);   // if it comes back, it is a new member and goes last
      unresponsive_.erase(id);
      bool was_leaving = leaving_.erase(id) > 0;
      standbys_.erase(id);
      if (members_.erase(id) && round_.phase == Phase::kActive) {
        reround_ = true;
        if (!was_leaving) reround_graceful_ = false;
        reround_why_ = fmt::format("node {} {}", id, was_leaving ? "left" : "is gone");
      }
      Record(fmt::format("node {} {}", id, was_leaving ? "left" : "is gone (lease ended)"));
    }
  }
}

void EtcdRendezvous::OnAckEvents(const std::vector<etcd::WatchEvent>& events) {
  for (const auto& e : events) {
    std::string id = e.kv.key.substr(keys_.ack.size());
    if (e.type == etcd::WatchEvent::Type::kDelete) {
      acks_.erase(id);
      continue;
    }
    auto rec = AckRecord::Decode(e.kv.value);
    if (!rec.ok()) {
      EFDL_LOG_WARN("rdzv {}: ignoring a bad ack record at {}: {}", opt_.node_id, e.kv.key,
                    rec.status().ToString());
      continue;
    }
    acks_[id] = *rec;
    unresponsive_.erase(id);
    if (rec->state == AckState::kAck && rec->round == round_.round) {
      if (acked_round_ids_.first != round_.round) acked_round_ids_ = {round_.round, {}};
      acked_round_ids_.second.insert(id);
    }
    switch (rec->state) {
      case AckState::kAck:
        if (round_.phase == Phase::kProposed && rec->round == round_.round) {
          last_progress_ = Clock::now();
        } else if (round_.phase == Phase::kActive && registered_.count(id) && !members_.count(id) &&
                   !standbys_.count(id)) {
          // A node left out for not acking in time announced itself again: treat as a join,
          // and be more patient with the next proposal.
          window_ = std::min(window_ * 2, opt_.liveness_window * 8);
          if (RoomForNewMember()) {
            reround_ = true;
            reround_why_ = fmt::format("node {} is back", id);
          } else {
            AssignStandby(id);
          }
        }
        break;
      case AckState::kFailed:
        if (round_.phase == Phase::kActive && rec->round == round_.round && members_.count(id)) {
          reround_ = true;
          reround_graceful_ = false;
          reround_why_ = fmt::format("workers of node {} failed", id);
        }
        break;
      case AckState::kLeaving:
        leaving_.insert(id);
        break;
      case AckState::kDone:
        break;
    }
  }
}

std::vector<Candidate> EtcdRendezvous::Registered(bool acked_only) const {
  std::vector<Candidate> out;
  out.reserve(registered_.size());
  for (const auto& [id, m] : registered_) {
    uint16_t port = 0;
    auto a = acks_.find(id);
    bool acked = a != acks_.end() && a->second.round == round_.round &&
                 a->second.state == AckState::kAck;
    if (acked) port = a->second.port;
    if (acked_only && (!acked || leaving_.count(id))) continue;
    if (!acked_only && (unresponsive_.count(id) || leaving_.count(id))) continue;
    out.push_back({id, m.create_revision, m.record.nproc, m.record.addr, port});
  }
  return out;
}

std::vector<std::string> EtcdRendezvous::PickDeputies(
    const std::vector<std::string>& preferred) const {
  std::vector<std::string> out;
  for (const auto& id : preferred) {
    if (out.size() == kMaxDeputies) break;
    if (id != opt_.node_id && registered_.count(id)) out.push_back(id);
  }
  return out;
}

void EtcdRendezvous::CoordinatorStep() {
  if (!coordinating_) return;
  auto now = Clock::now();
  PlanLimits limits{opt_.min_nodes, opt_.max_nodes, opt_.world_size};
  switch (round_.phase) {
    case Phase::kGathering: {
      // O(N) per step and no allocation: this runs once per batch of join events.
      int count = 0;
      std::vector<std::pair<int64_t, const std::string*>> oldest;
      for (const auto& [id, m] : registered_) {
        if (unresponsive_.count(id) || leaving_.count(id)) continue;
        ++count;
        if (id == opt_.node_id) continue;
        oldest.push_back({m.create_revision, &id});
        std::sort(oldest.begin(), oldest.end());
        if (oldest.size() > kMaxDeputies) oldest.pop_back();
      }
      std::vector<std::string> deputies;
      for (const auto& o : oldest) deputies.push_back(*o.second);
      bool formed = count >= opt_.min_nodes;
      bool full = count >= opt_.max_nodes;
      if (opt_.world_size > 0 && formed) {   // fragmented mode: only the planner knows
        Plan plan = PlanRound(Registered(false), prev_rank_, limits);
        formed = plan.formed;
        full = plan.formed;
      }
      if (!formed) {
        min_reached_at_.reset();
        if (deputies != round_.deputies) {
          RoundRecord next = round_;
          next.deputies = deputies;
          if (!CasRound(next, round_mod_rev_)) RereadRound();
        }
        return;
      }
      if (!min_reached_at_) min_reached_at_ = now;
      bool survivors = !prev_rank_.empty();   // a re-round after a formed one: no last call
      if (full || survivors || now >= *min_reached_at_ + opt_.last_call) {
        Propose(round_.graceful, round_.message.empty() ? "enough nodes registered" : round_.message);
      } else if (deputies != round_.deputies) {
        RoundRecord next = round_;
        next.deputies = deputies;
        if (!CasRound(next, round_mod_rev_)) RereadRound();
      }
      return;
    }
    case Phase::kProposed: {
      // Cheap test first: the full O(N) check runs only once enough acks came.
      size_t expected = registered_.size() - std::min(registered_.size(),
                                                      unresponsive_.size() + leaving_.size());
      bool all = acked_round_ids_.first == round_.round &&
                 acked_round_ids_.second.size() >= expected;
      for (auto it = registered_.begin(); all && it != registered_.end(); ++it) {
        const std::string& id = it->first;
        if (unresponsive_.count(id) || leaving_.count(id)) continue;
        auto a = acks_.find(id);
        if (a == acks_.end() || a->second.round != round_.round ||
            a->second.state != AckState::kAck) {
          all = false;
        }
      }
      if (all || now >= last_progress_ + window_) Finalize();
      return;
    }
    case Phase::kActive: {
      if (!members_.empty()) {
        bool done = std::all_of(members_.begin(), members_.end(), [&](const std::string& id) {
          auto a = acks_.find(id);
          return a != acks_.end() && a->second.round == round_.round &&
                 a->second.state == AckState::kDone;
        });
        if (done) {
          CompleteJob();
          return;
        }
      }
      if (reround_) Propose(reround_graceful_, reround_why_);
      return;
    }
    case Phase::kComplete:
    case Phase::kSuspended:   // unreachable: OnSuspended stopped coordinating
      return;
  }
}

void EtcdRendezvous::Propose(bool graceful, std::string why) {
  RoundRecord next = round_;
  if (round_.phase != Phase::kGathering) next.round = round_.round + 1;
  next.phase = Phase::kProposed;
  next.coordinator = opt_.node_id;
  next.graceful = graceful;
  next.message = why;
  next.world_size = 0;
  next.nnodes = 0;
  next.master_addr.clear();
  next.master_port = 0;
  next.horovod_port = 0;
  reround_ = false;
  reround_graceful_ = true;
  reround_why_.clear();
  min_reached_at_.reset();
  Record(fmt::format("proposing round {}: {}", next.round, why));
  if (CasRound(next, round_mod_rev_)) {
    last_progress_ = Clock::now();
  } else {
    RereadRound();
  }
}

void EtcdRendezvous::Finalize() {
  last_progress_ = Clock::now();   // on an etcd error below, retry after another window
  std::vector<Candidate> acked = Registered(true);
  Plan plan = PlanRound(acked, prev_rank_, {opt_.min_nodes, opt_.max_nodes, opt_.world_size});
  if (!plan.formed && PlanRound(Registered(false), prev_rank_,
                                {opt_.min_nodes, opt_.max_nodes, opt_.world_size}).formed) {
    // Enough nodes are registered but too few answered yet: a stall (etcd or the machines
    // slow), not a verdict on the silent ones. Giving up would mark most nodes unresponsive
    // and cascade into more rounds; wait another window instead (the join timeout still bounds
    // each node's wait, and leases still remove the dead).
    return;
  }
  std::set<std::string> answered;
  for (const auto& c : acked) answered.insert(c.id);
  for (const auto& c : Registered(false)) {
    if (!answered.count(c.id)) unresponsive_.insert(c.id);
  }
  if (!plan.formed) {
    RoundRecord next = round_;
    next.round = round_.round + 1;   // a proposal number is never reused
    next.phase = Phase::kGathering;
    next.message = fmt::format("round {} not formed: {} of at least {} nodes answered",
                               round_.round, acked.size(), opt_.min_nodes);
    Record(next.message);
    if (!CasRound(next, round_mod_rev_)) RereadRound();
    WriteStatus();
    return;
  }
  // Assignments first, in batches, each guarded by the round record we own: a coordinator that
  // was replaced meanwhile writes nothing.
  std::vector<etcd::TxnOp> ops;
  std::vector<std::pair<std::string, AssignRecord>> writes;
  std::vector<AssignRecord> member_assigns = MemberAssignments(round_.round, plan);
  for (size_t i = 0; i < plan.members.size(); ++i) {
    writes.push_back({plan.members[i].id, std::move(member_assigns[i])});
  }
  for (const auto& id : plan.standbys) writes.push_back({id, {round_.round, 0, 0, true}});
  std::vector<std::string> stale;
  for (const auto& id : assign_keys_) {
    if (!registered_.count(id)) stale.push_back(id);
  }
  size_t total = writes.size() + stale.size();
  for (size_t i = 0; i < total; ++i) {
    if (i < writes.size()) {
      ops.push_back(etcd::TxnOp::Put(keys_.Assign(writes[i].first), writes[i].second.Encode()));
    } else {
      ops.push_back(etcd::TxnOp::Delete(keys_.Assign(stale[i - writes.size()])));
    }
    if (ops.size() == kAssignBatch || i + 1 == total) {
      auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, round_mod_rev_)}, ops);
      ops.clear();
      if (!txn.ok() || !txn->succeeded) {
        if (!txn.ok()) {
          EFDL_LOG_WARN("rdzv {}: writing assignments failed: {}", opt_.node_id,
                        txn.status().ToString());
        }
        RereadRound();
        return;
      }
    }
  }
  for (const auto& w : writes) assign_keys_.insert(w.first);
  for (const auto& id : stale) assign_keys_.erase(id);

  prev_rank_.clear();
  members_.clear();
  std::vector<std::string> order;
  for (const auto& m : plan.members) {
    prev_rank_[m.id] = m.node_rank;
    members_.insert(m.id);
    order.push_back(m.id);
  }
  standbys_ = {plan.standbys.begin(), plan.standbys.end()};
  order.insert(order.end(), plan.standbys.begin(), plan.standbys.end());

  RoundRecord next = round_;
  next.phase = Phase::kActive;
  next.world_size = plan.world_size;
  next.nnodes = static_cast<int>(plan.members.size());
  next.master_addr = plan.master_addr;
  next.master_port = plan.master_port;
  next.horovod_port = plan.members.empty()
                          ? 0
                          : OfferedHorovodPort(acks_, plan.members.front().id, round_.round);
  next.deputies = PickDeputies(order);
  Record(fmt::format("round {} formed: {} nodes, world size {}, {} standby, {} left out",
                     round_.round, plan.members.size(), plan.world_size, plan.standbys.size(),
                     unresponsive_.size()));
  if (!CasRound(next, round_mod_rev_)) {
    RereadRound();
    return;
  }
  WriteStatus();
}

bool EtcdRendezvous::RoomForNewMember() const {
  // Fragmented mode: an active round adds up to exactly world_size, so a newcomer can only
  // wait; re-planning now could swap running members for fewer, larger nodes (a needless
  // restart). The set is re-chosen when a member leaves or fails.
  if (opt_.world_size > 0) return false;
  return static_cast<int>(members_.size()) < opt_.max_nodes;
}

void EtcdRendezvous::AssignStandby(const std::string& id) {
  AssignRecord a{round_.round, 0, 0, true};
  auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, round_mod_rev_)},
                         {etcd::TxnOp::Put(keys_.Assign(id), a.Encode())});
  if (txn.ok() && txn->succeeded) {
    standbys_.insert(id);
    assign_keys_.insert(id);
    Record(opt_.world_size > 0
               ? fmt::format("node {} is a standby (the round already adds up to world size {})",
                             id, opt_.world_size)
               : fmt::format("node {} is a standby (the job is at its maximum of {} nodes)", id,
                             opt_.max_nodes));
    WriteStatus();
  } else {
    RereadRound();
  }
}

void EtcdRendezvous::CompleteJob() {
  RoundRecord next = round_;
  next.phase = Phase::kComplete;
  next.message = fmt::format("job complete: every worker of round {} succeeded", round_.round);
  Record(next.message);
  WriteStatus();
  auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, round_mod_rev_)},
                         {etcd::TxnOp::Put(keys_.round, next.Encode()),
                          etcd::TxnOp::Put(keys_.complete,
                                           json{{"round", round_.round},
                                                {"time", WallClockTimestamp()}}.dump())});
  if (!txn.ok() || !txn->succeeded) {
    RereadRound();
    return;
  }
  ApplyRound(next, txn->revision);
}

void EtcdRendezvous::WriteStatus() {
  json members = json::array();
  std::vector<std::pair<int, std::string>> ranked;
  for (const auto& id : members_) ranked.push_back({prev_rank_.count(id) ? prev_rank_[id] : 0, id});
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [rank, id] : ranked) {
    auto it = registered_.find(id);
    members.push_back({{"id", id},
                       {"rank", rank},
                       {"addr", it != registered_.end() ? it->second.record.addr : ""},
                       {"nproc", it != registered_.end() ? it->second.record.nproc : 0}});
  }
  json st = {{"round", round_.round},
             {"coordinator", opt_.node_id},
             {"members", members},
             {"standbys", json(std::vector<std::string>(standbys_.begin(), standbys_.end()))},
             {"events", json(std::vector<json>(history_.begin(), history_.end()))}};
  auto put = client_.Put(keys_.status, st.dump());
  if (!put.ok()) {
    EFDL_LOG_WARN("rdzv {}: cannot write the job status: {}", opt_.node_id,
                  put.status().ToString());
  }
}

}  // namespace

std::unique_ptr<Rendezvous> NewEtcdRendezvous(etcd::Client& client, RendezvousOptions options) {
  return std::make_unique<EtcdRendezvous>(client, std::move(options));
}

}  // namespace efdl::rdzv
