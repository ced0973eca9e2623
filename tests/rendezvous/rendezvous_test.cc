// The rendezvous protocol end to end on the in-memory etcd: many agents' Rendezvous objects in
// one process, each behind its own CuttableClient so a test can make one node vanish (crash or
// partition) while its lease lives on until its TTL.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "common/log.h"
#include "rendezvous/job_status.h"
#include "rendezvous/node_books.h"
#include "rendezvous/protocol.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/rendezvous.h"
#include "support/memory_etcd.h"
#include "support/rendezvous_events.h"

namespace efdl::rdzv {
namespace {

using namespace std::chrono_literals;
using testing::MemoryEtcd;
using Clock = std::chrono::steady_clock;

// Forwards to a shared client until Cut(): then every call fails and no watch delivers, as for a
// node whose machine froze or whose network went.
class CuttableClient final : public etcd::Client {
 public:
  explicit CuttableClient(etcd::Client& inner) : inner_(inner), cut_(std::make_shared<std::atomic<bool>>(false)) {}
  void Cut() { *cut_ = true; }

  Result<etcd::RangeResult> Range(const std::string& k, const etcd::RangeOptions& o) override {
    if (*cut_) return Down();
    if (o.count_only && k.ends_with("/nodes/")) ++node_counts_;
    return inner_.Range(k, o);
  }
  // The counts of the job's registered nodes this node asked for (O(N) each in etcd 3.4).
  int node_counts() const { return node_counts_; }
  Result<std::optional<etcd::KeyValue>> Get(const std::string& k) override {
    if (*cut_) return Down();
    return inner_.Get(k);
  }
  Result<etcd::PutResult> Put(const std::string& k, const std::string& v, int64_t l) override {
    if (*cut_) return Down();
    return inner_.Put(k, v, l);
  }
  Result<etcd::DeleteResult> Delete(const std::string& k, bool p) override {
    if (*cut_) return Down();
    return inner_.Delete(k, p);
  }
  Result<etcd::TxnResult> Txn(const std::vector<etcd::Compare>& c, const std::vector<etcd::TxnOp>& t,
                              const std::vector<etcd::TxnOp>& o) override {
    if (*cut_) return Down();
    return inner_.Txn(c, t, o);
  }
  Result<etcd::LeaseGrantResult> LeaseGrant(int64_t ttl) override {
    if (*cut_) return Down();
    return inner_.LeaseGrant(ttl);
  }
  Status LeaseRevoke(int64_t id) override { return *cut_ ? Down() : inner_.LeaseRevoke(id); }
  Result<int64_t> LeaseTimeToLive(int64_t id) override {
    if (*cut_) return Down();
    return inner_.LeaseTimeToLive(id);
  }
  Result<std::unique_ptr<etcd::LeaseKeeper>> KeepAlive(int64_t id,
                                                       std::function<void()> on_lost) override {
    if (*cut_) return Down();
    return inner_.KeepAlive(id, std::move(on_lost));
  }
  Result<std::unique_ptr<etcd::Watch>> StartWatch(const std::string& k, const etcd::WatchOptions& o,
                                                  etcd::WatchCallback cb) override {
    if (*cut_) return Down();
    const bool round_key = k.ends_with("/round");
    return inner_.StartWatch(k, o, [cut = cut_, held = held_, round_key, cb](const etcd::WatchUpdate& u) {
      if (*cut) return;
      if (round_key) {
        std::lock_guard<std::mutex> lock(held->mu);
        if (held->on) {
          held->updates.push_back({cb, u});
          return;
        }
      }
      cb(u);
    });
  }
  // Delays the updates of the node's round-record watch (a slow watch) until HoldRoundWatch(false),
  // which delivers them in order.
  void HoldRoundWatch(bool on) {
    std::vector<std::pair<etcd::WatchCallback, etcd::WatchUpdate>> late;
    {
      std::lock_guard<std::mutex> lock(held_->mu);
      held_->on = on;
      if (!on) late.swap(held_->updates);
    }
    for (auto& [cb, u] : late) cb(u);
  }

 private:
  struct Held {
    std::mutex mu;
    bool on = false;
    std::vector<std::pair<etcd::WatchCallback, etcd::WatchUpdate>> updates;
  };
  static Status Down() { return Status::Unavailable("test: node cut off"); }
  etcd::Client& inner_;
  std::shared_ptr<std::atomic<bool>> cut_;
  std::shared_ptr<Held> held_ = std::make_shared<Held>();
  std::atomic<int> node_counts_{0};
};

RendezvousOptions Opts(const std::string& node, int min, int max) {
  return testing::FastRendezvousOptions("job1", node, min, max);
}

struct Node {
  Node(MemoryEtcd& db, RendezvousOptions o) : client(db), id(o.node_id) {
    rdzv = NewEtcdRendezvous(client, std::move(o));
  }
  // The next event of `type` within `timeout`; other events on the way are kept in `seen`.
  std::optional<Event> Next(Event::Type type, std::chrono::milliseconds timeout = 5s) {
    return testing::NextEvent(*rdzv, type, timeout, &seen);
  }
  std::optional<Event> Started(std::chrono::milliseconds timeout = 5s) {
    return Next(Event::Type::kRoundStarted, timeout);
  }
  CuttableClient client;
  std::string id;
  std::unique_ptr<Rendezvous> rdzv;
  std::vector<Event> seen;
};

// `before_join`: what the agent tells the rendezvous before it joins (its agent store).
std::unique_ptr<Node> Start(MemoryEtcd& db, RendezvousOptions o,
                            const std::function<void(Rendezvous&)>& before_join = {}) {
  auto n = std::make_unique<Node>(db, std::move(o));
  if (before_join) before_join(*n->rdzv);
  Status s = n->rdzv->Join();
  EXPECT_TRUE(s.ok()) << s.ToString();
  return n;
}

// The setup several tests share: nodes "a" then "b" of a 2:2 job (`nproc_a`, `nproc_b` worker
// processes), with their first round's kRoundStarted events. `before_join(node id, rendezvous)`:
// what each agent tells its rendezvous before it joins. Tests assert ok() first.
struct TwoNodeRound {
  explicit TwoNodeRound(
      MemoryEtcd& db, int nproc_a = 1, int nproc_b = 1,
      const std::function<void(const std::string&, Rendezvous&)>& before_join = {}) {
    auto start = [&](const std::string& id, int nproc) {
      RendezvousOptions o = Opts(id, 2, 2);
      o.nproc = nproc;
      std::function<void(Rendezvous&)> told;
      if (before_join) told = [&](Rendezvous& r) { before_join(id, r); };
      return Start(db, std::move(o), told);
    };
    a = start("a", nproc_a);
    b = start("b", nproc_b);
    ea = a->Started();
    eb = b->Started();
  }
  bool ok() const { return ea && eb; }

  std::unique_ptr<Node> a, b;
  std::optional<Event> ea, eb;
};

// Nodes `ids` of a MIN:MAX job, started one after the other (the first coordinates).
template <size_t N>
std::array<std::unique_ptr<Node>, N> StartNodes(MemoryEtcd& db, const char* const (&ids)[N],
                                                int min, int max) {
  std::array<std::unique_ptr<Node>, N> nodes;
  for (size_t i = 0; i < N; ++i) nodes[i] = Start(db, Opts(ids[i], min, max));
  return nodes;
}

int64_t LeaseOf(MemoryEtcd& db, const std::string& node) {
  auto kv = db.Get(JobKeys("job1").Node(node));
  return kv.ok() && kv->has_value() ? (*kv)->lease : 0;
}

TEST(RendezvousTest, FormsAtMaxWithStableRanksAndOneMasterPort) {
  MemoryEtcd db;
  std::vector<std::unique_ptr<Node>> nodes;
  for (int i = 0; i < 3; ++i) nodes.push_back(Start(db, Opts("n" + std::to_string(i), 2, 3)));
  std::vector<Assignment> got;
  for (auto& n : nodes) {
    auto e = n->Started();
    ASSERT_TRUE(e) << n->id;
    got.push_back(e->assignment);
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].node_rank, i);
    EXPECT_EQ(got[i].rank_offset, i);
    EXPECT_EQ(got[i].world_size, 3);
    EXPECT_EQ(got[i].nnodes, 3);
    EXPECT_FALSE(got[i].standby);
    EXPECT_EQ(got[i].round, got[0].round);
    EXPECT_EQ(got[i].master_port, got[0].master_port);
  }
  EXPECT_NE(got[0].master_port, 0);
  EXPECT_EQ(got[0].master_addr, "127.0.0.1");
}

TEST(RendezvousTest, FormsAtMinOnlyAfterLastCall) {
  MemoryEtcd db;
  auto o0 = Opts("a", 2, 4);
  o0.last_call = 800ms;
  auto t0 = Clock::now();
  auto a = Start(db, o0);
  auto b = Start(db, Opts("b", 2, 4));
  auto e = a->Started();
  ASSERT_TRUE(e);
  EXPECT_GE(Clock::now() - t0, 800ms);
  EXPECT_EQ(e->assignment.world_size, 2);
}

TEST(RendezvousTest, HeterogeneousNprocGivesContiguousRanks) {
  MemoryEtcd db;
  TwoNodeRound round(db, 3, 5);
  ASSERT_TRUE(round.ok());
  const auto& [a, b, ea, eb] = round;
  EXPECT_EQ(ea->assignment.rank_offset, 0);
  EXPECT_EQ(ea->assignment.nproc, 3);
  EXPECT_EQ(eb->assignment.rank_offset, 3);
  EXPECT_EQ(eb->assignment.nproc, 5);
  EXPECT_EQ(eb->assignment.world_size, 8);
}

TEST(RendezvousTest, ScaleOutBelowMaxClosesGracefullyAndNewcomerGoesLast) {
  MemoryEtcd db;
  auto [a, b] = StartNodes(db, {"a", "b"}, 2, 3);
  auto ra = a->Started();
  ASSERT_TRUE(ra && b->Started());
  auto c = Start(db, Opts("c", 2, 3));
  auto closing = a->Next(Event::Type::kRoundClosing);
  ASSERT_TRUE(closing);
  EXPECT_EQ(closing->round, ra->round);
  EXPECT_TRUE(closing->graceful);
  auto a2 = a->Started();
  auto b2 = b->Started();
  auto c2 = c->Started();
  ASSERT_TRUE(a2 && b2 && c2);
  EXPECT_GT(a2->round, ra->round);
  EXPECT_EQ(a2->assignment.node_rank, 0);
  EXPECT_EQ(b2->assignment.node_rank, 1);
  EXPECT_EQ(c2->assignment.node_rank, 2);
  EXPECT_EQ(c2->assignment.world_size, 3);
}

TEST(RendezvousTest, AtMaxNewcomerIsStandbyUntilAMemberLeaves) {
  MemoryEtcd db;
  auto oa = Opts("a", 1, 2);
  oa.last_call = 5s;  // proves the re-round below does not wait for a last call
  auto a = Start(db, oa);
  auto b = Start(db, Opts("b", 1, 2));
  ASSERT_TRUE(a->Started() && b->Started());
  auto c = Start(db, Opts("c", 1, 2));
  auto sc = c->Started();
  ASSERT_TRUE(sc);
  EXPECT_TRUE(sc->assignment.standby);
  auto t0 = Clock::now();
  a->rdzv->Leave();
  auto b2 = b->Started();
  auto c2 = c->Started();
  ASSERT_TRUE(b2 && c2);
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_EQ(b2->assignment.node_rank, 0);
  EXPECT_EQ(c2->assignment.node_rank, 1);
  EXPECT_FALSE(c2->assignment.standby);
  EXPECT_EQ(c2->assignment.world_size, 2);
}

TEST(RendezvousTest, GracefulLeaveReroundsAtOnceAndKeepsRelativeOrder) {
  MemoryEtcd db;
  std::vector<std::unique_ptr<Node>> n;
  for (auto id : {"a", "b", "c", "d"}) {
    auto o = Opts(id, 2, 4);
    o.last_call = 10s;
    n.push_back(Start(db, o));
  }
  for (auto& x : n) ASSERT_TRUE(x->Started());
  auto t0 = Clock::now();
  n[1]->rdzv->Leave();
  for (int i : {0, 2, 3}) {
    auto closing = n[i]->Next(Event::Type::kRoundClosing);
    ASSERT_TRUE(closing);
    EXPECT_TRUE(closing->graceful);
  }
  auto ea = n[0]->Started(), ec = n[2]->Started(), ed = n[3]->Started();
  ASSERT_TRUE(ea && ec && ed);
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_EQ(ea->assignment.node_rank, 0);
  EXPECT_EQ(ec->assignment.node_rank, 1);
  EXPECT_EQ(ed->assignment.node_rank, 2);
  EXPECT_EQ(ed->assignment.world_size, 3);
}

TEST(RendezvousTest, CoordinatorLeavingIsReplacedByItsDeputy) {
  MemoryEtcd db;
  // a joins first: the coordinator
  auto [a, b, c] = StartNodes(db, {"a", "b", "c"}, 2, 3);
  ASSERT_TRUE(a->Started() && b->Started() && c->Started());
  auto t0 = Clock::now();
  a->rdzv->Leave();
  // A graceful leave stays graceful when the leaver coordinated: the others stop their workers
  // at a commit instead of treating the change as a crash.
  for (auto* n : {b.get(), c.get()}) {
    auto closing = n->Next(Event::Type::kRoundClosing);
    ASSERT_TRUE(closing);
    EXPECT_TRUE(closing->graceful) << closing->message;
  }
  auto eb = b->Started();
  auto ec = c->Started();
  ASSERT_TRUE(eb && ec);
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_TRUE(eb->graceful);
  EXPECT_EQ(eb->assignment.node_rank, 0);
  EXPECT_EQ(ec->assignment.world_size, 2);
  auto st = ReadJobStatus(db, "job1");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->coordinator, "b");
}

TEST(RendezvousTest, WorkerFailureReroundsFastWhenTheDeadPeerIsTheCoordinator) {
  MemoryEtcd db;
  // a: the coordinator and rank 0; its lease TTL is 10 s
  auto [a, b, c] = StartNodes(db, {"a", "b", "c"}, 2, 3);
  auto rb = b->Started();
  ASSERT_TRUE(a->Started() && rb && c->Started());
  a->client.Cut();  // dead without a word: its lease lives on
  auto t0 = Clock::now();
  b->rdzv->ReportWorkerFailure(rb->round, "rank 0 connection reset");
  auto closing = c->Next(Event::Type::kRoundClosing);
  ASSERT_TRUE(closing);
  EXPECT_FALSE(closing->graceful);
  auto eb = b->Started();
  auto ec = c->Started();
  ASSERT_TRUE(eb && ec);
  auto took = Clock::now() - t0;
  EXPECT_LT(took, 2s) << "must not wait for the 10 s lease TTL";
  EXPECT_EQ(eb->assignment.world_size, 2);
  EXPECT_EQ(eb->assignment.node_rank, 0);
  EXPECT_EQ(ec->assignment.node_rank, 1);
  EXPECT_TRUE(LeaseOf(db, "a") != 0) << "the dead node's lease is still alive";
}

TEST(RendezvousTest, EveryMemberReportingTheSameFailureMakesOneNewRound) {
  MemoryEtcd db;
  std::vector<std::unique_ptr<Node>> n;
  for (auto id : {"a", "b", "c"}) n.push_back(Start(db, Opts(id, 2, 3)));
  std::vector<int64_t> rounds;
  for (auto& x : n) {
    auto e = x->Started();
    ASSERT_TRUE(e);
    rounds.push_back(e->round);
  }
  // The peers' workers all break together, so every agent reports: the CAS lets one proposal win.
  for (auto& x : n) x->rdzv->ReportWorkerFailure(rounds[0], "allreduce failed");
  std::vector<int64_t> next;
  for (auto& x : n) {
    auto e = x->Started();
    ASSERT_TRUE(e);
    next.push_back(e->round);
    EXPECT_EQ(e->assignment.world_size, 3);
  }
  EXPECT_EQ(next[0], rounds[0] + 1);
  EXPECT_EQ(next[1], next[0]);
  EXPECT_EQ(next[2], next[0]);
  EXPECT_FALSE(n[0]->Started(500ms)) << "no second re-round";
}

TEST(RendezvousTest, LeaseExpiryOfASilentNodeRerounds) {
  MemoryEtcd db;
  std::vector<std::unique_ptr<Node>> n;
  for (auto id : {"a", "b", "c"}) {
    auto o = Opts(id, 2, 3);
    o.ttl = 1s;
    n.push_back(Start(db, o));
  }
  for (auto& x : n) ASSERT_TRUE(x->Started());
  n[2]->client.Cut();
  db.PauseKeepAlive(LeaseOf(db, "c"), true);
  auto ea = n[0]->Started(5s);
  ASSERT_TRUE(ea);
  EXPECT_EQ(ea->assignment.world_size, 2);
  EXPECT_EQ(LeaseOf(db, "c"), 0);
}

TEST(RendezvousTest, NewcomersTakeOverWhenTheWholeRoundDiedBeforeItsLeasesExpired) {
  // Every member (the coordinator and all its deputies) vanishes at once; new nodes join while the
  // dead nodes' keys still exist, so nobody can take over at join. The newcomers must watch the
  // dead coordinator and take over when its lease expires.
  MemoryEtcd db;
  std::vector<std::unique_ptr<Node>> old;
  for (auto id : {"a", "b"}) {
    auto o = Opts(id, 2, 2);
    o.ttl = 1s;
    old.push_back(Start(db, o));
  }
  for (auto& x : old) ASSERT_TRUE(x->Started());
  for (auto& x : old) {
    x->client.Cut();
    db.PauseKeepAlive(LeaseOf(db, x->id), true);
  }
  ASSERT_NE(LeaseOf(db, "a"), 0);   // still registered: a join sees a live coordinator
  auto [c, d] = StartNodes(db, {"c", "d"}, 2, 2);
  auto ec = c->Started(8s);
  auto ed = d->Started(8s);
  ASSERT_TRUE(ec && ed);
  EXPECT_EQ(ec->assignment.world_size, 2);
  EXPECT_EQ(ec->assignment.node_rank + ed->assignment.node_rank, 1);
  EXPECT_EQ(LeaseOf(db, "a"), 0);
}

TEST(RendezvousTest, ANodeWhoseTakeoverFindsAProposalDecidedWithoutItAnnouncesItself) {
  // Found by the interleaving checker (issue #30, schedule 89): c's round watch is slow; the
  // coordinator dies; b takes over and forms round 2 without c (c never saw the proposal); c's own
  // takeover attempt then reads the formed round. Without a late ack the coordinator never heard
  // of c again and c waited outside the job until its join timeout.
  MemoryEtcd db;
  auto oa = Opts("a", 1, 1);
  oa.ttl = 1s;
  auto a = Start(db, oa);
  ASSERT_TRUE(a->Started());
  auto b = Start(db, Opts("b", 1, 1));
  auto oc = Opts("c", 1, 1);
  oc.takeover_step = 1s;   // c acts after b: at least 3 s after a's key is gone
  auto c = Start(db, oc);
  auto sb = b->Started();
  auto sc = c->Started();
  ASSERT_TRUE(sb && sc);
  ASSERT_TRUE(sb->assignment.standby && sc->assignment.standby);
  c->client.HoldRoundWatch(true);
  a->client.Cut();
  db.PauseKeepAlive(LeaseOf(db, "a"), true);
  auto b2 = b->Started(8s);
  ASSERT_TRUE(b2);
  EXPECT_FALSE(b2->assignment.standby);
  auto c2 = c->Started(10s);
  c->client.HoldRoundWatch(false);   // the slow watch's events arrive after all
  if (!c2) c2 = c->Started(3s);
  ASSERT_TRUE(c2) << "c never got a place in the round formed without it";
  EXPECT_EQ(c2->round, b2->round);
  EXPECT_TRUE(c2->assignment.standby);
}

TEST(RendezvousTest, BelowMinFailsAfterJoinTimeoutWithClearMessage) {
  MemoryEtcd db;
  auto o = Opts("lonely", 2, 3);
  o.join_timeout = 600ms;
  auto n = Start(db, o);
  auto e = n->Next(Event::Type::kFailed, 5s);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("MIN=2"), std::string::npos) << e->message;
  EXPECT_NE(e->message.find("join timeout"), std::string::npos) << e->message;
  EXPECT_EQ(LeaseOf(db, "lonely"), 0) << "a failed node leaves the job";
}

// Issue #32: under efdl.elastic.run a node's workers may pause at the close of a round that
// another node's failure broke, before their own collective fails. When that node gives up and
// fewer than MIN remain, the job cannot go on: the broken round counts like an own failure.
// Without a broken round (the peer gave up and left after a round that ended well) the node
// waits for new nodes as before.
TEST(RendezvousTest, ANodeWhoseRoundAPeersFailureBrokeEndsWhenThePeerGivesUpBelowMin) {
  for (const bool broken : {true, false}) {
    SCOPED_TRACE(broken ? "round broken by b" : "round left gracefully by b");
    MemoryEtcd db;
    TwoNodeRound round(db);
    ASSERT_TRUE(round.ok());
    auto& [a, b, ea, eb] = round;
    if (broken) {
      b->rdzv->ReportWorkerFailure(eb->round, "rank 1 raised ValueError: a bug");
      auto closing = a->Next(Event::Type::kRoundClosing);
      ASSERT_TRUE(closing);
      EXPECT_FALSE(closing->graceful);
      ASSERT_TRUE(a->Started() && b->Started()) << "a's workers continue in-process";
    }
    ASSERT_TRUE(b->rdzv->RecordGiveUp("rank 1 raised ValueError: a bug", {}).ok());
    b->rdzv->Leave();
    ASSERT_TRUE(a->Next(Event::Type::kPeerGaveUp));
    auto failed = a->Next(Event::Type::kFailed, broken ? 5s : 1500ms);
    if (!broken) {
      EXPECT_FALSE(failed) << failed->message;
      continue;
    }
    ASSERT_TRUE(failed);
    EXPECT_NE(failed->message.find("cannot go on: node b gave up: rank 1 raised ValueError"),
              std::string::npos) << failed->message;
    EXPECT_NE(failed->message.find("this node's round broke with it (round 1: workers of node b "
                                   "failed: rank 1 raised ValueError: a bug)"),
              std::string::npos) << failed->message;
  }
}

// Issue #37: the waiting notice (every 15 s, issue #22) says what a node waits for. In a
// proposed round it tells what the node holds - the round, its phase, the coordinator, how long
// - and reads nothing; only while the job gathers does the node count the registered nodes (an
// O(N) read in etcd 3.4), at its first notice in a small job.
TEST(RendezvousTest, AWaitingNodeCountsTheRegisteredNodesOnlyWhileTheJobGathers) {
  ASSERT_TRUE(LogEnabled(LogLevel::kInfo)) << "the notices are info lines: unset EFDL_LOG_LEVEL";
  MemoryEtcd db;
  // Job "stuck": its coordinator "boss" (alive: its lease is kept) proposed round 1 and never
  // decides it.
  const JobKeys stuck("stuck");
  auto lease = db.LeaseGrant(60);
  ASSERT_TRUE(lease.ok());
  auto keeper = db.KeepAlive(lease->id, [] {});
  ASSERT_TRUE(keeper.ok());
  ASSERT_TRUE(db.Put(stuck.Node("boss"), NodeRecord{"127.0.0.1", 1, "", ""}.Encode(), lease->id)
                  .ok());
  RoundRecord proposal;
  proposal.round = 1;
  proposal.phase = Phase::kProposed;
  proposal.coordinator = "boss";
  ASSERT_TRUE(db.Put(stuck.round, proposal.Encode()).ok());
  auto waits = testing::FastRendezvousOptions("stuck", "waiter", 2, 2);
  waits.join_timeout = 60s;
  auto gathers = Opts("alone", 2, 3);
  gathers.join_timeout = 60s;
  ::testing::internal::CaptureStderr();
  auto waiter = Start(db, waits);
  auto alone = Start(db, gathers);
  std::this_thread::sleep_for(16s);
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(waiter->client.node_counts(), 0) << out;
  EXPECT_EQ(alone->client.node_counts(), 1) << out;
  EXPECT_NE(out.find("rdzv waiter: waiting for round 1 to form (proposed; coordinator boss waits "
                     "for the nodes' acks, this node's came); waited 15 s; giving up in 4"),
            std::string::npos) << out;
  EXPECT_NE(out.find("rdzv alone: waiting for 1 more node(s): 1 of at least 2 registered; "
                     "giving up in 4"),
            std::string::npos) << out;
}

// Issue #37: the counts of a waiting job's nodes (Unplaced: notices) and of a job whose peer gave
// up (JobEndCheck) stay near kJobRequestsPerSecond for the whole job at any size, also when every
// node began to wait at the same moment, and when the job first spent 150 s in a proposal
// (no count) or the nodes in a round (no check); a small job still counts at its first notice
// (15 s) and checks within a second.
TEST(RendezvousTest, AJobsCountsOfItsNodesStayNearAHundredPerSecondAtAnySize) {
  using internal::JobEndCheck;
  using internal::TimePoint;
  using internal::Unplaced;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const TimePoint t0{};
  const auto step = 100ms;
  for (const bool held_first : {false, true}) {
    for (const int nodes : {3, 1500, 10000}) {
      SCOPED_TRACE(fmt::format("{} nodes{}", nodes, held_first ? ", 150 s held first" : ""));
      std::vector<Unplaced> waits(static_cast<size_t>(nodes));
      std::vector<JobEndCheck> ends(static_cast<size_t>(nodes));
      for (auto& w : waits) {
        w.SpreadCounts(nodes, unit(rng));
        w.Since(t0);
      }
      for (auto& e : ends) {
        e.PeerGaveUp("node x gave up");
        e.WorkersFailed("rank 0 failed");
        e.CheckFrom(t0, nodes, unit(rng));
      }
      std::map<int64_t, int> counts_per_second, checks_per_second;   // second -> reads
      std::optional<TimePoint> first_count, first_check;
      for (TimePoint now = t0; now < t0 + 400s; now += step) {
        const int64_t second =
            std::chrono::duration_cast<std::chrono::seconds>(now - t0).count();
        const bool held = held_first && now < t0 + 150s;
        for (auto& w : waits) {
          if (held) {
            w.NotCounting(now);
          } else if (w.CountDue(now)) {
            w.Counted(now, nodes);
            ++counts_per_second[second];
            if (!first_count) first_count = now;
          }
        }
        for (auto& e : ends) {
          if (held) {
            e.NotChecking(now);
          } else if (e.Due(now)) {
            e.Counted(nodes);
            ++checks_per_second[second];
            if (!first_check) first_check = now;
          }
        }
      }
      ASSERT_TRUE(first_count && first_check);
      if (nodes == 3 && !held_first) {
        EXPECT_EQ(*first_count, t0 + Unplaced::kNoticeInterval);
        EXPECT_LT(*first_check, t0 + 1s);
      }
      for (const auto* per_second : {&counts_per_second, &checks_per_second}) {
        int most = 0;
        int window = 0;   // the most in any 15 s
        for (const auto& [second, reads] : *per_second) {
          most = std::max(most, reads);
          int in_window = 0;
          for (auto it = per_second->lower_bound(second);
               it != per_second->end() && it->first < second + 15; ++it) {
            in_window += it->second;
          }
          window = std::max(window, in_window);
        }
        // A job of at most 1,500 nodes may count together once a notice (15 s apart); above,
        // the spread keeps every second near the rate.
        EXPECT_LE(window, std::max(nodes, 120 * 15)) << "in 15 s";
        if (nodes > 1500) {
          EXPECT_LE(most, 160) << "in one second";
        }
      }
    }
  }
}

// The pace that Unplaced's counts and JobEndCheck's checks share (node_books.h PacedCount), on a
// fake clock: the gap is CountGap (the floor, or 10 ms a node: 100 counts per second job-wide),
// the node's point lies within JobRatePeriod of the spread's job, and a count that fell due while
// the node did not count moves on by whole gaps, keeping the node's point.
TEST(NodeBooksTest, APacedCountWaitsCountGapAndMovesOnByWholeGapsWhileNotCounting) {
  using internal::PacedCount;
  using internal::TimePoint;
  const TimePoint t0{};
  PacedCount pace(15s, t0 + 20s);
  EXPECT_EQ(pace.gap(), 15s);
  EXPECT_EQ(pace.due(), t0 + 20s);
  EXPECT_FALSE(pace.spread());
  EXPECT_EQ(pace.PointWithin(10000), 0s);
  EXPECT_FALSE(pace.Due(t0 + 20s - 1ms));
  EXPECT_TRUE(pace.Due(t0 + 20s));

  // A job of 10,000 nodes: 100 s between counts, this node a quarter into them.
  pace.Spread(10000, 0.25);
  EXPECT_TRUE(pace.spread());
  EXPECT_EQ(pace.gap(), 100s);
  EXPECT_EQ(pace.PointWithin(10000), 25s);
  EXPECT_EQ(pace.PointWithin(3), 7500us);   // within 30 ms
  pace.Spread(3, 0.5);                      // a small job: the floor
  EXPECT_EQ(pace.gap(), 15s);

  pace.Counted(t0 + 10s, 3000);             // 30 s between counts
  EXPECT_EQ(pace.gap(), 30s);
  EXPECT_EQ(pace.due(), t0 + 40s);
  pace.NotCounting(t0 + 39s);               // not due yet: unchanged
  EXPECT_EQ(pace.due(), t0 + 40s);
  pace.NotCounting(t0 + 40s);               // due now: one gap on
  EXPECT_EQ(pace.due(), t0 + 70s);
  pace.NotCounting(t0 + 135s);              // overdue by 65 s: three gaps on, the same point
  EXPECT_EQ(pace.due(), t0 + 160s);
  pace.Counted(t0 + 200s, 3);               // a small count: the floor again
  EXPECT_EQ(pace.due(), t0 + 215s);

  PacedCount none(1s, TimePoint::max());    // nothing due: not counting changes nothing
  none.NotCounting(t0 + 1000s);
  EXPECT_EQ(none.due(), TimePoint::max());
  EXPECT_FALSE(none.Due(t0 + 1000s));
}

// A node whose program differs from the job's is refused before it registers, whether the
// round record names the coordinator whose record it compares with, or names none (a resumed
// job: it compares with the first other node's record); the same program joins.
TEST(RendezvousTest, ANodeOfAnotherProgramIsRefusedAtJoin) {
  for (const bool named : {true, false}) {
    SCOPED_TRACE(named ? "the coordinator's record" : "no coordinator named");
    MemoryEtcd db;
    auto with = [](const std::string& id, const std::string& program) {
      auto o = Opts(id, 3, 3);
      o.program = program;
      return o;
    };
    auto a = Start(db, with("a", "train_a.py"));
    if (!named) {
      auto round = db.Get(JobKeys("job1").round);
      ASSERT_TRUE(round.ok() && round->has_value());
      auto rec = RoundRecord::Decode((*round)->value);
      ASSERT_TRUE(rec.ok());
      rec->coordinator.clear();
      ASSERT_TRUE(db.Put(JobKeys("job1").round, rec->Encode()).ok());
    }
    Node b(db, with("b", "train_b.py"));
    Status refused = b.rdzv->Join();
    EXPECT_TRUE(refused.IsFailedPrecondition()) << refused.ToString();
    EXPECT_NE(refused.message().find("job 'job1' runs train_a.py (node a), this node "
                                     "train_b.py: the nodes of one job run one program"),
              std::string::npos) << refused.ToString();
    EXPECT_EQ(LeaseOf(db, "b"), 0) << "refused before registering";
    Node c(db, with("c", "train_a.py"));
    EXPECT_TRUE(c.rdzv->Join().ok());
  }
}

TEST(RendezvousTest, SurvivorsBelowMinWaitThenFormWhenANodeComes) {
  MemoryEtcd db;
  auto [a, b] = StartNodes(db, {"a", "b"}, 2, 3);
  ASSERT_TRUE(a->Started() && b->Started());
  b->rdzv->Leave();
  ASSERT_TRUE(a->Next(Event::Type::kRoundClosing));
  EXPECT_FALSE(a->Started(700ms)) << "one node is below MIN=2";
  auto c = Start(db, Opts("c", 2, 3));
  auto ea = a->Started();
  auto ec = c->Started();
  ASSERT_TRUE(ea && ec);
  EXPECT_EQ(ea->assignment.node_rank, 0);
  EXPECT_EQ(ec->assignment.node_rank, 1);
}

TEST(RendezvousTest, FencedNodeNeverRejoinsItsRoundAndComesBackAsNewMember) {
  MemoryEtcd db;
  auto [a, b, c] = StartNodes(db, {"a", "b", "c"}, 2, 3);
  auto first = b->Started();
  ASSERT_TRUE(a->Started() && first && c->Started());
  auto wall_now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const double committed_before = wall_now();
  EXPECT_TRUE(b->rdzv->MayPublish(committed_before));
  db.Expire(LeaseOf(db, "b"));  // b was partitioned long enough for its lease to end
  auto fenced = b->Next(Event::Type::kFenced);
  ASSERT_TRUE(fenced);
  // What b committed in its old round never reaches storage, even after it registered again.
  EXPECT_FALSE(b->rdzv->MayPublish(committed_before));
  b->seen.clear();
  EXPECT_EQ(fenced->round, first->round);
  // b rejoins as a new member: it goes last, and never runs `first->round` again.
  std::optional<Event> eb;
  for (int i = 0; i < 3 && (!eb || eb->assignment.world_size != 3); ++i) eb = b->Started();
  ASSERT_TRUE(eb);
  EXPECT_GT(eb->round, first->round);
  EXPECT_EQ(eb->assignment.node_rank, 2);
  EXPECT_EQ(eb->assignment.world_size, 3);
  EXPECT_FALSE(b->rdzv->MayPublish(committed_before));
  EXPECT_TRUE(b->rdzv->MayPublish(wall_now()));   // its new round's commits are its own
  for (const auto& e : b->seen) {
    if (e.type == Event::Type::kRoundStarted) {
      EXPECT_NE(e.round, first->round);
    }
  }
  EXPECT_NE(LeaseOf(db, "b"), 0);
}

TEST(RendezvousTest, CompletionReachesMembersStandbysAndLateAgents) {
  MemoryEtcd db;
  auto [a, b] = StartNodes(db, {"a", "b"}, 1, 2);
  auto ra = a->Started();
  ASSERT_TRUE(ra && b->Started());
  auto s = Start(db, Opts("s", 1, 2));
  auto rs = s->Started();
  ASSERT_TRUE(rs && rs->assignment.standby);
  a->rdzv->ReportWorkersSucceeded(ra->round);
  EXPECT_FALSE(s->Next(Event::Type::kJobComplete, 300ms)) << "b has not finished yet";
  b->rdzv->ReportWorkersSucceeded(ra->round);
  for (auto* n : {a.get(), b.get(), s.get()}) {
    EXPECT_TRUE(n->Next(Event::Type::kJobComplete)) << n->id;
  }
  auto late = Start(db, Opts("late", 1, 2));
  auto e = late->rdzv->WaitEvent(2s);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->type, Event::Type::kJobComplete);
  auto st = ReadJobStatus(db, "job1");
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->complete);
}

TEST(RendezvousTest, StatusShowsMembersStandbysRestartsAndEvents) {
  MemoryEtcd db;
  auto [a, b] = StartNodes(db, {"a", "b"}, 1, 2);
  auto ra = a->Started();
  ASSERT_TRUE(ra && b->Started());
  auto s = Start(db, Opts("s", 1, 2));
  ASSERT_TRUE(s->Started());
  b->rdzv->ReportWorkerFailure(ra->round, "rank 1 exited with status 3");
  auto ra2 = a->Started();
  ASSERT_TRUE(ra2);
  auto st = ReadJobStatus(db, "job1");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->round, ra2->round);
  EXPECT_EQ(st->phase, "active");
  ASSERT_EQ(st->members.size(), 2u);
  EXPECT_EQ(st->members[0].id, "a");
  EXPECT_EQ(st->members[1].id, "b");
  EXPECT_EQ(st->members[1].restarts, 1);
  ASSERT_EQ(st->standbys.size(), 1u);
  EXPECT_EQ(st->standbys[0].id, "s");
  EXPECT_FALSE(st->events.empty());
  std::string json = st->ToJson();
  EXPECT_NE(json.find("\"restarts\": 1"), std::string::npos) << json;
  EXPECT_NE(st->ToText().find("standby"), std::string::npos);
}

TEST(RendezvousTest, BadIdsAndTakenNodeIdAreRejectedBeforeRegistering) {
  MemoryEtcd db;
  auto bad = NewEtcdRendezvous(db, Opts("no/slash", 1, 1));
  Status s = bad->Join();
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  auto minmax = NewEtcdRendezvous(db, Opts("x", 3, 2));
  EXPECT_EQ(minmax->Join().code(), Status::Code::kInvalidArgument);
  auto first = Start(db, Opts("same", 1, 2));
  auto second = NewEtcdRendezvous(db, Opts("same", 1, 2));
  auto t0 = Clock::now();
  s = second->Join();
  EXPECT_EQ(s.code(), Status::Code::kAlreadyExists);
  EXPECT_NE(s.message().find("--node-id"), std::string::npos);
  // A live holder is recognised by its renewed lease, long before the 20 s join timeout.
  EXPECT_LT(Clock::now() - t0, 8s);
  db.SetUnavailable(true);
  auto down = NewEtcdRendezvous(db, Opts("y", 1, 2));
  EXPECT_TRUE(down->Join().IsUnavailable());
  db.SetUnavailable(false);
}

TEST(RendezvousTest, RestartedAgentWaitsOutItsDeadPredecessorsRegistration) {
  MemoryEtcd db;
  auto old_opts = Opts("same", 1, 2);
  old_opts.ttl = 3s;
  auto old = Start(db, old_opts);
  ASSERT_TRUE(old->Started());
  // The old agent dies without a word: its lease is no longer renewed but still holds the id.
  db.PauseKeepAlive(LeaseOf(db, "same"), true);
  old->client.Cut();
  auto t0 = Clock::now();
  auto restarted = std::make_unique<Node>(db, Opts("same", 1, 2));
  Status s = restarted->rdzv->Join();
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_LT(Clock::now() - t0, 8s) << "must register once the 3 s lease ran out";
  EXPECT_TRUE(restarted->Started(10s));
}

// The scale claim in miniature: one re-round costs O(N) requests and watch events, with small
// constants (see docs/scale.md for the model and the measured curves on real etcd).
TEST(RendezvousTest, OneReroundCostsLinearRequestsAndEvents) {
  MemoryEtcd db;
  constexpr int kN = 40;
  std::vector<std::unique_ptr<Node>> n;
  for (int i = 0; i < kN; ++i) {
    auto o = Opts(fmt::format("n{:02}", i), kN - 5, kN);
    o.liveness_window = 300ms;
    n.push_back(Start(db, o));
  }
  for (auto& x : n) ASSERT_TRUE(x->Started(10s)) << x->id;
  ASSERT_TRUE(db.WaitIdle(2s));
  db.ResetStats();
  n[kN / 2]->rdzv->Leave();
  for (int i = 0; i < kN; ++i) {
    if (i != kN / 2) {
      ASSERT_TRUE(n[i]->Started(10s)) << n[i]->id;
    }
  }
  ASSERT_TRUE(db.WaitIdle(2s));
  auto st = db.stats();
  // Model: 1 leave-ack + 1 revoke + 1 proposal + (N-1) acks + 1 assign txn + 1 activation +
  // 1 status write; a little slack for the coordinator's own bookkeeping.
  EXPECT_LE(st.requests(), kN + 12) << "requests per re-round must grow like N";
  // Proposal and activation reach every node; acks reach only the coordinator; each node sees
  // only its own assignment.
  EXPECT_LE(st.watch_events, 4 * kN + 12);
  // The members follow the same coordinator through the watch they kept open since the last
  // proposal (node_rules.h FollowWatch): no watch per node (2N requests with their cancels).
  EXPECT_LE(st.watches_started, 6) << "a re-round must not start a follow watch per node";
}

TEST(RendezvousTest, TheRankZeroNodesAgentStoreIsEveryNodesMasterPortUntilItIsWithdrawn) {
  MemoryEtcd db;
  TwoNodeRound round(db, 1, 1, [](const std::string& node, Rendezvous& r) {
    r.OfferAgentStore(node == "a" ? 45678 : 45679);
  });
  ASSERT_TRUE(round.ok());
  const auto& [a, b, ea, eb] = round;
  ASSERT_EQ(ea->assignment.node_rank, 0);
  for (const Assignment* x : {&ea->assignment, &eb->assignment}) {
    EXPECT_EQ(x->master_port, 45678);
    EXPECT_TRUE(x->agent_store);
    EXPECT_NE(x->horovod_port, 45678);
  }
  // The store died: the next round's master port is a free port again, for rank 0 to bind.
  a->rdzv->OfferAgentStore(0);
  a->rdzv->ReportWorkerFailure(ea->round, "a peer died");
  auto next_a = a->Started();
  auto next_b = b->Started();
  ASSERT_TRUE(next_a && next_b);
  for (const Assignment* x : {&next_a->assignment, &next_b->assignment}) {
    EXPECT_FALSE(x->agent_store);
    EXPECT_NE(x->master_port, 45678);
    EXPECT_NE(x->master_port, 0);
  }
}

TEST(RendezvousTest, HorovodLayoutAndServerPortReachEveryNodeButTheMemberListOnlyRankZero) {
  MemoryEtcd db;
  TwoNodeRound round(db, 1, 2);
  ASSERT_TRUE(round.ok());
  const auto& [a, b, ea, eb] = round;
  const Assignment& x = ea->assignment;
  const Assignment& y = eb->assignment;
  ASSERT_EQ(x.node_rank, 0);
  // The rank-0 node's offer, for everyone, and not the master port offered with it.
  EXPECT_NE(x.horovod_port, 0);
  EXPECT_NE(x.horovod_port, x.master_port);
  EXPECT_EQ(y.horovod_port, x.horovod_port);
  EXPECT_EQ(x.cross_rank, (std::vector<int>{0}));
  EXPECT_EQ(x.cross_size, (std::vector<int>{2}));
  EXPECT_EQ(y.cross_rank, (std::vector<int>{1, 0}));
  EXPECT_EQ(y.cross_size, (std::vector<int>{2, 1}));
  using Hosts = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ(x.horovod_hosts, (Hosts{{"a", 1}, {"b", 2}}));
  EXPECT_TRUE(y.horovod_hosts.empty());
}

}  // namespace
}  // namespace efdl::rdzv
