// The Coordinator carrying out its decisions against the in-memory etcd: what it writes, and
// that a coordinator that lost the round record writes nothing more.
#include "rendezvous/coordinator.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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
  EXPECT_EQ(StoredStatus()["standbys"], nlohmann::json::array({"c"}));
  c.Step(CoordClock::now());
  EXPECT_EQ(StoredRound().round, 1);   // no re-round for a standby
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
