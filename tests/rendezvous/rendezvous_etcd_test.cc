// The rendezvous against a real etcd (Debian's etcd 3.4, started on free loopback ports in a
// temporary directory and stopped at the end) through the real gRPC client.
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "efdl/etcd.h"
#include "rendezvous/job_status.h"
#include "rendezvous/registration.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/rendezvous.h"
#include "rendezvous/sim.h"
#include "support/real_etcd_fixture.h"

namespace efdl::rdzv {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class RealEtcdTest : public testing::RealEtcdRendezvousTest {
 protected:
  RealEtcdTest() : RealEtcdRendezvousTest("itest", 300ms) {}
  // Nodes a, b and c (MIN 2, MAX 3) joined and in their first round, a the coordinator.
  void JoinThreeWithACoordinating(std::vector<std::unique_ptr<Rendezvous>>& nodes) {
    for (auto id : {"a", "b", "c"}) {
      nodes.push_back(NewEtcdRendezvous(*client_, Opts(id, 2, 3)));
      ASSERT_TRUE(nodes.back()->Join().ok());
    }
    for (auto& n : nodes) ASSERT_TRUE(Next(*n, Event::Type::kRoundStarted));
    auto st = ReadJobStatus(*client_, "itest");
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(st->coordinator, "a");
  }
};

TEST_F(RealEtcdTest, FormsThenReroundsAfterLeaveAndAfterPeerReportedCrash) {
  TrafficCounters counters;
  std::vector<std::unique_ptr<SimNodeClient>> clients;
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  for (auto id : {"a", "b", "c", "d"}) {
    clients.push_back(std::make_unique<SimNodeClient>(*client_, counters));
    nodes.push_back(NewEtcdRendezvous(*clients.back(), Opts(id, 2, 4)));
    ASSERT_TRUE(nodes.back()->Join().ok());
  }
  std::vector<Event> first;
  for (auto& n : nodes) {
    auto e = Next(*n, Event::Type::kRoundStarted);
    ASSERT_TRUE(e);
    first.push_back(*e);
  }
  for (int i = 0; i < 4; ++i) EXPECT_EQ(first[i].assignment.node_rank, i);
  EXPECT_NE(first[0].assignment.master_port, 0);

  nodes[3]->Leave();  // graceful scale in
  for (int i = 0; i < 3; ++i) {
    auto e = Next(*nodes[i], Event::Type::kRoundStarted);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->assignment.world_size, 3);
    EXPECT_EQ(e->assignment.node_rank, i);
  }

  // a (the coordinator, rank 0) dies silently; b's worker notices and reports.
  clients[0]->Cut();
  auto t0 = Clock::now();
  auto st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  nodes[1]->ReportWorkerFailure(st->round, "connection reset by rank 0");
  auto eb = Next(*nodes[1], Event::Type::kRoundStarted);
  auto ec = Next(*nodes[2], Event::Type::kRoundStarted);
  ASSERT_TRUE(eb && ec);
  EXPECT_LT(Clock::now() - t0, 3s) << "must not wait for a's 10 s lease";
  EXPECT_EQ(eb->assignment.node_rank, 0);
  EXPECT_EQ(ec->assignment.node_rank, 1);
  EXPECT_EQ(ec->assignment.world_size, 2);
  st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->coordinator, "b");
  EXPECT_EQ(st->members.size(), 2u);

  nodes[1]->ReportWorkersSucceeded(ec->round);
  nodes[2]->ReportWorkersSucceeded(ec->round);
  EXPECT_TRUE(Next(*nodes[1], Event::Type::kJobComplete));
  EXPECT_TRUE(Next(*nodes[2], Event::Type::kJobComplete));
  nodes.clear();   // cut node a leaves nothing running: its lease ends with the etcd
}

// Every node of a job started at once (a Kubernetes job's pods, a launcher script): they
// register while the first one is already starting the job and coordinating, twice (with and
// without room to spare above MIN). Each time exactly one round forms and takes every node,
// with distinct ranks.
TEST_F(RealEtcdTest, NodesJoiningAtTheSameMomentFormOneRoundWithEveryNode) {
  for (const auto& [min_nodes, max_nodes] : {std::pair{6, 6}, std::pair{2, 6}}) {
    TrafficCounters counters;
    std::vector<std::unique_ptr<SimNodeClient>> clients;
    std::vector<std::unique_ptr<Rendezvous>> nodes;
    for (int i = 0; i < 6; ++i) {
      clients.push_back(std::make_unique<SimNodeClient>(*client_, counters));
      RendezvousOptions o = Opts(fmt::format("n{}", i), min_nodes, max_nodes);
      o.job_id = fmt::format("together-{}", min_nodes);   // a fresh job per pass
      nodes.push_back(NewEtcdRendezvous(*clients.back(), o));
    }
    std::latch start(6);
    std::vector<Status> joined(6);
    std::vector<std::thread> threads;
    for (int i = 0; i < 6; ++i) {
      threads.emplace_back([&, i] {
        start.arrive_and_wait();
        // Pods start within moments of each other, not within the same microsecond: spread
        // over 75 ms, the registrations straddle the first node's start of the job.
        std::this_thread::sleep_for(std::chrono::milliseconds(15 * i));
        joined[i] = nodes[i]->Join();
      });
    }
    for (auto& t : threads) t.join();
    std::set<int> ranks;
    std::set<int64_t> rounds;
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE(joined[i].ok()) << joined[i].ToString();
      auto e = Next(*nodes[i], Event::Type::kRoundStarted);
      ASSERT_TRUE(e) << "node " << i << " got no round (min " << min_nodes << ")";
      EXPECT_FALSE(e->assignment.standby);
      EXPECT_EQ(e->assignment.world_size, 6) << "min " << min_nodes;
      ranks.insert(e->assignment.node_rank);
      rounds.insert(e->assignment.round);
    }
    EXPECT_EQ(ranks.size(), 6u);
    EXPECT_EQ(rounds.size(), 1u);
    for (auto& n : nodes) n->Leave();
  }
}

TEST_F(RealEtcdTest, CoordinatorLeavingGracefullyHandsOverAndTheChangeStaysGraceful) {
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  ASSERT_NO_FATAL_FAILURE(JoinThreeWithACoordinating(nodes));
  auto t0 = Clock::now();
  nodes[0]->Leave();   // SIGTERM on the coordinator's agent
  for (int i = 1; i < 3; ++i) {
    auto closing = Next(*nodes[i], Event::Type::kRoundClosing);
    ASSERT_TRUE(closing);
    EXPECT_TRUE(closing->graceful) << closing->message;   // stop at a commit, lose nothing
    auto e = Next(*nodes[i], Event::Type::kRoundStarted);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->assignment.world_size, 2);
    EXPECT_EQ(e->assignment.node_rank, i - 1);
  }
  EXPECT_LT(Clock::now() - t0, 3s) << "must not wait for a's 10 s lease";
  auto st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->coordinator, "b");
  EXPECT_EQ(st->members.size(), 2u);
}

// Issue #32, nodes that keep failing: the coordinator's agent excludes its node (Withdraw). The
// others go on without it at once (it said it leaves and handed coordination over), `efdl
// status` shows the exclusion and not the node; no event reaches it during the cool-down; then
// it registers again, is taken in as a new member, and its record goes. Withdrawn a second
// time, it learns within seconds (not at the end of its cool-down) that the job completed.
TEST_F(RealEtcdTest, AnExcludedNodeWithdrawsForItsCooldownThenRegistersAgain) {
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  ASSERT_NO_FATAL_FAILURE(JoinThreeWithACoordinating(nodes));

  ExclusionRecord rec;
  rec.reason = "rank 0 exited with status 1 in round 1; 3 of this node's own worker failures";
  rec.time = "2026-12-06T06:00:00Z";
  rec.until = "2026-12-06T06:00:02Z";
  rec.failures = 3;
  rec.exclusion = 1;
  rec.stderr_tail = {"RuntimeError: bad host"};
  ASSERT_TRUE(nodes[0]->RecordExclusion(rec).ok());
  const auto t0 = Clock::now();
  nodes[0]->Withdraw(2s);
  for (int i = 1; i < 3; ++i) {
    auto e = Next(*nodes[i], Event::Type::kRoundStarted);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->assignment.world_size, 2);
  }
  EXPECT_LT(Clock::now() - t0, 2s) << "the others must not wait for a's lease";
  auto st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->members.size(), 2u);
  EXPECT_TRUE(st->waiting.empty() && st->standbys.empty());
  for (const auto& m : st->members) EXPECT_NE(m.id, "a");
  ASSERT_EQ(st->excluded.count("a"), 1u);
  EXPECT_EQ(st->excluded["a"].until, rec.until);
  EXPECT_EQ(st->excluded["a"].failures, 3);
  EXPECT_EQ(st->excluded["a"].stderr_tail, rec.stderr_tail);
  EXPECT_NE(st->ToText().find("a EXCLUDED at 2026-12-06T06:00:00Z until 2026-12-06T06:00:02Z"),
            std::string::npos) << st->ToText();
  EXPECT_NE(st->ToJson().find("\"excluded\""), std::string::npos);

  // Nothing for a until its cool-down is over; then a round that takes it in again.
  auto during = nodes[0]->WaitEvent(1500ms);
  EXPECT_FALSE(during) << "event " << static_cast<int>(during->type) << " during the cool-down";
  auto back = Next(*nodes[0], Event::Type::kRoundStarted);
  ASSERT_TRUE(back);
  EXPECT_GE(Clock::now() - t0, 2s);
  EXPECT_EQ(back->assignment.world_size, 3);
  EXPECT_EQ(back->assignment.node_rank, 2);   // a new member goes after the others
  st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->excluded.empty());
  for (int i = 1; i < 3; ++i) ASSERT_TRUE(Next(*nodes[i], Event::Type::kRoundStarted));

  // Withdrawn for 60 s, it hears of the job's completion within seconds.
  nodes[0]->Withdraw(60s);
  std::optional<Event> two;
  for (int i = 1; i < 3; ++i) {
    two = Next(*nodes[i], Event::Type::kRoundStarted);
    ASSERT_TRUE(two);
  }
  for (int i = 1; i < 3; ++i) nodes[i]->ReportWorkersSucceeded(two->round);
  for (int i = 1; i < 3; ++i) ASSERT_TRUE(Next(*nodes[i], Event::Type::kJobComplete));
  const auto completed = Clock::now();
  ASSERT_TRUE(Next(*nodes[0], Event::Type::kJobComplete));
  EXPECT_LT(Clock::now() - completed, 5s);
}

TEST_F(RealEtcdTest, LeaseExpiryFencesAndRerounds) {
  auto oa = Opts("a", 1, 3);
  auto ob = Opts("b", 1, 3);
  ob.ttl = 2s;
  TrafficCounters counters;
  SimNodeClient cb(*client_, counters);
  auto a = NewEtcdRendezvous(*client_, oa);
  auto b = NewEtcdRendezvous(cb, ob);
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(b->Join().ok());
  // Wait for the 2-node round (the first round may have formed with a alone at MIN=1).
  std::optional<Event> e;
  for (int i = 0; i < 3 && (!e || e->assignment.world_size != 2); ++i) {
    e = Next(*a, Event::Type::kRoundStarted);
  }
  ASSERT_TRUE(e && e->assignment.world_size == 2);
  // b's keep-alives stop (the real client keeps renewing, so revoke stands in for expiry).
  cb.Cut();
  auto kv = client_->Get("/efdl/itest/nodes/b");
  ASSERT_TRUE(kv.ok() && kv->has_value());
  ASSERT_TRUE(client_->LeaseRevoke((*kv)->lease).ok());
  auto e2 = Next(*a, Event::Type::kRoundStarted);
  ASSERT_TRUE(e2);
  EXPECT_EQ(e2->assignment.world_size, 1);
}

TEST_F(RealEtcdTest, ScaleSimRunsEveryScenarioWithLinearTraffic) {
  SimOptions o;
  o.job_id = "simtest";
  o.nodes = 30;
  o.liveness_window = 300ms;
  auto report = RunScaleSim(*client_, o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->scenarios.size(), 5u);
  for (const auto& s : report->scenarios) {
    EXPECT_TRUE(s.ok) << s.name << ": " << s.error;
    EXPECT_LT(s.seconds, 10) << s.name;
    // Only killed and crashed nodes lose their leases here (they are not counted).
    EXPECT_EQ(s.leases_lost, 0) << s.name;
  }
  // One killed node: about N requests (acks) plus a handful.
  EXPECT_LE(report->scenarios[1].requests, o.nodes + 15) << report->ToJson();
  // The re-round under the same coordinator: the members follow it through the watch they kept
  // (node_rules.h FollowWatch), not one new watch each.
  EXPECT_LE(report->scenarios[1].watches_started, 10) << report->ToJson();
}

// The simulator's leases_lost counts a live node's lost lease, never a cut-off (killed or
// crashed) node's: what shows a job losing nodes to its own starvation (issue #37).
TEST_F(RealEtcdTest, TheSimulatorCountsLostLeasesOfLiveNodesOnly) {
  TrafficCounters counters;
  SimNodeClient live(*client_, counters);
  SimNodeClient killed(*client_, counters);
  std::atomic<int> told{0};
  std::vector<int64_t> leases;
  auto keep = [&](SimNodeClient& c) {
    auto granted = c.LeaseGrant(3);
    EXPECT_TRUE(granted.ok());
    leases.push_back(granted->id);
    auto keeper = c.KeepGranted(*granted, std::chrono::steady_clock::now(), [&] { ++told; });
    EXPECT_TRUE(keeper.ok());
    return std::move(keeper).value();
  };
  auto k1 = keep(live);
  auto k2 = keep(killed);
  killed.Cut();   // as the simulator kills a node: cut off, then its lease revoked by "etcd"
  for (int64_t lease : leases) EXPECT_TRUE(client_->LeaseRevoke(lease).ok());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (told.load() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(told.load(), 2) << "both keepers report their lease lost";
  EXPECT_EQ(counters.leases_lost.load(), 1) << "only the live node's counts";
}

// Callbacks of a registration whose watches, deletions and lost leases the test ignores.
Registration::Callbacks IgnoredCallbacks() {
  Registration::Callbacks cb;
  cb.watch = [](Registration::Stream, uint64_t) -> etcd::WatchCallback {
    return [](const etcd::WatchUpdate&) {};
  };
  cb.coordinator_deleted = [](uint64_t, const std::string&, int64_t) {};
  cb.lease_lost = [](int64_t) {};
  return cb;
}

// The round record a job's first node creates.
RoundRecord FreshRound() {
  RoundRecord fresh;
  fresh.round = 1;
  fresh.phase = Phase::kGathering;
  return fresh;
}

// Issue #37: a registration is a lease grant and one txn (the job's first node: one more to
// create the round record), with no time-to-live read before keeping the lease.
TEST_F(RealEtcdTest, ARegistrationIsALeaseGrantAndOneTxn) {
  TrafficCounters counters;
  SimNodeClient counted(*client_, counters);
  const JobKeys keys("regcount");
  const Registration::Callbacks cb = IgnoredCallbacks();
  const RoundRecord fresh = FreshRound();
  const NodeRecord me{"127.0.0.1", 1, "", ""};
  Registration first(counted, keys, "regcount", "a", cb);
  ASSERT_TRUE(first.Open(me, 10s, fresh).ok());
  EXPECT_EQ(counters.requests.load(), 3) << "grant, register txn, create-the-round txn";
  counters.Reset();
  Registration second(counted, keys, "regcount", "b", cb);
  ASSERT_TRUE(second.Open(me, 10s, fresh).ok());
  EXPECT_EQ(counters.requests.load(), 2) << "grant and register txn";
  first.Release();
  second.Release();
}

// Issue #37: a node that names its program (every real agent does) registers with the same two
// requests as one that does not, while the node that wrote P program lives; after it is gone the
// next node reads the live nodes' records once and writes the key again. Another program is
// refused, whoever wrote the key, and may use the job id once every node is gone.
TEST_F(RealEtcdTest, TheProgramCheckCostsNoRequestWhileTheKeysWriterLives) {
  TrafficCounters counters;
  SimNodeClient counted(*client_, counters);
  const JobKeys keys("progkey");
  const Registration::Callbacks cb = IgnoredCallbacks();
  const RoundRecord fresh = FreshRound();
  const NodeRecord train{"127.0.0.1", 1, "train.py", ""};
  const NodeRecord other{"127.0.0.1", 1, "eval.py", ""};
  std::vector<std::unique_ptr<Registration>> regs;
  auto open = [&](const std::string& id, const NodeRecord& me) {
    counters.Reset();
    regs.push_back(std::make_unique<Registration>(counted, keys, "progkey", id, cb));
    return regs.back()->Open(me, 10s, fresh).status();
  };
  auto registered = [&](const std::string& id) {
    auto kv = client_->Get(keys.Node(id));
    return kv.ok() && kv->has_value();
  };
  ASSERT_TRUE(open("a", train).ok());
  ASSERT_TRUE(open("b", train).ok());
  EXPECT_EQ(counters.requests.load(), 2) << "grant and register txn";
  Status refused = open("x", other);
  EXPECT_TRUE(refused.IsFailedPrecondition()) << refused.ToString();
  EXPECT_NE(refused.message().find("job 'progkey' runs train.py (node "), std::string::npos)
      << refused.ToString();
  EXPECT_FALSE(registered("x"));
  regs[0]->Release();   // a wrote P program: it goes with a's lease
  auto key = client_->Get(keys.program);
  ASSERT_TRUE(key.ok());
  EXPECT_FALSE(key->has_value());
  refused = open("y", other);
  EXPECT_NE(refused.message().find("job 'progkey' runs train.py (node b)"), std::string::npos)
      << "b still runs it: " << refused.ToString();
  EXPECT_FALSE(registered("y"));
  ASSERT_TRUE(open("c", train).ok());
  EXPECT_EQ(counters.requests.load(), 5)
      << "grant, register txn, the round record, a range of 2 node records, claiming txn";
  ASSERT_TRUE(open("d", train).ok());
  EXPECT_EQ(counters.requests.load(), 2) << "c wrote the key again";
  for (auto& r : regs) r->Release();
  EXPECT_TRUE(open("z", other).ok()) << "no node of the job is left";
  regs.back()->Release();
}

// Issue #37: a join of a node that names its program (every real agent does) reads one other
// node's record - the coordinator's - whatever the size of the job, not every record.
TEST_F(RealEtcdTest, AJoinWithAProgramReadsTheSameWhateverTheJobsSize) {
  struct Cost {
    int64_t bytes = 0;   // keys and values read
  };
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  auto join_cost = [&](const std::string& job, int others) -> Cost {
    auto coordinator = Opts("coord", 1000, 1000);   // gathers for as long as the test runs
    coordinator.job_id = job;
    coordinator.program = "train.py";
    nodes.push_back(NewEtcdRendezvous(*client_, coordinator));
    EXPECT_TRUE(nodes.back()->Join().ok());
    const JobKeys keys(job);
    for (int i = 0; i < others; ++i) {
      const NodeRecord rec{"127.0.0.1", 1, "train.py", ""};
      EXPECT_TRUE(client_->Put(keys.Node(fmt::format("other{:04}", i)), rec.Encode()).ok());
    }
    TrafficCounters counters;
    SimNodeClient counted(*client_, counters);
    auto joiner = Opts("joiner", 1000, 1000);
    joiner.job_id = job;
    joiner.program = "train.py";
    auto node = NewEtcdRendezvous(counted, joiner);
    EXPECT_TRUE(node->Join().ok());
    Cost cost{counters.bytes_received.load()};
    node->Leave();
    return cost;
  };
  const Cost few = join_cost("progjoba", 3);
  const Cost many = join_cost("progjobb", 300);
  EXPECT_LE(many.bytes, few.bytes + 64) << "3 other nodes: " << few.bytes << " bytes read";
  for (auto& n : nodes) n->Leave();
}

// Issue #37: a lease kept from its grant's answer (KeepGranted, no time-to-live read) is renewed
// like one kept after the read, and its local expiry counts from before the grant was sent.
TEST_F(RealEtcdTest, ALeaseKeptFromItsGrantsAnswerIsRenewedWithoutARead) {
  TrafficCounters counters;
  SimNodeClient counted(*client_, counters);
  const auto asked = Clock::now();
  auto grant = counted.LeaseGrant(2);
  ASSERT_TRUE(grant.ok()) << grant.status().ToString();
  std::atomic<bool> lost{false};
  auto keeper = counted.KeepGranted(*grant, asked, [&] { lost = true; });
  ASSERT_TRUE(keeper.ok()) << keeper.status().ToString();
  EXPECT_EQ(counters.requests.load(), 1) << "the grant, and no read after it";
  EXPECT_LE((*keeper)->expires_at(), asked + 2s);
  EXPECT_GT((*keeper)->expires_at(), Clock::now());
  std::this_thread::sleep_for(4500ms);   // more than twice the TTL: renewed, or gone
  EXPECT_FALSE(lost.load());
  auto ttl = client_->LeaseTimeToLive(grant->id);
  ASSERT_TRUE(ttl.ok()) << ttl.status().ToString();
  EXPECT_GT(*ttl, 0);
  EXPECT_GT((*keeper)->expires_at(), Clock::now());
  keeper->reset();
  EXPECT_TRUE(client_->LeaseRevoke(grant->id).ok());
}

// Both simulators (issue #37): 60 nodes on 2 shared driver threads, and one thread per node,
// form and re-round with the same linear traffic (one killed node: N acks plus a handful).
TEST_F(RealEtcdTest, ScaleSimOnTwoDriverThreadsMatchesAThreadPerNode) {
  SimOptions o;
  o.nodes = 60;
  o.liveness_window = 300ms;
  for (int threads : {2, 0}) {
    o.job_id = fmt::format("simpool{}", threads);
    o.driver_threads = threads;
    auto report = RunScaleSim(*client_, o);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ASSERT_EQ(report->scenarios.size(), 5u);
    for (const auto& s : report->scenarios) {
      EXPECT_TRUE(s.ok) << threads << " threads, " << s.name << ": " << s.error;
      EXPECT_LT(s.seconds, 10) << s.name;
    }
    EXPECT_EQ(report->driver_threads, threads);
    EXPECT_LE(report->scenarios[1].requests, o.nodes + 15) << report->ToJson();
  }
}

}  // namespace
}  // namespace efdl::rdzv

namespace efdl::rdzv {
namespace {

using namespace std::chrono_literals;

// Issue #32 part 3, stragglers: each node's compute summary lives under its lease (gone with
// the node), the judge's record of the round's stragglers is read back, and `efdl status`
// shows a straggler of the current round only.
TEST_F(RealEtcdTest, ComputeSummariesLiveUnderTheLeaseAndStatusShowsTheRoundsStragglers) {
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  for (auto id : {"a", "b"}) {
    nodes.push_back(NewEtcdRendezvous(*client_, Opts(id, 1, 2)));
    ASSERT_TRUE(nodes.back()->Join().ok());
  }
  int64_t round = 0;
  for (auto& n : nodes) {
    auto e = Next(*n, Event::Type::kRoundStarted);
    ASSERT_TRUE(e);
    round = e->assignment.round;
  }
  nodes[0]->PublishCompute({round, 1, {{0, 0.1}}});
  nodes[1]->PublishCompute({round, 1, {{1, 0.4}}});
  std::map<std::string, ComputeRecord> all;
  for (auto deadline = std::chrono::steady_clock::now() + 10s;
       all.size() < 2 && std::chrono::steady_clock::now() < deadline;
       std::this_thread::sleep_for(50ms)) {
    auto read = nodes[0]->ReadCompute();
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    all = *read;
  }
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all["b"].round, round);
  EXPECT_EQ(all["b"].seq, 1);
  EXPECT_DOUBLE_EQ(all["b"].compute_s[1], 0.4);

  auto none = nodes[0]->ReadStragglers();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);
  StragglerRecord rec;
  rec.round = round;
  rec.judge = "a";
  rec.time = "2026-12-06T09:00:00Z";
  rec.factor = 2;
  rec.window_s = 30;
  rec.nodes.push_back({"b", {1}, 0.4, 0.1, 3, "2026-12-06T09:00:00Z"});
  ASSERT_TRUE(nodes[0]->RecordStragglers(rec).ok());
  auto back = nodes[1]->ReadStragglers();
  ASSERT_TRUE(back.ok() && *back);
  EXPECT_EQ((*back)->Encode(), rec.Encode());
  auto st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE(st->stragglers);
  EXPECT_NE(st->ToText().find(fmt::format(
                "b is a STRAGGLER in round {} since 2026-12-06T09:00:00Z: rank 1 0.400 s of "
                "compute per step, 4.0x the median 0.100 s of the other nodes' ranks",
                round)),
            std::string::npos)
      << st->ToText();
  EXPECT_NE(st->ToJson().find("\"compute_s\": 0.4"), std::string::npos) << st->ToJson();
  // A record of another round is not the current round's: not shown.
  rec.round = round - 1;
  ASSERT_TRUE(nodes[0]->RecordStragglers(rec).ok());
  st = ReadJobStatus(*client_, "itest");
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->stragglers);
  EXPECT_EQ(st->ToText().find("STRAGGLER"), std::string::npos);

  // b leaves: its summary goes with its lease.
  nodes[1]->Leave();
  for (auto deadline = std::chrono::steady_clock::now() + 10s;
       all.size() > 1 && std::chrono::steady_clock::now() < deadline;
       std::this_thread::sleep_for(50ms)) {
    all = *nodes[0]->ReadCompute();
  }
  EXPECT_EQ(all.size(), 1u);
  EXPECT_EQ(all.count("a"), 1u);
}

}  // namespace
}  // namespace efdl::rdzv
