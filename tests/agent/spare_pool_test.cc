#include "agent/spare_pool.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "agent/worker_group.h"
#include "agent/zygote.h"
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
    "argv": sys.argv, "file": __file__, "path": sys.path, "name": __name__,
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
    elif mode == "teardown":
        import atexit, threading
        log = open(os.path.join(os.path.dirname(__file__), "teardown.log"), "w")
        log.write("left open, never flushed\n")   # flushed by the exit, not by the program
        atexit.register(lambda: print("atexit ran", flush=True))
        def late():
            time.sleep(0.3)
            print("thread done", flush=True)
        threading.Thread(target=late).start()
        sys.exit("goodbye from the probe")
    elif mode == "term":
        def on_term(signum, frame):
            print("got signal", signum, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("waiting", flush=True)
        time.sleep(60)
)";

// Every case runs twice: spares started as interpreters of their own, and spares forked from the
// zygote (the default), which must behave the same in every way a program or the agent can see.
class SparePoolTest : public ::testing::TestWithParam<bool> {
 protected:
  bool Forked() const { return GetParam(); }

  void SetUp() override {
    // The agent is a child subreaper (agent.cc); the forked spares are adopted by it.
    if (Forked()) {
      ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    }
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
    return {python_, "-u", dir_.path() + "/probe.py", mode};
  }

  // The pool of a case: the probe in `mode`, no imports, no refill delay, this case's mode.
  SparePoolOptions Options(const std::string& mode, int nproc = 1) {
    SparePoolOptions o;
    o.command = Command(mode);
    o.nproc = nproc;
    o.refill_delay = 0ms;
    o.zygote = Forked();
    for (int lr = 0; lr < nproc; ++lr) {
      o.start_env[lr] = {{"PYTHONPATH", env_["PYTHONPATH"]}, {"EFDL_PRELOAD_MODULES", ""}};
    }
    return o;
  }

  std::unique_ptr<SparePool> Pool(const std::string& mode, int nproc = 1) {
    return Pool(Options(mode, nproc));
  }

  std::unique_ptr<SparePool> Pool(SparePoolOptions o) {
    auto pool = SparePool::Create(std::move(o));
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    return pool.ok() ? std::move(pool).value() : nullptr;
  }

  // A pool of the "exit" probe whose zygote learns from the import reports in `reports()`
  // (created here); the modules written to dir_ are importable.
  std::string reports() const { return dir_.path() + "/reports"; }
  std::unique_ptr<SparePool> LearningPool() {
    EXPECT_EQ(::mkdir(reports().c_str(), 0700), 0);
    env_["PYTHONPATH"] += ":" + dir_.path();
    SparePoolOptions o = Options("exit");
    o.imports_dir = reports();
    return Pool(std::move(o));
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

  // Maintains the pool until it holds `n` live spares (a zygote first does its imports).
  static bool HasSpares(SparePool& pool, size_t n) {
    return WaitUntil([&] {
      pool.Maintain();
      return pool.pids().size() == n;
    }, 60s);
  }

  // A virtual environment of EFDL_PYTHON without its site-packages (so without an efdl that
  // `make install` put there), made in dir_; its interpreter runs the probe from then on, and
  // nothing on PYTHONPATH holds efdl. "" when it cannot be made.
  std::string UseVenvWithoutEfdl() {
    const std::string venv = dir_.path() + "/venv";
    const std::string cmd = fmt::format("{} -m venv --without-pip {} >/dev/null 2>&1",
                                        EFDL_PYTHON, venv);
    if (std::system(cmd.c_str()) != 0) return "";
    python_ = venv + "/bin/python3";
    env_["PYTHONPATH"] = dir_.path();   // helper.py only
    return python_;
  }

  TempDir dir_;
  std::map<std::string, std::string> env_;
  std::string python_ = EFDL_PYTHON;
};

std::string ModeName(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "Forked" : "Started";
}
INSTANTIATE_TEST_SUITE_P(Spares, SparePoolTest, ::testing::Bool(), ModeName);

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

TEST_P(SparePoolTest, ActivatedSpareSeesExactlyWhatASpawnedWorkerSees) {
  Run spawned = RunProbe("exit", nullptr);
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
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

// A worker interpreter that cannot import efdl (a torchrun program's virtual environment): the
// zygote and started spares are given the package of the source tree (issue #39), and the
// program still sees exactly the sys.path and environment of a spawned worker: the package's
// directory is neither on its sys.path nor in its PYTHONPATH.
TEST_P(SparePoolTest, AnInterpreterWithoutEfdlGetsSparesThatKeepItsOwnPath) {
  ASSERT_FALSE(UseVenvWithoutEfdl().empty());
  auto facts = ProbeInterpreter({python_}, {{"PYTHONPATH", env_["PYTHONPATH"]}}, 30s);
  ASSERT_TRUE(facts.ok()) << facts.status().ToString();
  ASSERT_FALSE(facts->finds_efdl);
  Run spawned = RunProbe("exit", nullptr);
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  ASSERT_TRUE(pool->enabled()) << pool->off_reason();
  Run spare = RunProbe("exit", pool.get());
  ASSERT_FALSE(spawned.out.empty());
  EXPECT_EQ(spare.out, spawned.out);
  const std::string source_python = std::string(EFDL_SOURCE_DIR) + "/python";
  EXPECT_EQ(spare.out.find(source_python), std::string::npos) << spare.out;
  EXPECT_EQ(spare.out.find(kPreloadPathVariable), std::string::npos) << spare.out;
  EXPECT_TRUE(WIFEXITED(spare.status) && WEXITSTATUS(spare.status) == 7) << spare.status;
}

TEST_P(SparePoolTest, UncaughtExceptionPrintsTheNormalTracebackAndExitsOne) {
  Run spawned = RunProbe("raise", nullptr);
  auto pool = Pool("raise");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  const pid_t spare_pid = pool->pids()[0];
  Run spare = RunProbe("raise", pool.get());
  EXPECT_EQ(spare.pid, spare_pid);
  EXPECT_NE(spawned.err.find("ValueError: probe failure"), std::string::npos) << spawned.err;
  EXPECT_EQ(spare.err, spawned.err);
  EXPECT_TRUE(WIFEXITED(spare.status) && WEXITSTATUS(spare.status) == 1) << spare.status;
}

TEST_P(SparePoolTest, TheExitJoinsThreadsRunsAtexitAndFlushesFilesLeftOpen) {
  // A forked spare ends without the interpreter's teardown (preload._exit_without_teardown):
  // what a program may rely on at its exit must happen all the same.
  Run spawned = RunProbe("teardown", nullptr);
  const std::string spawned_log = ReadFile(dir_.path() + "/teardown.log");
  ASSERT_TRUE(std::filesystem::remove(dir_.path() + "/teardown.log"));
  auto pool = Pool("teardown");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  Run spare = RunProbe("teardown", pool.get());
  EXPECT_EQ(spawned_log, "left open, never flushed\n");
  EXPECT_EQ(ReadFile(dir_.path() + "/teardown.log"), spawned_log);
  EXPECT_NE(spare.out.find("[rank 0] thread done\n[rank 0] atexit ran\n"), std::string::npos)
      << spare.out;
  EXPECT_EQ(spare.out, spawned.out);
  EXPECT_EQ(spare.err, "[rank 0] goodbye from the probe\n");
  EXPECT_EQ(spare.err, spawned.err);
  EXPECT_TRUE(WIFEXITED(spare.status) && WEXITSTATUS(spare.status) == 1) << spare.status;
  EXPECT_EQ(spare.status, spawned.status);
}

TEST_P(SparePoolTest, SignalsReachTheProgramOnceActivated) {
  auto pool = Pool("term");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
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

TEST_P(SparePoolTest, ASpareServesOneRoundAndIsReplacedByANewProcess) {
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
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

TEST_P(SparePoolTest, ADifferentStartupEnvironmentIsSpawnedAndLearned) {
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  const pid_t first = pool->pids()[0];
  const std::optional<pid_t> first_zygote = pool->zygote_pid();
  auto env = env_;
  env["OMP_NUM_THREADS"] = "3";  // read while torch is imported: the spare has the wrong one
  EXPECT_FALSE(pool->Activate(0, env, 1));
  EXPECT_FALSE(testing::ProcessAlive(first));
  ASSERT_TRUE(HasSpares(*pool, 1));
  // A zygote that imported with the old environment is replaced by one with the new.
  if (Forked()) {
    EXPECT_NE(pool->zygote_pid(), first_zygote);
  }
  std::string environ = ReadFile("/proc/" + std::to_string(pool->pids()[0]) + "/environ");
  EXPECT_NE(environ.find(std::string("OMP_NUM_THREADS=3") + '\0'), std::string::npos);
  EXPECT_TRUE(pool->Activate(0, env, 2));
}

TEST_P(SparePoolTest, ASpareThatCannotStartDisablesThePool) {
  SparePoolOptions o;
  o.command = Command("exit");
  o.zygote = Forked();
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

TEST_P(SparePoolTest, ClearKillsEverySpare) {
  auto pool = Pool("exit", 2);
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 2));
  auto pids = pool->pids();
  ASSERT_EQ(pids.size(), 2u);
  pool->Clear();
  for (pid_t p : pids) EXPECT_FALSE(testing::ProcessAlive(p));
  pool->Maintain();  // no refill before the next activation
  EXPECT_TRUE(pool->pids().empty());
}

// A spare whose import blocks until `<dir>/go` exists (at most 60 s), and the pool for it.
std::unique_ptr<SparePool> GatedPool(const std::string& dir, const std::vector<std::string>& cmd,
                                     std::chrono::milliseconds import_timeout, bool zygote) {
  std::ofstream(dir + "/gate.py") << "import os, time\n"
                                     "t = time.monotonic() + 60\n"
                                     "while not os.path.exists('" << dir << "/go') and "
                                     "time.monotonic() < t:\n"
                                     "    time.sleep(0.02)\n";
  SparePoolOptions o;
  o.command = cmd;
  o.refill_delay = 0ms;
  o.import_timeout = import_timeout;
  o.zygote = zygote;
  o.start_env[0] = {{"PYTHONPATH", std::string(EFDL_SOURCE_DIR) + "/python:" + dir},
                    {"EFDL_PRELOAD_MODULES", "gate"}};
  auto pool = SparePool::Create(std::move(o));
  EXPECT_TRUE(pool.ok());
  return pool.ok() ? std::move(pool).value() : nullptr;
}

TEST_P(SparePoolTest, WaitUntilImportedReturnsOnlyOnceTheSpareFinishedItsImports) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 60s, Forked());
  ASSERT_TRUE(pool);
  pool->Maintain();
  std::this_thread::sleep_for(500ms);  // the gate is closed: the spare must still be importing
  pool->Maintain();
  EXPECT_EQ(pool->Importing(), 1u);
  // A started spare is there and importing; a forked one waits for the zygote's imports.
  EXPECT_EQ(pool->pids().size(), Forked() ? 0u : 1u);
  // The opener notes when it opened the gate; WaitUntilImported must return after that moment
  // (a measured order of events, not a duration a loaded machine could stretch).
  std::atomic<int64_t> opened_at{0};
  std::thread opener([&] {
    std::this_thread::sleep_for(300ms);
    opened_at = std::chrono::steady_clock::now().time_since_epoch().count();
    std::ofstream(dir_.path() + "/go") << "1";
  });
  EXPECT_EQ(pool->WaitUntilImported(nullptr), 0u);
  const int64_t returned_at = std::chrono::steady_clock::now().time_since_epoch().count();
  opener.join();
  ASSERT_NE(opened_at.load(), 0);
  EXPECT_GT(returned_at, opened_at.load());  // not before the gate opened
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

TEST_P(SparePoolTest, WaitUntilImportedGivesUpAfterTheImportTimeout) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 400ms, Forked());
  ASSERT_TRUE(pool);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported(nullptr), 1u);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 10s);
  // The spare (or the zygote) is kept: it may still be ready in time.
  EXPECT_EQ(Forked() ? static_cast<size_t>(pool->zygote_pid().has_value()) : pool->pids().size(),
            1u);
}

TEST_P(SparePoolTest, WaitUntilImportedStopsWhenInterrupted) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 60s, Forked());
  ASSERT_TRUE(pool);
  int asked = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported([&] { return ++asked >= 3; }), 1u);
  EXPECT_EQ(asked, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST_P(SparePoolTest, WaitUntilImportedEndsWhenTheSpareDies) {
  auto pool = GatedPool(dir_.path(), Command("exit"), 60s, Forked());
  ASSERT_TRUE(pool);
  pool->Maintain();
  // The process importing: the spare itself, or the zygote it is to be forked from.
  const std::optional<pid_t> importing =
      Forked() ? pool->zygote_pid()
               : (pool->pids().empty() ? std::nullopt : std::optional<pid_t>(pool->pids()[0]));
  ASSERT_TRUE(importing);
  ASSERT_EQ(::kill(*importing, SIGKILL), 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->WaitUntilImported(nullptr), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_FALSE(pool->enabled());
}

TEST_P(SparePoolTest, AConsumedSpareIsForkedAgainAtOnceAndStartedOnlyAfterTheRefillDelay) {
  SparePoolOptions o = Options("exit");
  o.refill_delay = 60s;   // for started spares
  auto pool = Pool(std::move(o));
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  auto a = pool->Activate(0, env_, 1);
  ASSERT_TRUE(a);
  pool->Maintain();
  EXPECT_EQ(pool->pids().size(), Forked() ? 1u : 0u);
  if (Forked()) {
    auto b = pool->Activate(0, env_, 2);
    ASSERT_TRUE(b);
    EXPECT_EQ(a->Wait(), b->Wait());   // both ran the program (exit 7)
  }
}

TEST_P(SparePoolTest, AZygoteWhoseImportsStartAThreadRefusesAndSparesAreStarted) {
  // fork() copies one thread: a zygote whose imports started another must not fork.
  std::ofstream(dir_.path() + "/threader.py")
      << "import threading, time\n"
         "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n";
  SparePoolOptions o = Options("exit");
  o.start_env[0] = {{"PYTHONPATH", env_["PYTHONPATH"] + ":" + dir_.path()},
                    {"EFDL_PRELOAD_MODULES", "threader"}};
  auto pool = Pool(std::move(o));
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  EXPECT_FALSE(pool->zygote_pid());   // gone (Forked) or never started
  EXPECT_TRUE(pool->enabled());
  auto env = env_;
  env["PYTHONPATH"] = env_["PYTHONPATH"] + ":" + dir_.path();
  auto proc = pool->Activate(0, env, 1);
  ASSERT_TRUE(proc);
  const int status = proc->Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 7) << status;
}

TEST_P(SparePoolTest, SparesAreForkedFromTheZygoteAndAZygoteThatDiesIsStartedAgain) {
  if (!Forked()) GTEST_SKIP() << "no zygote with started spares";
  auto pool = Pool("exit");
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  const auto zygote = pool->zygote_pid();
  ASSERT_TRUE(zygote.has_value());
  // Forked by the zygote (the fork's command line is the zygote's), then adopted by this
  // process (a child subreaper, as the agent is).
  const pid_t spare = pool->pids()[0];
  EXPECT_NE(ReadFile(fmt::format("/proc/{}/cmdline", spare)).find("--zygote"), std::string::npos);
  EXPECT_EQ(testing::ParentOf(spare), ::getpid());
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(::kill(*zygote, SIGKILL), 0);
  const bool restarted = WaitUntil([&] {
    pool->Maintain();
    return pool->zygote_pid().has_value() && *pool->zygote_pid() != *zygote;
  }, 60s);
  const std::string log = ::testing::internal::GetCapturedStderr();   // before any ASSERT
  ASSERT_TRUE(restarted) << log;
  EXPECT_NE(log.find(fmt::format("the zygote (pid {}) ended (killed by signal 9 (SIGKILL)); "
                                 "starting a new one (restart 1 of 3)",
                                 *zygote)),
            std::string::npos)
      << log;
  // The spare forked before lives on and still serves a round; its replacement comes from the
  // new zygote.
  Run r = RunProbe("exit", pool.get());
  EXPECT_EQ(r.pid, spare);
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 7) << r.status;
  ASSERT_TRUE(HasSpares(*pool, 1));
  EXPECT_NE(pool->pids()[0], spare);
  EXPECT_TRUE(pool->enabled());
}

TEST_P(SparePoolTest, ReportedImportsGoToTheZygoteAndOnesThatStartAThreadEndTheLearning) {
  if (!Forked()) GTEST_SKIP() << "learning is for the zygote";
  // learned.py leaves the importing process's pid in a file; threader.py starts a thread.
  std::ofstream(dir_.path() + "/learned.py")
      << "import os\nwith open(" << "'" << dir_.path() << "/marks', 'a') as f:\n"
      << "    f.write('%d\\n' % os.getpid())\n";
  std::ofstream(dir_.path() + "/threader.py")
      << "import threading, time\n"
         "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n";
  const std::string reports = this->reports();
  auto pool = LearningPool();
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  const pid_t zygote = *pool->zygote_pid();
  const pid_t spare = pool->pids()[0];
  ::testing::internal::CaptureStderr();
  std::ofstream(reports + "/imports-1-1.json") << R"(["learned", "no_such_module"])";
  const bool learned = WaitUntil([&] {
    pool->Maintain();
    return pool->pids().size() == 1 && pool->pids()[0] != spare;
  }, 60s);
  // The zygote imported it (once: not the spares), and the idle spare was forked again.
  EXPECT_EQ(ReadFile(dir_.path() + "/marks"), fmt::format("{}\n", zygote));
  EXPECT_EQ(*pool->zygote_pid(), zygote);
  EXPECT_TRUE(std::filesystem::is_empty(reports));   // read and removed
  std::ofstream(reports + "/imports-2-1.json") << R"(["learned", "threader"])";
  const bool replaced = WaitUntil([&] {
    pool->Maintain();
    return pool->zygote_pid() && *pool->zygote_pid() != zygote && pool->pids().size() == 1;
  }, 60s);
  const std::string log = ::testing::internal::GetCapturedStderr();   // before any ASSERT
  ASSERT_TRUE(learned) << log;
  ASSERT_TRUE(replaced) << log;
  EXPECT_NE(log.find("the zygote imports 2 more module(s) the program imported (learned, "
                     "no_such_module; --no-learn-imports turns this off)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("the zygote imported them in"), std::string::npos) << log;
  EXPECT_NE(log.find("importing the program's modules started 2 threads; a zygote must have one"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("no more learning of the program's imports"), std::string::npos) << log;
  // The new zygote serves, without the learned modules.
  EXPECT_TRUE(pool->enabled());
  const pid_t from_new_zygote = pool->pids()[0];
  Run r = RunProbe("exit", pool.get());
  EXPECT_EQ(r.pid, from_new_zygote);
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 7) << r.status;
  std::ofstream(reports + "/imports-3-1.json") << R"(["learned"])";
  for (int i = 0; i < 30; ++i) {
    pool->Maintain();
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(ReadFile(dir_.path() + "/marks"), fmt::format("{}\n", zygote));   // not again
}

TEST_P(SparePoolTest, AReportedImportThatInitialisesCudaEndsTheLearning) {
  if (!Forked()) GTEST_SKIP() << "learning is for the zygote";
  // Stands in for a library that initialises CUDA through torch at import (no GPU here): the
  // zygote asks torch.cuda.is_initialized(), which this module makes true.
  std::ofstream(dir_.path() + "/cudainit.py")
      << "import sys, types\n"
         "torch = types.ModuleType('torch')\n"
         "torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)\n"
         "sys.modules['torch'] = torch\n";
  const std::string reports = this->reports();
  auto pool = LearningPool();
  ASSERT_TRUE(pool);
  ASSERT_TRUE(HasSpares(*pool, 1));
  const pid_t zygote = *pool->zygote_pid();
  ::testing::internal::CaptureStderr();
  std::ofstream(reports + "/imports-1-1.json") << R"(["cudainit"])";
  const bool replaced = WaitUntil([&] {
    pool->Maintain();
    return pool->zygote_pid() && *pool->zygote_pid() != zygote && pool->pids().size() == 1;
  }, 60s);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(replaced) << log;
  EXPECT_NE(log.find("importing the program's modules initialised CUDA, which a forked process "
                     "cannot use"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("no more learning of the program's imports"), std::string::npos) << log;
  EXPECT_TRUE(pool->enabled());
}

// An interpreter of another Python version than the known package's compiled part: no spares
// at all, and one reason that names the cost and the fix.
TEST(ChoosePackageDir, DecidesOnTheInterpretersVersionAndExtensionSuffixes) {
  auto tmp = TempDir::Create("efdl-package-choice");
  ASSERT_TRUE(tmp.ok());
  auto package = [&](const std::string& name, const std::vector<std::string>& extensions) {
    const std::string dir = tmp->path() + "/" + name;
    std::filesystem::create_directories(dir + "/efdl");
    std::ofstream(dir + "/efdl/preload.py") << "";
    for (const auto& e : extensions) std::ofstream(dir + "/efdl/" + e) << "";
    return dir;
  };
  const std::string py311 = package("a", {"_efdl.cpython-311-x86_64-linux-gnu.so"});
  const std::string py312 = package("b", {"_efdl.cpython-312-x86_64-linux-gnu.so"});
  const std::string bare = package("c", {});
  InterpreterFacts f311{"3.11", {".cpython-311-x86_64-linux-gnu.so", ".abi3.so", ".so"}, false};
  InterpreterFacts f312{"3.12", {".cpython-312-x86_64-linux-gnu.so", ".abi3.so", ".so"}, false};

  // It imports efdl itself: nothing to give.
  InterpreterFacts own = f312;
  own.finds_efdl = true;
  EXPECT_EQ(ChoosePackageDir(own, {py311}, "py", "").python_dir, "");
  EXPECT_EQ(ChoosePackageDir(own, {py311}, "py", "").problem, "");
  // The first known package it loads.
  EXPECT_EQ(ChoosePackageDir(f311, {bare, py311, py312}, "py", "").python_dir, py311);
  EXPECT_EQ(ChoosePackageDir(f312, {py311, py312}, "py", "").python_dir, py312);
  EXPECT_EQ(ChoosePackageDir(f312, {py312}, "py", "").problem, "");

  // Another version: the problem names both versions, the cost and the install command.
  PackageChoice c = ChoosePackageDir(f312, {py311}, "/venv/bin/python3", "/src/python");
  EXPECT_EQ(c.python_dir, "");
  for (const char* part : {"/venv/bin/python3 (Python 3.12) cannot import efdl", py311.c_str(),
                           "_efdl.cpython-311-x86_64-linux-gnu.so", "4-5x slower",
                           "run the workers with Python 3.11",
                           "`/venv/bin/python3 /src/scripts/install-python-package.py "
                           "/src/python`"}) {
    EXPECT_NE(c.problem.find(part), std::string::npos) << part << " not in: " << c.problem;
  }
  // A package without its compiled part is not taken either.
  c = ChoosePackageDir(f311, {bare}, "py", "");
  EXPECT_EQ(c.python_dir, "");
  EXPECT_NE(c.problem.find("without its compiled part"), std::string::npos) << c.problem;
  // None known: the fix is installing it.
  c = ChoosePackageDir(f311, {}, "py", "");
  EXPECT_NE(c.problem.find("knows no efdl package"), std::string::npos) << c.problem;
  EXPECT_NE(c.problem.find("`py scripts/install-python-package.py python`"), std::string::npos)
      << c.problem;
}

// The probe asks the interpreter itself; a program that is no Python 3 interpreter fails it.
TEST(ProbeInterpreter, ReportsTheVersionSuffixesAndWhetherEfdlIsFound) {
  auto facts = ProbeInterpreter({EFDL_PYTHON}, {{"PYTHONPATH", std::string(EFDL_SOURCE_DIR) +
                                                                   "/python"}}, 30s);
  ASSERT_TRUE(facts.ok()) << facts.status().ToString();
  EXPECT_TRUE(facts->finds_efdl);
  const std::string tag = "cpython-" + std::string(facts->version).erase(1, 1);   // 3.11 -> 311
  EXPECT_TRUE(std::any_of(facts->extension_suffixes.begin(), facts->extension_suffixes.end(),
                          [&](const std::string& s) { return s.find(tag) != std::string::npos; }))
      << facts->version;
  // The build put the extension for this very interpreter into the source tree.
  EXPECT_EQ(ChoosePackageDir({facts->version, facts->extension_suffixes, false},
                             KnownPackageDirs(facts->version), "py", SourcePythonDir())
                .python_dir,
            SourcePythonDir());
  EXPECT_FALSE(ProbeInterpreter({"/bin/false"}, {}, 30s).ok());
}

TEST(ReapAdoptedOrphans, ReapsAdoptedZombiesAndLeavesGroupLeadersToTheirOwner) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  // A helper a worker started, orphaned when the worker died: adopted by us, in the worker's
  // group, not leading one.
  // Two pipes: the helper's pid goes to the test on one, the test lets the helper exit on the
  // other (on one pipe the waiting helper could read a byte of its own pid first).
  int pid_pipe[2];
  int go[2];
  ASSERT_EQ(::pipe(pid_pipe), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t worker = ::fork();
  ASSERT_GE(worker, 0);
  if (worker == 0) {
    ::setpgid(0, 0);
    const pid_t helper = ::fork();
    if (helper == 0) {
      char byte;
      (void)::read(go[0], &byte, 1);   // until the test has seen it adopted
      ::_exit(0);
    }
    (void)::write(pid_pipe[1], &helper, sizeof(helper));
    ::_exit(0);
  }
  pid_t helper = 0;
  ASSERT_EQ(::read(pid_pipe[0], &helper, sizeof(helper)), static_cast<ssize_t>(sizeof(helper)));
  ASSERT_EQ(::waitpid(worker, nullptr, 0), worker);
  // A child that leads its own group (what Spawn and the zygote make): its owner reaps it.
  const pid_t leader = ::fork();
  ASSERT_GE(leader, 0);
  if (leader == 0) {
    ::setpgid(0, 0);
    ::_exit(3);
  }
  ::setpgid(leader, leader);
  ASSERT_EQ(::write(go[1], "x", 1), 1);   // the helper exits now
  for (int fd : {pid_pipe[0], pid_pipe[1], go[0], go[1]}) ::close(fd);
  int reaped = 0;
  ASSERT_TRUE(WaitUntil([&] {
    reaped += ReapAdoptedOrphans();
    return reaped >= 1;
  }, 10s));
  EXPECT_EQ(reaped, 1);
  EXPECT_EQ(::kill(helper, 0), -1);   // gone for good: reaped, not a zombie
  int status = 0;
  ASSERT_EQ(::waitpid(leader, &status, 0), leader);   // still ours to reap
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3);
}

}  // namespace
}  // namespace efdl::agent
