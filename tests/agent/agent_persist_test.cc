// The node agent persists its workers' snapshots (AgentPersister, docs/snapshots.md): real python
// workers running efdl.State commit into a shared-memory arena under a real Agent (the rendezvous
// is a scripted double); storage is read back with the real SnapshotStore.
#include <gtest/gtest.h>

#include <signal.h>
#include <stdlib.h>

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "agent/agent.h"
#include "agent/agent_persister.h"
#include "test_util.h"
#include "common/net.h"
#include "snapshot/arena.h"
#include "snapshot/arena_dir.h"
#include "snapshot/env.h"
#include "snapshot/store.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using rdzv::Event;
using testing::PythonWorker;
using testing::ReadFile;
using testing::WaitUntil;

// Plays the rendezvous: the test queues events, the agent's reports are recorded.
class ScriptedRendezvous : public rdzv::Rendezvous {
 public:
  Status Join() override { return Status::OK(); }
  std::optional<Event> WaitEvent(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
    Event e = events_.front();
    events_.pop_front();
    return e;
  }
  void ReportWorkerFailure(int64_t, const std::string&) override {
    std::lock_guard lock(mu_);
    ++failures_;
  }
  void ReportWorkersSucceeded(int64_t) override {}
  void Leave() override {}
  Status ReportSuspended(const std::optional<rdzv::PersistedPoint>& point) override {
    std::lock_guard lock(mu_);
    suspended_.push_back(point ? std::optional<int64_t>(point->step) : std::nullopt);
    return Status::OK();
  }
  void Push(Event e) {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(e));
    cv_.notify_all();
  }
  int failures() {
    std::lock_guard lock(mu_);
    return failures_;
  }
  std::vector<std::optional<int64_t>> suspended() {
    std::lock_guard lock(mu_);
    return suspended_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  int failures_ = 0;
  std::vector<std::optional<int64_t>> suspended_;
};

Event Round(int rank_offset, int nproc, int world) {
  Event e;
  e.type = Event::Type::kRoundStarted;
  e.round = 1;
  e.assignment.round = 1;
  e.assignment.nnodes = world / nproc;
  e.assignment.node_rank = rank_offset / nproc;
  e.assignment.rank_offset = rank_offset;
  e.assignment.nproc = nproc;
  e.assignment.world_size = world;
  e.assignment.master_addr = "127.0.0.1";
  e.assignment.master_port = 29555;
  return e;
}

// Sets variables for this test (the agent and its workers read them) and restores them.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (const char* name : {"EFDL_SNAPSHOT_PER_RANK", "EFDL_PERSIST_MIN_INTERVAL_MS",
                             "EFDL_SNAPSHOT_HMAC", "EFDL_SNAPSHOT_KEEP", "EFDL_SHM_DIR"}) {
      Save(name);
      ::unsetenv(name);
    }
    for (const auto& [k, v] : vars) {
      Save(k);
      ::setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v) {
        ::setenv(k.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(k.c_str());
      }
    }
  }

 private:
  void Save(const std::string& name) {
    if (saved_.count(name)) return;
    const char* v = std::getenv(name.c_str());
    saved_[name] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

// One node's agent on a thread, with its own shared memory and storage directories.
struct Node {
  TempDir dir = TempDir::Create("efdl-agent-persist").value();
  std::string shm = dir.path() + "/shm";
  std::string storage = dir.path() + "/storage";
  ScriptedRendezvous rdzv;
  std::unique_ptr<Agent> agent;
  std::thread thread;
  int exit_code = -1;

  Node() {
    std::filesystem::create_directories(shm);
    std::filesystem::create_directories(storage);
  }
  ~Node() {
    if (thread.joinable()) {
      agent->RequestShutdown(SIGTERM);
      thread.join();
    }
  }
  void Run(const std::string& code, int nproc = 1) {
    AgentOptions o;
    o.job_id = "pj";
    o.node_id = "n1";
    o.command = PythonWorker(code);
    o.nproc = nproc;
    o.stop_grace = 20s;
    o.snapshot_dir = storage;
    o.job_secret = "s3cret";
    agent = std::make_unique<Agent>(std::move(o), rdzv);
    thread = std::thread([this] { exit_code = agent->Run(); });
  }
  int Stop(int sig) {
    agent->RequestShutdown(sig);
    thread.join();
    return exit_code;
  }
  // The step of the newest snapshot in `sub` of the job's storage, if any.
  std::optional<int64_t> StoredStep(const std::string& sub = "") const {
    snapshot::SnapshotStore store(snapshot::Env::Posix(), storage + "/pj" + sub, 2);
    for (const auto& e : store.List()) {
      auto info = store.ReadInfo(e.path);
      if (info.ok()) return info->manifest.step;
    }
    return std::nullopt;
  }
  // The step of the newest complete snapshot in shared memory.
  std::optional<int64_t> MemoryStep(const std::string& scope = "node") const {
    // The agent is the only holder of the job in this node's shm dir: index 0.
    auto arena = snapshot::SnapshotArena::Open(
        snapshot::ArenaPath(shm, "pj", snapshot::HolderName(HostName(), 0), scope));
    if (!arena.ok()) return std::nullopt;
    auto slots = (*arena)->ReadySlots();
    if (slots.empty()) return std::nullopt;
    return slots.front().step;
  }
};

// The worker: a small model under efdl.State. `body` runs after the State is built.
std::string Worker(const std::string& body) {
  return "import os, signal, sys, time\n"
         "import torch\n"
         "from efdl.state import State\n"
         "torch.manual_seed(0)\n"
         "model = torch.nn.Linear(16, 8)\n"
         "st = State(model, step=0)\n" +
         body;
}

// Writes the names of this process' threads and its EFDL_AGENT_PERSISTS to a file.
std::string ReportThreads(const std::string& path) {
  return "names = sorted(open('/proc/self/task/%s/comm' % t).read().strip()\n"
         "               for t in os.listdir('/proc/self/task'))\n"
         "open('" + path + "', 'w').write(os.environ.get('EFDL_AGENT_PERSISTS', '-') + ' ' + "
         "','.join(names))\n";
}

// Commits every 20 ms until the agent asks it to stop (commit() then snapshots and exits 0).
const char* kCommitForever =
    "while True:\n"
    "    st.step += 1\n"
    "    st.commit()\n"
    "    time.sleep(0.02)\n";

// Keeps calling commit() without a new snapshot (the step is not a multiple of the interval)
// until the agent asks it to stop: then commit() snapshots and exits 0.
const char* kWaitForStop =
    "st.set_commit_interval(1000)\n"
    "while True:\n"
    "    time.sleep(0.02)\n"
    "    st.commit()\n";

bool ThisProcessHasThread(const std::string& name) {
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::string comm = ReadFile(t.path().string() + "/comm");
    if (!comm.empty() && comm.back() == '\n') comm.pop_back();
    if (comm == name) return true;
  }
  return false;
}

TEST(AgentPersist, TheAgentPersistsWhileTheWorkerOnlyCommits) {
  Node node;
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "200"}});
  const std::string report = node.dir.path() + "/threads";
  node.rdzv.Push(Round(0, 1, 1));
  node.Run(Worker("for i in range(1, 6):\n"
                  "    st.step = i\n"
                  "    st.commit()\n" +
                  ReportThreads(report) + kWaitForStop));
  ASSERT_TRUE(WaitUntil([&] { return node.StoredStep() == std::optional<int64_t>(5); }, 60s))
      << "stored step " << node.StoredStep().value_or(-1);
  ASSERT_TRUE(WaitUntil([&] { return !ReadFile(report).empty(); }, 30s));
  const std::string threads = ReadFile(report);
  EXPECT_EQ(threads.rfind("1 ", 0), 0u) << threads;              // EFDL_AGENT_PERSISTS=1
  EXPECT_EQ(threads.find("efdl-persist"), std::string::npos) << threads;  // no persister there
  EXPECT_TRUE(ThisProcessHasThread("efdl-persist"));              // it runs in the agent
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
  EXPECT_EQ(node.rdzv.failures(), 0);
}

TEST(AgentPersist, AWorkerKilledRightAfterItsCommitStillGetsThatSnapshotPersisted) {
  Node node;
  // The first write happens at once; the step-7 commit can only reach storage after the worker
  // is dead, through the agent's background persister.
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "1500"}});
  node.rdzv.Push(Round(0, 1, 1));
  node.Run(Worker("for i in range(1, 8):\n"
                  "    st.step = i\n"
                  "    st.commit()\n"
                  "os.kill(os.getpid(), signal.SIGKILL)\n"));
  ASSERT_TRUE(WaitUntil([&] { return node.rdzv.failures() == 1; }, 60s)) << "the worker died";
  EXPECT_EQ(node.MemoryStep(), std::optional<int64_t>(7));
  EXPECT_TRUE(WaitUntil([&] { return node.StoredStep() == std::optional<int64_t>(7); }, 30s))
      << "stored step " << node.StoredStep().value_or(-1);
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
}

TEST(AgentPersist, SigtermAfterTheWorkersCrashedStillPersistsTheirNewestCommit) {
  Node node;
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "600000"}});
  node.rdzv.Push(Round(0, 1, 1));
  // Step 1 is persisted at once; steps 2..7 are held back by the rate limit, then it dies.
  node.Run(Worker("st.step = 1\n"
                  "st.commit()\n"
                  "d = os.path.join(os.environ['EFDL_SNAPSHOT_DIR'], os.environ['EFDL_JOB_ID'])\n"
                  "while not (os.path.isdir(d) and\n"
                  "           any(n.startswith('snap-') for n in os.listdir(d))):\n"
                  "    time.sleep(0.02)\n"
                  "for i in range(2, 8):\n"
                  "    st.step = i\n"
                  "    st.commit()\n"
                  "os.kill(os.getpid(), signal.SIGKILL)\n"));
  ASSERT_TRUE(WaitUntil([&] { return node.rdzv.failures() == 1; }, 60s)) << "the worker died";
  EXPECT_EQ(node.StoredStep(), std::optional<int64_t>(1));
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
  EXPECT_EQ(node.StoredStep(), std::optional<int64_t>(7)) << "no workers ran at the SIGTERM";
}

TEST(AgentPersist, SigtermToTheAgentPersistsTheNewestSnapshotBeforeItExits) {
  Node node;
  // Rate limit far beyond the test: after the first write only the stop can persist.
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "600000"}});
  node.rdzv.Push(Round(0, 1, 1));
  node.Run(Worker(kCommitForever));
  ASSERT_TRUE(WaitUntil([&] { return node.MemoryStep().value_or(0) >= 20; }, 60s));
  const auto early = node.StoredStep();
  ASSERT_TRUE(early.has_value());
  ASSERT_LT(*early, 20);
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
  const auto memory = node.MemoryStep();
  ASSERT_TRUE(memory.has_value());
  EXPECT_GE(*memory, 20);
  EXPECT_EQ(node.StoredStep(), memory) << "the worker's final commit reached storage";
}

TEST(AgentPersist, ASuspendReportsTheStepOfTheWorkersFinalCommit) {
  Node node;
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "600000"},
                 {"EFDL_SNAPSHOT_HMAC", "1"}});
  node.rdzv.Push(Round(0, 1, 1));
  node.Run(Worker(kCommitForever));
  ASSERT_TRUE(WaitUntil([&] { return node.MemoryStep().value_or(0) >= 20; }, 60s));
  Event suspend;
  suspend.type = Event::Type::kSuspended;
  suspend.round = 1;
  suspend.graceful = true;
  suspend.message = "test";
  node.rdzv.Push(suspend);
  node.thread.join();
  EXPECT_EQ(node.exit_code, 0);
  // A suspended job's arenas are removed (a resume restores from storage): the final commit
  // is known from storage only, which is what the report must say.
  EXPECT_FALSE(node.MemoryStep().has_value()) << "the suspended job's arena was removed";
  const auto stored = node.StoredStep();
  ASSERT_TRUE(stored.has_value());
  EXPECT_GE(*stored, 20);
  ASSERT_EQ(node.rdzv.suspended().size(), 1u);
  EXPECT_EQ(node.rdzv.suspended()[0], stored) << "workers' final commit -> persisted -> report";
  // EFDL_SNAPSHOT_HMAC=1: the agent signed it with the job's secret.
  snapshot::SnapshotStore store(snapshot::Env::Posix(), node.storage + "/pj", 2);
  auto entries = store.List();
  ASSERT_FALSE(entries.empty());
  auto info = store.ReadInfo(entries.front().path);
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->manifest.hmac.size(), 64u);
}

TEST(AgentPersist, PerRankStatesArePersistedForEveryLocalRankAndOnlyRankZerosNodeCopy) {
  {
    Node node;  // per rank: node rank 1 of 2 persists its ranks 2 and 3
    ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_SNAPSHOT_PER_RANK", "1"},
                   {"EFDL_PERSIST_MIN_INTERVAL_MS", "0"}});
    node.rdzv.Push(Round(2, 2, 4));
    node.Run(Worker(std::string("st.step = 10 + int(os.environ['RANK'])\nst.commit()\n") +
                    kWaitForStop),
             /*nproc=*/2);
    EXPECT_TRUE(WaitUntil([&] {
      return node.StoredStep("/rank-2") == std::optional<int64_t>(12) &&
             node.StoredStep("/rank-3") == std::optional<int64_t>(13);
    }, 60s));
    node.Stop(SIGTERM);
  }
  {
    Node node;  // node copy on node rank 1: memory only, storage is the rank-0 node's
    ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "0"}});
    node.rdzv.Push(Round(1, 1, 2));
    node.Run(Worker(std::string("st.step = 10\nst.commit()\n") + kWaitForStop));
    ASSERT_TRUE(WaitUntil([&] { return node.MemoryStep() == std::optional<int64_t>(10); }, 60s));
    EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
    EXPECT_FALSE(node.StoredStep().has_value());
    EXPECT_FALSE(std::filesystem::exists(node.storage + "/pj"));
  }
}

// The worker commits step 1 and (wait_stored) waits until it is in storage (the first write is at
// once), commits 2..5 (held back by the rate limit), calls flush() and writes what it returned
// (or raised) to `marker`.
std::string FlushAfterHeldBackCommits(const std::string& marker, bool wait_stored = true) {
  return std::string("st.step = 1\n"
         "st.commit()\n"
         "d = os.path.join(os.environ['EFDL_SNAPSHOT_DIR'], os.environ['EFDL_JOB_ID'])\n") +
         (wait_stored ? "while not (os.path.isdir(d) and\n"
                        "           any(n.startswith('snap-') for n in os.listdir(d))):\n"
                        "    time.sleep(0.02)\n" : "") +
         "for i in range(2, 6):\n"
         "    st.step = i\n"
         "    st.commit()\n"
         "try:\n"
         "    st.flush(timeout=20)\n"
         "    out = 'flushed'\n"
         "except Exception as e:\n"
         "    out = '%s: %s' % (type(e).__name__, e)\n"
         "open('" + marker + ".tmp', 'w').write(out)\n"
         "os.rename('" + marker + ".tmp', '" + marker + "')\n" +
         kWaitForStop;
}

TEST(AgentPersist, FlushInAWorkerReturnsOnceTheAgentHasStoredItsNewestCommit) {
  Node node;
  // Rate limit far beyond the test: only the flush can store steps 2..5 while the worker runs.
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "600000"}});
  const std::string marker = node.dir.path() + "/flushed";
  node.rdzv.Push(Round(0, 1, 1));
  node.Run(Worker(FlushAfterHeldBackCommits(marker)));
  ASSERT_TRUE(WaitUntil([&] { return !ReadFile(marker).empty(); }, 60s));
  EXPECT_EQ(ReadFile(marker), "flushed");
  EXPECT_EQ(node.StoredStep(), std::optional<int64_t>(5)) << "flush() returned before the write";
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
  EXPECT_EQ(node.rdzv.failures(), 0);
}

TEST(AgentPersist, FlushReportsTheAgentsStorageFailureToTheWorker) {
  Node node;
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "600000"}});
  // The job's storage directory cannot be created: a file is in its place.
  { std::ofstream(node.storage + "/pj") << "not a directory"; }
  const std::string marker = node.dir.path() + "/flushed";
  node.rdzv.Push(Round(0, 1, 1));
  node.Run(Worker(FlushAfterHeldBackCommits(marker, /*wait_stored=*/false)));
  ASSERT_TRUE(WaitUntil([&] { return !ReadFile(marker).empty(); }, 60s));
  const std::string out = ReadFile(marker);
  EXPECT_EQ(out.rfind("SnapshotError: flush: the agent could not persist the snapshot: ", 0), 0u)
      << out;
  EXPECT_NE(out.find("/pj"), std::string::npos) << "names the storage path: " << out;
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
}

TEST(AgentPersist, FlushOnANodeThatDoesNotStoreTheNodeCopyReturnsWithoutWriting) {
  Node node;  // node rank 1 of 2: the rank-0 node stores the (same) node copy
  ScopedEnv env({{"EFDL_SHM_DIR", node.shm}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "0"}});
  const std::string marker = node.dir.path() + "/flushed";
  node.rdzv.Push(Round(1, 1, 2));
  node.Run(Worker("st.step = 3\n"
                  "st.commit()\n"
                  "st.flush(timeout=20)\n"
                  "open('" + marker + "', 'w').write('returned')\n" +
                  kWaitForStop));
  ASSERT_TRUE(WaitUntil([&] { return ReadFile(marker) == "returned"; }, 60s));
  EXPECT_EQ(node.MemoryStep(), std::optional<int64_t>(3));
  EXPECT_FALSE(std::filesystem::exists(node.storage + "/pj"));
  EXPECT_EQ(node.Stop(SIGTERM), 128 + SIGTERM);
}

TEST(AgentPersistTargets, FollowStateArenaNamesAndTheRankZeroRule) {
  AgentPersisterOptions o;
  o.job_id = "job.1";
  o.holder = "host_a.0";
  o.shm_dir = "/dev/shm";
  o.snapshot_dir = "/snap";
  EXPECT_EQ(PersistTargetsFor(o, 0, 2),
            (std::vector<PersistTarget>{{"/dev/shm/efdl-job.1-host_a.0-node.arena", "/snap/job.1"}}));
  EXPECT_TRUE(PersistTargetsFor(o, 2, 2).empty());
  EXPECT_TRUE(PersistTargetsFor(o, 0, 0).empty());  // standby
  o.per_rank = true;
  EXPECT_EQ(PersistTargetsFor(o, 2, 2),
            (std::vector<PersistTarget>{
                {"/dev/shm/efdl-job.1-host_a.0-rank2.arena", "/snap/job.1/rank-2"},
                {"/dev/shm/efdl-job.1-host_a.0-rank3.arena", "/snap/job.1/rank-3"}}));
  o.snapshot_dir.clear();
  EXPECT_TRUE(PersistTargetsFor(o, 0, 2).empty());
}

TEST(AgentPersistTargets, BadSettingsGetOneLineNamingTheVariable) {
  std::map<std::string, std::string> vars = {{"EFDL_SNAPSHOT_KEEP", "two"}};
  auto lookup = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  auto r = AgentPersisterOptionsFromEnvironment("j", "n", "/s", "secret", lookup);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("EFDL_SNAPSHOT_KEEP='two' is not an integer"),
            std::string::npos) << r.status().message();
  vars = {{"EFDL_SNAPSHOT_HMAC", "yes"}};
  r = AgentPersisterOptionsFromEnvironment("j", "n", "/s", "", lookup);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("EFDL_SNAPSHOT_HMAC=1 needs the job's secret"),
            std::string::npos);
  vars = {{"EFDL_SNAPSHOT_HMAC", " On "}, {"EFDL_PERSIST_MIN_INTERVAL_MS", " 250 "},
          {"EFDL_SHM_DIR", "/x"}, {"EFDL_SNAPSHOT_PER_RANK", "1"}};
  r = AgentPersisterOptionsFromEnvironment("j", "n", "/s", "secret", lookup);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->hmac_key, "secret");
  EXPECT_EQ(r->min_interval, 250ms);
  EXPECT_EQ(r->shm_dir, "/x");
  EXPECT_TRUE(r->per_rank);
  EXPECT_EQ(r->keep, 2);
}

}  // namespace
}  // namespace efdl::agent
