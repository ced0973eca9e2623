// The Coordinator carrying out its decisions against the in-memory etcd: what it writes, and
// that a coordinator that lost the round record writes nothing more.
#include "rendezvous/coordinator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "support/memory_etcd.h"

namespace efdl::rdzv {
namespace {

using std::chrono::milliseconds;

// The node side as the coordinator sees it: the round record (read from and written to etcd
// by CAS) and the queue its watches deliver into, drained by the test as the driver would.
class Host final : public CoordinatorHost {
 public:
  Host(etcd::Client& client, const JobKeys& keys) : client_(client), keys_(keys) {}

  const RoundRecord& round() const override { return round_; }
  int64_t round_revision() const override { return revision_; }
  bool CasRound(const RoundRecord& rec) override {
    auto txn = client_.Txn({etcd::Compare::ModRevisionIs(keys_.round, revision_)},
                           {etcd::TxnOp::Put(keys_.round, rec.Encode())});
    if (!txn.ok() || !txn->succeeded) return false;
    ApplyRound(rec, txn->revision);
    return true;
  }
  void RereadRound() override {
    ++rereads;
    auto kv = client_.Get(keys_.round);
    ASSERT_TRUE(kv.ok() && kv->has_value());
    auto rec = RoundRecord::Decode((*kv)->value);
    ASSERT_TRUE(rec.ok());
    ApplyRound(*rec, (*kv)->mod_revision);
  }
  void ApplyRound(const RoundRecord& rec, int64_t mod_revision) override {
    round_ = rec;
    revision_ = mod_revision;
  }
  etcd::WatchCallback CoordinatorWatch(bool nodes, uint64_t generation) override {
    return [this, nodes, generation](const etcd::WatchUpdate& u) {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({nodes, generation, u});
    };
  }
  void RequestResync() override { ++resyncs; }

  // Delivers what the watches queued (after `etcd` dispatched everything) to `c`.
  void Pump(testing::MemoryEtcd& etcd, Coordinator& c) {
    ASSERT_TRUE(etcd.WaitIdle(milliseconds(5000)));
    std::deque<Queued> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.swap(queue_);
    }
    for (const auto& q : batch) {
      if (q.generation != c.generation() || !c.active()) continue;
      if (q.nodes) {
        c.OnNodesEvents(q.update.events);
      } else {
        c.OnAckEvents(q.update.events);
      }
    }
  }

  int rereads = 0;
  int resyncs = 0;

 private:
  struct Queued {
    bool nodes;
    uint64_t generation;
    etcd::WatchUpdate update;
  };
  etcd::Client& client_;
  const JobKeys& keys_;
  RoundRecord round_;
  int64_t revision_ = 0;
  std::mutex mu_;
  std::deque<Queued> queue_;
};

// Forwards to the in-memory etcd and watches the assignment txns (those that put assign/ keys):
// how many were sent, how many were in flight at once, and (on request) fails them or has the
// round record taken over before one of them. Each holds until another is in flight (or a second
// passed), so txns sent a few at a time overlap and txns sent one at a time never do.
class AssignWatchingClient final : public etcd::Client {
 public:
  AssignWatchingClient(etcd::Client& inner, const JobKeys& keys) : inner_(inner), keys_(keys) {}

  void FailAssignments() { fail_ = true; }
  // Before the `n`th assignment txn (1-based) goes out, another node takes over the round record.
  void TakeOverBeforeAssignment(int n) { take_over_at_ = n; }
  int sent() const {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }
  int max_in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return max_in_flight_;
  }

  Result<etcd::RangeResult> Range(const std::string& k, const etcd::RangeOptions& o) override {
    return inner_.Range(k, o);
  }
  Result<std::optional<etcd::KeyValue>> Get(const std::string& k) override { return inner_.Get(k); }
  Result<etcd::PutResult> Put(const std::string& k, const std::string& v, int64_t l) override {
    return inner_.Put(k, v, l);
  }
  Result<etcd::DeleteResult> Delete(const std::string& k, bool p) override {
    return inner_.Delete(k, p);
  }
  Result<etcd::TxnResult> Txn(const std::vector<etcd::Compare>& c,
                              const std::vector<etcd::TxnOp>& t,
                              const std::vector<etcd::TxnOp>& o) override {
    const bool assignment = std::any_of(t.begin(), t.end(), [&](const etcd::TxnOp& op) {
      return op.type == etcd::TxnOp::Type::kPut && op.key.starts_with(keys_.assign);
    });
    if (!assignment) return inner_.Txn(c, t, o);
    bool take_over = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      take_over = ++sent_ == take_over_at_;
      max_in_flight_ = std::max(max_in_flight_, ++in_flight_);
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::seconds(1), [&] { return max_in_flight_ > 1; });
    }
    if (take_over) {
      auto kv = inner_.Get(keys_.round);
      auto rec = RoundRecord::Decode((*kv)->value);
      rec->coordinator = "b";
      rec->round += 1;
      EXPECT_TRUE(inner_.Put(keys_.round, rec->Encode()).ok());
    }
    auto result = fail_ ? Result<etcd::TxnResult>(Status::Unavailable("injected"))
                        : inner_.Txn(c, t, o);
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
    return result;
  }
  Result<etcd::LeaseGrantResult> LeaseGrant(int64_t ttl) override { return inner_.LeaseGrant(ttl); }
  Status LeaseRevoke(int64_t id) override { return inner_.LeaseRevoke(id); }
  Result<int64_t> LeaseTimeToLive(int64_t id) override { return inner_.LeaseTimeToLive(id); }
  Result<std::unique_ptr<etcd::LeaseKeeper>> KeepAlive(int64_t id,
                                                       std::function<void()> on_lost) override {
    return inner_.KeepAlive(id, std::move(on_lost));
  }
  Result<std::unique_ptr<etcd::Watch>> StartWatch(const std::string& k, const etcd::WatchOptions& o,
                                                  etcd::WatchCallback cb) override {
    return inner_.StartWatch(k, o, std::move(cb));
  }

 private:
  etcd::Client& inner_;
  const JobKeys& keys_;
  std::atomic<bool> fail_{false};
  int take_over_at_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int sent_ = 0, in_flight_ = 0, max_in_flight_ = 0;
};

class CoordinatorTest : public ::testing::Test {
 protected:
  CoordinatorTest() : keys_("job"), host_(etcd_, keys_) {}

  void PutRound(const RoundRecord& rec) {
    ASSERT_TRUE(etcd_.Put(keys_.round, rec.Encode()).ok());
    host_.RereadRound();
  }
  void Register(const std::string& id, int nproc = 1) {
    ASSERT_TRUE(etcd_.Put(keys_.Node(id), NodeRecord{"h-" + id, nproc, "", ""}.Encode()).ok());
  }
  void PutAck(const std::string& id, int64_t round, AckState state, uint16_t port = 0) {
    AckRecord a;
    a.round = round;
    a.state = state;
    a.port = port;
    ASSERT_TRUE(etcd_.Put(keys_.Ack(id), a.Encode()).ok());
  }
  RoundRecord StoredRound() {
    auto kv = etcd_.Get(keys_.round);
    EXPECT_TRUE(kv.ok() && kv->has_value());
    auto rec = RoundRecord::Decode((*kv)->value);
    EXPECT_TRUE(rec.ok());
    return *rec;
  }
  std::optional<AssignRecord> StoredAssign(const std::string& id) {
    auto kv = etcd_.Get(keys_.Assign(id));
    if (!kv.ok() || !kv->has_value()) return std::nullopt;
    auto rec = AssignRecord::Decode((*kv)->value);
    EXPECT_TRUE(rec.ok());
    return *rec;
  }
  nlohmann::json StoredStatus() {
    auto kv = etcd_.Get(keys_.status);
    EXPECT_TRUE(kv.ok() && kv->has_value());
    return nlohmann::json::parse((*kv)->value);
  }
  // Two nodes a (the coordinator) and b, gathering round 1, with MAX = 2: formed at once.
  void FormRoundOfTwo(Coordinator& c) {
    RoundRecord gathering;
    gathering.round = 1;
    gathering.coordinator = "a";
    PutRound(gathering);
    Register("a");
    Register("b", 2);
    c.Start();
    ASSERT_TRUE(c.active());
    c.Step(CoordClock::now());
    ASSERT_EQ(StoredRound().phase, Phase::kProposed);
    PutAck("a", 1, AckState::kAck, 7001);
    PutAck("b", 1, AckState::kAck, 7002);
    host_.Pump(etcd_, c);
    c.Step(CoordClock::now());
  }

  // `n` nodes (a, the coordinator, then n0001...) proposed round 1 at MAX = n and every one
  // acked it: the next step finalizes, with ceil(n / 127) assignment txns.
  void ProposeToMany(Coordinator& c, int n) {
    RoundRecord gathering;
    gathering.round = 1;
    gathering.coordinator = "a";
    PutRound(gathering);
    std::vector<std::string> ids{"a"};
    for (int i = 1; i < n; ++i) ids.push_back(fmt::format("n{:04d}", i));
    for (const auto& id : ids) Register(id);
    c.Start();
    ASSERT_TRUE(c.active());
    c.Step(CoordClock::now());
    ASSERT_EQ(StoredRound().phase, Phase::kProposed);
    for (size_t i = 0; i < ids.size(); ++i) {
      PutAck(ids[i], 1, AckState::kAck, static_cast<uint16_t>(7000 + i));
    }
    host_.Pump(etcd_, c);
  }
  CoordinatorConfig ManyConfig(int n) const {
    CoordinatorConfig cfg = config_;
    cfg.max_nodes = n;
    return cfg;
  }

  testing::MemoryEtcd etcd_;
  JobKeys keys_;
  Host host_;
  CoordinatorConfig config_ = [] {
    CoordinatorConfig cfg;
    cfg.job_id = "job";
    cfg.node_id = "a";
    cfg.max_nodes = 2;
    cfg.last_call = milliseconds(3000);
    cfg.liveness_window = milliseconds(400);
    return cfg;
  }();
};

TEST_F(CoordinatorTest, FormsARoundFromRegistrationsAndAcksAndWritesItsStatus) {
  Coordinator c(etcd_, keys_, config_, host_);
  FormRoundOfTwo(c);
  RoundRecord round = StoredRound();
  EXPECT_EQ(round.phase, Phase::kActive);
  EXPECT_EQ(round.round, 1);
  EXPECT_EQ(round.world_size, 3);
  EXPECT_EQ(round.master_addr, "h-a");
  EXPECT_EQ(round.master_port, 7001);
  EXPECT_EQ(round.deputies, std::vector<std::string>{"b"});
  auto b = StoredAssign("b");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->node_rank, 1);
  EXPECT_EQ(b->rank_offset, 1);
  auto status = StoredStatus();
  EXPECT_EQ(status["round"], 1);
  EXPECT_EQ(status["coordinator"], "a");
  ASSERT_EQ(status["members"].size(), 2u);
  EXPECT_EQ(status["members"][1]["id"], "b");
  EXPECT_EQ(status["members"][1]["nproc"], 2);
  EXPECT_EQ(status["events"].back()["message"],
            "round 1 formed: 2 nodes, world size 3, 0 standby, 0 left out");
}

TEST_F(CoordinatorTest, ANodeThatJoinsAJobAtMaxIsMadeAStandbyInEtcd) {
  Coordinator c(etcd_, keys_, config_, host_);
  FormRoundOfTwo(c);
  Register("c");
  host_.Pump(etcd_, c);
  auto standby = StoredAssign("c");
  ASSERT_TRUE(standby);
  EXPECT_TRUE(standby->standby);
  EXPECT_EQ(standby->round, 1);
  c.Step(CoordClock::now());
  EXPECT_EQ(StoredStatus()["standbys"], nlohmann::json::array({"c"}));
  EXPECT_EQ(StoredRound().round, 1);   // no re-round for a standby
}

// Issue #37: the status record is O(N) bytes (about 650 KB at 10,000 nodes). Nodes that join a
// job at MAX together (one watch update, one driver turn) are each made a standby, and the
// status is written once for all of them, not once each.
TEST_F(CoordinatorTest, StandbysThatJoinTogetherCostOneStatusWrite) {
  Coordinator c(etcd_, keys_, config_, host_);
  FormRoundOfTwo(c);
  auto status_version = [&] {
    auto kv = etcd_.Get(keys_.status);
    return kv.ok() && kv->has_value() ? (*kv)->version : int64_t{0};
  };
  const int64_t before = status_version();
  ASSERT_GT(before, 0);
  for (const char* id : {"c", "d", "e", "f"}) Register(id);
  host_.Pump(etcd_, c);
  c.Step(CoordClock::now());
  for (const char* id : {"c", "d", "e", "f"}) {
    auto standby = StoredAssign(id);
    ASSERT_TRUE(standby) << id;
    EXPECT_TRUE(standby->standby) << id;
  }
  EXPECT_EQ(StoredStatus()["standbys"], nlohmann::json::array({"c", "d", "e", "f"}));
  EXPECT_EQ(status_version(), before + 1) << "one status write for the four standbys";
}

TEST_F(CoordinatorTest, AMemberWhoseKeyVanishesIsACrashAndTheNextRoundIsProposed) {
  Coordinator c(etcd_, keys_, config_, host_);
  FormRoundOfTwo(c);
  ASSERT_TRUE(etcd_.Delete(keys_.Node("b")).ok());
  host_.Pump(etcd_, c);
  c.Step(CoordClock::now());
  RoundRecord round = StoredRound();
  EXPECT_EQ(round.round, 2);
  EXPECT_EQ(round.phase, Phase::kProposed);
  EXPECT_FALSE(round.graceful);
  EXPECT_EQ(round.message, "node b is gone");
}

TEST_F(CoordinatorTest, ACoordinatorThatLostTheRoundRecordWritesNoAssignments) {
  Coordinator c(etcd_, keys_, config_, host_);
  RoundRecord gathering;
  gathering.round = 1;
  gathering.coordinator = "a";
  PutRound(gathering);
  Register("a");
  Register("b");
  c.Start();
  c.Step(CoordClock::now());
  PutAck("a", 1, AckState::kAck, 7001);
  PutAck("b", 1, AckState::kAck, 7002);
  host_.Pump(etcd_, c);
  // Meanwhile b took over (it thought a gone): the record a holds is stale.
  RoundRecord taken = StoredRound();
  taken.coordinator = "b";
  taken.round = 2;
  ASSERT_TRUE(etcd_.Put(keys_.round, taken.Encode()).ok());
  const int rereads = host_.rereads;
  c.Step(CoordClock::now());
  EXPECT_FALSE(StoredAssign("a"));
  EXPECT_FALSE(StoredAssign("b"));
  EXPECT_EQ(host_.rereads, rereads + 1);
  EXPECT_EQ(host_.round().coordinator, "b");
}

// Issue #37: the assignment txns of a large round go out a few at a time, not one after another,
// and the active record only after all of them.
TEST_F(CoordinatorTest, AssignmentBatchesAreSentSeveralAtATimeThenTheActiveRecord) {
  constexpr int kNodes = 3 * 127 + 5;   // 4 txns
  AssignWatchingClient client(etcd_, keys_);
  Coordinator c(client, keys_, ManyConfig(kNodes), host_);
  ProposeToMany(c, kNodes);
  c.Step(CoordClock::now());
  EXPECT_EQ(client.sent(), 4);
  EXPECT_GT(client.max_in_flight(), 1);
  const RoundRecord round = StoredRound();
  EXPECT_EQ(round.phase, Phase::kActive);
  EXPECT_EQ(round.nnodes, kNodes);
  auto assigns = etcd_.Range(keys_.assign, {.prefix = true, .count_only = true});
  ASSERT_TRUE(assigns.ok());
  EXPECT_EQ(assigns->count, kNodes);
}

// A failed batch stops the others from being sent (8 at most were in flight) and writes no
// active record: the coordinator re-reads the round record, as for one txn.
TEST_F(CoordinatorTest, AFailedAssignmentBatchWritesNoActiveRecordAndStopsTheRest) {
  constexpr int kNodes = 12 * 127;   // 12 txns, more than are ever in flight at once
  AssignWatchingClient client(etcd_, keys_);
  Coordinator c(client, keys_, ManyConfig(kNodes), host_);
  ProposeToMany(c, kNodes);
  client.FailAssignments();
  const int rereads = host_.rereads;
  c.Step(CoordClock::now());
  EXPECT_LE(client.sent(), 8);
  EXPECT_EQ(StoredRound().phase, Phase::kProposed);
  EXPECT_EQ(host_.rereads, rereads + 1);
}

// A batch that loses its compare (another node took the round record over while they were in
// flight) writes nothing, and no active record is written.
TEST_F(CoordinatorTest, AnAssignmentBatchThatLostTheRoundRecordWritesNoActiveRecord) {
  constexpr int kNodes = 12 * 127;
  AssignWatchingClient client(etcd_, keys_);
  Coordinator c(client, keys_, ManyConfig(kNodes), host_);
  ProposeToMany(c, kNodes);
  client.TakeOverBeforeAssignment(3);
  const int rereads = host_.rereads;
  c.Step(CoordClock::now());
  const RoundRecord round = StoredRound();
  EXPECT_EQ(round.coordinator, "b");
  EXPECT_EQ(round.phase, Phase::kProposed);
  EXPECT_EQ(host_.rereads, rereads + 1);
  EXPECT_EQ(host_.round().coordinator, "b");
  auto assigns = etcd_.Range(keys_.assign, {.prefix = true, .count_only = true});
  ASSERT_TRUE(assigns.ok());
  EXPECT_LT(assigns->count, kNodes);   // the batch sent after the takeover wrote nothing
}

TEST_F(CoordinatorTest, EveryMemberDoneCompletesTheJob) {
  Coordinator c(etcd_, keys_, config_, host_);
  FormRoundOfTwo(c);
  PutAck("a", 1, AckState::kDone);
  PutAck("b", 1, AckState::kDone);
  host_.Pump(etcd_, c);
  c.Step(CoordClock::now());
  EXPECT_EQ(StoredRound().phase, Phase::kComplete);
  auto complete = etcd_.Get(keys_.complete);
  ASSERT_TRUE(complete.ok() && complete->has_value());
  EXPECT_EQ(nlohmann::json::parse((*complete)->value)["round"], 1);
}

TEST_F(CoordinatorTest, AnUnreadableJobAsksForAResyncAndStaysInactive) {
  Coordinator c(etcd_, keys_, config_, host_);
  etcd_.SetUnavailable(true);
  c.Start();
  EXPECT_FALSE(c.active());
  EXPECT_EQ(host_.resyncs, 1);
  etcd_.SetUnavailable(false);
}

}  // namespace
}  // namespace efdl::rdzv
