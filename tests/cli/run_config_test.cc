#include "cli/run_config.h"
#include "snapshot/arena_dir.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace efdl::cli {
namespace {

using agent::AgentOptions;
using agent::LauncherEnvironment;
using agent::WorkerEnvironment;

RunFlags Valid() {
  RunFlags f;
  f.etcd_endpoints = {"127.0.0.1:2379"};
  f.job_id = "job-1";
  f.nnodes = "2:3";
  f.nproc_per_node = 2;
  f.node_id = "node-a";
  f.command = {"sh", "-c", "true"};
  return f;
}

TEST(RunConfigTest, NodeRangeAcceptsNAndMinMax) {
  auto one = ParseNodeRange("4");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->min, 4);
  EXPECT_EQ(one->max, 4);
  auto range = ParseNodeRange("2:5");
  ASSERT_TRUE(range.ok());
  EXPECT_EQ(range->min, 2);
  EXPECT_EQ(range->max, 5);
}

TEST(RunConfigTest, NodeRangeRejectsMinAboveMaxAndJunk) {
  auto inverted = ParseNodeRange("3:2");
  ASSERT_FALSE(inverted.ok());
  EXPECT_NE(inverted.status().message().find("MIN 3 is greater than MAX 2"), std::string::npos);
  for (const char* bad : {"", "0", "-1", "a:b", "2:", ":3", "1:2:3", "1.5"}) {
    EXPECT_FALSE(ParseNodeRange(bad).ok()) << bad;
  }
}

TEST(RunConfigTest, IdsMustBeSafeAsEtcdKeySegments) {
  EXPECT_TRUE(ValidateId("job id", "my-job_1.v2").ok());
  for (const char* bad : {"", "a/b", "has space", "..", ".hidden", "-x", "ü"}) {
    Status s = ValidateId("job id", bad);
    EXPECT_FALSE(s.ok()) << bad;
  }
  EXPECT_FALSE(ValidateId("job id", std::string(129, 'a')).ok());
}

TEST(RunConfigTest, ValidFlagsBecomeAgentAndRendezvousOptions) {
  auto plan = PlanRun(Valid());
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_FALSE(plan->embedded_etcd);
  EXPECT_EQ(plan->agent.nproc, 2);
  EXPECT_EQ(plan->agent.min_nodes, 2);
  EXPECT_EQ(plan->agent.max_nodes, 3);
  EXPECT_EQ(plan->rendezvous.nproc, 2);
  EXPECT_EQ(plan->rendezvous.advertise_addr, "127.0.0.1");  // loopback etcd
  EXPECT_EQ(plan->rendezvous.ttl, std::chrono::seconds(10));
  EXPECT_EQ(plan->agent.snapshot_dir.front(), '/');          // made absolute for the workers
}

TEST(RunConfigTest, NetworkOverridesThisHostDoesNotHaveAreOneClearLine) {
  RunFlags f = Valid();
  f.advertise_addr = "203.0.113.7";   // documentation range: never an address of this host
  auto addr = PlanRun(f);
  ASSERT_FALSE(addr.ok());
  EXPECT_NE(addr.status().message().find("--advertise-addr 203.0.113.7 is not an address of "
                                         "this host"), std::string::npos)
      << addr.status().message();
  f.advertise_addr.clear();
  f.iface = "efdl-no-such-if0";
  auto iface = PlanRun(f);
  ASSERT_FALSE(iface.ok());
  EXPECT_NE(iface.status().message().find("--iface efdl-no-such-if0"), std::string::npos)
      << iface.status().message();
  f.iface = "lo";
  auto lo = PlanRun(f);
  ASSERT_TRUE(lo.ok()) << lo.status().ToString();
  EXPECT_EQ(lo->agent.gloo_iface, "lo");
  EXPECT_EQ(lo->rendezvous.advertise_addr, "127.0.0.1");
  f.iface.clear();
  f.advertise_addr = "localhost";   // a name becomes its numeric address (MASTER_ADDR)
  auto named = PlanRun(f);
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  EXPECT_TRUE(named->rendezvous.advertise_addr == "127.0.0.1" ||
              named->rendezvous.advertise_addr == "::1")
      << named->rendezvous.advertise_addr;
}

TEST(RunConfigTest, MissingCommandIsAClearError) {
  RunFlags f = Valid();
  f.command = {"efdl-surely-not-a-command"};
  auto plan = PlanRun(f);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("efdl-surely-not-a-command"), std::string::npos);
  f.command.clear();
  EXPECT_FALSE(PlanRun(f).ok());
}

TEST(RunConfigTest, WithoutEtcdTheJobIsSingleNodeWithAnIdOfItsProgram) {
  RunFlags f = Valid();
  f.etcd_endpoints.clear();
  f.job_id.clear();
  f.nnodes = "1";
  f.command = {"/usr/bin/python3", "-u", "examples/train.py", "--epochs", "1"};
  auto plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->embedded_etcd);
  // The id the program's State derives when run without an agent: per program, not one word.
  EXPECT_EQ(plan->agent.job_id, snapshot::LocalJobId("examples/train.py"));
  EXPECT_TRUE(plan->agent.job_id.starts_with("local-train-")) << plan->agent.job_id;
  f.command = {"/usr/bin/python3", "examples/other.py"};
  auto other = PlanRun(f);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->agent.job_id, plan->agent.job_id);
  f.nnodes = "2:3";
  auto multi = PlanRun(f);
  ASSERT_FALSE(multi.ok());
  EXPECT_NE(multi.status().message().find("--etcd"), std::string::npos);
}

TEST(RunConfigTest, JobProgramIsTheScriptModuleOrExecutable) {
  EXPECT_EQ(JobProgram({"python3", "-u", "-W", "ignore", "t.py", "--x"}), "t.py");
  EXPECT_EQ(JobProgram({"/usr/bin/python3", "-m", "pkg.train", "--x"}), "pkg.train");
  EXPECT_EQ(JobProgram({"python3", "-c", "print(1)"}), "");
  EXPECT_EQ(JobProgram({"examples/launcher_torchrun.sh", "--epochs", "1"}),
            "examples/launcher_torchrun.sh");
  EXPECT_EQ(JobProgram({}), "");
}

TEST(RunConfigTest, JobIdIsRequiredWithASharedEtcd) {
  RunFlags f = Valid();
  f.job_id.clear();
  auto plan = PlanRun(f);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("--job"), std::string::npos);
}

TEST(RunConfigTest, NonsenseDurationsAreRejected) {
  for (auto mutate : std::vector<void (*)(RunFlags&)>{
           [](RunFlags& f) { f.ttl_s = 0; }, [](RunFlags& f) { f.ttl_s = 0.5; },
           [](RunFlags& f) { f.stop_grace_s = -1; }, [](RunFlags& f) { f.join_timeout_s = 0; },
           [](RunFlags& f) { f.last_call_s = -1; }, [](RunFlags& f) { f.max_restarts = -1; },
           [](RunFlags& f) { f.nproc_per_node = -2; }}) {
    RunFlags f = Valid();
    mutate(f);
    EXPECT_FALSE(PlanRun(f).ok());
  }
}

TEST(RunConfigTest, DefaultNodeIdsAreValidAndUnique) {
  std::string a = DefaultNodeId(), b = DefaultNodeId();
  EXPECT_TRUE(ValidateId("node id", a).ok()) << a;
  EXPECT_NE(a, b);
}

TEST(RunConfigTest, NprocDefaultsToVisibleGpus) {
  const char* saved = std::getenv("CUDA_VISIBLE_DEVICES");
  std::string keep = saved ? saved : "";
  ::setenv("CUDA_VISIBLE_DEVICES", "0,1,3", 1);
  EXPECT_EQ(DefaultNprocPerNode(), 3);
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  EXPECT_EQ(DefaultNprocPerNode(), 1);
  if (saved) ::setenv("CUDA_VISIBLE_DEVICES", keep.c_str(), 1); else ::unsetenv("CUDA_VISIBLE_DEVICES");
}

TEST(RunConfigTest, PrestartIsTheDefaultForPythonCommandsOnly) {
  RunFlags f = Valid();
  f.command = {"/usr/bin/python3", "-u", "train.py", "--lr", "1"};
  auto plan = PlanRun(f);  // kAuto: neither flag nor EFDL_PRESTART
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->agent.prestart);
  EXPECT_FALSE(plan->agent.prestart_requested);

  f.command = {"/usr/bin/python3", "-m", "pkg.train"};
  plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->agent.prestart);

  // Commands a spare cannot stand in for are spawned, without an error.
  for (std::vector<std::string> cmd : {std::vector<std::string>{"sh", "-c", "true"},
                                       {"/usr/bin/python3", "-c", "print(1)"},
                                       {"/usr/bin/python3", "-I", "train.py"}}) {
    f.command = cmd;
    plan = PlanRun(f);
    ASSERT_TRUE(plan.ok()) << cmd[1] << ": " << plan.status().ToString();
    EXPECT_FALSE(plan->agent.prestart) << cmd[1];
  }

  // --launcher runs one process per node that starts the workers itself: never a spare.
  f.command = {"/usr/bin/python3", "train.py"};
  f.launcher = true;
  plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_FALSE(plan->agent.prestart);
}

TEST(RunConfigTest, ExplicitPrestartIsStrictAndNoPrestartTurnsItOff) {
  RunFlags f = Valid();
  f.prestart = PrestartMode::kOn;
  f.command = {"/usr/bin/python3", "train.py"};
  auto plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->agent.prestart);
  EXPECT_TRUE(plan->agent.prestart_requested);

  f.command = {"sh", "-c", "true"};
  plan = PlanRun(f);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("--prestart needs a worker command"), std::string::npos)
      << plan.status().message();
  f.command = {"/usr/bin/python3", "train.py"};
  f.launcher = true;
  EXPECT_FALSE(PlanRun(f).ok());

  f.launcher = false;
  f.prestart = PrestartMode::kOff;
  plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_FALSE(plan->agent.prestart);
}

TEST(RunConfigTest, ResumeArgsAreSplitAtSpacesAndQuotesAreRefused) {
  auto args = ParseResumeArgs("  --init_from=resume\t--resume  ");
  ASSERT_TRUE(args.ok()) << args.status().message();
  EXPECT_EQ(*args, (std::vector<std::string>{"--init_from=resume", "--resume"}));
  for (const char* bad : {"--out \"a b\"", "--x='y'", "a\\ b"}) {
    auto r = ParseResumeArgs(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("quotes and backslashes are not interpreted"),
              std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(ParseResumeArgs("   ").ok());
  RunFlags f = Valid();
  f.resume_args = "--resume --from ckpt";
  auto plan = PlanRun(f);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->agent.resume_args, (std::vector<std::string>{"--resume", "--from", "ckpt"}));
  EXPECT_TRUE(plan->agent.horovod_shim_dir.empty());
}

TEST(RunConfigTest, HorovodStandInIsFirstOnTheWorkersAndLaunchersPythonPath) {
  AgentOptions o;
  o.job_id = "j";
  o.node_id = "n";
  rdzv::Assignment a;
  a.round = 2;
  a.nproc = 1;
  a.world_size = 1;
  a.nnodes = 1;
  EXPECT_EQ(WorkerEnvironment(o, a, 0, 0, "/s").count("PYTHONPATH"), 0u);
  o.horovod_shim_dir = "/pkg/efdl/_horovod_shim";
  const char* old = std::getenv("PYTHONPATH");
  const std::string expected =
      old != nullptr && *old != '\0' ? o.horovod_shim_dir + ":" + old : o.horovod_shim_dir;
  for (const auto& env : {WorkerEnvironment(o, a, 0, 0, "/s"), LauncherEnvironment(o, a, 0)}) {
    EXPECT_EQ(env.at("PYTHONPATH"), expected);
    EXPECT_EQ(env.at("EFDL_HOROVOD"), "torch");
  }
}

// A real interpreter (/usr/bin/python3) with PYTHONPATH pointing at the source tree's package,
// then with a `horovod` package after it (what a real Horovod install looks like to find_spec).
TEST(RunConfigTest, HorovodFindsTheStandInAndRefusesARealHorovod) {
  const char* old = std::getenv("PYTHONPATH");
  const std::string saved = old != nullptr ? old : "";
  const std::string python_dir = EFDL_SOURCE_DIR "/python";
  ::setenv("PYTHONPATH", python_dir.c_str(), 1);
  auto shim = FindHorovodShim({EFDL_PYTHON}, std::chrono::seconds(60));
  ASSERT_TRUE(shim.ok()) << shim.status().message();
  EXPECT_EQ(*shim, python_dir + "/efdl/_horovod_shim");

  const std::string dir = ::testing::TempDir() + "efdl-fake-horovod-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir + "/horovod");
  { std::ofstream(dir + "/horovod/__init__.py") << ""; }
  ::setenv("PYTHONPATH", (python_dir + ":" + dir).c_str(), 1);
  auto refused = FindHorovodShim({EFDL_PYTHON}, std::chrono::seconds(60));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("a real Horovod is importable by " EFDL_PYTHON " (" +
                                            dir + "/horovod/__init__.py)"),
            std::string::npos) << refused.status().message();

  ::setenv("PYTHONPATH", dir.c_str(), 1);   // no efdl at all
  auto no_efdl = FindHorovodShim({EFDL_PYTHON}, std::chrono::seconds(60));
  ASSERT_FALSE(no_efdl.ok());
  EXPECT_NE(no_efdl.status().message().find("cannot import efdl"), std::string::npos)
      << no_efdl.status().message();
  std::filesystem::remove_all(dir);
  if (old != nullptr) {
    ::setenv("PYTHONPATH", saved.c_str(), 1);
  } else {
    ::unsetenv("PYTHONPATH");
  }
}

}  // namespace
}  // namespace efdl::cli
