// StragglerWatch alone (issue #31 step 1, issue #32 part 3): a few nodes' watches on a fake
// clock, fed progress reports as their boards would show them, sharing one in-memory stand-in
// for the job's compute/<node> and stragglers records in etcd.
#include "agent/straggler_watch.h"

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "queued_rendezvous.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The job's records as etcd would hold them, and every summary published, in order.
struct FakeRecords {
  std::map<std::string, rdzv::ComputeRecord> compute;             // compute/<node>
  std::vector<std::pair<std::string, rdzv::ComputeRecord>> published;
  std::optional<rdzv::StragglerRecord> stragglers;                  // stragglers
  int straggler_writes = 0;
};

// One node's rendezvous: the four calls of the watch, on the shared records.
class RecordsRendezvous : public testing::QueuedRendezvous {
 public:
  RecordsRendezvous(std::string node, FakeRecords& records)
      : node_(std::move(node)), records_(records) {}
  void PublishCompute(const rdzv::ComputeRecord& record) override {
    records_.compute[node_] = record;
    records_.published.emplace_back(node_, record);
  }
  Result<std::map<std::string, rdzv::ComputeRecord>> ReadCompute() override {
    return records_.compute;
  }
  Status RecordStragglers(const rdzv::StragglerRecord& record) override {
    records_.stragglers = record;
    ++records_.straggler_writes;
    return Status::OK();
  }
  Result<std::optional<rdzv::StragglerRecord>> ReadStragglers() override {
    return records_.stragglers;
  }
  const std::string& node() const { return node_; }

 private:
  std::string node_;
  FakeRecords& records_;
};

// A node of the job: its watch, its place in the round and its ranks' running compute totals
// (each rank takes `step_s` of compute per step, 10 steps per second of the fake clock).
struct Node {
  Node(const std::string& id, int node_rank, int nnodes, double secs_per_step,
       const StragglerWatch::Config& base, FakeRecords& records)
      : rdzv(id, records), watch(WithId(base, id), rdzv), step_s(secs_per_step) {
    place.round = 7;
    place.nnodes = nnodes;
    place.node_rank = node_rank;
    place.rank_offset = node_rank;   // one rank per node
  }
  static StragglerWatch::Config WithId(StragglerWatch::Config c, const std::string& id) {
    c.node_id = id;
    return c;
  }
  // One loop turn of the agent at `now`: a sample when one is due.
  std::optional<StragglerWatch::Eviction> Turn(Clock::time_point now) {
    if (!watch.SampleDue(now)) return std::nullopt;
    health::HangMonitor::RankSample r;
    r.local_rank = 0;
    r.compute_steps = steps;
    r.compute_ns = static_cast<int64_t>(static_cast<double>(steps) * step_s * 1e9);
    steps += 10;
    return watch.Sample(now, place, {r});
  }

  RecordsRendezvous rdzv;
  StragglerWatch watch;
  rdzv::Assignment place;
  double step_s;
  int64_t steps = 0;
};

class StragglerWatchTest : public ::testing::Test {
 protected:
  StragglerWatchTest() {
    config_.policy.factor = 2.0;
    config_.policy.window = 6s;   // a summary every 2 s (kWindowsToName = 3)
    config_.job_id = "job";
    config_.min_nodes = 1;
    config_.exclude_cooldown = 300s;
  }
  // Nodes a (node rank 0: the judge), b and c; b computes 5x longer per step.
  void ThreeNodes() {
    for (const auto& [id, step_s] : {std::pair{"a", 0.1}, {"b", 0.5}, {"c", 0.1}}) {
      nodes_.push_back(std::make_unique<Node>(id, static_cast<int>(nodes_.size()), 3, step_s,
                                              config_, records_));
    }
  }
  // Loop turns every 100 ms of the fake clock until `until` after the start; the evictions the
  // watches asked for, by node. An evicted node's workers stop (the Agent's part): it is not
  // sampled again.
  std::map<std::string, StragglerWatch::Eviction> RunUntil(std::chrono::milliseconds until) {
    std::map<std::string, StragglerWatch::Eviction> evicted;
    for (; elapsed_ <= until; elapsed_ += 100ms) {
      for (auto& n : nodes_) {
        if (evicted.count(n->rdzv.node())) continue;
        if (auto e = n->Turn(start_ + elapsed_)) evicted.emplace(n->rdzv.node(), *e);
      }
    }
    return evicted;
  }

  StragglerWatch::Config config_;
  FakeRecords records_;
  std::vector<std::unique_ptr<Node>> nodes_;
  const Clock::time_point start_ = Clock::time_point{} + 1000s;
  std::chrono::milliseconds elapsed_{0};
};

TEST_F(StragglerWatchTest, PublishesOneSummaryPerPeriod) {
  nodes_.push_back(std::make_unique<Node>("a", 1, 2, 0.1, config_, records_));
  nodes_[0]->place.rank_offset = 4;
  RunUntil(10s);
  // The first summary a full period after the round began, then one per period: 2, 4, ..., 10 s.
  ASSERT_EQ(records_.published.size(), 5u);
  for (size_t i = 0; i < records_.published.size(); ++i) {
    const rdzv::ComputeRecord& rec = records_.published[i].second;
    EXPECT_EQ(records_.published[i].first, "a");
    EXPECT_EQ(rec.round, 7);
    EXPECT_EQ(rec.seq, static_cast<int64_t>(i) + 1);
    ASSERT_EQ(rec.compute_s.size(), 1u);
    EXPECT_NEAR(rec.compute_s.at(4), 0.1, 1e-6);   // the global rank: offset + local rank
  }
  EXPECT_FALSE(records_.stragglers.has_value());   // node rank 1 does not judge
}

TEST_F(StragglerWatchTest, TheJudgeNamesANodeSlowerThanFactorTimesTheMedian) {
  ThreeNodes();
  // Two slow summaries of b (at 2 and 4 s, judged at 3 and 5 s): not yet a straggler.
  EXPECT_TRUE(RunUntil(6s).empty());
  EXPECT_FALSE(records_.stragglers.has_value());
  // The third (6 s, judged at 7 s) names it; without --evict-stragglers it stays.
  EXPECT_TRUE(RunUntil(12s).empty());
  ASSERT_TRUE(records_.stragglers.has_value());
  const rdzv::StragglerRecord& rec = *records_.stragglers;
  EXPECT_EQ(rec.round, 7);
  EXPECT_EQ(rec.judge, "a");
  EXPECT_EQ(rec.factor, 2.0);
  EXPECT_EQ(rec.window_s, 6.0);
  ASSERT_EQ(rec.nodes.size(), 1u);
  EXPECT_EQ(rec.nodes[0].id, "b");
  EXPECT_EQ(rec.nodes[0].ranks, std::vector<int>{1});
  EXPECT_NEAR(rec.nodes[0].compute_s, 0.5, 1e-6);
  EXPECT_NEAR(rec.nodes[0].median_s, 0.1, 1e-6);
  EXPECT_EQ(rec.nodes[0].windows, 3);
  EXPECT_FALSE(rec.nodes[0].since.empty());
  EXPECT_EQ(records_.straggler_writes, 1);   // written when it changed, not every period
}

TEST_F(StragglerWatchTest, ANamedStragglerAsksForEvictionWithEvictStragglers) {
  config_.policy.evict = true;
  config_.min_nodes = 2;   // a and c go on without b
  ThreeNodes();
  const auto evicted = RunUntil(12s);
  ASSERT_EQ(evicted.size(), 1u);
  ASSERT_TRUE(evicted.count("b"));
  const StragglerWatch::Eviction& e = evicted.at("b");
  EXPECT_EQ(e.cooldown, 300s);   // the first exclusion: --exclude-cooldown
  EXPECT_EQ(e.record.cause, "straggler");
  EXPECT_EQ(e.record.exclusion, 1);
  EXPECT_EQ(e.record.failures, 0);
  EXPECT_NE(e.record.reason.find("straggler in round 7: rank 1"), std::string::npos)
      << e.record.reason;
  EXPECT_FALSE(e.record.until.empty());
}

TEST_F(StragglerWatchTest, NoEvictionBelowMinNodes) {
  config_.policy.evict = true;
  config_.min_nodes = 3;   // the job cannot go on with a and c only
  ThreeNodes();
  EXPECT_TRUE(RunUntil(20s).empty());
  ASSERT_TRUE(records_.stragglers.has_value());   // named all the same
  ASSERT_EQ(records_.stragglers->nodes.size(), 1u);
  EXPECT_EQ(records_.stragglers->nodes[0].id, "b");
}

}  // namespace
}  // namespace efdl::agent
