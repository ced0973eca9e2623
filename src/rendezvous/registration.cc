#include "rendezvous/registration.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "common/log.h"
#include "rendezvous/suspend.h"

namespace efdl::rdzv {

namespace {

// A watch from `from` on, started without waiting for etcd to serve it (WaitCreated later).
etcd::WatchOptions Queued(bool prefix, int64_t from) {
  return etcd::WatchOptions{.prefix = prefix, .start_revision = from, .wait_created = false};
}

// Both watches started and served by etcd (they were started together, and are waited for
// together); the first error otherwise.
Status BothCreated(Result<std::unique_ptr<etcd::Watch>>& a,
                   Result<std::unique_ptr<etcd::Watch>>& b) {
  if (!a.ok()) return a.status();
  if (!b.ok()) return b.status();
  EFDL_RETURN_IF_ERROR((*a)->WaitCreated());
  return (*b)->WaitCreated();
}

}  // namespace

Result<Registration::Joined> Registration::Open(const NodeRecord& me,
                                                std::chrono::milliseconds ttl,
                                                const RoundRecord& fresh) {
  ++generation_;
  const uint64_t gen = generation_;
  const int64_t ttl_s = std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::seconds>(ttl + std::chrono::milliseconds(999))
             .count());
  const auto asked = std::chrono::steady_clock::now();
  auto grant = client_.LeaseGrant(ttl_s);
  if (!grant.ok()) {
    return grant.status().WithContext(
        fmt::format("job {}: cannot register node {} in etcd", job_id_, node_id_));
  }
  const int64_t lease = grant->id;
  // The grant's answer has the TTL: no time-to-live read before keeping the lease.
  auto keeper = client_.KeepGranted(*grant, asked, [this, lease] { cb_.lease_lost(lease); });
  if (!keeper.ok()) {
    (void)client_.LeaseRevoke(lease);
    return keeper.status().WithContext("cannot keep the node's lease alive");
  }
  // Everything below that fails drops this attempt's keeper and lease.
  auto abandon = [&](Status s) {
    keeper->reset();
    (void)client_.LeaseRevoke(lease);
    return s;
  };
  // One request registers the node, checks its program and reads the round record (the common
  // case); only the first node of a job needs a second one to create the record.
  auto reg = RegisterNode(me, lease);
  if (!reg.ok()) {
    return abandon(reg.status().IsFailedPrecondition()
                       ? reg.status()
                       : reg.status().WithContext("cannot register the node"));
  }
  if (!reg->succeeded) {
    return abandon(Status::AlreadyExists(fmt::format(
        "node id '{}' is already registered in job '{}' by an agent whose lease is kept alive "
        "(another agent uses this id): give this node another --node-id",
        node_id_, job_id_)));
  }
  Joined joined;
  joined.revision = reg->revision;
  joined.round = fresh;
  int64_t read_rev = reg->revision;
  const etcd::KeyValue* found = nullptr;
  Result<etcd::TxnResult> created = etcd::TxnResult{};
  if (!reg->gets.empty() && !reg->gets[0].kvs.empty()) {
    found = &reg->gets[0].kvs[0];
  } else {
    created = client_.Txn({etcd::Compare::KeyMissing(keys_.round)},
                          {etcd::TxnOp::Put(keys_.round, fresh.Encode())},
                          {etcd::TxnOp::Get(keys_.round)});
    if (!created.ok()) return abandon(created.status().WithContext("cannot read the job's round"));
    read_rev = created->revision;
    joined.round_revision = created->revision;
    if (!created->succeeded && !created->gets.empty() && !created->gets[0].kvs.empty()) {
      found = &created->gets[0].kvs[0];
    }
  }
  if (found != nullptr) {
    auto dec = RoundRecord::Decode(found->value);
    if (!dec.ok()) {
      return abandon(dec.status().WithContext(
          fmt::format("job {} has a damaged round record in etcd", job_id_)));
    }
    joined.round = *dec;
    joined.round_revision = found->mod_revision;
    if (joined.round.phase == Phase::kSuspended) {
      auto info = ReadSuspension(client_, job_id_);
      return abandon(Status::FailedPrecondition(
          SuspendedJobMessage(job_id_, info.ok() ? info->point : std::nullopt)));
    }
  }
  // The watches go out together and are waited for together: one round trip, not one each.
  auto w1 = client_.StartWatch(keys_.round, Queued(false, read_rev + 1),
                               cb_.watch(Stream::kRound, gen));
  auto w2 = client_.StartWatch(keys_.Assign(node_id_), Queued(false, joined.revision + 1),
                               cb_.watch(Stream::kAssign, gen));
  std::unique_ptr<etcd::Watch> gaveup;
  if (!gaveup_watch_) {
    // Records written after this node joined; one that cannot be watched is only information.
    auto w3 = client_.StartWatch(keys_.gaveup, Queued(true, joined.revision + 1),
                                 cb_.watch(Stream::kGaveUp, gen));
    if (w3.ok()) gaveup = std::move(*w3);
  }
  if (Status s = BothCreated(w1, w2); !s.ok()) {
    return abandon(s.WithContext("cannot watch the job"));
  }
  lease_ = lease;
  kept_.Set(std::move(*keeper), false);
  round_watch_ = std::move(*w1);
  assign_watch_ = std::move(*w2);
  if (gaveup && gaveup->WaitCreated().ok()) gaveup_watch_ = std::move(gaveup);
  EFDL_LOG_DEBUG("rdzv {}: registered in job {} (lease {:x}, revision {})", node_id_, job_id_,
                 lease, joined.revision);
  return joined;
}

Result<etcd::TxnResult> Registration::RegisterNode(const NodeRecord& me, int64_t lease) {
  const std::string node_key = keys_.Node(node_id_);
  // Issue #37: a check that reads nothing while the key's writer lives. Reading a live node's
  // record instead cost every join two point reads (20,000 requests for 10,000 nodes forming).
  // A node that names no program compares nothing and never writes the key.
  const bool names_program = !me.program.empty();
  bool claim = false;     // no P program was found: write it (create-only)
  bool checked = false;   // the live nodes' records were compared
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::vector<etcd::Compare> guard{etcd::Compare::KeyMissing(node_key)};
    std::vector<etcd::TxnOp> then;
    if (names_program) {
      guard.push_back(claim ? etcd::Compare::KeyMissing(keys_.program)
                            : etcd::Compare::ValueIs(keys_.program, me.program));
    }
    if (claim) then.push_back(etcd::TxnOp::Put(keys_.program, me.program, lease));
    then.push_back(etcd::TxnOp::Put(node_key, me.Encode(), lease));
    then.push_back(etcd::TxnOp::Get(keys_.round));
    auto reg = client_.Txn(std::move(guard), std::move(then),
                           {etcd::TxnOp::Get(node_key), etcd::TxnOp::Get(keys_.program)});
    if (!reg.ok() || reg->succeeded || !names_program) return reg;
    if (reg->gets.size() < 2) return Status::Internal("etcd answered a txn without its reads");
    if (!reg->gets[0].kvs.empty()) return reg;   // the node id is taken
    const auto& job_program = reg->gets[1].kvs;
    if (!job_program.empty() && job_program[0].value != me.program) {
      // Name a node that runs it when one is found (the error is rare; the reads are cheap).
      Status named = CheckLiveNodesProgram(me.program);
      return named.ok() ? OtherProgram(job_program[0].value, "", me.program) : named;
    }
    claim = job_program.empty();
    if (claim && !checked) {
      EFDL_RETURN_IF_ERROR(CheckLiveNodesProgram(me.program));
      checked = true;
    }
  }
  return Status::Unavailable(fmt::format(
      "job {}: its program key {} kept changing while node {} registered; try again",
      job_id_, keys_.program, node_id_));
}

// Every live node of the job passed this check or the key's when it joined, so one other
// node's program is enough - the coordinator's, named in the round record. Only when the record
// names no coordinator (the job's first node, a resumed job) or its key is gone (a takeover is
// under way) does it read the first two node records (a range with a limit of 2, though etcd
// 3.4 still walks the nodes/ index for it). Two different programs joining at once while no
// P program exists can both pass (neither sees the other's record yet); that race is as old as
// the check and stays.
Status Registration::CheckLiveNodesProgram(const std::string& program) {
  std::optional<etcd::KeyValue> other;
  auto round = client_.Get(keys_.round);
  if (!round.ok()) return round.status().WithContext("cannot read the job's round record");
  if (round->has_value()) {
    auto rec = RoundRecord::Decode((*round)->value);
    if (rec.ok() && !rec->coordinator.empty() && rec->coordinator != node_id_) {
      auto coordinator = client_.Get(keys_.Node(rec->coordinator));
      if (!coordinator.ok()) {
        return coordinator.status().WithContext("cannot read the job's nodes");
      }
      other = std::move(*coordinator);
    }
  }
  if (!other) {
    auto first = client_.Range(keys_.nodes, {.prefix = true, .limit = 2});
    if (!first.ok()) return first.status().WithContext("cannot read the job's nodes");
    for (auto& kv : first->kvs) {
      if (kv.key != keys_.Node(node_id_)) {
        other = std::move(kv);
        break;
      }
    }
  }
  if (!other) return Status::OK();
  auto rec = NodeRecord::Decode(other->value);
  if (!rec.ok() || rec->program.empty() || rec->program == program) return Status::OK();
  return OtherProgram(rec->program, other->key.substr(keys_.nodes.size()), program);
}

Status Registration::OtherProgram(const std::string& runs, const std::string& node,
                                  const std::string& program) const {
  return Status::FailedPrecondition(fmt::format(
      "job '{}' runs {}{}, this node {}: the nodes of one job run one program. Give this one "
      "its own --job, or start it with the same command as the others",
      job_id_, runs, node.empty() ? std::string() : fmt::format(" (node {})", node), program));
}

Result<Registration::Reread> Registration::Rewatch() {
  StopWatching();
  ++generation_;
  auto rd = client_.Get(keys_.round);
  auto as = client_.Get(keys_.Assign(node_id_));
  if (!rd.ok() || !as.ok()) {
    return Status::Unavailable("etcd could not be re-read after a broken watch");
  }
  const int64_t rev =
      std::max((*rd) ? (*rd)->mod_revision : 0, (*as) ? (*as)->mod_revision : 0);
  auto w1 = client_.StartWatch(keys_.round, Queued(false, rev + 1),
                               cb_.watch(Stream::kRound, generation_));
  auto w2 = client_.StartWatch(keys_.Assign(node_id_), Queued(false, rev + 1),
                               cb_.watch(Stream::kAssign, generation_));
  if (!BothCreated(w1, w2).ok()) return Status::Unavailable("watches could not be restarted");
  round_watch_ = std::move(*w1);
  assign_watch_ = std::move(*w2);
  return Reread{*rd, *as};
}

bool Registration::FollowCoordinator(const std::string& coordinator, int64_t after_revision) {
  if (coordinator == followed_) return false;
  followed_ = coordinator;
  if (coordinator.empty()) return false;   // the watch stays open for the next round
  int64_t after = after_revision;
  if (after == 0) {
    auto ck = client_.Get(keys_.Node(coordinator));
    if (!ck.ok()) {
      follow_after_ = std::numeric_limits<int64_t>::max();   // as before: no takeover from here
      return false;
    }
    if (!ck->has_value()) {
      follow_after_ = 0;
      return true;
    }
    after = (*ck)->mod_revision;
  }
  follow_after_ = after;
  if (FollowWatchCovers(follow_watch_, coordinator, after)) {
    return FollowedIsGone(follow_watch_, coordinator, after);
  }
  coordinator_watch_.reset();
  follow_watch_ = FollowWatch{coordinator, after, 0};
  const uint64_t gen = generation_;
  // Not waited for: its one event, a delete, is acted on only after the takeover steps.
  auto w = client_.StartWatch(
      keys_.Node(coordinator), Queued(false, after + 1),
      [deleted_cb = cb_.coordinator_deleted, gen, coordinator](const etcd::WatchUpdate& u) {
        if (!u.error.ok() || u.compacted) {
          deleted_cb(gen, coordinator, std::numeric_limits<int64_t>::max());
          return;
        }
        for (const auto& e : u.events) {
          if (e.type == etcd::WatchEvent::Type::kDelete) {
            deleted_cb(gen, coordinator, e.kv.mod_revision);
          }
        }
      });
  if (w.ok()) {
    coordinator_watch_ = std::move(*w);
  } else {
    follow_watch_ = FollowWatch{};
  }
  return false;
}

bool Registration::CoordinatorDeleted(const std::string& coordinator, int64_t revision) {
  if (follow_watch_.coordinator != coordinator) return false;   // an earlier watch's
  follow_watch_.deleted_at = std::max(follow_watch_.deleted_at, revision);
  // A broken watch delivers nothing more: the next follow starts a new one.
  if (revision == std::numeric_limits<int64_t>::max()) {
    follow_watch_.from = revision;
  }
  return FollowedIsGone(follow_watch_, followed_, follow_after_);
}

void Registration::StopWatching() {
  round_watch_.reset();
  assign_watch_.reset();
  coordinator_watch_.reset();
  follow_watch_ = FollowWatch{};
  followed_.clear();
  follow_after_ = 0;
}

void Registration::Fence() {
  kept_.Set(nullptr, true);   // first: from now on nothing of the old round is published
  StopWatching();
  lease_ = 0;
  ++generation_;
}

void Registration::Release() {
  if (lease_ != 0) {
    kept_.Set(nullptr, false);
    Status s = client_.LeaseRevoke(lease_);
    if (!s.ok() && !s.IsNotFound()) {
      EFDL_LOG_WARN("rdzv {}: could not revoke the lease (others will see it expire after "
                    "the TTL): {}", node_id_, s.ToString());
    }
    lease_ = 0;
  }
  kept_.Set(nullptr, false);
}

void KeptLease::Set(std::unique_ptr<etcd::LeaseKeeper> keeper, bool fenced) {
  std::unique_ptr<etcd::LeaseKeeper> old;
  MutexLock lock(mu_);
  old = std::move(keeper_);   // destroyed after the lock is released
  keeper_ = std::move(keeper);
  fenced_ = fenced;
  if (fenced) {
    fenced_at_wall_ =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
            .count();
  }
}

bool KeptLease::MayPublish(double committed_at) const {
  MutexLock lock(mu_);
  if (fenced_ || committed_at < fenced_at_wall_) return false;
  // Without a lease (before the first registration, after leaving) nothing newer can be fenced
  // against it; with one, only until its local expiry.
  return keeper_ == nullptr || std::chrono::steady_clock::now() < keeper_->expires_at();
}

}  // namespace efdl::rdzv
