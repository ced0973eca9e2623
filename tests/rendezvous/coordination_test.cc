// The coordinator's decisions (coordination.h) without etcd: a view, an event, the action.
#include "rendezvous/coordination.h"
#include "rendezvous/node_rules.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace efdl::rdzv {
namespace {

using std::chrono::milliseconds;

CoordinatorConfig Config(int min_nodes, int max_nodes, int world_size = 0) {
  CoordinatorConfig cfg;
  cfg.job_id = "job";
  cfg.node_id = "a";
  cfg.min_nodes = min_nodes;
  cfg.max_nodes = max_nodes;
  cfg.world_size = world_size;
  cfg.last_call = milliseconds(3000);
  cfg.liveness_window = milliseconds(400);
  return cfg;
}

RoundRecord Round(int64_t r, Phase phase) {
  RoundRecord rec;
  rec.round = r;
  rec.phase = phase;
  rec.coordinator = "a";
  return rec;
}

MemberInfo Node(int64_t create_revision, int nproc = 1) {
  return {create_revision, NodeRecord{"h" + std::to_string(create_revision), nproc, "", ""}};
}

AckRecord Ack(int64_t round, AckState state = AckState::kAck, uint16_t port = 0,
              uint16_t horovod_port = 0) {
  AckRecord a;
  a.round = round;
  a.state = state;
  a.port = port;
  a.horovod_port = horovod_port;
  return a;
}

// A view of an active round whose members are `ids` (ranks in that order).
JobView ActiveView(const std::vector<std::string>& ids) {
  JobView v;
  v.window = milliseconds(400);
  for (size_t i = 0; i < ids.size(); ++i) {
    v.registered.Put(ids[i], Node(static_cast<int64_t>(10 + i)));
    v.members.insert(ids[i]);
    v.prev_rank[ids[i]] = static_cast<int>(i);
    v.assign_keys.insert(ids[i]);
  }
  return v;
}

TEST(CoordinationGatheringTest, WaitsForTheLastCallAfterMinThenProposes) {
  const auto cfg = Config(2, 3);
  const CoordTime t0{};
  JobView v;
  v.registered.Put("a", Node(1));
  const RoundRecord round = Round(1, Phase::kGathering);
  EXPECT_EQ(DecideStep(v, round, cfg, t0).kind, StepAction::Kind::kNone);
  EXPECT_FALSE(v.min_reached_at);

  v.registered.Put("b", Node(2));
  StepAction act = DecideStep(v, round, cfg, t0);
  // Not full and no previous round: wait for the last call, naming the deputies meanwhile.
  EXPECT_EQ(act.kind, StepAction::Kind::kSetDeputies);
  EXPECT_EQ(act.deputies, std::vector<std::string>{"b"});
  ASSERT_TRUE(v.min_reached_at);
  EXPECT_EQ(NextCoordinatorDeadline(v, round, cfg), t0 + cfg.last_call);

  act = DecideStep(v, round, cfg, t0 + cfg.last_call);
  EXPECT_EQ(act.kind, StepAction::Kind::kPropose);
  EXPECT_EQ(act.why, "enough nodes registered");
}

TEST(CoordinationGatheringTest, ProposesAtOnceWhenFullOrAfterAFormedRound) {
  JobView v;
  for (int i = 0; i < 3; ++i) v.registered.Put(std::string(1, static_cast<char>('a' + i)), Node(i));
  EXPECT_EQ(DecideStep(v, Round(1, Phase::kGathering), Config(2, 3), {}).kind,
            StepAction::Kind::kPropose);
  JobView after = v;
  after.registered.Erase("c");
  after.prev_rank = {{"a", 0}, {"b", 1}};   // survivors of a formed round: no last call
  EXPECT_EQ(DecideStep(after, Round(4, Phase::kGathering), Config(2, 3), {}).kind,
            StepAction::Kind::kPropose);
}

TEST(CoordinationGatheringTest, DeputiesAreTheThreeOldestOthersAndNeverTheUnresponsive) {
  JobView v;
  v.registered = {{"a", Node(1)}, {"e", Node(2)}, {"d", Node(3)}, {"c", Node(4)},
                  {"b", Node(5)}};
  v.unresponsive.insert("d");
  StepAction act = DecideStep(v, Round(1, Phase::kGathering), Config(9, 9), {});
  EXPECT_EQ(act.kind, StepAction::Kind::kSetDeputies);
  EXPECT_EQ(act.deputies, (std::vector<std::string>{"e", "c", "b"}));
  RoundRecord named = Round(1, Phase::kGathering);
  named.deputies = act.deputies;
  EXPECT_EQ(DecideStep(v, named, Config(9, 9), {}).kind, StepAction::Kind::kNone);
}

// The gathering step's count and deputies come from the join-order index and the excluded sets
// (O(log N + excluded), issue #37); they must stay what a walk over every registered node says:
// the non-excluded count, and the 3 oldest non-excluded others by create_revision.
TEST(CoordinationGatheringTest, CountAndDeputiesAgreeWithAWalkOverJoinsLeavesAndTheExcluded) {
  auto walk = [](const JobView& v, const std::string& self) {
    int count = 0;
    std::vector<std::pair<int64_t, std::string>> others;
    for (const auto& [id, m] : v.registered) {
      if (v.unresponsive.count(id) || v.leaving.count(id)) continue;
      ++count;
      if (id != self) others.push_back({m.create_revision, id});
    }
    std::sort(others.begin(), others.end());
    std::vector<std::string> deputies;
    for (size_t i = 0; i < others.size() && i < kMaxDeputies; ++i) {
      deputies.push_back(others[i].second);
    }
    return std::make_pair(count, deputies);
  };
  std::mt19937 rng(37);
  const RoundRecord round = Round(1, Phase::kGathering);
  JobView v;
  int64_t revision = 1;
  for (int step = 0; step < 3000; ++step) {
    const std::string id = "n" + std::to_string(rng() % 24);   // "a" (the coordinator) never
    const auto cfg = Config(1, 1000);
    switch (rng() % 6) {
      case 0:
      case 1:   // a join, or a new incarnation of a registered id (a later create_revision)
        OnNodeRegistered(v, round, id, Node(revision++), cfg);
        break;
      case 2:
        OnNodeGone(v, round, id);
        break;
      case 3:   // on its way out
        OnAck(v, round, id, Ack(1, AckState::kLeaving), cfg, {});
        break;
      case 4:   // left out of a proposal (DecideFinalize marks it); a node gone stays marked
        v.unresponsive.insert(id);
        break;
      case 5: {   // a coordinator that takes over reads the same job
        JobSnapshot snap;
        for (const auto& [nid, info] : v.registered) snap.nodes.push_back({nid, info});
        for (const auto& [nid, ack] : v.acks) snap.acks.push_back({nid, ack});
        JobView loaded = LoadJob(snap, round, cfg, {});
        loaded.unresponsive = v.unresponsive;
        v = loaded;
        break;
      }
    }
    if (step % 7 == 0) OnNodeRegistered(v, round, "a", Node(revision++), cfg);
    const auto [count, deputies] = walk(v, "a");
    RoundRecord named = round;
    named.deputies = {"-"};   // never a real node: the step always names its deputies
    const StepAction below = DecideStep(v, named, Config(count + 1, 1000), {});
    ASSERT_EQ(below.kind, StepAction::Kind::kSetDeputies) << "step " << step;
    EXPECT_EQ(below.deputies, deputies) << "step " << step;
    EXPECT_FALSE(v.min_reached_at) << "step " << step;
    if (count == 0) continue;
    DecideStep(v, named, Config(count, 1000), {});
    EXPECT_TRUE(v.min_reached_at) << "step " << step << ": " << count << " nodes count";
  }
}

TEST(CoordinationProposedTest, FinalizesOnceEveryKnownNodeAckedOrTheWindowPassed) {
  const auto cfg = Config(1, 3);
  JobView v;
  v.window = cfg.liveness_window;
  v.registered = {{"a", Node(1)}, {"b", Node(2)}};
  const RoundRecord round = Round(2, Phase::kProposed);
  const CoordTime t0{};
  OnAck(v, round, "a", Ack(2), cfg, t0);
  EXPECT_EQ(v.last_progress, t0);
  EXPECT_EQ(DecideStep(v, round, cfg, t0).kind, StepAction::Kind::kNone);
  EXPECT_EQ(DecideStep(v, round, cfg, t0 + cfg.liveness_window).kind,
            StepAction::Kind::kFinalize);
  OnAck(v, round, "b", Ack(2), cfg, t0);
  EXPECT_EQ(DecideStep(v, round, cfg, t0).kind, StepAction::Kind::kFinalize);
  // An ack of an older round counts for nothing.
  JobView stale = v;
  OnAck(stale, round, "b", Ack(1), cfg, t0);
  EXPECT_EQ(DecideStep(stale, round, cfg, t0).kind, StepAction::Kind::kNone);
}

TEST(CoordinationFinalizeTest, WaitsWhenEnoughAreRegisteredButTooFewAnswered) {
  const auto cfg = Config(2, 3);
  JobView v;
  v.registered = {{"a", Node(1)}, {"b", Node(2)}};
  const RoundRecord round = Round(2, Phase::kProposed);
  OnAck(v, round, "a", Ack(2, AckState::kAck, 7000), cfg, {});
  FinalizeAction act = DecideFinalize(v, round, cfg);
  EXPECT_EQ(act.kind, FinalizeAction::Kind::kWait);
  EXPECT_TRUE(v.unresponsive.empty());   // a stall is no verdict on the silent
}

TEST(CoordinationFinalizeTest, NotFormedGathersAgainUnderANewNumberAndMarksTheSilent) {
  const auto cfg = Config(2, 3);
  JobView v;
  v.registered = {{"a", Node(1)}};
  const RoundRecord round = Round(5, Phase::kProposed);
  FinalizeAction act = DecideFinalize(v, round, cfg);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kNotFormed);
  EXPECT_EQ(act.next.round, 6);
  EXPECT_EQ(act.next.phase, Phase::kGathering);
  EXPECT_EQ(act.history, "round 5 not formed: 0 of at least 2 nodes answered");
  EXPECT_EQ(v.unresponsive, std::set<std::string>{"a"});
}

TEST(CoordinationFinalizeTest, TheRoundUsesAnAgentStoreOnlyWhenItsRankZeroNodeOffersOne) {
  const auto cfg = Config(1, 2);
  for (const bool rank_zero_offers : {true, false}) {
    JobView v;
    v.registered = {{"a", Node(1)}, {"b", Node(2)}};
    const RoundRecord round = Round(3, Phase::kProposed);
    AckRecord first = Ack(3, AckState::kAck, 7001);
    first.agent_store = rank_zero_offers;
    AckRecord second = Ack(3, AckState::kAck, 7002);
    second.agent_store = true;   // b's store does not matter: a leads
    OnAck(v, round, "a", first, cfg, {});
    OnAck(v, round, "b", second, cfg, {});
    FinalizeAction act = DecideFinalize(v, round, cfg);
    ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
    EXPECT_EQ(act.writes[0].first, "a");
    EXPECT_EQ(act.next.master_port, 7001);
    EXPECT_EQ(act.next.agent_store, rank_zero_offers);
  }
}

TEST(CoordinationFinalizeTest, FormsWithSurvivorsFirstStandbysBeyondMaxAndStaleKeysDeleted) {
  const auto cfg = Config(1, 2);
  JobView v;
  v.registered = {{"a", Node(1)}, {"b", Node(2)}, {"c", Node(3)}};
  v.prev_rank = {{"b", 0}};
  v.assign_keys = {"b", "gone"};
  const RoundRecord round = Round(3, Phase::kProposed);
  OnAck(v, round, "a", Ack(3, AckState::kAck, 7001, 8001), cfg, {});
  OnAck(v, round, "b", Ack(3, AckState::kAck, 7002, 8002), cfg, {});
  OnAck(v, round, "c", Ack(3, AckState::kAck, 7003, 8003), cfg, {});
  FinalizeAction act = DecideFinalize(v, round, cfg);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  ASSERT_EQ(act.writes.size(), 3u);
  EXPECT_EQ(act.writes[0].first, "b");   // the survivor keeps rank 0
  EXPECT_EQ(act.writes[0].second.node_rank, 0);
  EXPECT_EQ(act.writes[1].first, "a");
  EXPECT_EQ(act.writes[2].first, "c");
  EXPECT_TRUE(act.writes[2].second.standby);
  EXPECT_EQ(act.stale, std::vector<std::string>{"gone"});
  EXPECT_EQ(act.next.phase, Phase::kActive);
  EXPECT_EQ(act.next.world_size, 2);
  EXPECT_EQ(act.next.master_addr, "h2");
  EXPECT_EQ(act.next.master_port, 7002);
  EXPECT_EQ(act.next.horovod_port, 8002);   // rank 0's second offer
  EXPECT_EQ(act.next.deputies, (std::vector<std::string>{"b", "c"}));   // never itself ("a")

  AssignmentsWritten(v, act);
  EXPECT_EQ(v.members, (std::set<std::string>{"a", "b"}));
  EXPECT_EQ(v.standbys, std::set<std::string>{"c"});
  EXPECT_EQ(v.prev_rank, (std::map<std::string, int>{{"b", 0}, {"a", 1}}));
  EXPECT_EQ(v.assign_keys, (std::set<std::string>{"a", "b", "c"}));
}

TEST(CoordinationActiveTest, AJoinBelowMaxIsAGracefulReroundAndAtMaxAStandby) {
  const RoundRecord round = Round(4, Phase::kActive);
  JobView v = ActiveView({"a", "b"});
  EventOutcome out = OnNodeRegistered(v, round, "c", Node(30), Config(1, 3));
  EXPECT_TRUE(out.make_standby.empty());
  EXPECT_TRUE(v.reround);
  EXPECT_TRUE(v.reround_graceful);
  EXPECT_EQ(v.reround_why, "node c joined");

  JobView full = ActiveView({"a", "b"});
  out = OnNodeRegistered(full, round, "c", Node(30), Config(1, 2));
  EXPECT_EQ(out.make_standby, std::vector<std::string>{"c"});
  EXPECT_FALSE(full.reround);
  EXPECT_EQ(StandbyAssigned(full, "c", Config(1, 2)),
            "node c is a standby (the job is at its maximum of 2 nodes)");
  EXPECT_TRUE(full.standbys.count("c"));

  // Fragmented mode: a running round adds up to the world size; a newcomer only waits.
  JobView fragmented = ActiveView({"a", "b"});
  out = OnNodeRegistered(fragmented, round, "c", Node(30), Config(1, 8, 2));
  EXPECT_EQ(out.make_standby, std::vector<std::string>{"c"});
}

TEST(CoordinationActiveTest, ALeaverIsGracefulACrashIsNotAndACrashStaysACrash) {
  const RoundRecord round = Round(4, Phase::kActive);
  const auto cfg = Config(1, 3);
  JobView v = ActiveView({"a", "b", "c"});
  OnAck(v, round, "b", Ack(4, AckState::kLeaving), cfg, {});
  EventOutcome out = OnNodeGone(v, round, "b");
  EXPECT_EQ(out.history, std::vector<std::string>{"node b left"});
  EXPECT_TRUE(v.reround && v.reround_graceful);
  EXPECT_FALSE(v.prev_rank.count("b"));

  out = OnNodeGone(v, round, "c");   // its lease ended: it crashed
  EXPECT_EQ(out.history, std::vector<std::string>{"node c is gone (lease ended)"});
  EXPECT_FALSE(v.reround_graceful);
  EXPECT_EQ(v.reround_why, "node c is gone");
  OnNodeRegistered(v, round, "d", Node(40), cfg);   // a join after it keeps the crash
  EXPECT_FALSE(v.reround_graceful);

  StepAction act = DecideStep(v, round, cfg, {});
  ASSERT_EQ(act.kind, StepAction::Kind::kPropose);
  EXPECT_FALSE(act.graceful);
  RoundRecord next = BeginProposal(v, round, cfg, act.graceful, act.why);
  EXPECT_EQ(next.round, 5);
  EXPECT_EQ(next.phase, Phase::kProposed);
  EXPECT_EQ(next.master_port, 0);
  EXPECT_FALSE(v.reround);
  EXPECT_TRUE(v.reround_graceful);   // the next change starts graceful again
}

TEST(CoordinationActiveTest, AMembersFailedAckReroundsButNotAStandbys) {
  const RoundRecord round = Round(4, Phase::kActive);
  const auto cfg = Config(1, 2);
  JobView v = ActiveView({"a", "b"});
  v.registered.Put("s", Node(50));
  v.standbys.insert("s");
  OnAck(v, round, "s", Ack(4, AckState::kFailed), cfg, {});
  EXPECT_FALSE(v.reround);
  OnAck(v, round, "b", Ack(3, AckState::kFailed), cfg, {});   // about an older round
  EXPECT_FALSE(v.reround);
  OnAck(v, round, "b", Ack(4, AckState::kFailed), cfg, {});
  EXPECT_TRUE(v.reround);
  EXPECT_FALSE(v.reround_graceful);
  EXPECT_EQ(v.reround_why, "workers of node b failed");
}

TEST(CoordinationActiveTest, ALateAckIsAJoinAndDoublesTheWindowUpToEightTimes) {
  const RoundRecord round = Round(4, Phase::kActive);
  const auto cfg = Config(1, 3);
  JobView v = ActiveView({"a"});
  v.window = cfg.liveness_window;
  v.registered.Put("late", Node(20));
  v.unresponsive.insert("late");
  OnAck(v, round, "late", Ack(3), cfg, {});
  EXPECT_FALSE(v.unresponsive.count("late"));
  EXPECT_EQ(v.reround_why, "node late is back");
  EXPECT_EQ(v.window, cfg.liveness_window * 2);
  for (int i = 0; i < 5; ++i) OnAck(v, round, "late", Ack(3), cfg, {});
  EXPECT_EQ(v.window, cfg.liveness_window * 8);
}

TEST(CoordinationActiveTest, CompletesWhenEveryMemberIsDoneBeforeAnyReround) {
  const RoundRecord round = Round(4, Phase::kActive);
  const auto cfg = Config(1, 3);
  JobView v = ActiveView({"a", "b"});
  OnAck(v, round, "a", Ack(4, AckState::kDone), cfg, {});
  EXPECT_EQ(DecideStep(v, round, cfg, {}).kind, StepAction::Kind::kNone);
  OnAck(v, round, "b", Ack(4, AckState::kDone), cfg, {});
  v.WantReround(true, "node c joined");
  EXPECT_EQ(DecideStep(v, round, cfg, {}).kind, StepAction::Kind::kComplete);
  RoundRecord done = CompletionRecord(round);
  EXPECT_EQ(done.phase, Phase::kComplete);
  EXPECT_EQ(done.message, "job complete: every worker of round 4 succeeded");
}

// The done count the active step tests first follows each member's newest ack, also in a view
// a coordinator loaded when it took over.
TEST(CoordinationActiveTest, ATakenOverRoundWhoseMembersAreAllDoneCompletesAndALaterAckCounts) {
  const RoundRecord round = Round(4, Phase::kActive);
  const auto cfg = Config(1, 3);
  JobSnapshot snap;
  snap.nodes = {{"a", Node(1)}, {"b", Node(2)}};
  snap.acks = {{"a", Ack(4, AckState::kDone)}, {"b", Ack(4, AckState::kDone)}};
  snap.assigns = {{"a", 10, AssignRecord{4, 0, 0, false}}, {"b", 10, AssignRecord{4, 1, 1, false}}};
  JobView v = LoadJob(snap, round, cfg, {});
  EXPECT_EQ(DecideStep(v, round, cfg, {}).kind, StepAction::Kind::kComplete);
  OnAck(v, round, "b", Ack(4, AckState::kFailed), cfg, {});
  EXPECT_NE(DecideStep(v, round, cfg, {}).kind, StepAction::Kind::kComplete);
  OnAck(v, round, "b", Ack(4, AckState::kDone), cfg, {});
  OnAckDeleted(v, "a");
  EXPECT_NE(DecideStep(v, round, cfg, {}).kind, StepAction::Kind::kComplete);
  OnAck(v, round, "a", Ack(4, AckState::kDone), cfg, {});
  EXPECT_EQ(DecideStep(v, round, cfg, {}).kind, StepAction::Kind::kComplete);
}

// --- Blame (issue #32): the cause of a round change a worker failure started, named when the
// next round is decided (NameCause).

// An ack of `round` carrying the node's outcome of round 4.
AckRecord AckWith(int64_t round, const char* outcome, const std::string& detail = "") {
  AckRecord a = Ack(round, AckState::kAck, 7000);
  a.prev_round = 4;
  a.prev_outcome = outcome;
  a.prev_detail = detail;
  return a;
}

// Round 5 proposed after round 4 of a, b, c broke: the nodes' outcomes of round 4 come with
// their acks.
JobView BrokenRoundFour() {
  JobView v = ActiveView({"a", "b", "c"});
  v.members.clear();
  v.formed_round = 4;
  return v;
}

RoundRecord FailureProposalOfFive() {
  RoundRecord r = Round(5, Phase::kProposed);
  r.graceful = false;
  r.message = "the workers of node b lost a peer (rank 1 exited with status 1); the cause is on "
              "another node";
  return r;
}

// The blame cases: round 5 proposed after round 4 of a, b, c broke (MIN 1, MAX 3); a case acks
// with the nodes' outcomes of round 4 and decides the proposal's end.
class CoordinationBlameTest : public ::testing::Test {
 protected:
  void Acked(const char* node, const char* outcome, const std::string& detail = "") {
    OnAck(v_, round_, node, AckWith(5, outcome, detail), cfg_, {});
  }
  const CoordinatorConfig cfg_ = Config(1, 3);
  JobView v_ = BrokenRoundFour();
  const RoundRecord round_ = FailureProposalOfFive();
};

TEST_F(CoordinationBlameTest, ANodeThatStoppedAnsweringIsTheCauseNotTheSurvivorThatReported) {
  Acked("b", kOutcomeLost, "rank 1 exited with status 1");
  Acked("a", kOutcomeLost, "rank 0 exited with status 1");
  // c (SIGKILLed: its lease still runs) never acks; the window ends the proposal.
  FinalizeAction act = DecideFinalize(v_, round_, cfg_);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message,
            "node c stopped answering (it did not ack the next round); the collectives of "
            "node(s) a, b lost it");
  EXPECT_NE(act.history.find("; the cause: node c stopped answering"), std::string::npos)
      << act.history;
  for (const auto& w : act.writes) EXPECT_FALSE(w.second.early_exit) << w.first;
}

TEST_F(CoordinationBlameTest, ANodeWhoseLeaseEndedDuringTheProposalIsGone) {
  Acked("b", kOutcomeLost);
  OnNodeGone(v_, round_, "c");
  Acked("a", kOutcomeLost);
  FinalizeAction act = DecideFinalize(v_, round_, cfg_);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message,
            "node c is gone (its lease ended or it left); the collectives of node(s) a, b lost "
            "it");
  // A new round formed: its members are what the next cause looks at.
  AssignmentsWritten(v_, act);
  EXPECT_EQ(v_.formed_round, 5);
  EXPECT_TRUE(v_.gone_members.empty());
}

TEST_F(CoordinationBlameTest, AMembersOwnFailureIsTheCauseWhicheverReportCameFirst) {
  Acked("b", kOutcomeLost, "rank 1 exited with status 1");
  Acked("c", kOutcomeFailed, "rank 2 exited with status 1");
  FinalizeAction act = DecideFinalize(v_, round_, cfg_);   // a did not answer: c's failure counts
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message, "workers of node c failed: rank 2 exited with status 1");
}

TEST_F(CoordinationBlameTest, WorkersThatExitedZeroWhileTheirPeersTrainedAreTheCause) {
  Acked("b", kOutcomeLost, "rank 1 exited with status 1");
  Acked("a", kOutcomeDone, "rank 0");
  Acked("c", kOutcomeLost, "rank 2 exited with status 1");
  FinalizeAction act = DecideFinalize(v_, round_, cfg_);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message,
            "workers of node a failed: rank 0 exited 0 before the job completed; the "
            "collectives of node(s) b, c lost it");
  // a is told so in its assignment (and counts it); its peers are not.
  for (const auto& w : act.writes) EXPECT_EQ(w.second.early_exit, w.first == "a") << w.first;
}

TEST_F(CoordinationBlameTest, NoCollectiveLostAPeerTheProposalsReasonStandsAndNobodyExitedEarly) {
  const auto cfg = Config(1, 4);
  // A node joined while a's workers had exited 0 and b's were still finishing (the job's end):
  // a graceful change names nobody.
  JobView v = BrokenRoundFour();
  RoundRecord round = Round(5, Phase::kProposed);
  round.graceful = true;
  round.message = "node d joined";
  v.registered.Put("d", Node(40));
  OnAck(v, round, "a", AckWith(5, kOutcomeDone, "rank 0"), cfg, {});
  for (const char* id : {"b", "c", "d"}) OnAck(v, round, id, Ack(5, AckState::kAck, 7000), cfg, {});
  FinalizeAction act = DecideFinalize(v, round, cfg);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message, "node d joined");
  for (const auto& w : act.writes) EXPECT_FALSE(w.second.early_exit) << w.first;

  // Not graceful, but every report an own failure (c's program raised, b exited 0 at its end):
  // the own failure's proposal stands, and b's exit is not blamed.
  JobView own = BrokenRoundFour();
  RoundRecord failed = Round(5, Phase::kProposed);
  failed.message = "workers of node c failed: rank 2 exited with status 1";
  OnAck(own, failed, "a", Ack(5, AckState::kAck, 7000), cfg, {});
  OnAck(own, failed, "b", AckWith(5, kOutcomeDone, "rank 1"), cfg, {});
  OnAck(own, failed, "c", AckWith(5, kOutcomeFailed, "rank 2 exited with status 1"), cfg, {});
  act = DecideFinalize(own, failed, cfg);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message, failed.message);
  for (const auto& w : act.writes) EXPECT_FALSE(w.second.early_exit) << w.first;
}

TEST_F(CoordinationBlameTest, AnOutcomeOfAnOlderRoundSaysNothingAboutThisOne) {
  AckRecord old = AckWith(5, kOutcomeDone, "rank 0");
  old.prev_round = 3;   // a's workers exited 0 in round 3, not in the round that broke
  OnAck(v_, round_, "a", old, cfg_, {});
  Acked("b", kOutcomeLost);
  Acked("c", kOutcomeLost);
  FinalizeAction act = DecideFinalize(v_, round_, cfg_);
  ASSERT_EQ(act.kind, FinalizeAction::Kind::kForm);
  EXPECT_EQ(act.next.message, "the collectives of node(s) b, c lost a peer; no node named the "
                              "cause");
  for (const auto& w : act.writes) EXPECT_FALSE(w.second.early_exit) << w.first;
}

// The reason node b's failed ack of round 4 (with that outcome and detail) gives the re-round.
std::string ReroundWhyOfFailedAck(const char* outcome, const std::string& detail) {
  JobView v = ActiveView({"a", "b"});
  AckRecord ack = Ack(4, AckState::kFailed);
  ack.prev_round = 4;
  ack.prev_outcome = outcome;
  ack.prev_detail = detail;
  OnAck(v, Round(4, Phase::kActive), "b", ack, Config(1, 3), {});
  EXPECT_TRUE(v.reround);
  return v.reround_why;
}

TEST_F(CoordinationBlameTest, AFailedAckOfALostPeerDoesNotCallThatNodesWorkersFailed) {
  EXPECT_EQ(ReroundWhyOfFailedAck(kOutcomeLost, ""), "the workers of node b lost a peer");
}

TEST_F(CoordinationBlameTest, AFailedAckWithItsOwnDetailNamesTheRankAndHow) {
  EXPECT_EQ(ReroundWhyOfFailedAck(kOutcomeFailed, "rank 1 exited with status 1"),
            "workers of node b failed: rank 1 exited with status 1");
}

TEST_F(CoordinationBlameTest, AFailureProposalOfALostPeerDoesNotSayTheReportersWorkersFailed) {
  RoundRecord active = Round(4, Phase::kActive);
  const RoundRecord own = FailureProposal(active, "b", "rank 1 exited with status 1");
  EXPECT_EQ(own.message, "workers of node b failed: rank 1 exited with status 1");
  const RoundRecord lost = FailureProposal(active, "b", "rank 1 exited with status 1", true);
  EXPECT_EQ(lost.message, "the workers of node b lost a peer (rank 1 exited with status 1); the "
                          "cause is on another node");
  EXPECT_EQ(lost.round, 5);
  EXPECT_FALSE(lost.graceful);
}

TEST_F(CoordinationBlameTest, ATakeoverKnowsTheFormedRoundAndItsVanishedMembers) {
  JobSnapshot snap;
  snap.nodes = {{"a", Node(1)}, {"b", Node(2)}};
  snap.assigns = {{"a", 5, AssignRecord{4, 0, 0, false}}, {"b", 6, AssignRecord{4, 1, 1, false}},
                  {"c", 7, AssignRecord{4, 2, 2, false}}};
  const JobView v = LoadJob(snap, FailureProposalOfFive(), Config(1, 3), {});
  EXPECT_EQ(v.formed_round, 4);
  EXPECT_EQ(v.gone_members, std::set<std::string>{"c"});
}

TEST(CoordinationLoadTest, ATakeoverRebuildsTheRoundAndReroundsForTheVanishedAndTheRestarted) {
  JobSnapshot snap;
  snap.nodes = {{"a", Node(1)}, {"b", Node(2)}, {"r", Node(90)}, {"s", Node(4)}};
  snap.acks = {{"a", Ack(7)}, {"s", Ack(7, AckState::kLeaving)}};
  snap.assigns = {{"a", 60, AssignRecord{7, 0, 0, false}},
                  {"b", 60, AssignRecord{7, 1, 1, false}},
                  {"gone", 60, AssignRecord{7, 2, 2, false}},
                  // registered again (revision 90) after its assignment (60): a restarted agent
                  {"r", 60, AssignRecord{7, 3, 3, false}},
                  {"s", 60, AssignRecord{7, 0, 0, true}},
                  {"bad", 60, std::nullopt}};
  const RoundRecord round = Round(7, Phase::kActive);
  const CoordTime t0{};
  JobView v = LoadJob(snap, round, Config(1, 9), t0);
  EXPECT_EQ(v.members, (std::set<std::string>{"a", "b"}));
  EXPECT_EQ(v.standbys, std::set<std::string>{"s"});
  EXPECT_EQ(v.leaving, std::set<std::string>{"s"});
  EXPECT_EQ(v.prev_rank, (std::map<std::string, int>{{"a", 0}, {"b", 1}, {"gone", 2}}));
  EXPECT_EQ(v.assign_keys.size(), 6u);
  EXPECT_EQ(v.round_acks.ack, std::set<std::string>{"a"});
  EXPECT_TRUE(v.reround);
  EXPECT_FALSE(v.reround_graceful);
  EXPECT_EQ(v.reround_why, "node r restarted");
  EXPECT_EQ(v.last_progress, t0);
  EXPECT_EQ(v.window, milliseconds(400));

  // Gathering: nothing to re-form, the previous ranks are kept for the planner.
  JobView g = LoadJob(snap, Round(8, Phase::kGathering), Config(1, 9), t0);
  EXPECT_FALSE(g.reround);
  EXPECT_TRUE(g.members.empty());
  EXPECT_EQ(g.prev_rank.size(), 3u);
}

TEST(CoordinationSuccessionTest, ATakeoverProposesTheNextRoundUnlessGathering) {
  RoundRecord active = Round(3, Phase::kActive);
  active.coordinator = "old";
  active.deputies = {"x", "me"};
  active.graceful = true;
  RoundRecord next = TakeOverRecord(active, "me");
  EXPECT_EQ(next.coordinator, "me");
  EXPECT_EQ(next.deputies, std::vector<std::string>{"x"});
  EXPECT_EQ(next.round, 4);
  EXPECT_EQ(next.phase, Phase::kProposed);
  EXPECT_FALSE(next.graceful);
  EXPECT_EQ(next.message, "coordinator old is gone; me took over");

  RoundRecord resumed = Round(9, Phase::kGathering);
  resumed.coordinator.clear();
  resumed.message = "resumed from step 40";
  next = TakeOverRecord(resumed, "me");
  EXPECT_EQ(next.round, 9);
  EXPECT_EQ(next.phase, Phase::kGathering);
  EXPECT_EQ(next.message, "resumed from step 40");
}

TEST(CoordinationSuccessionTest, AHandOverIsGracefulAndClearsTheOldRoundsPlace) {
  RoundRecord active = Round(3, Phase::kActive);
  active.deputies = {"b", "c"};
  active.master_port = 5000;
  active.world_size = 4;
  RoundRecord next = HandOverRecord(active, "a", "b");
  EXPECT_EQ(next.coordinator, "b");
  EXPECT_EQ(next.deputies, std::vector<std::string>{"c"});
  EXPECT_TRUE(next.graceful);
  EXPECT_EQ(next.round, 4);
  EXPECT_EQ(next.phase, Phase::kProposed);
  EXPECT_EQ(next.master_port, 0);
  EXPECT_EQ(next.world_size, 0);
  EXPECT_EQ(next.message, "node a left (it was the coordinator; b took over)");
}

}  // namespace
}  // namespace efdl::rdzv
