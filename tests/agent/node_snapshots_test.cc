// NodeSnapshots alone (issue #31 step 1; docs/snapshots.md): real arenas in a temporary shared
// memory directory (EFDL_SHM_DIR through its injected getenv), real snapshot files in a
// temporary storage directory, no Agent.
#include "agent/node_snapshots.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "efdl/snapshot.h"
#include "queued_rendezvous.h"
#include "snapshot/arena_dir.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

namespace fs = std::filesystem;
using snapshot::ArenaPath;

class NodeSnapshotsTest : public TempDirTest {
 protected:
  NodeSnapshotsTest() : TempDirTest("node-snapshots-test") {}
  void SetUpInDir() override {
    shm_ = dir_.path() + "/shm";
    store_ = dir_.path() + "/store";
    fs::create_directories(shm_);
    fs::create_directories(store_);
  }
  // Job "j" on node "n1", writing to store_ unless `persist` is false (--launcher).
  NodeSnapshots::Config Config(bool persist = true) {
    NodeSnapshots::Config c;
    c.job_id = "j";
    c.node_id = "n1";
    c.snapshot_dir = store_;
    c.persist = persist;
    c.getenv = [this](const char* name) -> const char* {
      return std::strcmp(name, "EFDL_SHM_DIR") == 0 ? shm_.c_str() : nullptr;
    };
    return c;
  }
  // A real arena of job `job` with `commits` committed snapshots (steps 0..commits-1).
  static void MakeArena(const std::string& path, const std::string& job, int commits) {
    snapshot::EngineOptions o;
    o.job_id = job;
    o.arena_path = path;
    o.commit_checksum = true;
    auto engine = snapshot::SnapshotEngine::Open(o);
    ASSERT_TRUE(engine.ok()) << engine.status().message();
    std::vector<float> data(1024, 1.0f);
    ASSERT_TRUE((*engine)->SetLayout({{"t", "float32", {1024}, 0, 4096}}).ok());
    for (int i = 0; i < commits; ++i) {
      ASSERT_TRUE((*engine)->Commit({{data.data()}}, i, "{}").ok());
    }
  }

  std::string shm_, store_;
  testing::QueuedRendezvous rdzv_;
};

TEST_F(NodeSnapshotsTest, OpenTakesOverThePredecessorsArenaAndRemovesOtherJobsDeadOnes) {
  const std::string predecessor = ArenaPath(shm_, "j", "gone.1", "node");   // no live holder
  const std::string other_job = ArenaPath(shm_, "k", "gone.0", "node");
  MakeArena(predecessor, "j", 2);
  MakeArena(other_job, "k", 1);
  NodeSnapshots snapshots(Config(), rdzv_);
  ASSERT_TRUE(snapshots.Open().ok());
  const std::string own = ArenaPath(shm_, "j", snapshots.holder(), "node");
  EXPECT_TRUE(fs::exists(own)) << "the predecessor's arena is this holder's now";
  EXPECT_FALSE(fs::exists(predecessor));
  EXPECT_FALSE(fs::exists(other_job));
  EXPECT_TRUE(fs::exists(snapshot::HolderLockPath(shm_, "j", snapshots.holder())));
  // The job completes: its arenas and this holder's lock file go.
  snapshots.RemoveJobArenas();
  EXPECT_FALSE(fs::exists(own));
  EXPECT_FALSE(fs::exists(snapshot::HolderLockPath(shm_, "j", snapshots.holder())));
}

TEST_F(NodeSnapshotsTest, TheRound0NodeWritesTheNewestSnapshotWhenAsked) {
  NodeSnapshots snapshots(Config(), rdzv_);
  ASSERT_TRUE(snapshots.Open().ok());
  MakeArena(ArenaPath(shm_, "j", snapshots.holder(), "node"), "j", 3);
  EXPECT_FALSE(snapshots.NewestStored());
  snapshots.SetRound(/*rank_offset=*/0, /*nproc=*/1);   // hosts global rank 0: the writer
  snapshots.PersistNewest("the test");
  const auto stored = snapshots.NewestStored();
  ASSERT_TRUE(stored);
  EXPECT_EQ(stored->seq, 3u);
  EXPECT_EQ(stored->step, 2);
}

TEST_F(NodeSnapshotsTest, NothingIsWrittenOnceNotAMemberOrWithoutAPersister) {
  {
    NodeSnapshots snapshots(Config(), rdzv_);
    ASSERT_TRUE(snapshots.Open().ok());
    snapshots.SetRound(0, 1);
    snapshots.StopWriting();   // fenced: storage is not this node's to write
    MakeArena(ArenaPath(shm_, "j", snapshots.holder(), "node"), "j", 2);
    snapshots.PersistNewest("the test");
    EXPECT_FALSE(snapshots.NewestStored());
    snapshots.RemoveJobArenas();
  }
  NodeSnapshots launcher(Config(/*persist=*/false), rdzv_);   // its workers persist themselves
  ASSERT_TRUE(launcher.Open().ok());
  MakeArena(ArenaPath(shm_, "j", launcher.holder(), "node"), "j", 2);
  launcher.SetRound(0, 1);
  launcher.PersistNewest("the test");
  EXPECT_FALSE(launcher.NewestStored());
  launcher.RemoveJobArenas();
}

}  // namespace
}  // namespace efdl::agent
