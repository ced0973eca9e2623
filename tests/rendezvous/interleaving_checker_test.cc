// The interleaving checker of the round protocol (protocol.h, issue #30).
//
// It drives the real decisions - the coordinator's (coordination.h) and the node's
// (node_rules.h) - over a model of etcd, and explores the interleavings of small jobs: nodes
// joining, crashing (their lease ends a TTL later), restarting with new ids, leaving gracefully,
// their workers failing, the job suspended (`efdl suspend`, its agents leaving, `efdl resume`,
// new agents); watch events delivered in any order across watches and nodes, timers
// firing while events are still in flight. After each step it checks safety; after the faults
// of a schedule it runs the job fairly to quiescence and checks liveness.
//
// THE MODEL, and where it abstracts etcd and the agent:
//   - one revision per write or txn; keys carry create/mod revision and lease; a lease ends by an
//     explicit expiry event TTL after its node crashed (etcd's clock and ours are one);
//   - a watch delivers the events of one revision together and the revisions in order (etcd's
//     guarantee per watch); different watches, and different nodes, interleave freely. No
//     compaction and no broken watch (the resync path is not explored);
//   - an etcd call is atomic and instantaneous: no request fails or times out (etcd errors end
//     in a re-read in the real code, which is a state the model reaches by other means);
//   - time is logical milliseconds; timers (takeover steps, the liveness window, last call,
//     lease expiry) fire in deadline order but may fire while events are in flight (slow
//     watches). The spread of a non-deputy's takeover is chosen by the schedule;
//   - workers are a flag: a member's workers run until its round closes; when a member crashes,
//     the workers of the round's other members fail (their collective lost a peer), which the
//     schedule delivers at any later point; the job never completes. A suspended node stops
//     taking part at once and leaves (releases its lease) at any later point.
// The glue below (Apply, Register, TakeOver, the coordinator's execution) mirrors
// etcd_rendezvous_node.cc, etcd_rendezvous.cc and coordinator.cc call for call.
//
// CHECKED
//   safety, after every step: in every round, the nodes that took a member's place hold distinct
//     node ranks and disjoint rank ranges, and each holds that round's assignment; no node takes
//     a place in a round older than the round record it holds, and no node's started or acked
//     round goes back; etcd's round number never goes back;
//   liveness, after the faults: with at least MIN live nodes registered and no further faults,
//     a round forms in which every live node has a place (member or standby), within
//     2 x TTL + the takeover steps + 16 liveness windows + last call of logical time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "rendezvous/coordination.h"
#include "rendezvous/node_rules.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {
namespace {

using Ms = std::chrono::milliseconds;

// --- The model of etcd -------------------------------------------------------------------------

struct KV {
  std::string value;
  int64_t create_rev = 0, mod_rev = 0, lease = 0;
};
struct Change {
  int64_t rev = 0;
  std::string key;
  bool del = false;
  KV kv;
};
struct Op {
  bool del = false;
  std::string key, value;
  int64_t lease = 0;
};

struct Store {
  int64_t rev = 1;
  std::map<std::string, KV> kv;
  std::vector<Change> log;
  int64_t next_lease = 100;

  // All ops at one new revision; returns it.
  int64_t Apply(const std::vector<Op>& ops) {
    ++rev;
    for (const auto& op : ops) {
      if (op.del) {
        auto it = kv.find(op.key);
        if (it == kv.end()) continue;
        log.push_back({rev, op.key, true, it->second});
        kv.erase(it);
        continue;
      }
      auto it = kv.find(op.key);
      KV e;
      e.value = op.value;
      e.lease = op.lease;
      e.mod_rev = rev;
      e.create_rev = it == kv.end() ? rev : it->second.create_rev;
      kv[op.key] = e;
      log.push_back({rev, op.key, false, e});
    }
    return rev;
  }
  const KV* Get(const std::string& key) const {
    auto it = kv.find(key);
    return it == kv.end() ? nullptr : &it->second;
  }
  void Revoke(int64_t lease) {
    std::vector<Op> ops;
    for (const auto& [k, v] : kv) {
      if (v.lease == lease) ops.push_back({true, k, "", 0});
    }
    if (!ops.empty()) Apply(ops);
  }
};

// --- The world: nodes over the store ------------------------------------------------------------

struct Config {
  int min_nodes = 1, max_nodes = 3;
  int64_t ttl = 10000, step = 250, window = 400, last_call = 0;
};

enum class WatchKind { kRound, kAssign, kFollow, kNodes, kAcks };

struct Watch {
  int node = 0;
  WatchKind kind = WatchKind::kRound;
  std::string key;
  bool prefix = false;
  size_t pos = 0;   // the next log entry to look at
};

struct Node {
  std::string id;
  bool alive = true;       // false: crashed or left (acts no more)
  int64_t lease = 0;
  RoundRecord round;
  int64_t round_rev = 0;
  std::optional<AssignRecord> assign;
  NodePart part;
  Succession succession;
  std::string followed;
  int64_t follow_after = 0;   // deletions of followed's key after this revision count
  FollowWatch follow_watch;   // the kept watch of a coordinator's key (node_rules.h FollowWatch)
  std::optional<int64_t> takeover_at;
  bool coordinating = false;
  JobView view;
  bool running = false;           // its workers of part.started_round run
  std::optional<int64_t> failure;  // its workers failed in this round: to be reported
  bool leaving_suspended = false;  // saw the job suspended: stops its workers, then leaves
  int64_t max_started = 0, max_acked = 0;
};

class World {
 public:
  World(Config cfg, uint64_t seed) : cfg_(cfg), keys_("job"), rng_(seed) {}

  // --- faults and arrivals
  int Join() {
    Node n;
    n.id = "n" + std::to_string(next_id_++);
    n.part.self = n.id;
    nodes_.push_back(n);
    const int i = static_cast<int>(nodes_.size()) - 1;
    Register(i);
    Tail(i);
    return i;
  }
  void Crash(int i) {
    Node& n = nodes_[i];
    Trace("crash " + n.id);
    KillWorkersOfRound(i);
    n.alive = false;
    DropWatches(i);
    expiries_[now_ + cfg_.ttl].push_back(n.lease);
  }
  void Leave(int i) {
    Node& n = nodes_[i];
    Trace("leave " + n.id);
    n.coordinating = false;
    DropWatches(i);
    SendAck(i, AckState::kLeaving, n.round.round);
    HandOver(i);
    n.alive = false;
    store_.Revoke(n.lease);
  }
  // `efdl suspend` (suspend.cc MarkSuspended): CAS on P round, any phase but complete.
  bool Suspend() {
    const KV* r = store_.Get(keys_.round);
    if (!r) return false;
    const RoundRecord cur = *RoundRecord::Decode(r->value);
    if (cur.phase == Phase::kSuspended || cur.phase == Phase::kComplete) return false;
    RoundRecord next;
    next.round = cur.round;
    next.phase = Phase::kSuspended;
    next.graceful = true;
    store_.Apply({{false, keys_.round, next.Encode(), 0}});
    Trace("efdl suspend (round " + std::to_string(cur.round) + ")");
    return true;
  }
  // `efdl resume` (suspend.cc): once no agent is registered, gathering(r+1) without a
  // coordinator, and the assignments and acks of the suspended job deleted.
  bool Resume() {
    const KV* r = store_.Get(keys_.round);
    if (!r) return false;
    const RoundRecord cur = *RoundRecord::Decode(r->value);
    if (cur.phase != Phase::kSuspended) return false;
    std::vector<Op> ops;
    for (const auto& [k, v] : store_.kv) {
      if (k.rfind(keys_.nodes, 0) == 0) return false;   // "agents are still stopping"
      if (k.rfind(keys_.assign, 0) == 0 || k.rfind(keys_.ack, 0) == 0) {
        ops.push_back({true, k, "", 0});
      }
    }
    RoundRecord next;
    next.round = cur.round + 1;
    next.phase = Phase::kGathering;
    next.message = "resumed";
    ops.push_back({false, keys_.round, next.Encode(), 0});
    store_.Apply(ops);
    Trace("efdl resume: round " + std::to_string(next.round) + " gathering");
    return true;
  }
  bool Suspended() const {
    const KV* r = store_.Get(keys_.round);
    return r && RoundRecord::Decode(r->value)->phase == Phase::kSuspended;
  }

  void FailWorkers(int i) {   // its program failed by itself
    Trace("workers of " + nodes_[i].id + " fail");
    nodes_[i].failure = nodes_[i].part.started_round;
    nodes_[i].running = false;
    KillWorkersOfRound(i);
  }

  // --- the schedule's choices
  struct Choice {
    enum Kind { kDeliver, kReportFailure, kTimer, kLeaveSuspended } kind;
    size_t index = 0;
  };
  bool IsAckWatch(size_t wi) const { return watches_[wi].kind == WatchKind::kAcks; }
  std::vector<Choice> Enabled() const {
    std::vector<Choice> out;
    for (size_t w = 0; w < watches_.size(); ++w) {
      if (Pending(watches_[w])) out.push_back({Choice::kDeliver, w});
    }
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i].alive && nodes_[i].failure) out.push_back({Choice::kReportFailure, i});
      if (nodes_[i].alive && nodes_[i].leaving_suspended) {
        out.push_back({Choice::kLeaveSuspended, i});
      }
    }
    if (NextTimer()) out.push_back({Choice::kTimer, 0});
    return out;
  }
  void Do(const Choice& c) {
    switch (c.kind) {
      case Choice::kDeliver:
        Deliver(c.index);
        break;
      case Choice::kReportFailure:
        ReportFailure(static_cast<int>(c.index));
        break;
      case Choice::kTimer:
        FireTimers();
        break;
      case Choice::kLeaveSuspended: {   // its workers stopped: Leave() releases the lease
        Node& n = nodes_[c.index];
        Trace(n.id + " leaves the suspended job");
        n.alive = false;
        store_.Revoke(n.lease);
        break;
      }
    }
  }
  // Runs fairly (events first, timers when nothing is in flight) until nothing is left to do or
  // the limits; returns false if it hit a limit.
  bool RunFairly(int max_steps) {
    for (int s = 0; s < max_steps; ++s) {
      auto en = Enabled();
      if (en.empty()) return true;
      std::vector<Choice> events;
      for (const auto& c : en) {
        if (c.kind != Choice::kTimer) events.push_back(c);
      }
      if (!events.empty()) {
        Do(events[rng_() % events.size()]);
      } else {
        FireTimers();
      }
      CheckSafety();
      if (!violations_.empty()) return true;
    }
    return false;
  }

  // Delivers events and failure reports only, no timer: what happens at once.
  void RunEvents(int max_steps) {
    for (int s = 0; s < max_steps; ++s) {
      std::vector<Choice> events;
      for (const auto& c : Enabled()) {
        if (c.kind != Choice::kTimer) events.push_back(c);
      }
      if (events.empty()) return;
      Do(events[rng_() % events.size()]);
      CheckSafety();
    }
  }

  // --- checks
  void CheckSafety() {
    if (const KV* r = store_.Get(keys_.round)) {
      auto rec = RoundRecord::Decode(r->value);
      if (rec.ok()) {
        if (rec->round < max_round_) Violation("etcd's round went back");
        max_round_ = std::max(max_round_, rec->round);
      }
    }
    std::map<int64_t, std::set<int>> node_ranks;
    std::map<int64_t, std::vector<std::pair<int, int>>> ranges;
    for (auto& n : nodes_) {
      if (!n.alive) continue;
      if (n.part.started_round != 0) {
        if (n.part.started_round < n.max_started) Violation(n.id + " started an older round");
        if (n.part.started_round > n.round.round) {
          Violation(n.id + " runs a round newer than its record");
        }
        n.max_started = std::max(n.max_started, n.part.started_round);
      }
      if (n.part.acked_round < n.max_acked) Violation(n.id + "'s acked round went back");
      n.max_acked = std::max(n.max_acked, n.part.acked_round);
      if (n.part.started_round == 0 || n.part.started_standby) continue;
      if (!n.assign || n.assign->round != n.part.started_round || n.assign->standby) {
        Violation(n.id + " runs round " + std::to_string(n.part.started_round) +
                  " without its assignment");
        continue;
      }
      if (!node_ranks[n.part.started_round].insert(n.assign->node_rank).second) {
        Violation("two nodes hold node rank " + std::to_string(n.assign->node_rank) +
                  " in round " + std::to_string(n.part.started_round));
      }
      ranges[n.part.started_round].push_back({n.assign->rank_offset, 1});
    }
    for (auto& [r, v] : ranges) {
      std::sort(v.begin(), v.end());
      for (size_t k = 1; k < v.size(); ++k) {
        if (v[k].first < v[k - 1].first + v[k - 1].second) {
          Violation("overlapping ranks in round " + std::to_string(r));
        }
      }
    }
  }
  // After the faults: every live node has a place in the one active round.
  void CheckFormed(int64_t since) {
    std::vector<const Node*> live;
    for (const auto& n : nodes_) {
      if (n.alive) live.push_back(&n);
    }
    if (static_cast<int>(live.size()) < cfg_.min_nodes) return;
    const KV* r = store_.Get(keys_.round);
    auto rec = r ? RoundRecord::Decode(r->value) : Result<RoundRecord>(Status::NotFound("none"));
    if (!rec.ok() || rec->phase != Phase::kActive) {
      Violation("no round formed after the faults: etcd's round is " +
                (rec.ok() ? std::to_string(rec->round) + " " + PhaseName(rec->phase)
                          : std::string("missing")));
      return;
    }
    int members = 0;
    for (const Node* n : live) {
      if (n->part.started_round != rec->round) {
        Violation(n->id + " has no place in the active round " + std::to_string(rec->round));
      } else if (!n->part.started_standby) {
        ++members;
      }
    }
    if (members != std::min<int>(static_cast<int>(live.size()), cfg_.max_nodes)) {
      Violation("round " + std::to_string(rec->round) + " has " + std::to_string(members) +
                " members of " + std::to_string(live.size()) + " live nodes");
    }
    const int64_t bound = 2 * cfg_.ttl +
                          (static_cast<int64_t>(kMaxDeputies) + kSpreadSteps + 1) * cfg_.step +
                          16 * cfg_.window + cfg_.last_call;
    if (formed_at_ - since > bound) {
      Violation("the round formed " + std::to_string(formed_at_ - since) +
                " ms after the last fault (bound " + std::to_string(bound) + " ms)");
    }
  }

  const std::vector<std::string>& violations() const { return violations_; }
  const std::vector<std::string>& trace() const { return trace_; }
  std::vector<Node>& nodes() { return nodes_; }
  int64_t now() const { return now_; }
  std::mt19937_64& rng() { return rng_; }
  int LiveCount() const {
    int c = 0;
    for (const auto& n : nodes_) c += n.alive ? 1 : 0;
    return c;
  }

 private:
  CoordinatorConfig CoordCfg(const Node& n) const {
    CoordinatorConfig c;
    c.job_id = "job";
    c.node_id = n.id;
    c.min_nodes = cfg_.min_nodes;
    c.max_nodes = cfg_.max_nodes;
    c.last_call = Ms(cfg_.last_call);
    c.liveness_window = Ms(cfg_.window);
    return c;
  }
  CoordTime T() const { return CoordTime{} + Ms(now_); }
  void Trace(const std::string& s) { trace_.push_back("t=" + std::to_string(now_) + " " + s); }
  void Violation(const std::string& s) { violations_.push_back(s); }

  // --- watches
  // A watch of the changes after revision `after` (default: from now on).
  void AddWatch(int node, WatchKind kind, const std::string& key, bool prefix,
                int64_t after = -1) {
    size_t pos = store_.log.size();
    if (after >= 0) {
      pos = 0;
      while (pos < store_.log.size() && store_.log[pos].rev <= after) ++pos;
    }
    watches_.push_back({node, kind, key, prefix, pos});
  }
  void DropWatches(int node, std::optional<WatchKind> kind = std::nullopt) {
    std::erase_if(watches_, [&](const Watch& w) {
      return w.node == node && (!kind || w.kind == *kind);
    });
    if (!kind || *kind == WatchKind::kFollow) nodes_[node].follow_watch = FollowWatch{};
  }
  bool Matches(const Watch& w, const Change& c) const {
    return w.prefix ? c.key.rfind(w.key, 0) == 0 : c.key == w.key;
  }
  bool Pending(const Watch& w) const {
    for (size_t p = w.pos; p < store_.log.size(); ++p) {
      if (Matches(w, store_.log[p])) return true;
    }
    return false;
  }
  void Deliver(size_t wi) {
    Watch w = watches_[wi];
    std::vector<Change> batch;
    size_t p = w.pos;
    while (p < store_.log.size() && !Matches(w, store_.log[p])) ++p;
    const int64_t rev = store_.log[p].rev;
    while (p < store_.log.size() && store_.log[p].rev == rev) {
      if (Matches(w, store_.log[p])) batch.push_back(store_.log[p]);
      ++p;
    }
    watches_[wi].pos = p;
    const int i = w.node;
    Node& n = nodes_[i];
    switch (w.kind) {
      case WatchKind::kRound:
        for (const auto& c : batch) {
          if (c.del) continue;
          auto rec = RoundRecord::Decode(c.kv.value);
          if (rec.ok()) Apply(i, *rec, c.kv.mod_rev);
        }
        break;
      case WatchKind::kAssign:
        for (const auto& c : batch) {
          if (c.del) continue;
          auto rec = AssignRecord::Decode(c.kv.value);
          if (rec.ok() && (!n.assign || rec->round >= n.assign->round)) n.assign = *rec;
        }
        TryStart(i);
        break;
      case WatchKind::kFollow:   // Registration::CoordinatorDeleted
        for (const auto& c : batch) {
          if (!c.del) continue;
          n.follow_watch.deleted_at = std::max(n.follow_watch.deleted_at, c.rev);
          if (FollowedIsGone(n.follow_watch, n.followed, n.follow_after)) {
            OnCoordinatorGone(i, n.followed);
          }
        }
        break;
      case WatchKind::kNodes:
        for (const auto& c : batch) {
          const std::string id = c.key.substr(keys_.nodes.size());
          if (!n.coordinating) break;
          if (c.del) {
            Execute(i, OnNodeGone(n.view, n.round, id));
          } else if (auto rec = NodeRecord::Decode(c.kv.value); rec.ok()) {
            Execute(i, OnNodeRegistered(n.view, n.round, id, {c.kv.create_rev, *rec},
                                        CoordCfg(n)));
          }
        }
        break;
      case WatchKind::kAcks:
        for (const auto& c : batch) {
          const std::string id = c.key.substr(keys_.ack.size());
          if (!n.coordinating) break;
          if (c.del) {
            OnAckDeleted(n.view, id);
          } else if (auto rec = AckRecord::Decode(c.kv.value); rec.ok()) {
            Execute(i, OnAck(n.view, n.round, id, *rec, CoordCfg(n), T()));
          }
        }
        break;
    }
    Tail(i);
  }

  // The driver loop's tail after each batch of inputs: due timers, then the coordinator's step.
  void Tail(int i) {
    Node& n = nodes_[i];
    if (!n.alive || n.leaving_suspended) return;
    if (n.takeover_at && now_ >= *n.takeover_at) {
      n.takeover_at.reset();
      TakeOver(i);
    }
    CoordStep(i);
  }

  // --- timers
  std::optional<int64_t> NextTimer() const {
    std::optional<int64_t> t;
    auto take = [&](std::optional<int64_t> x) {
      if (x && (!t || *x < *t)) t = x;
    };
    if (!expiries_.empty()) take(expiries_.begin()->first);
    for (const auto& n : nodes_) {
      if (!n.alive) continue;
      take(n.takeover_at);
      if (n.coordinating) {
        if (auto d = NextCoordinatorDeadline(n.view, n.round, CoordCfg(n))) {
          take(std::chrono::duration_cast<Ms>(d->time_since_epoch()).count());
        }
      }
    }
    return t;
  }
  void FireTimers() {
    auto t = NextTimer();
    if (!t) return;
    now_ = std::max(now_, *t);
    while (!expiries_.empty() && expiries_.begin()->first <= now_) {
      for (int64_t lease : expiries_.begin()->second) {
        Trace("lease " + std::to_string(lease) + " expires");
        store_.Revoke(lease);
      }
      expiries_.erase(expiries_.begin());
    }
    for (size_t i = 0; i < nodes_.size(); ++i) Tail(static_cast<int>(i));
  }

  // --- the node (etcd_rendezvous_node.cc)
  void Register(int i) {
    Node& n = nodes_[i];
    n.lease = ++store_.next_lease;
    store_.Apply({{false, keys_.Node(n.id), NodeRecord{"127.0.0.1", 1, "", ""}.Encode(), n.lease}});
    RoundRecord round;
    int64_t round_rev = 0;
    if (const KV* r = store_.Get(keys_.round)) {
      round = *RoundRecord::Decode(r->value);
      round_rev = r->mod_rev;
      if (round.phase == Phase::kSuspended) {   // Open refuses: the attempt leaves nothing
        Trace("join " + n.id + " refused: the job is suspended");
        store_.Revoke(n.lease);
        n.alive = false;
        return;
      }
    } else {
      round.round = 1;
      round.phase = Phase::kGathering;
      round.coordinator = n.id;
      round.message = "job started";
      round_rev = store_.Apply({{false, keys_.round, round.Encode(), 0}});
    }
    Trace("join " + n.id + " (round " + std::to_string(round.round) + " " +
          PhaseName(round.phase) + ")");
    AddWatch(i, WatchKind::kRound, keys_.round, false);
    AddWatch(i, WatchKind::kAssign, keys_.Assign(n.id), false);
    Apply(i, round, round_rev);
    if (n.round.coordinator != n.id && n.round.phase != Phase::kComplete &&
        !store_.Get(keys_.Node(n.round.coordinator))) {
      TakeOver(i);
    }
  }

  void Apply(int i, const RoundRecord& rec, int64_t rev) {
    Node& n = nodes_[i];
    if (!n.alive || rev <= n.round_rev) return;
    const int64_t held_round = n.round_rev == 0 ? 0 : n.round.round;
    n.round = rec;
    n.round_rev = rev;
    if (rec.phase == Phase::kSuspended) {   // OnSuspended: out of every round, then leave
      CoordStop(i);
      DropWatches(i);
      n.followed.clear();
      n.takeover_at.reset();
      n.part.started_round = 0;
      n.part.started_standby = false;
      n.running = false;
      n.failure.reset();
      n.leaving_suspended = true;
      return;
    }
    if (ClosesStartedRound(rec, n.part)) {
      n.part.started_round = 0;
      n.part.started_standby = false;
      n.running = false;
      n.failure.reset();
    }
    if (ShouldAck(rec, n.part) || AnnouncesLate(held_round, rec, n.part)) {
      SendAck(i, AckState::kAck, rec.round);
    }
    if (rec.coordinator == n.id && !n.coordinating) {
      CoordStart(i);
    } else if (rec.coordinator != n.id && n.coordinating) {
      CoordStop(i);
    }
    TryStart(i);
    UpdateFollow(i);
  }

  void TryStart(int i) {
    Node& n = nodes_[i];
    if (!MayStart(n.round, n.assign, n.part)) return;
    n.part.started_round = n.round.round;
    n.part.started_standby = n.assign->standby;
    n.running = !n.assign->standby;
    if (!n.assign->standby) formed_at_ = now_;
    Trace(n.id + " starts round " + std::to_string(n.round.round) +
          (n.assign->standby ? " (standby)" : ""));
    UpdateFollow(i);
  }

  void SendAck(int i, AckState state, int64_t round) {
    Node& n = nodes_[i];
    AckRecord ack;
    ack.round = round;
    ack.state = state;
    if (state == AckState::kAck) {
      ack.port = static_cast<uint16_t>(20000 + i);
      n.part.acked_round = round;
    }
    store_.Apply({{false, keys_.Ack(n.id), ack.Encode(), n.lease}});
  }

  // UpdateDeputyWatch and Registration::FollowCoordinator: the watch of a coordinator's key
  // stays open when the node stops following and serves again when it covers the revision the
  // node follows from.
  void UpdateFollow(int i) {
    Node& n = nodes_[i];
    n.succession = WhomToFollow(n.round, n.part);
    if (n.succession.follow == n.followed) return;
    n.takeover_at.reset();
    n.followed = n.succession.follow;
    if (n.followed.empty()) return;
    int64_t after = n.round_rev;   // spread: from the round record's revision, without a read
    if (!n.succession.spread) {
      const KV* key = store_.Get(keys_.Node(n.followed));
      if (!key) {
        n.follow_after = 0;
        OnCoordinatorGone(i, n.followed);
        return;
      }
      after = key->mod_rev;
    }
    n.follow_after = after;
    if (FollowWatchCovers(n.follow_watch, n.followed, after)) {
      if (FollowedIsGone(n.follow_watch, n.followed, after)) OnCoordinatorGone(i, n.followed);
      return;
    }
    DropWatches(i, WatchKind::kFollow);
    n.follow_watch = FollowWatch{n.followed, after, 0};
    AddWatch(i, WatchKind::kFollow, keys_.Node(n.followed), false, after);
  }

  void OnCoordinatorGone(int i, const std::string& coordinator) {
    Node& n = nodes_[i];
    if (coordinator != n.followed || n.round.coordinator != coordinator || n.takeover_at) return;
    int64_t delay = n.succession.after_steps * cfg_.step;
    if (n.succession.spread) delay += static_cast<int64_t>(rng_() % (kSpreadSteps + 1)) * cfg_.step;
    n.takeover_at = now_ + delay;
  }

  void TakeOver(int i) {
    Node& n = nodes_[i];
    const KV* r = store_.Get(keys_.round);
    if (!r) return;
    RoundRecord rec = *RoundRecord::Decode(r->value);
    const int64_t rev = r->mod_rev;
    if (rec.phase == Phase::kComplete || rec.coordinator == n.id) return;
    if (rec.phase == Phase::kSuspended || store_.Get(keys_.Node(rec.coordinator))) {
      Apply(i, rec, rev);
      return;
    }
    const RoundRecord next = TakeOverRecord(rec, n.id);
    if (CasAt(i, next, rev)) {
      Trace(n.id + " takes over from " + rec.coordinator + ": round " +
            std::to_string(next.round) + " " + PhaseName(next.phase));
    } else {
      Reread(i);
    }
  }

  bool CasAt(int i, const RoundRecord& rec, int64_t expect) {
    const KV* r = store_.Get(keys_.round);
    if (!r || r->mod_rev != expect) return false;
    const int64_t rev = store_.Apply({{false, keys_.round, rec.Encode(), 0}});
    Apply(i, rec, rev);
    return true;
  }
  void Reread(int i) {
    if (const KV* r = store_.Get(keys_.round)) Apply(i, *RoundRecord::Decode(r->value), r->mod_rev);
  }

  void ReportFailure(int i) {
    Node& n = nodes_[i];
    const int64_t round = *n.failure;
    n.failure.reset();
    n.running = false;
    Trace(n.id + " reports its workers failed in round " + std::to_string(round));
    if (round < n.part.acked_round) return;
    SendAck(i, AckState::kFailed, round);
    if (n.round.round == round && n.round.phase == Phase::kActive) {
      if (!CasAt(i, FailureProposal(n.round, n.id, "a collective failed"), n.round_rev)) Reread(i);
    }
    Tail(i);
  }

  // The peers of node i's running round lose a collective partner.
  void KillWorkersOfRound(int i) {
    const Node& x = nodes_[i];
    if (!x.running) return;
    for (auto& m : nodes_) {
      if (&m != &x && m.alive && m.running && m.part.started_round == x.part.started_round) {
        m.running = false;
        m.failure = m.part.started_round;
      }
    }
  }

  void HandOver(int i) {
    Node& n = nodes_[i];
    const KV* r = store_.Get(keys_.round);
    if (!r) return;
    RoundRecord rec = *RoundRecord::Decode(r->value);
    if (rec.coordinator != n.id || rec.phase == Phase::kComplete) return;
    for (const auto& d : rec.deputies) {
      if (d == n.id || !store_.Get(keys_.Node(d))) continue;
      store_.Apply({{false, keys_.round, HandOverRecord(rec, n.id, d).Encode(), 0}});
      Trace(n.id + " hands over to " + d);
      return;
    }
  }

  // --- the coordinator (coordinator.cc)
  void CoordStart(int i) {
    Node& n = nodes_[i];
    JobSnapshot snap;
    for (const auto& [k, v] : store_.kv) {
      if (k.rfind(keys_.nodes, 0) == 0) {
        snap.nodes.push_back({k.substr(keys_.nodes.size()),
                              {v.create_rev, *NodeRecord::Decode(v.value)}});
      } else if (k.rfind(keys_.ack, 0) == 0) {
        snap.acks.push_back({k.substr(keys_.ack.size()), *AckRecord::Decode(v.value)});
      } else if (k.rfind(keys_.assign, 0) == 0) {
        snap.assigns.push_back({k.substr(keys_.assign.size()), v.mod_rev,
                                *AssignRecord::Decode(v.value)});
      }
    }
    n.view = LoadJob(snap, n.round, CoordCfg(n), T());
    AddWatch(i, WatchKind::kNodes, keys_.nodes, true);
    AddWatch(i, WatchKind::kAcks, keys_.ack, true);
    n.coordinating = true;
  }
  void CoordStop(int i) {
    nodes_[i].coordinating = false;
    DropWatches(i, WatchKind::kNodes);
    DropWatches(i, WatchKind::kAcks);
  }
  void Execute(int i, const EventOutcome& out) {
    for (const auto& id : out.make_standby) {
      Node& n = nodes_[i];
      const KV* r = store_.Get(keys_.round);
      if (!r || r->mod_rev != n.round_rev) {
        Reread(i);
        continue;
      }
      AssignRecord a{n.round.round, 0, 0, true};
      store_.Apply({{false, keys_.Assign(id), a.Encode(), 0}});
      StandbyAssigned(n.view, id, CoordCfg(n));
    }
  }
  void CoordStep(int i) {
    Node& n = nodes_[i];
    if (!n.alive || !n.coordinating) return;
    const StepAction act = DecideStep(n.view, n.round, CoordCfg(n), T());
    switch (act.kind) {
      case StepAction::Kind::kNone:
      case StepAction::Kind::kComplete:
        return;
      case StepAction::Kind::kSetDeputies: {
        RoundRecord next = n.round;
        next.deputies = act.deputies;
        if (!CasAt(i, next, n.round_rev)) Reread(i);
        return;
      }
      case StepAction::Kind::kPropose: {
        const RoundRecord next = BeginProposal(n.view, n.round, CoordCfg(n), act.graceful, act.why);
        if (CasAt(i, next, n.round_rev)) {
          n.view.last_progress = T();
          Trace(n.id + " proposes round " + std::to_string(next.round) + ": " + act.why);
        } else {
          Reread(i);
        }
        return;
      }
      case StepAction::Kind::kFinalize:
        Finalize(i);
        return;
    }
  }
  void Finalize(int i) {
    Node& n = nodes_[i];
    n.view.last_progress = T();
    const FinalizeAction act = DecideFinalize(n.view, n.round, CoordCfg(n));
    if (act.kind == FinalizeAction::Kind::kWait) return;
    if (act.kind == FinalizeAction::Kind::kNotFormed) {
      Trace(n.id + ": " + act.history);
      if (!CasAt(i, act.next, n.round_rev)) Reread(i);
      return;
    }
    const KV* r = store_.Get(keys_.round);
    if (!r || r->mod_rev != n.round_rev) {
      Reread(i);
      return;
    }
    // coordinator.cc sends these in txns of 127, several at once, each guarded by the same round
    // revision, and writes the active record only after every one succeeded. Modelled as one
    // step: a batch whose compare held was applied while the round record was the one checked
    // here, and any batch applied after a competing write of it fails its compare, so the
    // batches that land are, in etcd's order, all before that write (sent one after another,
    // they were a prefix; sent together, any subset). Either way the rest is assignments of a
    // round whose active record is never written, which no node starts (MayStart needs both);
    // this model leaves such partial writes out, as it did when they were sent in order.
    std::vector<Op> ops;
    for (const auto& [id, a] : act.writes) ops.push_back({false, keys_.Assign(id), a.Encode(), 0});
    for (const auto& id : act.stale) ops.push_back({true, keys_.Assign(id), "", 0});
    if (!ops.empty()) store_.Apply(ops);
    AssignmentsWritten(n.view, act);
    Trace(n.id + ": " + act.history);
    if (!CasAt(i, act.next, n.round_rev)) Reread(i);
  }

  Config cfg_;
  JobKeys keys_;
  std::mt19937_64 rng_;
  Store store_;
  std::vector<Node> nodes_;
  std::vector<Watch> watches_;
  std::map<int64_t, std::vector<int64_t>> expiries_;   // when -> leases that end then
  int64_t now_ = 0;
  int next_id_ = 1;
  int64_t max_round_ = 0;
  int64_t formed_at_ = 0;
  std::vector<std::string> trace_;
  std::vector<std::string> violations_;
};

std::string Dump(World& w) {
  std::string out;
  for (const auto& v : w.violations()) out += "VIOLATION: " + v + "\n";
  for (const auto& t : w.trace()) out += "  " + t + "\n";
  for (const auto& n : w.nodes()) {
    out += "  node " + n.id + (n.alive ? "" : " (gone)") + ": holds round " +
           std::to_string(n.round.round) + " " + PhaseName(n.round.phase) + " of " +
           n.round.coordinator + ", acked " + std::to_string(n.part.acked_round) + ", started " +
           std::to_string(n.part.started_round) + (n.part.started_standby ? " standby" : "") +
           ", assign " + (n.assign ? std::to_string(n.assign->round) : "-") +
           (n.coordinating ? ", coordinating" : "") + ", follows '" + n.followed + "'\n";
  }
  return out;
}

// --- Schedules found failing, kept as regular cases ---------------------------------------------

// Issue #30: the coordinator of a 2-node job is killed; the other node's workers fail and it
// proposes round 2 as coordinator; it is killed too; two new nodes join while its lease lives.
// Before the fix nobody followed the proposal's coordinator: the job waited for ever.
TEST(InterleavingChecker, WholeJobRestartedWithinTheTtlDuringAProposalForms) {
  Config cfg;
  cfg.min_nodes = 2;
  cfg.max_nodes = 3;
  World w(cfg, 1);
  const int a = w.Join();
  const int b = w.Join();
  ASSERT_TRUE(w.RunFairly(10000));
  w.CheckFormed(0);
  ASSERT_TRUE(w.violations().empty()) << Dump(w);
  w.Crash(a);
  w.RunEvents(10000);   // b reports its workers' failure and proposes round 2 as coordinator
  ASSERT_EQ(w.nodes()[b].round.coordinator, w.nodes()[b].id) << Dump(w);
  ASSERT_EQ(w.nodes()[b].round.phase, Phase::kProposed) << Dump(w);
  w.Crash(b);
  const int64_t restart = w.now();
  w.Join();
  w.Join();
  ASSERT_TRUE(w.RunFairly(10000));
  w.CheckFormed(restart);
  EXPECT_TRUE(w.violations().empty()) << Dump(w);
}

// Issue #37: a member that runs its place follows nobody but keeps its watch of the
// coordinator's key; at the next proposal it follows the same coordinator through that watch
// (no new one), and when the coordinator and every deputy die during that proposal the kept
// watch's deletion makes it take over: the job forms.
TEST(InterleavingChecker, AMemberFollowsThroughItsKeptWatchAndTakesOverFromADeadProposal) {
  Config cfg;
  cfg.min_nodes = 2;
  cfg.max_nodes = 8;
  World w(cfg, 7);
  for (int k = 0; k < 6; ++k) w.Join();
  ASSERT_TRUE(w.RunFairly(20000));
  w.CheckFormed(0);
  ASSERT_TRUE(w.violations().empty()) << Dump(w);
  const RoundRecord formed = w.nodes()[0].round;
  std::vector<int> others;   // the members that are neither the coordinator nor a deputy
  for (size_t i = 0; i < w.nodes().size(); ++i) {
    const Node& n = w.nodes()[i];
    const bool deputy = std::find(formed.deputies.begin(), formed.deputies.end(), n.id) !=
                        formed.deputies.end();
    if (n.id != formed.coordinator && !deputy) others.push_back(static_cast<int>(i));
  }
  ASSERT_FALSE(others.empty()) << Dump(w);
  for (int i : others) {
    ASSERT_TRUE(w.nodes()[i].followed.empty()) << Dump(w);
    ASSERT_EQ(w.nodes()[i].follow_watch.coordinator, formed.coordinator) << Dump(w);
  }
  const int64_t kept_from = w.nodes()[others[0]].follow_watch.from;
  // A newcomer: the coordinator proposes the next round. Deliver every event but the acks (so
  // the proposal stays open) until every node holds the proposal (their round-1 workers
  // stopped: no failure report).
  const int newcomer = w.Join();
  auto holds_proposal = [&](const Node& n) {
    return n.round.round == formed.round + 1 && n.round.phase == Phase::kProposed;
  };
  for (int step = 0; step < 20000; ++step) {
    bool all = true;
    for (const auto& n : w.nodes()) all = all && holds_proposal(n);
    if (all) break;
    std::vector<World::Choice> rounds;
    for (const auto& c : w.Enabled()) {
      if (c.kind == World::Choice::kDeliver && !w.IsAckWatch(c.index)) rounds.push_back(c);
    }
    ASSERT_FALSE(rounds.empty()) << Dump(w);
    w.Do(rounds.front());
  }
  const Node& x = w.nodes()[others[0]];
  ASSERT_TRUE(holds_proposal(x)) << Dump(w);
  ASSERT_EQ(x.followed, formed.coordinator) << Dump(w);
  // Crash the coordinator and the deputies during the proposal: only the members that follow it
  // from the round record (through their kept watch) and the newcomer can take over.
  for (size_t i = 0; i < w.nodes().size(); ++i) {
    const Node& n = w.nodes()[i];
    const bool deputy = std::find(formed.deputies.begin(), formed.deputies.end(), n.id) !=
                        formed.deputies.end();
    if (n.id == formed.coordinator || deputy) w.Crash(static_cast<int>(i));
  }
  EXPECT_EQ(x.follow_watch.from, kept_from) << "the kept watch, not a new one\n" << Dump(w);
  const int64_t crashed = w.now();
  ASSERT_TRUE(w.RunFairly(20000));
  w.CheckFormed(crashed);
  EXPECT_TRUE(w.violations().empty()) << Dump(w);
  const std::string now_coordinating = w.nodes()[newcomer].round.coordinator;
  EXPECT_NE(now_coordinating, formed.coordinator) << Dump(w);
}

// --- The random walk ---------------------------------------------------------------------------

struct WalkLimits {
  int max_nodes_ever = 5;
  int faults = 4;
  int steps_between_faults = 12;
};

// One schedule: a job of `initial` nodes, then `faults` faults at random points, each after a
// random number of random steps (any enabled event or timer), then a fair run to quiescence.
void Walk(uint64_t seed, const Config& cfg, int initial, const WalkLimits& lim,
          std::string* failure) {
  World w(cfg, seed);
  std::mt19937_64& rng = w.rng();
  for (int k = 0; k < initial; ++k) w.Join();
  int joined = initial;
  int64_t last_fault = 0;
  for (int f = 0; f < lim.faults; ++f) {
    const int steps = static_cast<int>(rng() % (lim.steps_between_faults + 1));
    for (int s = 0; s < steps; ++s) {
      auto en = w.Enabled();
      if (en.empty()) break;
      w.Do(en[rng() % en.size()]);
      w.CheckSafety();
    }
    std::vector<int> live;
    for (size_t i = 0; i < w.nodes().size(); ++i) {
      if (w.nodes()[i].alive) live.push_back(static_cast<int>(i));
    }
    const int kind = static_cast<int>(rng() % 9);
    if (kind == 8) {
      w.Suspend();
    } else if ((kind % 4 == 0 || live.empty()) && joined < lim.max_nodes_ever) {
      w.Join();
      ++joined;
    } else if (!live.empty()) {
      const int i = live[rng() % live.size()];
      if (kind % 4 == 1) {
        w.Crash(i);
      } else if (kind % 4 == 2) {
        w.Leave(i);
      } else if (w.nodes()[i].running) {
        w.FailWorkers(i);
      } else {
        w.Crash(i);
      }
    }
    last_fault = w.now();
    w.CheckSafety();
  }
  // A suspended job: its agents leave, then `efdl resume` and new agents.
  if (w.Suspended()) {
    if (!w.RunFairly(20000)) {
      *failure = "no quiescence after a suspend within 20000 steps\n" + Dump(w);
      return;
    }
    if (!w.Resume()) {
      *failure = "the suspended job could not be resumed (an agent stayed registered)\n" + Dump(w);
      return;
    }
    joined = 0;
  }
  // Top the job up to MIN with newcomers, as an orchestrator restarting pods would.
  while (w.LiveCount() < cfg.min_nodes && joined < lim.max_nodes_ever + cfg.min_nodes) {
    w.Join();
    ++joined;
    last_fault = w.now();
  }
  if (!w.RunFairly(20000)) {
    *failure = "no quiescence within 20000 steps (a livelock)\n" + Dump(w);
    return;
  }
  w.CheckFormed(last_fault);
  if (!w.violations().empty()) *failure = "seed " + std::to_string(seed) + "\n" + Dump(w);
}

uint64_t SchedulesFromEnv(uint64_t fallback) {
  if (const char* s = std::getenv("EFDL_CHECKER_SCHEDULES")) return std::stoull(s);
  return fallback;
}

TEST(InterleavingChecker, RandomSchedulesOfSmallJobsAreSafeAndForm) {
  const uint64_t schedules = SchedulesFromEnv(40000);
  struct Shape {
    int min, max, initial;
  };
  const Shape shapes[] = {{1, 2, 2}, {2, 3, 2}, {2, 3, 3}, {3, 4, 4}, {1, 1, 2}};
  uint64_t run = 0;
  for (uint64_t s = 0; s < schedules; ++s) {
    const Shape& sh = shapes[s % std::size(shapes)];
    Config cfg;
    cfg.min_nodes = sh.min;
    cfg.max_nodes = sh.max;
    cfg.last_call = (s / std::size(shapes)) % 3 == 0 ? 300 : 0;
    std::string failure;
    Walk(s, cfg, sh.initial, {}, &failure);
    ++run;
    ASSERT_TRUE(failure.empty()) << "schedule " << s << " (MIN " << sh.min << ", MAX " << sh.max
                                 << ", " << sh.initial << " nodes) failed:\n"
                                 << failure;
  }
  RecordProperty("schedules", std::to_string(run));
}

}  // namespace
}  // namespace efdl::rdzv
