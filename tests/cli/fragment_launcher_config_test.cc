// `efdl run --world-size N` and `--launcher`: flag checks and the environment each mode gives.
#include <gtest/gtest.h>

#include "agent/agent.h"
#include "cli/run_config.h"
#include "../agent/test_util.h"

namespace efdl::cli {
namespace {

using agent::AgentOptions;
using agent::LauncherEnvironment;
using agent::WorkerEnvironment;
using agent::testing::ExpectVars;

RunFlags Fragmented(int world_size, int nproc) {
  RunFlags f;
  f.etcd_endpoints = {"127.0.0.1:2379"};
  f.job_id = "frag";
  f.node_id = "node-a";
  f.nproc_per_node = nproc;
  f.world_size = world_size;
  f.command = {"sh", "-c", "true"};
  return f;
}

std::string ErrorOf(const RunFlags& f) {
  auto plan = PlanRun(f);
  return plan.ok() ? std::string("(accepted)") : plan.status().message();
}

TEST(FragmentedRunConfigTest, WorldSizeReachesTheRendezvousAndNodesDefaultToOneToN) {
  auto plan = PlanRun(Fragmented(3, 2));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->rendezvous.world_size, 3);
  EXPECT_EQ(plan->rendezvous.min_nodes, 1);
  EXPECT_EQ(plan->rendezvous.max_nodes, 3);
  EXPECT_EQ(plan->agent.max_nodes, 3);
  EXPECT_EQ(plan->agent.world_size, 3);
  EXPECT_FALSE(plan->agent.launcher);
  RunFlags explicit_nodes = Fragmented(8, 3);
  explicit_nodes.nnodes = "2";
  auto two = PlanRun(explicit_nodes);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(two->rendezvous.min_nodes, 2);
  EXPECT_EQ(two->rendezvous.max_nodes, 2);
  // Without --world-size nothing changes: 1:1 and no fragmented mode.
  auto plain = PlanRun(Fragmented(0, 2));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->rendezvous.world_size, 0);
  EXPECT_EQ(plain->rendezvous.max_nodes, 1);
}

TEST(FragmentedRunConfigTest, InconsistentWorldSizeFlagsGetOneClearLine) {
  EXPECT_NE(ErrorOf(Fragmented(-1, 1)).find("--world-size -1 is out of range"),
            std::string::npos);
  EXPECT_NE(ErrorOf(Fragmented(2'000'000, 1)).find("out of range"), std::string::npos);
  EXPECT_NE(ErrorOf(Fragmented(3, 4)).find("exceed --world-size 3"), std::string::npos);
  RunFlags many_nodes = Fragmented(3, 1);
  many_nodes.nnodes = "1:4";
  EXPECT_NE(ErrorOf(many_nodes).find("give at most --nnodes 3"), std::string::npos)
      << ErrorOf(many_nodes);
  RunFlags alone = Fragmented(3, 1);
  alone.etcd_endpoints.clear();
  alone.job_id.clear();
  EXPECT_NE(ErrorOf(alone).find("pass --etcd"), std::string::npos) << ErrorOf(alone);
  // A single node with all N processes needs no shared etcd.
  RunFlags whole = Fragmented(3, 3);
  whole.etcd_endpoints.clear();
  whole.job_id.clear();
  EXPECT_EQ(ErrorOf(whole), "(accepted)");
  for (const RunFlags& f : {Fragmented(-1, 1), Fragmented(3, 4), many_nodes, alone}) {
    std::string message = ErrorOf(f);
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(FragmentedRunConfigTest, LauncherFlagReachesTheAgent) {
  RunFlags f = Fragmented(0, 2);
  f.launcher = true;
  auto plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->agent.launcher);
}

rdzv::Assignment SecondNodeOfOnePlusTwo() {
  return agent::testing::MakeAssignment(4, 1, 2, 1, 2, 3, "10.0.0.1", 29400);
}

AgentOptions Options() {
  AgentOptions o;
  o.job_id = "frag";
  o.node_id = "node-b";
  o.min_nodes = 1;
  o.max_nodes = 3;
  o.snapshot_dir = "/snap";
  return o;
}

TEST(LauncherEnvironmentTest, NodeLevelValuesAreRightForMixedNodeSizes) {
  auto env = LauncherEnvironment(Options(), SecondNodeOfOnePlusTwo(), 2);
  ExpectVars(env, {{"NNODES", "2"}, {"NODE_RANK", "1"}, {"NPROC_PER_NODE", "2"},
                   {"WORLD_SIZE", "3"},
                   {"RANK", "1"},   // the node's first global rank, not node rank x procs (= 2)
                   {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"},
                   {"EFDL_NUM_MAX_WORKERS", "3"}, {"EFDL_ROUND", "4"}, {"EFDL_RESTART_COUNT", "2"},
                   {"LOCAL_RANK", "0"}});
  EXPECT_EQ(env.count("EFDL_CONTROL_SOCKET"), 0u);
  EXPECT_EQ(env.count("LOCAL_WORLD_SIZE"), 0u);
}

TEST(LauncherEnvironmentTest, PerProcessEnvironmentHasTheSpecSection6Variables) {
  auto env = WorkerEnvironment(Options(), SecondNodeOfOnePlusTwo(), 1, 0, "/tmp/x.sock");
  ExpectVars(env, {{"WORLD_SIZE", "3"}, {"RANK", "2"}, {"LOCAL_RANK", "1"},
                   {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"},
                   {"EFDL_NUM_MAX_WORKERS", "3"}, {"NNODES", "2"}, {"NODE_RANK", "1"},
                   {"NPROC_PER_NODE", "2"}, {"EFDL_CONTROL_SOCKET", "/tmp/x.sock"}});
}

}  // namespace
}  // namespace efdl::cli
