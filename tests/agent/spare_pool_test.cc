#include "agent/spare_pool.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "agent/worker_group.h"
#include "common/net.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using testing::ReadFile;
using testing::WaitUntil;

// Prints everything a program can observe about how it was started, then acts on argv[1].
constexpr const char* kProbe = R"(import json, os, signal, sys, time
import helper
m = sys.modules["__main__"]
print(json.dumps({
    "argv": sys.argv, "file": __file__, "path0": sys.path[0], "name": __name__,
    "spec": repr(__spec__), "package": __package__, "cached": __cached__,
    "loader": type(__loader__).__name__, "cwd": os.getcwd(), "helper": helper.VALUE,
    "main_is_module": m.__dict__ is globals(), "unbuffered": sys.stdout.write_through,
    "env": dict(os.environ)}, sort_keys=True), flush=True)

def fail():
    raise ValueError("probe failure")

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "raise":
        fail()
    elif mode == "exit":
        sys.exit(7)
    elif mode == "term":
        def on_term(signum, frame):
            print("got signal", signum, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("waiting", flush=True)
        time.sleep(60)
)";

class SparePoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("efdl-spare-test");
    ASSERT_TRUE(dir.ok());
    dir_ = std::move(dir).value();
    std::ofstream(dir_.path() + "/probe.py") << kProbe;
    std::ofstream(dir_.path() + "/helper.py") << "VALUE = 42\n";
    // Spares find efdl.preload through PYTHONPATH; torch is not needed by the probe.
    env_["PYTHONPATH"] = std::string(EFDL_SOURCE_DIR) + "/python";
    env_["EFDL_TEST_VAR"] = "a b\nc \"q\" \xc3\xa9";  // travels in the JSON message
    env_["RANK"] = "5";
  }

  std::vector<std::string> Command(const std::string& mode) {
    return {EFDL_PYTHON, "-u", dir_.path() + "/probe.py", mode};
  }

  std::unique_ptr<SparePool> Pool(const std::string& mode, int nproc = 1) {
    SparePoolOptions o;
    o.command = Command(mode);
    o.nproc = nproc;
    o.refill_delay = 0ms;
    for (int lr = 0; lr < nproc; ++lr) {
      o.start_env[lr] = {{"PYTHONPATH", env_["PYTHONPATH"]}, {"EFDL_PRELOAD_MODULES", ""}};
    }
    auto pool = SparePool::Create(std::move(o));
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    return pool.ok() ? std::move(pool).value() : nullptr;
  }

  struct Run {
    std::string out, err;
    int status = -1;
    pid_t pid = -1;
  };
  // Runs the probe through a WorkerGroup, spawned or from `spares`, and collects its output.
  Run RunProbe(const std::string& mode, SparePool* spares) {
    std::string tag = spares ? "spare" : "spawn";
    std::string out_path = dir_.path() + "/" + tag + ".out";
    std::string err_path = dir_.path() + "/" + tag + ".err";
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    WorkerGroupOptions o;
    o.argv = Command(mode);
    o.round = 3;
    o.out_fd = out;
    o.err_fd = err;
    o.spares = spares;
    WorkerSpec spec;
    spec.env = env_;
    o.workers.push_back(spec);
    Run r;
    {
      auto g = WorkerGroup::Start(std::move(o));
      EXPECT_TRUE(g.ok()) << g.status().ToString();
      if (!g.ok()) return r;
      r.pid = (*g)->pids()[0];
      EXPECT_TRUE(WaitUntil([&] { return (*g)->Poll() != WorkerGroup::State::kRunning; }, 60s));
      if ((*g)->first_failure()) r.status = (*g)->first_failure()->wait_status;
      else r.status = 0;
    }  // joins the output thread
    ::close(out);
    ::close(err);
    r.out = ReadFile(out_path);
    r.err = ReadFile(err_path);
    return r;
  }

  TempDir dir_;
  std::map<std::string, std::string> env_;
};

TEST(ParsePythonCommand, SplitsInterpreterOptionsFromTheProgram) {
  auto c = ParsePythonCommand(
      {"/usr/bin/python3.11", "-u", "-X", "dev", "-W", "ignore", "t.py", "-u"});
  ASSERT_TRUE(c);
  EXPECT_EQ(c->interpreter,
            (std::vector<std::string>{"/usr/bin/python3.11", "-u", "-X", "dev", "-W", "ignore"}));
  EXPECT_EQ(c->program, (std::vector<std::string>{"t.py", "-u"}));
  c = ParsePythonCommand({"python", "-m", "pkg.train", "--lr", "1"});
  ASSERT_TRUE(c);
  EXPECT_EQ(c->program, (std::vector<std::string>{"-m", "pkg.train", "--lr", "1"}));
}

TEST(ParsePythonCommand, RejectsWhatASpareCannotStandInFor) {
  EXPECT_FALSE(ParsePythonCommand({"python3", "-c", "print(1)"}));
  EXPECT_FALSE(ParsePythonCommand({"python3", "-I", "t.py"}));
  EXPECT_FALSE(ParsePythonCommand({"python3", "-m"}));
  EXPECT_FALSE(ParsePythonCommand({"python3"}));
  EXPECT_FALSE(ParsePythonCommand({"/bin/sh", "t.py"}));
  EXPECT_FALSE(ParsePythonCommand({"mypython3", "t.py"}));
  SparePoolOptions not_python;
  not_python.command = {"/bin/true"};
  EXPECT_FALSE(SparePool::Create(std::move(not_python)).ok());
}

TEST(IsRoundVariable, PerRoundNamesOnly) {
  for (const char* n :
       {"RANK", "MASTER_PORT", "EFDL_ROUND", "TORCHELASTIC_RUN_ID", "HOROVOD_RANK"}) {
    EXPECT_TRUE(IsRoundVariable(n)) << n;
  }
  for (const char* n : {"OMP_NUM_THREADS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "RANKS"}) {
    EXPECT_FALSE(IsRoundVariable(n)) << n;
  }
}

TEST_F(SparePoolTest, ActivatedSpareSeesExactlyWhatASpawnedWorkerSees) {
  Run spawned = RunProbe("exit", nullptr);
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  const pid_t spare_pid = pool->pids()[0];
  Run spare = RunProbe("exit", pool.get());
  EXPECT_EQ(spare.pid, spare_pid);    // the spare ran the program...
  EXPECT_TRUE(pool->pids().empty());  // ...and was handed over, not kept
  ASSERT_FALSE(spawned.out.empty());
  // argv, __file__, sys.path[0], __main__, the helper next to the script, cwd, environment.
  EXPECT_EQ(spare.out, spawned.out);
  EXPECT_NE(spare.out.find("\"helper\": 42"), std::string::npos) << spare.out;
  EXPECT_NE(spare.out.find("\"unbuffered\": true"), std::string::npos) << spare.out;
  EXPECT_TRUE(WIFEXITED(spare.status) && WEXITSTATUS(spare.status) == 7) << spare.status;
  EXPECT_EQ(spare.status, spawned.status);
}

TEST_F(SparePoolTest, UncaughtExceptionPrintsTheNormalTracebackAndExitsOne) {
  Run spawned = RunProbe("raise", nullptr);
  auto pool = Pool("raise");
  ASSERT_TRUE(pool);
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  const pid_t spare_pid = pool->pids()[0];
  Run spare = RunProbe("raise", pool.get());
  EXPECT_EQ(spare.pid, spare_pid);
  EXPECT_NE(spawned.err.find("ValueError: probe failure"), std::string::npos) << spawned.err;
  EXPECT_EQ(spare.err, spawned.err);
  EXPECT_TRUE(WIFEXITED(spare.status) && WEXITSTATUS(spare.status) == 1) << spare.status;
}

TEST_F(SparePoolTest, SignalsReachTheProgramOnceActivated) {
  auto pool = Pool("term");
  ASSERT_TRUE(pool);
  pool->Maintain();
  std::map<std::string, std::string> env = env_;
  auto proc = pool->Activate(0, env, 1);
  ASSERT_TRUE(proc);
  ::fcntl(proc->stdout_fd(), F_SETFL, ::fcntl(proc->stdout_fd(), F_GETFL) | O_NONBLOCK);
  std::string out;
  ASSERT_TRUE(WaitUntil([&] {
    char buf[4096];
    ssize_t n = ::read(proc->stdout_fd(), buf, sizeof(buf));
    if (n > 0) out.append(buf, static_cast<size_t>(n));
    return out.find("waiting\n") != std::string::npos;
  }, 60s)) << out;
  ASSERT_TRUE(proc->Signal(SIGTERM).ok());
  int status = proc->Wait();
  char buf[4096];
  ssize_t n;
  while ((n = ::read(proc->stdout_fd(), buf, sizeof(buf))) > 0) {
    out.append(buf, static_cast<size_t>(n));
  }
  EXPECT_NE(out.find("got signal 15"), std::string::npos) << out;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(SparePoolTest, ASpareServesOneRoundAndIsReplacedByANewProcess) {
  SparePoolOptions o;
  o.command = Command("exit");
  o.refill_delay = 0ms;
  o.start_env[0] = {{"PYTHONPATH", env_["PYTHONPATH"]}, {"EFDL_PRELOAD_MODULES", ""}};
  auto created = SparePool::Create(std::move(o));
  ASSERT_TRUE(created.ok());
  auto& pool = *created;
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  const pid_t first = pool->pids()[0];
  auto a = pool->Activate(0, env_, 1);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->pid(), first);
  EXPECT_FALSE(pool->Activate(0, env_, 2));  // nothing left until the refill
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  EXPECT_NE(pool->pids()[0], first);
  auto b = pool->Activate(0, env_, 2);
  ASSERT_TRUE(b);
  EXPECT_NE(b->pid(), first);
  EXPECT_EQ(a->Wait(), b->Wait());  // both ran the program once (exit 7)
}

TEST_F(SparePoolTest, ADifferentStartupEnvironmentIsSpawnedAndLearned) {
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  const pid_t first = pool->pids()[0];
  auto env = env_;
  env["OMP_NUM_THREADS"] = "3";  // read while torch is imported: the spare has the wrong one
  EXPECT_FALSE(pool->Activate(0, env, 1));
  EXPECT_FALSE(testing::ProcessAlive(first));
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  std::string environ = ReadFile("/proc/" + std::to_string(pool->pids()[0]) + "/environ");
  EXPECT_NE(environ.find(std::string("OMP_NUM_THREADS=3") + '\0'), std::string::npos);
  EXPECT_TRUE(pool->Activate(0, env, 2));
}

TEST_F(SparePoolTest, ASpareThatCannotStartDisablesThePool) {
  SparePoolOptions o;
  o.command = Command("exit");
  // An interpreter that cannot start at all (no standard library), whatever is installed: with
  // only a bad PYTHONPATH, an efdl installed by `make install` is still importable.
  o.start_env[0] = {{"PYTHONHOME", dir_.path() + "/nowhere"}, {"PYTHONNOUSERSITE", "1"}};
  auto created = SparePool::Create(std::move(o));
  ASSERT_TRUE(created.ok());
  auto& pool = *created;
  pool->Maintain();
  ASSERT_TRUE(WaitUntil([&] {
    pool->Maintain();
    return !pool->enabled();
  }, 60s));
  EXPECT_TRUE(pool->pids().empty());
  EXPECT_FALSE(pool->Activate(0, env_, 1));
}

TEST_F(SparePoolTest, ClearKillsEverySpare) {
  auto pool = Pool("exit", 2);
  ASSERT_TRUE(pool);
  pool->Maintain();
  auto pids = pool->pids();
  ASSERT_EQ(pids.size(), 2u);
  pool->Clear();
  for (pid_t p : pids) EXPECT_FALSE(testing::ProcessAlive(p));
  pool->Maintain();  // no refill before the next activation
  EXPECT_TRUE(pool->pids().empty());
}

// A spare whose import blocks until `<dir>/go` exists (at most 60 s), and the pool for it.
std::unique_ptr<SparePool> GatedPool(const std::string& dir, const std::vector<std::string>& cmd,
                                     std::chrono::milliseconds import_timeout) {
  std::ofstream(dir + "/gate.py") << "import os, time\n"
                                     "t = time.monotonic() + 60\n"
                                     "while not os.path.exists('" << dir << "/go') and "
                                     "time.monotonic() < t:\n"
                                     "    time.sleep(0.02)\n";
  SparePoolOptions o;
  o.command = cmd;
  o.refill_delay = 0ms;
  o.import_timeout = import_timeout;
  o.start_env[0] = {{"PYTHONPATH", std::string(EFDL_SOURCE_DIR) + "/python:" + dir},
                    {"EFDL_PRELOAD_MODULES", "gate"}};
  auto pool = SparePool::Create(std::move(o));
  EXPECT_TRUE(pool.ok());
  return pool.ok() ? std::move(pool).value() : nullptr;
}

TEST_F(SparePoolTest, WaitUntilImportedReturnsOnlyOnceTheSpareFinishedItsImports) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 60s);
  ASSERT_TRUE(pool);
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  std::this_thread::sleep_for(500ms);  // the gate is closed: the spare must still be importing
  EXPECT_EQ(pool->Importing(), 1u);
  std::thread opener([&] {
    std::this_thread::sleep_for(300ms);
    std::ofstream(dir_.path() + "/go") << "1";
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported(nullptr), 0u);
  opener.join();
  EXPECT_GE(std::chrono::steady_clock::now() - start, 250ms);  // not before the gate opened
  EXPECT_EQ(pool->Importing(), 0u);
  // Still a usable spare: it runs the program for a round.
  auto env = env_;
  env["PYTHONPATH"] = std::string(EFDL_SOURCE_DIR) + "/python:" + dir_.path();
  auto proc = pool->Activate(0, env, 1);
  ASSERT_TRUE(proc);
  std::optional<int> st;
  ASSERT_TRUE(WaitUntil([&] { return (st = proc->Poll()).has_value(); }, 30s));
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 7) << *st;
}

TEST_F(SparePoolTest, WaitUntilImportedGivesUpAfterTheImportTimeout) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 400ms);
  ASSERT_TRUE(pool);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported(nullptr), 1u);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 10s);
  EXPECT_EQ(pool->pids().size(), 1u);  // the spare is kept: it may still be ready in time
}

TEST_F(SparePoolTest, WaitUntilImportedStopsWhenInterrupted) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 60s);
  ASSERT_TRUE(pool);
  int asked = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported([&] { return ++asked >= 3; }), 1u);
  EXPECT_EQ(asked, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST_F(SparePoolTest, WaitUntilImportedEndsWhenTheSpareDies) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 60s);
  ASSERT_TRUE(pool);
  pool->Maintain();
  ASSERT_EQ(pool->pids().size(), 1u);
  ASSERT_EQ(::kill(pool->pids()[0], SIGKILL), 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported(nullptr), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_FALSE(pool->enabled());
}

}  // namespace
}  // namespace efdl::agent
